/* The crash test's child: writes prefixes of random shapes and dtypes into
 * a store in a loop (and deletes some), until it is killed.
 *
 *   store_writer DIR SEED [MAX_RECORDS [MAP_MB]]
 *
 * Protocol on stdout, one line per event, flushed at once so a line the
 * parent reads was printed before the kill:
 *   BEGIN <id hex> <xxh3 hex>   about to put a prefix whose data hashes so
 *   OK <id hex>                 pd_store_put returned success
 *   DELBEGIN <id hex>           about to delete a prefix it wrote earlier
 *   DELOK <id hex>              pd_store_delete returned success
 *   FULL                        the map is full (exit status 3)
 *   DONE                        MAX_RECORDS written; it now waits for the kill
 * The hash covers the shape, the token ids and every stream's positions,
 * K and V rows; values are multiples of 1/64 below 2 in magnitude, exact in
 * f32, f16 and bf16, so the rows read back equal the rows written whatever
 * the dtype and the parent can hash what it reads back. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "cache/cache.h"

static int64_t rand_range(uint64_t *s, int64_t lo, int64_t hi) { /* [lo, hi] */
    return lo + (int64_t)(pd_splitmix64(s) % (uint64_t)(hi - lo + 1));
}

static void hash_i32(XXH3_state_t *st, int32_t v) { XXH3_64bits_update(st, &v, sizeof v); }

typedef struct record {
    int32_t n_layer, n_head_kv, head_dim, n;
    pd_token *tokens;
    pd_kv_prefix *kv;
} record;

static void record_free(record *r) {
    pd_kv_prefix_free(r->kv);
    free(r->tokens);
    memset(r, 0, sizeof *r);
}

/* One random record; returns its data hash, or exits on allocation failure. */
static uint64_t make_record(uint64_t *rng, record *r) {
    static const int32_t dims[] = {8, 16, 32, 64};
    memset(r, 0, sizeof *r);
    r->n_layer = (int32_t)rand_range(rng, 1, 4);
    r->n_head_kv = (int32_t)rand_range(rng, 1, 4);
    r->head_dim = dims[rand_range(rng, 0, 3)];
    r->n = (int32_t)rand_range(rng, 1, 300);
    pd_error err = {0};
    r->tokens = malloc((size_t)r->n * sizeof *r->tokens);
    float *k = malloc((size_t)r->n * (size_t)r->head_dim * sizeof *k);
    float *v = malloc((size_t)r->n * (size_t)r->head_dim * sizeof *v);
    int32_t *pos = malloc((size_t)r->n * sizeof *pos);
    pd_hparams hp;
    memset(&hp, 0, sizeof hp);
    hp.n_layer = r->n_layer;
    hp.n_head_kv = r->n_head_kv;
    hp.head_dim = r->head_dim;
    if (!r->tokens || !k || !v || !pos || pd_kv_prefix_create(&hp, r->n, PD_TYPE_F32, &r->kv, &err) != PD_OK) {
        fprintf(stderr, "store_writer: out of memory: %s\n", err.msg);
        exit(1);
    }
    XXH3_state_t *st = XXH3_createState();
    if (!st) {
        fputs("store_writer: out of memory for a hash state\n", stderr);
        exit(1);
    }
    XXH3_64bits_reset(st);
    hash_i32(st, r->n_layer);
    hash_i32(st, r->n_head_kv);
    hash_i32(st, r->head_dim);
    hash_i32(st, r->n);
    for (int32_t i = 0; i < r->n; i++) r->tokens[i] = (pd_token)rand_range(rng, 0, 31999);
    XXH3_64bits_update(st, r->tokens, (size_t)r->n * sizeof *r->tokens);
    int64_t keep_pct = rand_range(rng, 0, 100);
    for (int32_t l = 0; l < r->n_layer; l++)
        for (int32_t h = 0; h < r->n_head_kv; h++) {
            int64_t len = 0;
            for (int32_t p = 0; p < r->n; p++)
                if (rand_range(rng, 1, 100) <= keep_pct) pos[len++] = p;
            for (int64_t j = 0; j < len * r->head_dim; j++) {
                k[j] = (float)rand_range(rng, -127, 127) / 64.0f;
                v[j] = (float)rand_range(rng, -127, 127) / 64.0f;
            }
            if (pd_kv_prefix_set(r->kv, l, h, pos, k, v, len, &err) != PD_OK) {
                fprintf(stderr, "store_writer: %s\n", err.msg);
                exit(1);
            }
            hash_i32(st, (int32_t)len);
            XXH3_64bits_update(st, pos, (size_t)len * sizeof *pos);
            XXH3_64bits_update(st, k, (size_t)len * (size_t)r->head_dim * sizeof *k);
            XXH3_64bits_update(st, v, (size_t)len * (size_t)r->head_dim * sizeof *v);
        }
    uint64_t hash = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    free(k);
    free(v);
    free(pos);
    return hash;
}

int main(int argc, char **argv) {
    if (argc < 3 || argc > 5) {
        fputs("usage: store_writer DIR SEED [MAX_RECORDS [MAP_MB]]\n", stderr);
        return 2;
    }
    uint64_t rng = strtoull(argv[2], NULL, 10);
    long long max_records = argc > 3 ? strtoll(argv[3], NULL, 10) : -1;
    uint64_t map_mb = argc > 4 ? strtoull(argv[4], NULL, 10) : 1024;

    pd_error err = {0};
    pd_store_opts o;
    pd_store_opts_default(&o);
    o.dir = argv[1];
    o.map_size = map_mb << 20;
    pd_store *s = NULL;
    if (pd_store_open(&o, &s, &err) != PD_OK) {
        fprintf(stderr, "store_writer: %s\n", err.msg);
        return 1;
    }
    uint8_t fp[PD_SHA256_LEN];
    memset(fp, 0x5a, sizeof fp);
    static const char *const namespaces[] = {NULL, "tenant-a", "tenant-b"};
    static const pd_kv_dtype dtypes[] = {PD_KV_F32, PD_KV_F16, PD_KV_BF16};

    /* Ids this run committed and has not deleted, for deletes. */
    pd_prefix_id *mine = NULL;
    size_t n_mine = 0, cap_mine = 0;
    for (long long i = 0; max_records < 0 || i < max_records; i++) {
        record r;
        uint64_t hash = make_record(&rng, &r);
        pd_prefix_info info;
        memset(&info, 0, sizeof info);
        memcpy(info.fingerprint, fp, sizeof fp);
        snprintf(info.spec, sizeof info.spec, "crash:retention=0.%02d", (int)rand_range(&rng, 1, 99));
        const char *ns = namespaces[rand_range(&rng, 0, 2)];
        if (ns) snprintf(info.ns, sizeof info.ns, "%s", ns);
        info.dtype = dtypes[rand_range(&rng, 0, 2)];
        info.pinned = rand_range(&rng, 0, 9) == 0;
        info.quality.retention = 0.5;
        info.quality.tau = info.quality.nll_full = info.quality.nll_ratio = NAN; /* unknown */

        pd_prefix_id id;
        char hex[PD_PREFIX_ID_HEX];
        if (pd_prefix_id_compute(fp, r.tokens, r.n, info.spec, ns, &id) != PD_OK) {
            fputs("store_writer: cannot compute a prefix id (out of memory)\n", stderr);
            return 1;
        }
        pd_prefix_id_hex(&id, hex);
        printf("BEGIN %s %016" PRIx64 "\n", hex, hash);
        fflush(stdout);
        bool existed = false;
        int rc = pd_store_put(s, &info, r.tokens, r.n, r.kv, &existed, &err);
        record_free(&r);
        if (rc == PD_ERANGE) {
            printf("FULL\n");
            fflush(stdout);
            fprintf(stderr, "store_writer: %s\n", err.msg);
            pd_store_close(s);
            free(mine);
            return 3;
        }
        if (rc != PD_OK) {
            fprintf(stderr, "store_writer: put %s: %s\n", hex, err.msg);
            return 1;
        }
        if (memcmp(info.id.b, id.b, sizeof id.b) != 0) {
            fprintf(stderr, "store_writer: pd_store_put returned an id other than pd_prefix_id_compute's\n");
            return 1;
        }
        printf("OK %s\n", hex);
        fflush(stdout);
        if (!existed) {
            if (n_mine == cap_mine) {
                size_t nc = cap_mine ? 2 * cap_mine : 64;
                pd_prefix_id *nm = realloc(mine, nc * sizeof *nm);
                if (!nm) {
                    fputs("store_writer: out of memory\n", stderr);
                    return 1;
                }
                mine = nm;
                cap_mine = nc;
            }
            mine[n_mine++] = id;
        }

        if (n_mine > 0 && rand_range(&rng, 0, 4) == 0) {
            size_t j = (size_t)rand_range(&rng, 0, (int64_t)n_mine - 1);
            pd_prefix_id_hex(&mine[j], hex);
            printf("DELBEGIN %s\n", hex);
            fflush(stdout);
            if (pd_store_delete(s, &mine[j], &err) != PD_OK) {
                fprintf(stderr, "store_writer: delete %s: %s\n", hex, err.msg);
                return 1;
            }
            printf("DELOK %s\n", hex);
            fflush(stdout);
            mine[j] = mine[--n_mine];
        }
    }
    /* Wait to be killed, so a parent that bounds the work per run still
     * sees every run end in SIGKILL. */
    printf("DONE\n");
    fflush(stdout);
    for (;;) pause();
}
