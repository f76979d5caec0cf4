/* File segments from C: tent_open_segment("file://...") and the classic openSegment, WRITE and
 * READ through the file with every byte checked, segment info of TYPE_FILE, and the bad inputs
 * (READ past the end, a missing file, a directory, a closed handle) ending FAILED. */
#define _DEFAULT_SOURCE /* usleep, mkdtemp */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tent/transfer_engine.h"
#include "transfer_engine_c.h"
#include "check.h"

#define MIB (1024u * 1024u)

static int wait_tent(tent_engine_t e, tent_batch_id_t b, size_t n) {
    tent_status_t st;
    for (long i = 0; i < 100000000L; ++i) {
        if (tent_overall_status(e, b, &st) != 0) return -1;
        if (st.status != STATUS_PENDING && st.status != STATUS_WAITING) break;
        if (i % 64 == 63) usleep(50);
    }
    for (size_t t = 0; t < n; ++t) {
        if (tent_task_status(e, b, t, &st) != 0 || st.status != STATUS_COMPLETED) return st.status;
    }
    return STATUS_COMPLETED;
}

/* Runs one request and returns its status. */
static int one_tent(tent_engine_t e, int op, void *src, tent_segment_id_t h, uint64_t off, uint64_t len) {
    tent_request_t r;
    memset(&r, 0, sizeof r);
    r.opcode = op;
    r.source = src;
    r.target_id = h;
    r.target_offset = off;
    r.length = len;
    tent_batch_id_t b = tent_allocate_batch(e, 1);
    if (b == 0 || tent_submit(e, b, &r, 1) != 0) return -1;
    int st = wait_tent(e, b, 1);
    tent_free_batch(e, b);
    return st;
}

/* Moves `len` bytes between `mem` and the file in `req` sized requests, one batch. */
static int batch_tent(tent_engine_t e, int op, unsigned char *mem, tent_segment_id_t h, size_t len, size_t req) {
    size_t n = len / req;
    tent_request_t *rs = calloc(n, sizeof *rs);
    if (!rs) return -1;
    for (size_t i = 0; i < n; ++i) {
        rs[i].opcode = op;
        rs[i].source = mem + i * req;
        rs[i].target_id = h;
        rs[i].target_offset = i * req;
        rs[i].length = req;
    }
    tent_batch_id_t b = tent_allocate_batch(e, n);
    int st = -1;
    if (b != 0 && tent_submit(e, b, rs, n) == 0) st = wait_tent(e, b, n);
    tent_free_batch(e, b);
    free(rs);
    return st;
}

/* Creates an empty file `base` in `dir`; fills its path and its file:// segment name. */
static void empty_file(const char *dir, const char *base, char *path, size_t path_len, char *name, size_t name_len) {
    snprintf(path, path_len, "%s/%s", dir, base);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f) fclose(f);
    snprintf(name, name_len, "file://%s", path);
}

static void tent_api(const char *dir) {
    tent_set_config("rpc_server_hostname", "127.0.0.1");
    tent_set_config("log_level", "error");
    tent_set_config("merge_requests", "false");
    tent_engine_t e = tent_create_engine();
    CHECK(e != NULL && tent_available(e) == 1);

    char path[512], name[600];
    empty_file(dir, "kv.bin", path, sizeof path, name, sizeof name);

    const size_t len = 16 * MIB;
    void *src = NULL, *dst = NULL;
    CHECK_EQ(tent_allocate_memory(e, &src, len + 1, "*"), 0);
    CHECK_EQ(tent_allocate_memory(e, &dst, len + 1, "*"), 0);
    CHECK_EQ(tent_register_memory(e, src, len + 1), 0);
    CHECK_EQ(tent_register_memory(e, dst, len + 1), 0);
    unsigned char *s = src, *d = dst;
    for (size_t i = 0; i < len + 1; ++i) s[i] = (unsigned char)(i * 2654435761u >> 13);

    tent_segment_id_t h = 0;
    CHECK_EQ(tent_open_segment(e, &h, name), 0);
    CHECK(h != LOCAL_SEGMENT_ID);

    /* 1 MiB requests out, 64 KiB requests back, every byte compared. */
    CHECK_EQ(batch_tent(e, OPCODE_WRITE, s, h, len, MIB), STATUS_COMPLETED);
    memset(d, 0, len + 1);
    CHECK_EQ(batch_tent(e, OPCODE_READ, d, h, len, 64 * 1024), STATUS_COMPLETED);
    CHECK(memcmp(s, d, len) == 0);
    /* Unaligned memory and offset. */
    CHECK_EQ(one_tent(e, OPCODE_WRITE, s + 1, h, 12345, MIB + 77), STATUS_COMPLETED);
    memset(d, 0, len + 1);
    CHECK_EQ(one_tent(e, OPCODE_READ, d + 1, h, 12345, MIB + 77), STATUS_COMPLETED);
    CHECK(memcmp(s + 1, d + 1, MIB + 77) == 0);

    tent_segment_info_t info;
    CHECK_EQ(tent_get_segment_info(e, h, &info), 0);
    CHECK_EQ(info.type, TYPE_FILE);
    CHECK_EQ(info.num_buffers, 1);
    if (info.num_buffers == 1) {
        CHECK_EQ(info.buffers[0].base, 0);
        CHECK_EQ(info.buffers[0].length, len);
        CHECK(strcmp(info.buffers[0].location, "*") == 0);
    }
    tent_free_segment_info(&info);
    struct stat sb;
    CHECK(stat(path, &sb) == 0 && (size_t)sb.st_size == len);

    /* Past the end: READ fails, WRITE extends the file. */
    CHECK_EQ(one_tent(e, OPCODE_READ, d, h, len - 10, 4096), STATUS_FAILED);
    CHECK_EQ(one_tent(e, OPCODE_WRITE, s, h, len, 4096), STATUS_COMPLETED);
    CHECK(stat(path, &sb) == 0 && (size_t)sb.st_size == len + 4096);

    /* A missing file and a directory: the handle opens, info and transfers fail. */
    tent_segment_id_t missing = 0, directory = 0;
    char bad[600];
    snprintf(bad, sizeof bad, "file://%s/absent", dir);
    CHECK_EQ(tent_open_segment(e, &missing, bad), 0);
    CHECK_EQ(tent_get_segment_info(e, missing, &info), -1);
    CHECK_EQ(one_tent(e, OPCODE_READ, d, missing, 0, 4096), STATUS_FAILED);
    snprintf(bad, sizeof bad, "file://%s", dir);
    CHECK_EQ(tent_open_segment(e, &directory, bad), 0);
    CHECK_EQ(one_tent(e, OPCODE_WRITE, s, directory, 0, 4096), STATUS_FAILED);

    /* Closed: transfers to the handle fail; closing again fails. */
    CHECK_EQ(tent_close_segment(e, h), 0);
    CHECK_EQ(one_tent(e, OPCODE_READ, d, h, 0, 4096), STATUS_FAILED);
    CHECK_EQ(tent_close_segment(e, h), -1);

    CHECK_EQ(tent_unregister_memory(e, src, len + 1), 0);
    CHECK_EQ(tent_unregister_memory(e, dst, len + 1), 0);
    CHECK_EQ(tent_free_memory(e, src), 0);
    CHECK_EQ(tent_free_memory(e, dst), 0);
    tent_destroy_engine(e);
    unlink(path);
}

static int one_classic(transfer_engine_t e, int op, void *src, segment_id_t h, uint64_t off, uint64_t len) {
    struct transfer_request r;
    memset(&r, 0, sizeof r);
    r.opcode = op;
    r.source = src;
    r.target_id = h;
    r.target_offset = off;
    r.length = len;
    batch_id_t b = allocateBatchID(e, 1);
    if (b == INVALID_BATCH || submitTransfer(e, b, &r, 1) != 0) return -1;
    struct transfer_status st;
    memset(&st, 0, sizeof st);
    for (long i = 0; i < 100000000L; ++i) {
        if (getTransferStatus(e, b, 0, &st) != 0) return -1;
        if (st.status != STATUS_PENDING && st.status != STATUS_WAITING) break;
        if (i % 64 == 63) usleep(50);
    }
    freeBatchID(e, b);
    return st.status;
}

static void classic_api(const char *dir) {
    transfer_engine_t e = createTransferEngine("P2PHANDSHAKE", "127.0.0.1:0", "127.0.0.1", 0, 0);
    CHECK(e != NULL);
    if (!e) return;
    char path[512], name[600];
    empty_file(dir, "classic.bin", path, sizeof path, name, sizeof name);

    const size_t len = 4 * MIB;
    unsigned char *src = aligned_alloc(4096, len), *dst = aligned_alloc(4096, len);
    CHECK(src != NULL && dst != NULL);
    if (!src || !dst) return;
    for (size_t i = 0; i < len; ++i) src[i] = (unsigned char)(i * 31 + 1);
    memset(dst, 0, len);
    CHECK_EQ(registerLocalMemory(e, src, len, "cpu:0", 1), 0);
    CHECK_EQ(registerLocalMemory(e, dst, len, "cpu:0", 1), 0);

    segment_id_t h = openSegment(e, name);
    CHECK(h > 0);
    CHECK_EQ(one_classic(e, OPCODE_WRITE, src, h, 0, len), STATUS_COMPLETED);
    CHECK_EQ(one_classic(e, OPCODE_READ, dst, h, 0, len), STATUS_COMPLETED);
    CHECK(memcmp(src, dst, len) == 0);
    CHECK_EQ(one_classic(e, OPCODE_READ, dst, h, len, 1), STATUS_FAILED);
    CHECK_EQ(closeSegment(e, h), 0);

    char bad[600];
    snprintf(bad, sizeof bad, "file://%s/absent", dir);
    CHECK_EQ(openSegment(e, bad), -1); /* ERR_INVALID_ARGUMENT */

    CHECK_EQ(unregisterLocalMemory(e, src), 0);
    CHECK_EQ(unregisterLocalMemory(e, dst), 0);
    destroyTransferEngine(e);
    free(src);
    free(dst);
    unlink(path);
}

int main(void) {
    char dir[] = "/tmp/tent-c-file-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    tent_api(dir);
    classic_api(dir);
    rmdir(dir);
    return check_report("file_segment");
}
