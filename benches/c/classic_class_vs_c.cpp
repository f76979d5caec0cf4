// What the classic C++ class mooncake::TransferEngine costs over the classic C API: one
// engine, one registered buffer, one 4 KiB WRITE into its own segment per batch (allocate,
// submitTransfer, getTransferStatus until COMPLETED, free), timed through each API in
// alternating rounds so drift hits both alike. Prints the median time per transfer through
// each and the difference (goal: within 1 us).
//
//   classic_class_vs_c [--iters N] [--rounds R]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "mooncake/transfer_engine.h"

using namespace mooncake;
using Clock = std::chrono::steady_clock;

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char** argv) {
    int iters = 2000, rounds = 5;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!std::strcmp(argv[i], "--iters")) iters = std::atoi(argv[i + 1]);
        if (!std::strcmp(argv[i], "--rounds")) rounds = std::atoi(argv[i + 1]);
    }
    TransferEngine cxx(false);
    if (cxx.init(P2PHANDSHAKE, "127.0.0.1") != 0) return 1;
    std::vector<char> buf(1 << 16, 1);
    if (cxx.registerLocalMemory(buf.data(), buf.size()) != 0) return 1;
    SegmentHandle self = cxx.openSegment(cxx.getLocalIpAndPort());
    transfer_engine_t c = createTransferEngine(P2PHANDSHAKE, "127.0.0.1", "", 0, 0);
    if (!c || registerLocalMemory(c, buf.data(), buf.size(), "*", 1) != 0) return 1;
    char name[256];
    getLocalIpAndPort(c, name, sizeof(name));
    segment_id_t cself = openSegment(c, name);
    const uint64_t dst = reinterpret_cast<uint64_t>(buf.data()) + 8192;

    auto run_cxx = [&] {
        auto t0 = Clock::now();
        for (int i = 0; i < iters; ++i) {
            BatchID b = cxx.allocateBatchID(1);
            if (!cxx.submitTransfer(b, {TransferRequest{.opcode = TransferRequest::WRITE,
                                                        .source = buf.data(),
                                                        .target_id = self,
                                                        .target_offset = dst,
                                                        .length = 4096}})
                     .ok())
                std::exit(2);
            TransferStatus st{};
            do {
                if (!cxx.getTransferStatus(b, 0, st).ok()) std::exit(3);
            } while (st.s != TransferStatusEnum::COMPLETED);
            (void)cxx.freeBatchID(b);
        }
        return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / iters;
    };
    auto run_c = [&] {
        auto t0 = Clock::now();
        for (int i = 0; i < iters; ++i) {
            batch_id_t b = allocateBatchID(c, 1);
            transfer_request r{OPCODE_WRITE, buf.data(), cself, dst, 4096};
            if (submitTransfer(c, b, &r, 1) != 0) std::exit(4);
            transfer_status st{};
            do {
                if (getTransferStatus(c, b, 0, &st) != 0) std::exit(5);
            } while (st.status != STATUS_COMPLETED);
            freeBatchID(c, b);
        }
        return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / iters;
    };
    std::vector<double> tc, tx;
    run_c();
    run_cxx();
    for (int r = 0; r < rounds; ++r) {
        tc.push_back(run_c());
        tx.push_back(run_cxx());
    }
    double mc = median(tc), mx = median(tx);
    std::printf("4 KiB write, allocate+submit+status+free: C API %.2f us, C++ class %.2f us, difference %+.2f us\n", mc,
                mx, mx - mc);
    destroyTransferEngine(c);
    return 0;
}
