#include "helpers.h"

#include <stdio.h>
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
