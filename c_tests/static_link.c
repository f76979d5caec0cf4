/* The classic API linked from libtransfer_engine.a (-Bstatic), as the Go p2p-store links it. */
#include <stdio.h>

#include "transfer_engine_c.h"

int main(void) {
    transfer_engine_t e = createTransferEngine("P2PHANDSHAKE", "127.0.0.1:12345", "127.0.0.1", 0, 0);
    char buf[256];
    if (!e || getLocalIpAndPort(e, buf, sizeof buf) != 0) return 1;
    printf("linked statically: %s\n", buf);
    destroyTransferEngine(e);
    return 0;
}
