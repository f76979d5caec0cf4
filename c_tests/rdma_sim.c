/* RDMA on the simulated fabric through the tent_* API (spec rdma.md 13.4(c) scenarios 1 and 2):
 *   stale  - engine A with an endpoint store of capacity 1 talks to B, then C (evicting its
 *            endpoint to B), then B again: B's stale endpoint must be retired and the transfer
 *            must complete with every byte right;
 *   failed - engine A whose simulated NIC fails every 5th work request: each failed slice is
 *            retried on a fresh endpoint (the peer retires its old one) and every task completes;
 *   gpu    - device memory (the simulated device, TENT_SIM_DEVICES=2) between two engines by
 *            GPUDirect, then with each side's NICs unable to reach device memory (staging
 *            buffers stand in), every byte checked after a trip back to host memory through
 *            the device; a write to device memory the peer never registered fails, and
 *            tent_task_error says why.
 * TCP is disabled, so only RDMA can move the bytes. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tent/transfer_engine.h"
#include "check.h"

static tent_engine_t make_engine_gpu(const char *cap, const char *fail_nth, const char *gpu_direct) {
    tent_set_config("rpc_server_hostname", "127.0.0.1");
    tent_set_config("log_level", "error");
    tent_set_config("transports/rdma/provider", "sim");
    tent_set_config("transports/tcp/enable", "false");
    tent_set_config("transports/rdma/num_lanes", "2");
    tent_set_config("transports/rdma/workers/block_size", "16384");
    tent_set_config("transports/rdma/endpoint/endpoint_store_cap", cap);
    tent_set_config("transports/rdma/sim/fail_every_nth_wr", fail_nth);
    tent_set_config("transports/rdma/sim/peer_memory", gpu_direct);
    tent_set_config("transports/rdma/sim/dmabuf", gpu_direct);
    return tent_create_engine();
}

static tent_engine_t make_engine(const char *cap, const char *fail_nth) {
    return make_engine_gpu(cap, fail_nth, "true");
}

static int wait_task(tent_engine_t e, tent_batch_id_t b, size_t task, tent_status_t *st) {
    for (int i = 0; i < 20000000; ++i) {
        if (tent_task_status(e, b, task, st) != 0) return -1;
        if (st->status != STATUS_PENDING && st->status != STATUS_WAITING) return 0;
    }
    return -1;
}

/* WRITE `len` pattern bytes from a to b, READ them back, and compare. */
static void write_read(tent_engine_t a, tent_engine_t b, size_t len, unsigned char seed) {
    char name[128];
    CHECK_EQ(tent_segment_name(b, name, sizeof name), 0);
    tent_segment_id_t h = 0;
    CHECK_EQ(tent_open_segment(a, &h, name), 0);
    unsigned char *src = malloc(len), *back = malloc(len), *dst = malloc(len);
    CHECK(src != NULL && back != NULL && dst != NULL);
    if (src == NULL || back == NULL || dst == NULL) return;
    for (size_t i = 0; i < len; ++i) src[i] = (unsigned char)(i * 131 + seed);
    memset(back, 0, len);
    memset(dst, 0, len);
    CHECK_EQ(tent_register_memory(a, src, len), 0);
    CHECK_EQ(tent_register_memory(a, back, len), 0);
    CHECK_EQ(tent_register_memory(b, dst, len), 0);
    tent_request_t r;
    memset(&r, 0, sizeof r);
    r.opcode = OPCODE_WRITE;
    r.source = src;
    r.target_id = h;
    r.target_offset = (uint64_t)(uintptr_t)dst;
    r.length = len;
    tent_batch_id_t batch = tent_allocate_batch(a, 2);
    CHECK_EQ(tent_submit(a, batch, &r, 1), 0);
    tent_status_t st;
    CHECK_EQ(wait_task(a, batch, 0, &st), 0);
    CHECK_EQ(st.status, STATUS_COMPLETED);
    CHECK_EQ(st.transferred_bytes, len);
    CHECK(memcmp(src, dst, len) == 0);
    r.opcode = OPCODE_READ;
    r.source = back;
    CHECK_EQ(tent_submit(a, batch, &r, 1), 0);
    CHECK_EQ(wait_task(a, batch, 1, &st), 0);
    CHECK_EQ(st.status, STATUS_COMPLETED);
    CHECK(memcmp(src, back, len) == 0);
    CHECK_EQ(tent_free_batch(a, batch), 0);
    /* The buffers stay registered until the engines go: re-registering memory at a reused
     * address gives new keys that the peer's cached descriptor learns only asynchronously. */
}

static void stale_accept(void) {
    tent_engine_t a = make_engine("1", "0");
    tent_engine_t b = make_engine("256", "0");
    tent_engine_t c = make_engine("256", "0");
    CHECK(a != NULL && b != NULL && c != NULL);
    if (a == NULL || b == NULL || c == NULL) return;
    write_read(a, b, 256 << 10, 1);
    write_read(a, c, 256 << 10, 2); /* evicts A's endpoint to B; B's stays READY */
    write_read(a, b, 256 << 10, 3); /* B retires the stale endpoint and accepts a fresh one */
    write_read(b, a, 64 << 10, 4);  /* and the pair works in the other direction too */
    tent_nic_load_stat_t stats[4];
    size_t n = 4;
    CHECK_EQ(tent_get_nic_load_stats(a, stats, &n), 0);
    CHECK_EQ(n, 1);
    CHECK_EQ(stats[0].inflight_bytes, 0);
    tent_destroy_engine(c);
    tent_destroy_engine(b);
    tent_destroy_engine(a);
}

static void failed_completion(void) {
    tent_engine_t a = make_engine("256", "5");
    tent_engine_t b = make_engine("256", "0");
    CHECK(a != NULL && b != NULL);
    if (a == NULL || b == NULL) return;
    for (unsigned char i = 0; i < 4; ++i) write_read(a, b, 128 << 10, i);
    tent_destroy_engine(b);
    tent_destroy_engine(a);
}

/* Runs one request from `e` and returns its final status; `why` gets the reason of a failure. */
static tent_status_t one(tent_engine_t e, tent_request_t *r, char *why, size_t why_len) {
    tent_status_t st;
    memset(&st, 0, sizeof st);
    tent_batch_id_t batch = tent_allocate_batch(e, 1);
    CHECK_EQ(tent_submit(e, batch, r, 1), 0);
    CHECK_EQ(wait_task(e, batch, 0, &st), 0);
    if (why != NULL) {
        why[0] = 0;
        CHECK(tent_task_error(e, batch, 0, why, why_len) >= 0);
    }
    CHECK_EQ(tent_free_batch(e, batch), 0);
    return st;
}

/* `len` device bytes of `e` on `where`, registered with it. */
static void *device_buffer(tent_engine_t e, size_t len, const char *where) {
    void *p = NULL;
    CHECK_EQ(tent_allocate_memory(e, &p, len, where), 0);
    tent_memory_options_t o;
    memset(&o, 0, sizeof o);
    snprintf(o.location, sizeof o.location, "%s", where);
    o.permission = PERM_GLOBAL_READ_WRITE;
    o.transport_type = TRANSPORT_UNSPEC;
    CHECK_EQ(tent_register_memory_ex(e, p, len, &o), 0);
    return p;
}

/* Device memory of `a` to device memory of `b` and back, by whatever path each side's NICs allow. */
static void device_round_trip(tent_engine_t a, tent_engine_t b, size_t len, unsigned char seed) {
    char name[128];
    CHECK_EQ(tent_segment_name(b, name, sizeof name), 0);
    tent_segment_id_t h = 0;
    CHECK_EQ(tent_open_segment(a, &h, name), 0);
    unsigned char *host = malloc(len), *check = malloc(len);
    CHECK(host != NULL && check != NULL);
    if (host == NULL || check == NULL) return;
    for (size_t i = 0; i < len; ++i) host[i] = (unsigned char)(i * 7 + seed);
    memset(check, 0, len);
    CHECK_EQ(tent_register_memory(a, host, len), 0);
    CHECK_EQ(tent_register_memory(a, check, len), 0);
    void *src = device_buffer(a, len, "cuda:0"), *back = device_buffer(a, len, "cuda:1");
    void *dst = device_buffer(b, len, "cuda:1");
    /* Host to device within `a` (the device copies it), then device to the peer's device. */
    tent_request_t r;
    memset(&r, 0, sizeof r);
    r.opcode = OPCODE_WRITE;
    r.source = host;
    r.target_id = 0;
    r.target_offset = (uint64_t)(uintptr_t)src;
    r.length = len;
    CHECK_EQ(one(a, &r, NULL, 0).status, STATUS_COMPLETED);
    r.source = src;
    r.target_id = h;
    r.target_offset = (uint64_t)(uintptr_t)dst;
    tent_status_t st = one(a, &r, NULL, 0);
    CHECK_EQ(st.status, STATUS_COMPLETED);
    CHECK_EQ(st.transferred_bytes, len);
    /* Back from the peer's device into another device buffer, then to host to compare. */
    r.opcode = OPCODE_READ;
    r.source = back;
    CHECK_EQ(one(a, &r, NULL, 0).status, STATUS_COMPLETED);
    r.opcode = OPCODE_WRITE;
    r.source = back;
    r.target_id = 0;
    r.target_offset = (uint64_t)(uintptr_t)check;
    CHECK_EQ(one(a, &r, NULL, 0).status, STATUS_COMPLETED);
    CHECK(memcmp(host, check, len) == 0);
    free(host);
    free(check);
}

static void gpu(void) {
    /* GPUDirect on both sides. */
    tent_engine_t a = make_engine_gpu("256", "0", "true");
    tent_engine_t b = make_engine_gpu("256", "0", "true");
    CHECK(a != NULL && b != NULL);
    if (a == NULL || b == NULL) return;
    device_round_trip(a, b, (3 << 20) + 777, 5);
    /* Neither side's NICs reach device memory: staging buffers on both sides. */
    tent_engine_t c = make_engine_gpu("256", "0", "false");
    tent_engine_t d = make_engine_gpu("256", "0", "false");
    CHECK(c != NULL && d != NULL);
    if (c == NULL || d == NULL) return;
    device_round_trip(c, d, (5 << 20) + 333, 6);
    device_round_trip(a, d, 1 << 20, 7); /* GPUDirect here, staging at the peer */
    device_round_trip(c, b, 1 << 20, 8); /* and the other way round */
    /* Device memory the peer never registered: FAILED, with the reason readable. */
    char name[128];
    CHECK_EQ(tent_segment_name(b, name, sizeof name), 0);
    tent_segment_id_t h = 0;
    CHECK_EQ(tent_open_segment(a, &h, name), 0);
    void *src = device_buffer(a, 65536, "cuda:0");
    void *stray = NULL;
    CHECK_EQ(tent_allocate_memory(b, &stray, 65536, "cuda:1"), 0);
    tent_request_t r;
    memset(&r, 0, sizeof r);
    r.opcode = OPCODE_WRITE;
    r.source = src;
    r.target_id = h;
    r.target_offset = (uint64_t)(uintptr_t)stray;
    r.length = 4096;
    char why[512];
    tent_status_t st = one(a, &r, why, sizeof why);
    CHECK_EQ(st.status, STATUS_FAILED);
    CHECK(strlen(why) > 0);
    tent_destroy_engine(d);
    tent_destroy_engine(c);
    tent_destroy_engine(b);
    tent_destroy_engine(a);
}

int main(int argc, char **argv) {
    const char *which = argc > 1 ? argv[1] : "all";
    if (strcmp(which, "stale") == 0 || strcmp(which, "all") == 0) stale_accept();
    if (strcmp(which, "failed") == 0 || strcmp(which, "all") == 0) failed_completion();
    if (strcmp(which, "gpu") == 0 || strcmp(which, "all") == 0) gpu();
    return check_report("rdma_sim");
}
