/* The architectures beyond llama (qwen2, qwen3, gemma2, gemma3, phi3):
 * every one against a naive double-precision forward pass written from
 * llama.cpp's graphs (rope, per-head Q/K norms, GeGLU, post norms, sliding
 * windows per layer, soft-capping, fused tensors), prefill against
 * decode, a compressed prefix whose kept rows fall outside a layer's
 * window, compression policies on windowed models, and the files that
 * must be refused. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "helpers.h"
#include "policies/policies.h"
#include "tools/tools.h"

static char *tmpdir;

static void setup(void) {
    tmpdir = th_mkdtemp();
    cr_assert_not_null(tmpdir);
}

static void teardown(void) {
    th_rmtree(tmpdir);
    free(tmpdir);
}

TestSuite(arch, .init = setup, .fini = teardown);

/* ------------------------------------------------------------------------
 * the models
 * ------------------------------------------------------------------------ */

enum { WINDOW = 5, T = 24, N_PREFIX = 16 };

static pd_testmodel_opts opts_for(const char *arch) {
    pd_testmodel_opts o;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset("tiny", &o, &err), PD_OK, "%s", err.msg);
    o.arch = arch;
    o.peaked = true; /* a flat distribution would hide mistakes */
    o.n_layer = 3;
    o.head_dim = 32; /* q_dim 128 != n_embd 64 */
    o.sliding_window = WINDOW;
    o.tied = true;
    o.seed = 7;
    if (strcmp(arch, "llama") == 0 || strcmp(arch, "phi3") == 0) {
        o.head_dim = 0; /* phi3 needs n_head x head_dim = n_embd */
        o.tied = false;
    }
    if (strcmp(arch, "gemma2") == 0) o.attn_softcap = 4.0f, o.final_softcap = 20.0f; /* caps that bite */
    if (strcmp(arch, "gemma3") == 0) {
        o.n_layer = 6; /* 5 windowed layers, then a global one */
        o.rope_scale = 4.0f; /* scales the global layer only */
        o.rope_freq_base = 1000000.0f;
    }
    return o;
}

static const char *gen_model(const pd_testmodel_opts *o, const char *file) {
    static char path[4][1024];
    static int k;
    k = (k + 1) % 4;
    snprintf(path[k], sizeof path[k], "%s/%s", tmpdir, file);
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_write(o, path[k], NULL, &err), PD_OK, "%s", err.msg);
    return path[k];
}

static pd_model *load_on(const char *path, pd_backend *be) {
    pd_model *m = NULL;
    pd_error err = {0};
    pd_model_params p = {.n_threads = 2, .kv_f32 = true, .backend = be};
    cr_assert_eq(pd_model_load(path, &p, &m, &err), PD_OK, "%s: %s", path, err.msg);
    return m;
}

/* ------------------------------------------------------------------------
 * the naive reference
 * ------------------------------------------------------------------------ */

typedef struct ref_model {
    const pd_testmodel_opts *o;
    pd_gguf *g;
    int E, F, L, H, HKV, HD, V;
    bool gemma, qk_norm, phi3, qwen2;
} ref_model;

/* A tensor's values as double (the file is f32). */
static double *tensor(const ref_model *r, const char *name) {
    const pd_gguf_tensor *t = pd_gguf_find_tensor(r->g, name);
    cr_assert_not_null(t, "tensor %s", name);
    float *f = malloc(sizeof(float) * t->n_elems);
    double *d = malloc(sizeof(double) * t->n_elems);
    pd_error err = {0};
    cr_assert_eq(pd_dequantize_row(t->type, t->data, f, t->n_elems, &err), PD_OK, "%s", err.msg);
    for (uint64_t i = 0; i < t->n_elems; i++) d[i] = f[i];
    free(f);
    return d;
}

static double *layer_tensor(const ref_model *r, int l, const char *suffix) {
    char name[96];
    snprintf(name, sizeof name, "blk.%d.%s", l, suffix);
    return tensor(r, name);
}

static void matvec(const double *w, const double *x, int rows, int cols, double *y) {
    for (int i = 0; i < rows; i++) {
        double s = 0;
        for (int j = 0; j < cols; j++) s += w[(size_t)i * cols + j] * x[j];
        y[i] = s;
    }
}

static void rmsnorm(const double *x, const double *w, int n, double eps, double *y) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const double k = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++) y[i] = x[i] * k * w[i];
}

/* llama.cpp: NORM rotates (2i, 2i+1), NEOX (i, i + d/2); theta_i =
 * pos * base^(-2i/d) / factor. */
static void rope(double *x, int heads, int hd, int pos, bool neox, double base, double factor) {
    for (int h = 0; h < heads; h++)
        for (int i = 0; i < hd / 2; i++) {
            const double th = pos * pow(base, -2.0 * i / hd) / factor, c = cos(th), s = sin(th);
            double *a = &x[h * hd + (neox ? i : 2 * i)], *b = &x[h * hd + (neox ? i + hd / 2 : 2 * i + 1)];
            const double x0 = *a, x1 = *b;
            *a = x0 * c - x1 * s;
            *b = x0 * s + x1 * c;
        }
}

static bool windowed(const ref_model *r, int l) {
    if (!strcmp(r->o->arch, "gemma2")) return l % 2 == 0;
    if (!strcmp(r->o->arch, "gemma3")) return (l + 1) % 6 != 0;
    return !strcmp(r->o->arch, "phi3");
}

/* Which keys a query sees beyond causality: the window (in windowed
 * layers), and for queries past a compressed prefix of n_prefix tokens
 * only its kept rows; prefix_ignores_window lets kept rows through the
 * window (the mistake the engine must not make). */
typedef struct visibility {
    const uint8_t *keep; /* [n_prefix] or NULL */
    int n_prefix;
    bool prefix_ignores_window;
} visibility;

static bool visible(const ref_model *r, const visibility *vis, int l, int t, int s) {
    if (s > t) return false;
    const bool past_prefix = vis->keep && t >= vis->n_prefix && s < vis->n_prefix;
    if (past_prefix && !vis->keep[s]) return false;
    if (past_prefix && vis->prefix_ignores_window) return true;
    return !windowed(r, l) || t - s < (int)r->o->sliding_window;
}

static double gelu_tanh(double x) { return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }

/* Logits of every position of toks[0..n), [n][V]. */
static void reference(const pd_testmodel_opts *o, const char *path, const pd_token *toks, int n,
                      const visibility *vis, double *logits) {
    ref_model r = {.o = o};
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open(path, &r.g, &err), PD_OK, "%s", err.msg);
    r.E = (int)o->n_embd, r.F = (int)o->n_ff, r.L = (int)o->n_layer, r.H = (int)o->n_head;
    r.HKV = (int)o->n_head_kv, r.HD = o->head_dim ? (int)o->head_dim : r.E / r.H;
    r.V = (int)pd_gguf_find_tensor(r.g, "token_embd.weight")->ne[1];
    r.gemma = !strncmp(o->arch, "gemma", 5);
    r.qk_norm = !strcmp(o->arch, "qwen3") || !strcmp(o->arch, "gemma3");
    r.phi3 = !strcmp(o->arch, "phi3");
    r.qwen2 = !strcmp(o->arch, "qwen2");
    const int E = r.E, QD = r.H * r.HD, KVD = r.HKV * r.HD, rep = r.H / r.HKV;
    const double eps = o->rms_eps;
    double *x = calloc((size_t)n * E, sizeof(double));
    double *kc = malloc(sizeof(double) * n * KVD), *vc = malloc(sizeof(double) * n * KVD);
    double *h = malloc(sizeof(double) * E), *o_att = malloc(sizeof(double) * QD);
    double *a = malloc(sizeof(double) * (E > QD ? E : QD)), *g = malloc(sizeof(double) * 2 * r.F),
           *p = malloc(sizeof(double) * n), *tmp = malloc(sizeof(double) * 2 * r.F + QD + 2 * KVD);

    double *emb = tensor(&r, "token_embd.weight");
    for (int t = 0; t < n; t++)
        for (int i = 0; i < E; i++) x[(size_t)t * E + i] = emb[(size_t)toks[t] * E + i] * (r.gemma ? sqrt(E) : 1.0);

    for (int l = 0; l < r.L; l++) {
        double *an = layer_tensor(&r, l, "attn_norm.weight"), *fn = layer_tensor(&r, l, "ffn_norm.weight");
        double *wq, *wk, *wv, *wqkv = NULL;
        if (r.phi3) {
            wqkv = layer_tensor(&r, l, "attn_qkv.weight");
            wq = wqkv, wk = wqkv + (size_t)QD * E, wv = wqkv + (size_t)(QD + KVD) * E;
        } else {
            wq = layer_tensor(&r, l, "attn_q.weight"), wk = layer_tensor(&r, l, "attn_k.weight");
            wv = layer_tensor(&r, l, "attn_v.weight");
        }
        double *wo = layer_tensor(&r, l, "attn_output.weight"), *wd = layer_tensor(&r, l, "ffn_down.weight");
        double *wup = layer_tensor(&r, l, "ffn_up.weight");
        double *wgate = r.phi3 ? wup : layer_tensor(&r, l, "ffn_gate.weight");
        if (r.phi3) wup += (size_t)r.F * E; /* gate rows first, then up */
        double *bq = r.qwen2 ? layer_tensor(&r, l, "attn_q.bias") : NULL;
        double *bk = r.qwen2 ? layer_tensor(&r, l, "attn_k.bias") : NULL;
        double *bv = r.qwen2 ? layer_tensor(&r, l, "attn_v.bias") : NULL;
        double *qn = r.qk_norm ? layer_tensor(&r, l, "attn_q_norm.weight") : NULL;
        double *kn = r.qk_norm ? layer_tensor(&r, l, "attn_k_norm.weight") : NULL;
        double *pan = r.gemma ? layer_tensor(&r, l, "post_attention_norm.weight") : NULL;
        double *pfn = r.gemma ? layer_tensor(&r, l, "post_ffw_norm.weight") : NULL;
        /* gemma3's windowed layers rope at base 10000 unscaled; the others
         * at the file's base with its linear scaling. */
        const bool local = !strcmp(o->arch, "gemma3") && windowed(&r, l);
        const double base = local ? 10000.0 : o->rope_freq_base;
        const double factor = local || o->rope_scale <= 0.0f ? 1.0 : o->rope_scale;
        const bool neox = strcmp(o->arch, "llama") != 0;

        /* K and V of every position first (a position's keys do not depend
         * on later ones), then each position's attention. */
        double *qs = malloc(sizeof(double) * n * QD);
        for (int t = 0; t < n; t++) {
            rmsnorm(&x[(size_t)t * E], an, E, eps, h);
            double *qt = &qs[(size_t)t * QD], *kt = &kc[(size_t)t * KVD], *vt = &vc[(size_t)t * KVD];
            matvec(wq, h, QD, E, qt);
            matvec(wk, h, KVD, E, kt);
            matvec(wv, h, KVD, E, vt);
            for (int i = 0; bq && i < QD; i++) qt[i] += bq[i];
            for (int i = 0; bk && i < KVD; i++) kt[i] += bk[i], vt[i] += bv[i];
            for (int hh = 0; qn && hh < r.H; hh++) rmsnorm(&qt[hh * r.HD], qn, r.HD, eps, &qt[hh * r.HD]);
            for (int hh = 0; kn && hh < r.HKV; hh++) rmsnorm(&kt[hh * r.HD], kn, r.HD, eps, &kt[hh * r.HD]);
            rope(qt, r.H, r.HD, t, neox, base, factor);
            rope(kt, r.HKV, r.HD, t, neox, base, factor);
        }
        for (int t = 0; t < n; t++) {
            for (int hh = 0; hh < r.H; hh++) {
                const int kh = hh / rep;
                double mx = -INFINITY;
                for (int s = 0; s <= t; s++) {
                    p[s] = -INFINITY;
                    if (!visible(&r, vis, l, t, s)) continue;
                    const double *qv = &qs[(size_t)t * QD + hh * r.HD], *kv = &kc[(size_t)s * KVD + kh * r.HD];
                    double sc = 0;
                    for (int i = 0; i < r.HD; i++) sc += qv[i] * kv[i];
                    sc /= sqrt(r.HD);
                    if (o->attn_softcap > 0 && !strcmp(o->arch, "gemma2"))
                        sc = o->attn_softcap * tanh(sc / o->attn_softcap);
                    p[s] = sc;
                    mx = sc > mx ? sc : mx;
                }
                double sum = 0;
                for (int s = 0; s <= t; s++) sum += p[s] == -INFINITY ? 0 : (p[s] = exp(p[s] - mx));
                for (int i = 0; i < r.HD; i++) {
                    double acc = 0;
                    for (int s = 0; s <= t; s++)
                        if (p[s] != -INFINITY) acc += p[s] * vc[(size_t)s * KVD + kh * r.HD + i];
                    o_att[hh * r.HD + i] = sum > 0 ? acc / sum : 0;
                }
            }
            matvec(wo, o_att, E, QD, a);
            if (pan) rmsnorm(a, pan, E, eps, a);
            for (int i = 0; i < E; i++) x[(size_t)t * E + i] += a[i];
            rmsnorm(&x[(size_t)t * E], fn, E, eps, h);
            matvec(wgate, h, r.F, E, g);
            matvec(wup, h, r.F, E, tmp);
            for (int i = 0; i < r.F; i++)
                g[i] = (r.gemma ? gelu_tanh(g[i]) : g[i] / (1.0 + exp(-g[i]))) * tmp[i];
            matvec(wd, g, E, r.F, a);
            if (pfn) rmsnorm(a, pfn, E, eps, a);
            for (int i = 0; i < E; i++) x[(size_t)t * E + i] += a[i];
        }
        free(qs);
        free(an), free(fn), free(wo), free(wd), free(bq), free(bk), free(bv), free(qn), free(kn), free(pan), free(pfn);
        if (r.phi3) {
            free(wqkv), free(wgate);
        } else {
            free(wq), free(wk), free(wv), free(wup), free(wgate);
        }
    }
    double *on = tensor(&r, "output_norm.weight");
    const bool untied = pd_gguf_find_tensor(r.g, "output.weight") && strcmp(o->arch, "gemma2");
    double *out = untied ? tensor(&r, "output.weight") : emb;
    for (int t = 0; t < n; t++) {
        rmsnorm(&x[(size_t)t * E], on, E, eps, h);
        matvec(out, h, r.V, E, &logits[(size_t)t * r.V]);
        if (o->final_softcap > 0 && !strcmp(o->arch, "gemma2"))
            for (int j = 0; j < r.V; j++)
                logits[(size_t)t * r.V + j] = o->final_softcap * tanh(logits[(size_t)t * r.V + j] / o->final_softcap);
    }
    if (out != emb) free(out);
    free(emb), free(on), free(x), free(kc), free(vc), free(h), free(o_att), free(a), free(g), free(p), free(tmp);
    pd_gguf_close(r.g);
}

/* ------------------------------------------------------------------------
 * helpers
 * ------------------------------------------------------------------------ */

static void tokens(pd_token *t, int n, int32_t V, uint64_t salt) {
    uint64_t s = 0x9e3779b97f4a7c15ull ^ salt;
    t[0] = 1;
    for (int i = 1; i < n; i++) t[i] = (pd_token)(259 + pd_splitmix64(&s) % (uint64_t)(V - 259));
}

/* Largest |a - b| over n logits, relative to 1 + |b|. */
static double logit_err(const float *a, const double *b, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) {
        const double e = fabs(a[i] - b[i]) / (1.0 + fabs(b[i]));
        m = e > m ? e : m;
    }
    return m;
}

static double spread(const double *x, int64_t n) {
    double lo = INFINITY, hi = -INFINITY;
    for (int64_t i = 0; i < n; i++) lo = x[i] < lo ? x[i] : lo, hi = x[i] > hi ? x[i] : hi;
    return hi - lo;
}

static const char *const archs[] = {"llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"};

/* ------------------------------------------------------------------------
 * tests
 * ------------------------------------------------------------------------ */

/* Every position's logits from one prefill equal the reference's. */
static void check_reference_of(const pd_testmodel_opts *opts) {
    const pd_testmodel_opts o = *opts;
    const char *arch = o.arch;
    const char *path = gen_model(&o, "ref.gguf");
    pd_model *m = load_on(path, NULL);
    const int32_t V = pd_model_hparams(m)->n_vocab;
    pd_token toks[T];
    tokens(toks, T, V, 1);
    float *got = malloc(sizeof(float) * T * V);
    double *want = malloc(sizeof(double) * T * V);
    pd_seq *s = NULL;
    pd_error err = {0};
    pd_prefill_opts all = {.logits_all = true};
    cr_assert_eq(pd_seq_create(m, 0, &s, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_prefill(m, s, toks, T, &all, got, &err), PD_OK, "%s", err.msg);
    visibility vis = {0};
    reference(&o, path, toks, T, &vis, want);
    const double e = logit_err(got, want, (int64_t)T * V);
    cr_expect_lt(e, 2e-4, "%s: logits differ from the reference by %g", arch, e);
    /* Peaked weights: the logits are far from flat. */
    cr_expect_gt(spread(want + (size_t)(T - 1) * V, V), 3.0, "%s: flat logits prove nothing", arch);
    pd_seq_free(s);
    free(got), free(want);
    pd_model_free(m);
}

static void check_reference(const char *arch) {
    const pd_testmodel_opts o = opts_for(arch);
    check_reference_of(&o);
}

Test(arch, llama_matches_reference) { check_reference("llama"); }
/* Mistral Nemo's shape: llama with key_length 128 while n_embd / n_head
 * is 160, so the query width differs from n_embd. */
Test(arch, llama_with_an_explicit_head_size_matches_reference) {
    pd_testmodel_opts o = opts_for("llama");
    o.head_dim = 32;
    check_reference_of(&o);
}
Test(arch, qwen2_matches_reference) { check_reference("qwen2"); }
Test(arch, qwen3_matches_reference) { check_reference("qwen3"); }
Test(arch, gemma2_matches_reference) { check_reference("gemma2"); }
Test(arch, gemma3_matches_reference) { check_reference("gemma3"); }
Test(arch, phi3_matches_reference) { check_reference("phi3"); }

/* Decoding token by token after a short prefill gives the logits (and so
 * the greedy choices) of one long prefill. */
Test(arch, decode_equals_prefill) {
    for (size_t a = 0; a < sizeof archs / sizeof *archs; a++) {
        pd_testmodel_opts o = opts_for(archs[a]);
        pd_model *m = load_on(gen_model(&o, "dec.gguf"), NULL);
        const int32_t V = pd_model_hparams(m)->n_vocab;
        pd_token toks[T];
        tokens(toks, T, V, 2);
        float *full = malloc(sizeof(float) * T * V), *one = malloc(sizeof(float) * V);
        pd_seq *s1 = NULL, *s2 = NULL;
        pd_error err = {0};
        pd_prefill_opts all = {.logits_all = true};
        cr_assert_eq(pd_seq_create(m, 0, &s1, &err), PD_OK);
        cr_assert_eq(pd_seq_create(m, 0, &s2, &err), PD_OK);
        cr_assert_eq(pd_prefill(m, s1, toks, T, &all, full, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_prefill(m, s2, toks, 7, NULL, one, &err), PD_OK, "%s", err.msg);
        for (int t = 7; t < T; t++) {
            cr_assert_eq(pd_decode(m, &s2, &toks[t], 1, one, &err), PD_OK, "%s", err.msg);
            double e = 0;
            for (int32_t j = 0; j < V; j++) {
                const double d = fabs(one[j] - full[(size_t)t * V + j]) / (1.0 + fabs(full[(size_t)t * V + j]));
                e = d > e ? d : e;
            }
            cr_expect_lt(e, 1e-4, "%s: position %d: decode and prefill differ by %g", archs[a], t, e);
        }
        pd_seq_free(s1), pd_seq_free(s2);
        free(full), free(one);
        pd_model_free(m);
    }
}

/* A compressed prefix keeps rows with gaps in their positions. In a
 * windowed layer a kept row older than the window must stay invisible to
 * the continuation: positions are the original ones. */
static void check_windowed_prefix(const char *arch, bool discrete) {
    pd_testmodel_opts o = opts_for(arch);
    const char *path = gen_model(&o, "win.gguf");
    pd_backend *be = NULL;
    pd_error err = {0};
    if (discrete) cr_assert_eq(pd_backend_cpu_discrete_create(2, &be, &err), PD_OK, "%s", err.msg);
    pd_model *m = load_on(path, be);
    const pd_hparams *hp = pd_model_hparams(m);
    const int32_t V = hp->n_vocab;
    pd_token toks[T];
    tokens(toks, T, V, 3);

    /* The prefix: N_PREFIX tokens, then only these positions kept. Rows
     * 0..3 and 7 lie outside a window of 5 for every continuation query
     * (positions 16..23); 13..15 inside for the first ones. */
    static const uint8_t keep[N_PREFIX] = {1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1};
    pd_seq *full = NULL;
    pd_kv_prefix *whole = NULL, *kept = NULL;
    cr_assert_eq(pd_seq_create(m, 0, &full, &err), PD_OK);
    cr_assert_eq(pd_prefill(m, full, toks, N_PREFIX, NULL, NULL, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_to_prefix(full, &whole, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_kv_prefix_create(hp, N_PREFIX, PD_TYPE_F32, &kept, &err), PD_OK, "%s", err.msg);
    float *k = malloc(sizeof(float) * N_PREFIX * hp->head_dim), *v = malloc(sizeof(float) * N_PREFIX * hp->head_dim);
    float *kk = malloc(sizeof(float) * N_PREFIX * hp->head_dim), *vk = malloc(sizeof(float) * N_PREFIX * hp->head_dim);
    for (int l = 0; l < hp->n_layer; l++)
        for (int h = 0; h < hp->n_head_kv; h++) {
            const int32_t *pos;
            const void *rk, *rv;
            cr_assert_eq(pd_kv_prefix_stream(whole, l, h, &pos, &rk, &rv), N_PREFIX);
            pd_kv_prefix_stream_f32(whole, l, h, k, v);
            int32_t kpos[N_PREFIX];
            int64_t n = 0;
            for (int i = 0; i < N_PREFIX; i++) {
                if (!keep[pos[i]]) continue;
                memcpy(kk + n * hp->head_dim, k + (size_t)i * hp->head_dim, sizeof(float) * hp->head_dim);
                memcpy(vk + n * hp->head_dim, v + (size_t)i * hp->head_dim, sizeof(float) * hp->head_dim);
                kpos[n++] = pos[i];
            }
            cr_assert_eq(pd_kv_prefix_set(kept, l, h, kpos, kk, vk, n, &err), PD_OK, "%s", err.msg);
        }

    /* The continuation, decoded over the kept rows. */
    const int n_cont = T - N_PREFIX;
    float *got = malloc(sizeof(float) * n_cont * V);
    pd_seq *s = NULL;
    cr_assert_eq(pd_seq_create(m, 0, &s, &err), PD_OK);
    cr_assert_eq(pd_seq_attach_prefix(s, kept, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_prefill(m, s, &toks[N_PREFIX], 3, &(pd_prefill_opts){.logits_all = true}, got, &err), PD_OK,
                 "%s", err.msg);
    for (int t = N_PREFIX + 3; t < T; t++)
        cr_assert_eq(pd_decode(m, &s, &toks[t], 1, got + (size_t)(t - N_PREFIX) * V, &err), PD_OK, "%s", err.msg);

    double *want = malloc(sizeof(double) * T * V), *wrong = malloc(sizeof(double) * T * V);
    visibility vis = {.keep = keep, .n_prefix = N_PREFIX};
    reference(&o, path, toks, T, &vis, want);
    vis.prefix_ignores_window = true;
    reference(&o, path, toks, T, &vis, wrong);
    const int64_t nl = (int64_t)n_cont * V;
    const double e = logit_err(got, want + (size_t)N_PREFIX * V, nl);
    cr_expect_lt(e, 2e-4, "%s%s: continuation over the compressed prefix differs by %g", arch,
                 discrete ? " (discrete)" : "", e);
    /* The test can fail: letting the kept rows through the window would
     * have changed the logits. */
    double miss = 0;
    for (int64_t i = (int64_t)N_PREFIX * V; i < (int64_t)T * V; i++) miss = fmax(miss, fabs(want[i] - wrong[i]));
    cr_expect_gt(miss, 1e-2, "%s: the window makes no difference to this case (%g)", arch, miss);

    pd_seq_free(s), pd_seq_free(full);
    pd_kv_prefix_free(kept), pd_kv_prefix_free(whole);
    pd_model_free(m);
    pd_backend_free(be);
    free(k), free(v), free(kk), free(vk), free(got), free(want), free(wrong);
}

Test(arch, windowed_layers_mask_kept_rows_outside_the_window_gemma2) { check_windowed_prefix("gemma2", false); }
Test(arch, windowed_layers_mask_kept_rows_outside_the_window_gemma3) { check_windowed_prefix("gemma3", false); }
Test(arch, windowed_layers_mask_kept_rows_outside_the_window_phi3) { check_windowed_prefix("phi3", false); }
Test(arch, windowed_prefix_on_a_discrete_backend) { check_windowed_prefix("gemma2", true); }

/* The hyper-parameters llama.cpp derives, as the engine reads them. */
Test(arch, hparams_follow_llama_cpp) {
    pd_testmodel_opts o = opts_for("gemma2");
    o.sliding_window = 0; /* no key: gemma 2's 4096 */
    o.attn_softcap = o.final_softcap = 0.0f; /* no keys: 50 and 30 */
    pd_model *m = load_on(gen_model(&o, "g2.gguf"), NULL);
    const pd_hparams *hp = pd_model_hparams(m);
    cr_expect_eq(hp->arch, PD_ARCH_GEMMA2);
    cr_expect_eq(hp->n_swa, 4096);
    cr_expect_eq(hp->attn_softcap, 50.0f);
    cr_expect_eq(hp->final_softcap, 30.0f);
    cr_expect_eq(hp->rope.mode, PD_ROPE_NEOX);
    cr_expect(hp->tied_output);
    cr_expect(pd_hparams_layer_windowed(hp, 0) && !pd_hparams_layer_windowed(hp, 1) &&
              pd_hparams_layer_windowed(hp, 2));
    cr_expect_float_eq(hp->embd_scale, 8.0f, 1e-6f);
    cr_expect_float_eq(hp->attn_scale, 1.0f / sqrtf(32.0f), 1e-7f);
    pd_model_free(m);

    /* 46 layers is Gemma 2 27B: queries scaled by n_embd / n_head. */
    o.n_layer = 46;
    o.n_ff = 16;
    m = load_on(gen_model(&o, "g27.gguf"), NULL);
    cr_expect_float_eq(pd_model_hparams(m)->attn_scale, 1.0f / sqrtf(64.0f / 4.0f), 1e-7f);
    pd_model_free(m);

    o = opts_for("gemma3");
    m = load_on(gen_model(&o, "g3.gguf"), NULL);
    hp = pd_model_hparams(m);
    for (int l = 0; l < 6; l++) cr_expect_eq(pd_hparams_layer_windowed(hp, l), l != 5, "layer %d", l);
    cr_expect_eq(hp->rope_swa.freq_base, 10000.0f);
    cr_expect_null(hp->rope_swa.freq_factors, "local layers are not scaled");
    cr_expect_not_null(hp->rope.freq_factors, "the global layer is");
    cr_expect_eq(hp->attn_softcap, 0.0f);
    cr_expect_eq(hp->final_softcap, 0.0f);
    pd_model_free(m);

    o = opts_for("phi3");
    o.sliding_window = 0;
    o.n_layer = 32;
    o.n_ff = 16;
    o.n_ctx = 4096; /* Phi-3-mini-4k without the key: 2047 */
    m = load_on(gen_model(&o, "p4k.gguf"), NULL);
    cr_expect_eq(pd_model_hparams(m)->n_swa, 2047);
    cr_expect(pd_hparams_layer_windowed(pd_model_hparams(m), 31));
    pd_model_free(m);

    o = opts_for("qwen3");
    m = load_on(gen_model(&o, "q3.gguf"), NULL);
    cr_expect_eq(pd_model_hparams(m)->head_dim, 32);
    cr_expect_eq(pd_model_hparams(m)->n_swa, 0);
    pd_model_free(m);
}

/* Copy a model, with general.architecture replaced (NULL: kept) and one
 * extra 1-D tensor (NULL: none). */
static void rewrite(const char *src, const char *dst, const char *arch, const char *extra, const char *key_u32,
                    uint32_t value) {
    pd_gguf *g = NULL;
    pd_gguf_writer *w = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open(src, &g, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_gguf_writer_new(&w, &err), PD_OK);
    for (size_t i = 0; i < pd_gguf_kv_count(g); i++) {
        const pd_gguf_kv *kv = pd_gguf_kv_at(g, i);
        if (arch && !strcmp(kv->key, "general.architecture"))
            cr_assert_eq(pd_gguf_writer_set_str(w, kv->key, arch, &err), PD_OK);
        else
            cr_assert_eq(pd_gguf_writer_copy_kv(w, kv, &err), PD_OK, "%s", err.msg);
    }
    if (key_u32) cr_assert_eq(pd_gguf_writer_set_u32(w, key_u32, value, &err), PD_OK, "%s", err.msg);
    for (size_t i = 0; i < pd_gguf_tensor_count(g); i++) {
        const pd_gguf_tensor *t = pd_gguf_tensor_at(g, i);
        cr_assert_eq(pd_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, t->data, &err), PD_OK);
    }
    if (extra) {
        float f[8] = {1, 1, 1, 1, 1, 1, 1, 1};
        uint64_t ne[1] = {8};
        cr_assert_eq(pd_gguf_writer_add_tensor(w, extra, PD_TYPE_F32, 1, ne, f, &err), PD_OK);
    }
    cr_assert_eq(pd_gguf_writer_write(w, dst, 0, &err), PD_OK, "%s", err.msg);
    pd_gguf_writer_free(w);
    pd_gguf_close(g);
}

static void expect_refused(const char *path, const char *what) {
    pd_model *m = NULL;
    pd_error err = {0};
    const int rc = pd_model_load(path, NULL, &m, &err);
    cr_expect_neq(rc, PD_OK, "%s: loaded", path);
    cr_expect(strstr(err.msg, what) != NULL, "the refusal should say '%s': %s", what, err.msg);
    pd_model_free(m);
}

Test(arch, refusals_say_why) {
    char dst[1024];
    snprintf(dst, sizeof dst, "%s/bad.gguf", tmpdir);
    pd_testmodel_opts o = opts_for("phi3");
    const char *phi = gen_model(&o, "phi.gguf");
    /* Phi-3 128k / Phi-3.5: longrope factors. */
    rewrite(phi, dst, NULL, "rope_factors_long.weight", NULL, 0);
    expect_refused(dst, "longrope");
    /* An unknown architecture: the list of supported ones. */
    rewrite(phi, dst, "falcon", NULL, NULL, 0);
    expect_refused(dst, "supported: llama, qwen2, qwen3, gemma2, gemma3, phi3");
    /* A tensor the forward pass has no place for (a variant). */
    rewrite(phi, dst, NULL, "blk.0.attn_q_norm.weight", NULL, 0);
    expect_refused(dst, "blk.0.attn_q_norm.weight");
    /* Mixture of experts. */
    rewrite(phi, dst, NULL, NULL, "phi3.expert_count", 8);
    expect_refused(dst, "mixture-of-experts");
    /* Different K and V head sizes. */
    rewrite(phi, dst, NULL, NULL, "phi3.attention.value_length", 8);
    expect_refused(dst, "head size");
    /* gemma3 without a window key. */
    o = opts_for("gemma3");
    const char *g3 = gen_model(&o, "g3.gguf");
    pd_gguf *g = NULL;
    pd_gguf_writer *w = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open(g3, &g, &err), PD_OK);
    cr_assert_eq(pd_gguf_writer_new(&w, &err), PD_OK);
    for (size_t i = 0; i < pd_gguf_kv_count(g); i++)
        if (strcmp(pd_gguf_kv_at(g, i)->key, "gemma3.attention.sliding_window"))
            cr_assert_eq(pd_gguf_writer_copy_kv(w, pd_gguf_kv_at(g, i), &err), PD_OK);
    for (size_t i = 0; i < pd_gguf_tensor_count(g); i++) {
        const pd_gguf_tensor *t = pd_gguf_tensor_at(g, i);
        cr_assert_eq(pd_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, t->data, &err), PD_OK);
    }
    cr_assert_eq(pd_gguf_writer_write(w, dst, 0, &err), PD_OK);
    pd_gguf_writer_free(w);
    pd_gguf_close(g);
    expect_refused(dst, "gemma3.attention.sliding_window");
}

/* Peaked weights give each preset's shape, scaled down, a perplexity far
 * below its vocabulary on English text; flat ones about the vocabulary. */
Test(arch, peaked_presets_have_low_perplexity) {
    static const char text[] =
        "Once upon a time there was a little girl named Lily. She loved to play outside in the park with her "
        "friends. One day she saw a big red ball under a tree, and she ran to get it. Her mom said it was time "
        "to go home, so they walked back together and had some milk.";
    const char *presets[] = {"mistral-7b", "qwen3-0.6b", "gemma-2-2b", "gemma-3-1b", "phi-3-mini"};
    for (size_t i = 0; i < sizeof presets / sizeof *presets; i++) {
        for (int flat = 0; flat < 2; flat++) {
            pd_testmodel_opts o;
            pd_error err = {0};
            cr_assert_eq(pd_testmodel_preset(presets[i], &o, &err), PD_OK);
            o.n_vocab = 4000;
            o.n_embd = 64, o.n_ff = 128, o.n_layer = 3, o.n_head = 4, o.n_head_kv = 2;
            o.head_dim = strcmp(o.arch, "phi3") && strcmp(o.arch, "llama") ? 32 : 0;
            o.sliding_window = o.sliding_window ? 32 : 0;
            o.peaked = !flat;
            pd_model *m = load_on(gen_model(&o, "ppl.gguf"), NULL);
            pd_token *tk = NULL;
            size_t n = 0;
            const pd_tokenize_opts to = {.add_special = true};
            cr_assert_eq(pd_tokenize(pd_model_tokenizer(m), text, sizeof text - 1, to, &tk, &n, &err), PD_OK);
            double nll = 0;
            cr_assert_eq(pd_nll(m, NULL, tk, 1, tk + 1, (int64_t)n - 1, &nll, &err), PD_OK, "%s", err.msg);
            const double ppl = exp(nll);
            if (flat)
                cr_expect(ppl > 2000 && ppl < 8000, "%s flat: perplexity %g, vocab 4000", presets[i], ppl);
            else
                cr_expect_lt(ppl, 4000 / 8.0, "%s peaked: perplexity %g, vocab 4000", presets[i], ppl);
            free(tk);
            pd_model_free(m);
        }
    }
}

/* Policies that score attention ignore the windows, but they run on the
 * windowed, soft-capped models and their prefixes continue. Compactor's
 * official budget counts only the tokens beyond its 16 + 64 protected ones,
 * so on 48 tokens it keeps one per head: base=prompt makes it score here. */
Test(arch, policies_compress_windowed_models) {
    static const char *const models[] = {"gemma2", "gemma3", "phi3"};
    static const char *const specs[] = {"compactor:base=prompt", "snapkv", "h2o", "knorm"};
    for (size_t mi = 0; mi < sizeof models / sizeof *models; mi++) {
        pd_testmodel_opts o = opts_for(models[mi]);
        pd_model *m = load_on(gen_model(&o, "pol.gguf"), NULL);
        const pd_hparams *hp = pd_model_hparams(m);
        enum { N = 48 };
        pd_token toks[N + 4];
        tokens(toks, N + 4, hp->n_vocab, 4);
        for (size_t si = 0; si < sizeof specs / sizeof *specs; si++) {
            pd_policy_spec spec;
            pd_error err = {0};
            cr_assert_eq(pd_policy_spec_parse(specs[si], &spec, &err), PD_OK, "%s", err.msg);
            pd_kv_prefix *p = NULL;
            cr_assert_eq(pd_compress_prefix(m, toks, N, &spec, NULL, &p, NULL, &err), PD_OK, "%s on %s: %s",
                         specs[si], models[mi], err.msg);
            const int64_t kept = pd_kv_prefix_kept_rows(p), all = (int64_t)N * hp->n_layer * hp->n_head_kv;
            cr_expect(kept > all / 4 && kept < all, "%s on %s kept %lld of %lld rows", specs[si], models[mi],
                      (long long)kept, (long long)all);
            pd_seq *s = NULL;
            float *logits = malloc(sizeof(float) * hp->n_vocab);
            cr_assert_eq(pd_seq_create(m, 0, &s, &err), PD_OK);
            cr_assert_eq(pd_seq_attach_prefix(s, p, &err), PD_OK, "%s", err.msg);
            cr_assert_eq(pd_prefill(m, s, &toks[N], 4, NULL, logits, &err), PD_OK, "%s", err.msg);
            for (int32_t j = 0; j < hp->n_vocab; j++) cr_assert(isfinite(logits[j]), "%s on %s", specs[si], models[mi]);
            free(logits);
            pd_seq_free(s);
            pd_kv_prefix_free(p);
        }
        pd_model_free(m);
    }
}
