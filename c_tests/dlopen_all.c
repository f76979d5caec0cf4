/* Loads the library with dlopen under the name given in argv[1] (libtent.so, libtent_shared.so or
 * libtransfer_engine.so), resolves every function named in argv[2] (one per line: every function
 * the TENT and classic headers declare), and moves bytes between two engines through the resolved
 * pointers with each API. The program is not linked against the library. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tent/transfer_engine.h"
#include "transfer_engine_c.h"
#include "check.h"

static void *lib;

/* Resolves `name` with the exact type of the header's declaration. */
#define RESOLVE(name) ((__typeof__(&name))resolve(#name))
static void *resolve(const char *name) {
    void *p = dlsym(lib, name);
    if (!p) fprintf(stderr, "dlsym(%s): %s\n", name, dlerror());
    return p;
}

static int resolve_all(const char *list_path) {
    FILE *f = fopen(list_path, "r");
    CHECK(f != NULL);
    if (!f) return 0;
    char line[256];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        if (!line[0]) continue;
        CHECK(resolve(line) != NULL);
        ++n;
    }
    fclose(f);
    return n;
}

static void classic_transfer(void) {
    __typeof__(&createTransferEngine) create = RESOLVE(createTransferEngine);
    __typeof__(&destroyTransferEngine) destroy = RESOLVE(destroyTransferEngine);
    __typeof__(&installTransport) install = RESOLVE(installTransport);
    __typeof__(&getLocalIpAndPort) ip_port = RESOLVE(getLocalIpAndPort);
    __typeof__(&registerLocalMemory) reg = RESOLVE(registerLocalMemory);
    __typeof__(&unregisterLocalMemory) unreg = RESOLVE(unregisterLocalMemory);
    __typeof__(&openSegment) open_seg = RESOLVE(openSegment);
    __typeof__(&allocateBatchID) alloc = RESOLVE(allocateBatchID);
    __typeof__(&submitTransfer) submit = RESOLVE(submitTransfer);
    __typeof__(&getTransferStatus) status = RESOLVE(getTransferStatus);
    __typeof__(&freeBatchID) free_batch = RESOLVE(freeBatchID);
    if (!create || !destroy || !install || !ip_port || !reg || !unreg || !open_seg || !alloc ||
        !submit || !status || !free_batch)
        return;

    transfer_engine_t a = create("P2PHANDSHAKE", "127.0.0.1:0", "127.0.0.1", 0, 0);
    transfer_engine_t b = create("P2PHANDSHAKE", "127.0.0.1:0", "127.0.0.1", 0, 0);
    CHECK(a && b);
    if (!a || !b) return;
    void *args[1] = {NULL};
    CHECK(install(a, "tcp", args) != NULL);
    const size_t len = 1u << 20;
    unsigned char *src = malloc(len), *dst = calloc(1, len);
    for (size_t i = 0; i < len; ++i) src[i] = (unsigned char)(i * 31 + 5);
    CHECK_EQ(reg(a, src, len, "cpu:0", 1), 0);
    CHECK_EQ(reg(b, dst, len, "cpu:0", 1), 0);
    char name[256];
    CHECK_EQ(ip_port(b, name, sizeof name), 0);
    segment_id_t seg = open_seg(a, name);
    CHECK(seg > 0);
    batch_id_t batch = alloc(a, 1);
    CHECK(batch != INVALID_BATCH);
    struct transfer_request r;
    memset(&r, 0, sizeof r);
    r.opcode = OPCODE_WRITE;
    r.source = src;
    r.target_id = seg;
    r.target_offset = (uint64_t)(uintptr_t)dst;
    r.length = len;
    CHECK_EQ(submit(a, batch, &r, 1), 0);
    struct transfer_status st;
    memset(&st, 0, sizeof st);
    do {
        if (status(a, batch, 0, &st) != 0) break;
    } while (st.status == STATUS_WAITING || st.status == STATUS_PENDING);
    CHECK_EQ(st.status, STATUS_COMPLETED);
    CHECK(memcmp(src, dst, len) == 0);
    CHECK_EQ(free_batch(a, batch), 0);
    CHECK_EQ(unreg(a, src), 0);
    CHECK_EQ(unreg(b, dst), 0);
    destroy(a);
    destroy(b);
    free(src);
    free(dst);
}

static void tent_transfer(void) {
    __typeof__(&tent_set_config) set = RESOLVE(tent_set_config);
    __typeof__(&tent_create_engine) create = RESOLVE(tent_create_engine);
    __typeof__(&tent_destroy_engine) destroy = RESOLVE(tent_destroy_engine);
    __typeof__(&tent_available) available = RESOLVE(tent_available);
    __typeof__(&tent_segment_name) seg_name = RESOLVE(tent_segment_name);
    __typeof__(&tent_open_segment) open_seg = RESOLVE(tent_open_segment);
    __typeof__(&tent_register_memory) reg = RESOLVE(tent_register_memory);
    __typeof__(&tent_unregister_memory) unreg = RESOLVE(tent_unregister_memory);
    __typeof__(&tent_allocate_batch) alloc = RESOLVE(tent_allocate_batch);
    __typeof__(&tent_submit) submit = RESOLVE(tent_submit);
    __typeof__(&tent_task_status) status = RESOLVE(tent_task_status);
    __typeof__(&tent_free_batch) free_batch = RESOLVE(tent_free_batch);
    if (!set || !create || !destroy || !available || !seg_name || !open_seg || !reg || !unreg ||
        !alloc || !submit || !status || !free_batch)
        return;

    set("rpc_server_hostname", "127.0.0.1");
    tent_engine_t a = create(), b = create();
    CHECK(available(a) == 1 && available(b) == 1);
    const size_t len = 1u << 20;
    unsigned char *src = calloc(1, len), *dst = malloc(len);
    for (size_t i = 0; i < len; ++i) dst[i] = (unsigned char)(i * 17 + 9);
    CHECK_EQ(reg(a, src, len), 0);
    CHECK_EQ(reg(b, dst, len), 0);
    char name[256];
    CHECK_EQ(seg_name(b, name, sizeof name), 0);
    tent_segment_id_t seg = 0;
    CHECK_EQ(open_seg(a, &seg, name), 0);
    tent_batch_id_t batch = alloc(a, 1);
    tent_request_t r;
    memset(&r, 0, sizeof r);
    r.opcode = OPCODE_READ;
    r.source = src;
    r.target_id = seg;
    r.target_offset = (uint64_t)(uintptr_t)dst;
    r.length = len;
    CHECK_EQ(submit(a, batch, &r, 1), 0);
    tent_status_t st;
    memset(&st, 0, sizeof st);
    do {
        if (status(a, batch, 0, &st) != 0) break;
    } while (st.status == STATUS_WAITING || st.status == STATUS_PENDING);
    CHECK_EQ(st.status, STATUS_COMPLETED);
    CHECK(memcmp(src, dst, len) == 0);
    CHECK_EQ(free_batch(a, batch), 0);
    CHECK_EQ(unreg(a, src, len), 0);
    CHECK_EQ(unreg(b, dst, len), 0);
    destroy(a);
    destroy(b);
    free(src);
    free(dst);
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s LIBRARY FUNCTION-LIST EXPECTED-COUNT\n", argv[0]);
        return 2;
    }
    /* Not linked: nothing of the library is visible before dlopen. */
    CHECK(dlsym(RTLD_DEFAULT, "tent_create_engine") == NULL);
    CHECK(dlsym(RTLD_DEFAULT, "createTransferEngine") == NULL);
    lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "dlopen(%s): %s\n", argv[1], dlerror());
        return 1;
    }
    CHECK_EQ(resolve_all(argv[2]), atoi(argv[3]));
    classic_transfer();
    tent_transfer();
    CHECK_EQ(dlclose(lib), 0);
    return check_report("dlopen_all");
}
