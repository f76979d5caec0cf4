/* A classic API caller linked with -ltransfer_engine only: it must run where that one library
 * file is the only tent-rs file deployed. */
#include <stdio.h>

#include "transfer_engine_c.h"

int main(void) {
    transfer_engine_t e = createTransferEngine("P2PHANDSHAKE", "127.0.0.1:12345", "127.0.0.1", 0, 0);
    char buf[256];
    if (!e || getLocalIpAndPort(e, buf, sizeof buf) != 0) return 1;
    printf("one library: %s\n", buf);
    destroyTransferEngine(e);
    return 0;
}
