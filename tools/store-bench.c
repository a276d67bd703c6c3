/* store-bench: throughput of the compressed prefix store.
 *
 *   store-bench [--dir DIR] [--prefixes N] [--shape L/H/D/KEPT] [--tokens T]
 *               [--dtype f32|f16|bf16] [--lookups N] [--map-size-mb N] [--keep]
 *
 * Writes N prefixes (T tokens each; per (layer, kv head) KEPT rows of D
 * floats), one write transaction each, then reports:
 *   write   MB/s of stored bytes and prefixes/s through pd_store_put;
 *   read    MB/s through pd_store_get (every page checksum verified; read
 *           as an f16 KV cache does: f16 rows borrowed, f32/bf16 converted)
 *           in random order;
 *   hot     pd_hot_acquire + release latency on a hit, and on a miss;
 *   lookup  mean, median and p99 of pd_store_lookup for a request of T + 64 tokens
 *           that starts with a stored prefix, with all N prefixes stored,
 *           and for a request that matches nothing;
 *   size    stored bytes, map pages used and the data file's size.
 * Without --dir it works in a fresh temporary directory, removed at the end
 * unless --keep. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache/cache.h"

typedef struct bench_opts {
    const char *dir;
    int64_t prefixes, lookups;
    int32_t n_layer, n_head_kv, head_dim, kept, tokens;
    pd_kv_dtype dtype;
    uint64_t map_mb;
    int keep;
} bench_opts;

static void usage(FILE *f) {
    fputs("usage: store-bench [options]\n"
          "  --dir DIR             store directory (default: a fresh temporary one)\n"
          "  --prefixes N          prefixes to write (default 10000)\n"
          "  --shape L/H/D/KEPT    layers / kv heads / head dim / kept rows per stream (default 2/2/64/32)\n"
          "  --tokens T            original prefix length (default 128; KEPT <= T)\n"
          "  --dtype TYPE          f32, f16 (default) or bf16\n"
          "  --lookups N           lookups to time (default 2000)\n"
          "  --map-size-mb N       LMDB map size (default: twice the estimated data + 256)\n"
          "  --keep                keep the temporary directory\n",
          f);
}

static int parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || !*s || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

static int parse_args(int argc, char **argv, bench_opts *o) {
    o->dir = NULL;
    o->prefixes = 10000;
    o->lookups = 2000;
    o->n_layer = 2;
    o->n_head_kv = 2;
    o->head_dim = 64;
    o->kept = 32;
    o->tokens = 128;
    o->dtype = PD_KV_F16;
    o->map_mb = 0;
    o->keep = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int64_t x;
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage(stdout);
            exit(0);
        } else if (strcmp(a, "--keep") == 0) {
            o->keep = 1;
            continue;
        }
        if (!v) {
            fprintf(stderr, "store-bench: %s needs a value\n", a);
            return -1;
        }
        i++;
        if (strcmp(a, "--dir") == 0) {
            o->dir = v;
        } else if (strcmp(a, "--prefixes") == 0 && parse_i64(v, 1, 100000000, &x) == 0) {
            o->prefixes = x;
        } else if (strcmp(a, "--lookups") == 0 && parse_i64(v, 1, 100000000, &x) == 0) {
            o->lookups = x;
        } else if (strcmp(a, "--tokens") == 0 && parse_i64(v, 1, 1 << 24, &x) == 0) {
            o->tokens = (int32_t)x;
        } else if (strcmp(a, "--map-size-mb") == 0 && parse_i64(v, 1, INT64_C(1) << 40, &x) == 0) {
            o->map_mb = (uint64_t)x;
        } else if (strcmp(a, "--dtype") == 0) {
            if (!pd_kv_dtype_from_name(v, &o->dtype)) {
                fprintf(stderr, "store-bench: unknown dtype \"%s\" (f32, f16 or bf16)\n", v);
                return -1;
            }
        } else if (strcmp(a, "--shape") == 0) {
            int l, h, d, k, used = 0;
            if (sscanf(v, "%d/%d/%d/%d%n", &l, &h, &d, &k, &used) != 4 || v[used] || l < 1 || h < 1 || d < 1 ||
                k < 0 || l > 1024 || h > 1024 || d > 4096) {
                fprintf(stderr, "store-bench: --shape wants LAYERS/HEADS/HEAD_DIM/KEPT, e.g. 2/2/64/32, not \"%s\"\n", v);
                return -1;
            }
            o->n_layer = l;
            o->n_head_kv = h;
            o->head_dim = d;
            o->kept = k;
        } else {
            fprintf(stderr, "store-bench: bad option or value: %s %s\n", a, v);
            return -1;
        }
    }
    if (o->kept > o->tokens) {
        fprintf(stderr, "store-bench: KEPT (%d) exceeds --tokens (%d)\n", o->kept, o->tokens);
        return -1;
    }
    return 0;
}

/* dir/name into buf; false when it does not fit. */
static bool join_path(char *buf, size_t cap, const char *dir, const char *name) {
    int w = snprintf(buf, cap, "%s/%s", dir, name);
    return w >= 0 && (size_t)w < cap;
}

static void remove_store_dir(const char *dir) {
    char p[4096];
    if (join_path(p, sizeof p, dir, "data.mdb")) unlink(p);
    if (join_path(p, sizeof p, dir, "lock.mdb")) unlink(p);
    if (rmdir(dir) != 0) fprintf(stderr, "store-bench: could not remove %s: %s\n", dir, strerror(errno));
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Prefix i's token ids: its own seeded sequence. */
static void prefix_tokens(int64_t i, pd_token *t, int32_t n) {
    uint64_t rng = (uint64_t)i * 0x2545f4914f6cdd1dULL + 12345;
    for (int32_t j = 0; j < n; j++) t[j] = (pd_token)(pd_splitmix64(&rng) % 32000);
}

static double mb(uint64_t bytes) { return (double)bytes / 1e6; }

static int run(const bench_opts *o, const char *dir) {
    pd_error err = {0};
    int rc = 1;
    pd_store *s = NULL;
    pd_kv_prefix *kv = NULL;
    pd_hot *hot = NULL;
    pd_prefix_id *ids = NULL;
    pd_token *tok = NULL;
    double *lat = NULL;
    int64_t n = o->prefixes;

    /* One set of rows shared by every prefix; the token ids differ. */
    pd_hparams hp;
    memset(&hp, 0, sizeof hp);
    hp.n_layer = o->n_layer;
    hp.n_head_kv = o->n_head_kv;
    hp.head_dim = o->head_dim;
    size_t rowf = (size_t)o->kept * (size_t)o->head_dim;
    float *k = malloc((rowf ? rowf : 1) * sizeof *k);
    float *v = malloc((rowf ? rowf : 1) * sizeof *v);
    int32_t *pos = malloc(((size_t)o->kept + 1) * sizeof *pos);
    int32_t req_len = o->tokens + 64;
    ids = malloc((size_t)n * sizeof *ids);
    tok = malloc((size_t)req_len * sizeof *tok);
    lat = malloc((size_t)o->lookups * sizeof *lat);
    if (!k || !v || !pos || !ids || !tok || !lat) {
        fputs("store-bench: out of memory\n", stderr);
        goto out;
    }
    if (pd_kv_prefix_create(&hp, o->tokens, PD_TYPE_F32, &kv, &err) != PD_OK) goto fail;
    uint64_t rng = 42;
    for (int32_t i = 0; i < o->kept; i++) pos[i] = (int32_t)((int64_t)i * o->tokens / (o->kept ? o->kept : 1));
    for (int l = 0; l < o->n_layer; l++)
        for (int h = 0; h < o->n_head_kv; h++) {
            for (size_t j = 0; j < rowf; j++) {
                k[j] = (float)((double)(pd_splitmix64(&rng) % 20001) / 10000.0 - 1.0);
                v[j] = (float)((double)(pd_splitmix64(&rng) % 20001) / 10000.0 - 1.0);
            }
            if (pd_kv_prefix_set(kv, l, h, pos, k, v, o->kept, &err) != PD_OK) goto fail;
        }

    uint64_t elt = o->dtype == PD_KV_F32 ? 4 : 2;
    uint64_t per = (uint64_t)o->n_layer * (uint64_t)o->n_head_kv * (uint64_t)o->kept *
                   (2 * (uint64_t)o->head_dim * elt + 4) + 4 * (uint64_t)o->tokens + 4096;
    uint64_t map_mb = o->map_mb ? o->map_mb : (2 * per * (uint64_t)n >> 20) + 256;
    pd_store_opts so;
    pd_store_opts_default(&so);
    so.dir = dir;
    so.map_size = map_mb << 20;
    if (pd_store_open(&so, &s, &err) != PD_OK) goto fail;

    uint8_t fp[PD_SHA256_LEN];
    memset(fp, 0x42, sizeof fp);
    char ns[64];
    snprintf(ns, sizeof ns, "bench-%ld", (long)getpid());
    const char *spec = "bench:retention=0.25";
    printf("store-bench: %" PRId64 " prefixes of %d tokens, %d layers x %d kv heads x %d kept rows of %d (%s), in %s\n",
           n, o->tokens, o->n_layer, o->n_head_kv, o->kept, o->head_dim, pd_kv_dtype_name(o->dtype), dir);

    /* ---- write ---- */
    uint64_t stored = 0;
    double t0 = pd_now_seconds();
    for (int64_t i = 0; i < n; i++) {
        prefix_tokens(i, tok, o->tokens);
        pd_prefix_info info;
        memset(&info, 0, sizeof info);
        memcpy(info.fingerprint, fp, sizeof fp);
        snprintf(info.spec, sizeof info.spec, "%s", spec);
        snprintf(info.ns, sizeof info.ns, "%s", ns);
        info.dtype = o->dtype;
        info.quality.retention = 0.25;
        bool existed = false;
        if (pd_store_put(s, &info, tok, o->tokens, kv, &existed, &err) != PD_OK) goto fail;
        ids[i] = info.id;
        stored += info.bytes;
    }
    double tw = pd_now_seconds() - t0;
    printf("write:   %8.1f MB/s  %9.0f prefixes/s  (%.1f MB in %.2f s, one transaction each)\n", mb(stored) / tw,
           (double)n / tw, mb(stored), tw);

    /* ---- read (random order, checksums verified) ---- */
    int64_t *order = malloc((size_t)n * sizeof *order);
    if (!order) {
        fputs("store-bench: out of memory\n", stderr);
        goto out;
    }
    for (int64_t i = 0; i < n; i++) order[i] = i;
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)(pd_splitmix64(&rng) % (uint64_t)(i + 1));
        int64_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    uint64_t read_bytes = 0;
    double sink = 0;
    t0 = pd_now_seconds();
    for (int64_t i = 0; i < n; i++) {
        pd_prefix_ref *r = NULL;
        if (pd_store_get(s, &ids[order[i]], &r, &err) != PD_OK) {
            free(order);
            goto fail;
        }
        read_bytes += pd_prefix_ref_info(r)->bytes;
        float k0;
        if (o->kept > 0 && pd_kv_prefix_stream(pd_prefix_ref_kv(r), 0, 0, NULL, NULL, NULL) > 0) {
            const void *kr;
            pd_kv_prefix_stream(pd_prefix_ref_kv(r), 0, 0, NULL, &kr, NULL);
            memcpy(&k0, kr, sizeof k0); /* touch the rows (2 or 4 bytes, either is fine) */
            sink += k0;
        }
        pd_prefix_ref_release(r);
    }
    double tr = pd_now_seconds() - t0;
    free(order);
    printf("read:    %8.1f MB/s  %9.0f prefixes/s  (pd_store_get, all checksums verified%s)\n", mb(read_bytes) / tr,
           (double)n / tr, o->dtype == PD_KV_F16 ? ", zero-copy rows" : ", converted to f16");

    /* ---- hot tier ---- */
    const uint64_t hot_bytes = 256ull << 20;
    if (pd_hot_create(s, hot_bytes, &hot, &err) != PD_OK) goto fail;
    /* Hits must stay hits: load no more than the tier holds. */
    pd_hot_entry *first = NULL;
    if (pd_hot_acquire(hot, &ids[0], &first, &err) != PD_OK) goto fail;
    pd_hot_stats fs;
    pd_hot_stats_get(hot, &fs);
    pd_hot_release(hot, first);
    int64_t fit = fs.bytes ? (int64_t)(hot_bytes / fs.bytes) : 200;
    int64_t n_miss = n < 200 ? n : 200;
    if (n_miss > fit) n_miss = fit > 1 ? fit : 1;
    t0 = pd_now_seconds();
    for (int64_t i = 0; i < n_miss; i++) { /* ids[0] is already in: one hit among the misses */
        pd_hot_entry *e = NULL;
        if (pd_hot_acquire(hot, &ids[i], &e, &err) != PD_OK) goto fail;
        pd_hot_release(hot, e);
    }
    double tmiss = (pd_now_seconds() - t0) / (double)n_miss;
    int64_t n_hit = 200000;
    t0 = pd_now_seconds();
    for (int64_t i = 0; i < n_hit; i++) {
        pd_hot_entry *e = NULL;
        if (pd_hot_acquire(hot, &ids[i % n_miss], &e, &err) != PD_OK) goto fail;
        sink += pd_hot_entry_info(e)->n_tokens;
        pd_hot_release(hot, e);
    }
    double thit = (pd_now_seconds() - t0) / (double)n_hit;
    pd_hot_stats hs;
    pd_hot_stats_get(hot, &hs);
    printf("hot:     hit %.3f us, miss (load%s) %.1f us  (%" PRId64 " entries, %" PRId64 " borrowing, %.1f MB cached, %" PRId64
           " evictions)\n", thit * 1e6, o->dtype == PD_KV_F16 ? ", rows borrowed" : " + conversion to f16", tmiss * 1e6,
           hs.entries, hs.borrowing, mb(hs.bytes), hs.evictions);

    /* ---- lookup ---- */
    double sum = 0;
    int64_t found_all = 0;
    for (int64_t i = 0; i < o->lookups; i++) {
        int64_t which = (int64_t)(pd_splitmix64(&rng) % (uint64_t)n);
        prefix_tokens(which, tok, o->tokens);
        for (int32_t j = o->tokens; j < req_len; j++) tok[j] = (pd_token)(pd_splitmix64(&rng) % 32000);
        pd_prefix_id got;
        int32_t matched = 0;
        double a = pd_now_seconds();
        int lrc = pd_store_lookup(s, fp, ns, NULL, tok, req_len, &got, &matched, &err);
        lat[i] = pd_now_seconds() - a;
        if (lrc != PD_OK) goto fail;
        if (matched == o->tokens && memcmp(got.b, ids[which].b, PD_PREFIX_ID_LEN) == 0) found_all++;
        sum += lat[i];
    }
    qsort(lat, (size_t)o->lookups, sizeof *lat, cmp_double);
    double p50 = lat[(size_t)((double)(o->lookups - 1) * 0.50)];
    double p99 = lat[(size_t)((double)(o->lookups - 1) * 0.99)];
    printf("lookup:  mean %.1f us, p50 %.1f us, p99 %.1f us  (hit; request of %d tokens, %" PRId64 " stored; %" PRId64
           "/%" PRId64 " found the right prefix)\n",
           sum / (double)o->lookups * 1e6, p50 * 1e6, p99 * 1e6, req_len, n, found_all, o->lookups);
    sum = 0;
    for (int64_t i = 0; i < o->lookups; i++) {
        for (int32_t j = 0; j < req_len; j++) tok[j] = (pd_token)(pd_splitmix64(&rng) % 32000);
        pd_prefix_id got;
        int32_t matched = 0;
        double a = pd_now_seconds();
        int lrc = pd_store_lookup(s, fp, ns, NULL, tok, req_len, &got, &matched, &err);
        lat[i] = pd_now_seconds() - a;
        if (lrc != PD_OK && lrc != PD_ENOTFOUND) goto fail;
        sum += lat[i];
    }
    qsort(lat, (size_t)o->lookups, sizeof *lat, cmp_double);
    p50 = lat[(size_t)((double)(o->lookups - 1) * 0.50)];
    p99 = lat[(size_t)((double)(o->lookups - 1) * 0.99)];
    printf("lookup:  mean %.1f us, p50 %.1f us, p99 %.1f us  (miss; request of %d tokens)\n",
           sum / (double)o->lookups * 1e6, p50 * 1e6, p99 * 1e6, req_len);

    /* ---- size ---- */
    pd_store_stats st;
    if (pd_store_stats_get(s, &st, &err) != PD_OK) goto fail;
    char path[4096];
    struct stat sb;
    uint64_t file = join_path(path, sizeof path, dir, "data.mdb") && stat(path, &sb) == 0 ? (uint64_t)sb.st_size : 0;
    printf("size:    %" PRId64 " prefixes, %.1f MB stored (%.1f KB each), %.1f MB of map pages used, data file %.1f MB\n",
           st.prefixes, mb(st.bytes), (double)st.bytes / (double)(st.prefixes ? st.prefixes : 1) / 1e3,
           mb(st.map_used), mb(file));
    if (sink == 12345.678) printf(" \n"); /* keep the reads from being optimised away */
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "store-bench: %s\n", err.msg);
out:
    if (hot) pd_hot_free(hot);
    if (s) pd_store_close(s);
    pd_kv_prefix_free(kv);
    free(k);
    free(v);
    free(pos);
    free(ids);
    free(tok);
    free(lat);
    return rc;
}

int main(int argc, char **argv) {
    bench_opts o;
    if (parse_args(argc, argv, &o) != 0) {
        usage(stderr);
        return 2;
    }
    char tmpl[4096];
    const char *dir = o.dir;
    if (!dir) {
        const char *base = getenv("TMPDIR");
        snprintf(tmpl, sizeof tmpl, "%s/store-bench-XXXXXX", base && *base ? base : "/tmp");
        if (!mkdtemp(tmpl)) {
            fprintf(stderr, "store-bench: cannot create a temporary directory %s: %s\n", tmpl, strerror(errno));
            return 1;
        }
        dir = tmpl;
    }
    int rc = run(&o, dir);
    if (!o.dir) {
        if (o.keep) printf("kept %s\n", dir);
        else remove_store_dir(dir);
    }
    return rc;
}
