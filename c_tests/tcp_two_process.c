/* Two engines in two processes over TCP on 127.0.0.1, through the C API only: the peer's
 * buffers via tent_get_segment_info, strided WRITE then READ with bytes verified, a
 * notification, and the peer killed mid-batch (every task still ends within the bound). */
#define _DEFAULT_SOURCE
#define _POSIX_C_SOURCE 200809L
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tent/transfer_engine.h"
#include "check.h"

#define PEER_LEN (64u << 20)

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void peer(int to_parent, int from_parent) {
    tent_set_config("rpc_server_hostname", "127.0.0.1");
    tent_engine_t e = tent_create_engine();
    void *buf = NULL;
    if (!tent_available(e) || tent_allocate_memory(e, &buf, PEER_LEN, "*") || tent_register_memory(e, buf, PEER_LEN))
        _exit(2);
    char name[128] = {0};
    tent_segment_name(e, name, sizeof name);
    if (write(to_parent, name, sizeof name) != (ssize_t)sizeof name) _exit(3);
    /* Wait for the parent's verdict on the notification, then serve until killed. */
    char cmd = 0;
    if (read(from_parent, &cmd, 1) != 1) _exit(4);
    tent_notifi_info ni;
    int got = 0;
    for (int i = 0; i < 5000 && !got; ++i) {
        if (tent_recv_notifs(e, &ni) == 0 && ni.num_records > 0) {
            got = strcmp(ni.records[0].name, "from-parent") == 0 && strcmp(ni.records[0].msg, "hi") == 0;
            tent_free_notifs(&ni);
            if (!got) break;
        }
        usleep(1000);
    }
    cmd = got ? 'y' : 'n';
    if (write(to_parent, &cmd, 1) != 1) _exit(5);
    for (;;) pause();
}

static int wait_all(tent_engine_t e, tent_batch_id_t b, size_t n, double bound, int *failed) {
    double start = now();
    tent_status_t st;
    *failed = 0;
    for (;;) {
        size_t pending = 0;
        *failed = 0;
        for (size_t t = 0; t < n; ++t) {
            if (tent_task_status(e, b, t, &st) != 0) return -1;
            if (st.status == STATUS_PENDING) ++pending;
            if (st.status == STATUS_FAILED) ++*failed;
        }
        if (pending == 0) return 0;
        if (now() - start > bound) return -1;
        usleep(1000);
    }
}

int main(void) {
    int up[2], down[2];
    CHECK(pipe(up) == 0 && pipe(down) == 0);
    pid_t child = fork();
    if (child == 0) {
        close(up[0]);
        close(down[1]);
        peer(up[1], down[0]);
    }
    close(up[1]);
    close(down[0]);
    char name[128];
    CHECK(read(up[0], name, sizeof name) == (ssize_t)sizeof name);

    tent_set_config("rpc_server_hostname", "127.0.0.1");
    tent_set_config("transports/tcp/retry_base_delay_ms", "20");
    tent_engine_t e = tent_create_engine();
    CHECK_EQ(tent_available(e), 1);
    tent_segment_id_t h = 0;
    CHECK_EQ(tent_open_segment(e, &h, name), 0);
    CHECK(h >= 1);
    tent_segment_info_t info;
    CHECK_EQ(tent_get_segment_info(e, h, &info), 0);
    CHECK_EQ(info.num_buffers, 1);
    uint64_t base = info.num_buffers == 1 ? info.buffers[0].base : 0;
    CHECK(info.num_buffers == 1 && info.buffers[0].length == PEER_LEN);
    tent_free_segment_info(&info);

    const size_t part = 4u << 20;
    char *src = malloc(8 * part), *back = malloc(8 * part);
    for (size_t i = 0; i < 8 * part; ++i) src[i] = (char)(i * 7 + (i >> 13));
    memset(back, 0, 8 * part);
    CHECK_EQ(tent_register_memory(e, src, 8 * part), 0);
    CHECK_EQ(tent_register_memory(e, back, 8 * part), 0);
    tent_request_t reqs[8];
    memset(reqs, 0, sizeof reqs);
    for (int i = 0; i < 8; ++i) {
        reqs[i].opcode = OPCODE_WRITE;
        reqs[i].source = src + i * part;
        reqs[i].target_id = h;
        reqs[i].target_offset = base + (uint64_t)i * 2 * part;
        reqs[i].length = part;
        reqs[i].transport_hint = TRANSPORT_TCP;
    }
    tent_batch_id_t b = tent_allocate_batch(e, 16);
    CHECK_EQ(tent_submit(e, b, reqs, 8), 0);
    int failed = 0;
    CHECK_EQ(wait_all(e, b, 8, 60, &failed), 0);
    CHECK_EQ(failed, 0);
    for (int i = 0; i < 8; ++i) {
        reqs[i].opcode = OPCODE_READ;
        reqs[i].source = back + i * part;
    }
    CHECK_EQ(tent_submit(e, b, reqs, 8), 0);
    CHECK_EQ(wait_all(e, b, 16, 60, &failed), 0);
    CHECK_EQ(failed, 0);
    tent_status_t st;
    CHECK_EQ(tent_overall_status(e, b, &st), 0);
    CHECK_EQ(st.status, STATUS_COMPLETED);
    CHECK_EQ(st.transferred_bytes, 16 * part);
    CHECK(memcmp(src, back, 8 * part) == 0);
    CHECK_EQ(tent_free_batch(e, b), 0);

    /* A notification reaches the other process. */
    CHECK_EQ(tent_send_notifs(e, h, "from-parent", "hi"), 0);
    char cmd = 'n';
    CHECK(write(down[1], &cmd, 1) == 1);
    CHECK(read(up[0], &cmd, 1) == 1);
    CHECK_EQ(cmd, 'y');

    /* Kill the peer while a large batch is in flight: every task ends within the bound. */
    tent_request_t many[64];
    memset(many, 0, sizeof many);
    for (int i = 0; i < 64; ++i) {
        many[i].opcode = i % 2 ? OPCODE_READ : OPCODE_WRITE;
        many[i].source = (i % 2 ? back : src) + (size_t)(i / 2) % 8 * part;
        many[i].target_id = h;
        many[i].target_offset = base + (uint64_t)(i % 16) * part;
        many[i].length = part;
    }
    b = tent_allocate_batch(e, 64);
    CHECK_EQ(tent_submit(e, b, many, 64), 0);
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    double t0 = now();
    CHECK_EQ(wait_all(e, b, 64, 60, &failed), 0);
    printf("peer killed: %d of 64 tasks FAILED, all ended after %.2f s\n", failed, now() - t0);
    CHECK_EQ(tent_overall_status(e, b, &st), 0);
    CHECK(st.status == STATUS_COMPLETED || st.status == STATUS_FAILED);
    CHECK_EQ(tent_free_batch(e, b), 0);
    /* The dead peer: a fresh descriptor fetch fails cleanly. */
    CHECK_EQ(tent_close_segment(e, h), 0);
    CHECK_EQ(tent_open_segment(e, &h, name), 0);
    CHECK_EQ(tent_get_segment_info(e, h, &info), -1);

    CHECK_EQ(tent_unregister_memory(e, src, 0), 0);
    CHECK_EQ(tent_unregister_memory(e, back, 0), 0);
    tent_destroy_engine(e);
    free(src);
    free(back);
    return check_report("tcp_two_process");
}
