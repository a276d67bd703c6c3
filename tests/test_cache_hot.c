/* The hot tier over a real LMDB store in a temp dir: hit/miss counting,
 * reference counts under eviction pressure, LRU order, invalidation while
 * held, oversize entries, errors passing through, many threads at once. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache/cache.h"
#include "helpers.h"

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

TestSuite(cache_hot, .init = setup, .fini = teardown);

static const uint8_t fingerprint[PD_SHA256_LEN] = {1, 2, 3, 4, 5, 6, 7, 8};

/* A prefix generated from a seed: every stream keeps `kept` of the n
 * tokens (evenly spread), so prefixes of one shape have one size. */
typedef struct gen {
    int32_t n_layer, n_head_kv, head_dim, n, kept;
    pd_token *tokens;
    pd_kv_prefix *kv;
} gen;

static void gen_make(gen *g, uint64_t seed, int32_t n_layer, int32_t n_head_kv, int32_t head_dim, int32_t n,
                     int32_t kept) {
    g->n_layer = n_layer;
    g->n_head_kv = n_head_kv;
    g->head_dim = head_dim;
    g->n = n;
    g->kept = kept;
    g->tokens = malloc((size_t)n * sizeof *g->tokens);
    float *k = malloc((size_t)kept * (size_t)head_dim * sizeof *k);
    float *v = malloc((size_t)kept * (size_t)head_dim * sizeof *v);
    int32_t *pos = malloc((size_t)kept * sizeof *pos);
    cr_assert(g->tokens && k && v && pos);
    uint64_t rng = seed * 7919 + 1;
    for (int32_t i = 0; i < n; i++) g->tokens[i] = (pd_token)(pd_splitmix64(&rng) % 32000);
    pd_hparams hp;
    memset(&hp, 0, sizeof hp);
    hp.n_layer = n_layer;
    hp.n_head_kv = n_head_kv;
    hp.head_dim = head_dim;
    pd_error err = {0};
    cr_assert_eq(pd_kv_prefix_create(&hp, n, PD_TYPE_F32, &g->kv, &err), PD_OK, "%s", err.msg);
    for (int32_t i = 0; i < kept; i++) pos[i] = (int32_t)((int64_t)i * n / kept);
    for (int l = 0; l < n_layer; l++)
        for (int h = 0; h < n_head_kv; h++) {
            for (int64_t j = 0; j < (int64_t)kept * head_dim; j++) { /* multiples of 2^-9 below 2: exact in f16 */
                k[j] = (float)((int64_t)(pd_splitmix64(&rng) % 2001) - 1000) / 512.0f;
                v[j] = (float)((int64_t)(pd_splitmix64(&rng) % 2001) - 1000) / 512.0f;
            }
            cr_assert_eq(pd_kv_prefix_set(g->kv, l, h, pos, k, v, kept, &err), PD_OK, "%s", err.msg);
        }
    free(k);
    free(v);
    free(pos);
}

static void gen_free(gen *g) {
    pd_kv_prefix_free(g->kv);
    free(g->tokens);
    memset(g, 0, sizeof *g);
}

static pd_store *open_store(void) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/store", tmpdir);
    pd_store_opts o;
    pd_store_opts_default(&o);
    o.dir = dir;
    o.map_size = 256ull << 20;
    pd_store *s = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_store_open(&o, &s, &err), PD_OK, "%s", err.msg);
    return s;
}

static void put(pd_store *s, const gen *g, pd_kv_dtype dtype, pd_prefix_id *id) {
    pd_prefix_info info;
    memset(&info, 0, sizeof info);
    memcpy(info.fingerprint, fingerprint, sizeof fingerprint);
    snprintf(info.spec, sizeof info.spec, "hot-test:retention=0.5");
    info.dtype = dtype;
    bool existed = true;
    pd_error err = {0};
    cr_assert_eq(pd_store_put(s, &info, g->tokens, g->n, g->kv, &existed, &err), PD_OK, "%s", err.msg);
    cr_assert_not(existed);
    *id = info.id;
}

/* Stream (l, h) of two prefixes holds the same positions and values
 * (compared widened to f32: the generated values are exact in f16). */
static bool same_stream(const pd_kv_prefix *a, const pd_kv_prefix *b, int l, int h, int32_t head_dim) {
    const int32_t *p1, *p2;
    const int64_t n1 = pd_kv_prefix_stream(a, l, h, &p1, NULL, NULL), n2 = pd_kv_prefix_stream(b, l, h, &p2, NULL, NULL);
    if (n1 != n2 || (n1 && memcmp(p1, p2, (size_t)n1 * sizeof *p1) != 0)) return false;
    const size_t vals = (size_t)n1 * (size_t)head_dim;
    float *k1 = malloc(sizeof(float) * (vals + 1)), *k2 = malloc(sizeof(float) * (vals + 1));
    float *v1 = malloc(sizeof(float) * (vals + 1)), *v2 = malloc(sizeof(float) * (vals + 1));
    bool same = k1 && k2 && v1 && v2;
    if (same) {
        pd_kv_prefix_stream_f32(a, l, h, k1, v1);
        pd_kv_prefix_stream_f32(b, l, h, k2, v2);
        same = memcmp(k1, k2, vals * sizeof(float)) == 0 && memcmp(v1, v2, vals * sizeof(float)) == 0;
    }
    free(k1), free(k2), free(v1), free(v2);
    return same;
}

/* A hot entry holds the prefix as written, in the tier's KV type (f16). */
static void expect_same(const pd_hot_entry *e, const gen *g) {
    const pd_prefix_info *info = pd_hot_entry_info(e);
    cr_assert_eq(info->n_layer, g->n_layer);
    cr_assert_eq(info->n_head_kv, g->n_head_kv);
    cr_assert_eq(info->head_dim, g->head_dim);
    cr_assert_eq(info->n_tokens, g->n);
    cr_assert_eq(memcmp(pd_hot_entry_tokens(e), g->tokens, (size_t)g->n * sizeof(pd_token)), 0);
    const pd_kv_prefix *kv = pd_hot_entry_kv(e);
    cr_assert_eq(pd_kv_prefix_n_orig(kv), g->n);
    cr_assert_eq(pd_kv_prefix_type(kv), PD_TYPE_F16);
    for (int l = 0; l < g->n_layer; l++)
        for (int h = 0; h < g->n_head_kv; h++)
            cr_assert(same_stream(kv, g->kv, l, h, g->head_dim), "stream (%d, %d) differs", l, h);
}

static pd_hot_entry *acquire(pd_hot *h, const pd_prefix_id *id) {
    pd_hot_entry *e = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_hot_acquire(h, id, &e, &err), PD_OK, "%s", err.msg);
    cr_assert_not_null(e);
    return e;
}

static pd_hot_stats stats(pd_hot *h) {
    pd_hot_stats st;
    memset(&st, 0xff, sizeof st);
    pd_hot_stats_get(h, &st);
    return st;
}

/* Flip a byte of every copy of `pat` in the file (LMDB may keep stale
 * copies in free pages; the live one is among them). Returns the count. */
static int flip_all(const char *path, const void *pat, size_t n) {
    FILE *f = fopen(path, "r+b");
    cr_assert_not_null(f, "%s", path);
    cr_assert_eq(fseek(f, 0, SEEK_END), 0);
    long size = ftell(f);
    cr_assert_gt(size, 0);
    uint8_t *d = malloc((size_t)size);
    cr_assert_not_null(d);
    rewind(f);
    cr_assert_eq(fread(d, 1, (size_t)size, f), (size_t)size);
    int hits = 0;
    for (long i = 0; i + (long)n <= size; i++)
        if (memcmp(d + i, pat, n) == 0) {
            d[i + 1] ^= 0x5a;
            hits++;
        }
    rewind(f);
    cr_assert_eq(fwrite(d, 1, (size_t)size, f), (size_t)size);
    fclose(f);
    free(d);
    return hits;
}

/* The bytes an entry of this shape accounts for (f16 K and V, positions,
 * tokens), whether its rows are borrowed from the map or converted. */
static uint64_t entry_bytes(const gen *g) {
    uint64_t rows = (uint64_t)g->n_layer * (uint64_t)g->n_head_kv * (uint64_t)g->kept;
    return rows * (2 * (uint64_t)g->head_dim * 2 + 4) + (uint64_t)g->n * 4;
}

Test(cache_hot, hits_and_misses_are_counted_and_data_match) {
    pd_store *s = open_store();
    gen a, b;
    gen_make(&a, 1, 2, 2, 16, 40, 20);
    gen_make(&b, 2, 3, 1, 32, 70, 70);
    pd_prefix_id ia, ib;
    put(s, &a, PD_KV_F16, &ia);
    put(s, &b, PD_KV_F16, &ib);
    pd_hot *h = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_hot_create(s, 64ull << 20, &h, &err), PD_OK, "%s", err.msg);

    pd_hot_entry *e = acquire(h, &ia);
    expect_same(e, &a);
    pd_hot_stats st = stats(h);
    cr_assert_eq(st.misses, 1);
    cr_assert_eq(st.hits, 0);
    cr_assert_eq(st.entries, 1);
    cr_assert_eq(st.in_use, 1);
    cr_assert_eq(st.borrowing, 1, "f16 rows under an f16 cache are borrowed from the map, not copied");
    cr_assert_eq(st.bytes, entry_bytes(&a));
    cr_assert_eq(st.max_bytes, 64ull << 20);
    pd_hot_release(h, e);
    cr_assert_eq(stats(h).in_use, 0);

    pd_hot_entry *e2 = acquire(h, &ia);
    cr_assert_eq(e2, e, "a hit returns the cached entry");
    expect_same(e2, &a);
    pd_hot_entry *e3 = acquire(h, &ia); /* two holders of one entry */
    cr_assert_eq(e3, e);
    pd_hot_entry *eb = acquire(h, &ib);
    expect_same(eb, &b);
    st = stats(h);
    cr_assert_eq(st.hits, 2);
    cr_assert_eq(st.misses, 2);
    cr_assert_eq(st.entries, 2);
    cr_assert_eq(st.in_use, 2);
    cr_assert_eq(st.bytes, entry_bytes(&a) + entry_bytes(&b));
    cr_assert_eq(st.evictions, 0);
    cr_assert_eq(st.borrowing, 2);
    pd_hot_release(h, e2);
    cr_assert_eq(stats(h).in_use, 2, "still held once");
    pd_hot_release(h, e3);
    pd_hot_release(h, eb);
    cr_assert_eq(stats(h).in_use, 0);
    pd_hot_free(h);
    pd_store_close(s);
    gen_free(&a);
    gen_free(&b);
}

/* Records in another dtype than the tier's KV type (f32, bf16 under f16)
 * are converted once at load: the entry owns its rows (no read snapshot)
 * and equals what pd_store_get hands out. */
Test(cache_hot, other_dtypes_are_converted_once) {
    pd_store *s = open_store();
    pd_hot *h = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_hot_create(s, 64ull << 20, &h, &err), PD_OK, "%s", err.msg);
    const pd_kv_dtype types[] = {PD_KV_F32, PD_KV_BF16};
    for (int t = 0; t < 2; t++) {
        gen g;
        gen_make(&g, 10 + (uint64_t)t, 2, 2, 8, 33, 17);
        pd_prefix_id id;
        put(s, &g, types[t], &id);
        pd_hot_entry *e = acquire(h, &id);
        cr_assert_eq(stats(h).borrowing, 0, "%s rows are converted, not borrowed", pd_kv_dtype_name(types[t]));
        cr_assert_eq(stats(h).bytes, entry_bytes(&g) * (uint64_t)(t + 1), "bytes count f16 rows");
        pd_prefix_ref *r = NULL;
        cr_assert_eq(pd_store_get(s, &id, &r, &err), PD_OK, "%s", err.msg);
        cr_assert(!pd_prefix_ref_borrows(r));
        const pd_kv_prefix *want = pd_prefix_ref_kv(r);
        cr_assert_eq(pd_hot_entry_info(e)->dtype, types[t]);
        cr_assert_eq(pd_kv_prefix_type(pd_hot_entry_kv(e)), PD_TYPE_F16);
        for (int l = 0; l < 2; l++)
            for (int hd = 0; hd < 2; hd++) cr_assert(same_stream(pd_hot_entry_kv(e), want, l, hd, 8));
        if (types[t] == PD_KV_F32) expect_same(e, &g); /* exact in f16, not all in bf16 */
        pd_prefix_ref_release(r);
        pd_hot_release(h, e);
        gen_free(&g);
    }
    pd_hot_free(h);
    pd_store_close(s);
}

/* A borrowing entry's snapshot is bounded in age: past max_age its next
 * acquire reloads it (a miss, fresh snapshot), while a holder of the old
 * entry keeps reading valid rows until it releases. */
Test(cache_hot, old_snapshots_are_reloaded) {
    pd_store *s = open_store();
    gen g;
    gen_make(&g, 21, 2, 2, 16, 50, 25);
    pd_prefix_id id;
    put(s, &g, PD_KV_F16, &id);
    pd_hot *h = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_hot_create(s, 64ull << 20, &h, &err), PD_OK, "%s", err.msg);
    pd_hot_entry *old = acquire(h, &id);
    cr_assert_eq(acquire(h, &id), old, "young: a hit");
    pd_hot_release(h, old);
    pd_hot_set_max_age(h, 0);
    pd_hot_entry *fresh = acquire(h, &id);
    cr_assert_neq(fresh, old, "old: reloaded");
    expect_same(old, &g); /* still held, still valid */
    expect_same(fresh, &g);
    pd_hot_stats st = stats(h);
    cr_assert_eq(st.misses, 2);
    cr_assert_eq(st.hits, 1);
    cr_assert_eq(st.entries, 1, "the old entry left the map");
    cr_assert_eq(st.borrowing, 1);
    cr_assert_eq(st.bytes, entry_bytes(&g));
    pd_hot_release(h, old); /* its last holder: freed now */
    pd_hot_release(h, fresh);
    pd_hot_set_max_age(h, PD_HOT_SNAPSHOT_MAX_S);
    cr_assert_eq(acquire(h, &id), fresh, "young again: a hit");
    pd_hot_release(h, fresh);
    st = stats(h);
    cr_assert_eq(st.in_use, 0);
    pd_hot_free(h);
    pd_store_close(s);
    gen_free(&g);
}

/* The bound fits two entries. One is held throughout while others stream
 * through: the held one is never evicted and stays readable; the others
 * are evicted instead, and bytes exceed the bound by held entries only. */
Test(cache_hot, held_entry_survives_eviction_pressure) {
    pd_store *s = open_store();
    enum { N = 8 };
    gen g[N];
    pd_prefix_id id[N];
    for (int i = 0; i < N; i++) {
        gen_make(&g[i], 100 + (uint64_t)i, 2, 2, 16, 64, 32);
        put(s, &g[i], PD_KV_F16, &id[i]);
    }
    uint64_t one = entry_bytes(&g[0]);
    pd_hot *h = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_hot_create(s, 2 * one + one / 2, &h, &err), PD_OK, "%s", err.msg);

    pd_hot_entry *held = acquire(h, &id[0]);
    for (int round = 0; round < 3; round++)
        for (int i = 1; i < N; i++) {
            pd_hot_entry *e = acquire(h, &id[i]);
            expect_same(e, &g[i]);
            pd_hot_stats st = stats(h);
            cr_assert_leq(st.bytes, st.max_bytes, "two held entries fit the bound");
            pd_hot_release(h, e);
            expect_same(held, &g[0]);
        }
    pd_hot_stats st = stats(h);
    cr_assert_gt(st.evictions, 0);
    cr_assert_eq(st.in_use, 1);
    /* The held entry was never evicted: acquiring it again is a hit. */
    int64_t hits = st.hits;
    pd_hot_entry *again = acquire(h, &id[0]);
    cr_assert_eq(again, held);
    cr_assert_eq(stats(h).hits, hits + 1);
    pd_hot_release(h, again);

    /* Hold three at once in a tier that fits two: the third is cached
     * anyway (all three are held, nothing is evictable), so the tier is
     * over its bound by held entries only... */
    pd_hot_entry *e1 = acquire(h, &id[1]);
    pd_hot_entry *e2 = acquire(h, &id[2]);
    st = stats(h);
    cr_assert_eq(st.in_use, 3);
    cr_assert_eq(st.entries, 3);
    cr_assert_gt(st.bytes, st.max_bytes);
    expect_same(held, &g[0]);
    expect_same(e1, &g[1]);
    expect_same(e2, &g[2]);
    /* ...and back within it as soon as they are released. */
    pd_hot_release(h, e1);
    st = stats(h);
    cr_assert_leq(st.bytes, st.max_bytes);
    cr_assert_eq(st.entries, 2);
    pd_hot_release(h, e2);
    pd_hot_release(h, held);
    st = stats(h);
    cr_assert_leq(st.bytes, st.max_bytes);
    cr_assert_eq(st.in_use, 0);
    pd_hot_free(h);
    pd_store_close(s);
    for (int i = 0; i < N; i++) gen_free(&g[i]);
}

Test(cache_hot, least_recently_used_goes_first) {
    pd_store *s = open_store();
    enum { N = 5 };
    gen g[N];
    pd_prefix_id id[N];
    for (int i = 0; i < N; i++) {
        gen_make(&g[i], 200 + (uint64_t)i, 1, 2, 32, 50, 25);
        put(s, &g[i], PD_KV_F16, &id[i]);
    }
    uint64_t one = entry_bytes(&g[0]);
    pd_hot *h = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_hot_create(s, 3 * one, &h, &err), PD_OK, "%s", err.msg);
    /* Use A, B, C, then A again: B is now the least recently used. */
    const int order[] = {0, 1, 2, 0};
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) pd_hot_release(h, acquire(h, &id[order[i]]));
    pd_hot_stats st = stats(h);
    cr_assert_eq(st.entries, 3);
    cr_assert_eq(st.hits, 1);
    cr_assert_eq(st.evictions, 0);
    /* D evicts B. */
    pd_hot_release(h, acquire(h, &id[3]));
    st = stats(h);
    cr_assert_eq(st.evictions, 1);
    cr_assert_eq(st.entries, 3);
    int64_t hits = st.hits, misses = st.misses;
    /* A, C and D are hits (each touch reorders, but nothing is evicted). */
    pd_hot_release(h, acquire(h, &id[0]));
    pd_hot_release(h, acquire(h, &id[2]));
    pd_hot_release(h, acquire(h, &id[3]));
    st = stats(h);
    cr_assert_eq(st.hits, hits + 3);
    cr_assert_eq(st.misses, misses);
    /* LRU is now A; E evicts A, not C or D. */
    pd_hot_release(h, acquire(h, &id[4]));
    st = stats(h);
    cr_assert_eq(st.evictions, 2);
    hits = st.hits;
    misses = st.misses;
    pd_hot_release(h, acquire(h, &id[2])); /* hit */
    pd_hot_release(h, acquire(h, &id[3])); /* hit */
    pd_hot_release(h, acquire(h, &id[4])); /* hit */
    cr_assert_eq(stats(h).hits, hits + 3);
    pd_hot_entry *ea = acquire(h, &id[0]); /* miss: it was evicted */
    cr_assert_eq(stats(h).misses, misses + 1);
    expect_same(ea, &g[0]);
    pd_hot_release(h, ea);
    pd_hot_entry *eb = acquire(h, &id[1]); /* miss: evicted first of all */
    cr_assert_eq(stats(h).misses, misses + 2);
    expect_same(eb, &g[1]);
    pd_hot_release(h, eb);
    pd_hot_free(h);
    pd_store_close(s);
    for (int i = 0; i < N; i++) gen_free(&g[i]);
}

Test(cache_hot, invalidate_while_held) {
    pd_store *s = open_store();
    gen a;
    gen_make(&a, 300, 2, 1, 16, 30, 10);
    pd_prefix_id ia;
    put(s, &a, PD_KV_F16, &ia);
    pd_hot *h = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_hot_create(s, 64ull << 20, &h, &err), PD_OK, "%s", err.msg);

    pd_hot_entry *held = acquire(h, &ia);
    pd_hot_invalidate(h, &ia);
    pd_hot_stats st = stats(h);
    cr_assert_eq(st.entries, 0);
    cr_assert_eq(st.bytes, 0);
    cr_assert_eq(st.in_use, 0);
    expect_same(held, &a); /* the holder still reads it */
    /* A new acquire loads a fresh copy (a miss), not the invalidated one. */
    pd_hot_entry *fresh = acquire(h, &ia);
    cr_assert_neq(fresh, held);
    cr_assert_eq(stats(h).misses, 2);
    cr_assert_eq(stats(h).hits, 0);
    expect_same(fresh, &a);
    pd_hot_release(h, fresh);

    /* Deleted from the store and invalidated: gone for new acquires, still
     * readable by the holder, freed on its release. */
    cr_assert_eq(pd_store_delete(s, &ia, &err), PD_OK, "%s", err.msg);
    pd_hot_invalidate(h, &ia);
    pd_hot_entry *none = NULL;
    cr_assert_eq(pd_hot_acquire(h, &ia, &none, &err), PD_ENOTFOUND, "%s", err.msg);
    cr_assert_null(none);
    expect_same(held, &a);
    pd_hot_release(h, held);
    st = stats(h);
    cr_assert_eq(st.entries, 0);
    cr_assert_eq(st.in_use, 0);
    cr_assert_eq(st.bytes, 0);
    /* Invalidating an unknown id is harmless. */
    pd_hot_invalidate(h, &ia);
    pd_hot_free(h);
    pd_store_close(s);
    gen_free(&a);
}

/* Two processes on one store: a prefix the other one deletes is not served
 * from this one's hot tier, and one it stores again is served again. */
Test(cache_hot, delete_by_another_process_is_seen) {
    const char *exe = getenv("PD_PREFIXCTL");
    cr_assert(exe && *exe, "PD_PREFIXCTL is not set (run through meson test)");
    pd_store *s = open_store();
    gen a, b;
    gen_make(&a, 310, 2, 1, 16, 30, 10);
    gen_make(&b, 311, 2, 1, 16, 30, 10);
    pd_prefix_id ia, ib;
    put(s, &a, PD_KV_F16, &ia);
    put(s, &b, PD_KV_F16, &ib);
    pd_hot *h = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_hot_create(s, 64ull << 20, &h, &err), PD_OK, "%s", err.msg);
    pd_hot_release(h, acquire(h, &ia));
    pd_hot_release(h, acquire(h, &ib));
    cr_assert_eq(stats(h).entries, 2);

    char hex[PD_PREFIX_ID_HEX], cmd[4096];
    pd_prefix_id_hex(&ia, hex);
    snprintf(cmd, sizeof cmd, "'%s' store --dir '%s/store' delete %s", exe, tmpdir, hex);
    char *out = NULL;
    cr_assert_eq(th_run(cmd, &out), 0, "%s", out);
    free(out);

    pd_hot_entry *none = NULL;
    cr_assert_eq(pd_hot_acquire(h, &ia, &none, &err), PD_ENOTFOUND, "served a prefix deleted by another process");
    cr_assert_null(none);
    cr_assert_eq(stats(h).entries, 1, "the stale entry left the tier");
    pd_hot_entry *e = acquire(h, &ib); /* the other one is still a hit */
    expect_same(e, &b);
    pd_hot_release(h, e);
    cr_assert_eq(stats(h).hits, 1);

    put(s, &a, PD_KV_F16, &ia); /* stored again: found again */
    e = acquire(h, &ia);
    expect_same(e, &a);
    pd_hot_release(h, e);
    pd_hot_free(h);
    pd_store_close(s);
    gen_free(&a);
    gen_free(&b);
}

Test(cache_hot, oversize_entry_is_returned_uncached) {
    pd_store *s = open_store();
    gen big, small;
    gen_make(&big, 400, 2, 2, 64, 100, 100);
    gen_make(&small, 401, 1, 1, 8, 10, 5);
    pd_prefix_id ib, is;
    put(s, &big, PD_KV_F16, &ib);
    put(s, &small, PD_KV_F16, &is);
    pd_hot *h = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_hot_create(s, entry_bytes(&big) - 1, &h, &err), PD_OK, "%s", err.msg);
    pd_hot_entry *es = acquire(h, &is);
    pd_hot_release(h, es);
    pd_hot_entry *e1 = acquire(h, &ib);
    expect_same(e1, &big);
    pd_hot_stats st = stats(h);
    cr_assert_eq(st.entries, 1, "only the small one is cached");
    cr_assert_eq(st.bytes, entry_bytes(&small));
    cr_assert_eq(st.evictions, 0, "an uncached entry evicts nothing");
    pd_hot_entry *e2 = acquire(h, &ib);
    cr_assert_neq(e2, e1, "each acquire of an oversize prefix loads its own copy");
    cr_assert_eq(stats(h).misses, 3);
    expect_same(e2, &big);
    pd_hot_release(h, e1);
    expect_same(e2, &big);
    pd_hot_release(h, e2);
    cr_assert_eq(stats(h).bytes, entry_bytes(&small));
    /* A zero-byte tier caches nothing but still serves. */
    pd_hot *h0 = NULL;
    cr_assert_eq(pd_hot_create(s, 0, &h0, &err), PD_OK, "%s", err.msg);
    pd_hot_entry *e0 = acquire(h0, &is);
    expect_same(e0, &small);
    cr_assert_eq(stats(h0).entries, 0);
    pd_hot_release(h0, e0);
    pd_hot_free(h0);
    pd_hot_free(h);
    pd_store_close(s);
    gen_free(&big);
    gen_free(&small);
}

Test(cache_hot, errors_pass_through) {
    pd_store *s = open_store();
    pd_hot *h = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_hot_create(s, 1 << 20, &h, &err), PD_OK, "%s", err.msg);
    pd_prefix_id missing;
    memset(missing.b, 0xab, sizeof missing.b);
    pd_hot_entry *e = (pd_hot_entry *)&err; /* must be reset */
    cr_assert_eq(pd_hot_acquire(h, &missing, &e, &err), PD_ENOTFOUND);
    cr_assert_null(e);
    cr_assert_neq(err.msg[0], '\0', "a missing prefix comes with a message");
    pd_hot_stats st = stats(h);
    cr_assert_eq(st.misses, 1);
    cr_assert_eq(st.entries, 0);
    cr_assert_eq(st.in_use, 0);
    pd_hot *bad = (pd_hot *)&err;
    cr_assert_eq(pd_hot_create(NULL, 1, &bad, &err), PD_EINVAL);
    cr_assert_null(bad);
    pd_hot_free(NULL);
    pd_hot_release(h, NULL);
    pd_hot_free(h);

    /* A corrupt record is PD_EFORMAT through the tier too, and not cached. */
    gen g;
    gen_make(&g, 600, 1, 2, 8, 24, 12);
    for (int j = 0; j < 4; j++) g.tokens[j] = 800000 + j; /* findable in the data file */
    pd_prefix_id id;
    put(s, &g, PD_KV_F32, &id);
    pd_store_close(s);
    char data[1100];
    snprintf(data, sizeof data, "%s/store/data.mdb", tmpdir);
    uint8_t pat[16];
    for (int j = 0; j < 4; j++)
        for (int b = 0; b < 4; b++) pat[4 * j + b] = (uint8_t)((uint32_t)g.tokens[j] >> (8 * b));
    cr_assert_gt(flip_all(data, pat, sizeof pat), 0, "the token ids are in the data file");
    s = open_store();
    cr_assert_eq(pd_hot_create(s, 1 << 20, &h, &err), PD_OK, "%s", err.msg);
    e = NULL;
    cr_assert_eq(pd_hot_acquire(h, &id, &e, &err), PD_EFORMAT, "%s", err.msg);
    cr_assert_null(e);
    cr_assert_eq(pd_hot_acquire(h, &id, &e, &err), PD_EFORMAT, "still corrupt, never served from the tier");
    st = stats(h);
    cr_assert_eq(st.misses, 2);
    cr_assert_eq(st.entries, 0);
    pd_hot_free(h);
    pd_store_close(s);
    gen_free(&g);
}

/* Many threads acquire, read and release many ids through a small tier
 * while one of them also invalidates: every read sees the right data, the
 * counters add up, and (under ASan) nothing is freed while held. */
enum { CONC_THREADS = 8, CONC_IDS = 40, CONC_ITERS = 500 };

typedef struct conc {
    pd_hot *h;
    const gen *g;
    const pd_prefix_id *id;
    int thread;
    int64_t acquires, bad, errors;
} conc;

static bool same_data(const pd_hot_entry *e, const gen *g) {
    if (pd_hot_entry_info(e)->n_tokens != g->n ||
        memcmp(pd_hot_entry_tokens(e), g->tokens, (size_t)g->n * sizeof(pd_token)) != 0)
        return false;
    for (int l = 0; l < g->n_layer; l++)
        for (int hd = 0; hd < g->n_head_kv; hd++)
            if (!same_stream(pd_hot_entry_kv(e), g->kv, l, hd, g->head_dim)) return false;
    return true;
}

static void *conc_main(void *arg) {
    conc *c = arg;
    uint64_t rng = 1000 + (uint64_t)c->thread;
    pd_hot_entry *keep = NULL; /* sometimes hold one across iterations */
    int keep_i = 0;
    for (int it = 0; it < CONC_ITERS; it++) {
        int i = (int)(pd_splitmix64(&rng) % CONC_IDS);
        if (c->thread == 0 && pd_splitmix64(&rng) % 8 == 0) pd_hot_invalidate(c->h, &c->id[i]);
        pd_hot_entry *e = NULL;
        pd_error err = {0};
        if (pd_hot_acquire(c->h, &c->id[i], &e, &err) != PD_OK) {
            c->errors++;
            continue;
        }
        c->acquires++;
        if (!same_data(e, &c->g[i])) c->bad++;
        if (!keep && pd_splitmix64(&rng) % 4 == 0) {
            keep = e;
            keep_i = i;
            continue;
        }
        pd_hot_release(c->h, e);
        if (keep && pd_splitmix64(&rng) % 3 == 0) {
            if (!same_data(keep, &c->g[keep_i])) c->bad++;
            pd_hot_release(c->h, keep);
            keep = NULL;
        }
    }
    if (keep) pd_hot_release(c->h, keep);
    return NULL;
}

Test(cache_hot, concurrent_acquire_release_from_eight_threads, .timeout = 100) {
    pd_store *s = open_store();
    gen *g = calloc(CONC_IDS, sizeof *g);
    pd_prefix_id *id = calloc(CONC_IDS, sizeof *id);
    cr_assert(g && id);
    for (int i = 0; i < CONC_IDS; i++) {
        gen_make(&g[i], 500 + (uint64_t)i, 1 + i % 3, 1 + i % 2, 16, 20 + i, 10 + i / 2);
        put(s, &g[i], i % 2 ? PD_KV_F32 : PD_KV_F16, &id[i]); /* converted and borrowed entries */
    }
    pd_hot *h = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_hot_create(s, 12 * entry_bytes(&g[CONC_IDS / 2]), &h, &err), PD_OK, "%s", err.msg);
    conc c[CONC_THREADS];
    pthread_t t[CONC_THREADS];
    for (int i = 0; i < CONC_THREADS; i++) {
        c[i] = (conc){.h = h, .g = g, .id = id, .thread = i};
        cr_assert_eq(pthread_create(&t[i], NULL, conc_main, &c[i]), 0);
    }
    int64_t acquires = 0;
    for (int i = 0; i < CONC_THREADS; i++) {
        cr_assert_eq(pthread_join(t[i], NULL), 0);
        cr_assert_eq(c[i].errors, 0, "thread %d: acquire failed", i);
        cr_assert_eq(c[i].bad, 0, "thread %d read wrong data %" PRId64 " times", i, c[i].bad);
        acquires += c[i].acquires;
    }
    pd_hot_stats st = stats(h);
    cr_assert_eq(acquires, (int64_t)CONC_THREADS * CONC_ITERS);
    cr_assert_eq(st.hits + st.misses, acquires);
    cr_assert_gt(st.hits, 0);
    cr_assert_gt(st.evictions, 0);
    cr_assert_eq(st.in_use, 0);
    cr_assert_leq(st.bytes, st.max_bytes, "nothing held: back within the bound");
    cr_log_info("hits %" PRId64 ", misses %" PRId64 ", evictions %" PRId64, st.hits, st.misses, st.evictions);
    pd_hot_free(h);
    pd_store_close(s);
    for (int i = 0; i < CONC_IDS; i++) gen_free(&g[i]);
    free(g);
    free(id);
}

/* ---- `prefixctl store` ------------------------------------------------ */

/* Runs `$PD_PREFIXCTL store --dir DIR args` (stdout only unless args
 * redirect); returns the exit status and the output in *out. */
static int store_cli(const char *dir, const char *args, char **out) {
    const char *exe = getenv("PD_PREFIXCTL");
    cr_assert(exe && *exe, "PD_PREFIXCTL is not set (run through meson test)");
    char cmd[4096];
    if (dir) snprintf(cmd, sizeof cmd, "'%s' store --dir '%s' %s", exe, dir, args);
    else snprintf(cmd, sizeof cmd, "'%s' store %s", exe, args);
    char *o = NULL;
    int rc = th_run(cmd, &o);
    cr_assert_not_null(o, "%s: no output captured", cmd);
    if (out) *out = o;
    else free(o);
    return rc;
}

Test(cache_hot, prefixctl_store_commands) {
    char *out = NULL;
    /* Skipped until the lead wires `store` into tools/prefixctl.c. */
    if (store_cli(NULL, "--help >/dev/null 2>&1", NULL) != 0)
        cr_skip_test("prefixctl has no `store` command yet");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/store", tmpdir);
    pd_store *s = open_store();
    gen g[3];
    pd_prefix_id id[3];
    char hex[3][PD_PREFIX_ID_HEX];
    for (int i = 0; i < 3; i++) {
        gen_make(&g[i], 700 + (uint64_t)i, 2, 2, 8, 40 + 10 * i, 20);
        for (int j = 0; j < 4; j++) g[i].tokens[j] = 900000 + 10 * i + j; /* findable in the data file */
        pd_prefix_info info;
        memset(&info, 0, sizeof info);
        memcpy(info.fingerprint, fingerprint, sizeof fingerprint);
        snprintf(info.spec, sizeof info.spec, "cli-test:retention=0.5");
        if (i == 1) snprintf(info.ns, sizeof info.ns, "tenant-x");
        info.dtype = i == 2 ? PD_KV_F16 : PD_KV_F32;
        info.pinned = i == 0;
        bool existed = true;
        pd_error err = {0};
        cr_assert_eq(pd_store_put(s, &info, g[i].tokens, g[i].n, g[i].kv, &existed, &err), PD_OK, "%s", err.msg);
        id[i] = info.id;
        pd_prefix_id_hex(&id[i], hex[i]);
    }
    pd_store_close(s);

    /* list: a header, one line per prefix, a total. */
    cr_assert_eq(store_cli(dir, "list", &out), 0, "%s", out);
    int lines = 0;
    for (const char *p = out; *p; p++) lines += *p == '\n';
    cr_assert_eq(lines, 5, "%s", out);
    for (int i = 0; i < 3; i++) {
        char short_hex[17];
        memcpy(short_hex, hex[i], 16);
        short_hex[16] = '\0';
        const char *line = strstr(out, short_hex);
        cr_assert_not_null(line, "%s missing from:\n%s", short_hex, out);
        const char *eol = strchr(line, '\n');
        char buf[256];
        snprintf(buf, sizeof buf, "%.*s", (int)(eol - line), line);
        char ntok[16];
        snprintf(ntok, sizeof ntok, " %d ", g[i].n);
        cr_assert_not_null(strstr(buf, ntok), "token count in \"%s\"", buf);
        cr_assert_not_null(strstr(buf, i == 2 ? "f16" : "f32"), "%s", buf);
        cr_assert_not_null(strstr(buf, "iB"), "a human-readable size in \"%s\"", buf);
        if (i == 1) cr_assert_not_null(strstr(buf, "tenant-x"), "%s", buf);
        cr_assert_not_null(strstr(buf, i == 0 ? " yes " : " no "), "pinned column in \"%s\"", buf);
    }
    cr_assert_not_null(strstr(out, "3 prefixes"), "%s", out);
    free(out);

    /* show by a unique 12-digit prefix of the id. */
    char arg[128];
    snprintf(arg, sizeof arg, "show %.12s", hex[1]);
    cr_assert_eq(store_cli(dir, arg, &out), 0, "%s", out);
    cr_assert_not_null(strstr(out, hex[1]), "%s", out);
    cr_assert_not_null(strstr(out, "tenant-x"), "%s", out);
    cr_assert_not_null(strstr(out, "cli-test:retention=0.5"), "%s", out);
    cr_assert_not_null(strstr(out, "2 layers x 2 kv heads x 8 head dim"), "%s", out);
    cr_assert_not_null(strstr(out, "layer   1: 20 20"), "per-layer kept counts in:\n%s", out);
    free(out);

    cr_assert_eq(store_cli(dir, "stats", &out), 0, "%s", out);
    cr_assert_not_null(strstr(out, "prefixes:    3 (1 pinned)"), "%s", out);
    free(out);

    /* pin / unpin / delete, checked through the library. */
    snprintf(arg, sizeof arg, "pin %s", hex[2]);
    cr_assert_eq(store_cli(dir, arg, NULL), 0);
    snprintf(arg, sizeof arg, "unpin %.8s", hex[0]);
    cr_assert_eq(store_cli(dir, arg, NULL), 0);
    snprintf(arg, sizeof arg, "delete %.10s", hex[1]);
    cr_assert_eq(store_cli(dir, arg, NULL), 0);
    s = open_store();
    pd_prefix_info info;
    pd_error err = {0};
    cr_assert_eq(pd_store_info(s, &id[2], &info, &err), PD_OK, "%s", err.msg);
    cr_assert(info.pinned);
    cr_assert_eq(pd_store_info(s, &id[0], &info, &err), PD_OK, "%s", err.msg);
    cr_assert_not(info.pinned);
    cr_assert_eq(pd_store_info(s, &id[1], &info, &err), PD_ENOTFOUND);
    pd_store_close(s);

    /* Failures (1) and usage errors (2). */
    snprintf(arg, sizeof arg, "show %.12s 2>&1", hex[1]);
    cr_assert_eq(store_cli(dir, arg, &out), 1, "a deleted id: %s", out);
    cr_assert_not_null(strstr(out, "no stored prefix"), "%s", out);
    free(out);
    cr_assert_eq(store_cli(dir, "show abc 2>/dev/null", NULL), 2, "an id of three digits");
    cr_assert_eq(store_cli(dir, "frobnicate 2>/dev/null", NULL), 2);
    cr_assert_eq(store_cli(dir, "delete 2>/dev/null", NULL), 2);
    cr_assert_eq(store_cli(NULL, "list 2>/dev/null", NULL), 2, "no --dir");
    char missing[1100];
    snprintf(missing, sizeof missing, "%s/nothing-here", tmpdir);
    cr_assert_eq(store_cli(missing, "list 2>/dev/null", NULL), 1);

    /* Corruption: verify reports it (exit 1), --repair deletes it, and the
     * other prefix is untouched. */
    cr_assert_eq(store_cli(dir, "verify", &out), 0, "%s", out);
    cr_assert_not_null(strstr(out, "0 corrupt"), "%s", out);
    free(out);
    char data[1100];
    snprintf(data, sizeof data, "%s/data.mdb", dir);
    uint8_t pat[16];
    for (int j = 0; j < 4; j++) {
        uint32_t t = (uint32_t)g[2].tokens[j];
        for (int b = 0; b < 4; b++) pat[4 * j + b] = (uint8_t)(t >> (8 * b));
    }
    cr_assert_gt(flip_all(data, pat, sizeof pat), 0, "the token ids are in the data file");
    cr_assert_eq(store_cli(dir, "verify 2>/dev/null", &out), 1, "%s", out);
    cr_assert_not_null(strstr(out, hex[2]), "the corrupt id is named: %s", out);
    free(out);
    cr_assert_eq(store_cli(dir, "list 2>/dev/null", &out), 1, "%s", out);
    cr_assert_not_null(strstr(out, "CORRUPT"), "%s", out);
    free(out);
    cr_assert_eq(store_cli(dir, "verify --repair", &out), 0, "%s", out);
    cr_assert_not_null(strstr(out, "1 deleted"), "%s", out);
    free(out);
    cr_assert_eq(store_cli(dir, "verify", &out), 0, "%s", out);
    cr_assert_not_null(strstr(out, "checked 1 prefix:"), "%s", out);
    free(out);
    s = open_store();
    pd_prefix_ref *r = NULL;
    cr_assert_eq(pd_store_get(s, &id[0], &r, &err), PD_OK, "%s", err.msg);
    pd_prefix_ref_release(r);
    pd_store_close(s);

    /* A truncated data file: every command refuses it with exit status 1
     * (not SIGBUS) and names salvage, which copies what survives. */
    struct stat st;
    cr_assert_eq(stat(data, &st), 0);
    cr_assert_eq(truncate(data, st.st_size / 2), 0);
    const char *cmds[] = {"stats 2>&1", "list 2>&1", "verify 2>&1"};
    for (size_t i = 0; i < sizeof cmds / sizeof *cmds; i++) {
        cr_assert_eq(store_cli(dir, cmds[i], &out), 1, "%s: %s", cmds[i], out);
        cr_assert_not_null(strstr(out, "truncated"), "%s", out);
        cr_assert_not_null(strstr(out, "salvage NEW_DIR"), "%s", out);
        free(out);
    }
    char salvage[2300];
    snprintf(salvage, sizeof salvage, "salvage '%s/salvaged'", tmpdir);
    const int src = store_cli(dir, salvage, &out);
    cr_assert(src == 0 || src == 1, "exit 0 (all copied) or 1 (some dropped), not %d: %s", src, out);
    cr_assert_not_null(strstr(out, "data.mdb was truncated"), "%s", out);
    cr_assert_not_null(strstr(out, "salvaged "), "%s", out);
    free(out);
    snprintf(salvage, sizeof salvage, "%s/salvaged", tmpdir);
    cr_assert_eq(store_cli(salvage, "verify", &out), 0, "the salvaged store verifies: %s", out);
    free(out);
    snprintf(salvage, sizeof salvage, "salvage '%s/salvaged' 2>&1", tmpdir);
    cr_assert_eq(store_cli(dir, salvage, &out), 1, "not into an existing store: %s", out);
    cr_assert_not_null(strstr(out, "already holds a store"), "%s", out);
    free(out);
    cr_assert_eq(store_cli(dir, "salvage 2>/dev/null", NULL), 2, "salvage needs NEW_DIR");
    for (int i = 0; i < 3; i++) gen_free(&g[i]);
}
