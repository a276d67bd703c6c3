/* The HTTP server: libmicrohttpd's epoll event loop on a small fixed pool
 * of threads (server.threads), thin routing over the pure request/response
 * functions of request.c and response.c, and the scheduler underneath.
 *
 * No thread ever blocks on a client or on generation: a request waiting for
 * the engine (a non-streamed answer, a stream between tokens) is a
 * suspended connection that the engine's events resume; an admin call that
 * may wait for a job runs on a thread of its own. One watcher thread looks
 * after the waiting requests: their deadline, and whether their client has
 * gone (MHD does not watch a suspended connection's socket). */
#include <errno.h>
#include <inttypes.h>
#include <microhttpd.h>
#include <openssl/crypto.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netdb.h>

#include "api/api.h"

/* A listening socket: the public one, or the admin one (admin.port != 0). */
typedef struct listener {
    pd_server *srv;
    bool admin; /* serves only the admin routes */
} listener;

/* Compiled grammars kept for requests that repeat a schema or a tool list:
 * a grammar caches the token sets of its states, so a warm one masks fast. */
#define GRAMMAR_CACHE_SLOTS 8

typedef struct grammar_slot {
    char *text;
    pd_grammar *g;
    uint64_t used;
} grammar_slot;

struct pd_server {
    struct MHD_Daemon *mhd, *admin_mhd;
    listener pub, adm;
    pd_server_opts opts;
    pd_api_keys *keys;
    char admin_token[256];
    pd_metrics *metrics;
    pd_counter *errors, *streams;
    pd_histogram *prefill_seconds; /* admission to first token, per generation */
    pd_gauge *store_bytes, *store_prefixes, *hot_bytes; /* refreshed on each scrape */
    pthread_mutex_t mirror_mu; /* one scrape at a time brings the mirrored counters up to date */
    /* ready/backend: written by set_ready and drain, read by connection
     * threads, which hold the read lock from the check through
     * pd_scheduler_submit so that after drain nothing new is submitted. */
    pthread_rwlock_t lock;
    bool ready, draining;
    pd_server_backend backend;
    /* Constrained output: the model's vocabulary for the matcher (built at
     * the first request that needs it) and the grammar cache. */
    pthread_mutex_t grammar_mu;
    pd_grammar_vocab *gvocab;
    grammar_slot grammars[GRAMMAR_CACHE_SLOTS];
    uint64_t grammar_clock;
    /* new grammars waiting for the warmer thread (under grammar_mu) */
    pd_grammar *warm_queue[GRAMMAR_CACHE_SLOTS];
    int n_warm;
    pthread_cond_t warm_cv;
    atomic_bool warm_stop;
    pthread_t warmer;
    bool warmer_started;
    /* Requests between their first callback and on_completed: the drain
     * waits for them so that final events reach their clients. */
    pthread_mutex_t active_mu;
    pthread_cond_t active_cv;
    int64_t active;
    int admin_running;  /* admin calls on their own threads (active_mu) */
    /* Requests that may be suspended (submitted generations, running admin
     * calls), for the watcher and for the final resume before
     * MHD_stop_daemon; park_mu guards the list and watch_stop. */
    pthread_mutex_t park_mu;
    pthread_cond_t park_cv;
    struct http_req *parked;
    bool watch_stop, watcher_started;
    pthread_t watcher;
};

/* The longest X-Request-Id taken from a client. */
#define REQUEST_ID_MAX 64

/* One HTTP request: its body, then (for generation) the scheduler request
 * and what its events produced. Shared by the event-loop thread, the engine
 * thread (through the sink), the watcher and an admin call's thread; `mu`
 * guards everything below it. */
typedef struct http_req {
    pd_server *srv;
    struct MHD_Connection *conn;
    int fd;              /* the client's socket, polled by the watcher */
    struct http_req *park_prev, *park_next; /* srv->parked (srv->park_mu) */
    bool parked;
    char *body;
    size_t len, cap;
    bool too_large;

    pd_api_request areq;
    pd_api_response *resp;
    pd_sched_request *sreq;
    bool stream;

    pthread_mutex_t mu;
    bool done;           /* DONE or ERROR seen */
    bool has_deadline, timed_out;
    bool client_gone;    /* cancelled because the client closed the connection */
    struct timespec deadline; /* CLOCK_MONOTONIC */
    bool failed;
    pd_api_error err;
    bool suspended;      /* the connection waits for resume_locked */
    char *q;             /* streaming: SSE bytes not yet sent */
    size_t q_len, q_off, q_cap;
    /* An admin call: what its thread needs, and its answer. */
    bool admin_started;
    char *admin_method, *admin_url, *admin_ns;
    pd_admin_ctx admin_ctx;
    pd_admin_reply admin_rep;
    /* For the access line and the route/status metrics (on_completed).
     * has_usage and usage are the engine's (mu); the rest is only the
     * connection thread's. */
    char request_id[REQUEST_ID_MAX + 1];
    const char *route;   /* a route template: a bounded label value */
    const char *method;  /* MHD's string, valid until on_completed */
    double started;      /* pd_now_seconds at the first callback */
    unsigned status;     /* the status queued; 0 = none (the client went first) */
    char error[512];     /* the message of an error answer */
    bool has_usage;
    pd_sched_usage usage;
} http_req;

/* One connection's current request, as MHD's socket context, so that the
 * response path (queue_response) finds it from the connection alone. Only
 * the connection's own event-loop thread touches it. */
typedef struct conn_slot {
    const listener *li; /* the listener it came in on */
    http_req *cur;
} conn_slot;

/* ---- CORS (server.cors_origins) -------------------------------------------- */

#define CORS_ALLOW_METHODS "GET, POST, DELETE, OPTIONS"
#define CORS_ALLOW_HEADERS "Authorization, Content-Type, X-Request-Id"
#define CORS_EXPOSE_HEADERS "X-Request-Id, Retry-After"
#define CORS_MAX_AGE_S "7200" /* the most Chromium keeps a preflight */

/* The listener a connection came in on (kept in its slot), so that every
 * response can be given its CORS headers without passing the server around. */
static const listener *listener_of(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    const conn_slot *slot = ci ? ci->socket_context : NULL;
    return slot ? slot->li : NULL;
}

/* The configured origins of the listener c came in on; NULL when CORS is
 * off there (not configured, or the admin listener, which browsers have
 * no business calling). */
static const char *cors_origins(struct MHD_Connection *c) {
    const listener *li = listener_of(c);
    if (!li || li->admin) return NULL;
    const char *o = li->srv->opts.cors_origins;
    return o && *o ? o : NULL;
}

/* Whether the comma-separated list holds `item` (ASCII case-insensitive:
 * browsers send scheme and host in lower case, people may not write them
 * so). */
static bool list_has(const char *list, const char *item) {
    const size_t n = strlen(item);
    for (const char *p = list;;) {
        const char *end = strchr(p, ',');
        const size_t k = end ? (size_t)(end - p) : strlen(p);
        if (k == n && strncasecmp(p, item, n) == 0) return true;
        if (!end) return false;
        p = end + 1;
    }
}

/* The Access-Control-Allow-Origin value for this request ("*" or its
 * Origin), NULL when CORS is off or the Origin is not allowed; *vary is
 * set when the answer depends on the Origin (a list, not "*"). */
static const char *allowed_origin(struct MHD_Connection *c, bool *vary) {
    const char *origins = cors_origins(c);
    *vary = false;
    if (!origins) return NULL;
    const bool any = list_has(origins, "*");
    *vary = !any;
    const char *origin = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_ORIGIN);
    if (!origin || (!any && !list_has(origins, origin))) return NULL;
    return any ? "*" : origin;
}

/* The Access-Control-* headers every response of the public listener
 * carries for an allowed Origin (and Vary: Origin whenever the answer
 * depends on it). */
static void add_cors(struct MHD_Connection *c, struct MHD_Response *r) {
    bool vary;
    const char *allow = allowed_origin(c, &vary);
    if (vary) MHD_add_response_header(r, MHD_HTTP_HEADER_VARY, MHD_HTTP_HEADER_ORIGIN);
    if (!allow) return;
    MHD_add_response_header(r, MHD_HTTP_HEADER_ACCESS_CONTROL_ALLOW_ORIGIN, allow);
    MHD_add_response_header(r, MHD_HTTP_HEADER_ACCESS_CONTROL_EXPOSE_HEADERS, CORS_EXPOSE_HEADERS);
}

/* ---- small helpers -------------------------------------------------------- */

static http_req *current_request(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    const conn_slot *slot = ci ? ci->socket_context : NULL;
    return slot ? slot->cur : NULL;
}

/* Every answer goes out here: it carries the request's id, and its status
 * is kept for the access line. */
static enum MHD_Result queue_response(struct MHD_Connection *c, unsigned status, struct MHD_Response *resp) {
    http_req *r = current_request(c);
    add_cors(c, resp);
    if (r) {
        MHD_add_response_header(resp, "X-Request-Id", r->request_id);
        r->status = status;
    }
    return MHD_queue_response(c, status, resp);
}

static enum MHD_Result send_body(struct MHD_Connection *c, unsigned status, const char *type, char *body, size_t len) {
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    enum MHD_Result ret = queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result send_json(struct MHD_Connection *c, unsigned status, char *body, size_t len) {
    return send_body(c, status, "application/json", body, len);
}

static enum MHD_Result send_error(pd_server *s, struct MHD_Connection *c, const pd_api_error *e) {
    char *body = NULL;
    size_t len = 0;
    if (s->errors) pd_counter_add(s->errors, 1);
    http_req *req = current_request(c);
    if (req) snprintf(req->error, sizeof req->error, "%s", e->message);
    if (pd_api_error_json(e, &body, &len) != PD_OK) return MHD_NO;
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    /* Busy or stopping: a well-behaved client backs off this long. */
    if (e->http_status == 503 || e->http_status == 429) MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, "2");
    enum MHD_Result ret = queue_response(c, (unsigned)e->http_status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result send_errorf(pd_server *s, struct MHD_Connection *c, int status, const char *type,
                                   const char *code, const char *msg) {
    pd_api_error e;
    pd_api_errorf(&e, status, type, NULL, code, "%s", msg);
    return send_error(s, c, &e);
}

/* 413: the body, as declared (Content-Length) or as received (NULL), is
 * over server.max_body_bytes. */
static enum MHD_Result send_too_large(pd_server *s, struct MHD_Connection *c, const char *declared) {
    pd_api_error e;
    pd_api_errorf(&e, 413, PD_API_ERR_TOO_LARGE, NULL, NULL, "the request body%s%s%s is larger than %zu bytes "
                  "(server.max_body_bytes)", declared ? " (Content-Length " : "", declared ? declared : "",
                  declared ? ")" : "", s->opts.limits.max_body_bytes);
    return send_error(s, c, &e);
}

/* 503 before the model is loaded and after the drain began. */
static enum MHD_Result send_not_ready(pd_server *s, struct MHD_Connection *c, bool draining) {
    return send_errorf(s, c, 503, PD_API_ERR_OVERLOADED, draining ? "shutting_down" : "loading",
                       draining ? "the server is shutting down" : "the model is still loading; retry shortly");
}

static bool append(char **buf, size_t *len, size_t *cap, const char *data, size_t n) {
    if (*len + n + 1 > *cap) {
        size_t nc = *cap ? *cap : 4096;
        while (nc < *len + n + 1) nc *= 2;
        char *nb = realloc(*buf, nc);
        if (!nb) return false;
        *buf = nb;
        *cap = nc;
    }
    memcpy(*buf + *len, data, n);
    *len += n;
    (*buf)[*len] = '\0';
    return true;
}

/* The token of an `Authorization: Bearer TOKEN` header, or NULL. */
static const char *bearer_token(struct MHD_Connection *c) {
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    return h && strncmp(h, "Bearer ", 7) == 0 ? h + 7 : NULL;
}

/* The namespace the request's bearer token selects ("" when no key is
 * configured), or NULL when it is missing or wrong. */
static const char *client_namespace(const pd_server *s, struct MHD_Connection *c) {
    if (!pd_api_keys_required(s->keys)) return "";
    const char *tok = bearer_token(c);
    return tok ? pd_api_keys_match(s->keys, tok) : NULL;
}

static bool authorized(const pd_server *s, struct MHD_Connection *c) { return client_namespace(s, c) != NULL; }

static bool admin_authorized(const pd_server *s, struct MHD_Connection *c) {
    const char *tok = bearer_token(c);
    if (!tok) return false;
    size_t a = strlen(tok), b = strlen(s->admin_token);
    return a == b && CRYPTO_memcmp(tok, s->admin_token, a) == 0;
}

static bool get_backend(pd_server *s, pd_server_backend *out) {
    pthread_rwlock_rdlock(&s->lock);
    bool ready = s->ready;
    if (ready) *out = s->backend;
    pthread_rwlock_unlock(&s->lock);
    return ready;
}

/* CLOCK_MONOTONIC (the server's condition variables wait on it, see
 * cond_init_monotonic) `ms` from now. */
static struct timespec monotonic_after_ms(int64_t ms) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    t.tv_sec += (time_t)(ms / 1000);
    t.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return t;
}

/* Timed waits on the monotonic clock: a wall-clock step (NTP, an admin)
 * neither cuts nor stretches a deadline. */
static void cond_init_monotonic(pthread_cond_t *cv) {
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &a);
    pthread_condattr_destroy(&a);
}

static bool time_before(const struct timespec *a, const struct timespec *b) {
    return a->tv_sec < b->tv_sec || (a->tv_sec == b->tv_sec && a->tv_nsec < b->tv_nsec);
}

/* ---- suspended connections ------------------------------------------------ */

/* Park the connection until resume_locked; r->mu held. Only from MHD's
 * callbacks for this connection (the access handler or the content reader). */
static void suspend_locked(http_req *r) {
    r->suspended = true;
    MHD_suspend_connection(r->conn);
}

/* From any thread; r->mu held, so it never overtakes the suspend. */
static void resume_locked(http_req *r) {
    if (!r->suspended) return;
    r->suspended = false;
    MHD_resume_connection(r->conn);
}

static void park(pd_server *s, http_req *r) {
    pthread_mutex_lock(&s->park_mu);
    r->park_prev = NULL;
    r->park_next = s->parked;
    if (s->parked) s->parked->park_prev = r;
    s->parked = r;
    r->parked = true;
    pthread_mutex_unlock(&s->park_mu);
}

static void unpark(pd_server *s, http_req *r) {
    pthread_mutex_lock(&s->park_mu);
    if (r->parked) {
        if (r->park_prev) r->park_prev->park_next = r->park_next;
        else s->parked = r->park_next;
        if (r->park_next) r->park_next->park_prev = r->park_prev;
        r->parked = false;
    }
    pthread_mutex_unlock(&s->park_mu);
}

/* ---- the scheduler's events ------------------------------------------------ */

static void queue_sse(http_req *r, char *chunk, size_t len) {
    if (!chunk) return;
    if (!append(&r->q, &r->q_len, &r->q_cap, chunk, len)) r->failed = true;
    free(chunk);
}

/* A stream's last words when it cannot finish: the error as an event (its
 * headers are gone), then [DONE]. r->mu held. */
static void queue_sse_error(http_req *r) {
    char *chunk = NULL;
    size_t len = 0;
    if (pd_api_error_json(&r->err, &chunk, &len) != PD_OK) return;
    append(&r->q, &r->q_len, &r->q_cap, "data: ", 6);
    queue_sse(r, chunk, len);
    append(&r->q, &r->q_len, &r->q_cap, "\n\n" PD_API_SSE_DONE, 2 + strlen(PD_API_SSE_DONE));
}

/* The usage for the access line; r->mu held. */
static void keep_usage(http_req *r, const pd_sched_usage *u) {
    r->usage = *u;
    r->has_usage = true;
}

/* Runs on the engine thread. */
static void on_event(void *ctx, const pd_sched_event *ev) {
    http_req *r = ctx;
    pd_error err = {0};
    char *chunk = NULL;
    size_t len = 0;
    pthread_mutex_lock(&r->mu);
    switch (ev->kind) {
    case PD_SCHED_STARTED:
        if (ev->usage) pd_api_response_usage(r->resp, ev->usage);
        if (ev->usage) keep_usage(r, ev->usage);
        break;
    case PD_SCHED_TOKEN:
        if (pd_api_response_token(r->resp, ev->choice, ev->text, ev->len, ev->sample, &err)) r->failed = true;
        else if (r->stream && pd_api_response_sse_chunk(r->resp, ev->choice, &chunk, &len, &err) == PD_OK)
            queue_sse(r, chunk, len);
        break;
    case PD_SCHED_CHOICE_DONE:
        if (pd_api_response_finish(r->resp, ev->choice, ev->finish, &err)) r->failed = true;
        else if (r->stream && pd_api_response_sse_finish(r->resp, ev->choice, &chunk, &len, &err) == PD_OK)
            queue_sse(r, chunk, len);
        break;
    case PD_SCHED_DONE:
        if (ev->usage) pd_api_response_usage(r->resp, ev->usage);
        if (ev->usage) keep_usage(r, ev->usage);
        if (r->stream) {
            if (pd_api_response_sse_usage(r->resp, &chunk, &len, &err) == PD_OK) queue_sse(r, chunk, len);
            append(&r->q, &r->q_len, &r->q_cap, PD_API_SSE_DONE, strlen(PD_API_SSE_DONE));
        }
        r->done = true;
        break;
    case PD_SCHED_ERROR: {
        pd_error e = {.code = ev->error_code};
        snprintf(e.msg, sizeof e.msg, "%s", ev->error_msg ? ev->error_msg : "generation failed");
        if (r->timed_out)
            pd_api_errorf(&r->err, 504, PD_API_ERR_SERVER, NULL, "timeout",
                          "the request ran longer than server.request_timeout_s (%d s) and was cancelled; ask for "
                          "fewer tokens or raise the limit",
                          r->srv->opts.request_timeout_s);
        else
            pd_api_error_from(&r->err, &e, NULL);
        r->failed = true;
        r->done = true;
        if (r->stream) queue_sse_error(r);
        break;
    }
    }
    /* A non-streamed answer needs only the end; a stream, every byte. */
    if (r->stream || r->done) resume_locked(r);
    pthread_mutex_unlock(&r->mu);
}

/* The client closed its end (or the connection broke). */
static bool socket_closed(short revents) { return revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL); }

/* The watcher: every CLIENT_CHECK_MS, each waiting generation past its
 * deadline is cancelled (the scheduler then ends it with an error event,
 * which answers 504), and so is one whose client closed the connection (its
 * batch slot and the rest of its tokens go to someone who is listening).
 * One poll() over all their sockets. */
#define CLIENT_CHECK_MS 50
static void *watch_parked(void *arg) {
    pd_server *s = arg;
    struct pollfd *fds = NULL;
    http_req **reqs = NULL;
    size_t cap = 0;
    pthread_mutex_lock(&s->park_mu);
    while (!s->watch_stop) {
        size_t n = 0;
        for (http_req *r = s->parked; r; r = r->park_next) {
            if (!r->sreq) continue;
            if (n == cap) {
                size_t nc = cap ? 2 * cap : 64;
                struct pollfd *nf = realloc(fds, nc * sizeof *nf);
                if (nf) fds = nf;
                http_req **nr = nf ? realloc(reqs, nc * sizeof *nr) : NULL;
                if (nr) reqs = nr;
                if (!nf || !nr) break; /* watch the ones that fit; the rest next time */
                cap = nc;
            }
            fds[n] = (struct pollfd){.fd = r->fd, .events = POLLRDHUP};
            reqs[n++] = r;
        }
        if (n && poll(fds, (nfds_t)n, 0) < 0)
            for (size_t i = 0; i < n; i++) fds[i].revents = 0;
        const struct timespec now = monotonic_after_ms(0);
        for (size_t i = 0; i < n; i++) {
            http_req *r = reqs[i];
            bool cancel = false;
            pthread_mutex_lock(&r->mu);
            if (!r->done && r->has_deadline && !r->timed_out && !time_before(&now, &r->deadline))
                cancel = r->timed_out = true;
            else if (!r->done && !r->client_gone && socket_closed(fds[i].revents))
                cancel = r->client_gone = true;
            pthread_mutex_unlock(&r->mu);
            if (cancel) pd_sched_request_cancel(r->sreq);
        }
        const struct timespec next = monotonic_after_ms(CLIENT_CHECK_MS);
        pthread_cond_timedwait(&s->park_cv, &s->park_mu, &next);
    }
    pthread_mutex_unlock(&s->park_mu);
    free(fds);
    free(reqs);
    return NULL;
}

/* Streaming body: hand out queued SSE bytes; with none yet, park the
 * connection until the engine's next event resumes it. */
static ssize_t read_stream(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    http_req *r = cls;
    pthread_mutex_lock(&r->mu);
    ssize_t n;
    if (r->q_off < r->q_len) {
        size_t k = r->q_len - r->q_off < max ? r->q_len - r->q_off : max;
        memcpy(buf, r->q + r->q_off, k);
        r->q_off += k;
        if (r->q_off == r->q_len) r->q_off = r->q_len = 0;
        n = (ssize_t)k;
    } else if (r->done) {
        n = MHD_CONTENT_READER_END_OF_STREAM;
    } else {
        suspend_locked(r);
        n = 0;
    }
    pthread_mutex_unlock(&r->mu);
    return n;
}

/* ---- routes ---------------------------------------------------------------- */

/* A submitted non-streamed request: its answer once the engine is done;
 * until then (the first call, or a resume that was not the last) the
 * connection waits, suspended. */
static enum MHD_Result answer_generation(pd_server *s, struct MHD_Connection *c, http_req *r) {
    pthread_mutex_lock(&r->mu);
    if (!r->done) {
        suspend_locked(r);
        pthread_mutex_unlock(&r->mu);
        return MHD_YES;
    }
    const bool failed = r->failed;
    pd_api_error e = r->err;
    pthread_mutex_unlock(&r->mu);
    if (failed) {
        if (!e.http_status) pd_api_errorf(&e, 500, PD_API_ERR_SERVER, NULL, NULL, "generation failed");
        return send_error(s, c, &e);
    }
    char *body = NULL;
    size_t len = 0;
    pd_error err = {0};
    if (pd_api_response_json(r->resp, &body, &len, &err)) {
        pd_api_error_from(&e, &err, NULL);
        return send_error(s, c, &e);
    }
    return send_json(c, MHD_HTTP_OK, body, len);
}

/* The cached grammar for text, a new reference (under grammar_mu); NULL
 * when it is not cached. */
static pd_grammar *cached_grammar(pd_server *s, const char *text) {
    for (int i = 0; i < GRAMMAR_CACHE_SLOTS; i++) {
        grammar_slot *slot = &s->grammars[i];
        if (slot->text && strcmp(slot->text, text) == 0) {
            slot->used = ++s->grammar_clock;
            return pd_grammar_retain(slot->g);
        }
    }
    return NULL;
}

/* The compiled grammar for text (a new reference: pd_grammar_free it) and
 * the vocabulary it masks, from the cache or compiled now. A grammar too
 * large to build is a 400 naming param. */
static int server_grammar(pd_server *s, const pd_tokenizer *tok, const char *text, pd_grammar **g,
                          const pd_grammar_vocab **vocab, const char *param, pd_api_error *e) {
    pd_error err = {0};
    int rc = PD_OK;
    *g = NULL;
    pthread_mutex_lock(&s->grammar_mu);
    if (!s->gvocab) rc = pd_api_grammar_vocab(tok, &s->gvocab, &err);
    *vocab = s->gvocab;
    *g = rc ? NULL : cached_grammar(s, text);
    pthread_mutex_unlock(&s->grammar_mu);
    if (rc || *g) goto done;
    /* compiled unlocked: a large grammar takes up to a second, and cache
     * hits of other requests must not wait for it */
    pd_grammar *fresh = NULL;
    char *copy = strdup(text);
    if (!copy) rc = pd_errorf(&err, PD_ENOMEM, "out of memory for a grammar");
    else rc = pd_grammar_compile(text, strlen(text), &fresh, &err);
    if (rc) {
        free(copy);
        goto done;
    }
    pthread_mutex_lock(&s->grammar_mu);
    if ((*g = cached_grammar(s, text))) { /* another request compiled it meanwhile */
        free(copy);
        pd_grammar_free(fresh);
    } else {
        grammar_slot *victim = &s->grammars[0];
        for (int i = 1; i < GRAMMAR_CACHE_SLOTS; i++)
            if (s->grammars[i].used < victim->used) victim = &s->grammars[i];
        free(victim->text);
        pd_grammar_free(victim->g);
        victim->text = copy;
        victim->g = fresh;
        victim->used = ++s->grammar_clock;
        *g = pd_grammar_retain(fresh);
        if (s->warmer_started && s->n_warm < GRAMMAR_CACHE_SLOTS) {
            s->warm_queue[s->n_warm++] = pd_grammar_retain(fresh);
            pthread_cond_signal(&s->warm_cv);
        }
    }
    pthread_mutex_unlock(&s->grammar_mu);
done:
    if (rc) pd_api_error_from(e, &err, rc == PD_ENOMEM ? NULL : param);
    return rc;
}

/* Computes each new grammar's token sets ahead of the engine thread, at a
 * low priority, so that a schema seen for the first time stalls the
 * running sequences as little as possible: the engine thread computes what
 * it reaches before the warmer does, and the cache keeps whichever is
 * first. */
static void *warm_grammars(void *arg) {
    pd_server *s = arg;
    setpriority(PRIO_PROCESS, (id_t)gettid(), 10); /* this thread only (Linux) */
    pthread_mutex_lock(&s->grammar_mu);
    for (;;) {
        while (!s->n_warm && !atomic_load(&s->warm_stop)) pthread_cond_wait(&s->warm_cv, &s->grammar_mu);
        if (atomic_load(&s->warm_stop)) break;
        pd_grammar *g = s->warm_queue[--s->n_warm];
        const pd_grammar_vocab *v = s->gvocab;
        pthread_mutex_unlock(&s->grammar_mu);
        pd_error err = {0};
        if (pd_grammar_warm(g, v, &s->warm_stop, &err))
            pd_log(s->opts.logger, PD_LOG_WARN, "grammar warm-up stopped: %s", err.msg);
        pd_grammar_free(g);
        pthread_mutex_lock(&s->grammar_mu);
    }
    pthread_mutex_unlock(&s->grammar_mu);
    return NULL;
}

static enum MHD_Result handle_generate(pd_server *s, struct MHD_Connection *c, http_req *r, pd_api_kind kind,
                                       const char *ns) {
    pd_api_error e;
    if (pd_api_parse_request(kind, r->body ? r->body : "", r->len, &s->opts.limits, &r->areq, &e) ||
        pd_api_request_namespace(&r->areq, ns, &e))
        return send_error(s, c, &e);
    pthread_rwlock_rdlock(&s->lock);
    if (!s->ready) {
        const bool draining = s->draining;
        pthread_rwlock_unlock(&s->lock);
        return send_not_ready(s, c, draining);
    }
    const pd_server_backend b = s->backend;
    if (!pd_api_model_served(b.model_names, b.model_id, r->areq.model)) {
        pthread_rwlock_unlock(&s->lock);
        pd_api_errorf(&e, 404, PD_API_ERR_NOT_FOUND, "model", "model_not_found",
                      "the model '%.64s' is not served here; this server serves '%s' (GET /v1/models; more names: "
                      "server.model_names)", r->areq.model, b.model_id);
        return send_error(s, c, &e);
    }
    pd_token *prompt = NULL;
    int64_t n_prompt = 0;
    const pd_tokenizer *tok = pd_model_tokenizer(b.model);
    if (pd_api_prompt_tokens(&r->areq, tok, b.family, &s->opts.limits, &prompt, &n_prompt, NULL, &e)) {
        pthread_rwlock_unlock(&s->lock);
        return send_error(s, c, &e);
    }
    pd_sched_params sp;
    const pd_hparams *hp = pd_model_hparams(b.model);
    int rc = pd_api_sched_params(&r->areq, prompt, n_prompt, b.n_ctx, hp->n_vocab, &s->opts.limits, &sp, &e);
    pd_api_constraint con = {0};
    pd_grammar *grammar = NULL;
    if (!rc) rc = pd_api_constraint_build(&r->areq, b.family, tok, &con, &e);
    if (!rc && con.grammar)
        rc = server_grammar(s, tok, con.grammar, &grammar, &sp.grammar_vocab,
                            r->areq.grammar                              ? "grammar"
                            : r->areq.format == PD_API_FORMAT_JSON_SCHEMA ? "response_format.json_schema.schema"
                            : con.tool_calls                             ? "tools"
                                                                         : "response_format",
                            &e);
    sp.grammar = grammar;
    /* a call syntax may start with a control token ([TOOL_CALLS]): its text
     * must reach the answer for the calls to be read back */
    if (con.tool_calls) sp.gen.special = true;
    pd_api_response_opts ro;
    pd_api_response_opts_from(&r->areq, tok, &ro);
    ro.model = b.model_id;
    ro.tool_calls = con.tool_calls;
    ro.syntax = con.syntax;
    pd_error err = {0};
    if (!rc && pd_api_response_create(&ro, &r->resp, &err)) rc = pd_api_error_from(&e, &err, NULL);
    r->stream = r->areq.stream;
    if (s->opts.request_timeout_s > 0) {
        r->deadline = monotonic_after_ms((int64_t)s->opts.request_timeout_s * 1000);
        r->has_deadline = true;
    }
    if (!rc && pd_scheduler_submit(b.sched, &sp, on_event, r, &r->sreq, &err)) {
        pd_api_error_from(&e, &err, NULL);
        rc = PD_EINVAL;
    }
    pthread_rwlock_unlock(&s->lock);
    free(prompt);
    pd_grammar_free(grammar); /* the scheduler's matchers hold their own references */
    pd_api_constraint_free(&con);
    if (rc) return send_error(s, c, &e);

    park(s, r);
    if (r->stream) {
        if (s->streams) pd_counter_add(s->streams, 1);
        struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, read_stream, r, NULL);
        if (!resp) return MHD_NO;
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        enum MHD_Result ret = queue_response(c, MHD_HTTP_OK, resp);
        MHD_destroy_response(resp);
        return ret;
    }
    return answer_generation(s, c, r);
}

static bool server_stopping(void *ctx) {
    pd_server *s = ctx;
    pthread_rwlock_rdlock(&s->lock);
    bool d = s->draining;
    pthread_rwlock_unlock(&s->lock);
    return d;
}

/* GET /v1/models/{id}: the id is the rest of the path, URL-decoded, so a
 * name with '/' ("org/model") is reached either as it is or with %2F (what
 * the openai clients send). Every name in server.model_names is a model of
 * its own here: retrieving one answers with that name as the id. */
#define MODEL_ROUTE "/v1/models/"
static enum MHD_Result answer_model(pd_server *s, struct MHD_Connection *c, const char *id) {
    if (!authorized(s, c))
        return send_errorf(s, c, 401, PD_API_ERR_AUTH, "invalid_api_key", "missing or wrong API key "
                           "(send Authorization: Bearer KEY)");
    pd_server_backend b;
    if (!get_backend(s, &b)) return send_not_ready(s, c, server_stopping(s));
    pd_api_error e;
    if (!pd_api_model_served(b.model_names, b.model_id, id)) {
        pd_api_errorf(&e, 404, PD_API_ERR_NOT_FOUND, "model", "model_not_found",
                      "the model '%.64s' is not served here; this server serves '%s' (GET /v1/models; more names: "
                      "server.model_names)", id, b.model_id);
        return send_error(s, c, &e);
    }
    char *body = NULL;
    size_t len = 0;
    pd_error err = {0};
    if (pd_api_model_json(id, b.created, &body, &len, &err)) return MHD_NO;
    return send_json(c, MHD_HTTP_OK, body, len);
}

/* POST /tokenize and /detokenize with the model's tokenizer. Like a
 * completion's prompt, the text is tokenized here on the event-loop
 * thread; server.max_body_bytes and the prompt-token limit bound it. */
static enum MHD_Result handle_tokenize(pd_server *s, struct MHD_Connection *c, http_req *r, bool detokenize) {
    pd_api_tokenize_request tr;
    pd_api_error e;
    if (pd_api_parse_tokenize(detokenize, r->body, r->len, &s->opts.limits, &tr, &e)) return send_error(s, c, &e);
    /* the read lock keeps the model loaded while its tokenizer is in use */
    pthread_rwlock_rdlock(&s->lock);
    if (!s->ready) {
        const bool draining = s->draining;
        pthread_rwlock_unlock(&s->lock);
        pd_api_tokenize_request_free(&tr);
        return send_not_ready(s, c, draining);
    }
    char *body = NULL;
    size_t len = 0;
    const int rc = pd_api_tokenize_answer(&tr, pd_model_tokenizer(s->backend.model), &s->opts.limits, &body, &len, &e);
    pthread_rwlock_unlock(&s->lock);
    pd_api_tokenize_request_free(&tr);
    if (rc) return send_error(s, c, &e);
    return send_json(c, MHD_HTTP_OK, body, len);
}

/* A CORS preflight (OPTIONS while server.cors_origins is set): 204, with
 * the Access-Control-Allow-* headers when the Origin is allowed. It needs
 * no API key: browsers never send one with a preflight. */
static enum MHD_Result answer_preflight(struct MHD_Connection *c) {
    struct MHD_Response *resp = MHD_create_response_from_buffer(0, NULL, MHD_RESPMEM_PERSISTENT);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, CORS_ALLOW_METHODS);
    bool vary;
    if (allowed_origin(c, &vary)) {
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ACCESS_CONTROL_ALLOW_METHODS, CORS_ALLOW_METHODS);
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ACCESS_CONTROL_ALLOW_HEADERS, CORS_ALLOW_HEADERS);
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ACCESS_CONTROL_MAX_AGE, CORS_MAX_AGE_S);
    }
    enum MHD_Result ret = queue_response(c, MHD_HTTP_NO_CONTENT, resp); /* + origin, id */
    MHD_destroy_response(resp);
    return ret;
}

/* A counter that mirrors a total kept elsewhere (the hot tier's, the
 * shared tier's): registered on first use, raised to the total. Under
 * mirror_mu, so two scrapes never add the same difference twice. */
static void mirror_counter(pd_metrics *m, const char *name, const char *help, double total) {
    pd_counter *c;
    pd_error e;
    if (pd_metrics_counter(m, name, help, NULL, &c, &e) != PD_OK) return;
    const double now = pd_counter_value(c);
    if (total > now) pd_counter_add(c, total - now);
}

static void mirror_gauge(pd_metrics *m, const char *name, const char *help, double v) {
    pd_gauge *g;
    pd_error e;
    if (pd_metrics_gauge(m, name, help, NULL, &g, &e) == PD_OK) pd_gauge_set(g, v);
}

/* The Prometheus text of the registry (GET /metrics and GET
 * /admin/v1/metrics), the store and hot-tier gauges refreshed first. */
static enum MHD_Result answer_metrics(pd_server *s, struct MHD_Connection *c) {
    pd_server_backend b;
    const bool ready = get_backend(s, &b);
    pd_error err = {0};
    if (ready && b.store) {
        pd_store_stats st;
        if (pd_store_stats_get(b.store, &st, &err) == PD_OK) {
            pd_gauge_set(s->store_bytes, (double)st.bytes);
            pd_gauge_set(s->store_prefixes, (double)st.prefixes);
        }
    }
    pthread_mutex_lock(&s->mirror_mu);
    if (ready && b.hot) {
        pd_hot_stats hs;
        pd_hot_stats_get(b.hot, &hs);
        pd_gauge_set(s->hot_bytes, (double)hs.bytes);
        mirror_counter(s->metrics, "prefixd_hot_tier_hits_total", "Stored prefixes served from the in-memory tier.",
                       (double)hs.hits);
        mirror_counter(s->metrics, "prefixd_hot_tier_misses_total",
                       "Stored prefixes the in-memory tier had to load from the store.", (double)hs.misses);
    }
    if (ready && b.cluster) {
        pd_cluster_stats cs;
        pd_cluster_stats_get(b.cluster, &cs);
        mirror_gauge(s->metrics, "prefixd_cluster_up", "1 when the shared tier (Redis) answered the last attempt.",
                     cs.up ? 1 : 0);
        mirror_counter(s->metrics, "prefixd_cluster_errors_total",
                       "Failed calls to the shared tier (outages, error replies).", (double)cs.errors);
        mirror_counter(s->metrics, "prefixd_cluster_published_total", "Prefixes this node sent to the shared tier.",
                       (double)cs.published);
        mirror_counter(s->metrics, "prefixd_cluster_fetched_total",
                       "Prefixes fetched from the shared tier, verified and stored here.", (double)cs.fetched);
        mirror_counter(s->metrics, "prefixd_cluster_misses_total",
                       "Lookups in the shared tier that found nothing to fetch.", (double)cs.misses);
        mirror_counter(s->metrics, "prefixd_cluster_rejected_total",
                       "Prefixes from the shared tier that failed verification and were not used.",
                       (double)cs.rejected);
        mirror_counter(s->metrics, "prefixd_cluster_invalidations_total",
                       "Prefixes dropped here because another node deleted them.", (double)cs.invalidations);
    }
    pthread_mutex_unlock(&s->mirror_mu);
    char *text = NULL;
    size_t len = 0;
    if (pd_metrics_render(s->metrics, &text, &len, &err)) return MHD_NO;
    return send_body(c, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", text, len);
}

/* The model list (GET /v1/models and GET /admin/v1/models). */
static enum MHD_Result answer_models(pd_server *s, struct MHD_Connection *c) {
    pd_server_backend b;
    if (!get_backend(s, &b)) return send_errorf(s, c, 503, PD_API_ERR_OVERLOADED, "loading", "the model is still loading");
    char *body = NULL;
    size_t len = 0;
    pd_error err = {0};
    if (pd_api_models_json(b.model_id, b.created, &body, &len, &err)) return MHD_NO;
    return send_json(c, MHD_HTTP_OK, body, len);
}

static enum MHD_Result handle_get(pd_server *s, struct MHD_Connection *c, const char *url) {
    pd_server_backend b;
    bool ready = get_backend(s, &b);
    if (strcmp(url, "/health") == 0) {
        pthread_rwlock_rdlock(&s->lock);
        bool draining = s->draining;
        pthread_rwlock_unlock(&s->lock);
        const char *msg = ready      ? "{\"status\":\"ok\"}"
                          : draining ? "{\"status\":\"draining\"}"
                                     : "{\"status\":\"loading\"}";
        char *body = strdup(msg);
        if (!body) return MHD_NO;
        return send_json(c, ready ? MHD_HTTP_OK : MHD_HTTP_SERVICE_UNAVAILABLE, body, strlen(body));
    }
    if (strcmp(url, "/metrics") == 0 && s->opts.metrics && s->metrics) {
        if (s->opts.metrics_auth && !authorized(s, c))
            return send_errorf(s, c, 401, PD_API_ERR_AUTH, "invalid_api_key",
                               "missing or wrong API key (send Authorization: Bearer KEY; server.metrics_auth is on)");
        return answer_metrics(s, c);
    }
    if (strcmp(url, "/v1/models") == 0) {
        if (!authorized(s, c))
            return send_errorf(s, c, 401, PD_API_ERR_AUTH, "invalid_api_key", "missing or wrong API key "
                               "(send Authorization: Bearer KEY)");
        return answer_models(s, c);
    }
    if (strncmp(url, MODEL_ROUTE, strlen(MODEL_ROUTE)) == 0) return answer_model(s, c, url + strlen(MODEL_ROUTE));
    return send_errorf(s, c, 404, PD_API_ERR_NOT_FOUND, NULL, "no such route");
}

/* ---- the operator console and the admin listener's own routes --------------- */

/* The console's static files (api/console/, embedded): public, since they
 * hold no data; every data call of the page sends the admin token. The
 * page loads nothing from elsewhere and runs no inline code, so the policy
 * allows only this origin. */
#define CONSOLE_ROUTE "/admin/ui"
#define CONSOLE_CSP                                                                                          \
    "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'; " \
    "frame-ancestors 'none'"

static enum MHD_Result answer_console(pd_server *s, struct MHD_Connection *c, const char *url, const char *method) {
    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
        return send_errorf(s, c, 405, PD_API_ERR_INVALID, NULL, "the console's files answer GET only");
    struct MHD_Response *resp;
    unsigned status;
    if (strcmp(url, CONSOLE_ROUTE) == 0) { /* relative links in the page need the slash */
        resp = MHD_create_response_from_buffer(0, NULL, MHD_RESPMEM_PERSISTENT);
        if (!resp) return MHD_NO;
        MHD_add_response_header(resp, MHD_HTTP_HEADER_LOCATION, CONSOLE_ROUTE "/");
        status = MHD_HTTP_PERMANENT_REDIRECT;
    } else {
        const char *name = url + strlen(CONSOLE_ROUTE "/");
        const pd_api_asset *a = pd_api_console_asset(*name ? name : "index.html");
        if (!a) return send_errorf(s, c, 404, PD_API_ERR_NOT_FOUND, NULL, "no such file of the console");
        resp = MHD_create_response_from_buffer(a->len, (void *)a->data, MHD_RESPMEM_PERSISTENT);
        if (!resp) return MHD_NO;
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, a->content_type);
        status = MHD_HTTP_OK;
    }
    MHD_add_response_header(resp, "Content-Security-Policy", CONSOLE_CSP);
    MHD_add_response_header(resp, "X-Content-Type-Options", "nosniff");
    MHD_add_response_header(resp, "Referrer-Policy", "no-referrer");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    enum MHD_Result ret = queue_response(c, status, resp);
    MHD_destroy_response(resp);
    return ret;
}

static enum MHD_Result send_admin_unauthorized(pd_server *s, struct MHD_Connection *c) {
    return send_errorf(s, c, 401, PD_API_ERR_AUTH, "invalid_admin_token",
                       "missing or wrong admin token (send Authorization: Bearer ADMIN_TOKEN, admin.token)");
}

/* The admin routes served here rather than by api/admin.c: the console,
 * the metrics, the model list and the playground's completions (the public endpoints
 * reached with the admin token, so that the console works from the admin
 * listener alone, without CORS). *handled is false for every other URL. */
static enum MHD_Result route_admin_local(pd_server *s, struct MHD_Connection *c, http_req *r, const char *url,
                                         const char *method, bool *handled) {
    *handled = true;
    if (strcmp(url, CONSOLE_ROUTE) == 0 || strncmp(url, CONSOLE_ROUTE "/", strlen(CONSOLE_ROUTE "/")) == 0)
        return answer_console(s, c, url, method);
    const bool metrics = strcmp(url, "/admin/v1/metrics") == 0, models = strcmp(url, "/admin/v1/models") == 0;
    const bool chat = strcmp(url, "/admin/v1/chat/completions") == 0;
    const bool completion = strcmp(url, "/admin/v1/completions") == 0;
    if (!metrics && !models && !chat && !completion) {
        *handled = false;
        return MHD_YES;
    }
    if (!admin_authorized(s, c)) return send_admin_unauthorized(s, c);
    if (models) {
        if (strcmp(method, MHD_HTTP_METHOD_GET) != 0)
            return send_errorf(s, c, 405, PD_API_ERR_INVALID, NULL, "use GET");
        return answer_models(s, c);
    }
    if (metrics) {
        if (strcmp(method, MHD_HTTP_METHOD_GET) != 0)
            return send_errorf(s, c, 405, PD_API_ERR_INVALID, NULL, "use GET");
        if (!s->metrics)
            return send_errorf(s, c, 404, PD_API_ERR_NOT_FOUND, NULL, "this server keeps no metrics");
        return answer_metrics(s, c);
    }
    if (strcmp(method, MHD_HTTP_METHOD_POST) != 0) return send_errorf(s, c, 405, PD_API_ERR_INVALID, NULL, "use POST");
    const char *ns = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "namespace");
    return handle_generate(s, c, r, chat ? PD_API_CHAT : PD_API_COMPLETION, ns ? ns : "");
}

/* An admin call on its own thread: a registration may wait for its job
 * (wait: true), which must not stall an event-loop thread. The answer is
 * kept for answer_admin and the connection resumed. */
static void *run_admin(void *arg) {
    http_req *r = arg;
    pd_server *s = r->srv;
    pd_admin_reply rep = {0};
    pd_api_error e;
    const int rc = pd_admin_handle(&r->admin_ctx, r->admin_method, r->admin_url, r->admin_ns, r->body, r->len, &rep, &e);
    pthread_mutex_lock(&r->mu);
    r->admin_rep = rep;
    r->failed = rc != PD_OK;
    if (rc) r->err = e;
    r->done = true;
    resume_locked(r);
    pthread_mutex_unlock(&r->mu);
    pthread_mutex_lock(&s->active_mu);
    if (--s->admin_running == 0) pthread_cond_broadcast(&s->active_cv);
    pthread_mutex_unlock(&s->active_mu);
    return NULL;
}

/* At most this many admin calls at once; they are the operator's, but
 * each is a thread. */
#define MAX_ADMIN_CALLS 64

static enum MHD_Result answer_admin(pd_server *s, struct MHD_Connection *c, http_req *r) {
    pthread_mutex_lock(&r->mu);
    if (!r->done) {
        suspend_locked(r);
        pthread_mutex_unlock(&r->mu);
        return MHD_YES;
    }
    pthread_mutex_unlock(&r->mu);
    if (r->failed) return send_error(s, c, &r->err);
    pd_admin_reply *rep = &r->admin_rep;
    if (!rep->body) {
        struct MHD_Response *resp = MHD_create_response_from_buffer(0, NULL, MHD_RESPMEM_PERSISTENT);
        if (!resp) return MHD_NO;
        enum MHD_Result ret = queue_response(c, (unsigned)rep->status, resp);
        MHD_destroy_response(resp);
        return ret;
    }
    char *body = rep->body;
    rep->body = NULL;
    return send_json(c, (unsigned)rep->status, body, rep->len);
}

/* /admin/...: authenticated with admin.token, then api/admin.c on a thread
 * of its own. The backend is copied and the lock not held: the jobs outlive
 * the server (cmd/prefixd/main.c frees them after it). */
static enum MHD_Result handle_admin(pd_server *s, struct MHD_Connection *c, http_req *r, const char *url,
                                    const char *method) {
    if (!admin_authorized(s, c)) return send_admin_unauthorized(s, c);
    pd_server_backend b;
    if (!get_backend(s, &b)) return send_not_ready(s, c, server_stopping(s));
    r->admin_ctx = (pd_admin_ctx){.b = b, .limits = s->opts.limits,
                                  .stopping = server_stopping, .stopping_ctx = s};
    const char *ns = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "namespace");
    r->admin_method = strdup(method);
    r->admin_url = strdup(url);
    r->admin_ns = ns ? strdup(ns) : NULL;
    if (!r->admin_method || !r->admin_url || (ns && !r->admin_ns)) return MHD_NO;
    pthread_mutex_lock(&s->active_mu);
    const bool room = s->admin_running < MAX_ADMIN_CALLS;
    if (room) s->admin_running++;
    pthread_mutex_unlock(&s->active_mu);
    if (!room)
        return send_errorf(s, c, 429, PD_API_ERR_RATE_LIMIT, "too_many_admin_calls",
                           "too many admin calls in progress; retry shortly");
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t t;
    park(s, r);
    pthread_mutex_lock(&r->mu);
    r->admin_started = true;
    const int prc = pthread_create(&t, &attr, run_admin, r);
    pthread_attr_destroy(&attr);
    if (prc) {
        r->done = r->failed = true;
        pd_api_errorf(&r->err, 503, PD_API_ERR_OVERLOADED, NULL, "out_of_threads",
                      "cannot start a thread for the admin call (%s); retry shortly", strerror(prc));
        pthread_mutex_unlock(&r->mu);
        pthread_mutex_lock(&s->active_mu);
        s->admin_running--;
        pthread_mutex_unlock(&s->active_mu);
        return answer_admin(s, c, r);
    }
    suspend_locked(r);
    pthread_mutex_unlock(&r->mu);
    return MHD_YES;
}

/* ---- request ids, the access log, route/status metrics --------------------- */

/* A client's X-Request-Id is kept when it is 1..REQUEST_ID_MAX characters
 * of [A-Za-z0-9._:-] (it lands in logs and headers as it is). */
static bool sane_request_id(const char *id) {
    size_t n = 0;
    for (; id[n]; n++) {
        const char ch = id[n];
        if (n == REQUEST_ID_MAX ||
            !((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '.' ||
              ch == '_' || ch == ':' || ch == '-'))
            return false;
    }
    return n > 0;
}

/* 16 hex digits from the kernel's random pool. */
static void new_request_id(char *out, size_t cap) {
    uint64_t v;
    if (getrandom(&v, sizeof v, GRND_NONBLOCK) != (ssize_t)sizeof v) {
        /* No entropy yet (early boot): unique enough for correlating logs. */
        static _Atomic uint64_t fallback;
        v = pd_mix64(atomic_fetch_add(&fallback, 1) ^ (uint64_t)(pd_now_seconds() * 1e9));
    }
    snprintf(out, cap, "%016llx", (unsigned long long)v);
}

/* The route template a URL is counted and logged under: a fixed set, so
 * the metrics' label values stay bounded whatever clients send. */
static const char *route_of(const char *url, bool admin_listener) {
    static const char *const exact[] = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
                                        "/detokenize", "/health", "/metrics", "/admin/v1/prefixes",
                                        "/admin/v1/policies", "/admin/v1/metrics", "/admin/v1/models", "/admin/v1/completions",
                                        "/admin/v1/chat/completions", "/admin/ui"};
    for (size_t i = 0; i < sizeof exact / sizeof exact[0]; i++)
        if (strcmp(url, exact[i]) == 0) return exact[i];
    static const struct {
        const char *prefix, *route;
    } templated[] = {{"/v1/models/", "/v1/models/{id}"},
                     {"/admin/v1/prefixes/", "/admin/v1/prefixes/{id}"},
                     {"/admin/v1/jobs/", "/admin/v1/jobs/{id}"},
                     {"/admin/ui/", "/admin/ui/{file}"}};
    /* a prefix's kept rows: the one route below a prefix */
    static const char prefix_route[] = "/admin/v1/prefixes/", kept[] = "/kept";
    const size_t n = strlen(url);
    if (strncmp(url, prefix_route, strlen(prefix_route)) == 0 && n > strlen(prefix_route) + strlen(kept) &&
        strcmp(url + n - strlen(kept), kept) == 0)
        return "/admin/v1/prefixes/{id}/kept";
    for (size_t i = 0; i < sizeof templated / sizeof templated[0]; i++)
        if (strncmp(url, templated[i].prefix, strlen(templated[i].prefix)) == 0) return templated[i].route;
    return admin_listener || strncmp(url, PD_ADMIN_PREFIX, strlen(PD_ADMIN_PREFIX)) == 0 ? "/admin/other" : "other";
}

/* At a request's first callback: its id (also the response header), route
 * and start time, and the connection's current request. */
static void begin_access(http_req *r, struct MHD_Connection *c, const char *url, const char *method,
                         bool admin_listener) {
    r->started = pd_now_seconds();
    r->route = route_of(url, admin_listener);
    r->method = method;
    const char *given = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Request-Id");
    if (given && sane_request_id(given)) snprintf(r->request_id, sizeof r->request_id, "%s", given);
    else new_request_id(r->request_id, sizeof r->request_id);
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    conn_slot *slot = ci ? ci->socket_context : NULL;
    if (slot) slot->cur = r;
}

/* MHD's connection notifications: a slot per connection for its current request. */
static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode code) {
    (void)c;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        conn_slot *slot = calloc(1, sizeof *slot); /* NULL: requests go without an id header or CORS */
        if (slot) slot->li = cls;
        *socket_context = slot;
    } else {
        free(*socket_context);
        *socket_context = NULL;
    }
}

#define REQUEST_SECONDS_BOUNDS 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300

/* prefixd_http_requests_total{route,status} and
 * prefixd_http_request_duration_seconds{route}: the series of a route and
 * status are registered the first time they occur. */
static void count_request(pd_server *s, const http_req *r, unsigned status, double seconds) {
    if (!s->metrics) return;
    static const double bounds[] = {REQUEST_SECONDS_BOUNDS};
    char labels[160];
    pd_error err = {0};
    pd_counter *n = NULL;
    pd_histogram *h = NULL;
    snprintf(labels, sizeof labels, "route=\"%s\",status=\"%u\"", r->route, status);
    if (pd_metrics_counter(s->metrics, "prefixd_http_requests_total", "HTTP requests answered, by route and status.",
                           labels, &n, &err) == PD_OK)
        pd_counter_add(n, 1);
    snprintf(labels, sizeof labels, "route=\"%s\"", r->route);
    if (pd_metrics_histogram(s->metrics, "prefixd_http_request_duration_seconds",
                             "First byte of the request to the last byte of the answer, by route.", labels, bounds,
                             sizeof bounds / sizeof bounds[0], &h, &err) == PD_OK)
        pd_histogram_observe(h, seconds);
}

static const char *termination_name(enum MHD_RequestTerminationCode toe) {
    switch (toe) {
    case MHD_REQUEST_TERMINATED_COMPLETED_OK: return "completed";
    case MHD_REQUEST_TERMINATED_TIMEOUT_REACHED: return "idle_timeout";
    case MHD_REQUEST_TERMINATED_CLIENT_ABORT: return "client_abort";
    case MHD_REQUEST_TERMINATED_DAEMON_SHUTDOWN: return "shutdown";
    default: return "error";
    }
}

/* The request is over: count it and write its access line (warn for 5xx,
 * info otherwise). A request that got no answer (the client left first)
 * counts as 499, as nginx logs it. */
static void end_access(pd_server *s, http_req *r, struct MHD_Connection *c, enum MHD_RequestTerminationCode toe) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    conn_slot *slot = ci ? ci->socket_context : NULL;
    if (slot && slot->cur == r) slot->cur = NULL;
    const double seconds = pd_now_seconds() - r->started;
    const unsigned status = r->status ? r->status : 499;
    pthread_mutex_lock(&r->mu);
    const bool has_usage = r->has_usage, failed = r->failed;
    const pd_sched_usage u = r->usage;
    if (failed && !r->error[0]) snprintf(r->error, sizeof r->error, "%s", r->err.message);
    pthread_mutex_unlock(&r->mu);
    count_request(s, r, status, seconds);
    /* Admission to the first token: the prefill of what the cache did not cover. */
    if (has_usage && u.ttft_seconds > 0) pd_histogram_observe(s->prefill_seconds, u.ttft_seconds - u.queue_seconds);

    const pd_log_level level = status >= 500 ? PD_LOG_WARN : PD_LOG_INFO;
    if (!pd_log_enabled(s->opts.logger, level)) return;
    char client[INET6_ADDRSTRLEN] = "";
    const union MHD_ConnectionInfo *ai = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (ai && ai->client_addr) {
        const struct sockaddr *sa = ai->client_addr;
        if (sa->sa_family == AF_INET) inet_ntop(AF_INET, &((const struct sockaddr_in *)sa)->sin_addr, client, sizeof client);
        else if (sa->sa_family == AF_INET6)
            inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)sa)->sin6_addr, client, sizeof client);
    }
    pd_log_field f[20];
    size_t n = 0;
    f[n++] = PD_LOG_STR("event", "access");
    f[n++] = PD_LOG_STR("request_id", r->request_id);
    f[n++] = PD_LOG_STR("method", r->method);
    f[n++] = PD_LOG_STR("route", r->route);
    f[n++] = PD_LOG_INT("status", status);
    f[n++] = PD_LOG_NUM("duration_s", seconds);
    f[n++] = PD_LOG_STR("client", client[0] ? client : NULL);
    if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK) f[n++] = PD_LOG_STR("termination", termination_name(toe));
    char ns[PD_PREFIX_NS_MAX], prefix[PD_PREFIX_ID_HEX];
    if (r->sreq) {
        /* The API key's namespace: a cache_salt after U+001F stays out of the log. */
        snprintf(ns, sizeof ns, "%.*s", (int)strcspn(r->areq.ns, "\x1f"), r->areq.ns);
        f[n++] = PD_LOG_STR("namespace", ns);
        f[n++] = PD_LOG_STR("stream", r->stream ? "true" : "false");
    }
    if (has_usage) {
        f[n++] = PD_LOG_INT("prompt_tokens", u.prompt_tokens);
        f[n++] = PD_LOG_INT("cached_tokens", u.cached_tokens);
        f[n++] = PD_LOG_INT("completion_tokens", u.completion_tokens);
        f[n++] = PD_LOG_NUM("queue_s", u.queue_seconds);
        if (u.ttft_seconds > 0) f[n++] = PD_LOG_NUM("ttft_s", u.ttft_seconds);
        if (u.prefix_used && u.prefix_kind == PD_PREFIX_REGISTERED) {
            pd_prefix_id_hex(&u.prefix_id, prefix);
            f[n++] = PD_LOG_STR("prefix_id", prefix);
        } else if (u.prefix_used) {
            f[n++] = PD_LOG_STR("prefix_kind", "auto");
        }
    }
    if (r->error[0]) f[n++] = PD_LOG_STR("error", r->error);
    pd_log_fields(s->opts.logger, level, "request", f, n);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    (void)version;
    const listener *li = cls;
    pd_server *s = li->srv;
    http_req *r = *con_cls;
    if (!r) {
        if (!(r = calloc(1, sizeof *r))) return MHD_NO;
        r->srv = s;
        r->conn = c;
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        r->fd = ci ? ci->connect_fd : -1;
        pthread_mutex_init(&r->mu, NULL);
        *con_cls = r;
        begin_access(r, c, url, method, li->admin);
        pthread_mutex_lock(&s->active_mu);
        s->active++;
        pthread_mutex_unlock(&s->active_mu);
        /* A declared body over the limit is refused before a byte of it is
         * read (and before authentication: reading it is the cost). */
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl) {
            char *end;
            errno = 0;
            const unsigned long long n = strtoull(cl, &end, 10);
            if (end != cl && (errno == ERANGE || n > s->opts.limits.max_body_bytes)) return send_too_large(s, c, cl);
        }
        return MHD_YES;
    }
    if (*upload_size) {
        if (r->len + *upload_size > s->opts.limits.max_body_bytes) r->too_large = true;
        else if (!append(&r->body, &r->len, &r->cap, upload, *upload_size)) return MHD_NO;
        *upload_size = 0;
        return MHD_YES;
    }
    /* A body that grew past the limit (no Content-Length, or a false one). */
    if (r->too_large) return send_too_large(s, c, NULL);
    /* Resumed: a generation or admin call under way answers when done. */
    if (r->sreq && !r->stream) return answer_generation(s, c, r);
    if (r->admin_started) return answer_admin(s, c, r);
    /* The admin routes live on the admin listener when there is one, else
     * on the public one; with no admin token they do not exist. */
    bool admin_url = strncmp(url, PD_ADMIN_PREFIX, strlen(PD_ADMIN_PREFIX)) == 0 ||
                     strcmp(url, "/admin") == 0;
    bool admin_here = s->admin_token[0] && (li->admin || !s->admin_mhd);
    if (!li->admin && strcmp(method, MHD_HTTP_METHOD_OPTIONS) == 0 && cors_origins(c)) return answer_preflight(c);
    if (admin_url && admin_here) {
        bool handled;
        const enum MHD_Result ret = route_admin_local(s, c, r, url, method, &handled);
        return handled ? ret : handle_admin(s, c, r, url, method);
    }
    if (li->admin || admin_url) return send_errorf(s, c, 404, PD_API_ERR_NOT_FOUND, NULL, "no such route");
    if (strcmp(method, "GET") == 0) return handle_get(s, c, url);
    if (strcmp(method, "POST") != 0)
        return send_errorf(s, c, 405, PD_API_ERR_INVALID, NULL, "use GET or POST");
    bool chat = strcmp(url, "/v1/chat/completions") == 0, completion = strcmp(url, "/v1/completions") == 0;
    bool tokenize = strcmp(url, "/tokenize") == 0, detokenize = strcmp(url, "/detokenize") == 0;
    if (!chat && !completion && !tokenize && !detokenize)
        return send_errorf(s, c, 404, PD_API_ERR_NOT_FOUND, NULL, "no such route");
    const char *ns = client_namespace(s, c);
    if (!ns)
        return send_errorf(s, c, 401, PD_API_ERR_AUTH, "invalid_api_key",
                           "missing or wrong API key (send Authorization: Bearer KEY)");
    if (tokenize || detokenize) return handle_tokenize(s, c, r, detokenize);
    return handle_generate(s, c, r, chat ? PD_API_CHAT : PD_API_COMPLETION, ns);
}

/* The request is over (sent, failed or the client went away): stop its
 * generation before freeing what the sink writes to. */
static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    (void)cls;
    http_req *r = *con_cls;
    if (!r) return;
    pd_server *s = r->srv;
    unpark(s, r);
    if (r->sreq) pd_sched_request_release(r->sreq);
    end_access(s, r, c, toe);
    pd_api_response_free(r->resp);
    pd_api_request_free(&r->areq);
    pthread_mutex_destroy(&r->mu);
    free(r->q);
    free(r->body);
    free(r->admin_method);
    free(r->admin_url);
    free(r->admin_ns);
    free(r->admin_rep.body);
    free(r);
    *con_cls = NULL;
    pthread_mutex_lock(&s->active_mu);
    if (--s->active == 0) pthread_cond_broadcast(&s->active_cv);
    pthread_mutex_unlock(&s->active_mu);
}

/* ---- lifecycle --------------------------------------------------------------- */

void pd_server_opts_default(pd_server_opts *o) {
    memset(o, 0, sizeof *o);
    o->listen = "127.0.0.1";
    o->port = 8080;
    o->max_connections = 4096;
    o->idle_timeout_s = 15;
    o->metrics = true;
    pd_api_limits_default(&o->limits);
    o->admin_listen = "127.0.0.1";
}

/* The address to bind for `host` (an IPv4 or IPv6 address, or a name:
 * its first address) and port. */
static int resolve_listen(const char *key, const char *host, int port, struct sockaddr_storage *out, pd_error *err) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    char serv[16];
    snprintf(serv, sizeof serv, "%d", port);
    const int g = getaddrinfo(host, serv, &hints, &res);
    if (g != 0 || !res)
        return pd_errorf(err, PD_EINVAL, "%s '%s' is not an address this machine can listen on (%s)", key, host,
                         g ? gai_strerror(g) : "no address");
    memset(out, 0, sizeof *out);
    memcpy(out, res->ai_addr, res->ai_addrlen < sizeof *out ? res->ai_addrlen : sizeof *out);
    freeaddrinfo(res);
    return PD_OK;
}

/* An event-loop thread runs request parsing, tokenization and the JSON
 * answer, never the model: 1 MiB of stack is plenty. */
#define CONNECTION_STACK_BYTES (1u << 20)
/* Headers and query arguments live in a per-connection pool; with MHD's
 * 32 KiB a few hundred arguments exhausted it and the connection closed
 * without an answer. Pages are touched only as used. */
#define CONNECTION_POOL_BYTES (256u << 10)

static int hex_digit(char ch) {
    return ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10 : -1;
}

/* URL decoding for the path and query arguments, except that "%00" stays
 * as it is: decoded, the NUL would end the string early, and
 * "/metrics%00x" would be routed as "/metrics" (past a proxy rule that
 * blocks exactly that path). */
static size_t unescape_keeping_nul(void *cls, struct MHD_Connection *c, char *s) {
    (void)cls, (void)c;
    char *w = s;
    for (const char *p = s; *p;) {
        const int hi = p[0] == '%' ? hex_digit(p[1]) : -1, lo = hi >= 0 ? hex_digit(p[2]) : -1;
        if (lo >= 0 && (hi | lo) != 0) {
            *w++ = (char)(hi * 16 + lo);
            p += 3;
        } else {
            *w++ = *p++;
        }
    }
    *w = '\0';
    return (size_t)(w - s);
}

/* server.threads, where 0 means one per CPU. */
static unsigned event_threads(const pd_server_opts *o) {
    if (o->threads > 0) return (unsigned)o->threads;
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (unsigned)n : 1;
}

/* libmicrohttpd's own messages ("Failed to bind to port ..."), as warnings
 * of the daemon's log. */
static void log_library(void *cls, const char *fmt, va_list ap) {
    const pd_server *s = cls;
    if (!pd_log_enabled(s->opts.logger, PD_LOG_WARN)) return;
    char msg[1024];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n && msg[n - 1] == '\n') msg[--n] = '\0';
    pd_log(s->opts.logger, PD_LOG_WARN, "libmicrohttpd: %s", msg);
}

/* epoll, a fixed pool of event-loop threads, suspend/resume for requests
 * that wait on the engine (see the top of this file). */
static struct MHD_Daemon *start_mhd(const pd_server_opts *o, unsigned threads, struct sockaddr_storage *sa,
                                    listener *li) {
    const unsigned ipv6 = sa->ss_family == AF_INET6 ? MHD_USE_IPv6 : 0;
    return MHD_start_daemon(
        MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG | ipv6,
        /* the port of sa, for libmicrohttpd's own messages ("Failed to bind to port N") */
        ntohs(sa->ss_family == AF_INET6 ? ((struct sockaddr_in6 *)sa)->sin6_port : ((struct sockaddr_in *)sa)->sin_port),
        NULL, NULL, on_request, li, MHD_OPTION_EXTERNAL_LOGGER, log_library, li->srv, /* first, as MHD asks */
        MHD_OPTION_SOCK_ADDR, (struct sockaddr *)sa, MHD_OPTION_NOTIFY_COMPLETED, on_completed,
        li->srv, MHD_OPTION_NOTIFY_CONNECTION, on_connection, li, MHD_OPTION_THREAD_POOL_SIZE, threads, MHD_OPTION_CONNECTION_LIMIT, (unsigned)o->max_connections,
        MHD_OPTION_UNESCAPE_CALLBACK, unescape_keeping_nul, NULL, MHD_OPTION_PER_IP_CONNECTION_LIMIT,
        o->max_connections_per_client, MHD_OPTION_CONNECTION_TIMEOUT,
        (unsigned)(o->idle_timeout_s > 0 ? o->idle_timeout_s : 0), MHD_OPTION_THREAD_STACK_SIZE,
        (size_t)CONNECTION_STACK_BYTES, MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)CONNECTION_POOL_BYTES,
        MHD_OPTION_END);
}

int pd_server_start(const pd_server_opts *o, pd_metrics *metrics, pd_server **out, pd_error *err) {
    *out = NULL;
    if (o->admin_token && strlen(o->admin_token) >= sizeof((pd_server *)0)->admin_token)
        return pd_errorf(err, PD_EINVAL, "admin.token is longer than 255 bytes");
    pd_server *s = calloc(1, sizeof *s);
    if (!s) return pd_errorf(err, PD_ENOMEM, "out of memory for the HTTP server");
    s->opts = *o;
    int krc = pd_api_keys_load(o->api_key, o->api_keys_file, &s->keys, err);
    if (krc) {
        free(s);
        return krc;
    }
    snprintf(s->admin_token, sizeof s->admin_token, "%s", o->admin_token ? o->admin_token : "");
    s->pub = (listener){.srv = s, .admin = false};
    s->adm = (listener){.srv = s, .admin = true};
    s->metrics = metrics;
    pthread_rwlock_init(&s->lock, NULL);
    pthread_mutex_init(&s->mirror_mu, NULL);
    pthread_mutex_init(&s->grammar_mu, NULL);
    pthread_mutex_init(&s->active_mu, NULL);
    cond_init_monotonic(&s->active_cv);
    pthread_mutex_init(&s->park_mu, NULL);
    cond_init_monotonic(&s->park_cv);
    int rc = PD_OK;
    const int wrc = pthread_create(&s->watcher, NULL, watch_parked, s);
    if (wrc) rc = pd_errorf(err, PD_EIO, "cannot start the HTTP server's watcher thread: %s", strerror(wrc));
    s->watcher_started = wrc == 0;
    pthread_cond_init(&s->warm_cv, NULL);
    if (!rc) {
        const int grc = pthread_create(&s->warmer, NULL, warm_grammars, s);
        if (grc) rc = pd_errorf(err, PD_EIO, "cannot start the HTTP server's grammar thread: %s", strerror(grc));
        s->warmer_started = grc == 0;
    }
    if (metrics) {
        /* prefixd_http_requests_total{route,status} and the request
         * durations are registered per route as requests end (count_request). */
        static const double prefill_bounds[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
        rc = pd_metrics_histogram(metrics, "prefixd_prefill_duration_seconds",
                                  "Admission into the batch to the first token: the prefill of the prompt past its "
                                  "cached prefix.", NULL, prefill_bounds, sizeof prefill_bounds / sizeof prefill_bounds[0],
                                  &s->prefill_seconds, err);
        if (!rc)
            rc = pd_metrics_counter(metrics, "prefixd_http_errors_total", "HTTP requests answered with an error.",
                                    NULL, &s->errors, err);
        if (!rc)
            rc = pd_metrics_counter(metrics, "prefixd_http_streams_total", "Streaming responses started.", NULL,
                                    &s->streams, err);
        if (!rc)
            rc = pd_metrics_gauge(metrics, "prefixd_store_bytes", "Bytes of stored compressed prefixes.", NULL,
                                  &s->store_bytes, err);
        if (!rc)
            rc = pd_metrics_gauge(metrics, "prefixd_store_prefixes", "Compressed prefixes in the store.", NULL,
                                  &s->store_prefixes, err);
        if (!rc)
            rc = pd_metrics_gauge(metrics, "prefixd_hot_tier_bytes", "Bytes of prefixes held in the in-memory tier.",
                                  NULL, &s->hot_bytes, err);
    }
    struct sockaddr_storage sa;
    if (!rc) rc = resolve_listen("server.listen", o->listen, o->port, &sa, err);
    if (!rc) {
        s->mhd = start_mhd(o, event_threads(o), &sa, &s->pub);
        if (!s->mhd)
            rc = pd_errorf(err, PD_EIO, "cannot listen on %s:%d (in use, or not allowed?)", o->listen, o->port);
    }
    /* The admin listener exists only when the admin API is enabled. */
    if (!rc && s->admin_token[0] && o->admin_port != 0) {
        const char *al = o->admin_listen && o->admin_listen[0] ? o->admin_listen : "127.0.0.1";
        struct sockaddr_storage asa;
        if (o->admin_port < 0 || o->admin_port > 65535)
            rc = pd_errorf(err, PD_EINVAL, "admin.port %d is out of range (1..65535)", o->admin_port);
        else if ((rc = resolve_listen("admin.listen", al, o->admin_port, &asa, err)))
            ;
        else if (!(s->admin_mhd = start_mhd(o, 1, &asa, &s->adm)))
            rc = pd_errorf(err, PD_EIO, "cannot listen on %s:%d for the admin API (in use, or not allowed?)", al,
                           o->admin_port);
    }
    if (rc) {
        pd_server_stop(s);
        return rc;
    }
    *out = s;
    return PD_OK;
}

void pd_server_set_ready(pd_server *s, const pd_server_backend *b) {
    pthread_rwlock_wrlock(&s->lock);
    s->backend = *b;
    s->ready = true;
    pthread_rwlock_unlock(&s->lock);
}

void pd_server_drain(pd_server *s) {
    pthread_rwlock_wrlock(&s->lock);
    s->ready = false;
    s->draining = true;
    pthread_rwlock_unlock(&s->lock);
}

int pd_server_port(const pd_server *s) {
    const union MHD_DaemonInfo *i = MHD_get_daemon_info(s->mhd, MHD_DAEMON_INFO_BIND_PORT);
    return i ? (int)i->port : -1;
}

int pd_server_admin_port(const pd_server *s) {
    if (!s->admin_mhd) return -1;
    const union MHD_DaemonInfo *i = MHD_get_daemon_info(s->admin_mhd, MHD_DAEMON_INFO_BIND_PORT);
    return i ? (int)i->port : -1;
}

void pd_server_quiesce(pd_server *s) {
    if (s && s->mhd) MHD_quiesce_daemon(s->mhd);
    if (s && s->admin_mhd) MHD_quiesce_daemon(s->admin_mhd);
}

int64_t pd_server_wait_idle(pd_server *s, double seconds) {
    const struct timespec until = monotonic_after_ms((int64_t)(seconds * 1000));
    pthread_mutex_lock(&s->active_mu);
    while (s->active > 0 && pthread_cond_timedwait(&s->active_cv, &s->active_mu, &until) != ETIMEDOUT) {}
    const int64_t left = s->active;
    pthread_mutex_unlock(&s->active_mu);
    return left;
}

/* Before MHD_stop_daemon, which must find no connection suspended: wait
 * for the admin calls (a waiting one sees the drain within a second), stop
 * the watcher, then answer and resume every request still waiting (the
 * scheduler has normally ended them all already). */
static void release_parked(pd_server *s) {
    pthread_mutex_lock(&s->active_mu);
    while (s->admin_running > 0) pthread_cond_wait(&s->active_cv, &s->active_mu);
    pthread_mutex_unlock(&s->active_mu);
    pthread_mutex_lock(&s->park_mu);
    s->watch_stop = true;
    pthread_cond_broadcast(&s->park_cv);
    pthread_mutex_unlock(&s->park_mu);
    if (s->watcher_started) pthread_join(s->watcher, NULL);
    s->watcher_started = false;
    pthread_mutex_lock(&s->park_mu);
    for (http_req *r = s->parked; r; r = r->park_next) {
        pthread_mutex_lock(&r->mu);
        if (!r->done) {
            pd_api_errorf(&r->err, 503, PD_API_ERR_OVERLOADED, NULL, "shutting_down",
                          "the server shut down before the request finished; retry it");
            r->done = r->failed = true;
            if (r->stream) queue_sse_error(r);
        }
        resume_locked(r);
        pthread_mutex_unlock(&r->mu);
    }
    pthread_mutex_unlock(&s->park_mu);
}

void pd_server_stop(pd_server *s) {
    if (!s) return;
    pthread_rwlock_wrlock(&s->lock);
    s->ready = false;
    s->draining = true;
    pthread_rwlock_unlock(&s->lock);
    release_parked(s);
    if (s->admin_mhd) MHD_stop_daemon(s->admin_mhd);
    if (s->mhd) MHD_stop_daemon(s->mhd);
    pthread_rwlock_destroy(&s->lock);
    pthread_mutex_destroy(&s->mirror_mu);
    pthread_mutex_lock(&s->grammar_mu);
    atomic_store(&s->warm_stop, true);
    pthread_cond_broadcast(&s->warm_cv);
    pthread_mutex_unlock(&s->grammar_mu);
    if (s->warmer_started) pthread_join(s->warmer, NULL);
    for (int i = 0; i < s->n_warm; i++) pd_grammar_free(s->warm_queue[i]);
    pthread_cond_destroy(&s->warm_cv);
    for (int i = 0; i < GRAMMAR_CACHE_SLOTS; i++) {
        free(s->grammars[i].text);
        pd_grammar_free(s->grammars[i].g);
    }
    pd_grammar_vocab_free(s->gvocab);
    pthread_mutex_destroy(&s->grammar_mu);
    pthread_mutex_destroy(&s->active_mu);
    pthread_cond_destroy(&s->active_cv);
    pthread_mutex_destroy(&s->park_mu);
    pthread_cond_destroy(&s->park_cv);
    pd_api_keys_free(s->keys);
    free(s);
}
