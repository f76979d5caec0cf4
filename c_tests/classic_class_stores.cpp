// Upstream's classic C++ class mooncake::TransferEngine on a central metadata server, used as
// Mooncake Store's client uses it:
//   classic_class_stores <metadata_conn_string>
// (http://host:port/metadata, redis://host:port or etcd://host:port). Two engines start with
// init(conn, local_hostname, host, port) and open each other by exactly that local_hostname,
// right after registering their buffers (as a Store peer does once the master tells it the
// segment); bytes move both ways and every byte is checked. MetadataStoragePlugin (Store's
// master) sets, reads and removes keys on the same server; a removed descriptor key can no
// longer be opened by a fresh engine, until its owner republishes it (updateLocalSegmentDesc).
// With -DTENT_TEST_JSONCPP the Json::Value forms are used too. Run with a long metadata TTL
// (MC_TENT_CONF='{"metadata_ttl_secs": 3600}'), so no keep-alive rewrites a removed key here.
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "mooncake/common.h"
#include "mooncake/error.h"
#include "mooncake/transfer_engine.h"
#include "mooncake/transfer_metadata_plugin.h"

#ifdef TENT_TEST_JSONCPP
#include <json/json.h>
#endif

// Like upstream's, these headers bring glog in where it is installed; its CHECK macros give way
// to the test's own.
#undef CHECK
#undef CHECK_EQ
extern "C" {
#include "check.h"
}

using namespace mooncake;

namespace {

constexpr SegmentHandle kBad = static_cast<SegmentHandle>(ERR_INVALID_ARGUMENT);

// tent-rs publishes a segment's descriptor under this prefix (upstream's classic engine uses
// mooncake/ram/<name>; see the report of this test in tests/cpp_classic.rs).
const std::string kSegmentKeyPrefix = "mooncake/tent/";

// Starts `e` as Store's client does: the name, and the host and port parsed from it.
int initAsStore(TransferEngine& e, const std::string& conn, const std::string& name) {
    auto [host, port] = parseHostNameWithPort(name);
    return e.init(conn, name, host, port);
}

// One request in its own batch, waited for; true when it completed.
bool transfer(TransferEngine& e, TransferRequest::OpCode op, void* local, SegmentHandle target, void* remote,
              size_t len) {
    BatchID batch = e.allocateBatchID(1);
    if (batch == INVALID_BATCH_ID) return false;
    bool ok = e.submitTransfer(batch, {TransferRequest{.opcode = op,
                                                       .source = local,
                                                       .target_id = target,
                                                       .target_offset = reinterpret_cast<uint64_t>(remote),
                                                       .length = len}})
                  .ok();
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    TransferStatus st{};
    while (ok) {
        if (!e.getTransferStatus(batch, 0, st).ok()) ok = false;
        else if (st.s == TransferStatusEnum::COMPLETED) break;
        else if (st.s != TransferStatusEnum::PENDING && st.s != TransferStatusEnum::WAITING) ok = false;
        else if (std::chrono::steady_clock::now() > until) ok = false;
        else std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (!e.freeBatchID(batch).ok()) ok = false;
    return ok && st.transferred_bytes == len;
}

void fill(std::vector<char>& v, int seed) {
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<char>(i * 13 + seed);
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: classic_class_stores <metadata_conn_string>\n");
        return 2;
    }
    const std::string conn = argv[1];
    const std::string na = "127.0.0.1:17951", nb = "127.0.0.1:17952";

    TransferEngine a(false), b(false);
    CHECK_EQ(initAsStore(a, conn, na), 0);
    CHECK_EQ(initAsStore(b, conn, nb), 0);
    CHECK(a.installTransport("tcp", nullptr) != nullptr);
    CHECK(b.installTransport("tcp", nullptr) != nullptr);
    CHECK(a.isTcpOnly());

    const size_t kLen = 1 << 20;
    std::vector<char> a_src(kLen), a_in(kLen, 0), a_back(kLen, 0), b_src(kLen), b_in(kLen, 0);
    fill(a_src, 3);
    fill(b_src, 5);
    CHECK_EQ(a.registerLocalMemory(a_src.data(), kLen, "cpu:0"), 0);
    CHECK_EQ(a.registerLocalMemory(a_in.data(), kLen, "cpu:0"), 0);
    CHECK_EQ(a.registerLocalMemory(a_back.data(), kLen), 0);
    CHECK_EQ(b.registerLocalMemory(b_src.data(), kLen, "cpu:0"), 0);
    CHECK_EQ(b.registerLocalMemory(b_in.data(), kLen, kWildcardLocation, true, true), 0);

    // Each opens the other by exactly its local_hostname, at once: registration returned, so
    // the descriptor in the store lists the buffers (no retry, as Store does none).
    SegmentHandle to_b = a.openSegment(nb), to_a = b.openSegment(na);
    CHECK(to_b != kBad);
    CHECK(to_a != kBad);
    CHECK(transfer(a, TransferRequest::WRITE, a_src.data(), to_b, b_in.data(), kLen));
    CHECK(std::memcmp(a_src.data(), b_in.data(), kLen) == 0);
    CHECK(transfer(b, TransferRequest::WRITE, b_src.data(), to_a, a_in.data(), kLen));
    CHECK(std::memcmp(b_src.data(), a_in.data(), kLen) == 0);
    CHECK(transfer(a, TransferRequest::READ, a_back.data(), to_b, b_src.data(), kLen));
    CHECK(std::memcmp(b_src.data(), a_back.data(), kLen) == 0);
    // Its own segment too, by its own name.
    SegmentHandle self = a.openSegment(na);
    CHECK(self != kBad);
    std::memset(a_back.data(), 0, kLen);
    CHECK(transfer(a, TransferRequest::READ, a_back.data(), self, a_src.data(), kLen));
    CHECK(std::memcmp(a_src.data(), a_back.data(), kLen) == 0);

    // A name nobody published fails as Store checks it.
    CHECK(a.openSegment("127.0.0.1:1") == kBad);
    CHECK(a.openSegment("no-such-segment") == kBad);
    // A buffer registered later is reachable at once too.
    std::vector<char> b_late(4096, 0);
    CHECK_EQ(b.registerLocalMemory(b_late.data(), b_late.size()), 0);
    CHECK(transfer(a, TransferRequest::WRITE, a_src.data(), a.openSegment(nb), b_late.data(), b_late.size()));
    CHECK(std::memcmp(a_src.data(), b_late.data(), b_late.size()) == 0);

    // The master's view of the same server.
    auto store = MetadataStoragePlugin::Create(conn);
    CHECK(store != nullptr);
    if (!store) return check_report("classic_class_stores");
    std::string value;
    CHECK(store->set("tent-test/classic/k", "{\"v\": 1}"));
    CHECK(store->get("tent-test/classic/k", value) && value == "{\"v\": 1}");
    std::string big(5000, 'x');
    CHECK(store->set("tent-test/classic/big", big));
    CHECK(store->get("tent-test/classic/big", value) && value == big);
    CHECK(store->remove("tent-test/classic/k"));
    CHECK(!store->get("tent-test/classic/k", value));
    CHECK(store->remove("tent-test/classic/big"));
#ifdef TENT_TEST_JSONCPP
    Json::Value j;
    j["segment"] = nb;
    j["n"] = 7;
    CHECK(store->set("tent-test/classic/json", j));
    Json::Value back;
    CHECK(store->get("tent-test/classic/json", back));
    CHECK(back["segment"].asString() == nb && back["n"].asInt() == 7);
    CHECK(store->remove("tent-test/classic/json"));
    CHECK(!store->get("tent-test/classic/json", back));
#endif

    // b's descriptor, copied under another name, opens that segment for a fresh engine; once
    // the copy is removed, a fresh engine cannot open the name any more. (b's own key is kept
    // alive by b, which would write it again.)
    std::string desc;
    CHECK(store->get(kSegmentKeyPrefix + nb, desc) && desc.find("127.0.0.1") != std::string::npos);
    const std::string alias = "tent-test-alias-of-b";
    CHECK(store->set(kSegmentKeyPrefix + alias, desc));
    {
        TransferEngine c(false);
        CHECK_EQ(initAsStore(c, conn, "127.0.0.1:17953"), 0);
        std::vector<char> c_src(kLen);
        fill(c_src, 9);
        CHECK_EQ(c.registerLocalMemory(c_src.data(), kLen), 0);
        SegmentHandle h = c.openSegment(alias);
        CHECK(h != kBad);
        CHECK(transfer(c, TransferRequest::WRITE, c_src.data(), h, b_in.data(), kLen));
        CHECK(std::memcmp(c_src.data(), b_in.data(), kLen) == 0);
        CHECK_EQ(c.unregisterLocalMemory(c_src.data()), 0);
    }
    CHECK(store->remove(kSegmentKeyPrefix + alias));
    {
        TransferEngine d(false);
        CHECK_EQ(initAsStore(d, conn, "127.0.0.1:17954"), 0);
        CHECK(d.openSegment(alias) == kBad);
        CHECK(d.openSegment(nb) != kBad);
    }

    // What Store's master removes for a client that timed out (upstream's classic key names).
    // tent-rs keeps no such keys; removing a missing key succeeds here.
    CHECK(store->remove("mooncake/ram/" + nb));
    CHECK(store->remove("mooncake/rpc_meta/" + nb));
    // b's own key removed: a fresh engine cannot open b until b republishes, as Store's client
    // does after a remount (updateLocalSegmentDesc, rePublishRpcMetaEntry). (b's keep-alive
    // would write it again too; the harness sets a long TTL so that it does not run here.)
    CHECK(store->remove(kSegmentKeyPrefix + nb));
    CHECK(!store->get(kSegmentKeyPrefix + nb, value));
    {
        TransferEngine d(false);
        CHECK_EQ(initAsStore(d, conn, "127.0.0.1:17956"), 0);
        CHECK(d.openSegment(nb) == kBad);
    }
    CHECK_EQ(b.getMetadata()->updateLocalSegmentDesc(), 0);
    CHECK_EQ(b.getMetadata()->rePublishRpcMetaEntry(nb), 0);
    CHECK(store->get(kSegmentKeyPrefix + nb, value) && value == desc);
    {
        TransferEngine d(false);
        CHECK_EQ(initAsStore(d, conn, "127.0.0.1:17957"), 0);
        std::vector<char> d_src(4096);
        fill(d_src, 11);
        CHECK_EQ(d.registerLocalMemory(d_src.data(), d_src.size()), 0);
        SegmentHandle h = d.openSegment(nb);
        CHECK(h != kBad);
        CHECK(transfer(d, TransferRequest::WRITE, d_src.data(), h, b_late.data(), d_src.size()));
        CHECK(std::memcmp(d_src.data(), b_late.data(), d_src.size()) == 0);
    }

    // A server that does not answer, and strings naming no server, fail cleanly.
    CHECK(MetadataStoragePlugin::Create("http://127.0.0.1:1/metadata") == nullptr);
    CHECK(MetadataStoragePlugin::Create("redis://127.0.0.1:1") == nullptr);
    CHECK(MetadataStoragePlugin::Create("zk://127.0.0.1:1") == nullptr);
    CHECK(MetadataStoragePlugin::Create(P2PHANDSHAKE) == nullptr);
    {
        TransferEngine e(false);
        CHECK(initAsStore(e, "http://127.0.0.1:1/metadata", "127.0.0.1:17955") != 0);
        CHECK(e.openSegment(nb) == kBad);
    }

    CHECK_EQ(a.unregisterLocalMemory(a_src.data()), 0);
    CHECK_EQ(b.unregisterLocalMemory(b_late.data()), 0);
    CHECK_EQ(a.freeEngine(), 0);
    CHECK_EQ(b.freeEngine(), 0);
    // A clean stop deletes the engine's descriptor.
    CHECK(!store->get(kSegmentKeyPrefix + na, value));
    CHECK(!store->get(kSegmentKeyPrefix + nb, value));
    return check_report("classic_class_stores");
}
