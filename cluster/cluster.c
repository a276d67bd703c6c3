/* The shared tier on Redis (cluster.h). Connections come from a small pool;
 * a command that cannot reach Redis marks the tier down for retry_s, so an
 * outage costs a request nothing but the local store's answer. The event
 * thread holds its own connection in subscribe mode and reconciles (the
 * tombstones, the records registered while away) every time it
 * (re)subscribes. */
#include <errno.h>
#include <hiredis/hiredis.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cluster/cluster.h"

#define POOL_MAX 4
#define KEY_MAX 512
#define CANDIDATES_MAX 16 /* ids tried under one lookup key */

typedef enum tier_state { TIER_UNKNOWN = 0, TIER_UP, TIER_DOWN } tier_state;

struct pd_cluster {
    pd_cluster_opts o;
    char prefix[128];
    char host[256], unix_path[256], user[128], password[256];
    int port, db;
    char where[320]; /* the URL without its password, for messages */

    pthread_mutex_t mu; /* guards the pool and the tier state */
    /* One publish at a time (a registration and the reconnect's republish
     * may race): the check for the same bytes and the send are one step. */
    pthread_mutex_t publish_mu;
    pthread_cond_t cv;
    redisContext *idle[POOL_MAX];
    int n_idle, n_out;
    tier_state state;
    double down_until; /* pd_now_seconds(): no attempt before this */

    pthread_t events;
    bool events_started;
    int stop_pipe[2];

    atomic_llong errors, published, fetched, misses, rejected, invalidations;
};

void pd_cluster_opts_default(pd_cluster_opts *o) {
    memset(o, 0, sizeof *o);
    o->key_prefix = "prefixd:";
    o->role = PD_CLUSTER_MEMBER;
    o->timeout_ms = 250;
    o->chunk_bytes = (size_t)64 << 20;
    o->tombstone_s = 7 * 24 * 3600;
    o->retry_s = 1.0;
}

const char *pd_cluster_role_name(pd_cluster_role r) {
    switch (r) {
    case PD_CLUSTER_MEMBER: return "member";
    case PD_CLUSTER_PUBLISHER: return "publisher";
    case PD_CLUSTER_CONSUMER: return "consumer";
    }
    return "?";
}

/* ---- the URL ---------------------------------------------------------------- */

#define URL_FORMS "redis://[[USER]:PASSWORD@]HOST[:PORT][/DB] or unix:///PATH[?db=DB]"

static int parse_db(const char *s, int *db, pd_error *err) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (!*s || *end || errno || v < 0 || v > 65535)
        return pd_errorf(err, PD_EINVAL, "cluster.redis_url: the database \"%s\" is not a number (0..65535)", s);
    *db = (int)v;
    return PD_OK;
}

static int parse_url(pd_cluster *c, const char *url, pd_error *err) {
    c->port = 6379;
    if (strncmp(url, "rediss://", 9) == 0)
        return pd_errorf(err, PD_EUNSUPPORTED,
                         "cluster.redis_url: rediss:// (TLS) is not supported by this build's hiredis; run the TLS "
                         "tunnel deploy/cluster/redis-tls-tunnel.cfg on the node and give redis://127.0.0.1:PORT");
    if (strncmp(url, "unix://", 7) == 0) {
        const char *path = url + 7, *q = strchr(path, '?');
        const size_t len = q ? (size_t)(q - path) : strlen(path);
        if (len == 0 || path[0] != '/' || len >= sizeof c->unix_path)
            return pd_errorf(err, PD_EINVAL, "cluster.redis_url: write %s", URL_FORMS);
        memcpy(c->unix_path, path, len);
        if (q) {
            if (strncmp(q, "?db=", 4) != 0) return pd_errorf(err, PD_EINVAL, "cluster.redis_url: write %s", URL_FORMS);
            int rc = parse_db(q + 4, &c->db, err);
            if (rc) return rc;
        }
        snprintf(c->where, sizeof c->where, "unix://%s", c->unix_path);
        return PD_OK;
    }
    if (strncmp(url, "redis://", 8) != 0) return pd_errorf(err, PD_EINVAL, "cluster.redis_url: write %s", URL_FORMS);
    const char *p = url + 8, *at = strrchr(p, '@'), *slash;
    if (at) {
        const char *colon = memchr(p, ':', (size_t)(at - p));
        const char *user_end = colon ? colon : at;
        if ((size_t)(user_end - p) >= sizeof c->user) return pd_errorf(err, PD_EINVAL, "cluster.redis_url: user too long");
        memcpy(c->user, p, (size_t)(user_end - p));
        if (colon) {
            if ((size_t)(at - colon - 1) >= sizeof c->password)
                return pd_errorf(err, PD_EINVAL, "cluster.redis_url: password too long");
            memcpy(c->password, colon + 1, (size_t)(at - colon - 1));
        }
        p = at + 1;
    }
    slash = strchr(p, '/');
    const char *host_end = slash ? slash : p + strlen(p);
    const char *port = NULL;
    if (*p == '[') { /* [IPv6] */
        const char *close = memchr(p, ']', (size_t)(host_end - p));
        if (!close || close == p + 1) return pd_errorf(err, PD_EINVAL, "cluster.redis_url: write %s", URL_FORMS);
        if ((size_t)(close - p - 1) >= sizeof c->host) return pd_errorf(err, PD_EINVAL, "cluster.redis_url: host too long");
        memcpy(c->host, p + 1, (size_t)(close - p - 1));
        if (close + 1 < host_end) {
            if (close[1] != ':') return pd_errorf(err, PD_EINVAL, "cluster.redis_url: write %s", URL_FORMS);
            port = close + 2;
        }
    } else {
        const char *colon = memchr(p, ':', (size_t)(host_end - p));
        const char *name_end = colon ? colon : host_end;
        if (name_end == p) return pd_errorf(err, PD_EINVAL, "cluster.redis_url: no host; write %s", URL_FORMS);
        if ((size_t)(name_end - p) >= sizeof c->host) return pd_errorf(err, PD_EINVAL, "cluster.redis_url: host too long");
        memcpy(c->host, p, (size_t)(name_end - p));
        if (colon) port = colon + 1;
    }
    if (port) {
        char buf[16];
        const size_t len = (size_t)(host_end - port);
        char *end;
        if (len == 0 || len >= sizeof buf) return pd_errorf(err, PD_EINVAL, "cluster.redis_url: bad port");
        memcpy(buf, port, len);
        buf[len] = '\0';
        long v = strtol(buf, &end, 10);
        if (*end || v < 1 || v > 65535) return pd_errorf(err, PD_EINVAL, "cluster.redis_url: port \"%s\" is not 1..65535", buf);
        c->port = (int)v;
    }
    if (slash && slash[1]) {
        int rc = parse_db(slash + 1, &c->db, err);
        if (rc) return rc;
    }
    snprintf(c->where, sizeof c->where, "redis://%s%s%s:%d/%d", strchr(c->host, ':') ? "[" : "", c->host,
             strchr(c->host, ':') ? "]" : "", c->port, c->db);
    return PD_OK;
}

/* ---- the tier's state --------------------------------------------------------- */

static void mark_down(pd_cluster *c, const char *why) {
    atomic_fetch_add(&c->errors, 1);
    redisContext *stale[POOL_MAX];
    pthread_mutex_lock(&c->mu);
    const tier_state was = c->state;
    c->state = TIER_DOWN;
    c->down_until = pd_now_seconds() + c->o.retry_s;
    /* Idle connections predate the outage: a restarted Redis has closed
     * them, and the first command on each would fail again. */
    const int n_stale = c->n_idle;
    memcpy(stale, c->idle, sizeof(redisContext *) * (size_t)n_stale);
    c->n_idle = 0;
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < n_stale; i++) redisFree(stale[i]);
    if (was != TIER_DOWN)
        pd_log(c->o.logger, PD_LOG_WARN,
               "the shared tier at %s is unreachable (%s): serving from the local store only, retrying every %gs",
               c->where, why, c->o.retry_s);
}

static void mark_up(pd_cluster *c) {
    pthread_mutex_lock(&c->mu);
    const tier_state was = c->state;
    c->state = TIER_UP;
    pthread_mutex_unlock(&c->mu);
    if (was == TIER_DOWN)
        pd_log(c->o.logger, PD_LOG_INFO, "the shared tier at %s is reachable again", c->where);
    else if (was == TIER_UNKNOWN)
        pd_log(c->o.logger, PD_LOG_INFO, "connected to the shared tier at %s (role %s)", c->where,
               pd_cluster_role_name(c->o.role));
}

/* ---- connections --------------------------------------------------------------- */

static int unavailable(pd_cluster *c, const char *why, pd_error *err) {
    return pd_errorf(err, PD_EUNAVAILABLE, "the shared tier at %s is unavailable: %s", c->where, why);
}

/* A reply that must not be an error; false (and the error counted) when it is. */
static bool reply_ok(pd_cluster *c, const redisReply *r, pd_error *err) {
    if (r && r->type != REDIS_REPLY_ERROR) return true;
    atomic_fetch_add(&c->errors, 1);
    pd_errorf(err, PD_EIO, "the shared tier at %s answered an error: %s", c->where, r ? r->str : "no reply");
    return false;
}

static redisContext *conn_open(pd_cluster *c, pd_error *err) {
    const struct timeval tv = {c->o.timeout_ms / 1000, (c->o.timeout_ms % 1000) * 1000};
    redisContext *ctx = c->unix_path[0] ? redisConnectUnixWithTimeout(c->unix_path, tv)
                                        : redisConnectWithTimeout(c->host, c->port, tv);
    char why[256];
    if (!ctx || ctx->err) {
        snprintf(why, sizeof why, "%s", ctx ? ctx->errstr : "out of memory");
        goto fail;
    }
    if (redisSetTimeout(ctx, tv) != REDIS_OK) {
        snprintf(why, sizeof why, "cannot set the socket timeout");
        goto fail;
    }
    if (!c->unix_path[0]) (void)redisEnableKeepAlive(ctx);
    redisReply *r = NULL;
    if (c->password[0]) {
        r = c->user[0] ? redisCommand(ctx, "AUTH %s %s", c->user, c->password) : redisCommand(ctx, "AUTH %s", c->password);
        if (!r || r->type == REDIS_REPLY_ERROR) {
            snprintf(why, sizeof why, "AUTH failed (%s); check cluster.password or the URL's user and password",
                     r ? r->str : ctx->errstr);
            goto fail_reply;
        }
        freeReplyObject(r);
    }
    if (c->db) {
        r = redisCommand(ctx, "SELECT %d", c->db);
        if (!r || r->type == REDIS_REPLY_ERROR) {
            snprintf(why, sizeof why, "SELECT %d failed (%s)", c->db, r ? r->str : ctx->errstr);
            goto fail_reply;
        }
        freeReplyObject(r);
    }
    return ctx;
fail_reply:
    if (r) freeReplyObject(r);
fail:
    if (ctx) redisFree(ctx);
    mark_down(c, why);
    unavailable(c, why, err);
    return NULL;
}

/* A connection from the pool, or a new one; NULL (PD_EUNAVAILABLE) while
 * the tier is down. */
static redisContext *conn_get(pd_cluster *c, pd_error *err) {
    pthread_mutex_lock(&c->mu);
    if (c->state == TIER_DOWN && pd_now_seconds() < c->down_until) {
        pthread_mutex_unlock(&c->mu);
        unavailable(c, "it failed moments ago", err);
        return NULL;
    }
    while (c->n_idle == 0 && c->n_out >= POOL_MAX) pthread_cond_wait(&c->cv, &c->mu);
    c->n_out++;
    redisContext *ctx = c->n_idle ? c->idle[--c->n_idle] : NULL;
    pthread_mutex_unlock(&c->mu);
    if (!ctx && !(ctx = conn_open(c, err))) {
        pthread_mutex_lock(&c->mu);
        c->n_out--;
        pthread_cond_signal(&c->cv);
        pthread_mutex_unlock(&c->mu);
        return NULL;
    }
    return ctx;
}

/* Back to the pool; a connection that failed (ctx->err) is closed and the
 * tier marked down. */
static void conn_put(pd_cluster *c, redisContext *ctx) {
    if (!ctx) return;
    char why[160] = "";
    const bool broken = ctx->err != 0;
    if (broken) snprintf(why, sizeof why, "%s", ctx->errstr[0] ? ctx->errstr : "connection lost");
    pthread_mutex_lock(&c->mu);
    c->n_out--;
    if (!broken && c->n_idle < POOL_MAX) {
        c->idle[c->n_idle++] = ctx;
        ctx = NULL;
    }
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (ctx) redisFree(ctx);
    if (broken)
        mark_down(c, why);
    else
        mark_up(c);
}

/* Read n pipelined replies into r[]; false when the connection failed (the
 * replies read so far stay in r, the rest NULL). */
static bool read_replies(pd_cluster *c, redisContext *ctx, redisReply **r, size_t n, pd_error *err) {
    for (size_t i = 0; i < n; i++) r[i] = NULL;
    for (size_t i = 0; i < n; i++) {
        void *rep = NULL;
        if (redisGetReply(ctx, &rep) != REDIS_OK) {
            unavailable(c, ctx->errstr[0] ? ctx->errstr : "connection lost", err);
            return false;
        }
        r[i] = rep;
    }
    return true;
}

static void free_replies(redisReply **r, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (r[i]) freeReplyObject(r[i]);
}

/* ---- keys ---------------------------------------------------------------------------- */

static void key_of(const pd_cluster *c, char *out, const char *kind, const char *a, const char *b) {
    snprintf(out, KEY_MAX, "%s%s:%s%s%s", c->prefix, kind, a, b ? ":" : "", b ? b : "");
}

static void chunk_key(const pd_cluster *c, char *out, const char *idhex, size_t i) {
    snprintf(out, KEY_MAX, "%schunk:%s:%zu", c->prefix, idhex, i);
}

static void channel_of(const pd_cluster *c, char *out) { snprintf(out, KEY_MAX, "%sevents", c->prefix); }

/* ---- what a rec: hash says --------------------------------------------------------- */

#define REC_FIELDS "bytes chunks sha256 n_tokens tail spec created_at pinned"
enum { F_BYTES, F_CHUNKS, F_SHA, F_NTOK, F_TAIL, F_SPEC, F_CREATED, F_PINNED, N_FIELDS };

typedef struct rec_meta {
    pd_prefix_id id;
    uint64_t bytes, chunks;
    char sha[2 * PD_SHA256_LEN + 1];
    int32_t n_tokens, n_tail;
    pd_token tail[PD_LOOKUP_BLOCK];
    char spec[PD_PREFIX_SPEC_MAX];
    int64_t created_at;
    bool pinned;
} rec_meta;

static bool field_u64(const redisReply *f, uint64_t *out) {
    if (!f || f->type != REDIS_REPLY_STRING || f->len == 0 || f->len > 20) return false;
    char buf[24], *end;
    memcpy(buf, f->str, f->len);
    buf[f->len] = '\0';
    errno = 0;
    unsigned long long v = strtoull(buf, &end, 10);
    if (*end || errno) return false;
    *out = v;
    return true;
}

/* Decode an HMGET rec:ID REC_FIELDS reply; false for an absent or partial
 * hash (a record being deleted, or keys left by something else). */
static bool rec_meta_decode(const redisReply *r, rec_meta *m) {
    if (!r || r->type != REDIS_REPLY_ARRAY || r->elements != N_FIELDS) return false;
    uint64_t ntok, created, pinned;
    if (!field_u64(r->element[F_BYTES], &m->bytes) || !field_u64(r->element[F_CHUNKS], &m->chunks) ||
        !field_u64(r->element[F_NTOK], &ntok) || !field_u64(r->element[F_CREATED], &created) ||
        !field_u64(r->element[F_PINNED], &pinned))
        return false;
    const redisReply *sha = r->element[F_SHA], *tail = r->element[F_TAIL], *spec = r->element[F_SPEC];
    if (!sha || sha->type != REDIS_REPLY_STRING || sha->len != 2 * PD_SHA256_LEN) return false;
    if (!tail || tail->type != REDIS_REPLY_STRING || tail->len % sizeof(pd_token) ||
        tail->len / sizeof(pd_token) >= PD_LOOKUP_BLOCK)
        return false;
    if (!spec || spec->type != REDIS_REPLY_STRING || spec->len >= PD_PREFIX_SPEC_MAX) return false;
    if (ntok < 1 || ntok > INT32_MAX || m->chunks < 1 || m->bytes < m->chunks) return false;
    memcpy(m->sha, sha->str, sha->len);
    m->sha[sha->len] = '\0';
    m->n_tokens = (int32_t)ntok;
    m->n_tail = (int32_t)(tail->len / sizeof(pd_token));
    if (m->n_tail != m->n_tokens % PD_LOOKUP_BLOCK) return false;
    memcpy(m->tail, tail->str, tail->len);
    memcpy(m->spec, spec->str, spec->len);
    m->spec[spec->len] = '\0';
    m->created_at = (int64_t)created;
    m->pinned = pinned != 0;
    return true;
}

static int append_hmget(redisContext *ctx, const pd_cluster *c, const char *idhex) {
    char key[KEY_MAX];
    key_of(c, key, "rec", idhex, NULL);
    return redisAppendCommand(ctx, "HMGET %s " REC_FIELDS, key);
}

/* ---- publish ------------------------------------------------------------------------- */

static int publish_locked(pd_cluster *c, const pd_prefix_id *id, pd_error *err);

int pd_cluster_publish(pd_cluster *c, const pd_prefix_id *id, pd_error *err) {
    if (c->o.role == PD_CLUSTER_CONSUMER) return PD_OK;
    pthread_mutex_lock(&c->publish_mu);
    const int rc = publish_locked(c, id, err);
    pthread_mutex_unlock(&c->publish_mu);
    return rc;
}

static int publish_locked(pd_cluster *c, const pd_prefix_id *id, pd_error *err) {
    uint8_t *blob = NULL;
    size_t len = 0;
    pd_prefix_info info;
    pd_prefix_lookup_entry le;
    int rc = pd_store_export(c->o.store, id, &blob, &len, &info, err);
    if (!rc) rc = pd_store_lookup_entry(c->o.store, id, &le, err);
    uint8_t digest[PD_SHA256_LEN];
    if (!rc) rc = pd_sha256_buf(blob, len, digest, err);
    if (rc) {
        free(blob);
        return rc;
    }
    char idhex[PD_PREFIX_ID_HEX], sha[2 * PD_SHA256_LEN + 1], fp[2 * PD_SHA256_LEN + 1], lk[2 * PD_SHA256_LEN + 1];
    pd_prefix_id_hex(id, idhex);
    pd_hex(digest, PD_SHA256_LEN, sha);
    pd_hex(info.fingerprint, PD_SHA256_LEN, fp);
    pd_hex(le.key, PD_SHA256_LEN, lk);
    const size_t chunk = c->o.chunk_bytes, n_chunks = (len + chunk - 1) / chunk;
    char key[KEY_MAX], key2[KEY_MAX], key3[KEY_MAX];
    redisReply *r[4] = {0};
    redisReply **rs = NULL;
    redisContext *ctx = conn_get(c, err);
    if (!ctx) {
        free(blob);
        return err->code;
    }
    /* The same bytes already there (another node registered it too, or a
     * reconnect republishes): nothing to send. */
    key_of(c, key, "rec", idhex, NULL);
    r[0] = redisCommand(ctx, "HMGET %s sha256 chunks", key);
    if (!r[0]) {
        rc = unavailable(c, ctx->errstr, err);
        goto done;
    }
    if (!reply_ok(c, r[0], err)) {
        rc = err->code;
        goto done;
    }
    uint64_t old_chunks = 0;
    if (r[0]->type == REDIS_REPLY_ARRAY && r[0]->elements == 2) {
        const redisReply *s = r[0]->element[0];
        if (s->type == REDIS_REPLY_STRING && s->len == strlen(sha) && memcmp(s->str, sha, s->len) == 0) goto done;
        (void)field_u64(r[0]->element[1], &old_chunks);
    }
    /* Chunks first, then the hash and the index entries in one MULTI: a
     * reader that finds the id in the index finds its chunks. */
    key_of(c, key, "tomb", idhex, NULL);
    size_t n_cmds = 0;
    redisAppendCommand(ctx, "DEL %s", key), n_cmds++;
    for (size_t i = 0; i < n_chunks; i++) {
        chunk_key(c, key, idhex, i);
        const size_t off = i * chunk, clen = len - off < chunk ? len - off : chunk;
        redisAppendCommand(ctx, "SET %s %b", key, blob + off, clen), n_cmds++;
    }
    for (size_t i = n_chunks; i < old_chunks && i < n_chunks + 1024; i++) { /* left by a larger old version */
        chunk_key(c, key, idhex, i);
        redisAppendCommand(ctx, "DEL %s", key), n_cmds++;
    }
    key_of(c, key, "rec", idhex, NULL);
    key_of(c, key2, "idx", lk, NULL);
    key_of(c, key3, "ids", fp, info.ns);
    redisAppendCommand(ctx, "MULTI"), n_cmds++;
    redisAppendCommand(ctx,
                       "HSET %s bytes %llu chunks %llu sha256 %s n_tokens %d tail %b spec %s ns %s fingerprint %s "
                       "lookup %s created_at %lld pinned %d",
                       key, (unsigned long long)len, (unsigned long long)n_chunks, sha, info.n_tokens, (const void *)le.tail,
                       (size_t)le.n_tail * sizeof(pd_token), info.spec, info.ns, fp, lk, (long long)info.created_at,
                       info.pinned ? 1 : 0),
        n_cmds++;
    redisAppendCommand(ctx, "SADD %s %s", key2, idhex), n_cmds++;
    redisAppendCommand(ctx, "SADD %s %s", key3, idhex), n_cmds++;
    redisAppendCommand(ctx, "EXEC"), n_cmds++;
    if (!(rs = calloc(n_cmds, sizeof *rs))) {
        rc = pd_errorf(err, PD_ENOMEM, "out of memory publishing a prefix");
        ctx->err = REDIS_ERR_OOM; /* the replies are unread: do not reuse the connection */
        goto done;
    }
    if (!read_replies(c, ctx, rs, n_cmds, err)) {
        rc = err->code;
        goto done;
    }
    for (size_t i = 0; i < n_cmds && !rc; i++)
        if (!reply_ok(c, rs[i], err)) rc = err->code;
    const redisReply *exec = rs[n_cmds - 1];
    if (!rc && (exec->type != REDIS_REPLY_ARRAY || exec->elements != 3)) {
        atomic_fetch_add(&c->errors, 1);
        rc = pd_errorf(err, PD_EIO, "the shared tier at %s did not run the transaction that publishes prefix %s",
                       c->where, idhex);
    }
    for (size_t i = 0; !rc && i < 3; i++)
        if (!reply_ok(c, exec->element[i], err)) rc = err->code;
    if (!rc) atomic_fetch_add(&c->published, 1);
done:
    if (rs) {
        free_replies(rs, n_cmds);
        free(rs);
    }
    free_replies(r, 4);
    conn_put(c, ctx);
    free(blob);
    if (rc) pd_error_prefix(err, "publishing prefix %s", idhex);
    return rc;
}

/* ---- fetch --------------------------------------------------------------------------- */

/* Drop a prefix from this node: the store and the hot tier. */
static void drop_local(pd_cluster *c, const pd_prefix_id *id) {
    pd_error e;
    const int rc = pd_store_delete(c->o.store, id, &e);
    if (c->o.hot) pd_hot_invalidate(c->o.hot, id);
    if (rc == PD_OK) atomic_fetch_add(&c->invalidations, 1);
}

/* Fetch one record's chunks, verify and store it. PD_EFORMAT: it failed a
 * check (counted, logged; nothing stored). */
static int fetch_record(pd_cluster *c, redisContext *ctx, const rec_meta *m, pd_error *err) {
    char idhex[PD_PREFIX_ID_HEX], key[KEY_MAX];
    pd_prefix_id_hex(&m->id, idhex);
    /* The size comes from Redis: never allocate more than the local store
     * could hold anyway. */
    pd_store_stats ss;
    if (pd_store_stats_get(c->o.store, &ss, err)) return err->code;
    if (m->bytes > SIZE_MAX / 2 || m->bytes > ss.map_size || m->chunks > m->bytes) {
        atomic_fetch_add(&c->rejected, 1);
        pd_errorf(err, PD_EFORMAT, "prefix %s from the shared tier was not used: it claims %" PRIu64 " bytes in %" PRIu64
                  " chunks, more than this store's map of %" PRIu64 " bytes", idhex, m->bytes, m->chunks, ss.map_size);
        pd_log(c->o.logger, PD_LOG_WARN, "%s", err->msg);
        return PD_EFORMAT;
    }
    uint8_t *blob = malloc((size_t)m->bytes);
    redisReply **rs = calloc((size_t)m->chunks + 1, sizeof *rs);
    int rc = PD_OK;
    if (!blob || !rs) {
        free(blob);
        free(rs);
        return pd_errorf(err, PD_ENOMEM, "out of memory for prefix %s (%" PRIu64 " bytes)", idhex, m->bytes);
    }
    for (uint64_t i = 0; i < m->chunks; i++) {
        chunk_key(c, key, idhex, (size_t)i);
        redisAppendCommand(ctx, "GET %s", key);
    }
    key_of(c, key, "rec", idhex, NULL);
    if (!read_replies(c, ctx, rs, (size_t)m->chunks, err)) {
        rc = err->code;
        goto done;
    }
    size_t off = 0;
    for (uint64_t i = 0; i < m->chunks && !rc; i++) {
        const redisReply *r = rs[i];
        if (r->type != REDIS_REPLY_STRING || r->len > m->bytes - off)
            rc = pd_errorf(err, PD_EFORMAT, "chunk %" PRIu64 " is missing or too long", i);
        else {
            memcpy(blob + off, r->str, r->len);
            off += r->len;
        }
    }
    if (!rc && off != m->bytes) rc = pd_errorf(err, PD_EFORMAT, "its chunks hold %zu of %" PRIu64 " bytes", off, m->bytes);
    uint8_t digest[PD_SHA256_LEN];
    char sha[2 * PD_SHA256_LEN + 1];
    if (!rc && !(rc = pd_sha256_buf(blob, off, digest, err))) {
        pd_hex(digest, PD_SHA256_LEN, sha);
        if (strcmp(sha, m->sha) != 0) rc = pd_errorf(err, PD_EFORMAT, "its bytes do not match their SHA-256");
    }
    bool existed = false;
    if (!rc) rc = pd_store_import(c->o.store, blob, off, m->pinned, NULL, &existed, err);
    if (rc == PD_EFORMAT) {
        atomic_fetch_add(&c->rejected, 1);
        pd_error_prefix(err, "prefix %s from the shared tier was not used", idhex);
        pd_log(c->o.logger, PD_LOG_WARN, "%s", err->msg);
        goto done;
    }
    if (rc) goto done;
    /* Deleted while we fetched? The delete's event may have come before the
     * record was stored here; the hash is gone from Redis either way. */
    redisReply *ex = redisCommand(ctx, "EXISTS %s", key);
    if (!ex) {
        rc = unavailable(c, ctx->errstr, err);
    } else if (ex->type == REDIS_REPLY_INTEGER && ex->integer == 0) {
        if (!existed) drop_local(c, &m->id);
        rc = pd_errorf(err, PD_ENOTFOUND, "prefix %s was deleted while it was fetched", idhex);
    }
    if (ex) freeReplyObject(ex);
    if (!rc && !existed) atomic_fetch_add(&c->fetched, 1);
done:
    free_replies(rs, (size_t)m->chunks);
    free(rs);
    free(blob);
    return rc;
}

/* Already in this node's store: the local lookup passed it over (another
 * spec, or it does not continue the prompt), so fetching it again is waste. */
static bool held_here(pd_cluster *c, const pd_prefix_id *id) {
    pd_prefix_info info;
    pd_error e;
    return pd_store_info(c->o.store, id, &info, &e) == PD_OK;
}

int pd_cluster_fetch(pd_cluster *c, const uint8_t fingerprint[PD_SHA256_LEN], const char *ns, const char *spec,
                     const pd_token *tokens, int64_t n, pd_error *err) {
    if (c->o.role == PD_CLUSTER_PUBLISHER) return pd_errorf(err, PD_ENOTFOUND, "a publisher fetches nothing");
    if (n < 1) return pd_errorf(err, PD_ENOTFOUND, "nothing to look up");
    uint8_t(*chain)[PD_SHA256_LEN] = NULL;
    int64_t n_keys = 0;
    int rc = pd_store_lookup_chain(fingerprint, ns, tokens, n, &chain, &n_keys, err);
    if (rc) return rc;
    redisReply **sets = calloc((size_t)n_keys, sizeof *sets);
    if (!sets) {
        free(chain);
        return pd_errorf(err, PD_ENOMEM, "out of memory looking up the shared tier");
    }
    redisContext *ctx = conn_get(c, err);
    if (!ctx) {
        free(sets);
        free(chain);
        return err->code;
    }
    /* One round trip for every block boundary, longest first. */
    char key[KEY_MAX], hex[2 * PD_SHA256_LEN + 1];
    for (int64_t b = n_keys - 1; b >= 0; b--) {
        pd_hex(chain[b], PD_SHA256_LEN, hex);
        key_of(c, key, "idx", hex, NULL);
        redisAppendCommand(ctx, "SMEMBERS %s", key);
    }
    if (!read_replies(c, ctx, sets, (size_t)n_keys, err)) {
        rc = err->code;
        goto done;
    }
    rc = PD_ENOTFOUND;
    for (int64_t i = 0; i < n_keys && rc == PD_ENOTFOUND; i++) {
        const int64_t b = n_keys - 1 - i;
        const redisReply *set = sets[i];
        if (set->type != REDIS_REPLY_ARRAY || set->elements == 0) continue;
        rec_meta cand[CANDIDATES_MAX];
        redisReply *metas[CANDIDATES_MAX] = {0};
        size_t nc = 0;
        for (size_t e = 0; e < set->elements && nc < CANDIDATES_MAX; e++) {
            const redisReply *m = set->element[e];
            pd_error pe;
            char idhex[PD_PREFIX_ID_HEX];
            if (m->type != REDIS_REPLY_STRING || m->len != PD_PREFIX_ID_HEX - 1) continue;
            memcpy(idhex, m->str, m->len);
            idhex[m->len] = '\0';
            if (pd_prefix_id_parse(idhex, &cand[nc].id, &pe)) continue;
            append_hmget(ctx, c, idhex);
            nc++;
        }
        if (!read_replies(c, ctx, metas, nc, err)) {
            free_replies(metas, nc);
            rc = err->code;
            break;
        }
        /* The candidates that continue these tokens (the index key covers
         * whole blocks; the tail and the length are checked here), best
         * first: the longest, then the newest. */
        bool ok[CANDIDATES_MAX] = {0};
        for (size_t k = 0; k < nc; k++) {
            rec_meta *m = &cand[k];
            ok[k] = rec_meta_decode(metas[k], m) && m->n_tokens <= n && m->n_tokens / PD_LOOKUP_BLOCK == b &&
                    memcmp(m->tail, tokens + (int64_t)m->n_tokens - m->n_tail, (size_t)m->n_tail * sizeof(pd_token)) == 0 &&
                    (!spec || strcmp(spec, m->spec) == 0) && !held_here(c, &m->id);
        }
        free_replies(metas, nc);
        for (;;) {
            ssize_t best = -1;
            for (size_t k = 0; k < nc; k++)
                if (ok[k] && (best < 0 || cand[k].n_tokens > cand[best].n_tokens ||
                              (cand[k].n_tokens == cand[best].n_tokens && cand[k].created_at > cand[best].created_at)))
                    best = (ssize_t)k;
            if (best < 0) break;
            ok[best] = false;
            rc = fetch_record(c, ctx, &cand[best], err);
            if (rc == PD_EFORMAT || rc == PD_ENOTFOUND) {
                rc = PD_ENOTFOUND;
                continue;
            }
            break;
        }
    }
    if (rc == PD_ENOTFOUND) {
        atomic_fetch_add(&c->misses, 1);
        pd_errorf(err, PD_ENOTFOUND, "no prefix in the shared tier matches");
    }
done:
    free_replies(sets, (size_t)n_keys);
    free(sets);
    free(chain);
    conn_put(c, ctx);
    return rc;
}

int pd_cluster_fetch_id(pd_cluster *c, const pd_prefix_id *id, pd_error *err) {
    if (c->o.role == PD_CLUSTER_PUBLISHER) return pd_errorf(err, PD_ENOTFOUND, "a publisher fetches nothing");
    char idhex[PD_PREFIX_ID_HEX];
    pd_prefix_id_hex(id, idhex);
    if (held_here(c, id)) return pd_errorf(err, PD_ENOTFOUND, "prefix %s is in the local store already", idhex);
    redisContext *ctx = conn_get(c, err);
    if (!ctx) return err->code;
    redisReply *r = NULL;
    int rc;
    append_hmget(ctx, c, idhex);
    if (!read_replies(c, ctx, &r, 1, err)) {
        rc = err->code;
    } else {
        rec_meta m = {.id = *id};
        rc = rec_meta_decode(r, &m) ? fetch_record(c, ctx, &m, err)
                                    : pd_errorf(err, PD_ENOTFOUND, "prefix %s is not in the shared tier", idhex);
        if (rc == PD_EFORMAT) rc = PD_ENOTFOUND;
        if (rc == PD_ENOTFOUND) atomic_fetch_add(&c->misses, 1);
    }
    if (r) freeReplyObject(r);
    conn_put(c, ctx);
    return rc;
}

/* ---- delete, pin ---------------------------------------------------------------------- */

int pd_cluster_delete(pd_cluster *c, const pd_prefix_id *id, bool *existed, pd_error *err) {
    if (existed) *existed = false;
    char idhex[PD_PREFIX_ID_HEX], key[KEY_MAX], ch[KEY_MAX];
    pd_prefix_id_hex(id, idhex);
    key_of(c, key, "rec", idhex, NULL);
    channel_of(c, ch);
    redisContext *ctx = conn_get(c, err);
    if (!ctx) return err->code;
    int rc = PD_OK;
    redisReply *info = redisCommand(ctx, "HMGET %s chunks lookup fingerprint ns", key), **rs = NULL;
    size_t n_cmds = 0;
    if (!info) {
        rc = unavailable(c, ctx->errstr, err);
        goto done;
    }
    if (!reply_ok(c, info, err)) {
        rc = err->code;
        goto done;
    }
    if (info->type != REDIS_REPLY_ARRAY || info->elements != 4) {
        rc = pd_errorf(err, PD_EIO, "the shared tier at %s answered HMGET with something else than 4 values",
                       c->where);
        goto done;
    }
    uint64_t chunks = 0;
    const bool had = field_u64(info->element[0], &chunks);
    /* Everything in one MULTI, the event last: a node that hears it finds
     * the record gone from Redis already. */
    redisAppendCommand(ctx, "MULTI"), n_cmds++;
    redisAppendCommand(ctx, "DEL %s", key), n_cmds++;
    for (uint64_t i = 0; i < chunks && i < (1u << 20); i++) {
        char k[KEY_MAX];
        chunk_key(c, k, idhex, (size_t)i);
        redisAppendCommand(ctx, "DEL %s", k), n_cmds++;
    }
    const redisReply *lk = info->element[1], *fp = info->element[2], *ns = info->element[3];
    if (lk->type == REDIS_REPLY_STRING) {
        char k[KEY_MAX], v[2 * PD_SHA256_LEN + 1];
        snprintf(v, sizeof v, "%.*s", (int)lk->len, lk->str);
        key_of(c, k, "idx", v, NULL);
        redisAppendCommand(ctx, "SREM %s %s", k, idhex), n_cmds++;
    }
    if (fp->type == REDIS_REPLY_STRING && ns->type == REDIS_REPLY_STRING) {
        char k[KEY_MAX], f[2 * PD_SHA256_LEN + 1], s[PD_PREFIX_NS_MAX];
        snprintf(f, sizeof f, "%.*s", (int)fp->len, fp->str);
        snprintf(s, sizeof s, "%.*s", (int)ns->len, ns->str);
        key_of(c, k, "ids", f, s);
        redisAppendCommand(ctx, "SREM %s %s", k, idhex), n_cmds++;
    }
    key_of(c, key, "tomb", idhex, NULL);
    redisAppendCommand(ctx, "SET %s 1 EX %d", key, c->o.tombstone_s), n_cmds++;
    redisAppendCommand(ctx, "PUBLISH %s del:%s", ch, idhex), n_cmds++;
    redisAppendCommand(ctx, "EXEC"), n_cmds++;
    if (!(rs = calloc(n_cmds, sizeof *rs))) {
        ctx->err = REDIS_ERR_OOM; /* the replies are unread: do not reuse the connection */
        rc = pd_errorf(err, PD_ENOMEM, "out of memory deleting a prefix from the shared tier");
        goto done;
    }
    if (!read_replies(c, ctx, rs, n_cmds, err)) {
        rc = err->code;
        goto done;
    }
    for (size_t i = 0; i < n_cmds && !rc; i++)
        if (!reply_ok(c, rs[i], err)) rc = err->code;
    if (!rc && rs[n_cmds - 1]->type != REDIS_REPLY_ARRAY)
        rc = pd_errorf(err, PD_EIO, "the shared tier at %s did not run the delete of prefix %s", c->where, idhex);
    if (!rc && existed) *existed = had;
done:
    if (rs) {
        free_replies(rs, n_cmds);
        free(rs);
    }
    if (info) freeReplyObject(info);
    conn_put(c, ctx);
    if (rc) pd_error_prefix(err, "deleting prefix %s from the shared tier", idhex);
    return rc;
}

int pd_cluster_pin(pd_cluster *c, const pd_prefix_id *id, bool pinned, pd_error *err) {
    char idhex[PD_PREFIX_ID_HEX], key[KEY_MAX], ch[KEY_MAX];
    pd_prefix_id_hex(id, idhex);
    key_of(c, key, "rec", idhex, NULL);
    channel_of(c, ch);
    redisContext *ctx = conn_get(c, err);
    if (!ctx) return err->code;
    /* Only an existing hash is changed: HSET alone would make a partial one. */
    static const char script[] =
        "if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'pinned', ARGV[1]) end return 1";
    redisAppendCommand(ctx, "EVAL %s 1 %s %d", script, key, pinned ? 1 : 0);
    redisAppendCommand(ctx, "PUBLISH %s pin:%s:%d", ch, idhex, pinned ? 1 : 0);
    redisReply *rs[2];
    int rc = PD_OK;
    if (!read_replies(c, ctx, rs, 2, err))
        rc = err->code;
    else if (!reply_ok(c, rs[0], err) || !reply_ok(c, rs[1], err))
        rc = err->code;
    free_replies(rs, 2);
    conn_put(c, ctx);
    if (rc) pd_error_prefix(err, "pinning prefix %s in the shared tier", idhex);
    return rc;
}

/* ---- list ------------------------------------------------------------------------------ */

int pd_cluster_list(pd_cluster *c, const uint8_t fingerprint[PD_SHA256_LEN], const char *ns, pd_cluster_visit_fn fn,
                    void *ctx, pd_error *err) {
    char fp[2 * PD_SHA256_LEN + 1], key[KEY_MAX];
    pd_hex(fingerprint, PD_SHA256_LEN, fp);
    key_of(c, key, "ids", fp, ns ? ns : "");
    redisContext *rc_ctx = conn_get(c, err);
    if (!rc_ctx) return err->code;
    int rc = PD_OK;
    redisReply *set = redisCommand(rc_ctx, "SMEMBERS %s", key), **metas = NULL;
    size_t n = 0;
    if (!set) {
        rc = unavailable(c, rc_ctx->errstr, err);
        goto done;
    }
    if (!reply_ok(c, set, err)) {
        rc = err->code;
        goto done;
    }
    n = set->type == REDIS_REPLY_ARRAY ? set->elements : 0;
    rec_meta *m = n ? calloc(n, sizeof *m) : NULL;
    if (n && (!m || !(metas = calloc(n, sizeof *metas)))) {
        free(m);
        n = 0;
        rc = pd_errorf(err, PD_ENOMEM, "out of memory listing the shared tier");
        goto done;
    }
    size_t asked = 0;
    for (size_t i = 0; i < n; i++) {
        const redisReply *e = set->element[i];
        char idhex[PD_PREFIX_ID_HEX];
        pd_error pe;
        if (e->type != REDIS_REPLY_STRING || e->len != PD_PREFIX_ID_HEX - 1) continue;
        memcpy(idhex, e->str, e->len);
        idhex[e->len] = '\0';
        if (pd_prefix_id_parse(idhex, &m[asked].id, &pe)) continue;
        append_hmget(rc_ctx, c, idhex);
        asked++;
    }
    if (!read_replies(c, rc_ctx, metas, asked, err)) rc = err->code;
    /* An id whose hash is gone is a delete in progress: not listed. */
    for (size_t i = 0; !rc && i < asked; i++) {
        if (!rec_meta_decode(metas[i], &m[i])) continue;
        pd_cluster_entry e = {.id = m[i].id, .n_tokens = m[i].n_tokens, .created_at = m[i].created_at,
                              .bytes = m[i].bytes, .pinned = m[i].pinned};
        snprintf(e.spec, sizeof e.spec, "%s", m[i].spec);
        rc = fn(ctx, &e);
    }
    free_replies(metas, asked);
    free(m);
done:
    free(metas);
    if (set) freeReplyObject(set);
    conn_put(c, rc_ctx);
    return rc;
}

/* ---- the event thread -------------------------------------------------------------------- */

static void apply_event(pd_cluster *c, const char *msg, size_t len) {
    char buf[160];
    if (len >= sizeof buf) return;
    memcpy(buf, msg, len);
    buf[len] = '\0';
    pd_prefix_id id;
    pd_error e;
    if (strncmp(buf, "del:", 4) == 0 && len == 4 + PD_PREFIX_ID_HEX - 1) {
        if (pd_prefix_id_parse(buf + 4, &id, &e) == PD_OK) drop_local(c, &id);
    } else if (strncmp(buf, "pin:", 4) == 0 && len == 4 + PD_PREFIX_ID_HEX - 1 + 2 && buf[len - 2] == ':') {
        buf[len - 2] = '\0';
        if (pd_prefix_id_parse(buf + 4, &id, &e) == PD_OK) (void)pd_store_pin(c->o.store, &id, buf[len - 1] == '1', &e);
    }
}

typedef struct held_prefix {
    pd_prefix_id id;
    bool pinned;
} held_prefix;

typedef struct id_list {
    held_prefix *v;
    size_t n, cap;
} id_list;

static int collect_id(void *ctx, const pd_prefix_id *id, const pd_prefix_info *info, const char *why) {
    id_list *l = ctx;
    if (!info) return 0; /* damaged: verify's business */
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 64;
        held_prefix *p = realloc(l->v, cap * sizeof *p);
        if (!p) return PD_ENOMEM;
        l->v = p;
        l->cap = cap;
    }
    l->v[l->n++] = (held_prefix){.id = *id, .pinned = info->pinned};
    return 0;
}

/* After (re)subscribing: apply the deletes and pin changes this node
 * missed (tombstones; a record's pinned field) and publish what it
 * registered while Redis was away (or what a Redis that lost its data no
 * longer has). Events published from here on arrive on the subscription,
 * so nothing falls between the two. */
static void reconcile(pd_cluster *c) {
    id_list l = {0};
    pd_error err = {0};
    if (pd_store_list(c->o.store, collect_id, &l, &err) != PD_OK || l.n == 0) {
        free(l.v);
        return;
    }
    redisReply **rs = calloc(2 * l.n, sizeof *rs);
    redisContext *ctx = rs ? conn_get(c, &err) : NULL;
    if (!ctx) {
        free(rs);
        free(l.v);
        return;
    }
    char idhex[PD_PREFIX_ID_HEX], key[KEY_MAX];
    for (size_t i = 0; i < l.n; i++) {
        pd_prefix_id_hex(&l.v[i].id, idhex);
        key_of(c, key, "tomb", idhex, NULL);
        redisAppendCommand(ctx, "EXISTS %s", key);
        key_of(c, key, "rec", idhex, NULL);
        redisAppendCommand(ctx, "HGET %s pinned", key);
    }
    const bool ok = read_replies(c, ctx, rs, 2 * l.n, &err);
    conn_put(c, ctx);
    size_t dropped = 0, published = 0, repinned = 0;
    for (size_t i = 0; ok && i < l.n; i++) {
        const redisReply *tomb = rs[2 * i], *pinned = rs[2 * i + 1];
        if (tomb->type == REDIS_REPLY_INTEGER && tomb->integer == 1) {
            drop_local(c, &l.v[i].id);
            dropped++;
        } else if (pinned->type == REDIS_REPLY_NIL && c->o.role != PD_CLUSTER_CONSUMER) {
            if (pd_cluster_publish(c, &l.v[i].id, &err) == PD_OK) published++;
        } else if (pinned->type == REDIS_REPLY_STRING && (pinned->str[0] == '1') != l.v[i].pinned) {
            if (pd_store_pin(c->o.store, &l.v[i].id, !l.v[i].pinned, &err) == PD_OK) repinned++;
        }
    }
    if (dropped || published || repinned)
        pd_log(c->o.logger, PD_LOG_INFO,
               "shared tier: %zu prefixes deleted elsewhere were dropped, %zu (un)pinned elsewhere followed, %zu published",
               dropped, repinned, published);
    free_replies(rs, 2 * l.n);
    free(rs);
    free(l.v);
}

/* Wait up to `seconds` for the stop pipe; true when asked to stop. */
static bool wait_stop(pd_cluster *c, double seconds) {
    struct pollfd p = {.fd = c->stop_pipe[0], .events = POLLIN};
    return poll(&p, 1, (int)(seconds * 1000)) > 0;
}

static void *events_main(void *arg) {
    pd_cluster *c = arg;
    char ch[KEY_MAX];
    channel_of(c, ch);
    for (;;) {
        pd_error err = {0};
        redisContext *ctx = conn_open(c, &err);
        redisReply *r = ctx ? redisCommand(ctx, "SUBSCRIBE %s", ch) : NULL;
        if (!r || r->type == REDIS_REPLY_ERROR) {
            if (ctx) mark_down(c, r ? r->str : ctx->errstr);
            if (r) freeReplyObject(r);
            if (ctx) redisFree(ctx);
            if (wait_stop(c, c->o.retry_s)) return NULL;
            continue;
        }
        freeReplyObject(r);
        mark_up(c);
        reconcile(c);
        bool stop = false;
        while (!stop) {
            void *rep = NULL;
            if (redisGetReplyFromReader(ctx, &rep) != REDIS_OK) break;
            if (rep) {
                const redisReply *m = rep;
                if (m->type == REDIS_REPLY_ARRAY && m->elements == 3 && m->element[0]->type == REDIS_REPLY_STRING &&
                    strcmp(m->element[0]->str, "message") == 0 && m->element[2]->type == REDIS_REPLY_STRING)
                    apply_event(c, m->element[2]->str, m->element[2]->len);
                freeReplyObject(rep);
                continue;
            }
            struct pollfd p[2] = {{.fd = ctx->fd, .events = POLLIN}, {.fd = c->stop_pipe[0], .events = POLLIN}};
            if (poll(p, 2, -1) < 0) {
                if (errno == EINTR) continue;
                break;
            }
            if (p[1].revents) stop = true;
            else if (p[0].revents && redisBufferRead(ctx) != REDIS_OK)
                break;
        }
        if (!stop) mark_down(c, ctx->errstr[0] ? ctx->errstr : "the event connection was lost");
        redisFree(ctx);
        if (stop || wait_stop(c, c->o.retry_s)) return NULL;
    }
}

/* ---- create, free, stats ------------------------------------------------------------------- */

int pd_cluster_create(const pd_cluster_opts *o, pd_cluster **out, pd_error *err) {
    *out = NULL;
    if (!o || !o->redis_url || !o->redis_url[0] || !o->store)
        return pd_errorf(err, PD_EINVAL, "the shared tier needs cluster.redis_url and a store");
    if (o->timeout_ms < 1 || o->chunk_bytes < 1024 || o->tombstone_s < 1 || !(o->retry_s > 0) ||
        (unsigned)o->role > PD_CLUSTER_CONSUMER)
        return pd_errorf(err, PD_EINVAL, "cluster options out of range");
    pd_cluster *c = calloc(1, sizeof *c);
    if (!c) return pd_errorf(err, PD_ENOMEM, "out of memory for the shared tier");
    c->o = *o;
    c->stop_pipe[0] = c->stop_pipe[1] = -1;
    int rc = parse_url(c, o->redis_url, err);
    const char *prefix = o->key_prefix ? o->key_prefix : "prefixd:";
    if (!rc && strlen(prefix) >= sizeof c->prefix)
        rc = pd_errorf(err, PD_EINVAL, "cluster.key_prefix is longer than %zu bytes", sizeof c->prefix - 1);
    if (rc) {
        free(c);
        return rc;
    }
    snprintf(c->prefix, sizeof c->prefix, "%s", prefix);
    if (o->password && o->password[0]) {
        if (strlen(o->password) >= sizeof c->password) {
            free(c);
            return pd_errorf(err, PD_EINVAL, "cluster.password is longer than %zu bytes", sizeof c->password - 1);
        }
        snprintf(c->password, sizeof c->password, "%s", o->password);
    }
    c->o.redis_url = c->o.password = c->o.key_prefix = NULL; /* the caller's strings are not kept */
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->publish_mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    if (pipe(c->stop_pipe) != 0) {
        rc = pd_errorf(err, PD_EIO, "cannot create the shared tier's stop pipe: %s", strerror(errno));
        goto fail;
    }
    const int trc = pthread_create(&c->events, NULL, events_main, c);
    if (trc) {
        rc = pd_errorf(err, PD_EIO, "cannot start the shared tier's event thread: %s", strerror(trc));
        goto fail;
    }
    c->events_started = true;
    *out = c;
    return PD_OK;
fail:
    pd_cluster_free(c);
    return rc;
}

void pd_cluster_free(pd_cluster *c) {
    if (!c) return;
    if (c->events_started) {
        const char b = 1;
        if (write(c->stop_pipe[1], &b, 1) != 1) { /* cannot happen on an empty pipe */
        }
        pthread_join(c->events, NULL);
    }
    for (int i = 0; i < c->n_idle; i++) redisFree(c->idle[i]);
    for (int i = 0; i < 2; i++)
        if (c->stop_pipe[i] >= 0) close(c->stop_pipe[i]);
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->publish_mu);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

void pd_cluster_stats_get(pd_cluster *c, pd_cluster_stats *out) {
    pthread_mutex_lock(&c->mu);
    out->up = c->state == TIER_UP;
    pthread_mutex_unlock(&c->mu);
    out->errors = atomic_load(&c->errors);
    out->published = atomic_load(&c->published);
    out->fetched = atomic_load(&c->fetched);
    out->misses = atomic_load(&c->misses);
    out->rejected = atomic_load(&c->rejected);
    out->invalidations = atomic_load(&c->invalidations);
}
