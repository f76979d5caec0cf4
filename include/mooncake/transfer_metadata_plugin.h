// tent-rs: direct access to a metadata store by its connection string (upstream's
// MetadataStoragePlugin), header-only over tent_metadata_store_* of the classic C API.
// Values are JSON text; get/set also take a Json::Value when the caller has jsoncpp (they are
// templates, so a caller without jsoncpp neither needs its headers nor links it).
#ifndef TENT_RS_MOONCAKE_TRANSFER_METADATA_PLUGIN_H
#define TENT_RS_MOONCAKE_TRANSFER_METADATA_PLUGIN_H

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "transfer_metadata.h"

namespace mooncake {

struct MetadataStoragePlugin {
    // The store `conn_string` names (http://host:port/path, redis://..., etcd://... or bare
    // etcd servers), checked to answer; nullptr, with the reason on stderr, for P2PHANDSHAKE,
    // an unknown type or a store that does not answer (upstream aborts the process instead).
    static std::shared_ptr<MetadataStoragePlugin> Create(const std::string& conn_string) {
        void* store = tent_metadata_store_open(conn_string.c_str());
        if (!store) {
            tent_rs_detail::logError("MetadataStoragePlugin::Create(" + conn_string + "): " + tent_rs_detail::lastError());
            return nullptr;
        }
        return std::shared_ptr<MetadataStoragePlugin>(new MetadataStoragePlugin(store));
    }

    MetadataStoragePlugin(const MetadataStoragePlugin&) = delete;
    MetadataStoragePlugin& operator=(const MetadataStoragePlugin&) = delete;
    virtual ~MetadataStoragePlugin() { tent_metadata_store_close(store_); }

    // Reads `key` into `value`; false when it does not exist or the store cannot answer.
    virtual bool get(const std::string& key, std::string& value) {
        size_t len = 0;
        char small[1024];
        int rc = tent_metadata_store_get(store_, key.c_str(), small, sizeof(small), &len);
        if (rc != 0) return false;
        if (len < sizeof(small)) {
            value.assign(small, len);
            return true;
        }
        std::string big(len + 1, '\0');
        if (tent_metadata_store_get(store_, key.c_str(), big.data(), big.size(), &len) != 0) return false;
        big.resize(len);
        value = std::move(big);
        return true;
    }
    virtual bool set(const std::string& key, const std::string& value) {
        return tent_metadata_store_set(store_, key.c_str(), value.c_str()) == 0;
    }
    // Removes `key` (a missing key counts as removed); false when the store cannot answer.
    virtual bool remove(const std::string& key) { return tent_metadata_store_remove(store_, key.c_str()) == 0; }

    // jsoncpp forms, as upstream's: Json::Value in and out (parsed and written by jsoncpp).
    template <typename JsonValue, typename = decltype(std::declval<JsonValue&>().isNull())>
    bool get(const std::string& key, JsonValue& value) {
        std::string text;
        if (!get(key, text)) return false;
        std::istringstream in(text);
        try {
            in >> value;
        } catch (...) {
            return false;
        }
        return true;
    }
    template <typename JsonValue, typename = decltype(std::declval<const JsonValue&>().isNull())>
    bool set(const std::string& key, const JsonValue& value) {
        std::ostringstream out;
        out << value;
        return set(key, out.str());
    }

   protected:
    explicit MetadataStoragePlugin(void* store) : store_(store) {}

   private:
    void* store_;
};

}  // namespace mooncake

#endif  // TENT_RS_MOONCAKE_TRANSFER_METADATA_PLUGIN_H
