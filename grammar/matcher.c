/* grammar: the matcher. State = a set of stacks of (rule, DFA state)
 * frames; frames are immutable, parent-linked and interned per pool, so
 * equal stacks are one pointer (dedupe is pointer equality) and stacks
 * share their bottoms.
 *
 * Masks: for a stack's top frame (rule, state) the tokens it admits are
 * found once by a walk of the vocabulary trie from that frame alone, with
 * an unknown parent below it, and cached in the grammar: tokens consumed
 * within the frame (a bitset, and the same tokens sorted by the shortest
 * completion they leave, for the budget), and the trie nodes where the
 * frame's rule can end with bytes of the token left ("dependents": those
 * bytes continue on the real parent, checked at mask time by a walk of
 * that subtree only). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_internal.h"

#define COST_CAP (INT64_MAX / 4)

/* ---- frames and pools --------------------------------------------------- */

typedef struct gframe {
    int32_t rule, state;
    struct gframe *parent;
    int64_t cum; /* shortest completion of the whole stack from this frame */
    uint32_t mark;
    struct gframe *hnext, *fwd;
} gframe;

#define CHUNK_FRAMES 4096

typedef struct fpool {
    const pd_grammar *g;
    gframe **chunks;
    size_t n_chunks, cap_chunks, used; /* used: frames in the last chunk */
    size_t n_frames;
    gframe **table;
    size_t table_cap;
    uint32_t epoch;
} fpool;

typedef struct flist {
    gframe **v;
    size_t n, cap;
} flist;

static int flist_push(flist *l, gframe *f) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        gframe **v = realloc(l->v, cap * sizeof *v);
        if (!v) return PD_ENOMEM;
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = f;
    return PD_OK;
}

static void fpool_free(fpool *p) {
    for (size_t i = 0; i < p->n_chunks; i++) free(p->chunks[i]);
    free(p->chunks);
    free(p->table);
    memset(p, 0, sizeof *p);
}

static size_t frame_hash(int32_t rule, int32_t state, const gframe *parent, size_t mask) {
    uint64_t h = ((uint64_t)(uint32_t)rule << 32 | (uint32_t)state) ^ ((uint64_t)(uintptr_t)parent * 0x9E3779B97F4A7C15ull);
    h ^= h >> 31;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 29;
    return (size_t)h & mask;
}

static int fpool_grow_table(fpool *p) {
    size_t cap = p->table_cap ? p->table_cap * 2 : 1024;
    gframe **t = calloc(cap, sizeof *t);
    if (!t) return PD_ENOMEM;
    for (size_t i = 0; i < p->table_cap; i++) {
        for (gframe *f = p->table[i], *next; f; f = next) {
            next = f->hnext;
            size_t k = frame_hash(f->rule, f->state, f->parent, cap - 1);
            f->hnext = t[k];
            t[k] = f;
        }
    }
    free(p->table);
    p->table = t;
    p->table_cap = cap;
    return PD_OK;
}

/* The one frame (rule, state, parent) of this pool; NULL when out of memory. */
static gframe *intern(fpool *p, int32_t rule, int32_t state, gframe *parent) {
    if (p->n_frames >= p->table_cap && fpool_grow_table(p)) return NULL;
    size_t k = frame_hash(rule, state, parent, p->table_cap - 1);
    for (gframe *f = p->table[k]; f; f = f->hnext)
        if (f->rule == rule && f->state == state && f->parent == parent) return f;
    if (p->n_chunks == 0 || p->used == CHUNK_FRAMES) {
        if (p->n_chunks == p->cap_chunks) {
            size_t cap = p->cap_chunks ? p->cap_chunks * 2 : 16;
            gframe **c = realloc(p->chunks, cap * sizeof *c);
            if (!c) return NULL;
            p->chunks = c;
            p->cap_chunks = cap;
        }
        gframe *chunk = malloc(CHUNK_FRAMES * sizeof *chunk);
        if (!chunk) return NULL;
        p->chunks[p->n_chunks++] = chunk;
        p->used = 0;
    }
    gframe *f = &p->chunks[p->n_chunks - 1][p->used++];
    int64_t own = p->g->rules[rule].states[state].min_bytes;
    int64_t below = parent ? parent->cum : 0;
    f->rule = rule;
    f->state = state;
    f->parent = parent;
    f->cum = own + below > COST_CAP ? COST_CAP : own + below;
    f->mark = 0;
    f->fwd = NULL;
    f->hnext = p->table[k];
    p->table[k] = f;
    p->n_frames++;
    return f;
}

static const pd_gstate *frame_state(const fpool *p, const gframe *f) {
    return &p->g->rules[f->rule].states[f->state];
}

/* Every stack reachable from in[0..n) without consuming (push a callee at a
 * reference, pop an accepting frame to its parent), appended to out when its
 * top can consume a byte or a token. *bottom: some stack popped its last
 * frame (the text is complete, or, in a cache walk, the frame was left);
 * *min_cost: the shortest completion over all of them. */
static int close_stacks(fpool *p, gframe *const *in, size_t n, flist *out, flist *work, bool *bottom,
                        int64_t *min_cost) {
    p->epoch++;
    work->n = 0;
    *bottom = false;
    int64_t best = COST_CAP;
    for (size_t i = 0; i < n; i++)
        if (in[i]->mark != p->epoch) {
            in[i]->mark = p->epoch;
            if (flist_push(work, in[i])) return PD_ENOMEM;
        }
    while (work->n) {
        gframe *f = work->v[--work->n];
        const pd_gstate *st = frame_state(p, f);
        if (f->cum < best) best = f->cum;
        if ((st->n_byte || st->n_tok) && flist_push(out, f)) return PD_ENOMEM;
        const pd_grule *r = &p->g->rules[f->rule];
        for (uint32_t i = 0; i < st->n_ref; i++) {
            const pd_gsym_edge *e = &r->refs[st->ref_off + i];
            gframe *ret = intern(p, f->rule, e->to, f->parent);
            gframe *child = ret ? intern(p, e->sym, p->g->rules[e->sym].start, ret) : NULL;
            if (!child) return PD_ENOMEM;
            if (child->mark != p->epoch) {
                child->mark = p->epoch;
                if (flist_push(work, child)) return PD_ENOMEM;
            }
        }
        if (st->accepting) {
            if (!f->parent) {
                *bottom = true;
            } else if (f->parent->mark != p->epoch) {
                f->parent->mark = p->epoch;
                if (flist_push(work, f->parent)) return PD_ENOMEM;
            }
        }
    }
    *min_cost = best;
    return PD_OK;
}

/* The stacks after byte b: appended to out (not closed). */
static int step_byte(fpool *p, gframe *const *in, size_t n, uint8_t b, flist *out) {
    for (size_t i = 0; i < n; i++) {
        const pd_grule *r = &p->g->rules[in[i]->rule];
        int32_t t = pd_grule_step(r, in[i]->state, b);
        if (t < 0) continue;
        gframe *f = intern(p, in[i]->rule, t, in[i]->parent);
        if (!f || flist_push(out, f)) return PD_ENOMEM;
    }
    return PD_OK;
}

/* ---- trie walks ----------------------------------------------------------- */

typedef struct tok_cost {
    int32_t token;
    int32_t pad;
    int64_t cost;
} tok_cost;

typedef struct walk {
    fpool *pool;
    const pd_grammar_vocab *v;
    flist frames; /* the stack sets of the levels of the walk, one after another */
    flist stepped, work;
    tok_cost *found;
    size_t n_found, cap_found;
    uint32_t *deps; /* cache walks: trie nodes where the frame was left with bytes to go */
    size_t n_deps, cap_deps;
    bool record_deps;
} walk;

static void walk_free(walk *w) {
    free(w->frames.v);
    free(w->stepped.v);
    free(w->work.v);
    free(w->found);
    free(w->deps);
}

static int walk_found(walk *w, const pd_gtrie_node *node, int64_t cost) {
    for (uint32_t k = 0; k < node->n_tok; k++) {
        if (w->n_found == w->cap_found) {
            size_t cap = w->cap_found ? w->cap_found * 2 : 1024;
            tok_cost *f = realloc(w->found, cap * sizeof *f);
            if (!f) return PD_ENOMEM;
            w->found = f;
            w->cap_found = cap;
        }
        w->found[w->n_found++] = (tok_cost){w->v->sorted_tokens[node->tok_off + k], 0, cost};
    }
    return PD_OK;
}

/* Walk the subtree below trie node `node` from the stacks frames[lo, hi),
 * which have consumed that node's bytes: every token of the subtree whose
 * remaining bytes they can consume goes to found with its cost. */
static int walk_subtree(walk *w, uint32_t node, size_t lo, size_t hi) {
    const pd_gtrie_node *nd = &w->v->nodes[node];
    for (uint32_t c = 0; c < nd->n_child; c++) {
        uint32_t child = nd->child_off + c;
        const pd_gtrie_node *cn = &w->v->nodes[child];
        w->stepped.n = 0;
        int rc = step_byte(w->pool, w->frames.v + lo, hi - lo, cn->byte, &w->stepped);
        if (rc) return rc;
        if (w->stepped.n == 0) continue;
        size_t next_lo = w->frames.n;
        bool bottom;
        int64_t cost;
        if ((rc = close_stacks(w->pool, w->stepped.v, w->stepped.n, &w->frames, &w->work, &bottom, &cost))) return rc;
        if (cn->n_tok && (rc = walk_found(w, cn, cost))) return rc;
        if (cn->n_child) {
            if (bottom && w->record_deps) {
                if (w->n_deps == w->cap_deps) {
                    size_t cap = w->cap_deps ? w->cap_deps * 2 : 64;
                    uint32_t *d = realloc(w->deps, cap * sizeof *d);
                    if (!d) return PD_ENOMEM;
                    w->deps = d;
                    w->cap_deps = cap;
                }
                w->deps[w->n_deps++] = child;
            }
            /* only stacks that can take another byte matter below */
            size_t keep = next_lo;
            for (size_t i = next_lo; i < w->frames.n; i++)
                if (frame_state(w->pool, w->frames.v[i])->n_byte) w->frames.v[keep++] = w->frames.v[i];
            w->frames.n = keep;
            if (keep > next_lo && (rc = walk_subtree(w, child, next_lo, keep))) return rc;
        }
        w->frames.n = next_lo;
    }
    return PD_OK;
}

/* ---- the mask cache (its storage: cache.c) ------------------------------ */

static int cmp_tok_cost(const void *x, const void *y) {
    const tok_cost *a = x, *b = y;
    if (a->cost != b->cost) return a->cost < b->cost ? -1 : 1;
    return a->token < b->token ? -1 : a->token > b->token;
}

/* The tokens the frame (rule, state) admits on its own: a walk of the whole
 * trie from that frame, with an unknown parent below. */
static int entry_build(const pd_grammar *g, const pd_grammar_vocab *v, int32_t rule, int32_t state, gentry **out) {
    fpool pool = {.g = g};
    walk w = {.pool = &pool, .v = v, .record_deps = true};
    gentry *e = calloc(1, sizeof *e);
    int rc = PD_ENOMEM;
    if (!e) goto out;
    gframe *top = intern(&pool, rule, state, NULL);
    if (!top || flist_push(&w.frames, top)) goto out;
    if ((rc = walk_subtree(&w, 0, 0, 1))) goto out;
    rc = PD_ENOMEM;
    /* a token may be found twice (two ways through the frame): keep its cheapest */
    if (w.n_found > 1) qsort(w.found, w.n_found, sizeof *w.found, cmp_tok_cost);
    size_t words = ((size_t)v->n_vocab + 63) / 64;
    e->vocab_id = v->id;
    e->rule = rule;
    e->state = state;
    e->n_vocab = v->n_vocab;
    e->accepted = calloc(words, sizeof *e->accepted);
    e->by_cost = malloc((w.n_found ? w.n_found : 1) * sizeof *e->by_cost);
    e->group_cost = malloc((w.n_found + 1) * sizeof *e->group_cost);
    e->group_start = malloc((w.n_found + 1) * sizeof *e->group_start);
    if (!e->accepted || !e->by_cost || !e->group_cost || !e->group_start) goto out;
    e->min_cost = COST_CAP;
    e->max_cost = -1;
    for (size_t i = 0; i < w.n_found; i++) {
        int32_t t = w.found[i].token;
        if (e->accepted[t / 64] >> (t % 64) & 1) continue;
        e->accepted[t / 64] |= 1ull << (t % 64);
        int64_t cost = w.found[i].cost;
        if (e->n_groups == 0 || e->group_cost[e->n_groups - 1] != cost) {
            e->group_cost[e->n_groups] = cost;
            e->group_start[e->n_groups++] = (uint32_t)e->n_acc;
        }
        e->by_cost[e->n_acc++] = t;
        if (cost < e->min_cost) e->min_cost = cost;
        if (cost > e->max_cost) e->max_cost = cost;
    }
    e->group_start[e->n_groups] = (uint32_t)e->n_acc;
    e->deps = w.deps;
    e->n_deps = (int32_t)w.n_deps;
    w.deps = NULL;
    e->bytes = sizeof *e + words * sizeof *e->accepted + (size_t)e->n_acc * sizeof *e->by_cost +
               (size_t)e->n_groups * (sizeof *e->group_cost + sizeof *e->group_start) +
               (size_t)e->n_deps * sizeof *e->deps;
    *out = e;
    e = NULL;
    rc = PD_OK;
out:
    pd_gentry_free(e);
    walk_free(&w);
    fpool_free(&pool);
    return rc;
}

/* The entry for (rule, state) with a reference held: from the cache, or
 * built (outside the lock) and added. */
static int cache_get(const pd_grammar *g, const pd_grammar_vocab *v, int32_t rule, int32_t state, gentry **out) {
    pd_gcache *c = g->cache;
    pthread_mutex_lock(&c->lock);
    gentry *e = pd_gcache_find(c, v->id, rule, state);
    if (e) {
        e->refs++;
        e->tick = ++c->tick;
        c->hits++;
        pthread_mutex_unlock(&c->lock);
        *out = e;
        return PD_OK;
    }
    c->misses++;
    pthread_mutex_unlock(&c->lock);
    gentry *built = NULL;
    int rc = entry_build(g, v, rule, state, &built);
    if (rc) return rc;
    pthread_mutex_lock(&c->lock);
    e = pd_gcache_find(c, v->id, rule, state);
    if (e) { /* another thread built it meanwhile */
        pd_gentry_free(built);
    } else {
        e = built;
        pd_gcache_insert(c, e);
        c->computed++;
    }
    e->refs++;
    e->tick = ++c->tick;
    pd_gcache_evict(c);
    pthread_mutex_unlock(&c->lock);
    *out = e;
    return PD_OK;
}

int pd_grammar_warm(const pd_grammar *g, const pd_grammar_vocab *v, const atomic_bool *stop, pd_error *err) {
    /* frames only ever hold the root and rules some state references
     * (the others were expanded in place), and stop where bytes or tokens
     * go on */
    bool *framed = calloc((size_t)g->n_rules, sizeof *framed);
    if (!framed) return pd_errorf(err, PD_ENOMEM, "grammar warm-up: out of memory");
    framed[g->root] = true;
    for (int32_t r = 0; r < g->n_rules; r++) {
        const pd_grule *rule = &g->rules[r];
        for (int32_t st = 0; st < rule->n_states; st++)
            for (uint32_t i = 0; i < rule->states[st].n_ref; i++) framed[rule->refs[rule->states[st].ref_off + i].sym] = true;
    }
    int rc = PD_OK;
    for (int32_t r = 0; r < g->n_rules && !rc; r++) {
        if (!framed[r]) continue;
        for (int32_t st = 0; st < g->rules[r].n_states && !rc; st++) {
            const pd_gstate *state = &g->rules[r].states[st];
            if (!state->n_byte && !state->n_tok) continue;
            if (stop && atomic_load(stop)) goto out;
            /* past half the cap, warming would evict what it warmed */
            pthread_mutex_lock(&g->cache->lock);
            const bool full = g->cache->bytes > g->cache->cap_bytes / 2;
            pthread_mutex_unlock(&g->cache->lock);
            if (full) goto out;
            gentry *e = NULL;
            if ((rc = cache_get(g, v, r, st, &e))) {
                rc = pd_errorf(err, rc, "grammar warm-up: out of memory");
                break;
            }
            pd_gcache_release(g->cache, e);
        }
    }
out:
    free(framed);
    return rc;
}

void pd_grammar_stats_get(const pd_grammar *g, pd_grammar_stats *out) {
    pd_gcache *c = g->cache;
    pthread_mutex_lock(&c->lock);
    out->states_cached = c->computed;
    out->cache_hits = c->hits;
    out->cache_misses = c->misses;
    out->cache_bytes = (int64_t)c->bytes;
    pthread_mutex_unlock(&c->lock);
}

/* ---- matcher ------------------------------------------------------------------ */

struct pd_grammar_matcher {
    const pd_grammar *g;
    const pd_grammar_vocab *v;
    fpool pool;
    flist live; /* closed stacks whose top can consume */
    bool complete, ended;
    int64_t min_bytes;
    size_t collect_at; /* pool size that triggers the next collection */
    /* scratch */
    flist next, stepped, work;
    walk w;
    uint64_t *bits;
    gentry **entries;
    size_t cap_entries;
};

void pd_grammar_matcher_free(pd_grammar_matcher *m) {
    if (!m) return;
    fpool_free(&m->pool);
    free(m->live.v);
    free(m->next.v);
    free(m->stepped.v);
    free(m->work.v);
    walk_free(&m->w);
    free(m->bits);
    free(m->entries);
    pd_grammar_free((pd_grammar *)m->g);
    free(m);
}

int pd_grammar_matcher_create(const pd_grammar *g, const pd_grammar_vocab *v, pd_grammar_matcher **out,
                              pd_error *err) {
    *out = NULL;
    if (!g || !v) return pd_errorf(err, PD_EINVAL, "grammar matcher: no grammar or no vocabulary");
    pd_grammar_matcher *m = calloc(1, sizeof *m);
    if (!m) goto nomem;
    m->g = pd_grammar_retain(g);
    m->v = v;
    m->pool.g = g;
    m->collect_at = 65536;
    m->bits = calloc(((size_t)v->n_vocab + 63) / 64, sizeof *m->bits);
    if (!m->bits) goto nomem;
    gframe *root = intern(&m->pool, g->root, g->rules[g->root].start, NULL);
    if (!root || close_stacks(&m->pool, &root, 1, &m->live, &m->work, &m->complete, &m->min_bytes)) goto nomem;
    *out = m;
    return PD_OK;
nomem:
    pd_grammar_matcher_free(m);
    return pd_errorf(err, PD_ENOMEM, "grammar matcher: out of memory");
}

bool pd_grammar_matcher_complete(const pd_grammar_matcher *m) {
    return m->complete; /* stays true after an EOG: the text it ended was complete */
}

int64_t pd_grammar_matcher_min_bytes(const pd_grammar_matcher *m) {
    return m->ended ? 0 : m->min_bytes;
}

/* The closed stacks after token from the live ones, into m->next; false when
 * the token is not allowed. */
static int advance(pd_grammar_matcher *m, int32_t token, bool *ok, bool *complete, int64_t *min_after) {
    const pd_grammar_vocab *v = m->v;
    *ok = false;
    m->next.n = 0;
    if (m->ended || token < 0 || token >= v->n_vocab) return PD_OK;
    uint8_t kind = v->kinds[token];
    if (kind == PD_GTOK_EOG) {
        *ok = m->complete;
        *complete = true;
        *min_after = -1;
        return PD_OK;
    }
    int rc;
    m->stepped.n = 0;
    /* named by <[id]> at a live state */
    for (size_t i = 0; i < m->live.n; i++) {
        gframe *f = m->live.v[i];
        const pd_gstate *st = frame_state(&m->pool, f);
        const pd_grule *r = &m->g->rules[f->rule];
        for (uint32_t k = 0; k < st->n_tok; k++)
            if (r->toks[st->tok_off + k].sym == token) {
                gframe *n = intern(&m->pool, f->rule, r->toks[st->tok_off + k].to, f->parent);
                if (!n || flist_push(&m->stepped, n)) return PD_ENOMEM;
            }
    }
    size_t named = m->stepped.n;
    uint32_t len = v->lens[token];
    if (kind == PD_GTOK_BYTES && len > 0) {
        /* byte by byte: cur = live, then the closed stacks after each byte */
        const uint8_t *b = (const uint8_t *)v->bytes + v->offs[token];
        if ((rc = step_byte(&m->pool, m->live.v, m->live.n, b[0], &m->stepped))) return rc;
        for (uint32_t i = 1; i < len && m->stepped.n > named; i++) {
            m->next.n = 0;
            bool bottom;
            int64_t c;
            if ((rc = close_stacks(&m->pool, m->stepped.v + named, m->stepped.n - named, &m->next, &m->work, &bottom,
                                   &c)))
                return rc;
            m->stepped.n = named;
            if ((rc = step_byte(&m->pool, m->next.v, m->next.n, b[i], &m->stepped))) return rc;
        }
    }
    m->next.n = 0;
    if (m->stepped.n == 0) return PD_OK;
    if ((rc = close_stacks(&m->pool, m->stepped.v, m->stepped.n, &m->next, &m->work, complete, min_after))) return rc;
    *ok = true;
    return PD_OK;
}

bool pd_grammar_matcher_try(pd_grammar_matcher *m, int32_t token, int64_t *min_after) {
    bool ok = false, complete;
    int64_t after = 0;
    if (advance(m, token, &ok, &complete, &after)) return false;
    if (min_after) *min_after = after;
    return ok;
}

/* Copy the live stacks into a fresh pool once the old one holds mostly
 * frames no live stack uses (walks and dead alternatives add frames). */
static gframe *copy_frame(fpool *to, gframe *f, flist *chain) {
    /* iteratively (stacks can be as deep as the text is nested): up to the
     * first frame already copied, then down again */
    chain->n = 0;
    for (gframe *x = f; x && !x->fwd; x = x->parent)
        if (flist_push(chain, x)) return NULL;
    for (size_t i = chain->n; i-- > 0;) {
        gframe *x = chain->v[i];
        gframe *parent = x->parent ? x->parent->fwd : NULL;
        if (!(x->fwd = intern(to, x->rule, x->state, parent))) return NULL;
    }
    return f->fwd;
}

int pd_grammar_matcher_collect(pd_grammar_matcher *m) {
    fpool fresh = {.g = m->g};
    for (size_t i = 0; i < m->live.n; i++) {
        gframe *f = copy_frame(&fresh, m->live.v[i], &m->work);
        if (!f) { /* out of memory: keep the old pool */
            fpool_free(&fresh);
            for (size_t c = 0; c < m->pool.n_chunks; c++) {
                size_t n = c + 1 == m->pool.n_chunks ? m->pool.used : CHUNK_FRAMES;
                for (size_t k = 0; k < n; k++) m->pool.chunks[c][k].fwd = NULL;
            }
            return PD_ENOMEM;
        }
    }
    for (size_t i = 0; i < m->live.n; i++) m->live.v[i] = m->live.v[i]->fwd;
    fpool_free(&m->pool);
    m->pool = fresh;
    m->collect_at = 2 * m->pool.n_frames + 65536;
    return PD_OK;
}

int pd_grammar_matcher_accept(pd_grammar_matcher *m, int32_t token, pd_error *err) {
    bool ok, complete = false;
    int64_t after = 0;
    int rc = advance(m, token, &ok, &complete, &after);
    if (rc) return pd_errorf(err, rc, "grammar matcher: out of memory");
    if (!ok) {
        if (token < 0 || token >= m->v->n_vocab)
            return pd_errorf(err, PD_EINVAL, "grammar matcher: token %d is outside the vocabulary of %d", token,
                             m->v->n_vocab);
        if (m->ended) return pd_errorf(err, PD_EINVAL, "grammar matcher: token %d after the end of the text", token);
        return pd_errorf(err, PD_EINVAL, "grammar matcher: token %d cannot continue the text here", token);
    }
    if (m->v->kinds[token] == PD_GTOK_EOG) {
        m->ended = true;
        m->live.n = 0;
        return PD_OK;
    }
    flist t = m->live;
    m->live = m->next;
    m->next = t;
    m->complete = complete;
    m->min_bytes = after;
    if (m->pool.n_frames >= m->collect_at) pd_grammar_matcher_collect(m); /* on failure the old pool stays */
    return PD_OK;
}

static void set_bit(uint64_t *bits, int32_t t) {
    bits[t / 64] |= 1ull << (t % 64);
}

/* Tokens that leave the top frame f of a live stack with bytes to go: the
 * walks of e's dependent subtrees from f's parent; results in m->w.found. */
static int walk_dependents(pd_grammar_matcher *m, gframe *f, const gentry *e) {
    walk *w = &m->w;
    w->pool = &m->pool;
    w->v = m->v;
    w->record_deps = false;
    w->frames.n = 0;
    if (!f->parent || e->n_deps == 0) return PD_OK;
    bool bottom;
    int64_t cost;
    int rc = close_stacks(&m->pool, &f->parent, 1, &w->frames, &w->work, &bottom, &cost);
    if (rc) return rc;
    size_t keep = 0;
    for (size_t i = 0; i < w->frames.n; i++)
        if (frame_state(&m->pool, w->frames.v[i])->n_byte) w->frames.v[keep++] = w->frames.v[i];
    w->frames.n = keep;
    if (keep == 0) return PD_OK;
    for (int32_t d = 0; d < e->n_deps; d++)
        if ((rc = walk_subtree(w, e->deps[d], 0, keep))) return rc;
    return PD_OK;
}

int pd_grammar_matcher_mask(pd_grammar_matcher *m, float *logits, int32_t budget, pd_error *err) {
    const pd_grammar_vocab *v = m->v;
    size_t words = ((size_t)v->n_vocab + 63) / 64;
    int rc = PD_OK;
    size_t n_live = m->live.n;
    if (m->ended) return pd_errorf(err, PD_ERANGE, "grammar matcher: the text has ended (an EOG token was accepted)");
    if (n_live > m->cap_entries) {
        gentry **ne = realloc(m->entries, n_live * sizeof *ne);
        if (!ne) return pd_errorf(err, PD_ENOMEM, "grammar matcher: out of memory");
        m->entries = ne;
        m->cap_entries = n_live;
    }
    size_t got = 0;
    for (; got < n_live; got++) {
        gframe *f = m->live.v[got];
        if (!frame_state(&m->pool, f)->n_byte) {
            m->entries[got] = NULL;
            continue;
        }
        if ((rc = cache_get(m->g, v, f->rule, f->state, &m->entries[got]))) goto out;
    }
    /* the dependents and the named tokens, with their exact costs */
    m->w.n_found = 0;
    for (size_t i = 0; i < n_live; i++) {
        if (!m->entries[i]) continue;
        if ((rc = walk_dependents(m, m->live.v[i], m->entries[i]))) goto out;
    }
    size_t n_dep_found = m->w.n_found;
    int64_t T = budget > 0 ? (int64_t)budget - 2 : COST_CAP;
    for (int pass = 0; pass < 2; pass++) {
        memset(m->bits, 0, words * sizeof *m->bits);
        bool any = false;
        int64_t cheapest = COST_CAP;
        for (size_t i = 0; i < n_live; i++) {
            const gentry *e = m->entries[i];
            gframe *f = m->live.v[i];
            int64_t below = f->parent ? f->parent->cum : 0;
            if (e && e->n_acc) {
                if (e->min_cost + below < cheapest) cheapest = e->min_cost + below;
                if (e->max_cost + below <= T) {
                    for (size_t k = 0; k < words; k++) m->bits[k] |= e->accepted[k];
                    any = true;
                } else {
                    for (int32_t gi = 0; gi < e->n_groups && e->group_cost[gi] + below <= T; gi++) {
                        for (uint32_t k = e->group_start[gi]; k < e->group_start[gi + 1]; k++)
                            set_bit(m->bits, e->by_cost[k]);
                        any = true;
                    }
                }
            }
            /* tokens named by <[id]> */
            const pd_gstate *st = frame_state(&m->pool, f);
            const pd_grule *r = &m->g->rules[f->rule];
            for (uint32_t k = 0; k < st->n_tok; k++) {
                int32_t t = r->toks[st->tok_off + k].sym;
                if (t < 0 || t >= v->n_vocab || v->kinds[t] == PD_GTOK_EOG) continue;
                int64_t after;
                if (!pd_grammar_matcher_try(m, t, &after)) continue;
                if (after < cheapest) cheapest = after;
                if (after <= T) {
                    set_bit(m->bits, t);
                    any = true;
                }
            }
        }
        for (size_t k = 0; k < n_dep_found; k++) {
            const tok_cost *tc = &m->w.found[k];
            if (tc->cost < cheapest) cheapest = tc->cost;
            if (tc->cost <= T) {
                set_bit(m->bits, tc->token);
                any = true;
            }
        }
        if (m->complete && v->n_eog) {
            for (int32_t k = 0; k < v->n_eog; k++) set_bit(m->bits, v->eog[k]);
            any = true;
        }
        if (any || cheapest >= COST_CAP) break;
        T = cheapest; /* nothing fits the budget: the tokens that shorten the completion most */
    }
    bool any = false;
    for (size_t k = 0; k < words; k++) {
        uint64_t w = m->bits[k];
        size_t base = k * 64;
        size_t end = base + 64 < (size_t)v->n_vocab ? base + 64 : (size_t)v->n_vocab;
        if (w == 0) {
            for (size_t t = base; t < end; t++) logits[t] = -INFINITY;
            continue;
        }
        any = true;
        /* only the masked ones: few where most tokens are allowed */
        uint64_t masked = ~w;
        if (end - base < 64) masked &= (1ull << (end - base)) - 1;
        while (masked) {
            logits[base + (size_t)__builtin_ctzll(masked)] = -INFINITY;
            masked &= masked - 1;
        }
    }
    if (!any) rc = pd_errorf(err, PD_ERANGE, "grammar matcher: no token of the vocabulary can continue the text");
out:
    for (size_t i = 0; i < got; i++)
        if (m->entries[i]) pd_gcache_release(m->g->cache, m->entries[i]);
    if (rc == PD_ENOMEM) pd_errorf(err, rc, "grammar matcher: out of memory");
    return rc;
}
