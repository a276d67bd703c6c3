/* grammar: what grammar.c (parser, compiler), vocab.c (trie) and matcher.c
 * (stacks, masks) share. Private to the folder and its tests. */
#ifndef PD_GRAMMAR_INTERNAL_H
#define PD_GRAMMAR_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "grammar/grammar.h"

#define PD_GRAMMAR_MAX_REPEAT 10000
#define PD_GRAMMAR_INF_COST INT64_MAX

/* ---- compiled grammar: one DFA per rule -------------------------------- */

typedef struct pd_gbyte_edge {
    uint8_t lo, hi;
    int32_t to;
} pd_gbyte_edge;

typedef struct pd_gsym_edge { /* a rule reference or a token id */
    int32_t sym, to;
} pd_gsym_edge;

typedef struct pd_gstate {
    uint32_t byte_off, n_byte; /* into the rule's bytes[], sorted by lo, disjoint */
    uint32_t ref_off, n_ref;   /* into refs[] (sym = callee rule) */
    uint32_t tok_off, n_tok;   /* into toks[] (sym = token id) */
    bool accepting;
    int64_t min_bytes; /* shortest completion of the rule from here (a token counts 1) */
} pd_gstate;

typedef struct pd_grule {
    char *name;
    int32_t start;
    int32_t n_states;
    pd_gstate *states;
    pd_gbyte_edge *bytes;
    pd_gsym_edge *refs, *toks;
} pd_grule;

typedef struct pd_gcache pd_gcache;

struct pd_grammar {
    atomic_int refs;  /* pd_grammar_retain / pd_grammar_free; a matcher holds one */
    int32_t n_rules, root;
    pd_grule *rules;
    pd_gcache *cache; /* masks per (vocabulary, rule, state); locked inside */
};

/* The DFA state reached from s by byte b, or -1. */
static inline int32_t pd_grule_step(const pd_grule *r, int32_t s, uint8_t b) {
    const pd_gstate *st = &r->states[s];
    const pd_gbyte_edge *e = r->bytes + st->byte_off;
    for (uint32_t i = 0; i < st->n_byte; i++) {
        if (b < e[i].lo) return -1;
        if (b <= e[i].hi) return e[i].to;
    }
    return -1;
}

/* ---- vocabulary: pieces and a byte trie of the PD_GTOK_BYTES ones ------- */

typedef struct pd_gtrie_node {
    uint32_t child_off; /* children are nodes child_off .. child_off + n_child - 1 */
    uint16_t n_child;
    uint8_t byte;       /* the byte that leads here from the parent */
    uint32_t tok_off, n_tok; /* tokens whose piece ends here: sorted_tokens[tok_off ..] */
} pd_gtrie_node;

struct pd_grammar_vocab {
    int32_t n_vocab;
    uint64_t id; /* content hash: keys the grammar's mask cache */
    uint8_t *kinds;
    uint32_t *offs, *lens; /* piece i = bytes[offs[i] .. + lens[i]] */
    char *bytes;
    pd_gtrie_node *nodes; /* nodes[0] is the root */
    uint32_t n_nodes;
    int32_t *sorted_tokens;
    int32_t *eog;      /* the EOG token ids */
    int32_t n_eog;
};

/* ---- internals for tests ------------------------------------------------ */

/* Whether token would be accepted now, without changing the matcher; *min_after
 * (optional) gets the shortest completion after it (-1 for an EOG token). */
bool pd_grammar_matcher_try(pd_grammar_matcher *m, int32_t token, int64_t *min_after);
/* Move the live stacks to a fresh frame pool now (done by accept when the
 * pool has grown; tests force it to check nothing is lost). */
int pd_grammar_matcher_collect(pd_grammar_matcher *m);
/* UTF-8 byte-range sequences of the code points [lo, hi] (surrogates and
 * anything above U+10FFFF left out): calls fn once per sequence of n ranges. */
void pd_grammar_utf8_ranges(uint32_t lo, uint32_t hi,
                            void (*fn)(void *ctx, int n, const uint8_t *lo_b, const uint8_t *hi_b), void *ctx);

/* Cache lifetime (matcher.c). */
/* ---- the mask cache (cache.c) ----------------------------------------------- */

typedef struct gentry {
    uint64_t vocab_id;
    int32_t rule, state;
    int32_t n_vocab;
    uint64_t *accepted; /* tokens consumed within the frame */
    int32_t n_acc;
    int64_t min_cost, max_cost; /* local shortest completions over them */
    int32_t *by_cost;           /* the accepted tokens, cheapest first */
    int64_t *group_cost;        /* group k: by_cost[group_start[k] .. group_start[k + 1]) */
    uint32_t *group_start;
    int32_t n_groups;
    uint32_t *deps;
    int32_t n_deps;
    size_t bytes;
    uint64_t tick;
    int refs;
    bool evicted;
    struct gentry *next;
} gentry;

struct pd_gcache {
    pthread_mutex_t lock;
    gentry **table;
    size_t table_cap, n_entries, bytes, cap_bytes;
    uint64_t tick;
    int64_t computed, hits, misses;
};

pd_gcache *pd_gcache_new(void);
void pd_gcache_free(pd_gcache *c);
void pd_gentry_free(gentry *e);
/* The next four: with c->lock held, except release, which takes it. */
gentry *pd_gcache_find(pd_gcache *c, uint64_t vocab_id, int32_t rule, int32_t state);
void pd_gcache_insert(pd_gcache *c, gentry *e);
void pd_gcache_evict(pd_gcache *c);
void pd_gcache_release(pd_gcache *c, gentry *e);

#endif
