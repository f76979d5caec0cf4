// What the C++ class mooncake::tent::TransferEngine costs over the plain tent_* C API: the same
// engine, the same peer (a second process over TCP on 127.0.0.1), the same transfers, timed
// through each API in alternating rounds so drift hits both alike.
//
//   tent_class_vs_c [--iters N] [--rounds R]
//
// Workloads: one 1 MiB WRITE per batch, and 32 x 64 KiB WRITEs per batch (allocate the batch,
// submit, poll until done, free it, as upstream's callers do per transfer). Prints, per
// workload, the median time per batch through each API, the throughput, and C++/C as a
// throughput ratio (1.00 = no cost; the goal is >= 0.95).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "tent/transfer_engine.h"
#include "tent/common/config.h"

using namespace mooncake::tent;

namespace {

constexpr size_t kPeerLen = 64u << 20;

[[noreturn]] void peer(int to_parent) {
    tent_set_config("rpc_server_hostname", "127.0.0.1");
    tent_engine_t e = tent_create_engine();
    void* buf = nullptr;
    if (!tent_available(e) || tent_allocate_memory(e, &buf, kPeerLen, "*") || tent_register_memory(e, buf, kPeerLen))
        _exit(2);
    char name[256] = {0};
    tent_segment_name(e, name, sizeof name);
    if (write(to_parent, name, sizeof name) != static_cast<ssize_t>(sizeof name)) _exit(3);
    for (;;) pause();
}

struct Shape {
    const char* name;
    size_t count;
    size_t length;
};

double seconds() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One batch through the C API; false on any failure.
bool runC(tent_engine_t e, tent_request_t* reqs, size_t n) {
    tent_batch_id_t b = tent_allocate_batch(e, n);
    if (b == 0 || b == UINT64_MAX) return false;
    if (tent_submit(e, b, reqs, n) != 0) return false;
    tent_status_t st;
    do {
        if (tent_overall_status(e, b, &st) != 0) return false;
    } while (st.status == STATUS_PENDING);
    bool ok = st.status == STATUS_COMPLETED;
    return tent_free_batch(e, b) == 0 && ok;
}

// The same batch through the class.
bool runCxx(TransferEngine& engine, const std::vector<Request>& reqs) {
    BatchID b = engine.allocateBatch(reqs.size());
    if (b == 0) return false;
    if (!engine.submitTransfer(b, reqs).ok()) return false;
    TransferStatus st{PENDING, 0};
    do {
        if (!engine.getTransferStatus(b, st).ok()) return false;
    } while (st.s == PENDING);
    bool ok = st.s == COMPLETED;
    return engine.freeBatch(b).ok() && ok;
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
    int iters = 200, rounds = 11;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (std::strcmp(argv[i], "--iters") == 0) iters = std::max(1, std::atoi(argv[i + 1]));
        if (std::strcmp(argv[i], "--rounds") == 0) rounds = std::max(1, std::atoi(argv[i + 1]));
    }
    int up[2];
    if (pipe(up) != 0) return 1;
    pid_t child = fork();
    if (child == 0) {
        close(up[0]);
        peer(up[1]);
    }
    close(up[1]);
    char peer_name[256] = {0};
    if (read(up[0], peer_name, sizeof peer_name) != static_cast<ssize_t>(sizeof peer_name)) return 1;

    auto config = std::make_shared<Config>();
    config->set("rpc_server_hostname", "127.0.0.1");
    TransferEngine engine(config);
    tent_engine_t e = engine.native_handle();
    SegmentID h = 0;
    SegmentInfo info;
    if (!engine.available() || !engine.openSegment(h, peer_name).ok() || !engine.getSegmentInfo(h, info).ok() ||
        info.buffers.empty()) {
        std::fprintf(stderr, "setup failed\n");
        kill(child, SIGKILL);
        return 1;
    }
    const uint64_t base = info.buffers[0].base;
    const size_t local_len = 2u << 20;
    void* local = nullptr;
    if (!engine.allocateLocalMemory(&local, local_len).ok() || !engine.registerLocalMemory(local, local_len).ok()) return 1;
    std::memset(local, 0x5a, local_len);

    const Shape shapes[] = {{"write 1 MiB", 1, 1u << 20}, {"write 32 x 64 KiB", 32, 64u << 10}};
    std::printf("%-20s %12s %12s %10s %10s %8s\n", "workload", "C us/batch", "C++ us/batch", "C GiB/s", "C++ GiB/s",
                "C++/C");
    int rc = 0;
    for (const Shape& shape : shapes) {
        std::vector<Request> reqs;
        std::vector<tent_request_t> creqs(shape.count);
        for (size_t i = 0; i < shape.count; ++i) {
            Request r{};
            r.opcode = Request::WRITE;
            r.source = static_cast<char*>(local) + i * shape.length;
            r.target_id = h;
            r.target_offset = base + i * shape.length;
            r.length = shape.length;
            reqs.push_back(r);
            std::memset(&creqs[i], 0, sizeof creqs[i]);
            creqs[i].opcode = OPCODE_WRITE;
            creqs[i].source = r.source;
            creqs[i].target_id = h;
            creqs[i].target_offset = r.target_offset;
            creqs[i].length = r.length;
        }
        // Warm both paths (connections, caches) before timing.
        for (int i = 0; i < std::max(1, iters / 10); ++i) {
            if (!runC(e, creqs.data(), creqs.size()) || !runCxx(engine, reqs)) rc = 1;
        }
        std::vector<double> c_times, cxx_times;
        for (int r = 0; r < rounds && rc == 0; ++r) {
            // Alternate which API goes first, so neither always runs on a warmer system.
            for (int pass = 0; pass < 2; ++pass) {
                bool c_turn = (pass == 0) == (r % 2 == 0);
                double t0 = seconds();
                for (int i = 0; i < iters; ++i) {
                    bool ok = c_turn ? runC(e, creqs.data(), creqs.size()) : runCxx(engine, reqs);
                    if (!ok) rc = 1;
                }
                double per = (seconds() - t0) / iters;
                (c_turn ? c_times : cxx_times).push_back(per);
            }
        }
        if (rc != 0) {
            std::fprintf(stderr, "%s: a transfer failed\n", shape.name);
            break;
        }
        const double bytes = static_cast<double>(shape.count * shape.length);
        const double c = median(c_times), cxx = median(cxx_times);
        std::printf("%-20s %12.1f %12.1f %10.2f %10.2f %8.3f\n", shape.name, c * 1e6, cxx * 1e6,
                    bytes / c / (1u << 30), bytes / cxx / (1u << 30), c / cxx);
    }
    engine.unregisterLocalMemory(local);
    engine.freeLocalMemory(local);
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    return rc;
}
