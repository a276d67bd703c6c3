/* The tokenizers' growable outputs (token ids, bytes), used by every stage:
 * their own file so that the stages do not use each other for them. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer_internal.h"

int tk_ids_push(tk_ids *ids, pd_token id) {
    if (ids->n == ids->cap) {
        size_t cap = ids->cap ? ids->cap * 2 : 64;
        pd_token *v = realloc(ids->v, cap * sizeof *v);
        if (!v) return PD_ENOMEM;
        ids->v = v;
        ids->cap = cap;
    }
    ids->v[ids->n++] = id;
    return PD_OK;
}

int tk_buf_reserve(tk_buf *b, size_t extra) {
    if (b->n + extra <= b->cap) return PD_OK;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + extra) {
        if (cap > SIZE_MAX / 2) return PD_ENOMEM;
        cap *= 2;
    }
    char *p = realloc(b->p, cap);
    if (!p) return PD_ENOMEM;
    b->p = p;
    b->cap = cap;
    return PD_OK;
}

int tk_buf_append(tk_buf *b, const void *data, size_t n) {
    if (tk_buf_reserve(b, n)) return PD_ENOMEM;
    if (n) memcpy(b->p + b->n, data, n);
    b->n += n;
    return PD_OK;
}

