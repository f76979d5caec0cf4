/* Two classic engines on a central metadata store, named by the caller:
 *   classic_store <metadata_conn_string> <name_a> <name_b>
 * B finds A through the store only (there is no p2p fallback outside P2PHANDSHAKE), writes 1 MiB
 * into it and reads it back, bytes verified. Prints "a at <getLocalIpAndPort of A>" so the
 * harness can check the address each binding mode advertises, and destroys both engines (which
 * deletes their keys). */
#define _DEFAULT_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "transfer_engine_c.h"
#include "tent/transfer_engine.h"
#include "check.h"
#include "classic_util.h"

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: classic_store <conn> <name_a> <name_b>\n");
        return 2;
    }
    transfer_engine_t a = createTransferEngine(argv[1], argv[2], "127.0.0.1", 0, 0);
    transfer_engine_t b = createTransferEngine(argv[1], argv[3], "127.0.0.1", 0, 0);
    char why[512];
    if (!a || !b) {
        tent_last_error(why, sizeof why);
        fprintf(stderr, "createTransferEngine(%s) failed: %s\n", argv[1], why);
        CHECK(a != NULL && b != NULL);
        return check_report("classic_store");
    }
    char addr[256];
    CHECK_EQ(getLocalIpAndPort(a, addr, sizeof addr), 0);
    printf("a at %s\n", addr);

    const size_t len = 1u << 20;
    unsigned char *target = malloc(len), *src = malloc(len), *back = malloc(len);
    for (size_t i = 0; i < len; ++i) src[i] = (unsigned char)(i * 11 + 7);
    memset(target, 0, len);
    memset(back, 0, len);
    CHECK_EQ(registerLocalMemory(a, target, len, "cpu:0", 1), 0);
    CHECK_EQ(registerLocalMemory(b, src, len, "cpu:0", 1), 0);
    CHECK_EQ(registerLocalMemory(b, back, len, "cpu:0", 1), 0);
    /* The descriptor is republished after a registration; reopen until it lists the buffer. */
    segment_id_t seg = -1;
    int st = STATUS_FAILED;
    for (int attempt = 0; attempt < 200 && st != STATUS_COMPLETED; ++attempt) {
        seg = attempt == 0 ? openSegment(b, argv[2]) : openSegmentNoCache(b, argv[2]);
        if (seg > 0) st = classic_transfer(b, seg, OPCODE_WRITE, src, target, len);
        if (st != STATUS_COMPLETED) usleep(20000);
    }
    CHECK(seg > 0);
    CHECK_EQ(st, STATUS_COMPLETED);
    CHECK(memcmp(src, target, len) == 0);
    CHECK_EQ(classic_transfer(b, seg, OPCODE_READ, back, target, len), STATUS_COMPLETED);
    CHECK(memcmp(src, back, len) == 0);
    destroyTransferEngine(b);
    destroyTransferEngine(a);
    free(target);
    free(src);
    free(back);
    return check_report("classic_store");
}
