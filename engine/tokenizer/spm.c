/* SentencePiece-style BPE (tokenizer.ggml.model = "llama"), as llama.cpp's
 * llm_tokenizer_spm: split into UTF-8 characters, repeatedly merge the
 * adjacent pair whose concatenation is the highest-scoring token (ties: the
 * leftmost), then emit each symbol as a token or, failing that, as byte
 * tokens <0xXX>. The caller has already added the space prefix; here spaces
 * become U+2581. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer_internal.h"

static const char SPACE_MARK[] = "\xe2\x96\x81"; /* U+2581 */

/* llama.cpp's byte_to_token for SPM: "<0xXX>", else the byte itself as a
 * one-byte token. llama.cpp throws if neither exists; we fall back to UNK
 * and drop the byte if there is no UNK either. */
static pd_token byte_token(const pd_tokenizer *t, unsigned char b) {
    static const char hex[] = "0123456789ABCDEF";
    char buf[6] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'};
    pd_token id = tk_lookup(t, buf, 6);
    if (id != PD_TOKEN_NULL) return id;
    id = tk_lookup(t, (const char *)&b, 1);
    if (id != PD_TOKEN_NULL) return id;
    return t->unk;
}

static int try_add_bigram(const pd_tokenizer *t, const char *s, const tk_sym *sym, int32_t left,
                          int32_t right, tk_heap *heap) {
    if (left < 0 || right < 0) return PD_OK;
    uint32_t size = sym[left].n + sym[right].n;
    pd_token id = tk_lookup(t, s + sym[left].off, size);
    if (id == PD_TOKEN_NULL) return PD_OK;
    tk_bigram b = {-(double)t->tokens[id].score, left, right, size};
    return tk_heap_push(heap, b);
}

int tk_spm_tokenize(const pd_tokenizer *t, const char *text, size_t len, tk_ids *out) {
    if (len == 0) return PD_OK;
    /* escape spaces */
    size_t n_sp = 0;
    for (size_t i = 0; i < len; i++) n_sp += text[i] == ' ';
    size_t slen = len + 2 * n_sp;
    if (slen > UINT32_MAX) return PD_ERANGE;
    char *s = malloc(slen);
    tk_sym *sym = malloc(slen * sizeof *sym);
    tk_heap heap = {0};
    int rc = PD_ENOMEM;
    if (!s || !sym) goto done;
    for (size_t i = 0, o = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(s + o, SPACE_MARK, 3);
            o += 3;
        } else {
            s[o++] = text[i];
        }
    }

    /* one symbol per UTF-8 character (length from the lead byte) */
    int32_t n_sym = tk_split_symbols(s, slen, sym);

    for (int32_t i = 1; i < n_sym; i++)
        if ((rc = try_add_bigram(t, s, sym, i - 1, i, &heap))) goto done;

    while (heap.n) {
        tk_bigram b = tk_heap_pop(&heap);
        tk_sym *l = &sym[b.left], *r = &sym[b.right];
        if (l->n == 0 || r->n == 0 || l->n + r->n != b.size) continue; /* stale */
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0) sym[r->next].prev = b.left;
        if ((rc = try_add_bigram(t, s, sym, l->prev, b.left, &heap))) goto done;
        if ((rc = try_add_bigram(t, s, sym, b.left, l->next, &heap))) goto done;
    }

    /* Emit. Every merged symbol is a token by construction; a symbol that is
     * not (a single character missing from the vocab) falls back to bytes.
     * (llama.cpp's rev_merge resegmentation never triggers for the same
     * reason.) */
    for (int32_t i = 0; i != -1; i = sym[i].next) {
        pd_token id = tk_lookup(t, s + sym[i].off, sym[i].n);
        if (id != PD_TOKEN_NULL) {
            if ((rc = tk_ids_push(out, id))) goto done;
            continue;
        }
        for (uint32_t k = 0; k < sym[i].n; k++) {
            pd_token bid = byte_token(t, (unsigned char)s[sym[i].off + k]);
            if (bid != PD_TOKEN_NULL && (rc = tk_ids_push(out, bid))) goto done;
        }
    }
    rc = PD_OK;
done:
    free(s);
    free(sym);
    free(heap.v);
    return rc;
}
