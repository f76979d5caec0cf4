/* A C target for the Python tests: a classic-API engine (P2PHANDSHAKE) with one registered
 * buffer filled with the tests' pattern, driven by one-line commands on stdin:
 *   check OFF LEN SEED -> "ok" when buffer[OFF:OFF+LEN] holds pattern(SEED), else "bad AT"
 *   quit
 * It prints "SEGMENT <name> <addr> <size>" once ready. */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transfer_engine_c.h"

static unsigned char pat(unsigned long i, unsigned long seed) { return (unsigned char)((i * 131 + seed) % 251); }

int main(int argc, char **argv) {
    size_t size = argc > 1 ? strtoul(argv[1], NULL, 10) : (1u << 20);
    transfer_engine_t e = createTransferEngine("P2PHANDSHAKE", "127.0.0.1", "127.0.0.1", 0, 1);
    if (!e) return 2;
    unsigned char *buf = malloc(size);
    if (!buf) return 3;
    for (size_t i = 0; i < size; ++i) buf[i] = pat(i, 7);
    if (registerLocalMemory(e, buf, size, "cpu:0", 1) != 0) return 4;
    char name[256] = {0};
    if (getLocalIpAndPort(e, name, sizeof name) != 0) return 5;
    printf("SEGMENT %s %llu %zu\n", name, (unsigned long long)(uintptr_t)buf, size);
    fflush(stdout);
    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        unsigned long off = 0, len = 0, seed = 0;
        if (sscanf(line, "check %lu %lu %lu", &off, &len, &seed) == 3) {
            unsigned long bad = len;
            for (unsigned long i = 0; i < len && off + i < size; ++i)
                if (buf[off + i] != pat(i, seed)) { bad = i; break; }
            if (bad == len) printf("ok\n"); else printf("bad %lu\n", bad);
            fflush(stdout);
        } else if (strncmp(line, "quit", 4) == 0) {
            break;
        }
    }
    unregisterLocalMemory(e, buf);
    destroyTransferEngine(e);
    free(buf);
    return 0;
}
