/* tent-rs example: a verified transfer through the tent_* C API.
 *
 * Writes a buffer into the engine's local segment and reads it back, checks every byte, and
 * prints the throughput of each direction. Usage: transfer [MiB] (default 256). */
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

static int run_batch(tent_engine_t e, int opcode, void *local, uint64_t remote, size_t len, size_t chunk) {
    size_t n = (len + chunk - 1) / chunk;
    tent_batch_id_t b = tent_allocate_batch(e, n);
    tent_request_t *reqs = calloc(n, sizeof *reqs);
    if (b == 0 || b == UINT64_MAX || !reqs) return -1;
    for (size_t i = 0; i < n; ++i) {
        reqs[i].opcode = opcode;
        reqs[i].source = (char *)local + i * chunk;
        reqs[i].target_id = LOCAL_SEGMENT_ID;
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

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 256;
    size_t len = mib << 20, chunk = 1 << 20;
    tent_set_config("rpc_server_hostname", "127.0.0.1");
    tent_set_config("log_level", "warning");
    tent_engine_t e = tent_create_engine();
    if (!tent_available(e)) {
        char err[512];
        tent_last_error(err, sizeof err);
        fprintf(stderr, "engine failed to start: %s\n", err);
        return 1;
    }
    char name[128];
    tent_segment_name(e, name, sizeof name);
    void *src = NULL, *dst = NULL, *back = NULL;
    if (tent_allocate_memory(e, &src, len, "*") || tent_allocate_memory(e, &dst, len, "*") ||
        tent_allocate_memory(e, &back, len, "*")) {
        fprintf(stderr, "allocation failed\n");
        return 1;
    }
    if (tent_register_memory(e, src, len) || tent_register_memory(e, dst, len) || tent_register_memory(e, back, len)) {
        fprintf(stderr, "registration failed\n");
        return 1;
    }
    for (size_t i = 0; i < len / 8; ++i) ((uint64_t *)src)[i] = i * 0x9e3779b97f4a7c15ull;

    double t0 = now();
    if (run_batch(e, OPCODE_WRITE, src, (uint64_t)(uintptr_t)dst, len, chunk)) {
        fprintf(stderr, "write failed\n");
        return 1;
    }
    double t1 = now();
    if (run_batch(e, OPCODE_READ, back, (uint64_t)(uintptr_t)dst, len, chunk)) {
        fprintf(stderr, "read failed\n");
        return 1;
    }
    double t2 = now();
    if (memcmp(src, dst, len) != 0 || memcmp(src, back, len) != 0) {
        fprintf(stderr, "data mismatch\n");
        return 1;
    }
    printf("segment %s: %zu MiB in 1 MiB requests, all bytes verified\n", name, mib);
    printf("write: %.2f GB/s\nread:  %.2f GB/s\n", (double)len / (t1 - t0) / 1e9, (double)len / (t2 - t1) / 1e9);
    tent_destroy_engine(e);
    return 0;
}
