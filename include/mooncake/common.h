// tent-rs: the inline helpers of upstream's classic common.h that callers use (host names
// with ports, IPv6 brackets, clocks, NUMA binding, the spinlocks), header-only and written
// for tent-rs. Nothing here talks to the engine.
#ifndef TENT_RS_MOONCAKE_COMMON_H
#define TENT_RS_MOONCAKE_COMMON_H

#if __has_include(<glog/logging.h>)
#include <glog/logging.h>  // upstream's header brings glog in; callers may rely on it
#endif
#if __has_include(<numa.h>)
#include <numa.h>
#define TENT_RS_HAVE_NUMA 1
#endif
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "config.h"
#include "error.h"

// Same definitions as upstream's (and Mooncake Store's mutex.h), so either may come first.
#ifndef PAUSE
#if defined(__x86_64__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#elif defined(__aarch64__) || defined(__arm__)
#define PAUSE() __asm__ __volatile__("yield")
#else
#define PAUSE()
#endif
#endif

#ifndef likely
#define likely(x) __glibc_likely(x)
#define unlikely(x) __glibc_unlikely(x)
#endif

namespace mooncake {

// tent/transfer_engine.h defines LOCAL_SEGMENT_ID as a macro of the same value.
#ifndef LOCAL_SEGMENT_ID
const static int LOCAL_SEGMENT_ID = 0;
#endif

enum class HandShakeRequestType {
    Connection = 0,
    Metadata = 1,
    Notify = 2,
    Probe = 3,
    Invalid = 0xfe,
    OldProtocol = 0xff,
};

static inline std::string getHostname() {
    char name[256] = {0};
    if (gethostname(name, sizeof(name) - 1) != 0) return "";
    return name;
}

#ifdef TENT_RS_HAVE_NUMA
// Pins the calling thread to the CPUs of NUMA node `socket_id` (node 0 when out of range).
// Callers link libnuma, as upstream's do.
static inline int bindToSocket(int socket_id) {
    if (numa_available() < 0) return ERR_NUMA;
    if (socket_id < 0 || socket_id >= numa_num_configured_nodes()) socket_id = 0;
    struct bitmask* cpus = numa_allocate_cpumask();
    if (!cpus) return ERR_NUMA;
    // numa_node_to_cpus fills a lazily built cache without locking: serialize first callers.
    static std::mutex cache_mutex;
    int rc;
    {
        std::lock_guard<std::mutex> lock(cache_mutex);
        rc = numa_node_to_cpus(socket_id, cpus);
    }
    cpu_set_t set;
    CPU_ZERO(&set);
    int count = 0;
    if (rc == 0) {
        for (int cpu = 0; cpu < numa_num_possible_cpus() && cpu < CPU_SETSIZE; ++cpu) {
            if (numa_bitmask_isbitset(cpus, cpu) && numa_bitmask_isbitset(numa_all_cpus_ptr, cpu)) {
                CPU_SET(cpu, &set);
                ++count;
            }
        }
    }
    numa_free_cpumask(cpus);
    if (count == 0) return 0;
    return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0 ? 0 : ERR_NUMA;
}
#endif

static inline int64_t getCurrentTimeInNano() {
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return ERR_CLOCK;
    return int64_t{ts.tv_sec} * 1000000000 + int64_t{ts.tv_nsec};
}

static inline int64_t getCurrentTimeInMilli() { return getCurrentTimeInNano() / 1000000; }

static inline std::string getCurrentDateTime() {
    auto now = std::chrono::system_clock::now();
    std::time_t t = std::chrono::system_clock::to_time_t(now);
    std::tm local{};
    localtime_r(&t, &local);
    auto us = std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() % 1000000;
    std::ostringstream out;
    out << std::put_time(&local, "%Y-%m-%d %H:%M:%S") << "." << std::setw(6) << std::setfill('0') << us;
    return out.str();
}

// Reads all of `str` as a T; anything left over, or nothing readable, is no value.
template <typename T>
std::optional<T> parseFromString(std::string_view str) {
    T value{};
    const char* end = str.data() + str.size();
    auto [ptr, ec] = std::from_chars(str.data(), end, value);
    if (ec != std::errc() || ptr != end) return std::nullopt;
    return value;
}

static inline uint16_t getPortFromString(std::string_view port_string, uint16_t default_port) {
    if (auto port = parseFromString<uint16_t>(port_string)) return *port;
    std::cerr << "tent-rs: illegal port number in \"" << port_string << "\", using " << default_port << "\n";
    return default_port;
}

// An IPv6 address, optionally with a "%scope" suffix (but no port after it).
static inline bool isValidIpV6(const std::string& address) {
    in6_addr parsed;
    size_t percent = address.find('%');
    if (percent == std::string::npos) return inet_pton(AF_INET6, address.c_str(), &parsed) == 1;
    if (address.find(':', percent) != std::string::npos) return false;
    return inet_pton(AF_INET6, address.substr(0, percent).c_str(), &parsed) == 1;
}

static inline std::string maybeWrapIpV6(const std::string& address) {
    return isValidIpV6(address) ? "[" + address + "]" : address;
}

struct IPv6ParseResult {
    bool matched;
    std::string host;
    std::string_view port;
};

// Recognizes "[v6]", "[v6]:port", a bare "v6" and "v6%scope:port"; `port` views into
// `server_name`.
static inline IPv6ParseResult extractIPv6HostAndPort(const std::string& server_name) {
    if (!server_name.empty() && server_name.front() == '[') {
        size_t close = server_name.find(']');
        if (close != std::string::npos) {
            std::string host = server_name.substr(1, close - 1);
            if (isValidIpV6(host)) {
                std::string_view port;
                size_t colon = server_name.find(':', close);
                if (colon != std::string::npos) port = std::string_view(server_name).substr(colon + 1);
                return {true, std::move(host), port};
            }
        }
        return {false, "", ""};
    }
    if (isValidIpV6(server_name)) return {true, server_name, ""};
    size_t percent = server_name.find('%');
    if (percent != std::string::npos) {
        size_t colon = server_name.find(':', percent);
        if (colon == std::string::npos) {
            if (isValidIpV6(server_name)) return {true, server_name, ""};
        } else {
            std::string host = server_name.substr(0, colon);
            if (isValidIpV6(host)) return {true, std::move(host), std::string_view(server_name).substr(colon + 1)};
        }
    }
    return {false, "", ""};
}

// Splits "host[:port]" (IPv6 forms included); a missing or unreadable port is the default
// handshake port.
static inline std::pair<std::string, uint16_t> parseHostNameWithPort(const std::string& server_name) {
    const uint16_t fallback = getDefaultHandshakePort();
    auto v6 = extractIPv6HostAndPort(server_name);
    if (v6.matched) return {std::move(v6.host), v6.port.empty() ? fallback : getPortFromString(v6.port, fallback)};
    size_t colon = server_name.rfind(':');
    if (colon == std::string::npos) return {server_name, fallback};
    return {server_name.substr(0, colon), getPortFromString(std::string_view(server_name).substr(colon + 1), fallback)};
}

static inline bool hasExplicitPort(const std::string& server_name) {
    auto v6 = extractIPv6HostAndPort(server_name);
    if (v6.matched) return !v6.port.empty();
    return server_name.rfind(':') != std::string::npos;
}

static inline std::string getHostNameWithoutPort(const std::string& server_name) {
    auto v6 = extractIPv6HostAndPort(server_name);
    if (v6.matched) return std::move(v6.host);
    size_t colon = server_name.rfind(':');
    return colon == std::string::npos ? server_name : server_name.substr(0, colon);
}

static inline std::string buildHostNameWithPort(const std::string& host, uint16_t port) {
    return maybeWrapIpV6(host) + ":" + std::to_string(port);
}

// "port[:npu_<id>]" as the Ascend transport writes it: the id goes to *device_id.
static inline uint16_t parsePortAndDevice(std::string_view suffix, uint16_t default_port, int* device_id) {
    size_t colon = suffix.find(':');
    if (colon == std::string_view::npos) return getPortFromString(suffix, default_port);
    std::string_view device = suffix.substr(colon + 1);
    size_t underscore = device.find('_');
    if (underscore != std::string_view::npos && underscore != 0 && underscore + 1 != device.size() && device_id)
        *device_id = parseFromString<int>(device.substr(underscore + 1)).value_or(0);
    return getPortFromString(suffix.substr(0, colon), default_port);
}

static inline std::pair<std::string, uint16_t> parseHostNameWithPortAscend(const std::string& server_name,
                                                                           int* device_id) {
    const uint16_t fallback = getDefaultHandshakePort();
    auto v6 = extractIPv6HostAndPort(server_name);
    if (v6.matched)
        return {std::move(v6.host), v6.port.empty() ? fallback : parsePortAndDevice(v6.port, fallback, device_id)};
    size_t colon = server_name.find(':');
    if (colon == std::string::npos) return {server_name, fallback};
    return {server_name.substr(0, colon),
            parsePortAndDevice(std::string_view(server_name).substr(colon + 1), fallback, device_id)};
}

const static std::string NIC_PATH_DELIM = "@";

static inline const std::string getServerNameFromNicPath(const std::string& nic_path) {
    size_t at = nic_path.find(NIC_PATH_DELIM);
    return at == std::string::npos ? "" : nic_path.substr(0, at);
}

static inline const std::string getNicNameFromNicPath(const std::string& nic_path) {
    size_t at = nic_path.find(NIC_PATH_DELIM);
    return at == std::string::npos ? "" : nic_path.substr(at + 1);
}

static inline const std::string MakeNicPath(const std::string& server_name, const std::string& nic_name) {
    return server_name + NIC_PATH_DELIM + nic_name;
}

static inline bool overlap(const void* a, size_t a_len, const void* b, size_t b_len) {
    auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
    return (x >= y && x < y + b_len) || (y >= x && y < x + a_len);
}

// A reader-writer spinlock with upstream's interface (lock/unlock, lockShared/unlockShared and
// the two guards), built on one atomic word: the high bit is the writer, the rest count readers.
class RWSpinlock {
   public:
    RWSpinlock() = default;
    RWSpinlock(const RWSpinlock&) = delete;
    RWSpinlock& operator=(const RWSpinlock&) = delete;

    bool tryLock() {
        uint64_t expected = 0;
        return state_.compare_exchange_strong(expected, kWriter, std::memory_order_acquire);
    }
    void lock() {
        for (uint32_t spins = 0; !tryLock(); ++spins) backoff(spins);
    }
    void unlock() { state_.fetch_and(~kWriter, std::memory_order_release); }

    bool tryLockShared() {
        uint64_t cur = state_.load(std::memory_order_relaxed);
        return !(cur & kWriter) && state_.compare_exchange_weak(cur, cur + 1, std::memory_order_acquire);
    }
    void lockShared() {
        for (uint32_t spins = 0; !tryLockShared(); ++spins) backoff(spins);
    }
    void unlockShared() { state_.fetch_sub(1, std::memory_order_release); }

    struct WriteGuard {
        explicit WriteGuard(RWSpinlock& l) : lock(l) { lock.lock(); }
        WriteGuard(const WriteGuard&) = delete;
        WriteGuard& operator=(const WriteGuard&) = delete;
        ~WriteGuard() { lock.unlock(); }
        RWSpinlock& lock;
    };
    struct ReadGuard {
        explicit ReadGuard(RWSpinlock& l) : lock(l) { lock.lockShared(); }
        ReadGuard(const ReadGuard&) = delete;
        ReadGuard& operator=(const ReadGuard&) = delete;
        ~ReadGuard() { lock.unlockShared(); }
        RWSpinlock& lock;
    };

   private:
    static void backoff(uint32_t spins) {
        if (spins > 1000) std::this_thread::yield();
        else PAUSE();
    }
    static constexpr uint64_t kWriter = uint64_t{1} << 63;
    std::atomic<uint64_t> state_{0};
};

class TicketLock {
   public:
    void lock() {
        int mine = next_.fetch_add(1, std::memory_order_relaxed);
        while (serving_.load(std::memory_order_acquire) != mine) std::this_thread::yield();
    }
    void unlock() { serving_.fetch_add(1, std::memory_order_release); }

   private:
    std::atomic<int> next_{0};
    std::atomic<int> serving_{0};
};

// A fast thread-local linear congruential generator (not for anything that needs randomness
// of quality).
class SimpleRandom {
   public:
    explicit SimpleRandom(uint32_t seed) : state_(seed) {}
    static SimpleRandom& Get() {
        static std::atomic<uint64_t> salt{0};
        thread_local SimpleRandom r(static_cast<uint32_t>(getCurrentTimeInNano() + salt.fetch_add(1)));
        return r;
    }
    uint32_t next() {
        state_ = state_ * 1664525u + 1013904223u;
        return state_;
    }
    uint32_t next(uint32_t max) { return next() % max; }

   private:
    uint32_t state_;
};

}  // namespace mooncake

#endif  // TENT_RS_MOONCAKE_COMMON_H
