/* tools/testmodel.c and engine/gguf_write.c: generated models read back with
 * the GGUF reader; writer error handling. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/engine.h"
#include "helpers.h"
#include "tools/tools.h"

static char *tmpdir;

static void setup(void) {
    tmpdir = th_mkdtemp();
    cr_assert_not_null(tmpdir, "cannot create a temporary directory");
}

static void teardown(void) {
    th_rmtree(tmpdir);
    free(tmpdir);
    tmpdir = NULL;
}

static char *tpath(const char *name) {
    static char buf[4][1024];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", tmpdir, name);
    return buf[k];
}

static void gen(const pd_testmodel_opts *o, const char *path, pd_testmodel_info *info) {
    pd_error err = {0};
    int rc = pd_testmodel_write(o, path, info, &err);
    cr_assert_eq(rc, PD_OK, "pd_testmodel_write(%s): %s", path, err.msg);
}

static pd_gguf *open_ok(const char *path) {
    pd_gguf *g = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open(path, &g, &err), PD_OK, "open %s: %s", path, err.msg);
    return g;
}

static uint32_t get_u32(const pd_gguf *g, const char *key) {
    uint32_t v = 0;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_get_u32(g, key, &v, &err), PD_OK, "%s: %s", key, err.msg);
    return v;
}

static float get_f32(const pd_gguf *g, const char *key) {
    float v = 0;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_get_f32(g, key, &v, &err), PD_OK, "%s: %s", key, err.msg);
    return v;
}

static bool get_bool(const pd_gguf *g, const char *key) {
    bool v = false;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_get_bool(g, key, &v, &err), PD_OK, "%s: %s", key, err.msg);
    return v;
}

static void expect_str(const pd_gguf *g, const char *key, const char *want) {
    pd_str s = {0};
    pd_error err = {0};
    cr_assert_eq(pd_gguf_get_str(g, key, &s, &err), PD_OK, "%s: %s", key, err.msg);
    cr_expect(s.len == strlen(want) && memcmp(s.ptr, want, s.len) == 0, "%s = '%.*s', want '%s'", key,
              (int)s.len, s.ptr, want);
}

static bool str_eq(pd_str s, const char *c) {
    return s.len == strlen(c) && memcmp(s.ptr, c, s.len) == 0;
}

static const pd_gguf_tensor *expect_tensor(const pd_gguf *g, const char *name, pd_type type, uint64_t ne0,
                                           uint64_t ne1) {
    const pd_gguf_tensor *t = pd_gguf_find_tensor(g, name);
    cr_assert_not_null(t, "tensor %s missing", name);
    cr_expect_eq(t->type, type, "%s type %d, want %d", name, (int)t->type, (int)type);
    cr_expect_eq(t->n_dims, ne1 ? 2u : 1u, "%s n_dims", name);
    cr_expect_eq(t->ne[0], ne0, "%s ne0 %llu want %llu", name, (unsigned long long)t->ne[0],
                 (unsigned long long)ne0);
    if (ne1) cr_expect_eq(t->ne[1], ne1, "%s ne1 %llu want %llu", name, (unsigned long long)t->ne[1],
                          (unsigned long long)ne1);
    return t;
}

static float *dequant(const pd_gguf_tensor *t) {
    float *y = malloc(t->n_elems * sizeof *y);
    cr_assert_not_null(y);
    pd_error err = {0};
    cr_assert_eq(pd_dequantize_row(t->type, t->data, y, t->n_elems, &err), PD_OK, "%s: %s", t->name, err.msg);
    return y;
}

static char *slurp(const char *path, size_t *len) {
    char *buf = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_read_file(path, &buf, len, &err), PD_OK, "%s", err.msg);
    return buf;
}

static pd_testmodel_opts preset(const char *name) {
    pd_testmodel_opts o;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset(name, &o, &err), PD_OK, "%s", err.msg);
    return o;
}

/* ------------------------------------------------------------------------
 * generated models
 * ------------------------------------------------------------------------ */

TestSuite(testmodel, .init = setup, .fini = teardown);

Test(testmodel, presets_are_valid) {
    cr_assert_eq(pd_testmodel_preset_count(), 10);
    for (size_t i = 0; i < pd_testmodel_preset_count(); i++) {
        pd_testmodel_opts o = preset(pd_testmodel_preset_name(i));
        pd_error err = {0};
        cr_expect_eq(pd_testmodel_validate(&o, &err), PD_OK, "%s: %s", pd_testmodel_preset_name(i), err.msg);
    }
    pd_testmodel_opts o = preset("qwen2.5-0.5b");
    cr_expect_str_eq(o.arch, "qwen2");
    cr_expect_eq(o.n_embd, 896);
    cr_expect_eq(o.n_vocab, 151936);
    cr_expect(o.tied);
    o = preset("SmolLM2-135M");
    cr_expect_eq(o.n_layer, 30);
    cr_expect_eq(o.n_head_kv, 3);
    o = preset("mistral-7b");
    cr_expect_str_eq(o.arch, "llama");
    cr_expect(o.n_vocab == 32768 && o.n_embd == 4096 && o.n_ff == 14336 && o.n_head_kv == 8 && !o.tied && o.peaked);
    o = preset("qwen3-0.6b");
    cr_expect(o.n_embd == 1024 && o.n_head == 16 && o.head_dim == 128 && o.n_layer == 28 && o.tied);
    o = preset("gemma-2-2b");
    cr_expect(o.head_dim == 256 && o.sliding_window == 4096 && o.attn_softcap == 50.0f && o.final_softcap == 30.0f);
    o = preset("gemma-3-1b");
    cr_expect(o.n_head_kv == 1 && o.sliding_window == 512 && o.attn_softcap == 0.0f);
    o = preset("phi-3-mini");
    cr_expect(o.n_vocab == 32064 && o.n_embd == 3072 && o.sliding_window == 2047 && !o.tied);
    pd_error err = {0};
    cr_expect_eq(pd_testmodel_preset("gpt-5", &o, &err), PD_ENOTFOUND);
    cr_expect(strstr(err.msg, "tiny") != NULL, "error lists the presets: %s", err.msg);
    cr_assert_null(pd_testmodel_preset_name(99));
}

Test(testmodel, tiny_llama_metadata_and_tensors) {
    pd_testmodel_opts o = preset("tiny");
    const char *path = tpath("tiny.gguf");
    pd_testmodel_info info;
    gen(&o, path, &info);
    const uint32_t nv = pd_testmodel_builtin_vocab_size();
    cr_assert_geq(nv, 259 + 95);
    cr_assert_leq(nv, 512);
    cr_expect_eq(info.n_vocab, nv);

    pd_gguf *g = open_ok(path);
    cr_expect_eq(pd_gguf_version(g), 3);
    cr_expect_eq(pd_gguf_alignment(g), 32);
    expect_str(g, "general.architecture", "llama");
    expect_str(g, "general.name", "prefixd-test-tiny");
    cr_expect_eq(get_u32(g, "general.file_type"), 0);
    cr_expect_eq(get_u32(g, "llama.context_length"), 256);
    cr_expect_eq(get_u32(g, "llama.embedding_length"), 64);
    cr_expect_eq(get_u32(g, "llama.feed_forward_length"), 128);
    cr_expect_eq(get_u32(g, "llama.block_count"), 2);
    cr_expect_eq(get_u32(g, "llama.attention.head_count"), 4);
    cr_expect_eq(get_u32(g, "llama.attention.head_count_kv"), 2);
    cr_expect_eq(get_u32(g, "llama.rope.dimension_count"), 16);
    cr_expect_eq(get_f32(g, "llama.rope.freq_base"), 10000.0f);
    cr_expect_eq(get_f32(g, "llama.attention.layer_norm_rms_epsilon"), 1e-5f);
    cr_expect_eq(get_u32(g, "llama.vocab_size"), nv);

    /* tokenizer */
    expect_str(g, "tokenizer.ggml.model", "llama");
    expect_str(g, "tokenizer.ggml.pre", "default");
    cr_expect_eq(get_u32(g, "tokenizer.ggml.bos_token_id"), 1);
    cr_expect_eq(get_u32(g, "tokenizer.ggml.eos_token_id"), 2);
    cr_expect_eq(get_u32(g, "tokenizer.ggml.unknown_token_id"), 0);
    cr_expect(get_bool(g, "tokenizer.ggml.add_bos_token"));
    cr_expect(!get_bool(g, "tokenizer.ggml.add_eos_token"));
    const pd_gguf_value *toks, *scores, *types;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_get_arr(g, "tokenizer.ggml.tokens", PD_GGUF_STRING, &toks, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_gguf_get_arr(g, "tokenizer.ggml.scores", PD_GGUF_FLOAT32, &scores, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_gguf_get_arr(g, "tokenizer.ggml.token_type", PD_GGUF_INT32, &types, &err), PD_OK, "%s",
                 err.msg);
    cr_assert_eq(toks->arr.n, nv);
    cr_assert_eq(scores->arr.n, nv);
    cr_assert_eq(types->arr.n, nv);
    cr_expect(str_eq(toks->arr.strs[0], "<unk>"));
    cr_expect(str_eq(toks->arr.strs[1], "<s>"));
    cr_expect(str_eq(toks->arr.strs[2], "</s>"));
    cr_expect(str_eq(toks->arr.strs[3], "<0x00>"));
    cr_expect(str_eq(toks->arr.strs[3 + 0x41], "<0x41>"));
    cr_expect(str_eq(toks->arr.strs[258], "<0xFF>"));
    cr_expect(str_eq(toks->arr.strs[259], "\xe2\x96\x81"), "token 259 is the SentencePiece space");
    cr_expect_eq(pd_gguf_arr_i32(types, 0), PD_TOKEN_TYPE_UNKNOWN);
    cr_expect_eq(pd_gguf_arr_i32(types, 1), PD_TOKEN_TYPE_CONTROL);
    cr_expect_eq(pd_gguf_arr_i32(types, 2), PD_TOKEN_TYPE_CONTROL);
    for (uint32_t i = 3; i < 259; i++) cr_assert_eq(pd_gguf_arr_i32(types, i), PD_TOKEN_TYPE_BYTE, "token %u", i);
    bool found_the = false, found_a = false;
    for (uint32_t i = 259; i < nv; i++) {
        cr_assert_eq(pd_gguf_arr_i32(types, i), PD_TOKEN_TYPE_NORMAL, "token %u", i);
        if (i > 259)
            cr_assert_lt(pd_gguf_arr_f32(scores, i), pd_gguf_arr_f32(scores, i - 1), "scores descend at %u", i);
        found_the |= str_eq(toks->arr.strs[i], "\xe2\x96\x81the");
        found_a |= str_eq(toks->arr.strs[i], "a");
        for (uint32_t j = 0; j < i; j++)
            cr_assert(toks->arr.strs[j].len != toks->arr.strs[i].len ||
                          memcmp(toks->arr.strs[j].ptr, toks->arr.strs[i].ptr, toks->arr.strs[i].len) != 0,
                      "token %u duplicates %u", i, j);
    }
    cr_expect(found_the && found_a);

    /* tensors: llama.cpp names and shapes, ne0 contiguous */
    const uint64_t E = 64, F = 128, Ekv = 32;
    cr_expect_eq(pd_gguf_tensor_count(g), 1 + 2 * 9 + 2);
    cr_expect_eq(info.n_tensors, pd_gguf_tensor_count(g));
    expect_tensor(g, "token_embd.weight", PD_TYPE_F32, E, nv);
    for (int l = 0; l < 2; l++) {
        char n[64];
        snprintf(n, sizeof n, "blk.%d.attn_norm.weight", l);
        expect_tensor(g, n, PD_TYPE_F32, E, 0);
        snprintf(n, sizeof n, "blk.%d.attn_q.weight", l);
        expect_tensor(g, n, PD_TYPE_F32, E, E);
        snprintf(n, sizeof n, "blk.%d.attn_k.weight", l);
        expect_tensor(g, n, PD_TYPE_F32, E, Ekv);
        snprintf(n, sizeof n, "blk.%d.attn_v.weight", l);
        expect_tensor(g, n, PD_TYPE_F32, E, Ekv);
        snprintf(n, sizeof n, "blk.%d.attn_output.weight", l);
        expect_tensor(g, n, PD_TYPE_F32, E, E);
        snprintf(n, sizeof n, "blk.%d.ffn_norm.weight", l);
        expect_tensor(g, n, PD_TYPE_F32, E, 0);
        snprintf(n, sizeof n, "blk.%d.ffn_gate.weight", l);
        expect_tensor(g, n, PD_TYPE_F32, E, F);
        snprintf(n, sizeof n, "blk.%d.ffn_up.weight", l);
        expect_tensor(g, n, PD_TYPE_F32, E, F);
        snprintf(n, sizeof n, "blk.%d.ffn_down.weight", l);
        expect_tensor(g, n, PD_TYPE_F32, F, E);
        snprintf(n, sizeof n, "blk.%d.attn_q.bias", l);
        cr_expect_null(pd_gguf_find_tensor(g, n), "llama has no biases");
    }
    expect_tensor(g, "output_norm.weight", PD_TYPE_F32, E, 0);
    expect_tensor(g, "output.weight", PD_TYPE_F32, E, nv);

    /* data: norms are 1, matrices ~ N(0, 0.02), and equal the documented values */
    const pd_gguf_tensor *norm = pd_gguf_find_tensor(g, "blk.1.ffn_norm.weight");
    float *nw = dequant(norm);
    for (uint64_t i = 0; i < norm->n_elems; i++) cr_assert_eq(nw[i], 1.0f);
    free(nw);
    uint64_t params = 0;
    for (size_t i = 0; i < pd_gguf_tensor_count(g); i++) {
        const pd_gguf_tensor *t = pd_gguf_tensor_at(g, i);
        params += t->n_elems;
        cr_expect_eq(t->offset % 32, 0, "%s offset aligned", t->name);
        if (t->n_dims != 2) continue;
        float *w = dequant(t);
        double sum = 0, sq = 0, amax = 0;
        for (uint64_t k = 0; k < t->n_elems; k++) {
            sum += w[k];
            sq += (double)w[k] * w[k];
            amax = fmax(amax, fabs(w[k]));
        }
        const double mean = sum / (double)t->n_elems, sd = sqrt(sq / (double)t->n_elems - mean * mean);
        cr_expect_lt(fabs(mean), 0.003, "%s mean %g", t->name, mean);
        cr_expect(sd > 0.017 && sd < 0.023, "%s std %g", t->name, sd);
        cr_expect_lt(amax, 0.02 * 6.0 + 1e-6, "%s max |w| %g", t->name, amax);
        float *v = malloc(t->n_elems * sizeof *v);
        cr_assert_eq(pd_testmodel_tensor_values(&o, t->name, v, t->n_elems, &err), PD_OK, "%s", err.msg);
        cr_expect_eq(memcmp(v, w, t->n_elems * sizeof *v), 0, "%s matches pd_testmodel_tensor_values", t->name);
        free(v);
        free(w);
    }
    cr_expect_eq(info.n_params, params);
    /* different tensors get different values */
    const pd_gguf_tensor *q0 = pd_gguf_find_tensor(g, "blk.0.attn_q.weight");
    const pd_gguf_tensor *q1 = pd_gguf_find_tensor(g, "blk.1.attn_q.weight");
    cr_expect_neq(memcmp(q0->data, q1->data, q0->n_bytes), 0);
    pd_gguf_close(g);
}

Test(testmodel, qwen2_tied_with_biases) {
    pd_testmodel_opts o = preset("tiny");
    o.arch = "qwen2";
    o.tied = true;
    o.rms_eps = 1e-6f;
    o.rope_freq_base = 1000000.0f;
    o.n_vocab = 600; /* padded built-in vocab */
    o.name = "tiny qwen";
    const char *path = tpath("qwen.gguf");
    gen(&o, path, NULL);
    pd_gguf *g = open_ok(path);
    expect_str(g, "general.architecture", "qwen2");
    expect_str(g, "general.name", "tiny qwen");
    cr_expect_eq(get_u32(g, "qwen2.embedding_length"), 64);
    cr_expect_eq(get_u32(g, "qwen2.block_count"), 2);
    cr_expect_eq(get_u32(g, "qwen2.attention.head_count_kv"), 2);
    cr_expect_eq(get_f32(g, "qwen2.attention.layer_norm_rms_epsilon"), 1e-6f);
    cr_expect_eq(get_f32(g, "qwen2.rope.freq_base"), 1000000.0f);
    cr_expect_null(pd_gguf_find(g, "llama.block_count"));
    cr_expect_null(pd_gguf_find_tensor(g, "output.weight"), "tied: no output.weight");
    cr_expect_eq(pd_gguf_tensor_count(g), 1 + 2 * 12 + 1);
    expect_tensor(g, "token_embd.weight", PD_TYPE_F32, 64, 600);
    for (int l = 0; l < 2; l++) {
        char n[64];
        snprintf(n, sizeof n, "blk.%d.attn_q.bias", l);
        const pd_gguf_tensor *b = expect_tensor(g, n, PD_TYPE_F32, 64, 0);
        float *v = dequant(b);
        bool nonzero = false;
        for (uint64_t i = 0; i < b->n_elems; i++) nonzero |= v[i] != 0.0f;
        cr_expect(nonzero, "%s is random, not zero", n);
        free(v);
        snprintf(n, sizeof n, "blk.%d.attn_k.bias", l);
        expect_tensor(g, n, PD_TYPE_F32, 32, 0);
        snprintf(n, sizeof n, "blk.%d.attn_v.bias", l);
        expect_tensor(g, n, PD_TYPE_F32, 32, 0);
    }
    /* padded vocab */
    const pd_gguf_value *toks, *types;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_get_arr(g, "tokenizer.ggml.tokens", PD_GGUF_STRING, &toks, &err), PD_OK);
    cr_assert_eq(pd_gguf_get_arr(g, "tokenizer.ggml.token_type", PD_GGUF_INT32, &types, &err), PD_OK);
    cr_assert_eq(toks->arr.n, 600);
    cr_expect(str_eq(toks->arr.strs[599], "[PAD599]"));
    cr_expect_eq(pd_gguf_arr_i32(types, 599), PD_TOKEN_TYPE_UNUSED);
    pd_gguf_close(g);
}

/* A small model of each newer architecture: llama.cpp's keys and tensors. */
static pd_gguf *gen_arch(const char *arch, const char *file, bool peaked) {
    pd_testmodel_opts o = preset("tiny");
    o.arch = arch;
    o.head_dim = 32; /* 4 x 32 = 128 != n_embd 64, except for phi3 */
    o.tied = strcmp(arch, "phi3") != 0;
    o.sliding_window = 48;
    o.peaked = peaked;
    if (strcmp(arch, "phi3") == 0) o.head_dim = 16;
    if (strcmp(arch, "gemma2") == 0) o.attn_softcap = 50.0f, o.final_softcap = 30.0f;
    gen(&o, tpath(file), NULL);
    return open_ok(tpath(file));
}

static void expect_layer(pd_gguf *g, int l, const char *suffix, uint64_t ne0, uint64_t ne1) {
    char n[96];
    snprintf(n, sizeof n, "blk.%d.%s", l, suffix);
    expect_tensor(g, n, PD_TYPE_F32, ne0, ne1);
}

static void expect_no_layer(pd_gguf *g, const char *suffix) {
    char n[96];
    snprintf(n, sizeof n, "blk.0.%s", suffix);
    cr_expect_null(pd_gguf_find_tensor(g, n), "%s should not exist", n);
}

Test(testmodel, qwen3_has_qk_norms_and_head_size_keys) {
    pd_gguf *g = gen_arch("qwen3", "qwen3.gguf", false);
    cr_expect_eq(get_u32(g, "qwen3.attention.key_length"), 32);
    cr_expect_eq(get_u32(g, "qwen3.attention.value_length"), 32);
    cr_expect_eq(get_u32(g, "qwen3.rope.dimension_count"), 32);
    for (int l = 0; l < 2; l++) {
        expect_layer(g, l, "attn_q.weight", 64, 128);
        expect_layer(g, l, "attn_k.weight", 64, 64);
        expect_layer(g, l, "attn_output.weight", 128, 64);
        expect_layer(g, l, "attn_q_norm.weight", 32, 0);
        expect_layer(g, l, "attn_k_norm.weight", 32, 0);
    }
    expect_no_layer(g, "attn_q.bias");
    cr_expect_null(pd_gguf_find_tensor(g, "output.weight"));
    cr_expect_eq(pd_gguf_tensor_count(g), 1 + 2 * 11 + 1);
    pd_gguf_close(g);
}

Test(testmodel, gemma2_has_post_norms_window_and_caps) {
    pd_gguf *g = gen_arch("gemma2", "gemma2.gguf", false);
    cr_expect_eq(get_u32(g, "gemma2.attention.sliding_window"), 48);
    cr_expect_eq(get_f32(g, "gemma2.attn_logit_softcapping"), 50.0f);
    cr_expect_eq(get_f32(g, "gemma2.final_logit_softcapping"), 30.0f);
    cr_expect_eq(get_u32(g, "gemma2.attention.key_length"), 32);
    for (int l = 0; l < 2; l++) {
        expect_layer(g, l, "post_attention_norm.weight", 64, 0);
        expect_layer(g, l, "post_ffw_norm.weight", 64, 0);
        expect_layer(g, l, "ffn_gate.weight", 64, 128);
    }
    expect_no_layer(g, "attn_q_norm.weight");
    cr_expect_null(pd_gguf_find_tensor(g, "output.weight"), "gemma2 ties its output");
    cr_expect_eq(pd_gguf_tensor_count(g), 1 + 2 * 11 + 1);
    pd_gguf_close(g);
    pd_testmodel_opts o = preset("tiny");
    o.arch = "gemma2";
    pd_error err = {0};
    cr_expect_eq(pd_testmodel_validate(&o, &err), PD_EINVAL, "an untied gemma2 is refused");
    cr_expect(strstr(err.msg, "--tied") != NULL, "%s", err.msg);
}

Test(testmodel, gemma3_has_qk_norms_and_post_norms) {
    pd_gguf *g = gen_arch("gemma3", "gemma3.gguf", false);
    cr_expect_eq(get_u32(g, "gemma3.attention.sliding_window"), 48);
    cr_expect_null(pd_gguf_find(g, "gemma3.attn_logit_softcapping"));
    expect_layer(g, 1, "attn_q_norm.weight", 32, 0);
    expect_layer(g, 1, "post_ffw_norm.weight", 64, 0);
    cr_expect_eq(pd_gguf_tensor_count(g), 1 + 2 * 13 + 1);
    pd_gguf_close(g);
    pd_testmodel_opts o = preset("tiny");
    o.arch = "gemma3";
    o.tied = true;
    pd_error err = {0};
    cr_expect_eq(pd_testmodel_validate(&o, &err), PD_EINVAL, "gemma3 needs a window");
}

Test(testmodel, phi3_fuses_qkv_and_gate_up) {
    pd_gguf *g = gen_arch("phi3", "phi3.gguf", false);
    cr_expect_eq(get_u32(g, "phi3.attention.sliding_window"), 48);
    cr_expect_eq(get_u32(g, "phi3.rope.dimension_count"), 16);
    for (int l = 0; l < 2; l++) {
        expect_layer(g, l, "attn_qkv.weight", 64, 64 + 2 * 32);
        expect_layer(g, l, "ffn_up.weight", 64, 2 * 128);
        expect_layer(g, l, "ffn_down.weight", 128, 64);
    }
    expect_no_layer(g, "attn_q.weight");
    expect_no_layer(g, "ffn_gate.weight");
    expect_tensor(g, "output.weight", PD_TYPE_F32, 64, pd_testmodel_builtin_vocab_size());
    /* llama.cpp sets Phi-3 token attributes on "<|endoftext|>" when the
     * name says phi-3: the built-in vocabulary's model must not. */
    pd_str name;
    cr_assert_eq(pd_gguf_get_str(g, "general.name", &name, NULL), PD_OK);
    cr_expect(!memmem(name.ptr, name.len, "phi-3", 5) && !memmem(name.ptr, name.len, "phi3", 4), "%.*s",
              (int)name.len, name.ptr);
    cr_expect_eq(pd_gguf_tensor_count(g), 1 + 2 * 6 + 2);
    pd_gguf_close(g);
}

/* Peaked weights: the vocabulary rows carry the prior in element 0 and
 * the generator reproduces every value. */
Test(testmodel, peaked_weights_are_reproducible_and_carry_a_prior) {
    pd_testmodel_opts o = preset("tiny");
    o.peaked = true;
    o.n_vocab = 600;
    gen(&o, tpath("peaked.gguf"), NULL);
    pd_gguf *g = open_ok(tpath("peaked.gguf"));
    pd_error err = {0};
    const char *names[] = {"token_embd.weight", "output.weight", "output_norm.weight", "blk.0.attn_norm.weight",
                           "blk.1.attn_q.weight", "blk.1.ffn_down.weight"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        const pd_gguf_tensor *t = pd_gguf_find_tensor(g, names[i]);
        cr_assert_not_null(t, "%s", names[i]);
        float *w = dequant(t), *v = malloc(t->n_elems * sizeof *v);
        cr_assert_eq(pd_testmodel_tensor_values(&o, t->name, v, t->n_elems, &err), PD_OK, "%s", err.msg);
        cr_expect_eq(memcmp(v, w, t->n_elems * sizeof *v), 0, "%s matches pd_testmodel_tensor_values", t->name);
        free(v);
        free(w);
    }
    /* Element 0 of the rows: larger for tokens of the prior text (" the")
     * than for padding, and the same positive base for all. */
    const pd_gguf_tensor *e = pd_gguf_find_tensor(g, "output.weight");
    const float *rows = (const float *)e->data;
    int32_t the = -1;
    const pd_gguf_value *toks;
    cr_assert_eq(pd_gguf_get_arr(g, "tokenizer.ggml.tokens", PD_GGUF_STRING, &toks, &err), PD_OK);
    for (uint32_t j = 0; j < toks->arr.n; j++)
        if (str_eq(toks->arr.strs[j], "\xe2\x96\x81the")) the = (int32_t)j;
    cr_assert_geq(the, 0);
    const float pad = rows[599 * 64], unk = rows[0];
    cr_expect_gt(rows[(size_t)the * 64], pad * 1.5f, "the %g, padding %g", rows[(size_t)the * 64], pad);
    cr_expect_eq(pad, unk, "non-normal tokens share the lowest prior");
    cr_expect_gt(pad, 0.0f);
    /* attn_norm hides element 0 from the layers. */
    const float *an = (const float *)pd_gguf_find_tensor(g, "blk.0.attn_norm.weight")->data;
    cr_expect(an[0] == 0.0f && an[1] == 1.0f);
    pd_gguf_close(g);
}

Test(testmodel, same_seed_same_bytes_other_seed_differs) {
    pd_testmodel_opts o = preset("tiny");
    o.wtype = PD_TYPE_Q8_0;
    o.seed = 42;
    gen(&o, tpath("a.gguf"), NULL);
    gen(&o, tpath("b.gguf"), NULL);
    o.seed = 43;
    gen(&o, tpath("c.gguf"), NULL);
    size_t la, lb, lc;
    char *a = slurp(tpath("a.gguf"), &la), *b = slurp(tpath("b.gguf"), &lb), *c = slurp(tpath("c.gguf"), &lc);
    cr_assert_eq(la, lb);
    cr_expect_eq(memcmp(a, b, la), 0, "same options must give byte-identical files");
    cr_assert_eq(la, lc, "the seed does not change the layout");
    cr_expect_neq(memcmp(a, c, la), 0, "another seed must give other weights");
    free(a);
    free(b);
    free(c);
    /* no temporary files are left behind */
    DIR *d = opendir(tmpdir);
    cr_assert_not_null(d);
    struct dirent *e;
    while ((e = readdir(d)))
        cr_expect(strstr(e->d_name, ".tmp-") == NULL, "leftover temp file %s", e->d_name);
    closedir(d);
}

/* The same seed quantized: Q8_0/Q6_K/Q4_K weights are the F32 weights
 * within the type's error. */
static void compare_quantized(pd_type type, const pd_testmodel_opts *base, double max_rel_rmse,
                              uint32_t file_type) {
    pd_testmodel_opts o = *base;
    o.wtype = PD_TYPE_F32;
    gen(&o, tpath("f32.gguf"), NULL);
    o.wtype = type;
    pd_testmodel_info info;
    gen(&o, tpath("q.gguf"), &info);
    cr_expect_eq(info.n_fallback, 0);
    pd_gguf *gf = open_ok(tpath("f32.gguf")), *gq = open_ok(tpath("q.gguf"));
    cr_expect_eq(get_u32(gq, "general.file_type"), file_type);
    cr_assert_eq(pd_gguf_tensor_count(gf), pd_gguf_tensor_count(gq));
    for (size_t i = 0; i < pd_gguf_tensor_count(gf); i++) {
        const pd_gguf_tensor *tf = pd_gguf_tensor_at(gf, i);
        const pd_gguf_tensor *tq = pd_gguf_find_tensor(gq, tf->name);
        cr_assert_not_null(tq, "%s", tf->name);
        cr_assert_eq(tq->n_elems, tf->n_elems);
        if (tf->n_dims == 1) {
            cr_expect_eq(tq->type, PD_TYPE_F32, "%s: norms and biases stay f32", tf->name);
            cr_expect_eq(memcmp(tq->data, tf->data, tf->n_bytes), 0);
            continue;
        }
        cr_expect_eq(tq->type, type, "%s", tf->name);
        float *wf = dequant(tf), *wq = dequant(tq);
        double se = 0, ss = 0;
        for (uint64_t k = 0; k < tf->n_elems; k++) {
            se += ((double)wq[k] - wf[k]) * ((double)wq[k] - wf[k]);
            ss += (double)wf[k] * wf[k];
        }
        const double rel = sqrt(se / ss);
        cr_expect_lt(rel, max_rel_rmse, "%s: relative rmse %g", tf->name, rel);
        cr_expect_gt(rel, 0.0, "%s: quantization changes something", tf->name);
        free(wf);
        free(wq);
    }
    pd_gguf_close(gf);
    pd_gguf_close(gq);
}

Test(testmodel, q8_0_weights_close_to_f32) {
    pd_testmodel_opts o = preset("tiny");
    o.seed = 5;
    compare_quantized(PD_TYPE_Q8_0, &o, 0.01, 7);
}

static pd_testmodel_opts kquant_shape(void) {
    pd_testmodel_opts o = preset("tiny");
    o.n_embd = 256;
    o.n_ff = 512;
    o.n_layer = 1;
    o.n_head = 4;
    o.n_head_kv = 1;
    return o;
}

Test(testmodel, q6_K_and_q4_K_weights_close_to_f32) {
    pd_testmodel_opts o = kquant_shape();
    compare_quantized(PD_TYPE_Q6_K, &o, 0.03, 18);
    compare_quantized(PD_TYPE_Q4_K, &o, 0.11, 14);
    compare_quantized(PD_TYPE_F16, &o, 1e-3, 1);
    compare_quantized(PD_TYPE_BF16, &o, 5e-3, 32);
}

Test(testmodel, fallback_types_for_short_rows) {
    /* tiny rows (64, 128) cannot hold 256-element k-quant blocks */
    pd_testmodel_opts o = preset("tiny");
    o.wtype = PD_TYPE_Q4_K;
    pd_testmodel_info info;
    gen(&o, tpath("t.gguf"), &info);
    cr_expect_eq(info.n_fallback, 1 + 2 * 7 + 1);
    pd_gguf *g = open_ok(tpath("t.gguf"));
    cr_expect_eq(get_u32(g, "general.file_type"), 14);
    expect_tensor(g, "blk.0.attn_q.weight", PD_TYPE_Q4_0, 64, 64);
    expect_tensor(g, "blk.0.ffn_down.weight", PD_TYPE_Q4_0, 128, 64);
    expect_tensor(g, "blk.0.attn_norm.weight", PD_TYPE_F32, 64, 0);
    pd_gguf_close(g);

    /* stories260k: ffn_down rows of 172 hold no whole q8_0 block -> f16 */
    o = preset("stories260k");
    o.wtype = PD_TYPE_Q8_0;
    gen(&o, tpath("s.gguf"), &info);
    cr_expect_eq(info.n_fallback, 5);
    cr_expect_eq(info.n_vocab, 512);
    g = open_ok(tpath("s.gguf"));
    cr_expect_eq(get_u32(g, "llama.block_count"), 5);
    cr_expect_eq(get_u32(g, "llama.rope.dimension_count"), 8);
    expect_tensor(g, "token_embd.weight", PD_TYPE_Q8_0, 64, 512);
    expect_tensor(g, "output.weight", PD_TYPE_Q8_0, 64, 512);
    expect_tensor(g, "blk.4.ffn_gate.weight", PD_TYPE_Q8_0, 64, 172);
    expect_tensor(g, "blk.4.ffn_down.weight", PD_TYPE_F16, 172, 64);
    expect_tensor(g, "blk.4.attn_k.weight", PD_TYPE_Q8_0, 64, 32);
    pd_gguf_close(g);
}

Test(testmodel, validate_rejects_bad_shapes) {
    pd_error err = {0};
    pd_testmodel_opts o = preset("tiny");
    o.n_head = 3;
    cr_expect_eq(pd_testmodel_validate(&o, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "n_head") != NULL, "%s", err.msg);
    o = preset("tiny");
    o.n_head_kv = 3;
    cr_expect_eq(pd_testmodel_validate(&o, &err), PD_EINVAL);
    o = preset("tiny");
    o.n_head = 64; /* head_dim 1: odd */
    o.n_head_kv = 64;
    cr_expect_eq(pd_testmodel_validate(&o, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "even") != NULL, "%s", err.msg);
    o = preset("tiny");
    o.arch = "gpt2";
    cr_expect_eq(pd_testmodel_validate(&o, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "qwen2") != NULL, "%s", err.msg);
    o = preset("tiny");
    o.wtype = PD_TYPE_Q5_K;
    cr_expect_eq(pd_testmodel_validate(&o, &err), PD_EUNSUPPORTED);
    o = preset("tiny");
    o.n_vocab = 100;
    cr_expect_eq(pd_testmodel_validate(&o, &err), PD_EINVAL);
    o = preset("tiny");
    o.n_layer = 0;
    cr_expect_eq(pd_testmodel_write(&o, tpath("x.gguf"), NULL, &err), PD_EINVAL);
    struct stat st;
    cr_expect_neq(stat(tpath("x.gguf"), &st), 0, "nothing written for invalid options");
}

Test(testmodel, vocab_from_copies_tokenizer) {
    char vpath[1024];
    if (!th_shared_file("vocab/ggml-vocab-gpt-2.gguf", vpath, sizeof vpath))
        cr_skip_test("../shared/models/vocab/ggml-vocab-gpt-2.gguf is absent (set PD_SHARED_MODELS); skipping");
    pd_testmodel_opts o = preset("tiny");
    o.vocab_from = vpath;
    o.wtype = PD_TYPE_Q8_0;
    pd_testmodel_info info;
    gen(&o, tpath("gpt2vocab.gguf"), &info);
    pd_gguf *src = open_ok(vpath);
    pd_gguf *g = open_ok(tpath("gpt2vocab.gguf"));
    cr_expect_eq(info.n_vocab, 50257);
    expect_str(g, "general.architecture", "llama");
    expect_str(g, "tokenizer.ggml.model", "gpt2");
    expect_str(g, "tokenizer.ggml.pre", "gpt-2");
    cr_expect_eq(get_u32(g, "llama.vocab_size"), 50257);
    expect_tensor(g, "token_embd.weight", PD_TYPE_Q8_0, 64, 50257);
    expect_tensor(g, "output.weight", PD_TYPE_Q8_0, 64, 50257);
    /* every tokenizer.* key is copied with identical type and content */
    size_t copied = 0;
    for (size_t i = 0; i < pd_gguf_kv_count(src); i++) {
        const pd_gguf_kv *kv = pd_gguf_kv_at(src, i);
        if (strncmp(kv->key, "tokenizer.", 10) != 0) {
            if (strncmp(kv->key, "gpt2.", 5) == 0)
                cr_expect_null(pd_gguf_find(g, kv->key), "%s must not be copied", kv->key);
            continue;
        }
        const pd_gguf_value *v = pd_gguf_find(g, kv->key);
        cr_assert_not_null(v, "%s not copied", kv->key);
        cr_assert_eq(v->type, kv->value.type, "%s type", kv->key);
        copied++;
        if (v->type == PD_GGUF_STRING) {
            cr_expect(v->str.len == kv->value.str.len && memcmp(v->str.ptr, kv->value.str.ptr, v->str.len) == 0,
                      "%s", kv->key);
        } else if (v->type == PD_GGUF_ARRAY) {
            cr_assert_eq(v->arr.elem_type, kv->value.arr.elem_type, "%s", kv->key);
            cr_assert_eq(v->arr.n, kv->value.arr.n, "%s", kv->key);
            if (v->arr.elem_type == PD_GGUF_STRING) {
                for (uint64_t k = 0; k < v->arr.n; k++)
                    cr_assert(v->arr.strs[k].len == kv->value.arr.strs[k].len &&
                                  memcmp(v->arr.strs[k].ptr, kv->value.arr.strs[k].ptr, v->arr.strs[k].len) == 0,
                              "%s[%llu]", kv->key, (unsigned long long)k);
            }
        } else {
            cr_expect_eq(v->u, kv->value.u, "%s", kv->key);
        }
    }
    cr_expect_geq(copied, 5, "tokens, merges, model, pre, ids...");
    const pd_gguf_value *merges;
    pd_error err = {0};
    cr_expect_eq(pd_gguf_get_arr(g, "tokenizer.ggml.merges", PD_GGUF_STRING, &merges, &err), PD_OK, "%s", err.msg);
    pd_gguf_close(g);
    pd_gguf_close(src);
}

Test(testmodel, vocab_from_missing_file_fails) {
    pd_testmodel_opts o = preset("tiny");
    o.vocab_from = tpath("does-not-exist.gguf");
    pd_error err = {0};
    cr_expect_neq(pd_testmodel_write(&o, tpath("m.gguf"), NULL, &err), PD_OK);
    cr_expect(strstr(err.msg, "does-not-exist.gguf") != NULL, "message names the file: %s", err.msg);
    struct stat st;
    cr_expect_neq(stat(tpath("m.gguf"), &st), 0);
}

/* ------------------------------------------------------------------------
 * CLI
 * ------------------------------------------------------------------------ */

static int cli(const char *const *args) {
    char *argv[32];
    int argc = 0;
    argv[argc++] = (char *)"gen-model";
    for (; *args; args++) argv[argc++] = (char *)*args;
    argv[argc] = NULL;
    return pd_testmodel_cli(argc, argv);
}

Test(testmodel, cli_generates_and_overrides) {
    const char *out = tpath("cli.gguf");
    cr_assert_eq(cli((const char *const[]){"--preset", "tiny", "--type", "q8_0", "--seed=7", "--n-layer", "3",
                                           "--arch", "qwen2", "--tied", "-q", "-o", out, NULL}),
                 0);
    pd_gguf *g = open_ok(out);
    expect_str(g, "general.architecture", "qwen2");
    cr_expect_eq(get_u32(g, "qwen2.block_count"), 3);
    cr_expect_eq(get_u32(g, "general.file_type"), 7);
    cr_expect_null(pd_gguf_find_tensor(g, "output.weight"));
    expect_tensor(g, "blk.2.attn_v.bias", PD_TYPE_F32, 32, 0);
    pd_gguf_close(g);

    /* same options through the library give the same bytes */
    pd_testmodel_opts o = preset("tiny");
    o.wtype = PD_TYPE_Q8_0;
    o.seed = 7;
    o.n_layer = 3;
    o.arch = "qwen2";
    o.tied = true;
    gen(&o, tpath("lib.gguf"), NULL);
    size_t la, lb;
    char *a = slurp(out, &la), *b = slurp(tpath("lib.gguf"), &lb);
    cr_expect(la == lb && memcmp(a, b, la) == 0, "CLI and library agree");
    free(a);
    free(b);

    /* options before --preset still override it */
    cr_assert_eq(cli((const char *const[]){"--n-embd", "128", "--preset", "stories260k", "-q", "-o", out, NULL}), 0);
    g = open_ok(out);
    cr_expect_eq(get_u32(g, "llama.embedding_length"), 128);
    cr_expect_eq(get_u32(g, "llama.block_count"), 5);
    pd_gguf_close(g);
}

Test(testmodel, cli_usage_errors) {
    const char *out = tpath("bad.gguf");
    cr_expect_eq(cli((const char *const[]){"--help", NULL}), 0);
    cr_expect_eq(cli((const char *const[]){"--list-presets", NULL}), 0);
    cr_expect_eq(cli((const char *const[]){"--preset", "tiny", NULL}), 2, "missing -o");
    cr_expect_eq(cli((const char *const[]){"--bogus", "-o", out, NULL}), 2);
    cr_expect_eq(cli((const char *const[]){"--preset", "nope", "-o", out, NULL}), 2);
    cr_expect_eq(cli((const char *const[]){"--type", "q9_9", "-o", out, NULL}), 2);
    cr_expect_eq(cli((const char *const[]){"--type", "q5_k", "-o", out, NULL}), 2, "known but not generatable");
    cr_expect_eq(cli((const char *const[]){"--n-embd", "abc", "-o", out, NULL}), 2);
    cr_expect_eq(cli((const char *const[]){"--n-embd", "-5", "-o", out, NULL}), 2);
    cr_expect_eq(cli((const char *const[]){"--n-head", "3", "-o", out, NULL}), 2);
    cr_expect_eq(cli((const char *const[]){"--rms-eps", "0", "-o", out, NULL}), 2);
    cr_expect_eq(cli((const char *const[]){"--seed", NULL}), 2, "option without value");
    cr_expect_eq(cli((const char *const[]){"--n-vocab", "600", "--vocab-from", "x.gguf", "-o", out, NULL}), 2);
    cr_expect_eq(cli((const char *const[]){"--vocab-from", tpath("missing.gguf"), "-q", "-o", out, NULL}), 1);
    cr_expect_eq(cli((const char *const[]){"-q", "-o", "/nonexistent-dir/x.gguf", NULL}), 1);
    struct stat st;
    cr_expect_neq(stat(out, &st), 0, "no file from failed runs");
}

/* ------------------------------------------------------------------------
 * writer
 * ------------------------------------------------------------------------ */

static pd_gguf_writer *new_writer(void) {
    pd_gguf_writer *w = NULL;
    cr_assert_eq(pd_gguf_writer_new(&w, NULL), PD_OK);
    return w;
}

Test(testmodel, writer_round_trips_all_value_types) {
    pd_gguf_writer *w = new_writer();
    pd_error err = {0};
    cr_assert_eq(pd_gguf_writer_set_u32(w, "a.u32", 0xdeadbeefu, &err), PD_OK);
    cr_assert_eq(pd_gguf_writer_set_i32(w, "a.i32", -123456, &err), PD_OK);
    cr_assert_eq(pd_gguf_writer_set_u64(w, "a.u64", 0x123456789abcdef0ull, &err), PD_OK);
    cr_assert_eq(pd_gguf_writer_set_f32(w, "a.f32", 0.15625f, &err), PD_OK);
    cr_assert_eq(pd_gguf_writer_set_bool(w, "a.bool", true, &err), PD_OK);
    cr_assert_eq(pd_gguf_writer_set_str(w, "a.str", "h\xc3\xa9llo", &err), PD_OK);
    const int32_t ints[] = {1, -2, 3};
    cr_assert_eq(pd_gguf_writer_set_arr(w, "a.arr_i32", PD_GGUF_INT32, ints, 3, &err), PD_OK);
    const pd_str strs[] = {{"x", 1}, {"", 0}, {"a\0b", 3}};
    cr_assert_eq(pd_gguf_writer_set_arr_str(w, "a.arr_str", strs, 3, &err), PD_OK);
    cr_assert_eq(pd_gguf_writer_set_arr(w, "a.empty", PD_GGUF_FLOAT32, NULL, 0, &err), PD_OK);
    const float data[64] = {1.0f, 2.0f, 3.0f};
    const uint64_t ne[2] = {32, 2};
    cr_assert_eq(pd_gguf_writer_add_tensor(w, "t.f32", PD_TYPE_F32, 2, ne, data, &err), PD_OK, "%s", err.msg);
    uint8_t q8[68];
    cr_assert_eq(pd_quantize_row(PD_TYPE_Q8_0, data, q8, 64, &err), PD_OK);
    const uint64_t ne1[1] = {64};
    cr_assert_eq(pd_gguf_writer_add_tensor(w, "t.q8", PD_TYPE_Q8_0, 1, ne1, q8, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_gguf_writer_write(w, tpath("w.gguf"), 64, &err), PD_OK, "%s", err.msg);
    pd_gguf_writer_free(w);

    pd_gguf *g = open_ok(tpath("w.gguf"));
    cr_expect_eq(pd_gguf_alignment(g), 64);
    cr_expect_eq(get_u32(g, "general.alignment"), 64, "non-default alignment is recorded");
    cr_expect_eq(pd_gguf_data_offset(g) % 64, 0);
    cr_expect_eq(get_u32(g, "a.u32"), 0xdeadbeefu);
    int64_t i64 = 0;
    cr_expect_eq(pd_gguf_get_i64(g, "a.i32", &i64, &err), PD_OK);
    cr_expect_eq(i64, -123456);
    uint64_t u64 = 0;
    cr_expect_eq(pd_gguf_get_u64(g, "a.u64", &u64, &err), PD_OK);
    cr_expect_eq(u64, 0x123456789abcdef0ull);
    cr_expect_eq(get_f32(g, "a.f32"), 0.15625f);
    cr_expect(get_bool(g, "a.bool"));
    expect_str(g, "a.str", "h\xc3\xa9llo");
    const pd_gguf_value *arr;
    cr_assert_eq(pd_gguf_get_arr(g, "a.arr_i32", PD_GGUF_INT32, &arr, &err), PD_OK);
    cr_assert_eq(arr->arr.n, 3);
    cr_expect_eq(pd_gguf_arr_i32(arr, 1), -2);
    cr_assert_eq(pd_gguf_get_arr(g, "a.arr_str", PD_GGUF_STRING, &arr, &err), PD_OK);
    cr_assert_eq(arr->arr.n, 3);
    cr_expect_eq(arr->arr.strs[1].len, 0);
    cr_expect(arr->arr.strs[2].len == 3 && memcmp(arr->arr.strs[2].ptr, "a\0b", 3) == 0, "NUL bytes survive");
    cr_assert_eq(pd_gguf_get_arr(g, "a.empty", PD_GGUF_FLOAT32, &arr, &err), PD_OK);
    cr_expect_eq(arr->arr.n, 0);
    const pd_gguf_tensor *t = expect_tensor(g, "t.f32", PD_TYPE_F32, 32, 2);
    cr_expect_eq(memcmp(t->data, data, sizeof data), 0);
    t = expect_tensor(g, "t.q8", PD_TYPE_Q8_0, 64, 0);
    cr_expect_eq(t->offset % 64, 0);
    cr_expect_eq(t->n_bytes, 68);
    cr_expect_eq(memcmp(t->data, q8, 68), 0);
    pd_gguf_close(g);
}

/* A hand-made GGUF image with nested arrays, for copy_kv's deep copy. */
static size_t put(uint8_t *p, size_t o, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) p[o + (size_t)i] = (uint8_t)(v >> (8 * i));
    return o + (size_t)bytes;
}

static size_t put_str(uint8_t *p, size_t o, const char *s) {
    o = put(p, o, strlen(s), 8);
    memcpy(p + o, s, strlen(s));
    return o + strlen(s);
}

Test(testmodel, writer_copy_kv_deep_copies_nested_arrays) {
    static uint8_t img[1024];
    size_t o = 0;
    o = put(img, o, PD_GGUF_MAGIC, 4);
    o = put(img, o, 3, 4);
    o = put(img, o, 0, 8); /* tensors */
    o = put(img, o, 3, 8); /* kvs */
    /* nested: [[1, 2], [3]] of i16 */
    o = put_str(img, o, "x.nested");
    o = put(img, o, PD_GGUF_ARRAY, 4);
    o = put(img, o, PD_GGUF_ARRAY, 4);
    o = put(img, o, 2, 8);
    o = put(img, o, PD_GGUF_INT16, 4);
    o = put(img, o, 2, 8);
    o = put(img, o, 1, 2);
    o = put(img, o, 2, 2);
    o = put(img, o, PD_GGUF_INT16, 4);
    o = put(img, o, 1, 8);
    o = put(img, o, (uint16_t)-3, 2);
    /* nested strings: [["a", "bc"]] */
    o = put_str(img, o, "x.nested_str");
    o = put(img, o, PD_GGUF_ARRAY, 4);
    o = put(img, o, PD_GGUF_ARRAY, 4);
    o = put(img, o, 1, 8);
    o = put(img, o, PD_GGUF_STRING, 4);
    o = put(img, o, 2, 8);
    o = put_str(img, o, "a");
    o = put_str(img, o, "bc");
    /* f64 scalar */
    o = put_str(img, o, "x.f64");
    o = put(img, o, PD_GGUF_FLOAT64, 4);
    double dv = -2.5;
    uint64_t dbits;
    memcpy(&dbits, &dv, 8);
    o = put(img, o, dbits, 8);
    while (o % 32) img[o++] = 0;

    pd_gguf *src = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open_memory(img, o, &src, &err), PD_OK, "%s", err.msg);
    pd_gguf_writer *w = new_writer();
    for (size_t i = 0; i < pd_gguf_kv_count(src); i++)
        cr_assert_eq(pd_gguf_writer_copy_kv(w, pd_gguf_kv_at(src, i), &err), PD_OK, "%s", err.msg);
    cr_expect_eq(pd_gguf_writer_copy_kv(w, pd_gguf_kv_at(src, 0), &err), PD_EINVAL, "copying twice duplicates");
    pd_gguf_close(src); /* the writer must not point into the source */
    memset(img, 0xAA, sizeof img);
    cr_assert_eq(pd_gguf_writer_write(w, tpath("n.gguf"), 0, &err), PD_OK, "%s", err.msg);
    pd_gguf_writer_free(w);

    pd_gguf *g = open_ok(tpath("n.gguf"));
    cr_expect_null(pd_gguf_find(g, "general.alignment"), "default alignment is not written");
    const pd_gguf_value *v = pd_gguf_find(g, "x.nested");
    cr_assert_not_null(v);
    cr_assert_eq(v->type, PD_GGUF_ARRAY);
    cr_assert_eq(v->arr.elem_type, PD_GGUF_ARRAY);
    cr_assert_eq(v->arr.n, 2);
    cr_assert_eq(v->arr.items[0].arr.n, 2);
    cr_expect_eq(pd_gguf_arr_int(&v->arr.items[0], 1), 2);
    cr_assert_eq(v->arr.items[1].arr.n, 1);
    cr_expect_eq(pd_gguf_arr_int(&v->arr.items[1], 0), -3);
    v = pd_gguf_find(g, "x.nested_str");
    cr_assert_not_null(v);
    cr_assert_eq(v->arr.n, 1);
    cr_assert_eq(v->arr.items[0].arr.elem_type, PD_GGUF_STRING);
    cr_assert_eq(v->arr.items[0].arr.n, 2);
    cr_expect(str_eq(v->arr.items[0].arr.strs[1], "bc"));
    v = pd_gguf_find(g, "x.f64");
    cr_assert_not_null(v);
    cr_expect_eq(v->type, PD_GGUF_FLOAT64);
    cr_expect_eq(v->f, -2.5);
    pd_gguf_close(g);
}

Test(testmodel, writer_rejects_duplicates_and_bad_shapes) {
    pd_gguf_writer *w = new_writer();
    pd_error err = {0};
    cr_assert_eq(pd_gguf_writer_set_u32(w, "k", 1, &err), PD_OK);
    cr_expect_eq(pd_gguf_writer_set_str(w, "k", "again", &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "duplicate") && strstr(err.msg, "'k'"), "%s", err.msg);
    cr_expect_eq(pd_gguf_writer_set_u32(w, "", 1, &err), PD_EINVAL);
    cr_expect_eq(pd_gguf_writer_set_arr(w, "s", PD_GGUF_STRING, "x", 1, &err), PD_EINVAL);

    static const float data[256];
    const uint64_t ne[2] = {32, 2};
    cr_assert_eq(pd_gguf_writer_add_tensor(w, "t", PD_TYPE_F32, 2, ne, data, &err), PD_OK);
    cr_expect_eq(pd_gguf_writer_add_tensor(w, "t", PD_TYPE_F32, 2, ne, data, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "duplicate tensor") != NULL, "%s", err.msg);
    const uint64_t bad[2] = {33, 2};
    cr_expect_eq(pd_gguf_writer_add_tensor(w, "q", PD_TYPE_Q8_0, 2, bad, data, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "block size") != NULL, "%s", err.msg);
    const uint64_t k[1] = {128};
    cr_expect_eq(pd_gguf_writer_add_tensor(w, "k4", PD_TYPE_Q4_K, 1, k, data, &err), PD_EINVAL, "128 < 256");
    const uint64_t zero[2] = {32, 0};
    cr_expect_eq(pd_gguf_writer_add_tensor(w, "z", PD_TYPE_F32, 2, zero, data, &err), PD_EINVAL);
    cr_expect_eq(pd_gguf_writer_add_tensor(w, "d0", PD_TYPE_F32, 0, ne, data, &err), PD_EINVAL);
    const uint64_t ne5[5] = {1, 1, 1, 1, 1};
    cr_expect_eq(pd_gguf_writer_add_tensor(w, "d5", PD_TYPE_F32, 5, ne5, data, &err), PD_EINVAL);
    cr_expect_eq(pd_gguf_writer_add_tensor(w, "ty", (pd_type)5, 1, ne, data, &err), PD_EINVAL);
    const uint64_t huge[2] = {UINT64_MAX / 2, 4};
    cr_expect_neq(pd_gguf_writer_add_tensor(w, "h", PD_TYPE_F32, 2, huge, data, &err), PD_OK);
    cr_expect_eq(pd_gguf_writer_write(w, tpath("a.gguf"), 48, &err), PD_EINVAL, "alignment not a power of 2");
    cr_assert_eq(pd_gguf_writer_write(w, tpath("a.gguf"), 0, &err), PD_OK, "%s", err.msg);
    pd_gguf_writer_free(w);
    pd_gguf *g = open_ok(tpath("a.gguf"));
    cr_expect_eq(pd_gguf_tensor_count(g), 1, "rejected tensors are not written");
    cr_expect_eq(pd_gguf_kv_count(g), 1);
    pd_gguf_close(g);
}

static int failing_fill(void *ctx, const char *name, void *dst, uint64_t n_bytes, pd_error *err) {
    (void)ctx;
    memset(dst, 0, (size_t)n_bytes);
    return pd_errorf(err, PD_EIO, "synthetic failure for %s", name);
}

static int ones_fill(void *ctx, const char *name, void *dst, uint64_t n_bytes, pd_error *err) {
    (void)name;
    (void)err;
    int *calls = ctx;
    (*calls)++;
    float *f = dst;
    for (uint64_t i = 0; i < n_bytes / 4; i++) f[i] = 1.0f;
    return PD_OK;
}

Test(testmodel, writer_failure_keeps_old_file_and_no_temp) {
    const char *path = tpath("keep.gguf");
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs("old", f);
    fclose(f);

    pd_gguf_writer *w = new_writer();
    pd_error err = {0};
    int calls = 0;
    const uint64_t ne[1] = {64};
    cr_assert_eq(pd_gguf_writer_add_tensor_lazy(w, "ok", PD_TYPE_F32, 1, ne, ones_fill, &calls, &err), PD_OK);
    cr_assert_eq(pd_gguf_writer_add_tensor_lazy(w, "boom", PD_TYPE_F32, 1, ne, failing_fill, NULL, &err), PD_OK);
    cr_expect_eq(pd_gguf_writer_add_tensor_lazy(w, "nofill", PD_TYPE_F32, 1, ne, NULL, NULL, &err), PD_EINVAL);
    cr_expect_eq(pd_gguf_writer_write(w, path, 0, &err), PD_EIO);
    cr_expect(strstr(err.msg, "boom") && strstr(err.msg, "synthetic"), "%s", err.msg);
    pd_gguf_writer_free(w);

    size_t len;
    char *s = slurp(path, &len);
    cr_expect(len == 3 && memcmp(s, "old", 3) == 0, "failed write must not replace the file");
    free(s);
    DIR *d = opendir(tmpdir);
    struct dirent *e;
    while ((e = readdir(d)))
        cr_expect(strstr(e->d_name, ".tmp-") == NULL, "leftover temp file %s", e->d_name);
    closedir(d);

    /* a lazy tensor is filled once, at write time */
    w = new_writer();
    calls = 0;
    cr_assert_eq(pd_gguf_writer_add_tensor_lazy(w, "ok", PD_TYPE_F32, 1, ne, ones_fill, &calls, &err), PD_OK);
    cr_expect_eq(calls, 0);
    cr_assert_eq(pd_gguf_writer_write(w, path, 0, &err), PD_OK, "%s", err.msg);
    cr_expect_eq(calls, 1);
    pd_gguf_writer_free(w);
    pd_gguf *g = open_ok(path);
    const pd_gguf_tensor *t = expect_tensor(g, "ok", PD_TYPE_F32, 64, 0);
    float v;
    memcpy(&v, t->data + 63 * 4, 4);
    cr_expect_eq(v, 1.0f);
    pd_gguf_close(g);

    /* unwritable destination */
    w = new_writer();
    cr_expect_eq(pd_gguf_writer_write(w, "/nonexistent-dir/x.gguf", 0, &err), PD_EIO);
    cr_expect(strstr(err.msg, "/nonexistent-dir") != NULL, "%s", err.msg);
    pd_gguf_writer_free(w);
}

/* ------------------------------------------------------------------------
 * against llama.cpp's own files (skipped without ../shared/models)
 * ------------------------------------------------------------------------ */

/* Copy every key and tensor of a real file through the writer: the result
 * must be the same bytes llama.cpp's writer produced. */
static void rewrite_identical(const char *rel) {
    char src_path[1024];
    if (!th_shared_file(rel, src_path, sizeof src_path))
        cr_skip_test("../shared/models/%s is absent (set PD_SHARED_MODELS); skipping", rel);
    pd_gguf *g = open_ok(src_path);
    pd_gguf_writer *w = new_writer();
    pd_error err = {0};
    for (size_t i = 0; i < pd_gguf_kv_count(g); i++)
        cr_assert_eq(pd_gguf_writer_copy_kv(w, pd_gguf_kv_at(g, i), &err), PD_OK, "%s", err.msg);
    for (size_t i = 0; i < pd_gguf_tensor_count(g); i++) {
        const pd_gguf_tensor *t = pd_gguf_tensor_at(g, i);
        cr_assert_eq(pd_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, t->data, &err), PD_OK, "%s",
                     err.msg);
    }
    const char *out = tpath("rewrite.gguf");
    cr_assert_eq(pd_gguf_writer_write(w, out, (uint32_t)pd_gguf_alignment(g), &err), PD_OK, "%s", err.msg);
    pd_gguf_writer_free(w);
    pd_gguf_close(g);
    size_t la, lb;
    char *a = slurp(src_path, &la), *b = slurp(out, &lb);
    cr_expect_eq(la, lb, "%s: size %zu vs rewritten %zu", rel, la, lb);
    size_t first = 0;
    while (first < la && first < lb && a[first] == b[first]) first++;
    cr_expect(la == lb && first == la, "%s: first difference at byte %zu", rel, first);
    free(a);
    free(b);
}

Test(testmodel, writer_reproduces_llama_cpp_model_file) {
    rewrite_identical("tinystories/stories260K.gguf");
}

Test(testmodel, writer_reproduces_llama_cpp_vocab_file) {
    rewrite_identical("vocab/ggml-vocab-llama-spm.gguf");
}

/* Our stories260k preset has exactly the tensor table of llama.cpp's
 * conversion of the real model (names, dims, shapes). */
Test(testmodel, stories260k_layout_matches_real_model) {
    char real[1024];
    if (!th_shared_file("tinystories/stories260K.gguf", real, sizeof real))
        cr_skip_test("../shared/models/tinystories/stories260K.gguf is absent (set PD_SHARED_MODELS); skipping");
    pd_testmodel_opts o = preset("stories260k");
    gen(&o, tpath("s.gguf"), NULL);
    pd_gguf *gr = open_ok(real), *gm = open_ok(tpath("s.gguf"));
    cr_assert_eq(pd_gguf_tensor_count(gm), pd_gguf_tensor_count(gr));
    for (size_t i = 0; i < pd_gguf_tensor_count(gr); i++) {
        const pd_gguf_tensor *r = pd_gguf_tensor_at(gr, i);
        const pd_gguf_tensor *m = pd_gguf_find_tensor(gm, r->name);
        cr_assert_not_null(m, "%s missing from the generated model", r->name);
        cr_expect_eq(m->type, r->type, "%s", r->name);
        cr_expect_eq(m->n_dims, r->n_dims, "%s", r->name);
        for (uint32_t d = 0; d < PD_GGUF_MAX_DIMS; d++) cr_expect_eq(m->ne[d], r->ne[d], "%s ne[%u]", r->name, d);
    }
    /* every llama.* key of the real file exists in ours with the same type */
    for (size_t i = 0; i < pd_gguf_kv_count(gr); i++) {
        const pd_gguf_kv *kv = pd_gguf_kv_at(gr, i);
        if (strncmp(kv->key, "llama.", 6) != 0) continue;
        const pd_gguf_value *v = pd_gguf_find(gm, kv->key);
        cr_assert_not_null(v, "%s missing", kv->key);
        cr_expect_eq(v->type, kv->value.type, "%s type", kv->key);
        if (strcmp(kv->key, "llama.context_length") != 0) /* the real file says 2048 */
            cr_expect_eq(v->u, kv->value.u, "%s value", kv->key);
    }
    pd_gguf_close(gr);
    pd_gguf_close(gm);
}

/* The built-in vocab is a working SentencePiece vocab: common words are
 * single tokens, anything else falls back to bytes, decoding round-trips. */
Test(testmodel, builtin_vocab_tokenizes) {
    pd_testmodel_opts o = preset("tiny");
    gen(&o, tpath("tok.gguf"), NULL);
    pd_gguf *g = open_ok(tpath("tok.gguf"));
    pd_tokenizer *t = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_tokenizer_load(g, &t, &err), PD_OK, "%s", err.msg);
    pd_gguf_close(g);
    cr_expect_eq(pd_tokenizer_kind(t), PD_VOCAB_SPM);
    cr_expect_eq(pd_tokenizer_bos(t), 1);
    cr_expect_eq(pd_tokenizer_eos(t), 2);
    const char *texts[] = {"Once upon a time, there was a little girl", "h\xc3\xa9llo \xf0\x9f\x98\x80 {x: 42}"};
    for (int k = 0; k < 2; k++) {
        pd_token *ids = NULL;
        size_t n = 0;
        cr_assert_eq(pd_tokenize(t, texts[k], strlen(texts[k]), (pd_tokenize_opts){.add_special = true}, &ids, &n,
                                 &err),
                     PD_OK, "%s", err.msg);
        cr_assert_gt(n, 1);
        cr_expect_eq(ids[0], 1, "BOS first");
        if (k == 0) {
            cr_expect_eq(n, 1 + 10, "one token per word plus ',' and BOS (got %zu)", n);
            cr_expect_str_eq(pd_tokenizer_token_text(t, ids[1]), "\xe2\x96\x81Once");
        }
        char *out = NULL;
        size_t len = 0;
        cr_assert_eq(pd_detokenize(t, ids, n, false, true, &out, &len, &err), PD_OK, "%s", err.msg);
        cr_expect_str_eq(out, texts[k]);
        free(out);
        free(ids);
    }
    pd_tokenizer_free(t);
}
