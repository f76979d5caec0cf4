/* The classic Mooncake C API with device memory over RDMA, as Mooncake Store and the Go
 * p2p-store call it: two classic engines (RDMA on the simulated fabric, TCP off; the test sets
 * MC_TENT_CONF and TENT_SIM_DEVICES=2) register device memory with a `cuda:N` location and move
 * it with submitTransfer; a third (tent_*) engine allocates the device memory and copies it to
 * and from host memory to check every byte, since the CPU must never touch device memory.
 * Run twice (tests/common/c_programs.rs): with GPUDirect, and with neither side's NICs reaching device
 * memory (staging buffers on both sides). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tent/transfer_engine.h"
#include "transfer_engine_c.h"
#include "check.h"
#include "classic_util.h"

/* Copies `len` bytes within engine `e` (its local segment), e.g. host to device. */
static int local_copy(tent_engine_t e, void *dst, void *src, size_t len) {
    tent_request_t r;
    memset(&r, 0, sizeof r);
    r.opcode = OPCODE_WRITE;
    r.source = src;
    r.target_id = 0;
    r.target_offset = (uint64_t)(uintptr_t)dst;
    r.length = len;
    tent_batch_id_t b = tent_allocate_batch(e, 1);
    if (tent_submit(e, b, &r, 1) != 0) return -1;
    tent_status_t st;
    for (long i = 0; i < 50000000L; ++i) {
        if (tent_task_status(e, b, 0, &st) != 0) return -1;
        if (st.status != STATUS_PENDING && st.status != STATUS_WAITING) break;
    }
    tent_free_batch(e, b);
    return st.status == STATUS_COMPLETED ? 0 : -1;
}

static void *device(tent_engine_t alloc, size_t len, const char *where) {
    void *p = NULL;
    CHECK_EQ(tent_allocate_memory(alloc, &p, len, where), 0);
    tent_memory_options_t o;
    memset(&o, 0, sizeof o);
    snprintf(o.location, sizeof o.location, "%s", where);
    o.permission = PERM_GLOBAL_READ_WRITE;
    o.transport_type = TRANSPORT_UNSPEC;
    CHECK_EQ(tent_register_memory_ex(alloc, p, len, &o), 0);
    return p;
}

int main(void) {
    tent_set_config("rpc_server_hostname", "127.0.0.1");
    tent_set_config("transports/rdma/enable", "false");
    tent_engine_t alloc = tent_create_engine();
    transfer_engine_t a = createTransferEngine("P2PHANDSHAKE", "127.0.0.1:0", "127.0.0.1", 0, 0);
    transfer_engine_t b = createTransferEngine("P2PHANDSHAKE", "127.0.0.1:0", "127.0.0.1", 0, 0);
    CHECK(alloc != NULL && a != NULL && b != NULL);
    if (alloc == NULL || a == NULL || b == NULL) return check_report("classic_gpu");
    CHECK(installTransport(a, "rdma", NULL) != NULL);
    CHECK(installTransport(b, "rdma", NULL) != NULL);
    const size_t len = (3u << 20) + 4321;
    unsigned char *host = malloc(len), *check = malloc(len);
    CHECK(host != NULL && check != NULL);
    if (host == NULL || check == NULL) return check_report("classic_gpu");
    for (size_t i = 0; i < len; ++i) host[i] = (unsigned char)(i * 13 + 1);
    memset(check, 0, len);
    CHECK_EQ(tent_register_memory(alloc, host, len), 0);
    CHECK_EQ(tent_register_memory(alloc, check, len), 0);
    void *src = device(alloc, len, "cuda:0"), *back = device(alloc, len, "cuda:0");
    void *dst = device(alloc, len, "cuda:1");
    CHECK_EQ(local_copy(alloc, src, host, len), 0);
    /* The classic engines register the same device memory, as two processes' KV caches. */
    CHECK_EQ(registerLocalMemory(a, src, len, "cuda:0", 1), 0);
    CHECK_EQ(registerLocalMemory(a, back, len, "cuda:0", 1), 0);
    CHECK_EQ(registerLocalMemory(b, dst, len, "cuda:1", 1), 0);
    char b_name[256];
    CHECK_EQ(getLocalIpAndPort(b, b_name, sizeof b_name), 0);
    segment_id_t seg = openSegment(a, b_name);
    CHECK(seg > 0);
    CHECK_EQ(classic_transfer(a, seg, OPCODE_WRITE, src, dst, len), STATUS_COMPLETED);
    CHECK_EQ(classic_transfer(a, seg, OPCODE_READ, back, dst, len), STATUS_COMPLETED);
    CHECK_EQ(local_copy(alloc, check, back, len), 0);
    CHECK(memcmp(host, check, len) == 0);
    /* Device memory the peer never registered: refused, with the reason readable. */
    void *stray = NULL;
    CHECK_EQ(tent_allocate_memory(alloc, &stray, 65536, "cuda:1"), 0);
    batch_id_t bid = allocateBatchID(a, 1);
    struct transfer_request r;
    memset(&r, 0, sizeof r);
    r.opcode = OPCODE_WRITE;
    r.source = src;
    r.target_id = seg;
    r.target_offset = (uint64_t)(uintptr_t)stray;
    r.length = 4096;
    if (submitTransfer(a, bid, &r, 1) == 0) {
        struct transfer_status st;
        for (long i = 0; i < 50000000L; ++i) {
            if (getTransferStatus(a, bid, 0, &st) != 0) break;
            if (st.status != STATUS_WAITING && st.status != STATUS_PENDING) break;
        }
        CHECK_EQ(st.status, STATUS_FAILED);
        char why[512];
        CHECK(tent_classic_transfer_error(a, bid, 0, why, sizeof why) > 0);
    }
    freeBatchID(a, bid);
    CHECK_EQ(unregisterLocalMemory(a, src), 0);
    CHECK_EQ(unregisterLocalMemory(a, back), 0);
    CHECK_EQ(unregisterLocalMemory(b, dst), 0);
    destroyTransferEngine(b);
    destroyTransferEngine(a);
    tent_destroy_engine(alloc);
    free(host);
    free(check);
    return check_report("classic_gpu");
}
