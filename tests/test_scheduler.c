/* The scheduler against sequential references written here with the engine
 * API: single requests (greedy and seeded, n > 1), many concurrent requests
 * under continuous batching, chunked prefill, stored prefixes (store and hot
 * tier), cancellation and release, validation, a full queue and shutdown.
 * Sinks record under a mutex and tests wait on condition variables; a sink
 * that must hold the engine still blocks until the test lets it go. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "daemon/daemon.h"
#include "engine/engine.h"
#include "helpers.h"
#include "policies/policies.h"
#include "tools/tools.h"

#define MAXT 512
#define MAXC 16

static char *tmpdir;

static void setup(void) {
    tmpdir = th_mkdtemp();
    cr_assert_not_null(tmpdir);
}

static void teardown(void) {
    th_rmtree(tmpdir);
    free(tmpdir);
    tmpdir = NULL;
}

TestSuite(scheduler, .init = setup, .fini = teardown, .timeout = 300);

/* ---- models ------------------------------------------------------------ */

static pd_model *load(const char *path) {
    pd_model *m = NULL;
    pd_error err = {0};
    pd_model_params p = {.n_threads = 1};
    cr_assert_eq(pd_model_load(path, &p, &m, &err), PD_OK, "%s: %s", path, err.msg);
    return m;
}

static pd_model *load_stories(void) {
    char buf[1024];
    const char *path = th_shared_file("tinystories/stories260K.gguf", buf, sizeof buf);
    if (!path) cr_skip_test("tinystories/stories260K.gguf is absent; skipping");
    return load(path);
}

static pd_model *load_generated(void) {
    pd_testmodel_opts o;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset("tiny", &o, &err), PD_OK, "%s", err.msg);
    o.seed = 7;
    char path[1024];
    snprintf(path, sizeof path, "%s/tiny.gguf", tmpdir);
    cr_assert_eq(pd_testmodel_write(&o, path, NULL, &err), PD_OK, "%s", err.msg);
    return load(path);
}

/* BOS then deterministic pseudo-random tokens (no control tokens). */
static void make_prompt(const pd_model *m, uint64_t seed, int64_t n, pd_token *out) {
    int32_t V = pd_model_hparams(m)->n_vocab;
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    out[0] = pd_tokenizer_bos(pd_model_tokenizer(m));
    for (int64_t i = 1; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out[i] = (pd_token)(3 + x % (uint64_t)(V - 3));
    }
}

static int64_t tokenize_story(const pd_model *m, const char *text, pd_token *out, int64_t cap) {
    pd_token *ids = NULL;
    size_t n = 0;
    pd_error err = {0};
    pd_tokenize_opts o = {.add_special = true};
    cr_assert_eq(pd_tokenize(pd_model_tokenizer(m), text, strlen(text), o, &ids, &n, &err), PD_OK, "%s", err.msg);
    cr_assert_leq((int64_t)n, cap);
    memcpy(out, ids, n * sizeof *ids);
    free(ids);
    return (int64_t)n;
}

/* The sequential reference: one sequence, whole-prompt prefill (after a
 * prefix when given), then sample/accept/push and decode one at a time. */
static int reference(pd_model *m, const pd_kv_prefix *prefix, const pd_token *prompt, int64_t n,
                     const pd_sampler_params *sp, const pd_generation_params *gp, pd_token *out) {
    pd_error err = {0};
    int32_t V = pd_model_hparams(m)->n_vocab;
    float *logits = malloc(sizeof(float) * (size_t)V);
    cr_assert_not_null(logits);
    pd_seq *seq = NULL;
    pd_sampler *smp = NULL;
    pd_generation *gen = NULL;
    cr_assert_eq(pd_seq_create(m, 0, &seq, &err), PD_OK, "%s", err.msg);
    int64_t start = 0;
    if (prefix) {
        cr_assert_eq(pd_seq_attach_prefix(seq, prefix, &err), PD_OK, "%s", err.msg);
        start = pd_kv_prefix_n_orig(prefix);
    }
    cr_assert_eq(pd_sampler_create(sp, V, &smp, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_sampler_accept_many(smp, prompt, (size_t)n, false, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_generation_create(pd_model_tokenizer(m), gp, &gen, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_prefill(m, seq, prompt + start, n - start, NULL, logits, &err), PD_OK, "%s", err.msg);
    int count = 0;
    for (;;) {
        pd_sample_result r;
        pd_generation_step st;
        cr_assert_eq(pd_sampler_sample(smp, logits, &r, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_sampler_accept(smp, r.token, true, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_generation_push(gen, r.token, &st, &err), PD_OK, "%s", err.msg);
        out[count++] = r.token;
        if (st.finish != PD_FINISH_NONE) break;
        cr_assert_eq(pd_decode(m, &seq, &r.token, 1, logits, &err), PD_OK, "%s", err.msg);
    }
    pd_generation_free(gen);
    pd_sampler_free(smp);
    pd_seq_free(seq);
    free(logits);
    return count;
}

/* ---- a recording sink -------------------------------------------------- */

typedef struct collector {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_started, n_events;
    bool done, error;
    int error_code;
    char error_msg[512];
    pd_token tokens[MAXC][MAXT];
    int n_tokens[MAXC];
    int total_tokens;
    int n_choice_done;
    pd_finish_reason finish[MAXC];
    char text[MAXC][4096];
    size_t text_len[MAXC];
    pd_sched_usage started, usage;
    bool release_returned;
    int events_after_release;
    int order_errors;   /* an event after the last one, TOKEN before STARTED, ... */
    int block_at;       /* > 0: block inside the block_at-th TOKEN until `go` */
    bool reached, go;
} collector;

static void col_init(collector *c) {
    memset(c, 0, sizeof *c);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
}

static void col_destroy(collector *c) {
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
}

static void sink(void *ctx, const pd_sched_event *ev) {
    collector *c = ctx;
    pthread_mutex_lock(&c->mu);
    c->n_events++;
    if (c->release_returned) c->events_after_release++;
    if (c->done || c->error) c->order_errors++;
    switch (ev->kind) {
    case PD_SCHED_STARTED:
        if (c->n_started++ != 0) c->order_errors++;
        c->started = *ev->usage;
        break;
    case PD_SCHED_TOKEN:
        if (!c->n_started || ev->choice < 0 || ev->choice >= MAXC) {
            c->order_errors++;
            break;
        }
        if (c->n_tokens[ev->choice] < MAXT) c->tokens[ev->choice][c->n_tokens[ev->choice]++] = ev->sample->token;
        if (c->text_len[ev->choice] + ev->len < sizeof c->text[0]) {
            memcpy(c->text[ev->choice] + c->text_len[ev->choice], ev->text, ev->len);
            c->text_len[ev->choice] += ev->len;
        }
        c->total_tokens++;
        break;
    case PD_SCHED_CHOICE_DONE:
        c->n_choice_done++;
        if (ev->choice >= 0 && ev->choice < MAXC) c->finish[ev->choice] = ev->finish;
        break;
    case PD_SCHED_DONE:
        c->done = true;
        c->usage = *ev->usage;
        break;
    case PD_SCHED_ERROR:
        c->error = true;
        c->error_code = ev->error_code;
        snprintf(c->error_msg, sizeof c->error_msg, "%s", ev->error_msg ? ev->error_msg : "");
        break;
    }
    pthread_cond_broadcast(&c->cv);
    if (ev->kind == PD_SCHED_TOKEN && c->block_at > 0 && c->total_tokens == c->block_at) {
        c->reached = true;
        pthread_cond_broadcast(&c->cv);
        while (!c->go) pthread_cond_wait(&c->cv, &c->mu);
    }
    pthread_mutex_unlock(&c->mu);
}

static void col_wait_end(collector *c) {
    pthread_mutex_lock(&c->mu);
    while (!c->done && !c->error) pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

static void col_wait_reached(collector *c) {
    pthread_mutex_lock(&c->mu);
    while (!c->reached) pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

static void col_go(collector *c) {
    pthread_mutex_lock(&c->mu);
    c->go = true;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

static pd_scheduler *start(pd_model *m, const pd_scheduler_opts *o) {
    pd_scheduler *s = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_scheduler_create(m, o, &s, &err), PD_OK, "%s", err.msg);
    return s;
}

static pd_sched_params params(const pd_token *prompt, int64_t n, const pd_sampler_params *sp, int32_t max_tokens) {
    pd_sched_params p;
    memset(&p, 0, sizeof p);
    p.prompt = prompt;
    p.n_prompt = n;
    p.n_choices = 1;
    p.sampling = *sp;
    p.gen.max_tokens = max_tokens;
    p.cache = PD_CACHE_AUTO;
    return p;
}

static pd_sched_request *submit(pd_scheduler *s, const pd_sched_params *p, collector *c) {
    pd_sched_request *r = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_scheduler_submit(s, p, sink, c, &r, &err), PD_OK, "%s", err.msg);
    return r;
}

static pd_sampler_params greedy(void) {
    pd_sampler_params sp = pd_sampler_params_default();
    sp.temperature = 0.0f;
    sp.seed = 1;
    return sp;
}

static pd_sampler_params seeded(uint64_t seed) {
    pd_sampler_params sp = pd_sampler_params_default();
    sp.temperature = 0.9f;
    sp.top_k = 40;
    sp.top_p = 0.95f;
    sp.seed = seed;
    return sp;
}

static void expect_tokens(const collector *c, int choice, const pd_token *ref, int n_ref, const char *what) {
    cr_assert_eq(c->n_tokens[choice], n_ref, "%s: choice %d generated %d tokens, the reference %d", what, choice,
                 c->n_tokens[choice], n_ref);
    for (int i = 0; i < n_ref; i++)
        cr_assert_eq(c->tokens[choice][i], ref[i], "%s: choice %d token %d is %d, the reference %d", what, choice, i,
                     c->tokens[choice][i], ref[i]);
}

/* ---- (a) one request equals the sequential reference ------------------- */

static void single_request(pd_model *m) {
    pd_scheduler_opts o;
    pd_scheduler_opts_default(&o);
    pd_scheduler *s = start(m, &o);
    pd_token prompt[24];
    make_prompt(m, 11, 24, prompt);
    pd_token ref[MAXT];

    /* greedy */
    pd_sampler_params sp = greedy();
    pd_sched_params p = params(prompt, 24, &sp, 40);
    int n_ref = reference(m, NULL, prompt, 24, &sp, &p.gen, ref);
    collector c;
    col_init(&c);
    pd_sched_request *r = submit(s, &p, &c);
    col_wait_end(&c);
    cr_assert(c.done, "error: %s", c.error_msg);
    expect_tokens(&c, 0, ref, n_ref, "greedy");
    cr_assert_eq(c.n_started, 1);
    cr_assert_eq(c.n_choice_done, 1);
    cr_assert_eq(c.order_errors, 0);
    cr_assert_eq(c.usage.prompt_tokens, 24);
    cr_assert_eq(c.usage.completion_tokens, n_ref);
    cr_assert_eq(c.usage.cached_tokens, 0);
    cr_assert_not(c.usage.prefix_used);
    cr_assert_eq(c.finish[0], n_ref == 40 ? PD_FINISH_LENGTH : PD_FINISH_STOP);
    pd_sched_request_release(r);
    col_destroy(&c);

    /* seeded sampling, n = 3: choice i uses seed + i */
    sp = seeded(1234);
    p = params(prompt, 24, &sp, 30);
    p.n_choices = 3;
    col_init(&c);
    r = submit(s, &p, &c);
    col_wait_end(&c);
    cr_assert(c.done, "error: %s", c.error_msg);
    int64_t total = 0;
    for (int i = 0; i < 3; i++) {
        pd_sampler_params spi = seeded(1234 + (uint64_t)i);
        n_ref = reference(m, NULL, prompt, 24, &spi, &p.gen, ref);
        expect_tokens(&c, i, ref, n_ref, "seeded");
        total += n_ref;
    }
    cr_assert_eq(c.usage.completion_tokens, total);
    cr_assert_eq(c.n_choice_done, 3);
    pd_sched_request_release(r);
    col_destroy(&c);

    pd_scheduler_stats st;
    pd_scheduler_stats_get(s, &st);
    cr_assert_eq(st.completed, 2);
    cr_assert_eq(st.running, 0);
    cr_assert_eq(st.queued, 0);
    cr_assert_eq(st.kv_bytes, 0);
    pd_scheduler_free(s);
}

Test(scheduler, single_request_stories) {
    TH_REQUIRE_SHARED();
    pd_model *m = load_stories();
    single_request(m);
    pd_model_free(m);
}

Test(scheduler, single_request_generated_model) {
    pd_model *m = load_generated();
    single_request(m);
    pd_model_free(m);
}

/* ---- (b) concurrent requests under continuous batching ----------------- */

#define N_CONC 12
#define N_SUBMITTERS 4

typedef struct conc_job {
    pd_scheduler *s;
    pd_model *m;
    pd_token prompt[64];
    int64_t n_prompt;
    pd_sampler_params sp;
    int32_t max_tokens;
    collector c;
    pd_sched_request *r;
    int rc;
} conc_job;

typedef struct submitter {
    conc_job *jobs;
    int first;
} submitter;

static void *submit_thread(void *arg) {
    submitter *t = arg;
    for (int i = t->first; i < N_CONC; i += N_SUBMITTERS) {
        conc_job *j = &t->jobs[i];
        pd_sched_params p = params(j->prompt, j->n_prompt, &j->sp, j->max_tokens);
        pd_error err = {0};
        j->rc = pd_scheduler_submit(j->s, &p, sink, &j->c, &j->r, &err);
    }
    return NULL;
}

Test(scheduler, concurrent_requests_match_sequential) {
    TH_REQUIRE_SHARED();
    pd_model *m = load_stories();
    pd_scheduler_opts o;
    pd_scheduler_opts_default(&o);
    o.max_batch = 4;
    o.prefill_chunk = 24;
    pd_scheduler *s = start(m, &o);
    conc_job *jobs = calloc(N_CONC, sizeof *jobs);
    cr_assert_not_null(jobs);
    for (int i = 0; i < N_CONC; i++) {
        conc_job *j = &jobs[i];
        j->s = s;
        j->m = m;
        j->n_prompt = 5 + (i * 7) % 50;
        make_prompt(m, 100 + (uint64_t)i, j->n_prompt, j->prompt);
        j->sp = i % 3 == 0 ? greedy() : seeded(500 + (uint64_t)i);
        j->max_tokens = 8 + (i * 13) % 40;
        col_init(&j->c);
    }
    pthread_t th[N_SUBMITTERS];
    submitter sub[N_SUBMITTERS];
    for (int t = 0; t < N_SUBMITTERS; t++) {
        sub[t] = (submitter){.jobs = jobs, .first = t};
        cr_assert_eq(pthread_create(&th[t], NULL, submit_thread, &sub[t]), 0);
    }
    for (int t = 0; t < N_SUBMITTERS; t++) pthread_join(th[t], NULL);
    /* every request ends before the references run: calls on one model
     * are serialised, and the engine thread is idle only then */
    for (int i = 0; i < N_CONC; i++) {
        cr_assert_eq(jobs[i].rc, PD_OK, "request %d was refused", i);
        col_wait_end(&jobs[i].c);
    }
    pd_token ref[MAXT];
    for (int i = 0; i < N_CONC; i++) {
        conc_job *j = &jobs[i];
        cr_assert(j->c.done, "request %d: %s", i, j->c.error_msg);
        pd_generation_params gp = {.max_tokens = j->max_tokens};
        int n_ref = reference(m, NULL, j->prompt, j->n_prompt, &j->sp, &gp, ref);
        char what[32];
        snprintf(what, sizeof what, "request %d", i);
        expect_tokens(&j->c, 0, ref, n_ref, what);
        cr_assert_eq(j->c.order_errors, 0);
        pd_sched_request_release(j->r);
        col_destroy(&j->c);
    }
    pd_scheduler_stats st;
    pd_scheduler_stats_get(s, &st);
    cr_assert_eq(st.completed, N_CONC);
    cr_assert_eq(st.running, 0);
    pd_scheduler_free(s);
    free(jobs);
    pd_model_free(m);
}

/* ---- (c) chunked prefill ------------------------------------------------ */

Test(scheduler, chunked_prefill_matches_whole_prompt) {
    TH_REQUIRE_SHARED();
    pd_model *m = load_stories();
    pd_scheduler_opts o;
    pd_scheduler_opts_default(&o);
    o.prefill_chunk = 16;
    pd_scheduler *s = start(m, &o);
    pd_token prompt[100], other[37];
    make_prompt(m, 77, 100, prompt);
    make_prompt(m, 78, 37, other);
    pd_sampler_params sp = greedy();
    pd_sched_params p = params(prompt, 100, &sp, 30);
    pd_sched_params q = params(other, 37, &sp, 30);
    pd_token ref[MAXT];
    collector a, b;
    col_init(&a);
    col_init(&b);
    /* two at once, so chunks of one interleave with the other's decoding */
    pd_sched_request *ra = submit(s, &q, &b);
    pd_sched_request *rb = submit(s, &p, &a);
    col_wait_end(&a);
    col_wait_end(&b);
    cr_assert(a.done && b.done);
    int n_ref = reference(m, NULL, prompt, 100, &sp, &p.gen, ref);
    expect_tokens(&a, 0, ref, n_ref, "100-token prompt in chunks of 16");
    n_ref = reference(m, NULL, other, 37, &sp, &q.gen, ref);
    expect_tokens(&b, 0, ref, n_ref, "37-token prompt in chunks of 16");
    pd_sched_request_release(ra);
    pd_sched_request_release(rb);
    col_destroy(&a);
    col_destroy(&b);
    pd_scheduler_free(s);
    pd_model_free(m);
}

/* ---- (d) stored prefixes ------------------------------------------------ */

static const char *story =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball. She wanted to play with it, but it was too high.";

static void compress_put(pd_model *m, pd_store *st, const pd_token *tokens, int64_t n, const char *spec_text,
                         pd_prefix_info *info) {
    pd_error err = {0};
    pd_policy_spec spec;
    cr_assert_eq(pd_policy_spec_parse(spec_text, &spec, &err), PD_OK, "%s", err.msg);
    pd_kv_prefix *kv = NULL;
    cr_assert_eq(pd_compress_prefix(m, tokens, n, &spec, NULL, &kv, NULL, &err), PD_OK, "%s", err.msg);
    memset(info, 0, sizeof *info);
    pd_model_fingerprint(m, info->fingerprint);
    pd_policy_spec_print(&spec, info->spec, sizeof info->spec);
    info->dtype = PD_KV_F32;
    bool existed = true;
    cr_assert_eq(pd_store_put(st, info, tokens, n, kv, &existed, &err), PD_OK, "%s", err.msg);
    cr_assert_not(existed);
    pd_kv_prefix_free(kv);
}

static pd_store *open_store(void) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/store", tmpdir);
    pd_store_opts o;
    pd_store_opts_default(&o);
    o.dir = dir;
    o.map_size = 64ull << 20;
    pd_store *s = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_store_open(&o, &s, &err), PD_OK, "%s", err.msg);
    return s;
}

static void run_one(pd_scheduler *s, const pd_sched_params *p, collector *c) {
    col_init(c);
    pd_sched_request *r = submit(s, p, c);
    col_wait_end(c);
    cr_assert(c->done, "request failed: %s", c->error_msg);
    cr_assert_eq(c->order_errors, 0);
    pd_sched_request_release(r);
}

static void stored_prefix(bool with_hot) {
    pd_model *m = load_stories();
    const pd_hparams *hp = pd_model_hparams(m);
    pd_token prompt[256];
    int64_t n = tokenize_story(m, story, prompt, 256);
    const int64_t P = 32;
    cr_assert_gt(n, P + 8);
    pd_store *st = open_store();
    pd_prefix_info full, half;
    compress_put(m, st, prompt, P, "streaming:retention=1", &full);
    compress_put(m, st, prompt, P, "streaming:retention=0.5", &half);
    cr_assert_eq(full.kept_rows, P * hp->n_layer * hp->n_head_kv);
    cr_assert_lt(half.kept_rows, full.kept_rows);
    pd_hot *hot = NULL;
    pd_error err = {0};
    if (with_hot) cr_assert_eq(pd_hot_create(st, 64ull << 20, &hot, &err), PD_OK, "%s", err.msg);

    pd_scheduler_opts o;
    pd_scheduler_opts_default(&o);
    o.store = st;
    o.hot = hot;
    pd_scheduler *s = start(m, &o);
    pd_sampler_params sp = greedy();
    pd_sched_params p = params(prompt, n, &sp, 24);
    collector off, c;

    /* cache=off ignores the store */
    p.cache = PD_CACHE_OFF;
    run_one(s, &p, &off);
    cr_assert_eq(off.usage.cached_tokens, 0);
    cr_assert_not(off.usage.prefix_used);
    pd_token ref[MAXT];
    int n_ref = reference(m, NULL, prompt, n, &sp, &p.gen, ref);
    expect_tokens(&off, 0, ref, n_ref, "cache=off");

    /* retention 1: the prefix is the full cache, so greedy tokens agree */
    p.cache = PD_CACHE_AUTO;
    p.spec = full.spec;
    run_one(s, &p, &c);
    cr_assert(c.usage.prefix_used);
    cr_assert(c.started.prefix_used, "STARTED carries the prefix fields");
    cr_assert_eq(c.usage.cached_tokens, P);
    cr_assert_eq(memcmp(&c.usage.prefix_id, &full.id, sizeof full.id), 0);
    cr_assert_eq(c.usage.prefix_kept_rows, full.kept_rows);
    cr_assert_eq(c.usage.prefix_full_rows, P * hp->n_layer * hp->n_head_kv);
    cr_assert_str_eq(c.usage.prefix_spec, full.spec);
    expect_tokens(&c, 0, off.tokens[0], off.n_tokens[0], "retention 1 vs cache=off");
    col_destroy(&c);

    /* retention 0.5: completes, reports the kept rows; equals a reference
     * that continues the same compressed prefix */
    p.spec = half.spec;
    run_one(s, &p, &c);
    cr_assert_eq(c.usage.cached_tokens, P);
    cr_assert_eq(c.usage.prefix_kept_rows, half.kept_rows);
    cr_assert_eq(memcmp(&c.usage.prefix_id, &half.id, sizeof half.id), 0);
    pd_prefix_ref *hr = NULL;
    cr_assert_eq(pd_store_get(st, &half.id, &hr, &err), PD_OK, "%s", err.msg);
    n_ref = reference(m, pd_prefix_ref_kv(hr), prompt, n, &sp, &p.gen, ref);
    pd_prefix_ref_release(hr);
    expect_tokens(&c, 0, ref, n_ref, "retention 0.5 vs the same prefix");
    col_destroy(&c);

    /* explicit prefix_id, n = 2: both choices share the one prefix */
    p.spec = NULL;
    p.has_prefix_id = true;
    p.prefix_id = full.id;
    p.n_choices = 2;
    run_one(s, &p, &c);
    cr_assert_eq(c.usage.cached_tokens, P);
    expect_tokens(&c, 0, off.tokens[0], off.n_tokens[0], "explicit id, choice 0");
    expect_tokens(&c, 1, off.tokens[0], off.n_tokens[0], "explicit id, choice 1 (greedy)");
    col_destroy(&c);
    p.n_choices = 1;

    /* an explicit prefix the prompt does not start with is refused */
    pd_token other[64];
    memcpy(other, prompt, sizeof(pd_token) * 40);
    other[5] = other[5] == 100 ? 101 : 100;
    pd_sched_params bad = p;
    bad.prompt = other;
    bad.n_prompt = 40;
    pd_sched_request *r = NULL;
    cr_assert_eq(pd_scheduler_submit(s, &bad, sink, &c, &r, &err), PD_EINVAL);
    cr_assert_null(r);
    cr_assert(strstr(err.msg, "does not start with"), "%s", err.msg);
    /* ... and so is one that only covers the whole prompt */
    bad.prompt = prompt;
    bad.n_prompt = P;
    cr_assert_eq(pd_scheduler_submit(s, &bad, sink, &c, &r, &err), PD_EINVAL);
    /* an unknown id */
    bad.n_prompt = n;
    memset(&bad.prefix_id, 0xab, sizeof bad.prefix_id);
    cr_assert_eq(pd_scheduler_submit(s, &bad, sink, &c, &r, &err), PD_ENOTFOUND, "%s", err.msg);

    /* auto with another namespace misses */
    p.has_prefix_id = false;
    p.ns = "other";
    run_one(s, &p, &c);
    cr_assert_not(c.usage.prefix_used);
    expect_tokens(&c, 0, off.tokens[0], off.n_tokens[0], "miss");
    col_destroy(&c);

    pd_scheduler_stats stats;
    pd_scheduler_stats_get(s, &stats);
    cr_assert_eq(stats.prefix_hits, 3);
    cr_assert_eq(stats.prefix_misses, 1);
    pd_scheduler_free(s);

    col_destroy(&off);
    if (hot) {
        pd_hot_stats hs;
        pd_hot_stats_get(hot, &hs);
        cr_assert_eq(hs.in_use, 0, "every hot entry was released");
        pd_hot_free(hot);
    }
    pd_store_close(st);
    pd_model_free(m);
}

static void expect_refused(pd_scheduler *s, const pd_sched_params *p, int code, const char *needle) {
    pd_sched_request *r = NULL;
    pd_error err = {0};
    collector c;
    int rc = pd_scheduler_submit(s, p, sink, &c, &r, &err);
    cr_assert_eq(rc, code, "expected %s, got %s: %s", pd_status_name(code), pd_status_name(rc), err.msg);
    cr_assert_null(r);
    cr_assert(strstr(err.msg, needle), "message '%s' lacks '%s'", err.msg, needle);
}

/* A stored prefix whose record fails its checks is refused as the server's
 * fault (PD_EIO: a 500), not as a bad request (PD_EFORMAT would be a 400). */
Test(scheduler, a_damaged_stored_prefix_is_a_server_error) {
    TH_REQUIRE_SHARED();
    pd_model *m = load_stories();
    pd_token prompt[256];
    const int64_t n = tokenize_story(m, story, prompt, 256), P = 32;
    pd_store *st = open_store();
    pd_prefix_info info;
    compress_put(m, st, prompt, P, "streaming:retention=1", &info);
    pd_store_close(st);
    /* Flip a byte of the stored token list (the record checks it). */
    char path[1200];
    snprintf(path, sizeof path, "%s/store/data.mdb", tmpdir);
    cr_assert_gt(th_flip_in_file(path, prompt, sizeof(pd_token) * P, 4 * 7), 0, "the token list is in the data file");

    st = open_store();
    pd_scheduler_opts o;
    pd_scheduler_opts_default(&o);
    o.store = st;
    pd_scheduler *s = start(m, &o);
    pd_sampler_params sp = greedy();
    pd_sched_params p = params(prompt, n, &sp, 4);
    p.has_prefix_id = true;
    p.prefix_id = info.id;
    expect_refused(s, &p, PD_EIO, "verify --repair");
    pd_scheduler_free(s);
    pd_store_close(st);
    pd_model_free(m);
}

Test(scheduler, stored_prefix_from_store) {
    TH_REQUIRE_SHARED();
    stored_prefix(false);
}

Test(scheduler, stored_prefix_through_hot_tier) {
    TH_REQUIRE_SHARED();
    stored_prefix(true);
}

/* ---- (e) cancellation and release --------------------------------------- */

Test(scheduler, cancel_frees_the_slot) {
    pd_model *m = load_generated();
    pd_scheduler_opts o;
    pd_scheduler_opts_default(&o);
    o.max_batch = 1;
    pd_scheduler *s = start(m, &o);
    pd_token pa[10], pb[12], pc[9];
    make_prompt(m, 1, 10, pa);
    make_prompt(m, 2, 12, pb);
    make_prompt(m, 3, 9, pc);
    pd_sampler_params sp = greedy();
    pd_sched_params p = params(pa, 10, &sp, 200);
    p.gen.ignore_eos = true;
    collector a, b, c;
    col_init(&a);
    col_init(&b);
    col_init(&c);
    a.block_at = 3;
    pd_sched_request *ra = submit(s, &p, &a);
    col_wait_reached(&a); /* A runs and is held inside its third token */
    pd_sched_params q = params(pb, 12, &sp, 20);
    pd_sched_request *rb = submit(s, &q, &b);
    pd_sched_params qc = params(pc, 9, &sp, 20);
    pd_sched_request *rc = submit(s, &qc, &c);
    pd_scheduler_stats st;
    pd_scheduler_stats_get(s, &st);
    cr_assert_eq(st.running, 1);
    cr_assert_eq(st.queued, 2);
    pd_sched_request_cancel(rc); /* queued: never starts */
    pd_sched_request_cancel(ra); /* running: its slot goes to B */
    col_go(&a);
    col_wait_end(&a);
    col_wait_end(&b);
    col_wait_end(&c);
    cr_assert(a.error);
    cr_assert_eq(a.error_code, PD_EINVAL);
    cr_assert_str_eq(a.error_msg, "cancelled");
    cr_assert_geq(a.total_tokens, 3);
    cr_assert_lt(a.total_tokens, 200);
    cr_assert(c.error);
    cr_assert_eq(c.n_started, 0);
    cr_assert_str_eq(c.error_msg, "cancelled");
    cr_assert(b.done, "%s", b.error_msg);
    pd_token ref[MAXT];
    int n_ref = reference(m, NULL, pb, 12, &sp, &q.gen, ref);
    expect_tokens(&b, 0, ref, n_ref, "the request after a cancelled one");
    pd_scheduler_stats_get(s, &st);
    cr_assert_eq(st.cancelled, 2);
    cr_assert_eq(st.completed, 1);
    cr_assert_eq(st.running, 0);
    cr_assert_eq(st.queued, 0);
    pd_sched_request_release(ra);
    pd_sched_request_release(rb);
    pd_sched_request_release(rc);
    pd_scheduler_free(s);
    col_destroy(&a);
    col_destroy(&b);
    col_destroy(&c);
    pd_model_free(m);
}

Test(scheduler, release_without_waiting_delivers_nothing_after) {
    pd_model *m = load_generated();
    pd_scheduler_opts o;
    pd_scheduler_opts_default(&o);
    pd_scheduler *s = start(m, &o);
    pd_token pa[10];
    make_prompt(m, 5, 10, pa);
    pd_sampler_params sp = greedy();
    pd_sched_params p = params(pa, 10, &sp, 200);
    p.gen.ignore_eos = true;
    collector a, b, d;
    col_init(&a);
    col_init(&b);
    col_init(&d);
    /* released mid-generation, racing with the engine */
    a.block_at = 2;
    pd_sched_request *ra = submit(s, &p, &a);
    col_wait_reached(&a);
    col_go(&a);
    pd_sched_request_release(ra);
    pthread_mutex_lock(&a.mu);
    a.release_returned = true;
    pthread_mutex_unlock(&a.mu);
    /* released right after submit */
    pd_sched_request *rd = submit(s, &p, &d);
    pd_sched_request_release(rd);
    pthread_mutex_lock(&d.mu);
    d.release_returned = true;
    pthread_mutex_unlock(&d.mu);
    /* a later request runs to the end, after both were dropped */
    pd_sched_params q = params(pa, 10, &sp, 50);
    pd_sched_request *rb = submit(s, &q, &b);
    col_wait_end(&b);
    cr_assert(b.done);
    pd_sched_request_release(rb);
    pd_scheduler_free(s); /* joins: nothing can be delivered later */
    cr_assert_eq(a.events_after_release, 0);
    cr_assert_eq(d.events_after_release, 0);
    cr_assert_not(a.error, "a released request gets no ERROR");
    cr_assert_not(d.error);
    cr_assert_eq(a.order_errors + b.order_errors + d.order_errors, 0);
    col_destroy(&a);
    col_destroy(&b);
    col_destroy(&d);
    pd_model_free(m);
}

/* ---- (f) validation and a full queue ------------------------------------ */


Test(scheduler, validation) {
    pd_model *m = load_generated();
    int32_t n_ctx = pd_model_hparams(m)->n_ctx_train;
    pd_scheduler_opts o;
    pd_scheduler_opts_default(&o);
    o.max_batch = 4;
    pd_scheduler *s = start(m, &o);
    pd_token *prompt = calloc((size_t)n_ctx + 1, sizeof *prompt);
    cr_assert_not_null(prompt);
    make_prompt(m, 9, n_ctx + 1, prompt);
    pd_sampler_params sp = greedy();
    pd_sched_params p = params(prompt, n_ctx, &sp, 1);
    expect_refused(s, &p, PD_ERANGE, "the context holds");
    p = params(prompt, n_ctx - 10, &sp, 11);
    expect_refused(s, &p, PD_ERANGE, "max_tokens (11)");
    p = params(prompt, 0, &sp, 4);
    expect_refused(s, &p, PD_EINVAL, "empty");
    p = params(prompt, 10, &sp, 0);
    expect_refused(s, &p, PD_ERANGE, "max_tokens");
    pd_sampler_params bad = greedy();
    bad.temperature = -1.0f;
    p = params(prompt, 10, &bad, 4);
    expect_refused(s, &p, PD_EINVAL, "temperature");
    bad = greedy();
    bad.top_p = 0.0f;
    p = params(prompt, 10, &bad, 4);
    expect_refused(s, &p, PD_EINVAL, "top_p");
    p = params(prompt, 10, &sp, 4);
    p.n_choices = 0;
    expect_refused(s, &p, PD_ERANGE, "n must be");
    p.n_choices = 17;
    expect_refused(s, &p, PD_ERANGE, "n must be");
    p.n_choices = 5;
    expect_refused(s, &p, PD_ERANGE, "batch of 4");
    p.n_choices = 1;
    prompt[3] = pd_model_hparams(m)->n_vocab;
    expect_refused(s, &p, PD_EINVAL, "prompt token 3");
    make_prompt(m, 9, 10, prompt);
    const char *stops[] = {""};
    p.gen.stop = stops;
    p.gen.n_stop = 1;
    expect_refused(s, &p, PD_EINVAL, "stop");
    p.gen.stop = NULL;
    p.gen.n_stop = 0;
    p.has_prefix_id = true;
    expect_refused(s, &p, PD_EINVAL, "no prefix store");
    pd_scheduler_stats st;
    pd_scheduler_stats_get(s, &st);
    cr_assert_eq(st.queued + st.running + st.completed + st.failed, 0);
    pd_scheduler_free(s);

    /* bad options */
    pd_scheduler *none = NULL;
    pd_error err = {0};
    o.max_batch = 0;
    cr_assert_eq(pd_scheduler_create(m, &o, &none, &err), PD_ERANGE);
    pd_scheduler_opts_default(&o);
    o.n_ctx = n_ctx + 1;
    cr_assert_eq(pd_scheduler_create(m, &o, &none, &err), PD_ERANGE);
    cr_assert_null(none);
    free(prompt);
    pd_model_free(m);
}

Test(scheduler, queue_full) {
    pd_model *m = load_generated();
    pd_scheduler_opts o;
    pd_scheduler_opts_default(&o);
    o.max_batch = 1;
    o.max_queue = 2;
    pd_scheduler *s = start(m, &o);
    pd_token prompt[8];
    make_prompt(m, 4, 8, prompt);
    pd_sampler_params sp = greedy();
    pd_sched_params p = params(prompt, 8, &sp, 5);
    collector c[4];
    for (int i = 0; i < 4; i++) col_init(&c[i]);
    c[0].block_at = 1;
    pd_sched_request *r[4] = {0};
    r[0] = submit(s, &p, &c[0]);
    col_wait_reached(&c[0]); /* running, so out of the queue */
    r[1] = submit(s, &p, &c[1]);
    r[2] = submit(s, &p, &c[2]);
    expect_refused(s, &p, PD_EBUSY, "queue is full");
    col_go(&c[0]);
    for (int i = 0; i < 3; i++) {
        col_wait_end(&c[i]);
        cr_assert(c[i].done, "%d: %s", i, c[i].error_msg);
        expect_tokens(&c[i], 0, c[0].tokens[0], c[0].n_tokens[0], "same request");
        pd_sched_request_release(r[i]);
    }
    /* room again */
    r[3] = submit(s, &p, &c[3]);
    col_wait_end(&c[3]);
    cr_assert(c[3].done);
    pd_sched_request_release(r[3]);
    pd_scheduler_free(s);
    for (int i = 0; i < 4; i++) col_destroy(&c[i]);
    pd_model_free(m);
}

/* ---- (g) shutdown with requests in flight ------------------------------- */

typedef struct freer {
    pd_scheduler *s;
} freer;

static void *free_thread(void *arg) {
    pd_scheduler_free(((freer *)arg)->s);
    return NULL;
}

static void ignore_sink(void *ctx, const pd_sched_event *ev) {
    (void)ctx;
    (void)ev;
}

Test(scheduler, free_ends_requests_in_flight) {
    pd_model *m = load_generated();
    pd_scheduler_opts o;
    pd_scheduler_opts_default(&o);
    o.max_batch = 1;
    o.max_queue = 1000000;
    pd_scheduler *s = start(m, &o);
    pd_token prompt[8];
    make_prompt(m, 6, 8, prompt);
    pd_sampler_params sp = greedy();
    pd_sched_params p = params(prompt, 8, &sp, 100);
    p.gen.ignore_eos = true;
    collector c[3];
    pd_sched_request *r[3];
    for (int i = 0; i < 3; i++) col_init(&c[i]);
    c[0].block_at = 1;
    r[0] = submit(s, &p, &c[0]);
    col_wait_reached(&c[0]);
    r[1] = submit(s, &p, &c[1]);
    r[2] = submit(s, &p, &c[2]);
    /* free on another thread; A is held in its sink, so the engine cannot
     * move until we know shutdown began: submit is refused from then on */
    freer f = {.s = s};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, free_thread, &f), 0);
    for (;;) {
        pd_sched_request *probe = NULL;
        pd_error err = {0};
        pd_sched_params pp = params(prompt, 8, &sp, 1);
        int rc = pd_scheduler_submit(s, &pp, ignore_sink, NULL, &probe, &err);
        if (rc == PD_OK) {
            pd_sched_request_release(probe);
            sched_yield();
            continue;
        }
        cr_assert_eq(rc, PD_EUNAVAILABLE, "a submit during shutdown is 'unavailable' (503), not a bad request: %s",
                     err.msg);
        cr_assert(strstr(err.msg, "shutting down"), "%s", err.msg);
        break;
    }
    col_go(&c[0]);
    pthread_join(th, NULL);
    for (int i = 0; i < 3; i++) {
        cr_assert(c[i].error, "request %d was ended", i);
        cr_assert_not(c[i].done);
        cr_assert_eq(c[i].error_code, PD_EUNAVAILABLE, "%s", c[i].error_msg);
        cr_assert(strstr(c[i].error_msg, "shut down"), "%s", c[i].error_msg);
        cr_assert_eq(c[i].order_errors, 0);
        pd_sched_request_release(r[i]); /* after free: still safe */
        col_destroy(&c[i]);
    }
    cr_assert_eq(c[1].n_started, 0);
    pd_model_free(m);
}

/* ---- metrics ------------------------------------------------------------ */

Test(scheduler, metrics_are_updated) {
    pd_model *m = load_generated();
    pd_metrics *mx = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_metrics_create(&mx, &err), PD_OK, "%s", err.msg);
    pd_scheduler_opts o;
    pd_scheduler_opts_default(&o);
    o.metrics = mx;
    pd_scheduler *s = start(m, &o);
    pd_token prompt[8];
    make_prompt(m, 8, 8, prompt);
    pd_sampler_params sp = greedy();
    pd_sched_params p = params(prompt, 8, &sp, 6);
    p.gen.ignore_eos = true;
    collector c;
    run_one(s, &p, &c);
    col_destroy(&c);
    pd_scheduler_free(s);
    char *text = NULL;
    size_t len = 0;
    cr_assert_eq(pd_metrics_render(mx, &text, &len, &err), PD_OK, "%s", err.msg);
    cr_assert(strstr(text, "prefixd_generated_tokens_total 6"), "%s", text);
    cr_assert(strstr(text, "prefixd_prompt_tokens_total 8"), "%s", text);
    cr_assert(strstr(text, "prefixd_requests_total{outcome=\"completed\"} 1"), "%s", text);
    cr_assert(strstr(text, "prefixd_time_to_first_token_seconds_count 1"), "%s", text);
    cr_assert(strstr(text, "prefixd_time_per_output_token_seconds_count 5"), "%s", text);
    cr_assert(strstr(text, "prefixd_running_sequences 0"), "%s", text);
    free(text);
    pd_metrics_free(mx);
    pd_model_free(m);
}

/* ---- (f) the automatic prefix cache --------------------------------------- */

/* One request through the scheduler with its cached tokens and kind checked,
 * and its tokens against the sequential reference without any cache. */
static void auto_run(pd_scheduler *s, pd_model *m, const pd_token *prompt, int64_t n, const char *ns,
                     int64_t want_cached, const char *what) {
    pd_sampler_params sp = greedy();
    pd_sched_params p = params(prompt, n, &sp, 24);
    p.ns = ns;
    collector c;
    run_one(s, &p, &c);
    cr_assert_eq(c.usage.cached_tokens, want_cached, "%s: %lld cached tokens, expected %lld", what,
                 (long long)c.usage.cached_tokens, (long long)want_cached);
    cr_assert_eq(c.usage.prefix_used, want_cached > 0, "%s", what);
    if (want_cached) {
        cr_assert_eq(c.usage.prefix_kind, PD_PREFIX_AUTO, "%s", what);
        cr_assert_eq(c.started.cached_tokens, want_cached, "%s: STARTED says it", what);
    }
    pd_token ref[MAXT];
    int n_ref = reference(m, NULL, prompt, n, &sp, &p.gen, ref);
    expect_tokens(&c, 0, ref, n_ref, what);
    col_destroy(&c);
}

static void auto_cache(pd_model *m) {
    const int64_t Bk = PD_AUTO_BLOCK_TOKENS;
    pd_scheduler_opts o;
    pd_scheduler_opts_default(&o);
    o.auto_cache_bytes = 64ull << 20;
    o.prefill_chunk = 24; /* not a multiple of the block: chunks and blocks do not line up */
    pd_metrics *mx = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_metrics_create(&mx, &err), PD_OK, "%s", err.msg);
    o.metrics = mx;
    pd_scheduler *s = start(m, &o);
    pd_token prompt[200], longer[200], diverged[200];
    make_prompt(m, 91, 200, prompt);
    memcpy(longer, prompt, sizeof longer);
    memcpy(diverged, prompt, sizeof diverged);
    diverged[2 * Bk + 5] = diverged[2 * Bk + 5] == 7 ? 8 : 7; /* inside block 2 */

    auto_run(s, m, prompt, 100, NULL, 0, "first time");
    pd_scheduler_stats st;
    pd_scheduler_stats_get(s, &st);
    cr_assert_eq(st.auto_misses, 1);
    cr_assert_eq(st.auto_entries, 100 / Bk, "every whole block of the prompt is kept");
    auto_run(s, m, prompt, 100, NULL, 96, "the same prompt again");
    /* at most n - 1 tokens come from the cache: a prompt that ends with a
     * cached block takes all of its rows but the last */
    auto_run(s, m, prompt, 97, NULL, 96, "n - 1 tokens in whole blocks");
    auto_run(s, m, prompt, 96, NULL, 95, "the last token is always computed");
    auto_run(s, m, longer, 150, NULL, 96, "a prompt that extends a cached one");
    pd_scheduler_stats_get(s, &st);
    cr_assert_eq(st.auto_entries, 150 / Bk, "the extension's blocks were added");
    auto_run(s, m, longer, 150, NULL, 144, "the extension again");
    auto_run(s, m, diverged, 120, NULL, 2 * Bk, "a prompt that diverges inside block 2");
    auto_run(s, m, diverged, 120, NULL, 112, "the diverged prompt's own blocks");
    auto_run(s, m, prompt, 100, "tenant", 0, "another namespace shares nothing");
    auto_run(s, m, prompt, 100, "tenant", 96, "its own blocks");
    auto_run(s, m, prompt, Bk, NULL, Bk - 1, "a prompt of one block uses all but its last token");
    auto_run(s, m, prompt, Bk - 1, NULL, 0, "a prompt shorter than a block cannot match");

    /* cache off: nothing used */
    pd_sampler_params sp = greedy();
    pd_sched_params p = params(prompt, 100, &sp, 24);
    p.cache = PD_CACHE_OFF;
    collector c;
    run_one(s, &p, &c);
    cr_assert_eq(c.usage.cached_tokens, 0);
    cr_assert_not(c.usage.prefix_used);
    col_destroy(&c);

    /* n = 3 sampled choices from cached blocks equal the same without them */
    pd_sampler_params ss = seeded(5);
    p = params(prompt, 100, &ss, 20);
    p.n_choices = 3;
    p.cache = PD_CACHE_OFF;
    collector off;
    run_one(s, &p, &off);
    p.cache = PD_CACHE_AUTO;
    run_one(s, &p, &c);
    cr_assert_eq(c.usage.cached_tokens, 96);
    for (int i = 0; i < 3; i++) expect_tokens(&c, i, off.tokens[i], off.n_tokens[i], "sampled choice");
    col_destroy(&c);
    col_destroy(&off);

    pd_scheduler_stats_get(s, &st);
    cr_assert_eq(st.auto_hits, 10);
    cr_assert_eq(st.auto_misses, 2);
    char *text = NULL;
    size_t len = 0;
    cr_assert_eq(pd_metrics_render(mx, &text, &len, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(th_metric(text, "prefixd_auto_cache_hits_total"), 10.0);
    cr_assert_eq(th_metric(text, "prefixd_auto_cache_misses_total"), 2.0);
    cr_assert_eq(th_metric(text, "prefixd_auto_cache_entries"), (double)st.auto_entries);
    cr_assert_eq(th_metric(text, "prefixd_auto_cache_bytes"), (double)st.auto_bytes);
    cr_assert_eq(th_metric(text, "prefixd_auto_cache_evictions_total"), 0.0);
    free(text);
    pd_scheduler_free(s);
    pd_metrics_free(mx);
}

Test(scheduler, auto_cache_is_exact_stories) {
    TH_REQUIRE_SHARED();
    pd_model *m = load_stories();
    auto_cache(m);
    pd_model_free(m);
}

Test(scheduler, auto_cache_is_exact_generated_model) {
    pd_model *m = load_generated();
    auto_cache(m);
    pd_model_free(m);
}

/* A small cache evicts, and its bytes never pass the bound. */
Test(scheduler, auto_cache_evicts_within_its_bound) {
    pd_model *m = load_generated();
    pd_scheduler_opts o;
    pd_scheduler_opts_default(&o);
    const uint64_t block = pd_model_kv_token_bytes(m) * PD_AUTO_BLOCK_TOKENS;
    o.auto_cache_bytes = 10 * block; /* fewer than 10 blocks with their keys and index */
    pd_scheduler *s = start(m, &o);
    pd_token a[100], b[100];
    make_prompt(m, 3, 100, a);
    make_prompt(m, 4, 100, b);
    auto_run(s, m, a, 100, NULL, 0, "a");
    auto_run(s, m, b, 100, NULL, 0, "b pushes a's oldest blocks out");
    pd_scheduler_stats st;
    pd_scheduler_stats_get(s, &st);
    cr_assert_gt(st.auto_evictions, 0);
    cr_assert_leq(st.auto_bytes, (int64_t)o.auto_cache_bytes);
    cr_assert_lt(st.auto_entries, 10);
    const int64_t a_left = st.auto_entries - 6;
    cr_assert(a_left >= 0 && a_left < 6, "%lld of a's blocks left", (long long)a_left);
    auto_run(s, m, b, 100, NULL, 96, "b is whole");
    /* a lost its last blocks first (a chain is touched leaf first), so
     * what is left of it is its beginning, still usable */
    auto_run(s, m, a, 100, NULL, a_left * PD_AUTO_BLOCK_TOKENS, "a keeps its beginning");
    pd_scheduler_free(s);
    pd_model_free(m);
}

/* A stored prefix and automatic blocks: the longer match wins, the stored
 * one on a tie, and KV computed after a stored prefix is never cached. */
Test(scheduler, auto_cache_and_stored_prefix_longer_wins) {
    TH_REQUIRE_SHARED();
    pd_model *m = load_stories();
    pd_token prompt[256];
    int64_t n = tokenize_story(m, story, prompt, 256);
    const int64_t P = 32;
    cr_assert_gt(n, 3 * PD_AUTO_BLOCK_TOKENS + 2);
    pd_store *st = open_store();
    pd_prefix_info half;
    compress_put(m, st, prompt, P, "streaming:retention=0.5", &half);
    pd_scheduler_opts o;
    pd_scheduler_opts_default(&o);
    o.store = st;
    o.auto_cache_bytes = 64ull << 20;
    pd_scheduler *s = start(m, &o);
    pd_sampler_params sp = greedy();
    pd_sched_params p = params(prompt, n, &sp, 16);
    collector c;

    /* only the stored prefix matches; what follows it is not cached */
    run_one(s, &p, &c);
    cr_assert(c.usage.prefix_used);
    cr_assert_eq(c.usage.prefix_kind, PD_PREFIX_REGISTERED);
    cr_assert_eq(c.usage.cached_tokens, P);
    col_destroy(&c);
    pd_scheduler_stats stats;
    pd_scheduler_stats_get(s, &stats);
    cr_assert_eq(stats.auto_entries, 0, "rows after a compressed prefix are not exact: not cached");
    /* an exact run (cache off) leaves its blocks */
    p.cache = PD_CACHE_OFF;
    run_one(s, &p, &c);
    col_destroy(&c);
    p.cache = PD_CACHE_AUTO;
    /* now the blocks cover more than the stored prefix: they win */
    run_one(s, &p, &c);
    cr_assert_eq(c.usage.prefix_kind, PD_PREFIX_AUTO);
    const int64_t whole = n / PD_AUTO_BLOCK_TOKENS * PD_AUTO_BLOCK_TOKENS;
    cr_assert_eq(c.usage.cached_tokens, whole < n - 1 ? whole : n - 1);
    col_destroy(&c);
    /* a prompt whose blocks cover exactly the stored prefix: a tie, stored wins */
    p.n_prompt = P + 1;
    run_one(s, &p, &c);
    cr_assert_eq(c.usage.prefix_kind, PD_PREFIX_REGISTERED);
    cr_assert_eq(c.usage.cached_tokens, P);
    col_destroy(&c);
    /* an explicit prefix_id is used as asked, blocks or not */
    p.n_prompt = n;
    p.has_prefix_id = true;
    p.prefix_id = half.id;
    run_one(s, &p, &c);
    cr_assert_eq(c.usage.prefix_kind, PD_PREFIX_REGISTERED);
    cr_assert_eq(c.usage.cached_tokens, P);
    col_destroy(&c);
    pd_scheduler_free(s);
    pd_store_close(st);
    pd_model_free(m);
}
