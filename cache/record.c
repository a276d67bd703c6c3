/* Prefix ids and the record codec: the header value and the per-(layer,
 * head) stream values, with their checksums (XXH3-64). Stored bytes are
 * untrusted: every length is checked against the value's size before use.
 * The byte layout is documented in docs/store.md. */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "cache/cache_internal.h"
#include "kernels/kernels.h"
/* Only for the prefix's shape, which engine.h has no accessor for. */

/* ---- prefix ids ---------------------------------------------------------- */

static void sha_u64(pd_sha256 *h, uint64_t v) {
    uint8_t b[8];
    cache_wr_u64(b, v);
    pd_sha256_update(h, b, sizeof b);
}

/* tokens: n little-endian i32 (the stored bytes or a host array). */
static int prefix_id(const uint8_t fingerprint[PD_SHA256_LEN], const void *tokens, int64_t n, const char *spec,
                     size_t spec_len, const char *ns, size_t ns_len, pd_prefix_id *out, pd_error *err) {
    pd_sha256 h;
    int rc = pd_sha256_init(&h, err);
    if (rc) {
        memset(out, 0, sizeof *out);
        return rc;
    }
    uint8_t v[4];
    cache_wr_u32(v, PD_STORE_FORMAT_VERSION);
    pd_sha256_update(&h, v, sizeof v);
    sha_u64(&h, PD_SHA256_LEN);
    pd_sha256_update(&h, fingerprint, PD_SHA256_LEN);
    sha_u64(&h, (uint64_t)n);
    pd_sha256_update(&h, tokens, (size_t)n * sizeof(pd_token));
    sha_u64(&h, spec_len);
    pd_sha256_update(&h, spec, spec_len);
    sha_u64(&h, ns_len);
    pd_sha256_update(&h, ns, ns_len);
    pd_sha256_final(&h, out->b);
    return PD_OK;
}

int pd_prefix_id_compute(const uint8_t fingerprint[PD_SHA256_LEN], const pd_token *tokens, int64_t n,
                         const char *spec, const char *ns, pd_prefix_id *out) {
    if (!spec) spec = "";
    if (!ns) ns = "";
    if (n < 0) n = 0;
    return prefix_id(fingerprint, tokens, n, spec, strlen(spec), ns, strlen(ns), out, NULL);
}

void pd_prefix_id_hex(const pd_prefix_id *id, char out[PD_PREFIX_ID_HEX]) { pd_hex(id->b, PD_PREFIX_ID_LEN, out); }

static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

int pd_prefix_id_parse(const char *hex, pd_prefix_id *out, pd_error *err) {
    if (!hex) return pd_errorf(err, PD_EINVAL, "prefix id is missing");
    size_t len = strlen(hex);
    if (len != 2 * PD_PREFIX_ID_LEN)
        return pd_errorf(err, PD_EINVAL, "prefix id '%.80s' has %zu characters; expected %d hex digits", hex, len,
                         2 * PD_PREFIX_ID_LEN);
    for (size_t i = 0; i < PD_PREFIX_ID_LEN; i++) {
        int hi = hex_digit(hex[2 * i]), lo = hex_digit(hex[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return pd_errorf(err, PD_EINVAL, "prefix id '%s' is not hexadecimal (at character %zu)", hex,
                             hi < 0 ? 2 * i + 1 : 2 * i + 2);
        out->b[i] = (uint8_t)(hi << 4 | lo);
    }
    return PD_OK;
}

/* ---- dtypes -------------------------------------------------------------- */

const char *pd_kv_dtype_name(pd_kv_dtype t) {
    switch (t) {
    case PD_KV_F32: return "f32";
    case PD_KV_F16: return "f16";
    case PD_KV_BF16: return "bf16";
    }
    return "?";
}

bool pd_kv_dtype_from_name(const char *name, pd_kv_dtype *out) {
    static const pd_kv_dtype all[] = {PD_KV_F32, PD_KV_F16, PD_KV_BF16};
    if (!name) return false;
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (strcmp(name, pd_kv_dtype_name(all[i])) == 0) {
            *out = all[i];
            return true;
        }
    return false;
}

size_t cache_dtype_size(pd_kv_dtype t) { return t == PD_KV_F32 ? 4 : 2; }


/* ---- header ------------------------------------------------------------- */

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* Offsets of the variable part; 0 on overflow of the u32 length field. */
static uint64_t header_layout(uint64_t spec_len, uint64_t ns_len, uint64_t n_streams, uint64_t n_tokens,
                              uint64_t *off_kept, uint64_t *off_tokens) {
    uint64_t kept_bytes, tok_bytes, total;
    /* Every factor is bounded well below 2^32, so these cannot overflow u64. */
    *off_kept = align_up(CACHE_HEADER_FIXED + spec_len + ns_len, 4);
    kept_bytes = n_streams * 4;
    tok_bytes = n_tokens * 4;
    *off_tokens = *off_kept + kept_bytes;
    total = *off_tokens + tok_bytes + 8;
    return total > UINT32_MAX ? 0 : total;
}

int cache_header_size(const cache_header *h, size_t *out, pd_error *err) {
    uint64_t ok, ot;
    uint64_t total = header_layout(h->spec_len, h->ns_len, (uint64_t)h->n_layer * (uint64_t)h->n_head_kv,
                                   (uint64_t)h->n_tokens, &ok, &ot);
    if (!total)
        return pd_errorf(err, PD_ERANGE, "a prefix of %d tokens with %d x %d streams is too large for one record",
                         h->n_tokens, h->n_layer, h->n_head_kv);
    *out = (size_t)total;
    return PD_OK;
}

static void wr_f64(uint8_t *p, double d) { memcpy(p, &d, sizeof d); }
static double rd_f64(const uint8_t *p) {
    double d;
    memcpy(&d, p, sizeof d);
    return d;
}

void cache_header_write(uint8_t *dst, size_t size, const cache_header *h, const pd_kv_prefix *kv,
                        const pd_token *tokens) {
    uint64_t off_kept, off_tokens;
    header_layout(h->spec_len, h->ns_len, (uint64_t)h->n_layer * (uint64_t)h->n_head_kv, (uint64_t)h->n_tokens,
                  &off_kept, &off_tokens);
    memset(dst, 0, size);
    memcpy(dst, CACHE_HEADER_MAGIC, 8);
    cache_wr_u32(dst + 8, PD_STORE_FORMAT_VERSION);
    cache_wr_u32(dst + 12, (uint32_t)size);
    memcpy(dst + 16, h->fingerprint, PD_SHA256_LEN);
    cache_wr_u32(dst + 48, (uint32_t)h->n_layer);
    cache_wr_u32(dst + 52, (uint32_t)h->n_head_kv);
    cache_wr_u32(dst + 56, (uint32_t)h->head_dim);
    cache_wr_u32(dst + 60, (uint32_t)h->dtype);
    cache_wr_u32(dst + 64, (uint32_t)h->n_tokens);
    cache_wr_u32(dst + 68, (uint32_t)h->page_tokens);
    wr_f64(dst + 72, h->quality.retention);
    wr_f64(dst + 80, h->quality.tau);
    wr_f64(dst + 88, h->quality.nll_full);
    wr_f64(dst + 96, h->quality.nll_ratio);
    cache_wr_u64(dst + 104, (uint64_t)h->created_at);
    cache_wr_u32(dst + 112, h->spec_len);
    cache_wr_u32(dst + 116, h->ns_len);
    memcpy(dst + CACHE_HEADER_FIXED, h->spec, h->spec_len);
    memcpy(dst + CACHE_HEADER_FIXED + h->spec_len, h->ns, h->ns_len);
    for (int32_t l = 0; l < h->n_layer; l++)
        for (int32_t hd = 0; hd < h->n_head_kv; hd++)
            cache_wr_u32(dst + off_kept + 4 * ((uint64_t)l * (uint64_t)h->n_head_kv + (uint64_t)hd),
                         (uint32_t)pd_kv_prefix_stream(kv, l, hd, NULL, NULL, NULL));
    if (h->n_tokens) memcpy(dst + off_tokens, tokens, (size_t)h->n_tokens * sizeof(pd_token));
    cache_wr_u64(dst + size - 8, XXH3_64bits(dst, size - 8));
}

static bool has_nul(const char *s, uint32_t n) { return memchr(s, '\0', n) != NULL; }

int cache_header_decode(const void *val, size_t size, const pd_prefix_id *id, cache_header *out, pd_error *err) {
    const uint8_t *p = val;
    memset(out, 0, sizeof *out);
    if (size < CACHE_HEADER_FIXED + 8)
        return pd_errorf(err, PD_EFORMAT, "header is %zu bytes, shorter than the fixed part", size);
    if (memcmp(p, CACHE_HEADER_MAGIC, 8) != 0) return pd_errorf(err, PD_EFORMAT, "header has a bad magic");
    /* Check the checksum first: after it passes, the fields are what the
     * writer wrote and the range checks below only guard against bugs. */
    if (cache_rd_u64(p + size - 8) != XXH3_64bits(p, size - 8))
        return pd_errorf(err, PD_EFORMAT, "header fails its checksum");
    uint32_t version = cache_rd_u32(p + 8);
    if (version != PD_STORE_FORMAT_VERSION)
        return pd_errorf(err, PD_EFORMAT, "header has format version %" PRIu32 "; this build reads version %d",
                         version, PD_STORE_FORMAT_VERSION);
    if (cache_rd_u32(p + 12) != size)
        return pd_errorf(err, PD_EFORMAT, "header says it is %" PRIu32 " bytes but the value is %zu",
                         cache_rd_u32(p + 12), size);
    memcpy(out->fingerprint, p + 16, PD_SHA256_LEN);
    uint32_t nl = cache_rd_u32(p + 48), nh = cache_rd_u32(p + 52), hd = cache_rd_u32(p + 56);
    uint32_t dt = cache_rd_u32(p + 60), nt = cache_rd_u32(p + 64), pt = cache_rd_u32(p + 68);
    if (nl < 1 || nl > CACHE_MAX_LAYERS || nh < 1 || nh > CACHE_MAX_HEADS || hd < 1 || hd > CACHE_MAX_HEAD_DIM)
        return pd_errorf(err, PD_EFORMAT, "header has an invalid shape (%" PRIu32 " layers, %" PRIu32
                         " kv heads, head_dim %" PRIu32 ")", nl, nh, hd);
    if (dt > PD_KV_BF16) return pd_errorf(err, PD_EFORMAT, "header has an unknown dtype %" PRIu32, dt);
    if (nt < 1 || nt > INT32_MAX || pt < 1 || pt > INT32_MAX)
        return pd_errorf(err, PD_EFORMAT, "header has an invalid length %" PRIu32 " or page size %" PRIu32, nt, pt);
    out->n_layer = (int32_t)nl;
    out->n_head_kv = (int32_t)nh;
    out->head_dim = (int32_t)hd;
    out->dtype = (pd_kv_dtype)dt;
    out->n_tokens = (int32_t)nt;
    out->page_tokens = (int32_t)pt;
    out->quality.retention = rd_f64(p + 72);
    out->quality.tau = rd_f64(p + 80);
    out->quality.nll_full = rd_f64(p + 88);
    out->quality.nll_ratio = rd_f64(p + 96);
    out->created_at = (int64_t)cache_rd_u64(p + 104);
    out->spec_len = cache_rd_u32(p + 112);
    out->ns_len = cache_rd_u32(p + 116);
    if (out->spec_len >= PD_PREFIX_SPEC_MAX || out->ns_len >= PD_PREFIX_NS_MAX)
        return pd_errorf(err, PD_EFORMAT, "header has a spec of %" PRIu32 " or a namespace of %" PRIu32 " bytes",
                         out->spec_len, out->ns_len);
    uint64_t off_kept, off_tokens;
    uint64_t total = header_layout(out->spec_len, out->ns_len, (uint64_t)nl * nh, nt, &off_kept, &off_tokens);
    if (total != size)
        return pd_errorf(err, PD_EFORMAT, "header fields need %" PRIu64 " bytes but the value is %zu", total, size);
    out->spec = (const char *)p + CACHE_HEADER_FIXED;
    out->ns = out->spec + out->spec_len;
    if (has_nul(out->spec, out->spec_len) || has_nul(out->ns, out->ns_len))
        return pd_errorf(err, PD_EFORMAT, "header has a NUL byte inside its spec or namespace");
    out->kept = p + off_kept;
    out->tokens = p + off_tokens;
    out->size = size;
    for (uint64_t i = 0; i < (uint64_t)nl * nh; i++)
        if (cache_rd_u32(out->kept + 4 * i) > nt)
            return pd_errorf(err, PD_EFORMAT, "header keeps %" PRIu32 " rows of a %" PRIu32 "-token prefix",
                             cache_rd_u32(out->kept + 4 * i), nt);
    if (id) {
        /* A valid record stored under another id (a misdirected write) is
         * as wrong as a flipped byte. */
        pd_prefix_id got;
        int rc = prefix_id(out->fingerprint, out->tokens, nt, out->spec, out->spec_len, out->ns, out->ns_len, &got,
                           err);
        if (rc) return rc;
        if (memcmp(got.b, id->b, PD_PREFIX_ID_LEN) != 0)
            return pd_errorf(err, PD_EFORMAT, "header describes another prefix than its key");
    }
    return PD_OK;
}

uint32_t cache_header_kept(const cache_header *h, int32_t layer, int32_t head) {
    return cache_rd_u32(h->kept + 4 * ((uint64_t)layer * (uint64_t)h->n_head_kv + (uint64_t)head));
}

pd_token cache_header_token(const cache_header *h, int64_t i) { return (pd_token)cache_rd_u32(h->tokens + 4 * i); }

void cache_header_to_info(const cache_header *h, pd_prefix_info *info) {
    memcpy(info->fingerprint, h->fingerprint, PD_SHA256_LEN);
    memcpy(info->spec, h->spec, h->spec_len);
    info->spec[h->spec_len] = '\0';
    memcpy(info->ns, h->ns, h->ns_len);
    info->ns[h->ns_len] = '\0';
    info->n_layer = h->n_layer;
    info->n_head_kv = h->n_head_kv;
    info->head_dim = h->head_dim;
    info->dtype = h->dtype;
    info->n_tokens = h->n_tokens;
    int64_t kept = 0;
    for (int32_t l = 0; l < h->n_layer; l++)
        for (int32_t hd = 0; hd < h->n_head_kv; hd++) kept += cache_header_kept(h, l, hd);
    info->kept_rows = kept;
    info->quality = h->quality;
    info->created_at = h->created_at;
}

/* ---- streams ------------------------------------------------------------- */

typedef struct stream_layout {
    uint64_t n_pages, hdr_end, off_pos, off_k, off_v, total, row_bytes;
} stream_layout;

/* false on overflow (len and head_dim are range-checked by callers). */
static bool stream_layout_of(uint64_t len, uint64_t head_dim, pd_kv_dtype dtype, uint64_t page_tokens,
                             stream_layout *L) {
    L->n_pages = (len + page_tokens - 1) / page_tokens;
    L->row_bytes = head_dim * cache_dtype_size(dtype);
    uint64_t rows_bytes;
    if (!pd_mul_ok(len, L->row_bytes, &rows_bytes)) return false;
    L->hdr_end = CACHE_STREAM_FIXED + 8 * L->n_pages + 8;
    L->off_pos = align_up(L->hdr_end, CACHE_ALIGN);
    L->off_k = align_up(L->off_pos + 4 * len, CACHE_ALIGN);
    if (!pd_add_ok(L->off_k, rows_bytes, &L->off_v)) return false;
    L->off_v = align_up(L->off_v, CACHE_ALIGN);
    if (!pd_add_ok(L->off_v, rows_bytes, &L->total)) return false;
    return L->total <= SIZE_MAX;
}

int cache_stream_size(int64_t len, int32_t head_dim, pd_kv_dtype dtype, int32_t page_tokens, size_t *out,
                      pd_error *err) {
    stream_layout L;
    if (len < 0 || head_dim < 1 || page_tokens < 1 ||
        !stream_layout_of((uint64_t)len, (uint64_t)head_dim, dtype, (uint64_t)page_tokens, &L))
        return pd_errorf(err, PD_ERANGE, "a stream of %" PRId64 " rows of %d values is too large", len, head_dim);
    *out = (size_t)L.total;
    return PD_OK;
}

/* Page p covers rows [p * page_tokens, ...): positions, then K, then V,
 * chained through the seed so a page moved elsewhere fails too. */
static uint64_t page_checksum(const uint8_t *pos, const uint8_t *k, const uint8_t *v, uint64_t row_bytes,
                              uint64_t r0, uint64_t r1, uint64_t page) {
    uint64_t h = XXH3_64bits_withSeed(pos + 4 * r0, 4 * (r1 - r0), page);
    h = XXH3_64bits_withSeed(k + r0 * row_bytes, (r1 - r0) * row_bytes, h);
    return XXH3_64bits_withSeed(v + r0 * row_bytes, (r1 - r0) * row_bytes, h);
}

/* n values of a prefix's rows (src_type f32 or f16) as dtype into dst (only
 * 2-byte aligned: written through memcpy), through a small f32 buffer. */
static void convert_rows(uint8_t *dst, const void *src, pd_type src_type, uint64_t n, pd_kv_dtype dtype) {
    const size_t src_size = src_type == PD_TYPE_F16 ? 2 : 4, dst_size = cache_dtype_size(dtype);
    if ((src_type == PD_TYPE_F16 && dtype == PD_KV_F16) || (src_type == PD_TYPE_F32 && dtype == PD_KV_F32)) {
        memcpy(dst, src, n * src_size);
        return;
    }
    enum { CHUNK = 256 };
    float f[CHUNK];
    uint16_t h[CHUNK];
    for (uint64_t i0 = 0; i0 < n; i0 += CHUNK) {
        const size_t c = n - i0 < CHUNK ? (size_t)(n - i0) : CHUNK;
        if (src_type == PD_TYPE_F16)
            pd_fp16_to_fp32_row((const uint16_t *)src + i0, f, c);
        else
            memcpy(f, (const float *)src + i0, c * sizeof *f);
        if (dtype == PD_KV_F32) {
            memcpy(dst + i0 * dst_size, f, c * sizeof *f);
            continue;
        }
        if (dtype == PD_KV_F16)
            pd_fp32_to_fp16_row(f, h, c);
        else
            for (size_t i = 0; i < c; i++) h[i] = pd_fp32_to_bf16(f[i]);
        memcpy(dst + i0 * dst_size, h, c * sizeof *h);
    }
}

void cache_stream_write(uint8_t *dst, size_t size, const pd_kv_prefix *kv, int32_t layer, int32_t head,
                        int32_t head_dim, pd_kv_dtype dtype, int32_t page_tokens) {
    const int32_t *pos;
    const void *k, *v;
    uint64_t len = (uint64_t)pd_kv_prefix_stream(kv, layer, head, &pos, &k, &v);
    const pd_type src_type = pd_kv_prefix_type(kv);
    stream_layout L;
    stream_layout_of(len, (uint64_t)head_dim, dtype, (uint64_t)page_tokens, &L);
    memset(dst, 0, L.off_pos); /* header and padding; rows are written in full below */
    memcpy(dst, CACHE_STREAM_MAGIC, 8);
    cache_wr_u32(dst + 8, (uint32_t)layer);
    cache_wr_u32(dst + 12, (uint32_t)head);
    cache_wr_u32(dst + 16, (uint32_t)len);
    cache_wr_u32(dst + 20, (uint32_t)head_dim);
    cache_wr_u32(dst + 24, (uint32_t)dtype);
    cache_wr_u32(dst + 28, (uint32_t)page_tokens);
    cache_wr_u32(dst + 32, (uint32_t)L.n_pages);
    cache_wr_u64(dst + 40, L.off_pos);
    cache_wr_u64(dst + 48, L.off_k);
    cache_wr_u64(dst + 56, L.off_v);
    cache_wr_u64(dst + 64, L.total);
    uint8_t *dpos = dst + L.off_pos, *dk = dst + L.off_k, *dv = dst + L.off_v;
    /* Zero the gaps between the arrays so the value is deterministic. */
    memset(dpos + 4 * len, 0, L.off_k - L.off_pos - 4 * len);
    memset(dk + len * L.row_bytes, 0, L.off_v - L.off_k - len * L.row_bytes);
    if (len) {
        memcpy(dpos, pos, 4 * len);
        convert_rows(dk, k, src_type, len * (uint64_t)head_dim, dtype);
        convert_rows(dv, v, src_type, len * (uint64_t)head_dim, dtype);
    }
    for (uint64_t p = 0; p < L.n_pages; p++) {
        uint64_t r0 = p * (uint64_t)page_tokens, r1 = r0 + (uint64_t)page_tokens;
        if (r1 > len) r1 = len;
        cache_wr_u64(dst + CACHE_STREAM_FIXED + 8 * p, page_checksum(dpos, dk, dv, L.row_bytes, r0, r1, p));
    }
    cache_wr_u64(dst + L.hdr_end - 8, XXH3_64bits(dst, L.hdr_end - 8));
    (void)size;
}

int cache_stream_decode(const void *val, size_t size, const cache_header *h, int32_t layer, int32_t head,
                        cache_stream *out, pd_error *err) {
    const uint8_t *p = val;
    memset(out, 0, sizeof *out);
    uint64_t len = cache_header_kept(h, layer, head);
    stream_layout L;
    if (!stream_layout_of(len, (uint64_t)h->head_dim, h->dtype, (uint64_t)h->page_tokens, &L))
        return pd_errorf(err, PD_EFORMAT, "stream (layer %d, head %d) is too large", layer, head);
    if (size < CACHE_STREAM_FIXED + 8 || memcmp(p, CACHE_STREAM_MAGIC, 8) != 0)
        return pd_errorf(err, PD_EFORMAT, "stream (layer %d, head %d) has a bad magic or is truncated", layer, head);
    if (size != L.total || cache_rd_u64(p + 64) != L.total)
        return pd_errorf(err, PD_EFORMAT, "stream (layer %d, head %d) is %zu bytes; its header expects %" PRIu64,
                         layer, head, size, L.total);
    if (cache_rd_u64(p + L.hdr_end - 8) != XXH3_64bits(p, L.hdr_end - 8))
        return pd_errorf(err, PD_EFORMAT, "the header of stream (layer %d, head %d) fails its checksum", layer, head);
    if (cache_rd_u32(p + 8) != (uint32_t)layer || cache_rd_u32(p + 12) != (uint32_t)head ||
        cache_rd_u32(p + 16) != len || cache_rd_u32(p + 20) != (uint32_t)h->head_dim ||
        cache_rd_u32(p + 24) != (uint32_t)h->dtype || cache_rd_u32(p + 28) != (uint32_t)h->page_tokens ||
        cache_rd_u32(p + 32) != L.n_pages || cache_rd_u64(p + 40) != L.off_pos || cache_rd_u64(p + 48) != L.off_k ||
        cache_rd_u64(p + 56) != L.off_v)
        return pd_errorf(err, PD_EFORMAT, "stream (layer %d, head %d) does not match the record's header", layer,
                         head);
    /* The alignment gaps are written as zeros and no checksum covers them:
     * anything else there is corruption too. */
    const uint64_t gaps[3][2] = {{L.hdr_end, L.off_pos},
                                 {L.off_pos + 4 * len, L.off_k},
                                 {L.off_k + len * L.row_bytes, L.off_v}};
    for (int g = 0; g < 3; g++)
        for (uint64_t i = gaps[g][0]; i < gaps[g][1]; i++)
            if (p[i])
                return pd_errorf(err, PD_EFORMAT, "stream (layer %d, head %d) has non-zero padding at byte %" PRIu64,
                                 layer, head, i);
    const uint8_t *pos = p + L.off_pos, *k = p + L.off_k, *v = p + L.off_v;
    for (uint64_t pg = 0; pg < L.n_pages; pg++) {
        uint64_t r0 = pg * (uint64_t)h->page_tokens, r1 = r0 + (uint64_t)h->page_tokens;
        if (r1 > len) r1 = len;
        if (cache_rd_u64(p + CACHE_STREAM_FIXED + 8 * pg) != page_checksum(pos, k, v, L.row_bytes, r0, r1, pg))
            return pd_errorf(err, PD_EFORMAT, "page %" PRIu64 " of stream (layer %d, head %d) fails its checksum", pg,
                             layer, head);
    }
    out->len = (int32_t)len;
    out->pos = pos;
    out->k = k;
    out->v = v;
    out->size = size;
    return PD_OK;
}
