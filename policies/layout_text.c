/* Layouts from the prefix's text: automatic spans (turn, paragraph and
 * sentence boundaries, the fair-eviction paper's sentence-level span
 * detection) and phrase whitelists (its token matching). Both work on the
 * text the tokens render to, with each token's byte offset
 * (pd_detokenize_offsets), so a byte position maps back to one token. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "policies/policies.h"

#define DEFAULT_MIN_TOKENS 16
#define DEFAULT_MAX_SPANS 16
#define PHRASE_ECHO 60

void pd_auto_spans_opts_default(pd_auto_spans_opts *o) {
    o->min_tokens = DEFAULT_MIN_TOKENS;
    o->max_spans = DEFAULT_MAX_SPANS;
}

/* The rendered text, with offsets[n + 1]. */
typedef struct rendered {
    char *text;
    size_t len;
    size_t *offsets;
} rendered;

static int render(const pd_tokenizer *tok, const pd_token *ids, int64_t n, rendered *r, pd_error *err) {
    memset(r, 0, sizeof *r);
    if (!tok || (!ids && n > 0)) return pd_errorf(err, PD_EINVAL, "layout from text: NULL tokenizer or tokens");
    if (n < 1) return pd_errorf(err, PD_EINVAL, "layout from text: the prefix has no tokens");
    return pd_detokenize_offsets(tok, ids, (size_t)n, true, &r->text, &r->len, &r->offsets, err);
}

static void rendered_free(rendered *r) {
    free(r->text);
    free(r->offsets);
}

/* The token holding byte `at` (< len): the last token starting at or before
 * it whose piece is not empty. */
static int64_t token_at(const rendered *r, int64_t n, size_t at) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) { /* largest i with offsets[i] <= at */
        int64_t mid = lo + (hi - lo + 1) / 2;
        if (r->offsets[mid] <= at) lo = mid;
        else hi = mid - 1;
    }
    while (lo > 0 && r->offsets[lo + 1] == r->offsets[lo]) lo--; /* empty pieces hold no byte */
    return lo;
}

static bool is_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

/* Closing quotes and brackets that may follow a sentence's terminator; returns
 * their byte length at p, 0 if none. */
static size_t closer_len(const char *p, size_t left) {
    if (left >= 1 && (p[0] == '"' || p[0] == '\'' || p[0] == ')' || p[0] == ']')) return 1;
    /* U+201D ” and U+2019 ’ */
    if (left >= 3 && (unsigned char)p[0] == 0xE2 && (unsigned char)p[1] == 0x80 &&
        ((unsigned char)p[2] == 0x9D || (unsigned char)p[2] == 0x99))
        return 3;
    return 0;
}

/* A CJK sentence terminator at p (U+3002 。, U+FF01 ！, U+FF1F ？): its length. */
static size_t cjk_stop_len(const char *p, size_t left) {
    if (left < 3) return 0;
    const unsigned char *u = (const unsigned char *)p;
    if (u[0] == 0xE3 && u[1] == 0x80 && u[2] == 0x82) return 3;
    if (u[0] == 0xEF && u[1] == 0xBC && (u[2] == 0x81 || u[2] == 0x9F)) return 3;
    return 0;
}

static void mark(uint8_t *kinds, int64_t b, pd_boundary_kind k) {
    if (b > 0 && kinds[b] < (uint8_t)k) kinds[b] = (uint8_t)k;
}

int pd_text_boundaries(const pd_tokenizer *tok, const pd_token *ids, int64_t n, uint8_t *kinds, pd_error *err) {
    rendered r;
    int rc = render(tok, ids, n, &r, err);
    if (rc) return rc;
    memset(kinds, 0, (size_t)n);
    /* Turns: a token that ends generation (by id: <|im_end|>, <|eot_id|>,
     * ...) closes a chat turn. Written as plain text (a `text` prefix) it is
     * several ordinary tokens and closes nothing. */
    for (int64_t i = 0; i + 1 < n; i++)
        if (pd_tokenizer_is_eog(tok, ids[i])) mark(kinds, i + 1, PD_BOUNDARY_TURN);
    /* Text: after a terminator (with its closers) or a line break comes a run
     * of whitespace; the next part starts at the first byte after the run. */
    const char *t = r.text;
    for (size_t k = 0; k < r.len;) {
        const size_t cjk = cjk_stop_len(t + k, r.len - k);
        size_t end; /* past the terminator and its closers */
        bool needs_space = true;
        if (t[k] == '.' || t[k] == '!' || t[k] == '?' || cjk) {
            end = k + (cjk ? cjk : 1);
            needs_space = !cjk;
            for (size_t c; end < r.len && (c = closer_len(t + end, r.len - end)) > 0;) end += c;
        } else if (t[k] == '\n') {
            end = k; /* the line break opens the whitespace run */
        } else {
            k++;
            continue;
        }
        size_t run = end;
        int breaks = 0;
        while (run < r.len && is_space(t[run])) breaks += t[run++] == '\n';
        if (run < r.len && (run > end || !needs_space))
            mark(kinds, token_at(&r, n, run), breaks >= 2 ? PD_BOUNDARY_PARAGRAPH : PD_BOUNDARY_SENTENCE);
        k = run > k ? run : k + 1;
    }
    rendered_free(&r);
    return PD_OK;
}

/* ---- automatic spans -------------------------------------------------------- */

/* Pieces as a list: start[i], strength[i] of the boundary before piece i
 * (strength[0] unused), piece i ends where piece i + 1 starts (or at n). */
typedef struct pieces {
    int64_t *start;
    uint8_t *strength;
    int count;
    int64_t n;
} pieces;

static int64_t piece_len(const pieces *p, int i) {
    return (i + 1 < p->count ? p->start[i + 1] : p->n) - p->start[i];
}

/* Remove the boundary before piece i (i >= 1): piece i joins piece i - 1. */
static void join_before(pieces *p, int i) {
    memmove(p->start + i, p->start + i + 1, (size_t)(p->count - i - 1) * sizeof *p->start);
    memmove(p->strength + i, p->strength + i + 1, (size_t)(p->count - i - 1) * sizeof *p->strength);
    p->count--;
}

int pd_layout_auto(const pd_tokenizer *tok, const pd_token *ids, int64_t n, const pd_auto_spans_opts *opts,
                   pd_layout *out, pd_error *err) {
    memset(out, 0, sizeof *out);
    pd_auto_spans_opts o;
    if (opts) o = *opts;
    else pd_auto_spans_opts_default(&o);
    if (o.min_tokens < 1 || o.max_spans < 1)
        return pd_errorf(err, PD_EINVAL, "automatic spans: min_tokens (%" PRId64 ") and max_spans (%d) must be at "
                         "least 1", o.min_tokens, o.max_spans);
    if (n < 1) return pd_errorf(err, PD_EINVAL, "automatic spans: the prefix has no tokens");
    if (n > INT32_MAX) return pd_errorf(err, PD_ERANGE, "automatic spans: %" PRId64 " tokens are too many", n);
    uint8_t *kinds = malloc((size_t)n);
    pieces p = {.start = malloc((size_t)n * sizeof *p.start), .strength = malloc((size_t)n), .n = n};
    pd_span *spans = NULL;
    int rc = PD_OK;
    if (!kinds || !p.start || !p.strength) {
        rc = pd_errorf(err, PD_ENOMEM, "out of memory for the boundaries of %" PRId64 " tokens", n);
        goto fail;
    }
    if ((rc = pd_text_boundaries(tok, ids, n, kinds, err))) goto fail;
    for (int64_t i = 0; i < n; i++)
        if (i == 0 || kinds[i]) {
            p.start[p.count] = i;
            p.strength[p.count] = kinds[i];
            p.count++;
        }
    /* Merge short pieces, the shortest first, across the weaker boundary. */
    for (;;) {
        int shortest = -1;
        for (int i = 0; i < p.count && p.count > 1; i++)
            if (piece_len(&p, i) < o.min_tokens && (shortest < 0 || piece_len(&p, i) < piece_len(&p, shortest)))
                shortest = i;
        if (shortest < 0) break;
        const int i = shortest;
        bool left;
        if (i == 0) left = false;
        else if (i == p.count - 1) left = true;
        else if (p.strength[i] != p.strength[i + 1]) left = p.strength[i] < p.strength[i + 1];
        else left = piece_len(&p, i - 1) <= piece_len(&p, i + 1);
        join_before(&p, left ? i : i + 1);
    }
    /* Cap the count: drop the weakest boundary, joining the fewest tokens. */
    while (p.count > o.max_spans) {
        int best = 1;
        for (int i = 2; i < p.count; i++) {
            const int64_t joined = piece_len(&p, i - 1) + piece_len(&p, i),
                          best_joined = piece_len(&p, best - 1) + piece_len(&p, best);
            if (p.strength[i] < p.strength[best] || (p.strength[i] == p.strength[best] && joined < best_joined))
                best = i;
        }
        join_before(&p, best);
    }
    if (!(spans = calloc((size_t)p.count, sizeof *spans))) {
        rc = pd_errorf(err, PD_ENOMEM, "out of memory for %d spans", p.count);
        goto fail;
    }
    for (int i = 0; i < p.count; i++) {
        snprintf(spans[i].name, sizeof spans[i].name, "s%d", i);
        spans[i].start = p.start[i];
        spans[i].end = p.start[i] + piece_len(&p, i);
    }
    out->spans = spans;
    out->n_spans = p.count;
    spans = NULL;
fail:
    free(spans);
    free(kinds);
    free(p.start);
    free(p.strength);
    return rc;
}

/* ---- phrase whitelists -------------------------------------------------------- */

static int cmp_range(const void *a, const void *b) {
    const pd_range *x = a, *y = b;
    if (x->start != y->start) return x->start < y->start ? -1 : 1;
    return (x->end > y->end) - (x->end < y->end);
}

/* Append r to *arr (count *n, capacity *cap). */
static int push_range(pd_range **arr, int *n, int *cap, pd_range r, pd_error *err) {
    if (*n == *cap) {
        if (*cap > INT32_MAX / 2) return pd_errorf(err, PD_ERANGE, "keep phrases: too many kept ranges");
        int new_cap = *cap ? *cap * 2 : 16;
        pd_range *g = realloc(*arr, (size_t)new_cap * sizeof *g);
        if (!g) return pd_errorf(err, PD_ENOMEM, "out of memory for %d kept ranges", new_cap);
        *arr = g;
        *cap = new_cap;
    }
    (*arr)[(*n)++] = r;
    return PD_OK;
}

static void echo_phrase(const char *s, char *out, size_t cap) {
    size_t i = 0, len = strlen(s);
    for (; i < len && i + 4 < cap; i++) out[i] = (unsigned char)s[i] < 0x20 ? '?' : s[i];
    if (i < len) memcpy(out + i, "...", 4);
    else out[i] = '\0';
}

int pd_layout_keep_phrases(const pd_tokenizer *tok, const pd_token *ids, int64_t n, const char *const *phrases,
                           int n_phrases, pd_layout *layout, int *missing, pd_error *err) {
    if (missing) *missing = -1;
    if (!layout || n_phrases < 0 || (!phrases && n_phrases > 0))
        return pd_errorf(err, PD_EINVAL, "keep phrases: NULL layout or phrases");
    if (n_phrases == 0) return PD_OK;
    rendered r;
    int rc = render(tok, ids, n, &r, err);
    if (rc) return rc;
    pd_range *all = NULL;
    int count = 0, cap = 0;
    char shown[PHRASE_ECHO + 4];
    for (int i = 0; !rc && i < layout->n_whitelist; i++) rc = push_range(&all, &count, &cap, layout->whitelist[i], err);
    for (int p = 0; !rc && p < n_phrases; p++) {
        const char *phrase = phrases[p];
        const size_t plen = phrase ? strlen(phrase) : 0;
        if (plen == 0) {
            if (missing) *missing = p;
            rc = pd_errorf(err, PD_EINVAL, "keep phrase %d is empty; give the text to keep", p);
            break;
        }
        bool found = false;
        /* Every occurrence, overlapping ones too: the search restarts one
         * byte after each match (memmem: a byte token may render a NUL). */
        for (const char *at = r.text; !rc && (at = memmem(at, r.len - (size_t)(at - r.text), phrase, plen)); at++) {
            const size_t a = (size_t)(at - r.text);
            pd_range range = {token_at(&r, n, a), token_at(&r, n, a + plen - 1) + 1};
            rc = push_range(&all, &count, &cap, range, err);
            found = true;
        }
        if (!rc && !found) {
            if (missing) *missing = p;
            echo_phrase(phrase, shown, sizeof shown);
            rc = pd_errorf(err, PD_ENOTFOUND, "keep phrase '%s' does not occur in the prefix text; give text "
                           "exactly as it appears there (case and spaces included)", shown);
        }
    }
    if (!rc) {
        qsort(all, (size_t)count, sizeof *all, cmp_range);
        int merged = 0;
        for (int i = 0; i < count; i++) {
            if (merged > 0 && all[i].start <= all[merged - 1].end) {
                if (all[i].end > all[merged - 1].end) all[merged - 1].end = all[i].end;
            } else {
                all[merged++] = all[i];
            }
        }
        /* The header's array is const for users; it was malloc'd (parse, auto, or here). */
        free((void *)(uintptr_t)layout->whitelist);
        layout->whitelist = all;
        layout->n_whitelist = merged;
        all = NULL;
    }
    free(all);
    rendered_free(&r);
    return rc;
}
