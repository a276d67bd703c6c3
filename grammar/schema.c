/* JSON Schema (the subset of grammar.h) to grammar text.
 *
 * Every schema node becomes an expression; objects, arrays, anyOf, patterns
 * and definitions get rules of their own (<prefix>-N, numbered in the order
 * they are made, so the text is deterministic), and the JSON primitives
 * (<prefix>-ws, -char, -string, -number, -integer, -boolean, -null, -value,
 * -object, -member, -array) are appended once, only those used.
 *
 * Objects: the declared properties come in the schema's order, required
 * ones mandatory and optional ones skippable. The rest of an object from
 * property i on is one rule per (i, whether a comma is due), so commas are
 * right whatever is skipped and the rule count is linear. Other keys (when
 * additionalProperties allows them) come after the declared ones and are
 * spelled so that they cannot decode to a declared name: a trie of the
 * names, where leaving the trie early or running past a name frees the
 * rest. Inside the trie escapes are not generated (an escape may decode to
 * a name's next character); after it, anything goes. */
#include "schema_internal.h"

#include <math.h>

typedef struct def_entry {
    const json_t *schema; /* the definition ($defs/NAME, or the root for "#") */
    const char *ref;      /* "#/$defs/NAME" */
    char *rule;
} def_entry;

typedef struct gen {
    const json_t *root;
    const char *prefix;
    pd_sbuf rules; /* finished rules, one per line */
    pd_sbuf path;  /* the JSON pointer of the node being generated */
    pd_error *err;
    int next_rule, depth;
    unsigned used; /* USE_* primitives referenced */
    def_entry *defs;
    size_t n_defs;
} gen;

enum {
    USE_WS = 1u << 0,
    USE_CHAR = 1u << 1,
    USE_STRING = 1u << 2,
    USE_NUMBER = 1u << 3,
    USE_INTEGER = 1u << 4,
    USE_BOOLEAN = 1u << 5,
    USE_NULL = 1u << 6,
    USE_VALUE = 1u << 7,
    USE_DATE = 1u << 8,
    USE_TIME = 1u << 9,
    USE_UUID = 1u << 10,
};

#define MAX_NESTING 64
#define MAX_GRAMMAR_BYTES (4u << 20)

static const char *path_of(gen *g) { return pd_sbuf_str(&g->path); }

static int oom(gen *g) { return pd_errorf(g->err, PD_ENOMEM, "out of memory generating the grammar"); }

/* "<prefix>-name" for a primitive, marking it used. */
static const char *prim(gen *g, unsigned use, const char *name, pd_sbuf *into) {
    g->used |= use;
    pd_sbuf_printf(into, "%s-%s", g->prefix, name);
    return pd_sbuf_str(into);
}

/* Append a new rule; *name gets its malloc'd name. */
static int add_rule(gen *g, const char *body, char **name) {
    pd_sbuf n = {0};
    pd_sbuf_printf(&n, "%s-%d", g->prefix, g->next_rule++);
    pd_sbuf_printf(&g->rules, "%s ::= %s\n", pd_sbuf_str(&n), body);
    if (n.oom || g->rules.oom) {
        pd_sbuf_free(&n);
        return oom(g);
    }
    if (g->rules.len > MAX_GRAMMAR_BYTES) {
        pd_sbuf_free(&n);
        return pd_errorf(g->err, PD_EUNSUPPORTED,
                         "the JSON Schema makes a grammar larger than %u MiB (at %s); simplify it",
                         MAX_GRAMMAR_BYTES >> 20, path_of(g));
    }
    *name = n.p;
    return PD_OK;
}

static char *take(pd_sbuf *b) {
    if (b->oom) {
        pd_sbuf_free(b);
        return NULL;
    }
    char *p = b->p ? b->p : strdup("");
    *b = (pd_sbuf){0};
    return p;
}

static int gen_schema(gen *g, const json_t *s, char **expr);

/* Generate s at path + /key (+ /key2). */
static int gen_sub(gen *g, const json_t *s, const char *key, const char *key2, char **expr) {
    size_t mark = g->path.len;
    pd_schema_path_push(&g->path, key);
    if (key2) pd_schema_path_push(&g->path, key2);
    int rc = gen_schema(g, s, expr);
    pd_schema_path_pop(&g->path, mark);
    return rc;
}

/* A count keyword (minItems ...): -1 when absent. */
static int get_count(gen *g, const json_t *s, const char *key, long *out) {
    const json_t *v = json_object_get(s, key);
    *out = -1;
    if (!v) return PD_OK;
    if (!json_is_integer(v) || json_integer_value(v) < 0)
        return pd_errorf(g->err, PD_EINVAL, "JSON Schema keyword \"%s\" at %s must be a non-negative integer", key,
                         path_of(g));
    if (json_integer_value(v) > PD_SCHEMA_MAX_COUNT)
        return pd_errorf(g->err, PD_EUNSUPPORTED,
                         "JSON Schema keyword \"%s\" at %s is %lld; at most %d is supported", key, path_of(g),
                         (long long)json_integer_value(v), PD_SCHEMA_MAX_COUNT);
    *out = (long)json_integer_value(v);
    return PD_OK;
}

/* "{m,n}" in the shortest spelling (n < 0: unbounded); "" for {1}. */
static void put_repeat(pd_sbuf *b, long m, long n) {
    if (m == 0 && n < 0) pd_sbuf_puts(b, "*");
    else if (m == 1 && n < 0) pd_sbuf_puts(b, "+");
    else if (m == 0 && n == 1) pd_sbuf_puts(b, "?");
    else if (n < 0) pd_sbuf_printf(b, "{%ld,}", m);
    else if (m == n && m == 1) return;
    else if (m == n) pd_sbuf_printf(b, "{%ld}", m);
    else pd_sbuf_printf(b, "{%ld,%ld}", m, n);
}

/* ---- strings ------------------------------------------------------------- */

/* format: the shapes of RFC 3339 (date, time, date-time) and RFC 4122
 * (uuid), spelled without escapes. date knows month lengths and leap
 * years; time leaves out the leap second 60 (the validator admits it). */
static int gen_format(gen *g, const json_t *format, bool with_other, char **expr) {
    static const char *const names[] = {"date", "time", "date-time", "uuid"};
    size_t mark = g->path.len;
    pd_schema_path_push(&g->path, "format");
    int rc = PD_OK;
    size_t k = 0;
    if (!json_is_string(format)) {
        rc = pd_errorf(g->err, PD_EINVAL, "JSON Schema keyword \"format\" at %s must be a string", path_of(g));
        goto done;
    }
    while (k < 4 && strcmp(json_string_value(format), names[k]) != 0) k++;
    if (k == 4) {
        rc = pd_errorf(g->err, PD_EUNSUPPORTED,
                       "unsupported JSON Schema keyword \"format\" \"%s\" at %s (supported formats: date, time, "
                       "date-time, uuid)",
                       json_string_value(format), path_of(g));
        goto done;
    }
    if (with_other) {
        rc = pd_errorf(g->err, PD_EUNSUPPORTED,
                       "JSON Schema keyword \"format\" at %s together with \"pattern\", \"minLength\" or "
                       "\"maxLength\" is not supported; the format fixes the shape",
                       path_of(g));
        goto done;
    }
    pd_sbuf b = {0}, p1 = {0}, p2 = {0};
    if (k == 0) pd_sbuf_printf(&b, "\"\\\"\" %s \"\\\"\"", prim(g, USE_DATE, "date", &p1));
    else if (k == 1) pd_sbuf_printf(&b, "\"\\\"\" %s \"\\\"\"", prim(g, USE_TIME, "time", &p1));
    else if (k == 2)
        pd_sbuf_printf(&b, "\"\\\"\" %s \"T\" %s \"\\\"\"", prim(g, USE_DATE, "date", &p1),
                       prim(g, USE_TIME, "time", &p2));
    else pd_sbuf_printf(&b, "\"\\\"\" %s \"\\\"\"", prim(g, USE_UUID, "uuid", &p1));
    if (!(*expr = take(&b))) rc = oom(g);
    pd_sbuf_free(&p1);
    pd_sbuf_free(&p2);
done:
    pd_schema_path_pop(&g->path, mark);
    return rc;
}

static int gen_string(gen *g, const json_t *s, char **expr) {
    long lo, hi;
    int rc;
    if ((rc = get_count(g, s, "minLength", &lo)) != PD_OK || (rc = get_count(g, s, "maxLength", &hi)) != PD_OK)
        return rc;
    const json_t *pattern = json_object_get(s, "pattern");
    const json_t *format = json_object_get(s, "format");
    pd_sbuf b = {0}, name = {0};
    if (format) return gen_format(g, format, pattern || lo >= 0 || hi >= 0, expr);
    if (pattern) {
        if (!json_is_string(pattern))
            return pd_errorf(g->err, PD_EINVAL, "JSON Schema keyword \"pattern\" at %s must be a string", path_of(g));
        if (lo >= 0 || hi >= 0)
            return pd_errorf(g->err, PD_EUNSUPPORTED,
                             "JSON Schema keywords \"pattern\" and \"%s\" together at %s are not supported; put the "
                             "length into the pattern ({m,n})",
                             lo >= 0 ? "minLength" : "maxLength", path_of(g));
        pd_sbuf_puts(&b, "\"\\\"\" ");
        size_t mark = g->path.len;
        pd_schema_path_push(&g->path, "pattern");
        rc = pd_schema_pattern_expr(json_string_value(pattern), prim(g, USE_CHAR, "char", &name), path_of(g), &b,
                                    g->err);
        pd_schema_path_pop(&g->path, mark);
        if (rc == PD_OK) {
            pd_sbuf_puts(&b, b.p[b.len - 1] == ' ' ? "\"\\\"\"" : " \"\\\"\"");
            rc = b.oom ? oom(g) : add_rule(g, b.p, expr);
        }
        pd_sbuf_free(&b);
        pd_sbuf_free(&name);
        return rc;
    }
    if (lo < 0 && hi < 0) {
        *expr = strdup(prim(g, USE_STRING, "string", &b));
        pd_sbuf_free(&b);
        return *expr ? PD_OK : oom(g);
    }
    if (lo < 0) lo = 0;
    if (hi >= 0 && hi < lo)
        return pd_errorf(g->err, PD_EINVAL, "JSON Schema at %s: maxLength %ld is below minLength %ld (no string fits)",
                         path_of(g), hi, lo);
    pd_sbuf_puts(&b, "\"\\\"\" ");
    if (hi != 0) {
        pd_sbuf_puts(&b, prim(g, USE_CHAR, "char", &name));
        put_repeat(&b, lo, hi);
        pd_sbuf_puts(&b, " ");
    }
    pd_sbuf_puts(&b, "\"\\\"\"");
    rc = b.oom ? oom(g) : PD_OK;
    if (rc == PD_OK) *expr = take(&b);
    pd_sbuf_free(&b);
    pd_sbuf_free(&name);
    return rc;
}

/* ---- numbers: minimum, maximum, exclusiveMinimum, exclusiveMaximum ------- *
 *
 * An integer range becomes a digit-wise expression: per digit count, the
 * common prefix of the two ends, then "the lower end's digit and at least
 * its rest | a digit strictly between and any rest | the upper end's digit
 * and at most its rest", so the text grows with the digits, not the range.
 * No leading zeros, no "-0". A number range is a sign, an integer part in
 * such a range and a fraction chosen so that the double the document parses
 * to keeps its side of the bound: fractions (at most 6 digits) only on
 * integer parts below 10^9, where a double's error is far below 10^-6. */

#define INT_CAP 999999999999999999ULL /* 18 digits, as the integer primitive */
#define FRACTION_LIMIT 1000000000ULL  /* integer parts that may take a fraction */

static void put_digit_class(pd_sbuf *b, char lo, char hi) {
    if (lo == hi) pd_sbuf_printf(b, " \"%c\"", lo);
    else if (lo == '0' && hi == '9') pd_sbuf_puts(b, " [0-9]");
    else pd_sbuf_printf(b, " [%c-%c]", lo, hi);
}

static void put_any_digits(pd_sbuf *b, size_t n) {
    if (n == 1) pd_sbuf_puts(b, " [0-9]");
    else if (n > 1) pd_sbuf_printf(b, " [0-9]{%zu}", n);
}

static bool all_digit(const char *s, size_t n, char d) {
    for (size_t i = 0; i < n; i++)
        if (s[i] != d) return false;
    return true;
}

/* n-digit strings (leading zeros allowed) >= s (at_least) or <= s. */
static void put_digits_bound(pd_sbuf *b, const char *s, size_t n, bool at_least) {
    if (n == 0) return;
    if (all_digit(s, n, at_least ? '0' : '9')) {
        put_any_digits(b, n);
        return;
    }
    if (n == 1) {
        put_digit_class(b, at_least ? s[0] : '0', at_least ? '9' : s[0]);
        return;
    }
    pd_sbuf_printf(b, " ( \"%c\"", s[0]);
    put_digits_bound(b, s + 1, n - 1, at_least);
    if (at_least ? s[0] < '9' : s[0] > '0') {
        pd_sbuf_puts(b, " |");
        put_digit_class(b, at_least ? (char)(s[0] + 1) : '0', at_least ? '9' : (char)(s[0] - 1));
        put_any_digits(b, n - 1);
    }
    pd_sbuf_puts(b, " )");
}

/* n-digit strings from x to y (x <= y, the same length). */
static void put_digits_range(pd_sbuf *b, const char *x, const char *y, size_t n) {
    size_t k = 0;
    while (k < n && x[k] == y[k]) k++;
    if (k) pd_sbuf_printf(b, " \"%.*s\"", (int)k, x);
    if (k == n) return;
    size_t rest = n - k - 1;
    if (all_digit(x + k + 1, rest, '0') && all_digit(y + k + 1, rest, '9')) {
        put_digit_class(b, x[k], y[k]);
        put_any_digits(b, rest);
        return;
    }
    /* an end whose rest is all 0s (lower) or all 9s (upper) joins the
     * digits in between */
    bool x_whole = all_digit(x + k + 1, rest, '0'), y_whole = all_digit(y + k + 1, rest, '9');
    char mid_lo = x_whole ? x[k] : (char)(x[k] + 1), mid_hi = y_whole ? y[k] : (char)(y[k] - 1);
    pd_sbuf_puts(b, " (");
    if (!x_whole) {
        pd_sbuf_printf(b, " \"%c\"", x[k]);
        put_digits_bound(b, x + k + 1, rest, true);
    }
    if (mid_lo <= mid_hi) {
        pd_sbuf_puts(b, x_whole ? "" : " |");
        put_digit_class(b, mid_lo, mid_hi);
        put_any_digits(b, rest);
    }
    if (!y_whole) {
        pd_sbuf_printf(b, " | \"%c\"", y[k]);
        put_digits_bound(b, y + k + 1, rest, false);
    }
    pd_sbuf_puts(b, " )");
}

static uint64_t pow10u(int n) {
    uint64_t p = 1;
    while (n-- > 0) p *= 10;
    return p;
}

/* Alternatives (each starting " |" but the first) for the decimal spelling
 * of every integer in [a, b]; *n counts them. */
static void put_uint_range(pd_sbuf *b, uint64_t lo, uint64_t hi, int *n) {
    if (lo > hi) return;
    if (lo == 0) {
        pd_sbuf_printf(b, "%s \"0\"", (*n)++ ? " |" : "");
        if (hi == 0) return;
        lo = 1;
    }
    char x[24], y[24];
    int la = snprintf(x, sizeof x, "%llu", (unsigned long long)lo);
    int lb = snprintf(y, sizeof y, "%llu", (unsigned long long)hi);
    if (la == lb) {
        pd_sbuf_puts(b, (*n)++ ? " |" : "");
        put_digits_range(b, x, y, (size_t)la);
        return;
    }
    char top[24], bottom[24];
    snprintf(top, sizeof top, "%llu", (unsigned long long)(pow10u(la) - 1));
    snprintf(bottom, sizeof bottom, "%llu", (unsigned long long)pow10u(lb - 1));
    pd_sbuf_puts(b, (*n)++ ? " |" : "");
    put_digits_range(b, x, top, (size_t)la);
    if (lb - la >= 2) {
        pd_sbuf_printf(b, " | [1-9]");
        if (lb - la == 2) put_any_digits(b, (size_t)la);
        else pd_sbuf_printf(b, " [0-9]{%d,%d}", la, lb - 2);
        (*n)++;
    }
    pd_sbuf_puts(b, " |");
    put_digits_range(b, bottom, y, (size_t)lb);
    (*n)++;
}

/* One bound as read from the schema. */
typedef struct num_bound {
    bool set, strict, integral; /* integral: an int64 value, in i */
    int64_t i;
    long double v;
    const char *key;
} num_bound;

/* Read minimum/exclusiveMinimum (lower) or maximum/exclusiveMaximum,
 * keeping the tighter of the two. */
static int read_bound(gen *g, const json_t *s, bool lower, num_bound *out) {
    const char *keys[2] = {lower ? "minimum" : "maximum", lower ? "exclusiveMinimum" : "exclusiveMaximum"};
    *out = (num_bound){0};
    for (int k = 0; k < 2; k++) {
        const json_t *v = json_object_get(s, keys[k]);
        if (!v) continue;
        if (json_is_boolean(v))
            return pd_errorf(g->err, PD_EUNSUPPORTED,
                             "unsupported JSON Schema keyword \"%s\" as a boolean (draft 4) at %s/%s; give the bound "
                             "itself: \"%s\": N",
                             keys[k], path_of(g), keys[k], keys[k]);
        if (!json_is_number(v))
            return pd_errorf(g->err, PD_EINVAL, "JSON Schema keyword \"%s\" at %s must be a number", keys[k],
                             path_of(g));
        num_bound b = {.set = true, .strict = k == 1, .key = keys[k]};
        if (json_is_integer(v)) {
            b.integral = true;
            b.i = json_integer_value(v);
            b.v = (long double)b.i;
        } else {
            b.v = json_real_value(v);
            b.integral = b.v == floorl(b.v) && b.v >= -9.2e18L && b.v <= 9.2e18L;
            if (b.integral) b.i = (int64_t)b.v;
        }
        bool tighter = !out->set || (lower ? b.v > out->v : b.v < out->v) || (b.v == out->v && b.strict);
        if (tighter) *out = b;
    }
    return PD_OK;
}

static bool has_bounds(const json_t *s) {
    return json_object_get(s, "minimum") || json_object_get(s, "maximum") || json_object_get(s, "exclusiveMinimum") ||
           json_object_get(s, "exclusiveMaximum");
}

static int gen_integer_range(gen *g, const num_bound *lo_b, const num_bound *hi_b, pd_sbuf *b) {
    /* inclusive int64 ends; unbounded ends stop at 18 digits */
    long double lo = -(long double)INT_CAP, hi = (long double)INT_CAP;
    bool lo_set = lo_b->set, hi_set = hi_b->set;
    if (lo_set) lo = lo_b->strict ? floorl(lo_b->v) + 1 : ceill(lo_b->v);
    if (hi_set) hi = hi_b->strict ? ceill(hi_b->v) - 1 : floorl(hi_b->v);
    if (lo_set && lo_b->integral) lo = lo_b->strict ? (long double)lo_b->i + 1 : (long double)lo_b->i;
    if (hi_set && hi_b->integral) hi = hi_b->strict ? (long double)hi_b->i - 1 : (long double)hi_b->i;
    if (!hi_set && lo > hi) hi = (long double)INT64_MAX;
    if (!lo_set && hi < lo) lo = (long double)INT64_MIN;
    if (lo < (long double)INT64_MIN) lo = (long double)INT64_MIN;
    if (hi > (long double)INT64_MAX) hi = (long double)INT64_MAX;
    if (lo > hi)
        return pd_errorf(g->err, PD_EINVAL, "JSON Schema at %s: no 64-bit integer meets its bounds", path_of(g));
    int64_t l = (int64_t)lo, h = (int64_t)hi;
    int n = 0;
    pd_sbuf alts = {0};
    if (l < 0) {
        uint64_t mag_lo = h < 0 ? (uint64_t)0 - (uint64_t)h : 1, mag_hi = (uint64_t)0 - (uint64_t)l;
        pd_sbuf neg = {0};
        int k = 0;
        put_uint_range(&neg, mag_lo, mag_hi, &k);
        pd_sbuf_printf(&alts, " \"-\" %s%s%s", k > 1 ? "(" : "", pd_sbuf_str(&neg), k > 1 ? " )" : "");
        alts.oom = alts.oom || neg.oom;
        pd_sbuf_free(&neg);
        n++;
    }
    if (h >= 0) {
        put_uint_range(&alts, l > 0 ? (uint64_t)l : 0, (uint64_t)h, &n);
    }
    pd_sbuf_printf(b, "%s", pd_sbuf_str(&alts));
    b->oom = b->oom || alts.oom;
    pd_sbuf_free(&alts);
    return PD_OK;
}

/* Non-negative decimals (no sign) v with a <(=) v (<= b), as alternatives. */
static void put_magnitude(pd_sbuf *b, uint64_t a, bool a_strict, bool has_hi, uint64_t hi, bool hi_strict,
                          int *n) {
    if (!has_hi && a == 0) {
        /* a sign alone: any mantissa (not zero when strict) and exponent */
        pd_sbuf_printf(b, "%s ( %s ) ( [eE] [-+]? [0-9]{1,2} )?", (*n)++ ? " |" : "",
                       a_strict ? "[1-9] [0-9]{0,17} ( \".\" [0-9]+ )? | \"0.\" \"0\"{0,99} [1-9] [0-9]*"
                                : "( \"0\" | [1-9] [0-9]{0,17} ) ( \".\" [0-9]+ )?");
        return;
    }
    uint64_t first = a_strict ? a + 1 : a; /* integer parts with any fraction */
    uint64_t last = has_hi ? (hi == 0 ? 0 : hi - 1) : (first > INT_CAP ? (uint64_t)INT64_MAX : INT_CAP);
    bool any_part = has_hi ? hi > 0 && first <= hi - 1 : first <= last;
    if (any_part && first < FRACTION_LIMIT) {
        pd_sbuf part = {0};
        int k = 0;
        put_uint_range(&part, first, last < FRACTION_LIMIT - 1 ? last : FRACTION_LIMIT - 1, &k);
        pd_sbuf_printf(b, "%s %s%s%s ( \".\" [0-9]{1,6} )?", (*n)++ ? " |" : "", k > 1 ? "(" : "",
                       pd_sbuf_str(&part), k > 1 ? " )" : "");
        b->oom = b->oom || part.oom;
        pd_sbuf_free(&part);
    }
    if (any_part && last >= FRACTION_LIMIT) {
        put_uint_range(b, first > FRACTION_LIMIT ? first : FRACTION_LIMIT, last, n);
    }
    if (a_strict && a < FRACTION_LIMIT && (!has_hi || a < hi))
        pd_sbuf_printf(b, "%s \"%llu.\" [0-9]{0,5} [1-9]", (*n)++ ? " |" : "", (unsigned long long)a);
    if (has_hi && !hi_strict && hi >= first) {
        if (hi < FRACTION_LIMIT) pd_sbuf_printf(b, "%s \"%llu\" ( \".\" \"0\"{1,6} )?", (*n)++ ? " |" : "",
                                                (unsigned long long)hi);
        else pd_sbuf_printf(b, "%s \"%llu\"", (*n)++ ? " |" : "", (unsigned long long)hi);
    }
}

static int gen_number_range(gen *g, const num_bound *lo, const num_bound *hi, pd_sbuf *b) {
    const num_bound *nb[2] = {lo, hi};
    for (int k = 0; k < 2; k++)
        if (nb[k]->set && !nb[k]->integral)
            return pd_errorf(g->err, PD_EUNSUPPORTED,
                             "unsupported JSON Schema keyword \"%s\" at %s/%s on a number: only whole bounds "
                             "within 64 bits are supported for \"type\": \"number\" (any bound for \"integer\")",
                             nb[k]->key, path_of(g), nb[k]->key);
    int n = 0;
    /* negative values: "-" and a magnitude w, the value being -w */
    if (!lo->set || lo->i < 0) {
        pd_sbuf neg = {0};
        int k = 0;
        bool below_zero = hi->set && hi->i < 0;
        put_magnitude(&neg, below_zero ? (uint64_t)0 - (uint64_t)hi->i : 0, below_zero ? hi->strict : true, lo->set,
                      lo->set ? (uint64_t)0 - (uint64_t)lo->i : 0, lo->strict, &k);
        if (k) pd_sbuf_printf(b, " \"-\" %s%s%s", k > 1 ? "(" : "", pd_sbuf_str(&neg), k > 1 ? " )" : "");
        b->oom = b->oom || neg.oom;
        pd_sbuf_free(&neg);
        n += k > 0;
    }
    if (!hi->set || hi->i > 0 || (hi->i == 0 && !hi->strict)) {
        bool above_zero = lo->set && lo->i >= 0;
        put_magnitude(b, above_zero ? (uint64_t)lo->i : 0, above_zero && lo->strict, hi->set,
                      hi->set ? (uint64_t)hi->i : 0, hi->strict, &n);
    }
    if (n == 0) return pd_errorf(g->err, PD_EINVAL, "JSON Schema at %s: no number meets its bounds", path_of(g));
    return PD_OK;
}

/* An integer or number with bounds: a rule of its own. */
static int gen_bounded(gen *g, const json_t *s, bool integer, char **expr) {
    num_bound lo, hi;
    int rc;
    if ((rc = read_bound(g, s, true, &lo)) != PD_OK || (rc = read_bound(g, s, false, &hi)) != PD_OK) return rc;
    pd_sbuf b = {0};
    rc = integer ? gen_integer_range(g, &lo, &hi, &b) : gen_number_range(g, &lo, &hi, &b);
    if (rc == PD_OK) rc = b.oom ? oom(g) : add_rule(g, b.p + 1, expr);
    pd_sbuf_free(&b);
    return rc;
}

/* ---- arrays -------------------------------------------------------------- */

/* prefixItems: item i (i below the prefix's length) has its own schema;
 * the ones after it are items (a schema), anything (absent) or none
 * (false). Nested optional groups from minItems on keep commas right. */
static int gen_tuple(gen *g, const json_t *prefix, const json_t *items, long lo, long hi, char **expr) {
    long n_prefix = (long)json_array_size(prefix);
    if (n_prefix > PD_SCHEMA_MAX_COUNT)
        return pd_errorf(g->err, PD_EUNSUPPORTED, "JSON Schema keyword \"prefixItems\" at %s has more than %d schemas",
                         path_of(g), PD_SCHEMA_MAX_COUNT);
    bool more = !json_is_false(items);
    if (!more) hi = hi < 0 || hi > n_prefix ? n_prefix : hi;
    if (hi >= 0 && hi < lo)
        return pd_errorf(g->err, PD_EINVAL, "JSON Schema at %s: minItems %ld is more than the %ld items allowed "
                         "(prefixItems and items false)", path_of(g), lo, hi);
    long n_pos = hi >= 0 && hi < n_prefix ? hi : n_prefix;
    pd_sbuf ws = {0}, next = {0};
    const char *w = prim(g, USE_WS, "ws", &ws);
    char *e = NULL;
    int rc = PD_OK;
    if (more && n_pos == n_prefix && (hi < 0 || hi > n_prefix)) {
        if (items) rc = gen_sub(g, items, "items", NULL, &e);
        else {
            pd_sbuf v = {0};
            if (!(e = take((prim(g, USE_VALUE, "value", &v), &v)))) rc = oom(g);
        }
        if (rc != PD_OK) goto done;
        pd_sbuf_printf(&next, "( \",\" %s %s %s )", w, e, w);
        put_repeat(&next, lo > n_prefix ? lo - n_prefix : 0, hi < 0 ? -1 : hi - n_prefix);
        free(e);
        e = NULL;
    }
    for (long i = n_pos - 1; i >= 0; i--) {
        char index[24];
        snprintf(index, sizeof index, "%ld", i);
        if ((rc = gen_sub(g, json_array_get(prefix, (size_t)i), "prefixItems", index, &e)) != PD_OK) goto done;
        pd_sbuf cur = {0};
        if (i >= lo) pd_sbuf_puts(&cur, "( ");
        if (i) pd_sbuf_printf(&cur, "\",\" %s ", w);
        pd_sbuf_printf(&cur, "%s %s%s%s", e, w, next.len ? " " : "", pd_sbuf_str(&next));
        if (i >= lo) pd_sbuf_puts(&cur, " )?");
        free(e);
        e = NULL;
        pd_sbuf_free(&next);
        next = cur;
    }
    pd_sbuf b = {0};
    pd_sbuf_printf(&b, "\"[\" %s %s%s\"]\"", w, pd_sbuf_str(&next), next.len ? " " : "");
    rc = b.oom || next.oom ? oom(g) : add_rule(g, b.p, expr);
    pd_sbuf_free(&b);
done:
    free(e);
    pd_sbuf_free(&ws);
    pd_sbuf_free(&next);
    return rc;
}

static int gen_array(gen *g, const json_t *s, char **expr) {
    long lo, hi;
    int rc;
    if ((rc = get_count(g, s, "minItems", &lo)) != PD_OK || (rc = get_count(g, s, "maxItems", &hi)) != PD_OK)
        return rc;
    if (lo < 0) lo = 0;
    if (hi >= 0 && hi < lo)
        return pd_errorf(g->err, PD_EINVAL, "JSON Schema at %s: maxItems %ld is below minItems %ld (no array fits)",
                         path_of(g), hi, lo);
    const json_t *items = json_object_get(s, "items");
    if (json_is_array(items)) {
        size_t mark = g->path.len;
        pd_schema_path_push(&g->path, "items");
        rc = pd_errorf(g->err, PD_EUNSUPPORTED,
                       "unsupported JSON Schema keyword \"items\" as an array (tuple validation) at %s; give one "
                       "schema for every item",
                       path_of(g));
        pd_schema_path_pop(&g->path, mark);
        return rc;
    }
    const json_t *prefix = json_object_get(s, "prefixItems");
    if (prefix && (!json_is_array(prefix) || json_array_size(prefix) == 0))
        return pd_errorf(g->err, PD_EINVAL, "JSON Schema keyword \"prefixItems\" at %s must be a non-empty array of "
                         "schemas", path_of(g));
    if (prefix || json_is_false(items)) {
        json_t *none = prefix ? NULL : json_array();
        rc = none || prefix ? gen_tuple(g, prefix ? prefix : none, items, lo, hi, expr) : oom(g);
        json_decref(none);
        return rc;
    }
    char *item = NULL;
    pd_sbuf b = {0}, ws = {0};
    prim(g, USE_WS, "ws", &ws);
    if (hi != 0) {
        if (items && (rc = gen_sub(g, items, "items", NULL, &item)) != PD_OK) goto done;
        if (!items) {
            pd_sbuf v = {0};
            item = strdup(prim(g, USE_VALUE, "value", &v));
            pd_sbuf_free(&v);
            if (!item) {
                rc = oom(g);
                goto done;
            }
        }
    }
    const char *w = pd_sbuf_str(&ws);
    pd_sbuf_printf(&b, "\"[\" %s ", w);
    if (hi == 0) {
        /* only [] */
    } else if (lo == 0) {
        pd_sbuf_printf(&b, "( %s %s", item, w);
        if (hi != 1) {
            pd_sbuf_printf(&b, " ( \",\" %s %s %s )", w, item, w);
            put_repeat(&b, 0, hi < 0 ? -1 : hi - 1);
        }
        pd_sbuf_puts(&b, " )? ");
    } else {
        pd_sbuf_printf(&b, "%s %s ", item, w);
        if (hi != 1) {
            pd_sbuf_printf(&b, "( \",\" %s %s %s )", w, item, w);
            put_repeat(&b, lo - 1, hi < 0 ? -1 : hi - 1);
            pd_sbuf_puts(&b, " ");
        }
    }
    pd_sbuf_puts(&b, "\"]\"");
    rc = b.oom ? oom(g) : add_rule(g, b.p, expr);
done:
    free(item);
    pd_sbuf_free(&b);
    pd_sbuf_free(&ws);
    return rc;
}

/* ---- objects ------------------------------------------------------------- */

typedef struct trie {
    uint32_t cp;
    bool terminal;
    struct trie *kids; /* n_kids, in insertion order */
    size_t n_kids;
} trie;

static void trie_free(trie *t) {
    for (size_t i = 0; i < t->n_kids; i++) trie_free(&t->kids[i]);
    free(t->kids);
}

static uint32_t utf8_next(const unsigned char **p) {
    const unsigned char *s = *p;
    uint32_t cp;
    size_t n;
    if (s[0] < 0x80) cp = s[0], n = 1;
    else if ((s[0] & 0xE0) == 0xC0) cp = s[0] & 0x1F, n = 2;
    else if ((s[0] & 0xF0) == 0xE0) cp = s[0] & 0x0F, n = 3;
    else cp = s[0] & 0x07, n = 4;
    for (size_t i = 1; i < n; i++) cp = (cp << 6) | (s[i] & 0x3F);
    *p = s + n;
    return cp;
}

static bool trie_add(trie *t, const char *name) {
    const unsigned char *p = (const unsigned char *)name;
    while (*p) {
        uint32_t cp = utf8_next(&p);
        trie *next = NULL;
        for (size_t i = 0; i < t->n_kids; i++)
            if (t->kids[i].cp == cp) next = &t->kids[i];
        if (!next) {
            trie *k = realloc(t->kids, (t->n_kids + 1) * sizeof *k);
            if (!k) return false;
            t->kids = k;
            next = &t->kids[t->n_kids++];
            *next = (trie){.cp = cp};
        }
        t = next;
    }
    t->terminal = true;
    return true;
}

static bool json_special(uint32_t cp) { return cp < 0x20 || cp == '"' || cp == '\\'; }

/* The rest of a key (after its opening quote) from trie node t: anything
 * that does not end exactly on a name. */
static void trie_expr(pd_sbuf *b, const trie *t, const char *char_rule) {
    pd_sbuf_puts(b, "( ");
    bool first = true;
    if (!t->terminal) {
        pd_sbuf_puts(b, "\"\\\"\"");
        first = false;
    }
    for (size_t i = 0; i < t->n_kids; i++) {
        pd_sbuf spell = {0};
        pd_schema_spell_cp(&spell, t->kids[i].cp);
        char *q = pd_grammar_quote(pd_sbuf_str(&spell), spell.len);
        pd_sbuf_printf(b, "%s%s ", first ? "" : " | ", q ? q : "");
        if (!q) b->oom = true;
        free(q);
        pd_sbuf_free(&spell);
        trie_expr(b, &t->kids[i], char_rule);
        first = false;
    }
    if (t->n_kids == 0) {
        pd_sbuf_printf(b, "%s%s+ \"\\\"\"", first ? "" : " | ", char_rule);
    } else {
        pd_sbuf_printf(b, " | [^\"\\\\\\x00-\\x1F");
        for (size_t i = 0; i < t->n_kids; i++)
            if (!json_special(t->kids[i].cp)) pd_schema_class_char(b, t->kids[i].cp);
        pd_sbuf_printf(b, "] %s* \"\\\"\"", char_rule);
    }
    pd_sbuf_puts(b, " )");
}

typedef struct object_gen {
    size_t n;
    char **kv;      /* per property: "\"name\"" ws ":" ws value */
    bool *required;
    char *extra;    /* the rule of one other member, or NULL */
    char *rest[2];  /* rest(n, comma) */
    char **memo;    /* 2 per property: rest(i, comma) rule names */
} object_gen;

/* The rest of the object from property i, comma due or not; "" when it is
 * empty. Not owned by the caller. */
static int object_rest(gen *g, object_gen *o, size_t i, int comma, const char **out) {
    if (i == o->n) {
        *out = o->rest[comma];
        return PD_OK;
    }
    if (o->memo[2 * i + comma]) {
        *out = o->memo[2 * i + comma];
        return PD_OK;
    }
    const char *after_taken, *after_skipped = "";
    int rc = object_rest(g, o, i + 1, 1, &after_taken);
    if (rc == PD_OK && !o->required[i]) rc = object_rest(g, o, i + 1, comma, &after_skipped);
    if (rc != PD_OK) return rc;
    pd_sbuf b = {0}, ws = {0};
    prim(g, USE_WS, "ws", &ws);
    pd_sbuf taken = {0};
    if (comma) pd_sbuf_printf(&taken, "\",\" %s ", pd_sbuf_str(&ws));
    pd_sbuf_printf(&taken, "%s %s", o->kv[i], pd_sbuf_str(&ws));
    if (*after_taken) pd_sbuf_printf(&taken, " %s", after_taken);
    if (o->required[i]) pd_sbuf_puts(&b, pd_sbuf_str(&taken));
    else if (!*after_skipped) pd_sbuf_printf(&b, "( %s )?", pd_sbuf_str(&taken));
    else pd_sbuf_printf(&b, "%s | %s", pd_sbuf_str(&taken), after_skipped);
    rc = b.oom || taken.oom ? oom(g) : add_rule(g, b.p, &o->memo[2 * i + comma]);
    if (rc == PD_OK) *out = o->memo[2 * i + comma];
    pd_sbuf_free(&b);
    pd_sbuf_free(&ws);
    pd_sbuf_free(&taken);
    return rc;
}

static int gen_object(gen *g, const json_t *s, char **expr) {
    const json_t *props = json_object_get(s, "properties");
    const json_t *required = json_object_get(s, "required");
    const json_t *additional = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props))
        return pd_errorf(g->err, PD_EINVAL, "JSON Schema keyword \"properties\" at %s must be an object", path_of(g));
    if (required && !json_is_array(required))
        return pd_errorf(g->err, PD_EINVAL, "JSON Schema keyword \"required\" at %s must be an array of names",
                         path_of(g));
    if (additional && !json_is_boolean(additional) && !json_is_object(additional))
        return pd_errorf(g->err, PD_EINVAL, "JSON Schema keyword \"additionalProperties\" at %s must be a schema",
                         path_of(g));
    size_t i;
    const json_t *r;
    json_array_foreach(required, i, r) {
        if (!json_is_string(r))
            return pd_errorf(g->err, PD_EINVAL, "JSON Schema keyword \"required\" at %s must be an array of names",
                             path_of(g));
    }
    /* The properties: the declared ones in order, then required names that
     * are not declared (their values follow additionalProperties). */
    size_t n_props = json_object_size(props), n_req = json_array_size(required);
    const char **names = calloc(n_props + n_req + 1, sizeof *names);
    const json_t **schemas = calloc(n_props + n_req + 1, sizeof *schemas);
    object_gen o = {0};
    o.kv = calloc(n_props + n_req + 1, sizeof *o.kv);
    o.required = calloc(n_props + n_req + 1, sizeof *o.required);
    o.memo = calloc(2 * (n_props + n_req) + 2, sizeof *o.memo);
    trie keys = {0};
    pd_sbuf b = {0}, ws = {0}, chr = {0};
    char *value = NULL;
    int rc = PD_OK;
    if (!names || !schemas || !o.kv || !o.required || !o.memo) {
        rc = oom(g);
        goto done;
    }
    const char *key;
    const json_t *sub;
    json_object_foreach((json_t *)props, key, sub) {
        names[o.n] = key;
        schemas[o.n++] = sub;
    }
    json_array_foreach(required, i, r) {
        const char *name = json_string_value(r);
        size_t j = 0;
        while (j < o.n && strcmp(names[j], name) != 0) j++;
        if (j == o.n) {
            if (json_is_false(additional)) {
                rc = pd_errorf(g->err, PD_EINVAL,
                               "JSON Schema at %s requires \"%s\", which is not in its properties, and "
                               "additionalProperties is false (no object fits)",
                               path_of(g), name);
                goto done;
            }
            names[o.n] = name;
            schemas[o.n++] = additional ? additional : json_true();
        }
        o.required[j] = true;
    }
    prim(g, USE_WS, "ws", &ws);
    const char *w = pd_sbuf_str(&ws);
    for (size_t k = 0; k < o.n; k++) {
        bool declared = props && json_object_get(props, names[k]) == schemas[k];
        if (declared) rc = gen_sub(g, schemas[k], "properties", names[k], &value);
        else if (additional) rc = gen_sub(g, schemas[k], "additionalProperties", NULL, &value);
        else rc = gen_schema(g, schemas[k], &value);
        if (rc != PD_OK) goto done;
        json_t *js = json_string(names[k]);
        char *text = js ? json_dumps(js, JSON_ENCODE_ANY | JSON_COMPACT) : NULL;
        json_decref(js);
        char *q = text ? pd_grammar_quote(text, strlen(text)) : NULL;
        free(text);
        pd_sbuf kv = {0};
        if (q) pd_sbuf_printf(&kv, "%s %s \":\" %s %s", q, w, w, value);
        free(q);
        free(value);
        value = NULL;
        if (!(o.kv[k] = take(&kv))) {
            rc = oom(g);
            goto done;
        }
        if (!trie_add(&keys, names[k])) {
            rc = oom(g);
            goto done;
        }
    }
    /* Other members. */
    if (!json_is_false(additional)) {
        if (additional && !json_is_true(additional)) {
            if ((rc = gen_sub(g, additional, "additionalProperties", NULL, &value)) != PD_OK) goto done;
        } else {
            pd_sbuf v = {0};
            value = take((prim(g, USE_VALUE, "value", &v), &v));
            if (!value) {
                rc = oom(g);
                goto done;
            }
        }
        pd_sbuf_puts(&b, "\"\\\"\" ");
        trie_expr(&b, &keys, prim(g, USE_CHAR, "char", &chr));
        pd_sbuf_printf(&b, " %s \":\" %s %s %s", w, w, value, w);
        rc = b.oom ? oom(g) : add_rule(g, b.p, &o.extra);
        pd_sbuf_free(&b);
        if (rc != PD_OK) goto done;
        pd_sbuf r0 = {0}, r1 = {0};
        pd_sbuf_printf(&r0, "( %s ( \",\" %s %s )* )?", o.extra, w, o.extra);
        pd_sbuf_printf(&r1, "( \",\" %s %s )*", w, o.extra);
        o.rest[0] = take(&r0);
        o.rest[1] = take(&r1);
    } else {
        o.rest[0] = strdup("");
        o.rest[1] = strdup("");
    }
    if (!o.rest[0] || !o.rest[1]) {
        rc = oom(g);
        goto done;
    }
    const char *rest;
    if ((rc = object_rest(g, &o, 0, 0, &rest)) != PD_OK) goto done;
    pd_sbuf_printf(&b, "\"{\" %s %s%s\"}\"", w, rest, *rest ? " " : "");
    rc = b.oom ? oom(g) : add_rule(g, b.p, expr);
done:
    for (size_t k = 0; k < o.n; k++) free(o.kv[k]);
    for (size_t k = 0; o.memo && k < 2 * o.n; k++) free(o.memo[k]);
    free(o.kv);
    free(o.required);
    free(o.memo);
    free(o.extra);
    free(o.rest[0]);
    free(o.rest[1]);
    free(names);
    free(schemas);
    free(value);
    trie_free(&keys);
    pd_sbuf_free(&b);
    pd_sbuf_free(&ws);
    pd_sbuf_free(&chr);
    return rc;
}

/* ---- enum, anyOf, $ref, types ------------------------------------------- */

static int gen_enum(gen *g, const json_t *s, char **expr) {
    const json_t *en = json_object_get(s, "enum"), *cst = json_object_get(s, "const");
    if (en && !json_is_array(en))
        return pd_errorf(g->err, PD_EINVAL, "JSON Schema keyword \"enum\" at %s must be an array", path_of(g));
    json_t *single = NULL;
    if (!en) en = single = json_pack("[O]", cst);
    if (!en) return oom(g);
    pd_sbuf b = {0};
    char **seen = calloc(json_array_size(en) + 1, sizeof *seen);
    size_t n_seen = 0, i;
    int rc = seen ? PD_OK : oom(g);
    const json_t *v;
    json_array_foreach(en, i, v) {
        if (rc != PD_OK) break;
        if (cst && !json_equal(v, cst)) continue;
        /* Only the values that meet the rest of the schema. */
        pd_error e = {0};
        bool violation = false;
        int vrc = pd_schema_validate_node(g->root, s, v, true, &violation, &e);
        if (vrc != PD_OK && violation) continue;
        if (vrc != PD_OK) {
            if (g->err) *g->err = e;
            rc = vrc;
            break;
        }
        char *text = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
        char *q = text ? pd_grammar_quote(text, strlen(text)) : NULL;
        free(text);
        if (!q) {
            rc = oom(g);
            break;
        }
        bool dup = false;
        for (size_t k = 0; k < n_seen; k++) dup = dup || strcmp(seen[k], q) == 0;
        if (dup) {
            free(q);
            continue;
        }
        pd_sbuf_printf(&b, "%s%s", n_seen ? " | " : "", q);
        seen[n_seen++] = q;
    }
    if (rc == PD_OK && n_seen == 0)
        rc = pd_errorf(g->err, PD_EINVAL, "JSON Schema at %s: no value of its %s meets the rest of the schema",
                       path_of(g), single ? "const" : "enum");
    if (rc == PD_OK) {
        pd_sbuf e = {0};
        if (n_seen > 1) pd_sbuf_printf(&e, "( %s )", pd_sbuf_str(&b));
        else pd_sbuf_puts(&e, pd_sbuf_str(&b));
        if (b.oom || !(*expr = take(&e))) rc = oom(g);
        pd_sbuf_free(&e);
    }
    for (size_t k = 0; k < n_seen; k++) free(seen[k]);
    free(seen);
    pd_sbuf_free(&b);
    json_decref(single);
    return rc;
}

static int gen_any_of(gen *g, const char *key, const json_t *branches, char **expr) {
    if (!json_is_array(branches) || json_array_size(branches) == 0)
        return pd_errorf(g->err, PD_EINVAL, "JSON Schema keyword \"%s\" at %s must be a non-empty array of schemas",
                         key, path_of(g));
    pd_sbuf b = {0};
    int rc = PD_OK;
    for (size_t i = 0; i < json_array_size(branches); i++) {
        char index[24], *e = NULL;
        snprintf(index, sizeof index, "%zu", i);
        if ((rc = gen_sub(g, json_array_get(branches, i), key, index, &e)) != PD_OK) break;
        pd_sbuf_printf(&b, "%s%s", i ? " | " : "", e);
        free(e);
    }
    if (rc == PD_OK) rc = b.oom ? oom(g) : add_rule(g, b.p, expr);
    pd_sbuf_free(&b);
    return rc;
}

/* A rule name from a definition name: [A-Za-z0-9-], made unique. */
static char *def_rule_name(gen *g, const char *ref) {
    const char *name = strrchr(ref, '/');
    name = name ? name + 1 : ref;
    pd_sbuf b = {0};
    pd_sbuf_printf(&b, "%s-def-", g->prefix);
    size_t start = b.len;
    for (const char *c = name; *c && b.len - start < 40; c++) {
        char ch = (*c >= 'A' && *c <= 'Z') || (*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') ? *c : '-';
        pd_sbuf_putn(&b, &ch, 1);
    }
    size_t base = b.len;
    for (int k = 2;; k++) {
        bool clash = false;
        for (size_t i = 0; i < g->n_defs; i++) clash = clash || strcmp(g->defs[i].rule, pd_sbuf_str(&b)) == 0;
        if (!clash) break;
        pd_schema_path_pop(&b, base);
        pd_sbuf_printf(&b, "-%d", k);
    }
    return take(&b);
}

static int gen_ref(gen *g, const json_t *ref, char **expr) {
    if (!json_is_string(ref))
        return pd_errorf(g->err, PD_EINVAL, "JSON Schema \"$ref\" at %s must be a string", path_of(g));
    const json_t *target = pd_schema_resolve_ref(g->root, json_string_value(ref), path_of(g), g->err);
    if (!target) return g->err ? g->err->code : PD_EINVAL;
    for (size_t i = 0; i < g->n_defs; i++)
        if (g->defs[i].schema == target) return (*expr = strdup(g->defs[i].rule)) ? PD_OK : oom(g);
    def_entry *d = realloc(g->defs, (g->n_defs + 1) * sizeof *d);
    if (!d) return oom(g);
    g->defs = d;
    char *rule = def_rule_name(g, json_string_value(ref));
    if (!rule) return oom(g);
    g->defs[g->n_defs++] = (def_entry){.schema = target, .ref = json_string_value(ref), .rule = rule};
    /* Generated at the definition's own path, recursion through the entry. */
    pd_sbuf saved = g->path;
    g->path = (pd_sbuf){0};
    pd_sbuf_puts(&g->path, json_string_value(ref));
    char *body = NULL;
    int rc = gen_schema(g, target, &body);
    pd_sbuf_free(&g->path);
    g->path = saved;
    if (rc != PD_OK) return rc;
    pd_sbuf_printf(&g->rules, "%s ::= %s\n", rule, body);
    free(body);
    if (g->rules.oom) return oom(g);
    return (*expr = strdup(rule)) ? PD_OK : oom(g);
}

/* Keywords other than annotations, for the "cannot be combined" checks. */
static const char *other_constraint(const json_t *s, const char *except) {
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)s, key, v) {
        if (strcmp(key, except) != 0 && !pd_schema_is_annotation(key)) return key;
    }
    return NULL;
}

static bool has_any(const json_t *s, const char *const *keys) {
    for (; *keys; keys++)
        if (json_object_get(s, *keys)) return true;
    return false;
}

static int gen_types(gen *g, const json_t *s, char **expr) {
    static const char *const type_names[] = {"object", "array", "string", "number", "integer", "boolean", "null"};
    static const char *const object_keys[] = {"properties", "required", "additionalProperties", NULL};
    static const char *const array_keys[] = {"items", "prefixItems", "minItems", "maxItems", NULL};
    static const char *const string_keys[] = {"minLength", "maxLength", "pattern", "format", NULL};
    static const char *const number_keys[] = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", NULL};
    bool want[7] = {0};
    const json_t *type = json_object_get(s, "type");
    size_t n_types = sizeof type_names / sizeof type_names[0];
    if (type) {
        bool ok = json_is_string(type) || (json_is_array(type) && json_array_size(type) > 0);
        for (size_t i = 0; ok && i < (json_is_array(type) ? json_array_size(type) : 1); i++) {
            const json_t *t = json_is_array(type) ? json_array_get(type, i) : type;
            bool known = false;
            for (size_t k = 0; json_is_string(t) && k < n_types; k++)
                if (strcmp(json_string_value(t), type_names[k]) == 0) want[k] = known = true;
            ok = known;
        }
        if (!ok)
            return pd_errorf(g->err, PD_EINVAL,
                             "JSON Schema keyword \"type\" at %s must be one of object, array, string, number, "
                             "integer, boolean, null, or a non-empty array of them",
                             path_of(g));
    } else {
        /* No type: the kinds its keywords describe, or any value. */
        want[0] = has_any(s, object_keys);
        want[1] = has_any(s, array_keys);
        want[2] = has_any(s, string_keys);
        want[3] = has_any(s, number_keys);
        if (!want[0] && !want[1] && !want[2] && !want[3]) {
            pd_sbuf v = {0};
            prim(g, USE_VALUE, "value", &v);
            return (*expr = take(&v)) ? PD_OK : oom(g);
        }
    }
    if (want[3]) want[4] = false; /* every integer is a number */
    pd_sbuf b = {0};
    int n = 0, rc = PD_OK;
    for (size_t k = 0; k < n_types && rc == PD_OK; k++) {
        if (!want[k]) continue;
        char *e = NULL;
        pd_sbuf p = {0};
        switch (k) {
        case 0: rc = gen_object(g, s, &e); break;
        case 1: rc = gen_array(g, s, &e); break;
        case 2: rc = gen_string(g, s, &e); break;
        case 3:
        case 4:
            if (has_bounds(s)) rc = gen_bounded(g, s, k == 4, &e);
            else if (k == 3) e = take((prim(g, USE_NUMBER, "number", &p), &p));
            else e = take((prim(g, USE_INTEGER, "integer", &p), &p));
            break;
        case 5: e = take((prim(g, USE_BOOLEAN, "boolean", &p), &p)); break;
        default: e = take((prim(g, USE_NULL, "null", &p), &p)); break;
        }
        if (rc == PD_OK && !e) rc = oom(g);
        if (rc == PD_OK) pd_sbuf_printf(&b, "%s%s", n++ ? " | " : "", e);
        free(e);
    }
    if (rc == PD_OK) {
        pd_sbuf e = {0};
        if (n > 1) pd_sbuf_printf(&e, "( %s )", pd_sbuf_str(&b));
        else pd_sbuf_puts(&e, pd_sbuf_str(&b));
        if (b.oom || !(*expr = take(&e))) rc = oom(g);
    }
    pd_sbuf_free(&b);
    return rc;
}

static int gen_schema(gen *g, const json_t *s, char **expr) {
    *expr = NULL;
    if (json_is_true(s)) {
        pd_sbuf v = {0};
        prim(g, USE_VALUE, "value", &v);
        return (*expr = take(&v)) ? PD_OK : oom(g);
    }
    if (json_is_false(s))
        return pd_errorf(g->err, PD_EUNSUPPORTED,
                         "the JSON Schema false (no value is allowed) at %s is not supported", path_of(g));
    if (!json_is_object(s))
        return pd_errorf(g->err, PD_EINVAL, "the JSON Schema at %s must be an object or a boolean", path_of(g));
    static const char *const known[] = {"type",      "enum",      "const",    "properties", "required",
                                        "additionalProperties",   "items",    "minItems",   "maxItems",
                                        "minLength", "maxLength", "pattern",  "anyOf",      "oneOf",
                                        "$ref",      "allOf",     "minimum",  "maximum",    "exclusiveMinimum",
                                        "exclusiveMaximum",       "format",   "prefixItems", "uniqueItems",
                                        NULL};
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)s, key, v) {
        bool ok = pd_schema_is_annotation(key);
        for (const char *const *k = known; !ok && *k; k++) ok = strcmp(key, *k) == 0;
        /* uniqueItems: false constrains nothing; true a grammar cannot express */
        if (strcmp(key, "uniqueItems") == 0) ok = json_is_false(v);
        if (!ok) {
            size_t mark = g->path.len;
            pd_schema_path_push(&g->path, key);
            int rc = pd_schema_unsupported_keyword(g->err, key, path_of(g));
            pd_schema_path_pop(&g->path, mark);
            return rc;
        }
    }
    if (++g->depth > MAX_NESTING) {
        g->depth--;
        return pd_errorf(g->err, PD_EUNSUPPORTED, "the JSON Schema nests deeper than %d at %s", MAX_NESTING,
                         path_of(g));
    }
    int rc;
    const char *alone[] = {"$ref", "anyOf", "oneOf", "allOf"};
    const char *which = NULL;
    for (size_t i = 0; i < 4; i++)
        if (json_object_get(s, alone[i])) which = alone[i];
    if (which) {
        const char *other = other_constraint(s, which);
        if (other) {
            rc = pd_errorf(g->err, PD_EUNSUPPORTED,
                           "JSON Schema keyword \"%s\" together with \"%s\" at %s is not supported; move \"%s\" "
                           "into each alternative or definition",
                           which, other, path_of(g), other);
        } else if (strcmp(which, "$ref") == 0) {
            rc = gen_ref(g, json_object_get(s, which), expr);
        } else if (strcmp(which, "allOf") == 0) {
            /* one subschema (pydantic v1 wraps a $ref so): that schema */
            const json_t *all = json_object_get(s, which);
            if (!json_is_array(all) || json_array_size(all) == 0)
                rc = pd_errorf(g->err, PD_EINVAL, "JSON Schema keyword \"allOf\" at %s must be a non-empty array of "
                               "schemas", path_of(g));
            else if (json_array_size(all) > 1)
                rc = pd_errorf(g->err, PD_EUNSUPPORTED,
                               "unsupported JSON Schema keyword \"allOf\" with %zu subschemas at %s/allOf (only one "
                               "is supported: a grammar cannot intersect); merge them into one schema",
                               json_array_size(all), path_of(g));
            else rc = gen_sub(g, json_array_get(all, 0), "allOf", "0", expr);
        } else {
            rc = gen_any_of(g, which, json_object_get(s, which), expr);
        }
    } else if (json_object_get(s, "enum") || json_object_get(s, "const")) {
        rc = gen_enum(g, s, expr);
    } else {
        rc = gen_types(g, s, expr);
    }
    g->depth--;
    return rc;
}

/* ---- left recursion ------------------------------------------------------ */

/* A definition that reaches itself through $ref and anyOf alone, before any
 * byte, is left recursion: the grammar would be refused, and nothing in it
 * could ever be generated. */
static const json_t *head_cycle(gen *g, const json_t *s, const json_t **stack, int depth) {
    if (!json_is_object(s) || depth >= MAX_NESTING) return NULL;
    const json_t *ref = json_object_get(s, "$ref");
    if (json_is_string(ref)) {
        const json_t *target = pd_schema_resolve_ref(g->root, json_string_value(ref), "", NULL);
        if (!target) return NULL;
        for (int i = 0; i < depth; i++)
            if (stack[i] == target) return target;
        stack[depth] = target;
        return head_cycle(g, target, stack, depth + 1);
    }
    const char *keys[] = {"anyOf", "oneOf", "allOf"};
    for (size_t k = 0; k < 3; k++) {
        const json_t *branches = json_object_get(s, keys[k]), *b;
        size_t i;
        json_array_foreach(branches, i, b) {
            const json_t *hit = head_cycle(g, b, stack, depth);
            if (hit) return hit;
        }
    }
    return NULL;
}

/* ---- the primitives and the entry point ---------------------------------- */

static void emit_primitives(gen *g, pd_sbuf *b) {
    const char *p = g->prefix;
    unsigned u = g->used;
    if (u & USE_VALUE) u |= USE_STRING | USE_NUMBER | USE_BOOLEAN | USE_NULL | USE_WS;
    if (u & USE_STRING) u |= USE_CHAR;
    if (u & USE_VALUE) {
        pd_sbuf_printf(b, "%s-value ::= %s-object | %s-array | %s-string | %s-number | %s-boolean | %s-null\n", p, p,
                       p, p, p, p, p);
        pd_sbuf_printf(b, "%s-object ::= \"{\" %s-ws ( %s-member ( \",\" %s-ws %s-member )* )? \"}\"\n", p, p, p, p, p);
        pd_sbuf_printf(b, "%s-member ::= %s-string %s-ws \":\" %s-ws %s-value %s-ws\n", p, p, p, p, p, p);
        pd_sbuf_printf(b, "%s-array ::= \"[\" %s-ws ( %s-value %s-ws ( \",\" %s-ws %s-value %s-ws )* )? \"]\"\n", p, p,
                       p, p, p, p, p);
    }
    if (u & USE_STRING) pd_sbuf_printf(b, "%s-string ::= \"\\\"\" %s-char* \"\\\"\"\n", p, p);
    if (u & USE_CHAR)
        /* \u escapes of surrogates and of U+0000 are left out: a lone
         * surrogate is not a character, and many parsers refuse \u0000. */
        pd_sbuf_printf(b,
                       "%s-char ::= [^\"\\\\\\x00-\\x1F] | \"\\\\\" ( [\"\\\\/bfnrt] | \"u\" ( [1-9a-cA-C] "
                       "[0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2} | [eEfF] [0-9a-fA-F]{3} | \"0\" ( [1-9a-fA-F] "
                       "[0-9a-fA-F]{2} | \"0\" ( [1-9a-fA-F] [0-9a-fA-F] | \"0\" [1-9a-fA-F] ) ) ) )\n",
                       p);
    /* At most 18 integer digits and a two-digit exponent: every such number
     * fits a 64-bit integer or a double. */
    if (u & USE_NUMBER)
        pd_sbuf_printf(b,
                       "%s-number ::= \"-\"? ( \"0\" | [1-9] [0-9]{0,17} ) ( \".\" [0-9]+ )? ( [eE] [-+]? "
                       "[0-9]{1,2} )?\n",
                       p);
    if (u & USE_INTEGER) pd_sbuf_printf(b, "%s-integer ::= \"-\"? ( \"0\" | [1-9] [0-9]{0,17} )\n", p);
    if (u & USE_DATE)
        pd_sbuf_printf(b,
                       "%s-date ::= [0-9]{4} \"-\" ( ( \"0\" [13578] | \"1\" [02] ) \"-\" ( \"0\" [1-9] | [12] [0-9] | "
                       "\"3\" [01] ) | ( \"0\" [469] | \"11\" ) \"-\" ( \"0\" [1-9] | [12] [0-9] | \"30\" ) | \"02-\" ( "
                       "\"0\" [1-9] | \"1\" [0-9] | \"2\" [0-8] ) ) | ( [0-9]{2} ( \"0\" [48] | [2468] [048] | "
                       "[13579] [26] ) | ( [02468] [048] | [13579] [26] ) \"00\" ) \"-02-29\"\n",
                       p);
    if (u & USE_TIME)
        pd_sbuf_printf(b,
                       "%s-time ::= ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] \":\" [0-5] [0-9] ( \".\" "
                       "[0-9]{1,9} )? ( \"Z\" | [-+] ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] )\n",
                       p);
    if (u & USE_UUID)
        pd_sbuf_printf(b,
                       "%s-uuid ::= [0-9a-fA-F]{8} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} "
                       "\"-\" [0-9a-fA-F]{12}\n",
                       p);
    if (u & USE_BOOLEAN) pd_sbuf_printf(b, "%s-boolean ::= \"true\" | \"false\"\n", p);
    if (u & USE_NULL) pd_sbuf_printf(b, "%s-null ::= \"null\"\n", p);
    if (u & USE_WS) pd_sbuf_printf(b, "%s-ws ::= ( \" \" | \"\\n\" [ \\t]{0,20} )?\n", p);
}

int pd_json_schema_grammar(const json_t *schema, const char *rule_prefix, char **out, pd_error *err) {
    if (!schema || !rule_prefix || !out)
        return pd_errorf(err, PD_EINVAL, "pd_json_schema_grammar: schema, rule_prefix and out are required");
    *out = NULL;
    if (!*rule_prefix || strspn(rule_prefix, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-") !=
                             strlen(rule_prefix))
        return pd_errorf(err, PD_EINVAL, "grammar rule prefix \"%s\" must be letters, digits and '-'", rule_prefix);
    gen g = {.root = schema, .prefix = rule_prefix, .err = err};
    pd_sbuf_puts(&g.path, "#");
    char *body = NULL;
    pd_sbuf text = {0};
    int rc;
    /* The root is a definition too ("#"), named after the prefix. */
    g.defs = malloc(sizeof *g.defs);
    char *root_rule = strdup(rule_prefix);
    if (!g.defs || !root_rule) {
        free(root_rule);
        rc = oom(&g);
        goto done;
    }
    g.defs[g.n_defs++] = (def_entry){.schema = schema, .ref = "#", .rule = root_rule};
    if ((rc = gen_schema(&g, schema, &body)) != PD_OK) goto done;
    for (size_t i = 0; i < g.n_defs; i++) {
        const json_t *stack[MAX_NESTING] = {g.defs[i].schema};
        const json_t *hit = head_cycle(&g, g.defs[i].schema, stack, 1);
        if (hit) {
            rc = pd_errorf(err, PD_EUNSUPPORTED,
                           "the JSON Schema refers to itself through $ref and anyOf alone (at %s), so no value "
                           "could ever be generated; put the recursion inside an object or an array",
                           g.defs[i].ref);
            goto done;
        }
    }
    pd_sbuf_printf(&text, "%s ::= %s\n", rule_prefix, body);
    pd_sbuf_puts(&text, pd_sbuf_str(&g.rules));
    emit_primitives(&g, &text);
    if (text.oom || g.path.oom) {
        rc = oom(&g);
        goto done;
    }
    *out = take(&text);
done:
    free(body);
    pd_sbuf_free(&text);
    pd_sbuf_free(&g.rules);
    pd_sbuf_free(&g.path);
    for (size_t i = 0; i < g.n_defs; i++) free(g.defs[i].rule);
    free(g.defs);
    return rc;
}
