/* The test-model generator: llama/qwen2 GGUF files with llama.cpp's tensor
 * names, shapes and metadata keys, deterministic pseudo-random weights and
 * either a small built-in SentencePiece vocabulary or the tokenizer of
 * another GGUF file. See tools/tools.h for the contract. */
#include "tools/tools.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
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
    uint32_t n_vocab, n_embd, n_ff, n_layer, n_head, n_head_kv, n_ctx, head_dim, sliding_window;
    float rope_freq_base, rms_eps;
    bool tied, peaked;
} tm_preset;

/* The shapes of real models (the user scales them down with options); the
 * ones added for architectures beyond llama/qwen2 draw peaked weights. */
static const tm_preset presets[] = {
    {"tiny", "llama", 0, 64, 128, 2, 4, 2, 256, 0, 0, 10000.0f, 1e-5f, false, false},
    {"stories260k", "llama", 512, 64, 172, 5, 8, 4, 512, 0, 0, 10000.0f, 1e-5f, false, false},
    {"smollm2-135m", "llama", 49152, 576, 1536, 30, 9, 3, 8192, 0, 0, 100000.0f, 1e-5f, true, false},
    {"llama-3.2-1b", "llama", 128256, 2048, 8192, 16, 32, 8, 131072, 0, 0, 500000.0f, 1e-5f, true, false},
    {"qwen2.5-0.5b", "qwen2", 151936, 896, 4864, 24, 14, 2, 32768, 0, 0, 1000000.0f, 1e-6f, true, false},
    {"mistral-7b", "llama", 32768, 4096, 14336, 32, 32, 8, 32768, 0, 0, 1000000.0f, 1e-5f, false, true},
    {"qwen3-0.6b", "qwen3", 151936, 1024, 3072, 28, 16, 8, 40960, 128, 0, 1000000.0f, 1e-6f, true, true},
    {"gemma-2-2b", "gemma2", 256000, 2304, 9216, 26, 8, 4, 8192, 256, 4096, 10000.0f, 1e-6f, true, true},
    {"gemma-3-1b", "gemma3", 262144, 1152, 6912, 26, 4, 1, 32768, 256, 512, 1000000.0f, 1e-6f, true, true},
    {"phi-3-mini", "phi3", 32064, 3072, 8192, 32, 32, 32, 4096, 0, 2047, 10000.0f, 1e-5f, false, true},
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
        o->head_dim = p->head_dim;
        o->sliding_window = p->sliding_window;
        if (strcmp(p->arch, "gemma2") == 0) {
            o->attn_softcap = 50.0f;
            o->final_softcap = 30.0f;
        }
        o->rope_freq_base = p->rope_freq_base;
        o->rms_eps = p->rms_eps;
        o->tied = p->tied;
        o->peaked = p->peaked;
        o->wtype = PD_TYPE_F32;
        o->seed = 1;
        o->preset = p->name;
        return PD_OK;
    }
    return pd_errorf(err, PD_ENOTFOUND,
                     "unknown model preset '%s' (known: tiny, stories260k, smollm2-135m, llama-3.2-1b, "
                     "qwen2.5-0.5b, mistral-7b, qwen3-0.6b, gemma-2-2b, gemma-3-1b, phi-3-mini)",
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

typedef enum tm_kind {
    TM_MATRIX,
    TM_NORM,
    TM_BIAS,
    TM_VOCAB,       /* token_embd / output: rows of n_embd, one per token */
    TM_OUTPUT_NORM, /* output_norm: a norm whose element 0 may be resized */
} tm_kind;

typedef struct tm_tensor {
    char name[TM_MAX_NAME];
    tm_kind kind;
    pd_type type;
    uint32_t n_dims;
    uint64_t ne[2];
    uint64_t seed;
    double std;         /* TM_MATRIX, TM_BIAS, TM_VOCAB: element standard deviation */
    float dim0;         /* peaked: TM_VOCAB row j's element 0 is dim0 (1 + prior[j] / 2); TM_OUTPUT_NORM's
                           is dim0 and its others std */
    const float *prior; /* peaked TM_VOCAB: [ne[1]] values in [-0.5, 1], else NULL */
    bool hide0;         /* peaked TM_NORM before a sublayer: element 0 is 0, so the bias feature
                           does not swamp the sublayer's input */
    uint64_t qk_rows;   /* peaked: rows [0, qk_rows) are queries/keys, drawn QK_GAIN times larger */
    const pd_testmodel_opts *opts; /* its progress callback */
    double done_after;  /* fraction of all tensor bytes written once this one is */
} tm_tensor;

/* Peaked weights sharpen attention (scores of std ~4 rather than ~0.5) so
 * that which keys a query sees, and so masks and windows, matter: Q and K
 * rows are drawn TM_QK_GAIN times larger (elements ~2 after the 0.7 of a
 * norm), per-head Q/K norm weights are TM_QK_NORM (elements 2 after it). */
#define TM_QK_GAIN 3.0
#define TM_QK_NORM 2.0

/* Row r of tensor t (n elements), continuing the tensor's random stream. */
static void gen_row(const tm_tensor *t, uint64_t r, float *dst, uint64_t n, uint64_t *state) {
    if (t->kind == TM_NORM || t->kind == TM_OUTPUT_NORM) {
        const bool peaked = t->kind == TM_OUTPUT_NORM && t->dim0 > 0.0f;
        for (uint64_t i = 0; i < n; i++) dst[i] = peaked ? (float)t->std : 1.0f;
        if (peaked && n > 0) dst[0] = t->dim0;
        if (t->hide0 && n > 0) dst[0] = 0.0f;
        if (t->qk_rows)
            for (uint64_t i = 0; i < n; i++) dst[i] = (float)TM_QK_NORM;
        return;
    }
    const double std = r < t->qk_rows ? t->std * TM_QK_GAIN : t->std;
    for (uint64_t i = 0; i < n; i++) dst[i] = (float)(approx_normal(state) * std);
    if (t->kind == TM_VOCAB && t->prior && n > 0) dst[0] = t->dim0 * (1.0f + 0.5f * t->prior[r]);
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
        gen_row(t, r, row, ne0, &state);
        rc = pd_quantize_row(t->type, row, out + r * row_bytes, ne0, err);
    }
    free(row);
    if (!rc && t->opts && t->opts->progress) t->opts->progress(t->opts->progress_ctx, "writing tensors", t->done_after);
    return rc;
}

/* ------------------------------------------------------------------------
 * model layout
 * ------------------------------------------------------------------------ */

static bool arch_is(const pd_testmodel_opts *o, const char *a) {
    return strcmp(o->arch, a) == 0;
}

static bool is_gemma(const pd_testmodel_opts *o) {
    return arch_is(o, "gemma2") || arch_is(o, "gemma3");
}

static uint32_t head_dim_of(const pd_testmodel_opts *o) {
    return o->head_dim ? o->head_dim : o->n_embd / o->n_head;
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

/* The peaked weights' sizes (see tools.h), from the model's shape. */
typedef struct tm_peaks {
    double vocab_std; /* elements 1.. of the vocabulary rows */
    float dim0;       /* B: their element 0 is B (1 + prior / 2) */
    float norm0;      /* output_norm.weight[0] */
    float norm_rest;  /* output_norm.weight[1..] */
} tm_peaks;

static tm_peaks peaks_of(const pd_testmodel_opts *o) {
    const double E = o->n_embd, L = o->n_layer;
    /* Embedding elements enter the residual stream at about 1 (gemma
     * multiplies the rows by sqrt(E), so they are stored that much smaller)
     * and every sublayer adds about as much: attention ~1 and SwiGLU ~0.35
     * per layer, gemma's post-normed sublayers 1 each. */
    const double in = is_gemma(o) ? sqrt(E) : 1.0;
    const double r = sqrt(1.0 + (is_gemma(o) ? 2.0 : 1.35) * L);
    /* Element 0 enters at 4 r (to 6 r): positive whatever the layers add
     * to it, yet a small share of the stream's energy, so the sublayers'
     * norms still see the context. After the final norm it is about 4 and
     * the others about 1: output_norm makes the prior 12 + 6 a logits and
     * the context (rows of std 1/in) a spread of about 1. */
    const double b = 4.0 * r;
    return (tm_peaks){1.0 / in, (float)(b / in), (float)(3.0 * in / b), (float)(in / sqrt(E))};
}

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
    const bool matrix = kind == TM_MATRIX || kind == TM_VOCAB;
    t->n_dims = matrix ? 2 : 1;
    t->type = matrix ? matrix_type(o->wtype, ne0) : PD_TYPE_F32;
    t->std = TM_MATRIX_STD;
    if (o->peaked && kind == TM_MATRIX) t->std = 1.0 / sqrt((double)ne0);
    L->n++;
    return PD_OK;
}

/* The part of a tensor name after "blk.N.", or the whole name. */
static const char *layer_suffix(const char *name) {
    if (strncmp(name, "blk.", 4) != 0) return name;
    size_t i = 4;
    while (name[i] >= '0' && name[i] <= '9') i++;
    return name[i] == '.' ? name + i + 1 : name;
}

/* Tensor table in llama.cpp's names and shapes (ne[0] contiguous). prior:
 * the peaked vocabulary prior (NULL when not peaked). */
static int build_layout(const pd_testmodel_opts *o, uint32_t n_vocab, const float *prior, tm_layout *L,
                        pd_error *err) {
    const uint64_t E = o->n_embd, F = o->n_ff, V = n_vocab, hd = head_dim_of(o);
    const uint64_t Eq = hd * o->n_head, Ekv = hd * o->n_head_kv;
    const bool bias = arch_is(o, "qwen2"), phi3 = arch_is(o, "phi3"), gemma = is_gemma(o);
    const bool qk_norm = arch_is(o, "qwen3") || arch_is(o, "gemma3");
    const bool tied = o->tied || arch_is(o, "gemma2");
    const tm_peaks pk = peaks_of(o);
    int rc = layout_add(L, o, TM_VOCAB, E, V, err, "token_embd.weight");
    for (uint32_t i = 0; i < o->n_layer && !rc; i++) {
        rc = rc ? rc : layout_add(L, o, TM_NORM, E, 1, err, "blk.%u.attn_norm.weight", i);
        if (phi3) {
            rc = rc ? rc : layout_add(L, o, TM_MATRIX, E, Eq + 2 * Ekv, err, "blk.%u.attn_qkv.weight", i);
        } else {
            rc = rc ? rc : layout_add(L, o, TM_MATRIX, E, Eq, err, "blk.%u.attn_q.weight", i);
            if (bias) rc = rc ? rc : layout_add(L, o, TM_BIAS, Eq, 1, err, "blk.%u.attn_q.bias", i);
            rc = rc ? rc : layout_add(L, o, TM_MATRIX, E, Ekv, err, "blk.%u.attn_k.weight", i);
            if (bias) rc = rc ? rc : layout_add(L, o, TM_BIAS, Ekv, 1, err, "blk.%u.attn_k.bias", i);
            rc = rc ? rc : layout_add(L, o, TM_MATRIX, E, Ekv, err, "blk.%u.attn_v.weight", i);
            if (bias) rc = rc ? rc : layout_add(L, o, TM_BIAS, Ekv, 1, err, "blk.%u.attn_v.bias", i);
        }
        if (qk_norm) {
            rc = rc ? rc : layout_add(L, o, TM_NORM, hd, 1, err, "blk.%u.attn_q_norm.weight", i);
            rc = rc ? rc : layout_add(L, o, TM_NORM, hd, 1, err, "blk.%u.attn_k_norm.weight", i);
        }
        rc = rc ? rc : layout_add(L, o, TM_MATRIX, Eq, E, err, "blk.%u.attn_output.weight", i);
        if (gemma) rc = rc ? rc : layout_add(L, o, TM_NORM, E, 1, err, "blk.%u.post_attention_norm.weight", i);
        rc = rc ? rc : layout_add(L, o, TM_NORM, E, 1, err, "blk.%u.ffn_norm.weight", i);
        if (phi3) {
            rc = rc ? rc : layout_add(L, o, TM_MATRIX, E, 2 * F, err, "blk.%u.ffn_up.weight", i);
        } else {
            rc = rc ? rc : layout_add(L, o, TM_MATRIX, E, F, err, "blk.%u.ffn_gate.weight", i);
            rc = rc ? rc : layout_add(L, o, TM_MATRIX, E, F, err, "blk.%u.ffn_up.weight", i);
        }
        rc = rc ? rc : layout_add(L, o, TM_MATRIX, F, E, err, "blk.%u.ffn_down.weight", i);
        if (gemma) rc = rc ? rc : layout_add(L, o, TM_NORM, E, 1, err, "blk.%u.post_ffw_norm.weight", i);
    }
    rc = rc ? rc : layout_add(L, o, TM_OUTPUT_NORM, E, 1, err, "output_norm.weight");
    if (!tied) rc = rc ? rc : layout_add(L, o, TM_VOCAB, E, V, err, "output.weight");
    for (size_t i = 0; i < L->n && !rc && o->peaked; i++) {
        tm_tensor *t = &L->t[i];
        if (t->kind == TM_VOCAB) {
            t->std = pk.vocab_std;
            t->dim0 = pk.dim0;
            t->prior = prior;
        } else if (t->kind == TM_OUTPUT_NORM) {
            t->dim0 = pk.norm0;
            t->std = pk.norm_rest;
        } else if (t->kind == TM_NORM || t->kind == TM_MATRIX) {
            const char *base = layer_suffix(t->name);
#define HAS(prefix) (strncmp(base, prefix, sizeof(prefix) - 1) == 0)
            t->hide0 = HAS("attn_norm.") || HAS("ffn_norm.");
            if (HAS("attn_q.") || HAS("attn_k.") || HAS("attn_q_norm.") || HAS("attn_k_norm.")) t->qk_rows = t->ne[1];
            if (HAS("attn_qkv.")) t->qk_rows = Eq + Ekv;
#undef HAS
        }
    }
    return rc;
}

/* English text whose token counts make the peaked prior. */
static const char prior_text[] =
    "Once upon a time, there was a little girl named Lily. She liked to play in the park with her dog and "
    "her big red ball. One day the sun was warm, and Lily saw a cat in a tall tree. \"Come down, little cat!\" "
    "she said. The cat did not want to come down, so Lily sat under the tree and waited. Her mom came to see "
    "what she was doing. They looked up at the cat together, and then the cat jumped into her arms. Lily was "
    "very happy. She took the cat home, gave it some milk, and they were friends from that day on.\n"
    "The model reads the text one token at a time and predicts the next one. When it is right, the loss is "
    "small; when it is wrong, the loss is large. This is how a language model is trained and how it is "
    "measured: the perplexity of a text is the exponent of the mean loss over all of its tokens. It is a "
    "number that tells you how surprised the model is, and a lower number is better. You can compare two "
    "programs that run the same model on the same text, because they should find the same numbers.\n";

/* Open addressing over token strings: slot -> token id, -1 empty. */
typedef struct tm_strset {
    int32_t *slot;
    uint64_t mask;
    const pd_str *toks;
} tm_strset;

static uint64_t str_hash(const char *p, uint64_t len) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (uint64_t i = 0; i < len; i++) {
        h ^= (unsigned char)p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static int32_t strset_find(const tm_strset *set, const char *p, uint64_t len) {
    for (uint64_t i = str_hash(p, len) & set->mask;; i = (i + 1) & set->mask) {
        const int32_t id = set->slot[i];
        if (id < 0) return -1;
        if (set->toks[id].len == len && memcmp(set->toks[id].ptr, p, len) == 0) return id;
    }
}

/* The peaked prior of every token: log(1 + c) / log(1 + c_max) for a token
 * that a greedy longest match of prior_text uses c times (spaces written
 * as SentencePiece's U+2581 or byte-level BPE's U+0120, as the vocabulary
 * does), -0.5 for every other token. vocab: the built-in one, or g's. */
static int build_prior(const tm_vocab *v, const pd_gguf *g, uint32_t n_vocab, float **out, pd_error *err) {
    const pd_str *toks = v ? v->toks : NULL;
    const pd_gguf_value *arr = NULL, *types = NULL;
    bool spm = true;
    if (!v) {
        if (pd_gguf_get_arr(g, "tokenizer.ggml.tokens", PD_GGUF_STRING, &arr, err) != PD_OK)
            return pd_error_prefix(err, "vocab file");
        toks = arr->arr.strs;
        if (pd_gguf_get_arr(g, "tokenizer.ggml.token_type", PD_GGUF_INT32, &types, NULL) != PD_OK ||
            types->arr.n != n_vocab)
            types = NULL;
        pd_str model;
        spm = pd_gguf_get_str(g, "tokenizer.ggml.model", &model, NULL) != PD_OK ||
              (model.len == 5 && memcmp(model.ptr, "llama", 5) == 0);
    }
    uint64_t cap = 16;
    while (cap < 2 * (uint64_t)n_vocab) cap *= 2;
    const size_t text_len = sizeof prior_text - 1;
    tm_strset set = {.slot = malloc(cap * sizeof(int32_t)), .mask = cap - 1, .toks = toks};
    float *prior = malloc((n_vocab ? n_vocab : 1) * sizeof *prior);
    uint32_t *count = calloc(n_vocab ? n_vocab : 1, sizeof *count);
    char *text = malloc(3 * text_len + 4); /* a space becomes up to 3 bytes */
    if (!set.slot || !prior || !count || !text) {
        free(set.slot);
        free(prior);
        free(count);
        free(text);
        return pd_errorf(err, PD_ENOMEM, "out of memory for the vocabulary prior");
    }
    memset(set.slot, 0xff, cap * sizeof(int32_t));
    uint64_t max_len = 0;
    for (uint32_t j = 0; j < n_vocab; j++) {
        const int32_t type = v ? v->types[j] : types ? pd_gguf_arr_i32(types, j) : PD_TOKEN_TYPE_NORMAL;
        if ((type != PD_TOKEN_TYPE_NORMAL && type != PD_TOKEN_TYPE_USER_DEFINED) || toks[j].len == 0) continue;
        if (strset_find(&set, toks[j].ptr, toks[j].len) >= 0) continue; /* the first of duplicates */
        uint64_t i = str_hash(toks[j].ptr, toks[j].len) & set.mask;
        while (set.slot[i] >= 0) i = (i + 1) & set.mask;
        set.slot[i] = (int32_t)j;
        if (toks[j].len > max_len) max_len = toks[j].len;
    }
    size_t n = 0;
    if (spm) n += (size_t)snprintf(text, 4, SPM_SPACE);
    for (size_t i = 0; i < text_len; i++) {
        const char c = prior_text[i];
        if (c == ' ' || (c == '\n' && !spm)) {
            const char *rep = spm ? SPM_SPACE : c == ' ' ? "\xc4\xa0" : "\xc4\x8a"; /* U+0120, U+010A */
            memcpy(text + n, rep, strlen(rep));
            n += strlen(rep);
        } else {
            text[n++] = c;
        }
    }
    uint32_t c_max = 0;
    for (size_t i = 0; i < n;) {
        uint64_t len = max_len < n - i ? max_len : n - i;
        int32_t id = -1;
        for (; len > 0 && (id = strset_find(&set, text + i, len)) < 0; len--) {}
        if (id < 0) {
            i++; /* a byte no token spells */
            continue;
        }
        if (++count[id] > c_max) c_max = count[id];
        i += len;
    }
    for (uint32_t j = 0; j < n_vocab; j++) {
        const int32_t type = v ? v->types[j] : types ? pd_gguf_arr_i32(types, j) : PD_TOKEN_TYPE_NORMAL;
        prior[j] = count[j]                         ? (float)(log1p((double)count[j]) / log1p((double)c_max))
                   : type == PD_TOKEN_TYPE_NORMAL ? 0.0f
                                                  : -0.5f;
    }
    free(set.slot);
    free(count);
    free(text);
    *out = prior;
    return PD_OK;
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
    static const char *const archs[] = {"llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"};
    size_t ai = 0;
    while (o->arch && ai < sizeof archs / sizeof *archs && strcmp(o->arch, archs[ai]) != 0) ai++;
    if (!o->arch || ai == sizeof archs / sizeof *archs)
        return pd_errorf(err, PD_EINVAL,
                         "test model: unsupported architecture '%s' (use llama, qwen2, qwen3, gemma2, gemma3 or "
                         "phi3)",
                         o->arch ? o->arch : "(null)");
    const struct {
        const char *what;
        uint32_t v;
    } dims[] = {{"n_embd", o->n_embd}, {"n_ff", o->n_ff},           {"n_layer", o->n_layer},
                {"n_head", o->n_head}, {"n_head_kv", o->n_head_kv}, {"n_ctx", o->n_ctx}};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i].v == 0) return pd_errorf(err, PD_EINVAL, "test model: %s must be at least 1", dims[i].what);
    if (!o->head_dim && o->n_embd % o->n_head != 0)
        return pd_errorf(err, PD_EINVAL, "test model: n_embd %u is not a multiple of n_head %u (or give head_dim)",
                         o->n_embd, o->n_head);
    if (head_dim_of(o) % 2 != 0 || head_dim_of(o) > 512)
        return pd_errorf(err, PD_EINVAL, "test model: head_dim %u must be even (RoPE) and at most 512",
                         head_dim_of(o));
    if (arch_is(o, "phi3") && head_dim_of(o) * o->n_head != o->n_embd)
        return pd_errorf(err, PD_EINVAL, "test model: phi3 needs head_dim x n_head = n_embd (%u x %u != %u)",
                         head_dim_of(o), o->n_head, o->n_embd);
    if (arch_is(o, "gemma3") && o->sliding_window == 0)
        return pd_errorf(err, PD_EINVAL, "test model: gemma3 needs a sliding window (--sliding-window N)");
    if (arch_is(o, "gemma2") && !o->tied)
        return pd_errorf(err, PD_EINVAL, "test model: gemma2 always ties its output to token_embd (use --tied)");
    if (o->sliding_window > INT32_MAX)
        return pd_errorf(err, PD_ERANGE, "test model: sliding window %u is too large", o->sliding_window);
    if (o->n_head_kv > o->n_head || o->n_head % o->n_head_kv != 0)
        return pd_errorf(err, PD_EINVAL, "test model: n_head %u is not a multiple of n_head_kv %u", o->n_head,
                         o->n_head_kv);
    if (o->n_layer > 4096) return pd_errorf(err, PD_ERANGE, "test model: n_layer %u is too large", o->n_layer);
    if (!(o->rope_freq_base > 0.0f))
        return pd_errorf(err, PD_EINVAL, "test model: rope_freq_base must be positive");
    if (!(o->rms_eps > 0.0f) || !(o->rms_eps < 1.0f))
        return pd_errorf(err, PD_EINVAL, "test model: rms_eps must be in (0, 1)");
    if (!(o->attn_softcap >= 0.0f) || !(o->final_softcap >= 0.0f) || !(o->rope_scale >= 0.0f))
        return pd_errorf(err, PD_EINVAL, "test model: soft-caps and the rope scale must not be negative");
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
    else if (arch_is(o, "phi3") && !o->vocab_from)
        /* llama.cpp gives Phi-3 token attributes to "<|endoftext|>" when the
         * name says phi-3 or phi3; the built-in vocabulary has no such token. */
        snprintf(name, sizeof name, "prefixd-test-phi");
    else
        snprintf(name, sizeof name, "prefixd-test-%s", o->preset ? o->preset : o->arch);
    const char *a = o->arch;
    const uint32_t hd = head_dim_of(o);
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
    /* As the converters write them: explicit head sizes for qwen3 and gemma,
     * and wherever they are not n_embd / n_head. */
    if (o->head_dim || arch_is(o, "qwen3") || is_gemma(o)) {
        rc = rc ? rc : pd_gguf_writer_set_u32(w, ARCH_KEY("attention.key_length"), hd, err);
        rc = rc ? rc : pd_gguf_writer_set_u32(w, ARCH_KEY("attention.value_length"), hd, err);
    }
    rc = rc ? rc : pd_gguf_writer_set_f32(w, ARCH_KEY("rope.freq_base"), o->rope_freq_base, err);
    rc = rc ? rc : pd_gguf_writer_set_u32(w, ARCH_KEY("rope.dimension_count"), hd, err);
    if (o->rope_scale > 0.0f) {
        rc = rc ? rc : pd_gguf_writer_set_str(w, ARCH_KEY("rope.scaling.type"), "linear", err);
        rc = rc ? rc : pd_gguf_writer_set_f32(w, ARCH_KEY("rope.scaling.factor"), o->rope_scale, err);
    }
    rc = rc ? rc : pd_gguf_writer_set_f32(w, ARCH_KEY("attention.layer_norm_rms_epsilon"), o->rms_eps, err);
    if (o->sliding_window && (is_gemma(o) || arch_is(o, "phi3")))
        rc = rc ? rc : pd_gguf_writer_set_u32(w, ARCH_KEY("attention.sliding_window"), o->sliding_window, err);
    if (o->attn_softcap > 0.0f && arch_is(o, "gemma2"))
        rc = rc ? rc : pd_gguf_writer_set_f32(w, ARCH_KEY("attn_logit_softcapping"), o->attn_softcap, err);
    if (o->final_softcap > 0.0f && arch_is(o, "gemma2"))
        rc = rc ? rc : pd_gguf_writer_set_f32(w, ARCH_KEY("final_logit_softcapping"), o->final_softcap, err);
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
    float *prior = NULL;
    rc = pd_gguf_writer_new(&w, err);
    if (rc) return rc;

    /* The vocabulary decides n_vocab, which the metadata and shapes need;
     * tokenizer keys follow the model keys, as in llama.cpp's files. */
    pd_gguf *vg = NULL;
    if (o->progress) o->progress(o->progress_ctx, "building vocabulary", 0);
    if (o->vocab_from)
        rc = open_vocab_file(o->vocab_from, &vg, &n_vocab, err);
    else if (!(rc = builtin_vocab_sized(&v, o->n_vocab, err)))
        n_vocab = v.n;
    if (!rc) rc = write_metadata(w, o, n_vocab, err);
    if (!rc) rc = vg ? copy_tokenizer(w, vg, err) : write_builtin_tokenizer(w, &v, err);
    if (!rc && o->peaked) rc = build_prior(vg ? NULL : &v, vg, n_vocab, &prior, err);
    if (vg) pd_gguf_close(vg);
    vocab_free(&v);

    if (!rc) rc = build_layout(o, n_vocab, prior, &L, err);
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
        if (t->n_dims == 2 && t->type != o->wtype) inf.n_fallback++;
        t->opts = o;
        t->done_after = (double)inf.data_bytes; /* divided by the total below */
    }
    for (size_t i = 0; i < L.n && !rc; i++)
        L.t[i].done_after = inf.data_bytes ? L.t[i].done_after / (double)inf.data_bytes : 1;
    if (!rc && o->progress) o->progress(o->progress_ctx, "writing tensors", 0);
    if (!rc) rc = pd_gguf_writer_write(w, path, 0, err);
    if (!rc && info) *info = inf;
    pd_gguf_writer_free(w);
    free(L.t);
    free(prior);
    return rc;
}

int pd_testmodel_tensor_values(const pd_testmodel_opts *o, const char *name, float *dst, uint64_t n,
                               pd_error *err) {
    int rc = pd_testmodel_validate(o, err);
    if (rc) return rc;
    if (!name || (!dst && n)) return pd_errorf(err, PD_EINVAL, "test model: NULL argument");
    /* The vocabulary only matters for the two vocab matrices (their shape,
     * and with peaked weights their prior): it is built only for them. */
    const bool vocab_matrix = strcmp(name, "token_embd.weight") == 0 || strcmp(name, "output.weight") == 0;
    uint32_t n_vocab = o->n_vocab ? o->n_vocab : pd_testmodel_builtin_vocab_size();
    float *prior = NULL;
    if (o->peaked && vocab_matrix) {
        tm_vocab v = {0};
        pd_gguf *vg = NULL;
        if (o->vocab_from)
            rc = open_vocab_file(o->vocab_from, &vg, &n_vocab, err);
        else if (!(rc = builtin_vocab_sized(&v, o->n_vocab, err)))
            n_vocab = v.n;
        if (!rc) rc = build_prior(vg ? NULL : &v, vg, n_vocab, &prior, err);
        if (vg) pd_gguf_close(vg);
        vocab_free(&v);
    }
    tm_layout L = {0};
    if (!rc) rc = build_layout(o, n_vocab, prior, &L, err);
    const tm_tensor *t = NULL;
    for (size_t i = 0; i < L.n && !rc; i++)
        if (strcmp(L.t[i].name, name) == 0) t = &L.t[i];
    if (!rc && !t) rc = pd_errorf(err, PD_ENOTFOUND, "test model: no tensor named '%s'", name);
    if (!rc) {
        const uint64_t want = t->ne[0] * (t->n_dims > 1 ? t->ne[1] : 1);
        if (vocab_matrix ? n % t->ne[0] != 0 || (prior && n > want) : n != want) {
            rc = pd_errorf(err, PD_EINVAL, "test model: tensor '%s' has %" PRIu64 " elements, not %" PRIu64,
                           name, want, n);
        } else {
            uint64_t state = tensor_rng_init(t->seed, t->name);
            for (uint64_t r = 0; r * t->ne[0] < n; r++) gen_row(t, r, dst + r * t->ne[0], t->ne[0], &state);
        }
    }
    free(L.t);
    free(prior);
    return rc;
}

/* ------------------------------------------------------------------------
 * CLI
 * ------------------------------------------------------------------------ */

static void cli_usage(FILE *f, const char *prog) {
    fprintf(f,
            "usage: %s [--preset NAME] [options] -o OUT.gguf\n"
            "\n"
            "Write a GGUF test model with seeded random weights, in llama.cpp's layout.\n"
            "\n"
            "  --preset NAME        tiny (default), stories260k, smollm2-135m, llama-3.2-1b, qwen2.5-0.5b;\n"
            "                       with peaked weights: mistral-7b, qwen3-0.6b, gemma-2-2b, gemma-3-1b,\n"
            "                       phi-3-mini (real shapes: scale them down with the options below)\n"
            "  --arch ARCH          llama, qwen2, qwen3, gemma2, gemma3 or phi3\n"
            "  --type TYPE          matrix type: f32 (default), f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1,\n"
            "                       iq4_nl, q4_k, q6_k\n"
            "  --seed N             PRNG seed (default 1); same options give a byte-identical file\n"
            "  --vocab-from FILE    copy the tokenizer.* keys (and vocab size) from another GGUF\n"
            "  --name NAME          general.name\n"
            "  --n-vocab N          vocab size (built-in vocab is padded or truncated to N)\n"
            "  --n-embd N  --n-ff N  --n-layer N  --n-head N  --n-head-kv N  --n-ctx N\n"
            "  --head-dim N         attention head size (default n_embd / n_head)\n"
            "  --sliding-window N   gemma2/gemma3/phi3 attention.sliding_window (0: not written)\n"
            "  --attn-softcap F  --final-softcap F   gemma2 soft-capping (0: not written)\n"
            "  --rope-scale F       linear rope scaling factor (0: none)\n"
            "  --rope-freq-base F   --rms-eps F\n"
            "  --tied | --untied    share token_embd as the output matrix, or write output.weight\n"
            "  --peaked | --flat    peaked weights (a non-flat next-token distribution) or all N(0, 0.02^2)\n"
            "  -o, --output FILE    where to write the model (required)\n"
            "  -q, --quiet          no summary on stdout, no progress on stderr\n"
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
               "head_dim=%u sliding_window=%u rope_freq_base=%g rms_eps=%g tied=%s peaked=%s\n",
               p->name, p->arch, p->n_vocab ? p->n_vocab : pd_testmodel_builtin_vocab_size(), p->n_embd,
               p->n_ff, p->n_layer, p->n_head, p->n_head_kv, p->n_ctx,
               p->head_dim ? p->head_dim : p->n_embd / p->n_head, p->sliding_window, (double)p->rope_freq_base,
               (double)p->rms_eps, p->tied ? "yes" : "no", p->peaked ? "yes" : "no");
    }
}

static void report_progress(void *ctx, const char *phase, double fraction) {
    pd_progress_update(ctx, phase, fraction);
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
        } else if (strcmp(arg, "--attn-softcap") == 0 || strcmp(arg, "--final-softcap") == 0 ||
                   strcmp(arg, "--rope-scale") == 0) {
            NEED_VALUE();
            float *dst = arg[2] == 'a' ? &o.attn_softcap : arg[2] == 'f' ? &o.final_softcap : &o.rope_scale;
            if (strcmp(val, "0") == 0)
                *dst = 0.0f;
            else if (parse_pos_float(prog, arg, val, dst))
                return 2;
        } else if (strcmp(arg, "--tied") == 0) {
            o.tied = true;
        } else if (strcmp(arg, "--untied") == 0) {
            o.tied = false;
        } else if (strcmp(arg, "--peaked") == 0) {
            o.peaked = true;
        } else if (strcmp(arg, "--flat") == 0) {
            o.peaked = false;
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
                {"--head-dim", offsetof(pd_testmodel_opts, head_dim)},
                {"--sliding-window", offsetof(pd_testmodel_opts, sliding_window)},
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
    /* llama.cpp b4748 picks gemma2's query scale by model size and stops on
     * a size it does not know. */
    if (strcmp(o.arch, "gemma2") == 0 && o.n_layer != 26 && o.n_layer != 42 && o.n_layer != 46)
        fprintf(stderr,
                "%s: note: llama.cpp (b4748) runs gemma2 files only with 26, 42 or 46 layers; prefixd runs "
                "any\n",
                prog);
    pd_testmodel_info info;
    pd_progress prog_line;
    pd_progress_init(&prog_line);
    if (!quiet) {
        o.progress = report_progress;
        o.progress_ctx = &prog_line;
    }
    const int wrc = pd_testmodel_write(&o, out, &info, &err);
    pd_progress_end(&prog_line);
    if (wrc != PD_OK) {
        fprintf(stderr, "%s: %s\n", prog, err.msg);
        return 1;
    }
    if (!quiet) {
        printf("wrote %s: %s, %u layers, n_embd %u, n_ff %u, heads %u/%u of %u, vocab %u, type %s%s", out, o.arch,
               o.n_layer, o.n_embd, o.n_ff, o.n_head, o.n_head_kv, head_dim_of(&o), info.n_vocab,
               pd_type_get(o.wtype)->name, o.peaked ? ", peaked" : "");
        if (info.n_fallback)
            printf(" (%" PRIu64 " matrices in a fallback type: rows not a multiple of the block size)",
                   info.n_fallback);
        printf(", %" PRIu64 " tensors, %" PRIu64 " parameters, %.1f MiB of weights\n", info.n_tensors,
               info.n_params, (double)info.data_bytes / (1024.0 * 1024.0));
    }
    return 0;
}
