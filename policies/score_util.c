/* Helpers every scorer may use (scratch allocation, pooling): their own file
 * so that the scorer files do not use each other. */
#include <inttypes.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "policies/scorers.h"

/* n values of `size` bytes, or NULL with a message naming the scorer. */
void *pd_scorer_alloc(int64_t n, size_t size, const char *name, pd_error *err) {
    uint64_t bytes;
    void *p = NULL;
    if (n >= 0 && pd_mul_ok((uint64_t)n, size, &bytes) && bytes <= SIZE_MAX) p = malloc(bytes ? (size_t)bytes : 1);
    if (!p) pd_errorf(err, PD_ENOMEM, "%s: out of memory for %" PRId64 " scratch values", name, n);
    return p;
}

/* Window [i - w/2, i - w/2 + w - 1] (centred for odd w), outside values
 * count as zeros; in and out must not overlap. */
void pd_avg_pool(const float *in, int64_t n, int w, float *out) {
    if (n <= 0) return;
    if (w <= 1) {
        memcpy(out, in, (size_t)n * sizeof *out);
        return;
    }
    int64_t left = w / 2, right = (int64_t)w - 1 - left;
    double sum = 0;
    for (int64_t j = 0; j <= right && j < n; j++) sum += in[j];
    for (int64_t i = 0; i < n; i++) {
        out[i] = (float)(sum / w);
        if (i + right + 1 < n) sum += in[i + right + 1];
        if (i - left >= 0) sum -= in[i - left];
    }
}

/* The same window, outside values ignored (torch pads max_pool1d with
 * -inf). O(n * w): pools are a few tokens wide. */
void pd_max_pool(const float *in, int64_t n, int w, float *out) {
    if (n <= 0) return;
    int64_t left = w > 1 ? w / 2 : 0, right = w > 1 ? (int64_t)w - 1 - left : 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t a = i - left < 0 ? 0 : i - left, b = i + right >= n ? n - 1 : i + right;
        float m = in[a];
        for (int64_t j = a + 1; j <= b; j++)
            if (in[j] > m) m = in[j];
        out[i] = m;
    }
}
