/* Built when the CUDA backend is not compiled in: the probe reports no
 * devices and everything that needs a GPU fails with PD_EUNSUPPORTED. */
#include "kernels/kernels.h"

#define NO_CUDA "this build has no CUDA backend (rebuild with -Dcuda=enabled and the CUDA Toolkit installed)"

bool pd_cuda_compiled(void) { return false; }

int pd_cuda_device_count(void) { return 0; }

int pd_cuda_device_info_get(int index, pd_cuda_device_info *out, pd_error *err) {
    (void)index;
    (void)out;
    return pd_errorf(err, PD_EUNSUPPORTED, NO_CUDA);
}

int pd_cuda_selftest(int index, double *max_abs_err, pd_error *err) {
    (void)index;
    (void)max_abs_err;
    return pd_errorf(err, PD_EUNSUPPORTED, NO_CUDA);
}

int pd_cuda_copy_bandwidth(int index, size_t bytes, double *bytes_per_s, pd_error *err) {
    (void)index;
    (void)bytes;
    if (bytes_per_s) *bytes_per_s = 0.0;
    return pd_errorf(err, PD_EUNSUPPORTED, NO_CUDA);
}

uint64_t pd_cuda_weight_bytes(pd_type t, int64_t rows, int64_t cols) {
    (void)t;
    (void)rows;
    (void)cols;
    return 0;
}

int pd_backend_cuda_create(int index, pd_backend **out, pd_error *err) {
    (void)index;
    if (out) *out = NULL;
    return pd_errorf(err, PD_EUNSUPPORTED, NO_CUDA);
}
