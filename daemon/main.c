/* prefixd: entry point. Reads the configuration (file, then --set
 * overrides), validates it, and either prints it (--check-config) or runs
 * the daemon. */
#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "config/config.h"
#include "kernels/kernels.h"
#include "util/util.h"

/* Exit statuses: 0 success, 1 runtime failure, 2 bad usage or config. */
enum { EXIT_USAGE = 2 };

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
            "Exit status: 0 ok, 1 runtime failure, 2 bad usage or configuration.\n");
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
    if (opt.check_config) {
        if (pd_config_print(&cfg, stdout, &err) != PD_OK) {
            fprintf(stderr, "prefixd: %s\n", err.msg);
            status = EXIT_FAILURE;
        } else {
            status = EXIT_SUCCESS;
        }
        goto done;
    }
    fprintf(stderr, "prefixd: configuration is valid, but the serving daemon is not built yet; "
                    "use --check-config to check a configuration, or prefixctl for offline "
                    "work\n");
    status = EXIT_FAILURE;
done:
    free(opt.sets);
    return status;
}
