// CUDA device probe, a cuBLAS self-test and a copy-bandwidth measurement:
// what `prefixctl` and the benchmarks report about a GPU. The backend itself
// is in backend.cu and the kernel files.
#include "kernels/kernels.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" bool pd_cuda_compiled(void) { return true; }

extern "C" int pd_cuda_device_count(void) {
    int n = 0;
    // No driver or no device both mean "nothing to run on": report zero.
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

static int cuda_probe_fail(pd_error *err, cudaError_t e, int index, const char *what) {
    (void)cudaGetLastError();
    return pd_errorf(err, PD_EIO, "CUDA device %d: cannot read the %s: %s", index, what, cudaGetErrorString(e));
}

extern "C" int pd_cuda_device_info_get(int index, pd_cuda_device_info *out, pd_error *err) {
    cudaDeviceProp prop;
    cudaError_t e = cudaGetDeviceProperties(&prop, index);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return pd_errorf(err, PD_ENOTFOUND, "CUDA device %d: %s", index, cudaGetErrorString(e));
    }
    memset(out, 0, sizeof *out);
    out->index = index;
    snprintf(out->name, sizeof out->name, "%s", prop.name);
    out->cc_major = prop.major;
    out->cc_minor = prop.minor;
    out->total_mem = prop.totalGlobalMem;
    // CUDA 13 dropped memoryClockRate from cudaDeviceProp; the attributes
    // exist in every version we support.
    int v = 0;
    e = cudaDeviceGetAttribute(&v, cudaDevAttrMemoryClockRate, index);
    if (e != cudaSuccess) return cuda_probe_fail(err, e, index, "memory clock rate");
    out->mem_clock_khz = v;
    e = cudaDeviceGetAttribute(&v, cudaDevAttrGlobalMemoryBusWidth, index);
    if (e != cudaSuccess) return cuda_probe_fail(err, e, index, "memory bus width");
    out->mem_bus_width_bits = v;
    e = cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, index);
    if (e != cudaSuccess) return cuda_probe_fail(err, e, index, "multiprocessor count");
    out->sm_count = v;
    return PD_OK;
}

#define CUDA_TRY(call, what)                                                                   \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            rc = pd_errorf(err, e_ == cudaErrorMemoryAllocation ? PD_ENOMEM : PD_EIO,          \
                           "CUDA %s failed: %s", what, cudaGetErrorString(e_));                \
            goto done;                                                                         \
        }                                                                                      \
    } while (0)

extern "C" int pd_cuda_selftest(int index, double *max_abs_err, pd_error *err) {
    enum { M = 64, N = 48, K = 80 };
    int rc = PD_OK;
    float *a = NULL, *b = NULL, *c = NULL, *ref = NULL;
    float *da = NULL, *db = NULL, *dc = NULL;
    cublasHandle_t handle = NULL;
    const float alpha = 1.0f, beta = 0.0f;
    double worst = 0.0;

    a = (float *)malloc(sizeof(float) * M * K);
    b = (float *)malloc(sizeof(float) * K * N);
    c = (float *)malloc(sizeof(float) * M * N);
    ref = (float *)malloc(sizeof(float) * M * N);
    if (!a || !b || !c || !ref) {
        rc = pd_errorf(err, PD_ENOMEM, "out of host memory for the CUDA self-test");
        goto done;
    }
    for (int i = 0; i < M * K; i++) a[i] = (float)((i * 37 % 101) - 50) / 50.0f;
    for (int i = 0; i < K * N; i++) b[i] = (float)((i * 53 % 97) - 48) / 48.0f;
    // Column-major reference: C[m + n*M] = sum_k A[m + k*M] * B[k + n*K]
    for (int n = 0; n < N; n++)
        for (int m = 0; m < M; m++) {
            double s = 0;
            for (int k = 0; k < K; k++) s += (double)a[m + k * M] * b[k + n * K];
            ref[m + n * M] = (float)s;
        }

    CUDA_TRY(cudaSetDevice(index), "cudaSetDevice");
    CUDA_TRY(cudaMalloc((void **)&da, sizeof(float) * M * K), "cudaMalloc");
    CUDA_TRY(cudaMalloc((void **)&db, sizeof(float) * K * N), "cudaMalloc");
    CUDA_TRY(cudaMalloc((void **)&dc, sizeof(float) * M * N), "cudaMalloc");
    CUDA_TRY(cudaMemcpy(da, a, sizeof(float) * M * K, cudaMemcpyHostToDevice), "copy to device");
    CUDA_TRY(cudaMemcpy(db, b, sizeof(float) * K * N, cudaMemcpyHostToDevice), "copy to device");
    if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
        rc = pd_errorf(err, PD_EIO, "cublasCreate failed");
        goto done;
    }
    if (cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, M, N, K, &alpha, da, M, db, K, &beta, dc, M) !=
        CUBLAS_STATUS_SUCCESS) {
        rc = pd_errorf(err, PD_EIO, "cublasSgemm failed");
        goto done;
    }
    CUDA_TRY(cudaMemcpy(c, dc, sizeof(float) * M * N, cudaMemcpyDeviceToHost), "copy to host");
    for (int i = 0; i < M * N; i++) {
        double d = fabs((double)c[i] - ref[i]);
        if (d > worst) worst = d;
    }
    if (max_abs_err) *max_abs_err = worst;

done:
    if (handle) cublasDestroy(handle);
    cudaFree(da);
    cudaFree(db);
    cudaFree(dc);
    free(a);
    free(b);
    free(c);
    free(ref);
    return rc;
}

// Device-to-device copy bandwidth. One copy of `bytes` reads `bytes` and
// writes `bytes`, and *bytes_per_s counts both (2 * bytes per copy), which
// is the figure comparable with the memory's peak bandwidth (2 * clock *
// bus width / 8) and with a GEMV that streams weights.
extern "C" int pd_cuda_copy_bandwidth(int index, size_t bytes, double *bytes_per_s, pd_error *err) {
    enum { WARMUP = 2, REPS = 10 };
    int rc = PD_OK;
    void *a = NULL, *b = NULL;
    cudaStream_t stream = NULL;
    cudaEvent_t start = NULL, stop = NULL;
    float ms = 0.0f;
    int count = 0;

    if (!bytes_per_s) return pd_errorf(err, PD_EINVAL, "copy bandwidth: NULL result");
    *bytes_per_s = 0.0;
    if (bytes == 0) return pd_errorf(err, PD_EINVAL, "copy bandwidth: copy size must be above zero");
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        (void)cudaGetLastError();
        count = 0;
    }
    if (index < 0 || index >= count)
        return pd_errorf(err, PD_ENOTFOUND, "CUDA device %d does not exist: this machine has %d CUDA device%s", index,
                         count, count == 1 ? "" : "s");

    CUDA_TRY(cudaSetDevice(index), "cudaSetDevice");
    CUDA_TRY(cudaMalloc(&a, bytes), "cudaMalloc (copy source)");
    CUDA_TRY(cudaMalloc(&b, bytes), "cudaMalloc (copy destination)");
    CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    CUDA_TRY(cudaEventCreate(&start), "cudaEventCreate");
    CUDA_TRY(cudaEventCreate(&stop), "cudaEventCreate");
    CUDA_TRY(cudaMemsetAsync(a, 0x5a, bytes, stream), "cudaMemsetAsync");
    for (int i = 0; i < WARMUP; i++) CUDA_TRY(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream), "copy");
    CUDA_TRY(cudaEventRecord(start, stream), "cudaEventRecord");
    for (int i = 0; i < REPS; i++) CUDA_TRY(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream), "copy");
    CUDA_TRY(cudaEventRecord(stop, stream), "cudaEventRecord");
    CUDA_TRY(cudaEventSynchronize(stop), "cudaEventSynchronize");
    CUDA_TRY(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    if (!(ms > 0.0f)) {
        rc = pd_errorf(err, PD_EIO, "copy bandwidth: the timed copies took no measurable time; use a larger size");
        goto done;
    }
    *bytes_per_s = 2.0 * (double)bytes * REPS / ((double)ms * 1e-3);

done:
    if (rc) (void)cudaGetLastError();
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
    cudaFree(a);
    cudaFree(b);
    return rc;
}
