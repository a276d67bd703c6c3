/* The automatic block cache: exact KV of recent prompts by chained block
 * keys, a byte-bounded LRU (see cache.h). One owner thread, no locks. */
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"

#define B PD_AUTO_BLOCK_TOKENS

typedef struct auto_block {
    uint8_t key[PD_SHA256_LEN];
    uint8_t parent[PD_SHA256_LEN];
    struct auto_block *bucket_next;
    struct auto_block *newer, *older; /* the LRU list */
    uint64_t op;                      /* the insert that last touched it (not evicted by that insert) */
    size_t alloc;                     /* bytes of this allocation, as counted */
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
                                .hits = c->hits, .misses = c->misses, .evictions = c->evictions};
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

static void remove_block(pd_autocache *c, auto_block *b) {
    auto_block **pp = &c->buckets[bucket_of(c, b->key)];
    while (*pp != b) pp = &(*pp)->bucket_next;
    *pp = b->bucket_next;
    lru_unlink(c, b);
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
            blocks[k] = b->payload;
            memcpy(parent, key, sizeof key);
        }
    }
    /* leaf first, so every parent ends up more recent than its children:
     * walk back through the parents found above */
    for (int64_t i = k - 1; i >= 0; i--) {
        auto_block *b = (auto_block *)((const unsigned char *)blocks[i] - offsetof(auto_block, payload));
        touch(c, b);
    }
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
    const size_t alloc = sizeof(auto_block) + c->block_bytes;
    for (; !rc && k < n_blocks; k++) {
        const pd_token *t = tokens + k * B;
        if ((rc = chain_key(parent, t, key, err))) break;
        auto_block *b = find(c, key, parent, t);
        if (!b) {
            const bool grow = (uint64_t)c->entries + 1 > (uint64_t)c->n_buckets;
            const size_t next_index = grow ? (c->n_buckets ? c->n_buckets : 64) * sizeof *c->buckets : 0;
            if (!make_room(c, alloc + next_index)) break; /* the chain outgrew the cache */
            if (grow && !grow_index(c)) {
                rc = pd_errorf(err, PD_ENOMEM, "out of memory for the automatic cache's index");
                break;
            }
            if (!(b = calloc(1, alloc))) {
                rc = pd_errorf(err, PD_ENOMEM, "out of memory for an automatic cache block");
                break;
            }
            if ((rc = fill(ctx, k, b->payload, err))) {
                free(b);
                break;
            }
            memcpy(b->key, key, sizeof key);
            memcpy(b->parent, parent, sizeof parent);
            memcpy(b->tokens, t, sizeof b->tokens);
            b->alloc = alloc;
            size_t j = bucket_of(c, key);
            b->bucket_next = c->buckets[j];
            c->buckets[j] = b;
            lru_push_newest(c, b);
            c->bytes += alloc;
            c->entries++;
        }
        b->op = c->op;
        chain[k] = b;
        memcpy(parent, key, sizeof key);
    }
    for (int64_t i = k - 1; i >= 0; i--) touch(c, chain[i]); /* leaf first, as in match */
    free(chain);
    return rc;
}
