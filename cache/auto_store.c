/* Automatic blocks in the LMDB store (cache.auto_persist): one database,
 * "auto", with the records, their stamps, their LRU order and their totals
 * under one-letter key kinds (cache_internal.h, docs/store.md). Kept apart
 * from registered prefixes' databases and totals so that neither's
 * eviction, listing or size limit sees the other's entries.
 *
 * A record: magic "PDAUTOB1", u32 version, u32 kv_type, u64 payload bytes,
 * the parent key, the 16 token ids (i32), the payload (the engine's token
 * block, uncompressed), then XXH3-64 of everything before it. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "cache/cache_internal.h"

#define KEY_B_LEN (1 + PD_SHA256_LEN)
#define KEY_L_LEN (1 + 8 + PD_SHA256_LEN)

static void key_of(uint8_t *out, char kind, const uint8_t key[PD_SHA256_LEN]) {
    out[0] = (uint8_t)kind;
    memcpy(out + 1, key, PD_SHA256_LEN);
}

static void lru_key_of(uint8_t out[KEY_L_LEN], uint64_t stamp, const uint8_t key[PD_SHA256_LEN]) {
    out[0] = 'l';
    cache_wr_be64(out + 1, stamp);
    memcpy(out + 9, key, PD_SHA256_LEN);
}

static int no_auto_db(pd_store *s, pd_error *err) {
    return pd_errorf(err, PD_ENOTFOUND, "the prefix store in %s holds no automatic blocks", s->dir);
}

int cache_auto_begin(pd_store *s, bool write, MDB_txn **txn, pd_error *err) {
    if (write && (s->opts.read_only || !s->has_auto))
        return pd_errorf(err, PD_EINVAL, "the prefix store in %s is open read-only; open it writable to change it",
                         s->dir);
    int rc = mdb_txn_begin(s->env, NULL, write ? 0 : MDB_RDONLY, txn);
    return rc ? cache_lmdb_error(s, rc, "starting a transaction", err) : PD_OK;
}

int cache_auto_commit(pd_store *s, MDB_txn *txn, pd_error *err) {
    int rc = mdb_txn_commit(txn);
    return rc ? cache_lmdb_error(s, rc, "committing a write transaction", err) : PD_OK;
}

int cache_auto_totals_get(pd_store *s, MDB_txn *txn, cache_auto_totals *t, pd_error *err) {
    *t = (cache_auto_totals){0};
    if (!s->has_auto) return PD_OK;
    MDB_val k = cache_mval("t", 1), v;
    int rc = mdb_get(txn, s->autob, &k, &v);
    if (rc == MDB_NOTFOUND) return PD_OK;
    if (rc) return cache_lmdb_error(s, rc, "reading the automatic blocks' totals", err);
    if (v.mv_size != 16)
        return pd_errorf(err, PD_EFORMAT, "the automatic blocks' totals in %s are malformed; run `prefixctl store "
                                          "verify --repair`", s->dir);
    t->blocks = cache_rd_u64(v.mv_data);
    t->bytes = cache_rd_u64((const uint8_t *)v.mv_data + 8);
    return PD_OK;
}

int cache_auto_totals_put(pd_store *s, MDB_txn *txn, const cache_auto_totals *t, pd_error *err) {
    uint8_t b[16];
    cache_wr_u64(b, t->blocks);
    cache_wr_u64(b + 8, t->bytes);
    MDB_val k = cache_mval("t", 1), v = cache_mval(b, sizeof b);
    int rc = mdb_put(txn, s->autob, &k, &v, 0);
    return rc ? cache_lmdb_error(s, rc, "writing the automatic blocks' totals", err) : PD_OK;
}

/* Structure and checksum of a record value (not what it is compared to). */
static int check_value(const uint8_t *p, size_t size, pd_error *err) {
    if (size < CACHE_AUTO_FIXED + 8 || memcmp(p, CACHE_AUTO_MAGIC, 8) != 0)
        return pd_errorf(err, PD_EFORMAT, "not an automatic block record (%zu bytes)", size);
    if (cache_rd_u64(p + size - 8) != XXH3_64bits(p, size - 8))
        return pd_errorf(err, PD_EFORMAT, "automatic block fails its checksum");
    if (cache_rd_u32(p + 8) != CACHE_AUTO_VERSION)
        return pd_errorf(err, PD_EFORMAT, "automatic block of version %" PRIu32 ", this build reads %u",
                         cache_rd_u32(p + 8), CACHE_AUTO_VERSION);
    if (cache_rd_u64(p + 16) != size - CACHE_AUTO_FIXED - 8)
        return pd_errorf(err, PD_EFORMAT, "automatic block's payload length disagrees with its size");
    return PD_OK;
}

static uint64_t stamp_of(pd_store *s, MDB_txn *txn, const uint8_t key[PD_SHA256_LEN], bool *found) {
    uint8_t sk[KEY_B_LEN];
    key_of(sk, 's', key);
    MDB_val k = cache_mval(sk, sizeof sk), v;
    *found = mdb_get(txn, s->autob, &k, &v) == 0 && v.mv_size == 8;
    return *found ? cache_rd_u64(v.mv_data) : 0;
}

int cache_auto_read(pd_store *s, MDB_txn *txn, const uint8_t key[PD_SHA256_LEN], const uint8_t parent[PD_SHA256_LEN],
                    const pd_token *tokens, int kv_type, void *payload, size_t payload_bytes, uint64_t *stamp,
                    pd_error *err) {
    if (!s->has_auto) return no_auto_db(s, err);
    uint8_t bk[KEY_B_LEN];
    key_of(bk, 'b', key);
    MDB_val k = cache_mval(bk, sizeof bk), v;
    int rc = mdb_get(txn, s->autob, &k, &v);
    if (rc == MDB_NOTFOUND) return pd_errorf(err, PD_ENOTFOUND, "automatic block not stored");
    if (rc) return cache_lmdb_error(s, rc, "reading an automatic block", err);
    const uint8_t *p = v.mv_data;
    if ((rc = check_value(p, v.mv_size, err))) return rc;
    if (cache_rd_u32(p + 12) != (uint32_t)kv_type || cache_rd_u64(p + 16) != payload_bytes)
        return pd_errorf(err, PD_EFORMAT, "automatic block of another KV type or block size");
    const uint8_t *tok = p + 24 + PD_SHA256_LEN;
    if (memcmp(p + 24, parent, PD_SHA256_LEN) != 0)
        return pd_errorf(err, PD_EFORMAT, "automatic block with another parent (a key collision)");
    for (int i = 0; i < CACHE_AUTO_TOKENS; i++)
        if ((pd_token)cache_rd_u32(tok + 4 * i) != tokens[i])
            return pd_errorf(err, PD_EFORMAT, "automatic block with other tokens (a key collision)");
    memcpy(payload, p + CACHE_AUTO_FIXED, payload_bytes);
    bool found;
    *stamp = stamp_of(s, txn, key, &found);
    return PD_OK;
}

/* Remove block key's record, stamp and LRU entry, keeping t current. */
static int remove_block(pd_store *s, MDB_txn *txn, const uint8_t key[PD_SHA256_LEN], cache_auto_totals *t,
                        pd_error *err) {
    uint8_t bk[KEY_B_LEN];
    key_of(bk, 'b', key);
    MDB_val k = cache_mval(bk, sizeof bk), v;
    int rc = mdb_get(txn, s->autob, &k, &v);
    if (rc == 0) {
        if (t->blocks) t->blocks--;
        t->bytes = t->bytes > v.mv_size ? t->bytes - v.mv_size : 0;
        rc = mdb_del(txn, s->autob, &k, NULL);
    }
    bool found;
    uint64_t old = stamp_of(s, txn, key, &found);
    if ((rc == 0 || rc == MDB_NOTFOUND) && found) {
        uint8_t lk[KEY_L_LEN], sk[KEY_B_LEN];
        lru_key_of(lk, old, key);
        key_of(sk, 's', key);
        MDB_val l = cache_mval(lk, sizeof lk), sv = cache_mval(sk, sizeof sk);
        rc = mdb_del(txn, s->autob, &l, NULL);
        if (rc == 0 || rc == MDB_NOTFOUND) rc = mdb_del(txn, s->autob, &sv, NULL);
    }
    return rc && rc != MDB_NOTFOUND ? cache_lmdb_error(s, rc, "deleting an automatic block", err) : PD_OK;
}

static int put_stamp(pd_store *s, MDB_txn *txn, const uint8_t key[PD_SHA256_LEN], uint64_t stamp, pd_error *err) {
    uint8_t sk[KEY_B_LEN], lk[KEY_L_LEN], sb[8];
    key_of(sk, 's', key);
    lru_key_of(lk, stamp, key);
    cache_wr_u64(sb, stamp);
    MDB_val k = cache_mval(sk, sizeof sk), v = cache_mval(sb, sizeof sb);
    int rc = mdb_put(txn, s->autob, &k, &v, 0);
    MDB_val l = cache_mval(lk, sizeof lk), e = cache_mval("", 0);
    if (!rc) rc = mdb_put(txn, s->autob, &l, &e, 0);
    return rc ? cache_lmdb_error(s, rc, "writing an automatic block's stamp", err) : PD_OK;
}

int cache_auto_write(pd_store *s, MDB_txn *txn, const uint8_t key[PD_SHA256_LEN], const uint8_t parent[PD_SHA256_LEN],
                     const pd_token *tokens, int kv_type, const void *payload, size_t payload_bytes, uint64_t stamp,
                     cache_auto_totals *t, pd_error *err) {
    if (!s->has_auto) return no_auto_db(s, err);
    int rc = remove_block(s, txn, key, t, err); /* a damaged or older copy */
    if (rc) return rc;
    const size_t size = CACHE_AUTO_FIXED + payload_bytes + 8;
    uint8_t bk[KEY_B_LEN];
    key_of(bk, 'b', key);
    MDB_val k = cache_mval(bk, sizeof bk), v = cache_mval(NULL, size);
    if ((rc = mdb_put(txn, s->autob, &k, &v, MDB_RESERVE)))
        return cache_lmdb_error(s, rc, "writing an automatic block", err);
    uint8_t *p = v.mv_data;
    memcpy(p, CACHE_AUTO_MAGIC, 8);
    cache_wr_u32(p + 8, CACHE_AUTO_VERSION);
    cache_wr_u32(p + 12, (uint32_t)kv_type);
    cache_wr_u64(p + 16, payload_bytes);
    memcpy(p + 24, parent, PD_SHA256_LEN);
    for (int i = 0; i < CACHE_AUTO_TOKENS; i++) cache_wr_u32(p + 24 + PD_SHA256_LEN + 4 * i, (uint32_t)tokens[i]);
    memcpy(p + CACHE_AUTO_FIXED, payload, payload_bytes);
    cache_wr_u64(p + size - 8, XXH3_64bits(p, size - 8));
    if ((rc = put_stamp(s, txn, key, stamp, err))) return rc;
    t->blocks++;
    t->bytes += size;
    return PD_OK;
}

int cache_auto_restamp(pd_store *s, MDB_txn *txn, const uint8_t key[PD_SHA256_LEN], uint64_t stamp, pd_error *err) {
    if (!s->has_auto) return no_auto_db(s, err);
    bool found;
    uint64_t old = stamp_of(s, txn, key, &found);
    if (!found) return pd_errorf(err, PD_ENOTFOUND, "automatic block not stored");
    uint8_t lk[KEY_L_LEN];
    lru_key_of(lk, old, key);
    MDB_val l = cache_mval(lk, sizeof lk);
    int rc = mdb_del(txn, s->autob, &l, NULL);
    if (rc && rc != MDB_NOTFOUND) return cache_lmdb_error(s, rc, "updating an automatic block's stamp", err);
    return put_stamp(s, txn, key, stamp, err);
}

int cache_auto_evict(pd_store *s, MDB_txn *txn, uint64_t max_bytes, cache_auto_totals *t, int64_t *n_evicted,
                     pd_error *err) {
    *n_evicted = 0;
    if (!s->has_auto) return PD_OK;
    int rc = PD_OK;
    while (!rc && t->bytes > max_bytes) {
        MDB_cursor *c;
        int mrc = mdb_cursor_open(txn, s->autob, &c);
        if (mrc) return cache_lmdb_error(s, mrc, "evicting automatic blocks", err);
        MDB_val k = cache_mval("l", 1), v;
        mrc = mdb_cursor_get(c, &k, &v, MDB_SET_RANGE);
        uint8_t key[PD_SHA256_LEN];
        bool take = mrc == 0 && k.mv_size == KEY_L_LEN && ((const uint8_t *)k.mv_data)[0] == 'l';
        if (take) memcpy(key, (const uint8_t *)k.mv_data + 9, sizeof key);
        mdb_cursor_close(c);
        if (mrc && mrc != MDB_NOTFOUND) return cache_lmdb_error(s, mrc, "evicting automatic blocks", err);
        if (!take) break; /* no LRU entries left: the totals are off (verify --repair recounts) */
        if (!(rc = remove_block(s, txn, key, t, err))) ++*n_evicted;
    }
    return rc;
}

int cache_auto_verify(pd_store *s, bool repair, pd_store_visit_fn fn, void *ctx, pd_store_verify_report *rep,
                      pd_error *err) {
    if (!s->has_auto) return PD_OK;
    MDB_txn *txn;
    int rc = cache_auto_begin(s, false, &txn, err);
    if (rc) return rc;
    uint8_t(*bad)[PD_SHA256_LEN] = NULL;
    size_t n_bad = 0, cap = 0;
    cache_auto_totals fresh = {0}, stored;
    MDB_cursor *c;
    int mrc = mdb_cursor_open(txn, s->autob, &c);
    if (mrc) {
        mdb_txn_abort(txn);
        return cache_lmdb_error(s, mrc, "verifying the automatic blocks", err);
    }
    MDB_val k = cache_mval("b", 1), v;
    for (mrc = mdb_cursor_get(c, &k, &v, MDB_SET_RANGE); !rc && mrc == 0; mrc = mdb_cursor_get(c, &k, &v, MDB_NEXT)) {
        const uint8_t *kp = k.mv_data;
        if (k.mv_size < 1 || kp[0] != 'b') break;
        rep->checked++;
        rep->auto_checked++;
        pd_error why = {0};
        pd_prefix_id id = {{0}};
        memcpy(id.b, kp + 1, k.mv_size == KEY_B_LEN ? PD_SHA256_LEN : 0);
        bool ok = k.mv_size == KEY_B_LEN && check_value(v.mv_data, v.mv_size, &why) == PD_OK;
        if (ok) {
            fresh.blocks++;
            fresh.bytes += v.mv_size;
            continue;
        }
        if (k.mv_size != KEY_B_LEN) snprintf(why.msg, sizeof why.msg, "malformed automatic block key");
        rep->corrupt++;
        if (fn) {
            char msg[sizeof why.msg + 32];
            snprintf(msg, sizeof msg, "automatic block: %s", why.msg);
            rc = fn(ctx, &id, NULL, msg);
        }
        if (n_bad == cap) {
            cap = cap ? 2 * cap : 16;
            void *nb = realloc(bad, cap * sizeof *bad);
            if (!nb) {
                rc = pd_errorf(err, PD_ENOMEM, "out of memory verifying the automatic blocks");
                break;
            }
            bad = nb;
        }
        memcpy(bad[n_bad++], id.b, PD_SHA256_LEN);
    }
    mdb_cursor_close(c);
    if (!rc && mrc && mrc != MDB_NOTFOUND) rc = cache_lmdb_error(s, mrc, "verifying the automatic blocks", err);
    pd_error e2;
    bool totals_wrong = !rc && (cache_auto_totals_get(s, txn, &stored, &e2) != PD_OK ||
                                stored.blocks != fresh.blocks || stored.bytes != fresh.bytes);
    mdb_txn_abort(txn);
    if (!rc && totals_wrong && !n_bad) {
        rep->corrupt++;
        if (fn) {
            pd_prefix_id zero = {{0}};
            rc = fn(ctx, &zero, NULL, "automatic blocks: the totals disagree with the records");
        }
    }
    if (!rc && repair && (n_bad || totals_wrong)) {
        MDB_txn *w;
        if (!(rc = cache_auto_begin(s, true, &w, err))) {
            cache_auto_totals ignore = {0};
            for (size_t i = 0; !rc && i < n_bad; i++) {
                /* a writer may have replaced it since the read pass */
                uint8_t bk[KEY_B_LEN];
                key_of(bk, 'b', bad[i]);
                MDB_val bkv = cache_mval(bk, sizeof bk), bv;
                pd_error why;
                if (mdb_get(w, s->autob, &bkv, &bv) == 0 && check_value(bv.mv_data, bv.mv_size, &why) == PD_OK)
                    continue;
                if (!(rc = remove_block(s, w, bad[i], &ignore, err))) rep->deleted++;
            }
            /* recount from what is left */
            cache_auto_totals t = {0};
            MDB_cursor *wc;
            if (!rc && (mrc = mdb_cursor_open(w, s->autob, &wc)) != 0)
                rc = cache_lmdb_error(s, mrc, "repairing the automatic blocks", err);
            else if (!rc) {
                MDB_val rk = cache_mval("b", 1), rv;
                for (mrc = mdb_cursor_get(wc, &rk, &rv, MDB_SET_RANGE); mrc == 0;
                     mrc = mdb_cursor_get(wc, &rk, &rv, MDB_NEXT)) {
                    if (rk.mv_size < 1 || ((const uint8_t *)rk.mv_data)[0] != 'b') break;
                    t.blocks++;
                    t.bytes += rv.mv_size;
                }
                mdb_cursor_close(wc);
                rc = cache_auto_totals_put(s, w, &t, err);
            }
            if (rc) mdb_txn_abort(w);
            else rc = cache_auto_commit(s, w, err);
        }
    }
    free(bad);
    return rc;
}
