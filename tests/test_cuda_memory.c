/* The CUDA backend's memory on the serving path (docs/gpu.md, Memory): the
 * caching allocator, the pinned upload ring, pinned logits, and the device
 * KV pool, checked through pd_backend_counters: once the pool is reserved,
 * serving allocates nothing from the driver, copies nothing unstaged, and a
 * batched decode step brings its logits down in one copy. Results are
 * compared with the CPU backend's. Every test skips without a CUDA device
 * (cudaemu provides one in CI). */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/daemon.h"
#include "engine/engine.h"
#include "helpers.h"
#include "kernels/kernels.h"

#define REQUIRE_CUDA()                                                                                         \
    do {                                                                                                       \
        if (pd_cuda_device_count() == 0)                                                                       \
            cr_skip_test("no CUDA device: memory paths not checked (compiled in: %s)",                         \
                         pd_cuda_compiled() ? "yes" : "no");                                                   \
    } while (0)

static pd_backend *cuda_backend(void) {
    pd_backend *be = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_backend_cuda_create(0, &be, &err), PD_OK, "%s", err.msg);
    return be;
}

static pd_backend_counters counters(const pd_backend *be) {
    pd_backend_counters c;
    pd_backend_counters_get(be, &c);
    return c;
}

/* ---- caching allocator ---------------------------------------------------- */

Test(cuda_memory, released_blocks_are_reused_without_the_driver) {
    REQUIRE_CUDA();
    pd_backend *be = cuda_backend();
    pd_error err = {0};
    const pd_backend_counters c0 = counters(be);
    void *a = pd_backend_alloc(be, 1 << 20, &err);
    cr_assert_not_null(a, "%s", err.msg);
    cr_assert_eq(counters(be).device_allocs, c0.device_allocs + 1);
    pd_backend_release(be, a);
    pd_backend_counters c1 = counters(be);
    cr_assert_eq(c1.device_frees, c0.device_frees, "release went to the driver");
    cr_assert_eq(c1.syncs, c0.syncs, "release waited for the stream");

    /* A slightly smaller request takes the cached block. */
    void *b = pd_backend_alloc(be, (1 << 20) - 1000, &err);
    cr_assert_eq(b, a, "the cached block was not reused");
    cr_assert_eq(counters(be).device_allocs, c0.device_allocs + 1);
    pd_backend_release(be, b);
    /* Less than half of it does not pin the big block; more than it cannot use it. */
    void *small = pd_backend_alloc(be, 4096, &err);
    void *big = pd_backend_alloc(be, 3 << 20, &err);
    cr_assert(small && big && small != a && big != a);
    cr_assert_eq(counters(be).device_allocs, c0.device_allocs + 3);

    /* A block reused right after release holds what work queued after it wrote. */
    float host[256], back[256];
    for (int i = 0; i < 256; i++) host[i] = (float)i;
    cr_assert_eq(pd_backend_upload(be, big, host, sizeof host, &err), PD_OK, "%s", err.msg);
    pd_backend_release(be, big);
    void *again = pd_backend_alloc(be, 3 << 20, &err);
    cr_assert_eq(again, big);
    for (int i = 0; i < 256; i++) host[i] = (float)(1000 - i);
    cr_assert_eq(pd_backend_upload(be, again, host, sizeof host, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_backend_download(be, back, again, sizeof back, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(memcmp(back, host, sizeof host), 0);
    pd_backend_release(be, again);
    pd_backend_release(be, small);
    pd_backend_free(be);
}

Test(cuda_memory, out_of_memory_gives_the_cache_back_and_retries) {
    REQUIRE_CUDA();
    pd_backend *be = cuda_backend();
    pd_error err = {0};
    uint64_t free_b = 0, total_b = 0;
    cr_assert_eq(pd_backend_memory(be, &free_b, &total_b, &err), PD_OK, "%s", err.msg);
    cr_assert_gt(total_b, 0);
    void *blocks[3];
    for (int i = 0; i < 3; i++) cr_assert_not_null(blocks[i] = pd_backend_alloc(be, (size_t)(i + 1) << 20, &err));
    for (int i = 0; i < 3; i++) pd_backend_release(be, blocks[i]);
    uint64_t free_cached = 0;
    cr_assert_eq(pd_backend_memory(be, &free_cached, &total_b, &err), PD_OK, "%s", err.msg);
    const pd_backend_counters c0 = counters(be);
    /* More than the device has: the driver refuses, the cache is given back
     * (three cudaFree after one sync) and the retry is refused too. */
    void *huge = pd_backend_alloc(be, (size_t)total_b + ((size_t)1 << 30), &err);
    cr_assert_null(huge);
    cr_assert_eq(err.code, PD_ENOMEM, "%s", err.msg);
    cr_assert(strstr(err.msg, "out of memory"), "%s", err.msg);
    const pd_backend_counters c1 = counters(be);
    cr_assert_eq(c1.device_frees, c0.device_frees + 3, "the cached blocks were not given back");
    cr_assert_geq(c1.syncs, c0.syncs + 1);
    /* The cache is empty now: the next request goes to the driver. */
    void *p = pd_backend_alloc(be, 1 << 20, &err);
    cr_assert_not_null(p, "%s", err.msg);
    cr_assert_eq(counters(be).device_allocs, c1.device_allocs + 1);
    pd_backend_release(be, p);
    pd_backend_free(be);
}

/* ---- staging ---------------------------------------------------------------- */

Test(cuda_memory, uploads_are_staged_and_never_wait) {
    REQUIRE_CUDA();
    pd_backend *be = cuda_backend();
    pd_error err = {0};
    enum { N = 300, W = 1000 }; /* 300 uploads of 4 KB: several laps of no ring, no waits expected */
    int32_t *dev = pd_backend_alloc(be, (size_t)N * W * sizeof(int32_t), &err);
    cr_assert_not_null(dev, "%s", err.msg);
    int32_t src[W];
    const pd_backend_counters c0 = counters(be);
    for (int i = 0; i < N; i++) {
        /* src is rewritten as soon as each upload returns */
        for (int j = 0; j < W; j++) src[j] = i * W + j;
        cr_assert_eq(pd_backend_upload(be, dev + (size_t)i * W, src, sizeof src, &err), PD_OK, "%s", err.msg);
    }
    const pd_backend_counters c1 = counters(be);
    cr_assert_eq(c1.uploads, c0.uploads + N);
    cr_assert_eq(c1.unstaged_copies, c0.unstaged_copies);
    cr_assert_eq(c1.device_allocs, c0.device_allocs);

    /* Pinned destination: one copy, one wait. */
    int32_t *back = pd_backend_host_alloc(be, (size_t)N * W * sizeof(int32_t), &err);
    cr_assert_not_null(back, "%s", err.msg);
    cr_assert_eq(pd_backend_download(be, back, dev, (size_t)N * W * sizeof(int32_t), &err), PD_OK, "%s", err.msg);
    const pd_backend_counters c2 = counters(be);
    cr_assert_eq(c2.downloads, c1.downloads + 1);
    cr_assert_eq(c2.syncs, c1.syncs + 1);
    for (int i = 0; i < N * W; i++) cr_assert_eq(back[i], i, "element %d", i);

    /* An upload larger than the ring laps it; the bytes still arrive. */
    const size_t big = (size_t)40 << 20;
    uint8_t *hb = malloc(big), *hback = malloc(big);
    uint8_t *db = pd_backend_alloc(be, big, &err);
    cr_assert(hb && hback && db);
    for (size_t i = 0; i < big; i++) hb[i] = (uint8_t)(i * 7 + (i >> 20));
    cr_assert_eq(pd_backend_upload(be, db, hb, big, &err), PD_OK, "%s", err.msg);
    memset(hb, 0, big);
    cr_assert_eq(pd_backend_download(be, hback, db, big, &err), PD_OK, "%s", err.msg);
    for (size_t i = 0; i < big; i += 4093) cr_assert_eq(hback[i], (uint8_t)(i * 7 + (i >> 20)), "byte %zu", i);
    cr_assert_eq(counters(be).unstaged_copies, c0.unstaged_copies);
    free(hb);
    free(hback);
    pd_backend_release(be, db);
    pd_backend_host_free(be, back);
    pd_backend_release(be, dev);
    pd_backend_free(be);
}

/* ---- the KV pool in the engine -------------------------------------------- */

typedef struct pair {
    pd_backend *be;
    pd_model *gpu, *cpu;
} pair;

static pair load_pair(void) {
    TH_REQUIRE_SHARED();
    char path[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", path, sizeof path));
    pair p = {cuda_backend(), NULL, NULL};
    pd_error err = {0};
    pd_model_params mp = {.backend = p.be};
    cr_assert_eq(pd_model_load(path, &mp, &p.gpu, &err), PD_OK, "%s", err.msg);
    pd_model_params cp = {.n_threads = 1};
    cr_assert_eq(pd_model_load(path, &cp, &p.cpu, &err), PD_OK, "%s", err.msg);
    return p;
}

static void free_pair(pair *p) {
    pd_model_free(p->gpu);
    pd_model_free(p->cpu);
    pd_backend_free(p->be);
}

/* The largest |a - b| over n logits, relative to the range of b (NaN counts
 * as infinitely far). */
static double rel_diff(const float *a, const float *b, int64_t n) {
    double d = 0, lo = INFINITY, hi = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        const double e = fabs((double)a[i] - b[i]);
        d = isnan(e) ? INFINITY : fmax(d, e);
        lo = fmin(lo, b[i]);
        hi = fmax(hi, b[i]);
    }
    return d / (hi > lo ? hi - lo : 1.0);
}

/* Both backends compute these calls in f32 (GEMVs up to 8 rows; stories260K
 * is F32) and round K/V to f16 the same way, so logits differ by summation
 * order, plus the rare f16 rounding flip of a K/V element whose f32 values
 * differ in the last bit: ~1e-4 of the logit range after 70 positions (measured). A
 * wrong row or a stale block would be off by the range itself. */
#define LOGIT_TOL 2e-3

#define NSEQ 4
#define STEPS 6

/* NSEQ sequences: prefill `plen` tokens each, then STEPS batched decodes
 * on both models; logits must agree. f32 throughout on the GPU up to 8
 * tokens per call (stories260K is F32), so the bound is float rounding. */
static void run_and_compare(pair *p, int32_t n_ctx, int plen, pd_backend_counters *before_decode,
                            pd_backend_counters *after_decode, uint64_t *decode_downloads_max) {
    pd_error err = {0};
    const int64_t V = pd_model_hparams(p->gpu)->n_vocab;
    pd_seq *gs[NSEQ], *cs[NSEQ];
    float *gl = malloc(sizeof(float) * NSEQ * V), *cl = malloc(sizeof(float) * NSEQ * V);
    cr_assert(gl && cl);
    pd_token toks[NSEQ];
    for (int i = 0; i < NSEQ; i++) {
        cr_assert_eq(pd_seq_create(p->gpu, n_ctx, &gs[i], &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_seq_create(p->cpu, n_ctx, &cs[i], &err), PD_OK, "%s", err.msg);
        pd_token prompt[128];
        for (int t = 0; t < plen; t++) prompt[t] = (pd_token)(1 + (t * 37 + i * 101) % 500);
        /* in chunks of 8: f32 GEMVs on the GPU */
        for (int t = 0; t < plen; t += 8) {
            const int n = plen - t < 8 ? plen - t : 8;
            cr_assert_eq(pd_prefill(p->gpu, gs[i], prompt + t, n, NULL, gl, &err), PD_OK, "%s", err.msg);
            cr_assert_eq(pd_prefill(p->cpu, cs[i], prompt + t, n, NULL, cl, &err), PD_OK, "%s", err.msg);
        }
        const double rd = rel_diff(gl, cl, V);
        cr_assert_lt(rd, LOGIT_TOL, "prefill logits of sequence %d differ by %g of the range", i, rd);
        toks[i] = (pd_token)(2 + i);
    }
    pd_backend_counters_get(p->be, before_decode);
    *decode_downloads_max = 0;
    for (int s = 0; s < STEPS; s++) {
        pd_backend_counters c0;
        pd_backend_counters_get(p->be, &c0);
        cr_assert_eq(pd_decode(p->gpu, gs, toks, NSEQ, gl, &err), PD_OK, "%s", err.msg);
        pd_backend_counters c1;
        pd_backend_counters_get(p->be, &c1);
        const uint64_t dl = c1.downloads - c0.downloads;
        if (dl > *decode_downloads_max) *decode_downloads_max = dl;
        cr_assert_eq(pd_decode(p->cpu, cs, toks, NSEQ, cl, &err), PD_OK, "%s", err.msg);
        for (int i = 0; i < NSEQ; i++) {
            const double rd = rel_diff(gl + i * V, cl + i * V, V);
            cr_assert_lt(rd, LOGIT_TOL, "step %d, sequence %d: logits differ by %g of the range", s, i, rd);
            /* greedy on the CPU's logits, so both feed the same token */
            int64_t best = 0;
            for (int64_t v = 1; v < V; v++)
                if (cl[i * V + v] > cl[i * V + best]) best = v;
            toks[i] = (pd_token)best;
        }
    }
    pd_backend_counters_get(p->be, after_decode);
    for (int i = 0; i < NSEQ; i++) {
        pd_seq_free(gs[i]);
        pd_seq_free(cs[i]);
    }
    free(gl);
    free(cl);
}

Test(cuda_memory, pooled_sequences_allocate_nothing_and_match_the_cpu) {
    REQUIRE_CUDA();
    pair p = load_pair();
    pd_error err = {0};
    const int32_t n_ctx = 256;
    cr_assert_eq(pd_model_reserve_kv(p.gpu, NSEQ, n_ctx, 16, &err), PD_OK, "%s", err.msg);
    pd_kv_pool_stats st;
    pd_model_kv_pool_stats(p.gpu, &st);
    cr_assert_eq(st.slabs, NSEQ);
    cr_assert_eq(st.slabs_free, NSEQ);
    cr_assert_eq(st.rows, n_ctx);
    /* The CPU model has no pool: a no-op there. */
    cr_assert_eq(pd_model_reserve_kv(p.cpu, NSEQ, n_ctx, 16, &err), PD_OK, "%s", err.msg);
    pd_model_kv_pool_stats(p.cpu, &st);
    cr_assert_eq(st.slabs, 0);

    const pd_backend_counters start = counters(p.be);
    pd_backend_counters before, after;
    uint64_t dl_max;
    run_and_compare(&p, n_ctx, 20, &before, &after, &dl_max);
    cr_assert_eq(after.device_allocs, start.device_allocs, "serving allocated %llu blocks from the driver",
                 (unsigned long long)(after.device_allocs - start.device_allocs));
    cr_assert_eq(after.device_frees, start.device_frees);
    cr_assert_eq(after.unstaged_copies, start.unstaged_copies);
    cr_assert_eq(dl_max, 1, "a batched decode step took %llu downloads", (unsigned long long)dl_max);
    pd_model_kv_pool_stats(p.gpu, &st);
    cr_assert_eq(st.slabs_free, NSEQ, "every slab is back");
    cr_assert_eq(st.no_slab, 0);
    cr_assert_eq(st.outgrown, 0);
    free_pair(&p);
}

Test(cuda_memory, sequences_beyond_the_pool_grow_and_still_match) {
    REQUIRE_CUDA();
    pair p = load_pair();
    pd_error err = {0};
    /* Two slabs of 16 rows for four sequences of 256 positions: two find
     * no slab, and the two that do outgrow it at 16 + 1 rows, then grow
     * by doubling (the other two start at 64 rows). 28 prompt rows and 6
     * decode steps: the second growth, past 32 rows, is in a decode step,
     * before its graph is recorded. */
    cr_assert_eq(pd_model_reserve_kv(p.gpu, 2, 16, 0, &err), PD_OK, "%s", err.msg);
    pd_backend_counters before, after;
    uint64_t dl_max;
    run_and_compare(&p, 256, 28, &before, &after, &dl_max);
    pd_kv_pool_stats st;
    pd_model_kv_pool_stats(p.gpu, &st);
    const pd_hparams *hp = pd_model_hparams(p.gpu);
    cr_assert_eq(st.no_slab, NSEQ - 2);
    cr_assert_eq(st.outgrown, 2u * (uint64_t)hp->n_layer * (uint64_t)hp->n_head_kv);
    cr_assert_eq(st.slabs_free, 2);
    free_pair(&p);
}

/* ---- the scheduler reserves the pool --------------------------------------- */

typedef struct waiter {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool end, error;
    int n_tokens;
    pd_token tokens[64];
} waiter;

static void sink(void *ctx, const pd_sched_event *ev) {
    waiter *w = ctx;
    pthread_mutex_lock(&w->mu);
    if (ev->kind == PD_SCHED_TOKEN && w->n_tokens < 64) w->tokens[w->n_tokens++] = ev->sample->token;
    if (ev->kind == PD_SCHED_DONE || ev->kind == PD_SCHED_ERROR) {
        w->end = true;
        w->error = ev->kind == PD_SCHED_ERROR;
    }
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

#define NREQ 5
#define GEN 12

/* NREQ greedy requests at once on a scheduler over m; tokens[i] gets
 * request i's output. */
static void serve(pd_model *m, pd_token tokens[NREQ][64], int n_tokens[NREQ], pd_backend *be,
                  pd_backend_counters *after_create, pd_backend_counters *after_serve) {
    pd_scheduler_opts o;
    pd_scheduler_opts_default(&o);
    o.max_batch = 4;
    o.n_ctx = 128;
    o.prefill_chunk = 8; /* f32 GEMVs on the GPU: results equal the CPU's to rounding */
    pd_scheduler *s = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_scheduler_create(m, &o, &s, &err), PD_OK, "%s", err.msg);
    if (be) pd_backend_counters_get(be, after_create);
    waiter w[NREQ];
    pd_sched_request *r[NREQ];
    for (int i = 0; i < NREQ; i++) {
        memset(&w[i], 0, sizeof w[i]);
        pthread_mutex_init(&w[i].mu, NULL);
        pthread_cond_init(&w[i].cv, NULL);
        pd_token prompt[20];
        for (int t = 0; t < 11 + i; t++) prompt[t] = (pd_token)(1 + (t * 53 + i * 17) % 400);
        pd_sched_params p;
        memset(&p, 0, sizeof p);
        p.prompt = prompt;
        p.n_prompt = 11 + i;
        p.n_choices = 1;
        p.sampling = pd_sampler_params_default();
        p.sampling.temperature = 0.0f;
        p.gen.max_tokens = GEN;
        p.cache = PD_CACHE_OFF;
        cr_assert_eq(pd_scheduler_submit(s, &p, sink, &w[i], &r[i], &err), PD_OK, "%s", err.msg);
    }
    for (int i = 0; i < NREQ; i++) {
        pthread_mutex_lock(&w[i].mu);
        while (!w[i].end) pthread_cond_wait(&w[i].cv, &w[i].mu);
        pthread_mutex_unlock(&w[i].mu);
        cr_assert_not(w[i].error, "request %d failed", i);
        n_tokens[i] = w[i].n_tokens;
        memcpy(tokens[i], w[i].tokens, sizeof w[i].tokens);
        pd_sched_request_release(r[i]);
        pthread_cond_destroy(&w[i].cv);
        pthread_mutex_destroy(&w[i].mu);
    }
    if (be) pd_backend_counters_get(be, after_serve);
    pd_scheduler_free(s);
}

Test(cuda_memory, scheduler_serves_from_the_pool_without_driver_allocations) {
    REQUIRE_CUDA();
    pair p = load_pair();
    pd_token gt[NREQ][64], ct[NREQ][64];
    int gn[NREQ], cn[NREQ];
    pd_backend_counters created, served;
    serve(p.gpu, gt, gn, p.be, &created, &served);
    cr_assert_eq(served.device_allocs, created.device_allocs, "serving allocated %llu blocks from the driver",
                 (unsigned long long)(served.device_allocs - created.device_allocs));
    cr_assert_eq(served.device_frees, created.device_frees);
    cr_assert_eq(served.unstaged_copies, created.unstaged_copies);
    cr_assert_gt(served.downloads, created.downloads);
    pd_kv_pool_stats st;
    pd_model_kv_pool_stats(p.gpu, &st);
    cr_assert_eq(st.slabs, 4);
    cr_assert_eq(st.no_slab, 0);
    cr_assert_eq(st.outgrown, 0);
    serve(p.cpu, ct, cn, NULL, NULL, NULL);
    for (int i = 0; i < NREQ; i++) {
        cr_assert_eq(gn[i], cn[i], "request %d: %d tokens on the GPU, %d on the CPU", i, gn[i], cn[i]);
        for (int t = 0; t < gn[i]; t++)
            cr_assert_eq(gt[i][t], ct[i][t], "request %d token %d: GPU %d, CPU %d", i, t, gt[i][t], ct[i][t]);
    }
    free_pair(&p);
}

/* ---- decode steps as CUDA graphs (docs/gpu.md, CUDA graphs) ----------------- */

/* The same model twice on two backends, one recording decode steps as
 * graphs (the default), one op by op. */
typedef struct graph_pair {
    pd_backend *be_graph, *be_ops;
    pd_model *graph, *ops;
} graph_pair;

static graph_pair load_graph_pair(void) {
    TH_REQUIRE_SHARED();
    char path[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", path, sizeof path));
    graph_pair g = {cuda_backend(), cuda_backend(), NULL, NULL};
    pd_error err = {0};
    pd_model_params gp = {.backend = g.be_graph}, op = {.backend = g.be_ops, .no_graphs = true};
    cr_assert_eq(pd_model_load(path, &gp, &g.graph, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_model_load(path, &op, &g.ops, &err), PD_OK, "%s", err.msg);
    return g;
}

static void free_graph_pair(graph_pair *g) {
    pd_model_free(g->graph);
    pd_model_free(g->ops);
    pd_backend_free(g->be_graph);
    pd_backend_free(g->be_ops);
}

#define GSEQ 5

/* Decode steps over batches of the sizes in `sizes` (sequences 0..size-1,
 * each prefilled with its own prompt first), on both models: the logits
 * must be the same bits. A graph replays exactly the kernels the ops would
 * launch, with the same arguments, so any difference is a graph that ran
 * stale parameters or read an upload after it was overwritten. */
static void decode_both(graph_pair *g, const int *sizes, int n_steps) {
    pd_error err = {0};
    const int64_t V = pd_model_hparams(g->graph)->n_vocab;
    pd_seq *gs[GSEQ], *os[GSEQ];
    float *gl = malloc(sizeof(float) * GSEQ * V), *ol = malloc(sizeof(float) * GSEQ * V);
    cr_assert(gl && ol);
    pd_token toks[GSEQ];
    for (int i = 0; i < GSEQ; i++) {
        cr_assert_eq(pd_seq_create(g->graph, 128, &gs[i], &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_seq_create(g->ops, 128, &os[i], &err), PD_OK, "%s", err.msg);
        pd_token prompt[16];
        for (int t = 0; t < 9 + i; t++) prompt[t] = (pd_token)(1 + (t * 41 + i * 97) % 500);
        cr_assert_eq(pd_prefill(g->graph, gs[i], prompt, 9 + i, NULL, gl, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_prefill(g->ops, os[i], prompt, 9 + i, NULL, ol, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(memcmp(gl, ol, sizeof(float) * V), 0, "prefill logits of sequence %d differ", i);
        toks[i] = (pd_token)(3 + i);
    }
    for (int s = 0; s < n_steps; s++) {
        const int n = sizes[s];
        cr_assert_eq(pd_decode(g->graph, gs, toks, n, gl, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_decode(g->ops, os, toks, n, ol, &err), PD_OK, "%s", err.msg);
        for (int i = 0; i < n; i++) {
            cr_assert_eq(memcmp(gl + i * V, ol + i * V, sizeof(float) * V), 0,
                         "step %d (batch %d), sequence %d: a graph's logits differ from op by op", s, n, i);
            int64_t best = 0;
            for (int64_t v = 1; v < V; v++)
                if (ol[i * V + v] > ol[i * V + best]) best = v;
            toks[i] = (pd_token)best;
        }
    }
    for (int i = 0; i < GSEQ; i++) {
        pd_seq_free(gs[i]);
        pd_seq_free(os[i]);
    }
    free(gl);
    free(ol);
}

static const int graph_sizes[] = {1, 1, 1, 3, 3, 3, 1, 5, 5, 3, 3, 1};
#define GRAPH_STEPS ((int)(sizeof graph_sizes / sizeof *graph_sizes))

Test(cuda_memory, decode_steps_as_graphs_match_op_by_op_bit_for_bit) {
    REQUIRE_CUDA();
    graph_pair g = load_graph_pair();
    const pd_backend_counters g0 = counters(g.be_graph), o0 = counters(g.be_ops);
    decode_both(&g, graph_sizes, GRAPH_STEPS);
    const pd_backend_counters g1 = counters(g.be_graph), o1 = counters(g.be_ops);
    /* The prefills (many tokens per entry) are not recorded: the graph
     * launches are the decode steps alone. */
    cr_assert_eq(g1.graph_launches - g0.graph_launches, GRAPH_STEPS, "every decode step is one graph launch");
    /* One executable per batch size, kept across steps of the same size
     * (updated in place) and across other sizes in between: 1, 3 and 5,
     * plus a rebuild wherever a step's shape changed (the attention plan
     * splits the growing context differently). */
    const uint64_t builds = g1.graph_builds - g0.graph_builds;
    cr_assert_geq(builds, 3);
    cr_assert_lt(builds, GRAPH_STEPS / 2, "%llu graphs built for %d steps: updates in place do not work",
                 (unsigned long long)builds, GRAPH_STEPS);
    cr_assert_eq(o1.graph_launches, o0.graph_launches, "no_graphs still launched graphs");
    /* The recorded work is the op-by-op work. */
    cr_assert_eq(g1.launches - g0.launches, o1.launches - o0.launches);
    cr_assert_eq(g1.device_allocs - g0.device_allocs, o1.device_allocs - o0.device_allocs);
    free_graph_pair(&g);
}

Test(cuda_memory, a_failed_recording_reruns_the_step_without_a_graph) {
    th_require_cudaemu();
    /* The third recording of the process fails as if an operation in it
     * could not be recorded: that step runs op by op, and so does every
     * later one (a recording that failed once would fail again). */
    cr_assert_eq(setenv("CUDAEMU_FAIL_CAPTURE", "3", 1), 0);
    graph_pair g = load_graph_pair();
    const pd_backend_counters g0 = counters(g.be_graph);
    static const int sizes[] = {1, 3, 3, 1, 3};
    decode_both(&g, sizes, 5);
    const pd_backend_counters g1 = counters(g.be_graph);
    cr_assert_eq(g1.graph_launches - g0.graph_launches, 2, "two steps before the failure ran as graphs");
    free_graph_pair(&g);
}
