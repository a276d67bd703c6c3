/* Salvage: copy every record of a damaged store whose checksums verify into
 * a new one.
 *
 * The damaged file is never mapped: a truncated data.mdb would fault on
 * every page past its end, and a damaged B-tree may not lead to the records
 * at all. Instead its pages are read with pread and every LMDB leaf node
 * whose key and value look like a record header (32-byte id, "PDKVHDR1") or
 * a stream (id + layer + head, "PDKVSTR1") is a candidate, inline or in
 * overflow pages. A record is kept when its header verifies and, for every
 * (layer, head), some candidate stream verifies against it (a freed page may
 * hold a stale copy; any copy that verifies is the same bytes, records being
 * immutable). The kept values go into a scratch store, and from there
 * through the ordinary get/put path into the new store, so each record is
 * verified once more and written with its index and totals as any put. Rows
 * keep their stored dtype: the scratch handle reads f16 records as f16 and
 * f32/bf16 ones as f32 (bf16 -> f32 -> bf16 is exact). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache/cache_internal.h"
#include "kernels/kernels.h"

/* LMDB 0.9's page and node layout (mdb.c): a 16-byte page header (pgno,
 * pad, flags, lower/upper or an overflow page count), node offsets from
 * byte 16; a node is data size (lo, hi), flags, key size, key, data. */
#define PG_HDR 16
#define PG_FLAGS 10
#define PG_LOWER 12
#define P_LEAF 0x02
#define P_LEAF2 0x20
#define P_SUBP 0x40
#define NODE_HDR 8
#define F_BIGDATA 0x01
#define F_SUBDATA 0x02
#define F_DUPDATA 0x04

typedef struct candidate {
    uint8_t key[CACHE_STREAM_KEY_LEN];
    uint8_t key_len;
    uint64_t off, len; /* the value's bytes in the file */
} candidate;

typedef struct candidates {
    candidate *v;
    size_t n, cap;
} candidates;

static int cand_add(candidates *c, const uint8_t *key, size_t klen, uint64_t off, uint64_t len, pd_error *err) {
    if (c->n == c->cap) {
        size_t cap = c->cap ? 2 * c->cap : 256;
        candidate *v = realloc(c->v, cap * sizeof *v);
        if (!v) return pd_errorf(err, PD_ENOMEM, "out of memory for salvage candidates");
        c->v = v;
        c->cap = cap;
    }
    candidate *x = &c->v[c->n++];
    memcpy(x->key, key, klen);
    x->key_len = (uint8_t)klen;
    x->off = off;
    x->len = len;
    return PD_OK;
}

static int cand_cmp(const void *a, const void *b) {
    const candidate *x = a, *y = b;
    if (x->key_len != y->key_len) return x->key_len < y->key_len ? -1 : 1;
    return memcmp(x->key, y->key, x->key_len);
}

/* Read len bytes at off; NULL (err set) on failure. */
static uint8_t *read_at(int fd, uint64_t off, uint64_t len, pd_error *err) {
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf) {
        pd_errorf(err, PD_ENOMEM, "out of memory reading %" PRIu64 " bytes", len);
        return NULL;
    }
    for (uint64_t done = 0; done < len;) {
        ssize_t n = pread(fd, buf + done, len - done, (off_t)(off + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            pd_errorf(err, PD_EIO, "reading the damaged data file: %s", n < 0 ? strerror(errno) : "unexpected end");
            free(buf);
            return NULL;
        }
        done += (uint64_t)n;
    }
    return buf;
}

/* Every leaf node of every page that looks like a header or a stream. */
static int scan_pages(int fd, uint64_t size, uint32_t psize, candidates *heads, candidates *streams, pd_error *err) {
    uint8_t *pg = malloc(psize);
    if (!pg) return pd_errorf(err, PD_ENOMEM, "out of memory for a page");
    int rc = PD_OK;
    const uint64_t n_pages = size / psize;
    for (uint64_t i = 2; i < n_pages && !rc; i++) { /* pages 0 and 1 are the metas */
        if (pread(fd, pg, psize, (off_t)(i * psize)) != (ssize_t)psize) continue;
        const uint16_t flags = (uint16_t)(pg[PG_FLAGS] | pg[PG_FLAGS + 1] << 8);
        if (cache_rd_u64(pg) != i || !(flags & P_LEAF) || (flags & (P_LEAF2 | P_SUBP))) continue;
        const uint16_t lower = (uint16_t)(pg[PG_LOWER] | pg[PG_LOWER + 1] << 8);
        if (lower < PG_HDR || lower > psize) continue;
        for (unsigned k = 0; k < (unsigned)(lower - PG_HDR) / 2 && !rc; k++) {
            const uint16_t at = (uint16_t)(pg[PG_HDR + 2 * k] | pg[PG_HDR + 2 * k + 1] << 8);
            if (at < PG_HDR || (uint32_t)at + NODE_HDR > psize) continue;
            const uint8_t *node = pg + at;
            const uint64_t dsize = (uint64_t)(node[0] | node[1] << 8) | (uint64_t)(node[2] | node[3] << 8) << 16;
            const uint16_t nflags = (uint16_t)(node[4] | node[5] << 8), ksize = (uint16_t)(node[6] | node[7] << 8);
            if (nflags & (F_SUBDATA | F_DUPDATA)) continue;
            if (ksize != PD_PREFIX_ID_LEN && ksize != CACHE_STREAM_KEY_LEN) continue;
            if ((uint32_t)at + NODE_HDR + ksize + (nflags & F_BIGDATA ? 8u : 0u) > psize) continue;
            const uint8_t *key = node + NODE_HDR;
            uint64_t voff;
            if (nflags & F_BIGDATA) {
                const uint64_t ov = cache_rd_u64(key + ksize);
                if (ov >= n_pages) continue; /* lost to truncation */
                voff = ov * psize + PG_HDR;
            } else {
                voff = i * psize + at + NODE_HDR + ksize;
            }
            if (dsize < 8 || voff + dsize > size) continue;
            uint8_t magic[8];
            if (pread(fd, magic, 8, (off_t)voff) != 8) continue;
            if (ksize == PD_PREFIX_ID_LEN && memcmp(magic, CACHE_HEADER_MAGIC, 8) == 0)
                rc = cand_add(heads, key, ksize, voff, dsize, err);
            else if (ksize == CACHE_STREAM_KEY_LEN && memcmp(magic, CACHE_STREAM_MAGIC, 8) == 0)
                rc = cand_add(streams, key, ksize, voff, dsize, err);
        }
    }
    free(pg);
    return rc;
}

typedef struct salvage_ctx {
    pd_store *scratch, *dst;
    pd_store_visit_fn fn;
    void *fn_ctx;
    pd_store_salvage_report *rep;
    pd_error *err; /* set on a failure that stops the salvage (the new store) */
    bool failed;   /* ... and then this is true */
} salvage_ctx;

static int report_dropped(salvage_ctx *c, const pd_prefix_id *id, const pd_prefix_info *info, const char *why) {
    c->rep->dropped++;
    return c->fn ? c->fn(c->fn_ctx, id, info, why) : 0;
}

/* Verify one header candidate and find a verifying stream for each of its
 * (layer, head); put them into the scratch store. PD_OK when kept, 1 when
 * the record is lost (why, and what the header says when it verified, in
 * *why / *info), a negative status for failures that stop the salvage. */
static int rebuild_record(salvage_ctx *c, int fd, const candidate *hc, const candidates *streams, MDB_txn *txn,
                          pd_error *why, pd_prefix_info *info, bool *have_info) {
    pd_prefix_id id;
    memcpy(id.b, hc->key, PD_PREFIX_ID_LEN);
    uint8_t *hv = read_at(fd, hc->off, hc->len, why);
    if (!hv) return 1;
    cache_header h;
    int rc = 1;
    size_t ns = 0;
    uint8_t **sv = NULL;
    size_t *slen = NULL;
    if (cache_header_decode(hv, hc->len, &id, &h, why) != PD_OK) goto done;
    memset(info, 0, sizeof *info);
    cache_header_to_info(&h, info);
    info->id = id;
    *have_info = true;
    ns = (size_t)h.n_layer * (size_t)h.n_head_kv;
    sv = calloc(ns, sizeof *sv);
    slen = calloc(ns, sizeof *slen);
    if (!sv || !slen) {
        rc = pd_errorf(c->err, PD_ENOMEM, "out of memory salvaging a record");
        goto done;
    }
    for (size_t si = 0; si < ns; si++) {
        const int32_t l = (int32_t)(si / (size_t)h.n_head_kv), hd = (int32_t)(si % (size_t)h.n_head_kv);
        candidate want = {.key_len = CACHE_STREAM_KEY_LEN};
        cache_stream_key(want.key, &id, l, hd);
        const candidate *hit = streams->n ? bsearch(&want, streams->v, streams->n, sizeof want, cand_cmp) : NULL;
        if (!hit) {
            pd_errorf(why, PD_EFORMAT, "stream (layer %d, head %d) is lost", l, hd);
            goto done;
        }
        while (hit > streams->v && cand_cmp(hit - 1, &want) == 0) hit--; /* the first copy */
        for (; hit < streams->v + streams->n && cand_cmp(hit, &want) == 0 && !sv[si]; hit++) {
            uint8_t *v = read_at(fd, hit->off, hit->len, why);
            cache_stream st;
            if (v && cache_stream_decode(v, hit->len, &h, l, hd, &st, why) == PD_OK) {
                sv[si] = v;
                slen[si] = hit->len;
            } else {
                free(v);
            }
        }
        if (!sv[si]) goto done;
    }
    MDB_val k = {PD_PREFIX_ID_LEN, id.b}, v = {hc->len, hv};
    int mrc = mdb_put(txn, c->scratch->records, &k, &v, 0);
    for (size_t i = 0; !mrc && i < ns; i++) {
        uint8_t key[CACHE_STREAM_KEY_LEN];
        cache_stream_key(key, &id, (int32_t)(i / (size_t)h.n_head_kv), (int32_t)(i % (size_t)h.n_head_kv));
        MDB_val sk = {CACHE_STREAM_KEY_LEN, key}, svv = {slen[i], sv[i]};
        mrc = mdb_put(txn, c->scratch->streams, &sk, &svv, 0);
    }
    rc = mrc ? cache_lmdb_error(c->scratch, mrc, "writing the salvage scratch store", c->err) : PD_OK;
done:
    for (size_t i = 0; sv && i < ns; i++) free(sv[i]);
    free(sv);
    free(slen);
    free(hv);
    if (rc < 0) c->failed = true;
    return rc;
}

/* Scratch -> new store, through get (verify) and put. */
static int copy_one(void *p, const pd_prefix_id *id, const pd_prefix_info *info, const char *why) {
    salvage_ctx *c = p;
    if (!info) return report_dropped(c, id, NULL, why);
    c->scratch->opts.kv_type = info->dtype == PD_KV_F16 ? PD_TYPE_F16 : PD_TYPE_F32;
    pd_prefix_ref *ref = NULL;
    pd_error e;
    int rc = pd_store_get(c->scratch, id, &ref, &e);
    if (rc == PD_EFORMAT || rc == PD_ENOTFOUND) return report_dropped(c, id, info, e.msg);
    if (rc) { /* not damage: the salvage itself cannot go on */
        *c->err = e;
        c->failed = true;
        return rc;
    }
    const pd_prefix_info *ri = pd_prefix_ref_info(ref);
    pd_prefix_info out = *ri;
    rc = pd_store_put(c->dst, &out, pd_prefix_ref_tokens(ref), ri->n_tokens, pd_prefix_ref_kv(ref), NULL, c->err);
    pd_prefix_ref_release(ref);
    if (rc) {
        c->failed = true;
        return rc;
    }
    c->rep->copied++;
    c->rep->bytes += out.bytes;
    return 0;
}

static void remove_scratch(const char *dir) {
    char p[4096];
    snprintf(p, sizeof p, "%s/data.mdb", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/lock.mdb", dir);
    unlink(p);
    rmdir(dir);
}

int pd_store_salvage(const char *src_dir, const pd_store_opts *dst_opts, pd_store_visit_fn fn, void *ctx,
                     pd_store_salvage_report *out, pd_error *err) {
    pd_error local;
    if (!err) err = &local; /* internal code always has somewhere to write */
    pd_store_salvage_report rep = {0};
    if (out) *out = rep;
    if (!src_dir || !dst_opts || !dst_opts->dir)
        return pd_errorf(err, PD_EINVAL, "salvage needs a source directory and a new store directory");
    char path[4096], scratch[4096] = "";
    struct stat st;
    snprintf(path, sizeof path, "%s/data.mdb", dst_opts->dir);
    if (stat(path, &st) == 0)
        return pd_errorf(err, PD_EINVAL, "%s already holds a store; salvage writes into a new, empty directory",
                         dst_opts->dir);
    snprintf(path, sizeof path, "%s/data.mdb", src_dir);
    uint64_t size, needed;
    uint32_t psize;
    int rc = cache_data_file_check(path, &size, &needed, &psize, err);
    /* The scratch and the new store hold at most what the file holds. */
    pd_store_opts dopts = *dst_opts;
    if (dopts.map_size < needed + (64u << 20)) dopts.map_size = needed + (64u << 20);
    dst_opts = &dopts;
    if (rc) return pd_error_prefix(err, "salvage: nothing can be read from the store");
    if (size < needed) {
        rep.truncated = true;
        rep.missing_bytes = needed - size;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return pd_errorf(err, PD_EIO, "cannot open %s: %s", path, strerror(errno));
    candidates heads = {0}, streams = {0};
    pd_store *scratch_store = NULL, *dst = NULL;
    salvage_ctx c = {.fn = fn, .fn_ctx = ctx, .rep = &rep, .err = err};
    if ((rc = scan_pages(fd, size, psize, &heads, &streams, err))) goto done;
    if (heads.n > 1) qsort(heads.v, heads.n, sizeof *heads.v, cand_cmp);
    if (streams.n > 1) qsort(streams.v, streams.n, sizeof *streams.v, cand_cmp);

    snprintf(scratch, sizeof scratch, "%s.salvage-XXXXXX", dst_opts->dir);
    if (!mkdtemp(scratch)) {
        scratch[0] = '\0';
        rc = pd_errorf(err, PD_EIO, "cannot create a scratch directory next to %s: %s", dst_opts->dir, strerror(errno));
        goto done;
    }
    pd_store_opts so = *dst_opts;
    so.dir = scratch;
    so.max_bytes = 0;
    so.read_only = false;
    if ((rc = pd_store_open(&so, &scratch_store, err))) goto done;
    c.scratch = scratch_store;
    MDB_txn *txn;
    int mrc = mdb_txn_begin(scratch_store->env, NULL, 0, &txn);
    if (mrc) {
        rc = cache_lmdb_error(scratch_store, mrc, "writing the salvage scratch store", err);
        goto done;
    }
    /* Copies of one record (stale ones in freed pages) are tried in turn. */
    for (size_t i = 0, j; i < heads.n && !rc; i = j) {
        for (j = i + 1; j < heads.n && cand_cmp(&heads.v[i], &heads.v[j]) == 0; j++) {}
        rep.checked++;
        pd_error why = {0};
        pd_prefix_info info;
        bool have_info = false;
        int r = 1;
        for (size_t k = i; k < j && r == 1; k++) r = rebuild_record(&c, fd, &heads.v[k], &streams, txn, &why, &info, &have_info);
        if (r < 0) rc = r;
        else if (r == 1) {
            pd_prefix_id id;
            memcpy(id.b, heads.v[i].key, PD_PREFIX_ID_LEN);
            rc = report_dropped(&c, &id, have_info ? &info : NULL, why.msg);
        }
    }
    if (rc) {
        mdb_txn_abort(txn);
        goto done;
    }
    if ((mrc = mdb_txn_commit(txn))) {
        rc = cache_lmdb_error(scratch_store, mrc, "writing the salvage scratch store", err);
        goto done;
    }
    if ((rc = pd_store_open(dst_opts, &dst, err))) goto done;
    c.dst = dst;
    pd_error walk;
    rc = pd_store_list(scratch_store, copy_one, &c, &walk);
    if (rc && !c.failed) *err = walk;
done:
    pd_store_close(dst);
    pd_store_close(scratch_store);
    if (scratch[0]) remove_scratch(scratch);
    close(fd);
    free(heads.v);
    free(streams.v);
    if (out) *out = rep;
    return rc;
}
