/* The pd_backend_* functions: thin calls through the backend's ops table
 * (kernels/backend_impl.h), with the optional ops' defaults. */
#include <stdlib.h>
#include <string.h>

#include "kernels/backend_impl.h"

void pd_backend_free(pd_backend *be) {
    if (be) be->ops->free(be);
}

const char *pd_backend_name(const pd_backend *be) { return be->ops->name; }

bool pd_backend_host_memory(const pd_backend *be) { return be->ops->host_memory; }

void *pd_backend_alloc(pd_backend *be, size_t bytes, pd_error *err) {
    return be->ops->alloc(be, bytes, err);
}

void pd_backend_release(pd_backend *be, void *p) {
    be->ops->release(be, p);
}

int pd_backend_upload(pd_backend *be, void *dst, const void *src, size_t bytes, pd_error *err) {
    return be->ops->upload(be, dst, src, bytes, err);
}

/* Host time blocked in a waiting call, for pd_backend_timer. */
static void note_wait(pd_backend *be, double t0) {
    be->waited_s += pd_now_seconds() - t0;
    if (be->first_wait_at == 0) be->first_wait_at = t0;
}

int pd_backend_download(pd_backend *be, void *dst, const void *src, size_t bytes, pd_error *err) {
    const double t0 = pd_now_seconds();
    const int rc = be->ops->download(be, dst, src, bytes, err);
    note_wait(be, t0);
    return rc;
}

int pd_backend_copy(pd_backend *be, void *dst, const void *src, size_t bytes, pd_error *err) {
    return be->ops->copy(be, dst, src, bytes, err);
}

int pd_backend_copy2d(pd_backend *be, void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t width, size_t rows, pd_error *err) {
    return be->ops->copy2d(be, dst, dst_pitch, src, src_pitch, width, rows, err);
}

int pd_backend_copy2d_batch(pd_backend *be, const pd_copy2d *descs, int64_t n, pd_error *err) {
    return be->ops->copy2d_batch(be, descs, n, err);
}

int pd_backend_convert(pd_backend *be, void *dst, pd_type dst_type, const void *src, pd_type src_type, int64_t n, pd_error *err) {
    return be->ops->convert(be, dst, dst_type, src, src_type, n, err);
}

int pd_backend_gather(pd_backend *be, void *dst, const void *src, const int32_t *idx, int64_t n, size_t row_bytes, pd_error *err) {
    return be->ops->gather(be, dst, src, idx, n, row_bytes, err);
}

int pd_backend_sync(pd_backend *be, pd_error *err) {
    const double t0 = pd_now_seconds();
    const int rc = be->ops->sync(be, err);
    note_wait(be, t0);
    return rc;
}

int pd_backend_prepare_weight(pd_backend *be, const pd_weight *w, pd_error *err) {
    return be->ops->prepare_weight ? be->ops->prepare_weight(be, w, err) : PD_OK;
}

void pd_backend_forget_weight(pd_backend *be, const pd_weight *w) {
    if (be->ops->forget_weight) be->ops->forget_weight(be, w);
}

int pd_backend_pack_weight(pd_backend *be, pd_weight *w, void *data, pd_error *err) {
    if (!w || !data || data != w->data)
        return pd_errorf(err, PD_EINVAL, "pack_weight: data is not the weight's bytes (or NULL)");
    return be->ops->pack_weight && w->layout == PD_LAYOUT_GGUF ? be->ops->pack_weight(be, w, data, err) : PD_OK;
}

int pd_backend_matmul(pd_backend *be, const pd_weight *w, const float *x, int64_t n, float *y, pd_error *err) {
    return be->ops->matmul(be, w, x, n, y, err);
}

int pd_backend_get_rows(pd_backend *be, const pd_weight *w, const int32_t *ids, int64_t n, float *out, pd_error *err) {
    return be->ops->get_rows(be, w, ids, n, out, err);
}

int pd_backend_rmsnorm(pd_backend *be, const float *x, const float *weight, int64_t n, int64_t dim, float eps, float *out, pd_error *err) {
    return be->ops->rmsnorm(be, x, weight, n, dim, eps, out, err);
}

int pd_backend_rope(pd_backend *be, float *x, const int32_t *pos, int64_t n, int n_heads, int head_dim, const pd_rope_params *p, pd_error *err) {
    return be->ops->rope(be, x, pos, n, n_heads, head_dim, p, err);
}

int pd_backend_swiglu(pd_backend *be, const float *gate, const float *up, int64_t n, float *out, pd_error *err) {
    return be->ops->swiglu(be, gate, up, n, out, err);
}

int pd_backend_geglu(pd_backend *be, const float *gate, const float *up, int64_t n, float *out, pd_error *err) {
    return be->ops->geglu(be, gate, up, n, out, err);
}

int pd_backend_softcap(pd_backend *be, float *x, int64_t n, float cap, pd_error *err) {
    return be->ops->softcap(be, x, n, cap, err);
}

int pd_backend_scale(pd_backend *be, float *x, int64_t n, float s, pd_error *err) {
    return be->ops->scale(be, x, n, s, err);
}

int pd_backend_add(pd_backend *be, float *y, const float *x, int64_t rows, int64_t width, int64_t x_stride, pd_error *err) {
    return be->ops->add(be, y, x, rows, width, x_stride, err);
}

int pd_backend_add_rmsnorm(pd_backend *be, float *x, const float *h, const float *weight, int64_t n, int64_t dim,
                           float eps, float *out, pd_error *err) {
    return be->ops->add_rmsnorm(be, x, h, weight, n, dim, eps, out, err);
}

int pd_backend_matmul_multi(pd_backend *be, const pd_weight *const *w, int n_w, const float *x, int64_t n,
                            float *const *y, pd_error *err) {
    if (n_w < 1 || n_w > PD_MATMUL_MULTI_MAX)
        return pd_errorf(err, PD_EINVAL, "matmul_multi: %d weights, 1 to %d supported", n_w, PD_MATMUL_MULTI_MAX);
    for (int j = 0; j < n_w; j++)
        if (!w[j] || !y[j]) return pd_errorf(err, PD_EINVAL, "matmul_multi: NULL weight or output %d", j);
    return be->ops->matmul_multi(be, w, n_w, x, n, y, err);
}

int pd_backend_matmul_glu(pd_backend *be, const pd_weight *w_gate, const pd_weight *w_up, const float *x, int64_t n,
                          pd_glu act, float *out, float *up, pd_error *err) {
    if (!w_gate || !w_up) return pd_errorf(err, PD_EINVAL, "matmul_glu: NULL weight");
    if (w_gate->rows != w_up->rows || w_gate->cols != w_up->cols)
        return pd_errorf(err, PD_EINVAL, "matmul_glu: gate %lld x %lld and up %lld x %lld differ in shape",
                         (long long)w_gate->rows, (long long)w_gate->cols, (long long)w_up->rows, (long long)w_up->cols);
    return be->ops->matmul_glu(be, w_gate, w_up, x, n, act, out, up, err);
}

int pd_backend_qkv_bias_rope(pd_backend *be, const pd_qkv_args *a, pd_error *err) {
    return be->ops->qkv_bias_rope(be, a, err);
}

int pd_backend_attention(pd_backend *be, const pd_attn_args *a, pd_error *err) {
    return be->ops->attention(be, a, err);
}

int pd_backend_token_scores(pd_backend *be, const pd_token_score_args *a, pd_error *err) {
    if (!be->ops->token_scores) return pd_errorf(err, PD_EUNSUPPORTED, "backend %s has no token_scores op", be->ops->name);
    return be->ops->token_scores(be, a, err);
}

bool pd_backend_caches_weights(const pd_backend *be) { return be->ops->prepare_weight != NULL; }

bool pd_backend_has_token_scores(const pd_backend *be) { return be->ops->token_scores != NULL; }

int pd_backend_graph_begin(pd_backend *be, int bucket, pd_error *err) {
    if (!be->ops->graph_begin) return pd_errorf(err, PD_EUNSUPPORTED, "backend %s has no graphs", be->ops->name);
    return be->ops->graph_begin(be, bucket, err);
}

int pd_backend_graph_end(pd_backend *be, bool launch, pd_error *err) {
    if (!be->ops->graph_end) return pd_errorf(err, PD_EINVAL, "backend %s has no graphs to end", be->ops->name);
    return be->ops->graph_end(be, launch, err);
}

void pd_backend_counters_get(const pd_backend *be, pd_backend_counters *out) {
    memset(out, 0, sizeof *out);
    if (be->ops->counters) be->ops->counters(be, out);
}

void *pd_backend_host_alloc(pd_backend *be, size_t bytes, pd_error *err) {
    if (be->ops->host_alloc) return be->ops->host_alloc(be, bytes, err);
    void *p = malloc(bytes ? bytes : 1);
    if (!p) pd_errorf(err, PD_ENOMEM, "out of memory for %zu bytes of host buffers", bytes);
    return p;
}

void pd_backend_host_free(pd_backend *be, void *p) {
    if (be->ops->host_free) be->ops->host_free(be, p);
    else free(p);
}

int pd_backend_memory(pd_backend *be, uint64_t *free_bytes, uint64_t *total_bytes, pd_error *err) {
    if (!be->ops->memory)
        return pd_errorf(err, PD_EUNSUPPORTED, "backend %s does not report its free memory", be->ops->name);
    return be->ops->memory(be, free_bytes, total_bytes, err);
}

/* ---- pd_backend_timer: device marks where the backend has them, host
 * wall time otherwise ---- */
struct pd_backend_timer {
    pd_backend *be;
    void *marks; /* the backend's (timer ops), or NULL */
    double t_start, t_stop, waited_at_start;
    double enqueue_s, wait_s;
    bool started, stopped;
};

int pd_backend_timer_create(pd_backend *be, pd_backend_timer **out, pd_error *err) {
    pd_backend_timer *t = calloc(1, sizeof *t);
    if (!t) return pd_errorf(err, PD_ENOMEM, "out of memory for a backend timer");
    t->be = be;
    if (be->ops->timer && !(t->marks = be->ops->timer->create(be, err))) {
        free(t);
        return pd_error_prefix(err, "backend timer on %s", be->ops->name);
    }
    *out = t;
    return PD_OK;
}

void pd_backend_timer_free(pd_backend_timer *t) {
    if (!t) return;
    if (t->marks) t->be->ops->timer->destroy(t->be, t->marks);
    free(t);
}

int pd_backend_timer_start(pd_backend_timer *t, pd_error *err) {
    pd_backend *be = t->be;
    t->started = t->stopped = false;
    if (t->marks) {
        const int rc = be->ops->timer->record(be, t->marks, 0, err);
        if (rc) return rc;
    }
    be->first_wait_at = 0;
    t->waited_at_start = be->waited_s;
    t->t_start = pd_now_seconds();
    t->started = true;
    return PD_OK;
}

int pd_backend_timer_stop(pd_backend_timer *t, pd_error *err) {
    pd_backend *be = t->be;
    if (!t->started) return pd_errorf(err, PD_EINVAL, "backend timer stopped before it was started");
    t->t_stop = pd_now_seconds();
    t->enqueue_s = (be->first_wait_at > 0 ? be->first_wait_at : t->t_stop) - t->t_start;
    t->wait_s = be->waited_s - t->waited_at_start;
    if (t->marks) {
        const int rc = be->ops->timer->record(be, t->marks, 1, err);
        if (rc) return rc;
    }
    t->stopped = true;
    return PD_OK;
}

int pd_backend_timer_read(pd_backend_timer *t, pd_backend_timing *out, pd_error *err) {
    if (!t->stopped) return pd_errorf(err, PD_EINVAL, "backend timer read before it was started and stopped");
    out->wall_s = t->t_stop - t->t_start;
    out->enqueue_s = t->enqueue_s;
    out->wait_s = t->wait_s;
    out->device_s = out->wall_s;
    if (t->marks) return t->be->ops->timer->elapsed(t->be, t->marks, &out->device_s, err);
    return PD_OK;
}
