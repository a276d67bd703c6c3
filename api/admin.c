/* The admin API: register prefixes (precompression jobs), read job status,
 * list, show and delete stored prefixes. Pure request -> JSON answer; the
 * server does the HTTP and the authentication (server.c). */
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"

#define ADMIN_MAX_SEGMENTS 256
#define ADMIN_MAX_KEEP_TEXT 64
#define JOBS_URL "/admin/v1/jobs/"
#define PREFIXES_URL "/admin/v1/prefixes"
#define POLICIES_URL "/admin/v1/policies"
#define SHARED_URL "/admin/v1/shared/prefixes"

#define BAD(e, param, ...) pd_api_errorf((e), 400, PD_API_ERR_INVALID, (param), NULL, __VA_ARGS__)

/* ---- JSON answers ------------------------------------------------------------- */

static json_t *num_or_null(double v) {
    return isfinite(v) ? json_real(v) : json_null();
}

/* The curve calibration chose the retention from, its measured points and
 * what it chose; null without one. NULL when out of memory. */
static json_t *calibration_json(const pd_prefix_quality *q) {
    if (!q->has_curve) return json_null();
    json_t *points = json_array();
    for (int32_t i = 0; points && i < q->n_points; i++)
        if (json_array_append_new(points, json_pack("{s:f,s:f}", "retention", q->point_retention[i], "nll_ratio",
                                                     q->point_ratio[i]))) {
            json_decref(points);
            points = NULL;
        }
    if (!points) return NULL;
    return json_pack("{s:f,s:f,s:o,s:o,s:o,s:o}", "a", q->curve_a, "b", q->curve_b, "points", points, "chosen",
                     num_or_null(q->retention), "measured", num_or_null(q->nll_ratio), "tau", num_or_null(q->tau));
}

/* The JSON object for a stored prefix (id, tokens, kept_rows, kept_fraction,
 * policy, namespace, pinned, dtype, bytes, hits, quality, calibration,
 * created_at, last_used); NULL when out of memory. */
static json_t *prefix_json(const pd_prefix_info *info) {
    char hex[PD_PREFIX_ID_HEX];
    pd_prefix_id_hex(&info->id, hex);
    /* kept_fraction: kept rows over every (token, layer, kv head) row. */
    double full = (double)info->n_tokens * (double)info->n_layer * (double)info->n_head_kv;
    json_t *q = json_pack("{s:o,s:o,s:o,s:o}", "retention", num_or_null(info->quality.retention), "tau",
                          num_or_null(info->quality.tau), "nll_full", num_or_null(info->quality.nll_full),
                          "nll_ratio", num_or_null(info->quality.nll_ratio));
    if (!q) return NULL;
    json_t *calib = calibration_json(&info->quality);
    if (!calib) {
        json_decref(q);
        return NULL;
    }
    return json_pack("{s:s,s:s,s:I,s:I,s:f,s:s,s:s,s:b,s:s,s:I,s:I,s:o,s:o,s:I,s:I}", "id", hex, "object", "prefix",
                     "tokens", (json_int_t)info->n_tokens, "kept_rows", (json_int_t)info->kept_rows, "kept_fraction",
                     full > 0 ? (double)info->kept_rows / full : 0.0, "policy", info->spec, "namespace", info->ns,
                     "pinned", (int)info->pinned, "dtype", pd_kv_dtype_name(info->dtype), "bytes",
                     (json_int_t)info->bytes, "hits", (json_int_t)(info->hits > INT64_MAX ? INT64_MAX : info->hits),
                     "quality", q, "calibration", calib, "created_at", (json_int_t)info->created_at, "last_used",
                     (json_int_t)info->last_used);
}

static json_t *job_json(const pd_job_status *st) {
    json_t *prefix = NULL;
    if (st->state == PD_JOB_DONE && !(prefix = prefix_json(&st->info))) return NULL;
    char url[64];
    snprintf(url, sizeof url, JOBS_URL "%" PRIu64, st->id);
    return json_pack("{s:I,s:s,s:s,s:s,s:f,s:o,s:o,s:b,s:o,s:o}", "id", (json_int_t)st->id, "object", "job", "state",
                     pd_job_state_name(st->state), "phase", st->phase, "progress", st->progress, "error",
                     st->state == PD_JOB_FAILED ? json_string(st->error) : json_null(), "prefix",
                     prefix ? prefix : json_null(), "existed", (int)(st->state == PD_JOB_DONE && st->existed),
                     "chosen_retention", st->state == PD_JOB_DONE ? num_or_null(st->chosen_retention) : json_null(),
                     "status_url", json_string(url));
}

/* Takes j (may be NULL: out of memory). */
static int reply(json_t *j, int status, pd_admin_reply *out, pd_api_error *e) {
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!s) return pd_api_errorf(e, 503, PD_API_ERR_OVERLOADED, NULL, "out_of_memory", "out of memory");
    out->status = status;
    out->body = s;
    out->len = strlen(s);
    return PD_OK;
}

/* ---- registration -------------------------------------------------------------- */

/* What a registration body asks for, with what it owns. */
typedef struct reg {
    pd_token *tokens;
    size_t n;
    pd_span *spans;
    int n_spans;
    pd_layout layout; /* what the job gets: the spans (segments or auto) and kept ranges */
} reg;

static void reg_free(reg *r) {
    free(r->tokens);
    free(r->spans);
    pd_layout_free(&r->layout);
}

static int tokenize(const pd_admin_ctx *ctx, const char *text, size_t len, bool parse_special, pd_token **out,
                    size_t *n, const char *param, pd_api_error *e) {
    pd_error err = {0};
    pd_tokenize_opts o = {.add_special = true, .parse_special = parse_special};
    if (pd_tokenize(pd_model_tokenizer(ctx->b.model), text, len, o, out, n, &err))
        return pd_api_error_from(e, &err, param);
    return PD_OK;
}

/* Completions tokenize their text with BOS and without control tokens:
 * the prefix must be tokenized the same way to match them. */
static int reg_text(const pd_admin_ctx *ctx, json_t *v, reg *r, pd_api_error *e) {
    if (!json_is_string(v)) return BAD(e, "text", "'text' must be a string");
    size_t len = json_string_length(v);
    const char *s = json_string_value(v);
    if (len == 0) return BAD(e, "text", "'text' is empty: send the prefix text to store");
    if (strlen(s) != len) return BAD(e, "text", "'text' contains a NUL character");
    return tokenize(ctx, s, len, false, &r->tokens, &r->n, "text", e);
}

/* The leading system message(s) rendered with the model's chat template,
 * tokenized as chat requests are (BOS, control tokens parsed). The
 * scheduler finds a stored prefix only if its tokens begin the request's
 * tokens, so that is checked on the conversation given (with a placeholder
 * user turn when it holds only system messages). */
static int reg_messages(const pd_admin_ctx *ctx, json_t *v, json_t *tools, reg *r, pd_api_error *e) {
    if (ctx->b.family == PD_CHAT_NONE)
        return pd_api_errorf(e, 400, PD_API_ERR_INVALID, "messages", "no_chat_template",
                             "the model has no chat template prefixd recognises (tokenizer.chat_template); "
                             "register the prefix as 'text' instead");
    if (!json_is_array(v) || json_array_size(v) == 0)
        return BAD(e, "messages", "'messages' must be a non-empty array of {\"role\",\"content\"}");
    json_t *first = json_array_get(v, 0);
    json_t *role = json_is_object(first) ? json_object_get(first, "role") : NULL;
    if (!json_is_string(role) || strcmp(json_string_value(role), "system") != 0)
        return BAD(e, "messages[0].role", "the first message must be a system message: it becomes the prefix");
    bool only_system = true;
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *ro = json_object_get(json_array_get(v, i), "role");
        if (!json_is_string(ro) || strcmp(json_string_value(ro), "system") != 0) only_system = false;
    }
    /* Let the public request parser validate the messages (roles, content
     * parts) so that both accept exactly the same conversations. */
    json_t *wrap = json_pack("{s:s,s:O}", "model", "prefixd", "messages", v);
    /* tools render into the system part for most families (the tool list
     * is part of the prefix chat requests with the same tools send) */
    if (wrap && tools && json_object_set(wrap, "tools", tools)) {
        json_decref(wrap);
        wrap = NULL;
    }
    if (wrap && only_system) {
        json_t *u = json_pack("{s:s,s:s}", "role", "user", "content", "Hello");
        if (!u || json_array_append_new(json_object_get(wrap, "messages"), u)) {
            json_decref(wrap);
            wrap = NULL;
        }
    }
    char *body = wrap ? json_dumps(wrap, JSON_COMPACT) : NULL;
    json_decref(wrap);
    if (!body) return pd_api_errorf(e, 503, PD_API_ERR_OVERLOADED, NULL, "out_of_memory", "out of memory");
    pd_api_request areq;
    pd_api_limits lim;
    pd_api_limits_default(&lim);
    lim.max_body_bytes = SIZE_MAX;
    int rc = pd_api_parse_request(PD_API_CHAT, body, strlen(body), &lim, &areq, e);
    free(body);
    if (rc) return rc;
    pd_token *full = NULL;
    int64_t n_full = 0;
    size_t sys = 0;
    lim.max_prompt_tokens = INT64_MAX;
    rc = pd_api_prompt_tokens(&areq, pd_model_tokenizer(ctx->b.model), ctx->b.family, &lim, &full, &n_full, &sys, e);
    char *text = NULL;
    pd_error err = {0};
    if (!rc && sys == 0)
        rc = BAD(e, "messages", "the %s chat template does not render the system message as a separate leading "
                 "part, so it cannot be stored as a prefix", pd_chat_family_name(ctx->b.family));
    if (!rc && pd_chat_render_tools(ctx->b.family, areq.messages, areq.n_messages, areq.tools, areq.n_tools, true,
                                    &text, NULL, NULL, &err))
        rc = pd_api_error_from(e, &err, "messages");
    if (!rc) rc = tokenize(ctx, text, sys, true, &r->tokens, &r->n, "messages", e);
    if (!rc && (r->n > (size_t)n_full || memcmp(r->tokens, full, r->n * sizeof *full) != 0))
        rc = BAD(e, "messages", "the system part tokenizes differently alone than in the conversation, so chat "
                 "requests would never match it; end the system message with whitespace or punctuation");
    free(text);
    free(full);
    pd_api_request_free(&areq);
    return rc;
}

/* Span names become part of the layout text in the cache key. */
static bool good_span_name(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n >= sizeof((pd_span *)0)->name) return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-'))
            return false;
    }
    return true;
}

/* Segments are concatenated and tokenized as one text (as completions will
 * send it). A segment ends at the first token where the tokens of the text
 * up to its end stop agreeing with the whole: a token straddling two
 * segments belongs to the later one. */
static int reg_segments(const pd_admin_ctx *ctx, json_t *v, reg *r, pd_api_error *e) {
    size_t ns = json_is_array(v) ? json_array_size(v) : 0;
    if (ns == 0 || ns > ADMIN_MAX_SEGMENTS)
        return BAD(e, "segments", "'segments' must be an array of 1 to %d {\"name\",\"text\",\"keep\"} objects",
                   ADMIN_MAX_SEGMENTS);
    size_t *ends = calloc(ns, sizeof *ends);
    r->spans = calloc(ns, sizeof *r->spans);
    char *all = NULL;
    size_t len = 0;
    char param[64];
    int rc = ends && r->spans ? PD_OK
                              : pd_api_errorf(e, 503, PD_API_ERR_OVERLOADED, NULL, "out_of_memory", "out of memory");
    for (size_t i = 0; !rc && i < ns; i++) {
        json_t *s = json_array_get(v, i), *name = json_object_get(s, "name"), *text = json_object_get(s, "text"),
               *keep = json_object_get(s, "keep");
        snprintf(param, sizeof param, "segments[%zu]", i);
        if (!json_is_object(s)) {
            rc = BAD(e, param, "%s must be an object {\"name\",\"text\",\"keep\"}", param);
        } else if (!json_is_string(name) || !good_span_name(json_string_value(name))) {
            snprintf(param, sizeof param, "segments[%zu].name", i);
            rc = BAD(e, param, "%s must be 1 to 31 letters, digits, '_' or '-'", param);
        } else if (!json_is_string(text) || json_string_length(text) == 0 ||
                   strlen(json_string_value(text)) != json_string_length(text)) {
            snprintf(param, sizeof param, "segments[%zu].text", i);
            rc = BAD(e, param, "%s must be a non-empty string without NUL characters", param);
        } else if (keep && !json_is_boolean(keep) && !json_is_null(keep)) {
            snprintf(param, sizeof param, "segments[%zu].keep", i);
            rc = BAD(e, param, "%s must be true or false", param);
        } else {
            size_t n = json_string_length(text);
            char *grown = n <= SIZE_MAX - len - 1 ? realloc(all, len + n + 1) : NULL;
            if (!grown) {
                rc = pd_api_errorf(e, 503, PD_API_ERR_OVERLOADED, NULL, "out_of_memory", "out of memory");
                break;
            }
            all = grown;
            memcpy(all + len, json_string_value(text), n);
            len += n;
            all[len] = '\0';
            ends[i] = len;
            snprintf(r->spans[i].name, sizeof r->spans[i].name, "%s", json_string_value(name));
            r->spans[i].whitelist = json_is_true(keep);
        }
    }
    if (!rc) rc = tokenize(ctx, all, len, false, &r->tokens, &r->n, "segments", e);
    int64_t prev = 0;
    for (size_t i = 0; !rc && i < ns; i++) {
        size_t end = r->n;
        if (i + 1 < ns) {
            pd_token *part = NULL;
            size_t np = 0;
            rc = tokenize(ctx, all, ends[i], false, &part, &np, "segments", e);
            end = 0;
            while (!rc && end < np && end < r->n && part[end] == r->tokens[end]) end++;
            free(part);
        }
        if (!rc && (int64_t)end <= prev) {
            snprintf(param, sizeof param, "segments[%zu]", i);
            rc = BAD(e, param, "%s ('%s') does not hold a token of its own; make it longer or merge it with its "
                     "neighbour", param, r->spans[i].name);
        }
        if (!rc) {
            r->spans[i].start = prev;
            r->spans[i].end = (int64_t)end;
            prev = (int64_t)end;
        }
    }
    r->n_spans = (int)ns;
    free(all);
    free(ends);
    return rc;
}

static bool opt_type(json_t *root, const char *key, json_t **out, json_type type, const char *what, pd_api_error *e,
                     int *rc) {
    json_t *v = json_object_get(root, key);
    *out = NULL;
    if (!v || json_is_null(v)) return false;
    bool ok = type == JSON_TRUE ? json_is_boolean(v) : type == JSON_REAL ? json_is_number(v) : json_typeof(v) == type;
    if (!ok) {
        *rc = BAD(e, key, "'%s' must be %s", key, what);
        return false;
    }
    *out = v;
    return true;
}

/* `spans` ("auto": spans from the prefix's turns, paragraphs or sentences;
 * segments bring their own) and `keep_text` (phrases whose every
 * occurrence is kept) turn into the layout the job compresses with. */
static int reg_layout(const pd_admin_ctx *ctx, json_t *spans, json_t *keep_text, reg *r, pd_api_error *e) {
    const pd_tokenizer *tok = pd_model_tokenizer(ctx->b.model);
    pd_error err = {0};
    if (r->n_spans > 0) { /* segments: the layout takes the spans over */
        r->layout.spans = r->spans;
        r->layout.n_spans = r->n_spans;
        r->spans = NULL;
        r->n_spans = 0;
    } else if (spans && pd_layout_auto(tok, r->tokens, (int64_t)r->n, NULL, &r->layout, &err)) {
        return pd_api_error_from(e, &err, "spans");
    }
    size_t np = keep_text ? json_array_size(keep_text) : 0;
    if (np == 0) return PD_OK;
    const char *phrases[ADMIN_MAX_KEEP_TEXT];
    for (size_t i = 0; i < np; i++) phrases[i] = json_string_value(json_array_get(keep_text, i));
    int missing = -1;
    if (pd_layout_keep_phrases(tok, r->tokens, (int64_t)r->n, phrases, (int)np, &r->layout, &missing, &err)) {
        if (err.code != PD_ENOTFOUND && err.code != PD_EINVAL) return pd_api_error_from(e, &err, "keep_text");
        char param[32];
        snprintf(param, sizeof param, "keep_text[%d]", missing);
        return BAD(e, param, "%s: %s", param, err.msg);
    }
    return PD_OK;
}

static int wait_job(const pd_admin_ctx *ctx, uint64_t id, pd_job_status *st, pd_api_error *e) {
    pd_error err = {0};
    /* In slices, so a server shutting down does not wait for the job. */
    for (double waited = 0; waited < PD_ADMIN_WAIT_S; waited += 1.0) {
        if (pd_jobs_wait(ctx->b.jobs, id, 1.0, st, &err)) return pd_api_error_from(e, &err, NULL);
        if (st->state == PD_JOB_DONE || st->state == PD_JOB_FAILED) break;
        if (ctx->stopping && ctx->stopping(ctx->stopping_ctx)) break;
    }
    return PD_OK;
}

/* 'curve': a retention->quality curve fitted offline (prefixctl calibrate;
 * the curve file's JSON is accepted as it is): {a, b, policy} and
 * optionally model.fingerprint, which must be the served model's. The
 * policy is checked against the job's by pd_jobs_submit. */
static int reg_curve(const pd_admin_ctx *ctx, json_t *v, pd_curve *curve, const char **policy, pd_api_error *e) {
    json_t *a = json_object_get(v, "a"), *b = json_object_get(v, "b"), *pol = json_object_get(v, "policy"),
           *fp = json_object_get(json_object_get(v, "model"), "fingerprint");
    if (!json_is_number(a) || !json_is_number(b) || !(json_number_value(a) > 0) || !(json_number_value(b) > 0))
        return BAD(e, "curve", "'curve' must be {\"a\", \"b\": positive numbers, \"policy\": the spec it was "
                   "fitted for}, e.g. the file prefixctl calibrate writes");
    if (!json_is_string(pol)) return BAD(e, "curve.policy", "'curve.policy' must be the spec string the curve was fitted for");
    if (fp && !json_is_string(fp))
        return BAD(e, "curve.model.fingerprint", "'curve.model.fingerprint' must be the model's 64-hex fingerprint");
    if (fp) {
        uint8_t mine[PD_SHA256_LEN];
        char hex[2 * PD_SHA256_LEN + 1];
        pd_model_fingerprint(ctx->b.model, mine);
        pd_hex(mine, PD_SHA256_LEN, hex);
        if (strcmp(hex, json_string_value(fp)) != 0)
            return BAD(e, "curve.model.fingerprint", "the curve was fitted on another model (fingerprint %.12s..., "
                       "this server's model is %.12s...): fit one for this model with prefixctl calibrate",
                       json_string_value(fp), hex);
    }
    curve->a = json_number_value(a);
    curve->b = json_number_value(b);
    *policy = json_string_value(pol);
    return PD_OK;
}

static int handle_register(const pd_admin_ctx *ctx, const char *body, size_t len, pd_admin_reply *out,
                           pd_api_error *e) {
    const pd_api_limits *lim = &ctx->limits;
    if (lim->max_body_bytes && len > lim->max_body_bytes)
        return pd_api_errorf(e, 413, PD_API_ERR_TOO_LARGE, NULL, NULL, "the request body is larger than %zu bytes "
                             "(server.max_body_bytes)", lim->max_body_bytes);
    if (!pd_api_json_depth_ok(body ? body : "", len, lim->max_depth))
        return BAD(e, NULL, "the request body nests JSON deeper than %d levels", lim->max_depth);
    json_error_t je;
    json_t *root = json_loadb(body ? body : "", len, JSON_REJECT_DUPLICATES, &je);
    if (!root) return BAD(e, NULL, "the body is not valid JSON: %s (line %d, column %d)", je.text, je.line, je.column);
    int rc = PD_OK;
    reg r = {0};
    pd_job_spec spec = {.dtype = PD_KV_F16}; /* half the bytes; read zero-copy by an f16 KV cache */
    json_t *text = NULL, *msgs = NULL, *segs = NULL, *v = NULL, *spans = NULL, *keep_text = NULL, *tools = NULL;
    bool wait = false;
    if (!json_is_object(root)) {
        rc = BAD(e, NULL, "the body must be a JSON object");
        goto done;
    }
    int given = 0;
    if (opt_type(root, "text", &text, JSON_STRING, "a string", e, &rc)) given++;
    if (!rc && opt_type(root, "messages", &msgs, JSON_ARRAY, "an array of messages", e, &rc)) given++;
    if (!rc && opt_type(root, "segments", &segs, JSON_ARRAY, "an array of segments", e, &rc)) given++;
    if (!rc && opt_type(root, "tools", &tools, JSON_ARRAY, "an array of tools as chat requests send them", e, &rc) &&
        !msgs)
        rc = BAD(e, "tools", "'tools' goes with 'messages': the tool list is rendered into the system turn");
    if (!rc && given != 1) {
        rc = BAD(e, given ? "segments" : "text", "send exactly one of 'text', 'messages' or 'segments' (got %d)",
                 given);
        goto done;
    }
    if (!rc && opt_type(root, "policy", &v, JSON_STRING, "a policy spec string (docs/policies.md)", e, &rc)) {
        spec.policy = json_string_value(v);
        if (strlen(spec.policy) >= PD_PREFIX_SPEC_MAX) rc = BAD(e, "policy", "'policy' is too long");
    }
    bool has_retention = false, has_quality = false;
    if (!rc && opt_type(root, "retention", &v, JSON_REAL, "a number in (0, 1]", e, &rc)) {
        spec.retention = json_number_value(v);
        has_retention = true;
        if (!(spec.retention > 0 && spec.retention <= 1))
            rc = BAD(e, "retention", "'retention' must be in (0, 1], the fraction of rows kept");
    }
    if (!rc && opt_type(root, "quality", &v, JSON_REAL, "a number above 1", e, &rc)) {
        spec.quality = json_number_value(v);
        has_quality = true;
        if (!pd_calib_tau_valid(spec.quality))
            rc = BAD(e, "quality", "'quality' is the largest NLL ratio allowed (tau: above 1, at most %g), e.g. 1.05",
                     PD_CALIB_TAU_MAX);
    }
    if (!rc && has_retention && has_quality)
        rc = BAD(e, "quality", "send 'retention' or 'quality', not both: quality chooses the retention");
    pd_curve curve;
    if (!rc && opt_type(root, "curve", &v, JSON_OBJECT, "an object {a, b, policy} (prefixctl calibrate)", e, &rc) &&
        (rc = reg_curve(ctx, v, &curve, &spec.curve_policy, e)) == PD_OK) {
        spec.curve = &curve;
        if (has_retention) rc = BAD(e, "curve", "send 'retention' or 'curve', not both: the curve chooses the retention");
        else if (!has_quality && !(ctx->b.quality_budget > 0))
            rc = BAD(e, "curve", "'curve' chooses the retention for a quality target: send 'quality' too (e.g. 1.05)");
    }
    /* The configured quality budget applies when the request fixes nothing. */
    if (!rc && !has_retention && !has_quality && ctx->b.quality_budget > 0) spec.quality = ctx->b.quality_budget;
    if (!rc && !spec.policy) spec.policy = ctx->b.default_policy;
    if (!rc && opt_type(root, "namespace", &v, JSON_STRING, "a string", e, &rc)) {
        spec.ns = json_string_value(v);
        if (strlen(spec.ns) >= PD_PREFIX_NS_MAX)
            rc = BAD(e, "namespace", "'namespace' is longer than %d bytes", PD_PREFIX_NS_MAX - 1);
    }
    if (!rc && opt_type(root, "pin", &v, JSON_TRUE, "true or false", e, &rc)) spec.pin = json_is_true(v);
    if (!rc && opt_type(root, "dtype", &v, JSON_STRING, "\"f32\", \"f16\" or \"bf16\"", e, &rc) &&
        !pd_kv_dtype_from_name(json_string_value(v), &spec.dtype))
        rc = BAD(e, "dtype", "'dtype' must be \"f32\", \"f16\" or \"bf16\"");
    if (!rc && opt_type(root, "wait", &v, JSON_TRUE, "true or false", e, &rc)) wait = json_is_true(v);
    if (!rc && opt_type(root, "spans", &spans, JSON_STRING, "\"auto\"", e, &rc)) {
        if (strcmp(json_string_value(spans), "auto") != 0)
            rc = BAD(e, "spans", "'spans' must be \"auto\" (spans from the prefix's turns, paragraphs or sentences); "
                     "send 'segments' to name spans yourself");
        else if (segs)
            rc = BAD(e, "spans", "'spans' and 'segments' do not go together: segments already are the spans");
    }
    if (!rc && opt_type(root, "keep_text", &keep_text, JSON_ARRAY, "an array of phrases", e, &rc)) {
        size_t np = json_array_size(keep_text);
        if (np == 0 || np > ADMIN_MAX_KEEP_TEXT)
            rc = BAD(e, "keep_text", "'keep_text' must hold 1 to %d phrases", ADMIN_MAX_KEEP_TEXT);
        for (size_t i = 0; !rc && i < np; i++) {
            json_t *ph = json_array_get(keep_text, i);
            if (!json_is_string(ph) || json_string_length(ph) == 0 ||
                strlen(json_string_value(ph)) != json_string_length(ph)) {
                char param[32];
                snprintf(param, sizeof param, "keep_text[%zu]", i);
                rc = BAD(e, param, "%s must be a non-empty string without NUL characters", param);
            }
        }
    }
    if (rc) goto done;

    rc = text ? reg_text(ctx, text, &r, e) : msgs ? reg_messages(ctx, msgs, tools, &r, e) : reg_segments(ctx, segs, &r, e);
    if (!rc) rc = reg_layout(ctx, spans, keep_text, &r, e);
    if (rc) goto done;
    if (ctx->b.n_ctx > 0 && r.n >= (size_t)ctx->b.n_ctx) {
        rc = pd_api_errorf(e, 400, PD_API_ERR_INVALID, text ? "text" : msgs ? "messages" : "segments",
                           "context_length_exceeded", "the prefix is %zu tokens; it must be shorter than the "
                           "context (%d tokens) to leave room for requests", r.n, (int)ctx->b.n_ctx);
        goto done;
    }
    spec.tokens = r.tokens;
    spec.n = (int64_t)r.n;
    spec.layout = r.layout.n_spans || r.layout.n_whitelist ? &r.layout : NULL;
    uint64_t id = 0;
    pd_error err = {0};
    if (pd_jobs_submit(ctx->b.jobs, &spec, &id, &err)) {
        rc = pd_api_error_from(e, &err, NULL);
        goto done;
    }
    pd_job_status st;
    if (wait) {
        if ((rc = wait_job(ctx, id, &st, e))) goto done;
        if (st.state == PD_JOB_FAILED) {
            pd_error jerr = {.code = st.error_code ? st.error_code : PD_EIO};
            snprintf(jerr.msg, sizeof jerr.msg, "registration failed: %.400s", st.error);
            rc = pd_api_error_from(e, &jerr, NULL);
            goto done;
        }
        if (st.state == PD_JOB_DONE) {
            rc = reply(job_json(&st), 201, out, e);
            goto done;
        }
    } else if ((rc = pd_jobs_status(ctx->b.jobs, id, &st, &err))) {
        rc = pd_api_error_from(e, &err, NULL);
        goto done;
    }
    /* Not finished (or not waited for): where to ask. */
    json_t *j = job_json(&st);
    if (j && json_object_set_new(j, "job_id", json_integer((json_int_t)id))) {
        json_decref(j);
        j = NULL;
    }
    rc = reply(j, 202, out, e);
done:
    reg_free(&r);
    json_decref(root);
    return rc;
}

/* ---- the other routes ------------------------------------------------------------ */

static int parse_id(const char *hex, pd_prefix_id *id, pd_api_error *e) {
    pd_error err = {0};
    if (strlen(hex) != 2 * PD_PREFIX_ID_LEN || pd_prefix_id_parse(hex, id, &err))
        return pd_api_errorf(e, 404, PD_API_ERR_NOT_FOUND, NULL, "invalid_prefix_id",
                             "'%.80s' is not a prefix id (64 hex digits, as listed by GET /admin/v1/prefixes)", hex);
    return PD_OK;
}

typedef struct list_ctx {
    json_t *data;
    const char *ns;
} list_ctx;

static int list_one(void *vctx, const pd_prefix_id *id, const pd_prefix_info *info, const char *why) {
    list_ctx *l = vctx;
    json_t *j;
    if (!info) {
        char hex[PD_PREFIX_ID_HEX];
        pd_prefix_id_hex(id, hex);
        j = json_pack("{s:s,s:s,s:s}", "id", hex, "object", "prefix", "error", why ? why : "corrupt header");
    } else {
        if (l->ns && strcmp(l->ns, info->ns) != 0) return 0;
        j = prefix_json(info);
    }
    return j && json_array_append_new(l->data, j) == 0 ? 0 : PD_ENOMEM;
}

static int handle_list(const pd_admin_ctx *ctx, const char *ns, pd_admin_reply *out, pd_api_error *e) {
    list_ctx l = {.data = json_array(), .ns = ns};
    if (!l.data) return reply(NULL, 0, out, e);
    pd_error err = {0};
    int rc = pd_store_list(ctx->b.store, list_one, &l, &err);
    if (rc) {
        json_decref(l.data);
        if (rc == PD_ENOMEM && !err.msg[0]) return reply(NULL, 0, out, e);
        return pd_api_error_from(e, &err, NULL);
    }
    return reply(json_pack("{s:s,s:o}", "object", "list", "data", l.data), 200, out, e);
}

/* Redis could not be reached for something only it knows, or must carry
 * to every node: 503 with its own code, so a client knows to retry. */
static int shared_tier_error(pd_api_error *e, const pd_error *err) {
    if (err->code == PD_EUNAVAILABLE)
        return pd_api_errorf(e, 503, PD_API_ERR_OVERLOADED, NULL, "shared_tier_unavailable", "%s; retry", err->msg);
    return pd_api_error_from(e, err, NULL);
}

typedef struct shared_list_ctx {
    const pd_admin_ctx *admin;
    json_t *data;
    const char *ns;
} shared_list_ctx;

static int shared_one(void *vctx, const pd_cluster_entry *e) {
    shared_list_ctx *l = vctx;
    char hex[PD_PREFIX_ID_HEX];
    pd_prefix_id_hex(&e->id, hex);
    pd_prefix_info info;
    pd_error err;
    const bool here = pd_store_info(l->admin->b.store, &e->id, &info, &err) == PD_OK;
    json_t *o = json_pack("{s:s,s:s,s:I,s:s,s:s,s:b,s:I,s:I,s:b}", "id", hex, "object", "shared_prefix", "tokens",
                          (json_int_t)e->n_tokens, "policy", e->spec, "namespace", l->ns, "pinned", (int)e->pinned,
                          "bytes", (json_int_t)(e->bytes > INT64_MAX ? INT64_MAX : e->bytes), "created_at",
                          (json_int_t)e->created_at, "held_here", (int)here);
    return o && json_array_append_new(l->data, o) == 0 ? 0 : PD_ENOMEM;
}

/* GET /admin/v1/shared/prefixes: what the shared tier holds for the served
 * model in one namespace, and which of it this node holds too. */
static int handle_shared_list(const pd_admin_ctx *ctx, const char *ns, pd_admin_reply *out, pd_api_error *e) {
    if (!ctx->b.cluster)
        return pd_api_errorf(e, 404, PD_API_ERR_NOT_FOUND, NULL, "no_shared_tier",
                             "this node has no shared tier: set cluster.redis_url (docs/deployment.md, \"Several nodes\")");
    uint8_t fp[PD_SHA256_LEN];
    pd_model_fingerprint(ctx->b.model, fp);
    shared_list_ctx l = {.admin = ctx, .data = json_array(), .ns = ns ? ns : ""};
    if (!l.data) return reply(NULL, 0, out, e);
    pd_error err = {0};
    const int rc = pd_cluster_list(ctx->b.cluster, fp, l.ns, shared_one, &l, &err);
    if (rc) {
        json_decref(l.data);
        if (rc == PD_ENOMEM && !err.msg[0]) return reply(NULL, 0, out, e);
        return shared_tier_error(e, &err);
    }
    return reply(json_pack("{s:s,s:o}", "object", "list", "data", l.data), 200, out, e);
}


/* PATCH {"pinned": bool}: the only mutable part of a stored prefix. */
static int handle_patch(const pd_admin_ctx *ctx, const pd_prefix_id *id, const char *body, size_t len,
                        pd_admin_reply *out, pd_api_error *e) {
    json_error_t jerr;
    json_t *root = json_loadb(body ? body : "", len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root || !json_is_object(root)) {
        json_decref(root);
        return BAD(e, NULL, "the body must be a JSON object such as {\"pinned\": true}");
    }
    json_t *pinned = json_object_get(root, "pinned");
    const char *key;
    json_t *v;
    int rc = PD_OK;
    json_object_foreach(root, key, v) {
        if (strcmp(key, "pinned") != 0) {
            rc = BAD(e, key, "'%.60s' cannot be changed; only \"pinned\" can (delete and register again for the rest)",
                     key);
            break;
        }
    }
    if (!rc && !json_is_boolean(pinned)) rc = BAD(e, "pinned", "\"pinned\" must be true or false");
    const bool pin = json_is_true(pinned);
    json_decref(root);
    if (rc) return rc;
    pd_error err = {0};
    pd_prefix_info info;
    /* With a shared tier, every node that holds it follows (a prefix only
     * the shared tier holds is fetched here first). */
    if (ctx->b.cluster) {
        pd_error ferr;
        if (pd_store_info(ctx->b.store, id, &info, &ferr) == PD_ENOTFOUND)
            (void)pd_cluster_fetch_id(ctx->b.cluster, id, &ferr);
        if (pd_store_info(ctx->b.store, id, &info, &err) == PD_OK && pd_cluster_pin(ctx->b.cluster, id, pin, &err))
            return shared_tier_error(e, &err);
    }
    if (pd_store_pin(ctx->b.store, id, pin, &err) || pd_store_info(ctx->b.store, id, &info, &err))
        return pd_api_error_from(e, &err, NULL);
    return reply(prefix_json(&info), 200, out, e);
}

/* The spans of a stored prefix's layout (the key's text after '|'), with
 * the rows each kept; an empty array without one. */
static json_t *spans_json(const char *key, const pd_kv_prefix *kv, json_t **keep, pd_error *err) {
    *keep = json_array();
    json_t *spans = json_array();
    const char *bar = strchr(key, '|');
    pd_layout lay = {0};
    if (!spans || !*keep || (bar && pd_layout_parse(bar + 1, &lay, err))) goto fail;
    int32_t n_layer, n_head, head_dim;
    pd_kv_prefix_shape(kv, &n_layer, &n_head, &head_dim);
    for (int i = 0; i < lay.n_whitelist; i++)
        if (json_array_append_new(*keep, json_pack("[I,I]", (json_int_t)lay.whitelist[i].start,
                                                   (json_int_t)lay.whitelist[i].end)))
            goto fail;
    for (int i = 0; i < lay.n_spans; i++) {
        const pd_span *sp = &lay.spans[i];
        int64_t kept = 0;
        for (int l = 0; l < n_layer; l++)
            for (int h = 0; h < n_head; h++) {
                const int32_t *pos;
                const int64_t n = pd_kv_prefix_stream(kv, l, h, &pos, NULL, NULL);
                for (int64_t r = 0; r < n; r++) kept += pos[r] >= sp->start && pos[r] < sp->end;
            }
        const int64_t rows = (sp->end - sp->start) * (int64_t)n_layer * n_head;
        if (json_array_append_new(spans, json_pack("{s:s,s:I,s:I,s:b,s:I,s:I,s:f}", "name", sp->name, "start",
                                                   (json_int_t)sp->start, "end", (json_int_t)sp->end, "whitelisted",
                                                   (int)sp->whitelist, "rows", (json_int_t)rows, "kept_rows",
                                                   (json_int_t)kept, "kept_fraction",
                                                   rows > 0 ? (double)kept / (double)rows : 0.0)))
            goto fail;
    }
    pd_layout_free(&lay);
    return spans;
fail:
    pd_layout_free(&lay);
    json_decref(spans);
    json_decref(*keep);
    *keep = NULL;
    return NULL;
}

/* GET .../{id}/kept: kept rows per (layer, kv head) and per span. Read
 * with pd_store_peek (every page verified; looking is not a use). */
static int handle_kept(const pd_admin_ctx *ctx, const pd_prefix_id *id, pd_admin_reply *out, pd_api_error *e) {
    pd_error err = {0};
    pd_prefix_ref *ref = NULL;
    if (pd_store_peek(ctx->b.store, id, &ref, &err)) return pd_api_error_from(e, &err, NULL);
    const pd_prefix_info *info = pd_prefix_ref_info(ref);
    const pd_kv_prefix *kv = pd_prefix_ref_kv(ref);
    json_t *kept = json_array(), *keep = NULL, *spans = NULL;
    for (int l = 0; kept && l < info->n_layer; l++) {
        json_t *row = json_array();
        for (int h = 0; row && h < info->n_head_kv; h++)
            if (json_array_append_new(row, json_integer((json_int_t)pd_kv_prefix_stream(kv, l, h, NULL, NULL, NULL)))) {
                json_decref(row);
                row = NULL;
            }
        if (!row || json_array_append_new(kept, row)) {
            json_decref(kept);
            kept = NULL;
        }
    }
    if (kept) spans = spans_json(info->spec, kv, &keep, &err);
    char hex[PD_PREFIX_ID_HEX];
    pd_prefix_id_hex(id, hex);
    json_t *j = NULL;
    if (kept && spans)
        j = json_pack("{s:s,s:s,s:I,s:I,s:I,s:o,s:o,s:o}", "object", "prefix.kept", "id", hex, "tokens",
                      (json_int_t)info->n_tokens, "n_layer", (json_int_t)info->n_layer, "n_head_kv",
                      (json_int_t)info->n_head_kv, "kept", kept, "spans", spans, "keep", keep);
    else
        json_decref(kept);
    pd_prefix_ref_release(ref);
    if (!j && err.code) return pd_api_error_from(e, &err, NULL);
    return reply(j, 200, out, e);
}

static int handle_prefix(const pd_admin_ctx *ctx, const char *method, const char *path, const char *body,
                         size_t len, pd_admin_reply *out, pd_api_error *e) {
    /* {id} or {id}/kept */
    char hex[PD_PREFIX_ID_HEX];
    const char *slash = strchr(path, '/');
    const size_t idlen = slash ? (size_t)(slash - path) : strlen(path);
    snprintf(hex, sizeof hex, "%.*s", (int)(idlen < sizeof hex ? idlen : 0), path);
    pd_prefix_id id;
    int rc = parse_id(idlen == 2 * PD_PREFIX_ID_LEN ? hex : path, &id, e);
    if (rc) return rc;
    if (slash) {
        if (strcmp(slash, "/kept") != 0)
            return pd_api_errorf(e, 404, PD_API_ERR_NOT_FOUND, NULL, NULL, "no such admin route: %.200s", slash);
        if (strcmp(method, "GET") != 0)
            return pd_api_errorf(e, 405, PD_API_ERR_INVALID, NULL, "method_not_allowed", "use GET on %s/kept", hex);
        return handle_kept(ctx, &id, out, e);
    }
    pd_error err = {0};
    if (strcmp(method, "PATCH") == 0) return handle_patch(ctx, &id, body, len, out, e);
    if (strcmp(method, "GET") == 0) {
        pd_prefix_info info;
        if (pd_store_info(ctx->b.store, &id, &info, &err)) return pd_api_error_from(e, &err, NULL);
        return reply(prefix_json(&info), 200, out, e);
    }
    if (strcmp(method, "DELETE") == 0) {
        /* The shared tier first: if Redis is away nothing is deleted (503,
         * retry), rather than a prefix gone here and served elsewhere. */
        bool shared = false;
        if (ctx->b.cluster && pd_cluster_delete(ctx->b.cluster, &id, &shared, &err))
            return shared_tier_error(e, &err);
        const int drc = pd_store_delete(ctx->b.store, &id, &err);
        if (drc && !(drc == PD_ENOTFOUND && shared)) return pd_api_error_from(e, &err, NULL);
        /* Requests already attending to it keep their reference. */
        if (ctx->b.hot) pd_hot_invalidate(ctx->b.hot, &id);
        out->status = 204;
        return PD_OK;
    }
    return pd_api_errorf(e, 405, PD_API_ERR_INVALID, NULL, "method_not_allowed",
                         "use GET, PATCH or DELETE on a prefix");
}

/* GET /admin/v1/policies: every policy with its keys' defaults, and the
 * daemon's default spec, for pickers. */
static int handle_policies(const pd_admin_ctx *ctx, pd_admin_reply *out, pd_api_error *e) {
    json_t *data = json_array();
    for (int k = 0; data && k < PD_POLICY_COUNT; k++) {
        pd_policy_spec spec;
        pd_policy_spec_default((pd_policy_kind)k, &spec);
        char text[PD_POLICY_SPEC_MAX];
        pd_policy_spec_print(&spec, text, sizeof text);
        json_t *keys = json_array();
        /* The canonical text is "name:key=value,...", every key with its default. */
        const char *p = strchr(text, ':');
        while (keys && p && *p) {
            p++;
            const char *eq = strchr(p, '='), *end = strchr(p, ',');
            if (!end) end = p + strlen(p);
            if (!eq || eq > end) break;
            if (json_array_append_new(keys, json_pack("{s:s%,s:s%}", "name", p, (size_t)(eq - p), "default", eq + 1,
                                                      (size_t)(end - eq - 1)))) {
                json_decref(keys);
                keys = NULL;
            }
            p = end;
        }
        if (!keys || json_array_append_new(data, json_pack("{s:s,s:s,s:s,s:o}", "name",
                                                           pd_policy_kind_name((pd_policy_kind)k), "summary",
                                                           pd_policy_kind_summary((pd_policy_kind)k), "spec", text,
                                                           "keys", keys))) {
            json_decref(data);
            data = NULL;
        }
    }
    if (!data) return reply(NULL, 0, out, e);
    /* The default as jobs would run it (canonical, so the picker can match it). */
    char def[PD_POLICY_SPEC_MAX] = "";
    pd_policy_spec spec;
    pd_error err = {0};
    if (pd_policy_spec_parse(ctx->b.default_policy ? ctx->b.default_policy : "compactor", &spec, &err) == PD_OK)
        pd_policy_spec_print(&spec, def, sizeof def);
    return reply(json_pack("{s:s,s:s,s:o}", "object", "list", "default", def, "data", data), 200, out, e);
}

static int handle_job(const pd_admin_ctx *ctx, const char *idtext, pd_admin_reply *out, pd_api_error *e) {
    char *end = NULL;
    unsigned long long id = strtoull(idtext, &end, 10);
    if (!idtext[0] || idtext[0] == '-' || *end || id == 0)
        return pd_api_errorf(e, 404, PD_API_ERR_NOT_FOUND, NULL, "job_not_found", "'%.40s' is not a job id", idtext);
    pd_job_status st;
    pd_error err = {0};
    if (pd_jobs_status(ctx->b.jobs, (uint64_t)id, &st, &err)) {
        if (err.code == PD_ENOTFOUND)
            return pd_api_errorf(e, 404, PD_API_ERR_NOT_FOUND, NULL, "job_not_found",
                                 "no job %llu (unknown, or finished long ago and forgotten)", id);
        return pd_api_error_from(e, &err, NULL);
    }
    return reply(job_json(&st), 200, out, e);
}

int pd_admin_handle(const pd_admin_ctx *ctx, const char *method, const char *url, const char *query_namespace,
                    const char *body, size_t len, pd_admin_reply *out, pd_api_error *e) {
    memset(out, 0, sizeof *out);
    if (!ctx->b.jobs || !ctx->b.store || !ctx->b.model)
        return pd_api_errorf(e, 503, PD_API_ERR_OVERLOADED, NULL, "admin_unavailable",
                             "the admin API is not available (the model or the prefix store is not open)");
    if (strcmp(url, PREFIXES_URL) == 0) {
        if (strcmp(method, "POST") == 0) return handle_register(ctx, body, len, out, e);
        if (strcmp(method, "GET") == 0) return handle_list(ctx, query_namespace, out, e);
        return pd_api_errorf(e, 405, PD_API_ERR_INVALID, NULL, "method_not_allowed",
                             "use POST (register) or GET (list) on " PREFIXES_URL);
    }
    if (strncmp(url, PREFIXES_URL "/", strlen(PREFIXES_URL "/")) == 0)
        return handle_prefix(ctx, method, url + strlen(PREFIXES_URL "/"), body, len, out, e);
    if (strcmp(url, SHARED_URL) == 0) {
        if (strcmp(method, "GET") != 0)
            return pd_api_errorf(e, 405, PD_API_ERR_INVALID, NULL, "method_not_allowed", "use GET on " SHARED_URL);
        return handle_shared_list(ctx, query_namespace, out, e);
    }
    if (strcmp(url, POLICIES_URL) == 0) {
        if (strcmp(method, "GET") != 0)
            return pd_api_errorf(e, 405, PD_API_ERR_INVALID, NULL, "method_not_allowed", "use GET on " POLICIES_URL);
        return handle_policies(ctx, out, e);
    }
    if (strncmp(url, JOBS_URL, strlen(JOBS_URL)) == 0) {
        if (strcmp(method, "GET") != 0)
            return pd_api_errorf(e, 405, PD_API_ERR_INVALID, NULL, "method_not_allowed", "use GET on a job");
        return handle_job(ctx, url + strlen(JOBS_URL), out, e);
    }
    return pd_api_errorf(e, 404, PD_API_ERR_NOT_FOUND, NULL, NULL, "no such admin route: %.200s", url);
}
