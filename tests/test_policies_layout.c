/* Layouts from the prefix's text (policies/layout_text.c) on real
 * tokenizers: boundaries against hand-placed sentence, paragraph and turn
 * starts, automatic spans against their contract, phrase whitelists against
 * a brute-force search over the rendered pieces. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "helpers.h"
#include "policies/policies.h"

TestSuite(layout_text);

static pd_tokenizer *stories(void) { return th_shared_tokenizer("tinystories/stories260K.gguf"); }

static pd_token *tokens_of(const pd_tokenizer *t, const char *text, bool parse_special, int64_t *n) {
    pd_token *ids = NULL;
    size_t len = 0;
    pd_error err = {0};
    pd_tokenize_opts o = {.add_special = true, .parse_special = parse_special};
    cr_assert_eq(pd_tokenize(t, text, strlen(text), o, &ids, &len, &err), PD_OK, "%s", err.msg);
    *n = (int64_t)len;
    return ids;
}

/* The naive rendering: pieces concatenated one by one, with offsets. */
static char *naive_render(const pd_tokenizer *t, const pd_token *ids, int64_t n, size_t *off) {
    size_t cap = 64, len = 0;
    char *s = malloc(cap);
    for (int64_t i = 0; i < n; i++) {
        char piece[256];
        int pn = pd_token_to_piece(t, ids[i], true, piece, sizeof piece);
        cr_assert(pn >= 0 && pn < (int)sizeof piece);
        while (len + (size_t)pn + 1 > cap) s = realloc(s, cap *= 2);
        off[i] = len;
        memcpy(s + len, piece, (size_t)pn);
        len += (size_t)pn;
    }
    off[n] = len;
    s[len] = '\0';
    return s;
}

/* The token whose piece holds byte `at` of the naive rendering. */
static int64_t naive_token_at(const size_t *off, int64_t n, size_t at) {
    for (int64_t i = 0; i < n; i++)
        if (off[i] <= at && at < off[i + 1]) return i;
    cr_assert_fail("byte %zu is in no token", at);
    return -1;
}

/* ---- boundaries ------------------------------------------------------------ */

Test(layout_text, boundaries_are_where_the_text_says) {
    pd_tokenizer *t = stories();
    /* Sentence starts and their kinds, written by hand: the '.' of "3.14"
     * is not followed by whitespace, the quote closes a sentence, the blank
     * line is a paragraph, a line break a sentence. */
    const char *text = "Once upon a time, a cat sat. She ran fast! Did he see it?\n\nA new day \"began.\" It was 3.14 "
                       "miles long\nLast line here";
    struct { const char *at; pd_boundary_kind kind; } want[] = {
        {"She ran", PD_BOUNDARY_SENTENCE}, {"Did he", PD_BOUNDARY_SENTENCE}, {"A new", PD_BOUNDARY_PARAGRAPH},
        {"It was", PD_BOUNDARY_SENTENCE},  {"Last line", PD_BOUNDARY_SENTENCE}};
    int64_t n;
    pd_token *ids = tokens_of(t, text, false, &n);
    size_t *off = malloc((size_t)(n + 1) * sizeof *off);
    char *r = naive_render(t, ids, n, off);
    /* The rendered text is BOS's text, then the input after SPM's space. */
    const char *body = strstr(r, text);
    cr_assert_not_null(body, "%s", r);
    uint8_t *expect = calloc((size_t)n, 1), *kinds = malloc((size_t)n);
    for (size_t w = 0; w < sizeof want / sizeof want[0]; w++) {
        const char *p = strstr(text, want[w].at);
        cr_assert_not_null(p);
        expect[naive_token_at(off, n, (size_t)(body - r) + (size_t)(p - text))] = (uint8_t)want[w].kind;
    }
    pd_error err = {0};
    cr_assert_eq(pd_text_boundaries(t, ids, n, kinds, &err), PD_OK, "%s", err.msg);
    for (int64_t i = 0; i < n; i++)
        cr_expect_eq(kinds[i], expect[i], "token %lld ('%.*s'): kind %d, want %d", (long long)i,
                     (int)(off[i + 1] - off[i]), r + off[i], kinds[i], expect[i]);
    free(kinds);
    free(expect);
    free(r);
    free(off);
    free(ids);
    pd_tokenizer_free(t);
}

/* Control tokens that end a turn (phi-3's <|end|>) divide turns. */
Test(layout_text, turns_end_at_end_of_turn_tokens) {
    pd_tokenizer *t = th_shared_tokenizer("vocab/ggml-vocab-phi-3.gguf");
    const char *text = "<|system|>\nYou are kind. Be brief.<|end|>\n<|user|>\nHello there.<|end|>\n<|assistant|>\n";
    const pd_token end = pd_tokenizer_find(t, "<|end|>", 7);
    cr_assert_neq(end, PD_TOKEN_NULL);
    int64_t n;
    pd_token *ids = tokens_of(t, text, true, &n);
    uint8_t *kinds = malloc((size_t)n);
    pd_error err = {0};
    cr_assert_eq(pd_text_boundaries(t, ids, n, kinds, &err), PD_OK, "%s", err.msg);
    int turns = 0;
    for (int64_t i = 1; i < n; i++) {
        cr_expect_eq(kinds[i] == PD_BOUNDARY_TURN, ids[i - 1] == end, "token %lld", (long long)i);
        turns += kinds[i] == PD_BOUNDARY_TURN;
    }
    cr_assert_eq(turns, 2);
    /* Written as plain text the same characters are no turn. */
    free(ids);
    ids = tokens_of(t, text, false, &n);
    free(kinds);
    kinds = malloc((size_t)n);
    cr_assert_eq(pd_text_boundaries(t, ids, n, kinds, &err), PD_OK, "%s", err.msg);
    for (int64_t i = 0; i < n; i++) cr_expect_neq(kinds[i], PD_BOUNDARY_TURN);
    free(kinds);
    free(ids);
    pd_tokenizer_free(t);
}

/* ---- automatic spans ---------------------------------------------------------- */

static const char story[] =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she "
    "saw a big, red ball. She wanted to play with it, but it was too high. Lily asked her mom to help her.\n\n"
    "Her mom smiled and said, \"Let's get the ball together.\" They went to the tree and her mom lifted Lily up "
    "high. Lily took the ball and laughed. Then a little dog came running to them. The dog wanted to play too.\n\n"
    "Lily threw the ball and the dog ran after it. The dog brought the ball back and wagged its tail. Lily and the "
    "dog played all day long. When the sun went down, Lily was tired and happy. She hugged the dog.";

static void check_auto(const pd_tokenizer *t, const pd_token *ids, int64_t n, const uint8_t *kinds,
                       const pd_auto_spans_opts *o, pd_layout *lay) {
    pd_error err = {0};
    cr_assert_eq(pd_layout_auto(t, ids, n, o, lay, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_layout_validate(lay, n, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(lay->n_whitelist, 0);
    cr_assert(lay->n_spans >= 1 && lay->n_spans <= o->max_spans, "%d spans", lay->n_spans);
    for (int s = 0; s < lay->n_spans; s++) {
        char name[16];
        snprintf(name, sizeof name, "s%d", s);
        cr_assert_str_eq(lay->spans[s].name, name);
        if (s > 0) cr_assert_gt(kinds[lay->spans[s].start], 0, "span %d starts at a boundary", s);
        if (lay->n_spans > 1)
            cr_assert_geq(lay->spans[s].end - lay->spans[s].start, o->min_tokens, "span %d is long enough", s);
    }
}

Test(layout_text, automatic_spans_cut_at_boundaries_stronger_first) {
    pd_tokenizer *t = stories();
    int64_t n;
    pd_token *ids = tokens_of(t, story, false, &n);
    uint8_t *kinds = malloc((size_t)n);
    pd_error err = {0};
    cr_assert_eq(pd_text_boundaries(t, ids, n, kinds, &err), PD_OK, "%s", err.msg);
    int64_t sentences = 0, paragraphs = 0;
    for (int64_t i = 0; i < n; i++) {
        sentences += kinds[i] == PD_BOUNDARY_SENTENCE;
        paragraphs += kinds[i] == PD_BOUNDARY_PARAGRAPH;
    }
    cr_assert_eq(paragraphs, 2);
    cr_assert_eq(sentences, 12, "15 sentences in 3 paragraphs");

    /* No merging and room for all: one span per sentence. */
    pd_auto_spans_opts o = {.min_tokens = 1, .max_spans = 100};
    pd_layout lay;
    check_auto(t, ids, n, kinds, &o, &lay);
    cr_assert_eq(lay.n_spans, 15);
    pd_layout_free(&lay);

    /* Three spans: the paragraphs, whatever their sentences. */
    o.max_spans = 3;
    check_auto(t, ids, n, kinds, &o, &lay);
    cr_assert_eq(lay.n_spans, 3);
    for (int s = 1; s < 3; s++) cr_assert_eq(kinds[lay.spans[s].start], PD_BOUNDARY_PARAGRAPH);
    pd_layout_free(&lay);

    /* Defaults: sentences merged to at least 16 tokens, paragraphs kept. */
    pd_auto_spans_opts_default(&o);
    cr_assert_eq(o.min_tokens, 16);
    cr_assert_eq(o.max_spans, 16);
    check_auto(t, ids, n, kinds, &o, &lay);
    cr_assert_gt(lay.n_spans, 3);
    int para = 0;
    for (int s = 1; s < lay.n_spans; s++) para += kinds[lay.spans[s].start] == PD_BOUNDARY_PARAGRAPH;
    cr_assert_eq(para, 2, "both paragraph breaks start spans");
    pd_layout auto_null; /* NULL options are the defaults */
    cr_assert_eq(pd_layout_auto(t, ids, n, NULL, &auto_null, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(auto_null.n_spans, lay.n_spans);
    for (int s = 0; s < lay.n_spans; s++) cr_assert_eq(auto_null.spans[s].end, lay.spans[s].end);
    pd_layout_free(&auto_null);
    pd_layout_free(&lay);

    /* A text shorter than the minimum is one span; no text is an error. */
    free(ids);
    ids = tokens_of(t, "Hi. Yo.", false, &n);
    check_auto(t, ids, n, kinds, &(pd_auto_spans_opts){.min_tokens = 16, .max_spans = 16}, &lay);
    cr_assert_eq(lay.n_spans, 1);
    cr_assert_eq(lay.spans[0].end, n);
    pd_layout_free(&lay);
    cr_assert_eq(pd_layout_auto(t, ids, 0, NULL, &lay, &err), PD_EINVAL);
    cr_assert_eq(pd_layout_auto(t, ids, n, &(pd_auto_spans_opts){.min_tokens = 0, .max_spans = 4}, &lay, &err),
                 PD_EINVAL);
    cr_assert(strstr(err.msg, "min_tokens"), "%s", err.msg);
    free(kinds);
    free(ids);
    pd_tokenizer_free(t);
}

/* ---- phrase whitelists ----------------------------------------------------------- */

/* Brute force: every byte position where the phrase matches the naive
 * rendering marks the tokens overlapping those bytes. */
static void naive_keep(const char *r, const size_t *off, int64_t n, const char *phrase, uint8_t *keep) {
    const size_t len = strlen(phrase), total = off[n];
    for (size_t a = 0; a + len <= total; a++)
        if (memcmp(r + a, phrase, len) == 0)
            for (int64_t k = 0; k < n; k++)
                if (off[k] < a + len && off[k + 1] > a) keep[k] = 1;
}

Test(layout_text, phrases_keep_the_tokens_they_overlap) {
    pd_tokenizer *t = stories();
    int64_t n;
    pd_token *ids = tokens_of(t, story, false, &n);
    size_t *off = malloc((size_t)(n + 1) * sizeof *off);
    char *r = naive_render(t, ids, n, off);
    /* Whole words, a piece inside words ("ll" of ball, little, ...), a
     * phrase over a paragraph break and one across a quote. */
    const char *phrases[] = {"Lily", "the ball", "ll", "too.\n\nLily threw", "d, \"Let"};
    const int np = (int)(sizeof phrases / sizeof phrases[0]);
    uint8_t *want = calloc((size_t)n, 1), *got = calloc((size_t)n, 1);
    for (int p = 0; p < np; p++) naive_keep(r, off, n, phrases[p], want);
    /* A kept range from a span file joins the phrases' ranges. */
    pd_layout lay;
    pd_error err = {0};
    cr_assert_eq(pd_layout_parse("keep 2 4\n", &lay, &err), PD_OK, "%s", err.msg);
    want[2] = want[3] = 1;
    int missing = 7;
    cr_assert_eq(pd_layout_keep_phrases(t, ids, n, phrases, np, &lay, &missing, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(missing, -1);
    cr_assert_eq(pd_layout_validate(&lay, n, &err), PD_OK, "%s", err.msg);
    for (int i = 0; i < lay.n_whitelist; i++) {
        if (i > 0) cr_assert_gt(lay.whitelist[i].start, lay.whitelist[i - 1].end, "sorted, merged, not touching");
        for (int64_t k = lay.whitelist[i].start; k < lay.whitelist[i].end; k++) got[k] = 1;
    }
    int64_t kept = 0;
    for (int64_t k = 0; k < n; k++) {
        cr_expect_eq(got[k], want[k], "token %lld '%.*s'", (long long)k, (int)(off[k + 1] - off[k]), r + off[k]);
        kept += got[k];
    }
    cr_assert(kept > 20 && kept < n, "%lld of %lld kept", (long long)kept, (long long)n);

    /* A phrase that never occurs (case matters) names itself; nothing changes. */
    const int before = lay.n_whitelist;
    const char *bad[] = {"Lily", "lily threw"};
    cr_assert_eq(pd_layout_keep_phrases(t, ids, n, bad, 2, &lay, &missing, &err), PD_ENOTFOUND);
    cr_assert_eq(missing, 1);
    cr_assert(strstr(err.msg, "'lily threw'") && strstr(err.msg, "does not occur"), "%s", err.msg);
    cr_assert_eq(lay.n_whitelist, before);
    const char *empty[] = {""};
    cr_assert_eq(pd_layout_keep_phrases(t, ids, n, empty, 1, &lay, &missing, &err), PD_EINVAL);
    cr_assert_eq(missing, 0);
    pd_layout_free(&lay);

    /* Into an empty layout, with spans from pd_layout_auto. */
    cr_assert_eq(pd_layout_auto(t, ids, n, NULL, &lay, &err), PD_OK, "%s", err.msg);
    const int spans = lay.n_spans;
    const char *one[] = {"red ball"};
    cr_assert_eq(pd_layout_keep_phrases(t, ids, n, one, 1, &lay, NULL, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(lay.n_spans, spans);
    cr_assert_eq(lay.n_whitelist, 1);
    const char *at = strstr(r, "red ball");
    cr_assert_eq(lay.whitelist[0].start, naive_token_at(off, n, (size_t)(at - r)));
    cr_assert_eq(lay.whitelist[0].end, naive_token_at(off, n, (size_t)(at - r) + 7) + 1);
    pd_layout_free(&lay);
    free(want);
    free(got);
    free(r);
    free(off);
    free(ids);
    pd_tokenizer_free(t);
}
