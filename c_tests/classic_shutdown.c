/* enableGracefulShutdown as upstream's callers use it:
 *   classic_shutdown <metadata_conn_string> <segment name> <mode>
 *   signal - registers the engine, checks that a child forked afterwards still dies by SIGTERM
 *            (and does not clean up the parent's engine), prints READY and waits for a signal;
 *   plain  - does not register, prints READY and waits (SIGTERM kills it the default way);
 *   exit   - registers, prints READY, waits for a line on stdin and returns from main without
 *            destroying the engine (the exit hook must).
 * The harness watches the segment's key in the store. */
#define _DEFAULT_SOURCE
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "transfer_engine_c.h"
#include "tent/transfer_engine.h"
#include "check.h"

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: classic_shutdown <conn> <name> signal|plain|exit\n");
        return 2;
    }
    const char *mode = argv[3];
    transfer_engine_t e = createTransferEngine(argv[1], argv[2], "127.0.0.1", 0, 0);
    if (!e) {
        char why[512];
        tent_last_error(why, sizeof why);
        fprintf(stderr, "createTransferEngine failed: %s\n", why);
        return 1;
    }
    if (strcmp(mode, "plain") != 0) {
        enableGracefulShutdown(e);
        enableGracefulShutdown(e); /* twice is harmless */
        enableGracefulShutdown(NULL); /* ignored */
    }
    if (strcmp(mode, "signal") == 0) {
        pid_t child = fork();
        if (child == 0) {
            raise(SIGTERM);
            _exit(99); /* only reached if the handler swallowed the signal */
        }
        int status = 0;
        CHECK_EQ(waitpid(child, &status, 0), child);
        CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM);
        if (g_failures) return check_report("classic_shutdown");
    }
    printf("READY\n");
    fflush(stdout);
    if (strcmp(mode, "exit") == 0) {
        char line[16];
        if (!fgets(line, sizeof line, stdin)) return 3;
        return 0;
    }
    for (;;) pause();
}
