/* SHM between two processes through the C API: the peer allocates with
 * tent_allocate_memory_ex(TRANSPORT_SHM), gets the object name back in opts.shm_path, registers
 * with the same options; this process writes and reads over SHM (hinted), verifies every byte,
 * and checks that the object is gone from /dev/shm after the peer shut down cleanly. */
#define _DEFAULT_SOURCE
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tent/transfer_engine.h"
#include "check.h"

#define LEN (8u << 20)

struct hello {
    char name[128];
    char shm_path[256];
    uint64_t base;
};

static void peer(int up, int down) {
    tent_set_config("rpc_server_hostname", "127.0.0.1");
    tent_set_config("transports/shm/enable", "true");
    tent_engine_t e = tent_create_engine();
    tent_memory_options_t opts;
    memset(&opts, 0, sizeof opts);
    strcpy(opts.location, "cpu:0");
    opts.transport_type = TRANSPORT_SHM;
    opts.permission = PERM_GLOBAL_READ_WRITE;
    void *p = NULL;
    if (!tent_available(e) || tent_allocate_memory_ex(e, &p, LEN, &opts) != 0) _exit(2);
    opts.transport_type = TRANSPORT_UNSPEC; /* every loaded transport: SHM and TCP */
    if (tent_register_memory_ex(e, p, LEN, &opts) != 0) _exit(3);
    memset(p, 0, LEN);
    struct hello h;
    memset(&h, 0, sizeof h);
    tent_segment_name(e, h.name, sizeof h.name);
    memcpy(h.shm_path, opts.shm_path, sizeof h.shm_path);
    h.base = (uint64_t)(uintptr_t)p;
    if (write(up, &h, sizeof h) != (ssize_t)sizeof h) _exit(4);
    char cmd;
    if (read(down, &cmd, 1) != 1) _exit(5);
    /* Check what the other process wrote, then shut down cleanly. */
    int ok = 1;
    for (size_t i = 0; i < LEN; ++i)
        if (((unsigned char *)p)[i] != (unsigned char)(i * 13 + 5)) ok = 0;
    tent_unregister_memory(e, p, 0);
    tent_free_memory(e, p);
    tent_destroy_engine(e);
    _exit(ok ? 0 : 6);
}

int main(void) {
    int up[2], down[2];
    CHECK(pipe(up) == 0 && pipe(down) == 0);
    pid_t child = fork();
    if (child == 0) peer(up[1], down[0]);
    struct hello h;
    CHECK(read(up[0], &h, sizeof h) == (ssize_t)sizeof h);
    CHECK(strncmp(h.shm_path, "mooncake_", 9) == 0); /* the name came back through opts */
    char path[512];
    snprintf(path, sizeof path, "/dev/shm/%s", h.shm_path);
    struct stat st;
    CHECK(stat(path, &st) == 0 && st.st_size == LEN);

    tent_set_config("rpc_server_hostname", "127.0.0.1");
    tent_set_config("transports/shm/enable", "true");
    tent_engine_t e = tent_create_engine();
    CHECK_EQ(tent_available(e), 1);
    tent_segment_id_t seg;
    CHECK_EQ(tent_open_segment(e, &seg, h.name), 0);
    unsigned char *src = malloc(LEN), *back = malloc(LEN);
    for (size_t i = 0; i < LEN; ++i) src[i] = (unsigned char)(i * 13 + 5);
    memset(back, 0, LEN);
    CHECK_EQ(tent_register_memory(e, src, LEN), 0);
    CHECK_EQ(tent_register_memory(e, back, LEN), 0);
    tent_request_t r[2];
    memset(r, 0, sizeof r);
    r[0].opcode = OPCODE_WRITE;
    r[0].source = src;
    r[0].target_id = seg;
    r[0].target_offset = h.base;
    r[0].length = LEN;
    r[0].transport_hint = TRANSPORT_SHM;
    tent_batch_id_t b = tent_allocate_batch(e, 2);
    CHECK_EQ(tent_submit(e, b, r, 1), 0);
    tent_status_t s;
    do {
        CHECK_EQ(tent_task_status(e, b, 0, &s), 0);
    } while (s.status == STATUS_PENDING);
    CHECK_EQ(s.status, STATUS_COMPLETED);
    CHECK_EQ(s.transferred_bytes, LEN);
    r[1] = r[0];
    r[1].opcode = OPCODE_READ;
    r[1].source = back;
    r[1].target_offset = h.base + 4093; /* unaligned */
    r[1].length = LEN - 4093;
    CHECK_EQ(tent_submit(e, b, r + 1, 1), 0);
    do {
        CHECK_EQ(tent_task_status(e, b, 1, &s), 0);
    } while (s.status == STATUS_PENDING);
    CHECK_EQ(s.status, STATUS_COMPLETED);
    CHECK(memcmp(back, src + 4093, LEN - 4093) == 0);
    CHECK_EQ(tent_free_batch(e, b), 0);

    char cmd = 'x';
    CHECK(write(down[1], &cmd, 1) == 1);
    int status = 0;
    waitpid(child, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(stat(path, &st) != 0); /* the peer removed its object on free */
    tent_destroy_engine(e);
    free(src);
    free(back);
    return check_report("shm_two_process");
}
