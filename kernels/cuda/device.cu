// CUDA device probe and a cuBLAS self-test. The real kernels land with the
// CUDA backend; this file proves the toolkit, driver and cuBLAS link and run.
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

extern "C" int pd_cuda_device_info_get(int index, pd_cuda_device_info *out, pd_error *err) {
    cudaDeviceProp prop;
    cudaError_t e = cudaGetDeviceProperties(&prop, index);
    if (e != cudaSuccess)
        return pd_errorf(err, PD_ENOTFOUND, "CUDA device %d: %s", index, cudaGetErrorString(e));
    memset(out, 0, sizeof *out);
    out->index = index;
    snprintf(out->name, sizeof out->name, "%s", prop.name);
    out->cc_major = prop.major;
    out->cc_minor = prop.minor;
    out->total_mem = prop.totalGlobalMem;
    return PD_OK;
}

#define CUDA_TRY(call, what)                                                                   \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            rc = pd_errorf(err, PD_EIO, "CUDA %s failed: %s", what, cudaGetErrorString(e_));   \
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
