/* Model loading: hyper-parameters and weights of llama-family GGUF files.
 *
 * 2-D weights stay in the mapping (pd_weight points into it); 1-D tensors
 * (norms, biases, rope frequency factors) are small and converted to owned
 * f32 arrays so the forward pass never has to care about their type. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model_internal.h"

static int get_u32_key(const pd_gguf *g, const char *arch, const char *suffix, uint32_t *out, bool required,
                       pd_error *err) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = pd_gguf_get_u32(g, key, out, err);
    if (rc == PD_ENOTFOUND && !required) return PD_OK;
    if (rc == PD_ENOTFOUND) return pd_errorf(err, PD_EFORMAT, "model metadata '%s' is missing", key);
    return rc;
}

static int get_f32_key(const pd_gguf *g, const char *arch, const char *suffix, float *out, pd_error *err) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = pd_gguf_get_f32(g, key, out, err);
    return rc == PD_ENOTFOUND ? PD_OK : rc;
}

static int read_hparams(const pd_gguf *g, pd_hparams *hp, pd_error *err) {
    pd_str arch;
    int rc = pd_gguf_get_str(g, "general.architecture", &arch, err);
    if (rc) return rc;
    if (arch.len >= sizeof hp->arch_name)
        return pd_errorf(err, PD_EUNSUPPORTED, "architecture name is too long");
    memcpy(hp->arch_name, arch.ptr, arch.len);
    hp->arch_name[arch.len] = '\0';
    if (strcmp(hp->arch_name, "llama") == 0) hp->arch = PD_ARCH_LLAMA;
    else if (strcmp(hp->arch_name, "qwen2") == 0) hp->arch = PD_ARCH_QWEN2;
    else
        return pd_errorf(err, PD_EUNSUPPORTED, "architecture '%s' is not supported (supported: llama, qwen2)",
                         hp->arch_name);
    const char *a = hp->arch_name;

    uint32_t ctx = 0, embd = 0, ff = 0, layers = 0, heads = 0, heads_kv = 0, key_len = 0, rot = 0;
    if ((rc = get_u32_key(g, a, "context_length", &ctx, true, err)) ||
        (rc = get_u32_key(g, a, "embedding_length", &embd, true, err)) ||
        (rc = get_u32_key(g, a, "feed_forward_length", &ff, true, err)) ||
        (rc = get_u32_key(g, a, "block_count", &layers, true, err)) ||
        (rc = get_u32_key(g, a, "attention.head_count", &heads, true, err)) ||
        (rc = get_u32_key(g, a, "attention.head_count_kv", &heads_kv, false, err)) ||
        (rc = get_u32_key(g, a, "attention.key_length", &key_len, false, err)) ||
        (rc = get_u32_key(g, a, "rope.dimension_count", &rot, false, err)))
        return rc;
    if (heads_kv == 0) heads_kv = heads;
    if (embd == 0 || layers == 0 || heads == 0 || ff == 0 || embd > (1u << 20) || layers > 4096 || heads > 4096 ||
        ff > (1u << 24))
        return pd_errorf(err, PD_EFORMAT,
                         "implausible model shape: embedding %" PRIu32 ", layers %" PRIu32 ", heads %" PRIu32
                         ", feed-forward %" PRIu32,
                         embd, layers, heads, ff);
    if (heads % heads_kv != 0)
        return pd_errorf(err, PD_EFORMAT, "head_count %" PRIu32 " is not a multiple of head_count_kv %" PRIu32, heads,
                         heads_kv);
    if (key_len == 0) {
        if (embd % heads != 0)
            return pd_errorf(err, PD_EFORMAT, "embedding_length %" PRIu32 " is not a multiple of head_count %" PRIu32,
                             embd, heads);
        key_len = embd / heads;
    }
    if (rot == 0) rot = key_len;
    if (rot > key_len || rot % 2 != 0)
        return pd_errorf(err, PD_EFORMAT, "rope.dimension_count %" PRIu32 " must be even and <= head size %" PRIu32,
                         rot, key_len);
    hp->n_ctx_train = (int32_t)(ctx ? ctx : 2048);
    hp->n_embd = (int32_t)embd;
    hp->n_ff = (int32_t)ff;
    hp->n_layer = (int32_t)layers;
    hp->n_head = (int32_t)heads;
    hp->n_head_kv = (int32_t)heads_kv;
    hp->head_dim = (int32_t)key_len;
    hp->rms_eps = 1e-5f;
    hp->rope.mode = hp->arch == PD_ARCH_QWEN2 ? PD_ROPE_NEOX : PD_ROPE_NORM;
    hp->rope.n_rot = (int)rot;
    hp->rope.freq_base = 10000.0f;
    if ((rc = get_f32_key(g, a, "attention.layer_norm_rms_epsilon", &hp->rms_eps, err)) ||
        (rc = get_f32_key(g, a, "rope.freq_base", &hp->rope.freq_base, err)))
        return rc;

    if (!(hp->rms_eps > 0.0f) || !(hp->rope.freq_base > 0.0f))
        return pd_errorf(err, PD_EFORMAT, "rms epsilon and rope.freq_base must be positive");
    return PD_OK;
}

/* Linear rope scaling by a factor s divides every frequency by s, so it folds
 * into the per-frequency divisors together with llama3's rope_freqs.weight. */
static int read_rope_scaling(const pd_gguf *g, const pd_hparams *hp, float *factor, pd_error *err) {
    char key[128];
    *factor = 1.0f;
    snprintf(key, sizeof key, "%s.rope.scaling.type", hp->arch_name);
    pd_str stype;
    if (pd_gguf_get_str(g, key, &stype, NULL) != PD_OK) return PD_OK;
    if (stype.len == 6 && memcmp(stype.ptr, "linear", 6) == 0) {
        int rc = get_f32_key(g, hp->arch_name, "rope.scaling.factor", factor, err);
        if (rc) return rc;
        if (!(*factor > 0.0f)) return pd_errorf(err, PD_EFORMAT, "%s.rope.scaling.factor must be > 0", hp->arch_name);
        return PD_OK;
    }
    if ((stype.len == 4 && memcmp(stype.ptr, "none", 4) == 0) || (stype.len == 5 && memcmp(stype.ptr, "llama", 5) == 0) ||
        (stype.len == 6 && memcmp(stype.ptr, "llama3", 6) == 0))
        return PD_OK;
    return pd_errorf(err, PD_EUNSUPPORTED, "rope scaling type '%.*s' is not supported (linear, llama3, none)",
                     (int)stype.len, stype.ptr);
}

/* A 2-D weight with the expected shape: ne[0] = cols (input), ne[1] = rows. */
static int load_matrix(const pd_gguf *g, const char *name, int64_t cols, int64_t rows, bool optional,
                       pd_weight *w, pd_error *err) {
    const pd_gguf_tensor *t = pd_gguf_find_tensor(g, name);
    if (!t) {
        if (optional) {
            memset(w, 0, sizeof *w);
            return PD_OK;
        }
        return pd_errorf(err, PD_EFORMAT, "tensor '%s' is missing", name);
    }
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
    int rc = pd_weight_init(w, t->type, t->data, rows, cols, err);
    return rc ? pd_error_prefix(err, "tensor '%s'", name) : PD_OK;
}

/* A 1-D tensor of n elements, converted to f32 into dst. */
static int load_vector(const pd_gguf *g, const char *name, int64_t n, bool optional, float *dst, bool *found,
                       pd_error *err) {
    const pd_gguf_tensor *t = pd_gguf_find_tensor(g, name);
    if (found) *found = t != NULL;
    if (!t) return optional ? PD_OK : pd_errorf(err, PD_EFORMAT, "tensor '%s' is missing", name);
    if ((int64_t)t->n_elems != n || t->ne[0] != (uint64_t)n)
        return pd_errorf(err, PD_EFORMAT, "tensor '%s' has %" PRIu64 " elements, expected %" PRId64, name, t->n_elems, n);
    int rc = pd_dequantize_row(t->type, t->data, dst, (uint64_t)n, err);
    return rc ? pd_error_prefix(err, "tensor '%s'", name) : PD_OK;
}

static pd_type most_common_type(const pd_model *m) {
    int count[PD_TYPE_COUNT] = {0};
    for (int l = 0; l < m->hp.n_layer; l++) {
        const layer_weights *L = &m->layers[l];
        const pd_weight *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < sizeof ws / sizeof *ws; i++) count[ws[i]->type]++;
    }
    int best = 0;
    for (int t = 1; t < PD_TYPE_COUNT; t++)
        if (count[t] > count[best]) best = t;
    return (pd_type)best;
}

static int load_weights(pd_model *m, pd_error *err) {
    const pd_gguf *g = m->gguf;
    pd_hparams *hp = &m->hp;
    const pd_gguf_tensor *emb = pd_gguf_find_tensor(g, "token_embd.weight");
    if (!emb || emb->n_dims != 2) return pd_errorf(err, PD_EFORMAT, "tensor 'token_embd.weight' is missing or not 2-D");
    if (emb->ne[1] == 0 || emb->ne[1] > INT32_MAX) return pd_errorf(err, PD_EFORMAT, "token_embd.weight: bad vocabulary size");
    hp->n_vocab = (int32_t)emb->ne[1];
    const int64_t d = hp->n_embd, q_dim = (int64_t)hp->n_head * hp->head_dim, kv_dim = (int64_t)hp->n_head_kv * hp->head_dim;
    int rc;
    if ((rc = load_matrix(g, "token_embd.weight", d, hp->n_vocab, false, &m->tok_embd, err))) return rc;
    if ((rc = load_matrix(g, "output.weight", d, hp->n_vocab, true, &m->output, err))) return rc;
    hp->tied_output = m->output.data == NULL;
    if (hp->tied_output) m->output = m->tok_embd;
    if (pd_tokenizer_n_vocab(m->tok) > hp->n_vocab)
        return pd_errorf(err, PD_EFORMAT, "the vocabulary has %d tokens but token_embd.weight only %d rows",
                         pd_tokenizer_n_vocab(m->tok), hp->n_vocab);

    /* All 1-D tensors in one allocation: output norm, then per layer
     * attn_norm, ffn_norm, bq, bk, bv. */
    const int64_t per_layer = 2 * d + q_dim + 2 * kv_dim;
    m->norms_len = (size_t)(d + per_layer * hp->n_layer);
    m->norms = malloc(sizeof(float) * m->norms_len);
    m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers);
    if (!m->norms || !m->layers) return pd_errorf(err, PD_ENOMEM, "out of memory for model weights");
    float *f = m->norms;
    if ((rc = load_vector(g, "output_norm.weight", d, false, f, NULL, err))) return rc;
    m->output_norm = f;
    f += d;

    char name[96];
#define LAYER_NAME(fmt) (snprintf(name, sizeof name, "blk.%d." fmt, l), name)
    for (int l = 0; l < hp->n_layer; l++) {
        layer_weights *L = &m->layers[l];
        bool found;
        if ((rc = load_vector(g, LAYER_NAME("attn_norm.weight"), d, false, f, NULL, err))) return rc;
        L->attn_norm = f, f += d;
        if ((rc = load_vector(g, LAYER_NAME("ffn_norm.weight"), d, false, f, NULL, err))) return rc;
        L->ffn_norm = f, f += d;
        bool need_bias = hp->arch == PD_ARCH_QWEN2;
        if ((rc = load_vector(g, LAYER_NAME("attn_q.bias"), q_dim, !need_bias, f, &found, err))) return rc;
        L->bq = found ? f : NULL, f += q_dim;
        if ((rc = load_vector(g, LAYER_NAME("attn_k.bias"), kv_dim, !need_bias, f, &found, err))) return rc;
        L->bk = found ? f : NULL, f += kv_dim;
        if ((rc = load_vector(g, LAYER_NAME("attn_v.bias"), kv_dim, !need_bias, f, &found, err))) return rc;
        L->bv = found ? f : NULL, f += kv_dim;
        if ((rc = load_matrix(g, LAYER_NAME("attn_q.weight"), d, q_dim, false, &L->wq, err)) ||
            (rc = load_matrix(g, LAYER_NAME("attn_k.weight"), d, kv_dim, false, &L->wk, err)) ||
            (rc = load_matrix(g, LAYER_NAME("attn_v.weight"), d, kv_dim, false, &L->wv, err)) ||
            (rc = load_matrix(g, LAYER_NAME("attn_output.weight"), q_dim, d, false, &L->wo, err)) ||
            (rc = load_matrix(g, LAYER_NAME("ffn_gate.weight"), d, hp->n_ff, false, &L->w_gate, err)) ||
            (rc = load_matrix(g, LAYER_NAME("ffn_up.weight"), d, hp->n_ff, false, &L->w_up, err)) ||
            (rc = load_matrix(g, LAYER_NAME("ffn_down.weight"), hp->n_ff, d, false, &L->w_down, err)))
            return rc;
    }
#undef LAYER_NAME

    /* llama3-style rope scaling (per-frequency divisors) and linear scaling. */
    float linear;
    if ((rc = read_rope_scaling(g, hp, &linear, err))) return rc;
    const pd_gguf_tensor *rf = pd_gguf_find_tensor(g, "rope_freqs.weight");
    if (rf || linear != 1.0f) {
        int64_t n = hp->rope.n_rot / 2;
        m->rope_freqs = malloc(sizeof(float) * (size_t)n);
        if (!m->rope_freqs) return pd_errorf(err, PD_ENOMEM, "out of memory");
        for (int64_t i = 0; i < n; i++) m->rope_freqs[i] = 1.0f;
        if (rf && (rc = load_vector(g, "rope_freqs.weight", n, false, m->rope_freqs, NULL, err))) return rc;
        for (int64_t i = 0; i < n; i++) m->rope_freqs[i] *= linear;
        hp->rope.freq_factors = m->rope_freqs;
    }
    hp->wtype = most_common_type(m);
    return PD_OK;
}

/* A device backend gets its copy of every matrix now, so upload time and
 * running out of device memory show at load, and of the 1-D tensors. */
static int place_on_backend(pd_model *m, pd_error *err) {
    pd_backend *be = m->backend;
    if (be->ops->host_memory) {
        m->dev_norms = m->norms;
        return PD_OK;
    }
    const size_t bytes = m->norms_len * sizeof(float);
    if (!(m->dev_norms = be->ops->alloc(be, bytes, err))) return PD_ENOMEM;
    int rc = be->ops->upload(be, m->dev_norms, m->norms, bytes, err);
    if (rc || !be->ops->prepare_weight) return rc;
    if ((rc = be->ops->prepare_weight(be, &m->tok_embd, err))) return rc;
    if (!m->hp.tied_output && (rc = be->ops->prepare_weight(be, &m->output, err))) return rc;
    for (int l = 0; l < m->hp.n_layer; l++) {
        const layer_weights *L = &m->layers[l];
        const pd_weight *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < sizeof ws / sizeof *ws; i++)
            if ((rc = be->ops->prepare_weight(be, ws[i], err))) return pd_error_prefix(err, "layer %d", l);
    }
    return be->ops->sync(be, err);
}

int pd_model_load(const char *path, const pd_model_params *params, pd_model **out, pd_error *err) {
    *out = NULL;
    pd_model *m = calloc(1, sizeof *m);
    if (!m) return pd_errorf(err, PD_ENOMEM, "out of memory loading a model");
    m->kv_type = params && params->kv_f32 ? PD_TYPE_F32 : PD_TYPE_F16;
    /* The CPU computes from the file's bytes: read them into huge-page
     * memory. A device backend uploads them, so a mapping is enough. */
    const bool host = !params || !params->backend || params->backend->ops->host_memory;
    const bool in_memory = host && !(params && params->mmap_weights);
    int rc = in_memory ? pd_gguf_load(path, &m->gguf, err) : pd_gguf_open(path, &m->gguf, err);
    if (!rc && (rc = read_hparams(m->gguf, &m->hp, err))) pd_error_prefix(err, "%s", path);
    if (!rc && (rc = pd_tokenizer_load(m->gguf, &m->tok, err))) pd_error_prefix(err, "%s: tokenizer", path);
    if (!rc && (rc = load_weights(m, err))) pd_error_prefix(err, "%s", path);
    if (!rc) {
        if (params && params->backend) {
            m->backend = params->backend;
        } else {
            rc = pd_backend_cpu_create(params ? params->n_threads : 0, &m->backend, err);
            m->owns_backend = rc == PD_OK;
        }
    }
    if (!rc && (rc = place_on_backend(m, err))) pd_error_prefix(err, "%s: %s backend", path, m->backend->ops->name);
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
        if (be->ops->forget_weight && m->layers) {
            be->ops->forget_weight(be, &m->tok_embd);
            if (!m->hp.tied_output) be->ops->forget_weight(be, &m->output);
            for (int l = 0; l < m->hp.n_layer; l++) {
                const layer_weights *L = &m->layers[l];
                const pd_weight *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
                for (size_t i = 0; i < sizeof ws / sizeof *ws; i++) be->ops->forget_weight(be, ws[i]);
            }
        }
        if (m->dev_norms != m->norms) m->backend->ops->release(m->backend, m->dev_norms);
        m->backend->ops->release(m->backend, m->scratch.dev);
    }
    free(m->scratch.host);
    if (m->owns_backend) pd_backend_free(m->backend);
    free(m->layers);
    free(m->norms);
    free(m->rope_freqs);
    pd_tokenizer_free(m->tok);
    pd_gguf_close(m->gguf);
    free(m);
}

const pd_hparams *pd_model_hparams(const pd_model *m) { return &m->hp; }
const pd_tokenizer *pd_model_tokenizer(const pd_model *m) { return m->tok; }
const pd_gguf *pd_model_gguf(const pd_model *m) { return m->gguf; }
pd_backend *pd_model_backend(const pd_model *m) { return m->backend; }
pd_type pd_model_kv_type(const pd_model *m) { return m->kv_type; }
void pd_model_fingerprint(const pd_model *m, uint8_t out[PD_SHA256_LEN]) { pd_gguf_fingerprint(m->gguf, out); }
