/* kernel-bench: matmul micro-benchmark for the CPU backend.
 *
 *   kernel-bench [--threads 1,2] [--types q8_0,f32,...] [--n 1,256]
 *                [--shapes 576x576,192x576,...] [--time SECONDS] [--cold] [--packed] [--attn]
 *
 * For every (type, shape rows x cols, n, threads) it times
 * y[n][rows] = x[n][cols] . W^T and prints microseconds per call, GFLOP/s
 * (2*rows*cols*n per call) and GB/s of weight bytes read (each weight byte
 * once per call). With the default shapes (SmolLM2-135M: dim 576, FFN 1536,
 * 9/3 heads of 64, vocab 32000) it also prints what the matmuls alone would
 * allow in tokens per second for that model: decode (n = 1) and prefill of
 * n tokens (30 layers of q,k,v,o,gate,up,down, plus the output matrix for
 * the last token only).
 *
 * --cold rotates through enough copies of each weight (256 MiB in all) that
 * every call reads its weights from memory, as a forward pass over a model
 * larger than the caches does; without it a matrix stays in cache between
 * calls. --packed rearranges the weights as the model loader does for the
 * CPU (pd_backend_pack_weight: PD_LAYOUT_CPU_X16 for the types this CPU
 * packs at load, q8_0 on AVX-512; the type column then says q8_0/x16; q4_K
 * and q6_K stay in the file's layout and are repacked per call from 16
 * tokens). --attn also times attention for SmolLM2-135M's shape (9 query
 * heads, 3 kv heads of 64): prefill of 256 tokens (causal) and decode of one
 * token over 256 and 2048 cached keys, with f32 and with f16 K/V rows.
 *
 * Each figure is the best of five rounds (other load only adds time).
 * The tool re-executes itself with OPENBLAS_NUM_THREADS=1 unless that is
 * set: the pthreads OpenBLAS otherwise starts a thread per core at load
 * time that spins for a while, stealing a core from the backend's pool (the
 * backend never uses OpenBLAS's own threads).
 * $PD_CPU_SIMD caps the SIMD level and $PD_CPU_GEMM_MIN_N moves the
 * quantized-dot/GEMM threshold, as for the daemon. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kernels/kernels.h"
#include "util/util.h"

#define MAX_LIST 32

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float frand(void) {
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return (float)((double)((rng * 0x2545f4914f6cdd1dull) >> 40) / 16777216.0 * 2.0 - 1.0);
}

static int parse_ints(const char *s, long *out, int max) {
    int n = 0;
    while (*s && n < max) {
        char *end;
        out[n++] = strtol(s, &end, 10);
        if (end == s) return -1;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}

typedef struct shape {
    long rows, cols;
} shape;

static const shape default_shapes[] = {{576, 576}, {192, 576}, {1536, 576}, {576, 1536}, {32000, 576}};

static void usage(FILE *f) {
    fputs("usage: kernel-bench [--threads 1,2]\n"
          "                    [--types q8_0,q4_0,q4_1,q5_0,q5_1,iq4_nl,q2_k,q3_k,q4_k,q5_k,q6_k,iq4_xs,f32,f16,bf16]\n"
          "                    [--n 1,256] [--shapes ROWSxCOLS,...] [--time SECONDS] [--cold] [--packed]\n"
          "                    [--attn]\n",
          f);
}

/* Seconds per call of matmul, timed for at least min_time, cycling through
 * n_copies weights. */
static int time_matmul(pd_backend *be, const pd_weight *w, long n_copies, const float *x, long n, float *y,
                       double min_time, double *out, pd_error *err) {
    int rc = pd_backend_matmul(be, &w[0], x, n, y, err); /* warm up */
    if (rc) return rc;
    /* best of 5 rounds: other processes on the machine only ever add time */
    double best = INFINITY;
    long k = 0;
    for (int round = 0; round < 5; round++) {
        long iters = 0;
        const double t0 = pd_now_seconds();
        double t;
        do {
            rc = pd_backend_matmul(be, &w[k++ % n_copies], x, n, y, err);
            if (rc) return rc;
            iters++;
            t = pd_now_seconds() - t0;
        } while (t < min_time / 5 || iters < 2);
        if (t / (double)iters < best) best = t / (double)iters;
    }
    *out = best;
    return PD_OK;
}

/* Attention timing for one configuration, K/V rows of kv_type (f32, f16). */
static int time_attention(pd_backend *be, long n_tokens, long n_keys, bool causal, pd_type kv_type, double min_time,
                          double *out, pd_error *err) {
    const int nh = 9, nkv = 3, hd = 64;
    float *q = malloc(sizeof(float) * (size_t)(n_tokens * nh * hd));
    float *o = malloc(sizeof(float) * (size_t)(n_tokens * nh * hd));
    float *k = malloc(sizeof(float) * (size_t)(nkv * n_keys * hd));
    float *v = malloc(sizeof(float) * (size_t)(nkv * n_keys * hd));
    int32_t *kpos = malloc(sizeof(int32_t) * (size_t)n_keys);
    int32_t *qpos = malloc(sizeof(int32_t) * (size_t)n_tokens);
    if (!q || !o || !k || !v || !kpos || !qpos) return pd_errorf(err, PD_ENOMEM, "out of memory");
    for (long i = 0; i < n_tokens * nh * hd; i++) q[i] = frand();
    for (long i = 0; i < nkv * n_keys * hd; i++) {
        k[i] = frand();
        v[i] = frand();
    }
    for (long j = 0; j < n_keys; j++) kpos[j] = (int32_t)j;
    for (long t = 0; t < n_tokens; t++) qpos[t] = (int32_t)(n_keys - n_tokens + t);
    const size_t esz = kv_type == PD_TYPE_F16 ? 2 : 4, kv_vals = (size_t)(nkv * n_keys * hd);
    uint16_t *k16 = kv_type == PD_TYPE_F16 ? malloc(2 * kv_vals) : NULL, *v16 = k16 ? malloc(2 * kv_vals) : NULL;
    if (kv_type == PD_TYPE_F16 && (!k16 || !v16)) return pd_errorf(err, PD_ENOMEM, "out of memory");
    if (k16) {
        pd_fp32_to_fp16_row(k, k16, kv_vals);
        pd_fp32_to_fp16_row(v, v16, kv_vals);
    }
    const char *kb = k16 ? (const char *)k16 : (const char *)k, *vb = k16 ? (const char *)v16 : (const char *)v;
    pd_kv_view kv[3];
    for (int g = 0; g < nkv; g++)
        kv[g] = (pd_kv_view){kb + (size_t)g * (size_t)n_keys * hd * esz, vb + (size_t)g * (size_t)n_keys * hd * esz,
                             kpos, NULL, n_keys, kv_type};
    pd_attn_args a = {.q = q, .q_pos = qpos, .n_tokens = n_tokens, .n_head = nh, .n_head_kv = nkv,
                      .head_dim = hd, .n_segments = 1, .kv = kv, .scale = 0.125f, .causal = causal,
                      .out = o};
    int rc = pd_backend_attention(be, &a, err);
    double best = INFINITY;
    for (int round = 0; round < 5 && rc == PD_OK; round++) {
        long iters = 0;
        const double t0 = pd_now_seconds();
        double t = 0;
        while (rc == PD_OK && (t < min_time / 5 || iters < 2)) {
            rc = pd_backend_attention(be, &a, err);
            iters++;
            t = pd_now_seconds() - t0;
        }
        if (t / (double)iters < best) best = t / (double)iters;
    }
    *out = best;
    free(q);
    free(o);
    free(k);
    free(v);
    free(k16);
    free(v16);
    free(kpos);
    free(qpos);
    return rc;
}

int main(int argc, char **argv) {
    pd_cpu_prepare_process(argv);
    long threads[MAX_LIST] = {1, 2}, ns[MAX_LIST] = {1, 256};
    int n_threads = 2, n_ns = 2;
    pd_type types[MAX_LIST] = {PD_TYPE_Q8_0, PD_TYPE_Q4_0, PD_TYPE_Q4_1, PD_TYPE_Q5_0, PD_TYPE_Q5_1,
                               PD_TYPE_IQ4_NL, PD_TYPE_Q2_K, PD_TYPE_Q3_K, PD_TYPE_Q4_K, PD_TYPE_Q5_K,
                               PD_TYPE_Q6_K, PD_TYPE_IQ4_XS, PD_TYPE_F32, PD_TYPE_F16, PD_TYPE_BF16};
    int n_types = 15;
    shape shapes[MAX_LIST];
    int n_shapes = (int)(sizeof default_shapes / sizeof default_shapes[0]);
    memcpy(shapes, default_shapes, sizeof default_shapes);
    bool custom_shapes = false, cold = false, attn = false, packed = false;
    double min_time = 0.3;
    pd_error err = {0};

    static const struct option opts[] = {
        {"threads", required_argument, 0, 't'}, {"types", required_argument, 0, 'y'},
        {"n", required_argument, 0, 'n'},       {"shapes", required_argument, 0, 's'},
        {"time", required_argument, 0, 'T'},    {"help", no_argument, 0, 'h'},
        {"cold", no_argument, 0, 'c'},          {"attn", no_argument, 0, 'a'},
        {"packed", no_argument, 0, 'p'},
        {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 't':
            n_threads = parse_ints(optarg, threads, MAX_LIST);
            if (n_threads <= 0) goto bad;
            break;
        case 'n':
            n_ns = parse_ints(optarg, ns, MAX_LIST);
            if (n_ns <= 0) goto bad;
            break;
        case 'y': {
            n_types = 0;
            char *dup = strdup(optarg), *save = NULL;
            for (char *tok = strtok_r(dup, ",", &save); tok && n_types < MAX_LIST;
                 tok = strtok_r(NULL, ",", &save)) {
                if (pd_type_from_name(tok, &types[n_types], &err)) {
                    fprintf(stderr, "kernel-bench: %s\n", err.msg);
                    free(dup);
                    return 2;
                }
                n_types++;
            }
            free(dup);
            break;
        }
        case 's': {
            n_shapes = 0;
            custom_shapes = true;
            const char *p = optarg;
            while (*p && n_shapes < MAX_LIST) {
                char *end;
                shapes[n_shapes].rows = strtol(p, &end, 10);
                if (*end != 'x') goto bad;
                shapes[n_shapes].cols = strtol(end + 1, &end, 10);
                if (shapes[n_shapes].rows <= 0 || shapes[n_shapes].cols <= 0) goto bad;
                n_shapes++;
                p = *end == ',' ? end + 1 : end;
            }
            break;
        }
        case 'T':
            min_time = atof(optarg);
            if (!(min_time > 0)) goto bad;
            break;
        case 'c': cold = true; break;
        case 'a': attn = true; break;
        case 'p': packed = true; break;
        case 'h': usage(stdout); return 0;
        default: goto bad;
        }
    }
    if (optind != argc) goto bad;

    printf("kernel-bench: simd %s%s\n", pd_cpu_simd_name(), cold ? ", cold weights" : "");
    printf("%-6s %12s %5s %3s %12s %10s %9s\n", "type", "shape", "n", "thr", "us/call", "GFLOP/s", "GB/s");

    long max_n = 1;
    for (int i = 0; i < n_ns; i++)
        if (ns[i] > max_n) max_n = ns[i];
    for (int ti = 0; ti < n_types; ti++) {
        const pd_type t = types[ti];
        const pd_type_traits *tr = pd_type_get((uint32_t)t);
        /* per-model estimate: seconds per call [shape][n][threads] */
        double est[MAX_LIST][MAX_LIST][MAX_LIST];
        memset(est, 0, sizeof est);
        for (int si = 0; si < n_shapes; si++) {
            const long rows = shapes[si].rows, cols = shapes[si].cols;
            if (cols % (long)tr->block_size != 0) {
                printf("%-6s %5ldx%-6ld skipped: cols not a multiple of %u\n", tr->name, rows, cols,
                       tr->block_size);
                continue;
            }
            uint64_t rb;
            if (pd_type_row_size(t, (uint64_t)cols, &rb, &err)) goto fail;
            const size_t wbytes = (size_t)rb * (size_t)rows;
            long n_copies = cold ? (long)((256u << 20) / wbytes) + 1 : 1;
            if (n_copies > 4096) n_copies = 4096;
            uint8_t *wdata = malloc(wbytes * (size_t)n_copies);
            pd_weight *w = malloc(sizeof(pd_weight) * (size_t)n_copies);
            float *src = malloc(sizeof(float) * (size_t)cols);
            float *x = malloc(sizeof(float) * (size_t)cols * (size_t)max_n);
            float *y = malloc(sizeof(float) * (size_t)rows * (size_t)max_n);
            if (!wdata || !w || !src || !x || !y) {
                fprintf(stderr, "kernel-bench: out of memory\n");
                return 1;
            }
            for (long r = 0; r < rows; r++) {
                for (long k = 0; k < cols; k++) src[k] = frand() * 0.1f;
                if (pd_quantize_row(t, src, wdata + (size_t)r * rb, (uint64_t)cols, &err)) goto fail;
            }
            for (long i = 1; i < n_copies; i++) memcpy(wdata + wbytes * (size_t)i, wdata, wbytes);
            for (long i = 0; i < cols * max_n; i++) x[i] = frand();
            for (long i = 0; i < n_copies; i++)
                if (pd_weight_init(&w[i], t, wdata + wbytes * (size_t)i, rows, cols, &err)) goto fail;
            if (packed) {
                pd_backend *be;
                if (pd_backend_cpu_create(1, &be, &err)) goto fail;
                for (long i = 0; i < n_copies && !err.code; i++)
                    (void)pd_backend_pack_weight(be, &w[i], wdata + wbytes * (size_t)i, &err);
                pd_backend_free(be);
                if (err.code) goto fail;
            }
            char tname[32];
            snprintf(tname, sizeof tname, "%s%s", tr->name, w[0].layout == PD_LAYOUT_CPU_X16 ? "/x16" : "");
            for (int hi = 0; hi < n_threads; hi++) {
                pd_backend *be;
                if (pd_backend_cpu_create((int)threads[hi], &be, &err)) goto fail;
                for (int ni = 0; ni < n_ns; ni++) {
                    double sec = 0;
                    if (time_matmul(be, w, n_copies, x, ns[ni], y, min_time, &sec, &err)) {
                        pd_backend_free(be);
                        goto fail;
                    }
                    est[si][ni][hi] = sec;
                    const double flops = 2.0 * (double)rows * (double)cols * (double)ns[ni];
                    printf("%-6s %5ldx%-6ld %5ld %3ld %12.1f %10.1f %9.2f\n", tname, rows, cols, ns[ni],
                           threads[hi], sec * 1e6, flops / sec * 1e-9, (double)rb * (double)rows / sec * 1e-9);
                    fflush(stdout);
                }
                pd_backend_free(be);
            }
            free(wdata);
            free(w);
            free(src);
            free(x);
            free(y);
        }
        /* SmolLM2-135M estimate when the default shapes were measured */
        if (!custom_shapes && tr->block_size <= 64) {
            int n1 = -1;
            for (int ni = 0; ni < n_ns; ni++)
                if (ns[ni] == 1) n1 = ni;
            for (int hi = 0; hi < n_threads && n1 >= 0; hi++) {
                /* per layer: q,o 576x576; k,v 192x576; gate,up 1536x576; down 576x1536 */
                const double dec = 30.0 * (2 * est[0][n1][hi] + 2 * est[1][n1][hi] + 2 * est[2][n1][hi] +
                                           est[3][n1][hi]) +
                                   est[4][n1][hi];
                printf("%-6s smollm2-135m matmuls only, %ld thr: decode %.1f tok/s", tr->name, threads[hi],
                       1.0 / dec);
                for (int ni = 0; ni < n_ns; ni++) {
                    if (ns[ni] <= 1) continue;
                    const double pre = 30.0 * (2 * est[0][ni][hi] + 2 * est[1][ni][hi] +
                                               2 * est[2][ni][hi] + est[3][ni][hi]) +
                                       est[4][n1][hi];
                    printf(", prefill-%ld %.1f tok/s", ns[ni], (double)ns[ni] / pre);
                }
                printf("\n");
            }
        }
    }
    if (attn) {
        printf("%-28s %3s %12s %12s\n", "attention (9/3 heads x 64)", "thr", "f32 us/call", "f16 us/call");
        for (int hi = 0; hi < n_threads; hi++) {
            pd_backend *be;
            if (pd_backend_cpu_create((int)threads[hi], &be, &err)) goto fail;
            const struct {
                const char *name;
                long nt, nk;
                bool causal;
            } cfg[] = {{"prefill 256 (causal)", 256, 256, true},
                       {"decode 1 over 256 keys", 1, 256, true},
                       {"decode 1 over 2048 keys", 1, 2048, true}};
            for (int i = 0; i < 3; i++) {
                double sec[2] = {0, 0};
                for (int t = 0; t < 2; t++)
                    if (time_attention(be, cfg[i].nt, cfg[i].nk, cfg[i].causal, t ? PD_TYPE_F16 : PD_TYPE_F32,
                                       min_time, &sec[t], &err)) {
                        pd_backend_free(be);
                        goto fail;
                    }
                printf("%-28s %3ld %12.1f %12.1f\n", cfg[i].name, threads[hi], sec[0] * 1e6, sec[1] * 1e6);
            }
            pd_backend_free(be);
        }
    }
    return 0;
fail:
    fprintf(stderr, "kernel-bench: %s\n", err.msg);
    return 1;
bad:
    usage(stderr);
    return 2;
}
