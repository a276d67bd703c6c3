/* The forward pass: reference output of a real model (with f16 and f32 KV
 * caches), agreement of every weight type with an F32 computation of the
 * same weights, f16 against f32 KV, compressed-prefix attention (prefixes of
 * either type), the per-layer prefill hook, batching and NLL. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "helpers.h"
#include "tools/tools.h"

static char *tmpdir;

static void setup(void) {
    tmpdir = th_mkdtemp();
    cr_assert_not_null(tmpdir);
}

static void teardown(void) {
    th_rmtree(tmpdir);
    free(tmpdir);
    tmpdir = NULL;
}

TestSuite(engine, .init = setup, .fini = teardown);

static pd_model *load_kv(const char *path, int threads, bool kv_f32) {
    pd_model *m = NULL;
    pd_error err = {0};
    pd_model_params p = {.n_threads = threads, .kv_f32 = kv_f32};
    cr_assert_eq(pd_model_load(path, &p, &m, &err), PD_OK, "%s: %s", path, err.msg);
    cr_assert_eq(pd_model_kv_type(m), kv_f32 ? PD_TYPE_F32 : PD_TYPE_F16);
    return m;
}

/* With the default KV cache (f16). */
static pd_model *load(const char *path, int threads) { return load_kv(path, threads, false); }

/* A generated model; K-quant friendly shape (rows of 256) unless `small`. */
static void gen(const char *arch, pd_type type, uint64_t seed, bool small, const char *path) {
    pd_testmodel_opts o;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset("tiny", &o, &err), PD_OK, "%s", err.msg);
    o.arch = arch;
    o.wtype = type;
    o.seed = seed;
    if (!small) {
        o.n_embd = 256;
        o.n_ff = 512;
        o.n_head = 8;
        o.n_head_kv = 2;
        o.n_layer = 2;
    }
    cr_assert_eq(pd_testmodel_write(&o, path, NULL, &err), PD_OK, "%s", err.msg);
}

static pd_token argmax(const float *x, int32_t n) {
    pd_token best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* ||a - b|| / ||b|| */
static double rel_err(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static double max_abs_diff(const float *a, const float *b, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs((double)a[i] - b[i]));
    return m;
}

/* ---- real model ------------------------------------------------------- */

static const pd_token reference_ids[64] = {
    403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408,
    419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426,
    338, 391, 266, 267, 337, 335, 312, 432, 398, 312, 286, 267, 414, 270, 333, 415, 426, 13,  438, 310};

static void greedy_from_bos(int threads, bool kv_f32) {
    char path[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", path, sizeof path));
    pd_model *m = load_kv(path, threads, kv_f32);
    const int32_t V = pd_model_hparams(m)->n_vocab;
    float *logits = malloc(sizeof(float) * (size_t)V);
    pd_seq *s = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_seq_create(m, 0, &s, &err), PD_OK);
    pd_token tok = pd_tokenizer_bos(pd_model_tokenizer(m));
    cr_assert_eq(tok, 1);
    cr_assert_eq(pd_prefill(m, s, &tok, 1, NULL, logits, &err), PD_OK, "%s", err.msg);
    for (int i = 0; i < 64; i++) {
        tok = argmax(logits, V);
        cr_assert_eq(tok, reference_ids[i], "%s KV, %d threads: token %d is %d, the reference says %d",
                     kv_f32 ? "f32" : "f16", threads, i, tok, reference_ids[i]);
        if (i < 63) cr_assert_eq(pd_decode(m, &s, &tok, 1, logits, &err), PD_OK, "%s", err.msg);
    }
    cr_assert_eq(pd_seq_pos(s), 64);
    pd_seq_free(s);
    free(logits);
    pd_model_free(m);
}

Test(engine, stories260k_greedy_matches_reference_1_thread) {
    TH_REQUIRE_SHARED();
    greedy_from_bos(1, false);
}

Test(engine, stories260k_greedy_matches_reference_2_threads) {
    TH_REQUIRE_SHARED();
    greedy_from_bos(2, false);
}

Test(engine, stories260k_greedy_matches_reference_f32_kv_1_thread) {
    TH_REQUIRE_SHARED();
    greedy_from_bos(1, true);
}

Test(engine, stories260k_greedy_matches_reference_f32_kv_2_threads) {
    TH_REQUIRE_SHARED();
    greedy_from_bos(2, true);
}

Test(engine, stories260k_hparams) {
    TH_REQUIRE_SHARED();
    char path[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", path, sizeof path));
    pd_model *m = load(path, 1);
    const pd_hparams *hp = pd_model_hparams(m);
    cr_assert_eq(hp->arch, PD_ARCH_LLAMA);
    cr_assert_eq(hp->n_embd, 64);
    cr_assert_eq(hp->n_layer, 5);
    cr_assert_eq(hp->n_head, 8);
    cr_assert_eq(hp->n_head_kv, 4);
    cr_assert_eq(hp->head_dim, 8);
    cr_assert_eq(hp->n_ff, 172);
    cr_assert_eq(hp->n_vocab, 512);
    cr_assert_eq(hp->rope.mode, PD_ROPE_NORM);
    cr_assert_eq(hp->tied_output, false);
    pd_model_free(m);
}

/* ---- weight types ----------------------------------------------------- */

/* Rewrite a model with every tensor dequantized to F32: the same weights,
 * computed on the plain float path. */
static void dequantize_model(const char *src, const char *dst) {
    pd_gguf *g = NULL;
    pd_gguf_writer *w = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open(src, &g, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_gguf_writer_new(&w, &err), PD_OK);
    for (size_t i = 0; i < pd_gguf_kv_count(g); i++)
        cr_assert_eq(pd_gguf_writer_copy_kv(w, pd_gguf_kv_at(g, i), &err), PD_OK, "%s", err.msg);
    for (size_t i = 0; i < pd_gguf_tensor_count(g); i++) {
        const pd_gguf_tensor *t = pd_gguf_tensor_at(g, i);
        float *f = malloc(sizeof(float) * t->n_elems);
        cr_assert_eq(pd_dequantize_row(t->type, t->data, f, t->n_elems, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_gguf_writer_add_tensor(w, t->name, PD_TYPE_F32, t->n_dims, t->ne, f, &err), PD_OK, "%s", err.msg);
        free(f);
    }
    cr_assert_eq(pd_gguf_writer_write(w, dst, 0, &err), PD_OK, "%s", err.msg);
    pd_gguf_writer_free(w);
    pd_gguf_close(g);
}

/* Logits of every position of a fixed prompt (prefill) and of 3 decode steps. */
static void run_prompt(pd_model *m, float *out /* [n_prompt + 3][V] */, int n_prompt) {
    const int32_t V = pd_model_hparams(m)->n_vocab;
    pd_token prompt[64];
    for (int i = 0; i < n_prompt; i++) prompt[i] = (pd_token)((i * 37 + 11) % V);
    pd_seq *s = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_seq_create(m, 0, &s, &err), PD_OK);
    pd_prefill_opts all = {.logits_all = true};
    cr_assert_eq(pd_prefill(m, s, prompt, n_prompt, &all, out, &err), PD_OK, "%s", err.msg);
    for (int i = 0; i < 3; i++) {
        pd_token t = (pd_token)((i * 53 + 5) % V);
        cr_assert_eq(pd_decode(m, &s, &t, 1, out + (int64_t)(n_prompt + i) * V, &err), PD_OK, "%s", err.msg);
    }
    pd_seq_free(s);
}

/* Tolerances. The float types (f32/f16/bf16) are computed with float
 * activations: only summation order differs from the reference, so logits
 * agree to ~1e-5 relative. The quantized types multiply against activations
 * quantized to 8 bits per block (as llama.cpp does): each dot product then
 * carries a relative error of about 2^-8 / sqrt(block) per element, which
 * through a few layers stays well under 1% of the logit vector's norm; we
 * allow 3%. The same run reports how far each type is from the original
 * F32 weights (quantization error, informational). */
/* The model at qpath against the same weights dequantized to F32 (the
 * kernels' error, below tol) and against the original F32 weights at opath
 * (the quantization error: logged, and below max_quant_err). */
static void check_against_f32(const char *label, const char *qpath, const char *opath, double tol,
                              double max_quant_err) {
    char fpath[1024];
    snprintf(fpath, sizeof fpath, "%s-deq.gguf", qpath);
    dequantize_model(qpath, fpath);
    enum { N = 20 };
    for (int threads = 1; threads <= 2; threads++) {
        pd_model *mq = load(qpath, threads), *mf = load(fpath, threads), *mo = load(opath, threads);
        const int32_t V = pd_model_hparams(mq)->n_vocab;
        float *lq = malloc(sizeof(float) * V * (N + 3)), *lf = malloc(sizeof(float) * V * (N + 3)),
              *lo = malloc(sizeof(float) * V * (N + 3));
        run_prompt(mq, lq, N);
        run_prompt(mf, lf, N);
        run_prompt(mo, lo, N);
        for (int r = 0; r < N + 3; r++) {
            double e = rel_err(lq + (int64_t)r * V, lf + (int64_t)r * V, V);
            cr_assert_lt(e, tol, "%s, %d threads, row %d: relative error %.3g vs the same weights in F32 (limit %.3g)",
                         label, threads, r, e, tol);
        }
        const double eq = rel_err(lq, lo, (int64_t)V * (N + 3));
        if (threads == 1)
            cr_log_info("%s: kernel error %.2e, quantization error vs original F32 weights %.2e", label,
                        rel_err(lq, lf, (int64_t)V * (N + 3)), eq);
        cr_assert_lt(eq, max_quant_err, "%s: relative error %.3g vs the original F32 weights (limit %.3g)", label, eq,
                     max_quant_err);
        free(lq), free(lf), free(lo);
        pd_model_free(mq), pd_model_free(mf), pd_model_free(mo);
    }
}

static void check_type(const char *arch, pd_type type, double tol) {
    char qpath[1024], opath[1024], label[64];
    const pd_type_traits *tr = pd_type_get(type);
    snprintf(qpath, sizeof qpath, "%s/%s-%s.gguf", tmpdir, arch, tr->name);
    snprintf(opath, sizeof opath, "%s/%s-orig.gguf", tmpdir, arch);
    snprintf(label, sizeof label, "%s %s", arch, tr->name);
    gen(arch, type, 7, false, qpath);
    gen(arch, PD_TYPE_F32, 7, false, opath);
    pd_model *m = load(qpath, 1);
    cr_assert_eq(pd_model_hparams(m)->wtype, type, "the generator stored %s matrices",
                 pd_type_get(pd_model_hparams(m)->wtype)->name);
    pd_model_free(m);
    check_against_f32(label, qpath, opath, tol, INFINITY);
}

Test(engine, f32_is_its_own_reference) { check_type("llama", PD_TYPE_F32, 1e-5); }
Test(engine, f16_agrees_with_f32) { check_type("llama", PD_TYPE_F16, 1e-4); }
Test(engine, bf16_agrees_with_f32) { check_type("llama", PD_TYPE_BF16, 1e-4); }
Test(engine, q8_0_agrees_with_f32) { check_type("llama", PD_TYPE_Q8_0, 3e-2); }
Test(engine, q4_0_agrees_with_f32) { check_type("llama", PD_TYPE_Q4_0, 3e-2); }
Test(engine, q4_k_agrees_with_f32) { check_type("llama", PD_TYPE_Q4_K, 3e-2); }
Test(engine, q6_k_agrees_with_f32) { check_type("llama", PD_TYPE_Q6_K, 3e-2); }
Test(engine, qwen2_q8_0_agrees_with_f32) { check_type("qwen2", PD_TYPE_Q8_0, 3e-2); }

/* Files written by llama.cpp's llama-quantize (../shared/peer) from a
 * generated F32 model, in the mixes that hold q2_K, q3_K, q5_K and iq4_xs
 * (with q4_K and q6_K for some matrices): the kernels agree with the same
 * weights in F32, and the logits stay near the original model's: the
 * limits are about 1.5 times the relative errors these files show (0.46,
 * 0.23, 0.08, 0.15); weights read as noise put them near 1.4. */
static void check_llama_cpp_file(const char *ftype, double max_quant_err) {
    char qpath[1024], opath[1024], label[64];
    snprintf(opath, sizeof opath, "%s/llama-orig.gguf", tmpdir);
    snprintf(qpath, sizeof qpath, "%s/llama-%s.gguf", tmpdir, ftype);
    snprintf(label, sizeof label, "llama-quantize %s", ftype);
    gen("llama", PD_TYPE_F32, 7, false, opath);
    th_llama_quantize(opath, qpath, ftype);
    check_against_f32(label, qpath, opath, 3e-2, max_quant_err);
}

Test(engine, llama_cpp_q2_k_file_agrees_with_f32) { check_llama_cpp_file("Q2_K", 0.7); }
Test(engine, llama_cpp_q3_k_m_file_agrees_with_f32) { check_llama_cpp_file("Q3_K_M", 0.35); }
Test(engine, llama_cpp_q5_k_m_file_agrees_with_f32) { check_llama_cpp_file("Q5_K_M", 0.12); }
Test(engine, llama_cpp_iq4_xs_file_agrees_with_f32) { check_llama_cpp_file("IQ4_XS", 0.23); }

/* ---- prefixes, hook, batching ---------------------------------------- */

enum { NP = 40, NS = 9 };

static void prompt_tokens(pd_token *p, int n, int32_t V, int salt) {
    for (int i = 0; i < n; i++) p[i] = (pd_token)((i * 31 + 7 + salt * 101) % V);
}

static void prefix_matches_full_prefill(const char *arch) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s-f32.gguf", tmpdir, arch);
    gen(arch, PD_TYPE_F32, 3, true, path);
    pd_model *m = load(path, 2);
    const int32_t V = pd_model_hparams(m)->n_vocab;
    pd_token toks[NP + NS];
    prompt_tokens(toks, NP + NS, V, 0);
    pd_error err = {0};
    float *full = malloc(sizeof(float) * V * NS), *viaprefix = malloc(sizeof(float) * V * NS);

    pd_seq *a = NULL, *b = NULL, *c = NULL;
    pd_kv_prefix *p = NULL;
    pd_prefill_opts all = {.logits_all = true};
    cr_assert_eq(pd_seq_create(m, 0, &a, &err), PD_OK);
    cr_assert_eq(pd_prefill(m, a, toks, NP + NS, &all, NULL, &err), PD_OK, "%s", err.msg);
    /* logits for the suffix rows only */
    float *all_logits = malloc(sizeof(float) * V * (NP + NS));
    cr_assert_eq(pd_seq_create(m, 0, &c, &err), PD_OK);
    cr_assert_eq(pd_prefill(m, c, toks, NP + NS, &all, all_logits, &err), PD_OK, "%s", err.msg);
    memcpy(full, all_logits + (int64_t)NP * V, sizeof(float) * V * NS);

    pd_seq *pre = NULL;
    cr_assert_eq(pd_seq_create(m, 0, &pre, &err), PD_OK);
    cr_assert_eq(pd_prefill(m, pre, toks, NP, NULL, NULL, &err), PD_OK);
    cr_assert_eq(pd_seq_to_prefix(pre, &p, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_kv_prefix_n_orig(p), NP);
    cr_assert_eq(pd_kv_prefix_kept_rows(p),
                 (int64_t)NP * pd_model_hparams(m)->n_layer * pd_model_hparams(m)->n_head_kv);
    cr_assert_eq(pd_seq_create(m, 0, &b, &err), PD_OK);
    cr_assert_eq(pd_seq_attach_prefix(b, p, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_pos(b), NP);
    cr_assert_eq(pd_prefill(m, b, toks + NP, NS, &all, viaprefix, &err), PD_OK, "%s", err.msg);
    double e = max_abs_diff(viaprefix, full, (int64_t)V * NS);
    cr_assert_lt(e, 1e-4, "%s: [prefix | suffix] differs from a full prefill by %g", arch, e);

    /* Decoding on from both gives the same greedy continuation. */
    pd_token ta = argmax(full + (int64_t)(NS - 1) * V, V), tb = argmax(viaprefix + (int64_t)(NS - 1) * V, V);
    float *la = malloc(sizeof(float) * V), *lb = malloc(sizeof(float) * V);
    for (int i = 0; i < 8; i++) {
        cr_assert_eq(ta, tb, "step %d", i);
        cr_assert_eq(pd_decode(m, &c, &ta, 1, la, &err), PD_OK);
        cr_assert_eq(pd_decode(m, &b, &tb, 1, lb, &err), PD_OK);
        cr_assert_lt(max_abs_diff(la, lb, V), 1e-4);
        ta = argmax(la, V);
        tb = argmax(lb, V);
    }
    free(la), free(lb), free(all_logits), free(full), free(viaprefix);
    pd_seq_free(a), pd_seq_free(b), pd_seq_free(c), pd_seq_free(pre);
    pd_kv_prefix_free(p);
    pd_model_free(m);
}

Test(engine, prefix_at_retention_1_equals_full_prefill_llama) { prefix_matches_full_prefill("llama"); }
Test(engine, prefix_at_retention_1_equals_full_prefill_qwen2) { prefix_matches_full_prefill("qwen2"); }

/* A prefix whose streams borrow another prefix's rows (as the store's
 * zero-copy reads do) attends exactly like the owning copy, for both KV
 * types. */
static void borrowed_equals_copied(bool kv_f32) {
    char path[1024];
    snprintf(path, sizeof path, "%s/llama-f32.gguf", tmpdir);
    gen("llama", PD_TYPE_F32, 3, true, path);
    pd_model *m = load_kv(path, 2, kv_f32);
    const pd_hparams *hp = pd_model_hparams(m);
    pd_token toks[NP + NS];
    prompt_tokens(toks, NP + NS, hp->n_vocab, 1);
    pd_error err = {0};
    pd_seq *pre = NULL;
    pd_kv_prefix *owned = NULL, *borrowed = NULL;
    cr_assert_eq(pd_seq_create(m, 0, &pre, &err), PD_OK);
    cr_assert_eq(pd_prefill(m, pre, toks, NP, NULL, NULL, &err), PD_OK);
    cr_assert_eq(pd_seq_to_prefix(pre, &owned, &err), PD_OK, "%s", err.msg);
    const pd_type t = pd_kv_prefix_type(owned);
    cr_assert_eq(t, pd_model_kv_type(m), "a snapshot keeps the model's KV type");
    cr_assert_eq(pd_kv_prefix_create(hp, NP, t, &borrowed, &err), PD_OK);
    for (int l = 0; l < hp->n_layer; l++)
        for (int h = 0; h < hp->n_head_kv; h++) {
            const int32_t *pos;
            const void *k, *v;
            int64_t len = pd_kv_prefix_stream(owned, l, h, &pos, &k, &v);
            cr_assert_eq(pd_kv_prefix_set_borrowed(borrowed, l, h, pos, k, v, len, &err), PD_OK, "%s", err.msg);
            const void *bk;
            cr_assert_eq(pd_kv_prefix_stream(borrowed, l, h, NULL, &bk, NULL), len);
            cr_assert_eq(bk, k, "borrowed rows must not be copied");
        }
    double nll_owned, nll_borrowed;
    cr_assert_eq(pd_nll(m, owned, NULL, 0, toks + NP, NS, &nll_owned, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_nll(m, borrowed, NULL, 0, toks + NP, NS, &nll_borrowed, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(nll_owned, nll_borrowed);

    /* Misaligned rows and bad positions are refused. */
    const int32_t *pos;
    const void *k, *v;
    int64_t len = pd_kv_prefix_stream(owned, 0, 0, &pos, &k, &v);
    cr_assert_eq(pd_kv_prefix_set_borrowed(borrowed, 0, 0, pos, (const char *)k + 1, v, len - 1, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "aligned"), "%s", err.msg);
    int32_t backwards[2] = {3, 1};
    cr_assert_eq(pd_kv_prefix_set_borrowed(borrowed, 0, 0, backwards, k, v, 2, &err), PD_EINVAL);
    /* Replacing a borrowed stream by a copy (from f32 rows) works, frees
     * nothing borrowed, and gives back the same rows. */
    float *k32 = malloc(sizeof(float) * (size_t)(len * hp->head_dim)), *v32 = malloc(sizeof(float) * (size_t)(len * hp->head_dim));
    cr_assert_eq(pd_kv_prefix_stream_f32(owned, 0, 0, k32, v32), len);
    cr_assert_eq(pd_kv_prefix_set(borrowed, 0, 0, pos, k32, v32, len, &err), PD_OK, "%s", err.msg);
    const void *ck;
    cr_assert_eq(pd_kv_prefix_stream(borrowed, 0, 0, NULL, &ck, NULL), len);
    cr_assert_neq(ck, k);
    cr_assert(memcmp(ck, k, (size_t)(len * hp->head_dim) * (t == PD_TYPE_F16 ? 2 : 4)) == 0,
              "f32 rows of an %s prefix go back to the same bits", t == PD_TYPE_F16 ? "f16" : "f32");
    free(k32), free(v32);
    pd_kv_prefix_free(borrowed);
    pd_kv_prefix_free(owned);
    pd_seq_free(pre);
    pd_model_free(m);
}

Test(engine, borrowed_prefix_streams_equal_copied_ones) { borrowed_equals_copied(false); }
Test(engine, borrowed_prefix_streams_equal_copied_ones_f32_kv) { borrowed_equals_copied(true); }

/* An f16 KV cache holds half the bytes per token of an f32 one (K and V;
 * the 4-byte positions stay), for a sequence and for its snapshot. */
Test(engine, f16_kv_halves_memory_per_token) {
    char path[1024];
    snprintf(path, sizeof path, "%s/bytes.gguf", tmpdir);
    gen("llama", PD_TYPE_F32, 3, true, path);
    pd_model *m16 = load_kv(path, 1, false), *m32 = load_kv(path, 1, true);
    const pd_hparams *hp = pd_model_hparams(m16);
    pd_token toks[NP];
    prompt_tokens(toks, NP, hp->n_vocab, 2);
    pd_error err = {0};
    pd_seq *s16 = NULL, *s32 = NULL;
    cr_assert_eq(pd_seq_create(m16, 0, &s16, &err), PD_OK);
    cr_assert_eq(pd_seq_create(m32, 0, &s32, &err), PD_OK);
    cr_assert_eq(pd_seq_kv_bytes(s16), 0);
    cr_assert_eq(pd_prefill(m16, s16, toks, NP, NULL, NULL, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_prefill(m32, s32, toks, NP, NULL, NULL, &err), PD_OK, "%s", err.msg);
    const uint64_t rows = (uint64_t)NP * (uint64_t)hp->n_layer * (uint64_t)hp->n_head_kv;
    const uint64_t kv32 = rows * 2 * (uint64_t)hp->head_dim * 4, kv16 = kv32 / 2, posb = rows * 4;
    cr_assert_eq(pd_seq_kv_bytes(s32), kv32 + posb);
    cr_assert_eq(pd_seq_kv_bytes(s16), kv16 + posb);
    cr_log_info("KV bytes per token: f32 %.0f, f16 %.0f", (double)pd_seq_kv_bytes(s32) / NP,
                (double)pd_seq_kv_bytes(s16) / NP);
    pd_kv_prefix *p16 = NULL, *p32 = NULL;
    cr_assert_eq(pd_seq_to_prefix(s16, &p16, &err), PD_OK);
    cr_assert_eq(pd_seq_to_prefix(s32, &p32, &err), PD_OK);
    cr_assert_eq(pd_kv_prefix_type(p16), PD_TYPE_F16);
    cr_assert_eq(pd_kv_prefix_type(p32), PD_TYPE_F32);
    cr_assert_eq(pd_kv_prefix_bytes(p16), kv16 + posb);
    cr_assert_eq(pd_kv_prefix_bytes(p32), kv32 + posb);
    /* Layer 0's f16 rows are its f32 rows rounded once (later layers see
     * attention over rounded rows): |x16 - x32| <= 2^-11 |x32|, plus half
     * the subnormal step. */
    const size_t n = (size_t)NP * (size_t)hp->head_dim;
    float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n);
    for (int l = 0; l < 1; l++)
        for (int h = 0; h < hp->n_head_kv; h++) {
            cr_assert_eq(pd_kv_prefix_stream_f32(p16, l, h, a, NULL), NP);
            cr_assert_eq(pd_kv_prefix_stream_f32(p32, l, h, b, NULL), NP);
            for (size_t i = 0; i < n; i++)
                cr_assert_leq(fabsf(a[i] - b[i]), ldexpf(fabsf(b[i]), -11) + 0x1p-24f, "layer %d head %d value %zu: %g vs %g",
                              l, h, i, a[i], b[i]);
        }
    free(a), free(b);
    pd_kv_prefix_free(p16), pd_kv_prefix_free(p32);
    pd_seq_free(s16), pd_seq_free(s32);
    pd_model_free(m16), pd_model_free(m32);
}

/* The same model with an f16 and an f32 KV cache: the logits of a prompt
 * and of decode steps agree to the f16 rounding of K and V. Each K/V element
 * carries a relative error of at most 2^-11 (4.9e-4); a score q.k then moves
 * by about 2^-11 |q||k| / sqrt(head_dim) at random signs and the attention
 * output by the same relative amount, so logits after a few layers differ
 * by ~1e-3 of their norm; we allow 1e-2. Greedy tokens agree on the
 * stories260K reference either way (above). */
Test(engine, f16_kv_agrees_with_f32_kv) {
    char path[1024];
    snprintf(path, sizeof path, "%s/kvtype.gguf", tmpdir);
    gen("llama", PD_TYPE_F32, 7, false, path);
    enum { N = 20 };
    for (int threads = 1; threads <= 2; threads++) {
        pd_model *m16 = load_kv(path, threads, false), *m32 = load_kv(path, threads, true);
        const int32_t V = pd_model_hparams(m16)->n_vocab;
        float *l16 = malloc(sizeof(float) * V * (N + 3)), *l32 = malloc(sizeof(float) * V * (N + 3));
        run_prompt(m16, l16, N);
        run_prompt(m32, l32, N);
        double worst = 0;
        for (int r = 0; r < N + 3; r++) {
            double e = rel_err(l16 + (int64_t)r * V, l32 + (int64_t)r * V, V);
            worst = fmax(worst, e);
            cr_assert_lt(e, 1e-2, "%d threads, row %d: f16 KV logits are %.3g (relative) from f32 KV", threads, r, e);
        }
        cr_assert_gt(worst, 0.0, "the f16 cache should round something");
        if (threads == 1) cr_log_info("f16 vs f32 KV: worst relative logit error %.2e", worst);
        free(l16), free(l32);
        pd_model_free(m16), pd_model_free(m32);
    }
}

/* Whether the line of /proc/self/maps holding address p names a file
 * ending in `name`. */
static bool mapped_from(const void *p, const char *name) {
    FILE *f = fopen("/proc/self/maps", "r");
    cr_assert_not_null(f);
    char line[1024];
    bool found = false, named = false;
    while (!found && fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx", &lo, &hi) != 2) continue;
        if ((uintptr_t)p < lo || (uintptr_t)p >= hi) continue;
        found = true;
        line[strcspn(line, "\n")] = '\0';
        const size_t n = strlen(line), k = strlen(name);
        named = n >= k && strcmp(line + n - k, name) == 0;
    }
    fclose(f);
    cr_assert(found, "address %p is in no mapping", p);
    return named;
}

/* Weights read into memory (the CPU default) and mapped from the file
 * (mmap_weights) are the same numbers: only the mapped model points into
 * the file. Where this CPU packs the type (q4_K on AVX-512:
 * pd_backend_pack_weight), the copy in memory is rearranged and its sums
 * run in another order: float rounding, which can flip the rounding of an
 * activation to int8 downstream (seen: one token's logits off by 0.0085,
 * the others by 1e-7), so the logits agree to within that; elsewhere the
 * bytes and the logits are bit-identical, prefill and decode. */
Test(engine, weights_in_memory_equal_mapped_weights) {
    char path[1024];
    snprintf(path, sizeof path, "%s/mmap.gguf", tmpdir);
    gen("llama", PD_TYPE_Q4_K, 11, false, path);
    enum { N = 12 };
    pd_model *mem = NULL, *map = NULL;
    pd_error err = {0};
    pd_model_params pm = {.n_threads = 2}, pp = {.n_threads = 2, .mmap_weights = true};
    cr_assert_eq(pd_model_load(path, &pm, &mem, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_model_load(path, &pp, &map, &err), PD_OK, "%s", err.msg);
    const pd_gguf_tensor *tm = pd_gguf_find_tensor(pd_model_gguf(mem), "blk.0.ffn_down.weight");
    const pd_gguf_tensor *tp = pd_gguf_find_tensor(pd_model_gguf(map), "blk.0.ffn_down.weight");
    cr_assert(tm && tp);
    cr_assert(!mapped_from(tm->data, "/mmap.gguf"), "the default reads the weights into memory");
    cr_assert(mapped_from(tp->data, "/mmap.gguf"), "mmap_weights maps the file");
    const int32_t V = pd_model_hparams(mem)->n_vocab;
    float *a = malloc(sizeof(float) * V * (N + 3)), *b = malloc(sizeof(float) * V * (N + 3));
    run_prompt(mem, a, N);
    run_prompt(map, b, N);
    if (memcmp(tm->data, tp->data, (size_t)tm->n_bytes) == 0) {
        cr_assert(memcmp(a, b, sizeof(float) * V * (N + 3)) == 0, "in-memory and mapped weights give other logits");
    } else {
        for (int64_t i = 0; i < (int64_t)V * (N + 3); i++)
            cr_assert(fabsf(a[i] - b[i]) <= 0.03f * (1.0f + fabsf(b[i])), "logit %lld: packed %.9g, mapped %.9g",
                      (long long)i, (double)a[i], (double)b[i]);
    }
    free(a), free(b);
    pd_model_free(mem), pd_model_free(map);
}

/* A sequence attends to a prefix of the other KV type: an f32 copy of an
 * f16 prefix (exact widening) scores the same text as the f16 original on
 * an f16 model, and an f16 prefix works under an f32 model. */
Test(engine, prefix_of_the_other_kv_type) {
    char path[1024];
    snprintf(path, sizeof path, "%s/mixed.gguf", tmpdir);
    gen("llama", PD_TYPE_F32, 3, true, path);
    pd_model *m16 = load_kv(path, 2, false), *m32 = load_kv(path, 2, true);
    const pd_hparams *hp = pd_model_hparams(m16);
    pd_token toks[NP + NS];
    prompt_tokens(toks, NP + NS, hp->n_vocab, 5);
    pd_error err = {0};
    pd_seq *pre = NULL;
    pd_kv_prefix *p16 = NULL, *p32 = NULL;
    cr_assert_eq(pd_seq_create(m16, 0, &pre, &err), PD_OK);
    cr_assert_eq(pd_prefill(m16, pre, toks, NP, NULL, NULL, &err), PD_OK);
    cr_assert_eq(pd_seq_to_prefix(pre, &p16, &err), PD_OK);
    cr_assert_eq(pd_kv_prefix_create(hp, NP, PD_TYPE_F32, &p32, &err), PD_OK);
    const size_t n = (size_t)NP * (size_t)hp->head_dim;
    float *k = malloc(sizeof(float) * n), *v = malloc(sizeof(float) * n);
    for (int l = 0; l < hp->n_layer; l++)
        for (int h = 0; h < hp->n_head_kv; h++) {
            const int32_t *pos;
            int64_t len = pd_kv_prefix_stream(p16, l, h, &pos, NULL, NULL);
            cr_assert_eq(pd_kv_prefix_stream_f32(p16, l, h, k, v), len);
            cr_assert_eq(pd_kv_prefix_set(p32, l, h, pos, k, v, len, &err), PD_OK, "%s", err.msg);
        }
    double a, b, c;
    cr_assert_eq(pd_nll(m16, p16, NULL, 0, toks + NP, NS, &a, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_nll(m16, p32, NULL, 0, toks + NP, NS, &b, &err), PD_OK, "%s", err.msg);
    cr_assert_float_eq(a, b, 1e-6, "the same values as f16 and as f32 rows: %.9g vs %.9g", a, b);
    cr_assert_eq(pd_nll(m32, p16, NULL, 0, toks + NP, NS, &c, &err), PD_OK, "%s", err.msg);
    cr_assert_float_eq(a, c, 1e-2, "an f16 prefix under an f32 cache: %.9g vs %.9g", a, c);
    free(k), free(v);
    pd_kv_prefix_free(p16), pd_kv_prefix_free(p32);
    pd_seq_free(pre);
    pd_model_free(m16), pd_model_free(m32);
}

typedef struct hook_state {
    int calls;
    int last_layer;
    bool shapes_ok;
    bool rope_ok;
} hook_state;

/* Keep every other token, with the parity depending on the head and layer so
 * that heads and layers keep different tokens. */
static uint8_t keep_rule(int layer, int head, int64_t i) { return (uint8_t)((i + head + layer) % 2 == 0 || i == 0); }

static int every_other_hook(void *ctx, const pd_layer_kv *L, uint8_t *keep, pd_error *err) {
    hook_state *st = ctx;
    (void)err;
    st->shapes_ok &= L->layer == st->last_layer + 1 && L->n_tokens == NP && L->pos[0] == 0 && L->pos[NP - 1] == NP - 1;
    st->last_layer = L->layer;
    st->calls++;
    /* Position 0 is unrotated: pre- and post-RoPE keys agree there and differ later. */
    for (int j = 0; j < L->head_dim; j++) st->rope_ok &= L->k_pre_rope[j] == L->k[j];
    int64_t row5 = (int64_t)5 * L->n_head_kv * L->head_dim;
    bool differs = false;
    for (int j = 0; j < L->head_dim; j++) differs |= L->k_pre_rope[row5 + j] != L->k[row5 + j];
    st->rope_ok &= differs;
    for (int h = 0; h < L->n_head_kv; h++)
        for (int64_t i = 0; i < L->n_tokens; i++) keep[h * L->n_tokens + i] = keep_rule(L->layer, h, i);
    return PD_OK;
}

Test(engine, hook_eviction_equals_masking) {
    char path[1024];
    snprintf(path, sizeof path, "%s/hook.gguf", tmpdir);
    gen("llama", PD_TYPE_F32, 5, true, path);
    pd_model *m = load(path, 2);
    const pd_hparams *hp = pd_model_hparams(m);
    const int32_t V = hp->n_vocab;
    pd_token toks[NP + NS];
    prompt_tokens(toks, NP + NS, V, 1);
    pd_error err = {0};

    /* A: evict through the hook. */
    pd_seq *a = NULL;
    hook_state st = {.last_layer = -1, .shapes_ok = true, .rope_ok = true};
    pd_prefill_opts hook = {.hook = every_other_hook, .hook_ctx = &st};
    cr_assert_eq(pd_seq_create(m, 0, &a, &err), PD_OK);
    float *la = malloc(sizeof(float) * V * NS), *lb = malloc(sizeof(float) * V * NS), *lfull = malloc(sizeof(float) * V);
    cr_assert_eq(pd_prefill(m, a, toks, NP, &hook, lfull, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(st.calls, hp->n_layer);
    cr_assert(st.shapes_ok, "the hook saw the wrong layer order, token count or positions");
    cr_assert(st.rope_ok, "pre-RoPE keys should equal post-RoPE keys at position 0 only");
    cr_assert_eq(pd_seq_pos(a), NP, "kept tokens keep positions: the next one is n, not the kept count");
    for (int l = 0; l < hp->n_layer; l++)
        for (int h = 0; h < hp->n_head_kv; h++) {
            int64_t want = 0;
            for (int64_t i = 0; i < NP; i++) want += keep_rule(l, h, i);
            cr_assert_eq(pd_seq_stream_len(a, l, h), want, "layer %d head %d", l, h);
        }

    /* B: keep everything, then mask the same rows. */
    pd_seq *b = NULL;
    float *lb_prefill = malloc(sizeof(float) * V);
    cr_assert_eq(pd_seq_create(m, 0, &b, &err), PD_OK);
    cr_assert_eq(pd_prefill(m, b, toks, NP, NULL, lb_prefill, &err), PD_OK);
    cr_assert_lt(max_abs_diff(lfull, lb_prefill, V), 1e-5, "eviction must not change the prefill's own output");
    for (int l = 0; l < hp->n_layer; l++)
        for (int h = 0; h < hp->n_head_kv; h++) {
            uint8_t keep[NP];
            for (int64_t i = 0; i < NP; i++) keep[i] = keep_rule(l, h, i);
            cr_assert_eq(pd_seq_set_mask(b, l, h, keep, NP, &err), PD_OK, "%s", err.msg);
        }

    pd_prefill_opts all = {.logits_all = true};
    cr_assert_eq(pd_prefill(m, a, toks + NP, NS, &all, la, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_prefill(m, b, toks + NP, NS, &all, lb, &err), PD_OK, "%s", err.msg);
    double e = max_abs_diff(la, lb, (int64_t)V * NS);
    cr_assert_lt(e, 1e-4, "evicted cache vs masked cache differ by %g", e);

    /* And the eviction really changed something. */
    pd_seq *c = NULL;
    float *lc = malloc(sizeof(float) * V * NS);
    cr_assert_eq(pd_seq_create(m, 0, &c, &err), PD_OK);
    cr_assert_eq(pd_prefill(m, c, toks, NP, NULL, NULL, &err), PD_OK);
    cr_assert_eq(pd_prefill(m, c, toks + NP, NS, &all, lc, &err), PD_OK);
    cr_assert_gt(max_abs_diff(la, lc, (int64_t)V * NS), 1e-3, "evicting half the cache should change the logits");

    /* The compressed cache becomes a shareable prefix with the same effect. */
    pd_seq *a2 = NULL, *d = NULL;
    pd_kv_prefix *p = NULL;
    st = (hook_state){.last_layer = -1, .shapes_ok = true, .rope_ok = true};
    cr_assert_eq(pd_seq_create(m, 0, &a2, &err), PD_OK);
    cr_assert_eq(pd_prefill(m, a2, toks, NP, &hook, NULL, &err), PD_OK);
    cr_assert_eq(pd_seq_to_prefix(a2, &p, &err), PD_OK);
    cr_assert_lt(pd_kv_prefix_kept_rows(p), (int64_t)NP * hp->n_layer * hp->n_head_kv);
    cr_assert_eq(pd_seq_create(m, 0, &d, &err), PD_OK);
    cr_assert_eq(pd_seq_attach_prefix(d, p, &err), PD_OK);
    float *ld = malloc(sizeof(float) * V * NS);
    cr_assert_eq(pd_prefill(m, d, toks + NP, NS, &all, ld, &err), PD_OK);
    cr_assert_lt(max_abs_diff(la, ld, (int64_t)V * NS), 1e-4);

    free(la), free(lb), free(lc), free(ld), free(lfull), free(lb_prefill);
    pd_seq_free(a), pd_seq_free(b), pd_seq_free(c), pd_seq_free(a2), pd_seq_free(d);
    pd_kv_prefix_free(p);
    pd_model_free(m);
}

Test(engine, batched_decode_equals_one_by_one) {
    char path[1024];
    snprintf(path, sizeof path, "%s/batch.gguf", tmpdir);
    gen("llama", PD_TYPE_F32, 9, true, path);
    pd_model *m = load(path, 2);
    const int32_t V = pd_model_hparams(m)->n_vocab;
    pd_error err = {0};
    enum { B = 3 };
    pd_seq *solo[B], *batch[B];
    pd_token toks[B][12];
    for (int i = 0; i < B; i++) {
        prompt_tokens(toks[i], 5 + 3 * i, V, i + 2);
        cr_assert_eq(pd_seq_create(m, 0, &solo[i], &err), PD_OK);
        cr_assert_eq(pd_seq_create(m, 0, &batch[i], &err), PD_OK);
        cr_assert_eq(pd_prefill(m, solo[i], toks[i], 5 + 3 * i, NULL, NULL, &err), PD_OK);
        cr_assert_eq(pd_prefill(m, batch[i], toks[i], 5 + 3 * i, NULL, NULL, &err), PD_OK);
    }
    float *lb = malloc(sizeof(float) * V * B), *ls = malloc(sizeof(float) * V);
    pd_token next[B] = {3, 50, 77};
    for (int step = 0; step < 4; step++) {
        cr_assert_eq(pd_decode(m, batch, next, B, lb, &err), PD_OK, "%s", err.msg);
        for (int i = 0; i < B; i++) {
            cr_assert_eq(pd_decode(m, &solo[i], &next[i], 1, ls, &err), PD_OK);
            cr_assert_lt(max_abs_diff(ls, lb + (int64_t)i * V, V), 1e-4, "step %d seq %d", step, i);
        }
        for (int i = 0; i < B; i++) next[i] = argmax(lb + (int64_t)i * V, V);
    }
    pd_seq *twice[2] = {batch[0], batch[0]};
    cr_assert_eq(pd_decode(m, twice, next, 2, lb, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "twice"), "%s", err.msg);
    for (int i = 0; i < B; i++) pd_seq_free(solo[i]), pd_seq_free(batch[i]);
    free(lb), free(ls);
    pd_model_free(m);
}

/* -log softmax(l)[target], computed independently of the engine. */
static double nll_of(const float *l, int32_t V, pd_token target) {
    double mx = l[0], z = 0;
    for (int j = 1; j < V; j++) mx = fmax(mx, l[j]);
    for (int j = 0; j < V; j++) z += exp(l[j] - mx);
    return log(z) + mx - l[target];
}

Test(engine, nll_matches_logits_and_prefix) {
    char path[1024];
    snprintf(path, sizeof path, "%s/nll.gguf", tmpdir);
    gen("llama", PD_TYPE_F32, 11, true, path);
    pd_model *m = load(path, 1);
    const int32_t V = pd_model_hparams(m)->n_vocab;
    pd_token ctx[10], text[150];
    prompt_tokens(ctx, 10, V, 3);
    prompt_tokens(text, 150, V, 4);
    pd_error err = {0};
    double nll = 0;
    cr_assert_eq(pd_nll(m, NULL, ctx, 10, text, 150, &nll, &err), PD_OK, "%s", err.msg);

    /* By hand from one prefill of context + text. */
    pd_token all[160];
    memcpy(all, ctx, sizeof ctx);
    memcpy(all + 10, text, sizeof text);
    float *logits = malloc(sizeof(float) * V * 160);
    pd_seq *s = NULL;
    pd_prefill_opts o = {.logits_all = true};
    cr_assert_eq(pd_seq_create(m, 0, &s, &err), PD_OK);
    cr_assert_eq(pd_prefill(m, s, all, 160, &o, logits, &err), PD_OK);
    double sum = 0;
    for (int i = 9; i < 159; i++) {
        sum += nll_of(logits + (int64_t)i * V, V, all[i + 1]);
    }
    cr_assert_float_eq(nll, sum / 150, 1e-4, "pd_nll %g vs by hand %g", nll, sum / 150);
    cr_assert_gt(nll, 0.0);

    /* With the context as an uncompressed prefix and no context, text[0] is not scored. */
    pd_seq *pre = NULL;
    pd_kv_prefix *p = NULL;
    cr_assert_eq(pd_seq_create(m, 0, &pre, &err), PD_OK);
    cr_assert_eq(pd_prefill(m, pre, ctx, 10, NULL, NULL, &err), PD_OK);
    cr_assert_eq(pd_seq_to_prefix(pre, &p, &err), PD_OK);
    double nll_p = 0;
    cr_assert_eq(pd_nll(m, p, NULL, 0, text, 150, &nll_p, &err), PD_OK, "%s", err.msg);
    double sum_p = 0;
    for (int i = 10; i < 159; i++) {
        sum_p += nll_of(logits + (int64_t)i * V, V, all[i + 1]);
    }
    cr_assert_float_eq(nll_p, sum_p / 149, 1e-4);

    cr_assert_eq(pd_nll(m, NULL, NULL, 0, text, 150, &nll, &err), PD_EINVAL);
    free(logits);
    pd_seq_free(s), pd_seq_free(pre);
    pd_kv_prefix_free(p);
    pd_model_free(m);
}

Test(engine, errors_are_explained) {
    char path[1024];
    snprintf(path, sizeof path, "%s/err.gguf", tmpdir);
    gen("llama", PD_TYPE_F32, 1, true, path);
    pd_model *m = load(path, 1);
    const int32_t V = pd_model_hparams(m)->n_vocab;
    pd_error err = {0};
    pd_seq *s = NULL;
    cr_assert_eq(pd_seq_create(m, 8, &s, &err), PD_OK);
    pd_token bad = V + 5;
    cr_assert_eq(pd_prefill(m, s, &bad, 1, NULL, NULL, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "outside the vocabulary"), "%s", err.msg);
    pd_token toks[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    cr_assert_eq(pd_prefill(m, s, toks, 9, NULL, NULL, &err), PD_ERANGE);
    cr_assert(strstr(err.msg, "context size 8"), "%s", err.msg);
    cr_assert_eq(pd_seq_pos(s), 0, "a refused call leaves the sequence unchanged");
    cr_assert_eq(pd_prefill(m, s, toks, 4, NULL, NULL, &err), PD_OK);
    pd_kv_prefix *p = NULL;
    cr_assert_eq(pd_seq_to_prefix(s, &p, &err), PD_OK);
    cr_assert_eq(pd_seq_attach_prefix(s, p, &err), PD_EINVAL, "not on a non-empty sequence");
    cr_assert(strstr(err.msg, "empty sequence"), "%s", err.msg);
    pd_kv_prefix_free(p);
    pd_seq_free(s);
    pd_model_free(m);

    cr_assert_neq(pd_model_load("/nonexistent.gguf", NULL, &m, &err), PD_OK);
    cr_assert_null(m);
    char vocab[1024];
    if (th_shared_file("vocab/ggml-vocab-gpt-2.gguf", vocab, sizeof vocab)) {
        cr_assert_eq(pd_model_load(vocab, NULL, &m, &err), PD_EUNSUPPORTED);
        cr_assert(strstr(err.msg, "gpt2") && strstr(err.msg, "not supported"), "%s", err.msg);
    }
}

/* Copy a model, adding metadata and optionally a rope_freqs.weight tensor. */
static void with_rope_scaling(const char *src, const char *dst, const char *type, float factor, bool freqs_tensor) {
    pd_gguf *g = NULL;
    pd_gguf_writer *w = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open(src, &g, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_gguf_writer_new(&w, &err), PD_OK);
    for (size_t i = 0; i < pd_gguf_kv_count(g); i++)
        cr_assert_eq(pd_gguf_writer_copy_kv(w, pd_gguf_kv_at(g, i), &err), PD_OK, "%s", err.msg);
    if (type) {
        cr_assert_eq(pd_gguf_writer_set_str(w, "llama.rope.scaling.type", type, &err), PD_OK);
        cr_assert_eq(pd_gguf_writer_set_f32(w, "llama.rope.scaling.factor", factor, &err), PD_OK);
    }
    for (size_t i = 0; i < pd_gguf_tensor_count(g); i++) {
        const pd_gguf_tensor *t = pd_gguf_tensor_at(g, i);
        cr_assert_eq(pd_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, t->data, &err), PD_OK);
    }
    uint32_t n_rot = 0;
    cr_assert_eq(pd_gguf_get_u32(g, "llama.rope.dimension_count", &n_rot, &err), PD_OK, "%s", err.msg);
    if (freqs_tensor) {
        float f[256];
        for (uint32_t i = 0; i < n_rot / 2; i++) f[i] = factor;
        uint64_t ne[1] = {n_rot / 2};
        cr_assert_eq(pd_gguf_writer_add_tensor(w, "rope_freqs.weight", PD_TYPE_F32, 1, ne, f, &err), PD_OK);
    }
    cr_assert_eq(pd_gguf_writer_write(w, dst, 0, &err), PD_OK, "%s", err.msg);
    pd_gguf_writer_free(w);
    pd_gguf_close(g);
}

/* llama3's per-frequency divisors (rope_freqs.weight) all equal to s must act
 * exactly like linear scaling by s, and both must change the output. */
Test(engine, rope_scaling_linear_equals_uniform_freq_factors) {
    char base[1024], lin[1024], freqs[1024];
    snprintf(base, sizeof base, "%s/rope.gguf", tmpdir);
    snprintf(lin, sizeof lin, "%s/rope-linear.gguf", tmpdir);
    snprintf(freqs, sizeof freqs, "%s/rope-freqs.gguf", tmpdir);
    gen("llama", PD_TYPE_F32, 13, true, base);
    with_rope_scaling(base, lin, "linear", 4.0f, false);
    with_rope_scaling(base, freqs, NULL, 4.0f, true);
    pd_model *mb = load(base, 1), *ml = load(lin, 1), *mf = load(freqs, 1);
    const int32_t V = pd_model_hparams(mb)->n_vocab;
    enum { N = 24 };
    float *lb = malloc(sizeof(float) * V * (N + 3)), *ll = malloc(sizeof(float) * V * (N + 3)),
          *lf = malloc(sizeof(float) * V * (N + 3));
    run_prompt(mb, lb, N);
    run_prompt(ml, ll, N);
    run_prompt(mf, lf, N);
    cr_assert_lt(max_abs_diff(ll, lf, (int64_t)V * (N + 3)), 1e-5, "linear scaling and uniform freq factors differ");
    cr_assert_gt(max_abs_diff(lb, ll, (int64_t)V * (N + 3)), 1e-3, "rope scaling should change the output");
    free(lb), free(ll), free(lf);
    pd_model_free(mb), pd_model_free(ml), pd_model_free(mf);

    pd_error err = {0};
    pd_model *bad = NULL;
    with_rope_scaling(base, lin, "yarn", 4.0f, false);
    cr_assert_eq(pd_model_load(lin, NULL, &bad, &err), PD_EUNSUPPORTED);
    cr_assert(strstr(err.msg, "yarn"), "%s", err.msg);
}
