// cudaemu: the subset of the WMMA API (nvcuda::wmma, CUDA's <mma.h>) that
// kernels/cuda uses: 16x16x16 tiles of __half inputs with f32 accumulators.
//
// Semantics, exactly defined here where the hardware leaves them open:
//   - Every lane of the warp holds the whole tile (x[] in row-major order of
//     the tile: x[row * cols + col]; matrix_b is K x N, so x[k * 16 + n]),
//     whatever the fragment's layout. Hardware spreads the tile over the
//     lanes in an unspecified way, so kernels must not index x[] by position
//     (fill_fragment and uniform elementwise ops are fine on both).
//   - load_matrix_sync: each lane reads the whole tile itself, with no
//     barrier: data that other lanes wrote with ordinary stores must be
//     published with __syncwarp() first, as on hardware.
//   - store_matrix_sync: a warp barrier (all 32 lanes must call it, as on
//     hardware), then lane 0 alone writes the tile. A lane that reads what
//     the store wrote without a __syncwarp() after it may see old data, so
//     a missing __syncwarp shows up as a wrong result here too.
//   - mma_sync: D = A * B + C per lane; each product of two halves is exact
//     in f32 and the 16 products of an output are added to C's element in
//     k order, each addition rounded to f32 (tensor cores accumulate with at
//     least this precision; their order is unspecified).
//   - Pointers must be 256-bit (32-byte) aligned and ldm a multiple of 16
//     bytes (8 halves, 4 floats), as the CUDA documentation requires; a
//     violation aborts with a message, where a GPU would fault or misread.
#ifndef CUDAEMU_MMA_H
#define CUDAEMU_MMA_H

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include "cuda_fp16.h"
#include "cudaemu_device.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

namespace detail {

template <typename T> struct tile {
    typedef T element_type;
    enum { num_elements = 256 };
    T x[256];
};

static inline void check(const void *p, unsigned ldm, size_t elem, const char *what) {
    if (((uintptr_t)p & 31u) != 0 || (ldm * elem) % 16u != 0 || ldm < 16) {
        fprintf(stderr,
                "cudaemu: wmma::%s: pointer %p must be 32-byte aligned and ldm %u a multiple of 16 bytes, at "
                "least 16 elements\n",
                what, p, ldm);
        abort();
    }
}

static inline void warp_barrier() { (void)cudaemu::warp_exchange(0xffffffffu, 0, -1, true); }

// Element (r, c) of a 16x16 tile at p: row-major or column-major with
// leading dimension ldm.
template <typename T> static inline T at(const T *p, unsigned ldm, int r, int c, bool row_major_mem) {
    return row_major_mem ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r];
}

} // namespace detail

template <typename Use, int M, int N, int K, typename T, typename Layout = void> class fragment;

template <typename Layout>
class fragment<matrix_a, 16, 16, 16, __half, Layout> : public detail::tile<__half> {};
template <typename Layout>
class fragment<matrix_b, 16, 16, 16, __half, Layout> : public detail::tile<__half> {};
template <> class fragment<accumulator, 16, 16, 16, float, void> : public detail::tile<float> {};

template <typename Use, typename T, typename Layout, typename V>
static inline void fill_fragment(fragment<Use, 16, 16, 16, T, Layout> &f, const V &v) {
    for (int i = 0; i < 256; i++) f.x[i] = (T)v;
}

template <typename Use, typename Layout>
static inline void load_matrix_sync(fragment<Use, 16, 16, 16, __half, Layout> &f, const __half *p, unsigned ldm) {
    static_assert(std::is_same<Layout, row_major>::value || std::is_same<Layout, col_major>::value,
                  "matrix_a/matrix_b fragments name their layout");
    detail::check(p, ldm, sizeof(__half), "load_matrix_sync");
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++)
            f.x[r * 16 + c] = detail::at(p, ldm, r, c, std::is_same<Layout, row_major>::value);
}

static inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float> &f, const float *p, unsigned ldm,
                                    layout_t layout) {
    detail::check(p, ldm, sizeof(float), "load_matrix_sync");
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) f.x[r * 16 + c] = detail::at(p, ldm, r, c, layout == mem_row_major);
}

static inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 16, float> &f, unsigned ldm,
                                     layout_t layout) {
    detail::check(p, ldm, sizeof(float), "store_matrix_sync");
    detail::warp_barrier();
    if (cudaemu::lane_id() != 0) return;
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) {
            float *dst = layout == mem_row_major ? &p[(size_t)r * ldm + c] : &p[(size_t)c * ldm + r];
            *dst = f.x[r * 16 + c];
        }
}

template <typename LA, typename LB>
static inline void mma_sync(fragment<accumulator, 16, 16, 16, float> &d,
                            const fragment<matrix_a, 16, 16, 16, __half, LA> &a,
                            const fragment<matrix_b, 16, 16, 16, __half, LB> &b,
                            const fragment<accumulator, 16, 16, 16, float> &c) {
    float fa[256], fb[256];
    for (int i = 0; i < 256; i++) {
        fa[i] = __half2float(a.x[i]);
        fb[i] = __half2float(b.x[i]);
    }
    float out[256];
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            float acc = c.x[m * 16 + n];
            for (int k = 0; k < 16; k++) acc += fa[m * 16 + k] * fb[k * 16 + n];
            out[m * 16 + n] = acc;
        }
    for (int i = 0; i < 256; i++) d.x[i] = out[i]; // d may be c
}

} // namespace wmma
} // namespace nvcuda

#endif
