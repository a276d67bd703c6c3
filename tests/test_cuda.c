/* CUDA backend probe: runs a cuBLAS SGEMM on every device, or skips cleanly
 * where there is no GPU (CI, developer laptops). */
#include <criterion/criterion.h>
#include <string.h>

#include "kernels/kernels.h"

Test(cuda, selftest_on_every_device) {
    int n = pd_cuda_device_count();
    if (n == 0)
        cr_skip_test("no CUDA device (compiled in: %s); skipping GPU test", pd_cuda_compiled() ? "yes" : "no");
    for (int i = 0; i < n; i++) {
        pd_cuda_device_info info;
        pd_error err = {0};
        cr_assert_eq(pd_cuda_device_info_get(i, &info, &err), PD_OK, "%s", err.msg);
        cr_assert(info.name[0] != '\0');
        cr_assert_gt(info.total_mem, 0);
        double max_err = 1e9;
        cr_assert_eq(pd_cuda_selftest(i, &max_err, &err), PD_OK, "device %d: %s", i, err.msg);
        cr_assert_lt(max_err, 1e-3, "device %d: cuBLAS SGEMM differs from the CPU by %g", i, max_err);
    }
}

Test(cuda, absent_device_is_an_error_not_a_crash) {
    pd_cuda_device_info info;
    pd_error err = {0};
    int n = pd_cuda_device_count();
    int rc = pd_cuda_device_info_get(n + 7, &info, &err);
    cr_assert_neq(rc, PD_OK);
    cr_assert(strlen(err.msg) > 0);
}
