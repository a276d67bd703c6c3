// Compactor scores of one layer on the GPU (pd_token_score_args in
// kernels/kernels.h). The CPU reference is policies/score_compactor.c
// (pd_leverage_scores in approx mode, pd_noncausal_colsum, pd_avg_pool,
// pd_zscore, layer_leverage, layer_attention, pd_score_compactor); every
// step below names the CPU function it mirrors, and keeps the CPU's choice
// of float or double so that the kept indices agree.
//
// Only the final [n_head_kv][hi - lo] scores travel to the host, plus a few
// ints per (kv head, chunk) pair for the error checks the CPU makes.
//
// Leverage, per (kv head h, chunk c) "pair" p = h * n_chunks + c, processed
// in batches of pairs so that scratch stays bounded whatever the sketch:
//   1. lev_means_kernel: column means of the chunk's pre-RoPE keys in
//      double; the smallest non-finite dimension goes to bad_dim[p].
//   2. lev_sketch_kernel: X_p = (rows - mean) * phi in double, stored
//      row-major [L][sketch] with rows past the chunk's end set to zero, so
//      every pair has the same shape (zero rows add nothing to X^T X and
//      get leverage 0, which is never read).
//   3. G_p = X_p^T X_p (one cublasDgemmStridedBatched), + ridge_p I, batched
//      Cholesky (cusolverDnDpotrfBatched). Pairs whose factorisation fails
//      get ridge x10 (0 -> 1e-2) and the whole batch is refactored, up to
//      LEV_MAX_TRIES tries: refactoring a pair that already succeeded with
//      the same ridge gives the same factor.
//   4. X_p := L_p^-1 X_p^T (cublasDtrsmBatched on the column-major view),
//      l_i = ||row i||^2 (lev_norms_kernel), the smallest non-finite row
//      goes to bad_row[p].
//   5. The host reads bad_dim / info / bad_row of the batch and reports the
//      first failing pair in (head, chunk) order with the CPU's message and
//      precedence (keys, then Cholesky, then non-finite score).
// Attention, per kv head, in chunks of attn_chunk tokens (non-causal):
//   1. nc_rowstats_kernel: for each query row of each query head, the
//      softmax max and 1 / sum over the chunk's keys (online over key tiles,
//      as the CPU's long-chunk path does).
//   2. nc_colsum_kernel: each block owns a tile of keys and sums, over all
//      the chunk's query rows of the kv head's query heads, the normalised
//      weights in double: no atomics, so the result is deterministic.
//   Both recompute the logits with logits_tile (a small shared-memory SGEMM
//   tile, f32 with f32 accumulation like the CPU's cblas_sgemm).
//   3. times ||v|| (vnorm_kernel), average pool (pool_kernel).
// Both halves: z-score over all (head, token) (zscore_stats_kernel, one
// block, fixed reduction order; zscore_apply_kernel), then
// att + lambda * lev (combine_kernel).
#include "kernels/cuda/cuda_internal.h"

#include <cinttypes>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

// ---- constants shared with the CPU reference -------------------------------

constexpr int LEV_MAX_TRIES = 5;      // score_compactor.c: LEV_MAX_TRIES
constexpr int SKETCH_MAX = 4096;      // score_compactor.c: check_spec
constexpr double SD_FLOOR = 1e-6;     // pd_zscore
// Scratch for one batch of leverage pairs (X, G and friends). A single pair
// may exceed it (it then runs alone), as the CPU's own buffers would.
constexpr size_t LEV_BATCH_BYTES = (size_t)256 << 20;
constexpr int MAX_GRID_YZ = 65535;    // gridDim.y / gridDim.z limit

// ---- attention tiles -------------------------------------------------------

// logits_tile computes an AT_TQ x AT_TK tile of scaled logits with
// AT_THREADS threads, each owning a 4 x 4 micro-tile (rows ty + 16 i,
// columns tx + 16 j), over slabs of AT_DK dimensions staged in shared memory.
constexpr int AT_TQ = 64, AT_TK = 64, AT_DK = 16, AT_THREADS = 256;
static_assert(AT_TQ == 4 * 16 && AT_TK == 4 * 16 && AT_THREADS == 16 * 16, "micro-tile layout");
static_assert(AT_TQ % (AT_THREADS / 32) == 0, "rows split evenly over warps");
static_assert(AT_THREADS % AT_TK == 0 && AT_TQ % (AT_THREADS / AT_TK) == 0, "column-sum layout");
constexpr int ROWS_PER_WARP = AT_TQ / (AT_THREADS / 32);    // nc_rowstats_kernel
constexpr int COL_GROUPS = AT_THREADS / AT_TK;              // nc_colsum_kernel
constexpr int ROWS_PER_GROUP = AT_TQ / COL_GROUPS;

struct attn_geom {
    const float *q;     // row lo of the range is q + lo * q_stride
    const float *k;
    int64_t q_stride;   // floats between token rows: n_head * head_dim
    int64_t k_stride;   // n_head_kv * head_dim
    int64_t lo, m;      // the scored range [lo, lo + m)
    int64_t chunk;      // attention chunk, 1..m
    int d, g;           // head_dim, query heads per kv head
    float scale;
};

struct tile_smem {
    float qs[AT_DK][AT_TQ + 1]; // +1: the transposing stores do not all hit one bank
    float ks[AT_DK][AT_TK + 1];
    float s[AT_TQ][AT_TK + 1];
};

// s[i][j] = scale * dot(q row i, k row j) for i < AT_TQ, j < AT_TK, with rows
// at or past rq (queries) / rk (keys) read as zeros. qbase / kbase point at
// the tile's first row, already offset to the head. Ends with a barrier, so
// s is ready for every thread; the caller must barrier before the next call
// once it has finished reading s.
__device__ void logits_tile(const float *qbase, int rq, const float *kbase, int rk, const attn_geom &ag,
                            tile_smem &sm) {
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    float acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    for (int j0 = 0; j0 < ag.d; j0 += AT_DK) {
        // Consecutive threads read consecutive dimensions of one row.
        for (int e = tid; e < AT_TQ * AT_DK; e += AT_THREADS) {
            int r = e / AT_DK, jj = e % AT_DK;
            sm.qs[jj][r] = r < rq && j0 + jj < ag.d ? qbase[(int64_t)r * ag.q_stride + j0 + jj] : 0.0f;
        }
        for (int e = tid; e < AT_TK * AT_DK; e += AT_THREADS) {
            int r = e / AT_DK, jj = e % AT_DK;
            sm.ks[jj][r] = r < rk && j0 + jj < ag.d ? kbase[(int64_t)r * ag.k_stride + j0 + jj] : 0.0f;
        }
        __syncthreads();
        for (int jj = 0; jj < AT_DK; jj++) {
            float a[4], b[4];
            for (int i = 0; i < 4; i++) {
                a[i] = sm.qs[jj][ty + 16 * i];
                b[i] = sm.ks[jj][tx + 16 * i];
            }
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
    // cblas_sgemm's alpha: scale times the finished dot product.
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) sm.s[ty + 16 * i][tx + 16 * j] = ag.scale * acc[i][j];
    __syncthreads();
}

// Butterfly reduction: every lane ends with the same value (a + b == b + a
// in floating point, so the partial sums agree bit for bit); the float max
// is cuda_warp_max (cuda_internal.h).
__device__ double warp_sum(double v) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Tokens [c0, c0 + len) of the range form attention chunk `chunk_index`.
__device__ void chunk_bounds(const attn_geom &ag, int64_t chunk_index, int64_t *c0, int64_t *len) {
    *c0 = chunk_index * ag.chunk;
    int64_t rest = ag.m - *c0;
    *len = rest < ag.chunk ? rest : ag.chunk;
}

// Pass 1 of pd_noncausal_colsum: per query row, the max logit and
// 1 / sum exp(logit - max) over the keys of its chunk. Grid: x = chunk *
// tiles_per_chunk + query tile, y = query head. Row state lives in the
// registers of the warp that owns the row (every lane holds a copy).
__global__ void __launch_bounds__(AT_THREADS)
nc_rowstats_kernel(attn_geom ag, int64_t tiles_per_chunk, float *row_max, double *row_inv) {
    __shared__ tile_smem sm;
    const int qh = blockIdx.y, h = qh / ag.g;
    const int64_t chunk_index = blockIdx.x / tiles_per_chunk, tile = blockIdx.x % tiles_per_chunk;
    int64_t c0, len;
    chunk_bounds(ag, chunk_index, &c0, &len);
    const int64_t r0 = tile * AT_TQ;
    if (r0 >= len) return; // a tile past the end of a short last chunk: the whole block leaves
    const int rq = (int)(len - r0 < AT_TQ ? len - r0 : AT_TQ);
    const float *qbase = ag.q + (ag.lo + c0 + r0) * ag.q_stride + (int64_t)qh * ag.d;
    const float *kchunk = ag.k + (ag.lo + c0) * ag.k_stride + (int64_t)h * ag.d;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    double run_max[ROWS_PER_WARP], run_sum[ROWS_PER_WARP];
    for (int i = 0; i < ROWS_PER_WARP; i++) {
        run_max[i] = -INFINITY;
        run_sum[i] = 0.0;
    }
    for (int64_t k0 = 0; k0 < len; k0 += AT_TK) {
        const int rk = (int)(len - k0 < AT_TK ? len - k0 : AT_TK);
        logits_tile(qbase, rq, kchunk + k0 * ag.k_stride, rk, ag, sm);
        for (int i = 0; i < ROWS_PER_WARP; i++) {
            const float *s = sm.s[warp * ROWS_PER_WARP + i];
            float mx = -INFINITY;
            for (int j = lane; j < rk; j += 32) mx = fmaxf(mx, s[j]);
            mx = cuda_warp_max(mx);
            // The CPU's online update: rescale the running sum in double.
            if (mx > run_max[i]) {
                run_sum[i] *= exp(run_max[i] - (double)mx); // exp(-inf) = 0 on the first tile
                run_max[i] = mx;
            }
            const float rm = (float)run_max[i];
            double part = 0.0;
            for (int j = lane; j < rk; j += 32) part += (double)expf(s[j] - rm);
            run_sum[i] += warp_sum(part);
        }
        __syncthreads(); // everyone is done with sm.s before the next tile
    }
    if (lane == 0)
        for (int i = 0; i < ROWS_PER_WARP; i++) {
            const int r = warp * ROWS_PER_WARP + i;
            if (r >= rq) continue;
            const int64_t at = (int64_t)qh * ag.m + c0 + r0 + r;
            row_max[at] = (float)run_max[i];
            row_inv[at] = 1.0 / run_sum[i];
        }
}

// Pass 2: column sums of the normalised weights. Grid: x = chunk *
// ktiles_per_chunk + key tile, y = kv head. Thread (group, col) sums rows
// group * ROWS_PER_GROUP .. + ROWS_PER_GROUP of every query tile of every
// query head of the kv head; the groups are added in a fixed order at the
// end. out: [n_head_kv][m] floats.
__global__ void __launch_bounds__(AT_THREADS)
nc_colsum_kernel(attn_geom ag, int64_t ktiles_per_chunk, const float *row_max, const double *row_inv, float *out) {
    __shared__ tile_smem sm;
    __shared__ float rmax_s[AT_TQ];
    __shared__ double rinv_s[AT_TQ];
    __shared__ double part[COL_GROUPS][AT_TK];
    const int h = blockIdx.y;
    const int64_t chunk_index = blockIdx.x / ktiles_per_chunk, tile = blockIdx.x % ktiles_per_chunk;
    int64_t c0, len;
    chunk_bounds(ag, chunk_index, &c0, &len);
    const int64_t k0 = tile * AT_TK;
    if (k0 >= len) return;
    const int rk = (int)(len - k0 < AT_TK ? len - k0 : AT_TK);
    const float *kbase = ag.k + (ag.lo + c0 + k0) * ag.k_stride + (int64_t)h * ag.d;
    const int col = threadIdx.x % AT_TK, group = threadIdx.x / AT_TK;

    double acc = 0.0;
    for (int qi = 0; qi < ag.g; qi++) {
        const int qh = h * ag.g + qi;
        for (int64_t r0 = 0; r0 < len; r0 += AT_TQ) {
            const int rq = (int)(len - r0 < AT_TQ ? len - r0 : AT_TQ);
            if (threadIdx.x < AT_TQ) {
                // Made visible by the first barrier inside logits_tile.
                const int64_t at = (int64_t)qh * ag.m + c0 + r0 + threadIdx.x;
                rmax_s[threadIdx.x] = (int)threadIdx.x < rq ? row_max[at] : 0.0f;
                rinv_s[threadIdx.x] = (int)threadIdx.x < rq ? row_inv[at] : 0.0;
            }
            logits_tile(ag.q + (ag.lo + c0 + r0) * ag.q_stride + (int64_t)qh * ag.d, rq, kbase, rk, ag, sm);
            const int r_end = (group + 1) * ROWS_PER_GROUP < rq ? (group + 1) * ROWS_PER_GROUP : rq;
            for (int r = group * ROWS_PER_GROUP; r < r_end; r++)
                acc += (double)expf(sm.s[r][col] - rmax_s[r]) * rinv_s[r];
            __syncthreads(); // sm.s, rmax_s and rinv_s are rewritten next
        }
    }
    part[group][col] = acc;
    __syncthreads();
    if (group == 0 && col < rk) {
        double total = 0.0;
        for (int gidx = 0; gidx < COL_GROUPS; gidx++) total += part[gidx][col];
        out[(int64_t)h * ag.m + c0 + k0 + col] = (float)total;
    }
}

// layer_attention's vnorm: s[i] = (float)(s[i] * sqrt(sum v^2)), the sum in
// double in dimension order like the CPU.
__global__ void vnorm_kernel(float *att, const float *v, int64_t v_stride, int64_t lo, int64_t m, int n_head_kv,
                             int d) {
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (int64_t)n_head_kv * m) return;
    const int64_t h = idx / m, i = idx % m;
    const float *row = v + (lo + i) * v_stride + h * d;
    double sq = 0.0;
    for (int j = 0; j < d; j++) sq += (double)row[j] * row[j];
    att[idx] = (float)((double)att[idx] * sqrt(sq));
}

// pd_avg_pool per head: window [i - w/2, i - w/2 + w - 1], zeros outside,
// sum in double, divided by w.
__global__ void pool_kernel(const float *in, float *out, int64_t m, int n_head_kv, int w) {
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (int64_t)n_head_kv * m) return;
    const int64_t h = idx / m, i = idx % m;
    const int64_t left = w / 2, right = (int64_t)w - 1 - left;
    const int64_t j0 = i - left < 0 ? 0 : i - left, j1 = i + right < m - 1 ? i + right : m - 1;
    double sum = 0.0;
    for (int64_t j = j0; j <= j1; j++) sum += in[h * m + j];
    out[idx] = (float)(sum / w);
}

// ---- z-score and blend -----------------------------------------------------

constexpr int Z_THREADS = 1024;

// Sum over the block in a fixed tree order; every thread gets the result.
__device__ double block_sum(double v, double *red) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int o = Z_THREADS / 2; o > 0; o /= 2) {
        if ((int)threadIdx.x < o) red[threadIdx.x] = __dadd_rn(red[threadIdx.x], red[threadIdx.x + o]);
        __syncthreads();
    }
    double total = red[0];
    __syncthreads(); // red is reused by the next call
    return total;
}

// pd_zscore's two passes (mean, then population variance) in double, sd
// floored at SD_FLOOR. One block, so the order of the sums is fixed.
// stats[0] = mean, stats[1] = sd.
__global__ void __launch_bounds__(Z_THREADS) zscore_stats_kernel(const float *x, int64_t n, double *stats) {
    __shared__ double red[Z_THREADS];
    double s = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += Z_THREADS) s += x[i];
    const double mean = block_sum(s, red) / (double)n;
    double v = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += Z_THREADS) {
        const double dv = (double)x[i] - mean;
        v = __dadd_rn(v, __dmul_rn(dv, dv)); // no FMA contraction, as on the CPU
    }
    double sd = sqrt(block_sum(v, red) / (double)n);
    if (sd < SD_FLOOR) sd = SD_FLOOR;
    if (threadIdx.x == 0) {
        stats[0] = mean;
        stats[1] = sd;
    }
}

__global__ void zscore_apply_kernel(float *x, int64_t n, const double *stats) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = (float)(((double)x[i] - stats[0]) / stats[1]);
}

// pd_score_compactor: (float)((double)att + lambda * lev), rounded twice
// like the CPU (no FMA).
__global__ void combine_kernel(float *att, const float *lev, int64_t n, double lambda) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) att[i] = (float)__dadd_rn((double)att[i], __dmul_rn(lambda, (double)lev[i]));
}

// ---- leverage ----------------------------------------------------------------

struct lev_geom {
    const float *k_pre; // row lo of the range is k_pre + lo * k_stride
    int64_t k_stride;   // n_head_kv * head_dim
    int64_t lo, m;      // the scored range
    int64_t len;        // chunk length L (the last chunk of a head may be shorter)
    int64_t n_chunks;   // chunks per head
    int d, sketch;
};

// Pair p (global index) is chunk p % n_chunks of kv head p / n_chunks.
__device__ void pair_bounds(const lev_geom &lg, int64_t p, int *h, int64_t *c0, int64_t *rows) {
    *h = (int)(p / lg.n_chunks);
    *c0 = (p % lg.n_chunks) * lg.len;
    const int64_t rest = lg.m - *c0;
    *rows = rest < lg.len ? rest : lg.len;
}

__device__ const float *pair_rows(const lev_geom &lg, int h, int64_t c0) {
    return lg.k_pre + (lg.lo + c0) * lg.k_stride + (int64_t)h * lg.d;
}

__global__ void fill_int_kernel(int *x, int n, int value) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = value;
}

// column_means: grid (batch pair, 32-column tile), block (32, 8). Thread
// (tx, ty) sums rows ty, ty + 8, ... of column j; the 8 partials are added in
// order. A non-finite sum marks bad_dim[pair] (smallest such j).
__global__ void lev_means_kernel(lev_geom lg, int64_t p0, double *mean, int *bad_dim) {
    __shared__ double part[8][32];
    const int pl = blockIdx.x;
    int h;
    int64_t c0, rows;
    pair_bounds(lg, p0 + pl, &h, &c0, &rows);
    const float *base = pair_rows(lg, h, c0);
    const int j = blockIdx.y * 32 + threadIdx.x;
    double sum = 0.0;
    if (j < lg.d)
        for (int64_t i = threadIdx.y; i < rows; i += 8) sum += base[i * lg.k_stride + j];
    part[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0 && j < lg.d) {
        double total = 0.0;
        for (int t = 0; t < 8; t++) total += part[t][threadIdx.x];
        if (!isfinite(total)) atomicMin(&bad_dim[pl], j);
        mean[(int64_t)pl * lg.d + j] = total / (double)rows;
    }
}

// X = (rows - mean) * phi in double: a 16 x 16 tiled GEMM. Grid (row tile,
// sketch tile, batch pair). X of batch pair pl is row-major [len][sketch];
// rows at or past the chunk's end are written as zeros.
constexpr int SK_T = 16;
__global__ void lev_sketch_kernel(lev_geom lg, int64_t p0, const double *mean, const double *phi, double *x) {
    __shared__ double a_s[SK_T][SK_T + 1];
    __shared__ double b_s[SK_T][SK_T + 1];
    const int pl = blockIdx.z;
    int h;
    int64_t c0, rows;
    pair_bounds(lg, p0 + pl, &h, &c0, &rows);
    const float *base = pair_rows(lg, h, c0);
    const double *mu = mean + (int64_t)pl * lg.d;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int64_t r = (int64_t)blockIdx.x * SK_T + ty;
    const int sc = blockIdx.y * SK_T + tx;
    double acc = 0.0;
    for (int j0 = 0; j0 < lg.d; j0 += SK_T) {
        const int ja = j0 + tx, jb = j0 + ty;
        a_s[ty][tx] = r < rows && ja < lg.d ? (double)base[r * lg.k_stride + ja] - mu[ja] : 0.0;
        b_s[ty][tx] = jb < lg.d && sc < lg.sketch ? phi[(int64_t)jb * lg.sketch + sc] : 0.0;
        __syncthreads();
        for (int t = 0; t < SK_T; t++) acc += a_s[ty][t] * b_s[t][tx];
        __syncthreads();
    }
    if (r < lg.len && sc < lg.sketch) x[((int64_t)pl * lg.len + r) * lg.sketch + sc] = acc;
}

__global__ void lev_pointers_kernel(double *g, double *x, int64_t g_elems, int64_t x_elems, int nb, double **g_ptr,
                                    double **x_ptr) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < nb) {
        g_ptr[i] = g + (int64_t)i * g_elems;
        x_ptr[i] = x + (int64_t)i * x_elems;
    }
}

// G_pl += ridge[pl] I.
__global__ void lev_add_ridge_kernel(double *g, int sketch, const double *ridge) {
    const int pl = blockIdx.x;
    double *gp = g + (int64_t)pl * sketch * sketch;
    for (int j = threadIdx.x; j < sketch; j += blockDim.x) gp[(int64_t)j * sketch + j] += ridge[pl];
}

// l_i = ||L^-1 x_i||^2 from the solved X (row-major [len][sketch]), summed in
// dimension order; (float)(l < 0 ? 0 : l) like the CPU, which keeps NaN.
// Grid (row block, batch pair).
__global__ void lev_norms_kernel(lev_geom lg, int64_t p0, const double *x, float *lev, int *bad_row) {
    const int pl = blockIdx.y;
    int h;
    int64_t c0, rows;
    pair_bounds(lg, p0 + pl, &h, &c0, &rows);
    const int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const double *xr = x + ((int64_t)pl * lg.len + r) * lg.sketch;
    double l = 0.0;
    for (int j = 0; j < lg.sketch; j++) l += xr[j] * xr[j];
    const float out = (float)(l < 0 ? 0.0 : l);
    lev[(int64_t)h * lg.m + c0 + r] = out;
    if (!isfinite(out)) atomicMin(&bad_row[pl], (int)r);
}

// ---- host side -----------------------------------------------------------------

#define CK_CUDA(call, what)                                                                        \
    do {                                                                                           \
        cudaError_t ck_e_ = (call);                                                                \
        if (ck_e_ != cudaSuccess) return cuda_fail(err, ck_e_, what);                              \
    } while (0)
#define CK_CUBLAS(call, what)                                                                      \
    do {                                                                                           \
        cublasStatus_t ck_s_ = (call);                                                             \
        if (ck_s_ != CUBLAS_STATUS_SUCCESS) return cublas_fail(err, ck_s_, what);                  \
    } while (0)
#define CK_CUSOLVER(call, what)                                                                    \
    do {                                                                                           \
        cusolverStatus_t ck_s_ = (call);                                                           \
        if (ck_s_ != CUSOLVER_STATUS_SUCCESS) return cusolver_fail(err, ck_s_, what);              \
    } while (0)
#define CK_LAUNCH(what)                                                                            \
    do {                                                                                           \
        int ck_rc_ = cuda_check_launch(err, what);                                                 \
        if (ck_rc_) return ck_rc_;                                                                 \
    } while (0)

// malloc'd host array freed on scope exit (no exceptions across extern "C").
template <typename T> struct host_array {
    T *p = nullptr;
    host_array() = default;
    host_array(const host_array &) = delete;
    host_array &operator=(const host_array &) = delete;
    ~host_array() { free(p); }
    bool alloc(size_t n) {
        p = static_cast<T *>(malloc(n > 0 ? n * sizeof(T) : 1));
        return p != nullptr;
    }
};

// The backend's cuBLAS handle is shared: use host pointer mode for our
// scalars and put back whatever the handle had.
struct pointer_mode_guard {
    cublasHandle_t h;
    cublasPointerMode_t saved = CUBLAS_POINTER_MODE_HOST;
    bool active = false;
    explicit pointer_mode_guard(cublasHandle_t handle) : h(handle) {}
    pointer_mode_guard(const pointer_mode_guard &) = delete;
    pointer_mode_guard &operator=(const pointer_mode_guard &) = delete;
    cublasStatus_t set_host() {
        cublasStatus_t s = cublasGetPointerMode(h, &saved);
        if (s != CUBLAS_STATUS_SUCCESS) return s;
        s = cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST);
        active = s == CUBLAS_STATUS_SUCCESS;
        return s;
    }
    ~pointer_mode_guard() {
        if (active) cublasSetPointerMode(h, saved);
    }
};

// Offsets into the one scratch block, each aligned to 256 bytes; `ok`
// turns false on size_t overflow.
struct carve {
    size_t total = 0;
    bool ok = true;
    size_t take(uint64_t count, size_t elem) {
        uint64_t bytes;
        if (__builtin_mul_overflow(count, (uint64_t)elem, &bytes) || bytes > SIZE_MAX - total - 256) {
            ok = false;
            return 0;
        }
        size_t off = total;
        total += ((size_t)bytes + 255) & ~(size_t)255;
        return off;
    }
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

unsigned grid_1d(int64_t n, int threads) { return (unsigned)ceil_div(n, threads); }

int check_args(const pd_token_score_args *a, pd_error *err) {
    if (!a || !a->scores)
        return pd_errorf(err, PD_EINVAL, "cuda compactor: arguments and the scores array must not be NULL");
    if (a->n_head <= 0 || a->n_head_kv <= 0 || a->head_dim <= 0 || a->n_head % a->n_head_kv != 0)
        return pd_errorf(err, PD_EINVAL,
                         "cuda compactor: n_head %d, n_head_kv %d, head_dim %d; all must be positive and n_head a "
                         "multiple of n_head_kv",
                         a->n_head, a->n_head_kv, a->head_dim);
    if (a->n_tokens < 0 || a->lo < 0 || a->lo > a->hi || a->hi > a->n_tokens)
        return pd_errorf(err, PD_EINVAL,
                         "cuda compactor: token range [%" PRId64 ", %" PRId64 ") must satisfy 0 <= lo <= hi <= %" PRId64,
                         a->lo, a->hi, a->n_tokens);
    if (!a->use_leverage && !a->use_attention)
        return pd_errorf(err, PD_EINVAL, "cuda compactor: neither leverage nor attention is enabled");
    if (a->use_leverage) {
        if (!a->k_pre || !a->phi)
            return pd_errorf(err, PD_EINVAL, "cuda compactor: leverage needs the pre-RoPE keys and a sketch matrix");
        if (a->sketch <= 0 || a->sketch > SKETCH_MAX)
            return pd_errorf(err, PD_EINVAL, "sketch=%d is out of range; use 1..%d (default 48)", a->sketch,
                             SKETCH_MAX);
        if (!(a->ridge >= 0) || !std::isfinite(a->ridge))
            return pd_errorf(err, PD_EINVAL, "ridge=%g must be finite and >= 0", a->ridge);
        if (a->lev_chunk < 0)
            return pd_errorf(err, PD_EINVAL, "lev_chunk=%" PRId64 " must be >= 0 (0 = whole range)", a->lev_chunk);
    }
    if (a->use_attention) {
        if (!a->q || !a->k || (a->vnorm && !a->v))
            return pd_errorf(err, PD_EINVAL,
                             "cuda compactor: attention needs the queries and keys%s", a->vnorm ? " and values" : "");
        if (a->attn_chunk <= 0)
            return pd_errorf(err, PD_EINVAL, "attn_chunk=%" PRId64 " must be > 0", a->attn_chunk);
        if (!(a->scale >= 0) || !std::isfinite(a->scale))
            return pd_errorf(err, PD_EINVAL, "scale=%g must be finite and >= 0 (0 = 1/sqrt(head_dim))",
                             (double)a->scale);
        if (a->pool < 1 || a->pool % 2 == 0)
            return pd_errorf(err, PD_EINVAL, "pool=%d must be an odd width >= 1 (1 = none)", a->pool);
    }
    if (a->use_leverage && a->use_attention && !std::isfinite(a->lambda))
        return pd_errorf(err, PD_EINVAL, "lambda=%g must be finite", a->lambda);
    if (a->n_head > MAX_GRID_YZ)
        return pd_errorf(err, PD_EUNSUPPORTED, "cuda compactor: %d query heads; at most %d are supported", a->n_head,
                         MAX_GRID_YZ);
    return PD_OK;
}

// The scratch layout of one call (byte offsets into the SCORE slot).
struct layout {
    // leverage
    size_t phi, lev;
    size_t mean, x, g, g_ptr, x_ptr, info, bad_dim, bad_row, ridge;
    // attention
    size_t att, att_tmp, row_max, row_inv;
    size_t stats;
};

struct lev_plan {
    lev_geom lg;
    int64_t pairs;   // n_head_kv * n_chunks
    int batch;       // pairs per batch
};

// Download n ints (or doubles) after everything queued so far.
template <typename T> int download_small(cuda_backend *cb, T *dst, const T *src, size_t n, pd_error *err) {
    return cuda_download(cb, dst, src, n * sizeof(T), err);
}

// The CPU's messages (pd_leverage_scores, leverage_chunk_approx), with the
// "rows [c0, c0 + m)" and "kv head h" prefixes; the caller adds the layer.
int lev_pair_error(const lev_plan &lp, int64_t p, int bad_dim, int info, double ridge, int bad_row, pd_error *err) {
    const int h = (int)(p / lp.lg.n_chunks);
    const int64_t c0 = (p % lp.lg.n_chunks) * lp.lg.len;
    const int64_t rows = lp.lg.m - c0 < lp.lg.len ? lp.lg.m - c0 : lp.lg.len;
    if (bad_dim != INT_MAX)
        pd_errorf(err, PD_ERANGE, "leverage: dimension %d of the keys holds inf or NaN", bad_dim);
    else if (info != 0)
        pd_errorf(err, PD_ERANGE,
                  "leverage: Cholesky of the sketched Gram matrix failed %d times (last ridge %g); the keys are "
                  "degenerate at this scale, raise ridge",
                  LEV_MAX_TRIES, ridge);
    else
        pd_errorf(err, PD_ERANGE, "leverage: non-finite score at row %" PRId64 "; the keys hold inf or NaN",
                  c0 + bad_row);
    pd_error_prefix(err, "rows [%" PRId64 ", %" PRId64 ")", c0, c0 + rows);
    pd_error_prefix(err, "kv head %d", h);
    return PD_ERANGE;
}

// Leverage of every (head, chunk) pair into lev [n_head_kv][m] (not yet
// z-scored). See the file comment for the steps.
int lev_run(cuda_backend *cb, const lev_plan &lp, char *base, const layout &lay, double ridge0, pd_error *err) {
    const lev_geom &lg = lp.lg;
    const int s = lg.sketch;
    double *phi = reinterpret_cast<double *>(base + lay.phi);
    float *lev = reinterpret_cast<float *>(base + lay.lev);
    double *mean = reinterpret_cast<double *>(base + lay.mean);
    double *x = reinterpret_cast<double *>(base + lay.x);
    double *g = reinterpret_cast<double *>(base + lay.g);
    double **g_ptr = reinterpret_cast<double **>(base + lay.g_ptr);
    double **x_ptr = reinterpret_cast<double **>(base + lay.x_ptr);
    int *info = reinterpret_cast<int *>(base + lay.info);
    int *bad_dim = reinterpret_cast<int *>(base + lay.bad_dim);
    int *bad_row = reinterpret_cast<int *>(base + lay.bad_row);
    double *ridge = reinterpret_cast<double *>(base + lay.ridge);

    host_array<int> info_h, bad_dim_h, bad_row_h;
    host_array<double> ridge_h;
    host_array<bool> done;
    const size_t nbmax = (size_t)lp.batch;
    if (!info_h.alloc(nbmax) || !bad_dim_h.alloc(nbmax) || !bad_row_h.alloc(nbmax) || !ridge_h.alloc(nbmax) ||
        !done.alloc(nbmax))
        return pd_errorf(err, PD_ENOMEM, "cuda compactor: out of host memory for %d leverage statuses", lp.batch);

    const double one = 1.0, zero = 0.0;
    for (int64_t p0 = 0; p0 < lp.pairs; p0 += lp.batch) {
        const int nb = (int)(lp.pairs - p0 < lp.batch ? lp.pairs - p0 : lp.batch);
        fill_int_kernel<<<grid_1d(nb, 256), 256, 0, cuda_launch_stream(cb)>>>(bad_dim, nb, INT_MAX);
        CK_LAUNCH("compactor: fill");
        fill_int_kernel<<<grid_1d(nb, 256), 256, 0, cuda_launch_stream(cb)>>>(bad_row, nb, INT_MAX);
        CK_LAUNCH("compactor: fill");
        lev_pointers_kernel<<<grid_1d(nb, 256), 256, 0, cuda_launch_stream(cb)>>>(g, x, (int64_t)s * s, lg.len * s, nb, g_ptr,
                                                                      x_ptr);
        CK_LAUNCH("compactor: leverage pointers");
        lev_means_kernel<<<dim3((unsigned)nb, (unsigned)ceil_div(lg.d, 32)), dim3(32, 8), 0, cuda_launch_stream(cb)>>>(
            lg, p0, mean, bad_dim);
        CK_LAUNCH("compactor: leverage column means");
        lev_sketch_kernel<<<dim3((unsigned)ceil_div(lg.len, SK_T), (unsigned)ceil_div(s, SK_T), (unsigned)nb),
                            dim3(SK_T, SK_T), 0, cuda_launch_stream(cb)>>>(lg, p0, mean, phi, x);
        CK_LAUNCH("compactor: leverage sketch");

        // Cholesky with the CPU's ridge schedule, per pair. Pairs from the
        // first one with non-finite keys on are not retried: the CPU stops
        // there (or earlier), so their outcome is never reported.
        int first_bad = nb;
        for (int i = 0; i < nb; i++) {
            ridge_h.p[i] = ridge0;
            done.p[i] = false;
        }
        for (int t = 0; t < LEV_MAX_TRIES; t++) {
            if (t > 0)
                for (int i = 0; i < first_bad; i++)
                    if (!done.p[i]) ridge_h.p[i] = ridge_h.p[i] > 0 ? 10.0 * ridge_h.p[i] : 1e-2;
            // Through the staging ring: ridge_h is reusable on return.
            if (int rc_up = cuda_upload(cb, ridge, ridge_h.p, (size_t)nb * sizeof(double), err)) return rc_up;
            // G = X^T X: on the column-major view Xc (sketch x len, ld sketch)
            // of row-major X, G = Xc Xc^T.
            CK_CUBLAS(cublasDgemmStridedBatched(cuda_launch_blas(cb), CUBLAS_OP_N, CUBLAS_OP_T, s, s, (int)lg.len, &one, x, s,
                                                (long long)lg.len * s, x, s, (long long)lg.len * s, &zero, g, s,
                                                (long long)s * s, nb),
                      "compactor: leverage Gram matrices (cublasDgemmStridedBatched)");
            lev_add_ridge_kernel<<<(unsigned)nb, 256, 0, cuda_launch_stream(cb)>>>(g, s, ridge);
            CK_LAUNCH("compactor: leverage ridge");
            CK_CUSOLVER(cusolverDnDpotrfBatched(cuda_launch_solver(cb), CUBLAS_FILL_MODE_LOWER, s, g_ptr, s, info, nb),
                        "compactor: leverage Cholesky (cusolverDnDpotrfBatched)");
            int rc = t == 0 ? download_small(cb, bad_dim_h.p, bad_dim, (size_t)nb, err) : PD_OK;
            if (rc) return rc;
            rc = download_small(cb, info_h.p, info, (size_t)nb, err);
            if (rc) return rc;
            if (t == 0)
                for (int i = 0; i < nb; i++)
                    if (bad_dim_h.p[i] != INT_MAX) {
                        first_bad = i;
                        break;
                    }
            bool again = false;
            for (int i = 0; i < first_bad; i++) {
                done.p[i] = info_h.p[i] == 0;
                again = again || !done.p[i];
            }
            if (!again) break;
        }

        // X := L^-1 X^T per pair (failed pairs give garbage that is never read).
        CK_CUBLAS(cublasDtrsmBatched(cuda_launch_blas(cb), CUBLAS_SIDE_LEFT, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N,
                                     CUBLAS_DIAG_NON_UNIT, s, (int)lg.len, &one, g_ptr, s, x_ptr, s, nb),
                  "compactor: leverage triangular solve (cublasDtrsmBatched)");
        lev_norms_kernel<<<dim3(grid_1d(lg.len, 256), (unsigned)nb), 256, 0, cuda_launch_stream(cb)>>>(lg, p0, x, lev, bad_row);
        CK_LAUNCH("compactor: leverage norms");
        int rc = download_small(cb, bad_row_h.p, bad_row, (size_t)nb, err);
        if (rc) return rc;
        for (int i = 0; i < nb; i++)
            if (bad_dim_h.p[i] != INT_MAX || info_h.p[i] != 0 || bad_row_h.p[i] != INT_MAX)
                return lev_pair_error(lp, p0 + i, bad_dim_h.p[i], info_h.p[i], ridge_h.p[i], bad_row_h.p[i], err);
    }
    return PD_OK;
}

int attn_run(cuda_backend *cb, const pd_token_score_args *a, const attn_geom &ag, char *base, const layout &lay,
             pd_error *err) {
    float *att = reinterpret_cast<float *>(base + lay.att);
    float *row_max = reinterpret_cast<float *>(base + lay.row_max);
    double *row_inv = reinterpret_cast<double *>(base + lay.row_inv);
    const int64_t n_chunks = ceil_div(ag.m, ag.chunk);
    const int64_t qtiles = ceil_div(ag.chunk, AT_TQ), ktiles = ceil_div(ag.chunk, AT_TK);
    // Checked by the caller: n_chunks * tiles fits gridDim.x.
    nc_rowstats_kernel<<<dim3((unsigned)(n_chunks * qtiles), (unsigned)a->n_head), AT_THREADS, 0, cuda_launch_stream(cb)>>>(
        ag, qtiles, row_max, row_inv);
    CK_LAUNCH("compactor: attention row statistics");
    nc_colsum_kernel<<<dim3((unsigned)(n_chunks * ktiles), (unsigned)a->n_head_kv), AT_THREADS, 0, cuda_launch_stream(cb)>>>(
        ag, ktiles, row_max, row_inv, att);
    CK_LAUNCH("compactor: attention column sums");
    const int64_t total = (int64_t)a->n_head_kv * ag.m;
    if (a->vnorm) {
        vnorm_kernel<<<grid_1d(total, 256), 256, 0, cuda_launch_stream(cb)>>>(att, a->v, ag.k_stride, ag.lo, ag.m, a->n_head_kv,
                                                                 ag.d);
        CK_LAUNCH("compactor: value norms");
    }
    if (a->pool > 1) {
        float *tmp = reinterpret_cast<float *>(base + lay.att_tmp);
        CK_CUDA(cudaMemcpyAsync(tmp, att, (size_t)total * sizeof(float), cudaMemcpyDeviceToDevice, cb->stream),
                "compactor: pool copy");
        pool_kernel<<<grid_1d(total, 256), 256, 0, cuda_launch_stream(cb)>>>(tmp, att, ag.m, a->n_head_kv, a->pool);
        CK_LAUNCH("compactor: average pool");
    }
    return PD_OK;
}

int zscore(cuda_backend *cb, float *x, int64_t n, double *stats, pd_error *err) {
    zscore_stats_kernel<<<1, Z_THREADS, 0, cuda_launch_stream(cb)>>>(x, n, stats);
    CK_LAUNCH("compactor: z-score statistics");
    zscore_apply_kernel<<<grid_1d(n, 256), 256, 0, cuda_launch_stream(cb)>>>(x, n, stats);
    CK_LAUNCH("compactor: z-score");
    return PD_OK;
}

} // namespace

extern "C" int cuda_token_scores(pd_backend *be, const pd_token_score_args *a, pd_error *err) {
    if (!be) return pd_errorf(err, PD_EINVAL, "cuda compactor: no backend");
    int rc = check_args(a, err);
    if (rc) return rc;
    const int64_t m = a->hi - a->lo;
    if (m == 0) return PD_OK; // like the CPU: nothing to score, nothing written
    cuda_backend *cb = cuda_impl(be);
    CK_CUDA(cudaSetDevice(cb->device), "compactor: cudaSetDevice");

    const int H = a->n_head_kv, d = a->head_dim;
    const int64_t total = (int64_t)H * m;
    layout lay{};
    carve cv;

    // ---- leverage geometry (pd_leverage_scores) ----
    lev_plan lp{};
    if (a->use_leverage) {
        const int s = a->sketch;
        const int64_t len = a->lev_chunk > 0 && a->lev_chunk < m ? a->lev_chunk : m;
        // The CPU's BLAS/LAPACK limit, kept so both fail alike; cuBLAS takes
        // int dimensions too.
        const int64_t max_rows = INT_MAX / (s > d ? s : d);
        if (len > max_rows)
            return pd_errorf(err, PD_ERANGE,
                             "kv head 0: leverage: a chunk of %" PRId64 " rows of dimension %d is too large for BLAS; "
                             "set lev_chunk to at most %" PRId64,
                             len, d, max_rows);
        lp.lg = lev_geom{a->k_pre, (int64_t)H * d, a->lo, m, len, ceil_div(m, len), d, s};
        lp.pairs = (int64_t)H * lp.lg.n_chunks;
        // Bytes per pair: mean, X, G, two pointers, three ints, a ridge (+ alignment slack).
        const double per_pair = 8.0 * ((double)d + (double)len * s + (double)s * s + 1.0) + 16.0 + 12.0;
        double fit = (double)LEV_BATCH_BYTES / per_pair;
        int64_t batch = fit < 1.0 ? 1 : (int64_t)fit;
        if (batch > lp.pairs) batch = lp.pairs;
        if (batch > MAX_GRID_YZ) batch = MAX_GRID_YZ;
        lp.batch = (int)batch;
        if ((int64_t)ceil_div(len, SK_T) > INT_MAX || ceil_div(s, SK_T) > MAX_GRID_YZ)
            return pd_errorf(err, PD_EUNSUPPORTED, "cuda compactor: leverage chunk of %" PRId64 " rows is too long",
                             len);
        const uint64_t nb = (uint64_t)lp.batch;
        lay.phi = cv.take((uint64_t)d * (uint64_t)s, sizeof(double));
        lay.lev = cv.take((uint64_t)total, sizeof(float));
        lay.mean = cv.take(nb * (uint64_t)d, sizeof(double));
        lay.x = cv.take(nb * (uint64_t)len * (uint64_t)s, sizeof(double));
        lay.g = cv.take(nb * (uint64_t)s * (uint64_t)s, sizeof(double));
        lay.g_ptr = cv.take(nb, sizeof(double *));
        lay.x_ptr = cv.take(nb, sizeof(double *));
        lay.info = cv.take(nb, sizeof(int));
        lay.bad_dim = cv.take(nb, sizeof(int));
        lay.bad_row = cv.take(nb, sizeof(int));
        lay.ridge = cv.take(nb, sizeof(double));
    }

    // ---- attention geometry (pd_noncausal_colsum) ----
    attn_geom ag{};
    if (a->use_attention) {
        const int64_t chunk = a->attn_chunk > m ? m : a->attn_chunk;
        const int64_t n_chunks = ceil_div(m, chunk);
        if (n_chunks * ceil_div(chunk, AT_TQ) > INT_MAX)
            return pd_errorf(err, PD_EUNSUPPORTED,
                             "cuda compactor: %" PRId64 " tokens in chunks of %" PRId64 " need too many blocks", m,
                             chunk);
        const float scale = a->scale == 0.0f ? (float)(1.0 / sqrt((double)d)) : a->scale;
        ag = attn_geom{a->q, a->k, (int64_t)a->n_head * d, (int64_t)H * d, a->lo, m, chunk, d, a->n_head / H, scale};
        lay.att = cv.take((uint64_t)total, sizeof(float));
        if (a->pool > 1) lay.att_tmp = cv.take((uint64_t)total, sizeof(float));
        lay.row_max = cv.take((uint64_t)a->n_head * (uint64_t)m, sizeof(float));
        lay.row_inv = cv.take((uint64_t)a->n_head * (uint64_t)m, sizeof(double));
    }
    lay.stats = cv.take(2, sizeof(double));
    if (!cv.ok)
        return pd_errorf(err, PD_ENOMEM, "cuda compactor: scratch for %" PRId64 " tokens x %d heads overflows size_t", m,
                         H);

    char *base = static_cast<char *>(cuda_scratch_get(cb, CUDA_SCRATCH_SCORE, cv.total, err));
    if (!base) return err ? err->code : PD_ENOMEM;
    double *stats = reinterpret_cast<double *>(base + lay.stats);

    // backend.cu binds both handles to cb->stream at creation (setting the
    // cuBLAS stream again would also reset any workspace it was given).
    pointer_mode_guard pm(cb->cublas);
    CK_CUBLAS(pm.set_host(), "compactor: cublasSetPointerMode");

    float *lev = nullptr, *att = nullptr;
    if (a->use_leverage) {
        // phi in double, as pd_leverage_scores converts it.
        const size_t n_phi = (size_t)d * (size_t)a->sketch;
        host_array<double> phi_h;
        if (!phi_h.alloc(n_phi))
            return pd_errorf(err, PD_ENOMEM, "cuda compactor: out of host memory for a %d x %d sketch", d, a->sketch);
        for (size_t i = 0; i < n_phi; i++) phi_h.p[i] = a->phi[i];
        if ((rc = cuda_upload(cb, base + lay.phi, phi_h.p, n_phi * sizeof(double), err))) return rc;
        rc = lev_run(cb, lp, base, lay, a->ridge, err);
        if (rc) return rc;
        lev = reinterpret_cast<float *>(base + lay.lev);
        rc = zscore(cb, lev, total, stats, err);
        if (rc) return rc;
    }
    if (a->use_attention) {
        rc = attn_run(cb, a, ag, base, lay, err);
        if (rc) return rc;
        att = reinterpret_cast<float *>(base + lay.att);
        rc = zscore(cb, att, total, stats, err);
        if (rc) return rc;
    }
    const float *result = att ? att : lev;
    if (att && lev) {
        combine_kernel<<<grid_1d(total, 256), 256, 0, cuda_launch_stream(cb)>>>(att, lev, total, a->lambda);
        CK_LAUNCH("compactor: blend");
    }
    return cuda_download(cb, a->scores, result, (size_t)total * sizeof(float), err);
}
