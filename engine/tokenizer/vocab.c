/* Vocabulary loading from GGUF metadata (tokenizer.ggml.*), the text -> id
 * and merge-rank hash tables, and the public accessors.
 *
 * Defaults and fix-ups follow llama.cpp's llama_vocab::impl::load (commit
 * c392e509): per-model default special ids and add_bos/add_eos, per-pre
 * flags, control-looking tokens forced to CONTROL, the end-of-generation
 * set, and the phi-3 / jina strip attributes. */
#include <ctype.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer_internal.h"

/* ---- merge queue ------------------------------------------------------ */

static bool bigram_before(const tk_bigram *a, const tk_bigram *b) {
    return a->key < b->key || (a->key == b->key && a->left < b->left);
}

int tk_heap_push(tk_heap *h, tk_bigram b) {
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 64;
        tk_bigram *v = realloc(h->v, cap * sizeof *v);
        if (!v) return PD_ENOMEM;
        h->v = v;
        h->cap = cap;
    }
    size_t i = h->n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!bigram_before(&b, &h->v[p])) break;
        h->v[i] = h->v[p];
        i = p;
    }
    h->v[i] = b;
    return PD_OK;
}

tk_bigram tk_heap_pop(tk_heap *h) {
    tk_bigram top = h->v[0];
    tk_bigram last = h->v[--h->n];
    size_t i = 0, n = h->n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && bigram_before(&h->v[c + 1], &h->v[c])) c++;
        if (!bigram_before(&h->v[c], &last)) break;
        h->v[i] = h->v[c];
        i = c;
    }
    if (n) h->v[i] = last;
    return top;
}

/* ---- hashing ---------------------------------------------------------- */

uint64_t tk_hash_bytes(const void *p, size_t n) {
    const unsigned char *s = p;
    uint64_t h = 0xcbf29ce484222325ull ^ (n * 0x9E3779B97F4A7C15ull);
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 0x100000001b3ull;
    }
    /* murmur3 finalizer so the low bits (the slot index) are well mixed */
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return h;
}

static int table_init(tk_table *tb, uint64_t n_entries) {
    uint64_t cap = 16;
    while (cap < n_entries * 2) cap *= 2;
    tb->slots = calloc(cap, sizeof *tb->slots);
    if (!tb->slots) return PD_ENOMEM;
    tb->mask = cap - 1;
    return PD_OK;
}

pd_token tk_lookup(const pd_tokenizer *t, const char *s, size_t n) {
    uint64_t i = tk_hash_bytes(s, n) & t->vocab.mask;
    for (;;) {
        uint32_t e = t->vocab.slots[i];
        if (!e) return PD_TOKEN_NULL;
        const tk_token *tok = &t->tokens[e - 1];
        if (tok->len == n && memcmp(t->text + tok->off, s, n) == 0) return (pd_token)(e - 1);
        i = (i + 1) & t->vocab.mask;
    }
}

int32_t tk_special_lookup(const pd_tokenizer *t, const char *s, size_t n) {
    if (!t->n_special) return -1;
    uint64_t i = tk_hash_bytes(s, n) & t->special_map.mask;
    for (;;) {
        uint32_t e = t->special_map.slots[i];
        if (!e) return -1;
        const tk_token *tok = &t->tokens[t->special[e - 1]];
        if (tok->len == n && memcmp(t->text + tok->off, s, n) == 0) return (int32_t)(e - 1);
        i = (i + 1) & t->special_map.mask;
    }
}

static int build_special_index(pd_tokenizer *t) {
    uint32_t n = t->n_special;
    if (!n) return PD_OK;
    t->special_rep = malloc(n * sizeof *t->special_rep);
    t->special_lens = malloc(n * sizeof *t->special_lens);
    if (!t->special_rep || !t->special_lens || table_init(&t->special_map, n)) return PD_ENOMEM;
    for (uint32_t si = 0; si < n; si++) {
        const tk_token *tok = &t->tokens[t->special[si]];
        const char *s = t->text + tok->off;
        int32_t rep = tk_special_lookup(t, s, tok->len);
        if (rep < 0) {
            uint64_t i = tk_hash_bytes(s, tok->len) & t->special_map.mask;
            while (t->special_map.slots[i]) i = (i + 1) & t->special_map.mask;
            t->special_map.slots[i] = si + 1;
            rep = (int32_t)si;
        }
        t->special_rep[si] = (uint32_t)rep;
        if (tok->len) t->special_first[(unsigned char)s[0] >> 3] |= (uint8_t)(1u << (s[0] & 7));
        /* distinct lengths, kept sorted ascending (the list is sorted by
         * length descending, so each new length goes in front) */
        uint32_t L = tok->len;
        bool seen = false;
        for (uint32_t k = 0; k < t->n_special_lens; k++) seen |= t->special_lens[k] == L;
        if (!seen) {
            memmove(t->special_lens + 1, t->special_lens, t->n_special_lens * sizeof *t->special_lens);
            t->special_lens[0] = L;
            t->n_special_lens++;
        }
    }
    return PD_OK;
}

static uint64_t pair_hash(const char *l, size_t ln, const char *r, size_t rn) {
    return tk_hash_bytes(l, ln) * 0x9E3779B97F4A7C15ull ^ tk_hash_bytes(r, rn);
}

int32_t tk_merge_rank(const pd_tokenizer *t, const char *l, size_t ln, const char *r, size_t rn) {
    if (!t->n_merges) return -1;
    uint64_t i = pair_hash(l, ln, r, rn) & t->merge_map.mask;
    for (;;) {
        uint32_t e = t->merge_map.slots[i];
        if (!e) return -1;
        const tk_merge *m = &t->merges[e - 1];
        if (m->left_len == ln && m->right_len == rn &&
            memcmp(t->merge_text + m->left_off, l, ln) == 0 &&
            memcmp(t->merge_text + m->right_off, r, rn) == 0)
            return (int32_t)m->rank;
        i = (i + 1) & t->merge_map.mask;
    }
}

/* ---- metadata helpers ------------------------------------------------- */

#define KEY_PREFIX "tokenizer.ggml."

/* Optional bool: absent leaves *out unchanged; a wrong type is an error. */
static int opt_bool(const pd_gguf *g, const char *key, bool *out, bool *found, pd_error *err) {
    if (found) *found = false;
    const pd_gguf_value *v = pd_gguf_find(g, key);
    if (!v) return PD_OK;
    if (v->type != PD_GGUF_BOOL)
        return pd_errorf(err, PD_EFORMAT, "metadata '%s' has type %s, expected bool", key,
                         pd_gguf_vtype_name(v->type));
    *out = v->u != 0;
    if (found) *found = true;
    return PD_OK;
}

/* Optional token id: absent or out of range leaves *id unchanged (llama.cpp
 * warns and keeps its default); a non-integer type is an error. */
static int opt_id(const pd_gguf *g, const char *key, int32_t n_tokens, pd_token *id, pd_error *err) {
    const pd_gguf_value *v = pd_gguf_find(g, key);
    if (!v) return PD_OK;
    int64_t x;
    int rc = pd_gguf_get_i64(g, key, &x, err);
    if (rc) return rc;
    if (x >= 0 && x < n_tokens) *id = (pd_token)x;
    return PD_OK;
}

static bool str_eq(pd_str s, const char *lit) {
    size_t n = strlen(lit);
    return s.len == n && memcmp(s.ptr, lit, n) == 0;
}

/* ---- loading ---------------------------------------------------------- */

static void set_control(pd_tokenizer *t, pd_token id) {
    tk_token *tok = &t->tokens[id];
    if (!(tok->attr & TK_ATTR_CONTROL)) tok->attr = TK_ATTR_CONTROL;
}

/* llama.cpp detects EOT/EOM/FIM tokens by their text when the metadata does
 * not name them, and forces them to CONTROL. We take the first candidate
 * (in the listed order) present in the vocab. */
static void detect_by_text(pd_tokenizer *t, pd_token *slot, const char *const *names) {
    if (*slot != PD_TOKEN_NULL) return;
    for (size_t i = 0; names[i]; i++) {
        pd_token id = tk_lookup(t, names[i], strlen(names[i]));
        if (id != PD_TOKEN_NULL) {
            *slot = id;
            set_control(t, id);
            return;
        }
    }
}

static void apply_text_rules(pd_tokenizer *t) {
    static const char *const eot_names[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                                            "<|endoftext|>", "<EOT>",
                                            "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>",
                                            NULL};
    static const char *const eom_names[] = {"<|eom_id|>", NULL};
    static const char *const fim_pre_names[] = {"<|fim_prefix|>", "<fim-prefix>",
                                                "<\xef\xbd\x9c" "fim\xe2\x96\x81" "begin\xef\xbd\x9c>",
                                                "<PRE>", NULL};
    static const char *const fim_suf_names[] = {"<|fim_suffix|>", "<fim-suffix>",
                                                "<\xef\xbd\x9c" "fim\xe2\x96\x81hole\xef\xbd\x9c>",
                                                "<SUF>", NULL};
    static const char *const fim_mid_names[] = {"<|fim_middle|>", "<fim-middle>",
                                                "<\xef\xbd\x9c" "fim\xe2\x96\x81" "end\xef\xbd\x9c>",
                                                "<MID>", NULL};
    static const char *const fim_pad_names[] = {"<|fim_pad|>", "<fim-pad>", "<PAD>", NULL};
    static const char *const fim_rep_names[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
                                                "<REPO>", NULL};
    static const char *const fim_sep_names[] = {"<|file_sep|>", NULL};
    static const char *const eog_names[] = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                                            "<|endoftext|>", "<|eom_id|>", "<EOT>", NULL};

    detect_by_text(t, &t->eot, eot_names);
    detect_by_text(t, &t->eom, eom_names);
    detect_by_text(t, &t->fim_pre, fim_pre_names);
    detect_by_text(t, &t->fim_suf, fim_suf_names);
    detect_by_text(t, &t->fim_mid, fim_mid_names);
    detect_by_text(t, &t->fim_pad, fim_pad_names);
    detect_by_text(t, &t->fim_rep, fim_rep_names);
    detect_by_text(t, &t->fim_sep, fim_sep_names);

    /* end-of-generation set */
    const pd_token eog_ids[] = {t->fim_pad, t->fim_rep, t->fim_sep, t->eos, t->eot, t->eom};
    for (size_t i = 0; i < sizeof eog_ids / sizeof *eog_ids; i++)
        if (eog_ids[i] != PD_TOKEN_NULL) t->tokens[eog_ids[i]].eog = 1;
    for (size_t i = 0; eog_names[i]; i++) {
        pd_token id = tk_lookup(t, eog_names[i], strlen(eog_names[i]));
        if (id == PD_TOKEN_NULL) continue;
        t->tokens[id].eog = 1;
        set_control(t, id);
    }
}

/* Stable order for the special-token cache: longer text first, then lower
 * id (llama.cpp sorts by length only, with std::sort). */
static void sort_special(pd_tokenizer *t) {
    /* insertion-merge sort by (len desc, id asc) without globals */
    pd_token *a = t->special;
    size_t n = t->n_special;
    if (n < 2) return;
    pd_token *tmp = malloc(n * sizeof *tmp);
    if (!tmp) {
        /* fall back to insertion sort in place */
        for (size_t i = 1; i < n; i++) {
            pd_token x = a[i];
            size_t j = i;
            while (j > 0 && t->tokens[a[j - 1]].len < t->tokens[x].len) {
                a[j] = a[j - 1];
                j--;
            }
            a[j] = x;
        }
        return;
    }
    for (size_t w = 1; w < n; w *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * w) {
            size_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            size_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) {
                /* a[j] goes first only if strictly longer (keeps ids ascending) */
                if (t->tokens[a[j]].len > t->tokens[a[i]].len) tmp[k++] = a[j++];
                else tmp[k++] = a[i++];
            }
            while (i < mid) tmp[k++] = a[i++];
            while (j < hi) tmp[k++] = a[j++];
        }
        memcpy(a, tmp, n * sizeof *a);
    }
    free(tmp);
}

static void set_attr_by_text(pd_tokenizer *t, const char *text, uint16_t attr, bool on) {
    pd_token id = tk_lookup(t, text, strlen(text));
    if (id == PD_TOKEN_NULL) return;
    if (on) t->tokens[id].attr |= attr;
    else t->tokens[id].attr &= (uint16_t)~attr;
}

static bool contains_ci(pd_str hay, const char *needle) {
    size_t n = strlen(needle);
    if (hay.len < n) return false;
    for (size_t i = 0; i + n <= hay.len; i++) {
        size_t k = 0;
        while (k < n && tolower((unsigned char)hay.ptr[i + k]) == needle[k]) k++;
        if (k == n) return true;
    }
    return false;
}

static int load_tokens(pd_tokenizer *t, const pd_gguf *g, pd_error *err) {
    const pd_gguf_value *tokens;
    int rc = pd_gguf_get_arr(g, KEY_PREFIX "tokens", PD_GGUF_STRING, &tokens, err);
    if (rc == PD_ENOTFOUND)
        return pd_errorf(err, PD_EFORMAT, "GGUF has no " KEY_PREFIX "tokens: the file carries no vocabulary");
    if (rc) return rc;
    uint64_t n = tokens->arr.n;
    if (n == 0) return pd_errorf(err, PD_EFORMAT, KEY_PREFIX "tokens is empty");
    if (n > (uint64_t)INT32_MAX - 1)
        return pd_errorf(err, PD_ERANGE, KEY_PREFIX "tokens has %" PRIu64 " entries (max %d)", n,
                         INT32_MAX - 1);

    const pd_gguf_value *scores = pd_gguf_find(g, KEY_PREFIX "scores");
    if (scores) {
        if (scores->type != PD_GGUF_ARRAY || scores->arr.elem_type != PD_GGUF_FLOAT32)
            return pd_errorf(err, PD_EFORMAT, KEY_PREFIX "scores must be an array of float32");
        if (scores->arr.n != n)
            return pd_errorf(err, PD_EFORMAT,
                             KEY_PREFIX "scores has %" PRIu64 " entries but " KEY_PREFIX
                             "tokens has %" PRIu64,
                             scores->arr.n, n);
    }
    const pd_gguf_value *types = pd_gguf_find(g, KEY_PREFIX "token_type");
    if (types) {
        pd_gguf_vtype et = types->type == PD_GGUF_ARRAY ? types->arr.elem_type : PD_GGUF_STRING;
        bool is_int = et == PD_GGUF_INT8 || et == PD_GGUF_UINT8 || et == PD_GGUF_INT16 ||
                      et == PD_GGUF_UINT16 || et == PD_GGUF_INT32 || et == PD_GGUF_UINT32 ||
                      et == PD_GGUF_INT64 || et == PD_GGUF_UINT64;
        if (!is_int) return pd_errorf(err, PD_EFORMAT, KEY_PREFIX "token_type must be an array of integers");
        if (types->arr.n != n)
            return pd_errorf(err, PD_EFORMAT,
                             KEY_PREFIX "token_type has %" PRIu64 " entries but " KEY_PREFIX
                             "tokens has %" PRIu64,
                             types->arr.n, n);
    }

    /* text arena; empty tokens become "[EMPTY_<id>]" like llama.cpp */
    uint64_t total = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t len = tokens->arr.strs[i].len ? tokens->arr.strs[i].len : 32;
        total += len + 1;
        if (total > UINT32_MAX)
            return pd_errorf(err, PD_ERANGE, KEY_PREFIX "tokens: total text exceeds 4 GiB");
    }
    t->text = malloc(total);
    t->tokens = calloc(n, sizeof *t->tokens);
    if (!t->text || !t->tokens) return pd_errorf(err, PD_ENOMEM, "out of memory for %" PRIu64 " tokens", n);
    t->n_tokens = (int32_t)n;

    uint32_t off = 0;
    for (uint64_t i = 0; i < n; i++) {
        tk_token *tok = &t->tokens[i];
        pd_str s = tokens->arr.strs[i];
        tok->off = off;
        if (s.len == 0) {
            int w = snprintf(t->text + off, 32, "[EMPTY_%" PRIu64 "]", i);
            tok->len = (uint32_t)w;
        } else {
            memcpy(t->text + off, s.ptr, s.len);
            tok->len = (uint32_t)s.len;
        }
        t->text[off + tok->len] = '\0';
        off += tok->len + 1;
        if (tok->len > t->max_token_len) t->max_token_len = tok->len;

        tok->score = scores ? pd_gguf_arr_f32(scores, i) : 0.0f;
        tok->attr = TK_ATTR_NORMAL;
        tok->type = PD_TOKEN_TYPE_NORMAL;
        if (types) {
            int64_t ty = pd_gguf_arr_int(types, i);
            switch (ty) {
            case PD_TOKEN_TYPE_UNKNOWN: tok->attr = TK_ATTR_UNKNOWN; break;
            case PD_TOKEN_TYPE_UNUSED: tok->attr = TK_ATTR_UNUSED; break;
            case PD_TOKEN_TYPE_NORMAL: tok->attr = TK_ATTR_NORMAL; break;
            case PD_TOKEN_TYPE_CONTROL: tok->attr = TK_ATTR_CONTROL; break;
            case PD_TOKEN_TYPE_USER_DEFINED: tok->attr = TK_ATTR_USER_DEFINED; break;
            case PD_TOKEN_TYPE_BYTE: tok->attr = TK_ATTR_BYTE; break;
            default: tok->attr = TK_ATTR_UNDEFINED; break;
            }
            tok->type = (ty >= 0 && ty <= PD_TOKEN_TYPE_BYTE) ? (uint8_t)ty : PD_TOKEN_TYPE_UNDEFINED;
        }
    }

    if (table_init(&t->vocab, n)) return pd_errorf(err, PD_ENOMEM, "out of memory for the vocab table");
    for (uint64_t id = 0; id < n; id++) {
        const tk_token *tok = &t->tokens[id];
        uint64_t i = tk_hash_bytes(t->text + tok->off, tok->len) & t->vocab.mask;
        for (;;) {
            uint32_t e = t->vocab.slots[i];
            if (!e) {
                t->vocab.slots[i] = (uint32_t)id + 1;
                break;
            }
            const tk_token *o = &t->tokens[e - 1];
            if (o->len == tok->len && memcmp(t->text + o->off, t->text + tok->off, tok->len) == 0) {
                t->vocab.slots[i] = (uint32_t)id + 1; /* last one wins */
                break;
            }
            i = (i + 1) & t->vocab.mask;
        }
    }
    return PD_OK;
}

static int load_merges(pd_tokenizer *t, const pd_gguf *g, pd_error *err) {
    const pd_gguf_value *m;
    int rc = pd_gguf_get_arr(g, KEY_PREFIX "merges", PD_GGUF_STRING, &m, err);
    if (rc == PD_ENOTFOUND)
        return pd_errorf(err, PD_EFORMAT,
                         "tokenizer.ggml.model is gpt2 but " KEY_PREFIX "merges is missing");
    if (rc) return rc;
    uint64_t n = m->arr.n;
    if (n > UINT32_MAX / 2) return pd_errorf(err, PD_ERANGE, KEY_PREFIX "merges has too many entries");
    uint64_t total = 0;
    for (uint64_t i = 0; i < n; i++) {
        total += m->arr.strs[i].len;
        if (total > UINT32_MAX) return pd_errorf(err, PD_ERANGE, KEY_PREFIX "merges: text exceeds 4 GiB");
    }
    t->merges = calloc(n ? n : 1, sizeof *t->merges);
    t->merge_text = malloc(total ? total : 1);
    if (!t->merges || !t->merge_text || table_init(&t->merge_map, n))
        return pd_errorf(err, PD_ENOMEM, "out of memory for %" PRIu64 " merges", n);

    uint32_t off = 0, count = 0;
    for (uint64_t i = 0; i < n; i++) {
        pd_str s = m->arr.strs[i];
        /* llama.cpp splits at the first space after position 0; an entry
         * without one becomes ("", ""). */
        size_t pos = 0;
        bool found = false;
        for (size_t k = 1; k < s.len; k++)
            if (s.ptr[k] == ' ') {
                pos = k;
                found = true;
                break;
            }
        tk_merge me = {0};
        me.rank = (uint32_t)i;
        memcpy(t->merge_text + off, s.ptr, s.len);
        if (found) {
            me.left_off = off;
            me.left_len = (uint32_t)pos;
            me.right_off = off + (uint32_t)pos + 1;
            me.right_len = (uint32_t)(s.len - pos - 1);
        } else {
            me.left_off = me.right_off = off;
        }
        off += (uint32_t)s.len;

        const char *l = t->merge_text + me.left_off, *r = t->merge_text + me.right_off;
        uint64_t h = pair_hash(l, me.left_len, r, me.right_len) & t->merge_map.mask;
        bool dup = false;
        for (;;) {
            uint32_t e = t->merge_map.slots[h];
            if (!e) break;
            const tk_merge *o = &t->merges[e - 1];
            if (o->left_len == me.left_len && o->right_len == me.right_len &&
                memcmp(t->merge_text + o->left_off, l, me.left_len) == 0 &&
                memcmp(t->merge_text + o->right_off, r, me.right_len) == 0) {
                dup = true; /* first occurrence keeps its rank */
                break;
            }
            h = (h + 1) & t->merge_map.mask;
        }
        if (dup) continue;
        t->merges[count] = me;
        t->merge_map.slots[h] = ++count;
    }
    t->n_merges = count;
    return PD_OK;
}

int pd_tokenizer_load(const pd_gguf *g, pd_tokenizer **out, pd_error *err) {
    if (!g || !out) return pd_errorf(err, PD_EINVAL, "pd_tokenizer_load: NULL argument");
    *out = NULL;
    pd_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return pd_errorf(err, PD_ENOMEM, "out of memory for the tokenizer");
    int rc;

    pd_str model;
    rc = pd_gguf_get_str(g, KEY_PREFIX "model", &model, err);
    if (rc == PD_ENOTFOUND) {
        rc = pd_errorf(err, PD_EFORMAT,
                       "GGUF has no " KEY_PREFIX "model: the file carries no tokenizer");
        goto fail;
    }
    if (rc) goto fail;

    pd_str pre = {"", 0};
    const pd_gguf_value *prev = pd_gguf_find(g, KEY_PREFIX "pre");
    if (prev) {
        if ((rc = pd_gguf_get_str(g, KEY_PREFIX "pre", &pre, err))) goto fail;
    }

    /* per-model defaults (llama.cpp) */
    t->eot = t->eom = t->sep = t->pad = t->mask = PD_TOKEN_NULL;
    t->fim_pre = t->fim_suf = t->fim_mid = t->fim_pad = t->fim_rep = t->fim_sep = PD_TOKEN_NULL;
    t->pre = TK_PRE_DEFAULT;
    snprintf(t->pre_name, sizeof t->pre_name, "default");
    bool no_bos = false;
    if (str_eq(model, "llama")) {
        t->kind = PD_VOCAB_SPM;
        t->bos = 1, t->eos = 2, t->unk = 0;
        t->add_space_prefix = true;
        t->add_bos = true;
    } else if (str_eq(model, "gpt2")) {
        t->kind = PD_VOCAB_BPE;
        t->bos = 11, t->eos = 11, t->unk = PD_TOKEN_NULL;
        t->clean_spaces = true;
        tk_pre_info info;
        if (pre.len == 0) {
            tk_pre_find("default", 7, &info);
        } else if (!tk_pre_find(pre.ptr, pre.len, &info)) {
            rc = pd_errorf(err, PD_EUNSUPPORTED,
                           KEY_PREFIX "pre = '%.*s' is not a supported pre-tokenizer (supported: %s)",
                           (int)(pre.len > 64 ? 64 : pre.len), pre.ptr, tk_pre_supported());
            goto fail;
        }
        t->pre = info.pre;
        snprintf(t->pre_name, sizeof t->pre_name, "%s", info.canonical);
        if (!info.clean_spaces) t->clean_spaces = false;
        t->ignore_merges = info.ignore_merges;
        if (info.add_bos) t->add_bos = true;
        no_bos = info.no_bos;
    } else if (str_eq(model, "bert")) {
        t->kind = PD_VOCAB_WPM;
        t->bos = 101, t->eos = PD_TOKEN_NULL, t->unk = 100, t->sep = 102, t->pad = 0, t->mask = 103;
        t->clean_spaces = true;
        t->add_bos = true;
    } else {
        rc = pd_errorf(err, PD_EUNSUPPORTED,
                       KEY_PREFIX "model = '%.*s' is not supported (supported: llama (SentencePiece), "
                       "gpt2 (byte-level BPE), bert (WordPiece))",
                       (int)(model.len > 64 ? 64 : model.len), model.ptr);
        goto fail;
    }
    if ((rc = opt_bool(g, KEY_PREFIX "add_space_prefix", &t->add_space_prefix, NULL, err))) goto fail;

    if ((rc = load_tokens(t, g, err))) goto fail;
    if (t->kind == PD_VOCAB_BPE && (rc = load_merges(t, g, err))) goto fail;

    /* defaults that do not fit this vocab are dropped */
    pd_token *defaults[] = {&t->bos, &t->eos, &t->unk, &t->sep, &t->pad, &t->mask};
    for (size_t i = 0; i < sizeof defaults / sizeof *defaults; i++)
        if (*defaults[i] >= t->n_tokens) *defaults[i] = PD_TOKEN_NULL;
    if (no_bos) t->bos = PD_TOKEN_NULL;

    {
        struct {
            const char *key;
            pd_token *id;
        } ids[] = {
            {KEY_PREFIX "cls_token_id", &t->bos}, /* older BERT conversions; bos_token_id wins */
            {KEY_PREFIX "bos_token_id", &t->bos},
            {KEY_PREFIX "eos_token_id", &t->eos},
            {KEY_PREFIX "eot_token_id", &t->eot},
            {KEY_PREFIX "eom_token_id", &t->eom},
            {KEY_PREFIX "unknown_token_id", &t->unk},
            {KEY_PREFIX "seperator_token_id", &t->sep}, /* sic, as llama.cpp writes it */
            {KEY_PREFIX "padding_token_id", &t->pad},
            {KEY_PREFIX "mask_token_id", &t->mask},
            {KEY_PREFIX "fim_pre_token_id", &t->fim_pre},
            {KEY_PREFIX "fim_suf_token_id", &t->fim_suf},
            {KEY_PREFIX "fim_mid_token_id", &t->fim_mid},
            {KEY_PREFIX "fim_pad_token_id", &t->fim_pad},
            {KEY_PREFIX "fim_rep_token_id", &t->fim_rep},
            {KEY_PREFIX "fim_sep_token_id", &t->fim_sep},
            {KEY_PREFIX "prefix_token_id", &t->fim_pre},
            {KEY_PREFIX "suffix_token_id", &t->fim_suf},
            {KEY_PREFIX "middle_token_id", &t->fim_mid},
        };
        for (size_t i = 0; i < sizeof ids / sizeof *ids; i++)
            if ((rc = opt_id(g, ids[i].key, t->n_tokens, ids[i].id, err))) goto fail;
    }
    if ((rc = opt_bool(g, KEY_PREFIX "add_bos_token", &t->add_bos, NULL, err))) goto fail;
    if ((rc = opt_bool(g, KEY_PREFIX "add_eos_token", &t->add_eos, NULL, err))) goto fail;

    apply_text_rules(t);

    /* special-token cache */
    t->special = malloc((size_t)t->n_tokens * sizeof *t->special);
    if (!t->special) {
        rc = pd_errorf(err, PD_ENOMEM, "out of memory");
        goto fail;
    }
    for (int32_t id = 0; id < t->n_tokens; id++)
        if (t->tokens[id].attr & (TK_ATTR_CONTROL | TK_ATTR_USER_DEFINED | TK_ATTR_UNKNOWN))
            t->special[t->n_special++] = id;
    sort_special(t);

    /* per-model strip attributes (llama.cpp keys them on names) */
    {
        pd_str name = {"", 0};
        const pd_gguf_value *nv = pd_gguf_find(g, "general.name");
        if (nv && nv->type == PD_GGUF_STRING) name = nv->str;
        if (contains_ci(pre, "jina-v2-de") || contains_ci(pre, "jina-v2-es") ||
            contains_ci(pre, "jina-v2-code")) {
            set_attr_by_text(t, "<mask>", TK_ATTR_LSTRIP, true);
        } else if (contains_ci(name, "phi-3") || contains_ci(name, "phi3")) {
            for (uint32_t i = 0; i < t->n_special; i++) t->tokens[t->special[i]].attr |= TK_ATTR_RSTRIP;
            set_attr_by_text(t, "</s>", TK_ATTR_RSTRIP, true);
            set_attr_by_text(t, "<unk>", TK_ATTR_RSTRIP, false);
            set_attr_by_text(t, "<s>", TK_ATTR_RSTRIP, false);
            set_attr_by_text(t, "<|endoftext|>", TK_ATTR_RSTRIP, false);
        }
    }

    if (build_special_index(t)) {
        rc = pd_errorf(err, PD_ENOMEM, "out of memory for the special-token index");
        goto fail;
    }
    if ((rc = tk_build_pieces(t, err))) goto fail;
    if (t->kind == PD_VOCAB_BPE && (rc = tk_pre_compile(t, err))) goto fail;

    *out = t;
    return PD_OK;
fail:
    pd_tokenizer_free(t);
    return rc;
}

void pd_tokenizer_free(pd_tokenizer *t) {
    if (!t) return;
    tk_pre_free(t);
    free(t->tokens);
    free(t->text);
    free(t->pieces);
    free(t->vocab.slots);
    free(t->merges);
    free(t->merge_text);
    free(t->merge_map.slots);
    free(t->special);
    free(t->special_rep);
    free(t->special_lens);
    free(t->special_map.slots);
    free(t);
}

/* ---- accessors -------------------------------------------------------- */

pd_vocab_kind pd_tokenizer_kind(const pd_tokenizer *t) { return t->kind; }
const char *pd_tokenizer_pre(const pd_tokenizer *t) { return t->pre_name; }
int32_t pd_tokenizer_n_vocab(const pd_tokenizer *t) { return t->n_tokens; }
pd_token pd_tokenizer_bos(const pd_tokenizer *t) { return t->bos; }
pd_token pd_tokenizer_eos(const pd_tokenizer *t) { return t->eos; }
pd_token pd_tokenizer_eot(const pd_tokenizer *t) { return t->eot; }
bool pd_tokenizer_add_bos(const pd_tokenizer *t) { return t->add_bos; }
bool pd_tokenizer_add_eos(const pd_tokenizer *t) { return t->add_eos; }

bool pd_tokenizer_is_eog(const pd_tokenizer *t, pd_token id) {
    return id >= 0 && id < t->n_tokens && t->tokens[id].eog;
}

const char *pd_tokenizer_token_text(const pd_tokenizer *t, pd_token id) {
    if (id < 0 || id >= t->n_tokens) return NULL;
    return tk_text(t, id);
}

pd_token_type pd_tokenizer_token_type(const pd_tokenizer *t, pd_token id) {
    if (id < 0 || id >= t->n_tokens) return PD_TOKEN_TYPE_UNDEFINED;
    const tk_token *tok = &t->tokens[id];
    /* report the effective type (control-looking tokens were promoted) */
    if (tok->attr & TK_ATTR_CONTROL) return PD_TOKEN_TYPE_CONTROL;
    return (pd_token_type)tok->type;
}

pd_token pd_tokenizer_find(const pd_tokenizer *t, const char *text, size_t len) {
    if (!text) return PD_TOKEN_NULL;
    return tk_lookup(t, text, len);
}
