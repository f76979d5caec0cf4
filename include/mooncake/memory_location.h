// tent-rs: memory locations as upstream's classic memory_location.h names them, header-only.
// "*" lets the engine find a buffer's location itself; "segments:<page>:<n0>,<n1>,..." splits a
// buffer evenly across NUMA nodes.
#ifndef TENT_RS_MOONCAKE_MEMORY_LOCATION_H
#define TENT_RS_MOONCAKE_MEMORY_LOCATION_H

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common.h"

const int pagesize = 4096;

namespace mooncake {

struct MemoryLocationEntry {
    uint64_t start;
    size_t len;
    std::string location;
};

const static std::string kWildcardLocation = "*";
const static std::string kSegmentsLocationPrefix = "segments:";

struct SegmentsLocationInfo {
    size_t page_size;
    std::vector<int> numa_nodes;
};

// The engine probes locations itself when memory is registered, so this reports the whole
// range as one entry at "*" (upstream asks the kernel page by page).
inline const std::vector<MemoryLocationEntry> getMemoryLocation(void* start, size_t len, bool only_first_page) {
    (void)only_first_page;
    return {MemoryLocationEntry{reinterpret_cast<uint64_t>(start), len, kWildcardLocation}};
}

inline std::string buildSegmentsLocation(size_t page_size, const std::vector<int>& numa_nodes) {
    std::string out = kSegmentsLocationPrefix + std::to_string(page_size) + ":";
    for (size_t i = 0; i < numa_nodes.size(); ++i) {
        if (i) out += ',';
        out += std::to_string(numa_nodes[i]);
    }
    return out;
}

inline bool parseSegmentsLocation(const std::string& name, SegmentsLocationInfo& info) {
    if (name.compare(0, kSegmentsLocationPrefix.size(), kSegmentsLocationPrefix) != 0) return false;
    std::string_view body = std::string_view(name).substr(kSegmentsLocationPrefix.size());
    size_t colon = body.find(':');
    if (colon == std::string_view::npos) return false;
    auto page = parseFromString<size_t>(body.substr(0, colon));
    if (!page) return false;
    std::vector<int> nodes;
    std::string_view rest = body.substr(colon + 1);
    while (!rest.empty()) {
        size_t comma = rest.find(',');
        std::string_view tok = rest.substr(0, comma);
        if (!tok.empty()) {
            auto n = parseFromString<int>(tok);
            if (!n) return false;
            nodes.push_back(*n);
        }
        if (comma == std::string_view::npos) break;
        rest.remove_prefix(comma + 1);
    }
    info.page_size = *page;
    info.numa_nodes = std::move(nodes);
    return true;
}

inline std::string resolveSegmentsLocation(const SegmentsLocationInfo& info, uint64_t buffer_length,
                                           uint64_t offset) {
    size_t n = info.numa_nodes.size();
    if (n == 0 || buffer_length / n == 0) return kWildcardLocation;
    size_t region = static_cast<size_t>(offset / (buffer_length / n));
    if (region >= n) region = n - 1;
    return "cpu:" + std::to_string(info.numa_nodes[region]);
}

}  // namespace mooncake

#endif  // TENT_RS_MOONCAKE_MEMORY_LOCATION_H
