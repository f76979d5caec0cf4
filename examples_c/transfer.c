/* tent-rs example: a verified transfer between two engines through the tent_* C API.
 *
 * Starts a target engine and an initiator engine on 127.0.0.1 (p2p metadata, TCP transport),
 * writes a buffer from the initiator into the target's registered memory and reads it back in
 * 1 MiB requests, checks every byte on both sides, and prints the throughput of each direction.
 * Usage: transfer [MiB] (default 256). */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tent/transfer_engine.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int run_batch(tent_engine_t e, tent_segment_id_t target, int opcode, void *local, uint64_t remote, size_t len,
                     size_t chunk) {
    size_t n = (len + chunk - 1) / chunk;
    tent_batch_id_t b = tent_allocate_batch(e, n);
    tent_request_t *reqs = calloc(n, sizeof *reqs);
    if (b == 0 || b == UINT64_MAX || !reqs) return -1;
    for (size_t i = 0; i < n; ++i) {
        reqs[i].opcode = opcode;
        reqs[i].source = (char *)local + i * chunk;
        reqs[i].target_id = target;
        reqs[i].target_offset = remote + i * chunk;
        reqs[i].length = (i + 1) * chunk > len ? len - i * chunk : chunk;
    }
    int rc = tent_submit(e, b, reqs, n);
    tent_status_t st = {0};
    while (rc == 0) {
        rc = tent_overall_status(e, b, &st);
        if (st.status != STATUS_PENDING) break;
    }
    free(reqs);
    tent_free_batch(e, b);
    return rc == 0 && st.status == STATUS_COMPLETED ? 0 : -1;
}

static tent_engine_t start_engine(const char *role) {
    tent_set_config("rpc_server_hostname", "127.0.0.1");
    tent_set_config("log_level", "warning");
    tent_engine_t e = tent_create_engine();
    if (!tent_available(e)) {
        char err[512];
        tent_last_error(err, sizeof err);
        fprintf(stderr, "%s engine failed to start: %s\n", role, err);
        exit(1);
    }
    return e;
}

static void *registered(tent_engine_t e, size_t len) {
    void *p = NULL;
    if (tent_allocate_memory(e, &p, len, "*") != 0 || tent_register_memory(e, p, len) != 0) {
        fprintf(stderr, "allocating and registering %zu bytes failed\n", len);
        exit(1);
    }
    return p;
}

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 256;
    if (mib == 0) mib = 1;
    size_t len = mib << 20, chunk = 1 << 20;
    tent_engine_t target = start_engine("target");
    tent_engine_t initiator = start_engine("initiator");
    char target_name[128];
    tent_segment_name(target, target_name, sizeof target_name);
    void *dst = registered(target, len);
    memset(dst, 0, len);
    void *src = registered(initiator, len);
    void *back = registered(initiator, len);
    memset(back, 0, len);
    for (size_t i = 0; i < len / 8; ++i) ((uint64_t *)src)[i] = i * 0x9e3779b97f4a7c15ull;

    /* The initiator finds the target by name and reads its buffer list. */
    tent_segment_id_t h;
    tent_segment_info_t info;
    if (tent_open_segment(initiator, &h, target_name) != 0 || tent_get_segment_info(initiator, h, &info) != 0 ||
        info.num_buffers != 1) {
        fprintf(stderr, "could not read the target's segment %s\n", target_name);
        return 1;
    }
    uint64_t remote = info.buffers[0].base;
    tent_free_segment_info(&info);

    double t0 = now();
    if (run_batch(initiator, h, OPCODE_WRITE, src, remote, len, chunk)) {
        fprintf(stderr, "write failed\n");
        return 1;
    }
    double t1 = now();
    if (run_batch(initiator, h, OPCODE_READ, back, remote, len, chunk)) {
        fprintf(stderr, "read failed\n");
        return 1;
    }
    double t2 = now();
    if (memcmp(src, dst, len) != 0 || memcmp(src, back, len) != 0) {
        fprintf(stderr, "data mismatch\n");
        return 1;
    }
    printf("initiator -> target %s over TCP: %zu MiB in 1 MiB requests, every byte verified\n", target_name, mib);
    printf("write: %.2f GB/s\nread:  %.2f GB/s\n", (double)len / (t1 - t0) / 1e9, (double)len / (t2 - t1) / 1e9);
    tent_destroy_engine(initiator);
    tent_destroy_engine(target);
    return 0;
}
