/* kernels/types.h: tensor element types (ids as in GGUF, block and byte sizes, names), reference quantize/dequantize per type, half-precision conversions, and the fork-join thread pool the CPU kernels run on.
 * Part of kernels' public contract (kernels/kernels.h includes every part). */
#ifndef PD_KERNELS_TYPES_H
#define PD_KERNELS_TYPES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util/util.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Tensor element types. The numeric values are ggml's, as stored in GGUF
 * tensor tables; never renumber them. */
typedef enum pd_type {
    PD_TYPE_F32 = 0,
    PD_TYPE_F16 = 1,
    PD_TYPE_Q4_0 = 2,
    PD_TYPE_Q4_1 = 3,
    PD_TYPE_Q5_0 = 6,
    PD_TYPE_Q5_1 = 7,
    PD_TYPE_Q8_0 = 8,
    PD_TYPE_Q8_1 = 9,
    PD_TYPE_Q2_K = 10,
    PD_TYPE_Q3_K = 11,
    PD_TYPE_Q4_K = 12,
    PD_TYPE_Q5_K = 13,
    PD_TYPE_Q6_K = 14,
    PD_TYPE_Q8_K = 15,
    PD_TYPE_IQ2_XXS = 16,
    PD_TYPE_IQ2_XS = 17,
    PD_TYPE_IQ3_XXS = 18,
    PD_TYPE_IQ1_S = 19,
    PD_TYPE_IQ4_NL = 20,
    PD_TYPE_IQ3_S = 21,
    PD_TYPE_IQ2_S = 22,
    PD_TYPE_IQ4_XS = 23,
    PD_TYPE_I8 = 24,
    PD_TYPE_I16 = 25,
    PD_TYPE_I32 = 26,
    PD_TYPE_I64 = 27,
    PD_TYPE_F64 = 28,
    PD_TYPE_IQ1_M = 29,
    PD_TYPE_BF16 = 30,
    /* 31-33 (q4_0_4_4, q4_0_4_8, q4_0_8_8) and 36-38 (iq4_nl_4_4, ...) were
     * repacked layouts that llama.cpp no longer reads from files. */
    PD_TYPE_TQ1_0 = 34,
    PD_TYPE_TQ2_0 = 35,
    PD_TYPE_COUNT = 39 /* one past the largest id the GGUF spec defines */
} pd_type;

#define PD_QK_K 256 /* super-block size of the k-quants */

typedef struct pd_type_traits {
    const char *name;    /* "f32", "q8_0", ... (ggml's spelling) */
    uint32_t block_size; /* elements per block (1 for plain types) */
    uint32_t type_size;  /* bytes per block */
    bool can_dequantize; /* pd_dequantize_row supports it */
    bool can_quantize;   /* pd_quantize_row supports it */
} pd_type_traits;

/* NULL for an id that is not a known type. */
const pd_type_traits *pd_type_get(uint32_t type);
/* Parse a type name (case-insensitive); returns PD_ENOTFOUND if unknown. */
int pd_type_from_name(const char *name, pd_type *out, pd_error *err);
/* Bytes needed for n elements of type t; n must be a multiple of the block
 * size. Returns 0 and fills *out, or a negative status on overflow/misuse. */
int pd_type_row_size(pd_type t, uint64_t n, uint64_t *out, pd_error *err);

/* Reference (portable, unvectorised) conversions of one row of n elements.
 * n must be a multiple of the type's block size. */
int pd_quantize_row(pd_type t, const float *src, void *dst, uint64_t n, pd_error *err);
int pd_dequantize_row(pd_type t, const void *src, float *dst, uint64_t n, pd_error *err);

/* IEEE half and bfloat16 conversions (round to nearest even). */
float pd_fp16_to_fp32(uint16_t h);
uint16_t pd_fp32_to_fp16(float f);
float pd_bf16_to_fp32(uint16_t h);
uint16_t pd_fp32_to_bf16(float f);
/* n values at once, with F16C where the CPU has it: bit for bit the same
 * results as the functions above (KV rows loaded, stored, converted). */
void pd_fp32_to_fp16_row(const float *x, uint16_t *y, size_t n);
void pd_fp16_to_fp32_row(const uint16_t *x, float *y, size_t n);

/* ------------------------------------------------------------------------
 * Thread pool
 *
 * A fixed set of worker threads that run one parallel job at a time. The
 * calling thread takes part as thread 0, so a pool of 1 runs everything
 * inline. Not reentrant: one pd_threadpool_run at a time per pool.
 * ------------------------------------------------------------------------ */

typedef struct pd_threadpool pd_threadpool;
typedef void (*pd_parallel_fn)(void *ctx, int ith, int nth);

/* n_threads <= 0 means the number of online CPUs. */
int pd_threadpool_create(int n_threads, pd_threadpool **out, pd_error *err);
void pd_threadpool_free(pd_threadpool *tp);
int pd_threadpool_size(const pd_threadpool *tp);
/* Run fn(ctx, ith, nth) for ith = 0..nth-1 on the pool's threads; returns
 * when all have finished. */
void pd_threadpool_run(pd_threadpool *tp, pd_parallel_fn fn, void *ctx);

#ifdef __cplusplus
}
#endif
#endif
