/* KV caches: a sequence's own streams and shared read-only prefixes, both
 * addressed per (layer, kv_head) with their own lengths and positions. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model_internal.h"

static bool on_device(const pd_backend *be) { return be && !pd_backend_host_memory(be); }

/* Device streams grow by allocate, copy, release: backend memory has no
 * realloc. A stream in a pool slab leaves the slab (which stays the
 * sequence's) the first time it outgrows it. */
static int reserve_device(kv_stream *s, pd_backend *be, int64_t new_cap, size_t row, pd_error *err) {
    const size_t rows = (size_t)new_cap;
    void *k = pd_backend_alloc(be, rows * row, err);
    void *v = k ? pd_backend_alloc(be, rows * row, err) : NULL;
    int32_t *dpos = v ? pd_backend_alloc(be, rows * sizeof *dpos, err) : NULL;
    int rc = dpos ? PD_OK : PD_ENOMEM;
    if (!rc && s->len > 0 && !(rc = pd_backend_copy(be, k, s->k, (size_t)s->len * row, err)) &&
        !(rc = pd_backend_copy(be, v, s->v, (size_t)s->len * row, err)))
        rc = pd_backend_copy(be, dpos, s->dpos, (size_t)s->len * sizeof *dpos, err);
    if (rc) {
        pd_backend_release(be, k);
        pd_backend_release(be, v);
        pd_backend_release(be, dpos);
        return pd_error_prefix(err, "growing the KV cache to %" PRId64 " rows", new_cap);
    }
    if (s->pool) {
        pthread_mutex_lock(&s->pool->lock);
        s->pool->outgrown++;
        pthread_mutex_unlock(&s->pool->lock);
        s->pool = NULL;
    } else {
        pd_backend_release(be, s->k);
        pd_backend_release(be, s->v);
        pd_backend_release(be, s->dpos);
    }
    s->k = k;
    s->v = v;
    s->dpos = dpos;
    s->cap = new_cap;
    return PD_OK;
}

/* Host positions of a device stream grow on their own (by doubling): a pool
 * slab gives a stream its full capacity on the device at once, but the
 * host copy need only cover the rows in use. */
static int reserve_host_pos(kv_stream *s, int64_t cap, pd_error *err) {
    if (cap <= s->pos_cap) return PD_OK;
    int64_t n = s->pos_cap ? s->pos_cap : 64;
    while (n < cap) n *= 2;
    if (s->cap > cap && n > s->cap) n = s->cap;
    int32_t *pos = realloc(s->pos, (size_t)n * sizeof *pos);
    if (!pos) return pd_errorf(err, PD_ENOMEM, "out of memory growing the KV cache to %" PRId64 " rows", cap);
    s->pos = pos;
    s->pos_cap = n;
    return PD_OK;
}

int kv_stream_reserve(kv_stream *s, pd_backend *be, int64_t cap, size_t row_bytes, pd_error *err) {
    if (on_device(be)) {
        if (s->keep) return pd_errorf(err, PD_EUNSUPPORTED, "attention masks are a host-backend feature");
        int rc = reserve_host_pos(s, cap, err);
        if (rc || cap <= s->cap) return rc;
        int64_t new_cap = s->cap ? s->cap : 64;
        while (new_cap < cap) new_cap *= 2;
        if ((rc = reserve_host_pos(s, new_cap, err))) return rc;
        return reserve_device(s, be, new_cap, row_bytes, err);
    }
    if (cap <= s->cap) return PD_OK;
    int64_t new_cap = s->cap ? s->cap : 64;
    while (new_cap < cap) new_cap *= 2;
    size_t rows = (size_t)new_cap;
    /* Each array is grown in turn; one that failed leaves the others larger
     * but valid, and cap unchanged, so the stream stays consistent. */
    void *k = realloc(s->k, rows * row_bytes);
    if (!k) goto oom;
    s->k = k;
    void *v = realloc(s->v, rows * row_bytes);
    if (!v) goto oom;
    s->v = v;
    int32_t *pos = realloc(s->pos, rows * sizeof *pos);
    if (!pos) goto oom;
    s->pos = pos;
    if (s->keep) {
        uint8_t *keep = realloc(s->keep, rows);
        if (!keep) goto oom;
        memset(keep + s->cap, 1, rows - (size_t)s->cap);
        s->keep = keep;
    }
    s->cap = new_cap;
    return PD_OK;
oom:
    return pd_errorf(err, PD_ENOMEM, "out of memory growing the KV cache to %" PRId64 " rows", new_cap);
}

void kv_stream_free(kv_stream *s, pd_backend *be) {
    if (on_device(be)) {
        if (!s->pool) {
            pd_backend_release(be, s->k);
            pd_backend_release(be, s->v);
            pd_backend_release(be, s->dpos);
        }
        free(s->pos);
    } else if (!s->borrowed) {
        free(s->k);
        free(s->v);
        free(s->pos);
    }
    free(s->keep);
    memset(s, 0, sizeof *s);
}

static int streams_alloc(int32_t n_layer, int32_t n_head_kv, kv_stream **out, pd_error *err) {
    *out = calloc((size_t)n_layer * (size_t)n_head_kv, sizeof **out);
    return *out ? PD_OK : pd_errorf(err, PD_ENOMEM, "out of memory for KV streams");
}

static void streams_free(kv_stream *s, int64_t n, pd_backend *be) {
    if (!s) return;
    for (int64_t i = 0; i < n; i++) kv_stream_free(&s[i], be);
    free(s);
}

/* ---- prefixes --------------------------------------------------------- */

int pd_kv_prefix_create(const pd_hparams *hp, int32_t n_orig, pd_type type, pd_kv_prefix **out, pd_error *err) {
    *out = NULL;
    if (n_orig < 0) return pd_errorf(err, PD_EINVAL, "prefix length %d is negative", n_orig);
    if (!pd_kv_type_ok(type))
        return pd_errorf(err, PD_EINVAL, "a KV prefix holds f16 or f32 rows, not %s",
                         pd_type_get(type) ? pd_type_get(type)->name : "an unknown type");
    pd_kv_prefix *p = calloc(1, sizeof *p);
    if (!p) return pd_errorf(err, PD_ENOMEM, "out of memory for a KV prefix");
    p->n_layer = hp->n_layer;
    p->n_head_kv = hp->n_head_kv;
    p->head_dim = hp->head_dim;
    p->n_orig = n_orig;
    p->type = type;
    int rc = streams_alloc(p->n_layer, p->n_head_kv, &p->streams, err);
    if (!rc && pthread_mutex_init(&p->dev_lock, NULL) != 0) {
        free(p->streams);
        rc = pd_errorf(err, PD_ENOMEM, "out of resources for a KV prefix lock");
    }
    if (rc) {
        free(p);
        return rc;
    }
    *out = p;
    return PD_OK;
}

/* Shared checks of pd_kv_prefix_set and pd_kv_prefix_set_borrowed. */
static int check_prefix_stream(const pd_kv_prefix *p, int layer, int kv_head, const int32_t *pos, int64_t len,
                               pd_error *err) {
    if (layer < 0 || layer >= p->n_layer || kv_head < 0 || kv_head >= p->n_head_kv)
        return pd_errorf(err, PD_EINVAL, "prefix stream (layer %d, kv head %d) is out of range (%d layers, %d kv heads)",
                         layer, kv_head, p->n_layer, p->n_head_kv);
    if (len < 0 || len > p->n_orig)
        return pd_errorf(err, PD_EINVAL, "prefix stream (layer %d, kv head %d): %" PRId64 " rows for a prefix of %d tokens",
                         layer, kv_head, len, p->n_orig);
    for (int64_t i = 0; i < len; i++)
        if (pos[i] < 0 || pos[i] >= p->n_orig || (i > 0 && pos[i] <= pos[i - 1]))
            return pd_errorf(err, PD_EINVAL,
                             "prefix stream (layer %d, kv head %d): position %d at row %" PRId64
                             " is not increasing within [0, %d)",
                             layer, kv_head, pos[i], i, p->n_orig);
    return PD_OK;
}

int pd_kv_prefix_set(pd_kv_prefix *p, int layer, int kv_head, const int32_t *pos, const float *k, const float *v,
                     int64_t len, pd_error *err) {
    int rc = check_prefix_stream(p, layer, kv_head, pos, len, err);
    if (rc) return rc;
    kv_stream *s = &p->streams[(int64_t)layer * p->n_head_kv + kv_head];
    if (s->borrowed) memset(s, 0, sizeof *s);
    const size_t vals = (size_t)len * (size_t)p->head_dim;
    if ((rc = kv_stream_reserve(s, NULL, len, (size_t)p->head_dim * kv_elem_size(p->type), err))) return rc;
    if (len) {
        if (p->type == PD_TYPE_F16) {
            pd_fp32_to_fp16_row(k, s->k, vals);
            pd_fp32_to_fp16_row(v, s->v, vals);
        } else {
            memcpy(s->k, k, vals * sizeof(float));
            memcpy(s->v, v, vals * sizeof(float));
        }
        memcpy(s->pos, pos, (size_t)len * sizeof *pos);
    }
    s->len = len;
    return PD_OK;
}

int pd_kv_prefix_set_borrowed(pd_kv_prefix *p, int layer, int kv_head, const int32_t *pos, const void *k,
                              const void *v, int64_t len, pd_error *err) {
    int rc = check_prefix_stream(p, layer, kv_head, pos, len, err);
    if (rc) return rc;
    const size_t esz = kv_elem_size(p->type);
    if ((uintptr_t)pos % _Alignof(int32_t) || ((uintptr_t)k | (uintptr_t)v) % esz)
        return pd_errorf(err, PD_EINVAL,
                         "prefix stream (layer %d, kv head %d): positions must be 4-byte and %s rows %zu-byte aligned",
                         layer, kv_head, pd_type_get(p->type)->name, esz);
    kv_stream *s = &p->streams[(int64_t)layer * p->n_head_kv + kv_head];
    kv_stream_free(s, NULL);
    /* The engine only reads prefix streams, so dropping const is safe. */
    *s = (kv_stream){.k = (void *)k, .v = (void *)v, .pos = (int32_t *)pos, .len = len, .cap = len, .borrowed = true};
    return PD_OK;
}

int pd_kv_prefix_clone(const pd_kv_prefix *p, pd_kv_prefix **out, pd_error *err) {
    const pd_hparams hp = {.n_layer = p->n_layer, .n_head_kv = p->n_head_kv, .head_dim = p->head_dim};
    pd_kv_prefix *c;
    int rc = pd_kv_prefix_create(&hp, p->n_orig, p->type, &c, err);
    if (rc) return rc;
    const size_t row = (size_t)p->head_dim * kv_elem_size(p->type);
    for (int64_t i = 0; i < (int64_t)p->n_layer * p->n_head_kv && !rc; i++) {
        const kv_stream *s = &p->streams[i];
        kv_stream *d = &c->streams[i];
        if ((rc = kv_stream_reserve(d, NULL, s->len, row, err))) break;
        if (s->len) {
            memcpy(d->k, s->k, (size_t)s->len * row);
            memcpy(d->v, s->v, (size_t)s->len * row);
            memcpy(d->pos, s->pos, (size_t)s->len * sizeof *d->pos);
        }
        d->len = s->len;
    }
    if (rc) {
        pd_kv_prefix_free(c);
        return rc;
    }
    *out = c;
    return PD_OK;
}

void pd_kv_prefix_free(pd_kv_prefix *p) {
    if (!p) return;
    streams_free(p->streams, (int64_t)p->n_layer * p->n_head_kv, NULL);
    if (p->dev_backend) pd_backend_release(p->dev_backend, p->dev_block);
    free(p->dev_streams);
    pthread_mutex_destroy(&p->dev_lock);
    free(p);
}

/* One allocation for the whole prefix, filled stream by stream through the
 * backend's upload (which stages through pinned memory, so rows borrowed
 * from the store's map go straight from the page cache to the device). */
static int upload_prefix(pd_kv_prefix *p, pd_backend *be, pd_error *err) {
    const int64_t n = (int64_t)p->n_layer * p->n_head_kv;
    const size_t row = (size_t)p->head_dim * kv_elem_size(p->type);
    size_t bytes = 0;
    for (int64_t i = 0; i < n; i++) bytes += (size_t)p->streams[i].len * (2 * row + sizeof(int32_t)) + 3 * 256;
    kv_stream *ds = calloc((size_t)n, sizeof *ds);
    char *block = ds ? pd_backend_alloc(be, bytes ? bytes : 1, err) : NULL;
    if (!block) {
        free(ds);
        return ds ? pd_error_prefix(err, "uploading a KV prefix of %zu MiB", bytes >> 20)
                  : pd_errorf(err, PD_ENOMEM, "out of memory for KV prefix views");
    }
    char *at = block;
    int rc = PD_OK;
    for (int64_t i = 0; i < n && !rc; i++) {
        const kv_stream *hs = &p->streams[i];
        const size_t len = (size_t)hs->len;
        kv_stream *d = &ds[i];
        d->k = at, at += (len * row + 255) & ~(size_t)255;
        d->v = at, at += (len * row + 255) & ~(size_t)255;
        d->dpos = (int32_t *)at, at += (len * sizeof(int32_t) + 255) & ~(size_t)255;
        d->pos = hs->pos;
        d->len = d->cap = hs->len;
        d->borrowed = true;
        if (len && ((rc = pd_backend_upload(be, d->k, hs->k, len * row, err)) ||
                    (rc = pd_backend_upload(be, d->v, hs->v, len * row, err)) ||
                    (rc = pd_backend_upload(be, d->dpos, hs->pos, len * sizeof(int32_t), err))))
            pd_error_prefix(err, "uploading a KV prefix");
    }
    if (rc) {
        pd_backend_release(be, block);
        free(ds);
        return rc;
    }
    p->dev_backend = be;
    p->dev_block = block;
    p->dev_streams = ds;
    return PD_OK;
}

/* The prefix's streams as the backend reads them, uploading the prefix on
 * its first attach on a device backend. */
static int kv_prefix_streams_for(const pd_kv_prefix *cp, pd_backend *be, const kv_stream **out, pd_error *err) {
    if (!on_device(be)) {
        *out = cp->streams;
        return PD_OK;
    }
    /* The device copy is a cache of immutable data: filling it does not
     * change what the prefix holds, hence the cast. */
    pd_kv_prefix *p = (pd_kv_prefix *)cp;
    pthread_mutex_lock(&p->dev_lock);
    int rc = PD_OK;
    if (p->dev_backend && p->dev_backend != be)
        rc = pd_errorf(err, PD_EUNSUPPORTED, "this KV prefix is already on another device; load it once per model");
    else if (!p->dev_backend)
        rc = upload_prefix(p, be, err);
    pthread_mutex_unlock(&p->dev_lock);
    *out = rc ? NULL : p->dev_streams;
    return rc;
}

int32_t pd_kv_prefix_n_orig(const pd_kv_prefix *p) { return p->n_orig; }

pd_type pd_kv_prefix_type(const pd_kv_prefix *p) { return p->type; }

void pd_kv_prefix_shape(const pd_kv_prefix *p, int32_t *n_layer, int32_t *n_head_kv, int32_t *head_dim) {
    *n_layer = p->n_layer;
    *n_head_kv = p->n_head_kv;
    *head_dim = p->head_dim;
}

int64_t pd_kv_prefix_stream(const pd_kv_prefix *p, int layer, int kv_head, const int32_t **pos, const void **k,
                            const void **v) {
    const kv_stream *s = &p->streams[(int64_t)layer * p->n_head_kv + kv_head];
    if (pos) *pos = s->pos;
    if (k) *k = s->k;
    if (v) *v = s->v;
    return s->len;
}

int64_t pd_kv_prefix_stream_f32(const pd_kv_prefix *p, int layer, int kv_head, float *k, float *v) {
    const kv_stream *s = &p->streams[(int64_t)layer * p->n_head_kv + kv_head];
    const size_t vals = (size_t)s->len * (size_t)p->head_dim;
    float *dst[2] = {k, v};
    const void *src[2] = {s->k, s->v};
    for (int i = 0; i < 2; i++) {
        if (!dst[i] || !vals) continue;
        if (p->type == PD_TYPE_F16)
            pd_fp16_to_fp32_row(src[i], dst[i], vals);
        else
            memcpy(dst[i], src[i], vals * sizeof(float));
    }
    return s->len;
}

int64_t pd_kv_prefix_kept_rows(const pd_kv_prefix *p) {
    int64_t n = 0;
    for (int64_t i = 0; i < (int64_t)p->n_layer * p->n_head_kv; i++) n += p->streams[i].len;
    return n;
}

uint64_t pd_kv_prefix_bytes(const pd_kv_prefix *p) {
    const uint64_t row = 2 * (uint64_t)p->head_dim * kv_elem_size(p->type) + sizeof(int32_t);
    return (uint64_t)pd_kv_prefix_kept_rows(p) * row;
}

/* ---- the device KV pool ------------------------------------------------ */

static size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

/* Bytes of one stream's K, V and positions at `rows` rows in a slab. */
static size_t slab_stream_bytes(const pd_model *m, int64_t rows) {
    const size_t row = (size_t)m->hp.head_dim * kv_elem_size(m->kv_type);
    return 2 * align256((size_t)rows * row) + align256((size_t)rows * sizeof(int32_t));
}

static int64_t n_streams(const pd_model *m) { return (int64_t)m->hp.n_layer * m->hp.n_head_kv; }

/* A free slab for a new sequence on a pooled model: its streams point into
 * it with the slab's rows as capacity. None free: the sequence grows by
 * allocation like on a pool-less model. */
static void pool_take(pd_model *m, pd_seq *s) {
    kv_pool *p = &m->pool;
    if (!on_device(m->backend) || p->n_slabs == 0) return;
    pthread_mutex_lock(&p->lock);
    void *slab = p->n_free ? p->free[--p->n_free] : NULL;
    if (!slab) p->no_slab++;
    pthread_mutex_unlock(&p->lock);
    if (!slab) return;
    const size_t row = (size_t)m->hp.head_dim * kv_elem_size(m->kv_type);
    const size_t kv_bytes = align256((size_t)p->rows * row);
    char *at = slab;
    for (int64_t i = 0; i < n_streams(m); i++) {
        kv_stream *st = &s->streams[i];
        st->k = at;
        st->v = at + kv_bytes;
        st->dpos = (int32_t *)(at + 2 * kv_bytes);
        st->cap = p->rows;
        st->pool = p;
        at += slab_stream_bytes(m, p->rows);
    }
    s->slab = slab;
}

static void pool_give_back(kv_pool *p, void *slab) {
    if (!slab) return;
    pthread_mutex_lock(&p->lock);
    p->free[p->n_free++] = slab;
    pthread_mutex_unlock(&p->lock);
}

int kv_pool_init(kv_pool *p, pd_error *err) {
    memset(p, 0, sizeof *p);
    return pthread_mutex_init(&p->lock, NULL) == 0 ? PD_OK : pd_errorf(err, PD_ENOMEM, "cannot create the KV pool lock");
}

/* Every slab back to the backend's allocator (none may be taken). */
void kv_pool_drop(kv_pool *p, pd_backend *be) {
    for (int i = 0; i < p->n_slabs; i++) pd_backend_release(be, p->slabs[i]);
    free(p->slabs);
    free(p->free);
    p->slabs = p->free = NULL;
    p->n_slabs = p->n_free = 0;
    p->rows = 0;
    p->slab_bytes = 0;
    p->no_slab = p->outgrown = 0;
}

void kv_pool_destroy(kv_pool *p, pd_backend *be) {
    kv_pool_drop(p, be);
    pthread_mutex_destroy(&p->lock);
}

/* Rows per slab: n_ctx, or what PD_KV_POOL_FRACTION of the free memory
 * holds for n_seqs slabs, in multiples of 64. */
static int pool_rows(pd_model *m, int n_seqs, int32_t n_ctx, int32_t *rows, pd_error *err) {
    uint64_t free_b = 0, total_b = 0;
    pd_error ignored = {0};
    *rows = n_ctx;
    /* A device that does not say (the CPU pretending to be one) is not capped. */
    if (pd_backend_memory(m->backend, &free_b, &total_b, &ignored) != PD_OK) return PD_OK;
    const double budget = (double)free_b * PD_KV_POOL_FRACTION / n_seqs;
    const double per_row = (double)n_streams(m) * (double)slab_stream_bytes(m, 64) / 64.0;
    if ((double)n_streams(m) * (double)slab_stream_bytes(m, n_ctx) <= budget) return PD_OK;
    int64_t fit = (int64_t)(budget / per_row) / 64 * 64;
    while (fit >= 64 && (double)n_streams(m) * (double)slab_stream_bytes(m, fit) > budget) fit -= 64;
    if (fit < 64)
        return pd_errorf(err, PD_ENOMEM,
                         "the KV pool does not fit: %d sequences of even 64 positions need %.1f MiB and %.0f%% of the "
                         "%.1f MiB free on %s is %.1f MiB; lower the batch size (scheduler max_batch) or use a smaller model",
                         n_seqs, n_seqs * per_row * 64 / 1048576.0, PD_KV_POOL_FRACTION * 100, free_b / 1048576.0,
                         pd_backend_name(m->backend), budget * n_seqs / 1048576.0);
    *rows = (int32_t)fit;
    return PD_OK;
}

int kv_pool_reserve(pd_model *m, int n_seqs, int32_t n_ctx, pd_error *err) {
    kv_pool *p = &m->pool;
    pthread_mutex_lock(&p->lock);
    const bool busy = p->n_free != p->n_slabs;
    pthread_mutex_unlock(&p->lock);
    if (busy) return pd_errorf(err, PD_EINVAL, "sequences still hold KV pool slabs; free them before reserving again");
    kv_pool_drop(p, m->backend);
    int32_t rows;
    int rc = pool_rows(m, n_seqs, n_ctx, &rows, err);
    if (rc) return rc;
    const size_t slab = (size_t)n_streams(m) * slab_stream_bytes(m, rows);
    p->slabs = calloc((size_t)n_seqs, sizeof *p->slabs);
    p->free = calloc((size_t)n_seqs, sizeof *p->free);
    if (!p->slabs || !p->free) {
        kv_pool_drop(p, m->backend);
        return pd_errorf(err, PD_ENOMEM, "out of memory for the KV pool's table");
    }
    for (int i = 0; i < n_seqs; i++) {
        if (!(p->slabs[i] = pd_backend_alloc(m->backend, slab, err))) {
            kv_pool_drop(p, m->backend);
            return pd_error_prefix(err, "reserving the KV pool (%d slabs of %zu MiB)", n_seqs, slab >> 20);
        }
        p->free[i] = p->slabs[i];
        p->n_slabs = p->n_free = i + 1;
    }
    p->rows = rows;
    p->slab_bytes = slab;
    return PD_OK;
}

void pd_model_kv_pool_stats(pd_model *m, pd_kv_pool_stats *out) {
    kv_pool *p = &m->pool;
    pthread_mutex_lock(&p->lock);
    *out = (pd_kv_pool_stats){.slabs = p->n_slabs, .slabs_free = p->n_free, .rows = p->rows,
                              .bytes = (uint64_t)p->slab_bytes * (uint64_t)p->n_slabs,
                              .no_slab = p->no_slab, .outgrown = p->outgrown};
    pthread_mutex_unlock(&p->lock);
}

/* ---- sequences -------------------------------------------------------- */

int pd_seq_create(pd_model *m, int32_t n_ctx, pd_seq **out, pd_error *err) {
    *out = NULL;
    if (n_ctx < 0) return pd_errorf(err, PD_EINVAL, "context size %d is negative", n_ctx);
    pd_seq *s = calloc(1, sizeof *s);
    if (!s) return pd_errorf(err, PD_ENOMEM, "out of memory for a sequence");
    s->model = m;
    s->n_ctx = n_ctx ? n_ctx : m->hp.n_ctx_train;
    int rc = streams_alloc(m->hp.n_layer, m->hp.n_head_kv, &s->streams, err);
    if (rc) {
        free(s);
        return rc;
    }
    pool_take(m, s);
    *out = s;
    return PD_OK;
}

void pd_seq_free(pd_seq *s) {
    if (!s) return;
    streams_free(s->streams, (int64_t)s->model->hp.n_layer * s->model->hp.n_head_kv, s->model->backend);
    pool_give_back(&s->model->pool, s->slab);
    free(s);
}

int pd_seq_attach_prefix(pd_seq *s, const pd_kv_prefix *p, pd_error *err) {
    const pd_hparams *hp = &s->model->hp;
    if (s->next_pos != 0 || s->prefix) return pd_errorf(err, PD_EINVAL, "a prefix can only be attached to an empty sequence");
    if (p->n_layer != hp->n_layer || p->n_head_kv != hp->n_head_kv || p->head_dim != hp->head_dim)
        return pd_errorf(err, PD_EINVAL,
                         "prefix shape (%d layers, %d kv heads, head size %d) does not match the model (%d, %d, %d)",
                         p->n_layer, p->n_head_kv, p->head_dim, hp->n_layer, hp->n_head_kv, hp->head_dim);
    if (p->n_orig >= s->n_ctx)
        return pd_errorf(err, PD_ERANGE, "prefix of %d tokens leaves no room in a context of %d", p->n_orig, s->n_ctx);
    const kv_stream *streams;
    int rc = kv_prefix_streams_for(p, s->model->backend, &streams, err);
    if (rc) return rc;
    s->prefix = p;
    s->prefix_streams = streams;
    s->next_pos = p->n_orig;
    return PD_OK;
}

int32_t pd_seq_pos(const pd_seq *s) { return s->next_pos; }

int64_t pd_seq_stream_len(const pd_seq *s, int layer, int kv_head) {
    return s->streams[(int64_t)layer * s->model->hp.n_head_kv + kv_head].len;
}

uint64_t pd_seq_kv_bytes(const pd_seq *s) {
    const pd_hparams *hp = &s->model->hp;
    const uint64_t row = 2 * (uint64_t)hp->head_dim * kv_elem_size(s->model->kv_type) + sizeof(int32_t);
    uint64_t rows = 0;
    for (int64_t i = 0; i < (int64_t)hp->n_layer * hp->n_head_kv; i++) rows += (uint64_t)s->streams[i].len;
    return rows * row;
}

int pd_seq_to_prefix(const pd_seq *s, pd_kv_prefix **out, pd_error *err) {
    *out = NULL;
    if (s->prefix) return pd_errorf(err, PD_EINVAL, "a sequence that continues a prefix cannot be snapshotted as one");
    const pd_hparams *hp = &s->model->hp;
    pd_kv_prefix *p;
    int rc = pd_kv_prefix_create(hp, s->next_pos, s->model->kv_type, &p, err);
    if (rc) return rc;
    pd_backend *be = s->model->backend;
    const size_t row = (size_t)hp->head_dim * kv_elem_size(p->type);
    for (int l = 0; l < hp->n_layer && !rc; l++)
        for (int h = 0; h < hp->n_head_kv && !rc; h++) {
            const kv_stream *st = &s->streams[(int64_t)l * hp->n_head_kv + h];
            /* Copy the rows as they are (same type): the positions came
             * from the engine, so the checks of _set are not needed. */
            kv_stream *d = &p->streams[(int64_t)l * hp->n_head_kv + h];
            if ((rc = kv_stream_reserve(d, NULL, st->len, row, err))) break;
            if (st->len && ((rc = pd_backend_download(be, d->k, st->k, (size_t)st->len * row, err)) ||
                            (rc = pd_backend_download(be, d->v, st->v, (size_t)st->len * row, err))))
                break;
            if (st->len) memcpy(d->pos, st->pos, (size_t)st->len * sizeof *d->pos);
            d->len = st->len;
        }
    if (rc) {
        pd_kv_prefix_free(p);
        return rc;
    }
    *out = p;
    return PD_OK;
}

int pd_seq_reserve(pd_seq *s, int32_t n_tokens, pd_error *err) {
    const pd_hparams *hp = &s->model->hp;
    if (n_tokens < 0 || n_tokens > s->n_ctx)
        return pd_errorf(err, PD_ERANGE, "cannot reserve %d tokens in a context of %d", n_tokens, s->n_ctx);
    const size_t row = (size_t)hp->head_dim * kv_elem_size(s->model->kv_type);
    for (int64_t i = 0; i < (int64_t)hp->n_layer * hp->n_head_kv; i++) {
        kv_stream *st = &s->streams[i];
        int rc = kv_stream_reserve(st, s->model->backend, n_tokens, row, err);
        if (rc) return rc;
    }
    return PD_OK;
}

size_t pd_model_kv_token_bytes(const pd_model *m) {
    return (size_t)m->hp.n_layer * (size_t)m->hp.n_head_kv * 2 * (size_t)m->hp.head_dim * kv_elem_size(m->kv_type);
}

/* Every own stream holds positions [0, len) in order, unmasked: what a
 * plain prefill leaves and the only state blocks are exchanged with. */
static bool seq_streams_complete(const pd_seq *s) {
    const pd_hparams *hp = &s->model->hp;
    if (s->prefix) return false;
    for (int64_t i = 0; i < (int64_t)hp->n_layer * hp->n_head_kv; i++) {
        const kv_stream *st = &s->streams[i];
        /* positions are strictly increasing, so the ends decide */
        if (st->keep || st->len != s->next_pos || (st->len && (st->pos[0] != 0 || st->pos[st->len - 1] != st->len - 1)))
            return false;
    }
    return true;
}

int pd_seq_export_kv(const pd_seq *s, int32_t pos0, int32_t n, void *block, pd_error *err) {
    const pd_hparams *hp = &s->model->hp;
    if (pos0 < 0 || n < 1 || (int64_t)pos0 + n > s->next_pos)
        return pd_errorf(err, PD_EINVAL, "positions [%d, %lld) are not in a sequence of %d", pos0,
                         (long long)pos0 + n, s->next_pos);
    if (!seq_streams_complete(s))
        return pd_errorf(err, PD_EINVAL, "the sequence's cache is not every position in order (a prefix, a mask "
                                         "or evicted rows): it cannot be exported exactly");
    pd_backend *be = s->model->backend;
    const size_t row = (size_t)hp->head_dim * kv_elem_size(s->model->kv_type), part = row * (size_t)n;
    char *out = block;
    for (int64_t i = 0; i < (int64_t)hp->n_layer * hp->n_head_kv; i++) {
        const kv_stream *st = &s->streams[i];
        int rc;
        if ((rc = pd_backend_download(be, out, (const char *)st->k + (size_t)pos0 * row, part, err)) ||
            (rc = pd_backend_download(be, out + part, (const char *)st->v + (size_t)pos0 * row, part, err)))
            return rc;
        out += 2 * part;
    }
    return PD_OK;
}

int pd_seq_import_kv(pd_seq *s, const void *block, int32_t block_tokens, int32_t n, pd_error *err) {
    const pd_hparams *hp = &s->model->hp;
    if (n < 1 || n > block_tokens)
        return pd_errorf(err, PD_EINVAL, "cannot import %d positions of a block of %d", n, block_tokens);
    if ((int64_t)s->next_pos + n > s->n_ctx)
        return pd_errorf(err, PD_ERANGE, "%d more tokens do not fit after %d in a context of %d", n, s->next_pos,
                         s->n_ctx);
    if (!seq_streams_complete(s))
        return pd_errorf(err, PD_EINVAL, "rows can only be imported into a sequence holding every position in order");
    pd_backend *be = s->model->backend;
    const size_t row = (size_t)hp->head_dim * kv_elem_size(s->model->kv_type), part = row * (size_t)n,
                 pitch = row * (size_t)block_tokens; /* K rows then V rows of one stream in the block */
    const int32_t p0 = s->next_pos;
    const char *in = block;
    int32_t *pos = malloc(sizeof *pos * (size_t)n);
    if (!pos) return pd_errorf(err, PD_ENOMEM, "out of memory for %d positions", n);
    for (int32_t j = 0; j < n; j++) pos[j] = p0 + j;
    int rc = PD_OK;
    for (int64_t i = 0; i < (int64_t)hp->n_layer * hp->n_head_kv && !rc; i++) {
        kv_stream *st = &s->streams[i];
        if ((rc = kv_stream_reserve(st, be, st->len + n, row, err)) ||
            (rc = pd_backend_upload(be, (char *)st->k + (size_t)st->len * row, in, part, err)) ||
            (rc = pd_backend_upload(be, (char *)st->v + (size_t)st->len * row, in + pitch, part, err)) ||
            (st->dpos && (rc = pd_backend_upload(be, st->dpos + st->len, pos, sizeof *pos * (size_t)n, err))))
            break;
        memcpy(st->pos + st->len, pos, sizeof *pos * (size_t)n);
        st->len += n;
        in += 2 * pitch;
    }
    free(pos);
    if (rc) {
        /* streams that took the block already: back to the old length */
        for (int64_t i = 0; i < (int64_t)hp->n_layer * hp->n_head_kv; i++) s->streams[i].len = p0;
        return rc;
    }
    s->next_pos = p0 + n;
    return PD_OK;
}

int pd_seq_set_mask(pd_seq *s, int layer, int kv_head, const uint8_t *keep, int64_t len, pd_error *err) {
    const pd_hparams *hp = &s->model->hp;
    if (layer < 0 || layer >= hp->n_layer || kv_head < 0 || kv_head >= hp->n_head_kv)
        return pd_errorf(err, PD_EINVAL, "stream (layer %d, kv head %d) is out of range", layer, kv_head);
    kv_stream *st = &s->streams[(int64_t)layer * hp->n_head_kv + kv_head];
    if (!pd_backend_host_memory(s->model->backend))
        return pd_errorf(err, PD_EUNSUPPORTED, "attention masks are a host-backend feature (model.device = cpu)");
    if (!keep) {
        free(st->keep);
        st->keep = NULL;
        return PD_OK;
    }
    if (len != st->len)
        return pd_errorf(err, PD_EINVAL, "mask of %" PRId64 " entries for a stream of %" PRId64 " rows", len, st->len);
    if (!st->keep) {
        st->keep = malloc(st->cap ? (size_t)st->cap : 1);
        if (!st->keep) return pd_errorf(err, PD_ENOMEM, "out of memory for a KV mask");
        if (st->cap) memset(st->keep, 1, (size_t)st->cap);
    }
    if (len) memcpy(st->keep, keep, (size_t)len);
    return PD_OK;
}
