/* The test-model generator: llama/qwen2 GGUF files with llama.cpp's tensor
 * names, shapes and metadata keys, deterministic pseudo-random weights and
 * either a small built-in SentencePiece vocabulary or the tokenizer of
 * another GGUF file. See tools/tools.h for the contract. */
#include "tools/tools.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "engine/engine.h"

#define TM_MATRIX_STD 0.02
#define TM_MAX_NAME 96

/* ------------------------------------------------------------------------
 * presets
 * ------------------------------------------------------------------------ */

typedef struct tm_preset {
    const char *name;
    const char *arch;
    uint32_t n_vocab, n_embd, n_ff, n_layer, n_head, n_head_kv, n_ctx;
    float rope_freq_base, rms_eps;
    bool tied;
} tm_preset;

static const tm_preset presets[] = {
    {"tiny", "llama", 0, 64, 128, 2, 4, 2, 256, 10000.0f, 1e-5f, false},
    {"stories260k", "llama", 512, 64, 172, 5, 8, 4, 512, 10000.0f, 1e-5f, false},
    {"smollm2-135m", "llama", 49152, 576, 1536, 30, 9, 3, 8192, 100000.0f, 1e-5f, true},
    {"llama-3.2-1b", "llama", 128256, 2048, 8192, 16, 32, 8, 131072, 500000.0f, 1e-5f, true},
    {"qwen2.5-0.5b", "qwen2", 151936, 896, 4864, 24, 14, 2, 32768, 1000000.0f, 1e-6f, true},
};
#define N_PRESETS (sizeof presets / sizeof presets[0])

size_t pd_testmodel_preset_count(void) {
    return N_PRESETS;
}

const char *pd_testmodel_preset_name(size_t i) {
    return i < N_PRESETS ? presets[i].name : NULL;
}

int pd_testmodel_preset(const char *name, pd_testmodel_opts *o, pd_error *err) {
    if (!name || !o) return pd_errorf(err, PD_EINVAL, "pd_testmodel_preset: NULL argument");
    for (size_t i = 0; i < N_PRESETS; i++) {
        const tm_preset *p = &presets[i];
        if (strcasecmp(p->name, name) != 0) continue;
        memset(o, 0, sizeof *o);
        o->arch = p->arch;
        o->n_vocab = p->n_vocab;
        o->n_embd = p->n_embd;
        o->n_ff = p->n_ff;
        o->n_layer = p->n_layer;
        o->n_head = p->n_head;
        o->n_head_kv = p->n_head_kv;
        o->n_ctx = p->n_ctx;
        o->rope_freq_base = p->rope_freq_base;
        o->rms_eps = p->rms_eps;
        o->tied = p->tied;
        o->wtype = PD_TYPE_F32;
        o->seed = 1;
        o->preset = p->name;
        return PD_OK;
    }
    return pd_errorf(err, PD_ENOTFOUND,
                     "unknown model preset '%s' (known: tiny, stories260k, smollm2-135m, "
                     "llama-3.2-1b, qwen2.5-0.5b)",
                     name);
}

/* ------------------------------------------------------------------------
 * built-in vocabulary
 * ------------------------------------------------------------------------ */

#define SPM_SPACE "\xe2\x96\x81" /* U+2581 LOWER ONE EIGHTH BLOCK, SentencePiece's space */

/* Multi-character pieces; every prefix of each is added too (in order), so
 * SentencePiece's pairwise merging can reach each piece from characters. */
static const char *const builtin_pieces[] = {
    "th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ed", "es", "ing", "ly", "ll", "ou",
};
static const char *const builtin_words[] = {
    "the",   "a",    "and",  "to",     "was",  "he",    "she",   "it",   "of",    "in",
    "is",    "that", "you",  "they",   "with", "for",   "on",    "said", "his",   "her",
    "day",   "one",  "time", "upon",   "once", "there", "little", "big", "happy", "play",
    "girl",  "boy",  "saw",  "went",   "had",  "not",   "but",   "so",   "we",    "I",
    "my",    "be",   "at",   "are",    "this", "have",  "all",   "can",  "like",  "mom",
    "dog",   "cat",  "ball", "tree",   "sun",  "see",   "do",    "very", "good",  "Once",
    "The",   "Lily",
};

typedef struct tm_vocab {
    pd_str *toks; /* ptr owned (malloc'd, NUL-terminated) */
    float *scores;
    int32_t *types;
    uint32_t n, cap;
} tm_vocab;

static void vocab_free(tm_vocab *v) {
    for (uint32_t i = 0; i < v->n; i++) free((char *)v->toks[i].ptr);
    free(v->toks);
    free(v->scores);
    free(v->types);
    memset(v, 0, sizeof *v);
}

static bool vocab_has(const tm_vocab *v, const char *s, size_t len) {
    for (uint32_t i = 0; i < v->n; i++)
        if (v->toks[i].len == len && memcmp(v->toks[i].ptr, s, len) == 0) return true;
    return false;
}

static int vocab_add(tm_vocab *v, const char *s, size_t len, float score, int32_t type, pd_error *err) {
    if (v->n == v->cap) {
        uint32_t cap = v->cap ? v->cap * 2 : 1024;
        pd_str *t = realloc(v->toks, cap * sizeof *t);
        if (t) v->toks = t;
        float *sc = realloc(v->scores, cap * sizeof *sc);
        if (sc) v->scores = sc;
        int32_t *ty = realloc(v->types, cap * sizeof *ty);
        if (ty) v->types = ty;
        if (!t || !sc || !ty) return pd_errorf(err, PD_ENOMEM, "out of memory building the vocabulary");
        v->cap = cap;
    }
    char *c = malloc(len + 1);
    if (!c) return pd_errorf(err, PD_ENOMEM, "out of memory building the vocabulary");
    memcpy(c, s, len);
    c[len] = '\0';
    v->toks[v->n] = (pd_str){.ptr = c, .len = len};
    v->scores[v->n] = score;
    v->types[v->n] = type;
    v->n++;
    return PD_OK;
}

/* Normal tokens get descending scores 0, -1, -2, ... in insertion order. */
static int vocab_add_normal(tm_vocab *v, const char *s, size_t len, uint32_t *rank, pd_error *err) {
    if (vocab_has(v, s, len)) return PD_OK;
    int rc = vocab_add(v, s, len, -(float)*rank, PD_TOKEN_TYPE_NORMAL, err);
    if (!rc) (*rank)++;
    return rc;
}

/* Add every prefix of s of at least two UTF-8 characters. */
static int vocab_add_prefixes(tm_vocab *v, const char *s, uint32_t *rank, pd_error *err) {
    const size_t len = strlen(s);
    int chars = 0;
    for (size_t i = 1; i <= len; i++) {
        if (i < len && ((unsigned char)s[i] & 0xc0u) == 0x80u) continue; /* inside a character */
        if (++chars < 2) continue;
        int rc = vocab_add_normal(v, s, i, rank, err);
        if (rc) return rc;
    }
    return PD_OK;
}

static int build_builtin_vocab(tm_vocab *v, pd_error *err) {
    int rc = 0;
    rc = rc ? rc : vocab_add(v, "<unk>", 5, 0.0f, PD_TOKEN_TYPE_UNKNOWN, err);
    rc = rc ? rc : vocab_add(v, "<s>", 3, 0.0f, PD_TOKEN_TYPE_CONTROL, err);
    rc = rc ? rc : vocab_add(v, "</s>", 4, 0.0f, PD_TOKEN_TYPE_CONTROL, err);
    for (int b = 0; b < 256 && !rc; b++) {
        char buf[8];
        snprintf(buf, sizeof buf, "<0x%02X>", (unsigned)b);
        rc = vocab_add(v, buf, 6, 0.0f, PD_TOKEN_TYPE_BYTE, err);
    }
    uint32_t rank = 0;
    rc = rc ? rc : vocab_add_normal(v, SPM_SPACE, 3, &rank, err);
    for (int c = 0x21; c < 0x7f && !rc; c++) {
        const char ch = (char)c;
        rc = vocab_add_normal(v, &ch, 1, &rank, err);
    }
    for (size_t i = 0; i < sizeof builtin_pieces / sizeof builtin_pieces[0] && !rc; i++)
        rc = vocab_add_prefixes(v, builtin_pieces[i], &rank, err);
    for (size_t i = 0; i < sizeof builtin_words / sizeof builtin_words[0] && !rc; i++) {
        char buf[64];
        snprintf(buf, sizeof buf, SPM_SPACE "%s", builtin_words[i]);
        rc = vocab_add_prefixes(v, buf, &rank, err);
    }
    if (rc) vocab_free(v);
    return rc;
}

uint32_t pd_testmodel_builtin_vocab_size(void) {
    tm_vocab v = {0};
    if (build_builtin_vocab(&v, NULL) != PD_OK) return 0;
    const uint32_t n = v.n;
    vocab_free(&v);
    return n;
}

#define MIN_BUILTIN_VOCAB 259u /* <unk> <s> </s> + 256 byte tokens */

/* Built-in vocab resized to n (0 = natural size): truncated (keeping
 * specials and byte tokens) or padded with unused "[PAD<id>]" tokens, the
 * way llama.cpp's converter pads SentencePiece vocabularies. */
static int builtin_vocab_sized(tm_vocab *v, uint32_t n, pd_error *err) {
    int rc = build_builtin_vocab(v, err);
    if (rc) return rc;
    if (n == 0) return PD_OK;
    while (v->n > n) {
        v->n--;
        free((char *)v->toks[v->n].ptr);
    }
    while (v->n < n) {
        char buf[32];
        const int len = snprintf(buf, sizeof buf, "[PAD%" PRIu32 "]", v->n);
        rc = vocab_add(v, buf, (size_t)len, -1000.0f, PD_TOKEN_TYPE_UNUSED, err);
        if (rc) {
            vocab_free(v);
            return rc;
        }
    }
    return PD_OK;
}

static int write_builtin_tokenizer(pd_gguf_writer *w, const tm_vocab *v, pd_error *err) {
    int rc = 0;
    rc = rc ? rc : pd_gguf_writer_set_str(w, "tokenizer.ggml.model", "llama", err);
    rc = rc ? rc : pd_gguf_writer_set_str(w, "tokenizer.ggml.pre", "default", err);
    rc = rc ? rc : pd_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", v->toks, v->n, err);
    rc = rc ? rc : pd_gguf_writer_set_arr(w, "tokenizer.ggml.scores", PD_GGUF_FLOAT32, v->scores, v->n, err);
    rc = rc ? rc : pd_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", PD_GGUF_INT32, v->types, v->n, err);
    rc = rc ? rc : pd_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 1, err);
    rc = rc ? rc : pd_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 2, err);
    rc = rc ? rc : pd_gguf_writer_set_u32(w, "tokenizer.ggml.unknown_token_id", 0, err);
    rc = rc ? rc : pd_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", true, err);
    rc = rc ? rc : pd_gguf_writer_set_bool(w, "tokenizer.ggml.add_eos_token", false, err);
    return rc;
}

/* Open another GGUF for its tokenizer; *n_vocab = its token count. */
static int open_vocab_file(const char *path, pd_gguf **out, uint32_t *n_vocab, pd_error *err) {
    pd_gguf *g = NULL;
    int rc = pd_gguf_open(path, &g, err);
    if (rc) {
        pd_error_prefix(err, "vocab file %s", path);
        return rc;
    }
    const pd_gguf_value *toks = NULL;
    rc = pd_gguf_get_arr(g, "tokenizer.ggml.tokens", PD_GGUF_STRING, &toks, err);
    if (rc) {
        pd_error_prefix(err, "vocab file %s has no usable tokenizer.ggml.tokens", path);
        pd_gguf_close(g);
        return rc;
    }
    if (toks->arr.n == 0 || toks->arr.n > INT32_MAX) {
        pd_gguf_close(g);
        return pd_errorf(err, PD_EFORMAT, "vocab file %s: tokenizer.ggml.tokens has %" PRIu64 " entries",
                         path, toks->arr.n);
    }
    *n_vocab = (uint32_t)toks->arr.n;
    *out = g;
    return PD_OK;
}

/* Copy every tokenizer.* key (tokens, scores, merges, ids, chat template...). */
static int copy_tokenizer(pd_gguf_writer *w, const pd_gguf *g, pd_error *err) {
    const size_t n = pd_gguf_kv_count(g);
    for (size_t i = 0; i < n; i++) {
        const pd_gguf_kv *kv = pd_gguf_kv_at(g, i);
        if (strncmp(kv->key, "tokenizer.", 10) != 0) continue;
        int rc = pd_gguf_writer_copy_kv(w, kv, err);
        if (rc) return rc;
    }
    return PD_OK;
}

/* ------------------------------------------------------------------------
 * deterministic weights
 * ------------------------------------------------------------------------ */

static uint64_t name_hash(const char *name) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (const unsigned char *p = (const unsigned char *)name; *p; p++) {
        h ^= *p;
        h *= 0x100000001b3ull;
    }
    return h;
}

static uint64_t tensor_rng_init(uint64_t seed, const char *name) {
    uint64_t s = seed ^ 0x5bd1e9955bd1e995ull;
    uint64_t a = pd_splitmix64(&s);
    uint64_t t = a ^ name_hash(name);
    (void)pd_splitmix64(&t);
    return t;
}

/* Approximately standard normal: the sum of 12 uniforms on (0,1) minus 6,
 * from three 64-bit draws split into 16-bit parts. Every step is exact
 * integer or exactly-rounded IEEE arithmetic, so results never depend on
 * the C library's transcendental functions. */
static inline double approx_normal(uint64_t *s) {
    uint32_t sum = 0;
    for (int k = 0; k < 3; k++) {
        const uint64_t r = pd_splitmix64(s);
        sum += (uint32_t)(r & 0xffffu) + (uint32_t)((r >> 16) & 0xffffu) + (uint32_t)((r >> 32) & 0xffffu) +
               (uint32_t)(r >> 48);
    }
    return ((double)sum + 6.0) / 65536.0 - 6.0;
}

typedef enum tm_kind { TM_MATRIX, TM_NORM, TM_BIAS } tm_kind;

typedef struct tm_tensor {
    char name[TM_MAX_NAME];
    tm_kind kind;
    pd_type type;
    uint32_t n_dims;
    uint64_t ne[2];
    uint64_t seed;
} tm_tensor;

static void gen_values(const tm_tensor *t, float *dst, uint64_t n, uint64_t *state) {
    if (t->kind == TM_NORM) {
        for (uint64_t i = 0; i < n; i++) dst[i] = 1.0f;
        return;
    }
    for (uint64_t i = 0; i < n; i++) dst[i] = (float)(approx_normal(state) * TM_MATRIX_STD);
}

/* pd_gguf_fill_fn: generate row by row and encode into dst. */
static int fill_tensor(void *ctx, const char *name, void *dst, uint64_t n_bytes, pd_error *err) {
    const tm_tensor *t = ctx;
    const uint64_t ne0 = t->ne[0];
    const uint64_t rows = t->n_dims > 1 ? t->ne[1] : 1;
    uint64_t row_bytes;
    int rc = pd_type_row_size(t->type, ne0, &row_bytes, err);
    if (rc) return rc;
    if (row_bytes * rows != n_bytes)
        return pd_errorf(err, PD_EINVAL, "tensor '%s': expected %" PRIu64 " bytes, writer asked for %" PRIu64,
                         name, row_bytes * rows, n_bytes);
    float *row = malloc(ne0 * sizeof *row);
    if (!row) return pd_errorf(err, PD_ENOMEM, "out of memory generating tensor '%s'", name);
    uint64_t state = tensor_rng_init(t->seed, t->name);
    uint8_t *out = dst;
    for (uint64_t r = 0; r < rows && !rc; r++) {
        gen_values(t, row, ne0, &state);
        rc = pd_quantize_row(t->type, row, out + r * row_bytes, ne0, err);
    }
    free(row);
    return rc;
}

/* ------------------------------------------------------------------------
 * model layout
 * ------------------------------------------------------------------------ */

static bool is_qwen2(const pd_testmodel_opts *o) {
    return strcmp(o->arch, "qwen2") == 0;
}

static bool type_ok_for(pd_type t, uint64_t ne0) {
    const pd_type_traits *tr = pd_type_get((uint32_t)t);
    return tr && ne0 % tr->block_size == 0;
}

/* Storage type of a matrix with rows of ne0 elements. */
static pd_type matrix_type(pd_type want, uint64_t ne0) {
    pd_type t = want;
    for (int step = 0; step < 3 && !type_ok_for(t, ne0); step++) {
        switch (t) {
        case PD_TYPE_Q4_K: t = PD_TYPE_Q4_0; break;
        case PD_TYPE_Q6_K: t = PD_TYPE_Q8_0; break;
        default: t = PD_TYPE_F16; break;
        }
    }
    return type_ok_for(t, ne0) ? t : PD_TYPE_F32;
}

typedef struct tm_layout {
    tm_tensor *t;
    size_t n, cap;
} tm_layout;

static int layout_add(tm_layout *L, const pd_testmodel_opts *o, tm_kind kind, uint64_t ne0, uint64_t ne1,
                      pd_error *err, const char *fmt, ...) __attribute__((format(printf, 7, 8)));

static int layout_add(tm_layout *L, const pd_testmodel_opts *o, tm_kind kind, uint64_t ne0, uint64_t ne1,
                      pd_error *err, const char *fmt, ...) {
    if (L->n == L->cap) {
        size_t cap = L->cap ? L->cap * 2 : 64;
        tm_tensor *t = realloc(L->t, cap * sizeof *t);
        if (!t) return pd_errorf(err, PD_ENOMEM, "out of memory laying out the model");
        L->t = t;
        L->cap = cap;
    }
    tm_tensor *t = &L->t[L->n];
    memset(t, 0, sizeof *t);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->name, sizeof t->name, fmt, ap);
    va_end(ap);
    t->kind = kind;
    t->seed = o->seed;
    t->ne[0] = ne0;
    t->ne[1] = ne1;
    t->n_dims = kind == TM_MATRIX ? 2 : 1;
    t->type = kind == TM_MATRIX ? matrix_type(o->wtype, ne0) : PD_TYPE_F32;
    L->n++;
    return PD_OK;
}

/* Tensor table in llama.cpp's names and shapes (ne[0] contiguous). */
static int build_layout(const pd_testmodel_opts *o, uint32_t n_vocab, tm_layout *L, pd_error *err) {
    const uint64_t E = o->n_embd, F = o->n_ff, V = n_vocab;
    const uint64_t hd = E / o->n_head;
    const uint64_t Ekv = hd * o->n_head_kv;
    const bool bias = is_qwen2(o);
    int rc = layout_add(L, o, TM_MATRIX, E, V, err, "token_embd.weight");
    for (uint32_t i = 0; i < o->n_layer && !rc; i++) {
        rc = rc ? rc : layout_add(L, o, TM_NORM, E, 1, err, "blk.%u.attn_norm.weight", i);
        rc = rc ? rc : layout_add(L, o, TM_MATRIX, E, E, err, "blk.%u.attn_q.weight", i);
        if (bias) rc = rc ? rc : layout_add(L, o, TM_BIAS, E, 1, err, "blk.%u.attn_q.bias", i);
        rc = rc ? rc : layout_add(L, o, TM_MATRIX, E, Ekv, err, "blk.%u.attn_k.weight", i);
        if (bias) rc = rc ? rc : layout_add(L, o, TM_BIAS, Ekv, 1, err, "blk.%u.attn_k.bias", i);
        rc = rc ? rc : layout_add(L, o, TM_MATRIX, E, Ekv, err, "blk.%u.attn_v.weight", i);
        if (bias) rc = rc ? rc : layout_add(L, o, TM_BIAS, Ekv, 1, err, "blk.%u.attn_v.bias", i);
        rc = rc ? rc : layout_add(L, o, TM_MATRIX, E, E, err, "blk.%u.attn_output.weight", i);
        rc = rc ? rc : layout_add(L, o, TM_NORM, E, 1, err, "blk.%u.ffn_norm.weight", i);
        rc = rc ? rc : layout_add(L, o, TM_MATRIX, E, F, err, "blk.%u.ffn_gate.weight", i);
        rc = rc ? rc : layout_add(L, o, TM_MATRIX, E, F, err, "blk.%u.ffn_up.weight", i);
        rc = rc ? rc : layout_add(L, o, TM_MATRIX, F, E, err, "blk.%u.ffn_down.weight", i);
    }
    rc = rc ? rc : layout_add(L, o, TM_NORM, E, 1, err, "output_norm.weight");
    if (!o->tied) rc = rc ? rc : layout_add(L, o, TM_MATRIX, E, V, err, "output.weight");
    return rc;
}

/* llama_ftype of a file whose matrices are mostly `t`. */
static uint32_t file_type_of(pd_type t) {
    switch (t) {
    case PD_TYPE_F32: return 0;   /* LLAMA_FTYPE_ALL_F32 */
    case PD_TYPE_F16: return 1;   /* MOSTLY_F16 */
    case PD_TYPE_Q4_0: return 2;  /* MOSTLY_Q4_0 */
    case PD_TYPE_Q4_1: return 3;  /* MOSTLY_Q4_1 */
    case PD_TYPE_Q5_0: return 8;  /* MOSTLY_Q5_0 */
    case PD_TYPE_Q5_1: return 9;  /* MOSTLY_Q5_1 */
    case PD_TYPE_IQ4_NL: return 25; /* MOSTLY_IQ4_NL */
    case PD_TYPE_Q8_0: return 7;  /* MOSTLY_Q8_0 */
    case PD_TYPE_Q4_K: return 14; /* MOSTLY_Q4_K_S */
    case PD_TYPE_Q6_K: return 18; /* MOSTLY_Q6_K */
    case PD_TYPE_BF16: return 32; /* MOSTLY_BF16 */
    default: return 0;
    }
}

int pd_testmodel_validate(const pd_testmodel_opts *o, pd_error *err) {
    if (!o) return pd_errorf(err, PD_EINVAL, "test model: NULL options");
    if (!o->arch || (strcmp(o->arch, "llama") != 0 && strcmp(o->arch, "qwen2") != 0))
        return pd_errorf(err, PD_EINVAL, "test model: unsupported architecture '%s' (use llama or qwen2)",
                         o->arch ? o->arch : "(null)");
    const struct {
        const char *what;
        uint32_t v;
    } dims[] = {{"n_embd", o->n_embd}, {"n_ff", o->n_ff},           {"n_layer", o->n_layer},
                {"n_head", o->n_head}, {"n_head_kv", o->n_head_kv}, {"n_ctx", o->n_ctx}};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i].v == 0) return pd_errorf(err, PD_EINVAL, "test model: %s must be at least 1", dims[i].what);
    if (o->n_embd % o->n_head != 0)
        return pd_errorf(err, PD_EINVAL, "test model: n_embd %u is not a multiple of n_head %u", o->n_embd,
                         o->n_head);
    if ((o->n_embd / o->n_head) % 2 != 0)
        return pd_errorf(err, PD_EINVAL, "test model: head_dim %u (n_embd/n_head) must be even for RoPE",
                         o->n_embd / o->n_head);
    if (o->n_head_kv > o->n_head || o->n_head % o->n_head_kv != 0)
        return pd_errorf(err, PD_EINVAL, "test model: n_head %u is not a multiple of n_head_kv %u", o->n_head,
                         o->n_head_kv);
    if (o->n_layer > 4096) return pd_errorf(err, PD_ERANGE, "test model: n_layer %u is too large", o->n_layer);
    if (!(o->rope_freq_base > 0.0f))
        return pd_errorf(err, PD_EINVAL, "test model: rope_freq_base must be positive");
    if (!(o->rms_eps > 0.0f) || !(o->rms_eps < 1.0f))
        return pd_errorf(err, PD_EINVAL, "test model: rms_eps must be in (0, 1)");
    /* the types with a fallback for short rows and a file type above */
    const pd_type_traits *tr = pd_type_get((uint32_t)o->wtype);
    if (!tr || !tr->can_quantize || (o->wtype != PD_TYPE_F32 && file_type_of(o->wtype) == 0))
        return pd_errorf(err, PD_EUNSUPPORTED,
                         "test model: weight type %s cannot be generated (use f32, f16, bf16, q8_0, q4_0, "
                         "q4_1, q5_0, q5_1, iq4_nl, q4_k or q6_k)",
                         tr ? tr->name : "(unknown)");
    if (!o->vocab_from && o->n_vocab != 0 && o->n_vocab < MIN_BUILTIN_VOCAB)
        return pd_errorf(err, PD_EINVAL,
                         "test model: n_vocab %u is too small for the built-in vocab (needs at least %u: "
                         "3 special + 256 byte tokens)",
                         o->n_vocab, MIN_BUILTIN_VOCAB);
    if (o->n_vocab > INT32_MAX) return pd_errorf(err, PD_ERANGE, "test model: n_vocab %u is too large", o->n_vocab);
    return PD_OK;
}

static int write_metadata(pd_gguf_writer *w, const pd_testmodel_opts *o, uint32_t n_vocab, pd_error *err) {
    char name[128], key[128];
    if (o->name)
        snprintf(name, sizeof name, "%s", o->name);
    else
        snprintf(name, sizeof name, "prefixd-test-%s", o->preset ? o->preset : o->arch);
    const char *a = o->arch;
    int rc = 0;
#define ARCH_KEY(suffix) (snprintf(key, sizeof key, "%s." suffix, a), key)
    rc = rc ? rc : pd_gguf_writer_set_str(w, "general.architecture", a, err);
    rc = rc ? rc : pd_gguf_writer_set_str(w, "general.name", name, err);
    rc = rc ? rc : pd_gguf_writer_set_u32(w, "general.file_type", file_type_of(o->wtype), err);
    rc = rc ? rc : pd_gguf_writer_set_u32(w, "general.quantization_version", 2, err);
    rc = rc ? rc : pd_gguf_writer_set_u32(w, ARCH_KEY("vocab_size"), n_vocab, err);
    rc = rc ? rc : pd_gguf_writer_set_u32(w, ARCH_KEY("context_length"), o->n_ctx, err);
    rc = rc ? rc : pd_gguf_writer_set_u32(w, ARCH_KEY("embedding_length"), o->n_embd, err);
    rc = rc ? rc : pd_gguf_writer_set_u32(w, ARCH_KEY("feed_forward_length"), o->n_ff, err);
    rc = rc ? rc : pd_gguf_writer_set_u32(w, ARCH_KEY("block_count"), o->n_layer, err);
    rc = rc ? rc : pd_gguf_writer_set_u32(w, ARCH_KEY("attention.head_count"), o->n_head, err);
    rc = rc ? rc : pd_gguf_writer_set_u32(w, ARCH_KEY("attention.head_count_kv"), o->n_head_kv, err);
    rc = rc ? rc : pd_gguf_writer_set_f32(w, ARCH_KEY("rope.freq_base"), o->rope_freq_base, err);
    rc = rc ? rc : pd_gguf_writer_set_u32(w, ARCH_KEY("rope.dimension_count"), o->n_embd / o->n_head, err);
    rc = rc ? rc : pd_gguf_writer_set_f32(w, ARCH_KEY("attention.layer_norm_rms_epsilon"), o->rms_eps, err);
#undef ARCH_KEY
    return rc;
}

int pd_testmodel_write(const pd_testmodel_opts *o, const char *path, pd_testmodel_info *info,
                       pd_error *err) {
    int rc = pd_testmodel_validate(o, err);
    if (rc) return rc;
    if (!path || !*path) return pd_errorf(err, PD_EINVAL, "test model: empty output path");

    pd_gguf_writer *w = NULL;
    tm_layout L = {0};
    tm_vocab v = {0};
    uint32_t n_vocab = 0;
    rc = pd_gguf_writer_new(&w, err);
    if (rc) return rc;

    /* The vocabulary decides n_vocab, which the metadata and shapes need;
     * tokenizer keys follow the model keys, as in llama.cpp's files. */
    pd_gguf *vg = NULL;
    if (o->vocab_from)
        rc = open_vocab_file(o->vocab_from, &vg, &n_vocab, err);
    else if (!(rc = builtin_vocab_sized(&v, o->n_vocab, err)))
        n_vocab = v.n;
    if (!rc) rc = write_metadata(w, o, n_vocab, err);
    if (!rc) rc = vg ? copy_tokenizer(w, vg, err) : write_builtin_tokenizer(w, &v, err);
    if (vg) pd_gguf_close(vg);
    vocab_free(&v);

    if (!rc) rc = build_layout(o, n_vocab, &L, err);
    pd_testmodel_info inf = {.n_vocab = n_vocab};
    for (size_t i = 0; i < L.n && !rc; i++) {
        tm_tensor *t = &L.t[i];
        rc = pd_gguf_writer_add_tensor_lazy(w, t->name, t->type, t->n_dims, t->ne, fill_tensor, t, err);
        const uint64_t n_el = t->ne[0] * (t->n_dims > 1 ? t->ne[1] : 1);
        uint64_t bytes = 0;
        if (!rc) rc = pd_type_row_size(t->type, n_el, &bytes, err);
        inf.n_tensors++;
        inf.n_params += n_el;
        inf.data_bytes += bytes;
        if (t->kind == TM_MATRIX && t->type != o->wtype) inf.n_fallback++;
    }
    if (!rc) rc = pd_gguf_writer_write(w, path, 0, err);
    if (!rc && info) *info = inf;
    pd_gguf_writer_free(w);
    free(L.t);
    return rc;
}

int pd_testmodel_tensor_values(const pd_testmodel_opts *o, const char *name, float *dst, uint64_t n,
                               pd_error *err) {
    int rc = pd_testmodel_validate(o, err);
    if (rc) return rc;
    if (!name || (!dst && n)) return pd_errorf(err, PD_EINVAL, "test model: NULL argument");
    /* The vocab size only matters for the shape check of the two vocab
     * matrices; other tensors do not depend on it. */
    uint32_t n_vocab = o->n_vocab ? o->n_vocab : pd_testmodel_builtin_vocab_size();
    tm_layout L = {0};
    rc = build_layout(o, n_vocab, &L, err);
    const tm_tensor *t = NULL;
    for (size_t i = 0; i < L.n && !rc; i++)
        if (strcmp(L.t[i].name, name) == 0) t = &L.t[i];
    if (!rc && !t) rc = pd_errorf(err, PD_ENOTFOUND, "test model: no tensor named '%s'", name);
    if (!rc) {
        const uint64_t want = t->ne[0] * (t->n_dims > 1 ? t->ne[1] : 1);
        const bool vocab_matrix = strcmp(name, "token_embd.weight") == 0 || strcmp(name, "output.weight") == 0;
        if (vocab_matrix ? n % t->ne[0] != 0 : n != want) {
            rc = pd_errorf(err, PD_EINVAL, "test model: tensor '%s' has %" PRIu64 " elements, not %" PRIu64,
                           name, want, n);
        } else {
            uint64_t state = tensor_rng_init(t->seed, t->name);
            gen_values(t, dst, n, &state);
        }
    }
    free(L.t);
    return rc;
}

/* ------------------------------------------------------------------------
 * CLI
 * ------------------------------------------------------------------------ */

static void cli_usage(FILE *f, const char *prog) {
    fprintf(f,
            "usage: %s [--preset NAME] [options] -o OUT.gguf\n"
            "\n"
            "Write a llama/qwen2 GGUF test model with seeded random weights.\n"
            "\n"
            "  --preset NAME        tiny (default), stories260k, smollm2-135m, llama-3.2-1b, qwen2.5-0.5b\n"
            "  --arch ARCH          llama or qwen2\n"
            "  --type TYPE          matrix type: f32 (default), f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1,\n"
            "                       iq4_nl, q4_k, q6_k\n"
            "  --seed N             PRNG seed (default 1); same options give a byte-identical file\n"
            "  --vocab-from FILE    copy the tokenizer.* keys (and vocab size) from another GGUF\n"
            "  --name NAME          general.name\n"
            "  --n-vocab N          vocab size (built-in vocab is padded or truncated to N)\n"
            "  --n-embd N  --n-ff N  --n-layer N  --n-head N  --n-head-kv N  --n-ctx N\n"
            "  --rope-freq-base F   --rms-eps F\n"
            "  --tied | --untied    share token_embd as the output matrix, or write output.weight\n"
            "  -o, --output FILE    where to write the model (required)\n"
            "  -q, --quiet          no summary on stdout\n"
            "  --list-presets       print the presets and exit\n"
            "  -h, --help           this help\n",
            prog);
}

static int parse_u64(const char *prog, const char *opt, const char *s, uint64_t max, uint64_t *out) {
    char *end = NULL;
    if (!s || !*s || *s == '-' || *s == '+') goto bad;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || *end || v > max) goto bad;
    *out = v;
    return 0;
bad:
    fprintf(stderr, "%s: %s: '%s' is not an integer in 0..%" PRIu64 "\n", prog, opt, s ? s : "", max);
    return -1;
}

static int parse_pos_float(const char *prog, const char *opt, const char *s, float *out) {
    char *end = NULL;
    errno = 0;
    float v = s ? strtof(s, &end) : 0.0f;
    if (!s || !*s || errno || *end || !(v > 0.0f) || v > 3.0e38f) {
        fprintf(stderr, "%s: %s: '%s' is not a positive number\n", prog, opt, s ? s : "");
        return -1;
    }
    *out = v;
    return 0;
}

static void cli_list_presets(void) {
    for (size_t i = 0; i < N_PRESETS; i++) {
        const tm_preset *p = &presets[i];
        printf("%-14s arch=%s n_vocab=%u n_embd=%u n_ff=%u n_layer=%u n_head=%u n_head_kv=%u n_ctx=%u "
               "rope_freq_base=%g rms_eps=%g tied=%s\n",
               p->name, p->arch, p->n_vocab ? p->n_vocab : pd_testmodel_builtin_vocab_size(), p->n_embd,
               p->n_ff, p->n_layer, p->n_head, p->n_head_kv, p->n_ctx, (double)p->rope_freq_base,
               (double)p->rms_eps, p->tied ? "yes" : "no");
    }
}

int pd_testmodel_cli(int argc, char **argv) {
    const char *prog = argc > 0 && argv[0] ? argv[0] : "gen-model";
    pd_error err = {0};
    pd_testmodel_opts o;
    const char *out = NULL;
    bool quiet = false, explicit_vocab = false;

    /* Pass 1: the preset (so later options override it wherever they are). */
    const char *preset = "tiny";
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            cli_usage(stdout, prog);
            return 0;
        }
        if (strcmp(argv[i], "--list-presets") == 0) {
            cli_list_presets();
            return 0;
        }
        if (strcmp(argv[i], "--preset") == 0 && i + 1 < argc) preset = argv[++i];
        else if (strncmp(argv[i], "--preset=", 9) == 0) preset = argv[i] + 9;
    }
    if (pd_testmodel_preset(preset, &o, &err) != PD_OK) {
        fprintf(stderr, "%s: %s\n", prog, err.msg);
        return 2;
    }

    /* Pass 2: everything else. "--opt value" and "--opt=value" both work. */
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        char optbuf[64];
        const char *val = NULL;
        const char *eq = strncmp(arg, "--", 2) == 0 ? strchr(arg, '=') : NULL;
        if (eq) {
            size_t len = (size_t)(eq - arg);
            if (len >= sizeof optbuf) len = sizeof optbuf - 1;
            memcpy(optbuf, arg, len);
            optbuf[len] = '\0';
            val = eq + 1;
            arg = optbuf;
        }
#define NEED_VALUE()                                                                       \
    do {                                                                                   \
        if (!val) {                                                                        \
            if (i + 1 >= argc) {                                                           \
                fprintf(stderr, "%s: option %s needs a value (see --help)\n", prog, arg);  \
                return 2;                                                                  \
            }                                                                              \
            val = argv[++i];                                                               \
        }                                                                                  \
    } while (0)
        uint64_t u = 0;
        if (strcmp(arg, "--preset") == 0) {
            NEED_VALUE();
        } else if (strcmp(arg, "--arch") == 0) {
            NEED_VALUE();
            o.arch = val;
        } else if (strcmp(arg, "--type") == 0) {
            NEED_VALUE();
            pd_type t;
            if (pd_type_from_name(val, &t, &err) != PD_OK) {
                fprintf(stderr, "%s: --type: %s\n", prog, err.msg);
                return 2;
            }
            o.wtype = t;
        } else if (strcmp(arg, "--seed") == 0) {
            NEED_VALUE();
            if (parse_u64(prog, arg, val, UINT64_MAX, &u)) return 2;
            o.seed = u;
        } else if (strcmp(arg, "--vocab-from") == 0) {
            NEED_VALUE();
            o.vocab_from = val;
        } else if (strcmp(arg, "--name") == 0) {
            NEED_VALUE();
            o.name = val;
        } else if (strcmp(arg, "-o") == 0 || strcmp(arg, "--output") == 0) {
            NEED_VALUE();
            out = val;
        } else if (strcmp(arg, "--rope-freq-base") == 0) {
            NEED_VALUE();
            if (parse_pos_float(prog, arg, val, &o.rope_freq_base)) return 2;
        } else if (strcmp(arg, "--rms-eps") == 0) {
            NEED_VALUE();
            if (parse_pos_float(prog, arg, val, &o.rms_eps)) return 2;
        } else if (strcmp(arg, "--tied") == 0) {
            o.tied = true;
        } else if (strcmp(arg, "--untied") == 0) {
            o.tied = false;
        } else if (strcmp(arg, "-q") == 0 || strcmp(arg, "--quiet") == 0) {
            quiet = true;
        } else {
            static const struct {
                const char *opt;
                size_t off;
            } dims[] = {
                {"--n-vocab", offsetof(pd_testmodel_opts, n_vocab)},
                {"--n-embd", offsetof(pd_testmodel_opts, n_embd)},
                {"--n-ff", offsetof(pd_testmodel_opts, n_ff)},
                {"--n-layer", offsetof(pd_testmodel_opts, n_layer)},
                {"--n-head", offsetof(pd_testmodel_opts, n_head)},
                {"--n-head-kv", offsetof(pd_testmodel_opts, n_head_kv)},
                {"--n-ctx", offsetof(pd_testmodel_opts, n_ctx)},
            };
            size_t k = 0;
            while (k < sizeof dims / sizeof dims[0] && strcmp(arg, dims[k].opt) != 0) k++;
            if (k == sizeof dims / sizeof dims[0]) {
                fprintf(stderr, "%s: unknown option '%s' (see --help)\n", prog, argv[i]);
                return 2;
            }
            NEED_VALUE();
            if (parse_u64(prog, arg, val, INT32_MAX, &u)) return 2;
            const uint32_t u32 = (uint32_t)u;
            memcpy((char *)&o + dims[k].off, &u32, sizeof u32);
            if (k == 0) explicit_vocab = true;
        }
#undef NEED_VALUE
    }
    if (explicit_vocab && o.vocab_from) {
        fprintf(stderr, "%s: --n-vocab conflicts with --vocab-from (the vocab file decides the size)\n", prog);
        return 2;
    }
    if (!out) {
        fprintf(stderr, "%s: no output file; pass -o OUT.gguf (see --help)\n", prog);
        return 2;
    }
    if (pd_testmodel_validate(&o, &err) != PD_OK) {
        fprintf(stderr, "%s: %s\n", prog, err.msg);
        return 2;
    }
    pd_testmodel_info info;
    if (pd_testmodel_write(&o, out, &info, &err) != PD_OK) {
        fprintf(stderr, "%s: %s\n", prog, err.msg);
        return 1;
    }
    if (!quiet) {
        printf("wrote %s: %s, %u layers, n_embd %u, n_ff %u, heads %u/%u, vocab %u, type %s", out, o.arch,
               o.n_layer, o.n_embd, o.n_ff, o.n_head, o.n_head_kv, info.n_vocab, pd_type_get(o.wtype)->name);
        if (info.n_fallback)
            printf(" (%" PRIu64 " matrices in a fallback type: rows not a multiple of the block size)",
                   info.n_fallback);
        printf(", %" PRIu64 " tensors, %" PRIu64 " parameters, %.1f MiB of weights\n", info.n_tensors,
               info.n_params, (double)info.data_bytes / (1024.0 * 1024.0));
    }
    return 0;
}
