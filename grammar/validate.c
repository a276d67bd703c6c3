/* pd_json_schema_validate: the JSON Schema subset of grammar.h checked
 * directly on a parsed document, independently of the grammar that
 * schema.c generates (patterns go through PCRE2, not regex.c), so each can
 * be tested against the other. oneOf is checked as anyOf, as it is
 * generated. */
#include "schema_internal.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

/* A chain of $refs that never reaches a smaller part of the document. */
#define MAX_DEPTH 2000

typedef struct vctx {
    const json_t *root;
    pd_sbuf doc_path, schema_path;
    pd_error *err;
    int depth;
    bool bad_schema; /* the failure is the schema's, not the document's */
} vctx;

int pd_schema_unsupported_keyword(pd_error *err, const char *key, const char *path) {
    return pd_errorf(err, PD_EUNSUPPORTED,
                     "unsupported JSON Schema keyword \"%s\" at %s (supported: type, enum, const, properties, "
                     "required, additionalProperties, items, prefixItems, minItems, maxItems, minLength, maxLength, "
                     "pattern, format (date, time, date-time, uuid), minimum, maximum, exclusiveMinimum, "
                     "exclusiveMaximum, anyOf, oneOf, allOf of one schema, $ref to #/$defs, and annotations)",
                     key, path);
}

/* Decode ~1 and ~0 of one JSON pointer token (malloc'd). */
static char *pointer_token(const char *s, size_t n) {
    char *out = malloc(n + 1);
    if (!out) return NULL;
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '~' && i + 1 < n && (s[i + 1] == '0' || s[i + 1] == '1')) {
            out[w++] = s[i + 1] == '0' ? '~' : '/';
            i++;
        } else {
            out[w++] = s[i];
        }
    }
    out[w] = '\0';
    return out;
}

const json_t *pd_schema_resolve_ref(const json_t *root, const char *ref, const char *path, pd_error *err) {
    if (strcmp(ref, "#") == 0) return root;
    const char *name = NULL, *section = NULL;
    if (strncmp(ref, "#/$defs/", 8) == 0) name = ref + 8, section = "$defs";
    else if (strncmp(ref, "#/definitions/", 14) == 0) name = ref + 14, section = "definitions";
    if (!name || !*name || strchr(name, '/') || strchr(name, '%')) {
        pd_errorf(err, PD_EUNSUPPORTED,
                  "unsupported JSON Schema \"$ref\" \"%s\" at %s: only \"#\", \"#/$defs/NAME\" and "
                  "\"#/definitions/NAME\" are supported",
                  ref, path);
        return NULL;
    }
    char *key = pointer_token(name, strlen(name));
    if (!key) {
        pd_errorf(err, PD_ENOMEM, "out of memory");
        return NULL;
    }
    const json_t *defs = json_is_object(root) ? json_object_get(root, section) : NULL;
    const json_t *def = json_is_object(defs) ? json_object_get(defs, key) : NULL;
    free(key);
    if (!def) pd_errorf(err, PD_EINVAL, "JSON Schema \"$ref\" \"%s\" at %s names no definition", ref, path);
    return def;
}

static const char *dpath(vctx *c) { return pd_sbuf_str(&c->doc_path); }

/* The schema itself is wrong (PD_EINVAL, as the caller gave it). */
__attribute__((format(printf, 2, 3))) static int bad_schema(vctx *c, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    pd_verrorf(c->err, PD_EINVAL, fmt, ap);
    va_end(ap);
    c->bad_schema = true;
    return PD_EINVAL;
}

static int fail(vctx *c, const char *fmt, const char *detail) {
    return pd_errorf(c->err, PD_EINVAL, "the value at %s %s%s (schema at %s)", dpath(c), fmt, detail ? detail : "",
                     pd_sbuf_str(&c->schema_path));
}

static bool type_matches(const char *type, const json_t *doc) {
    if (strcmp(type, "object") == 0) return json_is_object(doc);
    if (strcmp(type, "array") == 0) return json_is_array(doc);
    if (strcmp(type, "string") == 0) return json_is_string(doc);
    if (strcmp(type, "number") == 0) return json_is_number(doc);
    if (strcmp(type, "boolean") == 0) return json_is_boolean(doc);
    if (strcmp(type, "null") == 0) return json_is_null(doc);
    if (strcmp(type, "integer") == 0) {
        if (json_is_integer(doc)) return true;
        if (!json_is_real(doc)) return false;
        double v = json_real_value(doc);
        if (v >= 9e15 || v <= -9e15) return true; /* doubles this large are all integral */
        return v == (double)(long long)v;
    }
    return false;
}

static size_t utf8_length(const char *s, size_t n) {
    size_t cps = 0;
    for (size_t i = 0; i < n; i++)
        if (((unsigned char)s[i] & 0xC0) != 0x80) cps++;
    return cps;
}

static int check_count(vctx *c, const json_t *v, const char *key, size_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0)
        return bad_schema(c, "JSON Schema keyword \"%s\" at %s must be a non-negative integer", key,
                         pd_sbuf_str(&c->schema_path));
    *out = (size_t)json_integer_value(v);
    return PD_OK;
}

static int check_pattern(vctx *c, const char *pattern, const json_t *doc) {
    int ecode;
    PCRE2_SIZE eoff;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_DOLLAR_ENDONLY | PCRE2_NEVER_BACKSLASH_C, &ecode, &eoff, NULL);
    if (!re) {
        PCRE2_UCHAR msg[128];
        pcre2_get_error_message(ecode, msg, sizeof msg);
        return bad_schema(c, "invalid JSON Schema \"pattern\" at %s: %s at offset %zu",
                         pd_sbuf_str(&c->schema_path), (const char *)msg, (size_t)eoff);
    }
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    int rc = PD_OK;
    if (!md) {
        rc = pd_errorf(c->err, PD_ENOMEM, "out of memory");
        goto done;
    }
    int m = pcre2_match(re, (PCRE2_SPTR)json_string_value(doc), json_string_length(doc), 0, 0, md, NULL);
    if (m == PCRE2_ERROR_NOMATCH) rc = fail(c, "does not match the pattern ", pattern);
    else if (m < 0) rc = pd_errorf(c->err, PD_EINVAL, "matching the pattern at %s failed (PCRE2 error %d)",
                                   pd_sbuf_str(&c->schema_path), m);
done:
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    return rc;
}

static int validate(vctx *c, const json_t *schema, const json_t *doc, bool skip_enum);

/* ---- numbers --------------------------------------------------------- */

/* doc compared with a bound: <0, 0, >0. Integers exactly, otherwise as
 * long doubles (exact for every int64 and every double). */
static int compare_number(const json_t *doc, const json_t *bound) {
    if (json_is_integer(doc) && json_is_integer(bound)) {
        json_int_t a = json_integer_value(doc), b = json_integer_value(bound);
        return (a > b) - (a < b);
    }
    long double a = json_is_integer(doc) ? (long double)json_integer_value(doc) : (long double)json_real_value(doc);
    long double b = json_is_integer(bound) ? (long double)json_integer_value(bound) : (long double)json_real_value(bound);
    return (a > b) - (a < b);
}

static int validate_number(vctx *c, const json_t *schema, const json_t *doc) {
    static const struct {
        const char *key;
        int sign; /* the comparison that fails */
        bool strict;
        const char *what;
    } bounds[] = {{"minimum", -1, false, "is below minimum "},
                  {"exclusiveMinimum", -1, true, "is not above exclusiveMinimum "},
                  {"maximum", 1, false, "is above maximum "},
                  {"exclusiveMaximum", 1, true, "is not below exclusiveMaximum "}};
    for (size_t i = 0; i < 4; i++) {
        const json_t *v = json_object_get(schema, bounds[i].key);
        if (!v) continue;
        if (json_is_boolean(v)) {
            size_t mark = c->schema_path.len;
            pd_schema_path_push(&c->schema_path, bounds[i].key);
            int rc = pd_errorf(c->err, PD_EUNSUPPORTED,
                               "unsupported JSON Schema keyword \"%s\" as a boolean (draft 4) at %s; give the bound "
                               "itself",
                               bounds[i].key, pd_sbuf_str(&c->schema_path));
            pd_schema_path_pop(&c->schema_path, mark);
            c->bad_schema = true;
            return rc;
        }
        if (!json_is_number(v))
            return bad_schema(c, "JSON Schema keyword \"%s\" at %s must be a number", bounds[i].key,
                              pd_sbuf_str(&c->schema_path));
        int cmp = compare_number(doc, v);
        if (cmp == bounds[i].sign || (bounds[i].strict && cmp == 0)) {
            char *want = json_dumps(v, JSON_ENCODE_ANY);
            int rc = fail(c, bounds[i].what, want);
            free(want);
            return rc;
        }
    }
    return PD_OK;
}

/* ---- formats (RFC 3339 dates and times, RFC 4122 uuids) --------------- */

static bool digits_at(const char *s, size_t n, int *out) {
    int v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return false;
        v = v * 10 + (s[i] - '0');
    }
    *out = v;
    return true;
}

static bool is_date(const char *s, size_t n) {
    int y, m, d;
    if (n != 10 || s[4] != '-' || s[7] != '-' || !digits_at(s, 4, &y) || !digits_at(s + 5, 2, &m) ||
        !digits_at(s + 8, 2, &d))
        return false;
    static const int days[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    if (m < 1 || m > 12 || d < 1) return false;
    bool leap = y % 4 == 0 && (y % 100 != 0 || y % 400 == 0);
    return d <= days[m - 1] + (m == 2 && leap);
}

/* partial-time and offset: HH:MM:SS[.frac](Z|+HH:MM|-HH:MM) */
static bool is_time(const char *s, size_t n) {
    int h, m, sec;
    if (n < 9 || s[2] != ':' || s[5] != ':' || !digits_at(s, 2, &h) || !digits_at(s + 3, 2, &m) ||
        !digits_at(s + 6, 2, &sec) || h > 23 || m > 59 || sec > 60)
        return false;
    size_t i = 8;
    if (s[i] == '.') {
        size_t start = ++i;
        while (i < n && s[i] >= '0' && s[i] <= '9') i++;
        if (i == start) return false;
    }
    if (i < n && (s[i] == 'Z' || s[i] == 'z')) return i + 1 == n;
    int oh, om;
    return i + 6 == n && (s[i] == '+' || s[i] == '-') && s[i + 3] == ':' && digits_at(s + i + 1, 2, &oh) &&
           digits_at(s + i + 4, 2, &om) && oh <= 23 && om <= 59;
}

static bool is_uuid(const char *s, size_t n) {
    if (n != 36) return false;
    for (size_t i = 0; i < n; i++) {
        bool dash = i == 8 || i == 13 || i == 18 || i == 23;
        char ch = s[i];
        bool hex = (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F');
        if (dash ? ch != '-' : !hex) return false;
    }
    return true;
}

/* The format's name is a string and one of those supported. */
static int format_known(vctx *c, const json_t *format) {
    static const char *const names[] = {"date", "time", "date-time", "uuid"};
    const char *f = json_string_value(format);
    if (!f) return bad_schema(c, "JSON Schema keyword \"format\" at %s must be a string", pd_sbuf_str(&c->schema_path));
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (strcmp(f, names[i]) == 0) return PD_OK;
    size_t mark = c->schema_path.len;
    pd_schema_path_push(&c->schema_path, "format");
    int rc = pd_errorf(c->err, PD_EUNSUPPORTED,
                       "unsupported JSON Schema keyword \"format\" \"%s\" at %s (supported formats: date, time, "
                       "date-time, uuid)",
                       f, pd_sbuf_str(&c->schema_path));
    pd_schema_path_pop(&c->schema_path, mark);
    c->bad_schema = true;
    return rc;
}

static int check_format(vctx *c, const json_t *format, const json_t *doc) {
    const char *s = json_string_value(doc);
    size_t n = json_string_length(doc);
    const char *f = json_string_value(format);
    int rc = format_known(c, format);
    if (rc != PD_OK) return rc;
    bool ok;
    if (strcmp(f, "date") == 0) ok = is_date(s, n);
    else if (strcmp(f, "time") == 0) ok = is_time(s, n);
    else if (strcmp(f, "date-time") == 0) ok = n > 11 && (s[10] == 'T' || s[10] == 't') && is_date(s, 10) &&
                                                is_time(s + 11, n - 11);
    else ok = is_uuid(s, n);
    return ok ? PD_OK : fail(c, "is not of format ", f);
}

/* validate under schema[key] (or schema[key][index] when index >= 0), with
 * the schema path extended accordingly. */
static int validate_sub(vctx *c, const json_t *sub, const char *key, const char *key2, const json_t *doc) {
    size_t mark = c->schema_path.len;
    pd_schema_path_push(&c->schema_path, key);
    if (key2) pd_schema_path_push(&c->schema_path, key2);
    int rc = validate(c, sub, doc, false);
    pd_schema_path_pop(&c->schema_path, mark);
    return rc;
}

static int validate_object(vctx *c, const json_t *schema, const json_t *doc) {
    const json_t *props = json_object_get(schema, "properties");
    const json_t *required = json_object_get(schema, "required");
    const json_t *additional = json_object_get(schema, "additionalProperties");
    if (props && !json_is_object(props))
        return bad_schema(c, "JSON Schema keyword \"properties\" at %s must be an object",
                         pd_sbuf_str(&c->schema_path));
    if (required) {
        if (!json_is_array(required))
            return bad_schema(c, "JSON Schema keyword \"required\" at %s must be an array of names",
                             pd_sbuf_str(&c->schema_path));
        size_t i;
        const json_t *name;
        json_array_foreach(required, i, name) {
            if (!json_is_string(name))
                return bad_schema(c, "JSON Schema keyword \"required\" at %s must be an array of names",
                                 pd_sbuf_str(&c->schema_path));
            if (!json_object_get(doc, json_string_value(name)))
                return fail(c, "lacks the required property ", json_string_value(name));
        }
    }
    const char *key;
    const json_t *value;
    json_object_foreach((json_t *)doc, key, value) {
        size_t mark = c->doc_path.len;
        pd_schema_path_push(&c->doc_path, key);
        int rc = PD_OK;
        const json_t *sub = props ? json_object_get(props, key) : NULL;
        if (sub) rc = validate_sub(c, sub, "properties", key, value);
        else if (json_is_false(additional)) {
            pd_schema_path_pop(&c->doc_path, mark);
            return fail(c, "has a property that is not allowed: ", key);
        } else if (additional && !json_is_true(additional))
            rc = validate_sub(c, additional, "additionalProperties", NULL, value);
        if (rc != PD_OK) return rc;
        pd_schema_path_pop(&c->doc_path, mark);
    }
    return PD_OK;
}

static int validate_array(vctx *c, const json_t *schema, const json_t *doc) {
    const json_t *items = json_object_get(schema, "items");
    const json_t *v;
    size_t n = json_array_size(doc), bound;
    int rc = PD_OK;
    if ((v = json_object_get(schema, "minItems"))) {
        if ((rc = check_count(c, v, "minItems", &bound)) != PD_OK) return rc;
        if (n < bound) return fail(c, "has fewer items than minItems", NULL);
    }
    if ((v = json_object_get(schema, "maxItems"))) {
        if ((rc = check_count(c, v, "maxItems", &bound)) != PD_OK) return rc;
        if (n > bound) return fail(c, "has more items than maxItems", NULL);
    }
    if (json_is_array(items)) {
        pd_schema_path_push(&c->schema_path, "items");
        c->bad_schema = true;
        return pd_schema_unsupported_keyword(c->err, "items (an array: tuple validation)", pd_sbuf_str(&c->schema_path));
    }
    const json_t *prefix = json_object_get(schema, "prefixItems");
    if (prefix && !json_is_array(prefix))
        return bad_schema(c, "JSON Schema keyword \"prefixItems\" at %s must be an array of schemas",
                          pd_sbuf_str(&c->schema_path));
    size_t n_prefix = json_array_size(prefix);
    for (size_t i = 0; i < n; i++) {
        char index[24];
        snprintf(index, sizeof index, "%zu", i);
        size_t mark = c->doc_path.len;
        pd_schema_path_push(&c->doc_path, index);
        if (i < n_prefix) rc = validate_sub(c, json_array_get(prefix, i), "prefixItems", index, json_array_get(doc, i));
        else if (items) rc = validate_sub(c, items, "items", NULL, json_array_get(doc, i));
        if (rc != PD_OK) return rc;
        pd_schema_path_pop(&c->doc_path, mark);
    }
    return PD_OK;
}

static int validate_string(vctx *c, const json_t *schema, const json_t *doc) {
    const json_t *v;
    size_t n = utf8_length(json_string_value(doc), json_string_length(doc)), bound;
    int rc;
    if ((v = json_object_get(schema, "minLength"))) {
        if ((rc = check_count(c, v, "minLength", &bound)) != PD_OK) return rc;
        if (n < bound) return fail(c, "is shorter than minLength", NULL);
    }
    if ((v = json_object_get(schema, "maxLength"))) {
        if ((rc = check_count(c, v, "maxLength", &bound)) != PD_OK) return rc;
        if (n > bound) return fail(c, "is longer than maxLength", NULL);
    }
    if ((v = json_object_get(schema, "pattern"))) {
        if (!json_is_string(v))
            return bad_schema(c, "JSON Schema keyword \"pattern\" at %s must be a string",
                             pd_sbuf_str(&c->schema_path));
        if ((rc = check_pattern(c, json_string_value(v), doc)) != PD_OK) return rc;
    }
    if ((v = json_object_get(schema, "format")) && (rc = check_format(c, v, doc)) != PD_OK) return rc;
    return PD_OK;
}

static int validate_any_of(vctx *c, const char *key, const json_t *branches, const json_t *doc) {
    if (!json_is_array(branches) || json_array_size(branches) == 0)
        return bad_schema(c, "JSON Schema keyword \"%s\" at %s must be a non-empty array of schemas",
                         key, pd_sbuf_str(&c->schema_path));
    pd_error first = {0};
    for (size_t i = 0; i < json_array_size(branches); i++) {
        char index[24];
        snprintf(index, sizeof index, "%zu", i);
        pd_error e = {0};
        pd_error *saved = c->err;
        c->err = &e;
        size_t mark = c->schema_path.len;
        int rc = validate_sub(c, json_array_get(branches, i), key, index, doc);
        c->err = saved;
        if (rc == PD_OK) return PD_OK;
        if (rc != PD_EINVAL || c->bad_schema) {
            *c->err = e;
            return rc;
        }
        pd_schema_path_pop(&c->schema_path, mark);
        if (i == 0) first = e;
    }
    return pd_errorf(c->err, PD_EINVAL, "the value at %s matches none of the %s at %s (the first: %s)", dpath(c), key,
                     pd_sbuf_str(&c->schema_path), first.msg);
}

static int validate(vctx *c, const json_t *schema, const json_t *doc, bool skip_enum) {
    if (json_is_true(schema)) return PD_OK;
    if (json_is_false(schema)) return fail(c, "is not allowed (the schema is false)", NULL);
    if (!json_is_object(schema))
        return bad_schema(c, "the JSON Schema at %s is not an object or a boolean",
                         pd_sbuf_str(&c->schema_path));
    if (++c->depth > MAX_DEPTH) return fail(c, "needs $refs nested too deep to check", NULL);
    int rc = PD_OK;
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)schema, key, v) {
        if (pd_schema_is_annotation(key)) continue;
        if (strcmp(key, "type") == 0) {
            bool ok = false;
            if (json_is_string(v)) ok = type_matches(json_string_value(v), doc);
            size_t i;
            const json_t *t;
            if (json_is_array(v)) json_array_foreach(v, i, t) ok = ok || (json_is_string(t) && type_matches(json_string_value(t), doc));
            if (!ok) {
                char *want = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
                rc = fail(c, "is not of type ", want);
                free(want);
                goto done;
            }
        } else if (strcmp(key, "enum") == 0) {
            if (skip_enum) continue;
            if (!json_is_array(v)) {
                rc = bad_schema(c, "JSON Schema keyword \"enum\" at %s must be an array",
                               pd_sbuf_str(&c->schema_path));
                goto done;
            }
            bool ok = false;
            size_t i;
            const json_t *e;
            json_array_foreach(v, i, e) ok = ok || json_equal(e, doc);
            if (!ok) {
                rc = fail(c, "is not one of the enum values", NULL);
                goto done;
            }
        } else if (strcmp(key, "const") == 0) {
            if (!skip_enum && !json_equal(v, doc)) {
                rc = fail(c, "is not the const value", NULL);
                goto done;
            }
        } else if (strcmp(key, "anyOf") == 0 || strcmp(key, "oneOf") == 0) {
            if ((rc = validate_any_of(c, key, v, doc)) != PD_OK) goto done;
        } else if (strcmp(key, "$ref") == 0) {
            if (!json_is_string(v)) {
                rc = bad_schema(c, "JSON Schema \"$ref\" at %s must be a string",
                               pd_sbuf_str(&c->schema_path));
                goto done;
            }
            const json_t *target = pd_schema_resolve_ref(c->root, json_string_value(v), pd_sbuf_str(&c->schema_path), c->err);
            if (!target) {
                c->bad_schema = true;
                rc = c->err ? c->err->code : PD_EINVAL;
                goto done;
            }
            /* The path of the definition, so messages point at it. */
            pd_sbuf saved = c->schema_path;
            c->schema_path = (pd_sbuf){0};
            pd_sbuf_puts(&c->schema_path, json_string_value(v));
            rc = validate(c, target, doc, false);
            pd_sbuf_free(&c->schema_path);
            c->schema_path = saved;
            if (rc != PD_OK) goto done;
        } else if (strcmp(key, "properties") == 0 || strcmp(key, "required") == 0 ||
                   strcmp(key, "additionalProperties") == 0) {
            /* checked once below, for objects */
        } else if (strcmp(key, "items") == 0 || strcmp(key, "minItems") == 0 || strcmp(key, "maxItems") == 0 ||
                   strcmp(key, "prefixItems") == 0) {
        } else if (strcmp(key, "format") == 0) {
            /* refused whatever the document is, as the generator does */
            if ((rc = format_known(c, v)) != PD_OK) goto done;
        } else if (strcmp(key, "minLength") == 0 || strcmp(key, "maxLength") == 0 || strcmp(key, "pattern") == 0) {
        } else if (strcmp(key, "minimum") == 0 || strcmp(key, "maximum") == 0 ||
                   strcmp(key, "exclusiveMinimum") == 0 || strcmp(key, "exclusiveMaximum") == 0) {
        } else if (strcmp(key, "uniqueItems") == 0 && json_is_false(v)) {
            /* constrains nothing; true is refused below */
        } else if (strcmp(key, "allOf") == 0) {
            if (!json_is_array(v) || json_array_size(v) == 0) {
                rc = bad_schema(c, "JSON Schema keyword \"allOf\" at %s must be a non-empty array of schemas",
                                pd_sbuf_str(&c->schema_path));
                goto done;
            }
            if (json_array_size(v) > 1) {
                size_t mark = c->schema_path.len;
                pd_schema_path_push(&c->schema_path, key);
                rc = pd_errorf(c->err, PD_EUNSUPPORTED,
                               "unsupported JSON Schema keyword \"allOf\" with %zu subschemas at %s (only one is "
                               "supported)",
                               json_array_size(v), pd_sbuf_str(&c->schema_path));
                pd_schema_path_pop(&c->schema_path, mark);
                c->bad_schema = true;
                goto done;
            }
            if ((rc = validate_sub(c, json_array_get(v, 0), "allOf", "0", doc)) != PD_OK) goto done;
        } else {
            size_t mark = c->schema_path.len;
            pd_schema_path_push(&c->schema_path, key);
            rc = pd_schema_unsupported_keyword(c->err, key, pd_sbuf_str(&c->schema_path));
            pd_schema_path_pop(&c->schema_path, mark);
            goto done;
        }
    }
    if (json_is_object(doc)) rc = validate_object(c, schema, doc);
    else if (json_is_array(doc)) rc = validate_array(c, schema, doc);
    else if (json_is_string(doc)) rc = validate_string(c, schema, doc);
    else if (json_is_number(doc)) rc = validate_number(c, schema, doc);
done:
    c->depth--;
    if (c->doc_path.oom || c->schema_path.oom) rc = pd_errorf(c->err, PD_ENOMEM, "out of memory");
    return rc;
}

int pd_schema_validate_node(const json_t *root, const json_t *schema, const json_t *doc, bool skip_enum,
                            bool *violation, pd_error *err) {
    vctx c = {.root = root, .err = err};
    pd_sbuf_puts(&c.schema_path, "#");
    pd_sbuf_puts(&c.doc_path, "#");
    int rc = validate(&c, schema, doc, skip_enum);
    if (violation) *violation = rc == PD_EINVAL && !c.bad_schema;
    pd_sbuf_free(&c.doc_path);
    pd_sbuf_free(&c.schema_path);
    return rc;
}

int pd_json_schema_validate(const json_t *schema, const json_t *doc, pd_error *err) {
    if (!schema || !doc) return pd_errorf(err, PD_EINVAL, "pd_json_schema_validate: schema and document are required");
    return pd_schema_validate_node(schema, schema, doc, false, NULL, err);
}
