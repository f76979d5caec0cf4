/* Every NULL, garbage-handle, freed-batch, out-of-range and unregistered-memory case returns the
 * documented value and the process survives. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tent/transfer_engine.h"
#include "check.h"

static char buf[1 << 16];

static void all_calls_fail(tent_engine_t e, const char *what) {
    char name[64];
    uint16_t port;
    tent_segment_id_t h;
    tent_segment_info_t info;
    void *p = NULL;
    tent_status_t st;
    tent_request_t r;
    tent_notifi_info ni;
    size_t n = 4;
    tent_status_t list[4];
    tent_nic_load_stat_t ns[2];
    tent_memory_options_t opts;
    void *addrs[1] = {buf};
    size_t sizes[1] = {64};
    memset(&r, 0, sizeof r);
    memset(&opts, 0, sizeof opts);
    r.source = buf;
    r.target_offset = (uint64_t)(uintptr_t)buf;
    r.length = 8;
    fprintf(stderr, "-- every call on %s engine fails cleanly\n", what);
    CHECK_EQ(tent_available(e), 0);
    CHECK_EQ(tent_segment_name(e, name, sizeof name), -1);
    CHECK_EQ(tent_rpc_server_addr_port(e, name, sizeof name, &port), -1);
    CHECK_EQ(tent_open_segment(e, &h, "x"), -1);
    CHECK_EQ(tent_close_segment(e, 1), -1);
    CHECK_EQ(tent_get_segment_info(e, 0, &info), -1);
    CHECK(info.buffers == NULL);
    CHECK_EQ(tent_allocate_memory(e, &p, 64, "*"), -1);
    CHECK_EQ(tent_free_memory(e, buf), -1);
    CHECK_EQ(tent_register_memory(e, buf, 64), -1);
    CHECK_EQ(tent_unregister_memory(e, buf, 64), -1);
    CHECK(tent_allocate_batch(e, 4) == (e == NULL ? UINT64_MAX : 0));
    CHECK_EQ(tent_free_batch(e, 1), -1);
    CHECK_EQ(tent_submit(e, 1, &r, 1), -1);
    CHECK_EQ(tent_submit_notif(e, 1, &r, 1, "n", "m"), -1);
    CHECK_EQ(tent_submit_with_deadlines(e, 1, &r, 1, NULL, NULL, NULL), -1);
    CHECK_EQ(tent_send_notifs(e, 0, "n", "m"), -1);
    CHECK_EQ(tent_recv_notifs(e, &ni), -1);
    CHECK_EQ(tent_task_status(e, 1, 0, &st), -1);
    CHECK_EQ(tent_cancel_task(e, 1, 0), -1);
    CHECK_EQ(tent_overall_status(e, 1, &st), -1);
    CHECK_EQ(tent_register_memory_with_perm(e, buf, 64, PERM_GLOBAL_READ_WRITE), -1);
    CHECK_EQ(tent_register_memory_batch(e, addrs, sizes, 1, PERM_GLOBAL_READ_WRITE), -1);
    CHECK_EQ(tent_unregister_memory_batch(e, addrs, sizes, 1), -1);
    CHECK_EQ(tent_allocate_memory_ex(e, &p, 64, &opts), -1);
    CHECK_EQ(tent_register_memory_ex(e, buf, 64, &opts), -1);
    CHECK_EQ(tent_register_memory_batch_ex(e, addrs, sizes, 1, &opts), -1);
    CHECK_EQ(tent_task_status_list(e, 1, list, &n), -1);
    n = 2;
    CHECK_EQ(tent_get_nic_load_stats(e, ns, &n), -1);
    tent_destroy_engine(e); /* harmless on NULL / garbage / failed */
}

static int wait_done(tent_engine_t e, tent_batch_id_t b, size_t t, tent_status_t *st) {
    for (int i = 0; i < 100000; ++i) {
        if (tent_task_status(e, b, t, st) != 0) return -1;
        if (st->status != STATUS_PENDING) return 0;
    }
    return -1;
}

int main(void) {
    char err[256];
    all_calls_fail(NULL, "a NULL");
    /* The last call there (destroying NULL) is harmless: a call that succeeds leaves no error. */
    CHECK_EQ(tent_last_error(err, sizeof err), 0);
    CHECK_EQ(tent_free_batch(NULL, 1), -1);
    CHECK(tent_last_error(err, sizeof err) > 0);
    /* tent_allocate_batch keeps upstream's two failure values: (uint64_t)-1 for a NULL engine,
     * 0 for every other failure, each with its reason. */
    CHECK(tent_allocate_batch(NULL, 4) == UINT64_MAX);
    CHECK_EQ(tent_last_error_code(), 1);
    CHECK(tent_last_error(err, sizeof err) > 0 && strstr(err, "engine is NULL") != NULL);
    CHECK(tent_allocate_batch((tent_engine_t)(uintptr_t)0x1234, 4) == 0);
    CHECK_EQ(tent_last_error_code(), 1);
    CHECK(tent_last_error(err, sizeof err) > 0 && strstr(err, "not a live engine handle") != NULL);
    all_calls_fail((tent_engine_t)(uintptr_t)0xdeadbeef, "a garbage");

    /* A bad config value: no engine at all, and the error names the key. */
    tent_set_config("rpc_server_hostname", "127.0.0.1");
    tent_set_config("log_level", "error");
    tent_set_config("rpc_server_port", "70000");
    tent_engine_t bad = tent_create_engine();
    CHECK(bad == NULL);
    CHECK(tent_last_error(err, sizeof err) > 0);
    CHECK(strstr(err, "rpc_server_port") != NULL);
    all_calls_fail(bad, "a NULL (bad config)");
    tent_set_config("rpc_server_port", "0");

    /* An engine that failed to start: its RPC port is taken by another engine. */
    tent_engine_t holder = tent_create_engine();
    CHECK_EQ(tent_available(holder), 1);
    char held[64];
    uint16_t held_port = 0;
    CHECK_EQ(tent_rpc_server_addr_port(holder, held, sizeof held, &held_port), 0);
    char port_text[16];
    snprintf(port_text, sizeof port_text, "%u", (unsigned)held_port);
    tent_set_config("rpc_server_port", port_text);
    bad = tent_create_engine();
    CHECK(bad != NULL);
    CHECK(tent_last_error(err, sizeof err) > 0);
    all_calls_fail(bad, "a failed");
    tent_destroy_engine(bad);
    tent_destroy_engine(holder);
    tent_set_config("rpc_server_port", "0");

    tent_engine_t e = tent_create_engine();
    CHECK_EQ(tent_available(e), 1);
    tent_destroy_engine(e);
    all_calls_fail(e, "a destroyed");

    e = tent_create_engine();
    CHECK_EQ(tent_available(e), 1);

    /* NULL arguments. */
    uint16_t port;
    tent_segment_id_t h;
    tent_status_t st;
    tent_request_t r;
    memset(&r, 0, sizeof r);
    CHECK_EQ(tent_segment_name(e, NULL, 10), -1);
    CHECK_EQ(tent_segment_name(e, err, 0), -1);
    CHECK_EQ(tent_rpc_server_addr_port(e, NULL, 10, &port), -1);
    CHECK_EQ(tent_rpc_server_addr_port(e, err, sizeof err, NULL), -1);
    CHECK_EQ(tent_open_segment(e, NULL, "x"), -1);
    CHECK_EQ(tent_open_segment(e, &h, NULL), -1);
    CHECK_EQ(tent_get_segment_info(e, 0, NULL), -1);
    tent_free_segment_info(NULL);
    CHECK_EQ(tent_allocate_memory(e, NULL, 64, "*"), -1);
    void *p = NULL;
    CHECK_EQ(tent_allocate_memory(e, &p, 64, NULL), -1);
    CHECK_EQ(tent_allocate_memory(e, &p, 0, "*"), -1);
    CHECK_EQ(tent_allocate_memory(e, &p, 64, "cuda:0"), -1);
    CHECK_EQ(tent_free_memory(e, NULL), -1);
    CHECK_EQ(tent_free_memory(e, buf), -1); /* not allocated by the engine */
    CHECK_EQ(tent_register_memory(e, NULL, 64), -1);
    CHECK_EQ(tent_register_memory(e, buf, 0), -1);
    CHECK_EQ(tent_register_memory(e, (void *)(uintptr_t)(UINT64_MAX - 8), 64), -1); /* overflows */
    CHECK_EQ(tent_unregister_memory(e, NULL, 0), -1);
    CHECK_EQ(tent_unregister_memory(e, buf, 0), 0); /* nothing registered: upstream returns 0 */
    CHECK_EQ(tent_register_memory_with_perm(e, buf, 64, 7), -1);
    CHECK_EQ(tent_register_memory_with_perm(e, buf, 64, -1), -1);
    CHECK_EQ(tent_register_memory_batch(e, NULL, NULL, 1, 2), -1);
    void *addrs[2] = {buf, buf + 128};
    size_t sizes[2] = {64, 64};
    CHECK_EQ(tent_register_memory_batch(e, addrs, NULL, 2, 2), -1);
    CHECK_EQ(tent_unregister_memory_batch(e, NULL, sizes, 1), -1);
    CHECK_EQ(tent_unregister_memory_batch(e, addrs, NULL, 2), 0);
    tent_memory_options_t opts;
    memset(&opts, 0, sizeof opts);
    CHECK_EQ(tent_allocate_memory_ex(e, &p, 64, NULL), -1);
    CHECK_EQ(tent_register_memory_ex(e, buf, 64, NULL), -1);
    CHECK_EQ(tent_register_memory_batch_ex(e, addrs, sizes, 2, NULL), -1);
    opts.transport_type = 13;
    CHECK_EQ(tent_register_memory_ex(e, buf, 64, &opts), -1);
    opts.transport_type = TRANSPORT_GDS; /* not loaded */
    CHECK_EQ(tent_register_memory_ex(e, buf, 64, &opts), -1);
    opts.transport_type = 0;
    opts.permission = 9;
    CHECK_EQ(tent_register_memory_ex(e, buf, 64, &opts), -1);

    /* Batches: garbage, freed, out-of-range task ids. */
    CHECK_EQ(tent_allocate_batch(e, 0), 0);
    CHECK_EQ(tent_free_batch(e, 0), -1);
    CHECK_EQ(tent_free_batch(e, 0x123456789ull), -1);
    CHECK_EQ(tent_task_status(e, 0x123456789ull, 0, &st), -1);
    tent_batch_id_t b = tent_allocate_batch(e, 2);
    CHECK(b != 0 && b != UINT64_MAX);
    CHECK_EQ(tent_submit(e, b, NULL, 0), -1);
    CHECK_EQ(tent_submit(e, b, &r, 0), 0);
    CHECK_EQ(tent_submit(e, b, &r, SIZE_MAX), -1);
    CHECK_EQ(tent_submit_notif(e, b, &r, 0, NULL, "m"), -1);
    CHECK_EQ(tent_submit_notif(e, b, &r, 0, "n", NULL), -1);
    uint64_t dl = 1;
    CHECK_EQ(tent_submit_with_deadlines(e, b, NULL, 0, &dl, NULL, NULL), -1);
    CHECK_EQ(tent_submit_with_deadlines(e, b, &r, 0, &dl, "n", NULL), -1);
    CHECK_EQ(tent_submit_with_deadlines(e, b, &r, 0, &dl, NULL, "m"), -1);
    CHECK_EQ(tent_submit_with_deadlines(e, b, &r, 0, NULL, NULL, NULL), 0);
    CHECK_EQ(tent_submit_with_deadlines(e, b, &r, 0, &dl, "n", "m"), 0);
    CHECK_EQ(tent_task_status(e, b, 0, &st), -1); /* no task yet */
    CHECK_EQ(tent_task_status(e, b, 0, NULL), -1);
    CHECK_EQ(tent_overall_status(e, b, NULL), -1);
    CHECK_EQ(tent_overall_status(e, b, &st), 0);
    CHECK_EQ(st.status, STATUS_COMPLETED); /* empty batch */
    CHECK_EQ(st.transferred_bytes, 0);
    size_t n = 1;
    CHECK_EQ(tent_task_status_list(e, b, NULL, &n), -1);
    CHECK_EQ(tent_task_status_list(e, b, &st, NULL), -1);
    CHECK_EQ(tent_cancel_task(e, b, 5), -1);

    /* Unregistered and partially registered ranges: submit succeeds, the task FAILs. */
    CHECK_EQ(tent_register_memory(e, buf, 4096), 0);
    tent_request_t reqs[2];
    memset(reqs, 0, sizeof reqs);
    reqs[0].opcode = OPCODE_WRITE;
    reqs[0].source = buf;
    reqs[0].target_offset = (uint64_t)(uintptr_t)(buf + 8192); /* unregistered target */
    reqs[0].length = 64;
    reqs[1].opcode = OPCODE_WRITE;
    reqs[1].source = buf + 4000; /* runs past the registered 4096 bytes */
    reqs[1].target_offset = (uint64_t)(uintptr_t)buf;
    reqs[1].length = 200;
    memset(buf + 8192, 0x5a, 64);
    CHECK_EQ(tent_submit(e, b, reqs, 2), 0);
    CHECK_EQ(wait_done(e, b, 0, &st), 0);
    CHECK_EQ(st.status, STATUS_FAILED);
    CHECK_EQ(wait_done(e, b, 1, &st), 0);
    CHECK_EQ(st.status, STATUS_FAILED);
    CHECK_EQ(buf[8192], 0x5a); /* untouched */
    CHECK_EQ(tent_submit(e, b, reqs, 1), -1); /* capacity 2 used up */
    CHECK_EQ(tent_cancel_task(e, b, 0), 0);   /* ended: left as it is */
    CHECK_EQ(tent_task_status(e, b, 0, &st), 0);
    CHECK_EQ(st.status, STATUS_FAILED);
    CHECK_EQ(tent_task_status(e, b, 2, &st), -1);
    CHECK_EQ(tent_overall_status(e, b, &st), 0);
    CHECK_EQ(st.status, STATUS_FAILED);

    /* Overflowing ranges, bad opcodes, out-of-range hints, unknown segments. */
    tent_batch_id_t b2 = tent_allocate_batch(e, 8);
    tent_request_t odd[4];
    memset(odd, 0, sizeof odd);
    odd[0].opcode = OPCODE_READ;
    odd[0].source = buf;
    odd[0].target_offset = UINT64_MAX - 4;
    odd[0].length = 64;
    odd[1].opcode = 42;
    odd[1].source = buf;
    odd[1].target_offset = (uint64_t)(uintptr_t)buf;
    odd[1].length = 8;
    odd[2] = odd[1];
    odd[2].opcode = OPCODE_WRITE;
    odd[2].transport_hint = 1234; /* out of range: treated as no hint, as upstream */
    odd[3] = odd[2];
    odd[3].transport_hint = 0;
    odd[3].target_id = 77; /* never opened */
    CHECK_EQ(tent_submit(e, b2, odd + 1, 1), -1); /* an unknown opcode is refused, nothing created */
    odd[1] = odd[0];
    CHECK_EQ(tent_submit(e, b2, odd, 4), 0);
    CHECK_EQ(wait_done(e, b2, 0, &st), 0);
    CHECK_EQ(st.status, STATUS_FAILED);
    CHECK_EQ(wait_done(e, b2, 1, &st), 0);
    CHECK_EQ(st.status, STATUS_FAILED);
    CHECK_EQ(wait_done(e, b2, 2, &st), 0);
    CHECK_EQ(st.status, STATUS_COMPLETED);
    CHECK_EQ(wait_done(e, b2, 3, &st), 0);
    CHECK_EQ(st.status, STATUS_FAILED);
    odd[3].transport_hint = TRANSPORT_GDS; /* a valid hint naming an unloaded transport */
    CHECK_EQ(tent_submit(e, b2, odd + 3, 1), -1);

    /* Segments: unknown handles, closed handles, remote fetch failures. */
    CHECK_EQ(tent_close_segment(e, 0), 0);
    CHECK_EQ(tent_close_segment(e, 12345), -1);
    CHECK_EQ(tent_open_segment(e, &h, "127.0.0.1:1"), 0);
    CHECK(h >= 1);
    tent_segment_info_t info;
    info.buffers = (struct tent_buffer_info *)0x1;
    CHECK_EQ(tent_get_segment_info(e, 999, &info), -1);
    CHECK(info.buffers == NULL);
    CHECK_EQ(tent_get_segment_info(e, h, &info), -1);
    CHECK_EQ(tent_close_segment(e, h), 0);
    CHECK_EQ(tent_close_segment(e, h), -1);
    CHECK_EQ(tent_send_notifs(e, 0, NULL, "m"), -1);
    CHECK_EQ(tent_send_notifs(e, 0, "n", NULL), -1);
    CHECK_EQ(tent_send_notifs(e, 4242, "n", "m"), -1);
    CHECK_EQ(tent_recv_notifs(e, NULL), -1);
    tent_free_notifs(NULL);
    tent_nic_load_stat_t ns;
    n = 1;
    CHECK_EQ(tent_get_nic_load_stats(e, NULL, &n), -1);
    CHECK_EQ(tent_get_nic_load_stats(e, &ns, NULL), -1);

    /* Double frees. */
    CHECK_EQ(tent_free_batch(e, b), 0);
    CHECK_EQ(tent_free_batch(e, b), -1);
    CHECK_EQ(tent_free_batch(e, b2), 0);
    CHECK_EQ(tent_allocate_memory(e, &p, 4096, "*"), 0);
    CHECK_EQ(tent_free_memory(e, p), 0);
    CHECK_EQ(tent_free_memory(e, p), -1);

    /* tent_last_error: a failure leaves a readable message; a short buffer is terminated. */
    CHECK_EQ(tent_close_segment(e, 5555), -1);
    int len = tent_last_error(NULL, 0);
    CHECK(len > 0);
    char tiny[8];
    CHECK_EQ(tent_last_error(tiny, sizeof tiny), len);
    CHECK_EQ(strlen(tiny), 7);

    tent_load_config_from_file(NULL); /* ignored */
    tent_set_config(NULL, "x");
    tent_set_config("x", NULL);
    CHECK_EQ(tent_unregister_memory(e, buf, 4096), 0);
    tent_destroy_engine(e);
    tent_destroy_engine(e); /* second destroy is harmless */
    return check_report("bad_input");
}
