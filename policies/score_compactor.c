/* Compactor (Chari & Van Durme 2025, arXiv 2507.08143): approximate
 * statistical leverage of the pre-RoPE keys blended with non-causal chunked
 * attention, plus the two halves as policies of their own.
 *
 * Two profiles share this code and differ only in spec defaults, except
 * that kvpress scores the unprotected middle of the range alone (its
 * CompactorPress slices the sinks and the recent window off before
 * scoring) while the official implementation scores every token. */
#include <cblas.h>
#include <float.h>
#include <inttypes.h>
#include <lapacke.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "policies/scorers.h"

/* ---- building blocks -------------------------------------------------- */

/* Box-Muller in double: two uniforms with 53-bit mantissas give two
 * independent N(0, 1) draws, filled row-major into phi[d][sketch]. */
void pd_gaussian_sketch(uint64_t seed, int d, int sketch, float *phi) {
    if (d <= 0 || sketch <= 0) return;
    uint64_t state = seed;
    double sd = 1.0 / sqrt((double)sketch);
    size_t total = (size_t)d * (size_t)sketch;
    for (size_t i = 0; i < total; i += 2) {
        double u1 = (double)((pd_splitmix64(&state) >> 11) + 1) * 0x1p-53; /* (0, 1]: log is finite */
        double u2 = (double)(pd_splitmix64(&state) >> 11) * 0x1p-53;       /* [0, 1) */
        double r = sqrt(-2.0 * log(u1)), t = 2.0 * M_PI * u2;
        phi[i] = (float)(r * cos(t) * sd);
        if (i + 1 < total) phi[i + 1] = (float)(r * sin(t) * sd);
    }
}

void pd_zscore(float *x, int64_t n) {
    if (n <= 0) return;
    double mean = 0, var = 0;
    for (int64_t i = 0; i < n; i++) mean += x[i];
    mean /= (double)n;
    /* Two passes: the one-pass sum of squares cancels badly when the mean
     * is large next to the spread. */
    for (int64_t i = 0; i < n; i++) var += ((double)x[i] - mean) * ((double)x[i] - mean);
    double sd = sqrt(var / (double)n);
    if (sd < 1e-6) sd = 1e-6;
    for (int64_t i = 0; i < n; i++) x[i] = (float)(((double)x[i] - mean) / sd);
}

typedef struct ranked {
    float v;
    int64_t i;
} ranked;

/* A total order even with NaN (last), ties by index, so qsort is well
 * defined on any input. */
static int ranked_cmp(const void *pa, const void *pb) {
    const ranked *a = pa, *b = pb;
    bool na = isnan(a->v), nb = isnan(b->v);
    if (na != nb) return na ? 1 : -1;
    if (!na && a->v != b->v) return a->v < b->v ? -1 : 1;
    return (a->i > b->i) - (a->i < b->i);
}

/* Average ranks (1-based) of x into rank; tmp has n entries. */
static void average_ranks(const float *x, int64_t n, ranked *tmp, double *rank) {
    for (int64_t i = 0; i < n; i++) tmp[i] = (ranked){x[i], i};
    qsort(tmp, (size_t)n, sizeof *tmp, ranked_cmp);
    for (int64_t s = 0; s < n;) {
        int64_t e = s + 1;
        while (e < n && tmp[e].v == tmp[s].v) e++;
        double r = 0.5 * (double)(s + 1 + e); /* mean of ranks s+1 .. e */
        for (int64_t t = s; t < e; t++) rank[tmp[t].i] = r;
        s = e;
    }
}

/* Pearson correlation of the average ranks. 0 when either side is
 * constant or n < 2 (no order to compare); NaN if memory runs out. */
double pd_rank_correlation(const float *a, const float *b, int64_t n) {
    if (n < 2) return 0.0;
    ranked *tmp = malloc((size_t)n * sizeof *tmp);
    double *ra = malloc((size_t)n * sizeof *ra), *rb = malloc((size_t)n * sizeof *rb);
    double result = NAN;
    if (tmp && ra && rb) {
        average_ranks(a, n, tmp, ra);
        average_ranks(b, n, tmp, rb);
        double mean = 0.5 * (double)(n + 1), sab = 0, saa = 0, sbb = 0;
        for (int64_t i = 0; i < n; i++) {
            double da = ra[i] - mean, db = rb[i] - mean;
            sab += da * db;
            saa += da * da;
            sbb += db * db;
        }
        result = saa > 0 && sbb > 0 ? sab / sqrt(saa * sbb) : 0.0;
    }
    free(tmp);
    free(ra);
    free(rb);
    return result;
}

/* Tiles of the non-causal attention: small enough for the stack (16 KiB of
 * logits), so the column sums need no heap and cannot fail. Chunks of up
 * to NC_TILE_K keys (both profiles' defaults) take one pass. */
enum { NC_TILE_Q = 16, NC_TILE_K = 256 };

/* Adds sum over the rq rows of softmax(row) to col[0 .. rk): the whole
 * chunk's keys are in the tile, so each row is normalised in place. */
static void colsum_one_tile(float *logits, int rq, int rk, double *col) {
    for (int j = 0; j < rk; j++) col[j] = 0;
    for (int i = 0; i < rq; i++) {
        float *s = logits + i * NC_TILE_K;
        float mx = s[0];
        for (int j = 1; j < rk; j++) mx = s[j] > mx ? s[j] : mx;
        double sum = 0;
        for (int j = 0; j < rk; j++) sum += (s[j] = expf(s[j] - mx));
        double inv = 1.0 / sum;
        for (int j = 0; j < rk; j++) col[j] += s[j] * inv;
    }
}

/* Strides must fit in an int (BLAS leading dimensions); the scorer checks.
 * Chunks longer than a tile take two passes per query tile: the first
 * finds each row's max and softmax denominator online over key tiles, the
 * second recomputes the logits and adds the normalised weights. That costs
 * one more small GEMM and exp per entry but keeps memory O(tile) for any
 * chunk length. */
void pd_noncausal_colsum(const float *q, int64_t q_stride, int n_q, const float *k, int64_t k_stride, int64_t n,
                         int d, int64_t chunk, float scale, float *out) {
    if (n <= 0) return;
    memset(out, 0, (size_t)n * sizeof *out);
    if (d <= 0 || n_q <= 0) return;
    if (chunk <= 0 || chunk > n) chunk = n;
    if (scale == 0.0f) scale = (float)(1.0 / sqrt((double)d));
    float logits[NC_TILE_Q * NC_TILE_K];
    double row_max[NC_TILE_Q], row_inv[NC_TILE_Q], col[NC_TILE_K];
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
        int64_t m = n - c0 < chunk ? n - c0 : chunk;
        const float *kc = k + c0 * k_stride;
        for (int h = 0; h < n_q; h++)
            for (int64_t r0 = 0; r0 < m; r0 += NC_TILE_Q) {
                int rq = (int)(m - r0 < NC_TILE_Q ? m - r0 : NC_TILE_Q);
                const float *qt = q + (c0 + r0) * q_stride + (int64_t)h * d;
                if (m <= NC_TILE_K) {
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rq, (int)m, d, scale, qt, (int)q_stride, kc,
                                (int)k_stride, 0.0f, logits, NC_TILE_K);
                    colsum_one_tile(logits, rq, (int)m, col);
                    for (int64_t j = 0; j < m; j++) out[c0 + j] += (float)col[j];
                    continue;
                }
                for (int i = 0; i < rq; i++) {
                    row_max[i] = -INFINITY;
                    row_inv[i] = 0; /* running sum until the end of pass 1 */
                }
                for (int64_t k0 = 0; k0 < m; k0 += NC_TILE_K) {
                    int rk = (int)(m - k0 < NC_TILE_K ? m - k0 : NC_TILE_K);
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rq, rk, d, scale, qt, (int)q_stride,
                                kc + k0 * k_stride, (int)k_stride, 0.0f, logits, NC_TILE_K);
                    for (int i = 0; i < rq; i++) {
                        const float *s = logits + i * NC_TILE_K;
                        float mx = s[0];
                        for (int j = 1; j < rk; j++) mx = s[j] > mx ? s[j] : mx;
                        if (mx > row_max[i]) {
                            row_inv[i] *= exp(row_max[i] - mx); /* exp(-inf) = 0 on the first tile */
                            row_max[i] = mx;
                        }
                        float rm = (float)row_max[i];
                        double sum = 0;
                        for (int j = 0; j < rk; j++) sum += expf(s[j] - rm);
                        row_inv[i] += sum;
                    }
                }
                for (int i = 0; i < rq; i++) row_inv[i] = 1.0 / row_inv[i];
                for (int64_t k0 = 0; k0 < m; k0 += NC_TILE_K) {
                    int rk = (int)(m - k0 < NC_TILE_K ? m - k0 : NC_TILE_K);
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rq, rk, d, scale, qt, (int)q_stride,
                                kc + k0 * k_stride, (int)k_stride, 0.0f, logits, NC_TILE_K);
                    for (int j = 0; j < rk; j++) col[j] = 0;
                    for (int i = 0; i < rq; i++) {
                        const float *s = logits + i * NC_TILE_K;
                        float rm = (float)row_max[i];
                        for (int j = 0; j < rk; j++) col[j] += expf(s[j] - rm) * row_inv[i];
                    }
                    for (int j = 0; j < rk; j++) out[c0 + k0 + j] += (float)col[j];
                }
            }
    }
}

/* Rows are processed in blocks of this many when sketching, so the double
 * copy of the centred keys stays small however long the chunk is. */
enum { LEV_BLOCK = 256, LEV_MAX_TRIES = 5 };

/* Map a LAPACKE status to ours. */
static int lapack_status(lapack_int info, const char *what, pd_error *err) {
    if (info == LAPACK_WORK_MEMORY_ERROR || info == LAPACK_TRANSPOSE_MEMORY_ERROR)
        return pd_errorf(err, PD_ENOMEM, "out of memory in LAPACK %s", what);
    return pd_errorf(err, PD_EINVAL, "LAPACK %s rejected argument %d (internal error)", what, (int)-info);
}

/* Column means of m rows in double. A sum of floats cannot overflow a
 * double, so a non-finite mean means a non-finite key: refuse it here,
 * before LAPACK (whose factorisations need not notice NaN). */
static int column_means(const float *rows, int64_t m, int d, int64_t stride, double *mean, pd_error *err) {
    for (int j = 0; j < d; j++) mean[j] = 0;
    for (int64_t i = 0; i < m; i++)
        for (int j = 0; j < d; j++) mean[j] += rows[i * stride + j];
    for (int j = 0; j < d; j++) {
        if (!isfinite(mean[j]))
            return pd_errorf(err, PD_ERANGE, "leverage: dimension %d of the keys holds inf or NaN", j);
        mean[j] /= (double)m;
    }
    return PD_OK;
}

typedef struct lev_work {
    double *mean;  /* [d] */
    double *block; /* approx: [LEV_BLOCK][d]; exact: [chunk][d] */
    double *phi;   /* [d][sketch] */
    double *x;     /* [chunk][sketch] */
    double *g;     /* [sketch][sketch] */
    double *tau;   /* exact: [min(chunk, d)] */
    lapack_int *jpvt; /* exact: [d] */
} lev_work;

/* One chunk, approx: X = centred rows * phi, G = X^T X + ridge I = L L^T,
 * l_i = ||L^-1 x_i||^2 (one triangular solve for all rows). */
static int leverage_chunk_approx(const float *rows, int64_t m, int d, int64_t stride, int sketch, double ridge,
                                 lev_work *w, float *out, pd_error *err) {
    int rc = column_means(rows, m, d, stride, w->mean, err);
    if (rc) return rc;
    for (int64_t b0 = 0; b0 < m; b0 += LEV_BLOCK) {
        int64_t bm = m - b0 < LEV_BLOCK ? m - b0 : LEV_BLOCK;
        for (int64_t i = 0; i < bm; i++)
            for (int j = 0; j < d; j++) w->block[i * d + j] = (double)rows[(b0 + i) * stride + j] - w->mean[j];
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)bm, sketch, d, 1.0, w->block, d, w->phi, sketch,
                    0.0, w->x + b0 * sketch, sketch);
    }
    double cur = ridge;
    lapack_int info = 1;
    for (int t = 0; t < LEV_MAX_TRIES && info != 0; t++) {
        if (t > 0) cur = cur > 0 ? 10.0 * cur : 1e-2; /* kvpress starts a zero jitter at 1e-2 */
        cblas_dsyrk(CblasRowMajor, CblasLower, CblasTrans, sketch, (int)m, 1.0, w->x, sketch, 0.0, w->g, sketch);
        for (int j = 0; j < sketch; j++) w->g[(int64_t)j * sketch + j] += cur;
        info = LAPACKE_dpotrf(LAPACK_ROW_MAJOR, 'L', sketch, w->g, sketch);
        if (info < 0) return lapack_status(info, "dpotrf", err);
    }
    if (info != 0)
        return pd_errorf(err, PD_ERANGE,
                         "leverage: Cholesky of the sketched Gram matrix failed %d times (last ridge %g); the keys "
                         "are degenerate at this scale, raise ridge",
                         LEV_MAX_TRIES, cur);
    cblas_dtrsm(CblasRowMajor, CblasRight, CblasLower, CblasTrans, CblasNonUnit, (int)m, sketch, 1.0, w->g, sketch,
                w->x, sketch);
    for (int64_t i = 0; i < m; i++) {
        double l = 0;
        for (int j = 0; j < sketch; j++) l += w->x[i * sketch + j] * w->x[i * sketch + j];
        out[i] = (float)(l < 0 ? 0 : l); /* a NaN stays NaN for the caller's check */
    }
    return PD_OK;
}

/* One chunk, exact: column-pivoted QR of the centred rows, so a rank r
 * below d is detected and the leverage is the diagonal of the projection
 * onto the rows' true column space (squared row norms of Q[:, :r]). */
static int leverage_chunk_exact(const float *rows, int64_t m, int d, int64_t stride, lev_work *w, float *out,
                                pd_error *err) {
    int rc = column_means(rows, m, d, stride, w->mean, err);
    if (rc) return rc;
    for (int64_t i = 0; i < m; i++)
        for (int j = 0; j < d; j++) w->block[i * d + j] = (double)rows[i * stride + j] - w->mean[j];
    for (int j = 0; j < d; j++) w->jpvt[j] = 0; /* every column free to pivot */
    lapack_int info = LAPACKE_dgeqp3(LAPACK_ROW_MAJOR, (lapack_int)m, d, w->block, d, w->jpvt, w->tau);
    if (info) return lapack_status(info, "dgeqp3", err);
    int64_t kmax = m < d ? m : d;
    /* numpy's matrix_rank cut for float32 data, |R_ii| against
     * max(m, d) * FLT_EPSILON * |R_00| (pivoting sorts |R_ii| decreasingly):
     * the keys are floats, so weaker directions are their rounding noise,
     * and counting them would make noise the most "unusual" direction. */
    double tol = (double)(m > d ? m : d) * FLT_EPSILON * fabs(w->block[0]);
    int64_t r = 0;
    while (r < kmax && fabs(w->block[r * d + r]) > tol) r++;
    if (r == 0) {
        /* All rows equal: nothing stands out. */
        for (int64_t i = 0; i < m; i++) out[i] = 0;
        return PD_OK;
    }
    info = LAPACKE_dorgqr(LAPACK_ROW_MAJOR, (lapack_int)m, (lapack_int)r, (lapack_int)r, w->block, d, w->tau);
    if (info) return lapack_status(info, "dorgqr", err);
    for (int64_t i = 0; i < m; i++) {
        double l = 0;
        for (int64_t j = 0; j < r; j++) l += w->block[i * d + j] * w->block[i * d + j];
        out[i] = (float)l;
    }
    return PD_OK;
}

static void lev_work_free(lev_work *w) {
    free(w->mean);
    free(w->block);
    free(w->phi);
    free(w->x);
    free(w->g);
    free(w->tau);
    free(w->jpvt);
}

/* a * b elements of `size` bytes, NULL on overflow or OOM (callers say
 * what they were allocating). */
static void *alloc_array(uint64_t a, uint64_t b, size_t size) {
    uint64_t n;
    if (!pd_mul_ok(a, b, &n) || n > INT64_MAX) return NULL;
    return pd_scorer_alloc((int64_t)n, size, NULL, NULL);
}

int pd_leverage_scores(const float *rows, int64_t n, int d, int64_t stride, const float *phi, int sketch,
                       int64_t chunk, double ridge, pd_leverage_mode mode, float *out, pd_error *err) {
    if (n < 0 || d <= 0 || stride < d || chunk < 0)
        return pd_errorf(err, PD_EINVAL,
                         "leverage: %" PRId64 " rows of dimension %d with stride %" PRId64 " and chunk %" PRId64
                         "; need rows >= 0, dimension > 0, stride >= dimension, chunk >= 0",
                         n, d, stride, chunk);
    if (mode != PD_LEVERAGE_APPROX && mode != PD_LEVERAGE_EXACT)
        return pd_errorf(err, PD_EINVAL, "leverage: mode %d is neither approx (0) nor exact (1)", (int)mode);
    if (mode == PD_LEVERAGE_APPROX && (!phi || sketch <= 0 || !(ridge >= 0) || !isfinite(ridge)))
        return pd_errorf(err, PD_EINVAL,
                         "leverage approx: needs a sketch matrix, sketch width > 0 (got %d) and a finite ridge >= 0 "
                         "(got %g)",
                         sketch, ridge);
    if (n == 0) return PD_OK;
    int64_t len = chunk > 0 && chunk < n ? chunk : n;
    /* BLAS and LAPACK take int dimensions, and LAPACKE's row-major copies
     * size their buffers in int: keep rows x width below INT_MAX. */
    int64_t max_rows = INT_MAX / (mode == PD_LEVERAGE_APPROX && sketch > d ? sketch : d);
    if (len > max_rows || stride > INT_MAX)
        return pd_errorf(err, PD_ERANGE,
                         "leverage: a chunk of %" PRId64 " rows of dimension %d is too large for BLAS; set lev_chunk "
                         "to at most %" PRId64,
                         len, d, max_rows);
    lev_work w = {0};
    int rc = PD_OK;
    w.mean = alloc_array((uint64_t)d, 1, sizeof *w.mean);
    if (mode == PD_LEVERAGE_APPROX) {
        w.block = alloc_array(LEV_BLOCK, (uint64_t)d, sizeof *w.block);
        w.phi = alloc_array((uint64_t)d, (uint64_t)sketch, sizeof *w.phi);
        w.x = alloc_array((uint64_t)len, (uint64_t)sketch, sizeof *w.x);
        w.g = alloc_array((uint64_t)sketch, (uint64_t)sketch, sizeof *w.g);
        if (!w.mean || !w.block || !w.phi || !w.x || !w.g) goto oom;
        for (int64_t i = 0; i < (int64_t)d * sketch; i++) w.phi[i] = phi[i];
    } else {
        w.block = alloc_array((uint64_t)len, (uint64_t)d, sizeof *w.block);
        w.tau = alloc_array((uint64_t)(len < d ? len : d), 1, sizeof *w.tau);
        w.jpvt = alloc_array((uint64_t)d, 1, sizeof *w.jpvt);
        if (!w.mean || !w.block || !w.tau || !w.jpvt) goto oom;
    }
    for (int64_t c0 = 0; c0 < n && rc == PD_OK; c0 += len) {
        int64_t m = n - c0 < len ? n - c0 : len;
        rc = mode == PD_LEVERAGE_APPROX
                 ? leverage_chunk_approx(rows + c0 * stride, m, d, stride, sketch, ridge, &w, out + c0, err)
                 : leverage_chunk_exact(rows + c0 * stride, m, d, stride, &w, out + c0, err);
        for (int64_t i = 0; i < m && rc == PD_OK; i++)
            if (!isfinite(out[c0 + i]))
                rc = pd_errorf(err, PD_ERANGE, "leverage: non-finite score at row %" PRId64 "; the keys hold inf or NaN",
                               c0 + i);
        if (rc && rc != PD_ENOMEM)
            pd_error_prefix(err, "rows [%" PRId64 ", %" PRId64 ")", c0, c0 + m);
    }
    lev_work_free(&w);
    return rc;
oom:
    lev_work_free(&w);
    return pd_errorf(err, PD_ENOMEM, "out of memory for leverage scores of %" PRId64 " rows x %d", len, d);
}

/* ---- the scorers ------------------------------------------------------- */

/* The spec fields the Compactor family reads, checked here as well as in
 * pd_policy_spec_validate because specs can be filled by hand. */
static int check_spec(const pd_policy_spec *spec, bool lev, bool attn, pd_error *err) {
    if (lev && spec->leverage == PD_LEVERAGE_APPROX && (spec->sketch <= 0 || spec->sketch > 4096))
        return pd_errorf(err, PD_EINVAL, "sketch=%d is out of range; use 1..4096 (default 48)", spec->sketch);
    if (lev && spec->leverage != PD_LEVERAGE_APPROX && spec->leverage != PD_LEVERAGE_EXACT)
        return pd_errorf(err, PD_EINVAL, "leverage mode %d is unknown; use approx or exact", (int)spec->leverage);
    if (lev && (!(spec->ridge >= 0) || !isfinite(spec->ridge)))
        return pd_errorf(err, PD_EINVAL, "ridge=%g must be finite and >= 0", spec->ridge);
    if (lev && spec->lev_chunk < 0)
        return pd_errorf(err, PD_EINVAL, "lev_chunk=%d must be >= 0 (0 = whole range)", spec->lev_chunk);
    if (attn && spec->attn_chunk <= 0)
        return pd_errorf(err, PD_EINVAL, "attn_chunk=%d must be > 0", spec->attn_chunk);
    if (attn && (!(spec->scale >= 0) || !isfinite(spec->scale)))
        return pd_errorf(err, PD_EINVAL, "scale=%g must be finite and >= 0 (0 = 1/sqrt(head_dim))", spec->scale);
    if (attn && (spec->pool < 1 || spec->pool % 2 == 0))
        return pd_errorf(err, PD_EINVAL, "pool=%d must be an odd width >= 1 (1 = none)", spec->pool);
    if (lev && attn && !isfinite(spec->lambda))
        return pd_errorf(err, PD_EINVAL, "lambda=%g must be finite (< 0 = auto)", spec->lambda);
    if (lev && attn && spec->lambda < 0 && !(spec->retention > 0 && spec->retention <= 1))
        return pd_errorf(err, PD_EINVAL, "lambda=auto needs retention in (0, 1], got %g", spec->retention);
    return PD_OK;
}

/* ---- the backend path --------------------------------------------------- */

/* Which halves the backend can score for this layer: it has
 * token_scores, the arrays it reads are in its memory, and leverage is
 * approx (exact leverage, a pivoted QR, stays on the host). */
static bool on_backend(const pd_policy_spec *spec, const pd_layer_kv *kv, bool lev, bool attn) {
    const pd_backend *be = kv->backend;
    if (!be || !pd_backend_has_token_scores(be)) return false;
    if (lev && (spec->leverage != PD_LEVERAGE_APPROX || !kv->dev_k_pre_rope)) return false;
    if (attn && (!kv->dev_q || !kv->dev_k || (spec->vnorm && !kv->dev_v))) return false;
    return true;
}

bool pd_scorer_runs_on_backend(const pd_policy_spec *spec, const pd_backend *be) {
    if (!spec || !be || !pd_backend_has_token_scores(be)) return false;
    switch (spec->scorer) {
    case PD_POLICY_COMPACTOR:
    case PD_POLICY_LEVERAGE: return spec->leverage == PD_LEVERAGE_APPROX;
    case PD_POLICY_NONCAUSAL: return true;
    default: return false;
    }
}

/* The backend's message ("kv head 1: rows [...): ...") gets its layer. */
static void prefix_layer(pd_error *err, int layer) {
    if (err) pd_error_prefix(err, "layer %d", layer);
}

/* Scores of tokens [a, b) on the backend, [n_head_kv][b - a] into out (host):
 * z(lev) alone, z(att) alone, or z(att) + lambda z(lev) when both, with the
 * same sketch, chunks and lambda as the host path. */
static int backend_scores(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t a, int64_t b, bool lev,
                          bool attn, float *out, pd_error *err) {
    int64_t d = kv->head_dim;
    float *phi = NULL;
    if (lev) {
        phi = alloc_array((uint64_t)d, (uint64_t)spec->sketch, sizeof *phi);
        if (!phi) return pd_errorf(err, PD_ENOMEM, "out of memory for a %" PRId64 " x %d sketch", d, spec->sketch);
        pd_gaussian_sketch(spec->seed, (int)d, spec->sketch, phi);
    }
    pd_token_score_args args = {
        .q = kv->dev_q,
        .k = kv->dev_k,
        .k_pre = kv->dev_k_pre_rope,
        .v = spec->vnorm ? kv->dev_v : NULL,
        .n_tokens = kv->n_tokens,
        .n_head = kv->n_head,
        .n_head_kv = kv->n_head_kv,
        .head_dim = kv->head_dim,
        .lo = a,
        .hi = b,
        .use_leverage = lev,
        .phi = phi,
        .sketch = spec->sketch,
        .lev_chunk = spec->lev_chunk,
        .ridge = spec->ridge,
        .use_attention = attn,
        .attn_chunk = spec->attn_chunk,
        .scale = (float)spec->scale,
        .vnorm = spec->vnorm,
        .pool = spec->pool,
        .lambda = lev && attn ? (spec->lambda < 0 ? 1.0 - spec->retention : spec->lambda) : 0.0,
        .scores = out,
    };
    int rc = pd_backend_token_scores(kv->backend, &args, err);
    free(phi);
    if (rc) prefix_layer(err, kv->layer);
    return rc;
}

/* The host path reads the host arrays, which a device-only prefill leaves
 * NULL. */
static int need_host(const pd_layer_kv *kv, const float *array, const char *what, pd_error *err) {
    if (array) return PD_OK;
    return pd_errorf(err, PD_EINVAL,
                     "layer %d: the %s are only in backend memory, but this scorer setting runs on the host (exact "
                     "leverage, or a backend without Compactor scoring); prefill without hook_device_only",
                     kv->layer, what);
}

/* ---- the host path ------------------------------------------------------ */

/* z-scored leverage of the pre-RoPE keys of tokens [a, b), [n_head_kv][b - a]. */
static int layer_leverage(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t a, int64_t b, float *lev,
                          pd_error *err) {
    if (on_backend(spec, kv, true, false)) return backend_scores(spec, kv, a, b, true, false, lev, err);
    int rc = need_host(kv, kv->k_pre_rope, "pre-RoPE keys", err);
    if (rc) return rc;
    int64_t m = b - a, d = kv->head_dim, stride = (int64_t)kv->n_head_kv * d;
    float *phi = NULL;
    if (spec->leverage == PD_LEVERAGE_APPROX) {
        /* One sketch for every layer and head: it only has to preserve the
         * keys' geometry, and a fixed one makes the scores a pure function
         * of (spec, keys). */
        phi = alloc_array((uint64_t)d, (uint64_t)spec->sketch, sizeof *phi);
        if (!phi) return pd_errorf(err, PD_ENOMEM, "out of memory for a %" PRId64 " x %d sketch", d, spec->sketch);
        pd_gaussian_sketch(spec->seed, (int)d, spec->sketch, phi);
    }
    for (int h = 0; h < kv->n_head_kv && rc == PD_OK; h++) {
        rc = pd_leverage_scores(kv->k_pre_rope + a * stride + h * d, m, (int)d, stride, phi, spec->sketch,
                                spec->lev_chunk, spec->ridge, spec->leverage, lev + h * m, err);
        if (rc) pd_error_prefix(err, "layer %d, kv head %d", kv->layer, h);
    }
    free(phi);
    if (rc == PD_OK) pd_zscore(lev, (int64_t)kv->n_head_kv * m);
    return rc;
}

/* z-scored non-causal attention received by the keys of tokens [a, b) from
 * the queries of [a, b), optionally times ||v|| and average-pooled. The
 * official code sums over the group's query heads, kvpress averages: a
 * common factor that the z-score removes. */
static int layer_attention(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t a, int64_t b, float *att,
                           pd_error *err) {
    if (on_backend(spec, kv, false, true)) return backend_scores(spec, kv, a, b, false, true, att, err);
    int rc = need_host(kv, kv->q, "queries", err);
    if (rc == PD_OK) rc = need_host(kv, kv->k, "keys", err);
    if (rc == PD_OK && spec->vnorm) rc = need_host(kv, kv->v, "values", err);
    if (rc) return rc;
    int64_t m = b - a, d = kv->head_dim, kstride = (int64_t)kv->n_head_kv * d, qstride = (int64_t)kv->n_head * d;
    int g = kv->n_head / kv->n_head_kv;
    if (qstride > INT_MAX || kstride > INT_MAX)
        return pd_errorf(err, PD_ERANGE, "layer %d: query rows of %" PRId64 " floats are too wide for BLAS",
                         kv->layer, qstride);
    float *tmp = NULL;
    if (spec->pool > 1) {
        tmp = alloc_array((uint64_t)m, 1, sizeof *tmp);
        if (!tmp) return pd_errorf(err, PD_ENOMEM, "out of memory pooling %" PRId64 " attention scores", m);
    }
    for (int h = 0; h < kv->n_head_kv; h++) {
        float *s = att + h * m;
        pd_noncausal_colsum(kv->q + a * qstride + (int64_t)h * g * d, qstride, g, kv->k + a * kstride + h * d, kstride,
                            m, (int)d, spec->attn_chunk, (float)spec->scale, s);
        if (spec->vnorm)
            for (int64_t i = 0; i < m; i++) {
                const float *v = kv->v + (a + i) * kstride + h * d;
                double sq = 0;
                for (int64_t j = 0; j < d; j++) sq += (double)v[j] * v[j];
                s[i] = (float)(s[i] * sqrt(sq));
            }
        if (tmp) {
            pd_avg_pool(s, m, spec->pool, tmp);
            memcpy(s, tmp, (size_t)m * sizeof *s);
        }
    }
    free(tmp);
    pd_zscore(att, (int64_t)kv->n_head_kv * m);
    return PD_OK;
}

int pd_score_compactor(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                       pd_error *err) {
    int rc = check_spec(spec, true, true, err);
    if (rc) return rc;
    int64_t n = hi - lo, H = kv->n_head_kv;
    int64_t a = lo, b = hi;
    if (spec->profile == PD_PROFILE_KVPRESS) {
        /* kvpress scores only what its sinks (start) and window (end) do
         * not protect, so those tokens do not shift the z-scores. */
        int64_t s = spec->sink > 0 ? (spec->sink < n ? spec->sink : n) : 0;
        int64_t r = spec->recent > 0 ? (spec->recent < n - s ? spec->recent : n - s) : 0;
        a = lo + s;
        b = hi - r;
    }
    int64_t m = b - a;
    double top = 0;
    if (m > 0) {
        /* On the backend both halves and the blend come back in one array
         * (att below); on the host they are blended here. */
        bool backend = on_backend(spec, kv, true, true);
        float *lev = backend ? NULL : alloc_array((uint64_t)H, (uint64_t)m, sizeof *lev);
        float *att = alloc_array((uint64_t)H, (uint64_t)m, sizeof *att);
        if ((!backend && !lev) || !att) {
            free(lev);
            free(att);
            return pd_errorf(err, PD_ENOMEM, "out of memory for Compactor scores of %" PRId64 " tokens", m);
        }
        if (backend) {
            rc = backend_scores(spec, kv, a, b, true, true, att, err);
        } else {
            rc = layer_leverage(spec, kv, a, b, lev, err);
            if (rc == PD_OK) rc = layer_attention(spec, kv, a, b, att, err);
        }
        if (rc == PD_OK) {
            double lambda = spec->lambda < 0 ? 1.0 - spec->retention : spec->lambda;
            top = -INFINITY;
            for (int64_t h = 0; h < H; h++)
                for (int64_t i = 0; i < m; i++) {
                    float v = backend ? att[h * m + i] : (float)((double)att[h * m + i] + lambda * lev[h * m + i]);
                    scores[h * n + (a - lo) + i] = v;
                    top = v > top ? v : top;
                }
        }
        free(lev);
        free(att);
        if (rc) return rc;
    }
    /* kvpress pads the protected tokens with max + 1 so that any selection
     * keeps them; the selection here protects them anyway. */
    for (int64_t h = 0; h < H; h++) {
        for (int64_t i = lo; i < a; i++) scores[h * n + (i - lo)] = (float)(top + 1);
        for (int64_t i = b; i < hi; i++) scores[h * n + (i - lo)] = (float)(top + 1);
    }
    return PD_OK;
}

int pd_score_leverage(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                      pd_error *err) {
    int rc = check_spec(spec, true, false, err);
    return rc ? rc : layer_leverage(spec, kv, lo, hi, scores, err);
}

int pd_score_noncausal(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                       pd_error *err) {
    int rc = check_spec(spec, false, true, err);
    return rc ? rc : layer_attention(spec, kv, lo, hi, scores, err);
}
