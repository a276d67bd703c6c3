/* kernels/device.c: where the model computes. pd_device_parse /
 * pd_device_format round trips and errors (and that config's model.device
 * reads the same strings the same way), pd_backend_create for cpu, auto and
 * cuda (failing cleanly without a GPU), and the device choice end to end:
 * prefixd with model.device and prefixctl with --device.
 *
 * Tests whose expectation depends on the machine skip where it has the
 * other kind: the "no GPU" tests skip on a GPU host, the "GPU" tests skip
 * without one. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "config/config.h"
#include "helpers.h"
#include "helpers_json.h"
#include "kernels/kernels.h"
#include "policies/policies.h"
#include "tools/tools.h"

static bool contains(const char *haystack, const char *needle) {
    return haystack && strstr(haystack, needle) != NULL;
}

/* What the build and the machine offer, for the tests that depend on it. */
static bool have_cuda_device(void) { return pd_cuda_compiled() && pd_cuda_device_count() > 0; }

/* ------------------------------------------------------------------------
 * Parsing and formatting
 * ------------------------------------------------------------------------ */

typedef struct device_case {
    const char *text;
    pd_device_kind kind;
    int index;
    const char *canonical;
} device_case;

static const device_case good_devices[] = {
    {"cpu", PD_DEVICE_CPU, 0, "cpu"},         {"CPU", PD_DEVICE_CPU, 0, "cpu"},
    {"Cpu", PD_DEVICE_CPU, 0, "cpu"},         {"auto", PD_DEVICE_AUTO, 0, "auto"},
    {"AUTO", PD_DEVICE_AUTO, 0, "auto"},      {"cuda", PD_DEVICE_CUDA, 0, "cuda:0"},
    {"CUDA", PD_DEVICE_CUDA, 0, "cuda:0"},    {"cuda:0", PD_DEVICE_CUDA, 0, "cuda:0"},
    {"cuda:1", PD_DEVICE_CUDA, 1, "cuda:1"},  {"Cuda:7", PD_DEVICE_CUDA, 7, "cuda:7"},
    {"cuda:42", PD_DEVICE_CUDA, 42, "cuda:42"}, {"cuda:255", PD_DEVICE_CUDA, 255, "cuda:255"},
    {"cuda:007", PD_DEVICE_CUDA, 7, "cuda:7"},
};

static const char *const bad_devices[] = {
    "",        "gpu",      "cuda:",     "cuda:256", "cuda:-1",  "cuda:+1",   "cuda: 1",
    "cuda:1 ", " cpu",     "cpu ",      "cuda:1x",  "cuda:0x1", "cuda:1000", "cuda:0007",
    "cuda0",   "cuda:1:2", "cpu:0",     "auto:0",   "cudas",    "metal",     "rocm:0",
    "cuda:1.", "c",        "cuda:\xff",
};

Test(device, parse_accepts_the_documented_forms) {
    for (size_t i = 0; i < sizeof good_devices / sizeof good_devices[0]; i++) {
        const device_case *c = &good_devices[i];
        pd_device d = {.kind = PD_DEVICE_AUTO, .index = 99};
        pd_error err = {0};
        cr_assert_eq(pd_device_parse(c->text, &d, &err), PD_OK, "'%s': %s", c->text, err.msg);
        cr_assert_eq(d.kind, c->kind, "'%s'", c->text);
        cr_assert_eq(d.index, c->index, "'%s'", c->text);
    }
}

Test(device, format_is_canonical_and_round_trips) {
    for (size_t i = 0; i < sizeof good_devices / sizeof good_devices[0]; i++) {
        const device_case *c = &good_devices[i];
        pd_device d, back;
        pd_error err = {0};
        cr_assert_eq(pd_device_parse(c->text, &d, &err), PD_OK, "%s", err.msg);
        char buf[16];
        pd_device_format(&d, buf, sizeof buf);
        cr_assert_str_eq(buf, c->canonical, "'%s'", c->text);
        cr_assert_eq(pd_device_parse(buf, &back, &err), PD_OK, "'%s': %s", buf, err.msg);
        cr_assert_eq(back.kind, d.kind);
        cr_assert_eq(back.index, d.index);
    }
    /* A short buffer is cut, still terminated. */
    pd_device d = {.kind = PD_DEVICE_CUDA, .index = 123};
    char small[5];
    memset(small, 'x', sizeof small);
    pd_device_format(&d, small, sizeof small);
    cr_assert_str_eq(small, "cuda");
}

Test(device, parse_errors_list_the_accepted_forms) {
    for (size_t i = 0; i < sizeof bad_devices / sizeof bad_devices[0]; i++) {
        const char *text = bad_devices[i];
        pd_device d = {.kind = PD_DEVICE_CUDA, .index = 3};
        pd_error err = {0};
        int rc = pd_device_parse(text, &d, &err);
        cr_assert_eq(rc, PD_EINVAL, "'%s' was accepted", text);
        cr_assert_eq(err.code, PD_EINVAL);
        cr_assert(contains(err.msg, "is not one of cpu, cuda, cuda:N (N = 0..255) or auto"), "'%s': %s",
                  text, err.msg);
        cr_assert(d.kind == PD_DEVICE_CUDA && d.index == 3, "a failed parse changed the output");
    }
    pd_device d;
    pd_error err = {0};
    cr_assert_eq(pd_device_parse("tpu", &d, &err), PD_EINVAL);
    cr_assert(contains(err.msg, "'tpu'"), "the message should echo the text: %s", err.msg);
    /* Long or binary input is echoed cut and printable. */
    char long_text[300];
    memset(long_text, 'z', sizeof long_text - 1);
    long_text[sizeof long_text - 1] = '\0';
    cr_assert_eq(pd_device_parse(long_text, &d, &err), PD_EINVAL);
    cr_assert(strlen(err.msg) < 200 && contains(err.msg, "..."), "%s", err.msg);
    cr_assert_eq(pd_device_parse("cuda:\x1b[2J", &d, &err), PD_EINVAL);
    cr_assert(!strchr(err.msg, '\x1b'), "a control byte reached the message");
    cr_assert_eq(pd_device_parse(NULL, &d, &err), PD_EINVAL);
}

/* config/config.c parses model.device itself (config does not depend on
 * kernels/): it must accept exactly what pd_device_parse accepts, read it the
 * same way and word its refusal the same way. */
Test(device, config_reads_model_device_like_pd_device_parse) {
    const size_t n_good = sizeof good_devices / sizeof good_devices[0];
    const size_t n_bad = sizeof bad_devices / sizeof bad_devices[0];
    for (size_t i = 0; i < n_good + n_bad; i++) {
        const char *text = i < n_good ? good_devices[i].text : bad_devices[i - n_good];
        pd_device d;
        pd_error kerr = {0}, cerr = {0};
        int krc = pd_device_parse(text, &d, &kerr);
        pd_config cfg;
        pd_config_defaults(&cfg);
        char set[64];
        snprintf(set, sizeof set, "model.device=%s", text);
        int crc = pd_config_set(&cfg, set, &cerr);
        /* --set trims the value, as a config file does; compare untrimmed
         * texts only where trimming changes nothing. */
        size_t len = strlen(text);
        if (len && (text[0] == ' ' || text[len - 1] == ' ')) continue;
        cr_assert_eq(krc == PD_OK, crc == PD_OK, "'%s': kernels %d (%s), config %d (%s)", text, krc,
                     kerr.msg, crc, cerr.msg);
        if (krc == PD_OK) {
            char kbuf[16], cbuf[PD_CONFIG_DEVICE_TEXT_CAP];
            pd_device_format(&d, kbuf, sizeof kbuf);
            pd_config_device_text(&cfg, cbuf, sizeof cbuf);
            cr_assert_str_eq(kbuf, cbuf, "'%s'", text);
            cr_assert_eq((int)cfg.model.device, (int)d.kind, "'%s'", text);
            cr_assert_eq(cfg.model.device_index, d.index, "'%s'", text);
        } else {
            const char *kp = strstr(kerr.msg, "is not one of");
            const char *cp = strstr(cerr.msg, "is not one of");
            cr_assert(kp && cp, "'%s': kernels '%s', config '%s'", text, kerr.msg, cerr.msg);
            cr_assert_str_eq(kp, cp, "'%s'", text);
        }
    }
}

/* ------------------------------------------------------------------------
 * pd_backend_create
 * ------------------------------------------------------------------------ */

Test(device, cpu_creates_the_cpu_backend) {
    pd_device d = {.kind = PD_DEVICE_CPU};
    pd_backend *be = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_backend_create(&d, 2, &be, &err), PD_OK, "%s", err.msg);
    cr_assert_not_null(be);
    cr_assert(pd_backend_host_memory(be));
    cr_assert_not_null(pd_backend_name(be));
    /* It is a working backend: one op through it. */
    float x[4] = {1, 2, 3, 4}, y[4] = {10, 20, 30, 40};
    cr_assert_eq(pd_backend_add(be, y, x, 1, 4, 4, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(y[3], 44.0f);
    pd_backend_free(be);
}

Test(device, auto_without_a_gpu_is_the_cpu) {
    if (have_cuda_device()) cr_skip_test("this machine has a CUDA device; auto picks it");
    pd_device d = {.kind = PD_DEVICE_AUTO};
    pd_backend *be = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_backend_create(&d, 1, &be, &err), PD_OK, "%s", err.msg);
    cr_assert_not_null(be);
    cr_assert(pd_backend_host_memory(be), "auto without a GPU must give the CPU backend, got %s", pd_backend_name(be));
    pd_backend_free(be);
}

Test(device, cuda_without_a_gpu_fails_naming_model_device) {
    if (have_cuda_device()) cr_skip_test("this machine has a CUDA device");
    const char *texts[] = {"cuda", "cuda:0", "cuda:3"};
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        pd_device d;
        pd_error err = {0};
        cr_assert_eq(pd_device_parse(texts[i], &d, &err), PD_OK);
        static char sentinel;
        pd_backend *be = (pd_backend *)(void *)&sentinel; /* must be reset to NULL */
        int rc = pd_backend_create(&d, 1, &be, &err);
        cr_assert(rc == PD_ENOTFOUND || rc == PD_EUNSUPPORTED, "%s: rc %d (%s)", texts[i], rc, err.msg);
        cr_assert_eq(err.code, rc);
        cr_assert_null(be);
        cr_assert(contains(err.msg, "model.device"), "%s: %s", texts[i], err.msg);
        if (!pd_cuda_compiled())
            cr_assert(contains(err.msg, "no CUDA backend") && contains(err.msg, "model.device = cpu"), "%s",
                      err.msg);
        else
            cr_assert(contains(err.msg, "found none") && contains(err.msg, "cpu or auto"), "%s", err.msg);
    }
}

Test(device, a_device_index_past_the_last_fails_everywhere) {
    int count = pd_cuda_device_count();
    if (count > 200) cr_skip_test("this machine has over 200 CUDA devices");
    pd_device d = {.kind = PD_DEVICE_CUDA, .index = 200};
    pd_backend *be = NULL;
    pd_error err = {0};
    int rc = pd_backend_create(&d, 1, &be, &err);
    cr_assert(rc == PD_ENOTFOUND || rc == PD_EUNSUPPORTED, "rc %d (%s)", rc, err.msg);
    cr_assert_null(be);
    cr_assert(contains(err.msg, "200") && contains(err.msg, "model.device"), "%s", err.msg);
    if (count > 0) {
        char found[32];
        snprintf(found, sizeof found, "found %d", count);
        cr_assert(contains(err.msg, found), "%s", err.msg);
    }
}

Test(device, out_of_range_structs_are_refused) {
    const pd_device bad[] = {
        {.kind = PD_DEVICE_CUDA, .index = -1},
        {.kind = PD_DEVICE_CUDA, .index = 256},
        {.kind = (pd_device_kind)9, .index = 0},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        pd_backend *be = NULL;
        pd_error err = {0};
        cr_assert_eq(pd_backend_create(&bad[i], 1, &be, &err), PD_EINVAL, "case %zu: %s", i, err.msg);
        cr_assert_null(be);
    }
    char buf[32];
    pd_device_format(&bad[2], buf, sizeof buf);
    cr_assert(strncmp(buf, "cpu", 3) != 0 && strncmp(buf, "cuda", 4) != 0 && strcmp(buf, "auto") != 0, "%s", buf);
}

/* On a GPU host: auto and cuda:0 give a device backend. */
Test(device, with_a_gpu_auto_and_cuda_give_the_device) {
    if (!have_cuda_device()) cr_skip_test("no CUDA device (compiled in: %s)", pd_cuda_compiled() ? "yes" : "no");
    const pd_device devs[] = {{.kind = PD_DEVICE_AUTO}, {.kind = PD_DEVICE_CUDA, .index = 0}};
    for (size_t i = 0; i < 2; i++) {
        pd_backend *be = NULL;
        pd_error err = {0};
        cr_assert_eq(pd_backend_create(&devs[i], 1, &be, &err), PD_OK, "case %zu: %s", i, err.msg);
        cr_assert_not_null(be);
        cr_assert(!pd_backend_host_memory(be), "case %zu: got the %s backend", i, pd_backend_name(be));
        pd_backend_free(be);
    }
}

/* ------------------------------------------------------------------------
 * End to end: prefixd and prefixctl
 * ------------------------------------------------------------------------ */

static char *tmpdir;
static char model_path[1024];

/* A scratch directory with a tiny generated model in it. */
static void setup_model(void) {
    tmpdir = th_mkdtemp();
    cr_assert_not_null(tmpdir);
    pd_testmodel_opts o;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset("tiny", &o, &err), PD_OK, "%s", err.msg);
    snprintf(model_path, sizeof model_path, "%s/tiny.gguf", tmpdir);
    cr_assert_eq(pd_testmodel_write(&o, model_path, NULL, &err), PD_OK, "%s", err.msg);
}

static void teardown_model(void) {
    th_rmtree(tmpdir);
    free(tmpdir);
    tmpdir = NULL;
}

static const char *env_path(const char *name) {
    const char *p = getenv(name);
    cr_assert_not_null(p, "%s is not set (run through meson test)", name);
    return p;
}

Test(device_cli, prefixd_with_a_missing_cuda_device_exits_before_serving, .init = setup_model,
     .fini = teardown_model, .timeout = 60) {
    if (pd_cuda_device_count() > 7) cr_skip_test("this machine has a CUDA device 7");
    char *out = NULL;
    int port = th_free_port();
    int status = th_runf(&out,
                         "'%s' --set model.path='%s' --set cache.path='%s/store' --set cache.map_size_mb=64 "
                         "--set server.port=%d --set model.device=cuda:7 2>&1",
                         env_path("PD_PREFIXD"), model_path, tmpdir, port);
    cr_assert_eq(status, 1, "status %d (want 1, a runtime failure), output:\n%s", status, out ? out : "");
    cr_assert(contains(out, "prefixd: ") && contains(out, "model.device"), "%s", out);
    cr_assert(contains(out, "cuda:7") || contains(out, "device 7"), "%s", out);
    /* The backend is chosen before the port opens or the model loads. */
    cr_assert(!contains(out, "listening on"), "%s", out);
    cr_assert(!contains(out, "serving"), "%s", out);
    free(out);
}

Test(device_cli, prefixd_check_config_reports_the_device_without_opening_it) {
    char *out = NULL;
    int status = th_runf(&out, "'%s' --check-config --set model.device=cuda:7", env_path("PD_PREFIXD"));
    cr_assert_eq(status, 0, "status %d, output:\n%s", status, out ? out : "");
    cr_assert(contains(out, "\ndevice = cuda:7\n"), "%s", out);
    free(out);
}

Test(device_cli, prefixd_logs_the_chosen_backend, .init = setup_model, .fini = teardown_model, .timeout = 120) {
    if (system("curl --version >/dev/null 2>&1") != 0) cr_skip_test("curl is not installed");
    if (have_cuda_device()) cr_skip_test("this machine has a CUDA device: auto would not pick the CPU");
    char args[4096], log[1200];
    snprintf(args, sizeof args,
             "--set model.path=%s --set cache.path=%s/store --set cache.map_size_mb=64 --set model.n_threads=2 "
             "--set model.device=auto",
             model_path, tmpdir);
    snprintf(log, sizeof log, "%s/prefixd.log", tmpdir);
    int port = 0;
    pid_t pid = th_daemon_start(args, log, &port);
    int st = th_daemon_stop(&pid, SIGTERM);
    (void)st;
    char *text = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_read_file(log, &text, NULL, &err), PD_OK, "%s", err.msg);
    char want[64];
    snprintf(want, sizeof want, "prefixd: compute: cpu (%s, 2 threads)", pd_cpu_simd_name());
    cr_assert(contains(text, want), "log lacks '%s':\n%s", want, text);
    free(text);
}

Test(device_cli, prefixctl_generate_with_a_missing_cuda_device_fails_cleanly, .init = setup_model,
     .fini = teardown_model, .timeout = 60) {
    if (pd_cuda_device_count() > 7) cr_skip_test("this machine has a CUDA device 7");
    char *out = NULL;
    int status = th_runf(&out, "'%s' generate --model '%s' --prompt 'hello' -n 4 --device cuda:7 2>&1",
                         env_path("PD_PREFIXCTL"), model_path);
    cr_assert_eq(status, 1, "status %d, output:\n%s", status, out ? out : "");
    cr_assert(contains(out, "prefixctl: --device cuda:7: "), "%s", out);
    cr_assert(contains(out, "model.device"), "%s", out);
    free(out);
    /* A malformed device is a usage error, before the model is read. */
    status = th_runf(&out, "'%s' generate --model /nonexistent.gguf --prompt 'hello' --device gpu 2>&1",
                     env_path("PD_PREFIXCTL"));
    cr_assert_eq(status, 2, "status %d, output:\n%s", status, out ? out : "");
    cr_assert(contains(out, "prefixctl generate: --device: device 'gpu' is not one of cpu, cuda"), "%s", out);
    free(out);
}

Test(device_cli, prefixctl_runs_on_cpu_and_auto, .init = setup_model, .fini = teardown_model, .timeout = 120) {
    char *cpu = NULL, *dflt = NULL;
    const char *ctl = env_path("PD_PREFIXCTL");
    int status = th_runf(&cpu,
                         "'%s' generate --model '%s' --prompt 'hello' -n 8 --ids --threads 1 --device CPU "
                         "2>/dev/null",
                         ctl, model_path);
    cr_assert_eq(status, 0, "status %d, output:\n%s", status, cpu ? cpu : "");
    /* Without --device the tool runs on the CPU, as before the option. */
    status = th_runf(&dflt, "'%s' generate --model '%s' --prompt 'hello' -n 8 --ids --threads 1 2>/dev/null", ctl,
                     model_path);
    cr_assert_eq(status, 0);
    cr_assert_str_eq(cpu, dflt);
    free(dflt);
    if (!have_cuda_device()) {
        char *aut = NULL;
        status = th_runf(&aut,
                         "'%s' generate --model '%s' --prompt 'hello' -n 8 --ids --threads 1 --device auto "
                         "2>/dev/null",
                         ctl, model_path);
        cr_assert_eq(status, 0);
        cr_assert_str_eq(aut, cpu, "auto without a GPU runs on the CPU and agrees with it");
        free(aut);
    }
    free(cpu);
    char *nll = NULL;
    status = th_runf(&nll, "'%s' nll --model '%s' --context 'once upon' --text ' a time' --device cpu 2>&1", ctl,
                     model_path);
    cr_assert_eq(status, 0, "status %d, output:\n%s", status, nll ? nll : "");
    free(nll);
}

/* ------------------------------------------------------------------------
 * On a CUDA device: prefixd with model.device = cuda:0 against a second
 * prefixd with model.device = cpu, same config, on stories260K; and
 * prefix-bench --device cuda:0. They skip without a device (a CPU build,
 * or a GPU-less machine); a cudaemu build (-Dcudaemu=true) runs them on
 * its CPU emulation of the device (slowly: ~90 s under ASan there, hence
 * the long timeouts; seconds on a GPU).
 * ------------------------------------------------------------------------ */

#define GPU_TOKEN "gpu-adm1n"

/* Daemons 0 (cuda:0) and 1 (cpu), each with its own store and log; 2 (cpu)
 * is started later on a copy of daemon 0's store. */
static pid_t pair_pid[3];
static int pair_port[3];
static char *pair_dir;

static void pair_setup(void) {
    pair_dir = th_mkdtemp();
    cr_assert_not_null(pair_dir);
}

static void pair_teardown(void) {
    for (int i = 0; i < 3; i++) th_daemon_stop(&pair_pid[i], SIGKILL);
    th_rmtree(pair_dir);
    free(pair_dir);
    pair_dir = NULL;
}

/* ~490 stories260K tokens: long enough that the default policy
 * (compactor:retention=0.25, 16 sinks + 64 recent protected) chooses about
 * 40 of each head's ~120 kept rows by its scores, so the scoring on the
 * device decides part of the kept set. */
static const char *long_story =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sunshine. One day, she "
    "saw a big tree with a red ball in it. She wanted the ball very much. Lily asked her mom for help. Her mom said, "
    "\\\"Let us get a stick.\\\" They found a long stick near the pond. Lily jumped and tried to reach the ball, but "
    "it was too high. Then a kind boy named Tom came by. Tom was tall and he had a dog named Max. Max barked at the "
    "tree and a bird flew away. Tom took the stick and hit the branch. The red ball fell down and rolled to Lily. "
    "Lily was very happy. She said thank you to Tom and gave Max a hug. They played with the ball all day in the "
    "park. When the sun went down, they went home and ate soup with bread. Lily told her dad about her new friends. "
    "Her dad smiled and said, \\\"Good friends are like treasure.\\\" The next morning, Lily and Tom met again by the "
    "big tree. They built a small house out of sticks and leaves. A little frog hopped inside and sat on a leaf. "
    "Lily laughed and named the frog Hoppy. Every day after that, the three friends played together near the pond.";

static int pair_http(int which, const char *method, const char *path, const char *json, const char *auth,
                     char **out) {
    char body_path[1200];
    snprintf(body_path, sizeof body_path, "%s/body%d.json", pair_dir, which);
    return th_http(pair_port[which], method, path, json, auth, body_path, out);
}

/* A greedy completion on daemon `which`: its text (malloc'd) and the
 * parsed response in *resp (json_decref it). */
static char *greedy_completion(int which, const char *prompt, int max_tokens, json_t **resp) {
    char body[4096], *out = NULL;
    snprintf(body, sizeof body, "{\"model\":\"test\",\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0}", prompt,
             max_tokens);
    cr_assert_eq(pair_http(which, "POST", "/v1/completions", body, NULL, &out), 200, "daemon %d: %s", which, out);
    json_t *j = th_json_parse(out);
    free(out);
    json_t *t = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "text");
    cr_assert(json_is_string(t));
    char *text = strdup(json_string_value(t));
    cr_assert_eq(th_json_int(j, "usage", "completion_tokens"), max_tokens);
    *resp = j;
    return text;
}

static char *read_log(int which) {
    char path[1200], *text = NULL;
    snprintf(path, sizeof path, "%s/prefixd%d.log", pair_dir, which);
    pd_error err = {0};
    cr_assert_eq(pd_read_file(path, &text, NULL, &err), PD_OK, "%s", err.msg);
    return text;
}

Test(device_cli, prefixd_on_cuda_serves_like_prefixd_on_the_cpu, .init = pair_setup, .fini = pair_teardown,
     .timeout = 400) {
    if (!have_cuda_device())
        cr_skip_test("no CUDA device (compiled in: %s): prefixd on cuda:0 not checked",
                     pd_cuda_compiled() ? "yes" : "no");
    if (system("curl --version >/dev/null 2>&1") != 0) cr_skip_test("curl is not installed");
    TH_REQUIRE_SHARED();
    char model[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    const char *devices[2] = {"cuda:0", "cpu"};
    for (int i = 0; i < 2; i++) {
        char args[4096], log[1200];
        snprintf(args, sizeof args,
                 "--set model.path=%s --set cache.path=%s/store%d --set cache.map_size_mb=64 "
                 "--set model.n_threads=2 --set server.model_names=test --set admin.token=" GPU_TOKEN " --set model.device=%s",
                 model, pair_dir, i, devices[i]);
        snprintf(log, sizeof log, "%s/prefixd%d.log", pair_dir, i);
        pair_pid[i] = th_daemon_start(args, log, &pair_port[i]);
    }

    /* The log names the device each computes on. */
    char *log = read_log(0);
    cr_assert(contains(log, "prefixd: compute: cuda:0 ("), "the cuda:0 daemon's log:\n%s", log);
    free(log);
    log = read_log(1);
    cr_assert(contains(log, "prefixd: compute: cpu ("), "the cpu daemon's log:\n%s", log);
    free(log);

    /* A greedy completion without a prefix: the same text. stories260K has
     * f32 weights, which the device multiplies in full f32 (cublasSgemm, no
     * TF32) and the parity suite checks 32 greedy steps of it against the
     * CPU, so a greedy choice has no reason to flip. */
    json_t *rg = NULL, *rc = NULL;
    char *gpu = greedy_completion(0, "Once upon a time", 24, &rg);
    char *cpu = greedy_completion(1, "Once upon a time", 24, &rc);
    cr_assert_str_eq(gpu, cpu, "cuda:0: '%s'\ncpu:    '%s'", gpu, cpu);
    cr_assert(strlen(gpu) > 0);
    json_decref(rg);
    json_decref(rc);

    /* The same greedy completion streamed from the cuda:0 daemon: the same
     * text, in server-sent events ending with [DONE]. */
    char *sse = NULL;
    cr_assert_eq(pair_http(0, "POST", "/v1/completions",
                           "{\"model\":\"test\",\"prompt\":\"Once upon a time\",\"max_tokens\":24,\"temperature\":0,"
                           "\"stream\":true}",
                           NULL, &sse),
                 200, "%s", sse);
    cr_assert(contains(sse, "data: [DONE]"), "%s", sse);
    size_t acc_len = 0;
    char *acc = calloc(strlen(sse) + 1, 1);
    int events = 0;
    for (const char *p = strstr(sse, "data: "); p; p = strstr(p + 1, "data: ")) {
        if (strncmp(p, "data: [DONE]", 12) == 0) break;
        const char *end = strstr(p, "\n\n");
        cr_assert_not_null(end, "%s", sse);
        char *one = strndup(p + 6, (size_t)(end - p - 6));
        json_t *j = th_json_parse(one);
        json_t *t = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "text");
        if (json_is_string(t)) {
            size_t n = strlen(json_string_value(t));
            memcpy(acc + acc_len, json_string_value(t), n);
            acc_len += n;
        }
        json_decref(j);
        free(one);
        events++;
    }
    cr_assert_gt(events, 1, "one event for a 24-token stream: %s", sse);
    cr_assert_str_eq(acc, gpu, "streamed: '%s'\nplain:    '%s'", acc, gpu);
    free(acc);
    free(sse);
    free(gpu);
    free(cpu);

    /* The long story registered through the admin API with the default
     * policy on both. On the cuda:0 daemon the precompression job runs on
     * the device serving resolved to (cmd/prefixd/main.c: jo.device), so its
     * prefill and Compactor scoring run there. */
    char body[4096];
    snprintf(body, sizeof body, "{\"text\":\"%s\",\"wait\":true}", long_story);
    json_t *job[2];
    for (int i = 0; i < 2; i++) {
        char *out = NULL;
        cr_assert_eq(pair_http(i, "POST", "/admin/v1/prefixes", body, GPU_TOKEN, &out), 201, "daemon %d: %s", i,
                     out);
        job[i] = th_json_parse(out);
        free(out);
        cr_assert_str_eq(json_string_value(json_object_get(job[i], "state")), "done");
    }
    json_t *pg = json_object_get(job[0], "prefix"), *pc = json_object_get(job[1], "prefix");
    cr_assert(strncmp(json_string_value(json_object_get(pg, "policy")), "compactor:", 10) == 0, "%s",
              json_string_value(json_object_get(pg, "policy")));
    /* The id hashes the model, tokens, spec and namespace: the same prefix. */
    cr_assert_str_eq(json_string_value(json_object_get(pg, "id")), json_string_value(json_object_get(pc, "id")));
    const json_int_t n_tokens = th_json_int(pg, "tokens", NULL);
    cr_assert_eq(n_tokens, th_json_int(pc, "tokens", NULL));
    cr_assert_gt(n_tokens, 400, "the story should be long enough for the scores to matter");
    /* budget=global fixes each layer's count of kept rows, whatever the
     * scores: the totals agree even if near-ties change sides. */
    cr_assert_eq(th_json_int(pg, "kept_rows", NULL), th_json_int(pc, "kept_rows", NULL));
    json_decref(job[0]);
    json_decref(job[1]);

    /* A third daemon, on the CPU, serves a copy of the cuda:0 daemon's store
     * (mdb_copy: a consistent snapshot while daemon 0 runs), so it continues
     * from the kept rows the device chose and stored. */
    char *copy_out = NULL;
    int st = th_runf(&copy_out, "mkdir -p '%s/store2' && mdb_copy '%s/store0' '%s/store2' 2>&1", pair_dir, pair_dir,
                     pair_dir);
    cr_assert_eq(st, 0, "mdb_copy: %s", copy_out ? copy_out : "");
    free(copy_out);
    {
        char args[4096], log_path[1200];
        snprintf(args, sizeof args,
                 "--set model.path=%s --set cache.path=%s/store2 --set cache.map_size_mb=64 "
                 "--set model.n_threads=2 --set server.model_names=test --set admin.token=" GPU_TOKEN " --set model.device=cpu",
                 model, pair_dir);
        snprintf(log_path, sizeof log_path, "%s/prefixd2.log", pair_dir);
        pair_pid[2] = th_daemon_start(args, log_path, &pair_port[2]);
    }

    /* A completion past the prefix uses it on every daemon. Daemon 2 reads
     * the very rows the device stored, so its greedy text must be the cuda:0
     * daemon's, as without a prefix. Daemon 1 compressed the prefix itself:
     * a near-tie in the scores may keep a different row there (the parity
     * suite allows 5% of a head's kept set), so its text is only logged. */
    char prompt[2048];
    snprintf(prompt, sizeof prompt, "%s Then", long_story);
    char *text[3];
    json_t *resp[3];
    for (int i = 0; i < 3; i++) {
        text[i] = greedy_completion(i, prompt, 16, &resp[i]);
        json_int_t cached =
            th_json_int(json_object_get(json_object_get(resp[i], "usage"), "prompt_tokens_details"), "cached_tokens", NULL);
        cr_assert_eq(cached, n_tokens, "daemon %d: the completion should attend to the stored prefix", i);
        cr_assert(json_is_object(json_object_get(resp[i], "prefix")), "daemon %d: no prefix object", i);
    }
    cr_assert_str_eq(text[0], text[2], "with the device's prefix, cuda:0: '%s'\ncpu:    '%s'", text[0], text[2]);
    cr_log_info("prefix of %lld tokens; greedy continuation on cuda:0 and on the CPU from its store: '%s'; "
                "from the CPU's own compression: '%s'%s",
                (long long)n_tokens, text[0], text[1], strcmp(text[0], text[1]) ? " (differs)" : " (same)");
    for (int i = 0; i < 3; i++) {
        json_decref(resp[i]);
        free(text[i]);
    }

    /* /metrics of the cuda:0 daemon counts the hit. */
    char *out = NULL;
    cr_assert_eq(pair_http(0, "GET", "/metrics", NULL, NULL, &out), 200, "%s", out);
    cr_assert_eq(th_metric(out, "prefixd_prefix_hits_total"), 1, "%s", out);
    free(out);

    /* All stop cleanly on SIGTERM (the device backend freed without error). */
    for (int i = 0; i < 3; i++) {
        st = th_daemon_stop(&pair_pid[i], SIGTERM);
        cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "daemon %d (%s) exit status %d", i, i == 0 ? "cuda:0" : "cpu",
                  st);
    }
}

Test(device_cli, prefix_bench_runs_on_cuda, .init = setup_model, .fini = teardown_model, .timeout = 400) {
    if (!have_cuda_device())
        cr_skip_test("no CUDA device (compiled in: %s): prefix-bench --device cuda:0 not checked",
                     pd_cuda_compiled() ? "yes" : "no");
    /* prefix-bench sits next to prefixctl in the build's tools/. */
    char bench[1200];
    snprintf(bench, sizeof bench, "%s", env_path("PD_PREFIXCTL"));
    char *slash = strrchr(bench, '/');
    cr_assert_not_null(slash);
    snprintf(slash + 1, sizeof bench - (size_t)(slash + 1 - bench), "prefix-bench");
    cr_assert_eq(access(bench, X_OK), 0, "%s is missing", bench);
    char *out = NULL;
    int status = th_runf(&out, "'%s' --model '%s' --device cuda:0 --prompt 32 --prefix 64 --gen 4 --reps 1 2>&1",
                         bench, model_path);
    cr_assert_eq(status, 0, "status %d, output:\n%s", status, out ? out : "");
    cr_assert(contains(out, "prefix-bench: device cuda:0 ("), "%s", out);
    /* The plain prefill/decode row names the device. */
    cr_assert(contains(out, "prefill tok/s") && contains(out, "decode tok/s"), "%s", out);
    cr_assert(contains(out, "\nfile         ") && contains(out, " cuda:0 ("), "%s", out);
    /* The compressed-prefix table, on the device, with its bandwidth bound. */
    cr_assert(contains(out, "compressed prefix: Compactor (default spec) at retention 0.25 on cuda:0 ("), "%s", out);
    cr_assert(contains(out, "\nbound: ") && contains(out, " GB of weights per decode step / ") &&
                  contains(out, " GB/s measured copy bandwidth = "),
              "%s", out);
    cr_assert(contains(out, "dec b1 t/s") && contains(out, "b1/bound"), "%s", out);
    const char *r = strstr(out, "\n     64 ");
    cr_assert_not_null(r, "no row for the 64-token prefix:\n%s", out);
    /* What the default Compactor keeps of 64 tokens at retention 0.25 (its
     * budget rule, pd_policy_budgets), and the bound columns filled in (not "-"). */
    pd_policy_spec spec;
    pd_policy_spec_default(PD_POLICY_COMPACTOR, &spec);
    pd_policy_spec_set_retention(&spec, 0.25);
    int64_t budget;
    pd_policy_budgets(&spec, 1, 64, &budget);
    char want[32];
    snprintf(want, sizeof want, " %.1f%% ", 100.0 * (double)budget / 64.0);
    const char *eol = strchr(r + 1, '\n');
    char *line = strndup(r + 1, eol ? (size_t)(eol - r - 1) : strlen(r + 1));
    cr_assert(contains(line, want), "kept column: want%s in %s", want, line);
    cr_assert(!contains(line, " - "), "%s", line);
    free(line);
    free(out);
    /* --device auto on a machine with a device runs on it, and says cuda:0. */
    status = th_runf(&out, "'%s' --model '%s' --device auto --prompt 16 --gen 2 --reps 1 2>&1", bench, model_path);
    cr_assert_eq(status, 0, "status %d, output:\n%s", status, out ? out : "");
    cr_assert(contains(out, "prefix-bench: device cuda:0 ("), "%s", out);
    free(out);
}

/* ------------------------------------------------------------------------
 * prefix-bench's GPU figures (make bench-gpu, docs/gpu.md "Benchmark") with
 * tiny sizes: on cpu-discrete everywhere (the CPU taking every device path),
 * and on cuda:0 where there is one (cudaemu's emulated device in a cudaemu
 * build). Every section and figure must be there with values that hold
 * together: percentiles in order, enqueue and wait within the step, KV bytes
 * and FLOPs as their formulas give for the model's shape.
 * ------------------------------------------------------------------------ */

#define FIG_PROMPT 12
#define FIG_GEN 3
#define FIG_REPS 2
#define FIG_KEYS0 40
#define FIG_KEYS1 72
#define FIG_CHUNK 16

#define FIG_STR_(x) #x
#define FIG_STR(x) FIG_STR_(x)

static const char *figure_batches[] = {"1", "3"};

/* prefix-bench next to prefixctl in the build's tools/. */
static void bench_path(char *out, size_t cap) {
    snprintf(out, cap, "%s", env_path("PD_PREFIXCTL"));
    char *slash = strrchr(out, '/');
    cr_assert_not_null(slash);
    snprintf(slash + 1, cap - (size_t)(slash + 1 - out), "prefix-bench");
    cr_assert_eq(access(out, X_OK), 0, "%s is missing", out);
}

/* Whether the backend counts launches (pd_backend_counters): one op, and
 * the counter moves or not. */
static bool backend_counts_launches(pd_backend *be) {
    pd_error err = {0};
    float *x = pd_backend_alloc(be, 64 * sizeof(float), &err);
    cr_assert_not_null(x, "%s", err.msg);
    pd_backend_counters c0, c1;
    pd_backend_counters_get(be, &c0);
    cr_assert_eq(pd_backend_scale(be, x, 64, 2.0f, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_backend_sync(be, &err), PD_OK, "%s", err.msg);
    pd_backend_counters_get(be, &c1);
    pd_backend_release(be, x);
    return c1.launches > c0.launches;
}

static double jnum(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    cr_assert(json_is_number(v), "no number '%s' in %s", key, json_dumps(o, 0));
    return json_number_value(v);
}

/* The tables' columns (with_tables: the printing is the same on every
 * backend, so one backend checks it), then every figure in the JSON. */
static void check_gpu_figures(const char *device, bool counts_launches, bool with_tables) {
    char bench[1200];
    bench_path(bench, sizeof bench);
    const char *flags = "--prompt " FIG_STR(FIG_PROMPT) " --gen " FIG_STR(FIG_GEN) " --reps " FIG_STR(FIG_REPS)
                        " --threads 1 --batches 1,3 --attn-keys " FIG_STR(FIG_KEYS0) "," FIG_STR(FIG_KEYS1)
                        " --attn-chunk " FIG_STR(FIG_CHUNK) " --prefix 40 --bw-mib 16";

    /* The readable tables: every figure of each section by its column. */
    char *out = NULL;
    int status;
    if (with_tables) {
        status = th_runf(&out, "'%s' --model '%s' --device %s %s 2>&1", bench, model_path, device, flags);
        cr_assert_eq(status, 0, "status %d, output:\n%s", status, out ? out : "");
        static const char *columns[] = {
            "decode steps on ", "p50 ms", "p99 ms", "max ms", "enqueue ms", "gpu ms", "wait ms", "logits ms",
            "launches", "graphs", "builds", "allocs", "KV MB", "bound t/s", "dec/bound", "\nbound: (",
            " GB of weights + the KV bytes read",
            "\nattention on ", "TFLOP/s", " decode ", " prefill-chunk ", "\ncompressed prefix: ", "comp/pre",
            "full b1 t/s", "comp/full"};
        for (size_t i = 0; i < sizeof columns / sizeof *columns; i++)
            cr_assert(contains(out, columns[i]), "no '%s' in:\n%s", columns[i], out);
        free(out);
    }

    /* The same run as JSON, checked figure by figure. */
    char errlog[1100];
    snprintf(errlog, sizeof errlog, "%s/bench-err.log", tmpdir);
    status = th_runf(&out, "'%s' --model '%s' --device %s %s --json 2>'%s'", bench, model_path, device, flags, errlog);
    cr_assert_eq(status, 0, "status %d, output:\n%s", status, out ? out : "");
    json_t *doc = th_json_parse(out);
    cr_assert_not_null(doc, "not JSON:\n%s", out);

    pd_model *m = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_model_load(model_path, NULL, &m, &err), PD_OK, "%s", err.msg);
    const pd_hparams hp = *pd_model_hparams(m);
    pd_model_free(m);

    json_t *steps = json_object_get(doc, "decode_steps");
    cr_assert(json_is_object(steps), "%s", out);
    cr_assert_gt(jnum(steps, "weight_bytes"), 0);
    cr_assert_gt(jnum(steps, "bandwidth_bytes_per_s"), 0);
    json_t *rows = json_object_get(steps, "results");
    cr_assert_eq(json_array_size(rows), 2, "%s", out);
    for (size_t i = 0; i < 2; i++) {
        json_t *r = json_array_get(rows, i);
        const double batch = jnum(r, "batch");
        cr_assert_eq(batch, atof(figure_batches[i]));
        cr_assert_eq(jnum(r, "steps"), FIG_GEN * FIG_REPS);
        const double p50 = jnum(r, "step_p50_ms"), p99 = jnum(r, "step_p99_ms"), mx = jnum(r, "step_max_ms");
        cr_assert(p50 > 0 && p50 <= p99 && p99 <= mx, "p50 %g p99 %g max %g", p50, p99, mx);
        cr_assert_gt(jnum(r, "tps"), 0);
        /* Each step's enqueue and wait lie within its wall time, so their
         * medians lie within the wall time's. */
        const double enq = jnum(r, "enqueue_p50_ms"), wait = jnum(r, "wait_p50_ms");
        cr_assert(enq > 0 && enq <= p50, "enqueue %g, step p50 %g", enq, p50);
        cr_assert(wait >= 0 && wait <= p50, "wait %g, step p50 %g", wait, p50);
        cr_assert_gt(jnum(r, "device_p50_ms"), 0);
        cr_assert_gt(jnum(r, "nologits_p50_ms"), 0);
        cr_assert(isfinite(jnum(r, "logits_ms")));
        /* KV read per step: every held row (prompt, warm-up, the earlier
         * steps with and without logits, its own) of every layer and kv
         * head, K and V, in f16; the mean over steps 0..gen-1. */
        const double rows_mean = FIG_PROMPT + FIG_GEN + 1.0;
        const double kv = batch * rows_mean * hp.n_layer * hp.n_head_kv * hp.head_dim * 2 * 2;
        cr_assert(fabs(jnum(r, "kv_bytes_per_step") - kv) <= 1e-6 * kv, "kv %g, want %g", jnum(r, "kv_bytes_per_step"),
                  kv);
        const double bound = batch * jnum(steps, "bandwidth_bytes_per_s") / (jnum(steps, "weight_bytes") + kv);
        cr_assert(fabs(jnum(r, "bound_tps") - bound) <= 1e-3 * bound, "bound %g, want %g", jnum(r, "bound_tps"), bound);
        cr_assert(fabs(jnum(r, "decode_over_bound") - jnum(r, "tps") / bound) <= 1e-3 * jnum(r, "tps") / bound + 1e-4);
        /* Launches per step follow the backend's counters; a decode step
         * allocates nothing from the driver once warm. */
        if (counts_launches)
            cr_assert_gt(jnum(r, "launches_per_step"), 0);
        else
            cr_assert_eq(jnum(r, "launches_per_step"), 0);
        cr_assert(jnum(r, "syncs_per_step") >= 0 && jnum(r, "device_allocs_per_step") >= 0);
        /* On CUDA every timed step (one token per sequence, with logits)
         * is one graph; the kept graphs are rebuilt only when a step's
         * shape changes. No graphs elsewhere. */
        const double graphs = jnum(r, "graph_launches_per_step"), builds = jnum(r, "graph_builds_per_step");
        if (strncmp(device, "cuda", 4) == 0)
            cr_assert_eq(graphs, 1.0, "batch %g: %g graph launches per step", batch, graphs);
        else
            cr_assert_eq(graphs, 0.0);
        cr_assert(builds >= 0 && builds <= graphs, "builds %g, graphs %g", builds, graphs);
    }

    json_t *attn = json_object_get(doc, "attention");
    cr_assert(json_is_object(attn), "%s", out);
    rows = json_object_get(attn, "results");
    cr_assert_eq(json_array_size(rows), 2 * 3, "%s", out); /* per key count: batch 1, batch 3, a prefill chunk */
    const double per_key = 4.0 * hp.n_head * hp.head_dim;
    for (size_t i = 0; i < json_array_size(rows); i++) {
        json_t *r = json_array_get(rows, i);
        const double keys = i < 3 ? FIG_KEYS0 : FIG_KEYS1;
        cr_assert_eq(jnum(r, "keys"), keys);
        const char *kind = json_string_value(json_object_get(r, "kind"));
        cr_assert_not_null(kind);
        double flops;
        if (i % 3 < 2) { /* decode: every query sees every key */
            cr_assert_str_eq(kind, "decode");
            cr_assert_eq(jnum(r, "queries"), atof(figure_batches[i % 3]));
            flops = per_key * keys * jnum(r, "queries");
        } else { /* the chunk's query j sees keys - chunk + j + 1 keys */
            cr_assert_str_eq(kind, "prefill-chunk");
            cr_assert_eq(jnum(r, "queries"), FIG_CHUNK);
            flops = 0;
            for (int j = 0; j < FIG_CHUNK; j++) flops += per_key * (keys - FIG_CHUNK + j + 1);
        }
        cr_assert(fabs(jnum(r, "flops") - flops) <= 1e-5 * flops, "flops %g, want %g", jnum(r, "flops"), flops);
        cr_assert_gt(jnum(r, "ms"), 0);
        cr_assert_gt(jnum(r, "tflops"), 0);
    }

    json_t *pb = json_object_get(doc, "prefix_bench");
    cr_assert(json_is_object(pb), "%s", out);
    json_t *p0 = json_array_get(json_object_get(pb, "results"), 0);
    cr_assert_not_null(p0, "%s", out);
    cr_assert_gt(jnum(p0, "compress_over_prefill"), 0);
    cr_assert_gt(jnum(p0, "full_decode_b1_tps"), 0);
    cr_assert_gt(jnum(p0, "compressed_over_full"), 0);
    json_decref(doc);
    free(out);
}

Test(device_cli, prefix_bench_prints_every_gpu_figure_on_cpu_discrete, .init = setup_model, .fini = teardown_model,
     .timeout = 300) {
    pd_backend *be = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_backend_cpu_discrete_create(1, &be, &err), PD_OK, "%s", err.msg);
    const bool counts = backend_counts_launches(be);
    pd_backend_free(be);
    check_gpu_figures("cpu-discrete", counts, true);
}

Test(device_cli, prefix_bench_prints_every_gpu_figure_on_cuda, .init = setup_model, .fini = teardown_model,
     .timeout = 600) {
    if (!have_cuda_device())
        cr_skip_test("no CUDA device (compiled in: %s): prefix-bench's figures on cuda:0 not checked",
                     pd_cuda_compiled() ? "yes" : "no");
    pd_backend *be = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_backend_cuda_create(0, &be, &err), PD_OK, "%s", err.msg);
    const bool counts = backend_counts_launches(be);
    pd_backend_free(be);
    check_gpu_figures("cuda:0", counts, false);
}

/* pd_backend_timer on a host backend: enqueue ends at the first wait
 * (sync or download), the device time is the wall time, and a stretch
 * without a wait is all enqueue. The sleeps give lower bounds only. */
Test(device, backend_timer_splits_enqueue_at_the_first_wait) {
    pd_backend *be = NULL;
    pd_backend_timer *tm = NULL, *fresh = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_backend_cpu_discrete_create(1, &be, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_backend_timer_create(be, &tm, &err), PD_OK, "%s", err.msg);
    pd_backend_timing t;
    cr_assert_eq(pd_backend_timer_start(tm, &err), PD_OK, "%s", err.msg);
    usleep(20000);
    cr_assert_eq(pd_backend_sync(be, &err), PD_OK, "%s", err.msg);
    usleep(20000);
    cr_assert_eq(pd_backend_timer_stop(tm, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_backend_timer_read(tm, &t, &err), PD_OK, "%s", err.msg);
    cr_assert(t.enqueue_s >= 0.02 && t.wall_s >= 0.04, "enqueue %g wall %g", t.enqueue_s, t.wall_s);
    cr_assert(t.enqueue_s <= t.wall_s - 0.02, "enqueue %g must end at the sync, wall %g", t.enqueue_s, t.wall_s);
    cr_assert(t.wait_s >= 0 && t.wait_s <= t.wall_s - 0.04, "wait %g wall %g", t.wait_s, t.wall_s);
    cr_assert_eq(t.device_s, t.wall_s);

    /* No wait in the stretch: all of it is enqueue. */
    cr_assert_eq(pd_backend_timer_start(tm, &err), PD_OK, "%s", err.msg);
    usleep(5000);
    cr_assert_eq(pd_backend_timer_stop(tm, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_backend_timer_read(tm, &t, &err), PD_OK, "%s", err.msg);
    cr_assert(t.wall_s >= 0.005 && t.enqueue_s == t.wall_s && t.wait_s == 0, "enqueue %g wall %g wait %g",
              t.enqueue_s, t.wall_s, t.wait_s);

    /* Read or stop before a start: an error, not garbage. */
    cr_assert_eq(pd_backend_timer_create(be, &fresh, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_backend_timer_read(fresh, &t, &err), PD_EINVAL);
    cr_assert_eq(pd_backend_timer_stop(fresh, &err), PD_EINVAL);
    pd_backend_timer_free(fresh);
    pd_backend_timer_free(tm);
    pd_backend_free(be);
}
