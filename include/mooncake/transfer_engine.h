// tent-rs: upstream's classic C++ class mooncake::TransferEngine (transfer_engine.h), header-only
// over the classic C API of include/transfer_engine_c.h, so that a C++ program written for
// upstream (Mooncake Store) compiles unchanged against these headers and links only the
// library's C ABI (libtransfer_engine). Engine logic lives in the library, below that ABI.
//
// Differences from upstream, by design: the engine loads its transports itself at init()
// (installTransport only checks and names one); update_metadata=false still publishes (in
// the background, soon after, instead of never); freeBatchID of a batch whose tasks still run
// succeeds (the batch is reclaimed when they end) instead of BatchBusy; getBaseAddr() is
// nullptr (no CXL transport); checkOverlap() is false; GPU transports do not exist
// (cuda_alike.h refuses GPU builds). Added: getTransferError(batch, task), the reason a task
// ended without completing.
#ifndef TENT_RS_MOONCAKE_TRANSFER_ENGINE_H
#define TENT_RS_MOONCAKE_TRANSFER_ENGINE_H

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "memory_location.h"
#include "multi_transport.h"
#include "transfer_metadata.h"
#include "transport/transport.h"

namespace mooncake {
namespace tent {
class TransferEngine;
}

using TransferRequest = Transport::TransferRequest;
using TransferStatus = Transport::TransferStatus;
using TransferStatusEnum = Transport::TransferStatusEnum;
using SegmentHandle = Transport::SegmentHandle;
using SegmentID = Transport::SegmentID;
using BatchID = Transport::BatchID;
const static BatchID INVALID_BATCH_ID = UINT64_MAX;
using BufferEntry = Transport::BufferEntry;
using NicLoadStats = Transport::NicLoadStats;

enum class PeerLiveness : uint8_t {
    Alive = 0,
    Unreachable = 1,
};

struct AutoDiscoverConfig {
    bool enabled = false;
    std::string protocol;
};

namespace tent_rs_detail {

// A classic return code as a Status: ERR_X becomes the code of the same name; the message is
// the library's reason for it.
inline Status statusOf(int rc, const char* what) {
    if (rc >= 0) return Status::OK();
    std::string msg = std::string(what) + ": " + lastError();
    switch (rc) {
        case ERR_NOT_IMPLEMENTED: return Status::NotImplemented(msg);
        case ERR_INVALID_ARGUMENT:
        case ERR_TOO_MANY_REQUESTS:
        case ERR_ADDRESS_NOT_REGISTERED:
        case ERR_BATCH_BUSY:
        case ERR_DEVICE_NOT_FOUND:
        case ERR_ADDRESS_OVERLAPPED:
        case ERR_DNS:
        case ERR_SOCKET:
        case ERR_MALFORMED_JSON:
        case ERR_REJECT_HANDSHAKE:
        case ERR_METADATA:
        case ERR_ENDPOINT:
        case ERR_CONTEXT:
        case ERR_NUMA:
        case ERR_CLOCK:
        case ERR_MEMORY: return Status(static_cast<Status::Code>(-rc), msg);
        default: return Status::Context(msg);
    }
}

inline const Status& notInitialized() {
    static const Status s = Status::InvalidArgument("transfer engine is not initialized (call init first)");
    return s;
}

constexpr SegmentHandle kBadSegment = static_cast<SegmentHandle>(static_cast<int64_t>(ERR_INVALID_ARGUMENT));

// Copies requests into the C layout on the stack (heap beyond 32): the hot path allocates
// nothing for small batches. A target beyond the C API's 32-bit segment id is refused.
class CRequests {
   public:
    explicit CRequests(const std::vector<TransferRequest>& entries) : n_(entries.size()) {
        if (n_ > kInline) heap_.resize(n_);
        transfer_request* out = data();
        for (size_t i = 0; i < n_; ++i) {
            const auto& r = entries[i];
            if (r.target_id > static_cast<uint64_t>(std::numeric_limits<segment_id_t>::max())) {
                bad_ = true;
                return;
            }
            out[i].opcode = r.opcode == TransferRequest::WRITE ? OPCODE_WRITE : OPCODE_READ;
            if (r.opcode != TransferRequest::READ && r.opcode != TransferRequest::WRITE) out[i].opcode = -1;
            out[i].source = r.source;
            out[i].target_id = static_cast<segment_id_t>(r.target_id);
            out[i].target_offset = r.target_offset;
            out[i].length = r.length;
        }
    }
    bool bad() const { return bad_; }
    transfer_request* data() { return n_ > kInline ? heap_.data() : inline_; }
    size_t size() const { return n_; }

   private:
    static constexpr size_t kInline = 32;
    size_t n_;
    bool bad_ = false;
    transfer_request inline_[kInline];
    std::vector<transfer_request> heap_;
};

}  // namespace tent_rs_detail

class TransferEngine {
   public:
    struct ScatterTransferRange {
        TransferRequest::OpCode opcode;
        std::string remote_segment;
        uint64_t remote_base_offset;
        size_t remote_size;
        void* local_buffer;
        size_t local_capacity;
        std::span<const size_t> local_offsets;
        std::span<const size_t> remote_offsets;
        std::span<const size_t> lengths;
        std::function<void(size_t, const Status&)> on_fragment_complete;
    };

    // A scatter transfer in flight (submitScatter). Move-only; the destructor waits until every
    // fragment ended. Each fragment's callback runs once, from wait()/waitFor() on the waiting
    // thread, when the fragment ends.
    class ScatterTransferOperation {
       public:
        ScatterTransferOperation(ScatterTransferOperation&&) noexcept = default;
        ScatterTransferOperation& operator=(ScatterTransferOperation&& other) noexcept;
        ~ScatterTransferOperation();
        ScatterTransferOperation(const ScatterTransferOperation&) = delete;
        ScatterTransferOperation& operator=(const ScatterTransferOperation&) = delete;

        // Waits until every fragment ended; OK, or the first failure.
        Status wait();

        // As wait(), but gives up after `timeout` with a Clock status (the transfer goes on:
        // keep the operation and its buffers until a later wait ends it).
        Status waitFor(std::chrono::nanoseconds timeout);

       private:
        class Impl;
        explicit ScatterTransferOperation(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
        std::unique_ptr<Impl> impl_;
        friend class TransferEngine;
    };

    TransferEngine(bool auto_discover = false) : auto_discover_(auto_discover) {}
    TransferEngine(bool auto_discover, const std::vector<std::string>& filter)
        : auto_discover_(auto_discover), filters_(filter) {}
    TransferEngine(TransferEngine&& other) noexcept = default;
    TransferEngine& operator=(TransferEngine&& other) noexcept {
        if (this != &other) {
            freeEngine();
            engine_ = std::move(other.engine_);
            metadata_ = std::move(other.metadata_);
            topology_ = std::move(other.topology_);
            transports_ = std::move(other.transports_);
            auto_discover_ = other.auto_discover_;
            filters_ = std::move(other.filters_);
        }
        return *this;
    }
    TransferEngine(const TransferEngine&) = delete;
    TransferEngine& operator=(const TransferEngine&) = delete;
    ~TransferEngine() { freeEngine(); }

    // Starts the engine: `metadata_conn_string` is P2PHANDSHAKE, http://host:port/path,
    // redis://servers or etcd://servers; `local_server_name` is host[:port] (in P2P mode the
    // segment is named host:<bound port>, which getLocalIpAndPort() reports; with a metadata
    // server it is named local_server_name exactly). Returns 0 or a negative code.
    int init(const std::string& metadata_conn_string, const std::string& local_server_name,
             const std::string& ip_or_host_name = "", uint64_t rpc_port = 12345) {
        if (engine_) {
            tent_rs_detail::logError("init: the engine is initialized already");
            return ERR_INVALID_ARGUMENT;
        }
        transfer_engine_t e;
        if (filters_.empty()) {
            e = createTransferEngine(metadata_conn_string.c_str(), local_server_name.c_str(), ip_or_host_name.c_str(),
                                     rpc_port, auto_discover_ ? 1 : 0);
        } else {
            std::vector<const char*> f;
            for (const auto& s : filters_) f.push_back(s.c_str());
            e = tent_classic_create_filtered(metadata_conn_string.c_str(), local_server_name.c_str(),
                                             ip_or_host_name.c_str(), f.data(), f.size());
        }
        if (!e) {
            tent_rs_detail::logError("init: " + tent_rs_detail::lastError());
            return ERR_INVALID_ARGUMENT;
        }
        engine_ = std::make_shared<tent_rs_detail::EngineHandle>(e);
        std::string ip_port = getLocalIpAndPort();
        auto [host, port] = parseHostNameWithPort(ip_port);
        metadata_ = std::make_shared<TransferMetadata>(engine_, TransferMetadata::RpcMetaDesc{host, port, -1});
        topology_ = std::make_shared<Topology>();
        topology_->loadFromLinksJson(showLinks(true));
        return 0;
    }

    // Stops the engine (transfers of scatter operations still waited on finish first). 0.
    int freeEngine() {
        transports_.clear();
        metadata_.reset();
        engine_.reset();
        return 0;
    }

    // A non-null Transport naming `proto` ("tcp", "rdma", "shm") when the engine runs it; else
    // nullptr with the reason on stderr. args[0], when given, is a NIC priority matrix (JSON).
    Transport* installTransport(const std::string& proto, void** args) {
        if (!engine_) {
            tent_rs_detail::logError("installTransport: " + std::string(tent_rs_detail::notInitialized().message()));
            return nullptr;
        }
        auto it = transports_.find(proto);
        if (it != transports_.end()) return it->second.get();
        if (!::installTransport(engine_->engine, proto.c_str(), args)) {
            tent_rs_detail::logError("installTransport(" + proto + "): " + tent_rs_detail::lastError());
            return nullptr;
        }
        auto t = std::make_unique<Transport>(proto);
        t->metadata_ = metadata_;
        Transport* raw = t.get();
        transports_.emplace(proto, std::move(t));
        return raw;
    }

    int uninstallTransport(const std::string& proto) {
        if (!engine_) return ERR_INVALID_ARGUMENT;
        transports_.erase(proto);
        return ::uninstallTransport(engine_->engine, proto.c_str());
    }

    // "host:port": in P2P mode the segment name peers open (this engine's own included).
    std::string getLocalIpAndPort() {
        if (!engine_) return "";
        char buf[300];
        return ::getLocalIpAndPort(engine_->engine, buf, sizeof(buf)) == 0 ? std::string(buf) : std::string();
    }

    int getRpcPort() {
        std::string s = getLocalIpAndPort();
        size_t colon = s.rfind(':');
        if (colon == std::string::npos) return ERR_INVALID_ARGUMENT;
        return parseFromString<int>(std::string_view(s).substr(colon + 1)).value_or(ERR_INVALID_ARGUMENT);
    }

    // This is the classic engine (Store then installs its transports itself).
    bool isUsingTent() const { return false; }

    // The handle of segment `segment_name` (its descriptor fetched), or
    // (SegmentHandle)ERR_INVALID_ARGUMENT when it cannot be opened.
    SegmentHandle openSegment(const std::string& segment_name) {
        if (!engine_) return tent_rs_detail::kBadSegment;
        size_t skip = segment_name.find_first_not_of('/');
        if (skip == std::string::npos) return tent_rs_detail::kBadSegment;
        segment_id_t id = ::openSegment(engine_->engine, segment_name.c_str() + skip);
        if (id < 0) {
            tent_rs_detail::logError("openSegment(" + segment_name + "): " + tent_rs_detail::lastError());
            return tent_rs_detail::kBadSegment;
        }
        return static_cast<SegmentHandle>(id);
    }

    Status CheckSegmentStatus(SegmentID sid) {
        (void)sid;
        return Status::OK();
    }

    int closeSegment(SegmentHandle handle) {
        if (!engine_) return ERR_INVALID_ARGUMENT;
        if (handle > static_cast<uint64_t>(std::numeric_limits<segment_id_t>::max())) return ERR_INVALID_ARGUMENT;
        return ::closeSegment(engine_->engine, static_cast<segment_id_t>(handle));
    }

    int removeLocalSegment(const std::string& segment_name) {
        return engine_ ? ::removeLocalSegment(engine_->engine, segment_name.c_str()) : ERR_INVALID_ARGUMENT;
    }

    // Registers [addr, addr+length) at `location` ("cpu:N", "*" to probe; a "segments:..."
    // location is probed too). With update_metadata the descriptor is in the metadata store
    // when this returns, as upstream's (a peer told of the buffer right after can reach it);
    // without, the engine publishes it in the background soon after.
    int registerLocalMemory(void* addr, size_t length, const std::string& location = kWildcardLocation,
                            bool remote_accessible = true, bool update_metadata = true) {
        if (!engine_) return ERR_INVALID_ARGUMENT;
        if (length == 0) {
            tent_rs_detail::logError("registerLocalMemory: zero length");
            return ERR_INVALID_ARGUMENT;
        }
        const char* loc = location.compare(0, kSegmentsLocationPrefix.size(), kSegmentsLocationPrefix) == 0
                              ? kWildcardLocation.c_str()
                              : location.c_str();
        int rc = ::registerLocalMemory(engine_->engine, addr, length, loc, remote_accessible ? 1 : 0);
        if (rc != 0) tent_rs_detail::logError("registerLocalMemory: " + tent_rs_detail::lastError());
        return rc == 0 && update_metadata ? publishNow("registerLocalMemory") : rc;
    }

    // ERR_ADDRESS_NOT_REGISTERED when no registration starts at `addr`. With update_metadata
    // the store no longer lists the buffer when this returns.
    int unregisterLocalMemory(void* addr, bool update_metadata = true) {
        if (!engine_) return ERR_INVALID_ARGUMENT;
        int rc = ::unregisterLocalMemory(engine_->engine, addr);
        return rc == 0 && update_metadata ? publishNow("unregisterLocalMemory") : rc;
    }

    // The store lists every buffer when this returns (as upstream's, which always updates).
    int registerLocalMemoryBatch(const std::vector<BufferEntry>& buffer_list, const std::string& location) {
        if (!engine_) return ERR_INVALID_ARGUMENT;
        std::vector<buffer_entry_t> list;
        list.reserve(buffer_list.size());
        for (const auto& b : buffer_list) list.push_back({b.addr, b.length});
        int rc = ::registerLocalMemoryBatch(engine_->engine, list.data(), list.size(), location.c_str());
        return rc == 0 ? publishNow("registerLocalMemoryBatch") : rc;
    }

    int unregisterLocalMemoryBatch(const std::vector<void*>& addr_list) {
        if (!engine_) return ERR_INVALID_ARGUMENT;
        std::vector<void*> list(addr_list);
        int rc = ::unregisterLocalMemoryBatch(engine_->engine, list.data(), list.size());
        int published = publishNow("unregisterLocalMemoryBatch");
        return rc != 0 ? rc : published;
    }

    BatchID allocateBatchID(size_t batch_size) {
        return engine_ ? ::allocateBatchID(engine_->engine, batch_size) : INVALID_BATCH_ID;
    }

    Status freeBatchID(BatchID batch_id) {
        if (!engine_) return tent_rs_detail::notInitialized();
        return tent_rs_detail::statusOf(::freeBatchID(engine_->engine, batch_id), "freeBatchID");
    }

    // Submits every request (all or none) as tasks batch_id's next task ids.
    Status submitTransfer(BatchID batch_id, const std::vector<TransferRequest>& entries) {
        if (!engine_) return tent_rs_detail::notInitialized();
        tent_rs_detail::CRequests reqs(entries);
        if (reqs.bad()) return Status::InvalidArgument("submitTransfer: target_id is not a segment handle");
        return tent_rs_detail::statusOf(::submitTransfer(engine_->engine, batch_id, reqs.data(), reqs.size()),
                                        "submitTransfer");
    }

    // As submitTransfer; once every task of this submit completed, `notify_msg` goes to each
    // target segment.
    Status submitTransferWithNotify(BatchID batch_id, const std::vector<TransferRequest>& entries,
                                    TransferMetadata::NotifyDesc notify_msg) {
        if (!engine_) return tent_rs_detail::notInitialized();
        tent_rs_detail::CRequests reqs(entries);
        if (reqs.bad()) return Status::InvalidArgument("submitTransferWithNotify: target_id is not a segment handle");
        notify_msg_t m{notify_msg.name.data(), notify_msg.notify_msg.data()};
        return tent_rs_detail::statusOf(
            ::submitTransferWithNotify(engine_->engine, batch_id, reqs.data(), reqs.size(), m),
            "submitTransferWithNotify");
    }

    ScatterTransferOperation submitScatter(const std::vector<ScatterTransferRange>& ranges);

    Status transferScatter(const std::vector<ScatterTransferRange>& ranges) {
        auto op = submitScatter(ranges);
        return op.wait();
    }

    // Appends (and takes) the notifications received so far. Returns 0.
    int getNotifies(std::vector<TransferMetadata::NotifyDesc>& notifies) {
        return metadata_ ? metadata_->getNotifies(notifies) : ERR_INVALID_ARGUMENT;
    }

    int sendNotifyByID(SegmentID target_id, TransferMetadata::NotifyDesc notify_msg) {
        if (!engine_) return ERR_INVALID_ARGUMENT;
        notify_msg_t m{notify_msg.name.data(), notify_msg.notify_msg.data()};
        return ::genNotifyInEngine(engine_->engine, target_id, m);
    }

    int sendNotifyByName(std::string remote_agent, TransferMetadata::NotifyDesc notify_msg) {
        SegmentHandle h = openSegment(remote_agent);
        if (h == tent_rs_detail::kBadSegment) return ERR_INVALID_ARGUMENT;
        return sendNotifyByID(h, std::move(notify_msg));
    }

    PeerLiveness probePeerAliveByID(SegmentID target_id) {
        if (!engine_ || target_id > static_cast<uint64_t>(std::numeric_limits<segment_id_t>::max()))
            return PeerLiveness::Unreachable;
        return tent_classic_probe(engine_->engine, static_cast<segment_id_t>(target_id)) == 0
                   ? PeerLiveness::Alive
                   : PeerLiveness::Unreachable;
    }

    Status getTransferStatus(BatchID batch_id, size_t task_id, TransferStatus& status) {
        if (!engine_) return tent_rs_detail::notInitialized();
        transfer_status st;
        int rc = ::getTransferStatus(engine_->engine, batch_id, task_id, &st);
        if (rc != 0) return tent_rs_detail::statusOf(rc, "getTransferStatus");
        status.s = static_cast<TransferStatusEnum>(st.status);
        status.transferred_bytes = st.transferred_bytes;
        return Status::OK();
    }

    // tent-rs: why task `task_id` ended without completing (FAILED, or TIMEOUT / CANCELED when
    // the engine gave a reason), over tent_classic_transfer_error; upstream only logs it. Empty
    // while the task runs, once it completed, before init, and for ids that name nothing live
    // (tent_last_error then says why).
    std::string getTransferError(BatchID batch_id, size_t task_id) const {
        if (!engine_) return std::string();
        transfer_engine_t e = engine_->engine;
        return tent_rs_detail::fetchString(
            [&](char* buf, size_t len) { return tent_classic_transfer_error(e, batch_id, task_id, buf, len); });
    }

    // The batch as a whole: COMPLETED when every task completed, FAILED when one failed, else
    // PENDING; transferred_bytes summed over its tasks.
    Status getBatchTransferStatus(BatchID batch_id, TransferStatus& status) {
        if (!engine_) return tent_rs_detail::notInitialized();
        transfer_status st;
        int rc = tent_classic_batch_status(engine_->engine, batch_id, &st);
        if (rc != 0) return tent_rs_detail::statusOf(rc, "getBatchTransferStatus");
        status.s = static_cast<TransferStatusEnum>(st.status);
        status.transferred_bytes = st.transferred_bytes;
        return Status::OK();
    }

    Status getNicLoadStats(std::vector<NicLoadStats>& stats) const {
        if (!engine_) return tent_rs_detail::notInitialized();
        size_t count = 0;
        int rc = ::getNicLoadStats(engine_->engine, nullptr, &count);
        if (rc != 0) return tent_rs_detail::statusOf(rc, "getNicLoadStats");
        std::vector<nic_load_stat_t> raw(count);
        rc = ::getNicLoadStats(engine_->engine, raw.data(), &count);
        if (rc != 0) return tent_rs_detail::statusOf(rc, "getNicLoadStats");
        stats.clear();
        for (size_t i = 0; i < count && i < raw.size(); ++i)
            stats.push_back({raw[i].device_name, raw[i].inflight_bytes, raw[i].ewma_bandwidth_bps});
        return Status::OK();
    }

    Transport* getTransport(const std::string& proto) {
        auto it = transports_.find(proto);
        return it == transports_.end() ? nullptr : it->second.get();
    }

    // True when the engine moves memory between processes over TCP only (no RDMA or device
    // transport; same-host shared memory does not count).
    bool isTcpOnly() const { return engine_ && tent_classic_is_tcp_only(engine_->engine) == 1; }

    // Forgets every cached remote descriptor (the engine caches by handle, not by name).
    int syncSegmentCache(const std::string& segment_name = "") {
        (void)segment_name;
        return engine_ ? ::syncSegmentCache(engine_->engine) : ERR_INVALID_ARGUMENT;
    }

    // The metadata view after init() (nullptr before).
    std::shared_ptr<TransferMetadata> getMetadata() { return metadata_; }

    bool checkOverlap(void* addr, uint64_t length) {
        (void)addr;
        (void)length;
        return false;
    }

    void setAutoDiscover(bool auto_discover) { auto_discover_ = auto_discover; }
    void setAutoDiscover(const AutoDiscoverConfig& config) { auto_discover_ = config.enabled; }

    void* getBaseAddr() { return nullptr; }

    // RDMA uses only these NICs; applies to the next init().
    void setWhitelistFilters(std::vector<std::string>&& filters) { filters_ = std::move(filters); }

    int numContexts() const {
        std::vector<NicLoadStats> stats;
        return getNicLoadStats(stats).ok() ? static_cast<int>(stats.size()) : 0;
    }

    // The engine's NIC priority matrix (empty without RDMA NICs); nullptr before init().
    std::shared_ptr<Topology> getLocalTopology() { return topology_; }

    std::string getLocalTopologyString() { return topology_ ? topology_->toString() : "{}"; }

    void enableGracefulShutdown() {
        if (engine_) ::enableGracefulShutdown(engine_->engine);
    }

    std::string showLinks(bool json = false) const {
        if (!engine_) return json ? "{}" : "(not initialized)";
        std::string buf(4096, '\0');
        for (int tries = 0; tries < 8; ++tries) {
            if (::showLinks(engine_->engine, buf.data(), buf.size(), json ? 1 : 0) == 0) {
                buf.resize(std::strlen(buf.c_str()));
                return buf;
            }
            buf.assign(buf.size() * 4, '\0');
        }
        return json ? "{}" : "";
    }

   private:
    // Writes the descriptor to the metadata store now (P2P mode: nothing to write), as
    // upstream's registration does before it returns: the engine's own publication runs in the
    // background, and a peer told of a buffer at once must find it. 0 or a negative code.
    int publishNow(const char* what) {
        int rc = tent_classic_republish(engine_->engine);
        if (rc != 0) tent_rs_detail::logError(std::string(what) + ": publishing: " + tent_rs_detail::lastError());
        return rc;
    }

    std::shared_ptr<tent_rs_detail::EngineHandle> engine_;
    std::shared_ptr<TransferMetadata> metadata_;
    std::shared_ptr<Topology> topology_;
    std::map<std::string, std::unique_ptr<Transport>> transports_;
    bool auto_discover_ = false;
    std::vector<std::string> filters_;
};

// One batch with one task per fragment. Fragments that fail their checks end at once (their
// callback runs during construction); the rest end as the engine reports them.
class TransferEngine::ScatterTransferOperation::Impl {
   public:
    Impl(TransferEngine& engine, const std::vector<ScatterTransferRange>& ranges) : engine_(engine.engine_) {
        std::unordered_map<std::string, SegmentHandle> segments;
        std::vector<TransferRequest> requests;
        for (size_t r = 0; r < ranges.size(); ++r) {
            const auto& range = ranges[r];
            callbacks_.push_back(range.on_fragment_complete);
            const size_t n = range.local_offsets.size();
            if (range.remote_offsets.size() != n || range.lengths.size() != n || !range.local_buffer ||
                range.remote_segment.empty()) {
                for (size_t f = 0; f < n; ++f) finish(r, f, Status::InvalidArgument("invalid scatter transfer range"));
                if (n == 0) remember(Status::InvalidArgument("invalid scatter transfer range"));
                continue;
            }
            for (size_t f = 0; f < n; ++f) {
                const size_t len = range.lengths[f], lo = range.local_offsets[f], ro = range.remote_offsets[f];
                const bool fits = lo <= range.local_capacity && len <= range.local_capacity - lo &&
                                  ro <= range.remote_size && len <= range.remote_size - ro &&
                                  range.remote_base_offset <= UINT64_MAX - ro &&
                                  len <= UINT64_MAX - (range.remote_base_offset + ro);
                if (!fits) {
                    finish(r, f, Status::InvalidArgument("invalid scatter transfer fragment"));
                    continue;
                }
                if (len == 0) {
                    finish(r, f, Status::OK());
                    continue;
                }
                auto [it, fresh] = segments.emplace(range.remote_segment, tent_rs_detail::kBadSegment);
                if (fresh) it->second = engine.openSegment(range.remote_segment);
                if (it->second == tent_rs_detail::kBadSegment) {
                    finish(r, f, Status::InvalidArgument("failed to open scatter transfer segment"));
                    continue;
                }
                requests.push_back(TransferRequest{
                    .opcode = range.opcode,
                    .source = static_cast<char*>(range.local_buffer) + lo,
                    .target_id = it->second,
                    .target_offset = range.remote_base_offset + ro,
                    .length = len,
                });
                pending_.push_back({r, f});
            }
        }
        if (pending_.empty()) return;
        batch_ = engine.allocateBatchID(requests.size());
        Status s = batch_ == INVALID_BATCH_ID ? Status::InvalidArgument("failed to allocate scatter transfer batch")
                                              : engine.submitTransfer(batch_, requests);
        if (!s.ok()) {
            // Nothing was submitted (submits are all or none): every fragment fails with why.
            for (const auto& p : pending_) finish(p.range, p.fragment, s);
            pending_.clear();
            releaseBatch();
            return;
        }
        done_.assign(pending_.size(), false);
        left_ = pending_.size();
    }

    ~Impl() { wait(); }

    Status wait() {
        while (!poll()) std::this_thread::sleep_for(std::chrono::microseconds(10));
        return result_;
    }

    Status waitFor(std::chrono::nanoseconds timeout) {
        const auto start = std::chrono::steady_clock::now();
        while (!poll()) {
            if (std::chrono::steady_clock::now() - start >= timeout)
                return Status::Clock("scatter transfer wait timed out");
            std::this_thread::sleep_for(std::chrono::microseconds(10));
        }
        return result_;
    }

   private:
    struct Fragment {
        size_t range;
        size_t fragment;
    };

    void remember(const Status& s) {
        if (result_.ok() && !s.ok()) result_ = s;
    }

    void finish(size_t range, size_t fragment, const Status& s) {
        remember(s);
        auto& cb = callbacks_[range];
        if (!cb) return;
        try {
            cb(fragment, s);
        } catch (...) {
            remember(Status::Context("scatter transfer callback failed"));
        }
    }

    void releaseBatch() {
        if (batch_ != INVALID_BATCH_ID && engine_) ::freeBatchID(engine_->engine, batch_);
        batch_ = INVALID_BATCH_ID;
    }

    // Reports fragments that ended; true once all did.
    bool poll() {
        if (left_ == 0) return true;
        for (size_t i = 0; i < pending_.size(); ++i) {
            if (done_[i]) continue;
            transfer_status st{};
            int rc = ::getTransferStatus(engine_->engine, batch_, i, &st);
            Status s;
            if (rc != 0) {
                s = tent_rs_detail::statusOf(rc, "scatter transfer status");
            } else if (st.status == STATUS_COMPLETED) {
                s = Status::OK();
            } else if (st.status == STATUS_WAITING || st.status == STATUS_PENDING) {
                continue;
            } else if (st.status == STATUS_TIMEOUT) {
                s = Status::Socket("scatter transfer fragment timed out");
            } else {
                s = Status::Socket("scatter transfer fragment failed");
            }
            done_[i] = true;
            --left_;
            finish(pending_[i].range, pending_[i].fragment, s);
        }
        if (left_ != 0) return false;
        releaseBatch();
        return true;
    }

    std::shared_ptr<tent_rs_detail::EngineHandle> engine_;
    std::vector<std::function<void(size_t, const Status&)>> callbacks_;
    std::vector<Fragment> pending_;
    std::vector<bool> done_;
    size_t left_ = 0;
    BatchID batch_ = INVALID_BATCH_ID;
    Status result_;
};

// The Impl's destructor waits for the fragments still running.
inline TransferEngine::ScatterTransferOperation::~ScatterTransferOperation() = default;

inline TransferEngine::ScatterTransferOperation& TransferEngine::ScatterTransferOperation::operator=(
    ScatterTransferOperation&& other) noexcept {
    if (this != &other) impl_ = std::move(other.impl_);
    return *this;
}

inline Status TransferEngine::ScatterTransferOperation::wait() {
    return impl_ ? impl_->wait() : Status::InvalidArgument("invalid scatter transfer operation");
}

inline Status TransferEngine::ScatterTransferOperation::waitFor(std::chrono::nanoseconds timeout) {
    return impl_ ? impl_->waitFor(timeout) : Status::InvalidArgument("invalid scatter transfer operation");
}

inline TransferEngine::ScatterTransferOperation TransferEngine::submitScatter(
    const std::vector<ScatterTransferRange>& ranges) {
    return ScatterTransferOperation(std::make_unique<ScatterTransferOperation::Impl>(*this, ranges));
}

}  // namespace mooncake

#endif  // TENT_RS_MOONCAKE_TRANSFER_ENGINE_H
