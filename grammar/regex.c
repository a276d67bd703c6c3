/* JSON Schema "pattern" (an ECMAScript regular expression subset) to grammar
 * text, and the quoting of grammar literals.
 *
 * The pattern constrains the decoded string; the grammar spells the JSON
 * text inside the quotes. So every set of characters becomes a class of the
 * characters JSON writes as they are, plus the canonical escape (\" \\ \n
 * \u001f ...) of the members JSON must escape. Other spellings of the same
 * characters (\u0061 for a) are not generated: the grammar is narrower than
 * the pattern, never wider.
 *
 * Supported: literals, ., [classes] with ranges and negation, \d \w \s and
 * their negations (ASCII, as PCRE2 without UCP), escapes \n \r \t \f \v \0
 * \xHH \uHHHH and escaped punctuation, groups (...), (?:...), named groups,
 * |, * + ? {m} {m,} {m,n}, ^ at the start and $ at the end of a top-level
 * alternative. Refused: lookaround, backreferences, \b \B, lazy and
 * possessive quantifiers, inline flags, \p{...}, POSIX classes. */
#include "schema_internal.h"

#include <stdint.h>

#define CP_MAX 0x10FFFF

char *pd_grammar_quote(const char *bytes, size_t len) {
    pd_sbuf b = {0};
    pd_sbuf_putn(&b, "\"", 1);
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)bytes[i];
        switch (c) {
        case '"': pd_sbuf_puts(&b, "\\\""); break;
        case '\\': pd_sbuf_puts(&b, "\\\\"); break;
        case '\n': pd_sbuf_puts(&b, "\\n"); break;
        case '\r': pd_sbuf_puts(&b, "\\r"); break;
        case '\t': pd_sbuf_puts(&b, "\\t"); break;
        default:
            if (c < 0x20 || c == 0x7f) pd_sbuf_printf(&b, "\\x%02X", c);
            else pd_sbuf_putn(&b, (const char *)&c, 1); /* UTF-8 bytes pass through */
        }
    }
    pd_sbuf_putn(&b, "\"", 1);
    if (b.oom) {
        pd_sbuf_free(&b);
        return NULL;
    }
    return b.p;
}

/* ---- sets of code points ----------------------------------------------- */

typedef struct cp_range {
    uint32_t lo, hi;
} cp_range;

typedef struct cp_set {
    cp_range *r;
    size_t n, cap;
    bool oom;
} cp_set;

static void set_add(cp_set *s, uint32_t lo, uint32_t hi) {
    if (s->oom) return;
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 8;
        cp_range *r = realloc(s->r, cap * sizeof *r);
        if (!r) {
            s->oom = true;
            return;
        }
        s->r = r;
        s->cap = cap;
    }
    s->r[s->n++] = (cp_range){lo, hi};
}

static int range_cmp(const void *a, const void *b) {
    const cp_range *x = a, *y = b;
    return x->lo < y->lo ? -1 : x->lo > y->lo;
}

/* Sort and merge overlapping or adjacent ranges. */
static void set_normalize(cp_set *s) {
    if (s->n == 0) return;
    if (s->n > 1) qsort(s->r, s->n, sizeof *s->r, range_cmp);
    size_t w = 0;
    for (size_t i = 1; i < s->n; i++) {
        if (s->r[i].lo <= s->r[w].hi + 1) {
            if (s->r[i].hi > s->r[w].hi) s->r[w].hi = s->r[i].hi;
        } else {
            s->r[++w] = s->r[i];
        }
    }
    s->n = w + 1;
}

/* The complement within [0, CP_MAX] (s normalized). */
static cp_set set_complement(const cp_set *s) {
    cp_set c = {0};
    uint32_t next = 0;
    for (size_t i = 0; i < s->n; i++) {
        if (s->r[i].lo > next) set_add(&c, next, s->r[i].lo - 1);
        next = s->r[i].hi + 1;
    }
    if (next <= CP_MAX) set_add(&c, next, CP_MAX);
    if (s->oom) c.oom = true;
    return c;
}

static bool set_has(const cp_set *s, uint32_t cp) {
    for (size_t i = 0; i < s->n; i++)
        if (cp >= s->r[i].lo && cp <= s->r[i].hi) return true;
    return false;
}

void pd_schema_class_char(pd_sbuf *b, uint32_t cp) {
    if (cp > 0x20 && cp < 0x7f && !strchr("]-^[\\", (int)cp)) {
        char c = (char)cp;
        pd_sbuf_putn(b, &c, 1);
    } else if (cp < 0x80) {
        pd_sbuf_printf(b, "\\x%02X", cp);
    } else if (cp <= 0xFFFF) {
        pd_sbuf_printf(b, "\\u%04X", cp);
    } else {
        pd_sbuf_printf(b, "\\U%08X", cp);
    }
}

static void class_ranges(pd_sbuf *b, const cp_set *s) {
    for (size_t i = 0; i < s->n; i++) {
        pd_schema_class_char(b, s->r[i].lo);
        if (s->r[i].hi > s->r[i].lo) {
            if (s->r[i].hi > s->r[i].lo + 1) pd_sbuf_putn(b, "-", 1);
            pd_schema_class_char(b, s->r[i].hi);
        }
    }
}

/* The characters JSON must escape: controls, " and \ (and surrogates,
 * which are not characters at all). */
static bool json_special(uint32_t cp) { return cp < 0x20 || cp == '"' || cp == '\\'; }

/* Spell a set of code points (normalized) as JSON string content: an
 * expression matching one character. Returns whether it is empty. */
static bool emit_set(pd_sbuf *b, const cp_set *s, bool *simple) {
    /* The members written as they are. */
    cp_set plain = {0};
    for (size_t i = 0; i < s->n; i++) {
        uint32_t lo = s->r[i].lo, hi = s->r[i].hi;
        for (uint32_t cp = lo; cp <= hi && cp < 0x80; cp++) {
            if (json_special(cp)) continue;
            uint32_t end = cp;
            while (end + 1 <= hi && end + 1 < 0x80 && !json_special(end + 1)) end++;
            set_add(&plain, cp, end);
            cp = end;
        }
        if (hi >= 0x80) {
            uint32_t a = lo < 0x80 ? 0x80 : lo;
            if (a < 0xD800 && hi >= 0xD800) {
                set_add(&plain, a, hi < 0xD7FF ? hi : 0xD7FF);
                if (hi > 0xDFFF) set_add(&plain, 0xE000, hi);
            } else if (a >= 0xD800 && a <= 0xDFFF) {
                if (hi > 0xDFFF) set_add(&plain, 0xE000, hi);
            } else {
                set_add(&plain, a, hi);
            }
        }
    }
    set_normalize(&plain);
    /* The members written as escapes. */
    char short_esc[8];
    size_t n_short = 0;
    uint32_t uesc[32];
    size_t n_u = 0;
    /* U+0000 is left out: many parsers (jansson among them) refuse \u0000. */
    for (uint32_t cp = 1; cp < 0x60; cp++) {
        if (!json_special(cp) || !set_has(s, cp)) continue;
        const char *sh = cp == '"' ? "\"" : cp == '\\' ? "\\\\" : cp == '\b' ? "b" : cp == '\f' ? "f"
                        : cp == '\n' ? "n" : cp == '\r' ? "r" : cp == '\t' ? "t" : NULL;
        if (sh) {
            memcpy(short_esc + n_short, sh, strlen(sh));
            n_short += strlen(sh);
        } else {
            uesc[n_u++] = cp;
        }
    }
    int alts = (plain.n > 0) + (n_short + n_u > 0);
    if (alts == 0) {
        free(plain.r);
        return true;
    }
    *simple = alts > 1 || n_short + n_u == 0; /* parenthesized, or one class */
    if (alts > 1) pd_sbuf_puts(b, "( ");
    if (plain.n > 0) {
        cp_set all = set_complement(&plain), comp = {0};
        /* Surrogates never match (classes admit valid UTF-8 only), so the
         * negation need not list them. */
        for (size_t i = 0; i < all.n; i++) {
            if (all.r[i].lo >= 0xD800 && all.r[i].hi <= 0xDFFF) continue;
            set_add(&comp, all.r[i].lo, all.r[i].hi);
        }
        if (all.oom) comp.oom = true;
        free(all.r);
        /* Whichever of the class and its negation is shorter. */
        pd_sbuf_putn(b, "[", 1);
        if (comp.n <= plain.n) {
            pd_sbuf_putn(b, "^", 1);
            class_ranges(b, &comp);
        } else {
            class_ranges(b, &plain);
        }
        pd_sbuf_putn(b, "]", 1);
        if (comp.oom) b->oom = true;
        free(comp.r);
    }
    if (n_short + n_u > 0) {
        if (plain.n > 0) pd_sbuf_puts(b, " | ");
        pd_sbuf_puts(b, "\"\\\\\" ");
        int inner = (n_short > 0) + (n_u > 0);
        if (inner > 1) pd_sbuf_puts(b, "( ");
        if (n_short == 1 && short_esc[0] != '\\') {
            pd_sbuf_printf(b, "\"%s%c\"", short_esc[0] == '"' ? "\\" : "", short_esc[0]);
        } else if (n_short > 0) {
            pd_sbuf_putn(b, "[", 1);
            pd_sbuf_putn(b, short_esc, n_short);
            pd_sbuf_putn(b, "]", 1);
        }
        if (n_u > 0) {
            if (n_short > 0) pd_sbuf_puts(b, " | ");
            pd_sbuf_puts(b, "\"u00\" ");
            /* Grouped by the first hex digit (0 or 1). */
            int groups = 0;
            for (uint32_t hi = 0; hi < 2; hi++)
                for (size_t i = 0; i < n_u; i++)
                    if (uesc[i] >> 4 == hi) {
                        groups++;
                        break;
                    }
            if (groups > 1) pd_sbuf_puts(b, "( ");
            bool first = true;
            for (uint32_t hi = 0; hi < 2; hi++) {
                cp_set digits = {0};
                for (size_t i = 0; i < n_u; i++)
                    if (uesc[i] >> 4 == hi) {
                        /* both cases: jansson writes \u001F, others \u001f */
                        uint32_t d = (uint32_t)"0123456789abcdef"[uesc[i] & 15];
                        set_add(&digits, d, d);
                        d = (uint32_t)"0123456789ABCDEF"[uesc[i] & 15];
                        set_add(&digits, d, d);
                    }
                if (digits.n) {
                    set_normalize(&digits);
                    pd_sbuf_printf(b, "%s\"%u\" [", first ? "" : " | ", hi);
                    class_ranges(b, &digits);
                    pd_sbuf_putn(b, "]", 1);
                    first = false;
                }
                if (digits.oom) b->oom = true;
                free(digits.r);
            }
            if (groups > 1) pd_sbuf_puts(b, " )");
        }
        if (inner > 1) pd_sbuf_puts(b, " )");
    }
    if (alts > 1) pd_sbuf_puts(b, " )");
    if (plain.oom) b->oom = true;
    free(plain.r);
    return false;
}

/* ---- the parser ---------------------------------------------------------- */

typedef struct rx {
    const char *s; /* the pattern (UTF-8) */
    size_t pos;
    const char *char_rule, *path;
    pd_error *err;
    int depth;
} rx;

/* An expression: text (empty = matches the empty string), whether it is one
 * token that a quantifier may follow without parentheses, and whether it
 * cannot match anything (an empty class). */
typedef struct rexpr {
    pd_sbuf t;
    bool simple, never;
    int elems; /* items of a sequence */
} rexpr;

static int unsupported(rx *r, const char *what) {
    return pd_errorf(r->err, PD_EUNSUPPORTED,
                     "unsupported construct in JSON Schema keyword \"pattern\" at %s: %s (at offset %zu of the "
                     "pattern); supported are literals, ., [classes], \\d \\w \\s, groups, |, * + ? {m,n}, ^ and $",
                     r->path, what, r->pos);
}

static int invalid(rx *r, const char *what) {
    return pd_errorf(r->err, PD_EINVAL, "invalid JSON Schema \"pattern\" at %s: %s (at offset %zu)", r->path, what,
                     r->pos);
}

/* Decode one UTF-8 code point at r->pos (jansson strings are valid UTF-8). */
static uint32_t next_cp(rx *r) {
    const unsigned char *p = (const unsigned char *)r->s + r->pos;
    uint32_t cp;
    size_t n;
    if (p[0] < 0x80) cp = p[0], n = 1;
    else if ((p[0] & 0xE0) == 0xC0) cp = p[0] & 0x1F, n = 2;
    else if ((p[0] & 0xF0) == 0xE0) cp = p[0] & 0x0F, n = 3;
    else cp = p[0] & 0x07, n = 4;
    for (size_t i = 1; i < n && p[i]; i++) cp = (cp << 6) | (p[i] & 0x3F);
    r->pos += n;
    return cp;
}

static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static void add_class_escape(cp_set *s, char c) {
    cp_set tmp = {0};
    switch (c | 0x20) {
    case 'd': set_add(&tmp, '0', '9'); break;
    case 'w':
        set_add(&tmp, '0', '9');
        set_add(&tmp, 'A', 'Z');
        set_add(&tmp, '_', '_');
        set_add(&tmp, 'a', 'z');
        break;
    case 's':
        set_add(&tmp, '\t', '\r');
        set_add(&tmp, ' ', ' ');
        break;
    }
    if (c >= 'A' && c <= 'Z') {
        set_normalize(&tmp);
        cp_set comp = set_complement(&tmp);
        for (size_t i = 0; i < comp.n; i++) set_add(s, comp.r[i].lo, comp.r[i].hi);
        free(comp.r);
    } else {
        for (size_t i = 0; i < tmp.n; i++) set_add(s, tmp.r[i].lo, tmp.r[i].hi);
    }
    if (tmp.oom) s->oom = true;
    free(tmp.r);
}

/* After a backslash: a class escape (\d ...: *is_class set, added to set) or
 * one code point (*cp). */
static int parse_escape(rx *r, bool in_class, uint32_t *cp, cp_set *set, bool *is_class) {
    *is_class = false;
    char c = r->s[r->pos];
    if (!c) return invalid(r, "a trailing backslash");
    r->pos++;
    switch (c) {
    case 'd': case 'D': case 'w': case 'W': case 's': case 'S':
        add_class_escape(set, c);
        *is_class = true;
        return PD_OK;
    case 'n': *cp = '\n'; return PD_OK;
    case 'r': *cp = '\r'; return PD_OK;
    case 't': *cp = '\t'; return PD_OK;
    case 'f': *cp = '\f'; return PD_OK;
    case 'v': *cp = '\v'; return PD_OK;
    case '0':
        if (r->s[r->pos] >= '0' && r->s[r->pos] <= '9') return unsupported(r, "an octal escape");
        *cp = 0;
        return PD_OK;
    case 'x': case 'u': {
        int n = c == 'x' ? 2 : 4;
        uint32_t v = 0;
        if (c == 'u' && r->s[r->pos] == '{') return unsupported(r, "\\u{...}");
        for (int i = 0; i < n; i++) {
            int h = hex_value(r->s[r->pos]);
            if (h < 0) return invalid(r, c == 'x' ? "\\x needs two hex digits" : "\\u needs four hex digits");
            v = v * 16 + (uint32_t)h;
            r->pos++;
        }
        if (v >= 0xD800 && v <= 0xDFFF) return unsupported(r, "a surrogate escape");
        *cp = v;
        return PD_OK;
    }
    case 'b':
        if (in_class) {
            *cp = '\b';
            return PD_OK;
        }
        return unsupported(r, "the word boundary \\b");
    case 'B': return unsupported(r, "the word boundary \\B");
    case 'p': case 'P': return unsupported(r, "Unicode property classes \\p{...}");
    case 'k': return unsupported(r, "a named backreference \\k");
    case 'c': return unsupported(r, "a control escape \\c");
    default:
        if (c >= '1' && c <= '9') return unsupported(r, "a backreference");
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) {
            r->pos--;
            return unsupported(r, "an unknown escape");
        }
        r->pos--;
        *cp = next_cp(r); /* escaped punctuation or any other character stands for itself */
        return PD_OK;
    }
}

static int parse_class(rx *r, cp_set *set) {
    /* r->pos is just after '[' */
    bool negate = false;
    cp_set s = {0};
    int rc = PD_OK;
    if (r->s[r->pos] == '^') {
        negate = true;
        r->pos++;
    }
    if (r->s[r->pos] == ']') {
        rc = unsupported(r, "an empty class [] or [^] (write \\] for a literal ])");
        goto fail;
    }
    while (r->s[r->pos] != ']') {
        if (!r->s[r->pos]) {
            rc = invalid(r, "a class without its closing ]");
            goto fail;
        }
        if (r->s[r->pos] == '[' && strchr(":.=", r->s[r->pos + 1])) {
            rc = unsupported(r, "POSIX classes [:name:]");
            goto fail;
        }
        uint32_t lo;
        bool is_class = false;
        if (r->s[r->pos] == '\\') {
            r->pos++;
            if ((rc = parse_escape(r, true, &lo, &s, &is_class)) != PD_OK) goto fail;
        } else {
            lo = next_cp(r);
        }
        if (is_class) continue;
        uint32_t hi = lo;
        if (r->s[r->pos] == '-' && r->s[r->pos + 1] && r->s[r->pos + 1] != ']') {
            r->pos++;
            if (r->s[r->pos] == '\\') {
                r->pos++;
                if ((rc = parse_escape(r, true, &hi, &s, &is_class)) != PD_OK) goto fail;
                if (is_class) {
                    rc = unsupported(r, "a range ending in a class escape");
                    goto fail;
                }
            } else {
                hi = next_cp(r);
            }
            if (hi < lo) {
                rc = invalid(r, "a range out of order");
                goto fail;
            }
        }
        set_add(&s, lo, hi);
    }
    r->pos++;
    set_normalize(&s);
    if (negate) {
        cp_set c = set_complement(&s);
        free(s.r);
        s = c;
    }
    for (size_t i = 0; i < s.n; i++) set_add(set, s.r[i].lo, s.r[i].hi);
    if (s.oom) set->oom = true;
fail:
    free(s.r);
    return rc;
}

static int parse_alt(rx *r, rexpr *out, bool top);

void pd_schema_spell_cp(pd_sbuf *b, uint32_t cp) {
    if (cp == '"') pd_sbuf_puts(b, "\\\"");
    else if (cp == '\\') pd_sbuf_puts(b, "\\\\");
    else if (cp == '\n') pd_sbuf_puts(b, "\\n");
    else if (cp == '\r') pd_sbuf_puts(b, "\\r");
    else if (cp == '\t') pd_sbuf_puts(b, "\\t");
    else if (cp == '\b') pd_sbuf_puts(b, "\\b");
    else if (cp == '\f') pd_sbuf_puts(b, "\\f");
    else if (cp < 0x20) pd_sbuf_printf(b, "\\u%04x", cp);
    else {
        char u[4];
        size_t n;
        if (cp < 0x80) u[0] = (char)cp, n = 1;
        else if (cp < 0x800) u[0] = (char)(0xC0 | (cp >> 6)), u[1] = (char)(0x80 | (cp & 0x3F)), n = 2;
        else if (cp < 0x10000)
            u[0] = (char)(0xE0 | (cp >> 12)), u[1] = (char)(0x80 | ((cp >> 6) & 0x3F)), u[2] = (char)(0x80 | (cp & 0x3F)), n = 3;
        else
            u[0] = (char)(0xF0 | (cp >> 18)), u[1] = (char)(0x80 | ((cp >> 12) & 0x3F)),
            u[2] = (char)(0x80 | ((cp >> 6) & 0x3F)), u[3] = (char)(0x80 | (cp & 0x3F)), n = 4;
        pd_sbuf_putn(b, u, n);
    }
}

/* Quote the pending literal text into the sequence. */
static void flush_literal(rexpr *body, pd_sbuf *pending) {
    if (!pending->len) return;
    char *q = pd_grammar_quote(pending->p, pending->len);
    if (!q) body->t.oom = true;
    else {
        if (body->t.len) pd_sbuf_putn(&body->t, " ", 1);
        pd_sbuf_puts(&body->t, q);
    }
    free(q);
    pending->len = 0;
    pending->p[0] = '\0';
    body->simple = ++body->elems == 1; /* one literal is one token */
}

static void put_quantified(rexpr *dst, const rexpr *atom, long m, long n) {
    /* n < 0: unbounded */
    if (atom->never) {
        if (m > 0) dst->never = true;
        return;
    }
    if (atom->t.len == 0 || (m == 1 && n == 1)) {
        if (atom->t.len) {
            if (dst->t.len) pd_sbuf_putn(&dst->t, " ", 1);
            pd_sbuf_puts(&dst->t, pd_sbuf_str(&atom->t));
            dst->simple = ++dst->elems == 1 && atom->simple;
        }
        return;
    }
    if (n == 0) return;
    dst->elems++;
    dst->simple = false;
    if (dst->t.len) pd_sbuf_putn(&dst->t, " ", 1);
    if (atom->simple) pd_sbuf_puts(&dst->t, pd_sbuf_str(&atom->t));
    else pd_sbuf_printf(&dst->t, "( %s )", pd_sbuf_str(&atom->t));
    if (m == 0 && n < 0) pd_sbuf_putn(&dst->t, "*", 1);
    else if (m == 1 && n < 0) pd_sbuf_putn(&dst->t, "+", 1);
    else if (m == 0 && n == 1) pd_sbuf_putn(&dst->t, "?", 1);
    else if (n < 0) pd_sbuf_printf(&dst->t, "{%ld,}", m);
    else if (m == n) pd_sbuf_printf(&dst->t, "{%ld}", m);
    else pd_sbuf_printf(&dst->t, "{%ld,%ld}", m, n);
}

/* A decimal count: PD_OK, NO_DIGITS, or an error. */
#define NO_DIGITS 1
static int parse_count(rx *r, long *v) {
    if (r->s[r->pos] < '0' || r->s[r->pos] > '9') return NO_DIGITS;
    long x = 0;
    while (r->s[r->pos] >= '0' && r->s[r->pos] <= '9') {
        x = x * 10 + (r->s[r->pos] - '0');
        if (x > PD_SCHEMA_MAX_COUNT) {
            return pd_errorf(r->err, PD_EUNSUPPORTED,
                             "JSON Schema keyword \"pattern\" at %s repeats more than %d times (at offset %zu)",
                             r->path, PD_SCHEMA_MAX_COUNT, r->pos);
        }
        r->pos++;
    }
    *v = x;
    return PD_OK;
}

/* A quantifier after an atom, if any: *m, *n (n = -1 unbounded). */
static int parse_quantifier(rx *r, long *m, long *n) {
    char c = r->s[r->pos];
    int rc;
    *m = 1, *n = 1;
    if (c == '*') *m = 0, *n = -1;
    else if (c == '+') *m = 1, *n = -1;
    else if (c == '?') *m = 0, *n = 1;
    else if (c == '{') {
        r->pos++;
        if ((rc = parse_count(r, m)) != PD_OK) return rc != NO_DIGITS ? rc : unsupported(r, "a literal { (write \\{)");
        *n = *m;
        if (r->s[r->pos] == ',') {
            r->pos++;
            *n = -1;
            if (r->s[r->pos] != '}') {
                if ((rc = parse_count(r, n)) != PD_OK) return rc != NO_DIGITS ? rc : unsupported(r, "a literal { (write \\{)");
            }
        }
        if (r->s[r->pos] != '}') return unsupported(r, "a literal { (write \\{)");
        if (*n >= 0 && *n < *m) return invalid(r, "a repetition {m,n} with n < m");
    } else {
        return PD_OK;
    }
    r->pos++;
    if (r->s[r->pos] == '?') return unsupported(r, "a lazy quantifier");
    if (r->s[r->pos] == '+') return unsupported(r, "a possessive quantifier");
    if (r->s[r->pos] && strchr("*+?{", r->s[r->pos])) return unsupported(r, "a quantifier after a quantifier");
    return PD_OK;
}

/* One alternative: a sequence of quantified atoms. With top, a leading ^
 * and a trailing $ anchor it; otherwise it is padded with char_rule*. */
static int parse_seq(rx *r, rexpr *out, bool top) {
    int rc = PD_OK;
    bool anchored_start = false, anchored_end = false;
    pd_sbuf pending = {0}; /* literal JSON text not yet quoted */
    rexpr atom = {0};
    pd_sbuf lit = {0}; /* the JSON spelling of a single-character atom */
    if (top && r->s[r->pos] == '^') {
        anchored_start = true;
        r->pos++;
    }
    rexpr body = {0};
    for (;;) {
        char c = r->s[r->pos];
        if (!c || c == '|' || c == ')') break;
        pd_sbuf_free(&atom.t);
        pd_sbuf_free(&lit);
        atom = (rexpr){0};
        bool is_literal = false;
        size_t at = r->pos;
        if (c == '$') {
            r->pos++;
            char d = r->s[r->pos];
            if (top && (!d || d == '|')) {
                anchored_end = true;
                break;
            }
            r->pos = at;
            rc = unsupported(r, "$ that does not end the pattern or one of its top-level alternatives");
            goto fail;
        } else if (c == '^') {
            rc = unsupported(r, "^ that does not start the pattern or one of its top-level alternatives");
            goto fail;
        } else if (c == '(') {
            r->pos++;
            if (r->s[r->pos] == '?') {
                const char *q = r->s + r->pos + 1;
                if (q[0] == ':') r->pos += 2;
                else if ((q[0] == '<' && q[1] != '=' && q[1] != '!') || (q[0] == 'P' && q[1] == '<')) {
                    const char *close = strchr(q, '>');
                    if (!close) {
                        rc = invalid(r, "a group name without its closing >");
                        goto fail;
                    }
                    r->pos = (size_t)(close + 1 - r->s);
                } else if (q[0] == '=' || q[0] == '!' || (q[0] == '<' && (q[1] == '=' || q[1] == '!'))) {
                    rc = unsupported(r, "lookahead and lookbehind");
                    goto fail;
                } else {
                    rc = unsupported(r, "inline flags and special groups (?...)");
                    goto fail;
                }
            }
            if (++r->depth > 64) {
                rc = unsupported(r, "groups nested more than 64 deep");
                goto fail;
            }
            if ((rc = parse_alt(r, &atom, false)) != PD_OK) goto fail;
            r->depth--;
            if (r->s[r->pos] != ')') {
                rc = invalid(r, "a group without its closing )");
                goto fail;
            }
            r->pos++;
        } else if (c == '*' || c == '+' || c == '?' || c == '{') {
            rc = unsupported(r, c == '{' ? "a literal { (write \\{)" : "a quantifier with nothing to repeat");
            goto fail;
        } else {
            cp_set set = {0};
            uint32_t cp = 0;
            bool is_set = false;
            if (c == '[') {
                r->pos++;
                if ((rc = parse_class(r, &set)) != PD_OK) {
                    free(set.r);
                    goto fail;
                }
                is_set = true;
            } else if (c == '.') {
                r->pos++;
                set_add(&set, 0, '\n' - 1);
                set_add(&set, '\n' + 1, CP_MAX);
                is_set = true;
            } else if (c == '\\') {
                r->pos++;
                if ((rc = parse_escape(r, false, &cp, &set, &is_set)) != PD_OK) {
                    free(set.r);
                    goto fail;
                }
            } else {
                cp = next_cp(r);
            }
            if (is_set) {
                set_normalize(&set);
                if (set.n == 1 && set.r[0].lo == set.r[0].hi) {
                    cp = set.r[0].lo;
                    is_set = false;
                }
            }
            if (is_set) {
                atom.simple = true;
                if (emit_set(&atom.t, &set, &atom.simple)) atom.never = true;
            } else {
                is_literal = true;
                pd_schema_spell_cp(&lit, cp);
                char *q = pd_grammar_quote(pd_sbuf_str(&lit), lit.len);
                if (q) pd_sbuf_puts(&atom.t, q);
                else atom.t.oom = true;
                free(q);
                atom.simple = true;
            }
            if (set.oom) atom.t.oom = true;
            free(set.r);
        }
        long m, n;
        if ((rc = parse_quantifier(r, &m, &n)) != PD_OK) goto fail;
        if (is_literal && m == 1 && n == 1) {
            pd_sbuf_puts(&pending, pd_sbuf_str(&lit)); /* runs of literals become one "..." */
        } else {
            flush_literal(&body, &pending);
            put_quantified(&body, &atom, m, n);
        }
        if (atom.t.oom || lit.oom) body.t.oom = true;
    }
    flush_literal(&body, &pending);
    if (body.never) {
        out->never = true;
        goto fail;
    }
    {
        pd_sbuf *t = &out->t;
        int parts = 0;
        if (!anchored_start && top) {
            pd_sbuf_printf(t, "%s*", r->char_rule);
            parts++;
        }
        if (body.t.len) {
            if (parts) pd_sbuf_putn(t, " ", 1);
            pd_sbuf_puts(t, pd_sbuf_str(&body.t));
            parts++;
        }
        if (!anchored_end && top) {
            if (parts) pd_sbuf_putn(t, " ", 1);
            pd_sbuf_printf(t, "%s*", r->char_rule);
            parts++;
        }
        out->simple = parts == 1 && body.elems == 1 && body.simple;
        if (body.t.oom) t->oom = true;
    }
fail:
    pd_sbuf_free(&atom.t);
    pd_sbuf_free(&lit);
    pd_sbuf_free(&body.t);
    pd_sbuf_free(&pending);
    return rc;
}

static int parse_alt(rx *r, rexpr *out, bool top) {
    int rc;
    rexpr *alts = NULL;
    size_t n = 0;
    for (;;) {
        rexpr *grown = realloc(alts, (n + 1) * sizeof *alts);
        if (!grown) {
            rc = pd_errorf(r->err, PD_ENOMEM, "out of memory");
            goto fail;
        }
        alts = grown;
        alts[n] = (rexpr){0};
        /* Only top-level alternatives pad unanchored ends. */
        rc = parse_seq(r, &alts[n++], top);
        if (rc != PD_OK) goto fail;
        if (r->s[r->pos] != '|') break;
        r->pos++;
    }
    /* Drop the alternatives that match nothing; an empty one makes the rest optional. */
    size_t live = 0, nonempty = 0;
    bool has_empty = false;
    for (size_t i = 0; i < n; i++) {
        if (alts[i].never) continue;
        live++;
        if (alts[i].t.len) nonempty++;
        else has_empty = true;
    }
    if (live == 0) {
        out->never = true;
    } else if (nonempty == 1 && !has_empty) {
        for (size_t i = 0; i < n; i++)
            if (!alts[i].never && alts[i].t.len) {
                pd_sbuf_puts(&out->t, pd_sbuf_str(&alts[i].t));
                out->simple = alts[i].simple;
            }
    } else if (nonempty > 0) {
        bool first = true;
        if (nonempty > 1 || has_empty) pd_sbuf_puts(&out->t, "( ");
        for (size_t i = 0; i < n; i++) {
            if (alts[i].never || !alts[i].t.len) continue;
            pd_sbuf_printf(&out->t, "%s%s", first ? "" : " | ", pd_sbuf_str(&alts[i].t));
            first = false;
        }
        pd_sbuf_puts(&out->t, has_empty ? " )?" : " )");
        out->simple = !has_empty;
    }
    rc = PD_OK;
fail:
    for (size_t i = 0; i < n; i++) {
        if (alts[i].t.oom) out->t.oom = true;
        pd_sbuf_free(&alts[i].t);
    }
    free(alts);
    return rc;
}

int pd_schema_pattern_expr(const char *pattern, const char *char_rule, const char *path, pd_sbuf *out,
                           pd_error *err) {
    rx r = {.s = pattern, .char_rule = char_rule, .path = path, .err = err};
    rexpr e = {0};
    int rc = parse_alt(&r, &e, true);
    if (rc != PD_OK) goto done;
    if (r.s[r.pos] == ')') {
        rc = invalid(&r, "a ) without its opening (");
        goto done;
    }
    if (e.never) {
        rc = pd_errorf(err, PD_EINVAL, "JSON Schema keyword \"pattern\" at %s matches no string", path);
        goto done;
    }
    pd_sbuf_puts(out, pd_sbuf_str(&e.t));
    if (e.t.oom || out->oom) rc = pd_errorf(err, PD_ENOMEM, "out of memory");
done:
    pd_sbuf_free(&e.t);
    return rc;
}
