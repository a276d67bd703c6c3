/* Longest-prefix lookup. A stored prefix of n tokens is registered in the
 * "index" database under the hash chain at its last full block:
 *   h_0 = SHA-256("prefixd-lookup", fingerprint, ns)
 *   h_{i+1} = SHA-256(h_i, tokens of block i)   (PD_LOOKUP_BLOCK tokens each)
 * key = h_{floor(n / B)}. A request hashes its own blocks once (O(n)) and
 * probes the index from its longest block boundary down; every candidate
 * is checked against its verified header (model, namespace, spec, and the
 * tokens themselves), so a hash collision can never return a wrong prefix.
 * Cost: O(n) hashing plus one B-tree probe per block boundary, whatever the
 * number of stored prefixes (candidates under one key are the few prefixes
 * that share those blocks). */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache_internal.h"

#define CHAIN_TAG "prefixd-lookup"

static int chain_start(const uint8_t fingerprint[PD_SHA256_LEN], const char *ns, size_t ns_len,
                       uint8_t out[PD_SHA256_LEN], pd_error *err) {
    pd_sha256 h;
    int rc = pd_sha256_init(&h, err);
    if (rc) return rc;
    uint8_t len[4];
    cache_wr_u32(len, (uint32_t)ns_len);
    pd_sha256_update(&h, CHAIN_TAG, strlen(CHAIN_TAG));
    pd_sha256_update(&h, fingerprint, PD_SHA256_LEN);
    pd_sha256_update(&h, len, sizeof len);
    pd_sha256_update(&h, ns, ns_len);
    pd_sha256_final(&h, out);
    return PD_OK;
}

static int chain_next(const uint8_t prev[PD_SHA256_LEN], const pd_token *block, uint8_t out[PD_SHA256_LEN],
                      pd_error *err) {
    pd_sha256 h;
    int rc = pd_sha256_init(&h, err);
    if (rc) return rc;
    pd_sha256_update(&h, prev, PD_SHA256_LEN);
    pd_sha256_update(&h, block, PD_LOOKUP_BLOCK * sizeof *block); /* little-endian i32 on supported hosts */
    pd_sha256_final(&h, out);
    return PD_OK;
}

int cache_lookup_key(const uint8_t fingerprint[PD_SHA256_LEN], const char *ns, size_t ns_len, const pd_token *tokens,
                     int64_t n, uint8_t out[PD_SHA256_LEN], pd_error *err) {
    int rc = chain_start(fingerprint, ns, ns_len, out, err);
    for (int64_t b = 0; !rc && b < n / PD_LOOKUP_BLOCK; b++) {
        uint8_t prev[PD_SHA256_LEN];
        memcpy(prev, out, sizeof prev);
        rc = chain_next(prev, tokens + b * PD_LOOKUP_BLOCK, out, err);
    }
    return rc;
}

int cache_index_add(pd_store *s, MDB_txn *txn, const uint8_t key[PD_SHA256_LEN], const pd_prefix_id *id,
                    pd_error *err) {
    MDB_val k = {.mv_size = PD_SHA256_LEN, .mv_data = (void *)key};
    MDB_val v = {.mv_size = PD_PREFIX_ID_LEN, .mv_data = (void *)id->b};
    int rc = mdb_put(txn, s->index, &k, &v, MDB_NODUPDATA);
    return rc && rc != MDB_KEYEXIST ? cache_lmdb_error(s, rc, "updating the lookup index", err) : PD_OK;
}

int cache_index_del(pd_store *s, MDB_txn *txn, const uint8_t key[PD_SHA256_LEN], const pd_prefix_id *id,
                    pd_error *err) {
    MDB_val k = {.mv_size = PD_SHA256_LEN, .mv_data = (void *)key};
    MDB_val v = {.mv_size = PD_PREFIX_ID_LEN, .mv_data = (void *)id->b};
    int rc = mdb_del(txn, s->index, &k, &v);
    return rc && rc != MDB_NOTFOUND ? cache_lmdb_error(s, rc, "updating the lookup index", err) : PD_OK;
}

int pd_store_lookup_chain(const uint8_t fingerprint[PD_SHA256_LEN], const char *ns, const pd_token *tokens, int64_t n,
                          uint8_t (**out)[PD_SHA256_LEN], int64_t *n_keys, pd_error *err) {
    *out = NULL;
    *n_keys = 0;
    if (!ns) ns = "";
    const size_t ns_len = strnlen(ns, PD_PREFIX_NS_MAX);
    if (ns_len == PD_PREFIX_NS_MAX)
        return pd_errorf(err, PD_EINVAL, "namespace is longer than %d bytes", PD_PREFIX_NS_MAX - 1);
    if (n < 0 || (n > 0 && !tokens)) return pd_errorf(err, PD_EINVAL, "pd_store_lookup_chain: missing tokens");
    const int64_t nb = n / PD_LOOKUP_BLOCK;
    uint8_t(*chain)[PD_SHA256_LEN] = malloc((size_t)(nb + 1) * sizeof *chain);
    if (!chain) return pd_errorf(err, PD_ENOMEM, "out of memory hashing a request of %" PRId64 " tokens", n);
    int rc = chain_start(fingerprint, ns, ns_len, chain[0], err);
    for (int64_t b = 0; !rc && b < nb; b++) rc = chain_next(chain[b], tokens + b * PD_LOOKUP_BLOCK, chain[b + 1], err);
    if (rc) {
        free(chain);
        return rc;
    }
    *out = chain;
    *n_keys = nb + 1;
    return PD_OK;
}

/* Is the stored record `id` a prefix of tokens[0..n) for this model,
 * namespace and (when given) spec? Its header must verify. */
static bool candidate_matches(pd_store *s, MDB_txn *txn, const pd_prefix_id *id,
                              const uint8_t fingerprint[PD_SHA256_LEN], const char *ns, size_t ns_len,
                              const char *spec, const pd_token *tokens, int64_t n, cache_header *h) {
    MDB_val k = {.mv_size = PD_PREFIX_ID_LEN, .mv_data = (void *)id->b}, v;
    pd_error e;
    if (mdb_get(txn, s->records, &k, &v) != 0) return false;
    /* A candidate counts only when its header verifies: damaged records
     * are misses here and get reports the damage. */
    if (cache_header_decode(v.mv_data, v.mv_size, id, h, &e) != PD_OK) return false;
    if (memcmp(h->fingerprint, fingerprint, PD_SHA256_LEN) != 0 || h->ns_len != ns_len ||
        memcmp(h->ns, ns, ns_len) != 0 || h->n_tokens > n)
        return false;
    if (spec && (h->spec_len != strlen(spec) || memcmp(h->spec, spec, h->spec_len) != 0)) return false;
    for (int64_t i = 0; i < h->n_tokens; i++)
        if (cache_header_token(h, i) != tokens[i]) return false;
    return true;
}

int pd_store_lookup(pd_store *s, const uint8_t fingerprint[PD_SHA256_LEN], const char *ns, const char *spec,
                    const pd_token *tokens, int64_t n, pd_prefix_id *out, int32_t *matched, pd_error *err) {
    pd_error local;
    if (!err) err = &local;
    if (matched) *matched = 0;
    if (!s || !fingerprint || !out || (!tokens && n > 0))
        return pd_errorf(err, PD_EINVAL, "pd_store_lookup: missing argument");
    if (!ns) ns = "";
    size_t ns_len = strnlen(ns, PD_PREFIX_NS_MAX);
    if (ns_len == PD_PREFIX_NS_MAX)
        return pd_errorf(err, PD_EINVAL, "namespace is longer than %d bytes", PD_PREFIX_NS_MAX - 1);
    if (n < 1) return pd_errorf(err, PD_ENOTFOUND, "no stored prefix matches an empty request");
    if (n > INT32_MAX) n = INT32_MAX; /* no stored prefix is longer */

    uint8_t(*chain)[PD_SHA256_LEN];
    int64_t n_keys;
    int rc = pd_store_lookup_chain(fingerprint, ns, tokens, n, &chain, &n_keys, err);
    if (rc) return rc;
    const int64_t nb = n_keys - 1;

    MDB_txn *txn;
    int mrc = mdb_txn_begin(s->env, NULL, MDB_RDONLY, &txn);
    if (mrc) {
        free(chain);
        return cache_lmdb_error(s, mrc, "looking up a prefix", err);
    }
    MDB_cursor *c;
    if ((mrc = mdb_cursor_open(txn, s->index, &c)) != 0) {
        mdb_txn_abort(txn);
        free(chain);
        return cache_lmdb_error(s, mrc, "looking up a prefix", err);
    }
    bool found = false;
    pd_prefix_id best = {{0}};
    int32_t best_len = 0;
    int64_t best_created = 0;
    uint64_t best_stamp = 0;
    /* The first boundary (from the longest) with a match holds the longest
     * match: every prefix registered lower is shorter than this block. */
    for (int64_t b = nb; b >= 0 && !found && !rc; b--) {
        MDB_val k = {.mv_size = PD_SHA256_LEN, .mv_data = chain[b]}, v;
        for (mrc = mdb_cursor_get(c, &k, &v, MDB_SET); mrc == 0; mrc = mdb_cursor_get(c, &k, &v, MDB_NEXT_DUP)) {
            if (v.mv_size != PD_PREFIX_ID_LEN) continue;
            pd_prefix_id id;
            memcpy(id.b, v.mv_data, PD_PREFIX_ID_LEN);
            cache_header h;
            if (!candidate_matches(s, txn, &id, fingerprint, ns, ns_len, spec, tokens, n, &h)) continue;
            /* Longest wins; among equals the newest (created_at has whole
             * seconds, so the last-use stamp breaks ties within one). */
            uint64_t stamp = cache_meta_stamp(s, txn, &id);
            if (!found || h.n_tokens > best_len ||
                (h.n_tokens == best_len &&
                 (h.created_at > best_created || (h.created_at == best_created && stamp > best_stamp)))) {
                found = true;
                best = id;
                best_len = h.n_tokens;
                best_created = h.created_at;
                best_stamp = stamp;
            }
        }
        if (mrc != MDB_NOTFOUND) rc = cache_lmdb_error(s, mrc, "looking up a prefix", err);
    }
    mdb_cursor_close(c);
    mdb_txn_abort(txn);
    free(chain);
    if (rc) return rc;
    if (!found) return pd_errorf(err, PD_ENOTFOUND, "no stored prefix matches the first %" PRId64 " tokens", n);
    *out = best;
    if (matched) *matched = best_len;
    return PD_OK;
}
