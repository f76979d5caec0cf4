// tent-rs: upstream's classic Transport (transport/transport.h): the request, status and
// handle types every caller uses, header-only. The engine loads and runs its transports
// itself (TCP, shared memory, RDMA); TransferEngine::installTransport returns a Transport
// object that names one of them. Its transfer methods are not the way to move data here
// (they return NotImplemented): use TransferEngine's. Subclassing Transport compiles, but
// the engine has no way to run a caller's transport.
#ifndef TENT_RS_MOONCAKE_TRANSPORT_H
#define TENT_RS_MOONCAKE_TRANSPORT_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <queue>
#include <string>
#include <utility>
#include <vector>

#include "../common/base/status.h"
#include "../transfer_metadata.h"

#ifdef USE_EVENT_DRIVEN_COMPLETION
#error "tent-rs: USE_EVENT_DRIVEN_COMPLETION reads the engine's batch internals through a BatchID; build without it"
#endif

namespace mooncake {

class Transport {
    friend class TransferEngine;

   public:
    using SegmentID = uint64_t;
    using SegmentHandle = SegmentID;
    using BatchID = uint64_t;

    using BufferDesc = TransferMetadata::BufferDesc;
    using SegmentDesc = TransferMetadata::SegmentDesc;
    using HandShakeDesc = TransferMetadata::HandShakeDesc;
    using NotifyDesc = TransferMetadata::NotifyDesc;

    // Field order as upstream's: callers build requests with designated initializers.
    struct TransferRequest {
        enum OpCode { READ, WRITE };

        static constexpr uint64_t kNoTaskGroup = 0;

        OpCode opcode;
        void* source;
        SegmentID target_id;
        uint64_t target_offset;
        size_t length;
        int advise_retry_cnt = 0;
        // Accepted and ignored: the engine picks the transport (upstream pins it under TENT only).
        int transport_hint = 0;
        // Accepted and ignored: each request is one task.
        uint64_t task_group_id = kNoTaskGroup;
    };

    // The values of the C API's STATUS_* constants.
    enum TransferStatusEnum { WAITING, PENDING, INVALID, CANCELED, COMPLETED, TIMEOUT, FAILED };

    struct TransferStatus {
        TransferStatusEnum s;
        size_t transferred_bytes;
    };

    struct NicLoadStats {
        std::string device_name;
        uint64_t inflight_bytes{0};
        double ewma_bandwidth_bps{0.0};
    };

    struct BufferEntry {
        void* addr;
        size_t length;
    };

    // Upstream's BatchID is the address of its batch state; tent-rs's is an opaque number, so
    // the batch state is not reachable from it (see the #error above).
    struct BatchDesc;
    struct TransferTask;

    explicit Transport(std::string name = "") : name_(std::move(name)) {}
    virtual ~Transport() {}

    Transport(const Transport&) = delete;
    Transport& operator=(const Transport&) = delete;

    virtual BatchID allocateBatchID(size_t batch_size) {
        (void)batch_size;
        return UINT64_MAX;
    }
    virtual Status freeBatchID(BatchID batch_id) {
        (void)batch_id;
        return notHere();
    }
    virtual Status submitTransfer(BatchID batch_id, const std::vector<TransferRequest>& entries) {
        (void)batch_id;
        (void)entries;
        return notHere();
    }
    virtual Status submitTransferTask(const std::vector<TransferTask*>& task_list) {
        (void)task_list;
        return notHere();
    }
    virtual Status submitTransferTaskGroup(const std::vector<TransferTask*>& task_list) {
        return submitTransferTask(task_list);
    }
    virtual bool supportsGroupedScatter() const { return false; }
    virtual Status getTransferStatus(BatchID batch_id, size_t task_id, TransferStatus& status) {
        (void)batch_id;
        (void)task_id;
        (void)status;
        return notHere();
    }
    virtual Status OpenChannel(const std::string& segment_name, SegmentID sid) {
        (void)segment_name;
        (void)sid;
        return Status::OK();
    }
    virtual Status CheckStatus(SegmentID sid) {
        (void)sid;
        return Status::OK();
    }

    std::shared_ptr<TransferMetadata>& meta() { return metadata_; }

    // The transport's name as installTransport was given it ("tcp", "rdma", "shm").
    virtual const char* getName() const { return name_.c_str(); }

   protected:
    std::string local_server_name_;
    std::shared_ptr<TransferMetadata> metadata_;

   private:
    static Status notHere() {
        return Status::NotImplemented("tent-rs: transfers go through TransferEngine, not through a Transport");
    }
    std::string name_;
};

}  // namespace mooncake

#endif  // TENT_RS_MOONCAKE_TRANSPORT_H
