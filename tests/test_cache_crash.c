/* Crash safety of the store: a child process (tests/store_writer.c) writes
 * and deletes prefixes in a loop and is killed with SIGKILL at random
 * moments. After every kill the store must open, verify with no corrupt
 * record, hold every prefix the child reported committed with exactly the
 * data it wrote, hold no prefix the child reported deleted, and hold a
 * prefix whose write (or delete) was cut off either whole or not at all. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "cache/cache.h"
#include "helpers.h"

/* Records per writer run: bounds the work of a run on a fast disk (the
 * writer then waits for its kill); ROUNDS * this fits MAX_IDS. */
#define RUN_RECORDS 150
#define MAX_IDS 8192
#define ROUNDS 20
_Static_assert(ROUNDS * RUN_RECORDS < MAX_IDS, "the id table must hold every run's ids");

/* What the parent knows about one id from the child's reports. */
typedef enum id_state {
    ST_BEGUN,      /* BEGIN seen, no OK: absent, or present and whole */
    ST_COMMITTED,  /* OK seen: must be present and whole */
    ST_DELETING,   /* DELBEGIN seen, no DELOK: present and whole, or absent */
    ST_DELETED,    /* DELOK seen, or found absent after a cut-off put or delete: must be absent */
} id_state;

typedef struct expect {
    pd_prefix_id id;
    uint64_t hash;
    id_state state;
} expect;

typedef struct world {
    expect *ids;
    size_t n;
    int64_t commits, deletes, cut_writes, cut_deletes;
} world;

static char *tmpdir;

static void setup(void) {
    tmpdir = th_mkdtemp();
    cr_assert_not_null(tmpdir);
}

static void teardown(void) {
    th_rmtree(tmpdir);
    free(tmpdir);
    tmpdir = NULL;
}

TestSuite(cache_crash, .init = setup, .fini = teardown);

static expect *find(world *w, const pd_prefix_id *id) {
    for (size_t i = 0; i < w->n; i++)
        if (memcmp(w->ids[i].id.b, id->b, PD_PREFIX_ID_LEN) == 0) return &w->ids[i];
    return NULL;
}

/* Returns true for a BEGIN line. */
static bool parse_line(world *w, const char *line) {
    char word[16], hex[PD_PREFIX_ID_HEX + 1];
    uint64_t hash = 0;
    if (strcmp(line, "FULL") == 0) cr_assert_fail("the writer filled the map; raise its map size");
    if (strcmp(line, "DONE") == 0) return false;
    int nf = sscanf(line, "%15s %65s %" SCNx64, word, hex, &hash);
    cr_assert(nf >= 2, "unexpected line from the writer: \"%s\"", line);
    pd_prefix_id id;
    pd_error err = {0};
    cr_assert_eq(pd_prefix_id_parse(hex, &id, &err), PD_OK, "%s", err.msg);
    expect *e = find(w, &id);
    if (strcmp(word, "BEGIN") == 0) {
        cr_assert_eq(nf, 3, "BEGIN without a hash: \"%s\"", line);
        if (!e) {
            cr_assert_lt(w->n, (size_t)MAX_IDS);
            e = &w->ids[w->n++];
            e->id = id;
        }
        e->hash = hash;
        /* Re-putting an id already committed (seeds never collide, but be
         * exact) cannot make it absent. */
        if (e->state != ST_COMMITTED) e->state = ST_BEGUN;
        return true;
    } else if (strcmp(word, "OK") == 0) {
        cr_assert_not_null(e, "OK for an id never begun: %s", hex);
        e->state = ST_COMMITTED;
        w->commits++;
    } else if (strcmp(word, "DELBEGIN") == 0) {
        cr_assert(e && e->state == ST_COMMITTED, "delete of an id not committed: %s", hex);
        e->state = ST_DELETING;
    } else if (strcmp(word, "DELOK") == 0) {
        cr_assert(e && e->state == ST_DELETING, "DELOK without DELBEGIN: %s", hex);
        e->state = ST_DELETED;
        w->deletes++;
    } else {
        cr_assert_fail("unexpected line from the writer: \"%s\"", line);
    }
    return false;
}

/* The same hash as store_writer's, over what the store returns widened to
 * f32 (the writer's values, multiples of 1/64 below 2, are exact in every
 * dtype). */
static uint64_t hash_ref(const pd_prefix_ref *r) {
    const pd_prefix_info *info = pd_prefix_ref_info(r);
    const pd_kv_prefix *kv = pd_prefix_ref_kv(r);
    XXH3_state_t *st = XXH3_createState();
    cr_assert_not_null(st);
    XXH3_64bits_reset(st);
    int32_t hdr[4] = {info->n_layer, info->n_head_kv, info->head_dim, info->n_tokens};
    for (int i = 0; i < 4; i++) XXH3_64bits_update(st, &hdr[i], sizeof hdr[i]);
    XXH3_64bits_update(st, pd_prefix_ref_tokens(r), (size_t)info->n_tokens * sizeof(pd_token));
    for (int l = 0; l < info->n_layer; l++)
        for (int h = 0; h < info->n_head_kv; h++) {
            const int32_t *pos;
            int64_t len = pd_kv_prefix_stream(kv, l, h, &pos, NULL, NULL);
            float *k = malloc(sizeof(float) * (size_t)(len * info->head_dim + 1));
            float *v = malloc(sizeof(float) * (size_t)(len * info->head_dim + 1));
            cr_assert(k && v);
            pd_kv_prefix_stream_f32(kv, l, h, k, v);
            int32_t len32 = (int32_t)len;
            XXH3_64bits_update(st, &len32, sizeof len32);
            XXH3_64bits_update(st, pos, (size_t)len * sizeof *pos);
            XXH3_64bits_update(st, k, (size_t)len * (size_t)info->head_dim * sizeof *k);
            XXH3_64bits_update(st, v, (size_t)len * (size_t)info->head_dim * sizeof *v);
            free(k);
            free(v);
        }
    uint64_t hash = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return hash;
}

typedef struct list_ctx {
    world *w;
    int64_t n, strays, corrupt;
} list_ctx;

static int on_listed(void *ctx, const pd_prefix_id *id, const pd_prefix_info *info, const char *why) {
    list_ctx *c = ctx;
    c->n++;
    if (!info) {
        c->corrupt++;
        cr_log_error("listed a corrupt record: %s", why ? why : "(no reason)");
    }
    expect *e = find(c->w, id);
    if (!e || e->state == ST_DELETED) {
        char hex[PD_PREFIX_ID_HEX];
        pd_prefix_id_hex(id, hex);
        cr_log_error("the store holds %s, which the writer %s", hex, e ? "deleted" : "never wrote");
        c->strays++;
    }
    return 0;
}

static void check_store(world *w, const char *dir) {
    pd_error err = {0};
    pd_store_opts o;
    pd_store_opts_default(&o);
    o.dir = dir;
    o.map_size = 1024ull << 20;
    pd_store *s = NULL;
    cr_assert_eq(pd_store_open(&o, &s, &err), PD_OK, "reopening after the kill: %s", err.msg);

    pd_store_verify_report rep = {0};
    cr_assert_eq(pd_store_verify(s, false, NULL, NULL, &rep, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(rep.corrupt, 0, "verify found %" PRId64 " corrupt records of %" PRId64, rep.corrupt, rep.checked);

    list_ctx lc = {.w = w};
    cr_assert_eq(pd_store_list(s, on_listed, &lc, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(lc.corrupt, 0);
    cr_assert_eq(lc.strays, 0, "%" PRId64 " records the writer never committed or deleted", lc.strays);
    cr_assert_eq(rep.checked, lc.n, "verify checked %" PRId64 " records, list shows %" PRId64, rep.checked, lc.n);

    int64_t present = 0;
    for (size_t i = 0; i < w->n; i++) {
        expect *e = &w->ids[i];
        char hex[PD_PREFIX_ID_HEX];
        pd_prefix_id_hex(&e->id, hex);
        pd_prefix_ref *r = NULL;
        int rc = pd_store_get(s, &e->id, &r, &err);
        if (rc == PD_ENOTFOUND) {
            cr_assert(e->state == ST_BEGUN || e->state == ST_DELETING || e->state == ST_DELETED,
                      "%s was reported committed but is missing", hex);
            /* Settle what the kill left: absent from now on. */
            if (e->state == ST_BEGUN) w->cut_writes++;
            if (e->state == ST_DELETING) w->cut_deletes++;
            e->state = ST_DELETED;
            continue;
        }
        cr_assert_eq(rc, PD_OK, "%s: %s", hex, err.msg);
        cr_assert_neq(e->state, ST_DELETED, "%s was reported deleted but is present", hex);
        cr_assert_eq(hash_ref(r), e->hash, "%s: data differ from what the writer wrote", hex);
        cr_assert_eq(memcmp(pd_prefix_ref_info(r)->id.b, e->id.b, PD_PREFIX_ID_LEN), 0);
        pd_prefix_ref_release(r);
        present++;
        /* Present after this kill: stays so (later runs never delete it). */
        e->state = ST_COMMITTED;
    }
    cr_assert_eq(present, lc.n);
    pd_store_close(s);
}

/* Run the writer until a SIGKILL `delay_ms` after its start (after its
 * first BEGIN when from_first_begin: its start-up, slow under sanitizers on
 * a loaded machine, then cannot use up the delay) or, when kill_at_begin >
 * 0, as soon as it reports its kill_at_begin-th BEGIN (it is then inside
 * pd_store_put), collecting its reports, including those still in the pipe
 * when it died. */
static void run_writer_and_kill(world *w, const char *writer, const char *dir, uint64_t seed, int delay_ms,
                                bool from_first_begin, int kill_at_begin) {
    int fds[2];
    cr_assert_eq(pipe(fds), 0, "pipe: %s", strerror(errno));
    char seed_s[32], max_s[32];
    snprintf(seed_s, sizeof seed_s, "%" PRIu64, seed);
    snprintf(max_s, sizeof max_s, "%d", RUN_RECORDS);
    pid_t pid = fork();
    cr_assert_neq(pid, -1, "fork: %s", strerror(errno));
    if (pid == 0) {
        close(fds[0]);
        if (dup2(fds[1], STDOUT_FILENO) < 0) _exit(127);
        close(fds[1]);
        execl(writer, writer, dir, seed_s, max_s, (char *)NULL);
        _exit(127);
    }
    close(fds[1]);

    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    char buf[4096];
    size_t len = 0;
    bool killed = false, eof = false;
    int begins = 0;
    while (!eof) {
        int wait_ms = -1;
        if (!killed && (!from_first_begin || begins > 0)) {
            clock_gettime(CLOCK_MONOTONIC, &now);
            long elapsed = (now.tv_sec - t0.tv_sec) * 1000 + (now.tv_nsec - t0.tv_nsec) / 1000000;
            if (elapsed >= delay_ms) {
                cr_assert_eq(kill(pid, SIGKILL), 0, "kill: %s", strerror(errno));
                killed = true;
            } else {
                wait_ms = (int)(delay_ms - elapsed);
            }
        }
        struct pollfd p = {.fd = fds[0], .events = POLLIN};
        int pr = poll(&p, 1, wait_ms);
        if (pr < 0 && errno == EINTR) continue;
        cr_assert_geq(pr, 0, "poll: %s", strerror(errno));
        if (pr == 0) continue;
        ssize_t got = read(fds[0], buf + len, sizeof buf - 1 - len);
        if (got < 0 && errno == EINTR) continue;
        cr_assert_geq(got, 0, "read: %s", strerror(errno));
        if (got == 0) {
            eof = true;
            break;
        }
        len += (size_t)got;
        buf[len] = '\0';
        char *start = buf, *nl;
        while ((nl = strchr(start, '\n'))) {
            *nl = '\0';
            if (parse_line(w, start)) {
                if (++begins == 1 && from_first_begin) clock_gettime(CLOCK_MONOTONIC, &t0);
                if (begins == kill_at_begin && !killed) {
                    cr_assert_eq(kill(pid, SIGKILL), 0, "kill: %s", strerror(errno));
                    killed = true;
                }
            }
            start = nl + 1;
        }
        len -= (size_t)(start - buf);
        memmove(buf, start, len);
        cr_assert_lt(len, sizeof buf - 1, "an overlong line from the writer");
    }
    /* A partial last line (none expected: lines are shorter than PIPE_BUF
     * and written whole) carries no report. */
    close(fds[0]);
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
              "the writer ended on its own (exit status %d) before the kill; see its stderr above",
              WIFEXITED(status) ? WEXITSTATUS(status) : -1);
}

Test(cache_crash, sigkill_at_random_moments_leaves_a_clean_store, .timeout = 280) {
    const char *writer = getenv("PD_STORE_WRITER");
    cr_assert(writer && *writer, "PD_STORE_WRITER is not set (run through meson test)");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/store", tmpdir);

    world w = {.ids = calloc(MAX_IDS, sizeof(expect))};
    cr_assert_not_null(w.ids);
    uint64_t rng = 20240505;
    for (int round = 0; round < ROUNDS; round++) {
        int delay_ms = 5 + (int)(pd_splitmix64(&rng) % 300);
        /* every fourth kill may land in the writer's start-up (opening the store) */
        run_writer_and_kill(&w, writer, dir, 1000 + (uint64_t)round, delay_ms, round % 4 != 0, 0);
        check_store(&w, dir);
    }
    cr_log_info("%d kills: %" PRId64 " commits, %" PRId64 " deletes, %" PRId64 " writes and %" PRId64
                " deletes cut off by the kill",
                ROUNDS, w.commits, w.deletes, w.cut_writes, w.cut_deletes);
    cr_assert_gt(w.commits, 0, "the writer never committed anything before being killed");
    free(w.ids);
}

/* A prefix half-written at the kill is absent rather than partial: kill the
 * writer right after it announces a put (so usually while pd_store_put is
 * writing), and check each such prefix is absent or whole. */
Test(cache_crash, prefix_cut_off_mid_put_is_absent_or_whole, .timeout = 200) {
    const char *writer = getenv("PD_STORE_WRITER");
    cr_assert(writer && *writer, "PD_STORE_WRITER is not set (run through meson test)");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/store", tmpdir);
    world w = {.ids = calloc(MAX_IDS, sizeof(expect))};
    cr_assert_not_null(w.ids);
    uint64_t rng = 77;
    int64_t cut = 0;
    for (int round = 0; round < 15; round++) {
        size_t before = w.n;
        int nth = 1 + (int)(pd_splitmix64(&rng) % 8);
        run_writer_and_kill(&w, writer, dir, 5000 + (uint64_t)round, 5000, false, nth);
        for (size_t i = before; i < w.n; i++)
            if (w.ids[i].state == ST_BEGUN) cut++;
        check_store(&w, dir);
    }
    cr_log_info("%" PRId64 " puts were in flight at the kill; %" PRId64 " of them left no record", cut, w.cut_writes);
    free(w.ids);
}
