/* Private to kernels/cpu: the SIMD kernel tables and the data layouts the
 * matmul kernels share. Nothing outside kernels/cpu includes this. */
#ifndef PD_KERNELS_CPU_INTERNAL_H
#define PD_KERNELS_CPU_INTERNAL_H

#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels/backend_impl.h"

#define PD_CPU_MAX_THREADS 512

/* Function attributes for the run-time dispatched SIMD code: the build
 * needs no -march flag, each kernel is compiled for its own target and only
 * called after cpuid said the CPU has it. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define PD_X86 1
#define PD_TARGET_AVX2 __attribute__((target("avx,avx2,fma,f16c")))
#define PD_TARGET_AVX512                                                                        \
    __attribute__((target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#else
#define PD_X86 0
#endif

/* Full unrolling of the short constant-trip loops in tile kernels, so their
 * accumulator arrays live in registers (clang needs its own spelling). */
#if defined(__clang__)
#define PD_UNROLL _Pragma("unroll")
#else
#define PD_UNROLL _Pragma("GCC unroll 16")
#endif

typedef enum cpu_simd_level {
    CPU_SIMD_SCALAR = 0,
    CPU_SIMD_AVX2 = 1,     /* AVX2 + FMA + F16C */
    CPU_SIMD_AVX512 = 2,   /* AVX-512 F/BW/VL/DQ + VNNI (plus the AVX2 set) */
} cpu_simd_level;

/* Best level this CPU supports, lowered by $PD_CPU_SIMD if set. */
cpu_simd_level cpu_simd_detect(void);
const char *cpu_simd_level_name(cpu_simd_level l);

/* Activations quantized for the integer dot products, one row per token.
 *
 * q8_0 (for q8_0, q4_0, q4_1, q5_0, q5_1 and iq4_nl weights), per block of 32:
 *   qs[32] int8 = round(x / d), d = amax / 127 (float, not fp16)
 *   c = -128 * sum(qs) : the correction that turns a dot product against
 *       (w XOR 0x80), i.e. w + 128 as unsigned bytes, back into dot(w, qs);
 *       for q4_0 (nibbles q in 0..15, w = q - 8) the correction is c / 16,
 *       for q5_0 (w = q - 16) c / 8; q4_1/q5_1 need sum(qs) = -c / 128.
 * q8_K (for q4_K and q6_K weights), per super-block of 256:
 *   qs[256] int8, d = amax / 127, bsums[16] = sums of each 16 qs.
 *
 * Rows are stored as separate arrays (qs contiguous per row) so SIMD loads
 * stay simple. */
typedef struct cpu_qact {
    int8_t *qs;     /* [n][cols] */
    float *d;       /* [n][nblocks] */
    int32_t *c;     /* q8_0: [n][nblocks] */
    int16_t *bsums; /* q8_K: [n][cols / 16] */
    int64_t n, cols, nblocks;
} cpu_qact;

/* Arguments of a matmul kernel call: rows [r0, r1) of W against all n
 * activation rows, y[t * ldy + r]. */
typedef struct cpu_mm {
    const uint8_t *w; /* row 0 */
    size_t rb;        /* bytes per row */
    int64_t cols;
    int64_t n;
    const float *x; /* float activations [n][cols] (f32/f16/bf16 weights) */
    const cpu_qact *q; /* quantized activations (quantized weights) */
    float *y;
    int64_t ldy;
    /* Decode only (n <= CPU_DECODE_MAX_N), for kernels with decode_far: 0,
     * or a call for rows [r0, r1) also computes the rows far, 2 far and 3
     * far after them, reading the four ranges side by side (matmul.c). */
    int64_t far;
} cpu_mm;

typedef void (*cpu_mm_fn)(const cpu_mm *m, int64_t r0, int64_t r1);

/* Up to this many activation rows a matmul is a decode step: the kernels
 * read the weights one row at a time, front to back, so each thread is one
 * sequential stream the hardware prefetcher follows (tiles of 4 rows, four
 * interleaved streams, ran at half the memory bandwidth), and every weight
 * byte is loaded once for all n tokens. */
#define CPU_DECODE_MAX_N 8
/* x16_decode_far kernels take cpu_mm.far up to this many tokens */
#define CPU_X16_FAR_MAX_N 2
/* Quantize one row of cols floats (cols a multiple of the block size). */
typedef void (*cpu_quant_fn)(const float *x, int64_t cols, int8_t *qs, float *d, int32_t *c,
                             int16_t *bsums);
/* Dequantize one row to float (fast path; NULL means use the reference). */
typedef void (*cpu_dequant_fn)(const uint8_t *w, int64_t cols, float *out);

/* Weight types multiplied with float activations (no quantized dot
 * product, and dequantize + sgemm for large batches at every level). */
static inline bool cpu_type_is_float(pd_type t) {
    return t == PD_TYPE_F32 || t == PD_TYPE_F16 || t == PD_TYPE_BF16;
}

typedef struct cpu_kernels {
    cpu_simd_level level;
    cpu_mm_fn mm[PD_TYPE_COUNT];       /* small-n (or any-n) kernels, NULL = unsupported */
    /* Kernels for whole 16-row groups in PD_LAYOUT_CPU_X16 (x16.c), at
     * every n. Rows r0 and r1 are multiples of 16; the rows after the last
     * group keep the GGUF layout and take mm. A type with x16_at_load is
     * packed by pack_weight (its x16 kernel reads memory about as fast as
     * its row kernel in decode); the others stay in the file's layout,
     * where the row kernels read faster from memory, and a batch of
     * CPU_X16_REPACK_MIN_N tokens or more repacks each few groups into a
     * per-thread buffer for the x16 kernel (matmul.c). Either way a token
     * gets the same bits: for those types the row and x16 kernels take the
     * same float steps per block. */
    cpu_mm_fn mm_x16[PD_TYPE_COUNT];
    bool x16_at_load[PD_TYPE_COUNT];
    /* mm (decode_far) or mm_x16 (x16_decode_far) honours cpu_mm.far: one
     * core reads memory faster from four far-apart streams than from one */
    bool decode_far[PD_TYPE_COUNT], x16_decode_far[PD_TYPE_COUNT];
    /* The first `groups` groups of rows at src (file layout) arranged as
     * cpu_x16_pack would, into dst (groups * 16 * row_bytes), for the
     * types with an x16 kernel that are not packed at load; NULL: none */
    void (*x16_repack)(pd_type t, const uint8_t *src, int64_t groups, size_t row_bytes, uint8_t *dst);
    /* Types whose mm kernel serves every n, never dequant + GEMM: every
     * quantized type from AVX2 up (set once, in cpu_kernels_avx2), so a
     * token's result does not depend on its batch. */
    bool mm_any_n[PD_TYPE_COUNT];
    cpu_dequant_fn dequant[PD_TYPE_COUNT];
    cpu_quant_fn quant_q8_0;
    cpu_quant_fn quant_q8_K;
    /* The activations a type's kernel wants when they differ from
     * quant_q8_0 / quant_q8_K's; NULL = those. */
    cpu_quant_fn quant_act[PD_TYPE_COUNT];
    /* out[i] = silu(g[i]) * u[i] */
    void (*swiglu)(const float *g, const float *u, int64_t n, float *out);
    /* p[i] = exp(s[i] - m) for i < n; returns the sum (masked entries are
     * -INFINITY and give 0) */
    float (*softmax_exp)(const float *s, float m, int64_t n, float *p);
    float (*dot_f32)(const float *a, const float *b, int64_t n);
    /* y += a * x */
    void (*axpy_f32)(float a, const float *x, int64_t n, float *y);
    /* y *= a */
    void (*scale_f32)(float a, int64_t n, float *y);
    /* o[i] = x[i] * a * w[i] (w NULL: 1); o may equal x */
    void (*scale_mul)(const float *x, float a, const float *w, int64_t n, float *o);
    /* max of x[0..n) (n >= 1; -INFINITY entries allowed) */
    float (*max_f32)(const float *x, int64_t n);
    /* max of x[0..n) (n >= 1) */
    int32_t (*max_i32)(const int32_t *x, int64_t n);
    /* s[j] = scale * dot(q, k + j * hd) for j < nk (attention scores) */
    void (*attn_scores)(const float *q, const float *k, int64_t hd, int64_t nk, float scale,
                        float *s);
    /* o += sum_j p[j] * v[j * hd ...] for j < nk (every row is read: the
     * caller passes only runs of visible keys) */
    void (*attn_pv)(const float *p, const float *v, int64_t hd, int64_t nk, float *o);
    /* The same two over f16 rows (f16 KV caches): each element is widened
     * to f32 exactly as it is loaded, the arithmetic stays f32. */
    void (*attn_scores_f16)(const float *q, const uint16_t *k, int64_t hd, int64_t nk, float scale,
                            float *s);
    void (*attn_pv_f16)(const float *p, const uint16_t *v, int64_t hd, int64_t nk, float *o);
    /* y[i] = x[i] as f16 / as f32; bit for bit pd_fp32_to_fp16 and
     * pd_fp16_to_fp32 (round to nearest even) at every level. */
    void (*f32_to_f16)(const float *x, int64_t n, uint16_t *y);
    void (*f16_to_f32)(const uint16_t *x, int64_t n, float *y);
} cpu_kernels;

void cpu_kernels_scalar(cpu_kernels *k);
#if PD_X86
void cpu_kernels_avx2(cpu_kernels *k);
void cpu_kernels_avx512(cpu_kernels *k);
#endif
/* The q2_K/q3_K/q5_K/iq4_xs entries of each table (simd_kq_*.c), called at
 * the end of the matching cpu_kernels_<level>. */
void cpu_kernels_kq_scalar(cpu_kernels *k);
#if PD_X86
void cpu_kernels_kq_avx2(cpu_kernels *k);
void cpu_kernels_kq_avx512(cpu_kernels *k);
/* The mm_x16 entries (simd_x16_avx512.c). */
void cpu_kernels_x16_avx512(cpu_kernels *k);
#endif

/* x16.c: the PD_LAYOUT_CPU_X16 arrangement. Rows go in groups of 16; a
 * group's bytes are its blocks in order, and block b of a group holds, of
 * block b of its 16 rows: the 2-byte d of each (q8_0, whose blocks start
 * with it), then their 4-byte words interleaved (word k of row i at
 * 64 k + 4 i from there), then, for a block of whole words plus 2 bytes
 * (q6_K), the last 2 bytes of each. For q4_K (36 words) that puts d|dmin,
 * the three scale words and the 32 code words of all 16 rows each in one
 * 64-byte line; q6_K: the 32 words of low bits, the 16 of high bits, the 4
 * of scales, then the 16 d; q8_0: the 16 d, then 8 lines of codes. */
#define CPU_X16 16
/* Groups an x16 kernel takes at a time across its token passes (their
 * codes stay in L2), and so what one repack (matmul.c) prepares. */
#define CPU_X16_BATCH_GROUPS 4
/* Batch size from which a weight in the file's layout is repacked for
 * the x16 kernel (below it the row kernels read the file's layout). */
#define CPU_X16_REPACK_MIN_N 16
/* Whether w (GGUF layout) can be arranged in x16 groups: a kernel for its
 * type, a whole group, rows exactly as long as their blocks. */
static inline bool cpu_x16_fits(const cpu_kernels *k, const pd_weight *w) {
    const pd_type_traits *tr = pd_type_get((uint32_t)w->type);
    return tr && (uint32_t)w->type < PD_TYPE_COUNT && k->mm_x16[w->type] && w->rows >= CPU_X16 &&
           w->row_bytes == (size_t)(w->cols / tr->block_size) * tr->type_size;
}
/* Pack the whole groups of `rows` rows of row_bytes at data in place;
 * tmp holds 16 * row_bytes. */
void cpu_x16_pack(pd_type t, uint8_t *data, int64_t rows, size_t row_bytes, uint8_t *tmp);
/* Row r of a packed weight as GGUF stores it, into out (row_bytes). */
void cpu_x16_row(pd_type t, const uint8_t *data, int64_t rows, size_t row_bytes, int64_t r, uint8_t *out);

/* Shared scalar helpers. */
static inline uint16_t cpu_load_u16(const uint8_t *p) {
    return (uint16_t)(p[0] | (p[1] << 8));
}
static inline float cpu_load_f32(const void *p) {
    float f;
    memcpy(&f, p, sizeof f);
    return f;
}
static inline int8_t cpu_load_i8(const uint8_t *p) {
    int8_t v;
    memcpy(&v, p, 1);
    return v;
}

/* An fp16 value from two little-endian bytes. */
static inline float cpu_load_half(const uint8_t *p) { return pd_fp16_to_fp32(cpu_load_u16(p)); }

/* Store f as fp16 and return the value actually stored (quantizers work
 * against the stored scale). */
static inline float cpu_store_half(uint8_t *p, float f) {
    const uint16_t h = pd_fp32_to_fp16(f);
    p[0] = (uint8_t)(h & 0xffu);
    p[1] = (uint8_t)(h >> 8);
    return pd_fp16_to_fp32(h);
}

/* Round to nearest (ties to even) and clamp into [lo, hi], in float so the
 * conversion to int is always defined; NaN maps to lo. */
static inline int cpu_round_clamp(float v, int lo, int hi) {
    float r = rintf(v);
    r = fmaxf(r, (float)lo); /* fmaxf(NaN, lo) == lo */
    r = fminf(r, (float)hi);
    return (int)r;
}

/* The 6-bit scale and min of sub-block j (0..7) of a q4_K block. */
static inline void cpu_q4k_scale_min(int j, const uint8_t *s, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63u;
        *m = s[j + 4] & 63u;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0x0fu) | ((s[j - 4] >> 6) << 4));
        *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* Inverse of cpu_q4k_scale_min; `s` must start zeroed. */
static inline void cpu_q4k_pack_scale_min(int j, uint8_t *s, uint8_t sc, uint8_t m) {
    if (j < 4) {
        s[j] = (uint8_t)(s[j] | (sc & 63u));
        s[j + 4] = (uint8_t)(s[j + 4] | (m & 63u));
    } else {
        s[j + 4] = (uint8_t)((sc & 0x0fu) | ((m & 0x0fu) << 4));
        s[j - 4] = (uint8_t)(s[j - 4] | ((sc >> 4) << 6));
        s[j] = (uint8_t)(s[j] | ((m >> 4) << 6));
    }
}

/* quant_kq.c: reference row conversions of nb blocks of q2_K, q3_K, q5_K
 * and iq4_xs (pd_quantize_row / pd_dequantize_row dispatch to them). */
void cpu_quantize_q2_K(const float *x, uint8_t *y, uint64_t nb);
void cpu_quantize_q3_K(const float *x, uint8_t *y, uint64_t nb);
void cpu_quantize_q5_K(const float *x, uint8_t *y, uint64_t nb);
void cpu_quantize_iq4_xs(const float *x, uint8_t *y, uint64_t nb);
void cpu_dequantize_q2_K(const uint8_t *x, float *y, uint64_t nb);
void cpu_dequantize_q3_K(const uint8_t *x, float *y, uint64_t nb);
void cpu_dequantize_q5_K(const uint8_t *x, float *y, uint64_t nb);
void cpu_dequantize_iq4_xs(const uint8_t *x, float *y, uint64_t nb);
/* The 16 scales of a q3_K block (its 12 scale bytes at s), minus 32. */
void cpu_q3k_scales(const uint8_t *s, int8_t out[16]);
/* The values an iq4 nibble stands for (ggml's kvalues_iq4nl; iq4_nl and
 * iq4_xs share it; defined in quant_q32.c). */
extern const int8_t cpu_iq4nl_values[16];

/* Bytes per block of the types whose kernels several files hold (the
 * layouts: quant.c, quant_kq.c). */
#define CPU_Q8_0_BYTES 34
#define CPU_Q4_0_BYTES 18
#define CPU_Q4_K_BYTES 144
#define CPU_Q6_K_BYTES 210
#define CPU_Q2_K_BYTES 84
#define CPU_Q3_K_BYTES 110
#define CPU_Q5_K_BYTES 176
#define CPU_IQ4_XS_BYTES 136

/* Blocks of the 32-element 4- and 5-bit types, ggml's layouts: fp16 d;
 * q4_1 and q5_1 then fp16 m; q5_0 and q5_1 then 32 fifth bits qh (little
 * endian); then 16 bytes of nibbles qs (elements 0..15 low, 16..31 high). */
#define CPU_Q4_1_BYTES 20
#define CPU_Q5_0_BYTES 22
#define CPU_Q5_1_BYTES 24
#define CPU_IQ4_NL_BYTES 18

static inline size_t cpu_q32_block_bytes(pd_type t) {
    return t == PD_TYPE_Q4_1 ? CPU_Q4_1_BYTES
           : t == PD_TYPE_Q5_0 ? CPU_Q5_0_BYTES
           : t == PD_TYPE_Q5_1 ? CPU_Q5_1_BYTES
                               : CPU_IQ4_NL_BYTES;
}

/* Where a block's nibbles start. */
static inline size_t cpu_q32_qs_offset(pd_type t) {
    return t == PD_TYPE_Q4_1 ? 4 : t == PD_TYPE_Q5_0 ? 6 : t == PD_TYPE_Q5_1 ? 8 : 2;
}

/* Where a q5_0 or q5_1 block's fifth bits are. */
static inline size_t cpu_q32_qh_offset(pd_type t) { return t == PD_TYPE_Q5_0 ? 2 : 4; }

/* A little-endian 32-bit value at any alignment. */
static inline uint32_t cpu_load_u32le(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Activation quantizers shared by the scalar table; SIMD tables use their
 * own but must produce identical bytes (same float ops, round to nearest
 * even), so the integer dot products agree exactly across levels. */
void cpu_quant_q8_0_scalar(const float *x, int64_t cols, int8_t *qs, float *d, int32_t *c,
                           int16_t *bsums);
void cpu_quant_q8_K_scalar(const float *x, int64_t cols, int8_t *qs, float *d, int32_t *c,
                           int16_t *bsums);
/* quant_q32.c: reference rows of nb blocks of q4_1, q5_0, q5_1 or iq4_nl
 * (false for any other type). */
bool cpu_quantize_q32(pd_type t, const float *x, uint8_t *y, uint64_t nb);
bool cpu_dequantize_q32(pd_type t, const uint8_t *x, float *y, uint64_t nb);
/* simd_q32_*.c: add the q4_1/q5_0/q5_1/iq4_nl kernels of a level to its
 * table (called at the end of cpu_kernels_<level>). */
void cpu_q32_kernels_scalar(cpu_kernels *k);
#if PD_X86
void cpu_q32_kernels_avx2(cpu_kernels *k);
void cpu_q32_kernels_avx512(cpu_kernels *k);
#endif

#if PD_X86
/* The CPU has AVX and F16C (the vcvtph2ps/vcvtps2ph conversions). */
bool cpu_has_f16c(void);
void cpu_quant_q8_0_avx2(const float *x, int64_t cols, int8_t *qs, float *d, int32_t *c, int16_t *bsums);
void cpu_quant_q8_K_avx2(const float *x, int64_t cols, int8_t *qs, float *d, int32_t *c, int16_t *bsums);
/* q8_K in the order the AVX-512 q4_K and q5_K kernels read it: per block
 * the 32-element sub-blocks 0 2 1 3 4 6 5 7, and the first 8 bsums the
 * sums of each sub-block (natural order). */
void cpu_quant_q8_K4_avx512(const float *x, int64_t cols, int8_t *qs, float *d, int32_t *c, int16_t *bsums);
/* q8_0 in the order the AVX-512 kernels of the 32-element 4- and 5-bit types
 * read it: per group of four blocks, the first 16 elements of each, then
 * the last 16 of each (a tail of fewer than four blocks in natural order);
 * c divided by 16. */
void cpu_quant_q8_0_q4_avx512(const float *x, int64_t cols, int8_t *qs, float *d, int32_t *c, int16_t *bsums);
#endif

/* A thread's run of matmul chunks, [lo, hi) packed as hi << 32 | lo, on
 * its own cache line (matmul.c). */
typedef struct cpu_mm_run {
    _Alignas(64) atomic_ullong lohi;
} cpu_mm_run;

/* The CPU backend object (pd_backend.impl points at it). Used by one
 * thread at a time; the scratch buffers only grow. */
typedef struct cpu_backend {
    pd_backend base;
    pd_threadpool *tp;
    int n_threads;
    cpu_kernels k;
    int64_t gemm_min_n[PD_TYPE_COUNT]; /* n at which dequantize + sgemm takes over */
    cpu_mm_run *runs;   /* n_threads */
    void *act;          /* quantized activations */
    size_t act_cap;
    float *work;        /* per-thread float scratch (dequantized tiles, attention) */
    size_t work_cap;    /* floats in total */
    void *x16_tmp;      /* per-thread groups repacked for an x16 kernel */
    size_t x16_tmp_cap;
} cpu_backend;

/* Make sure *buf holds at least `bytes` (64-byte aligned, contents not
 * kept). */
int cpu_scratch_reserve(void **buf, size_t *cap, size_t bytes, pd_error *err);

/* matmul.c */
int cpu_matmul(pd_backend *be, const pd_weight *w, const float *x, int64_t n, float *y,
               pd_error *err);
int cpu_matmul_multi(pd_backend *be, const pd_weight *const *w, int n_w, const float *x, int64_t n,
                     float *const *y, pd_error *err);
/* attention.c */
int cpu_attention(pd_backend *be, const pd_attn_args *a, pd_error *err);

#endif
