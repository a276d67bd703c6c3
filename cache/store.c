/* The LMDB prefix store: one environment, six named databases (records,
 * streams, index, lru, meta, and auto for automatic blocks; see docs/store.md), one write transaction per
 * change, every checksum verified on every read. LMDB serialises writers
 * and readers never block them; MDB_NOTLS lets any thread end a read
 * transaction, so a pd_prefix_ref can keep its snapshot (and the rows it
 * borrows from the map) alive across threads. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "cache/cache_internal.h"
#include "kernels/kernels.h"

#define DEFAULT_MAP_SIZE (1ull << 30)
#define MIN_MAP_SIZE (1ull << 20)
#define MAX_PAGE_TOKENS (1 << 20)
/* Accesses kept in memory before a get writes them itself. */
#define PENDING_FLUSH 1024

void pd_store_opts_default(pd_store_opts *o) {
    memset(o, 0, sizeof *o);
    o->map_size = DEFAULT_MAP_SIZE;
    o->page_tokens = 64;
    o->max_readers = 126;
    o->kv_type = PD_TYPE_F16;
}

/* ---- errors -------------------------------------------------------------- */

static int corrupt_error(const pd_prefix_id *id, pd_error *err) {
    char hex[PD_PREFIX_ID_HEX];
    pd_prefix_id_hex(id, hex);
    pd_error_prefix(err, "prefix %s", hex);
    size_t len = strlen(err->msg);
    snprintf(err->msg + len, sizeof err->msg - len, "; run `prefixctl store verify --repair`");
    return err->code;
}

static int not_found(const pd_prefix_id *id, pd_error *err) {
    char hex[PD_PREFIX_ID_HEX];
    pd_prefix_id_hex(id, hex);
    return pd_errorf(err, PD_ENOTFOUND, "prefix %s is not in the store", hex);
}

/* ---- small values -------------------------------------------------------- */

typedef struct store_totals {
    uint64_t prefixes, bytes, pinned;
} store_totals;

static int totals_get(pd_store *s, MDB_txn *txn, store_totals *t, pd_error *err) {
    MDB_val k = cache_mval(CACHE_STORE_KEY, strlen(CACHE_STORE_KEY)), v;
    int rc = mdb_get(txn, s->meta, &k, &v);
    if (rc) return cache_lmdb_error(s, rc, "reading the store's totals", err);
    if (v.mv_size != CACHE_STORE_VAL_LEN)
        return pd_errorf(err, PD_EFORMAT, "the prefix store in %s has a malformed '%s' entry", s->dir, CACHE_STORE_KEY);
    const uint8_t *p = v.mv_data;
    t->prefixes = cache_rd_u64(p + 16);
    t->bytes = cache_rd_u64(p + 24);
    t->pinned = cache_rd_u64(p + 32);
    return PD_OK;
}

static int totals_put(pd_store *s, MDB_txn *txn, const store_totals *t, pd_error *err) {
    uint8_t b[CACHE_STORE_VAL_LEN] = {0};
    memcpy(b, "PDKVSTOR", 8);
    cache_wr_u32(b + 8, PD_STORE_FORMAT_VERSION);
    cache_wr_u64(b + 16, t->prefixes);
    cache_wr_u64(b + 24, t->bytes);
    cache_wr_u64(b + 32, t->pinned);
    MDB_val k = cache_mval(CACHE_STORE_KEY, strlen(CACHE_STORE_KEY)), v = cache_mval(b, sizeof b);
    int rc = mdb_put(txn, s->meta, &k, &v, 0);
    return rc ? cache_lmdb_error(s, rc, "writing the store's totals", err) : PD_OK;
}

static void lru_key(uint8_t key[CACHE_LRU_KEY_LEN], uint64_t stamp, const pd_prefix_id *id) {
    cache_wr_be64(key, stamp);
    memcpy(key + 8, id->b, PD_PREFIX_ID_LEN);
}

static int lru_put(pd_store *s, MDB_txn *txn, uint64_t stamp, const pd_prefix_id *id, pd_error *err) {
    uint8_t key[CACHE_LRU_KEY_LEN];
    lru_key(key, stamp, id);
    MDB_val k = cache_mval(key, sizeof key), v = cache_mval("", 0);
    int rc = mdb_put(txn, s->lru, &k, &v, 0);
    return rc ? cache_lmdb_error(s, rc, "writing the LRU order", err) : PD_OK;
}

static int lru_del(pd_store *s, MDB_txn *txn, uint64_t stamp, const pd_prefix_id *id, pd_error *err) {
    uint8_t key[CACHE_LRU_KEY_LEN];
    lru_key(key, stamp, id);
    MDB_val k = cache_mval(key, sizeof key);
    int rc = mdb_del(txn, s->lru, &k, NULL);
    return rc && rc != MDB_NOTFOUND ? cache_lmdb_error(s, rc, "updating the LRU order", err) : PD_OK;
}

/* ---- access stamps --------------------------------------------------------- */

static uint64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* Strictly increasing within a handle, so two uses in the same microsecond
 * still have an order. Caller holds s->mu. */
static uint64_t next_stamp_locked(pd_store *s) {
    uint64_t t = now_us();
    if (t <= s->last_stamp) t = s->last_stamp + 1;
    s->last_stamp = t;
    return t;
}

static uint64_t next_stamp(pd_store *s) {
    pthread_mutex_lock(&s->mu);
    uint64_t t = next_stamp_locked(s);
    pthread_mutex_unlock(&s->mu);
    return t;
}

/* Returns the number of pending accesses after recording this one (with
 * `hits` more requests served from it). */
static size_t record_access(pd_store *s, const pd_prefix_id *id, uint32_t hits) {
    pthread_mutex_lock(&s->mu);
    uint64_t stamp = next_stamp_locked(s);
    size_t i = 0;
    while (i < s->n_pending && memcmp(s->pending[i].id.b, id->b, PD_PREFIX_ID_LEN) != 0) i++;
    if (i == s->n_pending) {
        if (s->n_pending == s->cap_pending) {
            size_t cap = s->cap_pending ? 2 * s->cap_pending : 64;
            cache_access *p = realloc(s->pending, cap * sizeof *p);
            if (!p) { /* LRU order is advisory: losing an access is harmless */
                size_t n = s->n_pending;
                pthread_mutex_unlock(&s->mu);
                return n;
            }
            s->pending = p;
            s->cap_pending = cap;
        }
        s->pending[s->n_pending++] = (cache_access){.id = *id};
    }
    s->pending[i].stamp = stamp;
    s->pending[i].hits = s->pending[i].hits > UINT32_MAX - hits ? UINT32_MAX : s->pending[i].hits + hits;
    size_t n = s->n_pending;
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* The uses of id that a reader of txn's snapshot does not see in meta: the
 * pending ones, and those being written by a write transaction newer than
 * the snapshot (so a count never dips while they are written). */
static cache_access pending_access(pd_store *s, MDB_txn *txn, const pd_prefix_id *id) {
    cache_access a = {.id = *id};
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < s->n_pending; i++)
        if (memcmp(s->pending[i].id.b, id->b, PD_PREFIX_ID_LEN) == 0) a = s->pending[i];
    if (mdb_txn_id(txn) < s->flushing_txn)
        for (size_t i = 0; i < s->n_flushing; i++)
            if (memcmp(s->flushing[i].id.b, id->b, PD_PREFIX_ID_LEN) == 0) {
                if (s->flushing[i].stamp > a.stamp) a.stamp = s->flushing[i].stamp;
                a.hits = a.hits > UINT32_MAX - s->flushing[i].hits ? UINT32_MAX : a.hits + s->flushing[i].hits;
            }
    pthread_mutex_unlock(&s->mu);
    return a;
}

/* Move the in-memory accesses into meta and lru inside txn. If txn is later
 * aborted they are lost, which only makes the LRU order and the hit counts
 * approximate. They stay readable (pending_access) until the next write
 * begins: by then this one has committed or is gone. */
static int flush_accesses(pd_store *s, MDB_txn *txn, pd_error *err) {
    pthread_mutex_lock(&s->mu);
    free(s->flushing);
    cache_access *acc = s->flushing = s->pending;
    size_t n = s->n_flushing = s->n_pending;
    s->flushing_txn = mdb_txn_id(txn);
    s->pending = NULL;
    s->n_pending = s->cap_pending = 0;
    pthread_mutex_unlock(&s->mu);
    int rc = PD_OK;
    for (size_t i = 0; i < n && !rc; i++) {
        cache_record_meta m;
        pd_error e2;
        int mrc = cache_meta_get(s, txn, &acc[i].id, &m, &e2);
        if (mrc == PD_ENOTFOUND || mrc == PD_EFORMAT) continue; /* deleted since, or for verify to handle */
        if (mrc) {
            *err = e2;
            rc = mrc;
            break;
        }
        if (acc[i].stamp <= m.stamp && !acc[i].hits) continue;
        if (acc[i].stamp > m.stamp) {
            if ((rc = lru_del(s, txn, m.stamp, &acc[i].id, err))) break;
            m.stamp = acc[i].stamp;
            if ((rc = lru_put(s, txn, m.stamp, &acc[i].id, err))) break;
        }
        m.hits = m.hits > UINT32_MAX - acc[i].hits ? UINT32_MAX : m.hits + acc[i].hits;
        rc = cache_meta_put(s, txn, &acc[i].id, &m, err);
    }
    return rc;
}

/* ---- transactions -------------------------------------------------------- */

static int read_begin(pd_store *s, MDB_txn **txn, pd_error *err) {
    int rc = mdb_txn_begin(s->env, NULL, MDB_RDONLY, txn);
    return rc ? cache_lmdb_error(s, rc, "starting a read transaction", err) : PD_OK;
}

static int write_begin(pd_store *s, MDB_txn **txn, pd_error *err) {
    if (s->opts.read_only)
        return pd_errorf(err, PD_EINVAL, "the prefix store in %s is open read-only; open it writable to change it",
                         s->dir);
    int rc = mdb_txn_begin(s->env, NULL, 0, txn);
    if (rc) return cache_lmdb_error(s, rc, "starting a write transaction", err);
    if ((rc = flush_accesses(s, *txn, err))) {
        mdb_txn_abort(*txn);
        *txn = NULL;
    }
    return rc;
}

static int write_commit(pd_store *s, MDB_txn *txn, pd_error *err) {
    int rc = mdb_txn_commit(txn);
    return rc ? cache_lmdb_error(s, rc, "committing a write transaction", err) : PD_OK;
}

/* ---- open / close -------------------------------------------------------- */

/* mkdir -p with mode 0700 for the directories it creates. */
static int make_dirs(const char *dir, pd_error *err) {
    char *path = strdup(dir);
    if (!path) return pd_errorf(err, PD_ENOMEM, "out of memory");
    int rc = PD_OK;
    for (char *p = path + 1;; p++) {
        if (*p != '/' && *p != '\0') continue;
        char c = *p;
        *p = '\0';
        if (mkdir(path, 0700) != 0 && errno != EEXIST) {
            rc = pd_errorf(err, PD_EIO, "cannot create the prefix store directory %s: %s", path, strerror(errno));
            break;
        }
        *p = c;
        if (c == '\0') break;
    }
    free(path);
    if (rc) return rc;
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return pd_errorf(err, PD_EIO, "the prefix store path %s is not a directory", dir);
    return PD_OK;
}

static int open_dbs(pd_store *s, pd_error *err) {
    const bool ro = s->opts.read_only;
    MDB_txn *txn;
    int rc = mdb_txn_begin(s->env, NULL, ro ? MDB_RDONLY : 0, &txn);
    if (rc) return cache_lmdb_error(s, rc, "opening the prefix store", err);
    const struct {
        const char *name;
        unsigned flags;
        MDB_dbi *dbi;
    } dbs[] = {
        {"records", 0, &s->records}, {"streams", 0, &s->streams}, {"index", MDB_DUPSORT | MDB_DUPFIXED, &s->index},
        {"lru", 0, &s->lru},         {"meta", 0, &s->meta},
    };
    for (size_t i = 0; i < sizeof dbs / sizeof dbs[0]; i++) {
        rc = mdb_dbi_open(txn, dbs[i].name, dbs[i].flags | (ro ? 0 : MDB_CREATE), dbs[i].dbi);
        if (rc == MDB_NOTFOUND) {
            mdb_txn_abort(txn);
            return pd_errorf(err, PD_EFORMAT,
                             "%s is not a prefix store (no '%s' database); check cache.path or open it writable once",
                             s->dir, dbs[i].name);
        }
        if (rc) {
            mdb_txn_abort(txn);
            return cache_lmdb_error(s, rc, "opening the prefix store's databases", err);
        }
    }
    /* Automatic blocks (cache.auto_persist) came later: a store written
     * before them has no such database, which read-only is just empty. */
    rc = mdb_dbi_open(txn, "auto", ro ? 0 : MDB_CREATE, &s->autob);
    s->has_auto = rc == 0;
    if (rc && rc != MDB_NOTFOUND) {
        mdb_txn_abort(txn);
        return cache_lmdb_error(s, rc, "opening the prefix store's databases", err);
    }
    /* So did calibration curves. */
    rc = mdb_dbi_open(txn, "calib", ro ? 0 : MDB_CREATE, &s->calib);
    s->has_calib = rc == 0;
    if (rc && rc != MDB_NOTFOUND) {
        mdb_txn_abort(txn);
        return cache_lmdb_error(s, rc, "opening the prefix store's databases", err);
    }
    MDB_val k = cache_mval(CACHE_STORE_KEY, strlen(CACHE_STORE_KEY)), v;
    rc = mdb_get(txn, s->meta, &k, &v);
    if (rc == MDB_NOTFOUND) {
        MDB_stat st;
        if (ro || (rc = mdb_stat(txn, s->records, &st)) != 0 || st.ms_entries != 0) {
            mdb_txn_abort(txn);
            if (!ro && rc) return cache_lmdb_error(s, rc, "opening the prefix store", err);
            return pd_errorf(err, PD_EFORMAT, "%s holds no prefix-store format marker; it was not written by prefixd",
                             s->dir);
        }
        store_totals t = {0};
        if ((rc = totals_put(s, txn, &t, err))) {
            mdb_txn_abort(txn);
            return rc;
        }
    } else if (rc) {
        mdb_txn_abort(txn);
        return cache_lmdb_error(s, rc, "opening the prefix store", err);
    } else {
        const uint8_t *p = v.mv_data;
        if (v.mv_size < 12 || memcmp(p, "PDKVSTOR", 8) != 0) {
            mdb_txn_abort(txn);
            return pd_errorf(err, PD_EFORMAT, "%s has a malformed prefix-store format marker", s->dir);
        }
        uint32_t ver = cache_rd_u32(p + 8);
        if (ver != PD_STORE_FORMAT_VERSION || v.mv_size != CACHE_STORE_VAL_LEN) {
            mdb_txn_abort(txn);
            return pd_errorf(err, PD_EFORMAT,
                             "%s holds a prefix store of format version %" PRIu32
                             "; this build reads version %d: use a matching prefixd or another cache.path",
                             s->dir, ver, PD_STORE_FORMAT_VERSION);
        }
    }
    rc = mdb_txn_commit(txn);
    return rc ? cache_lmdb_error(s, rc, "opening the prefix store", err) : PD_OK;
}

/* ---- the data file before it is mapped ------------------------------------ */

/* LMDB (0.9, 64-bit) keeps two meta pages at the start of data.mdb: after a
 * 16-byte page header, the magic and version, and further on the page size
 * (in the free-list database's md_pad), the last page in use and the
 * transaction id. The newer valid meta is the current one. */
#define LMDB_MAGIC 0xBEEFC0DEu
#define LMDB_META_MAGIC 16
#define LMDB_META_VERSION 20
#define LMDB_META_PSIZE 40
#define LMDB_META_LAST_PG 136
#define LMDB_META_TXNID 144
#define LMDB_META_END 152

int cache_data_file_check(const char *path, uint64_t *size, uint64_t *needed, uint32_t *page_size, pd_error *err) {
    *size = *needed = 0;
    *page_size = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return pd_errorf(err, PD_EIO, "cannot open %s: %s", path, strerror(errno));
    struct stat st;
    int rc = PD_OK;
    if (fstat(fileno(f), &st) != 0) {
        rc = pd_errorf(err, PD_EIO, "cannot stat %s: %s", path, strerror(errno));
        goto done;
    }
    *size = (uint64_t)st.st_size;
    uint8_t m0[LMDB_META_END], m1[LMDB_META_END];
    if (fread(m0, 1, sizeof m0, f) != sizeof m0) {
        rc = pd_errorf(err, PD_EFORMAT, "%s is only %" PRIu64 " bytes, shorter than LMDB's first page", path, *size);
        goto done;
    }
    if (cache_rd_u32(m0 + LMDB_META_MAGIC) != LMDB_MAGIC) {
        rc = pd_errorf(err, PD_EFORMAT, "%s is not an LMDB file (no LMDB magic in its first page)", path);
        goto done;
    }
    const uint32_t psize = cache_rd_u32(m0 + LMDB_META_PSIZE);
    if (psize < 512 || psize > (1u << 16) || (psize & (psize - 1))) {
        rc = pd_errorf(err, PD_EFORMAT, "%s: its first meta page gives a page size of %u bytes, which is corrupt", path,
                       psize);
        goto done;
    }
    /* The second meta page may be missing when the file is short; the
     * first then decides. */
    bool m1_ok = fseeko(f, (off_t)psize, SEEK_SET) == 0 && fread(m1, 1, sizeof m1, f) == sizeof m1 &&
                 cache_rd_u32(m1 + LMDB_META_MAGIC) == LMDB_MAGIC &&
                 cache_rd_u32(m1 + LMDB_META_VERSION) == cache_rd_u32(m0 + LMDB_META_VERSION);
    const uint8_t *cur = m1_ok && cache_rd_u64(m1 + LMDB_META_TXNID) > cache_rd_u64(m0 + LMDB_META_TXNID) ? m1 : m0;
    const uint64_t last_pg = cache_rd_u64(cur + LMDB_META_LAST_PG);
    if (last_pg > UINT64_MAX / psize - 1) {
        rc = pd_errorf(err, PD_EFORMAT, "%s: its meta page names page %" PRIu64 " as the last one, which is corrupt",
                       path, last_pg);
        goto done;
    }
    *needed = (last_pg + 1) * psize;
    *page_size = psize;
done:
    fclose(f);
    return rc;
}

/* Refuse a data file that mapping would crash on: LMDB reads every page up
 * to the last committed one through the map, and a page past the end of a
 * truncated file is a SIGBUS, not an error. */
static int check_existing_data_file(const char *dir, const char *path, pd_error *err) {
    uint64_t size, needed;
    uint32_t psize;
    struct stat st;
    /* An empty file also appears for an instant while another process
     * creates the environment; look again before calling it damage. */
    for (int i = 0; i < 20 && stat(path, &st) == 0 && st.st_size == 0; i++) usleep(10000);
    int rc = cache_data_file_check(path, &size, &needed, &psize, err);
    if (rc == PD_OK && size < needed)
        rc = pd_errorf(err, PD_EFORMAT,
                       "%s is %" PRIu64 " bytes but its last transaction uses %" PRIu64
                       " (truncated by a disk fault or an interrupted copy)",
                       path, size, needed);
    if (rc != PD_EFORMAT) return rc;
    size_t len = strlen(err->msg);
    snprintf(err->msg + len, sizeof err->msg - len,
             "; prefixd will not map it. Run `prefixctl store --dir %s salvage NEW_DIR` to copy every intact "
             "record into a new store, then point cache.path at it (or move the damaged directory away to start "
             "empty)",
             dir);
    return rc;
}

int pd_store_open(const pd_store_opts *o, pd_store **out, pd_error *err) {
    pd_error local;
    if (!err) err = &local; /* internal code always has somewhere to write */
    *out = NULL;
    if (!o || !o->dir || !o->dir[0])
        return pd_errorf(err, PD_EINVAL, "the prefix store needs a directory (cache.path)");
    if (o->page_tokens < 1 || o->page_tokens > MAX_PAGE_TOKENS)
        return pd_errorf(err, PD_EINVAL, "page_tokens %d is outside [1, %d] (cache.page_tokens)", o->page_tokens,
                         MAX_PAGE_TOKENS);
    if (!pd_kv_type_ok(o->kv_type))
        return pd_errorf(err, PD_EINVAL, "the store's kv_type must be f16 or f32 (the model's KV type, model.kv_type)");
    pd_store *s = calloc(1, sizeof *s);
    if (!s) return pd_errorf(err, PD_ENOMEM, "out of memory for the prefix store");
    s->opts = *o;
    s->dir = strdup(o->dir);
    if (!s->dir || pthread_mutex_init(&s->mu, NULL) != 0) {
        free(s->dir);
        free(s);
        return pd_errorf(err, PD_ENOMEM, "out of memory for the prefix store");
    }
    s->opts.dir = s->dir;
    if (!s->opts.max_readers) s->opts.max_readers = 126;
    uint64_t map = s->opts.map_size ? s->opts.map_size : DEFAULT_MAP_SIZE;
    if (map < MIN_MAP_SIZE) map = MIN_MAP_SIZE;
    long psz = sysconf(_SC_PAGESIZE);
    uint64_t pg = psz > 0 ? (uint64_t)psz : 4096;
    if (map > SIZE_MAX - pg) map = SIZE_MAX - pg;
    map = (map + pg - 1) / pg * pg;
    s->opts.map_size = map;

    int rc = PD_OK;
    if (!s->opts.read_only) rc = make_dirs(s->dir, err);
    int mrc;
    if (!rc && (mrc = mdb_env_create(&s->env)) != 0) {
        s->env = NULL;
        rc = cache_lmdb_error(s, mrc, "creating the LMDB environment", err);
    }
    /* An existing environment keeps its map size unless this one is larger:
     * shrinking it would make the other processes that have it open fail
     * with MDB_MAP_RESIZED at their next transaction. */
    char data_path[4096];
    struct stat dst;
    snprintf(data_path, sizeof data_path, "%s/data.mdb", s->dir);
    const bool exists = stat(data_path, &dst) == 0;
    if (!rc && exists) rc = check_existing_data_file(s->dir, data_path, err);
    if (!rc && ((mrc = mdb_env_set_maxdbs(s->env, 8)) != 0 ||
                (!exists && (mrc = mdb_env_set_mapsize(s->env, (size_t)map)) != 0) ||
                (mrc = mdb_env_set_maxreaders(s->env, s->opts.max_readers)) != 0))
        rc = cache_lmdb_error(s, mrc, "configuring the LMDB environment", err);
    if (!rc) {
        /* Never MDB_NOSYNC/MDB_NOMETASYNC: a reported commit must survive a
         * crash or power loss. */
        unsigned flags = MDB_NOTLS | (s->opts.read_only ? MDB_RDONLY : 0);
        mrc = mdb_env_open(s->env, s->dir, flags, 0600);
        if (mrc == ENOENT)
            rc = pd_errorf(err, PD_ENOTFOUND, "there is no prefix store in %s", s->dir);
        else if (mrc == MDB_INVALID)
            rc = pd_errorf(err, PD_EFORMAT, "%s/data.mdb is not an LMDB file", s->dir);
        else if (mrc == MDB_VERSION_MISMATCH)
            rc = pd_errorf(err, PD_EFORMAT, "%s was written by an incompatible LMDB version", s->dir);
        else if (mrc)
            rc = cache_lmdb_error(s, mrc, "opening the LMDB environment", err);
    }
    MDB_envinfo ei;
    if (!rc && exists && (mrc = mdb_env_info(s->env, &ei)) == 0 && ei.me_mapsize < map &&
        (mrc = mdb_env_set_mapsize(s->env, (size_t)map)) != 0)
        rc = cache_lmdb_error(s, mrc, "growing the LMDB map", err);
    if (!rc) {
        /* Free the reader slots of processes that died holding them. */
        int dead = 0;
        mdb_reader_check(s->env, &dead);
        rc = open_dbs(s, err);
    }
    if (rc) {
        if (s->env) mdb_env_close(s->env);
        pthread_mutex_destroy(&s->mu);
        free(s->dir);
        free(s);
        return rc;
    }
    *out = s;
    return PD_OK;
}

void pd_store_close(pd_store *s) {
    if (!s) return;
    if (!s->opts.read_only && s->n_pending) {
        /* Best effort: losing accesses only makes the LRU order older. */
        MDB_txn *txn;
        pd_error e;
        if (write_begin(s, &txn, &e) == PD_OK) (void)write_commit(s, txn, &e);
    }
    mdb_env_close(s->env);
    pthread_mutex_destroy(&s->mu);
    free(s->pending);
    free(s->flushing);
    free(s->dir);
    free(s);
}

/* ---- record removal ------------------------------------------------------- */

/* The index key of a record whose bookkeeping is lost, from its header. */
static bool index_key_from_header(pd_store *s, MDB_txn *txn, const pd_prefix_id *id, uint8_t key[PD_SHA256_LEN]) {
    MDB_val k = cache_mval(id->b, PD_PREFIX_ID_LEN), v;
    cache_header h;
    pd_error e;
    if (mdb_get(txn, s->records, &k, &v) || cache_header_decode(v.mv_data, v.mv_size, NULL, &h, &e)) return false;
    pd_token *toks = malloc((size_t)h.n_tokens * sizeof *toks);
    if (!toks) return false;
    memcpy(toks, h.tokens, (size_t)h.n_tokens * sizeof *toks);
    bool ok = cache_lookup_key(h.fingerprint, h.ns, h.ns_len, toks, h.n_tokens, key, &e) == PD_OK;
    free(toks);
    return ok;
}

/* Remove the entries of db whose key ends in id (lru) or whose value is id
 * (index) by a full scan: only for records whose bookkeeping is lost. */
static int scan_remove(pd_store *s, MDB_txn *txn, MDB_dbi db, bool in_value, const pd_prefix_id *id, pd_error *err) {
    typedef struct {
        uint8_t key[CACHE_LRU_KEY_LEN];
        size_t key_len;
    } entry;
    entry *found = NULL;
    size_t n = 0, cap = 0;
    MDB_cursor *c;
    int rc = mdb_cursor_open(txn, db, &c);
    if (rc) return cache_lmdb_error(s, rc, "scanning the store", err);
    MDB_val k, v;
    int op = MDB_FIRST, res = PD_OK;
    /* Collect, then delete: a delete would move the cursor. */
    while ((rc = mdb_cursor_get(c, &k, &v, op)) == 0) {
        op = MDB_NEXT;
        const MDB_val *x = in_value ? &v : &k;
        if (k.mv_size > CACHE_LRU_KEY_LEN || x->mv_size < PD_PREFIX_ID_LEN ||
            memcmp((const uint8_t *)x->mv_data + x->mv_size - PD_PREFIX_ID_LEN, id->b, PD_PREFIX_ID_LEN) != 0)
            continue;
        if (n == cap) {
            size_t ncap = cap ? 2 * cap : 4;
            entry *f = realloc(found, ncap * sizeof *f);
            if (!f) {
                res = pd_errorf(err, PD_ENOMEM, "out of memory scanning the store");
                break;
            }
            found = f;
            cap = ncap;
        }
        memcpy(found[n].key, k.mv_data, k.mv_size);
        found[n++].key_len = k.mv_size;
    }
    mdb_cursor_close(c);
    if (!res && rc != MDB_NOTFOUND) res = cache_lmdb_error(s, rc, "scanning the store", err);
    for (size_t i = 0; !res && i < n; i++) {
        MDB_val dk = cache_mval(found[i].key, found[i].key_len), dv = cache_mval(id->b, PD_PREFIX_ID_LEN);
        rc = mdb_del(txn, db, &dk, in_value ? &dv : NULL);
        if (rc && rc != MDB_NOTFOUND) res = cache_lmdb_error(s, rc, "scanning the store", err);
    }
    free(found);
    return res;
}

/* Delete one record: header, streams, bookkeeping, LRU and index entries.
 * Works on corrupt records too; t (may be NULL) loses the bytes removed. */
static int remove_record(pd_store *s, MDB_txn *txn, const pd_prefix_id *id, store_totals *t, pd_error *err) {
    MDB_val k = cache_mval(id->b, PD_PREFIX_ID_LEN), v;
    uint64_t freed = 0;
    int rc = mdb_get(txn, s->records, &k, &v);
    if (rc == MDB_NOTFOUND) return not_found(id, err);
    if (rc) return cache_lmdb_error(s, rc, "deleting a prefix", err);
    freed += v.mv_size;

    cache_record_meta m;
    pd_error e2;
    int mrc = cache_meta_get(s, txn, id, &m, &e2);
    if (mrc && mrc != PD_ENOTFOUND && mrc != PD_EFORMAT) {
        *err = e2;
        return mrc;
    }
    bool have_meta = mrc == PD_OK;
    uint8_t ikey[PD_SHA256_LEN];
    bool have_ikey = have_meta;
    if (have_meta)
        memcpy(ikey, m.index_key, sizeof ikey);
    else
        have_ikey = index_key_from_header(s, txn, id, ikey);

    if ((rc = mdb_del(txn, s->records, &k, NULL)) != 0) return cache_lmdb_error(s, rc, "deleting a prefix", err);

    MDB_cursor *c;
    if ((rc = mdb_cursor_open(txn, s->streams, &c)) != 0) return cache_lmdb_error(s, rc, "deleting a prefix", err);
    for (;;) {
        uint8_t first[CACHE_STREAM_KEY_LEN];
        cache_stream_key(first, id, 0, 0);
        MDB_val sk = cache_mval(first, sizeof first), sv;
        rc = mdb_cursor_get(c, &sk, &sv, MDB_SET_RANGE);
        if (rc || sk.mv_size < PD_PREFIX_ID_LEN || memcmp(sk.mv_data, id->b, PD_PREFIX_ID_LEN) != 0) break;
        freed += sv.mv_size;
        if ((rc = mdb_cursor_del(c, 0)) != 0) break;
    }
    mdb_cursor_close(c);
    if (rc && rc != MDB_NOTFOUND) return cache_lmdb_error(s, rc, "deleting a prefix's streams", err);

    if (have_meta) {
        if ((rc = lru_del(s, txn, m.stamp, id, err))) return rc;
    } else if ((rc = scan_remove(s, txn, s->lru, false, id, err))) {
        return rc;
    }
    if (have_ikey) {
        if ((rc = cache_index_del(s, txn, ikey, id, err))) return rc;
    } else if ((rc = scan_remove(s, txn, s->index, true, id, err))) {
        return rc;
    }
    if (mrc != PD_ENOTFOUND) {
        rc = mdb_del(txn, s->meta, &k, NULL);
        if (rc && rc != MDB_NOTFOUND) return cache_lmdb_error(s, rc, "deleting a prefix's bookkeeping", err);
    }
    if ((rc = cache_calib_del(s, txn, id, err))) return rc;
    if (t) {
        if (t->prefixes) t->prefixes--;
        t->bytes = t->bytes > freed ? t->bytes - freed : 0;
        if (have_meta && m.pinned && t->pinned) t->pinned--;
    }
    return PD_OK;
}

/* Delete least recently used unpinned records (never `keep`) until the
 * total fits max_bytes. */
static int evict(pd_store *s, MDB_txn *txn, store_totals *t, const pd_prefix_id *keep, int64_t *n_evicted,
                 pd_error *err) {
    const uint64_t limit = s->opts.max_bytes;
    while (t->bytes > limit) {
        /* Collect first, delete after: deleting under an open cursor on the
         * same database would move it. */
        pd_prefix_id victims[64];
        size_t nv = 0;
        uint64_t freeing = 0;
        MDB_cursor *c;
        int rc = mdb_cursor_open(txn, s->lru, &c);
        if (rc) return cache_lmdb_error(s, rc, "evicting prefixes", err);
        MDB_val k, v;
        int op = MDB_FIRST;
        while (nv < sizeof victims / sizeof victims[0] && t->bytes - freeing > limit &&
               (rc = mdb_cursor_get(c, &k, &v, op)) == 0) {
            op = MDB_NEXT;
            if (k.mv_size != CACHE_LRU_KEY_LEN) continue;
            pd_prefix_id id;
            memcpy(id.b, (const uint8_t *)k.mv_data + 8, PD_PREFIX_ID_LEN);
            if (memcmp(id.b, keep->b, PD_PREFIX_ID_LEN) == 0) continue;
            cache_record_meta m;
            pd_error e2;
            int mrc = cache_meta_get(s, txn, &id, &m, &e2);
            if (mrc == PD_OK && m.pinned) continue;
            victims[nv++] = id;
            freeing += mrc == PD_OK ? m.bytes : 0;
            if (freeing > t->bytes) freeing = t->bytes;
        }
        mdb_cursor_close(c);
        if (rc && rc != MDB_NOTFOUND) return cache_lmdb_error(s, rc, "evicting prefixes", err);
        if (!nv)
            return pd_errorf(err, PD_ERANGE,
                             "the prefix does not fit the store's size limit of %" PRIu64
                             " bytes: the other %" PRIu64 " prefixes are pinned; unpin or delete some",
                             limit, t->prefixes ? t->prefixes - 1 : 0);
        for (size_t i = 0; i < nv; i++) {
            if ((rc = remove_record(s, txn, &victims[i], t, err))) return rc;
            (*n_evicted)++;
        }
    }
    return PD_OK;
}

/* ---- put ------------------------------------------------------------------- */

static int info_from_record(pd_store *s, MDB_txn *txn, const pd_prefix_id *id, const cache_header *h,
                            pd_prefix_info *info, pd_error *err) {
    cache_header_to_info(h, info);
    info->id = *id;
    int rc = cache_calib_get(s, txn, id, &info->quality, err);
    if (rc) return rc;
    cache_record_meta m;
    pd_error e2;
    rc = cache_meta_get(s, txn, id, &m, &e2);
    if (rc && rc != PD_ENOTFOUND && rc != PD_EFORMAT) {
        *err = e2;
        return rc;
    }
    if (rc == PD_OK) {
        info->bytes = m.bytes;
        info->pinned = m.pinned;
        info->last_used = (int64_t)(m.stamp / 1000000u);
        info->hits = m.hits;
    } else { /* lost bookkeeping: verify repairs it; report what we can */
        info->bytes = h->size;
        info->pinned = false;
        info->last_used = h->created_at;
        info->hits = 0;
    }
    const cache_access p = pending_access(s, txn, id);
    if (p.stamp / 1000000u > (uint64_t)info->last_used) info->last_used = (int64_t)(p.stamp / 1000000u);
    info->hits += p.hits;
    return PD_OK;
}

/* The rest of a new record's write transaction, its header and streams
 * written: bookkeeping, LRU and index entries, the calibration curve, the
 * totals, eviction beyond max_bytes; then commit (or abort on failure). */
static int commit_new_record(pd_store *s, MDB_txn *txn, store_totals *t, const pd_prefix_id *id,
                             const uint8_t ikey[PD_SHA256_LEN], uint64_t total, bool pinned,
                             const pd_prefix_quality *q, uint64_t *stamp, pd_error *err) {
    cache_record_meta m = {.stamp = next_stamp(s), .bytes = total, .pinned = pinned};
    memcpy(m.index_key, ikey, PD_SHA256_LEN);
    int64_t n_evicted = 0;
    int rc;
    if ((rc = cache_meta_put(s, txn, id, &m, err)) || (rc = lru_put(s, txn, m.stamp, id, err)) ||
        (rc = cache_index_add(s, txn, ikey, id, err)) || (rc = cache_calib_put(s, txn, id, q, err))) {
        mdb_txn_abort(txn);
        return rc;
    }
    t->prefixes++;
    t->bytes += total;
    if (m.pinned) t->pinned++;
    if ((s->opts.max_bytes && t->bytes > s->opts.max_bytes && (rc = evict(s, txn, t, id, &n_evicted, err))) ||
        (rc = totals_put(s, txn, t, err))) {
        mdb_txn_abort(txn);
        return rc;
    }
    if ((rc = write_commit(s, txn, err))) return rc;
    if (n_evicted) {
        pthread_mutex_lock(&s->mu);
        s->evicted += n_evicted;
        pthread_mutex_unlock(&s->mu);
    }
    *stamp = m.stamp;
    return PD_OK;
}

int pd_store_put(pd_store *s, pd_prefix_info *info, const pd_token *tokens, int64_t n, const pd_kv_prefix *kv,
                 bool *existed, pd_error *err) {
    pd_error local;
    if (!err) err = &local; /* internal code always has somewhere to write */
    if (existed) *existed = false;
    if (!s || !info || !kv || (!tokens && n))
        return pd_errorf(err, PD_EINVAL, "pd_store_put: store, info, tokens and kv are required");
    if (n < 1 || n > INT32_MAX) return pd_errorf(err, PD_EINVAL, "a prefix of %" PRId64 " tokens cannot be stored", n);
    if (pd_kv_prefix_n_orig(kv) != n)
        return pd_errorf(err, PD_EINVAL, "the KV prefix covers %d tokens but %" PRId64 " token ids were given",
                         pd_kv_prefix_n_orig(kv), n);
    if ((unsigned)info->dtype > PD_KV_BF16) return pd_errorf(err, PD_EINVAL, "unknown KV dtype %d", (int)info->dtype);
    size_t spec_len = strnlen(info->spec, PD_PREFIX_SPEC_MAX), ns_len = strnlen(info->ns, PD_PREFIX_NS_MAX);
    if (spec_len == PD_PREFIX_SPEC_MAX || ns_len == PD_PREFIX_NS_MAX)
        return pd_errorf(err, PD_EINVAL, "the policy spec or namespace is longer than %d/%d bytes",
                         PD_PREFIX_SPEC_MAX - 1, PD_PREFIX_NS_MAX - 1);
    cache_header h = {0};
    pd_kv_prefix_shape(kv, &h.n_layer, &h.n_head_kv, &h.head_dim);
    if (h.n_layer < 1 || h.n_layer > CACHE_MAX_LAYERS || h.n_head_kv < 1 || h.n_head_kv > CACHE_MAX_HEADS ||
        h.head_dim < 1 || h.head_dim > CACHE_MAX_HEAD_DIM)
        return pd_errorf(err, PD_EINVAL, "a KV prefix of %d layers x %d kv heads x head_dim %d cannot be stored",
                         h.n_layer, h.n_head_kv, h.head_dim);
    memcpy(h.fingerprint, info->fingerprint, PD_SHA256_LEN);
    h.dtype = info->dtype;
    h.n_tokens = (int32_t)n;
    h.page_tokens = s->opts.page_tokens;
    h.quality = info->quality;
    h.created_at = (int64_t)time(NULL);
    h.spec = info->spec;
    h.spec_len = (uint32_t)spec_len;
    h.ns = info->ns;
    h.ns_len = (uint32_t)ns_len;

    /* Everything that costs O(size) but needs no transaction comes first,
     * so the write lock is held only for the copy into the map. */
    pd_prefix_id id;
    uint8_t ikey[PD_SHA256_LEN];
    int rc = pd_prefix_id_compute(h.fingerprint, tokens, n, info->spec, info->ns, &id);
    if (rc) return pd_errorf(err, rc, "out of memory hashing the prefix");
    if ((rc = cache_lookup_key(h.fingerprint, h.ns, ns_len, tokens, n, ikey, err))) return rc;
    size_t hsize;
    if ((rc = cache_header_size(&h, &hsize, err))) return rc;
    uint64_t total = hsize;
    for (int32_t l = 0; l < h.n_layer; l++)
        for (int32_t hd = 0; hd < h.n_head_kv; hd++) {
            size_t ss;
            rc = cache_stream_size(pd_kv_prefix_stream(kv, l, hd, NULL, NULL, NULL), h.head_dim, h.dtype,
                                   h.page_tokens, &ss, err);
            if (rc) return rc;
            if (!pd_add_ok(total, ss, &total)) return pd_errorf(err, PD_ERANGE, "the prefix is too large");
        }
    if (s->opts.max_bytes && total > s->opts.max_bytes)
        return pd_errorf(err, PD_ERANGE,
                         "the prefix needs %" PRIu64 " bytes, more than the store's size limit of %" PRIu64,
                         total, s->opts.max_bytes);

    MDB_txn *txn;
    if ((rc = write_begin(s, &txn, err))) return rc;
    store_totals t;
    if ((rc = totals_get(s, txn, &t, err))) goto fail;
    MDB_val k = cache_mval(id.b, PD_PREFIX_ID_LEN), v;
    rc = mdb_get(txn, s->records, &k, &v);
    if (rc == 0) {
        cache_header old;
        pd_error e2;
        if (cache_header_decode(v.mv_data, v.mv_size, &id, &old, &e2) == PD_OK) {
            if ((rc = info_from_record(s, txn, &id, &old, info, err))) goto fail;
            if ((rc = write_commit(s, txn, err))) return rc;
            if (existed) *existed = true;
            return PD_OK;
        }
        /* A corrupt copy of the same prefix: replace it. */
        if ((rc = remove_record(s, txn, &id, &t, err))) goto fail;
    } else if (rc != MDB_NOTFOUND) {
        rc = cache_lmdb_error(s, rc, "storing a prefix", err);
        goto fail;
    }

    v = cache_mval(NULL, hsize);
    if ((rc = mdb_put(txn, s->records, &k, &v, MDB_RESERVE | MDB_NOOVERWRITE)) != 0) {
        rc = cache_lmdb_error(s, rc, "storing a prefix", err);
        goto fail;
    }
    cache_header_write(v.mv_data, hsize, &h, kv, tokens);
    for (int32_t l = 0; l < h.n_layer; l++)
        for (int32_t hd = 0; hd < h.n_head_kv; hd++) {
            uint8_t skey[CACHE_STREAM_KEY_LEN];
            cache_stream_key(skey, &id, l, hd);
            size_t ss;
            if ((rc = cache_stream_size(pd_kv_prefix_stream(kv, l, hd, NULL, NULL, NULL), h.head_dim, h.dtype,
                                        h.page_tokens, &ss, err)))
                goto fail;
            MDB_val sk = cache_mval(skey, sizeof skey), sv = cache_mval(NULL, ss);
            if ((rc = mdb_put(txn, s->streams, &sk, &sv, MDB_RESERVE)) != 0) {
                rc = cache_lmdb_error(s, rc, "storing a prefix's rows", err);
                goto fail;
            }
            cache_stream_write(sv.mv_data, ss, kv, l, hd, h.head_dim, h.dtype, h.page_tokens);
        }
    uint64_t stamp;
    if ((rc = commit_new_record(s, txn, &t, &id, ikey, total, info->pinned, &info->quality, &stamp, err))) return rc;
    info->id = id;
    info->n_layer = h.n_layer;
    info->n_head_kv = h.n_head_kv;
    info->head_dim = h.head_dim;
    info->n_tokens = h.n_tokens;
    info->kept_rows = pd_kv_prefix_kept_rows(kv);
    info->created_at = h.created_at;
    info->last_used = (int64_t)(stamp / 1000000u);
    info->bytes = total;
    info->hits = 0;
    return PD_OK;
fail:
    mdb_txn_abort(txn);
    return rc;
}

/* ---- transfer (the shared tier) ---------------------------------------------- */

static int load_header(pd_store *s, MDB_txn *txn, const pd_prefix_id *id, cache_header *h, pd_error *err);

#define XFER_MAGIC "PDKVXFR1"
#define XFER_VERSION 1u
#define XFER_FIXED (8u + 4u + 4u + PD_PREFIX_ID_LEN)
#define XFER_ENTRY_FIXED 24u
enum { XFER_HEADER = 1, XFER_STREAM = 2, XFER_CALIB = 3 };

typedef struct xfer_buf {
    uint8_t *p;
    size_t len, cap;
} xfer_buf;

/* Make room for `more` bytes after b->len and return where they go. */
static uint8_t *xfer_grow(xfer_buf *b, size_t more, pd_error *err) {
    size_t need;
    if (!pd_add_ok(b->len, more, &need) || need > SIZE_MAX / 2) {
        pd_errorf(err, PD_ERANGE, "the prefix is too large to export");
        return NULL;
    }
    if (need > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < need) cap *= 2;
        uint8_t *p = realloc(b->p, cap);
        if (!p) {
            pd_errorf(err, PD_ENOMEM, "out of memory exporting a prefix (%zu bytes)", need);
            return NULL;
        }
        b->p = p;
        b->cap = cap;
    }
    uint8_t *at = b->p + b->len;
    b->len = need;
    return at;
}

static int xfer_add(xfer_buf *b, uint32_t kind, int32_t layer, int32_t head, const void *val, size_t size,
                    pd_error *err) {
    if (size > SIZE_MAX / 2) return pd_errorf(err, PD_ERANGE, "the prefix is too large to export");
    uint8_t *e = xfer_grow(b, XFER_ENTRY_FIXED + size, err);
    if (!e) return err->code;
    cache_wr_u32(e, kind);
    cache_wr_u32(e + 4, (uint32_t)layer);
    cache_wr_u32(e + 8, (uint32_t)head);
    cache_wr_u32(e + 12, 0);
    cache_wr_u64(e + 16, size);
    if (size) memcpy(e + XFER_ENTRY_FIXED, val, size);
    return PD_OK;
}

int pd_store_export(pd_store *s, const pd_prefix_id *id, uint8_t **out, size_t *out_len, pd_prefix_info *info,
                    pd_error *err) {
    pd_error local;
    if (!err) err = &local; /* internal code always has somewhere to write */
    *out = NULL;
    *out_len = 0;
    xfer_buf b = {0};
    MDB_txn *txn;
    int rc = read_begin(s, &txn, err);
    if (rc) return rc;
    cache_header h;
    MDB_val k = cache_mval(id->b, PD_PREFIX_ID_LEN), v;
    if ((rc = load_header(s, txn, id, &h, err))) goto done;
    if (info && (rc = info_from_record(s, txn, id, &h, info, err))) goto done;
    uint8_t *fixed = xfer_grow(&b, XFER_FIXED, err);
    if (!fixed) {
        rc = err->code;
        goto done;
    }
    if ((rc = mdb_get(txn, s->records, &k, &v))) {
        rc = cache_lmdb_error(s, rc, "exporting a prefix", err);
        goto done;
    }
    if ((rc = xfer_add(&b, XFER_HEADER, 0, 0, v.mv_data, v.mv_size, err))) goto done;
    uint32_t n_entries = 1;
    for (int32_t l = 0; l < h.n_layer; l++)
        for (int32_t hd = 0; hd < h.n_head_kv; hd++) {
            uint8_t skey[CACHE_STREAM_KEY_LEN];
            cache_stream_key(skey, id, l, hd);
            MDB_val sk = cache_mval(skey, sizeof skey), sv;
            cache_stream st;
            int mrc = mdb_get(txn, s->streams, &sk, &sv);
            if (mrc == MDB_NOTFOUND) {
                pd_errorf(err, PD_EFORMAT, "stream (layer %d, head %d) is missing", l, hd);
                rc = corrupt_error(id, err);
                goto done;
            }
            if (mrc) {
                rc = cache_lmdb_error(s, mrc, "exporting a prefix", err);
                goto done;
            }
            if ((rc = cache_stream_decode(sv.mv_data, sv.mv_size, &h, l, hd, &st, err))) {
                corrupt_error(id, err);
                goto done;
            }
            if ((rc = xfer_add(&b, XFER_STREAM, l, hd, sv.mv_data, sv.mv_size, err))) goto done;
            n_entries++;
        }
    if (s->has_calib) {
        int mrc = mdb_get(txn, s->calib, &k, &v);
        if (mrc == 0) {
            pd_prefix_quality q;
            if ((rc = cache_calib_decode(v.mv_data, v.mv_size, &q, err))) {
                corrupt_error(id, err);
                goto done;
            }
            if ((rc = xfer_add(&b, XFER_CALIB, 0, 0, v.mv_data, v.mv_size, err))) goto done;
            n_entries++;
        } else if (mrc != MDB_NOTFOUND) {
            rc = cache_lmdb_error(s, mrc, "exporting a prefix", err);
            goto done;
        }
    }
    const size_t body = b.len;
    uint8_t *digest = xfer_grow(&b, PD_SHA256_LEN, err);
    if (!digest) {
        rc = err->code;
        goto done;
    }
    memcpy(b.p, XFER_MAGIC, 8);
    cache_wr_u32(b.p + 8, XFER_VERSION);
    cache_wr_u32(b.p + 12, n_entries);
    memcpy(b.p + 16, id->b, PD_PREFIX_ID_LEN);
    rc = pd_sha256_buf(b.p, body, digest, err);
done:
    mdb_txn_abort(txn);
    if (rc) {
        free(b.p);
        return rc;
    }
    *out = b.p;
    *out_len = b.len;
    return PD_OK;
}

int pd_store_lookup_entry(pd_store *s, const pd_prefix_id *id, pd_prefix_lookup_entry *out, pd_error *err) {
    pd_error local;
    if (!err) err = &local; /* internal code always has somewhere to write */
    MDB_txn *txn;
    int rc = read_begin(s, &txn, err);
    if (rc) return rc;
    cache_header h;
    pd_token *toks = NULL;
    if ((rc = load_header(s, txn, id, &h, err))) goto done;
    if (!(toks = malloc((size_t)h.n_tokens * sizeof *toks))) {
        rc = pd_errorf(err, PD_ENOMEM, "out of memory for %d token ids", h.n_tokens);
        goto done;
    }
    memcpy(toks, h.tokens, (size_t)h.n_tokens * sizeof *toks);
    if ((rc = cache_lookup_key(h.fingerprint, h.ns, h.ns_len, toks, h.n_tokens, out->key, err))) goto done;
    out->n_tail = h.n_tokens % PD_LOOKUP_BLOCK;
    memcpy(out->tail, toks + (h.n_tokens - out->n_tail), (size_t)out->n_tail * sizeof *toks);
done:
    free(toks);
    mdb_txn_abort(txn);
    return rc;
}

/* One entry of a transfer blob, bounds-checked. */
static int xfer_entry(const uint8_t *blob, size_t end, size_t *at, uint32_t want_kind, int32_t layer, int32_t head,
                      const uint8_t **val, size_t *size, pd_error *err) {
    if (end - *at < XFER_ENTRY_FIXED)
        return pd_errorf(err, PD_EFORMAT, "the transferred record ends early (entry at byte %zu)", *at);
    const uint8_t *e = blob + *at;
    const uint64_t len = cache_rd_u64(e + 16);
    if (cache_rd_u32(e) != want_kind || cache_rd_u32(e + 4) != (uint32_t)layer || cache_rd_u32(e + 8) != (uint32_t)head)
        return pd_errorf(err, PD_EFORMAT, "the transferred record has an unexpected entry at byte %zu", *at);
    if (len > end - *at - XFER_ENTRY_FIXED)
        return pd_errorf(err, PD_EFORMAT, "the transferred record's entry at byte %zu overruns it", *at);
    *val = e + XFER_ENTRY_FIXED;
    *size = (size_t)len;
    *at += XFER_ENTRY_FIXED + (size_t)len;
    return PD_OK;
}

int pd_store_import(pd_store *s, const void *blob_in, size_t len, bool pinned, pd_prefix_info *info, bool *existed,
                    pd_error *err) {
    pd_error local;
    if (!err) err = &local; /* internal code always has somewhere to write */
    if (existed) *existed = false;
    const uint8_t *blob = blob_in;
    if (!blob || len < XFER_FIXED + PD_SHA256_LEN || memcmp(blob, XFER_MAGIC, 8) != 0)
        return pd_errorf(err, PD_EFORMAT, "not a prefixd transfer record");
    if (cache_rd_u32(blob + 8) != XFER_VERSION)
        return pd_errorf(err, PD_EFORMAT, "transfer record version %u; this build reads version %u",
                         cache_rd_u32(blob + 8), XFER_VERSION);
    uint8_t digest[PD_SHA256_LEN];
    const size_t end = len - PD_SHA256_LEN;
    int rc = pd_sha256_buf(blob, end, digest, err);
    if (rc) return rc;
    if (memcmp(digest, blob + end, PD_SHA256_LEN) != 0)
        return pd_errorf(err, PD_EFORMAT, "the transferred record fails its SHA-256");
    pd_prefix_id id;
    memcpy(id.b, blob + 16, PD_PREFIX_ID_LEN);
    const uint32_t n_entries = cache_rd_u32(blob + 12);

    /* Every value is verified as a read of the store would verify it
     * before anything is written: the header (which must hash to the id),
     * every page of every stream, the calibration curve. */
    size_t at = XFER_FIXED, hsize;
    const uint8_t *hval;
    cache_header h;
    if ((rc = xfer_entry(blob, end, &at, XFER_HEADER, 0, 0, &hval, &hsize, err)) ||
        (rc = cache_header_decode(hval, hsize, &id, &h, err)))
        goto bad;
    const uint64_t n_streams = (uint64_t)h.n_layer * (uint64_t)h.n_head_kv;
    if (n_entries != 1 + n_streams && n_entries != 2 + n_streams) {
        rc = pd_errorf(err, PD_EFORMAT, "the transferred record has %u entries for %" PRIu64 " streams", n_entries,
                       n_streams);
        goto bad;
    }
    const size_t streams_at = at;
    uint64_t total = hsize;
    for (int32_t l = 0; l < h.n_layer; l++)
        for (int32_t hd = 0; hd < h.n_head_kv; hd++) {
            const uint8_t *sval;
            size_t ssize;
            cache_stream st;
            if ((rc = xfer_entry(blob, end, &at, XFER_STREAM, l, hd, &sval, &ssize, err)) ||
                (rc = cache_stream_decode(sval, ssize, &h, l, hd, &st, err)))
                goto bad;
            total += ssize;
        }
    pd_prefix_quality q = {0};
    q.has_curve = false;
    const uint8_t *cval = NULL;
    size_t csize = 0;
    if (n_entries == 2 + n_streams &&
        ((rc = xfer_entry(blob, end, &at, XFER_CALIB, 0, 0, &cval, &csize, err)) ||
         (rc = cache_calib_decode(cval, csize, &q, err))))
        goto bad;
    if (at != end) {
        rc = pd_errorf(err, PD_EFORMAT, "the transferred record has %zu bytes after its last entry", end - at);
        goto bad;
    }
    if (s->opts.max_bytes && total > s->opts.max_bytes)
        return pd_errorf(err, PD_ERANGE,
                         "the prefix needs %" PRIu64 " bytes, more than the store's size limit of %" PRIu64,
                         total, s->opts.max_bytes);
    uint8_t ikey[PD_SHA256_LEN];
    pd_token *toks = malloc((size_t)h.n_tokens * sizeof *toks);
    if (!toks) return pd_errorf(err, PD_ENOMEM, "out of memory for %d token ids", h.n_tokens);
    memcpy(toks, h.tokens, (size_t)h.n_tokens * sizeof *toks);
    rc = cache_lookup_key(h.fingerprint, h.ns, h.ns_len, toks, h.n_tokens, ikey, err);
    free(toks);
    if (rc) return rc;

    MDB_txn *txn;
    if ((rc = write_begin(s, &txn, err))) return rc;
    store_totals t;
    if ((rc = totals_get(s, txn, &t, err))) goto fail;
    MDB_val k = cache_mval(id.b, PD_PREFIX_ID_LEN), v;
    int mrc = mdb_get(txn, s->records, &k, &v);
    if (mrc == 0) {
        cache_header old;
        pd_error e2;
        if (cache_header_decode(v.mv_data, v.mv_size, &id, &old, &e2) == PD_OK) {
            if (info && (rc = info_from_record(s, txn, &id, &old, info, err))) goto fail;
            if ((rc = write_commit(s, txn, err))) return rc;
            if (existed) *existed = true;
            return PD_OK;
        }
        if ((rc = remove_record(s, txn, &id, &t, err))) goto fail;
    } else if (mrc != MDB_NOTFOUND) {
        rc = cache_lmdb_error(s, mrc, "importing a prefix", err);
        goto fail;
    }
    v = cache_mval(hval, hsize);
    if ((mrc = mdb_put(txn, s->records, &k, &v, MDB_NOOVERWRITE)) != 0) {
        rc = cache_lmdb_error(s, mrc, "importing a prefix", err);
        goto fail;
    }
    at = streams_at;
    for (int32_t l = 0; l < h.n_layer; l++)
        for (int32_t hd = 0; hd < h.n_head_kv; hd++) {
            const uint8_t *sval;
            size_t ssize;
            (void)xfer_entry(blob, end, &at, XFER_STREAM, l, hd, &sval, &ssize, err); /* checked above */
            uint8_t skey[CACHE_STREAM_KEY_LEN];
            cache_stream_key(skey, &id, l, hd);
            MDB_val sk = cache_mval(skey, sizeof skey), sv = cache_mval(sval, ssize);
            if ((mrc = mdb_put(txn, s->streams, &sk, &sv, 0)) != 0) {
                rc = cache_lmdb_error(s, mrc, "importing a prefix's rows", err);
                goto fail;
            }
        }
    uint64_t stamp;
    if ((rc = commit_new_record(s, txn, &t, &id, ikey, total, pinned, &q, &stamp, err))) return rc;
    if (info) {
        cache_header_to_info(&h, info);
        info->id = id;
        info->quality.has_curve = q.has_curve;
        info->quality.curve_a = q.curve_a;
        info->quality.curve_b = q.curve_b;
        info->quality.n_points = q.n_points;
        memcpy(info->quality.point_retention, q.point_retention, sizeof q.point_retention);
        memcpy(info->quality.point_ratio, q.point_ratio, sizeof q.point_ratio);
        info->last_used = (int64_t)(stamp / 1000000u);
        info->bytes = total;
        info->pinned = pinned;
        info->hits = 0;
    }
    return PD_OK;
fail:
    mdb_txn_abort(txn);
    return rc;
bad:
    if (rc == PD_EFORMAT) pd_error_prefix(err, "transferred record");
    return rc;
}

/* ---- get -------------------------------------------------------------------- */

struct pd_prefix_ref {
    pd_store *s;
    MDB_txn *txn; /* kept while kv borrows rows from the map */
    pd_prefix_info info;
    pd_token *tokens;
    pd_kv_prefix *kv;
};

const pd_prefix_info *pd_prefix_ref_info(const pd_prefix_ref *r) { return &r->info; }
const pd_token *pd_prefix_ref_tokens(const pd_prefix_ref *r) { return r->tokens; }
const pd_kv_prefix *pd_prefix_ref_kv(const pd_prefix_ref *r) { return r->kv; }
bool pd_prefix_ref_borrows(const pd_prefix_ref *r) { return r->txn != NULL; }

int cache_ref_own(pd_prefix_ref *r, pd_error *err) {
    if (!r->txn) return PD_OK;
    pd_kv_prefix *copy;
    int rc = pd_kv_prefix_clone(r->kv, &copy, err);
    if (rc) return rc;
    pd_kv_prefix_free(r->kv); /* before the txn: it points into the map */
    r->kv = copy;
    mdb_txn_abort(r->txn);
    r->txn = NULL;
    return PD_OK;
}

void pd_prefix_ref_release(pd_prefix_ref *r) {
    if (!r) return;
    pd_kv_prefix_free(r->kv); /* before the txn: it points into the map */
    if (r->txn) mdb_txn_abort(r->txn);
    free(r->tokens);
    free(r);
}

/* Read and verify a record's header inside txn. */
static int load_header(pd_store *s, MDB_txn *txn, const pd_prefix_id *id, cache_header *h, pd_error *err) {
    MDB_val k = cache_mval(id->b, PD_PREFIX_ID_LEN), v;
    int rc = mdb_get(txn, s->records, &k, &v);
    if (rc == MDB_NOTFOUND) return not_found(id, err);
    if (rc) return cache_lmdb_error(s, rc, "reading a prefix", err);
    if ((rc = cache_header_decode(v.mv_data, v.mv_size, id, h, err))) return corrupt_error(id, err);
    return PD_OK;
}

/* Scratch for streams that cannot be borrowed. */
typedef struct conv_buf {
    int32_t *pos;
    float *k, *v;
    size_t cap_rows;
} conv_buf;

static int conv_reserve(conv_buf *b, size_t rows, size_t head_dim, pd_error *err) {
    if (rows <= b->cap_rows) return PD_OK;
    uint64_t vals;
    if (!pd_mul_ok(rows, head_dim, &vals) || vals > SIZE_MAX / sizeof(float))
        return pd_errorf(err, PD_ENOMEM, "a stream is too large to convert");
    int32_t *pos = realloc(b->pos, rows * sizeof *pos);
    if (pos) b->pos = pos;
    float *k = pos ? realloc(b->k, (size_t)vals * sizeof *k) : NULL;
    if (k) b->k = k;
    float *v = k ? realloc(b->v, (size_t)vals * sizeof *v) : NULL;
    if (!v) return pd_errorf(err, PD_ENOMEM, "out of memory converting a stored prefix");
    b->v = v;
    b->cap_rows = rows;
    return PD_OK;
}

/* Stored values are 2-byte aligned, so 16-bit rows can be read in place. */
static void rows_to_f32(float *dst, const uint8_t *src, size_t n, pd_kv_dtype dtype) {
    if (dtype == PD_KV_F32) {
        memcpy(dst, src, n * sizeof *dst);
    } else if (dtype == PD_KV_F16) {
        pd_fp16_to_fp32_row((const uint16_t *)(const void *)src, dst, n);
    } else {
        for (size_t i = 0; i < n; i++) dst[i] = pd_bf16_to_fp32(((const uint16_t *)(const void *)src)[i]);
    }
}

/* The stored dtype whose rows a prefix of kv type t can borrow. */
static bool borrowable(pd_kv_dtype stored, pd_type t) {
    return (stored == PD_KV_F32 && t == PD_TYPE_F32) || (stored == PD_KV_F16 && t == PD_TYPE_F16);
}

/* Verify every stream of a record; with kv, also fill it (borrowing rows
 * stored in kv's type when aligned, converting the rest). *borrowed: any
 * borrowed. */
static int load_streams(pd_store *s, MDB_txn *txn, const pd_prefix_id *id, const cache_header *h, pd_kv_prefix *kv,
                        bool *borrowed, uint64_t *bytes, pd_error *err) {
    conv_buf cb = {0};
    int rc = PD_OK;
    if (borrowed) *borrowed = false;
    uint64_t sum = h->size;
    for (int32_t l = 0; l < h->n_layer && !rc; l++)
        for (int32_t hd = 0; hd < h->n_head_kv && !rc; hd++) {
            uint8_t skey[CACHE_STREAM_KEY_LEN];
            cache_stream_key(skey, id, l, hd);
            MDB_val k = cache_mval(skey, sizeof skey), v;
            int mrc = mdb_get(txn, s->streams, &k, &v);
            if (mrc == MDB_NOTFOUND) {
                rc = pd_errorf(err, PD_EFORMAT, "stream (layer %d, head %d) is missing", l, hd);
                break;
            }
            if (mrc) {
                rc = cache_lmdb_error(s, mrc, "reading a prefix's rows", err);
                break;
            }
            cache_stream st;
            if ((rc = cache_stream_decode(v.mv_data, v.mv_size, h, l, hd, &st, err))) break;
            sum += st.size;
            if (!kv) continue;
            const size_t len = (size_t)st.len, vals = len * (size_t)h->head_dim;
            const uintptr_t addr_bits = (uintptr_t)st.pos | (uintptr_t)st.k | (uintptr_t)st.v;
            if (borrowable(h->dtype, pd_kv_prefix_type(kv)) && addr_bits % _Alignof(int32_t) == 0) {
                rc = pd_kv_prefix_set_borrowed(kv, l, hd, (const int32_t *)(const void *)st.pos, st.k, st.v, st.len,
                                               err);
                if (!rc && borrowed) *borrowed = true;
            } else {
                /* Small values sit in LMDB leaf pages with 2-byte alignment,
                 * and other dtypes need converting anyway (an f16 value
                 * through f32 and back is exact). */
                if ((rc = conv_reserve(&cb, len ? len : 1, (size_t)h->head_dim, err))) break;
                if (len) memcpy(cb.pos, st.pos, len * sizeof *cb.pos);
                rows_to_f32(cb.k, st.k, vals, h->dtype);
                rows_to_f32(cb.v, st.v, vals, h->dtype);
                rc = pd_kv_prefix_set(kv, l, hd, cb.pos, cb.k, cb.v, st.len, err);
            }
            if (rc == PD_EINVAL) { /* checksums passed but positions are invalid: a writer bug */
                pd_error_prefix(err, "stream (layer %d, head %d)", l, hd);
                rc = err->code = PD_EFORMAT;
            }
        }
    free(cb.pos);
    free(cb.k);
    free(cb.v);
    if (bytes) *bytes = sum;
    return rc;
}

/* Record an access, writing the pending ones when enough accumulated. */
static void note_access(pd_store *s, const pd_prefix_id *id, uint32_t hits) {
    if (record_access(s, id, hits) >= PENDING_FLUSH && !s->opts.read_only) {
        MDB_txn *w;
        pd_error e2;
        if (write_begin(s, &w, &e2) == PD_OK) (void)write_commit(s, w, &e2);
    }
}

static int get_ref(pd_store *s, const pd_prefix_id *id, bool use, pd_prefix_ref **out, pd_error *err) {
    pd_error local;
    if (!err) err = &local; /* internal code always has somewhere to write */
    *out = NULL;
    pd_prefix_ref *r = calloc(1, sizeof *r);
    if (!r) return pd_errorf(err, PD_ENOMEM, "out of memory for a prefix handle");
    r->s = s;
    int rc = read_begin(s, &r->txn, err);
    if (rc) {
        free(r);
        return rc;
    }
    cache_header h;
    if ((rc = load_header(s, r->txn, id, &h, err))) goto fail;
    if ((rc = info_from_record(s, r->txn, id, &h, &r->info, err))) goto fail;
    r->tokens = malloc((size_t)h.n_tokens * sizeof *r->tokens);
    if (!r->tokens) {
        rc = pd_errorf(err, PD_ENOMEM, "out of memory for %d token ids", h.n_tokens);
        goto fail;
    }
    memcpy(r->tokens, h.tokens, (size_t)h.n_tokens * sizeof *r->tokens);
    pd_hparams hp = {.n_layer = h.n_layer, .n_head_kv = h.n_head_kv, .head_dim = h.head_dim};
    if ((rc = pd_kv_prefix_create(&hp, h.n_tokens, s->opts.kv_type, &r->kv, err))) goto fail;
    bool borrowed;
    if ((rc = load_streams(s, r->txn, id, &h, r->kv, &borrowed, NULL, err))) {
        if (rc == PD_EFORMAT) corrupt_error(id, err);
        goto fail;
    }
    if (!borrowed) { /* nothing points into the map: give the reader slot back */
        mdb_txn_abort(r->txn);
        r->txn = NULL;
    }
    if (use) note_access(s, id, 0);
    *out = r;
    return PD_OK;
fail:
    pd_prefix_ref_release(r);
    return rc;
}

int pd_store_get(pd_store *s, const pd_prefix_id *id, pd_prefix_ref **out, pd_error *err) {
    return get_ref(s, id, true, out, err);
}

int pd_store_peek(pd_store *s, const pd_prefix_id *id, pd_prefix_ref **out, pd_error *err) {
    return get_ref(s, id, false, out, err);
}

void pd_store_note_use(pd_store *s, const pd_prefix_id *id) {
    note_access(s, id, 1);
}

bool pd_store_uses_pending(pd_store *s) {
    pthread_mutex_lock(&s->mu);
    const bool any = s->n_pending > 0;
    pthread_mutex_unlock(&s->mu);
    return any && !s->opts.read_only;
}

int pd_store_flush_uses(pd_store *s, pd_error *err) {
    if (!pd_store_uses_pending(s)) return PD_OK;
    MDB_txn *w;
    int rc = write_begin(s, &w, err);
    return rc ? rc : write_commit(s, w, err);
}

int pd_store_info(pd_store *s, const pd_prefix_id *id, pd_prefix_info *out, pd_error *err) {
    pd_error local;
    if (!err) err = &local; /* internal code always has somewhere to write */
    MDB_txn *txn;
    int rc = read_begin(s, &txn, err);
    if (rc) return rc;
    cache_header h;
    if (!(rc = load_header(s, txn, id, &h, err))) rc = info_from_record(s, txn, id, &h, out, err);
    mdb_txn_abort(txn);
    return rc;
}

int cache_record_exists(pd_store *s, const pd_prefix_id *id, pd_error *err) {
    MDB_txn *txn;
    int rc = read_begin(s, &txn, err);
    if (rc) return rc;
    MDB_val k = cache_mval(id->b, PD_PREFIX_ID_LEN), v;
    const int mrc = mdb_get(txn, s->records, &k, &v);
    mdb_txn_abort(txn);
    if (mrc == MDB_NOTFOUND) return not_found(id, err);
    return mrc ? cache_lmdb_error(s, mrc, "reading a prefix", err) : PD_OK;
}

/* ---- delete, pin ---------------------------------------------------------- */

/* LMDB lets a write transaction reuse only pages freed by transactions
 * older than the one before it (the previous snapshot must stay whole), so
 * the pages a delete frees would wait for some other write: after a full
 * map, one delete would not make room for the next put. One more small
 * commit (the totals, rewritten unchanged) releases them at once. Best
 * effort: the delete has succeeded either way. */
static void release_freed_pages(pd_store *s) {
    MDB_txn *txn;
    pd_error e;
    store_totals t;
    if (write_begin(s, &txn, &e)) return;
    if (totals_get(s, txn, &t, &e) || totals_put(s, txn, &t, &e)) {
        mdb_txn_abort(txn);
        return;
    }
    (void)write_commit(s, txn, &e);
}

int pd_store_delete(pd_store *s, const pd_prefix_id *id, pd_error *err) {
    pd_error local;
    if (!err) err = &local; /* internal code always has somewhere to write */
    MDB_txn *txn;
    int rc = write_begin(s, &txn, err);
    if (rc) return rc;
    store_totals t;
    if ((rc = totals_get(s, txn, &t, err)) || (rc = remove_record(s, txn, id, &t, err)) ||
        (rc = totals_put(s, txn, &t, err))) {
        mdb_txn_abort(txn);
        return rc;
    }
    if ((rc = write_commit(s, txn, err))) return rc;
    release_freed_pages(s);
    return PD_OK;
}

int pd_store_pin(pd_store *s, const pd_prefix_id *id, bool pinned, pd_error *err) {
    pd_error local;
    if (!err) err = &local; /* internal code always has somewhere to write */
    MDB_txn *txn;
    int rc = write_begin(s, &txn, err);
    if (rc) return rc;
    cache_record_meta m;
    store_totals t;
    MDB_val k = cache_mval(id->b, PD_PREFIX_ID_LEN), v;
    int grc = mdb_get(txn, s->records, &k, &v);
    if (grc == MDB_NOTFOUND)
        rc = not_found(id, err);
    else if (grc)
        rc = cache_lmdb_error(s, grc, "pinning a prefix", err);
    else if ((rc = cache_meta_get(s, txn, id, &m, err)) != PD_OK) {
        if (rc == PD_ENOTFOUND || rc == PD_EFORMAT) {
            pd_errorf(err, PD_EFORMAT, "its bookkeeping entry is missing or corrupt");
            rc = corrupt_error(id, err);
        }
    } else if (m.pinned != pinned && !(rc = totals_get(s, txn, &t, err))) {
        m.pinned = pinned;
        if (pinned)
            t.pinned++;
        else if (t.pinned)
            t.pinned--;
        if (!(rc = cache_meta_put(s, txn, id, &m, err))) rc = totals_put(s, txn, &t, err);
    }
    if (rc) {
        mdb_txn_abort(txn);
        return rc;
    }
    return write_commit(s, txn, err);
}

/* ---- list, verify, stats ---------------------------------------------------- */

int pd_store_list(pd_store *s, pd_store_visit_fn fn, void *ctx, pd_error *err) {
    pd_error local;
    if (!err) err = &local; /* internal code always has somewhere to write */
    MDB_txn *txn;
    int rc = read_begin(s, &txn, err);
    if (rc) return rc;
    MDB_cursor *c;
    if ((rc = mdb_cursor_open(txn, s->records, &c)) != 0) {
        mdb_txn_abort(txn);
        return cache_lmdb_error(s, rc, "listing prefixes", err);
    }
    MDB_val k, v;
    int op = MDB_FIRST, mrc;
    rc = PD_OK;
    while (!rc && (mrc = mdb_cursor_get(c, &k, &v, op)) == 0) {
        op = MDB_NEXT;
        if (k.mv_size != PD_PREFIX_ID_LEN) continue;
        pd_prefix_id id;
        memcpy(id.b, k.mv_data, PD_PREFIX_ID_LEN);
        cache_header h;
        pd_error e2;
        pd_prefix_info info;
        memset(&info, 0, sizeof info);
        if (cache_header_decode(v.mv_data, v.mv_size, &id, &h, &e2) == PD_OK &&
            info_from_record(s, txn, &id, &h, &info, &e2) == PD_OK)
            rc = fn(ctx, &id, &info, NULL);
        else
            rc = fn(ctx, &id, NULL, e2.msg);
    }
    if (!rc && mrc != MDB_NOTFOUND) rc = cache_lmdb_error(s, mrc, "listing prefixes", err);
    mdb_cursor_close(c);
    mdb_txn_abort(txn);
    return rc;
}

/* A growable list of ids. */
typedef struct id_list {
    pd_prefix_id *v;
    size_t n, cap;
} id_list;

static int id_list_add(id_list *l, const pd_prefix_id *id, pd_error *err) {
    if (l->n && memcmp(l->v[l->n - 1].b, id->b, PD_PREFIX_ID_LEN) == 0) return PD_OK; /* runs of one id */
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 16;
        pd_prefix_id *v = realloc(l->v, cap * sizeof *v);
        if (!v) return pd_errorf(err, PD_ENOMEM, "out of memory listing prefixes");
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = *id;
    return PD_OK;
}

static int id_cmp(const void *a, const void *b) { return memcmp(a, b, PD_PREFIX_ID_LEN); }

static bool record_exists(pd_store *s, MDB_txn *txn, const uint8_t *idb) {
    MDB_val k = cache_mval(idb, PD_PREFIX_ID_LEN), v;
    return mdb_get(txn, s->records, &k, &v) == 0;
}

/* Ids that have entries in db (the last 32 bytes of each key, or each
 * value) but no record: left behind only by a bug or by damage. */
static int find_orphans(pd_store *s, MDB_txn *txn, MDB_dbi db, bool in_value, size_t key_len, size_t id_off,
                        id_list *out, pd_error *err) {
    MDB_cursor *c;
    int rc = mdb_cursor_open(txn, db, &c);
    if (rc) return cache_lmdb_error(s, rc, "verifying the store", err);
    MDB_val k, v;
    int op = MDB_FIRST;
    int res = PD_OK;
    while (!res && (rc = mdb_cursor_get(c, &k, &v, op)) == 0) {
        op = MDB_NEXT;
        const MDB_val *x = in_value ? &v : &k;
        if (!in_value && key_len && x->mv_size != key_len) continue; /* the meta DB's store key */
        if (x->mv_size < id_off + PD_PREFIX_ID_LEN) continue;
        const uint8_t *idb = (const uint8_t *)x->mv_data + id_off;
        if (!record_exists(s, txn, idb)) {
            pd_prefix_id id;
            memcpy(id.b, idb, PD_PREFIX_ID_LEN);
            res = id_list_add(out, &id, err);
        }
    }
    mdb_cursor_close(c);
    if (res) return res;
    return rc == MDB_NOTFOUND ? PD_OK : cache_lmdb_error(s, rc, "verifying the store", err);
}

/* Remove every entry of an orphaned id (no record). */
static int remove_orphan(pd_store *s, MDB_txn *txn, const pd_prefix_id *id, pd_error *err) {
    int rc;
    MDB_cursor *c;
    if ((rc = mdb_cursor_open(txn, s->streams, &c)) != 0) return cache_lmdb_error(s, rc, "repairing the store", err);
    for (;;) {
        uint8_t first[CACHE_STREAM_KEY_LEN];
        cache_stream_key(first, id, 0, 0);
        MDB_val sk = cache_mval(first, sizeof first), sv;
        rc = mdb_cursor_get(c, &sk, &sv, MDB_SET_RANGE);
        if (rc || memcmp(sk.mv_data, id->b, PD_PREFIX_ID_LEN) != 0) break;
        if ((rc = mdb_cursor_del(c, 0)) != 0) break;
    }
    mdb_cursor_close(c);
    if (rc && rc != MDB_NOTFOUND) return cache_lmdb_error(s, rc, "repairing the store", err);
    MDB_val k = cache_mval(id->b, PD_PREFIX_ID_LEN);
    rc = mdb_del(txn, s->meta, &k, NULL);
    if (rc && rc != MDB_NOTFOUND) return cache_lmdb_error(s, rc, "repairing the store", err);
    if ((rc = scan_remove(s, txn, s->lru, false, id, err))) return rc;
    return scan_remove(s, txn, s->index, true, id, err);
}

/* Verify one record fully: header, every stream and page, bookkeeping
 * (present, intact, and counting the bytes actually stored). PD_EFORMAT
 * with the reason in *why when damaged; other codes are LMDB failures. */
static int check_record(pd_store *s, MDB_txn *txn, const MDB_val *k, const MDB_val *v, cache_header *h,
                        bool *header_ok, cache_record_meta *m, pd_error *why) {
    *header_ok = false;
    if (k->mv_size != PD_PREFIX_ID_LEN) return pd_errorf(why, PD_EFORMAT, "record key has %zu bytes", k->mv_size);
    pd_prefix_id id;
    memcpy(id.b, k->mv_data, PD_PREFIX_ID_LEN);
    int rc = cache_header_decode(v->mv_data, v->mv_size, &id, h, why);
    if (rc) return rc;
    *header_ok = true;
    uint64_t bytes;
    if ((rc = load_streams(s, txn, &id, h, NULL, NULL, &bytes, why))) return rc;
    pd_error e2;
    rc = cache_meta_get(s, txn, &id, m, &e2);
    if (rc == PD_ENOTFOUND || rc == PD_EFORMAT)
        return pd_errorf(why, PD_EFORMAT, "its bookkeeping entry is missing or corrupt");
    if (rc) {
        *why = e2;
        return rc;
    }
    if (m->bytes != bytes)
        return pd_errorf(why, PD_EFORMAT, "its bookkeeping says %" PRIu64 " bytes but %" PRIu64 " are stored", m->bytes,
                         bytes);
    pd_prefix_quality q;
    if ((rc = cache_calib_get(s, txn, &id, &q, &e2))) {
        *why = e2;
        return rc;
    }
    return PD_OK;
}

/* The totals recounted from the bookkeeping, inside a write transaction. */
static int recount_totals(pd_store *s, MDB_txn *txn, store_totals *t, pd_error *err) {
    memset(t, 0, sizeof *t);
    MDB_cursor *c;
    int rc = mdb_cursor_open(txn, s->meta, &c);
    if (rc) return cache_lmdb_error(s, rc, "recounting the store", err);
    MDB_val k, v;
    int op = MDB_FIRST;
    while ((rc = mdb_cursor_get(c, &k, &v, op)) == 0) {
        op = MDB_NEXT;
        if (k.mv_size != PD_PREFIX_ID_LEN || v.mv_size != CACHE_META_LEN) continue;
        const uint8_t *p = v.mv_data;
        t->prefixes++;
        t->bytes += cache_rd_u64(p + 8);
        t->pinned += cache_rd_u32(p + 16) & 1;
    }
    mdb_cursor_close(c);
    return rc == MDB_NOTFOUND ? PD_OK : cache_lmdb_error(s, rc, "recounting the store", err);
}

int pd_store_verify(pd_store *s, bool repair, pd_store_visit_fn fn, void *ctx, pd_store_verify_report *out,
                    pd_error *err) {
    pd_error local;
    if (!err) err = &local; /* internal code always has somewhere to write */
    pd_store_verify_report rep = {0};
    id_list bad = {0}, orphans = {0};
    store_totals fresh = {0};
    MDB_txn *txn;
    int rc = read_begin(s, &txn, err);
    if (rc) return rc;
    MDB_cursor *c;
    if ((rc = mdb_cursor_open(txn, s->records, &c)) != 0) {
        mdb_txn_abort(txn);
        return cache_lmdb_error(s, rc, "verifying the store", err);
    }
    MDB_val k, v;
    int op = MDB_FIRST, mrc;
    while (!rc && (mrc = mdb_cursor_get(c, &k, &v, op)) == 0) {
        op = MDB_NEXT;
        pd_prefix_id id = {{0}};
        memcpy(id.b, k.mv_data, k.mv_size < PD_PREFIX_ID_LEN ? k.mv_size : PD_PREFIX_ID_LEN);
        rep.checked++;
        cache_header h;
        pd_error why;
        pd_prefix_info info;
        memset(&info, 0, sizeof info);
        cache_record_meta m = {0};
        bool header_ok;
        int vrc = check_record(s, txn, &k, &v, &h, &header_ok, &m, &why);
        if (vrc && vrc != PD_EFORMAT) { /* an LMDB failure, not damage */
            *err = why;
            rc = vrc;
            break;
        }
        if (vrc == PD_OK) {
            fresh.prefixes++;
            fresh.bytes += m.bytes;
            fresh.pinned += m.pinned;
            continue;
        }
        pd_error e2;
        rep.corrupt++;
        if ((rc = id_list_add(&bad, &id, err))) break;
        if (fn) {
            if (header_ok) info_from_record(s, txn, &id, &h, &info, &e2);
            rc = fn(ctx, &id, header_ok ? &info : NULL, why.msg);
        }
    }
    mdb_cursor_close(c);
    if (!rc && mrc != MDB_NOTFOUND) rc = cache_lmdb_error(s, mrc, "verifying the store", err);
    if (!rc) rc = find_orphans(s, txn, s->streams, false, CACHE_STREAM_KEY_LEN, 0, &orphans, err);
    if (!rc) rc = find_orphans(s, txn, s->meta, false, PD_PREFIX_ID_LEN, 0, &orphans, err);
    if (!rc) rc = find_orphans(s, txn, s->lru, false, CACHE_LRU_KEY_LEN, 8, &orphans, err);
    if (!rc) rc = find_orphans(s, txn, s->index, true, 0, 0, &orphans, err);
    if (orphans.n > 1) { /* one report per id, though several databases may name it */
        qsort(orphans.v, orphans.n, sizeof *orphans.v, id_cmp);
        size_t u = 1;
        for (size_t i = 1; i < orphans.n; i++)
            if (id_cmp(&orphans.v[i], &orphans.v[u - 1]) != 0) orphans.v[u++] = orphans.v[i];
        orphans.n = u;
    }
    for (size_t i = 0; !rc && i < orphans.n; i++) {
        rep.corrupt++;
        if (fn) rc = fn(ctx, &orphans.v[i], NULL, "entries without a record (left by damage or an interrupted repair)");
    }
    store_totals stored;
    pd_error e3;
    bool totals_wrong = !rc && (totals_get(s, txn, &stored, &e3) != PD_OK || stored.prefixes != fresh.prefixes ||
                                stored.bytes != fresh.bytes || stored.pinned != fresh.pinned);
    mdb_txn_abort(txn);

    if (!rc && repair && (bad.n || orphans.n || totals_wrong)) {
        MDB_txn *w;
        if (!(rc = write_begin(s, &w, err))) {
            for (size_t i = 0; !rc && i < bad.n; i++) {
                /* Check again under the write lock: a writer may have
                 * replaced the damaged record since the read pass. */
                MDB_val bk = cache_mval(bad.v[i].b, PD_PREFIX_ID_LEN), bv;
                int grc = mdb_get(w, s->records, &bk, &bv);
                if (grc == 0) {
                    cache_header h;
                    bool header_ok;
                    cache_record_meta m;
                    pd_error why;
                    int crc = check_record(s, w, &bk, &bv, &h, &header_ok, &m, &why);
                    if (crc == PD_OK) continue;
                    if (crc != PD_EFORMAT) {
                        *err = why;
                        rc = crc;
                        break;
                    }
                    store_totals ignore = {0};
                    if ((rc = remove_record(s, w, &bad.v[i], &ignore, err))) break;
                    rep.deleted++;
                } else if (grc == MDB_NOTFOUND) { /* deleted meanwhile; sweep what may be left */
                    rc = remove_orphan(s, w, &bad.v[i], err);
                } else {
                    rc = cache_lmdb_error(s, grc, "repairing the store", err);
                }
            }
            for (size_t i = 0; !rc && i < orphans.n; i++)
                if (!record_exists(s, w, orphans.v[i].b)) rc = remove_orphan(s, w, &orphans.v[i], err);
            store_totals t;
            if (!rc && !(rc = recount_totals(s, w, &t, err))) rc = totals_put(s, w, &t, err);
            if (rc)
                mdb_txn_abort(w);
            else
                rc = write_commit(s, w, err);
        }
    }
    free(bad.v);
    free(orphans.v);
    if (!rc) rc = cache_auto_verify(s, repair, fn, ctx, &rep, err);
    if (out) *out = rep;
    return rc;
}

int pd_store_stats_get(pd_store *s, pd_store_stats *out, pd_error *err) {
    pd_error local;
    if (!err) err = &local; /* internal code always has somewhere to write */
    memset(out, 0, sizeof *out);
    MDB_txn *txn;
    int rc = read_begin(s, &txn, err);
    if (rc) return rc;
    store_totals t;
    cache_auto_totals a;
    rc = totals_get(s, txn, &t, err);
    if (!rc) rc = cache_auto_totals_get(s, txn, &a, err);
    mdb_txn_abort(txn);
    if (rc) return rc;
    out->auto_blocks = (int64_t)a.blocks;
    out->auto_bytes = a.bytes;
    MDB_envinfo ei;
    MDB_stat st;
    if ((rc = mdb_env_info(s->env, &ei)) != 0 || (rc = mdb_env_stat(s->env, &st)) != 0)
        return cache_lmdb_error(s, rc, "reading the store's statistics", err);
    out->prefixes = (int64_t)t.prefixes;
    out->pinned = (int64_t)t.pinned;
    out->bytes = t.bytes;
    out->map_size = ei.me_mapsize;
    out->map_used = ((uint64_t)ei.me_last_pgno + 1) * st.ms_psize;
    out->max_bytes = s->opts.max_bytes;
    pthread_mutex_lock(&s->mu);
    out->evicted = s->evicted;
    pthread_mutex_unlock(&s->mu);
    return PD_OK;
}
