/* GGUF reader.
 *
 * The whole file is mapped read-only and parsed once into a table of
 * metadata values and tensor descriptors. The parser never trusts a number
 * from the file: every length, count, offset and type is checked against the
 * bytes that remain before it is used, so a truncated or hostile file ends in
 * PD_EFORMAT with the field and byte offset named, not in a crash.
 *
 * Layout (v2/v3, little-endian):
 *   u32 magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
 *   n_kv x { string key | u32 type | value }
 *   n_tensors x { string name | u32 n_dims | u64 ne[n_dims] | u32 type | u64 offset }
 *   padding to `general.alignment` | tensor data
 * A string is u64 length + bytes; an array is u32 element type + u64 count +
 * elements (arrays may nest). */
#include "engine/engine.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#define MAX_KEY_LEN 65535u   /* far beyond any real key; bounds the copies we make */
#define MAX_TENSOR_NAME 256u /* ggml itself allows 63 */

struct pd_gguf {
    pd_mapped_file map; /* empty when opened from memory */
    const uint8_t *base;
    uint64_t size;
    uint32_t version;
    uint64_t alignment;
    uint64_t meta_end;    /* first byte after the tensor table */
    uint64_t data_offset; /* meta_end rounded up to the alignment */

    pd_gguf_kv *kvs;
    uint64_t n_kv;
    pd_gguf_tensor *tensors;
    uint64_t n_tensors;

    /* Open-addressing indexes (capacity a power of two, slot = index + 1). */
    uint32_t *kv_index;
    uint64_t kv_index_cap;
    uint32_t *tensor_index;
    uint64_t tensor_index_cap;

    /* Arrays of strings and nested values, freed on close. */
    void **blocks;
    size_t n_blocks, cap_blocks;

    uint8_t fingerprint[PD_SHA256_LEN];
};

typedef struct cursor {
    const uint8_t *base;
    uint64_t size;
    uint64_t pos;
    pd_error *err;
} cursor;

static const uint32_t vtype_size[PD_GGUF_VTYPE_COUNT] = {
    [PD_GGUF_UINT8] = 1, [PD_GGUF_INT8] = 1,    [PD_GGUF_UINT16] = 2,  [PD_GGUF_INT16] = 2,
    [PD_GGUF_UINT32] = 4, [PD_GGUF_INT32] = 4,  [PD_GGUF_FLOAT32] = 4, [PD_GGUF_BOOL] = 1,
    [PD_GGUF_STRING] = 0, [PD_GGUF_ARRAY] = 0,  [PD_GGUF_UINT64] = 8,  [PD_GGUF_INT64] = 8,
    [PD_GGUF_FLOAT64] = 8,
};

const char *pd_gguf_vtype_name(pd_gguf_vtype t) {
    static const char *const names[PD_GGUF_VTYPE_COUNT] = {
        "u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "str", "arr", "u64", "i64", "f64",
    };
    return (unsigned)t < PD_GGUF_VTYPE_COUNT ? names[t] : "?";
}

/* ---- bounded reads ---------------------------------------------------- */

static uint64_t remaining(const cursor *c) { return c->size - c->pos; }

static int need(cursor *c, uint64_t n, const char *what) {
    if (n > remaining(c))
        return pd_errorf(c->err, PD_EFORMAT,
                         "truncated file: %s at offset %" PRIu64 " needs %" PRIu64
                         " bytes but only %" PRIu64 " remain",
                         what, c->pos, n, remaining(c));
    return PD_OK;
}

static uint64_t load_le(const uint8_t *p, unsigned n) {
    uint64_t v = 0;
    for (unsigned i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static int read_u32(cursor *c, uint32_t *out, const char *what) {
    int rc = need(c, 4, what);
    if (rc) return rc;
    *out = (uint32_t)load_le(c->base + c->pos, 4);
    c->pos += 4;
    return PD_OK;
}

static int read_u64(cursor *c, uint64_t *out, const char *what) {
    int rc = need(c, 8, what);
    if (rc) return rc;
    *out = load_le(c->base + c->pos, 8);
    c->pos += 8;
    return PD_OK;
}

static int read_str(cursor *c, pd_str *out, const char *what) {
    uint64_t at = c->pos, len;
    int rc = read_u64(c, &len, what);
    if (rc) return rc;
    if (len > remaining(c))
        return pd_errorf(c->err, PD_EFORMAT,
                         "bad length: %s at offset %" PRIu64 " claims %" PRIu64
                         " bytes but only %" PRIu64 " remain",
                         what, at, len, remaining(c));
    out->ptr = (const char *)c->base + c->pos;
    out->len = len;
    c->pos += len;
    return PD_OK;
}

/* A NUL-terminated copy of a name; refuses embedded NULs and absurd lengths. */
static int copy_name(cursor *c, const pd_str *s, uint64_t at, uint64_t max_len, const char *what,
                     char **out) {
    if (s->len == 0)
        return pd_errorf(c->err, PD_EFORMAT, "empty %s at offset %" PRIu64, what, at);
    if (s->len > max_len)
        return pd_errorf(c->err, PD_EFORMAT,
                         "%s at offset %" PRIu64 " is %" PRIu64 " bytes long (limit %" PRIu64 ")",
                         what, at, s->len, max_len);
    if (memchr(s->ptr, '\0', s->len))
        return pd_errorf(c->err, PD_EFORMAT, "%s at offset %" PRIu64 " contains a NUL byte", what, at);
    char *p = malloc(s->len + 1);
    if (!p) return pd_errorf(c->err, PD_ENOMEM, "out of memory copying %s", what);
    memcpy(p, s->ptr, s->len);
    p[s->len] = '\0';
    *out = p;
    return PD_OK;
}

static int track_block(pd_gguf *g, void *block, pd_error *err) {
    if (g->n_blocks == g->cap_blocks) {
        size_t cap = g->cap_blocks ? g->cap_blocks * 2 : 16;
        void **nb = realloc(g->blocks, cap * sizeof *nb);
        if (!nb) {
            free(block);
            return pd_errorf(err, PD_ENOMEM, "out of memory while parsing metadata");
        }
        g->blocks = nb;
        g->cap_blocks = cap;
    }
    g->blocks[g->n_blocks++] = block;
    return PD_OK;
}

/* ---- metadata values -------------------------------------------------- */

static int read_value(pd_gguf *g, cursor *c, pd_gguf_vtype type, pd_gguf_value *v,
                      const char *key, unsigned depth);

static int read_array(pd_gguf *g, cursor *c, pd_gguf_value *v, const char *key, unsigned depth) {
    uint64_t at = c->pos;
    uint32_t et;
    uint64_t n;
    int rc;
    if (depth >= PD_GGUF_MAX_ARRAY_DEPTH)
        return pd_errorf(c->err, PD_EFORMAT,
                         "key '%s': arrays nested deeper than %d at offset %" PRIu64, key,
                         PD_GGUF_MAX_ARRAY_DEPTH, at);
    if ((rc = read_u32(c, &et, "array element type"))) return rc;
    if (et >= PD_GGUF_VTYPE_COUNT)
        return pd_errorf(c->err, PD_EFORMAT,
                         "key '%s': array element type %" PRIu32 " at offset %" PRIu64
                         " is not a GGUF type (0..12)",
                         key, et, at);
    if ((rc = read_u64(c, &n, "array length"))) return rc;
    v->type = PD_GGUF_ARRAY;
    v->arr.elem_type = (pd_gguf_vtype)et;
    v->arr.n = n;
    v->arr.data = NULL;
    v->arr.strs = NULL;
    v->arr.items = NULL;

    /* Smallest possible encoding of one element: bounds n before allocating. */
    uint64_t min_elem = et == PD_GGUF_STRING ? 8 : et == PD_GGUF_ARRAY ? 12 : vtype_size[et];
    if (n > remaining(c) / min_elem)
        return pd_errorf(c->err, PD_EFORMAT,
                         "key '%s': array at offset %" PRIu64 " claims %" PRIu64
                         " elements of type %s, more than the %" PRIu64 " bytes left can hold",
                         key, at, n, pd_gguf_vtype_name((pd_gguf_vtype)et), remaining(c));

    if (et == PD_GGUF_STRING) {
        pd_str *strs = n ? calloc(n, sizeof *strs) : NULL;
        if (n && !strs) return pd_errorf(c->err, PD_ENOMEM, "key '%s': out of memory for %" PRIu64 " strings", key, n);
        if (strs && (rc = track_block(g, strs, c->err))) return rc;
        for (uint64_t i = 0; i < n; i++)
            if ((rc = read_str(c, &strs[i], "array string"))) return pd_error_prefix(c->err, "key '%s'[%" PRIu64 "]", key, i);
        v->arr.strs = strs;
    } else if (et == PD_GGUF_ARRAY) {
        pd_gguf_value *items = n ? calloc(n, sizeof *items) : NULL;
        if (n && !items) return pd_errorf(c->err, PD_ENOMEM, "key '%s': out of memory for %" PRIu64 " nested arrays", key, n);
        if (items && (rc = track_block(g, items, c->err))) return rc;
        for (uint64_t i = 0; i < n; i++)
            if ((rc = read_value(g, c, PD_GGUF_ARRAY, &items[i], key, depth + 1))) return rc;
        v->arr.items = items;
    } else {
        v->arr.data = c->base + c->pos;
        c->pos += n * vtype_size[et]; /* bounded above */
    }
    return PD_OK;
}

static int read_value(pd_gguf *g, cursor *c, pd_gguf_vtype type, pd_gguf_value *v,
                      const char *key, unsigned depth) {
    v->type = type;
    if (type == PD_GGUF_STRING) return read_str(c, &v->str, "string value");
    if (type == PD_GGUF_ARRAY) return read_array(g, c, v, key, depth);

    uint32_t sz = vtype_size[type];
    int rc = need(c, sz, "value");
    if (rc) return pd_error_prefix(c->err, "key '%s'", key);
    uint64_t raw = load_le(c->base + c->pos, sz);
    c->pos += sz;
    switch (type) {
    case PD_GGUF_UINT8: case PD_GGUF_UINT16: case PD_GGUF_UINT32: case PD_GGUF_UINT64:
        v->u = raw;
        break;
    case PD_GGUF_BOOL:
        v->u = raw != 0;
        break;
    case PD_GGUF_INT8: v->i = (int8_t)raw; break;
    case PD_GGUF_INT16: v->i = (int16_t)raw; break;
    case PD_GGUF_INT32: v->i = (int32_t)raw; break;
    case PD_GGUF_INT64: v->i = (int64_t)raw; break;
    case PD_GGUF_FLOAT32: {
        float f;
        uint32_t r32 = (uint32_t)raw;
        memcpy(&f, &r32, 4);
        v->f = f;
        break;
    }
    case PD_GGUF_FLOAT64: {
        double d;
        memcpy(&d, &raw, 8);
        v->f = d;
        break;
    }
    default:
        return pd_errorf(c->err, PD_EFORMAT, "key '%s': bad value type %d", key, (int)type);
    }
    return PD_OK;
}

/* ---- name indexes ----------------------------------------------------- */

static uint64_t hash_name(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static int index_build(uint64_t n, uint32_t **slots_out, uint64_t *cap_out, pd_error *err) {
    if (n >= UINT32_MAX / 2) return pd_errorf(err, PD_EFORMAT, "%" PRIu64 " names is more than this reader indexes", n);
    uint64_t cap = 16;
    while (cap < n * 2) cap *= 2;
    uint32_t *slots = calloc(cap, sizeof *slots);
    if (!slots) return pd_errorf(err, PD_ENOMEM, "out of memory indexing %" PRIu64 " names", n);
    *slots_out = slots;
    *cap_out = cap;
    return PD_OK;
}

/* Insert name #i; returns the index of an existing equal name, or -1. */
static int64_t index_insert(uint32_t *slots, uint64_t cap, const char *name, uint64_t i,
                            const char *(*name_at)(const pd_gguf *, uint64_t), const pd_gguf *g) {
    for (uint64_t h = hash_name(name) & (cap - 1);; h = (h + 1) & (cap - 1)) {
        if (!slots[h]) {
            slots[h] = (uint32_t)(i + 1);
            return -1;
        }
        if (strcmp(name_at(g, slots[h] - 1), name) == 0) return slots[h] - 1;
    }
}

static int64_t index_lookup(const uint32_t *slots, uint64_t cap, const char *name,
                            const char *(*name_at)(const pd_gguf *, uint64_t), const pd_gguf *g) {
    if (!slots) return -1;
    for (uint64_t h = hash_name(name) & (cap - 1);; h = (h + 1) & (cap - 1)) {
        if (!slots[h]) return -1;
        if (strcmp(name_at(g, slots[h] - 1), name) == 0) return slots[h] - 1;
    }
}

static const char *kv_name_at(const pd_gguf *g, uint64_t i) { return g->kvs[i].key; }
static const char *tensor_name_at(const pd_gguf *g, uint64_t i) { return g->tensors[i].name; }

/* ---- header, metadata, tensor table ---------------------------------- */

static int parse_header(pd_gguf *g, cursor *c, pd_error *err) {
    uint32_t magic;
    int rc;
    if (c->size < 4 || (rc = read_u32(c, &magic, "magic")))
        return pd_errorf(err, PD_EFORMAT, "not a GGUF file: only %" PRIu64 " bytes", c->size);
    if (magic != PD_GGUF_MAGIC)
        return pd_errorf(err, PD_EFORMAT,
                         "not a GGUF file: magic is 0x%08" PRIx32 ", expected 0x%08x (\"GGUF\")", magic,
                         PD_GGUF_MAGIC);
    if ((rc = read_u32(c, &g->version, "version"))) return rc;
    if (g->version == 1)
        return pd_errorf(err, PD_EUNSUPPORTED,
                         "GGUF version 1 is not supported (only 2 and 3); convert the model again with a current llama.cpp");
    if ((g->version & 0xffff) == 0 && g->version != 0)
        return pd_errorf(err, PD_EUNSUPPORTED,
                         "GGUF version field 0x%08" PRIx32 " looks byte-swapped: big-endian GGUF files are not supported",
                         g->version);
    if (g->version != 2 && g->version != 3)
        return pd_errorf(err, PD_EUNSUPPORTED, "GGUF version %" PRIu32 " is not supported (only 2 and 3)",
                         g->version);
    if ((rc = read_u64(c, &g->n_tensors, "tensor count"))) return rc;
    if ((rc = read_u64(c, &g->n_kv, "metadata count"))) return rc;
    /* A KV needs >= 13 bytes (key length, 1-byte key, type, 1-byte value); a
     * tensor info >= 32 (name length, 1-byte name, n_dims, one dim, type, offset). */
    if (g->n_kv > remaining(c) / 13)
        return pd_errorf(err, PD_EFORMAT,
                         "header claims %" PRIu64 " metadata entries; the file cannot hold more than %" PRIu64,
                         g->n_kv, remaining(c) / 13);
    if (g->n_tensors > remaining(c) / 32)
        return pd_errorf(err, PD_EFORMAT,
                         "header claims %" PRIu64 " tensors; the file cannot hold more than %" PRIu64,
                         g->n_tensors, remaining(c) / 32);
    return PD_OK;
}

static int parse_metadata(pd_gguf *g, cursor *c, pd_error *err) {
    int rc;
    g->kvs = g->n_kv ? calloc(g->n_kv, sizeof *g->kvs) : NULL;
    if (g->n_kv && !g->kvs) return pd_errorf(err, PD_ENOMEM, "out of memory for %" PRIu64 " metadata entries", g->n_kv);
    if ((rc = index_build(g->n_kv, &g->kv_index, &g->kv_index_cap, err))) return rc;

    for (uint64_t i = 0; i < g->n_kv; i++) {
        pd_gguf_kv *kv = &g->kvs[i];
        uint64_t at = c->pos;
        pd_str key;
        uint32_t type;
        if ((rc = read_str(c, &key, "metadata key"))) return pd_error_prefix(err, "metadata entry %" PRIu64, i);
        if ((rc = copy_name(c, &key, at, MAX_KEY_LEN, "metadata key", &kv->key))) return rc;
        uint64_t type_at = c->pos;
        if ((rc = read_u32(c, &type, "value type"))) return pd_error_prefix(err, "key '%s'", kv->key);
        if (type >= PD_GGUF_VTYPE_COUNT)
            return pd_errorf(err, PD_EFORMAT,
                             "key '%s': value type %" PRIu32 " at offset %" PRIu64 " is not a GGUF type (0..12)",
                             kv->key, type, type_at);
        if ((rc = read_value(g, c, (pd_gguf_vtype)type, &kv->value, kv->key, 0))) return rc;
        int64_t dup = index_insert(g->kv_index, g->kv_index_cap, kv->key, i, kv_name_at, g);
        if (dup >= 0)
            return pd_errorf(err, PD_EFORMAT, "duplicate metadata key '%s' (entries %" PRId64 " and %" PRIu64 ")",
                             kv->key, dup, i);
    }

    g->alignment = PD_GGUF_DEFAULT_ALIGNMENT;
    const pd_gguf_value *al = pd_gguf_find(g, "general.alignment");
    if (al) {
        if (al->type != PD_GGUF_UINT32)
            return pd_errorf(err, PD_EFORMAT, "general.alignment has type %s, expected u32",
                             pd_gguf_vtype_name(al->type));
        if (al->u == 0 || (al->u & (al->u - 1)) != 0)
            return pd_errorf(err, PD_EFORMAT, "general.alignment = %" PRIu64 " is not a power of two", al->u);
        g->alignment = al->u;
    }
    return PD_OK;
}

static int parse_tensor_info(pd_gguf *g, cursor *c, uint64_t i, pd_error *err) {
    pd_gguf_tensor *t = &g->tensors[i];
    uint64_t at = c->pos;
    pd_str name;
    uint32_t n_dims, type;
    int rc;
    if ((rc = read_str(c, &name, "tensor name"))) return pd_error_prefix(err, "tensor %" PRIu64, i);
    if ((rc = copy_name(c, &name, at, MAX_TENSOR_NAME, "tensor name", &t->name))) return rc;
    if ((rc = read_u32(c, &n_dims, "tensor n_dims"))) return pd_error_prefix(err, "tensor '%s'", t->name);
    if (n_dims == 0 || n_dims > PD_GGUF_MAX_DIMS)
        return pd_errorf(err, PD_EFORMAT, "tensor '%s': n_dims = %" PRIu32 " (allowed 1..%d)", t->name, n_dims,
                         PD_GGUF_MAX_DIMS);
    t->n_dims = n_dims;
    uint64_t n_elems = 1;
    for (uint32_t d = 0; d < PD_GGUF_MAX_DIMS; d++) {
        t->ne[d] = 1;
        if (d >= n_dims) continue;
        if ((rc = read_u64(c, &t->ne[d], "tensor dimension"))) return pd_error_prefix(err, "tensor '%s'", t->name);
        if (t->ne[d] > (uint64_t)INT64_MAX || !pd_mul_ok(n_elems, t->ne[d], &n_elems) || n_elems > (uint64_t)INT64_MAX)
            return pd_errorf(err, PD_EFORMAT, "tensor '%s': dimension %" PRIu32 " = %" PRIu64 " overflows the element count",
                             t->name, d, t->ne[d]);
    }
    t->n_elems = n_elems;
    uint64_t type_at = c->pos;
    if ((rc = read_u32(c, &type, "tensor type"))) return pd_error_prefix(err, "tensor '%s'", t->name);
    const pd_type_traits *tr = pd_type_get(type);
    if (!tr)
        return pd_errorf(err, PD_EUNSUPPORTED, "tensor '%s': type %" PRIu32 " at offset %" PRIu64 " is unknown",
                         t->name, type, type_at);
    t->type = (pd_type)type;
    if (t->ne[0] % tr->block_size != 0)
        return pd_errorf(err, PD_EFORMAT, "tensor '%s': row length %" PRIu64 " is not a multiple of the %s block size %" PRIu32,
                         t->name, t->ne[0], tr->name, tr->block_size);
    if ((rc = pd_type_row_size(t->type, n_elems, &t->n_bytes, err))) return pd_error_prefix(err, "tensor '%s'", t->name);
    if ((rc = read_u64(c, &t->offset, "tensor offset"))) return pd_error_prefix(err, "tensor '%s'", t->name);
    if (t->offset % g->alignment != 0)
        return pd_errorf(err, PD_EFORMAT, "tensor '%s': data offset %" PRIu64 " is not a multiple of the alignment %" PRIu64,
                         t->name, t->offset, g->alignment);
    int64_t dup = index_insert(g->tensor_index, g->tensor_index_cap, t->name, i, tensor_name_at, g);
    if (dup >= 0) return pd_errorf(err, PD_EFORMAT, "duplicate tensor name '%s'", t->name);
    return PD_OK;
}

static int cmp_by_offset(const void *a, const void *b) {
    const pd_gguf_tensor *x = *(const pd_gguf_tensor *const *)a, *y = *(const pd_gguf_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* Tensor data must lie inside the file and no two tensors may overlap. */
static int check_tensor_data(pd_gguf *g, pd_error *err) {
    uint64_t data_size = g->data_offset <= g->size ? g->size - g->data_offset : 0;
    pd_gguf_tensor **order = g->n_tensors ? malloc(g->n_tensors * sizeof *order) : NULL;
    if (g->n_tensors && !order) return pd_errorf(err, PD_ENOMEM, "out of memory checking tensor offsets");
    int rc = PD_OK;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        pd_gguf_tensor *t = &g->tensors[i];
        order[i] = t;
        if (t->offset > data_size || t->n_bytes > data_size - t->offset) {
            rc = pd_errorf(err, PD_EFORMAT,
                           "tensor '%s': data [%" PRIu64 ", +%" PRIu64 ") lies beyond the end of the file "
                           "(data section holds %" PRIu64 " bytes from offset %" PRIu64 "); the file is truncated or corrupt",
                           t->name, t->offset, t->n_bytes, data_size, g->data_offset);
            goto out;
        }
        t->data = g->base + g->data_offset + t->offset;
    }
    if (g->n_tensors > 1) qsort(order, g->n_tensors, sizeof *order, cmp_by_offset);
    for (uint64_t i = 1; i < g->n_tensors; i++) {
        const pd_gguf_tensor *a = order[i - 1], *b = order[i];
        if (a->offset + a->n_bytes > b->offset) {
            rc = pd_errorf(err, PD_EFORMAT, "tensors '%s' and '%s' overlap (offsets %" PRIu64 " and %" PRIu64 ")",
                           a->name, b->name, a->offset, b->offset);
            goto out;
        }
    }
out:
    free(order);
    return rc;
}

static int parse(pd_gguf *g, pd_error *err) {
    cursor c = {.base = g->base, .size = g->size, .pos = 0, .err = err};
    int rc;
    if ((rc = parse_header(g, &c, err))) return rc;
    if ((rc = parse_metadata(g, &c, err))) return rc;

    g->tensors = g->n_tensors ? calloc(g->n_tensors, sizeof *g->tensors) : NULL;
    if (g->n_tensors && !g->tensors) return pd_errorf(err, PD_ENOMEM, "out of memory for %" PRIu64 " tensors", g->n_tensors);
    if ((rc = index_build(g->n_tensors, &g->tensor_index, &g->tensor_index_cap, err))) return rc;
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if ((rc = parse_tensor_info(g, &c, i, err))) return rc;

    g->meta_end = c.pos;
    uint64_t pad = (g->alignment - g->meta_end % g->alignment) % g->alignment;
    g->data_offset = g->meta_end + pad; /* meta_end <= size, alignment <= 2^32: no overflow */
    if ((rc = check_tensor_data(g, err))) return rc;
    return pd_sha256_buf(g->base, g->meta_end, g->fingerprint, err);
}

/* ---- public API ------------------------------------------------------- */

int pd_gguf_open_memory(const void *data, size_t size, pd_gguf **out, pd_error *err) {
    *out = NULL;
    pd_gguf *g = calloc(1, sizeof *g);
    if (!g) return pd_errorf(err, PD_ENOMEM, "out of memory opening GGUF");
    g->base = data;
    g->size = size;
    int rc = parse(g, err);
    if (rc) {
        pd_gguf_close(g);
        return rc;
    }
    *out = g;
    return PD_OK;
}

static int open_file(const char *path, bool in_memory, pd_gguf **out, pd_error *err) {
    *out = NULL;
    pd_mapped_file map;
    int rc = in_memory ? pd_load_file(path, &map, err) : pd_map_file(path, &map, err);
    if (rc) return rc;
    pd_gguf *g = NULL;
    rc = pd_gguf_open_memory(map.data, map.size, &g, err);
    if (rc) {
        pd_unmap_file(&map);
        return pd_error_prefix(err, "%s", path);
    }
    g->map = map;
    *out = g;
    return PD_OK;
}

int pd_gguf_open(const char *path, pd_gguf **out, pd_error *err) {
    return open_file(path, false, out, err);
}

int pd_gguf_load(const char *path, pd_gguf **out, pd_error *err) {
    return open_file(path, true, out, err);
}

int pd_gguf_set_writable(pd_gguf *g, bool writable, pd_error *err) {
    return pd_mapped_file_set_writable(&g->map, writable, err);
}

void pd_gguf_close(pd_gguf *g) {
    if (!g) return;
    for (uint64_t i = 0; i < g->n_kv && g->kvs; i++) free(g->kvs[i].key);
    for (uint64_t i = 0; i < g->n_tensors && g->tensors; i++) free(g->tensors[i].name);
    for (size_t i = 0; i < g->n_blocks; i++) free(g->blocks[i]);
    free(g->blocks);
    free(g->kvs);
    free(g->tensors);
    free(g->kv_index);
    free(g->tensor_index);
    pd_unmap_file(&g->map);
    free(g);
}

uint32_t pd_gguf_version(const pd_gguf *g) { return g->version; }
uint64_t pd_gguf_alignment(const pd_gguf *g) { return g->alignment; }
uint64_t pd_gguf_data_offset(const pd_gguf *g) { return g->data_offset; }
uint64_t pd_gguf_file_size(const pd_gguf *g) { return g->size; }
size_t pd_gguf_kv_count(const pd_gguf *g) { return (size_t)g->n_kv; }
size_t pd_gguf_tensor_count(const pd_gguf *g) { return (size_t)g->n_tensors; }

const pd_gguf_kv *pd_gguf_kv_at(const pd_gguf *g, size_t i) { return i < g->n_kv ? &g->kvs[i] : NULL; }

const pd_gguf_tensor *pd_gguf_tensor_at(const pd_gguf *g, size_t i) {
    return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const pd_gguf_value *pd_gguf_find(const pd_gguf *g, const char *key) {
    int64_t i = index_lookup(g->kv_index, g->kv_index_cap, key, kv_name_at, g);
    return i < 0 ? NULL : &g->kvs[i].value;
}

const pd_gguf_tensor *pd_gguf_find_tensor(const pd_gguf *g, const char *name) {
    int64_t i = index_lookup(g->tensor_index, g->tensor_index_cap, name, tensor_name_at, g);
    return i < 0 ? NULL : &g->tensors[i];
}

void pd_gguf_fingerprint(const pd_gguf *g, uint8_t out[PD_SHA256_LEN]) {
    memcpy(out, g->fingerprint, PD_SHA256_LEN);
}

/* ---- typed getters ---------------------------------------------------- */

static bool is_unsigned(pd_gguf_vtype t) {
    return t == PD_GGUF_UINT8 || t == PD_GGUF_UINT16 || t == PD_GGUF_UINT32 || t == PD_GGUF_UINT64;
}
static bool is_signed(pd_gguf_vtype t) {
    return t == PD_GGUF_INT8 || t == PD_GGUF_INT16 || t == PD_GGUF_INT32 || t == PD_GGUF_INT64;
}

static const pd_gguf_value *find_or_err(const pd_gguf *g, const char *key, pd_error *err) {
    const pd_gguf_value *v = pd_gguf_find(g, key);
    if (!v) pd_errorf(err, PD_ENOTFOUND, "metadata key '%s' is missing", key);
    return v;
}

int pd_gguf_get_i64(const pd_gguf *g, const char *key, int64_t *out, pd_error *err) {
    const pd_gguf_value *v = find_or_err(g, key, err);
    if (!v) return PD_ENOTFOUND;
    if (is_signed(v->type)) {
        *out = v->i;
        return PD_OK;
    }
    if (is_unsigned(v->type)) {
        if (v->u > (uint64_t)INT64_MAX) return pd_errorf(err, PD_EFORMAT, "metadata '%s' = %" PRIu64 " is too large", key, v->u);
        *out = (int64_t)v->u;
        return PD_OK;
    }
    return pd_errorf(err, PD_EFORMAT, "metadata '%s' has type %s, expected an integer", key, pd_gguf_vtype_name(v->type));
}

int pd_gguf_get_u64(const pd_gguf *g, const char *key, uint64_t *out, pd_error *err) {
    const pd_gguf_value *v = find_or_err(g, key, err);
    if (!v) return PD_ENOTFOUND;
    if (is_unsigned(v->type)) {
        *out = v->u;
        return PD_OK;
    }
    if (is_signed(v->type)) {
        if (v->i < 0) return pd_errorf(err, PD_EFORMAT, "metadata '%s' = %" PRId64 " is negative", key, v->i);
        *out = (uint64_t)v->i;
        return PD_OK;
    }
    return pd_errorf(err, PD_EFORMAT, "metadata '%s' has type %s, expected an integer", key, pd_gguf_vtype_name(v->type));
}

int pd_gguf_get_u32(const pd_gguf *g, const char *key, uint32_t *out, pd_error *err) {
    uint64_t v;
    int rc = pd_gguf_get_u64(g, key, &v, err);
    if (rc) return rc;
    if (v > UINT32_MAX) return pd_errorf(err, PD_EFORMAT, "metadata '%s' = %" PRIu64 " does not fit 32 bits", key, v);
    *out = (uint32_t)v;
    return PD_OK;
}

int pd_gguf_get_f32(const pd_gguf *g, const char *key, float *out, pd_error *err) {
    const pd_gguf_value *v = find_or_err(g, key, err);
    if (!v) return PD_ENOTFOUND;
    if (v->type == PD_GGUF_FLOAT32 || v->type == PD_GGUF_FLOAT64) *out = (float)v->f;
    else if (is_unsigned(v->type)) *out = (float)v->u;
    else if (is_signed(v->type)) *out = (float)v->i;
    else return pd_errorf(err, PD_EFORMAT, "metadata '%s' has type %s, expected a number", key, pd_gguf_vtype_name(v->type));
    return PD_OK;
}

int pd_gguf_get_bool(const pd_gguf *g, const char *key, bool *out, pd_error *err) {
    const pd_gguf_value *v = find_or_err(g, key, err);
    if (!v) return PD_ENOTFOUND;
    if (v->type != PD_GGUF_BOOL)
        return pd_errorf(err, PD_EFORMAT, "metadata '%s' has type %s, expected bool", key, pd_gguf_vtype_name(v->type));
    *out = v->u != 0;
    return PD_OK;
}

int pd_gguf_get_str(const pd_gguf *g, const char *key, pd_str *out, pd_error *err) {
    const pd_gguf_value *v = find_or_err(g, key, err);
    if (!v) return PD_ENOTFOUND;
    if (v->type != PD_GGUF_STRING)
        return pd_errorf(err, PD_EFORMAT, "metadata '%s' has type %s, expected str", key, pd_gguf_vtype_name(v->type));
    *out = v->str;
    return PD_OK;
}

int pd_gguf_get_arr(const pd_gguf *g, const char *key, pd_gguf_vtype elem_type, const pd_gguf_value **out,
                    pd_error *err) {
    const pd_gguf_value *v = find_or_err(g, key, err);
    if (!v) return PD_ENOTFOUND;
    if (v->type != PD_GGUF_ARRAY || v->arr.elem_type != elem_type)
        return pd_errorf(err, PD_EFORMAT, "metadata '%s' has type %s%s%s%s, expected arr[%s]", key,
                         pd_gguf_vtype_name(v->type), v->type == PD_GGUF_ARRAY ? "[" : "",
                         v->type == PD_GGUF_ARRAY ? pd_gguf_vtype_name(v->arr.elem_type) : "",
                         v->type == PD_GGUF_ARRAY ? "]" : "", pd_gguf_vtype_name(elem_type));
    *out = v;
    return PD_OK;
}

float pd_gguf_arr_f32(const pd_gguf_value *arr, uint64_t i) {
    float f;
    memcpy(&f, arr->arr.data + 4 * i, 4);
    return f;
}

int32_t pd_gguf_arr_i32(const pd_gguf_value *arr, uint64_t i) {
    return (int32_t)(uint32_t)load_le(arr->arr.data + 4 * i, 4);
}

int64_t pd_gguf_arr_int(const pd_gguf_value *arr, uint64_t i) {
    pd_gguf_vtype t = arr->arr.elem_type;
    unsigned sz = vtype_size[t];
    uint64_t raw = load_le(arr->arr.data + (uint64_t)sz * i, sz);
    switch (t) {
    case PD_GGUF_INT8: return (int8_t)raw;
    case PD_GGUF_INT16: return (int16_t)raw;
    case PD_GGUF_INT32: return (int32_t)raw;
    case PD_GGUF_INT64: return (int64_t)raw;
    case PD_GGUF_BOOL: return raw != 0;
    default: return (int64_t)raw;
    }
}
