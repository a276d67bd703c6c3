/* Layouts: named spans covering the prefix and whitelisted token ranges.
 * Two texts describe one: the canonical one-liner that goes into the cache
 * key ("spans=a:0-10,b:10-20!;keep=3-5") and the --spans file format (one
 * item per line, '#' comments). pd_layout_parse reads both. */
#include <ctype.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "policies/policies.h"

#define NAME_MAX_LEN 31 /* pd_span.name is char[32] */
#define ECHO_MAX 40

int pd_layout_validate(const pd_layout *layout, int64_t n, pd_error *err) {
    if (!layout) return PD_OK;
    if (n < 0) return pd_errorf(err, PD_EINVAL, "layout: prefix length %" PRId64 " is negative", n);
    if (layout->n_spans < 0 || layout->n_whitelist < 0)
        return pd_errorf(err, PD_EINVAL, "layout: negative count (%d spans, %d ranges)", layout->n_spans,
                         layout->n_whitelist);
    if ((layout->n_spans > 0 && !layout->spans) || (layout->n_whitelist > 0 && !layout->whitelist))
        return pd_errorf(err, PD_EINVAL, "layout: counts given without arrays");
    for (int i = 0; i < layout->n_spans; i++) {
        const pd_span *s = &layout->spans[i];
        size_t len = strnlen(s->name, sizeof s->name);
        if (len == 0 || len > NAME_MAX_LEN || strspn(s->name, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                                              "0123456789_.-") != len)
            return pd_errorf(err, PD_EINVAL, "layout: span %d has an invalid name (1..%d characters of "
                             "A-Z a-z 0-9 _ . -)", i, NAME_MAX_LEN);
        if (s->start >= s->end)
            return pd_errorf(err, PD_EINVAL, "layout: span %d '%s' (%" PRId64 "-%" PRId64 ") is empty or "
                             "reversed; a span needs start < end", i, s->name, s->start, s->end);
        int64_t expect = i == 0 ? 0 : layout->spans[i - 1].end;
        if (s->start != expect)
            return pd_errorf(err, PD_EINVAL, "layout: span %d '%s' starts at %" PRId64 " but must start at %"
                             PRId64 " (spans are sorted and cover every token, without gaps or overlaps)", i,
                             s->name, s->start, expect);
        if (s->end > n)
            return pd_errorf(err, PD_EINVAL, "layout: span %d '%s' (%" PRId64 "-%" PRId64 ") ends past the "
                             "prefix of %" PRId64 " tokens", i, s->name, s->start, s->end, n);
    }
    if (layout->n_spans > 0 && layout->spans[layout->n_spans - 1].end != n) {
        const pd_span *s = &layout->spans[layout->n_spans - 1];
        return pd_errorf(err, PD_EINVAL, "layout: the last span '%s' ends at %" PRId64 " but the prefix has %"
                         PRId64 " tokens; spans must cover every token", s->name, s->end, n);
    }
    for (int i = 0; i < layout->n_whitelist; i++) {
        const pd_range *r = &layout->whitelist[i];
        if (r->start < 0 || r->start >= r->end || r->end > n)
            return pd_errorf(err, PD_EINVAL, "layout: kept range %d (%" PRId64 "-%" PRId64 ") must be non-empty "
                             "and inside the prefix [0, %" PRId64 ")", i, r->start, r->end, n);
    }
    return PD_OK;
}


size_t pd_layout_print(const pd_layout *layout, char *buf, size_t cap) {
    pd_strbuf w = {buf, cap, 0};
    if (cap) buf[0] = '\0';
    if (!layout) return 0;
    for (int i = 0; i < layout->n_spans; i++) {
        const pd_span *s = &layout->spans[i];
        pd_strbuf_printf(&w, "%s%.*s:%" PRId64 "-%" PRId64 "%s", i ? "," : "spans=", (int)sizeof s->name, s->name, s->start,
             s->end, s->whitelist ? "!" : "");
    }
    for (int i = 0; i < layout->n_whitelist; i++) {
        const pd_range *r = &layout->whitelist[i];
        pd_strbuf_printf(&w, "%s%" PRId64 "-%" PRId64, i ? "," : layout->n_spans > 0 ? ";keep=" : "keep=", r->start, r->end);
    }
    return w.len;
}

size_t pd_policy_key_print(const pd_policy_spec *spec, const pd_layout *layout, char *buf, size_t cap) {
    size_t len = pd_policy_spec_print(spec, buf, cap);
    const size_t layout_len = pd_layout_print(layout, NULL, 0);
    if (!layout_len) return len;
    if (len + 1 < cap) {
        buf[len] = '|';
        pd_layout_print(layout, buf + len + 1, cap - len - 1);
    }
    return len + 1 + layout_len;
}

void pd_layout_free(pd_layout *layout) {
    if (!layout) return;
    /* The header's arrays are const for users; parse malloc'd them. */
    free((void *)(uintptr_t)layout->spans);
    free((void *)(uintptr_t)layout->whitelist);
    memset(layout, 0, sizeof *layout);
}

/* ------------------------------------------------------------------------
 * Parsing
 * ------------------------------------------------------------------------ */

typedef struct builder {
    pd_span *spans;
    int n_spans, cap_spans;
    pd_range *ranges;
    int n_ranges, cap_ranges;
} builder;

static int grow(void **arr, int *cap, int need, size_t elem, pd_error *err) {
    if (need <= *cap) return PD_OK;
    if (*cap > INT32_MAX / 2) return pd_errorf(err, PD_ERANGE, "layout: too many spans or ranges");
    int new_cap = *cap ? *cap * 2 : 8;
    void *p = realloc(*arr, (size_t)new_cap * elem);
    if (!p) return pd_errorf(err, PD_ENOMEM, "out of memory for a layout of %d items", new_cap);
    *arr = p;
    *cap = new_cap;
    return PD_OK;
}

static int add_span(builder *b, const char *name, int64_t start, int64_t end, bool wl, pd_error *err) {
    void *arr = b->spans;
    int rc = grow(&arr, &b->cap_spans, b->n_spans + 1, sizeof *b->spans, err);
    b->spans = arr;
    if (rc) return rc;
    pd_span *s = &b->spans[b->n_spans++];
    memset(s, 0, sizeof *s);
    memcpy(s->name, name, strlen(name)); /* checked: at most 31 characters */
    s->start = start;
    s->end = end;
    s->whitelist = wl;
    return PD_OK;
}

static int add_range(builder *b, int64_t start, int64_t end, pd_error *err) {
    void *arr = b->ranges;
    int rc = grow(&arr, &b->cap_ranges, b->n_ranges + 1, sizeof *b->ranges, err);
    b->ranges = arr;
    if (rc) return rc;
    b->ranges[b->n_ranges].start = start;
    b->ranges[b->n_ranges].end = end;
    b->n_ranges++;
    return PD_OK;
}

static void echo(const char *s, size_t n, char *out, size_t cap) {
    size_t max = cap - 4, i;
    for (i = 0; i < n && i < max; i++) out[i] = (unsigned char)s[i] < 0x20 ? '?' : s[i];
    if (i < n) {
        memcpy(out + i, "...", 3);
        i += 3;
    }
    out[i] = '\0';
}

/* A token position: plain decimal digits, no sign. */
static bool parse_pos(const char *s, size_t n, int64_t *out) {
    if (n == 0 || n > 18) return false; /* 18 digits cannot overflow int64 */
    int64_t v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return false;
        v = v * 10 + (s[i] - '0');
    }
    *out = v;
    return true;
}

static bool valid_name(const char *s, size_t n) {
    if (n == 0 || n > NAME_MAX_LEN) return false;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)s[i]) && s[i] != '_' && s[i] != '.' && s[i] != '-') return false;
    return true;
}

/* "START-END" (exactly), into a non-empty range. `what` names it in errors. */
static int parse_bounds(const char *s, size_t n, const char *what, int64_t *start, int64_t *end, pd_error *err) {
    char shown[ECHO_MAX + 4];
    const char *dash = memchr(s, '-', n);
    if (!dash || !parse_pos(s, (size_t)(dash - s), start) ||
        !parse_pos(dash + 1, n - (size_t)(dash - s) - 1, end)) {
        echo(s, n, shown, sizeof shown);
        return pd_errorf(err, PD_EINVAL, "layout: %s has bounds '%s'; write START-END with token positions",
                         what, shown);
    }
    if (*start >= *end)
        return pd_errorf(err, PD_EINVAL, "layout: %s %" PRId64 "-%" PRId64 " is empty or reversed; it needs "
                         "START < END", what, *start, *end);
    return PD_OK;
}

/* One comma-separated list of the canonical form. */
static int parse_list(builder *b, const char *s, size_t n, bool spans, pd_error *err) {
    char shown[ECHO_MAX + 4], what[96];
    size_t pos = 0;
    int idx = 0;
    for (;;) {
        const char *it = s + pos;
        const char *comma = memchr(it, ',', n - pos);
        size_t len = comma ? (size_t)(comma - it) : n - pos;
        if (len == 0)
            return pd_errorf(err, PD_EINVAL, "layout: empty %s item %d (a trailing or doubled ',' or an empty "
                             "list)", spans ? "span" : "keep", idx);
        if (spans) {
            const char *colon = memchr(it, ':', len);
            echo(it, colon ? (size_t)(colon - it) : len, shown, sizeof shown);
            if (!colon || !valid_name(it, (size_t)(colon - it)))
                return pd_errorf(err, PD_EINVAL, "layout: span item %d '%s' needs NAME:START-END with a name of "
                                 "1..%d characters of A-Z a-z 0-9 _ . -", idx, shown, NAME_MAX_LEN);
            char name[NAME_MAX_LEN + 1];
            memcpy(name, it, (size_t)(colon - it));
            name[colon - it] = '\0';
            size_t blen = len - (size_t)(colon - it) - 1;
            bool wl = blen > 0 && colon[blen] == '!';
            snprintf(what, sizeof what, "span '%s'", name);
            int64_t a, e;
            int rc = parse_bounds(colon + 1, blen - (wl ? 1 : 0), what, &a, &e, err);
            if (!rc) rc = add_span(b, name, a, e, wl, err);
            if (rc) return rc;
        } else {
            snprintf(what, sizeof what, "kept range %d", idx);
            int64_t a, e;
            int rc = parse_bounds(it, len, what, &a, &e, err);
            if (!rc) rc = add_range(b, a, e, err);
            if (rc) return rc;
        }
        idx++;
        if (!comma) return PD_OK;
        pos += len + 1;
    }
}

static int parse_canonical(builder *b, const char *text, pd_error *err) {
    bool seen_spans = false, seen_keep = false;
    const char *p = text;
    for (;;) {
        const char *semi = strchr(p, ';');
        size_t len = semi ? (size_t)(semi - p) : strlen(p);
        /* Trailing spaces (a newline at the end of a file) are harmless. */
        if (!semi)
            while (len > 0 && isspace((unsigned char)p[len - 1])) len--;
        char shown[ECHO_MAX + 4];
        int rc;
        if (len >= 6 && memcmp(p, "spans=", 6) == 0 && !seen_spans && !seen_keep) {
            seen_spans = true;
            rc = parse_list(b, p + 6, len - 6, true, err);
        } else if (len >= 5 && memcmp(p, "keep=", 5) == 0 && !seen_keep) {
            seen_keep = true;
            rc = parse_list(b, p + 5, len - 5, false, err);
        } else {
            echo(p, len, shown, sizeof shown);
            return pd_errorf(err, PD_EINVAL, "layout: part '%s' is not expected here; the form is "
                             "spans=NAME:START-END[!],...;keep=START-END,... (each part optional, once, in "
                             "that order)", shown);
        }
        if (rc) return rc;
        if (!semi) return PD_OK;
        p = semi + 1;
    }
}

/* Whitespace-separated fields of one line (comments already cut). */
#define LINE_FIELDS 5
static int split_fields(const char *s, size_t n, const char **f, size_t *flen) {
    int k = 0;
    size_t i = 0;
    while (i < n) {
        while (i < n && isspace((unsigned char)s[i])) i++;
        if (i >= n) break;
        size_t st = i;
        while (i < n && !isspace((unsigned char)s[i])) i++;
        if (k < LINE_FIELDS) {
            f[k] = s + st;
            flen[k] = i - st;
        }
        k++;
    }
    return k;
}

static int parse_file(builder *b, const char *text, pd_error *err) {
    const char *p = text;
    char shown[ECHO_MAX + 4];
    for (int line = 1;; line++) {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        const char *hash = memchr(p, '#', len);
        if (hash) len = (size_t)(hash - p);
        const char *f[LINE_FIELDS];
        size_t fl[LINE_FIELDS];
        int k = split_fields(p, len, f, fl);
        if (k > 0) {
            bool is_keep = fl[0] == 4 && memcmp(f[0], "keep", 4) == 0;
            int64_t a, e;
            if (is_keep ? k != 3 : (k != 3 && !(k == 4 && fl[3] == 4 && memcmp(f[3], "keep", 4) == 0))) {
                echo(p, len, shown, sizeof shown);
                return pd_errorf(err, PD_EINVAL, "layout line %d: '%s' is not 'NAME START END [keep]' or "
                                 "'keep START END'", line, shown);
            }
            if (!is_keep && !valid_name(f[0], fl[0])) {
                echo(f[0], fl[0], shown, sizeof shown);
                return pd_errorf(err, PD_EINVAL, "layout line %d: span name '%s' must be 1..%d characters of "
                                 "A-Z a-z 0-9 _ . -", line, shown, NAME_MAX_LEN);
            }
            if (!parse_pos(f[1], fl[1], &a) || !parse_pos(f[2], fl[2], &e)) {
                echo(p, len, shown, sizeof shown);
                return pd_errorf(err, PD_EINVAL, "layout line %d: '%s': START and END must be token positions "
                                 "(non-negative integers)", line, shown);
            }
            if (a >= e)
                return pd_errorf(err, PD_EINVAL, "layout line %d: %" PRId64 "-%" PRId64 " is empty or reversed; "
                                 "it needs START < END", line, a, e);
            int rc;
            if (is_keep) {
                rc = add_range(b, a, e, err);
            } else {
                char name[NAME_MAX_LEN + 1];
                memcpy(name, f[0], fl[0]);
                name[fl[0]] = '\0';
                rc = add_span(b, name, a, e, k == 4, err);
            }
            if (rc) return rc;
        }
        if (!nl) return PD_OK;
        p = nl + 1;
    }
}

int pd_layout_parse(const char *text, pd_layout *out, pd_error *err) {
    memset(out, 0, sizeof *out);
    if (!text) return pd_errorf(err, PD_EINVAL, "layout: no text given");
    const char *p = text;
    while (isspace((unsigned char)*p)) p++;
    builder b = {0};
    int rc = PD_OK;
    if (strncmp(p, "spans=", 6) == 0 || strncmp(p, "keep=", 5) == 0) rc = parse_canonical(&b, p, err);
    else if (*p) rc = parse_file(&b, text, err);
    if (rc) {
        free(b.spans);
        free(b.ranges);
        return rc;
    }
    out->spans = b.spans;
    out->n_spans = b.n_spans;
    out->whitelist = b.ranges;
    out->n_whitelist = b.n_ranges;
    return PD_OK;
}
