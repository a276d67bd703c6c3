// pd_backend_timer's device marks on the CUDA backend: a pair of timing
// events recorded on the backend's stream, so the elapsed time is what the
// GPU took for the work between them (launch gaps included), not the
// host's view of it.
#include "kernels/cuda/cuda_internal.h"

#include <stdlib.h>

typedef struct cuda_marks {
    cudaEvent_t ev[2]; // start, stop
} cuda_marks;

static void cuda_timer_destroy(pd_backend *be, void *marks) {
    cuda_marks *mk = (cuda_marks *)marks;
    if (!mk) return;
    pd_error ignored = {}; // nothing to report to: the timer is going
    if (cuda_enter(cuda_impl(be), &ignored) == PD_OK)
        for (int i = 0; i < 2; i++)
            if (mk->ev[i]) (void)cudaEventDestroy(mk->ev[i]);
    free(mk);
}

static void *cuda_timer_create(pd_backend *be, pd_error *err) {
    cuda_marks *mk = (cuda_marks *)calloc(1, sizeof *mk);
    if (!mk) {
        pd_errorf(err, PD_ENOMEM, "out of host memory for timing events");
        return NULL;
    }
    int rc = cuda_enter(cuda_impl(be), err);
    for (int i = 0; !rc && i < 2; i++) {
        const cudaError_t e = cudaEventCreateWithFlags(&mk->ev[i], cudaEventDefault);
        if (e != cudaSuccess) {
            mk->ev[i] = NULL;
            rc = cuda_fail(err, e, "cudaEventCreate (timing event)");
        }
    }
    if (rc) {
        cuda_timer_destroy(be, mk);
        return NULL;
    }
    return mk;
}

static int cuda_timer_record(pd_backend *be, void *marks, int which, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    int rc = cuda_enter(cb, err);
    if (rc) return rc;
    const cudaError_t e = cudaEventRecord(((cuda_marks *)marks)->ev[which ? 1 : 0], cb->stream);
    return e == cudaSuccess ? PD_OK : cuda_fail(err, e, "cudaEventRecord (timing event)");
}

static int cuda_timer_elapsed(pd_backend *be, void *marks, double *seconds, pd_error *err) {
    cuda_marks *mk = (cuda_marks *)marks;
    int rc = cuda_enter(cuda_impl(be), err);
    if (rc) return rc;
    cudaError_t e = cudaEventSynchronize(mk->ev[1]);
    if (e != cudaSuccess) return cuda_fail(err, e, "cudaEventSynchronize (timing event)");
    float ms = 0;
    e = cudaEventElapsedTime(&ms, mk->ev[0], mk->ev[1]);
    if (e != cudaSuccess) return cuda_fail(err, e, "cudaEventElapsedTime");
    *seconds = (double)ms / 1e3;
    return PD_OK;
}

extern "C" const pd_backend_timer_ops cuda_timer_ops = {
    cuda_timer_create,
    cuda_timer_destroy,
    cuda_timer_record,
    cuda_timer_elapsed,
};
