/*
 * tent-rs: the value types of the C++ class mooncake::tent::TransferEngine
 * (tent/transfer_engine.h). Names, field order, defaults and enum values follow upstream
 * Mooncake TENT's tent/common/types.h, so designated initializers and aggregate code written
 * against upstream compile unchanged. Header-only.
 */
#ifndef TENT_TYPES_H
#define TENT_TYPES_H

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace mooncake {
namespace tent {

using BatchID = uint64_t;
using SegmentID = uint64_t;

/* Request priorities (Request::priority). */
static constexpr uint8_t PRIO_HIGH = 0;
static constexpr uint8_t PRIO_MEDIUM = 1;
static constexpr uint8_t PRIO_LOW = 2;

/* A notification: who sent it (`name`, as the sender chose it) and its text. */
struct Notification {
    std::string name;
    std::string msg;
};

/* The engine's own segment (the C header defines the same value). */
#ifndef LOCAL_SEGMENT_ID
#define LOCAL_SEGMENT_ID (0ull)
#endif

/* The transports, with the values of the C API's TRANSPORT_* constants. */
enum TransportType : int {
    UNSPEC = 0,
    RDMA,
    MNNVL,
    SHM,
    NVLINK,
    GDS,
    IOURING,
    TCP,
    AscendDirect,
    SUNRISE_LINK,
    TPU,
    UB,
    MPCOMM,
    kNumTransportTypes, /* not a transport: the count; stays last */
};

inline constexpr int kSupportedTransportTypes = static_cast<int>(kNumTransportTypes);

/* A C transport hint as a TransportType; out-of-range values mean "no hint". */
inline TransportType c_to_transport_hint(int v) {
    return (v < 0 || v >= kSupportedTransportTypes) ? UNSPEC : static_cast<TransportType>(v);
}

/* The config name of a transport ("tcp", "io_uring", ...); "unknown" for the count. */
inline const char* transportTypeName(TransportType type) {
    switch (type) {
        case UNSPEC: return "unspec";
        case RDMA: return "rdma";
        case MNNVL: return "mnnvl";
        case SHM: return "shm";
        case NVLINK: return "nvlink";
        case GDS: return "gds";
        case IOURING: return "io_uring";
        case TCP: return "tcp";
        case AscendDirect: return "ascend";
        case SUNRISE_LINK: return "sunrise_link";
        case TPU: return "tpu";
        case UB: return "ub";
        case MPCOMM: return "mpcomm";
        case kNumTransportTypes: break;
    }
    return "unknown";
}

/* The inverse of transportTypeName; an unknown name is UNSPEC. */
inline TransportType parseTransportType(const std::string& str) {
    for (int t = 1; t < kSupportedTransportTypes; ++t) {
        if (str == transportTypeName(static_cast<TransportType>(t))) return static_cast<TransportType>(t);
    }
    return UNSPEC;
}

/* Why a request is made (carried for upstream compatibility; tent-rs does not act on it). */
enum class IntentType : int {
    INTENT_UNSPEC = 0,
    FOREGROUND_GET,
    BACKGROUND_PREFETCH,
    MIGRATION,
    CHECKPOINT,
    WEIGHT_LOADING,
    STAGING_INTERNAL,
};

/* One transfer: `length` bytes between local `source` and `target_offset` (an absolute address
 * in the target process, as getSegmentInfo reports it) of segment `target_id`. */
struct Request {
    enum OpCode { READ, WRITE };
    OpCode opcode;
    void* source;
    SegmentID target_id;
    uint64_t target_offset;
    size_t length;
    int priority = PRIO_HIGH;
    std::optional<std::string> policy_name = std::nullopt; /* accepted, not used by tent-rs */
    TransportType transport_hint = UNSPEC;  /* UNSPEC: the engine chooses */
    uint64_t deadline_ns = 0;               /* steady_clock ns; 0: none (see enable_runtime_queue) */
    IntentType intent_type = IntentType::INTENT_UNSPEC;
};

/* Task states, with the values of the C API's STATUS_* constants (INITIAL is STATUS_WAITING). */
enum TransferStatusEnum { INITIAL, PENDING, INVALID, CANCELED, COMPLETED, TIMEOUT, FAILED };

struct TransferStatus {
    TransferStatusEnum s;
    size_t transferred_bytes;
};

/* Load of one RDMA NIC. */
struct NicLoadStats {
    std::string device_name;
    uint64_t inflight_bytes{0};
    double ewma_bandwidth_bps{0.0};
};

/* Who may access registered memory, with the values of the C API's PERM_* constants. */
enum Permission {
    kLocalReadWrite,
    kGlobalReadOnly,
    kGlobalReadWrite,
};

using Location = std::string;
inline const std::string kWildcardLocation = "*";

/* Options of the advanced allocateLocalMemory / registerLocalMemory forms. */
struct MemoryOptions {
    Location location = kWildcardLocation;
    Permission perm = kGlobalReadWrite;
    TransportType type = UNSPEC;
    std::string shm_path = "";
    size_t shm_offset = 0;
    bool internal = false;
};

/* openSegment with this prefix and a path opens a file on this machine as a segment. */
inline const std::string kLocalFileSegmentPrefix = "file://";

/* What getSegmentInfo reports about a segment. */
struct SegmentInfo {
    enum Type { Memory, File };
    struct Buffer {
        uint64_t base, length;
        Location location;
    };
    Type type;
    std::vector<Buffer> buffers;
};

}  // namespace tent
}  // namespace mooncake

#endif /* TENT_TYPES_H */
