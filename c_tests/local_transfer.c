/* Register / batch / submit / status / free on the local segment, with every byte verified. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tent/transfer_engine.h"
#include "check.h"

static tent_engine_t make_engine(void) {
    tent_set_config("rpc_server_hostname", "127.0.0.1");
    tent_set_config("log_level", "warning");
    return tent_create_engine();
}

static int wait_task(tent_engine_t e, tent_batch_id_t b, size_t task, tent_status_t *st) {
    for (int i = 0; i < 100000; ++i) {
        if (tent_task_status(e, b, task, st) != 0) return -1;
        if (st->status != STATUS_PENDING && st->status != STATUS_WAITING) return 0;
    }
    return -1;
}

int main(void) {
    tent_engine_t e = make_engine();
    CHECK(e != NULL);
    CHECK_EQ(tent_available(e), 1);

    char name[128];
    CHECK_EQ(tent_segment_name(e, name, sizeof name), 0);
    CHECK(strncmp(name, "127.0.0.1:", 10) == 0);
    char ip[64];
    uint16_t port = 0;
    CHECK_EQ(tent_rpc_server_addr_port(e, ip, sizeof ip, &port), 0);
    CHECK(strcmp(ip, "127.0.0.1") == 0);
    CHECK(port >= 15000 && port < 17000);

    /* Opening our own name, or "", gives the local segment. */
    tent_segment_id_t h = 99;
    CHECK_EQ(tent_open_segment(e, &h, name), 0);
    CHECK_EQ(h, LOCAL_SEGMENT_ID);
    CHECK_EQ(tent_open_segment(e, &h, ""), 0);
    CHECK_EQ(h, 0);

    const size_t len = 4u << 20;
    void *src = NULL, *dst = NULL;
    CHECK_EQ(tent_allocate_memory(e, &src, len, "cpu:0"), 0);
    CHECK_EQ(tent_allocate_memory(e, &dst, len, "*"), 0);
    CHECK(src != NULL && dst != NULL);
    CHECK_EQ(tent_register_memory(e, src, len), 0);
    CHECK_EQ(tent_register_memory(e, dst, len), 0);
    for (size_t i = 0; i < len; ++i) ((unsigned char *)src)[i] = (unsigned char)(i * 131 + 7);
    memset(dst, 0, len);

    tent_segment_info_t info;
    CHECK_EQ(tent_get_segment_info(e, LOCAL_SEGMENT_ID, &info), 0);
    CHECK_EQ(info.type, TYPE_MEMORY);
    CHECK_EQ(info.num_buffers, 2);
    int found = 0;
    for (int i = 0; i < info.num_buffers; ++i) {
        if (info.buffers[i].base == (uint64_t)(uintptr_t)dst && info.buffers[i].length == len) found = 1;
        CHECK(memchr(info.buffers[i].location, 0, sizeof info.buffers[i].location) != NULL);
    }
    CHECK(found);
    tent_free_segment_info(&info);
    CHECK(info.buffers == NULL);
    tent_free_segment_info(&info); /* second free is a no-op */

    /* WRITE in 4 strided requests over two submits, then READ back. */
    tent_batch_id_t b = tent_allocate_batch(e, 8);
    CHECK(b != 0 && b != UINT64_MAX);
    tent_request_t reqs[4];
    memset(reqs, 0, sizeof reqs);
    const size_t part = len / 4;
    for (int i = 0; i < 4; ++i) {
        reqs[i].opcode = OPCODE_WRITE;
        reqs[i].source = (char *)src + i * part;
        reqs[i].target_id = LOCAL_SEGMENT_ID;
        reqs[i].target_offset = (uint64_t)(uintptr_t)dst + (uint64_t)(3 - i) * part;
        reqs[i].length = part;
    }
    CHECK_EQ(tent_submit(e, b, reqs, 2), 0);
    CHECK_EQ(tent_submit(e, b, reqs + 2, 2), 0);
    tent_status_t st;
    for (size_t t = 0; t < 4; ++t) {
        CHECK_EQ(wait_task(e, b, t, &st), 0);
        CHECK_EQ(st.status, STATUS_COMPLETED);
        CHECK_EQ(st.transferred_bytes, part);
    }
    CHECK_EQ(tent_overall_status(e, b, &st), 0);
    CHECK_EQ(st.status, STATUS_COMPLETED);
    CHECK_EQ(st.transferred_bytes, len);
    for (int i = 0; i < 4; ++i)
        CHECK(memcmp((char *)src + i * part, (char *)dst + (3 - i) * part, part) == 0);

    tent_status_t list[8];
    size_t n = 8;
    CHECK_EQ(tent_task_status_list(e, b, list, &n), 0);
    CHECK_EQ(n, 4);
    n = 1;
    CHECK_EQ(tent_task_status_list(e, b, list, &n), 0);
    CHECK_EQ(n, 4); /* total reported even when the buffer was smaller */

    /* Capacity spans submits: 4 used, 4 left, 5 more is refused and creates nothing. */
    tent_request_t five[5];
    memset(five, 0, sizeof five);
    for (int i = 0; i < 5; ++i) {
        five[i].opcode = OPCODE_READ;
        five[i].source = src;
        five[i].target_offset = (uint64_t)(uintptr_t)dst;
        five[i].length = 16;
    }
    CHECK_EQ(tent_submit(e, b, five, 5), -1);
    n = 8;
    CHECK_EQ(tent_task_status_list(e, b, list, &n), 0);
    CHECK_EQ(n, 4);
    CHECK_EQ(tent_free_batch(e, b), 0);
    CHECK_EQ(tent_task_status(e, b, 0, &st), -1); /* freed */

    /* READ back into a zeroed source. */
    memset(src, 0, len);
    b = tent_allocate_batch(e, 1);
    tent_request_t rd;
    memset(&rd, 0, sizeof rd);
    rd.opcode = OPCODE_READ;
    rd.source = src;
    rd.target_offset = (uint64_t)(uintptr_t)dst;
    rd.length = len;
    CHECK_EQ(tent_submit(e, b, &rd, 1), 0);
    CHECK_EQ(wait_task(e, b, 0, &st), 0);
    CHECK_EQ(st.status, STATUS_COMPLETED);
    int ok = 1;
    for (size_t i = 0; i < len && ok; ++i) {
        size_t quarter = i / part, within = i % part;
        size_t orig = (3 - quarter) * part + within; /* dst quarter q holds src quarter 3-q */
        if (((unsigned char *)src)[i] != (unsigned char)(orig * 131 + 7)) ok = 0;
    }
    CHECK(ok);
    CHECK_EQ(tent_free_batch(e, b), 0);

    /* A read-only target refuses writes; reads still work. */
    CHECK_EQ(tent_unregister_memory(e, dst, 0), 0);
    CHECK_EQ(tent_register_memory_with_perm(e, dst, len, PERM_GLOBAL_READ_ONLY), 0);
    b = tent_allocate_batch(e, 2);
    tent_request_t two[2];
    memset(two, 0, sizeof two);
    two[0].opcode = OPCODE_WRITE; two[0].source = src; two[0].target_offset = (uint64_t)(uintptr_t)dst; two[0].length = 64;
    two[1].opcode = OPCODE_READ;  two[1].source = src; two[1].target_offset = (uint64_t)(uintptr_t)dst; two[1].length = 64;
    unsigned char before[64];
    memcpy(before, dst, 64);
    memset(src, 0xAB, 64);
    CHECK_EQ(tent_submit(e, b, two, 1), 0);
    CHECK_EQ(wait_task(e, b, 0, &st), 0);
    CHECK_EQ(st.status, STATUS_FAILED);
    CHECK(memcmp(before, dst, 64) == 0);
    CHECK_EQ(tent_submit(e, b, two + 1, 1), 0);
    CHECK_EQ(wait_task(e, b, 1, &st), 0);
    CHECK_EQ(st.status, STATUS_COMPLETED);
    CHECK_EQ(tent_overall_status(e, b, &st), 0);
    CHECK_EQ(st.status, STATUS_FAILED);
    CHECK_EQ(st.transferred_bytes, 64);
    CHECK_EQ(tent_free_batch(e, b), 0);

    /* Notifications: direct, and attached to a submit. */
    CHECK_EQ(tent_send_notifs(e, LOCAL_SEGMENT_ID, "direct", "hello"), 0);
    b = tent_allocate_batch(e, 1);
    CHECK_EQ(tent_submit_notif(e, b, two + 1, 1, "after", "done"), 0);
    CHECK_EQ(wait_task(e, b, 0, &st), 0);
    tent_notifi_info ni;
    CHECK_EQ(tent_recv_notifs(e, &ni), 0);
    CHECK_EQ(ni.num_records, 2);
    if (ni.num_records == 2) {
        CHECK(strcmp(ni.records[0].name, "direct") == 0 && strcmp(ni.records[0].msg, "hello") == 0);
        CHECK(strcmp(ni.records[1].name, "after") == 0 && strcmp(ni.records[1].msg, "done") == 0);
    }
    tent_free_notifs(&ni);
    CHECK(ni.records == NULL && ni.num_records == 0);
    tent_free_notifs(&ni);
    ni.records = (tent_notifi_record_t *)0x1; /* garbage from the caller is replaced */
    CHECK_EQ(tent_recv_notifs(e, &ni), 0);
    CHECK_EQ(ni.num_records, 0);
    CHECK(ni.records == NULL);
    CHECK_EQ(tent_free_batch(e, b), 0);

    /* Long names are truncated and NUL-terminated. */
    char big[5000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = 0;
    CHECK_EQ(tent_send_notifs(e, 0, big, big), 0);
    CHECK_EQ(tent_recv_notifs(e, &ni), 0);
    CHECK_EQ(ni.num_records, 1);
    if (ni.num_records == 1) {
        CHECK_EQ(strlen(ni.records[0].name), 255);
        CHECK_EQ(strlen(ni.records[0].msg), 4095);
    }
    tent_free_notifs(&ni);

    /* No NICs without RDMA. */
    tent_nic_load_stat_t stats[2];
    size_t ns = 2;
    CHECK_EQ(tent_get_nic_load_stats(e, stats, &ns), 0);
    CHECK_EQ(ns, 0);

    CHECK_EQ(tent_unregister_memory(e, src, len), 0);
    CHECK_EQ(tent_unregister_memory(e, dst, 0), 0);
    CHECK_EQ(tent_free_memory(e, src), 0);
    CHECK_EQ(tent_free_memory(e, dst), 0);
    tent_destroy_engine(e);
    return check_report("local_transfer");
}
