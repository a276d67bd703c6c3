/* OpenAI request bodies -> validated pd_api_request; errors -> OpenAI error
 * objects; the request's prompt -> tokens -> pd_sched_params. */
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"

/* ---------------------------------------------------------------- errors */

static void copy_str(char *dst, size_t cap, const char *src) {
    if (!src) src = "";
    size_t n = strlen(src);
    if (n >= cap) n = cap - 1;
    memcpy(dst, src, n);
    dst[n] = '\0';
}

int pd_api_errorf(pd_api_error *e, int http_status, const char *type, const char *param, const char *code,
                  const char *fmt, ...) {
    int rc = http_status >= 500 ? PD_EIO : PD_EINVAL;
    if (!e) return rc;
    e->http_status = http_status;
    copy_str(e->type, sizeof e->type, type);
    copy_str(e->param, sizeof e->param, param);
    copy_str(e->code, sizeof e->code, code);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return rc;
}

int pd_api_error_from(pd_api_error *e, const pd_error *err, const char *param) {
    int code = err ? err->code : PD_EIO;
    const char *msg = err && err->msg[0] ? err->msg : "internal error";
    switch (code) {
    case PD_EINVAL:
    case PD_ERANGE:
    case PD_EFORMAT:
        return pd_api_errorf(e, 400, PD_API_ERR_INVALID, param, NULL, "%s", msg);
    case PD_EUNSUPPORTED:
        return pd_api_errorf(e, 400, PD_API_ERR_INVALID, param, "unsupported", "%s", msg);
    case PD_ENOTFOUND:
        return pd_api_errorf(e, 404, PD_API_ERR_NOT_FOUND, param, "not_found", "%s", msg);
    case PD_ENOMEM:
        return pd_api_errorf(e, 503, PD_API_ERR_OVERLOADED, NULL, "out_of_memory", "%s", msg);
    case PD_EUNAVAILABLE:
        return pd_api_errorf(e, 503, PD_API_ERR_OVERLOADED, NULL, "shutting_down", "%s", msg);
    case PD_EBUSY:
        return pd_api_errorf(e, 429, PD_API_ERR_RATE_LIMIT, NULL, "queue_full", "%s", msg);
    default:
        return pd_api_errorf(e, 500, PD_API_ERR_SERVER, NULL, NULL, "%s", msg);
    }
}

/* Messages may quote user input: keep only valid UTF-8 so jansson accepts it. */
static json_t *json_text(const char *s) {
    size_t n = strlen(s);
    json_t *j = json_stringn(s, n);
    if (j) return j;
    char *copy = malloc(n + 1);
    if (!copy) return NULL;
    for (size_t i = 0; i < n; i++) copy[i] = (unsigned char)s[i] < 0x80 ? s[i] : '?';
    copy[n] = '\0';
    j = json_stringn(copy, n);
    free(copy);
    return j;
}

static json_t *str_or_null(const char *s) { return s && s[0] ? json_text(s) : json_null(); }

int pd_api_error_json(const pd_api_error *e, char **out, size_t *len) {
    *out = NULL;
    if (len) *len = 0;
    json_t *inner = json_object();
    json_t *root = json_object();
    if (!inner || !root) goto oom;
    if (json_object_set_new(inner, "message", json_text(e->message)) ||
        json_object_set_new(inner, "type", json_text(e->type[0] ? e->type : PD_API_ERR_SERVER)) ||
        json_object_set_new(inner, "param", str_or_null(e->param)) ||
        json_object_set_new(inner, "code", str_or_null(e->code)))
        goto oom;
    if (json_object_set(root, "error", inner)) goto oom;
    json_decref(inner);
    *out = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (!*out) return PD_ENOMEM;
    if (len) *len = strlen(*out);
    return PD_OK;
oom:
    json_decref(inner);
    json_decref(root);
    return PD_ENOMEM;
}

/* ---------------------------------------------------------------- limits */

void pd_api_limits_default(pd_api_limits *l) {
    l->max_body_bytes = (size_t)1 << 20;
    l->max_depth = 16;
    l->default_max_tokens = 0;
    l->max_tokens_limit = 4096;
    l->max_prompt_tokens = 32768;
    l->max_n = 8;
}

/* ---------------------------------------------------------------- parsing */

#define BAD(e, param, ...) pd_api_errorf((e), 400, PD_API_ERR_INVALID, (param), NULL, __VA_ARGS__)
#define UNSUPPORTED(e, param, ...) \
    pd_api_errorf((e), 400, PD_API_ERR_INVALID, (param), "unsupported_parameter", __VA_ARGS__)
#define OOM(e) pd_api_errorf((e), 503, PD_API_ERR_OVERLOADED, NULL, "out_of_memory", "out of memory parsing the request")

bool pd_api_json_depth_ok(const char *s, size_t len, int max_depth) {
    int depth = 0;
    bool in_str = false;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (in_str) {
            if (c == '\\') i++;
            else if (c == '"') in_str = false;
        } else if (c == '"') {
            in_str = true;
        } else if (c == '[' || c == '{') {
            if (++depth > max_depth) return false;
        } else if (c == ']' || c == '}') {
            depth--;
        }
    }
    return true;
}

static const char *json_type_name(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER: return "an integer";
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

/* Present and not null. */
static json_t *field(json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return v && !json_is_null(v) ? v : NULL;
}

static int get_number(json_t *obj, const char *key, double lo, double hi, bool lo_open, float *out, pd_api_error *e) {
    json_t *v = field(obj, key);
    if (!v) return PD_OK;
    if (!json_is_number(v)) return BAD(e, key, "'%s' must be a number, not %s", key, json_type_name(v));
    double d = json_number_value(v);
    if (!isfinite(d) || d > hi || d < lo || (lo_open && d <= lo))
        return BAD(e, key, "'%s' = %g is out of range: it must be %s %g and <= %g", key, d, lo_open ? ">" : ">=", lo,
                   hi);
    *out = (float)d;
    return PD_OK;
}

static int get_int(json_t *obj, const char *key, int64_t lo, int64_t hi, int64_t *out, bool *present,
                   pd_api_error *e) {
    json_t *v = field(obj, key);
    if (present) *present = v != NULL;
    if (!v) return PD_OK;
    if (!json_is_integer(v)) return BAD(e, key, "'%s' must be an integer, not %s", key, json_type_name(v));
    json_int_t i = json_integer_value(v);
    if (i < lo || i > hi)
        return BAD(e, key, "'%s' = %lld is out of range [%" PRId64 ", %" PRId64 "]", key, (long long)i, lo, hi);
    *out = (int64_t)i;
    return PD_OK;
}

static int get_bool(json_t *obj, const char *key, bool *out, pd_api_error *e) {
    json_t *v = field(obj, key);
    if (!v) return PD_OK;
    if (!json_is_boolean(v)) return BAD(e, key, "'%s' must be a boolean, not %s", key, json_type_name(v));
    *out = json_is_true(v);
    return PD_OK;
}

static char *dup_json_string(json_t *v) {
    size_t n = json_string_length(v);
    char *s = malloc(n + 1);
    if (!s) return NULL;
    memcpy(s, json_string_value(v), n);
    s[n] = '\0';
    return s;
}

/* A JSON array of token ids. */
static int parse_token_array(json_t *arr, const char *param, pd_token **out, size_t *n, pd_api_error *e) {
    size_t cnt = json_array_size(arr);
    if (cnt == 0) return BAD(e, param, "'%s' is an empty array of token ids", param);
    pd_token *t = calloc(cnt, sizeof *t);
    if (!t) return OOM(e);
    for (size_t i = 0; i < cnt; i++) {
        json_t *x = json_array_get(arr, i);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > INT32_MAX) {
            free(t);
            return BAD(e, param, "'%s'[%zu] must be a token id (an integer >= 0), not %s", param, i,
                       json_is_integer(x) ? "a negative or huge integer" : json_type_name(x));
        }
        t[i] = (pd_token)json_integer_value(x);
    }
    *out = t;
    *n = cnt;
    return PD_OK;
}

static int parse_prompt(json_t *root, pd_api_request *r, pd_api_error *e) {
    json_t *p = field(root, "prompt");
    if (!p) return BAD(e, "prompt", "'prompt' is required: a string, an array with one string, or token ids");
    if (json_is_array(p) && json_array_size(p) > 0) {
        json_t *first = json_array_get(p, 0);
        if (json_is_string(first) || json_is_array(first)) {
            if (json_array_size(p) > 1)
                return UNSUPPORTED(e, "prompt",
                                   "'prompt' has %zu prompts; prefixd takes one prompt per request (send several requests, "
                                   "or use n for several completions of one prompt)",
                                   json_array_size(p));
            p = first;
            if (json_is_array(p)) {
                r->prompt_is_tokens = true;
                return parse_token_array(p, "prompt", &r->prompt_tokens, &r->n_prompt_tokens, e);
            }
        } else {
            r->prompt_is_tokens = true;
            return parse_token_array(p, "prompt", &r->prompt_tokens, &r->n_prompt_tokens, e);
        }
    }
    if (json_is_array(p)) return BAD(e, "prompt", "'prompt' is an empty array");
    if (!json_is_string(p))
        return BAD(e, "prompt", "'prompt' must be a string, an array with one string, or token ids, not %s",
                   json_type_name(p));
    r->prompt_text = dup_json_string(p);
    if (!r->prompt_text) return OOM(e);
    r->prompt_len = json_string_length(p);
    return PD_OK;
}

/* The role as the chat templates know it. "developer" is OpenAI's newer
 * name for "system" (sent by its clients for reasoning models): it becomes
 * "system" here, so every template renders it as its system turn. */
static const char *known_role(const char *s) {
    static const char *const roles[] = {"system", "user", "assistant", "tool"};
    for (size_t i = 0; i < sizeof roles / sizeof roles[0]; i++)
        if (strcmp(s, roles[i]) == 0) return roles[i];
    if (strcmp(s, "developer") == 0) return roles[0];
    return NULL;
}

/* Join the text parts of an array content with "\n". */
static int parse_content(json_t *c, size_t mi, char **out, pd_api_error *e) {
    char param[64];
    snprintf(param, sizeof param, "messages[%zu].content", mi);
    if (!c) {
        *out = strdup("");
        return *out ? PD_OK : OOM(e);
    }
    if (json_is_string(c)) {
        *out = dup_json_string(c);
        return *out ? PD_OK : OOM(e);
    }
    if (!json_is_array(c))
        return BAD(e, param, "'%s' must be a string or an array of text parts, not %s", param, json_type_name(c));
    size_t total = 0, n = json_array_size(c);
    for (size_t j = 0; j < n; j++) {
        json_t *part = json_array_get(c, j);
        char pp[128];
        snprintf(pp, sizeof pp, "%s[%zu]", param, j);
        if (!json_is_object(part)) return BAD(e, pp, "'%s' must be an object {\"type\":\"text\",\"text\":...}", pp);
        json_t *type = json_object_get(part, "type");
        if (!json_is_string(type) || strcmp(json_string_value(type), "text") != 0) {
            snprintf(pp, sizeof pp, "%s[%zu].type", param, j);
            return UNSUPPORTED(e, pp, "'%s' must be \"text\": prefixd serves text-only models", pp);
        }
        json_t *text = json_object_get(part, "text");
        if (!json_is_string(text)) {
            snprintf(pp, sizeof pp, "%s[%zu].text", param, j);
            return BAD(e, pp, "'%s' must be a string", pp);
        }
        total += json_string_length(text) + 1; /* body size bounds this: no overflow */
    }
    char *s = malloc(total + 1);
    if (!s) return OOM(e);
    size_t off = 0;
    for (size_t j = 0; j < n; j++) {
        json_t *text = json_object_get(json_array_get(c, j), "text");
        if (j > 0) s[off++] = '\n';
        memcpy(s + off, json_string_value(text), json_string_length(text));
        off += json_string_length(text);
    }
    s[off] = '\0';
    *out = s;
    return PD_OK;
}

static int parse_tool_calls(json_t *msg, size_t mi, pd_chat_message *out, pd_api_error *e);

static int parse_messages(json_t *root, pd_api_request *r, pd_api_error *e) {
    json_t *m = field(root, "messages");
    if (!m) return BAD(e, "messages", "'messages' is required: an array of {\"role\",\"content\"}");
    if (!json_is_array(m)) return BAD(e, "messages", "'messages' must be an array, not %s", json_type_name(m));
    size_t n = json_array_size(m);
    if (n == 0) return BAD(e, "messages", "'messages' is empty: send at least one message");
    r->messages = calloc(n, sizeof *r->messages);
    if (!r->messages) return OOM(e);
    for (size_t i = 0; i < n; i++) {
        json_t *msg = json_array_get(m, i);
        char param[64];
        snprintf(param, sizeof param, "messages[%zu]", i);
        if (!json_is_object(msg)) return BAD(e, param, "'%s' must be an object, not %s", param, json_type_name(msg));
        json_t *role = json_object_get(msg, "role");
        snprintf(param, sizeof param, "messages[%zu].role", i);
        if (!json_is_string(role)) return BAD(e, param, "'%s' must be a string", param);
        const char *known = known_role(json_string_value(role));
        if (!known)
            return BAD(e, param, "'%s' = '%.40s' is not supported: use \"system\", \"user\", \"assistant\" or "
                       "\"tool\" (\"developer\" counts as \"system\")", param, json_string_value(role));
        char *content = NULL;
        int rc = parse_content(field(msg, "content"), i, &content, e);
        if (rc) return rc;
        r->messages[i].role = known;
        r->messages[i].content = content;
        r->n_messages = i + 1;
        if (strcmp(known, "assistant") == 0 && (rc = parse_tool_calls(msg, i, &r->messages[i], e))) return rc;
        if (strcmp(known, "tool") == 0) {
            json_t *id = field(msg, "tool_call_id");
            snprintf(param, sizeof param, "messages[%zu].tool_call_id", i);
            if (!id) return BAD(e, param, "'%s' is required for a tool message: the id of the call it answers", param);
            if (!json_is_string(id)) return BAD(e, param, "'%s' must be a string, not %s", param, json_type_name(id));
            if (!(r->messages[i].tool_call_id = dup_json_string(id))) return OOM(e);
            json_t *name = field(msg, "name");
            if (name && json_is_string(name) && !(r->messages[i].name = dup_json_string(name))) return OOM(e);
        }
    }
    return PD_OK;
}

/* A function name as OpenAI allows it: 1..64 of [A-Za-z0-9_-] (so it can
 * be written into a grammar literal and a prompt without escaping). */
static bool good_function_name(const char *s, size_t len) {
    if (len == 0 || len > 64 || strlen(s) != len) return false;
    for (size_t i = 0; i < len; i++)
        if (!isalnum((unsigned char)s[i]) && s[i] != '_' && s[i] != '-') return false;
    return true;
}

/* A JSON object's text (key order kept), for arguments and parameters. */
static char *object_text(json_t *v) { return json_dumps(v, JSON_COMPACT | JSON_PRESERVE_ORDER); }

/* An assistant message's tool_calls: [{"id","type":"function","function":{"name","arguments"}}]. */
static int parse_tool_calls(json_t *msg, size_t mi, pd_chat_message *out, pd_api_error *e) {
    json_t *tc = field(msg, "tool_calls");
    char param[96];
    snprintf(param, sizeof param, "messages[%zu].tool_calls", mi);
    if (!tc) return PD_OK;
    if (!json_is_array(tc)) return BAD(e, param, "'%s' must be an array, not %s", param, json_type_name(tc));
    size_t n = json_array_size(tc);
    if (n == 0) return PD_OK;
    pd_chat_tool_call *calls = calloc(n, sizeof *calls);
    if (!calls) return OOM(e);
    out->tool_calls = calls;
    for (size_t j = 0; j < n; j++) {
        json_t *c = json_array_get(tc, j);
        snprintf(param, sizeof param, "messages[%zu].tool_calls[%zu]", mi, j);
        if (!json_is_object(c)) return BAD(e, param, "'%s' must be an object, not %s", param, json_type_name(c));
        json_t *type = field(c, "type"), *fn = field(c, "function"), *id = field(c, "id");
        if (type && (!json_is_string(type) || strcmp(json_string_value(type), "function") != 0))
            return BAD(e, param, "'%s.type' must be \"function\"", param);
        if (!json_is_object(fn)) return BAD(e, param, "'%s.function' must be an object {\"name\",\"arguments\"}", param);
        json_t *name = field(fn, "name"), *args = field(fn, "arguments");
        if (!json_is_string(name) || !good_function_name(json_string_value(name), json_string_length(name)))
            return BAD(e, param, "'%s.function.name' must be a function name (1..64 of A-Z a-z 0-9 _ -)", param);
        json_t *parsed = NULL;
        if (json_is_string(args)) parsed = json_loadb(json_string_value(args), json_string_length(args), 0, NULL);
        else if (json_is_object(args)) parsed = json_incref(args);
        else if (!args) parsed = json_object();
        if (!json_is_object(parsed)) {
            json_decref(parsed);
            return BAD(e, param, "'%s.function.arguments' must be a JSON object written as a string (\"{...}\")", param);
        }
        out->n_tool_calls = j + 1;
        calls[j].arguments = object_text(parsed);
        json_decref(parsed);
        calls[j].name = dup_json_string(name);
        if (id && json_is_string(id)) calls[j].id = dup_json_string(id);
        if (!calls[j].arguments || !calls[j].name || (id && json_is_string(id) && !calls[j].id)) return OOM(e);
    }
    return PD_OK;
}

/* response_format: {"type":"text"|"json_object"} or
 * {"type":"json_schema","json_schema":{"name","schema","strict","description"}}.
 * The schema itself is checked when its grammar is built (unsupported
 * keywords are a 400 there). */
static int parse_response_format(json_t *root, pd_api_request *r, pd_api_error *e) {
    json_t *rf = field(root, "response_format");
    if (!rf) return PD_OK;
    if (!json_is_object(rf))
        return BAD(e, "response_format", "'response_format' must be an object {\"type\": ...}, not %s",
                   json_type_name(rf));
    json_t *type = field(rf, "type");
    const char *t = json_is_string(type) ? json_string_value(type) : "";
    if (strcmp(t, "text") == 0) return PD_OK;
    if (strcmp(t, "json_object") == 0) {
        r->format = PD_API_FORMAT_JSON_OBJECT;
        return PD_OK;
    }
    if (strcmp(t, "json_schema") != 0)
        return BAD(e, "response_format.type", "'response_format.type' must be \"text\", \"json_object\" or "
                   "\"json_schema\"");
    json_t *js = field(rf, "json_schema");
    if (!json_is_object(js))
        return BAD(e, "response_format.json_schema", "'response_format.json_schema' must be an object "
                   "{\"name\", \"schema\", \"strict\"}");
    json_t *name = field(js, "name");
    if (!json_is_string(name) || !good_function_name(json_string_value(name), json_string_length(name)))
        return BAD(e, "response_format.json_schema.name", "'response_format.json_schema.name' is required: 1..64 "
                   "of A-Z a-z 0-9 _ -");
    json_t *strict = field(js, "strict");
    if (strict && !json_is_boolean(strict))
        return BAD(e, "response_format.json_schema.strict", "'response_format.json_schema.strict' must be a boolean");
    json_t *schema = field(js, "schema");
    if (!schema) schema = json_object(); /* OpenAI's default: any JSON */
    else json_incref(schema);
    if (!json_is_object(schema) && !json_is_boolean(schema)) {
        json_decref(schema);
        return BAD(e, "response_format.json_schema.schema", "'response_format.json_schema.schema' must be a JSON "
                   "Schema object");
    }
    r->format = PD_API_FORMAT_JSON_SCHEMA;
    r->schema = schema;
    if (!(r->schema_name = dup_json_string(name))) return OOM(e);
    return PD_OK;
}

/* tools: [{"type":"function","function":{"name","description","parameters","strict"}}],
 * tool_choice and parallel_tool_calls. */
static int parse_tools(json_t *root, pd_api_request *r, pd_api_error *e) {
    json_t *tools = field(root, "tools"), *choice = field(root, "tool_choice");
    r->parallel_tool_calls = true;
    int rc = get_bool(root, "parallel_tool_calls", &r->parallel_tool_calls, e);
    if (rc) return rc;
    if (tools && r->kind != PD_API_CHAT)
        return BAD(e, "tools", "'tools' belongs to /v1/chat/completions");
    if (tools && !json_is_array(tools)) return BAD(e, "tools", "'tools' must be an array, not %s", json_type_name(tools));
    size_t n = tools ? json_array_size(tools) : 0;
    if (n > PD_API_MAX_TOOLS) return BAD(e, "tools", "'tools' has %zu functions; at most %d", n, PD_API_MAX_TOOLS);
    if (n) {
        if (!(r->tools = calloc(n, sizeof *r->tools))) return OOM(e);
    }
    for (size_t i = 0; i < n; i++) {
        char param[64];
        json_t *t = json_array_get(tools, i);
        snprintf(param, sizeof param, "tools[%zu]", i);
        if (!json_is_object(t)) return BAD(e, param, "'%s' must be an object, not %s", param, json_type_name(t));
        json_t *type = field(t, "type"), *fn = field(t, "function");
        if (!json_is_string(type) || strcmp(json_string_value(type), "function") != 0)
            return BAD(e, param, "'%s.type' must be \"function\" (the only kind of tool)", param);
        snprintf(param, sizeof param, "tools[%zu].function", i);
        if (!json_is_object(fn)) return BAD(e, param, "'%s' must be an object {\"name\", \"parameters\"}", param);
        json_t *name = field(fn, "name"), *desc = field(fn, "description"), *params = field(fn, "parameters");
        snprintf(param, sizeof param, "tools[%zu].function.name", i);
        if (!json_is_string(name) || !good_function_name(json_string_value(name), json_string_length(name)))
            return BAD(e, param, "'%s' must be a function name (1..64 of A-Z a-z 0-9 _ -)", param);
        for (size_t j = 0; j < i; j++)
            if (strcmp(r->tools[j].name, json_string_value(name)) == 0)
                return BAD(e, param, "'%s' = \"%s\" is listed twice", param, json_string_value(name));
        if (desc && !json_is_string(desc)) {
            snprintf(param, sizeof param, "tools[%zu].function.description", i);
            return BAD(e, param, "'%s' must be a string", param);
        }
        if (params && !json_is_object(params)) {
            snprintf(param, sizeof param, "tools[%zu].function.parameters", i);
            return BAD(e, param, "'%s' must be a JSON Schema object", param);
        }
        pd_chat_tool *out = &r->tools[i];
        r->n_tools = i + 1;
        if (!(out->name = dup_json_string(name)) || (desc && !(out->description = dup_json_string(desc))) ||
            (params && !(out->parameters = object_text(params))))
            return OOM(e);
    }
    r->tool_choice = n ? PD_API_TOOLS_AUTO : PD_API_TOOLS_NONE;
    if (!choice) return PD_OK;
    if (!n) return BAD(e, "tool_choice", "'tool_choice' needs 'tools'");
    json_t *fn = json_is_object(choice) ? field(choice, "function") : NULL;
    json_t *name = json_is_object(fn) ? field(fn, "name") : NULL;
    const char *c = json_is_string(choice) ? json_string_value(choice) : "";
    if (strcmp(c, "auto") == 0) r->tool_choice = PD_API_TOOLS_AUTO;
    else if (strcmp(c, "none") == 0) r->tool_choice = PD_API_TOOLS_NONE;
    else if (strcmp(c, "required") == 0) r->tool_choice = PD_API_TOOLS_REQUIRED;
    else if (!json_is_string(name))
        return BAD(e, "tool_choice", "'tool_choice' must be \"auto\", \"none\", \"required\" or "
                   "{\"type\":\"function\",\"function\":{\"name\":...}}");
    if (json_is_string(choice)) return PD_OK;
    for (size_t j = 0; j < n; j++)
        if (strcmp(r->tools[j].name, json_string_value(name)) == 0) {
            r->tool_choice = PD_API_TOOLS_NAMED;
            if (!(r->tool_choice_name = dup_json_string(name))) return OOM(e);
            return PD_OK;
        }
    return BAD(e, "tool_choice", "'tool_choice' names \"%.64s\", which is not in 'tools'", json_string_value(name));
}

static int parse_stop(json_t *root, pd_api_request *r, pd_api_error *e) {
    json_t *s = field(root, "stop");
    if (!s) return PD_OK;
    size_t n = 1;
    if (json_is_array(s)) {
        n = json_array_size(s);
        if (n > PD_API_MAX_STOP)
            return BAD(e, "stop", "'stop' has %zu strings; at most %d are allowed", n, PD_API_MAX_STOP);
    } else if (!json_is_string(s)) {
        return BAD(e, "stop", "'stop' must be a string or an array of strings, not %s", json_type_name(s));
    }
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_is_array(s) ? json_array_get(s, i) : s;
        if (!json_is_string(x)) return BAD(e, "stop", "'stop'[%zu] must be a string, not %s", i, json_type_name(x));
        size_t len = json_string_length(x);
        if (len == 0) return BAD(e, "stop", "'stop' strings must not be empty");
        if (len > PD_STOP_MAX_LEN)
            return BAD(e, "stop", "'stop' string of %zu bytes is longer than %d", len, PD_STOP_MAX_LEN);
        r->stop[r->n_stop] = dup_json_string(x);
        if (!r->stop[r->n_stop]) return OOM(e);
        r->n_stop++;
    }
    return PD_OK;
}

static int parse_logit_bias(json_t *root, pd_api_request *r, pd_api_error *e) {
    json_t *b = field(root, "logit_bias");
    if (!b) return PD_OK;
    if (!json_is_object(b))
        return BAD(e, "logit_bias", "'logit_bias' must be an object mapping token ids to biases, not %s",
                   json_type_name(b));
    size_t n = json_object_size(b);
    if (n == 0) return PD_OK;
    if (n > PD_API_MAX_LOGIT_BIAS)
        return BAD(e, "logit_bias", "'logit_bias' has %zu entries; at most %d are allowed", n, PD_API_MAX_LOGIT_BIAS);
    r->logit_bias = calloc(n, sizeof *r->logit_bias);
    if (!r->logit_bias) return OOM(e);
    const char *key;
    json_t *val;
    json_object_foreach(b, key, val) {
        char *end = NULL;
        errno = 0;
        long long id = strtoll(key, &end, 10);
        if (!key[0] || *end || errno || id < 0 || id > INT32_MAX || key[0] == '-' || key[0] == '+' || key[0] == ' ')
            return BAD(e, "logit_bias", "'logit_bias' key '%.40s' is not a token id (a decimal integer >= 0)", key);
        if (!json_is_number(val))
            return BAD(e, "logit_bias", "'logit_bias'[\"%s\"] must be a number, not %s", key, json_type_name(val));
        double d = json_number_value(val);
        if (!isfinite(d) || d < -100 || d > 100)
            return BAD(e, "logit_bias", "'logit_bias'[\"%s\"] = %g is out of range [-100, 100]", key, d);
        r->logit_bias[r->n_logit_bias].token = (pd_token)id;
        r->logit_bias[r->n_logit_bias].bias = (float)d;
        r->n_logit_bias++;
    }
    r->sampling.logit_bias = r->logit_bias;
    r->sampling.n_logit_bias = r->n_logit_bias;
    return PD_OK;
}

static int parse_logprobs(json_t *root, pd_api_request *r, pd_api_error *e) {
    if (r->kind == PD_API_COMPLETION) {
        json_t *v = field(root, "logprobs");
        if (!v) return PD_OK;
        if (!json_is_integer(v))
            return BAD(e, "logprobs", "'logprobs' must be an integer 0..5 for /v1/completions, not %s",
                       json_type_name(v));
        json_int_t k = json_integer_value(v);
        if (k < 0 || k > 5) return BAD(e, "logprobs", "'logprobs' = %lld is out of range [0, 5]", (long long)k);
        r->sampling.logprobs = true;
        r->sampling.n_logprobs = (int32_t)k;
        return PD_OK;
    }
    bool lp = false;
    int rc = get_bool(root, "logprobs", &lp, e);
    if (rc) return rc;
    int64_t top = 0;
    bool has_top = false;
    rc = get_int(root, "top_logprobs", 0, PD_SAMPLER_MAX_LOGPROBS, &top, &has_top, e);
    if (rc) return rc;
    if (has_top && !lp)
        return BAD(e, "top_logprobs", "'top_logprobs' needs \"logprobs\": true");
    r->sampling.logprobs = lp;
    r->sampling.n_logprobs = (int32_t)top;
    return PD_OK;
}

static int parse_root(json_t *root, pd_api_request *r, const pd_api_limits *lim, pd_api_error *e) {
    json_t *model = field(root, "model");
    if (!model) return BAD(e, "model", "'model' is required (GET /v1/models lists it)");
    if (!json_is_string(model)) return BAD(e, "model", "'model' must be a string, not %s", json_type_name(model));
    r->model = dup_json_string(model);
    if (!r->model) return OOM(e);

    int rc = r->kind == PD_API_CHAT ? parse_messages(root, r, e) : parse_prompt(root, r, e);
    if (rc) return rc;

    int64_t v = 0;
    bool present = false;
    const char *mt_key = "max_tokens";
    if (r->kind == PD_API_CHAT && field(root, "max_completion_tokens")) mt_key = "max_completion_tokens";
    if ((rc = get_int(root, mt_key, 1, lim->max_tokens_limit, &v, &present, e))) return rc;
    if (present) r->max_tokens = (int32_t)v;
    if ((rc = get_int(root, "n", 1, lim->max_n, &v, &present, e))) return rc;
    if (present) r->n = (int)v;
    if ((rc = get_int(root, "best_of", 1, lim->max_n, &v, &present, e))) return rc;
    if (present && v != r->n)
        return UNSUPPORTED(e, "best_of", "'best_of' other than n is not supported; leave it out");

    pd_sampler_params *s = &r->sampling;
    if ((rc = get_number(root, "temperature", 0, 2, false, &s->temperature, e))) return rc;
    if ((rc = get_number(root, "top_p", 0, 1, true, &s->top_p, e))) return rc;
    if ((rc = get_number(root, "min_p", 0, 1, false, &s->min_p, e))) return rc;
    if ((rc = get_number(root, "presence_penalty", -2, 2, false, &s->presence_penalty, e))) return rc;
    if ((rc = get_number(root, "frequency_penalty", -2, 2, false, &s->frequency_penalty, e))) return rc;
    if ((rc = get_number(root, "repetition_penalty", 0, 1e6, true, &s->repetition_penalty, e))) return rc;
    if ((rc = get_int(root, "top_k", 0, INT32_MAX, &v, &present, e))) return rc;
    if (present) s->top_k = (int32_t)v;
    if ((rc = get_int(root, "seed", INT64_MIN, INT64_MAX, &v, &present, e))) return rc;
    if (present) {
        r->has_seed = true;
        s->seed = (uint64_t)v;
    }
    if ((rc = parse_stop(root, r, e))) return rc;
    if ((rc = parse_logit_bias(root, r, e))) return rc;
    if ((rc = parse_logprobs(root, r, e))) return rc;
    if ((rc = parse_response_format(root, r, e))) return rc;
    json_t *grammar = field(root, "grammar");
    if (grammar) {
        if (!json_is_string(grammar) || json_string_length(grammar) == 0)
            return BAD(e, "grammar", "'grammar' must be non-empty GBNF text (docs/structured-output.md)");
        if (r->format != PD_API_FORMAT_TEXT)
            return BAD(e, "grammar", "'grammar' and 'response_format' each constrain the answer: send one of them");
        if (!(r->grammar = dup_json_string(grammar))) return OOM(e);
    }
    if ((rc = parse_tools(root, r, e))) return rc;
    if (r->grammar && r->n_tools && r->tool_choice != PD_API_TOOLS_NONE)
        return BAD(e, "grammar", "'grammar' and 'tools' each constrain the answer: send one of them (or tool_choice "
                   "\"none\")");

    if ((rc = get_bool(root, "stream", &r->stream, e))) return rc;
    json_t *so = field(root, "stream_options");
    if (so) {
        if (!json_is_object(so))
            return BAD(e, "stream_options", "'stream_options' must be an object, not %s", json_type_name(so));
        json_t *iu = field(so, "include_usage");
        if (iu && !json_is_boolean(iu))
            return BAD(e, "stream_options.include_usage", "'stream_options.include_usage' must be a boolean, not %s",
                       json_type_name(iu));
        r->include_usage = iu && json_is_true(iu);
    }
    json_t *user = field(root, "user");
    if (user) {
        if (!json_is_string(user)) return BAD(e, "user", "'user' must be a string, not %s", json_type_name(user));
        if (!(r->user = dup_json_string(user))) return OOM(e);
    }
    if (r->kind == PD_API_COMPLETION) {
        bool echo = false;
        if ((rc = get_bool(root, "echo", &echo, e))) return rc;
        if (echo) return UNSUPPORTED(e, "echo", "'echo': true is not supported; leave it out or set it to false");
        json_t *suffix = field(root, "suffix");
        if (suffix && (!json_is_string(suffix) || json_string_length(suffix) > 0))
            return UNSUPPORTED(e, "suffix", "'suffix' (insertion) is not supported; leave it out");
    }

    json_t *pid = field(root, "prefix_id");
    if (pid) {
        if (!json_is_string(pid))
            return BAD(e, "prefix_id", "'prefix_id' must be a string of 64 hex digits, not %s", json_type_name(pid));
        pd_error err = {0};
        if (strlen(json_string_value(pid)) != json_string_length(pid) ||
            pd_prefix_id_parse(json_string_value(pid), &r->prefix_id, &err) != PD_OK)
            return BAD(e, "prefix_id", "'prefix_id': %s", err.msg[0] ? err.msg : "contains a NUL byte");
        r->has_prefix_id = true;
    }
    json_t *cache = field(root, "cache");
    if (cache) {
        const char *cs = json_is_string(cache) ? json_string_value(cache) : NULL;
        if (cs && strcmp(cs, "auto") == 0) r->cache = PD_CACHE_AUTO;
        else if (cs && strcmp(cs, "off") == 0) r->cache = PD_CACHE_OFF;
        else return BAD(e, "cache", "'cache' must be \"auto\" or \"off\"");
    }
    if (r->has_prefix_id && r->cache == PD_CACHE_OFF)
        return BAD(e, "prefix_id", "'prefix_id' names a stored prefix but \"cache\" is \"off\"; drop one of them");
    json_t *salt = field(root, "cache_salt");
    if (salt) {
        if (!json_is_string(salt)) return BAD(e, "cache_salt", "'cache_salt' must be a string, not %s", json_type_name(salt));
        if (json_string_length(salt) == 0 || strlen(json_string_value(salt)) != json_string_length(salt) ||
            json_string_length(salt) > PD_API_SALT_MAX)
            return BAD(e, "cache_salt", "'cache_salt' must be 1..%d bytes without NUL", PD_API_SALT_MAX);
        snprintf(r->cache_salt, sizeof r->cache_salt, "%s", json_string_value(salt));
    }
    return PD_OK;
}

int pd_api_request_namespace(pd_api_request *r, const char *key_ns, pd_api_error *e) {
    const size_t a = strlen(key_ns), b = strlen(r->cache_salt);
    if (b && a + 1 + b >= sizeof r->ns)
        return BAD(e, "cache_salt", "the API key's namespace and 'cache_salt' together exceed %zu bytes; use a shorter "
                   "salt", sizeof r->ns - 1);
    if (!b && a >= sizeof r->ns) return BAD(e, NULL, "the API key's namespace is too long");
    memcpy(r->ns, key_ns, a);
    if (b) {
        r->ns[a] = '\x1f';
        memcpy(r->ns + a + 1, r->cache_salt, b);
    }
    r->ns[a + (b ? 1 + b : 0)] = '\0';
    return PD_OK;
}


/* The body of a JSON endpoint: within the size and nesting limits, valid
 * JSON without duplicate keys, an object. *root is the caller's. */
static int load_body_object(const char *body, size_t len, const pd_api_limits *lim, json_t **root, pd_api_error *e) {
    *root = NULL;
    if (!body && len) return BAD(e, NULL, "the request body is missing");
    if (len > lim->max_body_bytes)
        return pd_api_errorf(e, 413, PD_API_ERR_TOO_LARGE, NULL, "request_too_large",
                             "the request body has %zu bytes; the limit is %zu", len, lim->max_body_bytes);
    if (len == 0) return BAD(e, NULL, "the request body is empty: send a JSON object");
    if (!pd_api_json_depth_ok(body, len, lim->max_depth))
        return BAD(e, NULL, "the request body nests JSON deeper than %d levels", lim->max_depth);
    json_error_t jerr;
    json_t *r = json_loadb(body, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!r)
        return BAD(e, NULL, "the request body is not valid JSON: %s (line %d, column %d)", jerr.text, jerr.line,
                   jerr.column);
    if (!json_is_object(r)) {
        int rc = BAD(e, NULL, "the request body must be a JSON object, not %s", json_type_name(r));
        json_decref(r);
        return rc;
    }
    *root = r;
    return PD_OK;
}

int pd_api_parse_request(pd_api_kind kind, const char *body, size_t len, const pd_api_limits *lim,
                         pd_api_request *out, pd_api_error *e) {
    pd_api_limits defaults;
    if (!lim) {
        pd_api_limits_default(&defaults);
        lim = &defaults;
    }
    memset(out, 0, sizeof *out);
    out->kind = kind;
    out->n = 1;
    out->sampling = pd_sampler_params_default();
    out->cache = PD_CACHE_AUTO;
    if (kind != PD_API_COMPLETION && kind != PD_API_CHAT)
        return pd_api_errorf(e, 500, PD_API_ERR_SERVER, NULL, NULL, "unknown endpoint kind %d", (int)kind);
    json_t *root;
    int rc = load_body_object(body, len, lim, &root, e);
    if (rc) return rc;
    rc = parse_root(root, out, lim, e);
    json_decref(root);
    if (rc) {
        pd_api_request_free(out);
        out->kind = kind;
    }
    return rc;
}

void pd_api_request_free(pd_api_request *r) {
    if (!r) return;
    free(r->model);
    free(r->prompt_text);
    free(r->prompt_tokens);
    for (size_t i = 0; i < r->n_messages; i++) {
        pd_chat_message *m = &r->messages[i];
        free((char *)m->content);
        free((char *)m->tool_call_id);
        free((char *)m->name);
        for (size_t j = 0; j < m->n_tool_calls; j++) {
            free((char *)m->tool_calls[j].id);
            free((char *)m->tool_calls[j].name);
            free((char *)m->tool_calls[j].arguments);
        }
        free((void *)m->tool_calls);
    }
    free(r->messages);
    json_decref(r->schema);
    free(r->schema_name);
    free(r->grammar);
    for (size_t i = 0; i < r->n_tools; i++) {
        free((char *)r->tools[i].name);
        free((char *)r->tools[i].description);
        free((char *)r->tools[i].parameters);
    }
    free(r->tools);
    free(r->tool_choice_name);
    for (size_t i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->logit_bias);
    free(r->user);
    memset(r, 0, sizeof *r);
}

/* ---------------------------------------------------------------- prompt */

int pd_api_prompt_tokens(const pd_api_request *r, const pd_tokenizer *tok, pd_chat_family family,
                         const pd_api_limits *lim, pd_token **out, int64_t *n_out, size_t *system_bytes,
                         pd_api_error *e) {
    pd_api_limits defaults;
    if (!lim) {
        pd_api_limits_default(&defaults);
        lim = &defaults;
    }
    *out = NULL;
    *n_out = 0;
    if (system_bytes) *system_bytes = 0;
    const char *param = r->kind == PD_API_CHAT ? "messages" : "prompt";
    pd_error err = {0};
    pd_token *t = NULL;
    size_t n = 0;
    if (r->kind == PD_API_COMPLETION && r->prompt_is_tokens) {
        n = r->n_prompt_tokens;
        t = malloc((n ? n : 1) * sizeof *t);
        if (!t) return OOM(e);
        memcpy(t, r->prompt_tokens, n * sizeof *t);
    } else if (r->kind == PD_API_COMPLETION) {
        pd_tokenize_opts o = {.add_special = true, .parse_special = false};
        if (pd_tokenize(tok, r->prompt_text ? r->prompt_text : "", r->prompt_len, o, &t, &n, &err))
            return pd_api_error_from(e, &err, param);
    } else {
        if (family == PD_CHAT_NONE)
            return pd_api_errorf(e, 400, PD_API_ERR_INVALID, "messages", "no_chat_template",
                                 "the model has no chat template prefixd recognises (tokenizer.chat_template); "
                                 "use /v1/completions with a prompt");
        char *text = NULL;
        size_t len = 0, sys = 0;
        if (pd_chat_render_tools(family, r->messages, r->n_messages, r->tools, r->n_tools, true, &text, &len, &sys,
                                 &err))
            return pd_api_error_from(e, &err, param);
        pd_tokenize_opts o = {.add_special = true, .parse_special = true};
        int rc = pd_tokenize(tok, text, len, o, &t, &n, &err);
        free(text);
        if (rc) return pd_api_error_from(e, &err, param);
        if (system_bytes) *system_bytes = sys;
    }
    if (n == 0) {
        free(t);
        return BAD(e, param, "the %s is empty after tokenization (the model adds no BOS token)", param);
    }
    if ((int64_t)n > lim->max_prompt_tokens) {
        free(t);
        return pd_api_errorf(e, 400, PD_API_ERR_INVALID, param, "context_length_exceeded",
                             "the prompt has %zu tokens; this server accepts at most %" PRId64, n,
                             lim->max_prompt_tokens);
    }
    *out = t;
    *n_out = (int64_t)n;
    return PD_OK;
}

int pd_api_sched_params(const pd_api_request *r, const pd_token *prompt, int64_t n_prompt, int32_t n_ctx,
                        int32_t n_vocab, const pd_api_limits *lim, pd_sched_params *out, pd_api_error *e) {
    pd_api_limits defaults;
    if (!lim) {
        pd_api_limits_default(&defaults);
        lim = &defaults;
    }
    const char *param = r->kind == PD_API_CHAT ? "messages" : "prompt";
    memset(out, 0, sizeof *out);
    if (!prompt || n_prompt < 1) return BAD(e, param, "the prompt is empty");
    if (n_ctx < 1) return pd_api_errorf(e, 500, PD_API_ERR_SERVER, NULL, NULL, "the model context is unknown");
    for (int64_t i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= n_vocab)
            return BAD(e, param, "prompt token %" PRId64 " is id %d, outside the vocabulary [0, %d)", i,
                       (int)prompt[i], (int)n_vocab);
    if (n_prompt >= n_ctx)
        return pd_api_errorf(e, 400, PD_API_ERR_INVALID, param, "context_length_exceeded",
                             "the prompt has %" PRId64 " tokens; the model's context is %d tokens, so it leaves no "
                             "room to generate",
                             n_prompt, (int)n_ctx);
    int64_t room = (int64_t)n_ctx - n_prompt;
    int32_t max_tokens = r->max_tokens;
    if (max_tokens > 0) {
        if (max_tokens > room)
            return pd_api_errorf(e, 400, PD_API_ERR_INVALID,
                                 r->kind == PD_API_CHAT ? "max_completion_tokens" : "max_tokens",
                                 "context_length_exceeded",
                                 "the model's context is %d tokens; the prompt (%" PRId64 ") plus max_tokens (%d) "
                                 "exceeds it: ask for at most %" PRId64 " tokens",
                                 (int)n_ctx, n_prompt, (int)max_tokens, room);
    } else if (r->kind == PD_API_COMPLETION) {
        max_tokens = PD_API_COMPLETION_MAX_TOKENS;
        if (max_tokens > room) max_tokens = (int32_t)room;
    } else {
        int64_t mt = lim->default_max_tokens > 0 ? lim->default_max_tokens : room;
        if (mt > room) mt = room;
        if (lim->max_tokens_limit > 0 && mt > lim->max_tokens_limit) mt = lim->max_tokens_limit;
        max_tokens = (int32_t)mt;
    }
    for (size_t i = 0; i < r->n_logit_bias; i++)
        if (r->logit_bias[i].token >= n_vocab)
            return BAD(e, "logit_bias", "'logit_bias' token id %d is outside the vocabulary [0, %d)",
                       (int)r->logit_bias[i].token, (int)n_vocab);
    pd_error err = {0};
    if (pd_sampler_params_validate(&r->sampling, n_vocab, &err)) return pd_api_error_from(e, &err, NULL);

    out->prompt = prompt;
    out->n_prompt = n_prompt;
    out->n_choices = r->n;
    out->sampling = r->sampling;
    out->sampling.logit_bias = r->logit_bias;
    out->sampling.n_logit_bias = r->n_logit_bias;
    out->gen.max_tokens = max_tokens;
    out->gen.stop = (const char *const *)r->stop;
    out->gen.n_stop = r->n_stop;
    out->cache = r->cache;
    out->has_prefix_id = r->has_prefix_id;
    out->prefix_id = r->prefix_id;
    out->ns = r->ns[0] ? r->ns : NULL;
    out->spec = NULL;
    return PD_OK;
}

/* ---------------------------------------------------------------- tokenize */

static int parse_tokenize_root(json_t *root, pd_api_tokenize_request *r, const pd_api_limits *lim,
                               pd_api_error *e) {
    int rc;
    if (r->detokenize) {
        json_t *t = field(root, "tokens");
        if (!t) return BAD(e, "tokens", "'tokens' is required: an array of token ids");
        if (!json_is_array(t)) return BAD(e, "tokens", "'tokens' must be an array of token ids, not %s", json_type_name(t));
        if ((int64_t)json_array_size(t) > lim->max_prompt_tokens)
            return pd_api_errorf(e, 400, PD_API_ERR_INVALID, "tokens", "context_length_exceeded",
                                 "'tokens' has %zu ids; this server accepts at most %" PRId64, json_array_size(t),
                                 lim->max_prompt_tokens);
        if (json_array_size(t) == 0) return PD_OK; /* nothing to render: "" */
        return parse_token_array(t, "tokens", &r->tokens, &r->n_tokens, e);
    }
    json_t *c = field(root, "content");
    if (!c) return BAD(e, "content", "'content' is required: the text to tokenize");
    if (!json_is_string(c)) return BAD(e, "content", "'content' must be a string, not %s", json_type_name(c));
    if (!(r->content = dup_json_string(c))) return OOM(e);
    r->content_len = json_string_length(c);
    r->parse_special = true; /* llama-server's default: "<|im_end|>" in the text is that token */
    if ((rc = get_bool(root, "add_special", &r->add_special, e))) return rc;
    if ((rc = get_bool(root, "parse_special", &r->parse_special, e))) return rc;
    return get_bool(root, "with_pieces", &r->with_pieces, e);
}

int pd_api_parse_tokenize(bool detokenize, const char *body, size_t len, const pd_api_limits *lim,
                          pd_api_tokenize_request *out, pd_api_error *e) {
    pd_api_limits defaults;
    if (!lim) {
        pd_api_limits_default(&defaults);
        lim = &defaults;
    }
    memset(out, 0, sizeof *out);
    out->detokenize = detokenize;
    json_t *root;
    int rc = load_body_object(body, len, lim, &root, e);
    if (rc) return rc;
    rc = parse_tokenize_root(root, out, lim, e);
    json_decref(root);
    if (rc) {
        pd_api_tokenize_request_free(out);
        out->detokenize = detokenize;
    }
    return rc;
}

void pd_api_tokenize_request_free(pd_api_tokenize_request *r) {
    if (!r) return;
    free(r->content);
    free(r->tokens);
    memset(r, 0, sizeof *r);
}

int pd_api_tokenize_answer(const pd_api_tokenize_request *r, const pd_tokenizer *tok, const pd_api_limits *lim,
                           char **out, size_t *len, pd_api_error *e) {
    pd_api_limits defaults;
    if (!lim) {
        pd_api_limits_default(&defaults);
        lim = &defaults;
    }
    *out = NULL;
    *len = 0;
    pd_error err = {0};
    if (r->detokenize) {
        const int32_t n_vocab = pd_tokenizer_n_vocab(tok);
        for (size_t i = 0; i < r->n_tokens; i++)
            if (r->tokens[i] >= n_vocab) {
                char param[48];
                snprintf(param, sizeof param, "tokens[%zu]", i);
                return BAD(e, param, "'%s' = %d is outside the vocabulary [0, %d)", param, (int)r->tokens[i],
                           (int)n_vocab);
            }
        char *text = NULL;
        size_t n = 0, *offsets = NULL;
        /* piece by piece, nothing stripped: what llama-server's /detokenize answers */
        if (r->n_tokens && pd_detokenize_offsets(tok, r->tokens, r->n_tokens, true, &text, &n, &offsets, &err))
            return pd_api_error_from(e, &err, "tokens");
        free(offsets);
        const int rc = pd_api_content_json(text ? text : "", n, out, len, &err);
        free(text);
        return rc ? pd_api_error_from(e, &err, NULL) : PD_OK;
    }
    pd_token *ids = NULL;
    size_t n = 0;
    pd_tokenize_opts o = {.add_special = r->add_special, .parse_special = r->parse_special};
    if (pd_tokenize(tok, r->content, r->content_len, o, &ids, &n, &err)) return pd_api_error_from(e, &err, "content");
    if ((int64_t)n > lim->max_prompt_tokens) {
        free(ids);
        return pd_api_errorf(e, 400, PD_API_ERR_INVALID, "content", "context_length_exceeded",
                             "'content' has %zu tokens; this server accepts at most %" PRId64, n,
                             lim->max_prompt_tokens);
    }
    const int rc = pd_api_tokens_json(tok, ids, n, r->with_pieces, out, len, &err);
    free(ids);
    return rc ? pd_api_error_from(e, &err, NULL) : PD_OK;
}
