/* grammar: the vocabulary as the matcher needs it: each token's bytes and
 * kind, and a byte trie of the PD_GTOK_BYTES pieces so a state's allowed
 * tokens are found in one walk that shares every common prefix. */
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_internal.h"

typedef struct trie_build {
    pd_grammar_vocab *v;
    uint32_t cap_nodes;
} trie_build;

static int cmp_piece(const void *x, const void *y, void *ctx) {
    const pd_grammar_vocab *v = ctx;
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    uint32_t la = v->lens[a], lb = v->lens[b];
    int c = memcmp(v->bytes + v->offs[a], v->bytes + v->offs[b], la < lb ? la : lb);
    if (c) return c;
    if (la != lb) return la < lb ? -1 : 1;
    return a < b ? -1 : a > b;
}

/* Children of node for sorted tokens [lo, hi), all sharing `depth` bytes. */
static int build_node(trie_build *tb, uint32_t node, uint32_t lo, uint32_t hi, uint32_t depth) {
    pd_grammar_vocab *v = tb->v;
    uint32_t i = lo;
    while (i < hi && v->lens[v->sorted_tokens[i]] == depth) i++;
    v->nodes[node].tok_off = lo;
    v->nodes[node].n_tok = i - lo;
    /* count the distinct next bytes */
    uint32_t n_child = 0;
    for (uint32_t k = i; k < hi;) {
        uint8_t b = (uint8_t)v->bytes[v->offs[v->sorted_tokens[k]] + depth];
        while (k < hi && (uint8_t)v->bytes[v->offs[v->sorted_tokens[k]] + depth] == b) k++;
        n_child++;
    }
    uint32_t first = v->n_nodes;
    if (first + n_child > tb->cap_nodes) return PD_ENOMEM; /* cap is the total piece bytes + 1: never */
    v->n_nodes += n_child;
    v->nodes[node].child_off = first;
    v->nodes[node].n_child = (uint16_t)n_child;
    uint32_t c = first;
    for (uint32_t k = i; k < hi; c++) {
        uint8_t b = (uint8_t)v->bytes[v->offs[v->sorted_tokens[k]] + depth];
        uint32_t start = k;
        while (k < hi && (uint8_t)v->bytes[v->offs[v->sorted_tokens[k]] + depth] == b) k++;
        memset(&v->nodes[c], 0, sizeof v->nodes[c]);
        v->nodes[c].byte = b;
        int rc = build_node(tb, c, start, k, depth + 1);
        if (rc) return rc;
    }
    return PD_OK;
}

void pd_grammar_vocab_free(pd_grammar_vocab *v) {
    if (!v) return;
    free(v->kinds);
    free(v->offs);
    free(v->lens);
    free(v->bytes);
    free(v->nodes);
    free(v->sorted_tokens);
    free(v->eog);
    free(v);
}

int32_t pd_grammar_vocab_size(const pd_grammar_vocab *v) {
    return v->n_vocab;
}

int pd_grammar_vocab_create(int32_t n_vocab, const char *const *pieces, const uint32_t *lens, const uint8_t *kinds,
                            pd_grammar_vocab **out, pd_error *err) {
    *out = NULL;
    if (n_vocab <= 0 || !pieces || !lens || !kinds)
        return pd_errorf(err, PD_EINVAL, "grammar vocabulary: %d tokens, or no pieces/lengths/kinds", n_vocab);
    pd_grammar_vocab *v = calloc(1, sizeof *v);
    if (!v) goto nomem;
    v->n_vocab = n_vocab;
    size_t total = 0;
    for (int32_t i = 0; i < n_vocab; i++) {
        if (kinds[i] > PD_GTOK_EOG) {
            pd_grammar_vocab_free(v);
            return pd_errorf(err, PD_EINVAL, "grammar vocabulary: token %d has kind %u (0 bytes, 1 special, 2 EOG)", i,
                             kinds[i]);
        }
        if (lens[i] && !pieces[i]) {
            pd_grammar_vocab_free(v);
            return pd_errorf(err, PD_EINVAL, "grammar vocabulary: token %d has %u bytes but no piece", i, lens[i]);
        }
        total += lens[i];
    }
    v->kinds = malloc((size_t)n_vocab);
    v->offs = malloc((size_t)n_vocab * sizeof *v->offs);
    v->lens = malloc((size_t)n_vocab * sizeof *v->lens);
    v->bytes = malloc(total + 1);
    v->sorted_tokens = malloc((size_t)n_vocab * sizeof *v->sorted_tokens);
    if (!v->kinds || !v->offs || !v->lens || !v->bytes || !v->sorted_tokens) goto nomem;
    if (total > UINT32_MAX) {
        pd_grammar_vocab_free(v);
        return pd_errorf(err, PD_ERANGE, "grammar vocabulary: %zu bytes of pieces (at most 4 GiB)", total);
    }
    memcpy(v->kinds, kinds, (size_t)n_vocab);
    size_t at = 0;
    int32_t n_bytes_tokens = 0;
    for (int32_t i = 0; i < n_vocab; i++) {
        v->offs[i] = (uint32_t)at;
        v->lens[i] = lens[i];
        if (lens[i]) memcpy(v->bytes + at, pieces[i], lens[i]);
        at += lens[i];
        if (kinds[i] == PD_GTOK_BYTES && lens[i] > 0) v->sorted_tokens[n_bytes_tokens++] = i;
        if (kinds[i] == PD_GTOK_EOG) v->n_eog++;
    }
    v->eog = malloc((size_t)(v->n_eog ? v->n_eog : 1) * sizeof *v->eog);
    if (!v->eog) goto nomem;
    for (int32_t i = 0, k = 0; i < n_vocab; i++)
        if (kinds[i] == PD_GTOK_EOG) v->eog[k++] = i;
    qsort_r(v->sorted_tokens, (size_t)n_bytes_tokens, sizeof *v->sorted_tokens, cmp_piece, v);
    trie_build tb = {.v = v, .cap_nodes = (uint32_t)total + 1};
    v->nodes = malloc((size_t)tb.cap_nodes * sizeof *v->nodes);
    if (!v->nodes) goto nomem;
    memset(&v->nodes[0], 0, sizeof v->nodes[0]);
    v->n_nodes = 1;
    if (build_node(&tb, 0, 0, (uint32_t)n_bytes_tokens, 0)) goto nomem;
    /* the cache key: a hash of the whole content */
    pd_sha256 h;
    int rc = pd_sha256_init(&h, err);
    if (rc) {
        pd_grammar_vocab_free(v);
        return rc;
    }
    pd_sha256_update(&h, &n_vocab, sizeof n_vocab);
    pd_sha256_update(&h, v->kinds, (size_t)n_vocab);
    pd_sha256_update(&h, v->lens, (size_t)n_vocab * sizeof *v->lens);
    pd_sha256_update(&h, v->bytes, total);
    uint8_t d[PD_SHA256_LEN];
    pd_sha256_final(&h, d);
    memcpy(&v->id, d, sizeof v->id);
    *out = v;
    return PD_OK;
nomem:
    pd_grammar_vocab_free(v);
    return pd_errorf(err, PD_ENOMEM, "grammar vocabulary: out of memory for %d tokens", n_vocab);
}
