/* WordPiece (tokenizer.ggml.model = "bert"), as llama.cpp's
 * llm_tokenizer_wpm.
 *
 * Pre-processing, per code point: replace it by the first code point of its
 * canonical decomposition (llama.cpp's "NFD" table keeps only that one, so
 * precomposed accents are dropped), then: whitespace ends a word; NUL,
 * U+FFFD and control/format/unassigned code points are dropped; punctuation,
 * ASCII symbols and CJK ideographs become one-character words; everything
 * else is lower-cased and appended to the current word.
 *
 * Each word, prefixed with U+2581, is covered greedily by the longest
 * vocabulary entries from the left; if some position cannot be covered the
 * whole word becomes [UNK]. Unicode data comes from utf8proc. */
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "tokenizer_internal.h"

static bool is_chinese_char(uint32_t c) {
    return (c >= 0x04E00 && c <= 0x09FFF) || (c >= 0x03400 && c <= 0x04DBF) ||
           (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
           (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
           (c >= 0x0F900 && c <= 0x0FAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

static uint32_t nfd_first(uint32_t c) {
    utf8proc_int32_t dst[8];
    utf8proc_ssize_t n = utf8proc_decompose_char((utf8proc_int32_t)c, dst, 8, UTF8PROC_DECOMPOSE, NULL);
    return n >= 1 ? (uint32_t)dst[0] : c;
}

/* Words are collected as "\xe2\x96\x81word" strings back to back in buf,
 * with their end offsets in ends[]. */
typedef struct wpm_words {
    tk_buf buf;
    size_t *ends;
    size_t n, cap;
    size_t cur_start; /* start of the word being built (after its prefix) */
} wpm_words;

static int word_begin(wpm_words *w) {
    if (tk_buf_append(&w->buf, "\xe2\x96\x81", 3)) return PD_ENOMEM;
    w->cur_start = w->buf.n;
    return PD_OK;
}

/* Close the current word if it has content (an empty one is discarded). */
static int word_end(wpm_words *w) {
    if (w->buf.n == w->cur_start) return PD_OK; /* empty: keep the prefix for the next word */
    if (w->n == w->cap) {
        size_t cap = w->cap ? w->cap * 2 : 64;
        size_t *e = realloc(w->ends, cap * sizeof *e);
        if (!e) return PD_ENOMEM;
        w->ends = e;
        w->cap = cap;
    }
    w->ends[w->n++] = w->buf.n;
    return word_begin(w);
}

static int append_cp(wpm_words *w, uint32_t c) {
    char enc[4];
    size_t n = tk_utf8_encode(c, enc);
    return tk_buf_append(&w->buf, enc, n);
}

int tk_wpm_tokenize(const pd_tokenizer *t, const char *text, size_t len, tk_ids *out) {
    wpm_words w = {0};
    int rc = word_begin(&w);
    if (rc) goto done;

    const unsigned char *s = (const unsigned char *)text;
    for (size_t i = 0; i < len;) {
        int32_t d = tk_utf8_decode(s, len, &i);
        uint32_t c = d < 0 ? 0xFFFD : (uint32_t)d;
        c = nfd_first(c);
        if (tk_is_whitespace(c)) {
            if ((rc = word_end(&w))) goto done;
            continue;
        }
        utf8proc_category_t cat = utf8proc_category((utf8proc_int32_t)c);
        bool is_control = cat == UTF8PROC_CATEGORY_CN || cat == UTF8PROC_CATEGORY_CC ||
                          cat == UTF8PROC_CATEGORY_CF || cat == UTF8PROC_CATEGORY_CS ||
                          cat == UTF8PROC_CATEGORY_CO;
        if (c == 0 || c == 0xFFFD || is_control) continue;
        bool is_punct = cat >= UTF8PROC_CATEGORY_PC && cat <= UTF8PROC_CATEGORY_PO;
        bool is_symbol = cat >= UTF8PROC_CATEGORY_SM && cat <= UTF8PROC_CATEGORY_SO;
        uint32_t lower = (uint32_t)utf8proc_tolower((utf8proc_int32_t)c);
        if (is_punct || (c < 0x7F && is_symbol) || is_chinese_char(c)) {
            if ((rc = word_end(&w))) goto done;
            if ((rc = append_cp(&w, lower))) goto done;
            if ((rc = word_end(&w))) goto done;
        } else if ((rc = append_cp(&w, lower))) {
            goto done;
        }
    }
    if ((rc = word_end(&w))) goto done;

    size_t start = 0;
    for (size_t k = 0; k < w.n; k++) {
        const char *word = w.buf.p + start;
        size_t n = w.ends[k] - start;
        start = w.ends[k] + 0;
        size_t before = out->n;
        for (size_t i = 0; i < n; i++) {
            size_t jmax = i + t->max_token_len + 1 < n ? i + t->max_token_len + 1 : n;
            bool match = false;
            for (size_t j = jmax; j > i; j--) {
                pd_token id = tk_lookup(t, word + i, j - i);
                if (id != PD_TOKEN_NULL) {
                    if ((rc = tk_ids_push(out, id))) goto done;
                    match = true;
                    i = j - 1;
                    break;
                }
            }
            if (!match) {
                out->n = before; /* discard the whole word */
                break;
            }
        }
        if (out->n == before && t->unk != PD_TOKEN_NULL && (rc = tk_ids_push(out, t->unk))) goto done;
    }
    rc = PD_OK;
done:
    free(w.buf.p);
    free(w.ends);
    return rc;
}
