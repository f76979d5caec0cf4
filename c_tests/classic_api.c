/* The classic Mooncake C API: layouts, two engines over TCP in one process (write, read, bytes
 * verified), notifications, remote_accessible = 0, and every error path returning a negative
 * classic code. Includes the TENT header first and the classic one second (the C++ test uses the
 * other order) to show both fit in one translation unit. */
#define _DEFAULT_SOURCE
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tent/transfer_engine.h"
#include "transfer_engine_c.h"
#include "check.h"
#include "classic_util.h"

/* Upstream's layouts (x86_64 LP64). */
_Static_assert(sizeof(struct transfer_request) == 40, "transfer_request size");
_Static_assert(offsetof(struct transfer_request, source) == 8, "source offset");
_Static_assert(offsetof(struct transfer_request, target_id) == 16, "target_id offset");
_Static_assert(offsetof(struct transfer_request, target_offset) == 24, "target_offset offset");
_Static_assert(offsetof(struct transfer_request, length) == 32, "length offset");
_Static_assert(sizeof(notify_msg_t) == 16, "notify_msg size");
_Static_assert(sizeof(struct transfer_status) == 16, "transfer_status size");
_Static_assert(offsetof(struct transfer_status, transferred_bytes) == 8, "transferred_bytes");
_Static_assert(sizeof(struct segment_desc) == 48, "segment_desc size");
_Static_assert(sizeof(buffer_entry_t) == 16, "buffer_entry size");
_Static_assert(sizeof(nic_load_stat_t) == 80, "nic_load_stat size");
_Static_assert(sizeof(segment_id_t) == 4 && (segment_id_t)-1 < 0, "segment_id_t is int32_t");
_Static_assert(sizeof(batch_id_t) == 8, "batch_id_t is uint64_t");
_Static_assert(LOCAL_SEGMENT == 0 && INVALID_BATCH == UINT64_MAX, "classic constants");
_Static_assert(OPCODE_READ == 0 && OPCODE_WRITE == 1, "opcodes");
_Static_assert(STATUS_WAITING == 0 && STATUS_PENDING == 1 && STATUS_INVALID == 2 &&
                   STATUS_CANCELED == 3 && STATUS_COMPLETED == 4 && STATUS_TIMEOUT == 5 &&
                   STATUS_FAILED == 6,
               "statuses");

/* Upstream's include/error.h values. */
#define ERR_INVALID_ARGUMENT (-1)
#define ERR_TOO_MANY_REQUESTS (-2)
#define ERR_ADDRESS_NOT_REGISTERED (-3)

static transfer_engine_t start(void) {
    transfer_engine_t e = createTransferEngine("P2PHANDSHAKE", "127.0.0.1:0", "127.0.0.1", 0, 0);
    CHECK(e != NULL);
    return e;
}

/* Polls a task until it ends; returns its final status (or -1 if polling failed). */
static int wait_task(transfer_engine_t e, batch_id_t b, size_t task) {
    struct transfer_status st;
    for (long i = 0; i < 50000000L; ++i) {
        if (getTransferStatus(e, b, task, &st) != 0) return -1;
        if (st.status != STATUS_WAITING && st.status != STATUS_PENDING) return st.status;
    }
    return -1;
}

/* One request in its own batch, polled to the end; returns the final status. */
static int run_one(transfer_engine_t e, int opcode, void *src, segment_id_t target, uint64_t addr,
                   uint64_t len) {
    return classic_transfer(e, target, opcode, src, (void *)(uintptr_t)addr, len);
}

static void null_and_garbage_handles(void) {
    transfer_engine_t bad[2] = {NULL, (transfer_engine_t)(uintptr_t)0x1234};
    for (int i = 0; i < 2; ++i) {
        transfer_engine_t e = bad[i];
        char buf[64];
        struct transfer_status st;
        struct transfer_request r;
        memset(&r, 0, sizeof r);
        notify_msg_t m = {(char *)"n", (char *)"m"};
        int size = 7;
        size_t count = 0;
        CHECK(getLocalIpAndPort(e, buf, sizeof buf) < 0);
        CHECK(installTransport(e, "tcp", NULL) == NULL);
        CHECK(uninstallTransport(e, "tcp") < 0);
        CHECK(openSegment(e, "127.0.0.1:1") < 0);
        CHECK(openSegmentNoCache(e, "127.0.0.1:1") < 0);
        CHECK(closeSegment(e, 1) < 0);
        CHECK(removeLocalSegment(e, "x") < 0);
        CHECK(warmupEfaSegment(e, "x") < 0);
        CHECK(registerLocalMemory(e, buf, sizeof buf, "cpu:0", 1) < 0);
        CHECK(unregisterLocalMemory(e, buf) < 0);
        CHECK(registerLocalMemoryBatch(e, NULL, 0, NULL) < 0);
        CHECK(unregisterLocalMemoryBatch(e, NULL, 0) < 0);
        CHECK(allocateBatchID(e, 1) == INVALID_BATCH);
        CHECK(submitTransfer(e, 1, &r, 1) < 0);
        CHECK(submitTransferWithNotify(e, 1, &r, 1, m) < 0);
        CHECK(getTransferStatus(e, 1, 0, &st) < 0);
        CHECK(freeBatchID(e, 1) < 0);
        CHECK(getNotifsFromEngine(e, &size) == NULL);
        CHECK_EQ(size, 0);
        CHECK(genNotifyInEngine(e, 0, m) < 0);
        CHECK(syncSegmentCache(e) < 0);
        CHECK(getNicLoadStats(e, NULL, &count) < 0);
        CHECK(discoverTopology(e) < 0);
        enableGracefulShutdown(e); /* ignored */
        CHECK(showLinks(e, buf, sizeof buf, 1) < 0);
        destroyTransferEngine(e); /* ignored */
    }
    CHECK_EQ(freeNotifsMsgBuf(NULL, 0), 0);
}

static void creation_failures(void) {
    char why[256];
    CHECK(createTransferEngine(NULL, "a", "127.0.0.1", 0, 0) == NULL);
    /* A metadata type nobody knows fails with a reason (upstream aborts the process). */
    CHECK(createTransferEngine("zookeeper://127.0.0.1:2181", "node", "127.0.0.1", 0, 0) == NULL);
    CHECK(tent_last_error(why, sizeof why) > 0);
    /* A metadata store this build may lack fails cleanly with a reason (or starts, once it exists;
     * nothing listens on port 1, so a store that connects at start fails either way). */
    transfer_engine_t r = createTransferEngine("redis://127.0.0.1:1", "node", "127.0.0.1", 0, 0);
    if (r) {
        destroyTransferEngine(r);
    } else {
        CHECK(tent_last_error(why, sizeof why) > 0);
    }
}

/* IPv6: the reported address is bracketed and is what peers open. Skipped when the host has no
 * IPv6 loopback. */
static void ipv6(void) {
    transfer_engine_t a = createTransferEngine("P2PHANDSHAKE", NULL, "::1", 0, 0);
    if (!a) {
        printf("classic_api: skipping IPv6 (no ::1 here)\n");
        return;
    }
    transfer_engine_t b = createTransferEngine("P2PHANDSHAKE", NULL, "::1", 0, 0);
    CHECK(b != NULL);
    char name[128];
    CHECK_EQ(getLocalIpAndPort(a, name, sizeof name), 0);
    CHECK(strncmp(name, "[::1]:", 6) == 0);
    if (b) {
        CHECK(openSegment(b, name) > 0);
        destroyTransferEngine(b);
    }
    destroyTransferEngine(a);
}

int main(void) {
    null_and_garbage_handles();
    creation_failures();
    ipv6();

    transfer_engine_t a = start();
    transfer_engine_t b = start();
    if (!a || !b) return check_report("classic_api");

    /* The ip:port peers open, as the Go p2p-store reads it (a 256-byte buffer). */
    char a_name[256], b_name[256];
    CHECK_EQ(getLocalIpAndPort(a, a_name, sizeof a_name), 0);
    CHECK_EQ(getLocalIpAndPort(b, b_name, sizeof b_name), 0);
    CHECK(strncmp(a_name, "127.0.0.1:", 10) == 0);
    CHECK(strcmp(a_name, b_name) != 0);
    char tiny[4];
    CHECK_EQ(getLocalIpAndPort(a, tiny, sizeof tiny), ERR_INVALID_ARGUMENT);
    CHECK_EQ(getLocalIpAndPort(a, NULL, 16), ERR_INVALID_ARGUMENT);

    /* Transports: tcp is there (args NULL or {NULL}); rdma and shm are not in this engine. */
    void *no_args[1] = {NULL};
    CHECK(installTransport(a, "tcp", NULL) != NULL);
    CHECK(installTransport(b, "tcp", no_args) != NULL);
    char matrix[] = "{\"cpu:0\": [[\"mlx5_0\"], []]}";
    void *matrix_args[2] = {matrix, NULL};
    CHECK(installTransport(a, "tcp", matrix_args) != NULL);
    char bad_matrix[] = "{not json";
    void *bad_args[2] = {bad_matrix, NULL};
    CHECK(installTransport(a, "tcp", bad_args) == NULL);
    CHECK(installTransport(a, "rdma", matrix_args) == NULL);
    CHECK(installTransport(a, "bogus", NULL) == NULL);
    CHECK(installTransport(a, NULL, NULL) == NULL);
    CHECK_EQ(uninstallTransport(a, "rdma"), 0);
    CHECK_EQ(uninstallTransport(a, NULL), ERR_INVALID_ARGUMENT);

    /* Memory: A's local buffer, B's target buffer, B's local-only buffer. */
    const size_t len = 1u << 20;
    unsigned char *src = malloc(len), *back = malloc(len), *target = malloc(len),
                  *private_mem = malloc(len), *unreg = malloc(len);
    for (size_t i = 0; i < len; ++i) src[i] = (unsigned char)(i * 7 + 3);
    memset(back, 0, len);
    memset(target, 0, len);
    memset(private_mem, 0x5a, len);
    CHECK_EQ(registerLocalMemory(a, src, len, "cpu:0", 1), 0);
    CHECK_EQ(registerLocalMemory(a, back, len, NULL, 1), 0);
    CHECK_EQ(registerLocalMemory(b, target, len, "*", 1), 0);
    CHECK_EQ(registerLocalMemory(b, private_mem, len, "cpu:0", 0), 0);
    CHECK_EQ(registerLocalMemory(a, NULL, len, "cpu:0", 1), ERR_INVALID_ARGUMENT);

    segment_id_t seg = openSegment(a, b_name);
    CHECK(seg > 0);
    CHECK_EQ(openSegment(a, a_name), LOCAL_SEGMENT);
    CHECK_EQ(openSegmentNoCache(a, b_name), seg);
    CHECK_EQ(openSegment(a, NULL), ERR_INVALID_ARGUMENT);
    CHECK_EQ(openSegment(a, ""), ERR_INVALID_ARGUMENT);
    CHECK(openSegment(a, "127.0.0.1:1") < 0); /* nobody listens there */

    /* WRITE then READ back, bytes verified. target_offset is the absolute remote address. */
    CHECK_EQ(run_one(a, OPCODE_WRITE, src, seg, (uint64_t)(uintptr_t)target, len), STATUS_COMPLETED);
    CHECK(memcmp(src, target, len) == 0);
    CHECK_EQ(run_one(a, OPCODE_READ, back, seg, (uint64_t)(uintptr_t)target, len), STATUS_COMPLETED);
    CHECK(memcmp(src, back, len) == 0);

    /* Local memory that is not registered but is memory moves as with upstream's TCP transport
     * (Mooncake Store reads into plain buffers): into it, then out of it. */
    CHECK_EQ(run_one(a, OPCODE_READ, unreg, seg, (uint64_t)(uintptr_t)target, len), STATUS_COMPLETED);
    CHECK(memcmp(src, unreg, len) == 0);
    for (size_t i = 0; i < len; ++i) unreg[i] = (unsigned char)(i * 11 + 5);
    CHECK_EQ(run_one(a, OPCODE_WRITE, unreg, seg, (uint64_t)(uintptr_t)target, len), STATUS_COMPLETED);
    CHECK(memcmp(unreg, target, len) == 0);

    /* remote_accessible = 0: peers are refused, the memory itself stays untouched. */
    CHECK_EQ(run_one(a, OPCODE_WRITE, src, seg, (uint64_t)(uintptr_t)private_mem, 4096), STATUS_FAILED);
    CHECK_EQ(private_mem[0], 0x5a);

    /* Error paths of a transfer. */
    struct transfer_request r;
    memset(&r, 0, sizeof r);
    r.opcode = OPCODE_WRITE;
    r.source = src;
    r.target_id = seg;
    r.target_offset = (uint64_t)(uintptr_t)target;
    r.length = 64;
    struct transfer_status st;
    batch_id_t bid = allocateBatchID(a, 4);
    CHECK(bid != INVALID_BATCH);
    CHECK_EQ(submitTransfer(a, bid, NULL, 1), ERR_INVALID_ARGUMENT);
    CHECK_EQ(getTransferStatus(a, bid, 0, NULL), ERR_INVALID_ARGUMENT);
    CHECK_EQ(getTransferStatus(a, bid, 99, &st), ERR_INVALID_ARGUMENT); /* no such task */
    struct transfer_request bad = r;
    bad.target_id = 999; /* never opened */
    CHECK_EQ(submitTransfer(a, bid, &bad, 1), ERR_INVALID_ARGUMENT);
    bad = r;
    bad.target_id = -5;
    CHECK_EQ(submitTransfer(a, bid, &bad, 1), ERR_INVALID_ARGUMENT);
    bad = r;
    bad.opcode = 9;
    CHECK_EQ(submitTransfer(a, bid, &bad, 1), ERR_INVALID_ARGUMENT);
    bad = r;
    bad.source = (void *)(uintptr_t)0x1000; /* neither registered nor mapped */
    CHECK_EQ(submitTransfer(a, bid, &bad, 1), ERR_ADDRESS_NOT_REGISTERED);
    notify_msg_t null_note = {NULL, NULL};
    CHECK_EQ(submitTransferWithNotify(a, bid, &r, 1, null_note), ERR_INVALID_ARGUMENT);
    struct transfer_request five[5];
    for (int i = 0; i < 5; ++i) five[i] = r;
    CHECK_EQ(submitTransfer(a, bid, five, 5), ERR_TOO_MANY_REQUESTS); /* more than the batch's 4 */
    CHECK_EQ(submitTransfer(a, bid, &r, 1), 0);
    CHECK_EQ(wait_task(a, bid, 0), STATUS_COMPLETED);
    CHECK_EQ(freeBatchID(a, bid), 0);
    /* A freed batch. */
    CHECK_EQ(getTransferStatus(a, bid, 0, &st), ERR_INVALID_ARGUMENT);
    CHECK_EQ(submitTransfer(a, bid, &r, 1), ERR_INVALID_ARGUMENT);
    CHECK(freeBatchID(a, bid) < 0);
    CHECK_EQ(allocateBatchID(a, 0), INVALID_BATCH);

    /* Notifications: with a submit, and on their own. */
    bid = allocateBatchID(a, 1);
    notify_msg_t note = {(char *)"kv", (char *)"layer-7 done"};
    CHECK_EQ(submitTransferWithNotify(a, bid, &r, 1, note), 0);
    CHECK_EQ(wait_task(a, bid, 0), STATUS_COMPLETED);
    CHECK_EQ(freeBatchID(a, bid), 0);
    notify_msg_t direct = {(char *)"ping", (char *)"hello"};
    CHECK_EQ(genNotifyInEngine(a, (uint64_t)seg, direct), 0);
    CHECK_EQ(genNotifyInEngine(a, 4242, direct), ERR_INVALID_ARGUMENT);
    CHECK_EQ(genNotifyInEngine(a, 0, null_note), ERR_INVALID_ARGUMENT);
    int got = 0, seen_kv = 0, seen_ping = 0;
    for (long spin = 0; spin < 2000000L && got < 2; ++spin) {
        int size = -1;
        notify_msg_t *msgs = getNotifsFromEngine(b, &size);
        CHECK(size >= 0);
        CHECK((msgs == NULL) == (size == 0));
        for (int i = 0; i < size; ++i) {
            if (strcmp(msgs[i].name, "kv") == 0 && strcmp(msgs[i].msg, "layer-7 done") == 0) seen_kv = 1;
            if (strcmp(msgs[i].name, "ping") == 0 && strcmp(msgs[i].msg, "hello") == 0) seen_ping = 1;
        }
        got += size;
        CHECK_EQ(freeNotifsMsgBuf(msgs, size), 0);
        if (got < 2) usleep(1000);
    }
    CHECK(seen_kv && seen_ping);
    CHECK(getNotifsFromEngine(b, NULL) == NULL);

    /* Batch registration and unregistration, and unregistered memory. */
    unsigned char *m1 = malloc(4096), *m2 = malloc(4096);
    buffer_entry_t list[2] = {{m1, 4096}, {m2, 4096}};
    CHECK_EQ(registerLocalMemoryBatch(a, list, 2, "cpu:0"), 0);
    CHECK_EQ(registerLocalMemoryBatch(a, NULL, 2, "cpu:0"), ERR_INVALID_ARGUMENT);
    void *addrs[2] = {m1, m2};
    void *mixed[2] = {m1, unreg};
    CHECK_EQ(unregisterLocalMemoryBatch(a, mixed, 2), ERR_ADDRESS_NOT_REGISTERED);
    CHECK_EQ(unregisterLocalMemoryBatch(a, addrs, 2), 0);
    CHECK_EQ(unregisterLocalMemoryBatch(a, NULL, 2), ERR_INVALID_ARGUMENT);
    CHECK_EQ(unregisterLocalMemory(a, unreg), ERR_ADDRESS_NOT_REGISTERED);
    CHECK_EQ(unregisterLocalMemory(a, NULL), ERR_INVALID_ARGUMENT);

    /* The documented no-ops and small queries. */
    size_t count = 5;
    nic_load_stat_t stats[5];
    CHECK_EQ(getNicLoadStats(a, stats, &count), 0);
    CHECK_EQ(count, 0);
    CHECK_EQ(getNicLoadStats(a, NULL, NULL), ERR_INVALID_ARGUMENT);
    char links[64];
    CHECK_EQ(showLinks(a, links, sizeof links, 1), 0);
    CHECK(strstr(links, "\"local_nics\": []") != NULL);
    CHECK_EQ(discoverTopology(a), 0);
    CHECK_EQ(removeLocalSegment(a, "x"), 0);
    CHECK_EQ(warmupEfaSegment(a, b_name), 0);
    CHECK_EQ(syncSegmentCache(a), 0);

    /* Segments: close, then the handle is unknown. */
    CHECK_EQ(closeSegment(a, seg), 0);
    CHECK_EQ(closeSegment(a, seg), ERR_INVALID_ARGUMENT);
    CHECK_EQ(closeSegment(a, -1), ERR_INVALID_ARGUMENT);
    CHECK_EQ(submitTransfer(a, allocateBatchID(a, 1), &r, 1), ERR_INVALID_ARGUMENT);

    CHECK_EQ(unregisterLocalMemory(a, src), 0);
    CHECK_EQ(unregisterLocalMemory(a, back), 0);
    CHECK_EQ(unregisterLocalMemory(b, target), 0);
    CHECK_EQ(unregisterLocalMemory(b, private_mem), 0);
    destroyTransferEngine(a);
    destroyTransferEngine(b);
    /* Destroyed handles are rejected, not dereferenced. */
    CHECK(allocateBatchID(a, 1) == INVALID_BATCH);
    CHECK(registerLocalMemory(b, src, len, "cpu:0", 1) < 0);
    destroyTransferEngine(a);

    free(src);
    free(back);
    free(target);
    free(private_mem);
    free(unreg);
    free(m1);
    free(m2);
    return check_report("classic_api");
}
