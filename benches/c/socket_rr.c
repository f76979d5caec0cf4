/* A plain request/response over one loopback TCP connection between two processes: the
 * reference for the latency of one small transfer (tent-bench at batch 1).
 *
 *   socket_rr BLOCK SECONDS [write|read]
 *
 * write: the client sends a 16-byte header and BLOCK bytes, the server reads them into a
 * buffer and answers 16 bytes (a WRITE's shape); read: the client sends 16 bytes and the
 * server answers with BLOCK bytes (a READ's). TCP_NODELAY on both ends, blocking calls, one
 * request at a time. Prints the block size, the average, p50 and p99 round trip in
 * microseconds. */
#define _GNU_SOURCE
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int full(int fd, void *p, size_t n, int out) {
    char *c = p;
    while (n > 0) {
        ssize_t k = out ? send(fd, c, n, MSG_NOSIGNAL) : recv(fd, c, n, 0);
        if (k <= 0) return -1;
        c += k;
        n -= (size_t)k;
    }
    return 0;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: socket_rr BLOCK SECONDS [write|read]\n");
        return 2;
    }
    size_t block = strtoull(argv[1], NULL, 0);
    double seconds = atof(argv[2]);
    int reading = argc > 3 && strcmp(argv[3], "read") == 0;
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 1) || getsockname(l, (struct sockaddr *)&a, &al)) {
        perror("listen");
        return 1;
    }
    char *buf = calloc(1, block + 16);
    if (!buf) return 1;
    int one = 1;
    pid_t pid = fork();
    if (pid == 0) {
        int c = accept(l, NULL, NULL);
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        for (;;) {
            if (full(c, buf, 16, 0)) break;
            if (!reading && full(c, buf + 16, block, 0)) break;
            if (full(c, buf, reading ? block : 16, 1)) break;
        }
        _exit(0);
    }
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(c, (struct sockaddr *)&a, sizeof a)) {
        perror("connect");
        return 1;
    }
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    size_t cap = 1 << 22, n = 0;
    double *lat = malloc(cap * sizeof *lat);
    if (!lat) return 1;
    double end = now_us() + seconds * 1e6, total = 0;
    while (n < cap) {
        double t0 = now_us();
        if (t0 > end) break;
        if (full(c, buf, reading ? 16 : 16 + block, 1) || full(c, buf, reading ? block : 16, 0)) {
            perror("transfer");
            return 1;
        }
        lat[n] = now_us() - t0;
        total += lat[n++];
    }
    close(c);
    waitpid(pid, NULL, 0);
    qsort(lat, n, sizeof *lat, cmp);
    printf("%zu %.1f %.1f %.1f\n", block, total / (double)n, lat[n / 2], lat[(size_t)(n * 0.99)]);
    return 0;
}
