/* The OpenAI surface beyond completions, on the real daemon over loopback
 * with curl: GET /v1/models/{id}, role "developer", POST /tokenize and
 * /detokenize (checked against the engine's tokenizer and against
 * llama-server itself when ../shared/peer can run here), and CORS
 * (server.cors_origins) on plain, error, streamed and preflight answers. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/wait.h>
#include <unistd.h>

#include "engine/engine.h"
#include "helpers.h"
#include "helpers_json.h"
#include "tools/tools.h"

static char *tmpdir;
static char model[1024];
static pid_t daemon_pid, peer_pid;
static int port;

static void setup(void) {
    tmpdir = th_mkdtemp();
    cr_assert_not_null(tmpdir);
    if (system("curl --version >/dev/null 2>&1") != 0) cr_skip_test("curl is not installed");
}

static void teardown(void) {
    th_daemon_stop(&daemon_pid, SIGKILL);
    if (peer_pid > 0) {
        kill(peer_pid, SIGKILL);
        waitpid(peer_pid, NULL, 0);
        peer_pid = 0;
    }
    th_rmtree(tmpdir);
    free(tmpdir);
    tmpdir = NULL;
}

TestSuite(surface, .init = setup, .fini = teardown, .timeout = 240);

/* prefixd serving model_path as "test" (and whatever extra sets). */
static void start_daemon_model(const char *model_path, const char *extra) {
    char args[4096], log[1200];
    snprintf(args, sizeof args, "--set model.path=%s --set cache.path=%s/store --set cache.map_size_mb=64 "
             "--set model.n_threads=2 --set server.model_names=test %s", model_path, tmpdir, extra ? extra : "");
    snprintf(log, sizeof log, "%s/prefixd.log", tmpdir);
    daemon_pid = th_daemon_start(args, log, &port);
}

static void start_daemon(const char *extra) {
    TH_REQUIRE_SHARED();
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    start_daemon_model(model, extra);
}

static int post(const char *path, const char *json, const char *auth, char **out) {
    char body_path[1200];
    snprintf(body_path, sizeof body_path, "%s/body.json", tmpdir);
    return th_http(port, "POST", path, json, auth, body_path, out);
}

static int get(const char *path, const char *auth, char **out) {
    return th_http(port, "GET", path, NULL, auth, NULL, out);
}

/* The error object's field, or "" (null). */
static const char *error_field(json_t *j, const char *key) {
    json_t *v = json_object_get(json_object_get(j, "error"), key);
    return json_is_string(v) ? json_string_value(v) : "";
}

/* Status, body and error fields of one request that must fail. */
static void expect_error(int status, const char *out, int want_status, const char *type, const char *param,
                         const char *code) {
    cr_assert_eq(status, want_status, "%d, not %d: %s", status, want_status, out);
    json_t *j = th_json_parse(out);
    cr_expect_str_eq(error_field(j, "type"), type, "%s", out);
    cr_expect_str_eq(error_field(j, "param"), param ? param : "", "%s", out);
    cr_expect_str_eq(error_field(j, "code"), code ? code : "", "%s", out);
    cr_expect_gt(strlen(error_field(j, "message")), 10, "%s", out);
    json_decref(j);
}

/* A tiny generated model carrying the real Phi-3 vocabulary and chat
 * template (as in test_daemon.c). */
static void phi3_model(char *path, size_t cap) {
    TH_REQUIRE_SHARED();
    char vpath[1024];
    cr_assert_not_null(th_shared_file("vocab/ggml-vocab-phi-3.gguf", vpath, sizeof vpath));
    pd_testmodel_opts o;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset("tiny", &o, &err), PD_OK, "%s", err.msg);
    o.vocab_from = vpath;
    o.wtype = PD_TYPE_Q8_0;
    snprintf(path, cap, "%s/phi3.gguf", tmpdir);
    cr_assert_eq(pd_testmodel_write(&o, path, NULL, &err), PD_OK, "%s", err.msg);
}

/* ---- GET /v1/models/{id} ------------------------------------------------------ */

static void expect_model(const char *path, const char *id) {
    char *out = NULL;
    cr_assert_eq(get(path, "k1", &out), 200, "%s: %s", path, out);
    json_t *j = th_json_parse(out);
    cr_expect_str_eq(json_string_value(json_object_get(j, "id")), id, "%s", out);
    cr_expect_str_eq(json_string_value(json_object_get(j, "object")), "model", "%s", out);
    cr_expect_str_eq(json_string_value(json_object_get(j, "owned_by")), "prefixd", "%s", out);
    cr_expect(json_integer_value(json_object_get(j, "created")) > 1600000000, "%s", out);
    json_decref(j);
    free(out);
}

Test(surface, models_retrieve_answers_every_served_name_and_404s_the_rest) {
    start_daemon("--set server.model_names=test,org/model --set server.api_key=k1");
    expect_model("/v1/models/test", "test");
    /* a name with a slash, sent as it is and percent-encoded (what the
     * openai clients send) */
    expect_model("/v1/models/org/model", "org/model");
    expect_model("/v1/models/org%2Fmodel", "org/model");
    expect_model("/v1/models/org%2fmodel?x=1", "org/model");
    /* the list still has the first name only, with the same created */
    char *out = NULL;
    cr_assert_eq(get("/v1/models", "k1", &out), 200, "%s", out);
    json_t *list = th_json_parse(out);
    cr_expect_eq(json_array_size(json_object_get(list, "data")), 1);
    json_decref(list);
    free(out);

    const char *missing[] = {"/v1/models/nope", "/v1/models/", "/v1/models/org", "/v1/models/org/model/x",
                             "/v1/models/TEST", "/v1/models/test%00"};
    for (size_t i = 0; i < sizeof missing / sizeof missing[0]; i++) {
        int st = get(missing[i], "k1", &out);
        expect_error(st, out, 404, "not_found_error", "model", "model_not_found");
        cr_expect(strstr(out, "'test'"), "the message names the served id: %s", out);
        free(out);
    }
    /* like the list: the API key is needed */
    int st = get("/v1/models/test", NULL, &out);
    expect_error(st, out, 401, "authentication_error", NULL, "invalid_api_key");
    free(out);
    st = get("/v1/models/test", "wrong", &out);
    cr_expect_eq(st, 401, "%s", out);
    free(out);
}

/* ---- role developer -------------------------------------------------------------- */

/* A greedy chat answer; role NULL: the user message alone. */
static json_t *chat(const char *role) {
    char body[1024], lead[256] = "", *out = NULL;
    if (role) snprintf(lead, sizeof lead, "{\"role\":\"%s\",\"content\":\"You tell short stories.\"},", role);
    snprintf(body, sizeof body, "{\"model\":\"test\",\"messages\":[%s{\"role\":\"user\",\"content\":\"A cat\"}],"
             "\"max_tokens\":12,\"temperature\":0}", lead);
    int st = post("/v1/chat/completions", body, NULL, &out);
    cr_assert_eq(st, 200, "%s: %s", role, out);
    json_t *j = th_json_parse(out);
    free(out);
    return j;
}

static int64_t prompt_tokens_of(json_t *j) {
    return json_integer_value(json_object_get(json_object_get(j, "usage"), "prompt_tokens"));
}

static const char *content_of(json_t *j) {
    json_t *m = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message");
    return json_string_value(json_object_get(m, "content"));
}

Test(surface, role_developer_is_rendered_as_system) {
    char path[1200];
    phi3_model(path, sizeof path);
    start_daemon_model(path, NULL);
    json_t *sys = chat("system"), *dev = chat("developer");
    /* the same prompt (Phi-3 renders <|system|> ... <|end|>; test_api_request.c
     * compares the rendered text for every template): the same length and
     * the same greedy answer */
    cr_expect_eq(prompt_tokens_of(dev), prompt_tokens_of(sys));
    cr_expect_str_eq(content_of(dev), content_of(sys));
    /* and it is not dropped: without it the prompt is shorter */
    json_t *usr = chat(NULL);
    cr_expect_lt(prompt_tokens_of(usr), prompt_tokens_of(sys));
    json_decref(sys);
    json_decref(dev);
    json_decref(usr);
    /* other unknown roles stay a 400 that names developer among the choices */
    char *out = NULL;
    int st = post("/v1/chat/completions",
                  "{\"model\":\"test\",\"messages\":[{\"role\":\"function\",\"content\":\"x\"}]}", NULL, &out);
    expect_error(st, out, 400, "invalid_request_error", "messages[0].role", NULL);
    cr_expect(strstr(out, "developer"), "%s", out);
    free(out);
}

/* ---- /tokenize and /detokenize -------------------------------------------------- */

/* POST /tokenize {"content": text, ...opts}: the ids (malloc'd). */
static pd_token *tokenize_http(const char *text, const char *opts, size_t *n) {
    json_t *body = json_pack("{s:s}", "content", text);
    if (opts) {
        json_t *o = th_json_parse(opts);
        json_object_update(body, o);
        json_decref(o);
    }
    char *js = json_dumps(body, JSON_COMPACT), *out = NULL;
    json_decref(body);
    int st = post("/tokenize", js, NULL, &out);
    cr_assert_eq(st, 200, "%s -> %s", js, out);
    free(js);
    json_t *j = th_json_parse(out);
    json_t *arr = json_object_get(j, "tokens");
    cr_assert(json_is_array(arr), "%s", out);
    *n = json_array_size(arr);
    pd_token *ids = calloc(*n + 1, sizeof *ids);
    for (size_t i = 0; i < *n; i++) {
        json_t *x = json_array_get(arr, i);
        cr_assert(json_is_integer(x), "%s", out);
        ids[i] = (pd_token)json_integer_value(x);
    }
    json_decref(j);
    free(out);
    return ids;
}

static void expect_same_ids(const pd_tokenizer *tok, const char *text, const char *opts, bool add_special,
                            bool parse_special) {
    size_t n = 0, nref = 0;
    pd_token *ids = tokenize_http(text, opts, &n), *ref = NULL;
    pd_error err = {0};
    pd_tokenize_opts o = {.add_special = add_special, .parse_special = parse_special};
    cr_assert_eq(pd_tokenize(tok, text, strlen(text), o, &ref, &nref, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(n, nref, "'%s' %s: %zu ids, the tokenizer gives %zu", text, opts ? opts : "", n, nref);
    for (size_t i = 0; i < n; i++) cr_assert_eq(ids[i], ref[i], "'%s' %s: id %zu differs", text, opts, i);
    free(ids);
    free(ref);
}

static char *detokenize_http(const char *tokens_json) {
    char body[8192], *out = NULL;
    snprintf(body, sizeof body, "{\"tokens\":%s}", tokens_json);
    int st = post("/detokenize", body, NULL, &out);
    cr_assert_eq(st, 200, "%s -> %s", body, out);
    json_t *j = th_json_parse(out);
    json_t *c = json_object_get(j, "content");
    cr_assert(json_is_string(c), "%s", out);
    char *s = strdup(json_string_value(c));
    json_decref(j);
    free(out);
    return s;
}

Test(surface, tokenize_matches_the_tokenizer_and_detokenize_inverts_it) {
    char path[1200];
    phi3_model(path, sizeof path);
    start_daemon_model(path, NULL);
    pd_tokenizer *tok = th_tokenizer(path);
    const char *texts[] = {"Once upon a time", "", "  two  spaces\nand a line", "caf\xc3\xa9 \xe5\xaa\xbd \xf0\x9f\xa4\x97",
                           "<|user|>\nHi<|end|>\n<|assistant|>"};
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        /* defaults: no BOS, control tokens in the text parsed (llama-server's) */
        expect_same_ids(tok, texts[i], NULL, false, true);
        expect_same_ids(tok, texts[i], "{\"add_special\":true}", true, true);
        expect_same_ids(tok, texts[i], "{\"parse_special\":false}", false, false);
        expect_same_ids(tok, texts[i], "{\"add_special\":true,\"parse_special\":false,\"model\":\"x\"}", true, false);
    }

    /* with_pieces: each piece is the token's own text (a string when it is
     * valid UTF-8 alone, else its bytes), and the pieces joined are what
     * /detokenize answers for the same ids */
    const char *text = "<|user|>Hi \xe5\xaa\xbd\xf0\x9f\xa4\x97 there";
    char *out = NULL;
    json_t *req = json_pack("{s:s,s:b,s:b}", "content", text, "with_pieces", 1, "add_special", 1);
    char *js = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    cr_assert_eq(post("/tokenize", js, NULL, &out), 200, "%s", out);
    free(js);
    json_t *j = th_json_parse(out);
    free(out);
    json_t *arr = json_object_get(j, "tokens");
    size_t n = json_array_size(arr);
    cr_assert_gt(n, 4);
    char joined[1024] = "", ids[4096] = "[";
    size_t jl = 0;
    bool saw_bytes = false, saw_special = false;
    for (size_t i = 0; i < n; i++) {
        json_t *o = json_array_get(arr, i);
        cr_assert_eq(json_object_size(o), 2);
        const pd_token id = (pd_token)json_integer_value(json_object_get(o, "id"));
        json_t *piece = json_object_get(o, "piece");
        char want[256];
        int wl = pd_token_to_piece(tok, id, true, want, sizeof want);
        cr_assert(wl >= 0 && wl < (int)sizeof want);
        if (json_is_string(piece)) {
            cr_expect_eq(json_string_length(piece), (size_t)wl);
            cr_expect(memcmp(json_string_value(piece), want, (size_t)wl) == 0, "piece of %d", id);
            memcpy(joined + jl, want, (size_t)wl);
            saw_special |= strcmp(json_string_value(piece), "<|user|>") == 0;
        } else {
            cr_assert(json_is_array(piece), "piece of %d is neither text nor bytes", id);
            cr_expect_eq(json_array_size(piece), (size_t)wl);
            for (int b = 0; b < wl; b++)
                cr_expect_eq(json_integer_value(json_array_get(piece, (size_t)b)), (unsigned char)want[b]);
            saw_bytes = true;
            memcpy(joined + jl, want, (size_t)wl);
        }
        jl += (size_t)wl;
        snprintf(ids + strlen(ids), sizeof ids - strlen(ids), "%s%d", i ? "," : "", id);
    }
    joined[jl] = '\0';
    strcat(ids, "]");
    cr_expect(saw_special, "the control token is parsed and shown as its text");
    cr_expect(saw_bytes, "a character split across byte tokens comes back as bytes");
    json_decref(j);
    char *content = detokenize_http(ids);
    cr_expect_str_eq(content, joined);
    free(content);
    /* plain text comes back as it was, after the space SPM puts in front */
    const char *plain = "Hi \xe5\xaa\xbd\xf0\x9f\xa4\x97 there.";
    pd_token *pids = tokenize_http(plain, NULL, &n);
    snprintf(ids, sizeof ids, "[");
    for (size_t i = 0; i < n; i++) snprintf(ids + strlen(ids), sizeof ids - strlen(ids), "%s%d", i ? "," : "", pids[i]);
    strcat(ids, "]");
    free(pids);
    content = detokenize_http(ids);
    cr_expect(content[0] == ' ' && strcmp(content + 1, plain) == 0, "'%s' is not ' %s'", content, plain);
    free(content);

    content = detokenize_http("[]");
    cr_expect_str_eq(content, "");
    free(content);
    pd_tokenizer_free(tok);
}

Test(surface, tokenize_and_detokenize_validate_like_completions) {
    start_daemon("--set server.max_body_bytes=300000 --set server.api_key=k1");
    char *out = NULL;
    struct {
        const char *path, *body, *param;
        int status;
    } bad[] = {
        {"/tokenize", "{}", "content", 400},
        {"/tokenize", "{\"content\":5}", "content", 400},
        {"/tokenize", "{\"content\":[\"a\"]}", "content", 400},
        {"/tokenize", "{\"content\":\"a\",\"add_special\":1}", "add_special", 400},
        {"/tokenize", "{\"content\":\"a\",\"with_pieces\":\"yes\"}", "with_pieces", 400},
        {"/tokenize", "{\"content\":\"a\",\"parse_special\":null,\"with_pieces\":[]}", "with_pieces", 400},
        {"/tokenize", "[\"a\"]", NULL, 400},
        {"/tokenize", "{\"content\":\"a\"", NULL, 400},
        {"/tokenize", "{\"content\":\"a\",\"content\":\"b\"}", NULL, 400},
        {"/tokenize", "", NULL, 400},
        {"/detokenize", "{}", "tokens", 400},
        {"/detokenize", "{\"tokens\":\"1 2\"}", "tokens", 400},
        {"/detokenize", "{\"tokens\":[1,-2]}", "tokens", 400},
        {"/detokenize", "{\"tokens\":[1,2.5]}", "tokens", 400},
        {"/detokenize", "{\"tokens\":[1,512]}", "tokens[1]", 400},
        {"/detokenize", "{\"tokens\":[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]}", NULL, 400},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int st = post(bad[i].path, bad[i].body, "k1", &out);
        expect_error(st, out, bad[i].status, "invalid_request_error", bad[i].param, NULL);
        free(out);
    }
    /* the API key, as for completions */
    int st = post("/tokenize", "{\"content\":\"a\"}", NULL, &out);
    expect_error(st, out, 401, "authentication_error", NULL, "invalid_api_key");
    free(out);
    st = post("/detokenize", "{\"tokens\":[1]}", "nope", &out);
    expect_error(st, out, 401, "authentication_error", NULL, "invalid_api_key");
    free(out);
    /* GET is not a route */
    st = get("/tokenize", "k1", &out);
    cr_expect_eq(st, 404, "%s", out);
    free(out);

    /* The limits of completions: the prompt-token limit (32768) ... */
    size_t len = 40000 * 5;
    char *big = malloc(len + 64);
    strcpy(big, "{\"content\":\"");
    size_t o = strlen(big);
    for (size_t i = 0; i < 40000; i++, o += 5) memcpy(big + o, " time", 5);
    strcpy(big + o, "\"}");
    st = post("/tokenize", big, "k1", &out);
    expect_error(st, out, 400, "invalid_request_error", "content", "context_length_exceeded");
    cr_expect(strstr(out, "32768"), "%s", out);
    free(out);
    /* ... for detokenize too, counted before anything is decoded ... */
    strcpy(big, "{\"tokens\":[");
    o = strlen(big);
    for (size_t i = 0; i < 40000; i++, o += 4) memcpy(big + o, "403,", 4);
    strcpy(big + o - 1, "]}"); /* over the last comma */
    st = post("/detokenize", big, "k1", &out);
    expect_error(st, out, 400, "invalid_request_error", "tokens", "context_length_exceeded");
    free(out);
    /* ... and the body size (server.max_body_bytes): 413 */
    char *huge = malloc(400000);
    memset(huge, ' ', 399999);
    huge[399999] = '\0';
    memcpy(huge, "{\"content\":\"", 12);
    memcpy(huge + 399990, "\"}", 3);
    st = post("/tokenize", huge, "k1", &out);
    cr_expect_eq(st, 413, "%s", out);
    cr_expect(strstr(out, "request_too_large"), "%s", out);
    free(out);
    free(huge);
    free(big);
    /* just under the limit is fine */
    st = post("/tokenize", "{\"content\":\"Once upon a time\"}", "k1", &out);
    cr_expect_eq(st, 200, "%s", out);
    free(out);
}

/* llama-server (../shared/peer) on the same GGUF: the same answers to the
 * same /tokenize and /detokenize bodies. Skipped when the binary is absent
 * or cannot run on this CPU. */
static int start_peer(const char *gguf) {
    char bin[1200];
    const char *models = th_shared_models();
    snprintf(bin, sizeof bin, "%s/../peer/llama-server", models ? models : "/nonexistent");
    if (access(bin, X_OK) != 0) cr_skip_test("llama-server is absent (%s)", bin);
    char *out = NULL;
    if (th_runf(&out, "%s --version >/dev/null 2>&1", bin) != 0) {
        free(out);
        cr_skip_test("llama-server cannot run on this machine (it is built for AVX-512)");
    }
    free(out);
    int peer_port = th_free_port();
    peer_pid = fork();
    cr_assert_geq(peer_pid, 0);
    if (peer_pid == 0) {
        char p[16], log[1200];
        snprintf(p, sizeof p, "%d", peer_port);
        snprintf(log, sizeof log, "%s/peer.log", tmpdir);
        if (!freopen(log, "w", stderr) || !freopen("/dev/null", "w", stdout)) _exit(127);
        execl(bin, bin, "-m", gguf, "--host", "127.0.0.1", "--port", p, "-t", "1", "-c", "256", (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 300; i++) {
        out = NULL;
        int rc = th_runf(&out, "curl -s -o /dev/null -w '%%{http_code}' http://127.0.0.1:%d/health", peer_port);
        bool up = rc == 0 && out && strcmp(out, "200") == 0;
        free(out);
        if (up) return peer_port;
        int status = 0;
        if (waitpid(peer_pid, &status, WNOHANG) == peer_pid) {
            peer_pid = 0;
            /* --version passes on a CPU without AVX-512; the first
             * inference is what executes the instructions it lacks */
            if (WIFSIGNALED(status) && WTERMSIG(status) == SIGILL)
                cr_skip_test("llama-server cannot run on this machine (SIGILL: it is built for AVX-512)");
            cr_assert_fail("llama-server exited before it was healthy (see %s/peer.log)", tmpdir);
        }
        usleep(100000);
    }
    cr_assert_fail("llama-server did not become healthy");
    return -1;
}

Test(surface, tokenize_and_detokenize_answer_like_llama_server) {
    /* the peer first: a skip ends this process without the suite's fini,
     * and a daemon started before it would outlive the test */
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    const int peer_port = start_peer(model);
    start_daemon(NULL);
    const char *bodies[][2] = {
        {"/tokenize", "{\"content\":\"Once upon a time \xe5\xaa\xbd\"}"},
        {"/tokenize", "{\"content\":\"Once upon a time \xe5\xaa\xbd\",\"add_special\":true,\"with_pieces\":true}"},
        {"/tokenize", "{\"content\":\"<s>The cat sat.</s> Then\",\"with_pieces\":true}"},
        {"/tokenize", "{\"content\":\"\"}"},
        {"/detokenize", "{\"tokens\":[1,400,403,2,232]}"},
        {"/detokenize", "{\"tokens\":[403,407,261,378,410,232,173,192]}"},
        {"/detokenize", "{\"tokens\":[]}"},
    };
    for (size_t i = 0; i < sizeof bodies / sizeof bodies[0]; i++) {
        char *ours = NULL, *theirs = NULL;
        cr_assert_eq(post(bodies[i][0], bodies[i][1], NULL, &ours), 200, "%s", ours);
        char body_path[1200];
        snprintf(body_path, sizeof body_path, "%s/peer.json", tmpdir);
        FILE *f = fopen(body_path, "w");
        fputs(bodies[i][1], f);
        fclose(f);
        cr_assert_eq(th_runf(&theirs, "curl -s http://127.0.0.1:%d%s --data-binary @%s", peer_port, bodies[i][0],
                         body_path), 0);
        json_t *a = th_json_parse(ours), *b = th_json_parse(theirs);
        cr_expect(json_equal(a, b), "%s %s\nprefixd:      %s\nllama-server: %s", bodies[i][0], bodies[i][1], ours,
                  theirs);
        json_decref(a);
        json_decref(b);
        free(ours);
        free(theirs);
    }
}

/* ---- CORS --------------------------------------------------------------------------- */

/* curl -i with extra arguments; returns the status, the headers and body in *out. */
static int curl_i(char **out, const char *args) {
    char *raw = NULL;
    cr_assert_eq(th_runf(&raw, "curl -s -i %s -w '\\n%%{http_code}' 2>&1", args), 0, "%s", raw);
    char *nl = strrchr(raw, '\n');
    cr_assert_not_null(nl);
    int status = atoi(nl + 1);
    *nl = '\0';
    *out = raw;
    return status;
}

/* The value of header `name` in a curl -i answer (case-insensitive name),
 * or NULL; malloc'd. */
static char *header(const char *resp, const char *name) {
    const size_t n = strlen(name);
    for (const char *p = resp; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
        if (*p == '\r' || *p == '\n') break; /* end of the headers */
        if (strncasecmp(p, name, n) == 0 && p[n] == ':') {
            const char *v = p + n + 1;
            while (*v == ' ') v++;
            return strndup(v, strcspn(v, "\r\n"));
        }
    }
    return NULL;
}

static void expect_header(const char *resp, const char *name, const char *want) {
    char *v = header(resp, name);
    if (!want) cr_expect_null(v, "%s should be absent: %s", name, resp);
    else cr_expect(v && strcmp(v, want) == 0, "%s: '%s', not '%s'\n%s", name, v ? v : "(absent)", want, resp);
    free(v);
}

Test(surface, cors_headers_for_allowed_origins_on_every_kind_of_answer) {
    start_daemon("--set server.cors_origins=https://app.example,http://localhost:3000 --set server.api_key=k1");
    char args[1024], *out = NULL;
    const char *ok = "-H 'Origin: https://app.example'", *auth = "-H 'Authorization: Bearer k1'";

    /* preflight: 204 with the allow-lists, and no API key needed */
    snprintf(args, sizeof args, "-X OPTIONS %s -H 'Access-Control-Request-Method: POST' -H "
             "'Access-Control-Request-Headers: authorization,content-type' http://127.0.0.1:%d/v1/chat/completions",
             ok, port);
    cr_expect_eq(curl_i(&out, args), 204, "%s", out);
    expect_header(out, "Access-Control-Allow-Origin", "https://app.example");
    expect_header(out, "Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS");
    expect_header(out, "Access-Control-Allow-Headers", "Authorization, Content-Type, X-Request-Id");
    expect_header(out, "Access-Control-Max-Age", "7200");
    expect_header(out, "Vary", "Origin");
    free(out);
    /* the other listed origin, written in another case by the browser */
    snprintf(args, sizeof args, "-X OPTIONS -H 'Origin: HTTP://LOCALHOST:3000' http://127.0.0.1:%d/tokenize", port);
    cr_expect_eq(curl_i(&out, args), 204, "%s", out);
    expect_header(out, "Access-Control-Allow-Origin", "HTTP://LOCALHOST:3000");
    free(out);
    /* an origin not listed: 204 but nothing a browser would accept */
    const char *others[] = {"https://evil.example", "https://app.example.evil", "https://app.exampl",
                            "http://app.example", "null"};
    for (size_t i = 0; i < sizeof others / sizeof others[0]; i++) {
        snprintf(args, sizeof args, "-X OPTIONS -H 'Origin: %s' -H 'Access-Control-Request-Method: POST' "
                 "http://127.0.0.1:%d/v1/completions", others[i], port);
        cr_expect_eq(curl_i(&out, args), 204, "%s", out);
        expect_header(out, "Access-Control-Allow-Origin", NULL);
        expect_header(out, "Access-Control-Allow-Methods", NULL);
        expect_header(out, "Vary", "Origin");
        free(out);
    }

    /* actual answers: JSON, errors, a stream */
    snprintf(args, sizeof args, "%s %s http://127.0.0.1:%d/v1/models", ok, auth, port);
    cr_expect_eq(curl_i(&out, args), 200, "%s", out);
    expect_header(out, "Access-Control-Allow-Origin", "https://app.example");
    expect_header(out, "Access-Control-Expose-Headers", "X-Request-Id, Retry-After");
    expect_header(out, "Vary", "Origin");
    free(out);
    snprintf(args, sizeof args, "%s http://127.0.0.1:%d/v1/models/test", ok, port); /* no key: 401 */
    cr_expect_eq(curl_i(&out, args), 401, "%s", out);
    expect_header(out, "Access-Control-Allow-Origin", "https://app.example");
    free(out);
    snprintf(args, sizeof args, "%s %s -d '{\"content\":\"Once\"}' http://127.0.0.1:%d/tokenize", ok, auth, port);
    cr_expect_eq(curl_i(&out, args), 200, "%s", out);
    expect_header(out, "Access-Control-Allow-Origin", "https://app.example");
    free(out);
    snprintf(args, sizeof args, "%s %s -N -d '{\"model\":\"test\",\"prompt\":\"Once\",\"max_tokens\":4,\"stream\":true}' "
             "http://127.0.0.1:%d/v1/completions", ok, auth, port);
    cr_expect_eq(curl_i(&out, args), 200, "%s", out);
    expect_header(out, "Content-Type", "text/event-stream");
    expect_header(out, "Access-Control-Allow-Origin", "https://app.example");
    cr_expect(strstr(out, "data: [DONE]"), "%s", out);
    free(out);
    /* not allowed, or no Origin at all: no allow header, still Vary */
    snprintf(args, sizeof args, "-H 'Origin: https://evil.example' %s http://127.0.0.1:%d/v1/models", auth, port);
    cr_expect_eq(curl_i(&out, args), 200, "%s", out);
    expect_header(out, "Access-Control-Allow-Origin", NULL);
    expect_header(out, "Vary", "Origin");
    free(out);
    snprintf(args, sizeof args, "%s http://127.0.0.1:%d/v1/models", auth, port);
    cr_expect_eq(curl_i(&out, args), 200, "%s", out);
    expect_header(out, "Access-Control-Allow-Origin", NULL);
    free(out);
}

Test(surface, cors_star_and_cors_off) {
    start_daemon("--set server.cors_origins=*");
    char args[1024], *out = NULL;
    snprintf(args, sizeof args, "-X OPTIONS -H 'Origin: https://any.example' http://127.0.0.1:%d/v1/models", port);
    cr_expect_eq(curl_i(&out, args), 204, "%s", out);
    expect_header(out, "Access-Control-Allow-Origin", "*");
    expect_header(out, "Access-Control-Allow-Headers", "Authorization, Content-Type, X-Request-Id");
    expect_header(out, "Vary", NULL); /* the same answer for every origin */
    free(out);
    snprintf(args, sizeof args, "-H 'Origin: https://other.example' -d '{\"tokens\":[403]}' "
             "http://127.0.0.1:%d/detokenize", port);
    cr_expect_eq(curl_i(&out, args), 200, "%s", out);
    expect_header(out, "Access-Control-Allow-Origin", "*");
    free(out);
    th_daemon_stop(&daemon_pid, SIGTERM);

    /* the default: no CORS headers, and OPTIONS is a 405 like any other
     * method the API does not take */
    start_daemon(NULL);
    snprintf(args, sizeof args, "-X OPTIONS -H 'Origin: https://app.example' -H 'Access-Control-Request-Method: POST' "
             "http://127.0.0.1:%d/v1/completions", port);
    cr_expect_eq(curl_i(&out, args), 405, "%s", out);
    expect_header(out, "Access-Control-Allow-Origin", NULL);
    free(out);
    snprintf(args, sizeof args, "-H 'Origin: https://app.example' http://127.0.0.1:%d/v1/models", port);
    cr_expect_eq(curl_i(&out, args), 200, "%s", out);
    expect_header(out, "Access-Control-Allow-Origin", NULL);
    expect_header(out, "Vary", NULL);
    free(out);
}

/* The admin listener is for operators' tools, never browsers: no CORS
 * there even when the public listener has it. */
Test(surface, the_admin_listener_sends_no_cors_headers) {
    int admin_port = th_free_port();
    char extra[512];
    snprintf(extra, sizeof extra, "--set server.cors_origins=* --set admin.token=adm1 --set admin.port=%d", admin_port);
    start_daemon(extra);
    char args[1024], *out = NULL;
    snprintf(args, sizeof args, "-H 'Origin: https://any.example' -H 'Authorization: Bearer adm1' "
             "http://127.0.0.1:%d/admin/v1/prefixes", admin_port);
    cr_expect_eq(curl_i(&out, args), 200, "%s", out);
    expect_header(out, "Access-Control-Allow-Origin", NULL);
    free(out);
    snprintf(args, sizeof args, "-X OPTIONS -H 'Origin: https://any.example' http://127.0.0.1:%d/admin/v1/prefixes",
             admin_port);
    /* not a preflight there: the admin routes answer it as before (no token) */
    cr_expect_eq(curl_i(&out, args), 401, "%s", out);
    expect_header(out, "Access-Control-Allow-Origin", NULL);
    free(out);
}
