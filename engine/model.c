/* Model loading: hyper-parameters and weights of the GGUF architectures the
 * forward pass runs (llama, qwen2, qwen3, gemma2, gemma3, phi3), read from
 * the same keys and tensors, with the same defaults, as llama.cpp b4748
 * (qwen3 and gemma3, which that build predates, as llama.cpp added them).
 *
 * 2-D weights stay in the mapping (pd_weight points into it); 1-D tensors
 * (norms, biases, rope frequency factors) are small and converted to owned
 * f32 arrays so the forward pass never has to care about their type. A file
 * with a tensor the forward pass would not use is refused, as llama.cpp
 * refuses it: such a tensor means a variant we would compute wrongly. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model_internal.h"

static const struct {
    const char *name;
    pd_arch arch;
    pd_rope_mode rope;
} arch_table[] = {
    {"llama", PD_ARCH_LLAMA, PD_ROPE_NORM},   {"qwen2", PD_ARCH_QWEN2, PD_ROPE_NEOX},
    {"qwen3", PD_ARCH_QWEN3, PD_ROPE_NEOX},   {"gemma2", PD_ARCH_GEMMA2, PD_ROPE_NEOX},
    {"gemma3", PD_ARCH_GEMMA3, PD_ROPE_NEOX}, {"phi3", PD_ARCH_PHI3, PD_ROPE_NEOX},
};
#define N_ARCHS (sizeof arch_table / sizeof arch_table[0])

static bool is_gemma(pd_arch a) { return a == PD_ARCH_GEMMA2 || a == PD_ARCH_GEMMA3; }

/* *found (may be NULL) tells whether the key exists. */
static int get_u32_key(const pd_gguf *g, const char *arch, const char *suffix, uint32_t *out, bool required,
                       bool *found, pd_error *err) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = pd_gguf_get_u32(g, key, out, err);
    if (found) *found = rc == PD_OK;
    if (rc == PD_ENOTFOUND && !required) return PD_OK;
    if (rc == PD_ENOTFOUND) return pd_errorf(err, PD_EFORMAT, "model metadata '%s' is missing", key);
    return rc;
}

static int get_f32_key(const pd_gguf *g, const char *arch, const char *suffix, float *out, bool *found,
                       pd_error *err) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = pd_gguf_get_f32(g, key, out, err);
    if (found) *found = rc == PD_OK;
    return rc == PD_ENOTFOUND ? PD_OK : rc;
}

/* The 1/sqrt(d) query scale of gemma2/gemma3 as llama.cpp picks it: d is the
 * head size, except for the 27B models (recognised, as llama.cpp does, by
 * their layer count), whose query_pre_attn_scalar is n_embd / n_head. */
static float gemma_attn_scale(const pd_hparams *hp) {
    const int32_t layers_27b = hp->arch == PD_ARCH_GEMMA2 ? 46 : 62;
    const int32_t d = hp->n_layer == layers_27b ? hp->n_embd / hp->n_head : hp->head_dim;
    return 1.0f / sqrtf((float)d);
}

/* Phi-3's sliding window: the file's key, or llama.cpp's defaults for the
 * files converted before the key existed (mini/medium 4k: 2047; mini 128k:
 * 262144; medium 128k: 131072). A key of 0 (Phi-4) means no window. */
static int phi3_window(const pd_gguf *g, const pd_hparams *hp, int32_t *window, pd_error *err) {
    uint32_t swa = 0;
    if ((hp->n_layer == 32 || hp->n_layer == 40) && hp->n_ctx_train == 4096) swa = 2047;
    else if (hp->n_layer == 32 && hp->n_head_kv == 32 && hp->n_ctx_train == 131072) swa = 262144;
    else if (hp->n_layer == 40 && hp->n_ctx_train == 131072) swa = 131072;
    bool found;
    int rc = get_u32_key(g, hp->arch_name, "attention.sliding_window", &swa, false, &found, err);
    if (rc) return rc;
    if (!found && swa == 0)
        return pd_errorf(err, PD_EFORMAT,
                         "phi3.attention.sliding_window is missing and this shape has no known default "
                         "(add the key: 0 for no window)");
    if (swa > INT32_MAX) return pd_errorf(err, PD_EFORMAT, "phi3.attention.sliding_window %u is too large", swa);
    *window = (int32_t)swa;
    return PD_OK;
}

/* What sets the architectures apart: windows, scales and soft-caps. */
static int read_arch_hparams(const pd_gguf *g, pd_hparams *hp, pd_error *err) {
    const char *a = hp->arch_name;
    hp->embd_scale = 1.0f;
    hp->attn_scale = 1.0f / sqrtf((float)hp->head_dim);
    int rc = PD_OK;
    uint32_t swa = 0;
    switch (hp->arch) {
    case PD_ARCH_GEMMA2:
        /* Gemma 2's window and caps, unless the file says otherwise. */
        swa = 4096;
        hp->attn_softcap = 50.0f;
        hp->final_softcap = 30.0f;
        if ((rc = get_u32_key(g, a, "attention.sliding_window", &swa, false, NULL, err)) ||
            (rc = get_f32_key(g, a, "attn_logit_softcapping", &hp->attn_softcap, NULL, err)) ||
            (rc = get_f32_key(g, a, "final_logit_softcapping", &hp->final_softcap, NULL, err)))
            return rc;
        hp->swa_period = 2;
        break;
    case PD_ARCH_GEMMA3:
        if ((rc = get_u32_key(g, a, "attention.sliding_window", &swa, true, NULL, err))) return rc;
        hp->swa_period = 6;
        break;
    case PD_ARCH_PHI3: {
        int32_t w = 0;
        if ((rc = phi3_window(g, hp, &w, err))) return rc;
        swa = (uint32_t)w;
        hp->swa_period = 1;
        break;
    }
    default:
        break;
    }
    if (swa > INT32_MAX) return pd_errorf(err, PD_EFORMAT, "%s.attention.sliding_window %u is too large", a, swa);
    hp->n_swa = (int32_t)swa;
    if (is_gemma(hp->arch)) {
        hp->embd_scale = sqrtf((float)hp->n_embd);
        hp->attn_scale = gemma_attn_scale(hp);
    }
    if (!(hp->attn_softcap >= 0.0f) || !(hp->final_softcap >= 0.0f))
        return pd_errorf(err, PD_EFORMAT, "%s: soft-capping values must not be negative", a);
    return PD_OK;
}

static int read_hparams(const pd_gguf *g, pd_hparams *hp, pd_error *err) {
    pd_str arch;
    int rc = pd_gguf_get_str(g, "general.architecture", &arch, err);
    if (rc) return rc;
    if (arch.len >= sizeof hp->arch_name)
        return pd_errorf(err, PD_EUNSUPPORTED, "architecture name is too long");
    memcpy(hp->arch_name, arch.ptr, arch.len);
    hp->arch_name[arch.len] = '\0';
    size_t ai = 0;
    while (ai < N_ARCHS && strcmp(arch_table[ai].name, hp->arch_name) != 0) ai++;
    if (ai == N_ARCHS)
        return pd_errorf(err, PD_EUNSUPPORTED,
                         "architecture '%s' is not supported (supported: llama, qwen2, qwen3, gemma2, gemma3, phi3)",
                         hp->arch_name);
    hp->arch = arch_table[ai].arch;
    const char *a = hp->arch_name;

    uint32_t ctx = 0, embd = 0, ff = 0, layers = 0, heads = 0, heads_kv = 0, key_len = 0, val_len = 0, rot = 0,
             experts = 0;
    bool has_key_len, has_val_len;
    if ((rc = get_u32_key(g, a, "context_length", &ctx, true, NULL, err)) ||
        (rc = get_u32_key(g, a, "embedding_length", &embd, true, NULL, err)) ||
        (rc = get_u32_key(g, a, "feed_forward_length", &ff, true, NULL, err)) ||
        (rc = get_u32_key(g, a, "block_count", &layers, true, NULL, err)) ||
        (rc = get_u32_key(g, a, "attention.head_count", &heads, true, NULL, err)) ||
        (rc = get_u32_key(g, a, "attention.head_count_kv", &heads_kv, false, NULL, err)) ||
        (rc = get_u32_key(g, a, "attention.key_length", &key_len, false, &has_key_len, err)) ||
        (rc = get_u32_key(g, a, "attention.value_length", &val_len, false, &has_val_len, err)) ||
        (rc = get_u32_key(g, a, "rope.dimension_count", &rot, false, NULL, err)) ||
        (rc = get_u32_key(g, a, "expert_count", &experts, false, NULL, err)))
        return rc;
    if (experts > 0)
        return pd_errorf(err, PD_EUNSUPPORTED,
                         "%s.expert_count is %" PRIu32 ": mixture-of-experts models are not supported", a, experts);
    if (heads_kv == 0) heads_kv = heads;
    if (embd == 0 || layers == 0 || heads == 0 || ff == 0 || embd > (1u << 20) || layers > 4096 || heads > 4096 ||
        ff > (1u << 24) || key_len > 4096)
        return pd_errorf(err, PD_EFORMAT,
                         "implausible model shape: embedding %" PRIu32 ", layers %" PRIu32 ", heads %" PRIu32
                         ", feed-forward %" PRIu32,
                         embd, layers, heads, ff);
    if (heads % heads_kv != 0)
        return pd_errorf(err, PD_EFORMAT, "head_count %" PRIu32 " is not a multiple of head_count_kv %" PRIu32, heads,
                         heads_kv);
    /* Head sizes default to n_embd / n_head, as in llama.cpp. */
    if ((!has_key_len || !has_val_len) && embd % heads != 0)
        return pd_errorf(err, PD_EFORMAT,
                         "embedding_length %" PRIu32 " is not a multiple of head_count %" PRIu32
                         " and the file gives no attention.key_length/value_length",
                         embd, heads);
    if (!has_key_len) key_len = embd / heads;
    if (!has_val_len) val_len = embd / heads;
    if (key_len == 0 || val_len != key_len)
        return pd_errorf(err, PD_EUNSUPPORTED,
                         "%s: key head size %" PRIu32 " and value head size %" PRIu32
                         " differ (or are 0); only equal head sizes are supported",
                         a, key_len, val_len);
    if (rot == 0) rot = key_len;
    /* llama.cpp requires a full rotation for llama ("invalid n_rot") and qwen3. */
    if ((hp->arch == PD_ARCH_LLAMA || hp->arch == PD_ARCH_QWEN3) && rot != key_len)
        return pd_errorf(err, PD_EFORMAT, "%s.rope.dimension_count %" PRIu32 " must equal the head size %" PRIu32, a,
                         rot, key_len);
    if (rot > key_len || rot % 2 != 0)
        return pd_errorf(err, PD_EFORMAT, "rope.dimension_count %" PRIu32 " must be even and <= head size %" PRIu32,
                         rot, key_len);
    if (hp->arch == PD_ARCH_PHI3 && key_len * heads != embd)
        return pd_errorf(err, PD_EFORMAT, "phi3: head_count x head size (%" PRIu32 " x %" PRIu32
                         ") must equal embedding_length %" PRIu32, heads, key_len, embd);
    hp->n_ctx_train = (int32_t)(ctx ? ctx : 2048);
    hp->n_embd = (int32_t)embd;
    hp->n_ff = (int32_t)ff;
    hp->n_layer = (int32_t)layers;
    hp->n_head = (int32_t)heads;
    hp->n_head_kv = (int32_t)heads_kv;
    hp->head_dim = (int32_t)key_len;
    hp->rms_eps = 1e-5f;
    hp->rope.mode = arch_table[ai].rope;
    hp->rope.n_rot = (int)rot;
    hp->rope.freq_base = 10000.0f;
    if ((rc = get_f32_key(g, a, "attention.layer_norm_rms_epsilon", &hp->rms_eps, NULL, err)) ||
        (rc = get_f32_key(g, a, "rope.freq_base", &hp->rope.freq_base, NULL, err)))
        return rc;
    if (!(hp->rms_eps > 0.0f) || !(hp->rope.freq_base > 0.0f))
        return pd_errorf(err, PD_EFORMAT, "rms epsilon and rope.freq_base must be positive");
    hp->rope_swa = hp->rope;
    /* Gemma 3's local layers rope at base 10000, unscaled. */
    if (hp->arch == PD_ARCH_GEMMA3) hp->rope_swa.freq_base = 10000.0f;
    return read_arch_hparams(g, hp, err);
}

/* The divisor of every rope frequency from the file's rope scaling, as
 * llama.cpp reads it: rope.scaling.factor (or the older rope.scale_linear)
 * s divides each frequency by s unless rope.scaling.type is "none" (the
 * type defaults to linear). Llama 3's rope_freqs.weight folds in on top. */
static int read_rope_scaling(const pd_gguf *g, const pd_hparams *hp, float *factor, pd_error *err) {
    char key[128];
    *factor = 1.0f;
    snprintf(key, sizeof key, "%s.rope.scaling.type", hp->arch_name);
    pd_str stype;
    if (pd_gguf_get_str(g, key, &stype, NULL) != PD_OK) stype = (pd_str){.ptr = "linear", .len = 6};
#define IS(s) (stype.len == sizeof(s) - 1 && memcmp(stype.ptr, s, sizeof(s) - 1) == 0)
    if (IS("none")) return PD_OK;
    if (!IS("linear") && !IS("llama") && !IS("llama3"))
        return pd_errorf(err, PD_EUNSUPPORTED, "rope scaling type '%.*s' is not supported (linear, none)",
                         (int)stype.len, stype.ptr);
#undef IS
    bool found;
    float s = 0.0f;
    int rc;
    if ((rc = get_f32_key(g, hp->arch_name, "rope.scaling.factor", &s, &found, err))) return rc;
    if (!found && (rc = get_f32_key(g, hp->arch_name, "rope.scale_linear", &s, NULL, err))) return rc;
    if (s < 0.0f || s != s) return pd_errorf(err, PD_EFORMAT, "%s.rope.scaling.factor must be > 0", hp->arch_name);
    *factor = s == 0.0f ? 1.0f : s;
    return PD_OK;
}

/* Tensors are looked up through a loader that remembers which it used. */
typedef struct loader {
    const pd_gguf *g;
    bool *used; /* [tensor count] */
} loader;

static const pd_gguf_tensor *find_tensor(loader *ld, const char *name) {
    const pd_gguf_tensor *t = pd_gguf_find_tensor(ld->g, name);
    if (!t) return NULL;
    const size_t n = pd_gguf_tensor_count(ld->g);
    for (size_t i = 0; i < n; i++)
        if (pd_gguf_tensor_at(ld->g, i) == t) ld->used[i] = true;
    return t;
}

/* A 2-D tensor with the expected shape: ne[0] = cols (input), ne[1] = rows. */
static int find_matrix(loader *ld, const char *name, int64_t cols, int64_t rows, bool optional,
                       const pd_gguf_tensor **out, pd_error *err) {
    const pd_gguf_tensor *t = *out = find_tensor(ld, name);
    if (!t) return optional ? PD_OK : pd_errorf(err, PD_EFORMAT, "tensor '%s' is missing", name);
    if (t->n_dims != 2 || (int64_t)t->ne[0] != cols || (int64_t)t->ne[1] != rows)
        return pd_errorf(err, PD_EFORMAT,
                         "tensor '%s' has shape [%" PRIu64 " x %" PRIu64 "], expected [%" PRId64 " x %" PRId64 "]",
                         name, t->ne[0], t->ne[1], cols, rows);
    const pd_type_traits *tr = pd_type_get(t->type);
    if (!tr->can_dequantize)
        return pd_errorf(err, PD_EUNSUPPORTED,
                         "tensor '%s' has type %s, which this build cannot compute with "
                         "(supported: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, q2_k, q3_k, q4_k, q5_k, "
                         "q6_k, iq4_xs)",
                         name, tr->name);
    return PD_OK;
}

/* Rows [r0, r0 + rows) of a found matrix as a weight of its own. */
static int matrix_rows(const pd_gguf_tensor *t, int64_t r0, int64_t rows, pd_weight *w, pd_error *err) {
    uint64_t row_bytes;
    int rc = pd_type_row_size(t->type, t->ne[0], &row_bytes, err);
    if (!rc) rc = pd_weight_init(w, t->type, t->data + (uint64_t)r0 * row_bytes, rows, (int64_t)t->ne[0], err);
    return rc ? pd_error_prefix(err, "tensor '%s'", t->name) : PD_OK;
}

static int load_matrix(loader *ld, const char *name, int64_t cols, int64_t rows, bool optional, pd_weight *w,
                       pd_error *err) {
    const pd_gguf_tensor *t;
    memset(w, 0, sizeof *w);
    int rc = find_matrix(ld, name, cols, rows, optional, &t, err);
    return rc || !t ? rc : matrix_rows(t, 0, rows, w, err);
}

/* A 1-D tensor of n elements, converted to f32 into dst. */
static int load_vector(loader *ld, const char *name, int64_t n, bool optional, float *dst, bool *found,
                       pd_error *err) {
    const pd_gguf_tensor *t = find_tensor(ld, name);
    if (found) *found = t != NULL;
    if (!t) return optional ? PD_OK : pd_errorf(err, PD_EFORMAT, "tensor '%s' is missing", name);
    if ((int64_t)t->n_elems != n || t->ne[0] != (uint64_t)n)
        return pd_errorf(err, PD_EFORMAT, "tensor '%s' has %" PRIu64 " elements, expected %" PRId64, name, t->n_elems, n);
    int rc = pd_dequantize_row(t->type, t->data, dst, (uint64_t)n, err);
    return rc ? pd_error_prefix(err, "tensor '%s'", name) : PD_OK;
}

/* The matrices of a layer (views of a fused tensor each count as one). */
#define N_LAYER_MATRICES 7
static void layer_matrices(const layer_weights *L, const pd_weight *ws[N_LAYER_MATRICES]) {
    const pd_weight *all[N_LAYER_MATRICES] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
    memcpy(ws, all, sizeof all);
}

static pd_type most_common_type(const pd_model *m) {
    int count[PD_TYPE_COUNT] = {0};
    for (int l = 0; l < m->hp.n_layer; l++) {
        const pd_weight *ws[N_LAYER_MATRICES];
        layer_matrices(&m->layers[l], ws);
        for (size_t i = 0; i < N_LAYER_MATRICES; i++) count[ws[i]->type]++;
    }
    int best = 0;
    for (int t = 1; t < PD_TYPE_COUNT; t++)
        if (count[t] > count[best]) best = t;
    return (pd_type)best;
}

/* Rope divisors for one rope: rope_freqs (if any) times the linear factor;
 * none at all leaves p->freq_factors NULL. */
static int make_rope_freqs(const float *base, float linear, pd_rope_params *p, float **owned, pd_error *err) {
    if (!base && linear == 1.0f) return PD_OK;
    const int n = p->n_rot / 2;
    if (n > PD_ROPE_MAX_FACTORS)
        return pd_errorf(err, PD_EUNSUPPORTED, "rope over %d dimensions is more than supported (%d)", p->n_rot,
                         2 * PD_ROPE_MAX_FACTORS);
    if (!(*owned = malloc(sizeof(float) * (size_t)n))) return pd_errorf(err, PD_ENOMEM, "out of memory");
    for (int i = 0; i < n; i++) (*owned)[i] = (base ? base[i] : 1.0f) * linear;
    p->freq_factors = *owned;
    return PD_OK;
}

static int load_rope(pd_model *m, loader *ld, pd_error *err) {
    pd_hparams *hp = &m->hp;
    float linear;
    int rc = read_rope_scaling(m->gguf, hp, &linear, err);
    if (rc) return rc;
    if (pd_gguf_find_tensor(m->gguf, "rope_factors_long.weight") ||
        pd_gguf_find_tensor(m->gguf, "rope_factors_short.weight"))
        return pd_errorf(err, PD_EUNSUPPORTED,
                         "longrope scaling (rope_factors_long/short tensors, as in Phi-3 128k and Phi-3.5) "
                         "is not supported");
    /* Llama 3's per-frequency divisors: llama.cpp reads them for llama. */
    float freqs[PD_ROPE_MAX_FACTORS], *base = NULL;
    const int n = hp->rope.n_rot / 2;
    if ((hp->arch == PD_ARCH_LLAMA || hp->arch == PD_ARCH_QWEN2) && pd_gguf_find_tensor(m->gguf, "rope_freqs.weight")) {
        if (n > PD_ROPE_MAX_FACTORS) return pd_errorf(err, PD_EUNSUPPORTED, "rope_freqs.weight is too long");
        if ((rc = load_vector(ld, "rope_freqs.weight", n, false, freqs, NULL, err))) return rc;
        base = freqs;
    }
    if ((rc = make_rope_freqs(base, linear, &hp->rope, &m->rope_freqs, err))) return rc;
    /* Gemma 3's local layers do not scale; elsewhere windowed layers rope alike. */
    if (hp->arch == PD_ARCH_GEMMA3) return PD_OK;
    hp->rope_swa.freq_factors = hp->rope.freq_factors;
    return PD_OK;
}

#define LOAD(suffix, cols, rows, w) \
    (snprintf(name, sizeof name, "blk.%d." suffix, l), load_matrix(ld, name, cols, rows, false, w, err))

/* Per layer: Q, K, V (phi3: views of one fused attn_qkv when the file has
 * it) and the output projection. */
static int load_attention(loader *ld, const pd_hparams *hp, int l, layer_weights *L, pd_error *err) {
    const int64_t d = hp->n_embd, qd = (int64_t)hp->n_head * hp->head_dim, kvd = (int64_t)hp->n_head_kv * hp->head_dim;
    char name[96];
    int rc;
    if (hp->arch == PD_ARCH_PHI3) {
        const pd_gguf_tensor *t;
        snprintf(name, sizeof name, "blk.%d.attn_qkv.weight", l);
        if ((rc = find_matrix(ld, name, d, qd + 2 * kvd, true, &t, err))) return rc;
        if (t && ((rc = matrix_rows(t, 0, qd, &L->wq, err)) || (rc = matrix_rows(t, qd, kvd, &L->wk, err)) ||
                  (rc = matrix_rows(t, qd + kvd, kvd, &L->wv, err))))
            return rc;
        if (t) goto output;
    }
    if ((rc = LOAD("attn_q.weight", d, qd, &L->wq)) || (rc = LOAD("attn_k.weight", d, kvd, &L->wk)) ||
        (rc = LOAD("attn_v.weight", d, kvd, &L->wv)))
        return rc;
output:
    return LOAD("attn_output.weight", qd, d, &L->wo);
}

/* Per layer: the feed-forward matrices (phi3: gate and up are the two row
 * halves of ffn_up, gate first, as llama.cpp's fused SwiGLU splits them). */
static int load_ffn(loader *ld, const pd_hparams *hp, int l, layer_weights *L, pd_error *err) {
    const int64_t d = hp->n_embd, ff = hp->n_ff;
    char name[96];
    int rc;
    if (hp->arch == PD_ARCH_PHI3) {
        const pd_gguf_tensor *t;
        snprintf(name, sizeof name, "blk.%d.ffn_up.weight", l);
        if ((rc = find_matrix(ld, name, d, 2 * ff, false, &t, err)) || (rc = matrix_rows(t, 0, ff, &L->w_gate, err)) ||
            (rc = matrix_rows(t, ff, ff, &L->w_up, err)))
            return rc;
    } else if ((rc = LOAD("ffn_gate.weight", d, ff, &L->w_gate)) || (rc = LOAD("ffn_up.weight", d, ff, &L->w_up))) {
        return rc;
    }
    return LOAD("ffn_down.weight", ff, d, &L->w_down);
}
#undef LOAD

static int load_weights(pd_model *m, loader *ld, pd_error *err) {
    const pd_gguf *g = m->gguf;
    pd_hparams *hp = &m->hp;
    const pd_gguf_tensor *emb = pd_gguf_find_tensor(g, "token_embd.weight");
    if (!emb || emb->n_dims != 2) return pd_errorf(err, PD_EFORMAT, "tensor 'token_embd.weight' is missing or not 2-D");
    if (emb->ne[1] == 0 || emb->ne[1] > INT32_MAX) return pd_errorf(err, PD_EFORMAT, "token_embd.weight: bad vocabulary size");
    hp->n_vocab = (int32_t)emb->ne[1];
    const int64_t d = hp->n_embd, hd = hp->head_dim, q_dim = (int64_t)hp->n_head * hd,
                  kv_dim = (int64_t)hp->n_head_kv * hd;
    int rc;
    if ((rc = load_matrix(ld, "token_embd.weight", d, hp->n_vocab, false, &m->tok_embd, err))) return rc;
    /* gemma2 always reuses token_embd (llama.cpp refuses an output.weight there). */
    if (hp->arch != PD_ARCH_GEMMA2 && (rc = load_matrix(ld, "output.weight", d, hp->n_vocab, true, &m->output, err)))
        return rc;
    hp->tied_output = m->output.data == NULL;
    if (hp->tied_output) m->output = m->tok_embd;
    if (pd_tokenizer_n_vocab(m->tok) > hp->n_vocab)
        return pd_errorf(err, PD_EFORMAT, "the vocabulary has %d tokens but token_embd.weight only %d rows",
                         pd_tokenizer_n_vocab(m->tok), hp->n_vocab);

    /* All 1-D tensors in one allocation: output norm, then per layer
     * attn_norm, post_attn_norm, ffn_norm, post_ffn_norm, bq, bk, bv,
     * q_norm, k_norm (a slot whatever the architecture; they are small). */
    const int64_t per_layer = 4 * d + q_dim + 2 * kv_dim + 2 * hd;
    m->norms_len = (size_t)(d + per_layer * hp->n_layer);
    m->norms = malloc(sizeof(float) * m->norms_len);
    m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers);
    if (!m->norms || !m->layers) return pd_errorf(err, PD_ENOMEM, "out of memory for model weights");
    float *f = m->norms;
    if ((rc = load_vector(ld, "output_norm.weight", d, false, f, NULL, err))) return rc;
    m->output_norm = f;
    f += d;

    const bool gemma = is_gemma(hp->arch), qk_norm = hp->arch == PD_ARCH_QWEN3 || hp->arch == PD_ARCH_GEMMA3;
    char name[96];
#define LAYER_NAME(fmt) (snprintf(name, sizeof name, "blk.%d." fmt, l), name)
/* Load an optional-or-required vector into the next slot; dst = slot or NULL. */
#define VECTOR(fmt, n, required, dst)                                                             \
    do {                                                                                          \
        bool found_;                                                                              \
        if ((rc = load_vector(ld, LAYER_NAME(fmt), n, !(required), f, &found_, err))) return rc;  \
        (dst) = found_ ? f : NULL;                                                                \
        f += (n);                                                                                 \
    } while (0)
    for (int l = 0; l < hp->n_layer; l++) {
        layer_weights *L = &m->layers[l];
        VECTOR("attn_norm.weight", d, true, L->attn_norm);
        VECTOR("ffn_norm.weight", d, true, L->ffn_norm);
        if (gemma) {
            VECTOR("post_attention_norm.weight", d, true, L->post_attn_norm);
            VECTOR("post_ffw_norm.weight", d, true, L->post_ffn_norm);
        }
        /* Biases: qwen2 has them, llama files may. */
        if (hp->arch == PD_ARCH_LLAMA || hp->arch == PD_ARCH_QWEN2) {
            const bool need = hp->arch == PD_ARCH_QWEN2;
            VECTOR("attn_q.bias", q_dim, need, L->bq);
            VECTOR("attn_k.bias", kv_dim, need, L->bk);
            VECTOR("attn_v.bias", kv_dim, need, L->bv);
        }
        if (qk_norm) {
            VECTOR("attn_q_norm.weight", hd, true, L->q_norm);
            VECTOR("attn_k_norm.weight", hd, true, L->k_norm);
        }
        if ((rc = load_attention(ld, hp, l, L, err)) || (rc = load_ffn(ld, hp, l, L, err))) return rc;
        const bool windowed = pd_hparams_layer_windowed(hp, l);
        L->window = windowed ? hp->n_swa : 0;
        L->rope = windowed ? &hp->rope_swa : &hp->rope;
    }
#undef VECTOR
#undef LAYER_NAME
    if ((rc = load_rope(m, ld, err))) return rc;
    hp->wtype = most_common_type(m);
    return PD_OK;
}

/* Every tensor of the file must have been used (llama.cpp's rule too). */
static int check_all_used(const loader *ld, const pd_hparams *hp, pd_error *err) {
    const size_t n = pd_gguf_tensor_count(ld->g);
    for (size_t i = 0; i < n; i++)
        if (!ld->used[i])
            return pd_errorf(err, PD_EUNSUPPORTED,
                             "tensor '%s' has no place in the %s forward pass: this is a variant of the "
                             "architecture that is not supported",
                             pd_gguf_tensor_at(ld->g, i)->name, hp->arch_name);
    return PD_OK;
}

/* A device backend gets its copy of every matrix now, so upload time and
 * running out of device memory show at load, and of the 1-D tensors. */
static int place_on_backend(pd_model *m, pd_error *err) {
    pd_backend *be = m->backend;
    if (pd_backend_host_memory(be)) {
        m->dev_norms = m->norms;
        return PD_OK;
    }
    const size_t bytes = m->norms_len * sizeof(float);
    if (!(m->dev_norms = pd_backend_alloc(be, bytes, err))) return PD_ENOMEM;
    int rc = pd_backend_upload(be, m->dev_norms, m->norms, bytes, err);
    if (rc || !pd_backend_caches_weights(be)) return rc;
    if ((rc = pd_backend_prepare_weight(be, &m->tok_embd, err))) return rc;
    if (!m->hp.tied_output && (rc = pd_backend_prepare_weight(be, &m->output, err))) return rc;
    for (int l = 0; l < m->hp.n_layer; l++) {
        const pd_weight *ws[N_LAYER_MATRICES];
        layer_matrices(&m->layers[l], ws);
        for (size_t i = 0; i < N_LAYER_MATRICES; i++)
            if ((rc = pd_backend_prepare_weight(be, ws[i], err))) return pd_error_prefix(err, "layer %d", l);
    }
    return pd_backend_sync(be, err);
}

static int pack_one(pd_backend *be, pd_weight *w, pd_error *err) {
    return w->data ? pd_backend_pack_weight(be, w, (void *)(uintptr_t)w->data, err) : PD_OK;
}

/* The CPU computes some types faster with their rows rearranged
 * (pd_backend_pack_weight), and the file's bytes in memory are the
 * model's own: rearrange them there, no second copy. */
static int pack_weights(pd_model *m, pd_error *err) {
    pd_backend *be = m->backend;
    int rc = pd_gguf_set_writable(m->gguf, true, err);
    if (rc) return rc;
    rc = pack_one(be, &m->tok_embd, err);
    if (!rc && m->hp.tied_output) m->output = m->tok_embd; /* the same bytes: one pd_weight */
    else if (!rc) rc = pack_one(be, &m->output, err);
    for (int l = 0; l < m->hp.n_layer && !rc; l++) {
        const pd_weight *ws[N_LAYER_MATRICES];
        layer_matrices(&m->layers[l], ws);
        for (size_t i = 0; i < N_LAYER_MATRICES && !rc; i++)
            if ((rc = pack_one(be, (pd_weight *)(uintptr_t)ws[i], err))) pd_error_prefix(err, "layer %d", l);
    }
    pd_error e2 = {0};
    const int rc2 = pd_gguf_set_writable(m->gguf, false, rc ? &e2 : err);
    return rc ? rc : rc2;
}

int pd_model_load(const char *path, const pd_model_params *params, pd_model **out, pd_error *err) {
    *out = NULL;
    pd_model *m = calloc(1, sizeof *m);
    if (!m) return pd_errorf(err, PD_ENOMEM, "out of memory loading a model");
    if (kv_pool_init(&m->pool, err)) {
        free(m);
        return PD_ENOMEM;
    }
    m->kv_type = params && params->kv_f32 ? PD_TYPE_F32 : PD_TYPE_F16;
    m->no_graphs = params && params->no_graphs;
    /* The CPU computes from the file's bytes: read them into huge-page
     * memory. A device backend uploads them, so a mapping is enough. */
    const bool host = !params || !params->backend || pd_backend_host_memory(params->backend);
    const bool in_memory = host && !(params && params->mmap_weights);
    int rc = in_memory ? pd_gguf_load(path, &m->gguf, err) : pd_gguf_open(path, &m->gguf, err);
    if (!rc && (rc = read_hparams(m->gguf, &m->hp, err))) pd_error_prefix(err, "%s", path);
    if (!rc && (rc = pd_tokenizer_load(m->gguf, &m->tok, err))) pd_error_prefix(err, "%s: tokenizer", path);
    if (!rc) {
        loader ld = {.g = m->gguf, .used = calloc(pd_gguf_tensor_count(m->gguf) + 1, sizeof(bool))};
        if (!ld.used) rc = pd_errorf(err, PD_ENOMEM, "out of memory loading a model");
        if (!rc) rc = load_weights(m, &ld, err);
        if (!rc) rc = check_all_used(&ld, &m->hp, err);
        if (rc) pd_error_prefix(err, "%s", path);
        free(ld.used);
    }
    if (!rc) {
        if (params && params->backend) {
            m->backend = params->backend;
        } else {
            rc = pd_backend_cpu_create(params ? params->n_threads : 0, &m->backend, err);
            m->owns_backend = rc == PD_OK;
        }
    }
    if (!rc && (rc = place_on_backend(m, err))) pd_error_prefix(err, "%s: %s backend", path, pd_backend_name(m->backend));
    if (!rc && in_memory && (rc = pack_weights(m, err))) pd_error_prefix(err, "%s: packing weights", path);
    if (rc) {
        pd_model_free(m);
        return rc;
    }
    *out = m;
    return PD_OK;
}

void pd_model_free(pd_model *m) {
    if (!m) return;
    if (m->backend) {
        pd_backend *be = m->backend;
        if (pd_backend_caches_weights(be) && m->layers) {
            pd_backend_forget_weight(be, &m->tok_embd);
            if (!m->hp.tied_output) pd_backend_forget_weight(be, &m->output);
            for (int l = 0; l < m->hp.n_layer; l++) {
                const pd_weight *ws[N_LAYER_MATRICES];
                layer_matrices(&m->layers[l], ws);
                for (size_t i = 0; i < N_LAYER_MATRICES; i++) pd_backend_forget_weight(be, ws[i]);
            }
        }
        if (m->dev_norms != m->norms) pd_backend_release(m->backend, m->dev_norms);
        pd_backend_release(m->backend, m->scratch.dev);
        pd_backend_host_free(m->backend, m->logits_staging);
    }
    kv_pool_destroy(&m->pool, m->backend);
    free(m->scratch.host);
    if (m->owns_backend) pd_backend_free(m->backend);
    free(m->layers);
    free(m->norms);
    free(m->rope_freqs);
    pd_tokenizer_free(m->tok);
    pd_gguf_close(m->gguf);
    free(m);
}

/* A throwaway prefill of warm tokens and a decode of n_seqs sequences:
 * the activation scratch, copy descriptors and pinned logits reach the
 * sizes of serving's largest calls. (Attention's split-K partials grow with
 * the context; they grow through the allocator's cache the first time a
 * longer context is served, not per step.) */
static int pool_warm(pd_model *m, int n_seqs, int32_t n_ctx, int32_t warm, pd_error *err) {
    if (warm > n_ctx - 1) warm = n_ctx - 1;
    pd_seq **seqs = calloc((size_t)n_seqs, sizeof *seqs);
    pd_token *toks = calloc((size_t)(warm > n_seqs ? warm : n_seqs), sizeof *toks);
    float *logits = malloc((size_t)n_seqs * (size_t)m->hp.n_vocab * sizeof *logits);
    int rc = seqs && toks && logits ? PD_OK : pd_errorf(err, PD_ENOMEM, "out of memory warming the KV pool");
    for (int i = 0; i < n_seqs && !rc; i++) rc = pd_seq_create(m, n_ctx, &seqs[i], err);
    if (!rc && warm > 0) rc = pd_prefill(m, seqs[0], toks, warm, NULL, logits, err);
    if (!rc) rc = pd_decode(m, seqs, toks, n_seqs, logits, err);
    for (int i = 0; seqs && i < n_seqs; i++) pd_seq_free(seqs[i]);
    free(seqs);
    free(toks);
    free(logits);
    return rc ? pd_error_prefix(err, "warming the KV pool") : PD_OK;
}

int pd_model_reserve_kv(pd_model *m, int n_seqs, int32_t n_ctx, int32_t warm_tokens, pd_error *err) {
    if (pd_backend_host_memory(m->backend)) return PD_OK;
    if (n_seqs < 1 || n_ctx < 0 || warm_tokens < 0)
        return pd_errorf(err, PD_EINVAL, "a KV pool of %d sequences, %d positions, %d warm-up tokens is not valid",
                         n_seqs, n_ctx, warm_tokens);
    if (n_ctx == 0) n_ctx = m->hp.n_ctx_train;
    int rc = kv_pool_reserve(m, n_seqs, n_ctx, err);
    if (rc) return rc;
    if (warm_tokens > 0 && (rc = pool_warm(m, n_seqs, n_ctx, warm_tokens, err))) {
        kv_pool_drop(&m->pool, m->backend);
        return rc;
    }
    /* the warm-up's sequences are not serving's */
    pthread_mutex_lock(&m->pool.lock);
    m->pool.no_slab = m->pool.outgrown = 0;
    pthread_mutex_unlock(&m->pool.lock);
    return PD_OK;
}

const pd_hparams *pd_model_hparams(const pd_model *m) { return &m->hp; }
const pd_tokenizer *pd_model_tokenizer(const pd_model *m) { return m->tok; }
const pd_gguf *pd_model_gguf(const pd_model *m) { return m->gguf; }
pd_backend *pd_model_backend(const pd_model *m) { return m->backend; }
pd_type pd_model_kv_type(const pd_model *m) { return m->kv_type; }
void pd_model_fingerprint(const pd_model *m, uint8_t out[PD_SHA256_LEN]) { pd_gguf_fingerprint(m->gguf, out); }
