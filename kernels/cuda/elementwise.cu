// The light per-element ops: rmsnorm (and add_rmsnorm), rope (and
// qkv_bias_rope), swiglu, geglu, softcap, scale, add, f32 <-> f16
// conversion (KV rows). Each mirrors the
// CPU backend's formula (kernels/cpu/backend_cpu.c and the scalar kernels
// in simd_scalar.c) operation for operation; the explicit _rn intrinsics
// keep nvcc from fusing a multiply and an add into one FMA where the CPU
// rounds twice.
#include "kernels/cuda/cuda_internal.h"

#include <cuda_fp16.h>
#include <math.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------------
 * rmsnorm: out = x * (1 / sqrtf(sum(x^2) / dim + eps)) * weight
 * ------------------------------------------------------------------------ */

// One block per row at a time. As on the CPU: the sum of squares in float,
// scale = 1.0f / sqrtf(ss / (float)dim + eps) in float, then (x * scale) *
// weight. Only the summation order differs (lanes and warps instead of the
// CPU's SIMD lanes). With h (add_rmsnorm), x[c] += h[c] first and the sum
// is over the new x, which is stored: the add op's rounding, so the fused
// op equals add then rmsnorm bit for bit. out may equal x or h: each thread
// reads x[c] and h[c] before it writes out[c], and the sum is complete
// before any write to out.
__global__ void rmsnorm_kernel(float *x, const float *h, const float *weight, int64_t n, int64_t dim, float eps,
                               float *out) {
    __shared__ float red[32];
    for (int64_t r = blockIdx.x; r < n; r += gridDim.x) {
        float *xr = x + r * dim;
        float *o = out + r * dim;
        float ss = 0.0f;
        if (h) {
            const float *hr = h + r * dim;
            for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
                const float v = __fadd_rn(xr[c], hr[c]);
                xr[c] = v;
                ss = fmaf(v, v, ss);
            }
        } else {
            for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) ss = fmaf(xr[c], xr[c], ss);
        }
        ss = cuda_block_sum(ss, red);
        const float scale = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)dim), eps)));
        if (weight)
            for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) o[c] = __fmul_rn(__fmul_rn(xr[c], scale), weight[c]);
        else
            for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) o[c] = __fmul_rn(xr[c], scale);
    }
}

static int rmsnorm_launch(cuda_backend *cb, float *x, const float *h, const float *weight, int64_t n, int64_t dim,
                          float eps, float *out, pd_error *err) {
    // Few long rows (decode): wide blocks, so one row is not left to 256
    // threads; many rows: 256 threads per row, many blocks per SM.
    const int threads = n < 2 * (int64_t)cb->prop.multiProcessorCount && dim >= 4096 ? 1024 : 256;
    const unsigned blocks = (unsigned)(n < (1 << 20) ? n : (1 << 20));
    rmsnorm_kernel<<<blocks, threads, 0, cuda_launch_stream(cb)>>>(x, h, weight, n, dim, eps, out);
    return cuda_check_launch(err, h ? "add_rmsnorm" : "rmsnorm");
}

int cuda_rmsnorm(pd_backend *be, const float *x, const float *weight, int64_t n, int64_t dim, float eps, float *out,
                 pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    const int rc = cuda_enter(cb, err);
    if (rc) return rc;
    if (n <= 0 || dim <= 0) return PD_OK;
    if (!x || !out) return pd_errorf(err, PD_EINVAL, "rmsnorm: NULL input or output");
    // x is only written when h is given.
    return rmsnorm_launch(cb, (float *)x, NULL, weight, n, dim, eps, out, err);
}

int cuda_add_rmsnorm(pd_backend *be, float *x, const float *h, const float *weight, int64_t n, int64_t dim, float eps,
                     float *out, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    const int rc = cuda_enter(cb, err);
    if (rc) return rc;
    if (n <= 0 || dim <= 0) return PD_OK;
    if (!x || !h || !out) return pd_errorf(err, PD_EINVAL, "add_rmsnorm: NULL input or output");
    return rmsnorm_launch(cb, x, h, weight, n, dim, eps, out, err);
}

/* ------------------------------------------------------------------------
 * rope
 * ------------------------------------------------------------------------ */

// Per-pair inverse frequencies, computed on the host with the same libm pow
// and the same double arithmetic as the CPU backend, passed by value.
typedef struct rope_table {
    double inv_freq[PD_ROPE_MAX_FACTORS];
} rope_table;

// One block per token at a time; thread i handles frequency pair i for
// every head (its sin/cos computed once). The CPU's precision choices, step
// by step: theta = pos * inv_freq in double, reduced to [-pi, pi] in double,
// rounded to float, then a float sin/cos. Here the sin/cos of that float are
// computed in double and rounded to float: within half an ulp, like glibc's
// sincosf, so the two nearly always agree (CUDA's sincosf is within 2 ulp).
static __device__ __forceinline__ void rope_sincos(double p, double inv_freq, float *sn, float *cs) {
    double th = __dmul_rn(p, inv_freq);
    th = __dsub_rn(th, __dmul_rn(6.283185307179586, nearbyint(__dmul_rn(th, 0.15915494309189535))));
    const float thf = __double2float_rn(th);
    double s, c;
    sincos((double)thf, &s, &c);
    *sn = __double2float_rn(s), *cs = __double2float_rn(c);
}

// Rotate the pair (x0, x1) into v[i0], v[i1].
static __device__ __forceinline__ void rope_rotate(float *v, int i0, int i1, float x0, float x1, float sn, float cs) {
    v[i0] = __fsub_rn(__fmul_rn(x0, cs), __fmul_rn(x1, sn));
    v[i1] = __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, cs));
}

__global__ void rope_kernel(float *x, const int32_t *__restrict__ pos, int64_t n, int n_heads, int head_dim, int n_pairs,
                            int neox, const rope_table tab) {
    for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
        const double p = (double)pos[t];
        for (int i = (int)threadIdx.x; i < n_pairs; i += (int)blockDim.x) {
            float sn, cs;
            rope_sincos(p, tab.inv_freq[i], &sn, &cs);
            // NEOX rotates (x[i], x[i + n_pairs]); NORM the pair (x[2i], x[2i+1]).
            const int i0 = neox ? i : 2 * i;
            const int i1 = neox ? i + n_pairs : 2 * i + 1;
            for (int h = 0; h < n_heads; h++) {
                float *v = x + (t * n_heads + h) * (int64_t)head_dim;
                rope_rotate(v, i0, i1, v[i0], v[i1], sn, cs);
            }
        }
    }
}

// The CPU's n_rot rules (at most head_dim, rounded down to even) and the
// inverse frequencies theta_i = base^(-2i/n_rot) / freq_factors[i], in
// double as the CPU computes them. *n_pairs 0: nothing rotates.
static int rope_table_make(const pd_rope_params *p, int head_dim, rope_table *tab, int *n_pairs, pd_error *err) {
    int n_rot = p->n_rot < head_dim ? p->n_rot : head_dim;
    n_rot &= ~1;
    *n_pairs = n_rot > 0 ? n_rot / 2 : 0;
    if (*n_pairs > PD_ROPE_MAX_FACTORS)
        return pd_errorf(err, PD_EUNSUPPORTED, "rope: %d rotated dimensions, at most %d supported", n_rot,
                         2 * PD_ROPE_MAX_FACTORS);
    const double base = (double)p->freq_base;
    for (int i = 0; i < PD_ROPE_MAX_FACTORS; i++) tab->inv_freq[i] = 0.0;
    for (int i = 0; i < *n_pairs; i++) {
        tab->inv_freq[i] = pow(base, -2.0 * (double)i / (double)n_rot);
        if (p->freq_factors) tab->inv_freq[i] /= (double)p->freq_factors[i];
    }
    return PD_OK;
}

int cuda_rope(pd_backend *be, float *x, const int32_t *pos, int64_t n, int n_heads, int head_dim,
              const pd_rope_params *p, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    int rc = cuda_enter(cb, err);
    if (rc) return rc;
    if (n <= 0 || n_heads <= 0 || head_dim <= 0) return PD_OK;
    if (!p) return pd_errorf(err, PD_EINVAL, "rope: NULL parameters");
    if (!x || !pos) return pd_errorf(err, PD_EINVAL, "rope: NULL input or positions");
    rope_table tab;
    int n_pairs;
    if ((rc = rope_table_make(p, head_dim, &tab, &n_pairs, err))) return rc;
    if (n_pairs == 0) return PD_OK;
    const int threads = n_pairs < 128 ? ((n_pairs + 31) / 32) * 32 : 128;
    const unsigned blocks = (unsigned)(n < (1 << 20) ? n : (1 << 20));
    rope_kernel<<<blocks, threads, 0, cuda_launch_stream(cb)>>>(x, pos, n, n_heads, head_dim, n_pairs,
                                                                   p->mode == PD_ROPE_NEOX, tab);
    return cuda_check_launch(err, "rope");
}

/* ------------------------------------------------------------------------
 * qkv_bias_rope: the biases of fresh Q, K, V and rope of Q and K in one
 * launch
 * ------------------------------------------------------------------------ */

// Block (x, y) handles token blockIdx.x's head blockIdx.y: Q heads first,
// then K heads, then (with a V bias) V heads. Thread i takes frequency pair
// i: bias added (the add op's rounding), then rotated exactly as
// rope_kernel does; dimensions from n_rot on only get their bias. So the
// result equals add then rope bit for bit.
typedef struct qkv_rope_ptrs {
    float *q, *k, *v;
    const float *bq, *bk, *bv;
    const int32_t *pos;
} qkv_rope_ptrs;

__global__ void qkv_bias_rope_kernel(const qkv_rope_ptrs a, int n_head, int n_head_kv, int head_dim, int n_pairs,
                                     int neox, int v_only, const rope_table tab) {
    const int64_t t = blockIdx.x;
    const int hh = (int)blockIdx.y + (v_only ? n_head + n_head_kv : 0);
    float *v;
    const float *b;
    bool rotate = n_pairs > 0;
    if (hh < n_head) {
        v = a.q + (t * n_head + hh) * (int64_t)head_dim, b = a.bq ? a.bq + (int64_t)hh * head_dim : NULL;
    } else if (hh < n_head + n_head_kv) {
        const int h = hh - n_head;
        v = a.k + (t * n_head_kv + h) * (int64_t)head_dim, b = a.bk ? a.bk + (int64_t)h * head_dim : NULL;
    } else {
        const int h = hh - n_head - n_head_kv;
        v = a.v + (t * n_head_kv + h) * (int64_t)head_dim, b = a.bv + (int64_t)h * head_dim;
        rotate = false;
    }
    const int n_rot = rotate ? 2 * n_pairs : 0;
    if (b)
        for (int d = n_rot + (int)threadIdx.x; d < head_dim; d += (int)blockDim.x) v[d] = __fadd_rn(v[d], b[d]);
    if (!rotate) return;
    const double p = (double)a.pos[t];
    for (int i = (int)threadIdx.x; i < n_pairs; i += (int)blockDim.x) {
        float sn, cs;
        rope_sincos(p, tab.inv_freq[i], &sn, &cs);
        const int i0 = neox ? i : 2 * i;
        const int i1 = neox ? i + n_pairs : 2 * i + 1;
        float x0 = v[i0], x1 = v[i1];
        if (b) x0 = __fadd_rn(x0, b[i0]), x1 = __fadd_rn(x1, b[i1]);
        rope_rotate(v, i0, i1, x0, x1, sn, cs);
    }
}

int cuda_qkv_bias_rope(pd_backend *be, const pd_qkv_args *a, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    int rc = cuda_enter(cb, err);
    if (rc) return rc;
    if (a->n <= 0 || a->head_dim <= 0) return PD_OK;
    if (a->n > INT_MAX || a->n_head < 0 || a->n_head_kv < 0 || a->n_head + 2 * a->n_head_kv > 65535)
        return pd_errorf(err, PD_EINVAL, "qkv_bias_rope: %lld tokens of %d + %d heads is out of range", (long long)a->n,
                         a->n_head, a->n_head_kv);
    if (!a->q || !a->k || (a->bv && !a->v))
        return pd_errorf(err, PD_EINVAL, "qkv_bias_rope: NULL q, k or v");
    rope_table tab;
    int n_pairs = 0;
    if (a->rope) {
        if (!a->pos) return pd_errorf(err, PD_EINVAL, "qkv_bias_rope: NULL positions");
        if ((rc = rope_table_make(a->rope, a->head_dim, &tab, &n_pairs, err))) return rc;
    } else {
        memset(&tab, 0, sizeof tab);
    }
    // Heads with nothing to do get no blocks: V only with a bias, Q and K
    // only with a bias or a rotation.
    const bool qk = n_pairs > 0 || a->bq || a->bk;
    const int heads = (qk ? a->n_head + a->n_head_kv : 0) + (a->bv ? a->n_head_kv : 0);
    if (heads == 0) return PD_OK;
    const qkv_rope_ptrs ptrs = {a->q, a->k, a->v, a->bq, a->bk, a->bv, a->pos};
    const int per = n_pairs > (a->head_dim - 2 * n_pairs) ? n_pairs : a->head_dim - 2 * n_pairs;
    const int threads = per < 128 ? ((per + 31) / 32) * 32 : 128;
    const dim3 grid((unsigned)a->n, (unsigned)heads);
    qkv_bias_rope_kernel<<<grid, threads > 0 ? threads : 32, 0, cuda_launch_stream(cb)>>>(
        ptrs, a->n_head, a->n_head_kv, a->head_dim, n_pairs, a->rope && a->rope->mode == PD_ROPE_NEOX, !qk, tab);
    return cuda_check_launch(err, "qkv_bias_rope");
}

/* ------------------------------------------------------------------------
 * swiglu, geglu, softcap, scale, add
 * ------------------------------------------------------------------------ */

// out = g / (1 + expf(-g)) * u, the CPU's formula and order. out may equal
// gate (each element is read before it is written, by the same thread).
__global__ void swiglu_kernel(const float *gate, const float *__restrict__ up, int64_t n, float *out) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = cuda_silu_mul(gate[i], up[i]);
    }
}

int cuda_swiglu(pd_backend *be, const float *gate, const float *up, int64_t n, float *out, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    const int rc = cuda_enter(cb, err);
    if (rc) return rc;
    if (n <= 0) return PD_OK;
    if (!gate || !up || !out) return pd_errorf(err, PD_EINVAL, "swiglu: NULL input or output");
    swiglu_kernel<<<cuda_grid_blocks(cb, n, 256), 256, 0, cuda_launch_stream(cb)>>>(gate, up, n, out);
    return cuda_check_launch(err, "swiglu");
}

// out = 0.5 g (1 + tanh(sqrt(2/pi) g (1 + 0.044715 g^2))) u: GELU's tanh
// approximation, the CPU's formula and order. out may equal gate.
__global__ void geglu_kernel(const float *gate, const float *__restrict__ up, int64_t n, float *out) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = cuda_gelu_mul(gate[i], up[i]);
    }
}

int cuda_geglu(pd_backend *be, const float *gate, const float *up, int64_t n, float *out, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    const int rc = cuda_enter(cb, err);
    if (rc) return rc;
    if (n <= 0) return PD_OK;
    if (!gate || !up || !out) return pd_errorf(err, PD_EINVAL, "geglu: NULL input or output");
    geglu_kernel<<<cuda_grid_blocks(cb, n, 256), 256, 0, cuda_launch_stream(cb)>>>(gate, up, n, out);
    return cuda_check_launch(err, "geglu");
}

// x = cap * tanh(x / cap) (softcap != 0), or x *= s (softcap == 0).
__global__ void scale_cap_kernel(float *x, int64_t n, float s, float cap) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = cap != 0.0f ? __fmul_rn(cap, tanhf(__fdiv_rn(x[i], cap))) : __fmul_rn(x[i], s);
}

static int scale_cap(pd_backend *be, float *x, int64_t n, float s, float cap, const char *what, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    const int rc = cuda_enter(cb, err);
    if (rc) return rc;
    if (n <= 0) return PD_OK;
    if (!x) return pd_errorf(err, PD_EINVAL, "%s: NULL data", what);
    scale_cap_kernel<<<cuda_grid_blocks(cb, n, 256), 256, 0, cuda_launch_stream(cb)>>>(x, n, s, cap);
    return cuda_check_launch(err, what);
}

int cuda_softcap(pd_backend *be, float *x, int64_t n, float cap, pd_error *err) {
    if (!(cap > 0.0f)) return pd_errorf(err, PD_EINVAL, "softcap: the cap must be positive, not %g", (double)cap);
    return scale_cap(be, x, n, 1.0f, cap, "softcap", err);
}

int cuda_scale(pd_backend *be, float *x, int64_t n, float s, pd_error *err) {
    return scale_cap(be, x, n, s, 0.0f, "scale", err);
}

// y[r][i] += x[r * x_stride + i]: x_stride 0 broadcasts one row (a bias).
__global__ void add_kernel(float *y, const float *x, int64_t rows, int64_t width, int64_t x_stride) {
    const int64_t total = rows * width;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += stride) {
        const int64_t r = e / width, i = e - r * width;
        y[e] = __fadd_rn(y[e], x[r * x_stride + i]);
    }
}

int cuda_add(pd_backend *be, float *y, const float *x, int64_t rows, int64_t width, int64_t x_stride, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    const int rc = cuda_enter(cb, err);
    if (rc) return rc;
    if (rows <= 0 || width <= 0) return PD_OK;
    if (!y || !x) return pd_errorf(err, PD_EINVAL, "add: NULL input or output");
    if (x_stride != 0 && x_stride != width)
        return pd_errorf(err, PD_EINVAL, "add: x_stride %lld must be 0 (broadcast) or the width %lld",
                         (long long)x_stride, (long long)width);
    add_kernel<<<cuda_grid_blocks(cb, rows * width, 256), 256, 0, cuda_launch_stream(cb)>>>(y, x, rows, width, x_stride);
    return cuda_check_launch(err, "add");
}

/* ------------------------------------------------------------------------
 * convert: f32 <-> f16 (KV rows appended to an f16 cache)
 * ------------------------------------------------------------------------ */

// Round to nearest even (__float2half_rn), as F16C and pd_fp32_to_fp16 do,
// so an f16 cache holds the CPU's bits; f16 -> f32 is exact.
__global__ void f32_to_f16_kernel(const float *__restrict__ x, unsigned short *__restrict__ y, int64_t n) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = __half_as_ushort(__float2half_rn(x[i]));
}

__global__ void f16_to_f32_kernel(const unsigned short *__restrict__ x, float *__restrict__ y, int64_t n) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = __half2float(__ushort_as_half(x[i]));
}

int cuda_convert(pd_backend *be, void *dst, pd_type dst_type, const void *src, pd_type src_type, int64_t n,
                 pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    const int rc = cuda_enter(cb, err);
    if (rc) return rc;
    if (n < 0) return pd_errorf(err, PD_EINVAL, "convert: negative count %lld", (long long)n);
    if (!pd_kv_type_ok(dst_type) || !pd_kv_type_ok(src_type))
        return pd_errorf(err, PD_EUNSUPPORTED, "convert: only f32 and f16 are supported (types %d -> %d)",
                         (int)src_type, (int)dst_type);
    if (n == 0) return PD_OK;
    if (!dst || !src) return pd_errorf(err, PD_EINVAL, "convert: NULL input or output");
    if (dst_type == src_type)
        return be->ops->copy(be, dst, src, (size_t)n * (dst_type == PD_TYPE_F16 ? 2u : 4u), err);
    if (dst_type == PD_TYPE_F16)
        f32_to_f16_kernel<<<cuda_grid_blocks(cb, n, 256), 256, 0, cuda_launch_stream(cb)>>>((const float *)src,
                                                                                (unsigned short *)dst, n);
    else
        f16_to_f32_kernel<<<cuda_grid_blocks(cb, n, 256), 256, 0, cuda_launch_stream(cb)>>>((const unsigned short *)src,
                                                                                (float *)dst, n);
    return cuda_check_launch(err, "convert");
}
