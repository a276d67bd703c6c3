/* Policy spec strings: one table row per key (name, type, field, accepted
 * range, which policies use it, the setting it depends on). Parsing,
 * validation, printing and --help all walk the table, so a new key is a
 * table row plus a struct field. The canonical string is part of the prefix
 * cache key: it must name every setting that changes the result, and
 * nothing else. */
#include <assert.h>
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "policies/policies.h"

/* Enum fields are read and written through an int (with memcpy). */
static_assert(sizeof(pd_policy_kind) == sizeof(int), "pd_policy_kind must be int-sized");
static_assert(sizeof(pd_budget_mode) == sizeof(int), "pd_budget_mode must be int-sized");
static_assert(sizeof(pd_compactor_profile) == sizeof(int), "pd_compactor_profile must be int-sized");
static_assert(sizeof(pd_leverage_mode) == sizeof(int), "pd_leverage_mode must be int-sized");
static_assert(sizeof(pd_obcache_target) == sizeof(int), "pd_obcache_target must be int-sized");
static_assert(sizeof(pd_budget_base) == sizeof(int), "pd_budget_base must be int-sized");
static_assert(PD_POLICY_COUNT <= 32, "policy sets are 32-bit masks");

/* How much of a user-supplied name or value to repeat back in a message. */
#define ECHO_MAX 40

static const char *const kind_names[PD_POLICY_COUNT + 1] = {
    "compactor", "leverage", "noncausal", "random", "knorm", "streaming", "snapkv",
    "h2o", "tova", "pyramidkv", "chunkkv", "obcache", "laserkv", NULL,
};
static const char *const budget_names[] = {"uniform", "pyramid", "global", NULL};
static const char *const profile_names[] = {"official", "kvpress", NULL};
static const char *const mode_names[] = {"approx", "exact", NULL};
static const char *const target_names[] = {"value", "key", "joint", NULL};
static const char *const base_names[] = {"prompt", "unprotected", NULL};

#define BIT(k) (1u << (unsigned)(k))
#define ALL_KINDS (BIT(PD_POLICY_COUNT) - 1u)
/* What pyramidkv and chunkkv may wrap: any single scorer, not another wrapper,
 * and not laserkv (two criteria and its own protection rules). */
#define WRAPPABLE (ALL_KINDS & ~(BIT(PD_POLICY_PYRAMIDKV) | BIT(PD_POLICY_CHUNKKV) | BIT(PD_POLICY_LASERKV)))
#define WRAPPERS (BIT(PD_POLICY_PYRAMIDKV) | BIT(PD_POLICY_CHUNKKV))

typedef enum key_type {
    T_INT,    /* int32_t */
    T_U64,    /* uint64_t */
    T_DOUBLE, /* double */
    T_LAMBDA, /* double, or "auto" stored as -1 */
    T_BOOL,   /* bool, written 0 or 1 */
    T_ENUM,   /* an int-sized enum; choices[i] names value i */
} key_type;

/* A setting another key must have for this key to exist. */
typedef enum key_cond {
    C_NONE,
    C_PYRAMID, /* budget=pyramid */
    C_FAIR,    /* fair=1 */
    C_APPROX,  /* leverage scorer with mode=approx (always true for other scorers) */
    C_CHUNK,   /* chunk > 0 */
} key_cond;

/* Integer shapes beyond a plain [min, max]. */
typedef enum key_shape { S_PLAIN, S_ODD, S_ZERO_OR_GE2 } key_shape;

typedef struct key_desc {
    const char *name;
    key_type type;
    size_t offset;
    int64_t imin, imax;         /* T_INT */
    double lo, hi;              /* T_DOUBLE, T_LAMBDA: [lo, hi], or (lo, hi] with lo_open */
    bool lo_open;
    key_shape shape;
    const char *const *choices; /* T_ENUM, NULL-terminated */
    uint32_t allowed;           /* T_ENUM: values accepted (0 = all) */
    uint32_t kinds;             /* policies that have the key whatever their scorer */
    uint32_t scorers;           /* policies whose scorer has the key */
    key_cond cond;
    const char *accepts;        /* for messages and --help */
} key_desc;

/* offsetof that refuses to compile when the field's type does not match. */
#define FIELD(member, type) \
    (offsetof(pd_policy_spec, member) + 0 * sizeof(_Generic(((pd_policy_spec *)0)->member, type : 1)))
#define ENUM_FIELD(member)                                                                       \
    (offsetof(pd_policy_spec, member) +                                                          \
     0 * sizeof(_Generic(((pd_policy_spec *)0)->member, pd_policy_kind : 1, pd_budget_mode : 1, \
                         pd_compactor_profile : 1, pd_leverage_mode : 1, pd_obcache_target : 1,  \
                         pd_budget_base : 1)))

#define INT_KEY(nm, member, mn, mx, shp, kd, sc, cnd, acc)                                          \
    { .name = nm, .type = T_INT, .offset = FIELD(member, int32_t), .imin = (mn), .imax = (mx),     \
      .shape = (shp), .kinds = (kd), .scorers = (sc), .cond = (cnd), .accepts = (acc) }
#define DBL_KEY(nm, member, l, h, lopen, kd, sc, cnd, acc)                                          \
    { .name = nm, .type = T_DOUBLE, .offset = FIELD(member, double), .lo = (l), .hi = (h),         \
      .lo_open = (lopen), .kinds = (kd), .scorers = (sc), .cond = (cnd), .accepts = (acc) }
#define BOOL_KEY(nm, member, kd, sc, cnd)                                                           \
    { .name = nm, .type = T_BOOL, .offset = FIELD(member, bool), .kinds = (kd), .scorers = (sc),   \
      .cond = (cnd), .accepts = "0 or 1" }
#define ENUM_KEY(nm, member, names, allow, kd, sc, acc)                                             \
    { .name = nm, .type = T_ENUM, .offset = ENUM_FIELD(member), .choices = (names),                \
      .allowed = (allow), .kinds = (kd), .scorers = (sc), .cond = C_NONE, .accepts = (acc) }

#define B_COMPACTOR BIT(PD_POLICY_COMPACTOR)
#define B_LEVERAGE BIT(PD_POLICY_LEVERAGE)
#define B_NONCAUSAL BIT(PD_POLICY_NONCAUSAL)
#define B_SNAPKV BIT(PD_POLICY_SNAPKV)
#define B_OBCACHE BIT(PD_POLICY_OBCACHE)
#define B_LASERKV BIT(PD_POLICY_LASERKV)

/* Sorted by name (strcmp): the canonical string prints keys in table order. */
static const key_desc keys[] = {
    BOOL_KEY("accumulate", accumulate, 0, B_LASERKV, C_NONE),
    DBL_KEY("alpha", alpha, 0, 1, false, 0, B_LASERKV, C_NONE, "a number in [0, 1]"),
    INT_KEY("attn_chunk", attn_chunk, 1, INT32_MAX, S_PLAIN, 0, B_COMPACTOR | B_NONCAUSAL, C_NONE,
            "an integer >= 1"),
    ENUM_KEY("base", base, base_names, 0, 0, B_COMPACTOR, "prompt or unprotected"),
    DBL_KEY("beta", beta, 1, HUGE_VAL, false, ALL_KINDS, 0, C_PYRAMID, "a number >= 1"),
    INT_KEY("bits", bits, 1, 32, S_PLAIN, 0, B_LASERKV, C_NONE, "an integer in 1..32"),
    ENUM_KEY("budget", budget, budget_names, 0, ALL_KINDS, 0, "uniform, pyramid or global"),
    INT_KEY("chunk", chunk, 0, INT32_MAX, S_PLAIN, ALL_KINDS, 0, C_NONE, "an integer >= 0 (0 = off)"),
    DBL_KEY("debias", debias, 0, 1, false, ALL_KINDS, 0, C_FAIR, "a number in [0, 1]"),
    INT_KEY("divisor", divisor, 2, INT32_MAX, S_PLAIN, 0, B_LASERKV, C_NONE, "an integer >= 2"),
    BOOL_KEY("fair", fair, ALL_KINDS, 0, C_NONE),
    { .name = "lambda", .type = T_LAMBDA, .offset = FIELD(lambda, double), .lo = 0, .hi = HUGE_VAL,
      .scorers = B_COMPACTOR, .cond = C_NONE, .accepts = "a number >= 0 or auto" },
    INT_KEY("lev_chunk", lev_chunk, 0, INT32_MAX, S_ZERO_OR_GE2, 0, B_COMPACTOR | B_LEVERAGE, C_NONE,
            "0 (whole sequence) or an integer >= 2"),
    BOOL_KEY("local", local, ALL_KINDS, 0, C_FAIR),
    ENUM_KEY("mode", leverage, mode_names, 0, 0, B_LEVERAGE, "approx or exact"),
    INT_KEY("pool", pool, 1, INT32_MAX, S_ODD, 0, B_COMPACTOR | B_NONCAUSAL | B_SNAPKV | B_OBCACHE, C_NONE,
            "an odd integer >= 1"),
    ENUM_KEY("profile", profile, profile_names, 0, 0, B_COMPACTOR, "official or kvpress"),
    INT_KEY("recent", recent, 0, INT32_MAX, S_PLAIN, ALL_KINDS & ~B_LASERKV, 0, C_NONE, "an integer >= 0"),
    DBL_KEY("retention", retention, 0, 1, true, ALL_KINDS, 0, C_NONE, "a number in (0, 1]"),
    INT_KEY("reuse", reuse, 1, INT32_MAX, S_PLAIN, ALL_KINDS, 0, C_NONE, "an integer >= 1 (1 = off)"),
    DBL_KEY("ridge", ridge, 0, HUGE_VAL, true, 0, B_COMPACTOR | B_LEVERAGE, C_APPROX, "a number > 0"),
    INT_KEY("rounds", rounds, 1, 64, S_PLAIN, 0, B_LASERKV, C_NONE, "an integer in 1..64"),
    DBL_KEY("scale", scale, 0, HUGE_VAL, false, 0, B_COMPACTOR | B_NONCAUSAL, C_NONE,
            "a number >= 0 (0 = 1/sqrt(head_dim))"),
    ENUM_KEY("scorer", scorer, kind_names, WRAPPABLE, WRAPPERS, 0,
             "compactor, leverage, noncausal, random, knorm, streaming, snapkv, h2o, tova or obcache"),
    { .name = "seed", .type = T_U64, .offset = FIELD(seed, uint64_t),
      .scorers = B_COMPACTOR | B_LEVERAGE | BIT(PD_POLICY_RANDOM) | B_LASERKV, .cond = C_APPROX,
      .accepts = "an integer in 0..18446744073709551615" },
    BOOL_KEY("shared", shared, ALL_KINDS & ~B_LASERKV, 0, C_CHUNK),
    INT_KEY("sink", sink, 0, INT32_MAX, S_PLAIN, ALL_KINDS & ~B_LASERKV, 0, C_NONE, "an integer >= 0"),
    INT_KEY("sketch", sketch, 1, 1024, S_PLAIN, 0, B_COMPACTOR | B_LEVERAGE, C_APPROX, "an integer in 1..1024"),
    ENUM_KEY("target", target, target_names, 0, 0, B_OBCACHE, "value, key or joint"),
    BOOL_KEY("vnorm", vnorm, 0, B_COMPACTOR | B_NONCAUSAL, C_NONE),
    INT_KEY("window", window, 0, INT32_MAX, S_PLAIN, 0, B_SNAPKV | B_OBCACHE | B_LASERKV, C_NONE,
            "an integer >= 0 (0 = auto: max(16, 5% of the budget))"),
};
#define N_KEYS ((int)(sizeof keys / sizeof keys[0]))

static int key_index(const char *name) {
    for (int i = 0; i < N_KEYS; i++)
        if (strcmp(keys[i].name, name) == 0) return i;
    return -1;
}

static bool kind_ok(int k) { return k >= 0 && k < PD_POLICY_COUNT; }

/* The key exists for this policy and scorer (ignoring its condition). */
static bool key_exists(const pd_policy_spec *s, const key_desc *k) {
    if (!kind_ok((int)s->kind) || !kind_ok((int)s->scorer)) return false;
    return (k->kinds & BIT(s->kind)) || (k->scorers & BIT(s->scorer));
}

static bool cond_holds(const pd_policy_spec *s, key_cond c) {
    switch (c) {
    case C_NONE: return true;
    case C_PYRAMID: return s->budget == PD_BUDGET_PYRAMID;
    case C_FAIR: return s->fair;
    case C_APPROX: return s->scorer != PD_POLICY_LEVERAGE || s->leverage == PD_LEVERAGE_APPROX;
    case C_CHUNK: return s->chunk > 0;
    }
    return false;
}

static const char *cond_text(key_cond c) {
    switch (c) {
    case C_NONE: return "";
    case C_PYRAMID: return "budget=pyramid";
    case C_FAIR: return "fair=1";
    case C_APPROX: return "mode=approx";
    case C_CHUNK: return "chunk > 0";
    }
    return "";
}

/* The key is part of this spec (and of its canonical string). */
static bool key_used(const pd_policy_spec *s, const key_desc *k) {
    return key_exists(s, k) && cond_holds(s, k->cond);
}

/* ------------------------------------------------------------------------
 * Defaults
 * ------------------------------------------------------------------------ */

static pd_policy_kind default_scorer(pd_policy_kind kind) {
    return (BIT(kind) & WRAPPERS) ? PD_POLICY_SNAPKV : kind;
}

/* Defaults for a policy with the given scorer and Compactor profile: the
 * scorer's own defaults first (sink/recent/budget included, so that e.g.
 * pyramidkv:scorer=streaming keeps streaming's sinks), then what the
 * wrapper itself stands for. */
static void fill_defaults(pd_policy_kind kind, pd_policy_kind scorer, pd_compactor_profile profile,
                          pd_policy_spec *s) {
    memset(s, 0, sizeof *s);
    s->kind = kind;
    s->scorer = scorer;
    s->retention = 0.5;
    s->seed = 1;
    s->budget = PD_BUDGET_UNIFORM;
    s->beta = 20;
    s->sink = 0;
    s->recent = 0;
    s->chunk = 0;
    s->reuse = 1;
    s->shared = true;
    s->fair = false;
    s->debias = 1;
    s->local = true;
    s->profile = PD_PROFILE_OFFICIAL;
    s->lambda = 0.5;
    s->sketch = 48;
    s->lev_chunk = 512;
    s->ridge = 0.005;
    s->attn_chunk = 128;
    s->scale = 1;
    s->vnorm = false;
    s->leverage = PD_LEVERAGE_APPROX;
    s->base = PD_BASE_PROMPT;
    s->window = 64;
    s->pool = 1;
    s->target = PD_OBCACHE_JOINT;
    s->divisor = 4;
    s->alpha = 0.75;
    /* LASER-KV's official code: 20 hash tables of 12 bits, exact attention
     * summed over layers. */
    s->rounds = 20;
    s->bits = 12;
    s->accumulate = true;

    switch (scorer) {
    case PD_POLICY_COMPACTOR:
        s->profile = profile;
        if (profile == PD_PROFILE_KVPRESS) {
            s->lambda = -1; /* auto: 1 - retention */
            s->lev_chunk = 0;
            s->ridge = 0.01;
            s->attn_chunk = 256;
            s->vnorm = true;
            s->pool = 3;
            s->budget = PD_BUDGET_UNIFORM;
            s->sink = 8;
            s->recent = 4;
        } else {
            s->budget = PD_BUDGET_GLOBAL;
            s->sink = 16;
            s->recent = 64;
            s->base = PD_BASE_UNPROTECTED;
        }
        break;
    case PD_POLICY_STREAMING:
        /* Its score is the position: the rest of the budget goes to the
         * most recent tokens. */
        s->sink = 4;
        break;
    case PD_POLICY_SNAPKV: s->pool = 5; break;
    case PD_POLICY_OBCACHE:
        /* OBCache's code: the observation window is the recent window, 5%
         * of the budget (LongBench) or 16 tokens (needle); max pool of 7. */
        s->window = 0;
        s->pool = 7;
        break;
    default: break;
    }
    if (kind == PD_POLICY_PYRAMIDKV) s->budget = PD_BUDGET_PYRAMID;
    if (kind == PD_POLICY_CHUNKKV) {
        s->chunk = 20;
        s->reuse = 1;
    }
}

void pd_policy_spec_default(pd_policy_kind kind, pd_policy_spec *out) {
    if (!kind_ok((int)kind)) kind = PD_POLICY_COMPACTOR;
    fill_defaults(kind, default_scorer(kind), PD_PROFILE_OFFICIAL, out);
}

void pd_policy_spec_set_retention(pd_policy_spec *spec, double retention) { spec->retention = retention; }

const char *pd_policy_kind_name(pd_policy_kind kind) {
    return kind_ok((int)kind) ? kind_names[kind] : "unknown";
}

const char *pd_policy_kind_summary(pd_policy_kind kind) {
    static const char *const summaries[PD_POLICY_COUNT] = {
        "Compactor: approximate leverage scores of the keys plus non-causal attention (the default)",
        "Compactor's leverage half alone: keys that span the key space",
        "Compactor's attention half alone: attention from every query, not just earlier ones",
        "Uniformly random scores, seeded (a baseline)",
        "K-norm: keep the keys with the smallest L2 norm",
        "StreamingLLM: attention sinks plus the most recent tokens",
        "SnapKV: attention of an observation window of the last queries, pooled",
        "H2O: heavy hitters by accumulated attention",
        "TOVA: attention of the last token",
        "PyramidKV: a scorer (SnapKV) with layer budgets falling linearly",
        "ChunkKV: a scorer (SnapKV) selecting whole chunks, indices reused across layers",
        "OBCache: output-perturbation saliency of values, keys or both",
        "LASER-KV: anchors and recent tokens, exact attention, then LSH recall",
    };
    return kind_ok((int)kind) ? summaries[kind] : "unknown";
}

bool pd_policy_kind_from_name(const char *name, pd_policy_kind *out) {
    for (int i = 0; i < PD_POLICY_COUNT; i++) {
        if (strcmp(name, kind_names[i]) == 0) {
            *out = (pd_policy_kind)i;
            return true;
        }
    }
    return false;
}

/* ------------------------------------------------------------------------
 * Output helpers
 * ------------------------------------------------------------------------ */


/* Shortest of %.15g, %.16g, %.17g that reads back as exactly v. */
static void format_double(double v, char *buf, size_t cap) {
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) return;
    }
}

static int enum_get(const pd_policy_spec *s, const key_desc *k) {
    int v;
    memcpy(&v, (const char *)s + k->offset, sizeof v);
    return v;
}

static int count_choices(const char *const *choices) {
    int n = 0;
    while (choices[n]) n++;
    return n;
}

static void format_value(const pd_policy_spec *s, const key_desc *k, char *buf, size_t cap) {
    const char *field = (const char *)s + k->offset;
    switch (k->type) {
    case T_INT: {
        int32_t v;
        memcpy(&v, field, sizeof v);
        snprintf(buf, cap, "%" PRId32, v);
        return;
    }
    case T_U64: {
        uint64_t v;
        memcpy(&v, field, sizeof v);
        snprintf(buf, cap, "%" PRIu64, v);
        return;
    }
    case T_DOUBLE:
    case T_LAMBDA: {
        double v;
        memcpy(&v, field, sizeof v);
        if (k->type == T_LAMBDA && v < 0) snprintf(buf, cap, "auto");
        else format_double(v + 0.0, buf, cap); /* -0 prints as 0, as parse stores it */
        return;
    }
    case T_BOOL: {
        bool v;
        memcpy(&v, field, sizeof v);
        snprintf(buf, cap, "%d", v ? 1 : 0);
        return;
    }
    case T_ENUM: {
        int v = enum_get(s, k);
        if (v >= 0 && v < count_choices(k->choices)) snprintf(buf, cap, "%s", k->choices[v]);
        else snprintf(buf, cap, "%d", v); /* invalid; validation names it */
        return;
    }
    }
    buf[0] = '\0';
}

size_t pd_policy_spec_print(const pd_policy_spec *spec, char *buf, size_t cap) {
    pd_strbuf w = {buf, cap, 0};
    if (cap) buf[0] = '\0';
    pd_strbuf_printf(&w, "%s", pd_policy_kind_name(spec->kind));
    char sep = ':';
    for (int i = 0; i < N_KEYS; i++) {
        if (!key_used(spec, &keys[i])) continue;
        char val[64];
        format_value(spec, &keys[i], val, sizeof val);
        pd_strbuf_printf(&w, "%c%s=%s", sep, keys[i].name, val);
        sep = ',';
    }
    return w.len;
}

/* The keys a policy has (conditions ignored), comma-separated. */
static void list_keys(const pd_policy_spec *s, char *buf, size_t cap) {
    pd_strbuf w = {buf, cap, 0};
    if (cap) buf[0] = '\0';
    for (int i = 0; i < N_KEYS; i++) {
        if (!key_exists(s, &keys[i])) continue;
        pd_strbuf_printf(&w, "%s%s", w.len ? ", " : "", keys[i].name);
        if (keys[i].cond != C_NONE) pd_strbuf_printf(&w, " (with %s)", cond_text(keys[i].cond));
    }
}

static void list_kinds(char *buf, size_t cap) {
    pd_strbuf w = {buf, cap, 0};
    if (cap) buf[0] = '\0';
    for (int i = 0; i < PD_POLICY_COUNT; i++) pd_strbuf_printf(&w, "%s%s", i ? ", " : "", kind_names[i]);
}

/* User text, cut short and with control characters replaced, for messages. */
static void echo(const char *s, char *out, size_t cap) {
    size_t n = strlen(s), max = cap - 4, i;
    for (i = 0; i < n && i < max; i++) out[i] = (unsigned char)s[i] < 0x20 ? '?' : s[i];
    if (i < n) {
        memcpy(out + i, "...", 3);
        i += 3;
    }
    out[i] = '\0';
}

void pd_policy_describe(FILE *f) {
    for (int kind = 0; kind < PD_POLICY_COUNT; kind++) {
        pd_policy_spec s;
        pd_policy_spec_default((pd_policy_kind)kind, &s);
        fprintf(f, "%s:", kind_names[kind]);
        for (int i = 0; i < N_KEYS; i++) {
            if (!key_used(&s, &keys[i])) continue;
            char val[64];
            format_value(&s, &keys[i], val, sizeof val);
            fprintf(f, " %s=%s", keys[i].name, val);
        }
        /* Keys that exist but wait for another setting, with their defaults. */
        for (int i = 0; i < N_KEYS; i++) {
            if (!key_exists(&s, &keys[i]) || cond_holds(&s, keys[i].cond)) continue;
            char val[64];
            format_value(&s, &keys[i], val, sizeof val);
            fprintf(f, " [%s=%s with %s]", keys[i].name, val, cond_text(keys[i].cond));
        }
        if (kind == PD_POLICY_COMPACTOR)
            fprintf(f, " (profile=kvpress: lambda=auto lev_chunk=0 ridge=0.01 attn_chunk=256 vnorm=1 pool=3"
                       " budget=uniform sink=8 recent=4 base=prompt; explicit keys override the profile)");
        if (kind == PD_POLICY_LEVERAGE) fprintf(f, " (mode=exact drops sketch, ridge and seed)");
        if (kind == PD_POLICY_PYRAMIDKV || kind == PD_POLICY_CHUNKKV)
            fprintf(f, " (another scorer brings its own keys and defaults)");
        if (kind == PD_POLICY_LASERKV)
            fprintf(f, " (anchors and recent tokens: budget/divisor each; chunk must stay 0)");
        if (kind == PD_POLICY_OBCACHE)
            fprintf(f, " (window=0: max(16, 5%% of the budget); pool is a max pool)");
        fputc('\n', f);
    }
}

/* ------------------------------------------------------------------------
 * Values
 * ------------------------------------------------------------------------ */

static bool int_in_range(const key_desc *k, int64_t v) {
    if (v < k->imin || v > k->imax) return false;
    if (k->shape == S_ODD && v % 2 == 0) return false;
    if (k->shape == S_ZERO_OR_GE2 && v == 1) return false;
    return true;
}

static bool double_in_range(const key_desc *k, double v) {
    if (!isfinite(v)) return false;
    if (k->type == T_LAMBDA && v < 0) return v == -1; /* auto */
    if (k->lo_open ? !(v > k->lo) : !(v >= k->lo)) return false;
    return v <= k->hi;
}

static bool all_in(const char *s, const char *set) { return strspn(s, set) == strlen(s); }

/* Parse `text` as key k's value into s. The problem is returned as a
 * message fragment ("is not an integer"), or NULL. */
static const char *apply_value(pd_policy_spec *s, const key_desc *k, const char *text) {
    char *field = (char *)s + k->offset;
    switch (k->type) {
    case T_INT: {
        /* strtoll would skip spaces and take "0x10"; plain decimal only. */
        const char *d = text[0] == '-' || text[0] == '+' ? text + 1 : text;
        if (!*d || !all_in(d, "0123456789")) return "is not an integer";
        errno = 0;
        long long v = strtoll(text, NULL, 10);
        if (errno == ERANGE || !int_in_range(k, v)) return "is out of range";
        int32_t v32 = (int32_t)v;
        memcpy(field, &v32, sizeof v32);
        return NULL;
    }
    case T_U64: {
        if (!all_in(text, "0123456789")) return "is not a non-negative integer";
        errno = 0;
        unsigned long long v = strtoull(text, NULL, 10);
        if (errno == ERANGE) return "is out of range";
        uint64_t v64 = v;
        memcpy(field, &v64, sizeof v64);
        return NULL;
    }
    case T_LAMBDA:
    case T_DOUBLE: {
        double v;
        if (k->type == T_LAMBDA && strcmp(text, "auto") == 0) {
            v = -1;
        } else {
            /* Plain decimal only: strtod would also take "nan", "inf" and hex. */
            if (!all_in(text, "0123456789.eE+-") || !strpbrk(text, "0123456789")) return "is not a number";
            char *end;
            errno = 0;
            v = strtod(text, &end);
            if (end == text || *end) return "is not a number";
            if (!isfinite(v) || (errno == ERANGE && fabs(v) > 1)) return "is out of range";
            v += 0.0; /* -0 and 0 are one value and get one canonical string */
            if (k->type == T_LAMBDA && v < 0) return "is out of range";
        }
        if (!double_in_range(k, v)) return "is out of range";
        memcpy(field, &v, sizeof v);
        return NULL;
    }
    case T_BOOL: {
        bool v;
        if (strcmp(text, "1") == 0 || strcmp(text, "true") == 0) v = true;
        else if (strcmp(text, "0") == 0 || strcmp(text, "false") == 0) v = false;
        else return "is not 0 or 1";
        memcpy(field, &v, sizeof v);
        return NULL;
    }
    case T_ENUM:
        for (int i = 0; k->choices[i]; i++) {
            if (strcmp(text, k->choices[i]) == 0) {
                if (k->allowed && !(k->allowed & BIT(i))) return "is not allowed here";
                memcpy(field, &i, sizeof i);
                return NULL;
            }
        }
        return "is not a valid name";
    }
    return "has an unknown type";
}

/* The field of key k in s is in range. */
static bool field_ok(const pd_policy_spec *s, const key_desc *k) {
    const char *field = (const char *)s + k->offset;
    switch (k->type) {
    case T_INT: {
        int32_t v;
        memcpy(&v, field, sizeof v);
        return int_in_range(k, v);
    }
    case T_U64: return true;
    case T_DOUBLE:
    case T_LAMBDA: {
        double v;
        memcpy(&v, field, sizeof v);
        return k->type == T_LAMBDA && v < 0 ? isfinite(v) : double_in_range(k, v);
    }
    case T_BOOL: return true;
    case T_ENUM: {
        int v = enum_get(s, k);
        if (v < 0 || v >= count_choices(k->choices)) return false;
        return !k->allowed || (k->allowed & BIT(v));
    }
    }
    return false;
}

/* ------------------------------------------------------------------------
 * Validation
 * ------------------------------------------------------------------------ */

int pd_policy_spec_validate(const pd_policy_spec *spec, pd_error *err) {
    char list[256];
    if (!kind_ok((int)spec->kind)) {
        list_kinds(list, sizeof list);
        return pd_errorf(err, PD_EINVAL, "policy kind %d is not a policy; policies: %s", (int)spec->kind, list);
    }
    const char *name = kind_names[spec->kind];
    if (BIT(spec->kind) & WRAPPERS) {
        if (!kind_ok((int)spec->scorer) || !(BIT(spec->scorer) & WRAPPABLE))
            return pd_errorf(err, PD_EINVAL, "policy '%s': key 'scorer' = %s is not allowed; scorer accepts %s",
                             name, pd_policy_kind_name(spec->scorer), keys[key_index("scorer")].accepts);
    } else if (spec->scorer != spec->kind) {
        return pd_errorf(err, PD_EINVAL, "policy '%s' scores by itself but its scorer is '%s'; only pyramidkv "
                         "and chunkkv take a scorer", name, pd_policy_kind_name(spec->scorer));
    }
    /* Every enum is checked, used or not, so printing never meets a bad one. */
    for (int i = 0; i < N_KEYS; i++) {
        const key_desc *k = &keys[i];
        bool used = key_used(spec, k);
        if (!used && k->type != T_ENUM) continue;
        if (used ? field_ok(spec, k) : enum_get(spec, k) >= 0 && enum_get(spec, k) < count_choices(k->choices))
            continue;
        char val[64];
        format_value(spec, k, val, sizeof val);
        return pd_errorf(err, PD_EINVAL, "policy '%s': key '%s' = %s is out of range; %s accepts %s", name,
                         k->name, val, k->name, k->accepts);
    }
    if (spec->reuse > 1 && spec->budget == PD_BUDGET_PYRAMID)
        return pd_errorf(err, PD_EINVAL, "policy '%s': key 'reuse' = %" PRId32 " needs budget=uniform or "
                         "budget=global: pyramid layer budgets differ, so layers cannot share indices "
                         "(set reuse=1 or change budget)", name, spec->reuse);
    if (spec->chunk > 0 && spec->kind == PD_POLICY_LASERKV)
        return pd_errorf(err, PD_EINVAL, "policy 'laserkv': key 'chunk' = %" PRId32 " is not supported: "
                         "laserkv picks single tokens by two criteria (set chunk=0)", spec->chunk);
    return PD_OK;
}

/* ------------------------------------------------------------------------
 * Parsing
 * ------------------------------------------------------------------------ */

static char *trim(char *s) {
    while (isspace((unsigned char)*s)) s++;
    size_t n = strlen(s);
    while (n > 0 && isspace((unsigned char)s[n - 1])) s[--n] = '\0';
    return s;
}

typedef struct item {
    int key;
    const char *value;
} item;

static int inapplicable_error(pd_error *err, const pd_policy_spec *s, const char *key) {
    char list[400];
    list_keys(s, list, sizeof list);
    if (BIT(s->kind) & WRAPPERS)
        return pd_errorf(err, PD_EINVAL, "policy '%s' with scorer '%s' has no key '%s'; its keys: %s",
                         kind_names[s->kind], kind_names[s->scorer], key, list);
    return pd_errorf(err, PD_EINVAL, "policy '%s' has no key '%s'; its keys: %s", kind_names[s->kind], key, list);
}

static int value_error(pd_error *err, const char *policy, const key_desc *k, const char *value,
                       const char *problem) {
    char shown[ECHO_MAX + 4];
    echo(value, shown, sizeof shown);
    return pd_errorf(err, PD_EINVAL, "policy '%s': key '%s' value '%s' %s; %s accepts %s", policy, k->name,
                     shown, problem, k->name, k->accepts);
}

/* Split "key=value,..." (in buf, modified in place) into items, rejecting
 * syntax errors, unknown and duplicate keys. */
static int split_items(char *buf, const pd_policy_spec *s, item *items, int *n_items, pd_error *err) {
    const char *policy = kind_names[s->kind];
    bool seen[N_KEYS];
    memset(seen, 0, sizeof seen);
    *n_items = 0;
    char *p = buf, shown[ECHO_MAX + 4];
    const char *prev = NULL;
    for (;;) {
        char *comma = strchr(p, ',');
        if (comma) *comma = '\0';
        char *entry = trim(p);
        if (!*entry) {
            if (prev)
                return pd_errorf(err, PD_EINVAL, "policy '%s': empty entry after key '%s' (a trailing or doubled "
                                 "comma); write key=value,key=value", policy, prev);
            return pd_errorf(err, PD_EINVAL, "policy '%s': empty entry after ':' (write %s or "
                             "%s:key=value,...)", policy, policy, policy);
        }
        char *eq = strchr(entry, '=');
        if (!eq) {
            echo(entry, shown, sizeof shown);
            return pd_errorf(err, PD_EINVAL, "policy '%s': '%s' has no value; write %s=VALUE", policy, shown, shown);
        }
        *eq = '\0';
        char *key = trim(entry), *value = trim(eq + 1);
        echo(key, shown, sizeof shown);
        int ki = key_index(key);
        if (ki < 0) {
            char list[400];
            list_keys(s, list, sizeof list);
            if (!*key) return pd_errorf(err, PD_EINVAL, "policy '%s': '=%s' has no key name; its keys: %s",
                                        policy, value, list);
            return pd_errorf(err, PD_EINVAL, "policy '%s': unknown key '%s'; its keys: %s", policy, shown, list);
        }
        if (seen[ki]) return pd_errorf(err, PD_EINVAL, "policy '%s': key '%s' is given twice", policy, key);
        seen[ki] = true;
        if (!*value)
            return pd_errorf(err, PD_EINVAL, "policy '%s': key '%s' has an empty value; %s accepts %s", policy, key,
                             key, keys[ki].accepts);
        items[*n_items].key = ki;
        items[*n_items].value = value;
        (*n_items)++;
        prev = keys[ki].name;
        if (!comma) break;
        p = comma + 1;
    }
    return PD_OK;
}

static int parse_into(char *buf, pd_policy_spec *out, pd_error *err) {
    char shown[ECHO_MAX + 4], list[256];
    char *colon = strchr(buf, ':');
    if (colon) *colon = '\0';
    char *name = trim(buf);
    pd_policy_kind kind;
    if (!pd_policy_kind_from_name(name, &kind)) {
        echo(name, shown, sizeof shown);
        list_kinds(list, sizeof list);
        return pd_errorf(err, PD_EINVAL, "unknown policy '%s'; policies: %s", shown, list);
    }
    pd_policy_spec s;
    pd_policy_spec_default(kind, &s);
    if (!colon) {
        *out = s;
        return PD_OK;
    }

    item items[N_KEYS];
    int n_items, rc = split_items(colon + 1, &s, items, &n_items, err);
    if (rc) return rc;

    /* `scorer` then `profile` first: they choose the other keys' defaults. */
    const int k_scorer = key_index("scorer"), k_profile = key_index("profile");
    pd_policy_kind scorer = s.scorer;
    pd_compactor_profile profile = PD_PROFILE_OFFICIAL;
    for (int pass = 0; pass < 2; pass++) {
        int want = pass == 0 ? k_scorer : k_profile;
        for (int i = 0; i < n_items; i++) {
            if (items[i].key != want) continue;
            const key_desc *k = &keys[want];
            if (!key_exists(&s, k)) return inapplicable_error(err, &s, k->name);
            const char *problem = apply_value(&s, k, items[i].value);
            if (problem) return value_error(err, name, k, items[i].value, problem);
            scorer = s.scorer;
            profile = s.profile;
        }
        fill_defaults(kind, scorer, profile, &s);
    }

    for (int i = 0; i < n_items; i++) {
        const key_desc *k = &keys[items[i].key];
        if (items[i].key == k_scorer || items[i].key == k_profile) continue;
        if (!key_exists(&s, k)) return inapplicable_error(err, &s, k->name);
        const char *problem = apply_value(&s, k, items[i].value);
        if (problem) return value_error(err, name, k, items[i].value, problem);
    }
    /* Conditions are checked once every key is in: order does not matter. */
    for (int i = 0; i < n_items; i++) {
        const key_desc *k = &keys[items[i].key];
        if (cond_holds(&s, k->cond)) continue;
        char now[64];
        const char *cond_key = k->cond == C_PYRAMID ? "budget" : k->cond == C_FAIR ? "fair"
                             : k->cond == C_CHUNK                       ? "chunk"
                                                                        : "mode";
        const key_desc *ck = &keys[key_index(cond_key)];
        format_value(&s, ck, now, sizeof now);
        return pd_errorf(err, PD_EINVAL, "policy '%s': key '%s' needs %s (%s is %s)", name, k->name,
                         cond_text(k->cond), ck->name, now);
    }
    rc = pd_policy_spec_validate(&s, err);
    if (rc) return rc;
    *out = s;
    return PD_OK;
}

int64_t pd_policy_window(const pd_policy_spec *spec, int64_t len) {
    if (len < 1) return 0;
    int64_t w = spec->window;
    if (w <= 0) {
        /* OBCache's evaluation: 5% of the budget (LongBench), 16 tokens
         * (needle); the larger of the two covers both. The epsilon as in
         * pd_policy_budgets. */
        double budget = floor(spec->retention * (double)len + 1e-9);
        w = (int64_t)floor(0.05 * (budget < 1 ? 1 : budget) + 1e-9);
        if (w < 16) w = 16;
    }
    return w < len ? w : len;
}

void pd_policy_spec_for_span(const pd_policy_spec *spec, int n_spans, pd_policy_spec *out) {
    *out = *spec;
    if (spec->scorer == PD_POLICY_SNAPKV && n_spans > 1 && spec->window > 0)
        out->window = spec->window / n_spans > 1 ? spec->window / n_spans : 1;
}

void pd_policy_spec_protected(const pd_policy_spec *spec, int64_t budget, int64_t *sink, int64_t *recent) {
    if (spec->kind == PD_POLICY_LASERKV) { /* anchors and recent tokens scale with the budget */
        *sink = *recent = spec->divisor > 0 ? budget / spec->divisor : 0;
        return;
    }
    *sink = spec->sink;
    *recent = spec->recent;
}

int pd_policy_spec_parse(const char *text, pd_policy_spec *out, pd_error *err) {
    if (!text) return pd_errorf(err, PD_EINVAL, "no policy spec given");
    size_t len = strlen(text);
    char *buf = malloc(len + 1);
    if (!buf) return pd_errorf(err, PD_ENOMEM, "out of memory parsing a policy spec");
    memcpy(buf, text, len + 1);
    int rc = parse_into(buf, out, err);
    free(buf);
    return rc;
}
