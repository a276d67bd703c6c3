/* Replays the fuzz corpora and regressions of fuzz_policy_spec and
 * fuzz_store_record without libFuzzer: every file of tests/fuzz/corpus-spec,
 * regressions-spec, corpus-record and regressions-record goes through the
 * same harness functions as the fuzz targets (tests/fuzz/harness_*.h), so a
 * crasher copied into a regressions folder keeps failing here until it is
 * fixed, and stays fixed. A violated invariant aborts (the harness prints
 * which) and Criterion reports the test as crashed; the file being replayed
 * is logged just before. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/harness_policy.h"
#include "tests/fuzz/harness_record.h"
#include "util/util.h"

typedef void (*replay_fn)(const uint8_t *data, size_t size);

static int cmp_names(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Every regular file of $PD_SOURCE_ROOT/rel, in name order, through fn;
 * check (optional) then sees the same bytes. Returns how many. */
static int replay_dir(const char *rel, replay_fn fn, replay_fn check) {
    const char *root = getenv("PD_SOURCE_ROOT");
    cr_assert(root, "PD_SOURCE_ROOT is not set (run through meson test)");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/%s", root, rel);
    DIR *d = opendir(dir);
    cr_assert(d, "cannot open %s", dir);
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 32;
            names = realloc(names, cap * sizeof *names);
            cr_assert(names, "out of memory");
        }
        names[n] = strdup(e->d_name);
        cr_assert(names[n], "out of memory");
        n++;
    }
    closedir(d);
    if (n) qsort(names, n, sizeof *names, cmp_names);
    for (size_t i = 0; i < n; i++) {
        char path[2048];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        char *data = NULL;
        size_t len = 0;
        pd_error err = {0};
        cr_assert_eq(pd_read_file(path, &data, &len, &err), PD_OK, "%s", err.msg);
        fprintf(stderr, "replaying %s/%s (%zu bytes)\n", rel, names[i], len);
        fn((const uint8_t *)data, len);
        if (check) check((const uint8_t *)data, len);
        free(data);
        free(names[i]);
    }
    free(names);
    return (int)n;
}

/* Seeds of the spec corpus are meant to be valid: each parses as a policy
 * spec or as a layout. */
static void spec_seed_parses(const uint8_t *data, size_t size) {
    char *text = malloc(size + 1);
    cr_assert(text, "out of memory");
    memcpy(text, data, size);
    text[size] = '\0';
    pd_policy_spec s;
    pd_layout l;
    pd_error e1 = {0}, e2 = {0};
    bool spec_ok = pd_policy_spec_parse(text, &s, &e1) == PD_OK;
    bool layout_ok = pd_layout_parse(text, &l, &e2) == PD_OK;
    if (layout_ok) pd_layout_free(&l);
    cr_expect(spec_ok || layout_ok, "seed '%s' is neither a spec (%s) nor a layout (%s)", text, e1.msg, e2.msg);
    free(text);
}

Test(fuzz_replay, spec_regressions) {
    cr_assert_gt(replay_dir("tests/fuzz/regressions-spec", pd_fuzz_policy_input, NULL), 0, "no inputs");
}

Test(fuzz_replay, spec_corpus) {
    cr_assert_gt(replay_dir("tests/fuzz/corpus-spec", pd_fuzz_policy_input, spec_seed_parses), 0, "no inputs");
}

Test(fuzz_replay, record_regressions) {
    cr_assert_gt(replay_dir("tests/fuzz/regressions-record", pd_fuzz_record_input, NULL), 0, "no inputs");
}

Test(fuzz_replay, record_corpus) {
    cr_assert_gt(replay_dir("tests/fuzz/corpus-record", pd_fuzz_record_input, NULL), 0, "no inputs");
}

/* A few hundred deterministic pseudo-random inputs per record mode: a
 * smoke test of the harness and the decoders on every build, far short of
 * a fuzzing run. */
Test(fuzz_replay, record_noise) {
    uint64_t x = 0x2545f4914f6cdd1du;
    uint8_t buf[2048];
    for (int i = 0; i < 1000; i++) {
        size_t len = 1 + (size_t)(i * 7919 % (int)sizeof buf);
        for (size_t j = 0; j < len; j++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            buf[j] = (uint8_t)(x >> 32);
        }
        buf[0] = (uint8_t)(i % PD_FUZZ_REC_MODES);
        if (buf[0] == PD_FUZZ_REC_SEAL_HEADER && len > 1 && i % 10 < 5) buf[1] = 0xff; /* must decode */
        pd_fuzz_record_input(buf, len);
    }
}
