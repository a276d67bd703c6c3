/* The log (util's pd_logger) and the observability of the real daemon:
 * the three formats on a real stream, one access line per request with its
 * X-Request-Id echoed, level filtering, job lines, journal entries caught on
 * a real socket, and the /metrics series of issue 18 moving as requests
 * are served. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "cache/cache.h"
#include "daemon/daemon.h"
#include "helpers.h"
#include "helpers_json.h"
#include "util/util.h"

static char *tmpdir;
static char model[1024];
static pid_t daemon_pid;
static int port;

static void setup(void) {
    tmpdir = th_mkdtemp();
    cr_assert_not_null(tmpdir);
}

static void teardown(void) {
    th_daemon_stop(&daemon_pid, SIGKILL);
    th_rmtree(tmpdir);
    free(tmpdir);
    tmpdir = NULL;
}

TestSuite(logging, .init = setup, .fini = teardown, .timeout = 240);

/* ---- the logger on a real stream ------------------------------------------- */

/* Everything the logger wrote to f, from the start. */
static char *contents(FILE *f) {
    fflush(f);
    rewind(f);
    char *text = NULL;
    size_t len = 0;
    pd_error err = {0};
    cr_assert_eq(pd_read_stream(f, &text, &len, &err), PD_OK, "%s", err.msg);
    return text;
}

Test(logging, text_lines_have_a_timestamp_the_level_and_logfmt_fields) {
    FILE *f = tmpfile();
    cr_assert_not_null(f);
    const pd_logger lg = {.level = PD_LOG_INFO, .format = PD_LOG_TEXT, .sink = f};
    const pd_log_field fields[] = {PD_LOG_STR("route", "/v1/completions"), PD_LOG_INT("status", 404),
                                   PD_LOG_NUM("ttft_s", 0.25), PD_LOG_STR("error", "no \"such\" model"),
                                   PD_LOG_STR("namespace", ""), PD_LOG_STR("absent", NULL)};
    pd_log_fields(&lg, PD_LOG_INFO, "request", fields, sizeof fields / sizeof fields[0]);
    pd_log(&lg, PD_LOG_WARN, "disk %d%% full", 95);
    pd_log(&lg, PD_LOG_DEBUG, "not written at info");
    char *text = contents(f);
    char *second = strchr(text, '\n');
    cr_assert_not_null(second, "%s", text);
    *second++ = '\0';
    /* 2026-01-02T03:04:05.678Z: 24 characters, then the line */
    cr_assert_eq(strlen(text) > 25 && text[4] == '-' && text[10] == 'T' && text[19] == '.' && text[23] == 'Z', 1,
                 "%s", text);
    cr_assert_str_eq(text + 24, " prefixd: request route=/v1/completions status=404 ttft_s=0.25 "
                                "error=\"no \\\"such\\\" model\" namespace=\"\"");
    cr_assert_str_eq(second + 24, " prefixd: warning: disk 95% full\n");
    free(text);
    fclose(f);
}

Test(logging, json_lines_are_objects_with_typed_fields) {
    FILE *f = tmpfile();
    cr_assert_not_null(f);
    const pd_logger lg = {.level = PD_LOG_DEBUG, .format = PD_LOG_JSON, .sink = f};
    const pd_log_field fields[] = {PD_LOG_STR("request_id", "abc"), PD_LOG_INT("prompt_tokens", 1234567890123),
                                   PD_LOG_NUM("queue_s", 0.5), PD_LOG_STR("bad_utf8", "a\xff" "b\n")};
    pd_log_fields(&lg, PD_LOG_DEBUG, "line \"one\"", fields, sizeof fields / sizeof fields[0]);
    pd_log(&lg, PD_LOG_ERROR, "two");
    char *text = contents(f);
    char *second = strchr(text, '\n');
    cr_assert_not_null(second);
    *second++ = '\0';
    json_t *j = th_json_parse(text);
    cr_assert_str_eq(json_string_value(json_object_get(j, "level")), "debug");
    cr_assert_str_eq(json_string_value(json_object_get(j, "msg")), "line \"one\"");
    cr_assert(json_is_string(json_object_get(j, "ts")));
    cr_assert_str_eq(json_string_value(json_object_get(j, "request_id")), "abc");
    cr_assert_eq(json_integer_value(json_object_get(j, "prompt_tokens")), 1234567890123);
    cr_assert_float_eq(json_real_value(json_object_get(j, "queue_s")), 0.5, 1e-12);
    /* invalid UTF-8 does not lose the line */
    cr_assert_str_eq(json_string_value(json_object_get(j, "bad_utf8")), "a?b\n");
    json_decref(j);
    char *end = strchr(second, '\n');
    cr_assert(end && end[1] == '\0', "one object per line: %s", second);
    j = th_json_parse(second);
    cr_assert_str_eq(json_string_value(json_object_get(j, "level")), "error");
    cr_assert_str_eq(json_string_value(json_object_get(j, "msg")), "two");
    json_decref(j);
    free(text);
    fclose(f);
}

Test(logging, levels_filter_and_a_null_logger_is_silent) {
    FILE *f = tmpfile();
    cr_assert_not_null(f);
    const pd_logger lg = {.level = PD_LOG_WARN, .format = PD_LOG_TEXT, .sink = f};
    cr_assert(pd_log_enabled(&lg, PD_LOG_ERROR) && pd_log_enabled(&lg, PD_LOG_WARN));
    cr_assert(!pd_log_enabled(&lg, PD_LOG_INFO) && !pd_log_enabled(&lg, PD_LOG_DEBUG));
    cr_assert(!pd_log_enabled(NULL, PD_LOG_ERROR));
    pd_log(&lg, PD_LOG_INFO, "info");
    pd_log(&lg, PD_LOG_ERROR, "boom");
    pd_log(NULL, PD_LOG_ERROR, "nowhere");
    char *text = contents(f);
    cr_assert(strstr(text, "prefixd: error: boom\n") && !strstr(text, "info"), "%s", text);
    cr_assert_eq(strchr(text, '\n'), text + strlen(text) - 1, "one line: %s", text);
    free(text);
    fclose(f);
}

/* Without a journal to send to (no /run/systemd/journal/socket, as in a
 * container), the journal format writes the text line instead of losing it;
 * with one, the entry goes there and the stream stays empty. */
Test(logging, journal_format_falls_back_to_text_without_a_journal) {
    FILE *f = tmpfile();
    cr_assert_not_null(f);
    const pd_logger lg = {.level = PD_LOG_INFO, .format = PD_LOG_JOURNAL, .sink = f};
    const pd_log_field fields[] = {PD_LOG_STR("request_id", "r1")};
    pd_log_fields(&lg, PD_LOG_INFO, "hello", fields, 1);
    char *text = contents(f);
    if (access("/run/systemd/journal/socket", W_OK) == 0) cr_assert_str_eq(text, "");
    else cr_assert(strstr(text, " prefixd: hello request_id=r1\n"), "%s", text);
    free(text);
    fclose(f);
}

/* ---- the real daemon ---------------------------------------------------------- */

static void log_path(char *buf, size_t cap) { snprintf(buf, cap, "%s/prefixd.log", tmpdir); }

static void start_daemon(const char *extra) {
    TH_REQUIRE_SHARED();
    if (system("curl --version >/dev/null 2>&1") != 0) cr_skip_test("curl is not installed");
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    char args[4096], log[1200];
    snprintf(args, sizeof args, "--set model.path=%s --set cache.path=%s/store --set cache.map_size_mb=64 "
             "--set model.n_threads=1 --set server.model_names=test %s", model, tmpdir, extra ? extra : "");
    log_path(log, sizeof log);
    daemon_pid = th_daemon_start(args, log, &port);
    /* The start-up lines and the /health polls are not this test's requests. */
    cr_assert_eq(th_runf(NULL, ": > '%s'", log), 0);
}

/* The log so far; the daemon appends to it (O_APPEND), so it can be emptied. */
static char *read_log(void) {
    char log[1200], *text = NULL;
    size_t len = 0;
    pd_error err = {0};
    log_path(log, sizeof log);
    cr_assert_eq(pd_read_file(log, &text, &len, &err), PD_OK, "%s", err.msg);
    return text;
}

/* curl with an optional X-Request-Id; returns the status, *id_out gets the
 * X-Request-Id the answer carried ("" when none), *body the body. */
static int request(const char *method, const char *path, const char *json, const char *req_id, char *id_out,
                   size_t id_cap, char **body) {
    char headers[1200], data[1200], *out = NULL;
    snprintf(headers, sizeof headers, "%s/headers.txt", tmpdir);
    snprintf(data, sizeof data, "%s/data.json", tmpdir);
    if (json) {
        FILE *f = fopen(data, "w");
        cr_assert_not_null(f);
        fputs(json, f);
        fclose(f);
    }
    char idh[300] = "";
    if (req_id) snprintf(idh, sizeof idh, "-H 'X-Request-Id: %s'", req_id);
    cr_assert_eq(th_runf(&out, "curl -s -X %s -D '%s' -o '%s/body.out' -w '%%{http_code}' %s %s%s%s "
                               "'http://127.0.0.1:%d%s'",
                         method, headers, tmpdir, idh, json ? "-H 'Content-Type: application/json' --data-binary '@" : "",
                         json ? data : "", json ? "'" : "", port, path),
                 0);
    const int status = atoi(out);
    free(out);
    char *hdrs = NULL;
    size_t len = 0;
    pd_error err = {0};
    cr_assert_eq(pd_read_file(headers, &hdrs, &len, &err), PD_OK, "%s", err.msg);
    id_out[0] = '\0';
    for (char *line = strtok(hdrs, "\r\n"); line; line = strtok(NULL, "\r\n"))
        if (strncasecmp(line, "X-Request-Id: ", 14) == 0) snprintf(id_out, id_cap, "%s", line + 14);
    free(hdrs);
    if (body) {
        char bp[1200];
        snprintf(bp, sizeof bp, "%s/body.out", tmpdir);
        cr_assert_eq(pd_read_file(bp, body, &len, &err), PD_OK, "%s", err.msg);
    }
    return status;
}

/* The JSON access lines of a log, by request id; fails on any line that is
 * not a JSON object. */
static json_t *access_lines(const char *log, int *n_lines) {
    json_t *by_id = json_object();
    char *copy = strdup(log);
    *n_lines = 0;
    for (char *save = NULL, *line = strtok_r(copy, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        json_t *j = th_json_parse(line);
        cr_assert(json_is_object(j), "%s", line);
        const char *ev = json_string_value(json_object_get(j, "event"));
        if (ev && strcmp(ev, "access") == 0) {
            const char *id = json_string_value(json_object_get(j, "request_id"));
            cr_assert_not_null(id, "%s", line);
            cr_assert_null(json_object_get(by_id, id), "two access lines for %s", id);
            json_object_set(by_id, id, j);
            (*n_lines)++;
        }
        json_decref(j);
    }
    free(copy);
    return by_id;
}

static const char *completion = "{\"model\":\"test\",\"prompt\":\"Once upon a time\",\"max_tokens\":6,\"temperature\":0}";

Test(logging, json_access_line_per_request_with_usage_and_the_echoed_request_id) {
    start_daemon("--set log.format=json");
    char id[128], *body = NULL;
    cr_assert_eq(request("POST", "/v1/completions", completion, "client-id.1:A_b", id, sizeof id, &body), 200);
    cr_assert_str_eq(id, "client-id.1:A_b", "a sane client id is echoed");
    json_t *resp = th_json_parse(body);
    free(body);
    const json_int_t prompt = th_json_int(resp, "usage", "prompt_tokens");
    const json_int_t completion_tokens = th_json_int(resp, "usage", "completion_tokens");
    json_decref(resp);

    char gen_id[128], bad_id[128], missing_id[128], health_id[128];
    cr_assert_eq(request("POST", "/v1/completions", "{\"model\":\"nope\",\"prompt\":\"x\"}", NULL, gen_id,
                         sizeof gen_id, NULL), 404);
    cr_assert_eq(strlen(gen_id), 16, "a fresh id: %s", gen_id);
    cr_assert_eq(strspn(gen_id, "0123456789abcdef"), 16, "%s", gen_id);
    /* An id with a space (or too long) is replaced, not echoed. */
    cr_assert_eq(request("GET", "/health", NULL, "has space", bad_id, sizeof bad_id, NULL), 200);
    cr_assert_eq(strlen(bad_id), 16, "%s", bad_id);
    cr_assert_eq(request("GET", "/no/such/route", NULL, NULL, missing_id, sizeof missing_id, NULL), 404);
    char long_id[100];
    memset(long_id, 'a', 65);
    long_id[65] = '\0';
    cr_assert_eq(request("GET", "/health", NULL, long_id, health_id, sizeof health_id, NULL), 200);
    cr_assert_eq(strlen(health_id), 16, "a 65-character id is replaced: %s", health_id);
    th_daemon_stop(&daemon_pid, SIGTERM);

    char *log = read_log();
    int n = 0;
    json_t *lines = access_lines(log, &n);
    /* One line per request: ours, and perhaps the last /health poll of
     * the start, whose line may follow its answer by a moment. */
    const char *ours[] = {"client-id.1:A_b", gen_id, bad_id, missing_id, health_id};
    const char *key;
    json_t *line;
    json_object_foreach(lines, key, line) {
        bool mine = false;
        for (size_t i = 0; i < sizeof ours / sizeof ours[0]; i++) mine |= strcmp(key, ours[i]) == 0;
        cr_assert(mine || strcmp(json_string_value(json_object_get(line, "route")), "/health") == 0,
                  "an access line for no request of ours: %s\n%s", key, log);
        n -= !mine;
    }
    cr_assert_eq(n, 5, "one access line per request:\n%s", log);
    json_t *a = json_object_get(lines, "client-id.1:A_b");
    cr_assert_not_null(a, "%s", log);
    cr_assert_str_eq(json_string_value(json_object_get(a, "level")), "info");
    cr_assert_str_eq(json_string_value(json_object_get(a, "method")), "POST");
    cr_assert_str_eq(json_string_value(json_object_get(a, "route")), "/v1/completions");
    cr_assert_eq(json_integer_value(json_object_get(a, "status")), 200);
    cr_assert_eq(json_integer_value(json_object_get(a, "prompt_tokens")), prompt);
    cr_assert_eq(json_integer_value(json_object_get(a, "completion_tokens")), completion_tokens);
    cr_assert_eq(json_integer_value(json_object_get(a, "cached_tokens")), 0);
    cr_assert_str_eq(json_string_value(json_object_get(a, "namespace")), "");
    const double queue = json_real_value(json_object_get(a, "queue_s")),
                 ttft = json_real_value(json_object_get(a, "ttft_s")),
                 total = json_real_value(json_object_get(a, "duration_s"));
    cr_assert(queue >= 0 && ttft >= queue && total >= ttft && total < 60, "queue %g ttft %g total %g", queue, ttft,
              total);
    cr_assert_null(json_object_get(a, "error"));

    json_t *e = json_object_get(lines, gen_id);
    cr_assert_not_null(e, "%s", log);
    cr_assert_eq(json_integer_value(json_object_get(e, "status")), 404);
    cr_assert(strstr(json_string_value(json_object_get(e, "error")), "'nope' is not served here"), "%s", log);
    cr_assert_null(json_object_get(e, "prompt_tokens"), "a request that never ran has no usage");
    json_t *m = json_object_get(lines, missing_id);
    cr_assert_not_null(m, "%s", log);
    cr_assert_str_eq(json_string_value(json_object_get(m, "route")), "other", "unknown paths share one route label");
    cr_assert_not_null(json_object_get(lines, bad_id));
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(lines, health_id), "route")), "/health");
    json_decref(lines);
    free(log);
}

Test(logging, text_access_lines_and_level_filtering) {
    start_daemon(NULL);
    char id[128];
    cr_assert_eq(request("POST", "/v1/completions", completion, "text-1", id, sizeof id, NULL), 200);
    cr_assert_eq(request("GET", "/v1/models", NULL, "text-2", id, sizeof id, NULL), 200);
    /* Stopped before the log is read, as in the other tests: an access line
     * is written when its connection finishes, a moment after the client
     * has the answer (a clean-clone run here once read the log first). */
    th_daemon_stop(&daemon_pid, SIGTERM);
    char *log = read_log();
    cr_assert(strstr(log, " prefixd: request event=access request_id=text-1 method=POST route=/v1/completions "
                          "status=200 duration_s="),
              "%s", log);
    cr_assert(strstr(log, " prompt_tokens=") && strstr(log, " ttft_s="), "%s", log);
    cr_assert(strstr(log, " request_id=text-2 method=GET route=/v1/models status=200 "), "%s", log);
    free(log);

    /* At warn, the access lines of answered requests (info) are left out. */
    start_daemon("--set log.level=warn");
    cr_assert_eq(request("POST", "/v1/completions", completion, "quiet-1", id, sizeof id, NULL), 200);
    cr_assert_eq(request("GET", "/nothing", NULL, "quiet-2", id, sizeof id, NULL), 404);
    cr_assert_str_eq(id, "quiet-2", "the header does not depend on the log level");
    th_daemon_stop(&daemon_pid, SIGTERM);
    log = read_log();
    cr_assert_null(strstr(log, "quiet-"), "%s", log);
    cr_assert_null(strstr(log, "draining"), "info lines at warn: %s", log);
    free(log);
}

/* Every line of a streamed request is still one access line, written when
 * the stream ends. */
Test(logging, a_stream_gets_one_access_line_when_it_ends) {
    start_daemon("--set log.format=json");
    char id[128], *body = NULL;
    cr_assert_eq(request("POST", "/v1/completions",
                         "{\"model\":\"test\",\"prompt\":\"Once upon a time\",\"max_tokens\":5,"
                         "\"stream\":true,\"stream_options\":{\"include_usage\":true}}",
                         "stream-1", id, sizeof id, &body),
                 200);
    cr_assert_str_eq(id, "stream-1");
    free(body);
    th_daemon_stop(&daemon_pid, SIGTERM);
    char *log = read_log();
    int n = 0;
    json_t *lines = access_lines(log, &n);
    json_t *a = json_object_get(lines, "stream-1");
    cr_assert_not_null(a, "%s", log);
    cr_assert_str_eq(json_string_value(json_object_get(a, "route")), "/v1/completions");
    cr_assert_str_eq(json_string_value(json_object_get(a, "stream")), "true");
    cr_assert_gt(json_integer_value(json_object_get(a, "completion_tokens")), 0, "%s", log);
    json_decref(lines);
    free(log);
}

/* A registration job: a start line and a done line naming the stored prefix. */
Test(logging, jobs_log_their_start_and_end) {
    start_daemon("--set log.format=json --set admin.token=adm1n-token-0123456789");
    char *out = NULL;
    char bodyf[1200];
    snprintf(bodyf, sizeof bodyf, "%s/job.json", tmpdir);
    cr_assert_eq(th_http(port, "POST", "/admin/v1/prefixes",
                         "{\"text\":\"Once upon a time, there was a little girl named Lily. She loved to play.\","
                         "\"policy\":\"knorm\",\"retention\":0.5,\"wait\":true}",
                         "adm1n-token-0123456789", bodyf, &out),
                 201, "%s", out);
    json_t *j = th_json_parse(out);
    free(out);
    const char *prefix_id = json_string_value(json_object_get(json_object_get(j, "prefix"), "id"));
    cr_assert_not_null(prefix_id);
    char want[128];
    snprintf(want, sizeof want, "\"prefix_id\":\"%s\"", prefix_id);
    json_decref(j);
    th_daemon_stop(&daemon_pid, SIGTERM);
    char *log = read_log();
    cr_assert(strstr(log, "\"msg\":\"job started\"") && strstr(log, "\"event\":\"job_start\""), "%s", log);
    cr_assert(strstr(log, "\"msg\":\"job done\"") && strstr(log, want), "%s", log);
    cr_assert(strstr(log, "\"route\":\"/admin/v1/prefixes\",\"status\":201"), "%s", log);
    free(log);
}

/* A job that fails says so at warn, with its error; the next one that
 * succeeds logs its start and end. The jobs service on a real store and
 * model, its lines on a real stream. */
Test(logging, a_failed_job_is_logged_with_its_error) {
    TH_REQUIRE_SHARED();
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    FILE *f = tmpfile();
    cr_assert_not_null(f);
    const pd_logger lg = {.level = PD_LOG_INFO, .format = PD_LOG_JSON, .sink = f};
    pd_store_opts so;
    pd_store_opts_default(&so);
    so.dir = tmpdir;
    so.map_size = 64ull << 20;
    pd_store *store = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_store_open(&so, &store, &err), PD_OK, "%s", err.msg);
    pd_jobs_opts o;
    pd_jobs_opts_default(&o);
    o.model_path = model;
    o.store = store;
    o.logger = &lg;
    pd_jobs *j = NULL;
    cr_assert_eq(pd_jobs_create(&o, &j, &err), PD_OK, "%s", err.msg);
    pd_token t[40];
    for (int i = 0; i < 40; i++) t[i] = 3 + (pd_token)(i * 7 % 500);
    t[0] = 1;
    t[10] = 100000; /* outside the vocabulary: the worker fails the job */
    uint64_t bad = 0, good = 0;
    pd_job_status st;
    cr_assert_eq(pd_jobs_submit(j, &(pd_job_spec){.tokens = t, .n = 40, .policy = "snapkv", .retention = 0.5}, &bad,
                                &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_jobs_wait(j, bad, 120, &st, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(st.state, PD_JOB_FAILED);
    t[10] = 7;
    cr_assert_eq(pd_jobs_submit(j, &(pd_job_spec){.tokens = t, .n = 40, .policy = "snapkv", .retention = 0.5}, &good,
                                &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_jobs_wait(j, good, 120, &st, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(st.state, PD_JOB_DONE, "%s", st.error);
    pd_jobs_free(j);
    pd_store_close(store);

    char *text = contents(f);
    fclose(f);
    int starts = 0, failed = 0, done = 0;
    for (char *save = NULL, *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        json_t *l = th_json_parse(line);
        const char *ev = json_string_value(json_object_get(l, "event"));
        const json_int_t id = json_integer_value(json_object_get(l, "job_id"));
        cr_assert_not_null(ev, "%s", line);
        if (strcmp(ev, "job_start") == 0) {
            starts++;
            cr_assert_eq(json_integer_value(json_object_get(l, "tokens")), 40, "%s", line);
        } else if (strcmp(ev, "job_failed") == 0) {
            failed++;
            cr_assert_eq(id, (json_int_t)bad, "%s", line);
            cr_assert_str_eq(json_string_value(json_object_get(l, "level")), "warn");
            cr_assert(strstr(json_string_value(json_object_get(l, "error")), "100000"), "%s", line);
        } else if (strcmp(ev, "job_done") == 0) {
            done++;
            cr_assert_eq(id, (json_int_t)good, "%s", line);
            cr_assert_eq(strlen(json_string_value(json_object_get(l, "prefix_id"))), 64, "%s", line);
        }
        json_decref(l);
    }
    cr_assert(starts == 2 && failed == 1 && done == 1, "starts %d failed %d done %d", starts, failed, done);
    free(text);
}

/* format = journal under a real journal socket: prefixd runs in a mount
 * namespace whose /run is a tmpfs holding a datagram socket at
 * systemd/journal/socket, and each entry (KEY=value lines) is kept. */
Test(logging, journal_entries_carry_structured_fields) {
    TH_REQUIRE_SHARED();
    if (system("unshare --mount true 2>/dev/null") != 0 && system("unshare --mount --map-root-user true 2>/dev/null") != 0)
        cr_skip_test("cannot make a mount namespace here (unshare --mount)");
    if (system("python3 --version >/dev/null 2>&1 && curl --version >/dev/null 2>&1") != 0)
        cr_skip_test("python3 and curl are needed");
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    const int p = th_free_port();
    char script[1200];
    snprintf(script, sizeof script, "%s/journal.sh", tmpdir);
    FILE *f = fopen(script, "w");
    cr_assert_not_null(f);
    fprintf(f,
            "set -e\n"
            "mount -t tmpfs tmpfs /run\n"
            "mkdir -p /run/systemd/journal\n"
            "timeout 120 python3 -c '\n"
            "import socket, sys\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
            "s.bind(\"/run/systemd/journal/socket\")\n"
            "open(sys.argv[1] + \".ready\", \"w\").close()\n"
            "with open(sys.argv[1], \"ab\") as out:\n"
            "    while True:\n"
            "        d = s.recv(1 << 20)\n"
            "        out.write(d + b\"\\x1e\\n\"); out.flush()\n"
            "' %s/journal.bin >/dev/null 2>&1 &\n"
            "py=$!\n"
            "while [ ! -e %s/journal.bin.ready ]; do sleep 0.05; done\n"
            "%s --set model.path=%s --set cache.path=%s/store --set cache.map_size_mb=64 --set model.n_threads=1 "
            "--set server.model_names=test --set server.port=%d --set log.format=journal 2>%s/stderr.log &\n"
            "d=$!\n"
            "for i in $(seq 200); do curl -sf http://127.0.0.1:%d/health >/dev/null && break; sleep 0.05; done\n"
            "curl -s -H 'X-Request-Id: journal-1' http://127.0.0.1:%d/v1/models >/dev/null\n"
            "kill -TERM $d; wait $d || true\n"
            "kill $py\n",
            tmpdir, tmpdir, getenv("PD_PREFIXD"), model, tmpdir, p, tmpdir, p, p);
    fclose(f);
    char *out = NULL;
    const int rc = th_runf(&out, "(unshare --mount sh '%s' || unshare --mount --map-root-user sh '%s') 2>&1", script,
                           script);
    cr_assert_eq(rc, 0, "%s", out);
    free(out);
    char path[1200], *entries = NULL;
    size_t len = 0;
    pd_error err = {0};
    snprintf(path, sizeof path, "%s/journal.bin", tmpdir);
    cr_assert_eq(pd_read_file(path, &entries, &len, &err), PD_OK, "%s", err.msg);
    cr_assert(strstr(entries, "MESSAGE=serving test") && strstr(entries, "SYSLOG_IDENTIFIER=prefixd\n") &&
                  strstr(entries, "PRIORITY=6\n"),
              "%s", entries);
    /* the access line: one entry with the fields as upper-case keys */
    char *access = strstr(entries, "REQUEST_ID=journal-1\n");
    cr_assert_not_null(access, "%s", entries);
    char *start = access;
    while (start > entries && !(start[-1] == '\n' && start[-2] == '\x1e')) start--;
    char *end = strstr(access, "\x1e\n");
    cr_assert_not_null(end);
    *end = '\0';
    cr_assert(strstr(start, "MESSAGE=request\n") && strstr(start, "ROUTE=/v1/models\n") &&
                  strstr(start, "STATUS=200\n") && strstr(start, "EVENT=access\n"),
              "%s", start);
    free(entries);
    /* nothing fell back to stderr: the journal took every line */
    char *stderr_text = NULL;
    snprintf(path, sizeof path, "%s/stderr.log", tmpdir);
    cr_assert_eq(pd_read_file(path, &stderr_text, &len, &err), PD_OK, "%s", err.msg);
    cr_assert_null(strstr(stderr_text, "prefixd: "), "%s", stderr_text);
    free(stderr_text);
}

/* ---- /metrics ---------------------------------------------------------------- */

/* A scrape once `series` reads `want` (the previous request's line is
 * counted when its connection thread finishes it, a moment after the
 * client has its answer); at most about 2 s, then the last scrape. */
static char *scrape_when(const char *series, double want) {
    char *out = NULL;
    for (int i = 0; i < 200; i++) {
        free(out);
        cr_assert_eq(th_http(port, "GET", "/metrics", NULL, NULL, NULL, &out), 200, "%s", out);
        if (th_metric(out, series) == want) break;
        usleep(10000);
    }
    return out;
}

static char *scrape(void) {
    char *out = NULL;
    cr_assert_eq(th_http(port, "GET", "/metrics", NULL, NULL, NULL, &out), 200, "%s", out);
    return out;
}

/* The _bucket values of one histogram series, in order; checks they never
 * decrease and end with +Inf. Returns how many. */
static int buckets(const char *text, const char *name, const char *labels, double *out, int cap) {
    char prefix[256];
    snprintf(prefix, sizeof prefix, "%s_bucket{%s%sle=\"", name, labels, labels[0] ? "," : "");
    int n = 0;
    bool inf = false;
    for (const char *p = strstr(text, prefix); p; p = strstr(p + 1, prefix)) {
        const char *q = strchr(p, '}');
        cr_assert_not_null(q);
        cr_assert_lt(n, cap);
        out[n] = strtod(q + 2, NULL);
        if (n > 0) cr_assert_geq(out[n], out[n - 1], "%s buckets decrease:\n%s", name, text);
        inf = strncmp(p + strlen(prefix), "+Inf\"", 5) == 0;
        n++;
    }
    cr_assert(inf, "%s{%s} has no +Inf bucket last:\n%s", name, labels, text);
    return n;
}

Test(logging, metrics_series_exist_and_move_with_requests) {
    start_daemon(NULL);
    char *before = scrape();
    char want[256];
    snprintf(want, sizeof want, "prefixd_build_info{version=\"%s\",commit=\"", PREFIXD_VERSION);
    cr_assert(strstr(before, want) && strstr(before, "backend=\"cpu\"} 1\n"), "%s", before);
    cr_assert_gt(th_metric(before, "process_resident_memory_bytes"), 1e6, "%s", before);
    cr_assert_gt(th_metric(before, "process_open_fds"), 3, "%s", before);
    cr_assert_geq(th_metric(before, "process_max_fds"), th_metric(before, "process_open_fds"));
    cr_assert_geq(th_metric(before, "process_cpu_seconds_total"), 0);
    const double start = th_metric(before, "process_start_time_seconds");
    cr_assert(start > 1.5e9 && start <= (double)time(NULL) + 1, "%f", start);
    const double count0 = th_metric(before, "prefixd_http_requests_total{route=\"/v1/completions\",status=\"200\"}");
    cr_assert_eq(count0, -1, "no completion yet, no series:\n%s", before);
    const double prefill0 = th_metric(before, "prefixd_prefill_duration_seconds_count");
    cr_assert_eq(prefill0, 0, "%s", before);

    enum { N = 3 };
    char id[64];
    for (int i = 0; i < N; i++) cr_assert_eq(request("POST", "/v1/completions", completion, NULL, id, sizeof id, NULL), 200);
    cr_assert_eq(request("POST", "/v1/completions", "{\"model\":\"test\"}", NULL, id, sizeof id, NULL), 400);
    char *after = scrape_when("prefixd_http_requests_total{route=\"/v1/completions\",status=\"400\"}", 1);
    cr_assert_eq(th_metric(after, "prefixd_http_requests_total{route=\"/v1/completions\",status=\"200\"}"), N, "%s",
                 after);
    cr_assert_eq(th_metric(after, "prefixd_http_requests_total{route=\"/v1/completions\",status=\"400\"}"), 1, "%s",
                 after);
    cr_assert_geq(th_metric(after, "prefixd_http_requests_total{route=\"/metrics\",status=\"200\"}"), 1,
                  "the first scrape counted once it was answered:\n%s", after);
    const char *route = "route=\"/v1/completions\"";
    double b[64];
    int nb = buckets(after, "prefixd_http_request_duration_seconds", route, b, 64);
    cr_assert_eq(b[nb - 1], N + 1, "every /v1/completions request observed once:\n%s", after);
    cr_assert_eq(th_metric(after, "prefixd_http_request_duration_seconds_count{route=\"/v1/completions\"}"), N + 1);
    cr_assert_gt(th_metric(after, "prefixd_http_request_duration_seconds_sum{route=\"/v1/completions\"}"), 0);
    nb = buckets(after, "prefixd_prefill_duration_seconds", "", b, 64);
    cr_assert_eq(b[nb - 1], N, "one prefill per generation:\n%s", after);
    cr_assert_eq(th_metric(after, "prefixd_prefill_duration_seconds_count"), N);
    cr_assert_geq(th_metric(after, "process_cpu_seconds_total"), th_metric(before, "process_cpu_seconds_total"));
    free(before);
    free(after);
}
