/* The operator console on the real daemon, driven by curl: its static files
 * (the embedded bytes, content types and security headers, no token
 * needed), where /admin/ui exists, the admin-side metrics and the
 * playground's completions (admin token, ?namespace=, streaming); and a
 * syntax check of the console's JavaScript with node when it is installed. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"
#include "helpers_json.h"

#define TOKEN "c0ns0le-t0ken"
#define API_KEY "publ1c-key"
#define CSP                                                                                                  \
    "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'; " \
    "frame-ancestors 'none'"

static char *tmpdir;
static char model[1024];
static pid_t daemon_pid;
static int port, admin_port;

static const char *story = "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
                           "sunshine. One day, she saw a big tree with a red ball in it. She wanted the ball very much.";

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

TestSuite(console, .init = setup, .fini = teardown, .timeout = 240);

static void start_daemon(const char *extra) {
    TH_REQUIRE_SHARED();
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    char args[4096], log[1200];
    snprintf(args, sizeof args, "--set model.path=%s --set cache.path=%s/store --set cache.map_size_mb=64 "
             "--set model.n_threads=2 --set compression.min_prefix_tokens=8 --set server.model_names=test %s",
             model, tmpdir, extra ? extra : "");
    snprintf(log, sizeof log, "%s/prefixd.log", tmpdir);
    daemon_pid = th_daemon_start(args, log, &port);
}

static int req_on(int p, const char *method, const char *path, const char *json, const char *auth, char **out) {
    char body_path[1200];
    snprintf(body_path, sizeof body_path, "%s/body.json", tmpdir);
    return th_http(p, method, path, json, auth, body_path, out);
}

/* A whole file into a malloc'd buffer (NUL-terminated); *len its size. */
static char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    cr_assert_not_null(buf);
    cr_assert_eq(fread(buf, 1, (size_t)n, f), (size_t)n, "%s", path);
    buf[n] = '\0';
    fclose(f);
    if (len) *len = (size_t)n;
    return buf;
}

/* One GET (or `method`) with curl: the status; the response headers in
 * *headers and the body in *body (both malloc'd, *body_len its size). */
typedef struct answer {
    int status;
    char *headers, *body;
    size_t body_len;
} answer;

static answer fetch(int p, const char *method, const char *path, const char *auth) {
    char hdr[1200], body[1200];
    snprintf(hdr, sizeof hdr, "%s/headers.txt", tmpdir);
    snprintf(body, sizeof body, "%s/answer.bin", tmpdir);
    unlink(hdr);
    unlink(body);
    char *code = NULL;
    th_runf(&code, "curl -s --path-as-is -X %s -D %s -o %s -w '%%{http_code}' %s%s%s 'http://127.0.0.1:%d%s'", method, hdr, body,
            auth ? "-H 'Authorization: Bearer " : "", auth ? auth : "", auth ? "'" : "", p, path);
    cr_assert_not_null(code);
    answer a = {.status = atoi(code)};
    free(code);
    a.headers = slurp(hdr, NULL);
    a.body = slurp(body, &a.body_len);
    if (!a.headers) a.headers = strdup("");
    if (!a.body) a.body = strdup("");
    return a;
}

static void answer_free(answer *a) {
    free(a->headers);
    free(a->body);
}

/* The value of response header `name` (case-insensitive), copied into out;
 * NULL when absent. */
static const char *header(const answer *a, const char *name, char *out, size_t cap) {
    const size_t n = strlen(name);
    for (const char *line = a->headers; line && *line; line = strchr(line, '\n'), line = line ? line + 1 : NULL) {
        if (strncasecmp(line, name, n) != 0 || line[n] != ':') continue;
        const char *v = line + n + 1;
        while (*v == ' ') v++;
        size_t k = strcspn(v, "\r\n");
        snprintf(out, cap, "%.*s", (int)k, v);
        return out;
    }
    return NULL;
}

static void expect_console_headers(const answer *a, const char *path) {
    char v[512];
    cr_assert(header(a, "Content-Security-Policy", v, sizeof v), "%s: no CSP:\n%s", path, a->headers);
    cr_assert_str_eq(v, CSP, "%s", path);
    cr_assert(header(a, "X-Content-Type-Options", v, sizeof v) && strcmp(v, "nosniff") == 0, "%s:\n%s", path, a->headers);
    cr_assert(header(a, "Referrer-Policy", v, sizeof v) && strcmp(v, "no-referrer") == 0, "%s:\n%s", path, a->headers);
    cr_assert(header(a, "Cache-Control", v, sizeof v) && strcmp(v, "no-cache") == 0, "%s:\n%s", path, a->headers);
}

/* The content type the console's files must be served with. */
static const char *expected_type(const char *name) {
    const char *dot = strrchr(name, '.');
    if (!dot) return NULL;
    if (strcmp(dot, ".html") == 0) return "text/html; charset=utf-8";
    if (strcmp(dot, ".css") == 0) return "text/css; charset=utf-8";
    if (strcmp(dot, ".js") == 0) return "text/javascript; charset=utf-8";
    return NULL;
}

/* The console's source folder (api/console), or skips. */
static const char *console_dir(char *buf, size_t cap) {
    const char *root = getenv("PD_SOURCE_ROOT");
    if (!root) cr_skip_test("PD_SOURCE_ROOT is not set (run through meson test)");
    snprintf(buf, cap, "%s/api/console", root);
    return buf;
}

/* Every file of api/console (but the generator) is served byte for byte
 * under /admin/ui/, with its content type and the security headers, to a
 * client without a token: so a file missing from api/meson.build's list
 * fails here. */
static void expect_all_files_served(int p) {
    char dir[1200];
    console_dir(dir, sizeof dir);
    DIR *d = opendir(dir);
    cr_assert_not_null(d, "%s", dir);
    int served = 0;
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.' || strcmp(e->d_name, "embed.py") == 0) continue;
        char src[1500], path[600];
        snprintf(src, sizeof src, "%s/%s", dir, e->d_name);
        snprintf(path, sizeof path, "/admin/ui/%s", e->d_name);
        size_t len;
        char *want = slurp(src, &len);
        cr_assert_not_null(want, "%s", src);
        answer a = fetch(p, "GET", path, NULL);
        cr_assert_eq(a.status, 200, "%s: %d %s", path, a.status, a.body);
        cr_assert(a.body_len == len && memcmp(a.body, want, len) == 0,
                  "%s is not the bytes of %s (rebuild?): %zu vs %zu bytes", path, src, a.body_len, len);
        char type[200];
        const char *t = expected_type(e->d_name);
        cr_assert_not_null(t, "api/console/%s: a file type the test does not know", e->d_name);
        cr_assert(header(&a, "Content-Type", type, sizeof type), "%s", path);
        cr_assert_str_eq(type, t, "%s", path);
        expect_console_headers(&a, path);
        answer_free(&a);
        free(want);
        served++;
    }
    closedir(d);
    cr_assert_geq(served, 3, "index.html, a script and a style sheet at least");
}

Test(console, files_are_served_without_a_token_with_their_types_and_csp) {
    start_daemon("--set admin.token=" TOKEN);
    expect_all_files_served(port);

    /* The folder is the index; it loads its script and style from here. */
    answer a = fetch(port, "GET", "/admin/ui/", NULL);
    cr_assert_eq(a.status, 200, "%s", a.body);
    char v[200];
    cr_assert(header(&a, "Content-Type", v, sizeof v) && strcmp(v, "text/html; charset=utf-8") == 0, "%s", a.headers);
    expect_console_headers(&a, "/admin/ui/");
    cr_assert(strstr(a.body, "<form id=\"login-form\""), "%s", a.body);
    cr_assert(strstr(a.body, "src=\"app.js\"") && strstr(a.body, "href=\"style.css\""), "%s", a.body);
    cr_assert_null(strstr(a.body, "<script>"), "no inline script (the CSP forbids it)");
    cr_assert_null(strstr(a.body, "style=\""), "no inline style (the CSP forbids it)");
    answer_free(&a);

    /* Without the slash: a redirect to it, so that relative URLs resolve. */
    a = fetch(port, "GET", "/admin/ui", NULL);
    cr_assert(a.status == 308 || a.status == 301, "%d", a.status);
    cr_assert(header(&a, "Location", v, sizeof v), "%s", a.headers);
    cr_assert_str_eq(v, "/admin/ui/");
    answer_free(&a);

    /* Unknown files, and methods other than GET. */
    a = fetch(port, "GET", "/admin/ui/nope.js", NULL);
    cr_assert_eq(a.status, 404, "%s", a.body);
    json_t *j = th_json_parse(a.body);
    cr_assert_str_eq(json_string_value(json_object_get(json_object_get(j, "error"), "type")), "not_found_error");
    json_decref(j);
    answer_free(&a);
    a = fetch(port, "GET", "/admin/ui/../v1/prefixes", NULL);
    cr_assert_neq(a.status, 200, "no way out of the console's files without the token: %s", a.body);
    answer_free(&a);
    a = fetch(port, "POST", "/admin/ui/app.js", NULL);
    cr_assert_eq(a.status, 405, "%s", a.body);
    answer_free(&a);

    /* The data stays behind the token. */
    a = fetch(port, "GET", "/admin/v1/prefixes", NULL);
    cr_assert_eq(a.status, 401, "%s", a.body);
    answer_free(&a);
}

Test(console, absent_without_an_admin_token) {
    start_daemon(NULL);
    answer a = fetch(port, "GET", "/admin/ui/", NULL);
    cr_assert_eq(a.status, 404, "%s", a.body);
    answer_free(&a);
    a = fetch(port, "GET", "/admin/ui", NULL);
    cr_assert_eq(a.status, 404, "%s", a.body);
    answer_free(&a);
    a = fetch(port, "GET", "/admin/v1/metrics", "anything");
    cr_assert_eq(a.status, 404, "%s", a.body);
    answer_free(&a);
}

/* With admin.port the console and its routes are on the admin listener
 * only. */
Test(console, on_the_admin_listener_only_when_it_has_its_own_port) {
    admin_port = th_free_port();
    char extra[256];
    snprintf(extra, sizeof extra, "--set admin.token=" TOKEN " --set admin.port=%d", admin_port);
    start_daemon(extra);
    static const char *const public_404[] = {"/admin/ui/", "/admin/ui", "/admin/ui/app.js"};
    for (size_t i = 0; i < sizeof public_404 / sizeof public_404[0]; i++) {
        answer a = fetch(port, "GET", public_404[i], NULL);
        cr_assert_eq(a.status, 404, "the public listener serves %s: %s", public_404[i], a.body);
        answer_free(&a);
    }
    answer a = fetch(port, "GET", "/admin/v1/metrics", TOKEN);
    cr_assert_eq(a.status, 404, "%s", a.body);
    answer_free(&a);
    char *out = NULL;
    cr_assert_eq(req_on(port, "POST", "/admin/v1/completions", "{\"model\":\"test\",\"prompt\":\"Once\",\"max_tokens\":1}",
                        TOKEN, &out), 404, "%s", out);
    free(out);

    expect_all_files_served(admin_port);
    a = fetch(admin_port, "GET", "/admin/ui", NULL);
    cr_assert_eq(a.status, 308, "%s", a.body);
    answer_free(&a);
    a = fetch(admin_port, "GET", "/admin/v1/metrics", TOKEN);
    cr_assert_eq(a.status, 200, "%s", a.body);
    answer_free(&a);
    cr_assert_eq(req_on(admin_port, "POST", "/admin/v1/completions",
                        "{\"model\":\"test\",\"prompt\":\"Once\",\"max_tokens\":2,\"temperature\":0}", TOKEN, &out),
                 200, "the playground works from the admin listener alone: %s", out);
    json_t *j = th_json_parse(out);
    cr_assert_eq(th_json_int(j, "usage", "completion_tokens"), 2, "%s", out);
    json_decref(j);
    free(out);
}

Test(console, admin_metrics_need_the_admin_token_and_are_the_prometheus_text) {
    start_daemon("--set admin.token=" TOKEN " --set server.api_key=" API_KEY " --set server.metrics_auth=true");
    static const char *const refused[] = {NULL, "wrong", API_KEY};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        answer a = fetch(port, "GET", "/admin/v1/metrics", refused[i]);
        cr_assert_eq(a.status, 401, "%s: %s", refused[i] ? refused[i] : "(none)", a.body);
        cr_assert(strstr(a.body, "invalid_admin_token"), "%s", a.body);
        answer_free(&a);
    }
    /* a request to count first, on a route the console adds */
    answer ui = fetch(port, "GET", "/admin/ui/app.js", NULL);
    cr_assert_eq(ui.status, 200);
    answer_free(&ui);
    answer a = fetch(port, "GET", "/admin/v1/metrics", TOKEN);
    cr_assert_eq(a.status, 200, "%s", a.body);
    char v[200];
    cr_assert(header(&a, "Content-Type", v, sizeof v), "%s", a.headers);
    cr_assert_str_eq(v, "text/plain; version=0.0.4; charset=utf-8");
    cr_assert(strstr(a.body, "# TYPE prefixd_requests_total counter"), "%s", a.body);
    cr_assert_eq(th_metric(a.body, "prefixd_store_prefixes"), 0, "%s", a.body);
    cr_assert_eq(th_metric(a.body, "prefixd_http_requests_total{route=\"/admin/ui/{file}\",status=\"200\"}"), 1, "%s",
                 a.body);
    cr_assert_eq(th_metric(a.body, "prefixd_http_requests_total{route=\"/admin/v1/metrics\",status=\"401\"}"), 3, "%s",
                 a.body);
    answer_free(&a);
    /* The same renderer as /metrics: the families match one for one. */
    answer pub = fetch(port, "GET", "/metrics", API_KEY);
    cr_assert_eq(pub.status, 200, "%s", pub.body);
    a = fetch(port, "GET", "/admin/v1/metrics", TOKEN);
    for (const char *p = pub.body; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        if (strncmp(p, "# TYPE ", 7) != 0) continue;
        char line[256];
        snprintf(line, sizeof line, "\n%.*s\n", (int)strcspn(p, "\n"), p);
        cr_assert(strstr(a.body, line) || strncmp(a.body, line + 1, strlen(line) - 1) == 0,
                  "/admin/v1/metrics lacks %s", line);
    }
    answer_free(&pub);
    answer_free(&a);
    /* not a POST route */
    char *out = NULL;
    cr_assert_eq(req_on(port, "POST", "/admin/v1/metrics", "{}", TOKEN, &out), 405, "%s", out);
    free(out);
}

/* The SSE events of a stream: the last usage and prefix seen, whether the
 * text arrived in more than one event and [DONE] ended it. */
typedef struct stream_seen {
    int events, text_events;
    json_int_t cached_tokens, prompt_tokens;
    char prefix_kind[32];
    bool done;
} stream_seen;

static stream_seen read_stream(const char *sse) {
    stream_seen s = {.cached_tokens = -1};
    for (const char *p = sse; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        if (strncmp(p, "data: ", 6) != 0) continue;
        const char *data = p + 6;
        const size_t n = strcspn(data, "\n");
        if (strncmp(data, "[DONE]", 6) == 0) {
            s.done = true;
            continue;
        }
        json_error_t je;
        json_t *j = json_loadb(data, n, 0, &je);
        cr_assert_not_null(j, "not JSON: %.*s", (int)n, data);
        s.events++;
        cr_assert_null(json_object_get(j, "error"), "%.*s", (int)n, data);
        json_t *choice = json_array_get(json_object_get(j, "choices"), 0);
        const char *text = json_string_value(json_object_get(choice, "text"));
        if (text && *text) s.text_events++;
        json_t *prefix = json_object_get(j, "prefix");
        if (!prefix) prefix = json_object_get(choice, "prefix");
        if (json_is_object(prefix))
            snprintf(s.prefix_kind, sizeof s.prefix_kind, "%s",
                     json_string_value(json_object_get(prefix, "kind")) ? json_string_value(json_object_get(prefix, "kind")) : "");
        json_t *usage = json_object_get(j, "usage");
        if (json_is_object(usage)) {
            s.prompt_tokens = json_integer_value(json_object_get(usage, "prompt_tokens"));
            s.cached_tokens = json_integer_value(json_object_get(json_object_get(usage, "prompt_tokens_details"), "cached_tokens"));
        }
        json_decref(j);
    }
    return s;
}

static stream_seen stream_story(int p, const char *path, const char *auth) {
    char body[2048], *out = NULL;
    snprintf(body, sizeof body, "{\"model\":\"test\",\"prompt\":\"%s Then\",\"max_tokens\":6,\"temperature\":0,"
             "\"stream\":true,\"stream_options\":{\"include_usage\":true}}", story);
    cr_assert_eq(req_on(p, "POST", path, body, auth, &out), 200, "%s", out);
    stream_seen s = read_stream(out);
    free(out);
    cr_assert(s.done, "the stream ends with [DONE]");
    cr_assert_geq(s.text_events, 2, "the text arrives in pieces");
    return s;
}

Test(console, admin_completions_need_the_admin_token_stream_and_take_the_namespace) {
    start_daemon("--set admin.token=" TOKEN " --set server.api_key=" API_KEY);
    char body[2048], *out = NULL;
    snprintf(body, sizeof body, "{\"text\":\"%s\",\"policy\":\"knorm\",\"retention\":0.5,\"wait\":true,"
             "\"namespace\":\"team-a\"}", story);
    cr_assert_eq(req_on(port, "POST", "/admin/v1/prefixes", body, TOKEN, &out), 201, "%s", out);
    json_t *job = th_json_parse(out);
    const json_int_t tokens = th_json_int(json_object_get(job, "prefix"), "tokens", NULL);
    json_decref(job);
    free(out);

    const char *ok = "{\"model\":\"test\",\"prompt\":\"Once\",\"max_tokens\":1}";
    static const char *const refused[] = {NULL, "wrong", API_KEY};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        cr_assert_eq(req_on(port, "POST", "/admin/v1/completions", ok, refused[i], &out), 401, "%s", out);
        cr_assert(strstr(out, "invalid_admin_token"), "%s", out);
        free(out);
        cr_assert_eq(req_on(port, "POST", "/admin/v1/chat/completions", ok, refused[i], &out), 401, "%s", out);
        free(out);
    }
    /* the admin token does not open the public endpoint */
    cr_assert_eq(req_on(port, "POST", "/v1/completions", ok, TOKEN, &out), 401, "%s", out);
    free(out);

    /* ?namespace= selects the registered prefix, as the API key's namespace would. */
    stream_seen s = stream_story(port, "/admin/v1/completions?namespace=team-a", TOKEN);
    cr_assert_eq(s.cached_tokens, tokens, "the registered prefix covers the story's %lld tokens", (long long)tokens);
    cr_assert_str_eq(s.prefix_kind, "registered");
    cr_assert_gt(s.prompt_tokens, tokens);
    s = stream_story(port, "/admin/v1/completions", TOKEN);
    cr_assert_neq(strcmp(s.prefix_kind, "registered"), 0, "no namespace: the team-a prefix is not found");

    /* The chat route is the public chat endpoint's: same answer for the same body. */
    const char *chat = "{\"model\":\"test\",\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":2}";
    char *pub = NULL;
    const int pub_status = req_on(port, "POST", "/v1/chat/completions", chat, API_KEY, &pub);
    const int adm_status = req_on(port, "POST", "/admin/v1/chat/completions", chat, TOKEN, &out);
    cr_assert_eq(adm_status, pub_status, "public %s / admin %s", pub, out);
    if (pub_status == 200) {
        cr_assert(strstr(out, "\"chat.completion\""), "%s", out);
    } else {
        json_t *a = th_json_parse(pub), *b = th_json_parse(out);
        cr_assert_str_eq(json_string_value(json_object_get(json_object_get(a, "error"), "code")),
                         json_string_value(json_object_get(json_object_get(b, "error"), "code")), "%s / %s", pub, out);
        json_decref(a);
        json_decref(b);
    }
    free(pub);
    free(out);
    cr_assert_eq(req_on(port, "GET", "/admin/v1/completions", NULL, TOKEN, &out), 405, "%s", out);
    free(out);

    /* The route labels of the metrics. */
    answer m = fetch(port, "GET", "/admin/v1/metrics", TOKEN);
    cr_assert_eq(th_metric(m.body, "prefixd_http_requests_total{route=\"/admin/v1/completions\",status=\"200\"}"), 2,
                 "%s", m.body);
    cr_assert_eq(th_metric(m.body, "prefixd_http_requests_total{route=\"/admin/v1/completions\",status=\"401\"}"), 3,
                 "%s", m.body);
    answer_free(&m);
}

Test(console, models_listed_for_the_playground) {
    start_daemon("--set admin.token=" TOKEN);
    answer a = fetch(port, "GET", "/admin/v1/models", NULL);
    cr_assert_eq(a.status, 401, "%s", a.body);
    answer_free(&a);
    a = fetch(port, "GET", "/admin/v1/models", TOKEN);
    cr_assert_eq(a.status, 200, "%s", a.body);
    json_t *j = th_json_parse(a.body);
    cr_assert_str_eq(json_string_value(json_object_get(json_array_get(json_object_get(j, "data"), 0), "id")), "test",
                     "%s", a.body);
    json_decref(j);
    answer_free(&a);
}

/* node --check on every script as an ES module (plain --check of a .js
 * file with import statements passes whatever follows on node 20). */
Test(console, scripts_parse_as_es_modules) {
    if (system("node --version >/dev/null 2>&1") != 0) cr_skip_test("node is not installed");
    char dir[1200];
    console_dir(dir, sizeof dir);
    DIR *d = opendir(dir);
    cr_assert_not_null(d, "%s", dir);
    int checked = 0;
    for (struct dirent *e; (e = readdir(d));) {
        const size_t n = strlen(e->d_name);
        if (n < 4 || strcmp(e->d_name + n - 3, ".js") != 0) continue;
        char *out = NULL;
        const int rc = th_runf(&out, "node --input-type=module --check < '%s/%s' 2>&1", dir, e->d_name);
        cr_assert_eq(rc, 0, "%s: %s", e->d_name, out ? out : "");
        free(out);
        checked++;
    }
    closedir(d);
    cr_assert_geq(checked, 1);
    /* and the check does catch a broken module */
    char bad[1200], *out = NULL;
    snprintf(bad, sizeof bad, "%s/bad.js", tmpdir);
    FILE *f = fopen(bad, "w");
    cr_assert_not_null(f);
    fputs("import { x } from './y.js';\nlet = ;\n", f);
    fclose(f);
    cr_assert_neq(th_runf(&out, "node --input-type=module --check < '%s' 2>&1", bad), 0, "%s", out ? out : "");
    free(out);
}
