/* policies/spec.c and policies/layout.c: policy spec strings (defaults,
 * canonical form, round trips of random specs against a key model written
 * here, every error class) and layouts (both text forms, validation). */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policies/policies.h"

static bool contains(const char *haystack, const char *needle) { return strstr(haystack, needle) != NULL; }

static void print_spec(const pd_policy_spec *s, char *buf) {
    size_t len = pd_policy_spec_print(s, buf, PD_POLICY_SPEC_MAX);
    cr_assert_lt(len, PD_POLICY_SPEC_MAX, "canonical string too long: %zu", len);
    cr_assert_eq(strlen(buf), len);
}

/* Parse text, print it, check that the print parses back to the same print. */
static void canonical_of(const char *text, char *out) {
    pd_policy_spec s;
    pd_error err = {0};
    cr_assert_eq(pd_policy_spec_parse(text, &s, &err), PD_OK, "parse '%s': %s", text, err.msg);
    cr_assert_eq(pd_policy_spec_validate(&s, &err), PD_OK, "validate '%s': %s", text, err.msg);
    print_spec(&s, out);
    pd_policy_spec again;
    cr_assert_eq(pd_policy_spec_parse(out, &again, &err), PD_OK, "reparse '%s': %s", out, err.msg);
    char out2[PD_POLICY_SPEC_MAX];
    print_spec(&again, out2);
    cr_assert_str_eq(out2, out, "round trip of '%s'", text);
}

/* ------------------------------------------------------------------------
 * A model of the keys, written from the contract (not from spec.c)
 * ------------------------------------------------------------------------ */

enum { K_ACCUMULATE, K_ALPHA, K_ATTN_CHUNK, K_BASE, K_BETA, K_BITS, K_BUDGET, K_CHUNK, K_DEBIAS, K_DIVISOR, K_FAIR, K_LAMBDA,
       K_LEV_CHUNK, K_LOCAL, K_MODE, K_POOL, K_PROFILE, K_RECENT, K_RETENTION, K_REUSE, K_RIDGE, K_ROUNDS,
       K_SCALE, K_SCORER, K_SEED, K_SHARED, K_SINK, K_SKETCH, K_TARGET, K_VNORM, K_WINDOW, NK };

static const char *const key_names[NK] = {
    "accumulate", "alpha", "attn_chunk", "base", "beta", "bits", "budget", "chunk", "debias", "divisor", "fair", "lambda",
    "lev_chunk", "local", "mode", "pool", "profile", "recent", "retention", "reuse", "ridge", "rounds",
    "scale", "scorer", "seed", "shared", "sink", "sketch", "target", "vnorm", "window",
};

static const char *const policy_names[PD_POLICY_COUNT] = {
    "compactor", "leverage", "noncausal", "random", "knorm", "streaming", "snapkv",
    "h2o", "tova", "pyramidkv", "chunkkv", "obcache", "laserkv",
};

/* The settings that decide which keys exist and what their defaults are. */
typedef struct shape {
    int kind, scorer;
    bool kvpress;     /* compactor profile */
    const char *budget;
    bool fair;
    bool exact;       /* leverage mode */
    bool chunked;     /* chunk > 0 */
} shape;

static bool is_wrapper(int kind) { return kind == PD_POLICY_PYRAMIDKV || kind == PD_POLICY_CHUNKKV; }

static bool uses(const shape *c, int key) {
    int s = c->scorer;
    bool compactor = s == PD_POLICY_COMPACTOR, leverage = s == PD_POLICY_LEVERAGE;
    bool noncausal = s == PD_POLICY_NONCAUSAL, laser = s == PD_POLICY_LASERKV;
    switch (key) {
    case K_RETENTION: case K_BUDGET: case K_CHUNK: case K_REUSE: case K_FAIR: return true;
    case K_SINK: case K_RECENT: return c->kind != PD_POLICY_LASERKV;
    case K_BETA: return strcmp(c->budget, "pyramid") == 0;
    case K_DEBIAS: case K_LOCAL: return c->fair;
    case K_SCORER: return is_wrapper(c->kind);
    case K_PROFILE: case K_LAMBDA: case K_BASE: return compactor;
    case K_SHARED: return c->chunked;
    case K_ATTN_CHUNK: case K_SCALE: case K_VNORM: return compactor || noncausal;
    case K_POOL: return compactor || noncausal || s == PD_POLICY_SNAPKV || s == PD_POLICY_OBCACHE;
    case K_LEV_CHUNK: return compactor || leverage;
    case K_SKETCH: case K_RIDGE: return compactor || (leverage && !c->exact);
    case K_SEED: return compactor || (leverage && !c->exact) || s == PD_POLICY_RANDOM || laser;
    case K_MODE: return leverage;
    case K_WINDOW: return s == PD_POLICY_SNAPKV || s == PD_POLICY_OBCACHE || laser;
    case K_TARGET: return s == PD_POLICY_OBCACHE;
    case K_DIVISOR: case K_ALPHA: case K_ROUNDS: case K_BITS: case K_ACCUMULATE: return laser;
    }
    return false;
}

static const char *default_budget(int kind, int scorer, bool kvpress) {
    if (kind == PD_POLICY_PYRAMIDKV) return "pyramid";
    if (scorer == PD_POLICY_COMPACTOR && !kvpress) return "global";
    return "uniform";
}

static const char *default_text(const shape *c, int key) {
    bool compactor = c->scorer == PD_POLICY_COMPACTOR, kv = compactor && c->kvpress;
    switch (key) {
    case K_RETENTION: return "0.5";
    case K_SEED: return "1";
    case K_BUDGET: return default_budget(c->kind, c->scorer, c->kvpress);
    case K_BETA: return "20";
    case K_SINK: return compactor ? (kv ? "8" : "16") : c->scorer == PD_POLICY_STREAMING ? "4" : "0";
    case K_RECENT: return compactor ? (kv ? "4" : "64") : "0";
    case K_CHUNK: return c->kind == PD_POLICY_CHUNKKV ? "20" : "0";
    case K_REUSE: return "1";
    case K_FAIR: return "0";
    case K_DEBIAS: return "1";
    case K_LOCAL: return "1";
    case K_PROFILE: return "official"; /* the profile's own default; the others follow the chosen one */
    case K_LAMBDA: return kv ? "auto" : "0.5";
    case K_SKETCH: return "48";
    case K_LEV_CHUNK: return kv ? "0" : "512";
    case K_RIDGE: return kv ? "0.01" : "0.005";
    case K_ATTN_CHUNK: return kv ? "256" : "128";
    case K_SCALE: return "1";
    case K_VNORM: return kv ? "1" : "0";
    case K_MODE: return "approx";
    case K_WINDOW: return c->scorer == PD_POLICY_OBCACHE ? "0" : "64";
    case K_POOL: return kv ? "3" : c->scorer == PD_POLICY_SNAPKV ? "5" : c->scorer == PD_POLICY_OBCACHE ? "7" : "1";
    case K_TARGET: return "joint";
    case K_DIVISOR: return "4";
    case K_ALPHA: return "0.75";
    case K_ROUNDS: return "20";
    case K_BITS: return "12";
    case K_ACCUMULATE: return "1";
    case K_SHARED: return "1";
    case K_BASE: return kv ? "prompt" : "unprotected";
    case K_SCORER: return "snapkv";
    }
    return "?";
}

/* The canonical string the contract promises for shape c with the given
 * values (NULL = default), keys sorted by name. */
static void expected_canonical(const shape *c, char vals[NK][32], char *out, size_t cap) {
    size_t len = (size_t)snprintf(out, cap, "%s", policy_names[c->kind]);
    char sep = ':';
    for (int k = 0; k < NK; k++) {
        if (!uses(c, k)) continue;
        len += (size_t)snprintf(out + len, cap - len, "%c%s=%s", sep, key_names[k],
                                vals && vals[k][0] ? vals[k] : default_text(c, k));
        sep = ',';
    }
}

/* Shortest of %.15g..%.17g that reads back exactly (the format contract). */
static void shortest(double v, char *buf, size_t cap) {
    for (int p = 15; p <= 17; p++) {
        snprintf(buf, cap, "%.*g", p, v);
        if (strtod(buf, NULL) == v) return;
    }
}

static uint64_t rng_next(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}
static int64_t rng_int(uint64_t *s, int64_t lo, int64_t hi) { return lo + (int64_t)(rng_next(s) % (uint64_t)(hi - lo + 1)); }
static double rng_unit(uint64_t *s) { return (double)(rng_next(s) >> 11) / 9007199254740992.0; }

/* A random decimal text for a double, sometimes with full precision. */
static void rand_decimal(uint64_t *s, double lo, double hi, bool lo_open, char *buf, size_t cap) {
    for (;;) {
        double v;
        switch (rng_int(s, 0, 3)) {
        case 0: v = lo + (double)rng_int(s, 0, 1000) / 1000 * (hi - lo); break;
        case 1: v = lo + rng_unit(s) * (hi - lo); break;
        case 2: v = hi; break;
        default: v = lo + (double)rng_int(s, 0, 16) / 16 * (hi - lo); break;
        }
        if (lo_open && v <= lo) continue;
        snprintf(buf, cap, "%.17g", v);
        return;
    }
}

/* A random valid value text for key k in shape c. */
static void rand_value(uint64_t *s, const shape *c, int k, char *buf, size_t cap) {
    switch (k) {
    case K_RETENTION: rand_decimal(s, 0, 1, true, buf, cap); return;
    case K_BETA: rand_decimal(s, 1, 200, false, buf, cap); return;
    case K_DEBIAS: case K_ALPHA: rand_decimal(s, 0, 1, false, buf, cap); return;
    case K_RIDGE: rand_decimal(s, 0, 0.5, true, buf, cap); return;
    case K_SCALE: rand_decimal(s, 0, 4, false, buf, cap); return;
    case K_LAMBDA:
        if (rng_int(s, 0, 3) == 0) snprintf(buf, cap, "auto");
        else rand_decimal(s, 0, 3, false, buf, cap);
        return;
    case K_SEED: snprintf(buf, cap, "%" PRIu64, rng_int(s, 0, 2) == 0 ? UINT64_MAX : rng_next(s) >> rng_int(s, 0, 63)); return;
    case K_SINK: case K_RECENT: snprintf(buf, cap, "%d", (int)rng_int(s, 0, 200)); return;
    case K_CHUNK: snprintf(buf, cap, "%d", c->chunked ? (int)rng_int(s, 1, 64) : 0); return;
    case K_REUSE: snprintf(buf, cap, "%d", strcmp(c->budget, "pyramid") == 0 ? 1 : (int)rng_int(s, 1, 4)); return;
    case K_SKETCH: snprintf(buf, cap, "%d", (int)rng_int(s, 1, 1024)); return;
    case K_LEV_CHUNK: snprintf(buf, cap, "%d", rng_int(s, 0, 3) == 0 ? 0 : (int)rng_int(s, 2, 4096)); return;
    case K_ATTN_CHUNK: snprintf(buf, cap, "%d", (int)rng_int(s, 1, 512)); return;
    case K_POOL: snprintf(buf, cap, "%d", (int)rng_int(s, 0, 6) * 2 + 1); return;
    case K_WINDOW: snprintf(buf, cap, "%d", (int)rng_int(s, 0, 256)); return;
    case K_BASE: snprintf(buf, cap, "%s", rng_int(s, 0, 1) ? "prompt" : "unprotected"); return;
    case K_DIVISOR: snprintf(buf, cap, "%d", (int)rng_int(s, 2, 32)); return;
    case K_ROUNDS: snprintf(buf, cap, "%d", (int)rng_int(s, 1, 64)); return;
    case K_BITS: snprintf(buf, cap, "%d", (int)rng_int(s, 1, 32)); return;
    case K_VNORM: case K_LOCAL: case K_ACCUMULATE: case K_SHARED: snprintf(buf, cap, "%d", (int)rng_int(s, 0, 1)); return;
    case K_TARGET: {
        static const char *const t[] = {"value", "key", "joint"};
        snprintf(buf, cap, "%s", t[rng_int(s, 0, 2)]);
        return;
    }
    }
    cr_assert_fail("no random value for key %s", key_names[k]);
}

/* What the canonical string shows for a value text we generated. */
static void canonical_value(int k, const char *text, char *out, size_t cap) {
    bool dbl = k == K_RETENTION || k == K_BETA || k == K_DEBIAS || k == K_ALPHA || k == K_RIDGE || k == K_SCALE ||
               (k == K_LAMBDA && strcmp(text, "auto") != 0);
    if (dbl) {
        shortest(strtod(text, NULL) + 0.0, out, cap);
        return;
    }
    size_t len = strlen(text);
    cr_assert_lt(len, cap);
    memcpy(out, text, len + 1);
}

/* ------------------------------------------------------------------------
 * Spec: defaults and canonical strings
 * ------------------------------------------------------------------------ */

Test(spec, compactor_default_literal) {
    char buf[PD_POLICY_SPEC_MAX];
    pd_policy_spec s;
    pd_policy_spec_default(PD_POLICY_COMPACTOR, &s);
    print_spec(&s, buf);
    cr_assert_str_eq(buf, "compactor:attn_chunk=128,base=unprotected,budget=global,chunk=0,fair=0,lambda=0.5,lev_chunk=512,pool=1,"
                          "profile=official,recent=64,retention=0.5,reuse=1,ridge=0.005,scale=1,seed=1,sink=16,"
                          "sketch=48,vnorm=0");
    cr_assert_eq(s.kind, PD_POLICY_COMPACTOR);
    cr_assert_eq(s.scorer, PD_POLICY_COMPACTOR);
    cr_assert_eq(s.leverage, PD_LEVERAGE_APPROX);
    cr_assert_eq(s.profile, PD_PROFILE_OFFICIAL);
}

Test(spec, other_literals) {
    char buf[PD_POLICY_SPEC_MAX];
    canonical_of("snapkv", buf);
    cr_assert_str_eq(buf, "snapkv:budget=uniform,chunk=0,fair=0,pool=5,recent=0,retention=0.5,reuse=1,sink=0,window=64");
    canonical_of("compactor:profile=kvpress", buf);
    cr_assert_str_eq(buf, "compactor:attn_chunk=256,base=prompt,budget=uniform,chunk=0,fair=0,lambda=auto,lev_chunk=0,pool=3,"
                          "profile=kvpress,recent=4,retention=0.5,reuse=1,ridge=0.01,scale=1,seed=1,sink=8,"
                          "sketch=48,vnorm=1");
    canonical_of("laserkv", buf);
    cr_assert_str_eq(buf, "laserkv:accumulate=1,alpha=0.75,bits=12,budget=uniform,chunk=0,divisor=4,fair=0,"
                          "retention=0.5,reuse=1,rounds=20,seed=1,window=64");
    canonical_of("obcache", buf);
    cr_assert_str_eq(buf, "obcache:budget=uniform,chunk=0,fair=0,pool=7,recent=0,retention=0.5,reuse=1,sink=0,"
                          "target=joint,window=0");
    canonical_of("chunkkv", buf);
    cr_assert_str_eq(buf, "chunkkv:budget=uniform,chunk=20,fair=0,pool=5,recent=0,retention=0.5,reuse=1,"
                          "scorer=snapkv,shared=1,sink=0,window=64");
    canonical_of("chunkkv:shared=0", buf);
    cr_assert(contains(buf, ",shared=0,"), "%s", buf);
    canonical_of("knorm:chunk=0", buf);
    cr_assert(!contains(buf, "shared"), "shared exists only with chunks: %s", buf);
    canonical_of("pyramidkv", buf);
    cr_assert_str_eq(buf, "pyramidkv:beta=20,budget=pyramid,chunk=0,fair=0,pool=5,recent=0,retention=0.5,reuse=1,"
                          "scorer=snapkv,sink=0,window=64");
    canonical_of("knorm:fair=1,retention=0.1", buf);
    cr_assert_str_eq(buf, "knorm:budget=uniform,chunk=0,debias=1,fair=1,local=1,recent=0,retention=0.1,reuse=1,sink=0");
}

Test(spec, defaults_of_every_policy) {
    for (int k = 0; k < PD_POLICY_COUNT; k++) {
        pd_policy_spec s;
        pd_policy_spec_default((pd_policy_kind)k, &s);
        cr_assert_eq(pd_policy_spec_validate(&s, NULL), PD_OK, "%s defaults invalid", policy_names[k]);
        shape c = {k, is_wrapper(k) ? PD_POLICY_SNAPKV : k, false, default_budget(k, is_wrapper(k) ? PD_POLICY_SNAPKV : k, false),
                   false, false, k == PD_POLICY_CHUNKKV};
        char want[PD_POLICY_SPEC_MAX], got[PD_POLICY_SPEC_MAX], parsed[PD_POLICY_SPEC_MAX];
        expected_canonical(&c, NULL, want, sizeof want);
        print_spec(&s, got);
        cr_assert_str_eq(got, want, "defaults of %s", policy_names[k]);
        canonical_of(policy_names[k], parsed);
        cr_assert_str_eq(parsed, want, "parse of bare '%s'", policy_names[k]);
        /* Field-level checks of the documented defaults. */
        cr_assert_eq(s.retention, 0.5);
        cr_assert_eq(s.seed, 1);
        cr_assert_eq(s.reuse, 1);
        cr_assert_eq(s.fair, false);
        cr_assert_eq(s.kind, (pd_policy_kind)k);
        pd_policy_kind back;
        cr_assert(pd_policy_kind_from_name(policy_names[k], &back));
        cr_assert_eq(back, (pd_policy_kind)k);
        cr_assert_str_eq(pd_policy_kind_name((pd_policy_kind)k), policy_names[k]);
    }
    pd_policy_kind dummy;
    cr_assert_not(pd_policy_kind_from_name("Compactor", &dummy));
    cr_assert_not(pd_policy_kind_from_name("", &dummy));
}

Test(spec, field_values) {
    pd_policy_spec s;
    pd_error err = {0};
    cr_assert_eq(pd_policy_spec_parse("compactor:lambda=auto,retention=0.1,seed=18446744073709551615", &s, &err),
                 PD_OK, "%s", err.msg);
    cr_assert_lt(s.lambda, 0);
    cr_assert_eq(s.retention, 0.1);
    cr_assert_eq(s.seed, UINT64_MAX);
    cr_assert_eq(pd_policy_spec_parse("leverage:mode=exact", &s, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(s.leverage, PD_LEVERAGE_EXACT);
    cr_assert_eq(pd_policy_spec_parse("obcache:target=key", &s, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(s.target, PD_OBCACHE_KEY);
    cr_assert_eq(pd_policy_spec_parse("chunkkv:scorer=h2o", &s, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(s.kind, PD_POLICY_CHUNKKV);
    cr_assert_eq(s.scorer, PD_POLICY_H2O);
    cr_assert_eq(s.chunk, 20);
    cr_assert_eq(pd_policy_spec_parse("knorm:scale=-0", &s, &err), PD_EINVAL); /* knorm has no scale */
    cr_assert_eq(pd_policy_spec_parse("noncausal:scale=-0", &s, &err), PD_OK, "%s", err.msg);
    char buf[PD_POLICY_SPEC_MAX];
    print_spec(&s, buf);
    cr_assert(contains(buf, ",scale=0,"), "%s", buf);
    /* Whitespace around names and values is tolerated; the canonical form has none. */
    canonical_of(" knorm : sink = 3 , retention=0.25 ", buf);
    cr_assert(contains(buf, "knorm:budget=uniform,") && contains(buf, ",sink=3") && contains(buf, "retention=0.25"),
              "%s", buf);
    cr_assert_eq(pd_policy_spec_parse("knorm:fair=true", &s, &err), PD_OK, "%s", err.msg);
    cr_assert(s.fair);
}

Test(spec, set_retention) {
    pd_policy_spec s, before;
    pd_policy_spec_default(PD_POLICY_SNAPKV, &s);
    before = s;
    pd_policy_spec_set_retention(&s, 0.125);
    cr_assert_eq(s.retention, 0.125);
    char a[PD_POLICY_SPEC_MAX], b[PD_POLICY_SPEC_MAX];
    print_spec(&s, a);
    before.retention = 0.125;
    print_spec(&before, b);
    cr_assert_str_eq(a, b);
}

/* Fair eviction scores each span with SnapKV's window split across the
 * spans (the fair-eviction paper), other scorers and keys unchanged. */
Test(spec, a_span_of_a_fair_selection_gets_its_share_of_the_window) {
    pd_policy_spec s, span;
    pd_error err = {0};
    cr_assert_eq(pd_policy_spec_parse("snapkv:fair=1", &s, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(s.window, 64);
    pd_policy_spec_for_span(&s, 4, &span);
    cr_assert_eq(span.window, 16, "64 / 4 spans");
    cr_assert_eq(span.pool, s.pool);
    cr_assert_eq(span.retention, s.retention);
    pd_policy_spec_for_span(&s, 1, &span);
    cr_assert_eq(span.window, 64, "one span: the whole window");
    pd_policy_spec_for_span(&s, 100, &span);
    cr_assert_eq(span.window, 1, "never below 1");
    cr_assert_eq(pd_policy_spec_parse("pyramidkv:fair=1", &s, &err), PD_OK, "%s", err.msg);
    pd_policy_spec_for_span(&s, 4, &span);
    cr_assert_eq(span.window, s.window / 4, "pyramidkv scores with snapkv");
    cr_assert_eq(pd_policy_spec_parse("tova:fair=1", &s, &err), PD_OK, "%s", err.msg);
    pd_policy_spec_for_span(&s, 4, &span);
    cr_assert_eq(memcmp(&span, &s, sizeof s), 0, "other scorers keep their spec");
}

Test(spec, print_truncates_like_snprintf) {
    pd_policy_spec s;
    pd_policy_spec_default(PD_POLICY_COMPACTOR, &s);
    char full[PD_POLICY_SPEC_MAX], small[16];
    size_t len = pd_policy_spec_print(&s, full, sizeof full);
    memset(small, 'x', sizeof small);
    cr_assert_eq(pd_policy_spec_print(&s, small, sizeof small), len);
    cr_assert_eq(small[15], '\0');
    cr_assert_eq(strncmp(small, full, 15), 0);
    cr_assert_eq(pd_policy_spec_print(&s, NULL, 0), len);
}

/* ------------------------------------------------------------------------
 * Spec: order independence, profile and scorer first, random round trips
 * ------------------------------------------------------------------------ */

Test(spec, key_order_independent) {
    char a[PD_POLICY_SPEC_MAX], b[PD_POLICY_SPEC_MAX], c[PD_POLICY_SPEC_MAX];
    canonical_of("compactor:retention=0.25,sketch=32,budget=pyramid,beta=4,fair=1,debias=0.5", a);
    canonical_of("compactor:debias=0.5,fair=1,beta=4,budget=pyramid,sketch=32,retention=0.25", b);
    cr_assert_str_eq(a, b);
    canonical_of(a, c);
    cr_assert_str_eq(a, c);
    cr_assert(contains(a, "beta=4,budget=pyramid"), "%s", a);
    cr_assert(contains(a, "debias=0.5,fair=1,lambda=0.5"), "%s", a);
}

Test(spec, profile_and_scorer_first) {
    char a[PD_POLICY_SPEC_MAX], b[PD_POLICY_SPEC_MAX];
    /* Explicit keys override the profile's defaults wherever they stand. */
    canonical_of("compactor:sink=3,pool=5,profile=kvpress", a);
    canonical_of("compactor:profile=kvpress,pool=5,sink=3", b);
    cr_assert_str_eq(a, b);
    cr_assert(contains(a, ",sink=3,") && contains(a, "pool=5,") && contains(a, "lambda=auto") &&
              contains(a, "attn_chunk=256") && contains(a, "recent=4,"), "%s", a);
    /* scorer decides which keys exist: window and target come from obcache. */
    canonical_of("pyramidkv:target=key,window=32,scorer=obcache", a);
    cr_assert_str_eq(a, "pyramidkv:beta=20,budget=pyramid,chunk=0,fair=0,pool=7,recent=0,retention=0.5,reuse=1,"
                        "scorer=obcache,sink=0,target=key,window=32");
    /* A wrapped compactor keeps its wrapper's budget but the profile's keys. */
    canonical_of("pyramidkv:profile=kvpress,scorer=compactor", a);
    cr_assert(contains(a, "budget=pyramid") && contains(a, "profile=kvpress") && contains(a, "sink=8"), "%s", a);
    canonical_of("chunkkv:scorer=streaming", a);
    cr_assert(contains(a, "chunk=20") && contains(a, "sink=4") && contains(a, "scorer=streaming"), "%s", a);
}

static void random_shape(uint64_t *rng, shape *c) {
    static const char *const budgets[] = {"uniform", "pyramid", "global"};
    c->kind = (int)rng_int(rng, 0, PD_POLICY_COUNT - 1);
    c->scorer = c->kind;
    if (is_wrapper(c->kind)) {
        static const int wrappable[] = {PD_POLICY_COMPACTOR, PD_POLICY_LEVERAGE, PD_POLICY_NONCAUSAL, PD_POLICY_RANDOM,
                                        PD_POLICY_KNORM, PD_POLICY_STREAMING, PD_POLICY_SNAPKV, PD_POLICY_H2O,
                                        PD_POLICY_TOVA, PD_POLICY_OBCACHE};
        c->scorer = wrappable[rng_int(rng, 0, 9)];
    }
    c->kvpress = c->scorer == PD_POLICY_COMPACTOR && rng_int(rng, 0, 1);
    c->budget = budgets[rng_int(rng, 0, 2)];
    c->fair = rng_int(rng, 0, 1);
    c->exact = c->scorer == PD_POLICY_LEVERAGE && rng_int(rng, 0, 1);
    c->chunked = c->kind != PD_POLICY_LASERKV && (c->kind == PD_POLICY_CHUNKKV ? rng_int(rng, 0, 3) != 0 : rng_int(rng, 0, 1));
}

Test(spec, random_specs_round_trip) {
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    for (int iter = 0; iter < 2000; iter++) {
        shape c;
        random_shape(&rng, &c);
        /* Values for every key the shape has; each given with probability
         * 2/3, the ones that decide the shape always when not default. */
        char vals[NK][32], want_vals[NK][32];
        int order[NK], n_given = 0;
        for (int k = 0; k < NK; k++) {
            vals[k][0] = want_vals[k][0] = '\0';
            if (!uses(&c, k)) continue;
            switch (k) {
            case K_SCORER: snprintf(vals[k], 32, "%s", policy_names[c.scorer]); break;
            case K_PROFILE: snprintf(vals[k], 32, "%s", c.kvpress ? "kvpress" : "official"); break;
            case K_BUDGET: snprintf(vals[k], 32, "%s", c.budget); break;
            case K_FAIR: snprintf(vals[k], 32, "%d", c.fair); break;
            case K_MODE: snprintf(vals[k], 32, "%s", c.exact ? "exact" : "approx"); break;
            case K_CHUNK: rand_value(&rng, &c, k, vals[k], 32); break;
            default: rand_value(&rng, &c, k, vals[k], 32); break;
            }
            canonical_value(k, vals[k], want_vals[k], 32);
            bool is_default = strcmp(want_vals[k], default_text(&c, k)) == 0;
            bool decides = k == K_SCORER || k == K_PROFILE || k == K_BUDGET || k == K_FAIR || k == K_MODE || k == K_CHUNK;
            if ((decides && !is_default) || rng_int(&rng, 0, 2) != 0) order[n_given++] = k;
            else snprintf(want_vals[k], 32, "%s", default_text(&c, k));
        }
        /* A pyramid budget forbids reuse > 1 even when reuse comes from a default. */
        for (int i = n_given - 1; i > 0; i--) {
            int j = (int)rng_int(&rng, 0, i), t = order[i];
            order[i] = order[j];
            order[j] = t;
        }
        char text[1024];
        size_t len = (size_t)snprintf(text, sizeof text, "%s", policy_names[c.kind]);
        for (int i = 0; i < n_given; i++)
            len += (size_t)snprintf(text + len, sizeof text - len, "%c%s=%s", i ? ',' : ':', key_names[order[i]],
                                    vals[order[i]]);
        char want[PD_POLICY_SPEC_MAX], got[PD_POLICY_SPEC_MAX];
        expected_canonical(&c, want_vals, want, sizeof want);
        canonical_of(text, got);
        cr_assert_str_eq(got, want, "iteration %d: '%s'\n got %s\nwant %s", iter, text, got, want);
    }
}

/* ------------------------------------------------------------------------
 * Spec: errors
 * ------------------------------------------------------------------------ */

/* Parse must fail with PD_EINVAL, leave *out alone and mention every needle. */
static void expect_spec_error(const char *text, ...) {
    pd_policy_spec s, before;
    pd_policy_spec_default(PD_POLICY_TOVA, &s);
    before = s;
    pd_error err = {0};
    int rc = pd_policy_spec_parse(text, &s, &err);
    cr_assert_eq(rc, PD_EINVAL, "'%s' gave %d (%s)", text, rc, err.msg);
    cr_assert_eq(err.code, PD_EINVAL);
    cr_assert_eq(memcmp(&s, &before, sizeof s), 0, "a failed parse of '%s' changed the spec", text);
    va_list ap;
    va_start(ap, text);
    for (const char *needle; (needle = va_arg(ap, const char *));)
        cr_assert(contains(err.msg, needle), "'%s': message '%s' lacks '%s'", text, err.msg, needle);
    va_end(ap);
}

Test(spec, errors_name_the_problem) {
    expect_spec_error("foo", "unknown policy 'foo'", "compactor", "leverage", "tova", "laserkv", NULL);
    expect_spec_error("", "unknown policy", "compactor", NULL);
    expect_spec_error("foo:retention=0.5", "unknown policy 'foo'", NULL);
    expect_spec_error("knorm:bogus=1", "unknown key 'bogus'", "retention", "sink", NULL);
    expect_spec_error("knorm:sketch=4", "'knorm'", "no key 'sketch'", "retention", NULL);
    expect_spec_error("laserkv:sink=4", "no key 'sink'", "divisor", NULL);
    expect_spec_error("knorm:profile=kvpress", "no key 'profile'", NULL);
    expect_spec_error("pyramidkv:profile=kvpress", "no key 'profile'", "scorer 'snapkv'", NULL);
    expect_spec_error("snapkv:scorer=h2o", "no key 'scorer'", NULL);
    expect_spec_error("knorm:beta=2", "'beta'", "budget=pyramid", "budget is uniform", NULL);
    expect_spec_error("knorm:debias=0.5", "'debias'", "fair=1", NULL);
    expect_spec_error("knorm:local=0,fair=0", "'local'", "fair=1", NULL);
    expect_spec_error("leverage:seed=3,mode=exact", "'seed'", "mode=approx", NULL);
    expect_spec_error("leverage:mode=exact,sketch=3", "'sketch'", "mode=approx", NULL);
    expect_spec_error("knorm:retention=0.5,retention=0.4", "'retention'", "twice", NULL);
    expect_spec_error("knorm:retention=abc", "'retention'", "'abc'", "not a number", "(0, 1]", NULL);
    expect_spec_error("knorm:retention=nan", "'retention'", "not a number", NULL);
    expect_spec_error("knorm:retention=inf", "'retention'", "not a number", NULL);
    expect_spec_error("knorm:retention=0x1p-1", "'retention'", "not a number", NULL);
    expect_spec_error("knorm:retention=1e999", "'retention'", "out of range", NULL);
    expect_spec_error("knorm:sink=1.5", "'sink'", "not an integer", NULL);
    expect_spec_error("knorm:sink=0x10", "'sink'", "not an integer", NULL);
    expect_spec_error("knorm:sink=-1", "'sink'", "out of range", ">= 0", NULL);
    expect_spec_error("knorm:sink=99999999999999999999", "'sink'", "out of range", NULL);
    expect_spec_error("knorm:sink=2147483648", "'sink'", "out of range", NULL);
    expect_spec_error("knorm:retention=0", "'retention'", "out of range", "(0, 1]", NULL);
    expect_spec_error("knorm:retention=1.5", "'retention'", "out of range", NULL);
    expect_spec_error("compactor:sketch=2000", "'sketch'", "1..1024", NULL);
    expect_spec_error("compactor:sketch=0", "'sketch'", "1..1024", NULL);
    expect_spec_error("compactor:pool=2", "'pool'", "odd", NULL);
    expect_spec_error("compactor:lev_chunk=1", "'lev_chunk'", ">= 2", NULL);
    expect_spec_error("compactor:lambda=-1", "'lambda'", "auto", NULL);
    expect_spec_error("compactor:ridge=0", "'ridge'", "> 0", NULL);
    expect_spec_error("random:seed=-1", "'seed'", NULL);
    expect_spec_error("random:seed=18446744073709551616", "'seed'", "out of range", NULL);
    expect_spec_error("laserkv:rounds=65", "'rounds'", "1..64", NULL);
    expect_spec_error("laserkv:divisor=1", "'divisor'", ">= 2", NULL);
    expect_spec_error("laserkv:alpha=1.01", "'alpha'", "[0, 1]", NULL);
    expect_spec_error("knorm:fair=2", "'fair'", "0 or 1", NULL);
    expect_spec_error("knorm:budget=foo", "'budget'", "'foo'", "uniform, pyramid or global", NULL);
    expect_spec_error("obcache:target=both", "'target'", "value, key or joint", NULL);
    expect_spec_error("leverage:mode=fast", "'mode'", "approx or exact", NULL);
    expect_spec_error("compactor:profile=paper", "'profile'", "official or kvpress", NULL);
    expect_spec_error("pyramidkv:scorer=laserkv", "'scorer'", "obcache", NULL);
    expect_spec_error("chunkkv:scorer=pyramidkv", "'scorer'", "snapkv", NULL);
    expect_spec_error("pyramidkv:scorer=nope", "'scorer'", "'nope'", NULL);
    expect_spec_error("knorm:retention=", "'retention'", "empty value", NULL);
    expect_spec_error("knorm:retention=0.5,", "after key 'retention'", "comma", NULL);
    expect_spec_error("knorm:retention=0.5,,sink=1", "after key 'retention'", NULL);
    expect_spec_error("knorm:", "empty entry", NULL);
    expect_spec_error("knorm:retention", "'retention'", "no value", NULL);
    expect_spec_error("knorm:=5", "no key name", NULL);
    expect_spec_error("knorm:reuse=2,budget=pyramid", "'reuse'", "pyramid", NULL);
    expect_spec_error("pyramidkv:reuse=2", "'reuse'", "pyramid", NULL);
    expect_spec_error("laserkv:chunk=4", "'chunk'", "laserkv", NULL);
}

Test(spec, validate_checks_structs) {
    pd_policy_spec s;
    pd_error err = {0};
    pd_policy_spec_default(PD_POLICY_COMPACTOR, &s);
    s.sketch = 0;
    cr_assert_eq(pd_policy_spec_validate(&s, &err), PD_EINVAL);
    cr_assert(contains(err.msg, "sketch"), "%s", err.msg);
    pd_policy_spec_default(PD_POLICY_KNORM, &s);
    s.sketch = 0; /* not a knorm key: ignored */
    cr_assert_eq(pd_policy_spec_validate(&s, &err), PD_OK, "%s", err.msg);
    s.retention = 0;
    cr_assert_eq(pd_policy_spec_validate(&s, &err), PD_EINVAL);
    cr_assert(contains(err.msg, "retention"), "%s", err.msg);
    pd_policy_spec_default(PD_POLICY_SNAPKV, &s);
    s.budget = PD_BUDGET_PYRAMID;
    s.reuse = 2;
    cr_assert_eq(pd_policy_spec_validate(&s, &err), PD_EINVAL);
    cr_assert(contains(err.msg, "reuse"), "%s", err.msg);
    pd_policy_spec_default(PD_POLICY_LASERKV, &s);
    s.chunk = 8;
    cr_assert_eq(pd_policy_spec_validate(&s, &err), PD_EINVAL);
    cr_assert(contains(err.msg, "chunk"), "%s", err.msg);
    pd_policy_spec_default(PD_POLICY_PYRAMIDKV, &s);
    s.scorer = PD_POLICY_CHUNKKV;
    cr_assert_eq(pd_policy_spec_validate(&s, &err), PD_EINVAL);
    cr_assert(contains(err.msg, "scorer"), "%s", err.msg);
    pd_policy_spec_default(PD_POLICY_H2O, &s);
    s.scorer = PD_POLICY_TOVA;
    cr_assert_eq(pd_policy_spec_validate(&s, &err), PD_EINVAL);
    cr_assert(contains(err.msg, "scorer"), "%s", err.msg);
    pd_policy_spec_default(PD_POLICY_OBCACHE, &s);
    s.target = (pd_obcache_target)7;
    cr_assert_eq(pd_policy_spec_validate(&s, &err), PD_EINVAL);
    cr_assert(contains(err.msg, "target"), "%s", err.msg);
    pd_policy_spec_default(PD_POLICY_COMPACTOR, &s);
    s.lambda = NAN;
    cr_assert_eq(pd_policy_spec_validate(&s, &err), PD_EINVAL);
    cr_assert(contains(err.msg, "lambda"), "%s", err.msg);
}

Test(spec, describe_lists_every_policy) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    cr_assert_not_null(f);
    pd_policy_describe(f);
    cr_assert_eq(fclose(f), 0);
    int lines = 0;
    for (char *line = text, *nl; *line; line = nl + 1) {
        nl = strchr(line, '\n');
        cr_assert_not_null(nl, "describe output must end lines with newlines");
        cr_assert_lt(lines, PD_POLICY_COUNT, "more lines than policies");
        size_t name_len = strlen(policy_names[lines]);
        cr_assert(strncmp(line, policy_names[lines], name_len) == 0 && line[name_len] == ':',
                  "line %d does not start with '%s:'", lines, policy_names[lines]);
        *nl = '\0';
        cr_assert(contains(line, " retention=0.5"), "line of %s: %s", policy_names[lines], line);
        if (lines == PD_POLICY_PYRAMIDKV) cr_assert(contains(line, " scorer=snapkv"), "%s", line);
        if (lines == PD_POLICY_COMPACTOR) cr_assert(contains(line, " sink=16") && contains(line, "kvpress"), "%s", line);
        if (lines == PD_POLICY_KNORM) cr_assert(contains(line, "beta=20") && contains(line, "debias=1"), "%s", line);
        lines++;
    }
    cr_assert_eq(lines, PD_POLICY_COUNT);
    free(text);
}

/* ------------------------------------------------------------------------
 * Layouts
 * ------------------------------------------------------------------------ */

static void layout_text(const pd_layout *l, char *buf, size_t cap) {
    size_t len = pd_layout_print(l, buf, cap);
    cr_assert_lt(len, cap);
}

Test(layout, canonical_round_trip) {
    const char *text = "spans=defense:0-120,directive:120-200!,docs:200-400;keep=5-9";
    pd_layout l;
    pd_error err = {0};
    cr_assert_eq(pd_layout_parse(text, &l, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(l.n_spans, 3);
    cr_assert_eq(l.n_whitelist, 1);
    cr_assert_str_eq(l.spans[1].name, "directive");
    cr_assert_eq(l.spans[1].start, 120);
    cr_assert_eq(l.spans[1].end, 200);
    cr_assert(l.spans[1].whitelist);
    cr_assert_not(l.spans[0].whitelist);
    cr_assert_eq(l.whitelist[0].start, 5);
    cr_assert_eq(l.whitelist[0].end, 9);
    cr_assert_eq(pd_layout_validate(&l, 400, &err), PD_OK, "%s", err.msg);
    char buf[256];
    layout_text(&l, buf, sizeof buf);
    cr_assert_str_eq(buf, text);
    pd_layout_free(&l);
    cr_assert_null(l.spans);

    cr_assert_eq(pd_layout_parse("keep=1-3,7-9", &l, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(l.n_spans, 0);
    cr_assert_eq(l.n_whitelist, 2);
    layout_text(&l, buf, sizeof buf);
    cr_assert_str_eq(buf, "keep=1-3,7-9");
    pd_layout_free(&l);

    cr_assert_eq(pd_layout_parse("  spans=a.b-c_D9:0-4\n", &l, &err), PD_OK, "%s", err.msg);
    layout_text(&l, buf, sizeof buf);
    cr_assert_str_eq(buf, "spans=a.b-c_D9:0-4");
    pd_layout_free(&l);

    cr_assert_eq(pd_layout_parse("", &l, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(l.n_spans + l.n_whitelist, 0);
    layout_text(&l, buf, sizeof buf);
    cr_assert_str_eq(buf, "");
    cr_assert_eq(pd_layout_validate(&l, 10, &err), PD_OK);
    pd_layout_free(&l);
    cr_assert_eq(pd_layout_print(NULL, buf, sizeof buf), 0);
    cr_assert_eq(pd_layout_validate(NULL, 10, &err), PD_OK);
}

Test(layout, file_format) {
    const char *file = "# spans of the prompt\n"
                       "system 0 10 keep\n"
                       "\n"
                       "  user   10 25   # the question\n"
                       "keep 12 14\n"
                       "docs 25 40\n"
                       "keep 30 31";
    pd_layout l;
    pd_error err = {0};
    cr_assert_eq(pd_layout_parse(file, &l, &err), PD_OK, "%s", err.msg);
    char buf[256];
    layout_text(&l, buf, sizeof buf);
    cr_assert_str_eq(buf, "spans=system:0-10!,user:10-25,docs:25-40;keep=12-14,30-31");
    cr_assert_eq(pd_layout_validate(&l, 40, &err), PD_OK, "%s", err.msg);
    pd_layout back;
    cr_assert_eq(pd_layout_parse(buf, &back, &err), PD_OK, "%s", err.msg);
    char buf2[256];
    layout_text(&back, buf2, sizeof buf2);
    cr_assert_str_eq(buf2, buf);
    pd_layout_free(&back);
    pd_layout_free(&l);

    cr_assert_eq(pd_layout_parse("# only a comment\n\n", &l, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(l.n_spans + l.n_whitelist, 0);
    pd_layout_free(&l);
}

Test(layout, random_round_trips) {
    uint64_t rng = 12345;
    for (int iter = 0; iter < 300; iter++) {
        int ns = (int)rng_int(&rng, 0, 6), nr = (int)rng_int(&rng, 0, 4);
        pd_span spans[6];
        pd_range ranges[4];
        int64_t pos = 0;
        for (int i = 0; i < ns; i++) {
            memset(&spans[i], 0, sizeof spans[i]);
            int name_len = (int)rng_int(&rng, 1, 31);
            for (int j = 0; j < name_len; j++) {
                static const char cs[] = "abcXYZ019_.-";
                spans[i].name[j] = cs[rng_int(&rng, 0, (int64_t)sizeof cs - 2)];
            }
            spans[i].start = pos;
            pos += rng_int(&rng, 1, 1000);
            spans[i].end = pos;
            spans[i].whitelist = rng_int(&rng, 0, 3) == 0;
        }
        int64_t n = ns ? pos : rng_int(&rng, 10, 3000);
        for (int i = 0; i < nr; i++) {
            ranges[i].start = rng_int(&rng, 0, n - 1);
            ranges[i].end = rng_int(&rng, ranges[i].start + 1, n);
        }
        pd_layout l = {spans, ns, ranges, nr};
        pd_error err = {0};
        cr_assert_eq(pd_layout_validate(&l, n, &err), PD_OK, "%s", err.msg);
        char canon[4096], file[4096], again[4096];
        layout_text(&l, canon, sizeof canon);
        /* The same layout in the file format, items interleaved. */
        size_t len = 0;
        file[0] = '\0';
        for (int i = 0; i < ns || i < nr; i++) {
            if (i < ns)
                len += (size_t)snprintf(file + len, sizeof file - len, "%s %" PRId64 " %" PRId64 "%s\n", spans[i].name,
                                        spans[i].start, spans[i].end, spans[i].whitelist ? " keep" : "");
            if (i < nr)
                len += (size_t)snprintf(file + len, sizeof file - len, "keep\t%" PRId64 " %" PRId64 " # r%d\n",
                                        ranges[i].start, ranges[i].end, i);
        }
        for (int form = 0; form < 2; form++) {
            pd_layout back;
            cr_assert_eq(pd_layout_parse(form ? file : canon, &back, &err), PD_OK, "%s\n%s", err.msg,
                         form ? file : canon);
            cr_assert_eq(back.n_spans, ns, "%s", form ? file : canon);
            cr_assert_eq(back.n_whitelist, nr);
            for (int i = 0; i < ns; i++) {
                cr_assert_str_eq(back.spans[i].name, spans[i].name);
                cr_assert_eq(back.spans[i].start, spans[i].start);
                cr_assert_eq(back.spans[i].end, spans[i].end);
                cr_assert_eq(back.spans[i].whitelist, spans[i].whitelist);
            }
            for (int i = 0; i < nr; i++) {
                cr_assert_eq(back.whitelist[i].start, ranges[i].start);
                cr_assert_eq(back.whitelist[i].end, ranges[i].end);
            }
            layout_text(&back, again, sizeof again);
            cr_assert_str_eq(again, canon);
            pd_layout_free(&back);
        }
    }
}

static void expect_validate_error(const pd_layout *l, int64_t n, const char *needle1, const char *needle2) {
    pd_error err = {0};
    cr_assert_eq(pd_layout_validate(l, n, &err), PD_EINVAL);
    cr_assert(contains(err.msg, needle1), "message '%s' lacks '%s'", err.msg, needle1);
    if (needle2) cr_assert(contains(err.msg, needle2), "message '%s' lacks '%s'", err.msg, needle2);
}

Test(layout, validation_errors) {
    pd_span s[3] = {{"a", 0, 10, false}, {"b", 10, 20, false}, {"c", 20, 30, false}};
    pd_layout l = {s, 3, NULL, 0};
    cr_assert_eq(pd_layout_validate(&l, 30, NULL), PD_OK);
    expect_validate_error(&l, 31, "'c'", "31");  /* does not cover the end */
    expect_validate_error(&l, 25, "'c'", "25");  /* past the end */
    s[1].start = 11;                              /* gap */
    expect_validate_error(&l, 30, "'b'", "10");
    s[1].start = 9;                               /* overlap */
    expect_validate_error(&l, 30, "'b'", "start");
    s[1].start = 10;
    s[0].start = 1;                               /* does not start at 0 */
    expect_validate_error(&l, 30, "'a'", "0");
    s[0].start = 0;
    s[1].end = 10;                                /* empty */
    s[2].start = 10;
    expect_validate_error(&l, 30, "'b'", "empty");
    s[1].end = 20;
    s[2].start = 20;
    memcpy(s[2].name, "bad name", 9);
    expect_validate_error(&l, 30, "span 2", "name");
    memcpy(s[2].name, "c", 2);
    pd_range r[2] = {{5, 8}, {28, 31}};
    pd_layout lr = {s, 3, r, 2};
    expect_validate_error(&lr, 30, "range 1", "28-31");
    r[1] = (pd_range){7, 7};
    expect_validate_error(&lr, 30, "range 1", "non-empty");
    r[1] = (pd_range){-1, 3};
    expect_validate_error(&lr, 30, "range 1", NULL);
    r[1] = (pd_range){3, 30};
    cr_assert_eq(pd_layout_validate(&lr, 30, NULL), PD_OK);
    pd_layout only_ranges = {NULL, 0, r, 2};
    cr_assert_eq(pd_layout_validate(&only_ranges, 30, NULL), PD_OK);
    expect_validate_error(&only_ranges, 20, "range 1", NULL);
}

static void expect_parse_error(const char *text, const char *needle1, const char *needle2) {
    pd_layout l;
    pd_error err = {0};
    cr_assert_eq(pd_layout_parse(text, &l, &err), PD_EINVAL, "'%s' parsed", text);
    cr_assert_null(l.spans);
    cr_assert_null(l.whitelist);
    cr_assert(contains(err.msg, needle1), "'%s': message '%s' lacks '%s'", text, err.msg, needle1);
    if (needle2) cr_assert(contains(err.msg, needle2), "'%s': message '%s' lacks '%s'", text, err.msg, needle2);
}

Test(layout, parse_errors) {
    expect_parse_error("spans=a:0-5,", "empty span item 1", NULL);
    expect_parse_error("spans=a:0-5,b5-9", "'b5-9'", "NAME:START-END");
    expect_parse_error("spans=a:0-x", "span 'a'", "START-END");
    expect_parse_error("spans=a:5-5", "span 'a'", "empty");
    expect_parse_error("spans=:0-5", "span item 0", "name");
    expect_parse_error("spans=abcdefghijabcdefghijabcdefghijab:0-5", "span item 0", "31");
    expect_parse_error("spans=a b:0-5", "span item 0", NULL);
    expect_parse_error("spans=a:0-5;keep=", "empty keep item 0", NULL);
    expect_parse_error("spans=a:0-5;keep=3", "kept range 0", "START-END");
    expect_parse_error("keep=1-2;spans=a:0-5", "spans=", "order");
    expect_parse_error("spans=a:0-5;spans=b:5-6", "spans=", NULL);
    expect_parse_error("spans=a:-1-5", "span 'a'", NULL);
    expect_parse_error("a 0 5\nb 5\n", "line 2", "NAME START END");
    expect_parse_error("a 0 5\nb 5 x\n", "line 2", "token positions");
    expect_parse_error("a 0 5\n\n# c\nb 7 6\n", "line 4", "empty or reversed");
    expect_parse_error("a 0 5 always\n", "line 1", "keep");
    expect_parse_error("keep 1 2 3\n", "line 1", NULL);
    expect_parse_error("bad/name 0 5\n", "line 1", "'bad/name'");
}

/* The store key: the canonical spec, then '|' and the layout when there is one. */
Test(layout, key_is_spec_then_layout) {
    pd_policy_spec s;
    pd_error err = {0};
    cr_assert_eq(pd_policy_spec_parse("knorm:retention=0.25", &s, &err), PD_OK, "%s", err.msg);
    char spec[PD_POLICY_SPEC_MAX], key[PD_POLICY_SPEC_MAX + 128], lay_text[128];
    pd_policy_spec_print(&s, spec, sizeof spec);
    cr_assert_eq(pd_policy_key_print(&s, NULL, key, sizeof key), strlen(spec));
    cr_assert_str_eq(key, spec);
    const pd_layout empty = {0};
    cr_assert_eq(pd_policy_key_print(&s, &empty, key, sizeof key), strlen(spec));
    cr_assert_str_eq(key, spec);
    const pd_span spans[2] = {{.name = "sys", .start = 0, .end = 4, .whitelist = true}, {.name = "doc", .start = 4, .end = 9}};
    const pd_layout lay = {.spans = spans, .n_spans = 2};
    pd_layout_print(&lay, lay_text, sizeof lay_text);
    char want[PD_POLICY_SPEC_MAX + 128];
    snprintf(want, sizeof want, "%s|%s", spec, lay_text);
    cr_assert_eq(pd_policy_key_print(&s, &lay, key, sizeof key), strlen(want));
    cr_assert_str_eq(key, want);
    /* Too small: the full length is still reported and the text is cut, terminated. */
    char small[8];
    cr_assert_eq(pd_policy_key_print(&s, &lay, small, sizeof small), strlen(want));
    cr_assert_eq(strlen(small), sizeof small - 1);
    cr_assert_eq(strncmp(small, want, sizeof small - 1), 0);
}
