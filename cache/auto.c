/* The automatic block cache: exact KV of recent prompts by chained block
 * keys, a byte-bounded LRU (see cache.h). One owner thread, no locks.
 * With a store attached (cache.auto_persist) blocks are also written to it
 * (auto_store.c) when the owner calls pd_autocache_persist, and a RAM miss
 * goes on into the store. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache/cache_internal.h"

#define B PD_AUTO_BLOCK_TOKENS

typedef struct auto_block {
    uint8_t key[PD_SHA256_LEN];
    uint8_t parent[PD_SHA256_LEN];
    struct auto_block *bucket_next;
    struct auto_block *newer, *older; /* the LRU list */
    uint64_t op;                      /* the insert that last touched it (not evicted by that insert) */
    size_t alloc;                     /* bytes of this allocation, as counted */
    uint64_t disk_stamp;              /* its LRU stamp in the store; 0 = not written there */
    bool dirty;                       /* to write, or to restamp, at the next persist */
    pd_token tokens[B];
    unsigned char payload[];
} auto_block;

struct pd_autocache {
    uint64_t max_bytes, bytes;
    size_t block_bytes;
    uint8_t fingerprint[PD_SHA256_LEN];
    int kv_type;
    auto_block **buckets;
    size_t n_buckets;                 /* a power of two */
    auto_block *newest, *oldest;
    uint64_t op;
    int64_t entries, hits, misses, evictions;
    /* persistence (NULL store: none) */
    pd_store *store;
    uint64_t max_disk_bytes, last_stamp;
    int64_t n_dirty;
    int64_t disk_reads, disk_rejected, disk_writes, disk_failures, disk_evictions;
};

int pd_autocache_create(uint64_t max_bytes, size_t block_bytes, const uint8_t fingerprint[PD_SHA256_LEN],
                        int kv_type, pd_autocache **out, pd_error *err) {
    *out = NULL;
    if (block_bytes == 0) return pd_errorf(err, PD_EINVAL, "the automatic cache needs a block size above 0 bytes");
    pd_autocache *c = calloc(1, sizeof *c);
    if (!c) return pd_errorf(err, PD_ENOMEM, "out of memory for the automatic prefix cache");
    c->max_bytes = max_bytes;
    c->block_bytes = block_bytes;
    memcpy(c->fingerprint, fingerprint, PD_SHA256_LEN);
    c->kv_type = kv_type;
    *out = c;
    return PD_OK;
}

void pd_autocache_free(pd_autocache *c) {
    if (!c) return;
    for (auto_block *b = c->newest, *nx; b; b = nx) {
        nx = b->older;
        free(b);
    }
    free(c->buckets);
    free(c);
}

void pd_autocache_stats_get(const pd_autocache *c, pd_autocache_stats *out) {
    *out = (pd_autocache_stats){.bytes = c->bytes, .max_bytes = c->max_bytes, .entries = c->entries,
                                .hits = c->hits, .misses = c->misses, .evictions = c->evictions,
                                .disk_reads = c->disk_reads, .disk_rejected = c->disk_rejected,
                                .disk_writes = c->disk_writes, .disk_failures = c->disk_failures,
                                .disk_evictions = c->disk_evictions, .pending = c->n_dirty};
}

/* ---- keys -------------------------------------------------------------- */

static int root_key(const pd_autocache *c, const char *ns, uint8_t out[PD_SHA256_LEN], pd_error *err) {
    static const char tag[] = "prefixd auto block v1";
    pd_sha256 h;
    int rc = pd_sha256_init(&h, err);
    if (rc) return rc;
    const uint32_t type = (uint32_t)c->kv_type;
    const char *n = ns ? ns : "";
    pd_sha256_update(&h, tag, sizeof tag);
    pd_sha256_update(&h, c->fingerprint, PD_SHA256_LEN);
    pd_sha256_update(&h, &type, sizeof type);
    pd_sha256_update(&h, n, strlen(n) + 1); /* the NUL ends the namespace */
    pd_sha256_final(&h, out);
    return PD_OK;
}

/* key = SHA-256(parent key, the block's token ids as little-endian int32) */
static int chain_key(const uint8_t parent[PD_SHA256_LEN], const pd_token *tokens, uint8_t out[PD_SHA256_LEN],
                     pd_error *err) {
    unsigned char le[4 * B];
    for (int i = 0; i < B; i++) {
        uint32_t t = (uint32_t)tokens[i];
        le[4 * i] = (unsigned char)t, le[4 * i + 1] = (unsigned char)(t >> 8);
        le[4 * i + 2] = (unsigned char)(t >> 16), le[4 * i + 3] = (unsigned char)(t >> 24);
    }
    pd_sha256 h;
    int rc = pd_sha256_init(&h, err);
    if (rc) return rc;
    pd_sha256_update(&h, parent, PD_SHA256_LEN);
    pd_sha256_update(&h, le, sizeof le);
    pd_sha256_final(&h, out);
    return PD_OK;
}

static size_t bucket_of(const pd_autocache *c, const uint8_t key[PD_SHA256_LEN]) {
    uint64_t v;
    memcpy(&v, key, sizeof v);
    return (size_t)v & (c->n_buckets - 1);
}

/* The block with this key, parent and tokens, or NULL. */
static auto_block *find(const pd_autocache *c, const uint8_t key[PD_SHA256_LEN], const uint8_t parent[PD_SHA256_LEN],
                        const pd_token *tokens) {
    if (!c->n_buckets) return NULL;
    for (auto_block *b = c->buckets[bucket_of(c, key)]; b; b = b->bucket_next)
        if (memcmp(b->key, key, PD_SHA256_LEN) == 0)
            return memcmp(b->parent, parent, PD_SHA256_LEN) == 0 && memcmp(b->tokens, tokens, sizeof b->tokens) == 0
                       ? b
                       : NULL;
    return NULL;
}

/* ---- the LRU list and the index ----------------------------------------- */

static void lru_unlink(pd_autocache *c, auto_block *b) {
    if (b->newer) b->newer->older = b->older;
    else c->newest = b->older;
    if (b->older) b->older->newer = b->newer;
    else c->oldest = b->newer;
    b->newer = b->older = NULL;
}

static void lru_push_newest(pd_autocache *c, auto_block *b) {
    b->older = c->newest;
    b->newer = NULL;
    if (c->newest) c->newest->newer = b;
    c->newest = b;
    if (!c->oldest) c->oldest = b;
}

static void touch(pd_autocache *c, auto_block *b) {
    lru_unlink(c, b);
    lru_push_newest(c, b);
}

static void mark_dirty(pd_autocache *c, auto_block *b) {
    if (c->store && !b->dirty) {
        b->dirty = true;
        c->n_dirty++;
    }
}

static void clear_dirty(pd_autocache *c, auto_block *b) {
    if (b->dirty) {
        b->dirty = false;
        c->n_dirty--;
    }
}

static void remove_block(pd_autocache *c, auto_block *b) {
    auto_block **pp = &c->buckets[bucket_of(c, b->key)];
    while (*pp != b) pp = &(*pp)->bucket_next;
    *pp = b->bucket_next;
    lru_unlink(c, b);
    clear_dirty(c, b);
    c->bytes -= b->alloc;
    c->entries--;
    free(b);
}

/* Evict least recently used blocks not touched by the current insert until
 * `need` more bytes fit. False when they cannot. */
static bool make_room(pd_autocache *c, uint64_t need) {
    auto_block *b = c->oldest;
    while (c->bytes + need > c->max_bytes && b) {
        auto_block *newer = b->newer;
        if (b->op != c->op) {
            remove_block(c, b);
            c->evictions++;
        }
        b = newer;
    }
    return c->bytes + need <= c->max_bytes;
}

/* Double the index (or make the first one); its bytes count like entries'. */
static bool grow_index(pd_autocache *c) {
    size_t n = c->n_buckets ? 2 * c->n_buckets : 64;
    auto_block **nb = calloc(n, sizeof *nb);
    if (!nb) return false;
    for (size_t i = 0; i < c->n_buckets; i++)
        for (auto_block *b = c->buckets[i], *nx; b; b = nx) {
            nx = b->bucket_next;
            uint64_t v;
            memcpy(&v, b->key, sizeof v);
            size_t j = (size_t)v & (n - 1);
            b->bucket_next = nb[j];
            nb[j] = b;
        }
    c->bytes = c->bytes - c->n_buckets * sizeof *nb + n * sizeof *nb;
    free(c->buckets);
    c->buckets = nb;
    c->n_buckets = n;
    return true;
}

/* A new block (payload unfilled) linked into the index and the LRU list,
 * protected from eviction by the current op. NULL with *rc == PD_OK when
 * it does not fit, with *rc set when memory runs out. */
static auto_block *add_block(pd_autocache *c, const uint8_t key[PD_SHA256_LEN], const uint8_t parent[PD_SHA256_LEN],
                             const pd_token *tokens, int *rc, pd_error *err) {
    *rc = PD_OK;
    const size_t alloc = sizeof(auto_block) + c->block_bytes;
    const bool grow = (uint64_t)c->entries + 1 > (uint64_t)c->n_buckets;
    const size_t next_index = grow ? (c->n_buckets ? c->n_buckets : 64) * sizeof *c->buckets : 0;
    if (!make_room(c, alloc + next_index)) return NULL;
    if (grow && !grow_index(c)) {
        *rc = pd_errorf(err, PD_ENOMEM, "out of memory for the automatic cache's index");
        return NULL;
    }
    auto_block *b = calloc(1, alloc);
    if (!b) {
        *rc = pd_errorf(err, PD_ENOMEM, "out of memory for an automatic cache block");
        return NULL;
    }
    memcpy(b->key, key, PD_SHA256_LEN);
    memcpy(b->parent, parent, PD_SHA256_LEN);
    memcpy(b->tokens, tokens, sizeof b->tokens);
    b->alloc = alloc;
    b->op = c->op;
    size_t j = bucket_of(c, key);
    b->bucket_next = c->buckets[j];
    c->buckets[j] = b;
    lru_push_newest(c, b);
    c->bytes += alloc;
    c->entries++;
    return b;
}

static auto_block *block_of(const void *payload) {
    return (auto_block *)((const unsigned char *)payload - offsetof(auto_block, payload));
}

/* Go on with a chain of k blocks from the store: each block read is
 * verified (checksum, parent key, tokens) and promoted into RAM. Stops at
 * the first block that is missing, damaged (counted), or does not fit. */
static int64_t match_disk(pd_autocache *c, const pd_token *tokens, int64_t k, int64_t max_blocks,
                          uint8_t parent[PD_SHA256_LEN], const void **blocks) {
    pd_error err = {0};
    MDB_txn *txn;
    if (cache_auto_begin(c->store, false, &txn, &err)) return k;
    c->op++; /* the chain so far must not make room for its own continuation */
    for (int64_t i = 0; i < k; i++) block_of(blocks[i])->op = c->op;
    uint8_t key[PD_SHA256_LEN];
    for (; k < max_blocks; k++) {
        const pd_token *t = tokens + k * B;
        if (chain_key(parent, t, key, &err)) break;
        auto_block *b = find(c, key, parent, t);
        if (!b) {
            int rc;
            if (!(b = add_block(c, key, parent, t, &rc, &err))) break;
            uint64_t stamp = 0;
            rc = cache_auto_read(c->store, txn, key, parent, t, c->kv_type, b->payload, c->block_bytes, &stamp, &err);
            if (rc) {
                if (rc == PD_EFORMAT) c->disk_rejected++;
                remove_block(c, b);
                break;
            }
            b->disk_stamp = stamp;
            c->disk_reads++;
        }
        b->op = c->op;
        mark_dirty(c, b); /* restamped at the next persist */
        blocks[k] = b->payload;
        memcpy(parent, key, PD_SHA256_LEN);
    }
    mdb_txn_abort(txn);
    return k;
}

/* ---- match and insert -------------------------------------------------- */

int64_t pd_autocache_match(pd_autocache *c, const char *ns, const pd_token *tokens, int64_t max_blocks,
                           const void **blocks) {
    if (max_blocks <= 0) return 0;
    uint8_t parent[PD_SHA256_LEN], key[PD_SHA256_LEN];
    pd_error err = {0};
    int64_t k = 0;
    if (root_key(c, ns, parent, &err) == PD_OK) {
        for (; k < max_blocks; k++) {
            if (chain_key(parent, tokens + k * B, key, &err)) break;
            auto_block *b = find(c, key, parent, tokens + k * B);
            if (!b) break;
            mark_dirty(c, b);
            blocks[k] = b->payload;
            memcpy(parent, key, sizeof key);
        }
        if (c->store && k < max_blocks) k = match_disk(c, tokens, k, max_blocks, parent, blocks);
    }
    /* leaf first, so every parent ends up more recent than its children:
     * walk back through the parents found above */
    for (int64_t i = k - 1; i >= 0; i--) touch(c, block_of(blocks[i]));
    if (k > 0) c->hits++;
    else c->misses++;
    return k;
}

int pd_autocache_insert(pd_autocache *c, const char *ns, const pd_token *tokens, int64_t n_blocks,
                        pd_autocache_fill_fn fill, void *ctx, pd_error *err) {
    if (n_blocks <= 0) return PD_OK;
    auto_block **chain = malloc(sizeof *chain * (size_t)n_blocks);
    if (!chain) return pd_errorf(err, PD_ENOMEM, "out of memory for a chain of %lld blocks", (long long)n_blocks);
    c->op++;
    uint8_t parent[PD_SHA256_LEN], key[PD_SHA256_LEN];
    int64_t k = 0;
    int rc = root_key(c, ns, parent, err);
    for (; !rc && k < n_blocks; k++) {
        const pd_token *t = tokens + k * B;
        if ((rc = chain_key(parent, t, key, err))) break;
        auto_block *b = find(c, key, parent, t);
        if (!b) {
            if (!(b = add_block(c, key, parent, t, &rc, err))) break; /* the chain outgrew the cache, or ENOMEM */
            if ((rc = fill(ctx, k, b->payload, err))) {
                remove_block(c, b);
                break;
            }
        }
        mark_dirty(c, b);
        b->op = c->op;
        chain[k] = b;
        memcpy(parent, key, sizeof key);
    }
    for (int64_t i = k - 1; i >= 0; i--) touch(c, chain[i]); /* leaf first, as in match */
    free(chain);
    return rc;
}

/* ---- persistence ----------------------------------------------------------- */

int pd_autocache_attach_store(pd_autocache *c, pd_store *s, uint64_t max_disk_bytes, pd_error *err) {
    if (s->opts.read_only || !s->has_auto)
        return pd_errorf(err, PD_EINVAL, "cache.auto_persist needs the prefix store in %s open writable", s->dir);
    c->store = s;
    c->max_disk_bytes = max_disk_bytes;
    for (auto_block *b = c->oldest; b; b = b->newer) mark_dirty(c, b);
    return PD_OK;
}

bool pd_autocache_persist_pending(const pd_autocache *c) { return c->store && c->n_dirty > 0; }

static uint64_t next_stamp(pd_autocache *c) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t t = (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
    if (t <= c->last_stamp) t = c->last_stamp + 1;
    return c->last_stamp = t;
}

int pd_autocache_persist(pd_autocache *c, uint64_t max_bytes, pd_error *err) {
    if (!pd_autocache_persist_pending(c)) return PD_OK;
    typedef struct done_block {
        auto_block *b;
        uint64_t stamp;
    } done_block;
    done_block *done = malloc(sizeof *done * (size_t)c->n_dirty);
    if (!done) return pd_errorf(err, PD_ENOMEM, "out of memory writing automatic blocks to the store");
    size_t n_done = 0;
    int64_t written = 0, evicted = 0;
    uint64_t bytes = 0, first = 0;
    cache_auto_totals t;
    MDB_txn *txn = NULL;
    int rc = cache_auto_begin(c->store, true, &txn, err);
    if (!rc) rc = cache_auto_totals_get(c->store, txn, &t, err);
    /* oldest first, so the store's LRU order is RAM's: a parent stays more
     * recent than its children there too */
    for (auto_block *b = c->oldest; !rc && b && bytes < max_bytes; b = b->newer) {
        if (!b->dirty) continue;
        const uint64_t stamp = next_stamp(c);
        if (!first) first = stamp;
        done[n_done++] = (done_block){b, stamp};
        int r = b->disk_stamp ? cache_auto_restamp(c->store, txn, b->key, stamp, err) : PD_ENOTFOUND;
        if (r == PD_ENOTFOUND) { /* new, or evicted from the store since */
            r = cache_auto_write(c->store, txn, b->key, b->parent, b->tokens, c->kv_type, b->payload, c->block_bytes,
                                 stamp, &t, err);
            written++;
            bytes += c->block_bytes;
        }
        rc = r;
    }
    /* this transaction's blocks are candidates too: the bound holds after
     * every commit (a block of RAM whose copy goes is written again when
     * next used) */
    if (!rc && first) rc = cache_auto_evict(c->store, txn, c->max_disk_bytes, &t, &evicted, err);
    if (!rc) rc = cache_auto_totals_put(c->store, txn, &t, err);
    if (!rc) rc = cache_auto_commit(c->store, txn, err);
    else if (txn) mdb_txn_abort(txn);
    if (!rc) {
        for (size_t i = 0; i < n_done; i++) {
            done[i].b->disk_stamp = done[i].stamp;
            clear_dirty(c, done[i].b);
        }
        c->disk_writes += written;
        c->disk_evictions += evicted;
    } else {
        /* Give up on every pending block until it is used again, so a full
         * store costs one failed transaction, not one per idle moment. */
        c->disk_failures++;
        for (auto_block *b = c->oldest; b; b = b->newer) clear_dirty(c, b);
        pd_error_prefix(err, "writing automatic blocks to the store");
    }
    free(done);
    return rc;
}
