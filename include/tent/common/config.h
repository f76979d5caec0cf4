/*
 * tent-rs: mooncake::tent::Config, the per-engine configuration upstream's C++ class
 * mooncake::tent::TransferEngine takes (std::shared_ptr<Config>). A JSON tree addressed by
 * "/" paths ("transports/tcp/enable"), with upstream's method names: set, setFromString, get,
 * getArray, contains, load, loadFile, dump, dumpSubtree.
 *
 * The tree lives in the library (a tent_config_t from tent_config_create); this class only
 * turns C++ values into JSON text and back, so JSON is parsed in one place, the same way the
 * engine reads it. Header-only.
 */
/* Outside the guard on purpose: if this header is included first, the C API (and, through its
 * trailer, the C++ class) must still be declared before anything below needs it. */
#include "tent/transfer_engine.h"

#ifndef TENT_CONFIG_H
#define TENT_CONFIG_H

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "tent/common/status.h"
#include "tent/common/types.h"

namespace mooncake {
namespace tent {

class Config {
   public:
    Config() : handle_(tent_config_create()) {}
    ~Config() { tent_config_destroy(handle_); }
    Config(const Config&) = delete;
    Config& operator=(const Config&) = delete;

    /* Sets the value at `key_path` (intermediate objects are made as needed). Takes bool,
     * integers, floating point, strings and std::vector of those (nested vectors too). */
    template <typename T>
    void set(const std::string& key_path, const T& value) {
        std::string json;
        AppendJson(json, value);
        tent_config_set(handle_, key_path.c_str(), json.c_str());
    }

    /* Sets `key` from text, typed as upstream types it: "true"/"false" (any case) become
     * booleans, a whole integer becomes a number, anything else stays a string. */
    void setFromString(const std::string& key, const std::string& value) {
        tent_config_set_from_string(handle_, key.c_str(), value.c_str());
    }

    /* The value at `key_path` as T (bool, an integer, floating point, std::string or a
     * std::vector of those), or `default_value` when it is unset, null or of another type. */
    template <typename T>
    T get(const std::string& key_path, const T& default_value) const {
        T out{};
        if (!Read(key_path, out)) return default_value;
        return out;
    }

    std::string get(const std::string& key, const char* def) const { return get<std::string>(key, std::string(def)); }

    bool contains(const std::string& key_path) const {
        return tent_config_get(handle_, key_path.c_str(), 1, nullptr, 0) >= 0;
    }

    template <typename T>
    std::vector<T> getArray(const std::string& key) const {
        return get<std::vector<T>>(key, {});
    }

    /* Replaces the tree with the JSON object `content`; InvalidArgument (and no change) when
     * it is not one. */
    Status load(const std::string& content) {
        if (tent_config_load(handle_, content.c_str()) == 0) return Status::OK();
        return Status::InvalidArgument(LastError());
    }

    /* Replaces the tree with the JSON object in the file at `file_path`. */
    Status loadFile(const std::string& file_path) {
        if (tent_config_load_file(handle_, file_path.c_str()) == 0) return Status::OK();
        return Status::InvalidArgument(LastError());
    }

    /* The whole tree as JSON, indented by `indent` spaces (compact when negative). */
    std::string dump(int indent = 2) const {
        return Fetch([&](char* buf, size_t len) { return tent_config_dump(handle_, indent, buf, len); });
    }

    /* The JSON of the value at `key_path` into `*out`; false when it is unset. */
    bool dumpSubtree(const std::string& key_path, std::string* out) const {
        if (!out || key_path.empty() || !contains(key_path)) return false;
        *out = Fetch([&](char* buf, size_t len) { return tent_config_get(handle_, key_path.c_str(), 1, buf, len); });
        return true;
    }

    /* tent-rs: the library's handle of this configuration (for tent_create_engine_with_config). */
    tent_config_t handle() const { return handle_; }

   private:
    template <typename F>
    static std::string Fetch(F&& call) {
        char small[256];
        int n = call(small, sizeof small);
        if (n < 0) return std::string();
        if (static_cast<size_t>(n) < sizeof small) return std::string(small, static_cast<size_t>(n));
        std::string big(static_cast<size_t>(n) + 1, '\0');
        int m = call(&big[0], big.size());
        big.resize(m < 0 ? 0 : std::min(static_cast<size_t>(m), static_cast<size_t>(n)));
        return big;
    }

    static std::string LastError() {
        char buf[512];
        int n = tent_last_error(buf, sizeof buf);
        return n > 0 ? std::string(buf) : std::string("config error");
    }

    /* The value at `key` as JSON text (`as_json`) or, for a string value, its text; false when
     * unset. */
    bool Text(const std::string& key, int as_json, std::string& out) const {
        if (tent_config_get(handle_, key.c_str(), as_json, nullptr, 0) < 0) return false;
        out = Fetch([&](char* buf, size_t len) { return tent_config_get(handle_, key.c_str(), as_json, buf, len); });
        return true;
    }

    template <typename T>
    bool Read(const std::string& key, T& out) const {
        std::string text;
        if constexpr (std::is_same_v<T, std::string>) {
            // A string value as its text; any other value would be a type mismatch upstream.
            std::string json;
            if (!Text(key, 1, json) || json.empty() || json[0] != '"') return false;
            return Text(key, 0, out);
        } else {
            if (!Text(key, 1, text)) return false;
            size_t pos = 0;
            return ParseValue(text, pos, out) && SkipSpace(text, pos) == text.size();
        }
    }

    static size_t SkipSpace(const std::string& s, size_t& pos) {
        while (pos < s.size() && (s[pos] == ' ' || s[pos] == '\n' || s[pos] == '\t' || s[pos] == '\r')) ++pos;
        return pos;
    }

    /* Readers of the compact JSON the library returns: one value at `pos`, which moves past
     * it; false when the value is not of the requested type. */
    static bool ParseValue(const std::string& s, size_t& pos, bool& out) {
        SkipSpace(s, pos);
        if (s.compare(pos, 4, "true") == 0) return out = true, pos += 4, true;
        if (s.compare(pos, 5, "false") == 0) return out = false, pos += 5, true;
        return false;
    }

    template <typename T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool>, int> = 0>
    static bool ParseValue(const std::string& s, size_t& pos, T& out) {
        SkipSpace(s, pos);
        if (pos >= s.size() || !(s[pos] == '-' || (s[pos] >= '0' && s[pos] <= '9'))) return false;
        const char* start = s.c_str() + pos;
        char* end = nullptr;
        errno = 0;
        if constexpr (std::is_floating_point_v<T>) {
            double v = std::strtod(start, &end);
            out = static_cast<T>(v);
        } else if constexpr (std::is_signed_v<T>) {
            long long v = std::strtoll(start, &end, 10);
            if (*end == '.' || *end == 'e' || *end == 'E') return false;
            if (v < static_cast<long long>(std::numeric_limits<T>::min()) ||
                v > static_cast<long long>(std::numeric_limits<T>::max()))
                return false;
            out = static_cast<T>(v);
        } else {
            if (*start == '-') return false;
            unsigned long long v = std::strtoull(start, &end, 10);
            if (*end == '.' || *end == 'e' || *end == 'E') return false;
            if (v > static_cast<unsigned long long>(std::numeric_limits<T>::max())) return false;
            out = static_cast<T>(v);
        }
        if (errno == ERANGE || end == start) return false;
        pos += static_cast<size_t>(end - start);
        return true;
    }

    static bool ParseValue(const std::string& s, size_t& pos, std::string& out) {
        SkipSpace(s, pos);
        if (pos >= s.size() || s[pos] != '"') return false;
        out.clear();
        for (++pos; pos < s.size(); ++pos) {
            char c = s[pos];
            if (c == '"') return ++pos, true;
            if (c != '\\') {
                out += c;
                continue;
            }
            if (++pos >= s.size()) return false;
            switch (s[pos]) {
                case 'n': out += '\n'; break;
                case 't': out += '\t'; break;
                case 'r': out += '\r'; break;
                case 'b': out += '\b'; break;
                case 'f': out += '\f'; break;
                case 'u': {
                    if (pos + 4 >= s.size()) return false;
                    unsigned cp = static_cast<unsigned>(std::strtoul(s.substr(pos + 1, 4).c_str(), nullptr, 16));
                    pos += 4;
                    // Only the basic plane is decoded; the library escapes nothing above it.
                    if (cp < 0x80) {
                        out += static_cast<char>(cp);
                    } else if (cp < 0x800) {
                        out += static_cast<char>(0xc0 | (cp >> 6));
                        out += static_cast<char>(0x80 | (cp & 0x3f));
                    } else {
                        out += static_cast<char>(0xe0 | (cp >> 12));
                        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
                        out += static_cast<char>(0x80 | (cp & 0x3f));
                    }
                    break;
                }
                default: out += s[pos]; break; /* \" \\ \/ */
            }
        }
        return false;
    }

    template <typename T>
    static bool ParseValue(const std::string& s, size_t& pos, std::vector<T>& out) {
        SkipSpace(s, pos);
        if (pos >= s.size() || s[pos] != '[') return false;
        ++pos;
        out.clear();
        if (SkipSpace(s, pos) < s.size() && s[pos] == ']') return ++pos, true;
        for (;;) {
            T item{};
            if (!ParseValue(s, pos, item)) return false;
            out.push_back(std::move(item));
            SkipSpace(s, pos);
            if (pos >= s.size()) return false;
            if (s[pos] == ']') return ++pos, true;
            if (s[pos] != ',') return false;
            ++pos;
        }
    }

    /* Writers: C++ values as JSON text. */
    static void AppendJson(std::string& out, bool v) { out += v ? "true" : "false"; }

    template <typename T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool>, int> = 0>
    static void AppendJson(std::string& out, T v) {
        if constexpr (std::is_floating_point_v<T>) {
            // JSON has no NaN or infinity; upstream's library stores them as null.
            if (!std::isfinite(static_cast<double>(v))) {
                out += "null";
                return;
            }
            char buf[64];
            std::snprintf(buf, sizeof buf, "%.17g", static_cast<double>(v));
            out += buf;
        } else {
            out += std::to_string(v);
        }
    }

    static void AppendJson(std::string& out, std::string_view v) {
        out += '"';
        for (char c : v) {
            switch (c) {
                case '"': out += "\\\""; break;
                case '\\': out += "\\\\"; break;
                case '\n': out += "\\n"; break;
                case '\t': out += "\\t"; break;
                case '\r': out += "\\r"; break;
                default:
                    if (static_cast<unsigned char>(c) < 0x20) {
                        char buf[8];
                        std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
                        out += buf;
                    } else {
                        out += c;
                    }
            }
        }
        out += '"';
    }
    static void AppendJson(std::string& out, const std::string& v) { AppendJson(out, std::string_view(v)); }
    static void AppendJson(std::string& out, const char* v) { AppendJson(out, std::string_view(v ? v : "")); }
    template <size_t N>
    static void AppendJson(std::string& out, const char (&v)[N]) {
        AppendJson(out, std::string_view(v));
    }

    template <typename T>
    static void AppendJson(std::string& out, const std::vector<T>& v) {
        out += '[';
        for (size_t i = 0; i < v.size(); ++i) {
            if (i) out += ',';
            AppendJson(out, v[i]);
        }
        out += ']';
    }

    tent_config_t handle_;
};

}  // namespace tent
}  // namespace mooncake

#endif /* TENT_CONFIG_H */
