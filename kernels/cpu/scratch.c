/* Scratch buffers of the CPU kernels (activations, per-thread work): they
 * only grow, 64-byte aligned. Its own file so that the kernels and the
 * backend that calls them both use it without using each other. */
#include <stdlib.h>

#include "kernels/cpu/cpu_internal.h"

int cpu_scratch_reserve(void **buf, size_t *cap, size_t bytes, pd_error *err) {
    if (bytes <= *cap && *buf) return PD_OK;
    size_t want = bytes + bytes / 4 + 4096; /* grow with headroom */
    want = (want + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, want);
    if (!p) return pd_errorf(err, PD_ENOMEM, "cpu backend: cannot allocate %zu bytes of scratch", want);
    free(*buf);
    *buf = p;
    *cap = want;
    return PD_OK;
}
