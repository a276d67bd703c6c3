/* Responses: one accumulator per request, rendered either as one JSON body
 * or as SSE chunks of what was appended since the previous chunk. */
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "api/api.h"

typedef struct lp_entry {
    pd_token token;
    float logprob;
    int32_t n_top;
    size_t offset; /* sum of the pieces of the tokens before it (text_offset) */
    pd_token_logprob top[PD_SAMPLER_MAX_LOGPROBS];
} lp_entry;

typedef struct choice_acc {
    char *text;
    size_t len, cap;
    lp_entry *lp;
    size_t n_lp, cap_lp;
    size_t piece_off;
    int64_t n_tokens;
    pd_finish_reason finish;
    /* streaming cursors */
    size_t sent_text, sent_lp;
    bool sent_role, sent_finish;
    bool text_decided; /* tool calls on: the text is known not to start with the trigger */
} choice_acc;

struct pd_api_response {
    pd_api_response_opts o;
    char id[PD_API_ID_MAX];
    char *model;
    choice_acc *ch;
    bool has_usage;
    pd_sched_usage usage;
    char trigger[32]; /* o.tool_calls: what starts calls in o.syntax */
};

/* ---------------------------------------------------------------- UTF-8 */

/* Length of the valid UTF-8 sequence at s[0..n), or 0 if invalid there. */
static size_t utf8_seq(const unsigned char *s, size_t n) {
    unsigned char c = s[0];
    if (c < 0x80) return 1;
    size_t L;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) L = 2, cp = c & 0x1F;
    else if (c >= 0xE0 && c <= 0xEF) L = 3, cp = c & 0x0F;
    else if (c >= 0xF0 && c <= 0xF4) L = 4, cp = c & 0x07;
    else return 0;
    if (n < L) return 0;
    for (size_t i = 1; i < L; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = cp << 6 | (s[i] & 0x3F);
    }
    if ((L == 3 && cp < 0x800) || (L == 4 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return L;
}

static bool utf8_valid(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        size_t L = utf8_seq((const unsigned char *)s + i, n - i);
        if (!L) return false;
        i += L;
    }
    return true;
}

/* Bytes at the end of s[0..n) that could start a character still to come:
 * a lead byte followed only by continuation bytes, fewer than it needs. */
static size_t utf8_incomplete_tail(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t back = 1; back <= 3 && back <= n; back++) {
        unsigned char c = u[n - back];
        if ((c & 0xC0) == 0x80) continue;
        size_t need = c >= 0xF0 && c <= 0xF4 ? 4 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xC2 && c <= 0xDF ? 2 : 1;
        return need > back ? back : 0;
    }
    return 0;
}

/* A JSON string of s[0..n) with invalid UTF-8 replaced by U+FFFD, one per
 * offending byte (the same result however the text is cut at character
 * boundaries, which keeps streamed and whole text equal). */
static json_t *json_utf8(const char *s, size_t n) {
    if (utf8_valid(s, n)) return json_stringn(s, n);
    uint64_t cap;
    if (!pd_mul_ok(n, 3, &cap) || !pd_add_ok(cap, 1, &cap) || cap > SIZE_MAX) return NULL;
    char *buf = malloc((size_t)cap);
    if (!buf) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        size_t L = utf8_seq((const unsigned char *)s + i, n - i);
        if (L) {
            memcpy(buf + o, s + i, L);
            o += L;
            i += L;
        } else {
            memcpy(buf + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        }
    }
    json_t *j = json_stringn(buf, o);
    free(buf);
    return j;
}

/* ---------------------------------------------------------------- create */

void pd_api_response_opts_from(const pd_api_request *r, const pd_tokenizer *tok, pd_api_response_opts *o) {
    memset(o, 0, sizeof *o);
    o->kind = r->kind;
    o->model = r->model;
    o->n_choices = r->n;
    o->logprobs = r->sampling.logprobs || r->sampling.n_logprobs > 0;
    o->n_logprobs = r->sampling.n_logprobs;
    o->include_usage = r->stream && r->include_usage;
    o->tok = tok;
}

/* ---------------------------------------------------------------- tool calls */

/* Whether a choice's text may still turn out to be calls: it is a prefix
 * of the trigger or starts with it. Once it cannot, it is plain content
 * for good (the text only grows). */
static bool may_be_calls(const pd_api_response *r, choice_acc *c) {
    if (!r->o.tool_calls || c->text_decided) return false;
    const size_t n = strlen(r->trigger), m = c->len < n ? c->len : n;
    if (m > 0 && memcmp(c->text, r->trigger, m) != 0) {
        c->text_decided = true;
        return false;
    }
    return true;
}

/* [{"id","type":"function","function":{"name","arguments"}}], with "index"
 * for stream deltas; NULL when the text is not whole calls. */
static json_t *tool_calls_json(const pd_api_response *r, const choice_acc *c, bool with_index) {
    pd_api_tool_call *calls = NULL;
    size_t n = 0;
    if (pd_api_tool_calls_parse(&r->o.syntax, c->text ? c->text : "", c->len, &calls, &n) || n == 0) return NULL;
    json_t *arr = json_array();
    for (size_t i = 0; arr && i < n; i++) {
        json_t *call = json_pack("{s:s,s:s,s:{s:s,s:s}}", "id", calls[i].id, "type", "function", "function", "name",
                                 calls[i].name, "arguments", calls[i].arguments);
        if (call && with_index && json_object_set_new(call, "index", json_integer((json_int_t)i))) {
            json_decref(call);
            call = NULL;
        }
        if (!call || json_array_append_new(arr, call)) {
            json_decref(arr);
            arr = NULL;
        }
    }
    pd_api_tool_calls_free(calls, n);
    return arr;
}

int pd_api_response_create(const pd_api_response_opts *o, pd_api_response **out, pd_error *err) {
    *out = NULL;
    if (!o || o->n_choices < 1 || o->n_choices > 4096)
        return pd_errorf(err, PD_EINVAL, "response: n_choices must be in [1, 4096]");
    if (o->n_logprobs < 0 || o->n_logprobs > PD_SAMPLER_MAX_LOGPROBS)
        return pd_errorf(err, PD_EINVAL, "response: n_logprobs must be in [0, %d]", PD_SAMPLER_MAX_LOGPROBS);
    pd_api_response *r = calloc(1, sizeof *r);
    if (!r) return pd_errorf(err, PD_ENOMEM, "response: out of memory");
    r->o = *o;
    r->model = strdup(o->model ? o->model : "");
    r->ch = calloc((size_t)o->n_choices, sizeof *r->ch);
    if (!r->model || !r->ch) {
        pd_api_response_free(r);
        return pd_errorf(err, PD_ENOMEM, "response: out of memory");
    }
    r->o.model = r->model;
    if (o->id && o->id[0]) {
        if (strlen(o->id) >= sizeof r->id) {
            pd_api_response_free(r);
            return pd_errorf(err, PD_EINVAL, "response: id longer than %d characters", PD_API_ID_MAX - 1);
        }
        snprintf(r->id, sizeof r->id, "%s", o->id);
    } else {
        pd_random_id(r->id, sizeof r->id, o->kind == PD_API_CHAT ? "chatcmpl-" : "cmpl-");
    }
    if (r->o.created == 0) r->o.created = (int64_t)time(NULL);
    if (r->o.tool_calls) pd_api_tool_trigger(&r->o.syntax, r->trigger, sizeof r->trigger);
    *out = r;
    return PD_OK;
}

void pd_api_response_free(pd_api_response *r) {
    if (!r) return;
    if (r->ch)
        for (int i = 0; i < r->o.n_choices; i++) {
            free(r->ch[i].text);
            free(r->ch[i].lp);
        }
    free(r->ch);
    free(r->model);
    free(r);
}

const char *pd_api_response_id(const pd_api_response *r) { return r->id; }

static int check_choice(const pd_api_response *r, int choice, pd_error *err) {
    if (choice < 0 || choice >= r->o.n_choices)
        return pd_errorf(err, PD_EINVAL, "response: choice %d is outside [0, %d)", choice, r->o.n_choices);
    return PD_OK;
}

/* Grow *buf (element size `size`) to hold at least `need` elements. */
static int grow(void **buf, size_t *cap, size_t need, size_t size) {
    if (need <= *cap) return PD_OK;
    size_t nc = *cap ? *cap : 16;
    while (nc < need) {
        if (nc > SIZE_MAX / 2) return PD_ENOMEM;
        nc *= 2;
    }
    uint64_t bytes;
    if (!pd_mul_ok(nc, size, &bytes) || bytes > SIZE_MAX) return PD_ENOMEM;
    void *p = realloc(*buf, (size_t)bytes);
    if (!p) return PD_ENOMEM;
    *buf = p;
    *cap = nc;
    return PD_OK;
}

static size_t piece_len(const pd_tokenizer *tok, pd_token id) {
    if (!tok) return 0;
    char small[64];
    int n = pd_token_to_piece(tok, id, true, small, sizeof small);
    return n > 0 ? (size_t)n : 0;
}

int pd_api_response_token(pd_api_response *r, int choice, const char *text, size_t len,
                          const pd_sample_result *sample, pd_error *err) {
    int rc = check_choice(r, choice, err);
    if (rc) return rc;
    choice_acc *c = &r->ch[choice];
    if (c->finish != PD_FINISH_NONE) return pd_errorf(err, PD_EINVAL, "response: choice %d already finished", choice);
    if (len) {
        if (!text) return pd_errorf(err, PD_EINVAL, "response: text is NULL");
        size_t need = c->len + len + 1;
        if (need < len || grow((void **)&c->text, &c->cap, need, 1))
            return pd_errorf(err, PD_ENOMEM, "response: out of memory for the text of choice %d", choice);
        memcpy(c->text + c->len, text, len);
        c->len += len;
        c->text[c->len] = '\0';
    }
    c->n_tokens++;
    if (r->o.logprobs && sample) {
        if (grow((void **)&c->lp, &c->cap_lp, c->n_lp + 1, sizeof *c->lp))
            return pd_errorf(err, PD_ENOMEM, "response: out of memory for logprobs of choice %d", choice);
        lp_entry *e = &c->lp[c->n_lp++];
        e->token = sample->token;
        e->logprob = sample->has_logprob ? sample->logprob : 0.0f;
        int32_t k = sample->n_top < r->o.n_logprobs ? sample->n_top : r->o.n_logprobs;
        e->n_top = k < 0 ? 0 : k;
        memcpy(e->top, sample->top, (size_t)e->n_top * sizeof e->top[0]);
        e->offset = c->piece_off;
        c->piece_off += piece_len(r->o.tok, sample->token);
    }
    return PD_OK;
}

int pd_api_response_finish(pd_api_response *r, int choice, pd_finish_reason reason, pd_error *err) {
    int rc = check_choice(r, choice, err);
    if (rc) return rc;
    if (reason != PD_FINISH_STOP && reason != PD_FINISH_LENGTH)
        return pd_errorf(err, PD_EINVAL, "response: finish reason must be stop or length");
    r->ch[choice].finish = reason;
    return PD_OK;
}

void pd_api_response_usage(pd_api_response *r, const pd_sched_usage *u) {
    if (!u) return;
    r->usage = *u;
    r->has_usage = true;
}

/* ---------------------------------------------------------------- rendering */

/* Set or fail: jansson's set_new steals the value even on failure. */
#define SET(obj, key, val)                                         \
    do {                                                           \
        if (json_object_set_new((obj), (key), (val))) goto oom;    \
    } while (0)
#define APPEND(arr, val)                                           \
    do {                                                           \
        if (json_array_append_new((arr), (val))) goto oom;         \
    } while (0)

/* The token's text for logprobs: its piece when valid UTF-8, else OpenAI's
 * "bytes:\xNN..." spelling. */
static json_t *token_string(const pd_tokenizer *tok, pd_token id, char *piece, size_t cap, size_t *plen) {
    *plen = 0;
    if (tok) {
        int n = pd_token_to_piece(tok, id, true, piece, cap);
        if (n > 0) *plen = (size_t)n < cap ? (size_t)n : cap - 1;
    }
    if (utf8_valid(piece, *plen)) return json_stringn(piece, *plen);
    char hex[6 + 4 * 256 + 1];
    size_t o = (size_t)snprintf(hex, sizeof hex, "bytes:");
    for (size_t i = 0; i < *plen && o + 5 < sizeof hex; i++)
        o += (size_t)snprintf(hex + o, sizeof hex - o, "\\x%02x", (unsigned char)piece[i]);
    return json_stringn(hex, o);
}

static double finite_lp(float lp) { return isfinite(lp) ? (double)lp : -9999.0; }

static json_t *bytes_array(const char *p, size_t n) {
    json_t *a = json_array();
    if (!a) return NULL;
    for (size_t i = 0; i < n; i++)
        if (json_array_append_new(a, json_integer((unsigned char)p[i]))) {
            json_decref(a);
            return NULL;
        }
    return a;
}

/* logprobs of entries [from, to) of a choice, in the kind's shape. */
static json_t *logprobs_json(const pd_api_response *r, const choice_acc *c, size_t from, size_t to) {
    char piece[256];
    size_t plen;
    json_t *obj = json_object();
    if (!obj) return NULL;
    if (r->o.kind == PD_API_CHAT) {
        json_t *content = json_array();
        SET(obj, "content", content);
        for (size_t i = from; i < to; i++) {
            const lp_entry *e = &c->lp[i];
            json_t *t = json_object();
            APPEND(content, t);
            SET(t, "token", token_string(r->o.tok, e->token, piece, sizeof piece, &plen));
            SET(t, "logprob", json_real(finite_lp(e->logprob)));
            SET(t, "bytes", bytes_array(piece, plen));
            json_t *tops = json_array();
            SET(t, "top_logprobs", tops);
            for (int32_t k = 0; k < e->n_top; k++) {
                json_t *alt = json_object();
                APPEND(tops, alt);
                SET(alt, "token", token_string(r->o.tok, e->top[k].token, piece, sizeof piece, &plen));
                SET(alt, "logprob", json_real(finite_lp(e->top[k].logprob)));
                SET(alt, "bytes", bytes_array(piece, plen));
            }
        }
        return obj;
    }
    json_t *tokens = json_array();
    SET(obj, "tokens", tokens);
    json_t *lps = json_array();
    SET(obj, "token_logprobs", lps);
    json_t *tops = json_array();
    SET(obj, "top_logprobs", tops);
    json_t *offs = json_array();
    SET(obj, "text_offset", offs);
    for (size_t i = from; i < to; i++) {
        const lp_entry *e = &c->lp[i];
        APPEND(tokens, token_string(r->o.tok, e->token, piece, sizeof piece, &plen));
        APPEND(lps, json_real(finite_lp(e->logprob)));
        json_t *alt = json_object();
        APPEND(tops, alt);
        for (int32_t k = 0; k < e->n_top; k++) {
            json_t *s = token_string(r->o.tok, e->top[k].token, piece, sizeof piece, &plen);
            if (!s) goto oom;
            /* keys are C strings: a piece with a NUL byte is cut there */
            const char *key = json_string_value(s);
            int bad = json_object_set_new(alt, key, json_real(finite_lp(e->top[k].logprob)));
            json_decref(s);
            if (bad) goto oom;
        }
        APPEND(offs, json_integer((json_int_t)e->offset));
    }
    return obj;
oom:
    json_decref(obj);
    return NULL;
}

static json_t *usage_json(const pd_api_response *r) {
    int64_t completion = 0;
    for (int i = 0; i < r->o.n_choices; i++) completion += r->ch[i].n_tokens;
    int64_t prompt = 0, cached = 0;
    if (r->has_usage) {
        prompt = r->usage.prompt_tokens;
        cached = r->usage.cached_tokens;
        if (r->usage.completion_tokens > 0) completion = r->usage.completion_tokens;
    }
    json_t *u = json_object(), *d = json_object();
    if (!u || !d) goto oom;
    SET(u, "prompt_tokens", json_integer(prompt));
    SET(u, "completion_tokens", json_integer(completion));
    SET(u, "total_tokens", json_integer(prompt + completion));
    SET(d, "cached_tokens", json_integer(cached));
    if (json_object_set(u, "prompt_tokens_details", d)) goto oom;
    json_decref(d);
    return u;
oom:
    json_decref(u);
    json_decref(d);
    return NULL;
}

/* kept_tokens: the prefix's kept (layer, head, token) rows expressed as
 * tokens, i.e. original_tokens * kept_rows / full_rows, rounded. kind
 * "registered" (a stored prefix: id and policy) or "auto" (exact blocks of
 * the automatic cache: neither). */
static int add_prefix(const pd_api_response *r, json_t *root) {
    if (!r->has_usage || !r->usage.prefix_used) return 0;
    const pd_sched_usage *u = &r->usage;
    char hex[PD_PREFIX_ID_HEX];
    pd_prefix_id_hex(&u->prefix_id, hex);
    double frac = u->prefix_full_rows > 0 ? (double)u->prefix_kept_rows / (double)u->prefix_full_rows : 1.0;
    const bool registered = u->prefix_kind == PD_PREFIX_REGISTERED;
    json_t *p = json_object();
    if (!p) return -1;
    if (json_object_set_new(p, "kind", json_string(registered ? "registered" : "auto")) ||
        (registered && json_object_set_new(p, "id", json_string(hex))) ||
        json_object_set_new(p, "original_tokens", json_integer(u->cached_tokens)) ||
        json_object_set_new(p, "kept_tokens", json_integer((json_int_t)llround(frac * (double)u->cached_tokens))) ||
        json_object_set_new(p, "kept_fraction", json_real(frac)) ||
        (registered &&
         json_object_set_new(p, "policy", json_utf8(u->prefix_spec, strnlen(u->prefix_spec, sizeof u->prefix_spec))))) {
        json_decref(p);
        return -1;
    }
    return json_object_set_new(root, "prefix", p);
}

static json_t *base_object(const pd_api_response *r, const char *object) {
    json_t *o = json_object();
    if (!o) return NULL;
    SET(o, "id", json_string(r->id));
    SET(o, "object", json_string(object));
    SET(o, "created", json_integer(r->o.created));
    SET(o, "model", json_utf8(r->model, strlen(r->model)));
    return o;
oom:
    json_decref(o);
    return NULL;
}

static json_t *finish_json(pd_finish_reason f) {
    const char *name = pd_finish_reason_name(f);
    return name ? json_string(name) : json_null();
}

static int dump(json_t *root, bool sse, char **out, size_t *len, pd_error *err) {
    char *s = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (!s) return pd_errorf(err, PD_ENOMEM, "response: out of memory rendering JSON");
    size_t n = strlen(s);
    if (!sse) {
        *out = s;
        if (len) *len = n;
        return PD_OK;
    }
    char *e = malloc(n + 9);
    if (!e) {
        free(s);
        return pd_errorf(err, PD_ENOMEM, "response: out of memory rendering an event");
    }
    memcpy(e, "data: ", 6);
    memcpy(e + 6, s, n);
    memcpy(e + 6 + n, "\n\n", 3);
    free(s);
    *out = e;
    if (len) *len = n + 8;
    return PD_OK;
}

int pd_api_response_json(const pd_api_response *r, char **out, size_t *len, pd_error *err) {
    *out = NULL;
    if (len) *len = 0;
    bool chat = r->o.kind == PD_API_CHAT;
    json_t *root = base_object(r, chat ? "chat.completion" : "text_completion");
    if (!root) return pd_errorf(err, PD_ENOMEM, "response: out of memory");
    json_t *choices = json_array();
    SET(root, "choices", choices);
    for (int i = 0; i < r->o.n_choices; i++) {
        const choice_acc *c = &r->ch[i];
        json_t *ch = json_object();
        APPEND(choices, ch);
        SET(ch, "index", json_integer(i));
        json_t *calls = chat && r->o.tool_calls ? tool_calls_json(r, c, false) : NULL;
        if (chat) {
            json_t *msg = json_object();
            SET(ch, "message", msg);
            SET(msg, "role", json_string("assistant"));
            SET(msg, "content", calls ? json_null() : json_utf8(c->text ? c->text : "", c->len));
            if (calls) SET(msg, "tool_calls", calls);
        } else {
            SET(ch, "text", json_utf8(c->text ? c->text : "", c->len));
        }
        SET(ch, "logprobs", r->o.logprobs ? logprobs_json(r, c, 0, c->n_lp) : json_null());
        SET(ch, "finish_reason", calls ? json_string("tool_calls") : finish_json(c->finish));
    }
    SET(root, "usage", usage_json(r));
    if (add_prefix(r, root)) goto oom;
    return dump(root, false, out, len, err);
oom:
    json_decref(root);
    return pd_errorf(err, PD_ENOMEM, "response: out of memory rendering JSON");
}

/* One chunk for one choice: the text and logprobs since the last chunk
 * (all of it when final), and the finish reason when final. */
static int sse_choice(pd_api_response *r, int choice, bool final, char **out, size_t *len, pd_error *err) {
    *out = NULL;
    if (len) *len = 0;
    int rc = check_choice(r, choice, err);
    if (rc) return rc;
    choice_acc *c = &r->ch[choice];
    bool chat = r->o.kind == PD_API_CHAT;
    if (c->sent_finish) return PD_OK;
    if (final && c->finish == PD_FINISH_NONE)
        return pd_errorf(err, PD_EINVAL, "response: choice %d has not finished", choice);
    size_t end = final ? c->len : c->len - utf8_incomplete_tail(c->text, c->len);
    size_t lp_end = c->n_lp;
    /* Text that may still be calls is held; at the end it is sent as
     * calls when it parses as such, else as the content it is. */
    const bool held = chat && may_be_calls(r, c);
    json_t *calls = NULL;
    if (held && !final) end = c->sent_text, lp_end = c->sent_lp;
    if (held && final) calls = tool_calls_json(r, c, true);
    bool role = chat && !c->sent_role;
    if (!final && !role && end == c->sent_text && lp_end == c->sent_lp) return PD_OK;

    json_t *root = base_object(r, chat ? "chat.completion.chunk" : "text_completion");
    if (!root) return pd_errorf(err, PD_ENOMEM, "response: out of memory");
    json_t *choices = json_array();
    SET(root, "choices", choices);
    json_t *ch = json_object();
    APPEND(choices, ch);
    SET(ch, "index", json_integer(choice));
    const char *delta_text = c->text ? c->text + c->sent_text : "";
    if (chat) {
        json_t *delta = json_object();
        SET(ch, "delta", delta);
        if (role) SET(delta, "role", json_string("assistant"));
        if (calls) {
            SET(delta, "tool_calls", calls);
            calls = NULL;
        } else if (role || end > c->sent_text) {
            SET(delta, "content", json_utf8(delta_text, end - c->sent_text));
        }
    } else {
        SET(ch, "text", json_utf8(delta_text, end - c->sent_text));
    }
    SET(ch, "logprobs", r->o.logprobs && lp_end > c->sent_lp ? logprobs_json(r, c, c->sent_lp, lp_end) : json_null());
    SET(ch, "finish_reason", final ? (held && json_object_get(json_object_get(ch, "delta"), "tool_calls")
                                           ? json_string("tool_calls") : finish_json(c->finish))
                                   : json_null());
    if (r->o.include_usage) SET(root, "usage", json_null());
    if (final && add_prefix(r, root)) goto oom;
    rc = dump(root, true, out, len, err);
    if (rc) return rc;
    c->sent_text = end;
    c->sent_lp = lp_end;
    c->sent_role = true;
    if (final) c->sent_finish = true;
    return PD_OK;
oom:
    json_decref(calls);
    json_decref(root);
    return pd_errorf(err, PD_ENOMEM, "response: out of memory rendering a chunk");
}

int pd_api_response_sse_chunk(pd_api_response *r, int choice, char **out, size_t *len, pd_error *err) {
    return sse_choice(r, choice, false, out, len, err);
}

int pd_api_response_sse_finish(pd_api_response *r, int choice, char **out, size_t *len, pd_error *err) {
    return sse_choice(r, choice, true, out, len, err);
}

int pd_api_response_sse_usage(pd_api_response *r, char **out, size_t *len, pd_error *err) {
    *out = NULL;
    if (len) *len = 0;
    if (!r->o.include_usage) return PD_OK;
    bool chat = r->o.kind == PD_API_CHAT;
    json_t *root = base_object(r, chat ? "chat.completion.chunk" : "text_completion");
    if (!root) return pd_errorf(err, PD_ENOMEM, "response: out of memory");
    SET(root, "choices", json_array());
    SET(root, "usage", usage_json(r));
    if (add_prefix(r, root)) goto oom;
    return dump(root, true, out, len, err);
oom:
    json_decref(root);
    return pd_errorf(err, PD_ENOMEM, "response: out of memory rendering the usage chunk");
}

/* ---------------------------------------------------------------- models */

void pd_api_model_id(const pd_gguf *g, const char *path, char *out, size_t cap) {
    if (!cap) return;
    out[0] = '\0';
    pd_str name = {0};
    pd_error err = {0};
    if (g && pd_gguf_get_str(g, "general.name", &name, &err) == PD_OK && name.len > 0 &&
        utf8_valid(name.ptr, (size_t)name.len) && !memchr(name.ptr, '\0', (size_t)name.len)) {
        size_t n = name.len < cap ? (size_t)name.len : cap - 1;
        memcpy(out, name.ptr, n);
        out[n] = '\0';
        return;
    }
    const char *base = path ? strrchr(path, '/') : NULL;
    base = base ? base + 1 : path ? path : "model";
    size_t n = strlen(base);
    if (n >= 5 && strcmp(base + n - 5, ".gguf") == 0) n -= 5;
    if (n == 0) base = "model", n = 5;
    if (n >= cap) n = cap - 1;
    memcpy(out, base, n);
    out[n] = '\0';
}

bool pd_api_model_served(const char *names, const char *model_id, const char *requested) {
    if (!requested) return false;
    if (!names || !*names) return strcmp(requested, model_id) == 0;
    const size_t n = strlen(requested);
    for (const char *p = names;;) {
        const char *end = strchr(p, ',');
        const size_t k = end ? (size_t)(end - p) : strlen(p);
        if (k == n && memcmp(p, requested, n) == 0) return true;
        if (!end) return false;
        p = end + 1;
    }
}

/* The OpenAI Model object. */
static json_t *model_object(const char *id, int64_t created) {
    json_t *m = json_object();
    if (!m) return NULL;
    SET(m, "id", json_utf8(id ? id : "", id ? strlen(id) : 0));
    SET(m, "object", json_string("model"));
    SET(m, "created", json_integer(created));
    SET(m, "owned_by", json_string("prefixd"));
    return m;
oom:
    json_decref(m);
    return NULL;
}

int pd_api_models_json(const char *model_id, int64_t created, char **out, size_t *len, pd_error *err) {
    *out = NULL;
    if (len) *len = 0;
    json_t *root = json_object();
    if (!root) return pd_errorf(err, PD_ENOMEM, "models: out of memory");
    SET(root, "object", json_string("list"));
    json_t *data = json_array();
    SET(root, "data", data);
    APPEND(data, model_object(model_id, created));
    return dump(root, false, out, len, err);
oom:
    json_decref(root);
    return pd_errorf(err, PD_ENOMEM, "models: out of memory");
}

int pd_api_model_json(const char *id, int64_t created, char **out, size_t *len, pd_error *err) {
    *out = NULL;
    if (len) *len = 0;
    json_t *m = model_object(id, created);
    if (!m) return pd_errorf(err, PD_ENOMEM, "models: out of memory");
    return dump(m, false, out, len, err);
}

/* ---------------------------------------------------------------- tokenize */

/* One {"id","piece"}: the piece as a string when it is valid UTF-8 by
 * itself, else its bytes (a character split across tokens), as
 * llama-server answers. */
static json_t *piece_object(const pd_tokenizer *tok, pd_token id) {
    char small[256], *piece = small;
    json_t *o = json_object();
    if (!o) return NULL;
    int n = pd_token_to_piece(tok, id, true, small, sizeof small);
    if (n < 0) n = 0;
    if ((size_t)n >= sizeof small) {
        if (!(piece = malloc((size_t)n + 1))) goto oom;
        pd_token_to_piece(tok, id, true, piece, (size_t)n + 1);
    }
    SET(o, "id", json_integer(id));
    SET(o, "piece", utf8_valid(piece, (size_t)n) ? json_stringn(piece, (size_t)n) : bytes_array(piece, (size_t)n));
    if (piece != small) free(piece);
    return o;
oom:
    if (piece != small) free(piece);
    json_decref(o);
    return NULL;
}

int pd_api_tokens_json(const pd_tokenizer *tok, const pd_token *ids, size_t n, bool with_pieces, char **out,
                       size_t *len, pd_error *err) {
    *out = NULL;
    if (len) *len = 0;
    json_t *root = json_object();
    if (!root) return pd_errorf(err, PD_ENOMEM, "tokenize: out of memory");
    json_t *arr = json_array();
    SET(root, "tokens", arr);
    for (size_t i = 0; i < n; i++) APPEND(arr, with_pieces ? piece_object(tok, ids[i]) : json_integer(ids[i]));
    return dump(root, false, out, len, err);
oom:
    json_decref(root);
    return pd_errorf(err, PD_ENOMEM, "tokenize: out of memory");
}

int pd_api_content_json(const char *text, size_t n, char **out, size_t *len, pd_error *err) {
    *out = NULL;
    if (len) *len = 0;
    json_t *root = json_object();
    if (!root) return pd_errorf(err, PD_ENOMEM, "detokenize: out of memory");
    SET(root, "content", json_utf8(text, n));
    return dump(root, false, out, len, err);
oom:
    json_decref(root);
    return pd_errorf(err, PD_ENOMEM, "detokenize: out of memory");
}
