/* The admin API on the real daemon, driven by curl: registering prefixes
 * (text, chat messages, segments; waiting and asynchronous), using them from
 * completions, list/show/delete, authentication, errors, a separate admin
 * listener, persistence across a restart, and `prefixctl prefix`. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <jansson.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "helpers.h"
#include "helpers_json.h"
#include "policies/policies.h"
#include "tools/tools.h"

#define TOKEN "adm1n-t0ken"

static char *tmpdir;
static char model[1024];
static pid_t daemon_pid;
static pid_t proxy_pid; /* HAProxy of the https test, stopped by teardown */
static int port, admin_port;

static const char *story = "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
                           "sunshine. One day, she saw a big tree with a red ball in it. She wanted the ball very much.";

static void setup(void) {
    tmpdir = th_mkdtemp();
    cr_assert_not_null(tmpdir);
    if (system("curl --version >/dev/null 2>&1") != 0) cr_skip_test("curl is not installed");
}

static void stop_daemon(int sig) { th_daemon_stop(&daemon_pid, sig); }

static void teardown(void) {
    if (proxy_pid > 0) {
        kill(proxy_pid, SIGKILL);
        waitpid(proxy_pid, NULL, 0);
        proxy_pid = 0;
    }
    stop_daemon(SIGKILL);
    th_rmtree(tmpdir);
    free(tmpdir);
    tmpdir = NULL;
}

TestSuite(admin, .init = setup, .fini = teardown, .timeout = 240);

/* Start prefixd on model_path (NULL: stories260K) with extra --set
 * arguments and the store in tmpdir/store; wait until /health says ok. */
static void start_daemon_on(const char *model_path, const char *extra) {
    if (!model_path) {
        TH_REQUIRE_SHARED();
        cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
        model_path = model;
    }
    char args[4096], log[1200];
    snprintf(args, sizeof args, "--set model.path=%s --set cache.path=%s/store --set cache.map_size_mb=64 "
             "--set model.n_threads=2 --set compression.min_prefix_tokens=8 --set server.model_names=test %s",
             model_path, tmpdir, extra ? extra : "");
    snprintf(log, sizeof log, "%s/prefixd.log", tmpdir);
    daemon_pid = th_daemon_start(args, log, &port);
}

static void start_daemon(const char *extra) {
    start_daemon_on(NULL, extra);
}

/* An HTTP request on port p; json may be NULL (no body). Returns the
 * status, the body in *out. */
static int req_on(int p, const char *method, const char *path, const char *json, const char *auth, char **out) {
    char body_path[1200];
    snprintf(body_path, sizeof body_path, "%s/body.json", tmpdir);
    return th_http(p, method, path, json, auth, body_path, out);
}

static int req(const char *method, const char *path, const char *json, const char *auth, char **out) {
    return req_on(port, method, path, json, auth, out);
}

/* cached_tokens of a greedy completion of story + " Then" when a registered
 * prefix was used (the automatic cache's blocks of earlier requests: 0). */
static json_int_t completion_cached(const char *path, const char *body) {
    char *out = NULL;
    cr_assert_eq(req("POST", path, body, NULL, &out), 200, "%s", out);
    json_t *j = th_json_parse(out);
    json_int_t c = th_json_int(json_object_get(j, "usage"), "prompt_tokens_details", "cached_tokens");
    const char *kind = json_string_value(json_object_get(json_object_get(j, "prefix"), "kind"));
    if (c > 0 && (!kind || strcmp(kind, "registered") != 0)) c = 0;
    json_decref(j);
    free(out);
    return c;
}

static json_int_t story_cached(void) {
    char body[2048];
    snprintf(body, sizeof body, "{\"model\":\"test\",\"prompt\":\"%s Then\",\"max_tokens\":4,\"temperature\":0}", story);
    return completion_cached("/v1/completions", body);
}

/* Register story as text; returns the parsed 201 answer. */
static json_t *register_story(const char *extra) {
    char body[2048], *out = NULL;
    snprintf(body, sizeof body, "{\"text\":\"%s\",\"policy\":\"knorm\",\"retention\":0.5,\"wait\":true%s}", story,
             extra ? extra : "");
    cr_assert_eq(req("POST", "/admin/v1/prefixes", body, TOKEN, &out), 201, "%s", out);
    json_t *j = th_json_parse(out);
    free(out);
    cr_assert_str_eq(json_string_value(json_object_get(j, "state")), "done");
    return j;
}

/* The number of story tokens as completions see them (BOS included). */
static json_int_t story_tokens(void) {
    char body[2048];
    snprintf(body, sizeof body, "{\"model\":\"test\",\"prompt\":\"%s\",\"max_tokens\":1,\"cache\":\"off\"}", story);
    char *out = NULL;
    cr_assert_eq(req("POST", "/v1/completions", body, NULL, &out), 200, "%s", out);
    json_t *j = th_json_parse(out);
    json_int_t n = th_json_int(j, "usage", "prompt_tokens");
    json_decref(j);
    free(out);
    return n;
}

Test(admin, text_registration_is_used_listed_shown_and_deleted) {
    start_daemon("--set admin.token=" TOKEN);
    cr_assert_eq(story_cached(), 0, "nothing is stored yet");
    json_t *job = register_story(NULL);
    json_t *p = json_object_get(job, "prefix");
    json_int_t n = story_tokens();
    cr_assert_eq(th_json_int(p, "tokens", NULL), n, "the prefix is the story's tokens, BOS included");
    /* stories260K: 5 layers x 4 kv heads; knorm keeps half of each head's rows. */
    json_int_t full = n * 5 * 4, kept = th_json_int(p, "kept_rows", NULL);
    cr_assert(kept > 0 && kept <= full, "kept %lld of %lld", (long long)kept, (long long)full);
    double frac = json_real_value(json_object_get(p, "kept_fraction"));
    cr_assert_float_eq(frac, (double)kept / (double)full, 1e-9);
    cr_assert(frac >= 0.4 && frac <= 0.6, "retention 0.5 kept %.3f", frac);
    cr_assert(strstr(json_string_value(json_object_get(p, "policy")), "retention=0.5"));
    cr_assert_str_eq(json_string_value(json_object_get(p, "dtype")), "f16", "prefixes are stored as f16 by default");
    char id[80];
    snprintf(id, sizeof id, "%s", json_string_value(json_object_get(p, "id")));
    cr_assert_eq(strlen(id), 64);
    json_decref(job);

    cr_assert_eq(story_cached(), n, "the completion attends to the stored prefix");

    char *out = NULL, path[200];
    cr_assert_eq(req("GET", "/admin/v1/prefixes", NULL, TOKEN, &out), 200, "%s", out);
    json_t *l = th_json_parse(out);
    cr_assert_eq(json_array_size(json_object_get(l, "data")), 1, "%s", out);
    cr_assert_str_eq(json_string_value(json_object_get(json_array_get(json_object_get(l, "data"), 0), "id")), id);
    json_decref(l);
    free(out);
    cr_assert_eq(req("GET", "/admin/v1/prefixes?namespace=other", NULL, TOKEN, &out), 200, "%s", out);
    l = th_json_parse(out);
    cr_assert_eq(json_array_size(json_object_get(l, "data")), 0, "%s", out);
    json_decref(l);
    free(out);

    /* /metrics reports the store and the scheduler's prefix hit. */
    cr_assert_eq(req("GET", "/metrics", NULL, NULL, &out), 200, "%s", out);
    cr_assert(strstr(out, "\nprefixd_store_prefixes 1\n"), "%s", out);
    cr_assert(strstr(out, "\nprefixd_prefix_hits_total 1\n"), "%s", out);
    const char *sb = strstr(out, "\nprefixd_store_bytes ");
    cr_assert(sb && atof(sb + 21) > 0, "%s", out);
    free(out);

    snprintf(path, sizeof path, "/admin/v1/prefixes/%s", id);
    cr_assert_eq(req("GET", path, NULL, TOKEN, &out), 200, "%s", out);
    json_t *s = th_json_parse(out);
    cr_assert_str_eq(json_string_value(json_object_get(s, "id")), id);
    cr_assert_eq(th_json_int(s, "kept_rows", NULL), kept);
    json_decref(s);
    free(out);

    cr_assert_eq(req("DELETE", path, NULL, TOKEN, &out), 204, "%s", out);
    free(out);
    cr_assert_eq(req("GET", path, NULL, TOKEN, &out), 404, "%s", out);
    free(out);
    cr_assert_eq(req("DELETE", path, NULL, TOKEN, &out), 404, "%s", out);
    free(out);
    cr_assert_eq(story_cached(), 0, "a deleted prefix is not used");
}

Test(admin, async_registration_polls_to_done) {
    start_daemon("--set admin.token=" TOKEN);
    char body[2048], *out = NULL;
    /* No policy: the configured default (compression.policy). */
    snprintf(body, sizeof body, "{\"text\":\"%s\"}", story);
    cr_assert_eq(req("POST", "/admin/v1/prefixes", body, TOKEN, &out), 202, "%s", out);
    json_t *j = th_json_parse(out);
    free(out);
    json_int_t id = th_json_int(j, "job_id", NULL);
    char status_url[200];
    snprintf(status_url, sizeof status_url, "%s", json_string_value(json_object_get(j, "status_url")));
    json_decref(j);
    char expect[64];
    snprintf(expect, sizeof expect, "/admin/v1/jobs/%lld", (long long)id);
    cr_assert_str_eq(status_url, expect);
    json_t *st = NULL;
    for (int i = 0; i < 2400; i++) {
        cr_assert_eq(req("GET", status_url, NULL, TOKEN, &out), 200, "%s", out);
        st = th_json_parse(out);
        free(out);
        const char *state = json_string_value(json_object_get(st, "state"));
        cr_assert(strcmp(state, "failed") != 0, "job failed: %s", json_string_value(json_object_get(st, "error")));
        if (strcmp(state, "done") == 0) break;
        json_decref(st);
        st = NULL;
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    cr_assert_not_null(st, "the job did not finish");
    cr_assert_float_eq(json_real_value(json_object_get(st, "progress")), 1.0, 1e-9);
    cr_assert(strncmp(json_string_value(json_object_get(json_object_get(st, "prefix"), "policy")), "compactor", 9) == 0,
              "the default policy is compression.policy");
    json_decref(st);
    cr_assert_eq(story_cached(), story_tokens());
}

Test(admin, auth_and_bad_input_errors) {
    start_daemon("--set admin.token=" TOKEN);
    char *out = NULL, body[2048];
    snprintf(body, sizeof body, "{\"text\":\"%s\",\"wait\":true}", story);
    cr_assert_eq(req("POST", "/admin/v1/prefixes", body, NULL, &out), 401, "%s", out);
    json_t *j = th_json_parse(out);
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(j, "error"), "type")), "authentication_error");
    json_decref(j);
    free(out);
    cr_assert_eq(req("GET", "/admin/v1/prefixes", NULL, "wrong", &out), 401, "%s", out);
    free(out);
    const struct {
        const char *body, *param;
    } bad[] = {
        {"{not json", NULL},
        {"[1,2]", NULL},
        {"{}", "text"},
        {"{\"text\":\"a\",\"segments\":[{\"name\":\"a\",\"text\":\"b\"}]}", "segments"},
        {"{\"text\":42}", "text"},
        {"{\"text\":\"\"}", "text"},
        {"{\"text\":\"Hi\",\"retention\":2}", "retention"},
        {"{\"text\":\"Hi\",\"retention\":0.5,\"quality\":1.1}", "quality"},
        {"{\"text\":\"Hi\",\"quality\":0.5}", "quality"},
        {"{\"text\":\"Hi\",\"quality\":1}", "quality"}, /* tau 1 allows no loss: the jobs' rule */
        {"{\"text\":\"Hi\",\"quality\":11}", "quality"},
        {"{\"text\":\"Hi\",\"dtype\":\"f8\"}", "dtype"},
        {"{\"text\":\"Hi\",\"pin\":\"yes\"}", "pin"},
        {"{\"text\":\"Hi\",\"policy\":\"nosuchpolicy\"}", NULL},
        {"{\"segments\":[{\"name\":\"a b\",\"text\":\"x\"}]}", "segments[0].name"},
        {"{\"segments\":[{\"name\":\"a\",\"text\":\"\"}]}", "segments[0].text"},
        /* stories260K has no chat template */
        {"{\"messages\":[{\"role\":\"system\",\"content\":\"Be nice.\"}]}", "messages"},
        /* nesting past 16 levels, as for completions, even in an ignored field */
        {"{\"text\":\"Hi\",\"x\":[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]}", NULL},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_assert_eq(req("POST", "/admin/v1/prefixes", bad[i].body, TOKEN, &out), 400, "%s: %s", bad[i].body, out);
        j = th_json_parse(out);
        json_t *e = json_object_get(j, "error");
        cr_assert(json_is_string(json_object_get(e, "message")), "%s", out);
        cr_assert_str_eq(json_string_value(json_object_get(e, "type")), "invalid_request_error");
        if (bad[i].param)
            cr_assert_str_eq(json_string_value(json_object_get(e, "param")), bad[i].param, "%s: %s", bad[i].body,
                             out);
        json_decref(j);
        free(out);
    }
    cr_assert_eq(req("GET", "/admin/v1/jobs/999", NULL, TOKEN, &out), 404, "%s", out);
    free(out);
    cr_assert_eq(req("GET", "/admin/v1/jobs/abc", NULL, TOKEN, &out), 404, "%s", out);
    free(out);
    cr_assert_eq(req("GET", "/admin/v1/prefixes/zz", NULL, TOKEN, &out), 404, "%s", out);
    free(out);
    cr_assert_eq(req("GET", "/admin/v1/prefixes/"
                            "0000000000000000000000000000000000000000000000000000000000000000",
                     NULL, TOKEN, &out),
                 404, "%s", out);
    free(out);
    cr_assert_eq(req("PUT", "/admin/v1/prefixes", "{}", TOKEN, &out), 405, "%s", out);
    free(out);
    cr_assert_eq(req("GET", "/admin/v1/nothing", NULL, TOKEN, &out), 404, "%s", out);
    free(out);
    /* Nothing was stored by any of that. */
    cr_assert_eq(req("GET", "/admin/v1/prefixes", NULL, TOKEN, &out), 200, "%s", out);
    j = th_json_parse(out);
    cr_assert_eq(json_array_size(json_object_get(j, "data")), 0, "%s", out);
    json_decref(j);
    free(out);
}

Test(admin, disabled_without_a_token) {
    start_daemon(NULL);
    char *out = NULL;
    cr_assert_eq(req("GET", "/admin/v1/prefixes", NULL, NULL, &out), 404, "%s", out);
    free(out);
    cr_assert_eq(req("GET", "/admin/v1/prefixes", NULL, "anything", &out), 404, "%s", out);
    free(out);
}

Test(admin, separate_listener_serves_only_admin_routes) {
    admin_port = th_free_port();
    char extra[256];
    snprintf(extra, sizeof extra, "--set admin.token=" TOKEN " --set admin.port=%d", admin_port);
    start_daemon(extra);
    char *out = NULL;
    cr_assert_eq(req("GET", "/admin/v1/prefixes", NULL, TOKEN, &out), 404, "the public listener: %s", out);
    free(out);
    cr_assert_eq(req_on(admin_port, "GET", "/admin/v1/prefixes", NULL, TOKEN, &out), 200, "%s", out);
    free(out);
    cr_assert_eq(req_on(admin_port, "GET", "/admin/v1/prefixes", NULL, NULL, &out), 401, "%s", out);
    free(out);
    cr_assert_eq(req_on(admin_port, "GET", "/v1/models", NULL, NULL, &out), 404, "%s", out);
    free(out);
}

/* An f32 record is served by the default f16 KV cache (converted at load),
 * and, after a restart with model.kv_type = f32, read in place. */
Test(admin, a_restart_keeps_the_prefix) {
    start_daemon("--set admin.token=" TOKEN);
    json_t *job = register_story(",\"pin\":true,\"dtype\":\"f32\"");
    json_t *p = json_object_get(job, "prefix");
    cr_assert(json_is_true(json_object_get(p, "pinned")));
    cr_assert_str_eq(json_string_value(json_object_get(p, "dtype")), "f32");
    json_decref(job);
    json_int_t n = story_tokens();
    cr_assert_eq(story_cached(), n);
    kill(daemon_pid, SIGTERM);
    int st;
    cr_assert_eq(waitpid(daemon_pid, &st, 0), daemon_pid);
    daemon_pid = 0;
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d", st);
    start_daemon("--set admin.token=" TOKEN " --set model.kv_type=f32");
    cr_assert_eq(story_cached(), n, "the prefix survived the restart (served by an f32 KV cache)");
}

Test(admin, segments_with_a_kept_span) {
    start_daemon("--set admin.token=" TOKEN);
    /* story = "Once upon a time," + " there was ..." */
    const char *cut = strstr(story, " there");
    cr_assert_not_null(cut);
    char body[2048], *out = NULL, ids[2][80];
    json_int_t n = story_tokens();
    for (int keep = 1; keep >= 0; keep--) {
        snprintf(body, sizeof body, "{\"segments\":[{\"name\":\"intro\",\"text\":\"%.*s\",\"keep\":%s},"
                 "{\"name\":\"rest\",\"text\":\"%s\"}],\"policy\":\"knorm\",\"retention\":0.5,\"wait\":true}",
                 (int)(cut - story), story, keep ? "true" : "false", cut);
        cr_assert_eq(req("POST", "/admin/v1/prefixes", body, TOKEN, &out), 201, "%s", out);
        json_t *j = th_json_parse(out);
        free(out);
        json_t *p = json_object_get(j, "prefix");
        const char *policy = json_string_value(json_object_get(p, "policy"));
        /* The layout is part of the key: "spans=intro:0-K[!],rest:K-n". */
        const char *intro = strstr(policy, "intro:0-");
        cr_assert_not_null(intro, "%s", policy);
        char *after = NULL;
        long k = strtol(intro + 8, &after, 10);
        cr_assert(k > 1 && k < 10, "the intro is a few tokens (BOS included): %s", policy);
        cr_assert_eq(*after == '!', keep, "%s", policy);
        char rest[64];
        snprintf(rest, sizeof rest, "rest:%ld-%lld", k, (long long)n);
        cr_assert(strstr(policy, rest), "%s lacks %s", policy, rest);
        cr_assert_eq(th_json_int(p, "tokens", NULL), n, "segments tokenize as their concatenation");
        snprintf(ids[keep], sizeof ids[keep], "%s", json_string_value(json_object_get(p, "id")));
        json_decref(j);
        cr_assert_eq(story_cached(), n);
    }
    cr_assert_str_neq(ids[0], ids[1], "keeping a span is another prefix");
    /* A segment too short to hold a token of its own. */
    cr_assert_eq(req("POST", "/admin/v1/prefixes", "{\"segments\":[{\"name\":\"a\",\"text\":\"O\"},"
                     "{\"name\":\"b\",\"text\":\"n\"},{\"name\":\"c\",\"text\":\"ce upon a time\"}]}", TOKEN, &out), 400, "%s", out);
    free(out);
}

/* The error of a 400 answer: its param and message. */
static void expect_400(const char *body, const char *param, const char *says) {
    char *out = NULL;
    cr_assert_eq(req("POST", "/admin/v1/prefixes", body, TOKEN, &out), 400, "%s: %s", body, out);
    json_t *j = th_json_parse(out);
    json_t *e = json_object_get(j, "error");
    cr_assert_str_eq(json_string_value(json_object_get(e, "param")), param, "%s", out);
    cr_assert(strstr(json_string_value(json_object_get(e, "message")), says), "%s", out);
    json_decref(j);
    free(out);
}

/* "spans": "auto" and "keep_text" build the layout pd_layout_auto and
 * pd_layout_keep_phrases build from the same tokens (the key shows it). */
Test(admin, automatic_spans_and_kept_phrases) {
    start_daemon("--set admin.token=" TOKEN);
    pd_gguf *g = NULL;
    pd_tokenizer *tok = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open(model, &g, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_tokenizer_load(g, &tok, &err), PD_OK, "%s", err.msg);
    pd_gguf_close(g);
    pd_token *ids = NULL;
    size_t n = 0;
    pd_tokenize_opts o = {.add_special = true};
    cr_assert_eq(pd_tokenize(tok, story, strlen(story), o, &ids, &n, &err), PD_OK, "%s", err.msg);
    pd_layout lay;
    const char *phrases[] = {"red ball", "Lily"};
    cr_assert_eq(pd_layout_auto(tok, ids, (int64_t)n, NULL, &lay, &err), PD_OK, "%s", err.msg);
    cr_assert_gt(lay.n_spans, 1);
    cr_assert_eq(pd_layout_keep_phrases(tok, ids, (int64_t)n, phrases, 2, &lay, NULL, &err), PD_OK, "%s", err.msg);
    char want[1024] = "|";
    pd_layout_print(&lay, want + 1, sizeof want - 1);

    char body[2048], *out = NULL;
    snprintf(body, sizeof body, "{\"text\":\"%s\",\"policy\":\"knorm:fair=1\",\"retention\":0.5,\"spans\":\"auto\","
             "\"keep_text\":[\"red ball\",\"Lily\"],\"wait\":true}", story);
    cr_assert_eq(req("POST", "/admin/v1/prefixes", body, TOKEN, &out), 201, "%s", out);
    json_t *j = th_json_parse(out);
    free(out);
    json_t *p = json_object_get(j, "prefix");
    const char *policy = json_string_value(json_object_get(p, "policy"));
    const char *bar = strchr(policy, '|');
    cr_assert(bar && strcmp(bar, want) == 0, "%s\nwant the layout %s", policy, want);
    cr_assert(strstr(policy, "fair=1"), "%s", policy);
    json_decref(j);
    cr_assert_eq(story_cached(), (json_int_t)n, "completions use the prefix");

    /* Phrases in segments' text; spans come from the segments. */
    const char *cut = strstr(story, " One day");
    snprintf(body, sizeof body, "{\"segments\":[{\"name\":\"a\",\"text\":\"%.*s\"},{\"name\":\"b\",\"text\":\"%s\"}],"
             "\"keep_text\":[\"red ball\"],\"policy\":\"knorm\",\"retention\":0.5,\"wait\":true}",
             (int)(cut - story), story, cut);
    cr_assert_eq(req("POST", "/admin/v1/prefixes", body, TOKEN, &out), 201, "%s", out);
    j = th_json_parse(out);
    free(out);
    policy = json_string_value(json_object_get(json_object_get(j, "prefix"), "policy"));
    char keep[64];
    for (int i = 0; i < lay.n_whitelist; i++) /* the one "red ball" range of the library's layout */
        if (lay.whitelist[i].end - lay.whitelist[i].start >= 2)
            snprintf(keep, sizeof keep, ";keep=%lld-%lld", (long long)lay.whitelist[i].start,
                     (long long)lay.whitelist[i].end);
    cr_assert(strstr(policy, "|spans=a:0-") && strstr(policy, keep), "%s lacks %s", policy, keep);
    json_decref(j);

    /* Errors name the field. */
    snprintf(body, sizeof body, "{\"text\":\"%s\",\"keep_text\":[\"Lily\",\"purple cow\"]}", story);
    expect_400(body, "keep_text[1]", "'purple cow' does not occur");
    snprintf(body, sizeof body, "{\"text\":\"%s\",\"keep_text\":[\"Lily\",\"\"]}", story);
    expect_400(body, "keep_text[1]", "non-empty");
    snprintf(body, sizeof body, "{\"text\":\"%s\",\"keep_text\":[]}", story);
    expect_400(body, "keep_text", "1 to 64");
    snprintf(body, sizeof body, "{\"text\":\"%s\",\"spans\":\"sentences\"}", story);
    expect_400(body, "spans", "\"auto\"");
    expect_400("{\"segments\":[{\"name\":\"a\",\"text\":\"Once upon a time\"}],\"spans\":\"auto\"}", "spans",
               "segments already are the spans");
    /* fair=1 without spans fails the job: the registration says so. */
    snprintf(body, sizeof body, "{\"text\":\"%s\",\"policy\":\"knorm:fair=1\",\"wait\":true}", story);
    cr_assert_eq(req("POST", "/admin/v1/prefixes", body, TOKEN, &out), 400, "%s", out);
    free(out);
    pd_layout_free(&lay);
    free(ids);
    pd_tokenizer_free(tok);
}

/* The daemon on a generated model carrying the phi-3 vocabulary and chat
 * template, with a context that holds a system prompt and its tool list
 * (~200 tokens). */
static void start_daemon_phi3(void) {
    TH_REQUIRE_SHARED();
    char vpath[1024], mpath[1200];
    cr_assert_not_null(th_shared_file("vocab/ggml-vocab-phi-3.gguf", vpath, sizeof vpath));
    pd_testmodel_opts o;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset("tiny", &o, &err), PD_OK, "%s", err.msg);
    o.vocab_from = vpath;
    o.wtype = PD_TYPE_Q8_0;
    o.n_ctx = 1024;
    snprintf(mpath, sizeof mpath, "%s/phi3.gguf", tmpdir);
    cr_assert_eq(pd_testmodel_write(&o, mpath, NULL, &err), PD_OK, "%s", err.msg);
    start_daemon_on(mpath, "--set admin.token=" TOKEN);
}

Test(admin, chat_messages_register_the_system_prompt) {
    start_daemon_phi3();
    const char *sys = "You are a friendly storyteller. Tell short, happy stories about animals for children.";
    char body[2048], *out = NULL;
    snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"system\",\"content\":\"%s\"}],\"policy\":\"knorm\","
             "\"retention\":0.5,\"wait\":true}", sys);
    cr_assert_eq(req("POST", "/admin/v1/prefixes", body, TOKEN, &out), 201, "%s", out);
    json_t *j = th_json_parse(out);
    json_int_t n = th_json_int(json_object_get(j, "prefix"), "tokens", NULL);
    json_decref(j);
    free(out);
    cr_assert_gt(n, 10);
    char body_chat[2048];
    snprintf(body_chat, sizeof body_chat, "{\"model\":\"test\",\"messages\":[{\"role\":\"system\",\"content\":\"%s\"},"
             "{\"role\":\"user\",\"content\":\"A story about a cat.\"}],\"max_tokens\":4,\"temperature\":0}", sys);
    cr_assert_eq(completion_cached("/v1/chat/completions", body_chat), n, "the chat request used the system prefix");
    /* Another system prompt does not match. */
    snprintf(body, sizeof body, "{\"model\":\"test\",\"messages\":[{\"role\":\"system\",\"content\":\"Be terse.\"},"
             "{\"role\":\"user\",\"content\":\"A story about a cat.\"}],\"max_tokens\":4,\"temperature\":0}");
    cr_assert_eq(completion_cached("/v1/chat/completions", body), 0);
    /* A conversation without a leading system message has no prefix. */
    cr_assert_eq(req("POST", "/admin/v1/prefixes", "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}]}", TOKEN,
                     &out),
                 400, "%s", out);
    free(out);
    /* Automatic spans and a kept phrase over the rendered system turn. */
    snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"system\",\"content\":\"%s\"}],\"policy\":\"knorm:fair=1\","
             "\"retention\":0.5,\"spans\":\"auto\",\"keep_text\":[\"happy stories\"],\"wait\":true}", sys);
    cr_assert_eq(req("POST", "/admin/v1/prefixes", body, TOKEN, &out), 201, "%s", out);
    j = th_json_parse(out);
    free(out);
    const char *policy = json_string_value(json_object_get(json_object_get(j, "prefix"), "policy"));
    char end[48];
    snprintf(end, sizeof end, "-%lld;keep=", (long long)n);
    cr_assert(strstr(policy, "|spans=s0:0-") && strstr(policy, end), "%s: spans cover the %lld tokens", policy,
              (long long)n);
    json_decref(j);
    cr_assert_eq(completion_cached("/v1/chat/completions", body_chat), n);
}

/* A system prompt with its tool list is one stored prefix: registered with
 * the same tools, chat requests that offer them use it, and the calls come
 * back as tool_calls; a repeated tool request hits the automatic cache. */
Test(admin, a_system_prompt_with_tools_is_a_prefix_and_calls_come_back) {
    start_daemon_phi3();
    const char *tools = "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"The weather "
                        "in a city\",\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\","
                        "\"maxLength\":12}},\"required\":[\"city\"],\"additionalProperties\":false}}}]";
    const char *sys = "You are a weather assistant. Use the tools to answer questions about the weather.";
    char body[4096], *out = NULL;
    snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"system\",\"content\":\"%s\"}],\"tools\":%s,"
             "\"policy\":\"knorm\",\"retention\":0.5,\"wait\":true}", sys, tools);
    cr_assert_eq(req("POST", "/admin/v1/prefixes", body, TOKEN, &out), 201, "%s", out);
    json_t *j = th_json_parse(out);
    json_int_t n = th_json_int(json_object_get(j, "prefix"), "tokens", NULL);
    json_decref(j);
    free(out);
    /* the tool block is in the prefix: far longer than the system text alone */
    cr_assert_gt(n, 60);
    for (int seed = 0; seed < 3; seed++) {
        snprintf(body, sizeof body, "{\"model\":\"test\",\"messages\":[{\"role\":\"system\",\"content\":\"%s\"},"
                 "{\"role\":\"user\",\"content\":\"Weather in Oslo?\"}],\"tools\":%s,\"tool_choice\":\"required\","
                 "\"max_tokens\":48,\"temperature\":1,\"seed\":%d}", sys, tools, seed);
        cr_assert_eq(req("POST", "/v1/chat/completions", body, NULL, &out), 200, "%s", out);
        j = th_json_parse(out);
        free(out);
        cr_assert_eq(th_json_int(json_object_get(j, "usage"), "prompt_tokens_details", "cached_tokens"), n);
        cr_assert_str_eq(json_string_value(json_object_get(json_object_get(j, "prefix"), "kind")), "registered");
        json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
        cr_assert_str_eq(json_string_value(json_object_get(ch, "finish_reason")), "tool_calls");
        json_t *call = json_array_get(json_object_get(json_object_get(ch, "message"), "tool_calls"), 0);
        json_t *fn = json_object_get(call, "function");
        cr_assert_str_eq(json_string_value(json_object_get(fn, "name")), "get_weather");
        json_t *args = json_loads(json_string_value(json_object_get(fn, "arguments")), 0, NULL);
        cr_assert(json_is_string(json_object_get(args, "city")) && json_object_size(args) == 1);
        json_decref(args);
        json_decref(j);
    }
    /* Unregistered tools: the second identical request finds the first's
     * blocks in the automatic cache and still answers with calls. */
    snprintf(body, sizeof body, "{\"model\":\"test\",\"messages\":[{\"role\":\"system\",\"content\":\"You help with "
             "time zones and clocks around the world.\"},{\"role\":\"user\",\"content\":\"Time?\"}],\"tools\":"
             "[{\"type\":\"function\",\"function\":{\"name\":\"get_time\"}}],\"tool_choice\":\"required\","
             "\"max_tokens\":32,\"temperature\":0}");
    for (int round = 0; round < 2; round++) {
        cr_assert_eq(req("POST", "/v1/chat/completions", body, NULL, &out), 200, "%s", out);
        j = th_json_parse(out);
        json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
        cr_assert_str_eq(json_string_value(json_object_get(ch, "finish_reason")), "tool_calls", "%s", out);
        if (round == 1) {
            cr_assert_gt(th_json_int(json_object_get(j, "usage"), "prompt_tokens_details", "cached_tokens"), 16, "%s",
                         out);
            cr_assert_str_eq(json_string_value(json_object_get(json_object_get(j, "prefix"), "kind")), "auto");
        }
        free(out);
        json_decref(j);
    }
}

Test(admin, prefixctl_prefix_end_to_end) {
    char *out = NULL;
    if (th_runf(&out, "%s prefix --help >/dev/null 2>&1", getenv("PD_PREFIXCTL")) != 0) {
        free(out);
        cr_skip_test("prefixctl has no 'prefix' command yet (tools/prefixctl.c wires pd_prefix_cli)");
    }
    free(out);
    start_daemon("--set admin.token=" TOKEN);
    char text[1200];
    snprintf(text, sizeof text, "%s/prefix.txt", tmpdir);
    FILE *f = fopen(text, "w");
    cr_assert_not_null(f);
    fputs(story, f);
    fclose(f);
    const char *ctl = getenv("PD_PREFIXCTL");
    char url[64];
    snprintf(url, sizeof url, "http://127.0.0.1:%d", port);
    /* Without a token: refused, exit 1. */
    cr_assert_eq(th_runf(&out, "env -u PREFIXD_ADMIN_TOKEN %s prefix --url %s list 2>&1", ctl, url), 1, "%s", out);
    free(out);
    cr_assert_eq(th_runf(&out, "%s prefix --url %s --token %s add --text %s --policy knorm --retention 0.5 2>/dev/null",
                     ctl, url, TOKEN, text),
                 0, "%s", out);
    json_t *j = th_json_parse(out);
    free(out);
    char id[80];
    snprintf(id, sizeof id, "%s", json_string_value(json_object_get(j, "id")));
    cr_assert_eq(strlen(id), 64);
    json_decref(j);
    cr_assert_eq(story_cached(), story_tokens());
    /* The token from the environment. */
    cr_assert_eq(th_runf(&out, "PREFIXD_ADMIN_TOKEN=%s %s prefix --url %s list", TOKEN, ctl, url), 0, "%s", out);
    cr_assert(strstr(out, id), "%s", out);
    free(out);
    cr_assert_eq(th_runf(&out, "%s prefix --url %s --token %s show %s", ctl, url, TOKEN, id), 0, "%s", out);
    j = th_json_parse(out);
    cr_assert_str_eq(json_string_value(json_object_get(j, "id")), id);
    json_decref(j);
    free(out);
    cr_assert_eq(th_runf(&out, "%s prefix --url %s --token %s job 1", ctl, url, TOKEN), 0, "%s", out);
    cr_assert(strstr(out, "\"done\""), "%s", out);
    free(out);
    for (int pin = 1; pin >= 0; pin--) {
        cr_assert_eq(th_runf(&out, "%s prefix --url %s --token %s %s %s", ctl, url, TOKEN, pin ? "pin" : "unpin", id), 0,
                     "%s", out);
        j = th_json_parse(out);
        cr_assert_eq(json_is_true(json_object_get(j, "pinned")), pin, "%s", out);
        cr_assert_eq(th_json_int(j, "hits", NULL), 1, "%s", out);
        json_decref(j);
        free(out);
    }
    cr_assert_eq(th_runf(&out, "%s prefix --url %s --token %s pin nothex 2>&1", ctl, url, TOKEN), 2, "%s", out);
    free(out);
    cr_assert_eq(th_runf(&out, "%s prefix --url %s --token %s delete %s", ctl, url, TOKEN, id), 0, "%s", out);
    free(out);
    cr_assert_eq(th_runf(&out, "%s prefix --url %s --token %s show %s 2>&1", ctl, url, TOKEN, id), 1, "%s", out);
    free(out);
    cr_assert_eq(story_cached(), 0);
    /* Automatic spans and kept phrases; a missing phrase is the daemon's 400. */
    cr_assert_eq(th_runf(&out, "%s prefix --url %s --token %s add --text %s --policy knorm:fair=1 --retention 0.5 "
                         "--spans-auto --keep-text 'red ball' --keep-text Lily 2>/dev/null", ctl, url, TOKEN, text),
                 0, "%s", out);
    j = th_json_parse(out);
    free(out);
    const char *policy = json_string_value(json_object_get(j, "policy"));
    cr_assert(strstr(policy, "|spans=s0:0-") && strstr(policy, ";keep="), "%s", policy);
    json_decref(j);
    cr_assert_eq(th_runf(&out, "%s prefix --url %s --token %s add --text %s --keep-text 'purple cow' 2>&1", ctl, url,
                         TOKEN, text),
                 1, "%s", out);
    cr_assert(strstr(out, "'purple cow' does not occur"), "%s", out);
    free(out);
}

/* Non-ASCII text through prefixctl: a --messages file written with \u
 * escapes (a surrogate pair included) registers the same prefix as the
 * same file in raw UTF-8, which a chat request in raw UTF-8 then uses; a
 * non-ASCII namespace is listed back byte for byte; the daemon's error
 * bodies reach the user decoded; https against the plain-http listener
 * fails with a TLS message. */
Test(admin, prefixctl_unicode_round_trip_and_errors) {
    /* Chat messages need a chat template: the phi-3 vocabulary carries one. */
    TH_REQUIRE_SHARED();
    char vpath[1024], mpath[1200];
    cr_assert_not_null(th_shared_file("vocab/ggml-vocab-phi-3.gguf", vpath, sizeof vpath));
    pd_testmodel_opts o;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset("tiny", &o, &err), PD_OK, "%s", err.msg);
    o.vocab_from = vpath;
    o.wtype = PD_TYPE_Q8_0;
    snprintf(mpath, sizeof mpath, "%s/phi3.gguf", tmpdir);
    cr_assert_eq(pd_testmodel_write(&o, mpath, NULL, &err), PD_OK, "%s", err.msg);
    start_daemon_on(mpath, "--set admin.token=" TOKEN);
    const char *ctl = getenv("PD_PREFIXCTL");
    char url[64], esc[1200], raw[1200], *out = NULL;
    snprintf(url, sizeof url, "http://127.0.0.1:%d", port);
    /* "Caf\u00e9 na\u00efve \u2014 \U0001F600" in both spellings, then the story. */
    const char *sys_raw = "Caf\xc3\xa9 na\xc3\xafve \xe2\x80\x94 \xf0\x9f\x98\x80";
    snprintf(esc, sizeof esc, "%s/esc.json", tmpdir);
    snprintf(raw, sizeof raw, "%s/raw.json", tmpdir);
    FILE *f = fopen(esc, "w");
    cr_assert_not_null(f);
    fprintf(f, "[{\"role\":\"system\",\"content\":\"Caf\\u00e9 na\\u00efve \\u2014 \\ud83d\\ude00 %s\"}]", story);
    fclose(f);
    f = fopen(raw, "w");
    cr_assert_not_null(f);
    fprintf(f, "[{\"role\":\"system\",\"content\":\"%s %s\"}]", sys_raw, story);
    fclose(f);
    char ids[2][80];
    const char *files[2] = {esc, raw};
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(th_runf(&out, "%s prefix --url %s --token %s add --messages %s --policy knorm --retention 0.5 "
                             "2>/dev/null", ctl, url, TOKEN, files[i]),
                     0, "%s", out);
        json_t *j = th_json_parse(out);
        snprintf(ids[i], sizeof ids[i], "%s", json_string_value(json_object_get(j, "id")));
        json_decref(j);
        free(out);
    }
    cr_assert_str_eq(ids[0], ids[1], "\\u escapes and raw UTF-8 are the same text");
    char body[2048];
    snprintf(body, sizeof body, "{\"model\":\"test\",\"messages\":[{\"role\":\"system\",\"content\":\"%s %s\"},"
             "{\"role\":\"user\",\"content\":\"Go on.\"}],\"max_tokens\":2,\"temperature\":0}", sys_raw, story);
    cr_assert_gt(completion_cached("/v1/chat/completions", body), 10, "the raw UTF-8 request used the prefix");

    /* A namespace beyond ASCII, listed back intact (and filtered by it). */
    const char *ns = "\xc3\xa9quipe-\xe6\x97\xa5\xe6\x9c\xac";
    char text[1200];
    snprintf(text, sizeof text, "%s/prefix.txt", tmpdir);
    f = fopen(text, "w");
    cr_assert_not_null(f);
    fputs(story, f);
    fclose(f);
    cr_assert_eq(th_runf(&out, "%s prefix --url %s --token %s add --text %s --namespace '%s' --retention 0.5 "
                         "2>/dev/null", ctl, url, TOKEN, text, ns),
                 0, "%s", out);
    json_t *j = th_json_parse(out);
    free(out);
    cr_assert_str_eq(json_string_value(json_object_get(j, "namespace")), ns);
    char id[80];
    snprintf(id, sizeof id, "%s", json_string_value(json_object_get(j, "id")));
    json_decref(j);
    cr_assert_eq(th_runf(&out, "%s prefix --url %s --token %s list --namespace '%s'", ctl, url, TOKEN, ns), 0);
    j = th_json_parse(out);
    free(out);
    json_t *data = json_object_get(j, "data");
    cr_assert_eq(json_array_size(data), 1, "only the prefix of that namespace");
    cr_assert_str_eq(json_string_value(json_object_get(json_array_get(data, 0), "id")), id);
    cr_assert_str_eq(json_string_value(json_object_get(json_array_get(data, 0), "namespace")), ns);
    json_decref(j);

    /* The daemon's error message, decoded, on stderr; exit 1. */
    cr_assert_eq(th_runf(&out, "%s prefix --url %s --token %s add --text %s --keep-text '%s' 2>&1", ctl, url, TOKEN,
                         text, sys_raw),
                 1, "%s", out);
    char want[128];
    snprintf(want, sizeof want, "HTTP 400: ");
    cr_assert(strstr(out, want), "%s", out);
    snprintf(want, sizeof want, "'%s' does not occur", sys_raw);
    cr_assert(strstr(out, want), "the phrase comes back intact: %s", out);
    free(out);
    cr_assert_eq(th_runf(&out, "%s prefix --url %s --token wrong list 2>&1", ctl, url), 1, "%s", out);
    cr_assert(strstr(out, "HTTP 401: "), "%s", out);
    free(out);
    cr_assert_eq(th_runf(&out, "%s prefix --url %s --token %s job 999 2>&1", ctl, url, TOKEN), 1, "%s", out);
    cr_assert(strstr(out, "HTTP 404: ") && !strstr(out, "is the admin API enabled"),
              "a missing job is not a missing route: %s", out);
    free(out);
    /* https to the plain-http listener: the TLS handshake fails, clearly. */
    cr_assert_eq(th_runf(&out, "%s prefix --url https://127.0.0.1:%d --token %s list 2>&1", ctl, port, TOKEN), 1);
    cr_assert(strstr(out, "TLS with https://127.0.0.1:") && strstr(out, "use http://"), "%s", out);
    free(out);
}

/* https for real: HAProxy terminates TLS (a throwaway certificate for
 * 127.0.0.1) in front of the admin listener. With --cacert the commands
 * work as over http; without it the certificate is refused, clearly. And
 * libcurl takes proxies from the environment: an http_proxy that refuses
 * connections is what fails, not the (unresolvable) host. */
Test(admin, prefixctl_over_https_and_through_proxy_variables) {
    if (system("haproxy -v >/dev/null 2>&1") != 0) cr_skip_test("haproxy is not installed");
    if (system("openssl version >/dev/null 2>&1") != 0) cr_skip_test("openssl is not installed");
    start_daemon("--set admin.token=" TOKEN);
    const int hp = th_free_port();
    char *out = NULL;
    cr_assert_eq(th_runf(&out, "cd %s && openssl req -x509 -newkey rsa:2048 -nodes -keyout key.pem -out cert.pem "
                               "-days 2 -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1 2>&1 && "
                               "cat cert.pem key.pem > both.pem", tmpdir),
                 0, "%s", out);
    free(out);
    char cfg[1200];
    snprintf(cfg, sizeof cfg, "%s/haproxy.cfg", tmpdir);
    FILE *f = fopen(cfg, "w");
    cr_assert_not_null(f);
    fprintf(f, "defaults\n    mode http\n    timeout connect 5s\n    timeout client 60s\n    timeout server 60s\n"
               "frontend tls\n    bind 127.0.0.1:%d ssl crt %s/both.pem\n    default_backend prefixd\n"
               "backend prefixd\n    server p 127.0.0.1:%d\n", hp, tmpdir, port);
    fclose(f);
    char *pid_text = NULL;
    cr_assert_eq(th_runf(&pid_text, "haproxy -f %s -db >%s/haproxy.log 2>&1 & echo $!", cfg, tmpdir), 0);
    proxy_pid = (pid_t)atoi(pid_text);
    free(pid_text);
    const char *ctl = getenv("PD_PREFIXCTL");
    int rc = 1;
    out = NULL;
    for (int i = 0; i < 100 && rc != 0; i++) { /* until HAProxy listens */
        free(out);
        rc = th_runf(&out, "%s prefix --url https://127.0.0.1:%d --cacert %s/cert.pem --token %s list 2>&1", ctl, hp,
                     tmpdir, TOKEN);
        if (rc) usleep(50 * 1000);
    }
    cr_assert_eq(rc, 0, "list over https: %s", out);
    json_t *j = th_json_parse(out);
    cr_assert(json_is_array(json_object_get(j, "data")), "%s", out);
    json_decref(j);
    free(out);
    char text[1200];
    snprintf(text, sizeof text, "%s/prefix.txt", tmpdir);
    f = fopen(text, "w");
    cr_assert_not_null(f);
    fputs(story, f);
    fclose(f);
    cr_assert_eq(th_runf(&out, "%s prefix --url https://127.0.0.1:%d --cacert %s/cert.pem --token %s add --text %s "
                         "--retention 0.5 2>/dev/null", ctl, hp, tmpdir, TOKEN, text),
                 0, "%s", out);
    j = th_json_parse(out);
    cr_assert_eq(strlen(json_string_value(json_object_get(j, "id"))), 64, "%s", out);
    json_decref(j);
    free(out);
    /* The system's CAs do not know the throwaway certificate. */
    cr_assert_eq(th_runf(&out, "%s prefix --url https://127.0.0.1:%d --token %s list 2>&1", ctl, hp, TOKEN), 1);
    cr_assert(strstr(out, "TLS with https://127.0.0.1:") && strstr(out, "--cacert"), "%s", out);
    free(out);
    kill(proxy_pid, SIGTERM);
    waitpid(proxy_pid, NULL, 0);
    proxy_pid = 0;

    const int closed = th_free_port();
    cr_assert_eq(th_runf(&out, "env -u no_proxy -u NO_PROXY http_proxy=http://127.0.0.1:%d %s prefix "
                               "--url http://prefixd.invalid:8080 --token t list 2>&1", closed, ctl),
                 1);
    char want[64];
    snprintf(want, sizeof want, "port %d", closed);
    cr_assert(strstr(out, "cannot connect to http://prefixd.invalid:8080") && strstr(out, want),
              "the proxy was used: %s", out);
    free(out);
}

/* A registration waiting for its job (wait: true) when the daemon is told to
 * stop is answered 202 with where to ask, as docs/api.md says, not with a
 * closed connection; the daemon still exits cleanly. */
Test(admin, a_waiting_registration_is_answered_202_at_shutdown) {
    char slow[1200], *out = NULL;
    th_slow_model(tmpdir, slow, sizeof slow);
    start_daemon_on(slow, "--set admin.token=" TOKEN);
    const size_t cap = 40 * (strlen(story) + 1) + 256;
    char *text = calloc(1, cap), *body = malloc(cap);
    for (int i = 0; i < 40; i++) strcat(strcat(text, story), " ");
    /* Three jobs ahead of the waiting one: it is still queued or running
     * when the stop comes. */
    const double ahead[3] = {0.3, 0.4, 0.6};
    json_int_t last_job = 0;
    for (int i = 0; i < 3; i++) {
        snprintf(body, cap, "{\"text\":\"%s\",\"policy\":\"compactor\",\"retention\":%.1f}", text, ahead[i]);
        cr_assert_eq(req("POST", "/admin/v1/prefixes", body, TOKEN, &out), 202, "%s", out);
        json_t *a = th_json_parse(out);
        last_job = th_json_int(a, "job_id", NULL);
        json_decref(a);
        free(out);
    }
    snprintf(body, cap, "{\"text\":\"%s\",\"policy\":\"compactor\",\"retention\":0.5,\"wait\":true}", text);
    char path[1200];
    snprintf(path, sizeof path, "%s/wait.json", tmpdir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(body, f);
    fclose(f);
    char *bg = NULL;
    cr_assert_eq(th_runf(&bg, "(curl -s -o %s/wait.out -w '%%{http_code}' -H 'Authorization: Bearer " TOKEN "' "
                              "-H 'Content-Type: application/json' --data-binary @%s "
                              "http://127.0.0.1:%d/admin/v1/prefixes > %s/wait.code 2>&1) >/dev/null 2>&1 & echo $!",
                         tmpdir, path, port, tmpdir),
                 0);
    const int client = atoi(bg);
    free(bg);
    /* Stop only once the daemon holds the waiting registration (its job
     * exists): a fixed delay lost the race to a slow curl start on a loaded
     * machine, and the client then saw a refused connection. */
    char job_path[64];
    snprintf(job_path, sizeof job_path, "/admin/v1/jobs/%lld", (long long)last_job + 1);
    int code = 0;
    for (int i = 0; i < 600 && code != 200; i++) {
        code = req("GET", job_path, NULL, TOKEN, &out);
        free(out);
        if (code != 200) usleep(50 * 1000);
    }
    cr_assert_eq(code, 200, "the waiting registration never became job %lld", (long long)last_job + 1);
    kill(daemon_pid, SIGTERM);
    int st;
    cr_assert_eq(waitpid(daemon_pid, &st, 0), daemon_pid);
    daemon_pid = 0;
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d", st);
    cr_assert_eq(th_runf(NULL, "while kill -0 %d 2>/dev/null; do sleep 0.05; done", client), 0);
    cr_assert_eq(th_runf(&out, "cat %s/wait.code", tmpdir), 0);
    cr_assert_str_eq(out, "202", "the waiting registration's status");
    free(out);
    cr_assert_eq(th_runf(&out, "cat %s/wait.out", tmpdir), 0);
    json_t *j = th_json_parse(out);
    cr_assert(th_json_int(j, "job_id", NULL) > 0, "%s", out);
    cr_assert(json_is_string(json_object_get(j, "status_url")), "%s", out);
    json_decref(j);
    free(out);
    free(text);
    free(body);
}

/* ---- what the operator console reads ------------------------------------------------------ */

static json_t *get_json(const char *path, int want) {
    char *out = NULL;
    cr_assert_eq(req("GET", path, NULL, TOKEN, &out), want, "GET %s: %s", path, out);
    json_t *j = th_json_parse(out);
    free(out);
    return j;
}

static json_int_t prefix_hits(const char *id) {
    char path[200];
    snprintf(path, sizeof path, "/admin/v1/prefixes/%s", id);
    json_t *j = get_json(path, 200);
    json_int_t h = th_json_int(j, "hits", NULL);
    json_decref(j);
    return h;
}

Test(admin, hits_kept_rows_pinning_and_the_policy_list) {
    start_daemon("--set admin.token=" TOKEN " --set compression.policy=knorm:retention=0.25");
    json_t *job = register_story(NULL);
    char id[80], path[200];
    snprintf(id, sizeof id, "%s", json_string_value(json_object_get(json_object_get(job, "prefix"), "id")));
    cr_assert_eq(th_json_int(json_object_get(job, "prefix"), "hits", NULL), 0);
    cr_assert(json_is_null(json_object_get(json_object_get(job, "prefix"), "calibration")), "no calibration asked");
    json_int_t kept_rows = th_json_int(json_object_get(job, "prefix"), "kept_rows", NULL);
    json_decref(job);
    cr_assert_eq(prefix_hits(id), 0);
    json_int_t n = story_tokens();
    cr_assert_eq(prefix_hits(id), 0, "a request that does not use it is no hit");
    cr_assert_eq(story_cached(), n);
    cr_assert_eq(story_cached(), n);
    cr_assert_eq(prefix_hits(id), 2, "each request served from it is a hit");

    /* Kept rows per (layer, kv head): stories260K has 5 layers x 4 kv heads. */
    snprintf(path, sizeof path, "/admin/v1/prefixes/%s/kept", id);
    json_t *k = get_json(path, 200);
    cr_assert_str_eq(json_string_value(json_object_get(k, "object")), "prefix.kept");
    cr_assert_eq(th_json_int(k, "n_layer", NULL), 5);
    cr_assert_eq(th_json_int(k, "n_head_kv", NULL), 4);
    cr_assert_eq(th_json_int(k, "tokens", NULL), n);
    json_t *kept = json_object_get(k, "kept");
    cr_assert_eq(json_array_size(kept), 5);
    json_int_t sum = 0;
    for (size_t l = 0; l < 5; l++) {
        cr_assert_eq(json_array_size(json_array_get(kept, l)), 4);
        for (size_t h = 0; h < 4; h++) {
            json_int_t c = json_integer_value(json_array_get(json_array_get(kept, l), h));
            cr_assert(c > 0 && c < n, "knorm at 0.5 keeps part of every head: %lld", (long long)c);
            sum += c;
        }
    }
    cr_assert_eq(sum, kept_rows, "the cells add up to kept_rows");
    cr_assert_eq(json_array_size(json_object_get(k, "spans")), 0, "no layout, no spans");
    json_decref(k);
    cr_assert_eq(prefix_hits(id), 2, "looking at it is no use");

    /* Pinning: PATCH {"pinned"} only. */
    char *out = NULL;
    snprintf(path, sizeof path, "/admin/v1/prefixes/%s", id);
    cr_assert_eq(req("PATCH", path, "{\"pinned\":true}", TOKEN, &out), 200, "%s", out);
    json_t *p = th_json_parse(out);
    free(out);
    cr_assert(json_is_true(json_object_get(p, "pinned")));
    cr_assert_eq(th_json_int(p, "hits", NULL), 2, "pinning keeps the count");
    json_decref(p);
    cr_assert_eq(req("PATCH", path, "{\"pinned\":1}", TOKEN, &out), 400, "%s", out);
    cr_assert(strstr(out, "true or false"), "%s", out);
    free(out);
    cr_assert_eq(req("PATCH", path, "{\"namespace\":\"x\"}", TOKEN, &out), 400, "%s", out);
    cr_assert(strstr(out, "\"param\":\"namespace\"") || strstr(out, "\"param\": \"namespace\""), "%s", out);
    free(out);
    cr_assert_eq(req("PATCH", path, "[]", TOKEN, &out), 400, "%s", out);
    free(out);
    cr_assert_eq(req("PATCH", "/admin/v1/prefixes/00000000000000000000000000000000000000000000000000000000000000ff",
                     "{\"pinned\":false}", TOKEN, &out), 404, "%s", out);
    free(out);
    cr_assert_eq(req("PUT", path, "{}", TOKEN, &out), 405, "%s", out);
    free(out);
    snprintf(path, sizeof path, "/admin/v1/prefixes/%s/other", id);
    cr_assert_eq(req("GET", path, NULL, TOKEN, &out), 404, "%s", out);
    free(out);
    cr_assert_eq(req("GET", "/admin/v1/prefixes/abc/kept", NULL, TOKEN, &out), 404, "%s", out);
    free(out);

    /* Every policy with its keys' defaults; the default is the configured one, canonical. */
    json_t *pl = get_json("/admin/v1/policies", 200);
    json_t *data = json_object_get(pl, "data");
    cr_assert_eq(json_array_size(data), PD_POLICY_COUNT);
    pd_policy_spec want;
    pd_error err = {0};
    cr_assert_eq(pd_policy_spec_parse("knorm:retention=0.25", &want, &err), PD_OK);
    char canon[PD_POLICY_SPEC_MAX];
    pd_policy_spec_print(&want, canon, sizeof canon);
    cr_assert_str_eq(json_string_value(json_object_get(pl, "default")), canon);
    bool saw_compactor = false;
    for (size_t i = 0; i < json_array_size(data); i++) {
        json_t *e = json_array_get(data, i);
        const char *name = json_string_value(json_object_get(e, "name"));
        pd_policy_spec d;
        cr_assert_eq(pd_policy_spec_parse(json_string_value(json_object_get(e, "spec")), &d, &err), PD_OK,
                     "%s: %s", name, err.msg);
        cr_assert(strlen(json_string_value(json_object_get(e, "summary"))) > 10);
        /* The keys are exactly the canonical spec's, so name=default pairs rebuild it. */
        char rebuilt[PD_POLICY_SPEC_MAX];
        int w = snprintf(rebuilt, sizeof rebuilt, "%s", name);
        json_t *keys = json_object_get(e, "keys");
        for (size_t j = 0; j < json_array_size(keys); j++)
            w += snprintf(rebuilt + w, sizeof rebuilt - (size_t)w, "%c%s=%s", j ? ',' : ':',
                          json_string_value(json_object_get(json_array_get(keys, j), "name")),
                          json_string_value(json_object_get(json_array_get(keys, j), "default")));
        cr_assert_str_eq(rebuilt, json_string_value(json_object_get(e, "spec")));
        if (strcmp(name, "compactor") == 0) {
            saw_compactor = true;
            cr_assert(strstr(rebuilt, "retention="), "%s", rebuilt);
        }
    }
    cr_assert(saw_compactor);
    json_decref(pl);

    /* Hits are written when the engine is idle: they survive a restart. */
    kill(daemon_pid, SIGTERM);
    int st;
    cr_assert_eq(waitpid(daemon_pid, &st, 0), daemon_pid);
    daemon_pid = 0;
    start_daemon("--set admin.token=" TOKEN);
    cr_assert_eq(prefix_hits(id), 2);
}

Test(admin, spans_report_their_keep_rates_and_calibration_its_curve) {
    start_daemon("--set admin.token=" TOKEN);
    const char *cut = strstr(story, " there");
    char body[2048], *out = NULL, path[200];
    snprintf(body, sizeof body, "{\"segments\":[{\"name\":\"intro\",\"text\":\"%.*s\",\"keep\":true},"
             "{\"name\":\"rest\",\"text\":\"%s\"}],\"policy\":\"knorm\",\"retention\":0.5,\"wait\":true}",
             (int)(cut - story), story, cut);
    cr_assert_eq(req("POST", "/admin/v1/prefixes", body, TOKEN, &out), 201, "%s", out);
    json_t *j = th_json_parse(out);
    free(out);
    json_t *p = json_object_get(j, "prefix");
    snprintf(path, sizeof path, "/admin/v1/prefixes/%s/kept", json_string_value(json_object_get(p, "id")));
    json_int_t kept_rows = th_json_int(p, "kept_rows", NULL);
    json_decref(j);
    json_t *k = get_json(path, 200);
    json_t *spans = json_object_get(k, "spans");
    cr_assert_eq(json_array_size(spans), 2);
    json_t *intro = json_array_get(spans, 0), *rest = json_array_get(spans, 1);
    cr_assert_str_eq(json_string_value(json_object_get(intro, "name")), "intro");
    cr_assert(json_is_true(json_object_get(intro, "whitelisted")));
    cr_assert_float_eq(json_real_value(json_object_get(intro, "kept_fraction")), 1.0, 1e-12,
                       "a kept span keeps every row");
    cr_assert_eq(th_json_int(intro, "rows", NULL),
                 (th_json_int(intro, "end", NULL) - th_json_int(intro, "start", NULL)) * 5 * 4);
    cr_assert_eq(th_json_int(rest, "start", NULL), th_json_int(intro, "end", NULL));
    double rf = json_real_value(json_object_get(rest, "kept_fraction"));
    cr_assert(rf > 0 && rf < 0.6, "the rest pays for the kept intro: %.3f", rf);
    cr_assert_eq(th_json_int(intro, "kept_rows", NULL) + th_json_int(rest, "kept_rows", NULL), kept_rows,
                 "spans cover the prefix");
    json_decref(k);

    /* A quality budget: the curve calibration fitted, with its measured points. */
    /* (twice the story: calibration holds out a probe of at least 16 tokens) */
    snprintf(body, sizeof body, "{\"text\":\"%s %s\",\"policy\":\"knorm\",\"quality\":1.5,\"wait\":true}", story,
             story);
    cr_assert_eq(req("POST", "/admin/v1/prefixes", body, TOKEN, &out), 201, "%s", out);
    j = th_json_parse(out);
    free(out);
    p = json_object_get(j, "prefix");
    json_t *c = json_object_get(p, "calibration");
    cr_assert(json_is_object(c), "calibrated prefixes keep their curve");
    cr_assert(json_real_value(json_object_get(c, "a")) > 0 && json_real_value(json_object_get(c, "b")) > 0);
    json_t *pts = json_object_get(c, "points");
    cr_assert_geq(json_array_size(pts), 4, "the default four retentions at least");
    for (size_t i = 0; i < json_array_size(pts); i++) {
        double r = json_real_value(json_object_get(json_array_get(pts, i), "retention"));
        double x = json_real_value(json_object_get(json_array_get(pts, i), "nll_ratio"));
        cr_assert(r > 0 && r <= 1 && x > 0, "point %zu: %g %g", i, r, x);
    }
    json_t *q = json_object_get(p, "quality");
    cr_assert_float_eq(json_real_value(json_object_get(c, "chosen")), json_real_value(json_object_get(q, "retention")),
                       1e-12);
    cr_assert_float_eq(json_real_value(json_object_get(c, "tau")), 1.5, 1e-12);
    cr_assert(json_real_value(json_object_get(c, "measured")) <= 1.5);
    snprintf(path, sizeof path, "/admin/v1/prefixes/%s", json_string_value(json_object_get(p, "id")));
    json_t *again = get_json(path, 200);
    cr_assert(json_equal(json_object_get(again, "calibration"), c), "the curve reads back as it was stored");
    json_decref(again);
    json_decref(j);

    /* A zero-shot curve is stored as given, without points. */
    pd_policy_spec spec;
    pd_error err = {0};
    cr_assert_eq(pd_policy_spec_parse("knorm", &spec, &err), PD_OK);
    char cp[PD_POLICY_SPEC_MAX];
    pd_curve_policy_print(&spec, cp, sizeof cp);
    snprintf(body, sizeof body, "{\"text\":\"%s\",\"policy\":\"knorm\",\"quality\":1.2,\"namespace\":\"zs\","
             "\"curve\":{\"a\":0.25,\"b\":1.5,\"policy\":\"%s\"},\"wait\":true}", story, cp);
    cr_assert_eq(req("POST", "/admin/v1/prefixes", body, TOKEN, &out), 201, "%s", out);
    j = th_json_parse(out);
    free(out);
    c = json_object_get(json_object_get(j, "prefix"), "calibration");
    cr_assert_float_eq(json_real_value(json_object_get(c, "a")), 0.25, 1e-12);
    cr_assert_float_eq(json_real_value(json_object_get(c, "b")), 1.5, 1e-12);
    cr_assert_eq(json_array_size(json_object_get(c, "points")), 0);
    cr_assert(json_is_null(json_object_get(c, "measured")), "nothing was measured");
    json_decref(j);
}
