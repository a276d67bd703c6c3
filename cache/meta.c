/* What the store's files share below the record format: LMDB failures
 * mapped to statuses with messages that say what to do, and a record's
 * bookkeeping entry (the meta database: last use, size, pin, index key).
 * Their own file so that the store and the lookup index both use them
 * without using each other. */
#include <errno.h>
#include <inttypes.h>
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
    memcpy(b + 24, m->index_key, PD_SHA256_LEN);
    cache_wr_u64(b + 56, XXH3_64bits(b, 56));
    MDB_val k = cache_mval(id->b, PD_PREFIX_ID_LEN), v = cache_mval(b, sizeof b);
    int rc = mdb_put(txn, s->meta, &k, &v, 0);
    return rc ? cache_lmdb_error(s, rc, "writing a prefix's bookkeeping", err) : PD_OK;
}
