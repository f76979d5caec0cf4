/* Helpers shared by the classic-API C tests: one transfer in its own batch, polled to the end. */
#ifndef TENT_C_TESTS_CLASSIC_UTIL_H
#define TENT_C_TESTS_CLASSIC_UTIL_H
#include <stdint.h>
#include <string.h>

#include "transfer_engine_c.h"

/* Submits one request (`remote` is the absolute address in segment `seg`) in a batch of its
 * own, busy-polls it as Go's p2p-store does and frees the batch. Returns the final status, or
 * -1 when the submit was refused or polling failed (callers decide whether that is a failure). */
static int classic_transfer(transfer_engine_t e, segment_id_t seg, int opcode, void *local, void *remote,
                            size_t len) {
    batch_id_t b = allocateBatchID(e, 1);
    if (b == INVALID_BATCH) return -1;
    struct transfer_request r;
    memset(&r, 0, sizeof r);
    r.opcode = opcode;
    r.source = local;
    r.target_id = seg;
    r.target_offset = (uint64_t)(uintptr_t)remote;
    r.length = len;
    int status = -1;
    if (submitTransfer(e, b, &r, 1) == 0) {
        struct transfer_status st;
        for (long i = 0; i < 50000000L; ++i) {
            if (getTransferStatus(e, b, 0, &st) != 0) break;
            if (st.status != STATUS_WAITING && st.status != STATUS_PENDING) {
                status = st.status;
                break;
            }
        }
    }
    freeBatchID(e, b);
    return status;
}
#endif
