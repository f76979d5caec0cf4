// tent-rs: the classic engine's metadata view (upstream's transfer_metadata.h), header-only
// over the classic C API. Its descriptor types keep upstream's fields for callers that name
// them; the object that TransferEngine::getMetadata() returns republishes this engine's
// segment descriptor on request. tent-rs writes, keeps alive and (on a restarted store)
// rewrites the descriptor itself, so callers need not, but may, as Mooncake Store does.
#ifndef TENT_RS_MOONCAKE_TRANSFER_METADATA_H
#define TENT_RS_MOONCAKE_TRANSFER_METADATA_H

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "../transfer_engine_c.h"
#include "common.h"
#include "topology.h"

// Declared in tent/transfer_engine.h too (the same declaration); the classic header lacks it.
extern "C" int tent_last_error(char* buf, size_t len);

namespace mooncake {
struct MetadataStoragePlugin;
struct HandShakePlugin;

#define P2PHANDSHAKE "P2PHANDSHAKE"

namespace tent_rs_detail {
// Owns one engine of the classic C API: destroyed when the last owner lets go, so that
// operations still running keep their engine (as upstream's shared implementation does).
struct EngineHandle {
    transfer_engine_t engine = nullptr;
    explicit EngineHandle(transfer_engine_t e) : engine(e) {}
    EngineHandle(const EngineHandle&) = delete;
    EngineHandle& operator=(const EngineHandle&) = delete;
    ~EngineHandle() {
        if (engine) destroyTransferEngine(engine);
    }
};

// Reads a string the snprintf way: `call(buf, len)` returns the full length (<= 0: none, or
// an error), so a string longer than the first buffer is fetched again at its size.
template <typename F>
inline std::string fetchString(F&& call) {
    char buf[512];
    int n = call(buf, sizeof(buf));
    if (n <= 0) return "";
    if (static_cast<size_t>(n) < sizeof(buf)) return std::string(buf, static_cast<size_t>(n));
    std::string big(static_cast<size_t>(n) + 1, '\0');
    int m = call(big.data(), big.size());
    big.resize(m <= 0 ? 0 : std::min(static_cast<size_t>(m), static_cast<size_t>(n)));
    return big;
}

// This thread's last error message of the library ("" when its last call succeeded).
inline std::string lastError() {
    return fetchString([](char* buf, size_t len) { return tent_last_error(buf, len); });
}

inline void logError(const std::string& what) { std::cerr << "tent-rs: " << what << "\n"; }
}  // namespace tent_rs_detail

class TransferMetadata {
   public:
    struct DeviceDesc {
        std::string name;
        uint16_t lid;
        std::string gid;
        std::string eid;
        bool operator==(const DeviceDesc& other) const = default;
    };

    struct BufferDesc {
        std::string name;
        uint64_t addr;
        uint64_t length;
        int32_t device_id = -1;
        using mr_key_t = uint32_t;
        std::vector<mr_key_t> lkey;
        std::vector<mr_key_t> rkey;
        std::string shm_name;
        uint64_t offset;
        std::vector<std::string> tseg;
        std::vector<uint32_t> l_seg_index;
        bool operator==(const BufferDesc& other) const = default;
    };

    struct NVMeoFBufferDesc {
        std::string file_path;
        uint64_t length;
        std::unordered_map<std::string, std::string> local_path_map;
        bool operator==(const NVMeoFBufferDesc& other) const = default;
    };

    struct RankInfoDesc {
        uint64_t rankId = 0xFFFFFFFF;
        std::string hostIp;
        uint64_t hostPort;
        uint64_t deviceLogicId;
        uint64_t devicePhyId;
        uint64_t deviceType = 5;
        std::string deviceIp;
        uint64_t devicePort;
        uint64_t pid;
        std::vector<std::string> endpoints;
        bool operator==(const RankInfoDesc& other) const = default;
    };

    using SegmentID = uint64_t;

    struct SegmentDesc {
        std::string name;
        std::string protocol;
        std::vector<DeviceDesc> devices;
        Topology topology;
        std::vector<BufferDesc> buffers;
        std::vector<NVMeoFBufferDesc> nvmeof_buffers;
        std::string cxl_name;
        uint64_t cxl_base_addr;
        std::string timestamp;
        RankInfoDesc rank_info;
        int tcp_data_port;
        int tcp_proto_version{1};
        std::string rdma_server_name;

        const std::string& nicPathServerName() const { return rdma_server_name.empty() ? name : rdma_server_name; }
        bool operator==(const SegmentDesc& other) const {
            return name == other.name && protocol == other.protocol && devices == other.devices &&
                   topology == other.topology && buffers == other.buffers && nvmeof_buffers == other.nvmeof_buffers &&
                   cxl_name == other.cxl_name && timestamp == other.timestamp;
        }
        bool operator!=(const SegmentDesc& other) const { return !(*this == other); }
        void dump() const { std::cerr << "segment " << name << " (" << buffers.size() << " buffers)\n"; }
    };

    struct RpcMetaDesc {
        std::string ip_or_host_name;
        uint16_t rpc_port;
        int sockfd;
    };

    struct HandShakeDesc {
        std::string payload;
        std::string local_nic_path;
        uint16_t local_lid = 0;
        std::string local_gid;
        std::string peer_nic_path;
        std::vector<uint32_t> qp_num;
        bool ready_ack = false;
        bool ready_ack_supported = false;
        std::string reply_msg;
    };

    struct NotifyDesc {
        std::string name;
        std::string notify_msg;
    };

    // tent-rs: the view of one engine; made by TransferEngine::init. It does not keep the
    // engine alive: once the engine is freed, every call fails with ERR_INVALID_ARGUMENT.
    TransferMetadata(std::weak_ptr<tent_rs_detail::EngineHandle> engine, RpcMetaDesc rpc)
        : engine_(std::move(engine)), local_rpc_meta_(std::move(rpc)) {}

    TransferMetadata(const TransferMetadata&) = delete;
    TransferMetadata& operator=(const TransferMetadata&) = delete;
    ~TransferMetadata() = default;

    // Writes this engine's segment descriptor to the metadata store now (nothing to do in P2P
    // mode). Only the local segment can be written. Returns 0 or a classic ERR_* code.
    int updateLocalSegmentDesc(SegmentID segment_id = 0) {
        if (segment_id != 0) return ERR_INVALID_ARGUMENT;
        auto e = engine_.lock();
        if (!e) return ERR_INVALID_ARGUMENT;
        int rc = tent_classic_republish(e->engine);
        if (rc != 0) tent_rs_detail::logError("updateLocalSegmentDesc: " + tent_rs_detail::lastError());
        return rc;
    }

    // tent-rs publishes no separate RPC entry: peers read the RPC address from the segment
    // descriptor, which updateLocalSegmentDesc writes. So there is nothing to write and this
    // returns 0 for a live engine.
    int rePublishRpcMetaEntry(const std::string& server_name) {
        (void)server_name;
        return engine_.lock() ? 0 : ERR_INVALID_ARGUMENT;
    }

    // The segment handle of `segment_name` (opened and its descriptor fetched), or
    // (SegmentID)ERR_INVALID_ARGUMENT.
    SegmentID getSegmentID(const std::string& segment_name) {
        auto e = engine_.lock();
        if (!e) return static_cast<SegmentID>(static_cast<int64_t>(ERR_INVALID_ARGUMENT));
        segment_id_t id = openSegment(e->engine, segment_name.c_str());
        return id < 0 ? static_cast<SegmentID>(static_cast<int64_t>(ERR_INVALID_ARGUMENT)) : static_cast<SegmentID>(id);
    }

    // Forgets cached descriptors, so each is fetched again on next use (all of them: the
    // engine caches by handle).
    int syncSegmentCache(const std::string& segment_name) {
        (void)segment_name;
        auto e = engine_.lock();
        return e ? syncSegmentCache(e->engine) : ERR_INVALID_ARGUMENT;
    }

    // Appends the received notifications to `notifies` (taking them). Returns 0.
    int getNotifies(std::vector<NotifyDesc>& notifies) {
        auto e = engine_.lock();
        if (!e) return ERR_INVALID_ARGUMENT;
        int n = 0;
        notify_msg_t* msgs = getNotifsFromEngine(e->engine, &n);
        for (int i = 0; i < n; ++i) notifies.push_back({msgs[i].name, msgs[i].msg});
        freeNotifsMsgBuf(msgs, n);
        return 0;
    }

    int sendProbe(const std::string& peer_server_name) {
        auto e = engine_.lock();
        if (!e) return ERR_INVALID_ARGUMENT;
        segment_id_t id = openSegment(e->engine, peer_server_name.c_str());
        return id < 0 ? id : tent_classic_probe(e->engine, id);
    }

    const RpcMetaDesc& localRpcMeta() const { return local_rpc_meta_; }

   private:
    // syncSegmentCache above hides the C function of the same name.
    static int syncSegmentCache(transfer_engine_t e) { return ::syncSegmentCache(e); }

    std::weak_ptr<tent_rs_detail::EngineHandle> engine_;
    RpcMetaDesc local_rpc_meta_;
};

}  // namespace mooncake

#endif  // TENT_RS_MOONCAKE_TRANSFER_METADATA_H
