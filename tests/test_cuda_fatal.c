/* A GPU that fails for good. On cudaemu, with a fault injected into the
 * N-th kernel launch (CUDAEMU_FAIL_LAUNCH / CUDAEMU_FAIL_ERROR,
 * tests/cudaemu/README.md): the backend reports a sticky error as
 * PD_EDEVICE and other errors as before; the scheduler fails what is running
 * and queued with PD_EUNAVAILABLE and refuses new requests; prefixd logs the
 * error and exits with status 3 so that systemd restarts it; prefixctl
 * cuda-info runs one of our kernels and names the fix for a GPU the build
 * has no code for. Registered for CUDA and cudaemu builds; on a real GPU
 * (where nothing can be injected) the tests skip. Each Criterion test runs
 * in its own process, so each gets its own emulated context and fault. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "daemon/daemon.h"
#include "engine/engine.h"
#include "helpers.h"
#include "kernels/kernels.h"
#include "tools/tools.h"

static bool contains(const char *haystack, const char *needle) { return haystack && strstr(haystack, needle); }


/* Before the process's first launch: the emulator reads these once. */
static void inject(const char *launch, const char *error) {
    cr_assert_eq(setenv("CUDAEMU_FAIL_LAUNCH", launch, 1), 0);
    if (error) cr_assert_eq(setenv("CUDAEMU_FAIL_ERROR", error, 1), 0);
}

/* One RMSNorm through the backend, its result waited for: one launch. */
static int rmsnorm_once(pd_backend *be, pd_error *err) {
    enum { DIM = 64 };
    float x[DIM], w[DIM], out[DIM];
    for (int i = 0; i < DIM; i++) x[i] = w[i] = 1.0f + (float)i / DIM;
    float *dx = pd_backend_alloc(be, sizeof x, err);
    float *dw = dx ? pd_backend_alloc(be, sizeof w, err) : NULL;
    int rc = dw ? PD_OK : err->code;
    if (!rc) rc = pd_backend_upload(be, dx, x, sizeof x, err);
    if (!rc) rc = pd_backend_upload(be, dw, w, sizeof w, err);
    if (!rc) rc = pd_backend_rmsnorm(be, dx, dw, 1, DIM, 1e-5f, dx, err);
    if (!rc) rc = pd_backend_download(be, out, dx, sizeof out, err);
    if (!rc) rc = pd_backend_sync(be, err);
    pd_backend_release(be, dx);
    pd_backend_release(be, dw);
    return rc;
}

static pd_backend *cuda_backend(void) {
    pd_backend *be = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_backend_cuda_create(0, &be, &err), PD_OK, "%s", err.msg);
    return be;
}

/* ---- the backend: which errors are fatal -------------------------------- */

typedef struct fault_case {
    char error[40];    /* cudaError_t name (in the struct: Criterion copies parameters to the test's process) */
    int status;        /* what the backend reports */
    bool sticky;       /* the context is gone after it */
} fault_case;

ParameterizedTestParameters(cuda_fatal, injected_launch_error_maps_by_its_code) {
    static fault_case cases[] = {
        {"cudaErrorIllegalAddress", PD_EDEVICE, true},
        {"cudaErrorLaunchFailure", PD_EDEVICE, true},
        {"cudaErrorIllegalInstruction", PD_EDEVICE, true},
        {"cudaErrorMisalignedAddress", PD_EDEVICE, true},
        {"cudaErrorInvalidAddressSpace", PD_EDEVICE, true},
        {"cudaErrorInvalidPc", PD_EDEVICE, true},
        {"cudaErrorHardwareStackError", PD_EDEVICE, true},
        {"cudaErrorECCUncorrectable", PD_EDEVICE, true},
        {"cudaErrorAssert", PD_EDEVICE, true},
        {"cudaErrorLaunchTimeout", PD_EDEVICE, true},
        {"cudaErrorMemoryAllocation", PD_ENOMEM, false},
        {"cudaErrorInvalidValue", PD_EIO, false},
        {"cudaErrorInvalidConfiguration", PD_EIO, false},
        {"cudaErrorNoKernelImageForDevice", PD_EUNSUPPORTED, false},
    };
    return cr_make_param_array(fault_case, cases, sizeof cases / sizeof cases[0]);
}

ParameterizedTest(fault_case *fc, cuda_fatal, injected_launch_error_maps_by_its_code, .timeout = 60) {
    th_require_cudaemu();
    inject("1", fc->error);
    pd_backend *be = cuda_backend();
    pd_error err = {0};
    const int rc = rmsnorm_once(be, &err);
    cr_assert_eq(rc, fc->status, "%s: got %s (%d), want %s: %s", fc->error, pd_status_name(rc), rc,
                 pd_status_name(fc->status), err.msg);
    cr_assert(contains(err.msg, fc->error), "the message names the CUDA error: %s", err.msg);
    pd_error again = {0};
    const int rc2 = rmsnorm_once(be, &again);
    if (fc->sticky) {
        /* the context is gone: whatever comes next fails the same way */
        cr_assert(contains(err.msg, "nvidia-smi") && contains(err.msg, "restart"), "the fix is named: %s", err.msg);
        cr_assert_eq(rc2, PD_EDEVICE, "after %s: %s (%s)", fc->error, pd_status_name(rc2), again.msg);
        cr_assert(contains(again.msg, fc->error), "%s", again.msg);
    } else {
        cr_assert_eq(rc2, PD_OK, "after %s the device still works: %s", fc->error, again.msg);
    }
    if (fc->status == PD_EUNSUPPORTED) cr_assert(contains(err.msg, "-Dgpu_sm"), "%s", err.msg);
    pd_backend_free(be);
}

/* ---- the scheduler ------------------------------------------------------- */

typedef struct outcome {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int tokens;
    bool ended, error;
    int error_code;
    char error_msg[512];
    int hold_at;           /* > 0: wait inside this TOKEN until released */
    bool held, released;
} outcome;

static void outcome_init(outcome *o) {
    memset(o, 0, sizeof *o);
    pthread_mutex_init(&o->mu, NULL);
    pthread_cond_init(&o->cv, NULL);
}

static void outcome_sink(void *ctx, const pd_sched_event *ev) {
    outcome *o = ctx;
    pthread_mutex_lock(&o->mu);
    if (ev->kind == PD_SCHED_TOKEN) o->tokens++;
    if (ev->kind == PD_SCHED_DONE || ev->kind == PD_SCHED_ERROR) o->ended = true;
    if (ev->kind == PD_SCHED_ERROR) {
        o->error = true;
        o->error_code = ev->error_code;
        snprintf(o->error_msg, sizeof o->error_msg, "%s", ev->error_msg ? ev->error_msg : "");
    }
    pthread_cond_broadcast(&o->cv);
    if (ev->kind == PD_SCHED_TOKEN && o->tokens == o->hold_at) {
        o->held = true;
        pthread_cond_broadcast(&o->cv);
        while (!o->released) pthread_cond_wait(&o->cv, &o->mu);
    }
    pthread_mutex_unlock(&o->mu);
}

static void outcome_wait(outcome *o, bool *flag) {
    pthread_mutex_lock(&o->mu);
    while (!*flag) pthread_cond_wait(&o->cv, &o->mu);
    pthread_mutex_unlock(&o->mu);
}

static void outcome_release(outcome *o) {
    pthread_mutex_lock(&o->mu);
    o->released = true;
    pthread_cond_broadcast(&o->cv);
    pthread_mutex_unlock(&o->mu);
}

typedef struct failure_count {
    int n; /* written by the engine thread, read after it is joined */
} failure_count;

static void count_failure(void *ctx) { ((failure_count *)ctx)->n++; }

Test(cuda_fatal, scheduler_fails_running_and_queued_requests_and_refuses_new_ones, .timeout = 300) {
    th_require_cudaemu();
    /* Armed while A's engine thread waits in A's first token (B queued),
     * so the 30th launch after that falls in A's next steps, whatever the
     * model load and the scheduler's KV pool warm-up launched before. */
    inject("30", NULL);
    char *dir = th_mkdtemp();
    char arm[1100];
    snprintf(arm, sizeof arm, "%s/arm", dir);
    cr_assert_eq(setenv("CUDAEMU_FAIL_ARM", arm, 1), 0);
    char path[1024];
    snprintf(path, sizeof path, "%s/tiny.gguf", dir);
    pd_testmodel_opts mo;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset("tiny", &mo, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_testmodel_write(&mo, path, NULL, &err), PD_OK, "%s", err.msg);
    pd_backend *be = cuda_backend();
    pd_model *m = NULL;
    pd_model_params mp = {.n_threads = 1, .backend = be};
    cr_assert_eq(pd_model_load(path, &mp, &m, &err), PD_OK, "%s", err.msg);

    failure_count fc = {.n = 0};
    pd_scheduler_opts so;
    pd_scheduler_opts_default(&so);
    so.max_batch = 1; /* the second request waits in the queue */
    so.on_device_failure = count_failure;
    so.on_device_failure_ctx = &fc;
    pd_scheduler *s = NULL;
    cr_assert_eq(pd_scheduler_create(m, &so, &s, &err), PD_OK, "%s", err.msg);

    pd_token prompt[8];
    for (int i = 0; i < 8; i++) prompt[i] = (pd_token)(3 + i);
    pd_sched_params p;
    memset(&p, 0, sizeof p);
    p.prompt = prompt;
    p.n_prompt = 8;
    p.n_choices = 1;
    p.sampling = pd_sampler_params_default();
    p.sampling.temperature = 0.0f;
    p.gen.max_tokens = 200;
    p.gen.ignore_eos = true;
    p.cache = PD_CACHE_OFF;
    outcome a, b, c;
    outcome_init(&a);
    outcome_init(&b);
    outcome_init(&c);
    a.hold_at = 1; /* B is queued while A's engine thread waits in A's first token */
    pd_sched_request *ra = NULL, *rb = NULL, *rc = NULL;
    cr_assert_eq(pd_scheduler_submit(s, &p, outcome_sink, &a, &ra, &err), PD_OK, "%s", err.msg);
    outcome_wait(&a, &a.held);
    cr_assert_eq(pd_scheduler_submit(s, &p, outcome_sink, &b, &rb, &err), PD_OK, "%s", err.msg);
    pd_scheduler_stats st;
    pd_scheduler_stats_get(s, &st);
    cr_assert_eq(st.queued, 1);
    cr_assert(!st.device_failed);
    const int arm_fd = open(arm, O_WRONLY | O_CREAT | O_EXCL, 0600);
    cr_assert_geq(arm_fd, 0, "%s: %s", arm, strerror(errno));
    close(arm_fd);
    outcome_release(&a);
    outcome_wait(&a, &a.ended);
    outcome_wait(&b, &b.ended);

    cr_assert(a.error, "the running request failed (it got %d tokens and finished instead)", a.tokens);
    cr_assert_geq(a.tokens, 1);
    cr_assert_lt(a.tokens, 200);
    cr_assert_eq(a.error_code, PD_EUNAVAILABLE, "%s: %s", pd_status_name(a.error_code), a.error_msg);
    cr_assert(contains(a.error_msg, "GPU failed"), "%s", a.error_msg);
    cr_assert(b.error, "the queued request failed");
    cr_assert_eq(b.tokens, 0);
    cr_assert_eq(b.error_code, PD_EUNAVAILABLE, "%s: %s", pd_status_name(b.error_code), b.error_msg);

    /* nothing is admitted any more */
    pd_error serr = {0};
    cr_assert_eq(pd_scheduler_submit(s, &p, outcome_sink, &c, &rc, &serr), PD_EUNAVAILABLE, "%s", serr.msg);
    cr_assert_null(rc);
    cr_assert(contains(serr.msg, "GPU failed"), "%s", serr.msg);
    pd_scheduler_stats_get(s, &st);
    cr_assert(st.device_failed);
    cr_assert_eq(st.failed, 2);
    cr_assert_eq(st.queued + st.running, 0);

    pd_sched_request_release(ra);
    pd_sched_request_release(rb);
    pd_scheduler_free(s); /* joins the engine thread, which calls the hook */
    cr_assert_eq(fc.n, 1, "the owner is told once (told %d times)", fc.n);
    pd_model_free(m);
    pd_backend_free(be);
    th_rmtree(dir);
    free(dir);
}

/* ---- prefixd ------------------------------------------------------------- */

static char *read_text(const char *path) {
    char *text = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_read_file(path, &text, NULL, &err), PD_OK, "%s", err.msg);
    return text;
}

/* Wait (bounded) for the daemon to exit by itself; its wait status. */
static int wait_exit(pid_t pid, int max_seconds) {
    for (int i = 0; i < max_seconds * 20; i++) {
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) return st;
        struct timespec ts = {0, 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    cr_assert_fail("prefixd did not exit within %d s of the GPU failure", max_seconds);
    return -1;
}

Test(cuda_fatal, prefixd_fails_requests_with_503_and_exits_3, .timeout = 400) {
    th_require_cudaemu();
    if (system("curl --version >/dev/null 2>&1") != 0) cr_skip_test("curl is not installed");
    TH_REQUIRE_SHARED();
    char model[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    /* The fault is armed only once A is streaming and B is queued behind it
     * (CUDAEMU_FAIL_ARM): from then on the 20th launch fails, inside A's
     * next step or so. Racing the two clients to the server, or guessing a
     * launch number that lands in A's tokens, made this test flaky. */
    inject("20", NULL);
    char *dir = th_mkdtemp();
    char arm[1100];
    snprintf(arm, sizeof arm, "%s/arm", dir);
    cr_assert_eq(setenv("CUDAEMU_FAIL_ARM", arm, 1), 0);
    char args[4096], log[1200];
    snprintf(args, sizeof args,
             "--set model.path=%s --set cache.path=%s/store --set cache.map_size_mb=64 --set model.n_threads=2 "
             "--set server.model_names=test --set scheduler.max_batch=1 --set model.device=cuda:0",
             model, dir);
    snprintf(log, sizeof log, "%s/prefixd.log", dir);
    int port = 0;
    pid_t pid = th_daemon_start(args, log, &port);

    /* A streams; EOS (id 2) is banned so it cannot end before the fault. */
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "(curl -s -N -o %s/a.out -w '%%{http_code}' -H 'Content-Type: application/json' --data-binary "
             "'{\"model\":\"test\",\"prompt\":\"Once upon a time\",\"max_tokens\":400,\"temperature\":0,"
             "\"logit_bias\":{\"2\":-100},\"stream\":true}' http://127.0.0.1:%d/v1/completions > %s/a.status 2>&1; "
             "touch %s/a.done) &",
             dir, port, dir, dir);
    cr_assert_eq(system(cmd), 0);
    snprintf(cmd, sizeof cmd, "for i in $(seq 600); do grep -q '\"text\"' %s/a.out 2>/dev/null && exit 0; sleep 0.01; done; exit 1",
             dir);
    cr_assert_eq(system(cmd), 0, "A streamed no token");
    /* B waits behind A (max_batch 1). */
    snprintf(cmd, sizeof cmd,
             "(curl -s -o %s/b.out -w '%%{http_code}' -H 'Content-Type: application/json' --data-binary "
             "'{\"model\":\"test\",\"prompt\":\"Lily\",\"max_tokens\":5}' http://127.0.0.1:%d/v1/completions "
             "> %s/b.status 2>&1; touch %s/b.done) &",
             dir, port, dir, dir);
    cr_assert_eq(system(cmd), 0);
    double queued = 0;
    for (int i = 0; i < 600 && queued < 1; i++) {
        char *metrics = NULL;
        if (th_http(port, "GET", "/metrics", NULL, NULL, NULL, &metrics) == 200)
            queued = th_metric(metrics, "prefixd_queue_depth");
        free(metrics);
        if (queued < 1) nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
    }
    cr_assert_eq(queued, 1, "B was never queued behind A");
    const int arm_fd = open(arm, O_WRONLY | O_CREAT | O_EXCL, 0600);
    cr_assert_geq(arm_fd, 0, "%s: %s", arm, strerror(errno));
    close(arm_fd);

    const int st = wait_exit(pid, 300);
    cr_assert(WIFEXITED(st), "prefixd was killed by signal %d", WIFSIGNALED(st) ? WTERMSIG(st) : 0);
    char *text = read_text(log);
    cr_assert_eq(WEXITSTATUS(st), 3, "exit status %d (want 3, the GPU failed); log:\n%s", WEXITSTATUS(st), text);
    /* one error line with the CUDA error and the fix */
    const char *line = strstr(text, "cudaErrorIllegalAddress");
    cr_assert_not_null(line, "%s", text);
    cr_assert(contains(text, "nvidia-smi") && contains(text, "prefixctl cuda-info"), "%s", text);
    int error_lines = 0;
    for (const char *q = text; (q = strstr(q, "the GPU context is unusable")); q++) error_lines++;
    cr_assert_eq(error_lines, 1, "the error is logged once:\n%s", text);
    cr_assert(contains(text, "exiting with status 3"), "%s", text);

    /* the clients: both closed once prefixd exited (curl waits for that) */
    char p_a[1200], p_b[1200];
    snprintf(cmd, sizeof cmd, "for i in $(seq 600); do [ -e %s/a.done ] && [ -e %s/b.done ] && exit 0; sleep 0.1; done; exit 1",
             dir, dir);
    cr_assert_eq(system(cmd), 0, "the clients did not finish after prefixd exited");
    snprintf(p_a, sizeof p_a, "%s/a.out", dir);
    snprintf(p_b, sizeof p_b, "%s/b.status", dir);
    char *a_body = read_text(p_a), *b_status = read_text(p_b);
    /* A's stream began (200) and ends with an error event, not [DONE] after tokens */
    cr_assert(contains(a_body, "\"text\""), "A streamed tokens before the fault:\n%s", a_body);
    cr_assert(contains(a_body, "\"error\"") && contains(a_body, "GPU failed"), "A's stream:\n%s", a_body);
    cr_assert_str_eq(b_status, "503", "B (queued) got %s", b_status);
    snprintf(p_b, sizeof p_b, "%s/b.out", dir);
    char *b_body = read_text(p_b);
    cr_assert(contains(b_body, "GPU failed"), "%s", b_body);
    free(a_body);
    free(b_body);
    free(b_status);
    free(text);
    th_rmtree(dir);
    free(dir);
}

Test(cuda_fatal, prefixd_exits_3_when_the_gpu_fails_while_warming_up, .timeout = 120) {
    th_require_cudaemu();
    TH_REQUIRE_SHARED();
    char model[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    char *dir = th_mkdtemp();
    char *out = NULL;
    /* launch 1 is the warm-up token's first kernel */
    const int status = th_runf(&out,
                               "CUDAEMU_FAIL_LAUNCH=1 '%s' --set model.path=%s --set cache.path=%s/store "
                               "--set cache.map_size_mb=64 --set model.device=cuda:0 --set server.port=%d 2>&1",
                               getenv("PD_PREFIXD"), model, dir, th_free_port());
    cr_assert_eq(status, 3, "exit status %d (want 3, the GPU failed):\n%s", status, out);
    cr_assert(contains(out, "warming up the model") && contains(out, "cudaErrorIllegalAddress"), "%s", out);
    cr_assert(!contains(out, "serving "), "it never served:\n%s", out);
    free(out);
    th_rmtree(dir);
    free(dir);
}

/* A precompression job runs on its own model but in the process's one CUDA
 * context: its sticky error kills serving too, so prefixd exits 3 even with
 * no request in flight. */
Test(cuda_fatal, prefixd_exits_3_when_the_gpu_fails_in_a_precompression_job, .timeout = 300) {
    th_require_cudaemu();
    if (system("curl --version >/dev/null 2>&1") != 0) cr_skip_test("curl is not installed");
    TH_REQUIRE_SHARED();
    char model[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    inject("3", NULL);
    char *dir = th_mkdtemp();
    char arm[1100], args[4096], log[1200], body[1100];
    snprintf(arm, sizeof arm, "%s/arm", dir);
    snprintf(body, sizeof body, "%s/body.json", dir);
    cr_assert_eq(setenv("CUDAEMU_FAIL_ARM", arm, 1), 0);
    snprintf(args, sizeof args,
             "--set model.path=%s --set cache.path=%s/store --set cache.map_size_mb=64 --set model.n_threads=2 "
             "--set server.model_names=test --set model.device=cuda:0 --set admin.token=fatal-test-token",
             model, dir);
    snprintf(log, sizeof log, "%s/prefixd.log", dir);
    int port = 0;
    pid_t pid = th_daemon_start(args, log, &port);
    /* serving works; then the fault is armed and a job meets it */
    char *out = NULL;
    cr_assert_eq(th_http(port, "POST", "/v1/completions", "{\"model\":\"test\",\"prompt\":\"Lily\",\"max_tokens\":3}",
                         NULL, body, &out),
                 200, "%s", out);
    free(out);
    const int arm_fd = open(arm, O_WRONLY | O_CREAT | O_EXCL, 0600);
    cr_assert_geq(arm_fd, 0, "%s: %s", arm, strerror(errno));
    close(arm_fd);
    out = NULL;
    const int code = th_http(port, "POST", "/admin/v1/prefixes",
                             "{\"text\":\"Once upon a time there was a little girl named Lily. She liked to play.\","
                             "\"policy\":\"knorm\",\"retention\":0.5}",
                             "fatal-test-token", body, &out);
    cr_assert_eq(code, 202, "%s", out);
    free(out);

    const int st = wait_exit(pid, 120);
    char *text = read_text(log);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 3, "want exit status 3 (the GPU failed); log:\n%s", text);
    cr_assert(contains(text, "precompression job 1: ") && contains(text, "cudaErrorIllegalAddress"), "%s", text);
    cr_assert(contains(text, "exiting with status 3"), "%s", text);
    free(text);
    th_rmtree(dir);
    free(dir);
}

/* ---- prefixctl cuda-info ------------------------------------------------- */

Test(cuda_fatal, cuda_info_runs_a_kernel_self_test, .timeout = 120) {
    if (!pd_cuda_compiled() || pd_cuda_device_count() < 1) cr_skip_test("no CUDA device");
    const char *ctl = getenv("PD_PREFIXCTL");
    cr_assert_not_null(ctl);
    char *out = NULL;
    int status = th_runf(&out, "'%s' cuda-info 2>&1", ctl);
    cr_assert_eq(status, 0, "%s", out);
    cr_assert(contains(out, "kernel self-test (RMSNorm): ok"), "%s", out);
    free(out);
}

Test(cuda_fatal, cuda_info_names_the_gpu_sm_fix_when_the_build_has_no_code_for_the_gpu, .timeout = 120) {
    th_require_cudaemu();
    const char *ctl = getenv("PD_PREFIXCTL");
    cr_assert_not_null(ctl);
    char *out = NULL;
    /* cuda-info's first launch is its kernel self-test (cuBLAS runs no
     * launch of ours) */
    int status = th_runf(&out, "CUDAEMU_FAIL_LAUNCH=1 CUDAEMU_FAIL_ERROR=cudaErrorNoKernelImageForDevice '%s' cuda-info 2>&1",
                         ctl);
    cr_assert_eq(status, 1, "%s", out);
    cr_assert(contains(out, "cuBLAS SGEMM self-test: ok"), "%s", out);
    cr_assert(contains(out, "kernel self-test (RMSNorm): failed: ") && contains(out, "cudaErrorNoKernelImageForDevice") &&
                  contains(out, "-Dgpu_sm"),
              "%s", out);
    free(out);
}
