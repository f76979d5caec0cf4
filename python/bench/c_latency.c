/* The C side of bench.py's latency comparison: 4 KiB WRITEs to a segment through the classic C
 * API, one at a time, each waited for (allocateBatchID, submitTransfer, getTransferStatus until
 * it ends, freeBatchID): what transfer_sync_write does, without Python. Prints the median and
 * the 99th percentile in microseconds.
 *   c_latency SEGMENT REMOTE_ADDR COUNT */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "transfer_engine_c.h"

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc < 4) return 2;
    uint64_t remote = strtoull(argv[2], NULL, 10);
    int count = atoi(argv[3]);
    transfer_engine_t e = createTransferEngine("P2PHANDSHAKE", "127.0.0.1", "127.0.0.1", 0, 1);
    if (!e) return 3;
    static char buf[4096];
    memset(buf, 7, sizeof buf);
    if (registerLocalMemory(e, buf, sizeof buf, "cpu:0", 1) != 0) return 4;
    segment_id_t seg = openSegment(e, argv[1]);
    if (seg < 0) return 5;
    double *lat = calloc((size_t)count, sizeof *lat);
    if (!lat) return 6;
    for (int i = -100; i < count; ++i) { /* 100 warm-up calls */
        double t0 = now_us();
        batch_id_t b = allocateBatchID(e, 1);
        struct transfer_request req = {OPCODE_WRITE, buf, seg, remote, sizeof buf};
        if (submitTransfer(e, b, &req, 1) != 0) return 7;
        struct transfer_status st;
        do {
            if (getTransferStatus(e, b, 0, &st) != 0) return 8;
        } while (st.status == STATUS_WAITING || st.status == STATUS_PENDING);
        if (st.status != STATUS_COMPLETED) return 9;
        freeBatchID(e, b);
        if (i >= 0) lat[i] = now_us() - t0;
    }
    qsort(lat, (size_t)count, sizeof *lat, cmp);
    printf("%.2f %.2f\n", lat[count / 2], lat[count * 99 / 100]);
    unregisterLocalMemory(e, buf);
    destroyTransferEngine(e);
    return 0;
}
