/* kernels: tensor element types and the compute backends behind them.
 *
 * This header is the folder's contract. Today it holds the type table that
 * every layer above needs (block sizes, byte sizes, names, ids as in GGUF),
 * reference quantize/dequantize routines per type, half-precision
 * conversions, and the CUDA device probe. The CPU/CUDA compute vtable lands
 * with the inference engine. */
#ifndef PD_KERNELS_H
#define PD_KERNELS_H

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
    PD_TYPE_I8 = 24,
    PD_TYPE_I16 = 25,
    PD_TYPE_I32 = 26,
    PD_TYPE_I64 = 27,
    PD_TYPE_F64 = 28,
    PD_TYPE_BF16 = 30,
    PD_TYPE_COUNT = 31 /* one past the largest id we know */
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

/* CUDA backend probe. Always linkable: without CUDA support compiled in, it
 * reports zero devices and `pd_cuda_compiled()` is false. */
bool pd_cuda_compiled(void);
typedef struct pd_cuda_device_info {
    int index;
    char name[256];
    int cc_major, cc_minor;
    uint64_t total_mem;
} pd_cuda_device_info;
/* Number of usable CUDA devices (0 when none or not compiled in). */
int pd_cuda_device_count(void);
int pd_cuda_device_info_get(int index, pd_cuda_device_info *out, pd_error *err);
/* Round-trip a small SGEMM through cuBLAS on device `index` and compare with
 * the CPU; proves the toolkit, driver and library agree. */
int pd_cuda_selftest(int index, double *max_abs_err, pd_error *err);

#ifdef __cplusplus
}
#endif
#endif
