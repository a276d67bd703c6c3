#include "helpers.h"
#include "helpers_json.h"
#include "engine/engine.h"
#include "kernels/kernels.h"

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <sys/socket.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "util/util.h"

const char *th_shared_models(void) {
    const char *p = getenv("PD_SHARED_MODELS");
    struct stat st;
    if (!p || stat(p, &st) != 0 || !S_ISDIR(st.st_mode)) return NULL;
    return p;
}

const char *th_shared_file(const char *rel, char *buf, size_t cap) {
    const char *root = th_shared_models();
    if (!root) return NULL;
    snprintf(buf, cap, "%s/%s", root, rel);
    return access(buf, R_OK) == 0 ? buf : NULL;
}

char *th_mkdtemp(void) {
    const char *base = getenv("TMPDIR");
    char tmpl[512];
    snprintf(tmpl, sizeof tmpl, "%s/prefixd-test-XXXXXX", base && *base ? base : "/tmp");
    char *d = mkdtemp(tmpl);
    return d ? strdup(d) : NULL;
}

void th_rmtree(const char *dir) {
    if (!dir || !*dir || strcmp(dir, "/") == 0) return;
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", dir);
}

int th_run(const char *cmd, char **out) {
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    char *buf = NULL;
    size_t len = 0;
    pd_error err;
    if (pd_read_stream(p, &buf, &len, &err) != PD_OK) buf = NULL;
    int st = pclose(p);
    if (out) *out = buf;
    else free(buf);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

void th_llama_quantize(const char *src, const char *dst, const char *ftype) {
    const char *models = th_shared_models();
    char bin[1024];
    if (models) snprintf(bin, sizeof bin, "%s/../peer/llama-quantize", models);
    if (!models || access(bin, X_OK) != 0)
        cr_skip_test("../shared/peer/llama-quantize is absent (set PD_SHARED_MODELS); skipping");
    char *out = NULL;
    const int rc = th_runf(&out, "'%s' '%s' '%s' %s 2>&1", bin, src, dst, ftype);
    if (rc == 128 + SIGILL) {
        free(out);
        cr_skip_test("llama-quantize needs AVX-512, which this CPU lacks; skipping");
    }
    cr_assert_eq(rc, 0, "llama-quantize %s %s %s exited with %d:\n%s", src, dst, ftype, rc, out ? out : "");
    free(out);
}

void th_buf_bytes(th_buf *b, const void *p, size_t n) {
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n) cap *= 2;
        uint8_t *nd = realloc(b->data, cap);
        if (!nd) abort();
        b->data = nd;
        b->cap = cap;
    }
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
}
void th_buf_u8(th_buf *b, uint8_t v) { th_buf_bytes(b, &v, 1); }
void th_buf_u32(th_buf *b, uint32_t v) {
    uint8_t x[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    th_buf_bytes(b, x, 4);
}
void th_buf_u64(th_buf *b, uint64_t v) {
    th_buf_u32(b, (uint32_t)v);
    th_buf_u32(b, (uint32_t)(v >> 32));
}
void th_buf_f32(th_buf *b, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    th_buf_u32(b, u);
}
void th_buf_str(th_buf *b, const char *s) {
    th_buf_u64(b, strlen(s));
    th_buf_bytes(b, s, strlen(s));
}
void th_buf_pad(th_buf *b, size_t alignment) {
    while (b->len % alignment) th_buf_u8(b, 0);
}
void th_buf_free(th_buf *b) {
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

int th_free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t l = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &l);
    close(fd);
    return ntohs(a.sin_port);
}

int th_runf(char **out, const char *fmt, ...) {
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    return th_run(cmd, out);
}

pid_t th_daemon_start(const char *args, const char *log, int *port) {
    const char *prefixd = getenv("PD_PREFIXD");
    cr_assert_not_null(prefixd, "PD_PREFIXD is not set (run through meson test)");
    *port = th_free_port();
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        char cmd[8192];
        snprintf(cmd, sizeof cmd, "exec %s %s --set server.port=%d 2>>%s", prefixd, args, *port, log);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    /* Loading takes a moment; poll readiness (a bound, not a timing check). */
    for (int i = 0; i < 600; i++) {
        char *out = NULL;
        int rc = th_runf(&out, "curl -s -o /dev/null -w '%%{http_code}' http://127.0.0.1:%d/health", *port);
        bool ok = rc == 0 && out && strcmp(out, "200") == 0;
        free(out);
        if (ok) return pid;
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            char *l = NULL;
            th_runf(&l, "cat %s", log);
            cr_assert_fail("prefixd exited early:\n%s", l ? l : "");
        }
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    cr_assert_fail("prefixd did not become healthy");
    return -1;
}

int th_daemon_stop(pid_t *pid, int sig) {
    if (*pid <= 0) return -1;
    kill(*pid, sig);
    int st = -1;
    waitpid(*pid, &st, 0);
    *pid = 0;
    return st;
}

int th_http(int port, const char *method, const char *path, const char *json, const char *auth,
            const char *body_file, char **out) {
    char data[1300] = "";
    if (json) {
        FILE *f = fopen(body_file, "w");
        cr_assert_not_null(f, "%s", body_file);
        fputs(json, f);
        fclose(f);
        snprintf(data, sizeof data, "-H 'Content-Type: application/json' --data-binary @%s", body_file);
    }
    char *raw = NULL;
    th_runf(&raw, "curl -s -N -X %s -w '\\n%%{http_code}' %s%s%s %s 'http://127.0.0.1:%d%s'", method,
            auth ? "-H 'Authorization: Bearer " : "", auth ? auth : "", auth ? "'" : "", data, port, path);
    cr_assert_not_null(raw);
    char *nl = strrchr(raw, '\n');
    cr_assert_not_null(nl, "%s", raw);
    int status = atoi(nl + 1);
    *nl = '\0';
    *out = raw;
    return status;
}

json_t *th_json_parse(const char *text) {
    json_error_t je;
    json_t *j = json_loads(text, 0, &je);
    cr_assert_not_null(j, "not JSON (%s): %s", je.text, text);
    return j;
}

json_int_t th_json_int(json_t *obj, const char *a, const char *b) {
    json_t *v = json_object_get(obj, a);
    if (b) v = json_object_get(v, b);
    cr_assert(json_is_integer(v), "%s%s%s is not an integer", a, b ? "." : "", b ? b : "");
    return json_integer_value(v);
}

double th_metric(const char *text, const char *series) {
    size_t n = strlen(series);
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (strncmp(p, series, n) == 0 && p[n] == ' ') return strtod(p + n + 1, NULL);
    return -1;
}

void th_slow_model(const char *dir, char *path, size_t cap) {
    TH_REQUIRE_SHARED();
    char vocab[1024];
    if (!th_shared_file("vocab/ggml-vocab-llama-spm.gguf", vocab, sizeof vocab)) cr_skip_test("no llama-spm vocab");
    snprintf(path, cap, "%s/slow.gguf", dir);
    char *out = NULL;
    cr_assert_eq(th_runf(&out, "%s gen-model --preset smollm2-135m --n-layer 6 --type q8_0 --seed 1 --vocab-from %s -o %s "
                               "2>&1", getenv("PD_PREFIXCTL"), vocab, path),
                 0, "%s", out);
    free(out);
}

int th_flip_in_file(const char *path, const void *pat, size_t len, size_t at) {
    char *buf = NULL;
    size_t size = 0;
    pd_error err = {0};
    cr_assert_eq(pd_read_file(path, &buf, &size, &err), PD_OK, "%s", err.msg);
    int hits = 0;
    for (size_t i = 0; i + len <= size; i++)
        if (memcmp(buf + i, pat, len) == 0) {
            buf[i + at] ^= 0x40;
            hits++;
        }
    FILE *f = fopen(path, "r+b");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(buf, 1, size, f), size);
    fclose(f);
    free(buf);
    return hits;
}

pd_tokenizer *th_shared_tokenizer(const char *rel) {
    char path[1024];
    if (!th_shared_file(rel, path, sizeof path)) cr_skip_test("%s is absent (../shared/models); skipping", rel);
    return th_tokenizer(path);
}

pd_tokenizer *th_tokenizer(const char *path) {
    pd_gguf *g = NULL;
    pd_tokenizer *t = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open(path, &g, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_tokenizer_load(g, &t, &err), PD_OK, "%s", err.msg);
    pd_gguf_close(g);
    return t;
}

void th_require_cudaemu(void) {
    if (!pd_cuda_compiled() || pd_cuda_device_count() < 1) cr_skip_test("no CUDA device");
    pd_cuda_device_info info;
    pd_error err = {0};
    cr_assert_eq(pd_cuda_device_info_get(0, &info, &err), PD_OK, "%s", err.msg);
    if (strncmp(info.name, "cudaemu", 7) != 0)
        cr_skip_test("cuda:0 is a real GPU (%s): faults are injected only on cudaemu", info.name);
}
