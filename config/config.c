/* config: one table describes every key (section, name, type, field, range,
 * default); parsing, validation, printing and comparison all walk it, so a
 * new key is one table row plus a struct field. */
#include "config.h"

#include <arpa/inet.h>
#include <assert.h>
#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

/* Enum fields are read and written through an int (with memcpy). */
static_assert(sizeof(pd_backend_kind) == sizeof(int), "pd_backend_kind must be int-sized");
static_assert(sizeof(pd_log_level) == sizeof(int), "pd_log_level must be int-sized");
static_assert(sizeof(pd_log_format) == sizeof(int), "pd_log_format must be int-sized");
static_assert(sizeof(pd_kv_cache_type) == sizeof(int), "pd_kv_cache_type must be int-sized");

/* A config file is a few kilobytes; anything far larger is a mistake
 * (or /dev/zero) and is refused before it is read. */
#define CONFIG_FILE_MAX (1024 * 1024)
/* How much of a user-supplied value or name to repeat back in a message. */
#define ECHO_MAX 48

typedef enum key_kind {
    KIND_INT,    /* int */
    KIND_I64,    /* int64_t */
    KIND_BOOL,   /* bool */
    KIND_ENUM,   /* an int-sized enum; choices[i] names value i */
    KIND_DOUBLE, /* double */
    KIND_STRING, /* char[PD_CONFIG_STR_CAP] */
    KIND_DEVICE, /* pd_backend_kind at offset, its int index at index_offset */
} key_kind;

typedef struct key_desc {
    const char *section;
    const char *name;
    key_kind kind;
    size_t offset;
    size_t index_offset;                      /* KIND_DEVICE */
    int64_t min, max;                         /* KIND_INT, KIND_I64 */
    const char *const *choices;               /* KIND_ENUM, NULL-terminated */
    const char *(*check_string)(const char *); /* KIND_STRING: problem or NULL */
    const char *(*check_double)(double);      /* KIND_DOUBLE: problem or NULL */
    bool secret;                              /* never repeated in messages */
    const char *default_text;                 /* parsed by pd_config_defaults */
} key_desc;

/* offsetof that refuses to compile when the field's type does not match
 * the kind the table claims (the _Generic has no other branch). */
#define FIELD(member, type) \
    (offsetof(pd_config, member) + 0 * sizeof(_Generic(((pd_config *)0)->member, type : 1)))
#define ENUM_FIELD(member) \
    (offsetof(pd_config, member) + \
     0 * sizeof(_Generic(((pd_config *)0)->member, pd_backend_kind : 1, pd_log_level : 1, \
                         pd_log_format : 1, pd_kv_cache_type : 1, pd_cluster_role_cfg : 1)))

#define INT_KEY(sec, key, lo, hi, def) \
    { .section = #sec, .name = #key, .kind = KIND_INT, .offset = FIELD(sec.key, int), \
      .min = (lo), .max = (hi), .default_text = (def) }
#define I64_KEY(sec, key, lo, hi, def) \
    { .section = #sec, .name = #key, .kind = KIND_I64, .offset = FIELD(sec.key, int64_t), \
      .min = (lo), .max = (hi), .default_text = (def) }
#define BOOL_KEY(sec, key, def) \
    { .section = #sec, .name = #key, .kind = KIND_BOOL, .offset = FIELD(sec.key, bool), \
      .default_text = (def) }
#define ENUM_KEY(sec, key, names, def) \
    { .section = #sec, .name = #key, .kind = KIND_ENUM, .offset = ENUM_FIELD(sec.key), \
      .choices = (names), .default_text = (def) }
#define DOUBLE_KEY(sec, key, check, def) \
    { .section = #sec, .name = #key, .kind = KIND_DOUBLE, .offset = FIELD(sec.key, double), \
      .check_double = (check), .default_text = (def) }
#define DEVICE_KEY(sec, key, def) \
    { .section = #sec, .name = #key, .kind = KIND_DEVICE, .offset = FIELD(sec.key, pd_backend_kind), \
      .index_offset = FIELD(sec.key##_index, int), .default_text = (def) }
#define STRING_KEY(sec, key, check, is_secret, def) \
    { .section = #sec, .name = #key, .kind = KIND_STRING, .offset = FIELD(sec.key, char *), \
      .check_string = (check), .secret = (is_secret), .default_text = (def) }

static const char *const backend_names[] = {"cpu", "cuda", "auto", NULL};
/* model.device: the forms and the wording of pd_device_parse (kernels/device.c). */
#define DEVICE_INDEX_MAX 255
#define DEVICE_FORMS "cpu, cuda, cuda:N (N = 0..255) or auto"

/* Keys that were removed, and what to write instead: an old config gets
 * this rather than "unknown key". */
typedef struct retired_key {
    const char *section, *name, *advice;
} retired_key;
static const retired_key retired_keys[] = {
    {"model", "backend", "model.backend was replaced by model.device (cpu, cuda, cuda:N or auto)"},
    {"model", "gpu_device",
     "model.gpu_device was replaced by model.device (cpu, cuda, cuda:N or auto): write "
     "device = cuda:N"},
};
static const char *const log_level_names[] = {"error", "warn", "info", "debug", NULL};
static const char *const kv_type_names[] = {"f16", "f32", NULL};
static const char *const log_format_names[] = {"text", "json", "journal", NULL};
static const char *const cluster_role_names[] = {"member", "publisher", "consumer", NULL};

static const char *check_address(const char *s);
static const char *check_secret(const char *s);
static const char *check_not_empty(const char *s);
static const char *check_model_names(const char *s);
static const char *check_cors_origins(const char *s);
static const char *check_policy_spec(const char *s);
static const char *check_quality_budget(double v);
static const char *check_redis_url(const char *s);
static const char *check_key_prefix(const char *s);

/* Order here is the order of pd_config_print() and of the docs. Keys of one
 * section must be contiguous. */
static const key_desc keys[] = {
    STRING_KEY(server, listen, check_address, false, "127.0.0.1"),
    INT_KEY(server, port, 1, 65535, "8080"),
    INT_KEY(server, threads, 0, 1024, "0"),
    I64_KEY(server, max_body_bytes, 1024, INT64_C(1) << 30, "8388608"),
    INT_KEY(server, request_timeout_s, 0, 86400, "600"),
    INT_KEY(server, idle_timeout_s, 1, 3600, "15"),
    INT_KEY(server, max_connections, 16, 1000000, "4096"),
    INT_KEY(server, max_connections_per_client, 0, 1000000, "0"),
    INT_KEY(server, shutdown_grace_s, 0, 3600, "30"),
    STRING_KEY(server, api_key, check_secret, true, ""),
    STRING_KEY(server, api_keys_file, NULL, false, ""),
    STRING_KEY(server, model_names, check_model_names, false, ""),
    STRING_KEY(server, cors_origins, check_cors_origins, false, ""),
    BOOL_KEY(server, metrics, "true"),
    BOOL_KEY(server, metrics_auth, "false"),

    STRING_KEY(admin, token, check_secret, true, ""),
    STRING_KEY(admin, listen, check_address, false, "127.0.0.1"),
    INT_KEY(admin, port, 0, 65535, "0"),

    STRING_KEY(model, path, check_not_empty, false, "models/default.gguf"),
    INT_KEY(model, n_ctx, 0, 16777216, "0"),
    DEVICE_KEY(model, device, "auto"),
    INT_KEY(model, n_threads, 0, 1024, "0"),
    ENUM_KEY(model, kv_type, kv_type_names, "f16"),
    BOOL_KEY(model, mmap, "false"),
    BOOL_KEY(model, cuda_graphs, "true"),

    STRING_KEY(cache, path, check_not_empty, false, "var/prefixd"),
    I64_KEY(cache, map_size_mb, 16, INT64_C(16777216), "4096"),
    I64_KEY(cache, hot_tier_mb, 0, INT64_C(16777216), "256"),
    I64_KEY(cache, auto_mb, 0, INT64_C(16777216), "256"),
    BOOL_KEY(cache, auto_persist, "false"),
    INT_KEY(cache, page_tokens, 1, 4096, "64"),

    STRING_KEY(compression, policy, check_policy_spec, false, "compactor:retention=0.25"),
    INT_KEY(compression, min_prefix_tokens, 0, 16777216, "256"),
    DOUBLE_KEY(compression, quality_budget, check_quality_budget, "0"),

    INT_KEY(scheduler, max_batch, 1, 1024, "16"),
    INT_KEY(scheduler, max_queue, 0, 1048576, "256"),

    STRING_KEY(cluster, redis_url, check_redis_url, true, ""),
    STRING_KEY(cluster, password, check_secret, true, ""),
    ENUM_KEY(cluster, role, cluster_role_names, "member"),
    STRING_KEY(cluster, key_prefix, check_key_prefix, false, "prefixd:"),
    INT_KEY(cluster, timeout_ms, 10, 60000, "250"),
    INT_KEY(cluster, chunk_mb, 1, 512, "64"),

    ENUM_KEY(log, level, log_level_names, "info"),
    ENUM_KEY(log, format, log_format_names, "text"),
};

enum { KEY_COUNT = sizeof keys / sizeof keys[0] };

/* ------------------------------------------------------------------------
 * Small helpers
 * ------------------------------------------------------------------------ */

static void *field_of(pd_config *c, const key_desc *k) { return (char *)c + k->offset; }
static const void *cfield_of(const pd_config *c, const key_desc *k) {
    return (const char *)c + k->offset;
}

/* Copy user text into buf for a message: non-printable bytes become '?'
 * (no terminal escapes from a config file), long text is cut with "...". */
static void echo_text(const char *s, size_t len, char *buf, size_t cap) {
    size_t n = 0;
    for (size_t i = 0; i < len && n + 4 < cap; i++) {
        if (i == ECHO_MAX) {
            memcpy(buf + n, "...", 3);
            n += 3;
            break;
        }
        unsigned char ch = (unsigned char)s[i];
        buf[n++] = (ch >= 0x20 && ch < 0x7f) ? (char)ch : '?';
    }
    buf[n] = '\0';
}

/* How a value appears in a message: secrets hidden, strings quoted. */
static void show_value(const key_desc *k, const char *value, char *buf, size_t cap) {
    if (k->secret) {
        snprintf(buf, cap, "(hidden)");
        return;
    }
    char echoed[ECHO_MAX + 8];
    echo_text(value, strlen(value), echoed, sizeof echoed);
    if (k->kind == KIND_STRING) snprintf(buf, cap, "'%s'", echoed);
    else snprintf(buf, cap, "%s", echoed);
}

/* "<where>: <problem>", or just the problem when where is NULL. */
__attribute__((format(printf, 4, 5))) static int located_error(pd_error *err, int code,
                                                               const char *where,
                                                               const char *fmt, ...) {
    char problem[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(problem, sizeof problem, fmt, ap);
    va_end(ap);
    if (where) return pd_errorf(err, code, "%s: %s", where, problem);
    return pd_errorf(err, code, "%s", problem);
}

/* "<where>: section.key = value <problem>". */
__attribute__((format(printf, 5, 6))) static int value_error(pd_error *err, const char *where,
                                                             const key_desc *k,
                                                             const char *value,
                                                             const char *fmt, ...) {
    char problem[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(problem, sizeof problem, fmt, ap);
    va_end(ap);
    char shown[ECHO_MAX + 16];
    show_value(k, value, shown, sizeof shown);
    return located_error(err, PD_EINVAL, where, "%s.%s = %s %s", k->section, k->name, shown,
                         problem);
}

static bool section_exists(const char *section) {
    for (size_t i = 0; i < KEY_COUNT; i++)
        if (strcmp(keys[i].section, section) == 0) return true;
    return false;
}

static const key_desc *find_key(const char *section, const char *name) {
    for (size_t i = 0; i < KEY_COUNT; i++)
        if (strcmp(keys[i].section, section) == 0 && strcmp(keys[i].name, name) == 0)
            return &keys[i];
    return NULL;
}

/* "server, admin, ..." */
static void list_sections(char *buf, size_t cap) {
    size_t n = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < KEY_COUNT; i++) {
        if (i > 0 && strcmp(keys[i].section, keys[i - 1].section) == 0) continue;
        int w = snprintf(buf + n, cap - n, "%s%s", n ? ", " : "", keys[i].section);
        if (w < 0 || (size_t)w >= cap - n) return;
        n += (size_t)w;
    }
}

/* "listen, port, ..." for one section. */
static void list_keys(const char *section, char *buf, size_t cap) {
    size_t n = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < KEY_COUNT; i++) {
        if (strcmp(keys[i].section, section) != 0) continue;
        int w = snprintf(buf + n, cap - n, "%s%s", n ? ", " : "", keys[i].name);
        if (w < 0 || (size_t)w >= cap - n) return;
        n += (size_t)w;
    }
}

static int unknown_section_error(pd_error *err, const char *where, const char *section) {
    char shown[ECHO_MAX + 8], valid[200];
    echo_text(section, strlen(section), shown, sizeof shown);
    list_sections(valid, sizeof valid);
    return located_error(err, PD_EINVAL, where, "unknown section [%s]; valid sections: %s",
                         shown, valid);
}

static int unknown_key_error(pd_error *err, const char *where, const char *section,
                             const char *name) {
    for (size_t i = 0; i < sizeof retired_keys / sizeof retired_keys[0]; i++)
        if (strcmp(retired_keys[i].section, section) == 0 && strcmp(retired_keys[i].name, name) == 0)
            return located_error(err, PD_EINVAL, where, "%s", retired_keys[i].advice);
    char shown[ECHO_MAX + 8], valid[200];
    echo_text(name, strlen(name), shown, sizeof shown);
    list_keys(section, valid, sizeof valid);
    return located_error(err, PD_EINVAL, where, "unknown key %s.%s; valid keys in [%s]: %s",
                         section, shown, section, valid);
}

/* ------------------------------------------------------------------------
 * Value parsing: text -> typed field, with the checks every key shares
 * ------------------------------------------------------------------------ */

typedef enum num_parse { NUM_OK, NUM_NOT_A_NUMBER, NUM_OVERFLOW } num_parse;

static num_parse parse_int64(const char *s, int64_t *out) {
    /* strtoll would skip leading spaces and accept an empty string as 0. */
    if (*s == '\0' || isspace((unsigned char)*s)) return NUM_NOT_A_NUMBER;
    errno = 0;
    char *end;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end != '\0') return NUM_NOT_A_NUMBER;
    if (errno == ERANGE) return NUM_OVERFLOW;
    *out = (int64_t)v;
    return NUM_OK;
}

static num_parse parse_double(const char *s, double *out) {
    /* Plain decimal only: strtod would also take "nan", "inf" and hex. */
    if (*s == '\0' || strspn(s, "0123456789.eE+-") != strlen(s)) return NUM_NOT_A_NUMBER;
    errno = 0;
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end != '\0') return NUM_NOT_A_NUMBER;
    if (errno == ERANGE && fabs(v) > 1.0) return NUM_OVERFLOW; /* underflow is ~0, fine */
    if (!isfinite(v)) return NUM_OVERFLOW;
    *out = v;
    return NUM_OK;
}

static bool parse_bool(const char *s, bool *out) {
    static const char *const truthy[] = {"true", "yes", "on", "1"};
    static const char *const falsy[] = {"false", "no", "off", "0"};
    for (size_t i = 0; i < 4; i++) {
        if (strcasecmp(s, truthy[i]) == 0 || strcasecmp(s, falsy[i]) == 0) {
            *out = strcasecmp(s, truthy[i]) == 0;
            return true;
        }
    }
    return false;
}

/* ';' or '#' at the start of a value or after whitespace would be read back
 * as a comment, so such a value could not survive pd_config_print(). */
static bool has_comment_hazard(const char *s) {
    for (size_t i = 0; s[i]; i++)
        if ((s[i] == ';' || s[i] == '#') && (i == 0 || isspace((unsigned char)s[i - 1])))
            return true;
    return false;
}

static bool has_control_char(const char *s) {
    for (; *s; s++)
        if ((unsigned char)*s < 0x20 || (unsigned char)*s == 0x7f) return true;
    return false;
}

static void choices_text(const char *const *choices, char *buf, size_t cap) {
    size_t n = 0;
    buf[0] = '\0';
    for (size_t i = 0; choices[i]; i++) {
        int w = snprintf(buf + n, cap - n, "%s%s", i ? ", " : "", choices[i]);
        if (w < 0 || (size_t)w >= cap - n) return;
        n += (size_t)w;
    }
}

/* "cpu", "auto", "cuda" or "cuda:N" (case-insensitive, N decimal 0..255,
 * no sign or spaces), as pd_device_parse reads them. */
static bool parse_device(const char *s, pd_backend_kind *kind, int *index) {
    *index = 0;
    if (strcasecmp(s, "cpu") == 0) *kind = PD_BACKEND_CPU;
    else if (strcasecmp(s, "auto") == 0) *kind = PD_BACKEND_AUTO;
    else if (strcasecmp(s, "cuda") == 0) *kind = PD_BACKEND_CUDA;
    else if (strncasecmp(s, "cuda:", 5) == 0) {
        const char *digits = s + 5;
        size_t len = strlen(digits);
        if (len == 0 || len > 3 || strspn(digits, "0123456789") != len) return false;
        int v = 0;
        for (size_t i = 0; i < len; i++) v = v * 10 + (digits[i] - '0');
        if (v > DEVICE_INDEX_MAX) return false;
        *kind = PD_BACKEND_CUDA;
        *index = v;
    } else return false;
    return true;
}

/* Parse `value` for key k and store it in c. On failure c is untouched and
 * err says "<where>: section.key = value <problem>". */
static int apply_value(pd_config *c, const key_desc *k, const char *value, const char *where,
                       pd_error *err) {
    void *field = field_of(c, k);
    switch (k->kind) {
    case KIND_INT:
    case KIND_I64: {
        int64_t v = 0;
        num_parse r = parse_int64(value, &v);
        if (r == NUM_NOT_A_NUMBER) return value_error(err, where, k, value, "is not an integer");
        if (r == NUM_OVERFLOW || v < k->min || v > k->max)
            return value_error(err, where, k, value, "is out of range (%" PRId64 "..%" PRId64 ")",
                               k->min, k->max);
        if (k->kind == KIND_INT) *(int *)field = (int)v;
        else *(int64_t *)field = v;
        return PD_OK;
    }
    case KIND_BOOL: {
        bool v;
        if (!parse_bool(value, &v))
            return value_error(err, where, k, value,
                               "is not a boolean (true/false, yes/no, on/off, 1/0)");
        *(bool *)field = v;
        return PD_OK;
    }
    case KIND_ENUM:
        for (int i = 0; k->choices[i]; i++) {
            if (strcasecmp(value, k->choices[i]) == 0) {
                memcpy(field, &i, sizeof i);
                return PD_OK;
            }
        }
        {
            char valid[128];
            choices_text(k->choices, valid, sizeof valid);
            return value_error(err, where, k, value, "is not one of %s", valid);
        }
    case KIND_DOUBLE: {
        double v = 0;
        num_parse r = parse_double(value, &v);
        if (r == NUM_NOT_A_NUMBER) return value_error(err, where, k, value, "is not a number");
        const char *problem = r == NUM_OVERFLOW ? "is out of range" : NULL;
        if (!problem && k->check_double) problem = k->check_double(v);
        if (problem) return value_error(err, where, k, value, "%s", problem);
        *(double *)field = v;
        return PD_OK;
    }
    case KIND_DEVICE: {
        pd_backend_kind kind;
        int index;
        if (!parse_device(value, &kind, &index))
            return value_error(err, where, k, value, "is not one of " DEVICE_FORMS);
        memcpy(field, &kind, sizeof kind);
        memcpy((char *)c + k->index_offset, &index, sizeof index);
        return PD_OK;
    }
    case KIND_STRING: {
        /* `name = value` must fit one config line, so printing round-trips. */
        size_t len = strlen(value), max = PD_CONFIG_LINE_MAX - strlen(k->name) - 3;
        if (len > max)
            return value_error(err, where, k, value,
                               "is too long (%zu characters; at most %zu for this key)", len, max);
        if (has_control_char(value))
            return value_error(err, where, k, value, "contains a control character");
        if (len > 0 && (isspace((unsigned char)value[0]) ||
                        isspace((unsigned char)value[len - 1])))
            return value_error(err, where, k, value, "has leading or trailing whitespace");
        if (has_comment_hazard(value))
            return value_error(err, where, k, value,
                               "has ';' or '#' at its start or after a space, which a config "
                               "file reads as a comment");
        const char *problem = k->check_string ? k->check_string(value) : NULL;
        if (problem) return value_error(err, where, k, value, "%s", problem);
        memset(field, 0, PD_CONFIG_STR_CAP);
        memcpy(field, value, len);
        return PD_OK;
    }
    }
    return pd_errorf(err, PD_EINVAL, "%s.%s: internal error: unknown kind", k->section, k->name);
}

/* Shortest decimal that reads back as exactly v (at least 6 digits, so
 * 10 prints as "10", not "1e+01"). */
static void format_double(double v, char *buf, size_t cap) {
    for (int prec = 6; prec <= 17; prec++) {
        snprintf(buf, cap, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) return;
    }
}

/* The text that apply_value() turns back into this field's value. */
static void format_value(const pd_config *c, const key_desc *k, char *buf, size_t cap) {
    const void *field = cfield_of(c, k);
    switch (k->kind) {
    case KIND_INT: snprintf(buf, cap, "%d", *(const int *)field); return;
    case KIND_I64: snprintf(buf, cap, "%" PRId64, *(const int64_t *)field); return;
    case KIND_BOOL: snprintf(buf, cap, "%s", *(const bool *)field ? "true" : "false"); return;
    case KIND_ENUM: {
        int v;
        memcpy(&v, field, sizeof v);
        int n = 0;
        while (k->choices[n]) n++;
        if (v >= 0 && v < n) snprintf(buf, cap, "%s", k->choices[v]);
        else snprintf(buf, cap, "%d", v); /* invalid; validation names it */
        return;
    }
    case KIND_DOUBLE: format_double(*(const double *)field, buf, cap); return;
    case KIND_STRING: snprintf(buf, cap, "%.*s", PD_CONFIG_STR_CAP - 1, (const char *)field); return;
    case KIND_DEVICE: {
        int kind, index;
        memcpy(&kind, field, sizeof kind);
        memcpy(&index, (const char *)c + k->index_offset, sizeof index);
        /* Invalid values print as something the parser refuses, so
         * validation names them. */
        if (kind == PD_BACKEND_CUDA) snprintf(buf, cap, "cuda:%d", index);
        else if (kind == PD_BACKEND_CPU || kind == PD_BACKEND_AUTO)
            snprintf(buf, cap, "%s", backend_names[kind]);
        else snprintf(buf, cap, "%d", kind);
        return;
    }
    }
    buf[0] = '\0';
}

/* ------------------------------------------------------------------------
 * Per-key rules beyond type and range
 * ------------------------------------------------------------------------ */

static bool is_hostname(const char *s) {
    size_t len = strlen(s);
    if (len == 0 || len > 253) return false;
    size_t label = 0;
    for (size_t i = 0; i <= len; i++) {
        char ch = s[i];
        if (ch == '.' || ch == '\0') {
            if (label == 0 || label > 63 || s[i - 1] == '-') return false;
            label = 0;
        } else if (isalnum((unsigned char)ch) || (ch == '-' && label > 0)) {
            label++;
        } else {
            return false;
        }
    }
    const char *last = strrchr(s, '.');
    last = last ? last + 1 : s;
    return strspn(last, "0123456789") != strlen(last); /* 256.1.1.1 is no host name */
}

static const char *check_address(const char *s) {
    unsigned char addr[16];
    if (*s == '\0') return "must not be empty";
    if (inet_pton(AF_INET, s, addr) == 1 || inet_pton(AF_INET6, s, addr) == 1) return NULL;
    if (is_hostname(s)) return NULL;
    return "is not an IP address or host name (write IPv6 addresses without brackets)";
}

static const char *check_secret(const char *s) {
    for (; *s; s++)
        if ((unsigned char)*s <= 0x20 || (unsigned char)*s >= 0x7f)
            return "must be printable ASCII without spaces";
    return NULL;
}

/* Comma-separated names, each 1..127 printable ASCII bytes without spaces
 * (what fits pd_server_backend.model_id). */
static const char *check_model_names(const char *s) {
    if (!*s) return NULL;
    for (const char *p = s;;) {
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == 0) return "has an empty name (write NAME or NAME1,NAME2 without spaces)";
        if (n > 127) return "has a name longer than 127 bytes";
        for (size_t i = 0; i < n; i++)
            if ((unsigned char)p[i] <= 0x20 || (unsigned char)p[i] >= 0x7f)
                return "must be printable ASCII names without spaces, separated by commas";
        if (!end) break;
        p = end + 1;
    }
    return NULL;
}

/* "*" or comma-separated origins as browsers send them in Origin:
 * scheme://host[:port], no path and no trailing slash (the Origin header
 * never has one, so such an entry would silently match nothing). */
static const char *check_cors_origins(const char *s) {
    if (!*s) return NULL;
    for (const char *p = s;;) {
        const char *end = strchr(p, ',');
        const size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == 0) return "has an empty origin (write * or https://app.example,http://localhost:3000 without spaces)";
        for (size_t i = 0; i < n; i++)
            if ((unsigned char)p[i] <= 0x20 || (unsigned char)p[i] >= 0x7f)
                return "must be * or origins in printable ASCII without spaces, separated by commas";
        if (!(n == 1 && p[0] == '*')) {
            size_t scheme = 0;
            while (scheme < n && (isalnum((unsigned char)p[scheme]) || strchr("+.-", p[scheme]))) scheme++;
            if (scheme == 0 || !isalpha((unsigned char)p[0]) || n < scheme + 4 || memcmp(p + scheme, "://", 3) != 0)
                return "has an entry that is not an origin: write scheme://host[:port], e.g. https://app.example";
            if (memchr(p + scheme + 3, '/', n - scheme - 3) || memchr(p, '?', n) || memchr(p, '#', n))
                return "has an origin with a path: write scheme://host[:port] without a trailing slash";
        }
        if (!end) break;
        p = end + 1;
    }
    return NULL;
}

static const char *check_not_empty(const char *s) {
    return *s ? NULL : "must not be empty";
}

/* name[:key=value[,key=value...]]; the policies folder owns the meaning,
 * this only catches typos early. */
static const char *check_policy_spec(const char *s) {
    static const char *const problem =
        "is not a policy spec (name or name:key=value,..., e.g. compactor:retention=0.25)";
    static const char word[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-";
    static const char number[] =
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.+";
    size_t n = strspn(s, word);
    if (n == 0) return problem;
    s += n;
    if (*s == '\0') return NULL;
    if (*s++ != ':') return problem;
    for (;;) {
        n = strspn(s, word);
        if (n == 0 || s[n] != '=') return problem;
        s += n + 1;
        n = strspn(s, number);
        if (n == 0) return problem;
        s += n;
        if (*s == '\0') return NULL;
        if (*s++ != ',') return problem;
    }
}

/* The forms cluster/ parses (it checks the details when it starts); the URL
 * may hold a password, so it is a secret and never echoed. */
static const char *check_redis_url(const char *s) {
    if (!*s) return NULL;
    for (const char *p = s; *p; p++)
        if ((unsigned char)*p <= 0x20 || (unsigned char)*p >= 0x7f) return "must be printable ASCII without spaces";
    if (strncmp(s, "rediss://", 9) == 0)
        return "uses TLS (rediss://), which this build's hiredis lacks: run the TLS tunnel "
               "deploy/cluster/redis-tls-tunnel.cfg on the node and write redis://127.0.0.1:PORT";
    if (strncmp(s, "redis://", 8) == 0 && s[8] && s[8] != '/') return NULL;
    if (strncmp(s, "unix:///", 8) == 0) return NULL;
    return "must be redis://[[USER]:PASSWORD@]HOST[:PORT][/DB] or unix:///PATH[?db=DB]";
}

static const char *check_key_prefix(const char *s) {
    if (!*s) return "must not be empty (nodes of one cluster share it; e.g. prefixd:)";
    if (strlen(s) > 100) return "is longer than 100 bytes";
    for (; *s; s++)
        if ((unsigned char)*s <= 0x20 || (unsigned char)*s >= 0x7f) return "must be printable ASCII without spaces";
    return NULL;
}

/* pd_calib_tau_valid's rule (policies.h; config depends on util only). */
static const char *check_quality_budget(double v) {
    if (v == 0.0 || (v > 1.0 && v <= 10.0)) return NULL;
    return "is out of range (0 = off, or above 1 and at most 10)";
}

/* ------------------------------------------------------------------------
 * Defaults, comparison, names
 * ------------------------------------------------------------------------ */

void pd_config_defaults(pd_config *c) {
    memset(c, 0, sizeof *c);
    for (size_t i = 0; i < KEY_COUNT; i++) {
        int rc = apply_value(c, &keys[i], keys[i].default_text, NULL, NULL);
        assert(rc == PD_OK && "a default in the key table does not validate");
        (void)rc;
    }
}

bool pd_config_equal(const pd_config *a, const pd_config *b) {
    for (size_t i = 0; i < KEY_COUNT; i++) {
        const key_desc *k = &keys[i];
        const void *fa = cfield_of(a, k), *fb = cfield_of(b, k);
        bool same;
        switch (k->kind) {
        case KIND_INT: same = *(const int *)fa == *(const int *)fb; break;
        case KIND_I64: same = *(const int64_t *)fa == *(const int64_t *)fb; break;
        case KIND_BOOL: same = *(const bool *)fa == *(const bool *)fb; break;
        case KIND_ENUM: same = memcmp(fa, fb, sizeof(int)) == 0; break;
        case KIND_DOUBLE: same = *(const double *)fa == *(const double *)fb; break;
        case KIND_STRING: same = strncmp(fa, fb, PD_CONFIG_STR_CAP) == 0; break;
        case KIND_DEVICE: {
            /* As printed: the index only counts for cuda. */
            char ta[32], tb[32]; /* room for invalid values too ("cuda:-2147483648") */
            format_value(a, k, ta, sizeof ta);
            format_value(b, k, tb, sizeof tb);
            same = strcmp(ta, tb) == 0;
            break;
        }
        default: same = false; break;
        }
        if (!same) return false;
    }
    return true;
}

const char *pd_backend_kind_name(pd_backend_kind b) {
    return (unsigned)b < 3 ? backend_names[b] : "unknown";
}
void pd_config_device_text(const pd_config *c, char *buf, size_t cap) {
    const key_desc *k = find_key("model", "device");
    if (k && k->kind == KIND_DEVICE) format_value(c, k, buf, cap);
    else if (cap) buf[0] = '\0';
}
const char *pd_kv_cache_type_name(pd_kv_cache_type t) {
    return (unsigned)t < 2 ? kv_type_names[t] : "unknown";
}
const char *pd_log_level_name(pd_log_level l) {
    return (unsigned)l < 4 ? log_level_names[l] : "unknown";
}
const char *pd_log_format_name(pd_log_format f) {
    return (unsigned)f < 3 ? log_format_names[f] : "unknown";
}

/* ------------------------------------------------------------------------
 * INI parsing
 *
 * inih calls our reader for each line and our handler for each key, in
 * order, so the reader's line counter is the line of the key being handled.
 * The reader also refuses what inih would get wrong silently: over-long
 * lines (split in two) and unknown empty sections (never reported).
 * ------------------------------------------------------------------------ */

typedef struct parse_ctx {
    pd_config *cfg; /* the working copy; committed only on success */
    const char *origin;
    const char *text;
    size_t pos;
    int line;                 /* line most recently handed to inih */
    bool line_indented;       /* it starts with whitespace */
    int last_key;             /* index of the last key handled, -1 if none */
    int seen_line[KEY_COUNT]; /* line where each key was set, 0 if not yet */
    int fail_line;            /* 0 while all is well */
    pd_error error;           /* the first failure, copied out at the end */
} parse_ctx;

static void where_line(const parse_ctx *ctx, int line, char *buf, size_t cap) {
    snprintf(buf, cap, "%s:%d", ctx->origin, line);
}

/* The section name inih will see on a "[name]" line, or false when the
 * line is not a complete section header (inih then reports the syntax). */
static bool header_name(const char *line, char *name, size_t cap) {
    while (isspace((unsigned char)*line)) line++;
    if (*line != '[') return false;
    const char *start = ++line;
    bool was_space = false;
    /* Same scan as inih: stop at ']' or at an inline comment. */
    while (*line && *line != ']' && !(was_space && *line == ';')) {
        was_space = isspace((unsigned char)*line);
        line++;
    }
    if (*line != ']') return false;
    size_t len = (size_t)(line - start);
    if (len >= cap) len = cap - 1;
    memcpy(name, start, len);
    name[len] = '\0';
    return true;
}

static char *read_line(char *buf, int cap, void *stream) {
    parse_ctx *ctx = stream;
    if (ctx->fail_line || ctx->text[ctx->pos] == '\0' || cap < 3) return NULL;
    const char *start = ctx->text + ctx->pos;
    const char *nl = strchr(start, '\n');
    size_t len = nl ? (size_t)(nl - start) + 1 : strlen(start);
    size_t content = len;
    if (content && start[content - 1] == '\n') content--;
    if (content && start[content - 1] == '\r') content--;
    int line = ++ctx->line;
    char where[300];
    where_line(ctx, line, where, sizeof where);

    size_t limit = PD_CONFIG_LINE_MAX;
    if ((size_t)cap - 3 < limit) limit = (size_t)cap - 3; /* a smaller inih build */
    if (content > limit) {
        located_error(&ctx->error, PD_EINVAL, where,
                      "line is %zu characters long; the limit is %zu", content, limit);
        ctx->fail_line = line;
        return NULL;
    }
    memcpy(buf, start, len);
    buf[len] = '\0';
    ctx->pos += len;
    ctx->line_indented = *start == ' ' || *start == '\t';

    char section[PD_CONFIG_STR_CAP];
    if (header_name(buf, section, sizeof section) && !section_exists(section)) {
        unknown_section_error(&ctx->error, where, section);
        ctx->fail_line = line;
        return NULL;
    }
    return buf;
}

/* Check one key from inih and store its value; on failure record the
 * error and stop the parse (the reader returns NULL from then on). */
static int on_key(void *user, const char *section, const char *name, const char *value) {
    parse_ctx *ctx = user;
    if (ctx->fail_line) return 0;
    int line = ctx->line;
    char where[300];
    where_line(ctx, line, where, sizeof where);
    pd_error *err = &ctx->error;
    const key_desc *k = NULL;
    int index = -1;

    if (*section == '\0') {
        char shown[ECHO_MAX + 8], valid[200];
        echo_text(name, strlen(name), shown, sizeof shown);
        list_sections(valid, sizeof valid);
        located_error(err, PD_EINVAL, where,
                      "key %s is not inside a section; put it under one of: %s", shown, valid);
    } else if (!section_exists(section)) {
        unknown_section_error(err, where, section);
    } else if (!(k = find_key(section, name))) {
        unknown_key_error(err, where, section, name);
    } else if ((index = (int)(k - keys)) == ctx->last_key && ctx->line_indented) {
        /* inih reads an indented line as more of the previous value. */
        located_error(err, PD_EINVAL, where,
                      "indented line continues the value of %s.%s, and multi-line values are "
                      "not supported; remove the indentation",
                      k->section, k->name);
    } else if (ctx->seen_line[index]) {
        located_error(err, PD_EINVAL, where, "%s.%s is set twice (first on line %d)",
                      k->section, k->name, ctx->seen_line[index]);
    } else if (apply_value(ctx->cfg, k, value, where, err) == PD_OK) {
        ctx->seen_line[index] = line;
        ctx->last_key = index;
        return 1;
    }
    ctx->fail_line = line;
    return 0;
}

/* Describe a line inih rejected without calling us (no '=', no ']'). */
static int syntax_error(const char *text, const char *origin, int line, pd_error *err) {
    const char *s = text;
    for (int i = 1; i < line && s; i++) {
        s = strchr(s, '\n');
        if (s) s++;
    }
    while (s && (*s == ' ' || *s == '\t')) s++;
    if (s && *s == '[')
        return pd_errorf(err, PD_EINVAL, "%s:%d: section header has no closing ']'", origin,
                         line);
    return pd_errorf(err, PD_EINVAL,
                     "%s:%d: expected 'key = value', '[section]' or a comment", origin, line);
}

int pd_config_load_string(pd_config *c, const char *text, const char *origin, pd_error *err) {
    if (!origin) origin = "<string>";
    pd_config work = *c;
    parse_ctx ctx = {.cfg = &work, .origin = origin, .text = text, .last_key = -1};
    int rc = ini_parse_stream(read_line, &ctx, on_key, &ctx);
    /* inih reports the first bad line, ours or its own (a syntax error). */
    if (rc > 0 && (!ctx.fail_line || rc < ctx.fail_line))
        return syntax_error(text, origin, rc, err);
    if (ctx.fail_line) {
        if (err) *err = ctx.error;
        return ctx.error.code;
    }
    if (rc != 0) return pd_errorf(err, PD_EFORMAT, "%s: the INI parser failed (%d)", origin, rc);
    *c = work;
    return PD_OK;
}

int pd_config_load_file(pd_config *c, const char *path, pd_error *err) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return pd_errorf(err, PD_EIO, "cannot open config file '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0) {
        int e = errno;
        fclose(f);
        return pd_errorf(err, PD_EIO, "cannot stat config file '%s': %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        fclose(f);
        return pd_errorf(err, PD_EINVAL, "config file '%s' is not a regular file", path);
    }
    if (st.st_size > CONFIG_FILE_MAX) {
        fclose(f);
        return pd_errorf(err, PD_EINVAL, "config file '%s' is %lld bytes; the limit is %d", path,
                         (long long)st.st_size, CONFIG_FILE_MAX);
    }
    char *text = NULL;
    size_t len = 0;
    int rc = pd_read_stream(f, &text, &len, err);
    fclose(f);
    if (rc != PD_OK) {
        pd_error_prefix(err, "config file '%s'", path);
        return rc;
    }
    size_t text_len = strlen(text);
    if (text_len < len) {
        int line = 1;
        for (size_t i = 0; i < text_len; i++) line += text[i] == '\n';
        free(text);
        return pd_errorf(err, PD_EINVAL, "%s:%d: contains a NUL byte", path, line);
    }
    rc = pd_config_load_string(c, text, path, err);
    free(text);
    return rc;
}

/* ------------------------------------------------------------------------
 * --set overrides
 * ------------------------------------------------------------------------ */

/* [start, end) without surrounding whitespace. */
static void trim_span(const char **start, const char **end) {
    while (*start < *end && isspace((unsigned char)**start)) (*start)++;
    while (*end > *start && isspace((unsigned char)(*end)[-1])) (*end)--;
}

int pd_config_set(pd_config *c, const char *assignment, pd_error *err) {
    const char *where = "--set";
    const char *eq = strchr(assignment, '=');
    const char *dot = eq ? memchr(assignment, '.', (size_t)(eq - assignment)) : NULL;
    if (!eq || !dot) {
        char shown[ECHO_MAX + 8];
        echo_text(assignment, eq ? (size_t)(eq - assignment) : strlen(assignment), shown,
                  sizeof shown);
        return located_error(err, PD_EINVAL, where, "expected section.key=value, got '%s%s'",
                             shown, eq ? "=..." : "");
    }
    const char *sec_start = assignment, *sec_end = dot;
    const char *key_start = dot + 1, *key_end = eq;
    const char *val_start = eq + 1, *val_end = eq + 1 + strlen(eq + 1);
    trim_span(&sec_start, &sec_end);
    trim_span(&key_start, &key_end);
    trim_span(&val_start, &val_end);

    char section[64], name[64];
    size_t sec_len = (size_t)(sec_end - sec_start), key_len = (size_t)(key_end - key_start);
    echo_text(sec_start, sec_len, section, sizeof section);
    echo_text(key_start, key_len, name, sizeof name);
    /* Echoed names are cut or altered only when they cannot be valid anyway. */
    if (sec_len >= sizeof section || !section_exists(section) || strlen(section) != sec_len)
        return unknown_section_error(err, where, section);
    const key_desc *k = key_len < sizeof name ? find_key(section, name) : NULL;
    if (!k || strlen(name) != key_len) return unknown_key_error(err, where, section, name);

    size_t val_len = (size_t)(val_end - val_start);
    if (val_len > PD_CONFIG_LINE_MAX)
        return located_error(err, PD_EINVAL, where, "%s.%s is too long (%zu characters)",
                             k->section, k->name, val_len);
    char value[PD_CONFIG_LINE_MAX + 1];
    memcpy(value, val_start, val_len);
    value[val_len] = '\0';
    if (strlen(value) != val_len) /* cannot happen: the input is a C string */
        return located_error(err, PD_EINVAL, where, "%s.%s contains a NUL byte", k->section,
                             k->name);

    pd_config work = *c;
    int rc = apply_value(&work, k, value, where, err);
    if (rc != PD_OK) return rc;
    *c = work;
    return PD_OK;
}

/* ------------------------------------------------------------------------
 * Validation and printing
 * ------------------------------------------------------------------------ */

static bool is_wildcard(const char *addr) {
    unsigned char bytes[16] = {0};
    size_t n;
    if (inet_pton(AF_INET, addr, bytes) == 1) n = 4;
    else if (inet_pton(AF_INET6, addr, bytes) == 1) n = 16;
    else return false;
    for (size_t i = 0; i < n; i++)
        if (bytes[i]) return false;
    return true;
}

int pd_config_validate(const pd_config *c, pd_error *err) {
    /* Every value again, through the same parser, so a config built in
     * code meets the same rules as one read from a file. */
    pd_config scratch = *c;
    for (size_t i = 0; i < KEY_COUNT; i++) {
        const key_desc *k = &keys[i];
        if (k->kind == KIND_STRING && !memchr(cfield_of(c, k), '\0', PD_CONFIG_STR_CAP))
            return pd_errorf(err, PD_EINVAL, "%s.%s is not NUL-terminated", k->section, k->name);
        char text[PD_CONFIG_STR_CAP];
        format_value(c, k, text, sizeof text);
        int rc = apply_value(&scratch, k, text, NULL, err);
        if (rc != PD_OK) return rc;
    }

    if (c->admin.port != 0 && c->admin.port == c->server.port &&
        (strcmp(c->admin.listen, c->server.listen) == 0 || is_wildcard(c->admin.listen) ||
         is_wildcard(c->server.listen)))
        return pd_errorf(err, PD_EINVAL,
                         "admin.port = %d collides with server.port on the same address; set "
                         "admin.port = 0 to serve the admin API on the public listener, or "
                         "choose another port",
                         c->admin.port);
    if (c->admin.token[0] && strcmp(c->admin.token, c->server.api_key) == 0)
        return pd_errorf(err, PD_EINVAL,
                         "admin.token must differ from server.api_key, or every API client "
                         "could use the admin API");
    if (c->cache.auto_persist && c->cache.auto_mb == 0)
        return pd_errorf(err, PD_EINVAL,
                         "cache.auto_persist = true needs the automatic cache: set cache.auto_mb above 0, or "
                         "cache.auto_persist = false");
    /* the blocks' disk bound is cache.auto_mb: keep at least half of the map
     * for registered prefixes */
    if (c->cache.auto_persist && c->cache.auto_mb > c->cache.map_size_mb / 2)
        return pd_errorf(err, PD_EINVAL,
                         "cache.auto_persist = true stores up to cache.auto_mb = %" PRId64
                         " MiB of automatic blocks, more than half of cache.map_size_mb = %" PRId64
                         "; raise cache.map_size_mb to at least %" PRId64 " or lower cache.auto_mb",
                         c->cache.auto_mb, c->cache.map_size_mb, 2 * c->cache.auto_mb);
    if (c->model.n_ctx != 0 && c->compression.min_prefix_tokens > c->model.n_ctx)
        return pd_errorf(err, PD_EINVAL,
                         "compression.min_prefix_tokens = %d is larger than model.n_ctx = %d, so "
                         "no prefix could ever be compressed",
                         c->compression.min_prefix_tokens, c->model.n_ctx);
    return PD_OK;
}

int pd_config_print(const pd_config *c, FILE *f, pd_error *err) {
    fprintf(f, "# prefixd effective configuration (prefixd --check-config)\n");
    for (size_t i = 0; i < KEY_COUNT; i++) {
        const key_desc *k = &keys[i];
        if (i == 0 || strcmp(k->section, keys[i - 1].section) != 0)
            fprintf(f, "%s[%s]\n", i ? "\n" : "", k->section);
        char text[PD_CONFIG_STR_CAP];
        format_value(c, k, text, sizeof text);
        if (text[0]) fprintf(f, "%s = %s\n", k->name, text);
        else fprintf(f, "%s =\n", k->name);
    }
    if (fflush(f) != 0 || ferror(f))
        return pd_errorf(err, PD_EIO, "cannot write the configuration: %s", strerror(errno));
    return PD_OK;
}
