/* config/: defaults, INI parsing, typed errors with file:line, --set,
 * cross-field validation, print -> parse round trips, the sample config and
 * docs staying in step with the key table, and `prefixd --check-config`. */
#include <criterion/criterion.h>
#include <ini.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "config/config.h"
#include "helpers.h"
#include "util/util.h"

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

static char *scratch_dir;

static void setup_dir(void) {
    scratch_dir = th_mkdtemp();
    cr_assert_not_null(scratch_dir, "mkdtemp failed");
}

static void teardown_dir(void) {
    th_rmtree(scratch_dir);
    free(scratch_dir);
    scratch_dir = NULL;
}

/* Write `len` bytes to scratch_dir/name; returns a malloc'd path. */
static char *write_bytes(const char *name, const char *data, size_t len) {
    char *path = NULL;
    cr_assert(asprintf(&path, "%s/%s", scratch_dir, name) > 0);
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot create %s", path);
    cr_assert_eq(fwrite(data, 1, len, f), len);
    cr_assert_eq(fclose(f), 0);
    return path;
}

static char *write_conf(const char *name, const char *text) {
    return write_bytes(name, text, strlen(text));
}

static bool contains(const char *haystack, const char *needle) {
    return haystack && strstr(haystack, needle) != NULL;
}

/* Load `text` from scratch_dir/bad.conf and expect failure with a message
 * containing every needle (NULL-terminated). The config must not change. */
static void expect_file_error(const char *text, ...) {
    char *path = write_conf("bad.conf", text);
    pd_config cfg, before;
    pd_config_defaults(&cfg);
    before = cfg;
    pd_error err = {0};
    int rc = pd_config_load_file(&cfg, path, &err);
    cr_assert_neq(rc, PD_OK, "expected an error for:\n%s", text);
    cr_assert_eq(err.code, rc);
    va_list ap;
    va_start(ap, text);
    for (const char *needle; (needle = va_arg(ap, const char *));)
        cr_assert(contains(err.msg, needle), "message '%s' lacks '%s'", err.msg, needle);
    va_end(ap);
    cr_assert(pd_config_equal(&cfg, &before), "a failed load changed the config");
    free(path);
}

/* Apply one --set to the defaults and expect failure naming every needle. */
static void expect_set_error(const char *assignment, ...) {
    pd_config cfg, before;
    pd_config_defaults(&cfg);
    before = cfg;
    pd_error err = {0};
    int rc = pd_config_set(&cfg, assignment, &err);
    cr_assert_neq(rc, PD_OK, "expected --set %s to fail", assignment);
    cr_assert(contains(err.msg, "--set"), "message '%s' does not name --set", err.msg);
    va_list ap;
    va_start(ap, assignment);
    for (const char *needle; (needle = va_arg(ap, const char *));)
        cr_assert(contains(err.msg, needle), "message '%s' lacks '%s'", err.msg, needle);
    va_end(ap);
    cr_assert(pd_config_equal(&cfg, &before), "a failed --set changed the config");
}

static void set_ok(pd_config *cfg, const char *assignment) {
    pd_error err = {0};
    cr_assert_eq(pd_config_set(cfg, assignment, &err), PD_OK, "--set %s: %s", assignment,
                 err.msg);
}

/* pd_config_print() into a malloc'd string. */
static char *print_to_string(const pd_config *cfg) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    cr_assert_not_null(f);
    pd_error err = {0};
    cr_assert_eq(pd_config_print(cfg, f, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(fclose(f), 0);
    return text;
}

static void assert_round_trip(const pd_config *cfg) {
    char *text = print_to_string(cfg);
    pd_config back;
    pd_config_defaults(&back);
    pd_error err = {0};
    cr_assert_eq(pd_config_load_string(&back, text, "printed", &err), PD_OK, "%s\n%s", err.msg,
                 text);
    cr_assert(pd_config_equal(&back, cfg), "printed config reads back different:\n%s", text);
    char *again = print_to_string(&back);
    cr_assert_str_eq(again, text);
    free(again);
    free(text);
}

/* ------------------------------------------------------------------------
 * Defaults
 * ------------------------------------------------------------------------ */

Test(config, defaults_validate_and_match_docs) {
    pd_config cfg;
    pd_config_defaults(&cfg);
    pd_error err = {0};
    cr_assert_eq(pd_config_validate(&cfg, &err), PD_OK, "%s", err.msg);
    cr_assert_str_eq(cfg.server.listen, "127.0.0.1");
    cr_assert_eq(cfg.server.port, 8080);
    cr_assert_eq(cfg.server.threads, 0);
    cr_assert_str_eq(cfg.server.api_key, "");
    cr_assert(cfg.server.metrics);
    cr_assert_str_eq(cfg.admin.token, "");
    cr_assert_eq(cfg.admin.port, 0);
    cr_assert_str_eq(cfg.model.path, "models/default.gguf");
    cr_assert_eq(cfg.model.device, PD_BACKEND_AUTO);
    cr_assert_eq(cfg.model.device_index, 0);
    cr_assert_str_eq(cfg.cache.path, "var/prefixd");
    cr_assert_eq(cfg.cache.map_size_mb, 4096);
    cr_assert_eq(cfg.cache.hot_tier_mb, 256);
    cr_assert_eq(cfg.cache.auto_mb, 256);
    cr_assert(!cfg.cache.auto_persist);
    cr_assert_eq(cfg.cache.page_tokens, 64);
    cr_assert_str_eq(cfg.compression.policy, "compactor:retention=0.25");
    cr_assert_eq(cfg.compression.min_prefix_tokens, 256);
    cr_assert_eq(cfg.compression.quality_budget, 0.0);
    cr_assert_eq(cfg.scheduler.max_batch, 16);
    cr_assert_eq(cfg.scheduler.max_queue, 256);
    cr_assert_str_eq(cfg.cluster.redis_url, "");
    cr_assert_eq(cfg.cluster.role, PD_CLUSTER_ROLE_MEMBER);
    cr_assert_str_eq(cfg.cluster.key_prefix, "prefixd:");
    cr_assert_eq(cfg.cluster.timeout_ms, 250);
    cr_assert_eq(cfg.cluster.chunk_mb, 64);
    cr_assert_eq(cfg.log.level, PD_LOG_INFO);
    cr_assert_eq(cfg.log.format, PD_LOG_TEXT);
    cr_assert_str_eq(pd_backend_kind_name(cfg.model.device), "auto");
    char device[PD_CONFIG_DEVICE_TEXT_CAP];
    pd_config_device_text(&cfg, device, sizeof device);
    cr_assert_str_eq(device, "auto");
    cr_assert_str_eq(pd_log_level_name(cfg.log.level), "info");
    cr_assert_str_eq(pd_log_format_name(cfg.log.format), "text");
}

/* ------------------------------------------------------------------------
 * File parsing
 * ------------------------------------------------------------------------ */

Test(config, file_sets_keys_and_keeps_the_rest, .init = setup_dir, .fini = teardown_dir) {
    char *path = write_conf("ok.conf",
                            "# full-line comment\n"
                            "; another comment\n"
                            "[server]\n"
                            "listen = 0.0.0.0\n"
                            "port = 9000 ; inline comment\n"
                            "api_key = sk-abc123\n"
                            "metrics = off\n"
                            "\n"
                            "[model]\n"
                            "device = CUDA:1\n"
                            "n_ctx: 8192\n" /* inih's ':' separator */
                            "\n"
                            "[compression]\n"
                            "policy = snapkv:retention=0.5,window=32\n"
                            "quality_budget = 1.05\n"
                            "[log]\n"
                            "level = debug\n"
                            "format = json\n");
    pd_config cfg;
    pd_config_defaults(&cfg);
    pd_error err = {0};
    cr_assert_eq(pd_config_load_file(&cfg, path, &err), PD_OK, "%s", err.msg);
    cr_assert_str_eq(cfg.server.listen, "0.0.0.0");
    cr_assert_eq(cfg.server.port, 9000);
    cr_assert_str_eq(cfg.server.api_key, "sk-abc123");
    cr_assert(!cfg.server.metrics);
    cr_assert_eq(cfg.model.device, PD_BACKEND_CUDA);
    cr_assert_eq(cfg.model.device_index, 1);
    cr_assert_eq(cfg.model.n_ctx, 8192);
    cr_assert_str_eq(cfg.compression.policy, "snapkv:retention=0.5,window=32");
    cr_assert_eq(cfg.compression.quality_budget, 1.05);
    cr_assert_eq(cfg.log.level, PD_LOG_DEBUG);
    cr_assert_eq(cfg.log.format, PD_LOG_JSON);
    /* Keys the file does not mention keep their defaults. */
    cr_assert_eq(cfg.scheduler.max_batch, 16);
    cr_assert_str_eq(cfg.cache.path, "var/prefixd");
    cr_assert_eq(pd_config_validate(&cfg, &err), PD_OK, "%s", err.msg);
    free(path);
}

Test(config, crlf_and_utf8_bom_are_accepted, .init = setup_dir, .fini = teardown_dir) {
    char *path = write_conf("crlf.conf", "\xEF\xBB\xBF[server]\r\nport = 1234\r\n"
                                         "[cache]\r\npath = /var/lib/prefixd\r\n");
    pd_config cfg;
    pd_config_defaults(&cfg);
    pd_error err = {0};
    cr_assert_eq(pd_config_load_file(&cfg, path, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(cfg.server.port, 1234);
    cr_assert_str_eq(cfg.cache.path, "/var/lib/prefixd");
    free(path);
}

Test(config, load_string_names_its_origin) {
    pd_config cfg;
    pd_config_defaults(&cfg);
    pd_error err = {0};
    cr_assert_eq(pd_config_load_string(&cfg, "[scheduler]\nmax_batch = 4\n", "inline", &err),
                 PD_OK, "%s", err.msg);
    cr_assert_eq(cfg.scheduler.max_batch, 4);
    cr_assert_neq(pd_config_load_string(&cfg, "[scheduler]\n\nmax_batch = 0\n", "inline", &err),
                  PD_OK);
    cr_assert(contains(err.msg, "inline:3: scheduler.max_batch = 0 is out of range (1..1024)"),
              "%s", err.msg);
}

Test(config, empty_values_clear_strings) {
    pd_config cfg;
    pd_config_defaults(&cfg);
    pd_error err = {0};
    cr_assert_eq(pd_config_load_string(&cfg, "[server]\napi_key = k1\n", NULL, &err), PD_OK);
    cr_assert_eq(pd_config_load_string(&cfg, "[server]\napi_key =\n", NULL, &err), PD_OK,
                 "%s", err.msg);
    cr_assert_str_eq(cfg.server.api_key, "");
}

/* ------------------------------------------------------------------------
 * File errors: every class names the key (where there is one) and file:line
 * ------------------------------------------------------------------------ */

Test(config_errors, out_of_range_integer, .init = setup_dir, .fini = teardown_dir) {
    expect_file_error("[server]\nlisten = ::1\n\nport = 70000\n",
                      "bad.conf:4: server.port = 70000 is out of range (1..65535)", NULL);
    expect_file_error("[server]\nport = -1\n", "bad.conf:2:", "server.port", "out of range",
                      NULL);
    expect_file_error("[cache]\nmap_size_mb = 8\n", "bad.conf:2:", "cache.map_size_mb",
                      "(16..16777216)", NULL);
}

Test(config_errors, integer_overflow, .init = setup_dir, .fini = teardown_dir) {
    expect_file_error("[server]\nmax_body_bytes = 99999999999999999999999\n", "bad.conf:2:",
                      "server.max_body_bytes", "out of range", NULL);
    expect_file_error("[server]\nport = 4294975376\n", /* 2^32 + 8080 must not wrap */
                      "bad.conf:2:", "server.port", "out of range", NULL);
}

Test(config_errors, not_an_integer, .init = setup_dir, .fini = teardown_dir) {
    const char *bad[] = {"80x", "0x50", "8 0", "1e3", "", "eighty", "80.0"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char text[64];
        snprintf(text, sizeof text, "[server]\nport = %s\n", bad[i]);
        expect_file_error(text, "bad.conf:2:", "server.port", "is not an integer", NULL);
    }
}

Test(config_errors, bad_boolean, .init = setup_dir, .fini = teardown_dir) {
    expect_file_error("[server]\nmetrics = maybe\n",
                      "bad.conf:2: server.metrics = maybe is not a boolean", NULL);
    expect_file_error("[server]\nmetrics = 2\n", "bad.conf:2:", "server.metrics", NULL);
}

Test(config_errors, bad_enum_lists_choices, .init = setup_dir, .fini = teardown_dir) {
    expect_file_error("[log]\nlevel = verbose\n", "bad.conf:2:", "log.level",
                      "error, warn, info, debug", NULL);
    expect_file_error("[log]\nformat = xml\n", "bad.conf:2:", "log.format", "text, json", NULL);
    expect_file_error("[model]\nkv_type = bf16\n", "bad.conf:2:", "model.kv_type = bf16", "f16, f32", NULL);
}

/* model.kv_type: f16 by default, f32 on request (any letter case). */
Test(config_errors, kv_type_parses_and_defaults_to_f16) {
    pd_config cfg;
    pd_config_defaults(&cfg);
    cr_assert_eq(cfg.model.kv_type, PD_KV_CACHE_F16);
    cr_assert_str_eq(pd_kv_cache_type_name(cfg.model.kv_type), "f16");
    set_ok(&cfg, "model.kv_type=F32");
    cr_assert_eq(cfg.model.kv_type, PD_KV_CACHE_F32);
    cr_assert_str_eq(pd_kv_cache_type_name(cfg.model.kv_type), "f32");
    pd_error err = {0};
    cr_assert_neq(pd_config_set(&cfg, "model.kv_type=q8_0", &err), PD_OK);
    cr_assert(contains(err.msg, "--set") && contains(err.msg, "model.kv_type") && contains(err.msg, "f16, f32"), "%s",
              err.msg);
    cr_assert_eq(cfg.model.kv_type, PD_KV_CACHE_F32, "a refused value changes nothing");
}

Test(config_errors, bad_double, .init = setup_dir, .fini = teardown_dir) {
    expect_file_error("[compression]\nquality_budget = 1\n", "bad.conf:2:", "compression.quality_budget",
                      "out of range", NULL);
    expect_file_error("[compression]\nquality_budget = 1.05x\n", "bad.conf:2:",
                      "compression.quality_budget", "is not a number", NULL);
    expect_file_error("[compression]\nquality_budget = nan\n", "bad.conf:2:",
                      "compression.quality_budget", "is not a number", NULL);
    expect_file_error("[compression]\nquality_budget = 0.5\n", "bad.conf:2:",
                      "compression.quality_budget", "out of range", NULL);
    expect_file_error("[compression]\nquality_budget = 1e999\n", "bad.conf:2:",
                      "compression.quality_budget", "out of range", NULL);
}

Test(config_errors, unknown_key_lists_valid_keys, .init = setup_dir, .fini = teardown_dir) {
    expect_file_error("[server]\nport = 8080\nprot = 80\n",
                      "bad.conf:3: unknown key server.prot", "listen, port, threads", NULL);
}

Test(config_errors, unknown_section_lists_valid_sections, .init = setup_dir,
     .fini = teardown_dir) {
    expect_file_error("[server]\nport = 8080\n[srever]\nport = 1\n",
                      "bad.conf:3: unknown section [srever]",
                      "server, admin, model, cache, compression, scheduler, cluster, log", NULL);
    /* inih never calls back for an empty section; it must still be caught. */
    expect_file_error("[server]\nport = 8080\n\n[caches]\n", "bad.conf:4:",
                      "unknown section [caches]", NULL);
}

Test(config_errors, key_outside_a_section, .init = setup_dir, .fini = teardown_dir) {
    expect_file_error("port = 8080\n[server]\n", "bad.conf:1:", "port",
                      "not inside a section", NULL);
}

Test(config_errors, duplicate_key, .init = setup_dir, .fini = teardown_dir) {
    expect_file_error("[server]\nport = 1\n[model]\npath = m.gguf\n[server]\nport = 2\n",
                      "bad.conf:6: server.port is set twice (first on line 2)", NULL);
}

Test(config_errors, syntax_errors, .init = setup_dir, .fini = teardown_dir) {
    expect_file_error("[server]\nport = 1\nport 8080\n", "bad.conf:3:", "expected 'key = value'",
                      NULL);
    expect_file_error("[server\nport = 1\n", "bad.conf:1:", "no closing ']'", NULL);
    /* A syntax error before a bad value is the one reported. */
    expect_file_error("[server]\noops\nport = 0\n", "bad.conf:2:", "expected", NULL);
}

Test(config_errors, indented_continuation, .init = setup_dir, .fini = teardown_dir) {
    expect_file_error("[server]\n  listen = ::1\n  port = 80\n", "bad.conf:3:", "server.listen",
                      "indent", NULL);
}

Test(config_errors, overlong_line, .init = setup_dir, .fini = teardown_dir) {
    char text[400];
    int n = snprintf(text, sizeof text, "[model]\npath = ");
    memset(text + n, 'a', 250);
    strcpy(text + n + 250, "\nn_ctx = 1\n");
    expect_file_error(text, "bad.conf:2:", "the limit is 197", NULL);
}

Test(config_errors, string_rules, .init = setup_dir, .fini = teardown_dir) {
    expect_file_error("[server]\nlisten = local host\n", "bad.conf:2:", "server.listen",
                      "not an IP address or host name", NULL);
    expect_file_error("[server]\nlisten = 256.1.1.1\n", "bad.conf:2:", "server.listen", NULL);
    expect_file_error("[admin]\nlisten = [::1]\n", "bad.conf:2:", "admin.listen", NULL);
    expect_file_error("[model]\npath =\n", "bad.conf:2:", "model.path", "must not be empty",
                      NULL);
    expect_file_error("[cache]\npath =\n", "bad.conf:2:", "cache.path", "must not be empty",
                      NULL);
    expect_file_error("[compression]\npolicy = compactor:retention\n", "bad.conf:2:",
                      "compression.policy", "not a policy spec", NULL);
    expect_file_error("[compression]\npolicy = compactor;x\n", "bad.conf:2:",
                      "compression.policy", NULL);
    expect_file_error("[server]\ncors_origins = https://app.example/\n", "bad.conf:2:",
                      "server.cors_origins", "without a trailing slash", NULL);
    expect_file_error("[server]\ncors_origins = app.example\n", "bad.conf:2:", "server.cors_origins",
                      "scheme://host[:port]", NULL);
    expect_file_error("[server]\ncors_origins = https://a.example,,*\n", "bad.conf:2:",
                      "server.cors_origins", "empty origin", NULL);
    expect_file_error("[server]\ncors_origins = https://a.example, https://b.example\n", "bad.conf:2:",
                      "server.cors_origins", "without spaces", NULL);
}

Test(config, cors_origins_accepts_a_star_or_origins) {
    const char *ok[] = {"*", "https://app.example", "http://localhost:3000,https://app.example:8443",
                        "chrome-extension://abcdef,*", ""};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        pd_config cfg;
        pd_config_defaults(&cfg);
        char set[256];
        snprintf(set, sizeof set, "server.cors_origins=%s", ok[i]);
        set_ok(&cfg, set);
        cr_expect_str_eq(cfg.server.cors_origins, ok[i]);
    }
}

Test(config_errors, secrets_are_never_echoed, .init = setup_dir, .fini = teardown_dir) {
    char *path = write_conf("bad.conf", "[server]\napi_key = hunter2 hunter3\n");
    pd_config cfg;
    pd_config_defaults(&cfg);
    pd_error err = {0};
    cr_assert_neq(pd_config_load_file(&cfg, path, &err), PD_OK);
    cr_assert(contains(err.msg, "bad.conf:2: server.api_key = (hidden)"), "%s", err.msg);
    cr_assert(!contains(err.msg, "hunter"), "secret leaked: %s", err.msg);
    free(path);
}

Test(config_errors, nul_byte, .init = setup_dir, .fini = teardown_dir) {
    static const char data[] = "[server]\nport = 80\0\n";
    char *path = write_bytes("nul.conf", data, sizeof data - 1);
    pd_config cfg;
    pd_config_defaults(&cfg);
    pd_error err = {0};
    cr_assert_neq(pd_config_load_file(&cfg, path, &err), PD_OK);
    cr_assert(contains(err.msg, "nul.conf:2:") && contains(err.msg, "NUL"), "%s", err.msg);
    free(path);
}

Test(config_errors, unreadable_files, .init = setup_dir, .fini = teardown_dir) {
    pd_config cfg;
    pd_config_defaults(&cfg);
    pd_error err = {0};
    char missing[600];
    snprintf(missing, sizeof missing, "%s/missing.conf", scratch_dir);
    cr_assert_eq(pd_config_load_file(&cfg, missing, &err), PD_EIO);
    cr_assert(contains(err.msg, missing), "%s", err.msg);
    cr_assert_eq(pd_config_load_file(&cfg, scratch_dir, &err), PD_EINVAL);
    cr_assert(contains(err.msg, "not a regular file"), "%s", err.msg);
}

Test(config_errors, first_error_wins_and_nothing_is_applied, .init = setup_dir,
     .fini = teardown_dir) {
    /* Line 2 is fine and line 3 is bad: the whole load fails, port keeps 8080. */
    expect_file_error("[server]\nport = 9001\nthreads = -5\nport = x\n", "bad.conf:3:",
                      "server.threads", NULL);
}

/* ------------------------------------------------------------------------
 * model.device: one key for where the model computes (it replaced
 * model.backend and model.gpu_device)
 * ------------------------------------------------------------------------ */

/* Load "[model]\ndevice = <text>" and check what it became and how it prints. */
static void expect_device(const char *text, pd_backend_kind kind, int index, const char *printed) {
    pd_config cfg;
    pd_config_defaults(&cfg);
    char conf[128];
    snprintf(conf, sizeof conf, "[model]\ndevice = %s\n", text);
    pd_error err = {0};
    cr_assert_eq(pd_config_load_string(&cfg, conf, "dev", &err), PD_OK, "%s: %s", text, err.msg);
    cr_assert_eq(cfg.model.device, kind, "%s", text);
    cr_assert_eq(cfg.model.device_index, index, "%s", text);
    char shown[PD_CONFIG_DEVICE_TEXT_CAP];
    pd_config_device_text(&cfg, shown, sizeof shown);
    cr_assert_str_eq(shown, printed, "%s", text);
    char *out = print_to_string(&cfg);
    char line[64];
    snprintf(line, sizeof line, "\ndevice = %s\n", printed);
    cr_assert(contains(out, line), "%s:\n%s", text, out);
    free(out);
    assert_round_trip(&cfg);
}

Test(config_device, accepted_forms_and_canonical_text) {
    expect_device("cpu", PD_BACKEND_CPU, 0, "cpu");
    expect_device("CPU", PD_BACKEND_CPU, 0, "cpu");
    expect_device("auto", PD_BACKEND_AUTO, 0, "auto");
    expect_device("Auto", PD_BACKEND_AUTO, 0, "auto");
    expect_device("cuda", PD_BACKEND_CUDA, 0, "cuda:0");
    expect_device("cuda:0", PD_BACKEND_CUDA, 0, "cuda:0");
    expect_device("CUDA:3", PD_BACKEND_CUDA, 3, "cuda:3");
    expect_device("cuda:255", PD_BACKEND_CUDA, 255, "cuda:255");
}

Test(config_device, bad_values_list_the_forms, .init = setup_dir, .fini = teardown_dir) {
    expect_file_error("[model]\ndevice = gpu\n",
                      "bad.conf:2: model.device = gpu is not one of cpu, cuda, cuda:N (N = 0..255) or "
                      "auto",
                      NULL);
    const char *bad[] = {"cuda:256", "cuda:-1", "cuda:", "cuda:1x", "cuda:+1", "cuda:0x1",
                         "cuda:1000", "cuda0", "cuda:1:2", "cpu:0", "auto:1", "metal", "rocm:0"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char text[64];
        snprintf(text, sizeof text, "[model]\ndevice = %s\n", bad[i]);
        expect_file_error(text, "bad.conf:2:", "model.device", "is not one of", "cuda:N", NULL);
    }
    expect_file_error("[model]\ndevice =\n", "bad.conf:2:", "model.device", "is not one of", NULL);
    expect_set_error("model.device=cuda:999", "--set: model.device = cuda:999 is not one of", NULL);
    expect_set_error("model.device=cuda: 1", "model.device", "is not one of", NULL);
}

Test(config_device, set_overrides_and_last_wins) {
    pd_config cfg;
    pd_config_defaults(&cfg);
    set_ok(&cfg, "model.device=cuda:2");
    cr_assert_eq(cfg.model.device, PD_BACKEND_CUDA);
    cr_assert_eq(cfg.model.device_index, 2);
    set_ok(&cfg, " model.device = cpu ");
    cr_assert_eq(cfg.model.device, PD_BACKEND_CPU);
    cr_assert_eq(cfg.model.device_index, 0, "cpu resets the index");
    set_ok(&cfg, "model.device=cuda");
    cr_assert_eq(cfg.model.device, PD_BACKEND_CUDA);
    cr_assert_eq(cfg.model.device_index, 0);
    assert_round_trip(&cfg);
}

Test(config_device, retired_keys_say_what_replaced_them, .init = setup_dir, .fini = teardown_dir) {
    expect_file_error("[model]\nbackend = cuda\n",
                      "bad.conf:2: model.backend was replaced by model.device (cpu, cuda, cuda:N or "
                      "auto)",
                      NULL);
    expect_file_error("[model]\npath = m.gguf\ngpu_device = 1\n",
                      "bad.conf:3: model.gpu_device was replaced by model.device", "cuda:N", NULL);
    expect_set_error("model.backend=cpu",
                     "--set: model.backend was replaced by model.device (cpu, cuda, cuda:N or auto)",
                     NULL);
    expect_set_error("model.gpu_device=0", "model.gpu_device was replaced by model.device", NULL);
    /* Other unknown keys still list the valid ones, device among them. */
    expect_set_error("model.devices=cpu", "unknown key model.devices", "device", NULL);
}

Test(config_device, values_set_in_code_are_checked_and_compared_as_printed) {
    pd_config cfg, other;
    pd_error err = {0};

    pd_config_defaults(&cfg);
    cfg.model.device = PD_BACKEND_CUDA;
    cfg.model.device_index = 256;
    cr_assert_neq(pd_config_validate(&cfg, &err), PD_OK);
    cr_assert(contains(err.msg, "model.device = cuda:256 is not one of"), "%s", err.msg);
    cfg.model.device_index = -1;
    cr_assert_neq(pd_config_validate(&cfg, &err), PD_OK);
    cr_assert(contains(err.msg, "model.device = cuda:-1"), "%s", err.msg);

    pd_config_defaults(&cfg);
    cfg.model.device = (pd_backend_kind)7;
    cr_assert_neq(pd_config_validate(&cfg, &err), PD_OK);
    cr_assert(contains(err.msg, "model.device = 7"), "%s", err.msg);

    /* The index means something only for cuda. */
    pd_config_defaults(&cfg);
    other = cfg;
    cfg.model.device = other.model.device = PD_BACKEND_CPU;
    other.model.device_index = 5;
    cr_assert(pd_config_equal(&cfg, &other));
    cfg.model.device = other.model.device = PD_BACKEND_CUDA;
    cr_assert(!pd_config_equal(&cfg, &other));
    cr_assert_eq(pd_config_validate(&other, &err), PD_OK, "%s", err.msg);
}

/* ------------------------------------------------------------------------
 * --set
 * ------------------------------------------------------------------------ */

Test(config_set, overrides_apply_after_the_file) {
    pd_config cfg;
    pd_config_defaults(&cfg);
    pd_error err = {0};
    cr_assert_eq(pd_config_load_string(&cfg, "[server]\nport = 9000\n", "f", &err), PD_OK);
    set_ok(&cfg, "server.port=9999");
    cr_assert_eq(cfg.server.port, 9999);
    set_ok(&cfg, " model.path = /srv/models/qwen.gguf ");
    cr_assert_str_eq(cfg.model.path, "/srv/models/qwen.gguf");
    set_ok(&cfg, "model.device=CPU");
    cr_assert_eq(cfg.model.device, PD_BACKEND_CPU);
    set_ok(&cfg, "compression.policy=compactor:retention=0.5,lambda=0.5");
    cr_assert_str_eq(cfg.compression.policy, "compactor:retention=0.5,lambda=0.5");
    set_ok(&cfg, "server.api_key=");
    cr_assert_str_eq(cfg.server.api_key, "");
    /* The last --set of a key wins. */
    set_ok(&cfg, "scheduler.max_batch=8");
    set_ok(&cfg, "scheduler.max_batch=32");
    cr_assert_eq(cfg.scheduler.max_batch, 32);
}

Test(config_set, errors_name_set_and_the_key) {
    expect_set_error("server.port=70000", "--set: server.port = 70000 is out of range (1..65535)",
                     NULL);
    expect_set_error("server.port=12ab", "server.port", "is not an integer", NULL);
    expect_set_error("server.metrics=sometimes", "server.metrics", "not a boolean", NULL);
    expect_set_error("model.device=tpu", "--set: model.device = tpu is not one of", "cpu, cuda, cuda:N",
                     NULL);
    expect_set_error("server.prot=1", "unknown key server.prot", "listen, port", NULL);
    expect_set_error("srever.port=1", "unknown section [srever]", "server, admin", NULL);
    expect_set_error("server.port", "expected section.key=value", NULL);
    expect_set_error("port=80", "expected section.key=value", NULL);
    expect_set_error("model.path= ", "model.path", "must not be empty", NULL);
    expect_set_error("admin.token=a b", "admin.token = (hidden)", NULL);
}

Test(config_set, values_that_could_not_round_trip_are_refused) {
    /* Would read back as "a" plus a comment. */
    expect_set_error("model.path=a ;b", "model.path", "comment", NULL);
    expect_set_error("model.path=;b", "model.path", "comment", NULL);
    expect_set_error("cache.path=a\tb", "cache.path", "control character", NULL);
    char long_set[400];
    int n = snprintf(long_set, sizeof long_set, "model.path=");
    memset(long_set + n, 'p', 300);
    long_set[n + 300] = '\0';
    expect_set_error(long_set, "model.path", "too long", NULL);
    /* Just under the printed-line limit is fine and round-trips. */
    pd_config cfg;
    pd_config_defaults(&cfg);
    memset(long_set + n, 'p', 187); /* 4 ("path") + 3 (" = ") + 187 = 194 */
    long_set[n + 187] = '\0';
    set_ok(&cfg, long_set);
    assert_round_trip(&cfg);
    memset(long_set + n, 'p', 191); /* 198 > 197 */
    long_set[n + 191] = '\0';
    expect_set_error(long_set, "model.path", "too long", NULL);
}

/* ------------------------------------------------------------------------
 * Cross-field and programmatic validation
 * ------------------------------------------------------------------------ */

Test(config_validate, cross_field_rules) {
    pd_config cfg;
    pd_error err = {0};

    pd_config_defaults(&cfg);
    set_ok(&cfg, "admin.port=8080");
    cr_assert_neq(pd_config_validate(&cfg, &err), PD_OK);
    cr_assert(contains(err.msg, "admin.port") && contains(err.msg, "server.port"), "%s",
              err.msg);
    set_ok(&cfg, "admin.listen=10.0.0.1"); /* a different address may share the port */
    cr_assert_eq(pd_config_validate(&cfg, &err), PD_OK, "%s", err.msg);
    set_ok(&cfg, "server.listen=::"); /* but not next to a wildcard */
    cr_assert_neq(pd_config_validate(&cfg, &err), PD_OK);

    pd_config_defaults(&cfg);
    set_ok(&cfg, "admin.token=same-secret");
    set_ok(&cfg, "server.api_key=same-secret");
    cr_assert_neq(pd_config_validate(&cfg, &err), PD_OK);
    cr_assert(contains(err.msg, "admin.token") && contains(err.msg, "server.api_key"), "%s",
              err.msg);
    cr_assert(!contains(err.msg, "same-secret"), "secret leaked: %s", err.msg);

    pd_config_defaults(&cfg); /* persisted automatic blocks: a cache to persist, room left in the map */
    set_ok(&cfg, "cache.auto_persist=true");
    cr_assert_eq(pd_config_validate(&cfg, &err), PD_OK, "%s", err.msg); /* 256 of 4096 MiB */
    set_ok(&cfg, "cache.auto_mb=0");
    cr_assert_neq(pd_config_validate(&cfg, &err), PD_OK);
    cr_assert(contains(err.msg, "cache.auto_persist") && contains(err.msg, "cache.auto_mb"), "%s", err.msg);
    set_ok(&cfg, "cache.auto_mb=2049");
    cr_assert_neq(pd_config_validate(&cfg, &err), PD_OK);
    cr_assert(contains(err.msg, "cache.map_size_mb") && contains(err.msg, "4098"), "%s", err.msg);
    set_ok(&cfg, "cache.auto_mb=2048");
    cr_assert_eq(pd_config_validate(&cfg, &err), PD_OK, "%s", err.msg);
    set_ok(&cfg, "cache.auto_persist=false"); /* without persistence the RAM bound is all */
    set_ok(&cfg, "cache.auto_mb=8192");
    cr_assert_eq(pd_config_validate(&cfg, &err), PD_OK, "%s", err.msg);

    pd_config_defaults(&cfg);
    set_ok(&cfg, "model.n_ctx=128");
    cr_assert_neq(pd_config_validate(&cfg, &err), PD_OK);
    cr_assert(contains(err.msg, "compression.min_prefix_tokens") &&
                  contains(err.msg, "model.n_ctx"),
              "%s", err.msg);
}

Test(config_validate, values_set_in_code_are_checked) {
    pd_config cfg;
    pd_error err = {0};

    pd_config_defaults(&cfg);
    cfg.server.port = 0;
    cr_assert_neq(pd_config_validate(&cfg, &err), PD_OK);
    cr_assert(contains(err.msg, "server.port = 0 is out of range"), "%s", err.msg);

    pd_config_defaults(&cfg);
    cfg.log.level = (pd_log_level)9;
    cr_assert_neq(pd_config_validate(&cfg, &err), PD_OK);
    cr_assert(contains(err.msg, "log.level = 9"), "%s", err.msg);

    pd_config_defaults(&cfg);
    memset(cfg.model.path, 'a', sizeof cfg.model.path);
    cr_assert_neq(pd_config_validate(&cfg, &err), PD_OK);
    cr_assert(contains(err.msg, "model.path"), "%s", err.msg);

    pd_config_defaults(&cfg);
    cfg.compression.quality_budget = 0.9;
    cr_assert_neq(pd_config_validate(&cfg, &err), PD_OK);
    cr_assert(contains(err.msg, "compression.quality_budget"), "%s", err.msg);
}

/* ------------------------------------------------------------------------
 * Printing and equality
 * ------------------------------------------------------------------------ */

/* One non-default value for every key. */
static const char *const every_key_changed[] = {
    "server.listen=::1",
    "server.port=9443",
    "server.threads=12",
    "server.max_body_bytes=1048576",
    "server.request_timeout_s=0",
    "server.idle_timeout_s=60",
    "server.max_connections=100",
    "server.max_connections_per_client=8",
    "server.api_key=sk-live-0123456789",
    "server.metrics=false",
    "server.metrics_auth=true",
    "server.api_keys_file=/etc/prefixd/keys",
    "server.cors_origins=https://app.example,http://localhost:3000",
    "admin.token=adm:t0ken/with=punct#no-space",
    "admin.listen=admin.internal.example",
    "admin.port=9444",
    "model.path=/srv/models/Qwen3-0.6B-Q8_0.gguf",
    "model.n_ctx=32768",
    "model.device=cuda:1",
    "model.n_threads=7",
    "model.kv_type=f32",
    "cache.path=/var/lib/prefixd",
    "cache.map_size_mb=65536",
    "cache.hot_tier_mb=0",
    "cache.auto_mb=1024", /* with auto_persist below: above 0, at most half the map */
    "cache.auto_persist=true",
    "cache.page_tokens=128",
    "compression.policy=fair:retention=0.3,lambda=0.5,debias=1e-3",
    "compression.min_prefix_tokens=1024",
    "compression.quality_budget=1.2345678901234567",
    "scheduler.max_batch=64",
    "scheduler.max_queue=0",
    "cluster.redis_url=redis://:s3cret@redis.internal:6380/2",
    "cluster.password=another-s3cret",
    "cluster.role=consumer",
    "cluster.key_prefix=tenant-a:",
    "cluster.timeout_ms=1000",
    "cluster.chunk_mb=16",
    "log.level=debug",
    "log.format=json",
};

Test(config_print, every_key_matters_to_equality) {
    pd_config defaults, changed;
    pd_config_defaults(&defaults);
    for (size_t i = 0; i < sizeof every_key_changed / sizeof every_key_changed[0]; i++) {
        changed = defaults;
        set_ok(&changed, every_key_changed[i]);
        cr_assert(!pd_config_equal(&changed, &defaults), "%s did not change the config",
                  every_key_changed[i]);
    }
}

Test(config_print, round_trip_defaults) {
    pd_config cfg;
    pd_config_defaults(&cfg);
    assert_round_trip(&cfg);
}

Test(config_print, round_trip_every_key_changed) {
    pd_config cfg;
    pd_config_defaults(&cfg);
    for (size_t i = 0; i < sizeof every_key_changed / sizeof every_key_changed[0]; i++)
        set_ok(&cfg, every_key_changed[i]);
    pd_error err = {0};
    cr_assert_eq(pd_config_validate(&cfg, &err), PD_OK, "%s", err.msg);
    assert_round_trip(&cfg);
    char *text = print_to_string(&cfg);
    cr_assert(contains(text, "\n[compression]\n"), "%s", text);
    cr_assert(contains(text, "quality_budget = 1.2345678901234567\n"), "%s", text);
    cr_assert(contains(text, "device = cuda:1\n"), "%s", text);
    cr_assert(contains(text, "metrics = false\n"), "%s", text);
    free(text);
}

Test(config_print, doubles_print_short_and_exact) {
    pd_config cfg;
    pd_config_defaults(&cfg);
    set_ok(&cfg, "compression.quality_budget=1.05");
    char *text = print_to_string(&cfg);
    cr_assert(contains(text, "quality_budget = 1.05\n"), "%s", text);
    free(text);
    set_ok(&cfg, "compression.quality_budget=10");
    text = print_to_string(&cfg);
    cr_assert(contains(text, "quality_budget = 10\n"), "%s", text);
    free(text);
    assert_round_trip(&cfg);
}

/* ------------------------------------------------------------------------
 * The sample config and the docs cover every key
 * ------------------------------------------------------------------------ */

typedef struct key_list {
    char names[64][64];
    int n;
} key_list;

static int collect_key(void *user, const char *section, const char *name, const char *value) {
    key_list *list = user;
    (void)value;
    if (list->n == 64) return 0;
    snprintf(list->names[list->n++], sizeof list->names[0], "%s.%s", section, name);
    return 1;
}

static bool key_listed(const key_list *list, const char *key) {
    for (int i = 0; i < list->n; i++)
        if (strcmp(list->names[i], key) == 0) return true;
    return false;
}

/* Every "section.key" the config knows, from printing the defaults. */
static void all_keys(key_list *list) {
    pd_config cfg;
    pd_config_defaults(&cfg);
    char *text = print_to_string(&cfg);
    memset(list, 0, sizeof *list);
    cr_assert_eq(ini_parse_string(text, collect_key, list), 0);
    cr_assert_gt(list->n, 20);
    free(text);
}

/* A file in the repository, found through $PD_SOURCE_ROOT (set by meson). */
static void repo_file(const char *rel, char *buf, size_t cap) {
    const char *root = getenv("PD_SOURCE_ROOT");
    cr_assert_not_null(root, "PD_SOURCE_ROOT is not set (run through meson test)");
    snprintf(buf, cap, "%s/%s", root, rel);
}

Test(config_repo, sample_config_sets_every_key_to_its_default) {
    char path[4096];
    repo_file("deploy/prefixd.conf", path, sizeof path);
    pd_config cfg, defaults;
    pd_config_defaults(&defaults);
    /* Start from values unlike the defaults, so a key the sample forgets
     * shows up as a difference. */
    cfg = defaults;
    for (size_t i = 0; i < sizeof every_key_changed / sizeof every_key_changed[0]; i++)
        set_ok(&cfg, every_key_changed[i]);
    pd_error err = {0};
    cr_assert_eq(pd_config_load_file(&cfg, path, &err), PD_OK, "%s", err.msg);
    cr_assert(pd_config_equal(&cfg, &defaults), "deploy/prefixd.conf differs from the defaults");

    key_list known, in_sample = {0};
    all_keys(&known);
    char *text = NULL;
    cr_assert_eq(pd_read_file(path, &text, NULL, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(ini_parse_string(text, collect_key, &in_sample), 0);
    for (int i = 0; i < known.n; i++)
        cr_assert(key_listed(&in_sample, known.names[i]), "sample lacks %s", known.names[i]);
    free(text);
}

Test(config_repo, docs_describe_every_key) {
    char path[4096];
    repo_file("docs/configuration.md", path, sizeof path);
    char *docs = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_read_file(path, &docs, NULL, &err), PD_OK, "%s", err.msg);
    key_list known;
    all_keys(&known);
    for (int i = 0; i < known.n; i++) {
        char heading[96];
        snprintf(heading, sizeof heading, "`%s`", known.names[i]);
        cr_assert(contains(docs, heading), "docs/configuration.md lacks %s", heading);
    }
    free(docs);
}

/* ------------------------------------------------------------------------
 * The prefixd binary
 * ------------------------------------------------------------------------ */

static const char *prefixd_path(void) {
    const char *p = getenv("PD_PREFIXD");
    cr_assert_not_null(p, "PD_PREFIXD is not set (run through meson test)");
    return p;
}

Test(config_cli, check_config_prints_overrides) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' --check-config --set server.port=9999 --set log.level=warn",
             prefixd_path());
    char *out = NULL;
    int status = th_run(cmd, &out);
    cr_assert_eq(status, 0, "status %d, output:\n%s", status, out ? out : "");
    cr_assert(contains(out, "port = 9999\n"), "%s", out);
    /* The output is the effective config and reads back as such. */
    pd_config expected, back;
    pd_config_defaults(&expected);
    set_ok(&expected, "server.port=9999");
    set_ok(&expected, "log.level=warn");
    pd_config_defaults(&back);
    back.server.port = 1;
    pd_error err = {0};
    cr_assert_eq(pd_config_load_string(&back, out, "stdout", &err), PD_OK, "%s", err.msg);
    cr_assert(pd_config_equal(&back, &expected), "%s", out);
    free(out);
}

Test(config_cli, bad_config_exits_2_and_names_the_line, .init = setup_dir, .fini = teardown_dir) {
    char *path = write_conf("prefixd.conf", "[server]\nport = 8080\n\n[model]\ndevice = tpu\n");
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' --config '%s' --check-config 2>&1", prefixd_path(), path);
    char *out = NULL;
    int status = th_run(cmd, &out);
    cr_assert_eq(status, 2, "status %d, output:\n%s", status, out ? out : "");
    cr_assert(contains(out, "prefixd: "), "%s", out);
    cr_assert(contains(out, "prefixd.conf:5: model.device = tpu is not one of"), "%s", out);
    free(out);
    free(path);
}

Test(config_cli, check_config_reports_the_device) {
    char *out = NULL;
    int status = th_runf(&out, "'%s' --check-config --set model.device=CUDA:3", prefixd_path());
    cr_assert_eq(status, 0, "status %d, output:\n%s", status, out ? out : "");
    cr_assert(contains(out, "\n[model]\n") && contains(out, "\ndevice = cuda:3\n"), "%s", out);
    free(out);
    status = th_runf(&out, "'%s' --check-config --set model.backend=cuda 2>&1", prefixd_path());
    cr_assert_eq(status, 2, "status %d, output:\n%s", status, out ? out : "");
    cr_assert(contains(out, "prefixd: --set: model.backend was replaced by model.device"), "%s", out);
    free(out);
}

Test(config_cli, bad_set_exits_2) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' --check-config --set server.port=0 2>&1", prefixd_path());
    char *out = NULL;
    int status = th_run(cmd, &out);
    cr_assert_eq(status, 2, "status %d, output:\n%s", status, out ? out : "");
    cr_assert(contains(out, "prefixd: --set: server.port = 0 is out of range"), "%s", out);
    free(out);
}

Test(config_cli, file_then_set, .init = setup_dir, .fini = teardown_dir) {
    char *path = write_conf("prefixd.conf", "[scheduler]\nmax_batch = 8\nmax_queue = 9\n");
    char cmd[4096];
    /* --set before --config on the command line still applies after the file. */
    snprintf(cmd, sizeof cmd, "'%s' --set scheduler.max_batch=4 -c '%s' --check-config",
             prefixd_path(), path);
    char *out = NULL;
    int status = th_run(cmd, &out);
    cr_assert_eq(status, 0, "status %d", status);
    cr_assert(contains(out, "max_batch = 4\n") && contains(out, "max_queue = 9\n"), "%s", out);
    free(out);
    free(path);
}

Test(config_cli, without_a_model_file_prefixd_says_how_to_give_one) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' --set model.path=/nonexistent/m.gguf 2>&1", prefixd_path());
    char *out = NULL;
    int status = th_run(cmd, &out);
    cr_assert_eq(status, 2, "status %d, output:\n%s", status, out ? out : "");
    cr_assert(contains(out, "model.path '/nonexistent/m.gguf'") && contains(out, "--set model.path="), "%s", out);
    free(out);
    /* The config is still validated first. */
    snprintf(cmd, sizeof cmd, "'%s' --set log.level=loud 2>&1", prefixd_path());
    status = th_run(cmd, &out);
    cr_assert_eq(status, 2, "status %d, output:\n%s", status, out ? out : "");
    free(out);
}

Test(config_cli, help_version_and_usage_errors) {
    char cmd[4096];
    char *out = NULL;
    snprintf(cmd, sizeof cmd, "'%s' --help", prefixd_path());
    cr_assert_eq(th_run(cmd, &out), 0);
    cr_assert(contains(out, "--check-config") && contains(out, "--set"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "'%s' --version", prefixd_path());
    cr_assert_eq(th_run(cmd, &out), 0);
    cr_assert(contains(out, "prefixd " PREFIXD_VERSION), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "'%s' --no-such-option 2>&1", prefixd_path());
    cr_assert_eq(th_run(cmd, &out), 2);
    free(out);
    snprintf(cmd, sizeof cmd, "'%s' stray-argument 2>&1", prefixd_path());
    cr_assert_eq(th_run(cmd, &out), 2);
    cr_assert(contains(out, "stray-argument"), "%s", out);
    free(out);
}

/* cluster.redis_url: the forms the shared tier parses; TLS is refused with
 * the tunnel to use instead; a URL (which may carry a password) is never
 * echoed. */
Test(config_cluster, redis_url_forms_and_errors) {
    pd_config cfg;
    pd_config_defaults(&cfg);
    set_ok(&cfg, "cluster.redis_url=redis://127.0.0.1:6379/0");
    set_ok(&cfg, "cluster.redis_url=redis://redis.internal");
    set_ok(&cfg, "cluster.redis_url=redis://user:pw@[::1]:7000/3");
    set_ok(&cfg, "cluster.redis_url=unix:///run/redis/redis.sock?db=1");
    set_ok(&cfg, "cluster.redis_url=");
    expect_set_error("cluster.redis_url=rediss://:hunter2@host:6380", "TLS", "tunnel", NULL);
    expect_set_error("cluster.redis_url=http://host:6379", "redis://", "unix:///", NULL);
    expect_set_error("cluster.redis_url=redis:///0", "redis://", NULL);
    pd_config c2;
    pd_config_defaults(&c2);
    pd_error err = {0};
    cr_assert_neq(pd_config_set(&c2, "cluster.redis_url=rediss://:hunter2@host", &err), PD_OK);
    cr_assert(!contains(err.msg, "hunter2"), "secret leaked: %s", err.msg);
    expect_set_error("cluster.role=leader", "member", "publisher", "consumer", NULL);
    expect_set_error("cluster.key_prefix=", "must not be empty", NULL);
    expect_set_error("cluster.key_prefix=a b", "printable ASCII", NULL);
    expect_set_error("cluster.timeout_ms=5", "10..60000", NULL);
    expect_set_error("cluster.chunk_mb=513", "1..512", NULL);
}
