// cudaemu: the cuBLAS / cuSOLVER calls kernels/cuda makes, run on the CPU.
//
// A reference implementation for finding bugs in how we call the libraries,
// so it is strict where the real ones are silent:
//   - arguments are validated as cuBLAS / cuSOLVER document it (negative
//     sizes, leading dimensions, enum values, NULL scalars), and unknown or
//     destroyed handles are refused;
//   - every matrix, pointer array, pointer inside one, and infoArray must lie
//     inside one live device allocation over exactly the extent the call
//     touches (column-major: (cols - 1) * ld + rows elements);
//   - alpha / beta must be host memory in CUBLAS_POINTER_MODE_HOST and device
//     memory in CUBLAS_POINTER_MODE_DEVICE;
//   - outputs that overlap other operands (or each other, across a batch, or
//     a batched call's pointer arrays) are refused: the libraries leave such
//     calls undefined;
//   - potrfBatched overwrites the triangle it does not factor with NaN (the
//     cuSOLVER documentation says that triangle is used as workspace and
//     destroyed).
//
// Calls are asynchronous, split as the real libraries split them (they
// cannot read device memory when called):
//   - at call time, the handle, enum values, sizes, leading dimensions, batch
//     counts, NULL pointers and the scalars' pointer mode are checked; in
//     CUBLAS_POINTER_MODE_HOST alpha / beta are read (the caller may reuse
//     them once the call returns); the operands the call names directly (a
//     GEMM's A, B, C and a strided batch's; the pointer arrays themselves;
//     infoArray) are range-checked, and overlaps among them found. A refusal
//     prints "cudaemu: <function>: ..." to stderr and returns
//     CUBLAS_STATUS_INVALID_VALUE / CUSOLVER_STATUS_INVALID_VALUE
//     (NOT_SUPPORTED for a cublasGemmEx type combination cuBLAS or this
//     emulator lacks, NOT_INITIALIZED for a bad handle);
//   - the rest is work enqueued on the handle's stream (cublasSetStream /
//     cusolverDnSetStream; the null stream by default), run after the work
//     enqueued there before it: reading alpha / beta in
//     CUBLAS_POINTER_MODE_DEVICE (and then checking the GEMM's C and the
//     overlaps, which depend on them), reading the pointer arrays' contents
//     (typically written by a kernel enqueued just before) and checking the
//     matrices they point to, the arithmetic, and potrfBatched's infoArray
//     (also its -i for a bad parameter). A check that fails there is a
//     device fault: "cudaemu: <function>: ..." and abort.
// So results may be read only after the stream is synchronized, and memory
// the call reads may not be changed before its work has run.
//
// Arithmetic: single-precision GEMMs (cublasSgemm, cublasGemmEx with compute
// type 32F) convert the inputs to float and accumulate each dot product in
// float, as eight interleaved partial sums added pairwise at the end (a
// blocked order like a GPU's, not a more accurate one); alpha * sum + beta * C
// is formed in float and, for a 16-bit C, rounded to nearest even. TF32
// compute (CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_TF32_TENSOR_OP_MATH) is
// treated as full float. Double routines compute in double. Quick returns and
// zero scalars follow the reference BLAS: when beta == 0, C is not read (NaN
// there does not propagate); when alpha == 0 (or k == 0) A and B are not
// read; when additionally beta == 1, C is not touched.
#include "cuda_runtime.h"
#include "cublas_v2.h"
#include "cusolverDn.h"

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <utility>
#include <vector>

struct cublasContext {
    cudaStream_t stream;
    cublasPointerMode_t pointer_mode;
    cublasMath_t math_mode;
};

struct cusolverDnContext {
    cudaStream_t stream;
};

namespace {

// ---- diagnostics ---------------------------------------------------------------

__attribute__((format(printf, 2, 3))) void complain(const char *fn, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "cudaemu: %s: %s\n", fn, buf);
}

const char *op_name(cublasOperation_t op) {
    switch (op) {
    case CUBLAS_OP_N: return "N";
    case CUBLAS_OP_T: return "T";
    case CUBLAS_OP_C: return "C";
    default: return "?";
    }
}

// ---- handles -------------------------------------------------------------------

// Live handles, so a destroyed or made-up handle is refused rather than read.
std::mutex &handle_mutex() {
    static std::mutex m;
    return m;
}
std::set<const void *> &live_handles() {
    static std::set<const void *> s;
    return s;
}

bool handle_live(const void *h) {
    std::lock_guard<std::mutex> lock(handle_mutex());
    return live_handles().count(h) != 0;
}

bool blas_handle_ok(const char *fn, cublasHandle_t h) {
    if (!h) {
        complain(fn, "handle is NULL (cublasCreate was not called or failed)");
        return false;
    }
    if (!handle_live(h)) {
        complain(fn, "handle %p is not a live cuBLAS handle (destroyed, or never created)", (const void *)h);
        return false;
    }
    return true;
}

bool solver_handle_ok(const char *fn, cusolverDnHandle_t h) {
    if (!h) {
        complain(fn, "handle is NULL (cusolverDnCreate was not called or failed)");
        return false;
    }
    if (!handle_live(h)) {
        complain(fn, "handle %p is not a live cuSOLVER handle (destroyed, or never created)", (const void *)h);
        return false;
    }
    return true;
}

// ---- 16-bit floats -------------------------------------------------------------

uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float bf16_to_float(uint16_t h) { return bits_float((uint32_t)h << 16); }

// Round to nearest even; a NaN stays a (quiet) NaN of the same sign.
uint16_t float_to_bf16(float f) {
    uint32_t x = float_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x0040u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

// IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
float f16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (man << 13)); // inf, NaN (payload kept)
    if (exp != 0) return bits_float(sign | ((exp - 15u + 127u) << 23) | (man << 13));
    // zero or subnormal: man * 2^-24, exact in float
    const float mag = std::ldexp((float)man, -24);
    return sign ? -mag : mag;
}

// Round to nearest even, overflow to infinity, subnormals kept, NaN quiet.
uint16_t float_to_f16(float f) {
    const uint32_t x = float_bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu)); // NaN
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); // >= 65520 (incl. inf): inf
    if (ax >= 0x38800000u) {                                   // >= 2^-14: a normal half
        const uint32_t man = ax & 0x7fffffu;
        uint32_t h = ((((ax >> 23) - 127u + 15u)) << 10) | (man >> 13);
        const uint32_t rem = man & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++; // a carry into the exponent is right
        return (uint16_t)(sign | h);
    }
    if (ax < 0x33000000u) return sign; // below 2^-25: rounds to zero
    // subnormal half: units of 2^-24
    const uint32_t man = (ax & 0x7fffffu) | 0x800000u;
    const int e = (int)(ax >> 23) - 127; // value = man * 2^(e - 23), e in [-25, -15]
    const int shift = -(e + 1);          // 14 .. 24
    uint32_t q = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
}

// ---- element types -------------------------------------------------------------

enum class Elem { F16, BF16, F32, F64 };

size_t elem_size(Elem e) {
    switch (e) {
    case Elem::F16:
    case Elem::BF16: return 2;
    case Elem::F32: return 4;
    case Elem::F64: return 8;
    }
    return 1;
}

template <typename Acc> Acc load(Elem e, const void *base, size_t i) {
    switch (e) {
    case Elem::F16: return (Acc)f16_to_float(static_cast<const uint16_t *>(base)[i]);
    case Elem::BF16: return (Acc)bf16_to_float(static_cast<const uint16_t *>(base)[i]);
    case Elem::F32: return (Acc) static_cast<const float *>(base)[i];
    case Elem::F64: return (Acc) static_cast<const double *>(base)[i];
    }
    return 0;
}

template <typename Acc> void store(Elem e, void *base, size_t i, Acc v) {
    switch (e) {
    case Elem::F16: static_cast<uint16_t *>(base)[i] = float_to_f16((float)v); break;
    case Elem::BF16: static_cast<uint16_t *>(base)[i] = float_to_bf16((float)v); break;
    case Elem::F32: static_cast<float *>(base)[i] = (float)v; break;
    case Elem::F64: static_cast<double *>(base)[i] = (double)v; break;
    }
}

// ---- memory checks -------------------------------------------------------------

// Elements a column-major rows x cols matrix with leading dimension ld spans.
uint64_t span_elems(int64_t rows, int64_t cols, int64_t ld) {
    if (rows <= 0 || cols <= 0) return 0;
    return (uint64_t)(cols - 1) * (uint64_t)ld + (uint64_t)rows;
}

// A column-major block of memory an operation reads or writes.
struct Region {
    const char *p;
    int64_t rows, cols, ld;
    size_t elem;
    bool write;
    std::string what; // for messages
    uint64_t bytes() const { return span_elems(rows, cols, ld) * elem; }
};

std::string describe(const Region &r) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s at %p", r.what.c_str(), (const void *)r.p);
    return buf;
}

std::string fmt(const char *f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char *f, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

// A check that fails inside enqueued work: the device faults (aborts).
[[noreturn]] void fault(const char *fn, const std::string &msg) {
    cudaemu_device_fault("cudaemu: %s: %s", fn, msg.c_str());
}

// Why the region is not inside one live device allocation (or is NULL, or
// not aligned to its element); empty when it is.
std::string region_error(const Region &r) {
    const uint64_t elems = span_elems(r.rows, r.cols, r.ld);
    if (elems == 0) return std::string();
    if (!r.p) return r.what + " is NULL";
    if (elems > std::numeric_limits<uint64_t>::max() / r.elem || elems * r.elem > (uint64_t)SIZE_MAX)
        return r.what + " spans more bytes than the address space";
    if ((uintptr_t)r.p % r.elem != 0)
        return fmt("%s at %p is not aligned to its %zu-byte elements", r.what.c_str(), (const void *)r.p, r.elem);
    const size_t bytes = (size_t)(elems * r.elem);
    if (!cudaemu_is_device_range(r.p, bytes))
        return fmt("%s [%" PRIu64 " elements of %zu bytes = %zu bytes from %p] is not inside a device allocation",
                   r.what.c_str(), elems, r.elem, bytes, (const void *)r.p);
    return std::string();
}

// At call time: complains and returns false when the region is bad.
bool check_region(const char *fn, const Region &r) {
    const std::string e = region_error(r);
    if (e.empty()) return true;
    complain(fn, "%s", e.c_str());
    return false;
}

// A pointer array (batched calls): batch entries, itself in device memory.
bool check_pointer_array(const char *fn, const char *name, const void *arr, int batch) {
    if (!arr) {
        complain(fn, "pointer array %s is NULL", name);
        return false;
    }
    const size_t bytes = (size_t)batch * sizeof(void *);
    if ((uintptr_t)arr % alignof(void *) != 0) {
        complain(fn, "pointer array %s at %p is not aligned to a pointer", name, arr);
        return false;
    }
    if (!cudaemu_is_device_range(arr, bytes)) {
        complain(fn,
                 "pointer array %s [%d pointers = %zu bytes from %p] is not inside a device allocation (the array "
                 "itself must be uploaded to the device)",
                 name, batch, bytes, arr);
        return false;
    }
    return true;
}

// alpha / beta: non-NULL, and host or device memory as the pointer mode says.
bool check_scalar(const char *fn, const char *name, const void *p, size_t bytes, cublasPointerMode_t mode) {
    if (!p) {
        complain(fn, "%s is NULL", name);
        return false;
    }
    const bool dev = cudaemu_is_device_range(p, bytes) != 0;
    if (mode == CUBLAS_POINTER_MODE_HOST && dev) {
        complain(fn, "%s (%p) is device memory but the handle's pointer mode is CUBLAS_POINTER_MODE_HOST", name, p);
        return false;
    }
    if (mode == CUBLAS_POINTER_MODE_DEVICE && !dev) {
        complain(fn, "%s (%p) is not inside a device allocation but the handle's pointer mode is "
                 "CUBLAS_POINTER_MODE_DEVICE", name, p);
        return false;
    }
    return true;
}

int64_t floor_div(int64_t a, int64_t b) { // b > 0
    int64_t q = a / b;
    if ((a % b != 0) && (a < 0)) q--;
    return q;
}

// Whether two regions share a byte (exact, column by column).
bool regions_overlap(const Region &a, const Region &b) {
    const int64_t ea = (int64_t)a.elem, eb = (int64_t)b.elem;
    const int64_t col_a = a.ld * ea, len_a = a.rows * ea;
    const int64_t col_b = b.ld * eb, len_b = b.rows * eb;
    // Column c of a is [a0 + c*col_a, + len_a); column j of b meets [s, t)
    // iff s - len_b < b0 + j*col_b < t, b0 = 0 below.
    const int64_t a0 = (int64_t)((intptr_t)a.p - (intptr_t)b.p);
    for (int64_t c = 0; c < a.cols; c++) {
        const int64_t s = a0 + c * col_a, t = s + len_a;
        int64_t lo = floor_div(s - len_b, col_b) + 1;
        int64_t hi = -floor_div(-(t), col_b) - 1; // ceil(t / col_b) - 1
        lo = std::max<int64_t>(lo, 0);
        hi = std::min<int64_t>(hi, b.cols - 1);
        if (lo <= hi) return true;
    }
    return false;
}

// Why some write region overlaps another region (reads may share); empty
// when none does.
std::string conflict_error(std::vector<Region> regs) {
    regs.erase(std::remove_if(regs.begin(), regs.end(), [](const Region &r) { return r.bytes() == 0; }), regs.end());
    std::sort(regs.begin(), regs.end(),
              [](const Region &x, const Region &y) { return (uintptr_t)x.p < (uintptr_t)y.p; });
    for (size_t i = 0; i < regs.size(); i++) {
        const uintptr_t end = (uintptr_t)regs[i].p + regs[i].bytes();
        for (size_t j = i + 1; j < regs.size() && (uintptr_t)regs[j].p < end; j++) {
            if (!regs[i].write && !regs[j].write) continue;
            // Cheap first: the smaller column count drives the exact test.
            const bool hit = regs[i].cols <= regs[j].cols ? regions_overlap(regs[i], regs[j])
                                                          : regions_overlap(regs[j], regs[i]);
            if (hit)
                return describe(regs[i]) + " overlaps " + describe(regs[j]) +
                       " (the result of such a call is undefined)";
        }
    }
    return std::string();
}

// At call time: complains and returns false on an overlap.
bool check_no_conflicts(const char *fn, std::vector<Region> regs) {
    const std::string e = conflict_error(std::move(regs));
    if (e.empty()) return true;
    complain(fn, "%s", e.c_str());
    return false;
}

// ---- GEMM ----------------------------------------------------------------------

bool op_valid(cublasOperation_t op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C; }

// The documented cuBLAS GEMM argument checks (everything but the pointers).
bool gemm_args_ok(const char *fn, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, int lda, int ldb,
                  int ldc) {
    if (!op_valid(ta) || !op_valid(tb)) {
        complain(fn, "transa (%d) / transb (%d) is not CUBLAS_OP_N, _T or _C", (int)ta, (int)tb);
        return false;
    }
    if (m < 0 || n < 0 || k < 0) {
        complain(fn, "negative size m=%d n=%d k=%d", m, n, k);
        return false;
    }
    const int a_rows = ta == CUBLAS_OP_N ? m : k, b_rows = tb == CUBLAS_OP_N ? k : n;
    if (lda < std::max(1, a_rows)) {
        complain(fn, "lda=%d < max(1, %d) (A is %d x %d as stored, transa=%s)", lda, a_rows, a_rows,
                 ta == CUBLAS_OP_N ? k : m, op_name(ta));
        return false;
    }
    if (ldb < std::max(1, b_rows)) {
        complain(fn, "ldb=%d < max(1, %d) (B is %d x %d as stored, transb=%s)", ldb, b_rows, b_rows,
                 tb == CUBLAS_OP_N ? n : k, op_name(tb));
        return false;
    }
    if (ldc < std::max(1, m)) {
        complain(fn, "ldc=%d < max(1, m=%d)", ldc, m);
        return false;
    }
    return true;
}

struct GemmOperands {
    cublasOperation_t ta, tb;
    int m, n, k;
    const void *A;
    Elem ae;
    int lda;
    const void *B;
    Elem be;
    int ldb;
    void *C;
    Elem ce;
    int ldc;
};

// The regions a GEMM touches given the scalars (see the header comment).
void gemm_regions(const GemmOperands &g, bool reads_ab, bool touches_c, const std::string &suffix,
                  std::vector<Region> &out) {
    if (g.m == 0 || g.n == 0) return;
    if (reads_ab && g.k > 0) {
        const int64_t ar = g.ta == CUBLAS_OP_N ? g.m : g.k, ac = g.ta == CUBLAS_OP_N ? g.k : g.m;
        const int64_t br = g.tb == CUBLAS_OP_N ? g.k : g.n, bc = g.tb == CUBLAS_OP_N ? g.n : g.k;
        out.push_back({static_cast<const char *>(g.A), ar, ac, g.lda, elem_size(g.ae), false,
                       fmt("A%s [m=%d,k=%d,lda=%d,transa=%s: %" PRId64 " x %" PRId64 " stored]", suffix.c_str(), g.m,
                           g.k, g.lda, op_name(g.ta), ar, ac)});
        out.push_back({static_cast<const char *>(g.B), br, bc, g.ldb, elem_size(g.be), false,
                       fmt("B%s [k=%d,n=%d,ldb=%d,transb=%s: %" PRId64 " x %" PRId64 " stored]", suffix.c_str(), g.k,
                           g.n, g.ldb, op_name(g.tb), br, bc)});
    }
    if (touches_c)
        out.push_back({static_cast<const char *>(g.C), g.m, g.n, g.ldc, elem_size(g.ce), true,
                       fmt("C%s [m=%d,n=%d,ldc=%d]", suffix.c_str(), g.m, g.n, g.ldc)});
}

template <typename Acc> Acc dot(const Acc *a, const Acc *b, int k) {
    Acc s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int p = 0;
    for (; p + 8 <= k; p += 8)
        for (int l = 0; l < 8; l++) s[l] += a[p + l] * b[p + l];
    for (int l = 0; p < k; p++, l++) s[l] += a[p] * b[p];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// out[o * inner + q] = X(o, q) of op(X), where the stored X has op(X)(o, q)
// at q + o*ld (contiguous) or o + q*ld.
template <typename Acc>
void pack(std::vector<Acc> &out, Elem e, const void *x, int ld, int outer, int inner, bool contiguous) {
    out.resize((size_t)outer * (size_t)inner);
    for (int o = 0; o < outer; o++)
        for (int q = 0; q < inner; q++)
            out[(size_t)o * inner + q] = load<Acc>(e, x, contiguous ? (size_t)q + (size_t)o * ld
                                                                     : (size_t)o + (size_t)q * ld);
}

// C = alpha op(A) op(B) + beta C, arguments already validated.
template <typename Acc> void gemm_compute(const GemmOperands &g, Acc alpha, Acc beta) {
    const int m = g.m, n = g.n, k = g.k;
    if (m == 0 || n == 0) return;
    const bool no_product = alpha == (Acc)0 || k == 0;
    if (no_product && beta == (Acc)1) return;
    auto c_at = [&](int i, int j) { return (size_t)i + (size_t)j * g.ldc; };
    if (no_product) {
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++)
                store<Acc>(g.ce, g.C, c_at(i, j), beta == (Acc)0 ? (Acc)0 : beta * load<Acc>(g.ce, g.C, c_at(i, j)));
        return;
    }
    std::vector<Acc> ap, bp;
    pack(ap, g.ae, g.A, g.lda, m, k, g.ta != CUBLAS_OP_N); // ap[i*k + p] = op(A)(i, p)
    pack(bp, g.be, g.B, g.ldb, n, k, g.tb == CUBLAS_OP_N); // bp[j*k + p] = op(B)(p, j)
    for (int j = 0; j < n; j++) {
        const Acc *bj = bp.data() + (size_t)j * k;
        for (int i = 0; i < m; i++) {
            Acc v = alpha * dot(ap.data() + (size_t)i * k, bj, k);
            if (beta != (Acc)0) v += beta * load<Acc>(g.ce, g.C, c_at(i, j));
            store<Acc>(g.ce, g.C, c_at(i, j), v);
        }
    }
}

// The GEMMs of one call: one, or a strided batch (for the messages).
struct GemmBatch {
    std::vector<GemmOperands> ops;
    bool strided;
    long long sA, sB, sC;
};

// The regions entry i touches, named as the messages name them.
void batch_regions(const GemmBatch &b, size_t i, bool reads_ab, bool touches_c, std::vector<Region> &out) {
    const std::string suffix =
        b.strided ? fmt(" + %zu*stride (batch %zu of %zu, strides %lld/%lld/%lld)", i, i, b.ops.size(), b.sA, b.sB,
                        b.sC)
                  : std::string();
    gemm_regions(b.ops[i], reads_ab, touches_c, suffix, out);
}

template <typename Acc> void run_gemms(const char *fn, const GemmBatch &b, Acc alpha, Acc beta) {
    try {
        for (const GemmOperands &g : b.ops) gemm_compute<Acc>(g, alpha, beta);
    } catch (const std::bad_alloc &) {
        fault(fn, "out of host memory");
    }
}

// Library calls that enqueued work (cudaemu_library_calls).
std::atomic<uint64_t> library_calls{0};

// The GEMMs of a call whose handle, arguments and scalar pointers are
// checked: the rest of the call-time checks, then the work on the handle's
// stream. In CUBLAS_POINTER_MODE_HOST alpha / beta are read now, so every
// region is checked now; in _DEVICE they are read by the work, which then
// checks C (touched or not, as alpha / beta say) and the overlaps.
template <typename Acc>
cublasStatus_t gemm_submit(const char *fn, cublasHandle_t h, GemmBatch batch, const Acc *alpha, const Acc *beta) {
    const cudaStream_t stream = h->stream;
    const bool nothing = batch.ops.empty() || batch.ops[0].m == 0 || batch.ops[0].n == 0;
    if (h->pointer_mode == CUBLAS_POINTER_MODE_HOST) {
        const Acc a = *alpha, b = *beta;
        // A and B must be device memory whenever the product has them as
        // operands, even if alpha == 0 means they are not read this time.
        const bool touches_c = !nothing && !((a == (Acc)0 || batch.ops[0].k == 0) && b == (Acc)1);
        std::vector<Region> regs;
        for (size_t i = 0; i < batch.ops.size(); i++) {
            const size_t first = regs.size();
            batch_regions(batch, i, true, touches_c, regs);
            for (size_t r = first; r < regs.size(); r++)
                if (!check_region(fn, regs[r])) return CUBLAS_STATUS_INVALID_VALUE;
        }
        if (!check_no_conflicts(fn, regs)) return CUBLAS_STATUS_INVALID_VALUE;
        if (!touches_c) return CUBLAS_STATUS_SUCCESS;
        library_calls.fetch_add(1);
        cudaemu_enqueue(stream, [fn, batch = std::move(batch), a, b] { run_gemms<Acc>(fn, batch, a, b); }, fn);
        return CUBLAS_STATUS_SUCCESS;
    }
    {
        std::vector<Region> regs;
        for (size_t i = 0; i < batch.ops.size(); i++) {
            const size_t first = regs.size();
            batch_regions(batch, i, true, false, regs);
            for (size_t r = first; r < regs.size(); r++)
                if (!check_region(fn, regs[r])) return CUBLAS_STATUS_INVALID_VALUE;
        }
    }
    if (nothing) return CUBLAS_STATUS_SUCCESS;
    library_calls.fetch_add(1);
    cudaemu_enqueue(stream, [fn, batch = std::move(batch), alpha, beta] {
        const Acc a = *alpha, b = *beta;
        const bool touches_c = !((a == (Acc)0 || batch.ops[0].k == 0) && b == (Acc)1);
        if (!touches_c) return;
        std::vector<Region> regs;
        for (size_t i = 0; i < batch.ops.size(); i++) {
            const size_t first = regs.size();
            batch_regions(batch, i, true, true, regs);
            for (size_t r = first; r < regs.size(); r++) {
                const std::string e = region_error(regs[r]);
                if (!e.empty()) fault(fn, e);
            }
        }
        const std::string e = conflict_error(std::move(regs));
        if (!e.empty()) fault(fn, e);
        run_gemms<Acc>(fn, batch, a, b);
    }, fn);
    return CUBLAS_STATUS_SUCCESS;
}

// One (non-batched) GEMM. Acc is float or double, as are alpha and beta.
template <typename Acc>
cublasStatus_t gemm_one(const char *fn, cublasHandle_t h, const GemmOperands &g, const Acc *alpha, const Acc *beta) {
    if (!blas_handle_ok(fn, h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!gemm_args_ok(fn, g.ta, g.tb, g.m, g.n, g.k, g.lda, g.ldb, g.ldc)) return CUBLAS_STATUS_INVALID_VALUE;
    if (!check_scalar(fn, "alpha", alpha, sizeof(Acc), h->pointer_mode) ||
        !check_scalar(fn, "beta", beta, sizeof(Acc), h->pointer_mode))
        return CUBLAS_STATUS_INVALID_VALUE;
    GemmBatch batch = {{g}, false, 0, 0, 0};
    return gemm_submit<Acc>(fn, h, std::move(batch), alpha, beta);
}

// ---- triangular solve ----------------------------------------------------------

// op(A) X = alpha B (LEFT) or X op(A) = alpha B (RIGHT), X over B.
void trsm_compute(cublasSideMode_t side, cublasFillMode_t uplo, cublasOperation_t trans, cublasDiagType_t diag, int m,
                  int n, double alpha, const double *A, int lda, double *B, int ldb) {
    auto b = [&](int i, int j) -> double & { return B[(size_t)i + (size_t)j * ldb]; };
    if (alpha == 0.0) { // the reference BLAS: A is not read, B need not be set
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) b(i, j) = 0.0;
        return;
    }
    const bool tr = trans != CUBLAS_OP_N;
    // M = op(A); only A's uplo triangle is read.
    auto M = [&](int i, int j) { return tr ? A[(size_t)j + (size_t)i * lda] : A[(size_t)i + (size_t)j * lda]; };
    const bool unit = diag == CUBLAS_DIAG_UNIT;
    const bool m_lower = (uplo == CUBLAS_FILL_MODE_LOWER) != tr;
    if (side == CUBLAS_SIDE_LEFT) {
        for (int j = 0; j < n; j++) {
            if (m_lower) {
                for (int i = 0; i < m; i++) {
                    double s = alpha * b(i, j);
                    for (int p = 0; p < i; p++) s -= M(i, p) * b(p, j);
                    b(i, j) = unit ? s : s / M(i, i);
                }
            } else {
                for (int i = m - 1; i >= 0; i--) {
                    double s = alpha * b(i, j);
                    for (int p = i + 1; p < m; p++) s -= M(i, p) * b(p, j);
                    b(i, j) = unit ? s : s / M(i, i);
                }
            }
        }
    } else {
        // Row r of X: X(r, :) M = alpha B(r, :).
        for (int r = 0; r < m; r++) {
            if (!m_lower) { // M upper: forward over columns
                for (int j = 0; j < n; j++) {
                    double s = alpha * b(r, j);
                    for (int p = 0; p < j; p++) s -= b(r, p) * M(p, j);
                    b(r, j) = unit ? s : s / M(j, j);
                }
            } else {
                for (int j = n - 1; j >= 0; j--) {
                    double s = alpha * b(r, j);
                    for (int p = j + 1; p < n; p++) s -= b(r, p) * M(p, j);
                    b(r, j) = unit ? s : s / M(j, j);
                }
            }
        }
    }
}

// ---- Cholesky ------------------------------------------------------------------

// Returns 0, or the order (1-based) of the first leading minor that is not
// positive definite (the factorisation stops there, as LAPACK's dpotf2).
int potrf_compute(cublasFillMode_t uplo, int n, double *A, int lda) {
    auto a = [&](int i, int j) -> double & { return A[(size_t)i + (size_t)j * lda]; };
    const bool lower = uplo == CUBLAS_FILL_MODE_LOWER;
    // F(i, j), i >= j: L(i, j) (lower) or U(j, i) (upper).
    auto f = [&](int i, int j) -> double & { return lower ? a(i, j) : a(j, i); };
    int info = 0;
    for (int j = 0; j < n && !info; j++) {
        double d = f(j, j);
        for (int p = 0; p < j; p++) d -= f(j, p) * f(j, p);
        if (!(d > 0.0)) { // also NaN
            f(j, j) = d;
            info = j + 1;
            break;
        }
        d = std::sqrt(d);
        f(j, j) = d;
        for (int i = j + 1; i < n; i++) {
            double s = f(i, j);
            for (int p = 0; p < j; p++) s -= f(i, p) * f(j, p);
            f(i, j) = s / d;
        }
    }
    // The other strict triangle is cuSOLVER's workspace: destroyed.
    const double nan = std::numeric_limits<double>::quiet_NaN();
    for (int j = 0; j < n; j++)
        for (int i = 0; i < n; i++)
            if (lower ? i < j : i > j) a(i, j) = nan;
    return info;
}

} // namespace

// ---- cuBLAS API ----------------------------------------------------------------

extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t *handle) {
    if (!handle) {
        complain("cublasCreate", "handle pointer is NULL");
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    cublasContext *c = new (std::nothrow) cublasContext;
    if (!c) return CUBLAS_STATUS_ALLOC_FAILED;
    c->stream = nullptr;
    c->pointer_mode = CUBLAS_POINTER_MODE_HOST;
    c->math_mode = CUBLAS_DEFAULT_MATH;
    {
        std::lock_guard<std::mutex> lock(handle_mutex());
        live_handles().insert(c);
    }
    *handle = c;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
    if (!blas_handle_ok("cublasDestroy", handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    {
        std::lock_guard<std::mutex> lock(handle_mutex());
        live_handles().erase(handle);
    }
    delete handle;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t streamId) {
    if (!blas_handle_ok("cublasSetStream", handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->stream = streamId;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t handle, void *workspace, size_t workspaceSizeInBytes) {
    if (!blas_handle_ok("cublasSetWorkspace", handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (workspaceSizeInBytes && !cudaemu_is_device_range(workspace, workspaceSizeInBytes)) {
        complain("cublasSetWorkspace", "workspace %p (+%zu bytes) is not inside one device allocation", workspace,
                 workspaceSizeInBytes);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if ((uintptr_t)workspace % 256 != 0) {
        complain("cublasSetWorkspace", "workspace %p is not 256-byte aligned", workspace);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream_v2(cublasHandle_t handle, cudaStream_t *streamId) {
    if (!blas_handle_ok("cublasGetStream", handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!streamId) {
        complain("cublasGetStream", "streamId is NULL");
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    *streamId = handle->stream;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t *mode) {
    if (!blas_handle_ok("cublasGetPointerMode", handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!mode) {
        complain("cublasGetPointerMode", "mode is NULL");
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    *mode = handle->pointer_mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t handle, cublasPointerMode_t mode) {
    if (!blas_handle_ok("cublasSetPointerMode", handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (mode != CUBLAS_POINTER_MODE_HOST && mode != CUBLAS_POINTER_MODE_DEVICE) {
        complain("cublasSetPointerMode", "mode %d is not CUBLAS_POINTER_MODE_HOST or _DEVICE", (int)mode);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    handle->pointer_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t *mode) {
    if (!blas_handle_ok("cublasGetMathMode", handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!mode) {
        complain("cublasGetMathMode", "mode is NULL");
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    *mode = handle->math_mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
    if (!blas_handle_ok("cublasSetMathMode", handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    const int base = (int)mode & ~(int)CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
    if (base != CUBLAS_DEFAULT_MATH && base != CUBLAS_TENSOR_OP_MATH && base != CUBLAS_PEDANTIC_MATH &&
        base != CUBLAS_TF32_TENSOR_OP_MATH && base != CUBLAS_FP32_EMULATED_BF16X9_MATH &&
        base != CUBLAS_FP64_EMULATED_FIXEDPOINT_MATH) {
        complain("cublasSetMathMode", "mode %d is not a cublasMath_t value", (int)mode);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    handle->math_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}

const char *cublasGetStatusName(cublasStatus_t status) {
    switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    }
    return "CUBLAS_STATUS_UNKNOWN";
}

const char *cublasGetStatusString(cublasStatus_t status) {
    switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "an absent device architectural feature is required";
    case CUBLAS_STATUS_MAPPING_ERROR: return "an access to GPU memory space failed";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
    case CUBLAS_STATUS_LICENSE_ERROR: return "error detected trying to check the license";
    }
    return "unknown error";
}

cublasStatus_t cublasSgemm_v2(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                              int k, const float *alpha, const float *A, int lda, const float *B, int ldb,
                              const float *beta, float *C, int ldc) {
    const GemmOperands g = {transa, transb, m, n, k, A, Elem::F32, lda, B, Elem::F32, ldb, C, Elem::F32, ldc};
    return gemm_one<float>("cublasSgemm", handle, g, alpha, beta);
}

cublasStatus_t cublasDgemm_v2(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                              int k, const double *alpha, const double *A, int lda, const double *B, int ldb,
                              const double *beta, double *C, int ldc) {
    const GemmOperands g = {transa, transb, m, n, k, A, Elem::F64, lda, B, Elem::F64, ldb, C, Elem::F64, ldc};
    return gemm_one<double>("cublasDgemm", handle, g, alpha, beta);
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void *alpha, const void *A, cudaDataType Atype, int lda, const void *B,
                            cudaDataType Btype, int ldb, const void *beta, void *C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
    const char *fn = "cublasGemmEx";
    if (!blas_handle_ok(fn, handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    const int al = (int)algo;
    if (!(al == CUBLAS_GEMM_DEFAULT || (al >= CUBLAS_GEMM_ALGO0 && al <= CUBLAS_GEMM_ALGO23) ||
          (al >= CUBLAS_GEMM_DEFAULT_TENSOR_OP && al <= CUBLAS_GEMM_ALGO15_TENSOR_OP) || al == CUBLAS_GEMM_AUTOTUNE)) {
        complain(fn, "algo %d is not a cublasGemmAlgo_t value", al);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    switch (computeType) {
    case CUBLAS_COMPUTE_16F:
    case CUBLAS_COMPUTE_16F_PEDANTIC:
    case CUBLAS_COMPUTE_32F:
    case CUBLAS_COMPUTE_32F_PEDANTIC:
    case CUBLAS_COMPUTE_32F_FAST_16F:
    case CUBLAS_COMPUTE_32F_FAST_16BF:
    case CUBLAS_COMPUTE_32F_FAST_TF32:
    case CUBLAS_COMPUTE_32F_EMULATED_16BFX9:
    case CUBLAS_COMPUTE_64F:
    case CUBLAS_COMPUTE_64F_PEDANTIC:
    case CUBLAS_COMPUTE_64F_EMULATED_FIXEDPOINT:
    case CUBLAS_COMPUTE_32I:
    case CUBLAS_COMPUTE_32I_PEDANTIC: break;
    default:
        complain(fn, "computeType %d is not a cublasComputeType_t value", (int)computeType);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    auto elem_of = [](cudaDataType t, Elem *e) {
        switch (t) {
        case CUDA_R_16F: *e = Elem::F16; return true;
        case CUDA_R_16BF: *e = Elem::BF16; return true;
        case CUDA_R_32F: *e = Elem::F32; return true;
        default: return false;
        }
    };
    Elem ae = Elem::F32, be = Elem::F32, ce = Elem::F32;
    const bool emulated_types = elem_of(Atype, &ae) && elem_of(Btype, &be) && elem_of(Ctype, &ce);
    const bool c32 = computeType == CUBLAS_COMPUTE_32F || computeType == CUBLAS_COMPUTE_32F_PEDANTIC;
    const bool fast = computeType == CUBLAS_COMPUTE_32F_FAST_TF32;
    // cuBLAS's table for compute type 32F (scale type float): A = B in
    // {16F, 16BF} with C the same or 32F; A = B = C = 32F. The _FAST_ compute
    // types take only A = B = C = 32F.
    bool ok = false;
    if (emulated_types && Atype == Btype) {
        if (c32)
            ok = (Atype == CUDA_R_32F && Ctype == CUDA_R_32F) ||
                 ((Atype == CUDA_R_16F || Atype == CUDA_R_16BF) && (Ctype == Atype || Ctype == CUDA_R_32F));
        else if (fast)
            ok = Atype == CUDA_R_32F && Ctype == CUDA_R_32F;
    }
    if (!ok) {
        const bool all32 = Atype == CUDA_R_32F && Btype == CUDA_R_32F && Ctype == CUDA_R_32F;
        const bool f32_family = c32 || fast || computeType == CUBLAS_COMPUTE_32F_FAST_16F ||
                                computeType == CUBLAS_COMPUTE_32F_FAST_16BF ||
                                computeType == CUBLAS_COMPUTE_32F_EMULATED_16BFX9;
        const char *why = "not emulated here (and maybe not supported by cuBLAS)";
        if (all32 && f32_family)
            why = "supported by cuBLAS but not emulated here";
        else if (emulated_types && f32_family)
            why = "cuBLAS does not support this combination";
        complain(fn,
                 "Atype=%d Btype=%d Ctype=%d computeType=%d: %s (emulated: A = B in {16F, 16BF} with C = A or 32F, "
                 "or A = B = C = 32F, under compute type 32F or 32F_PEDANTIC; A = B = C = 32F under 32F_FAST_TF32)",
                 (int)Atype, (int)Btype, (int)Ctype, (int)computeType, why);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    const GemmOperands g = {transa, transb, m, n, k, A, ae, lda, B, be, ldb, C, ce, ldc};
    // gemm_one checks the handle again, then the arguments and pointers;
    // alpha / beta are float for every supported combination.
    return gemm_one<float>(fn, handle, g, static_cast<const float *>(alpha), static_cast<const float *>(beta));
}

cublasStatus_t cublasDgemmStridedBatched(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb,
                                         int m, int n, int k, const double *alpha, const double *A, int lda,
                                         long long int strideA, const double *B, int ldb, long long int strideB,
                                         const double *beta, double *C, int ldc, long long int strideC,
                                         int batchCount) {
    const char *fn = "cublasDgemmStridedBatched";
    if (!blas_handle_ok(fn, handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!gemm_args_ok(fn, transa, transb, m, n, k, lda, ldb, ldc)) return CUBLAS_STATUS_INVALID_VALUE;
    if (batchCount < 0) {
        complain(fn, "batchCount=%d < 0", batchCount);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (!check_scalar(fn, "alpha", alpha, sizeof(double), handle->pointer_mode) ||
        !check_scalar(fn, "beta", beta, sizeof(double), handle->pointer_mode))
        return CUBLAS_STATUS_INVALID_VALUE;
    GemmBatch batch = {std::vector<GemmOperands>((size_t)batchCount), true, strideA, strideB, strideC};
    for (int i = 0; i < batchCount; i++) {
        // Pointer arithmetic on the integers: an out-of-range batch must be
        // reported, not formed as a pointer.
        const uintptr_t pa = (uintptr_t)A + (uintptr_t)((long long)i * strideA * (long long)sizeof(double));
        const uintptr_t pb = (uintptr_t)B + (uintptr_t)((long long)i * strideB * (long long)sizeof(double));
        const uintptr_t pc = (uintptr_t)C + (uintptr_t)((long long)i * strideC * (long long)sizeof(double));
        batch.ops[(size_t)i] = {transa, transb, m,        n,   k, (const void *)pa, Elem::F64, lda, (const void *)pb,
                                Elem::F64, ldb, (void *)pc, Elem::F64, ldc};
    }
    return gemm_submit<double>(fn, handle, std::move(batch), alpha, beta);
}

cublasStatus_t cublasDtrsmBatched(cublasHandle_t handle, cublasSideMode_t side, cublasFillMode_t uplo,
                                  cublasOperation_t trans, cublasDiagType_t diag, int m, int n, const double *alpha,
                                  const double *const A[], int lda, double *const B[], int ldb, int batchCount) {
    const char *fn = "cublasDtrsmBatched";
    if (!blas_handle_ok(fn, handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (side != CUBLAS_SIDE_LEFT && side != CUBLAS_SIDE_RIGHT) {
        complain(fn, "side %d is not CUBLAS_SIDE_LEFT or _RIGHT", (int)side);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (uplo != CUBLAS_FILL_MODE_LOWER && uplo != CUBLAS_FILL_MODE_UPPER) {
        complain(fn, "uplo %d is not CUBLAS_FILL_MODE_LOWER or _UPPER", (int)uplo);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (!op_valid(trans)) {
        complain(fn, "trans %d is not CUBLAS_OP_N, _T or _C", (int)trans);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (diag != CUBLAS_DIAG_NON_UNIT && diag != CUBLAS_DIAG_UNIT) {
        complain(fn, "diag %d is not CUBLAS_DIAG_NON_UNIT or _UNIT", (int)diag);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (m < 0 || n < 0 || batchCount < 0) {
        complain(fn, "negative size m=%d n=%d batchCount=%d", m, n, batchCount);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    const int ka = side == CUBLAS_SIDE_LEFT ? m : n;
    if (lda < std::max(1, ka)) {
        complain(fn, "lda=%d < max(1, %d) (A is %d x %d, side=%s)", lda, ka, ka, ka,
                 side == CUBLAS_SIDE_LEFT ? "LEFT" : "RIGHT");
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (ldb < std::max(1, m)) {
        complain(fn, "ldb=%d < max(1, m=%d)", ldb, m);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (!check_scalar(fn, "alpha", alpha, sizeof(double), handle->pointer_mode)) return CUBLAS_STATUS_INVALID_VALUE;
    if (m == 0 || n == 0 || batchCount == 0) return CUBLAS_STATUS_SUCCESS;
    if (!check_pointer_array(fn, "A", A, batchCount) || !check_pointer_array(fn, "B", B, batchCount))
        return CUBLAS_STATUS_INVALID_VALUE;
    // The pointer arrays' contents are device memory (typically written by
    // work enqueued just before): only the work reads them.
    const bool dev_alpha = handle->pointer_mode == CUBLAS_POINTER_MODE_DEVICE;
    const double host_alpha = dev_alpha ? 0.0 : *alpha;
    library_calls.fetch_add(1);
    cudaemu_enqueue(handle->stream, [=] {
        const double a = dev_alpha ? *alpha : host_alpha;
        std::vector<const double *> pa((size_t)batchCount);
        std::vector<double *> pb((size_t)batchCount);
        std::vector<Region> regs;
        regs.reserve(2 * (size_t)batchCount + 2);
        regs.push_back({reinterpret_cast<const char *>(A), batchCount, 1, batchCount, sizeof(void *), false,
                        fmt("pointer array A [%d pointers]", batchCount)});
        regs.push_back({reinterpret_cast<const char *>(B), batchCount, 1, batchCount, sizeof(void *), false,
                        fmt("pointer array B [%d pointers]", batchCount)});
        for (int i = 0; i < batchCount; i++) {
            pa[(size_t)i] = A[i];
            pb[(size_t)i] = B[i];
            const Region ra = {reinterpret_cast<const char *>(pa[(size_t)i]), ka, ka, lda, sizeof(double), false,
                               fmt("A[%d] [%d x %d, lda=%d]", i, ka, ka, lda)};
            const Region rb = {reinterpret_cast<const char *>(pb[(size_t)i]), m, n, ldb, sizeof(double), true,
                               fmt("B[%d] [m=%d,n=%d,ldb=%d]", i, m, n, ldb)};
            std::string e = region_error(ra);
            if (e.empty()) e = region_error(rb);
            if (!e.empty()) fault(fn, e);
            regs.push_back(ra);
            regs.push_back(rb);
        }
        const std::string e = conflict_error(std::move(regs));
        if (!e.empty()) fault(fn, e);
        for (int i = 0; i < batchCount; i++)
            trsm_compute(side, uplo, trans, diag, m, n, a, pa[(size_t)i], lda, pb[(size_t)i], ldb);
    });
    return CUBLAS_STATUS_SUCCESS;
}

// ---- cuSOLVER API --------------------------------------------------------------

cusolverStatus_t cusolverDnCreate(cusolverDnHandle_t *handle) {
    if (!handle) {
        complain("cusolverDnCreate", "handle pointer is NULL");
        return CUSOLVER_STATUS_INVALID_VALUE;
    }
    cusolverDnContext *c = new (std::nothrow) cusolverDnContext;
    if (!c) return CUSOLVER_STATUS_ALLOC_FAILED;
    c->stream = nullptr;
    {
        std::lock_guard<std::mutex> lock(handle_mutex());
        live_handles().insert(c);
    }
    *handle = c;
    return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnDestroy(cusolverDnHandle_t handle) {
    if (!solver_handle_ok("cusolverDnDestroy", handle)) return CUSOLVER_STATUS_NOT_INITIALIZED;
    {
        std::lock_guard<std::mutex> lock(handle_mutex());
        live_handles().erase(handle);
    }
    delete handle;
    return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnSetStream(cusolverDnHandle_t handle, cudaStream_t streamId) {
    if (!solver_handle_ok("cusolverDnSetStream", handle)) return CUSOLVER_STATUS_NOT_INITIALIZED;
    handle->stream = streamId;
    return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnGetStream(cusolverDnHandle_t handle, cudaStream_t *streamId) {
    if (!solver_handle_ok("cusolverDnGetStream", handle)) return CUSOLVER_STATUS_NOT_INITIALIZED;
    if (!streamId) {
        complain("cusolverDnGetStream", "streamId is NULL");
        return CUSOLVER_STATUS_INVALID_VALUE;
    }
    *streamId = handle->stream;
    return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnDpotrfBatched(cusolverDnHandle_t handle, cublasFillMode_t uplo, int n, double *Aarray[],
                                         int lda, int *infoArray, int batchSize) {
    const char *fn = "cusolverDnDpotrfBatched";
    if (!solver_handle_ok(fn, handle)) return CUSOLVER_STATUS_NOT_INITIALIZED;
    const cudaStream_t stream = handle->stream;
    // The documented failure: infoArray[0] = -i for the i-th parameter (not
    // counting the handle), when infoArray can take it; written in stream
    // order, as the library's own write would be.
    auto invalid = [&](int param) {
        if (infoArray && (uintptr_t)infoArray % alignof(int) == 0 && cudaemu_is_device_range(infoArray, sizeof(int)))
            cudaemu_enqueue(stream, [infoArray, param] { infoArray[0] = -param; });
        return CUSOLVER_STATUS_INVALID_VALUE;
    };
    if (uplo != CUBLAS_FILL_MODE_LOWER && uplo != CUBLAS_FILL_MODE_UPPER) {
        complain(fn, "uplo %d is not CUBLAS_FILL_MODE_LOWER or _UPPER", (int)uplo);
        return invalid(1);
    }
    if (n < 0) {
        complain(fn, "n=%d < 0", n);
        return invalid(2);
    }
    if (lda < std::max(1, n)) {
        complain(fn, "lda=%d < max(1, n=%d)", lda, n);
        return invalid(4);
    }
    // cuSOLVER documents batchSize < 1 as invalid.
    if (batchSize < 1) {
        complain(fn, "batchSize=%d < 1", batchSize);
        return invalid(6);
    }
    if (!check_pointer_array(fn, "Aarray", Aarray, batchSize)) return invalid(3);
    const Region rinfo = {reinterpret_cast<const char *>(infoArray), batchSize, 1, batchSize, sizeof(int), true,
                          fmt("infoArray [%d ints]", batchSize)};
    if (!infoArray) {
        complain(fn, "infoArray is NULL");
        return CUSOLVER_STATUS_INVALID_VALUE;
    }
    if (!check_region(fn, rinfo)) return CUSOLVER_STATUS_INVALID_VALUE;
    const Region rarr = {reinterpret_cast<const char *>(Aarray), batchSize, 1, batchSize, sizeof(void *), false,
                         fmt("pointer array Aarray [%d pointers]", batchSize)};
    if (!check_no_conflicts(fn, {rinfo, rarr})) return CUSOLVER_STATUS_INVALID_VALUE;
    // Aarray's contents are device memory (typically written by work
    // enqueued just before): only the work reads them.
    library_calls.fetch_add(1);
    cudaemu_enqueue(stream, [=] {
        std::vector<double *> pa((size_t)batchSize);
        std::vector<Region> regs;
        regs.reserve((size_t)batchSize + 2);
        regs.push_back(rinfo);
        regs.push_back(rarr);
        for (int i = 0; i < batchSize; i++) {
            pa[(size_t)i] = Aarray[i];
            if (n > 0 && !pa[(size_t)i]) fault(fn, fmt("Aarray[%d] is NULL", i));
            const Region ra = {reinterpret_cast<const char *>(pa[(size_t)i]), n, n, lda, sizeof(double), true,
                               fmt("Aarray[%d] [n=%d,lda=%d]", i, n, lda)};
            const std::string e = region_error(ra);
            if (!e.empty()) fault(fn, e);
            regs.push_back(ra);
        }
        const std::string e = conflict_error(std::move(regs));
        if (!e.empty()) fault(fn, e);
        for (int i = 0; i < batchSize; i++) infoArray[i] = potrf_compute(uplo, n, pa[(size_t)i], lda);
    });
    return CUSOLVER_STATUS_SUCCESS;
}

} // extern "C"

// cuBLAS/cuSOLVER calls of this process that enqueued work: tests compare
// the CUDA backend's launch counter with this plus cudaemu_kernel_launches.
extern "C" uint64_t cudaemu_library_calls(void) { return library_calls.load(); }
