/* The shared tier (cluster/) against a real redis-server on a loopback
 * port and real LMDB stores in a temp dir: records published in chunks and
 * fetched into another store row for row; damage in Redis refused; deletes
 * reaching every store, including one that was away; Redis down answered
 * fast and caught up after. Skips without redis-server (fails under CI). */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cache/cache.h"
#include "cluster/cluster.h"
#include "tests/helpers.h"

static char *tmpdir;
static pid_t redis_pid;
static int redis_port;

static void stop_redis(void) {
    if (redis_pid > 0) {
        kill(redis_pid, SIGKILL);
        waitpid(redis_pid, NULL, 0);
    }
    redis_pid = 0;
}

/* redis-server on redis_port (a free one the first time), no persistence;
 * returns once it answers PING. */
static void start_redis(void) {
    if (!redis_port) redis_port = th_free_port();
    char port[16];
    snprintf(port, sizeof port, "%d", redis_port);
    redis_pid = fork();
    cr_assert_geq(redis_pid, 0);
    if (redis_pid == 0) {
        int devnull = open("/dev/null", O_WRONLY);
        dup2(devnull, 1);
        execlp("redis-server", "redis-server", "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly",
               "no", "--dir", tmpdir, (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 200; i++) {
        char *out = NULL;
        if (th_runf(&out, "redis-cli -p %d ping 2>/dev/null", redis_port) == 0 && out && strstr(out, "PONG")) {
            free(out);
            return;
        }
        free(out);
        usleep(25 * 1000);
    }
    cr_assert_fail("redis-server did not answer on port %d", redis_port);
}

static void setup(void) {
    tmpdir = th_mkdtemp();
    if (system("command -v redis-server >/dev/null && command -v redis-cli >/dev/null") != 0) {
        if (getenv("CI") && strcmp(getenv("CI"), "true") == 0)
            cr_assert_fail("redis-server and redis-cli are required under CI (deploy/install-deps.sh installs them)");
        cr_skip_test("redis-server is not installed (apt-get install redis-server)");
    }
    redis_port = 0;
    start_redis();
}

static void teardown(void) {
    stop_redis();
    th_rmtree(tmpdir);
    free(tmpdir);
}

TestSuite(cluster, .init = setup, .fini = teardown, .timeout = 120);

/* ---- stores, records --------------------------------------------------------- */

static pd_store *open_store(const char *name) {
    char dir[1200];
    snprintf(dir, sizeof dir, "%s/%s", tmpdir, name);
    pd_store_opts o;
    pd_store_opts_default(&o);
    o.dir = dir;
    o.map_size = 64u << 20;
    o.page_tokens = 8; /* several pages per stream: every one is checked */
    pd_store *s = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_store_open(&o, &s, &err), PD_OK, "%s", err.msg);
    return s;
}

static pd_cluster *join(pd_store *s, size_t chunk_bytes) {
    char url[64];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", redis_port);
    pd_cluster_opts o;
    pd_cluster_opts_default(&o);
    o.redis_url = url;
    o.store = s;
    o.chunk_bytes = chunk_bytes;
    o.timeout_ms = 200;
    o.retry_s = 0.2;
    pd_cluster *c = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_cluster_create(&o, &c, &err), PD_OK, "%s", err.msg);
    return c;
}

static const uint8_t FP[PD_SHA256_LEN] = {1, 2, 3, 4, 5, 6, 7, 8, 9};

/* tokens[0..n) stored in s as a prefix with every row kept (values from seed). */
static pd_prefix_id put_record(pd_store *s, const pd_token *tokens, int32_t n, const char *ns, uint32_t seed) {
    pd_hparams hp = {.n_layer = 2, .n_head_kv = 2, .head_dim = 16};
    pd_kv_prefix *kv = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_kv_prefix_create(&hp, n, PD_TYPE_F32, &kv, &err), PD_OK, "%s", err.msg);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)n);
    float *k = malloc(sizeof(float) * (size_t)n * 16), *v = malloc(sizeof(float) * (size_t)n * 16);
    cr_assert(pos && k && v);
    for (int32_t i = 0; i < n; i++) pos[i] = i;
    for (int l = 0; l < 2; l++)
        for (int h = 0; h < 2; h++) {
            for (int32_t i = 0; i < n * 16; i++) {
                k[i] = sinf((float)(seed + 7 * l + 3 * h + (uint32_t)i));
                v[i] = cosf((float)(seed + 5 * l + 11 * h + (uint32_t)i));
            }
            cr_assert_eq(pd_kv_prefix_set(kv, l, h, pos, k, v, n, &err), PD_OK, "%s", err.msg);
        }
    pd_prefix_info info;
    memset(&info, 0, sizeof info);
    memcpy(info.fingerprint, FP, sizeof FP);
    snprintf(info.spec, sizeof info.spec, "knorm:retention=1");
    snprintf(info.ns, sizeof info.ns, "%s", ns);
    info.dtype = PD_KV_F16;
    info.quality = (pd_prefix_quality){.retention = 1, .tau = NAN, .nll_full = NAN, .nll_ratio = NAN};
    bool existed = true;
    cr_assert_eq(pd_store_put(s, &info, tokens, n, kv, &existed, &err), PD_OK, "%s", err.msg);
    cr_assert(!existed);
    pd_kv_prefix_free(kv);
    free(pos), free(k), free(v);
    return info.id;
}

static pd_token *tokens_of(int64_t n, uint32_t seed) {
    pd_token *t = malloc(sizeof *t * (size_t)n);
    cr_assert_not_null(t);
    for (int64_t i = 0; i < n; i++) t[i] = (pd_token)((seed * 2654435761u + (uint32_t)i * 40503u) % 32000u);
    return t;
}

static bool held(pd_store *s, const pd_prefix_id *id) {
    pd_prefix_info info;
    pd_error err;
    return pd_store_info(s, id, &info, &err) == PD_OK;
}

/* The same rows in both stores, byte for byte (both read as f16). */
static void assert_same_rows(pd_store *a, pd_store *b, const pd_prefix_id *id) {
    pd_prefix_ref *ra = NULL, *rb = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_store_get(a, id, &ra, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_store_get(b, id, &rb, &err), PD_OK, "%s", err.msg);
    const pd_kv_prefix *ka = pd_prefix_ref_kv(ra), *kb = pd_prefix_ref_kv(rb);
    cr_assert_eq(pd_kv_prefix_kept_rows(ka), pd_kv_prefix_kept_rows(kb));
    for (int l = 0; l < 2; l++)
        for (int h = 0; h < 2; h++) {
            const int32_t *pa, *pb;
            const void *kra, *krb, *vra, *vrb;
            const int64_t na = pd_kv_prefix_stream(ka, l, h, &pa, &kra, &vra);
            cr_assert_eq(pd_kv_prefix_stream(kb, l, h, &pb, &krb, &vrb), na);
            cr_assert(memcmp(pa, pb, sizeof(int32_t) * (size_t)na) == 0);
            cr_assert(memcmp(kra, krb, 2u * 16u * (size_t)na) == 0, "K rows of (%d, %d)", l, h);
            cr_assert(memcmp(vra, vrb, 2u * 16u * (size_t)na) == 0, "V rows of (%d, %d)", l, h);
        }
    pd_prefix_ref_release(ra);
    pd_prefix_ref_release(rb);
}

static int redis_count(const char *pattern) {
    char *out = NULL;
    cr_assert_eq(th_runf(&out, "redis-cli -p %d --scan --pattern '%s' | wc -l", redis_port, pattern), 0);
    const int n = atoi(out);
    free(out);
    return n;
}

/* Wait up to `seconds` for cond(s, id) to become `want`. */
static bool eventually_held(pd_store *s, const pd_prefix_id *id, bool want, double seconds) {
    for (double t = 0; t < seconds; t += 0.02) {
        if (held(s, id) == want) return true;
        usleep(20 * 1000);
    }
    return held(s, id) == want;
}

/* ---- tests ----------------------------------------------------------------------- */

Test(cluster, a_record_travels_in_chunks_and_arrives_row_for_row) {
    pd_store *a = open_store("a"), *b = open_store("b");
    pd_cluster *ca = join(a, 1024), *cb = join(b, 1024);
    const int32_t n = 45; /* not a whole number of blocks: the tail counts too */
    pd_token *t = tokens_of(n + 5, 1);
    const pd_prefix_id id = put_record(a, t, n, "tenant", 11);
    pd_error err = {0};
    cr_assert_eq(pd_cluster_publish(ca, &id, &err), PD_OK, "%s", err.msg);
    cr_assert_gt(redis_count("prefixd:chunk:*"), 10, "a ~%d KiB record in 1 KiB chunks", 12);
    cr_assert_eq(pd_cluster_publish(ca, &id, &err), PD_OK, "publishing again is harmless");

    /* Another namespace, another spec, or tokens that leave the prefix's
     * last partial block: nothing matches. */
    cr_assert_eq(pd_cluster_fetch(cb, FP, "other", NULL, t, n + 5, &err), PD_ENOTFOUND);
    cr_assert_eq(pd_cluster_fetch(cb, FP, "tenant", "snapkv:retention=0.5", t, n + 5, &err), PD_ENOTFOUND);
    pd_token *diverge = tokens_of(n + 5, 1);
    diverge[n - 1] ^= 1;
    cr_assert_eq(pd_cluster_fetch(cb, FP, "tenant", NULL, diverge, n + 5, &err), PD_ENOTFOUND);
    cr_assert_eq(pd_cluster_fetch(cb, FP, "tenant", NULL, t, n - 1, &err), PD_ENOTFOUND, "longer than the prompt");
    cr_assert(!held(b, &id));

    cr_assert_eq(pd_cluster_fetch(cb, FP, "tenant", NULL, t, n + 5, &err), PD_OK, "%s", err.msg);
    cr_assert(held(b, &id));
    assert_same_rows(a, b, &id);
    pd_prefix_id found;
    int32_t matched = 0;
    cr_assert_eq(pd_store_lookup(b, FP, "tenant", NULL, t, n + 5, &found, &matched, &err), PD_OK);
    cr_assert_eq(matched, n);
    /* By id, into a third store. */
    pd_store *c = open_store("c");
    pd_cluster *cc = join(c, 1024);
    cr_assert_eq(pd_cluster_fetch_id(cc, &id, &err), PD_OK, "%s", err.msg);
    assert_same_rows(a, c, &id);

    pd_cluster_stats st;
    pd_cluster_stats_get(ca, &st);
    cr_assert_eq(st.published, 1, "the same bytes are sent once");
    cr_assert(st.up);
    pd_cluster_stats_get(cb, &st);
    cr_assert_eq(st.fetched, 1);
    cr_assert_eq(st.misses, 4);
    cr_assert_eq(st.rejected, 0);
    pd_cluster_free(cc), pd_cluster_free(cb), pd_cluster_free(ca);
    pd_store_close(c), pd_store_close(b), pd_store_close(a);
    free(t), free(diverge);
}

Test(cluster, a_damaged_record_in_redis_is_refused_and_nothing_is_stored) {
    pd_store *a = open_store("a"), *b = open_store("b");
    pd_cluster *ca = join(a, 4096), *cb = join(b, 4096);
    pd_token *t = tokens_of(40, 2);
    const pd_prefix_id id = put_record(a, t, 32, "", 5);
    pd_error err = {0};
    cr_assert_eq(pd_cluster_publish(ca, &id, &err), PD_OK, "%s", err.msg);
    char hex[PD_PREFIX_ID_HEX];
    pd_prefix_id_hex(&id, hex);
    /* One byte of the second chunk changes (to whichever of two letters it is not). */
    char *out = NULL;
    cr_assert_eq(th_runf(&out, "redis-cli -p %d GETRANGE prefixd:chunk:%s:1 100 100", redis_port, hex), 0);
    const char *repl = out && out[0] == 'Q' ? "R" : "Q";
    free(out);
    cr_assert_eq(th_runf(NULL, "redis-cli -p %d SETRANGE prefixd:chunk:%s:1 100 %s >/dev/null", redis_port, hex, repl), 0);
    cr_assert_eq(pd_cluster_fetch(cb, FP, "", NULL, t, 40, &err), PD_ENOTFOUND);
    cr_assert(!held(b, &id), "damaged bytes never reach the store");
    pd_cluster_stats st;
    pd_cluster_stats_get(cb, &st);
    cr_assert_eq(st.rejected, 1);
    pd_store_stats ss;
    cr_assert_eq(pd_store_stats_get(b, &ss, &err), PD_OK);
    cr_assert_eq(ss.prefixes, 0);
    /* A chunk gone entirely is refused the same way. */
    cr_assert_eq(th_runf(NULL, "redis-cli -p %d DEL prefixd:chunk:%s:0 >/dev/null", redis_port, hex), 0);
    cr_assert_eq(pd_cluster_fetch_id(cb, &id, &err), PD_ENOTFOUND);
    pd_cluster_stats_get(cb, &st);
    cr_assert_eq(st.rejected, 2);
    pd_cluster_free(cb), pd_cluster_free(ca);
    pd_store_close(b), pd_store_close(a);
    free(t);
}

Test(cluster, a_delete_reaches_every_store_and_one_that_was_away) {
    pd_store *a = open_store("a"), *b = open_store("b"), *c = open_store("c");
    pd_cluster *ca = join(a, 1 << 20), *cb = join(b, 1 << 20), *cc = join(c, 1 << 20);
    pd_token *t1 = tokens_of(40, 3), *t2 = tokens_of(40, 4);
    const pd_prefix_id id1 = put_record(a, t1, 33, "", 1), id2 = put_record(a, t2, 20, "", 2);
    pd_error err = {0};
    cr_assert_eq(pd_cluster_publish(ca, &id1, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_cluster_publish(ca, &id2, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_cluster_fetch_id(cb, &id1, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_cluster_fetch_id(cc, &id1, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_cluster_fetch_id(cc, &id2, &err), PD_OK, "%s", err.msg);

    /* Deleted from b (which is where an operator happened to ask). */
    bool existed = false;
    cr_assert_eq(pd_cluster_delete(cb, &id1, &existed, &err), PD_OK, "%s", err.msg);
    cr_assert(existed);
    cr_assert(eventually_held(a, &id1, false, 1.0), "a still holds a deleted prefix after 1 s");
    cr_assert(eventually_held(b, &id1, false, 1.0));
    cr_assert(eventually_held(c, &id1, false, 1.0));
    cr_assert_eq(pd_cluster_fetch_id(cb, &id1, &err), PD_ENOTFOUND, "gone from Redis too");
    cr_assert_eq(redis_count("prefixd:chunk:*"), 1, "only id2's chunk is left");

    /* c is away while id2 is deleted; it catches up when it comes back. */
    pd_cluster_free(cc);
    cr_assert_eq(pd_cluster_delete(ca, &id2, &existed, &err), PD_OK, "%s", err.msg);
    cr_assert(held(c, &id2));
    cc = join(c, 1 << 20);
    cr_assert(eventually_held(c, &id2, false, 2.0), "the tombstone was not applied on reconnect");
    pd_cluster_stats st;
    pd_cluster_stats_get(cc, &st);
    for (int i = 0; i < 50 && st.invalidations == 0; i++) { /* counted just after the store changed */
        usleep(20 * 1000);
        pd_cluster_stats_get(cc, &st);
    }
    cr_assert_eq(st.invalidations, 1, "%lld", (long long)st.invalidations);
    /* Deleting what Redis does not hold says so (and still tells the others). */
    cr_assert_eq(pd_cluster_delete(ca, &id2, &existed, &err), PD_OK);
    cr_assert(!existed);
    pd_cluster_free(cc), pd_cluster_free(cb), pd_cluster_free(ca);
    pd_store_close(c), pd_store_close(b), pd_store_close(a);
    free(t1), free(t2);
}

Test(cluster, pins_propagate) {
    pd_store *a = open_store("a"), *b = open_store("b");
    pd_cluster *ca = join(a, 1 << 20), *cb = join(b, 1 << 20);
    pd_token *t = tokens_of(40, 9);
    const pd_prefix_id id = put_record(a, t, 30, "", 3);
    pd_error err = {0};
    cr_assert_eq(pd_cluster_publish(ca, &id, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_cluster_fetch_id(cb, &id, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_cluster_pin(ca, &id, true, &err), PD_OK, "%s", err.msg);
    pd_prefix_info info = {0};
    for (int i = 0; i < 50 && !info.pinned; i++) {
        usleep(20 * 1000);
        cr_assert_eq(pd_store_info(b, &id, &info, &err), PD_OK);
    }
    cr_assert(info.pinned, "b's copy was not pinned within 1 s");
    /* b is away while the pin is taken off; it follows when it comes back. */
    pd_cluster_free(cb);
    cr_assert_eq(pd_cluster_pin(ca, &id, false, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_store_info(b, &id, &info, &err), PD_OK);
    cr_assert(info.pinned);
    cb = join(b, 1 << 20);
    for (int i = 0; i < 100 && info.pinned; i++) {
        usleep(20 * 1000);
        cr_assert_eq(pd_store_info(b, &id, &info, &err), PD_OK);
    }
    cr_assert(!info.pinned, "the unpin was not applied on reconnect");
    cr_assert_eq(pd_cluster_pin(ca, &id, true, &err), PD_OK, "%s", err.msg);
    /* A store that fetches it later gets it pinned. */
    pd_store *c = open_store("c");
    pd_cluster *cc = join(c, 1 << 20);
    cr_assert_eq(pd_cluster_fetch_id(cc, &id, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_store_info(c, &id, &info, &err), PD_OK);
    cr_assert(info.pinned);
    pd_cluster_free(cc), pd_cluster_free(cb), pd_cluster_free(ca);
    pd_store_close(c), pd_store_close(b), pd_store_close(a);
    free(t);
}

Test(cluster, redis_down_answers_fast_and_the_node_catches_up_after) {
    pd_store *a = open_store("a"), *b = open_store("b");
    pd_cluster *ca = join(a, 1 << 20), *cb = join(b, 1 << 20);
    pd_token *t = tokens_of(40, 7);
    stop_redis();
    const pd_prefix_id id = put_record(a, t, 36, "", 4);
    pd_error err = {0};
    const double t0 = pd_now_seconds();
    cr_assert_eq(pd_cluster_publish(ca, &id, &err), PD_EUNAVAILABLE);
    cr_assert(strstr(err.msg, "unavailable"), "%s", err.msg);
    cr_assert_eq(pd_cluster_fetch(cb, FP, "", NULL, t, 40, &err), PD_EUNAVAILABLE);
    for (int i = 0; i < 100; i++) (void)pd_cluster_fetch(cb, FP, "", NULL, t, 40, &err);
    cr_assert_lt(pd_now_seconds() - t0, 2.0, "an outage must not make requests wait");
    pd_cluster_stats st;
    pd_cluster_stats_get(cb, &st);
    cr_assert(!st.up);
    cr_assert_geq(st.errors, 1);

    /* Back up (empty): a, which registered meanwhile, publishes on reconnect. */
    start_redis();
    bool ok = false;
    for (int i = 0; i < 150 && !ok; i++) {
        usleep(20 * 1000);
        ok = pd_cluster_fetch(cb, FP, "", NULL, t, 40, &err) == PD_OK;
    }
    cr_assert(ok, "b never found what a registered during the outage: %s", err.msg);
    assert_same_rows(a, b, &id);
    pd_cluster_stats_get(cb, &st);
    cr_assert(st.up);
    pd_cluster_free(cb), pd_cluster_free(ca);
    pd_store_close(b), pd_store_close(a);
    free(t);
}

Test(cluster, bad_urls_are_refused_with_the_forms) {
    pd_store *a = open_store("a");
    pd_cluster_opts o;
    pd_cluster_opts_default(&o);
    o.store = a;
    pd_cluster *c = NULL;
    pd_error err = {0};
    o.redis_url = "rediss://host:6380";
    cr_assert_eq(pd_cluster_create(&o, &c, &err), PD_EUNSUPPORTED);
    cr_assert(strstr(err.msg, "tunnel"), "%s", err.msg);
    o.redis_url = "redis://host:99999";
    cr_assert_eq(pd_cluster_create(&o, &c, &err), PD_EINVAL);
    o.redis_url = "tcp://host";
    cr_assert_eq(pd_cluster_create(&o, &c, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "redis://"), "%s", err.msg);
    o.redis_url = "redis://:secret@127.0.0.1:1/3";
    cr_assert_eq(pd_cluster_create(&o, &c, &err), PD_OK, "a Redis that is down is not an error: %s", err.msg);
    cr_assert_eq(pd_cluster_fetch_id(c, &(pd_prefix_id){{1}}, &err), PD_EUNAVAILABLE);
    cr_assert(!strstr(err.msg, "secret"), "the password leaked: %s", err.msg);
    pd_cluster_free(c);
    pd_store_close(a);
}

/* A consumer never writes records to Redis; a publisher never fetches. */
Test(cluster, roles_limit_what_a_node_does) {
    pd_store *a = open_store("a"), *b = open_store("b"), *p = open_store("p");
    char url[64];
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", redis_port);
    pd_cluster_opts o;
    pd_cluster_opts_default(&o);
    o.redis_url = url;
    o.timeout_ms = 200;
    o.retry_s = 0.2;
    pd_cluster *consumer = NULL, *publisher = NULL;
    pd_error err = {0};
    o.store = a;
    o.role = PD_CLUSTER_CONSUMER;
    cr_assert_eq(pd_cluster_create(&o, &consumer, &err), PD_OK, "%s", err.msg);
    o.store = p;
    o.role = PD_CLUSTER_PUBLISHER;
    cr_assert_eq(pd_cluster_create(&o, &publisher, &err), PD_OK, "%s", err.msg);
    pd_cluster *member = join(b, 1 << 20);
    pd_token *t = tokens_of(40, 12);
    const pd_prefix_id from_consumer = put_record(a, t, 30, "", 1);
    cr_assert_eq(pd_cluster_publish(consumer, &from_consumer, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(redis_count("prefixd:rec:*"), 0, "a consumer published");
    cr_assert_eq(pd_cluster_fetch_id(member, &from_consumer, &err), PD_ENOTFOUND);

    const pd_prefix_id from_member = put_record(b, t, 33, "", 2);
    cr_assert_eq(pd_cluster_publish(member, &from_member, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_cluster_fetch(publisher, FP, "", NULL, t, 40, &err), PD_ENOTFOUND, "a publisher fetched");
    cr_assert(!held(p, &from_member));
    cr_assert_eq(pd_cluster_fetch(consumer, FP, "", NULL, t, 40, &err), PD_OK, "%s", err.msg);
    cr_assert(held(a, &from_member));
    pd_cluster_free(member), pd_cluster_free(publisher), pd_cluster_free(consumer);
    pd_store_close(p), pd_store_close(b), pd_store_close(a);
    free(t);
}

static int collect_entry(void *ctx, const pd_cluster_entry *e) {
    pd_cluster_entry *out = ctx;
    for (int i = 0; i < 4; i++)
        if (out[i].n_tokens == 0) {
            out[i] = *e;
            return 0;
        }
    return 1;
}

/* The index per (model, namespace) lists what the shared tier holds. */
Test(cluster, the_shared_tier_lists_a_namespace) {
    pd_store *a = open_store("a");
    pd_cluster *ca = join(a, 1 << 20);
    pd_token *t = tokens_of(60, 21);
    const pd_prefix_id x = put_record(a, t, 40, "ns1", 1), y = put_record(a, t, 20, "ns1", 2),
                       z = put_record(a, t, 30, "ns2", 3);
    pd_error err = {0};
    cr_assert_eq(pd_cluster_publish(ca, &x, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_cluster_publish(ca, &y, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_cluster_publish(ca, &z, &err), PD_OK, "%s", err.msg);
    pd_cluster_entry got[4];
    memset(got, 0, sizeof got);
    cr_assert_eq(pd_cluster_list(ca, FP, "ns1", collect_entry, got, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(got[2].n_tokens, 0, "ns2's prefix listed under ns1");
    cr_assert_eq(got[0].n_tokens + got[1].n_tokens, 60);
    const pd_cluster_entry *ex = got[0].n_tokens == 40 ? &got[0] : &got[1];
    cr_assert(memcmp(ex->id.b, x.b, PD_PREFIX_ID_LEN) == 0);
    cr_assert_str_eq(ex->spec, "knorm:retention=1");
    cr_assert(ex->bytes > 0 && ex->created_at > 0 && !ex->pinned);
    bool existed;
    cr_assert_eq(pd_cluster_delete(ca, &x, &existed, &err), PD_OK);
    memset(got, 0, sizeof got);
    cr_assert_eq(pd_cluster_list(ca, FP, "ns1", collect_entry, got, &err), PD_OK);
    cr_assert_eq(got[0].n_tokens, 20, "only y is left");
    cr_assert_eq(got[1].n_tokens, 0);
    uint8_t other[PD_SHA256_LEN] = {9};
    memset(got, 0, sizeof got);
    cr_assert_eq(pd_cluster_list(ca, other, "ns1", collect_entry, got, &err), PD_OK);
    cr_assert_eq(got[0].n_tokens, 0, "another model's list is empty");
    pd_cluster_free(ca);
    pd_store_close(a);
    free(t);
}
