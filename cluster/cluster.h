/* cluster: the shared tier. Several prefixd nodes share their registered
 * prefixes through one Redis server, so a prefix compressed on one node is
 * served by every node without being compressed again.
 *
 * A registered prefix's record is published to Redis as the transfer blob
 * of pd_store_export (the bytes the node's LMDB holds, each value with its
 * own checksum, the whole sealed by a SHA-256), split into chunks of at
 * most chunk_bytes, with an index that mirrors the store's lookup index
 * (the chained block hashes of pd_store_lookup_chain, which start from the
 * model fingerprint and namespace). A node whose local lookup misses asks
 * that index, fetches the record, verifies everything (pd_store_import)
 * and stores it in its own LMDB, so the next request is a local hit. Delete
 * and pin propagate: they change Redis, leave a tombstone and publish an
 * event that every node applies to its store and hot tier; a node that was
 * cut off applies the tombstones when it reconnects, and publishes the
 * records it registered meanwhile.
 *
 * Redis being down never fails a request: every call answers quickly
 * (PD_EUNAVAILABLE, one warning per outage in the log, stats.up false) and
 * serving goes on from the local store; Redis is tried again after retry_s.
 *
 * The Redis keys, under key_prefix (docs/deployment.md "Several nodes"):
 *   rec:ID         hash: bytes, chunks, sha256, n_tokens, tail, spec, ns,
 *                  fingerprint, lookup, created_at, pinned
 *   chunk:ID:I     the I-th piece of the blob
 *   idx:KEY        set of IDs whose lookup key is KEY
 *   ids:FP:NS      set of IDs per (model fingerprint, namespace)
 *   tomb:ID        a deleted ID (expires after tombstone_s)
 *   events         the pub/sub channel: "del:ID", "pin:ID:0|1"
 *
 * Thread safety: every call may come from any thread (a small pool of
 * connections); one thread of its own follows the events.
 *
 * The stack: daemon -> cluster -> cache -> engine -> kernels -> util.
 * This header is the folder's public contract. */
#ifndef PD_CLUSTER_H
#define PD_CLUSTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cache/cache.h"
#include "util/util.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum pd_cluster_role {
    PD_CLUSTER_MEMBER = 0, /* publishes its registrations and fetches the others' */
    PD_CLUSTER_PUBLISHER,  /* publishes only: a node that compresses for the others */
    PD_CLUSTER_CONSUMER,   /* fetches only: never writes records to Redis */
} pd_cluster_role;

typedef struct pd_cluster_opts {
    /* redis://[[USER]:PASSWORD@]HOST[:PORT][/DB] or unix:///PATH[?db=DB].
     * rediss:// (TLS) is refused: hiredis 0.14 has no TLS; run the tunnel
     * deploy/cluster/redis-tls-tunnel.cfg and point the URL at it. */
    const char *redis_url;
    const char *password;     /* NULL or "": the URL's, if any (AUTH) */
    const char *key_prefix;   /* every key and the channel start with it (default "prefixd:") */
    pd_cluster_role role;
    int timeout_ms;           /* connect and per-command timeout (default 250) */
    size_t chunk_bytes;       /* a record is split into values of at most this (default 64 MiB) */
    int tombstone_s;          /* how long a delete is remembered for nodes that were away (default 7 days) */
    double retry_s;           /* after a failure, Redis is left alone this long (default 1) */
    pd_store *store;          /* this node's store (not owned; required) */
    pd_hot *hot;              /* optional: invalidated when a delete arrives (not owned) */
    const pd_logger *logger;  /* optional: outages, rejected records (not owned) */
} pd_cluster_opts;

void pd_cluster_opts_default(pd_cluster_opts *o);

typedef struct pd_cluster pd_cluster;

/* Parses the URL (a bad one is PD_EINVAL naming the form) and starts the
 * event thread. Redis need not be up: that is an outage, not an error. */
int pd_cluster_create(const pd_cluster_opts *o, pd_cluster **out, pd_error *err);
void pd_cluster_free(pd_cluster *c);

/* Publish a stored prefix (after its registration). Already published with
 * the same bytes: nothing is sent again. A consumer: PD_OK, nothing done. */
int pd_cluster_publish(pd_cluster *c, const pd_prefix_id *id, pd_error *err);

/* After a local miss: the longest prefix of tokens[0..n) that the shared
 * index holds for this model fingerprint and namespace (and spec, when not
 * NULL) is fetched, verified and stored locally. PD_OK: the local lookup
 * now finds it. PD_ENOTFOUND: nothing shared matches. PD_EUNAVAILABLE:
 * Redis is down. A record that fails verification is not stored (counted
 * in stats.rejected, logged) and the next candidate is tried. A publisher
 * fetches nothing (PD_ENOTFOUND). */
int pd_cluster_fetch(pd_cluster *c, const uint8_t fingerprint[PD_SHA256_LEN], const char *ns, const char *spec,
                     const pd_token *tokens, int64_t n, pd_error *err);
/* The same for one id (a request's prefix_id, a registration that another
 * node already compressed). */
int pd_cluster_fetch_id(pd_cluster *c, const pd_prefix_id *id, pd_error *err);

/* Remove a prefix from the shared tier, remember the delete (tombstone) and
 * tell every node to drop it. *existed: Redis held it. Whatever the role. */
int pd_cluster_delete(pd_cluster *c, const pd_prefix_id *id, bool *existed, pd_error *err);
/* Pin or unpin it on every node that holds it. */
int pd_cluster_pin(pd_cluster *c, const pd_prefix_id *id, bool pinned, pd_error *err);

/* One prefix the shared tier holds, as its rec: hash describes it. */
typedef struct pd_cluster_entry {
    pd_prefix_id id;
    int32_t n_tokens;
    char spec[PD_PREFIX_SPEC_MAX];
    int64_t created_at;      /* unix seconds, when it was compressed */
    uint64_t bytes;          /* the transfer blob's size */
    bool pinned;
} pd_cluster_entry;

/* Every prefix the shared tier holds for this model fingerprint and
 * namespace (its ids:FP:NS index), in no particular order. A non-zero
 * return from fn stops the walk and is returned. */
typedef int (*pd_cluster_visit_fn)(void *ctx, const pd_cluster_entry *e);
int pd_cluster_list(pd_cluster *c, const uint8_t fingerprint[PD_SHA256_LEN], const char *ns, pd_cluster_visit_fn fn,
                    void *ctx, pd_error *err);

typedef struct pd_cluster_stats {
    bool up;                /* the last attempt to reach Redis succeeded */
    int64_t errors;         /* failed Redis calls (outages, error replies) */
    int64_t published;      /* records sent to Redis */
    int64_t fetched;        /* records fetched, verified and stored locally */
    int64_t misses;         /* fetches that found nothing shared */
    int64_t rejected;       /* fetched records that failed verification */
    int64_t invalidations;  /* deletes applied from other nodes' events or tombstones */
} pd_cluster_stats;

void pd_cluster_stats_get(pd_cluster *c, pd_cluster_stats *out);
const char *pd_cluster_role_name(pd_cluster_role r); /* "member", "publisher", "consumer" */

#ifdef __cplusplus
}
#endif
#endif
