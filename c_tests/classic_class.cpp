// Upstream's classic C++ class mooncake::TransferEngine used as Mooncake Store uses it: two
// engines in one process over TCP with P2P handshake, registrations, segments opened by the
// name getLocalIpAndPort() reports (the engine's own included), batches of requests built with
// designated initializers, per-task and batch status, scatter transfers, and the failures
// Store checks for. Every byte moved is verified.
#include <atomic>
#include <chrono>
#include <cstring>
#include <vector>

#include "mooncake/common.h"
#include "mooncake/config.h"
#include "mooncake/error.h"
#include "mooncake/memory_location.h"
#include "mooncake/transfer_engine.h"
#include "mooncake/transfer_metadata_plugin.h"

// Like upstream's, these headers bring glog in where it is installed; its CHECK macros give way
// to the test's own.
#undef CHECK
#undef CHECK_EQ
extern "C" {
#include "check.h"
}

using namespace mooncake;

static bool waitBatch(TransferEngine& e, BatchID b, size_t n) {
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    for (;;) {
        size_t done = 0;
        for (size_t i = 0; i < n; ++i) {
            TransferStatus st{};
            if (!e.getTransferStatus(b, i, st).ok()) return false;
            if (st.s == TransferStatusEnum::COMPLETED) ++done;
            else if (st.s != TransferStatusEnum::PENDING && st.s != TransferStatusEnum::WAITING) return false;
        }
        if (done == n) return true;
        if (std::chrono::steady_clock::now() > until) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
}

int main() {
    // Helpers of common.h / config.h / memory_location.h.
    CHECK(getHostNameWithoutPort("[::1]:5") == "::1");
    CHECK(parseHostNameWithPort("h:77").second == 77);
    CHECK(parseHostNameWithPort("h").second == getDefaultHandshakePort());
    CHECK(hasExplicitPort("h:1") && !hasExplicitPort("h"));
    CHECK(buildHostNameWithPort("::1", 9) == "[::1]:9");
    CHECK(ValidatePortRange(80, 90, 15000, 17000).first == 15000);
    CHECK(buildSegmentsLocation(4096, {1, 3}) == "segments:4096:1,3");
    CHECK(Status::InvalidArgument("x").ToString() == "InvalidArgument: x");
    CHECK(Status::OK().ToString() == "OK");

    TransferEngine a(false), b(false);
    CHECK(a.getMetadata() == nullptr);
    CHECK(a.openSegment("x") == static_cast<uint64_t>(ERR_INVALID_ARGUMENT));
    CHECK_EQ(a.init(P2PHANDSHAKE, "127.0.0.1:17931"), 0);
    CHECK_EQ(b.init(P2PHANDSHAKE, "127.0.0.1:17931", "127.0.0.1", 17931), 0);
    CHECK(!a.isUsingTent());
    CHECK(a.installTransport("tcp", nullptr) != nullptr);
    CHECK(a.installTransport("tcp", nullptr) == a.getTransport("tcp"));
    CHECK(a.installTransport("carrier-pigeon", nullptr) == nullptr);
    CHECK(a.isTcpOnly());
    CHECK(a.getLocalIpAndPort() != b.getLocalIpAndPort());
    CHECK(a.getRpcPort() > 0);
    CHECK(a.getLocalTopology() != nullptr);

    const size_t kLen = 1 << 20;
    std::vector<char> src(kLen), dst(kLen, 0), local(kLen, 0);
    for (size_t i = 0; i < kLen; ++i) src[i] = static_cast<char>(i * 7 + 3);
    CHECK_EQ(a.registerLocalMemory(src.data(), kLen, "cpu:0"), 0);
    CHECK_EQ(a.registerLocalMemory(local.data(), kLen), 0);
    CHECK_EQ(b.registerLocalMemory(dst.data(), kLen, kWildcardLocation, true, true), 0);
    CHECK_EQ(a.registerLocalMemory(src.data(), 0), ERR_INVALID_ARGUMENT);

    // Open by the name each engine reports, its own included.
    SegmentHandle peer = a.openSegment(b.getLocalIpAndPort());
    SegmentHandle self = a.openSegment(a.getLocalIpAndPort());
    CHECK(peer != static_cast<uint64_t>(ERR_INVALID_ARGUMENT));
    CHECK(self != static_cast<uint64_t>(ERR_INVALID_ARGUMENT));
    CHECK(a.openSegment("127.0.0.1:1") == static_cast<uint64_t>(ERR_INVALID_ARGUMENT));

    // A batch of WRITEs in four pieces, then READ back into `local`.
    BatchID batch = a.allocateBatchID(8);
    CHECK(batch != INVALID_BATCH_ID);
    std::vector<TransferRequest> reqs;
    for (size_t i = 0; i < 4; ++i)
        reqs.push_back(TransferRequest{.opcode = TransferRequest::WRITE,
                                       .source = src.data() + i * (kLen / 4),
                                       .target_id = peer,
                                       .target_offset = reinterpret_cast<uint64_t>(dst.data()) + i * (kLen / 4),
                                       .length = kLen / 4});
    CHECK(a.submitTransfer(batch, reqs).ok());
    CHECK(waitBatch(a, batch, 4));
    TransferStatus whole{};
    CHECK(a.getBatchTransferStatus(batch, whole).ok());
    CHECK_EQ(whole.s, TransferStatusEnum::COMPLETED);
    CHECK_EQ(whole.transferred_bytes, kLen);
    CHECK(std::memcmp(src.data(), dst.data(), kLen) == 0);
    TransferStatus st{};
    CHECK(a.getTransferStatus(batch, 4, st).IsInvalidArgument());
    CHECK(a.getTransferError(batch, 0).empty());  // completed
    CHECK(a.getTransferError(batch, 4).empty());  // past the batch
    CHECK(a.freeBatchID(batch).ok());

    // tent-rs: a WRITE past the peer's registered buffer fails, and says why.
    batch = a.allocateBatchID(1);
    CHECK(a.submitTransfer(batch, {TransferRequest{.opcode = TransferRequest::WRITE,
                                                   .source = src.data(),
                                                   .target_id = peer,
                                                   .target_offset = reinterpret_cast<uint64_t>(dst.data()) + kLen,
                                                   .length = 64}})
              .ok());
    CHECK(!waitBatch(a, batch, 1));
    CHECK(a.getTransferStatus(batch, 0, st).ok() && st.s == TransferStatusEnum::FAILED);
    CHECK(a.getTransferError(batch, 0).find("not inside a registered buffer") != std::string::npos);
    CHECK(a.freeBatchID(batch).ok());
    CHECK(a.getTransferError(batch, 0).empty());  // freed

    batch = a.allocateBatchID(1);
    CHECK(a.submitTransfer(batch, {TransferRequest{.opcode = TransferRequest::READ,
                                                   .source = local.data(),
                                                   .target_id = peer,
                                                   .target_offset = reinterpret_cast<uint64_t>(dst.data()),
                                                   .length = kLen}})
              .ok());
    CHECK(waitBatch(a, batch, 1));
    CHECK(std::memcmp(src.data(), local.data(), kLen) == 0);
    // Capacity 1: a second request is too many.
    CHECK(!a.submitTransfer(batch, {reqs[0]}).ok());
    CHECK(a.freeBatchID(batch).ok());

    // Failures: a freed batch, local memory that is neither registered nor mapped, an unknown
    // segment. (Mapped memory that is not registered moves, as with upstream's TCP transport.)
    CHECK(!a.submitTransfer(batch, reqs).ok());
    CHECK(!a.getTransferStatus(batch, 0, st).ok());
    void* unmapped = reinterpret_cast<void*>(uintptr_t{0x1000});
    batch = a.allocateBatchID(2);
    CHECK(!a.submitTransfer(batch, {TransferRequest{.opcode = TransferRequest::WRITE,
                                                    .source = unmapped,
                                                    .target_id = peer,
                                                    .target_offset = reinterpret_cast<uint64_t>(dst.data()),
                                                    .length = 64}})
               .ok());
    CHECK(!a.submitTransfer(batch, {TransferRequest{.opcode = TransferRequest::WRITE,
                                                    .source = src.data(),
                                                    .target_id = 9999,
                                                    .target_offset = 0,
                                                    .length = 64}})
               .ok());
    CHECK(a.freeBatchID(batch).ok());

    // Scatter: three fragments of src land reversed in dst; each callback runs once.
    std::memset(dst.data(), 0, kLen);
    const size_t lo[] = {0, 4096, 8192}, ro[] = {8192, 4096, 0}, ln[] = {4096, 4096, 4096};
    std::vector<int> calls(3, 0);
    std::atomic<int> failures{0};
    auto range = [&](void* buf) {
        return TransferEngine::ScatterTransferRange{
            .opcode = TransferRequest::WRITE,
            .remote_segment = b.getLocalIpAndPort(),
            .remote_base_offset = reinterpret_cast<uint64_t>(dst.data()),
            .remote_size = kLen,
            .local_buffer = buf,
            .local_capacity = kLen,
            .local_offsets = std::span<const size_t>(lo),
            .remote_offsets = std::span<const size_t>(ro),
            .lengths = std::span<const size_t>(ln),
            .on_fragment_complete =
                [&](size_t i, const Status& s) {
                    if (i < 3) ++calls[i];
                    if (!s.ok()) ++failures;
                },
        };
    };
    {
        auto op = a.submitScatter({range(src.data())});
        Status s = op.waitFor(std::chrono::seconds(30));
        CHECK(s.ok());
        CHECK(op.wait().ok());
    }
    CHECK(calls == std::vector<int>({1, 1, 1}));
    CHECK_EQ(failures.load(), 0);
    for (int i = 0; i < 3; ++i) CHECK(std::memcmp(src.data() + lo[i], dst.data() + ro[i], 4096) == 0);
    // waitFor(0) on a fresh operation: Clock, or already done; the destructor then waits.
    {
        auto op = a.submitScatter({range(src.data())});
        Status s = op.waitFor(std::chrono::nanoseconds(0));
        CHECK(s.ok() || s.IsClock());
        TransferEngine::ScatterTransferOperation moved(std::move(op));
        CHECK(op.wait().IsInvalidArgument());
    }
    CHECK(calls == std::vector<int>({2, 2, 2}));
    // An unknown segment fails every fragment; a mismatched range is invalid.
    auto bad = range(src.data());
    bad.remote_segment = "127.0.0.1:1";
    CHECK(!a.transferScatter({bad}).ok());
    CHECK_EQ(failures.load(), 3);
    auto uneven = range(src.data());
    uneven.lengths = std::span<const size_t>(ln, 2);
    CHECK(a.transferScatter({uneven}).IsInvalidArgument());

    // Notifications and probes.
    CHECK_EQ(a.sendNotifyByName(b.getLocalIpAndPort(), {"who", "hello"}), 0);
    std::vector<TransferMetadata::NotifyDesc> notes;
    for (int i = 0; i < 3000 && notes.empty(); ++i) {
        b.getNotifies(notes);
        if (notes.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    CHECK(notes.size() == 1 && notes[0].name == "who" && notes[0].notify_msg == "hello");
    CHECK(a.probePeerAliveByID(peer) == PeerLiveness::Alive);

    // Metadata: republishing succeeds (nothing to write in P2P mode).
    CHECK(a.getMetadata() != nullptr);
    CHECK_EQ(a.getMetadata()->updateLocalSegmentDesc(), 0);
    CHECK_EQ(a.getMetadata()->rePublishRpcMetaEntry(a.getLocalIpAndPort()), 0);
    CHECK(MetadataStoragePlugin::Create(P2PHANDSHAKE) == nullptr);

    // Unregistering twice: the second time nothing is registered there.
    CHECK_EQ(a.unregisterLocalMemory(src.data()), 0);
    CHECK_EQ(a.unregisterLocalMemory(src.data()), ERR_ADDRESS_NOT_REGISTERED);
    CHECK_EQ(a.unregisterLocalMemory(local.data()), 0);
    CHECK_EQ(b.unregisterLocalMemory(dst.data()), 0);

    CHECK_EQ(a.freeEngine(), 0);
    CHECK_EQ(a.registerLocalMemory(src.data(), kLen), ERR_INVALID_ARGUMENT);
    CHECK(a.allocateBatchID(1) == INVALID_BATCH_ID);
    return check_report("classic_class");
}
