/* Fuzz harness for the policy spec and layout parsers, shared by the
 * libFuzzer target (fuzz_policy_spec.c) and the test suite's replay of
 * tests/fuzz/regressions-spec and tests/fuzz/corpus-spec
 * (test_fuzz_replay.c), so both run exactly the same checks.
 *
 * The input's bytes (cut at the first NUL, as a C string) go to
 * pd_policy_spec_parse and to pd_layout_parse. Whatever parses must:
 *   spec:   validate; print shorter than PD_POLICY_SPEC_MAX; print -> parse
 *           -> print give the same string; printing into a short buffer
 *           stays inside it and reports the full length;
 *   layout: print -> parse -> print give the same string and the same
 *           arrays; pd_layout_validate answers (with a message when it
 *           refuses) for a few prefix lengths, and accepts the covering
 *           length when the spans are well formed.
 * A refusal must come with a message. A violated invariant prints what
 * happened and calls abort(), which libFuzzer reports as a crash and
 * Criterion as a failed test. */
#ifndef PD_FUZZ_HARNESS_POLICY_H
#define PD_FUZZ_HARNESS_POLICY_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policies/policies.h"

#ifndef PD_FUZZ_CHECK
#define PD_FUZZ_CHECK(cond, ...)                                                                    \
    do {                                                                                            \
        if (!(cond)) {                                                                              \
            fprintf(stderr, "fuzz invariant violated at %s:%d: %s\n  ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                                           \
            fputc('\n', stderr);                                                                    \
            abort();                                                                                \
        }                                                                                           \
    } while (0)
#endif

/* Print into an exactly-sized heap buffer (so ASan sees any overrun) of
 * cap bytes and check the contract: the full length is returned and what
 * fits is NUL-terminated. full: the untruncated text. */
static inline void pd_fuzz_check_short_print(const char *full, size_t len, size_t cap, const pd_policy_spec *spec,
                                             const pd_layout *layout) {
    char *buf = malloc(cap ? cap : 1);
    if (!buf) return;
    size_t got = spec ? pd_policy_spec_print(spec, buf, cap) : pd_layout_print(layout, buf, cap);
    PD_FUZZ_CHECK(got == len, "print into %zu bytes returned %zu, the full length is %zu", cap, got, len);
    if (cap) {
        size_t fit = len < cap ? len : cap - 1;
        PD_FUZZ_CHECK(buf[fit] == '\0' && memcmp(buf, full, fit) == 0,
                      "print into %zu bytes is not the NUL-terminated start of '%s'", cap, full);
    }
    free(buf);
}

static inline void pd_fuzz_policy_spec(const char *text) {
    pd_policy_spec s, back;
    pd_error err = {0};
    if (pd_policy_spec_parse(text, &s, &err) != PD_OK) {
        PD_FUZZ_CHECK(err.msg[0] != '\0', "spec refused without a message");
        return;
    }
    err.msg[0] = '\0';
    PD_FUZZ_CHECK(pd_policy_spec_validate(&s, &err) == PD_OK, "a parsed spec fails validation: %s", err.msg);
    char a[PD_POLICY_SPEC_MAX], b[PD_POLICY_SPEC_MAX];
    size_t na = pd_policy_spec_print(&s, a, sizeof a);
    PD_FUZZ_CHECK(na < sizeof a, "canonical spec is %zu bytes, PD_POLICY_SPEC_MAX is %d: '%s'", na,
                  PD_POLICY_SPEC_MAX, a);
    PD_FUZZ_CHECK(strlen(a) == na, "print returned %zu for a string of %zu bytes", na, strlen(a));
    PD_FUZZ_CHECK(pd_policy_spec_parse(a, &back, &err) == PD_OK, "canonical spec '%s' does not parse: %s", a,
                  err.msg);
    PD_FUZZ_CHECK(pd_policy_spec_validate(&back, &err) == PD_OK, "re-parsed '%s' fails validation: %s", a, err.msg);
    size_t nb = pd_policy_spec_print(&back, b, sizeof b);
    PD_FUZZ_CHECK(nb == na && memcmp(a, b, na + 1) == 0, "print -> parse -> print changed\n  '%s'\n  '%s'", a, b);
    PD_FUZZ_CHECK(back.kind == s.kind && back.scorer == s.scorer, "re-parse changed the policy or scorer of '%s'",
                  a);
    pd_fuzz_check_short_print(a, na, na / 2, &s, NULL);
    pd_fuzz_check_short_print(a, na, 0, &s, NULL);
}

static inline bool pd_fuzz_layout_equal(const pd_layout *x, const pd_layout *y) {
    if (x->n_spans != y->n_spans || x->n_whitelist != y->n_whitelist) return false;
    for (int i = 0; i < x->n_spans; i++) {
        const pd_span *p = &x->spans[i], *q = &y->spans[i];
        if (strncmp(p->name, q->name, sizeof p->name) != 0 || p->start != q->start || p->end != q->end ||
            p->whitelist != q->whitelist)
            return false;
    }
    for (int i = 0; i < x->n_whitelist; i++)
        if (x->whitelist[i].start != y->whitelist[i].start || x->whitelist[i].end != y->whitelist[i].end)
            return false;
    return true;
}

/* The spans are sorted, non-empty and contiguous from 0 (what validate
 * checks besides the length), and every kept range is non-empty. */
static inline bool pd_fuzz_layout_well_formed(const pd_layout *l, int64_t *cover) {
    int64_t end = 0, top = 0;
    for (int i = 0; i < l->n_spans; i++) {
        const pd_span *s = &l->spans[i];
        if (s->start != end || s->start >= s->end) return false;
        end = s->end;
    }
    for (int i = 0; i < l->n_whitelist; i++) {
        if (l->whitelist[i].start >= l->whitelist[i].end) return false;
        if (l->whitelist[i].end > top) top = l->whitelist[i].end;
    }
    /* With spans n must be their end; without, any n past the ranges. */
    if (l->n_spans > 0 && top > end) return false;
    *cover = l->n_spans > 0 ? end : top;
    return true;
}

static inline void pd_fuzz_layout_validate(const pd_layout *l, int64_t n) {
    pd_error err = {0};
    if (pd_layout_validate(l, n, &err) != PD_OK)
        PD_FUZZ_CHECK(err.msg[0] != '\0', "layout refused for n = %lld without a message", (long long)n);
}

static inline void pd_fuzz_layout(const char *text) {
    pd_layout l, back;
    pd_error err = {0};
    if (pd_layout_parse(text, &l, &err) != PD_OK) {
        PD_FUZZ_CHECK(err.msg[0] != '\0', "layout refused without a message");
        PD_FUZZ_CHECK(!l.spans && !l.whitelist && !l.n_spans && !l.n_whitelist, "a refused layout is not empty");
        return;
    }
    size_t na = pd_layout_print(&l, NULL, 0);
    char *a = malloc(na + 1), *b = malloc(na + 1);
    PD_FUZZ_CHECK(a && b, "out of memory for a %zu-byte layout", na);
    PD_FUZZ_CHECK(pd_layout_print(&l, a, na + 1) == na && strlen(a) == na, "layout print lengths disagree");
    PD_FUZZ_CHECK(pd_layout_parse(a, &back, &err) == PD_OK, "canonical layout '%s' does not parse: %s", a, err.msg);
    PD_FUZZ_CHECK(pd_fuzz_layout_equal(&l, &back), "canonical layout '%s' parses to other spans or ranges", a);
    size_t nb = pd_layout_print(&back, b, na + 1);
    PD_FUZZ_CHECK(nb == na && memcmp(a, b, na + 1) == 0, "layout print -> parse -> print changed\n  '%s'\n  '%s'",
                  a, b);
    pd_fuzz_check_short_print(a, na, na / 2, NULL, &l);

    /* validate never crashes, whatever n; the covering n is accepted when
     * the spans are well formed. */
    static const int64_t fixed_n[] = {-1, 0, 1, 2, 7, 1000, INT64_MAX};
    for (size_t i = 0; i < sizeof fixed_n / sizeof fixed_n[0]; i++) pd_fuzz_layout_validate(&l, fixed_n[i]);
    int64_t cover;
    if (pd_fuzz_layout_well_formed(&l, &cover)) {
        pd_fuzz_layout_validate(&l, cover - 1);
        pd_fuzz_layout_validate(&l, cover + 1);
        err.msg[0] = '\0';
        PD_FUZZ_CHECK(pd_layout_validate(&l, cover, &err) == PD_OK, "well-formed layout '%s' refused for n = %lld: %s",
                      a, (long long)cover, err.msg);
    } else {
        /* Badly formed spans or ranges are refused for every n. */
        if (l.n_spans > 0) {
            int64_t end = l.spans[l.n_spans - 1].end;
            err.msg[0] = '\0';
            if (pd_layout_validate(&l, end, &err) == PD_OK)
                PD_FUZZ_CHECK(false, "malformed layout '%s' accepted for n = %lld", a, (long long)end);
        }
    }
    pd_layout_free(&back);
    pd_layout_free(&l);
    PD_FUZZ_CHECK(!l.spans && !l.n_spans, "pd_layout_free left the layout set");
    pd_fuzz_layout_validate(&l, 5);
    pd_fuzz_layout_validate(NULL, 5);
    free(a);
    free(b);
}

/* The whole harness: arbitrary bytes to both parsers. */
static inline void pd_fuzz_policy_input(const uint8_t *data, size_t size) {
    char *text = malloc(size + 1);
    if (!text) return;
    if (size) memcpy(text, data, size);
    text[size] = '\0';
    pd_fuzz_policy_spec(text);
    pd_fuzz_layout(text);
    free(text);
}

#endif
