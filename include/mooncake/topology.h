// tent-rs: the classic engine's NIC priority matrix (upstream's topology.h), header-only.
// A Topology holds, per memory location ("cpu:0", ...), the NICs preferred for it and the
// others. The engine discovers its NICs when it starts; TransferEngine::getLocalTopology()
// returns its matrix, read from the engine's showLinks JSON. A Topology made by the caller
// starts empty and is filled by parse(); discover(filter) keeps the NICs named in the filter.
#ifndef TENT_RS_MOONCAKE_TOPOLOGY_H
#define TENT_RS_MOONCAKE_TOPOLOGY_H

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common.h"

namespace mooncake {

struct TopologyEntry {
    std::string name;
    std::vector<std::string> preferred_hca;
    std::vector<std::string> avail_hca;

    bool operator==(const TopologyEntry& other) const = default;
};

using TopologyMatrix = std::unordered_map<std::string /* storage type */, TopologyEntry>;

namespace tent_rs_detail {

// Just enough JSON for the matrix: objects, arrays, strings (with escapes), and skipping any
// other value.
class MatrixJson {
   public:
    explicit MatrixJson(std::string_view text) : s_(text) {}

    // Reads {"location": [[preferred...], [avail...]], ...} into `out`.
    bool readMatrix(TopologyMatrix& out) {
        if (!eat('{')) return false;
        if (eat('}')) return end();
        do {
            std::string location;
            if (!readString(location) || !eat(':')) return false;
            TopologyEntry entry;
            entry.name = location;
            if (!eat('[') || !readStrings(entry.preferred_hca)) return false;
            if (eat(',') && !readStrings(entry.avail_hca)) return false;
            if (!eat(']')) return false;
            out[location] = std::move(entry);
        } while (eat(','));
        return eat('}') && end();
    }

    // Finds the member `key` of the top-level object and leaves the cursor on its value.
    bool seekMember(std::string_view key) {
        if (!eat('{')) return false;
        if (eat('}')) return false;
        do {
            std::string name;
            if (!readString(name) || !eat(':')) return false;
            if (name == key) return true;
            if (!skipValue()) return false;
        } while (eat(','));
        return false;
    }

    // The raw text of the value at the cursor.
    bool rawValue(std::string& out) {
        skipWs();
        size_t start = i_;
        if (!skipValue()) return false;
        out.assign(s_.substr(start, i_ - start));
        return true;
    }

    // Collects the string member `field` of each object of the array at the cursor.
    bool readFieldOfEach(std::string_view field, std::vector<std::string>& out) {
        if (!eat('[')) return false;
        if (eat(']')) return true;
        do {
            if (!eat('{')) return false;
            if (!eat('}')) {
                do {
                    std::string name;
                    if (!readString(name) || !eat(':')) return false;
                    skipWs();
                    if (name == field && i_ < s_.size() && s_[i_] == '"') {
                        std::string v;
                        if (!readString(v)) return false;
                        out.push_back(std::move(v));
                    } else if (!skipValue()) {
                        return false;
                    }
                } while (eat(','));
                if (!eat('}')) return false;
            }
        } while (eat(','));
        return eat(']');
    }

   private:
    void skipWs() {
        while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
    }
    bool eat(char c) {
        skipWs();
        if (i_ < s_.size() && s_[i_] == c) {
            ++i_;
            return true;
        }
        return false;
    }
    bool end() {
        skipWs();
        return i_ == s_.size();
    }
    bool readString(std::string& out) {
        if (!eat('"')) return false;
        out.clear();
        while (i_ < s_.size()) {
            char c = s_[i_++];
            if (c == '"') return true;
            if (c != '\\') {
                out += c;
                continue;
            }
            if (i_ >= s_.size()) return false;
            char e = s_[i_++];
            switch (e) {
                case 'n': out += '\n'; break;
                case 't': out += '\t'; break;
                case 'r': out += '\r'; break;
                case 'b': out += '\b'; break;
                case 'f': out += '\f'; break;
                case 'u':
                    // Names here are ASCII; keep a \u escape's low byte.
                    if (i_ + 4 > s_.size()) return false;
                    out += static_cast<char>(std::stoi(std::string(s_.substr(i_ + 2, 2)), nullptr, 16));
                    i_ += 4;
                    break;
                default: out += e;
            }
        }
        return false;
    }
    bool readStrings(std::vector<std::string>& out) {
        if (!eat('[')) return false;
        if (eat(']')) return true;
        do {
            std::string v;
            if (!readString(v)) return false;
            out.push_back(std::move(v));
        } while (eat(','));
        return eat(']');
    }
    bool skipValue(int depth = 0) {
        if (depth > 64) return false;
        skipWs();
        if (i_ >= s_.size()) return false;
        char c = s_[i_];
        if (c == '"') {
            std::string ignored;
            return readString(ignored);
        }
        if (c == '{' || c == '[') {
            char close = c == '{' ? '}' : ']';
            ++i_;
            if (eat(close)) return true;
            do {
                if (c == '{') {
                    std::string ignored;
                    if (!readString(ignored) || !eat(':')) return false;
                }
                if (!skipValue(depth + 1)) return false;
            } while (eat(','));
            return eat(close);
        }
        size_t start = i_;
        while (i_ < s_.size() && s_[i_] != ',' && s_[i_] != '}' && s_[i_] != ']' &&
               !std::isspace(static_cast<unsigned char>(s_[i_])))
            ++i_;
        return i_ > start;
    }

    std::string_view s_;
    size_t i_ = 0;
};

inline void appendJsonString(std::string& out, const std::string& s) {
    out += '"';
    for (char c : s) {
        if (c == '"' || c == '\\') out += '\\';
        out += c;
    }
    out += '"';
}

}  // namespace tent_rs_detail

class Topology {
   public:
    Topology() = default;
    ~Topology() = default;

    bool empty() const { return matrix_.empty(); }

    void clear() {
        matrix_.clear();
        hca_list_.clear();
        discovered_.clear();
    }

    int discover() { return discover(std::vector<std::string>{}); }

    // Keeps the NICs named in `filter` (all with an empty filter) of what the engine
    // discovered; a caller-made Topology has discovered nothing and stays empty. Returns 0.
    int discover(const std::vector<std::string>& filter) {
        matrix_.clear();
        auto keep = [&](const std::string& hca) {
            return filter.empty() || std::find(filter.begin(), filter.end(), hca) != filter.end();
        };
        for (const auto& [location, entry] : discovered_) {
            TopologyEntry e{entry.name, {}, {}};
            std::copy_if(entry.preferred_hca.begin(), entry.preferred_hca.end(), std::back_inserter(e.preferred_hca),
                         keep);
            std::copy_if(entry.avail_hca.begin(), entry.avail_hca.end(), std::back_inserter(e.avail_hca), keep);
            matrix_[location] = std::move(e);
        }
        resolve();
        return 0;
    }

    // Reads a matrix in upstream's JSON form: {"cpu:0": [["nic0"], ["nic1"]], ...}. Returns 0,
    // or ERR_MALFORMED_JSON (the Topology unchanged).
    int parse(const std::string& topology_json) {
        TopologyMatrix m;
        tent_rs_detail::MatrixJson reader(topology_json);
        if (!reader.readMatrix(m)) return ERR_MALFORMED_JSON;
        matrix_ = std::move(m);
        resolve();
        return 0;
    }

    // Drops a NIC from every entry.
    int disableDevice(const std::string& device_name) {
        for (auto& [_, e] : matrix_) {
            std::erase(e.preferred_hca, device_name);
            std::erase(e.avail_hca, device_name);
        }
        resolve();
        return 0;
    }

    // The matrix as JSON, in the form parse() reads (locations in sorted order).
    std::string toString() const {
        std::map<std::string, const TopologyEntry*> sorted;
        for (const auto& [k, v] : matrix_) sorted[k] = &v;
        std::string out = "{";
        bool first = true;
        for (const auto& [k, v] : sorted) {
            if (!first) out += ',';
            first = false;
            tent_rs_detail::appendJsonString(out, k);
            out += ":[";
            for (const auto* list : {&v->preferred_hca, &v->avail_hca}) {
                if (list == &v->avail_hca) out += ',';
                out += '[';
                for (size_t i = 0; i < list->size(); ++i) {
                    if (i) out += ',';
                    tent_rs_detail::appendJsonString(out, (*list)[i]);
                }
                out += ']';
            }
            out += ']';
        }
        return out + "}";
    }

    bool operator==(const Topology& other) const { return matrix_ == other.matrix_; }
    bool operator!=(const Topology& other) const { return !(*this == other); }

    // The index in getHcaList() of a NIC for `storage_type` (a preferred one when there is
    // one, chosen by `retry_count`), or ERR_DEVICE_NOT_FOUND. The engine picks NICs itself;
    // this is for callers that ask.
    int selectDevice(const std::string storage_type, int retry_count = 0) {
        auto it = matrix_.find(storage_type);
        if (it == matrix_.end()) return ERR_DEVICE_NOT_FOUND;
        const auto& list = it->second.preferred_hca.empty() ? it->second.avail_hca : it->second.preferred_hca;
        if (list.empty()) return ERR_DEVICE_NOT_FOUND;
        const auto& name = list[static_cast<size_t>(retry_count < 0 ? 0 : retry_count) % list.size()];
        auto pos = std::find(hca_list_.begin(), hca_list_.end(), name);
        return pos == hca_list_.end() ? ERR_DEVICE_NOT_FOUND : static_cast<int>(pos - hca_list_.begin());
    }
    int selectDevice(const std::string storage_type, std::string_view hint, int retry_count = 0) {
        auto pos = std::find(hca_list_.begin(), hca_list_.end(), hint);
        if (!hint.empty() && pos != hca_list_.end()) return static_cast<int>(pos - hca_list_.begin());
        return selectDevice(storage_type, retry_count);
    }
    int selectDeviceByLocalHca(const std::string storage_type, std::string_view local_hca, int retry_count = 0) {
        return selectDevice(storage_type, local_hca, retry_count);
    }

    TopologyMatrix getMatrix() const { return matrix_; }

    const std::vector<std::string>& getHcaList() const { return hca_list_; }

    // tent-rs: fills this Topology from the engine's showLinks JSON ("topology" member: the
    // matrix; "local_nics": the NICs). Returns 0 or ERR_MALFORMED_JSON.
    int loadFromLinksJson(const std::string& links_json) {
        TopologyMatrix m;
        std::string matrix_text;
        tent_rs_detail::MatrixJson seek(links_json);
        if (seek.seekMember("topology") && seek.rawValue(matrix_text)) {
            tent_rs_detail::MatrixJson reader(matrix_text);
            if (!reader.readMatrix(m)) return ERR_MALFORMED_JSON;
        }
        std::vector<std::string> nics;
        tent_rs_detail::MatrixJson nic_reader(links_json);
        if (nic_reader.seekMember("local_nics") && !nic_reader.readFieldOfEach("device", nics))
            return ERR_MALFORMED_JSON;
        discovered_ = m;
        matrix_ = std::move(m);
        resolve();
        for (const auto& n : nics)
            if (std::find(hca_list_.begin(), hca_list_.end(), n) == hca_list_.end()) hca_list_.push_back(n);
        return 0;
    }

   private:
    // The NIC list: every NIC of the matrix, in first-seen order of the sorted locations.
    void resolve() {
        hca_list_.clear();
        std::map<std::string, const TopologyEntry*> sorted;
        for (const auto& [k, v] : matrix_) sorted[k] = &v;
        for (const auto& [_, e] : sorted)
            for (const auto* list : {&e->preferred_hca, &e->avail_hca})
                for (const auto& h : *list)
                    if (std::find(hca_list_.begin(), hca_list_.end(), h) == hca_list_.end()) hca_list_.push_back(h);
    }

    TopologyMatrix matrix_;
    std::vector<std::string> hca_list_;
    TopologyMatrix discovered_;
};

}  // namespace mooncake

#endif  // TENT_RS_MOONCAKE_TOPOLOGY_H
