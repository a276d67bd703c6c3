/* The LMDB prefix store with a real environment in a temporary directory:
 * prefix ids, round trips of many shapes and dtypes, zero-copy reads,
 * longest-prefix lookup, concurrent readers beside a writer, corruption
 * of the data file, a full map, LRU eviction, persistence and format
 * versions. */
#include <criterion/criterion.h>
#include <lmdb.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache/cache.h"
#include "helpers.h"
#include "kernels/kernels.h"

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

TestSuite(store, .init = setup, .fini = teardown, .timeout = 240);

/* ---- helpers ----------------------------------------------------------------- */

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static int64_t rng_range(uint64_t *s, int64_t lo, int64_t hi) { /* [lo, hi] */
    return lo + (int64_t)(rng_next(s) % (uint64_t)(hi - lo + 1));
}
static float rng_float(uint64_t *s) { return (float)((double)(rng_next(s) >> 11) / 9007199254740992.0 * 8.0 - 4.0); }

/* Readers attend with kv_type. */
static pd_store *open_store_kv(const char *dir, uint64_t map_size, uint64_t max_bytes, int32_t page_tokens, bool ro,
                               pd_type kv_type) {
    pd_store_opts o;
    pd_store_opts_default(&o);
    cr_assert_eq(o.kv_type, PD_TYPE_F16, "readers attend with f16 rows by default");
    o.kv_type = kv_type;
    o.dir = dir;
    if (map_size) o.map_size = map_size;
    o.max_bytes = max_bytes;
    if (page_tokens) o.page_tokens = page_tokens;
    o.read_only = ro;
    pd_store *s = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_store_open(&o, &s, &err), PD_OK, "open %s: %s", dir, err.msg);
    return s;
}

static pd_store *open_store_at(const char *dir, uint64_t map_size, uint64_t max_bytes, int32_t page_tokens, bool ro) {
    return open_store_kv(dir, map_size, max_bytes, page_tokens, ro, PD_TYPE_F16);
}

static char *store_dir(void) {
    static char buf[600];
    snprintf(buf, sizeof buf, "%s/store", tmpdir);
    return buf;
}

static pd_store *open_store(uint64_t map_size, uint64_t max_bytes) {
    return open_store_at(store_dir(), map_size, max_bytes, 0, false);
}

static void fingerprint_of(int model, uint8_t fp[PD_SHA256_LEN]) {
    for (int i = 0; i < PD_SHA256_LEN; i++) fp[i] = (uint8_t)(model * 31 + i);
}

/* A random prefix: every stream keeps a random sorted subset of [0, n). */
static pd_kv_prefix *random_kv(uint64_t *rng, int32_t n_layer, int32_t n_head_kv, int32_t head_dim, int32_t n,
                               int32_t max_rows) {
    pd_hparams hp = {.n_layer = n_layer, .n_head_kv = n_head_kv, .head_dim = head_dim};
    pd_kv_prefix *kv = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_kv_prefix_create(&hp, n, PD_TYPE_F32, &kv, &err), PD_OK, "%s", err.msg);
    int32_t cap = max_rows < n ? max_rows : n;
    int32_t *pos = malloc((size_t)(cap ? cap : 1) * sizeof *pos);
    float *k = malloc((size_t)(cap ? cap : 1) * (size_t)head_dim * sizeof *k);
    float *v = malloc((size_t)(cap ? cap : 1) * (size_t)head_dim * sizeof *v);
    cr_assert(pos && k && v);
    for (int32_t l = 0; l < n_layer; l++)
        for (int32_t h = 0; h < n_head_kv; h++) {
            int32_t len = (int32_t)rng_range(rng, 0, cap);
            /* Selection sampling: len sorted positions out of n. */
            int32_t got = 0;
            for (int32_t i = 0; i < n && got < len; i++)
                if ((int64_t)(rng_next(rng) % (uint64_t)(n - i)) < len - got) pos[got++] = i;
            for (int64_t i = 0; i < (int64_t)len * head_dim; i++) {
                k[i] = rng_float(rng);
                v[i] = rng_float(rng);
            }
            cr_assert_eq(pd_kv_prefix_set(kv, l, h, pos, k, v, len, &err), PD_OK, "%s", err.msg);
        }
    free(pos);
    free(k);
    free(v);
    return kv;
}

static pd_token *random_tokens(uint64_t *rng, int64_t n) {
    pd_token *t = malloc((size_t)n * sizeof *t);
    cr_assert_not_null(t);
    for (int64_t i = 0; i < n; i++) t[i] = (pd_token)rng_range(rng, 0, 49999);
    return t;
}

static float stored_value(float x, pd_kv_dtype dt) {
    switch (dt) {
    case PD_KV_F16: return pd_fp16_to_fp32(pd_fp32_to_fp16(x));
    case PD_KV_BF16: return pd_bf16_to_fp32(pd_fp32_to_bf16(x));
    default: return x;
    }
}

/* What a reader attending with kv type t gets for a stored value. */
static float read_value(float x, pd_kv_dtype dt, pd_type t) {
    const float stored = stored_value(x, dt);
    return t == PD_TYPE_F16 ? pd_fp16_to_fp32(pd_fp32_to_fp16(stored)) : stored;
}

/* Every stream of got equals want (f32) after rounding to dt, then to
 * got's type (the reader's). */
static void assert_same_kv(const pd_kv_prefix *want, const pd_kv_prefix *got, int32_t n_layer, int32_t n_head_kv,
                           int32_t head_dim, pd_kv_dtype dt) {
    cr_assert_eq(pd_kv_prefix_n_orig(got), pd_kv_prefix_n_orig(want));
    cr_assert_eq(pd_kv_prefix_kept_rows(got), pd_kv_prefix_kept_rows(want));
    cr_assert_eq(pd_kv_prefix_type(want), PD_TYPE_F32);
    const pd_type t = pd_kv_prefix_type(got);
    for (int32_t l = 0; l < n_layer; l++)
        for (int32_t h = 0; h < n_head_kv; h++) {
            const int32_t *wp, *gp;
            const void *wkr, *wvr;
            int64_t wl = pd_kv_prefix_stream(want, l, h, &wp, &wkr, &wvr);
            int64_t gl = pd_kv_prefix_stream(got, l, h, &gp, NULL, NULL);
            const float *wk = wkr, *wv = wvr;
            cr_assert_eq(gl, wl, "stream (%d, %d) length", l, h);
            if (!wl) continue;
            cr_assert(memcmp(gp, wp, (size_t)wl * sizeof *wp) == 0, "stream (%d, %d) positions", l, h);
            float *gk = malloc(sizeof(float) * (size_t)(wl * head_dim)), *gv = malloc(sizeof(float) * (size_t)(wl * head_dim));
            cr_assert(gk && gv);
            pd_kv_prefix_stream_f32(got, l, h, gk, gv);
            for (int64_t i = 0; i < wl * head_dim; i++) {
                float ek = read_value(wk[i], dt, t), ev = read_value(wv[i], dt, t);
                cr_assert(memcmp(&gk[i], &ek, sizeof ek) == 0, "stream (%d, %d) K[%ld]: %g != %g (%s, read as %s)", l,
                          h, (long)i, gk[i], ek, pd_kv_dtype_name(dt), pd_type_get(t)->name);
                cr_assert(memcmp(&gv[i], &ev, sizeof ev) == 0, "stream (%d, %d) V[%ld]", l, h, (long)i);
            }
            free(gk), free(gv);
        }
}

static pd_prefix_info base_info(int model, const char *spec, const char *ns, pd_kv_dtype dt) {
    pd_prefix_info info;
    memset(&info, 0, sizeof info);
    fingerprint_of(model, info.fingerprint);
    snprintf(info.spec, sizeof info.spec, "%s", spec);
    snprintf(info.ns, sizeof info.ns, "%s", ns ? ns : "");
    info.dtype = dt;
    info.quality = (pd_prefix_quality){.retention = 0.25, .tau = NAN, .nll_full = 2.5, .nll_ratio = 1.01};
    return info;
}

static pd_prefix_id put_ok(pd_store *s, pd_prefix_info *info, const pd_token *t, int64_t n, const pd_kv_prefix *kv) {
    pd_error err = {0};
    bool existed = true;
    cr_assert_eq(pd_store_put(s, info, t, n, kv, &existed, &err), PD_OK, "put: %s", err.msg);
    cr_assert(!existed);
    return info->id;
}

/* A small prefix (one layer, one head) covering tokens[0..n). */
static pd_prefix_id put_small(pd_store *s, int model, const char *spec, const char *ns, const pd_token *t, int64_t n,
                              uint64_t seed) {
    uint64_t rng = seed;
    pd_kv_prefix *kv = random_kv(&rng, 1, 1, 4, (int32_t)n, 3);
    pd_prefix_info info = base_info(model, spec, ns, PD_KV_F32);
    pd_prefix_id id = put_ok(s, &info, t, n, kv);
    pd_kv_prefix_free(kv);
    return id;
}

/* ---- ids ---------------------------------------------------------------------- */

Test(store, prefix_ids) {
    uint8_t fp1[PD_SHA256_LEN], fp2[PD_SHA256_LEN];
    fingerprint_of(1, fp1);
    fingerprint_of(2, fp2);
    pd_token t[] = {1, 2, 3, 4, 5}, u[] = {1, 2, 3, 4, 6};
    pd_prefix_id a, b;
    cr_assert_eq(pd_prefix_id_compute(fp1, t, 5, "snapkv:r=0.5", "tenant", &a), PD_OK);
    cr_assert_eq(pd_prefix_id_compute(fp1, t, 5, "snapkv:r=0.5", "tenant", &b), PD_OK);
    cr_assert(memcmp(&a, &b, sizeof a) == 0, "ids are deterministic");
    pd_prefix_id other[6];
    pd_prefix_id_compute(fp1, t, 5, "snapkv:r=0.5", "other", &other[0]);
    pd_prefix_id_compute(fp1, t, 5, "snapkv:r=0.25", "tenant", &other[1]);
    pd_prefix_id_compute(fp2, t, 5, "snapkv:r=0.5", "tenant", &other[2]);
    pd_prefix_id_compute(fp1, u, 5, "snapkv:r=0.5", "tenant", &other[3]);
    pd_prefix_id_compute(fp1, t, 4, "snapkv:r=0.5", "tenant", &other[4]);
    pd_prefix_id_compute(fp1, t, 5, "snapkv:r=0.5", NULL, &other[5]);
    for (int i = 0; i < 6; i++) {
        cr_assert(memcmp(&a, &other[i], sizeof a) != 0, "variant %d must change the id", i);
        for (int j = 0; j < i; j++) cr_assert(memcmp(&other[j], &other[i], sizeof a) != 0);
    }
    pd_prefix_id empty_ns;
    pd_prefix_id_compute(fp1, t, 5, "snapkv:r=0.5", "", &empty_ns);
    cr_assert(memcmp(&empty_ns, &other[5], sizeof a) == 0, "NULL namespace == \"\"");

    char hex[PD_PREFIX_ID_HEX];
    pd_prefix_id_hex(&a, hex);
    cr_assert_eq(strlen(hex), 64);
    pd_prefix_id back;
    pd_error err = {0};
    cr_assert_eq(pd_prefix_id_parse(hex, &back, &err), PD_OK, "%s", err.msg);
    cr_assert(memcmp(&a, &back, sizeof a) == 0);
    for (char *c = hex; *c; c++)
        if (*c >= 'a' && *c <= 'f') *c = (char)(*c - 'a' + 'A');
    cr_assert_eq(pd_prefix_id_parse(hex, &back, &err), PD_OK, "upper case: %s", err.msg);
    cr_assert(memcmp(&a, &back, sizeof a) == 0);
    cr_assert_eq(pd_prefix_id_parse("abc", &back, &err), PD_EINVAL);
    hex[10] = 'g';
    cr_assert_eq(pd_prefix_id_parse(hex, &back, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "hexadecimal"), "%s", err.msg);

    pd_kv_dtype dt;
    for (int i = 0; i <= PD_KV_BF16; i++) {
        cr_assert(pd_kv_dtype_from_name(pd_kv_dtype_name((pd_kv_dtype)i), &dt));
        cr_assert_eq(dt, (pd_kv_dtype)i);
    }
    cr_assert(!pd_kv_dtype_from_name("f64", &dt));
}

/* ---- round trip ------------------------------------------------------------------ */

typedef struct stored {
    pd_prefix_id id;
    pd_kv_prefix *kv;
    pd_token *tokens;
    int32_t n, n_layer, n_head_kv, head_dim;
    pd_kv_dtype dtype;
    pd_prefix_info info;
} stored;

static void check_stored(pd_store *s, const stored *r) {
    pd_prefix_ref *ref = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_store_get(s, &r->id, &ref, &err), PD_OK, "get: %s", err.msg);
    const pd_prefix_info *gi = pd_prefix_ref_info(ref);
    cr_assert(memcmp(&gi->id, &r->id, sizeof r->id) == 0);
    cr_assert_eq(gi->n_layer, r->n_layer);
    cr_assert_eq(gi->n_head_kv, r->n_head_kv);
    cr_assert_eq(gi->head_dim, r->head_dim);
    cr_assert_eq(gi->dtype, r->dtype);
    cr_assert_eq(gi->n_tokens, r->n);
    cr_assert_eq(gi->kept_rows, pd_kv_prefix_kept_rows(r->kv));
    cr_assert_eq(gi->bytes, r->info.bytes);
    cr_assert_eq(gi->created_at, r->info.created_at);
    cr_assert_str_eq(gi->spec, r->info.spec);
    cr_assert_str_eq(gi->ns, r->info.ns);
    cr_assert(memcmp(gi->fingerprint, r->info.fingerprint, PD_SHA256_LEN) == 0);
    cr_assert_eq(gi->quality.retention, r->info.quality.retention);
    cr_assert(isnan(gi->quality.tau));
    cr_assert(memcmp(pd_prefix_ref_tokens(ref), r->tokens, (size_t)r->n * sizeof(pd_token)) == 0);
    assert_same_kv(r->kv, pd_prefix_ref_kv(ref), r->n_layer, r->n_head_kv, r->head_dim, r->dtype);
    pd_prefix_ref_release(ref);
}

Test(store, round_trip_shapes_and_dtypes) {
    enum { N = 36 };
    static const int32_t dims[] = {2, 3, 7, 16, 31, 64, 65, 128};
    stored recs[N];
    uint64_t rng = 42;
    pd_store *s = open_store(0, 0);
    int64_t kept_total = 0;
    for (int i = 0; i < N; i++) {
        stored *r = &recs[i];
        r->n_layer = (int32_t)rng_range(&rng, 1, 6);
        r->n_head_kv = (int32_t)rng_range(&rng, 1, 4);
        r->head_dim = dims[rng_range(&rng, 0, 7)];
        r->n = (int32_t)(i % 5 == 0 ? rng_range(&rng, 1, 20) : rng_range(&rng, 1, 2000));
        r->dtype = (pd_kv_dtype)(i % 3);
        r->kv = random_kv(&rng, r->n_layer, r->n_head_kv, r->head_dim, r->n, (int32_t)rng_range(&rng, 0, 300));
        r->tokens = random_tokens(&rng, r->n);
        char spec[64];
        snprintf(spec, sizeof spec, "snapkv:r=0.%d", i);
        r->info = base_info(i % 4, spec, i % 2 ? "tenant-a" : "", r->dtype);
        r->info.pinned = i % 7 == 0;
        put_ok(s, &r->info, r->tokens, r->n, r->kv);
        r->id = r->info.id;
        cr_assert_eq(r->info.kept_rows, pd_kv_prefix_kept_rows(r->kv));
        cr_assert_eq(r->info.n_tokens, r->n);
        cr_assert_gt(r->info.bytes, 0);
        kept_total += r->info.kept_rows;
        pd_prefix_id want;
        pd_prefix_id_compute(r->info.fingerprint, r->tokens, r->n, r->info.spec, r->info.ns, &want);
        cr_assert(memcmp(&want, &r->id, sizeof want) == 0, "the stored id is pd_prefix_id_compute's");
    }
    cr_assert_gt(kept_total, 0);
    for (int i = 0; i < N; i++) check_stored(s, &recs[i]);

    /* The same prefix again is left alone and reported. */
    pd_prefix_info again = recs[3].info;
    memset(&again.id, 0, sizeof again.id);
    again.bytes = 0;
    again.created_at = 0;
    bool existed = false;
    pd_error err = {0};
    cr_assert_eq(pd_store_put(s, &again, recs[3].tokens, recs[3].n, recs[3].kv, &existed, &err), PD_OK, "%s",
                 err.msg);
    cr_assert(existed);
    cr_assert(memcmp(&again.id, &recs[3].id, sizeof again.id) == 0);
    cr_assert_eq(again.bytes, recs[3].info.bytes);
    cr_assert_eq(again.created_at, recs[3].info.created_at);
    cr_assert_eq(again.kept_rows, recs[3].info.kept_rows);

    pd_store_stats st;
    cr_assert_eq(pd_store_stats_get(s, &st, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(st.prefixes, N);
    uint64_t bytes = 0;
    int64_t pinned = 0;
    for (int i = 0; i < N; i++) {
        bytes += recs[i].info.bytes;
        pinned += recs[i].info.pinned;
    }
    cr_assert_eq(st.bytes, bytes);
    cr_assert_eq(st.pinned, pinned);
    cr_assert_geq(st.map_used, bytes);
    cr_assert_geq(st.map_size, st.map_used);

    pd_store_verify_report rep;
    cr_assert_eq(pd_store_verify(s, false, NULL, NULL, &rep, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(rep.checked, N);
    cr_assert_eq(rep.corrupt, 0);

    /* Reopen: everything persisted. Then read-only. */
    pd_store_close(s);
    s = open_store(0, 0);
    for (int i = 0; i < N; i++) check_stored(s, &recs[i]);
    pd_store_close(s);
    s = open_store_at(store_dir(), 0, 0, 0, true);
    for (int i = 0; i < N; i += 5) check_stored(s, &recs[i]);
    pd_prefix_info ro = recs[0].info;
    cr_assert_eq(pd_store_put(s, &ro, recs[0].tokens, recs[0].n, recs[0].kv, &existed, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "read-only"), "%s", err.msg);
    cr_assert_eq(pd_store_delete(s, &recs[0].id, &err), PD_EINVAL);
    pd_store_close(s);
    for (int i = 0; i < N; i++) {
        pd_kv_prefix_free(recs[i].kv);
        free(recs[i].tokens);
    }
}

/* The address range of the data file's mapping, from /proc/self/maps. */
static bool data_map_range(const char *dir, uintptr_t *lo, uintptr_t *hi) {
    char want[700], real[4096];
    snprintf(want, sizeof want, "%s/data.mdb", dir);
    if (!realpath(want, real)) return false;
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return false;
    char line[8192];
    bool found = false;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        size_t ll = strlen(line), rl = strlen(real);
        if (ll < rl || strcmp(line + ll - rl, real) != 0) continue;
        unsigned long a, b;
        if (sscanf(line, "%lx-%lx", &a, &b) == 2) {
            if (!found || a < *lo) *lo = a;
            if (!found || b > *hi) *hi = b;
            found = true;
        }
    }
    fclose(f);
    return found;
}

/* Rows stored in the readers' KV type are read in place (zero-copy, a
 * snapshot that outlives a delete); the other dtype is converted at load
 * into owned rows of the readers' type (an f32 record under an f16 cache,
 * an f16 record under an f32 one). */
static void zero_copy_rows(pd_type reader) {
    uint64_t rng = 7;
    pd_store *s = open_store_kv(store_dir(), 0, 0, 0, false, reader);
    const int32_t n = 600;
    pd_token *t = random_tokens(&rng, n);
    /* Large streams (LMDB overflow pages), f32 and f16. */
    pd_hparams hp = {.n_layer = 2, .n_head_kv = 2, .head_dim = 64};
    pd_kv_prefix *kv = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_kv_prefix_create(&hp, n, PD_TYPE_F32, &kv, &err), PD_OK);
    int32_t *pos = malloc(200 * sizeof *pos);
    float *k = malloc(200 * 64 * sizeof *k), *v = malloc(200 * 64 * sizeof *v);
    uint16_t *k16 = malloc(200 * 64 * 2);
    for (int i = 0; i < 200; i++) pos[i] = 3 * i;
    for (int i = 0; i < 200 * 64; i++) {
        k[i] = rng_float(&rng);
        v[i] = rng_float(&rng);
    }
    pd_fp32_to_fp16_row(k, k16, 200 * 64);
    for (int l = 0; l < 2; l++)
        for (int h = 0; h < 2; h++) cr_assert_eq(pd_kv_prefix_set(kv, l, h, pos, k, v, 200, &err), PD_OK);
    pd_prefix_info i32 = base_info(1, "h2o:r=0.33", "", PD_KV_F32), i16 = base_info(1, "h2o:r=0.33", "", PD_KV_F16);
    snprintf(i16.ns, sizeof i16.ns, "f16");
    put_ok(s, &i32, t, n, kv);
    put_ok(s, &i16, t, n, kv);

    pd_prefix_ref *r32 = NULL, *r16 = NULL;
    cr_assert_eq(pd_store_get(s, &i32.id, &r32, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_store_get(s, &i16.id, &r16, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_kv_prefix_type(pd_prefix_ref_kv(r32)), reader, "prefixes come in the readers' type");
    cr_assert_eq(pd_kv_prefix_type(pd_prefix_ref_kv(r16)), reader);
    /* The record in the readers' type is borrowed; the other one owns converted rows. */
    pd_prefix_ref *same = reader == PD_TYPE_F16 ? r16 : r32, *other = reader == PD_TYPE_F16 ? r32 : r16;
    const void *want = reader == PD_TYPE_F16 ? (const void *)k16 : (const void *)k;
    const size_t row_bytes = 64 * (reader == PD_TYPE_F16 ? 2 : 4);
    cr_assert(pd_prefix_ref_borrows(same));
    cr_assert(!pd_prefix_ref_borrows(other), "a converted record holds no read transaction");
    uintptr_t lo = 0, hi = 0;
    cr_assert(data_map_range(store_dir(), &lo, &hi), "the environment's data.mdb is mapped");
    float *back = malloc(200 * 64 * sizeof *back);
    for (int l = 0; l < 2; l++)
        for (int h = 0; h < 2; h++) {
            const int32_t *p;
            const void *kk, *vv;
            cr_assert_eq(pd_kv_prefix_stream(pd_prefix_ref_kv(same), l, h, &p, &kk, &vv), 200);
            cr_assert((uintptr_t)kk >= lo && (uintptr_t)kk + 200 * row_bytes <= hi, "K rows are read in place");
            cr_assert((uintptr_t)vv >= lo && (uintptr_t)vv + 200 * row_bytes <= hi, "V rows are read in place");
            cr_assert((uintptr_t)p >= lo && (uintptr_t)p < hi);
            cr_assert_eq((uintptr_t)kk % 16, 0, "rows are 16-byte aligned in the map");
            cr_assert(memcmp(kk, want, 200 * row_bytes) == 0);
            cr_assert_eq(pd_kv_prefix_stream(pd_prefix_ref_kv(other), l, h, &p, &kk, &vv), 200);
            cr_assert((uintptr_t)kk < lo || (uintptr_t)kk >= hi, "the other dtype is converted into owned memory");
            /* f32 rows under an f16 cache are rounded once; f16 rows widen exactly. */
            pd_kv_prefix_stream_f32(pd_prefix_ref_kv(other), l, h, back, NULL);
            for (int i = 0; i < 200 * 64; i++) cr_assert_eq(back[i], pd_fp16_to_fp32(k16[i]));
        }
    /* A borrowed prefix stays valid while the record is deleted under it. */
    const pd_prefix_id *same_id = same == r16 ? &i16.id : &i32.id;
    cr_assert_eq(pd_store_delete(s, same_id, &err), PD_OK, "%s", err.msg);
    const void *kk;
    pd_kv_prefix_stream(pd_prefix_ref_kv(same), 1, 1, NULL, &kk, NULL);
    cr_assert(memcmp(kk, want, 200 * row_bytes) == 0, "the snapshot outlives the delete");
    pd_prefix_ref_release(r32);
    pd_prefix_ref_release(r16);
    pd_prefix_ref *gone = NULL;
    cr_assert_eq(pd_store_get(s, same_id, &gone, &err), PD_ENOTFOUND);
    cr_assert_null(gone);
    pd_store_close(s);
    pd_kv_prefix_free(kv);
    free(pos);
    free(k);
    free(v);
    free(k16);
    free(back);
    free(t);
}

Test(store, zero_copy_f16_rows_live_in_the_map) { zero_copy_rows(PD_TYPE_F16); }
Test(store, zero_copy_f32_rows_live_in_the_map) { zero_copy_rows(PD_TYPE_F32); }

/* ---- lookup ------------------------------------------------------------------------ */

static int32_t lookup_len(pd_store *s, int model, const char *ns, const char *spec, const pd_token *t, int64_t n,
                          pd_prefix_id *id) {
    uint8_t fp[PD_SHA256_LEN];
    fingerprint_of(model, fp);
    pd_prefix_id got;
    int32_t matched = -1;
    pd_error err = {0};
    int rc = pd_store_lookup(s, fp, ns, spec, t, n, &got, &matched, &err);
    if (rc == PD_ENOTFOUND) return 0;
    cr_assert_eq(rc, PD_OK, "lookup: %s", err.msg);
    cr_assert_gt(matched, 0);
    if (id) *id = got;
    return matched;
}

Test(store, lookup_finds_the_longest_prefix) {
    uint64_t rng = 99;
    pd_store *s = open_store(0, 0);
    const int64_t N = 1000;
    pd_token *t = random_tokens(&rng, N);
    static const int64_t lens[] = {5, 16, 40, 100, 333, 1000};
    pd_prefix_id ids[6];
    for (int i = 0; i < 6; i++) ids[i] = put_small(s, 1, "snapkv:r=0.5", "a", t, lens[i], 100 + (uint64_t)i);

    pd_prefix_id got;
    cr_assert_eq(lookup_len(s, 1, "a", NULL, t, N, &got), 1000);
    cr_assert(memcmp(&got, &ids[5], sizeof got) == 0);
    cr_assert_eq(lookup_len(s, 1, "a", NULL, t, 999, &got), 333, "exact tail off a block boundary");
    cr_assert(memcmp(&got, &ids[4], sizeof got) == 0);
    cr_assert_eq(lookup_len(s, 1, "a", NULL, t, 350, NULL), 333);
    cr_assert_eq(lookup_len(s, 1, "a", NULL, t, 333, NULL), 333);
    cr_assert_eq(lookup_len(s, 1, "a", NULL, t, 332, NULL), 100);
    cr_assert_eq(lookup_len(s, 1, "a", NULL, t, 100, NULL), 100);
    cr_assert_eq(lookup_len(s, 1, "a", NULL, t, 17, NULL), 16);
    cr_assert_eq(lookup_len(s, 1, "a", NULL, t, 15, NULL), 5);
    cr_assert_eq(lookup_len(s, 1, "a", NULL, t, 5, NULL), 5);
    cr_assert_eq(lookup_len(s, 1, "a", NULL, t, 4, NULL), 0, "shorter than every prefix");

    /* A request that diverges inside a block or in a tail. */
    pd_token *u = malloc((size_t)N * sizeof *u);
    memcpy(u, t, (size_t)N * sizeof *u);
    u[50] ^= 1;
    cr_assert_eq(lookup_len(s, 1, "a", NULL, u, N, NULL), 40);
    memcpy(u, t, (size_t)N * sizeof *u);
    u[330] ^= 1; /* inside the 333 prefix's exact tail (blocks end at 320) */
    cr_assert_eq(lookup_len(s, 1, "a", NULL, u, N, NULL), 100);
    memcpy(u, t, (size_t)N * sizeof *u);
    u[2] ^= 1;
    cr_assert_eq(lookup_len(s, 1, "a", NULL, u, N, NULL), 0, "no match");

    /* Other models, namespaces and specs are ignored. */
    cr_assert_eq(lookup_len(s, 2, "a", NULL, t, N, NULL), 0);
    cr_assert_eq(lookup_len(s, 1, "b", NULL, t, N, NULL), 0);
    cr_assert_eq(lookup_len(s, 1, NULL, NULL, t, N, NULL), 0);
    cr_assert_eq(lookup_len(s, 1, "a", "snapkv:r=0.25", t, N, NULL), 0);
    cr_assert_eq(lookup_len(s, 1, "a", "snapkv:r=0.5", t, N, NULL), 1000);
    put_small(s, 1, "snapkv:r=0.5", "b", t, 200, 7);
    put_small(s, 2, "snapkv:r=0.5", "a", t, 700, 8);
    cr_assert_eq(lookup_len(s, 1, "b", NULL, t, N, NULL), 200);
    cr_assert_eq(lookup_len(s, 1, "a", NULL, t, 699, NULL), 333, "the other model's 700 is not seen");
    cr_assert_eq(lookup_len(s, 2, "a", NULL, t, N, NULL), 700);

    /* A second spec: the spec filter picks, no filter takes the longest. */
    pd_prefix_id s2 = put_small(s, 1, "tova:r=0.5", "a", t, 500, 9);
    cr_assert_eq(lookup_len(s, 1, "a", NULL, t, 600, &got), 500);
    cr_assert(memcmp(&got, &s2, sizeof got) == 0);
    cr_assert_eq(lookup_len(s, 1, "a", "snapkv:r=0.5", t, 600, NULL), 333);
    cr_assert_eq(lookup_len(s, 1, "a", "tova:r=0.5", t, 600, NULL), 500);
    /* Equal lengths under two specs: no filter takes the newest. */
    pd_prefix_id s3 = put_small(s, 1, "tova:r=0.5", "a", t, 333, 10);
    cr_assert_eq(lookup_len(s, 1, "a", NULL, t, 400, &got), 333);
    cr_assert(memcmp(&got, &s3, sizeof got) == 0, "ties go to the newest");

    /* A deleted prefix is no longer found; the next longest is. */
    pd_error err = {0};
    cr_assert_eq(pd_store_delete(s, &ids[5], &err), PD_OK, "%s", err.msg);
    cr_assert_eq(lookup_len(s, 1, "a", "snapkv:r=0.5", t, N, NULL), 333);
    cr_assert_eq(pd_store_delete(s, &ids[5], &err), PD_ENOTFOUND);

    /* Many prefixes sharing one index key (shorter than a block). */
    for (int i = 1; i <= 15; i++) put_small(s, 3, "snapkv:r=0.5", "", t, i, 200 + (uint64_t)i);
    for (int i = 1; i <= 15; i++) cr_assert_eq(lookup_len(s, 3, "", NULL, t, i, NULL), i);
    cr_assert_eq(lookup_len(s, 3, "", NULL, t, N, NULL), 15);
    pd_store_close(s);
    free(u);
    free(t);
}

/* ---- pin, list, delete ------------------------------------------------------------- */

typedef struct list_ctx {
    int n, n_bad, n_pinned;
    pd_prefix_id last;
    bool ordered;
} list_ctx;

static int list_fn(void *ctx, const pd_prefix_id *id, const pd_prefix_info *info, const char *why) {
    list_ctx *c = ctx;
    if (c->n && memcmp(&c->last, id, sizeof *id) >= 0) c->ordered = false;
    c->last = *id;
    c->n++;
    if (!info) c->n_bad++;
    else if (info->pinned) c->n_pinned++;
    (void)why;
    return 0;
}

static int stop_fn(void *ctx, const pd_prefix_id *id, const pd_prefix_info *info, const char *why) {
    (void)id, (void)info, (void)why;
    return ++*(int *)ctx == 2 ? 42 : 0;
}

Test(store, pin_list_delete) {
    uint64_t rng = 5;
    pd_store *s = open_store(0, 0);
    pd_token *t = random_tokens(&rng, 100);
    pd_prefix_id ids[8];
    for (int i = 0; i < 8; i++) ids[i] = put_small(s, 1, "x", "", t, 10 + i, (uint64_t)i);
    pd_error err = {0};
    cr_assert_eq(pd_store_pin(s, &ids[2], true, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_store_pin(s, &ids[5], true, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_store_pin(s, &ids[5], true, &err), PD_OK, "pinning twice is fine");
    pd_prefix_info info;
    cr_assert_eq(pd_store_info(s, &ids[2], &info, &err), PD_OK, "%s", err.msg);
    cr_assert(info.pinned);
    cr_assert_eq(info.n_tokens, 12);
    list_ctx c = {.ordered = true};
    cr_assert_eq(pd_store_list(s, list_fn, &c, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(c.n, 8);
    cr_assert_eq(c.n_bad, 0);
    cr_assert_eq(c.n_pinned, 2);
    cr_assert(c.ordered, "list walks in id order");
    int calls = 0;
    cr_assert_eq(pd_store_list(s, stop_fn, &calls, &err), 42, "a non-zero return stops the walk");
    cr_assert_eq(calls, 2);

    pd_store_stats st;
    cr_assert_eq(pd_store_stats_get(s, &st, &err), PD_OK);
    cr_assert_eq(st.prefixes, 8);
    cr_assert_eq(st.pinned, 2);
    cr_assert_eq(pd_store_pin(s, &ids[5], false, &err), PD_OK);
    cr_assert_eq(pd_store_delete(s, &ids[2], &err), PD_OK);
    cr_assert_eq(pd_store_stats_get(s, &st, &err), PD_OK);
    cr_assert_eq(st.prefixes, 7);
    cr_assert_eq(st.pinned, 0);
    cr_assert_eq(pd_store_info(s, &ids[2], &info, &err), PD_ENOTFOUND);
    cr_assert_eq(pd_store_pin(s, &ids[2], true, &err), PD_ENOTFOUND);
    pd_store_verify_report rep;
    cr_assert_eq(pd_store_verify(s, true, NULL, NULL, &rep, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(rep.checked, 7);
    cr_assert_eq(rep.corrupt, 0);
    cr_assert_eq(rep.deleted, 0);
    for (int i = 0; i < 8; i++)
        if (i != 2) cr_assert_eq(pd_store_delete(s, &ids[i], &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_store_stats_get(s, &st, &err), PD_OK);
    cr_assert_eq(st.prefixes, 0);
    cr_assert_eq(st.bytes, 0);
    cr_assert_eq(lookup_len(s, 1, "", NULL, t, 100, NULL), 0);
    pd_store_close(s);
    free(t);
}

/* ---- concurrency -------------------------------------------------------------------- */

/* Prefix k of the concurrency test: content is a function of (k, l, h, row,
 * d), so a reader can check what it got without a copy. */
enum { CC_LAYERS = 2, CC_HEADS = 2, CC_DIM = 24, CC_N = 300, CC_KEYS = 40 };

static float cc_value(int k, int l, int h, int32_t pos, int d, int which) {
    return (float)((k * 7 + l * 13 + h * 17 + pos * 3 + d * 5 + which * 11) % 1000) / 8.0f;
}

static int32_t cc_len(int k, int l, int h) { return 20 + (k * 31 + l * 7 + h * 3) % 200; }

static void cc_tokens(int k, pd_token *t) {
    for (int i = 0; i < CC_N; i++) t[i] = i == 0 ? 100000 + k : (pd_token)((k * 131 + i * 17) % 32000);
}

static pd_kv_prefix *cc_kv(int k) {
    pd_hparams hp = {.n_layer = CC_LAYERS, .n_head_kv = CC_HEADS, .head_dim = CC_DIM};
    pd_kv_prefix *kv = NULL;
    pd_error err = {0};
    if (pd_kv_prefix_create(&hp, CC_N, PD_TYPE_F32, &kv, &err)) return NULL;
    int32_t pos[CC_N];
    static float kk[CC_N * CC_DIM], vv[CC_N * CC_DIM]; /* only the writer thread calls this */
    for (int l = 0; l < CC_LAYERS; l++)
        for (int h = 0; h < CC_HEADS; h++) {
            int32_t len = cc_len(k, l, h);
            for (int32_t i = 0; i < len; i++) {
                pos[i] = i < 10 ? i : i + 80; /* a gap, as compression leaves */
                for (int d = 0; d < CC_DIM; d++) {
                    kk[i * CC_DIM + d] = cc_value(k, l, h, pos[i], d, 0);
                    vv[i * CC_DIM + d] = cc_value(k, l, h, pos[i], d, 1);
                }
            }
            if (pd_kv_prefix_set(kv, l, h, pos, kk, vv, len, &err)) {
                pd_kv_prefix_free(kv);
                return NULL;
            }
        }
    return kv;
}

typedef struct cc_shared {
    pd_store *s;
    pd_prefix_id ids[CC_KEYS];
    volatile int done;
    pthread_mutex_t mu;
    int failures;
    char first_failure[600];
    long hits, misses, lookups_hit;
} cc_shared;

static void cc_fail(cc_shared *c, const char *what, const char *msg) {
    pthread_mutex_lock(&c->mu);
    if (!c->failures++) snprintf(c->first_failure, sizeof c->first_failure, "%s: %s", what, msg);
    pthread_mutex_unlock(&c->mu);
}

/* The record of key k, read back (widened from the store's kv_type: the
 * values are exact in f16). */
static bool cc_check(int k, const pd_prefix_ref *r) {
    const pd_kv_prefix *kv = pd_prefix_ref_kv(r);
    if (pd_kv_prefix_n_orig(kv) != CC_N || pd_prefix_ref_info(r)->n_tokens != CC_N) return false;
    pd_token t[CC_N];
    cc_tokens(k, t);
    if (memcmp(t, pd_prefix_ref_tokens(r), sizeof t) != 0) return false;
    float *kk = malloc(sizeof(float) * CC_N * CC_DIM), *vv = malloc(sizeof(float) * CC_N * CC_DIM);
    bool ok = kk && vv;
    for (int l = 0; l < CC_LAYERS && ok; l++)
        for (int h = 0; h < CC_HEADS && ok; h++) {
            const int32_t *pos;
            if (pd_kv_prefix_stream(kv, l, h, &pos, NULL, NULL) != cc_len(k, l, h)) {
                ok = false;
                break;
            }
            pd_kv_prefix_stream_f32(kv, l, h, kk, vv);
            for (int32_t i = 0; i < cc_len(k, l, h) && ok; i++)
                for (int d = 0; d < CC_DIM; d++)
                    if (kk[i * CC_DIM + d] != cc_value(k, l, h, pos[i], d, 0) ||
                        vv[i * CC_DIM + d] != cc_value(k, l, h, pos[i], d, 1))
                        ok = false;
        }
    free(kk);
    free(vv);
    return ok;
}

static void *cc_reader(void *arg) {
    cc_shared *c = arg;
    uint64_t rng = (uint64_t)(uintptr_t)&rng;
    long hits = 0, misses = 0, lhits = 0;
    uint8_t fp[PD_SHA256_LEN];
    fingerprint_of(1, fp);
    for (int iter = 0; !c->done || iter < 50; iter++) {
        int k = (int)rng_range(&rng, 0, CC_KEYS - 1);
        pd_prefix_ref *r = NULL;
        pd_error err = {0};
        int rc = pd_store_get(c->s, &c->ids[k], &r, &err);
        if (rc == PD_OK) {
            hits++;
            if (!cc_check(k, r)) cc_fail(c, "get", "a prefix's contents are not what was written");
            pd_prefix_ref_release(r);
        } else if (rc == PD_ENOTFOUND) {
            misses++;
        } else {
            cc_fail(c, "get", err.msg);
        }
        pd_token t[CC_N + 7];
        cc_tokens(k, t);
        for (int i = CC_N; i < CC_N + 7; i++) t[i] = 5;
        pd_prefix_id got;
        int32_t matched = 0;
        rc = pd_store_lookup(c->s, fp, "", NULL, t, CC_N + 7, &got, &matched, &err);
        if (rc == PD_OK) {
            lhits++;
            if (matched != CC_N || memcmp(&got, &c->ids[k], sizeof got) != 0)
                cc_fail(c, "lookup", "found another prefix than the one the tokens start with");
        } else if (rc != PD_ENOTFOUND) {
            cc_fail(c, "lookup", err.msg);
        }
        if (iter % 25 == 0) {
            pd_store_verify_report rep;
            if (pd_store_verify(c->s, false, NULL, NULL, &rep, &err) != PD_OK)
                cc_fail(c, "verify", err.msg);
            else if (rep.corrupt)
                cc_fail(c, "verify", "a reader saw a torn record");
        }
    }
    pthread_mutex_lock(&c->mu);
    c->hits += hits;
    c->misses += misses;
    c->lookups_hit += lhits;
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static void *cc_writer(void *arg) {
    cc_shared *c = arg;
    uint64_t rng = 1234;
    for (int op = 0; op < 240; op++) {
        int k = (int)rng_range(&rng, 0, CC_KEYS - 1);
        pd_error err = {0};
        if (op % 3 == 2) {
            int rc = pd_store_delete(c->s, &c->ids[k], &err);
            if (rc != PD_OK && rc != PD_ENOTFOUND) cc_fail(c, "delete", err.msg);
            continue;
        }
        pd_kv_prefix *kv = cc_kv(k);
        if (!kv) {
            cc_fail(c, "writer", "cannot build a prefix");
            break;
        }
        pd_token t[CC_N];
        cc_tokens(k, t);
        pd_prefix_info info = base_info(1, "cc", "", PD_KV_F32);
        bool existed;
        if (pd_store_put(c->s, &info, t, CC_N, kv, &existed, &err) != PD_OK) cc_fail(c, "put", err.msg);
        pd_kv_prefix_free(kv);
    }
    c->done = 1;
    return NULL;
}

Test(store, concurrent_readers_and_a_writer) {
    cc_shared c;
    memset(&c, 0, sizeof c);
    pthread_mutex_init(&c.mu, NULL);
    c.s = open_store(0, 0);
    uint8_t fp[PD_SHA256_LEN];
    fingerprint_of(1, fp);
    for (int k = 0; k < CC_KEYS; k++) {
        pd_token t[CC_N];
        cc_tokens(k, t);
        pd_prefix_id_compute(fp, t, CC_N, "cc", "", &c.ids[k]);
    }
    pthread_t w, r[4];
    for (int i = 0; i < 4; i++) cr_assert_eq(pthread_create(&r[i], NULL, cc_reader, &c), 0);
    cr_assert_eq(pthread_create(&w, NULL, cc_writer, &c), 0);
    pthread_join(w, NULL);
    for (int i = 0; i < 4; i++) pthread_join(r[i], NULL);
    cr_assert_eq(c.failures, 0, "%d failures, first: %s", c.failures, c.first_failure);
    cr_assert_gt(c.hits, 0, "readers saw stored prefixes");
    cr_assert_gt(c.lookups_hit, 0);
    pd_store_verify_report rep;
    pd_error err = {0};
    cr_assert_eq(pd_store_verify(c.s, false, NULL, NULL, &rep, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(rep.corrupt, 0);
    pd_store_close(c.s);
    pthread_mutex_destroy(&c.mu);
}

/* ---- corruption ------------------------------------------------------------------------ */

/* Flip one byte at every occurrence of pat in the data file; returns the count. */
static int flip_in_data_file(const char *dir, const void *pat, size_t len, size_t at) {
    char path[700];
    snprintf(path, sizeof path, "%s/data.mdb", dir);
    return th_flip_in_file(path, pat, len, at);
}

typedef struct bad_ctx {
    int n;
    pd_prefix_id id;
    char why[512];
    bool had_info;
} bad_ctx;

static int bad_fn(void *ctx, const pd_prefix_id *id, const pd_prefix_info *info, const char *why) {
    bad_ctx *b = ctx;
    b->n++;
    b->id = *id;
    b->had_info = info != NULL;
    snprintf(b->why, sizeof b->why, "%s", why ? why : "");
    return 0;
}

Test(store, corrupt_rows_are_detected_and_repaired) {
    uint64_t rng = 77;
    pd_store *s = open_store(0, 0);
    const int32_t n = 400;
    pd_token *t = random_tokens(&rng, n);
    pd_kv_prefix *victim = random_kv(&rng, 3, 2, 32, n, 300), *other = random_kv(&rng, 3, 2, 32, n, 300);
    /* Make stream (2, 1) long enough for several pages. */
    int32_t pos[250];
    float *k = malloc(250 * 32 * sizeof *k), *v = malloc(250 * 32 * sizeof *v);
    for (int i = 0; i < 250; i++) pos[i] = i;
    for (int i = 0; i < 250 * 32; i++) {
        k[i] = 1000.0f + (float)i * 0.5f; /* a pattern nothing else has */
        v[i] = rng_float(&rng);
    }
    pd_error err = {0};
    cr_assert_eq(pd_kv_prefix_set(victim, 2, 1, pos, k, v, 250, &err), PD_OK, "%s", err.msg);
    pd_prefix_info vi = base_info(1, "s", "", PD_KV_F32), oi = base_info(1, "s", "other", PD_KV_F32);
    pd_prefix_id vid = put_ok(s, &vi, t, n, victim), oid = put_ok(s, &oi, t, n, other);
    pd_store_close(s);

    /* Row 70 of that stream sits in page 1 (64 rows a page). */
    cr_assert_geq(flip_in_data_file(store_dir(), &k[70 * 32], 16 * sizeof(float), 5), 1);
    s = open_store(0, 0);
    pd_prefix_ref *r = NULL;
    cr_assert_eq(pd_store_get(s, &vid, &r, &err), PD_EFORMAT);
    cr_assert_null(r);
    cr_assert(strstr(err.msg, "page 1 of stream (layer 2, head 1)"), "%s", err.msg);
    cr_assert(strstr(err.msg, "verify --repair"), "%s", err.msg);
    char hex[PD_PREFIX_ID_HEX];
    pd_prefix_id_hex(&vid, hex);
    cr_assert(strstr(err.msg, hex), "the message names the prefix: %s", err.msg);
    cr_assert_eq(pd_store_get(s, &oid, &r, &err), PD_OK, "the other prefix is fine: %s", err.msg);
    pd_prefix_ref_release(r);

    bad_ctx b = {0};
    pd_store_verify_report rep;
    cr_assert_eq(pd_store_verify(s, false, bad_fn, &b, &rep, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(rep.checked, 2);
    cr_assert_eq(rep.corrupt, 1);
    cr_assert_eq(rep.deleted, 0);
    cr_assert_eq(b.n, 1);
    cr_assert(memcmp(&b.id, &vid, sizeof vid) == 0);
    cr_assert(b.had_info, "the header is fine, so verify reports it");
    cr_assert(strstr(b.why, "page 1"), "%s", b.why);
    memset(&b, 0, sizeof b);
    cr_assert_eq(pd_store_verify(s, true, bad_fn, &b, &rep, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(rep.deleted, 1);
    cr_assert_eq(pd_store_get(s, &vid, &r, &err), PD_ENOTFOUND);
    cr_assert_eq(pd_store_verify(s, false, NULL, NULL, &rep, &err), PD_OK);
    cr_assert_eq(rep.corrupt, 0);
    cr_assert_eq(rep.checked, 1);
    pd_store_stats st;
    cr_assert_eq(pd_store_stats_get(s, &st, &err), PD_OK);
    cr_assert_eq(st.prefixes, 1);
    cr_assert_eq(st.bytes, oi.bytes);
    cr_assert_eq(pd_store_get(s, &oid, &r, &err), PD_OK, "%s", err.msg);
    pd_prefix_ref_release(r);
    /* The prefix can be stored again. */
    put_ok(s, &vi, t, n, victim);
    cr_assert_eq(pd_store_get(s, &vid, &r, &err), PD_OK, "%s", err.msg);
    assert_same_kv(victim, pd_prefix_ref_kv(r), 3, 2, 32, PD_KV_F32);
    pd_prefix_ref_release(r);
    pd_store_close(s);
    pd_kv_prefix_free(victim);
    pd_kv_prefix_free(other);
    free(k);
    free(v);
    free(t);
}

Test(store, corrupt_header_is_a_miss) {
    uint64_t rng = 78;
    pd_store *s = open_store(0, 0);
    pd_token *t = random_tokens(&rng, 300), *u = random_tokens(&rng, 300);
    for (int i = 0; i < 8; i++) t[100 + i] = 900000 + i; /* a token run only this header holds */
    pd_prefix_id short_id = put_small(s, 1, "s", "", t, 50, 1);
    pd_prefix_id vid = put_small(s, 1, "s", "", t, 300, 2);
    pd_prefix_id oid = put_small(s, 1, "s", "", u, 300, 3);
    cr_assert_eq(lookup_len(s, 1, "", NULL, t, 300, NULL), 300);
    pd_store_close(s);
    /* Older copies of the leaf page may sit in free pages: flip them all. */
    cr_assert_geq(flip_in_data_file(store_dir(), &t[100], 8 * sizeof(pd_token), 1), 1);

    s = open_store(0, 0);
    pd_error err = {0};
    pd_prefix_ref *r = NULL;
    cr_assert_eq(pd_store_get(s, &vid, &r, &err), PD_EFORMAT);
    cr_assert(strstr(err.msg, "header"), "%s", err.msg);
    pd_prefix_info info;
    cr_assert_eq(pd_store_info(s, &vid, &info, &err), PD_EFORMAT);
    pd_prefix_id got;
    cr_assert_eq(lookup_len(s, 1, "", NULL, t, 300, &got), 50, "a corrupt candidate is a miss");
    cr_assert(memcmp(&got, &short_id, sizeof got) == 0);
    list_ctx c = {.ordered = true};
    cr_assert_eq(pd_store_list(s, list_fn, &c, &err), PD_OK);
    cr_assert_eq(c.n, 3);
    cr_assert_eq(c.n_bad, 1, "list reports the corrupt header");
    bad_ctx b = {0};
    pd_store_verify_report rep;
    cr_assert_eq(pd_store_verify(s, true, bad_fn, &b, &rep, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(rep.corrupt, 1);
    cr_assert_eq(rep.deleted, 1);
    cr_assert(!b.had_info);
    cr_assert(memcmp(&b.id, &vid, sizeof vid) == 0);
    cr_assert_eq(pd_store_verify(s, false, NULL, NULL, &rep, &err), PD_OK);
    cr_assert_eq(rep.corrupt, 0, "no index or stream entries are left behind");
    cr_assert_eq(rep.checked, 2);
    cr_assert_eq(pd_store_get(s, &oid, &r, &err), PD_OK, "%s", err.msg);
    pd_prefix_ref_release(r);
    pd_store_close(s);
    free(t);
    free(u);
}

/* ---- limits ------------------------------------------------------------------------------ */

Test(store, map_full_is_a_clean_error) {
    uint64_t rng = 11;
    pd_store *s = open_store(1u << 20, 0);
    pd_token *t = random_tokens(&rng, 2000);
    pd_kv_prefix *kv = random_kv(&rng, 2, 2, 64, 200, 200); /* ~100 KiB a prefix */
    pd_prefix_id ids[64];
    int stored_n = 0, rc = PD_OK;
    pd_error err = {0};
    for (int i = 0; i < 64; i++) {
        t[0] = i;
        pd_prefix_info info = base_info(1, "s", "", PD_KV_F32);
        bool existed;
        rc = pd_store_put(s, &info, t, 200, kv, &existed, &err);
        if (rc != PD_OK) break;
        ids[stored_n++] = info.id;
    }
    cr_assert_eq(rc, PD_ERANGE, "a 1 MiB map fills up: %s", err.msg);
    cr_assert(strstr(err.msg, "cache.map_size_mb"), "%s", err.msg);
    cr_assert(strstr(err.msg, "full"), "%s", err.msg);
    cr_assert_gt(stored_n, 2);
    /* Everything committed is intact; nothing of the failed put is there. */
    pd_store_verify_report rep;
    cr_assert_eq(pd_store_verify(s, false, NULL, NULL, &rep, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(rep.checked, stored_n);
    cr_assert_eq(rep.corrupt, 0);
    for (int i = 0; i < stored_n; i++) {
        pd_prefix_ref *r = NULL;
        cr_assert_eq(pd_store_get(s, &ids[i], &r, &err), PD_OK, "%s", err.msg);
        pd_prefix_ref_release(r);
    }
    /* Deleting one makes room for one of the same size, at once; again and
     * again (LMDB reuses freed pages only two commits later). */
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(pd_store_delete(s, &ids[i], &err), PD_OK, "%s", err.msg);
        t[0] = 1000 + i;
        pd_prefix_info info = base_info(1, "s", "", PD_KV_F32);
        put_ok(s, &info, t, 200, kv);
    }
    pd_store_close(s);
    pd_kv_prefix_free(kv);
    free(t);
}

Test(store, eviction_is_lru_and_spares_pinned) {
    uint64_t rng = 12;
    pd_token *t = random_tokens(&rng, 100);
    pd_kv_prefix *kv = random_kv(&rng, 2, 2, 16, 100, 50);
    /* Size one record first: all records below have the same shape. */
    pd_store *s = open_store(0, 0);
    pd_prefix_info probe = base_info(1, "s", "", PD_KV_F32);
    put_ok(s, &probe, t, 100, kv);
    pd_store_close(s);
    th_rmtree(store_dir());
    const uint64_t one = probe.bytes;

    s = open_store(0, 3 * one + one / 2);
    pd_prefix_id id[8];
    pd_error err = {0};
    for (int i = 0; i < 3; i++) {
        t[0] = i;
        pd_prefix_info info = base_info(1, "s", "", PD_KV_F32);
        id[i] = put_ok(s, &info, t, 100, kv);
        cr_assert_eq(info.bytes, one);
    }
    /* Use 0: 1 is now the least recently used. */
    pd_prefix_ref *r = NULL;
    cr_assert_eq(pd_store_get(s, &id[0], &r, &err), PD_OK);
    pd_prefix_ref_release(r);
    t[0] = 3;
    pd_prefix_info info = base_info(1, "s", "", PD_KV_F32);
    id[3] = put_ok(s, &info, t, 100, kv);
    pd_prefix_info got;
    cr_assert_eq(pd_store_info(s, &id[1], &got, &err), PD_ENOTFOUND, "the least recently used went");
    cr_assert_eq(pd_store_info(s, &id[0], &got, &err), PD_OK, "the one just used stayed");
    cr_assert_eq(pd_store_info(s, &id[2], &got, &err), PD_OK);
    pd_store_stats st;
    cr_assert_eq(pd_store_stats_get(s, &st, &err), PD_OK);
    cr_assert_eq(st.evicted, 1);
    cr_assert_eq(st.prefixes, 3);
    cr_assert_leq(st.bytes, st.max_bytes);

    /* Pin 2 (now the oldest): 0 goes instead. */
    cr_assert_eq(pd_store_pin(s, &id[2], true, &err), PD_OK);
    t[0] = 4;
    info = base_info(1, "s", "", PD_KV_F32);
    id[4] = put_ok(s, &info, t, 100, kv);
    cr_assert_eq(pd_store_info(s, &id[2], &got, &err), PD_OK, "pinned prefixes are never evicted");
    cr_assert_eq(pd_store_info(s, &id[0], &got, &err), PD_ENOTFOUND);
    /* Pin everything: a new prefix cannot fit. */
    cr_assert_eq(pd_store_pin(s, &id[3], true, &err), PD_OK);
    cr_assert_eq(pd_store_pin(s, &id[4], true, &err), PD_OK);
    t[0] = 5;
    info = base_info(1, "s", "", PD_KV_F32);
    bool existed;
    cr_assert_eq(pd_store_put(s, &info, t, 100, kv, &existed, &err), PD_ERANGE);
    cr_assert(strstr(err.msg, "pinned"), "%s", err.msg);
    for (int i = 2; i <= 4; i++) cr_assert_eq(pd_store_info(s, &id[i], &got, &err), PD_OK);
    /* A prefix larger than the whole limit. */
    pd_kv_prefix *big = random_kv(&rng, 6, 4, 64, 100, 100);
    info = base_info(1, "s", "big", PD_KV_F32);
    cr_assert_eq(pd_store_put(s, &info, t, 100, big, &existed, &err), PD_ERANGE);
    pd_kv_prefix_free(big);
    pd_store_close(s);

    /* The LRU order survives a reopen. */
    s = open_store(0, 3 * one + one / 2);
    cr_assert_eq(pd_store_pin(s, &id[3], false, &err), PD_OK);
    cr_assert_eq(pd_store_pin(s, &id[4], false, &err), PD_OK);
    cr_assert_eq(pd_store_get(s, &id[3], &r, &err), PD_OK);
    pd_prefix_ref_release(r);
    pd_store_close(s); /* writes the access */
    s = open_store(0, 3 * one + one / 2);
    t[0] = 6;
    info = base_info(1, "s", "", PD_KV_F32);
    put_ok(s, &info, t, 100, kv);
    cr_assert_eq(pd_store_info(s, &id[4], &got, &err), PD_ENOTFOUND, "4 was used longer ago than 3");
    cr_assert_eq(pd_store_info(s, &id[3], &got, &err), PD_OK);
    pd_store_close(s);
    pd_kv_prefix_free(kv);
    free(t);
}

/* ---- opening ------------------------------------------------------------------------------- */

Test(store, open_errors_and_format_version) {
    pd_store_opts o;
    pd_store_opts_default(&o);
    pd_store *s = NULL;
    pd_error err = {0};
    char missing[700];
    snprintf(missing, sizeof missing, "%s/nope", tmpdir);
    o.dir = missing;
    o.read_only = true;
    cr_assert_eq(pd_store_open(&o, &s, &err), PD_ENOTFOUND, "%s", err.msg);
    cr_assert_null(s);
    o.read_only = false;
    o.page_tokens = 0;
    cr_assert_eq(pd_store_open(&o, &s, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "cache.page_tokens"), "%s", err.msg);

    /* Nested directories are created with mode 0700. */
    char nested[700];
    snprintf(nested, sizeof nested, "%s/a/b/c", tmpdir);
    s = open_store_at(nested, 0, 0, 16, false);
    struct stat st;
    cr_assert_eq(stat(nested, &st), 0);
    cr_assert_eq(st.st_mode & 0777, 0700);
    pd_store_close(s);

    /* An existing store never shrinks its map (other processes may have
     * it open with the larger size); a larger configured size grows it. */
    pd_store_stats ss;
    s = open_store_at(nested, 4u << 20, 0, 0, false);
    cr_assert_eq(pd_store_stats_get(s, &ss, &err), PD_OK);
    cr_assert_eq(ss.map_size, 1ull << 30);
    pd_store_close(s);
    s = open_store_at(nested, 2ull << 30, 0, 0, false);
    cr_assert_eq(pd_store_stats_get(s, &ss, &err), PD_OK);
    cr_assert_eq(ss.map_size, 2ull << 30);
    pd_store_close(s);

    /* Another format version: rewrite the marker with raw LMDB. */
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi meta;
    cr_assert_eq(mdb_env_create(&env), 0);
    cr_assert_eq(mdb_env_set_maxdbs(env, 8), 0);
    cr_assert_eq(mdb_env_open(env, nested, 0, 0600), 0);
    cr_assert_eq(mdb_txn_begin(env, NULL, 0, &txn), 0);
    cr_assert_eq(mdb_dbi_open(txn, "meta", 0, &meta), 0);
    MDB_val k = {.mv_size = strlen("prefixd-store"), .mv_data = "prefixd-store"}, v;
    cr_assert_eq(mdb_get(txn, meta, &k, &v), 0);
    uint8_t marker[64];
    cr_assert_leq(v.mv_size, sizeof marker);
    memcpy(marker, v.mv_data, v.mv_size);
    uint32_t ver = 2;
    memcpy(marker + 8, &ver, 4);
    v.mv_data = marker;
    cr_assert_eq(mdb_put(txn, meta, &k, &v, 0), 0);
    cr_assert_eq(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
    o.dir = nested;
    o.page_tokens = 64;
    cr_assert_eq(pd_store_open(&o, &s, &err), PD_EFORMAT);
    cr_assert(strstr(err.msg, "format version 2"), "%s", err.msg);
    cr_assert(strstr(err.msg, "version 1"), "%s", err.msg);

    /* A plain LMDB environment that prefixd did not write. */
    char foreign[700];
    snprintf(foreign, sizeof foreign, "%s/foreign", tmpdir);
    cr_assert_eq(mkdir(foreign, 0700), 0);
    cr_assert_eq(mdb_env_create(&env), 0);
    cr_assert_eq(mdb_env_open(env, foreign, 0, 0600), 0);
    mdb_env_close(env);
    o.dir = foreign;
    o.read_only = true;
    cr_assert_eq(pd_store_open(&o, &s, &err), PD_EFORMAT, "%s", err.msg);
    cr_assert(strstr(err.msg, "not a prefix store"), "%s", err.msg);
}

Test(store, put_rejects_bad_input) {
    uint64_t rng = 3;
    pd_store *s = open_store(0, 0);
    pd_token *t = random_tokens(&rng, 50);
    pd_kv_prefix *kv = random_kv(&rng, 1, 1, 4, 50, 10);
    pd_prefix_info info = base_info(1, "s", "", PD_KV_F32);
    pd_error err = {0};
    bool existed;
    cr_assert_eq(pd_store_put(s, &info, t, 49, kv, &existed, &err), PD_EINVAL, "token count must match n_orig");
    info.dtype = (pd_kv_dtype)9;
    cr_assert_eq(pd_store_put(s, &info, t, 50, kv, &existed, &err), PD_EINVAL);
    info = base_info(1, "s", "", PD_KV_F32);
    memset(info.ns, 'x', sizeof info.ns);
    cr_assert_eq(pd_store_put(s, &info, t, 50, kv, &existed, &err), PD_EINVAL, "unterminated namespace");
    pd_store_stats st;
    cr_assert_eq(pd_store_stats_get(s, &st, &err), PD_OK);
    cr_assert_eq(st.prefixes, 0);
    pd_store_close(s);
    pd_kv_prefix_free(kv);
    free(t);
}

Test(store, verify_finds_and_removes_orphans) {
    uint64_t rng = 4;
    pd_store *s = open_store(0, 0);
    pd_token *t = random_tokens(&rng, 40);
    pd_prefix_id keep = put_small(s, 1, "s", "", t, 40, 1);
    pd_store_close(s);
    /* Entries of an id that has no record, as only damage could leave. */
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi streams, lru;
    cr_assert_eq(mdb_env_create(&env), 0);
    cr_assert_eq(mdb_env_set_maxdbs(env, 8), 0);
    cr_assert_eq(mdb_env_open(env, store_dir(), 0, 0600), 0);
    cr_assert_eq(mdb_txn_begin(env, NULL, 0, &txn), 0);
    cr_assert_eq(mdb_dbi_open(txn, "streams", 0, &streams), 0);
    cr_assert_eq(mdb_dbi_open(txn, "lru", 0, &lru), 0);
    uint8_t key[40] = {0};
    memset(key, 0xab, 32);
    MDB_val k = {.mv_size = 40, .mv_data = key}, v = {.mv_size = 3, .mv_data = "xyz"};
    cr_assert_eq(mdb_put(txn, streams, &k, &v, 0), 0);
    memset(key, 0, 8);
    memset(key + 8, 0xab, 32);
    v.mv_size = 0;
    cr_assert_eq(mdb_put(txn, lru, &k, &v, 0), 0);
    cr_assert_eq(mdb_txn_commit(txn), 0);
    mdb_env_close(env);

    s = open_store(0, 0);
    bad_ctx b = {0};
    pd_store_verify_report rep;
    pd_error err = {0};
    cr_assert_eq(pd_store_verify(s, false, bad_fn, &b, &rep, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(rep.checked, 1);
    cr_assert_eq(rep.corrupt, 1, "one orphaned id, named by two databases");
    cr_assert_eq(b.n, 1);
    cr_assert(!b.had_info);
    cr_assert_eq(b.id.b[0], 0xab);
    cr_assert_eq(pd_store_verify(s, true, NULL, NULL, &rep, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_store_verify(s, false, NULL, NULL, &rep, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(rep.corrupt, 0);
    pd_prefix_ref *r = NULL;
    cr_assert_eq(pd_store_get(s, &keep, &r, &err), PD_OK, "%s", err.msg);
    pd_prefix_ref_release(r);
    pd_store_close(s);
    free(t);
}

/* ---- a damaged data file: refused before mapping, salvaged by pread ------------ */

typedef struct salvage_rec {
    pd_prefix_id id;
    pd_kv_dtype dt;
    pd_kv_prefix *kv;
    pd_token *t;
    int32_t n;
} salvage_rec;

#define SALVAGE_N 12

/* SALVAGE_N prefixes of every dtype whose streams span overflow pages, each
 * put in its own transaction (so the last ones sit at the file's end). */
static void salvage_fill(const char *dir, salvage_rec *r) {
    pd_store *s = open_store_at(dir, 0, 0, 16, false);
    uint64_t rng = 4242;
    for (int i = 0; i < SALVAGE_N; i++) {
        r[i].dt = (pd_kv_dtype)(i % 3);
        r[i].n = 150 + i;
        r[i].t = random_tokens(&rng, r[i].n);
        r[i].kv = random_kv(&rng, 2, 2, 64, r[i].n, 100);
        pd_prefix_info info = base_info(1, "compactor:0.5", "ns", r[i].dt);
        r[i].id = put_ok(s, &info, r[i].t, r[i].n, r[i].kv);
    }
    pd_store_close(s);
}

static void salvage_free(salvage_rec *r) {
    for (int i = 0; i < SALVAGE_N; i++) {
        pd_kv_prefix_free(r[i].kv);
        free(r[i].t);
    }
}

static int count_dropped(void *ctx, const pd_prefix_id *id, const pd_prefix_info *info, const char *why) {
    (void)id, (void)info;
    cr_assert(why && *why, "a dropped record comes with a reason");
    ++*(int *)ctx;
    return 0;
}

/* Every record in dir is one of r, stored with its dtype and exact rows. */
static int64_t check_salvaged(const char *dir, const salvage_rec *r) {
    pd_store *s = open_store_at(dir, 0, 0, 0, false);
    pd_store_verify_report vr;
    pd_error err = {0};
    cr_assert_eq(pd_store_verify(s, false, NULL, NULL, &vr, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(vr.corrupt, 0);
    int64_t found = 0;
    for (int i = 0; i < SALVAGE_N; i++) {
        pd_store_close(s);
        /* Read each in the type that shows its stored bits exactly. */
        s = open_store_kv(dir, 0, 0, 0, true, r[i].dt == PD_KV_F16 ? PD_TYPE_F16 : PD_TYPE_F32);
        pd_prefix_ref *ref = NULL;
        int rc = pd_store_get(s, &r[i].id, &ref, &err);
        if (rc == PD_ENOTFOUND) continue;
        cr_assert_eq(rc, PD_OK, "%s", err.msg);
        found++;
        const pd_prefix_info *info = pd_prefix_ref_info(ref);
        cr_assert_eq(info->dtype, r[i].dt);
        cr_assert_str_eq(info->ns, "ns");
        cr_assert_str_eq(info->spec, "compactor:0.5");
        cr_assert_eq(info->n_tokens, r[i].n);
        cr_assert(memcmp(pd_prefix_ref_tokens(ref), r[i].t, (size_t)r[i].n * sizeof *r[i].t) == 0);
        assert_same_kv(r[i].kv, pd_prefix_ref_kv(ref), 2, 2, 64, r[i].dt);
        pd_prefix_ref_release(ref);
    }
    pd_store_stats st;
    cr_assert_eq(pd_store_stats_get(s, &st, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(st.prefixes, found, "the totals count what was salvaged");
    pd_store_close(s);
    return found;
}

static void truncate_data(const char *dir, int64_t cut) {
    char path[700];
    snprintf(path, sizeof path, "%s/data.mdb", dir);
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq(truncate(path, cut < 0 ? st.st_size + cut : cut), 0);
}

Test(store, truncated_data_file_is_refused_then_salvaged) {
    salvage_rec r[SALVAGE_N];
    salvage_fill(store_dir(), r);
    /* The last transactions' pages go: the tree's root survives (the
     * meta pages do) but a truncated map would fault past the end. */
    truncate_data(store_dir(), -100000);
    pd_store_opts o;
    pd_store_opts_default(&o);
    o.dir = store_dir();
    pd_store *s = NULL;
    pd_error err = {0};
    for (int ro = 0; ro < 2; ro++) {
        o.read_only = ro;
        cr_assert_eq(pd_store_open(&o, &s, &err), PD_EFORMAT, "a truncated store is refused, not mapped");
        cr_assert_null(s);
        cr_assert(strstr(err.msg, "truncated") && strstr(err.msg, "salvage"), "the message names the fix: %s",
                  err.msg);
    }

    char out[700];
    snprintf(out, sizeof out, "%s/salvaged", tmpdir);
    pd_store_opts d;
    pd_store_opts_default(&d);
    d.dir = out;
    pd_store_salvage_report rep;
    int dropped = 0;
    cr_assert_eq(pd_store_salvage(store_dir(), &d, count_dropped, &dropped, &rep, &err), PD_OK, "%s", err.msg);
    cr_assert(rep.truncated);
    cr_assert_geq(rep.missing_bytes, 100000);
    cr_assert_eq(rep.dropped, dropped);
    cr_assert_geq(rep.dropped, 1, "the records in the lost bytes are reported");
    cr_assert_geq(rep.copied, 1, "the records before the damage survive");
    cr_assert_eq(rep.copied + rep.dropped, SALVAGE_N, "every record header is accounted for (%lld + %lld)",
                 (long long)rep.copied, (long long)rep.dropped);
    const int64_t copied = rep.copied;
    cr_assert_eq(check_salvaged(out, r), copied);

    /* Into a directory that holds a store: refused, nothing touched. */
    cr_assert_eq(pd_store_salvage(store_dir(), &d, NULL, NULL, &rep, &err), PD_EINVAL);
    cr_assert_eq(check_salvaged(out, r), copied);
    salvage_free(r);
}

Test(store, salvage_of_an_intact_store_copies_everything) {
    salvage_rec r[SALVAGE_N];
    salvage_fill(store_dir(), r);
    char out[700];
    snprintf(out, sizeof out, "%s/copy", tmpdir);
    pd_store_opts d;
    pd_store_opts_default(&d);
    d.dir = out;
    pd_store_salvage_report rep;
    pd_error err = {0};
    cr_assert_eq(pd_store_salvage(store_dir(), &d, count_dropped, &(int){0}, &rep, &err), PD_OK, "%s", err.msg);
    cr_assert(!rep.truncated);
    cr_assert_eq(rep.checked, SALVAGE_N);
    cr_assert_eq(rep.copied, SALVAGE_N);
    cr_assert_eq(rep.dropped, 0);
    cr_assert_eq(check_salvaged(out, r), SALVAGE_N);
    salvage_free(r);
}

Test(store, empty_or_foreign_data_file_is_refused) {
    salvage_rec r[SALVAGE_N];
    salvage_fill(store_dir(), r);
    salvage_free(r);
    truncate_data(store_dir(), 0);
    pd_store_opts o;
    pd_store_opts_default(&o);
    o.dir = store_dir();
    pd_store *s = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_store_open(&o, &s, &err), PD_EFORMAT, "an emptied store does not start empty");
    cr_assert(strstr(err.msg, "salvage"), "%s", err.msg);
    char out[700];
    snprintf(out, sizeof out, "%s/none", tmpdir);
    pd_store_opts d;
    pd_store_opts_default(&d);
    d.dir = out;
    pd_store_salvage_report rep;
    cr_assert_eq(pd_store_salvage(store_dir(), &d, NULL, NULL, &rep, &err), PD_EFORMAT,
                 "nothing to read: the salvage says so");
}

/* ---- hits and calibration curves -------------------------------------------------------- */

static uint64_t hits_of(pd_store *s, const pd_prefix_id *id) {
    pd_prefix_info info;
    pd_error err = {0};
    cr_assert_eq(pd_store_info(s, id, &info, &err), PD_OK, "%s", err.msg);
    return info.hits;
}

Test(store, hits_are_counted_written_when_idle_and_survive_a_reopen) {
    pd_token t[40];
    for (int i = 0; i < 40; i++) t[i] = 7 * i + 1;
    pd_store *s = open_store(0, 0);
    pd_prefix_id id = put_small(s, 1, "s", "", t, 40, 5);
    pd_error err = {0};
    cr_assert_eq(hits_of(s, &id), 0);
    cr_assert_not(pd_store_uses_pending(s), "a put leaves nothing pending");
    for (int i = 0; i < 3; i++) pd_store_note_use(s, &id);
    cr_assert(pd_store_uses_pending(s));
    cr_assert_eq(hits_of(s, &id), 3, "pending hits count before they are written");
    cr_assert_eq(pd_store_flush_uses(s, &err), PD_OK, "%s", err.msg);
    cr_assert_not(pd_store_uses_pending(s));
    cr_assert_eq(hits_of(s, &id), 3, "written once, not twice");

    /* Looking is not a use; loading for a request stamps the LRU order but is no hit. */
    pd_prefix_ref *r = NULL;
    cr_assert_eq(pd_store_peek(s, &id, &r, &err), PD_OK, "%s", err.msg);
    pd_prefix_ref_release(r);
    cr_assert_not(pd_store_uses_pending(s), "peek records nothing");
    cr_assert_eq(pd_store_get(s, &id, &r, &err), PD_OK, "%s", err.msg);
    pd_prefix_ref_release(r);
    cr_assert(pd_store_uses_pending(s));
    cr_assert_eq(hits_of(s, &id), 3);

    /* Pinning rewrites the bookkeeping and keeps the count; close writes the rest. */
    pd_store_note_use(s, &id);
    cr_assert_eq(pd_store_pin(s, &id, true, &err), PD_OK, "%s", err.msg);
    pd_store_note_use(s, &id);
    pd_store_close(s);
    s = open_store(0, 0);
    cr_assert_eq(hits_of(s, &id), 5);
    pd_prefix_info info;
    cr_assert_eq(pd_store_info(s, &id, &info, &err), PD_OK);
    cr_assert(info.pinned);
    pd_store_close(s);
}

static void set_curve(pd_prefix_info *info, double a, double b, int n) {
    info->quality.has_curve = true;
    info->quality.curve_a = a;
    info->quality.curve_b = b;
    info->quality.n_points = n;
    for (int i = 0; i < n; i++) {
        info->quality.point_retention[i] = 0.5 / (1 << i);
        info->quality.point_ratio[i] = 1 + a * (pow(info->quality.point_retention[i], -b) - 1) + 0.01 * i;
    }
}

static void assert_curve(const pd_prefix_info *got, const pd_prefix_info *want) {
    cr_assert(got->quality.has_curve);
    cr_assert_eq(got->quality.curve_a, want->quality.curve_a);
    cr_assert_eq(got->quality.curve_b, want->quality.curve_b);
    cr_assert_eq(got->quality.n_points, want->quality.n_points);
    for (int i = 0; i < want->quality.n_points; i++) {
        cr_assert_eq(got->quality.point_retention[i], want->quality.point_retention[i]);
        cr_assert_eq(got->quality.point_ratio[i], want->quality.point_ratio[i]);
    }
}

static int count_visits(void *ctx, const pd_prefix_id *id, const pd_prefix_info *info, const char *why) {
    (void)id, (void)why;
    int *n = ctx;
    n[info ? 0 : 1]++;
    return 0;
}

Test(store, a_calibration_curve_is_kept_beside_its_record) {
    pd_token t[40];
    for (int i = 0; i < 40; i++) t[i] = 3 * i + 2;
    uint64_t rng = 11;
    pd_kv_prefix *kv = random_kv(&rng, 2, 2, 4, 40, 9);
    pd_store *s = open_store(0, 0);
    pd_error err = {0};

    pd_prefix_info want = base_info(1, "c", "", PD_KV_F32);
    set_curve(&want, 0.3, 1.25, 4);
    pd_prefix_info in = want;
    pd_prefix_id id = put_ok(s, &in, t, 40, kv);
    pd_prefix_info got;
    cr_assert_eq(pd_store_info(s, &id, &got, &err), PD_OK, "%s", err.msg);
    assert_curve(&got, &want);
    /* Without one: none. A zero-shot curve: no points. */
    pd_prefix_info plain = base_info(1, "c", "plain", PD_KV_F32);
    pd_prefix_id pid = put_ok(s, &plain, t, 40, kv);
    cr_assert_eq(pd_store_info(s, &pid, &got, &err), PD_OK);
    cr_assert_not(got.quality.has_curve);
    pd_prefix_info zero = base_info(1, "c", "zero", PD_KV_F32);
    set_curve(&zero, 0.2, 0.8, 0);
    pd_prefix_id zid = put_ok(s, &zero, t, 40, kv);
    pd_store_close(s);

    s = open_store(0, 0);
    cr_assert_eq(pd_store_info(s, &id, &got, &err), PD_OK);
    assert_curve(&got, &want);
    cr_assert_eq(pd_store_info(s, &zid, &got, &err), PD_OK);
    assert_curve(&got, &zero);
    /* A delete takes the curve along: the same id stored again without one has none. */
    cr_assert_eq(pd_store_delete(s, &id, &err), PD_OK, "%s", err.msg);
    pd_prefix_info again = base_info(1, "c", "", PD_KV_F32);
    const pd_prefix_id id2 = put_ok(s, &again, t, 40, kv);
    cr_assert(memcmp(id2.b, id.b, PD_PREFIX_ID_LEN) == 0);
    cr_assert_eq(pd_store_info(s, &id, &got, &err), PD_OK);
    cr_assert_not(got.quality.has_curve, "the deleted record's curve went with it");
    /* An impossible curve is refused, and nothing is stored. */
    pd_prefix_info bad = base_info(1, "c", "bad", PD_KV_F32);
    set_curve(&bad, -1, 1, 2);
    bool existed;
    cr_assert_eq(pd_store_put(s, &bad, t, 40, kv, &existed, &err), PD_EINVAL);
    pd_store_stats st;
    cr_assert_eq(pd_store_stats_get(s, &st, &err), PD_OK);
    cr_assert_eq(st.prefixes, 3);
    pd_store_close(s);

    /* A damaged curve makes its record corrupt: reads refuse it, verify reports it. */
    cr_assert_geq(flip_in_data_file(store_dir(), "PDKVCAL1", 8, 7), 1);
    s = open_store(0, 0);
    cr_assert_eq(pd_store_info(s, &zid, &got, &err), PD_EFORMAT);
    cr_assert(strstr(err.msg, "calibration"), "%s", err.msg);
    int visits[2] = {0, 0};
    cr_assert_eq(pd_store_list(s, count_visits, visits, &err), PD_OK);
    cr_assert_eq(visits[0], 2);
    cr_assert_eq(visits[1], 1, "the damaged one is listed as corrupt");
    pd_store_verify_report rep;
    cr_assert_eq(pd_store_verify(s, true, NULL, NULL, &rep, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(rep.corrupt, 1);
    cr_assert_eq(pd_store_info(s, &zid, &got, &err), PD_ENOTFOUND, "repaired by deleting it");
    cr_assert_eq(pd_store_info(s, &pid, &got, &err), PD_OK);
    pd_store_close(s);
    pd_kv_prefix_free(kv);
}

/* ---- transfer between stores (the shared tier's bytes) -------------------------- */

/* A record exported from one store and imported into another reads back
 * row for row (the lookup finds it there too, calibration curve included);
 * any flipped byte, a cut blob or trailing bytes are refused and nothing is
 * written; a second import finds it stored. The chain of lookup keys ends
 * at the key the record is indexed under. */
Test(store, export_import_round_trip_and_every_damage_refused) {
    uint64_t rng = 4242;
    char a_dir[700], b_dir[700];
    snprintf(a_dir, sizeof a_dir, "%s/a", tmpdir);
    snprintf(b_dir, sizeof b_dir, "%s/b", tmpdir);
    pd_store *a = open_store_at(a_dir, 0, 0, 8, false), *b = open_store_at(b_dir, 0, 0, 0, false);
    const int64_t n = 70;
    pd_token *t = random_tokens(&rng, n);
    pd_kv_prefix *kv = random_kv(&rng, 3, 2, 8, (int32_t)n, 30);
    pd_prefix_info info = base_info(7, "knorm:retention=0.5", "tenant", PD_KV_F16);
    info.quality.has_curve = true;
    info.quality.curve_a = 0.25;
    info.quality.curve_b = 1.5;
    info.quality.n_points = 2;
    info.quality.point_retention[0] = 0.5, info.quality.point_ratio[0] = 1.05;
    info.quality.point_retention[1] = 0.25, info.quality.point_ratio[1] = 1.2;
    const pd_prefix_id id = put_ok(a, &info, t, n, kv);

    uint8_t *blob = NULL;
    size_t len = 0;
    pd_prefix_info ei;
    pd_error err = {0};
    cr_assert_eq(pd_store_export(a, &id, &blob, &len, &ei, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(ei.n_tokens, n);
    cr_assert(memcmp(ei.id.b, id.b, PD_PREFIX_ID_LEN) == 0);

    /* Damage anywhere is refused, and leaves b empty. */
    uint8_t *bad = malloc(len + 1);
    cr_assert_not_null(bad);
    for (size_t at = 0; at < len; at += 1 + at / 7) {
        memcpy(bad, blob, len);
        bad[at] ^= 0x10;
        bool existed = true;
        cr_assert_eq(pd_store_import(b, bad, len, false, NULL, &existed, &err), PD_EFORMAT, "flip at %zu", at);
    }
    cr_assert_eq(pd_store_import(b, blob, len - 1, false, NULL, NULL, &err), PD_EFORMAT, "a cut blob");
    memcpy(bad, blob, len);
    bad[len] = 0;
    cr_assert_eq(pd_store_import(b, bad, len + 1, false, NULL, NULL, &err), PD_EFORMAT, "a trailing byte");
    /* A blob that verifies as a whole but whose header claims another id
     * (re-hashed after the id field was changed) is refused too. */
    memcpy(bad, blob, len);
    bad[16] ^= 1;
    cr_assert_eq(pd_sha256_buf(bad, len - PD_SHA256_LEN, bad + len - PD_SHA256_LEN, &err), PD_OK);
    cr_assert_eq(pd_store_import(b, bad, len, false, NULL, NULL, &err), PD_EFORMAT);
    cr_assert(strstr(err.msg, "transferred record"), "%s", err.msg);
    free(bad);
    pd_store_stats st;
    cr_assert_eq(pd_store_stats_get(b, &st, &err), PD_OK);
    cr_assert_eq(st.prefixes, 0, "nothing damaged was written");

    pd_prefix_info ii;
    bool existed = true;
    cr_assert_eq(pd_store_import(b, blob, len, true, &ii, &existed, &err), PD_OK, "%s", err.msg);
    cr_assert(!existed);
    cr_assert(ii.pinned);
    cr_assert_eq(ii.kept_rows, pd_kv_prefix_kept_rows(kv));
    cr_assert_eq(pd_store_import(b, blob, len, false, NULL, &existed, &err), PD_OK);
    cr_assert(existed, "a second import finds it stored");

    pd_prefix_ref *r = NULL;
    cr_assert_eq(pd_store_get(b, &id, &r, &err), PD_OK, "%s", err.msg);
    assert_same_kv(kv, pd_prefix_ref_kv(r), 3, 2, 8, PD_KV_F16);
    const pd_prefix_info *ri = pd_prefix_ref_info(r);
    cr_assert(ri->pinned);
    cr_assert_eq(ri->created_at, info.created_at, "the record's own bytes, creation time included");
    cr_assert(ri->quality.has_curve && ri->quality.curve_a == 0.25 && ri->quality.n_points == 2);
    cr_assert_eq(ri->quality.point_ratio[1], 1.2);
    cr_assert_str_eq(ri->ns, "tenant");
    pd_prefix_ref_release(r);
    pd_prefix_id found;
    cr_assert_eq(lookup_len(b, 7, "tenant", NULL, t, n + 5, &found), n);
    cr_assert(memcmp(found.b, id.b, PD_PREFIX_ID_LEN) == 0);
    cr_assert_eq(lookup_len(b, 7, "other", NULL, t, n + 5, NULL), 0, "namespaces stay apart");

    uint8_t fp[PD_SHA256_LEN];
    fingerprint_of(7, fp);
    uint8_t(*chain)[PD_SHA256_LEN] = NULL;
    int64_t n_keys = 0;
    cr_assert_eq(pd_store_lookup_chain(fp, "tenant", t, n, &chain, &n_keys, &err), PD_OK);
    cr_assert_eq(n_keys, n / PD_LOOKUP_BLOCK + 1);
    free(chain);

    pd_prefix_id missing = id;
    missing.b[0] ^= 1;
    uint8_t *none = NULL;
    size_t none_len = 0;
    cr_assert_eq(pd_store_export(a, &missing, &none, &none_len, NULL, &err), PD_ENOTFOUND);
    cr_assert_null(none);
    free(blob);
    pd_kv_prefix_free(kv);
    free(t);
    pd_store_close(a);
    pd_store_close(b);
}
