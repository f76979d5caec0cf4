/*
 * tent-rs: the C++ class mooncake::tent::TransferEngine, upstream Mooncake TENT's C++ API, as
 * thin inline code over the C API of tent/transfer_engine.h (which includes this file at its
 * end when compiled as C++; include that header, not this one).
 *
 * Every method keeps upstream's name, signature and default arguments and returns the Status
 * code upstream's engine returns for the same failure (from tent_last_error_code), with the
 * library's message (tent_last_error). Nothing here is compiled into the library, so C
 * callers never need libstdc++.
 *
 * Where tent-rs differs from upstream:
 *  - getLocalTopology() returns nullptr: Topology stays an opaque, forward-declared type.
 *    getLocalTopologyString() returns the real topology JSON ({"nics": ..., "mems": ...}).
 *  - exportLocalSegment / importRemoteSegment return NotImplemented, as upstream's do.
 *  - progressBatch is getTransferStatus(batch, overall): tent-rs's status polls already drive
 *    progress and failover.
 *  - Request::deadline_ns reaches the engine through tent_submit_with_deadlines (a tent-rs
 *    symbol: the C struct has no such field); policy_name and intent_type are accepted and
 *    ignored.
 *  - The engine copies its Config when it is constructed; later changes to that Config do not
 *    reach it.
 *  - getTransferError(batch, task) is a tent-rs addition: the reason a task ended without
 *    completing, which upstream only logs.
 */
#ifndef TENT_TRANSFER_ENGINE_CXX_H
#define TENT_TRANSFER_ENGINE_CXX_H

#include "tent/transfer_engine.h"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tent/common/config.h"
#include "tent/common/status.h"
#include "tent/common/types.h"

namespace mooncake {
namespace tent {

namespace tent_rs_detail {
/* Reads a string the snprintf way: `call(buf, len)` returns the full length (<= 0: none, or an
 * error), so a string longer than the first buffer is fetched again at its size. */
template <typename F>
inline std::string FetchString(F&& call) {
    char small[512];
    int n = call(small, sizeof small);
    if (n <= 0) return std::string();
    if (static_cast<size_t>(n) < sizeof small) return std::string(small, static_cast<size_t>(n));
    std::string big(static_cast<size_t>(n) + 1, '\0');
    int m = call(&big[0], big.size());
    big.resize(m <= 0 ? 0 : std::min(static_cast<size_t>(m), static_cast<size_t>(n)));
    return big;
}
}  // namespace tent_rs_detail

class TransferEngineImpl;
class Config;
/* Upstream's topology object has no counterpart here (see getLocalTopology). */
class Topology;

class TransferEngine {
   public:
    /* An engine from the default configuration and the environment (MC_* variables,
     * MC_TENT_CONF). */
    TransferEngine() : engine_(tent_create_engine_with_config(nullptr)) {}

    /* An engine from the JSON config file at `config_path`; an unreadable file is reported on
     * stderr and the defaults are used, as upstream. */
    TransferEngine(const std::string config_path) {
        Config conf;
        Status s = conf.loadFile(config_path);
        if (!s.ok()) {
            std::fprintf(stderr, "tent: failed to read config file %s (%s); using the defaults\n",
                         config_path.c_str(), s.ToString().c_str());
        }
        engine_ = tent_create_engine_with_config(conf.handle());
    }

    /* An engine from `config` (a copy taken now) and the environment; nullptr = defaults. */
    TransferEngine(std::shared_ptr<Config> config)
        : engine_(tent_create_engine_with_config(config ? config->handle() : nullptr)) {}

    ~TransferEngine() { tent_destroy_engine(engine_); }

    TransferEngine(const TransferEngine&) = delete;
    TransferEngine& operator=(const TransferEngine&) = delete;

    bool available() const { return tent_available(engine_) == 1; }

    /* The name peers open this engine's segment by ("" when the engine is unavailable). */
    const std::string getSegmentName() const {
        char buf[1024];
        if (tent_segment_name(engine_, buf, sizeof buf) != 0) return std::string();
        return std::string(buf);
    }

    /* The address the RPC server advertises (an IP, without brackets). */
    const std::string getRpcServerAddress() const {
        char buf[256];
        uint16_t port = 0;
        if (tent_rpc_server_addr_port(engine_, buf, sizeof buf, &port) != 0) return std::string();
        return std::string(buf);
    }

    uint16_t getRpcServerPort() const {
        char buf[256];
        uint16_t port = 0;
        if (tent_rpc_server_addr_port(engine_, buf, sizeof buf, &port) != 0) return 0;
        return port;
    }

    /* Always nullptr in tent-rs (upstream's Topology class is internal to its engine); use
     * getLocalTopologyString for the same information. */
    std::shared_ptr<Topology> getLocalTopology() const { return nullptr; }

    /* {"nics": [...], "mems": [...]} as upstream's Topology::toString lays it out; "{}" when
     * the engine is unavailable. */
    std::string getLocalTopologyString() const {
        std::string out = tent_rs_detail::FetchString([&](char* buf, size_t len) { return tent_local_topology(engine_, buf, len); });
        return out.empty() ? std::string("{}") : out;
    }

    Status exportLocalSegment(std::string& shared_handle) {
        (void)shared_handle;
        return Status::NotImplemented("exportLocalSegment is not implemented (as in upstream TENT)");
    }

    Status importRemoteSegment(SegmentID& handle, const std::string& shared_handle) {
        (void)handle;
        (void)shared_handle;
        return Status::NotImplemented("importRemoteSegment is not implemented (as in upstream TENT)");
    }

    /* A handle for `segment_name` (LOCAL_SEGMENT_ID for "" and this engine's own name). The
     * peer is contacted when the segment is first used, as upstream. */
    Status openSegment(SegmentID& handle, const std::string& segment_name) {
        tent_segment_id_t h = 0;
        if (tent_open_segment(engine_, &h, segment_name.c_str()) != 0) return LastStatus();
        handle = h;
        return Status::OK();
    }

    Status closeSegment(SegmentID handle) { return Check(tent_close_segment(engine_, handle)); }

    /* Replaces `info` with the segment's type and its (non-internal) buffers. */
    Status getSegmentInfo(SegmentID handle, SegmentInfo& info) {
        tent_segment_info_t raw;
        if (tent_get_segment_info(engine_, handle, &raw) != 0) return LastStatus();
        info.type = raw.type == TYPE_FILE ? SegmentInfo::File : SegmentInfo::Memory;
        info.buffers.clear();
        info.buffers.reserve(static_cast<size_t>(raw.num_buffers));
        for (int i = 0; i < raw.num_buffers; ++i) {
            const tent_buffer_info& b = raw.buffers[i];
            info.buffers.push_back(SegmentInfo::Buffer{b.base, b.length, Location(b.location)});
        }
        tent_free_segment_info(&raw);
        return Status::OK();
    }

    Status allocateLocalMemory(void** addr, size_t size, Location location = kWildcardLocation) {
        return Check(tent_allocate_memory(engine_, addr, size, location.c_str()));
    }

    Status freeLocalMemory(void* addr) { return Check(tent_free_memory(engine_, addr)); }

    Status registerLocalMemory(void* addr, size_t size, Permission permission = kGlobalReadWrite) {
        return Check(tent_register_memory_with_perm(engine_, addr, size, static_cast<int>(permission)));
    }

    /* size 0 matches the registration at `addr` whatever its length. */
    Status unregisterLocalMemory(void* addr, size_t size = 0) {
        return Check(tent_unregister_memory(engine_, addr, size));
    }

    /* All or none; the lists must have the same length. */
    Status registerLocalMemory(std::vector<void*> addr_list, std::vector<size_t> size_list,
                               Permission permission = kGlobalReadWrite) {
        if (addr_list.size() != size_list.size())
            return Status::InvalidArgument("registerLocalMemory: addr_list and size_list differ in length");
        if (addr_list.empty()) return Status::OK();
        return Check(tent_register_memory_batch(engine_, addr_list.data(), size_list.data(), addr_list.size(),
                                                static_cast<int>(permission)));
    }

    /* An empty size_list matches each address whatever its length. */
    Status unregisterLocalMemory(std::vector<void*> addr_list, std::vector<size_t> size_list = {}) {
        if (!size_list.empty() && size_list.size() != addr_list.size())
            return Status::InvalidArgument("unregisterLocalMemory: addr_list and size_list differ in length");
        if (addr_list.empty()) return Status::OK();
        return Check(tent_unregister_memory_batch(engine_, addr_list.data(),
                                                  size_list.empty() ? nullptr : size_list.data(), addr_list.size()));
    }

    /* With options.type == SHM the block is a shared-memory object whose name is written back
     * into options.shm_path, ready for registerLocalMemory with the same options. */
    Status allocateLocalMemory(void** addr, size_t size, MemoryOptions& options) {
        tent_memory_options_t raw;
        Status s = ToC(options, raw);
        if (!s.ok()) return s;
        if (tent_allocate_memory_ex(engine_, addr, size, &raw) != 0) return LastStatus();
        options.shm_path = raw.shm_path;
        options.shm_offset = raw.shm_offset;
        return Status::OK();
    }

    Status registerLocalMemory(void* addr, size_t size, MemoryOptions& options) {
        tent_memory_options_t raw;
        Status s = ToC(options, raw);
        if (!s.ok()) return s;
        return Check(tent_register_memory_ex(engine_, addr, size, &raw));
    }

    Status registerLocalMemory(std::vector<void*> addr_list, std::vector<size_t> size_list, MemoryOptions& options) {
        if (addr_list.size() != size_list.size())
            return Status::InvalidArgument("registerLocalMemory: addr_list and size_list differ in length");
        tent_memory_options_t raw;
        Status s = ToC(options, raw);
        if (!s.ok()) return s;
        if (addr_list.empty()) return Status::OK();
        return Check(
            tent_register_memory_batch_ex(engine_, addr_list.data(), size_list.data(), addr_list.size(), &raw));
    }

    /* A batch for up to `batch_size` tasks over its life; 0 on failure, as upstream. */
    BatchID allocateBatch(size_t batch_size) {
        tent_batch_id_t id = tent_allocate_batch(engine_, batch_size);
        return id == UINT64_MAX ? 0 : id;
    }

    Status freeBatch(BatchID batch_id) { return Check(tent_free_batch(engine_, batch_id)); }

    /* Task ids continue from earlier submits to the batch. A request that cannot run becomes a
     * FAILED task; the call itself fails for a dead batch, exceeded capacity or bad input. */
    Status submitTransfer(BatchID batch_id, const std::vector<Request>& request_list) {
        tent_request_t* raw = ToC(request_list);
        const uint64_t* deadlines = Deadlines(request_list);
        if (deadlines != nullptr)
            return Check(tent_submit_with_deadlines(engine_, batch_id, raw, request_list.size(), deadlines, nullptr,
                                                    nullptr));
        return Check(tent_submit(engine_, batch_id, raw, request_list.size()));
    }

    /* As above; once every task of this submit completed, `notifi` goes to every target. */
    Status submitTransfer(BatchID batch_id, const std::vector<Request>& request_list, const Notification& notifi) {
        tent_request_t* raw = ToC(request_list);
        const uint64_t* deadlines = Deadlines(request_list);
        if (deadlines != nullptr)
            return Check(tent_submit_with_deadlines(engine_, batch_id, raw, request_list.size(), deadlines,
                                                    notifi.name.c_str(), notifi.msg.c_str()));
        return Check(tent_submit_notif(engine_, batch_id, raw, request_list.size(), notifi.name.c_str(),
                                       notifi.msg.c_str()));
    }

    /* Best effort: a task that has not ended becomes CANCELED; keep polling for its end. */
    Status cancelTransfer(BatchID batch_id, size_t task_id) {
        return Check(tent_cancel_task(engine_, batch_id, task_id));
    }

    Status sendNotification(SegmentID target_id, const Notification& notifi) {
        return Check(tent_send_notifs(engine_, target_id, notifi.name.c_str(), notifi.msg.c_str()));
    }

    /* Replaces `notifi_list` with every notification received since the last call. */
    Status receiveNotification(std::vector<Notification>& notifi_list) {
        tent_notifi_info info;
        if (tent_recv_notifs(engine_, &info) != 0) return LastStatus();
        notifi_list.clear();
        notifi_list.reserve(static_cast<size_t>(info.num_records));
        for (int i = 0; i < info.num_records; ++i)
            notifi_list.push_back(Notification{info.records[i].name, info.records[i].msg});
        tent_free_notifs(&info);
        return Status::OK();
    }

    /* OK when the owner of `target_id` answers a probe; NeedsRefreshCache when it does not (as
     * upstream reports an RPC failure here), InvalidArgument for an unknown handle. */
    Status probePeerAliveByID(SegmentID target_id) {
        if (tent_probe_peer(engine_, target_id) == 0) return Status::OK();
        Status s = LastStatus();
        if (s.IsRpcServiceError()) return Status::NeedsRefreshCache(std::string("RPC service error: ") + std::string(s.message()));
        return s;
    }

    Status getTransferStatus(BatchID batch_id, size_t task_id, TransferStatus& status) {
        tent_status_t raw;
        if (tent_task_status(engine_, batch_id, task_id, &raw) != 0) return LastStatus();
        status = FromC(raw);
        return Status::OK();
    }

    /* Replaces `status_list` with the status of every task, in task-id order. */
    Status getTransferStatus(BatchID batch_id, std::vector<TransferStatus>& status_list) {
        std::vector<tent_status_t>& raw = Scratch<tent_status_t>();
        if (raw.size() < 64) raw.resize(64);
        for (;;) {
            size_t count = raw.size();
            if (tent_task_status_list(engine_, batch_id, raw.data(), &count) != 0) return LastStatus();
            if (count <= raw.size()) {
                status_list.resize(count);
                for (size_t i = 0; i < count; ++i) status_list[i] = FromC(raw[i]);
                return Status::OK();
            }
            raw.resize(count);  // more tasks than room: ask again with enough
        }
    }

    Status getTransferStatus(BatchID batch_id, TransferStatus& overall_status) {
        tent_status_t raw;
        if (tent_overall_status(engine_, batch_id, &raw) != 0) return LastStatus();
        overall_status = FromC(raw);
        return Status::OK();
    }

    /* tent-rs: why task `task_id` ended without completing (FAILED, or TIMEOUT / CANCELED when
     * the engine gave a reason), over tent_task_error. Empty while the task runs, once it
     * completed, and for ids that name nothing live (tent_last_error then says why). */
    std::string getTransferError(BatchID batch_id, size_t task_id) const {
        return tent_rs_detail::FetchString(
            [&](char* buf, size_t len) { return tent_task_error(engine_, batch_id, task_id, buf, len); });
    }

    /* One step of progress on the batch and its aggregated status (tent-rs's status poll is
     * that step). */
    Status progressBatch(BatchID batch_id, TransferStatus& overall_status) {
        return getTransferStatus(batch_id, overall_status);
    }

    /* Replaces `stats` with the load of each RDMA NIC (empty without RDMA). */
    Status getNicLoadStats(std::vector<NicLoadStats>& stats) const {
        std::vector<tent_nic_load_stat_t> raw(8);
        for (;;) {
            size_t count = raw.size();
            if (tent_get_nic_load_stats(engine_, raw.data(), &count) != 0) return LastStatus();
            if (count <= raw.size()) {
                stats.clear();
                for (size_t i = 0; i < count; ++i)
                    stats.push_back(NicLoadStats{raw[i].device_name, raw[i].inflight_bytes, raw[i].ewma_bandwidth_bps});
                return Status::OK();
            }
            raw.resize(count);
        }
    }

    /* tent-rs: the C API handle behind this engine, for mixing the two APIs. */
    tent_engine_t native_handle() const { return engine_; }

   private:
    /* The Status for this thread's last failed call: upstream's code and the library's
     * message. */
    static Status LastStatus() {
        int code = tent_last_error_code();
        std::string msg = tent_rs_detail::FetchString([](char* buf, size_t len) { return tent_last_error(buf, len); });
        if (code <= 0 || code >= static_cast<int>(Status::Code::kMaxCode)) code = static_cast<int>(Status::Code::kInternalError);
        if (msg.empty()) msg = "the call failed without a message";
        return Status(static_cast<Status::Code>(code), msg);
    }

    static Status Check(int rc) { return rc == 0 ? Status::OK() : LastStatus(); }

    /* A per-thread buffer reused across calls, so a submit or a status list allocates only
     * when it is larger than any before it on this thread. */
    template <typename T>
    static std::vector<T>& Scratch() {
        static thread_local std::vector<T> buf;
        return buf;
    }

    /* The requests as zero-initialised C requests, in this thread's scratch buffer (never
     * NULL, so an empty list is a valid empty submit). */
    static tent_request_t* ToC(const std::vector<Request>& list) {
        std::vector<tent_request_t>& raw = Scratch<tent_request_t>();
        raw.resize(list.size() > 0 ? list.size() : 1);
        for (size_t i = 0; i < list.size(); ++i) {
            const Request& r = list[i];
            tent_request_t& c = raw[i];
            std::memset(&c, 0, sizeof c);
            c.opcode = r.opcode == Request::READ ? OPCODE_READ : OPCODE_WRITE;
            c.source = r.source;
            c.target_id = r.target_id;
            c.target_offset = r.target_offset;
            c.length = r.length;
            c.priority = r.priority;
            c.transport_hint = static_cast<int>(r.transport_hint);
        }
        return raw.data();
    }

    /* The requests' deadlines in this thread's scratch buffer, or NULL when none has one (the
     * plain submit then serves). */
    static const uint64_t* Deadlines(const std::vector<Request>& list) {
        bool any = false;
        for (const Request& r : list) any = any || r.deadline_ns != 0;
        if (!any) return nullptr;
        std::vector<uint64_t>& d = Scratch<uint64_t>();
        d.resize(list.size());
        for (size_t i = 0; i < list.size(); ++i) d[i] = list[i].deadline_ns;
        return d.data();
    }

    static Status ToC(const MemoryOptions& o, tent_memory_options_t& raw) {
        std::memset(&raw, 0, sizeof raw);
        if (o.location.size() >= sizeof raw.location)
            return Status::InvalidArgument("MemoryOptions::location is longer than 63 bytes");
        if (o.shm_path.size() >= sizeof raw.shm_path)
            return Status::InvalidArgument("MemoryOptions::shm_path is longer than 255 bytes");
        std::memcpy(raw.location, o.location.data(), o.location.size());
        std::memcpy(raw.shm_path, o.shm_path.data(), o.shm_path.size());
        raw.permission = static_cast<int>(o.perm);
        raw.transport_type = static_cast<int>(o.type);
        raw.shm_offset = o.shm_offset;
        raw.internal = o.internal ? 1 : 0;
        return Status::OK();
    }

    static TransferStatus FromC(const tent_status_t& raw) {
        return TransferStatus{static_cast<TransferStatusEnum>(raw.status), static_cast<size_t>(raw.transferred_bytes)};
    }

    tent_engine_t engine_ = nullptr;
};

}  // namespace tent
}  // namespace mooncake

#endif /* TENT_TRANSFER_ENGINE_CXX_H */
