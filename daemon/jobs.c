/* Precompression jobs: one worker thread registers prefixes (optional
 * calibration, compressing prefill, store write) with its own pd_model, so
 * serving never waits for it.
 *
 * Locking: one mutex guards the job table and every job's status; a job's
 * copied spec (tokens, layout, policy) is immutable after submit, so the
 * worker reads it without the lock. The running job is unfinished and is
 * therefore never dropped from the table while the worker uses it. One
 * condition variable wakes the worker (new job, stop) and the waiters (a job
 * changed state). */
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/daemon.h"

typedef struct job {
    /* immutable after submit */
    pd_token *tokens;
    int64_t n;
    pd_span *spans;
    int n_spans;
    pd_range *whitelist;
    int n_whitelist;
    bool has_layout;
    pd_policy_spec spec;         /* parsed, retention override applied */
    double quality;              /* > 1: calibrate with this tau */
    bool has_curve;              /* with quality: choose from this curve, no probe */
    pd_curve curve;
    char ns[PD_PREFIX_NS_MAX];
    bool pin;
    pd_kv_dtype dtype;
    /* guarded by the mutex */
    pd_job_status st;
} job;

struct pd_jobs {
    char *model_path;
    char *default_policy;
    int n_threads;
    bool kv_f32;
    pd_store *store;
    pd_cluster *cluster;         /* may be NULL */
    int max_jobs;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
    bool paused;
    job **table;                 /* [max_jobs], oldest first (ids increasing) */
    int n_table;
    uint64_t next_id;
    int32_t n_ctx;               /* the model's trained context once loaded, else 0 */
    pthread_t thread;

    pd_model *model;             /* the worker's; only the worker touches it */
    pd_backend *backend;         /* the worker model's */
    pd_device device;

    pd_counter *m_done, *m_failed;
    pd_gauge *m_queued;
    const pd_logger *logger;     /* may be NULL */
    int64_t min_compress_tokens; /* shorter prefixes are stored exactly */
    void (*on_device_failure)(void *ctx);
    void *on_device_failure_ctx;
    bool device_failed;          /* guarded by mu: a job hit PD_EDEVICE; no job starts after it */
};

const char *pd_job_state_name(pd_job_state s) {
    switch (s) {
    case PD_JOB_QUEUED: return "queued";
    case PD_JOB_RUNNING: return "running";
    case PD_JOB_DONE: return "done";
    case PD_JOB_FAILED: return "failed";
    }
    return "unknown";
}

void pd_jobs_opts_default(pd_jobs_opts *o) {
    memset(o, 0, sizeof *o);
    o->n_threads = 1;
    o->max_jobs = 256;
    o->default_policy = "compactor";
}

/* Unix seconds for the status timestamps (pd_now_seconds is monotonic). */
static double unix_now(void) {
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return 0;
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void job_free(job *jb) {
    if (!jb) return;
    free(jb->tokens);
    free(jb->spans);
    free(jb->whitelist);
    free(jb);
}

static bool finished(const job *jb) { return jb->st.state == PD_JOB_DONE || jb->st.state == PD_JOB_FAILED; }

static void set_phase(job *jb, const char *phase) { snprintf(jb->st.phase, sizeof jb->st.phase, "%s", phase); }

/* Progress only moves forward, whatever a phase reports. Under the lock. */
static void set_progress(job *jb, double p) {
    if (p > 1) p = 1;
    if (p > jb->st.progress) jb->st.progress = p;
}

static void queued_gauge_add(pd_jobs *j, double v) {
    if (j->m_queued) pd_gauge_add(j->m_queued, v);
}

/* ---- the worker ----------------------------------------------------------- */

/* Progress and cancellation between layers of the compressing prefill
 * (and between calibration measurements, on_calib_step). */
typedef struct layer_ctx {
    pd_jobs *j;
    job *jb;
    double base, span;           /* progress = base + span * layers done / n_layer */
} layer_ctx;

static int on_layer(void *ctx, int layer, int n_layer, pd_error *err) {
    layer_ctx *h = ctx;
    pd_jobs *j = h->j;
    pthread_mutex_lock(&j->mu);
    const bool stop = j->stop;
    set_progress(h->jb, h->base + h->span * (double)(layer + 1) / (double)(n_layer > 0 ? n_layer : 1));
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (stop) return pd_errorf(err, PD_EIO, "the jobs service is shutting down; the job was abandoned");
    return PD_OK;
}

/* Calibration fills progress [0, CALIB_SHARE): one step per measurement
 * (pd_calib_opts.progress); compression the rest up to "storing". */
#define CALIB_SHARE 0.6

static int on_calib_step(void *ctx, int done, int total, pd_error *err) {
    layer_ctx *h = ctx;
    pd_jobs *j = h->j;
    pthread_mutex_lock(&j->mu);
    const bool stop = j->stop;
    set_progress(h->jb, h->base + h->span * (double)done / (double)(total > 0 ? total : 1));
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (stop) return pd_errorf(err, PD_EIO, "the jobs service is shutting down; the job was abandoned");
    return PD_OK;
}

/* Set the phase (and progress floor) of the running job; false when asked to
 * stop, so the worker abandons the job between steps. */
static bool enter_phase(pd_jobs *j, job *jb, const char *phase, double progress) {
    pthread_mutex_lock(&j->mu);
    set_phase(jb, phase);
    set_progress(jb, progress);
    const bool stop = j->stop;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    return !stop;
}

/* The store key (pd_policy_key_print), which must fit the store's field. */
static int key_spec(const pd_policy_spec *spec, const pd_layout *layout, char *out, size_t cap, pd_error *err) {
    const size_t len = pd_policy_key_print(spec, layout, out, cap);
    if (len >= cap)
        return pd_errorf(err, PD_ERANGE, "the spec and layout take %zu bytes; the store keeps at most %zu (use fewer "
                                         "or shorter span names)",
                         len, cap - 1);
    return PD_OK;
}

static int abandoned(pd_error *err) {
    return pd_errorf(err, PD_EIO, "the jobs service is shutting down; the job was abandoned");
}

static int load_model(pd_jobs *j, pd_error *err) {
    if (j->model) return PD_OK;
    if (!j->backend) {
        int rc = pd_backend_create(&j->device, j->n_threads, &j->backend, err);
        if (rc) return pd_error_prefix(err, "the compute backend for precompression");
    }
    /* mapped: prefill is bound by compute, and serving holds a copy already */
    pd_model_params mp = {.n_threads = j->n_threads, .backend = j->backend, .kv_f32 = j->kv_f32,
                          .mmap_weights = true};
    int rc = pd_model_load(j->model_path, &mp, &j->model, err);
    if (rc) return pd_error_prefix(err, "loading the model for precompression");
    pthread_mutex_lock(&j->mu);
    j->n_ctx = pd_model_hparams(j->model)->n_ctx_train;
    pthread_mutex_unlock(&j->mu);
    return PD_OK;
}

/* Run one job outside the lock: phases and progress are published as it
 * goes; the outcome (info, existed, chosen retention) is recorded by the
 * caller. Returns PD_OK, or the failure code with err set. */
static int run_job(pd_jobs *j, job *jb, pd_prefix_info *info, bool *existed, double *chosen, pd_error *err) {
    int rc;
    if (!enter_phase(j, jb, "loading model", 0)) return abandoned(err);
    if ((rc = load_model(j, err))) return rc;
    const pd_hparams *hp = pd_model_hparams(j->model);
    if (jb->n > hp->n_ctx_train)
        return pd_errorf(err, PD_ERANGE, "the prefix has %" PRId64 " tokens, more than the model's context of %d",
                         jb->n, hp->n_ctx_train);

    const pd_layout layout = {.spans = jb->spans, .n_spans = jb->n_spans, .whitelist = jb->whitelist,
                              .n_whitelist = jb->n_whitelist};
    const pd_layout *lay = jb->has_layout ? &layout : NULL;
    pd_policy_spec spec = jb->spec;
    pd_prefix_quality q = {.retention = NAN, .tau = NAN, .nll_full = NAN, .nll_ratio = NAN};
    double base = 0;
    if (jb->n < j->min_compress_tokens) {
        /* Too short to be worth compressing (compression.min_prefix_tokens). */
        pd_policy_spec_set_retention(&spec, 1);
    } else if (jb->quality > 1 && jb->has_curve) {
        /* Zero-shot: the curve was fitted offline on a calibration set. */
        pd_calib_opts co;
        pd_calib_opts_default(&co);
        pd_policy_spec_set_retention(&spec, pd_curve_choose(jb->curve, jb->quality, co.min_retention));
        q.tau = jb->quality;
        q.has_curve = true;
        q.curve_a = jb->curve.a;
        q.curve_b = jb->curve.b;
    } else if (jb->quality > 1) {
        if (!enter_phase(j, jb, "calibrating", 0)) return abandoned(err);
        pd_calib_opts co;
        pd_calib_opts_default(&co);
        co.tau = jb->quality;
        layer_ctx calib = {.j = j, .jb = jb, .base = 0, .span = CALIB_SHARE};
        co.progress = on_calib_step;
        co.progress_ctx = &calib;
        pd_calib_result cr;
        pd_policy_spec chosen_spec;
        if ((rc = pd_calibrate(j->model, jb->tokens, jb->n, &spec, lay, &co, &cr, &chosen_spec, err))) return rc;
        spec = chosen_spec;
        q.tau = jb->quality;
        q.nll_full = cr.nll_full;
        q.nll_ratio = cr.measured;
        _Static_assert(PD_PREFIX_CALIB_POINTS >= PD_CALIB_MAX_POINTS, "every calibration point fits the record");
        q.has_curve = true;
        q.curve_a = cr.curve.a;
        q.curve_b = cr.curve.b;
        q.n_points = cr.n_points;
        for (int i = 0; i < cr.n_points; i++) {
            q.point_retention[i] = cr.retention[i];
            q.point_ratio[i] = cr.ratio[i];
        }
        base = CALIB_SHARE;
    }
    q.retention = spec.retention;
    *chosen = spec.retention;

    /* Stored here already, or compressed by another node (the shared
     * tier): the work happened once; only the bookkeeping is left. */
    memset(info, 0, sizeof *info);
    pd_model_fingerprint(j->model, info->fingerprint);
    if ((rc = key_spec(&spec, lay, info->spec, sizeof info->spec, err))) return rc;
    snprintf(info->ns, sizeof info->ns, "%s", jb->ns);
    pd_prefix_id id;
    if ((rc = pd_prefix_id_compute(info->fingerprint, jb->tokens, jb->n, info->spec, info->ns, &id)))
        return pd_errorf(err, rc, "out of memory hashing the prefix");
    pd_error lerr;
    bool here = pd_store_info(j->store, &id, info, &lerr) == PD_OK;
    if (!here && j->cluster && pd_cluster_fetch_id(j->cluster, &id, &lerr) == PD_OK)
        here = pd_store_info(j->store, &id, info, &lerr) == PD_OK;
    if (here) {
        if (jb->pin && !info->pinned && !(rc = pd_store_pin(j->store, &id, true, err))) info->pinned = true;
        *existed = true;
        return rc;
    }

    if (!enter_phase(j, jb, "compressing", base)) return abandoned(err);
    layer_ctx h = {.j = j, .jb = jb, .base = base, .span = 0.95 - base};
    pd_kv_prefix *prefix = NULL;
    if ((rc = pd_compress_prefix_observed(j->model, jb->tokens, jb->n, &spec, lay, on_layer, &h, &prefix, NULL, err)))
        return rc;

    if (!enter_phase(j, jb, "storing", 0.95)) {
        pd_kv_prefix_free(prefix);
        return abandoned(err);
    }
    info->dtype = jb->dtype;
    info->quality = q;
    info->pinned = jb->pin;
    rc = pd_store_put(j->store, info, jb->tokens, jb->n, prefix, existed, err);
    if (rc) pd_error_prefix(err, "storing the prefix");
    pd_kv_prefix_free(prefix);
    /* Published before the job is done, so a client that waited for it
     * finds it on every node. Redis being away only delays that: the node
     * publishes what it holds when it reconnects. */
    pd_error perr;
    if (!rc && j->cluster && pd_cluster_publish(j->cluster, &info->id, &perr) != PD_OK)
        pd_log(j->logger, PD_LOG_WARN, "the prefix is stored here but not in the shared tier yet: %s", perr.msg);
    return rc;
}

/* Job lines: the start (what it compresses), then done (the stored prefix)
 * or failed (the error). The worker reads only jb's immutable part here. */
static void log_job_start(const pd_jobs *j, const job *jb) {
    if (!pd_log_enabled(j->logger, PD_LOG_INFO)) return;
    char spec[256];
    pd_policy_spec_print(&jb->spec, spec, sizeof spec);
    const pd_log_field f[] = {PD_LOG_STR("event", "job_start"), PD_LOG_INT("job_id", jb->st.id),
                              PD_LOG_INT("tokens", jb->n), PD_LOG_STR("policy", spec),
                              PD_LOG_STR("namespace", jb->ns)};
    pd_log_fields(j->logger, PD_LOG_INFO, "job started", f, sizeof f / sizeof f[0]);
}

static void log_job_end(const pd_jobs *j, const job *jb, int rc, const pd_error *err, const pd_prefix_info *info,
                        bool existed, double chosen) {
    const double seconds = unix_now() - jb->st.started_at;
    if (rc) {
        const pd_log_field f[] = {PD_LOG_STR("event", "job_failed"), PD_LOG_INT("job_id", jb->st.id),
                                  PD_LOG_NUM("seconds", seconds), PD_LOG_STR("status", pd_status_name(rc)),
                                  PD_LOG_STR("error", err->msg[0] ? err->msg : pd_status_name(rc))};
        pd_log_fields(j->logger, PD_LOG_WARN, "job failed", f, sizeof f / sizeof f[0]);
        return;
    }
    char id[PD_PREFIX_ID_HEX];
    pd_prefix_id_hex(&info->id, id);
    const pd_log_field f[] = {PD_LOG_STR("event", "job_done"), PD_LOG_INT("job_id", jb->st.id),
                              PD_LOG_NUM("seconds", seconds), PD_LOG_STR("prefix_id", id),
                              PD_LOG_INT("kept_rows", info->kept_rows),
                              PD_LOG_STR("existed", existed ? "true" : "false"), PD_LOG_NUM("retention", chosen)};
    /* No retention was chosen (NaN): the last field is left out. */
    const size_t n = sizeof f / sizeof f[0] - (isnan(chosen) ? 1 : 0);
    pd_log_fields(j->logger, PD_LOG_INFO, "job done", f, n);
}

static void *worker_main(void *arg) {
    pd_jobs *j = arg;
    pthread_mutex_lock(&j->mu);
    for (;;) {
        job *jb = NULL;
        while (!j->stop) {
            for (int i = 0; !j->paused && !j->device_failed && i < j->n_table; i++)
                if (j->table[i]->st.state == PD_JOB_QUEUED) {
                    jb = j->table[i];
                    break;
                }
            if (jb) break;
            pthread_cond_wait(&j->cv, &j->mu);
        }
        if (j->stop) break;
        jb->st.state = PD_JOB_RUNNING;
        jb->st.started_at = unix_now();
        queued_gauge_add(j, -1);
        pthread_cond_broadcast(&j->cv);
        pthread_mutex_unlock(&j->mu);

        log_job_start(j, jb);
        pd_error err = {0};
        pd_prefix_info info;
        bool existed = false;
        double chosen = NAN;
        int rc = run_job(j, jb, &info, &existed, &chosen, &err);
        log_job_end(j, jb, rc, &err, &info, existed, chosen);

        pthread_mutex_lock(&j->mu);
        jb->st.finished_at = unix_now();
        jb->st.chosen_retention = chosen;
        if (rc) {
            jb->st.state = PD_JOB_FAILED;
            jb->st.error_code = rc;
            snprintf(jb->st.error, sizeof jb->st.error, "%s", err.msg[0] ? err.msg : pd_status_name(rc));
            set_phase(jb, "failed");
            if (j->m_failed) pd_counter_add(j->m_failed, 1);
            if (rc == PD_EDEVICE && !j->device_failed) {
                /* The context is gone for every model of the process (the
                 * serving one too): tell the owner, which restarts it. */
                j->device_failed = true;
                pd_log(j->logger, PD_LOG_ERROR, "precompression job %" PRIu64 ": %s (no further job starts)",
                       jb->st.id, err.msg);
                if (j->on_device_failure) {
                    pthread_mutex_unlock(&j->mu);
                    j->on_device_failure(j->on_device_failure_ctx);
                    pthread_mutex_lock(&j->mu);
                }
            }
        } else {
            jb->st.state = PD_JOB_DONE;
            jb->st.info = info;
            jb->st.existed = existed;
            set_phase(jb, "done");
            jb->st.progress = 1;
            if (j->m_done) pd_counter_add(j->m_done, 1);
        }
        pthread_cond_broadcast(&j->cv);
    }
    pthread_mutex_unlock(&j->mu);
    return NULL;
}

/* ---- public API ------------------------------------------------------------ */

static int register_metrics(pd_jobs *j, pd_metrics *m, pd_error *err) {
    static const char total_help[] = "Precompression jobs finished, by outcome.";
    int rc = pd_metrics_counter(m, "prefixd_prefix_jobs_total", total_help, "state=\"done\"", &j->m_done, err);
    if (!rc) rc = pd_metrics_counter(m, "prefixd_prefix_jobs_total", total_help, "state=\"failed\"", &j->m_failed, err);
    if (!rc)
        rc = pd_metrics_gauge(m, "prefixd_prefix_jobs_queued", "Precompression jobs waiting to start.", NULL,
                              &j->m_queued, err);
    return rc;
}

int pd_jobs_create(const pd_jobs_opts *o, pd_jobs **out, pd_error *err) {
    *out = NULL;
    if (!o || !o->model_path || !*o->model_path)
        return pd_errorf(err, PD_EINVAL, "precompression jobs need the model path (model.path in the config)");
    if (!o->store) return pd_errorf(err, PD_EINVAL, "precompression jobs need a prefix store to write to");
    if (o->max_jobs < 1 || o->max_jobs > 1000000)
        return pd_errorf(err, PD_EINVAL, "max_jobs %d must be in [1, 1000000]", o->max_jobs);
    const char *dp = o->default_policy ? o->default_policy : "compactor";
    pd_policy_spec probe;
    int rc = pd_policy_spec_parse(dp, &probe, err);
    if (rc) return pd_error_prefix(err, "the default policy '%s'", dp);

    pd_jobs *j = calloc(1, sizeof *j);
    if (!j) return pd_errorf(err, PD_ENOMEM, "out of memory for the jobs service");
    j->n_threads = o->n_threads;
    j->kv_f32 = o->kv_f32;
    j->device = o->device;
    j->store = o->store;
    j->cluster = o->cluster;
    j->max_jobs = o->max_jobs;
    j->next_id = 1;
    j->paused = o->start_paused;
    j->logger = o->logger;
    j->min_compress_tokens = o->min_compress_tokens;
    j->on_device_failure = o->on_device_failure;
    j->on_device_failure_ctx = o->on_device_failure_ctx;
    j->model_path = strdup(o->model_path);
    j->default_policy = strdup(dp);
    j->table = calloc((size_t)o->max_jobs, sizeof *j->table);
    if (!j->model_path || !j->default_policy || !j->table) {
        rc = pd_errorf(err, PD_ENOMEM, "out of memory for the jobs service");
        goto fail_alloc;
    }
    if (o->metrics && (rc = register_metrics(j, o->metrics, err))) goto fail_alloc;

    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca) != 0) {
        rc = pd_errorf(err, PD_ENOMEM, "cannot initialise a condition variable attribute");
        goto fail_alloc;
    }
    /* Waits are timed on the monotonic clock so a wall-clock jump neither
     * cuts them short nor stretches them. */
    int e = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    if (!e) e = pthread_cond_init(&j->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (e) {
        rc = pd_errorf(err, PD_ENOMEM, "cannot initialise the jobs' condition variable (%s)", strerror(e));
        goto fail_alloc;
    }
    if ((e = pthread_mutex_init(&j->mu, NULL)) != 0) {
        pthread_cond_destroy(&j->cv);
        rc = pd_errorf(err, PD_ENOMEM, "cannot initialise the jobs' mutex (%s)", strerror(e));
        goto fail_alloc;
    }
    if ((e = pthread_create(&j->thread, NULL, worker_main, j)) != 0) {
        pthread_mutex_destroy(&j->mu);
        pthread_cond_destroy(&j->cv);
        rc = pd_errorf(err, PD_ENOMEM, "cannot start the precompression worker thread (%s)", strerror(e));
        goto fail_alloc;
    }
    *out = j;
    return PD_OK;
fail_alloc:
    free(j->model_path);
    free(j->default_policy);
    free(j->table);
    free(j);
    return rc;
}

void pd_jobs_free(pd_jobs *j) {
    if (!j) return;
    pthread_mutex_lock(&j->mu);
    j->stop = true;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    pthread_join(j->thread, NULL);
    /* The registry may outlive us: dropped jobs leave the queued gauge. */
    for (int i = 0; i < j->n_table; i++) {
        if (j->table[i]->st.state == PD_JOB_QUEUED) queued_gauge_add(j, -1);
        job_free(j->table[i]);
    }
    free(j->table);
    pd_model_free(j->model);
    pd_backend_free(j->backend);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j->model_path);
    free(j->default_policy);
    free(j);
}

bool pd_jobs_device_failed(pd_jobs *j) {
    pthread_mutex_lock(&j->mu);
    const bool failed = j->device_failed;
    pthread_mutex_unlock(&j->mu);
    return failed;
}

void pd_jobs_set_paused(pd_jobs *j, bool paused) {
    pthread_mutex_lock(&j->mu);
    j->paused = paused;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

/* Copy and check everything a job needs, outside the lock. */
static int job_build(pd_jobs *j, const pd_job_spec *spec, job **out, pd_error *err) {
    *out = NULL;
    if (!spec) return pd_errorf(err, PD_EINVAL, "no job spec given");
    if (!spec->tokens || spec->n <= 0)
        return pd_errorf(err, PD_EINVAL, "the prefix is empty: give at least one token to precompress");
    if (spec->n > INT32_MAX)
        return pd_errorf(err, PD_ERANGE, "the prefix has %" PRId64 " tokens; at most %d are supported", spec->n,
                         INT32_MAX);
    if (isnan(spec->retention) || spec->retention < 0 || spec->retention > 1)
        return pd_errorf(err, PD_EINVAL, "retention %g must be in (0, 1] (the fraction of tokens kept), or 0 to use "
                                         "the policy's own",
                         spec->retention);
    if (spec->quality != 0 && !pd_calib_tau_valid(spec->quality))
        return pd_errorf(err, PD_EINVAL, "quality %g must be above 1 and at most %g (the allowed NLL ratio, e.g. "
                                         "1.05), or 0 for no calibration",
                         spec->quality, PD_CALIB_TAU_MAX);
    if (spec->quality > 1 && spec->retention > 0)
        return pd_errorf(err, PD_EINVAL, "give a retention or a quality target, not both (calibration chooses the "
                                         "retention)");
    if (spec->curve && !(spec->quality > 1))
        return pd_errorf(err, PD_EINVAL, "a curve chooses the retention for a quality target: give the quality (tau)");
    if (spec->curve && (!(spec->curve->a > 0) || !(spec->curve->b > 0) || !isfinite(spec->curve->a) ||
                        !isfinite(spec->curve->b)))
        return pd_errorf(err, PD_EINVAL, "the curve's a (%g) and b (%g) must be positive numbers", spec->curve->a,
                         spec->curve->b);
    if (spec->curve && !spec->curve_policy)
        return pd_errorf(err, PD_EINVAL, "a curve needs the policy it was fitted for (curve_policy)");
    if (spec->dtype != PD_KV_F32 && spec->dtype != PD_KV_F16 && spec->dtype != PD_KV_BF16)
        return pd_errorf(err, PD_EINVAL, "unknown KV dtype %d: use f32, f16 or bf16", (int)spec->dtype);
    const char *ns = spec->ns ? spec->ns : "";
    if (strlen(ns) >= PD_PREFIX_NS_MAX)
        return pd_errorf(err, PD_EINVAL, "the namespace is longer than %d bytes", PD_PREFIX_NS_MAX - 1);

    job *jb = calloc(1, sizeof *jb);
    if (!jb) return pd_errorf(err, PD_ENOMEM, "out of memory for a job");
    const char *policy = spec->policy ? spec->policy : j->default_policy;
    int rc = pd_policy_spec_parse(policy, &jb->spec, err);
    if (rc) {
        pd_error_prefix(err, "policy '%s'", policy);
        goto fail;
    }
    if (spec->retention > 0) pd_policy_spec_set_retention(&jb->spec, spec->retention);
    if (spec->curve) {
        /* A curve is only valid for the policy (and model) it was fitted on. */
        pd_policy_spec fitted;
        char want[PD_POLICY_SPEC_MAX], have[PD_POLICY_SPEC_MAX];
        if ((rc = pd_policy_spec_parse(spec->curve_policy, &fitted, err))) {
            pd_error_prefix(err, "the curve's policy '%s'", spec->curve_policy);
            goto fail;
        }
        pd_curve_policy_print(&jb->spec, want, sizeof want);
        pd_curve_policy_print(&fitted, have, sizeof have);
        if (strcmp(want, have) != 0) {
            rc = pd_errorf(err, PD_EINVAL, "the curve was fitted for policy %s, not %s (retention aside): fit one "
                           "for this policy with prefixctl calibrate", have, want);
            goto fail;
        }
        jb->has_curve = true;
        jb->curve = *spec->curve;
    }

    const pd_layout *l = spec->layout;
    if (l && (l->n_spans > 0 || l->n_whitelist > 0)) {
        if ((rc = pd_layout_validate(l, spec->n, err))) goto fail;
        if (l->n_spans > 0) {
            if (!(jb->spans = malloc(sizeof *jb->spans * (size_t)l->n_spans))) goto oom;
            memcpy(jb->spans, l->spans, sizeof *jb->spans * (size_t)l->n_spans);
            jb->n_spans = l->n_spans;
        }
        if (l->n_whitelist > 0) {
            if (!(jb->whitelist = malloc(sizeof *jb->whitelist * (size_t)l->n_whitelist))) goto oom;
            memcpy(jb->whitelist, l->whitelist, sizeof *jb->whitelist * (size_t)l->n_whitelist);
            jb->n_whitelist = l->n_whitelist;
        }
        jb->has_layout = true;
    }
    if (jb->spec.fair && jb->n_spans == 0) {
        rc = pd_errorf(err, PD_EINVAL, "policy %s has fair=1, which needs a layout with spans; give spans or set fair=0",
                       pd_policy_kind_name(jb->spec.kind));
        goto fail;
    }
    {
        /* The key must fit the store's spec field; say so now, not after the prefill. */
        char key[PD_PREFIX_SPEC_MAX];
        const pd_layout lay = {.spans = jb->spans, .n_spans = jb->n_spans, .whitelist = jb->whitelist,
                               .n_whitelist = jb->n_whitelist};
        if ((rc = key_spec(&jb->spec, jb->has_layout ? &lay : NULL, key, sizeof key, err))) goto fail;
    }
    if (!(jb->tokens = malloc(sizeof *jb->tokens * (size_t)spec->n))) goto oom;
    memcpy(jb->tokens, spec->tokens, sizeof *jb->tokens * (size_t)spec->n);
    jb->n = spec->n;
    jb->quality = spec->quality;
    snprintf(jb->ns, sizeof jb->ns, "%s", ns);
    jb->pin = spec->pin;
    jb->dtype = spec->dtype;
    *out = jb;
    return PD_OK;
oom:
    rc = pd_errorf(err, PD_ENOMEM, "out of memory copying a %" PRId64 "-token job", spec->n);
fail:
    job_free(jb);
    return rc;
}

int pd_jobs_submit(pd_jobs *j, const pd_job_spec *spec, uint64_t *job_id, pd_error *err) {
    job *jb = NULL;
    int rc = job_build(j, spec, &jb, err);
    if (rc) return rc;
    pthread_mutex_lock(&j->mu);
    if (j->stop) {
        rc = pd_errorf(err, PD_EINVAL, "the jobs service is shutting down");
        goto out;
    }
    if (j->device_failed) {
        rc = pd_errorf(err, PD_EUNAVAILABLE,
                       "the server's GPU failed and the server is restarting; submit the job again once it is back");
        goto out;
    }
    if (j->n_ctx > 0 && jb->n > j->n_ctx) {
        rc = pd_errorf(err, PD_ERANGE, "the prefix has %" PRId64 " tokens, more than the model's context of %d", jb->n,
                       (int)j->n_ctx);
        goto out;
    }
    if (j->n_table == j->max_jobs) {
        /* Forget the oldest finished job to make room. */
        int victim = -1;
        for (int i = 0; i < j->n_table && victim < 0; i++)
            if (finished(j->table[i])) victim = i;
        if (victim < 0) {
            rc = pd_errorf(err, PD_EBUSY, "the job queue is full: %d precompression jobs are queued or running; "
                                             "wait for some to finish",
                           j->max_jobs);
            goto out;
        }
        job_free(j->table[victim]);
        memmove(j->table + victim, j->table + victim + 1, sizeof *j->table * (size_t)(j->n_table - victim - 1));
        j->n_table--;
    }
    jb->st.id = j->next_id++;
    jb->st.state = PD_JOB_QUEUED;
    set_phase(jb, "queued");
    jb->st.chosen_retention = NAN;
    jb->st.created_at = unix_now();
    j->table[j->n_table++] = jb;
    if (job_id) *job_id = jb->st.id;
    jb = NULL;
    queued_gauge_add(j, 1);
    pthread_cond_broadcast(&j->cv);
out:
    pthread_mutex_unlock(&j->mu);
    job_free(jb);
    return rc;
}

/* Binary search: ids are increasing in the table. Under the lock. */
static job *find_job(pd_jobs *j, uint64_t id) {
    int lo = 0, hi = j->n_table;
    while (lo < hi) {
        const int mid = lo + (hi - lo) / 2;
        const uint64_t v = j->table[mid]->st.id;
        if (v == id) return j->table[mid];
        if (v < id) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}

int pd_jobs_status(pd_jobs *j, uint64_t id, pd_job_status *out, pd_error *err) {
    pthread_mutex_lock(&j->mu);
    job *jb = find_job(j, id);
    if (jb) *out = jb->st;
    pthread_mutex_unlock(&j->mu);
    if (!jb) return pd_errorf(err, PD_ENOTFOUND, "no precompression job %" PRIu64 " (unknown, or finished and forgotten)", id);
    return PD_OK;
}

int pd_jobs_wait(pd_jobs *j, uint64_t id, double timeout_s, pd_job_status *out, pd_error *err) {
    if (isnan(timeout_s)) return pd_errorf(err, PD_EINVAL, "the wait timeout is not a number");
    struct timespec deadline = {0};
    const bool forever = isinf(timeout_s) && timeout_s > 0;
    if (!forever && timeout_s > 0) {
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        /* Clamp so the addition cannot overflow time_t. */
        const double t = timeout_s > 1e9 ? 1e9 : timeout_s;
        const double whole = floor(t);
        deadline.tv_sec += (time_t)whole;
        deadline.tv_nsec += (long)((t - whole) * 1e9);
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000L;
        }
    }
    int rc = PD_OK;
    pthread_mutex_lock(&j->mu);
    for (;;) {
        job *jb = find_job(j, id);
        if (!jb) {
            rc = pd_errorf(err, PD_ENOTFOUND, "no precompression job %" PRIu64 " (unknown, or finished and forgotten)",
                           id);
            break;
        }
        *out = jb->st;
        if (finished(jb) || j->stop || !(timeout_s > 0)) break;
        if (forever) {
            pthread_cond_wait(&j->cv, &j->mu);
        } else if (pthread_cond_timedwait(&j->cv, &j->mu, &deadline) != 0) {
            /* ETIMEDOUT: report the status as it is now. */
            jb = find_job(j, id);
            if (jb) *out = jb->st;
            else rc = pd_errorf(err, PD_ENOTFOUND, "precompression job %" PRIu64 " was forgotten while waiting", id);
            break;
        }
    }
    pthread_mutex_unlock(&j->mu);
    return rc;
}
