// tent-rs: mooncake::Status, the result type of upstream's classic C++ class, header-only.
// Codes, factories and names as upstream's common/base/status.h; the message is kept in a
// std::string (upstream keeps a raw char array), which callers cannot tell apart.
#ifndef TENT_RS_MOONCAKE_STATUS_H
#define TENT_RS_MOONCAKE_STATUS_H

#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>

namespace mooncake {

class Status final {
   public:
    // The values are upstream's (the negated ERR_* code for most of them).
    enum class Code : uint16_t {
        kOk = 0,
        kInvalidArgument = 1,
        kTooManyRequests = 2,
        kAddressNotRegistered = 3,
        kBatchBusy = 4,
        kDeviceNotFound = 6,
        kAddressOverlapped = 7,
        kNotSupportedTransport = 8,
        kDns = 101,
        kSocket = 102,
        kMalformedJson = 103,
        kRejectHandshake = 104,
        kMetadata = 200,
        kEndpoint = 201,
        kContext = 202,
        kNuma = 300,
        kClock = 301,
        kMemory = 302,
        kNotImplemented = 999,
        kMaxCode
    };

    Status() = default;

    // An OK code drops the message, so every OK status compares equal.
    Status(Code code, std::string_view message) : code_(code) {
        if (code != Code::kOk) message_.assign(message.data(), message.size());
    }

    Status(const Status&) = default;
    Status& operator=(const Status&) = default;
    // A moved-from status is OK, as upstream's.
    Status(Status&& s) noexcept : code_(s.code_), message_(std::move(s.message_)) {
        s.code_ = Code::kOk;
        s.message_.clear();
    }
    Status& operator=(Status&& s) noexcept {
        if (this != &s) {
            code_ = s.code_;
            message_ = std::move(s.message_);
            s.code_ = Code::kOk;
            s.message_.clear();
        }
        return *this;
    }
    ~Status() = default;

    Code code() const { return code_; }
    std::string_view message() const { return message_; }

    [[nodiscard]] bool ok() const { return code_ == Code::kOk; }
    [[nodiscard]] bool IsInvalidArgument() const { return code_ == Code::kInvalidArgument; }
    [[nodiscard]] bool IsTooManyRequests() const { return code_ == Code::kTooManyRequests; }
    [[nodiscard]] bool IsAddressNotRegistered() const { return code_ == Code::kAddressNotRegistered; }
    [[nodiscard]] bool IsBatchBusy() const { return code_ == Code::kBatchBusy; }
    [[nodiscard]] bool IsDeviceNotFound() const { return code_ == Code::kDeviceNotFound; }
    [[nodiscard]] bool IsAddressOverlapped() const { return code_ == Code::kAddressOverlapped; }
    [[nodiscard]] bool IsDns() const { return code_ == Code::kDns; }
    [[nodiscard]] bool IsSocket() const { return code_ == Code::kSocket; }
    [[nodiscard]] bool IsMalformedJson() const { return code_ == Code::kMalformedJson; }
    [[nodiscard]] bool IsRejectHandshake() const { return code_ == Code::kRejectHandshake; }
    [[nodiscard]] bool IsMetadata() const { return code_ == Code::kMetadata; }
    [[nodiscard]] bool IsEndpoint() const { return code_ == Code::kEndpoint; }
    [[nodiscard]] bool IsContext() const { return code_ == Code::kContext; }
    [[nodiscard]] bool IsNuma() const { return code_ == Code::kNuma; }
    [[nodiscard]] bool IsClock() const { return code_ == Code::kClock; }
    [[nodiscard]] bool IsMemory() const { return code_ == Code::kMemory; }
    [[nodiscard]] bool IsNotImplemented() const { return code_ == Code::kNotImplemented; }
    [[nodiscard]] bool IsNotSupportedTransport() const { return code_ == Code::kNotSupportedTransport; }

    // "OK", or "<code name>: <message>".
    std::string ToString() const {
        if (ok()) return "OK";
        std::string s(CodeToString(code_));
        s += ": ";
        s += message_;
        return s;
    }

    bool operator==(const Status& s) const { return code_ == s.code_ && message_ == s.message_; }
    bool operator!=(const Status& s) const { return !(*this == s); }

    static Status OK() { return Status(); }
    static Status InvalidArgument(std::string_view msg) { return Status(Code::kInvalidArgument, msg); }
    static Status TooManyRequests(std::string_view msg) { return Status(Code::kTooManyRequests, msg); }
    static Status AddressNotRegistered(std::string_view msg) { return Status(Code::kAddressNotRegistered, msg); }
    static Status BatchBusy(std::string_view msg) { return Status(Code::kBatchBusy, msg); }
    static Status DeviceNotFound(std::string_view msg) { return Status(Code::kDeviceNotFound, msg); }
    static Status AddressOverlapped(std::string_view msg) { return Status(Code::kAddressOverlapped, msg); }
    static Status Dns(std::string_view msg) { return Status(Code::kDns, msg); }
    static Status Socket(std::string_view msg) { return Status(Code::kSocket, msg); }
    static Status MalformedJson(std::string_view msg) { return Status(Code::kMalformedJson, msg); }
    static Status RejectHandshake(std::string_view msg) { return Status(Code::kRejectHandshake, msg); }
    static Status Metadata(std::string_view msg) { return Status(Code::kMetadata, msg); }
    static Status Endpoint(std::string_view msg) { return Status(Code::kEndpoint, msg); }
    static Status Context(std::string_view msg) { return Status(Code::kContext, msg); }
    static Status Numa(std::string_view msg) { return Status(Code::kNuma, msg); }
    static Status Clock(std::string_view msg) { return Status(Code::kClock, msg); }
    static Status Memory(std::string_view msg) { return Status(Code::kMemory, msg); }
    static Status NotImplemented(std::string_view msg) { return Status(Code::kNotImplemented, msg); }
    static Status NotSupportedTransport(std::string_view msg) {
        return Status(Code::kNotSupportedTransport, msg);
    }

    // The code's name without its "k" ("InvalidArgument"), "UnknownCode" for a value that is
    // none of the codes.
    static std::string_view CodeToString(Code code) {
        switch (code) {
            case Code::kOk: return "OK";
            case Code::kInvalidArgument: return "InvalidArgument";
            case Code::kTooManyRequests: return "TooManyRequests";
            case Code::kAddressNotRegistered: return "AddressNotRegistered";
            case Code::kBatchBusy: return "BatchBusy";
            case Code::kDeviceNotFound: return "DeviceNotFound";
            case Code::kAddressOverlapped: return "AddressOverlapped";
            case Code::kNotSupportedTransport: return "NotSupportedTransport";
            case Code::kDns: return "Dns";
            case Code::kSocket: return "Socket";
            case Code::kMalformedJson: return "MalformedJson";
            case Code::kRejectHandshake: return "RejectHandshake";
            case Code::kMetadata: return "Metadata";
            case Code::kEndpoint: return "Endpoint";
            case Code::kContext: return "Context";
            case Code::kNuma: return "Numa";
            case Code::kClock: return "Clock";
            case Code::kMemory: return "Memory";
            case Code::kNotImplemented: return "NotImplemented";
            default: return "UnknownCode";
        }
    }

   private:
    Code code_ = Code::kOk;
    std::string message_;
};

inline std::ostream& operator<<(std::ostream& os, Status::Code code) {
    return os << Status::CodeToString(code);
}

inline std::ostream& operator<<(std::ostream& os, const Status& s) { return os << s.ToString(); }

}  // namespace mooncake

#endif  // TENT_RS_MOONCAKE_STATUS_H
