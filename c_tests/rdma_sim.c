/* RDMA on the simulated fabric through the tent_* API (spec rdma.md 13.4(c) scenarios 1 and 2):
 *   stale  - engine A with an endpoint store of capacity 1 talks to B, then C (evicting its
 *            endpoint to B), then B again: B's stale endpoint must be retired and the transfer
 *            must complete with every byte right;
 *   failed - engine A whose simulated NIC fails every 5th work request: each failed slice is
 *            retried on a fresh endpoint (the peer retires its old one) and every task completes.
 * TCP is disabled, so only RDMA can move the bytes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tent/transfer_engine.h"
#include "check.h"

static tent_engine_t make_engine(const char *cap, const char *fail_nth) {
    tent_set_config("rpc_server_hostname", "127.0.0.1");
    tent_set_config("log_level", "error");
    tent_set_config("transports/rdma/provider", "sim");
    tent_set_config("transports/tcp/enable", "false");
    tent_set_config("transports/rdma/num_lanes", "2");
    tent_set_config("transports/rdma/workers/block_size", "16384");
    tent_set_config("transports/rdma/endpoint/endpoint_store_cap", cap);
    tent_set_config("transports/rdma/sim/fail_every_nth_wr", fail_nth);
    return tent_create_engine();
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

int main(int argc, char **argv) {
    const char *which = argc > 1 ? argv[1] : "all";
    if (strcmp(which, "stale") == 0 || strcmp(which, "all") == 0) stale_accept();
    if (strcmp(which, "failed") == 0 || strcmp(which, "all") == 0) failed_completion();
    return check_report("rdma_sim");
}
