/* pd_tokenize: split special tokens out of the text, run the model
 * tokenizer on the text between them, add BOS/EOS.
 *
 * Special-token partition (llama.cpp's tokenizer_st_partition): for each
 * special token in turn, longest text first, every remaining text fragment
 * is split at each occurrence of the token's text. CONTROL and UNKNOWN
 * tokens take part only with parse_special; USER_DEFINED tokens always do.
 * Tokens marked LSTRIP/RSTRIP eat the ASCII whitespace before/after them. */
#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer_internal.h"

typedef struct frag {
    pd_token token; /* PD_TOKEN_NULL for raw text */
    size_t off, len;
} frag;

typedef struct frags {
    frag *v;
    size_t n, cap;
} frags;

static int frags_push(frags *f, pd_token token, size_t off, size_t len) {
    if (f->n == f->cap) {
        size_t cap = f->cap ? f->cap * 2 : 16;
        frag *v = realloc(f->v, cap * sizeof *v);
        if (!v) return PD_ENOMEM;
        f->v = v;
        f->cap = cap;
    }
    f->v[f->n++] = (frag){token, off, len};
    return PD_OK;
}

/* Mark which special texts occur anywhere in the text (one pass, a hash
 * probe per distinct special length at each plausible start), so the
 * partition below only scans for tokens that can match. */
static void find_present(const pd_tokenizer *t, const char *text, size_t len, uint8_t *present) {
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)text[i];
        if (!(t->special_first[c >> 3] & (1u << (c & 7)))) continue;
        for (uint32_t k = 0; k < t->n_special_lens; k++) {
            size_t L = t->special_lens[k];
            if (L > len - i) break;
            int32_t si = tk_special_lookup(t, text + i, L);
            if (si >= 0) present[si] = 1;
        }
    }
}

static int partition(const pd_tokenizer *t, const char *text, size_t len, bool parse_special,
                     frags *cur) {
    frags next = {0};
    int rc = PD_OK;
    if (len == 0) return PD_OK;
    if ((rc = frags_push(cur, PD_TOKEN_NULL, 0, len))) return rc;
    if (t->n_special == 0) return PD_OK;
    uint8_t *present = calloc(t->n_special, 1);
    if (!present) return PD_ENOMEM;
    find_present(t, text, len, present);

    for (uint32_t si = 0; si < t->n_special; si++) {
        if (!present[t->special_rep[si]]) continue;
        pd_token id = t->special[si];
        const tk_token *tok = &t->tokens[id];
        if (!parse_special && (tok->attr & (TK_ATTR_CONTROL | TK_ATTR_UNKNOWN))) continue;
        const char *needle = t->text + tok->off;
        size_t nl = tok->len;
        if (nl == 0) continue;

        next.n = 0;
        for (size_t i = 0; i < cur->n; i++) {
            frag f = cur->v[i];
            if (f.token != PD_TOKEN_NULL) {
                if ((rc = frags_push(&next, f.token, 0, 0))) goto done;
                continue;
            }
            size_t off = f.off, flen = f.len;
            for (;;) {
                const char *m = flen >= nl ? memmem(text + off, flen, needle, nl) : NULL;
                if (!m) {
                    if (flen > 0 && (rc = frags_push(&next, PD_TOKEN_NULL, off, flen))) goto done;
                    break;
                }
                size_t mpos = (size_t)(m - text);
                size_t left_len = mpos - off;
                if (tok->attr & TK_ATTR_LSTRIP)
                    while (left_len > 0 && isspace((unsigned char)text[off + left_len - 1])) left_len--;
                if (left_len > 0 && (rc = frags_push(&next, PD_TOKEN_NULL, off, left_len))) goto done;
                if ((rc = frags_push(&next, id, 0, 0))) goto done;
                size_t roff = mpos + nl, rlen = off + flen - roff;
                if (tok->attr & TK_ATTR_RSTRIP)
                    while (rlen > 0 && isspace((unsigned char)text[roff])) roff++, rlen--;
                off = roff;
                flen = rlen;
            }
        }
        frags tmp = *cur;
        *cur = next;
        next = tmp;
    }
done:
    free(next.v);
    free(present);
    return rc;
}

int pd_tokenize(const pd_tokenizer *t, const char *text, size_t len, pd_tokenize_opts opts,
                pd_token **out, size_t *n_out, pd_error *err) {
    if (!t || !out || !n_out) return pd_errorf(err, PD_EINVAL, "pd_tokenize: NULL argument");
    *out = NULL;
    *n_out = 0;
    if (!text && len) return pd_errorf(err, PD_EINVAL, "pd_tokenize: text is NULL but len is %zu", len);

    frags fr = {0};
    tk_ids ids = {0};
    tk_buf tmp = {0};
    int rc = partition(t, text, len, opts.parse_special, &fr);
    if (rc) goto fail;

    switch (t->kind) {
    case PD_VOCAB_SPM: {
        bool prev_special = true; /* the start counts as "after a special token" */
        if (opts.add_special && t->add_bos && t->bos != PD_TOKEN_NULL && (rc = tk_ids_push(&ids, t->bos)))
            goto fail;
        for (size_t i = 0; i < fr.n; i++) {
            if (fr.v[i].token != PD_TOKEN_NULL) {
                if ((rc = tk_ids_push(&ids, fr.v[i].token))) goto fail;
                prev_special = true;
                continue;
            }
            tmp.n = 0;
            if (t->add_space_prefix && prev_special && (rc = tk_buf_append(&tmp, " ", 1))) goto fail;
            if ((rc = tk_buf_append(&tmp, text + fr.v[i].off, fr.v[i].len))) goto fail;
            if ((rc = tk_spm_tokenize(t, tmp.p, tmp.n, &ids))) goto fail;
            prev_special = false;
        }
        if (opts.add_special && t->add_eos && t->eos != PD_TOKEN_NULL && (rc = tk_ids_push(&ids, t->eos)))
            goto fail;
        break;
    }
    case PD_VOCAB_BPE:
        if (opts.add_special && t->add_bos && t->bos != PD_TOKEN_NULL && (rc = tk_ids_push(&ids, t->bos)))
            goto fail;
        for (size_t i = 0; i < fr.n; i++) {
            if (fr.v[i].token != PD_TOKEN_NULL) {
                if ((rc = tk_ids_push(&ids, fr.v[i].token))) goto fail;
            } else if ((rc = tk_bpe_tokenize(t, text + fr.v[i].off, fr.v[i].len, &ids, err))) {
                goto fail_msg;
            }
        }
        if (opts.add_special && t->add_eos && t->eos != PD_TOKEN_NULL && (rc = tk_ids_push(&ids, t->eos)))
            goto fail;
        break;
    case PD_VOCAB_WPM:
        /* BERT: [CLS] ... [SEP] whenever special tokens are requested */
        if (opts.add_special && t->bos != PD_TOKEN_NULL && (rc = tk_ids_push(&ids, t->bos))) goto fail;
        for (size_t i = 0; i < fr.n; i++) {
            if (fr.v[i].token != PD_TOKEN_NULL) {
                if ((rc = tk_ids_push(&ids, fr.v[i].token))) goto fail;
            } else if ((rc = tk_wpm_tokenize(t, text + fr.v[i].off, fr.v[i].len, &ids))) {
                goto fail;
            }
        }
        if (opts.add_special && t->sep != PD_TOKEN_NULL && (rc = tk_ids_push(&ids, t->sep))) goto fail;
        break;
    }

    free(fr.v);
    free(tmp.p);
    *out = ids.v;
    *n_out = ids.n;
    return PD_OK;
fail:
    if (rc == PD_ENOMEM) pd_errorf(err, rc, "out of memory while tokenizing %zu bytes", len);
    else pd_errorf(err, rc, "tokenizing %zu bytes failed (%s)", len, pd_status_name(rc));
fail_msg:
    free(fr.v);
    free(tmp.p);
    free(ids.v);
    return rc;
}
