/* Tool calls read back out of a finished answer, in the family's syntax
 * (pd_chat_tool_syntax), and the marker that says an answer is calls. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"

/* The text that marks the start of calls: the open string up to its first
 * space or newline ("<tool_call>", "[TOOL_CALLS]"), or "{" for a syntax
 * whose calls are bare JSON (Llama 3). */
void pd_api_tool_trigger(const pd_chat_tool_syntax *syn, char *out, size_t cap) {
    size_t n = strcspn(syn->open, " \n");
    if (n == 0) {
        snprintf(out, cap, "{");
        return;
    }
    if (n >= cap) n = cap - 1;
    memcpy(out, syn->open, n);
    out[n] = '\0';
}

/* ---------------------------------------------------------------- reading calls back */

static size_t skip_ws(const char *t, size_t len, size_t p) {
    while (p < len && (t[p] == ' ' || t[p] == '\n' || t[p] == '\t' || t[p] == '\r')) p++;
    return p;
}

static bool eat(const char *t, size_t len, size_t *p, const char *lit) {
    size_t n = strlen(lit);
    if (n > len - *p || memcmp(t + *p, lit, n) != 0) return false;
    *p += n;
    return true;
}

/* One JSON value at t[*p..len); advances past it. */
static json_t *load_value(const char *t, size_t len, size_t *p) {
    json_error_t jerr;
    json_t *v = json_loadb(t + *p, len - *p, JSON_DISABLE_EOF_CHECK | JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &jerr);
    if (v) *p += jerr.position;
    return v;
}

static int add_call(const pd_chat_tool_syntax *syn, json_t *obj, pd_api_tool_call **calls, size_t *n) {
    json_t *name = json_object_get(obj, "name"), *args = json_object_get(obj, syn->args_key);
    if (!json_is_object(obj) || !json_is_string(name) || !json_is_object(args)) return PD_EFORMAT;
    pd_api_tool_call *grown = realloc(*calls, (*n + 1) * sizeof **calls);
    if (!grown) return PD_ENOMEM;
    *calls = grown;
    pd_api_tool_call *c = &grown[*n];
    memset(c, 0, sizeof *c);
    c->name = strdup(json_string_value(name));
    c->arguments = json_dumps(args, JSON_COMPACT | JSON_PRESERVE_ORDER);
    pd_random_id(c->id, sizeof c->id, "call_");
    (*n)++;
    return c->name && c->arguments ? PD_OK : PD_ENOMEM;
}

int pd_api_tool_calls_parse(const pd_chat_tool_syntax *syn, const char *t, size_t len, pd_api_tool_call **calls,
                            size_t *n_calls) {
    *calls = NULL;
    *n_calls = 0;
    char trigger[32];
    pd_api_tool_trigger(syn, trigger, sizeof trigger);
    if (len < strlen(trigger) || memcmp(t, trigger, strlen(trigger)) != 0) return PD_OK; /* text */
    size_t p = 0;
    int rc = PD_EFORMAT;
    if (syn->json_list) {
        /* open (which may end with the array's "["), the array, close */
        size_t open = strlen(syn->open);
        if (!eat(t, len, &p, syn->open)) goto fail;
        if (open && syn->open[open - 1] == '[') p--;
        p = skip_ws(t, len, p);
        json_t *arr = load_value(t, len, &p);
        if (!json_is_array(arr)) {
            json_decref(arr);
            goto fail;
        }
        size_t i;
        json_t *v;
        rc = PD_OK;
        json_array_foreach(arr, i, v) if (!rc) rc = add_call(syn, v, calls, n_calls);
        json_decref(arr);
        if (rc) goto fail;
        const char *close = syn->close;
        if (close[0] == ']') close++;
        if (!eat(t, len, &p, close)) goto fail_format;
    } else {
        for (;;) {
            if (!eat(t, len, &p, syn->open)) goto fail_format;
            p = skip_ws(t, len, p);
            json_t *obj = load_value(t, len, &p);
            rc = obj ? add_call(syn, obj, calls, n_calls) : PD_EFORMAT;
            json_decref(obj);
            if (rc) goto fail;
            size_t q = skip_ws(t, len, p);
            if (syn->close[0] && !eat(t, len, &q, syn->close + (syn->close[0] == '\n' ? 1 : 0))) goto fail_format;
            p = q;
            if (skip_ws(t, len, p) == len) break;
            if (!syn->parallel) goto fail_format;
            size_t s = p;
            if (syn->sep[0] && !eat(t, len, &s, syn->sep)) s = skip_ws(t, len, p);
            p = s;
        }
    }
    if (skip_ws(t, len, p) != len) goto fail_format;
    return PD_OK;
fail_format:
    rc = PD_EFORMAT;
fail:
    pd_api_tool_calls_free(*calls, *n_calls);
    *calls = NULL;
    *n_calls = 0;
    return rc;
}

void pd_api_tool_calls_free(pd_api_tool_call *calls, size_t n) {
    for (size_t i = 0; i < n; i++) {
        free(calls[i].name);
        free(calls[i].arguments);
    }
    free(calls);
}
