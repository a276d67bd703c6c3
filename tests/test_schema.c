/* JSON Schema to grammar (grammar/schema.c, regex.c) and the direct
 * validator (grammar/validate.c).
 *
 * The grammar compiler lives elsewhere, so the generated text is checked
 * here by a small REFERENCE RECOGNIZER (a backtracking matcher of the
 * grammar subset schema.c emits, written for this test only; see "reference
 * recognizer" below). The cross-check: for a set of schemas, documents made
 * from the schema that the validator accepts are recognized, and for random
 * mutations of them, recognized implies "jansson parses it and the
 * validator accepts it" (the grammar is never wider than the schema). */
#include <criterion/criterion.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar.h"

/* ======================================================================
 * Reference recognizer (test only): parses grammar text of the subset
 * schema.c emits (rules, sequences, |, groups, * + ? {m,n}, "literals",
 * [classes], rule references) and matches a whole text by backtracking.
 * ====================================================================== */

enum { N_SEQ, N_ALT, N_REP, N_LIT, N_CLASS, N_DOT, N_REF };

typedef struct rn {
    int kind;
    struct rn **kids;
    int n;
    char lit[256]; /* N_LIT bytes, N_REF name */
    size_t len;
    uint32_t lo[64], hi[64];
    int nr;
    bool neg;
    int min, max; /* N_REP; max -1 unbounded */
    int rule;
} rn;

typedef struct rgram {
    char *names[1024];
    rn *bodies[1024];
    int n;
    rn *all[200000];
    int n_all;
} rgram;

static rn *new_node(rgram *g, int kind) {
    rn *n = calloc(1, sizeof *n);
    cr_assert_not_null(n);
    cr_assert_lt(g->n_all, 200000);
    g->all[g->n_all++] = n;
    n->kind = kind;
    return n;
}

static void add_kid(rn *p, rn *k) {
    p->kids = realloc(p->kids, (size_t)(p->n + 1) * sizeof *p->kids);
    p->kids[p->n++] = k;
}

static void skip_space(const char **p) {
    for (;;) {
        while (**p == ' ' || **p == '\n' || **p == '\t' || **p == '\r') (*p)++;
        if (**p != '#') return;
        while (**p && **p != '\n') (*p)++;
    }
}

static bool is_name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

static bool rule_starts(const char *p) {
    if (!is_name_char(*p)) return false;
    while (is_name_char(*p)) p++;
    while (*p == ' ' || *p == '\t' || *p == '\n') p++;
    return strncmp(p, "::=", 3) == 0;
}

static uint32_t parse_hex(const char **p, int digits) {
    uint32_t v = 0;
    for (int i = 0; i < digits; i++) {
        char c = **p;
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        cr_assert_geq(d, 0, "bad hex digit in grammar at '%.20s'", *p);
        v = v * 16 + (uint32_t)d;
        (*p)++;
    }
    return v;
}

/* One code point of a literal or class: an escape or a UTF-8 sequence. */
static uint32_t parse_char(const char **p) {
    const unsigned char *s = (const unsigned char *)*p;
    if (s[0] == '\\') {
        *p += 2;
        switch (s[1]) {
        case 'n': return '\n';
        case 'r': return '\r';
        case 't': return '\t';
        case 'x': return parse_hex(p, 2);
        case 'u': return parse_hex(p, 4);
        case 'U': return parse_hex(p, 8);
        default: return s[1];
        }
    }
    uint32_t cp;
    int n;
    if (s[0] < 0x80) cp = s[0], n = 1;
    else if ((s[0] & 0xE0) == 0xC0) cp = s[0] & 0x1F, n = 2;
    else if ((s[0] & 0xF0) == 0xE0) cp = s[0] & 0x0F, n = 3;
    else cp = s[0] & 0x07, n = 4;
    for (int i = 1; i < n; i++) cp = (cp << 6) | (s[i] & 0x3F);
    *p += n;
    return cp;
}

static size_t put_utf8(char *out, uint32_t cp) {
    if (cp < 0x80) return out[0] = (char)cp, 1;
    if (cp < 0x800) return out[0] = (char)(0xC0 | (cp >> 6)), out[1] = (char)(0x80 | (cp & 0x3F)), 2;
    if (cp < 0x10000)
        return out[0] = (char)(0xE0 | (cp >> 12)), out[1] = (char)(0x80 | ((cp >> 6) & 0x3F)),
               out[2] = (char)(0x80 | (cp & 0x3F)), 3;
    return out[0] = (char)(0xF0 | (cp >> 18)), out[1] = (char)(0x80 | ((cp >> 12) & 0x3F)),
           out[2] = (char)(0x80 | ((cp >> 6) & 0x3F)), out[3] = (char)(0x80 | (cp & 0x3F)), 4;
}

static rn *parse_alt(rgram *g, const char **p);

static rn *parse_atom(rgram *g, const char **p) {
    const char *s = *p;
    if (*s == '(') {
        (*p)++;
        rn *a = parse_alt(g, p);
        skip_space(p);
        cr_assert_eq(**p, ')', "expected ) at '%.30s'", *p);
        (*p)++;
        return a;
    }
    if (*s == '"') {
        rn *n = new_node(g, N_LIT);
        (*p)++;
        while (**p != '"') {
            cr_assert(**p, "unterminated literal");
            bool byte_escape = (*p)[0] == '\\' && (*p)[1] == 'x';
            uint32_t cp = parse_char(p);
            cr_assert_lt(n->len + 4, sizeof n->lit);
            if (byte_escape) n->lit[n->len++] = (char)cp; /* \xHH is a byte below 0x80 here */
            else n->len += put_utf8(n->lit + n->len, cp);
        }
        (*p)++;
        return n;
    }
    if (*s == '[') {
        rn *n = new_node(g, N_CLASS);
        (*p)++;
        if (**p == '^') {
            n->neg = true;
            (*p)++;
        }
        while (**p != ']') {
            cr_assert(**p, "unterminated class");
            uint32_t lo = parse_char(p), hi = lo;
            if (**p == '-' && (*p)[1] != ']') {
                (*p)++;
                hi = parse_char(p);
            }
            cr_assert_lt(n->nr, 64);
            n->lo[n->nr] = lo;
            n->hi[n->nr++] = hi;
        }
        (*p)++;
        return n;
    }
    if (*s == '.') {
        (*p)++;
        return new_node(g, N_DOT);
    }
    cr_assert(is_name_char(*s), "unexpected '%.30s' in grammar", s);
    rn *n = new_node(g, N_REF);
    while (is_name_char(**p)) n->lit[n->len++] = *(*p)++;
    n->lit[n->len] = '\0';
    n->rule = -1;
    return n;
}

static rn *parse_seq(rgram *g, const char **p) {
    rn *seq = new_node(g, N_SEQ);
    for (;;) {
        skip_space(p);
        char c = **p;
        if (!c || c == ')' || c == '|' || rule_starts(*p)) return seq;
        rn *a = parse_atom(g, p);
        for (;;) {
            c = **p;
            int m, x;
            if (c == '*') m = 0, x = -1;
            else if (c == '+') m = 1, x = -1;
            else if (c == '?') m = 0, x = 1;
            else if (c == '{') {
                (*p)++;
                m = (int)strtol(*p, (char **)p, 10);
                x = m;
                if (**p == ',') {
                    (*p)++;
                    x = **p == '}' ? -1 : (int)strtol(*p, (char **)p, 10);
                }
                cr_assert_eq(**p, '}');
            } else break;
            (*p)++;
            rn *r = new_node(g, N_REP);
            r->min = m;
            r->max = x;
            add_kid(r, a);
            a = r;
        }
        add_kid(seq, a);
    }
}

static rn *parse_alt(rgram *g, const char **p) {
    rn *alt = new_node(g, N_ALT);
    add_kid(alt, parse_seq(g, p));
    while (**p == '|') {
        (*p)++;
        add_kid(alt, parse_seq(g, p));
    }
    return alt;
}

static rgram *rgram_parse(const char *text) {
    rgram *g = calloc(1, sizeof *g);
    const char *p = text;
    for (;;) {
        skip_space(&p);
        if (!*p) break;
        const char *start = p;
        while (is_name_char(*p)) p++;
        cr_assert_gt(p - start, 0, "expected a rule name at '%.30s'", start);
        cr_assert_lt(g->n, 1024);
        g->names[g->n] = strndup(start, (size_t)(p - start));
        for (int i = 0; i < g->n; i++) cr_assert_str_neq(g->names[i], g->names[g->n], "rule defined twice");
        skip_space(&p);
        cr_assert(strncmp(p, "::=", 3) == 0, "expected ::= at '%.30s'", p);
        p += 3;
        g->bodies[g->n++] = parse_alt(g, &p);
    }
    for (int i = 0; i < g->n_all; i++) {
        rn *n = g->all[i];
        if (n->kind != N_REF) continue;
        for (int r = 0; r < g->n; r++)
            if (strcmp(g->names[r], n->lit) == 0) n->rule = r;
        cr_assert_geq(n->rule, 0, "rule %s is used but not defined", n->lit);
    }
    return g;
}

static void rgram_free(rgram *g) {
    for (int i = 0; i < g->n_all; i++) {
        free(g->all[i]->kids);
        free(g->all[i]);
    }
    for (int i = 0; i < g->n; i++) free(g->names[i]);
    free(g);
}

typedef struct kont {
    int kind; /* 0: rest of a sequence, 1: one more repetition done */
    const rn *node;
    int i;
    size_t start;
    const struct kont *next;
} kont;

typedef struct rmatch {
    const rgram *g;
    const unsigned char *in;
    size_t len;
    long steps;
} rmatch;

static bool match(rmatch *m, const rn *n, size_t pos, const kont *k);

static bool rep(rmatch *m, const rn *n, int count, size_t pos, const kont *k) {
    if (n->max < 0 || count < n->max) {
        kont nk = {1, n, count + 1, pos, k};
        if (match(m, n->kids[0], pos, &nk)) return true;
    }
    return count >= n->min && (k ? (match(m, NULL, pos, k)) : pos == m->len);
}

/* Continue with k at pos (node == NULL). */
static bool resume(rmatch *m, size_t pos, const kont *k) {
    if (!k) return pos == m->len;
    if (k->kind == 0) {
        if (k->i == k->node->n) return resume(m, pos, k->next);
        kont nk = {0, k->node, k->i + 1, 0, k->next};
        return match(m, k->node->kids[k->i], pos, &nk);
    }
    /* An empty repetition adds nothing once the minimum is reached. */
    if (pos == k->start && k->i > k->node->min) return false;
    return rep(m, k->node, k->i, pos, k->next);
}

static bool decode(const unsigned char *s, size_t left, uint32_t *cp, size_t *n) {
    if (!left) return false;
    if (s[0] < 0x80) return *cp = s[0], *n = 1, true;
    int len = (s[0] & 0xE0) == 0xC0 ? 2 : (s[0] & 0xF0) == 0xE0 ? 3 : (s[0] & 0xF8) == 0xF0 ? 4 : 0;
    if (!len || (size_t)len > left) return false;
    uint32_t v = s[0] & (0x7F >> len);
    for (int i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return false;
        v = (v << 6) | (s[i] & 0x3F);
    }
    static const uint32_t min_cp[] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < min_cp[len] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return false;
    return *cp = v, *n = (size_t)len, true;
}

static bool match(rmatch *m, const rn *n, size_t pos, const kont *k) {
    cr_assert_lt(++m->steps, 20000000, "the reference recognizer ran too long");
    if (!n) return resume(m, pos, k);
    switch (n->kind) {
    case N_LIT:
        if (pos + n->len > m->len || memcmp(m->in + pos, n->lit, n->len) != 0) return false;
        return resume(m, pos + n->len, k);
    case N_CLASS:
    case N_DOT: {
        uint32_t cp;
        size_t len;
        if (!decode(m->in + pos, m->len - pos, &cp, &len)) return false;
        if (n->kind == N_CLASS) {
            bool in = false;
            for (int i = 0; i < n->nr; i++) in = in || (cp >= n->lo[i] && cp <= n->hi[i]);
            if (in == n->neg) return false;
        }
        return resume(m, pos + len, k);
    }
    case N_SEQ: {
        kont nk = {0, n, 0, 0, k};
        return resume(m, pos, &nk);
    }
    case N_ALT:
        for (int i = 0; i < n->n; i++)
            if (match(m, n->kids[i], pos, k)) return true;
        return false;
    case N_REP: return rep(m, n, 0, pos, k);
    default: return match(m, m->g->bodies[n->rule], pos, k);
    }
}

/* Whether text is a whole match of rule `start`. */
static bool recognize(const rgram *g, const char *start, const char *text, size_t len) {
    for (int r = 0; r < g->n; r++)
        if (strcmp(g->names[r], start) == 0) {
            rmatch m = {g, (const unsigned char *)text, len, 0};
            return match(&m, g->bodies[r], 0, NULL);
        }
    cr_assert_fail("no rule %s", start);
    return false;
}

TestSuite(schema);

/* The reference recognizer itself, on a hand-written grammar. */
Test(schema, reference_recognizer) {
    rgram *g = rgram_parse("# comment\ns ::= \"x\" d{2,3} ( \"y\" | \"z\" )? t\n"
                           "d ::= [0-9]\nt ::= [^a-c\\x00] ( \"\\\\\" | \"\\u00e9\" )* | \".\"\n");
    const char *yes[] = {"x12.", "x123z.", "x12d", "x12d\\\xc3\xa9\\", "x99y."};
    const char *no[] = {"x1.", "x1234.", "x12a", "x12", "x12.\xc3\xa9.", "x12d\xc3", "x12yz."};
    for (size_t i = 0; i < sizeof yes / sizeof *yes; i++) cr_expect(recognize(g, "s", yes[i], strlen(yes[i])), "%s", yes[i]);
    for (size_t i = 0; i < sizeof no / sizeof *no; i++) cr_expect(!recognize(g, "s", no[i], strlen(no[i])), "%s", no[i]);
    rgram_free(g);
}

/* ======================================================================
 * Helpers
 * ====================================================================== */

static json_t *J(const char *text) {
    json_error_t je;
    json_t *v = json_loads(text, JSON_DECODE_ANY, &je);
    cr_assert_not_null(v, "test JSON %s: %s", text, je.text);
    return v;
}

static char *grammar_of(const char *schema_text, const char *prefix) {
    json_t *s = J(schema_text);
    char *out = NULL;
    pd_error err = {0};
    int rc = pd_json_schema_grammar(s, prefix, &out, &err);
    cr_assert_eq(rc, PD_OK, "%s: %s", schema_text, err.msg);
    json_decref(s);
    return out;
}

/* The code and message of a refused schema. */
static int refuse(const char *schema_text, pd_error *err) {
    json_t *s = J(schema_text);
    char *out = NULL;
    int rc = pd_json_schema_grammar(s, "root", &out, err);
    cr_assert_null(out);
    json_decref(s);
    return rc;
}

static int validate_text(const char *schema_text, const char *doc_text, pd_error *err) {
    json_t *s = J(schema_text), *d = J(doc_text);
    int rc = pd_json_schema_validate(s, d, err);
    json_decref(s);
    json_decref(d);
    return rc;
}

/* jansson parses it and the validator accepts it. */
static bool valid_doc(const json_t *schema, const char *text, size_t len) {
    json_error_t je;
    json_t *d = json_loadb(text, len, JSON_DECODE_ANY, &je);
    if (!d) return false;
    pd_error err = {0};
    bool ok = pd_json_schema_validate(schema, d, &err) == PD_OK;
    json_decref(d);
    return ok;
}

/* ======================================================================
 * Documents made from a schema (random, seeded)
 * ====================================================================== */

typedef struct dgen {
    uint64_t rng;
    const json_t *root;
    const char *const *samples; /* strings to try for patterns */
    char buf[1 << 16];
    size_t len;
} dgen;

static uint32_t rnd(dgen *d, uint32_t n) {
    d->rng = d->rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(d->rng >> 33) % n;
}

static void put(dgen *d, const char *s) {
    size_t n = strlen(s);
    cr_assert_lt(d->len + n, sizeof d->buf);
    memcpy(d->buf + d->len, s, n);
    d->len += n;
}

static void put_ws(dgen *d) {
    static const char *const ws[] = {"", "", " ", "\n", "\n  ", "\n\t\t", "\n                    "};
    put(d, ws[rnd(d, 7)]);
}

static void put_json(dgen *d, const json_t *v) {
    char *t = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    put(d, t);
    free(t);
}

static void gen_any(dgen *d, int depth);

static void gen_string_body(dgen *d, int min, int max, bool plain) {
    /* characters, in several spellings when the schema is a plain string */
    static const char *const canonical[] = {"a", "Z", " ", "\\\"", "\\\\", "\\n", "\xc3\xa9", "\xf0\x9f\x98\x80", "/", "\\u001f"};
    static const char *const other[] = {"\\u0041", "\\/", "\\u00e9", "\\ud83d\\ude00", "\\b"};
    if (max < 0) max = min + 6;
    int n = min + (int)rnd(d, (uint32_t)(max - min + 1));
    for (int i = 0; i < n; i++) {
        /* \ud83d\ude00 is one character written as a surrogate pair: the
         * grammar leaves surrogate escapes out, so only with !plain. */
        if (plain && rnd(d, 4) == 0) put(d, other[rnd(d, 3)]);
        else put(d, canonical[rnd(d, 10)]);
    }
}

static void gen_value(dgen *d, const json_t *s, int depth);

static void gen_typed(dgen *d, const json_t *s, const char *type, int depth) {
    if (strcmp(type, "null") == 0) put(d, "null");
    else if (strcmp(type, "boolean") == 0) put(d, rnd(d, 2) ? "true" : "false");
    else if ((strcmp(type, "integer") == 0 || strcmp(type, "number") == 0) &&
             (json_object_get(s, "minimum") || json_object_get(s, "maximum") ||
              json_object_get(s, "exclusiveMinimum") || json_object_get(s, "exclusiveMaximum"))) {
        /* near a bound (the validator filters what falls outside) */
        static const char *const keys[] = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"};
        const json_t *b = NULL;
        for (int tries = 0; !b && tries < 16; tries++) b = json_object_get(s, keys[rnd(d, 4)]);
        long long base = json_is_integer(b) ? (long long)json_integer_value(b) : (long long)json_number_value(b);
        static const long long deltas[] = {0, 1, -1, 2, -2, 9, -9, 10, -10, 99, -99, 1000, -1000, 123456};
        long long v = base + deltas[rnd(d, 14)];
        char text[64];
        if (strcmp(type, "number") == 0 && rnd(d, 2)) {
            static const char *const fractions[] = {".5", ".000001", ".0", ".999999", ".25", ".000"};
            snprintf(text, sizeof text, "%lld%s", v, fractions[rnd(d, 6)]);
        } else {
            snprintf(text, sizeof text, "%lld", v);
        }
        put(d, text);
    } else if (strcmp(type, "string") == 0 && json_object_get(s, "format")) {
        /* per format: mostly valid, some not */
        static const char *const dates[] = {"\"2024-02-29\"", "\"2023-02-29\"", "\"1999-12-31\"", "\"2021-04-31\""};
        static const char *const times[] = {"\"23:59:59Z\"", "\"00:00:00.123+05:30\"", "\"24:00:00Z\"", "\"12:30:00\""};
        static const char *const date_times[] = {"\"2024-01-15T08:30:00Z\"", "\"2024-01-15T08:30:00.5-07:00\"",
                                                 "\"2000-02-29T00:00:00+00:00\"", "\"2024-13-15T08:30:00Z\""};
        static const char *const uuids[] = {"\"123e4567-e89b-12d3-a456-426614174000\"",
                                            "\"123E4567-E89B-12D3-A456-426614174000\"",
                                            "\"00000000-0000-0000-0000-000000000000\"",
                                            "\"123e4567e89b12d3a456426614174000\""};
        const char *f = json_string_value(json_object_get(s, "format"));
        const char *const *pool = strcmp(f, "date") == 0 ? dates : strcmp(f, "time") == 0 ? times
                                 : strcmp(f, "date-time") == 0 ? date_times : uuids;
        put(d, pool[rnd(d, 4)]);
    } else if (strcmp(type, "integer") == 0) {
        static const char *const v[] = {"0", "7", "-42", "123456789012345678", "-1"};
        put(d, v[rnd(d, 5)]);
    } else if (strcmp(type, "number") == 0) {
        static const char *const v[] = {"0", "-3.25", "1e5", "2.5E-3", "12", "-0.0", "6.02e+23"};
        put(d, v[rnd(d, 7)]);
    } else if (strcmp(type, "string") == 0) {
        const json_t *pattern = json_object_get(s, "pattern");
        if (pattern && d->samples) {
            size_t n = 0;
            while (d->samples[n]) n++;
            json_t *str = json_string(d->samples[rnd(d, (uint32_t)n)]);
            put_json(d, str);
            json_decref(str);
            return;
        }
        const json_t *lo = json_object_get(s, "minLength"), *hi = json_object_get(s, "maxLength");
        put(d, "\"");
        gen_string_body(d, lo ? (int)json_integer_value(lo) : 0, hi ? (int)json_integer_value(hi) : -1, !pattern);
        put(d, "\"");
    } else if (strcmp(type, "array") == 0) {
        const json_t *lo = json_object_get(s, "minItems"), *hi = json_object_get(s, "maxItems");
        int min = lo ? (int)json_integer_value(lo) : 0, max = hi ? (int)json_integer_value(hi) : min + 3;
        if (depth > 4) max = min;
        int n = min + (int)rnd(d, (uint32_t)(max - min + 1));
        const json_t *items = json_object_get(s, "items"), *prefix = json_object_get(s, "prefixItems");
        if (prefix && !hi) n = (int)rnd(d, (uint32_t)json_array_size(prefix) + 3);
        put(d, "[");
        put_ws(d);
        for (int i = 0; i < n; i++) {
            if (i) {
                put(d, ",");
                put_ws(d);
            }
            if (prefix && (size_t)i < json_array_size(prefix)) gen_value(d, json_array_get(prefix, (size_t)i), depth + 1);
            else if (json_is_false(items)) gen_any(d, depth + 1);
            else if (items) gen_value(d, items, depth + 1);
            else gen_any(d, depth + 1);
            put_ws(d);
        }
        put(d, "]");
    } else {
        const json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
        const json_t *add = json_object_get(s, "additionalProperties");
        int members = 0;
        put(d, "{");
        put_ws(d);
        const char *key;
        const json_t *sub;
        json_object_foreach((json_t *)props, key, sub) {
            bool required = false;
            size_t i;
            const json_t *r;
            json_array_foreach(req, i, r) required = required || strcmp(json_string_value(r), key) == 0;
            if (!required && (depth > 3 || rnd(d, 2))) continue;
            if (members++) {
                put(d, ",");
                put_ws(d);
            }
            json_t *k = json_string(key);
            put_json(d, k);
            json_decref(k);
            put_ws(d);
            put(d, ":");
            put_ws(d);
            gen_value(d, sub, depth + 1);
            put_ws(d);
        }
        size_t ri;
        const json_t *r;
        json_array_foreach(req, ri, r) {
            /* required but not declared: a value of additionalProperties */
            if (props && json_object_get(props, json_string_value(r))) continue;
            if (members++) {
                put(d, ",");
                put_ws(d);
            }
            put_json(d, r);
            put(d, ":");
            if (add && !json_is_true(add)) gen_value(d, add, depth + 1);
            else gen_any(d, depth + 1);
        }
        if (!json_is_false(add) && depth <= 3) {
            static const char *const keys[] = {"x", "zz", "n", "names", "\xc3\xa9t\xc3\xa9", "a b"};
            int n = (int)rnd(d, 3);
            for (int i = 0; i < n; i++) {
                const char *k = keys[rnd(d, 6)];
                if (props && json_object_get(props, k)) continue;
                if (members++) {
                    put(d, ",");
                    put_ws(d);
                }
                json_t *kj = json_string(k);
                put_json(d, kj);
                json_decref(kj);
                put_ws(d);
                put(d, ":");
                put_ws(d);
                if (add && !json_is_true(add)) gen_value(d, add, depth + 1);
                else gen_any(d, depth + 1);
                put_ws(d);
            }
        }
        put(d, "}");
    }
}

static void gen_any(dgen *d, int depth) {
    static const char *const types[] = {"null", "boolean", "integer", "number", "string", "array", "object"};
    json_t *empty = json_object();
    gen_typed(d, empty, types[rnd(d, depth > 2 ? 5 : 7)], depth + 1);
    json_decref(empty);
}

static void gen_value(dgen *d, const json_t *s, int depth) {
    if (json_is_true(s) || (json_is_object(s) && json_object_size(s) == 0)) {
        gen_any(d, depth);
        return;
    }
    const json_t *v;
    if ((v = json_object_get(s, "$ref"))) {
        const char *ref = json_string_value(v);
        const json_t *target = d->root;
        if (strcmp(ref, "#") != 0) {
            const char *name = strrchr(ref, '/') + 1;
            const json_t *defs = json_object_get(d->root, strstr(ref, "$defs") ? "$defs" : "definitions");
            target = json_object_get(defs, name);
        }
        gen_value(d, target, depth + 1);
        return;
    }
    if ((v = json_object_get(s, "allOf"))) {
        gen_value(d, json_array_get(v, 0), depth + 1);
        return;
    }
    if ((v = json_object_get(s, "anyOf")) || (v = json_object_get(s, "oneOf"))) {
        /* deep down, the last branch (the tests put the leaf there) */
        size_t n = json_array_size(v);
        gen_value(d, json_array_get(v, depth > 3 ? n - 1 : rnd(d, (uint32_t)n)), depth + 1);
        return;
    }
    if ((v = json_object_get(s, "const"))) {
        put_json(d, v);
        return;
    }
    if ((v = json_object_get(s, "enum"))) {
        put_json(d, json_array_get(v, rnd(d, (uint32_t)json_array_size(v))));
        return;
    }
    const json_t *type = json_object_get(s, "type");
    if (json_is_string(type)) {
        gen_typed(d, s, json_string_value(type), depth);
    } else if (json_is_array(type)) {
        gen_typed(d, s, json_string_value(json_array_get(type, rnd(d, (uint32_t)json_array_size(type)))), depth);
    } else if (json_object_get(s, "properties") || json_object_get(s, "additionalProperties")) {
        gen_typed(d, s, "object", depth);
    } else if (json_object_get(s, "items") || json_object_get(s, "minItems") || json_object_get(s, "maxItems") ||
               json_object_get(s, "prefixItems")) {
        gen_typed(d, s, "array", depth);
    } else if (json_object_get(s, "pattern") || json_object_get(s, "minLength") || json_object_get(s, "maxLength") ||
               json_object_get(s, "format")) {
        gen_typed(d, s, "string", depth);
    } else if (json_object_get(s, "minimum") || json_object_get(s, "maximum") ||
               json_object_get(s, "exclusiveMinimum") || json_object_get(s, "exclusiveMaximum")) {
        gen_typed(d, s, "number", depth);
    } else {
        gen_any(d, depth);
    }
}

/* ======================================================================
 * The cross-check
 * ====================================================================== */

typedef struct xcase {
    const char *schema;
    const char *const *valid;   /* hand-written documents the validator accepts */
    const char *const *invalid; /* hand-written documents it rejects */
    const char *const *samples; /* strings to try where there is a pattern */
} xcase;

/* Returns how many generated documents were valid. */
static int cross_check(const xcase *c, int n_docs) {
    json_t *schema = J(c->schema);
    char *text = grammar_of(c->schema, "t");
    rgram *g = rgram_parse(text);
    int n_valid = 0, n_mutants_ok = 0;
    for (const char *const *v = c->valid; v && *v; v++) {
        cr_assert(valid_doc(schema, *v, strlen(*v)), "%s: the validator rejects the valid %s", c->schema, *v);
        cr_assert(recognize(g, "t", *v, strlen(*v)), "%s: the grammar rejects the valid %s\n%s", c->schema, *v, text);
    }
    for (const char *const *v = c->invalid; v && *v; v++) {
        cr_assert(!valid_doc(schema, *v, strlen(*v)), "%s: the validator accepts the invalid %s", c->schema, *v);
        cr_assert(!recognize(g, "t", *v, strlen(*v)), "%s: the grammar accepts the invalid %s\n%s", c->schema, *v,
                  text);
    }
    static dgen d;
    memset(&d, 0, sizeof d);
    d.rng = 0x9e3779b97f4a7c15ULL;
    d.root = schema;
    d.samples = c->samples;
    static const char junk[] = ",:{}[]\"\\ 0a-.e\n\x01\xc3";
    for (int i = 0; i < n_docs; i++) {
        d.len = 0;
        gen_value(&d, schema, 0);
        char doc[1 << 16];
        size_t len = d.len;
        memcpy(doc, d.buf, len);
        if (valid_doc(schema, doc, len)) {
            n_valid++;
            cr_assert(recognize(g, "t", doc, len), "%s: the grammar rejects the valid %.*s\n%s", c->schema, (int)len,
                      doc, text);
        }
        /* Mutants: whatever the grammar accepts must parse and validate. */
        for (int k = 0; k < 8; k++) {
            char mut[(1 << 16) + 8];
            size_t mlen = len, at = len ? rnd(&d, (uint32_t)len) : 0;
            memcpy(mut, doc, len);
            switch (rnd(&d, 4)) {
            case 0: /* delete a byte */
                if (mlen) {
                    memmove(mut + at, mut + at + 1, mlen - at - 1);
                    mlen--;
                }
                break;
            case 1: /* insert a byte */
                memmove(mut + at + 1, mut + at, mlen - at);
                mut[at] = junk[rnd(&d, sizeof junk - 1)];
                mlen++;
                break;
            case 2: /* replace a byte */
                if (mlen) mut[at] = junk[rnd(&d, sizeof junk - 1)];
                break;
            default: { /* cut the tail */
                mlen = at;
                break;
            }
            }
            if (recognize(g, "t", mut, mlen) && ++n_mutants_ok)
                cr_assert(valid_doc(schema, mut, mlen), "%s: the grammar accepts %.*s, which is not valid\n%s",
                          c->schema, (int)mlen, mut, text);
        }
    }
    cr_log_info("%s: %d of %d made documents valid, %d of %d mutants recognized", c->schema, n_valid, n_docs,
                n_mutants_ok, n_docs * 8);
    rgram_free(g);
    free(text);
    json_decref(schema);
    return n_valid;
}

#define LIST(...) ((const char *const[]){__VA_ARGS__, NULL})

static const char *const pattern_samples[] = {
    "abc@example.com", "x@y.org", "a@b.net", "@x.com", "abc", "12345", "1234", "123456", "a1234b", "abc123",
    "a\"c",            "a\nc",    "abc\x01", "$10",    "$10.50", "$1.5", "",       "d",      "zzz",    "a.c", "a\\c",
    "\xc3\xa9t\xc3\xa9", "a\xf0\x9f\x98\x80" "c", NULL};

Test(schema, cross_check_objects) {
    const xcase cases[] = {
        {.schema = "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"minLength\":1,\"maxLength\":8},"
                   "\"age\":{\"type\":\"integer\"},\"address\":{\"type\":\"object\",\"properties\":{\"city\":{"
                   "\"type\":\"string\"},\"zip\":{\"type\":\"string\",\"pattern\":\"^[0-9]{5}$\"}},\"required\":["
                   "\"city\"],\"additionalProperties\":false}},\"required\":[\"name\",\"address\"]}",
         .valid = LIST("{\"name\":\"Ann\",\"address\":{\"city\":\"Oslo\"}}",
                       "{\"name\": \"Ann\", \"age\": 30, \"address\": {\"city\": \"Oslo\", \"zip\": \"01234\"}, \"x\": [1]}",
                       "{\n  \"name\": \"\\u00e9\",\n  \"address\": {\n    \"city\": \"\"\n  }\n}"),
         .invalid = LIST("{\"address\":{\"city\":\"Oslo\"}}", "{\"name\":\"\",\"address\":{\"city\":\"Oslo\"}}",
                         "{\"name\":\"Ann\",\"address\":{\"city\":\"Oslo\",\"zip\":\"1234\"}}",
                         "{\"name\":\"Ann\",\"address\":{\"city\":\"Oslo\",\"x\":1}}",
                         "{\"name\":\"Ann\",\"age\":1.5,\"address\":{\"city\":\"Oslo\"}}",
                         "{\"name\":\"Ann\",\"address\":{\"city\":\"Oslo\"},}",
                         "{\"name\":\"123456789\",\"address\":{\"city\":\"Oslo\"}}"),
         .samples = pattern_samples},
        {.schema = "{\"properties\":{\"a\":{\"type\":\"boolean\"},\"b\":{\"type\":\"null\"},\"c\":{\"type\":"
                   "\"number\"}},\"additionalProperties\":false}",
         .valid = LIST("{}", "{\"c\":1}", "{\"a\":true,\"c\":-2.5e3}", "{\"b\":null,\"c\":0}", "{ }"),
         .invalid = LIST("{\"d\":1}", "{,\"c\":1}", "{\"a\":true,}", "{\"a\":1}")},
        {.schema = "{\"type\":\"object\",\"properties\":{\"id\":{\"type\":\"integer\"}},\"required\":[\"id\"],"
                   "\"additionalProperties\":{\"type\":\"string\",\"maxLength\":3}}",
         .valid = LIST("{\"id\":1}", "{\"id\":1,\"idx\":\"abc\",\"i\":\"\"}"),
         .invalid = LIST("{\"id\":1,\"x\":\"abcd\"}", "{\"id\":1,\"x\":2}", "{\"x\":\"a\"}")},
        {.schema = "{\"type\":\"object\",\"properties\":{\"a\":{\"const\":1},\"ab\":{\"type\":\"string\"},\"abc\":{"
                   "\"type\":\"array\"}},\"required\":[\"ab\"]}",
         .valid = LIST("{\"ab\":\"\"}", "{\"a\":1,\"ab\":\"x\",\"abc\":[],\"abcd\":{},\"b\":0,\"\":1}"),
         .invalid = LIST("{\"a\":1}", "{\"ab\":\"\",\"a\":2}", "{\"ab\":\"\",\"abc\":{}}", "{\"ab\":1}")},
        {.schema = "{\"type\":\"object\",\"required\":[\"k\"]}",
         .valid = LIST("{\"k\":[{}]}"),
         .invalid = LIST("{}", "{\"j\":1}")},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        cr_expect_gt(cross_check(&cases[i], 300), 50, "%s: too few valid documents were made", cases[i].schema);
}

Test(schema, cross_check_arrays_enums_any_of) {
    const xcase cases[] = {
        {.schema = "{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":2,\"maxItems\":4}",
         .valid = LIST("[1,2]", "[1, 2, 3, 4]", "[\n  0,\n  -1\n]"),
         .invalid = LIST("[1]", "[1,2,3,4,5]", "[1,\"2\"]", "[1,2,]", "[]")},
        {.schema = "{\"type\":\"array\",\"maxItems\":1}", .valid = LIST("[]", "[{\"a\":[null]}]"),
         .invalid = LIST("[1,2]", "{}")},
        {.schema = "{\"type\":\"array\",\"items\":{\"enum\":[\"x\",1,null,[1,2],{\"k\":\"v\"}]},\"maxItems\":3}",
         .valid = LIST("[]", "[\"x\",[1,2],{\"k\":\"v\"}]"), .invalid = LIST("[2]", "[[1]]", "[{\"k\":\"w\"}]")},
        {.schema = "{\"type\":\"array\",\"maxItems\":0}", .valid = LIST("[]", "[ ]"), .invalid = LIST("[1]")},
        {.schema = "{\"enum\":[\"red\",\"green\",\"bl\\\"ue\",42,true,null,{\"a\":[1]}]}",
         .valid = LIST("\"red\"", "\"bl\\\"ue\"", "42", "null", "{\"a\":[1]}"),
         .invalid = LIST("\"blue\"", "41", "false", "{\"a\":[2]}")},
        {.schema = "{\"type\":\"string\",\"enum\":[\"a\",1,\"b\"],\"const\":\"b\"}", .valid = LIST("\"b\""),
         .invalid = LIST("\"a\"", "1")},
        {.schema = "{\"anyOf\":[{\"type\":\"string\",\"maxLength\":2},{\"type\":\"object\",\"properties\":{\"k\":{"
                   "\"type\":\"number\"}},\"required\":[\"k\"],\"additionalProperties\":false},{\"type\":\"null\"}]}",
         .valid = LIST("\"ab\"", "{\"k\":1}", "null"), .invalid = LIST("\"abc\"", "{}", "{\"k\":1,\"j\":2}", "1")},
        {.schema = "{\"oneOf\":[{\"type\":[\"integer\",\"string\"]},{\"type\":\"boolean\"}]}",
         .valid = LIST("1", "\"s\"", "true"), .invalid = LIST("1.5", "null", "[]")},
        {.schema = "{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}",
         .valid = LIST("\"ab\"", "\"\\u00e9\xf0\x9f\x98\x80\"", "\"\\\"\\\\\\n\""),
         .invalid = LIST("\"a\"", "\"abcd\"", "\"\xf0\x9f\x98\x80\"")},
        {.schema = "{}", .valid = LIST("1", "\"x\"", "{\"a\":[true,null,{}]}"), .invalid = LIST("{", "[1,]")},
        {.schema = "true", .valid = LIST("[]"), .invalid = LIST("tru")},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        cr_expect_gt(cross_check(&cases[i], 300), 20, "%s: too few valid documents were made", cases[i].schema);
}

Test(schema, cross_check_refs) {
    const xcase cases[] = {
        {.schema = "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"value\":{\"type\":\"integer\"},"
                   "\"children\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"},\"maxItems\":2}},"
                   "\"required\":[\"value\"],\"additionalProperties\":false}},\"$ref\":\"#/$defs/node\"}",
         .valid = LIST("{\"value\":1,\"children\":[{\"value\":2},{\"value\":3,\"children\":[]}]}"),
         .invalid = LIST("{\"value\":1,\"children\":[{}]}", "{\"value\":1,\"children\":[{\"value\":1},{\"value\":2},"
                                                            "{\"value\":3}]}")},
        {.schema = "{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"string\"},\"next\":{\"anyOf\":[{\"type\":"
                   "\"null\"},{\"$ref\":\"#\"}]}},\"additionalProperties\":false}",
         .valid = LIST("{\"next\":{\"next\":null}}", "{\"v\":\"a\",\"next\":{\"v\":\"b\"}}"),
         .invalid = LIST("{\"next\":1}", "{\"next\":{\"w\":1}}")},
        {.schema = "{\"definitions\":{\"a b\":{\"type\":\"integer\"},\"a-b\":{\"type\":\"boolean\"}},\"type\":"
                   "\"array\",\"items\":{\"anyOf\":[{\"$ref\":\"#/definitions/a b\"},{\"$ref\":\"#/definitions/a-b\"}]}}",
         .valid = LIST("[1,true]"), .invalid = LIST("[null]")},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        cr_expect_gt(cross_check(&cases[i], 300), 20, "%s: too few valid documents were made", cases[i].schema);
}

Test(schema, cross_check_patterns) {
    const xcase cases[] = {
        {.schema = "{\"type\":\"string\",\"pattern\":\"^[a-z]+@[a-z]+\\\\.(com|org)$\"}",
         .valid = LIST("\"abc@example.com\"", "\"x@y.org\""),
         .invalid = LIST("\"a@b.net\"", "\"@x.com\"", "\"abc@example.com \"")},
        {.schema = "{\"type\":\"string\",\"pattern\":\"\\\\d{3}\"}", .valid = LIST("\"a1234b\"", "\"123\""),
         .invalid = LIST("\"12\"", "\"a1b2c3\"")},
        {.schema = "{\"type\":\"string\",\"pattern\":\"^a.c$\"}",
         .valid = LIST("\"abc\"", "\"a\\\"c\"", "\"a\\\\c\"", "\"a\xf0\x9f\x98\x80" "c\""),
         .invalid = LIST("\"a\\nc\"", "\"ac\"", "\"abcd\"")},
        {.schema = "{\"pattern\":\"^[^a-c]*$\"}", .valid = LIST("\"zzz\"", "\"\"", "\"\\n\\u001f\""),
         .invalid = LIST("\"abc\"", "\"zaz\"")},
        {.schema = "{\"type\":\"string\",\"pattern\":\"^\\\\$\\\\d+(\\\\.\\\\d\\\\d)?$|^free$\"}",
         .valid = LIST("\"$10\"", "\"$10.50\"", "\"free\""), .invalid = LIST("\"$1.5\"", "\"$\"", "\"freedom\"")},
        {.schema = "{\"type\":\"string\",\"pattern\":\"^(?:[\\\\w.]|\\\\s)+$\"}", .valid = LIST("\"a.b c\""),
         .invalid = LIST("\"a-b\"", "\"\"")},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        xcase c = cases[i];
        c.samples = pattern_samples;
        cr_expect_gt(cross_check(&c, 200), 0, "%s: no valid documents were made", c.schema);
    }
}

/* ======================================================================
 * Golden texts, names, determinism
 * ====================================================================== */

Test(schema, golden_object) {
    char *t = grammar_of("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":"
                         "\"boolean\"}},\"required\":[\"b\"],\"additionalProperties\":false}",
                         "r");
    cr_assert_str_eq(t, "r ::= r-3\n"
                        "r-0 ::= \",\" r-ws \"\\\"b\\\"\" r-ws \":\" r-ws r-boolean r-ws\n"
                        "r-1 ::= \"\\\"b\\\"\" r-ws \":\" r-ws r-boolean r-ws\n"
                        "r-2 ::= \"\\\"a\\\"\" r-ws \":\" r-ws r-integer r-ws r-0 | r-1\n"
                        "r-3 ::= \"{\" r-ws r-2 \"}\"\n"
                        "r-integer ::= \"-\"? ( \"0\" | [1-9] [0-9]{0,17} )\n"
                        "r-boolean ::= \"true\" | \"false\"\n"
                        "r-ws ::= ( \" \" | \"\\n\" [ \\t]{0,20} )?\n");
    free(t);
}

Test(schema, golden_enum_and_array) {
    char *t = grammar_of("{\"type\":\"array\",\"items\":{\"enum\":[\"x\",1,\"x\"]},\"minItems\":1}", "e");
    cr_assert_str_eq(t, "e ::= e-0\n"
                        "e-0 ::= \"[\" e-ws ( \"\\\"x\\\"\" | \"1\" ) e-ws ( \",\" e-ws ( \"\\\"x\\\"\" | \"1\" ) e-ws )* \"]\"\n"
                        "e-ws ::= ( \" \" | \"\\n\" [ \\t]{0,20} )?\n");
    free(t);
}

/* Every rule of a text starts with its prefix, the prefix rule comes
 * first, and texts for two prefixes can be concatenated. */
Test(schema, prefixes_and_determinism) {
    const char *schema = "{\"$defs\":{\"x\":{\"type\":\"string\",\"pattern\":\"^a+$\"}},\"type\":\"object\","
                         "\"properties\":{\"p\":{\"$ref\":\"#/$defs/x\"},\"q\":{}}}";
    char *a = grammar_of(schema, "one"), *b = grammar_of(schema, "two-2"), *again = grammar_of(schema, "one");
    cr_assert_str_eq(a, again, "the text is deterministic");
    cr_assert(strncmp(a, "one ::= ", 8) == 0);
    for (const char *line = a; *line; line = strchr(line, '\n') + 1)
        cr_assert(strncmp(line, "one ::=", 7) == 0 || strncmp(line, "one-", 4) == 0, "rule %.20s", line);
    size_t la = strlen(a), lb = strlen(b);
    char *both = malloc(la + lb + 1);
    memcpy(both, a, la);
    memcpy(both + la, b, lb + 1);
    rgram *g = rgram_parse(both);
    const char *doc = "{\"p\":\"aa\",\"q\":[1]}";
    cr_assert(recognize(g, "one", doc, strlen(doc)));
    cr_assert(recognize(g, "two-2", doc, strlen(doc)));
    rgram_free(g);
    free(both);
    free(a);
    free(b);
    free(again);
    json_t *s = J("{}");
    char *out = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_json_schema_grammar(s, "bad_prefix", &out, &err), PD_EINVAL);
    cr_assert_eq(pd_json_schema_grammar(s, "", &out, &err), PD_EINVAL);
    json_decref(s);
}

/* json_object mode: {"type":"object"} under prefix "root" is any object. */
Test(schema, generic_object) {
    char *t = grammar_of("{\"type\":\"object\"}", "root");
    rgram *g = rgram_parse(t);
    const char *ok[] = {"{}", "{\"a\": [1, {\"b\": null}], \"\": \"\\u00e9\"}", "{\n  \"x\": -0.5e+10\n}"};
    const char *bad[] = {"[]", "{\"a\":}", "{\"a\":1,}", "{'a':1}", "{\"a\":01}", "{\"a\":\"\\ud800\"}",
                         "{\"a\":\"\\u0000\"}", "{\"a\":1e999}", "{\"a\":\"\x01\"}"};
    for (size_t i = 0; i < sizeof ok / sizeof *ok; i++) cr_expect(recognize(g, "root", ok[i], strlen(ok[i])), "%s", ok[i]);
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        cr_expect(!recognize(g, "root", bad[i], strlen(bad[i])), "%s", bad[i]);
    rgram_free(g);
    free(t);
}

Test(schema, quote) {
    char *q = pd_grammar_quote("a\"b\\c\n\t\r\x01\x7f\xc3\xa9", 12);
    cr_assert_str_eq(q, "\"a\\\"b\\\\c\\n\\t\\r\\x01\\x7F\xc3\xa9\"");
    free(q);
    q = pd_grammar_quote("", 0);
    cr_assert_str_eq(q, "\"\"");
    free(q);
}

/* ======================================================================
 * Refusals
 * ====================================================================== */

Test(schema, unsupported_keywords_name_keyword_and_path) {
    static const char *const keywords[] = {
        "multipleOf", "patternProperties",
        "propertyNames", "minProperties", "maxProperties", "dependentRequired", "dependentSchemas", "not",
        "if", "then", "else", "contains", "minContains", "uniqueItems", "unevaluatedProperties",
        "unevaluatedItems", "$anchor", "$dynamicRef", "contentEncoding", "dependencies", "additionalItems"};
    for (size_t i = 0; i < sizeof keywords / sizeof *keywords; i++) {
        char schema[256], want[128];
        snprintf(schema, sizeof schema,
                 "{\"type\":\"object\",\"properties\":{\"a/b\":{\"type\":\"array\",\"items\":{\"%s\":1}}}}",
                 keywords[i]);
        snprintf(want, sizeof want, "unsupported JSON Schema keyword \"%s\" at #/properties/a~1b/items/%s",
                 keywords[i], keywords[i]);
        pd_error err = {0};
        cr_expect_eq(refuse(schema, &err), PD_EUNSUPPORTED, "%s", keywords[i]);
        cr_expect(strstr(err.msg, want) == err.msg, "%s: %s", keywords[i], err.msg);
        /* the validator refuses it too */
        char doc[] = "{\"a/b\":[1]}";
        cr_expect_eq(validate_text(schema, doc, &err), PD_EUNSUPPORTED, "%s", keywords[i]);
        cr_expect(strstr(err.msg, want) == err.msg, "%s: %s", keywords[i], err.msg);
    }
}

Test(schema, refused_constructs) {
    static const struct {
        const char *schema;
        int code;
        const char *needle;
    } cases[] = {
        {"false", PD_EUNSUPPORTED, "false (no value is allowed) at #"},
        {"{\"properties\":{\"x\":false}}", PD_EUNSUPPORTED, "at #/properties/x"},
        {"{\"items\":[{}]}", PD_EUNSUPPORTED, "\"items\" as an array (tuple validation) at #/items"},
        {"{\"$ref\":\"#/$defs/a\",\"type\":\"object\",\"$defs\":{\"a\":{}}}", PD_EUNSUPPORTED,
         "\"$ref\" together with \"type\" at #"},
        {"{\"anyOf\":[{}],\"minLength\":1}", PD_EUNSUPPORTED, "\"anyOf\" together with \"minLength\" at #"},
        {"{\"$ref\":\"http://x/y.json\"}", PD_EUNSUPPORTED, "\"$ref\" \"http://x/y.json\" at #"},
        {"{\"$ref\":\"#/properties/a\"}", PD_EUNSUPPORTED, "\"$ref\" \"#/properties/a\" at #"},
        {"{\"$ref\":\"#/$defs/missing\"}", PD_EINVAL, "names no definition"},
        {"{\"$defs\":{\"a\":{\"anyOf\":[{\"$ref\":\"#/$defs/b\"}]},\"b\":{\"$ref\":\"#/$defs/a\"}},\"$ref\":"
         "\"#/$defs/a\"}",
         PD_EUNSUPPORTED, "refers to itself through $ref and anyOf alone"},
        {"{\"type\":\"array\",\"maxItems\":20000}", PD_EUNSUPPORTED, "\"maxItems\" at # is 20000; at most 10000"},
        {"{\"properties\":{\"s\":{\"type\":\"string\",\"minLength\":10001}}}", PD_EUNSUPPORTED,
         "\"minLength\" at #/properties/s is 10001"},
        {"{\"type\":\"string\",\"pattern\":\"a{0,20000}\"}", PD_EUNSUPPORTED, "more than 10000"},
        {"{\"type\":\"string\",\"pattern\":\"^a$\",\"maxLength\":3}", PD_EUNSUPPORTED,
         "\"pattern\" and \"maxLength\" together at #"},
        {"{\"type\":\"string\",\"minLength\":3,\"maxLength\":2}", PD_EINVAL, "no string fits"},
        {"{\"type\":\"array\",\"minItems\":-1}", PD_EINVAL, "\"minItems\" at # must be a non-negative integer"},
        {"{\"type\":\"strin\"}", PD_EINVAL, "\"type\" at #"},
        {"{\"enum\":[1,2],\"type\":\"string\"}", PD_EINVAL, "no value of its enum"},
        {"{\"required\":[\"z\"],\"additionalProperties\":false}", PD_EINVAL, "requires \"z\""},
        {"{\"type\":\"string\",\"pattern\":\"(?=a)b\"}", PD_EUNSUPPORTED, "lookahead"},
        {"{\"type\":\"string\",\"pattern\":\"(?<!a)b\"}", PD_EUNSUPPORTED, "lookahead and lookbehind"},
        {"{\"type\":\"string\",\"pattern\":\"(a)\\\\1\"}", PD_EUNSUPPORTED, "backreference"},
        {"{\"type\":\"string\",\"pattern\":\"\\\\bword\"}", PD_EUNSUPPORTED, "word boundary"},
        {"{\"type\":\"string\",\"pattern\":\"a+?\"}", PD_EUNSUPPORTED, "lazy quantifier"},
        {"{\"type\":\"string\",\"pattern\":\"a*+\"}", PD_EUNSUPPORTED, "possessive"},
        {"{\"type\":\"string\",\"pattern\":\"(?i)a\"}", PD_EUNSUPPORTED, "inline flags"},
        {"{\"type\":\"string\",\"pattern\":\"\\\\p{L}\"}", PD_EUNSUPPORTED, "\\p{...}"},
        {"{\"type\":\"string\",\"pattern\":\"a^b\"}", PD_EUNSUPPORTED, "^ that does not start"},
        {"{\"type\":\"string\",\"pattern\":\"a$b\"}", PD_EUNSUPPORTED, "$ that does not end"},
        {"{\"type\":\"string\",\"pattern\":\"[[:alpha:]]\"}", PD_EUNSUPPORTED, "POSIX"},
        {"{\"type\":\"string\",\"pattern\":\"(a\"}", PD_EINVAL, "closing )"},
        {"{\"properties\":{\"p\":{\"pattern\":\"x(?=y)\"}}}", PD_EUNSUPPORTED,
         "\"pattern\" at #/properties/p/pattern"},
        {"{\"allOf\":[{\"type\":\"integer\"},{\"minimum\":1}]}", PD_EUNSUPPORTED, "\"allOf\" with 2 subschemas at #/allOf"},
        {"{\"allOf\":[{\"type\":\"integer\"}],\"minimum\":1}", PD_EUNSUPPORTED, "\"allOf\" together with \"minimum\""},
        {"{\"allOf\":[]}", PD_EINVAL, "\"allOf\" at # must be a non-empty array"},
        {"{\"properties\":{\"e\":{\"type\":\"string\",\"format\":\"email\"}}}", PD_EUNSUPPORTED,
         "\"format\" \"email\" at #/properties/e/format"},
        {"{\"type\":\"string\",\"format\":\"date\",\"maxLength\":10}", PD_EUNSUPPORTED, "\"format\" at #/format together"},
        {"{\"type\":\"number\",\"minimum\":0.5}", PD_EUNSUPPORTED, "\"minimum\" at #/minimum on a number: only whole"},
        {"{\"type\":\"number\",\"exclusiveMaximum\":1.5}", PD_EUNSUPPORTED, "\"exclusiveMaximum\" at #/exclusiveMaximum"},
        {"{\"type\":\"integer\",\"minimum\":0,\"exclusiveMinimum\":true}", PD_EUNSUPPORTED,
         "\"exclusiveMinimum\" as a boolean (draft 4) at #/exclusiveMinimum"},
        {"{\"type\":\"integer\",\"minimum\":\"1\"}", PD_EINVAL, "\"minimum\" at # must be a number"},
        {"{\"type\":\"integer\",\"minimum\":5,\"exclusiveMaximum\":5}", PD_EINVAL, "no 64-bit integer"},
        {"{\"type\":\"integer\",\"minimum\":0.2,\"maximum\":0.8}", PD_EINVAL, "no 64-bit integer"},
        {"{\"type\":\"number\",\"exclusiveMinimum\":3,\"maximum\":3}", PD_EINVAL, "no number meets"},
        {"{\"type\":\"array\",\"uniqueItems\":true}", PD_EUNSUPPORTED, "\"uniqueItems\" at #/uniqueItems"},
        {"{\"type\":\"array\",\"prefixItems\":[{}],\"items\":false,\"minItems\":2}", PD_EINVAL,
         "minItems 2 is more than the 1 items allowed"},
        {"{\"type\":\"array\",\"prefixItems\":[]}", PD_EINVAL, "\"prefixItems\" at # must be a non-empty array"},
        {"{\"$defs\":{\"a\":{\"allOf\":[{\"$ref\":\"#/$defs/a\"}]}},\"$ref\":\"#/$defs/a\"}", PD_EUNSUPPORTED,
         "refers to itself"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        pd_error err = {0};
        cr_expect_eq(refuse(cases[i].schema, &err), cases[i].code, "%s: %s", cases[i].schema, err.msg);
        cr_expect(strstr(err.msg, cases[i].needle), "%s: %s", cases[i].schema, err.msg);
    }
}

Test(schema, annotations_are_ignored) {
    char *a = grammar_of("{\"type\":\"integer\"}", "r");
    char *b = grammar_of("{\"type\":\"integer\",\"title\":\"t\",\"description\":\"d\",\"default\":1,\"examples\":[1],"
                         "\"$schema\":\"x\",\"$id\":\"y\",\"$comment\":\"c\",\"deprecated\":false,\"readOnly\":true,"
                         "\"writeOnly\":false}",
                         "r");
    cr_assert_str_eq(a, b);
    free(a);
    free(b);
}

/* ======================================================================
 * The validator
 * ====================================================================== */

Test(schema, validator_keywords) {
    static const struct {
        const char *schema, *doc;
        bool ok;
        const char *where; /* the JSON pointer the message names */
    } cases[] = {
        {"{\"type\":\"integer\"}", "3", true, NULL},
        {"{\"type\":\"integer\"}", "3.0", true, NULL},
        {"{\"type\":\"integer\"}", "3.5", false, "#"},
        {"{\"type\":\"integer\"}", "1e300", true, NULL},
        {"{\"type\":\"integer\"}", "\"3\"", false, "#"},
        {"{\"type\":[\"string\",\"null\"]}", "null", true, NULL},
        {"{\"type\":[\"string\",\"null\"]}", "1", false, "#"},
        {"{\"enum\":[1,\"a\"]}", "\"a\"", true, NULL},
        {"{\"enum\":[1,\"a\"]}", "2", false, "#"},
        {"{\"const\":{\"a\":1}}", "{\"a\":1}", true, NULL},
        {"{\"const\":{\"a\":1}}", "{\"a\":2}", false, "#"},
        {"{\"properties\":{\"a\":{\"type\":\"string\"}}}", "{\"a\":1}", false, "#/a"},
        {"{\"properties\":{\"a\":{\"type\":\"string\"}}}", "5", true, NULL},
        {"{\"required\":[\"a\"]}", "{}", false, "#"},
        {"{\"additionalProperties\":false,\"properties\":{\"a\":{}}}", "{\"a\":1,\"b/c\":2}", false, "#"},
        {"{\"additionalProperties\":{\"type\":\"integer\"}}", "{\"x\":{\"y\":1}}", false, "#/x"},
        {"{\"items\":{\"type\":\"integer\"}}", "[1,2,\"3\"]", false, "#/2"},
        {"{\"minItems\":2}", "[1]", false, "#"},
        {"{\"maxItems\":1}", "[1,2]", false, "#"},
        {"{\"minLength\":2}", "\"\xf0\x9f\x98\x80\"", false, "#"},
        {"{\"maxLength\":1}", "\"\xf0\x9f\x98\x80\"", true, NULL},
        {"{\"pattern\":\"^a+$\"}", "\"aab\"", false, "#"},
        {"{\"pattern\":\"b\"}", "\"aab\"", true, NULL},
        {"{\"pattern\":\"^a$\"}", "\"a\\n\"", false, "#"},
        {"{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"integer\"}]}", "1", true, NULL},
        {"{\"oneOf\":[{\"type\":\"number\"},{\"type\":\"integer\"}]}", "1", true, NULL},
        {"{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"integer\"}]}", "[]", false, "#"},
        {"{\"$defs\":{\"n\":{\"properties\":{\"k\":{\"$ref\":\"#/$defs/n\"},\"v\":{\"type\":\"integer\"}}}},"
         "\"$ref\":\"#/$defs/n\"}",
         "{\"k\":{\"k\":{\"v\":\"x\"}}}", false, "#/k/k/v"},
        {"{\"properties\":{\"a\":{\"items\":{\"required\":[\"z\"]}}}}", "{\"a\":[{},{\"z\":1}]}", false, "#/a/0"},
        {"true", "[1]", true, NULL},
        {"false", "1", false, "#"},
        {"{\"minimum\":3}", "3", true, NULL},
        {"{\"minimum\":3}", "2.999", false, "#"},
        {"{\"minimum\":3}", "\"x\"", true, NULL},
        {"{\"exclusiveMinimum\":3}", "3.0", false, "#"},
        {"{\"exclusiveMinimum\":3}", "3.0001", true, NULL},
        {"{\"maximum\":9007199254740993}", "9007199254740993", true, NULL},
        {"{\"maximum\":9007199254740992}", "9007199254740993", false, "#"},
        {"{\"exclusiveMaximum\":0.5}", "0.5", false, "#"},
        {"{\"properties\":{\"n\":{\"type\":\"integer\",\"maximum\":-1}}}", "{\"n\":0}", false, "#/n"},
        {"{\"format\":\"date\"}", "\"2023-02-29\"", false, "#"},
        {"{\"format\":\"date-time\"}", "\"2024-02-29T12:00:00+01:00\"", true, NULL},
        {"{\"allOf\":[{\"type\":\"string\"}]}", "1", false, "#"},
        {"{\"prefixItems\":[{\"type\":\"string\"}],\"items\":false}", "[\"a\",1]", false, "#/1"},
        {"{\"prefixItems\":[{\"type\":\"string\"}],\"items\":{\"type\":\"integer\"}}", "[\"a\",1,\"b\"]", false,
         "#/2"},
        {"{\"prefixItems\":[{\"type\":\"string\"}]}", "[1]", false, "#/0"},
        {"{\"uniqueItems\":false}", "[1,1]", true, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        pd_error err = {0};
        int rc = validate_text(cases[i].schema, cases[i].doc, &err);
        if (cases[i].ok) {
            cr_expect_eq(rc, PD_OK, "%s on %s: %s", cases[i].schema, cases[i].doc, err.msg);
            continue;
        }
        cr_expect_eq(rc, PD_EINVAL, "%s on %s", cases[i].schema, cases[i].doc);
        char want[96];
        snprintf(want, sizeof want, "at %s ", cases[i].where);
        cr_expect(strstr(err.msg, want), "%s on %s: %s (wants %s)", cases[i].schema, cases[i].doc, err.msg, want);
    }
}

Test(schema, validator_bad_schemas) {
    pd_error err = {0};
    cr_expect_eq(validate_text("{\"pattern\":\"(\"}", "\"x\"", &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "invalid JSON Schema \"pattern\" at #"), "%s", err.msg);
    cr_expect_eq(validate_text("{\"$ref\":\"#/$defs/none\"}", "1", &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "names no definition"), "%s", err.msg);
    /* a $ref loop that never reaches a smaller part of the document */
    cr_expect_eq(validate_text("{\"$ref\":\"#\"}", "1", &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "too deep"), "%s", err.msg);
    /* what the generator refuses, the validator refuses too */
    static const struct {
        const char *schema, *doc, *needle;
    } refused[] = {
        {"{\"format\":\"email\"}", "\"a@b.c\"", "\"format\" \"email\" at #/format"},
        {"{\"allOf\":[{},{}]}", "1", "\"allOf\" with 2 subschemas at #/allOf"},
        {"{\"exclusiveMinimum\":true,\"minimum\":1}", "2", "\"exclusiveMinimum\" as a boolean"},
        {"{\"uniqueItems\":true}", "[1]", "\"uniqueItems\" at #/uniqueItems"},
        {"{\"anyOf\":[{\"type\":\"integer\"},{\"format\":\"hostname\"}]}", "\"x\"", "\"hostname\""},
        {"{\"format\":\"hostname\"}", "5", "\"hostname\" at #/format"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++) {
        cr_expect_eq(validate_text(refused[i].schema, refused[i].doc, &err), PD_EUNSUPPORTED, "%s", refused[i].schema);
        cr_expect(strstr(err.msg, refused[i].needle), "%s: %s", refused[i].schema, err.msg);
    }
}

/* ======================================================================
 * Numbers, formats, tuples, allOf (and the schemas pydantic emits)
 * ====================================================================== */

/* Whether the recognizer and the validator agree on text. */
static void expect_agree(const json_t *schema, const rgram *g, const char *schema_text, const char *text, bool exact) {
    bool rec = recognize(g, "t", text, strlen(text)), val = valid_doc(schema, text, strlen(text));
    if (rec) cr_assert(val, "%s: the grammar accepts %s, which is not valid", schema_text, text);
    if (exact) cr_assert_eq(rec, val, "%s: %s is valid but the grammar rejects it", schema_text, text);
}

static int count_digits(const char *s) {
    int n = 0;
    for (; *s && *s != '.'; s++) n += *s >= '0' && *s <= '9';
    return n;
}

/* Integer ranges are exact: every integer (up to 18 digits, or inside
 * explicit 64-bit bounds) near each bound and each power of ten. */
Test(schema, integer_ranges_are_exact) {
    static const char *const schemas[] = {
        "{\"type\":\"integer\",\"minimum\":17,\"maximum\":12345}",
        "{\"type\":\"integer\",\"minimum\":0}",
        "{\"type\":\"integer\",\"maximum\":-5}",
        "{\"type\":\"integer\",\"minimum\":17}",
        "{\"type\":\"integer\",\"exclusiveMinimum\":-1000,\"exclusiveMaximum\":99}",
        "{\"type\":\"integer\",\"minimum\":-1,\"maximum\":1}",
        "{\"type\":\"integer\",\"minimum\":0.5,\"maximum\":9.5}",
        "{\"type\":\"integer\",\"minimum\":100,\"exclusiveMinimum\":150,\"maximum\":1e6}",
        "{\"type\":\"integer\",\"minimum\":-7200,\"maximum\":-7100}",
        "{\"type\":\"integer\",\"minimum\":907,\"maximum\":3000000}",
        "{\"type\":[\"integer\",\"null\"],\"minimum\":999999999999999990}",
        "{\"type\":\"integer\",\"minimum\":-9223372036854775808,\"maximum\":9223372036854775807}",
        "{\"type\":\"integer\",\"minimum\":5,\"maximum\":5}",
    };
    for (size_t i = 0; i < sizeof schemas / sizeof *schemas; i++) {
        json_t *schema = J(schemas[i]);
        char *text = grammar_of(schemas[i], "t");
        rgram *g = rgram_parse(text);
        bool full = strstr(schemas[i], "9223372036854775807") != NULL;
        long long centers[64];
        int n_centers = 0;
        static const char *const keys[] = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"};
        for (int k = 0; k < 4; k++) {
            const json_t *b = json_object_get(schema, keys[k]);
            if (b) centers[n_centers++] = json_is_integer(b) ? (long long)json_integer_value(b) : (long long)json_number_value(b);
        }
        long long p = 1;
        for (int e = 0; e <= 18; e++) {
            if (e == 18) p = 999999999999999999LL; /* 10^18 - 1: the last power would overflow below */
            centers[n_centers++] = p;
            centers[n_centers++] = -p;
            if (e < 18) p *= 10;
        }
        centers[n_centers++] = 0;
        int n_valid = 0;
        for (int c = 0; c < n_centers; c++) {
            for (long long delta = -120; delta <= 120; delta++) {
                long long v = centers[c];
                if ((delta > 0 && v > INT64_MAX - delta) || (delta < 0 && v < INT64_MIN - delta)) continue;
                v += delta;
                char doc[32];
                snprintf(doc, sizeof doc, "%lld", v);
                if (!full && count_digits(doc) > 18) continue;
                expect_agree(schema, g, schemas[i], doc, true);
                n_valid += valid_doc(schema, doc, strlen(doc));
            }
        }
        /* no leading zeros, no -0, no fraction, and past int64 */
        const char *bad[] = {"-0", "007", "0.0", "1e2", "9223372036854775808", "-9223372036854775809", "+5", NULL};
        for (const char *const *b = bad; *b; b++) cr_expect(!recognize(g, "t", *b, strlen(*b)), "%s: %s", schemas[i], *b);
        cr_expect_gt(n_valid, 0, "%s", schemas[i]);
        /* compact: O(digits), not O(range) */
        cr_expect_lt(strlen(text), 3000u, "%s:\n%s", schemas[i], text);
        rgram_free(g);
        free(text);
        json_decref(schema);
    }
}

/* Numbers: whatever the grammar admits validates (as the double it
 * parses to), and every plain decimal with an integer part below 10^9 and
 * at most 6 fraction digits that validates is admitted (-0 aside). */
Test(schema, number_ranges_are_sound_and_cover_plain_decimals) {
    static const char *const schemas[] = {
        "{\"type\":\"number\",\"minimum\":0}",
        "{\"type\":\"number\",\"exclusiveMinimum\":0}",
        "{\"type\":\"number\",\"maximum\":0}",
        "{\"type\":\"number\",\"exclusiveMaximum\":0}",
        "{\"type\":\"number\",\"minimum\":-90,\"maximum\":90}",
        "{\"type\":\"number\",\"exclusiveMinimum\":2,\"exclusiveMaximum\":5}",
        "{\"type\":\"number\",\"minimum\":1}",
        "{\"type\":\"number\",\"exclusiveMaximum\":-3}",
        "{\"type\":\"number\",\"minimum\":-1.0,\"exclusiveMaximum\":1000000001}",
        "{\"minimum\":10,\"maximum\":10}",
    };
    static const char *const fractions[] = {"", ".0", ".5", ".000001", ".999999", ".000000", ".25", ".1000000",
                                            ".0000001", "e1", "e-2", "E+2", ".5e-1"};
    for (size_t i = 0; i < sizeof schemas / sizeof *schemas; i++) {
        json_t *schema = J(schemas[i]);
        char *text = grammar_of(schemas[i], "t");
        rgram *g = rgram_parse(text);
        static const long long centers[] = {0, 1, 2, 3, 5, 10, 90, 1000, 999999999, 1000000000, 1000000001,
                                            999999999999999999LL};
        int n_rec = 0;
        for (size_t c = 0; c < sizeof centers / sizeof *centers; c++)
            for (int sign = -1; sign <= 1; sign += 2)
                for (long long delta = -3; delta <= 3; delta++) {
                    long long v = sign * centers[c] + delta;
                    for (size_t f = 0; f < sizeof fractions / sizeof *fractions; f++) {
                        char doc[64];
                        bool negative = v < 0 || (v == 0 && sign < 0 && delta == 0);
                        unsigned long long mag = v < 0 ? (unsigned long long)-v : (unsigned long long)v;
                        snprintf(doc, sizeof doc, "%s%llu%s", negative ? "-" : "", mag, fractions[f]);
                        const char *fr = fractions[f];
                        bool plain = !strpbrk(fr, "eE") && strlen(fr) <= 7 && mag < 1000000000ULL &&
                                     !(negative && mag == 0 && strspn(fr, ".0") == strlen(fr));
                        expect_agree(schema, g, schemas[i], doc, plain);
                        n_rec += recognize(g, "t", doc, strlen(doc));
                    }
                }
        cr_expect_gt(n_rec, 0, "%s", schemas[i]);
        rgram_free(g);
        free(text);
        json_decref(schema);
    }
}

/* date is exact against the calendar, both ways. */
Test(schema, date_format_is_exact) {
    json_t *schema = J("{\"type\":\"string\",\"format\":\"date\"}");
    char *text = grammar_of("{\"type\":\"string\",\"format\":\"date\"}", "t");
    rgram *g = rgram_parse(text);
    static const int years[] = {0, 4, 100, 1600, 1900, 1999, 2000, 2023, 2024, 2100, 2400, 9999, 9996};
    int n_valid = 0;
    for (size_t y = 0; y < sizeof years / sizeof *years; y++)
        for (int m = 0; m <= 13; m++)
            for (int d = 0; d <= 32; d++) {
                char doc[32];
                snprintf(doc, sizeof doc, "\"%04d-%02d-%02d\"", years[y], m, d);
                expect_agree(schema, g, "date", doc, true);
                n_valid += valid_doc(schema, doc, strlen(doc));
            }
    /* 13 years: 365 or 366 days each (0, 4, 1600, 2000, 2024, 2400, 9996 are leap) */
    cr_expect_eq(n_valid, 13 * 365 + 7);
    const char *bad[] = {"\"2024-1-01\"", "\"20240101\"", "\"2024-01-01T00:00:00Z\"", "\" 2024-01-01\"", NULL};
    for (const char *const *b = bad; *b; b++) expect_agree(schema, g, "date", *b, true);
    rgram_free(g);
    free(text);
    json_decref(schema);
}

Test(schema, time_date_time_uuid_formats) {
    const struct {
        const char *format;
        const char *const *yes, *const *no;
        const char *const *validator_only; /* valid, not generated */
    } cases[] = {
        {"time", LIST("\"00:00:00Z\"", "\"23:59:59.999999999+14:00\"", "\"12:30:05-08:00\"", "\"01:02:03.5Z\""),
         LIST("\"24:00:00Z\"", "\"12:60:00Z\"", "\"12:00:00\"", "\"12:00Z\"", "\"12:00:00+5:00\"", "\"12:00:00.Z\"",
              "\"12:00:00+24:00\""),
         LIST("\"23:59:60Z\"", "\"12:00:00z\"", "\"12:00:00.1234567890Z\"")},
        {"date-time",
         LIST("\"2024-02-29T08:30:00Z\"", "\"1999-12-31T23:59:59.5+01:00\""),
         LIST("\"2023-02-29T08:30:00Z\"", "\"2024-02-29 08:30:00Z\"", "\"2024-02-29T08:30Z\"", "\"2024-02-29\""),
         LIST("\"2024-02-29t08:30:00z\"")},
        {"uuid", LIST("\"123e4567-e89b-12d3-a456-426614174000\"", "\"ABCDEF00-0000-0000-0000-000000000000\""),
         LIST("\"123e4567e89b12d3a456426614174000\"", "\"123e4567-e89b-12d3-a456-42661417400\"",
              "\"g23e4567-e89b-12d3-a456-426614174000\"", "\"{123e4567-e89b-12d3-a456-426614174000}\""),
         NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char schema_text[96];
        snprintf(schema_text, sizeof schema_text, "{\"type\":\"string\",\"format\":\"%s\"}", cases[i].format);
        json_t *schema = J(schema_text);
        char *text = grammar_of(schema_text, "t");
        rgram *g = rgram_parse(text);
        for (const char *const *y = cases[i].yes; *y; y++) {
            cr_expect(valid_doc(schema, *y, strlen(*y)), "%s: %s", cases[i].format, *y);
            cr_expect(recognize(g, "t", *y, strlen(*y)), "%s: %s", cases[i].format, *y);
        }
        for (const char *const *n = cases[i].no; *n; n++) expect_agree(schema, g, schema_text, *n, true);
        for (const char *const *v = cases[i].validator_only; v && *v; v++) {
            cr_expect(valid_doc(schema, *v, strlen(*v)), "%s: %s", cases[i].format, *v);
            cr_expect(!recognize(g, "t", *v, strlen(*v)), "%s: %s", cases[i].format, *v);
        }
        /* format applies to strings only */
        cr_expect(valid_doc(schema, "5", 1) == false);
        json_t *untyped = J("{\"format\":\"uuid\"}");
        cr_expect(valid_doc(untyped, "5", 1));
        json_decref(untyped);
        rgram_free(g);
        free(text);
        json_decref(schema);
    }
}

/* pydantic v2 (model_json_schema) for a model with an enum field with a
 * default, a nested model, an Optional field, a list default, a uuid, a
 * datetime, a tuple and bounded numbers: verbatim. */
#define PYDANTIC_V2_SCHEMA                                                                                             \
    "{\"$defs\": {\"Address\": {\"properties\": {\"street\": {\"title\": \"Street\", \"type\": \"string\"}, \"zip\": " \
    "{\"pattern\": \"^\\\\d{5}$\", \"title\": \"Zip\", \"type\": \"string\"}}, \"required\": [\"street\", \"zip\"], " \
    "\"title\": \"Address\", \"type\": \"object\"}, \"Color\": {\"enum\": [\"red\", \"green\"], \"title\": "          \
    "\"Color\", \"type\": \"string\"}}, \"properties\": {\"id\": {\"format\": \"uuid\", \"title\": \"Id\", "          \
    "\"type\": \"string\"}, \"name\": {\"description\": \"Full name\", \"maxLength\": 40, \"title\": \"Name\", "      \
    "\"type\": \"string\"}, \"age\": {\"maximum\": 150, \"minimum\": 0, \"title\": \"Age\", \"type\": \"integer\"}, " \
    "\"score\": {\"exclusiveMinimum\": 0, \"title\": \"Score\", \"type\": \"number\"}, \"color\": {\"$ref\": "        \
    "\"#/$defs/Color\", \"default\": \"red\"}, \"address\": {\"$ref\": \"#/$defs/Address\"}, \"nickname\": "          \
    "{\"anyOf\": [{\"type\": \"string\"}, {\"type\": \"null\"}], \"default\": null, \"title\": \"Nickname\"}, "       \
    "\"tags\": {\"default\": [], \"items\": {\"type\": \"string\"}, \"title\": \"Tags\", \"type\": \"array\"}, "      \
    "\"created\": {\"format\": \"date-time\", \"title\": \"Created\", \"type\": \"string\"}, \"point\": "             \
    "{\"maxItems\": 2, \"minItems\": 2, \"prefixItems\": [{\"type\": \"integer\"}, {\"type\": \"integer\"}], "         \
    "\"title\": \"Point\", \"type\": \"array\"}}, \"required\": [\"id\", \"name\", \"age\", \"score\", \"address\", " \
    "\"created\", \"point\"], \"title\": \"User\", \"type\": \"object\"}"

/* pydantic v1 (.schema()): a $ref with a default is wrapped in allOf. */
#define PYDANTIC_V1_SCHEMA                                                                                             \
    "{\"title\": \"User\", \"type\": \"object\", \"properties\": {\"color\": {\"default\": \"red\", \"allOf\": "       \
    "[{\"$ref\": \"#/definitions/Color\"}]}, \"age\": {\"title\": \"Age\", \"minimum\": 0, \"maximum\": 150, "         \
    "\"type\": \"integer\"}, \"score\": {\"title\": \"Score\", \"exclusiveMinimum\": 0, \"type\": \"number\"}, "       \
    "\"nickname\": {\"title\": \"Nickname\", \"type\": \"string\"}, \"id\": {\"title\": \"Id\", \"type\": "           \
    "\"string\", \"format\": \"uuid\"}}, \"required\": [\"age\", \"id\"], \"definitions\": {\"Color\": {\"title\": "  \
    "\"Color\", \"description\": \"An enumeration.\", \"enum\": [\"red\", \"green\"], \"type\": \"string\"}}}"

/* zod-to-json-schema output with exclusiveMinimum and a date. */
#define ZOD_SCHEMA                                                                                                     \
    "{\"type\":\"object\",\"properties\":{\"count\":{\"type\":\"integer\",\"exclusiveMinimum\":0},\"when\":{\"type\":" \
    "\"string\",\"format\":\"date\"},\"price\":{\"type\":\"number\",\"minimum\":0,\"maximum\":1000}},\"required\":["   \
    "\"count\",\"when\",\"price\"],\"additionalProperties\":false,\"$schema\":\"http://json-schema.org/draft-07/"    \
    "schema#\"}"

/* pydantic v2: a discriminated union (oneOf with OpenAPI's discriminator). */
#define PYDANTIC_V2_UNION_SCHEMA                                                                                       \
    "{\"$defs\": {\"Cat\": {\"properties\": {\"kind\": {\"const\": \"cat\", \"title\": \"Kind\"}, \"meow\": "  \
    "{\"title\": \"Meow\", \"type\": \"boolean\"}}, \"required\": [\"kind\", \"meow\"], \"title\": \"Cat\", "     \
    "\"type\": \"object\"}, \"Dog\": {\"properties\": {\"kind\": {\"const\": \"dog\", \"title\": \"Kind\"}, "     \
    "\"bark\": {\"title\": \"Bark\", \"type\": \"integer\"}}, \"required\": [\"kind\", \"bark\"], \"title\": "    \
    "\"Dog\", \"type\": \"object\"}}, \"properties\": {\"pet\": {\"discriminator\": {\"mapping\": {\"cat\": "      \
    "\"#/$defs/Cat\", \"dog\": \"#/$defs/Dog\"}, \"propertyName\": \"kind\"}, \"oneOf\": [{\"$ref\": "             \
    "\"#/$defs/Cat\"}, {\"$ref\": \"#/$defs/Dog\"}], \"title\": \"Pet\"}}, \"required\": [\"pet\"], \"title\": "    \
    "\"Owner\", \"type\": \"object\"}"

static const char *const widened_schemas[] = {
    PYDANTIC_V2_SCHEMA,
    PYDANTIC_V1_SCHEMA,
    ZOD_SCHEMA,
    "{\"type\":\"array\",\"prefixItems\":[{\"type\":\"string\",\"format\":\"date\"},{\"enum\":[1,2]},{\"type\":"
    "\"boolean\"}],\"items\":false,\"minItems\":1}",
    "{\"type\":\"array\",\"prefixItems\":[{\"type\":\"integer\",\"minimum\":1,\"maximum\":9}],\"items\":{\"type\":"
    "\"null\"},\"maxItems\":3,\"uniqueItems\":false}",
    "{\"type\":\"array\",\"prefixItems\":[{\"const\":\"a\"},{\"const\":\"b\"}],\"minItems\":3}",
    "{\"type\":\"object\",\"properties\":{\"lat\":{\"type\":\"number\",\"minimum\":-90,\"maximum\":90},\"lon\":{"
    "\"type\":\"number\",\"minimum\":-180,\"maximum\":180},\"floor\":{\"type\":\"integer\",\"minimum\":-5,"
    "\"exclusiveMaximum\":200},\"at\":{\"type\":\"string\",\"format\":\"time\"}},\"required\":[\"lat\",\"lon\"]}",
    PYDANTIC_V2_UNION_SCHEMA,
    NULL};

Test(schema, cross_check_widened_subset) {
    const xcase cases[] = {
        {.schema = PYDANTIC_V2_SCHEMA,
         .valid = LIST("{\"id\":\"123e4567-e89b-12d3-a456-426614174000\",\"name\":\"Ann\",\"age\":30,\"score\":0.5,"
                       "\"address\":{\"street\":\"Main\",\"zip\":\"12345\"},\"created\":\"2024-01-15T08:30:00Z\","
                       "\"point\":[1,-2]}",
                       "{\"id\": \"123e4567-e89b-12d3-a456-426614174000\", \"name\": \"Ann\", \"age\": 150, "
                       "\"score\": 1e3, \"color\": \"green\", \"address\": {\"street\": \"\", \"zip\": \"00000\"}, "
                       "\"nickname\": null, \"tags\": [\"a\"], \"created\": \"2024-02-29T23:59:59.5+01:00\", "
                       "\"point\": [0, 0]}"),
         .invalid = LIST("{\"id\":\"123e4567-e89b-12d3-a456-426614174000\",\"name\":\"Ann\",\"age\":151,\"score\":0.5,"
                         "\"address\":{\"street\":\"Main\",\"zip\":\"12345\"},\"created\":\"2024-01-15T08:30:00Z\","
                         "\"point\":[1,2]}",
                         "{\"id\":\"123e4567-e89b-12d3-a456-426614174000\",\"name\":\"Ann\",\"age\":1,\"score\":0,"
                         "\"address\":{\"street\":\"Main\",\"zip\":\"12345\"},\"created\":\"2024-01-15T08:30:00Z\","
                         "\"point\":[1,2]}",
                         "{\"id\":\"123e4567-e89b-12d3-a456-426614174000\",\"name\":\"Ann\",\"age\":1,\"score\":1,"
                         "\"address\":{\"street\":\"Main\",\"zip\":\"12345\"},\"created\":\"2023-02-29T08:30:00Z\","
                         "\"point\":[1,2]}",
                         "{\"id\":\"123e4567-e89b-12d3-a456-426614174000\",\"name\":\"Ann\",\"age\":1,\"score\":1,"
                         "\"address\":{\"street\":\"Main\",\"zip\":\"12345\"},\"created\":\"2024-01-15T08:30:00Z\","
                         "\"point\":[1,2,3]}",
                         "{\"id\":\"123e4567-e89b-12d3-a456-426614174000\",\"name\":\"Ann\",\"age\":1,\"score\":1,"
                         "\"color\":\"blue\",\"address\":{\"street\":\"Main\",\"zip\":\"12345\"},\"created\":"
                         "\"2024-01-15T08:30:00Z\",\"point\":[1,2]}"),
         .samples = LIST("12345", "00000", "1234")},
        {.schema = PYDANTIC_V2_UNION_SCHEMA,
         .valid = LIST("{\"pet\":{\"kind\":\"cat\",\"meow\":true}}", "{\"pet\": {\"kind\": \"dog\", \"bark\": 3}}"),
         .invalid = LIST("{\"pet\":{\"kind\":\"cat\",\"bark\":1}}", "{\"pet\":{\"kind\":\"cow\",\"meow\":true}}",
                         "{}")},
        {.schema = PYDANTIC_V1_SCHEMA,
         .valid = LIST("{\"age\":0,\"id\":\"00000000-0000-0000-0000-000000000000\"}",
                       "{\"color\":\"red\",\"age\":7,\"score\":2.5,\"id\":\"00000000-0000-0000-0000-000000000000\"}"),
         .invalid = LIST("{\"color\":\"blue\",\"age\":7,\"id\":\"00000000-0000-0000-0000-000000000000\"}",
                         "{\"age\":-1,\"id\":\"00000000-0000-0000-0000-000000000000\"}",
                         "{\"age\":1,\"score\":-0.5,\"id\":\"00000000-0000-0000-0000-000000000000\"}")},
        {.schema = ZOD_SCHEMA,
         .valid = LIST("{\"count\":1,\"when\":\"2024-06-01\",\"price\":999.99}",
                       "{\"count\":12,\"when\":\"2000-02-29\",\"price\":1000}"),
         .invalid = LIST("{\"count\":0,\"when\":\"2024-06-01\",\"price\":1}",
                         "{\"count\":1,\"when\":\"2024-06-31\",\"price\":1}",
                         "{\"count\":1,\"when\":\"2024-06-01\",\"price\":1000.5}",
                         "{\"count\":1,\"when\":\"2024-06-01\",\"price\":-1}")},
        {.schema = widened_schemas[3],
         .valid = LIST("[\"2024-01-01\"]", "[\"2024-01-01\", 2, true]", "[\"2024-01-01\",1]"),
         .invalid = LIST("[]", "[\"2024-01-01\",3]", "[\"2024-01-01\",1,true,null]", "[1]")},
        {.schema = widened_schemas[4],
         .valid = LIST("[]", "[9]", "[1,null,null]"),
         .invalid = LIST("[0]", "[1,2]", "[1,null,null,null]", "[null]")},
        {.schema = widened_schemas[5],
         .valid = LIST("[\"a\",\"b\",1]", "[\"a\",\"b\",{},[]]"),
         .invalid = LIST("[\"a\",\"b\"]", "[\"b\",\"a\",1]")},
        {.schema = widened_schemas[6],
         .valid = LIST("{\"lat\":-90,\"lon\":180.000}", "{\"lat\":45.5,\"lon\":-0.25,\"floor\":199,\"at\":\"10:00:00Z\"}"),
         .invalid = LIST("{\"lat\":-90.5,\"lon\":0}", "{\"lat\":0,\"lon\":0,\"floor\":200}",
                         "{\"lat\":0,\"lon\":180.1}")},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        xcase c = cases[i];
        if (!c.samples) c.samples = pattern_samples;
        cr_expect_gt(cross_check(&c, 300), 0, "%s: no valid documents were made", c.schema);
    }
}

/* ---- random walks through the real compiler and matcher ------------- */

/* A small vocabulary: every printable ASCII byte, \n, \t, a two-byte
 * character, a few multi-byte tokens, and an end token (id 0). */
static pd_grammar_vocab *walk_vocab(void) {
    static const char *const multi[] = {"{\"", "\":", "\",", "\": \"", ", ", "true", "false", "null", "00", "12",
                                        "2024-", "-0", ".5", "e+", "\xc3\xa9", "\n  ", "]}", "abc", "-1", "99"};
    const size_t n_multi = sizeof multi / sizeof *multi;
    int32_t n = (int32_t)(1 + 95 + 2 + n_multi);
    const char **pieces = calloc((size_t)n, sizeof *pieces);
    uint32_t *lens = calloc((size_t)n, sizeof *lens);
    uint8_t *kinds = calloc((size_t)n, sizeof *kinds);
    static char bytes[97][2];
    int32_t t = 0;
    pieces[t] = "";
    kinds[t++] = PD_GTOK_EOG;
    for (int c = 0x20; c < 0x7F; c++) {
        bytes[c - 0x20][0] = (char)c;
        pieces[t] = bytes[c - 0x20];
        lens[t++] = 1;
    }
    pieces[t] = "\n", lens[t++] = 1;
    pieces[t] = "\t", lens[t++] = 1;
    for (size_t i = 0; i < n_multi; i++) pieces[t] = multi[i], lens[t++] = (uint32_t)strlen(multi[i]);
    pd_grammar_vocab *v = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_grammar_vocab_create(n, pieces, lens, kinds, &v, &err), PD_OK, "%s", err.msg);
    free(pieces);
    free(lens);
    free(kinds);
    return v;
}

Test(schema, random_walks_through_the_matcher_validate) {
    pd_grammar_vocab *v = walk_vocab();
    int32_t n = pd_grammar_vocab_size(v);
    float *logits = malloc(sizeof(float) * (size_t)n);
    const char *extra[] = {"{\"type\":\"integer\",\"minimum\":-7200,\"maximum\":3000000}",
                           "{\"type\":\"integer\",\"exclusiveMaximum\":-5}",
                           "{\"type\":\"number\",\"exclusiveMinimum\":0}",
                           "{\"type\":\"number\",\"exclusiveMinimum\":2,\"exclusiveMaximum\":5}",
                           "{\"type\":\"string\",\"format\":\"date-time\"}",
                           "{\"type\":\"string\",\"format\":\"uuid\"}",
                           "{\"allOf\":[{\"type\":\"integer\",\"minimum\":17}],\"description\":\"d\"}",
                           NULL};
    for (int set = 0; set < 2; set++)
        for (const char *const *st = set ? extra : widened_schemas; *st; st++) {
            json_t *schema = J(*st);
            char *text = grammar_of(*st, "root");
            pd_grammar *g = NULL;
            pd_error err = {0};
            cr_assert_eq(pd_grammar_compile(text, strlen(text), &g, &err), PD_OK, "%s\n%s", err.msg, text);
            uint64_t rng = 0x1234567ULL + (uint64_t)(st - (set ? extra : widened_schemas));
            for (int walk = 0; walk < 30; walk++) {
                pd_grammar_matcher *m = NULL;
                cr_assert_eq(pd_grammar_matcher_create(g, v, &m, &err), PD_OK, "%s", err.msg);
                char out[4096];
                size_t len = 0;
                bool ended = false;
                const int32_t budget = 600;
                for (int32_t i = 0; i < budget && !ended; i++) {
                    for (int32_t k = 0; k < n; k++) {
                        rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
                        logits[k] = (float)(rng >> 40);
                    }
                    cr_assert_eq(pd_grammar_matcher_mask(m, logits, budget - i, &err), PD_OK, "%s", err.msg);
                    int32_t best = -1;
                    for (int32_t k = 0; k < n; k++)
                        if (logits[k] > -1e30f && (best < 0 || logits[k] > logits[best])) best = k;
                    cr_assert_geq(best, 0);
                    if (best == 0) {
                        cr_assert(pd_grammar_matcher_complete(m));
                        ended = true;
                        break;
                    }
                    cr_assert_eq(pd_grammar_matcher_accept(m, best, &err), PD_OK, "%s", err.msg);
                    char one[2] = {0};
                    const char *p;
                    if (best >= 1 && best <= 95) one[0] = (char)(0x1F + best), p = one;
                    else if (best == 96) p = "\n";
                    else if (best == 97) p = "\t";
                    else {
                        static const char *const multi[] = {"{\"", "\":", "\",", "\": \"", ", ", "true", "false",
                                                            "null", "00", "12", "2024-", "-0", ".5", "e+", "\xc3\xa9",
                                                            "\n  ", "]}", "abc", "-1", "99"};
                        p = multi[best - 98];
                    }
                    size_t pl = strlen(p);
                    cr_assert_lt(len + pl, sizeof out);
                    memcpy(out + len, p, pl);
                    len += pl;
                }
                out[len] = '\0';
                cr_assert(ended, "%s: the walk did not end: %s", *st, out);
                json_error_t je;
                json_t *doc = json_loads(out, JSON_DECODE_ANY, &je);
                cr_assert_not_null(doc, "%s: not JSON (%s): %s", *st, je.text, out);
                cr_assert_eq(pd_json_schema_validate(schema, doc, &err), PD_OK, "%s: %s\n%s", *st, err.msg, out);
                if (walk == 0) cr_log_info("walk: %s", out);
                json_decref(doc);
                pd_grammar_matcher_free(m);
            }
            pd_grammar_free(g);
            free(text);
            json_decref(schema);
        }
    free(logits);
    pd_grammar_vocab_free(v);
}
