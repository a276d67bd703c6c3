/* Byte-level BPE (tokenizer.ggml.model = "gpt2"), as llama.cpp's
 * llm_tokenizer_bpe: pre-tokenize with the regex list of tokenizer.ggml.pre,
 * map each word's bytes to GPT-2's printable code points, then merge the
 * adjacent pair with the lowest merge rank (ties: the leftmost) until no
 * ranked pair is left. With ignore_merges (llama3), a word that is already a
 * token is emitted whole. A final symbol that is not a token is emitted byte
 * by byte where single bytes are tokens (llama.cpp's fallback). */
#include <stdlib.h>
#include <string.h>

#include "tokenizer_internal.h"

typedef struct bpe_work {
    tk_buf word; /* byte-encoded word */
    tk_sym *sym;
    size_t sym_cap;
    tk_heap heap;
} bpe_work;

static int add_bigram(const pd_tokenizer *t, bpe_work *w, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return PD_OK;
    const tk_sym *l = &w->sym[left], *r = &w->sym[right];
    int32_t rank = tk_merge_rank(t, w->word.p + l->off, l->n, w->word.p + r->off, r->n);
    if (rank < 0) return PD_OK;
    tk_bigram b = {(double)rank, left, right, l->n + r->n};
    return tk_heap_push(&w->heap, b);
}

static int emit_symbol(const pd_tokenizer *t, const char *s, size_t n, tk_ids *out) {
    pd_token id = tk_lookup(t, s, n);
    if (id != PD_TOKEN_NULL) return tk_ids_push(out, id);
    for (size_t j = 0; j < n; j++) {
        pd_token b = tk_lookup(t, s + j, 1);
        if (b != PD_TOKEN_NULL && tk_ids_push(out, b)) return PD_ENOMEM;
    }
    return PD_OK;
}

static int bpe_word(const pd_tokenizer *t, bpe_work *w, const char *src, size_t len, tk_ids *out) {
    /* byte-level encoding */
    w->word.n = 0;
    if (tk_buf_reserve(&w->word, len * 2)) return PD_ENOMEM;
    for (size_t i = 0; i < len; i++) {
        char enc[4];
        size_t el = tk_utf8_encode(tk_byte_to_cp((uint8_t)src[i]), enc);
        memcpy(w->word.p + w->word.n, enc, el);
        w->word.n += el;
    }
    const char *s = w->word.p;
    size_t slen = w->word.n;
    if (slen > UINT32_MAX) return PD_ERANGE;

    if (t->ignore_merges) {
        pd_token id = tk_lookup(t, s, slen);
        if (id != PD_TOKEN_NULL) return tk_ids_push(out, id);
    }

    if (slen > w->sym_cap) {
        tk_sym *v = realloc(w->sym, slen * sizeof *v);
        if (!v) return PD_ENOMEM;
        w->sym = v;
        w->sym_cap = slen;
    }
    tk_sym *sym = w->sym;
    int32_t n_sym = tk_split_symbols(s, slen, sym);

    w->heap.n = 0;
    int rc;
    for (int32_t i = 1; i < n_sym; i++)
        if ((rc = add_bigram(t, w, i - 1, i))) return rc;

    while (w->heap.n) {
        tk_bigram b = tk_heap_pop(&w->heap);
        tk_sym *l = &sym[b.left], *r = &sym[b.right];
        /* outdated: one side was merged away or grew since it was queued */
        if (l->n == 0 || r->n == 0 || l->n + r->n != b.size) continue;
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) sym[r->next].prev = b.left;
        if ((rc = add_bigram(t, w, l->prev, b.left))) return rc;
        if ((rc = add_bigram(t, w, b.left, l->next))) return rc;
    }

    for (int32_t i = 0; i < n_sym; i++) {
        if (sym[i].n == 0) continue;
        if ((rc = emit_symbol(t, s + sym[i].off, sym[i].n, out))) return rc;
    }
    return PD_OK;
}

int tk_bpe_tokenize(const pd_tokenizer *t, const char *text, size_t len, tk_ids *out, pd_error *err) {
    size_t *spans = NULL, n_spans = 0;
    int rc = tk_pre_split(t, text, len, &spans, &n_spans, err);
    if (rc) return rc;
    bpe_work w = {0};
    for (size_t i = 0; i < n_spans && rc == PD_OK; i++)
        rc = bpe_word(t, &w, text + spans[2 * i], spans[2 * i + 1], out);
    if (rc == PD_ENOMEM) pd_errorf(err, rc, "out of memory while tokenizing");
    else if (rc) pd_errorf(err, rc, "a pre-tokenized word is too long (over 4 GiB)");
    free(spans);
    free(w.word.p);
    free(w.sym);
    free(w.heap.v);
    return rc;
}
