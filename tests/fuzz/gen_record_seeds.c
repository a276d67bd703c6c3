/* Writes the seed corpus of fuzz_store_record into a folder:
 *   build-fuzz/tests/fuzz/gen_record_seeds tests/fuzz/corpus-record
 * (tools/fuzz.sh also runs it into build-fuzz/corpus-record). Records are
 * built and encoded by the harness itself (pd_fuzz_record_build, which
 * calls cache_header_write and cache_stream_write), so the seeds follow the
 * current format; the input format of each mode is described in
 * harness_record.h. Deterministic: the same build writes the same bytes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/harness_record.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15u;

static uint8_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint8_t)(rng_state >> 24);
}

static int write_seed(const char *dir, const char *name, const uint8_t *a, size_t na, const uint8_t *b, size_t nb) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) {
        perror(path);
        return 1;
    }
    if ((na && fwrite(a, 1, na, f) != na) || (nb && fwrite(b, 1, nb, f) != nb)) {
        perror(path);
        fclose(f);
        return 1;
    }
    return fclose(f) != 0;
}

/* The bytes pd_fuzz_record_build reads: shape, spec, namespace, then
 * pseudo-random fingerprint, quality, tokens, masks and rows. */
static size_t record_input(uint8_t *buf, size_t cap, int n_layer, int n_head_kv, int head_dim, pd_kv_dtype dtype,
                           int n_tokens, int page_tokens, const char *spec, const char *ns) {
    size_t n = 0;
    buf[n++] = (uint8_t)(n_layer - 1);
    buf[n++] = (uint8_t)(n_head_kv - 1);
    buf[n++] = (uint8_t)(head_dim - 1);
    buf[n++] = (uint8_t)dtype;
    buf[n++] = (uint8_t)(n_tokens - 1);
    buf[n++] = (uint8_t)(page_tokens - 1);
    buf[n++] = (uint8_t)strlen(spec);
    buf[n++] = (uint8_t)strlen(ns);
    memcpy(buf + n, spec, strlen(spec));
    n += strlen(spec);
    memcpy(buf + n, ns, strlen(ns));
    n += strlen(ns);
    while (n < cap) buf[n++] = rnd();
    return n;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s OUTPUT_DIR\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    int bad = 0;
    static const struct {
        const char *tag;
        int n_layer, n_head_kv, head_dim;
        pd_kv_dtype dtype;
        int n_tokens, page_tokens;
        const char *spec, *ns;
    } recs[] = {
        {"f32", 2, 2, 8, PD_KV_F32, 20, 4, "compactor:retention=0.5", "test"},
        {"f16", 1, 3, 16, PD_KV_F16, 48, 7, "snapkv:pool=5,retention=0.25,window=64", ""},
        {"bf16", 3, 1, 4, PD_KV_BF16, 9, 20, "knorm|spans=a:0-4,b:4-9", "tenant-7"},
    };
    uint8_t *in = malloc(8192);
    if (!in) return 1;
    for (size_t i = 0; i < sizeof recs / sizeof recs[0]; i++) {
        size_t n = record_input(in, 4096, recs[i].n_layer, recs[i].n_head_kv, recs[i].head_dim, recs[i].dtype,
                                recs[i].n_tokens, recs[i].page_tokens, recs[i].spec, recs[i].ns);
        pd_fuzz_rd r = {in, n, 0};
        pd_fuzz_record rec;
        pd_fuzz_record_build(&r, &rec);
        char name[64];
        uint8_t mode[2];
        /* Mode 4 replays the same record and flips one byte. */
        mode[0] = PD_FUZZ_REC_ENCODE;
        snprintf(name, sizeof name, "encode-%s", recs[i].tag);
        bad |= write_seed(dir, name, mode, 1, in, n);
        /* Mode 0: the header value as stored. */
        mode[0] = PD_FUZZ_REC_RAW_HEADER;
        snprintf(name, sizeof name, "raw-header-%s", recs[i].tag);
        bad |= write_seed(dir, name, mode, 1, rec.hv, rec.hsize);
        /* Mode 2: the same, every field repaired (a no-op) / only resealed. */
        mode[0] = PD_FUZZ_REC_SEAL_HEADER;
        mode[1] = i == 0 ? 0xff : PD_FUZZ_SEAL_SUM;
        snprintf(name, sizeof name, "seal-header-%s", recs[i].tag);
        bad |= write_seed(dir, name, mode, 2, rec.hv, rec.hsize);
        /* Mode 1: the shape the stream decoder needs, then the last stream. */
        int s = rec.n_streams - 1;
        pd_fuzz_shape sh = {
            .n_layer = rec.h.n_layer, .n_head_kv = rec.h.n_head_kv, .layer = s / rec.h.n_head_kv,
            .head = s % rec.h.n_head_kv, .head_dim = rec.h.head_dim, .n_tokens = rec.h.n_tokens,
            .page_tokens = rec.h.page_tokens, .dtype = rec.h.dtype,
            .kept = (uint32_t)pd_kv_prefix_stream(rec.kv, s / rec.h.n_head_kv, s % rec.h.n_head_kv, NULL, NULL, NULL),
        };
        uint8_t shape[1 + PD_FUZZ_SHAPE_LEN + 2];
        shape[0] = PD_FUZZ_REC_RAW_STREAM;
        pd_fuzz_write_shape(shape + 1, &sh);
        snprintf(name, sizeof name, "raw-stream-%s", recs[i].tag);
        bad |= write_seed(dir, name, shape, 1 + PD_FUZZ_SHAPE_LEN, rec.sv[s], rec.ssize[s]);
        /* Mode 3: the same shape, repaired fields and checksums, the
         * stream's rows as the payload. */
        shape[0] = PD_FUZZ_REC_SEAL_STREAM;
        shape[1 + PD_FUZZ_SHAPE_LEN] = PD_FUZZ_SEAL_FIELDS | PD_FUZZ_SEAL_PAGES | PD_FUZZ_SEAL_HSUM;
        shape[2 + PD_FUZZ_SHAPE_LEN] = 0;
        size_t rows = rec.ssize[s] > 256 ? 256 : rec.ssize[s];
        snprintf(name, sizeof name, "seal-stream-%s", recs[i].tag);
        bad |= write_seed(dir, name, shape, sizeof shape, rec.sv[s] + rec.ssize[s] - rows, rows);
        pd_fuzz_record_free(&rec);
    }
    /* Mode 4 from plain noise, short and long. */
    static const size_t noise[] = {0, 24, 200, 3000};
    for (size_t i = 0; i < sizeof noise / sizeof noise[0]; i++) {
        uint8_t mode = PD_FUZZ_REC_ENCODE;
        for (size_t j = 0; j < noise[i]; j++) in[j] = rnd();
        char name[64];
        snprintf(name, sizeof name, "encode-noise-%zu", noise[i]);
        bad |= write_seed(dir, name, &mode, 1, in, noise[i]);
    }
    free(in);
    return bad;
}
