/* The mask cache of a grammar: token sets per (vocabulary, rule, state),
 * reference-counted while a mask uses them, least recently used evicted
 * over a byte cap. Storage only; matcher.c builds the entries. */
#include <pthread.h>
#include <stdlib.h>

#include "grammar/grammar_internal.h"


/* per grammar: a state costs about 1 MiB at a 152k vocabulary (its bitset and
 * its tokens sorted by cost), and the server keeps 8 grammars */
#define CACHE_CAP_BYTES ((size_t)128 << 20)

pd_gcache *pd_gcache_new(void) {
    pd_gcache *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->table_cap = 256;
    c->table = calloc(c->table_cap, sizeof *c->table);
    if (!c->table || pthread_mutex_init(&c->lock, NULL)) {
        free(c->table);
        free(c);
        return NULL;
    }
    c->cap_bytes = CACHE_CAP_BYTES;
    return c;
}

void pd_gentry_free(gentry *e) {
    if (!e) return;
    free(e->accepted);
    free(e->by_cost);
    free(e->group_cost);
    free(e->group_start);
    free(e->deps);
    free(e);
}

void pd_gcache_free(pd_gcache *c) {
    if (!c) return;
    for (size_t i = 0; i < c->table_cap; i++)
        for (gentry *e = c->table[i], *next; e; e = next) {
            next = e->next;
            pd_gentry_free(e);
        }
    free(c->table);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

static size_t entry_slot(const pd_gcache *c, uint64_t vocab_id, int32_t rule, int32_t state) {
    uint64_t h = vocab_id ^ ((uint64_t)(uint32_t)rule << 32 | (uint32_t)state) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
    return (size_t)h & (c->table_cap - 1);
}

gentry *pd_gcache_find(pd_gcache *c, uint64_t vocab_id, int32_t rule, int32_t state) {
    for (gentry *e = c->table[entry_slot(c, vocab_id, rule, state)]; e; e = e->next)
        if (e->vocab_id == vocab_id && e->rule == rule && e->state == state) return e;
    return NULL;
}

static void cache_unlink(pd_gcache *c, gentry *e) {
    gentry **pp = &c->table[entry_slot(c, e->vocab_id, e->rule, e->state)];
    while (*pp != e) pp = &(*pp)->next;
    *pp = e->next;
    c->n_entries--;
    c->bytes -= e->bytes;
}

/* Evict least recently used entries while over the cap (locked). In-use
 * ones are unlinked now and freed by their last release. */
void pd_gcache_evict(pd_gcache *c) {
    while (c->bytes > c->cap_bytes && c->n_entries > 1) {
        gentry *lru = NULL;
        for (size_t i = 0; i < c->table_cap; i++)
            for (gentry *e = c->table[i]; e; e = e->next)
                if (!lru || e->tick < lru->tick) lru = e;
        cache_unlink(c, lru);
        lru->evicted = true;
        if (lru->refs == 0) pd_gentry_free(lru);
    }
}

void pd_gcache_insert(pd_gcache *c, gentry *e) {
    if (c->n_entries + 1 > c->table_cap) {
        size_t cap = c->table_cap * 2;
        gentry **t = calloc(cap, sizeof *t);
        if (t) {
            gentry **old = c->table;
            size_t old_cap = c->table_cap;
            c->table = t;
            c->table_cap = cap;
            for (size_t i = 0; i < old_cap; i++)
                for (gentry *x = old[i], *next; x; x = next) {
                    next = x->next;
                    size_t k = entry_slot(c, x->vocab_id, x->rule, x->state);
                    x->next = t[k];
                    t[k] = x;
                }
            free(old);
        }
    }
    size_t k = entry_slot(c, e->vocab_id, e->rule, e->state);
    e->next = c->table[k];
    c->table[k] = e;
    c->n_entries++;
    c->bytes += e->bytes;
}

void pd_gcache_release(pd_gcache *c, gentry *e) {
    pthread_mutex_lock(&c->lock);
    if (--e->refs == 0 && e->evicted) pd_gentry_free(e);
    pthread_mutex_unlock(&c->lock);
}

