// A C++17 caller: includes the classic header, then the TENT header, then the RAII wrapper, and
// moves bytes between two engines with each API (write, then read back, every byte verified).
#include "transfer_engine_c.h"
#include "tent/transfer_engine.h"
#include "tent/tent.hpp"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

static int g_failures = 0;
#define EXPECT(cond)                                                                  \
    do {                                                                              \
        if (!(cond)) {                                                                \
            ++g_failures;                                                             \
            std::fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond); \
        }                                                                             \
    } while (0)
#define EXPECT_OK(expr)                                                                         \
    do {                                                                                        \
        tent::Status s_ = (expr);                                                               \
        if (!s_.ok()) {                                                                         \
            ++g_failures;                                                                       \
            std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #expr,          \
                         s_.message().c_str());                                                 \
        }                                                                                       \
    } while (0)

static void with_the_wrapper() {
    const std::vector<std::pair<std::string, std::string>> settings = {
        {"rpc_server_hostname", "127.0.0.1"}, {"log_level", "warning"}};
    tent::Engine a = tent::Engine::create(settings);
    tent::Engine b = tent::Engine::create(settings);
    EXPECT(a.available() && b.available());
    if (!a.available() || !b.available()) return;

    const size_t len = 2u << 20;
    std::vector<unsigned char> src(len), back(len, 0), target(len, 0);
    for (size_t i = 0; i < len; ++i) src[i] = static_cast<unsigned char>(i * 13 + 1);
    tent::RegisteredMemory src_mem, back_mem, target_mem;
    EXPECT_OK(src_mem.reset(a, src.data(), len));
    EXPECT_OK(back_mem.reset(a, back.data(), len));
    EXPECT_OK(target_mem.reset(b, target.data(), len));

    std::string b_name;
    EXPECT_OK(b.segment_name(b_name));
    tent_segment_id_t peer = 0;
    EXPECT_OK(a.open_segment(b_name, peer));
    EXPECT(peer != LOCAL_SEGMENT_ID);

    tent::Batch batch;
    EXPECT_OK(batch.reset(a, 2));
    EXPECT_OK(batch.submit({tent::write(src.data(), peer, target_mem.address(), len)}));
    EXPECT_OK(batch.wait(0, std::chrono::seconds(30)));
    EXPECT(std::memcmp(src.data(), target.data(), len) == 0);
    EXPECT_OK(batch.submit({tent::read(back.data(), peer, target_mem.address(), len)}));
    EXPECT_OK(batch.wait(1, std::chrono::seconds(30)));
    EXPECT(std::memcmp(src.data(), back.data(), len) == 0);

    // Failures come back as a status with the library's reason.
    tent::Batch too_big;
    EXPECT_OK(too_big.reset(a, 1));
    tent::Status s = too_big.submit({tent::write(src.data(), peer, target_mem.address(), 1),
                                     tent::write(src.data(), peer, target_mem.address(), 1)});
    EXPECT(!s.ok() && s.code() == -1 && !s.message().empty());

    // A task that fails says why: Batch::error, and in the message of wait().
    tent::Batch past_end;
    EXPECT_OK(past_end.reset(a, 1));
    EXPECT_OK(past_end.submit({tent::write(src.data(), peer, target_mem.address() + len, 64)}));
    tent::Status failed = past_end.wait(0, std::chrono::seconds(30));
    std::string why = past_end.error(0);
    EXPECT(!failed.ok() && !why.empty());
    EXPECT(failed.message().find(why) != std::string::npos);
    EXPECT(batch.error(0).empty());  // completed

    EXPECT_OK(a.notify(peer, "cpp", "done"));
    std::vector<tent::Notification> notes;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (notes.empty() && std::chrono::steady_clock::now() < deadline) EXPECT_OK(b.receive(notes));
    EXPECT(notes.size() == 1 && notes[0].name == "cpp" && notes[0].message == "done");

    // Moves keep one owner: the moved-from batch frees nothing.
    tent::Batch moved = std::move(batch);
    EXPECT(batch.id() == moved.id());
    EXPECT_OK(batch.release());
    EXPECT_OK(moved.release());
}

static void with_the_classic_api() {
    transfer_engine_t a = createTransferEngine("P2PHANDSHAKE", "127.0.0.1:0", "127.0.0.1", 0, 0);
    transfer_engine_t b = createTransferEngine("P2PHANDSHAKE", "127.0.0.1:0", "127.0.0.1", 0, 0);
    EXPECT(a != nullptr && b != nullptr);
    if (!a || !b) return;
    void *args[1] = {nullptr};
    EXPECT(installTransport(a, "tcp", args) != nullptr);
    const size_t len = 1u << 20;
    std::vector<unsigned char> src(len), target(len, 0);
    for (size_t i = 0; i < len; ++i) src[i] = static_cast<unsigned char>(i ^ 0x5a);
    EXPECT(registerLocalMemory(a, src.data(), len, "cpu:0", 1) == 0);
    EXPECT(registerLocalMemory(b, target.data(), len, "cpu:0", 1) == 0);
    char name[256];
    EXPECT(getLocalIpAndPort(b, name, sizeof name) == 0);
    segment_id_t seg = openSegment(a, name);
    EXPECT(seg > 0);
    batch_id_t batch = allocateBatchID(a, 1);
    EXPECT(batch != INVALID_BATCH);
    transfer_request_t req{};
    req.opcode = OPCODE_WRITE;
    req.source = src.data();
    req.target_id = seg;
    req.target_offset = reinterpret_cast<uintptr_t>(target.data());
    req.length = len;
    EXPECT(submitTransfer(a, batch, &req, 1) == 0);
    transfer_status_t st{};
    do {
        EXPECT(getTransferStatus(a, batch, 0, &st) == 0);
    } while (st.status == STATUS_WAITING || st.status == STATUS_PENDING);
    EXPECT(st.status == STATUS_COMPLETED && st.transferred_bytes == len);
    EXPECT(std::memcmp(src.data(), target.data(), len) == 0);
    EXPECT(freeBatchID(a, batch) == 0);
    EXPECT(unregisterLocalMemory(a, src.data()) == 0);
    EXPECT(unregisterLocalMemory(b, target.data()) == 0);
    destroyTransferEngine(a);
    destroyTransferEngine(b);
}

int main() {
    with_the_wrapper();
    with_the_classic_api();
    std::printf("classic_cpp: %s, %d failed\n", g_failures ? "FAIL" : "ok", g_failures);
    return g_failures == 0 ? 0 : 1;
}
