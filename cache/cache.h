/* cache: the compressed prefix store.
 *
 * A stored prefix is identified by a SHA-256 prefix id over (format version,
 * model fingerprint, prefix token ids, canonical policy spec, namespace). Its
 * record lives in an LMDB environment: a checksummed header (with the token
 * ids and kept counts) and, per (layer, kv head), one stream value holding
 * the kept positions, K rows and V rows, checksummed in fixed-size pages of
 * `page_tokens` rows. A stream is one LMDB value so its rows are contiguous
 * in the memory map: streams whose dtype is the store's kv_type (f16 by
 * default, as the engine's KV cache) are attended to in place (zero-copy);
 * others (f32 records under an f16 cache, bf16 ones) are converted on read.
 * The byte layout is in
 * docs/store.md and is stable across builds (little-endian, versioned).
 *
 * Thread safety: one pd_store may be used from any number of threads
 * (MDB_NOTLS); LMDB serialises writers and readers never block the writer.
 * The hot tier (pd_hot) is thread-safe too.
 *
 * The stack: cache -> engine (pd_kv_prefix) -> kernels -> util.
 * This header is the folder's public contract. */
#ifndef PD_CACHE_H
#define PD_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/model.h" /* pd_model, pd_kv_prefix, pd_layer_kv */
#include "util/util.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_STORE_FORMAT_VERSION 1
#define PD_PREFIX_ID_LEN 32
#define PD_PREFIX_ID_HEX (2 * PD_PREFIX_ID_LEN + 1)
#define PD_PREFIX_SPEC_MAX 1024 /* canonical spec (+ ';' layout) incl. NUL */
#define PD_PREFIX_NS_MAX 128    /* namespace incl. NUL */
#define PD_LOOKUP_BLOCK 16      /* tokens per block of the lookup hash chain */

typedef struct pd_prefix_id {
    uint8_t b[PD_PREFIX_ID_LEN];
} pd_prefix_id;

/* SHA-256 over (PD_STORE_FORMAT_VERSION, fingerprint, n, tokens, spec, ns),
 * each length-prefixed little-endian; ns NULL == "". Returns PD_OK, or
 * PD_ENOMEM (out zeroed) when OpenSSL cannot allocate a digest context. */
int pd_prefix_id_compute(const uint8_t fingerprint[PD_SHA256_LEN], const pd_token *tokens, int64_t n,
                         const char *spec, const char *ns, pd_prefix_id *out);
void pd_prefix_id_hex(const pd_prefix_id *id, char out[PD_PREFIX_ID_HEX]);
/* 64 hex digits (either case). */
int pd_prefix_id_parse(const char *hex, pd_prefix_id *out, pd_error *err);

typedef enum pd_kv_dtype {
    PD_KV_F32 = 0,
    PD_KV_F16 = 1,
    PD_KV_BF16 = 2,
} pd_kv_dtype;

const char *pd_kv_dtype_name(pd_kv_dtype t);
bool pd_kv_dtype_from_name(const char *name, pd_kv_dtype *out);

#define PD_PREFIX_CALIB_POINTS 8

/* Quality numbers measured when the prefix was compressed; NaN = unknown. */
typedef struct pd_prefix_quality {
    double retention;      /* the policy's retention (calibrated or asked for) */
    double tau;            /* quality budget asked for; NaN = none */
    double nll_full;       /* probe NLL under the full prefix */
    double nll_ratio;      /* probe NLL ratio compressed / full */
    /* The curve the retention was chosen from, NLL ratio f(rho) =
     * 1 + a (rho^-b - 1) (policies.h), and the (retention, ratio) points
     * calibration measured to fit it; a curve given at registration
     * (zero-shot) has none. Kept beside the record (docs/store.md). */
    bool has_curve;
    double curve_a, curve_b;
    int32_t n_points;      /* 0..PD_PREFIX_CALIB_POINTS */
    double point_retention[PD_PREFIX_CALIB_POINTS], point_ratio[PD_PREFIX_CALIB_POINTS];
} pd_prefix_quality;

/* What a record says about itself (the decoded header plus bookkeeping). */
typedef struct pd_prefix_info {
    pd_prefix_id id;
    uint8_t fingerprint[PD_SHA256_LEN];
    char spec[PD_PREFIX_SPEC_MAX];
    char ns[PD_PREFIX_NS_MAX];
    int32_t n_layer, n_head_kv, head_dim;
    pd_kv_dtype dtype;
    int32_t n_tokens;          /* original prefix length n */
    int64_t kept_rows;         /* sum of kept counts over (layer, head) */
    pd_prefix_quality quality;
    int64_t created_at;        /* unix seconds */
    int64_t last_used;         /* unix seconds (approximate: see pd_store_get) */
    uint64_t bytes;            /* stored bytes of header + streams */
    bool pinned;               /* never evicted by the store's size limit */
    uint64_t hits;             /* requests served from it (pd_store_note_use) */
} pd_prefix_info;

/* ------------------------------------------------------------------------
 * The LMDB store
 * ------------------------------------------------------------------------ */

typedef struct pd_store_opts {
    const char *dir;           /* LMDB environment directory, created if missing */
    uint64_t map_size;         /* bytes (default 1 GiB) */
    uint64_t max_bytes;        /* 0 = no store-level eviction; else LRU beyond this */
    int32_t page_tokens;       /* rows per checksummed page (default 64) */
    unsigned max_readers;      /* concurrent read handles (default 126) */
    bool read_only;
    /* The element type readers attend with (the model's pd_model_kv_type):
     * PD_TYPE_F16 (default) or PD_TYPE_F32. pd_store_get hands out prefixes
     * of this type, borrowing rows stored in it and converting the rest. */
    pd_type kv_type;
} pd_store_opts;

void pd_store_opts_default(pd_store_opts *o);

typedef struct pd_store pd_store;

int pd_store_open(const pd_store_opts *o, pd_store **out, pd_error *err);
/* All pd_prefix_ref handles must be released first. */
void pd_store_close(pd_store *s);

/* Store a compressed prefix in ONE write transaction (all or nothing).
 * In: info->fingerprint, spec, ns, dtype, quality, pinned; the shape comes
 * from kv and n_tokens from pd_kv_prefix_n_orig(kv) (== n). Out: info->id,
 * kept_rows, created_at, last_used, bytes. An id already stored is left
 * alone (*existed = true, info filled from the stored record). With
 * max_bytes, least recently used unpinned prefixes are deleted in the same
 * transaction to make room. A full map is PD_ERANGE with a message naming
 * cache.map_size_mb; the store stays usable. */
int pd_store_put(pd_store *s, pd_prefix_info *info, const pd_token *tokens, int64_t n, const pd_kv_prefix *kv,
                 bool *existed, pd_error *err);

/* A verified, readable prefix. Its kv (of the store's kv_type) borrows rows
 * of that dtype from the map (kept valid by the handle's read transaction)
 * or owns converted rows. */
typedef struct pd_prefix_ref pd_prefix_ref;

/* Every checksum (header and every page) is verified before returning.
 * Missing: PD_ENOTFOUND. Corrupt: PD_EFORMAT with a message naming the
 * record and page; corrupt data is never returned. The access is recorded
 * for LRU in memory and written with the next write transaction. */
int pd_store_get(pd_store *s, const pd_prefix_id *id, pd_prefix_ref **out, pd_error *err);
/* pd_store_get for looking, not serving: the LRU order is left alone. */
int pd_store_peek(pd_store *s, const pd_prefix_id *id, pd_prefix_ref **out, pd_error *err);
const pd_prefix_info *pd_prefix_ref_info(const pd_prefix_ref *r);
/* A request was served from this prefix: one more hit, and its last use
 * (the LRU order) is now. Kept in memory and written with the next write
 * transaction (or when enough accumulate, or at close), like the accesses
 * of pd_store_get; a crash loses only those not yet written. */
void pd_store_note_use(pd_store *s, const pd_prefix_id *id);
/* Whether uses (pd_store_note_use, pd_store_get) wait to be written, and
 * write them now in one write transaction (the scheduler does when idle). */
bool pd_store_uses_pending(pd_store *s);
int pd_store_flush_uses(pd_store *s, pd_error *err);
const pd_token *pd_prefix_ref_tokens(const pd_prefix_ref *r);
const pd_kv_prefix *pd_prefix_ref_kv(const pd_prefix_ref *r);
/* Whether its kv borrows rows from the map (the handle then holds a read
 * transaction, i.e. one of max_readers slots and a snapshot, until it is
 * released). */
bool pd_prefix_ref_borrows(const pd_prefix_ref *r);
void pd_prefix_ref_release(pd_prefix_ref *r);

/* A record as one self-contained blob for another store (the shared tier,
 * docs/store.md "Transfer format"): the header, stream and calibration
 * values exactly as stored, each verified before it is exported, then a
 * SHA-256 over the whole. *out is malloc'd. info (may be NULL) is filled
 * as pd_store_info fills it. PD_ENOTFOUND, or PD_EFORMAT for a damaged
 * record (nothing damaged is ever exported). */
int pd_store_export(pd_store *s, const pd_prefix_id *id, uint8_t **out, size_t *len, pd_prefix_info *info,
                    pd_error *err);
/* What a shared index needs of a stored prefix besides its info: the key
 * the lookup index files it under and its token ids after the last whole
 * block (n_tokens % PD_LOOKUP_BLOCK of them), which that key does not cover. */
typedef struct pd_prefix_lookup_entry {
    uint8_t key[PD_SHA256_LEN];
    int32_t n_tail;
    pd_token tail[PD_LOOKUP_BLOCK];
} pd_prefix_lookup_entry;
int pd_store_lookup_entry(pd_store *s, const pd_prefix_id *id, pd_prefix_lookup_entry *out, pd_error *err);
/* Store an exported blob after verifying everything a read verifies (the
 * blob's SHA-256, the header's checksum and that it hashes to the blob's
 * id, every page of every stream, the calibration curve): one write
 * transaction, all or nothing, evicting like pd_store_put. A blob that
 * fails any check is PD_EFORMAT and nothing is written. An id already
 * stored is left alone (*existed = true). info (may be NULL) is filled. */
int pd_store_import(pd_store *s, const void *blob, size_t len, bool pinned, pd_prefix_info *info, bool *existed,
                    pd_error *err);
/* The lookup index's keys of every block boundary of tokens[0..n): out[b]
 * for b = 0..n/PD_LOOKUP_BLOCK (*n_keys of them, malloc'd); a stored
 * prefix of m tokens is found under out[m / PD_LOOKUP_BLOCK]. For a shared
 * index that mirrors the store's (cluster/). */
int pd_store_lookup_chain(const uint8_t fingerprint[PD_SHA256_LEN], const char *ns, const pd_token *tokens, int64_t n,
                          uint8_t (**out)[PD_SHA256_LEN], int64_t *n_keys, pd_error *err);

/* Header only (checksum verified). */
int pd_store_info(pd_store *s, const pd_prefix_id *id, pd_prefix_info *out, pd_error *err);
int pd_store_delete(pd_store *s, const pd_prefix_id *id, pd_error *err);
int pd_store_pin(pd_store *s, const pd_prefix_id *id, bool pinned, pd_error *err);

/* Every record's header, in id order; a non-zero return from fn stops the
 * walk and is returned. Records whose header is corrupt are reported with
 * info == NULL and `why`. */
typedef int (*pd_store_visit_fn)(void *ctx, const pd_prefix_id *id, const pd_prefix_info *info, const char *why);
int pd_store_list(pd_store *s, pd_store_visit_fn fn, void *ctx, pd_error *err);

typedef struct pd_store_verify_report {
    int64_t checked, corrupt, deleted;
    int64_t auto_checked; /* of checked: automatic blocks */
} pd_store_verify_report;

/* Check every header and page. Corrupt records go to fn (may be NULL) and
 * are deleted when `repair`. Index entries without a record are removed
 * when `repair` too. Automatic blocks are checked as well (counted in the
 * report; fn gets the block key as id, info NULL and a `why` starting
 * "automatic block"). */
int pd_store_verify(pd_store *s, bool repair, pd_store_visit_fn fn, void *ctx, pd_store_verify_report *out,
                    pd_error *err);

typedef struct pd_store_salvage_report {
    int64_t checked, copied, dropped; /* records seen, written to the new store, left behind */
    uint64_t bytes;                   /* stored bytes of the copied records */
    bool truncated;                   /* data.mdb was shorter than its last transaction */
    uint64_t missing_bytes;           /* ... by this much */
} pd_store_salvage_report;

/* Copy every record of the store in src_dir whose checksums verify into a
 * new store (dst->dir must not hold one yet; its map is made at least as
 * large as the source's data). The source is only read, with pread, never
 * mapped, so a truncated or damaged file is safe (a scratch store sits next
 * to dst->dir while this runs). Dropped records go to fn (info NULL when
 * even the header is lost). Damage is reported, not an error: the return is
 * non-zero only when the salvage itself could not run (unreadable source
 * meta pages, the new store cannot be written). */
int pd_store_salvage(const char *src_dir, const pd_store_opts *dst, pd_store_visit_fn fn, void *ctx,
                     pd_store_salvage_report *out, pd_error *err);

typedef struct pd_store_stats {
    int64_t prefixes, pinned;
    uint64_t bytes;            /* sum of records' bytes */
    uint64_t map_size, map_used;
    uint64_t max_bytes;
    int64_t evicted;           /* by the size limit since open */
    int64_t auto_blocks;       /* automatic blocks (cache.auto_persist), not counted above */
    uint64_t auto_bytes;       /* their records' bytes */
} pd_store_stats;

int pd_store_stats_get(pd_store *s, pd_store_stats *out, pd_error *err);

/* The longest stored prefix, for this model fingerprint and namespace (and
 * this spec when spec != NULL; otherwise ties go to the newest), that
 * tokens[0..n) starts with (its length <= n). Cost: O(n) hashing (a chain
 * of SHA-256 over blocks of PD_LOOKUP_BLOCK tokens) plus one index probe
 * per block boundary, independent of how many prefixes are stored.
 * PD_ENOTFOUND when none. */
int pd_store_lookup(pd_store *s, const uint8_t fingerprint[PD_SHA256_LEN], const char *ns, const char *spec,
                    const pd_token *tokens, int64_t n, pd_prefix_id *out, int32_t *matched, pd_error *err);

/* ------------------------------------------------------------------------
 * The hot tier: a byte-bounded LRU of loaded (verified) stored prefixes,
 * reference-counted so an entry in use is never freed. An entry keeps the
 * store handle: rows stored in the store's kv_type stay borrowed from the
 * map (no copy), other dtypes are converted once at load.
 * ------------------------------------------------------------------------ */

typedef struct pd_hot pd_hot;
typedef struct pd_hot_entry pd_hot_entry;

/* max_bytes: the bound on the entries' bytes (K and V rows in the store's
 * kv_type, positions, tokens), whether borrowed from the map or owned. */
int pd_hot_create(pd_store *s, uint64_t max_bytes, pd_hot **out, pd_error *err);
/* Every entry must have been released. */
void pd_hot_free(pd_hot *h);
/* A hit returns the cached entry; a miss loads it with pd_store_get (errors
 * pass through: PD_ENOTFOUND, PD_EFORMAT) and inserts it, evicting least
 * recently used entries nobody holds. An entry larger than max_bytes is
 * returned uncached (freed on release). Read snapshots are bounded: at most
 * half of the store's max_readers entries borrow rows (beyond that a
 * borrowed load is copied), and a borrowing entry older than
 * PD_HOT_SNAPSHOT_MAX_S is reloaded on its next acquire (holders keep the
 * old one), so writers can reuse the pages freed since. */
#define PD_HOT_SNAPSHOT_MAX_S 60
int pd_hot_acquire(pd_hot *h, const pd_prefix_id *id, pd_hot_entry **out, pd_error *err);
const pd_kv_prefix *pd_hot_entry_kv(const pd_hot_entry *e);
const pd_prefix_info *pd_hot_entry_info(const pd_hot_entry *e);
const pd_token *pd_hot_entry_tokens(const pd_hot_entry *e);
void pd_hot_release(pd_hot *h, pd_hot_entry *e);
/* Seconds a borrowing entry is served before its next acquire reloads it
 * (default PD_HOT_SNAPSHOT_MAX_S; tests shorten it). */
void pd_hot_set_max_age(pd_hot *h, double seconds);
/* Drop an id (after a delete): freed now, or when its last holder releases. */
void pd_hot_invalidate(pd_hot *h, const pd_prefix_id *id);

typedef struct pd_hot_stats {
    uint64_t bytes, max_bytes;
    int64_t entries, in_use, hits, misses, evictions;
    int64_t borrowing; /* cached entries whose rows are borrowed from the map (each holds a read snapshot) */
} pd_hot_stats;

void pd_hot_stats_get(pd_hot *h, pd_hot_stats *out);

/* ------------------------------------------------------------------------
 * The automatic block cache: exact (uncompressed) KV of recent prompts in
 * RAM, in blocks of PD_AUTO_BLOCK_TOKENS tokens, each keyed by a chained
 * SHA-256: block i's key hashes block i-1's key and block i's token ids, and
 * block 0's parent is a root over (model fingerprint, KV type, namespace).
 * So a key names a whole token prefix, and namespaces never share blocks.
 * A block's payload is opaque here (the engine's token block, see
 * pd_seq_export_kv); a hit also compares the stored parent key and token
 * ids, so a hash collision is a miss, not wrong rows.
 *
 * Bounded by max_bytes (every entry's allocation plus the hash index,
 * counted exactly); least recently used blocks go first. Using a chain
 * touches it leaf first, so a parent is always more recent than its
 * children and eviction never strands reachable blocks behind a missing
 * parent.
 *
 * Not thread-safe: one owner thread (the scheduler's engine thread) makes
 * every call; stats are copied out by that thread too.
 * ------------------------------------------------------------------------ */

/* 16 tokens: a prompt that diverges inside a block loses at most 15 tokens
 * of reuse, while the per-block overhead (about 150 bytes of key, tokens
 * and links, one hash per block) stays under 2% of the rows of even a
 * 260K-parameter model. */
#define PD_AUTO_BLOCK_TOKENS 16

typedef struct pd_autocache pd_autocache;

/* block_bytes: the payload of one block (> 0). max_bytes may be smaller
 * than one block: nothing is then cached. */
int pd_autocache_create(uint64_t max_bytes, size_t block_bytes, const uint8_t fingerprint[PD_SHA256_LEN],
                        int kv_type, pd_autocache **out, pd_error *err);
void pd_autocache_free(pd_autocache *c);

/* The longest chain of cached blocks the tokens start with, at most
 * max_blocks: its payloads in blocks[0..k) (valid until the next
 * pd_autocache_insert or free), k returned. Touches the chain; counts one
 * hit (k > 0) or miss, unless max_blocks is 0. */
int64_t pd_autocache_match(pd_autocache *c, const char *ns, const pd_token *tokens, int64_t max_blocks,
                           const void **blocks);

/* Fills one missing block's payload (block index i of the tokens). */
typedef int (*pd_autocache_fill_fn)(void *ctx, int64_t block, void *payload, pd_error *err);

/* Cache blocks [0, n_blocks) of tokens: present ones are touched, missing
 * ones filled by fill and inserted, evicting least recently used blocks
 * outside this chain. Stops early (PD_OK) when the chain outgrows
 * max_bytes; a fill failure is returned (what was inserted before stays). */
int pd_autocache_insert(pd_autocache *c, const char *ns, const pd_token *tokens, int64_t n_blocks,
                        pd_autocache_fill_fn fill, void *ctx, pd_error *err);

typedef struct pd_autocache_stats {
    uint64_t bytes, max_bytes;
    int64_t entries, hits, misses, evictions;
    /* with a store attached: blocks read from it (verified, promoted into
     * RAM), blocks it held that failed verification (a miss), blocks
     * written, persists that failed, blocks evicted from it, and blocks
     * waiting to be written or restamped */
    int64_t disk_reads, disk_rejected, disk_writes, disk_failures, disk_evictions, pending;
} pd_autocache_stats;

void pd_autocache_stats_get(const pd_autocache *c, pd_autocache_stats *out);

/* Persistence (cache.auto_persist): blocks also live in the store s, in its
 * "auto" database (docs/store.md), apart from registered prefixes: their
 * own LRU order and byte bound (max_disk_bytes, the records' bytes), never
 * counted in the store's totals or its size limit. A match that misses in
 * RAM goes on into the store: a block read from it is verified like a RAM
 * hit (checksum, parent key, token ids; a damaged one is a miss) and
 * promoted into RAM. Inserted and used blocks become pending; they reach
 * the store only when the owner calls pd_autocache_persist (the scheduler
 * does when idle and at shutdown), so no request waits for a disk write.
 * s must be open writable and outlive the cache. */
int pd_autocache_attach_store(pd_autocache *c, pd_store *s, uint64_t max_disk_bytes, pd_error *err);
bool pd_autocache_persist_pending(const pd_autocache *c);
/* One write transaction: pending blocks, oldest first, are written (new
 * ones, about max_bytes of them at most; the rest stay pending) or moved in
 * the store's LRU order (used ones), then the least recently used stored
 * blocks beyond max_disk_bytes are deleted. A failure (a full map: PD_ERANGE)
 * changes nothing in the store, is counted in disk_failures and leaves no
 * block pending: they are tried again when next used. */
int pd_autocache_persist(pd_autocache *c, uint64_t max_bytes, pd_error *err);

#ifdef __cplusplus
}
#endif
#endif
