/* A program written against upstream's declarations (c_tests/upstream/transfer_engine.h, not
 * ours): a local-segment WRITE and READ with every byte verified. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "upstream/transfer_engine.h"
#include "check.h"

static int wait(tent_engine_t e, tent_batch_id_t b) {
    tent_status_t st;
    do {
        if (tent_overall_status(e, b, &st) != 0) return -1;
    } while (st.status == STATUS_PENDING);
    return st.status;
}

int main(void) {
    tent_set_config("rpc_server_hostname", "127.0.0.1");
    tent_set_config("log_level", "warning");
    tent_engine_t e = tent_create_engine();
    CHECK(tent_available(e) == 1);
    const size_t n = 1 << 20;
    char *a = malloc(n), *b = malloc(n), *c = malloc(n);
    for (size_t i = 0; i < n; ++i) a[i] = (char)(i ^ (i >> 8));
    memset(b, 0, n);
    memset(c, 0, n);
    CHECK_EQ(tent_register_memory(e, a, n), 0);
    CHECK_EQ(tent_register_memory(e, b, n), 0);
    CHECK_EQ(tent_register_memory(e, c, n), 0);

    tent_request_t r = {0};
    r.opcode = OPCODE_WRITE;
    r.source = a;
    r.target_id = LOCAL_SEGMENT_ID;
    r.target_offset = (uint64_t)(uintptr_t)b;
    r.length = n;
    tent_batch_id_t batch = tent_allocate_batch(e, 2);
    CHECK_EQ(tent_submit(e, batch, &r, 1), 0);
    CHECK_EQ(wait(e, batch), STATUS_COMPLETED);
    r.opcode = OPCODE_READ;
    r.source = c;
    CHECK_EQ(tent_submit(e, batch, &r, 1), 0);
    CHECK_EQ(wait(e, batch), STATUS_COMPLETED);
    CHECK(memcmp(a, b, n) == 0);
    CHECK(memcmp(a, c, n) == 0);
    CHECK_EQ(tent_free_batch(e, batch), 0);
    CHECK_EQ(tent_unregister_memory(e, a, 0), 0);
    CHECK_EQ(tent_unregister_memory(e, b, 0), 0);
    CHECK_EQ(tent_unregister_memory(e, c, 0), 0);
    tent_destroy_engine(e);
    free(a);
    free(b);
    free(c);
    return check_report("upstream_header");
}
