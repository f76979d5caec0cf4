// tent-rs: the classic engine's process-wide settings (upstream's config.h), header-only.
// globalConfig() is one object per process (a function-local static of an inline function).
// tent-rs reads its own settings from its config and environment; of these fields only
// handshake_port (MC_HANDSHAKE_PORT) and the RPC port range feed the helpers below. The rest
// are kept so that callers that read or set them (Store sets ascend_* flags, reads
// max_mr_size) compile and behave as before.
#ifndef TENT_RS_MOONCAKE_CONFIG_H
#define TENT_RS_MOONCAKE_CONFIG_H

#if __has_include(<glog/logging.h>)
#include <glog/logging.h>  // upstream's header brings glog in; callers may rely on it
#endif
#if __has_include(<infiniband/verbs.h>)
#include <infiniband/verbs.h>
#define TENT_RS_HAVE_IBV_MTU 1
#endif

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mooncake {

enum class EndpointStoreType {
    FIFO = 0,
    SIEVE = 1,
};

enum class EfaNicSelection {
    ALL = 0,
    LOCAL = 1,
};

// Field order, types and defaults as upstream's (callers may use designated initializers).
struct GlobalConfig {
    size_t num_cq_per_ctx = 1;
    size_t num_comp_channels_per_ctx = 1;
    uint8_t port = 1;
    int gid_index = -1;
    uint16_t pkey_index = 0;
    uint64_t max_mr_size = 0x10000000000;
    size_t max_cqe = 4096;
    int max_ep_per_ctx = 65536;
    size_t num_qp_per_ep = 2;
    size_t max_sge = 4;
    size_t max_wr = 256;
    bool max_wr_from_env = false;
    size_t max_inline = 64;
#ifdef TENT_RS_HAVE_IBV_MTU
    ibv_mtu mtu_length = IBV_MTU_4096;
#else
    int mtu_length = 5;  // IBV_MTU_4096, without the verbs header
#endif
    uint16_t handshake_port = 12001;
    int workers_per_ctx = 2;
    size_t slice_size = 65536;
    int retry_cnt = 9;
    int auto_gid_max_retries = 2;
    int handshake_listen_backlog = 128;
    int handshake_connect_timeout = 5;
    uint64_t rdma_rail_pause_seconds = 30;
    bool metacache = true;
    uint64_t te_metadata_refresh_interval_seconds = 0;
    int log_level = 0;  // google::INFO
    bool trace = false;
    int64_t slice_timeout = -1;
    int conn_pause_ttl_ms = 0;
    uint16_t rpc_min_port = 15000;
    uint16_t rpc_max_port = 17000;
    bool use_ipv6 = false;
    size_t fragment_limit = 16384;
    bool enable_dest_device_affinity = false;
    bool enable_hca_peer_affinity = false;
    std::unordered_map<std::string, std::vector<std::string>> nic_peer_affinity;
    bool log_rdma_slice_affinity = false;
    bool track_rdma_posted_slices = false;
    int parallel_reg_mr = -1;
    size_t max_concurrent_reg_mr = 0;
    EfaNicSelection efa_nic_selection = EfaNicSelection::ALL;
    size_t eic_max_block_size = 64UL * 1024 * 1024;
    EndpointStoreType endpoint_store_type = EndpointStoreType::SIEVE;
    int ib_traffic_class = -1;
    int ib_service_level = -1;
    std::vector<uint16_t> mlx5_qp_udp_sports;
    bool mlx5_qp_lag_port_balance = false;
    int ib_pci_relaxed_ordering_mode = 1;
    bool ascend_use_fabric_mem = false;
    bool ascend_agent_mode = false;
    bool sunrise_use_device_mem = false;
    bool ascend_store_te_init = false;
    size_t num_jfc_per_ctx = 2;
    size_t num_jfce_per_ctx = 2;
    int eid_index = 0;
    uint64_t max_seg_size = 0x10000000000;
    size_t max_jfc_e = 4096;
    size_t num_jetty_per_ep = 1;
};

struct RpcCommunicatorConfig {
    std::string listen_address;
    size_t thread_count = 0;
    size_t timeout_seconds = 30;
    size_t pool_size = 100;
};

// Rejects ports below 1024, above 65535, in Linux's ephemeral range (32768-60999) and an
// inverted range: the defaults are returned instead, with a warning on stderr.
inline std::pair<int, int> ValidatePortRange(int min_port, int max_port, int default_min, int default_max) {
    auto usable = [](int p) { return p >= 1024 && p <= 65535 && !(p >= 32768 && p <= 60999); };
    if (!usable(min_port) || !usable(max_port) || min_port > max_port) {
        std::cerr << "tent-rs: invalid port range [" << min_port << ", " << max_port << "], using ["
                  << default_min << ", " << default_max << "]\n";
        return {default_min, default_max};
    }
    return {min_port, max_port};
}

namespace tent_rs_detail {
inline bool envPort(const char* name, int& out) {
    const char* v = std::getenv(name);
    if (!v || !*v) return false;
    char* end = nullptr;
    long p = std::strtol(v, &end, 10);
    if (*end != '\0' || p <= 0 || p > 65535) return false;
    out = static_cast<int>(p);
    return true;
}
}  // namespace tent_rs_detail

// Reads the few settings the helpers use from the environment, as upstream reads them:
// MC_HANDSHAKE_PORT, MC_MIN_RPC_PORT / MC_MAX_RPC_PORT (or the older MC_MIN_PRC_PORT /
// MC_MAX_PRC_PORT), MC_USE_IPV6.
inline void loadGlobalConfig(GlobalConfig& config) {
    int p = 0;
    if (tent_rs_detail::envPort("MC_HANDSHAKE_PORT", p)) config.handshake_port = static_cast<uint16_t>(p);
    int lo = config.rpc_min_port, hi = config.rpc_max_port;
    bool has_lo = tent_rs_detail::envPort("MC_MIN_RPC_PORT", lo) || tent_rs_detail::envPort("MC_MIN_PRC_PORT", lo);
    bool has_hi = tent_rs_detail::envPort("MC_MAX_RPC_PORT", hi) || tent_rs_detail::envPort("MC_MAX_PRC_PORT", hi);
    if (has_lo || has_hi) {
        auto [a, b] = ValidatePortRange(lo, hi, 15000, 17000);
        config.rpc_min_port = static_cast<uint16_t>(a);
        config.rpc_max_port = static_cast<uint16_t>(b);
    }
    if (std::getenv("MC_USE_IPV6")) config.use_ipv6 = true;
}

// The process's settings, loaded from the environment on first use.
inline GlobalConfig& globalConfig() {
    static GlobalConfig config = [] {
        GlobalConfig c;
        loadGlobalConfig(c);
        return c;
    }();
    return config;
}

inline void dumpGlobalConfig() {
    const auto& c = globalConfig();
    std::cerr << "tent-rs classic settings: handshake_port=" << c.handshake_port << " rpc_ports=[" << c.rpc_min_port
              << ", " << c.rpc_max_port << "] use_ipv6=" << c.use_ipv6 << "\n";
}

#ifdef TENT_RS_HAVE_IBV_MTU
// The engine sizes its RDMA resources from the device itself; nothing to update here.
inline void updateGlobalConfig(ibv_device_attr& device_attr) { (void)device_attr; }
#endif

// The port a server name without one means: MC_HANDSHAKE_PORT, else 12001.
inline uint16_t getDefaultHandshakePort() { return globalConfig().handshake_port; }

}  // namespace mooncake

#endif  // TENT_RS_MOONCAKE_CONFIG_H
