/* Private to cache/: the store handle, the record codec (record.c) and the
 * lookup index (lookup.c). The byte layouts are documented in docs/store.md. */
#ifndef PD_CACHE_INTERNAL_H
#define PD_CACHE_INTERNAL_H

#include <lmdb.h>
#include <pthread.h>
#include <string.h>

#include "cache/cache.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
/* Rows are stored little-endian and attended to in place. */
#error "the prefix store supports little-endian hosts only"
#endif

/* ---- byte helpers (stored values are only 2-byte aligned: use memcpy) -- */

static inline uint32_t cache_rd_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline uint64_t cache_rd_u64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void cache_wr_u32(uint8_t *p, uint32_t v) { memcpy(p, &v, sizeof v); }
static inline void cache_wr_u64(uint8_t *p, uint64_t v) { memcpy(p, &v, sizeof v); }
static inline void cache_wr_be32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (24 - 8 * i));
}
static inline void cache_wr_be64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (56 - 8 * i));
}
static inline uint64_t cache_rd_be64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = (v << 8) | p[i];
    return v;
}

/* ---- the LMDB data file (store.c) ---------------------------------------- */

/* Reads data.mdb's meta pages without mapping it: *size is the file's size,
 * *needed the bytes its last committed transaction uses (a shorter file is
 * truncated), *page_size LMDB's page size. PD_EFORMAT when the meta pages
 * are unreadable or not LMDB's. */
int cache_data_file_check(const char *path, uint64_t *size, uint64_t *needed, uint32_t *page_size, pd_error *err);

/* ---- record codec (record.c) ------------------------------------------ */

#define CACHE_HEADER_MAGIC "PDKVHDR1"
#define CACHE_STREAM_MAGIC "PDKVSTR1"
#define CACHE_HEADER_FIXED 120u  /* bytes before the spec */
#define CACHE_STREAM_FIXED 72u   /* bytes before the page checksum table */
#define CACHE_ALIGN 64u          /* alignment of positions, K and V inside a stream value */
#define CACHE_MAX_LAYERS 4096
#define CACHE_MAX_HEADS 1024
#define CACHE_MAX_HEAD_DIM 65536

/* A decoded header. Pointers point into the stored value (unaligned). */
typedef struct cache_header {
    uint8_t fingerprint[PD_SHA256_LEN];
    int32_t n_layer, n_head_kv, head_dim;
    pd_kv_dtype dtype;
    int32_t n_tokens, page_tokens;
    pd_prefix_quality quality;
    int64_t created_at;
    const char *spec, *ns;   /* not NUL-terminated */
    uint32_t spec_len, ns_len;
    const uint8_t *kept;     /* u32 [n_layer][n_head_kv] */
    const uint8_t *tokens;   /* i32 [n_tokens] */
    size_t size;             /* whole value, checksum included */
} cache_header;

/* A decoded, verified stream. Pointers point into the stored value. */
typedef struct cache_stream {
    int32_t len;
    const uint8_t *pos, *k, *v;
    size_t size;
} cache_stream;

size_t cache_dtype_size(pd_kv_dtype t);

/* Size of a header value; h->spec_len, ns_len, n_layer, n_head_kv, n_tokens
 * are read. PD_ERANGE when it does not fit the format's u32 length. */
int cache_header_size(const cache_header *h, size_t *out, pd_error *err);
/* Write the header value (size from cache_header_size) into dst. */
void cache_header_write(uint8_t *dst, size_t size, const cache_header *h, const pd_kv_prefix *kv,
                        const pd_token *tokens);
/* Decode and verify (checksum, every length against size, field ranges,
 * and that the record's fields hash to *id when id != NULL). PD_EFORMAT
 * with a message (without the id) when anything is wrong. */
int cache_header_decode(const void *val, size_t size, const pd_prefix_id *id, cache_header *out, pd_error *err);
/* The header's kept count of stream (layer, head) / token i. */
uint32_t cache_header_kept(const cache_header *h, int32_t layer, int32_t head);
pd_token cache_header_token(const cache_header *h, int64_t i);
/* info fields that come from the header (not id, last_used, bytes, pinned). */
void cache_header_to_info(const cache_header *h, pd_prefix_info *info);

int cache_stream_size(int64_t len, int32_t head_dim, pd_kv_dtype dtype, int32_t page_tokens, size_t *out,
                      pd_error *err);
/* Encode stream (layer, head) of kv into dst (size from cache_stream_size),
 * converting rows to dtype. */
void cache_stream_write(uint8_t *dst, size_t size, const pd_kv_prefix *kv, int32_t layer, int32_t head,
                        int32_t head_dim, pd_kv_dtype dtype, int32_t page_tokens);
/* Decode and verify a stream against what the header says about it: its
 * header checksum, then every page checksum. PD_EFORMAT naming the page. */
int cache_stream_decode(const void *val, size_t size, const cache_header *h, int32_t layer, int32_t head,
                        cache_stream *out, pd_error *err);

/* ---- keys --------------------------------------------------------------- */

#define CACHE_STREAM_KEY_LEN (PD_PREFIX_ID_LEN + 8)
#define CACHE_LRU_KEY_LEN (8 + PD_PREFIX_ID_LEN)
#define CACHE_META_LEN 64
#define CACHE_STORE_KEY "prefixd-store"
#define CACHE_STORE_VAL_LEN 40

static inline void cache_stream_key(uint8_t key[CACHE_STREAM_KEY_LEN], const pd_prefix_id *id, int32_t layer,
                                    int32_t head) {
    memcpy(key, id->b, PD_PREFIX_ID_LEN);
    cache_wr_be32(key + PD_PREFIX_ID_LEN, (uint32_t)layer);
    cache_wr_be32(key + PD_PREFIX_ID_LEN + 4, (uint32_t)head);
}

/* ---- the store handle (store.c) ---------------------------------------- */

typedef struct cache_access {
    pd_prefix_id id;
    uint64_t stamp;
    uint32_t hits; /* requests served since the last flush */
} cache_access;

struct pd_store {
    MDB_env *env;
    MDB_dbi records, streams, index, lru, meta;
    MDB_dbi autob;           /* automatic blocks (auto_store.c) */
    bool has_auto;           /* false: read-only on a store that never had them */
    MDB_dbi calib;           /* calibration curves (pd_prefix_quality.has_curve) */
    bool has_calib;          /* false: read-only on a store that never had them */
    pd_store_opts opts;
    char *dir;
    pthread_mutex_t mu;      /* guards everything below */
    cache_access *pending;   /* accesses not yet written to meta/lru */
    size_t n_pending, cap_pending;
    cache_access *flushing;  /* accesses the write transaction flushing_txn writes */
    size_t n_flushing;
    size_t flushing_txn;
    uint64_t last_stamp;     /* keeps access stamps strictly increasing */
    int64_t evicted;
};

/* Replace a handle's kv, when it borrows rows from the map, by an owned
 * copy and give its read transaction back (the hot tier, when reader slots
 * run short). */
int cache_ref_own(pd_prefix_ref *r, pd_error *err);

/* PD_OK when the store (as of now, whatever process wrote it) holds a
 * record for id, PD_ENOTFOUND when not. One short read transaction. */
int cache_record_exists(pd_store *s, const pd_prefix_id *id, pd_error *err);

/* ---- meta.c: LMDB errors and a record's bookkeeping ------------------ */

/* Map an LMDB failure to a status and a message that says what to do. */
int cache_lmdb_error(const pd_store *s, int rc, const char *what, pd_error *err);

static inline MDB_val cache_mval(const void *p, size_t n) { return (MDB_val){.mv_size = n, .mv_data = (void *)p}; }

typedef struct cache_record_meta {
    uint64_t stamp; /* last use, microseconds since the epoch */
    uint64_t bytes;
    bool pinned;
    uint32_t hits;  /* requests served from it, saturating */
    uint8_t index_key[PD_SHA256_LEN];
} cache_record_meta;

/* PD_ENOTFOUND when absent, PD_EFORMAT when its checksum fails. */
int cache_meta_get(pd_store *s, MDB_txn *txn, const pd_prefix_id *id, cache_record_meta *m, pd_error *err);
int cache_meta_put(pd_store *s, MDB_txn *txn, const pd_prefix_id *id, const cache_record_meta *m, pd_error *err);
/* A record's calibration curve (calib[id], docs/store.md): get fills the
 * curve fields of q (has_curve false when there is none; PD_EFORMAT when
 * its checksum fails), put writes them when q->has_curve, del removes
 * them (absent is fine). */
int cache_calib_get(pd_store *s, MDB_txn *txn, const pd_prefix_id *id, pd_prefix_quality *q, pd_error *err);
int cache_calib_put(pd_store *s, MDB_txn *txn, const pd_prefix_id *id, const pd_prefix_quality *q, pd_error *err);
/* Verify a stored calib value and fill q's curve fields from it. */
int cache_calib_decode(const void *val, size_t size, pd_prefix_quality *q, pd_error *err);
int cache_calib_del(pd_store *s, MDB_txn *txn, const pd_prefix_id *id, pd_error *err);
/* The last-use stamp (microseconds) of a record; 0 when unknown. */
uint64_t cache_meta_stamp(pd_store *s, MDB_txn *txn, const pd_prefix_id *id);

/* ---- the lookup index (lookup.c) -------------------------------------- */

/* The index key of a prefix: the hash chain at its last full block. */
int cache_lookup_key(const uint8_t fingerprint[PD_SHA256_LEN], const char *ns, size_t ns_len, const pd_token *tokens,
                     int64_t n, uint8_t out[PD_SHA256_LEN], pd_error *err);
int cache_index_add(pd_store *s, MDB_txn *txn, const uint8_t key[PD_SHA256_LEN], const pd_prefix_id *id,
                    pd_error *err);
/* Removing an entry that is not there is not an error. */
int cache_index_del(pd_store *s, MDB_txn *txn, const uint8_t key[PD_SHA256_LEN], const pd_prefix_id *id,
                    pd_error *err);

/* ---- automatic blocks (auto_store.c) ------------------------------------
 * One database, "auto", four kinds of key (docs/store.md):
 *   'b' key[32]            -> the block record (CACHE_AUTO_MAGIC ...)
 *   's' key[32]            -> u64 last-use stamp (microseconds)
 *   'l' be64 stamp key[32] -> empty (the LRU order among automatic blocks)
 *   't'                    -> u64 blocks, u64 bytes (their totals)
 * Registered prefixes' databases and totals never see them. */

#define CACHE_AUTO_MAGIC "PDAUTOB1"
#define CACHE_AUTO_VERSION 1u
#define CACHE_AUTO_TOKENS PD_AUTO_BLOCK_TOKENS
#define CACHE_AUTO_FIXED (8u + 4u + 4u + 8u + PD_SHA256_LEN + 4u * CACHE_AUTO_TOKENS)

typedef struct cache_auto_totals {
    uint64_t blocks, bytes; /* bytes: the records' values */
} cache_auto_totals;

/* A transaction for automatic blocks (a write one is refused read-only);
 * commit ends a write one. */
int cache_auto_begin(pd_store *s, bool write, MDB_txn **txn, pd_error *err);
int cache_auto_commit(pd_store *s, MDB_txn *txn, pd_error *err);
int cache_auto_totals_get(pd_store *s, MDB_txn *txn, cache_auto_totals *t, pd_error *err);
/* Read and verify block `key`: its checksum, version, kv_type, payload size,
 * and that its parent key and tokens are these (as the RAM path compares).
 * The payload is copied out; *stamp is its last-use stamp. PD_ENOTFOUND
 * when absent, PD_EFORMAT (a message saying what) when it fails a check. */
int cache_auto_read(pd_store *s, MDB_txn *txn, const uint8_t key[PD_SHA256_LEN], const uint8_t parent[PD_SHA256_LEN],
                    const pd_token *tokens, int kv_type, void *payload, size_t payload_bytes, uint64_t *stamp,
                    pd_error *err);
/* Write (or replace) a block with this stamp, keeping t current. */
int cache_auto_write(pd_store *s, MDB_txn *txn, const uint8_t key[PD_SHA256_LEN], const uint8_t parent[PD_SHA256_LEN],
                     const pd_token *tokens, int kv_type, const void *payload, size_t payload_bytes, uint64_t stamp,
                     cache_auto_totals *t, pd_error *err);
/* Move a stored block to `stamp` in the LRU order. PD_ENOTFOUND when it is
 * not stored (any more). */
int cache_auto_restamp(pd_store *s, MDB_txn *txn, const uint8_t key[PD_SHA256_LEN], uint64_t stamp, pd_error *err);
/* Delete least recently used blocks until t's bytes fit max_bytes;
 * *n_evicted counts them. */
int cache_auto_evict(pd_store *s, MDB_txn *txn, uint64_t max_bytes, cache_auto_totals *t, int64_t *n_evicted,
                     pd_error *err);
int cache_auto_totals_put(pd_store *s, MDB_txn *txn, const cache_auto_totals *t, pd_error *err);
/* pd_store_verify's pass over automatic blocks: damaged ones go to fn
 * (with the block key as id) and are deleted when `repair`; the totals are
 * recounted when `repair` and wrong. Adds to *rep. */
int cache_auto_verify(pd_store *s, bool repair, pd_store_visit_fn fn, void *ctx, pd_store_verify_report *rep,
                      pd_error *err);

#endif
