/*
 * tent-rs: a header-only C++17 wrapper over the TENT C API (tent/transfer_engine.h).
 *
 * RAII owners for an engine, a memory registration and a batch; every operation returns a
 * tent::Status that carries the library's message for the failure (from tent_last_error). All
 * code is inline in this header: it adds no symbols to any library.
 *
 *   auto engine = tent::Engine::create({{"rpc_server_hostname", "127.0.0.1"}});
 *   tent::RegisteredMemory mem;
 *   tent::Status s = mem.reset(engine, buf, len);
 *   tent::Batch batch;
 *   s = batch.reset(engine, 16);
 *   s = batch.submit({tent::write(buf, peer, remote_addr, len)});
 *   s = batch.wait(0, std::chrono::seconds(10));
 */
#ifndef TENT_TENT_HPP
#define TENT_TENT_HPP

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tent/transfer_engine.h"

namespace tent {

/* The outcome of an operation: ok, or the C return value and the library's message. */
class Status {
public:
    Status() = default;
    static Status ok_status() { return Status(); }
    /* A failure of `what`, with the calling thread's last error message from the library. */
    static Status from_last_error(const char *what, int code = -1) {
        char buf[512];
        int n = tent_last_error(buf, sizeof buf);
        std::string msg = what;
        if (n > 0) {
            msg += ": ";
            msg += buf;
        }
        return Status(code, std::move(msg));
    }
    static Status error(std::string message, int code = -1) { return Status(code, std::move(message)); }

    bool ok() const { return code_ == 0; }
    explicit operator bool() const { return ok(); }
    int code() const { return code_; }
    const std::string &message() const { return message_; }

private:
    Status(int code, std::string message) : code_(code), message_(std::move(message)) {}
    int code_ = 0;
    std::string message_;
};

/* A zero-initialised request (so transport_hint is TRANSPORT_UNSPEC, as the C API requires). */
inline tent_request_t request(int opcode, void *local, tent_segment_id_t target,
                              uint64_t target_addr, uint64_t length) {
    tent_request_t r{};
    r.opcode = opcode;
    r.source = local;
    r.target_id = target;
    r.target_offset = target_addr;
    r.length = length;
    return r;
}
inline tent_request_t write(void *local, tent_segment_id_t target, uint64_t target_addr,
                            uint64_t length) {
    return request(OPCODE_WRITE, local, target, target_addr, length);
}
inline tent_request_t read(void *local, tent_segment_id_t target, uint64_t target_addr,
                           uint64_t length) {
    return request(OPCODE_READ, local, target, target_addr, length);
}

/* A received notification. */
struct Notification {
    tent_segment_id_t sender;
    std::string name;
    std::string message;
};

/* Owns a tent_engine_t; destroying the Engine destroys the engine. Movable, not copyable. */
class Engine {
public:
    Engine() = default;
    explicit Engine(tent_engine_t handle) : handle_(handle) {}
    ~Engine() { reset(); }
    Engine(const Engine &) = delete;
    Engine &operator=(const Engine &) = delete;
    Engine(Engine &&o) noexcept : handle_(std::exchange(o.handle_, nullptr)) {}
    Engine &operator=(Engine &&o) noexcept {
        if (this != &o) {
            reset();
            handle_ = std::exchange(o.handle_, nullptr);
        }
        return *this;
    }

    /* Sets `settings` (config key, value) for this thread, then creates an engine. Check
     * available(): an engine that failed to start fails every call. */
    static Engine create(const std::vector<std::pair<std::string, std::string>> &settings = {}) {
        for (const auto &kv : settings) tent_set_config(kv.first.c_str(), kv.second.c_str());
        return Engine(tent_create_engine());
    }

    void reset() {
        if (handle_) tent_destroy_engine(std::exchange(handle_, nullptr));
    }
    tent_engine_t get() const { return handle_; }
    bool available() const { return handle_ && tent_available(handle_) == 1; }

    /* The segment name peers open this engine by. */
    Status segment_name(std::string &out) const {
        char buf[256];
        if (tent_segment_name(handle_, buf, sizeof buf) != 0)
            return Status::from_last_error("tent_segment_name");
        out = buf;
        return Status();
    }
    Status rpc_address(std::string &ip, uint16_t &port) const {
        char buf[128];
        if (tent_rpc_server_addr_port(handle_, buf, sizeof buf, &port) != 0)
            return Status::from_last_error("tent_rpc_server_addr_port");
        ip = buf;
        return Status();
    }
    Status open_segment(const std::string &name, tent_segment_id_t &handle) {
        if (tent_open_segment(handle_, &handle, name.c_str()) != 0)
            return Status::from_last_error("tent_open_segment");
        return Status();
    }
    Status close_segment(tent_segment_id_t handle) {
        if (tent_close_segment(handle_, handle) != 0)
            return Status::from_last_error("tent_close_segment");
        return Status();
    }
    Status notify(tent_segment_id_t target, const std::string &name, const std::string &msg) {
        if (tent_send_notifs(handle_, target, name.c_str(), msg.c_str()) != 0)
            return Status::from_last_error("tent_send_notifs");
        return Status();
    }
    /* Appends every received notification to `out`. */
    Status receive(std::vector<Notification> &out) {
        tent_notifi_info info{};
        if (tent_recv_notifs(handle_, &info) != 0) return Status::from_last_error("tent_recv_notifs");
        for (int i = 0; i < info.num_records; ++i)
            out.push_back({info.records[i].handle, info.records[i].name, info.records[i].msg});
        tent_free_notifs(&info);
        return Status();
    }

private:
    tent_engine_t handle_ = nullptr;
};

/* A registration of caller-owned memory, unregistered when this object goes away. The memory
 * must outlive it. Movable, not copyable. */
class RegisteredMemory {
public:
    RegisteredMemory() = default;
    ~RegisteredMemory() { release(); }
    RegisteredMemory(const RegisteredMemory &) = delete;
    RegisteredMemory &operator=(const RegisteredMemory &) = delete;
    RegisteredMemory(RegisteredMemory &&o) noexcept
        : engine_(std::exchange(o.engine_, nullptr)), addr_(o.addr_), length_(o.length_) {}
    RegisteredMemory &operator=(RegisteredMemory &&o) noexcept {
        if (this != &o) {
            release();
            engine_ = std::exchange(o.engine_, nullptr);
            addr_ = o.addr_;
            length_ = o.length_;
        }
        return *this;
    }

    /* Registers [addr, addr+length) with `permission` (PERM_*), releasing any earlier one. */
    Status reset(const Engine &engine, void *addr, size_t length,
                 int permission = PERM_GLOBAL_READ_WRITE) {
        release();
        if (tent_register_memory_with_perm(engine.get(), addr, length, permission) != 0)
            return Status::from_last_error("tent_register_memory_with_perm");
        engine_ = engine.get();
        addr_ = addr;
        length_ = length;
        return Status();
    }
    /* Unregisters now (also done by the destructor). */
    Status release() {
        if (!engine_) return Status();
        tent_engine_t e = std::exchange(engine_, nullptr);
        if (tent_unregister_memory(e, addr_, length_) != 0)
            return Status::from_last_error("tent_unregister_memory");
        return Status();
    }
    void *addr() const { return addr_; }
    size_t length() const { return length_; }
    uint64_t address() const { return reinterpret_cast<uintptr_t>(addr_); }

private:
    tent_engine_t engine_ = nullptr;
    void *addr_ = nullptr;
    size_t length_ = 0;
};

/* A batch of transfers, freed when this object goes away. Movable, not copyable. */
class Batch {
public:
    Batch() = default;
    ~Batch() { release(); }
    Batch(const Batch &) = delete;
    Batch &operator=(const Batch &) = delete;
    Batch(Batch &&o) noexcept : engine_(std::exchange(o.engine_, nullptr)), id_(o.id_) {}
    Batch &operator=(Batch &&o) noexcept {
        if (this != &o) {
            release();
            engine_ = std::exchange(o.engine_, nullptr);
            id_ = o.id_;
        }
        return *this;
    }

    /* Allocates a batch for up to `capacity` tasks, freeing any earlier one. */
    Status reset(const Engine &engine, size_t capacity) {
        release();
        tent_batch_id_t id = tent_allocate_batch(engine.get(), capacity);
        if (id == 0 || id == UINT64_MAX) return Status::from_last_error("tent_allocate_batch");
        engine_ = engine.get();
        id_ = id;
        return Status();
    }
    /* Frees the batch now (also done by the destructor). */
    Status release() {
        if (!engine_) return Status();
        tent_engine_t e = std::exchange(engine_, nullptr);
        if (tent_free_batch(e, id_) != 0) return Status::from_last_error("tent_free_batch");
        return Status();
    }
    /* Submits requests (copied by the library); task ids continue from earlier submits. */
    Status submit(std::vector<tent_request_t> requests) {
        if (tent_submit(engine_, id_, requests.data(), requests.size()) != 0)
            return Status::from_last_error("tent_submit");
        return Status();
    }
    Status status(size_t task, tent_status_t &out) const {
        if (tent_task_status(engine_, id_, task, &out) != 0)
            return Status::from_last_error("tent_task_status");
        return Status();
    }
    /* Why task `task` ended without completing (tent_task_error): empty while it runs, once it
     * completed, or when the ids name nothing live. */
    std::string error(size_t task) const {
        return mooncake::tent::tent_rs_detail::FetchString(
            [&](char *buf, size_t len) { return tent_task_error(engine_, id_, task, buf, len); });
    }
    /* Polls task `task` until it ends; ok only when it COMPLETED within `timeout`, else the
     * message says how it ended and why. */
    Status wait(size_t task, std::chrono::milliseconds timeout) const {
        const auto deadline = std::chrono::steady_clock::now() + timeout;
        for (;;) {
            tent_status_t st{};
            Status s = status(task, st);
            if (!s.ok()) return s;
            if (st.status == STATUS_COMPLETED) return Status();
            if (st.status != STATUS_WAITING && st.status != STATUS_PENDING) {
                std::string why = error(task);
                return Status::error("task " + std::to_string(task) + " ended with status " +
                                     std::to_string(st.status) + (why.empty() ? "" : ": " + why));
            }
            if (std::chrono::steady_clock::now() > deadline)
                return Status::error("task " + std::to_string(task) + " did not end in time");
            std::this_thread::yield();
        }
    }
    tent_batch_id_t id() const { return id_; }

private:
    tent_engine_t engine_ = nullptr;
    tent_batch_id_t id_ = 0;
};

}  // namespace tent

#endif  // TENT_TENT_HPP
