/* The real daemon on a loopback port, driven by a real HTTP client (curl):
 * completions and chat, streaming against non-streaming, a stored prefix
 * used by a request, errors, concurrent streams, SIGTERM. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <jansson.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine.h"
#include "helpers.h"
#include "helpers_json.h"
#include "tools/tools.h"

static char *tmpdir;
static char model[1024];
static pid_t daemon_pid;
static int port;

static void setup(void) {
    tmpdir = th_mkdtemp();
    cr_assert_not_null(tmpdir);
    if (system("curl --version >/dev/null 2>&1") != 0) cr_skip_test("curl is not installed");
}

static void stop_daemon(int sig) { th_daemon_stop(&daemon_pid, sig); }

static void teardown(void) {
    stop_daemon(SIGKILL);
    th_rmtree(tmpdir);
    free(tmpdir);
    tmpdir = NULL;
}

TestSuite(daemon, .init = setup, .fini = teardown, .timeout = 240);

/* Start prefixd serving model_path with extra --set arguments; wait until
 * /health says ok. Requests name the model "test". */
static void start_daemon_model(const char *model_path, const char *extra) {
    char args[4096], log[1200];
    snprintf(args, sizeof args, "--set model.path=%s --set cache.path=%s/store --set cache.map_size_mb=64 "
             "--set model.n_threads=2 --set server.model_names=test %s", model_path, tmpdir, extra ? extra : "");
    snprintf(log, sizeof log, "%s/prefixd.log", tmpdir);
    daemon_pid = th_daemon_start(args, log, &port);
}

/* The same with stories260K (the shared model). */
static void start_daemon(const char *extra) {
    TH_REQUIRE_SHARED();
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    start_daemon_model(model, extra);
}

/* POST a JSON body; returns the HTTP status, the body in *out. */
static int post(const char *path, const char *json, const char *auth, char **out) {
    char body_path[1200];
    snprintf(body_path, sizeof body_path, "%s/body.json", tmpdir);
    return th_http(port, "POST", path, json, auth, body_path, out);
}

/* The text of choice 0 of a completion or chat completion. */
static char *choice_text(json_t *j) {
    json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
    cr_assert_not_null(c0);
    json_t *t = json_object_get(c0, "text");
    if (!t) t = json_object_get(json_object_get(c0, "message"), "content");
    cr_assert(json_is_string(t));
    return strdup(json_string_value(t));
}

/* Concatenate the deltas of an SSE stream; checks it ends with [DONE]. */
static char *stream_text(const char *sse) {
    cr_assert(strstr(sse, "data: [DONE]"), "%s", sse);
    size_t cap = strlen(sse) + 1, len = 0;
    char *acc = calloc(cap, 1);
    for (const char *p = strstr(sse, "data: "); p; p = strstr(p + 1, "data: ")) {
        if (strncmp(p, "data: [DONE]", 12) == 0) break;
        const char *end = strstr(p, "\n\n");
        cr_assert_not_null(end);
        char *one = strndup(p + 6, (size_t)(end - p - 6));
        json_t *j = th_json_parse(one);
        json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
        json_t *t = c0 ? json_object_get(c0, "text") : NULL;
        if (c0 && !t) t = json_object_get(json_object_get(c0, "delta"), "content");
        if (t && json_is_string(t)) {
            size_t n = strlen(json_string_value(t));
            memcpy(acc + len, json_string_value(t), n);
            len += n;
        }
        json_decref(j);
        free(one);
    }
    return acc;
}

Test(daemon, health_models_and_greedy_completion_match_the_engine) {
    start_daemon(NULL);
    char *out = NULL;
    /* the model ran once before /health said ok, so the first request pays
     * no page faults or buffer set-up */
    cr_assert_eq(th_runf(&out, "grep -c 'model warmed up in' %s/prefixd.log", tmpdir), 0, "no warm-up logged");
    free(out);
    out = NULL;
    cr_assert_eq(th_runf(&out, "curl -s http://127.0.0.1:%d/v1/models", port), 0);
    json_t *m = th_json_parse(out);
    cr_assert_str_eq(json_string_value(json_object_get(json_array_get(json_object_get(m, "data"), 0), "object")),
                     "model");
    json_decref(m);
    free(out);

    cr_assert_eq(post("/v1/completions", "{\"model\":\"test\",\"prompt\":\"Once upon a time\",\"max_tokens\":24,"
                                         "\"temperature\":0}", NULL, &out), 200, "%s", out);
    json_t *j = th_json_parse(out);
    char *text = choice_text(j);
    json_t *usage = json_object_get(j, "usage");
    cr_assert_eq(json_integer_value(json_object_get(usage, "completion_tokens")), 24);
    json_decref(j);
    free(out);

    /* The same greedy continuation from prefixctl generate (the engine). */
    cr_assert_eq(th_runf(&out, "%s generate --model %s --prompt 'Once upon a time' -n 24 --threads 2 2>/dev/null",
                     getenv("PD_PREFIXCTL"), model), 0);
    size_t n = strlen(out);
    if (n && out[n - 1] == '\n') out[n - 1] = '\0'; /* prefixctl ends the text with a newline */
    cr_assert_str_eq(text, out, "daemon: '%s'\nengine: '%s'", text, out);
    free(out);
    free(text);
}

Test(daemon, streamed_and_non_streamed_output_are_identical) {
    start_daemon(NULL);
    const char *req = "{\"model\":\"test\",\"prompt\":\"The little dog\",\"max_tokens\":40,\"temperature\":1,"
                      "\"seed\":7%s}";
    char body[512], *plain = NULL, *sse = NULL;
    snprintf(body, sizeof body, req, "");
    cr_assert_eq(post("/v1/completions", body, NULL, &plain), 200, "%s", plain);
    snprintf(body, sizeof body, req, ",\"stream\":true");
    cr_assert_eq(post("/v1/completions", body, NULL, &sse), 200, "%s", sse);
    json_t *j = th_json_parse(plain);
    char *a = choice_text(j), *b = stream_text(sse);
    cr_assert_str_eq(a, b);
    json_decref(j);
    free(a), free(b), free(plain), free(sse);
}

Test(daemon, errors_are_openai_shaped) {
    start_daemon("--set server.api_key=sekrit --set server.max_body_bytes=2048");
    char *out = NULL;
    const char *ok = "{\"model\":\"test\",\"prompt\":\"Hi\",\"max_tokens\":2}";
    cr_assert_eq(post("/v1/completions", ok, NULL, &out), 401, "%s", out);
    json_t *j = th_json_parse(out);
    cr_assert(json_is_string(json_object_get(json_object_get(j, "error"), "message")));
    json_decref(j);
    free(out);
    cr_assert_eq(post("/v1/completions", ok, "wrong", &out), 401, "%s", out);
    free(out);
    cr_assert_eq(post("/v1/completions", ok, "sekrit", &out), 200, "%s", out);
    free(out);
    cr_assert_eq(post("/v1/completions", "{not json", "sekrit", &out), 400, "%s", out);
    free(out);
    cr_assert_eq(post("/v1/completions", "{\"model\":\"test\",\"prompt\":\"Hi\",\"temperature\":9}", "sekrit", &out), 400,
                 "%s", out);
    j = th_json_parse(out);
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(j, "error"), "param")), "temperature");
    json_decref(j);
    free(out);
    cr_assert_eq(post("/v1/nothing", ok, "sekrit", &out), 404, "%s", out);
    free(out);
    char big[4096];
    memset(big, ' ', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    const char *head = "{\"model\":\"test\",\"prompt\":\"";
    memcpy(big, head, strlen(head));
    memcpy(big + sizeof big - 3, "\"}", 2);
    cr_assert_eq(post("/v1/completions", big, "sekrit", &out), 413, "%s", out);
    free(out);
}

/* The error's code, or "". */
static const char *error_code_of(json_t *j) {
    const char *code = json_string_value(json_object_get(json_object_get(j, "error"), "code"));
    return code ? code : "";
}

/* "model" must name what is served (docs/api.md): the GGUF id by default,
 * or one of server.model_names, whose first name becomes the id. */
Test(daemon, the_model_field_must_name_the_served_model) {
    start_daemon("--set server.model_names=");
    char *out = NULL;
    cr_assert_eq(th_runf(&out, "curl -s http://127.0.0.1:%d/v1/models", port), 0);
    json_t *m = th_json_parse(out);
    char id[256];
    snprintf(id, sizeof id, "%s",
             json_string_value(json_object_get(json_array_get(json_object_get(m, "data"), 0), "id")));
    json_decref(m);
    free(out);
    char body[1024];
    snprintf(body, sizeof body, "{\"model\":\"%s\",\"prompt\":\"Hi\",\"max_tokens\":2}", id);
    cr_assert_eq(post("/v1/completions", body, NULL, &out), 200, "the id from /v1/models: %s", out);
    free(out);
    cr_assert_eq(post("/v1/completions", "{\"model\":\"gpt-4o\",\"prompt\":\"Hi\",\"max_tokens\":2}", NULL, &out),
                 404, "%s", out);
    json_t *j = th_json_parse(out);
    cr_assert_str_eq(error_code_of(j), "model_not_found", "%s", out);
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(j, "error"), "param")), "model");
    cr_assert(strstr(json_string_value(json_object_get(json_object_get(j, "error"), "message")), id),
              "the message names the served model: %s", out);
    json_decref(j);
    free(out);
    cr_assert_eq(post("/v1/chat/completions", "{\"model\":\"gpt-4o\",\"messages\":[{\"role\":\"user\","
                      "\"content\":\"Hi\"}]}", NULL, &out), 404, "%s", out);
    free(out);
    stop_daemon(SIGTERM);

    start_daemon("--set server.model_names=alpha,beta");
    cr_assert_eq(th_runf(&out, "curl -s http://127.0.0.1:%d/v1/models", port), 0);
    cr_assert(strstr(out, "\"id\":\"alpha\""), "the first name is the id: %s", out);
    free(out);
    cr_assert_eq(post("/v1/completions", "{\"model\":\"beta\",\"prompt\":\"Hi\",\"max_tokens\":2}", NULL, &out), 200,
                 "%s", out);
    j = th_json_parse(out);
    cr_assert_str_eq(json_string_value(json_object_get(j, "model")), "alpha", "answers carry the id");
    json_decref(j);
    free(out);
    cr_assert_eq(post("/v1/completions", body, NULL, &out), 404, "names replace the GGUF id: %s", out);
    free(out);
}

/* 64 clients at once (the number), more than the batch holds: the
 * rest queue and join between decode steps. */
Test(daemon, concurrent_streams_all_complete_and_sigterm_exits_cleanly) {
    start_daemon("--set scheduler.max_batch=16");
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "for i in $(seq 1 64); do curl -s -N -H 'Content-Type: application/json' --data-binary "
             "\"{\\\"model\\\":\\\"test\\\",\\\"prompt\\\":\\\"Tom had a ball $i\\\",\\\"max_tokens\\\":32,"
             "\\\"stream\\\":true,\\\"seed\\\":$i}\" http://127.0.0.1:%d/v1/completions > %s/s$i.txt & done; wait",
             port, tmpdir);
    cr_assert_eq(th_runf(NULL, "%s", cmd), 0);
    for (int i = 1; i <= 64; i++) {
        char *out = NULL;
        cr_assert_eq(th_runf(&out, "cat %s/s%d.txt", tmpdir, i), 0);
        cr_assert(strstr(out, "\"finish_reason\"") && strstr(out, "data: [DONE]"), "stream %d: %s", i, out);
        free(out);
    }
    kill(daemon_pid, SIGTERM);
    int st;
    cr_assert_eq(waitpid(daemon_pid, &st, 0), daemon_pid);
    daemon_pid = 0;
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d", st);
}

Test(daemon, a_stored_prefix_is_used_and_exact_at_retention_1) {
    TH_REQUIRE_SHARED();
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    /* A story prefix, stored uncompressed (retention 1). */
    char text[1200];
    snprintf(text, sizeof text, "%s/prefix.txt", tmpdir);
    const char *story = "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
                        "sunshine. One day, she saw a big tree with a red ball in it. She wanted the ball very much.";
    FILE *f = fopen(text, "w");
    fputs(story, f);
    fclose(f);
    char *out = NULL;
    cr_assert_eq(th_runf(&out, "%s compress --model %s --policy knorm --retention 1 --text %s --store %s/store 2>&1",
                     getenv("PD_PREFIXCTL"), model, text, tmpdir),
                 0, "%s", out);
    free(out);
    start_daemon("--set compression.min_prefix_tokens=8");
    char body[2048];
    snprintf(body, sizeof body, "{\"model\":\"test\",\"prompt\":\"%s Then\",\"max_tokens\":20,\"temperature\":0}", story);
    cr_assert_eq(post("/v1/completions", body, NULL, &out), 200, "%s", out);
    json_t *j = th_json_parse(out);
    json_t *details = json_object_get(json_object_get(j, "usage"), "prompt_tokens_details");
    cr_assert_gt(json_integer_value(json_object_get(details, "cached_tokens")), 30, "%s", out);
    cr_assert(json_is_object(json_object_get(j, "prefix")), "%s", out);
    char *with_prefix = choice_text(j);
    json_decref(j);
    free(out);
    snprintf(body, sizeof body,
             "{\"model\":\"test\",\"prompt\":\"%s Then\",\"max_tokens\":20,\"temperature\":0,\"cache\":\"off\"}", story);
    cr_assert_eq(post("/v1/completions", body, NULL, &out), 200, "%s", out);
    j = th_json_parse(out);
    details = json_object_get(json_object_get(j, "usage"), "prompt_tokens_details");
    cr_assert_eq(json_integer_value(json_object_get(details, "cached_tokens")), 0, "%s", out);
    char *without = choice_text(j);
    cr_assert_str_eq(with_prefix, without);
    json_decref(j);
    free(out), free(with_prefix), free(without);
}

/* ---- helpers for the tests below ------------------------------------------ */

/* GET path; returns the HTTP status, the body in *out. */
static int get(const char *path, char **out) { return th_http(port, "GET", path, NULL, NULL, NULL, out); }

static const char *story = "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
                           "sunshine. One day, she saw a big tree with a red ball in it. She wanted the ball very much.";

/* Store `story` as a prefix with the knorm policy at `retention`. */
static void store_story_prefix(double retention) {
    char text[1200];
    snprintf(text, sizeof text, "%s/prefix.txt", tmpdir);
    FILE *f = fopen(text, "w");
    cr_assert_not_null(f);
    fputs(story, f);
    fclose(f);
    char *out = NULL;
    cr_assert_eq(th_runf(&out, "%s compress --model %s --policy knorm --retention %g --text %s --store %s/store 2>&1",
                     getenv("PD_PREFIXCTL"), model, retention, text, tmpdir),
                 0, "%s", out);
    free(out);
}

/* A tiny generated model carrying the real Phi-3 vocabulary and chat
 * template (vocab_from copies every tokenizer.* key). */
static void phi3_model(char *path, size_t cap) {
    char vpath[1024];
    cr_assert_not_null(th_shared_file("vocab/ggml-vocab-phi-3.gguf", vpath, sizeof vpath));
    pd_testmodel_opts o;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset("tiny", &o, &err), PD_OK, "%s", err.msg);
    o.vocab_from = vpath;
    o.wtype = PD_TYPE_Q8_0;
    o.n_ctx = 1024; /* a system prompt with its tool list is ~200 tokens */
    snprintf(path, cap, "%s/phi3.gguf", tmpdir);
    cr_assert_eq(pd_testmodel_write(&o, path, NULL, &err), PD_OK, "%s", err.msg);
}

/* ---- chat ------------------------------------------------------------------- */

Test(daemon, chat_without_a_template_is_a_400_naming_the_problem) {
    start_daemon(NULL);
    char *out = NULL;
    cr_assert_eq(get("/v1/models", &out), 200, "%s", out);
    free(out);
    cr_assert_eq(post("/v1/chat/completions",
                      "{\"model\":\"test\",\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":4}", NULL,
                      &out),
                 400, "%s", out);
    json_t *j = th_json_parse(out);
    json_t *e = json_object_get(j, "error");
    cr_assert_str_eq(json_string_value(json_object_get(e, "type")), "invalid_request_error", "%s", out);
    cr_assert_str_eq(json_string_value(json_object_get(e, "code")), "no_chat_template", "%s", out);
    cr_assert_str_eq(json_string_value(json_object_get(e, "param")), "messages", "%s", out);
    cr_assert(strstr(json_string_value(json_object_get(e, "message")), "chat template"), "%s", out);
    json_decref(j);
    free(out);
    /* The server is still fine afterwards. */
    cr_assert_eq(post("/v1/completions", "{\"model\":\"test\",\"prompt\":\"Hi\",\"max_tokens\":2}", NULL, &out), 200,
                 "%s", out);
    free(out);
}

Test(daemon, chat_on_a_phi3_vocab_model_streamed_and_not_are_identical) {
    TH_REQUIRE_SHARED();
    char path[1200];
    phi3_model(path, sizeof path);
    start_daemon_model(path, NULL);
    const char *req = "{\"model\":\"test\",\"messages\":[{\"role\":\"system\",\"content\":\"You are a helpful "
                      "assistant.\"},{\"role\":\"user\",\"content\":\"Tell me a story.\"}],\"max_tokens\":16,"
                      "\"temperature\":1,\"seed\":11%s}";
    char body[1024], *plain = NULL, *sse = NULL;
    snprintf(body, sizeof body, req, "");
    cr_assert_eq(post("/v1/chat/completions", body, NULL, &plain), 200, "%s", plain);
    snprintf(body, sizeof body, req, ",\"stream\":true");
    cr_assert_eq(post("/v1/chat/completions", body, NULL, &sse), 200, "%s", sse);
    json_t *j = th_json_parse(plain);
    cr_assert_str_eq(json_string_value(json_object_get(j, "object")), "chat.completion", "%s", plain);
    json_t *msg = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message");
    cr_assert_str_eq(json_string_value(json_object_get(msg, "role")), "assistant", "%s", plain);
    cr_assert(strstr(sse, "\"role\":\"assistant\""), "the first chunk names the role: %s", sse);
    cr_assert(strstr(sse, "chat.completion.chunk"), "%s", sse);
    char *a = choice_text(j), *b = stream_text(sse);
    cr_assert_str_eq(a, b);

    /* prompt_tokens: the messages rendered with the Phi-3 template and
     * tokenized with the model's own tokenizer, computed here. */
    pd_model *m = NULL;
    pd_error err = {0};
    pd_model_params mp = {.n_threads = 1};
    cr_assert_eq(pd_model_load(path, &mp, &m, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_model_chat_family(m), PD_CHAT_PHI3);
    pd_chat_message msgs[2] = {{.role = "system", .content = "You are a helpful assistant."},
                               {.role = "user", .content = "Tell me a story."}};
    char *text = NULL;
    size_t len = 0, sys = 0;
    cr_assert_eq(pd_chat_render(PD_CHAT_PHI3, msgs, 2, true, &text, &len, &sys, &err), PD_OK, "%s", err.msg);
    pd_token *ids = NULL;
    size_t n_ids = 0;
    pd_tokenize_opts to = {.add_special = true, .parse_special = true};
    cr_assert_eq(pd_tokenize(pd_model_tokenizer(m), text, len, to, &ids, &n_ids, &err), PD_OK, "%s", err.msg);
    json_t *usage = json_object_get(j, "usage");
    cr_assert_eq(json_integer_value(json_object_get(usage, "prompt_tokens")), (json_int_t)n_ids, "%s", plain);
    cr_assert_leq(json_integer_value(json_object_get(usage, "completion_tokens")), 16);
    free(ids);
    free(text);
    pd_model_free(m);
    json_decref(j);
    free(a), free(b), free(plain), free(sse);
}

/* ---- cancellation ------------------------------------------------------------ */

/* Open a streaming request on a raw socket, read until the first SSE event
 * arrives, then close the connection: the client went away mid-stream. */
static void stream_then_disconnect(const char *json) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    struct timeval tv = {.tv_sec = 60};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv); /* a bound, not a timing assertion */
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    char req[4096];
    int n = snprintf(req, sizeof req,
                     "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\n\r\n%s", strlen(json), json);
    cr_assert(n > 0 && (size_t)n < sizeof req);
    cr_assert_eq(send(fd, req, (size_t)n, 0), n);
    char buf[8192];
    size_t got = 0;
    while (got + 1 < sizeof buf) {
        ssize_t k = recv(fd, buf + got, sizeof buf - 1 - got, 0);
        cr_assert_gt(k, 0, "the stream ended or stalled before its first event");
        got += (size_t)k;
        buf[got] = '\0';
        if (strstr(buf, "data: {")) break;
    }
    cr_assert(strstr(buf, "HTTP/1.1 200"), "%s", buf);
    close(fd);
}

Test(daemon, a_client_gone_mid_stream_frees_its_slot) {
    start_daemon("--set scheduler.max_batch=1");
    /* Long enough that it cannot finish on its own first: EOS is banned. */
    stream_then_disconnect("{\"model\":\"test\",\"prompt\":\"Once upon a time\",\"max_tokens\":1900,\"stream\":true,"
                           "\"seed\":1,\"logit_bias\":{\"2\":-100}}");
    /* With one slot this runs only once the first request left the batch. */
    char *out = NULL;
    cr_assert_eq(post("/v1/completions", "{\"model\":\"test\",\"prompt\":\"The cat\",\"max_tokens\":8,\"temperature\":0}",
                      NULL, &out),
                 200, "%s", out);
    json_t *j = th_json_parse(out);
    cr_assert_eq(json_integer_value(json_object_get(json_object_get(j, "usage"), "completion_tokens")), 8);
    json_decref(j);
    free(out);
    cr_assert_eq(get("/metrics", &out), 200, "%s", out);
    cr_assert_geq(th_metric(out, "prefixd_requests_total{outcome=\"cancelled\"}"), 1, "%s", out);
    cr_assert_geq(th_metric(out, "prefixd_requests_total{outcome=\"completed\"}"), 1, "%s", out);
    /* The abandoned request stopped early: far fewer than its 1900 tokens. */
    cr_assert_lt(th_metric(out, "prefixd_generated_tokens_total"), 1900 + 8, "%s", out);
    cr_assert_eq(th_metric(out, "prefixd_running_sequences"), 0, "%s", out);
    free(out);
}

/* The metric `name` from /metrics. */
static double metric_now(const char *name) {
    char *out = NULL;
    cr_assert_eq(get("/metrics", &out), 200, "%s", out);
    double v = th_metric(out, name);
    free(out);
    return v;
}

/* A non-streamed request, abandoned once it runs: the client waits for the
 * whole answer, so only its socket closing says it left. */
Test(daemon, a_client_gone_before_a_non_streamed_answer_frees_its_slot) {
    start_daemon("--set scheduler.max_batch=1");
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    const char *json = "{\"model\":\"test\",\"prompt\":\"Once upon a time\",\"max_tokens\":1900,\"seed\":1,"
                       "\"logit_bias\":{\"2\":-100}}";
    char req[4096];
    int n = snprintf(req, sizeof req,
                     "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\n\r\n%s", strlen(json), json);
    cr_assert_eq(send(fd, req, (size_t)n, 0), n);
    for (int i = 0; i < 600 && metric_now("prefixd_running_sequences") < 1; i++) usleep(5000);
    cr_assert_eq(metric_now("prefixd_running_sequences"), 1, "the request is running");
    close(fd);
    /* With one slot this runs only once the first request left the batch. */
    char *out = NULL;
    cr_assert_eq(post("/v1/completions", "{\"model\":\"test\",\"prompt\":\"The cat\",\"max_tokens\":8,\"temperature\":0}",
                      NULL, &out),
                 200, "%s", out);
    free(out);
    cr_assert_eq(metric_now("prefixd_requests_total{outcome=\"cancelled\"}"), 1, "generated %g tokens",
                 metric_now("prefixd_generated_tokens_total"));
    cr_assert_lt(metric_now("prefixd_generated_tokens_total"), 1900 + 8, "the abandoned request stopped early");
}

/* Send raw bytes, read until the peer closes (or 30 s): the reply. */
static char *raw_exchange(const char *bytes, size_t n) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(fd, 0);
    struct timeval tv = {.tv_sec = 30};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv); /* a bound, not a timing assertion */
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(send(fd, bytes, n, 0), (ssize_t)n);
    size_t cap = 65536, got = 0;
    char *buf = malloc(cap);
    cr_assert_not_null(buf);
    ssize_t k;
    while (got + 1 < cap && (k = recv(fd, buf + got, cap - 1 - got, 0)) > 0) got += (size_t)k;
    buf[got] = '\0';
    close(fd);
    return buf;
}

Test(daemon, a_declared_oversize_body_is_refused_before_it_is_read) {
    start_daemon("--set server.api_key=secret --set server.max_body_bytes=65536");
    /* 10 GB declared, 1 KB sent: the answer comes without the rest. */
    char req[2048];
    int n = snprintf(req, sizeof req,
                     "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     "Content-Length: 10000000000\r\n\r\n");
    memset(req + n, 'x', 1024);
    char *out = raw_exchange(req, (size_t)n + 1024);
    cr_assert(strncmp(out, "HTTP/1.1 413", 12) == 0, "%s", out);
    const char *body = strstr(out, "\r\n\r\n");
    cr_assert_not_null(body, "%s", out);
    json_t *j = th_json_parse(body + 4);
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(j, "error"), "type")), "request_too_large");
    json_decref(j);
    free(out);
}

Test(daemon, metrics_auth_closes_metrics_but_not_health) {
    start_daemon("--set server.api_key=secret --set server.metrics_auth=true");
    char *out = NULL;
    cr_assert_eq(th_http(port, "GET", "/metrics", NULL, NULL, NULL, &out), 401, "%s", out);
    cr_assert_not_null(strstr(out, "invalid_api_key"), "%s", out);
    free(out);
    cr_assert_eq(th_http(port, "GET", "/metrics", NULL, "secret", NULL, &out), 200, "%s", out);
    cr_assert_not_null(strstr(out, "prefixd_http_requests_total"), "%s", out);
    free(out);
    cr_assert_eq(th_http(port, "GET", "/health", NULL, NULL, NULL, &out), 200, "%s", out);
    free(out);
}

Test(daemon, a_readable_config_file_with_secrets_is_warned_about) {
    const char *exe = getenv("PD_PREFIXD");
    cr_assert(exe && *exe);
    char conf[1200], cmd[4096];
    snprintf(conf, sizeof conf, "%s/prefixd.conf", tmpdir);
    FILE *f = fopen(conf, "w");
    cr_assert_not_null(f);
    fputs("[server]\napi_key = sk-test-123\n", f);
    fclose(f);
    char *out = NULL;
    for (int mode = 0; mode < 2; mode++) {
        cr_assert_eq(chmod(conf, mode ? 0600 : 0644), 0);
        snprintf(cmd, sizeof cmd, "'%s' --config '%s' --check-config 2>&1 >/dev/null", exe, conf);
        cr_assert_eq(th_run(cmd, &out), 0, "%s", out);
        if (mode) cr_assert_null(strstr(out, "warning"), "mode 0600 is fine: %s", out);
        else cr_assert_not_null(strstr(out, "readable by everyone (mode 0644)"), "%s", out);
        cr_assert_null(strstr(out, "sk-test-123"), "the secret itself is never printed: %s", out);
        free(out);
    }
}

Test(daemon, listen_takes_host_names_and_ipv6) {
    start_daemon("--set server.listen=localhost");
    char *out = NULL;
    cr_assert_eq(get("/health", &out), 200, "%s", out);
    free(out);
    stop_daemon(SIGTERM);

    int fd = socket(AF_INET6, SOCK_STREAM, 0);
    struct sockaddr_in6 a6 = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT};
    const bool v6 = fd >= 0 && bind(fd, (struct sockaddr *)&a6, sizeof a6) == 0;
    if (fd >= 0) close(fd);
    if (!v6) cr_skip_test("this machine has no IPv6 loopback");
    const char *exe = getenv("PD_PREFIXD");
    cr_assert(exe && *exe);
    const int p6 = th_free_port();
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "'%s' --set model.path='%s' --set cache.path='%s/store6' --set server.listen=::1 --set server.port=%d "
             ">/dev/null 2>&1 & pid=$!; code=000; for i in $(seq 100); do "
             "code=$(curl -s -g -o /dev/null -w '%%{http_code}' 'http://[::1]:%d/health'); "
             "[ \"$code\" = 200 ] && break; sleep 0.1; done; kill $pid; wait $pid; echo $code",
             exe, model, tmpdir, p6, p6);
    cr_assert_eq(th_run(cmd, &out), 0, "%s", out);
    cr_assert_not_null(strstr(out, "200"), "GET http://[::1]:%d/health answered %s", p6, out);
    free(out);
}

/* SIGTERM with no grace: every stream still open gets an error event and
 * [DONE], every non-streamed request a 503 with Retry-After, none a cut
 * connection. */
Test(daemon, the_end_of_the_grace_period_answers_everyone) {
    start_daemon("--set scheduler.max_batch=2 --set server.shutdown_grace_s=0");
    char cmd[4096];
    /* EOS banned, 1900 tokens each: 8 of them take seconds with 2 slots. */
    snprintf(cmd, sizeof cmd,
             "for i in $(seq 1 6); do curl -s -N -H 'Content-Type: application/json' --data-binary "
             "\"{\\\"model\\\":\\\"test\\\",\\\"prompt\\\":\\\"Tom had a ball $i\\\",\\\"max_tokens\\\":1900,"
             "\\\"stream\\\":true,\\\"seed\\\":$i,\\\"logit_bias\\\":{\\\"2\\\":-100}}\" "
             "http://127.0.0.1:%d/v1/completions > %s/s$i.txt & done; "
             "for i in 7 8; do curl -s -D %s/h$i.txt -H 'Content-Type: application/json' --data-binary "
             "\"{\\\"model\\\":\\\"test\\\",\\\"prompt\\\":\\\"Tom had a ball $i\\\",\\\"max_tokens\\\":1900,"
             "\\\"seed\\\":$i,\\\"logit_bias\\\":{\\\"2\\\":-100}}\" "
             "http://127.0.0.1:%d/v1/completions > %s/s$i.txt & done; wait",
             port, tmpdir, tmpdir, port, tmpdir);
    /* Start the clients, then stop the daemon. */
    char *bg = NULL;
    char wrapped[4300];
    snprintf(wrapped, sizeof wrapped, "(%s) >/dev/null 2>&1 & echo $!", cmd);
    cr_assert_eq(th_run(wrapped, &bg), 0);
    const int clients = atoi(bg);
    free(bg);
    /* Every request admitted or queued (a client not yet connected when the
     * listener closes is refused, which is not what this checks). */
    for (int i = 0; i < 400 && metric_now("prefixd_running_sequences") + metric_now("prefixd_queue_depth") < 8; i++)
        usleep(5000);
    kill(daemon_pid, SIGTERM);
    int st;
    cr_assert_eq(waitpid(daemon_pid, &st, 0), daemon_pid);
    daemon_pid = 0;
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d", st);
    cr_assert_eq(th_runf(NULL, "while kill -0 %d 2>/dev/null; do sleep 0.05; done", clients), 0);
    int finished = 0;
    for (int i = 1; i <= 8; i++) {
        char *out = NULL;
        cr_assert_eq(th_runf(&out, "cat %s/s%d.txt", tmpdir, i), 0);
        if (i <= 6 && out[0] == '{') {
            /* It arrived after the drain began: refused before streaming. */
            cr_assert_not_null(strstr(out, "shutting_down"), "stream %d: %s", i, out);
        } else if (i <= 6) {
            cr_assert_not_null(strstr(out, "data: [DONE]"), "stream %d ends with [DONE]: ...%s", i,
                               strlen(out) > 300 ? out + strlen(out) - 300 : out);
            if (!strstr(out, "\"finish_reason\":\"length\""))
                cr_assert_not_null(strstr(out, "shutting_down"), "stream %d was cut without an error event", i);
            else
                finished++; /* it finished before the stop */
        } else {
            char *h = NULL;
            cr_assert_eq(th_runf(&h, "cat %s/h%d.txt", tmpdir, i), 0);
            if (strstr(h, " 200")) {
                finished++;
            } else {
                cr_assert_not_null(strstr(h, " 503"), "request %d: %s", i, h);
                cr_assert_not_null(strstr(h, "Retry-After"), "request %d: %s", i, h);
                cr_assert_not_null(strstr(out, "shutting_down"), "request %d: %s", i, out);
            }
            free(h);
        }
        free(out);
    }
    cr_assert_lt(finished, 8, "the stop came while requests ran");
}

/* POST with a bearer key; the HTTP status, the body in *out. */
static int post_as(const char *key, const char *json, char **out) { return post("/v1/completions", json, key, out); }

static int64_t cached_tokens_of(const char *out) {
    json_t *j = th_json_parse(out);
    json_t *d = json_object_get(json_object_get(j, "usage"), "prompt_tokens_details");
    const int64_t n = json_integer_value(json_object_get(d, "cached_tokens"));
    json_decref(j);
    return n;
}

/* The error message of a reply, with every 64-digit id replaced by X. */
static char *error_message_without_id(const char *out, const char *id) {
    json_t *j = th_json_parse(out);
    const char *m = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    cr_assert_not_null(m, "%s", out);
    char *copy = strdup(m);
    char *at = strstr(copy, id);
    if (at) memset(at, 'X', strlen(id));
    json_decref(j);
    return copy;
}

Test(daemon, api_keys_select_namespaces_and_isolate_them) {
    TH_REQUIRE_SHARED();
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    char text[1200], keys[1200], *out = NULL;
    snprintf(text, sizeof text, "%s/prefix.txt", tmpdir);
    FILE *f = fopen(text, "w");
    fputs(story, f);
    fclose(f);
    /* Tenant a's prefix. */
    cr_assert_eq(th_runf(&out, "%s compress --model %s --policy knorm --retention 1 --namespace a --text %s --store "
                         "%s/store 2>&1 | grep -o '[0-9a-f]\\{64\\}' | head -1",
                         getenv("PD_PREFIXCTL"), model, text, tmpdir),
                 0, "%s", out);
    char id[65];
    cr_assert_eq(sscanf(out, "%64s", id), 1, "%s", out);
    free(out);
    snprintf(keys, sizeof keys, "%s/keys", tmpdir);
    f = fopen(keys, "w");
    fputs("# key      namespace\nkey-a a\nkey-b b   # the second tenant\n", f);
    fclose(f);

    /* Readable by others: refused at start. */
    cr_assert_eq(chmod(keys, 0644), 0);
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' --set model.path=%s --set cache.path=%s/store --set server.port=%d "
             "--set server.api_keys_file=%s 2>&1", getenv("PD_PREFIXD"), model, tmpdir, th_free_port(), keys);
    cr_assert_neq(th_run(cmd, &out), 0, "%s", out);
    cr_assert_not_null(strstr(out, "chmod 600"), "%s", out);
    free(out);
    cr_assert_eq(chmod(keys, 0600), 0);
    char extra[1500];
    snprintf(extra, sizeof extra, "--set compression.min_prefix_tokens=8 --set server.api_keys_file=%s", keys);
    start_daemon(extra);

    char body[2048];
    snprintf(body, sizeof body, "{\"model\":\"test\",\"prompt\":\"%s Then\",\"max_tokens\":4,\"temperature\":0}", story);
    cr_assert_eq(post_as("key-a", body, &out), 200, "%s", out);
    cr_assert_gt(cached_tokens_of(out), 30, "tenant a finds its prefix: %s", out);
    free(out);
    cr_assert_eq(post_as("key-b", body, &out), 200, "%s", out);
    cr_assert_eq(cached_tokens_of(out), 0, "tenant b does not see a's prefix: %s", out);
    free(out);
    cr_assert_eq(post_as("key-c", body, &out), 401, "%s", out);
    free(out);
    /* A salt isolates further: a's prefix was registered without one. */
    snprintf(body, sizeof body, "{\"model\":\"test\",\"prompt\":\"%s Then\",\"max_tokens\":4,\"cache_salt\":\"s1\"}",
             story);
    cr_assert_eq(post_as("key-a", body, &out), 200, "%s", out);
    cr_assert_eq(cached_tokens_of(out), 0, "a salted request sees only salted prefixes: %s", out);
    free(out);

    /* prefix_id of a's prefix from b: exactly an unknown id, whether the
     * prompt extends it or not (no token counts, no model mismatch). */
    const char *unknown = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    const char *prompts[] = {" Then", "A different prompt"};
    for (int i = 0; i < 2; i++) {
        char *m[2];
        const char *ids[2] = {id, unknown};
        for (int k = 0; k < 2; k++) {
            snprintf(body, sizeof body, "{\"model\":\"test\",\"prompt\":\"%s%s\",\"max_tokens\":4,\"prefix_id\":\"%s\"}",
                     i ? "" : story, prompts[i], ids[k]);
            cr_assert_eq(post_as("key-b", body, &out), 404, "%s", out);
            m[k] = error_message_without_id(out, ids[k]);
            free(out);
        }
        cr_assert_str_eq(m[0], m[1], "another tenant's prefix answers like an unknown id");
        free(m[0]), free(m[1]);
    }
    snprintf(body, sizeof body, "{\"model\":\"test\",\"prompt\":\"%s Then\",\"max_tokens\":4,\"prefix_id\":\"%s\"}", story,
             id);
    cr_assert_eq(post_as("key-a", body, &out), 200, "its own tenant uses it: %s", out);
    cr_assert_gt(cached_tokens_of(out), 30, "%s", out);
    free(out);
}

/* More half-sent requests than the old 256-connection limit, and past
 * descriptor 1023 (select()'s limit): the daemon still answers. */
Test(daemon, slow_clients_do_not_stop_service) {
    start_daemon(NULL);
    enum { SLOW = 1100 };
    static int fds[SLOW];
    int open_n = 0;
    for (int i = 0; i < SLOW; i++) {
        fds[i] = socket(AF_INET, SOCK_STREAM, 0);
        if (fds[i] < 0) break; /* the test's own file limit */
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                                .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        cr_assert_eq(connect(fds[i], (struct sockaddr *)&a, sizeof a), 0);
        cr_assert_eq(send(fds[i], "GET /hea", 8, 0), 8);
        open_n++;
    }
    cr_assert_geq(open_n, 300, "could open only %d sockets (ulimit -n)", open_n);
    char *out = NULL;
    cr_assert_eq(get("/health", &out), 200, "with %d slow clients: %s", open_n, out);
    free(out);
    cr_assert_eq(post("/v1/completions", "{\"model\":\"test\",\"prompt\":\"The cat\",\"max_tokens\":4}", NULL, &out), 200,
                 "%s", out);
    free(out);
    for (int i = 0; i < open_n; i++) close(fds[i]);
}

Test(daemon, http_edges_get_answers_not_silence) {
    start_daemon("--set server.idle_timeout_s=1");
    /* 600 query arguments used to exhaust libmicrohttpd's 32 KiB pool:
     * the connection closed without a word. */
    size_t cap = 16384, n = 0;
    char *req = malloc(cap);
    cr_assert_not_null(req);
    n += (size_t)snprintf(req, cap, "GET /health?");
    for (int i = 0; i < 600; i++) n += (size_t)snprintf(req + n, cap - n, "%sa%d=1", i ? "&" : "", i);
    n += (size_t)snprintf(req + n, cap - n, " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    cr_assert_lt(n, cap);
    char *out = raw_exchange(req, n);
    cr_assert(strncmp(out, "HTTP/1.1 200", 12) == 0, "600 query arguments: '%.200s'", out);
    free(out);
    free(req);
    /* An encoded NUL does not end the path: "/metrics%00x" is not /metrics. */
    const char *nul_paths[] = {"/metrics%00x", "/health%00", "/v1/models%00junk"};
    for (size_t i = 0; i < sizeof nul_paths / sizeof nul_paths[0]; i++) {
        char get_req[256];
        const int k = snprintf(get_req, sizeof get_req, "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
                               nul_paths[i]);
        out = raw_exchange(get_req, (size_t)k);
        cr_assert(strncmp(out, "HTTP/1.1 404", 12) == 0, "%s: '%.200s'", nul_paths[i], out);
        free(out);
    }
    /* A transfer coding libmicrohttpd cannot decode: the body never
     * arrives as far as it is concerned, and the idle timeout, not the
     * 600 s generation deadline, ends the wait. */
    const char *gz = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
                     "5\r\nhello\r\n0\r\n\r\n";
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    out = raw_exchange(gz, strlen(gz));
    clock_gettime(CLOCK_MONOTONIC, &t1);
    cr_assert_lt((double)(t1.tv_sec - t0.tv_sec), 20.0, "closed by the idle timeout, not left hanging: '%s'", out);
    free(out);
}

/* ---- prefixes and metrics ------------------------------------------------------- */

Test(daemon, a_prefix_at_retention_half_is_used_and_reported) {
    TH_REQUIRE_SHARED();
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    store_story_prefix(0.5);
    start_daemon("--set compression.min_prefix_tokens=8");
    char body[2048], *out = NULL;
    snprintf(body, sizeof body, "{\"model\":\"test\",\"prompt\":\"%s Then\",\"max_tokens\":20,\"temperature\":0}", story);
    cr_assert_eq(post("/v1/completions", body, NULL, &out), 200, "%s", out);
    json_t *j = th_json_parse(out);
    json_t *usage = json_object_get(j, "usage");
    cr_assert_eq(json_integer_value(json_object_get(usage, "completion_tokens")), 20, "%s", out);
    json_int_t cached = json_integer_value(json_object_get(json_object_get(usage, "prompt_tokens_details"),
                                                           "cached_tokens"));
    cr_assert_gt(cached, 30, "%s", out);
    cr_assert_lt(cached, json_integer_value(json_object_get(usage, "prompt_tokens")), "%s", out);
    json_t *p = json_object_get(j, "prefix");
    cr_assert(json_is_object(p), "%s", out);
    cr_assert_eq(strlen(json_string_value(json_object_get(p, "id"))), 64, "%s", out);
    cr_assert_eq(json_integer_value(json_object_get(p, "original_tokens")), cached, "%s", out);
    double frac = json_number_value(json_object_get(p, "kept_fraction"));
    cr_assert(frac > 0.45 && frac < 0.55, "kept_fraction %g: %s", frac, out);
    json_int_t kept = json_integer_value(json_object_get(p, "kept_tokens"));
    cr_assert(kept >= cached * 2 / 5 && kept <= cached * 3 / 5, "%s", out);
    cr_assert(strstr(json_string_value(json_object_get(p, "policy")), "knorm"), "%s", out);
    json_decref(j);
    free(out);
    cr_assert_eq(get("/metrics", &out), 200, "%s", out);
    cr_assert_geq(th_metric(out, "prefixd_prefix_hits_total"), 1, "%s", out);
    free(out);
}

Test(daemon, metrics_expose_the_scheduler_series_after_a_request) {
    start_daemon(NULL);
    char *out = NULL;
    cr_assert_eq(post("/v1/completions", "{\"model\":\"test\",\"prompt\":\"Tom\",\"max_tokens\":10,\"temperature\":0,"
                                         "\"stream\":true}", NULL, &out),
                 200, "%s", out);
    free(out);
    cr_assert_eq(get("/metrics", &out), 200, "%s", out);
    cr_assert(strstr(out, "# TYPE prefixd_time_to_first_token_seconds histogram"), "%s", out);
    cr_assert_geq(th_metric(out, "prefixd_time_to_first_token_seconds_count"), 1, "%s", out);
    cr_assert_geq(th_metric(out, "prefixd_time_to_first_token_seconds_bucket{le=\"+Inf\"}"), 1, "%s", out);
    cr_assert_geq(th_metric(out, "prefixd_generated_tokens_total"), 10, "%s", out);
    cr_assert_gt(th_metric(out, "prefixd_prompt_tokens_total"), 0, "%s", out);
    cr_assert_geq(th_metric(out, "prefixd_requests_total{outcome=\"completed\"}"), 1, "%s", out);
    cr_assert_geq(th_metric(out, "prefixd_http_streams_total"), 1, "%s", out);
    cr_assert_geq(th_metric(out, "prefixd_queue_depth"), 0, "%s", out);
    free(out);
}

/* llama.cpp's "grammar" extension: a completion follows the client's GBNF
 * (stories260K, a real model, would otherwise write a story), and a grammar
 * that does not compile is a 400 naming the field and the line. */
Test(daemon, a_gbnf_grammar_constrains_the_completion) {
    start_daemon(NULL);
    for (int seed = 0; seed < 8; seed++) {
        char body[512], *out = NULL;
        snprintf(body, sizeof body, "{\"model\":\"test\",\"prompt\":\"Once upon a time\",\"max_tokens\":12,"
                 "\"temperature\":1,\"seed\":%d,\"grammar\":\"root ::= (\\\"yes\\\" | \\\"no\\\") \\\" \\\" "
                 "[0-9]{1,3}\"}", seed);
        cr_assert_eq(post("/v1/completions", body, NULL, &out), 200, "%s", out);
        json_t *j = th_json_parse(out);
        char *text = choice_text(j);
        const char *digits = strncmp(text, "yes ", 4) == 0 ? text + 4 : strncmp(text, "no ", 3) == 0 ? text + 3 : NULL;
        size_t n = digits ? strspn(digits, "0123456789") : 0;
        cr_assert(digits && n >= 1 && n <= 3 && digits[n] == '\0', "seed %d: %s", seed, text);
        free(text);
        json_decref(j);
        free(out);
    }
    char *out = NULL;
    cr_assert_eq(post("/v1/completions", "{\"model\":\"test\",\"prompt\":\"Hi\",\"grammar\":\"root ::= \\\"a\\\" b\"}",
                      NULL, &out), 400, "%s", out);
    json_t *j = th_json_parse(out);
    json_t *err = json_object_get(j, "error");
    cr_assert_str_eq(json_string_value(json_object_get(err, "param")), "grammar", "%s", out);
    cr_assert(strstr(json_string_value(json_object_get(err, "message")), "line 1"), "%s", out);
    json_decref(j);
    free(out);
    cr_assert_eq(post("/v1/completions", "{\"model\":\"test\",\"prompt\":\"Hi\",\"grammar\":\"root ::= \\\"a\\\"\","
                      "\"response_format\":{\"type\":\"json_object\"}}", NULL, &out), 400, "%s", out);
    cr_assert(strstr(out, "\"param\":\"grammar\""), "%s", out);
    free(out);
}

/* ---- the official openai client ------------------------------------------------ */

/* tests/openai/check.mjs with the `openai` npm package, unmodified: models,
 * completions and chat, streamed (for await) and not, models.retrieve (a
 * name with '/' too), role developer, and typed errors.
 * Skipped when node/npm are missing or the package cannot be installed (no
 * network). */
Test(daemon, the_official_openai_npm_client_works_against_the_server, .timeout = 280) {
    TH_REQUIRE_SHARED();
    if (system("node -e 'process.exit(+process.versions.node.split(\".\")[0] >= 18 ? 0 : 1)' >/dev/null 2>&1") != 0 ||
        system("npm --version >/dev/null 2>&1") != 0)
        cr_skip_test("node >= 18 and npm are needed (apt-get install nodejs npm)");
    const char *src = getenv("PD_SOURCE_ROOT");
    cr_assert_not_null(src, "PD_SOURCE_ROOT is set by meson");
    char *out = NULL;
    cr_assert_eq(th_runf(&out, "mkdir -p %s/openai && cp %s/tests/openai/package.json %s/tests/openai/check.mjs %s/openai/ "
                     "2>&1", tmpdir, src, src, tmpdir),
                 0, "%s", out);
    free(out);
    if (th_runf(&out, "cd %s/openai && timeout 90 npm install --no-audit --no-fund --fetch-retries=1 2>&1", tmpdir) != 0) {
        fprintf(stderr, "npm install openai failed:\n%s\n", out ? out : "");
        free(out);
        cr_skip_test("could not install the openai npm package (no network?)");
    }
    free(out);
    char path[1200];
    phi3_model(path, sizeof path);
    start_daemon_model(path, "--set server.model_names=test,org/model");
    int rc = th_runf(&out, "cd %s/openai && node check.mjs %d org/model 2>&1", tmpdir, port);
    cr_assert_eq(rc, 0, "check.mjs failed:\n%s", out ? out : "");
    cr_assert(out && strstr(out, "openai client checks passed"), "%s", out ? out : "");
    free(out);
}

/* server.request_timeout_s cancels a generation that runs too long: 504 for
 * a JSON response, an error event then [DONE] for a stream. */
Test(daemon, a_request_past_its_timeout_is_cancelled) {
    char slow[1200], *out = NULL;
    th_slow_model(tmpdir, slow, sizeof slow);
    start_daemon_model(slow, "--set server.request_timeout_s=1");
    /* EOS (id 2 in this vocabulary) is banned so nothing ends it early. */
    const char *body = "{\"model\":\"test\",\"prompt\":\"Hello\",\"max_tokens\":1500,\"logit_bias\":{\"2\":-100}%s}";
    char req[512];
    snprintf(req, sizeof req, body, "");
    cr_assert_eq(post("/v1/completions", req, NULL, &out), 504, "%s", out);
    json_t *j = th_json_parse(out);
    json_t *e = json_object_get(j, "error");
    cr_assert_str_eq(json_string_value(json_object_get(e, "code")), "timeout", "%s", out);
    cr_assert(strstr(json_string_value(json_object_get(e, "message")), "server.request_timeout_s"), "%s", out);
    json_decref(j);
    free(out);
    snprintf(req, sizeof req, body, ",\"stream\":true");
    cr_assert_eq(post("/v1/completions", req, NULL, &out), 200, "%s", out);
    cr_assert(strstr(out, "\"timeout\"") && strstr(out, "data: [DONE]"), "%s", out);
    free(out);
}

/* deploy/haproxy/prefixd.cfg, the recipe for HAProxy in front: answers and
 * streams pass through unchanged, and when prefixd is down the client still
 * gets the OpenAI error shape (502/503 in JSON), not HTML. */
Test(daemon, the_haproxy_recipe_passes_answers_and_keeps_errors_json) {
    if (system("haproxy -v >/dev/null 2>&1") != 0) cr_skip_test("haproxy is not installed");
    start_daemon(NULL);
    const char *src = getenv("PD_SOURCE_ROOT");
    cr_assert_not_null(src);
    const int hp = th_free_port();
    char *out = NULL;
    cr_assert_eq(th_runf(&out, "sed -e 's#/etc/haproxy/prefixd-errors#%s/deploy/haproxy/errors#' "
                               "-e 's#bind :8443#bind 127.0.0.1:%d#' -e 's#127.0.0.1:8080#127.0.0.1:%d#' "
                               "-e 's#log stdout.*#log stderr format raw local0#' "
                               "%s/deploy/haproxy/prefixd.cfg > %s/haproxy.cfg && haproxy -c -f %s/haproxy.cfg 2>&1",
                         src, hp, port, src, tmpdir, tmpdir),
                 0, "the recipe does not pass haproxy -c: %s", out);
    free(out);
    char *pid_text = NULL;
    cr_assert_eq(th_runf(&pid_text, "haproxy -f %s/haproxy.cfg -db >%s/haproxy.log 2>&1 & echo $!", tmpdir, tmpdir), 0);
    const pid_t proxy = (pid_t)atoi(pid_text);
    free(pid_text);
    int st = 0;
    for (int i = 0; i < 100 && (st = th_http(hp, "GET", "/health", NULL, NULL, NULL, &out)) != 200; i++) {
        free(out);
        out = NULL;
        usleep(50 * 1000);
    }
    cr_assert_eq(st, 200, "/health through the proxy: %s", out);
    free(out);

    const char *greedy = "{\"model\":\"test\",\"prompt\":\"Once upon a time\",\"max_tokens\":12,\"temperature\":0}";
    char *direct = NULL, *proxied = NULL, path[1200];
    snprintf(path, sizeof path, "%s/body.json", tmpdir);
    cr_assert_eq(post("/v1/completions", greedy, NULL, &direct), 200, "%s", direct);
    cr_assert_eq(th_http(hp, "POST", "/v1/completions", greedy, NULL, path, &proxied), 200, "%s", proxied);
    json_t *a = th_json_parse(direct), *b = th_json_parse(proxied);
    char *ta = choice_text(a), *tb = choice_text(b);
    cr_assert_str_eq(ta, tb, "the same greedy text through the proxy");
    free(ta);
    free(tb);
    json_decref(a);
    json_decref(b);
    free(direct);
    free(proxied);
    cr_assert_eq(th_http(hp, "POST", "/v1/completions",
                         "{\"model\":\"test\",\"prompt\":\"Tom had\",\"max_tokens\":16,\"stream\":true}", NULL, path, &out),
                 200, "%s", out);
    free(stream_text(out)); /* checks the [DONE] */
    free(out);
    cr_assert_eq(th_http(hp, "POST", "/v1/completions", "{\"model\":\"nope\",\"prompt\":\"Hi\"}", NULL, path, &out), 404,
                 "%s", out);
    json_t *j = th_json_parse(out);
    cr_assert_str_eq(error_code_of(j), "model_not_found", "prefixd's own error passes unchanged: %s", out);
    json_decref(j);
    free(out);

    stop_daemon(SIGKILL);
    st = th_http(hp, "GET", "/health", NULL, NULL, NULL, &out);
    cr_assert(st == 502 || st == 503, "prefixd down: %d %s", st, out);
    j = th_json_parse(out); /* fails the test unless the body is JSON */
    cr_assert(json_is_string(json_object_get(json_object_get(j, "error"), "type")), "%s", out);
    json_decref(j);
    free(out);
    kill(proxy, SIGTERM);
    cr_assert_eq(th_runf(NULL, "while kill -0 %d 2>/dev/null; do sleep 0.05; done", (int)proxy), 0);
}

/* log.format = json writes one JSON object per line (ts, level, msg);
 * log.level = error leaves out the info lines. */
Test(daemon, log_level_and_format_take_effect) {
    start_daemon("--set log.format=json");
    stop_daemon(SIGTERM);
    char *out = NULL;
    cr_assert_eq(th_runf(&out, "cat %s/prefixd.log", tmpdir), 0);
    int lines = 0;
    bool serving = false;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
        json_t *j = th_json_parse(line); /* fails the test unless each line is JSON */
        cr_assert(json_is_string(json_object_get(j, "ts")), "%s", line);
        const char *level = json_string_value(json_object_get(j, "level"));
        cr_assert(level && strstr("error warn info debug", level), "%s", line);
        const char *msg = json_string_value(json_object_get(j, "msg"));
        cr_assert_not_null(msg, "%s", line);
        serving |= strncmp(msg, "serving ", 8) == 0;
        json_decref(j);
        lines++;
    }
    free(out);
    cr_assert(lines >= 3 && serving, "%d lines, serving logged: %d", lines, serving);

    cr_assert_eq(th_runf(NULL, ": > %s/prefixd.log", tmpdir), 0);
    start_daemon("--set log.level=error");
    stop_daemon(SIGTERM);
    cr_assert_eq(th_runf(&out, "cat %s/prefixd.log", tmpdir), 0);
    cr_assert_null(strstr(out, "serving"), "info lines at log.level = error: %s", out);
    free(out);
}
