#include "util.h"

#include <stdio.h>
#include <string.h>

int pd_verrorf(pd_error *err, int code, const char *fmt, va_list ap) {
    if (err) {
        err->code = code;
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    }
    return code;
}

int pd_errorf(pd_error *err, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    pd_verrorf(err, code, fmt, ap);
    va_end(ap);
    return code;
}

int pd_error_prefix(pd_error *err, const char *fmt, ...) {
    if (!err) return PD_OK;
    char prefix[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(prefix, sizeof prefix - 2, fmt, ap);
    va_end(ap);
    if (n < 0) return err->code;
    size_t plen = strlen(prefix);
    memcpy(prefix + plen, ": ", 3);
    plen += 2;
    /* Shift the old message right, keeping it NUL-terminated when it no longer fits. */
    size_t old_len = strnlen(err->msg, sizeof err->msg - 1);
    if (plen + old_len >= sizeof err->msg) old_len = sizeof err->msg - 1 - plen;
    memmove(err->msg + plen, err->msg, old_len);
    err->msg[plen + old_len] = '\0';
    memcpy(err->msg, prefix, plen);
    return err->code;
}

const char *pd_status_name(int code) {
    switch (code) {
    case PD_OK: return "ok";
    case PD_EINVAL: return "invalid argument";
    case PD_EIO: return "i/o error";
    case PD_ENOMEM: return "out of memory";
    case PD_EFORMAT: return "malformed data";
    case PD_ENOTFOUND: return "not found";
    case PD_EUNSUPPORTED: return "unsupported";
    case PD_ERANGE: return "out of range";
    case PD_EDEVICE: return "device failed";
    default: return "unknown error";
    }
}

void pd_strbuf_printf(pd_strbuf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *dst = b->len < b->cap ? b->buf + b->len : NULL;
    size_t room = b->len < b->cap ? b->cap - b->len : 0;
    int n = vsnprintf(dst, room, fmt, ap);
    va_end(ap);
    if (n > 0) b->len += (size_t)n;
}
