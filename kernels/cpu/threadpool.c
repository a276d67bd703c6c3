/* A small fork-join thread pool.
 *
 * The caller is thread 0; n-1 workers wait for a job. A job is published by
 * storing fn/ctx and then bumping `generation` with release order. Every
 * index 1..n-1 of a job is claimed exactly once, by an atomic exchange of
 * claim[i] with the job's generation: normally by worker i when it sees the
 * new generation, but the caller, once its own index is done, claims and
 * runs every index whose worker has not shown up yet. So a worker that is
 * asleep or descheduled (another process on its core) delays nobody, and
 * `fn` still runs for every index exactly once. Workers that ran an index
 * bump `done` with release order; the caller waits (acquire) until every
 * index it did not run itself is done, so all writes made by `fn` are
 * visible when pd_threadpool_run returns, and no worker touches fn/ctx
 * afterwards (a late worker loses the claim and never reads them).
 *
 * Waiting: a worker spins for a short time (jobs arrive back to back during
 * a forward pass, and a futex wake costs several microseconds) and then
 * sleeps on a condition variable. The generation is re-checked under the
 * mutex before sleeping and the caller broadcasts under the same mutex after
 * bumping it, so a wake-up can never be lost. */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kernels/cpu/cpu_internal.h"
#include "kernels/kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* How long an idle worker spins before it sleeps, and how long the caller
 * spins before it starts yielding the CPU while it waits for stragglers. */
#define SPIN_NS 300000L

struct worker_arg {
    pd_threadpool *tp;
    int ith;
    /* generation for which index ith was last claimed; own cache line */
    _Alignas(64) atomic_uint claim;
};

struct pd_threadpool {
    int n_threads;
    pthread_t *threads;       /* n_threads - 1 workers */
    struct worker_arg *args;  /* one per worker (index ith - 1) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Alignas(64) atomic_uint generation; /* bumped once per job */
    _Alignas(64) atomic_int done;        /* worker-run indices finished in this job */
    atomic_bool stop;
    pd_parallel_fn fn;        /* written by the caller before the release */
    void *ctx;
};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Wait until the generation differs from `seen`; returns the new one. */
static unsigned wait_for_job(pd_threadpool *tp, unsigned seen) {
    unsigned g;
    const int64_t start = now_ns();
    for (int i = 0;; i++) {
        g = atomic_load_explicit(&tp->generation, memory_order_acquire);
        if (g != seen) return g;
        cpu_relax();
        if ((i & 255) == 255 && now_ns() - start > SPIN_NS) break;
    }
    pthread_mutex_lock(&tp->mu);
    while ((g = atomic_load_explicit(&tp->generation, memory_order_acquire)) == seen)
        pthread_cond_wait(&tp->cv, &tp->mu);
    pthread_mutex_unlock(&tp->mu);
    return g;
}

/* Claim index a->ith for job generation g: succeeds only while the claim
 * holds an older generation. A compare-exchange, not an exchange: a worker
 * that read generation g late must not take (or clobber) a claim the caller
 * already made for a newer job. */
static bool claim_index(struct worker_arg *a, unsigned g) {
    unsigned c = atomic_load_explicit(&a->claim, memory_order_relaxed);
    while ((int)(g - c) > 0) {
        if (atomic_compare_exchange_weak_explicit(&a->claim, &c, g, memory_order_acq_rel,
                                                  memory_order_relaxed))
            return true;
    }
    return false;
}

static void *worker_main(void *p) {
    struct worker_arg *a = p;
    pd_threadpool *tp = a->tp;
    unsigned seen = 0; /* the pool starts at generation 0 */
    for (;;) {
        seen = wait_for_job(tp, seen);
        if (atomic_load_explicit(&tp->stop, memory_order_acquire)) break;
        /* the caller may have run our index already */
        if (!claim_index(a, seen)) continue;
        tp->fn(tp->ctx, a->ith, tp->n_threads);
        atomic_fetch_add_explicit(&tp->done, 1, memory_order_release);
    }
    return NULL;
}

static int online_cpus(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    if (n > PD_CPU_MAX_THREADS) n = PD_CPU_MAX_THREADS;
    return (int)n;
}

int pd_threadpool_create(int n_threads, pd_threadpool **out, pd_error *err) {
    *out = NULL;
    if (n_threads <= 0) n_threads = online_cpus();
    if (n_threads > PD_CPU_MAX_THREADS)
        return pd_errorf(err, PD_ERANGE, "thread pool: %d threads requested, at most %d supported",
                         n_threads, PD_CPU_MAX_THREADS);
    /* over-aligned type: calloc's alignment is not enough */
    const size_t tp_size = (sizeof(pd_threadpool) + 63) & ~(size_t)63;
    pd_threadpool *tp = aligned_alloc(64, tp_size);
    if (!tp) return pd_errorf(err, PD_ENOMEM, "thread pool: out of memory");
    memset(tp, 0, tp_size);
    tp->n_threads = n_threads;
    atomic_init(&tp->generation, 0u);
    atomic_init(&tp->done, 0);
    atomic_init(&tp->stop, false);
    if (pthread_mutex_init(&tp->mu, NULL) != 0) {
        free(tp);
        return pd_errorf(err, PD_EIO, "thread pool: pthread_mutex_init failed");
    }
    if (pthread_cond_init(&tp->cv, NULL) != 0) {
        pthread_mutex_destroy(&tp->mu);
        free(tp);
        return pd_errorf(err, PD_EIO, "thread pool: pthread_cond_init failed");
    }
    const int nw = n_threads - 1;
    if (nw > 0) {
        tp->threads = calloc((size_t)nw, sizeof *tp->threads);
        tp->args = aligned_alloc(64, (size_t)nw * sizeof *tp->args);
        if (tp->args) memset(tp->args, 0, (size_t)nw * sizeof *tp->args);
        if (!tp->threads || !tp->args) {
            free(tp->threads);
            free(tp->args);
            pthread_cond_destroy(&tp->cv);
            pthread_mutex_destroy(&tp->mu);
            free(tp);
            return pd_errorf(err, PD_ENOMEM, "thread pool: out of memory");
        }
    }
    for (int i = 0; i < nw; i++) {
        tp->args[i].tp = tp;
        tp->args[i].ith = i + 1;
        atomic_init(&tp->args[i].claim, 0u);
        const int rc = pthread_create(&tp->threads[i], NULL, worker_main, &tp->args[i]);
        if (rc != 0) {
            tp->n_threads = i + 1; /* free() joins the ones that started */
            pd_threadpool_free(tp);
            return pd_errorf(err, PD_EIO, "thread pool: could not start worker %d of %d: %s", i + 1,
                             nw, strerror(rc));
        }
    }
    *out = tp;
    return PD_OK;
}

void pd_threadpool_free(pd_threadpool *tp) {
    if (!tp) return;
    const int nw = tp->n_threads - 1;
    if (nw > 0) {
        atomic_store_explicit(&tp->stop, true, memory_order_release);
        pthread_mutex_lock(&tp->mu);
        atomic_fetch_add_explicit(&tp->generation, 1u, memory_order_release);
        pthread_cond_broadcast(&tp->cv);
        pthread_mutex_unlock(&tp->mu);
        for (int i = 0; i < nw; i++) pthread_join(tp->threads[i], NULL);
    }
    pthread_cond_destroy(&tp->cv);
    pthread_mutex_destroy(&tp->mu);
    free(tp->threads);
    free(tp->args);
    free(tp);
}

int pd_threadpool_size(const pd_threadpool *tp) {
    return tp ? tp->n_threads : 1;
}

void pd_threadpool_run(pd_threadpool *tp, pd_parallel_fn fn, void *ctx) {
    if (!tp || tp->n_threads <= 1) {
        fn(ctx, 0, 1);
        return;
    }
    const int nth = tp->n_threads;
    tp->fn = fn;
    tp->ctx = ctx;
    atomic_store_explicit(&tp->done, 0, memory_order_relaxed);
    /* The broadcast happens under the mutex so a worker between its last
     * check of the generation and pthread_cond_wait cannot miss it. */
    pthread_mutex_lock(&tp->mu);
    const unsigned g = atomic_fetch_add_explicit(&tp->generation, 1u, memory_order_release) + 1u;
    pthread_cond_broadcast(&tp->cv);
    pthread_mutex_unlock(&tp->mu);

    fn(ctx, 0, nth);

    /* Run the indices of workers that have not started yet ourselves. */
    int by_workers = nth - 1;
    for (int i = 1; i < nth; i++) {
        if (claim_index(&tp->args[i - 1], g)) {
            fn(ctx, i, nth);
            by_workers--;
        }
    }
    const int64_t start = now_ns();
    for (int i = 0; atomic_load_explicit(&tp->done, memory_order_acquire) != by_workers; i++) {
        if ((i & 255) == 255 && now_ns() - start > SPIN_NS)
            sched_yield();
        else
            cpu_relax();
    }
}
