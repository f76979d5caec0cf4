// Upstream's C++ class mooncake::tent::TransferEngine (tent/transfer_engine.h under C++), used
// the way upstream's callers use it, between two processes over TCP on 127.0.0.1: a Config
// given as std::shared_ptr, memory registered, the peer opened by name, batches of WRITE and
// READ with every byte checked, per-task, list and overall status, notifications both ways,
// probes of a live and of a dead peer, and bad input answered with upstream's Status codes.
// Built as C++20 (as Mooncake Store builds), with warnings as errors.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "tent/transfer_engine.h"
#include "tent/common/config.h"
#include "check.h"

using namespace mooncake::tent;

namespace {

constexpr size_t kPeerLen = 16u << 20;
constexpr size_t kPart = 1u << 20;
constexpr int kParts = 8;

// Writes or reads exactly `n` bytes on a pipe; false when the other side is gone.
bool put(int fd, const void* p, size_t n) { return write(fd, p, n) == static_cast<ssize_t>(n); }
bool get(int fd, void* p, size_t n) { return read(fd, p, n) == static_cast<ssize_t>(n); }

std::shared_ptr<Config> loopbackConfig() {
    auto config = std::make_shared<Config>();
    config->set("metadata_type", "p2p");
    config->set("rpc_server_hostname", "127.0.0.1");
    config->set("transports/tcp/retry_base_delay_ms", 20);
    return config;
}

// Polls until `want` notifications arrived (bounded: a lost one fails the check, never hangs).
std::vector<Notification> awaitNotifications(TransferEngine& engine, size_t want) {
    std::vector<Notification> all, got;
    for (int i = 0; i < 10000 && all.size() < want; ++i) {
        if (!engine.receiveNotification(got).ok()) break;
        all.insert(all.end(), got.begin(), got.end());
        if (all.size() < want) usleep(1000);
    }
    return all;
}

bool has(const std::vector<Notification>& list, const char* name, const char* msg) {
    for (const auto& n : list)
        if (n.name == name && n.msg == msg) return true;
    return false;
}

// The peer process: one engine with a registered buffer; it reports its segment name, then,
// told the parent's name, waits for the parent's two notifications and answers with one of its
// own, then serves until killed. Exit codes above 1 say which step failed.
[[noreturn]] void peer(int to_parent, int from_parent) {
    TransferEngine engine(loopbackConfig());
    void* buf = nullptr;
    if (!engine.available()) _exit(2);
    if (!engine.allocateLocalMemory(&buf, kPeerLen).ok() || !engine.registerLocalMemory(buf, kPeerLen).ok()) _exit(3);
    std::memset(buf, 0, kPeerLen);
    char name[256] = {0};
    std::snprintf(name, sizeof name, "%s", engine.getSegmentName().c_str());
    if (!put(to_parent, name, sizeof name)) _exit(4);
    char parent_name[256] = {0};
    if (!get(from_parent, parent_name, sizeof parent_name)) _exit(5);
    std::vector<Notification> notes = awaitNotifications(engine, 2);
    char verdict = has(notes, "from-parent", "hi") && has(notes, "parent-batch", "done") ? 'y' : 'n';
    SegmentID parent = 0;
    if (!engine.openSegment(parent, parent_name).ok()) verdict = 'o';
    if (!engine.sendNotification(parent, Notification{"from-peer", "hello"}).ok()) verdict = 's';
    if (!put(to_parent, &verdict, 1)) _exit(6);
    for (;;) pause();
}

// Waits for every task of the batch to end; the overall status at the end.
TransferStatus awaitBatch(TransferEngine& engine, BatchID batch) {
    TransferStatus overall{PENDING, 0};
    for (int i = 0; i < 60000; ++i) {
        if (!engine.getTransferStatus(batch, overall).ok() || overall.s != PENDING) break;
        usleep(1000);
    }
    return overall;
}

void statusBasics() {
    Status ok = Status::OK();
    CHECK(ok.ok());
    CHECK(ok.message().empty());
    CHECK_EQ(ok.ToString() == "OK", 1);
    Status bad = Status::InvalidArgument("no such batch");
    CHECK(!bad.ok() && bad.IsInvalidArgument() && !bad.IsInternalError());
    CHECK_EQ(static_cast<int>(bad.code()), 1);
    CHECK(bad.ToString() == "InvalidArgument: no such batch");
    Status copy = bad;
    CHECK(copy == bad && copy.message() == "no such batch");
    Status moved = std::move(copy);
    CHECK(moved == bad);
    CHECK(copy.ok());  // a moved-from status is OK, as upstream's
    copy = moved;
    CHECK(copy == moved && copy != ok);
    CHECK(Status(Status::Code::kOk, "ignored").message().empty());
    CHECK(Status::CodeToString(Status::Code::kNeedsRefreshCache) == "NeedsRefreshCache");
    CHECK_EQ(static_cast<int>(Status::NotImplemented("x").code()), 200);
    CHECK_EQ(static_cast<int>(Status::Code::kRpcServiceError), 132);
    std::ostringstream os;
    os << Status::Code::kTooManyRequests << "|" << Status::MetadataError("m");
    CHECK(os.str() == "TooManyRequests|MetadataError: m");
    CHECK(parseTransportType("io_uring") == IOURING && parseTransportType("nope") == UNSPEC);
    CHECK(std::string(transportTypeName(TCP)) == "tcp");
    CHECK_EQ(static_cast<int>(TCP), TRANSPORT_TCP);
    CHECK_EQ(static_cast<int>(COMPLETED), STATUS_COMPLETED);
    CHECK_EQ(static_cast<int>(kGlobalReadOnly), PERM_GLOBAL_READ_ONLY);
    Request r{};
    CHECK(r.priority == PRIO_HIGH && r.transport_hint == UNSPEC && r.deadline_ns == 0 && !r.policy_name);
    MemoryOptions mo;
    CHECK(mo.location == kWildcardLocation && mo.perm == kGlobalReadWrite && !mo.internal);
}

void configBasics() {
    Config c;
    c.set("local_segment_name", "seg");
    c.set("rpc_server_port", 17);
    c.set("transports/tcp/enable", false);
    c.set("topology/rdma_whitelist", std::vector<std::string>{"mlx5_0", "say \"hi\""});
    c.set("ratio", 0.5);
    c.setFromString("flag", "TRUE");
    CHECK(c.get("local_segment_name", "") == "seg");
    CHECK_EQ(c.get<int>("rpc_server_port", 0), 17);
    CHECK_EQ(c.get<bool>("transports/tcp/enable", true), 0);
    CHECK_EQ(c.get<bool>("flag", false), 1);
    CHECK(c.get<double>("ratio", 0.0) == 0.5);
    auto list = c.getArray<std::string>("topology/rdma_whitelist");
    CHECK(list.size() == 2 && list[0] == "mlx5_0" && list[1] == "say \"hi\"");
    CHECK(c.contains("transports/tcp") && !c.contains("transports/rdma"));
    CHECK_EQ(c.get<int>("local_segment_name", -3), -3);  // a string is not an int
    CHECK(c.get("missing", "dflt") == "dflt");
    std::string sub;
    CHECK(c.dumpSubtree("transports", &sub) && sub.find("\"enable\"") != std::string::npos);
    CHECK(c.dump().find("rdma_whitelist") != std::string::npos);
    Status s = c.load("{not json");
    CHECK(s.IsInvalidArgument() && !s.message().empty());
    CHECK(c.get("local_segment_name", "") == "seg");  // a failed load changes nothing
    CHECK(c.loadFile("/nonexistent/tent-class.json").IsInvalidArgument());
    CHECK(c.load("{\"a\": {\"b\": 3}}").ok());
    CHECK_EQ(c.get<int>("a/b", 0), 3);
    CHECK(!c.contains("local_segment_name"));
}

// The config-file constructor: a file's settings apply; a missing file gives the defaults.
void configFileConstructor() {
    char path[] = "/tmp/tent_class_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    if (fd < 0) return;
    close(fd);
    {
        std::ofstream f(path);
        f << "{\"rpc_server_hostname\": \"127.0.0.1\", \"metadata_type\": \"p2p\"}";
    }
    {
        TransferEngine e{std::string(path)};
        CHECK(e.available());
        CHECK(e.getRpcServerAddress() == "127.0.0.1");
        CHECK(e.getRpcServerPort() != 0);
    }
    unlink(path);
    TransferEngine defaults{std::string("/nonexistent/tent-class.json")};
    CHECK(defaults.available());
}

// Request::deadline_ns reaches the engine: with the admission queue on and dropping late work,
// a request whose steady_clock deadline passed ends CANCELED without moving a byte; one with a
// deadline ahead completes, also when submitted with a notification.
void deadlines() {
    auto config = loopbackConfig();
    config->set("enable_runtime_queue", true);
    config->set("runtime_queue/deadline_aware", true);
    config->set("runtime_queue/mlu_local_threshold", 1.0);
    TransferEngine engine(config);
    CHECK(engine.available());
    if (!engine.available()) return;
    std::vector<char> src(2 * kPart, 's'), dst(2 * kPart, 0);
    CHECK(engine.registerLocalMemory({src.data(), dst.data()}, {src.size(), dst.size()}).ok());
    const uint64_t now = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count());
    Request late{.opcode = Request::WRITE,
                 .source = src.data(),
                 .target_id = LOCAL_SEGMENT_ID,
                 .target_offset = reinterpret_cast<uint64_t>(dst.data()),
                 .length = kPart};
    late.deadline_ns = now - 1000000;
    Request on_time = late;
    on_time.source = src.data() + kPart;
    on_time.target_offset += kPart;
    on_time.deadline_ns = now + 600000000000ull;
    BatchID batch = engine.allocateBatch(3);
    CHECK(engine.submitTransfer(batch, {late, on_time}).ok());
    awaitBatch(engine, batch);
    TransferStatus a{PENDING, 0}, b{PENDING, 0};
    CHECK(engine.getTransferStatus(batch, 0, a).ok() && a.s == CANCELED);
    CHECK(engine.getTransferStatus(batch, 1, b).ok() && b.s == COMPLETED);
    CHECK(engine.getTransferError(batch, 0).find("deadline") != std::string::npos);
    CHECK(engine.getTransferError(batch, 1).empty());
    CHECK(dst[0] == 0 && dst[kPart] == 's');
    std::vector<Request> notified{on_time};
    CHECK(engine.submitTransfer(batch, notified, Notification{"deadline", "met"}).ok());
    TransferStatus c{PENDING, 0};
    for (int i = 0; i < 60000 && c.s == PENDING; ++i) {
        if (!engine.getTransferStatus(batch, 2, c).ok()) break;
        if (c.s == PENDING) usleep(1000);
    }
    CHECK_EQ(c.s, COMPLETED);
    CHECK(has(awaitNotifications(engine, 1), "deadline", "met"));
    CHECK(engine.freeBatch(batch).ok());
    CHECK(engine.unregisterLocalMemory({src.data(), dst.data()}).ok());
}

}  // namespace

int main() {
    statusBasics();
    configBasics();
    configFileConstructor();
    deadlines();

    int up[2], down[2];
    CHECK(pipe(up) == 0 && pipe(down) == 0);
    pid_t child = fork();
    if (child == 0) {
        close(up[0]);
        close(down[1]);
        peer(up[1], down[0]);
    }
    close(up[1]);
    close(down[0]);
    char peer_name[256] = {0};
    CHECK(get(up[0], peer_name, sizeof peer_name));

    TransferEngine engine(loopbackConfig());
    CHECK(engine.available());
    const std::string own_name = engine.getSegmentName();
    CHECK(!own_name.empty());
    CHECK(engine.getRpcServerAddress() == "127.0.0.1");
    CHECK(engine.getRpcServerPort() != 0);
    CHECK(own_name == "127.0.0.1:" + std::to_string(engine.getRpcServerPort()));
    const std::string topo = engine.getLocalTopologyString();
    CHECK(topo.find("\"nics\"") != std::string::npos && topo.find("\"mems\"") != std::string::npos);
    CHECK(engine.getLocalTopology() == nullptr);
    std::string shared;
    CHECK(engine.exportLocalSegment(shared).IsNotImplemented());
    SegmentID imported = 0;
    CHECK(engine.importRemoteSegment(imported, shared).IsNotImplemented());
    std::vector<NicLoadStats> nic_stats{NicLoadStats{}};
    CHECK(engine.getNicLoadStats(nic_stats).ok() && nic_stats.empty());

    // Open by name; the engine's own name is the local segment.
    SegmentID self = 99;
    CHECK(engine.openSegment(self, own_name).ok());
    CHECK_EQ(self, LOCAL_SEGMENT_ID);
    SegmentID h = 0;
    CHECK(engine.openSegment(h, peer_name).ok());
    CHECK(h != LOCAL_SEGMENT_ID);
    SegmentInfo info;
    CHECK(engine.getSegmentInfo(h, info).ok());
    CHECK(info.type == SegmentInfo::Memory);
    CHECK_EQ(info.buffers.size(), 1);
    const uint64_t base = info.buffers.empty() ? 0 : info.buffers[0].base;
    CHECK(!info.buffers.empty() && info.buffers[0].length == kPeerLen);
    CHECK(engine.probePeerAliveByID(h).ok());
    CHECK(engine.probePeerAliveByID(LOCAL_SEGMENT_ID).ok());

    // Local memory: one block allocated by the engine, one from malloc, registered together.
    void* src_mem = nullptr;
    CHECK(engine.allocateLocalMemory(&src_mem, kParts * kPart).ok());
    char* src = static_cast<char*>(src_mem);
    char* back = static_cast<char*>(std::malloc(kParts * kPart));
    if (!src || !back) return check_report("tent_class");
    for (size_t i = 0; i < kParts * kPart; ++i) src[i] = static_cast<char>(i * 7 + (i >> 13));
    std::memset(back, 0, kParts * kPart);
    CHECK(engine.registerLocalMemory({src, back}, {kParts * kPart, kParts * kPart}).ok());

    // WRITE 8 x 1 MiB, then READ them back, in one batch; every byte compared.
    BatchID batch = engine.allocateBatch(32);
    CHECK(batch != 0);
    std::vector<Request> writes;
    for (int i = 0; i < kParts; ++i)
        writes.push_back(Request{.opcode = Request::WRITE,
                                 .source = src + i * kPart,
                                 .target_id = h,
                                 .target_offset = base + static_cast<uint64_t>(i) * 2 * kPart,
                                 .length = kPart,
                                 .transport_hint = TCP});
    CHECK(engine.submitTransfer(batch, writes).ok());
    TransferStatus overall = awaitBatch(engine, batch);
    CHECK_EQ(overall.s, COMPLETED);
    for (int i = 0; i < kParts; ++i) {
        TransferStatus st{PENDING, 0};
        CHECK(engine.getTransferStatus(batch, static_cast<size_t>(i), st).ok());
        CHECK_EQ(st.s, COMPLETED);
        CHECK_EQ(st.transferred_bytes, kPart);
    }
    std::vector<Request> reads = writes;
    for (int i = 0; i < kParts; ++i) {
        reads[i].opcode = Request::READ;
        reads[i].source = back + i * kPart;
    }
    CHECK(engine.submitTransfer(batch, reads).ok());
    overall = awaitBatch(engine, batch);
    CHECK_EQ(overall.s, COMPLETED);
    CHECK_EQ(overall.transferred_bytes, 2 * kParts * kPart);
    CHECK(std::memcmp(src, back, kParts * kPart) == 0);
    std::vector<TransferStatus> list;
    CHECK(engine.getTransferStatus(batch, list).ok());
    CHECK_EQ(list.size(), 2 * kParts);
    size_t completed = 0;
    for (const auto& st : list) completed += st.s == COMPLETED && st.transferred_bytes == kPart;
    CHECK_EQ(completed, 2 * kParts);
    TransferStatus progressed{PENDING, 0};
    CHECK(engine.progressBatch(batch, progressed).ok());
    CHECK_EQ(progressed.s, COMPLETED);
    CHECK(engine.cancelTransfer(batch, 0).ok());  // an ended task stays as it is
    TransferStatus first{PENDING, 0};
    CHECK(engine.getTransferStatus(batch, 0, first).ok() && first.s == COMPLETED);
    CHECK(engine.getTransferError(batch, 0).empty());
    CHECK(engine.freeBatch(batch).ok());

    // Notifications both ways: one sent directly, one with a batch; the peer answers.
    CHECK(engine.sendNotification(h, Notification{"from-parent", "hi"}).ok());
    BatchID nb = engine.allocateBatch(1);
    std::vector<Request> one{writes[0]};
    CHECK(engine.submitTransfer(nb, one, Notification{"parent-batch", "done"}).ok());
    CHECK_EQ(awaitBatch(engine, nb).s, COMPLETED);
    CHECK(engine.freeBatch(nb).ok());
    char name_buf[256] = {0};
    std::snprintf(name_buf, sizeof name_buf, "%s", own_name.c_str());
    CHECK(put(down[1], name_buf, sizeof name_buf));
    char verdict = 0;
    CHECK(get(up[0], &verdict, 1));
    CHECK_EQ(verdict, 'y');
    std::vector<Notification> notes = awaitNotifications(engine, 1);
    CHECK(has(notes, "from-peer", "hello"));

    // Bad input: upstream's codes, with the library's message.
    SegmentInfo none;
    Status s = engine.getSegmentInfo(987654, none);
    CHECK(s.IsInvalidArgument());
    CHECK(!s.message().empty());
    CHECK(s.ToString().rfind("InvalidArgument: ", 0) == 0);
    CHECK(engine.closeSegment(987654).IsInvalidArgument());
    CHECK(engine.freeBatch(0).IsInvalidArgument());
    TransferStatus st{PENDING, 0};
    CHECK(engine.getTransferStatus(0xdead0, 0, st).IsInvalidArgument());
    CHECK(engine.getTransferStatus(0xdead0, list).IsInvalidArgument());
    CHECK(engine.getTransferStatus(0xdead0, st).IsInvalidArgument());
    CHECK(engine.cancelTransfer(0xdead0, 0).IsInvalidArgument());
    CHECK(engine.submitTransfer(0xdead0, writes).IsInvalidArgument());
    BatchID small = engine.allocateBatch(2);
    CHECK(engine.submitTransfer(small, writes).IsTooManyRequests());
    CHECK(engine.getTransferStatus(small, 5, st).IsInvalidArgument());
    // Unregistered memory (a local copy from a loose buffer) and a target outside the peer's
    // buffers: the submit succeeds and those tasks fail.
    std::vector<char> loose(4096, 'x');
    std::vector<Request> wrong{
        Request{.opcode = Request::WRITE,
                .source = loose.data(),
                .target_id = LOCAL_SEGMENT_ID,
                .target_offset = reinterpret_cast<uint64_t>(src),
                .length = 4096},
        Request{.opcode = Request::WRITE, .source = src, .target_id = h, .target_offset = base + kPeerLen, .length = 4096},
    };
    Status ws = engine.submitTransfer(small, wrong);
    if (ws.ok()) {
        TransferStatus t0{PENDING, 0}, t1{PENDING, 0};
        awaitBatch(engine, small);
        CHECK(engine.getTransferStatus(small, 0, t0).ok() && t0.s == FAILED);
        CHECK(engine.getTransferStatus(small, 1, t1).ok() && t1.s == FAILED);
        CHECK_EQ(awaitBatch(engine, small).s, FAILED);
        // tent-rs: each says why.
        CHECK(engine.getTransferError(small, 0).find("not registered") != std::string::npos);
        CHECK(engine.getTransferError(small, 1).find("not inside a registered buffer") != std::string::npos);
        CHECK(engine.getTransferError(small, 2).empty());  // past the batch: nothing
    } else {
        CHECK(ws.IsAddressNotRegistered() || ws.IsInvalidArgument());
    }
    CHECK(engine.freeBatch(small).ok());
    CHECK(engine.registerLocalMemory({src}, {1, 2}).IsInvalidArgument());
    CHECK(engine.unregisterLocalMemory({src}, {1, 2}).IsInvalidArgument());
    CHECK(engine.freeLocalMemory(loose.data()).IsInvalidArgument());
    MemoryOptions long_location;
    long_location.location = std::string(100, 'c');
    CHECK(engine.registerLocalMemory(src, 64, long_location).IsInvalidArgument());
    // A segment nobody serves: opening is lazy (as upstream), using it fails.
    SegmentID ghost = 0;
    CHECK(engine.openSegment(ghost, "127.0.0.1:1").ok());
    CHECK(!engine.getSegmentInfo(ghost, none).ok());
    CHECK(!engine.probePeerAliveByID(ghost).ok());
    CHECK(engine.closeSegment(ghost).ok());

    // The peer dies: probing it fails (NeedsRefreshCache, as upstream reports an RPC failure).
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    Status dead = engine.probePeerAliveByID(h);
    CHECK(!dead.ok());
    CHECK(dead.IsNeedsRefreshCache());

    CHECK(engine.unregisterLocalMemory({src, back}).ok());
    CHECK(engine.freeLocalMemory(src).ok());
    std::free(back);
    return check_report("tent_class");
}
