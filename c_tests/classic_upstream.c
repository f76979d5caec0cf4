/* The classic API where real upstream callers depend on upstream's behaviour:
 *   - upstream's own declarations of the five diagnostic functions, repeated after our header,
 *     and function pointers of upstream's types (a mismatch does not compile under -Werror);
 *   - P2PHANDSHAKE ignores the port of local_server_name (and rpc_port): two engines given the
 *     same host:port, a port some other socket holds, both start on free ports and move bytes
 *     both ways; the segment name keeps the host as given ("localhost" stays "localhost");
 *   - getLocalIpAndPort reports that name;
 *   - showLinks writes a JSON object with "local_nics" (and readable text), one entry per RDMA
 *     NIC. Run with the argument "sim" (and MC_TENT_CONF selecting the simulated RDMA provider)
 *     it expects one NIC with its details and a "topology" member; without, no NIC. */
#define _DEFAULT_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "transfer_engine_c.h"
#include "check.h"
#include "classic_util.h"

/* Upstream's declarations, verbatim in meaning: a conflicting declaration in our header is a
 * compile error here. */
void enableGracefulShutdown(transfer_engine_t engine);
int showLinks(transfer_engine_t engine, char *buf_out, size_t buf_len, int json);
int getNicLoadStats(transfer_engine_t engine, nic_load_stat_t *stats, size_t *count);
int discoverTopology(transfer_engine_t engine);
int warmupEfaSegment(transfer_engine_t engine, const char *segment_name);

typedef void (*graceful_fn)(transfer_engine_t);
typedef int (*show_links_fn)(transfer_engine_t, char *, size_t, int);
typedef int (*nic_stats_fn)(transfer_engine_t, nic_load_stat_t *, size_t *);
typedef int (*discover_fn)(transfer_engine_t);
typedef int (*warmup_fn)(transfer_engine_t, const char *);

static const graceful_fn p_graceful = enableGracefulShutdown;
static const show_links_fn p_show_links = showLinks;
static const nic_stats_fn p_nic_stats = getNicLoadStats;
static const discover_fn p_discover = discoverTopology;
static const warmup_fn p_warmup = warmupEfaSegment;

/* One request from `e` to segment `name`, polled to the end; returns the final status. */
static int transfer(transfer_engine_t e, const char *name, int opcode, void *local, void *remote, size_t len) {
    segment_id_t seg = openSegment(e, name);
    CHECK(seg > 0);
    return seg > 0 ? classic_transfer(e, seg, opcode, local, remote, len) : -1;
}

static int port_of(const char *name) {
    const char *colon = strrchr(name, ':');
    return colon ? atoi(colon + 1) : -1;
}

static void p2p_ignores_the_given_port(void) {
    /* A port someone else holds: upstream's classic engine never binds it in P2P mode. */
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    CHECK_EQ(bind(s, (struct sockaddr *)&a, sizeof a), 0);
    CHECK_EQ(listen(s, 1), 0);
    socklen_t alen = sizeof a;
    CHECK_EQ(getsockname(s, (struct sockaddr *)&a, &alen), 0);
    int held = ntohs(a.sin_port);
    char given[64];
    snprintf(given, sizeof given, "127.0.0.1:%d", held);

    /* Both get the same name; rpc_port is ignored as well (70000 is not even a port). */
    transfer_engine_t x = createTransferEngine("P2PHANDSHAKE", given, "127.0.0.1", 70000, 0);
    transfer_engine_t y = createTransferEngine("P2PHANDSHAKE", given, "127.0.0.1", (uint64_t)held, 0);
    CHECK(x != NULL && y != NULL);
    if (!x || !y) return;
    char xn[256], yn[256];
    CHECK_EQ(getLocalIpAndPort(x, xn, sizeof xn), 0);
    CHECK_EQ(getLocalIpAndPort(y, yn, sizeof yn), 0);
    CHECK(strncmp(xn, "127.0.0.1:", 10) == 0 && strncmp(yn, "127.0.0.1:", 10) == 0);
    CHECK(port_of(xn) != held && port_of(yn) != held && port_of(xn) != port_of(yn));
    CHECK(port_of(xn) > 0 && port_of(yn) > 0);

    const size_t len = 1u << 20;
    unsigned char *xs = malloc(len), *xt = malloc(len), *ys = malloc(len), *yt = malloc(len);
    for (size_t i = 0; i < len; ++i) {
        xs[i] = (unsigned char)(i * 13 + 1);
        ys[i] = (unsigned char)(i * 29 + 5);
    }
    memset(xt, 0, len);
    memset(yt, 0, len);
    CHECK_EQ(registerLocalMemory(x, xs, len, "cpu:0", 1), 0);
    CHECK_EQ(registerLocalMemory(x, xt, len, "cpu:0", 1), 0);
    CHECK_EQ(registerLocalMemory(y, ys, len, "cpu:0", 1), 0);
    CHECK_EQ(registerLocalMemory(y, yt, len, "cpu:0", 1), 0);
    /* x writes into y, y writes into x, then each reads the other's source back. */
    CHECK_EQ(transfer(x, yn, OPCODE_WRITE, xs, yt, len), STATUS_COMPLETED);
    CHECK_EQ(transfer(y, xn, OPCODE_WRITE, ys, xt, len), STATUS_COMPLETED);
    CHECK(memcmp(xs, yt, len) == 0);
    CHECK(memcmp(ys, xt, len) == 0);
    memset(xt, 0, len);
    CHECK_EQ(transfer(x, yn, OPCODE_READ, xt, ys, len), STATUS_COMPLETED);
    CHECK(memcmp(ys, xt, len) == 0);
    destroyTransferEngine(x);
    destroyTransferEngine(y);
    free(xs);
    free(xt);
    free(ys);
    free(yt);
    close(s);
}

static void name_keeps_the_host_as_given(void) {
    transfer_engine_t h = createTransferEngine("P2PHANDSHAKE", "localhost:12345", "ignored.invalid", 0, 0);
    transfer_engine_t p = createTransferEngine("P2PHANDSHAKE", "127.0.0.1:12345", NULL, 0, 0);
    CHECK(h != NULL && p != NULL);
    if (!h || !p) return;
    char name[256];
    CHECK_EQ(getLocalIpAndPort(h, name, sizeof name), 0);
    CHECK(strncmp(name, "localhost:", 10) == 0);
    CHECK(port_of(name) > 0 && port_of(name) != 12345);
    /* Peers reach it by that name. */
    const size_t len = 4096;
    unsigned char *src = malloc(len), *dst = malloc(len);
    memset(src, 0xa7, len);
    memset(dst, 0, len);
    CHECK_EQ(registerLocalMemory(h, dst, len, "cpu:0", 1), 0);
    CHECK_EQ(registerLocalMemory(p, src, len, "cpu:0", 1), 0);
    CHECK_EQ(transfer(p, name, OPCODE_WRITE, src, dst, len), STATUS_COMPLETED);
    CHECK(memcmp(src, dst, len) == 0);
    /* Opening our own name gives the local segment. */
    CHECK_EQ(openSegment(h, name), LOCAL_SEGMENT);
    destroyTransferEngine(h);
    destroyTransferEngine(p);
    free(src);
    free(dst);
}

static void show_links(int expect_nics) {
    transfer_engine_t e = createTransferEngine("P2PHANDSHAKE", "127.0.0.1", NULL, 0, 0);
    CHECK(e != NULL);
    if (!e) return;
    static char buf[65536];
    CHECK_EQ(p_show_links(e, buf, sizeof buf, 1), 0);
    printf("showLinks json:\n%s\n", buf);
    CHECK(buf[0] == '{' && strstr(buf, "\"local_nics\"") != NULL);
    if (expect_nics) {
        CHECK(strstr(buf, "\"device\"") != NULL);
        const char *keys[] = {"\"numa\"", "\"gid\"", "\"gid_index\"", "\"port\"", "\"speed_gbps\": 100",
                              "\"source\": \"rdma_transport\"", "\"topology\""};
        for (size_t i = 0; i < sizeof keys / sizeof keys[0]; ++i) {
            if (strstr(buf, keys[i]) == NULL) {
                CHECK(!"key in showLinks JSON");
                fprintf(stderr, "missing %s\n", keys[i]);
            }
        }
    } else {
        CHECK(strstr(buf, "\"local_nics\": []") != NULL);
        CHECK(strstr(buf, "\"topology\"") == NULL);
    }
    CHECK_EQ(p_show_links(e, buf, sizeof buf, 0), 0);
    printf("showLinks text:\n%s\n", buf);
    CHECK(strstr(buf, "=== Local NICs ===") != NULL);
    CHECK((strstr(buf, "(no RDMA devices found)") == NULL) == (expect_nics != 0));
    CHECK((strstr(buf, "Gbps") != NULL) == (expect_nics != 0));
    /* Upstream's refusals. */
    CHECK(p_show_links(NULL, buf, sizeof buf, 0) != 0);
    CHECK(p_show_links(e, NULL, sizeof buf, 0) != 0);
    CHECK(p_show_links(e, buf, 0, 0) != 0);

    size_t count = 4;
    nic_load_stat_t stats[4];
    CHECK_EQ(p_nic_stats(e, stats, &count), 0);
    CHECK_EQ(count, expect_nics ? 1 : 0);
    CHECK_EQ(p_discover(e), 0);
    CHECK_EQ(p_warmup(e, "127.0.0.1:1"), 0);
    (void)p_graceful; /* exercised by c_tests/classic_shutdown.c */
    destroyTransferEngine(e);
}

int main(int argc, char **argv) {
    int sim = argc > 1 && strcmp(argv[1], "sim") == 0;
    if (!sim) {
        p2p_ignores_the_given_port();
        name_keeps_the_host_as_given();
    }
    show_links(sim);
    return check_report(sim ? "classic_upstream sim" : "classic_upstream");
}
