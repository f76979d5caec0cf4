/* Minimal assertion helpers for the C tests: every failed check prints where and why, and the
 * program exits non-zero at the end. */
#ifndef TENT_C_TESTS_CHECK_H
#define TENT_C_TESTS_CHECK_H
#include <stdio.h>
#include <stdlib.h>

static int g_checks = 0;
static int g_failures = 0;

#define CHECK(cond)                                                               \
    do {                                                                          \
        ++g_checks;                                                               \
        if (!(cond)) {                                                            \
            ++g_failures;                                                         \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                         \
    } while (0)

#define CHECK_EQ(a, b)                                                            \
    do {                                                                          \
        long long va_ = (long long)(a), vb_ = (long long)(b);                     \
        ++g_checks;                                                               \
        if (va_ != vb_) {                                                         \
            ++g_failures;                                                         \
            fprintf(stderr, "%s:%d: check failed: %s == %s (%lld vs %lld)\n",      \
                    __FILE__, __LINE__, #a, #b, va_, vb_);                        \
        }                                                                         \
    } while (0)

static int check_report(const char *name) {
    printf("%s: %d passed, %d failed\n", name, g_checks - g_failures, g_failures);
    return g_failures == 0 ? 0 : 1;
}
#endif
