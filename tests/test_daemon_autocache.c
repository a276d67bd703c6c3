/* The automatic prefix cache and short registered prefixes on the real
 * daemon (loopback port, curl): a repeated prompt reports cached tokens
 * with prefix.kind "auto" and the same greedy text, an extended and a
 * diverging prompt reuse whole blocks, tenants' salts isolate, the metrics
 * count it; a registered prefix shorter than compression.min_prefix_tokens
 * is used (kind "registered"); with cache.auto_persist the blocks survive a
 * restart (and prefixctl store shows them), without it none are stored. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "helpers.h"
#include "helpers_json.h"

static char *tmpdir;
static char model[1024];
static pid_t daemon_pid;
static int port;

static void setup(void) {
    tmpdir = th_mkdtemp();
    cr_assert_not_null(tmpdir);
    if (system("curl --version >/dev/null 2>&1") != 0) cr_skip_test("curl is not installed");
}

static void teardown(void) {
    th_daemon_stop(&daemon_pid, SIGKILL);
    th_rmtree(tmpdir);
    free(tmpdir);
    tmpdir = NULL;
}

TestSuite(daemon_autocache, .init = setup, .fini = teardown, .timeout = 240);

static void start_daemon(const char *extra) {
    TH_REQUIRE_SHARED();
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    char args[4096], log[1200];
    snprintf(args, sizeof args,
             "--set model.path=%s --set cache.path=%s/store --set cache.map_size_mb=64 "
             "--set model.n_threads=2 --set server.model_names=test %s",
             model, tmpdir, extra ? extra : "");
    snprintf(log, sizeof log, "%s/prefixd.log", tmpdir);
    daemon_pid = th_daemon_start(args, log, &port);
}

typedef struct reply {
    char *text;
    long long cached, prompt_tokens;
    char kind[32]; /* "" without a prefix object */
} reply;

/* A greedy completion of `prompt` (JSON-safe text) with extra body fields. */
static reply complete(const char *prompt, const char *extra) {
    char body[8192], body_path[1200];
    snprintf(body, sizeof body, "{\"model\":\"test\",\"prompt\":\"%s\",\"max_tokens\":24,\"temperature\":0%s}", prompt,
             extra ? extra : "");
    snprintf(body_path, sizeof body_path, "%s/body.json", tmpdir);
    char *out = NULL;
    cr_assert_eq(th_http(port, "POST", "/v1/completions", body, NULL, body_path, &out), 200, "%s", out);
    json_t *j = th_json_parse(out);
    reply r = {0};
    json_t *details = json_object_get(json_object_get(j, "usage"), "prompt_tokens_details");
    r.cached = (long long)json_integer_value(json_object_get(details, "cached_tokens"));
    r.prompt_tokens = (long long)json_integer_value(json_object_get(json_object_get(j, "usage"), "prompt_tokens"));
    json_t *prefix = json_object_get(j, "prefix");
    if (prefix) {
        const char *k = json_string_value(json_object_get(prefix, "kind"));
        cr_assert_not_null(k, "%s", out);
        snprintf(r.kind, sizeof r.kind, "%s", k);
        cr_assert_eq(json_integer_value(json_object_get(prefix, "original_tokens")), r.cached, "%s", out);
        cr_assert_eq(json_object_get(prefix, "id") != NULL, strcmp(k, "registered") == 0, "%s", out);
    }
    json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
    r.text = strdup(json_string_value(json_object_get(c0, "text")));
    json_decref(j);
    free(out);
    return r;
}

static double metric(const char *name) {
    char *out = NULL;
    cr_assert_eq(th_http(port, "GET", "/metrics", NULL, NULL, NULL, &out), 200, "%s", out);
    double v = th_metric(out, name);
    free(out);
    return v;
}

static int store_cmd(const char *cmd, char **out);
static void wait_for_metric_above(const char *name, double floor);

static const char *story =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine. One day, "
    "she saw a big tree with a red ball in it. She wanted the ball very much. She asked her mom for help, and "
    "her mom said they would try together after lunch.";

Test(daemon_autocache, a_repeated_prompt_is_served_from_exact_blocks) {
    start_daemon(NULL); /* the defaults: cache.auto_mb = 256 */
    char extended[4096], diverged[4096];
    snprintf(extended, sizeof extended, "%s Then they went to the park and played with the ball.", story);
    snprintf(diverged, sizeof diverged, "%s", story);
    char *at = strstr(diverged, "big tree"); /* past the first blocks, inside the prompt */
    cr_assert_not_null(at);
    memcpy(at, "old tree", 8);

    reply off = complete(story, ",\"cache\":\"off\"");
    cr_assert_eq(off.cached, 0);
    cr_assert_str_eq(off.kind, "");
    reply again = complete(story, NULL);
    cr_assert_gt(again.cached, 32, "the second time comes from the cache");
    cr_assert(again.cached % 16 == 0 || again.cached == again.prompt_tokens - 1,
              "whole blocks, or all but the last token (%lld of %lld)", again.cached, again.prompt_tokens);
    cr_assert_str_eq(again.kind, "auto");
    cr_assert_str_eq(again.text, off.text, "greedy output is the same with and without the cache");

    reply ext = complete(extended, NULL);
    cr_assert_eq(ext.cached, again.prompt_tokens / 16 * 16, "an extension reuses every whole block of the prompt");
    reply ext_off = complete(extended, ",\"cache\":\"off\"");
    cr_assert_str_eq(ext.text, ext_off.text);

    reply div = complete(diverged, NULL);
    cr_assert_gt(div.cached, 0);
    cr_assert_lt(div.cached, again.cached, "a divergence inside the prompt ends the match at its block");
    reply div_off = complete(diverged, ",\"cache\":\"off\"");
    cr_assert_str_eq(div.text, div_off.text);

    reply salted = complete(story, ",\"cache_salt\":\"tenant-a\"");
    cr_assert_eq(salted.cached, 0, "another cache_salt shares nothing");

    cr_assert_geq(metric("prefixd_auto_cache_hits_total"), 3.0);
    cr_assert_geq(metric("prefixd_auto_cache_misses_total"), 1.0);
    cr_assert_gt(metric("prefixd_auto_cache_entries"), 0.0);
    cr_assert_gt(metric("prefixd_auto_cache_bytes"), 0.0);
    cr_assert_geq(metric("prefixd_cached_tokens_total"), (double)(again.cached + ext.cached + div.cached));
    reply *all[] = {&off, &again, &ext, &ext_off, &div, &div_off, &salted};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]->text);
}

Test(daemon_autocache, zero_turns_it_off) {
    start_daemon("--set cache.auto_mb=0");
    reply a = complete(story, NULL), b = complete(story, NULL);
    cr_assert_eq(b.cached, 0);
    cr_assert_str_eq(a.text, b.text);
    cr_assert_eq(metric("prefixd_auto_cache_hits_total"), -1.0, "no series without the cache");
    free(a.text), free(b.text);
}

/* Fix 2: compression.min_prefix_tokens (256 by default) is about
 * compressing; a shorter registered prefix is still looked up and used. */
static void short_registered_prefix_is_used(const char *daemon_args) {
    TH_REQUIRE_SHARED();
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    char text[1200];
    snprintf(text, sizeof text, "%s/prefix.txt", tmpdir);
    FILE *f = fopen(text, "w");
    cr_assert_not_null(f);
    fputs(story, f);
    fclose(f);
    char *out = NULL;
    cr_assert_eq(th_runf(&out, "%s compress --model %s --policy knorm --retention 0.5 --text %s --store %s/store 2>&1",
                         getenv("PD_PREFIXCTL"), model, text, tmpdir),
                 0, "%s", out);
    free(out);
    start_daemon(daemon_args); /* compression.min_prefix_tokens stays 256, far above the prefix */
    char prompt[4096];
    snprintf(prompt, sizeof prompt, "%s Then", story);
    reply r = complete(prompt, NULL);
    cr_assert_str_eq(r.kind, "registered");
    cr_assert_gt(r.cached, 32);
    cr_assert_lt(r.cached, 256);
    /* the same prompt again: the blocks cannot be longer than the stored
     * prefix (nothing after a compressed prefix is cached), so it stays */
    reply again = complete(prompt, NULL);
    cr_assert_str_eq(again.kind, "registered");
    cr_assert_eq(again.cached, r.cached);
    free(r.text), free(again.text);
}

Test(daemon_autocache, a_short_registered_prefix_is_used) { short_registered_prefix_is_used(NULL); }

/* Persisted automatic blocks change nothing for registered prefixes: the
 * same choice, and the store still lists the one prefix. */
Test(daemon_autocache, a_registered_prefix_is_unchanged_by_persisted_blocks) {
    short_registered_prefix_is_used("--set cache.auto_persist=true --set cache.auto_mb=16");
    reply other = complete(story + 20, NULL); /* no registered prefix: automatic blocks only */
    reply other2 = complete(story + 20, NULL);
    cr_assert_str_eq(other2.kind, "auto");
    wait_for_metric_above("prefixd_auto_cache_disk_writes_total", 0.0);
    cr_assert_eq(th_daemon_stop(&daemon_pid, SIGTERM), 0);
    char *out = NULL;
    cr_assert_eq(store_cmd("list", &out), 0, "%s", out);
    cr_assert(strstr(out, "\n1 prefix,") && strstr(out, "automatic block"), "%s", out);
    free(out);
    free(other.text), free(other2.text);
}

/* prefixctl store <cmd> on the test's store; its output in *out. */
static int store_cmd(const char *cmd, char **out) {
    return th_runf(out, "%s store --dir %s/store %s 2>&1", getenv("PD_PREFIXCTL"), tmpdir, cmd);
}

/* The idle engine writes pending blocks right after a request. */
static void wait_for_metric_above(const char *name, double floor) {
    for (int i = 0; i < 200 && metric(name) <= floor; i++) usleep(25 * 1000);
    cr_assert_gt(metric(name), floor, "%s stayed at %g", name, floor);
}

Test(daemon_autocache, persisted_blocks_survive_a_restart) {
    const char *persist = "--set cache.auto_persist=true --set cache.auto_mb=16";
    start_daemon(persist);
    reply first = complete(story, NULL);
    cr_assert_eq(first.cached, 0);
    wait_for_metric_above("prefixd_auto_cache_disk_writes_total", 0.0);
    cr_assert_eq(metric("prefixd_auto_cache_persist_failures_total"), 0.0);
    cr_assert_eq(th_daemon_stop(&daemon_pid, SIGTERM), 0);

    char *out = NULL;
    cr_assert_eq(store_cmd("stats", &out), 0, "%s", out);
    cr_assert(strstr(out, "prefixes:    0 ") != NULL, "automatic blocks are not prefixes: %s", out);
    long long blocks = -1;
    const char *at = strstr(out, "automatic:");
    cr_assert(at && sscanf(at, "automatic: %lld block", &blocks) == 1, "%s", out);
    cr_assert_eq(blocks, first.prompt_tokens / 16, "every whole block of the prompt: %s", out);
    free(out);
    cr_assert_eq(store_cmd("list", &out), 0, "%s", out);
    cr_assert(strstr(out, "0 prefixes") && strstr(out, "automatic block"), "%s", out);
    free(out);
    cr_assert_eq(store_cmd("verify", &out), 0, "%s", out);
    cr_assert(strstr(out, "automatic blocks: 0 corrupt"), "%s", out);
    free(out);

    start_daemon(persist); /* the same store, empty RAM */
    reply again = complete(story, NULL);
    cr_assert_str_eq(again.kind, "auto");
    cr_assert_gt(again.cached, 32, "served from the store after the restart");
    cr_assert(again.cached % 16 == 0 || again.cached == again.prompt_tokens - 1, "%lld", again.cached);
    cr_assert_str_eq(again.text, first.text, "greedy output is the same as before the restart");
    cr_assert_gt(metric("prefixd_auto_cache_disk_reads_total"), 0.0);
    cr_assert_eq(metric("prefixd_auto_cache_disk_rejected_total"), 0.0);
    free(first.text), free(again.text);
}

Test(daemon_autocache, without_persist_no_blocks_are_stored) {
    start_daemon(NULL); /* cache.auto_persist = false */
    reply a = complete(story, NULL), b = complete(story, NULL);
    cr_assert_str_eq(b.kind, "auto", "the RAM cache works");
    cr_assert_eq(metric("prefixd_auto_cache_disk_writes_total"), -1.0, "no persistence series without it");
    cr_assert_eq(th_daemon_stop(&daemon_pid, SIGTERM), 0);
    char *out = NULL;
    cr_assert_eq(store_cmd("stats", &out), 0, "%s", out);
    cr_assert(strstr(out, "automatic:   0 blocks"), "%s", out);
    free(out);
    start_daemon(NULL);
    reply c = complete(story, NULL);
    cr_assert_eq(c.cached, 0, "nothing survived the restart");
    cr_assert_str_eq(c.text, a.text);
    free(a.text), free(b.text), free(c.text);
}
