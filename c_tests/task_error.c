/* Why a task failed, through both C APIs: tent_task_error and tent_classic_transfer_error.
 * Two engines in one process over TCP; a batch holds a WRITE that completes, a WRITE past the
 * peer's registered buffers and a local WRITE to unregistered memory; then the peer goes away.
 * Checks the reason of each (sized like snprintf, truncated, NUL-terminated, NULL with length 0),
 * nothing for the completed task, and -1 / ERR_INVALID_ARGUMENT with a tent_last_error for bad
 * handles, freed batches and task ids past the batch. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tent/transfer_engine.h"
#include "transfer_engine_c.h"
#include "check.h"

#define ERR_INVALID_ARGUMENT (-1)
#define LEN 4096

/* One function over both APIs, so every check below runs against each. */
typedef int (*reason_fn)(void *engine, uint64_t batch, size_t task, char *buf, size_t len);
typedef int (*status_fn)(void *engine, uint64_t batch, size_t task, int *status);

static int tent_reason(void *e, uint64_t b, size_t t, char *buf, size_t len) {
    return tent_task_error(e, b, t, buf, len);
}
static int classic_reason(void *e, uint64_t b, size_t t, char *buf, size_t len) {
    return tent_classic_transfer_error(e, b, t, buf, len);
}
static int tent_state(void *e, uint64_t b, size_t t, int *status) {
    tent_status_t st;
    int rc = tent_task_status(e, b, t, &st);
    *status = st.status;
    return rc;
}
static int classic_state(void *e, uint64_t b, size_t t, int *status) {
    struct transfer_status st;
    int rc = getTransferStatus(e, b, t, &st);
    *status = st.status;
    return rc;
}

/* Polls a task to its end; its final status, or -1 when polling failed or never ended. */
static int wait_task(status_fn state, void *e, uint64_t b, size_t t) {
    for (long i = 0; i < 50000000L; ++i) {
        int s = STATUS_PENDING;
        if (state(e, b, t, &s) != 0) return -1;
        if (s != STATUS_WAITING && s != STATUS_PENDING) return s;
    }
    return -1;
}

static int last_error_is_set(void) {
    char buf[256];
    return tent_last_error(buf, sizeof buf) > 0 && buf[0] != '\0';
}

/* The checks on a batch whose task 0 completed and tasks 1 and 2 failed. `bad_rc` is what the
 * API returns for a bad argument. */
static void check_reasons(const char *api, reason_fn reason, void *e, uint64_t b, int bad_rc) {
    char buf[1024];
    printf("%s:\n", api);

    /* The completed task has no reason: 0, an empty string, no error. */
    memset(buf, 'x', sizeof buf);
    CHECK_EQ(reason(e, b, 0, buf, sizeof buf), 0);
    CHECK_EQ(buf[0], '\0');
    CHECK(!last_error_is_set());
    CHECK_EQ(reason(e, b, 0, NULL, 0), 0);

    for (size_t task = 1; task <= 2; ++task) {
        /* Sized first with no buffer, then read whole. */
        int n = reason(e, b, task, NULL, 0);
        CHECK(n > 0);
        CHECK(!last_error_is_set());
        memset(buf, 'x', sizeof buf);
        CHECK_EQ(reason(e, b, task, buf, sizeof buf), n);
        CHECK(n < (int)sizeof buf);
        CHECK_EQ(strlen(buf), n);
        printf("  task %zu FAILED: %s\n", task, buf);

        /* Truncated to len - 1 bytes, NUL-terminated, the full length still returned. */
        char small[9];
        memset(small, 'x', sizeof small);
        CHECK_EQ(reason(e, b, task, small, 8), n);
        CHECK_EQ(strlen(small), n < 7 ? n : 7);
        CHECK(strncmp(small, buf, 7) == 0);
        CHECK_EQ(small[8], 'x'); /* nothing written past len */
        char one = 'x';
        CHECK_EQ(reason(e, b, task, &one, 1), n);
        CHECK_EQ(one, '\0');
    }

    /* Bad arguments: the API's error value, the reason in tent_last_error. */
    CHECK_EQ(reason(NULL, b, 1, buf, sizeof buf), bad_rc);
    CHECK(last_error_is_set());
    CHECK_EQ(reason((void *)(uintptr_t)0x1234, b, 1, buf, sizeof buf), bad_rc);
    CHECK(last_error_is_set());
    CHECK_EQ(reason(e, b, 3, buf, sizeof buf), bad_rc); /* the batch has 3 tasks */
    char why[256];
    CHECK(tent_last_error(why, sizeof why) > 0 && strstr(why, "out of range") != NULL);
    CHECK_EQ(reason(e, b, SIZE_MAX, NULL, 0), bad_rc);
    CHECK_EQ(reason(e, b + 1, 0, buf, sizeof buf), bad_rc); /* not a live batch */
    CHECK_EQ(reason(e, 0, 0, buf, sizeof buf), bad_rc);
}

/* The batch's three WRITEs of 64 bytes into `reqs` (tent_request_t or struct transfer_request,
 * which name these fields alike): into `target` of segment `peer` (completes), past the peer's
 * registered buffer, and to unregistered memory of this engine's own segment `self`. */
#define FILL_WRITES(reqs, src, peer, self, target, unregistered)                \
    do {                                                                        \
        memset(reqs, 0, sizeof reqs);                                           \
        for (int i_ = 0; i_ < 3; ++i_) {                                        \
            reqs[i_].opcode = OPCODE_WRITE;                                     \
            reqs[i_].source = src;                                              \
            reqs[i_].target_id = i_ == 2 ? self : peer;                         \
            reqs[i_].length = 64;                                               \
        }                                                                       \
        reqs[0].target_offset = (uint64_t)(uintptr_t)(target);                  \
        reqs[1].target_offset = (uint64_t)(uintptr_t)(target) + (1u << 20);     \
        reqs[2].target_offset = (uint64_t)(uintptr_t)(unregistered);            \
    } while (0)

static void with_the_tent_api(void) {
    tent_set_config("rpc_server_hostname", "127.0.0.1");
    tent_set_config("log_level", "error");
    tent_engine_t a = tent_create_engine(), b = tent_create_engine();
    CHECK(a != NULL && b != NULL && tent_available(a) == 1 && tent_available(b) == 1);
    static unsigned char src[LEN], target[LEN], unregistered[LEN];
    memset(src, 0x3c, sizeof src);
    CHECK_EQ(tent_register_memory(a, src, LEN), 0);
    CHECK_EQ(tent_register_memory(b, target, LEN), 0);
    char name[128];
    CHECK_EQ(tent_segment_name(b, name, sizeof name), 0);
    tent_segment_id_t peer = 0;
    CHECK_EQ(tent_open_segment(a, &peer, name), 0);

    tent_request_t reqs[3];
    FILL_WRITES(reqs, src, peer, LOCAL_SEGMENT_ID, target, unregistered);
    tent_batch_id_t batch = tent_allocate_batch(a, 3);
    CHECK_EQ(tent_submit(a, batch, reqs, 3), 0);
    CHECK_EQ(wait_task(tent_state, a, batch, 0), STATUS_COMPLETED);
    CHECK_EQ(wait_task(tent_state, a, batch, 1), STATUS_FAILED);
    CHECK_EQ(wait_task(tent_state, a, batch, 2), STATUS_FAILED);
    CHECK_EQ(target[0], 0x3c);
    check_reasons("tent_task_error", tent_reason, a, batch, -1);

    /* A freed batch is gone. */
    CHECK_EQ(tent_free_batch(a, batch), 0);
    CHECK_EQ(tent_task_error(a, batch, 1, NULL, 0), -1);
    CHECK(last_error_is_set());

    /* The peer goes away: the WRITE that completed before now fails, with the transport's
     * reason. */
    tent_destroy_engine(b);
    batch = tent_allocate_batch(a, 1);
    CHECK_EQ(tent_submit(a, batch, reqs, 1), 0);
    CHECK_EQ(wait_task(tent_state, a, batch, 0), STATUS_FAILED);
    char why[1024];
    int n = tent_task_error(a, batch, 0, why, sizeof why);
    CHECK(n > 0 && n < (int)sizeof why && strlen(why) == (size_t)n);
    printf("  peer gone, FAILED: %s\n", why);
    CHECK_EQ(tent_free_batch(a, batch), 0);

    /* A destroyed engine answers -1. */
    tent_destroy_engine(a);
    CHECK_EQ(tent_task_error(a, batch, 0, NULL, 0), -1);
}

static void with_the_classic_api(void) {
    transfer_engine_t a = createTransferEngine("P2PHANDSHAKE", "127.0.0.1:0", "127.0.0.1", 0, 0);
    transfer_engine_t b = createTransferEngine("P2PHANDSHAKE", "127.0.0.1:0", "127.0.0.1", 0, 0);
    CHECK(a != NULL && b != NULL);
    /* `unregistered` is a target in this engine's own segment (a source need not be registered
     * in the classic API, a target must). */
    static unsigned char src[LEN], target[LEN], unregistered[LEN];
    memset(src, 0x5a, sizeof src);
    CHECK_EQ(registerLocalMemory(a, src, LEN, "cpu:0", 1), 0);
    CHECK_EQ(registerLocalMemory(b, target, LEN, "cpu:0", 1), 0);
    char name[128];
    CHECK_EQ(getLocalIpAndPort(b, name, sizeof name), 0);
    segment_id_t peer = openSegment(a, name);
    CHECK(peer > 0);

    struct transfer_request reqs[3];
    FILL_WRITES(reqs, src, peer, LOCAL_SEGMENT, target, unregistered);
    batch_id_t batch = allocateBatchID(a, 3);
    CHECK(batch != INVALID_BATCH);
    CHECK_EQ(submitTransfer(a, batch, reqs, 3), 0);
    CHECK_EQ(wait_task(classic_state, a, batch, 0), STATUS_COMPLETED);
    CHECK_EQ(wait_task(classic_state, a, batch, 1), STATUS_FAILED);
    CHECK_EQ(wait_task(classic_state, a, batch, 2), STATUS_FAILED);
    CHECK_EQ(target[0], 0x5a);
    check_reasons("tent_classic_transfer_error", classic_reason, a, batch, ERR_INVALID_ARGUMENT);

    CHECK_EQ(freeBatchID(a, batch), 0);
    CHECK_EQ(tent_classic_transfer_error(a, batch, 1, NULL, 0), ERR_INVALID_ARGUMENT);
    destroyTransferEngine(a);
    destroyTransferEngine(b);
}

int main(void) {
    with_the_tent_api();
    with_the_classic_api();
    return check_report("task_error");
}
