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
