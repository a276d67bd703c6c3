/* grammar: GBNF text -> one DFA per rule.
 *
 * The parser builds a small syntax tree per rule; each rule becomes a
 * Thompson NFA over bytes (code-point classes as UTF-8 byte-range
 * sequences), rule references and token ids, which subset construction
 * turns into a DFA (a reference and a token are symbols like a byte range).
 * Then the checks: every rule defined, every rule with a finite text, no
 * left recursion; and each state's shortest completion in bytes. */
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_internal.h"

/* ---- syntax tree ------------------------------------------------------- */

enum { A_SEQ, A_ALT, A_BYTES, A_CLASS, A_REF, A_TOK, A_REP };

typedef struct ast {
    int kind;
    int32_t *kids;
    int n_kids, cap_kids;
    uint8_t *bytes;        /* A_BYTES */
    int n_bytes;
    uint32_t *ranges;      /* A_CLASS: pairs lo, hi of code points */
    int n_ranges;
    bool negated;
    int32_t sym;           /* A_REF: rule id, A_TOK: token id */
    int32_t min, max;      /* A_REP: max -1 = unbounded */
    size_t pos;
} ast;

typedef struct rule_def {
    char *name;
    int32_t body; /* ast node, -1 until defined */
    size_t def_pos, use_pos;
} rule_def;

typedef struct parser {
    const char *text;
    size_t len, pos;
    ast *nodes;
    int32_t n_nodes, cap_nodes;
    rule_def *rules;
    int32_t n_rules, cap_rules;
    pd_error *err;
} parser;

static void line_col(const char *text, size_t pos, int *line, int *col) {
    *line = 1;
    *col = 1;
    for (size_t i = 0; i < pos; i++) {
        if (text[i] == '\n') {
            (*line)++;
            *col = 1;
        } else {
            (*col)++;
        }
    }
}

__attribute__((format(printf, 3, 4))) static int perr(parser *p, size_t pos, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    int line, col;
    line_col(p->text, pos, &line, &col);
    return pd_errorf(p->err, PD_EINVAL, "grammar: line %d column %d: %s", line, col, msg);
}

static int32_t new_node(parser *p, int kind, size_t pos) {
    if (p->n_nodes == p->cap_nodes) {
        int32_t cap = p->cap_nodes ? p->cap_nodes * 2 : 64;
        ast *n = realloc(p->nodes, (size_t)cap * sizeof *n);
        if (!n) return -1;
        p->nodes = n;
        p->cap_nodes = cap;
    }
    ast *a = &p->nodes[p->n_nodes];
    memset(a, 0, sizeof *a);
    a->kind = kind;
    a->pos = pos;
    return p->n_nodes++;
}

static int add_kid(parser *p, int32_t parent, int32_t kid) {
    ast *a = &p->nodes[parent];
    if (a->n_kids == a->cap_kids) {
        int cap = a->cap_kids ? a->cap_kids * 2 : 4;
        int32_t *k = realloc(a->kids, (size_t)cap * sizeof *k);
        if (!k) return PD_ENOMEM;
        a->kids = k;
        a->cap_kids = cap;
    }
    a->kids[a->n_kids++] = kid;
    return PD_OK;
}

static void free_parser(parser *p) {
    for (int32_t i = 0; i < p->n_nodes; i++) {
        free(p->nodes[i].kids);
        free(p->nodes[i].bytes);
        free(p->nodes[i].ranges);
    }
    free(p->nodes);
    for (int32_t i = 0; i < p->n_rules; i++) free(p->rules[i].name);
    free(p->rules);
}

static int32_t rule_id(parser *p, const char *name, size_t n, size_t pos) {
    for (int32_t i = 0; i < p->n_rules; i++)
        if (strlen(p->rules[i].name) == n && memcmp(p->rules[i].name, name, n) == 0) return i;
    if (p->n_rules == p->cap_rules) {
        int32_t cap = p->cap_rules ? p->cap_rules * 2 : 16;
        rule_def *r = realloc(p->rules, (size_t)cap * sizeof *r);
        if (!r) return -1;
        p->rules = r;
        p->cap_rules = cap;
    }
    rule_def *r = &p->rules[p->n_rules];
    r->name = strndup(name, n);
    if (!r->name) return -1;
    r->body = -1;
    r->def_pos = 0;
    r->use_pos = pos;
    return p->n_rules++;
}

static bool is_name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
}

static void skip_ws(parser *p) {
    while (p->pos < p->len) {
        char c = p->text[p->pos];
        if (c == '#') {
            while (p->pos < p->len && p->text[p->pos] != '\n') p->pos++;
        } else if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
            p->pos++;
        } else {
            break;
        }
    }
}

static size_t name_len(const parser *p, size_t at) {
    size_t n = 0;
    while (at + n < p->len && is_name_char(p->text[at + n])) n++;
    return n;
}

/* Whether a rule definition `name ::=` starts at p->pos. */
static bool at_definition(parser *p) {
    size_t n = name_len(p, p->pos);
    if (n == 0) return false;
    size_t save = p->pos;
    p->pos += n;
    skip_ws(p);
    bool def = p->len - p->pos >= 3 && memcmp(p->text + p->pos, "::=", 3) == 0;
    p->pos = save;
    return def;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* One code point of a literal or class at p->pos (escapes, or UTF-8).
 * *raw_byte >= 0 when the text held a byte that is not valid UTF-8 (kept as
 * is in literals). */
static int read_char(parser *p, bool in_class, uint32_t *cp, int *raw_byte) {
    *raw_byte = -1;
    size_t at = p->pos;
    unsigned char c = (unsigned char)p->text[p->pos];
    if (c == '\\') {
        if (p->pos + 1 >= p->len) return perr(p, at, "unfinished escape at the end of the text");
        char e = p->text[p->pos + 1];
        p->pos += 2;
        int digits = 0;
        switch (e) {
        case 'n': *cp = '\n'; return PD_OK;
        case 'r': *cp = '\r'; return PD_OK;
        case 't': *cp = '\t'; return PD_OK;
        case '"': *cp = '"'; return PD_OK;
        case '\\': *cp = '\\'; return PD_OK;
        case 'x': digits = 2; break;
        case 'u': digits = 4; break;
        case 'U': digits = 8; break;
        default:
            if (in_class && (e == ']' || e == '-' || e == '^' || e == '[')) {
                *cp = (uint32_t)e;
                return PD_OK;
            }
            return perr(p, at, "unknown escape '\\%c' (use \\\" \\\\ \\n \\r \\t \\xHH \\uHHHH \\UHHHHHHHH%s)", e,
                        in_class ? " \\] \\- \\^ \\[" : "");
        }
        uint32_t v = 0;
        for (int i = 0; i < digits; i++) {
            int h = p->pos < p->len ? hexval(p->text[p->pos]) : -1;
            if (h < 0) return perr(p, at, "escape '\\%c' needs %d hex digits", e, digits);
            v = v * 16 + (uint32_t)h;
            p->pos++;
        }
        if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
            return perr(p, at, "escape '\\%c' gives U+%X, which is not a Unicode scalar value", e, v);
        *cp = v;
        return PD_OK;
    }
    /* UTF-8 */
    int n = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    uint32_t v = n == 1 ? c : n == 2 ? (c & 0x1Fu) : n == 3 ? (c & 0x0Fu) : (c & 0x07u);
    bool ok = n > 0 && p->pos + (size_t)n <= p->len;
    for (int i = 1; ok && i < n; i++) {
        unsigned char d = (unsigned char)p->text[p->pos + (size_t)i];
        if ((d & 0xC0) != 0x80) ok = false;
        v = (v << 6) | (d & 0x3Fu);
    }
    static const uint32_t min_of_len[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (ok && (v < min_of_len[n] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))) ok = false;
    if (!ok) {
        if (in_class) return perr(p, at, "invalid UTF-8 in a character class");
        *raw_byte = c;
        p->pos++;
        return PD_OK;
    }
    *cp = v;
    p->pos += (size_t)n;
    return PD_OK;
}

static int append_bytes(ast *a, const uint8_t *b, int n) {
    uint8_t *nb = realloc(a->bytes, (size_t)a->n_bytes + (size_t)n);
    if (!nb) return PD_ENOMEM;
    a->bytes = nb;
    memcpy(a->bytes + a->n_bytes, b, (size_t)n);
    a->n_bytes += n;
    return PD_OK;
}

static int utf8_encode(uint32_t cp, uint8_t out[4]) {
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | (cp >> 6));
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | (cp >> 12));
        out[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | (cp >> 18));
    out[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

static int parse_alternatives(parser *p, int32_t *out, int depth);

static int parse_literal(parser *p, int32_t *out) {
    size_t at = p->pos;
    int32_t id = new_node(p, A_BYTES, at);
    if (id < 0) return PD_ENOMEM;
    p->pos++; /* opening quote */
    for (;;) {
        if (p->pos >= p->len) return perr(p, at, "unterminated literal: expected '\"'");
        if (p->text[p->pos] == '"') {
            p->pos++;
            break;
        }
        uint32_t cp;
        int raw;
        int rc = read_char(p, false, &cp, &raw);
        if (rc) return rc;
        uint8_t b[4];
        int n = 1;
        if (raw >= 0)
            b[0] = (uint8_t)raw;
        else
            n = utf8_encode(cp, b);
        if (append_bytes(&p->nodes[id], b, n)) return PD_ENOMEM;
    }
    *out = id;
    return PD_OK;
}

static int add_range(ast *a, uint32_t lo, uint32_t hi) {
    uint32_t *r = realloc(a->ranges, (size_t)(a->n_ranges + 1) * 2 * sizeof *r);
    if (!r) return PD_ENOMEM;
    a->ranges = r;
    r[a->n_ranges * 2] = lo;
    r[a->n_ranges * 2 + 1] = hi;
    a->n_ranges++;
    return PD_OK;
}

static int parse_class(parser *p, int32_t *out) {
    size_t at = p->pos;
    int32_t id = new_node(p, A_CLASS, at);
    if (id < 0) return PD_ENOMEM;
    p->pos++;
    if (p->pos < p->len && p->text[p->pos] == '^') {
        p->nodes[id].negated = true;
        p->pos++;
    }
    for (;;) {
        if (p->pos >= p->len) return perr(p, at, "unterminated character class: expected ']'");
        if (p->text[p->pos] == ']') {
            p->pos++;
            break;
        }
        uint32_t lo, hi;
        int raw;
        int rc = read_char(p, true, &lo, &raw);
        if (rc) return rc;
        hi = lo;
        if (p->pos + 1 < p->len && p->text[p->pos] == '-' && p->text[p->pos + 1] != ']') {
            size_t range_at = p->pos;
            p->pos++;
            rc = read_char(p, true, &hi, &raw);
            if (rc) return rc;
            if (hi < lo) return perr(p, range_at, "character range U+%X-U+%X is reversed", lo, hi);
        }
        if (add_range(&p->nodes[id], lo, hi)) return PD_ENOMEM;
    }
    *out = id;
    return PD_OK;
}

static int parse_uint(parser *p, int32_t *v) {
    size_t at = p->pos;
    int64_t x = 0;
    if (p->pos >= p->len || p->text[p->pos] < '0' || p->text[p->pos] > '9') return perr(p, at, "expected a number");
    while (p->pos < p->len && p->text[p->pos] >= '0' && p->text[p->pos] <= '9') {
        x = x * 10 + (p->text[p->pos] - '0');
        if (x > 1000000000) return perr(p, at, "number too large");
        p->pos++;
    }
    *v = (int32_t)x;
    return PD_OK;
}

static int parse_primary(parser *p, int32_t *out, int depth) {
    size_t at = p->pos;
    char c = p->text[p->pos];
    if (c == '(') {
        p->pos++;
        int rc = parse_alternatives(p, out, depth + 1);
        if (rc) return rc;
        skip_ws(p);
        if (p->pos >= p->len || p->text[p->pos] != ')') return perr(p, at, "unclosed group: expected ')'");
        p->pos++;
        return PD_OK;
    }
    if (c == '"') return parse_literal(p, out);
    if (c == '[') return parse_class(p, out);
    if (c == '.') {
        p->pos++;
        int32_t id = new_node(p, A_CLASS, at);
        if (id < 0) return PD_ENOMEM;
        p->nodes[id].negated = true; /* [^] : every code point */
        *out = id;
        return PD_OK;
    }
    if (c == '<' && p->pos + 1 < p->len && p->text[p->pos + 1] == '[') {
        p->pos += 2;
        int32_t tok;
        int rc = parse_uint(p, &tok);
        if (rc) return rc;
        if (p->len - p->pos < 2 || memcmp(p->text + p->pos, "]>", 2) != 0)
            return perr(p, p->pos, "expected ']>' to close the token reference");
        p->pos += 2;
        int32_t id = new_node(p, A_TOK, at);
        if (id < 0) return PD_ENOMEM;
        p->nodes[id].sym = tok;
        *out = id;
        return PD_OK;
    }
    size_t n = name_len(p, p->pos);
    if (n > 0) {
        int32_t r = rule_id(p, p->text + p->pos, n, at);
        int32_t id = r < 0 ? -1 : new_node(p, A_REF, at);
        if (id < 0) return PD_ENOMEM;
        p->nodes[id].sym = r;
        p->pos += n;
        *out = id;
        return PD_OK;
    }
    return perr(p, at, "expected a literal, a class, '.', a rule name, '(' or '<[id]>', found '%c'", c);
}

static int parse_item(parser *p, int32_t *out, int depth) {
    int32_t prim = -1;
    int rc = parse_primary(p, &prim, depth);
    if (rc) return rc;
    for (;;) {
        if (p->pos >= p->len) break;
        char c = p->text[p->pos];
        size_t at = p->pos;
        int32_t min, max;
        if (c == '*') {
            min = 0, max = -1;
            p->pos++;
        } else if (c == '+') {
            min = 1, max = -1;
            p->pos++;
        } else if (c == '?') {
            min = 0, max = 1;
            p->pos++;
        } else if (c == '{') {
            p->pos++;
            skip_ws(p);
            if ((rc = parse_uint(p, &min))) return rc;
            skip_ws(p);
            max = min;
            if (p->pos < p->len && p->text[p->pos] == ',') {
                p->pos++;
                skip_ws(p);
                max = -1;
                if (p->pos < p->len && p->text[p->pos] != '}' && (rc = parse_uint(p, &max))) return rc;
                skip_ws(p);
            }
            if (p->pos >= p->len || p->text[p->pos] != '}') return perr(p, at, "expected '}' to close the repetition");
            p->pos++;
            if (min > PD_GRAMMAR_MAX_REPEAT || max > PD_GRAMMAR_MAX_REPEAT)
                return perr(p, at, "repetition bound above %d: write a smaller bound or use '*' / '+'",
                            PD_GRAMMAR_MAX_REPEAT);
            if (max >= 0 && max < min) return perr(p, at, "repetition {%d,%d}: the maximum is below the minimum", min, max);
        } else {
            break;
        }
        int32_t id = new_node(p, A_REP, at);
        if (id < 0 || add_kid(p, id, prim)) return PD_ENOMEM;
        p->nodes[id].min = min;
        p->nodes[id].max = max;
        prim = id;
    }
    *out = prim;
    return PD_OK;
}

static int parse_sequence(parser *p, int32_t *out, int depth) {
    int32_t seq = new_node(p, A_SEQ, p->pos);
    if (seq < 0) return PD_ENOMEM;
    for (;;) {
        skip_ws(p);
        if (p->pos >= p->len) break;
        char c = p->text[p->pos];
        if (c == '|' || c == ')') break;
        if (depth == 0 && at_definition(p)) break;
        int32_t item = -1;
        int rc = parse_item(p, &item, depth);
        if (rc) return rc;
        if (add_kid(p, seq, item)) return PD_ENOMEM;
    }
    *out = seq;
    return PD_OK;
}

static int parse_alternatives(parser *p, int32_t *out, int depth) {
    if (depth > 200) return perr(p, p->pos, "groups nested more than 200 deep");
    int32_t alt = new_node(p, A_ALT, p->pos);
    if (alt < 0) return PD_ENOMEM;
    for (;;) {
        int32_t seq = -1;
        int rc = parse_sequence(p, &seq, depth);
        if (rc) return rc;
        if (add_kid(p, alt, seq)) return PD_ENOMEM;
        skip_ws(p);
        if (p->pos < p->len && p->text[p->pos] == '|') {
            p->pos++;
            continue;
        }
        break;
    }
    *out = alt;
    return PD_OK;
}

static int parse_grammar(parser *p) {
    for (;;) {
        skip_ws(p);
        if (p->pos >= p->len) break;
        size_t at = p->pos;
        size_t n = name_len(p, p->pos);
        if (n == 0) return perr(p, at, "expected a rule name (letters, digits, '_', '-') followed by '::='");
        int32_t r = rule_id(p, p->text + p->pos, n, at);
        if (r < 0) return PD_ENOMEM;
        p->pos += n;
        skip_ws(p);
        if (p->len - p->pos < 3 || memcmp(p->text + p->pos, "::=", 3) != 0)
            return perr(p, p->pos, "expected '::=' after the rule name '%s'", p->rules[r].name);
        p->pos += 3;
        if (p->rules[r].body >= 0) {
            int line, col;
            line_col(p->text, p->rules[r].def_pos, &line, &col);
            return perr(p, at, "rule '%s' is already defined at line %d column %d", p->rules[r].name, line, col);
        }
        int32_t body = -1;
        int rc = parse_alternatives(p, &body, 0);
        if (rc) return rc;
        skip_ws(p);
        if (p->pos < p->len && !at_definition(p))
            return perr(p, p->pos, "unexpected '%c': expected '|', an item or the next rule", p->text[p->pos]);
        p->rules[r].body = body;
        p->rules[r].def_pos = at;
    }
    for (int32_t i = 0; i < p->n_rules; i++)
        if (p->rules[i].body < 0) return perr(p, p->rules[i].use_pos, "rule '%s' is used but not defined", p->rules[i].name);
    return PD_OK;
}

/* ---- UTF-8 byte ranges ----------------------------------------------- */

static void utf8_split(uint32_t lo, uint32_t hi, void (*fn)(void *, int, const uint8_t *, const uint8_t *), void *ctx) {
    static const uint32_t len_max[4] = {0x7F, 0x7FF, 0xFFFF, 0x10FFFF};
    for (int i = 0; i < 3; i++) { /* one encoded length per range */
        if (lo <= len_max[i] && hi > len_max[i]) {
            utf8_split(lo, len_max[i], fn, ctx);
            utf8_split(len_max[i] + 1, hi, fn, ctx);
            return;
        }
    }
    int n = hi <= 0x7F ? 1 : hi <= 0x7FF ? 2 : hi <= 0xFFFF ? 3 : 4;
    for (int i = 1; i < n; i++) { /* continuation bytes must span 80..BF alike */
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0) {
                utf8_split(lo, lo | m, fn, ctx);
                utf8_split((lo | m) + 1, hi, fn, ctx);
                return;
            }
            if ((hi & m) != m) {
                utf8_split(lo, (hi & ~m) - 1, fn, ctx);
                utf8_split(hi & ~m, hi, fn, ctx);
                return;
            }
        }
    }
    uint8_t a[4], b[4];
    utf8_encode(lo, a);
    utf8_encode(hi, b);
    fn(ctx, n, a, b);
}

void pd_grammar_utf8_ranges(uint32_t lo, uint32_t hi, void (*fn)(void *, int, const uint8_t *, const uint8_t *),
                            void *ctx) {
    if (hi > 0x10FFFF) hi = 0x10FFFF;
    if (lo > hi) return;
    if (lo < 0xD800 && hi >= 0xD800) {
        utf8_split(lo, 0xD7FF, fn, ctx);
        if (hi > 0xDFFF) utf8_split(0xE000, hi, fn, ctx);
        return;
    }
    if (lo >= 0xD800 && lo <= 0xDFFF) {
        if (hi <= 0xDFFF) return;
        lo = 0xE000;
    }
    utf8_split(lo, hi, fn, ctx);
}

/* ---- NFA --------------------------------------------------------------- */

enum { E_EPS, E_BYTE, E_REF, E_TOK };

typedef struct nfa_edge {
    int kind;
    uint8_t lo, hi;
    int32_t sym, to, next;
} nfa_edge;

typedef struct nfa {
    int32_t *head; /* first edge per state */
    int32_t n_states, cap_states;
    nfa_edge *edges;
    int32_t n_edges, cap_edges;
    parser *p;
    const bool *inline_rule; /* references to these rules are expanded in place */
} nfa;

/* Limits on what one request can make the server build: about 100 bytes
 * per NFA state, so a hostile schema costs at most ~100 MB for a moment. */
#define NFA_MAX_STATES 1000000

static int32_t nfa_state(nfa *a) {
    if (a->n_states >= NFA_MAX_STATES) return -1;
    if (a->n_states == a->cap_states) {
        int32_t cap = a->cap_states ? a->cap_states * 2 : 256;
        int32_t *h = realloc(a->head, (size_t)cap * sizeof *h);
        if (!h) return -1;
        a->head = h;
        a->cap_states = cap;
    }
    a->head[a->n_states] = -1;
    return a->n_states++;
}

static int nfa_edge_add(nfa *a, int32_t from, int kind, uint8_t lo, uint8_t hi, int32_t sym, int32_t to) {
    if (a->n_edges == a->cap_edges) {
        int32_t cap = a->cap_edges ? a->cap_edges * 2 : 512;
        nfa_edge *e = realloc(a->edges, (size_t)cap * sizeof *e);
        if (!e) return PD_ENOMEM;
        a->edges = e;
        a->cap_edges = cap;
    }
    a->edges[a->n_edges] = (nfa_edge){.kind = kind, .lo = lo, .hi = hi, .sym = sym, .to = to, .next = a->head[from]};
    a->head[from] = a->n_edges++;
    return PD_OK;
}

typedef struct class_ctx {
    nfa *a;
    int32_t from, to;
    int rc;
} class_ctx;

static void class_seq(void *vctx, int n, const uint8_t *lo, const uint8_t *hi) {
    class_ctx *c = vctx;
    if (c->rc) return;
    int32_t at = c->from;
    for (int i = 0; i < n; i++) {
        int32_t next = i == n - 1 ? c->to : nfa_state(c->a);
        if (next < 0 || nfa_edge_add(c->a, at, E_BYTE, lo[i], hi[i], 0, next)) {
            c->rc = PD_ENOMEM;
            return;
        }
        at = next;
    }
}

static int cmp_u32_pair(const void *x, const void *y) {
    const uint32_t *a = x, *b = y;
    return a[0] < b[0] ? -1 : a[0] > b[0];
}

/* Fragment for node id from state `from`; *end gets its final state. */
static int build(nfa *a, int32_t id, int32_t from, int32_t *end) {
    parser *p = a->p;
    ast *n = &p->nodes[id];
    int rc;
    switch (n->kind) {
    case A_SEQ: {
        int32_t at = from;
        for (int i = 0; i < n->n_kids; i++)
            if ((rc = build(a, p->nodes[id].kids[i], at, &at))) return rc;
        *end = at;
        return PD_OK;
    }
    case A_ALT: {
        if (n->n_kids == 1) return build(a, n->kids[0], from, end);
        int32_t e = nfa_state(a);
        if (e < 0) goto too_big;
        for (int i = 0; i < p->nodes[id].n_kids; i++) {
            int32_t s = nfa_state(a), k_end;
            if (s < 0) goto too_big;
            if ((rc = nfa_edge_add(a, from, E_EPS, 0, 0, 0, s))) return rc;
            if ((rc = build(a, p->nodes[id].kids[i], s, &k_end))) return rc;
            if ((rc = nfa_edge_add(a, k_end, E_EPS, 0, 0, 0, e))) return rc;
        }
        *end = e;
        return PD_OK;
    }
    case A_BYTES: {
        int32_t at = from;
        for (int i = 0; i < n->n_bytes; i++) {
            int32_t s = nfa_state(a);
            if (s < 0) goto too_big;
            if ((rc = nfa_edge_add(a, at, E_BYTE, p->nodes[id].bytes[i], p->nodes[id].bytes[i], 0, s))) return rc;
            at = s;
        }
        *end = at;
        return PD_OK;
    }
    case A_CLASS: {
        /* sorted, merged code point ranges; then the complement if negated */
        int nr = n->n_ranges;
        uint32_t *r = malloc((size_t)(nr + 1) * 2 * sizeof *r);
        if (!r) return PD_ENOMEM;
        if (nr) memcpy(r, n->ranges, (size_t)nr * 2 * sizeof *r);
        if ((size_t)nr > 1) qsort(r, (size_t)nr, 2 * sizeof *r, cmp_u32_pair);
        int m = 0;
        for (int i = 0; i < nr; i++) {
            if (m > 0 && r[2 * i] <= r[2 * (m - 1) + 1] + 1) {
                if (r[2 * i + 1] > r[2 * (m - 1) + 1]) r[2 * (m - 1) + 1] = r[2 * i + 1];
            } else {
                r[2 * m] = r[2 * i];
                r[2 * m + 1] = r[2 * i + 1];
                m++;
            }
        }
        if (n->negated) {
            uint32_t *c = malloc((size_t)(m + 1) * 2 * sizeof *c);
            if (!c) {
                free(r);
                return PD_ENOMEM;
            }
            int k = 0;
            uint32_t next = 0;
            for (int i = 0; i < m; i++) {
                if (r[2 * i] > next) {
                    c[2 * k] = next;
                    c[2 * k + 1] = r[2 * i] - 1;
                    k++;
                }
                next = r[2 * i + 1] + 1;
            }
            if (next <= 0x10FFFF) {
                c[2 * k] = next;
                c[2 * k + 1] = 0x10FFFF;
                k++;
            }
            free(r);
            r = c;
            m = k;
        }
        int32_t e = nfa_state(a);
        if (e < 0) {
            free(r);
            goto too_big;
        }
        class_ctx cc = {.a = a, .from = from, .to = e, .rc = PD_OK};
        for (int i = 0; i < m; i++) pd_grammar_utf8_ranges(r[2 * i], r[2 * i + 1], class_seq, &cc);
        free(r);
        if (cc.rc) goto too_big;
        *end = e;
        return PD_OK;
    }
    case A_REF:
        if (a->inline_rule[n->sym]) return build(a, p->rules[n->sym].body, from, end);
        /* fall through */
    case A_TOK: {
        int32_t s = nfa_state(a);
        if (s < 0) goto too_big;
        if ((rc = nfa_edge_add(a, from, n->kind == A_REF ? E_REF : E_TOK, 0, 0, n->sym, s))) return rc;
        *end = s;
        return PD_OK;
    }
    case A_REP: {
        int32_t kid = n->kids[0], min = n->min, max = n->max;
        int32_t at = from;
        for (int32_t i = 0; i < min; i++)
            if ((rc = build(a, kid, at, &at))) return rc;
        if (max < 0) { /* loop: at -> kid -> at */
            int32_t loop = nfa_state(a), k_end;
            if (loop < 0) goto too_big;
            if ((rc = nfa_edge_add(a, at, E_EPS, 0, 0, 0, loop))) return rc;
            if ((rc = build(a, kid, loop, &k_end))) return rc;
            if ((rc = nfa_edge_add(a, k_end, E_EPS, 0, 0, 0, loop))) return rc;
            *end = loop;
            return PD_OK;
        }
        if (max == min) {
            *end = at;
            return PD_OK;
        }
        int32_t e = nfa_state(a);
        if (e < 0) goto too_big;
        for (int32_t i = min; i < max; i++) {
            if ((rc = nfa_edge_add(a, at, E_EPS, 0, 0, 0, e))) return rc;
            if ((rc = build(a, kid, at, &at))) return rc;
        }
        if ((rc = nfa_edge_add(a, at, E_EPS, 0, 0, 0, e))) return rc;
        *end = e;
        return PD_OK;
    }
    }
    return PD_EINVAL;
too_big:
    if (a->n_states >= NFA_MAX_STATES)
        return perr(p, n->pos, "the grammar expands to more than %d automaton states (smaller repetition bounds)",
                    NFA_MAX_STATES);
    return PD_ENOMEM;
}

/* ---- subset construction ------------------------------------------------ */

typedef struct ivec {
    int32_t *v;
    size_t n, cap;
} ivec;

static int ivec_push(ivec *a, int32_t x) {
    if (a->n == a->cap) {
        size_t cap = a->cap ? a->cap * 2 : 64;
        int32_t *v = realloc(a->v, cap * sizeof *v);
        if (!v) return PD_ENOMEM;
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = x;
    return PD_OK;
}

typedef struct dfa_builder {
    nfa *a;
    int32_t final;
    uint32_t *mark, epoch;
    ivec stack;
    /* DFA states as NFA sets: set i = pool[set_off[i] .. set_off[i+1]] */
    ivec pool, set_off;
    int32_t *table; /* hash -> dfa id + 1 */
    size_t table_cap;
    /* output */
    pd_gstate *states;
    int32_t n_states, cap_states;
    pd_gbyte_edge *bytes;
    size_t n_bytes, cap_bytes;
    pd_gsym_edge *refs, *toks;
    size_t n_refs, cap_refs, n_toks, cap_toks;
} dfa_builder;

static int cmp_i32(const void *x, const void *y) {
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    return a < b ? -1 : a > b;
}

/* eps-closure of the NFA states in set (n of them, scratch), sorted, into *out. */
static int closure(dfa_builder *d, const int32_t *seeds, size_t n, ivec *out) {
    d->epoch++;
    out->n = 0;
    d->stack.n = 0;
    for (size_t i = 0; i < n; i++) {
        if (d->mark[seeds[i]] == d->epoch) continue;
        d->mark[seeds[i]] = d->epoch;
        if (ivec_push(&d->stack, seeds[i])) return PD_ENOMEM;
    }
    while (d->stack.n) {
        int32_t s = d->stack.v[--d->stack.n];
        if (ivec_push(out, s)) return PD_ENOMEM;
        for (int32_t e = d->a->head[s]; e >= 0; e = d->a->edges[e].next) {
            const nfa_edge *ed = &d->a->edges[e];
            if (ed->kind != E_EPS || d->mark[ed->to] == d->epoch) continue;
            d->mark[ed->to] = d->epoch;
            if (ivec_push(&d->stack, ed->to)) return PD_ENOMEM;
        }
    }
    if (out->n > 1) qsort(out->v, out->n, sizeof *out->v, cmp_i32);
    return PD_OK;
}

static uint64_t hash_set(const int32_t *v, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ n;
    for (size_t i = 0; i < n; i++) {
        h ^= (uint64_t)(uint32_t)v[i];
        h *= 0xff51afd7ed558ccdull;
        h ^= h >> 33;
    }
    return h;
}

static int table_rehash(dfa_builder *d) {
    size_t cap = d->table_cap ? d->table_cap * 2 : 1024;
    int32_t *t = calloc(cap, sizeof *t);
    if (!t) return PD_ENOMEM;
    for (int32_t id = 0; id < d->n_states; id++) {
        const int32_t *v = d->pool.v + d->set_off.v[id];
        size_t n = (size_t)(d->set_off.v[id + 1] - d->set_off.v[id]);
        size_t i = hash_set(v, n) & (cap - 1);
        while (t[i]) i = (i + 1) & (cap - 1);
        t[i] = id + 1;
    }
    free(d->table);
    d->table = t;
    d->table_cap = cap;
    return PD_OK;
}

#define DFA_MAX_STATES 200000

/* The DFA state for a closed, sorted NFA set (added if new). */
static int dfa_state_of(dfa_builder *d, const ivec *set, int32_t *id) {
    if ((size_t)(d->n_states + 1) * 2 > d->table_cap && table_rehash(d)) return PD_ENOMEM;
    size_t i = hash_set(set->v, set->n) & (d->table_cap - 1);
    while (d->table[i]) {
        int32_t c = d->table[i] - 1;
        size_t n = (size_t)(d->set_off.v[c + 1] - d->set_off.v[c]);
        if (n == set->n && memcmp(d->pool.v + d->set_off.v[c], set->v, n * sizeof *set->v) == 0) {
            *id = c;
            return PD_OK;
        }
        i = (i + 1) & (d->table_cap - 1);
    }
    if (d->n_states >= DFA_MAX_STATES) return PD_ERANGE;
    for (size_t k = 0; k < set->n; k++)
        if (ivec_push(&d->pool, set->v[k])) return PD_ENOMEM;
    if (ivec_push(&d->set_off, (int32_t)d->pool.n)) return PD_ENOMEM;
    if (d->n_states == d->cap_states) {
        int32_t cap = d->cap_states ? d->cap_states * 2 : 64;
        pd_gstate *s = realloc(d->states, (size_t)cap * sizeof *s);
        if (!s) return PD_ENOMEM;
        d->states = s;
        d->cap_states = cap;
    }
    memset(&d->states[d->n_states], 0, sizeof d->states[0]);
    d->table[i] = d->n_states + 1;
    *id = d->n_states++;
    return PD_OK;
}

#define GROW(arr, n, cap)                                                   \
    do {                                                                    \
        if ((n) == (cap)) {                                                 \
            size_t c_ = (cap) ? (cap) * 2 : 64;                             \
            void *p_ = realloc((arr), c_ * sizeof *(arr));                  \
            if (!p_) { rc = PD_ENOMEM; goto out; }                          \
            (arr) = p_;                                                     \
            (cap) = c_;                                                     \
        }                                                                   \
    } while (0)

typedef struct sym_target {
    int32_t sym, to;
} sym_target;

static int cmp_sym_target(const void *x, const void *y) {
    const sym_target *a = x, *b = y;
    if (a->sym != b->sym) return a->sym < b->sym ? -1 : 1;
    return a->to < b->to ? -1 : a->to > b->to;
}

/* Symbol edges (refs or tokens) of one DFA state: grouped by symbol. */
static int add_sym_edges(dfa_builder *d, sym_target *st, size_t n, ivec *tmp, ivec *closed, bool refs) {
    int rc = PD_OK;
    if (n > 1) qsort(st, n, sizeof *st, cmp_sym_target);
    for (size_t i = 0; i < n;) {
        size_t j = i;
        tmp->n = 0;
        while (j < n && st[j].sym == st[i].sym)
            if ((rc = ivec_push(tmp, st[j++].to))) goto out;
        if ((rc = closure(d, tmp->v, tmp->n, closed))) goto out;
        int32_t to;
        if ((rc = dfa_state_of(d, closed, &to))) goto out;
        if (refs) {
            GROW(d->refs, d->n_refs, d->cap_refs);
            d->refs[d->n_refs++] = (pd_gsym_edge){st[i].sym, to};
        } else {
            GROW(d->toks, d->n_toks, d->cap_toks);
            d->toks[d->n_toks++] = (pd_gsym_edge){st[i].sym, to};
        }
        i = j;
    }
out:
    return rc;
}

static int determinize(nfa *a, int32_t start, int32_t final, pd_grule *out) {
    dfa_builder d = {.a = a, .final = final};
    ivec closed = {0}, tmp = {0}, points = {0};
    sym_target *refs = NULL, *toks = NULL;
    size_t cap_refs = 0, cap_toks = 0;
    int rc = PD_ENOMEM;
    d.mark = calloc((size_t)a->n_states, sizeof *d.mark);
    if (!d.mark || ivec_push(&d.set_off, 0)) goto out;
    if ((rc = closure(&d, &start, 1, &closed))) goto out;
    int32_t s0;
    if ((rc = dfa_state_of(&d, &closed, &s0))) goto out;
    for (int32_t cur = 0; cur < d.n_states; cur++) {
        size_t n_refs = 0, n_toks = 0;
        points.n = 0;
        bool accepting = false;
        for (int32_t k = d.set_off.v[cur]; k < d.set_off.v[cur + 1]; k++) {
            int32_t s = d.pool.v[k];
            if (s == final) accepting = true;
            for (int32_t e = a->head[s]; e >= 0; e = a->edges[e].next) {
                const nfa_edge *ed = &a->edges[e];
                if (ed->kind == E_BYTE) {
                    if ((rc = ivec_push(&points, ed->lo)) || (rc = ivec_push(&points, ed->hi + 1))) goto out;
                } else if (ed->kind == E_REF) {
                    GROW(refs, n_refs, cap_refs);
                    refs[n_refs++] = (sym_target){ed->sym, ed->to};
                } else if (ed->kind == E_TOK) {
                    GROW(toks, n_toks, cap_toks);
                    toks[n_toks++] = (sym_target){ed->sym, ed->to};
                }
            }
        }
        /* byte edges: one target set per interval between boundary points */
        size_t byte_off = d.n_bytes;
        if (points.n > 1) qsort(points.v, points.n, sizeof *points.v, cmp_i32);
        for (size_t i = 0; i + 1 < points.n; i++) {
            int32_t lo = points.v[i], hi = points.v[i + 1] - 1;
            if (hi < lo) continue;
            tmp.n = 0;
            for (int32_t k = d.set_off.v[cur]; k < d.set_off.v[cur + 1]; k++)
                for (int32_t e = a->head[d.pool.v[k]]; e >= 0; e = a->edges[e].next) {
                    const nfa_edge *ed = &a->edges[e];
                    if (ed->kind == E_BYTE && ed->lo <= lo && lo <= ed->hi && (rc = ivec_push(&tmp, ed->to))) goto out;
                }
            if (tmp.n == 0) continue;
            if ((rc = closure(&d, tmp.v, tmp.n, &closed))) goto out;
            int32_t to;
            if ((rc = dfa_state_of(&d, &closed, &to))) goto out;
            if (d.n_bytes > byte_off && d.bytes[d.n_bytes - 1].to == to && d.bytes[d.n_bytes - 1].hi + 1 == lo) {
                d.bytes[d.n_bytes - 1].hi = (uint8_t)hi;
            } else {
                GROW(d.bytes, d.n_bytes, d.cap_bytes);
                d.bytes[d.n_bytes++] = (pd_gbyte_edge){(uint8_t)lo, (uint8_t)hi, to};
            }
        }
        size_t ref_off = d.n_refs, tok_off = d.n_toks;
        if ((rc = add_sym_edges(&d, refs, n_refs, &tmp, &closed, true))) goto out;
        if ((rc = add_sym_edges(&d, toks, n_toks, &tmp, &closed, false))) goto out;
        pd_gstate *st = &d.states[cur];
        st->byte_off = (uint32_t)byte_off;
        st->n_byte = (uint32_t)(d.n_bytes - byte_off);
        st->ref_off = (uint32_t)ref_off;
        st->n_ref = (uint32_t)(d.n_refs - ref_off);
        st->tok_off = (uint32_t)tok_off;
        st->n_tok = (uint32_t)(d.n_toks - tok_off);
        st->accepting = accepting;
    }
    out->start = s0;
    out->n_states = d.n_states;
    out->states = d.states;
    out->bytes = d.bytes;
    out->refs = d.refs;
    out->toks = d.toks;
    d.states = NULL;
    d.bytes = NULL;
    d.refs = d.toks = NULL;
    rc = PD_OK;
out:
    free(d.mark);
    free(d.stack.v);
    free(d.pool.v);
    free(d.set_off.v);
    free(d.table);
    free(d.states);
    free(d.bytes);
    free(d.refs);
    free(d.toks);
    free(closed.v);
    free(tmp.v);
    free(points.v);
    free(refs);
    free(toks);
    return rc;
}

/* ---- analysis ------------------------------------------------------------ */

static int64_t add_cost(int64_t a, int64_t b) {
    return a == PD_GRAMMAR_INF_COST || b == PD_GRAMMAR_INF_COST ? PD_GRAMMAR_INF_COST : a + b;
}

/* Shortest completions of every state, given the rules' current shortest
 * texts: Bellman-Ford passes within the rule (weights are >= 0). Returns
 * whether anything changed. */
static bool relax_rule(pd_grammar *g, pd_grule *r) {
    bool any = false, changed = true;
    while (changed) {
        changed = false;
        for (int32_t s = r->n_states - 1; s >= 0; s--) {
            pd_gstate *st = &r->states[s];
            int64_t best = st->accepting ? 0 : PD_GRAMMAR_INF_COST;
            for (uint32_t i = 0; i < st->n_byte; i++) {
                int64_t c = add_cost(1, r->states[r->bytes[st->byte_off + i].to].min_bytes);
                if (c < best) best = c;
            }
            for (uint32_t i = 0; i < st->n_tok; i++) {
                int64_t c = add_cost(1, r->states[r->toks[st->tok_off + i].to].min_bytes);
                if (c < best) best = c;
            }
            for (uint32_t i = 0; i < st->n_ref; i++) {
                const pd_gsym_edge *e = &r->refs[st->ref_off + i];
                const pd_grule *callee = &g->rules[e->sym];
                int64_t c = add_cost(callee->states ? callee->states[callee->start].min_bytes : PD_GRAMMAR_INF_COST,
                                     r->states[e->to].min_bytes);
                if (c < best) best = c;
            }
            if (best < st->min_bytes) {
                st->min_bytes = best;
                changed = any = true;
            }
        }
    }
    return any;
}

static int check_left_recursion(pd_grammar *g, parser *p) {
    const int32_t n = g->n_rules;
    if (n < 1) return PD_OK;
    int rc = PD_ENOMEM;
    /* left[left_off[r] .. left_off[r + 1]) = rules r calls before consuming anything */
    ivec left = {0};
    int32_t *left_off = malloc(((size_t)n + 1) * sizeof *left_off);
    uint32_t *listed = calloc((size_t)n, sizeof *listed);
    uint8_t *seen = NULL;
    int32_t *stack = NULL, *color = NULL, *path = NULL, *iter = NULL;
    if (!left_off || !listed) goto out;
    for (int32_t r = 0; r < n; r++) {
        const pd_grule *ru = &g->rules[r];
        left_off[r] = (int32_t)left.n;
        seen = calloc((size_t)ru->n_states, 1);
        stack = malloc((size_t)ru->n_states * sizeof *stack);
        if (!seen || !stack) goto out;
        int32_t sp = 0;
        stack[sp++] = ru->start;
        seen[ru->start] = 1;
        while (sp) {
            const pd_gstate *st = &ru->states[stack[--sp]];
            for (uint32_t i = 0; i < st->n_ref; i++) {
                const pd_gsym_edge *e = &ru->refs[st->ref_off + i];
                if (listed[e->sym] != (uint32_t)r + 1) {
                    listed[e->sym] = (uint32_t)r + 1;
                    if (ivec_push(&left, e->sym)) goto out;
                }
                const pd_grule *c = &g->rules[e->sym];
                if (c->states[c->start].min_bytes == 0 && !seen[e->to]) {
                    seen[e->to] = 1;
                    stack[sp++] = e->to;
                }
            }
        }
        free(seen);
        free(stack);
        seen = NULL;
        stack = NULL;
    }
    left_off[n] = (int32_t)left.n;
    /* a cycle in left is left recursion: DFS with colours */
    color = calloc((size_t)n, sizeof *color);
    path = malloc((size_t)n * sizeof *path);
    iter = malloc((size_t)n * sizeof *iter);
    if (!color || !path || !iter) goto out;
    for (int32_t root = 0; root < n; root++) {
        if (color[root]) continue;
        int32_t depth = 0;
        path[0] = root;
        iter[0] = left_off[root];
        color[root] = 1;
        while (depth >= 0) {
            int32_t r = path[depth];
            if (iter[depth] >= left_off[r + 1]) {
                color[r] = 2;
                depth--;
                continue;
            }
            int32_t c = left.v[iter[depth]++];
            if (color[c] == 1) {
                char chain[300];
                pd_strbuf b = {chain, sizeof chain, 0};
                int32_t from = depth;
                while (path[from] != c) from--;
                for (int32_t k = from; k <= depth; k++) pd_strbuf_printf(&b, "%s -> ", g->rules[path[k]].name);
                pd_strbuf_printf(&b, "%s", g->rules[c].name);
                rc = perr(p, p->rules[c].def_pos,
                          "left recursion: rule '%s' can reach itself without consuming text (%s); "
                          "rewrite it with repetition, e.g. a ::= b (\"+\" b)*",
                          g->rules[c].name, chain);
                goto out;
            }
            if (color[c] == 0) {
                color[c] = 1;
                depth++;
                path[depth] = c;
                iter[depth] = left_off[c];
            }
        }
    }
    rc = PD_OK;
out:
    free(left.v);
    free(left_off);
    free(listed);
    free(seen);
    free(stack);
    free(color);
    free(path);
    free(iter);
    return rc;
}

/* ---- inlining -------------------------------------------------------------
 * A reference to a rule that cannot reach itself is expanded in place. A
 * small helper rule (a string's `char ::= [^"\\] | ...`) would otherwise be
 * the top frame of every stack inside a string, and as it ends after one
 * character, nearly every token would leave it: masks would walk the whole
 * vocabulary each time instead of using the cached set. Only recursive
 * rules stay references, and expansions are capped in size. */

#define INLINE_MAX_STATES 1000
#define EST_CAP 1000000000LL

static int collect_refs(const parser *p, int32_t id, uint32_t *listed, uint32_t stamp, ivec *out) {
    const ast *n = &p->nodes[id];
    if (n->kind == A_REF && listed[n->sym] != stamp) {
        listed[n->sym] = stamp;
        if (ivec_push(out, n->sym)) return PD_ENOMEM;
    }
    for (int i = 0; i < n->n_kids; i++)
        if (collect_refs(p, n->kids[i], listed, stamp, out)) return PD_ENOMEM;
    return PD_OK;
}

static int64_t est_add(int64_t a, int64_t b) {
    return a + b > EST_CAP ? EST_CAP : a + b;
}

/* Estimated NFA states of node id with the inlining decided so far. */
static int64_t estimate(const parser *p, int32_t id, const bool *inline_rule, const int64_t *rule_est) {
    const ast *n = &p->nodes[id];
    switch (n->kind) {
    case A_BYTES: return n->n_bytes + 1;
    case A_CLASS: return 4 * (int64_t)(n->n_ranges + 1) + 8;
    case A_TOK: return 1;
    case A_REF: return inline_rule[n->sym] ? rule_est[n->sym] : 1;
    case A_REP: {
        int64_t kid = estimate(p, n->kids[0], inline_rule, rule_est);
        int64_t copies = n->max < 0 ? (n->min > 1 ? n->min : 1) + 1 : (n->max > 1 ? n->max : 1);
        return kid > EST_CAP / copies ? EST_CAP : kid * copies + 2;
    }
    default: {
        int64_t sum = 1;
        for (int i = 0; i < n->n_kids; i++) sum = est_add(sum, estimate(p, n->kids[i], inline_rule, rule_est) + 1);
        return sum;
    }
    }
}

/* Tarjan's strongly connected components over the call graph: a rule in a
 * component of two or more, or calling itself, is recursive. Components
 * complete callees first, so a non-recursive rule's size is known when its
 * callers need it. */
static int decide_inlining(const parser *p, bool *inline_rule) {
    int32_t n = p->n_rules;
    int rc = PD_ENOMEM;
    ivec adj = {0}, sccs = {0};
    int32_t *adj_off = malloc((size_t)(n + 1) * sizeof *adj_off);
    uint32_t *listed = calloc((size_t)n, sizeof *listed);
    int32_t *index = malloc((size_t)n * sizeof *index), *low = malloc((size_t)n * sizeof *low);
    int32_t *call_v = malloc((size_t)n * sizeof *call_v), *call_it = malloc((size_t)n * sizeof *call_it);
    uint8_t *on = calloc((size_t)n, 1);
    int64_t *rule_est = calloc((size_t)n, sizeof *rule_est);
    if (!adj_off || !listed || !index || !low || !call_v || !call_it || !on || !rule_est) goto out;
    for (int32_t r = 0; r < n; r++) {
        adj_off[r] = (int32_t)adj.n;
        if (collect_refs(p, p->rules[r].body, listed, (uint32_t)r + 1, &adj)) goto out;
    }
    adj_off[n] = (int32_t)adj.n;
    for (int32_t r = 0; r < n; r++) index[r] = -1;
    int32_t next_index = 0;
    for (int32_t root = 0; root < n; root++) {
        if (index[root] >= 0) continue;
        int32_t depth = 0;
        call_v[0] = root;
        call_it[0] = adj_off[root];
        index[root] = low[root] = next_index++;
        if (ivec_push(&sccs, root)) goto out;
        on[root] = 1;
        while (depth >= 0) {
            int32_t v = call_v[depth];
            if (call_it[depth] < adj_off[v + 1]) {
                int32_t w = adj.v[call_it[depth]++];
                if (index[w] < 0) {
                    index[w] = low[w] = next_index++;
                    if (ivec_push(&sccs, w)) goto out;
                    on[w] = 1;
                    depth++;
                    call_v[depth] = w;
                    call_it[depth] = adj_off[w];
                } else if (on[w] && index[w] < low[v]) {
                    low[v] = index[w];
                }
                continue;
            }
            depth--;
            if (depth >= 0 && low[v] < low[call_v[depth]]) low[call_v[depth]] = low[v];
            if (low[v] != index[v]) continue;
            /* v roots a component: the rules above it on the stack */
            size_t first = sccs.n;
            while (sccs.v[first - 1] != v) first--;
            first--;
            bool recursive = sccs.n - first > 1;
            for (int32_t k = adj_off[v]; k < adj_off[v + 1] && !recursive; k++)
                if (adj.v[k] == v) recursive = true;
            for (size_t k = first; k < sccs.n; k++) on[sccs.v[k]] = 0;
            sccs.n = first;
            if (!recursive) {
                rule_est[v] = estimate(p, p->rules[v].body, inline_rule, rule_est);
                inline_rule[v] = rule_est[v] <= INLINE_MAX_STATES;
            }
        }
    }
    rc = PD_OK;
out:
    free(adj.v);
    free(sccs.v);
    free(adj_off);
    free(listed);
    free(index);
    free(low);
    free(call_v);
    free(call_it);
    free(on);
    free(rule_est);
    return rc;
}

/* ---- compile ------------------------------------------------------------- */

pd_grammar *pd_grammar_retain(const pd_grammar *g) {
    pd_grammar *m = (pd_grammar *)g; /* the count is the one mutable field besides the locked cache */
    if (m) atomic_fetch_add(&m->refs, 1);
    return m;
}

void pd_grammar_free(pd_grammar *g) {
    if (!g || atomic_fetch_sub(&g->refs, 1) != 1) return;
    for (int32_t i = 0; i < g->n_rules; i++) {
        free(g->rules[i].name);
        free(g->rules[i].states);
        free(g->rules[i].bytes);
        free(g->rules[i].refs);
        free(g->rules[i].toks);
    }
    free(g->rules);
    pd_gcache_free(g->cache);
    free(g);
}

int pd_grammar_compile(const char *text, size_t len, pd_grammar **out, pd_error *err) {
    *out = NULL;
    if (!text) return pd_errorf(err, PD_EINVAL, "grammar: no text");
    parser p = {.text = text, .len = len, .err = err};
    nfa a = {.p = &p};
    pd_grammar *g = NULL;
    bool *inline_rule = NULL;
    int rc = parse_grammar(&p);
    if (rc) goto out;
    int32_t root = -1;
    for (int32_t i = 0; i < p.n_rules; i++)
        if (strcmp(p.rules[i].name, "root") == 0) root = i;
    if (root < 0) {
        rc = pd_errorf(err, PD_EINVAL, "grammar: no rule named 'root' (the start rule): add root ::= ...");
        goto out;
    }
    rc = PD_ENOMEM;
    inline_rule = calloc((size_t)p.n_rules, sizeof *inline_rule);
    if (!inline_rule || decide_inlining(&p, inline_rule)) goto out;
    a.inline_rule = inline_rule;
    g = calloc(1, sizeof *g);
    if (g) atomic_init(&g->refs, 1);
    if (!g) goto out;
    g->rules = calloc((size_t)p.n_rules, sizeof *g->rules);
    g->cache = pd_gcache_new();
    if (!g->rules || !g->cache) goto out;
    g->n_rules = p.n_rules;
    g->root = root;
    for (int32_t r = 0; r < p.n_rules; r++) {
        g->rules[r].name = strdup(p.rules[r].name);
        if (!g->rules[r].name) goto out;
        a.n_states = a.n_edges = 0;
        int32_t start = nfa_state(&a), end = start;
        if (start < 0) goto out;
        /* a rule expanded wherever it is used needs no automaton of its own */
        if ((r == root || !inline_rule[r]) && (rc = build(&a, p.rules[r].body, start, &end))) goto out;
        rc = determinize(&a, start, end, &g->rules[r]);
        if (rc == PD_ERANGE)
            rc = perr(&p, p.rules[r].def_pos, "rule '%s' needs more than %d automaton states", p.rules[r].name,
                      DFA_MAX_STATES);
        if (rc) goto out;
        for (int32_t s = 0; s < g->rules[r].n_states; s++) g->rules[r].states[s].min_bytes = PD_GRAMMAR_INF_COST;
    }
    for (bool changed = true; changed;) {
        changed = false;
        for (int32_t r = 0; r < g->n_rules; r++)
            if (relax_rule(g, &g->rules[r])) changed = true;
    }
    /* name a rule with no finite text that refers to no other such rule (the
     * culprit rather than the rules that merely use it), else the first */
    int32_t endless = -1;
    for (int32_t r = 0; r < g->n_rules; r++) {
        const pd_grule *ru = &g->rules[r];
        if (ru->states[ru->start].min_bytes != PD_GRAMMAR_INF_COST) continue;
        bool uses_other = false;
        for (int32_t s = 0; s < ru->n_states; s++)
            for (uint32_t i = 0; i < ru->states[s].n_ref; i++) {
                const pd_grule *c = &g->rules[ru->refs[ru->states[s].ref_off + i].sym];
                if (c != ru && c->states[c->start].min_bytes == PD_GRAMMAR_INF_COST) uses_other = true;
            }
        if (endless < 0 || !uses_other) endless = r;
        if (!uses_other) break;
    }
    for (int32_t r = endless; r >= 0; r = -1) {
        {
            rc = perr(&p, p.rules[r].def_pos,
                      "rule '%s' matches no finite text (every alternative refers back to it): add an alternative "
                      "that ends",
                      p.rules[r].name);
            goto out;
        }
    }
    if ((rc = check_left_recursion(g, &p))) goto out;
    *out = g;
    g = NULL;
    rc = PD_OK;
out:
    if (rc == PD_ENOMEM) pd_errorf(err, PD_ENOMEM, "grammar: out of memory");
    pd_grammar_free(g);
    free(a.head);
    free(a.edges);
    free(inline_rule);
    free_parser(&p);
    return rc;
}
