/* The hot tier: a byte-bounded LRU of loaded stored prefixes.
 *
 * Entries live in a hash map keyed by prefix id (the id is a SHA-256, so its
 * first bytes are already a good hash). An entry nobody holds (refcount 0)
 * is also on the LRU list; eviction takes from the list's tail only, so an
 * entry held by a request is never freed under it. Consequently `bytes` may
 * exceed `max_bytes` while held entries alone account for the excess: the
 * bound is restored as soon as they are released.
 *
 * A miss loads the record with pd_store_get outside the lock (the store's
 * checksum verification, and conversion of rows stored in another dtype
 * than the store's kv_type, are the slow part) and keeps the store handle:
 * rows in the kv_type stay borrowed from the map, zero-copy. Such an entry
 * holds an LMDB read transaction, which takes one of max_readers slots and
 * pins a snapshot (pages freed after it cannot be reused by writers), so
 * both are bounded: at most half of max_readers cached entries borrow (a
 * load beyond that is copied and its handle released), and a borrowing
 * entry older than max_age is dropped from the map on its next acquire and
 * loaded afresh (its holders keep the old one until they release it). Two
 * threads missing the same id both load; the first to insert wins and the
 * other frees its copy and takes the winner's. A hit is served only after
 * a short read transaction confirms the record still exists: another
 * process sharing the store may have deleted it (a delete in this process
 * invalidates the entry directly).
 *
 * Stats describe the map: `entries`, `bytes` and `in_use` (entries with at
 * least one holder) count cached entries only; uncached oversize entries and
 * invalidated entries still held are outside the tier. */
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache_internal.h"

struct pd_hot_entry {
    pd_prefix_info info;
    pd_prefix_ref *ref;             /* the store handle: tokens and kv */
    bool borrows;                   /* ref holds a read transaction */
    double loaded_at;               /* pd_now_seconds() at load */
    uint64_t bytes;
    int64_t refs;
    bool cached;                    /* in the map (and counted in the stats) */
    pd_hot_entry *hnext;            /* hash chain */
    pd_hot_entry *prev, *next;      /* LRU list: only while cached && refs == 0 */
};

struct pd_hot {
    pd_store *store;
    pthread_mutex_t mu;
    pd_hot_entry **buckets;
    size_t n_buckets;               /* a power of two */
    pd_hot_entry *lru_head;         /* most recently released */
    pd_hot_entry *lru_tail;         /* next to evict */
    uint64_t bytes, max_bytes;
    int64_t entries, in_use, hits, misses, evictions;
    int64_t borrowing;              /* cached entries that borrow (hold a read transaction) */
    int64_t max_borrowing;          /* half the store's reader slots */
    double max_age;                 /* seconds a borrowing entry is served before it is reloaded */
    /* Bumped by every invalidate: a load that started before an invalidate
     * may hold the deleted record's data, so it is not inserted. */
    uint64_t generation;
};

#define HOT_MIN_BUCKETS 64

static void entry_free(pd_hot_entry *e) {
    if (!e) return;
    pd_prefix_ref_release(e->ref);
    free(e);
}

static size_t id_hash(const pd_prefix_id *id) {
    uint64_t h;
    memcpy(&h, id->b, sizeof h);
    return (size_t)h;
}

static pd_hot_entry **bucket_of(pd_hot *h, const pd_prefix_id *id) {
    return &h->buckets[id_hash(id) & (h->n_buckets - 1)];
}

static pd_hot_entry *map_find(pd_hot *h, const pd_prefix_id *id) {
    for (pd_hot_entry *e = *bucket_of(h, id); e; e = e->hnext)
        if (memcmp(e->info.id.b, id->b, PD_PREFIX_ID_LEN) == 0) return e;
    return NULL;
}

static void map_unlink(pd_hot *h, pd_hot_entry *e) {
    for (pd_hot_entry **pp = bucket_of(h, &e->info.id); *pp; pp = &(*pp)->hnext)
        if (*pp == e) {
            *pp = e->hnext;
            e->hnext = NULL;
            return;
        }
}

/* Double the table when it gets crowded; on allocation failure keep the
 * old table (longer chains, still correct). */
static void map_maybe_grow(pd_hot *h) {
    if ((uint64_t)h->entries < h->n_buckets || h->n_buckets > SIZE_MAX / 2 / sizeof(pd_hot_entry *)) return;
    size_t n = h->n_buckets * 2;
    pd_hot_entry **nb = calloc(n, sizeof *nb);
    if (!nb) return;
    for (size_t i = 0; i < h->n_buckets; i++) {
        pd_hot_entry *e = h->buckets[i];
        while (e) {
            pd_hot_entry *next = e->hnext;
            size_t b = id_hash(&e->info.id) & (n - 1);
            e->hnext = nb[b];
            nb[b] = e;
            e = next;
        }
    }
    free(h->buckets);
    h->buckets = nb;
    h->n_buckets = n;
}

static void lru_remove(pd_hot *h, pd_hot_entry *e) {
    if (e->prev) e->prev->next = e->next;
    else h->lru_head = e->next;
    if (e->next) e->next->prev = e->prev;
    else h->lru_tail = e->prev;
    e->prev = e->next = NULL;
}

static void lru_push_front(pd_hot *h, pd_hot_entry *e) {
    e->prev = NULL;
    e->next = h->lru_head;
    if (h->lru_head) h->lru_head->prev = e;
    else h->lru_tail = e;
    h->lru_head = e;
}

/* Take a cached entry out of the map and the stats (not off the LRU list). */
static void uncache_locked(pd_hot *h, pd_hot_entry *e) {
    map_unlink(h, e);
    e->cached = false;
    h->bytes -= e->bytes;
    h->entries--;
    if (e->borrows) h->borrowing--;
}

/* Evict unheld entries, least recently used first, until `incoming` more
 * bytes fit under the bound or nothing evictable is left. Victims are
 * chained on *victims to be freed after the lock is dropped. */
static void evict_locked(pd_hot *h, uint64_t incoming, pd_hot_entry **victims) {
    while (h->lru_tail && (h->bytes > h->max_bytes || incoming > h->max_bytes - h->bytes)) {
        pd_hot_entry *e = h->lru_tail;
        lru_remove(h, e);
        uncache_locked(h, e);
        h->evictions++;
        e->hnext = *victims;
        *victims = e;
    }
}

static void free_chain(pd_hot_entry *e) {
    while (e) {
        pd_hot_entry *next = e->hnext;
        entry_free(e);
        e = next;
    }
}

int pd_hot_create(pd_store *s, uint64_t max_bytes, pd_hot **out, pd_error *err) {
    *out = NULL;
    if (!s) return pd_errorf(err, PD_EINVAL, "hot tier: no store given");
    pd_hot *h = calloc(1, sizeof *h);
    if (!h) return pd_errorf(err, PD_ENOMEM, "out of memory for the hot tier");
    h->buckets = calloc(HOT_MIN_BUCKETS, sizeof *h->buckets);
    if (!h->buckets) {
        free(h);
        return pd_errorf(err, PD_ENOMEM, "out of memory for the hot tier's table");
    }
    int prc = pthread_mutex_init(&h->mu, NULL);
    if (prc != 0) {
        free(h->buckets);
        free(h);
        return pd_errorf(err, PD_ENOMEM, "hot tier: cannot create its mutex (error %d)", prc);
    }
    h->n_buckets = HOT_MIN_BUCKETS;
    h->store = s;
    h->max_bytes = max_bytes;
    h->max_borrowing = s->opts.max_readers / 2;
    h->max_age = PD_HOT_SNAPSHOT_MAX_S;
    *out = h;
    return PD_OK;
}

void pd_hot_free(pd_hot *h) {
    if (!h) return;
    /* Every entry has been released, so every cached entry is in the map;
     * free through the map (an entry still held would be a caller bug). */
    for (size_t i = 0; i < h->n_buckets; i++) free_chain(h->buckets[i]);
    free(h->buckets);
    pthread_mutex_destroy(&h->mu);
    free(h);
}

/* Bytes an entry accounts for: K and V rows in its type, positions, token
 * ids (rows are bounded by the map, so the sum cannot overflow). */
static uint64_t entry_bytes(const pd_hot_entry *e) {
    return pd_kv_prefix_bytes(pd_hot_entry_kv(e)) + (uint64_t)e->info.n_tokens * sizeof(pd_token);
}

/* An entry for a verified store handle (taken over: released with the
 * entry). With `copy`, a kv borrowed from the map is copied and the handle's
 * read transaction given back. */
static int entry_from_ref(pd_prefix_ref *r, bool copy, pd_hot_entry **out, pd_error *err) {
    *out = NULL;
    pd_hot_entry *e = calloc(1, sizeof *e);
    if (!e) {
        pd_prefix_ref_release(r);
        return pd_errorf(err, PD_ENOMEM, "out of memory for a hot-tier entry");
    }
    e->info = *pd_prefix_ref_info(r);
    e->ref = r;
    e->borrows = pd_prefix_ref_borrows(r);
    e->loaded_at = pd_now_seconds();
    if (copy && e->borrows) {
        int rc = cache_ref_own(r, err);
        if (rc) {
            entry_free(e);
            return pd_error_prefix(err, "hot tier: copying a stored prefix");
        }
        e->borrows = false;
    }
    e->bytes = entry_bytes(e);
    *out = e;
    return PD_OK;
}

static void take_locked(pd_hot *h, pd_hot_entry *e) {
    if (e->refs == 0 && e->cached) {
        lru_remove(h, e);
        h->in_use++;
    }
    e->refs++;
}

/* Take e out of the map; returns it when nobody holds it (the caller frees
 * it after unlocking), else NULL: its last release frees it. */
static pd_hot_entry *drop_locked(pd_hot *h, pd_hot_entry *e) {
    uncache_locked(h, e);
    if (e->refs > 0) {
        h->in_use--;
        return NULL;
    }
    lru_remove(h, e);
    return e;
}

int pd_hot_acquire(pd_hot *h, const pd_prefix_id *id, pd_hot_entry **out, pd_error *err) {
    *out = NULL;
    pthread_mutex_lock(&h->mu);
    pd_hot_entry *e = map_find(h, id), *stale = NULL;
    if (e && e->borrows && pd_now_seconds() - e->loaded_at > h->max_age) {
        /* Its snapshot is old: drop it from the map and load afresh. */
        stale = drop_locked(h, e);
        e = NULL;
    }
    if (e) {
        take_locked(h, e);
        h->hits++;
        pthread_mutex_unlock(&h->mu);
        /* Another process sharing the store may have deleted it: a hit is
         * served only while the record still exists (one short read). */
        int rc = cache_record_exists(h->store, id, err);
        if (rc) {
            pthread_mutex_lock(&h->mu);
            h->hits--; /* not served: a miss after all */
            h->misses++;
            pthread_mutex_unlock(&h->mu);
            pd_hot_release(h, e);
            if (rc == PD_ENOTFOUND) pd_hot_invalidate(h, id);
            return rc;
        }
        *out = e;
        return PD_OK;
    }
    h->misses++;
    uint64_t gen = h->generation;
    const bool copy = h->borrowing >= h->max_borrowing;
    pthread_mutex_unlock(&h->mu);
    entry_free(stale);

    pd_prefix_ref *r = NULL;
    int rc = pd_store_get(h->store, id, &r, err);
    if (rc != PD_OK) return rc;
    pd_hot_entry *ne = NULL;
    if ((rc = entry_from_ref(r, copy, &ne, err)) != PD_OK) return rc;

    pd_hot_entry *victims = NULL;
    pthread_mutex_lock(&h->mu);
    e = map_find(h, id);
    if (e) {
        /* Another thread loaded it meanwhile: take the winner's copy. */
        take_locked(h, e);
        pthread_mutex_unlock(&h->mu);
        entry_free(ne);
        *out = e;
        return PD_OK;
    }
    ne->refs = 1;
    if (ne->bytes > h->max_bytes || gen != h->generation) {
        /* Too big to cache, or possibly deleted while we loaded it: hand it
         * out uncached; the last release frees it. */
        ne->cached = false;
        pthread_mutex_unlock(&h->mu);
        *out = ne;
        return PD_OK;
    }
    evict_locked(h, ne->bytes, &victims);
    ne->cached = true;
    ne->hnext = *bucket_of(h, id);
    *bucket_of(h, id) = ne;
    h->entries++;
    h->in_use++;
    h->bytes += ne->bytes;
    if (ne->borrows) h->borrowing++;
    map_maybe_grow(h);
    pthread_mutex_unlock(&h->mu);
    free_chain(victims);
    *out = ne;
    return PD_OK;
}

const pd_kv_prefix *pd_hot_entry_kv(const pd_hot_entry *e) { return pd_prefix_ref_kv(e->ref); }
const pd_prefix_info *pd_hot_entry_info(const pd_hot_entry *e) { return &e->info; }
const pd_token *pd_hot_entry_tokens(const pd_hot_entry *e) { return pd_prefix_ref_tokens(e->ref); }

void pd_hot_set_max_age(pd_hot *h, double seconds) {
    pthread_mutex_lock(&h->mu);
    h->max_age = seconds;
    pthread_mutex_unlock(&h->mu);
}

void pd_hot_release(pd_hot *h, pd_hot_entry *e) {
    if (!e) return;
    pd_hot_entry *victims = NULL;
    pthread_mutex_lock(&h->mu);
    if (--e->refs == 0) {
        if (e->cached) {
            h->in_use--;
            lru_push_front(h, e);
            /* Held entries may have pushed the tier over its bound. */
            evict_locked(h, 0, &victims);
        } else {
            e->hnext = victims;
            victims = e;
        }
    }
    pthread_mutex_unlock(&h->mu);
    free_chain(victims);
}

void pd_hot_invalidate(pd_hot *h, const pd_prefix_id *id) {
    pd_hot_entry *victim = NULL;
    pthread_mutex_lock(&h->mu);
    h->generation++;
    pd_hot_entry *e = map_find(h, id);
    if (e) victim = drop_locked(h, e);
    pthread_mutex_unlock(&h->mu);
    entry_free(victim);
}

void pd_hot_stats_get(pd_hot *h, pd_hot_stats *out) {
    pthread_mutex_lock(&h->mu);
    out->bytes = h->bytes;
    out->max_bytes = h->max_bytes;
    out->entries = h->entries;
    out->in_use = h->in_use;
    out->hits = h->hits;
    out->misses = h->misses;
    out->evictions = h->evictions;
    out->borrowing = h->borrowing;
    pthread_mutex_unlock(&h->mu);
}
