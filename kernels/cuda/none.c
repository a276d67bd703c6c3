/* Built when the CUDA backend is not compiled in: the probe reports no devices. */
#include "kernels/kernels.h"

bool pd_cuda_compiled(void) { return false; }

int pd_cuda_device_count(void) { return 0; }

int pd_cuda_device_info_get(int index, pd_cuda_device_info *out, pd_error *err) {
    (void)index;
    (void)out;
    return pd_errorf(err, PD_EUNSUPPORTED, "this build has no CUDA backend (rebuild with -Dcuda=enabled)");
}

int pd_cuda_selftest(int index, double *max_abs_err, pd_error *err) {
    (void)index;
    (void)max_abs_err;
    return pd_errorf(err, PD_EUNSUPPORTED, "this build has no CUDA backend (rebuild with -Dcuda=enabled)");
}
