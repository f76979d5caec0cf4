/* Cost at scale through the C API, against whichever library implements it.
 *
 *   scale LIBRARY [--n 100,1000,10000,100000] [--batches 300] [--single 1000] [--no-warm]
 *
 * Loads LIBRARY (a path to libtent.so, or to any other library exporting the tent_* functions of
 * include/tent/transfer_engine.h) with dlopen, so one binary measures either. For each N, two
 * engines in this process talk over TCP on 127.0.0.1 (p2p metadata; SHM, RDMA and io_uring off):
 *
 * - the target registers N buffers of 4 KiB. The last min(N, --single) are registered one
 *   tent_register_memory call each and timed (`reg us/buf`); the ones before them go in
 *   tent_register_memory_batch calls of 1,000, not timed. --single 0 times all N one by one.
 * - the initiator opens the target's segment and reads its descriptor (`open ms`: tent_open_segment
 *   and tent_get_segment_info, which must list the N buffers);
 * - unless --no-warm, every target buffer is written once (pages touched, connections up);
 * - then the sizes take turns, batch by batch, sending --batches batches of 32 x 4 KiB WRITEs to
 *   random target buffers, each waited for with tent_overall_status (`batch us`: median, p99).
 *
 * Prints one line per N. Exits non-zero if any call fails or a transfer does not complete. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "tent/transfer_engine.h"

#define BUF 4096u
#define BATCH 32u
#define CHUNK 1000u

static struct {
    __typeof__(&tent_set_config) set_config;
    __typeof__(&tent_create_engine) create_engine;
    __typeof__(&tent_destroy_engine) destroy_engine;
    __typeof__(&tent_available) available;
    __typeof__(&tent_segment_name) segment_name;
    __typeof__(&tent_open_segment) open_segment;
    __typeof__(&tent_get_segment_info) get_segment_info;
    __typeof__(&tent_free_segment_info) free_segment_info;
    __typeof__(&tent_register_memory) register_memory;
    __typeof__(&tent_register_memory_batch) register_memory_batch;
    __typeof__(&tent_allocate_batch) allocate_batch;
    __typeof__(&tent_free_batch) free_batch;
    __typeof__(&tent_submit) submit;
    __typeof__(&tent_overall_status) overall_status;
} api;

static int resolve_all(void *lib) {
    int ok = 1;
#define RESOLVE(field, name)                                          \
    do {                                                              \
        api.field = (__typeof__(api.field))dlsym(lib, #name);         \
        if (!api.field) {                                             \
            fprintf(stderr, "dlsym(%s): %s\n", #name, dlerror());     \
            ok = 0;                                                   \
        }                                                             \
    } while (0)
    RESOLVE(set_config, tent_set_config);
    RESOLVE(create_engine, tent_create_engine);
    RESOLVE(destroy_engine, tent_destroy_engine);
    RESOLVE(available, tent_available);
    RESOLVE(segment_name, tent_segment_name);
    RESOLVE(open_segment, tent_open_segment);
    RESOLVE(get_segment_info, tent_get_segment_info);
    RESOLVE(free_segment_info, tent_free_segment_info);
    RESOLVE(register_memory, tent_register_memory);
    RESOLVE(register_memory_batch, tent_register_memory_batch);
    RESOLVE(allocate_batch, tent_allocate_batch);
    RESOLVE(free_batch, tent_free_batch);
    RESOLVE(submit, tent_submit);
    RESOLVE(overall_status, tent_overall_status);
#undef RESOLVE
    return ok;
}

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static void die(const char *what, size_t n) {
    fprintf(stderr, "scale: %s failed (N = %zu)\n", what, n);
    exit(1);
}

/* A small deterministic generator, so every run picks the same targets. */
static uint64_t next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

struct setup {
    size_t n;
    tent_engine_t target, initiator;
    char *base, *src;
    tent_segment_id_t h;
    uint64_t rng;
    double reg_us, open_ms;
    double *times;
    size_t count;
};

static tent_engine_t engine(void) {
    /* The settings apply to the engines this thread creates next. */
    api.set_config("metadata_type", "p2p");
    api.set_config("rpc_server_hostname", "127.0.0.1");
    api.set_config("log_level", "warning");
    api.set_config("transports/tcp/enable", "true");
    api.set_config("transports/shm/enable", "false");
    api.set_config("transports/rdma/enable", "false");
    api.set_config("transports/io_uring/enable", "false");
    tent_engine_t e = api.create_engine();
    if (!e || !api.available(e)) die("tent_create_engine", 0);
    return e;
}

/* One batch of WRITEs from the source blocks to the target buffers `idx`, waited for. */
static double batch(struct setup *s, const size_t *idx, size_t count) {
    tent_request_t reqs[BATCH];
    memset(reqs, 0, sizeof reqs);
    for (size_t i = 0; i < count; ++i) {
        reqs[i].opcode = OPCODE_WRITE;
        reqs[i].source = s->src + i * BUF;
        reqs[i].target_id = s->h;
        reqs[i].target_offset = (uint64_t)(uintptr_t)(s->base + idx[i] * BUF);
        reqs[i].length = BUF;
        reqs[i].transport_hint = TRANSPORT_TCP;
    }
    double start = now_us();
    tent_batch_id_t b = api.allocate_batch(s->initiator, BATCH);
    if (b == 0 || b == UINT64_MAX || api.submit(s->initiator, b, reqs, count) != 0) die("tent_submit", s->n);
    for (;;) {
        tent_status_t st;
        memset(&st, 0, sizeof st);
        if (api.overall_status(s->initiator, b, &st) != 0) die("tent_overall_status", s->n);
        if (st.status == STATUS_COMPLETED) break;
        if (st.status != STATUS_PENDING && st.status != STATUS_WAITING) die("a transfer", s->n);
        if (now_us() - start > 60e6) die("waiting 60 s for a batch", s->n);
        sched_yield();
    }
    double el = now_us() - start;
    if (api.free_batch(s->initiator, b) != 0) die("tent_free_batch", s->n);
    return el;
}

static void setup(struct setup *s, size_t n, size_t single, int warm, size_t batches) {
    memset(s, 0, sizeof *s);
    s->n = n;
    s->rng = 0x9e3779b97f4a7c15ull ^ n;
    s->times = calloc(batches, sizeof(double));
    s->target = engine();
    s->initiator = engine();

    size_t len = n * BUF;
    s->base = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    s->src = mmap(NULL, BATCH * BUF, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (s->base == MAP_FAILED || s->src == MAP_FAILED || !s->times) die("allocating memory", n);
    /* Touched before registering, so that registering is not charged with first-touch faults. */
    memset(s->base, 0, len);
    memset(s->src, 7, BATCH * BUF);

    if (single == 0 || single > n) single = n;
    void *addrs[CHUNK];
    size_t sizes[CHUNK];
    for (size_t first = 0; first < n - single; first += CHUNK) {
        size_t count = n - single - first < CHUNK ? n - single - first : CHUNK;
        for (size_t i = 0; i < count; ++i) {
            addrs[i] = s->base + (first + i) * BUF;
            sizes[i] = BUF;
        }
        if (api.register_memory_batch(s->target, addrs, sizes, count, PERM_GLOBAL_READ_WRITE) != 0)
            die("tent_register_memory_batch", n);
    }
    double t = now_us();
    for (size_t i = n - single; i < n; ++i)
        if (api.register_memory(s->target, s->base + i * BUF, BUF) != 0) die("tent_register_memory", n);
    s->reg_us = (now_us() - t) / (double)single;

    if (api.register_memory(s->initiator, s->src, BATCH * BUF) != 0) die("registering the source", n);
    char name[256] = {0};
    if (api.segment_name(s->target, name, sizeof name - 1) != 0) die("tent_segment_name", n);
    t = now_us();
    if (api.open_segment(s->initiator, &s->h, name) != 0) die("tent_open_segment", n);
    tent_segment_info_t info;
    memset(&info, 0, sizeof info);
    if (api.get_segment_info(s->initiator, s->h, &info) != 0) die("tent_get_segment_info", n);
    s->open_ms = (now_us() - t) / 1e3;
    int listed = info.num_buffers;
    api.free_segment_info(&info);
    if (listed < 0 || (size_t)listed != n) {
        fprintf(stderr, "scale: the descriptor lists %d buffers, not %zu\n", listed, n);
        exit(1);
    }

    if (warm) {
        size_t idx[BATCH];
        for (size_t first = 0; first < n; first += BATCH) {
            size_t count = n - first < BATCH ? n - first : BATCH;
            for (size_t i = 0; i < count; ++i) idx[i] = first + i;
            batch(s, idx, count);
        }
    }
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s LIBRARY [--n 100,1000] [--batches 300] [--single 1000] [--no-warm]\n",
                argv[0]);
        return 2;
    }
    const char *ns = "100,1000,10000,100000";
    size_t batches = 300, single = 1000;
    int warm = 1;
    for (int i = 2; i < argc; ++i) {
        if (!strcmp(argv[i], "--n") && i + 1 < argc)
            ns = argv[++i];
        else if (!strcmp(argv[i], "--batches") && i + 1 < argc)
            batches = strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--single") && i + 1 < argc)
            single = strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--no-warm"))
            warm = 0;
        else {
            fprintf(stderr, "scale: unknown argument %s\n", argv[i]);
            return 2;
        }
    }
    if (batches == 0) batches = 1;

    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "dlopen(%s): %s\n", argv[1], dlerror());
        return 1;
    }
    if (!resolve_all(lib)) return 1;

    struct setup setups[16];
    size_t count = 0;
    for (const char *p = ns; *p && count < 16;) {
        char *end = NULL;
        size_t n = strtoul(p, &end, 10);
        if (end == p) break;
        if (n > 0) setup(&setups[count++], n, single, warm, batches);
        p = *end == ',' ? end + 1 : end;
    }

    /* The sizes take turns batch by batch, so that a machine whose speed drifts slows each alike. */
    size_t idx[BATCH];
    for (size_t b = 0; b < batches; ++b)
        for (size_t k = 0; k < count; ++k) {
            struct setup *s = &setups[k];
            for (size_t i = 0; i < BATCH; ++i) idx[i] = (size_t)(next(&s->rng) % s->n);
            s->times[s->count++] = batch(s, idx, BATCH);
        }

    printf("library %s: 4 KiB buffers, TCP, %zu batches of %u x 4 KiB WRITE to random buffers\n", argv[1],
           batches, BATCH);
    printf("%8s %11s %9s %11s %9s\n", "N", "reg us/buf", "open ms", "batch us", "p99 us");
    for (size_t k = 0; k < count; ++k) {
        struct setup *s = &setups[k];
        qsort(s->times, s->count, sizeof(double), cmp);
        size_t p99 = s->count * 99 / 100;
        if (p99 >= s->count) p99 = s->count - 1;
        printf("%8zu %11.1f %9.1f %11.1f %9.1f\n", s->n, s->reg_us, s->open_ms, s->times[s->count / 2],
               s->times[p99]);
    }
    fflush(stdout);
    for (size_t k = 0; k < count; ++k) {
        api.destroy_engine(setups[k].initiator);
        api.destroy_engine(setups[k].target);
    }
    return 0;
}
