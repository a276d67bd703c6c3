/* The automatic block cache (cache/auto.c) against a naive reference LRU,
 * its persistence in a real LMDB store (cache.auto_persist: written,
 * reopened, matched from disk, damaged records are misses, bounds, a full
 * map), and the engine's exact KV export/import against a plain prefill. */
#include <criterion/criterion.h>
#include <lmdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "engine/engine.h"
#include "helpers.h"
#include "tools/tools.h"

#define B PD_AUTO_BLOCK_TOKENS

static char *tmpdir;

static void setup(void) {
    tmpdir = th_mkdtemp();
    cr_assert_not_null(tmpdir);
}

static void teardown(void) {
    th_rmtree(tmpdir);
    free(tmpdir);
    tmpdir = NULL;
}

TestSuite(autocache, .init = setup, .fini = teardown, .timeout = 300);

static const uint8_t fp_a[PD_SHA256_LEN] = {1, 2, 3};
static const uint8_t fp_b[PD_SHA256_LEN] = {9, 9, 9};

/* A block's payload is a function of every token up to its end, so a
 * payload from the wrong chain shows. */
static void payload_of(const pd_token *tokens, int64_t block, unsigned char *out, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (int64_t i = 0; i < (block + 1) * B; i++) h = (h ^ (uint64_t)tokens[i]) * 1099511628211ull;
    for (size_t i = 0; i < n; i++) {
        h ^= h >> 29;
        h *= 0xbf58476d1ce4e5b9ull;
        out[i] = (unsigned char)(h >> 56);
    }
}

typedef struct fill_ctx {
    const pd_token *tokens;
    size_t bytes;
    int calls;
    int fail_at; /* -1: never */
} fill_ctx;

static int fill(void *vctx, int64_t block, void *payload, pd_error *err) {
    fill_ctx *c = vctx;
    if (block == c->fail_at) return pd_errorf(err, PD_EIO, "fill failed on purpose");
    c->calls++;
    payload_of(c->tokens, block, payload, c->bytes);
    return PD_OK;
}

static void make_tokens(uint64_t seed, int64_t n, pd_token *out) {
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int64_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        out[i] = (pd_token)(x % 50);
    }
}

/* Every matched payload is the one of that chain's block. */
static void check_payloads(const pd_token *tokens, const void **blocks, int64_t k, size_t bytes) {
    unsigned char *want = malloc(bytes);
    for (int64_t i = 0; i < k; i++) {
        payload_of(tokens, i, want, bytes);
        cr_assert_eq(memcmp(blocks[i], want, bytes), 0, "block %lld holds another block's rows", (long long)i);
    }
    free(want);
}

Test(autocache, match_extend_diverge_and_namespaces) {
    const size_t bytes = 100;
    pd_autocache *c = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_autocache_create(64ull << 20, bytes, fp_a, 1, &c, &err), PD_OK, "%s", err.msg);
    pd_token t[10 * B], u[10 * B];
    make_tokens(1, 10 * B, t);
    const void *blocks[10];
    /* empty: a miss */
    cr_assert_eq(pd_autocache_match(c, "", t, 5, blocks), 0);
    fill_ctx f = {.tokens = t, .bytes = bytes, .fail_at = -1};
    cr_assert_eq(pd_autocache_insert(c, "", t, 5, fill, &f, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(f.calls, 5);
    cr_assert_eq(pd_autocache_match(c, "", t, 10, blocks), 5);
    check_payloads(t, blocks, 5, bytes);
    cr_assert_eq(pd_autocache_match(c, "", t, 3, blocks), 3, "max_blocks bounds the match");
    /* inserting a longer prompt fills only the new blocks */
    f.calls = 0;
    cr_assert_eq(pd_autocache_insert(c, "", t, 8, fill, &f, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(f.calls, 3);
    cr_assert_eq(pd_autocache_match(c, "", t, 10, blocks), 8);
    check_payloads(t, blocks, 8, bytes);
    /* diverging inside block 3: blocks 0..2 */
    memcpy(u, t, sizeof u);
    u[3 * B + 7] = (pd_token)(u[3 * B + 7] + 1);
    cr_assert_eq(pd_autocache_match(c, "", u, 10, blocks), 3);
    check_payloads(u, blocks, 3, bytes);
    /* diverging in block 0: nothing, even though later blocks equal */
    u[0] = (pd_token)(u[0] + 1);
    cr_assert_eq(pd_autocache_match(c, "", u, 10, blocks), 0);
    /* namespaces share nothing */
    cr_assert_eq(pd_autocache_match(c, "tenant", t, 10, blocks), 0);
    pd_autocache_stats st;
    pd_autocache_stats_get(c, &st);
    cr_assert_eq(st.entries, 8);
    cr_assert_eq(st.hits, 4);
    cr_assert_eq(st.misses, 3);
    cr_assert_eq(st.evictions, 0);
    /* a fill failure is returned; what came before stays */
    pd_token w[4 * B];
    make_tokens(2, 4 * B, w);
    fill_ctx g = {.tokens = w, .bytes = bytes, .fail_at = 2};
    cr_assert_eq(pd_autocache_insert(c, "", w, 4, fill, &g, &err), PD_EIO);
    cr_assert_eq(pd_autocache_match(c, "", w, 4, blocks), 2);
    pd_autocache_free(c);

    /* another model's cache (fingerprint) does not answer for this one's keys:
     * the root differs, so the same tokens hash elsewhere */
    cr_assert_eq(pd_autocache_create(64ull << 20, bytes, fp_b, 1, &c, &err), PD_OK, "%s", err.msg);
    f.calls = 0;
    cr_assert_eq(pd_autocache_insert(c, "", t, 2, fill, &f, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_autocache_match(c, "", t, 2, blocks), 2);
    pd_autocache_free(c);
}

/* ---- LRU against a naive reference ---------------------------------------- */

/* The reference: a list of (namespace, token prefix) entries with a
 * recency stamp; the same rules as cache.h states them. */
typedef struct ref_entry {
    int ns;
    int64_t n;              /* tokens up to the block's end */
    pd_token tokens[12 * B];
    uint64_t used;          /* larger = more recent */
    uint64_t op;
    bool live;
} ref_entry;

typedef struct ref_lru {
    ref_entry e[512];
    int n;
    uint64_t clock, op;
    int64_t entries, evictions, capacity; /* in blocks */
} ref_lru;

static ref_entry *ref_find(ref_lru *r, int ns, const pd_token *t, int64_t n) {
    for (int i = 0; i < r->n; i++)
        if (r->e[i].live && r->e[i].ns == ns && r->e[i].n == n && memcmp(r->e[i].tokens, t, sizeof *t * (size_t)n) == 0)
            return &r->e[i];
    return NULL;
}

static int64_t ref_match(ref_lru *r, int ns, const pd_token *t, int64_t max_blocks) {
    int64_t k = 0;
    ref_entry *chain[12];
    while (k < max_blocks && (chain[k] = ref_find(r, ns, t, (k + 1) * B))) k++;
    for (int64_t i = k - 1; i >= 0; i--) chain[i]->used = ++r->clock;
    return k;
}

static void ref_insert(ref_lru *r, int ns, const pd_token *t, int64_t n_blocks) {
    r->op++;
    ref_entry *chain[12];
    int64_t k = 0;
    for (; k < n_blocks; k++) {
        ref_entry *e = ref_find(r, ns, t, (k + 1) * B);
        if (!e) {
            while (r->entries + 1 > r->capacity) {
                ref_entry *old = NULL;
                for (int i = 0; i < r->n; i++)
                    if (r->e[i].live && r->e[i].op != r->op && (!old || r->e[i].used < old->used)) old = &r->e[i];
                if (!old) break;
                old->live = false;
                r->entries--;
                r->evictions++;
            }
            if (r->entries + 1 > r->capacity) break;
            int slot = 0;
            while (slot < r->n && r->e[slot].live) slot++;
            cr_assert_lt(slot, 512);
            if (slot == r->n) r->n++;
            e = &r->e[slot];
            *e = (ref_entry){.ns = ns, .n = (k + 1) * B, .live = true};
            memcpy(e->tokens, t, sizeof *t * (size_t)e->n);
            r->entries++;
            e->used = ++r->clock;
        }
        e->op = r->op;
        chain[k] = e;
    }
    for (int64_t i = k - 1; i >= 0; i--) chain[i]->used = ++r->clock;
}

Test(autocache, lru_and_exact_bytes_match_a_naive_reference) {
    const size_t bytes = 256;
    pd_error err = {0};
    pd_token t[12 * B];
    make_tokens(5, 12 * B, t);
    fill_ctx f = {.tokens = t, .bytes = bytes, .fail_at = -1};
    /* the size of one entry and of the first index, measured */
    pd_autocache *c = NULL;
    cr_assert_eq(pd_autocache_create(64ull << 20, bytes, fp_a, 1, &c, &err), PD_OK, "%s", err.msg);
    pd_autocache_stats s1, s2;
    cr_assert_eq(pd_autocache_insert(c, "", t, 1, fill, &f, &err), PD_OK, "%s", err.msg);
    pd_autocache_stats_get(c, &s1);
    cr_assert_eq(pd_autocache_insert(c, "", t, 2, fill, &f, &err), PD_OK, "%s", err.msg);
    pd_autocache_stats_get(c, &s2);
    const uint64_t entry = s2.bytes - s1.bytes, index = s1.bytes - entry;
    cr_assert_geq(entry, bytes + B * sizeof(pd_token), "an entry holds at least its payload and tokens");
    cr_assert_eq(index, 64 * sizeof(void *), "the first index has 64 buckets");
    pd_autocache_free(c);

    /* room for exactly 20 blocks (the index stays at 64 buckets) */
    const int64_t cap = 20;
    cr_assert_eq(pd_autocache_create(index + cap * entry, bytes, fp_a, 1, &c, &err), PD_OK, "%s", err.msg);
    ref_lru *r = calloc(1, sizeof *r);
    r->capacity = cap;
    /* prompts from a few families sharing beginnings, in two namespaces */
    pd_token fam[4][12 * B];
    for (int i = 0; i < 4; i++) make_tokens(100 + (uint64_t)i, 12 * B, fam[i]);
    uint64_t x = 42;
    const void *blocks[12];
    for (int step = 0; step < 400; step++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        int fi = (int)(x % 4), ns = (int)((x >> 8) % 2);
        int64_t nb = 1 + (int64_t)((x >> 16) % 12);
        pd_token p[12 * B];
        memcpy(p, fam[fi], sizeof p);
        if ((x >> 24) % 3 == 0) p[((x >> 32) % (uint64_t)(nb * B))] = 49; /* diverge somewhere */
        const char *nsname = ns ? "b" : "";
        if ((x >> 40) % 2) {
            int64_t want = ref_match(r, ns, p, nb);
            int64_t got = pd_autocache_match(c, nsname, p, nb, blocks);
            cr_assert_eq(got, want, "step %d: match %lld, reference %lld", step, (long long)got, (long long)want);
            check_payloads(p, blocks, got, bytes);
        } else {
            fill_ctx pf = {.tokens = p, .bytes = bytes, .fail_at = -1};
            ref_insert(r, ns, p, nb);
            cr_assert_eq(pd_autocache_insert(c, nsname, p, nb, fill, &pf, &err), PD_OK, "%s", err.msg);
        }
        pd_autocache_stats st;
        pd_autocache_stats_get(c, &st);
        cr_assert_eq(st.entries, r->entries, "step %d", step);
        cr_assert_eq(st.evictions, r->evictions, "step %d", step);
        cr_assert_eq(st.bytes, index + (uint64_t)st.entries * entry, "step %d: bytes are exact", step);
        cr_assert_leq(st.bytes, st.max_bytes);
    }
    pd_autocache_stats st;
    pd_autocache_stats_get(c, &st);
    cr_assert_gt(st.evictions, 0, "the test evicted");
    cr_assert_gt(st.hits, 0);
    free(r);
    pd_autocache_free(c);

    /* smaller than one block: nothing is cached, nothing fails */
    cr_assert_eq(pd_autocache_create(entry / 2, bytes, fp_a, 1, &c, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_autocache_insert(c, "", t, 3, fill, &f, &err), PD_OK, "%s", err.msg);
    pd_autocache_stats_get(c, &st);
    cr_assert_eq(st.entries, 0);
    cr_assert_eq(st.bytes, 0);
    pd_autocache_free(c);
}

/* ---- the engine: export/import is a prefill ------------------------------- */

static pd_model *load(const char *path) {
    pd_model *m = NULL;
    pd_error err = {0};
    pd_model_params p = {.n_threads = 1};
    cr_assert_eq(pd_model_load(path, &p, &m, &err), PD_OK, "%s: %s", path, err.msg);
    return m;
}

/* Prefill h = k blocks + 5 tokens, then the rest of n tokens; a second
 * sequence imports the k blocks exported from the first and the first 5
 * rows of block k, and prefills the same rest: the same logits, bit for
 * bit, and the same cache. (A whole-prompt prefill is
 * another chunking, which may round differently: the reference for that is
 * the greedy token, as for the scheduler's chunked prefill.) */
static void export_import(pd_model *m) {
    const pd_hparams *hp = pd_model_hparams(m);
    const int64_t n = 100, k = 4, h = k * B + 5;
    pd_token t[100];
    make_tokens(9, n, t);
    for (int64_t i = 0; i < n; i++) t[i] = (pd_token)(3 + t[i] % (hp->n_vocab - 3));
    pd_error err = {0};
    float *la = malloc(sizeof(float) * (size_t)hp->n_vocab), *lb = malloc(sizeof(float) * (size_t)hp->n_vocab);
    const size_t blk = pd_model_kv_token_bytes(m) * B;
    unsigned char *blocks = malloc(blk * (size_t)(k + 1)), *again = malloc(blk);
    pd_seq *a = NULL, *b = NULL;
    cr_assert_eq(pd_seq_create(m, 0, &a, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_create(m, 0, &b, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_prefill(m, b, t, n, NULL, lb, &err), PD_OK, "%s", err.msg);
    pd_token whole_next = 0;
    for (int32_t v = 1; v < hp->n_vocab; v++)
        if (lb[v] > lb[whole_next]) whole_next = v;
    pd_seq_free(b);
    cr_assert_eq(pd_prefill(m, a, t, h, NULL, NULL, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_prefill(m, a, t + h, n - h, NULL, la, &err), PD_OK, "%s", err.msg);
    for (int64_t i = 0; i <= k; i++)
        cr_assert_eq(pd_seq_export_kv(a, (int32_t)(i * B), B, blocks + (size_t)i * blk, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_create(m, 0, &b, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_reserve(b, (int32_t)n, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_kv_bytes(b), 0, "reserving adds no rows");
    for (int64_t i = 0; i < k; i++)
        cr_assert_eq(pd_seq_import_kv(b, blocks + (size_t)i * blk, B, B, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_import_kv(b, blocks + (size_t)k * blk, B, (int32_t)(h - k * B), &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_pos(b), h);
    cr_assert_eq(pd_prefill(m, b, t + h, n - h, NULL, lb, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(memcmp(la, lb, sizeof(float) * (size_t)hp->n_vocab), 0, "imported blocks give the same logits");
    cr_assert_eq(pd_seq_kv_bytes(a), pd_seq_kv_bytes(b));
    /* and the re-exported rows are the rows */
    cr_assert_eq(pd_seq_export_kv(b, 2 * B, B, again, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(memcmp(again, blocks + 2 * blk, blk), 0);
    /* one greedy step further agrees too */
    pd_token next = 0;
    for (int32_t v = 1; v < hp->n_vocab; v++)
        if (la[v] > la[next]) next = v;
    cr_assert_eq(next, whole_next, "the whole-prompt prefill agrees on the greedy token");
    cr_assert_eq(pd_decode(m, &a, &next, 1, la, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_decode(m, &b, &next, 1, lb, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(memcmp(la, lb, sizeof(float) * (size_t)hp->n_vocab), 0);

    /* what cannot be exported or imported exactly */
    cr_assert_eq(pd_seq_export_kv(a, (int32_t)n, B, again, &err), PD_EINVAL, "past the end");
    pd_kv_prefix *pre = NULL;
    cr_assert_eq(pd_seq_to_prefix(a, &pre, &err), PD_OK, "%s", err.msg);
    pd_seq *c = NULL;
    cr_assert_eq(pd_seq_create(m, 0, &c, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_attach_prefix(c, pre, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_import_kv(c, blocks, B, B, &err), PD_EINVAL, "a sequence on a prefix");
    cr_assert_eq(pd_prefill(m, c, t, B, NULL, NULL, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_export_kv(c, pd_seq_pos(c) - B, B, again, &err), PD_EINVAL, "rows after a prefix");
    pd_seq_free(c);
    pd_kv_prefix_free(pre);
    cr_assert_eq(pd_seq_create(m, 2 * B - 1, &c, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_reserve(c, 2 * B, &err), PD_ERANGE, "more than the context");
    cr_assert_eq(pd_seq_import_kv(c, blocks, B, B + 1, &err), PD_EINVAL, "more rows than the block has");
    cr_assert_eq(pd_seq_import_kv(c, blocks, B, B, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_import_kv(c, blocks + blk, B, B, &err), PD_ERANGE, "the context is full after it");
    pd_seq_free(c);

    pd_seq_free(a);
    pd_seq_free(b);
    free(la), free(lb), free(blocks), free(again);
}

Test(autocache, export_import_is_a_prefill_stories) {
    TH_REQUIRE_SHARED();
    char buf[1024];
    const char *path = th_shared_file("tinystories/stories260K.gguf", buf, sizeof buf);
    cr_assert_not_null(path);
    pd_model *m = load(path);
    export_import(m);
    pd_model_free(m);
}

Test(autocache, export_import_is_a_prefill_generated_model) {
    pd_testmodel_opts o;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset("tiny", &o, &err), PD_OK, "%s", err.msg);
    o.seed = 11;
    char path[1024];
    snprintf(path, sizeof path, "%s/tiny.gguf", tmpdir);
    cr_assert_eq(pd_testmodel_write(&o, path, NULL, &err), PD_OK, "%s", err.msg);
    pd_model *m = load(path);
    export_import(m);
    pd_model_free(m);
}

/* The same on the CPU backend in discrete-memory mode (the engine's device
 * path: rows go through the backend's upload and download). */
Test(autocache, export_import_is_a_prefill_discrete_backend) {
    pd_testmodel_opts o;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset("tiny", &o, &err), PD_OK, "%s", err.msg);
    o.seed = 12;
    char path[1024];
    snprintf(path, sizeof path, "%s/tiny.gguf", tmpdir);
    cr_assert_eq(pd_testmodel_write(&o, path, NULL, &err), PD_OK, "%s", err.msg);
    pd_backend *be = NULL;
    cr_assert_eq(pd_backend_cpu_discrete_create(1, &be, &err), PD_OK, "%s", err.msg);
    pd_model *m = NULL;
    pd_model_params p = {.n_threads = 1, .backend = be};
    cr_assert_eq(pd_model_load(path, &p, &m, &err), PD_OK, "%s", err.msg);
    export_import(m);
    pd_model_free(m);
    pd_backend_free(be);
}

/* ---- persistence (cache.auto_persist) ------------------------------------ */

static pd_store *open_store(uint64_t map_size) {
    char dir[1200];
    snprintf(dir, sizeof dir, "%s/store", tmpdir);
    pd_store_opts o;
    pd_store_opts_default(&o);
    o.dir = dir;
    o.map_size = map_size;
    pd_store *s = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_store_open(&o, &s, &err), PD_OK, "%s", err.msg);
    return s;
}

static pd_autocache *persisted_cache(pd_store *st, uint64_t ram, size_t bytes, uint64_t disk) {
    pd_autocache *c = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_autocache_create(ram, bytes, fp_a, 1, &c, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_autocache_attach_store(c, st, disk, &err), PD_OK, "%s", err.msg);
    return c;
}

static void insert_all(pd_autocache *c, const char *ns, const pd_token *t, int64_t n_blocks, size_t bytes) {
    fill_ctx fc = {.tokens = t, .bytes = bytes, .fail_at = -1};
    pd_error err = {0};
    cr_assert_eq(pd_autocache_insert(c, ns, t, n_blocks, fill, &fc, &err), PD_OK, "%s", err.msg);
}

static pd_store_stats store_stats(pd_store *st) {
    pd_store_stats ss;
    pd_error err = {0};
    cr_assert_eq(pd_store_stats_get(st, &ss, &err), PD_OK, "%s", err.msg);
    return ss;
}

static int count_visit(void *ctx, const pd_prefix_id *id, const pd_prefix_info *info, const char *why) {
    (void)id, (void)info, (void)why;
    ++*(int *)ctx;
    return 0;
}

Test(autocache, persisted_blocks_survive_a_reopen_and_serve_ram_misses) {
    enum { NB = 12 };
    const size_t bytes = 100;
    pd_token t[NB * B], other[NB * B];
    make_tokens(7, NB * B, t);
    memcpy(other, t, sizeof other);
    other[5 * B + 3] = (other[5 * B + 3] + 1) % 50; /* diverges inside block 5 */
    pd_error err = {0};
    const void *blocks[NB];

    pd_store *st = open_store(16u << 20);
    pd_autocache *c = persisted_cache(st, 1u << 20, bytes, 1u << 20);
    insert_all(c, "tenant", t, NB, bytes);
    pd_autocache_stats a;
    pd_autocache_stats_get(c, &a);
    cr_assert_eq(a.pending, NB, "inserted blocks wait for a persist");
    cr_assert(pd_autocache_persist_pending(c));
    cr_assert_eq(store_stats(st).auto_blocks, 0, "nothing is written before pd_autocache_persist");
    cr_assert_eq(pd_autocache_persist(c, UINT64_MAX, &err), PD_OK, "%s", err.msg);
    pd_autocache_stats_get(c, &a);
    cr_assert_eq(a.disk_writes, NB);
    cr_assert_eq(a.pending, 0);
    cr_assert(!pd_autocache_persist_pending(c));
    pd_store_stats ss = store_stats(st);
    cr_assert_eq(ss.auto_blocks, NB);
    cr_assert(ss.auto_bytes >= NB * bytes && ss.auto_bytes % NB == 0, "%llu", (unsigned long long)ss.auto_bytes);
    cr_assert_eq(ss.prefixes, 0, "automatic blocks are not registered prefixes");
    cr_assert_eq(ss.bytes, 0);
    int listed = 0;
    cr_assert_eq(pd_store_list(st, count_visit, &listed, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(listed, 0, "the prefix list shows registered prefixes only");
    /* a second persist of used blocks restamps them and writes nothing new */
    cr_assert_eq(pd_autocache_match(c, "tenant", t, NB, blocks), NB);
    cr_assert_eq(pd_autocache_persist(c, UINT64_MAX, &err), PD_OK, "%s", err.msg);
    pd_autocache_stats_get(c, &a);
    cr_assert_eq(a.disk_writes, NB);
    cr_assert_eq(store_stats(st).auto_blocks, NB);
    pd_autocache_free(c);
    pd_store_close(st);

    /* a restart: empty RAM, the same store */
    st = open_store(16u << 20);
    c = persisted_cache(st, 1u << 20, bytes, 1u << 20);
    cr_assert_eq(pd_autocache_match(c, "other tenant", t, NB, blocks), 0, "namespaces never share blocks");
    cr_assert_eq(pd_autocache_match(c, "tenant", other, NB, blocks), 5, "a diverging prompt keeps its whole blocks");
    check_payloads(other, blocks, 5, bytes);
    cr_assert_eq(pd_autocache_match(c, "tenant", t, NB, blocks), NB);
    check_payloads(t, blocks, NB, bytes);
    pd_autocache_stats_get(c, &a);
    cr_assert_eq(a.disk_reads, NB, "each block is read from the store once, then served from RAM");
    cr_assert_eq(a.entries, NB);
    cr_assert_eq(pd_autocache_match(c, "tenant", t, NB, blocks), NB);
    pd_autocache_stats_get(c, &a);
    cr_assert_eq(a.disk_reads, NB);
    cr_assert_eq(a.disk_rejected, 0);
    /* a cache of another model (fingerprint) finds nothing */
    pd_autocache *c2 = NULL;
    cr_assert_eq(pd_autocache_create(1u << 20, bytes, fp_b, 1, &c2, &err), PD_OK);
    cr_assert_eq(pd_autocache_attach_store(c2, st, 1u << 20, &err), PD_OK);
    cr_assert_eq(pd_autocache_match(c2, "tenant", t, NB, blocks), 0);
    pd_autocache_free(c2);
    pd_autocache_free(c);
    pd_store_close(st);
}

/* Flip one payload byte of one stored block (its checksum no longer holds). */
static void damage_one_block(void) {
    char dir[1200];
    snprintf(dir, sizeof dir, "%s/store", tmpdir);
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi db;
    MDB_cursor *cur;
    cr_assert_eq(mdb_env_create(&env), 0);
    cr_assert_eq(mdb_env_set_maxdbs(env, 8), 0);
    cr_assert_eq(mdb_env_open(env, dir, 0, 0600), 0);
    cr_assert_eq(mdb_txn_begin(env, NULL, 0, &txn), 0);
    cr_assert_eq(mdb_dbi_open(txn, "auto", 0, &db), 0);
    cr_assert_eq(mdb_cursor_open(txn, db, &cur), 0);
    MDB_val k = {.mv_size = 1, .mv_data = "b"}, v;
    cr_assert_eq(mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE), 0);
    cr_assert_eq(((const char *)k.mv_data)[0], 'b');
    unsigned char key[64], *val = malloc(v.mv_size);
    cr_assert(k.mv_size <= sizeof key);
    memcpy(key, k.mv_data, k.mv_size);
    memcpy(val, v.mv_data, v.mv_size);
    val[v.mv_size - 20] ^= 0x40; /* inside the payload */
    MDB_val k2 = {.mv_size = k.mv_size, .mv_data = key}, v2 = {.mv_size = v.mv_size, .mv_data = val};
    mdb_cursor_close(cur);
    cr_assert_eq(mdb_put(txn, db, &k2, &v2, 0), 0);
    cr_assert_eq(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
    free(val);
}

static int rejected_visit(void *ctx, const pd_prefix_id *id, const pd_prefix_info *info, const char *why) {
    (void)id;
    cr_assert_null(info);
    cr_assert(strstr(why, "automatic block") != NULL, "%s", why);
    ++*(int *)ctx;
    return 0;
}

Test(autocache, a_damaged_stored_block_is_a_miss_and_verify_repairs_it) {
    enum { NB = 10 };
    const size_t bytes = 256;
    pd_token t[NB * B];
    make_tokens(11, NB * B, t);
    pd_error err = {0};
    const void *blocks[NB];
    pd_store *st = open_store(16u << 20);
    pd_autocache *c = persisted_cache(st, 1u << 20, bytes, 1u << 20);
    insert_all(c, NULL, t, NB, bytes);
    cr_assert_eq(pd_autocache_persist(c, UINT64_MAX, &err), PD_OK, "%s", err.msg);
    pd_autocache_free(c);
    pd_store_close(st);

    damage_one_block();

    st = open_store(16u << 20);
    c = persisted_cache(st, 1u << 20, bytes, 1u << 20);
    int64_t k = pd_autocache_match(c, NULL, t, NB, blocks);
    cr_assert_lt(k, NB, "the chain stops at the damaged block");
    check_payloads(t, blocks, k, bytes);
    pd_autocache_stats a;
    pd_autocache_stats_get(c, &a);
    cr_assert_eq(a.disk_rejected, 1);
    cr_assert_eq(a.disk_reads, k);

    pd_store_verify_report rep;
    int seen = 0;
    cr_assert_eq(pd_store_verify(st, false, rejected_visit, &seen, &rep, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(seen, 1);
    cr_assert_eq(rep.checked, NB);
    cr_assert_eq(rep.auto_checked, NB);
    cr_assert_eq(rep.corrupt, 1);
    cr_assert_eq(rep.deleted, 0);
    seen = 0;
    cr_assert_eq(pd_store_verify(st, true, rejected_visit, &seen, &rep, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(rep.deleted, 1);
    cr_assert_eq(store_stats(st).auto_blocks, NB - 1);
    cr_assert_eq(pd_store_verify(st, false, NULL, NULL, &rep, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(rep.corrupt, 0, "the repaired store verifies");

    /* the prompt again: the missing block is computed, inserted and written back */
    insert_all(c, NULL, t, NB, bytes);
    cr_assert_eq(pd_autocache_persist(c, UINT64_MAX, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(store_stats(st).auto_blocks, NB);
    pd_autocache_free(c);
    pd_store_close(st);
    st = open_store(16u << 20);
    c = persisted_cache(st, 1u << 20, bytes, 1u << 20);
    cr_assert_eq(pd_autocache_match(c, NULL, t, NB, blocks), NB);
    check_payloads(t, blocks, NB, bytes);
    pd_autocache_free(c);
    pd_store_close(st);
}

Test(autocache, stored_blocks_are_bounded_lru_and_a_full_map_is_a_counted_failure) {
    enum { NB = 12, NBIG = 40 };
    const size_t bytes = 1000;
    pd_token t[NB * B];
    make_tokens(3, NB * B, t);
    pd_error err = {0};
    const void *blocks[NBIG]; /* both matches below write up to their max_blocks */
    pd_store *st = open_store(16u << 20);

    /* measure one record, then bound the store to five of them */
    pd_autocache *c = persisted_cache(st, 1u << 20, bytes, 1u << 20);
    insert_all(c, NULL, t, 1, bytes);
    cr_assert_eq(pd_autocache_persist(c, UINT64_MAX, &err), PD_OK, "%s", err.msg);
    const uint64_t record = store_stats(st).auto_bytes;
    cr_assert_gt(record, bytes);
    pd_autocache_free(c);

    c = persisted_cache(st, 1u << 20, bytes, 5 * record);
    insert_all(c, NULL, t, NB, bytes);
    cr_assert_eq(pd_autocache_persist(c, UINT64_MAX, &err), PD_OK, "%s", err.msg);
    pd_store_stats ss = store_stats(st);
    cr_assert_eq(ss.auto_blocks, 5);
    cr_assert_eq(ss.auto_bytes, 5 * record);
    pd_autocache_stats a;
    pd_autocache_stats_get(c, &a);
    cr_assert_eq(a.disk_evictions, NB - 5, "block 0, stored already, is replaced, not evicted");
    pd_autocache_free(c);
    /* the least recently used are the chain's tail: its first five blocks stay */
    c = persisted_cache(st, 1u << 20, bytes, 5 * record);
    cr_assert_eq(pd_autocache_match(c, NULL, t, NB, blocks), 5);
    check_payloads(t, blocks, 5, bytes);
    pd_autocache_free(c);
    pd_store_close(st);

    /* a 1 MiB map cannot take 40 blocks of 64 KiB: the persist fails, is
     * counted, leaves nothing pending and the store usable */
    char dir[1200];
    snprintf(dir, sizeof dir, "%s/store", tmpdir);
    th_rmtree(dir);
    st = open_store(1u << 20);
    pd_token big[NBIG * B];
    make_tokens(5, NBIG * B, big);
    c = persisted_cache(st, 64u << 20, 64u << 10, 64u << 20);
    insert_all(c, NULL, big, NBIG, 64u << 10);
    int rc = pd_autocache_persist(c, UINT64_MAX, &err);
    cr_assert_eq(rc, PD_ERANGE, "%d %s", rc, err.msg);
    cr_assert(strstr(err.msg, "cache.map_size_mb") != NULL, "%s", err.msg);
    pd_autocache_stats_get(c, &a);
    cr_assert_eq(a.disk_failures, 1);
    cr_assert_eq(a.pending, 0);
    cr_assert_eq(store_stats(st).auto_blocks, 0, "a failed persist writes nothing");
    cr_assert_eq(pd_autocache_match(c, NULL, big, NBIG, blocks), NBIG, "RAM is unaffected");
    /* used again: pending again; a smaller chunk fits */
    cr_assert_eq(pd_autocache_persist(c, 4 * (64u << 10), &err), PD_OK, "%s", err.msg);
    cr_assert_gt(store_stats(st).auto_blocks, 0);
    pd_autocache_free(c);
    pd_store_close(st);
}
