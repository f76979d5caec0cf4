/* Pins every size, offset and constant of the TENT C API to upstream's values (spec 1.1, 1.2). */
#include <stddef.h>
#include <stdint.h>

#include "tent/transfer_engine.h"
#include "check.h"

_Static_assert(sizeof(tent_batch_id_t) == 8, "tent_batch_id_t");
_Static_assert(sizeof(tent_segment_id_t) == 8, "tent_segment_id_t");
_Static_assert(sizeof(tent_engine_t) == sizeof(void *), "tent_engine_t");

_Static_assert(sizeof(struct tent_request) == 48 && _Alignof(struct tent_request) == 8, "tent_request");
_Static_assert(offsetof(tent_request_t, opcode) == 0, "opcode");
_Static_assert(offsetof(tent_request_t, source) == 8, "source");
_Static_assert(offsetof(tent_request_t, target_id) == 16, "target_id");
_Static_assert(offsetof(tent_request_t, target_offset) == 24, "target_offset");
_Static_assert(offsetof(tent_request_t, length) == 32, "length");
_Static_assert(offsetof(tent_request_t, priority) == 40, "priority");
_Static_assert(offsetof(tent_request_t, transport_hint) == 44, "transport_hint");

_Static_assert(sizeof(tent_status_t) == 16, "tent_status");
_Static_assert(offsetof(struct tent_status, status) == 0, "status");
_Static_assert(offsetof(struct tent_status, transferred_bytes) == 8, "transferred_bytes");

_Static_assert(sizeof(struct tent_buffer_info) == 80, "tent_buffer_info");
_Static_assert(offsetof(struct tent_buffer_info, base) == 0, "base");
_Static_assert(offsetof(struct tent_buffer_info, length) == 8, "length");
_Static_assert(offsetof(struct tent_buffer_info, location) == 16, "location");

_Static_assert(sizeof(tent_segment_info_t) == 16, "tent_segment_info");
_Static_assert(offsetof(struct tent_segment_info, type) == 0, "type");
_Static_assert(offsetof(struct tent_segment_info, num_buffers) == 4, "num_buffers");
_Static_assert(offsetof(struct tent_segment_info, buffers) == 8, "buffers");

_Static_assert(sizeof(tent_notifi_record_t) == 4360, "tent_notifi_record");
_Static_assert(offsetof(struct tent_notifi_record, handle) == 0, "handle");
_Static_assert(offsetof(struct tent_notifi_record, name) == 8, "name");
_Static_assert(offsetof(struct tent_notifi_record, msg) == 264, "msg");

_Static_assert(sizeof(tent_notifi_info) == 16, "tent_notifi_info");
_Static_assert(offsetof(struct tent_notifi_info, num_records) == 0, "num_records");
_Static_assert(offsetof(struct tent_notifi_info, records) == 8, "records");

_Static_assert(sizeof(tent_memory_options_t) == 344, "tent_memory_options");
_Static_assert(offsetof(struct tent_memory_options, location) == 0, "location");
_Static_assert(offsetof(struct tent_memory_options, permission) == 64, "permission");
_Static_assert(offsetof(struct tent_memory_options, transport_type) == 68, "transport_type");
_Static_assert(offsetof(struct tent_memory_options, shm_path) == 72, "shm_path");
_Static_assert(offsetof(struct tent_memory_options, shm_offset) == 328, "shm_offset");
_Static_assert(offsetof(struct tent_memory_options, internal) == 336, "internal");

_Static_assert(sizeof(tent_nic_load_stat_t) == 80, "tent_nic_load_stat");
_Static_assert(offsetof(struct tent_nic_load_stat, device_name) == 0, "device_name");
_Static_assert(offsetof(struct tent_nic_load_stat, inflight_bytes) == 64, "inflight_bytes");
_Static_assert(offsetof(struct tent_nic_load_stat, ewma_bandwidth_bps) == 72, "ewma");

int main(void) {
    CHECK_EQ(LOCAL_SEGMENT_ID, 0);
    CHECK(sizeof(LOCAL_SEGMENT_ID) == 8); /* 0ull, as upstream */
    CHECK_EQ(OPCODE_READ, 0);
    CHECK_EQ(OPCODE_WRITE, 1);
    CHECK_EQ(STATUS_WAITING, 0);
    CHECK_EQ(STATUS_PENDING, 1);
    CHECK_EQ(STATUS_INVALID, 2);
    CHECK_EQ(STATUS_CANCELED, 3);
    CHECK_EQ(STATUS_COMPLETED, 4);
    CHECK_EQ(STATUS_TIMEOUT, 5);
    CHECK_EQ(STATUS_FAILED, 6);
    CHECK_EQ(TYPE_MEMORY, 0);
    CHECK_EQ(TYPE_FILE, 1);
    CHECK_EQ(PERM_LOCAL_READ_WRITE, 0);
    CHECK_EQ(PERM_GLOBAL_READ_ONLY, 1);
    CHECK_EQ(PERM_GLOBAL_READ_WRITE, 2);
    CHECK_EQ(TRANSPORT_UNSPEC, 0);
    CHECK_EQ(TRANSPORT_RDMA, 1);
    CHECK_EQ(TRANSPORT_MNNVL, 2);
    CHECK_EQ(TRANSPORT_SHM, 3);
    CHECK_EQ(TRANSPORT_NVLINK, 4);
    CHECK_EQ(TRANSPORT_GDS, 5);
    CHECK_EQ(TRANSPORT_IOURING, 6);
    CHECK_EQ(TRANSPORT_TCP, 7);
    CHECK_EQ(TRANSPORT_ASCEND_DIRECT, 8);
    CHECK_EQ(TRANSPORT_SUNRISE_LINK, 9);
    CHECK_EQ(TRANSPORT_TPU, 10);
    CHECK_EQ(TRANSPORT_UB, 11);
    CHECK_EQ(TRANSPORT_MPCOMM, 12);
    CHECK(tent_version() != NULL && tent_version()[0] != '\0');
    return check_report("abi_layout");
}
