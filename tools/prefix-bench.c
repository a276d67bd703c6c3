/* prefix-bench: throughput of the engine on a real or generated model.
 *
 *   prefix-bench [--model FILE | --preset NAME [--type T] [--n-vocab N]]
 *                [--device D] [--threads 1,2] [--prompt 256] [--gen 64]
 *                [--reps 3] [--decode-ctx N] [--bandwidth [--bw-mib M]]
 *                [--prefix N1,N2] [--json]
 *
 * Prefill: tokens/s to run a prompt of --prompt tokens from an empty
 * sequence (logits of the last token included). Decode: tokens/s of --gen
 * single-token steps after that prompt. Each figure is the best of --reps
 * runs, after one warm-up run. On the CPU this is measured for every
 * --threads count; on a CUDA device once.
 *
 * --decode-ctx N times decode on a fresh sequence that holds N context
 * tokens (prefilled untimed) instead of after the prompt: 0 decodes from an
 * empty context, as llama-bench's tg test does (tools/bench-peer.sh).
 *
 * --bandwidth (CPU) measures, for every --threads count, the streaming-read
 * memory bandwidth of the machine (a --bw-mib buffer, default 1 GiB, or
 * 4x the L3 when less memory is free, read by that many threads with
 * AVX2/plain loads, best of BW_PASSES passes) and reports decode against it:
 * bytes of weights one decode step reads (every matrix as stored in the
 * file, the output matrix once; the tied embedding counts as the output
 * matrix, an untied token_embd not at all: one row per token), achieved
 * bytes/s = those bytes x decode tokens/s, and achieved / bandwidth.
 *
 * --prefix N1,N2 adds the compressed-prefix benchmark, for each prefix
 * length N (on the CPU with the last --threads count):
 *   (a) plain prefill of N tokens: tokens/s;
 *   (b) Compactor compression of the same N tokens (pd_compress_prefix,
 *       default compactor spec at retention 0.25): one prefill pass with the
 *       scoring hook, so the wall time is reported as a ratio to (a), with
 *       the scoring + selection time inside it;
 *   (c) time to first token with that prefix: attach + prefill of a
 *       32-token suffix + the first token's logits, once with the prefix
 *       not yet on the device ("cold": includes its upload) and once with it
 *       resident (a second sequence attached to the same prefix);
 *   (d) decode tokens/s after the prefix and suffix, batch 1 and batch 8
 *       (8 sequences sharing the prefix in one pd_decode call), and batch 1
 *       after the plain prefill of (a), uncompressed, for comparison;
 *   (e) on CUDA, the memory-bandwidth bound of decode: bytes of weights read
 *       per step (every matrix as the device stores it, pd_cuda_weight_bytes:
 *       quantized types as their file blocks, f32 4 bytes per element,
 *       f16/bf16 2; the
 *       embedding table counts only when it is also the output matrix)
 *       divided into the measured device copy bandwidth, and the batch-1
 *       measured / bound ratio. KV reads are left out of the bound.
 *
 * --batches B1,B2 adds decode steps at each batch size B (on the last model
 * loaded): B fresh sequences prefilled with --prompt tokens, one warm-up
 * step, then --reps x --gen timed steps, each measured alone:
 *   wall time (p50/p99/max; tok/s = B x steps / their summed wall time);
 *   host enqueue time (pd_backend_timer: from the step's start to its first
 *   wait, the logits download) against the device time (events around the
 *   step; host wall time on a host backend);
 *   logits time: p50 of the step minus p50 of the same step without logits
 *   (pd_decode with NULL logits, interleaved at the same contexts);
 *   launches, driver allocations and syncs per step (pd_backend_counters);
 *   the bound: B x bandwidth / (weight bytes + KV bytes read per step; KV:
 *   every held row of every layer and kv head, K and V, at the KV type's
 *   size), bandwidth the device copy bandwidth on CUDA (weights as the
 *   device holds them) or the host streaming-read bandwidth elsewhere
 *   (weights as in the file).
 *
 * --attn-keys K1,K2 times pd_backend_attention alone on synthetic f16 KV of
 * K rows per kv head (the model's head shape): one decode query per
 * sequence for each --batches size (1 without --batches), each sequence with
 * its own KV, and one causal prefill chunk of --attn-chunk queries at the
 * last positions. FLOPs = 4 x n_head x head_dim x the keys each query may
 * see (causal masking counted), over the median device time of --reps calls.
 *
 * A generated model is written once to $TMPDIR and reused while its options
 * stay the same. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <unistd.h>

#include "engine/engine.h"
#include "policies/policies.h"
#include "tools/tools.h"

#define SUFFIX_TOKENS 32     /* (c), (d): tokens after the compressed prefix */
#define DECODE_BATCH 8       /* (d): sequences sharing the prefix */
#define PREFIX_RETENTION 0.25
#define MAX_PREFIXES 16
#define BANDWIDTH_BYTES ((size_t)256 << 20) /* pd_cuda_copy_bandwidth buffer */

static void usage(FILE *f) {
    fputs("usage: prefix-bench [--model FILE | --preset NAME [--type T] [--n-vocab N] [--seed S]]\n"
          "                    [--device D] [--threads LIST] [--prompt N] [--gen N] [--reps N]\n"
          "                    [--decode-ctx N] [--bandwidth [--bw-mib M]] [--prefix LIST]\n"
          "                    [--batches LIST] [--attn-keys LIST [--attn-chunk N]] [--no-graphs] [--json]\n"
          "  --preset    generate a model: tiny, stories260k, smollm2-135m, llama-3.2-1b, qwen2.5-0.5b\n"
          "  --type      weight type of the generated model (default q8_0)\n"
          "  --device    cpu (default), cuda, cuda:N, auto, or cpu-discrete (the CPU acting as a\n"
          "              device with memory of its own: every device path, CPU arithmetic)\n"
          "  --kv-type   KV cache element type: f16 (default) or f32\n"
          "  --threads   comma-separated CPU thread counts to measure (default 1,2)\n"
          "  --prompt    prompt tokens for prefill (default 256)\n"
          "  --gen       decode steps (default 64)\n"
          "  --reps      runs per figure, best kept (default 3)\n"
          "  --decode-ctx  time decode on a fresh sequence holding N context tokens (0: from an\n"
          "              empty context, like llama-bench's tg); default: right after the prompt\n"
          "  --bandwidth streaming-read memory bandwidth per --threads count, and decode's\n"
          "              achieved bytes/s of weights against it (CPU)\n"
          "  --bw-mib    buffer for --bandwidth in MiB (default 1024, or 4x L3 if memory is short)\n"
          "  --prefix    comma-separated prefix lengths for the compressed-prefix benchmark\n"
          "              (plain prefill, Compactor compression at retention 0.25, time to first\n"
          "              token, decode at batch 1 and 8 and uncompressed at batch 1, and on CUDA the\n"
          "              bandwidth bound)\n"
          "  --batches   decode steps at each batch size (e.g. 1,8,16,32): tok/s, step time\n"
          "              p50/p99/max, host enqueue vs device time, logits time, launches, graph\n"
          "              launches and builds, allocations and syncs per step, decode against the\n"
          "              bound of weights + KV read per step (--bw-mib sizes the host bandwidth\n"
          "              test off CUDA)\n"
          "  --attn-keys attention over that many synthetic f16 keys (e.g. 4096,16384): decode\n"
          "              queries at each --batches size and one prefill chunk, TFLOP/s\n"
          "  --attn-chunk  queries of that prefill chunk (default 512, at most the keys)\n"
          "  --no-graphs run decode steps op by op, not as recorded CUDA graphs (model.cuda_graphs)\n"
          "  --json      machine-readable output\n",
          f);
}

/* Deterministic token ids that avoid 0..2 (unk, BOS, EOS in most vocabs). */
static pd_token bench_token(int64_t i, uint32_t salt, int32_t n_vocab) {
    const int32_t span = n_vocab > 3 ? n_vocab - 3 : n_vocab;
    return (pd_token)((n_vocab > 3 ? 3 : 0) + (int32_t)(pd_mix64((uint64_t)i * 0x9E3779B97F4A7C15ull + salt) %
                                                         (uint64_t)span));
}

typedef struct bench_result {
    double prefill_tps, decode_tps;
} bench_result;

/* One prefill of n_prompt tokens, then n_gen decode steps: after that
 * prompt (decode_ctx < 0), or on a fresh sequence holding decode_ctx context
 * tokens prefilled untimed (0: from an empty context). */
static int run_once(pd_model *m, int n_prompt, int n_gen, int decode_ctx, bench_result *r, pd_error *err) {
    const pd_hparams *hp = pd_model_hparams(m);
    const int n_toks = n_prompt > decode_ctx ? n_prompt : decode_ctx;
    pd_token *toks = malloc(sizeof(pd_token) * (size_t)(n_toks > 0 ? n_toks : 1));
    float *logits = malloc(sizeof(float) * (size_t)hp->n_vocab);
    pd_seq *s = NULL;
    int rc = toks && logits ? PD_OK : pd_errorf(err, PD_ENOMEM, "out of memory");
    if (!rc) rc = pd_seq_create(m, n_prompt + n_gen + 1, &s, err);
    if (!rc) {
        for (int i = 0; i < n_toks; i++) toks[i] = (pd_token)((i * 7919 + 13) % hp->n_vocab);
        double t0 = pd_now_seconds();
        rc = pd_prefill(m, s, toks, n_prompt, NULL, logits, err);
        double t1 = pd_now_seconds();
        r->prefill_tps = n_prompt / (t1 - t0);
    }
    if (!rc && decode_ctx >= 0) { /* decode on its own sequence */
        pd_seq_free(s);
        s = NULL;
        rc = pd_seq_create(m, decode_ctx + n_gen + 1, &s, err);
        if (!rc && decode_ctx > 0) rc = pd_prefill(m, s, toks, decode_ctx, NULL, logits, err);
    }
    if (!rc) {
        pd_token t = toks[0];
        double t2 = pd_now_seconds();
        for (int i = 0; !rc && i < n_gen; i++) {
            rc = pd_decode(m, &s, &t, 1, logits, err);
            t = (pd_token)((t * 31 + 7) % hp->n_vocab);
        }
        double t3 = pd_now_seconds();
        r->decode_tps = n_gen / (t3 - t2);
    }
    pd_seq_free(s);
    free(toks);
    free(logits);
    return rc;
}

/* ------------------------------------------------------------------------
 * Streaming-read memory bandwidth (--bandwidth)
 * ------------------------------------------------------------------------ */

#define BW_PASSES 5
#define BW_MAX_THREADS 256

static volatile uint64_t bw_sink; /* keeps the sums alive */

/* Sum of the 64-bit words of p[0..n), n a multiple of 128, p 64-aligned. */
static uint64_t bw_sum_plain(const uint8_t *p, size_t n) {
    const uint64_t *w = (const uint64_t *)(const void *)p;
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    for (size_t i = 0; i < n / 8; i += 16) {
        a0 += w[i] + w[i + 8];
        a1 += w[i + 1] + w[i + 9];
        a2 += w[i + 2] + w[i + 10];
        a3 += w[i + 3] + w[i + 11];
        a4 += w[i + 4] + w[i + 12];
        a5 += w[i + 5] + w[i + 13];
        a6 += w[i + 6] + w[i + 14];
        a7 += w[i + 7] + w[i + 15];
    }
    return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define BW_HAVE_AVX2 1
__attribute__((target("avx2"))) static uint64_t bw_sum_avx2(const uint8_t *p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *)(const void *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *)(const void *)(p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i *)(const void *)(p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i *)(const void *)(p + i + 96)));
    }
    const __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t out[4];
    _mm256_storeu_si256((__m256i *)(void *)out, s);
    return out[0] + out[1] + out[2] + out[3];
}
#endif

typedef struct bw_slice {
    uint8_t *p;
    size_t n;
    bool fill, avx2;
    uint64_t sum;
} bw_slice;

static void *bw_worker(void *arg) {
    bw_slice *sl = arg;
    if (sl->fill) {
        memset(sl->p, 0x5a, sl->n); /* touch every page from the thread that reads it */
        return NULL;
    }
#ifdef BW_HAVE_AVX2
    if (sl->avx2) {
        sl->sum = bw_sum_avx2(sl->p, sl->n);
        return NULL;
    }
#endif
    sl->sum = bw_sum_plain(sl->p, sl->n);
    return NULL;
}

/* Run one pass over the slices with n_threads threads (the caller is one of
 * them); returns its wall time in seconds, or a negative value when a thread
 * could not start. */
static double bw_pass(bw_slice *sl, int n_threads) {
    pthread_t tid[BW_MAX_THREADS];
    int started = 0;
    const double t0 = pd_now_seconds();
    for (int i = 1; i < n_threads; i++, started++)
        if (pthread_create(&tid[i], NULL, bw_worker, &sl[i]) != 0) break;
    bw_worker(&sl[0]);
    for (int i = 1; i <= started; i++) pthread_join(tid[i], NULL);
    const double dt = pd_now_seconds() - t0;
    uint64_t sum = 0;
    for (int i = 0; i < n_threads; i++) sum += sl[i].sum;
    bw_sink += sum;
    return started == n_threads - 1 ? dt : -1;
}

/* The L3 size: sysfs first (in some VMs sysconf reports CPUID's figure,
 * which can be ten times the real one), else sysconf; 0 when unknown. */
static long l3_cache_bytes(void) {
    FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
    long v = 0;
    char unit = 0;
    if (f) {
        if (fscanf(f, "%ld%c", &v, &unit) < 1) v = 0;
        fclose(f);
        if (unit == 'K') v <<= 10;
        else if (unit == 'M') v <<= 20;
    }
    return v > 0 ? v : sysconf(_SC_LEVEL3_CACHE_SIZE);
}

/* The buffer size: bw_mib when given, else 1 GiB, or 4x the L3 (at least
 * 64 MiB) when less than 4 GiB of memory is free. */
static size_t bw_buffer_bytes(long bw_mib) {
    if (bw_mib > 0) return (size_t)bw_mib << 20;
    const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    const double avail = pages > 0 && page > 0 ? (double)pages * (double)page : 0;
    if (avail <= 0 || avail >= 4.0 * (1 << 30)) return (size_t)1 << 30;
    long l3 = l3_cache_bytes();
    if (l3 <= 0) l3 = 32l << 20;
    const size_t b = 4 * (size_t)l3;
    return b > ((size_t)64 << 20) ? b : (size_t)64 << 20;
}

/* Best streaming-read bandwidth in bytes/s over BW_PASSES passes of
 * n_threads threads over a buffer of bytes bytes. */
static int measure_bandwidth(int n_threads, size_t bytes, double *out, const char **how, pd_error *err) {
    if (n_threads < 1 || n_threads > BW_MAX_THREADS)
        return pd_errorf(err, PD_EINVAL, "--bandwidth measures 1 to %d threads, not %d", BW_MAX_THREADS, n_threads);
    const size_t chunk = (size_t)128 * (size_t)n_threads;
    bytes -= bytes % chunk;
    /* Huge-page backed like the weights (pd_load_file): with 4 KiB pages
     * the stream measured below what decode reaches. */
    const size_t huge = (size_t)2 << 20, alloc = (bytes + huge - 1) / huge * huge;
    uint8_t *buf = aligned_alloc(huge, alloc);
    if (!buf) return pd_errorf(err, PD_ENOMEM, "no memory for a %zu MiB bandwidth buffer", bytes >> 20);
    (void)madvise(buf, alloc, MADV_HUGEPAGE); /* advice: fine if the kernel says no */
    bool avx2 = false;
#ifdef BW_HAVE_AVX2
    avx2 = __builtin_cpu_supports("avx2");
#endif
    *how = avx2 ? "avx2" : "plain";
    bw_slice sl[BW_MAX_THREADS];
    const size_t per = bytes / (size_t)n_threads; /* a multiple of 128 */
    for (int i = 0; i < n_threads; i++) sl[i] = (bw_slice){.p = buf + (size_t)i * per, .n = per, .fill = true, .avx2 = avx2};
    int rc = bw_pass(sl, n_threads) < 0 ? pd_errorf(err, PD_EIO, "could not start %d threads", n_threads) : PD_OK;
    for (int i = 0; i < n_threads; i++) sl[i].fill = false;
    double best = 0;
    for (int pass = 0; !rc && pass < BW_PASSES; pass++) {
        const double dt = bw_pass(sl, n_threads);
        if (dt < 0) rc = pd_errorf(err, PD_EIO, "could not start %d threads", n_threads);
        else if (dt > 0 && (double)(per * (size_t)n_threads) / dt > best) best = (double)(per * (size_t)n_threads) / dt;
    }
    free(buf);
    *out = best;
    return rc;
}

/* Bytes of matrix (2-D or more) t as the CUDA backend holds it. */
static uint64_t device_matrix_bytes(const pd_gguf_tensor *t) {
    return pd_cuda_weight_bytes(t->type, (int64_t)(t->n_elems / t->ne[0]), (int64_t)t->ne[0]);
}

/* Bytes of every matrix the CUDA backend holds for the model (resident,
 * the embedding table included). */
static uint64_t device_weight_bytes(const pd_model *m) {
    const pd_gguf *g = pd_model_gguf(m);
    uint64_t total = 0;
    for (size_t i = 0; i < pd_gguf_tensor_count(g); i++) {
        const pd_gguf_tensor *t = pd_gguf_tensor_at(g, i);
        if (t->n_dims >= 2) total += device_matrix_bytes(t);
    }
    return total;
}

/* Bytes of weights one decode step reads: every matrix (2-D or more) as
 * stored in the file (the CPU), or as the CUDA backend stores it
 * (as_device, pd_cuda_weight_bytes: quantized types as their file blocks,
 * f32 4 bytes per element, f16/bf16 2). The
 * embedding table is read one row per token, so it counts only when it is
 * also the output matrix (no output.weight). */
static uint64_t decode_weight_bytes(const pd_model *m, bool as_device) {
    const pd_gguf *g = pd_model_gguf(m);
    const bool tied = pd_gguf_find_tensor(g, "output.weight") == NULL;
    uint64_t total = 0;
    for (size_t i = 0; i < pd_gguf_tensor_count(g); i++) {
        const pd_gguf_tensor *t = pd_gguf_tensor_at(g, i);
        if (t->n_dims < 2) continue;
        if (!tied && strcmp(t->name, "token_embd.weight") == 0) continue;
        total += as_device ? device_matrix_bytes(t) : t->n_bytes;
    }
    return total;
}

/* ------------------------------------------------------------------------
 * The compressed-prefix benchmark
 * ------------------------------------------------------------------------ */

typedef struct prefix_result {
    int64_t n;
    double prefill_s;        /* (a) */
    double compress_s;       /* (b) wall time of pd_compress_prefix */
    double score_s;          /*     scoring + selection inside it */
    int64_t kept_rows, full_rows;
    double ttft_cold_s;      /* (c) first attach of a new prefix */
    double ttft_s;           /*     prefix already resident */
    double decode_b1_tps;    /* (d) */
    double decode_b8_tps;
    double full_b1_tps;      /*     batch 1 after the uncompressed prefill of (a) */
} prefix_result;

static double min_pos(double best, double v) { return best <= 0 || v < best ? v : best; }
static double max_of(double best, double v) { return v > best ? v : best; }

/* n_gen batch-1 decode steps continuing s; *best_tps keeps the best rate. */
static int decode_b1(pd_model *m, pd_seq *s, int n_gen, float *logits, double *best_tps, pd_error *err) {
    const int32_t V = pd_model_hparams(m)->n_vocab;
    pd_token t = bench_token(0, 7, V);
    const double t0 = pd_now_seconds();
    int rc = PD_OK;
    for (int i = 0; !rc && i < n_gen; i++) {
        rc = pd_decode(m, &s, &t, 1, logits, err);
        t = bench_token(i + 1, 7, V);
    }
    *best_tps = max_of(*best_tps, n_gen / (pd_now_seconds() - t0));
    return rc;
}

/* Attach p to a new sequence, prefill the suffix (salted so sequences
 * differ) with last-token logits; *seconds is the whole call. */
static int attach_and_prefill(pd_model *m, const pd_kv_prefix *p, int32_t n_ctx, uint32_t salt, float *logits,
                              pd_seq **out, double *seconds, pd_error *err) {
    const int32_t V = pd_model_hparams(m)->n_vocab;
    pd_token suffix[SUFFIX_TOKENS];
    for (int i = 0; i < SUFFIX_TOKENS; i++) suffix[i] = bench_token(i, 1000 + salt, V);
    const double t0 = pd_now_seconds();
    pd_seq *s = NULL;
    int rc = pd_seq_create(m, n_ctx, &s, err);
    if (!rc) rc = pd_seq_attach_prefix(s, p, err);
    if (!rc) rc = pd_prefill(m, s, suffix, SUFFIX_TOKENS, NULL, logits, err);
    *seconds = pd_now_seconds() - t0;
    if (rc) {
        pd_seq_free(s);
        s = NULL;
    }
    *out = s;
    return rc;
}

/* One run of (a)-(d) for a prefix of n tokens; r keeps the best figures. */
static int prefix_once(pd_model *m, int64_t n, int n_gen, prefix_result *r, pd_error *err) {
    const pd_hparams *hp = pd_model_hparams(m);
    const int32_t V = hp->n_vocab;
    const int32_t n_ctx = (int32_t)(n + SUFFIX_TOKENS + n_gen + 1);
    pd_token *toks = malloc(sizeof(pd_token) * (size_t)n);
    float *logits = malloc(sizeof(float) * (size_t)V * DECODE_BATCH);
    pd_seq *seqs[DECODE_BATCH] = {0};
    pd_seq *s = NULL;
    pd_kv_prefix *p = NULL;
    pd_compress_stats st = {0};
    int rc = toks && logits ? PD_OK : pd_errorf(err, PD_ENOMEM, "out of memory for a %" PRId64 "-token prefix", n);
    for (int64_t i = 0; !rc && i < n; i++) toks[i] = bench_token(i, 1, V);

    /* (a) plain prefill */
    if (!rc) rc = pd_seq_create(m, n_ctx, &s, err);
    if (!rc) {
        const double t0 = pd_now_seconds();
        rc = pd_prefill(m, s, toks, n, NULL, logits, err);
        r->prefill_s = min_pos(r->prefill_s, pd_now_seconds() - t0);
    }
    /* (d) for comparison: decode after the full, uncompressed prefix */
    if (!rc) rc = decode_b1(m, s, n_gen, logits, &r->full_b1_tps, err);
    pd_seq_free(s);
    s = NULL;

    /* (b) compression: the same prefill with the Compactor hook */
    if (!rc) {
        pd_policy_spec spec;
        pd_policy_spec_default(PD_POLICY_COMPACTOR, &spec);
        pd_policy_spec_set_retention(&spec, PREFIX_RETENTION);
        const double t0 = pd_now_seconds();
        rc = pd_compress_prefix(m, toks, n, &spec, NULL, &p, &st, err);
        const double dt = pd_now_seconds() - t0;
        if (!rc && (r->compress_s <= 0 || dt < r->compress_s)) {
            r->compress_s = dt;
            r->score_s = st.score_seconds;
        }
        if (!rc) {
            r->kept_rows = pd_kv_prefix_kept_rows(p);
            r->full_rows = (int64_t)hp->n_layer * hp->n_head_kv * n;
        }
    }

    /* (c) time to first token: the first attach of this new prefix uploads
     * it (on a device), the second finds it resident. */
    double dt;
    if (!rc) rc = attach_and_prefill(m, p, n_ctx, 0, logits, &s, &dt, err);
    if (!rc) r->ttft_cold_s = min_pos(r->ttft_cold_s, dt);
    pd_seq_free(s);
    s = NULL;
    if (!rc) rc = attach_and_prefill(m, p, n_ctx, 1, logits, &s, &dt, err);
    if (!rc) r->ttft_s = min_pos(r->ttft_s, dt);

    /* (d) decode, batch 1 (continuing the sequence above) */
    if (!rc) rc = decode_b1(m, s, n_gen, logits, &r->decode_b1_tps, err);
    pd_seq_free(s);
    s = NULL;

    /* (d) decode, batch 8 sharing the prefix */
    for (int b = 0; !rc && b < DECODE_BATCH; b++) rc = attach_and_prefill(m, p, n_ctx, 2 + (uint32_t)b, logits,
                                                                          &seqs[b], &dt, err);
    if (!rc) {
        pd_token t[DECODE_BATCH];
        const double t0 = pd_now_seconds();
        for (int i = 0; !rc && i < n_gen; i++) {
            for (int b = 0; b < DECODE_BATCH; b++) t[b] = bench_token(i, 100 + (uint32_t)b, V);
            rc = pd_decode(m, seqs, t, DECODE_BATCH, logits, err);
        }
        r->decode_b8_tps = max_of(r->decode_b8_tps, (double)DECODE_BATCH * n_gen / (pd_now_seconds() - t0));
    }
    for (int b = 0; b < DECODE_BATCH; b++) pd_seq_free(seqs[b]);
    /* Sequences first: the prefix must outlive them. */
    pd_kv_prefix_free(p);
    pd_compress_stats_free(&st);
    free(toks);
    free(logits);
    return rc;
}

/* ------------------------------------------------------------------------
 * Decode steps (--batches): per batch size, every step timed
 * ------------------------------------------------------------------------ */

/* Nearest-rank percentiles of n samples (sorted in place). */
typedef struct pct3 {
    double p50, p99, max;
} pct3;

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double nearest_rank(const double *sorted, int n, double q) {
    int i = (int)ceil(q * n) - 1;
    if (i < 0) i = 0;
    if (i >= n) i = n - 1;
    return sorted[i];
}

static pct3 percentiles(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return (pct3){nearest_rank(v, n, 0.50), nearest_rank(v, n, 0.99), v[n - 1]};
}

typedef struct steps_result {
    int batch, steps;         /* steps timed, all reps together */
    double tps;               /* batch * steps / their summed wall time */
    pct3 wall;                /* per-step wall time, logits included */
    double enqueue_p50;       /* host: start of the step to its first wait (the logits download) */
    double device_p50;        /* device: events around the step */
    double wait_p50;          /* host blocked in download/sync */
    double nologits_p50;      /* wall time of the same step without logits */
    double launches, allocs, frees, syncs, uploads, downloads, unstaged; /* per step (counter deltas) */
    double graphs, graph_builds; /* device graphs launched and instantiated per step */
    double kv_bytes;          /* KV read per step, mean over the timed steps */
} steps_result;

/* reps x n_gen timed decode steps of `batch` fresh sequences, each
 * prefilled with n_prompt tokens (untimed), after one warm-up step.
 * Steps alternate: one with logits (timed in full), one without (its wall
 * time only), so the logits cost is the difference of their medians at the
 * same context. */
static int decode_steps(pd_model *m, pd_backend_timer *tm, int batch, int n_prompt, int n_gen, int reps,
                        bool kv_f32, steps_result *out, pd_error *err) {
    const pd_hparams *hp = pd_model_hparams(m);
    pd_backend *be = pd_model_backend(m);
    const int32_t V = hp->n_vocab;
    const int n = reps * n_gen;
    const int32_t n_ctx = n_prompt + 2 * n_gen + 2;
    pd_seq **seqs = calloc((size_t)batch, sizeof *seqs);
    pd_token *toks = malloc(sizeof(pd_token) * (size_t)(n_prompt > batch ? n_prompt : batch));
    float *logits = malloc(sizeof(float) * (size_t)V * (size_t)batch);
    double *wall = malloc(sizeof(double) * (size_t)n * 5), *enq = wall + n, *dev = enq + n, *wait = dev + n,
           *nolog = wait + n;
    const double row_bytes = (double)hp->n_layer * hp->n_head_kv * hp->head_dim * 2.0 * (kv_f32 ? 4 : 2);
    double wall_sum = 0, kv_sum = 0;
    pd_backend_counters c0, c1;
    memset(out, 0, sizeof *out);
    out->batch = batch;
    out->steps = n;
    int rc = seqs && toks && logits && wall ? PD_OK : pd_errorf(err, PD_ENOMEM, "out of memory for batch %d", batch);
    for (int rep = 0, k = 0; !rc && rep < reps; rep++) {
        for (int b = 0; !rc && b < batch; b++) {
            for (int i = 0; i < n_prompt; i++) toks[i] = bench_token(i, 500 + (uint32_t)b, V);
            rc = pd_seq_create(m, n_ctx, &seqs[b], err);
            if (!rc) rc = pd_prefill(m, seqs[b], toks, n_prompt, NULL, logits, err);
        }
        for (int b = 0; b < batch; b++) toks[b] = bench_token(b, 900, V);
        if (!rc) rc = pd_decode(m, seqs, toks, batch, logits, err); /* warm-up */
        for (int i = 0; !rc && i < n_gen; i++, k++) {
            const int32_t ctx = n_prompt + 1 + 2 * i; /* tokens held before this step */
            for (int b = 0; b < batch; b++) toks[b] = bench_token(i, 100 + (uint32_t)b, V);
            pd_backend_timing t;
            pd_backend_counters_get(be, &c0);
            if ((rc = pd_backend_timer_start(tm, err)) || (rc = pd_decode(m, seqs, toks, batch, logits, err)) ||
                (rc = pd_backend_timer_stop(tm, err)) || (rc = pd_backend_timer_read(tm, &t, err)))
                break;
            pd_backend_counters_get(be, &c1);
            wall[k] = t.wall_s;
            enq[k] = t.enqueue_s;
            dev[k] = t.device_s;
            wait[k] = t.wait_s;
            wall_sum += t.wall_s;
            kv_sum += batch * (ctx + 1) * row_bytes;
            out->launches += (double)(c1.launches - c0.launches);
            out->allocs += (double)(c1.device_allocs - c0.device_allocs);
            out->frees += (double)(c1.device_frees - c0.device_frees);
            out->syncs += (double)(c1.syncs - c0.syncs);
            out->uploads += (double)(c1.uploads - c0.uploads);
            out->downloads += (double)(c1.downloads - c0.downloads);
            out->unstaged += (double)(c1.unstaged_copies - c0.unstaged_copies);
            out->graphs += (double)(c1.graph_launches - c0.graph_launches);
            out->graph_builds += (double)(c1.graph_builds - c0.graph_builds);
            /* The same step without logits (pd_decode syncs instead). */
            const double t0 = pd_now_seconds();
            rc = pd_decode(m, seqs, toks, batch, NULL, err);
            nolog[k] = pd_now_seconds() - t0;
        }
        for (int b = 0; b < batch; b++) {
            pd_seq_free(seqs[b]);
            seqs[b] = NULL;
        }
    }
    if (!rc) {
        out->tps = wall_sum > 0 ? (double)batch * n / wall_sum : 0;
        out->kv_bytes = kv_sum / n;
        out->launches /= n;
        out->allocs /= n;
        out->frees /= n;
        out->syncs /= n;
        out->uploads /= n;
        out->downloads /= n;
        out->unstaged /= n;
        out->graphs /= n;
        out->graph_builds /= n;
        out->wall = percentiles(wall, n);
        out->enqueue_p50 = percentiles(enq, n).p50;
        out->device_p50 = percentiles(dev, n).p50;
        out->wait_p50 = percentiles(wait, n).p50;
        out->nologits_p50 = percentiles(nolog, n).p50;
    }
    if (seqs)
        for (int b = 0; b < batch; b++) pd_seq_free(seqs[b]);
    free(seqs);
    free(toks);
    free(logits);
    free(wall);
    return rc;
}

/* ------------------------------------------------------------------------
 * Attention (--attn-keys): pd_backend_attention on synthetic f16 KV
 * ------------------------------------------------------------------------ */

typedef struct attn_result {
    int64_t keys, queries;
    int groups;              /* decode: one query per group, each with its own KV */
    double flops;            /* 4 * n_head * head_dim * visible keys, summed over queries */
    double seconds;          /* median device time of one call */
} attn_result;

static float bench_uniform(uint64_t i, uint32_t salt) {
    return (float)((double)(pd_mix64(i * 0x9E3779B97F4A7C15ull + salt) >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* Device buffers for one key count: max_groups groups of n_head_kv streams
 * of `keys` f16 rows (K and V), their positions 0..keys-1, and queries and
 * outputs for max_q tokens. */
typedef struct attn_bufs {
    void *k, *v;
    int32_t *pos, *q_pos;
    float *q, *out;
} attn_bufs;

static void attn_bufs_free(pd_backend *be, attn_bufs *b) {
    pd_backend_release(be, b->k);
    pd_backend_release(be, b->v);
    pd_backend_release(be, b->pos);
    pd_backend_release(be, b->q_pos);
    pd_backend_release(be, b->q);
    pd_backend_release(be, b->out);
    memset(b, 0, sizeof *b);
}

static int attn_bufs_make(pd_backend *be, const pd_hparams *hp, int64_t keys, int max_groups, int64_t max_q,
                          attn_bufs *b, pd_error *err) {
    const size_t stream_elems = (size_t)hp->n_head_kv * (size_t)keys * (size_t)hp->head_dim; /* one group */
    const size_t q_elems = (size_t)max_q * (size_t)hp->n_head * (size_t)hp->head_dim;
    memset(b, 0, sizeof *b);
    float *host = malloc(sizeof(float) * (stream_elems > q_elems ? stream_elems : q_elems));
    int32_t *hpos = malloc(sizeof(int32_t) * (size_t)keys);
    float *tmp = NULL;
    int rc = host && hpos ? PD_OK : pd_errorf(err, PD_ENOMEM, "out of host memory for %" PRId64 " keys", keys);
    if (!rc && (!(b->k = pd_backend_alloc(be, 2 * stream_elems * (size_t)max_groups, err)) ||
                !(b->v = pd_backend_alloc(be, 2 * stream_elems * (size_t)max_groups, err)) ||
                !(b->pos = pd_backend_alloc(be, sizeof(int32_t) * (size_t)keys, err)) ||
                !(b->q_pos = pd_backend_alloc(be, sizeof(int32_t) * (size_t)max_q, err)) ||
                !(b->q = pd_backend_alloc(be, sizeof(float) * q_elems, err)) ||
                !(b->out = pd_backend_alloc(be, sizeof(float) * q_elems, err)) ||
                !(tmp = pd_backend_alloc(be, sizeof(float) * stream_elems, err))))
        rc = err->code ? err->code : PD_ENOMEM;
    /* K and V: uniform in [-1, 1), written in f32 and converted to f16 on
     * the backend, the same rows for every group. */
    for (int kv = 0; !rc && kv < 2; kv++) {
        for (size_t i = 0; i < stream_elems; i++) host[i] = bench_uniform(i, 11 + (uint32_t)kv);
        rc = pd_backend_upload(be, tmp, host, sizeof(float) * stream_elems, err);
        for (int g = 0; !rc && g < max_groups; g++)
            rc = pd_backend_convert(be, (uint16_t *)(kv ? b->v : b->k) + (size_t)g * stream_elems, PD_TYPE_F16, tmp,
                                    PD_TYPE_F32, (int64_t)stream_elems, err);
    }
    for (int64_t i = 0; i < keys; i++) hpos[i] = (int32_t)i;
    for (size_t i = 0; !rc && i < q_elems; i++) host[i] = bench_uniform(i, 13);
    if (!rc) rc = pd_backend_upload(be, b->pos, hpos, sizeof(int32_t) * (size_t)keys, err);
    if (!rc) rc = pd_backend_upload(be, b->q, host, sizeof(float) * q_elems, err);
    if (!rc) rc = pd_backend_sync(be, err); /* tmp is released below */
    pd_backend_release(be, tmp);
    free(host);
    free(hpos);
    if (rc) attn_bufs_free(be, b);
    return rc;
}

/* One configuration: `groups` decode queries (each at position `keys`, its
 * own KV) or, with groups 0, one prefill chunk of `chunk` queries at
 * positions keys - chunk .. keys - 1 over one KV, causal. One warm-up call,
 * then the median device time of reps calls. */
static int attn_run(pd_backend *be, pd_backend_timer *tm, const pd_hparams *hp, const attn_bufs *b, int64_t keys,
                    int groups, int64_t chunk, int reps, attn_result *r, pd_error *err) {
    const int hkv = hp->n_head_kv;
    const size_t stream_elems = (size_t)hkv * (size_t)keys * (size_t)hp->head_dim;
    const int n_groups = groups > 0 ? groups : 1;
    const int64_t n_q = groups > 0 ? groups : chunk;
    pd_kv_view *views = calloc((size_t)n_groups * (size_t)hkv, sizeof *views);
    int64_t *group_start = malloc(sizeof(int64_t) * (size_t)(n_groups + 1));
    int32_t *qpos = malloc(sizeof(int32_t) * (size_t)n_q);
    double *times = malloc(sizeof(double) * (size_t)reps);
    int rc = views && group_start && qpos && times ? PD_OK : pd_errorf(err, PD_ENOMEM, "out of memory");
    for (int g = 0; !rc && g < n_groups; g++) {
        for (int h = 0; h < hkv; h++) {
            const size_t off = (size_t)g * stream_elems + (size_t)h * (size_t)keys * (size_t)hp->head_dim;
            views[g * hkv + h] = (pd_kv_view){.k = (const uint16_t *)b->k + off, .v = (const uint16_t *)b->v + off,
                                              .pos = b->pos, .len = keys, .type = PD_TYPE_F16};
        }
        group_start[g] = groups > 0 ? g : 0;
    }
    group_start[n_groups] = n_q;
    r->keys = keys;
    r->queries = n_q;
    r->groups = groups;
    r->flops = 0;
    for (int64_t i = 0; !rc && i < n_q; i++) {
        qpos[i] = (int32_t)(groups > 0 ? keys : keys - chunk + i);
        const int64_t visible = groups > 0 ? keys : keys - chunk + i + 1; /* causal: keys at positions <= its own */
        r->flops += 4.0 * hp->n_head * (double)hp->head_dim * (double)visible;
    }
    if (!rc) rc = pd_backend_upload(be, b->q_pos, qpos, sizeof(int32_t) * (size_t)n_q, err);
    const pd_attn_args a = {.q = b->q, .q_pos = b->q_pos, .n_tokens = n_q, .n_head = hp->n_head, .n_head_kv = hkv,
                            .head_dim = hp->head_dim, .n_segments = 1, .kv = views, .n_groups = n_groups,
                            .group_start = group_start, .scale = 1.0f / sqrtf((float)hp->head_dim),
                            .causal = true, .out = b->out};
    if (!rc) rc = pd_backend_attention(be, &a, err); /* warm-up */
    if (!rc) rc = pd_backend_sync(be, err);
    for (int i = 0; !rc && i < reps; i++) {
        pd_backend_timing t;
        if ((rc = pd_backend_timer_start(tm, err)) || (rc = pd_backend_attention(be, &a, err)) ||
            (rc = pd_backend_timer_stop(tm, err)) || (rc = pd_backend_timer_read(tm, &t, err)))
            break;
        times[i] = t.device_s;
    }
    if (!rc) r->seconds = percentiles(times, reps).p50;
    free(views);
    free(group_start);
    free(qpos);
    free(times);
    return rc;
}

/* Parse "N1,N2,..." (each >= 1) into out; returns the count or -1. */
static int parse_list(const char *text, long *out, int cap) {
    int n = 0;
    for (const char *p = text; *p;) {
        char *end;
        errno = 0;
        const long v = strtol(p, &end, 10);
        if (end == p || v < 1 || errno || n == cap || (*end != ',' && *end != '\0')) return -1;
        out[n++] = v;
        p = *end == ',' ? end + 1 : end;
    }
    return n > 0 ? n : -1;
}

/* The bound of a decode step on this backend: bytes it reads over the
 * measured bandwidth. */
typedef struct bound_info {
    bool on;
    double bandwidth;       /* bytes/s: device copy bandwidth (CUDA) or host streaming read */
    const char *bandwidth_what;
    uint64_t weight_bytes;  /* weights one step reads, as the backend holds them */
    uint64_t device_bytes;  /* every matrix the device holds (CUDA), else 0 */
} bound_info;

static void print_steps_table(const char *dev_name, const bound_info *bd, long n_prompt, long n_gen, long reps,
                              const steps_result *rs, int n) {
    printf("\ndecode steps on %s: per batch size, fresh sequences of %ld prompt tokens, %ld timed steps x %ld "
           "reps (after one warm-up step); step times are wall times with logits\n",
           dev_name, n_prompt, n_gen, reps);
    if (bd->device_bytes)
        printf("device weights: %.3g GB (quantized types in their file blocks)\n", (double)bd->device_bytes / 1e9);
    printf("bound: (%.3g GB of weights + the KV bytes read) per step / %.1f GB/s %s\n", (double)bd->weight_bytes / 1e9,
           bd->bandwidth / 1e9, bd->bandwidth_what);
    printf("%5s %10s %8s %8s %8s %10s %8s %8s %9s %9s %6s %6s %7s %6s %8s %10s %9s\n", "batch", "tok/s", "p50 ms",
           "p99 ms", "max ms", "enqueue ms", "gpu ms", "wait ms", "logits ms", "launches", "graphs", "builds", "allocs",
           "syncs", "KV MB", "bound t/s", "dec/bound");
    for (int i = 0; i < n; i++) {
        const steps_result *r = &rs[i];
        const double bound = r->batch * bd->bandwidth / ((double)bd->weight_bytes + r->kv_bytes);
        printf("%5d %10.1f %8.3f %8.3f %8.3f %10.3f %8.3f %8.3f %9.3f %9.1f %6.2f %6.2f %7.2f %6.2f %8.2f %10.1f %9.3f\n",
               r->batch, r->tps, 1e3 * r->wall.p50, 1e3 * r->wall.p99, 1e3 * r->wall.max, 1e3 * r->enqueue_p50,
               1e3 * r->device_p50, 1e3 * r->wait_p50, 1e3 * (r->wall.p50 - r->nologits_p50), r->launches,
               r->graphs, r->graph_builds, r->allocs, r->syncs, r->kv_bytes / 1e6, bound,
               bound > 0 ? r->tps / bound : 0);
    }
    fflush(stdout);
}

static void print_steps_json(const bound_info *bd, long n_prompt, long n_gen, long reps, const steps_result *rs,
                             int n) {
    printf(",\n\"decode_steps\": {\"prompt\": %ld, \"gen\": %ld, \"reps\": %ld, \"weight_bytes\": %" PRIu64
           ", \"device_weight_bytes\": %" PRIu64 ", \"bandwidth_bytes_per_s\": %.6g, \"bandwidth\": \"%s\", "
           "\"results\": [",
           n_prompt, n_gen, reps, bd->weight_bytes, bd->device_bytes, bd->bandwidth, bd->bandwidth_what);
    for (int i = 0; i < n; i++) {
        const steps_result *r = &rs[i];
        const double bound = r->batch * bd->bandwidth / ((double)bd->weight_bytes + r->kv_bytes);
        printf("%s\n  {\"batch\": %d, \"steps\": %d, \"tps\": %.3f, \"step_p50_ms\": %.4f, \"step_p99_ms\": %.4f, "
               "\"step_max_ms\": %.4f, \"enqueue_p50_ms\": %.4f, \"device_p50_ms\": %.4f, \"wait_p50_ms\": %.4f, "
               "\"nologits_p50_ms\": %.4f, \"logits_ms\": %.4f, \"launches_per_step\": %.2f, "
               "\"device_allocs_per_step\": %.3f, \"device_frees_per_step\": %.3f, \"syncs_per_step\": %.3f, "
               "\"uploads_per_step\": %.3f, \"downloads_per_step\": %.3f, \"unstaged_copies_per_step\": %.3f, "
               "\"graph_launches_per_step\": %.3f, \"graph_builds_per_step\": %.3f, "
               "\"kv_bytes_per_step\": %.6g, \"bound_tps\": %.3f, \"decode_over_bound\": %.4f}",
               i ? "," : "", r->batch, r->steps, r->tps, 1e3 * r->wall.p50, 1e3 * r->wall.p99, 1e3 * r->wall.max,
               1e3 * r->enqueue_p50, 1e3 * r->device_p50, 1e3 * r->wait_p50, 1e3 * r->nologits_p50,
               1e3 * (r->wall.p50 - r->nologits_p50), r->launches, r->allocs, r->frees, r->syncs, r->uploads,
               r->downloads, r->unstaged, r->graphs, r->graph_builds, r->kv_bytes, bound,
               bound > 0 ? r->tps / bound : 0);
    }
    printf("\n]}");
}

/* Every --attn-keys count: decode queries at each --batches size (1 when
 * none) and one prefill chunk. */
static int attention_section(pd_model *m, pd_backend_timer *tm, const char *dev_name, const long *keys, int n_keys,
                             const long *batches, int n_batches, long chunk, long reps, bool json, pd_error *err) {
    const pd_hparams *hp = pd_model_hparams(m);
    pd_backend *be = pd_model_backend(m);
    static const long one = 1;
    if (!n_batches) {
        batches = &one;
        n_batches = 1;
    }
    int max_groups = 1;
    for (int i = 0; i < n_batches; i++)
        if (batches[i] > max_groups) max_groups = (int)batches[i];
    if (json)
        printf(",\n\"attention\": {\"n_head\": %d, \"n_head_kv\": %d, \"head_dim\": %d, \"kv_type\": \"f16\", "
               "\"reps\": %ld, \"results\": [",
               hp->n_head, hp->n_head_kv, hp->head_dim, reps);
    else
        printf("\nattention on %s: pd_backend_attention, f16 KV, %d query heads / %d kv heads x %d, causal; median "
               "of %ld calls (device time); FLOPs = 4 x heads x head_dim x visible keys per query\n"
               "%7s %8s %-14s %10s %10s\n",
               dev_name, hp->n_head, hp->n_head_kv, hp->head_dim, reps, "keys", "queries", "kind", "ms", "TFLOP/s");
    int rc = PD_OK;
    bool first = true;
    for (int ki = 0; !rc && ki < n_keys; ki++) {
        const int64_t k = keys[ki], ck = chunk < k ? chunk : k;
        attn_bufs b;
        if ((rc = attn_bufs_make(be, hp, k, max_groups, ck > max_groups ? ck : max_groups, &b, err))) break;
        for (int i = 0; !rc && i <= n_batches; i++) {
            attn_result r;
            const bool prefill = i == n_batches;
            if ((rc = attn_run(be, tm, hp, &b, k, prefill ? 0 : (int)batches[i], ck, (int)reps, &r, err))) break;
            const double tflops = r.seconds > 0 ? r.flops / r.seconds / 1e12 : 0;
            if (json)
                printf("%s\n  {\"keys\": %" PRId64 ", \"queries\": %" PRId64 ", \"kind\": \"%s\", \"flops\": %.6g, "
                       "\"ms\": %.4f, \"tflops\": %.6g}",
                       first ? "" : ",", r.keys, r.queries, prefill ? "prefill-chunk" : "decode", r.flops,
                       1e3 * r.seconds, tflops);
            else
                printf("%7" PRId64 " %8" PRId64 " %-14s %10.3f %10.4g\n", r.keys, r.queries,
                       prefill ? "prefill-chunk" : "decode", 1e3 * r.seconds, tflops);
            first = false;
        }
        attn_bufs_free(be, &b);
    }
    if (json && !rc) printf("\n]}");
    fflush(stdout);
    return rc;
}

int main(int argc, char **argv) {
    pd_cpu_prepare_process(argv);
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},   {"preset", required_argument, 0, 'p'},
        {"type", required_argument, 0, 't'},    {"n-vocab", required_argument, 0, 'v'},
        {"seed", required_argument, 0, 's'},    {"threads", required_argument, 0, 'T'},
        {"prompt", required_argument, 0, 'P'},  {"gen", required_argument, 0, 'g'},
        {"reps", required_argument, 0, 'r'},    {"json", no_argument, 0, 'j'},
        {"device", required_argument, 0, 'd'},  {"prefix", required_argument, 0, 'x'},
        {"decode-ctx", required_argument, 0, 'D'}, {"bandwidth", no_argument, 0, 'B'},
        {"bw-mib", required_argument, 0, 'M'},  {"kv-type", required_argument, 0, 'K'},
        {"batches", required_argument, 0, 'b'}, {"attn-keys", required_argument, 0, 'A'},
        {"attn-chunk", required_argument, 0, 'C'}, {"no-graphs", no_argument, 0, 'G'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    const char *model = NULL, *preset = NULL, *type_name = "q8_0", *threads = "1,2";
    const char *device_text = "cpu", *prefix_text = NULL, *batches_text = NULL, *attn_text = NULL;
    long n_vocab = 0, seed = 1, n_prompt = 256, n_gen = 64, reps = 3, decode_ctx = -1, bw_mib = 0, attn_chunk = 512;
    bool json = false, bandwidth_on = false, kv_f32 = false, no_graphs = false;
    int c;
    while ((c = getopt_long(argc, argv, "m:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'p': preset = optarg; break;
        case 't': type_name = optarg; break;
        case 'v': n_vocab = strtol(optarg, NULL, 10); break;
        case 's': seed = strtol(optarg, NULL, 10); break;
        case 'T': threads = optarg; break;
        case 'P': n_prompt = strtol(optarg, NULL, 10); break;
        case 'g': n_gen = strtol(optarg, NULL, 10); break;
        case 'r': reps = strtol(optarg, NULL, 10); break;
        case 'j': json = true; break;
        case 'd': device_text = optarg; break;
        case 'x': prefix_text = optarg; break;
        case 'D': decode_ctx = strtol(optarg, NULL, 10); break;
        case 'B': bandwidth_on = true; break;
        case 'M': bw_mib = strtol(optarg, NULL, 10); break;
        case 'b': batches_text = optarg; break;
        case 'A': attn_text = optarg; break;
        case 'C': attn_chunk = strtol(optarg, NULL, 10); break;
        case 'G': no_graphs = true; break;
        case 'K':
            if (strcmp(optarg, "f16") != 0 && strcmp(optarg, "f32") != 0) {
                fprintf(stderr, "prefix-bench: --kv-type '%s': use f16 (the default) or f32\n", optarg);
                return 2;
            }
            kv_f32 = strcmp(optarg, "f32") == 0;
            break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (!model == !preset || n_prompt < 1 || n_gen < 1 || reps < 1 || decode_ctx < -1 || bw_mib < 0 ||
        attn_chunk < 1) {
        usage(stderr);
        return 2;
    }
    pd_error err = {0};
    long thread_counts[64], prefixes[MAX_PREFIXES], batches[MAX_PREFIXES], attn_keys[MAX_PREFIXES];
    const int n_threads = parse_list(threads, thread_counts, 64);
    if (n_threads < 0) {
        fprintf(stderr, "prefix-bench: bad --threads list '%s'\n", threads);
        return 2;
    }
    const int n_prefixes = prefix_text ? parse_list(prefix_text, prefixes, MAX_PREFIXES) : 0;
    if (n_prefixes < 0) {
        fprintf(stderr, "prefix-bench: bad --prefix list '%s' (at most %d lengths >= 1, comma-separated)\n",
                prefix_text, MAX_PREFIXES);
        return 2;
    }
    const int n_batches = batches_text ? parse_list(batches_text, batches, MAX_PREFIXES) : 0;
    if (n_batches < 0) {
        fprintf(stderr, "prefix-bench: bad --batches list '%s' (at most %d sizes >= 1, comma-separated)\n",
                batches_text, MAX_PREFIXES);
        return 2;
    }
    const int n_attn = attn_text ? parse_list(attn_text, attn_keys, MAX_PREFIXES) : 0;
    if (n_attn < 0) {
        fprintf(stderr, "prefix-bench: bad --attn-keys list '%s' (at most %d counts >= 1, comma-separated)\n",
                attn_text, MAX_PREFIXES);
        return 2;
    }
    /* cpu-discrete: the CPU backend acting as a device (its own memory), so
     * every device path of this benchmark runs without a GPU (tests). */
    const bool discrete = strcmp(device_text, "cpu-discrete") == 0;
    pd_device dev = {.kind = PD_DEVICE_CPU};
    if (!discrete && pd_device_parse(device_text, &dev, &err)) {
        fprintf(stderr, "prefix-bench: --device: %s (or cpu-discrete)\n", err.msg);
        return 2;
    }

    char gen_path[1024];
    if (preset) {
        pd_testmodel_opts o;
        pd_type type;
        if (pd_testmodel_preset(preset, &o, &err) || pd_type_from_name(type_name, &type, &err)) {
            fprintf(stderr, "prefix-bench: %s\n", err.msg);
            return 2;
        }
        o.wtype = type;
        o.seed = (uint64_t)seed;
        if (n_vocab > 0) o.n_vocab = (uint32_t)n_vocab;
        const char *tmp = getenv("TMPDIR");
        snprintf(gen_path, sizeof gen_path, "%s/prefix-bench-%s-%s-v%ld-s%ld.gguf", tmp && *tmp ? tmp : "/tmp", preset,
                 type_name, n_vocab, seed);
        if (access(gen_path, R_OK) != 0) {
            fprintf(stderr, "prefix-bench: generating %s\n", gen_path);
            if (pd_testmodel_write(&o, gen_path, NULL, &err)) {
                fprintf(stderr, "prefix-bench: %s\n", err.msg);
                return 1;
            }
        }
        model = gen_path;
    }

    /* The device backend, created once (a CPU backend is made per thread
     * count below, as before). `auto` resolves here. */
    pd_backend *dev_be = NULL;
    char dev_name[300] = "";
    bool on_cuda = false;
    if (discrete) {
        if (pd_backend_cpu_discrete_create((int)thread_counts[n_threads - 1], &dev_be, &err)) {
            fprintf(stderr, "prefix-bench: --device cpu-discrete: %s\n", err.msg);
            return 1;
        }
        snprintf(dev_name, sizeof dev_name, "cpu-discrete");
        if (!json) fprintf(stderr, "prefix-bench: device %s\n", dev_name);
    } else if (dev.kind != PD_DEVICE_CPU) {
        if (pd_backend_create(&dev, (int)thread_counts[n_threads - 1], &dev_be, &err)) {
            fprintf(stderr, "prefix-bench: --device %s: %s\n", device_text, err.msg);
            return 1;
        }
        on_cuda = !pd_backend_host_memory(dev_be);
        if (!on_cuda) { /* auto fell back to the CPU: measure it the CPU way */
            pd_backend_free(dev_be);
            dev_be = NULL;
            dev.kind = PD_DEVICE_CPU;
        } else {
            dev.kind = PD_DEVICE_CUDA; /* auto chose cuda:index: name it so */
            pd_cuda_device_info info;
            pd_device_format(&dev, dev_name, sizeof dev_name);
            if (pd_cuda_device_info_get(dev.index, &info, &err) == PD_OK) {
                const size_t len = strlen(dev_name);
                snprintf(dev_name + len, sizeof dev_name - len, " (%s)", info.name);
            }
            if (!json) fprintf(stderr, "prefix-bench: device %s\n", dev_name);
        }
    }
    if (!dev_be) snprintf(dev_name, sizeof dev_name, "cpu");
    const bool sections = n_prefixes || n_batches || n_attn; /* JSON: an object rather than the rows alone */

    /* ---- plain prefill / decode ---- */
    if (json) printf(sections ? "{\"device\": \"%s\", \"rows\": [" : "[", dev_name);
    bool first = true;
    const int n_rows = dev_be ? 1 : n_threads;
    pd_model *kept_model = NULL; /* the last model loaded serves the sections below */
    for (int ti = 0; ti < n_rows; ti++) {
        const long nt = dev_be ? thread_counts[n_threads - 1] : thread_counts[ti];
        pd_model *m = NULL;
        pd_model_params mp = {.n_threads = (int)nt, .backend = dev_be, .kv_f32 = kv_f32, .no_graphs = no_graphs};
        if (pd_model_load(model, &mp, &m, &err)) {
            fprintf(stderr, "prefix-bench: %s\n", err.msg);
            return 1;
        }
        const pd_hparams *hp = pd_model_hparams(m);
        for (int pi = 0; ti == 0 && pi < n_prefixes; pi++)
            if (prefixes[pi] + SUFFIX_TOKENS + n_gen + 1 > hp->n_ctx_train) {
                fprintf(stderr,
                        "prefix-bench: a %ld-token prefix with %d suffix tokens and %ld decode steps exceeds the "
                        "model's context of %d\n",
                        prefixes[pi], SUFFIX_TOKENS, n_gen, hp->n_ctx_train);
                return 2;
            }
        if (ti == 0 && n_batches && n_prompt + 2 * n_gen + 2 > hp->n_ctx_train) {
            fprintf(stderr,
                    "prefix-bench: --batches: %ld prompt tokens and 2 x %ld decode steps (with and without logits) "
                    "exceed the model's context of %d\n",
                    n_prompt, n_gen, hp->n_ctx_train);
            return 2;
        }
        bench_result best = {0}, r;
        if (run_once(m, (int)n_prompt, (int)n_gen, (int)decode_ctx, &r, &err)) { /* warm-up */
            fprintf(stderr, "prefix-bench: %s\n", err.msg);
            return 1;
        }
        for (long i = 0; i < reps; i++) {
            if (run_once(m, (int)n_prompt, (int)n_gen, (int)decode_ctx, &r, &err)) {
                fprintf(stderr, "prefix-bench: %s\n", err.msg);
                return 1;
            }
            if (r.prefill_tps > best.prefill_tps) best.prefill_tps = r.prefill_tps;
            if (r.decode_tps > best.decode_tps) best.decode_tps = r.decode_tps;
        }
        const char *tname = pd_type_get(hp->wtype)->name;
        if (dev_be) {
            if (json) {
                printf("\n  {\"model\": \"%s\", \"type\": \"%s\", \"device\": \"%s\", \"prompt\": %ld, \"gen\": %ld, "
                       "\"prefill_tps\": %.1f, \"decode_tps\": %.1f}",
                       model, tname, dev_name, n_prompt, n_gen, best.prefill_tps, best.decode_tps);
            } else {
                printf("%-12s %-6s %-40s %14s %14s\n", "model", "type", "device", "prefill tok/s", "decode tok/s");
                printf("%-12s %-6s %-40s %14.1f %14.1f\n", preset ? preset : "file", tname, dev_name,
                       best.prefill_tps, best.decode_tps);
            }
        } else {
            /* --bandwidth: the machine's read bandwidth with nt threads,
             * and decode's bytes of weights per second against it. */
            double bw = 0;
            const char *bw_how = "";
            const size_t bw_bytes = bandwidth_on ? bw_buffer_bytes(bw_mib) : 0;
            if (bandwidth_on && measure_bandwidth((int)nt, bw_bytes, &bw, &bw_how, &err)) {
                fprintf(stderr, "prefix-bench: bandwidth: %s\n", err.msg);
                return 1;
            }
            const uint64_t sbytes = decode_weight_bytes(m, false);
            const double achieved = (double)sbytes * best.decode_tps;
            char ctx_text[32] = "null";
            if (decode_ctx >= 0) snprintf(ctx_text, sizeof ctx_text, "%ld", decode_ctx);
            if (json) {
                printf("%s\n  {\"model\": \"%s\", \"type\": \"%s\", \"threads\": %ld, \"simd\": \"%s\", "
                       "\"prompt\": %ld, \"gen\": %ld, \"decode_ctx\": %s, \"prefill_tps\": %.1f, "
                       "\"decode_tps\": %.2f, \"decode_weight_bytes\": %" PRIu64 ", ",
                       first ? "" : ",", model, tname, nt, pd_cpu_simd_name(), n_prompt, n_gen, ctx_text,
                       best.prefill_tps, best.decode_tps, sbytes);
                if (bandwidth_on)
                    printf("\"bandwidth_bytes_per_s\": %.6g, \"bandwidth_read\": \"%s\", \"bandwidth_buffer_bytes\": "
                           "%zu, \"decode_bytes_per_s\": %.6g, \"decode_over_bound\": %.4f}",
                           bw, bw_how, bw_bytes, achieved, bw > 0 ? achieved / bw : 0);
                else
                    printf("\"bandwidth_bytes_per_s\": null, \"bandwidth_read\": null, \"bandwidth_buffer_bytes\": "
                           "null, \"decode_bytes_per_s\": %.6g, \"decode_over_bound\": null}",
                           achieved);
            } else {
                if (first) {
                    printf("%-10s %-6s %-7s %-10s %14s %14s", "model", "type", "threads", "simd", "prefill tok/s",
                           "decode tok/s");
                    if (bandwidth_on)
                        printf(" %9s %10s %11s %8s", "MB/token", "bound GB/s", "decode GB/s", "of bound");
                    printf("\n");
                }
                printf("%-10s %-6s %-7ld %-10s %14.1f %14.1f", preset ? preset : "file", tname, nt,
                       pd_cpu_simd_name(), best.prefill_tps, best.decode_tps);
                if (bandwidth_on)
                    printf(" %9.1f %10.1f %11.1f %7.1f%%", (double)sbytes / 1e6, bw / 1e9, achieved / 1e9,
                           bw > 0 ? 100 * achieved / bw : 0);
                printf("\n");
            }
        }
        first = false;
        /* The sections below run on the last model loaded: the device's, or
         * the CPU's with the last --threads count. */
        if (sections && ti == n_rows - 1)
            kept_model = m;
        else
            pd_model_free(m);
    }
    if (json) printf("\n]");
    if (!sections) {
        if (json) printf("\n");
        pd_backend_free(dev_be);
        return 0;
    }

    pd_model *m = kept_model;
    const pd_hparams *hp = pd_model_hparams(m);
    pd_backend_timer *tm = NULL;
    if (pd_backend_timer_create(pd_model_backend(m), &tm, &err)) {
        fprintf(stderr, "prefix-bench: %s\n", err.msg);
        return 1;
    }
    /* The bound of a decode step: on CUDA the device's copy bandwidth and
     * the weights as it holds them; elsewhere (--batches only) the host's
     * streaming-read bandwidth and the file's bytes. */
    bound_info bd = {0};
    if (on_cuda) {
        if (pd_cuda_copy_bandwidth(dev.index, BANDWIDTH_BYTES, &bd.bandwidth, &err)) {
            fprintf(stderr, "prefix-bench: copy bandwidth of %s: %s\n", dev_name, err.msg);
            return 1;
        }
        bd.on = true;
        bd.bandwidth_what = "measured device copy bandwidth";
        bd.weight_bytes = decode_weight_bytes(m, true);
        bd.device_bytes = device_weight_bytes(m);
    } else if (n_batches) {
        const char *how = "";
        if (measure_bandwidth((int)thread_counts[n_threads - 1], bw_buffer_bytes(bw_mib), &bd.bandwidth, &how,
                              &err)) {
            fprintf(stderr, "prefix-bench: bandwidth: %s\n", err.msg);
            return 1;
        }
        bd.on = true;
        bd.bandwidth_what = "measured host streaming-read bandwidth";
        bd.weight_bytes = decode_weight_bytes(m, false);
    }

    /* ---- decode steps at each --batches size ---- */
    if (n_batches) {
        steps_result rs[MAX_PREFIXES];
        for (int i = 0; i < n_batches; i++)
            if (decode_steps(m, tm, (int)batches[i], (int)n_prompt, (int)n_gen, (int)reps, kv_f32, &rs[i], &err)) {
                fprintf(stderr, "prefix-bench: decode steps at batch %ld: %s\n", batches[i], err.msg);
                return 1;
            }
        if (json)
            print_steps_json(&bd, n_prompt, n_gen, reps, rs, n_batches);
        else
            print_steps_table(dev_name, &bd, n_prompt, n_gen, reps, rs, n_batches);
    }

    /* ---- attention at each --attn-keys count ---- */
    if (n_attn && attention_section(m, tm, dev_name, attn_keys, n_attn, batches, n_batches, attn_chunk, reps, json,
                                    &err)) {
        fprintf(stderr, "prefix-bench: attention: %s\n", err.msg);
        return 1;
    }

    /* ---- the compressed-prefix benchmark ---- */
    const uint64_t wbytes = on_cuda ? bd.weight_bytes : 0;
    const double bandwidth = on_cuda ? bd.bandwidth : 0, bound_tps = wbytes ? bandwidth / (double)wbytes : 0;
    if (n_prefixes && json) {
        printf(",\n\"prefix_bench\": {\"model\": \"%s\", \"type\": \"%s\", \"policy\": \"compactor\", "
               "\"retention\": %g, \"suffix\": %d, \"gen\": %ld, \"batch\": %d, ",
               model, pd_type_get(hp->wtype)->name, PREFIX_RETENTION, SUFFIX_TOKENS, n_gen, DECODE_BATCH);
        if (on_cuda)
            printf("\"threads\": null, \"weight_bytes\": %" PRIu64 ", \"device_weight_bytes\": %" PRIu64
                   ", \"copy_bandwidth_bytes_per_s\": %.4g, \"bound_tps\": %.2f, ",
                   wbytes, bd.device_bytes, bandwidth, bound_tps);
        else
            printf("\"threads\": %ld, \"weight_bytes\": null, \"device_weight_bytes\": null, "
                   "\"copy_bandwidth_bytes_per_s\": null, \"bound_tps\": null, ",
                   thread_counts[n_threads - 1]);
        printf("\"results\": [");
    } else if (n_prefixes) {
        printf("\ncompressed prefix: Compactor (default spec) at retention %.2f on %s", PREFIX_RETENTION, dev_name);
        if (!dev_be) printf(", %ld threads", thread_counts[n_threads - 1]);
        printf("; TTFT = attach + %d-token suffix + first logits; decode after the suffix, %ld steps\n",
               SUFFIX_TOKENS, n_gen);
        if (on_cuda)
            printf("device weights: %.3g GB (quantized types in their file blocks)\n"
                   "bound: %.3g GB of weights per decode step / %.1f GB/s measured copy bandwidth = %.1f tok/s\n",
                   (double)bd.device_bytes / 1e9, (double)wbytes / 1e9, bandwidth / 1e9, bound_tps);
        printf("%7s %12s %11s %12s %9s %9s %6s %10s %9s %10s %10s %11s %10s %10s %8s\n", "prefix", "prefill t/s",
               "prefill ms", "compress ms", "score ms", "comp/pre", "kept", "TTFT cold", "TTFT ms", "dec b1 t/s",
               "dec b8 t/s", "full b1 t/s", "comp/full", "bound t/s", "b1/bound");
    }
    for (int pi = 0; pi < n_prefixes; pi++) {
        const int64_t n = prefixes[pi]; /* fits the context: checked at load */
        prefix_result r = {.n = n};
        for (long i = 0; i < reps; i++) {
            if (prefix_once(m, n, (int)n_gen, &r, &err)) {
                fprintf(stderr, "prefix-bench: prefix of %" PRId64 " tokens: %s\n", n, err.msg);
                return 1;
            }
        }
        const double kept_frac = r.full_rows ? (double)r.kept_rows / (double)r.full_rows : 0;
        const double comp_over_full = r.full_b1_tps > 0 ? r.decode_b1_tps / r.full_b1_tps : 0;
        if (json) {
            printf("%s\n  {\"prefix\": %" PRId64 ", \"prefill_tps\": %.1f, \"prefill_ms\": %.2f, "
                   "\"compress_ms\": %.2f, \"score_ms\": %.2f, \"compress_over_prefill\": %.3f, "
                   "\"score_over_prefill\": %.3f, "
                   "\"kept_rows\": %" PRId64 ", \"full_rows\": %" PRId64 ", \"ttft_cold_ms\": %.2f, \"ttft_ms\": %.2f, "
                   "\"decode_b1_tps\": %.1f, \"decode_b8_tps\": %.1f, \"full_decode_b1_tps\": %.1f, "
                   "\"compressed_over_full\": %.3f, ",
                   pi ? "," : "", n, n / r.prefill_s, 1e3 * r.prefill_s, 1e3 * r.compress_s, 1e3 * r.score_s,
                   r.compress_s / r.prefill_s, r.score_s / r.prefill_s, r.kept_rows, r.full_rows,
                   1e3 * r.ttft_cold_s, 1e3 * r.ttft_s, r.decode_b1_tps, r.decode_b8_tps, r.full_b1_tps,
                   comp_over_full);
            if (on_cuda)
                printf("\"bound_tps\": %.1f, \"b1_over_bound\": %.3g}", bound_tps,
                       bound_tps > 0 ? r.decode_b1_tps / bound_tps : 0);
            else
                printf("\"bound_tps\": null, \"b1_over_bound\": null}");
        } else {
            char bound_col[32] = "-", ratio_col[32] = "-";
            if (on_cuda && bound_tps > 0) {
                snprintf(bound_col, sizeof bound_col, "%.1f", bound_tps);
                snprintf(ratio_col, sizeof ratio_col, "%.3g", r.decode_b1_tps / bound_tps);
            }
            printf("%7" PRId64 " %12.1f %11.2f %12.2f %9.2f %9.3f %5.1f%% %10.2f %9.2f %10.1f %10.1f %11.1f %10.3f "
                   "%10s %8s\n",
                   n, n / r.prefill_s, 1e3 * r.prefill_s, 1e3 * r.compress_s, 1e3 * r.score_s,
                   r.compress_s / r.prefill_s, 100 * kept_frac, 1e3 * r.ttft_cold_s, 1e3 * r.ttft_s, r.decode_b1_tps,
                   r.decode_b8_tps, r.full_b1_tps, comp_over_full, bound_col, ratio_col);
        }
        fflush(stdout);
    }
    if (json) printf(n_prefixes ? "\n]}}\n" : "}\n");
    pd_backend_timer_free(tm);
    pd_model_free(m);
    pd_backend_free(dev_be);
    return 0;
}
