/* Config loading: JSON text and a file path through tent_load_config_from_file, tent_set_config
 * typing, MC_TENT_CONF merged over the caller's config, invalid values failing the start. Each
 * scenario runs on its own thread because the settings are thread-local. */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tent/transfer_engine.h"
#include "check.h"

static uint16_t base_port;

static uint16_t port_of(tent_engine_t e) {
    char ip[64];
    uint16_t port = 0;
    if (tent_rpc_server_addr_port(e, ip, sizeof ip, &port) != 0) return 0;
    return port;
}

static void *json_text(void *arg) {
    (void)arg;
    char cfg[256];
    snprintf(cfg, sizeof cfg,
             "{\"rpc_server_hostname\":\"127.0.0.1\",\"rpc_server_port\":%u,\"log_level\":\"error\"}",
             (unsigned)base_port);
    tent_load_config_from_file(cfg);
    tent_engine_t e = tent_create_engine();
    CHECK_EQ(tent_available(e), 1);
    CHECK_EQ(port_of(e), base_port);
    char name[64];
    CHECK_EQ(tent_segment_name(e, name, sizeof name), 0);
    char want[64];
    snprintf(want, sizeof want, "127.0.0.1:%u", (unsigned)base_port);
    CHECK(strcmp(name, want) == 0);
    /* The same explicit port while it is taken: the start fails instead of moving. */
    tent_engine_t clash = tent_create_engine();
    CHECK_EQ(tent_available(clash), 0);
    tent_destroy_engine(clash);
    tent_destroy_engine(e);
    return NULL;
}

static void *file_path(void *arg) {
    (void)arg;
    char path[] = "/tmp/tent-config-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    char cfg[256];
    int n = snprintf(cfg, sizeof cfg, "{\"rpc_server_hostname\":\"127.0.0.1\",\"rpc_server_port\":\"%u\"}",
                     (unsigned)(base_port + 1));
    CHECK(write(fd, cfg, (size_t)n) == n);
    close(fd);
    tent_load_config_from_file(path);
    tent_engine_t e = tent_create_engine();
    CHECK_EQ(tent_available(e), 1);
    CHECK_EQ(port_of(e), base_port + 1); /* a file path works, and the port may be a string */
    tent_destroy_engine(e);
    unlink(path);
    return NULL;
}

static void *set_config_values(void *arg) {
    (void)arg;
    tent_set_config("rpc_server_hostname", "127.0.0.1");
    tent_set_config("merge_requests", "0");       /* "0" read as false, no crash */
    tent_set_config("transports/tcp/enable", "TRUE");
    tent_set_config("rpc_server_threads", "4");
    tent_engine_t e = tent_create_engine();
    CHECK_EQ(tent_available(e), 1);
    tent_destroy_engine(e);
    tent_set_config("rpc_server_threads", "0"); /* out of 1..1024 */
    e = tent_create_engine();
    CHECK_EQ(tent_available(e), 0);
    tent_destroy_engine(e);
    tent_set_config("rpc_server_threads", "1");
    tent_set_config("rpc_server_port", "abc");
    e = tent_create_engine();
    CHECK_EQ(tent_available(e), 0);
    tent_destroy_engine(e);
    tent_set_config("rpc_server_port", "-5");
    e = tent_create_engine();
    CHECK_EQ(tent_available(e), 0);
    tent_destroy_engine(e);
    tent_set_config("rpc_server_port", "0");
    /* Every key is typed: an ill-typed or out-of-range value fails the start, and the error
     * names the key, the value and the reason. */
    static const char *bad[][4] = {
        /* key, bad value, reason, a good value to put back */
        {"transports/tcp/chunk_size", "abc", "not a non-negative integer", "65536"},
        {"max_failover_attempts", "xyz", "not a non-negative integer", "3"},
        {"transports/rdma/max_timeout_ns", "-5", "not a non-negative integer", "1000000000"},
        {"transports/tcp/max_concurrent_tasks", "0", "outside the allowed range", "16"},
        {"metadata_type", "zookeeper", "not one of", "p2p"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        tent_set_config(bad[i][0], bad[i][1]);
        e = tent_create_engine();
        CHECK_EQ(e == NULL, 1);
        char msg[512] = {0};
        CHECK_EQ(tent_last_error(msg, sizeof msg) >= 0, 1);
        CHECK_EQ(strstr(msg, bad[i][0]) != NULL, 1);
        CHECK_EQ(strstr(msg, bad[i][1]) != NULL, 1);
        CHECK_EQ(strstr(msg, bad[i][2]) != NULL, 1);
        tent_destroy_engine(e);
        tent_set_config(bad[i][0], bad[i][3]);
    }
    /* Back to good values: a misspelt key is only a warning, the engine starts. */
    tent_set_config("transports/tcp/chunk_sise", "65536");
    e = tent_create_engine();
    CHECK_EQ(tent_available(e), 1);
    tent_destroy_engine(e);
    return NULL;
}

static void *garbage_source(void *arg) {
    (void)arg;
    tent_load_config_from_file("/no/such/file/and {not json");
    tent_set_config("rpc_server_hostname", "127.0.0.1");
    tent_engine_t e = tent_create_engine();
    CHECK_EQ(tent_available(e), 1); /* falls back to the defaults with a warning */
    tent_destroy_engine(e);
    return NULL;
}

static void *env_merge(void *arg) {
    (void)arg;
    /* MC_TENT_CONF gives the port; the caller's hostname survives (merge, not replace). */
    char conf[128];
    snprintf(conf, sizeof conf, "{\"rpc_server_port\":%u,\"log_level\":\"error\"}", (unsigned)(base_port + 2));
    setenv("MC_TENT_CONF", conf, 1);
    tent_set_config("rpc_server_hostname", "127.0.0.1");
    tent_engine_t e = tent_create_engine();
    CHECK_EQ(tent_available(e), 1);
    CHECK_EQ(port_of(e), base_port + 2);
    char ip[64];
    uint16_t port;
    CHECK_EQ(tent_rpc_server_addr_port(e, ip, sizeof ip, &port), 0);
    CHECK(strcmp(ip, "127.0.0.1") == 0);
    tent_destroy_engine(e);
    /* An explicit identity key wins over MC_TENT_CONF. */
    tent_set_config("rpc_server_port", "0");
    e = tent_create_engine();
    CHECK_EQ(tent_available(e), 1);
    CHECK(port_of(e) != base_port + 2);
    tent_destroy_engine(e);
    /* A legacy variable: MC_TENT_RPC_THREADS out of range fails the start. */
    setenv("MC_TENT_RPC_THREADS", "5000", 1);
    e = tent_create_engine();
    CHECK_EQ(tent_available(e), 0);
    tent_destroy_engine(e);
    unsetenv("MC_TENT_RPC_THREADS");
    unsetenv("MC_TENT_CONF");
    return NULL;
}

static void run(void *(*fn)(void *)) {
    pthread_t t;
    CHECK_EQ(pthread_create(&t, NULL, fn, NULL), 0);
    pthread_join(t, NULL);
}

int main(void) {
    /* Below Linux's ephemeral range (32768 and up), where other sockets' local ports would
       collide with ours now and then. */
    base_port = (uint16_t)(20000 + (getpid() % 3000) * 4);
    run(json_text);
    run(file_path);
    run(set_config_values);
    run(garbage_source);
    run(env_merge);
    return check_report("config_loading");
}
