/*
 * tent-rs: mooncake::tent::Status, the result type of the C++ class mooncake::tent::TransferEngine
 * (tent/transfer_engine.h). Names, codes and printing follow upstream Mooncake TENT's
 * tent/common/status.h, so code written against upstream compiles unchanged.
 *
 * Header-only: every member is inline, so neither libtent nor the libraries named after
 * upstream's carry C++ symbols, and C callers of those libraries never need libstdc++.
 */
#ifndef TENT_STATUS_H
#define TENT_STATUS_H

#include <cstdint>
#include <cstring>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>

/* Upstream's helper macros that callers use: CHECK_STATUS returns a failed Status from the
 * enclosing function, LOC_MARK appends where a message was raised. Each is defined only when
 * the caller has not defined its own. */
#ifndef STRINGIFY
#define STRINGIFY(x) #x
#endif
#ifndef TOSTRING
#define TOSTRING(x) STRINGIFY(x)
#endif
#ifndef LOC_MARK
#define LOC_MARK "\n    Raised at " __FILE__ ":" TOSTRING(__LINE__)
#endif
#ifndef CHECK_STATUS
#define CHECK_STATUS(call)                     \
    do {                                       \
        ::mooncake::tent::Status status_ = call; \
        if (!status_.ok()) return status_;     \
    } while (0)
#endif

namespace mooncake {
namespace tent {

/* OK, or a code with a message. An OK status holds no message and allocates nothing, so the
 * success path of every call costs one 16-byte value. */
class Status final {
   public:
    /* Upstream's codes, with upstream's values. */
    enum class Code : uint16_t {
        kOk = 0,
        kInvalidArgument = 1,
        kTooManyRequests = 2,
        kAddressNotRegistered = 3,
        kDeviceNotFound = 4,
        kInvalidEntry = 5,
        kInvalidMetadataType = 6,
        kNeedsRefreshCache = 7,
        kRdmaError = 100,
        kCudaError = 101,
        kMetadataError = 131,
        kRpcServiceError = 132,
        kMalformedJson = 133,
        kInternalError = 199,
        kNotImplemented = 200,
        kMaxCode
    };

    Status() = default;

    /* A status with `code` and `message`; with Code::kOk the message is dropped, so every OK
     * status is the same. An empty message is stored as none. */
    Status(Code code, std::string_view message) : code_(code) {
        if (code != Code::kOk && !message.empty()) message_ = Copy(message.data(), message.size());
    }

    ~Status() { delete[] message_; }

    Status(const Status& s) : code_(s.code_), message_(s.message_ ? Copy(s.message_, std::strlen(s.message_)) : nullptr) {}

    Status& operator=(const Status& s) {
        if (this != &s) {
            char* copy = s.message_ ? Copy(s.message_, std::strlen(s.message_)) : nullptr;
            delete[] message_;
            message_ = copy;
            code_ = s.code_;
        }
        return *this;
    }

    /* A moved-from status is OK with no message, as upstream's. */
    Status(Status&& s) noexcept : code_(s.code_), message_(s.message_) {
        s.code_ = Code::kOk;
        s.message_ = nullptr;
    }

    Status& operator=(Status&& s) noexcept {
        if (this != &s) {
            delete[] message_;
            code_ = s.code_;
            message_ = s.message_;
            s.code_ = Code::kOk;
            s.message_ = nullptr;
        }
        return *this;
    }

    /* Equal when the codes and the message texts are. */
    bool operator==(const Status& s) const {
        if (code_ != s.code_) return false;
        if (!message_ || !s.message_) return message_ == s.message_;
        return std::strcmp(message_, s.message_) == 0;
    }
    bool operator!=(const Status& s) const { return !(*this == s); }

    Code code() const { return code_; }

    /* The message ("" when there is none); valid while this status lives unchanged. */
    std::string_view message() const { return message_ ? std::string_view(message_) : std::string_view(); }

    [[nodiscard]] bool ok() const { return code_ == Code::kOk; }

    static Status OK() { return Status(); }

    /* One factory and one check per code, named as upstream's (Status::InvalidArgument(msg),
     * s.IsInvalidArgument()). */
#define TENT_STATUS_KIND_(name)                                                  \
    [[nodiscard]] bool Is##name() const { return code_ == Code::k##name; }       \
    static Status name(std::string_view msg) { return Status(Code::k##name, msg); }
    TENT_STATUS_KIND_(InvalidArgument)
    TENT_STATUS_KIND_(TooManyRequests)
    TENT_STATUS_KIND_(AddressNotRegistered)
    TENT_STATUS_KIND_(DeviceNotFound)
    TENT_STATUS_KIND_(InvalidEntry)
    TENT_STATUS_KIND_(InvalidMetadataType)
    TENT_STATUS_KIND_(NeedsRefreshCache)
    TENT_STATUS_KIND_(RdmaError)
    TENT_STATUS_KIND_(CudaError)
    TENT_STATUS_KIND_(MetadataError)
    TENT_STATUS_KIND_(RpcServiceError)
    TENT_STATUS_KIND_(MalformedJson)
    TENT_STATUS_KIND_(InternalError)
    TENT_STATUS_KIND_(NotImplemented)
#undef TENT_STATUS_KIND_

    /* "OK", or "<CodeName>: <message>" as upstream prints it. */
    std::string ToString() const {
        if (ok()) return "OK";
        std::string out(CodeToString(code_));
        out += ": ";
        out += message();
        return out;
    }

    /* The code's name ("InvalidArgument"); "UnknownCode" for a value outside the enum. */
    static std::string_view CodeToString(Code code) {
        switch (code) {
            case Code::kOk: return "OK";
            case Code::kInvalidArgument: return "InvalidArgument";
            case Code::kTooManyRequests: return "TooManyRequests";
            case Code::kAddressNotRegistered: return "AddressNotRegistered";
            case Code::kDeviceNotFound: return "DeviceNotFound";
            case Code::kInvalidEntry: return "InvalidEntry";
            case Code::kInvalidMetadataType: return "InvalidMetadataType";
            case Code::kNeedsRefreshCache: return "NeedsRefreshCache";
            case Code::kRdmaError: return "RdmaError";
            case Code::kCudaError: return "CudaError";
            case Code::kMetadataError: return "MetadataError";
            case Code::kRpcServiceError: return "RpcServiceError";
            case Code::kMalformedJson: return "MalformedJson";
            case Code::kInternalError: return "InternalError";
            case Code::kNotImplemented: return "NotImplemented";
            case Code::kMaxCode: break;
        }
        return "UnknownCode";
    }

   private:
    /* A NUL-terminated heap copy of `len` bytes at `text`. */
    static char* Copy(const char* text, size_t len) {
        char* out = new char[len + 1];
        std::memcpy(out, text, len);
        out[len] = '\0';
        return out;
    }

    Code code_ = Code::kOk;
    char* message_ = nullptr;
};

inline std::ostream& operator<<(std::ostream& os, Status::Code code) { return os << Status::CodeToString(code); }

inline std::ostream& operator<<(std::ostream& os, const Status& s) { return os << s.ToString(); }

}  // namespace tent
}  // namespace mooncake

#endif /* TENT_STATUS_H */
