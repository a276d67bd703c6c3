// Attention over segmented, grouped KV on the GPU (pd_attn_args in
// kernels/kernels.h; kernels/cpu/attention.c is the reference).
//
// Two kernels run the same work items (the plan below): attn_mma_kernel on
// tensor cores when every K/V row is f16, head_dim a multiple of 16 and
// there are enough query rows per kv head (use_mma says exactly when; see
// "tensor-core path" below), attn_tile_kernel otherwise. In the latter,
// queries, scores, softmax, accumulators and output are f32; K/V rows are
// f32 or f16 per view (an f16 KV cache, or an f16 prefix): f16 rows are
// widened to f32 as a tile is loaded into shared memory, so they cost half
// the DRAM bytes and the arithmetic is the f32 path's. Either kernel does
// the work of both plans (prefill, split-K); what differs is the list of
// work items the host builds for it.
//
// Work item (attn_item) x kv head = one block of 8 warps. An item names
//   - a query set: the tokens from t_begin on, flattened into queries
//     qi = (token - t_begin) * n_rep + r (query head h * n_rep + r of kv
//     head h), and the tile [q0, q0 + nq) of it that the block takes
//     (nq <= ATTN_TILE_Q = 32, at most ATTN_QPW = 4 queries per warp);
//   - a key list: up to PD_MAX_KV_SEGMENTS segment descriptors, taken as
//     one concatenation, and the range [key_begin, key_end) of it to read;
//   - where the result goes: slot < 0 writes the normalised output, slot
//     >= 0 writes the unnormalised partial (m, l, o) of every query of the
//     tile to partial slot `slot`.
// The block streams its keys through shared memory ATTN_TILE_K = 32 rows of
// K and V at a time. Lane j of a warp scores key j of the tile against each
// of the warp's queries (q is pre-scaled in shared memory, K rows padded so
// the float4 reads do not conflict); warp shuffles give the tile's max and
// sum, and broadcast each probability for the P.V product, in which lane d
// owns output dimensions d, d + 32, ... So each query keeps an online
// softmax (running max m, running sum l, running weighted value sum o) in
// registers over the whole key range, across segments: over one
// concatenation that is the same as merging per-segment results.
// Sliding window: also only if q_pos - pos[j] < window; a tile older than
// every query's window is skipped likewise. Soft-capping maps each score s
// to softcap * tanh(s / softcap) before the mask.
// Causal: key j is visible to a query iff pos[j] <= q_pos (positions are
// explicit and may have gaps). A key tile whose smallest position exceeds
// the largest query position of the block is skipped by the whole block
// (and by a warp when it exceeds that warp's largest); nothing assumes the
// positions are sorted, it only skips less when they are not. A query that
// sees no key ends with m = -inf, l = 0 and gets zeros.
//
// Prefill path (enough query tiles for 2 blocks per SM, and not a batch of
// groups of at most 16 tokens over a shared prefix, which is better read
// once for all of them): one item per (group, query tile) whose key list
// is the group's whole segment list (the n_shared shared views, then the
// group's n_segments own views), full key range, slot -1. A classic tiled
// flash-attention pass: no partials, no merge.
//
// Decode path (split-K; otherwise): the keys are cut into chunks so that
// even one query per group gives enough blocks (target: 4 blocks per SM; a
// 16k-key prefix with 8 kv heads and one token gives 64 chunks of 256 keys,
// 512 blocks).
//   - shared items: one per (shared chunk c, query tile of ALL n_tokens *
//     n_rep queries of the call), key list = the shared views, range =
//     chunk c, slot c. Every group's queries of a kv head sit in the same
//     query set, so the shared prefix is read from DRAM once per call for
//     the whole batch (when the batch has more than 32 queries per kv head,
//     the tiles of one chunk are adjacent blocks and share it through L2).
//   - own items: one per (group g, own chunk c, query tile of g), key list =
//     g's own views, range = chunk c, slot n_sh_chunks + c. Every group gets
//     the same number of own chunks (sized by the longest group), so every
//     (query, slot) is written exactly once; a chunk past a group's keys
//     just writes m = -inf.
//   Shared and own items go in one launch. Then attn_merge_kernel (a warp
//   per (token, query head)) merges the n_slots partials by log-sum-exp:
//       M = max_s m_s,  L = sum_s l_s e^(m_s - M),
//       out = sum_s o_s e^(m_s - M) / L   (zeros when M = -inf).
//   When the whole call comes to one slot, the items write the output
//   directly and there is no merge.
//
// Descriptors. The pd_kv_view arrays are host memory; the host packs one
// attn_seg {k, v, pos, len, f16} per (segment, kv head): the shared views first,
// index s * n_head_kv + h, then group g's own views at n_shared * n_head_kv
// + (g * n_segments + s) * n_head_kv + h. An item stores, per segment of its
// key list, the index for kv head 0 (the block adds its kv head). Segment
// descriptors, then items, are packed into one host buffer and uploaded
// with one cuda_upload (which leaves the host buffer reusable on return)
// into scratch slot CUDA_SCRATCH_ATTN, followed there by the partials:
// part_ml[slot][token][head] = (m, l) and part_o[slot][token][head][hd].
//
// Not supported on the GPU: `keep` masks (a host-backend test feature),
// head_dim above 256 or not a multiple of 4, and q/out or f32 K/V pointers
// that are not 16-byte aligned, f16 K/V not 8-byte aligned (backend memory
// and row offsets of it always are).
#include "kernels/cuda/cuda_internal.h"

#include <cuda_fp16.h>
#include <mma.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ATTN_WARPS 8
#define ATTN_THREADS (ATTN_WARPS * 32)
#define ATTN_QPW 4                           // queries per warp, at most
#define ATTN_TILE_Q (ATTN_WARPS * ATTN_QPW)  // queries per block, at most
#define ATTN_TILE_K 32                       // keys per shared-memory tile: one per lane
#define ATTN_MAX_HEAD_DIM 256
#define ATTN_MIN_CHUNK_KEYS 128              // split-K: keys per chunk, at least
#define ATTN_MAX_CHUNKS 128                  // split-K: chunks per pass, at most
#define ATTN_DECODE_MAX_TOKENS 16            // tokens per group up to which a shared prefix is split
#define ATTN_BLOCKS_PER_SM 4                 // split-K aims at this many blocks per SM
#define ATTN_PREFILL_MIN_BLOCKS_PER_SM 2     // the prefill path needs this many (one resident wave)

// One (segment, kv head) view, on the device.
typedef struct attn_seg {
    const void *k; // [len][head_dim] f32, or f16 when f16 != 0
    const void *v;
    const int32_t *pos;
    long long len;
    int f16;
} attn_seg;

// One block's work for every kv head (blockIdx.y). See the comment above.
typedef struct attn_item {
    long long t_begin;              // first token of the query set
    long long q0;                   // first query of the tile within the set
    long long key_begin, key_end;   // range of the concatenated key list
    int nq;                         // queries in the tile, 1..ATTN_TILE_Q (ATTN_MMA_TILE_Q)
    int slot;                       // partial slot, or -1: normalised output
    int n_seg;                      // segments in the key list
    int seg[PD_MAX_KV_SEGMENTS];    // attn_seg index of segment s for kv head 0
} attn_item;

// Kernel arguments, passed by value.
typedef struct attn_params {
    const float *q;
    const int32_t *q_pos;
    float *out;
    const attn_seg *segs;
    const attn_item *items;
    float2 *part_ml;   // [n_slots][n_tokens][n_head]
    float *part_o;     // [n_slots][n_tokens][n_head][head_dim]
    long long n_tokens;
    int n_head, n_rep, head_dim;
    int kstride;       // floats per K row in shared memory (head_dim, padded)
    float scale;
    int causal;
    int window;        // > 0: keys at q_pos - window or earlier are masked
    float softcap;     // > 0: scores become softcap * tanh(score / softcap)
} attn_params;

// Four consecutive elements (the c-th group of four) of rows of f32 or
// f16, as float4. f16 groups are 8 bytes: one load, widened exactly.
static __device__ __forceinline__ float4 attn_load4(const void *base, long long c, int f16) {
    if (!f16) return reinterpret_cast<const float4 *>(base)[c];
    const uint2 u = reinterpret_cast<const uint2 *>(base)[c];
    return make_float4(__half2float(__ushort_as_half((unsigned short)(u.x & 0xffffu))),
                       __half2float(__ushort_as_half((unsigned short)(u.x >> 16))),
                       __half2float(__ushort_as_half((unsigned short)(u.y & 0xffffu))),
                       __half2float(__ushort_as_half((unsigned short)(u.y >> 16))));
}

static __device__ __forceinline__ int attn_warp_min_int(int v) {
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// DPL: output dimensions per lane (head_dim <= 32 * DPL).
template <int DPL>
__global__ void __launch_bounds__(ATTN_THREADS, 2) attn_tile_kernel(const attn_params p) {
    extern __shared__ float4 attn_smem[];
    __shared__ int block_qmax, block_qmin;
    const int hd = p.head_dim, hd4 = hd / 4;
    float *ks = reinterpret_cast<float *>(attn_smem);  // [ATTN_TILE_K][kstride]
    float *vs = ks + ATTN_TILE_K * p.kstride;            // [ATTN_TILE_K][hd]
    float *qs = vs + ATTN_TILE_K * hd;                   // [ATTN_TILE_Q][hd], times scale

    // Fields used in loops are copied to registers; seg[] is read where
    // needed (indexing a local copy by a variable would put it on the stack).
    const attn_item *item = &p.items[blockIdx.x];
    const struct {
        long long t_begin, q0, key_begin, key_end;
        int nq, slot, n_seg;
    } it = {item->t_begin, item->q0, item->key_begin, item->key_end, item->nq, item->slot, item->n_seg};
    const int h = (int)blockIdx.y;
    const int tid = (int)threadIdx.x, warp = tid >> 5, lane = tid & 31;
    // Queries of this warp: tile queries [wq0, wq0 + wn).
    const int qpw = (it.nq + ATTN_WARPS - 1) / ATTN_WARPS;
    const int wq0 = warp * qpw;
    const int wn = max(0, min(qpw, it.nq - wq0));

    if (tid == 0) {
        block_qmax = INT_MIN;
        block_qmin = INT_MAX;
    }
    const bool need_pos = p.causal || p.window > 0;
    for (int idx = tid; idx < it.nq * hd4; idx += ATTN_THREADS) {
        const int ql = idx / hd4, c = idx - ql * hd4;
        const long long qi = it.q0 + ql;
        const long long t = it.t_begin + qi / p.n_rep;
        const int head = h * p.n_rep + (int)(qi % p.n_rep);
        float4 x = reinterpret_cast<const float4 *>(p.q + (t * p.n_head + head) * hd)[c];
        x.x *= p.scale;
        x.y *= p.scale;
        x.z *= p.scale;
        x.w *= p.scale;
        reinterpret_cast<float4 *>(qs)[ql * hd4 + c] = x;
    }
    __syncthreads(); // block_qmax initialised

    int qpos[ATTN_QPW];
    float m[ATTN_QPW], l[ATTN_QPW], o[ATTN_QPW][DPL];
    int warp_qmax = INT_MIN, warp_qmin = INT_MAX;
#pragma unroll
    for (int i = 0; i < ATTN_QPW; i++) {
        qpos[i] = INT_MIN;
        if (need_pos && i < wn) {
            const long long qi = it.q0 + wq0 + i;
            qpos[i] = p.q_pos[it.t_begin + qi / p.n_rep];
            if (p.causal) warp_qmax = max(warp_qmax, qpos[i]);
            warp_qmin = min(warp_qmin, qpos[i]);
        }
        m[i] = -INFINITY;
        l[i] = 0.0f;
#pragma unroll
        for (int d = 0; d < DPL; d++) o[i][d] = 0.0f;
    }
    if (p.causal && lane == 0 && wn > 0) atomicMax(&block_qmax, warp_qmax);
    if (p.window > 0 && lane == 0 && wn > 0) atomicMin(&block_qmin, warp_qmin);
    __syncthreads(); // block_qmax final, Q tile loaded

    long long seg_off = 0; // start of segment s in the concatenation
    for (int s = 0; s < it.n_seg; s++) {
        const attn_seg sg = p.segs[item->seg[s] + h];
        const long long jb = max(it.key_begin - seg_off, 0LL);
        const long long je = min(it.key_end - seg_off, sg.len);
        seg_off += sg.len;
        for (long long j0 = jb; j0 < je; j0 += ATTN_TILE_K) {
            const int nk = (int)min((long long)ATTN_TILE_K, je - j0);
            // Lane j holds key j's position; lanes past the tile hold
            // INT_MAX so they never lower the tile minimum.
            int kpos = INT_MAX, tile_min = INT_MIN;
            if (need_pos && lane < nk) kpos = sg.pos[j0 + lane];
            if (p.causal) {
                tile_min = attn_warp_min_int(kpos);
                // Every warp computes the same tile_min and reads the same
                // block_qmax, so the whole block skips or none of it does.
                if (tile_min > block_qmax) continue;
            }
            if (p.window > 0) {
                // A tile wholly before every query's window is skipped the
                // same way (lanes past the tile do not raise the maximum).
                const int tile_max = -attn_warp_min_int(lane < nk ? -kpos : INT_MAX);
                if ((long long)block_qmin - tile_max >= p.window) continue;
            }
            __syncthreads(); // every warp is done with the previous tile
            // Rows past nk are zeroed so no stale values are ever multiplied.
            for (int idx = tid; idx < ATTN_TILE_K * hd4; idx += ATTN_THREADS) {
                const int row = idx / hd4, c = idx - row * hd4;
                float4 kx = make_float4(0.0f, 0.0f, 0.0f, 0.0f), vx = kx;
                if (row < nk) {
                    const long long c4 = (j0 + row) * hd4 + c; // float4 / half4 index
                    kx = attn_load4(sg.k, c4, sg.f16);
                    vx = attn_load4(sg.v, c4, sg.f16);
                }
                reinterpret_cast<float4 *>(ks + row * p.kstride)[c] = kx;
                reinterpret_cast<float4 *>(vs + row * hd)[c] = vx;
            }
            __syncthreads();
            if (wn == 0 || tile_min > warp_qmax) continue; // warp-uniform

            // Scores: lane j against each query of the warp.
            float acc[ATTN_QPW];
#pragma unroll
            for (int i = 0; i < ATTN_QPW; i++) acc[i] = 0.0f;
            const float4 *krow = reinterpret_cast<const float4 *>(ks + lane * p.kstride);
            const float4 *qrow = reinterpret_cast<const float4 *>(qs + wq0 * hd);
            for (int c = 0; c < hd4; c++) {
                const float4 kx = krow[c];
#pragma unroll
                for (int i = 0; i < ATTN_QPW; i++) {
                    if (i < wn) {
                        const float4 qx = qrow[i * hd4 + c];
                        acc[i] = fmaf(kx.x, qx.x, acc[i]);
                        acc[i] = fmaf(kx.y, qx.y, acc[i]);
                        acc[i] = fmaf(kx.z, qx.z, acc[i]);
                        acc[i] = fmaf(kx.w, qx.w, acc[i]);
                    }
                }
            }

            // Online softmax update; pr[i] is lane j's probability for query i
            // (0 for masked keys and for queries with nothing visible here).
            float pr[ATTN_QPW];
            bool any = false;
#pragma unroll
            for (int i = 0; i < ATTN_QPW; i++) {
                pr[i] = 0.0f;
                if (i >= wn) continue;
                const bool vis = lane < nk && (!p.causal || kpos <= qpos[i]) &&
                                 (p.window <= 0 || (long long)qpos[i] - kpos < p.window);
                const float capped = p.softcap > 0.0f ? p.softcap * tanhf(acc[i] / p.softcap) : acc[i];
                const float sc = vis ? capped : -INFINITY;
                const float tmax = cuda_warp_max(sc);
                if (tmax == -INFINITY) continue; // warp-uniform: nothing visible
                const float mnew = fmaxf(m[i], tmax);
                const float alpha = expf(m[i] - mnew); // 0 while m was -inf
                pr[i] = vis ? expf(sc - mnew) : 0.0f;
                l[i] = l[i] * alpha + cuda_warp_sum(pr[i]);
                m[i] = mnew;
#pragma unroll
                for (int d = 0; d < DPL; d++) o[i][d] *= alpha;
                any = true;
            }
            if (!any) continue; // warp-uniform

            // o += P V: row j of V is shared by all the warp's queries.
            for (int j = 0; j < nk; j++) {
                float vj[DPL];
#pragma unroll
                for (int d = 0; d < DPL; d++) {
                    const int dim = lane + 32 * d;
                    vj[d] = dim < hd ? vs[j * hd + dim] : 0.0f;
                }
#pragma unroll
                for (int i = 0; i < ATTN_QPW; i++) {
                    const float pj = __shfl_sync(0xffffffffu, pr[i], j);
#pragma unroll
                    for (int d = 0; d < DPL; d++) o[i][d] = fmaf(pj, vj[d], o[i][d]);
                }
            }
        }
    }

#pragma unroll
    for (int i = 0; i < ATTN_QPW; i++) {
        if (i >= wn) continue;
        const long long qi = it.q0 + wq0 + i;
        const long long t = it.t_begin + qi / p.n_rep;
        const int head = h * p.n_rep + (int)(qi % p.n_rep);
        const long long row = t * p.n_head + head;
        if (it.slot < 0) {
            // l > 0 iff some key was visible; otherwise o is 0: zeros.
            const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
            float *dst = p.out + row * hd;
#pragma unroll
            for (int d = 0; d < DPL; d++) {
                const int dim = lane + 32 * d;
                if (dim < hd) dst[dim] = o[i][d] * inv;
            }
        } else {
            const long long prow = (long long)it.slot * p.n_tokens * p.n_head + row;
            if (lane == 0) p.part_ml[prow] = make_float2(m[i], l[i]);
            if (m[i] == -INFINITY) continue; // the merge never reads o then
            float *dst = p.part_o + prow * hd;
#pragma unroll
            for (int d = 0; d < DPL; d++) {
                const int dim = lane + 32 * d;
                if (dim < hd) dst[dim] = o[i][d];
            }
        }
    }
}

// out[t][head] = log-sum-exp merge of the n_slots partials; a warp per row.
template <int DPL>
__global__ void __launch_bounds__(ATTN_THREADS) attn_merge_kernel(const attn_params p, int n_slots) {
    const int lane = (int)(threadIdx.x & 31u);
    const long long rows = p.n_tokens * p.n_head;
    const long long row = (long long)blockIdx.x * ATTN_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return; // warp-uniform
    const int hd = p.head_dim;
    float *dst = p.out + row * hd;

    float mx = -INFINITY;
    for (int s = lane; s < n_slots; s += 32) mx = fmaxf(mx, p.part_ml[s * rows + row].x);
    mx = cuda_warp_max(mx);
    if (mx == -INFINITY) { // no visible key in any slot
        for (int d = lane; d < hd; d += 32) dst[d] = 0.0f;
        return;
    }
    float lsum = 0.0f;
    for (int s = lane; s < n_slots; s += 32) {
        const float2 ml = p.part_ml[s * rows + row];
        if (ml.x != -INFINITY) lsum += ml.y * expf(ml.x - mx);
    }
    lsum = cuda_warp_sum(lsum);

    float acc[DPL];
#pragma unroll
    for (int d = 0; d < DPL; d++) acc[d] = 0.0f;
    for (int s = 0; s < n_slots; s++) {
        const float2 ml = p.part_ml[s * rows + row];
        if (ml.x == -INFINITY) continue; // o was not written
        const float w = expf(ml.x - mx);
        const float *src = p.part_o + (s * rows + row) * hd;
#pragma unroll
        for (int d = 0; d < DPL; d++) {
            const int dim = lane + 32 * d;
            if (dim < hd) acc[d] = fmaf(w, src[dim], acc[d]);
        }
    }
    const float inv = 1.0f / lsum;
#pragma unroll
    for (int d = 0; d < DPL; d++) {
        const int dim = lane + 32 * d;
        if (dim < hd) dst[dim] = acc[d] * inv;
    }
}

/* ------------------------------------------------------------------------
 * tensor-core path (f16 K/V, head_dim a multiple of 16)
 *
 * attn_mma_kernel takes the same items as attn_tile_kernel (same plan,
 * shared-prefix pass, split-K chunks, partial slots and merge) with query
 * tiles of up to ATTN_MMA_TILE_Q = 64 rows: 4 warps of 16 query rows, one
 * WMMA row of fragments each. Per 32-key tile of K and V (f16, copied to
 * shared memory as they are):
 *   S = Q K^T    Q: the warp's 16 rows, pre-scaled, rounded to f16 once and
 *                kept in fragments (registers) for the whole key range;
 *                K^T read as a col_major matrix_b straight from the K rows;
 *                f32 accumulators, stored to shared memory;
 *   softmax      a lane pair per query row (16 keys each): soft-cap, mask,
 *                the running max m and sum l in registers; probabilities are
 *                rounded to f16 for the P V product and l sums the rounded
 *                values, so the output is an exact convex combination of
 *                the value rows under the weights actually used; the row of
 *                O in shared memory is rescaled by e^(m_old - m_new);
 *   O += P V     P (f16, row_major) times V rows (row_major matrix_b), onto
 *                O loaded from and stored back to shared memory (f32).
 * WMMA leaves the accumulator's lane layout unspecified, so O lives in
 * shared memory, where ordinary threads can rescale rows of it. What the
 * f16 rounding costs against the f32 path: Q and P each carry a relative
 * error of at most 2^-11 (scores off by ~2^-11 |q| |k| at worst, each
 * probability by 2^-11 of itself); tests/test_cuda_attention.c states the
 * bounds it checks.
 * ------------------------------------------------------------------------ */

#define ATTN_MMA_WARPS 4
#define ATTN_MMA_THREADS (ATTN_MMA_WARPS * 32)
#define ATTN_MMA_ROWS 16                             // query rows per warp: one fragment row
#define ATTN_MMA_TILE_Q (ATTN_MMA_WARPS * ATTN_MMA_ROWS)
#define ATTN_MMA_TILE_K ATTN_TILE_K                  // keys per tile (split-K chunks are whole tiles)
#define ATTN_MMA_SLD (ATTN_MMA_TILE_K + 4)           // floats per S row in shared memory
#define ATTN_MMA_PLD (ATTN_MMA_TILE_K + 8)           // halves per P row
#define ATTN_MMA_MIN_ROWS 4                          // query rows per (group, kv head) for the path

static_assert(ATTN_MMA_TILE_K == 32, "the softmax gives a lane pair 32 keys, 16 each");

// Shared memory of attn_mma_kernel for head_dim hd, in bytes; every array
// starts 32-byte aligned (WMMA's requirement) given an aligned base.
//   K, V   __half [TILE_K][hd + 8]   (rows padded 16 bytes against bank conflicts)
//   S      float  [TILE_Q][SLD]
//   P      __half [TILE_Q][PLD]
//   O      float  [TILE_Q][hd + 4]   (each warp's rows first stage its Q tile)
//   kpos   int    [TILE_K], then the block's query position bounds (2 ints)
static __host__ __device__ __forceinline__ size_t attn_mma_smem_bytes(int hd) {
    return 2 * sizeof(__half) * ATTN_MMA_TILE_K * (size_t)(hd + 8) +
           sizeof(float) * ATTN_MMA_TILE_Q * ATTN_MMA_SLD + sizeof(__half) * ATTN_MMA_TILE_Q * ATTN_MMA_PLD +
           sizeof(float) * ATTN_MMA_TILE_Q * (size_t)(hd + 4) + sizeof(int) * (ATTN_MMA_TILE_K + 2);
}

static __device__ __forceinline__ int attn_warp_max_int(int v) {
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// NDT: 16-column tiles of head_dim, at most (the Q fragments held).
template <int NDT>
__global__ void __launch_bounds__(ATTN_MMA_THREADS) attn_mma_kernel(const attn_params p) {
    using namespace nvcuda;
    extern __shared__ float4 attn_mma_smem[];
    const int hd = p.head_dim, ndt = hd / 16, hd4 = hd / 4;
    const int kld = hd + 8, old = hd + 4;
    __half *ks = reinterpret_cast<__half *>(attn_mma_smem);
    __half *vs = ks + ATTN_MMA_TILE_K * kld;
    float *ss = reinterpret_cast<float *>(vs + ATTN_MMA_TILE_K * kld);
    __half *ps = reinterpret_cast<__half *>(ss + ATTN_MMA_TILE_Q * ATTN_MMA_SLD);
    float *os = reinterpret_cast<float *>(ps + ATTN_MMA_TILE_Q * ATTN_MMA_PLD);
    int *kpos_s = reinterpret_cast<int *>(os + ATTN_MMA_TILE_Q * old);
    int *block_qmax = kpos_s + ATTN_MMA_TILE_K, *block_qmin = block_qmax + 1;

    const attn_item *item = &p.items[blockIdx.x];
    const struct {
        long long t_begin, q0, key_begin, key_end;
        int nq, slot, n_seg;
    } it = {item->t_begin, item->q0, item->key_begin, item->key_end, item->nq, item->slot, item->n_seg};
    const int h = (int)blockIdx.y;
    const int tid = (int)threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int r0 = warp * ATTN_MMA_ROWS;                       // the warp's first tile row
    const int wn = max(0, min(ATTN_MMA_ROWS, it.nq - r0));     // its query rows
    float *ow = os + r0 * old;
    float *sw = ss + r0 * ATTN_MMA_SLD;
    __half *pw = ps + r0 * ATTN_MMA_PLD;
    // Lanes 2r and 2r + 1 own row r of the warp: its softmax state, and
    // keys [16 side, 16 side + 16) of each tile.
    const int row = lane >> 1, side = lane & 1;
    const bool live = row < wn;
    const bool need_pos = p.causal || p.window > 0;

    if (tid == 0) {
        *block_qmax = INT_MIN;
        *block_qmin = INT_MAX;
    }
    // Q rows of the warp, times scale, as f16 in the warp's O rows (zeros
    // past wn), then into fragments.
    __half *qstage = reinterpret_cast<__half *>(ow); // [16][kld]
    for (int idx = lane; idx < ATTN_MMA_ROWS * hd4; idx += 32) {
        const int r = idx / hd4, c = idx - r * hd4;
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < wn) {
            const long long qi = it.q0 + r0 + r;
            const long long t = it.t_begin + qi / p.n_rep;
            const int head = h * p.n_rep + (int)(qi % p.n_rep);
            x = reinterpret_cast<const float4 *>(p.q + (t * p.n_head + head) * hd)[c];
        }
        __half *dst = qstage + r * kld + 4 * c;
        dst[0] = __float2half_rn(x.x * p.scale);
        dst[1] = __float2half_rn(x.y * p.scale);
        dst[2] = __float2half_rn(x.z * p.scale);
        dst[3] = __float2half_rn(x.w * p.scale);
    }
    __syncwarp();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> qf[NDT];
#pragma unroll
    for (int dt = 0; dt < NDT; dt++)
        if (dt < ndt) wmma::load_matrix_sync(qf[dt], qstage + 16 * dt, kld);
    __syncwarp(); // every lane has read the staged Q before O overwrites it
    for (int idx = lane; idx < ATTN_MMA_ROWS * hd; idx += 32) ow[(idx / hd) * old + idx % hd] = 0.0f;

    int qpos = INT_MIN;
    if (need_pos && live) qpos = p.q_pos[it.t_begin + (it.q0 + r0 + row) / p.n_rep];
    const int warp_qmax = p.causal ? attn_warp_max_int(live ? qpos : INT_MIN) : INT_MAX;
    __syncthreads(); // block bounds initialised
    if (p.causal && live && side == 0) atomicMax(block_qmax, qpos);
    if (p.window > 0 && live && side == 0) atomicMin(block_qmin, qpos);
    __syncthreads(); // block bounds final

    float m = -INFINITY, l = 0.0f; // row `row`'s, the same in both lanes of the pair
    long long seg_off = 0;
    for (int s = 0; s < it.n_seg; s++) {
        const attn_seg sg = p.segs[item->seg[s] + h];
        const long long jb = max(it.key_begin - seg_off, 0LL);
        const long long je = min(it.key_end - seg_off, sg.len);
        seg_off += sg.len;
        for (long long j0 = jb; j0 < je; j0 += ATTN_MMA_TILE_K) {
            const int nk = (int)min((long long)ATTN_MMA_TILE_K, je - j0);
            // The same tile skips as attn_tile_kernel: the whole block or none.
            int kpos = INT_MAX, tile_min = INT_MIN;
            if (need_pos && lane < nk) kpos = sg.pos[j0 + lane];
            if (p.causal) {
                tile_min = attn_warp_min_int(kpos);
                if (tile_min > *block_qmax) continue;
            }
            if (p.window > 0) {
                const int tile_max = -attn_warp_min_int(lane < nk ? -kpos : INT_MAX);
                if ((long long)*block_qmin - tile_max >= p.window) continue;
            }
            __syncthreads(); // every warp is done with the previous tile
            // K and V rows as they are (f16, 8 bytes at a time); rows past nk
            // are zeros so no stale value meets a zero probability.
            for (int idx = tid; idx < ATTN_MMA_TILE_K * hd4; idx += ATTN_MMA_THREADS) {
                const int r = idx / hd4, c = idx - r * hd4;
                uint2 kx = make_uint2(0u, 0u), vx = kx;
                if (r < nk) {
                    const long long c4 = (j0 + r) * hd4 + c;
                    kx = reinterpret_cast<const uint2 *>(sg.k)[c4];
                    vx = reinterpret_cast<const uint2 *>(sg.v)[c4];
                }
                *reinterpret_cast<uint2 *>(ks + r * kld + 4 * c) = kx;
                *reinterpret_cast<uint2 *>(vs + r * kld + 4 * c) = vx;
            }
            if (warp == 0) kpos_s[lane] = kpos;
            __syncthreads();
            if (wn == 0 || tile_min > warp_qmax) continue; // warp-uniform

            // S = Q K^T: 16 rows x 32 keys, two accumulator tiles.
#pragma unroll
            for (int kt = 0; kt < ATTN_MMA_TILE_K / 16; kt++) {
                wmma::fragment<wmma::accumulator, 16, 16, 16, float> sf;
                wmma::fill_fragment(sf, 0.0f);
#pragma unroll
                for (int dt = 0; dt < NDT; dt++) {
                    if (dt >= ndt) break;
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> kf;
                    wmma::load_matrix_sync(kf, ks + kt * 16 * kld + 16 * dt, kld);
                    wmma::mma_sync(sf, qf[dt], kf, sf);
                }
                wmma::store_matrix_sync(sw + 16 * kt, sf, ATTN_MMA_SLD, wmma::mem_row_major);
            }
            __syncwarp();

            // Online softmax of row `row` over this lane's 16 keys.
            float sc[16];
            float tmax = -INFINITY;
#pragma unroll
            for (int c = 0; c < 16; c++) {
                const int j = 16 * side + c;
                const int kp = kpos_s[j];
                const bool vis = live && j < nk && (!p.causal || kp <= qpos) &&
                                 (p.window <= 0 || (long long)qpos - kp < p.window);
                float x = sw[row * ATTN_MMA_SLD + j];
                if (p.softcap > 0.0f) x = p.softcap * tanhf(x / p.softcap);
                sc[c] = vis ? x : -INFINITY;
                tmax = fmaxf(tmax, sc[c]);
            }
            tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
            // Nothing visible to any row of the warp: m, l and O stay as they are.
            if (cuda_warp_max(tmax) == -INFINITY) continue; // warp-uniform
            const float mnew = fmaxf(m, tmax);
            float alpha = 1.0f, sum = 0.0f;
            if (mnew != -INFINITY) alpha = expf(m - mnew); // 0 while m was -inf
#pragma unroll
            for (int c = 0; c < 16; c++) {
                const float pr = mnew != -INFINITY ? expf(sc[c] - mnew) : 0.0f; // e^-inf = 0
                const __half ph = __float2half_rn(pr);
                pw[row * ATTN_MMA_PLD + 16 * side + c] = ph;
                sum += __half2float(ph);
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            l = l * alpha + sum;
            m = mnew;
            if (alpha != 1.0f)
                for (int d = side; d < hd; d += 2) ow[row * old + d] *= alpha;
            __syncwarp(); // P written and O rescaled before the fragments read them

            // O += P V, one 16-column tile of O at a time.
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> pf[ATTN_MMA_TILE_K / 16];
#pragma unroll
            for (int kt = 0; kt < ATTN_MMA_TILE_K / 16; kt++)
                wmma::load_matrix_sync(pf[kt], pw + 16 * kt, ATTN_MMA_PLD);
#pragma unroll
            for (int dt = 0; dt < NDT; dt++) {
                if (dt >= ndt) break;
                wmma::fragment<wmma::accumulator, 16, 16, 16, float> of;
                wmma::load_matrix_sync(of, ow + 16 * dt, old, wmma::mem_row_major);
#pragma unroll
                for (int kt = 0; kt < ATTN_MMA_TILE_K / 16; kt++) {
                    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> vf;
                    wmma::load_matrix_sync(vf, vs + kt * 16 * kld + 16 * dt, kld);
                    wmma::mma_sync(of, pf[kt], vf, of);
                }
                wmma::store_matrix_sync(ow + 16 * dt, of, old, wmma::mem_row_major);
            }
            __syncwarp(); // O stored before the next rescale or the output
        }
    }

    // Output, a row at a time over the whole warp (coalesced): row r's m
    // and l come from lane 2r.
    for (int r = 0; r < wn; r++) {
        const float mr = __shfl_sync(0xffffffffu, m, 2 * r);
        const float lr = __shfl_sync(0xffffffffu, l, 2 * r);
        const long long qi = it.q0 + r0 + r;
        const long long t = it.t_begin + qi / p.n_rep;
        const int head = h * p.n_rep + (int)(qi % p.n_rep);
        const long long orow = t * p.n_head + head;
        const float *src = ow + r * old;
        if (it.slot < 0) {
            // l > 0 iff some key was visible; otherwise O is 0: zeros.
            const float inv = lr > 0.0f ? 1.0f / lr : 0.0f;
            float *dst = p.out + orow * hd;
            for (int d = lane; d < hd; d += 32) dst[d] = src[d] * inv;
        } else {
            const long long prow = (long long)it.slot * p.n_tokens * p.n_head + orow;
            if (lane == 0) p.part_ml[prow] = make_float2(mr, lr);
            if (mr == -INFINITY) continue; // the merge never reads o then
            float *dst = p.part_o + prow * hd;
            for (int d = lane; d < hd; d += 32) dst[d] = src[d];
        }
    }
}

/* ------------------------------------------------------------------------
 * host side
 * ------------------------------------------------------------------------ */

static bool misaligned16(const void *ptr) { return ((uintptr_t)ptr & 15u) != 0; }

// Token range of group g (n_groups 0: one group of all tokens).
static int64_t group_begin(const pd_attn_args *a, int g) { return a->n_groups > 0 ? a->group_start[g] : 0; }
static int64_t group_end(const pd_attn_args *a, int g) {
    return a->n_groups > 0 ? a->group_start[g + 1] : a->n_tokens;
}

static const pd_kv_view *own_view(const pd_attn_args *a, int g, int s, int h) {
    return &a->kv[((int64_t)g * a->n_segments + s) * a->n_head_kv + h];
}

// `where` names the view in messages ("shared segment 1, kv head 0").
static int check_view(const pd_attn_args *a, const pd_kv_view *kv, const char *where, pd_error *err) {
    if (kv->keep)
        return pd_errorf(err, PD_EUNSUPPORTED,
                         "attention: %s has a keep mask; attention masks (keep) are a host-backend test feature",
                         where);
    if (kv->len < 0) return pd_errorf(err, PD_EINVAL, "attention: %s has length %lld", where, (long long)kv->len);
    if (kv->len == 0) return PD_OK;
    if (!kv->k || !kv->v || ((a->causal || a->window > 0) && !kv->pos))
        return pd_errorf(err, PD_EINVAL, "attention: %s has NULL k, v or pos", where);
    if (!pd_kv_type_ok(kv->type))
        return pd_errorf(err, PD_EUNSUPPORTED, "attention: %s holds rows of type %d; KV rows must be f32 or f16",
                         where, (int)kv->type);
    const uintptr_t align = kv->type == PD_TYPE_F16 ? 8u : 16u;
    if (((uintptr_t)kv->k | (uintptr_t)kv->v) % align)
        return pd_errorf(err, PD_EUNSUPPORTED, "attention: %s: k and v must be %u-byte aligned device memory", where,
                         (unsigned)align);
    return PD_OK;
}

static int validate(const pd_attn_args *a, pd_error *err) {
    if (!a) return pd_errorf(err, PD_EINVAL, "attention: NULL arguments");
    if (a->n_tokens < 0 || a->head_dim <= 0 || a->n_head <= 0 || a->n_head_kv <= 0)
        return pd_errorf(err, PD_EINVAL,
                         "attention: bad shape (n_tokens %lld, n_head %d, n_head_kv %d, head_dim %d)",
                         (long long)a->n_tokens, a->n_head, a->n_head_kv, a->head_dim);
    if (a->n_head % a->n_head_kv != 0)
        return pd_errorf(err, PD_EINVAL, "attention: n_head %d is not a multiple of n_head_kv %d", a->n_head,
                         a->n_head_kv);
    if (a->n_segments < 0 || a->n_shared < 0 || a->n_segments + a->n_shared > PD_MAX_KV_SEGMENTS)
        return pd_errorf(err, PD_EINVAL,
                         "attention: %d own + %d shared segments per group (allowed 0..%d in all)",
                         a->n_segments, a->n_shared, PD_MAX_KV_SEGMENTS);
    if (a->n_groups < 0) return pd_errorf(err, PD_EINVAL, "attention: %d groups", a->n_groups);
    if (a->n_head_kv > 65535) // grid.y of the tile kernel
        return pd_errorf(err, PD_EUNSUPPORTED, "attention: %d kv heads is more than the CUDA backend supports (65535)",
                         a->n_head_kv);
    const int64_t n_descs =
        ((int64_t)a->n_shared + (int64_t)(a->n_groups > 0 ? a->n_groups : 1) * a->n_segments) * a->n_head_kv;
    if (n_descs > INT_MAX)
        return pd_errorf(err, PD_ERANGE, "attention: %lld segment views is too many", (long long)n_descs);
    if (a->n_groups > 0) {
        if (!a->group_start) return pd_errorf(err, PD_EINVAL, "attention: %d groups but NULL group_start", a->n_groups);
        if (a->group_start[0] != 0 || a->group_start[a->n_groups] != a->n_tokens)
            return pd_errorf(err, PD_EINVAL, "attention: group_start runs %lld..%lld, not 0..n_tokens (%lld)",
                             (long long)a->group_start[0], (long long)a->group_start[a->n_groups],
                             (long long)a->n_tokens);
        for (int g = 0; g < a->n_groups; g++)
            if (a->group_start[g + 1] < a->group_start[g])
                return pd_errorf(err, PD_EINVAL, "attention: group_start decreases at group %d (%lld > %lld)", g,
                                 (long long)a->group_start[g], (long long)a->group_start[g + 1]);
    }
    if (a->head_dim > ATTN_MAX_HEAD_DIM || a->head_dim % 4 != 0)
        return pd_errorf(err, PD_EUNSUPPORTED,
                         "attention: head_dim %d is not supported by the CUDA backend (a multiple of 4, at most %d)",
                         a->head_dim, ATTN_MAX_HEAD_DIM);
    if (a->window < 0 || !(a->softcap >= 0.0f))
        return pd_errorf(err, PD_EINVAL, "attention: window %d and softcap %g must not be negative", (int)a->window,
                         (double)a->softcap);
    if (a->n_tokens == 0) return PD_OK;
    if (!a->q || !a->out || ((a->causal || a->window > 0) && !a->q_pos) || (a->n_segments > 0 && !a->kv) ||
        (a->n_shared > 0 && !a->shared))
        return pd_errorf(err, PD_EINVAL, "attention: NULL q, q_pos, kv, shared or out");
    if (misaligned16(a->q) || misaligned16(a->out))
        return pd_errorf(err, PD_EUNSUPPORTED, "attention: q and out must be 16-byte aligned device memory");
    if (a->n_tokens > INT64_MAX / ((int64_t)a->n_head * a->head_dim * ATTN_MAX_CHUNKS * 2))
        return pd_errorf(err, PD_ERANGE, "attention: %lld tokens is too many", (long long)a->n_tokens);
    for (int s = 0; s < a->n_shared; s++)
        for (int h = 0; h < a->n_head_kv; h++) {
            char where[96];
            snprintf(where, sizeof where, "shared segment %d, kv head %d", s, h);
            const int rc = check_view(a, &a->shared[(int64_t)s * a->n_head_kv + h], where, err);
            if (rc) return rc;
        }
    const int n_groups = a->n_groups > 0 ? a->n_groups : 1;
    for (int g = 0; g < n_groups; g++)
        for (int s = 0; s < a->n_segments; s++)
            for (int h = 0; h < a->n_head_kv; h++) {
                char where[96];
                snprintf(where, sizeof where, "group %d segment %d, kv head %d", g, s, h);
                const int rc = check_view(a, own_view(a, g, s, h), where, err);
                if (rc) return rc;
            }
    return PD_OK;
}

static int64_t ceil_div(int64_t x, int64_t y) { return (x + y - 1) / y; }

// Query tiles of a set of nq queries: as many as tile_q (the kernel's
// ATTN_TILE_Q or ATTN_MMA_TILE_Q) needs, evenly sized.
static int64_t tiles_of(int64_t nq, int tile_q) { return ceil_div(nq, tile_q); }

// Append the tiles of a query set (proto filled but for q0 and nq) at
// items[at...]; with items NULL only count. Returns the new count.
static int64_t emit_tiles(attn_item *items, int64_t at, const attn_item *proto, int64_t nq, int tile_q) {
    const int64_t nt = tiles_of(nq, tile_q);
    if (items)
        for (int64_t k = 0; k < nt; k++) {
            // Tile k covers [k nq / nt, (k + 1) nq / nt): sizes differ by at
            // most one, none empty (nq >= nt), none above tile_q.
            const int64_t q0 = k * nq / nt, q1 = (k + 1) * nq / nt;
            attn_item *it = &items[at + k];
            *it = *proto;
            it->q0 = q0;
            it->nq = (int)(q1 - q0);
        }
    return at + nt;
}

// Chunks of a key range of `keys` keys (the longest kv head's) for a pass
// whose other dimensions give `base_blocks` blocks: enough to reach
// `target` blocks, none below ATTN_MIN_CHUNK_KEYS keys. *chunk_keys is a
// whole number of key tiles.
static int64_t plan_chunks(int64_t keys, int64_t base_blocks, int64_t target, int64_t *chunk_keys) {
    *chunk_keys = 0;
    if (keys <= 0) return 0;
    int64_t want = ceil_div(target, base_blocks > 0 ? base_blocks : 1);
    const int64_t most = ceil_div(keys, ATTN_MIN_CHUNK_KEYS);
    want = want < most ? want : most;
    want = want < ATTN_MAX_CHUNKS ? want : ATTN_MAX_CHUNKS;
    want = want > 1 ? want : 1;
    int64_t ck = ceil_div(keys, want);
    ck = ceil_div(ck, ATTN_TILE_K) * ATTN_TILE_K;
    *chunk_keys = ck;
    return ceil_div(keys, ck);
}

static size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

// The log-sum-exp merge of n_slots partials (split-K), after either tile kernel.
template <int DPL> static int launch_merge(cuda_backend *cb, const attn_params &p, int n_slots, pd_error *err) {
    const int64_t rows = p.n_tokens * p.n_head;
    attn_merge_kernel<DPL>
        <<<(unsigned)ceil_div(rows, ATTN_WARPS), ATTN_THREADS, 0, cuda_launch_stream(cb)>>>(p, n_slots);
    return cuda_check_launch(err, "attention merge");
}

template <int DPL>
static int launch(cuda_backend *cb, const attn_params &p, int64_t n_items, int n_head_kv, int n_slots,
                  pd_error *err) {
    const size_t smem = sizeof(float) * ((size_t)ATTN_TILE_K * (size_t)p.kstride +
                                         (size_t)ATTN_TILE_K * (size_t)p.head_dim +
                                         (size_t)ATTN_TILE_Q * (size_t)p.head_dim);
    if (smem > 48u * 1024u) {
        if (cb->prop.sharedMemPerBlockOptin > 0 && smem > cb->prop.sharedMemPerBlockOptin)
            return pd_errorf(err, PD_EUNSUPPORTED,
                             "attention: head_dim %d needs %zu bytes of shared memory per block; %s has %zu",
                             p.head_dim, smem, cb->prop.name, (size_t)cb->prop.sharedMemPerBlockOptin);
        const cudaError_t e = cudaFuncSetAttribute(attn_tile_kernel<DPL>,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return cuda_fail(err, e, "attention (cudaFuncSetAttribute shared memory)");
    }
    const dim3 grid((unsigned)n_items, (unsigned)n_head_kv);
    attn_tile_kernel<DPL><<<grid, ATTN_THREADS, smem, cuda_launch_stream(cb)>>>(p);
    int rc = cuda_check_launch(err, "attention tiles");
    if (rc || n_slots <= 1) return rc;
    return launch_merge<DPL>(cb, p, n_slots, err);
}

// The tensor-core path; make_plan has checked that its shared memory fits.
template <int NDT, int DPL>
static int launch_mma(cuda_backend *cb, const attn_params &p, int64_t n_items, int n_head_kv, int n_slots,
                      pd_error *err) {
    const size_t smem = attn_mma_smem_bytes(p.head_dim);
    if (smem > 48u * 1024u) {
        const cudaError_t e = cudaFuncSetAttribute(attn_mma_kernel<NDT>,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return cuda_fail(err, e, "attention (cudaFuncSetAttribute shared memory)");
    }
    const dim3 grid((unsigned)n_items, (unsigned)n_head_kv);
    attn_mma_kernel<NDT><<<grid, ATTN_MMA_THREADS, smem, cuda_launch_stream(cb)>>>(p);
    int rc = cuda_check_launch(err, "attention tiles (tensor cores)");
    if (rc || n_slots <= 1) return rc;
    return launch_merge<DPL>(cb, p, n_slots, err);
}

// How a call is cut into work items.
typedef struct attn_plan {
    int n_groups;        // effective: 1 when a->n_groups is 0
    int n_rep;
    bool mma;            // attn_mma_kernel (tensor cores) rather than attn_tile_kernel
    int tile_q;          // query rows per item, at most: ATTN_MMA_TILE_Q or ATTN_TILE_Q
    bool split;          // decode path (split-K + merge) rather than prefill
    int64_t n_sh_chunks, sh_chunk_keys;
    int64_t n_own_chunks, own_chunk_keys;
    int n_slots;         // partial slots per query; <= 1: items write the output
} attn_plan;

// attn_seg index of segment s of kv head 0: shared views first, then each
// group's own views (see the comment at the top).
static int shared_seg(const pd_attn_args *a, int s) { return s * a->n_head_kv; }
static int own_seg(const pd_attn_args *a, int g, int s) {
    return (a->n_shared + g * a->n_segments + s) * a->n_head_kv;
}

// Write the items of plan pl to items[] (NULL: only count); returns the count.
static int64_t emit_items(const pd_attn_args *a, const attn_plan *pl, attn_item *items) {
    const bool direct = pl->n_slots <= 1;
    attn_item proto;
    int64_t at = 0;
    if (!pl->split) { // prefill: each group's tiles over its whole key list
        for (int g = 0; g < pl->n_groups; g++) {
            const int64_t nt = group_end(a, g) - group_begin(a, g);
            if (nt == 0) continue;
            memset(&proto, 0, sizeof proto);
            proto.t_begin = group_begin(a, g);
            proto.key_begin = 0;
            proto.key_end = LLONG_MAX;
            proto.slot = -1;
            proto.n_seg = a->n_shared + a->n_segments;
            for (int s = 0; s < a->n_shared; s++) proto.seg[s] = shared_seg(a, s);
            for (int s = 0; s < a->n_segments; s++) proto.seg[a->n_shared + s] = own_seg(a, g, s);
            at = emit_tiles(items, at, &proto, nt * pl->n_rep, pl->tile_q);
        }
        return at;
    }
    // Split-K, shared chunks: tiles over every query of the call, the tiles
    // of one chunk adjacent so they meet its keys in L2.
    for (int64_t c = 0; c < pl->n_sh_chunks; c++) {
        memset(&proto, 0, sizeof proto);
        proto.t_begin = 0;
        proto.key_begin = c * pl->sh_chunk_keys;
        proto.key_end = (c + 1) * pl->sh_chunk_keys;
        proto.slot = direct ? -1 : (int)c;
        proto.n_seg = a->n_shared;
        for (int s = 0; s < a->n_shared; s++) proto.seg[s] = shared_seg(a, s);
        at = emit_tiles(items, at, &proto, a->n_tokens * pl->n_rep, pl->tile_q);
    }
    // Split-K, own chunks: per group.
    for (int g = 0; g < pl->n_groups; g++) {
        const int64_t nt = group_end(a, g) - group_begin(a, g);
        if (nt == 0) continue;
        for (int64_t c = 0; c < pl->n_own_chunks; c++) {
            memset(&proto, 0, sizeof proto);
            proto.t_begin = group_begin(a, g);
            proto.key_begin = c * pl->own_chunk_keys;
            proto.key_end = (c + 1) * pl->own_chunk_keys;
            proto.slot = direct ? -1 : (int)(pl->n_sh_chunks + c);
            proto.n_seg = a->n_segments;
            for (int s = 0; s < a->n_segments; s++) proto.seg[s] = own_seg(a, g, s);
            at = emit_tiles(items, at, &proto, nt * pl->n_rep, pl->tile_q);
        }
    }
    return at;
}

// Which kernel runs the items (the plan is the same for both):
//   attn_mma_kernel, tensor cores, when every K/V view the call reads holds
//     f16 rows (the default KV cache type, and an f16 prefix), head_dim is a
//     multiple of 16, its shared memory fits the device, and the query sets
//     have at least ATTN_MMA_MIN_ROWS rows per kv head on average over the
//     groups with tokens: prefill chunks, and decode batches of GQA models
//     (n_rep = n_head / n_head_kv rows per token, 4-8 in today's models);
//   attn_tile_kernel, f32 on CUDA cores, otherwise: f32 rows anywhere (an
//     f32 cache or an f32 compressed prefix), head_dim not a multiple of 16,
//     or decode of single tokens of an MHA model (n_rep 1-3), where the 16
//     rows of a fragment would be mostly padding.
static bool use_mma(const cuda_backend *cb, const pd_attn_args *a, int n_groups) {
    if (a->head_dim % 16 != 0) return false;
    const size_t optin = cb->prop.sharedMemPerBlockOptin > 0 ? cb->prop.sharedMemPerBlockOptin : 48u * 1024u;
    if (attn_mma_smem_bytes(a->head_dim) > optin) return false;
    const int nkv = a->n_head_kv;
    int64_t busy_groups = 0;
    for (int g = 0; g < n_groups; g++) {
        if (group_end(a, g) == group_begin(a, g)) continue; // its keys are never read
        busy_groups++;
        for (int s = 0; s < a->n_segments; s++)
            for (int h = 0; h < nkv; h++) {
                const pd_kv_view *kv = own_view(a, g, s, h);
                if (kv->len > 0 && kv->type != PD_TYPE_F16) return false;
            }
    }
    for (int64_t i = 0; i < (int64_t)a->n_shared * nkv; i++)
        if (a->shared[i].len > 0 && a->shared[i].type != PD_TYPE_F16) return false;
    const int64_t rows = a->n_tokens * (a->n_head / nkv);
    return busy_groups > 0 && rows >= (int64_t)ATTN_MMA_MIN_ROWS * busy_groups;
}

// Pick the path and the chunk sizes. Returns false when no query can see
// any key (the output is all zeros).
static bool make_plan(const cuda_backend *cb, const pd_attn_args *a, attn_plan *pl) {
    memset(pl, 0, sizeof *pl);
    const int nkv = a->n_head_kv;
    pl->n_groups = a->n_groups > 0 ? a->n_groups : 1;
    pl->n_rep = a->n_head / nkv;
    pl->mma = use_mma(cb, a, pl->n_groups);
    pl->tile_q = pl->mma ? ATTN_MMA_TILE_Q : ATTN_TILE_Q;

    // Longest key list of a kv head: over the shared views, and over each
    // (non-empty) group's own views.
    int64_t sh_keys = 0, own_keys = 0, max_group_tokens = 0, group_tiles = 0;
    for (int h = 0; h < nkv; h++) {
        int64_t len = 0;
        for (int s = 0; s < a->n_shared; s++) len += a->shared[(int64_t)s * nkv + h].len;
        sh_keys = len > sh_keys ? len : sh_keys;
    }
    for (int g = 0; g < pl->n_groups; g++) {
        const int64_t nt = group_end(a, g) - group_begin(a, g);
        if (nt == 0) continue; // its keys are never read
        max_group_tokens = nt > max_group_tokens ? nt : max_group_tokens;
        group_tiles += tiles_of(nt * pl->n_rep, pl->tile_q);
        for (int h = 0; h < nkv; h++) {
            int64_t len = 0;
            for (int s = 0; s < a->n_segments; s++) len += own_view(a, g, s, h)->len;
            own_keys = len > own_keys ? len : own_keys;
        }
    }
    if (sh_keys == 0 && own_keys == 0) return false;

    const int sms = cb->prop.multiProcessorCount > 0 ? cb->prop.multiProcessorCount : 132;
    const int64_t target = (int64_t)ATTN_BLOCKS_PER_SM * sms;
    // The prefill path needs enough query tiles to fill the device by
    // itself (a wave of ATTN_PREFILL_MIN_BLOCKS_PER_SM blocks per SM), and
    // reads a shared prefix once per group: not for a batch of short groups
    // over a shared prefix.
    pl->split = group_tiles * nkv < (int64_t)ATTN_PREFILL_MIN_BLOCKS_PER_SM * sms ||
                (sh_keys > 0 && pl->n_groups > 1 && max_group_tokens <= ATTN_DECODE_MAX_TOKENS);
    if (!pl->split) {
        pl->n_slots = 1;
        return true;
    }
    pl->n_sh_chunks =
        plan_chunks(sh_keys, tiles_of(a->n_tokens * pl->n_rep, pl->tile_q) * nkv, target, &pl->sh_chunk_keys);
    pl->n_own_chunks = plan_chunks(own_keys, group_tiles * nkv, target, &pl->own_chunk_keys);
    pl->n_slots = (int)(pl->n_sh_chunks + pl->n_own_chunks);
    return true;
}

extern "C" int cuda_attention(pd_backend *be, const pd_attn_args *a, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    int rc = validate(a, err);
    if (rc || a->n_tokens == 0) return rc;
    rc = cuda_enter(cb, err);
    if (rc) return rc;

    attn_plan pl;
    if (!make_plan(cb, a, &pl)) { // no query sees any key: zeros
        const size_t bytes = (size_t)a->n_tokens * (size_t)a->n_head * (size_t)a->head_dim * sizeof(float);
        const cudaError_t e = cudaMemsetAsync(a->out, 0, bytes, cb->stream);
        return e == cudaSuccess ? PD_OK : cuda_fail(err, e, "attention (cudaMemsetAsync of the output)");
    }
    const int64_t n_items = emit_items(a, &pl, NULL);
    if (n_items > INT_MAX) // grid.x is at most 2^31 - 1
        return pd_errorf(err, PD_ERANGE, "attention: %lld work items is too many", (long long)n_items);
    const bool direct = pl.n_slots <= 1;

    // Host descriptors [segs | items], uploaded as one block.
    const int nkv = a->n_head_kv;
    const int64_t n_segs = ((int64_t)a->n_shared + (int64_t)pl.n_groups * a->n_segments) * nkv;
    const size_t seg_bytes = align256((size_t)n_segs * sizeof(attn_seg));
    const size_t host_bytes = seg_bytes + (size_t)n_items * sizeof(attn_item);
    char *host = (char *)calloc(1, host_bytes);
    if (!host)
        return pd_errorf(err, PD_ENOMEM, "attention: out of host memory for %zu bytes of descriptors", host_bytes);
    attn_seg *segs = (attn_seg *)host;
    for (int s = 0; s < a->n_shared; s++)
        for (int h = 0; h < nkv; h++) {
            const pd_kv_view *kv = &a->shared[(int64_t)s * nkv + h];
            segs[shared_seg(a, s) + h] = attn_seg{kv->k, kv->v, kv->pos, (long long)kv->len, kv->type == PD_TYPE_F16};
        }
    for (int g = 0; g < pl.n_groups; g++)
        for (int s = 0; s < a->n_segments; s++)
            for (int h = 0; h < nkv; h++) {
                const pd_kv_view *kv = own_view(a, g, s, h);
                segs[own_seg(a, g, s) + h] =
                    attn_seg{kv->k, kv->v, kv->pos, (long long)kv->len, kv->type == PD_TYPE_F16};
            }
    emit_items(a, &pl, (attn_item *)(host + seg_bytes));

    // Device scratch [segs | items | part_ml | part_o].
    const size_t item_bytes = align256((size_t)n_items * sizeof(attn_item));
    const size_t rows = (size_t)a->n_tokens * (size_t)a->n_head;
    const size_t ml_bytes = direct ? 0 : align256((size_t)pl.n_slots * rows * sizeof(float2));
    const size_t o_bytes = direct ? 0 : (size_t)pl.n_slots * rows * (size_t)a->head_dim * sizeof(float);
    char *dev = (char *)cuda_scratch_get(cb, CUDA_SCRATCH_ATTN, seg_bytes + item_bytes + ml_bytes + o_bytes, err);
    if (!dev) {
        free(host);
        return err ? err->code : PD_ENOMEM;
    }
    // Ordered on the stream after every earlier user of the scratch, and
    // host is reusable once cuda_upload returns.
    rc = cuda_upload(cb, dev, host, host_bytes, err);
    free(host);
    if (rc) return rc;

    attn_params p;
    memset(&p, 0, sizeof p);
    p.q = a->q;
    p.q_pos = a->q_pos;
    p.out = a->out;
    p.segs = (const attn_seg *)dev;
    p.items = (const attn_item *)(dev + seg_bytes);
    p.part_ml = direct ? NULL : (float2 *)(dev + seg_bytes + item_bytes);
    p.part_o = direct ? NULL : (float *)(dev + seg_bytes + item_bytes + ml_bytes);
    p.n_tokens = a->n_tokens;
    p.n_head = a->n_head;
    p.n_rep = pl.n_rep;
    p.head_dim = a->head_dim;
    // K rows padded to an odd number of float4s: the eight lanes of one
    // float4 shared-memory phase then hit eight distinct bank groups.
    p.kstride = (a->head_dim / 4) % 2 == 1 ? a->head_dim : a->head_dim + 4;
    p.scale = a->scale;
    p.causal = a->causal ? 1 : 0;
    p.window = a->window;
    p.softcap = a->softcap;
    if (pl.mma) {
        if (a->head_dim <= 64) return launch_mma<4, 2>(cb, p, n_items, nkv, pl.n_slots, err);
        if (a->head_dim <= 128) return launch_mma<8, 4>(cb, p, n_items, nkv, pl.n_slots, err);
        return launch_mma<16, 8>(cb, p, n_items, nkv, pl.n_slots, err);
    }
    if (a->head_dim <= 64) return launch<2>(cb, p, n_items, nkv, pl.n_slots, err);
    if (a->head_dim <= 128) return launch<4>(cb, p, n_items, nkv, pl.n_slots, err);
    return launch<8>(cb, p, n_items, nkv, pl.n_slots, err);
}
