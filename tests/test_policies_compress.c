/* The compressor through the real prefill (budgets, determinism, retention 1,
 * index reuse, fair eviction, whitelists, errors), the calibration curve
 * against naive references, pd_calibrate on stories260K and `prefixctl
 * compress` end to end. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "engine/engine.h"
#include "helpers.h"
#include "helpers_json.h"
#include "policies/policies.h"
#include "tools/tools.h"

static char *tmpdir;
static char model_path[1024];

/* Four layers and GQA (4 query heads over 2 kv heads), small enough that a
 * 200-token prefill takes milliseconds. */
static void setup(void) {
    tmpdir = th_mkdtemp();
    cr_assert_not_null(tmpdir);
    pd_testmodel_opts o;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset("tiny", &o, &err), PD_OK, "%s", err.msg);
    o.n_layer = 4;
    o.n_head = 4;
    o.n_head_kv = 2;
    o.seed = 7;
    o.n_ctx = 1024;
    snprintf(model_path, sizeof model_path, "%s/m.gguf", tmpdir);
    cr_assert_eq(pd_testmodel_write(&o, model_path, NULL, &err), PD_OK, "%s", err.msg);
}

static void teardown(void) {
    th_rmtree(tmpdir);
    free(tmpdir);
    tmpdir = NULL;
}

TestSuite(compress, .init = setup, .fini = teardown);
TestSuite(curve);

static pd_model *load(const char *path) {
    pd_model *m = NULL;
    pd_error err = {0};
    pd_model_params p = {.n_threads = 2};
    cr_assert_eq(pd_model_load(path, &p, &m, &err), PD_OK, "%s: %s", path, err.msg);
    return m;
}

static pd_model *load_stories(void) {
    char path[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", path, sizeof path));
    return load(path);
}

/* Seeded token ids in [3, n_vocab) (no BOS/EOS in the middle), BOS first. */
static pd_token *random_tokens(int64_t n, int32_t n_vocab, uint64_t seed) {
    pd_token *t = malloc(sizeof *t * (size_t)n);
    cr_assert(t);
    uint64_t x = seed * 6364136223846793005ull + 1442695040888963407ull;
    for (int64_t i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        t[i] = 3 + (pd_token)((x >> 33) % (uint64_t)(n_vocab - 3));
    }
    t[0] = 1;
    return t;
}

static void parse(const char *text, pd_policy_spec *s) {
    pd_error err = {0};
    cr_assert_eq(pd_policy_spec_parse(text, s, &err), PD_OK, "'%s': %s", text, err.msg);
}

static pd_kv_prefix *compress(pd_model *m, const pd_token *t, int64_t n, const pd_policy_spec *s, const pd_layout *lay,
                              pd_compress_stats *st) {
    pd_kv_prefix *p = NULL;
    pd_error err = {0};
    char name[PD_POLICY_SPEC_MAX];
    pd_policy_spec_print(s, name, sizeof name);
    cr_assert_eq(pd_compress_prefix(m, t, n, s, lay, &p, st, &err), PD_OK, "%s: %s", name, err.msg);
    return p;
}

static pd_kv_prefix *full_prefix(pd_model *m, const pd_token *t, int64_t n) {
    pd_seq *s = NULL;
    pd_kv_prefix *p = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_seq_create(m, 0, &s, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_prefill(m, s, t, n, NULL, NULL, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_to_prefix(s, &p, &err), PD_OK, "%s", err.msg);
    pd_seq_free(s);
    return p;
}

static double nll_after(pd_model *m, const pd_kv_prefix *p, const pd_token *text, int64_t n) {
    double v = 0;
    pd_error err = {0};
    cr_assert_eq(pd_nll(m, p, NULL, 0, text, n, &v, &err), PD_OK, "%s", err.msg);
    return v;
}

/* floor(retention * n), at least 1, at most n: the header's per-head budget. */
/* The header's rule: floor(retention * n), or for Compactor's
 * base=unprotected (profile official) round(retention * (n - sink -
 * recent)) as compactor-vllm budgets; everything at retention 1; >= 1. */
static int64_t uniform_budget(const pd_policy_spec *s, int64_t n) {
    if (s->retention >= 1) return n;
    int64_t b = (int64_t)floor(s->retention * (double)n + 1e-9);
    if (s->scorer == PD_POLICY_COMPACTOR && s->base == PD_BASE_UNPROTECTED) {
        int64_t free_n = n - s->sink - s->recent;
        b = free_n > 0 ? (int64_t)llround(s->retention * (double)free_n) : 0;
    }
    if (b < 1) b = 1;
    return b > n ? n : b;
}

/* Kept positions of every stream: sorted, distinct, inside [0, n); the
 * stats agree with the stream lengths. Returns the total. */
static int64_t check_streams(const pd_kv_prefix *p, const pd_hparams *hp, int64_t n, const pd_compress_stats *st,
                             const char *what) {
    int64_t total = 0;
    cr_assert_eq(pd_kv_prefix_n_orig(p), n, "%s", what);
    cr_assert_eq(st->n_layer, hp->n_layer, "%s", what);
    cr_assert_eq(st->n_head_kv, hp->n_head_kv, "%s", what);
    cr_assert_eq(st->n_tokens, n, "%s", what);
    for (int l = 0; l < hp->n_layer; l++)
        for (int h = 0; h < hp->n_head_kv; h++) {
            const int32_t *pos;
            const int64_t len = pd_kv_prefix_stream(p, l, h, &pos, NULL, NULL);
            cr_assert_eq(len, st->kept[l * hp->n_head_kv + h], "%s: layer %d head %d stats say %lld, stream has %lld",
                         what, l, h, (long long)st->kept[l * hp->n_head_kv + h], (long long)len);
            for (int64_t i = 0; i < len; i++) {
                cr_assert(pos[i] >= 0 && pos[i] < n, "%s: position %d outside [0, %lld)", what, pos[i], (long long)n);
                if (i) cr_assert_lt(pos[i - 1], pos[i], "%s: positions not increasing", what);
            }
            total += len;
        }
    cr_assert_eq(st->kept_total, total, "%s: kept_total %lld, streams %lld", what, (long long)st->kept_total,
                 (long long)total);
    cr_assert_eq(pd_kv_prefix_kept_rows(p), total, "%s", what);
    return total;
}

/* The per-head budget of layer l: the header's rule, with pyramid taken from
 * pd_policy_budgets (checked here for its invariants) and reused layers
 * keeping their group leader's indices. */
static void check_budget(const pd_kv_prefix *p, const pd_hparams *hp, int64_t n, const pd_policy_spec *s,
                         const char *what) {
    const int L = hp->n_layer, H = hp->n_head_kv;
    int64_t *b = malloc(sizeof *b * (size_t)L);
    cr_assert(b);
    pd_policy_budgets(s, L, n, b);
    const int64_t u = uniform_budget(s, n);
    int64_t sum = 0;
    for (int l = 0; l < L; l++) {
        if (s->budget != PD_BUDGET_PYRAMID) cr_assert_eq(b[l], u, "%s: layer %d budget %lld, expected %lld", what, l,
                                                         (long long)b[l], (long long)u);
        cr_assert(b[l] >= 1 && b[l] <= n, "%s", what);
        if (l) cr_assert_leq(b[l], b[l - 1], "%s: pyramid budgets must not grow with depth", what);
        sum += b[l];
    }
    /* PyramidKV never keeps fewer than its observation window (at most n),
     * even where that is more than the retention asks. */
    const int64_t window = s->budget == PD_BUDGET_PYRAMID && s->scorer == PD_POLICY_SNAPKV
                               ? (pd_policy_window(s, n) < n ? pd_policy_window(s, n) : n)
                               : 1;
    for (int l = 0; l < L; l++) cr_assert_geq(b[l], window, "%s: layer %d keeps fewer than the window", what, l);
    cr_assert_leq(sum, (int64_t)L * (u > window ? u : window), "%s", what);
    for (int l = 0; l < L; l++) {
        const int lead = s->reuse > 1 ? l - l % s->reuse : l;
        int64_t layer_total = 0;
        for (int h = 0; h < H; h++) {
            const int64_t len = pd_kv_prefix_stream(p, l, h, NULL, NULL, NULL);
            layer_total += len;
            if (s->budget != PD_BUDGET_GLOBAL)
                cr_assert_eq(len, b[lead], "%s: layer %d head %d keeps %lld, budget %lld", what, l, h, (long long)len,
                             (long long)b[lead]);
        }
        if (s->budget == PD_BUDGET_GLOBAL)
            cr_assert_eq(layer_total, b[lead] * H, "%s: layer %d keeps %lld pairs, budget %lld", what, l,
                         (long long)layer_total, (long long)(b[lead] * H));
    }
    free(b);
}

static void every_policy_keeps_its_budget(pd_model *m, int64_t n, uint64_t seed) {
    const pd_hparams *hp = pd_model_hparams(m);
    pd_token *t = random_tokens(n, hp->n_vocab, seed);
    static const double rets[] = {0.5, 0.25, 0.1};
    for (int k = 0; k < PD_POLICY_COUNT; k++)
        for (size_t r = 0; r < sizeof rets / sizeof rets[0]; r++) {
            pd_policy_spec s;
            pd_policy_spec_default((pd_policy_kind)k, &s);
            pd_policy_spec_set_retention(&s, rets[r]);
            char what[PD_POLICY_SPEC_MAX];
            pd_policy_spec_print(&s, what, sizeof what);
            pd_compress_stats st;
            pd_kv_prefix *p = compress(m, t, n, &s, NULL, &st);
            check_streams(p, hp, n, &st, what);
            check_budget(p, hp, n, &s, what);
            cr_assert(st.score_seconds >= 0, "%s", what);
            pd_compress_stats_free(&st);
            pd_kv_prefix_free(p);
        }
    free(t);
}

Test(compress, every_policy_keeps_its_budget_generated_model) {
    pd_model *m = load(model_path);
    every_policy_keeps_its_budget(m, 200, 1);
    pd_model_free(m);
}

Test(compress, every_policy_keeps_its_budget_stories260k) {
    TH_REQUIRE_SHARED();
    pd_model *m = load_stories();
    every_policy_keeps_its_budget(m, 300, 2);
    pd_model_free(m);
}

static void assert_same_prefix(const pd_kv_prefix *a, const pd_kv_prefix *b, const pd_hparams *hp, const char *what) {
    cr_assert_eq(pd_kv_prefix_n_orig(a), pd_kv_prefix_n_orig(b), "%s", what);
    for (int l = 0; l < hp->n_layer; l++)
        for (int h = 0; h < hp->n_head_kv; h++) {
            const int32_t *pa, *pb;
            const void *ka, *kb, *va, *vb;
            const int64_t la = pd_kv_prefix_stream(a, l, h, &pa, &ka, &va);
            const int64_t lb = pd_kv_prefix_stream(b, l, h, &pb, &kb, &vb);
            cr_assert_eq(la, lb, "%s: layer %d head %d lengths %lld vs %lld", what, l, h, (long long)la, (long long)lb);
            cr_assert_eq(pd_kv_prefix_type(a), pd_kv_prefix_type(b), "%s", what);
            if (!la) continue;
            const size_t rows = (size_t)la * (size_t)hp->head_dim * (pd_kv_prefix_type(a) == PD_TYPE_F16 ? 2 : 4);
            cr_assert_eq(memcmp(pa, pb, sizeof *pa * (size_t)la), 0, "%s: layer %d head %d positions differ", what, l,
                         h);
            cr_assert_eq(memcmp(ka, kb, rows), 0, "%s: layer %d head %d K rows differ", what, l, h);
            cr_assert_eq(memcmp(va, vb, rows), 0, "%s: layer %d head %d V rows differ", what, l, h);
        }
}

/* Positions only (K/V rows may differ when only the selection is compared). */
static void assert_same_positions(const pd_kv_prefix *a, const pd_kv_prefix *b, const pd_hparams *hp,
                                  const char *what) {
    for (int l = 0; l < hp->n_layer; l++)
        for (int h = 0; h < hp->n_head_kv; h++) {
            const int32_t *pa, *pb;
            const int64_t la = pd_kv_prefix_stream(a, l, h, &pa, NULL, NULL);
            const int64_t lb = pd_kv_prefix_stream(b, l, h, &pb, NULL, NULL);
            cr_assert_eq(la, lb, "%s: layer %d head %d lengths %lld vs %lld", what, l, h, (long long)la, (long long)lb);
            for (int64_t i = 0; i < la; i++)
                cr_assert_eq(pa[i], pb[i], "%s: layer %d head %d entry %lld: %d vs %d", what, l, h, (long long)i,
                             pa[i], pb[i]);
        }
}

Test(compress, deterministic) {
    pd_model *m = load(model_path);
    const pd_hparams *hp = pd_model_hparams(m);
    const int64_t n = 180;
    pd_token *t = random_tokens(n, hp->n_vocab, 3);
    for (int k = 0; k < PD_POLICY_COUNT; k++) {
        pd_policy_spec s;
        pd_policy_spec_default((pd_policy_kind)k, &s);
        pd_policy_spec_set_retention(&s, 0.25);
        pd_kv_prefix *a = compress(m, t, n, &s, NULL, NULL);
        pd_kv_prefix *b = compress(m, t, n, &s, NULL, NULL);
        assert_same_prefix(a, b, hp, pd_policy_kind_name((pd_policy_kind)k));
        pd_kv_prefix_free(a);
        pd_kv_prefix_free(b);
    }
    free(t);
    pd_model_free(m);
}

Test(compress, retention_one_is_the_full_prefix) {
    pd_model *m = load(model_path);
    const pd_hparams *hp = pd_model_hparams(m);
    const int64_t n = 150, n_text = 40;
    pd_token *t = random_tokens(n + n_text, hp->n_vocab, 4);
    pd_kv_prefix *full = full_prefix(m, t, n);
    const double nll_full = nll_after(m, full, t + n, n_text);
    static const char *const specs[] = {"compactor:retention=1", "snapkv:retention=1", "random:retention=1",
                                        "laserkv:retention=1", "pyramidkv:retention=1", "chunkkv:retention=1"};
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        pd_policy_spec s;
        parse(specs[i], &s);
        pd_compress_stats st;
        pd_kv_prefix *p = compress(m, t, n, &s, NULL, &st);
        assert_same_prefix(p, full, hp, specs[i]);
        cr_assert_eq(st.kept_total, (int64_t)hp->n_layer * hp->n_head_kv * n, "%s", specs[i]);
        const double nll = nll_after(m, p, t + n, n_text);
        cr_assert_eq(nll, nll_full, "%s: NLL %.17g, full prefix %.17g", specs[i], nll, nll_full);
        pd_compress_stats_free(&st);
        pd_kv_prefix_free(p);
    }
    pd_kv_prefix_free(full);
    free(t);
    pd_model_free(m);
}

Test(compress, compression_changes_the_nll) {
    pd_model *m = load(model_path);
    const pd_hparams *hp = pd_model_hparams(m);
    const int64_t n = 150, n_text = 40;
    pd_token *t = random_tokens(n + n_text, hp->n_vocab, 5);
    pd_kv_prefix *full = full_prefix(m, t, n);
    pd_policy_spec s;
    parse("snapkv:retention=0.1", &s);
    pd_kv_prefix *p = compress(m, t, n, &s, NULL, NULL);
    cr_assert_neq(nll_after(m, p, t + n, n_text), nll_after(m, full, t + n, n_text),
                  "a prefix with 90%% of its tokens evicted must change what follows");
    pd_kv_prefix_free(p);
    pd_kv_prefix_free(full);
    free(t);
    pd_model_free(m);
}

Test(compress, reuse_copies_indices_across_layer_pairs) {
    pd_model *m = load(model_path);
    const pd_hparams *hp = pd_model_hparams(m);
    const int64_t n = 160;
    pd_token *t = random_tokens(n, hp->n_vocab, 6);
    static const char *const specs[] = {"knorm:retention=0.25,reuse=2", "compactor:retention=0.25,sink=4,recent=4,reuse=2",
                                        "chunkkv:retention=0.25,reuse=2,scorer=knorm"};
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        pd_policy_spec s;
        parse(specs[i], &s);
        pd_kv_prefix *p = compress(m, t, n, &s, NULL, NULL);
        bool some_layers_differ = false;
        for (int l = 0; l < hp->n_layer; l++)
            for (int h = 0; h < hp->n_head_kv; h++) {
                const int32_t *a, *b;
                const int64_t la = pd_kv_prefix_stream(p, l, h, &a, NULL, NULL);
                const int lead = l - l % 2;
                const int64_t lb = pd_kv_prefix_stream(p, lead, h, &b, NULL, NULL);
                cr_assert_eq(la, lb, "%s", specs[i]);
                for (int64_t j = 0; j < la; j++)
                    cr_assert_eq(a[j], b[j], "%s: layer %d head %d differs from layer %d", specs[i], l, h, lead);
                if (l == 2) {
                    const int32_t *c;
                    const int64_t lc = pd_kv_prefix_stream(p, 0, h, &c, NULL, NULL);
                    if (lc != la || memcmp(a, c, sizeof *a * (size_t)la)) some_layers_differ = true;
                }
            }
        /* Otherwise the test could not tell reuse from a scorer that ignores the layer. */
        cr_assert(some_layers_differ, "%s: layers 0 and 2 chose the same tokens in every head", specs[i]);
        pd_kv_prefix_free(p);
    }
    free(t);
    pd_model_free(m);
}

/* ---- fair eviction ------------------------------------------------------ */

static const pd_span four_spans[] = {
    {.name = "a", .start = 0, .end = 30},
    {.name = "b", .start = 30, .end = 100},
    {.name = "c", .start = 100, .end = 150},
    {.name = "d", .start = 150, .end = 200},
};

static int64_t count_in(const int32_t *pos, int64_t len, int64_t lo, int64_t hi) {
    int64_t c = 0;
    for (int64_t i = 0; i < len; i++) c += pos[i] >= lo && pos[i] < hi;
    return c;
}

/* debias=1: every span keeps its share of the free budget (protected tokens
 * excluded), within the one entry largest-remainder rounding allows. */
static void check_fair_shares(const char *spec_text) {
    pd_model *m = load(model_path);
    const pd_hparams *hp = pd_model_hparams(m);
    const int64_t n = 200;
    pd_token *t = random_tokens(n, hp->n_vocab, 8);
    pd_layout lay = {.spans = four_spans, .n_spans = 4};
    pd_policy_spec s;
    parse(spec_text, &s);
    cr_assert(s.budget != PD_BUDGET_GLOBAL);
    pd_kv_prefix *p = compress(m, t, n, &s, &lay, NULL);
    const int64_t B = uniform_budget(&s, n);
    cr_assert_gt(B, s.sink + s.recent, "the test assumes no clipping of protected tokens");
    const int64_t free_budget = B - s.sink - s.recent;
    int64_t free_len[4], free_total = 0;
    for (int k = 0; k < 4; k++) {
        const int64_t lo = four_spans[k].start > s.sink ? four_spans[k].start : s.sink;
        const int64_t hi = four_spans[k].end < n - s.recent ? four_spans[k].end : n - s.recent;
        free_len[k] = hi > lo ? hi - lo : 0;
        free_total += free_len[k];
    }
    for (int l = 0; l < hp->n_layer; l++)
        for (int h = 0; h < hp->n_head_kv; h++) {
            const int32_t *pos;
            const int64_t len = pd_kv_prefix_stream(p, l, h, &pos, NULL, NULL);
            cr_assert_eq(len, B, "%s", spec_text);
            cr_assert_eq(count_in(pos, len, 0, s.sink), s.sink, "%s: sinks missing", spec_text);
            cr_assert_eq(count_in(pos, len, n - s.recent, n), s.recent, "%s: recent tokens missing", spec_text);
            for (int k = 0; k < 4; k++) {
                const int64_t lo = four_spans[k].start > s.sink ? four_spans[k].start : s.sink;
                const int64_t hi = four_spans[k].end < n - s.recent ? four_spans[k].end : n - s.recent;
                const int64_t got = hi > lo ? count_in(pos, len, lo, hi) : 0;
                const double want = (double)free_budget * (double)free_len[k] / (double)free_total;
                cr_assert(fabs((double)got - want) < 1.0, "%s: layer %d head %d span %s keeps %lld free tokens, fair share %.2f",
                          spec_text, l, h, four_spans[k].name, (long long)got, want);
            }
        }
    pd_kv_prefix_free(p);
    free(t);
    pd_model_free(m);
}

Test(compress, fair_debias_1_gives_equal_fractions) {
    check_fair_shares("snapkv:retention=0.25,fair=1,debias=1");
    check_fair_shares("snapkv:retention=0.1,fair=1,debias=1,local=1");
    check_fair_shares("tova:retention=0.25,fair=1,debias=1,local=1");
    check_fair_shares("knorm:retention=0.5,fair=1,debias=1");
}

/* The fair-eviction paper's fairness on the default policy: compactor
 * (global budget, 16 sinks, 64 recent tokens) with fair=1 keeps the same
 * fraction of every span but the sinks; the recent window competes inside
 * the last span's quota. (It used to be protected on top: with 4 equal
 * spans the last one kept most of its tokens and the others a few.) */
Test(compress, fair_debias_1_global_gives_equal_fractions_over_pairs) {
    pd_model *m = load(model_path);
    const pd_hparams *hp = pd_model_hparams(m);
    const int64_t n = 256;
    const int H = hp->n_head_kv;
    pd_token *t = random_tokens(n, hp->n_vocab, 9);
    static const pd_span equal[] = {
        {.name = "a", .start = 0, .end = 64},
        {.name = "b", .start = 64, .end = 128},
        {.name = "c", .start = 128, .end = 192},
        {.name = "d", .start = 192, .end = 256},
    };
    pd_layout lay = {.spans = equal, .n_spans = 4};
    pd_policy_spec s;
    parse("compactor:retention=0.5,fair=1", &s);
    cr_assert_eq(s.budget, PD_BUDGET_GLOBAL);
    cr_assert(s.sink == 16 && s.recent == 64, "the defaults this test is about");
    pd_kv_prefix *p = compress(m, t, n, &s, &lay, NULL);
    const int64_t B = uniform_budget(&s, n) * H;
    const int64_t free_budget = B - s.sink * H;
    for (int l = 0; l < hp->n_layer; l++) {
        int64_t got[4] = {0}, free_len[4] = {0}, free_total = 0;
        for (int h = 0; h < H; h++) {
            const int32_t *pos;
            const int64_t len = pd_kv_prefix_stream(p, l, h, &pos, NULL, NULL);
            cr_assert_eq(count_in(pos, len, 0, s.sink), s.sink, "sinks stay protected");
            for (int k = 0; k < 4; k++) {
                const int64_t lo = equal[k].start > s.sink ? equal[k].start : s.sink, hi = equal[k].end;
                got[k] += count_in(pos, len, lo, hi), free_len[k] += hi - lo;
            }
        }
        for (int k = 0; k < 4; k++) free_total += free_len[k];
        for (int k = 0; k < 4; k++) {
            const double want = (double)free_budget * (double)free_len[k] / (double)free_total;
            cr_assert(fabs((double)got[k] - want) < 1.0, "layer %d span %s keeps %lld free pairs, fair share %.2f", l,
                      equal[k].name, (long long)got[k], want);
        }
    }
    pd_kv_prefix_free(p);
    free(t);
    pd_model_free(m);
}

/* The issue-17 bar: with fair=1 every base policy keeps the same fraction
 * of each span's unprotected tokens (max / min <= 1.05) on a 4-span prefix
 * at retentions 0.5, 0.25 and 0.1, counted over all layers and kv heads;
 * and the per-span statistics agree with the kept positions. */
Test(compress, fair_keeps_equal_span_fractions_for_every_policy) {
    pd_model *m = load(model_path);
    const pd_hparams *hp = pd_model_hparams(m);
    const int64_t n = 400;
    pd_token *t = random_tokens(n, hp->n_vocab, 21);
    pd_span equal[4];
    for (int k = 0; k < 4; k++) {
        memset(&equal[k], 0, sizeof equal[k]);
        snprintf(equal[k].name, sizeof equal[k].name, "s%d", k);
        equal[k].start = n * k / 4;
        equal[k].end = n * (k + 1) / 4;
    }
    pd_layout lay = {.spans = equal, .n_spans = 4};
    static const double retentions[] = {0.5, 0.25, 0.1};
    for (int kind = 0; kind < PD_POLICY_COUNT; kind++)
        for (int r = 0; r < 3; r++) {
            char text[128];
            snprintf(text, sizeof text, "%s:retention=%g,fair=1", pd_policy_kind_name((pd_policy_kind)kind),
                     retentions[r]);
            pd_policy_spec s;
            parse(text, &s);
            pd_compress_stats st = {0};
            pd_kv_prefix *p = compress(m, t, n, &s, &lay, &st);
            cr_assert_eq(st.n_spans, 4, "%s", text);
            for (int l = 0; l < hp->n_layer; l++)
                for (int k = 0; k < 4; k++) {
                    int64_t kept = 0;
                    for (int h = 0; h < hp->n_head_kv; h++) {
                        const int32_t *pos;
                        const int64_t len = pd_kv_prefix_stream(p, l, h, &pos, NULL, NULL);
                        kept += count_in(pos, len, equal[k].start, equal[k].end);
                    }
                    cr_assert_eq(st.span_kept[l * 4 + k], kept, "%s: layer %d span %d", text, l, k);
                    cr_assert(st.span_protected[l * 4 + k] <= kept, "%s", text);
                }
            double lo = 2, hi = -1;
            for (int k = 0; k < 4; k++) {
                double f;
                pd_compress_span_fraction(&st, k, NULL, &f);
                lo = fmin(lo, f), hi = fmax(hi, f);
            }
            cr_assert(lo > 0 && hi / lo <= 1.05, "%s: unprotected kept fractions of the spans range over [%.4f, %.4f]",
                      text, lo, hi);
            pd_compress_stats_free(&st);
            pd_kv_prefix_free(p);
        }
    free(t);
    pd_model_free(m);
}

Test(compress, fair_debias_0_is_the_base_policy) {
    pd_model *m = load(model_path);
    const pd_hparams *hp = pd_model_hparams(m);
    const int64_t n = 200;
    pd_token *t = random_tokens(n, hp->n_vocab, 10);
    pd_layout lay = {.spans = four_spans, .n_spans = 4};
    static const char *const bases[] = {"snapkv:retention=0.25", "compactor:retention=0.1", "knorm:retention=0.5",
                                        "h2o:retention=0.25",    "tova:retention=0.1",      "random:retention=0.25"};
    for (size_t i = 0; i < sizeof bases / sizeof bases[0]; i++) {
        char fair_text[256];
        snprintf(fair_text, sizeof fair_text, "%s,fair=1,debias=0,local=0", bases[i]);
        pd_policy_spec base, fair;
        parse(bases[i], &base);
        parse(fair_text, &fair);
        pd_kv_prefix *a = compress(m, t, n, &base, NULL, NULL);
        pd_kv_prefix *b = compress(m, t, n, &fair, &lay, NULL);
        assert_same_positions(a, b, hp, fair_text);
        pd_kv_prefix_free(a);
        pd_kv_prefix_free(b);
    }
    free(t);
    pd_model_free(m);
}

Test(compress, whitelist_is_kept_in_every_layer_and_head) {
    pd_model *m = load(model_path);
    const pd_hparams *hp = pd_model_hparams(m);
    const int64_t n = 200;
    pd_token *t = random_tokens(n, hp->n_vocab, 11);
    const pd_range keep[] = {{50, 58}, {120, 123}};
    pd_span spans[4];
    memcpy(spans, four_spans, sizeof spans);
    spans[2].whitelist = false;
    pd_layout with_spans = {.spans = spans, .n_spans = 4, .whitelist = keep, .n_whitelist = 2};
    pd_span wl_spans[4];
    memcpy(wl_spans, four_spans, sizeof wl_spans);
    wl_spans[0].end = wl_spans[1].start = 12;
    wl_spans[0].whitelist = true; /* 12 tokens: fits the smallest budget below (20) */
    pd_layout wl_span = {.spans = wl_spans, .n_spans = 4};
    static const char *const specs[] = {"snapkv:retention=0.1", "compactor:retention=0.1", "streaming:retention=0.1",
                                        "chunkkv:retention=0.25", "laserkv:retention=0.25",
                                        "snapkv:retention=0.25,fair=1,debias=1"};
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++)
        for (int v = 0; v < 2; v++) {
            pd_policy_spec s;
            parse(specs[i], &s);
            const pd_layout *lay = v ? &wl_span : &with_spans;
            pd_compress_stats st;
            pd_kv_prefix *p = compress(m, t, n, &s, lay, &st);
            check_streams(p, hp, n, &st, specs[i]);
            check_budget(p, hp, n, &s, specs[i]);
            for (int l = 0; l < hp->n_layer; l++)
                for (int h = 0; h < hp->n_head_kv; h++) {
                    const int32_t *pos;
                    const int64_t len = pd_kv_prefix_stream(p, l, h, &pos, NULL, NULL);
                    if (v) {
                        cr_assert_eq(count_in(pos, len, 0, 12), 12, "%s: whitelisted span not kept in layer %d head %d",
                                     specs[i], l, h);
                    } else {
                        for (int r = 0; r < 2; r++)
                            cr_assert_eq(count_in(pos, len, keep[r].start, keep[r].end), keep[r].end - keep[r].start,
                                         "%s: keep range %lld-%lld not kept in layer %d head %d", specs[i],
                                         (long long)keep[r].start, (long long)keep[r].end, l, h);
                    }
                }
            pd_compress_stats_free(&st);
            pd_kv_prefix_free(p);
        }
    free(t);
    pd_model_free(m);
}

/* The hook's contract with the prefill, driven by hand. */
Test(compress, hook_checks_the_prefill_it_serves) {
    pd_model *m = load(model_path);
    const pd_hparams *hp = pd_model_hparams(m);
    pd_token *t = random_tokens(100, hp->n_vocab, 12);
    pd_policy_spec s;
    parse("snapkv:retention=0.5", &s);
    pd_compressor *c = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_compressor_create(&s, NULL, hp, 80, &c, &err), PD_OK, "%s", err.msg);
    pd_seq *seq = NULL;
    cr_assert_eq(pd_seq_create(m, 0, &seq, &err), PD_OK);
    pd_prefill_opts o = {.hook = pd_compressor_hook, .hook_ctx = c};
    cr_assert_neq(pd_prefill(m, seq, t, 100, &o, NULL, &err), PD_OK);
    cr_assert(strstr(err.msg, "80") && strstr(err.msg, "100"), "%s", err.msg);
    cr_assert_eq(pd_seq_pos(seq), 0, "a failed prefill leaves the sequence as it was");
    /* The right length works with the same compressor, and the stats add up. */
    cr_assert_eq(pd_prefill(m, seq, t, 80, &o, NULL, &err), PD_OK, "%s", err.msg);
    const pd_compress_stats *st = pd_compressor_stats(c);
    cr_assert_eq(st->kept_total, (int64_t)hp->n_layer * hp->n_head_kv * 40);
    for (int l = 0; l < hp->n_layer; l++)
        for (int h = 0; h < hp->n_head_kv; h++) cr_assert_eq(pd_seq_stream_len(seq, l, h), 40);
    pd_seq_free(seq);
    pd_compressor_free(c);
    free(t);
    pd_model_free(m);
}

Test(compress, bad_layouts_and_specs_are_errors) {
    pd_model *m = load(model_path);
    const pd_hparams *hp = pd_model_hparams(m);
    const int64_t n = 200;
    pd_token *t = random_tokens(n, hp->n_vocab, 13);
    pd_error err = {0};
    pd_kv_prefix *p = NULL;
    pd_policy_spec s;

    parse("snapkv:fair=1", &s);
    cr_assert_eq(pd_compress_prefix(m, t, n, &s, NULL, &p, NULL, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "fair") && strstr(err.msg, "spans"), "%s", err.msg);
    cr_assert_null(p);
    const pd_range only_keep[] = {{0, 5}};
    pd_layout no_spans = {.whitelist = only_keep, .n_whitelist = 1};
    cr_assert_eq(pd_compress_prefix(m, t, n, &s, &no_spans, &p, NULL, &err), PD_EINVAL, "%s", err.msg);

    /* Spans that stop short of the prefix. */
    parse("snapkv", &s);
    pd_layout short_spans = {.spans = four_spans, .n_spans = 3};
    cr_assert_neq(pd_compress_prefix(m, t, n, &s, &short_spans, &p, NULL, &err), PD_OK);
    cr_assert_null(p);
    /* A layout for a longer prefix. */
    pd_layout spans = {.spans = four_spans, .n_spans = 4};
    cr_assert_neq(pd_compress_prefix(m, t, 150, &s, &spans, &p, NULL, &err), PD_OK);
    /* A whitelist larger than the budget. */
    const pd_range big[] = {{10, 60}};
    pd_layout big_wl = {.whitelist = big, .n_whitelist = 1};
    parse("snapkv:retention=0.1", &s);
    cr_assert_eq(pd_compress_prefix(m, t, n, &s, &big_wl, &p, NULL, &err), PD_ERANGE, "%s", err.msg);
    cr_assert_null(p);
    /* An invalid spec struct (parse would refuse it). */
    parse("snapkv", &s);
    s.retention = 0;
    cr_assert_eq(pd_compress_prefix(m, t, n, &s, NULL, &p, NULL, &err), PD_EINVAL);
    parse("snapkv", &s);
    s.retention = 1.5;
    cr_assert_eq(pd_compress_prefix(m, t, n, &s, NULL, &p, NULL, &err), PD_EINVAL);
    /* Empty and over-long prefixes. */
    parse("snapkv", &s);
    cr_assert_eq(pd_compress_prefix(m, t, 0, &s, NULL, &p, NULL, &err), PD_EINVAL);
    pd_token *longer = random_tokens(hp->n_ctx_train + 1, hp->n_vocab, 14);
    cr_assert_eq(pd_compress_prefix(m, longer, hp->n_ctx_train + 1, &s, NULL, &p, NULL, &err), PD_ERANGE);
    cr_assert(strstr(err.msg, "context"), "%s", err.msg);
    free(longer);
    free(t);
    pd_model_free(m);
}

/* ---- the calibration curve --------------------------------------------- */

static double ref_eval(double a, double b, double r) { return 1.0 + a * (pow(r, -b) - 1.0); }

static double ref_loss(const double *r, const double *y, int m, double uw, double a, double b) {
    double s = 0;
    for (int i = 0; i < m; i++) {
        const double e = y[i] - ref_eval(a, b, r[i]);
        s += (e > 0 ? uw : 1.0) * e * e;
    }
    return s;
}

Test(curve, eval_and_inverse_match_the_formula) {
    static const pd_curve cs[] = {{0.3, 0.7}, {0.05, 1.5}, {2.0, 0.2}, {1e-3, 5.0}};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        cr_assert_eq(pd_curve_eval(cs[i], 1.0), 1.0);
        for (double x = 0.02; x <= 1.0; x += 0.02) {
            const double f = pd_curve_eval(cs[i], x);
            cr_assert(fabs(f - ref_eval(cs[i].a, cs[i].b, x)) <= 1e-12 * f, "f(%g) = %.17g", x, f);
            const double back = pd_curve_inverse(cs[i], f, 1e-9);
            if (f > 1 + 1e-12) cr_assert(fabs(back - x) <= 1e-9 * x, "a=%g b=%g: inverse(f(%g)) = %.17g", cs[i].a, cs[i].b, x, back);
            /* The smallest retention within the budget: a bit less would exceed it. */
            if (back > 1e-6 && back < 1) cr_assert_gt(pd_curve_eval(cs[i], back * (1 - 1e-6)), f);
        }
        /* Clamping and the no-compression cases. */
        cr_assert_eq(pd_curve_inverse(cs[i], 1.0, 0.05), 1.0);
        cr_assert_eq(pd_curve_inverse(cs[i], 0.9, 0.05), 1.0);
        cr_assert_eq(pd_curve_inverse(cs[i], 1e12, 0.05), 0.05);
        cr_assert_eq(pd_curve_inverse(cs[i], 1e12, 2.0), 1.0);
    }
    cr_assert_eq(pd_curve_inverse((pd_curve){0, 1}, 1.1, 0.05), 1.0, "an unusable curve never compresses");
    cr_assert_eq(pd_curve_inverse((pd_curve){NAN, 1}, 1.1, 0.05), 1.0);
}

Test(curve, fit_recovers_known_curves_from_exact_points) {
    static const double pts[][2] = {{0.3, 0.7}, {0.05, 1.5}, {2.0, 0.2}, {0.8, 0.05}, {0.01, 3.0}};
    static const double r[] = {0.5, 0.25, 0.125, 0.0625};
    for (size_t i = 0; i < sizeof pts / sizeof pts[0]; i++) {
        double y[4];
        for (int k = 0; k < 4; k++) y[k] = ref_eval(pts[i][0], pts[i][1], r[k]);
        pd_curve c;
        pd_error err = {0};
        cr_assert_eq(pd_curve_fit(r, y, 4, 4.0, &c, &err), PD_OK, "%s", err.msg);
        cr_assert(fabs(c.a - pts[i][0]) <= 1e-4 * pts[i][0] && fabs(c.b - pts[i][1]) <= 1e-4 * pts[i][1],
                  "true (%g, %g), fitted (%.10g, %.10g)", pts[i][0], pts[i][1], c.a, c.b);
        /* Two points determine the curve too. */
        cr_assert_eq(pd_curve_fit(r + 1, y + 1, 2, 1.0, &c, &err), PD_OK, "%s", err.msg);
        cr_assert(fabs(c.a - pts[i][0]) <= 1e-4 * pts[i][0] && fabs(c.b - pts[i][1]) <= 1e-4 * pts[i][1],
                  "two points: true (%g, %g), fitted (%.10g, %.10g)", pts[i][0], pts[i][1], c.a, c.b);
    }
}

/* Noisy points: the fit is at least as good as a brute-force search of the
 * same loss over a fine (log a, log b) grid, and weighting under-prediction
 * moves the curve above the points. */
Test(curve, asymmetric_loss_pushes_the_fit_above_the_points) {
    static const double r[] = {0.5, 0.35, 0.25, 0.18, 0.125, 0.09, 0.0625};
    static const double noise[] = {0.02, -0.03, 0.025, -0.015, 0.03, -0.02, 0.01};
    double y[7];
    for (int k = 0; k < 7; k++) y[k] = ref_eval(0.2, 0.6, r[k]) * (1 + noise[k]);
    pd_curve sym, asym;
    pd_error err = {0};
    cr_assert_eq(pd_curve_fit(r, y, 7, 1.0, &sym, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_curve_fit(r, y, 7, 4.0, &asym, &err), PD_OK, "%s", err.msg);
    static const double uws[] = {1.0, 4.0};
    const pd_curve *fits[] = {&sym, &asym};
    for (int w = 0; w < 2; w++) {
        double best = INFINITY;
        for (double la = log(1e-3); la <= log(10.0); la += 0.01)
            for (double lb = log(1e-2); lb <= log(5.0); lb += 0.01)
                best = fmin(best, ref_loss(r, y, 7, uws[w], exp(la), exp(lb)));
        const double got = ref_loss(r, y, 7, uws[w], fits[w]->a, fits[w]->b);
        cr_assert_leq(got, best * (1 + 1e-9), "weight %g: fitted loss %.10g, grid search %.10g", uws[w], got, best);
    }
    int under_sym = 0, under_asym = 0;
    double excess_sym = 0, excess_asym = 0;
    for (int k = 0; k < 7; k++) {
        const double es = y[k] - ref_eval(sym.a, sym.b, r[k]), ea = y[k] - ref_eval(asym.a, asym.b, r[k]);
        under_sym += es > 0, under_asym += ea > 0;
        excess_sym += fmax(es, 0), excess_asym += fmax(ea, 0);
        cr_assert_geq(ref_eval(asym.a, asym.b, r[k]), ref_eval(sym.a, sym.b, r[k]) - 1e-12,
                      "at %g the weighted fit is below the symmetric one", r[k]);
    }
    cr_assert_lt(excess_asym, excess_sym, "under-prediction %.6g (weighted) vs %.6g (symmetric)", excess_asym,
                 excess_sym);
    cr_assert_leq(under_asym, under_sym);
}

Test(curve, ratios_below_one_fit_the_flattest_curve) {
    static const double r[] = {0.5, 0.25, 0.125};
    static const double y[] = {0.99, 0.98, 0.995};
    pd_curve c;
    pd_error err = {0};
    cr_assert_eq(pd_curve_fit(r, y, 3, 4.0, &c, &err), PD_OK, "%s", err.msg);
    cr_assert(c.a > 0 && c.b > 0);
    cr_assert_lt(c.a, 1e-6, "compression that never hurts fits a ~ 0, got %g", c.a);
    cr_assert_eq(pd_curve_inverse(c, 1.05, 0.05), 0.05);
}

Test(curve, bad_input_is_an_error) {
    const double r[] = {0.5, 0.25}, y[] = {1.1, 1.3};
    pd_curve c;
    pd_error err = {0};
    cr_assert_eq(pd_curve_fit(r, y, 1, 4.0, &c, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "at least 2"), "%s", err.msg);
    cr_assert_eq(pd_curve_fit(r, y, 2, 0.0, &c, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "under_weight"), "%s", err.msg);
    const double r0[] = {0.5, 0.0}, r2[] = {0.5, 1.5}, ones[] = {1.0, 1.0};
    cr_assert_eq(pd_curve_fit(r0, y, 2, 4.0, &c, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "retention[1]"), "%s", err.msg);
    cr_assert_eq(pd_curve_fit(r2, y, 2, 4.0, &c, &err), PD_EINVAL);
    cr_assert_eq(pd_curve_fit(ones, y, 2, 4.0, &c, &err), PD_EINVAL);
    const double yneg[] = {1.1, -1.0}, ynan[] = {NAN, 1.2}, yzero[] = {0.0, 1.2};
    cr_assert_eq(pd_curve_fit(r, yneg, 2, 4.0, &c, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "ratio[1]"), "%s", err.msg);
    cr_assert_eq(pd_curve_fit(r, ynan, 2, 4.0, &c, &err), PD_EINVAL);
    cr_assert_eq(pd_curve_fit(r, yzero, 2, 4.0, &c, &err), PD_EINVAL);
}

Test(curve, default_options) {
    pd_calib_opts o;
    pd_calib_opts_default(&o);
    cr_assert_eq(o.n_points, 4);
    cr_assert_eq(o.points[0], 0.5);
    cr_assert_eq(o.points[3], 0.0625);
    cr_assert_eq(o.min_retention, 0.05);
    cr_assert_eq(o.holdout, 0.2);
    cr_assert_eq(o.under_weight, 4.0);
    cr_assert_null(o.probe);
    cr_assert_gt(o.tau, 1.0);
}

/* ---- calibration on the real model ------------------------------------- */

/* n tokens sampled from BOS at temperature 1: text the model itself finds
 * natural, so compression has structure to lose. */
static pd_token *sample_story(pd_model *m, uint64_t seed, int64_t n) {
    const int32_t V = pd_model_hparams(m)->n_vocab;
    pd_token *t = malloc(sizeof *t * (size_t)n);
    float *logits = malloc(sizeof(float) * (size_t)V);
    cr_assert(t && logits);
    pd_sampler_params sp = pd_sampler_params_default();
    sp.temperature = 1.0f;
    sp.seed = seed;
    sp.penalty_last_n = 0;
    pd_sampler *smp = NULL;
    pd_seq *s = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_sampler_create(&sp, V, &smp, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_create(m, 0, &s, &err), PD_OK, "%s", err.msg);
    t[0] = pd_tokenizer_bos(pd_model_tokenizer(m));
    cr_assert_eq(pd_prefill(m, s, t, 1, NULL, logits, &err), PD_OK, "%s", err.msg);
    for (int64_t i = 1; i < n; i++) {
        pd_sample_result r;
        cr_assert_eq(pd_sampler_sample(smp, logits, &r, &err), PD_OK, "%s", err.msg);
        t[i] = r.token;
        if (i + 1 < n) cr_assert_eq(pd_decode(m, &s, &t[i], 1, logits, &err), PD_OK, "%s", err.msg);
    }
    pd_seq_free(s);
    pd_sampler_free(smp);
    free(logits);
    return t;
}

static double compressed_ratio(pd_model *m, const pd_token *t, int64_t n_prefix, const pd_policy_spec *s,
                               const pd_layout *lay, const pd_token *text, int64_t n_text) {
    pd_kv_prefix *full = full_prefix(m, t, n_prefix);
    pd_kv_prefix *p = compress(m, t, n_prefix, s, lay, NULL);
    const double r = nll_after(m, p, text, n_text) / nll_after(m, full, text, n_text);
    pd_kv_prefix_free(p);
    pd_kv_prefix_free(full);
    return r;
}

/* pd_calibrate's measurements are what the plain API gives on the split it
 * documents (the first 80% as prefix, the last 20% as probe), the choice is
 * checked on the probe, and the returned spec differs only in retention. */
Test(compress, calibration_measures_what_it_reports) {
    TH_REQUIRE_SHARED();
    pd_model *m = load_stories();
    const int64_t n = 400, n_prefix = 320;
    pd_token *t = sample_story(m, 77, n);
    pd_policy_spec s, chosen;
    parse("snapkv", &s);
    pd_calib_opts o;
    pd_calib_opts_default(&o);
    o.tau = 1.05;
    pd_calib_result r;
    pd_error err = {0};
    cr_assert_eq(pd_calibrate(m, t, n, &s, NULL, &o, &r, &chosen, &err), PD_OK, "%s", err.msg);
    cr_assert_geq(r.n_points, 4);
    cr_assert_leq(r.n_points, PD_CALIB_MAX_POINTS);
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(r.retention[i], o.points[i]);
        pd_policy_spec at = s;
        pd_policy_spec_set_retention(&at, o.points[i]);
        const double want = compressed_ratio(m, t, n_prefix, &at, NULL, t + n_prefix, n - n_prefix);
        cr_assert(fabs(r.ratio[i] - want) <= 1e-12 * want, "point %g: reported %.17g, recomputed %.17g",
                  o.points[i], r.ratio[i], want);
    }
    pd_kv_prefix *full = full_prefix(m, t, n_prefix);
    cr_assert(fabs(r.nll_full - nll_after(m, full, t + n_prefix, n - n_prefix)) <= 1e-12 * r.nll_full);
    pd_kv_prefix_free(full);
    cr_assert(r.chosen >= o.min_retention && r.chosen <= 1, "chosen %g", r.chosen);
    cr_assert_leq(r.measured, o.tau, "the choice is checked on the probe: measured %g", r.measured);
    if (r.chosen < 1) {
        pd_policy_spec at = s;
        pd_policy_spec_set_retention(&at, r.chosen);
        const double want = compressed_ratio(m, t, n_prefix, &at, NULL, t + n_prefix, n - n_prefix);
        cr_assert(fabs(r.measured - want) <= 1e-12 * want, "measured %.17g, recomputed %.17g", r.measured, want);
    }
    cr_assert(fabs(r.predicted - pd_curve_eval(r.curve, r.chosen)) <= 1e-12 * r.predicted);
    cr_assert_eq(chosen.retention, r.chosen);
    char a[PD_POLICY_SPEC_MAX], b[PD_POLICY_SPEC_MAX];
    pd_policy_spec_set_retention(&chosen, s.retention);
    pd_policy_spec_print(&chosen, a, sizeof a);
    pd_policy_spec_print(&s, b, sizeof b);
    cr_assert_str_eq(a, b, "only the retention may change");
    free(t);
    pd_model_free(m);
}

Test(compress, calibration_with_a_probe_and_a_clipped_layout) {
    TH_REQUIRE_SHARED();
    pd_model *m = load_stories();
    const int64_t n = 300, n_probe = 60;
    pd_token *t = sample_story(m, 78, n + n_probe);
    pd_policy_spec s;
    parse("compactor", &s);
    pd_calib_opts o;
    pd_calib_opts_default(&o);
    o.tau = 1.1;
    o.probe = t + n;
    o.n_probe = n_probe;
    pd_calib_result r;
    pd_error err = {0};
    cr_assert_eq(pd_calibrate(m, t, n, &s, NULL, &o, &r, NULL, &err), PD_OK, "%s", err.msg);
    pd_policy_spec at = s;
    pd_policy_spec_set_retention(&at, o.points[1]);
    const double want = compressed_ratio(m, t, n, &at, NULL, t + n, n_probe);
    cr_assert(fabs(r.ratio[1] - want) <= 1e-12 * want, "with a probe the whole prefix is compressed");

    /* Fair eviction needs spans; without a probe they are cut to the
     * calibration prefix (the first 240 of 300 tokens). */
    const pd_span spans[] = {{.name = "a", .start = 0, .end = 100}, {.name = "b", .start = 100, .end = 250},
                             {.name = "c", .start = 250, .end = 300}};
    pd_layout lay = {.spans = spans, .n_spans = 3};
    parse("snapkv:fair=1", &s);
    pd_calib_opts_default(&o);
    o.tau = 1.1;
    cr_assert_eq(pd_calibrate(m, t, n, &s, &lay, &o, &r, NULL, &err), PD_OK, "%s", err.msg);
    const pd_span clipped[] = {{.name = "a", .start = 0, .end = 100}, {.name = "b", .start = 100, .end = 240}};
    pd_layout clay = {.spans = clipped, .n_spans = 2};
    at = s;
    pd_policy_spec_set_retention(&at, o.points[0]);
    const double want2 = compressed_ratio(m, t, 240, &at, &clay, t + 240, 60);
    cr_assert(fabs(r.ratio[0] - want2) <= 1e-12 * want2, "reported %.17g, with the clipped layout %.17g", r.ratio[0],
              want2);
    cr_assert_eq(pd_calibrate(m, t, n, &s, NULL, &o, &r, NULL, &err), PD_EINVAL, "fair=1 without spans");
    free(t);
    pd_model_free(m);
}

Test(compress, calibration_rejects_bad_options) {
    pd_model *m = load(model_path);
    const pd_hparams *hp = pd_model_hparams(m);
    pd_token *t = random_tokens(200, hp->n_vocab, 15);
    pd_policy_spec s;
    parse("snapkv", &s);
    pd_calib_opts o;
    pd_calib_result r;
    pd_error err = {0};
    pd_calib_opts_default(&o);
    cr_assert_eq(pd_calibrate(m, t, 40, &s, NULL, &o, &r, NULL, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "holdout") && strstr(err.msg, "16"), "%s", err.msg);
    o.holdout = 0.9; /* leaves 20 tokens of prefix */
    cr_assert_eq(pd_calibrate(m, t, 200, &s, NULL, &o, &r, NULL, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "32"), "%s", err.msg);
    o.holdout = 1.0;
    cr_assert_eq(pd_calibrate(m, t, 200, &s, NULL, &o, &r, NULL, &err), PD_EINVAL);
    pd_calib_opts_default(&o);
    o.tau = 1.0;
    cr_assert_eq(pd_calibrate(m, t, 200, &s, NULL, &o, &r, NULL, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "tau"), "%s", err.msg);
    pd_calib_opts_default(&o);
    o.n_points = 1;
    cr_assert_eq(pd_calibrate(m, t, 200, &s, NULL, &o, &r, NULL, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "n_points"), "%s", err.msg);
    pd_calib_opts_default(&o);
    o.points[2] = 1.0;
    cr_assert_eq(pd_calibrate(m, t, 200, &s, NULL, &o, &r, NULL, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "points[2]"), "%s", err.msg);
    pd_calib_opts_default(&o);
    o.min_retention = 0;
    cr_assert_eq(pd_calibrate(m, t, 200, &s, NULL, &o, &r, NULL, &err), PD_EINVAL);
    pd_calib_opts_default(&o);
    o.probe = t;
    o.n_probe = 1;
    cr_assert_eq(pd_calibrate(m, t, 200, &s, NULL, &o, &r, NULL, &err), PD_EINVAL);
    free(t);
    pd_model_free(m);
}

/* On stories the model wrote: calibrate on each story's prefix alone, then
 * compress that prefix at the chosen retention and score the story's real
 * continuation. The choice is verified on the probe (measured <= tau), but
 * the continuation is other text: on this 260K-parameter model the ratio of
 * 100 tokens moves by a few percent from story to story at any retention
 * (policy-eval: std 0.01-0.05 at retention 0.25), so some misses are
 * expected: this test sees 15 of 24 (62%), and `make eval` similar rates
 * (docs/policies.md). The bound, at least half, leaves room for that noise
 * (a few borderline stories may flip with other float kernels); the second
 * assertion fails a calibration that ignores tau, since always compressing
 * to the minimum retention hits only 8 of 24. */
Test(compress, calibration_holds_on_held_out_continuations, .timeout = 300) {
    TH_REQUIRE_SHARED();
    pd_model *m = load_stories();
    const int64_t n_prefix = 400, n_cont = 100;
    static const char *const specs[] = {"compactor", "snapkv"};
    static const double taus[] = {1.05, 1.10};
    enum { N_STORIES = 6 };
    pd_token *stories[N_STORIES];
    for (int k = 0; k < N_STORIES; k++) stories[k] = sample_story(m, 201 + (uint64_t)k, n_prefix + n_cont);
    int hits = 0, trials = 0, low_hits = 0;
    for (size_t p = 0; p < sizeof specs / sizeof specs[0]; p++)
        for (size_t q = 0; q < sizeof taus / sizeof taus[0]; q++)
            for (int k = 0; k < N_STORIES; k++) {
                pd_policy_spec s, chosen;
                parse(specs[p], &s);
                pd_calib_opts o;
                pd_calib_opts_default(&o);
                o.tau = taus[q];
                pd_calib_result r;
                pd_error err = {0};
                cr_assert_eq(pd_calibrate(m, stories[k], n_prefix, &s, NULL, &o, &r, &chosen, &err), PD_OK, "%s",
                             err.msg);
                cr_assert_leq(r.measured, o.tau);
                const double ratio =
                    compressed_ratio(m, stories[k], n_prefix, &chosen, NULL, stories[k] + n_prefix, n_cont);
                hits += ratio <= o.tau;
                trials++;
                /* The baseline a calibration must beat: always the minimum retention. */
                pd_policy_spec low = s;
                pd_policy_spec_set_retention(&low, o.min_retention);
                low_hits += compressed_ratio(m, stories[k], n_prefix, &low, NULL, stories[k] + n_prefix, n_cont) <= o.tau;
                cr_log_info("%s tau %.2f story %d: chosen %.4f (probe %.4f), continuation ratio %.4f", specs[p],
                            o.tau, k, r.chosen, r.measured, ratio);
            }
    cr_log_info("calibration hit rate %d/%d; retention %.2f always: %d/%d", hits, trials, 0.05, low_hits, trials);
    cr_assert_geq(hits * 2, trials, "hit rate %d/%d is below one half", hits, trials);
    cr_assert_gt(hits, low_hits, "calibration (%d hits) must beat the minimum retention (%d hits)", hits, low_hits);
    for (int k = 0; k < N_STORIES; k++) free(stories[k]);
    pd_model_free(m);
}

/* ---- prefixctl compress ------------------------------------------------ */

static const char *prefixctl(void) {
    const char *p = getenv("PD_PREFIXCTL");
    cr_assert(p, "PD_PREFIXCTL is not set");
    return p;
}

static int run(char **out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int run(char **out, const char *fmt, ...) {
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    return th_run(cmd, out);
}

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    cr_assert(f, "%s", path);
    fputs(text, f);
    fclose(f);
}

static const char story_text[] =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she "
    "saw a big, red ball. She wanted to play with it, but it was too high. Lily asked her mom to help her. Her "
    "mom smiled and said, \"Let's get the ball together.\" They went to the tree and her mom lifted Lily up high. "
    "Lily took the ball and laughed. Then a little dog came running to them. The dog wanted to play too. Lily "
    "threw the ball and the dog ran after it. The dog brought the ball back and wagged its tail. Lily and the dog "
    "played all day long. When the sun went down, Lily was tired and happy. She hugged the dog and said goodbye. "
    "Her mom took her home and gave her a warm bath. Lily went to bed and dreamed about the park, the red ball and "
    "her new friend the dog.";
static const char eval_text[] =
    " The next day, Lily went back to the park with her mom. She looked for the dog everywhere. Then she saw "
    "it under the big tree, waiting for her with the red ball.";

static int64_t count_tokens(pd_model *m, const char *text, bool bos) {
    pd_token *ids = NULL;
    size_t n = 0;
    pd_error err = {0};
    pd_tokenize_opts o = {.add_special = bos};
    cr_assert_eq(pd_tokenize(pd_model_tokenizer(m), text, strlen(text), o, &ids, &n, &err), PD_OK, "%s", err.msg);
    free(ids);
    return (int64_t)n;
}

static long long number_after(const char *out, const char *label) {
    const char *p = strstr(out, label);
    cr_assert(p, "'%s' not in:\n%s", label, out);
    return strtoll(p + strlen(label), NULL, 10);
}

static double double_after(const char *out, const char *label) {
    const char *p = strstr(out, label);
    cr_assert(p, "'%s' not in:\n%s", label, out);
    return strtod(p + strlen(label), NULL);
}

Test(compress, prefixctl_compress_with_retention_spans_and_eval) {
    char text[1024], evalf[1024], spans[1024];
    snprintf(text, sizeof text, "%s/story.txt", tmpdir);
    snprintf(evalf, sizeof evalf, "%s/eval.txt", tmpdir);
    snprintf(spans, sizeof spans, "%s/spans.txt", tmpdir);
    write_file(text, story_text);
    write_file(evalf, eval_text);
    pd_model *m = load(model_path);
    const pd_hparams *hp = pd_model_hparams(m);
    const int64_t n = count_tokens(m, story_text, true);
    cr_assert_gt(n, 100);

    char *out = NULL;
    cr_assert_eq(run(&out, "%s compress --model %s --policy snapkv --retention 0.25 --text %s --threads 2 2>&1",
                     prefixctl(), model_path, text),
                 0, "%s", out);
    cr_assert(strstr(out, "policy: snapkv:") && strstr(out, "retention=0.25"), "%s", out);
    cr_assert_eq(number_after(out, "prefix: "), n, "%s", out);
    const int64_t per_head = (int64_t)floor(0.25 * (double)n + 1e-9), all = (int64_t)hp->n_layer * hp->n_head_kv * n;
    cr_assert_eq(number_after(out, "kept: "), per_head * hp->n_layer * hp->n_head_kv, "%s", out);
    char layer_line[128];
    snprintf(layer_line, sizeof layer_line, "layer  0: kept %6lld of %lld", (long long)(per_head * hp->n_head_kv),
             (long long)(n * hp->n_head_kv));
    cr_assert(strstr(out, layer_line), "'%s' not in:\n%s", layer_line, out);
    cr_assert(strstr(out, "layer  3: kept"), "%s", out);
    char want[64];
    snprintf(want, sizeof want, "of %lld (layer, head, token)", (long long)all);
    cr_assert(strstr(out, want), "%s", out);
    cr_assert(strstr(out, "time: scoring and selection"), "%s", out);
    free(out);

    /* Spans with a kept range, fair eviction, and the eval text. */
    char spans_text[256];
    snprintf(spans_text, sizeof spans_text, "# name start end\nopening 0 40\nmiddle 40 100\nrest 100 %lld\nkeep 10 14\n",
             (long long)n);
    write_file(spans, spans_text);
    cr_assert_eq(run(&out, "%s compress --model %s --policy snapkv:fair=1 --retention 0.5 --text %s --spans %s "
                           "--eval %s --threads 2 2>&1",
                     prefixctl(), model_path, text, spans, evalf),
                 0, "%s", out);
    cr_assert(strstr(out, "layout: spans=opening:0-40,middle:40-100,rest:100-"), "%s", out);
    cr_assert(strstr(out, ";keep=10-14"), "%s", out);
    cr_assert(strstr(out, "fair=1"), "%s", out);
    const double nll_full = double_after(out, "mean NLL full prefix "), nll_comp = double_after(out, ", compressed ");
    const double ratio = double_after(out, ", ratio ");

    /* The same numbers through the library. */
    pd_token *ids = NULL, *eids = NULL;
    size_t n_ids = 0, n_e = 0;
    pd_error err = {0};
    pd_tokenize_opts with_bos = {.add_special = true}, plain = {.add_special = false};
    cr_assert_eq(pd_tokenize(pd_model_tokenizer(m), story_text, strlen(story_text), with_bos, &ids, &n_ids, &err), 0);
    cr_assert_eq(pd_tokenize(pd_model_tokenizer(m), eval_text, strlen(eval_text), plain, &eids, &n_e, &err), 0);
    pd_layout lay;
    cr_assert_eq(pd_layout_parse(spans_text, &lay, &err), PD_OK, "%s", err.msg);
    pd_policy_spec s;
    parse("snapkv:fair=1,retention=0.5", &s);
    pd_kv_prefix *full = full_prefix(m, ids, n), *p = compress(m, ids, n, &s, &lay, NULL);
    const double want_full = nll_after(m, full, eids, (int64_t)n_e), want_comp = nll_after(m, p, eids, (int64_t)n_e);
    cr_assert(fabs(nll_full - want_full) < 1e-6 && fabs(nll_comp - want_comp) < 1e-6,
              "prefixctl %.6f / %.6f, library %.6f / %.6f", nll_full, nll_comp, want_full, want_comp);
    cr_assert(fabs(ratio - want_comp / want_full) < 1e-6);
    for (int l = 0; l < hp->n_layer; l++)
        for (int h = 0; h < hp->n_head_kv; h++) {
            const int32_t *pos;
            const int64_t len = pd_kv_prefix_stream(p, l, h, &pos, NULL, NULL);
            cr_assert_eq(count_in(pos, len, 10, 14), 4, "the kept range is kept");
        }
    pd_kv_prefix_free(p);
    pd_kv_prefix_free(full);
    pd_layout_free(&lay);
    free(ids);
    free(eids);
    free(out);
    pd_model_free(m);
}

static double json_num(json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    cr_assert(json_is_number(v), "'%s' is not a number", key);
    return json_number_value(v);
}

static bool close_to(double got, double want) { return fabs(got - want) <= 1e-12 * fmax(1.0, fabs(want)); }

/* Every number of a --json report against pd_compress_prefix of the same
 * tokens, spec and layout. */
static void check_json_report(json_t *j, pd_model *m, const pd_token *ids, int64_t n, const pd_policy_spec *s,
                              const pd_layout *lay) {
    pd_compress_stats st = {0};
    pd_kv_prefix *p = compress(m, ids, n, s, lay, &st);
    char buf[PD_POLICY_SPEC_MAX], layout[PD_PREFIX_SPEC_MAX];
    pd_policy_spec_print(s, buf, sizeof buf);
    cr_assert_str_eq(json_string_value(json_object_get(j, "spec")), buf);
    if (lay) {
        pd_layout_print(lay, layout, sizeof layout);
        cr_assert_str_eq(json_string_value(json_object_get(j, "layout")), layout);
    } else {
        cr_assert_null(json_object_get(j, "layout"));
    }
    cr_assert_eq(th_json_int(j, "prefix_tokens", NULL), n);
    cr_assert_eq(th_json_int(j, "kept_entries", NULL), st.kept_total);
    const double all = (double)n * st.n_layer * st.n_head_kv;
    cr_assert(close_to(json_num(j, "kept_fraction"), (double)st.kept_total / all));
    json_t *layers = json_object_get(j, "layers"), *heads = json_object_get(j, "heads");
    cr_assert_eq(json_array_size(layers), (size_t)st.n_layer);
    cr_assert_eq(json_array_size(heads), (size_t)st.n_layer);
    for (int l = 0; l < st.n_layer; l++) {
        int64_t kept = 0;
        json_t *row = json_array_get(heads, (size_t)l);
        cr_assert_eq(json_array_size(row), (size_t)st.n_head_kv);
        for (int h = 0; h < st.n_head_kv; h++) {
            const int64_t k = st.kept[l * st.n_head_kv + h];
            kept += k;
            cr_assert(close_to(json_number_value(json_array_get(row, (size_t)h)), (double)k / (double)n));
        }
        cr_assert(close_to(json_number_value(json_array_get(layers, (size_t)l)),
                           (double)kept / ((double)n * st.n_head_kv)), "layer %d", l);
    }
    json_t *spans = json_object_get(j, "spans");
    if (!lay || lay->n_spans == 0) {
        cr_assert_null(spans);
    } else {
        cr_assert_eq(json_array_size(spans), (size_t)lay->n_spans);
        for (int i = 0; i < lay->n_spans; i++) {
            json_t *sp = json_array_get(spans, (size_t)i);
            double frac, unprot;
            pd_compress_span_fraction(&st, i, &frac, &unprot);
            cr_assert_str_eq(json_string_value(json_object_get(sp, "name")), lay->spans[i].name);
            cr_assert_eq(th_json_int(sp, "start", NULL), lay->spans[i].start);
            cr_assert_eq(th_json_int(sp, "end", NULL), lay->spans[i].end);
            cr_assert_eq(th_json_int(sp, "tokens", NULL), lay->spans[i].end - lay->spans[i].start);
            cr_assert(close_to(json_num(sp, "kept_fraction"), frac), "span %d", i);
            cr_assert(close_to(json_num(sp, "unprotected_kept_fraction"), unprot), "span %d", i);
        }
    }
    json_t *ranges = json_object_get(j, "kept_ranges");
    cr_assert_eq(json_array_size(ranges), lay ? (size_t)lay->n_whitelist : 0u);
    for (int i = 0; lay && i < lay->n_whitelist; i++) {
        json_t *r = json_array_get(ranges, (size_t)i);
        cr_assert_eq(json_integer_value(json_array_get(r, 0)), lay->whitelist[i].start);
        cr_assert_eq(json_integer_value(json_array_get(r, 1)), lay->whitelist[i].end);
    }
    pd_compress_stats_free(&st);
    pd_kv_prefix_free(p);
}

static pd_token *tokens_of(pd_model *m, const char *text, bool bos, int64_t *n) {
    pd_token *ids = NULL;
    size_t len = 0;
    pd_error err = {0};
    pd_tokenize_opts o = {.add_special = bos};
    cr_assert_eq(pd_tokenize(pd_model_tokenizer(m), text, strlen(text), o, &ids, &len, &err), PD_OK, "%s", err.msg);
    *n = (int64_t)len;
    return ids;
}

Test(compress, prefixctl_compress_json_matches_the_library) {
    char text[1024], evalf[1024], spans[1024];
    snprintf(text, sizeof text, "%s/story.txt", tmpdir);
    snprintf(evalf, sizeof evalf, "%s/eval.txt", tmpdir);
    snprintf(spans, sizeof spans, "%s/spans.txt", tmpdir);
    write_file(text, story_text);
    write_file(evalf, eval_text);
    pd_model *m = load(model_path);
    int64_t n, n_e;
    pd_token *ids = tokens_of(m, story_text, true, &n), *eids = tokens_of(m, eval_text, false, &n_e);
    pd_error err = {0};

    /* A span file with a kept range, fair eviction and an eval text. */
    char spans_text[256];
    snprintf(spans_text, sizeof spans_text, "opening 0 40\nmiddle 40 100\nrest 100 %lld\nkeep 10 14\n", (long long)n);
    write_file(spans, spans_text);
    char *out = NULL;
    cr_assert_eq(run(&out, "%s compress --model %s --policy snapkv:fair=1 --retention 0.5 --text %s --spans %s "
                           "--eval %s --threads 2 --json",
                     prefixctl(), model_path, text, spans, evalf),
                 0, "%s", out);
    json_t *j = th_json_parse(out);
    free(out);
    pd_layout lay;
    cr_assert_eq(pd_layout_parse(spans_text, &lay, &err), PD_OK, "%s", err.msg);
    pd_policy_spec s;
    parse("snapkv:fair=1,retention=0.5", &s);
    check_json_report(j, m, ids, n, &s, &lay);
    cr_assert_eq(json_num(j, "retention"), 0.5);
    pd_kv_prefix *full = full_prefix(m, ids, n), *p = compress(m, ids, n, &s, &lay, NULL);
    const double want_full = nll_after(m, full, eids, n_e), want_comp = nll_after(m, p, eids, n_e);
    cr_assert(close_to(json_num(j, "nll_full"), want_full), "%.17g vs %.17g", json_num(j, "nll_full"), want_full);
    cr_assert(close_to(json_num(j, "nll_compressed"), want_comp));
    cr_assert(close_to(json_num(j, "nll_ratio"), want_comp / want_full));
    cr_assert_eq(th_json_int(j, "eval_tokens", NULL), n_e);
    pd_kv_prefix_free(p);
    pd_kv_prefix_free(full);
    pd_layout_free(&lay);
    json_decref(j);

    /* No layout: no spans, no layout key. */
    cr_assert_eq(run(&out, "%s compress --model %s --policy knorm --retention 0.3 --text %s --threads 2 --json",
                     prefixctl(), model_path, text),
                 0, "%s", out);
    j = th_json_parse(out);
    free(out);
    parse("knorm:retention=0.3", &s);
    check_json_report(j, m, ids, n, &s, NULL);
    cr_assert_null(json_object_get(j, "nll_ratio"));
    json_decref(j);

    /* Automatic spans and phrase whitelists: the layout the library builds. */
    cr_assert_eq(run(&out, "%s compress --model %s --policy compactor:fair=1 --retention 0.25 --text %s --spans auto "
                           "--keep-text 'red ball' --keep-text 'the dog' --threads 2 --json",
                     prefixctl(), model_path, text),
                 0, "%s", out);
    j = th_json_parse(out);
    free(out);
    pd_layout auto_lay;
    const char *phrases[] = {"red ball", "the dog"};
    cr_assert_eq(pd_layout_auto(pd_model_tokenizer(m), ids, n, NULL, &auto_lay, &err), PD_OK, "%s", err.msg);
    cr_assert_gt(auto_lay.n_spans, 3, "the story has many sentences");
    cr_assert_eq(pd_layout_keep_phrases(pd_model_tokenizer(m), ids, n, phrases, 2, &auto_lay, NULL, &err), PD_OK,
                 "%s", err.msg);
    cr_assert_geq(auto_lay.n_whitelist, 3, "one red ball, at least two 'the dog'");
    parse("compactor:fair=1,retention=0.25", &s);
    check_json_report(j, m, ids, n, &s, &auto_lay);
    /* Whitelisted tokens are always kept, so spans holding them keep more
     * of all their tokens than of the unprotected ones. */
    json_t *sp = json_object_get(j, "spans");
    int raised = 0;
    for (size_t i = 0; i < json_array_size(sp); i++) {
        const double all = json_num(json_array_get(sp, i), "kept_fraction"),
                     unprotected = json_num(json_array_get(sp, i), "unprotected_kept_fraction");
        cr_assert_geq(all, unprotected - 1e-12, "span %zu", i);
        raised += all > unprotected + 1e-9;
    }
    cr_assert_geq(raised, 2, "the spans with the phrases");
    pd_layout_free(&auto_lay);
    json_decref(j);

    /* Errors stay on stderr with their exit status, nothing on stdout. */
    cr_assert_eq(run(&out, "%s compress --model %s --policy knorm --text %s --keep-text 'purple cow' --json 2>/dev/null",
                     prefixctl(), model_path, text),
                 1);
    cr_assert_str_eq(out, "");
    free(out);
    cr_assert_eq(run(&out, "%s compress --model %s --policy knorm --text %s --keep-text 'purple cow' 2>&1",
                     prefixctl(), model_path, text),
                 1);
    cr_assert(strstr(out, "--keep-text: keep phrase 'purple cow' does not occur"), "%s", out);
    free(out);
    cr_assert_eq(run(&out, "%s compress --model %s --policy knorm --text %s --keep-text '' 2>&1", prefixctl(),
                     model_path, text),
                 2);
    free(out);
    cr_assert_eq(run(&out, "%s compress --model %s --policy knorm:fair=1 --text %s --json 2>/dev/null", prefixctl(),
                     model_path, text),
                 1, "fair=1 without spans is still an error");
    cr_assert_str_eq(out, "");
    free(out);
    free(ids);
    free(eids);
    pd_model_free(m);
}

/* --quality --json: the calibration points and the chosen retention, which
 * the prefix is compressed with. */
Test(compress, prefixctl_compress_json_with_quality) {
    TH_REQUIRE_SHARED();
    char model[1024], text[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    snprintf(text, sizeof text, "%s/story.txt", tmpdir);
    write_file(text, story_text);
    char *out = NULL;
    cr_assert_eq(run(&out, "%s compress --model %s --policy knorm --quality 1.1 --text %s --threads 2 --json",
                     prefixctl(), model, text),
                 0, "%s", out);
    json_t *j = th_json_parse(out);
    free(out);
    json_t *c = json_object_get(j, "calibration");
    cr_assert(json_is_object(c));
    cr_assert_eq(json_num(c, "tau"), 1.1);
    json_t *pts = json_object_get(c, "points");
    cr_assert_geq(json_array_size(pts), 4u);
    cr_assert_eq(json_num(json_array_get(pts, 0), "retention"), 0.5);
    const double chosen = json_num(c, "chosen");
    cr_assert_eq(json_num(j, "retention"), chosen);
    cr_assert_leq(json_num(c, "measured"), 1.1);
    pd_model *m = load(model);
    int64_t n;
    pd_token *ids = tokens_of(m, story_text, true, &n);
    pd_policy_spec s;
    parse("knorm", &s);
    pd_policy_spec_set_retention(&s, chosen);
    check_json_report(j, m, ids, n, &s, NULL);
    free(ids);
    pd_model_free(m);
    json_decref(j);
}

/* --store writes the compressed prefix where the store's own lookup finds
 * it, once per (model, tokens, spec, namespace). */
Test(compress, prefixctl_compress_into_a_store) {
    char text[1024], dir[1024];
    snprintf(text, sizeof text, "%s/story.txt", tmpdir);
    snprintf(dir, sizeof dir, "%s/store", tmpdir);
    write_file(text, story_text);
    char *out = NULL;
    const char *cmd = "%s compress --model %s --policy knorm --retention 0.5 --text %s --store %s --dtype %s %s 2>&1";
    cr_assert_eq(run(&out, cmd, prefixctl(), model_path, text, dir, "f16", ""), 0, "%s", out);
    const char *at = strstr(out, "stored: ");
    cr_assert(at && strstr(at, "(new, f16"), "%s", out);
    char hex[PD_PREFIX_ID_HEX];
    cr_assert_eq(sscanf(at, "stored: %64s", hex), 1);
    free(out);
    cr_assert_eq(run(&out, cmd, prefixctl(), model_path, text, dir, "f16", ""), 0, "%s", out);
    cr_assert(strstr(out, hex) && strstr(out, "already there"), "%s", out);
    free(out);
    cr_assert_eq(run(&out, cmd, prefixctl(), model_path, text, dir, "f32", "--namespace acme --pin"), 0, "%s", out);
    cr_assert(strstr(out, "(new, f32") && strstr(out, "pinned, namespace acme") && !strstr(out, hex), "%s", out);
    free(out);

    /* The library sees what the CLI wrote. */
    pd_model *m = load(model_path);
    const pd_hparams *hp = pd_model_hparams(m);
    pd_token *ids = NULL;
    size_t n = 0;
    pd_error err = {0};
    pd_tokenize_opts to = {.add_special = true};
    cr_assert_eq(pd_tokenize(pd_model_tokenizer(m), story_text, strlen(story_text), to, &ids, &n, &err), PD_OK, "%s",
                 err.msg);
    pd_store_opts o;
    pd_store_opts_default(&o);
    o.dir = dir;
    pd_store *st = NULL;
    cr_assert_eq(pd_store_open(&o, &st, &err), PD_OK, "%s", err.msg);
    uint8_t fp[PD_SHA256_LEN];
    pd_model_fingerprint(m, fp);
    pd_prefix_id id;
    int32_t matched = 0;
    cr_assert_eq(pd_store_lookup(st, fp, "", NULL, ids, (int64_t)n, &id, &matched, &err), PD_OK, "%s", err.msg);
    char got[PD_PREFIX_ID_HEX];
    pd_prefix_id_hex(&id, got);
    cr_assert_str_eq(got, hex);
    cr_assert_eq(matched, (int32_t)n);
    pd_prefix_ref *r = NULL;
    cr_assert_eq(pd_store_get(st, &id, &r, &err), PD_OK, "%s", err.msg);
    const pd_prefix_info *info = pd_prefix_ref_info(r);
    cr_assert_eq(info->kept_rows, (int64_t)hp->n_layer * hp->n_head_kv * (int64_t)floor(0.5 * (double)n + 1e-9));
    cr_assert(strstr(info->spec, "knorm:") && strstr(info->spec, "retention=0.5"), "%s", info->spec);
    pd_prefix_ref_release(r);
    pd_store_close(st);
    free(ids);
    pd_model_free(m);
}

Test(compress, prefixctl_compress_with_quality) {
    TH_REQUIRE_SHARED();
    char model[1024], text[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    snprintf(text, sizeof text, "%s/story.txt", tmpdir);
    write_file(text, story_text);
    char *out = NULL;
    cr_assert_eq(run(&out, "%s compress --model %s --policy compactor --quality 1.1 --text %s --threads 2 2>&1",
                     prefixctl(), model, text),
                 0, "%s", out);
    cr_assert(strstr(out, "calibration: tau 1.1, probe = the last "), "%s", out);
    cr_assert(strstr(out, "retention 0.5 ") && strstr(out, "retention 0.0625 "), "%s", out);
    cr_assert(strstr(out, "curve: f(r) = 1 + "), "%s", out);
    const double chosen = double_after(out, "chosen retention ");
    const double measured = double_after(out, ", measured ");
    cr_assert(chosen >= 0.05 && chosen <= 1, "%s", out);
    cr_assert_leq(measured, 1.1, "%s", out);
    /* The prefix is compressed at the chosen retention. */
    cr_assert(fabs(double_after(out, ",retention=") - chosen) <= 1e-5 * chosen, "%s", out);
    free(out);
}

Test(compress, prefixctl_compress_rejects_bad_input) {
    char text[1024];
    snprintf(text, sizeof text, "%s/story.txt", tmpdir);
    write_file(text, story_text);
    const char *px = prefixctl();
    char *out = NULL;
    cr_assert_eq(run(&out, "%s compress --model %s --text %s 2>&1", px, model_path, text), 2);
    cr_assert(strstr(out, "--policy SPEC"), "%s", out);
    free(out);
    cr_assert_eq(run(&out, "%s compress --model %s --policy snapkv 2>&1", px, model_path), 2);
    cr_assert(strstr(out, "--text FILE"), "%s", out);
    free(out);
    cr_assert_eq(run(&out, "%s compress --model %s --policy snapkv:frobs=1 --text %s 2>&1", px, model_path, text), 2);
    cr_assert(strstr(out, "--policy") && strstr(out, "frobs"), "%s", out);
    free(out);
    cr_assert_eq(run(&out, "%s compress --model %s --policy nosuch --text %s 2>&1", px, model_path, text), 2);
    cr_assert(strstr(out, "nosuch"), "%s", out);
    free(out);
    cr_assert_eq(run(&out, "%s compress --model %s --policy snapkv --text %s --retention 0.5 --quality 1.1 2>&1", px,
                     model_path, text),
                 2);
    cr_assert(strstr(out, "not both"), "%s", out);
    free(out);
    cr_assert_eq(run(&out, "%s compress --model %s --policy snapkv --text %s --retention 0 2>&1", px, model_path, text),
                 2);
    cr_assert(strstr(out, "(0, 1]"), "%s", out);
    free(out);
    cr_assert_eq(run(&out, "%s compress --model %s --policy snapkv --text %s --retention half 2>&1", px, model_path,
                     text),
                 2);
    cr_assert(strstr(out, "--retention wants a number"), "%s", out);
    free(out);
    cr_assert_eq(run(&out, "%s compress --model %s --policy snapkv --text %s --quality 0.9 2>&1", px, model_path, text),
                 2);
    cr_assert(strstr(out, "--quality"), "%s", out);
    free(out);
    cr_assert_eq(run(&out, "%s compress --model %s --policy snapkv --text %s --holdout 0.3 2>&1", px, model_path, text),
                 2);
    cr_assert(strstr(out, "--holdout only applies with --quality"), "%s", out);
    free(out);
    cr_assert_eq(run(&out, "%s compress --model %s --policy snapkv --text %s --quality 1.1 --holdout 1.5 2>&1", px,
                     model_path, text),
                 2);
    cr_assert(strstr(out, "--holdout 1.5"), "%s", out);
    free(out);
    cr_assert_eq(run(&out, "%s compress --model %s --policy snapkv --text %s extra 2>&1", px, model_path, text), 2);
    cr_assert(strstr(out, "unexpected argument 'extra'"), "%s", out);
    free(out);
    /* Runtime errors: exit 1 with the reason. */
    cr_assert_eq(run(&out, "%s compress --model %s --policy snapkv --text %s/missing.txt --threads 2 2>&1", px, model_path, tmpdir),
                 1);
    cr_assert(strstr(out, "missing.txt"), "%s", out);
    free(out);
    cr_assert_eq(run(&out, "%s compress --model %s --policy snapkv:fair=1 --text %s --threads 2 2>&1", px, model_path, text), 1);
    cr_assert(strstr(out, "fair=1") && strstr(out, "spans"), "%s", out);
    free(out);
    char spans[1024];
    snprintf(spans, sizeof spans, "%s/bad.spans", tmpdir);
    write_file(spans, "a 0 10\nb 20 30\n");
    cr_assert_eq(run(&out, "%s compress --model %s --policy snapkv --text %s --spans %s --threads 2 2>&1", px, model_path, text,
                     spans),
                 1);
    cr_assert(strstr(out, "bad.spans"), "%s", out);
    free(out);
    /* The policy list, two ways. */
    cr_assert_eq(run(&out, "%s policies", px), 0);
    for (int k = 0; k < PD_POLICY_COUNT; k++) {
        char line[64];
        snprintf(line, sizeof line, "%s:", pd_policy_kind_name((pd_policy_kind)k));
        cr_assert(strstr(out, line), "%s missing from:\n%s", line, out);
    }
    char *out2 = NULL;
    cr_assert_eq(run(&out2, "%s compress --list", px), 0);
    cr_assert_str_eq(out, out2);
    free(out);
    free(out2);
    cr_assert_eq(run(&out, "%s policies extra 2>&1", px), 2);
    free(out);
}

/* pd_compress_prefix_observed reports every layer in order, gives the same
 * prefix as pd_compress_prefix, and stops when the callback says so. */
typedef struct layer_log {
    int calls, last, stop_at;
    bool in_order;
} layer_log;

static int log_layer(void *ctx, int layer, int n_layer, pd_error *err) {
    layer_log *l = ctx;
    l->in_order = l->in_order && layer == l->last + 1 && n_layer == 4;
    l->last = layer;
    l->calls++;
    return layer == l->stop_at ? pd_errorf(err, PD_EIO, "stopped at layer %d", layer) : PD_OK;
}

Test(compress, observed_compression_reports_each_layer_and_can_stop) {
    pd_model *m = load(model_path);
    pd_token *t = random_tokens(120, pd_model_hparams(m)->n_vocab, 5);
    pd_policy_spec spec;
    pd_error err = {0};
    cr_assert_eq(pd_policy_spec_parse("snapkv:retention=0.25", &spec, &err), PD_OK, "%s", err.msg);
    pd_kv_prefix *a = NULL, *b = NULL;
    layer_log log = {.last = -1, .stop_at = -1, .in_order = true};
    cr_assert_eq(pd_compress_prefix_observed(m, t, 120, &spec, NULL, log_layer, &log, &a, NULL, &err), PD_OK, "%s",
                 err.msg);
    cr_assert(log.in_order && log.calls == pd_model_hparams(m)->n_layer, "calls %d", log.calls);
    cr_assert_eq(pd_compress_prefix(m, t, 120, &spec, NULL, &b, NULL, &err), PD_OK, "%s", err.msg);
    for (int l = 0; l < 4; l++)
        for (int h = 0; h < 2; h++) {
            const int32_t *pa, *pb;
            const void *ka, *kb;
            int64_t na = pd_kv_prefix_stream(a, l, h, &pa, &ka, NULL), nb = pd_kv_prefix_stream(b, l, h, &pb, &kb, NULL);
            cr_assert_eq(na, nb);
            cr_assert_eq(memcmp(pa, pb, sizeof *pa * (size_t)na), 0);
            cr_assert_eq(memcmp(ka, kb, 2 * (size_t)na * (size_t)pd_model_hparams(m)->head_dim), 0); /* f16 rows */
        }
    pd_kv_prefix_free(a);
    pd_kv_prefix_free(b);
    pd_kv_prefix *c = NULL;
    layer_log stop = {.last = -1, .stop_at = 1, .in_order = true};
    cr_assert_eq(pd_compress_prefix_observed(m, t, 120, &spec, NULL, log_layer, &stop, &c, NULL, &err), PD_EIO);
    cr_assert_null(c);
    cr_assert_eq(stop.calls, 2);
    cr_assert(strstr(err.msg, "stopped at layer 1"), "%s", err.msg);
    free(t);
    pd_model_free(m);
}
