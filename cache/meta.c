/* What the store's files share below the record format: LMDB failures
 * mapped to statuses with messages that say what to do, and a record's
 * bookkeeping entry (the meta database: last use, hits, size, pin, index
 * key) and its calibration curve (the calib database).
 * Their own file so that the store and the lookup index both use them
 * without using each other. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/statvfs.h>
#include <xxhash.h>

#include "cache/cache_internal.h"

/* ---- errors -------------------------------------------------------------- */

static uint64_t map_size_now(const pd_store *s) {
    MDB_envinfo ei;
    if (s->env && mdb_env_info(s->env, &ei) == 0) return ei.me_mapsize;
    return s->opts.map_size;
}

/* Less than 16 MiB free for unprivileged writers on dir's file system. */
static bool disk_nearly_full(const char *dir) {
    struct statvfs v;
    return statvfs(dir, &v) == 0 && (uint64_t)v.f_bavail * v.f_frsize < (16u << 20);
}

int cache_lmdb_error(const pd_store *s, int rc, const char *what, pd_error *err) {
    switch (rc) {
    case MDB_MAP_FULL:
        return pd_errorf(err, PD_ERANGE,
                         "the prefix store is full (map size %" PRIu64
                         " MiB, cache.map_size_mb): raise it, set a size limit for eviction, or delete prefixes",
                         map_size_now(s) >> 20);
    case MDB_TXN_FULL:
        return pd_errorf(err, PD_ERANGE,
                         "%s: the change touches more pages than one LMDB transaction can hold; store smaller prefixes",
                         what);
    case MDB_READERS_FULL:
        return pd_errorf(err, PD_ERANGE,
                         "%s: all %u reader slots of the prefix store are in use; release prefixes sooner or raise "
                         "max_readers",
                         what, s->opts.max_readers);
    case MDB_MAP_RESIZED:
        return pd_errorf(err, PD_EIO, "%s: another process grew the prefix store in %s; reopen the store", what,
                         s->dir);
    case MDB_CORRUPTED:
    case MDB_PAGE_NOTFOUND:
        return pd_errorf(err, PD_EFORMAT,
                         "%s: the LMDB file in %s is corrupt (%s); restore it from a backup or delete it",
                         what, s->dir, mdb_strerror(rc));
    case EIO: /* LMDB reports a short write (the disk filled up) as EIO */
        if (!disk_nearly_full(s->dir)) break;
        /* fall through */
    case ENOSPC:
        return pd_errorf(err, PD_EIO,
                         "%s: no space left on the disk holding the prefix store %s: free disk space, or delete "
                         "prefixes (the file keeps its size: `mdb_copy -c %s NEW_DIR` writes a compacted copy)",
                         what, s->dir, s->dir);
    case ENOMEM: return pd_errorf(err, PD_ENOMEM, "%s: out of memory", what);
    default: break;
    }
    return pd_errorf(err, PD_EIO, "%s in the prefix store %s: %s", what, s->dir, mdb_strerror(rc));
}

/* ---- a record's bookkeeping ---------------------------------------------- */

/* PD_ENOTFOUND when absent, PD_EFORMAT when its checksum fails. */
int cache_meta_get(pd_store *s, MDB_txn *txn, const pd_prefix_id *id, cache_record_meta *m, pd_error *err) {
    MDB_val k = cache_mval(id->b, PD_PREFIX_ID_LEN), v;
    int rc = mdb_get(txn, s->meta, &k, &v);
    if (rc == MDB_NOTFOUND) return PD_ENOTFOUND;
    if (rc) return cache_lmdb_error(s, rc, "reading a prefix's bookkeeping", err);
    const uint8_t *p = v.mv_data;
    if (v.mv_size != CACHE_META_LEN || cache_rd_u64(p + 56) != XXH3_64bits(p, 56))
        return pd_errorf(err, PD_EFORMAT, "bookkeeping entry fails its checksum");
    m->stamp = cache_rd_u64(p);
    m->bytes = cache_rd_u64(p + 8);
    m->pinned = cache_rd_u32(p + 16) & 1;
    m->hits = cache_rd_u32(p + 20);
    memcpy(m->index_key, p + 24, PD_SHA256_LEN);
    return PD_OK;
}

uint64_t cache_meta_stamp(pd_store *s, MDB_txn *txn, const pd_prefix_id *id) {
    cache_record_meta m;
    pd_error e;
    return cache_meta_get(s, txn, id, &m, &e) == PD_OK ? m.stamp : 0;
}

int cache_meta_put(pd_store *s, MDB_txn *txn, const pd_prefix_id *id, const cache_record_meta *m, pd_error *err) {
    uint8_t b[CACHE_META_LEN] = {0};
    cache_wr_u64(b, m->stamp);
    cache_wr_u64(b + 8, m->bytes);
    cache_wr_u32(b + 16, m->pinned ? 1u : 0u);
    cache_wr_u32(b + 20, m->hits);
    memcpy(b + 24, m->index_key, PD_SHA256_LEN);
    cache_wr_u64(b + 56, XXH3_64bits(b, 56));
    MDB_val k = cache_mval(id->b, PD_PREFIX_ID_LEN), v = cache_mval(b, sizeof b);
    int rc = mdb_put(txn, s->meta, &k, &v, 0);
    return rc ? cache_lmdb_error(s, rc, "writing a prefix's bookkeeping", err) : PD_OK;
}

/* ---- a record's calibration curve ------------------------------------------ */

#define CALIB_MAGIC "PDKVCAL1"
#define CALIB_FIXED 32u /* magic, n_points, reserved, a, b */

static size_t calib_len(int32_t n_points) {
    return CALIB_FIXED + 16u * (size_t)n_points + 8u;
}

static void wr_f64(uint8_t *p, double d) { memcpy(p, &d, sizeof d); }
static double rd_f64(const uint8_t *p) {
    double d;
    memcpy(&d, p, sizeof d);
    return d;
}

int cache_calib_get(pd_store *s, MDB_txn *txn, const pd_prefix_id *id, pd_prefix_quality *q, pd_error *err) {
    q->has_curve = false;
    q->curve_a = q->curve_b = NAN;
    q->n_points = 0;
    if (!s->has_calib) return PD_OK;
    MDB_val k = cache_mval(id->b, PD_PREFIX_ID_LEN), v;
    int rc = mdb_get(txn, s->calib, &k, &v);
    if (rc == MDB_NOTFOUND) return PD_OK;
    if (rc) return cache_lmdb_error(s, rc, "reading a prefix's calibration curve", err);
    return cache_calib_decode(v.mv_data, v.mv_size, q, err);
}

int cache_calib_decode(const void *val, size_t size, pd_prefix_quality *q, pd_error *err) {
    const uint8_t *p = val;
    if (size < calib_len(0) || memcmp(p, CALIB_MAGIC, 8) != 0 || cache_rd_u64(p + size - 8) != XXH3_64bits(p, size - 8))
        return pd_errorf(err, PD_EFORMAT, "calibration curve fails its checksum");
    const uint32_t n = cache_rd_u32(p + 8);
    const double a = rd_f64(p + 16), b = rd_f64(p + 24);
    if (n > PD_PREFIX_CALIB_POINTS || size != calib_len((int32_t)n) || !(a > 0) || !(b > 0) || !isfinite(a) ||
        !isfinite(b))
        return pd_errorf(err, PD_EFORMAT, "calibration curve is malformed");
    q->has_curve = true;
    q->curve_a = a;
    q->curve_b = b;
    q->n_points = (int32_t)n;
    for (uint32_t i = 0; i < n; i++) {
        q->point_retention[i] = rd_f64(p + CALIB_FIXED + 16 * i);
        q->point_ratio[i] = rd_f64(p + CALIB_FIXED + 16 * i + 8);
    }
    return PD_OK;
}

int cache_calib_put(pd_store *s, MDB_txn *txn, const pd_prefix_id *id, const pd_prefix_quality *q, pd_error *err) {
    if (!q->has_curve) return PD_OK;
    if (!(q->curve_a > 0) || !(q->curve_b > 0) || !isfinite(q->curve_a) || !isfinite(q->curve_b) || q->n_points < 0 ||
        q->n_points > PD_PREFIX_CALIB_POINTS)
        return pd_errorf(err, PD_EINVAL, "calibration curve out of range (a, b > 0, at most %d points)",
                         PD_PREFIX_CALIB_POINTS);
    uint8_t b[CALIB_FIXED + 16 * PD_PREFIX_CALIB_POINTS + 8] = {0};
    const size_t len = calib_len(q->n_points);
    memcpy(b, CALIB_MAGIC, 8);
    cache_wr_u32(b + 8, (uint32_t)q->n_points);
    wr_f64(b + 16, q->curve_a);
    wr_f64(b + 24, q->curve_b);
    for (int32_t i = 0; i < q->n_points; i++) {
        wr_f64(b + CALIB_FIXED + 16 * i, q->point_retention[i]);
        wr_f64(b + CALIB_FIXED + 16 * i + 8, q->point_ratio[i]);
    }
    cache_wr_u64(b + len - 8, XXH3_64bits(b, len - 8));
    MDB_val k = cache_mval(id->b, PD_PREFIX_ID_LEN), v = cache_mval(b, len);
    int rc = mdb_put(txn, s->calib, &k, &v, 0);
    return rc ? cache_lmdb_error(s, rc, "writing a prefix's calibration curve", err) : PD_OK;
}

int cache_calib_del(pd_store *s, MDB_txn *txn, const pd_prefix_id *id, pd_error *err) {
    if (!s->has_calib) return PD_OK;
    MDB_val k = cache_mval(id->b, PD_PREFIX_ID_LEN);
    int rc = mdb_del(txn, s->calib, &k, NULL);
    return rc && rc != MDB_NOTFOUND ? cache_lmdb_error(s, rc, "deleting a prefix's calibration curve", err) : PD_OK;
}
