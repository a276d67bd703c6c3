/* The scheduler: one engine thread running continuous batching.
 *
 * Threads and ownership:
 *   - sched->mu guards the queue, the stopping flag and the stats. The
 *     engine thread never holds it while it runs the model or calls a sink.
 *   - each request's mu (recursive, so a sink may cancel its own request)
 *     is held while its sink runs; release takes it too, which is how
 *     "no event after release returns" is guaranteed.
 *   - a request is referenced by the caller's handle and by the scheduler
 *     (from submit until its last event); the last reference frees it.
 *   - everything else about a running request (sequences, samplers, the
 *     prefix) is touched only by the engine thread once it is queued.
 *   - the automatic block cache belongs to the engine thread: it matches a
 *     request's prompt at admission (where the stored prefix, looked up at
 *     submit, is compared with it) and stores the prompt's blocks when its
 *     first choice finishes the prefill. Only sequences that attend to no
 *     stored prefix are stored, so every cached row is exact.
 *
 * Each loop iteration: drop cancelled requests, admit queued requests while
 * sequences fit in max_batch, prefill at most prefill_chunk prompt tokens
 * (oldest first), then one pd_decode over every sequence that has a token
 * to feed. The sampler of a choice sees exactly the calls a sequential
 * generation would make (accept the prompt, then sample/accept per token),
 * so batching does not change what is sampled. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/daemon.h"

#define SCHED_MAX_CHOICES 16

/* One choice ("n") of a request: its own sequence, sampler and stop state. */
typedef struct sched_choice {
    pd_seq *seq;
    pd_sampler *smp;
    pd_generation *gen;
    pd_grammar_matcher *gm; /* constrained output, else NULL */
    int64_t fed;            /* prompt tokens in the cache, the prefix's included */
    pd_token pending;       /* sampled, fed by the next decode */
    bool decoding;          /* the prompt is done and `pending` is valid */
    bool done;
    double last_token_at;   /* for the inter-token latency histogram */
} sched_choice;

struct pd_sched_request {
    pd_scheduler *sched;
    atomic_int refs;
    atomic_bool cancel;
    pthread_mutex_t mu;     /* held while the sink runs (recursive) */
    bool released;          /* under mu */
    bool terminal;          /* DONE or ERROR delivered; under mu */

    pd_sched_sink sink;
    void *ctx;

    /* copied parameters */
    pd_token *prompt;
    int64_t n_prompt;
    int n_choices;
    pd_cache_mode cache;
    char ns[PD_PREFIX_NS_MAX];
    char *spec;             /* NULL = any */
    bool explicit_prefix;   /* prefix_id was given: no automatic blocks */

    /* the prefix, looked up (cache auto) and acquired at submit, on the
     * caller's thread: loading and verifying a stored prefix never stalls
     * the engine thread and the sequences it is running */
    bool looked_up;
    pd_hot_entry *hot;
    pd_prefix_ref *ref;
    const pd_kv_prefix *prefix;
    int32_t prefix_len;
    /* automatic blocks matched at admission (payloads valid until the next
     * insert, so they are copied into the sequences right away) and the
     * tokens taken from them (the last block's first rows when the prompt
     * ends with it: at most n_prompt - 1) */
    int64_t auto_blocks, auto_tokens;

    sched_choice choices[SCHED_MAX_CHOICES];
    int n_done;
    int n_seqs;             /* batch slots held: choices admitted and not finished */
    double submitted_at;
    bool first_token_seen;
    pd_sched_usage usage;

    pd_sched_request *next; /* queue link */
};

struct pd_scheduler {
    pd_model *model;
    pd_scheduler_opts o;
    int32_t n_ctx, n_vocab;
    uint8_t fingerprint[PD_SHA256_LEN];

    pthread_mutex_t mu;
    pthread_cond_t cv;
    pd_sched_request *qhead, *qtail;
    bool stopping;
    pd_scheduler_stats st;
    pthread_t thread;

    /* engine thread only */
    pd_sched_request **run; /* running requests in admission order [max_batch] */
    int n_run;
    int run_seqs;           /* live sequences */
    float *logits;          /* [max_batch][n_vocab] */
    pd_seq **dseqs;
    pd_token *dtoks;
    sched_choice **dch;
    pd_sched_request **dreq;
    pd_autocache *autoc;    /* NULL without auto_cache_bytes */
    const void **match_blocks; /* [n_ctx / block + 1] payloads of a match */
    pd_autocache_stats auto_published; /* what the counters have seen */

    /* metrics (NULL without opts->metrics) */
    pd_counter *m_completed, *m_failed, *m_cancelled;
    pd_counter *m_prompt_tokens, *m_gen_tokens, *m_cached_tokens;
    pd_counter *m_hits, *m_misses;
    pd_gauge *m_queue, *m_running, *m_kv;
    pd_histogram *m_ttft, *m_tpot, *m_queue_time, *m_mask;
    pd_counter *m_auto_hits, *m_auto_misses, *m_auto_evictions;
    pd_gauge *m_auto_entries, *m_auto_bytes;
    pd_counter *m_disk_reads, *m_disk_rejected, *m_disk_writes, *m_disk_evictions, *m_persist_failures;
    pd_histogram *m_persist_time;
};

/* What every request gets once the device failed: retryable elsewhere. */
#define DEVICE_FAILED_MSG "the server's GPU failed and the server is restarting; retry the request on another instance"

/* New automatic blocks written to the store per transaction when idle: a
 * request that arrives meanwhile waits for at most one such commit. */
#define AUTO_PERSIST_CHUNK_BYTES (4u << 20)

void pd_scheduler_opts_default(pd_scheduler_opts *o) {
    memset(o, 0, sizeof *o);
    o->max_batch = 16;
    o->max_queue = 256;
    o->prefill_chunk = 256;
    o->n_ctx = 0;
}

/* ---- metrics ----------------------------------------------------------- */

/* The automatic cache's series (only when it exists). */
static int register_auto_metrics(pd_scheduler *s, pd_error *err) {
    pd_metrics *m = s->o.metrics;
    int rc = pd_metrics_counter(m, "prefixd_auto_cache_hits_total",
                                "Lookups in the automatic prefix cache that matched at least one block", NULL,
                                &s->m_auto_hits, err);
    if (!rc)
        rc = pd_metrics_counter(m, "prefixd_auto_cache_misses_total",
                                "Lookups in the automatic prefix cache that matched no block", NULL, &s->m_auto_misses,
                                err);
    if (!rc)
        rc = pd_metrics_counter(m, "prefixd_auto_cache_evictions_total",
                                "Blocks evicted from the automatic prefix cache to make room", NULL,
                                &s->m_auto_evictions, err);
    if (!rc)
        rc = pd_metrics_gauge(m, "prefixd_auto_cache_entries", "Blocks in the automatic prefix cache", NULL,
                              &s->m_auto_entries, err);
    if (!rc)
        rc = pd_metrics_gauge(m, "prefixd_auto_cache_bytes",
                              "Bytes the automatic prefix cache holds (blocks and index, bounded by cache.auto_mb)", NULL,
                              &s->m_auto_bytes, err);
    if (!rc && s->o.auto_persist) {
        static const double bounds[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5};
        rc = pd_metrics_counter(m, "prefixd_auto_cache_disk_reads_total",
                                "Automatic blocks read back from the store (verified) on a RAM miss", NULL,
                                &s->m_disk_reads, err);
        if (!rc)
            rc = pd_metrics_counter(m, "prefixd_auto_cache_disk_rejected_total",
                                    "Automatic blocks in the store that failed verification (served as a miss)", NULL,
                                    &s->m_disk_rejected, err);
        if (!rc)
            rc = pd_metrics_counter(m, "prefixd_auto_cache_disk_writes_total", "Automatic blocks written to the store",
                                    NULL, &s->m_disk_writes, err);
        if (!rc)
            rc = pd_metrics_counter(m, "prefixd_auto_cache_disk_evictions_total",
                                    "Automatic blocks deleted from the store beyond cache.auto_mb", NULL,
                                    &s->m_disk_evictions, err);
        if (!rc)
            rc = pd_metrics_counter(m, "prefixd_auto_cache_persist_failures_total",
                                    "Writes of automatic blocks to the store that failed (a full map)", NULL,
                                    &s->m_persist_failures, err);
        if (!rc)
            rc = pd_metrics_histogram(m, "prefixd_auto_cache_persist_seconds",
                                      "One write transaction of automatic blocks (run while the engine is idle)", NULL,
                                      bounds, sizeof bounds / sizeof bounds[0], &s->m_persist_time, err);
    }
    return rc;
}

static int register_metrics(pd_scheduler *s, pd_error *err) {
    pd_metrics *m = s->o.metrics;
    static const double ttft_bounds[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
    static const double tpot_bounds[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1};
    const char *req = "prefixd_requests_total";
    const char *req_help = "Requests the scheduler finished, by outcome";
    int rc = pd_metrics_counter(m, req, req_help, "outcome=\"completed\"", &s->m_completed, err);
    if (!rc) rc = pd_metrics_counter(m, req, req_help, "outcome=\"failed\"", &s->m_failed, err);
    if (!rc) rc = pd_metrics_counter(m, req, req_help, "outcome=\"cancelled\"", &s->m_cancelled, err);
    if (!rc)
        rc = pd_metrics_counter(m, "prefixd_prompt_tokens_total", "Prompt tokens of admitted requests", NULL,
                                &s->m_prompt_tokens, err);
    if (!rc)
        rc = pd_metrics_counter(m, "prefixd_generated_tokens_total", "Tokens generated over all choices", NULL,
                                &s->m_gen_tokens, err);
    if (!rc)
        rc = pd_metrics_counter(m, "prefixd_cached_tokens_total",
                                "Prompt tokens covered by a stored prefix or automatic cache blocks", NULL,
                                &s->m_cached_tokens, err);
    if (!rc)
        rc = pd_metrics_counter(m, "prefixd_prefix_hits_total", "Requests that used a stored prefix", NULL,
                                &s->m_hits, err);
    if (!rc)
        rc = pd_metrics_counter(m, "prefixd_prefix_misses_total",
                                "Requests that looked for a stored prefix and found none usable", NULL, &s->m_misses,
                                err);
    if (!rc)
        rc = pd_metrics_gauge(m, "prefixd_queue_depth", "Requests waiting to start", NULL, &s->m_queue, err);
    if (!rc)
        rc = pd_metrics_gauge(m, "prefixd_running_sequences", "Sequences in the running batch", NULL, &s->m_running,
                              err);
    if (!rc)
        rc = pd_metrics_gauge(m, "prefixd_kv_bytes", "KV cache bytes owned by running sequences (shared prefixes excluded)",
                              NULL, &s->m_kv, err);
    if (!rc)
        rc = pd_metrics_histogram(m, "prefixd_time_to_first_token_seconds", "Submit to first generated token", NULL,
                                  ttft_bounds, sizeof ttft_bounds / sizeof ttft_bounds[0], &s->m_ttft, err);
    if (!rc)
        rc = pd_metrics_histogram(m, "prefixd_time_per_output_token_seconds",
                                  "Time between consecutive tokens of one choice", NULL, tpot_bounds,
                                  sizeof tpot_bounds / sizeof tpot_bounds[0], &s->m_tpot, err);
    if (!rc)
        rc = pd_metrics_histogram(m, "prefixd_queue_time_seconds", "Submit to admission into the batch", NULL,
                                  ttft_bounds, sizeof ttft_bounds / sizeof ttft_bounds[0], &s->m_queue_time, err);
    static const double mask_bounds[] = {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1};
    if (!rc)
        rc = pd_metrics_histogram(m, "prefixd_grammar_mask_seconds",
                                  "Time to mask one token's logits by a grammar (structured output, tool calls)", NULL,
                                  mask_bounds, sizeof mask_bounds / sizeof mask_bounds[0], &s->m_mask, err);
    if (!rc && s->autoc) rc = register_auto_metrics(s, err);
    if (rc) pd_error_prefix(err, "registering the scheduler's metrics");
    return rc;
}

static void m_add(pd_counter *c, double v) {
    if (c) pd_counter_add(c, v);
}

static void m_observe(pd_histogram *h, double v) {
    if (h) pd_histogram_observe(h, v);
}

typedef enum { END_DONE, END_FAILED, END_CANCELLED } end_kind;

/* An outcome, counted once: in the stats and in its Prometheus counter
 * (s->mu held). */
static void count_end_locked(pd_scheduler *s, end_kind kind) {
    if (kind == END_DONE) s->st.completed++;
    else if (kind == END_FAILED) s->st.failed++;
    else s->st.cancelled++;
    m_add(kind == END_DONE ? s->m_completed : kind == END_FAILED ? s->m_failed : s->m_cancelled, 1);
}

/* A stored-prefix lookup's result, the same way (s->mu held). */
static void count_prefix_locked(pd_scheduler *s, bool hit) {
    if (hit) s->st.prefix_hits++;
    else s->st.prefix_misses++;
    m_add(hit ? s->m_hits : s->m_misses, 1);
}

/* Publish the gauges from the stats; call with s->mu held. */
static void publish_gauges_locked(pd_scheduler *s) {
    if (s->m_queue) pd_gauge_set(s->m_queue, (double)s->st.queued);
    if (s->m_running) pd_gauge_set(s->m_running, (double)s->st.running);
    if (s->m_kv) pd_gauge_set(s->m_kv, (double)s->st.kv_bytes);
}

/* The automatic cache's stats into the scheduler's stats and series
 * (engine thread). */
static void publish_auto(pd_scheduler *s) {
    pd_autocache_stats a;
    pd_autocache_stats_get(s->autoc, &a);
    pd_autocache_stats *p = &s->auto_published;
    m_add(s->m_auto_hits, (double)(a.hits - p->hits));
    m_add(s->m_auto_misses, (double)(a.misses - p->misses));
    m_add(s->m_auto_evictions, (double)(a.evictions - p->evictions));
    m_add(s->m_disk_reads, (double)(a.disk_reads - p->disk_reads));
    m_add(s->m_disk_rejected, (double)(a.disk_rejected - p->disk_rejected));
    m_add(s->m_disk_writes, (double)(a.disk_writes - p->disk_writes));
    m_add(s->m_disk_evictions, (double)(a.disk_evictions - p->disk_evictions));
    m_add(s->m_persist_failures, (double)(a.disk_failures - p->disk_failures));
    if (s->m_auto_entries) pd_gauge_set(s->m_auto_entries, (double)a.entries);
    if (s->m_auto_bytes) pd_gauge_set(s->m_auto_bytes, (double)a.bytes);
    *p = a;
    pthread_mutex_lock(&s->mu);
    s->st.auto_hits = a.hits;
    s->st.auto_misses = a.misses;
    s->st.auto_evictions = a.evictions;
    s->st.auto_entries = a.entries;
    s->st.auto_bytes = (int64_t)a.bytes;
    pthread_mutex_unlock(&s->mu);
}

/* Write pending automatic blocks (engine thread, never while a request is
 * running). A failure costs future hits, not a request: a warning. */
static void persist_auto(pd_scheduler *s, uint64_t max_bytes) {
    pd_error err = {0};
    const double t0 = pd_now_seconds();
    int rc = pd_autocache_persist(s->autoc, max_bytes, &err);
    m_observe(s->m_persist_time, pd_now_seconds() - t0);
    if (rc) pd_log(s->o.logger, PD_LOG_WARN, "automatic prefix cache: %s", err.msg);
    publish_auto(s);
}

/* ---- requests ---------------------------------------------------------- */

static void prefix_release(pd_scheduler *s, pd_sched_request *r) {
    if (r->hot) pd_hot_release(s->o.hot, r->hot);
    if (r->ref) pd_prefix_ref_release(r->ref);
    r->hot = NULL;
    r->ref = NULL;
    r->prefix = NULL;
}

/* Free what the engine uses for a request (sequences, samplers, prefix). */
static void request_free_work(pd_scheduler *s, pd_sched_request *r) {
    for (int i = 0; i < r->n_choices; i++) {
        sched_choice *c = &r->choices[i];
        pd_seq_free(c->seq);
        pd_sampler_free(c->smp);
        pd_generation_free(c->gen);
        pd_grammar_matcher_free(c->gm);
        memset(c, 0, sizeof *c);
    }
    prefix_release(s, r);
}

static void request_unref(pd_sched_request *r) {
    if (atomic_fetch_sub(&r->refs, 1) != 1) return;
    pthread_mutex_destroy(&r->mu);
    free(r->prompt);
    free(r->spec);
    free(r);
}

/* Deliver one event unless the caller released the request. */
static void emit(pd_sched_request *r, const pd_sched_event *ev) {
    pthread_mutex_lock(&r->mu);
    if (!r->released && !r->terminal) r->sink(r->ctx, ev);
    if (ev->kind == PD_SCHED_DONE || ev->kind == PD_SCHED_ERROR) r->terminal = true;
    pthread_mutex_unlock(&r->mu);
}

static void emit_error(pd_sched_request *r, int code, const char *msg) {
    pd_sched_event ev = {.kind = PD_SCHED_ERROR, .error_code = code, .error_msg = msg};
    emit(r, &ev);
}

/* The own KV bytes of a request's live sequences (in the model's KV type). */
static int64_t request_kv_bytes(const pd_sched_request *r) {
    uint64_t bytes = 0;
    for (int i = 0; i < r->n_choices; i++)
        if (r->choices[i].seq) bytes += pd_seq_kv_bytes(r->choices[i].seq);
    return (int64_t)bytes;
}

/* ---- prefix resolution ------------------------------------------------- */

/* A stored record that fails its checks (PD_EFORMAT from the store) is the
 * server's fault, not the request's: PD_EIO, with the store's message
 * (which names `prefixctl store verify --repair`). */
static int stored_prefix_error(int rc, pd_error *err) {
    if (rc == PD_EFORMAT) err->code = rc = PD_EIO;
    return rc;
}

/* Acquire a stored prefix by id (through the hot tier when there is one)
 * and check it can continue this request's prompt. */
static int prefix_acquire(pd_scheduler *s, pd_sched_request *r, const pd_prefix_id *id, pd_error *err) {
    const pd_prefix_info *info;
    const pd_token *tokens;
    int rc;
    if (s->o.hot) {
        if ((rc = pd_hot_acquire(s->o.hot, id, &r->hot, err))) return stored_prefix_error(rc, err);
        info = pd_hot_entry_info(r->hot);
        tokens = pd_hot_entry_tokens(r->hot);
        r->prefix = pd_hot_entry_kv(r->hot);
    } else {
        if ((rc = pd_store_get(s->o.store, id, &r->ref, err))) return stored_prefix_error(rc, err);
        info = pd_prefix_ref_info(r->ref);
        tokens = pd_prefix_ref_tokens(r->ref);
        r->prefix = pd_prefix_ref_kv(r->ref);
    }
    char hex[PD_PREFIX_ID_HEX];
    pd_prefix_id_hex(id, hex);
    const pd_hparams *hp = pd_model_hparams(s->model);
    /* Another namespace's prefix is indistinguishable from an unknown id:
     * the same error, before anything about it (length, model) is said. */
    if (strcmp(info->ns, r->ns) != 0)
        rc = pd_errorf(err, PD_ENOTFOUND, "prefix %s is not in the store", hex);
    else if (memcmp(info->fingerprint, s->fingerprint, PD_SHA256_LEN) != 0)
        rc = pd_errorf(err, PD_EINVAL, "prefix %s was stored for another model", hex);
    else if (info->n_layer != hp->n_layer || info->n_head_kv != hp->n_head_kv || info->head_dim != hp->head_dim)
        rc = pd_errorf(err, PD_EINVAL, "prefix %s has another shape than the model", hex);
    else if ((int64_t)info->n_tokens >= r->n_prompt)
        rc = pd_errorf(err, PD_EINVAL,
                       "the prompt (%lld tokens) must extend prefix %s (%d tokens) by at least one token",
                       (long long)r->n_prompt, hex, info->n_tokens);
    else if (memcmp(tokens, r->prompt, sizeof(pd_token) * (size_t)info->n_tokens) != 0)
        rc = pd_errorf(err, PD_EINVAL, "the prompt does not start with the %d tokens of prefix %s", info->n_tokens,
                       hex);
    if (rc) {
        prefix_release(s, r);
        return rc;
    }
    r->prefix_len = info->n_tokens;
    r->usage.prefix_used = true;
    r->usage.prefix_kind = PD_PREFIX_REGISTERED;
    if (s->o.store) pd_store_note_use(s->o.store, id);
    r->usage.prefix_id = *id;
    r->usage.cached_tokens = info->n_tokens;
    r->usage.prefix_kept_rows = info->kept_rows;
    r->usage.prefix_full_rows = (int64_t)info->n_tokens * info->n_layer * info->n_head_kv;
    snprintf(r->usage.prefix_spec, sizeof r->usage.prefix_spec, "%s", info->spec);
    return PD_OK;
}

/* cache=auto: the longest stored prefix strictly shorter than the prompt,
 * whatever its length (compression.min_prefix_tokens is about compressing).
 * Lookup or load failures (a corrupt record) only cost the cache hit. */
static void prefix_lookup(pd_scheduler *s, pd_sched_request *r) {
    pd_prefix_id id;
    int32_t matched = 0;
    pd_error err = {0};
    /* n_prompt - 1: a prefix keeps K/V, not its last token's logits */
    int rc = pd_store_lookup(s->o.store, s->fingerprint, r->ns, r->spec, r->prompt, r->n_prompt - 1, &id, &matched,
                             &err);
    /* A local miss asks the shared tier, which stores what it finds here
     * (so the next request is a local hit); Redis being down is a miss. */
    if (rc == PD_ENOTFOUND && s->o.cluster &&
        pd_cluster_fetch(s->o.cluster, s->fingerprint, r->ns, r->spec, r->prompt, r->n_prompt - 1, &err) == PD_OK)
        rc = pd_store_lookup(s->o.store, s->fingerprint, r->ns, r->spec, r->prompt, r->n_prompt - 1, &id, &matched,
                             &err);
    if (rc != PD_OK) return;
    (void)prefix_acquire(s, r, &id, &err);
}

/* ---- submit ------------------------------------------------------------ */

static int copy_params(pd_scheduler *s, pd_sched_request *r, const pd_sched_params *p, pd_error *err) {
    const pd_tokenizer *tok = pd_model_tokenizer(s->model);
    if (!p->prompt || p->n_prompt < 1)
        return pd_errorf(err, PD_EINVAL, "the prompt is empty: give at least one token");
    if (p->n_prompt > s->n_ctx - 1)
        return pd_errorf(err, PD_ERANGE, "the prompt has %lld tokens; the context holds %d, so at most %d fit",
                         (long long)p->n_prompt, s->n_ctx, s->n_ctx - 1);
    if (p->gen.max_tokens < 1)
        return pd_errorf(err, PD_ERANGE, "max_tokens must be at least 1 (got %d)", p->gen.max_tokens);
    if (p->n_prompt + p->gen.max_tokens > s->n_ctx)
        return pd_errorf(err, PD_ERANGE,
                         "the prompt (%lld tokens) plus max_tokens (%d) exceeds the context of %d tokens",
                         (long long)p->n_prompt, p->gen.max_tokens, s->n_ctx);
    if (p->n_choices < 1 || p->n_choices > SCHED_MAX_CHOICES)
        return pd_errorf(err, PD_ERANGE, "n must be between 1 and %d (got %d)", SCHED_MAX_CHOICES, p->n_choices);
    if (p->n_choices > s->o.max_batch)
        return pd_errorf(err, PD_ERANGE, "n (%d) is larger than the server's batch of %d sequences", p->n_choices,
                         s->o.max_batch);
    for (int64_t i = 0; i < p->n_prompt; i++)
        if (p->prompt[i] < 0 || p->prompt[i] >= s->n_vocab)
            return pd_errorf(err, PD_EINVAL, "prompt token %lld (id %d) is outside the vocabulary of %d tokens",
                             (long long)i, p->prompt[i], s->n_vocab);
    int rc = pd_sampler_params_validate(&p->sampling, s->n_vocab, err);
    if (rc) return rc;
    if (p->cache != PD_CACHE_AUTO && p->cache != PD_CACHE_OFF)
        return pd_errorf(err, PD_EINVAL, "cache must be \"auto\" or \"off\"");
    if (p->has_prefix_id && p->cache == PD_CACHE_OFF)
        return pd_errorf(err, PD_EINVAL, "prefix_id names a stored prefix but cache is \"off\"");
    if (p->ns && strlen(p->ns) >= PD_PREFIX_NS_MAX)
        return pd_errorf(err, PD_EINVAL, "the namespace is longer than %d bytes", PD_PREFIX_NS_MAX - 1);
    if (p->grammar && (!p->grammar_vocab || pd_grammar_vocab_size(p->grammar_vocab) != s->n_vocab))
        return pd_errorf(err, PD_EINVAL, "a grammar needs the model's vocabulary of %d tokens", s->n_vocab);
    if (p->spec && strlen(p->spec) >= PD_PREFIX_SPEC_MAX)
        return pd_errorf(err, PD_EINVAL, "the policy spec is longer than %d bytes", PD_PREFIX_SPEC_MAX - 1);

    r->prompt = malloc(sizeof(pd_token) * (size_t)p->n_prompt);
    if (!r->prompt) return pd_errorf(err, PD_ENOMEM, "out of memory for a prompt of %lld tokens", (long long)p->n_prompt);
    memcpy(r->prompt, p->prompt, sizeof(pd_token) * (size_t)p->n_prompt);
    r->n_prompt = p->n_prompt;
    r->n_choices = p->n_choices;
    r->cache = p->cache;
    snprintf(r->ns, sizeof r->ns, "%s", p->ns ? p->ns : "");
    if (p->spec && !(r->spec = strdup(p->spec))) return pd_errorf(err, PD_ENOMEM, "out of memory");

    /* Samplers and stop state are made now, so bad stop strings fail the
     * submit and the engine thread only allocates KV. */
    for (int i = 0; i < r->n_choices; i++) {
        sched_choice *c = &r->choices[i];
        pd_sampler_params sp = p->sampling;
        if (sp.seed != PD_SAMPLER_SEED_RANDOM) sp.seed += (uint64_t)i;
        if ((rc = pd_sampler_create(&sp, s->n_vocab, &c->smp, err))) return rc;
        if ((rc = pd_sampler_accept_many(c->smp, r->prompt, (size_t)r->n_prompt, false, err))) return rc;
        if ((rc = pd_generation_create(tok, &p->gen, &c->gen, err))) return rc;
        if (p->grammar && (rc = pd_grammar_matcher_create(p->grammar, p->grammar_vocab, &c->gm, err))) return rc;
    }
    return PD_OK;
}

int pd_scheduler_submit(pd_scheduler *s, const pd_sched_params *p, pd_sched_sink sink, void *ctx,
                        pd_sched_request **out, pd_error *err) {
    *out = NULL;
    if (!p || !sink) return pd_errorf(err, PD_EINVAL, "submit needs parameters and a sink");
    pd_sched_request *r = calloc(1, sizeof *r);
    if (!r) return pd_errorf(err, PD_ENOMEM, "out of memory for a request");
    pthread_mutexattr_t ma;
    int rc = PD_OK;
    if (pthread_mutexattr_init(&ma) != 0) {
        free(r);
        return pd_errorf(err, PD_ENOMEM, "cannot create a request lock");
    }
    pthread_mutexattr_settype(&ma, PTHREAD_MUTEX_RECURSIVE);
    if (pthread_mutex_init(&r->mu, &ma) != 0) {
        pthread_mutexattr_destroy(&ma);
        free(r);
        return pd_errorf(err, PD_ENOMEM, "cannot create a request lock");
    }
    pthread_mutexattr_destroy(&ma);
    atomic_init(&r->refs, 2); /* the caller's handle and the scheduler */
    atomic_init(&r->cancel, false);
    r->sched = s;
    r->sink = sink;
    r->ctx = ctx;
    r->submitted_at = pd_now_seconds();

    rc = copy_params(s, r, p, err);
    if (!rc) r->usage.prompt_tokens = r->n_prompt;
    if (!rc && p->has_prefix_id) {
        r->explicit_prefix = true;
        if (!s->o.store) {
            rc = pd_errorf(err, PD_EINVAL, "prefix_id was given but the server has no prefix store");
        } else {
            rc = prefix_acquire(s, r, &p->prefix_id, err);
            pd_error cerr;
            if (rc == PD_ENOTFOUND && s->o.cluster && pd_cluster_fetch_id(s->o.cluster, &p->prefix_id, &cerr) == PD_OK)
                rc = prefix_acquire(s, r, &p->prefix_id, err);
            if (rc == PD_ENOTFOUND) {
                char hex[PD_PREFIX_ID_HEX];
                pd_prefix_id_hex(&p->prefix_id, hex);
                rc = pd_errorf(err, PD_ENOTFOUND, "no stored prefix has id %s", hex);
            }
        }
    } else if (!rc && r->cache == PD_CACHE_AUTO && s->o.store) {
        prefix_lookup(s, r);
        r->looked_up = true;
    }
    if (!rc) {
        pthread_mutex_lock(&s->mu);
        if (s->stopping) {
            rc = pd_errorf(err, PD_EUNAVAILABLE, "the server is shutting down; retry on another instance");
        } else if (s->st.device_failed) {
            rc = pd_errorf(err, PD_EUNAVAILABLE, "%s", DEVICE_FAILED_MSG);
        } else if (s->st.queued >= s->o.max_queue) {
            rc = pd_errorf(err, PD_EBUSY, "queue is full (%d requests waiting); retry later", s->o.max_queue);
        } else {
            if (s->qtail) s->qtail->next = r;
            else s->qhead = r;
            s->qtail = r;
            s->st.queued++;
            publish_gauges_locked(s);
            pthread_cond_signal(&s->cv);
        }
        pthread_mutex_unlock(&s->mu);
    }
    if (rc) {
        request_free_work(s, r);
        atomic_store(&r->refs, 1);
        request_unref(r);
        return rc;
    }
    *out = r;
    return PD_OK;
}

void pd_sched_request_cancel(pd_sched_request *r) {
    /* The engine thread is never idle while a request is unfinished, so a
     * flag it reads every step is enough; the scheduler is not touched, so
     * this is safe even after pd_scheduler_free. */
    if (r) atomic_store(&r->cancel, true);
}

void pd_sched_request_release(pd_sched_request *r) {
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    r->released = true;
    pthread_mutex_unlock(&r->mu);
    pd_sched_request_cancel(r);
    request_unref(r);
}

int32_t pd_scheduler_n_ctx(const pd_scheduler *s) { return s->n_ctx; }

void pd_scheduler_stats_get(pd_scheduler *s, pd_scheduler_stats *out) {
    pthread_mutex_lock(&s->mu);
    *out = s->st;
    pthread_mutex_unlock(&s->mu);
}

/* ---- the engine thread ------------------------------------------------- */


/* Recompute the KV gauge from the live sequences (each step, and when sequences go). */
static void update_kv(pd_scheduler *s) {
    int64_t kv = 0;
    for (int i = 0; i < s->n_run; i++) kv += request_kv_bytes(s->run[i]);
    pthread_mutex_lock(&s->mu);
    s->st.kv_bytes = kv;
    publish_gauges_locked(s);
    pthread_mutex_unlock(&s->mu);
}

/* A running request ends: stats first (so a caller that saw the last event
 * reads stats that include it), the terminal event, then free its work,
 * drop it from the batch and the scheduler's reference. */
static void finish_request(pd_scheduler *s, int idx, end_kind kind, int code, const char *msg) {
    pd_sched_request *r = s->run[idx];
    int64_t seqs = r->n_seqs; /* slots still held */
    r->n_seqs = 0;
    memmove(&s->run[idx], &s->run[idx + 1], sizeof s->run[0] * (size_t)(s->n_run - idx - 1));
    s->n_run--;
    s->run_seqs -= (int)seqs;
    update_kv(s); /* without r, which left the batch */
    pthread_mutex_lock(&s->mu);
    s->st.running -= seqs;
    count_end_locked(s, kind);
    publish_gauges_locked(s);
    pthread_mutex_unlock(&s->mu);
    if (kind == END_DONE) {
        pd_sched_event ev = {.kind = PD_SCHED_DONE, .usage = &r->usage};
        emit(r, &ev);
    } else {
        emit_error(r, code, msg);
    }
    request_free_work(s, r);
    request_unref(r);
}

/* A queued request that never ran (shutdown, cancelled while queued, or
 * failed admission). */
static void end_unadmitted(pd_scheduler *s, pd_sched_request *r, end_kind kind, int code, const char *msg) {
    pthread_mutex_lock(&s->mu);
    count_end_locked(s, kind);
    pthread_mutex_unlock(&s->mu);
    emit_error(r, code, msg);
    request_free_work(s, r);
    request_unref(r);
}

/* cache=auto: the automatic blocks the prompt starts with, at most
 * n_prompt - 1 tokens (the last prompt token is always fed, for its
 * logits; a prompt that ends with a cached block takes that block's rows
 * but the last, since a block's first rows are its first positions' KV).
 * They replace the stored prefix looked up at submit only where they
 * cover more of the prompt. */
static void auto_match(pd_scheduler *s, pd_sched_request *r) {
    const int64_t max_blocks = r->n_prompt / PD_AUTO_BLOCK_TOKENS;
    if (!s->autoc || r->cache != PD_CACHE_AUTO || r->explicit_prefix || max_blocks < 1) return;
    int64_t k = pd_autocache_match(s->autoc, r->ns, r->prompt, max_blocks, s->match_blocks);
    publish_auto(s);
    int64_t covered = k * PD_AUTO_BLOCK_TOKENS;
    if (covered > r->n_prompt - 1) covered = r->n_prompt - 1;
    if (covered <= r->prefix_len) return;
    if (r->prefix) {
        prefix_release(s, r);
        r->prefix_len = 0;
    }
    const pd_hparams *hp = pd_model_hparams(s->model);
    r->auto_blocks = k;
    r->auto_tokens = covered;
    r->usage.prefix_used = true;
    r->usage.prefix_kind = PD_PREFIX_AUTO;
    memset(&r->usage.prefix_id, 0, sizeof r->usage.prefix_id);
    r->usage.cached_tokens = covered;
    r->usage.prefix_full_rows = r->usage.cached_tokens * hp->n_layer * hp->n_head_kv;
    r->usage.prefix_kept_rows = r->usage.prefix_full_rows;
    r->usage.prefix_spec[0] = '\0';
}

typedef struct auto_fill_ctx {
    const pd_seq *seq;
} auto_fill_ctx;

static int auto_fill(void *vctx, int64_t block, void *payload, pd_error *err) {
    const auto_fill_ctx *ctx = vctx;
    return pd_seq_export_kv(ctx->seq, (int32_t)(block * PD_AUTO_BLOCK_TOKENS), PD_AUTO_BLOCK_TOKENS, payload, err);
}

/* A prompt's prefill is done on a sequence that attends to no stored
 * prefix: keep its whole blocks. A failure only costs future hits. */
static void auto_store(pd_scheduler *s, pd_sched_request *r, const pd_seq *seq) {
    if (!s->autoc || r->prefix) return;
    auto_fill_ctx ctx = {.seq = seq};
    pd_error err = {0};
    (void)pd_autocache_insert(s->autoc, r->ns, r->prompt, r->n_prompt / PD_AUTO_BLOCK_TOKENS, auto_fill, &ctx, &err);
    publish_auto(s);
}

/* Admission on the engine thread: prefix, sequences, STARTED. */
static int admit(pd_scheduler *s, pd_sched_request *r, pd_error *err) {
    int rc;
    auto_match(s, r);
    if (r->looked_up || r->explicit_prefix) { /* a lookup, or an explicit prefix_id (a hit) */
        pthread_mutex_lock(&s->mu);
        count_prefix_locked(s, r->prefix != NULL);
        pthread_mutex_unlock(&s->mu);
    }
    r->usage.prompt_tokens = r->n_prompt;
    for (int i = 0; i < r->n_choices; i++) {
        sched_choice *c = &r->choices[i];
        if ((rc = pd_seq_create(s->model, s->n_ctx, &c->seq, err))) return rc;
        if (r->prefix && (rc = pd_seq_attach_prefix(c->seq, r->prefix, err))) return rc;
        /* the prompt's rows in one allocation per stream, not by doubling
         * as the blocks arrive */
        if (r->auto_blocks && (rc = pd_seq_reserve(c->seq, (int32_t)r->n_prompt, err))) return rc;
        for (int64_t b = 0; b < r->auto_blocks; b++) {
            const int64_t left = r->auto_tokens - b * PD_AUTO_BLOCK_TOKENS;
            const int32_t take = (int32_t)(left < PD_AUTO_BLOCK_TOKENS ? left : PD_AUTO_BLOCK_TOKENS);
            if ((rc = pd_seq_import_kv(c->seq, s->match_blocks[b], PD_AUTO_BLOCK_TOKENS, take, err))) return rc;
        }
        c->fed = r->prefix ? r->prefix_len : r->auto_tokens;
    }
    double now = pd_now_seconds();
    r->usage.queue_seconds = now - r->submitted_at;
    m_observe(s->m_queue_time, r->usage.queue_seconds);
    m_add(s->m_prompt_tokens, (double)r->n_prompt);
    m_add(s->m_cached_tokens, (double)r->usage.cached_tokens);
    pd_sched_event ev = {.kind = PD_SCHED_STARTED, .usage = &r->usage};
    emit(r, &ev);
    return PD_OK;
}

/* Sample the next token of a choice from its logits and emit it. Returns a
 * failure of the request (sampling errors), not of the batch. */
static int take_token(pd_scheduler *s, pd_sched_request *r, int ci, float *logits, pd_error *err) {
    sched_choice *c = &r->choices[ci];
    pd_sample_result res;
    pd_generation_step step;
    int rc = PD_OK;
    if (c->gm) {
        /* the logits are this step's scratch: masking them in place is
         * what makes sampling and logprobs see the constrained distribution */
        const int32_t budget = pd_generation_tokens_left(c->gen);
        const double t0 = pd_now_seconds();
        rc = pd_grammar_matcher_mask(c->gm, logits, budget, err);
        m_observe(s->m_mask, pd_now_seconds() - t0);
    }
    if (!rc) rc = pd_sampler_sample(c->smp, logits, &res, err);
    if (!rc && c->gm && !pd_tokenizer_is_eog(pd_model_tokenizer(s->model), res.token))
        rc = pd_grammar_matcher_accept(c->gm, res.token, err);
    if (!rc) rc = pd_sampler_accept(c->smp, res.token, true, err);
    if (!rc) rc = pd_generation_push(c->gen, res.token, &step, err);
    if (rc) return rc;
    double now = pd_now_seconds();
    if (!r->first_token_seen) {
        r->first_token_seen = true;
        r->usage.ttft_seconds = now - r->submitted_at;
        m_observe(s->m_ttft, r->usage.ttft_seconds);
    } else if (c->last_token_at > 0) {
        m_observe(s->m_tpot, now - c->last_token_at);
    }
    c->last_token_at = now;
    r->usage.completion_tokens++;
    m_add(s->m_gen_tokens, 1);
    pd_sched_event ev = {.kind = PD_SCHED_TOKEN, .choice = ci, .text = step.text, .len = step.len, .sample = &res};
    emit(r, &ev);
    if (step.finish == PD_FINISH_NONE && pd_seq_pos(c->seq) >= s->n_ctx)
        /* Unreachable with the submit checks; kept so a full context can
         * never reach pd_decode. */
        return pd_errorf(err, PD_ERANGE, "the context of %d tokens is full", s->n_ctx);
    if (step.finish != PD_FINISH_NONE) {
        c->done = true;
        c->decoding = false;
        r->n_done++;
        pd_sched_event done = {.kind = PD_SCHED_CHOICE_DONE, .choice = ci, .finish = step.finish};
        emit(r, &done);
        /* free the sequence now: its slot is usable at the next admission */
        pd_seq_free(c->seq);
        c->seq = NULL;
        r->n_seqs--;
        s->run_seqs--;
        pthread_mutex_lock(&s->mu);
        s->st.running--;
        pthread_mutex_unlock(&s->mu);
        update_kv(s);
    } else {
        c->pending = res.token;
        c->decoding = true;
    }
    return PD_OK;
}

/* DONE for requests whose choices all finished. */
static void complete_finished(pd_scheduler *s) {
    for (int i = 0; i < s->n_run;) {
        pd_sched_request *r = s->run[i];
        if (r->n_done == r->n_choices) {
            finish_request(s, i, END_DONE, 0, NULL);
        } else {
            i++;
        }
    }
}

/* A sticky device error (PD_EDEVICE): the model can compute nothing more in
 * this process. Log it once (its message names the fix), fail every running
 * and queued request with PD_EUNAVAILABLE, refuse new ones (submit checks
 * device_failed), and tell the owner, which restarts the process. */
static void device_failed(pd_scheduler *s, const pd_error *err) {
    pthread_mutex_lock(&s->mu);
    const int64_t queued = s->st.queued;
    s->st.device_failed = true;
    pd_sched_request *q = s->qhead;
    s->qhead = s->qtail = NULL;
    s->st.queued = 0;
    publish_gauges_locked(s);
    pthread_mutex_unlock(&s->mu);
    pd_log(s->o.logger, PD_LOG_ERROR, "%s (failing %d running and %lld queued requests with 503; no new one starts)",
           err->msg, s->n_run, (long long)queued);
    while (s->n_run > 0) finish_request(s, s->n_run - 1, END_FAILED, PD_EUNAVAILABLE, DEVICE_FAILED_MSG);
    while (q) {
        pd_sched_request *nx = q->next;
        end_unadmitted(s, q, END_FAILED, PD_EUNAVAILABLE, DEVICE_FAILED_MSG);
        q = nx;
    }
    if (s->o.on_device_failure) s->o.on_device_failure(s->o.on_device_failure_ctx);
}

static void fail_request_err(pd_scheduler *s, pd_sched_request *r, const pd_error *err) {
    for (int i = 0; i < s->n_run; i++)
        if (s->run[i] == r) {
            finish_request(s, i, END_FAILED, err->code ? err->code : PD_EINVAL, err->msg);
            return;
        }
}

/* One step: a chunk of prefill, then one decode over the batch. */
static void step(pd_scheduler *s) {
    pd_error err = {0};
    const int32_t V = s->n_vocab;

    /* (1) prefill, oldest requests first, at most prefill_chunk tokens */
    int64_t budget = s->o.prefill_chunk;
    for (int i = 0; i < s->n_run && budget > 0; i++) {
        pd_sched_request *r = s->run[i];
        bool failed = false;
        for (int ci = 0; ci < r->n_choices && budget > 0 && !failed; ci++) {
            sched_choice *c = &r->choices[ci];
            if (c->done || c->decoding) continue;
            int64_t take = r->n_prompt - c->fed;
            if (take > budget) take = budget;
            int rc = pd_prefill(s->model, c->seq, r->prompt + c->fed, take, NULL, s->logits, &err);
            if (!rc) {
                c->fed += take;
                budget -= take;
                if (c->fed == r->n_prompt) {
                    if (ci == 0) auto_store(s, r, c->seq); /* before sampling may free the sequence */
                    rc = take_token(s, r, ci, s->logits, &err);
                }
            }
            if (rc) failed = true;
        }
        if (failed && err.code == PD_EDEVICE) { /* the device, not this request */
            device_failed(s, &err);
            return;
        }
        if (failed) {
            fail_request_err(s, r, &err);
            i--;
        }
    }
    complete_finished(s);

    /* (2) decode every sequence that has a token to feed */
    int n = 0;
    for (int i = 0; i < s->n_run; i++) {
        pd_sched_request *r = s->run[i];
        for (int ci = 0; ci < r->n_choices; ci++) {
            sched_choice *c = &r->choices[ci];
            if (!c->decoding || c->done) continue;
            s->dseqs[n] = c->seq;
            s->dtoks[n] = c->pending;
            s->dch[n] = c;
            s->dreq[n] = r;
            n++;
        }
    }
    if (n > 0) {
        pd_error derr = {0};
        const int drc = pd_decode(s->model, s->dseqs, s->dtoks, n, s->logits, &derr);
        if (drc == PD_EDEVICE) {
            device_failed(s, &derr);
            return;
        } else if (drc != PD_OK) {
            /* a batch failure (memory): every request in it fails */
            for (int j = 0; j < n; j++) {
                if (j > 0 && s->dreq[j] == s->dreq[j - 1]) continue;
                fail_request_err(s, s->dreq[j], &derr);
            }
        } else {
            for (int j = 0; j < n; j++) {
                pd_sched_request *r = s->dreq[j];
                bool alive = false;
                for (int i = 0; i < s->n_run; i++) alive |= s->run[i] == r;
                if (!alive) continue; /* failed on an earlier choice */
                int ci = (int)(s->dch[j] - r->choices);
                pd_error terr = {0};
                if (take_token(s, r, ci, s->logits + (size_t)j * (size_t)V, &terr)) fail_request_err(s, r, &terr);
            }
        }
        complete_finished(s);
    }
    update_kv(s);
}

/* Requests cancelled while running end now, freeing their slots. */
static void drop_cancelled(pd_scheduler *s) {
    for (int i = 0; i < s->n_run;) {
        if (atomic_load(&s->run[i]->cancel)) finish_request(s, i, END_CANCELLED, PD_EINVAL, "cancelled");
        else i++;
    }
}

static void *engine_main(void *arg) {
    pd_scheduler *s = arg;
    for (;;) {
        pd_sched_request *cancelled = NULL, **ctail = &cancelled;
        pd_sched_request *admitted = NULL, **atail = &admitted;
        pthread_mutex_lock(&s->mu);
        while (!s->stopping && !s->qhead && s->n_run == 0) {
            if (s->autoc && pd_autocache_persist_pending(s->autoc)) { /* idle: write what is pending */
                pthread_mutex_unlock(&s->mu);
                persist_auto(s, AUTO_PERSIST_CHUNK_BYTES);
                pthread_mutex_lock(&s->mu);
                continue;
            }
            if (s->o.store && pd_store_uses_pending(s->o.store)) { /* idle: write prefix hits and last uses */
                pthread_mutex_unlock(&s->mu);
                pd_error err = {0};
                if (pd_store_flush_uses(s->o.store, &err))
                    pd_log(s->o.logger, PD_LOG_WARN, "recording prefix uses: %s", err.msg);
                pthread_mutex_lock(&s->mu);
                continue;
            }
            pthread_cond_wait(&s->cv, &s->mu);
        }
        if (s->stopping) {
            pd_sched_request *q = s->qhead;
            s->qhead = s->qtail = NULL;
            s->st.queued = 0;
            publish_gauges_locked(s);
            pthread_mutex_unlock(&s->mu);
            while (s->n_run > 0) finish_request(s, s->n_run - 1, END_FAILED, PD_EUNAVAILABLE,
                                                  "the server shut down before the request finished; retry it");
            while (q) {
                pd_sched_request *nx = q->next;
                end_unadmitted(s, q, END_FAILED, PD_EUNAVAILABLE, "the server shut down before the request started; retry it");
                q = nx;
            }
            if (s->autoc && pd_autocache_persist_pending(s->autoc)) persist_auto(s, UINT64_MAX);
            return NULL;
        }
        /* take cancelled requests out of the whole queue */
        pd_sched_request **pp = &s->qhead, *last = NULL;
        while (*pp) {
            pd_sched_request *r = *pp;
            if (atomic_load(&r->cancel)) {
                *pp = r->next;
                r->next = NULL;
                s->st.queued--;
                *ctail = r;
                ctail = &r->next;
            } else {
                last = r;
                pp = &r->next;
            }
        }
        s->qtail = last;
        /* admit in order while the sequences fit (FIFO: no overtaking) */
        int reserved = s->run_seqs;
        while (s->qhead && reserved + s->qhead->n_choices <= s->o.max_batch) {
            pd_sched_request *r = s->qhead;
            s->qhead = r->next;
            r->next = NULL;
            s->st.queued--;
            reserved += r->n_choices;
            s->st.running += r->n_choices;
            *atail = r;
            atail = &r->next;
        }
        if (!s->qhead) s->qtail = NULL;
        publish_gauges_locked(s);
        pthread_mutex_unlock(&s->mu);

        while (cancelled) {
            pd_sched_request *nx = cancelled->next;
            end_unadmitted(s, cancelled, END_CANCELLED, PD_EINVAL, "cancelled");
            cancelled = nx;
        }
        while (admitted) {
            pd_sched_request *r = admitted, *nx = r->next;
            r->next = NULL;
            s->run[s->n_run++] = r;
            s->run_seqs += r->n_choices;
            r->n_seqs = r->n_choices;
            pd_error err = {0};
            if (s->st.device_failed) { /* only this thread writes it: no lock to read it */
                finish_request(s, s->n_run - 1, END_FAILED, PD_EUNAVAILABLE, DEVICE_FAILED_MSG);
            } else if (admit(s, r, &err) != PD_OK) {
                if (err.code == PD_EDEVICE) device_failed(s, &err);
                else finish_request(s, s->n_run - 1, END_FAILED, err.code, err.msg);
            }
            admitted = nx;
        }
        drop_cancelled(s);
        if (s->n_run > 0) step(s);
    }
}

/* ---- create / free ----------------------------------------------------- */

static void sched_destroy(pd_scheduler *s) {
    pd_autocache_free(s->autoc);
    free(s->match_blocks);
    free(s->run);
    free(s->logits);
    free(s->dseqs);
    free(s->dtoks);
    free(s->dch);
    free(s->dreq);
    free(s);
}

int pd_scheduler_create(pd_model *m, const pd_scheduler_opts *o, pd_scheduler **out, pd_error *err) {
    *out = NULL;
    if (!m || !o) return pd_errorf(err, PD_EINVAL, "the scheduler needs a model and options");
    const pd_hparams *hp = pd_model_hparams(m);
    if (o->max_batch < 1 || o->max_batch > 4096)
        return pd_errorf(err, PD_ERANGE, "max_batch must be between 1 and 4096 (got %d)", o->max_batch);
    /* every request waits in the queue, however briefly */
    if (o->max_queue < 1) return pd_errorf(err, PD_ERANGE, "max_queue must be at least 1 (got %d)", o->max_queue);
    if (o->prefill_chunk < 1)
        return pd_errorf(err, PD_ERANGE, "prefill_chunk must be at least 1 (got %d)", o->prefill_chunk);
    if (o->n_ctx < 0 || o->n_ctx > hp->n_ctx_train)
        return pd_errorf(err, PD_ERANGE, "n_ctx must be between 0 (the model's) and %d (got %d)", hp->n_ctx_train,
                         o->n_ctx);
    if (o->hot && !o->store) return pd_errorf(err, PD_EINVAL, "a hot tier needs the store it caches");
    if (o->auto_persist && (!o->store || !o->auto_cache_bytes))
        return pd_errorf(err, PD_EINVAL, "persisting the automatic cache needs a store and auto_cache_bytes above 0");

    pd_scheduler *s = calloc(1, sizeof *s);
    if (!s) return pd_errorf(err, PD_ENOMEM, "out of memory for the scheduler");
    s->model = m;
    s->o = *o;
    s->n_ctx = o->n_ctx ? o->n_ctx : hp->n_ctx_train;
    s->n_vocab = hp->n_vocab;
    pd_model_fingerprint(m, s->fingerprint);
    size_t B = (size_t)o->max_batch;
    uint64_t logit_bytes;
    if (!pd_mul_ok((uint64_t)B * sizeof(float), (uint64_t)hp->n_vocab, &logit_bytes) || logit_bytes > SIZE_MAX) {
        free(s);
        return pd_errorf(err, PD_ERANGE, "max_batch %d x vocabulary %d logits do not fit in memory", o->max_batch,
                         hp->n_vocab);
    }
    s->run = calloc(B, sizeof *s->run);
    s->logits = malloc((size_t)logit_bytes);
    s->dseqs = calloc(B, sizeof *s->dseqs);
    s->dtoks = calloc(B, sizeof *s->dtoks);
    s->dch = calloc(B, sizeof *s->dch);
    s->dreq = calloc(B, sizeof *s->dreq);
    if (!s->run || !s->logits || !s->dseqs || !s->dtoks || !s->dch || !s->dreq) {
        sched_destroy(s);
        return pd_errorf(err, PD_ENOMEM, "out of memory for a batch of %d sequences", o->max_batch);
    }
    int rc;
    if (o->auto_cache_bytes > 0) {
        if ((rc = pd_autocache_create(o->auto_cache_bytes, pd_model_kv_token_bytes(m) * PD_AUTO_BLOCK_TOKENS,
                                      s->fingerprint, (int)pd_model_kv_type(m), &s->autoc, err))) {
            sched_destroy(s);
            return rc;
        }
        if (!(s->match_blocks = calloc((size_t)(s->n_ctx / PD_AUTO_BLOCK_TOKENS + 1), sizeof *s->match_blocks))) {
            sched_destroy(s);
            return pd_errorf(err, PD_ENOMEM, "out of memory for the automatic cache's match");
        }
        if (o->auto_persist && (rc = pd_autocache_attach_store(s->autoc, o->store, o->auto_cache_bytes, err))) {
            sched_destroy(s);
            return rc;
        }
    }
    if (o->metrics && (rc = register_metrics(s, err))) {
        sched_destroy(s);
        return rc;
    }
    /* On a device: a KV slab per batch slot and scratch grown by a warm-up
     * step, so serving allocates nothing from the driver (a no-op on the CPU). */
    if ((rc = pd_model_reserve_kv(m, o->max_batch, s->n_ctx, o->prefill_chunk, err))) {
        sched_destroy(s);
        return rc;
    }
    if (pthread_mutex_init(&s->mu, NULL) != 0) {
        sched_destroy(s);
        return pd_errorf(err, PD_ENOMEM, "cannot create the scheduler lock");
    }
    if (pthread_cond_init(&s->cv, NULL) != 0) {
        pthread_mutex_destroy(&s->mu);
        sched_destroy(s);
        return pd_errorf(err, PD_ENOMEM, "cannot create the scheduler condition variable");
    }
    if ((rc = pthread_create(&s->thread, NULL, engine_main, s)) != 0) {
        pthread_cond_destroy(&s->cv);
        pthread_mutex_destroy(&s->mu);
        sched_destroy(s);
        return pd_errorf(err, PD_EIO, "cannot start the engine thread: %s", strerror(rc));
    }
    *out = s;
    return PD_OK;
}

void pd_scheduler_free(pd_scheduler *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->stopping = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    sched_destroy(s);
}
