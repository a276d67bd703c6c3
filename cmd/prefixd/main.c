/* prefixd: entry point. Reads the configuration (file, then --set
 * overrides), validates it, and either prints it (--check-config) or runs
 * the daemon. */
#include <getopt.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <string.h>
#include <systemd/sd-daemon.h>
#include <time.h>
#include <unistd.h>

#include "api/api.h"
#include "cache/cache.h"
#include "cluster/cluster.h"
#include "config/config.h"
#include "daemon/daemon.h"
#include "engine/engine.h"
#include "kernels/kernels.h"
#include "util/util.h"
#include "build_info.h"

/* Exit statuses: 0 success, 1 runtime failure, 2 bad usage or config, 3
 * the GPU failed (a sticky CUDA error: only a new process can use it). */
enum { EXIT_USAGE = 2, EXIT_DEVICE = 3 };

static void print_usage(FILE *f) {
    fprintf(f,
            "Usage: prefixd [OPTIONS]\n"
            "\n"
            "Serve an LLM with compressed, persistent prompt-prefix caches.\n"
            "\n"
            "Options:\n"
            "  -c, --config FILE            read settings from an INI file\n"
            "  -s, --set SECTION.KEY=VALUE  override one setting (after the file; repeatable)\n"
            "      --check-config           validate, print the effective config, exit\n"
            "  -V, --version                print the version and exit\n"
            "  -h, --help                   print this help and exit\n"
            "\n"
            "Every key and its default: docs/configuration.md, deploy/prefixd.conf.\n"
            "Exit status: 0 ok, 1 runtime failure, 2 bad usage or configuration,\n"
            "3 the GPU failed (restart prefixd; systemd does).\n");
}

typedef struct options {
    const char *config_path; /* NULL: built-in defaults only */
    const char **sets;       /* --set arguments, in command-line order */
    int n_sets;
    bool check_config;
} options;

/* Returns -1 to go on, or the exit status when main should stop now. */
static int parse_options(int argc, char **argv, options *opt) {
    enum { OPT_CHECK_CONFIG = 256 };
    static const struct option longopts[] = {
        {"config", required_argument, NULL, 'c'},
        {"set", required_argument, NULL, 's'},
        {"check-config", no_argument, NULL, OPT_CHECK_CONFIG},
        {"version", no_argument, NULL, 'V'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    int ch;
    while ((ch = getopt_long(argc, argv, "c:s:Vh", longopts, NULL)) != -1) {
        switch (ch) {
        case 'c': opt->config_path = optarg; break;
        case 's': opt->sets[opt->n_sets++] = optarg; break;
        case OPT_CHECK_CONFIG: opt->check_config = true; break;
        case 'V': printf("prefixd %s\n", PREFIXD_VERSION); return EXIT_SUCCESS;
        case 'h': print_usage(stdout); return EXIT_SUCCESS;
        default: /* getopt_long has already said what was wrong */
            fprintf(stderr, "Try 'prefixd --help'.\n");
            return EXIT_USAGE;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "prefixd: unexpected argument '%s'\nTry 'prefixd --help'.\n",
                argv[optind]);
        return EXIT_USAGE;
    }
    return -1;
}

/* Defaults, then the file, then each --set in order, then cross-checks. */
static int load_config(const options *opt, pd_config *cfg, pd_error *err) {
    pd_config_defaults(cfg);
    int rc = opt->config_path ? pd_config_load_file(cfg, opt->config_path, err) : PD_OK;
    for (int i = 0; rc == PD_OK && i < opt->n_sets; i++) rc = pd_config_set(cfg, opt->sets[i], err);
    return rc == PD_OK ? pd_config_validate(cfg, err) : rc;
}

/* Secrets in a config file others can read are secrets no longer; say so
 * (the file may be shared on purpose, so this does not stop the start). */
static void warn_exposed_secrets(const pd_logger *lg, const options *opt, const pd_config *cfg) {
    struct stat st;
    /* A Redis URL holds a password only after "user:" and before "@". */
    const bool redis_secret = cfg->cluster.password[0] || strchr(cfg->cluster.redis_url, '@');
    if (!opt->config_path || (!cfg->server.api_key[0] && !cfg->admin.token[0] && !redis_secret) ||
        stat(opt->config_path, &st) != 0 || !(st.st_mode & 077))
        return;
    pd_log(lg, PD_LOG_WARN,
             "config file %s is readable by %s (mode %04o) and the configuration holds secrets "
             "(server.api_key, admin.token, the Redis password): chmod 600 %s, or 640 with a group only the service "
             "is in",
             opt->config_path, st.st_mode & 004 ? "everyone" : "its group", (unsigned)(st.st_mode & 07777),
             opt->config_path);
}

/* The device-failure hook of the scheduler (on its engine thread) and of
 * the precompression worker: wake wait_for_stop, which takes every signal
 * of the process. */
static void wake_on_device_failure(void *ctx) {
    (void)ctx;
    kill(getpid(), SIGUSR2);
}

/* Wait for SIGTERM/SIGINT (signals are blocked in every thread and taken
 * here), pinging the systemd watchdog meanwhile, or for SIGUSR2 from
 * wake_on_device_failure; returns true for the latter. SIGHUP is accepted
 * and logged: logs go to stderr (the journal), so there is nothing to
 * reopen. */
static bool wait_for_stop(const pd_logger *lg, const sigset_t *set, pd_scheduler *sched, pd_jobs *jobs) {
    uint64_t wd_usec = 0;
    bool watchdog = sd_watchdog_enabled(0, &wd_usec) > 0 && wd_usec > 0;
    for (;;) {
        int sig;
        if (watchdog) {
            struct timespec ts = {.tv_sec = (time_t)(wd_usec / 2 / 1000000), .tv_nsec = (long)(wd_usec / 2 % 1000000) * 1000};
            sig = sigtimedwait(set, NULL, &ts);
            sd_notify(0, "WATCHDOG=1");
            if (sig < 0) continue;
        } else if (sigwait(set, &sig) != 0) {
            continue;
        }
        if (sig == SIGHUP) {
            pd_log(lg, PD_LOG_INFO, "SIGHUP: logs go to stderr, nothing to reopen");
            continue;
        }
        if (sig == SIGUSR2) {
            pd_scheduler_stats st;
            pd_scheduler_stats_get(sched, &st);
            if (st.device_failed || (jobs && pd_jobs_device_failed(jobs))) return true;
            pd_log(lg, PD_LOG_INFO, "SIGUSR2 ignored (prefixd uses it only to report a failed GPU to itself)");
            continue;
        }
        pd_log(lg, PD_LOG_INFO, "%s: draining", sig == SIGTERM ? "SIGTERM" : "SIGINT");
        return false;
    }
}

/* prefixd_build_info{version,commit,backend} 1: which build serves, on
 * which compute backend (the usual *_build_info idiom: join on it). */
static int register_build_info(pd_metrics *m, const pd_backend *be, pd_error *err) {
    const char *values[] = {PREFIXD_VERSION, PREFIXD_COMMIT, pd_backend_name(be)};
    const char *names[] = {"version", "commit", "backend"};
    char labels[512];
    pd_strbuf b = {.buf = labels, .cap = sizeof labels};
    for (size_t i = 0; i < sizeof values / sizeof values[0]; i++) {
        pd_strbuf_printf(&b, "%s%s=\"", i ? "," : "", names[i]);
        /* Label values escape backslash, quote and newline. */
        for (const char *c = values[i]; *c; c++) {
            if (*c == '\\' || *c == '"') pd_strbuf_printf(&b, "\\%c", *c);
            else if (*c == '\n') pd_strbuf_printf(&b, "\\n");
            else pd_strbuf_printf(&b, "%c", *c);
        }
        pd_strbuf_printf(&b, "\"");
    }
    if (b.len >= b.cap) return pd_errorf(err, PD_ERANGE, "prefixd_build_info: labels longer than %zu bytes", b.cap);
    pd_gauge *g = NULL;
    const int rc = pd_metrics_gauge(m, "prefixd_build_info", "The running build: version, commit and compute backend.",
                                    labels, &g, err);
    if (!rc) pd_gauge_set(g, 1);
    return rc;
}

/* Give in-flight requests up to grace seconds to finish. */
static void drain(const pd_logger *lg, pd_scheduler *sched, int grace_s) {
    double deadline = pd_now_seconds() + grace_s;
    for (;;) {
        pd_scheduler_stats st;
        pd_scheduler_stats_get(sched, &st);
        if (st.queued + st.running == 0) return;
        if (pd_now_seconds() >= deadline) {
            pd_log(lg, PD_LOG_WARN, "grace period over: cancelling %" PRId64 " requests", st.queued + st.running);
            return;
        }
        struct timespec ts = {.tv_sec = 0, .tv_nsec = 50 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

/* model.device as the kernels' pd_device (config keeps its own enum so that
 * it does not depend on kernels/). */
static pd_device config_device(const pd_config *cfg) {
    pd_device d = {.kind = PD_DEVICE_AUTO, .index = 0};
    switch (cfg->model.device) {
    case PD_BACKEND_CPU: d.kind = PD_DEVICE_CPU; break;
    case PD_BACKEND_CUDA: d.kind = PD_DEVICE_CUDA; d.index = cfg->model.device_index; break;
    case PD_BACKEND_AUTO: d.kind = PD_DEVICE_AUTO; break;
    }
    return d;
}

/* "prefixd: compute: cuda:0 (NVIDIA H100 ..., 79.1 GiB)" or
 * "prefixd: compute: cpu (avx2, 16 threads)": which backend `auto` chose, and
 * the line to look for after a driver or config change. */
static void log_compute(const pd_logger *lg, const pd_backend *be, const pd_device *d, int n_threads) {
    if (pd_backend_host_memory(be)) {
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        int threads = n_threads > 0 ? n_threads : (online > 0 ? (int)online : 1);
        pd_log(lg, PD_LOG_INFO, "compute: cpu (%s, %d threads)", pd_cpu_simd_name(), threads);
        return;
    }
    /* A device backend: pd_backend_create picks d->index for cuda and auto. */
    pd_cuda_device_info info;
    pd_error err = {0};
    if (pd_cuda_device_info_get(d->index, &info, &err) == PD_OK)
        pd_log(lg, PD_LOG_INFO, "compute: cuda:%d (%s, compute capability %d.%d, %.1f GiB, %d SMs)", d->index,
                info.name, info.cc_major, info.cc_minor, (double)info.total_mem / (1024.0 * 1024 * 1024),
                info.sm_count);
    else
        pd_log(lg, PD_LOG_INFO, "compute: cuda:%d (%s backend; no device details: %s)", d->index, pd_backend_name(be),
                err.msg);
}

/* One token through the whole model before the first request: every
 * weight page is touched, the scratch buffers are sized and the CPU
 * threads are up, so the first request after a start takes no longer than
 * the next ones. */
static int warm_up(const pd_logger *lg, pd_model *m, pd_error *err) {
    const double t0 = pd_now_seconds();
    const pd_hparams *hp = pd_model_hparams(m);
    float *logits = malloc(sizeof(float) * (size_t)hp->n_vocab);
    if (!logits) return pd_errorf(err, PD_ENOMEM, "out of memory warming up the model");
    pd_seq *s = NULL;
    const pd_token tok = 0;
    int rc = pd_seq_create(m, 2, &s, err);
    if (!rc) rc = pd_prefill(m, s, &tok, 1, NULL, logits, err);
    pd_seq_free(s);
    free(logits);
    if (rc) return pd_error_prefix(err, "warming up the model");
    pd_log(lg, PD_LOG_INFO, "model warmed up in %.0f ms", (pd_now_seconds() - t0) * 1e3);
    return PD_OK;
}

static int run(const pd_logger *lg, const pd_config *cfg) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    sigaddset(&set, SIGUSR2);
    /* Before any thread starts, so every thread inherits the mask. */
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);

    pd_error err = {0};
    pd_metrics *metrics = NULL;
    pd_server *server = NULL;
    pd_backend *backend = NULL;
    pd_model *model = NULL;
    pd_store *store = NULL;
    pd_hot *hot = NULL;
    pd_cluster *cluster = NULL;
    pd_scheduler *sched = NULL;
    pd_jobs *jobs = NULL;
    int rc = pd_metrics_create(&metrics, &err);
    /* The backend first, so a device that cannot be used fails before the
     * port is opened or the model read. */
    pd_device device = config_device(cfg);
    if (!rc) rc = pd_backend_create(&device, cfg->model.n_threads, &backend, &err);
    if (!rc) log_compute(lg, backend, &device, cfg->model.n_threads);
    if (!rc) rc = pd_metrics_process(metrics, &err);
    if (!rc) rc = register_build_info(metrics, backend, &err);

    pd_server_opts so;
    pd_server_opts_default(&so);
    so.listen = cfg->server.listen;
    so.port = cfg->server.port;
    so.api_key = cfg->server.api_key;
    so.api_keys_file = cfg->server.api_keys_file;
    so.threads = cfg->server.threads;
    so.logger = lg;
    so.request_timeout_s = cfg->server.request_timeout_s;
    so.idle_timeout_s = cfg->server.idle_timeout_s;
    so.max_connections = (unsigned)cfg->server.max_connections;
    so.max_connections_per_client = (unsigned)cfg->server.max_connections_per_client;
    so.metrics = cfg->server.metrics;
    so.metrics_auth = cfg->server.metrics_auth;
    so.cors_origins = cfg->server.cors_origins;
    so.limits.max_body_bytes = (size_t)cfg->server.max_body_bytes;
    so.admin_token = cfg->admin.token;
    so.admin_listen = cfg->admin.listen;
    so.admin_port = cfg->admin.port;
    if (!rc) rc = pd_server_start(&so, metrics, &server, &err);
    if (!rc) pd_log(lg, PD_LOG_INFO, "listening on %s:%d, loading %s", so.listen, pd_server_port(server),
                     cfg->model.path);
    if (!rc && cfg->admin.token[0])
        pd_log(lg, PD_LOG_INFO, "admin API on %s:%d", cfg->admin.port ? so.admin_listen : so.listen,
                cfg->admin.port ? pd_server_admin_port(server) : pd_server_port(server));
    if (!rc && !cfg->model.path[0])
        rc = pd_errorf(&err, PD_EINVAL, "model.path is not set: give a GGUF file (--set model.path=FILE)");
    const bool kv_f32 = cfg->model.kv_type == PD_KV_CACHE_F32;
    pd_model_params mp = {.n_threads = cfg->model.n_threads, .backend = backend, .kv_f32 = kv_f32,
                          .mmap_weights = cfg->model.mmap, .no_graphs = !cfg->model.cuda_graphs};
    if (!rc) rc = pd_model_load(cfg->model.path, &mp, &model, &err);
    if (!rc) rc = warm_up(lg, model, &err);

    pd_store_opts sto;
    pd_store_opts_default(&sto);
    sto.dir = cfg->cache.path;
    sto.kv_type = kv_f32 ? PD_TYPE_F32 : PD_TYPE_F16; /* stored rows of this dtype are read zero-copy */
    sto.map_size = (uint64_t)cfg->cache.map_size_mb << 20;
    sto.page_tokens = cfg->cache.page_tokens;
    if (!rc) rc = pd_store_open(&sto, &store, &err);
    if (!rc && cfg->cache.hot_tier_mb > 0) rc = pd_hot_create(store, (uint64_t)cfg->cache.hot_tier_mb << 20, &hot, &err);
    if (!rc && cfg->cluster.redis_url[0]) {
        pd_cluster_opts clo;
        pd_cluster_opts_default(&clo);
        clo.redis_url = cfg->cluster.redis_url;
        clo.password = cfg->cluster.password;
        clo.key_prefix = cfg->cluster.key_prefix;
        _Static_assert((int)PD_CLUSTER_ROLE_CONSUMER == (int)PD_CLUSTER_CONSUMER, "config and cluster roles agree");
        clo.role = (pd_cluster_role)cfg->cluster.role;
        clo.timeout_ms = cfg->cluster.timeout_ms;
        clo.chunk_bytes = (size_t)cfg->cluster.chunk_mb << 20;
        clo.store = store;
        clo.hot = hot;
        clo.logger = lg;
        rc = pd_cluster_create(&clo, &cluster, &err);
    }

    pd_scheduler_opts sco;
    pd_scheduler_opts_default(&sco);
    sco.max_batch = cfg->scheduler.max_batch;
    sco.max_queue = cfg->scheduler.max_queue;
    sco.n_ctx = cfg->model.n_ctx;
    sco.auto_cache_bytes = (uint64_t)cfg->cache.auto_mb << 20;
    sco.auto_persist = cfg->cache.auto_persist;
    sco.logger = lg;
    sco.store = store;
    sco.hot = hot;
    sco.cluster = cluster;
    sco.metrics = metrics;
    sco.on_device_failure = wake_on_device_failure;
    bool device_failed = false;
    if (!rc) rc = pd_scheduler_create(model, &sco, &sched, &err);
    /* Precompression jobs only serve the admin API: without a token there is
     * no way to submit one. The worker loads its own model lazily. */
    pd_jobs_opts jo;
    pd_jobs_opts_default(&jo);
    jo.model_path = cfg->model.path;
    jo.n_threads = cfg->model.n_threads > 0 ? cfg->model.n_threads : 1;
    jo.kv_f32 = kv_f32;
    /* Precompression computes where serving does (auto resolved already). */
    jo.device = backend && !pd_backend_host_memory(backend) ? (pd_device){PD_DEVICE_CUDA, device.index}
                                                       : (pd_device){PD_DEVICE_CPU, 0};
    jo.store = store;
    jo.hot = hot;
    jo.cluster = cluster;
    jo.default_policy = cfg->compression.policy;
    jo.metrics = metrics;
    jo.logger = lg;
    jo.min_compress_tokens = cfg->compression.min_prefix_tokens;
    jo.on_device_failure = wake_on_device_failure;
    if (!rc && cfg->admin.token[0]) rc = pd_jobs_create(&jo, &jobs, &err);
    if (!rc) {
        pd_server_backend b = {.model = model, .sched = sched, .family = pd_model_chat_family(model),
                               .created = (int64_t)time(NULL), .jobs = jobs, .store = store, .hot = hot,
                               .cluster = cluster,
                               .default_policy = cfg->compression.policy,
                               .quality_budget = cfg->compression.quality_budget};
        b.n_ctx = pd_scheduler_n_ctx(sched);
        pd_api_model_id(pd_model_gguf(model), cfg->model.path, b.model_id, sizeof b.model_id);
        if (cfg->server.model_names[0]) {
            /* The first of the configured names is the id. */
            b.model_names = cfg->server.model_names;
            snprintf(b.model_id, sizeof b.model_id, "%.*s", (int)strcspn(b.model_names, ","), b.model_names);
        }
        pd_server_set_ready(server, &b);
        pd_log(lg, PD_LOG_INFO, "serving %s (%s, chat template: %s, %s KV cache), prefix store %s", b.model_id,
                pd_model_hparams(model)->arch_name, pd_chat_family_name(b.family), pd_kv_cache_type_name(cfg->model.kv_type),
                cfg->cache.path);
        sd_notify(0, "READY=1\nSTATUS=serving");
        device_failed = wait_for_stop(lg, &set, sched, jobs);
        if (device_failed) {
            /* The scheduler (or the precompression worker) logged the error;
             * requests fail with 503 as they meet the dead context. */
            pd_log(lg, PD_LOG_INFO, "the GPU failed: exiting with status %d so that the service manager restarts "
                                    "prefixd (systemd: Restart=on-failure)",
                   EXIT_DEVICE);
            sd_notify(0, "STOPPING=1\nSTATUS=the GPU failed; restarting");
            pd_server_drain(server);
            pd_server_quiesce(server);
        } else {
            sd_notify(0, "STOPPING=1\nSTATUS=draining");
            pd_server_quiesce(server);
            pd_server_drain(server);
            drain(lg, sched, cfg->server.shutdown_grace_s);
        }
    }
    if (rc) pd_log(lg, PD_LOG_ERROR, "%s", err.msg);
    /* Cancel what is left (waiting clients get an error), then close the
     * connections, then the store. */
    pd_scheduler_free(sched);
    if (server) {
        const int64_t left = pd_server_wait_idle(server, 5.0);
        if (left) pd_log(lg, PD_LOG_WARN, "%" PRId64 " requests still unanswered after 5 s; closing them", left);
    }
    pd_server_stop(server);
    /* After the server: no connection can reach the jobs any more. */
    pd_jobs_free(jobs);
    /* Before the hot tier and the store, which its event thread uses. */
    pd_cluster_free(cluster);
    if (hot) pd_hot_free(hot);
    pd_store_close(store);
    pd_model_free(model);
    /* After the model, which borrows it. */
    pd_backend_free(backend);
    pd_metrics_free(metrics);
    if (device_failed || (rc && err.code == PD_EDEVICE)) return EXIT_DEVICE;
    return rc ? EXIT_FAILURE : EXIT_SUCCESS;
}

int main(int argc, char **argv) {
    pd_cpu_prepare_process(argv);
    /* Every --set needs its own argv slot, so argc bounds their number. */
    options opt = {.sets = calloc((size_t)argc, sizeof(const char *))};
    if (!opt.sets) {
        fprintf(stderr, "prefixd: out of memory\n");
        return EXIT_FAILURE;
    }
    int status = parse_options(argc, argv, &opt);
    if (status >= 0) goto done;

    pd_config cfg;
    pd_error err = {0};
    if (load_config(&opt, &cfg, &err) != PD_OK) {
        fprintf(stderr, "prefixd: %s\n", err.msg);
        status = EXIT_USAGE;
        goto done;
    }
    /* The log, from the configuration and fixed from here on: every layer
     * gets it by const pointer. */
    const pd_logger logger = {.level = cfg.log.level, .format = cfg.log.format, .sink = stderr};
    if (cfg.log.format == PD_LOG_JOURNAL && !pd_log_journal_available())
        pd_log(&logger, PD_LOG_WARN, "log.format = journal, but there is no journal here (no "
               "/run/systemd/journal/socket): lines go to stderr as text; run under systemd, or set log.format");
    warn_exposed_secrets(&logger, &opt, &cfg);
    if (opt.check_config) {
        if (pd_config_print(&cfg, stdout, &err) != PD_OK) {
            fprintf(stderr, "prefixd: %s\n", err.msg);
            status = EXIT_FAILURE;
        } else {
            status = EXIT_SUCCESS;
        }
        goto done;
    }
    /* Checked before anything listens, so a wrong path fails fast. */
    if (!cfg.model.path[0] || access(cfg.model.path, R_OK) != 0) {
        fprintf(stderr, "prefixd: model.path '%s': %s; give a GGUF file (--set model.path=FILE, or "
                        "[model] path = FILE in the config)\n",
                cfg.model.path, cfg.model.path[0] ? strerror(errno) : "not set");
        status = EXIT_USAGE;
        goto done;
    }
    status = run(&logger, &cfg);
done:
    free(opt.sets);
    return status;
}
