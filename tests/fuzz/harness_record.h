/* Fuzz harness for the prefix store's record codec (cache/record.c), shared
 * by the libFuzzer target (fuzz_store_record.c), the seed generator
 * (gen_record_seeds.c) and the test suite's replay of
 * tests/fuzz/regressions-record and tests/fuzz/corpus-record
 * (test_fuzz_replay.c).
 *
 * Stored values are untrusted: cache_header_decode and cache_stream_decode
 * must refuse anything wrong with PD_EFORMAT and a message, never read
 * outside the value, and whatever they accept must be consistent. Byte 0
 * of the input picks a mode (mod 5); the rest is the payload:
 *
 *   0 raw header   the payload is a header value: decode it (no id, and as
 *                  the id its first 32 bytes).
 *   1 raw stream   the first PD_FUZZ_SHAPE_LEN bytes give what the stream
 *                  decoder reads from the record's header (layers, kv heads,
 *                  which stream, head_dim, dtype, n, page_tokens, kept
 *                  rows; see pd_fuzz_read_shape), the rest is the value.
 *   2 sealed header  byte 1 = flags: which fields to repair before
 *                  decoding (magic, version, shape, lengths and value size,
 *                  NULs, kept counts, length field, checksum); the rest is
 *                  the value. This gets past the checksum to the range
 *                  checks behind it. All flags set: it must decode.
 *   3 sealed stream  a shape (small head_dim and kept count), byte flags,
 *                  byte size delta, then the payload, repeated to fill the
 *                  value; flags repair the header fields, the page checksums
 *                  and the header checksum (computed here from the layout in
 *                  docs/store.md, not with record.c's code). All three
 *                  repaired and no size delta: it must decode.
 *   4 encode       the payload describes a small prefix (shape, spec,
 *                  namespace, fingerprint, quality, tokens, kept positions
 *                  and rows); it is encoded with cache_header_write and
 *                  cache_stream_write, decoded back (must give the same
 *                  values, also checked against the documented layout), then
 *                  one byte chosen by the input is flipped: the decoders must
 *                  refuse it or decode the same values (a flip in the zero
 *                  gaps between arrays is not covered by any checksum).
 *
 * Every accepted header is checked (ranges, pointers inside the value,
 * cache_header_to_info, the id it hashes to is accepted and a different id
 * refused); every accepted stream likewise (length, 64-byte offsets, arrays
 * inside the value, every byte readable). A violated invariant prints what
 * happened and calls abort(). */
#ifndef PD_FUZZ_HARNESS_RECORD_H
#define PD_FUZZ_HARNESS_RECORD_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "cache/cache_internal.h"
#include "kernels/kernels.h"

#ifndef PD_FUZZ_CHECK
#define PD_FUZZ_CHECK(cond, ...)                                                                    \
    do {                                                                                            \
        if (!(cond)) {                                                                              \
            fprintf(stderr, "fuzz invariant violated at %s:%d: %s\n  ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                                           \
            fputc('\n', stderr);                                                                    \
            abort();                                                                                \
        }                                                                                           \
    } while (0)
#endif

enum {
    PD_FUZZ_REC_RAW_HEADER = 0,
    PD_FUZZ_REC_RAW_STREAM = 1,
    PD_FUZZ_REC_SEAL_HEADER = 2,
    PD_FUZZ_REC_SEAL_STREAM = 3,
    PD_FUZZ_REC_ENCODE = 4,
    PD_FUZZ_REC_MODES = 5,
};

/* Sealed-header flags. */
enum {
    PD_FUZZ_SEAL_MAGIC = 1,
    PD_FUZZ_SEAL_VERSION = 2,
    PD_FUZZ_SEAL_SHAPE = 4,     /* n_layer 1..4, n_head_kv 1..4, head_dim 1..64, dtype, n 1..64, page 1..64 */
    PD_FUZZ_SEAL_LENGTHS = 8,   /* spec_len < 200, ns_len < 40, value size = what the fields need */
    PD_FUZZ_SEAL_NUL = 16,      /* no NUL in spec and namespace */
    PD_FUZZ_SEAL_KEPT = 32,     /* kept counts <= n */
    PD_FUZZ_SEAL_SIZE = 64,     /* length field = value size */
    PD_FUZZ_SEAL_SUM = 128,     /* checksum */
};

/* Sealed-stream flags. */
enum {
    PD_FUZZ_SEAL_FIELDS = 1, /* magic and every header field as the layout says */
    PD_FUZZ_SEAL_PAGES = 2,  /* page checksums */
    PD_FUZZ_SEAL_HSUM = 4,   /* the stream header's checksum */
    PD_FUZZ_SEAL_DELTA = 8,  /* decode with the value size off by the delta byte */
};

#define PD_FUZZ_SHAPE_LEN 21
#define PD_FUZZ_MAX_SHAPE_STREAMS 64 /* 8 layers x 8 kv heads */

static inline size_t pd_fuzz_min(size_t a, size_t b) { return a < b ? a : b; }

/* Reads bytes of the input; zeros once it runs out. */
typedef struct pd_fuzz_rd {
    const uint8_t *p;
    size_t n, off;
} pd_fuzz_rd;

static inline uint8_t pd_fuzz_u8(pd_fuzz_rd *r) { return r->off < r->n ? r->p[r->off++] : 0; }
static inline uint32_t pd_fuzz_u32(pd_fuzz_rd *r) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)pd_fuzz_u8(r) << (8 * i);
    return v;
}
static inline uint64_t pd_fuzz_u64(pd_fuzz_rd *r) {
    uint64_t lo = pd_fuzz_u32(r);
    return lo | (uint64_t)pd_fuzz_u32(r) << 32;
}

/* What cache_stream_decode reads from the record's header for one stream. */
typedef struct pd_fuzz_shape {
    int32_t n_layer, n_head_kv, layer, head, head_dim, n_tokens, page_tokens;
    pd_kv_dtype dtype;
    uint32_t kept;
} pd_fuzz_shape;

/* PD_FUZZ_SHAPE_LEN bytes: u8 n_layer-1, u8 n_head_kv-1, u8 layer, u8 head,
 * u32 head_dim-1, u8 dtype, u32 n-1, u32 page_tokens-1, u32 kept (each taken
 * modulo its range, so any bytes give a shape a decoded header can have).
 * small: head_dim <= 64 and kept <= 256, for values that are built here. */
static inline void pd_fuzz_read_shape(pd_fuzz_rd *r, pd_fuzz_shape *s, bool small) {
    s->n_layer = 1 + pd_fuzz_u8(r) % 8;
    s->n_head_kv = 1 + pd_fuzz_u8(r) % 8;
    s->layer = pd_fuzz_u8(r) % s->n_layer;
    s->head = pd_fuzz_u8(r) % s->n_head_kv;
    uint32_t hd = pd_fuzz_u32(r);
    s->head_dim = (int32_t)(1 + hd % (small ? 64u : (uint32_t)CACHE_MAX_HEAD_DIM));
    s->dtype = (pd_kv_dtype)(pd_fuzz_u8(r) % 3);
    s->n_tokens = (int32_t)(1 + pd_fuzz_u32(r) % (uint32_t)INT32_MAX);
    s->page_tokens = (int32_t)(1 + pd_fuzz_u32(r) % (uint32_t)INT32_MAX);
    uint64_t range = (uint64_t)s->n_tokens + 1;
    if (small && range > 257) range = 257;
    s->kept = (uint32_t)(pd_fuzz_u32(r) % range);
}

/* The inverse, for seed generators. */
static inline void pd_fuzz_write_shape(uint8_t out[PD_FUZZ_SHAPE_LEN], const pd_fuzz_shape *s) {
    out[0] = (uint8_t)(s->n_layer - 1);
    out[1] = (uint8_t)(s->n_head_kv - 1);
    out[2] = (uint8_t)s->layer;
    out[3] = (uint8_t)s->head;
    cache_wr_u32(out + 4, (uint32_t)(s->head_dim - 1));
    out[8] = (uint8_t)s->dtype;
    cache_wr_u32(out + 9, (uint32_t)(s->n_tokens - 1));
    cache_wr_u32(out + 13, (uint32_t)(s->page_tokens - 1));
    cache_wr_u32(out + 17, s->kept);
}

/* A header as cache_header_decode would give it, for the shape's stream. */
static inline void pd_fuzz_shape_header(const pd_fuzz_shape *s, uint8_t kept[4 * PD_FUZZ_MAX_SHAPE_STREAMS],
                                        cache_header *h) {
    memset(h, 0, sizeof *h);
    memset(kept, 0, 4 * PD_FUZZ_MAX_SHAPE_STREAMS);
    h->n_layer = s->n_layer;
    h->n_head_kv = s->n_head_kv;
    h->head_dim = s->head_dim;
    h->dtype = s->dtype;
    h->n_tokens = s->n_tokens;
    h->page_tokens = s->page_tokens;
    cache_wr_u32(kept + 4 * (s->layer * s->n_head_kv + s->head), s->kept);
    h->kept = kept;
}

/* ---- invariants of accepted values --------------------------------------- */

static inline void pd_fuzz_check_refusal(int rc, const pd_error *err, const char *what) {
    PD_FUZZ_CHECK(rc == PD_EFORMAT && err->msg[0] != '\0', "%s refused with status %d and message '%s'", what, rc,
                  err->msg);
}

static inline void pd_fuzz_header_ok(const cache_header *h, const uint8_t *val, size_t size) {
    PD_FUZZ_CHECK(h->size == size, "header size %zu, value %zu", h->size, size);
    PD_FUZZ_CHECK(h->n_layer >= 1 && h->n_layer <= CACHE_MAX_LAYERS && h->n_head_kv >= 1 &&
                      h->n_head_kv <= CACHE_MAX_HEADS && h->head_dim >= 1 && h->head_dim <= CACHE_MAX_HEAD_DIM,
                  "accepted shape %d x %d x %d", h->n_layer, h->n_head_kv, h->head_dim);
    PD_FUZZ_CHECK((unsigned)h->dtype <= PD_KV_BF16 && h->n_tokens >= 1 && h->page_tokens >= 1,
                  "accepted dtype %d, n %d, page_tokens %d", (int)h->dtype, h->n_tokens, h->page_tokens);
    PD_FUZZ_CHECK(h->spec_len < PD_PREFIX_SPEC_MAX && h->ns_len < PD_PREFIX_NS_MAX, "accepted spec %u, ns %u",
                  h->spec_len, h->ns_len);
    const uint8_t *end = val + size;
    uint64_t n_streams = (uint64_t)h->n_layer * (uint64_t)h->n_head_kv;
    PD_FUZZ_CHECK((const uint8_t *)h->spec == val + CACHE_HEADER_FIXED && h->ns == h->spec + h->spec_len &&
                      (const uint8_t *)h->ns + h->ns_len <= h->kept && h->kept + 4 * n_streams == h->tokens &&
                      h->tokens + 4 * (uint64_t)h->n_tokens + 8 == end,
                  "header arrays are not where the layout puts them inside the %zu-byte value", size);
    PD_FUZZ_CHECK(!memchr(h->spec, 0, h->spec_len) && !memchr(h->ns, 0, h->ns_len), "accepted a NUL in spec or ns");
    int64_t kept_rows = 0;
    for (int32_t l = 0; l < h->n_layer; l++)
        for (int32_t hd = 0; hd < h->n_head_kv; hd++) {
            uint32_t k = cache_header_kept(h, l, hd);
            PD_FUZZ_CHECK(k <= (uint32_t)h->n_tokens, "kept %u of %d tokens", k, h->n_tokens);
            kept_rows += k;
        }
    pd_token *tokens = malloc(4 * (size_t)h->n_tokens);
    PD_FUZZ_CHECK(tokens, "out of memory for %d tokens", h->n_tokens);
    for (int64_t i = 0; i < h->n_tokens; i++) tokens[i] = cache_header_token(h, i);
    pd_prefix_info *info = calloc(1, sizeof *info);
    PD_FUZZ_CHECK(info, "out of memory");
    cache_header_to_info(h, info);
    PD_FUZZ_CHECK(strlen(info->spec) == h->spec_len && strlen(info->ns) == h->ns_len && info->kept_rows == kept_rows &&
                      info->n_tokens == h->n_tokens && info->n_layer == h->n_layer,
                  "cache_header_to_info disagrees with the header");
    /* The fields hash to an id the decoder accepts; any other id is refused. */
    pd_prefix_id id;
    pd_error err = {0};
    if (pd_prefix_id_compute(h->fingerprint, tokens, h->n_tokens, info->spec, info->ns, &id) == PD_OK) {
        cache_header again;
        int rc = cache_header_decode(val, size, &id, &again, &err);
        PD_FUZZ_CHECK(rc == PD_OK, "header refused under its own id: %s", err.msg);
        id.b[id.b[0] % PD_PREFIX_ID_LEN] ^= 0x20;
        err.msg[0] = '\0';
        rc = cache_header_decode(val, size, &id, &again, &err);
        pd_fuzz_check_refusal(rc, &err, "a header under another id");
    }
    free(info);
    free(tokens);
}

static inline void pd_fuzz_stream_ok(const cache_header *h, int32_t layer, int32_t head, const cache_stream *st,
                                     const uint8_t *val, size_t size) {
    uint64_t len = cache_header_kept(h, layer, head);
    uint64_t row = (uint64_t)h->head_dim * cache_dtype_size(h->dtype);
    PD_FUZZ_CHECK(st->len >= 0 && (uint64_t)st->len == len && st->size == size, "stream of %d rows (%zu bytes) "
                  "for a kept count of %llu (%zu bytes)", st->len, st->size, (unsigned long long)len, size);
    const uint8_t *end = val + size;
    PD_FUZZ_CHECK(st->pos >= val + CACHE_STREAM_FIXED + 8 && (st->pos - val) % CACHE_ALIGN == 0 &&
                      (st->k - val) % CACHE_ALIGN == 0 && (st->v - val) % CACHE_ALIGN == 0 &&
                      st->pos + 4 * len <= st->k && st->k + len * row <= st->v && st->v + len * row == end,
                  "stream arrays are not where the layout puts them inside the %zu-byte value", size);
    volatile uint8_t acc = 0;
    for (const uint8_t *q = st->pos; q < end; q++) acc ^= *q;
    (void)acc;
}

/* ---- the documented layout, computed here independently ------------------ */

static inline uint64_t pd_fuzz_align64(uint64_t x) { return (x + 63) / 64 * 64; }

typedef struct pd_fuzz_slayout {
    uint64_t n_pages, hdr_end, off_pos, off_k, off_v, total, row;
} pd_fuzz_slayout;

/* For small streams only (no overflow checks). */
static inline void pd_fuzz_stream_layout(uint64_t len, uint64_t head_dim, pd_kv_dtype dtype, uint64_t page_tokens,
                                         pd_fuzz_slayout *L) {
    L->n_pages = (len + page_tokens - 1) / page_tokens;
    L->row = head_dim * (dtype == PD_KV_F32 ? 4 : 2);
    L->hdr_end = 72 + 8 * L->n_pages;
    L->off_pos = pd_fuzz_align64(L->hdr_end + 8);
    L->off_k = pd_fuzz_align64(L->off_pos + 4 * len);
    L->off_v = pd_fuzz_align64(L->off_k + len * L->row);
    L->total = L->off_v + len * L->row;
}

static inline uint64_t pd_fuzz_page_sum(const uint8_t *val, const pd_fuzz_slayout *L, uint64_t len,
                                        uint64_t page_tokens, uint64_t page) {
    uint64_t r0 = page * page_tokens, r1 = r0 + page_tokens < len ? r0 + page_tokens : len;
    uint64_t s = XXH3_64bits_withSeed(val + L->off_pos + 4 * r0, 4 * (r1 - r0), page);
    s = XXH3_64bits_withSeed(val + L->off_k + r0 * L->row, (r1 - r0) * L->row, s);
    return XXH3_64bits_withSeed(val + L->off_v + r0 * L->row, (r1 - r0) * L->row, s);
}

/* Write every stream header field, page checksum and the header checksum
 * as docs/store.md describes them. */
static inline void pd_fuzz_seal_stream_value(uint8_t *val, const pd_fuzz_slayout *L, uint32_t layer, uint32_t head,
                                             uint64_t len, uint32_t head_dim, pd_kv_dtype dtype, uint64_t page_tokens,
                                             unsigned flags) {
    if (flags & PD_FUZZ_SEAL_FIELDS) {
        memcpy(val, CACHE_STREAM_MAGIC, 8);
        cache_wr_u32(val + 8, layer);
        cache_wr_u32(val + 12, head);
        cache_wr_u32(val + 16, (uint32_t)len);
        cache_wr_u32(val + 20, head_dim);
        cache_wr_u32(val + 24, (uint32_t)dtype);
        cache_wr_u32(val + 28, (uint32_t)page_tokens);
        cache_wr_u32(val + 32, (uint32_t)L->n_pages);
        cache_wr_u32(val + 36, 0);
        cache_wr_u64(val + 40, L->off_pos);
        cache_wr_u64(val + 48, L->off_k);
        cache_wr_u64(val + 56, L->off_v);
        cache_wr_u64(val + 64, L->total);
    }
    if (flags & PD_FUZZ_SEAL_PAGES)
        for (uint64_t pg = 0; pg < L->n_pages; pg++)
            cache_wr_u64(val + 72 + 8 * pg, pd_fuzz_page_sum(val, L, len, page_tokens, pg));
    if (flags & PD_FUZZ_SEAL_HSUM) cache_wr_u64(val + L->hdr_end, XXH3_64bits(val, L->hdr_end));
}

/* ---- modes 0 and 1: raw values ------------------------------------------- */

static inline void pd_fuzz_raw_header(const uint8_t *p, size_t n) {
    uint8_t *val = malloc(n ? n : 1);
    if (!val) return;
    if (n) memcpy(val, p, n);
    cache_header h;
    pd_error err = {0};
    int rc = cache_header_decode(val, n, NULL, &h, &err);
    if (rc == PD_OK) pd_fuzz_header_ok(&h, val, n);
    else pd_fuzz_check_refusal(rc, &err, "a raw header");
    if (n >= PD_PREFIX_ID_LEN) {
        pd_prefix_id id;
        memcpy(id.b, val, PD_PREFIX_ID_LEN);
        err.msg[0] = '\0';
        rc = cache_header_decode(val, n, &id, &h, &err);
        if (rc == PD_OK) pd_fuzz_header_ok(&h, val, n);
        else pd_fuzz_check_refusal(rc, &err, "a raw header under an id");
    }
    free(val);
}

static inline void pd_fuzz_raw_stream(const uint8_t *p, size_t n) {
    pd_fuzz_rd r = {p, n, 0};
    pd_fuzz_shape s;
    pd_fuzz_read_shape(&r, &s, false);
    size_t vn = n - pd_fuzz_min(n, PD_FUZZ_SHAPE_LEN);
    uint8_t *val = malloc(vn ? vn : 1);
    if (!val) return;
    if (vn) memcpy(val, p + (n - vn), vn);
    uint8_t kept[4 * PD_FUZZ_MAX_SHAPE_STREAMS];
    cache_header h;
    pd_fuzz_shape_header(&s, kept, &h);
    cache_stream st;
    pd_error err = {0};
    int rc = cache_stream_decode(val, vn, &h, s.layer, s.head, &st, &err);
    if (rc == PD_OK) pd_fuzz_stream_ok(&h, s.layer, s.head, &st, val, vn);
    else pd_fuzz_check_refusal(rc, &err, "a raw stream");
    free(val);
}

/* ---- mode 2: a header with repaired fields ------------------------------- */

static inline void pd_fuzz_seal_header(const uint8_t *p, size_t n) {
    if (n < 1) return;
    unsigned flags = p[0];
    p++;
    n--;
    uint8_t fixed[CACHE_HEADER_FIXED];
    memset(fixed, 0, sizeof fixed);
    memcpy(fixed, p, pd_fuzz_min(n, sizeof fixed));
    if (flags & PD_FUZZ_SEAL_MAGIC) memcpy(fixed, CACHE_HEADER_MAGIC, 8);
    if (flags & PD_FUZZ_SEAL_VERSION) cache_wr_u32(fixed + 8, PD_STORE_FORMAT_VERSION);
    if (flags & PD_FUZZ_SEAL_SHAPE) {
        /* Values already in these ranges stay as they are. */
        cache_wr_u32(fixed + 48, 1 + (cache_rd_u32(fixed + 48) - 1) % 4);
        cache_wr_u32(fixed + 52, 1 + (cache_rd_u32(fixed + 52) - 1) % 4);
        cache_wr_u32(fixed + 56, 1 + (cache_rd_u32(fixed + 56) - 1) % 64);
        cache_wr_u32(fixed + 60, cache_rd_u32(fixed + 60) % 3);
        cache_wr_u32(fixed + 64, 1 + (cache_rd_u32(fixed + 64) - 1) % 64);
        cache_wr_u32(fixed + 68, 1 + (cache_rd_u32(fixed + 68) - 1) % 64);
    }
    uint64_t nl = cache_rd_u32(fixed + 48), nh = cache_rd_u32(fixed + 52), nt = cache_rd_u32(fixed + 64);
    size_t size = n;
    if (flags & PD_FUZZ_SEAL_LENGTHS) {
        cache_wr_u32(fixed + 112, cache_rd_u32(fixed + 112) % 200);
        cache_wr_u32(fixed + 116, cache_rd_u32(fixed + 116) % 40);
        /* The documented layout: fixed part, spec, ns, pad to 4, kept, tokens, checksum. */
        if (nl >= 1 && nl <= CACHE_MAX_LAYERS && nh >= 1 && nh <= CACHE_MAX_HEADS && nt >= 1 && nt <= (1u << 16)) {
            uint64_t var = (CACHE_HEADER_FIXED + cache_rd_u32(fixed + 112) + cache_rd_u32(fixed + 116) + 3) / 4 * 4;
            size = (size_t)(var + 4 * nl * nh + 4 * nt + 8);
        }
    }
    if (size > (1u << 22)) return;
    uint8_t *val = calloc(size ? size : 1, 1);
    if (!val) return;
    memcpy(val, p, pd_fuzz_min(n, size));
    if (size >= CACHE_HEADER_FIXED + 8) {
        memcpy(val, fixed, CACHE_HEADER_FIXED);
        uint64_t spec_len = cache_rd_u32(val + 112), ns_len = cache_rd_u32(val + 116);
        uint64_t text_end = pd_fuzz_min(CACHE_HEADER_FIXED + spec_len + ns_len, size - 8);
        if (flags & PD_FUZZ_SEAL_NUL)
            for (uint64_t i = CACHE_HEADER_FIXED; i < text_end; i++)
                if (!val[i]) val[i] = 'a';
        if (flags & PD_FUZZ_SEAL_KEPT) {
            uint64_t off = (CACHE_HEADER_FIXED + spec_len + ns_len + 3) / 4 * 4;
            for (uint64_t i = 0; i < nl * nh && off + 4 * i + 4 <= size - 8; i++)
                cache_wr_u32(val + off + 4 * i, (uint32_t)(cache_rd_u32(val + off + 4 * i) % (nt + 1)));
        }
    }
    if ((flags & PD_FUZZ_SEAL_SIZE) && size >= 16) cache_wr_u32(val + 12, (uint32_t)size);
    if ((flags & PD_FUZZ_SEAL_SUM) && size >= 8) cache_wr_u64(val + size - 8, XXH3_64bits(val, size - 8));
    cache_header h;
    pd_error err = {0};
    int rc = cache_header_decode(val, size, NULL, &h, &err);
    if (rc == PD_OK) {
        pd_fuzz_header_ok(&h, val, size);
    } else {
        pd_fuzz_check_refusal(rc, &err, "a sealed header");
        PD_FUZZ_CHECK(flags != 0xff, "a header with every field repaired is refused: %s", err.msg);
    }
    free(val);
}

/* ---- mode 3: a stream with repaired fields and checksums ----------------- */

static inline void pd_fuzz_seal_stream(const uint8_t *p, size_t n) {
    pd_fuzz_rd r = {p, n, 0};
    pd_fuzz_shape s;
    pd_fuzz_read_shape(&r, &s, true);
    unsigned flags = pd_fuzz_u8(&r);
    int delta = (int8_t)pd_fuzz_u8(&r);
    const uint8_t *payload = p + r.off;
    size_t np = r.off < n ? n - r.off : 0;
    pd_fuzz_slayout L;
    pd_fuzz_stream_layout(s.kept, (uint64_t)s.head_dim, s.dtype, (uint64_t)s.page_tokens, &L);
    size_t total;
    pd_error err = {0};
    PD_FUZZ_CHECK(cache_stream_size(s.kept, s.head_dim, s.dtype, s.page_tokens, &total, &err) == PD_OK,
                  "cache_stream_size refused a small stream: %s", err.msg);
    PD_FUZZ_CHECK(total == L.total, "cache_stream_size says %zu bytes, docs/store.md %llu", total,
                  (unsigned long long)L.total);
    size_t cap = total + 128;
    uint8_t *val = calloc(cap, 1);
    if (!val) return;
    if (np)
        for (size_t i = 0; i < total; i++) val[i] = payload[i % np];
    if ((flags & 7) == 7) {
        /* docs/store.md: the alignment gaps are zero (a full repair makes them so). */
        memset(val + L.hdr_end, 0, L.off_pos - L.hdr_end);
        memset(val + L.off_pos + 4 * s.kept, 0, L.off_k - L.off_pos - 4 * (uint64_t)s.kept);
        memset(val + L.off_k + (uint64_t)s.kept * L.row, 0, L.off_v - L.off_k - (uint64_t)s.kept * L.row);
    }
    pd_fuzz_seal_stream_value(val, &L, (uint32_t)s.layer, (uint32_t)s.head, s.kept, (uint32_t)s.head_dim, s.dtype,
                              (uint64_t)s.page_tokens, flags);
    size_t size = total;
    if ((flags & PD_FUZZ_SEAL_DELTA) && delta) {
        if (delta < 0) size = (size_t)-delta > total ? 0 : total - (size_t)-delta;
        else size = total + (size_t)delta;
    }
    /* An exactly-sized copy, so ASan sees any read past the value. */
    uint8_t *exact = malloc(size ? size : 1);
    if (!exact) {
        free(val);
        return;
    }
    memcpy(exact, val, size);
    uint8_t kept[4 * PD_FUZZ_MAX_SHAPE_STREAMS];
    cache_header h;
    pd_fuzz_shape_header(&s, kept, &h);
    cache_stream st;
    int rc = cache_stream_decode(exact, size, &h, s.layer, s.head, &st, &err);
    if (rc == PD_OK) {
        pd_fuzz_stream_ok(&h, s.layer, s.head, &st, exact, size);
    } else {
        pd_fuzz_check_refusal(rc, &err, "a sealed stream");
        PD_FUZZ_CHECK((flags & 7) != 7 || size != total, "a stream with every field and checksum repaired is "
                      "refused: %s", err.msg);
    }
    free(exact);
    free(val);
}

/* ---- mode 4: encode, decode, corrupt ------------------------------------- */

#define PD_FUZZ_ENC_LAYERS 3
#define PD_FUZZ_ENC_HEADS 3
#define PD_FUZZ_ENC_DIM 16
#define PD_FUZZ_ENC_TOKENS 48
#define PD_FUZZ_ENC_STREAMS (PD_FUZZ_ENC_LAYERS * PD_FUZZ_ENC_HEADS)

/* A small record built from input bytes and encoded with record.c. */
typedef struct pd_fuzz_record {
    cache_header h; /* the fields written; spec and ns point into the arrays below */
    char spec[64], ns[32];
    pd_token tokens[PD_FUZZ_ENC_TOKENS];
    pd_kv_prefix *kv;
    pd_prefix_id id;
    uint8_t *hv;
    size_t hsize;
    int n_streams; /* layer-major */
    uint8_t *sv[PD_FUZZ_ENC_STREAMS];
    size_t ssize[PD_FUZZ_ENC_STREAMS];
} pd_fuzz_record;

static inline float pd_fuzz_value(pd_fuzz_rd *r) {
    uint8_t lo = pd_fuzz_u8(r), hi = pd_fuzz_u8(r);
    if (hi == 0x7f) return lo & 1 ? NAN : (lo & 2 ? -INFINITY : INFINITY);
    return (float)(int16_t)(uint16_t)(lo | hi << 8) / 64.0f;
}

static inline void pd_fuzz_record_free(pd_fuzz_record *rec) {
    for (int i = 0; i < rec->n_streams; i++) free(rec->sv[i]);
    free(rec->hv);
    pd_kv_prefix_free(rec->kv);
    memset(rec, 0, sizeof *rec);
}

/* Build and encode; the encoders are not expected to fail on these shapes. */
static inline void pd_fuzz_record_build(pd_fuzz_rd *r, pd_fuzz_record *rec) {
    memset(rec, 0, sizeof *rec);
    cache_header *h = &rec->h;
    h->n_layer = 1 + pd_fuzz_u8(r) % PD_FUZZ_ENC_LAYERS;
    h->n_head_kv = 1 + pd_fuzz_u8(r) % PD_FUZZ_ENC_HEADS;
    h->head_dim = 1 + pd_fuzz_u8(r) % PD_FUZZ_ENC_DIM;
    h->dtype = (pd_kv_dtype)(pd_fuzz_u8(r) % 3);
    h->n_tokens = 1 + pd_fuzz_u8(r) % PD_FUZZ_ENC_TOKENS;
    h->page_tokens = 1 + pd_fuzz_u8(r) % 20;
    h->spec_len = pd_fuzz_u8(r) % (uint32_t)(sizeof rec->spec);
    h->ns_len = pd_fuzz_u8(r) % (uint32_t)(sizeof rec->ns);
    for (uint32_t i = 0; i < h->spec_len; i++) {
        uint8_t c = pd_fuzz_u8(r);
        rec->spec[i] = (char)(c ? c : '0');
    }
    for (uint32_t i = 0; i < h->ns_len; i++) {
        uint8_t c = pd_fuzz_u8(r);
        rec->ns[i] = (char)(c ? c : '0');
    }
    /* Spec and ns are shorter than their arrays: the rest stays NUL. */
    h->spec = rec->spec;
    h->ns = rec->ns;
    for (int i = 0; i < PD_SHA256_LEN; i++) h->fingerprint[i] = pd_fuzz_u8(r);
    double q[4];
    for (int i = 0; i < 4; i++) {
        uint64_t bits = pd_fuzz_u64(r);
        memcpy(&q[i], &bits, sizeof bits);
    }
    h->quality.retention = q[0];
    h->quality.tau = q[1];
    h->quality.nll_full = q[2];
    h->quality.nll_ratio = q[3];
    h->created_at = (int64_t)pd_fuzz_u64(r);
    for (int32_t i = 0; i < h->n_tokens; i++) rec->tokens[i] = (pd_token)pd_fuzz_u32(r);

    pd_hparams hp;
    memset(&hp, 0, sizeof hp);
    hp.n_layer = h->n_layer;
    hp.n_head_kv = h->n_head_kv;
    hp.head_dim = h->head_dim;
    pd_error err = {0};
    PD_FUZZ_CHECK(pd_kv_prefix_create(&hp, h->n_tokens, PD_TYPE_F32, &rec->kv, &err) == PD_OK, "%s", err.msg);
    int32_t pos[PD_FUZZ_ENC_TOKENS];
    float *k = malloc(sizeof(float) * PD_FUZZ_ENC_TOKENS * PD_FUZZ_ENC_DIM);
    float *v = malloc(sizeof(float) * PD_FUZZ_ENC_TOKENS * PD_FUZZ_ENC_DIM);
    PD_FUZZ_CHECK(k && v, "out of memory");
    for (int32_t l = 0; l < h->n_layer; l++)
        for (int32_t hd = 0; hd < h->n_head_kv; hd++) {
            int64_t len = 0;
            uint8_t bits = 0;
            for (int32_t t = 0; t < h->n_tokens; t++) {
                if (t % 8 == 0) bits = pd_fuzz_u8(r);
                if (bits >> (t % 8) & 1) pos[len++] = t;
            }
            for (int64_t i = 0; i < len * h->head_dim; i++) {
                k[i] = pd_fuzz_value(r);
                v[i] = pd_fuzz_value(r);
            }
            PD_FUZZ_CHECK(pd_kv_prefix_set(rec->kv, l, hd, pos, k, v, len, &err) == PD_OK, "%s", err.msg);
        }
    free(k);
    free(v);

    PD_FUZZ_CHECK(cache_header_size(h, &rec->hsize, &err) == PD_OK, "%s", err.msg);
    rec->hv = malloc(rec->hsize);
    PD_FUZZ_CHECK(rec->hv, "out of memory");
    cache_header_write(rec->hv, rec->hsize, h, rec->kv, rec->tokens);
    PD_FUZZ_CHECK(pd_prefix_id_compute(h->fingerprint, rec->tokens, h->n_tokens, rec->spec, rec->ns, &rec->id) ==
                      PD_OK, "pd_prefix_id_compute failed");
    rec->n_streams = h->n_layer * h->n_head_kv;
    for (int32_t l = 0; l < h->n_layer; l++)
        for (int32_t hd = 0; hd < h->n_head_kv; hd++) {
            int s = l * h->n_head_kv + hd;
            int64_t len = pd_kv_prefix_stream(rec->kv, l, hd, NULL, NULL, NULL);
            PD_FUZZ_CHECK(cache_stream_size(len, h->head_dim, h->dtype, h->page_tokens, &rec->ssize[s], &err) == PD_OK,
                          "%s", err.msg);
            rec->sv[s] = malloc(rec->ssize[s]);
            PD_FUZZ_CHECK(rec->sv[s], "out of memory");
            cache_stream_write(rec->sv[s], rec->ssize[s], rec->kv, l, hd, h->head_dim, h->dtype, h->page_tokens);
        }
}

/* A decoded header says what was written. */
static inline bool pd_fuzz_header_matches(const cache_header *got, const pd_fuzz_record *rec) {
    const cache_header *w = &rec->h;
    if (got->n_layer != w->n_layer || got->n_head_kv != w->n_head_kv || got->head_dim != w->head_dim ||
        got->dtype != w->dtype || got->n_tokens != w->n_tokens || got->page_tokens != w->page_tokens ||
        got->created_at != w->created_at || got->spec_len != w->spec_len || got->ns_len != w->ns_len ||
        got->size != rec->hsize)
        return false;
    if (memcmp(got->fingerprint, w->fingerprint, PD_SHA256_LEN) != 0 ||
        memcmp(&got->quality, &w->quality, sizeof w->quality) != 0 ||
        memcmp(got->spec, w->spec, w->spec_len) != 0 || memcmp(got->ns, w->ns, w->ns_len) != 0)
        return false;
    for (int32_t l = 0; l < w->n_layer; l++)
        for (int32_t hd = 0; hd < w->n_head_kv; hd++)
            if (cache_header_kept(got, l, hd) != (uint64_t)pd_kv_prefix_stream(rec->kv, l, hd, NULL, NULL, NULL))
                return false;
    for (int64_t i = 0; i < w->n_tokens; i++)
        if (cache_header_token(got, i) != rec->tokens[i]) return false;
    return true;
}

/* A decoded stream holds the rows that were written, converted to the dtype. */
static inline bool pd_fuzz_stream_matches(const cache_stream *st, const pd_fuzz_record *rec, int32_t layer,
                                          int32_t head) {
    const int32_t *pos;
    const void *kr, *vr;
    int64_t len = pd_kv_prefix_stream(rec->kv, layer, head, &pos, &kr, &vr);
    const float *k = kr, *v = vr; /* the record's prefix is f32 */
    if (st->len != len || (len && memcmp(st->pos, pos, 4 * (size_t)len) != 0)) return false;
    pd_kv_dtype dt = rec->h.dtype;
    for (int64_t i = 0; i < len * rec->h.head_dim; i++) {
        for (int which = 0; which < 2; which++) {
            float x = which ? v[i] : k[i];
            const uint8_t *at = which ? st->v : st->k;
            if (dt == PD_KV_F32) {
                if (memcmp(at + 4 * i, &x, 4) != 0) return false;
            } else {
                uint16_t want = dt == PD_KV_F16 ? pd_fp32_to_fp16(x) : pd_fp32_to_bf16(x), got;
                memcpy(&got, at + 2 * i, 2);
                if (got != want) return false;
            }
        }
    }
    return true;
}

static inline void pd_fuzz_encode(const uint8_t *p, size_t n) {
    pd_fuzz_rd r = {p, n, 0};
    pd_fuzz_record rec;
    pd_fuzz_record_build(&r, &rec);
    const cache_header *w = &rec.h;
    pd_error err = {0};

    /* Clean round trip, under the record's id. */
    cache_header dh;
    int rc = cache_header_decode(rec.hv, rec.hsize, &rec.id, &dh, &err);
    PD_FUZZ_CHECK(rc == PD_OK, "an encoded header is refused: %s", err.msg);
    PD_FUZZ_CHECK(pd_fuzz_header_matches(&dh, &rec), "an encoded header decodes to other values");
    pd_fuzz_header_ok(&dh, rec.hv, rec.hsize);
    for (int32_t l = 0; l < w->n_layer; l++)
        for (int32_t hd = 0; hd < w->n_head_kv; hd++) {
            int s = l * w->n_head_kv + hd;
            cache_stream st;
            rc = cache_stream_decode(rec.sv[s], rec.ssize[s], &dh, l, hd, &st, &err);
            PD_FUZZ_CHECK(rc == PD_OK, "an encoded stream is refused: %s", err.msg);
            PD_FUZZ_CHECK(pd_fuzz_stream_matches(&st, &rec, l, hd), "stream (%d, %d) decodes to other rows", l, hd);
            pd_fuzz_stream_ok(&dh, l, hd, &st, rec.sv[s], rec.ssize[s]);
            /* The value is exactly what docs/store.md describes. */
            uint8_t *copy = malloc(rec.ssize[s]);
            PD_FUZZ_CHECK(copy, "out of memory");
            memcpy(copy, rec.sv[s], rec.ssize[s]);
            pd_fuzz_slayout L;
            pd_fuzz_stream_layout((uint64_t)st.len, (uint64_t)w->head_dim, w->dtype, (uint64_t)w->page_tokens, &L);
            PD_FUZZ_CHECK(L.total == rec.ssize[s], "stream size %zu, documented %llu", rec.ssize[s],
                          (unsigned long long)L.total);
            pd_fuzz_seal_stream_value(copy, &L, (uint32_t)l, (uint32_t)hd, (uint64_t)st.len, (uint32_t)w->head_dim,
                                      w->dtype, (uint64_t)w->page_tokens,
                                      PD_FUZZ_SEAL_FIELDS | PD_FUZZ_SEAL_PAGES | PD_FUZZ_SEAL_HSUM);
            PD_FUZZ_CHECK(memcmp(copy, rec.sv[s], rec.ssize[s]) == 0,
                          "stream (%d, %d) differs from the layout in docs/store.md", l, hd);
            free(copy);
        }

    /* Values in the wrong place or of the wrong size (dh stays the good
     * header: a refused decode zeroes its output). */
    {
        cache_header tmp;
        err.msg[0] = '\0';
        rc = cache_header_decode(rec.hv, rec.hsize - 1, &rec.id, &tmp, &err);
        pd_fuzz_check_refusal(rc, &err, "a truncated header");
    }
    if (rec.n_streams > 1) {
        cache_stream st;
        err.msg[0] = '\0';
        rc = cache_stream_decode(rec.sv[0], rec.ssize[0], &dh, (rec.n_streams - 1) / w->n_head_kv,
                                 (rec.n_streams - 1) % w->n_head_kv, &st, &err);
        pd_fuzz_check_refusal(rc, &err, "a stream decoded as another stream");
    }
    {
        cache_stream st;
        err.msg[0] = '\0';
        rc = cache_stream_decode(rec.sv[0], rec.ssize[0] - 1, &dh, 0, 0, &st, &err);
        pd_fuzz_check_refusal(rc, &err, "a truncated stream");
    }

    /* One flipped byte: refused, or decoded to the same values. */
    int target = pd_fuzz_u8(&r) % (1 + rec.n_streams);
    uint32_t off = pd_fuzz_u32(&r);
    uint8_t x = (uint8_t)(1 + pd_fuzz_u8(&r) % 255);
    if (target == 0) {
        off %= (uint32_t)rec.hsize;
        rec.hv[off] ^= x;
        err.msg[0] = '\0';
        rc = cache_header_decode(rec.hv, rec.hsize, &rec.id, &dh, &err);
        if (rc == PD_OK)
            PD_FUZZ_CHECK(pd_fuzz_header_matches(&dh, &rec), "a header with byte %u flipped decodes to other values",
                          off);
        else pd_fuzz_check_refusal(rc, &err, "a corrupt header");
        err.msg[0] = '\0';
        rc = cache_header_decode(rec.hv, rec.hsize, NULL, &dh, &err);
        if (rc == PD_OK) pd_fuzz_header_ok(&dh, rec.hv, rec.hsize);
        else pd_fuzz_check_refusal(rc, &err, "a corrupt header");
        rec.hv[off] ^= x;
    } else {
        int s = target - 1;
        int32_t l = s / w->n_head_kv, hd = s % w->n_head_kv;
        rc = cache_header_decode(rec.hv, rec.hsize, &rec.id, &dh, &err);
        PD_FUZZ_CHECK(rc == PD_OK, "%s", err.msg);
        off %= (uint32_t)rec.ssize[s];
        rec.sv[s][off] ^= x;
        cache_stream st;
        err.msg[0] = '\0';
        rc = cache_stream_decode(rec.sv[s], rec.ssize[s], &dh, l, hd, &st, &err);
        if (rc == PD_OK)
            PD_FUZZ_CHECK(pd_fuzz_stream_matches(&st, &rec, l, hd),
                          "stream (%d, %d) with byte %u flipped decodes to other rows", l, hd, off);
        else pd_fuzz_check_refusal(rc, &err, "a corrupt stream");
        rec.sv[s][off] ^= x;
    }
    pd_fuzz_record_free(&rec);
}

/* The whole harness. */
static inline void pd_fuzz_record_input(const uint8_t *data, size_t size) {
    if (size < 1) return;
    const uint8_t *p = data + 1;
    size_t n = size - 1;
    switch (data[0] % PD_FUZZ_REC_MODES) {
    case PD_FUZZ_REC_RAW_HEADER: pd_fuzz_raw_header(p, n); break;
    case PD_FUZZ_REC_RAW_STREAM: pd_fuzz_raw_stream(p, n); break;
    case PD_FUZZ_REC_SEAL_HEADER: pd_fuzz_seal_header(p, n); break;
    case PD_FUZZ_REC_SEAL_STREAM: pd_fuzz_seal_stream(p, n); break;
    default: pd_fuzz_encode(p, n); break;
    }
}

#endif
