/* grammar: the GBNF parser's errors, code-point classes against a naive
 * decoder over every code point, and token masks against brute force (each
 * token tried by its bytes) along random walks, with and without a budget. */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/gguf.h"
#include "engine/tokenizer.h"
#include "grammar/grammar_internal.h"
#include "helpers.h"

static pd_grammar *compile_ok(const char *text) {
    pd_grammar *g = NULL;
    pd_error err = {0};
    int rc = pd_grammar_compile(text, strlen(text), &g, &err);
    cr_assert_eq(rc, PD_OK, "compile failed: %s\n%s", err.msg, text);
    return g;
}

static void compile_fails(const char *text, const char *want) {
    pd_grammar *g = NULL;
    pd_error err = {0};
    int rc = pd_grammar_compile(text, strlen(text), &g, &err);
    cr_assert_eq(rc, PD_EINVAL, "expected an error for:\n%s", text);
    cr_assert_null(g);
    cr_assert(strstr(err.msg, want), "error '%s' lacks '%s'", err.msg, want);
}

Test(grammar, parser_errors_name_line_and_column) {
    compile_fails("root ::= \"a\" foo", "line 1 column 14: rule 'foo' is used but not defined");
    compile_fails("root ::= \"a\"\n  x ::= y \"b\"\ny ::= x | \"c\"", "left recursion");
    compile_fails("root ::= \"a\"\n  x ::= y \"b\"\ny ::= x | \"c\"", "line 2 column 3");
    compile_fails("root ::= e\ne ::= e \"+\" \"1\" | \"1\"", "left recursion: rule 'e'");
    /* nullable prefix still recursion */
    compile_fails("root ::= n root \"x\" | \"y\"\nn ::= \"a\"?", "left recursion");
    compile_fails("root ::= \"a\" (\"b\" | \"c\"", "line 1 column 14: unclosed group");
    compile_fails("root ::= [a-", "unterminated character class");
    compile_fails("root ::= \"abc", "unterminated literal");
    compile_fails("root ::= x\nx ::= \"a\" x", "line 2 column 1: rule 'x' matches no finite text");
    compile_fails("root ::= \"a\"{10001}", "repetition bound above 10000");
    compile_fails("root ::= \"a\"{3,2}", "maximum is below the minimum");
    compile_fails("start ::= \"a\"", "no rule named 'root'");
    compile_fails("root ::= \"a\"\nroot ::= \"b\"", "line 2 column 1: rule 'root' is already defined at line 1 column 1");
    compile_fails("root ::= \"\\q\"", "unknown escape");
    compile_fails("root ::= \"\\uD800\"", "not a Unicode scalar value");
    compile_fails("root ::= [z-a]", "reversed");
    compile_fails("root ::= \"a\" ::=", "line 1 column 14");
    compile_fails("root ::= <[12", "expected ']>'");
    /* fine: right recursion, comments, rules used before their definition */
    pd_grammar_free(compile_ok("# a list\nroot ::= item (\",\" item)* # trailing\nitem ::= [a-z]+ | \"(\" root \")\"\n"));
    pd_grammar_free(compile_ok("root ::= \"a\"{10000}"));
    pd_grammar_free(compile_ok("root ::= x\nx ::= \"a\" x | \"\""));
    /* many rules: a chain r0 -> r1 -> ... through nullable prefixes, then a cycle closing it */
    enum { N = 3000 };
    size_t cap = (size_t)N * 40 + 64;
    char *text = malloc(cap);
    pd_strbuf b = {text, cap, 0};
    pd_strbuf_printf(&b, "root ::= r0\n");
    for (int i = 0; i < N - 1; i++) pd_strbuf_printf(&b, "r%d ::= \"a\"? r%d\n", i, i + 1);
    pd_strbuf_printf(&b, "r%d ::= \"b\"\n", N - 1);
    pd_grammar_free(compile_ok(text));
    b.len = 0;
    pd_strbuf_printf(&b, "root ::= r0\n");
    for (int i = 0; i < N - 1; i++) pd_strbuf_printf(&b, "r%d ::= \"a\"? r%d\n", i, i + 1);
    pd_strbuf_printf(&b, "r%d ::= \"b\" | r0 \"c\"\n", N - 1);
    compile_fails(text, "left recursion: rule 'r0' can reach itself without consuming text (r0 -> r1 -> r2 ->");
    free(text);
}

/* ---- vocabularies ------------------------------------------------------------ */

typedef struct vocab_spec {
    int32_t n;
    char **pieces;
    uint32_t *lens;
    uint8_t *kinds;
} vocab_spec;

static void spec_free(vocab_spec *s) {
    for (int32_t i = 0; i < s->n; i++) free(s->pieces[i]);
    free(s->pieces);
    free(s->lens);
    free(s->kinds);
}

static pd_grammar_vocab *make_vocab(const vocab_spec *s) {
    pd_grammar_vocab *v = NULL;
    pd_error err = {0};
    int rc = pd_grammar_vocab_create(s->n, (const char *const *)s->pieces, s->lens, s->kinds, &v, &err);
    cr_assert_eq(rc, PD_OK, "%s", err.msg);
    return v;
}

static int utf8_put(uint32_t cp, char *out) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) { /* surrogates too: the bytes a careless encoder would write */
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* ---- classes against every code point --------------------------------------- */

typedef struct class_case {
    const char *grammar;
    bool (*member)(uint32_t cp);
} class_case;

static bool is_scalar(uint32_t cp) {
    return cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
}
static bool m_any(uint32_t cp) {
    return is_scalar(cp);
}
static bool m_string_char(uint32_t cp) {
    return is_scalar(cp) && cp != '"' && cp != '\\' && cp >= 0x20;
}
static bool m_mixed(uint32_t cp) {
    return (cp >= 'a' && cp <= 'z') || cp == '_' || (cp >= 0x3B1 && cp <= 0x3C9) || (cp >= 0x4E00 && cp <= 0x9FFF) ||
           (cp >= 0x1F600 && cp <= 0x1F64F) || cp == 0xD7FF || cp == 0xE000 || cp == 0x10FFFF || cp == 0x7FF ||
           cp == 0x800 || cp == 0xFFFF || cp == 0x10000 || cp == ']' || cp == '-';
}
static bool m_not_ascii(uint32_t cp) {
    return is_scalar(cp) && cp > 0x7F;
}
static bool m_wide(uint32_t cp) { /* a range across every encoded length and the surrogates */
    return is_scalar(cp) && cp >= 0x41 && cp <= 0x10FFFE;
}

Test(grammar, utf8_classes_match_a_naive_decoder_on_every_code_point, .timeout = 600) {
    /* token i = the UTF-8 bytes of code point i, for 0 .. 0x10FFFF and a few past it */
    const uint32_t n = 0x110000 + 16;
    vocab_spec s = {.n = (int32_t)n};
    s.pieces = calloc(n, sizeof *s.pieces);
    s.lens = calloc(n, sizeof *s.lens);
    s.kinds = calloc(n, 1);
    for (uint32_t cp = 0; cp < n; cp++) {
        s.pieces[cp] = malloc(4);
        s.lens[cp] = (uint32_t)utf8_put(cp, s.pieces[cp]);
    }
    pd_grammar_vocab *v = make_vocab(&s);
    const class_case cases[] = {
        {"root ::= .", m_any},
        {"root ::= [^\"\\\\\\x00-\\x1f]", m_string_char},
        {"root ::= [a-z_α-ω\\u4e00-\\u9fff\\U0001F600-\\U0001F64F\\uD7FF\\uE000\\U0010FFFF\\u07ff\\u0800\\uffff"
         "\\U00010000\\]\\-]",
         m_mixed},
        {"root ::= [^\\x00-\\x7f]", m_not_ascii},
        {"root ::= [A-\\U0010FFFE]", m_wide},
    };
    float *logits = malloc(n * sizeof *logits);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        pd_grammar *g = compile_ok(cases[c].grammar);
        pd_grammar_matcher *m;
        pd_error err;
        cr_assert_eq(pd_grammar_matcher_create(g, v, &m, &err), PD_OK);
        for (uint32_t i = 0; i < n; i++) logits[i] = 0;
        cr_assert_eq(pd_grammar_matcher_mask(m, logits, 0, &err), PD_OK, "%s", err.msg);
        for (uint32_t cp = 0; cp < n; cp++) {
            bool want = cases[c].member(cp);
            int64_t after = -5;
            bool tried = pd_grammar_matcher_try(m, (int32_t)cp, &after);
            cr_assert_eq(tried, want, "%s: U+%X accepted %d, member %d", cases[c].grammar, cp, tried, want);
            cr_assert_eq(!isinf(logits[cp]), want, "%s: U+%X masked wrongly", cases[c].grammar, cp);
            if (want) cr_assert_eq(after, 0, "U+%X completes the text", cp);
        }
        pd_grammar_matcher_free(m);
        pd_grammar_free(g);
    }
    free(logits);
    pd_grammar_vocab_free(v);
    spec_free(&s);
}

/* ---- masks against brute force ------------------------------------------------ */

#define N_SPECIAL 3
#define N_EOG 2

/* Every single byte (ids 0..255), an empty piece, `extra` random pieces
 * over an alphabet of the grammars' characters, then special and EOG tokens. */
static void synthetic_vocab(vocab_spec *s, int extra, unsigned seed, int32_t *special0, int32_t *eog0) {
    static const char *alphabet[] = {"{", "}", "[", "]", "\"", ",", ":", " ", "\n", "\\", "0", "1", "5", "9", ".",
                                     "-", "+", "e", "E", "true", "false", "null", "a", "b", "c", "x", "y", "z", "!",
                                     "(", ")", "*", "/", "say ", "\\u00", "é", "中", "\t", "ab", "\": ", "\", \""};
    int n_alpha = (int)(sizeof alphabet / sizeof alphabet[0]);
    s->n = 256 + 1 + extra + N_SPECIAL + N_EOG;
    s->pieces = calloc((size_t)s->n, sizeof *s->pieces);
    s->lens = calloc((size_t)s->n, sizeof *s->lens);
    s->kinds = calloc((size_t)s->n, 1);
    srand(seed);
    int32_t i = 0;
    for (; i < 256; i++) {
        s->pieces[i] = malloc(1);
        s->pieces[i][0] = (char)i;
        s->lens[i] = 1;
    }
    s->pieces[i++] = strdup(""); /* an empty piece: never allowed */
    for (int k = 0; k < extra; k++, i++) {
        char buf[64];
        size_t len = 0;
        int parts = 1 + rand() % 4;
        for (int p = 0; p < parts; p++) {
            if (rand() % 10 == 0) {
                buf[len++] = (char)(rand() % 256); /* a raw byte, often not UTF-8 */
            } else {
                const char *a = alphabet[rand() % n_alpha];
                memcpy(buf + len, a, strlen(a));
                len += strlen(a);
            }
        }
        s->pieces[i] = malloc(len);
        memcpy(s->pieces[i], buf, len);
        s->lens[i] = (uint32_t)len;
    }
    *special0 = i;
    for (int k = 0; k < N_SPECIAL; k++, i++) {
        s->pieces[i] = strdup("<|special|>"); /* bytes a special token never matches by */
        s->lens[i] = 11;
        s->kinds[i] = PD_GTOK_SPECIAL;
    }
    *eog0 = i;
    for (int k = 0; k < N_EOG; k++, i++) {
        s->pieces[i] = strdup("");
        s->kinds[i] = PD_GTOK_EOG;
    }
}

/* The allowed set by brute force: every token tried on the current state. */
static int32_t brute_allowed(pd_grammar_matcher *m, int32_t n, int32_t budget, bool *allowed, int64_t *after) {
    int64_t cheapest = INT64_MAX;
    for (int32_t t = 0; t < n; t++) {
        allowed[t] = pd_grammar_matcher_try(m, t, &after[t]);
        if (allowed[t] && after[t] < cheapest) cheapest = after[t];
    }
    if (budget > 0) {
        int64_t limit = (int64_t)budget - 2;
        bool fits = false;
        for (int32_t t = 0; t < n; t++)
            if (allowed[t] && after[t] <= limit) fits = true;
        if (!fits) limit = cheapest;
        for (int32_t t = 0; t < n; t++)
            if (allowed[t] && after[t] > limit) allowed[t] = false;
    }
    int32_t count = 0;
    for (int32_t t = 0; t < n; t++) count += allowed[t];
    return count;
}

typedef struct walk_result {
    char text[4096];
    size_t len;
    bool ended;
} walk_result;

/* One random walk; at every step the mask must equal brute force. With
 * `collect`, the matcher moves its stacks to a fresh pool after every token,
 * and a walk without a budget avoids EOG and takes, every other step, a token
 * that opens something, for deeper states. */
static void random_walk(const pd_grammar *g, const pd_grammar_vocab *v, const vocab_spec *s, int32_t budget,
                        int max_steps, walk_result *res, const char *name, bool collect) {
    pd_grammar_matcher *m;
    pd_error err;
    cr_assert_eq(pd_grammar_matcher_create(g, v, &m, &err), PD_OK);
    int32_t n = s->n;
    float *logits = malloc((size_t)n * sizeof *logits);
    bool *allowed = malloc((size_t)n);
    int64_t *after = malloc((size_t)n * sizeof *after);
    res->len = 0;
    res->ended = false;
    for (int step = 0; step < max_steps; step++) {
        int32_t left = budget > 0 ? budget - step : 0;
        if (budget > 0 && left <= 0) break;
        int32_t want = brute_allowed(m, n, left, allowed, after);
        for (int32_t t = 0; t < n; t++) logits[t] = (float)(t % 7);
        int rc = pd_grammar_matcher_mask(m, logits, left, &err);
        if (want == 0) {
            cr_assert_eq(rc, PD_ERANGE, "%s: nothing allowed, mask said %d", name, rc);
            break;
        }
        cr_assert_eq(rc, PD_OK, "%s: %s", name, err.msg);
        int32_t pick = -1, seen = 0;
        for (int32_t t = 0; t < n; t++) {
            bool masked = isinf(logits[t]);
            cr_assert_eq(!masked, allowed[t],
                         "%s step %d budget %d: token %d ('%.*s', kind %u) mask %d brute %d (after %lld) text '%.*s'",
                         name, step, left, t, (int)s->lens[t], s->pieces[t], s->kinds[t], !masked, allowed[t],
                         (long long)after[t], (int)res->len, res->text);
            if (!masked) {
                cr_assert_eq(logits[t], (float)(t % 7), "an allowed logit is left as it was");
                if (rand() % ++seen == 0) pick = t;
            }
        }
        if (collect && budget == 0) { /* go on, and steer into structure: tokens that open something */
            int32_t opener = -1, n_opener = 0, other = -1, n_other = 0;
            for (int32_t t = 0; t < n; t++) {
                if (!allowed[t] || s->kinds[t] == PD_GTOK_EOG) continue;
                if (rand() % ++n_other == 0) other = t;
                if (s->kinds[t] == PD_GTOK_BYTES &&
                    (memchr(s->pieces[t], '{', s->lens[t]) || memchr(s->pieces[t], '[', s->lens[t]) ||
                     memchr(s->pieces[t], '"', s->lens[t]) || memchr(s->pieces[t], '(', s->lens[t])) &&
                    rand() % ++n_opener == 0)
                    opener = t;
            }
            if (opener >= 0 && (step == 0 || step % 2 == 1))
                pick = opener;
            else if (other >= 0)
                pick = other;
        }
        cr_assert_eq(pd_grammar_matcher_accept(m, pick, &err), PD_OK, "%s: %s", name, err.msg);
        if (collect) cr_assert_eq(pd_grammar_matcher_collect(m), PD_OK);
        if (s->kinds[pick] == PD_GTOK_EOG) {
            res->ended = true;
            break;
        }
        if (s->kinds[pick] == PD_GTOK_BYTES && res->len + s->lens[pick] < sizeof res->text) {
            memcpy(res->text + res->len, s->pieces[pick], s->lens[pick]);
            res->len += s->lens[pick];
        }
    }
    if (budget > 0 && max_steps > budget) { /* walked to the end of the budget: ended by an EOG */
        cr_assert(res->ended, "%s: a walk with budget %d did not end with an EOG: '%.*s'", name, budget, (int)res->len,
                  res->text);
    }
    /* after an EOG nothing more */
    if (res->ended) {
        cr_assert_eq(pd_grammar_matcher_mask(m, logits, 0, &err), PD_ERANGE);
        cr_assert_eq(pd_grammar_matcher_accept(m, 0, &err), PD_EINVAL);
    }
    free(logits);
    free(allowed);
    free(after);
    pd_grammar_matcher_free(m);
}

/* JSON (exponents of at most two digits, so jansson can hold every number) */
#define JSON_GBNF                                                                                       \
    "root   ::= ws value ws\n"                                                                          \
    "value  ::= object | array | string | number | \"true\" | \"false\" | \"null\"\n"                    \
    "object ::= \"{\" ws ( member ( ws \",\" ws member )* ws )? \"}\"\n"                                 \
    "member ::= string ws \":\" ws value\n"                                                             \
    "array  ::= \"[\" ws ( value ( ws \",\" ws value )* ws )? \"]\"\n"                                   \
    "string ::= \"\\\"\" ( [^\"\\\\\\x00-\\x1f] | \"\\\\\" ( [\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4} ) )* \"\\\"\"\n" \
    "number ::= \"-\"? ( \"0\" | [1-9] [0-9]* ) ( \".\" [0-9]+ )? ( [eE] [-+]? [0-9]{1,2} )?\n"             \
    "ws     ::= [ \\t\\n]*\n"

static void check_grammar(const char *name, const char *text, bool is_json, int walks, int max_steps) {
    vocab_spec s;
    int32_t special0, eog0;
    synthetic_vocab(&s, 2500, 1234, &special0, &eog0);
    pd_grammar_vocab *v = make_vocab(&s);
    char buf[2048];
    snprintf(buf, sizeof buf, text, special0, special0 + 1, 300);
    pd_grammar *g = compile_ok(buf);
    srand(42);
    for (int w = 0; w < walks; w++) {
        walk_result r;
        random_walk(g, v, &s, 0, max_steps, &r, name, w % 4 == 3);
        if (is_json && r.ended) {
            json_error_t je;
            json_t *doc = json_loadb(r.text, r.len, JSON_DECODE_ANY | JSON_ALLOW_NUL | JSON_DECODE_INT_AS_REAL, &je);
            cr_assert_not_null(doc, "%s: ended text is not JSON (%s): '%.*s'", name, je.text, (int)r.len, r.text);
            json_decref(doc);
        }
    }
    /* with a budget: every walk ends complete, by an EOG, within it */
    pd_grammar_matcher *m;
    pd_error err;
    cr_assert_eq(pd_grammar_matcher_create(g, v, &m, &err), PD_OK);
    int64_t min0 = pd_grammar_matcher_min_bytes(m);
    pd_grammar_matcher_free(m);
    for (int w = 0; w < walks; w++) {
        walk_result r;
        int32_t budget = (int32_t)min0 + 1 + (w % 3 == 0 ? 0 : rand() % 30);
        random_walk(g, v, &s, budget, budget + 1, &r, name, w % 4 == 1);
        if (is_json) {
            json_error_t je;
            json_t *doc = json_loadb(r.text, r.len, JSON_DECODE_ANY | JSON_ALLOW_NUL | JSON_DECODE_INT_AS_REAL, &je);
            cr_assert_not_null(doc, "%s: budget %d text is not JSON (%s): '%.*s'", name, budget, je.text, (int)r.len,
                               r.text);
            json_decref(doc);
        }
    }
    /* a budget too small from the start: still a token, the ones that shorten most */
    walk_result r;
    random_walk(g, v, &s, 1, 1, &r, name, false);
    cr_assert(r.ended || min0 > 0);
    pd_grammar_free(g);
    pd_grammar_vocab_free(v);
    spec_free(&s);
}

Test(grammar, mask_matches_brute_force_json, .timeout = 600) {
    check_grammar("json", JSON_GBNF, true, 40, 60);
}

/* JSON as llama.cpp's schema converter writes it: helper rules (char,
 * integer) that the compiler expands in place */
Test(grammar, mask_matches_brute_force_json_helper_rules, .timeout = 600) {
    check_grammar("json-char",
                  "root ::= ws value ws\n"
                  "value ::= object | array | string | number | (\"true\" | \"false\" | \"null\") space\n"
                  "object ::= \"{\" space ( string \":\" space value (\",\" space string \":\" space value)* )? \"}\" space\n"
                  "array ::= \"[\" space ( value (\",\" space value)* )? \"]\" space\n"
                  "string ::= \"\\\"\" char* \"\\\"\" space\n"
                  "char ::= [^\"\\\\\\x7F\\x00-\\x1F] | [\\\\] ([\"\\\\bfnrt] | \"u\" [0-9a-fA-F]{4})\n"
                  "number ::= integer (\".\" [0-9]+)? ([eE] [-+]? [0-9]{1,2})? space\n"
                  "integer ::= \"-\"? (\"0\" | [1-9] [0-9]{0,15})\n"
                  "space ::= | \" \" | \"\\n\" [ \\t]{0,20}\n"
                  "ws ::= [ \\t\\n]*\n",
                  true, 30, 60);
}

Test(grammar, mask_matches_brute_force_arithmetic, .timeout = 600) {
    check_grammar("arith",
                  "root ::= expr\nexpr ::= term ((\"+\" | \"-\") term)*\nterm ::= factor ((\"*\" | \"/\") factor)*\n"
                  "factor ::= num | \"(\" expr \")\" | \"-\" factor\nnum ::= [0-9]+ (\".\" [0-9]+)?\n",
                  false, 30, 50);
}

Test(grammar, mask_matches_brute_force_repetition_bounds, .timeout = 600) {
    check_grammar("repeat", "root ::= (\"ab\" | [x-z]){2,5} \"!\" [0-9]{3} (\"-\" [a-c]{0,2}){1,3} \" \"{0,}\n", false,
                  10, 30);
}

Test(grammar, mask_matches_brute_force_token_ids, .timeout = 600) {
    /* %d: two special tokens, then a byte token named by id (300) */
    check_grammar("tokens",
                  "root ::= \"say \" ( <[%d]> \"x\" | \"y\" <[%d]> )+ (<[%d]> \"!\")?\n", false, 10, 20);
}

Test(grammar, mask_matches_brute_force_ambiguous_alternatives, .timeout = 600) {
    check_grammar("ambiguous",
                  "root ::= a | b | c\na ::= \"ab\" \"c\"* | \"a\" [b-d]+ x\nb ::= (\"a\" \"b\"?)+ \"c\"? y\n"
                  "c ::= x y z\nx ::= \"a\"*\ny ::= \"b\"? | \"bc\"\nz ::= x \"c\" | \"\" | ws\nws ::= [ ]* [ ]*\n",
                  false, 12, 20);
}

Test(grammar, named_token_and_eog_accept) {
    vocab_spec s;
    int32_t special0, eog0;
    synthetic_vocab(&s, 10, 7, &special0, &eog0);
    pd_grammar_vocab *v = make_vocab(&s);
    char text[128];
    snprintf(text, sizeof text, "root ::= <[%d]> \"{\" \"}\"", special0);
    pd_grammar *g = compile_ok(text);
    pd_grammar_matcher *m;
    pd_error err;
    cr_assert_eq(pd_grammar_matcher_create(g, v, &m, &err), PD_OK);
    cr_assert_eq(pd_grammar_matcher_min_bytes(m), 3);
    cr_assert_eq(pd_grammar_matcher_accept(m, '{', &err), PD_EINVAL, "the special token comes first");
    cr_assert(strstr(err.msg, "cannot continue"), "%s", err.msg);
    cr_assert_eq(pd_grammar_matcher_accept(m, special0 + 1, &err), PD_EINVAL, "another special token");
    cr_assert_eq(pd_grammar_matcher_accept(m, eog0, &err), PD_EINVAL, "not complete yet");
    cr_assert_eq(pd_grammar_matcher_accept(m, special0, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_grammar_matcher_accept(m, '{', &err), PD_OK);
    cr_assert_not(pd_grammar_matcher_complete(m));
    cr_assert_eq(pd_grammar_matcher_min_bytes(m), 1);
    cr_assert_eq(pd_grammar_matcher_accept(m, '}', &err), PD_OK);
    cr_assert(pd_grammar_matcher_complete(m));
    cr_assert_eq(pd_grammar_matcher_accept(m, 256, &err), PD_EINVAL, "the empty piece");
    cr_assert_eq(pd_grammar_matcher_accept(m, s.n, &err), PD_EINVAL, "outside the vocabulary");
    cr_assert_eq(pd_grammar_matcher_accept(m, eog0 + 1, &err), PD_OK);
    cr_assert(pd_grammar_matcher_complete(m), "the text an EOG ended is complete");
    cr_assert_eq(pd_grammar_matcher_min_bytes(m), 0);
    pd_grammar_matcher_free(m);
    pd_grammar_stats st;
    pd_grammar_stats_get(g, &st);
    cr_assert_eq(st.states_cached, 0, "no mask was asked for");
    pd_grammar_free(g);
    pd_grammar_vocab_free(v);
    spec_free(&s);
}

Test(grammar, cache_is_shared_by_matchers) {
    vocab_spec s;
    int32_t special0, eog0;
    synthetic_vocab(&s, 200, 9, &special0, &eog0);
    pd_grammar_vocab *v = make_vocab(&s);
    pd_grammar *g = compile_ok(JSON_GBNF);
    float *logits = calloc((size_t)s.n, sizeof *logits);
    pd_error err;
    pd_grammar_stats a, b;
    for (int k = 0; k < 2; k++) {
        pd_grammar_matcher *m;
        cr_assert_eq(pd_grammar_matcher_create(g, v, &m, &err), PD_OK);
        cr_assert_eq(pd_grammar_matcher_mask(m, logits, 0, &err), PD_OK);
        cr_assert_eq(pd_grammar_matcher_accept(m, '[', &err), PD_OK);
        cr_assert_eq(pd_grammar_matcher_mask(m, logits, 0, &err), PD_OK);
        pd_grammar_matcher_free(m);
        pd_grammar_stats_get(g, k == 0 ? &a : &b);
    }
    cr_assert_gt(a.states_cached, 0);
    cr_assert_gt(a.cache_bytes, 0);
    cr_assert_eq(b.states_cached, a.states_cached, "the second matcher computes nothing new");
    cr_assert_gt(b.cache_hits, a.cache_hits);
    cr_assert_eq(b.cache_misses, a.cache_misses);
    free(logits);
    pd_grammar_free(g);
    pd_grammar_vocab_free(v);
    spec_free(&s);
}

/* A real vocabulary: llama-spm's 32000 pieces, JSON; mask vs brute force. */
Test(grammar, real_vocabulary_json_walks, .timeout = 600) {
    char path[1024];
    if (!th_shared_file("vocab/ggml-vocab-llama-spm.gguf", path, sizeof path)) cr_skip_test("no llama-spm vocab");
    pd_gguf *gg;
    pd_tokenizer *tok;
    pd_error err;
    cr_assert_eq(pd_gguf_open(path, &gg, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_tokenizer_load(gg, &tok, &err), PD_OK, "%s", err.msg);
    vocab_spec s = {.n = pd_tokenizer_n_vocab(tok)};
    s.pieces = calloc((size_t)s.n, sizeof *s.pieces);
    s.lens = calloc((size_t)s.n, sizeof *s.lens);
    s.kinds = calloc((size_t)s.n, 1);
    for (int32_t i = 0; i < s.n; i++) {
        char buf[256];
        int len = pd_token_to_piece(tok, i, false, buf, sizeof buf);
        cr_assert(len >= 0 && len < (int)sizeof buf);
        s.pieces[i] = malloc((size_t)len + 1);
        memcpy(s.pieces[i], buf, (size_t)len);
        s.lens[i] = (uint32_t)len;
        pd_token_type type = pd_tokenizer_token_type(tok, i);
        if (pd_tokenizer_is_eog(tok, i))
            s.kinds[i] = PD_GTOK_EOG;
        else if (type == PD_TOKEN_TYPE_CONTROL)
            s.kinds[i] = PD_GTOK_SPECIAL;
    }
    pd_grammar_vocab *v = make_vocab(&s);
    pd_grammar *g = compile_ok(JSON_GBNF);
    srand(5);
    for (int w = 0; w < 3; w++) {
        walk_result r;
        random_walk(g, v, &s, 60, 61, &r, "llama-spm json", false);
        json_error_t je;
        json_t *doc = json_loadb(r.text, r.len, JSON_DECODE_ANY | JSON_ALLOW_NUL | JSON_DECODE_INT_AS_REAL, &je);
        cr_assert_not_null(doc, "not JSON (%s): '%.*s'", je.text, (int)r.len, r.text);
        json_decref(doc);
    }
    pd_grammar_free(g);
    pd_grammar_vocab_free(v);
    spec_free(&s);
    pd_tokenizer_free(tok);
    pd_gguf_close(gg);
}

/* One grammar, its cache filled by several threads at once: every thread's
 * masks along the same token sequence equal those of a lone matcher. */
typedef struct replay {
    const pd_grammar *g;
    const pd_grammar_vocab *v;
    const int32_t *tokens;
    int n_tokens;
    const uint64_t *want; /* per step, the allowed set as bits */
    size_t words;
    int mismatches;
} replay;

static void mask_bits(pd_grammar_matcher *m, int32_t n, float *logits, uint64_t *bits) {
    pd_error err;
    for (int32_t t = 0; t < n; t++) logits[t] = 0;
    int rc = pd_grammar_matcher_mask(m, logits, 0, &err);
    memset(bits, 0, ((size_t)n + 63) / 64 * 8);
    if (rc) return;
    for (int32_t t = 0; t < n; t++)
        if (!isinf(logits[t])) bits[t / 64] |= 1ull << (t % 64);
}

static void *replay_thread(void *arg) {
    replay *r = arg;
    pd_grammar_matcher *m;
    pd_error err;
    int32_t n = pd_grammar_vocab_size(r->v);
    float *logits = malloc((size_t)n * sizeof *logits);
    uint64_t *bits = malloc(r->words * 8);
    if (pd_grammar_matcher_create(r->g, r->v, &m, &err)) {
        r->mismatches = -1;
        return NULL;
    }
    for (int i = 0; i < r->n_tokens; i++) {
        mask_bits(m, n, logits, bits);
        if (memcmp(bits, r->want + (size_t)i * r->words, r->words * 8)) r->mismatches++;
        if (pd_grammar_matcher_accept(m, r->tokens[i], &err)) r->mismatches++;
    }
    pd_grammar_matcher_free(m);
    free(logits);
    free(bits);
    return NULL;
}

Test(grammar, matchers_on_threads_share_one_grammar, .timeout = 300) {
    vocab_spec s;
    int32_t special0, eog0;
    synthetic_vocab(&s, 2500, 99, &special0, &eog0);
    pd_grammar_vocab *v = make_vocab(&s);
    size_t words = ((size_t)s.n + 63) / 64;
    enum { STEPS = 80, THREADS = 4 };
    int32_t tokens[STEPS];
    uint64_t *want = calloc(STEPS * words, 8);
    float *logits = malloc((size_t)s.n * sizeof *logits);
    /* the reference: one matcher on its own grammar */
    pd_grammar *ref = compile_ok(JSON_GBNF);
    pd_grammar_matcher *m;
    pd_error err;
    cr_assert_eq(pd_grammar_matcher_create(ref, v, &m, &err), PD_OK);
    srand(3);
    int n_tokens = 0;
    for (; n_tokens < STEPS; n_tokens++) {
        uint64_t *bits = want + (size_t)n_tokens * words;
        mask_bits(m, s.n, logits, bits);
        int32_t pick = -1, seen = 0;
        for (int32_t t = 0; t < s.n; t++)
            if ((bits[t / 64] >> (t % 64) & 1) && s.kinds[t] == PD_GTOK_BYTES && rand() % ++seen == 0) pick = t;
        if (pick < 0) break;
        tokens[n_tokens] = pick;
        cr_assert_eq(pd_grammar_matcher_accept(m, pick, &err), PD_OK);
    }
    pd_grammar_matcher_free(m);
    pd_grammar *shared = compile_ok(JSON_GBNF);
    pthread_t th[THREADS];
    replay r[THREADS];
    for (int i = 0; i < THREADS; i++) {
        r[i] = (replay){.g = shared, .v = v, .tokens = tokens, .n_tokens = n_tokens, .want = want, .words = words};
        cr_assert_eq(pthread_create(&th[i], NULL, replay_thread, &r[i]), 0);
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(th[i], NULL);
        cr_assert_eq(r[i].mismatches, 0, "thread %d: %d steps differ", i, r[i].mismatches);
    }
    pd_grammar_stats st;
    pd_grammar_stats_get(shared, &st);
    cr_assert_eq(st.cache_hits + st.cache_misses > 0, true);
    free(want);
    free(logits);
    pd_grammar_free(ref);
    pd_grammar_free(shared);
    pd_grammar_vocab_free(v);
    spec_free(&s);
}

/* Non-recursive rules are expanded where they are used (so a string's
 * `char` is never the top frame, whose every token would leave it); the
 * recursive ones stay references. */
Test(grammar, non_recursive_rules_are_expanded_in_place) {
    pd_grammar *g = compile_ok("root ::= value\nvalue ::= string | \"[\" value \"]\"\nstring ::= \"\\\"\" char* \"\\\"\"\n"
                               "char ::= [^\"\\\\] | \"\\\\\" [nt]\n");
    for (int32_t r = 0; r < g->n_rules; r++) {
        const pd_grule *ru = &g->rules[r];
        int64_t refs = 0;
        for (int32_t s = 0; s < ru->n_states; s++) refs += ru->states[s].n_ref;
        if (!strcmp(ru->name, "char") || !strcmp(ru->name, "string"))
            cr_assert_eq(ru->n_states, 1, "%s is expanded, not compiled on its own", ru->name);
        else if (!strcmp(ru->name, "value"))
            cr_assert_eq(refs, 1, "value refers only to itself (string is expanded)");
        else
            cr_assert_eq(refs, 1, "root refers to value");
    }
    pd_grammar_free(g);
}

/* Stacks as deep as the text is nested: 20000 open arrays, a collection in
 * the middle, then closed again. */
Test(grammar, deep_nesting, .timeout = 120) {
    vocab_spec s;
    int32_t special0, eog0;
    synthetic_vocab(&s, 100, 11, &special0, &eog0);
    pd_grammar_vocab *v = make_vocab(&s);
    pd_grammar *g = compile_ok(JSON_GBNF);
    pd_grammar_matcher *m;
    pd_error err;
    cr_assert_eq(pd_grammar_matcher_create(g, v, &m, &err), PD_OK);
    enum { DEPTH = 20000 };
    for (int i = 0; i < DEPTH; i++) cr_assert_eq(pd_grammar_matcher_accept(m, '[', &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_grammar_matcher_min_bytes(m), DEPTH, "one ']' per open array");
    cr_assert_eq(pd_grammar_matcher_collect(m), PD_OK);
    float *logits = calloc((size_t)s.n, sizeof *logits);
    cr_assert_eq(pd_grammar_matcher_mask(m, logits, 0, &err), PD_OK);
    cr_assert(!isinf(logits[']']) && !isinf(logits['[']) && isinf(logits['}']) && isinf(logits[eog0]));
    /* a budget of exactly the shortest completion plus the EOG: only ']'s */
    for (int32_t t = 0; t < s.n; t++) logits[t] = 0;
    cr_assert_eq(pd_grammar_matcher_mask(m, logits, DEPTH + 1, &err), PD_OK);
    for (int32_t t = 0; t < s.n; t++) {
        bool closes = s.kinds[t] == PD_GTOK_BYTES && s.lens[t] > 0;
        for (uint32_t b = 0; b < s.lens[t] && closes; b++) closes = s.pieces[t][b] == ']';
        cr_assert_eq(!isinf(logits[t]), closes, "token %d", t);
    }
    for (int i = 0; i < DEPTH; i++) cr_assert_eq(pd_grammar_matcher_accept(m, ']', &err), PD_OK, "%s", err.msg);
    cr_assert(pd_grammar_matcher_complete(m));
    cr_assert_eq(pd_grammar_matcher_accept(m, eog0, &err), PD_OK);
    free(logits);
    pd_grammar_matcher_free(m);
    pd_grammar_free(g);
    pd_grammar_vocab_free(v);
    spec_free(&s);
}
