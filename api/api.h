/* api: the OpenAI-compatible request and response layer, as pure functions
 * so the HTTP server (libmicrohttpd) stays thin:
 *
 *   body bytes --pd_api_parse_request--> pd_api_request (validated)
 *              --pd_api_prompt_tokens--> prompt token ids (chat template)
 *              --pd_api_sched_params---> pd_sched_params for the scheduler
 *   scheduler events --pd_api_response_*--> JSON body or SSE chunks
 *
 * Every failure fills a pd_api_error: the HTTP status plus the OpenAI error
 * object {"error":{"message","type","param","code"}}. docs/api.md lists the
 * fields, their ranges and defaults, the extensions and the error shapes.
 *
 * Streaming and non-streaming share one accumulator (pd_api_response): the
 * tokens of each choice are appended to it in both cases, and an SSE chunk
 * renders what was appended since the previous chunk. So the concatenated
 * deltas equal the non-streamed text by construction. */
#ifndef PD_API_H
#define PD_API_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "cache/cache.h"
#include "daemon/daemon.h"
#include "engine/engine.h"
#include "grammar/grammar.h"
#include "util/util.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------
 * Errors
 * ------------------------------------------------------------------------ */

/* OpenAI error types (pd_api_error.type). */
#define PD_API_ERR_INVALID "invalid_request_error"       /* 400 */
#define PD_API_ERR_AUTH "authentication_error"           /* 401 */
#define PD_API_ERR_NOT_FOUND "not_found_error"           /* 404 */
#define PD_API_ERR_TOO_LARGE "request_too_large"         /* 413 */
#define PD_API_ERR_RATE_LIMIT "rate_limit_error"         /* 429 */
#define PD_API_ERR_OVERLOADED "overloaded_error"         /* 503 */
#define PD_API_ERR_SERVER "server_error"                 /* 500 */

typedef struct pd_api_error {
    int http_status;   /* 400, 401, 404, 413, 429, 500, 503 */
    char type[32];     /* one of PD_API_ERR_* */
    char param[64];    /* the offending field ("messages[2].role"); "" = null */
    char code[48];     /* machine-readable detail ("context_length_exceeded"); "" = null */
    char message[512]; /* what is wrong and what to send instead */
} pd_api_error;

/* Fill e (if not NULL). param and code may be NULL (JSON null). Returns
 * PD_EINVAL for 4xx statuses and PD_EIO for 5xx, so parsers can write
 * `return pd_api_errorf(...)`. */
int pd_api_errorf(pd_api_error *e, int http_status, const char *type, const char *param, const char *code,
                  const char *fmt, ...) __attribute__((format(printf, 6, 7)));
/* Map a pd_error from a lower layer (pd_scheduler_submit, pd_tokenize, ...):
 * PD_EINVAL/PD_ERANGE/PD_EUNSUPPORTED/PD_EFORMAT -> 400, PD_ENOTFOUND ->
 * 404, PD_ENOMEM -> 503, anything else -> 500. The server maps "queue is
 * full" to 429/503 itself (it knows it submitted). param may be NULL. */
int pd_api_error_from(pd_api_error *e, const pd_error *err, const char *param);
/* {"error":{"message":...,"type":...,"param":...|null,"code":...|null}};
 * malloc'd, NUL-terminated. PD_ENOMEM only. */
int pd_api_error_json(const pd_api_error *e, char **out, size_t *len);

/* ------------------------------------------------------------------------
 * Requests
 * ------------------------------------------------------------------------ */

typedef enum pd_api_kind {
    PD_API_COMPLETION = 0, /* POST /v1/completions */
    PD_API_CHAT = 1,       /* POST /v1/chat/completions */
} pd_api_kind;

#define PD_API_MAX_STOP 4                /* like OpenAI */
#define PD_API_MAX_LOGIT_BIAS 1024       /* entries in logit_bias */
#define PD_API_COMPLETION_MAX_TOKENS 16  /* OpenAI's default for /v1/completions */

typedef struct pd_api_limits {
    size_t max_body_bytes;      /* larger bodies: 413 (default 1 MiB) */
    int max_depth;              /* JSON nesting deeper than this: 400 (default 16) */
    int32_t default_max_tokens; /* chat default when max_tokens is absent; 0 = the
                                   context remainder (default 0) */
    int32_t max_tokens_limit;   /* largest max_tokens accepted (default 4096) */
    int64_t max_prompt_tokens;  /* longest prompt after tokenization (default 32768) */
    int max_n;                  /* largest n (default 8) */
} pd_api_limits;

void pd_api_limits_default(pd_api_limits *l);

/* A parsed, range-checked request. Strings are owned (pd_api_request_free). */
#define PD_API_SALT_MAX 64 /* bytes of a request's cache_salt */

/* response_format.type */
typedef enum pd_api_format {
    PD_API_FORMAT_TEXT = 0,
    PD_API_FORMAT_JSON_OBJECT,  /* any JSON object */
    PD_API_FORMAT_JSON_SCHEMA,  /* a document valid under response_format.json_schema.schema */
} pd_api_format;

/* tool_choice */
typedef enum pd_api_tool_choice {
    PD_API_TOOLS_AUTO = 0,  /* text or calls (the default with tools) */
    PD_API_TOOLS_NONE,      /* text only: no constraint, no parsing of calls */
    PD_API_TOOLS_REQUIRED,  /* one or more calls */
    PD_API_TOOLS_NAMED,     /* exactly one call of tool_choice_name */
} pd_api_tool_choice;

#define PD_API_MAX_TOOLS 128

typedef struct pd_api_request {
    pd_api_kind kind;
    char *model;

    /* completions: exactly one of text / tokens */
    bool prompt_is_tokens;
    char *prompt_text;           /* NUL-terminated (no NUL inside: JSON "\u0000" is refused) */
    size_t prompt_len;
    pd_token *prompt_tokens;
    size_t n_prompt_tokens;

    /* chat: roles are "system", "user", "assistant" or "tool" (static
     * strings); array content parts are joined with "\n"; an assistant's
     * tool_calls and a tool's tool_call_id are owned */
    pd_chat_message *messages;
    size_t n_messages;

    /* constrained output: response_format (both endpoints), and for chat
     * the tools the model may call (names, descriptions and parameters as
     * JSON text, owned) */
    pd_api_format format;
    json_t *schema;              /* FORMAT_JSON_SCHEMA: the schema (a reference we own) */
    char *schema_name;           /* response_format.json_schema.name */
    char *grammar;               /* "grammar" (llama.cpp's extension): GBNF text the answer must match;
                                    not together with response_format or tools */
    pd_chat_tool *tools;
    size_t n_tools;
    pd_api_tool_choice tool_choice;
    char *tool_choice_name;      /* TOOLS_NAMED */
    bool parallel_tool_calls;    /* default true */

    int32_t max_tokens;          /* 0 = not given (see pd_api_sched_params) */
    int n;                       /* choices, default 1 */
    char *stop[PD_API_MAX_STOP];
    size_t n_stop;
    bool has_seed;
    pd_sampler_params sampling;  /* temperature, top_p, top_k, min_p, penalties, seed,
                                    logprobs, n_logprobs; logit_bias -> the array below */
    pd_logit_bias *logit_bias;
    size_t n_logit_bias;
    bool stream;
    bool include_usage;          /* stream_options.include_usage */
    char *user;                  /* NULL when absent; not used */
    pd_cache_mode cache;         /* "cache": "auto" (default) | "off" */
    bool has_prefix_id;          /* "prefix_id": 64 hex digits */
    pd_prefix_id prefix_id;
    char ns[PD_PREFIX_NS_MAX];   /* not from the body: the server fills it from the API key */
    char cache_salt[PD_API_SALT_MAX + 1]; /* "cache_salt": "" = none; see pd_api_request_namespace */
} pd_api_request;

/* The namespace a request's prefix lookups and prefix_id use: the API key's,
 * and with a cache_salt, that namespace + U+001F + the salt (so only
 * prefixes registered under exactly that string are seen). PD_EINVAL when
 * the two together exceed a namespace's length. */
int pd_api_request_namespace(pd_api_request *r, const char *key_ns, pd_api_error *e);

/* Parse and validate a request body. Unknown fields are ignored; a known
 * field of the wrong type or out of range is 400 with param naming it; null
 * counts as absent. Bodies over max_body_bytes are 413. On failure *out is
 * left empty (safe to free). lim may be NULL (defaults). */
int pd_api_parse_request(pd_api_kind kind, const char *body, size_t len, const pd_api_limits *lim,
                         pd_api_request *out, pd_api_error *e);
void pd_api_request_free(pd_api_request *r);

/* The prompt as token ids. Completions: token ids as given, or the text
 * tokenized with the vocabulary's BOS (add_special) and control tokens NOT
 * parsed. Chat: the messages rendered with `family` and a generation prompt,
 * tokenized with add_special and parse_special. *system_bytes (may be NULL)
 * is the rendered length of the leading system part (0 for completions).
 * Errors: PD_CHAT_NONE for chat (400 "no chat template"), empty prompt,
 * longer than lim->max_prompt_tokens (400 context_length_exceeded). *out is
 * malloc'd. */
int pd_api_prompt_tokens(const pd_api_request *r, const pd_tokenizer *tok, pd_chat_family family,
                         const pd_api_limits *lim, pd_token **out, int64_t *n_out, size_t *system_bytes,
                         pd_api_error *e);

/* Fill the scheduler's parameters. Points into r and prompt (both must stay
 * valid until pd_scheduler_submit returns; it copies). max_tokens: as given
 * (then prompt + max_tokens must fit n_ctx, else 400
 * context_length_exceeded), else 16 for completions and for chat
 * lim->default_max_tokens or the context remainder, capped at
 * lim->max_tokens_limit. Checks prompt ids and logit_bias ids against
 * n_vocab and every sampler parameter (pd_sampler_params_validate). */
int pd_api_sched_params(const pd_api_request *r, const pd_token *prompt, int64_t n_prompt, int32_t n_ctx,
                        int32_t n_vocab, const pd_api_limits *lim, pd_sched_params *out, pd_api_error *e);

/* ------------------------------------------------------------------------
 * Constrained output (api/constrain.c, docs/structured-output.md)
 *
 * response_format and tools become one grammar (grammar/grammar.h) that the
 * scheduler's matcher applies to every sampled token:
 *   root ::= fmt                      response_format alone
 *   root ::= tc-calls | TEXT          tools, tool_choice auto (TEXT: plain
 *                                     text not starting with the calls'
 *                                     marker, or the response_format document)
 *   root ::= tc-calls                 tool_choice required or a named function
 * tc-calls is the family's call syntax (pd_chat_tool_syntax) around
 * {"name": NAME, ARGS_KEY: <the tool's parameters schema>}.
 * ------------------------------------------------------------------------ */

typedef struct pd_api_constraint {
    char *grammar;               /* grammar text; NULL = the answer is unconstrained */
    bool tool_calls;             /* the answer may hold calls: parse them back */
    pd_chat_tool_syntax syntax;  /* with tool_calls */
    char trigger[32];            /* text that starts the calls ("<tool_call>", "{", "[TOOL_CALLS]") */
} pd_api_constraint;

/* The grammar of a parsed request. An unsupported schema keyword is a 400
 * naming the field ("response_format.json_schema.schema",
 * "tools[1].function.parameters") and the keyword. */
int pd_api_constraint_build(const pd_api_request *r, pd_chat_family family, const pd_tokenizer *tok,
                            pd_api_constraint *out, pd_api_error *e);
void pd_api_constraint_free(pd_api_constraint *c);
/* The model's vocabulary as the grammar matcher sees it: each token's
 * bytes, control tokens special, end-of-generation tokens EOG. */
int pd_api_grammar_vocab(const pd_tokenizer *tok, pd_grammar_vocab **out, pd_error *err);

typedef struct pd_api_tool_call {
    char id[40];      /* "call_" + 24 random characters */
    char *name;
    char *arguments;  /* compact JSON text of the arguments object */
} pd_api_tool_call;

/* Calls in a finished answer. *n_calls = 0 and PD_OK when the text does
 * not start with the syntax's marker (it is plain content); PD_EFORMAT when
 * it does but is not whole calls (cut short by max_tokens or a stop
 * string): then it is returned as content too. */
int pd_api_tool_calls_parse(const pd_chat_tool_syntax *syn, const char *text, size_t len, pd_api_tool_call **calls,
                            size_t *n_calls);
void pd_api_tool_calls_free(pd_api_tool_call *calls, size_t n);
/* The text that starts calls in a syntax: its open string up to the first
 * space or newline ("<tool_call>", "[TOOL_CALLS]"), or "{" where calls are
 * bare JSON (Llama 3). */
void pd_api_tool_trigger(const pd_chat_tool_syntax *syn, char *out, size_t cap);

/* ------------------------------------------------------------------------
 * Responses
 * ------------------------------------------------------------------------ */

typedef struct pd_api_response pd_api_response;

#define PD_API_ID_MAX 64

/* id: NULL = "cmpl-"/"chatcmpl-" + 24 random characters; created: Unix
 * seconds (0 = now); model: echoed as "model". logprobs and n_logprobs
 * (alternatives) say whether choices carry logprobs (from r->sampling).
 * tok (not owned, may be NULL) renders token strings for logprobs. */
typedef struct pd_api_response_opts {
    pd_api_kind kind;
    const char *id;
    int64_t created;
    const char *model;
    int n_choices;
    bool logprobs;
    int32_t n_logprobs;
    bool include_usage;  /* streaming: usage: null in chunks, then a usage chunk */
    const pd_tokenizer *tok;
    /* Tool calls (chat): a choice whose text starts with the syntax's
     * trigger (pd_api_tool_trigger) is read back as calls
     * (message.tool_calls, finish_reason "tool_calls"); in a stream its
     * text is held from the first byte that may start the trigger and the
     * calls are sent whole, one delta.tool_calls entry each, with the
     * finish reason. */
    bool tool_calls;
    pd_chat_tool_syntax syntax;
} pd_api_response_opts;

/* The options a parsed request implies. */
void pd_api_response_opts_from(const pd_api_request *r, const pd_tokenizer *tok, pd_api_response_opts *o);

int pd_api_response_create(const pd_api_response_opts *o, pd_api_response **out, pd_error *err);
void pd_api_response_free(pd_api_response *r);
const char *pd_api_response_id(const pd_api_response *r);

/* Append one token of one choice: the bytes the generation emitted for it
 * (may be empty) and its sample (logprobs; may be NULL without logprobs). */
int pd_api_response_token(pd_api_response *r, int choice, const char *text, size_t len,
                          const pd_sample_result *sample, pd_error *err);
int pd_api_response_finish(pd_api_response *r, int choice, pd_finish_reason reason, pd_error *err);
/* Usage and prefix facts (from PD_SCHED_STARTED and PD_SCHED_DONE). */
void pd_api_response_usage(pd_api_response *r, const pd_sched_usage *u);

/* The non-streamed body: text_completion / chat.completion with choices,
 * usage (prompt_tokens_details.cached_tokens) and, when a stored prefix was
 * used, "prefix": {id, original_tokens, kept_tokens, kept_fraction, policy}.
 * Invalid UTF-8 in text becomes U+FFFD. malloc'd. */
int pd_api_response_json(const pd_api_response *r, char **out, size_t *len, pd_error *err);

/* Streaming. Each returns one malloc'd "data: {json}\n\n" event, or
 * *out = NULL and *len = 0 when there is nothing to send.
 *  - chunk: what choice `choice` gained since its previous chunk (the
 *    first chat chunk of a choice carries "role":"assistant" even when
 *    empty); an incomplete UTF-8 character at the end waits for the next.
 *  - finish: the rest of the choice plus its finish_reason (call after
 *    pd_api_response_finish).
 *  - usage: the include_usage chunk ("choices": [], usage, prefix); NULL
 *    when include_usage is off. */
int pd_api_response_sse_chunk(pd_api_response *r, int choice, char **out, size_t *len, pd_error *err);
int pd_api_response_sse_finish(pd_api_response *r, int choice, char **out, size_t *len, pd_error *err);
int pd_api_response_sse_usage(pd_api_response *r, char **out, size_t *len, pd_error *err);
#define PD_API_SSE_DONE "data: [DONE]\n\n"

/* ------------------------------------------------------------------------
 * Models
 * ------------------------------------------------------------------------ */

/* The model's public id: general.name when present and non-empty, else the
 * file name of path without directory and ".gguf". */
void pd_api_model_id(const pd_gguf *g, const char *path, char *out, size_t cap);
/* Whether the JSON text nests at most max_depth levels (strings skipped),
 * checked before parsing so that "[[[[..." never reaches the recursive
 * parser. */
bool pd_api_json_depth_ok(const char *s, size_t len, int max_depth);
/* Whether a request's "model" names the served model: one of `names`
 * (comma-separated) when set, else model_id. */
bool pd_api_model_served(const char *names, const char *model_id, const char *requested);
/* {"object":"list","data":[{"id","object":"model","created","owned_by":"prefixd"}]} */
int pd_api_models_json(const char *model_id, int64_t created, char **out, size_t *len, pd_error *err);
/* One model object (GET /v1/models/{id}): {"id","object":"model","created","owned_by":"prefixd"}. */
int pd_api_model_json(const char *id, int64_t created, char **out, size_t *len, pd_error *err);

/* ------------------------------------------------------------------------
 * Tokenizer endpoints, in llama-server's shapes (docs/api.md)
 *
 *   POST /tokenize   {"content", "add_special"=false, "parse_special"=true,
 *                     "with_pieces"=false} -> {"tokens":[id...]}
 *                    or {"tokens":[{"id","piece"}...]}
 *   POST /detokenize {"tokens":[id...]} -> {"content"}
 * ------------------------------------------------------------------------ */

typedef struct pd_api_tokenize_request {
    bool detokenize;
    char *content;        /* /tokenize: NUL-terminated, owned */
    size_t content_len;
    bool add_special, parse_special, with_pieces;
    pd_token *tokens;     /* /detokenize: owned */
    size_t n_tokens;
} pd_api_tokenize_request;

/* Parse and validate a body (the same body, depth and JSON rules as
 * completions; more than lim->max_prompt_tokens ids: 400
 * context_length_exceeded). On failure *out is left empty. lim may be NULL. */
int pd_api_parse_tokenize(bool detokenize, const char *body, size_t len, const pd_api_limits *lim,
                          pd_api_tokenize_request *out, pd_api_error *e);
void pd_api_tokenize_request_free(pd_api_tokenize_request *r);
/* The answer body: the text tokenized (at most lim->max_prompt_tokens ids,
 * else 400 context_length_exceeded), or the ids checked against the
 * vocabulary (400 naming tokens[i]) and rendered as their pieces joined,
 * control tokens as their text, like llama-server. malloc'd. */
int pd_api_tokenize_answer(const pd_api_tokenize_request *r, const pd_tokenizer *tok, const pd_api_limits *lim,
                           char **out, size_t *len, pd_api_error *e);
/* {"tokens":[...]}: ids, or with_pieces {"id","piece"} objects whose piece
 * (control tokens as their text) is a string, or its bytes as numbers when
 * it is not valid UTF-8 on its own. */
int pd_api_tokens_json(const pd_tokenizer *tok, const pd_token *ids, size_t n, bool with_pieces, char **out,
                       size_t *len, pd_error *err);
/* {"content": text}, invalid UTF-8 as U+FFFD. */
int pd_api_content_json(const char *text, size_t n, char **out, size_t *len, pd_error *err);

/* ------------------------------------------------------------------------
 * HTTP server (libmicrohttpd's epoll event loop on server.threads threads)
 *
 * Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE),
 * GET /v1/models, GET /v1/models/{id}, POST /tokenize, POST /detokenize,
 * GET /health (503 until ready), GET /metrics; OPTIONS (CORS preflight)
 * when cors_origins is set. The server starts listening before the model
 * is loaded so /health can say so.
 * Every response carries X-Request-Id: the client's own when it is sane
 * (1..64 of [A-Za-z0-9._:-]), else a fresh one; the access line and the
 * route/status metrics are written when the request is over.
 * ------------------------------------------------------------------------ */

typedef struct pd_server pd_server;

/* API keys (server.api_key, server.api_keys_file) and their namespaces,
 * api/keys.c. The file: `KEY NAMESPACE` per line, `#` comments; refused
 * when group or others can read it. */
typedef struct pd_api_keys pd_api_keys;
int pd_api_keys_load(const char *api_key, const char *keys_file, pd_api_keys **out, pd_error *err);
void pd_api_keys_free(pd_api_keys *k);
/* Whether any key is configured (otherwise the API is open, namespace ""). */
bool pd_api_keys_required(const pd_api_keys *k);
/* The namespace of the key equal to token, or NULL (constant time over
 * every key). */
const char *pd_api_keys_match(const pd_api_keys *k, const char *token);

typedef struct pd_server_opts {
    const char *listen;        /* IPv4 or IPv6 address or host name (default 127.0.0.1) */
    int port;                  /* 0 = any free port (see pd_server_port) */
    const char *api_key;       /* NULL or "" = none; selects namespace "" */
    const char *api_keys_file; /* NULL or "" = none; KEY NAMESPACE lines */
    int threads;               /* event-loop threads; 0 = one per CPU (default) */
    unsigned max_connections;  /* default 4096 */
    unsigned max_connections_per_client; /* per client address; 0 = no limit (default) */
    int request_timeout_s;     /* a generation's deadline, submit to last token; 0 = none */
    int idle_timeout_s;        /* a connection that sends nothing this long is closed (default 15) */
    bool metrics;              /* serve GET /metrics (default true) */
    bool metrics_auth;         /* GET /metrics needs api_key like the API (default false) */
    /* Origins browsers may call the public listener from: ORIGIN[,ORIGIN...]
     * or "*"; NULL or "" = no CORS headers and OPTIONS is 405 (default). */
    const char *cors_origins;
    /* The daemon's log (not owned; NULL = none): one access line per
     * request, failed requests with their error, libmicrohttpd's messages. */
    const pd_logger *logger;
    pd_api_limits limits;
    /* Admin API (/admin/v1/...): admin_token NULL or "" = disabled (404).
     * admin_port != 0: a second listener on admin_listen:admin_port serves
     * only the admin routes and the public one does not; admin_port 0: the
     * public listener serves them too. */
    const char *admin_token;
    const char *admin_listen;  /* the same for the admin listener (default 127.0.0.1) */
    int admin_port;
} pd_server_opts;

/* What the routes serve once the model is loaded (not owned). */
typedef struct pd_server_backend {
    pd_model *model;
    pd_scheduler *sched;
    int32_t n_ctx;
    pd_chat_family family;
    char model_id[128];
    /* server.model_names: NAME[,NAME...] that a request's "model" may say
     * (model_id is the first); NULL or "": model_id only. */
    const char *model_names;
    int64_t created;           /* Unix seconds, for /v1/models */
    /* Admin API (all optional; without jobs and store it answers 503). */
    pd_jobs *jobs;
    pd_store *store;
    pd_hot *hot;
    pd_cluster *cluster;        /* optional: deletes and pins reach every node through it */
    const char *default_policy; /* compression.policy (NULL = the jobs' default) */
    double quality_budget;      /* compression.quality_budget; > 0: default "quality" */
} pd_server_backend;

void pd_server_opts_default(pd_server_opts *o);
/* The admin listener's port (-1 when there is none). */
int pd_server_admin_port(const pd_server *s);
/* metrics may be NULL; the server registers its series in it. */
int pd_server_start(const pd_server_opts *o, pd_metrics *metrics, pd_server **out, pd_error *err);
/* From now on the API routes serve b, /health says ok. */
void pd_server_set_ready(pd_server *s, const pd_server_backend *b);
/* No new generation starts after this returns (503 "shutting down"); the
 * ones already submitted run on. */
void pd_server_drain(pd_server *s);
int pd_server_port(const pd_server *s);
/* Stop accepting connections (the listening socket closes). */
void pd_server_quiesce(pd_server *s);
/* Wait up to `seconds` for every request in progress to be answered
 * (after the scheduler ended what was left, so that its final events, an
 * error and [DONE] for a stream, reach the clients); returns how many are
 * still in progress. */
int64_t pd_server_wait_idle(pd_server *s, double seconds);
/* Close every connection (releasing their scheduler requests) and free. */
void pd_server_stop(pd_server *s);

/* The operator console's static files (api/console/, embedded at build time
 * by api/console/embed.py), served under /admin/ui/. */
typedef struct pd_api_asset {
    const char *path;         /* the file's name: "index.html", "app.js" */
    const char *content_type;
    const unsigned char *data;
    size_t len;
} pd_api_asset;
/* The asset named path, or NULL. */
const pd_api_asset *pd_api_console_asset(const char *path);

/* ------------------------------------------------------------------------
 * Admin API (api/admin.c): prefix registration, jobs, the stored prefixes.
 * The server authenticates (Authorization: Bearer admin.token) and routes
 * here; these functions only see the request and answer JSON.
 *
 *   POST   /admin/v1/prefixes        register (exactly one of text, messages,
 *                                    segments); 201 when done (wait), else
 *                                    202 {"job_id","status_url"}
 *   GET    /admin/v1/jobs/{id}       job status (+ "prefix" when done)
 *   GET    /admin/v1/prefixes        stored prefixes (?namespace=NS)
 *   GET    /admin/v1/prefixes/{id}   one prefix
 *   DELETE /admin/v1/prefixes/{id}   204 (also dropped from the hot tier)
 *
 * docs/api.md describes the bodies and answers.
 * ------------------------------------------------------------------------ */

#define PD_ADMIN_PREFIX "/admin/"   /* every admin route starts with this */
#define PD_ADMIN_WAIT_S 600.0       /* longest a "wait": true registration blocks */

/* What the admin routes work on (not owned). */
typedef struct pd_admin_ctx {
    pd_server_backend b;        /* the served model, jobs, store, hot tier (may be NULL), defaults */
    pd_api_limits limits;       /* the server's: body size (413) and JSON nesting (400) */
    /* "wait": true polls this once a second and stops waiting (202) when it
     * says the server is stopping. May be NULL. */
    bool (*stopping)(void *stopping_ctx);
    void *stopping_ctx;
} pd_admin_ctx;

typedef struct pd_admin_reply {
    int status;                 /* 200, 201, 202, 204 */
    char *body;                 /* malloc'd JSON (NULL for 204) */
    size_t len;
} pd_admin_reply;

/* Serve one admin request. url is the path (no query); query_namespace is
 * the ?namespace= argument or NULL. On success *out holds the answer; on
 * failure e (status 400/404/405/413/500/503) and out->body is NULL. */
int pd_admin_handle(const pd_admin_ctx *ctx, const char *method, const char *url, const char *query_namespace,
                    const char *body, size_t len, pd_admin_reply *out, pd_api_error *e);

#ifdef __cplusplus
}
#endif
#endif
