/* Device selection: parse "cpu" / "cuda[:N]" / "auto" and create the backend it names.
 *
 * config/config.c parses the same strings for model.device (config may not
 * depend on kernels/); keep the accepted forms and the error text of the two
 * in step. */
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "kernels/kernels.h"

#define DEVICE_INDEX_MAX 255
#define DEVICE_FORMS "cpu, cuda, cuda:N (N = 0..255) or auto"

/* Decimal digits only (no sign, spaces or hex), at most 3 of them, value
 * within 0..DEVICE_INDEX_MAX. */
static bool parse_index(const char *s, int *out) {
    size_t len = strlen(s);
    if (len == 0 || len > 3 || strspn(s, "0123456789") != len) return false;
    int v = 0;
    for (size_t i = 0; i < len; i++) v = v * 10 + (s[i] - '0');
    if (v > DEVICE_INDEX_MAX) return false;
    *out = v;
    return true;
}

int pd_device_parse(const char *text, pd_device *out, pd_error *err) {
    if (!text) return pd_errorf(err, PD_EINVAL, "device: no text; use " DEVICE_FORMS);
    pd_device d = {.kind = PD_DEVICE_CPU, .index = 0};
    bool ok = true;
    if (strcasecmp(text, "cpu") == 0) d.kind = PD_DEVICE_CPU;
    else if (strcasecmp(text, "auto") == 0) d.kind = PD_DEVICE_AUTO;
    else if (strcasecmp(text, "cuda") == 0) d.kind = PD_DEVICE_CUDA;
    else if (strncasecmp(text, "cuda:", 5) == 0) {
        d.kind = PD_DEVICE_CUDA;
        ok = parse_index(text + 5, &d.index);
    } else ok = false;
    if (!ok) {
        /* Echo at most 32 printable bytes of what the user wrote. */
        char shown[40];
        size_t n = 0;
        for (size_t i = 0; text[i] && n < 32; i++) {
            unsigned char ch = (unsigned char)text[i];
            shown[n++] = (ch >= 0x20 && ch < 0x7f) ? (char)ch : '?';
        }
        shown[n] = '\0';
        return pd_errorf(err, PD_EINVAL, "device '%s%s' is not one of " DEVICE_FORMS, shown,
                         text[n] ? "..." : "");
    }
    *out = d;
    return PD_OK;
}

void pd_device_format(const pd_device *d, char *buf, size_t cap) {
    if (!buf || cap == 0) return;
    switch (d->kind) {
    case PD_DEVICE_CPU: snprintf(buf, cap, "cpu"); return;
    case PD_DEVICE_AUTO: snprintf(buf, cap, "auto"); return;
    case PD_DEVICE_CUDA: snprintf(buf, cap, "cuda:%d", d->index); return;
    }
    snprintf(buf, cap, "unknown(%d)", (int)d->kind);
}

/* Why cuda:index cannot be used here, as a status with err filled, or PD_OK
 * when the build has CUDA and the device exists. */
static int cuda_unavailable(int index, pd_error *err) {
    if (!pd_cuda_compiled())
        return pd_errorf(err, PD_EUNSUPPORTED,
                         "model.device = cuda:%d: this build has no CUDA backend (rebuild with the "
                         "CUDA Toolkit installed), or use model.device = cpu",
                         index);
    int count = pd_cuda_device_count();
    if (count <= 0)
        return pd_errorf(err, PD_ENOTFOUND,
                         "no CUDA device %d: found none (driver missing or no GPU); use "
                         "model.device = cpu or auto",
                         index);
    if (index >= count) {
        char range[32];
        if (count == 1) snprintf(range, sizeof range, "cuda:0");
        else snprintf(range, sizeof range, "cuda:0 to cuda:%d", count - 1);
        return pd_errorf(err, PD_ENOTFOUND,
                         "no CUDA device %d: found %d (%s); use model.device = one of those, cpu "
                         "or auto",
                         index, count, range);
    }
    return PD_OK;
}

int pd_backend_create(const pd_device *d, int n_threads, pd_backend **out, pd_error *err) {
    *out = NULL;
    if (d->index < 0 || d->index > DEVICE_INDEX_MAX)
        return pd_errorf(err, PD_EINVAL, "device index %d is out of range (0..%d)", d->index,
                         DEVICE_INDEX_MAX);
    switch (d->kind) {
    case PD_DEVICE_CPU: return pd_backend_cpu_create(n_threads, out, err);
    case PD_DEVICE_CUDA: {
        int rc = cuda_unavailable(d->index, err);
        return rc ? rc : pd_backend_cuda_create(d->index, out, err);
    }
    case PD_DEVICE_AUTO:
        /* A device that exists but fails to start is an error, not a
         * silent fallback: the operator should hear about a broken GPU. */
        if (cuda_unavailable(d->index, NULL) == PD_OK) {
            int rc = pd_backend_cuda_create(d->index, out, err);
            if (rc)
                pd_error_prefix(err, "model.device = auto found CUDA device %d but could not use it "
                                "(model.device = cpu runs without it)",
                                d->index);
            return rc;
        }
        return pd_backend_cpu_create(n_threads, out, err);
    }
    return pd_errorf(err, PD_EINVAL, "device kind %d is not cpu, cuda or auto", (int)d->kind);
}
