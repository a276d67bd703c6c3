/* GGUF v3 writer: metadata and tensors are collected in memory (or, for lazy
 * tensors, a fill callback), then written in one pass to a temporary file
 * that is fsync'd and renamed over the destination.
 *
 * Layout written (all little-endian):
 *   "GGUF" u32 version=3  u64 n_tensors  u64 n_kv
 *   n_kv x { u64 key_len, key bytes, u32 vtype, value }
 *   n_tensors x { u64 name_len, name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset }
 *   zero padding to `alignment`
 *   tensor data, each tensor starting at a multiple of `alignment`
 * Values: strings are u64 len + bytes; arrays are u32 elem_type + u64 n + elements. */
#include "engine/engine.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_WRITE_VERSION 3u
#define MAX_KEY_LEN 65535u
#define MAX_ALIGNMENT (1u << 24)

/* A growable byte buffer holding serialized value bytes. */
typedef struct wbuf {
    uint8_t *data;
    size_t len, cap;
    bool oom;
} wbuf;

static void wb_put(wbuf *b, const void *p, size_t n) {
    if (b->oom || n == 0) return;
    if (b->len + n < b->len) {
        b->oom = true;
        return;
    }
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->len + n) {
            if (cap > SIZE_MAX / 2) {
                b->oom = true;
                return;
            }
            cap *= 2;
        }
        uint8_t *d = realloc(b->data, cap);
        if (!d) {
            b->oom = true;
            return;
        }
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
}

static void wb_u32(wbuf *b, uint32_t v) {
    uint8_t p[4];
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
    wb_put(b, p, 4);
}

static void wb_u64(wbuf *b, uint64_t v) {
    uint8_t p[8];
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
    wb_put(b, p, 8);
}

static void wb_str(wbuf *b, const char *s, uint64_t len) {
    wb_u64(b, len);
    if (len > SIZE_MAX) {
        b->oom = true;
        return;
    }
    wb_put(b, s, (size_t)len);
}

typedef struct wkv {
    char *key;
    pd_gguf_vtype type;
    uint8_t *val; /* serialized value (after the type field) */
    size_t val_len;
} wkv;

typedef struct wtensor {
    char *name;
    pd_type type;
    uint32_t n_dims;
    uint64_t ne[PD_GGUF_MAX_DIMS];
    uint64_t n_bytes;
    uint8_t *data; /* owned copy, or NULL for lazy tensors */
    pd_gguf_fill_fn fill;
    void *ctx;
} wtensor;

struct pd_gguf_writer {
    wkv *kvs;
    size_t n_kv, cap_kv;
    wtensor *tensors;
    size_t n_tensors, cap_tensors;
};

int pd_gguf_writer_new(pd_gguf_writer **out, pd_error *err) {
    if (!out) return pd_errorf(err, PD_EINVAL, "gguf writer: NULL output pointer");
    *out = calloc(1, sizeof **out);
    if (!*out) return pd_errorf(err, PD_ENOMEM, "gguf writer: out of memory");
    return PD_OK;
}

void pd_gguf_writer_free(pd_gguf_writer *w) {
    if (!w) return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kvs[i].key);
        free(w->kvs[i].val);
    }
    free(w->kvs);
    for (size_t i = 0; i < w->n_tensors; i++) {
        free(w->tensors[i].name);
        free(w->tensors[i].data);
    }
    free(w->tensors);
    free(w);
}

static const wkv *find_kv(const pd_gguf_writer *w, const char *key) {
    for (size_t i = 0; i < w->n_kv; i++)
        if (strcmp(w->kvs[i].key, key) == 0) return &w->kvs[i];
    return NULL;
}

static int check_key(const pd_gguf_writer *w, const char *key, pd_error *err) {
    if (!w) return pd_errorf(err, PD_EINVAL, "gguf writer: NULL writer");
    if (!key || !*key) return pd_errorf(err, PD_EINVAL, "gguf writer: metadata key is empty");
    if (strlen(key) > MAX_KEY_LEN)
        return pd_errorf(err, PD_EINVAL, "gguf writer: metadata key '%.64s...' is longer than %u bytes",
                         key, MAX_KEY_LEN);
    if (find_kv(w, key))
        return pd_errorf(err, PD_EINVAL, "gguf writer: duplicate metadata key '%s'", key);
    return PD_OK;
}

/* Take ownership of the serialized value in b and append the KV. */
static int add_kv(pd_gguf_writer *w, const char *key, pd_gguf_vtype type, wbuf *b, pd_error *err) {
    int rc = check_key(w, key, err);
    if (rc) {
        free(b->data);
        return rc;
    }
    if (b->oom) {
        free(b->data);
        return pd_errorf(err, PD_ENOMEM, "gguf writer: out of memory storing key '%s'", key);
    }
    if (w->n_kv == w->cap_kv) {
        size_t cap = w->cap_kv ? w->cap_kv * 2 : 16;
        wkv *k = realloc(w->kvs, cap * sizeof *k);
        if (!k) {
            free(b->data);
            return pd_errorf(err, PD_ENOMEM, "gguf writer: out of memory storing key '%s'", key);
        }
        w->kvs = k;
        w->cap_kv = cap;
    }
    char *kc = strdup(key);
    if (!kc) {
        free(b->data);
        return pd_errorf(err, PD_ENOMEM, "gguf writer: out of memory storing key '%s'", key);
    }
    w->kvs[w->n_kv++] = (wkv){.key = kc, .type = type, .val = b->data, .val_len = b->len};
    b->data = NULL;
    return PD_OK;
}

int pd_gguf_writer_set_u32(pd_gguf_writer *w, const char *key, uint32_t v, pd_error *err) {
    wbuf b = {0};
    wb_u32(&b, v);
    return add_kv(w, key, PD_GGUF_UINT32, &b, err);
}

int pd_gguf_writer_set_i32(pd_gguf_writer *w, const char *key, int32_t v, pd_error *err) {
    wbuf b = {0};
    wb_u32(&b, (uint32_t)v);
    return add_kv(w, key, PD_GGUF_INT32, &b, err);
}

int pd_gguf_writer_set_u64(pd_gguf_writer *w, const char *key, uint64_t v, pd_error *err) {
    wbuf b = {0};
    wb_u64(&b, v);
    return add_kv(w, key, PD_GGUF_UINT64, &b, err);
}

int pd_gguf_writer_set_f32(pd_gguf_writer *w, const char *key, float v, pd_error *err) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    wbuf b = {0};
    wb_u32(&b, u);
    return add_kv(w, key, PD_GGUF_FLOAT32, &b, err);
}

int pd_gguf_writer_set_bool(pd_gguf_writer *w, const char *key, bool v, pd_error *err) {
    wbuf b = {0};
    const uint8_t c = v ? 1 : 0;
    wb_put(&b, &c, 1);
    return add_kv(w, key, PD_GGUF_BOOL, &b, err);
}

int pd_gguf_writer_set_str(pd_gguf_writer *w, const char *key, const char *v, pd_error *err) {
    if (!v) return pd_errorf(err, PD_EINVAL, "gguf writer: NULL string value for key '%s'", key ? key : "");
    wbuf b = {0};
    wb_str(&b, v, strlen(v));
    return add_kv(w, key, PD_GGUF_STRING, &b, err);
}

/* Size in bytes of one fixed-size element, 0 for STRING/ARRAY/unknown. */
static size_t vtype_size(pd_gguf_vtype t) {
    switch (t) {
    case PD_GGUF_UINT8:
    case PD_GGUF_INT8:
    case PD_GGUF_BOOL: return 1;
    case PD_GGUF_UINT16:
    case PD_GGUF_INT16: return 2;
    case PD_GGUF_UINT32:
    case PD_GGUF_INT32:
    case PD_GGUF_FLOAT32: return 4;
    case PD_GGUF_UINT64:
    case PD_GGUF_INT64:
    case PD_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

int pd_gguf_writer_set_arr(pd_gguf_writer *w, const char *key, pd_gguf_vtype elem_type,
                           const void *data, uint64_t n, pd_error *err) {
    const size_t es = vtype_size(elem_type);
    if (!es)
        return pd_errorf(err, PD_EINVAL,
                         "gguf writer: key '%s': array element type %d is not a fixed-size type "
                         "(use pd_gguf_writer_set_arr_str for strings)",
                         key ? key : "", (int)elem_type);
    uint64_t bytes;
    if (!pd_mul_ok(n, es, &bytes) || bytes > SIZE_MAX)
        return pd_errorf(err, PD_ERANGE, "gguf writer: key '%s': array of %llu elements is too large",
                         key ? key : "", (unsigned long long)n);
    if (n && !data) return pd_errorf(err, PD_EINVAL, "gguf writer: key '%s': NULL array data", key ? key : "");
    wbuf b = {0};
    wb_u32(&b, (uint32_t)elem_type);
    wb_u64(&b, n);
    /* Host order is little-endian on every platform we build for; GGUF is LE. */
    wb_put(&b, data, (size_t)bytes);
    return add_kv(w, key, PD_GGUF_ARRAY, &b, err);
}

int pd_gguf_writer_set_arr_str(pd_gguf_writer *w, const char *key, const pd_str *strs,
                               uint64_t n, pd_error *err) {
    if (n && !strs) return pd_errorf(err, PD_EINVAL, "gguf writer: key '%s': NULL string array", key ? key : "");
    wbuf b = {0};
    wb_u32(&b, PD_GGUF_STRING);
    wb_u64(&b, n);
    for (uint64_t i = 0; i < n && !b.oom; i++) {
        if (strs[i].len && !strs[i].ptr) {
            free(b.data);
            return pd_errorf(err, PD_EINVAL, "gguf writer: key '%s': string %llu has NULL data",
                             key ? key : "", (unsigned long long)i);
        }
        wb_str(&b, strs[i].ptr, strs[i].len);
    }
    return add_kv(w, key, PD_GGUF_ARRAY, &b, err);
}

/* Serialize a reader value (without its type tag) into b. */
static int ser_value(wbuf *b, const pd_gguf_value *v, int depth, const char *key, pd_error *err) {
    switch (v->type) {
    case PD_GGUF_UINT8:
    case PD_GGUF_BOOL: {
        const uint8_t c = (uint8_t)v->u;
        wb_put(b, &c, 1);
        return PD_OK;
    }
    case PD_GGUF_INT8: {
        const uint8_t c = (uint8_t)v->i;
        wb_put(b, &c, 1);
        return PD_OK;
    }
    case PD_GGUF_UINT16:
    case PD_GGUF_INT16: {
        const uint16_t x = v->type == PD_GGUF_UINT16 ? (uint16_t)v->u : (uint16_t)v->i;
        const uint8_t p[2] = {(uint8_t)(x & 0xffu), (uint8_t)(x >> 8)};
        wb_put(b, p, 2);
        return PD_OK;
    }
    case PD_GGUF_UINT32: wb_u32(b, (uint32_t)v->u); return PD_OK;
    case PD_GGUF_INT32: wb_u32(b, (uint32_t)v->i); return PD_OK;
    case PD_GGUF_UINT64: wb_u64(b, v->u); return PD_OK;
    case PD_GGUF_INT64: wb_u64(b, (uint64_t)v->i); return PD_OK;
    case PD_GGUF_FLOAT32: {
        const float f = (float)v->f;
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        wb_u32(b, u);
        return PD_OK;
    }
    case PD_GGUF_FLOAT64: {
        uint64_t u;
        memcpy(&u, &v->f, sizeof u);
        wb_u64(b, u);
        return PD_OK;
    }
    case PD_GGUF_STRING:
        if (v->str.len && !v->str.ptr)
            return pd_errorf(err, PD_EINVAL, "gguf writer: key '%s': string value has NULL data", key);
        wb_str(b, v->str.ptr, v->str.len);
        return PD_OK;
    case PD_GGUF_ARRAY: {
        if (depth >= PD_GGUF_MAX_ARRAY_DEPTH)
            return pd_errorf(err, PD_EINVAL, "gguf writer: key '%s': arrays nested deeper than %d",
                             key, PD_GGUF_MAX_ARRAY_DEPTH);
        const pd_gguf_vtype et = v->arr.elem_type;
        const uint64_t n = v->arr.n;
        wb_u32(b, (uint32_t)et);
        wb_u64(b, n);
        if (et == PD_GGUF_STRING) {
            if (n && !v->arr.strs)
                return pd_errorf(err, PD_EINVAL, "gguf writer: key '%s': string array without strings", key);
            for (uint64_t i = 0; i < n && !b->oom; i++) {
                if (v->arr.strs[i].len && !v->arr.strs[i].ptr)
                    return pd_errorf(err, PD_EINVAL, "gguf writer: key '%s': string %llu has NULL data",
                                     key, (unsigned long long)i);
                wb_str(b, v->arr.strs[i].ptr, v->arr.strs[i].len);
            }
            return PD_OK;
        }
        if (et == PD_GGUF_ARRAY) {
            if (n && !v->arr.items)
                return pd_errorf(err, PD_EINVAL, "gguf writer: key '%s': nested array without items", key);
            for (uint64_t i = 0; i < n && !b->oom; i++) {
                if (v->arr.items[i].type != PD_GGUF_ARRAY)
                    return pd_errorf(err, PD_EINVAL,
                                     "gguf writer: key '%s': item %llu of an array of arrays has type %d",
                                     key, (unsigned long long)i, (int)v->arr.items[i].type);
                int rc = ser_value(b, &v->arr.items[i], depth + 1, key, err);
                if (rc) return rc;
            }
            return PD_OK;
        }
        const size_t es = vtype_size(et);
        if (!es)
            return pd_errorf(err, PD_EINVAL, "gguf writer: key '%s': unknown array element type %d",
                             key, (int)et);
        uint64_t bytes;
        if (!pd_mul_ok(n, es, &bytes) || bytes > SIZE_MAX)
            return pd_errorf(err, PD_ERANGE, "gguf writer: key '%s': array too large", key);
        if (n && !v->arr.data)
            return pd_errorf(err, PD_EINVAL, "gguf writer: key '%s': array without data", key);
        wb_put(b, v->arr.data, (size_t)bytes);
        return PD_OK;
    }
    default:
        return pd_errorf(err, PD_EINVAL, "gguf writer: key '%s': unknown value type %d", key, (int)v->type);
    }
}

int pd_gguf_writer_copy_kv(pd_gguf_writer *w, const pd_gguf_kv *kv, pd_error *err) {
    if (!kv || !kv->key) return pd_errorf(err, PD_EINVAL, "gguf writer: NULL key/value to copy");
    int rc = check_key(w, kv->key, err);
    if (rc) return rc;
    wbuf b = {0};
    rc = ser_value(&b, &kv->value, 0, kv->key, err);
    if (rc) {
        free(b.data);
        return rc;
    }
    return add_kv(w, kv->key, kv->value.type, &b, err);
}

/* ------------------------------------------------------------------------
 * tensors
 * ------------------------------------------------------------------------ */

static int new_tensor(pd_gguf_writer *w, const char *name, pd_type type, uint32_t n_dims,
                      const uint64_t *ne, wtensor **out, pd_error *err) {
    if (!w) return pd_errorf(err, PD_EINVAL, "gguf writer: NULL writer");
    if (!name || !*name) return pd_errorf(err, PD_EINVAL, "gguf writer: tensor name is empty");
    if (strlen(name) > MAX_KEY_LEN)
        return pd_errorf(err, PD_EINVAL, "gguf writer: tensor name '%.64s...' is too long", name);
    for (size_t i = 0; i < w->n_tensors; i++)
        if (strcmp(w->tensors[i].name, name) == 0)
            return pd_errorf(err, PD_EINVAL, "gguf writer: duplicate tensor name '%s'", name);
    const pd_type_traits *tr = pd_type_get((uint32_t)type);
    if (!tr) return pd_errorf(err, PD_EINVAL, "gguf writer: tensor '%s': unknown type id %u", name, (unsigned)type);
    if (n_dims < 1 || n_dims > PD_GGUF_MAX_DIMS)
        return pd_errorf(err, PD_EINVAL, "gguf writer: tensor '%s': n_dims %u is outside 1..%d", name,
                         n_dims, PD_GGUF_MAX_DIMS);
    if (!ne) return pd_errorf(err, PD_EINVAL, "gguf writer: tensor '%s': NULL shape", name);
    uint64_t n_elems = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        if (ne[d] == 0)
            return pd_errorf(err, PD_EINVAL, "gguf writer: tensor '%s': dimension %u is zero", name, d);
        if (ne[d] > INT64_MAX || !pd_mul_ok(n_elems, ne[d], &n_elems) || n_elems > INT64_MAX)
            return pd_errorf(err, PD_ERANGE, "gguf writer: tensor '%s': element count overflows", name);
    }
    if (ne[0] % tr->block_size != 0)
        return pd_errorf(err, PD_EINVAL,
                         "gguf writer: tensor '%s': ne[0]=%llu is not a multiple of the %s block size %u "
                         "(rows must hold whole blocks; pick another type for this tensor)",
                         name, (unsigned long long)ne[0], tr->name, tr->block_size);
    uint64_t n_bytes;
    int rc = pd_type_row_size(type, n_elems, &n_bytes, err);
    if (rc) {
        pd_error_prefix(err, "gguf writer: tensor '%s'", name);
        return rc;
    }
    if (w->n_tensors == w->cap_tensors) {
        size_t cap = w->cap_tensors ? w->cap_tensors * 2 : 16;
        wtensor *t = realloc(w->tensors, cap * sizeof *t);
        if (!t) return pd_errorf(err, PD_ENOMEM, "gguf writer: out of memory adding tensor '%s'", name);
        w->tensors = t;
        w->cap_tensors = cap;
    }
    char *nc = strdup(name);
    if (!nc) return pd_errorf(err, PD_ENOMEM, "gguf writer: out of memory adding tensor '%s'", name);
    wtensor *t = &w->tensors[w->n_tensors];
    memset(t, 0, sizeof *t);
    t->name = nc;
    t->type = type;
    t->n_dims = n_dims;
    for (uint32_t d = 0; d < PD_GGUF_MAX_DIMS; d++) t->ne[d] = d < n_dims ? ne[d] : 1;
    t->n_bytes = n_bytes;
    *out = t;
    return PD_OK;
}

int pd_gguf_writer_add_tensor(pd_gguf_writer *w, const char *name, pd_type type,
                              uint32_t n_dims, const uint64_t *ne, const void *data,
                              pd_error *err) {
    wtensor *t;
    int rc = new_tensor(w, name, type, n_dims, ne, &t, err);
    if (rc) return rc;
    if (t->n_bytes > SIZE_MAX) {
        free(t->name);
        return pd_errorf(err, PD_ERANGE, "gguf writer: tensor '%s' is too large to hold in memory", name);
    }
    if (!data) {
        free(t->name);
        return pd_errorf(err, PD_EINVAL, "gguf writer: tensor '%s': NULL data", name);
    }
    t->data = malloc((size_t)t->n_bytes);
    if (!t->data) {
        free(t->name);
        return pd_errorf(err, PD_ENOMEM, "gguf writer: out of memory copying tensor '%s' (%llu bytes)",
                         name, (unsigned long long)t->n_bytes);
    }
    memcpy(t->data, data, (size_t)t->n_bytes);
    w->n_tensors++;
    return PD_OK;
}

int pd_gguf_writer_add_tensor_lazy(pd_gguf_writer *w, const char *name, pd_type type,
                                   uint32_t n_dims, const uint64_t *ne, pd_gguf_fill_fn fill,
                                   void *ctx, pd_error *err) {
    if (!fill) return pd_errorf(err, PD_EINVAL, "gguf writer: tensor '%s': NULL fill callback", name ? name : "");
    wtensor *t;
    int rc = new_tensor(w, name, type, n_dims, ne, &t, err);
    if (rc) return rc;
    if (t->n_bytes > SIZE_MAX) {
        free(t->name);
        return pd_errorf(err, PD_ERANGE, "gguf writer: tensor '%s' is too large for this platform", name);
    }
    t->fill = fill;
    t->ctx = ctx;
    w->n_tensors++;
    return PD_OK;
}

/* ------------------------------------------------------------------------
 * writing
 * ------------------------------------------------------------------------ */

static uint64_t align_up(uint64_t x, uint64_t a) {
    return (x + a - 1) / a * a;
}

typedef struct out_file {
    FILE *f;
    const char *tmp;
    uint64_t pos;
} out_file;

static int out_write(out_file *o, const void *p, size_t n, pd_error *err) {
    if (n && fwrite(p, 1, n, o->f) != n)
        return pd_errorf(err, PD_EIO, "writing %s: %s", o->tmp, strerror(errno));
    o->pos += n;
    return PD_OK;
}

static int out_zeros(out_file *o, uint64_t n, pd_error *err) {
    static const uint8_t zeros[256];
    while (n) {
        const size_t k = n < sizeof zeros ? (size_t)n : sizeof zeros;
        int rc = out_write(o, zeros, k, err);
        if (rc) return rc;
        n -= k;
    }
    return PD_OK;
}

/* Resolve the effective alignment and whether general.alignment must be added. */
static int resolve_alignment(const pd_gguf_writer *w, uint32_t requested, uint32_t *out,
                             bool *add_key, pd_error *err) {
    const wkv *ak = find_kv(w, "general.alignment");
    uint32_t stored = 0;
    if (ak) {
        if (ak->type != PD_GGUF_UINT32 || ak->val_len != 4)
            return pd_errorf(err, PD_EINVAL, "gguf writer: general.alignment must be a u32");
        stored = (uint32_t)ak->val[0] | ((uint32_t)ak->val[1] << 8) | ((uint32_t)ak->val[2] << 16) |
                 ((uint32_t)ak->val[3] << 24);
    }
    uint32_t a = requested ? requested : (ak ? stored : PD_GGUF_DEFAULT_ALIGNMENT);
    if (a == 0 || (a & (a - 1)) != 0 || a > MAX_ALIGNMENT)
        return pd_errorf(err, PD_EINVAL, "gguf writer: alignment %u is not a power of two in 1..%u", a,
                         MAX_ALIGNMENT);
    if (ak && stored != a)
        return pd_errorf(err, PD_EINVAL,
                         "gguf writer: general.alignment is %u but the file is being written with "
                         "alignment %u; drop the key or pass the same alignment",
                         stored, a);
    *out = a;
    *add_key = !ak && a != PD_GGUF_DEFAULT_ALIGNMENT;
    return PD_OK;
}

static void fsync_parent_dir(const char *path) {
    char *copy = strdup(path);
    if (!copy) return;
    int dfd = open(dirname(copy), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        (void)fsync(dfd);
        close(dfd);
    }
    free(copy);
}

static int write_body(const pd_gguf_writer *w, out_file *o, uint32_t alignment, bool add_align_key,
                      pd_error *err) {
    /* Header, metadata and tensor infos are assembled in memory. */
    wbuf h = {0};
    const uint8_t magic[4] = {'G', 'G', 'U', 'F'};
    wb_put(&h, magic, 4);
    wb_u32(&h, GGUF_WRITE_VERSION);
    wb_u64(&h, (uint64_t)w->n_tensors);
    wb_u64(&h, (uint64_t)w->n_kv + (add_align_key ? 1 : 0));
    for (size_t i = 0; i < w->n_kv; i++) {
        const wkv *kv = &w->kvs[i];
        wb_str(&h, kv->key, strlen(kv->key));
        wb_u32(&h, (uint32_t)kv->type);
        wb_put(&h, kv->val, kv->val_len);
    }
    if (add_align_key) {
        static const char k[] = "general.alignment";
        wb_str(&h, k, sizeof k - 1);
        wb_u32(&h, PD_GGUF_UINT32);
        wb_u32(&h, alignment);
    }
    uint64_t offset = 0;
    uint64_t max_bytes = 0;
    for (size_t i = 0; i < w->n_tensors; i++) {
        const wtensor *t = &w->tensors[i];
        wb_str(&h, t->name, strlen(t->name));
        wb_u32(&h, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++) wb_u64(&h, t->ne[d]);
        wb_u32(&h, (uint32_t)t->type);
        wb_u64(&h, offset);
        uint64_t end;
        if (!pd_add_ok(offset, t->n_bytes, &end) || end > UINT64_MAX - alignment) {
            free(h.data);
            return pd_errorf(err, PD_ERANGE, "gguf writer: total tensor data overflows 64 bits");
        }
        offset = align_up(end, alignment);
        if (t->fill && t->n_bytes > max_bytes) max_bytes = t->n_bytes;
    }
    if (h.oom) {
        free(h.data);
        return pd_errorf(err, PD_ENOMEM, "gguf writer: out of memory assembling the header");
    }
    int rc = out_write(o, h.data, h.len, err);
    free(h.data);
    if (rc) return rc;
    /* Pad to the data section; like llama.cpp's writers, a file without
     * tensors ends right after its metadata. */
    if (w->n_tensors) rc = out_zeros(o, align_up(o->pos, alignment) - o->pos, err);
    if (rc) return rc;

    /* One scratch buffer, as large as the largest lazy tensor, is reused. */
    uint8_t *scratch = NULL;
    if (max_bytes) {
        scratch = malloc((size_t)max_bytes);
        if (!scratch)
            return pd_errorf(err, PD_ENOMEM, "gguf writer: out of memory (%llu bytes) for tensor data",
                             (unsigned long long)max_bytes);
    }
    const uint64_t data_start = o->pos;
    for (size_t i = 0; i < w->n_tensors && !rc; i++) {
        const wtensor *t = &w->tensors[i];
        const uint8_t *src = t->data;
        if (t->fill) {
            rc = t->fill(t->ctx, t->name, scratch, t->n_bytes, err);
            if (rc) {
                pd_error_prefix(err, "gguf writer: filling tensor '%s'", t->name);
                break;
            }
            src = scratch;
        }
        rc = out_write(o, src, (size_t)t->n_bytes, err);
        if (!rc) rc = out_zeros(o, align_up(o->pos - data_start, alignment) - (o->pos - data_start), err);
    }
    free(scratch);
    return rc;
}

int pd_gguf_writer_write(pd_gguf_writer *w, const char *path, uint32_t alignment, pd_error *err) {
    if (!w) return pd_errorf(err, PD_EINVAL, "gguf writer: NULL writer");
    if (!path || !*path) return pd_errorf(err, PD_EINVAL, "gguf writer: empty output path");
    uint32_t align = 0;
    bool add_key = false;
    int rc = resolve_alignment(w, alignment, &align, &add_key, err);
    if (rc) return rc;

    const size_t plen = strlen(path);
    char *tmp = malloc(plen + sizeof ".tmp-XXXXXX");
    if (!tmp) return pd_errorf(err, PD_ENOMEM, "gguf writer: out of memory");
    memcpy(tmp, path, plen);
    memcpy(tmp + plen, ".tmp-XXXXXX", sizeof ".tmp-XXXXXX");
    int fd = mkstemp(tmp);
    if (fd < 0) {
        rc = pd_errorf(err, PD_EIO, "cannot create temporary file %s: %s (is the directory writable?)",
                       tmp, strerror(errno));
        free(tmp);
        return rc;
    }
    (void)fchmod(fd, 0644);
    FILE *f = fdopen(fd, "wb");
    if (!f) {
        rc = pd_errorf(err, PD_EIO, "cannot open %s for writing: %s", tmp, strerror(errno));
        close(fd);
        unlink(tmp);
        free(tmp);
        return rc;
    }
    out_file o = {.f = f, .tmp = tmp, .pos = 0};
    rc = write_body(w, &o, align, add_key, err);
    if (!rc && fflush(f) != 0) rc = pd_errorf(err, PD_EIO, "writing %s: %s", tmp, strerror(errno));
    if (!rc && fsync(fileno(f)) != 0) rc = pd_errorf(err, PD_EIO, "fsync %s: %s", tmp, strerror(errno));
    if (fclose(f) != 0 && !rc) rc = pd_errorf(err, PD_EIO, "closing %s: %s", tmp, strerror(errno));
    if (!rc && rename(tmp, path) != 0)
        rc = pd_errorf(err, PD_EIO, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
    if (rc) {
        unlink(tmp);
    } else {
        fsync_parent_dir(path);
    }
    free(tmp);
    return rc;
}
