/* The systemd deployment: the unit template verifies with systemd-analyze,
 * scores 2.0 or lower in its offline security analysis, the sysusers and
 * tmpfiles entries apply to a scratch root, and the CPU inference path runs
 * under the unit's MemoryDenyWriteExecute= (the kernel's equivalent,
 * PR_SET_MDWE). Tools that are missing make the test skip, not fail. */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "helpers.h"
#include "util/util.h"

#ifndef PR_SET_MDWE
#define PR_SET_MDWE 65
#endif
#ifndef PR_MDWE_REFUSE_EXEC_GAIN
#define PR_MDWE_REFUSE_EXEC_GAIN 1UL
#endif

enum { PATH_CAP = 4096 };

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

TestSuite(deploy, .init = setup, .fini = teardown);

/* snprintf that fails the test rather than truncating. */
__attribute__((format(printf, 3, 4))) static void fmt(char *out, size_t cap, const char *f, ...) {
    va_list ap;
    va_start(ap, f);
    int n = vsnprintf(out, cap, f, ap);
    va_end(ap);
    cr_assert(n >= 0 && (size_t)n < cap, "string too long (%d bytes)", n);
}

/* out = a + b (b starts with '/'). */
static void join(char *out, size_t cap, const char *a, const char *b) { fmt(out, cap, "%s%s", a, b); }

static bool have_tool(const char *name) {
    char cmd[PATH_CAP];
    fmt(cmd, sizeof cmd, "command -v %s >/dev/null 2>&1", name);
    return th_run(cmd, NULL) == 0;
}

static const char *env_or_skip(const char *name) {
    const char *v = getenv(name);
    if (!v || !*v) cr_skip_test("%s is not set (run through meson test)", name);
    return v;
}

static char *read_all(const char *path) {
    char *text = NULL;
    size_t len = 0;
    pd_error err = {0};
    cr_assert_eq(pd_read_file(path, &text, &len, &err), PD_OK, "%s", err.msg);
    return text;
}

static void write_all(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    cr_assert_eq(fputs(text, f) >= 0, true);
    cr_assert_eq(fclose(f), 0);
}

/* Length of the meson placeholder name at p ("@name@", name in
 * [-a-zA-Z0-9_]+, as configure_file matches it), or 0. The unit's own '@'
 * (SystemCallFilter=@system-service) is no placeholder. */
static size_t placeholder_len(const char *p) {
    if (*p != '@') return 0;
    size_t n = 0;
    while (p[1 + n] && (strchr("-_", p[1 + n]) || (p[1 + n] >= 'a' && p[1 + n] <= 'z') ||
                        (p[1 + n] >= 'A' && p[1 + n] <= 'Z') || (p[1 + n] >= '0' && p[1 + n] <= '9')))
        n++;
    return n > 0 && p[1 + n] == '@' ? n : 0;
}

static bool has_placeholder(const char *s) {
    for (; *s; s++)
        if (placeholder_len(s)) return true;
    return false;
}

/* Fill the placeholders of a meson template: each name in `vars` (name,
 * value pairs, NULL-terminated) by its value, any other by
 * "<other_root>/<name>". Returns a malloc'd string. */
static char *substitute(const char *tmpl, const char *const *vars, const char *other_root) {
    size_t cap = strlen(tmpl) * 2 + 4096, len = 0;
    char *out = malloc(cap);
    cr_assert_not_null(out);
    for (const char *p = tmpl; *p;) {
        size_t n = placeholder_len(p);
        char repl[1024];
        if (n) {
            fmt(repl, sizeof repl, "%s/%.*s", other_root, (int)n, p + 1);
            for (size_t i = 0; vars[i]; i += 2)
                if (strlen(vars[i]) == n && memcmp(p + 1, vars[i], n) == 0) fmt(repl, sizeof repl, "%s", vars[i + 1]);
            p += n + 2;
        } else {
            repl[0] = *p++;
            repl[1] = '\0';
        }
        size_t rl = strlen(repl);
        cr_assert_lt(len + rl, cap, "template too large");
        memcpy(out + len, repl, rl);
        len += rl;
    }
    out[len] = '\0';
    return out;
}

/* deploy/prefixd.service.in with ExecStart pointing at the built prefixd
 * (verify wants an executable), written as <tmpdir>/prefixd.service. */
static void make_unit(char *path, size_t cap) {
    const char *src = env_or_skip("PD_SOURCE_ROOT");
    const char *prefixd = env_or_skip("PD_PREFIXD");
    char tpath[PATH_CAP], bindir[PATH_CAP];
    join(tpath, sizeof tpath, src, "/deploy/prefixd.service.in");
    join(bindir, sizeof bindir, prefixd, "");
    char *dir = dirname(bindir);
    char *tmpl = read_all(tpath);
    const char *const vars[] = {"bindir", dir, NULL};
    char *unit = substitute(tmpl, vars, tmpdir);
    cr_assert(!has_placeholder(unit), "an @...@ placeholder was left in the unit");
    cr_assert_not_null(strstr(unit, "\nType=notify\n"));
    join(path, cap, tmpdir, "/prefixd.service");
    write_all(path, unit);
    free(unit);
    free(tmpl);
}

Test(deploy, unit_passes_systemd_analyze_verify) {
    if (!have_tool("systemd-analyze")) cr_skip_test("systemd-analyze is not installed");
    char unit[PATH_CAP], cmd[PATH_CAP];
    make_unit(unit, sizeof unit);
    fmt(cmd, sizeof cmd, "systemd-analyze verify '%s' 2>&1", unit);
    char *out = NULL;
    int rc = th_run(cmd, &out);
    cr_assert_not_null(out);
    cr_assert_eq(rc, 0, "systemd-analyze verify failed (%d):\n%s", rc, out);
    /* verify exits 0 on unknown or misspelt keys; it only warns, naming the
     * file. Any line about our unit is a mistake in it. */
    cr_assert_null(strstr(out, "prefixd.service"), "systemd-analyze verify warned:\n%s", out);
    free(out);
}

Test(deploy, unit_security_exposure_is_at_most_2) {
    if (!have_tool("systemd-analyze")) cr_skip_test("systemd-analyze is not installed");
    char unit[PATH_CAP], cmd[PATH_CAP];
    make_unit(unit, sizeof unit);
    /* --threshold is in tenths: 20 means an exposure of 2.0. */
    fmt(cmd, sizeof cmd, "systemd-analyze security --offline=true --threshold=20 --no-pager '%s' 2>&1", unit);
    char *out = NULL;
    int rc = th_run(cmd, &out);
    cr_assert_not_null(out);
    if (strstr(out, "unrecognized option") || strstr(out, "Unknown option"))
        cr_skip_test("this systemd-analyze has no offline security analysis (systemd < 250)");
    const char *line = strstr(out, "Overall exposure level for prefixd.service:");
    cr_assert_not_null(line, "no overall exposure line in:\n%s", out);
    double score = -1;
    cr_assert_eq(sscanf(line, "Overall exposure level for prefixd.service: %lf", &score), 1, "%s", line);
    cr_log_info("systemd-analyze security --offline=true: overall exposure %.1f", score);
    fprintf(stderr, "prefixd.service overall exposure level: %.1f\n", score);
    cr_assert_geq(score, 0.0);
    cr_assert_leq(score, 2.0, "exposure %.1f is above 2.0:\n%s", score, out);
    cr_assert_eq(rc, 0, "systemd-analyze security exited %d:\n%s", rc, out);
    free(out);
}

/* The copy meson generated (configure_file) has every placeholder filled.
 * Only when deploy/ is part of the build. */
Test(deploy, configured_unit_has_no_placeholders) {
    const char *prefixd = env_or_skip("PD_PREFIXD");
    char buf[PATH_CAP], path[PATH_CAP];
    join(buf, sizeof buf, prefixd, "");
    char *build_root = dirname(buf); /* <build>/prefixd */
    join(path, sizeof path, build_root, "/deploy/prefixd.service");
    if (access(path, R_OK) != 0) cr_skip_test("%s was not generated (deploy/ is not in the build)", path);
    char *unit = read_all(path);
    cr_assert(!has_placeholder(unit), "placeholder left in %s", path);
    const char *exec = strstr(unit, "\nExecStart=/");
    cr_assert_not_null(exec, "ExecStart is not an absolute path");
    cr_assert_not_null(strstr(exec, "/prefixd --config /"), "ExecStart: %.80s", exec + 1);
    free(unit);
}

/* systemd-sysusers creates the user in a scratch root, and the tmpfiles
 * entry then gives the config file mode 0640, group prefixd. */
Test(deploy, sysusers_and_tmpfiles_apply_to_a_scratch_root) {
    if (!have_tool("systemd-sysusers") || !have_tool("systemd-tmpfiles"))
        cr_skip_test("systemd-sysusers or systemd-tmpfiles is not installed");
    if (geteuid() != 0) cr_skip_test("needs root to chown inside the scratch root");
    const char *src = env_or_skip("PD_SOURCE_ROOT");
    char root[PATH_CAP], etc[PATH_CAP], confdir[PATH_CAP], conf[PATH_CAP], cmd[PATH_CAP], path[PATH_CAP];
    join(root, sizeof root, tmpdir, "/root");
    join(etc, sizeof etc, root, "/etc");
    join(confdir, sizeof confdir, etc, "/prefixd");
    cr_assert_eq(mkdir(root, 0755), 0);
    cr_assert_eq(mkdir(etc, 0755), 0);
    cr_assert_eq(mkdir(confdir, 0755), 0);

    fmt(cmd, sizeof cmd, "systemd-sysusers --root='%s' '%s/deploy/prefixd.sysusers' 2>&1", root, src);
    char *out = NULL;
    int rc = th_run(cmd, &out);
    cr_assert_eq(rc, 0, "systemd-sysusers failed:\n%s", out ? out : "");
    free(out);
    join(path, sizeof path, etc, "/passwd");
    char *passwd = read_all(path);
    const char *pw = strstr(passwd, "prefixd:x:");
    cr_assert_not_null(pw, "no prefixd user in:\n%s", passwd);
    unsigned uid = 0, gid = 0;
    cr_assert_eq(sscanf(pw, "prefixd:x:%u:%u:", &uid, &gid), 2);
    cr_assert_neq(uid, 0u, "prefixd must not be root");
    const char *eol = strchr(pw, '\n');
    char entry[512];
    snprintf(entry, sizeof entry, "%.*s", eol ? (int)(eol - pw) : (int)strlen(pw), pw);
    cr_assert_not_null(strstr(entry, ":/var/lib/prefixd:"), "home: %s", entry);
    cr_assert_not_null(strstr(entry, "nologin"), "shell: %s", entry);
    free(passwd);

    /* The tmpfiles entry is a template (@sysconfdir@); fill in /etc. */
    char tpath[PATH_CAP], tmpf[PATH_CAP];
    join(tpath, sizeof tpath, src, "/deploy/prefixd.tmpfiles");
    char *tmpl = read_all(tpath);
    const char *const vars[] = {"sysconfdir", "/etc", NULL};
    char *entries = substitute(tmpl, vars, tmpdir);
    join(tmpf, sizeof tmpf, tmpdir, "/prefixd-tmpfiles.conf");
    write_all(tmpf, entries);
    join(conf, sizeof conf, confdir, "/prefixd.conf");
    write_all(conf, "[server]\napi_key = secret\n");
    cr_assert_eq(chmod(conf, 0644), 0);
    fmt(cmd, sizeof cmd, "systemd-tmpfiles --root='%s' --create '%s' 2>&1", root, tmpf);
    rc = th_run(cmd, &out);
    cr_assert_eq(rc, 0, "systemd-tmpfiles failed:\n%s", out ? out : "");
    free(out);
    struct stat st;
    cr_assert_eq(stat(conf, &st), 0);
    cr_assert_eq(st.st_mode & 07777, 0640, "mode %o", (unsigned)(st.st_mode & 07777));
    cr_assert_eq(st.st_uid, 0u);
    cr_assert_eq(st.st_gid, gid, "group %u, want prefixd's %u", (unsigned)st.st_gid, gid);
    free(entries);
    free(tmpl);
}

/* Runs `cmd` through sh, with W^X enforced by the kernel when `mdwe`.
 * stdout goes to `out_path`. Returns the exit status, or -2 when the kernel
 * has no PR_SET_MDWE. */
static int run_sh(const char *cmd, bool mdwe, const char *out_path) {
    int pfd[2];
    cr_assert_eq(pipe(pfd), 0);
    pid_t pid = fork();
    cr_assert_neq(pid, -1);
    if (pid == 0) {
        close(pfd[0]);
        int status = 0;
        if (mdwe) {
            if (prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0L, 0L, 0L) != 0) status = -2;
            else {
                /* Prove it is on: a writable+executable mapping is refused. */
                void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE | PROT_EXEC, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
                if (p != MAP_FAILED) status = -3;
            }
        }
        if (write(pfd[1], &status, sizeof status) != (ssize_t)sizeof status) _exit(127);
        close(pfd[1]);
        if (status != 0) _exit(127);
        int fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd < 0 || dup2(fd, STDOUT_FILENO) < 0) _exit(127);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    close(pfd[1]);
    int status = -1;
    cr_assert_eq(read(pfd[0], &status, sizeof status), (ssize_t)sizeof status);
    close(pfd[0]);
    int ws = 0;
    cr_assert_eq(waitpid(pid, &ws, 0), pid);
    if (status == -2) return -2;
    cr_assert_eq(status, 0, "MDWE was set but a W+X mapping still succeeded");
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : -1;
}

Test(deploy, inference_runs_with_memory_deny_write_execute) {
    TH_REQUIRE_SHARED();
    char model[PATH_CAP];
    if (!th_shared_file("tinystories/stories260K.gguf", model, sizeof model))
        cr_skip_test("tinystories/stories260K.gguf is absent");
    const char *prefixctl = env_or_skip("PD_PREFIXCTL");
    const char *prefixd = env_or_skip("PD_PREFIXD");
    char cmd[PATH_CAP], plain[PATH_CAP], guarded[PATH_CAP];
    fmt(cmd, sizeof cmd,
             "'%s' --version && '%s' generate --model '%s' --prompt 'Once upon a time' -n 24 --ids --threads 2 "
             "2>/dev/null",
             prefixd, prefixctl, model);
    join(plain, sizeof plain, tmpdir, "/plain.txt");
    join(guarded, sizeof guarded, tmpdir, "/mdwe.txt");
    int rc = run_sh(cmd, true, guarded);
    if (rc == -2) cr_skip_test("this kernel has no PR_SET_MDWE (Linux < 6.3)");
    cr_assert_eq(rc, 0, "prefixd/prefixctl failed under W^X");
    cr_assert_eq(run_sh(cmd, false, plain), 0);
    char *a = read_all(plain), *b = read_all(guarded);
    cr_assert_not_null(strstr(a, "prefixd "), "%s", a);
    cr_assert_str_eq(b, a, "output differs under W^X");
    free(a);
    free(b);
}
