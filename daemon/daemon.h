/* daemon: the serving core under the HTTP layer — the scheduler (one engine
 * thread running continuous batching over stored compressed prefixes) and
 * the metrics registry. main.c composes them with api/ and the store.
 *
 * The stack: api -> daemon -> { policies, cache } -> engine -> kernels.
 * This header is the folder's public contract. */
#ifndef PD_DAEMON_H
#define PD_DAEMON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "cache/cache.h"
#include "cluster/cluster.h"
#include "engine/engine.h"
#include "grammar/grammar.h"
#include "policies/policies.h"
#include "util/util.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------
 * Metrics registry (Prometheus text exposition format 0.0.4)
 *
 * Registration is thread-safe (a lock; cheap enough per request, but keep
 * the handle where the series is fixed); updates are thread-safe and
 * lock-free. Label values are given at registration of a series.
 * ------------------------------------------------------------------------ */

typedef struct pd_metrics pd_metrics;
typedef struct pd_counter pd_counter;
typedef struct pd_gauge pd_gauge;
typedef struct pd_histogram pd_histogram;

int pd_metrics_create(pd_metrics **out, pd_error *err);
void pd_metrics_free(pd_metrics *m);

/* name: [a-zA-Z_:][a-zA-Z0-9_:]*; help: one line. labels: NULL or
 * "key=\"value\",key2=\"value2\"" exactly as it appears between braces
 * (checked). Registering the same name + labels twice returns the same
 * series; the same name with another type or help is PD_EINVAL. */
int pd_metrics_counter(pd_metrics *m, const char *name, const char *help, const char *labels, pd_counter **out,
                       pd_error *err);
int pd_metrics_gauge(pd_metrics *m, const char *name, const char *help, const char *labels, pd_gauge **out,
                     pd_error *err);
/* bounds: n strictly increasing finite upper bounds (the +Inf bucket is implicit). */
int pd_metrics_histogram(pd_metrics *m, const char *name, const char *help, const char *labels,
                         const double *bounds, size_t n, pd_histogram **out, pd_error *err);

void pd_counter_add(pd_counter *c, double v); /* v >= 0 */
void pd_gauge_set(pd_gauge *g, double v);
void pd_gauge_add(pd_gauge *g, double v);     /* may be negative */
void pd_histogram_observe(pd_histogram *h, double v);
double pd_counter_value(const pd_counter *c);
double pd_gauge_value(const pd_gauge *g);

/* Register the process_* series (CPU seconds, resident and virtual memory,
 * open and maximum fds, start time), read from /proc at every render. */
int pd_metrics_process(pd_metrics *m, pd_error *err);

/* The whole registry in text format: families in registration order, each
 * with # HELP and # TYPE, histogram _bucket{le=...} (cumulative), _sum,
 * _count. Returns a malloc'd NUL-terminated string. */
int pd_metrics_render(pd_metrics *m, char **out, size_t *len, pd_error *err);

/* ------------------------------------------------------------------------
 * Scheduler
 *
 * One engine thread owns the model. Requests are queued by any thread; the
 * engine thread admits them into the running batch between decode steps
 * (continuous batching), prefills their prompts in chunks of at most
 * `prefill_chunk` tokens per step so running sequences keep decoding, and
 * decodes every running sequence together with pd_decode. A request whose
 * prompt starts with a stored prefix attends to it read-only (shared by
 * every request that uses it, through the hot tier) and prefills only the
 * rest. With an automatic cache (auto_cache_bytes), every prompt's exact KV
 * is kept after its request in token blocks (pd_autocache, owned by the
 * engine thread) and a later prompt starting with the same blocks copies
 * them into its sequence instead of prefilling them; the longer of the two
 * matches is used, a stored prefix on a tie. Events reach the caller's sink
 * on the engine thread, in order.
 * ------------------------------------------------------------------------ */

typedef struct pd_scheduler pd_scheduler;
typedef struct pd_sched_request pd_sched_request;

typedef struct pd_scheduler_opts {
    int max_batch;           /* sequences decoded together (default 16) */
    int max_queue;           /* requests waiting to start (>= 1); more is PD_ERANGE "queue is full" (default 256) */
    int32_t prefill_chunk;   /* prompt tokens prefilled per step (default 256) */
    int32_t n_ctx;           /* per-sequence context; 0 = the model's trained context */
    uint64_t auto_cache_bytes; /* RAM for exact KV of recent prompts (pd_autocache); 0 = none (default) */
    /* also keep the automatic blocks in `store` (up to auto_cache_bytes of
     * them): written when the engine is idle and at shutdown, read back on
     * a RAM miss (pd_autocache_attach_store) */
    bool auto_persist;
    const pd_logger *logger; /* optional: warnings (a failed write of automatic blocks) */
    pd_store *store;         /* optional: stored prefixes to look up (not owned) */
    pd_hot *hot;             /* optional: hot tier over `store` (not owned) */
    /* optional: the shared tier (not owned). A prompt that no stored prefix
     * starts with, or a prefix_id the store lacks, is looked up there and
     * fetched into `store` before the request is queued. */
    pd_cluster *cluster;
    pd_metrics *metrics;     /* optional: the scheduler registers and updates its series */
    /* optional: called once, on the engine thread, when the model's device
     * fails for good (PD_EDEVICE, a sticky CUDA error). By then the error is
     * logged, every running and queued request has failed with
     * PD_EUNAVAILABLE and submits are refused the same way: the owner's part
     * is to end the process so that the service manager restarts it. */
    void (*on_device_failure)(void *ctx);
    void *on_device_failure_ctx;
} pd_scheduler_opts;

void pd_scheduler_opts_default(pd_scheduler_opts *o);

/* Starts the engine thread. The model must outlive the scheduler and is used
 * only by that thread from now on. */
int pd_scheduler_create(pd_model *m, const pd_scheduler_opts *o, pd_scheduler **out, pd_error *err);
/* The context length its sequences get (opts n_ctx, or the model's). */
int32_t pd_scheduler_n_ctx(const pd_scheduler *s);
/* Cancels what is queued or running (their sinks get PD_SCHED_ERROR,
 * PD_EIO, "shutting down" unless already done), joins the thread. Submits
 * racing with it are refused (PD_EINVAL, "the scheduler is shutting
 * down"); handles may still be released afterwards. */
void pd_scheduler_free(pd_scheduler *s);

typedef enum pd_cache_mode {
    PD_CACHE_AUTO = 0, /* use the longest stored prefix or cached blocks the prompt starts with */
    PD_CACHE_OFF,      /* never use a stored prefix or cached blocks (the prompt's blocks are still cached) */
} pd_cache_mode;

/* What a request asks for. Everything is copied by pd_scheduler_submit. */
typedef struct pd_sched_params {
    const pd_token *prompt;      /* BOS included as the caller wants it */
    int64_t n_prompt;            /* >= 1 */
    int n_choices;               /* 1..16 and <= max_batch ("n"); choice i samples with seed + i (a random
                                    seed stays random); n choices prefill the prompt separately */
    pd_sampler_params sampling;  /* logit_bias array copied */
    pd_generation_params gen;    /* stop strings copied */
    pd_cache_mode cache;
    bool has_prefix_id;          /* use exactly this stored prefix (error if the prompt does not start with its
                                    tokens or is not longer; contradicts cache OFF); no automatic blocks then */
    pd_prefix_id prefix_id;
    const char *ns;              /* namespace for lookup ("" or NULL = none) */
    const char *spec;            /* only prefixes compressed with this spec (NULL = any, newest first) */
    /* Constrained output: every choice samples only tokens the grammar
     * allows, with its remaining max_tokens as the matcher's budget (so a
     * grammar's text always completes when max_tokens leaves room for it).
     * The scheduler holds a reference to the grammar until the request is
     * freed; the vocabulary must outlive the scheduler. NULL = none. */
    const pd_grammar *grammar;
    const pd_grammar_vocab *grammar_vocab;
} pd_sched_params;

typedef enum pd_sched_event_kind {
    PD_SCHED_STARTED = 0, /* admitted; prefix (if any) resolved; once per request, first */
    PD_SCHED_TOKEN,       /* one sampled token of one choice (text may be empty: held back by stop matching) */
    PD_SCHED_CHOICE_DONE, /* one choice finished (finish reason) */
    PD_SCHED_DONE,        /* every choice finished; the last event; usage filled */
    PD_SCHED_ERROR,       /* the request failed or was cancelled; the last event */
} pd_sched_event_kind;

typedef enum pd_prefix_kind {
    PD_PREFIX_REGISTERED = 0, /* a stored (registered, maybe compressed) prefix */
    PD_PREFIX_AUTO,           /* exact blocks of the automatic cache */
} pd_prefix_kind;

typedef struct pd_sched_usage {
    int64_t prompt_tokens;
    int64_t completion_tokens;   /* over all choices */
    int64_t cached_tokens;       /* prompt tokens covered by a prefix of either kind (its original length) */
    bool prefix_used;
    pd_prefix_kind prefix_kind;  /* with prefix_used */
    pd_prefix_id prefix_id;      /* PD_PREFIX_REGISTERED only; the spec too */
    int64_t prefix_kept_rows;    /* kept (layer, head, token) rows of that prefix */
    int64_t prefix_full_rows;    /* n_orig * n_layer * n_head_kv */
    char prefix_spec[PD_PREFIX_SPEC_MAX];
    double queue_seconds;        /* submit -> admitted */
    double ttft_seconds;         /* submit -> first token of any choice */
} pd_sched_usage;

typedef struct pd_sched_event {
    pd_sched_event_kind kind;
    int choice;                  /* TOKEN, CHOICE_DONE */
    const char *text;            /* TOKEN: bytes to emit (valid during the call) */
    size_t len;
    const pd_sample_result *sample; /* TOKEN: the token and its logprobs */
    pd_finish_reason finish;     /* CHOICE_DONE */
    const pd_sched_usage *usage; /* STARTED (prefix fields), DONE */
    int error_code;              /* ERROR: PD_E*; message in error_msg */
    const char *error_msg;
} pd_sched_event;

/* Called on the engine thread; must not block for long and must not call
 * back into the scheduler except pd_sched_request_cancel (and
 * pd_scheduler_stats_get). The stats include a request's end before its
 * DONE or ERROR is delivered. */
typedef void (*pd_sched_sink)(void *ctx, const pd_sched_event *ev);

/* Validate (prompt length vs context, sampler params, prefix id found and
 * matching) and queue. On success *out is a handle the caller releases with
 * pd_sched_request_release after the last event (DONE or ERROR) or to give
 * up early (which cancels). Full queue: PD_ERANGE "queue is full". */
int pd_scheduler_submit(pd_scheduler *s, const pd_sched_params *p, pd_sched_sink sink, void *ctx,
                        pd_sched_request **out, pd_error *err);
/* Ask to stop (client went away): its slot is freed at the next step, and
 * the sink gets PD_SCHED_ERROR (PD_EINVAL, "cancelled") unless done. Only
 * sets a flag: safe from any thread, a sink included, at any time before
 * release (also after pd_scheduler_free). */
void pd_sched_request_cancel(pd_sched_request *r);
/* Cancel if still running, then drop the caller's reference; no event is
 * delivered to the sink after this returns. */
void pd_sched_request_release(pd_sched_request *r);

typedef struct pd_scheduler_stats {
    int64_t queued;              /* requests waiting */
    int64_t running;             /* sequences (choices) holding a batch slot */
    int64_t completed, failed, cancelled;
    int64_t prefix_hits, prefix_misses;
    int64_t kv_bytes;            /* own KV of running sequences (not the shared prefixes) */
    /* the automatic cache (zero without one); a lookup is one request with
     * cache auto, no prefix_id and at least one whole block before its last
     * prompt token */
    int64_t auto_hits, auto_misses, auto_evictions, auto_entries, auto_bytes;
    bool device_failed;          /* the device failed (PD_EDEVICE): nothing runs until a restart */
} pd_scheduler_stats;

void pd_scheduler_stats_get(pd_scheduler *s, pd_scheduler_stats *out);

/* ------------------------------------------------------------------------
 * Precompression jobs
 *
 * Registering a prefix (prefill with a policy, optional calibration, store
 * write) runs on the jobs' own worker thread with its own pd_model instance
 * loaded from the same file (the weights are mmap'd, so shared), so serving
 * never waits for it. Jobs run one at a time, oldest first; finished jobs
 * are remembered (up to max_jobs) so their status can be read.
 * ------------------------------------------------------------------------ */

typedef struct pd_jobs pd_jobs;

typedef struct pd_jobs_opts {
    const char *model_path;      /* the served GGUF (loaded again, lazily, by the worker) */
    int n_threads;               /* the worker's compute threads (default 1) */
    pd_device device;            /* where the worker computes (default cpu); on a GPU it keeps its
                                    own copy of the weights and scores on the device */
    bool kv_f32;                 /* the worker's KV cache in f32 (model.kv_type); default f16 */
    pd_store *store;             /* where prefixes go (not owned) */
    pd_hot *hot;                 /* optional: invalidated on delete (not owned) */
    /* optional: the shared tier (not owned). A job whose prefix is already
     * there is fetched instead of compressed; a stored prefix is published
     * before its job is done. */
    pd_cluster *cluster;
    int max_jobs;                /* jobs remembered, queued or finished (default 256) */
    const char *default_policy;  /* spec when a job names none (default "compactor") */
    pd_metrics *metrics;         /* optional: prefixd_prefix_jobs_total{state="done"|"failed"} and
                                    prefixd_prefix_jobs_queued */
    bool start_paused;           /* the worker starts no job until pd_jobs_set_paused(j, false) */
    const pd_logger *logger;     /* optional: a line when a job starts, is done or fails (not owned) */
    int64_t min_compress_tokens; /* prefixes shorter than this are stored exactly (retention 1, no
                                    calibration): compressing them saves too little (default 0) */
    /* Optional: called once, on the worker thread, when a job fails with a
     * sticky device error (PD_EDEVICE): the process's GPU context is gone,
     * the serving model's too. No job starts after it; submit answers
     * PD_EUNAVAILABLE. */
    void (*on_device_failure)(void *ctx);
    void *on_device_failure_ctx;
} pd_jobs_opts;

void pd_jobs_opts_default(pd_jobs_opts *o);
int pd_jobs_create(const pd_jobs_opts *o, pd_jobs **out, pd_error *err);
/* Finishes the running job's current step (a calibration, one layer of the
 * compressing prefill, or the store write) and abandons it after that step,
 * drops the queue, joins the worker, frees everything. Must not race with
 * other calls on j. */
void pd_jobs_free(pd_jobs *j);
/* Paused, the worker starts no new job (the running one continues); queued
 * jobs stay queued. For maintenance and deterministic tests. */
void pd_jobs_set_paused(pd_jobs *j, bool paused);
/* Whether a job hit a sticky device error (see on_device_failure). */
bool pd_jobs_device_failed(pd_jobs *j);

/* What to register. Copied by pd_jobs_submit. */
typedef struct pd_job_spec {
    const pd_token *tokens;      /* the prefix, BOS included as requests will send it */
    int64_t n;
    const pd_layout *layout;     /* optional spans/whitelist (policies.h), copied */
    const char *policy;          /* spec string; NULL = default_policy */
    double retention;            /* > 0: overrides the spec's retention */
    double quality;              /* > 1: choose the retention by calibration (tau) */
    /* With quality: choose the retention zero-shot from this curve, fitted
     * offline (prefixctl calibrate), instead of measuring a probe. NULL =
     * probe calibration. curve_policy: the spec it was fitted for; it must
     * name the job's policy, retention aside (pd_curve_policy_print). */
    const pd_curve *curve;
    const char *curve_policy;
    const char *ns;              /* namespace ("" or NULL = none) */
    bool pin;
    pd_kv_dtype dtype;           /* how the rows are stored (the admin API defaults to f16) */
} pd_job_spec;

typedef enum pd_job_state {
    PD_JOB_QUEUED = 0,
    PD_JOB_RUNNING,
    PD_JOB_DONE,
    PD_JOB_FAILED,
} pd_job_state;

const char *pd_job_state_name(pd_job_state s); /* "queued", "running", "done", "failed" */

typedef struct pd_job_status {
    uint64_t id;                 /* 1, 2, ... */
    pd_job_state state;
    double progress;             /* 0..1 */
    char phase[32];              /* "queued", "loading model", "calibrating", "compressing", "storing", "done" */
    char error[512];             /* PD_JOB_FAILED */
    int error_code;
    pd_prefix_info info;         /* PD_JOB_DONE: the stored prefix (id, kept rows, quality, ...) */
    bool existed;                /* PD_JOB_DONE: it was already stored */
    double chosen_retention;     /* the retention used (calibrated or asked for) */
    double created_at, started_at, finished_at; /* Unix seconds; 0 = not yet */
} pd_job_status;

/* Validates (non-empty tokens, the spec parses, the layout fits n, quality
 * and retention ranges, n within the model's context once loaded) and
 * queues. Full (max_jobs unfinished): PD_ERANGE. When the table is full the
 * oldest finished job is forgotten to make room. retention: 0 = the
 * policy's own, else (0, 1]; quality: 0 = none, else > 1 (not both). A job
 * whose prefix turns out longer than the model's context when the worker
 * loads it fails with PD_ERANGE. The stored spec (the cache key) is the
 * canonical spec, then "|" and the canonical layout text when there is a
 * layout, as `prefixctl compress --store` writes it. */
int pd_jobs_submit(pd_jobs *j, const pd_job_spec *spec, uint64_t *job_id, pd_error *err);
/* PD_ENOTFOUND for unknown or forgotten ids. */
int pd_jobs_status(pd_jobs *j, uint64_t id, pd_job_status *out, pd_error *err);
/* Wait until the job is DONE or FAILED, or timeout_s passes (then the
 * current status, rc PD_OK; check out->state). timeout_s <= 0: no wait;
 * INFINITY: no limit; NaN: PD_EINVAL. */
int pd_jobs_wait(pd_jobs *j, uint64_t id, double timeout_s, pd_job_status *out, pd_error *err);

#ifdef __cplusplus
}
#endif
#endif
