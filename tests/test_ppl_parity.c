/* Perplexity parity with llama.cpp, over (architecture x weight mix).
 *
 * For each architecture row, `prefixctl gen-model` writes a scaled-down F16
 * model; the test then "sharpens" it (below) and llama.cpp's own
 * llama-quantize turns it into the mixes people download. Each cell asserts
 * |ppl_prefixd / ppl_llama - 1| <= 0.5% on tests/data/ppl-stories.txt, where
 * ppl_llama is llama-perplexity's "Final estimate" and ppl_prefixd is
 * `prefixctl perplexity` with the same context and chunks.
 *
 * The models must not be flat: with gen-model's plain weights (matrices
 * N(0, 0.02^2), every norm weight 1.0) logits and attention scores are
 * nearly uniform, perplexity is about the vocabulary size and a wrong rope
 * base moves it by 0.001%, so such a model cannot tell a right
 * implementation from a wrong one. The test "sharpens" the flat model:
 * every norm weight becomes a seeded random gain (a different one per
 * element, so a norm that ignored its weight shows too), which makes
 * attention scores and logits vary by several units. The `discriminates`
 * tests prove the 0.5% check has teeth: one changed hyper-parameter moves
 * perplexity far more than that. (gen-model's `--peaked` weights, where it
 * has them, were measured too and are asked off with `--flat`: they put
 * llama.cpp's 8-bit activation rounding at up to 0.75% of perplexity on
 * correct kernels, and a wrong rope base or epsilon moved them less.)
 *
 * A cell whose model prefixd refuses (a weight type or architecture) or
 * that gen-model cannot write fails: every cell of the matrix is one this
 * build supports. Rows the peer cannot run are skipped with its reason. The sharpened F16 models
 * are cached under $PD_PPL_CACHE (the build folder), keyed by their
 * generation options; the mixes are made afresh in a temporary folder.
 * Under AddressSanitizer the matrix is F16 and Q4_K_M only and the
 * discrimination tests are skipped (they check the test, not the code).
 * Without ../shared/peer (llama.cpp's binaries), or on a CPU they cannot run
 * on (they are built for AVX-512), everything is skipped: the first cell to
 * see the peer die notes it in the cache folder, and the rest skip at once. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/engine.h"
#include "helpers.h"

#if defined(__SANITIZE_ADDRESS__)
#define PPL_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PPL_SANITIZED 1
#endif
#endif
#ifndef PPL_SANITIZED
#define PPL_SANITIZED 0
#endif

#define PPL_TOLERANCE 0.005 /* |ppl_prefixd / ppl_llama - 1| */
#define PPL_FAR (4 * PPL_TOLERANCE) /* what a wrong variant must at least move it by */
#define PPL_CTX 128
#define PPL_CHUNKS 10 /* 630 scored tokens: implementation noise well under the tolerance */
#define SHARPEN_VERSION 1 /* bump when sharpen() changes: cached models are keyed by it (and the gains) */

/* One architecture: gen-model options (--type and -o are added). "$VOCAB/"
 * stands for ../shared/models/vocab/. Shapes keep rows a multiple of 256 so
 * the K-quant mixes really use K-quants (llama-quantize falls back to
 * q5_0/iq4_nl for other rows), except llama-fallback, which is there for
 * those fallbacks. */
typedef struct arch_row {
    const char *name;
    const char *gen;
    float attn_gain; /* attention input norms' gain when sharpened; 0 = GAIN_ATTN */
} arch_row;

static const arch_row ARCHS[] = {
    /* Tied embeddings, GQA, rope base 1e5; the built-in vocab padded to 8192
     * (the preset's 49152 would only make the output matrix slower). */
    {"llama-smollm2", "--preset smollm2-135m --n-vocab 8192 --n-embd 256 --n-ff 768 --n-layer 2 --n-head 4 "
                      "--n-head-kv 2 --n-ctx 2048", 0},
    /* Untied output, GQA 4:1, rope base 1e6, Llama 2's 32000 SentencePiece vocab. */
    {"llama-mistral", "--preset tiny --vocab-from $VOCAB/ggml-vocab-llama-spm.gguf --untied --n-embd 256 --n-ff 768 "
                      "--n-layer 2 --n-head 8 --n-head-kv 2 --rope-freq-base 1000000 --n-ctx 4096", 0},
    /* Rows of 320 and 640: llama-quantize gives the K-quant mixes their
     * fallbacks instead (q5_0 for q4_K, q5_1 for q5_K, iq4_nl for q3_K and
     * iq4_xs, q8_0 for q6_K). */
    {"llama-fallback", "--preset tiny --n-vocab 2048 --n-embd 320 --n-ff 640 --n-layer 2 --n-head 5 --n-head-kv 1 "
                       "--n-ctx 4096", 0},
    /* QKV bias, NeoX rope, tied. */
    {"qwen2", "--preset qwen2.5-0.5b --n-vocab 4096 --n-embd 256 --n-ff 512 --n-layer 2 --n-head 4 --n-head-kv 2 "
              "--n-ctx 4096", 0},
    /* The other architectures from gen-model's presets of real models,
     * scaled down: per-head q/k norms and head size 128 (qwen3); soft-caps,
     * post-norms and a 64-token window on every other layer (gemma2), or on
     * five layers of six (gemma3), so windows matter at a 128-token
     * context; fused QKV and gate/up, Phi-3's vocab (phi3). llama.cpp b4748
     * runs gemma2 only with the layer counts of the released sizes (it picks
     * the attention scale by size and aborts otherwise): 26, like 2B. It
     * does not know qwen3 or gemma3 at all (added in later releases): those
     * rows are skipped until the peer is newer. */
    {"qwen3", "--preset qwen3-0.6b --n-vocab 4096 --n-embd 256 --n-ff 512 --n-layer 2 --n-head 4 --n-head-kv 2 "
              "--n-ctx 4096", 0},
    {"gemma2", "--preset gemma-2-2b --n-vocab 4096 --n-embd 256 --n-ff 256 --n-layer 26 --n-head 4 --n-head-kv 2 "
               "--head-dim 64 --sliding-window 64 --n-ctx 4096", 3.0f},
    {"gemma3", "--preset gemma-3-1b --n-vocab 4096 --n-embd 256 --n-ff 512 --n-layer 6 --n-head 4 --n-head-kv 1 "
               "--sliding-window 64 --n-ctx 4096", 0},
    {"phi3", "--preset phi-3-mini --vocab-from $VOCAB/ggml-vocab-phi-3.gguf --n-embd 256 --n-ff 512 --n-layer 2 "
             "--n-head 4 --n-head-kv 4 --n-ctx 4096", 0},
};
#define N_ARCHS (sizeof ARCHS / sizeof *ARCHS)

/* llama.cpp mixes (llama-quantize names); none needs an importance matrix. */
static const char *const MIXES[] = {"F16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q3_K_M", "IQ4_XS"};
static const char *const SANITIZED_MIXES[] = {"F16", "Q4_K_M"};
#define N_MIXES (sizeof MIXES / sizeof *MIXES)

/* ---- paths and processes ------------------------------------------------- */

static const char *peer_dir(void) {
    static char buf[4096];
    const char *env = getenv("PD_PEER");
    if (env && *env) snprintf(buf, sizeof buf, "%s", env);
    else if (th_shared_models()) snprintf(buf, sizeof buf, "%s/../peer", th_shared_models());
    else return NULL;
    char exe[4200];
    snprintf(exe, sizeof exe, "%s/llama-perplexity", buf);
    return access(exe, X_OK) == 0 ? buf : NULL;
}

static const char *cache_dir(void);

#define PEER_SIGILL_MSG                                                                                        \
    "stopped with 'Illegal instruction': ../shared/peer is built for AVX-512, which this CPU lacks; perplexity " \
    "parity not checked here"

/* This CPU's feature flags (the /proc/cpuinfo line), "" where unknown. */
static void cpu_flags(char *buf, size_t cap) {
    buf[0] = '\0';
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[8192];
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "flags", 5) == 0) {
            snprintf(buf, cap, "%s", line);
            break;
        }
    fclose(f);
}

/* Each cell is its own process: the first that sees the peer die of SIGILL
 * leaves a note (keyed by this CPU's flags) so the others skip at once
 * instead of generating and quantizing models for nothing. */
static void peer_sigill_note(void) {
    char path[4200], flags[8192];
    snprintf(path, sizeof path, "%s/peer-sigill", cache_dir());
    cpu_flags(flags, sizeof flags);
    FILE *f = fopen(path, "w");
    if (!f) return;
    fputs(flags, f);
    fclose(f);
}

static bool peer_sigill_noted(void) {
    char path[4200], flags[8192], noted[8192] = "";
    snprintf(path, sizeof path, "%s/peer-sigill", cache_dir());
    FILE *f = fopen(path, "r");
    if (!f) return false;
    const bool got = fgets(noted, sizeof noted, f) != NULL;
    fclose(f);
    cpu_flags(flags, sizeof flags);
    return got && flags[0] && strcmp(flags, noted) == 0;
}

#define REQUIRE_PEER()                                                                                          \
    do {                                                                                                        \
        if (!peer_dir())                                                                                        \
            cr_skip_test("../shared/peer (llama.cpp's llama-perplexity, llama-quantize) is absent: perplexity " \
                         "parity not checked (set PD_PEER or PD_SHARED_MODELS)");                               \
        if (peer_sigill_noted()) cr_skip_test("llama.cpp in ../shared/peer " PEER_SIGILL_MSG);                 \
    } while (0)

static const char *cache_dir(void) {
    static char buf[4096];
    const char *env = getenv("PD_PPL_CACHE");
    snprintf(buf, sizeof buf, "%s", env && *env ? env : "/tmp/prefixd-ppl-cache");
    if (mkdir(buf, 0755) != 0 && errno != EEXIST) cr_assert_fail("cannot create %s: %s", buf, strerror(errno));
    return buf;
}

static const char *text_path(void) {
    static char buf[4096];
    const char *root = getenv("PD_SOURCE_ROOT");
    cr_assert(root && *root, "PD_SOURCE_ROOT is not set (run through meson test)");
    snprintf(buf, sizeof buf, "%s/tests/data/ppl-stories.txt", root);
    return buf;
}

static uint64_t fnv1a(uint64_t h, const char *s) {
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}

/* "$VOCAB/" expanded. */
static void expand_args(const char *args, char *out, size_t cap) {
    char vocab[4200];
    snprintf(vocab, sizeof vocab, "%s/vocab/", th_shared_models() ? th_shared_models() : ".");
    size_t n = 0;
    for (const char *p = args; *p && n + 1 < cap;) {
        if (strncmp(p, "$VOCAB/", 7) == 0) {
            n += (size_t)snprintf(out + n, cap - n, "%s", vocab);
            p += 7;
        } else {
            out[n++] = *p++;
        }
    }
    out[n < cap ? n : cap - 1] = '\0';
}

static bool file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && st.st_size > 0;
}

/* ---- sharpening ---------------------------------------------------------- */

/* A norm weight's gain by the norm's role. Layer input norms set how far
 * attention scores spread (q and k both scale with it); the output norm
 * sets the logits' spread. Per-head q/k norms (qwen3, gemma3) already make
 * q and k unit-sized, and post-norms (gemma2/3) scale what is added to the
 * residual, so those stay near 1. */
#define GAIN_ATTN 8.0f /* attn_norm: attention scores spread by several units */
#define GAIN_FFN 1.0f  /* ffn_norm: the feed-forward (position-blind) must not drown attention */
#define GAIN_OUT 3.0f  /* output_norm: logits spread by about 3 */
#define GAIN_QK 1.5f   /* attn_q_norm, attn_k_norm */
#define GAIN_POST 1.0f /* post_attention_norm, post_ffw_norm */

/* A deep model (gemma2's 26 layers) needs milder attention (its row's
 * attn_gain), or the layers amplify rounding differences (llama.cpp's 8-bit
 * activations) chaotically: at 8x, 26 layers put correct kernels 0.4-6.5%
 * apart; at 3x within 0.3%. */
static float norm_gain(const char *name, const arch_row *row) {
    if (strstr(name, "attn_q_norm") || strstr(name, "attn_k_norm")) return GAIN_QK;
    if (strstr(name, "post_")) return GAIN_POST;
    if (strcmp(name, "output_norm.weight") == 0) return GAIN_OUT;
    if (strstr(name, "ffn_norm")) return GAIN_FFN;
    return row && row->attn_gain > 0 ? row->attn_gain : GAIN_ATTN;
}

/* A deliberately wrong variant of a model, to show the check has teeth. */
typedef struct variant {
    const char *key_suffix; /* scale this float or u32 key ("<arch>" + suffix) by `factor`; NULL = none */
    float factor;
    bool other_rope_pairs;  /* reorder q/k rows so rope rotates the other pairing (NORM <-> NEOX) */
} variant;

static uint32_t arch_u32(const pd_gguf *g, const char *arch, const char *suffix) {
    char key[256];
    snprintf(key, sizeof key, "%s%s", arch, suffix);
    uint32_t v = 0;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_get_u32(g, key, &v, &err), PD_OK, "%s", err.msg);
    return v;
}

/* Rows of one attn_q/attn_k matrix reordered inside every head: the even
 * rows first, then the odd ones. Rope on adjacent pairs (llama's NORM) of the
 * new rows computes what rope on split halves (NEOX) computes on the old
 * ones; q.k without rope would not change at all. */
static void *reorder_rope_rows(const pd_gguf_tensor *t, uint32_t n_heads) {
    uint64_t row = 0;
    pd_error err = {0};
    cr_assert_eq(pd_type_row_size(t->type, t->ne[0], &row, &err), PD_OK, "%s", err.msg);
    const uint64_t hd = t->ne[1] / n_heads;
    uint8_t *out = malloc(t->n_bytes);
    cr_assert_not_null(out);
    for (uint64_t h = 0; h < n_heads; h++)
        for (uint64_t j = 0; j < hd; j++) {
            const uint64_t from = j < hd / 2 ? 2 * j : 2 * (j - hd / 2) + 1;
            memcpy(out + (h * hd + j) * row, t->data + (h * hd + from) * row, row);
        }
    return out;
}

static bool is_norm(const pd_gguf_tensor *t) {
    const size_t len = strlen(t->name);
    return t->type == PD_TYPE_F32 && t->n_dims == 1 && len > 11 && strcmp(t->name + len - 11, "norm.weight") == 0;
}

/* Every norm weight 1.0: gen-model's flat weights. */
static bool flat_norms(const pd_gguf *g) {
    for (size_t i = 0; i < pd_gguf_tensor_count(g); i++) {
        const pd_gguf_tensor *t = pd_gguf_tensor_at(g, i);
        if (!is_norm(t)) continue;
        for (uint64_t e = 0; e < t->n_elems; e++) {
            float x;
            memcpy(&x, t->data + 4 * e, 4);
            if (x != 1.0f) return false;
        }
    }
    return true;
}

/* Copy src to dst with, when its norms are flat, every "*norm.weight"
 * F32 tensor replaced by gain * (0.5 + u), u uniform in [0, 1) from a
 * generator seeded by the tensor's name (deterministic, independent of the
 * weight type, and the same when applied again); and the variant's change
 * if any. */
static void sharpen(const char *src, const char *dst, const arch_row *row, const variant *v) {
    pd_gguf *g = NULL;
    pd_gguf_writer *w = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open(src, &g, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_gguf_writer_new(&w, &err), PD_OK, "%s", err.msg);
    pd_str arch_s;
    cr_assert_eq(pd_gguf_get_str(g, "general.architecture", &arch_s, &err), PD_OK, "%s", err.msg);
    char arch[64], key[256] = "";
    snprintf(arch, sizeof arch, "%.*s", (int)arch_s.len, arch_s.ptr);
    if (v && v->key_suffix) snprintf(key, sizeof key, "%s%s", arch, v->key_suffix);
    bool overridden = false;
    for (size_t i = 0; i < pd_gguf_kv_count(g); i++) {
        const pd_gguf_kv *kv = pd_gguf_kv_at(g, i);
        if (*key && strcmp(kv->key, key) == 0) {
            if (kv->value.type == PD_GGUF_UINT32) {
                const uint32_t u = (uint32_t)lround((double)kv->value.u * v->factor);
                cr_assert_eq(pd_gguf_writer_set_u32(w, key, u, &err), PD_OK, "%s", err.msg);
            } else {
                float f = 0;
                cr_assert_eq(pd_gguf_get_f32(g, key, &f, &err), PD_OK, "%s", err.msg);
                cr_assert_eq(pd_gguf_writer_set_f32(w, key, f * v->factor, &err), PD_OK, "%s", err.msg);
            }
            overridden = true;
        } else {
            cr_assert_eq(pd_gguf_writer_copy_kv(w, kv, &err), PD_OK, "%s", err.msg);
        }
    }
    cr_assert(!*key || overridden, "%s has no key %s", src, key);
    const bool flat = flat_norms(g);
    for (size_t i = 0; i < pd_gguf_tensor_count(g); i++) {
        const pd_gguf_tensor *t = pd_gguf_tensor_at(g, i);
        const size_t len = strlen(t->name);
        const bool norm = flat && is_norm(t);
        const bool q = len > 13 && strcmp(t->name + len - 13, "attn_q.weight") == 0;
        const bool k = len > 13 && strcmp(t->name + len - 13, "attn_k.weight") == 0;
        void *data = NULL;
        if (norm) {
            float *vals = malloc(sizeof *vals * t->n_elems);
            cr_assert_not_null(vals);
            uint64_t state = fnv1a(0xcbf29ce484222325ull, t->name);
            const float gain = norm_gain(t->name, row);
            for (uint64_t e = 0; e < t->n_elems; e++)
                vals[e] = gain * (0.5f + (float)(pd_splitmix64(&state) >> 40) / (float)(1u << 24));
            data = vals;
        } else if (v && v->other_rope_pairs && (q || k)) {
            data = reorder_rope_rows(t, arch_u32(g, arch, q ? ".attention.head_count" : ".attention.head_count_kv"));
        }
        cr_assert_eq(pd_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, data ? data : t->data, &err),
                     PD_OK, "%s", err.msg);
        free(data);
    }
    cr_assert_eq(pd_gguf_writer_write(w, dst, (uint32_t)pd_gguf_alignment(g), &err), PD_OK, "%s", err.msg);
    pd_gguf_writer_free(w);
    pd_gguf_close(g);
}

/* ---- the pieces of a cell ------------------------------------------------ */

typedef enum { STEP_OK, STEP_REFUSED } step_rc;

/* Remove the architecture's models cached under other keys (older options). */
static void prune_cache(const char *arch, const char *keep) {
    DIR *d = opendir(cache_dir());
    if (!d) return;
    const size_t n = strlen(arch);
    for (struct dirent *e; (e = readdir(d));) {
        char path[8192];
        snprintf(path, sizeof path, "%s/%s", cache_dir(), e->d_name);
        if (strncmp(e->d_name, arch, n) == 0 && e->d_name[n] == '-' && strlen(e->d_name) == n + 26 &&
            strcmp(path, keep) != 0)
            unlink(path);
    }
    closedir(d);
}

/* The sharpened F16 model of an architecture, generated once into the cache
 * (name keyed by the options). STEP_REFUSED with *why when gen-model cannot
 * write the architecture. */
/* Whether gen-model draws peaked weights unless told `--flat`. */
static bool gen_model_has_flat(void) {
    char *out = NULL;
    th_runf(&out, "%s gen-model --help 2>&1", getenv("PD_PREFIXCTL"));
    const bool yes = out && strstr(out, "--flat");
    free(out);
    return yes;
}

static step_rc base_model(const arch_row *a, char *path, size_t cap, char **why) {
    char args[8192];
    expand_args(a->gen, args, sizeof args - 16);
    if (gen_model_has_flat()) strcat(args, " --flat");
    char version[64], key[64];
    snprintf(version, sizeof version, "|sharpen %d %g %g %g %g %g", SHARPEN_VERSION,
             a->attn_gain > 0 ? a->attn_gain : GAIN_ATTN, GAIN_FFN, GAIN_OUT, GAIN_QK, GAIN_POST);
    snprintf(key, sizeof key, "%016llx", (unsigned long long)fnv1a(fnv1a(0xcbf29ce484222325ull, args), version));
    cr_assert((size_t)snprintf(path, cap, "%s/%s-%s-F16.gguf", cache_dir(), a->name, key) < cap, "path too long");
    if (file_exists(path)) return STEP_OK;
    char raw[4200], tmp[4200];
    snprintf(raw, sizeof raw, "%s.raw.%d", path, (int)getpid());
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    char *out = NULL;
    int rc = th_runf(&out, "%s gen-model %s --type f16 -q -o '%s' 2>&1", getenv("PD_PREFIXCTL"), args, raw);
    if (rc != 0) {
        unlink(raw);
        *why = out;
        return STEP_REFUSED;
    }
    free(out);
    sharpen(raw, tmp, a, NULL);
    unlink(raw);
    cr_assert_eq(rename(tmp, path), 0, "rename %s: %s", tmp, strerror(errno));
    prune_cache(a->name, path);
    return STEP_OK;
}

/* The peer is older than the architecture: nothing to compare with, which
 * is no failure of prefixd's. */
static void peer_lacks_arch(const char *model, char *out) {
    const char *arch = strstr(out, "unknown model architecture");
    char msg[256];
    snprintf(msg, sizeof msg, "%.80s", arch);
    for (char *p = msg; *p; p++)
        if (*p == '\n') *p = '\0';
    free(out);
    cr_skip_test("llama.cpp in ../shared/peer cannot run %s (%s): no reference to compare with", model, msg);
}

/* llama-quantize base -> dir/name-MIX.gguf (F16: the base itself). */
static void quantize(const char *base, const char *mix, const char *dir, const char *name, char *out_path,
                     size_t cap) {
    if (strcmp(mix, "F16") == 0) {
        snprintf(out_path, cap, "%s", base);
        return;
    }
    snprintf(out_path, cap, "%s/%s-%s.gguf", dir, name, mix);
    char *out = NULL;
    int rc = th_runf(&out, "%s/llama-quantize '%s' '%s' %s 2 2>&1", peer_dir(), base, out_path, mix);
    if (rc == 128 + 4) {
        free(out);
        peer_sigill_note();
        cr_skip_test("llama-quantize " PEER_SIGILL_MSG);
    }
    if (rc != 0 && out && strstr(out, "unknown model architecture")) peer_lacks_arch(base, out);
    cr_assert_eq(rc, 0, "llama-quantize %s %s failed:\n%s", base, mix, out ? out : "");
    free(out);
}

/* llama-perplexity's final estimate. Batches of one chunk (-b ctx) give
 * the same numbers as the default batching, without its 16 sequences
 * sharing one 2048-cell cache (a quadratic attention cost). */
static double llama_ppl(const char *model, int chunks) {
    char *out = NULL;
    int rc = th_runf(&out, "%s/llama-perplexity -m '%s' -f '%s' -c %d -b %d --chunks %d -t 1 2>&1", peer_dir(), model,
                     text_path(), PPL_CTX, PPL_CTX, chunks);
    const char *fin = out ? strstr(out, "Final estimate: PPL = ") : NULL;
    if (rc == 128 + 4) { /* SIGILL, as the shell reports it */
        free(out);
        peer_sigill_note();
        cr_skip_test("llama-perplexity " PEER_SIGILL_MSG);
    }
    if (rc != 0 && out && strstr(out, "unknown model architecture")) peer_lacks_arch(model, out);
    cr_assert(rc == 0 && fin, "llama-perplexity on %s failed (exit %d):\n%s", model, rc, out ? out : "");
    const double v = strtod(fin + strlen("Final estimate: PPL = "), NULL);
    free(out);
    return v;
}

/* prefixctl perplexity; STEP_REFUSED with *why when prefixd does not compute
 * this model yet (a weight type or architecture it does not know). */
static step_rc prefixd_ppl(const char *model, int chunks, double *ppl, char **why) {
    char *out = NULL;
    int rc = th_runf(&out, "%s perplexity --model '%s' --file '%s' --ctx %d --chunks %d --threads 1 2>&1",
                     getenv("PD_PREFIXCTL"), model, text_path(), PPL_CTX, chunks);
    if (rc != 0 && out && (strstr(out, "cannot compute with") || strstr(out, "is not supported"))) {
        *why = out;
        return STEP_REFUSED;
    }
    cr_assert_eq(rc, 0, "prefixctl perplexity on %s failed:\n%s", model, out ? out : "");
    /* The number is the last line (stdout after the stderr summary). */
    const char *last = out;
    for (const char *p = out; *p; p++)
        if (*p == '\n' && p[1]) last = p + 1;
    *ppl = strtod(last, NULL);
    free(out);
    return STEP_OK;
}

static void cell_fail(const char *cell, const char *stage, char *why) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s: %s: %.700s", cell, stage, why ? why : "");
    free(why);
    for (char *p = msg; *p; p++)
        if (*p == '\n') *p = ' ';
    cr_assert_fail("%s", msg);
}

static double n_vocab(const char *model) {
    pd_gguf *g = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open(model, &g, &err), PD_OK, "%s", err.msg);
    const pd_gguf_value *toks = NULL;
    cr_assert_eq(pd_gguf_get_arr(g, "tokenizer.ggml.tokens", PD_GGUF_STRING, &toks, &err), PD_OK, "%s", err.msg);
    const double n = (double)toks->arr.n;
    pd_gguf_close(g);
    return n;
}

/* ---- the matrix ---------------------------------------------------------- */

typedef struct cell {
    int arch, mix;
} cell;

ParameterizedTestParameters(ppl_parity, cell) {
    static cell cells[N_ARCHS * N_MIXES];
    size_t n = 0;
    for (size_t a = 0; a < N_ARCHS; a++)
        for (size_t k = 0; k < N_MIXES; k++) {
            bool in = !PPL_SANITIZED;
            for (size_t s = 0; s < sizeof SANITIZED_MIXES / sizeof *SANITIZED_MIXES; s++)
                in |= strcmp(MIXES[k], SANITIZED_MIXES[s]) == 0;
            if (in) cells[n++] = (cell){(int)a, (int)k};
        }
    return cr_make_param_array(cell, cells, n);
}

ParameterizedTest(cell *c, ppl_parity, cell, .timeout = 120) {
    REQUIRE_PEER();
    const arch_row *a = &ARCHS[c->arch];
    const char *mix = MIXES[c->mix];
    char name[128], base[4096], model[8192], *why = NULL;
    snprintf(name, sizeof name, "%s/%s", a->name, mix);
    if (base_model(a, base, sizeof base, &why) == STEP_REFUSED) cell_fail(name, "gen-model", why);
    char *dir = th_mkdtemp();
    cr_assert_not_null(dir);
    quantize(base, mix, dir, a->name, model, sizeof model);
    double ours = 0;
    const step_rc rc = prefixd_ppl(model, PPL_CHUNKS, &ours, &why);
    const double ref = rc == STEP_OK ? llama_ppl(model, PPL_CHUNKS) : 0;
    th_rmtree(dir);
    free(dir);
    if (rc == STEP_REFUSED) cell_fail(name, "prefixd", why);
    const double rel = ours / ref - 1;
    cr_log_info("%-14s %-7s prefixd %12.4f  llama %12.4f  ratio-1 %+.4f%%  (ppl / n_vocab %.2f)", a->name, mix, ours, ref,
                100 * rel, ref / n_vocab(base));
    cr_expect(fabs(rel) <= PPL_TOLERANCE, "%s: prefixd %.4f vs llama %.4f: off by %+.3f%% (tolerance %.1f%%)", name, ours,
              ref, 100 * rel, 100 * PPL_TOLERANCE);
}

/* ---- the check has teeth ------------------------------------------------- */

/* prefixd on a wrong variant of a model against llama.cpp on the model: a
 * bug of that kind would be far outside the tolerance. (On random weights
 * a wrong detail moves each token's NLL up or down, so how far the mean
 * moves varies from model to model; these seeds give 3-10%.) */
static void expect_far(const char *arch_name, const char *what, const variant *v) {
    if (PPL_SANITIZED) cr_skip_test("the discrimination checks test the test itself: run in a normal build");
    const arch_row *a = NULL;
    for (size_t i = 0; i < N_ARCHS; i++)
        if (strcmp(ARCHS[i].name, arch_name) == 0) a = &ARCHS[i];
    cr_assert_not_null(a);
    char base[4096], *why = NULL;
    if (base_model(a, base, sizeof base, &why) == STEP_REFUSED) cell_fail(arch_name, "gen-model", why);
    char *dir = th_mkdtemp();
    cr_assert_not_null(dir);
    char wrong[4200];
    snprintf(wrong, sizeof wrong, "%s/wrong.gguf", dir);
    sharpen(base, wrong, a, v);
    const double ref = llama_ppl(base, PPL_CHUNKS);
    double right = 0, off = 0;
    cr_assert_eq(prefixd_ppl(base, PPL_CHUNKS, &right, &why), STEP_OK, "%s", why);
    cr_assert_eq(prefixd_ppl(wrong, PPL_CHUNKS, &off, &why), STEP_OK, "%s", why);
    th_rmtree(dir);
    free(dir);
    const double rel = off / ref - 1;
    cr_log_info("%-14s %-22s llama %12.4f  prefixd %12.4f  wrong variant %12.4f (%+.2f%%)", arch_name, what, ref,
                right, off, 100 * rel);
    cr_expect(fabs(right / ref - 1) <= PPL_TOLERANCE, "%s: the right model is off by %+.3f%%", arch_name,
              100 * (right / ref - 1));
    cr_expect(fabs(rel) > PPL_FAR, "%s with %s is only %+.3f%% away (want %.0f%%): the parity check would hardly see it",
              arch_name, what, 100 * rel, 100 * PPL_FAR);
}

/* A rope base read wrongly (llama's default 1e4 instead of the file's 1e6). */
Test(ppl_parity, discriminates_the_rope_base, .timeout = 120) {
    REQUIRE_PEER();
    expect_far("llama-mistral", "rope base 1e4, not 1e6", &(variant){.key_suffix = ".rope.freq_base", .factor = 0.01f});
}

Test(ppl_parity, discriminates_the_rope_pairing, .timeout = 120) {
    REQUIRE_PEER();
    expect_far("llama-mistral", "NEOX instead of NORM", &(variant){.other_rope_pairs = true});
}

Test(ppl_parity, discriminates_the_norm_epsilon, .timeout = 120) {
    REQUIRE_PEER();
    expect_far("llama-smollm2", "rms eps x 100", &(variant){.key_suffix = ".attention.layer_norm_rms_epsilon",
                                                             .factor = 100.0f});
}

/* A sliding window ignored (gemma2's 64 read as 4096, wider than the text). */
Test(ppl_parity, discriminates_the_sliding_window, .timeout = 120) {
    REQUIRE_PEER();
    expect_far("gemma2", "window 4096, not 64", &(variant){.key_suffix = ".attention.sliding_window", .factor = 64.0f});
}
