/* Token -> bytes, as llama.cpp's token_to_piece / detokenize.
 *
 * Pieces are computed once at load (llama.cpp's cache_token_to_piece):
 *   CONTROL, UNKNOWN, USER_DEFINED: the token text as is;
 *   SPM/WPM NORMAL: the text with U+2581 turned into spaces;
 *   SPM BYTE "<0xXX>": that byte;
 *   BPE NORMAL: the text mapped back through GPT-2's byte table;
 *   anything else (UNUSED, UNDEFINED, BPE BYTE): nothing.
 * CONTROL and UNKNOWN pieces are only output when `special` is set. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer_internal.h"

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

static int piece_of(const pd_tokenizer *t, pd_token id, tk_buf *b) {
    const tk_token *tok = &t->tokens[id];
    const char *s = tk_text(t, id);
    size_t n = tok->len;
    if (tok->attr & (TK_ATTR_UNKNOWN | TK_ATTR_CONTROL | TK_ATTR_USER_DEFINED)) return tk_buf_append(b, s, n);

    if (t->kind == PD_VOCAB_BPE) {
        if (!(tok->attr & TK_ATTR_NORMAL)) return PD_OK;
        const unsigned char *u = (const unsigned char *)s;
        for (size_t i = 0; i < n;) {
            size_t at = i;
            int32_t cp = tk_utf8_decode(u, n, &i);
            int byte = cp < 0 ? -1 : tk_cp_to_byte((uint32_t)cp);
            if (byte >= 0) {
                char c = (char)byte;
                if (tk_buf_append(b, &c, 1)) return PD_ENOMEM;
                continue;
            }
            /* llama.cpp's llama_decode_text marks what it cannot map */
            char hex[16];
            if (tk_buf_append(b, "[UNK_BYTE_0x", 12)) return PD_ENOMEM;
            for (size_t k = at; k < i; k++) {
                snprintf(hex, sizeof hex, "%02x", u[k]);
                if (tk_buf_append(b, hex, 2)) return PD_ENOMEM;
            }
            if (tk_buf_append(b, s, n) || tk_buf_append(b, "]", 1)) return PD_ENOMEM;
        }
        return PD_OK;
    }

    /* SPM and WPM */
    if (tok->attr & TK_ATTR_NORMAL) {
        for (size_t i = 0; i < n;) {
            if (i + 3 <= n && memcmp(s + i, "\xe2\x96\x81", 3) == 0) {
                if (tk_buf_append(b, " ", 1)) return PD_ENOMEM;
                i += 3;
            } else {
                if (tk_buf_append(b, s + i, 1)) return PD_ENOMEM;
                i++;
            }
        }
        return PD_OK;
    }
    if (tok->attr & TK_ATTR_BYTE) {
        if (n == 6 && s[0] == '<' && s[1] == '0' && s[2] == 'x' && s[5] == '>') {
            int hi = hexval(s[3]), lo = hexval(s[4]);
            if (hi >= 0 && lo >= 0) {
                char c = (char)(hi * 16 + lo);
                return tk_buf_append(b, &c, 1);
            }
        }
        return tk_buf_append(b, s, n); /* malformed byte token: show its text */
    }
    return PD_OK;
}

int tk_build_pieces(pd_tokenizer *t, pd_error *err) {
    tk_buf b = {0};
    for (int32_t id = 0; id < t->n_tokens; id++) {
        size_t start = b.n;
        if (piece_of(t, id, &b)) {
            free(b.p);
            return pd_errorf(err, PD_ENOMEM, "out of memory for the token pieces");
        }
        if (b.n > UINT32_MAX) {
            free(b.p);
            return pd_errorf(err, PD_ERANGE, "decoded vocabulary exceeds 4 GiB");
        }
        t->tokens[id].piece_off = (uint32_t)start;
        t->tokens[id].piece_len = (uint32_t)(b.n - start);
    }
    t->pieces = b.p ? b.p : malloc(1);
    if (!t->pieces) return pd_errorf(err, PD_ENOMEM, "out of memory");
    return PD_OK;
}

/* Piece bytes for id, or NULL/0 when suppressed. */
static const char *piece(const pd_tokenizer *t, pd_token id, bool special, size_t *n) {
    const tk_token *tok = &t->tokens[id];
    if (!special && (tok->attr & (TK_ATTR_UNKNOWN | TK_ATTR_CONTROL))) {
        *n = 0;
        return NULL;
    }
    *n = tok->piece_len;
    return t->pieces + tok->piece_off;
}

int pd_token_to_piece(const pd_tokenizer *t, pd_token id, bool special, char *buf, size_t cap) {
    if (!t || id < 0 || id >= t->n_tokens) return PD_EINVAL;
    size_t n;
    const char *p = piece(t, id, special, &n);
    if (n > INT32_MAX) return PD_ERANGE;
    if (buf && cap && n) memcpy(buf, p, n < cap ? n : cap);
    return (int)n;
}

/* llama.cpp's clean_up_tokenization_spaces, three passes in place. */
static size_t clean_spaces(char *text, size_t total) {
    /* " ?", " !", " .", " ," lose the space */
    size_t n1 = total;
    total = total ? 1 : 0;
    for (size_t i = 1; i < n1; i++) {
        char x = text[i];
        if (text[i - 1] == ' ' && (x == '?' || x == '!' || x == '.' || x == ','))
            total--;
        text[total++] = x;
    }
    /* " ' " becomes "'" */
    size_t n2 = total;
    total = total ? 1 : 0;
    for (size_t i = 1; i < n2; i++) {
        char x = text[i];
        if (x == '\'' && i + 1 < n2 && text[i - 1] == ' ' && text[i + 1] == ' ') {
            total--;
            text[++i] = '\0';
        }
        text[total++] = x;
    }
    /* " 's", " 'm", " 're", " 've" lose the space */
    size_t n3 = total;
    total = total ? 1 : 0;
    for (size_t i = 1; i < n3; i++) {
        char x = text[i];
        if (text[i - 1] == ' ' && x == '\'' && i + 1 < n3) {
            char x1 = text[i + 1];
            if (x1 == 's' || x1 == 'm') {
                total--;
            } else if (x1 != 't' && x1 != 'd' && i + 2 < n3) {
                char x2 = text[i + 2];
                if ((x1 == 'r' && x2 == 'e') || (x1 == 'v' && x2 == 'e')) total--;
            }
        }
        text[total++] = x;
    }
    return total;
}

/* Every id checked against the vocabulary; *total = the bytes of their pieces. */
static int pieces_length(const pd_tokenizer *t, const pd_token *ids, size_t n, size_t *total, pd_error *err) {
    *total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_tokens)
            return pd_errorf(err, PD_EINVAL, "token id %d at position %zu is out of range (vocab has %d tokens)",
                             ids[i], i, t->n_tokens);
        *total += t->tokens[ids[i]].piece_len;
    }
    return PD_OK;
}

int pd_detokenize(const pd_tokenizer *t, const pd_token *ids, size_t n, bool special,
                  bool remove_leading_space, char **out, size_t *len_out, pd_error *err) {
    if (!t || !out) return pd_errorf(err, PD_EINVAL, "pd_detokenize: NULL argument");
    *out = NULL;
    if (len_out) *len_out = 0;
    if (!ids && n) return pd_errorf(err, PD_EINVAL, "pd_detokenize: ids is NULL but n is %zu", n);
    size_t total;
    int rc = pieces_length(t, ids, n, &total, err);
    if (rc) return rc;
    char *s = malloc(total + 1);
    if (!s) return pd_errorf(err, PD_ENOMEM, "out of memory for %zu decoded bytes", total);

    /* The space SPM puts in front of the text sits on the first token after
     * any leading control tokens (BOS). */
    bool strip = remove_leading_space && t->add_space_prefix;
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        size_t pn;
        const char *p = piece(t, ids[i], special, &pn);
        if (strip && !(t->tokens[ids[i]].attr & TK_ATTR_CONTROL)) {
            if (pn && p[0] == ' ') p++, pn--;
            strip = false;
        }
        if (pn) memcpy(s + len, p, pn);
        len += pn;
    }
    if (t->clean_spaces) len = clean_spaces(s, len);
    s[len] = '\0';
    *out = s;
    if (len_out) *len_out = len;
    return PD_OK;
}

int pd_detokenize_offsets(const pd_tokenizer *t, const pd_token *ids, size_t n, bool special, char **out,
                          size_t *len_out, size_t **offsets_out, pd_error *err) {
    if (!t || !out || !offsets_out) return pd_errorf(err, PD_EINVAL, "pd_detokenize_offsets: NULL argument");
    *out = NULL;
    *offsets_out = NULL;
    if (len_out) *len_out = 0;
    if (!ids && n) return pd_errorf(err, PD_EINVAL, "pd_detokenize_offsets: ids is NULL but n is %zu", n);
    size_t total;
    int rc = pieces_length(t, ids, n, &total, err);
    if (rc) return rc;
    char *s = malloc(total + 1);
    size_t *off = n < SIZE_MAX / sizeof *off ? malloc((n + 1) * sizeof *off) : NULL;
    if (!s || !off) {
        free(s);
        free(off);
        return pd_errorf(err, PD_ENOMEM, "out of memory for %zu decoded bytes and %zu offsets", total, n + 1);
    }
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        size_t pn;
        const char *p = piece(t, ids[i], special, &pn);
        off[i] = len;
        if (pn) memcpy(s + len, p, pn);
        len += pn;
    }
    off[n] = len;
    s[len] = '\0';
    *out = s;
    *offsets_out = off;
    if (len_out) *len_out = len;
    return PD_OK;
}
