/* prefixctl calibrate: fit one retention->quality curve offline on a set of
 * texts (the Compactor paper's setting) and write it as CURVE.json, which
 * `prefixctl compress --curve` and the admin API's `curve` apply zero-shot.
 *
 *   prefixctl calibrate --model F --policy SPEC --set DIR --out CURVE.json
 *       [--points 0.5,0.25,0.125,0.0625] [--holdout 0.2] [--under-weight 4] [--threads N]
 *
 * Every regular file of DIR (names not starting with '.', sorted bytewise so
 * the result does not depend on the locale or the directory order) is one
 * text: its last `holdout` of tokens is the continuation, the rest the
 * prefix, and the continuation's NLL ratio is measured at every point. The
 * curve is fitted over all (point, ratio) pairs pooled (pd_curve_fit_set). */
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/engine.h"
#include "tools/tools.h"

#define CURVE_OBJECT "prefixd.curve"
#define CURVE_VERSION 1
#define MAX_SET_FILES 100000

/* ---- the curve file ------------------------------------------------------------ */

void pd_curve_file_free(pd_curve_file *cf) {
    if (!cf) return;
    free(cf->texts);
    cf->texts = NULL;
    cf->n_texts = 0;
}

static json_t *reals(const double *x, int n) {
    json_t *a = json_array();
    for (int i = 0; a && i < n; i++)
        if (json_array_append_new(a, json_real(x[i]))) {
            json_decref(a);
            return NULL;
        }
    return a;
}

int pd_curve_file_write(const pd_curve_file *cf, const char *path, pd_error *err) {
    json_t *texts = json_array();
    for (int t = 0; texts && t < cf->n_texts; t++) {
        const pd_curve_text *x = &cf->texts[t];
        json_t *o = json_pack("{s:s,s:I,s:f,s:o}", "file", x->file, "tokens", (json_int_t)x->tokens, "nll_full",
                              x->nll_full, "ratios", reals(x->ratio, cf->n_points));
        if (!o || json_array_append_new(texts, o)) {
            json_decref(texts);
            texts = NULL;
        }
    }
    json_t *root = texts ? json_pack("{s:s,s:i,s:s,s:{s:s,s:s},s:f,s:f,s:s,s:o,s:f,s:f,s:s,s:i,s:o}", "object",
                                     CURVE_OBJECT, "version", CURVE_VERSION, "policy", cf->policy, "model", "file",
                                     cf->model_file, "fingerprint", cf->fingerprint, "a", cf->curve.a, "b",
                                     cf->curve.b, "formula", "f(r) = 1 + a * (r^-b - 1)", "points",
                                     reals(cf->points, cf->n_points), "holdout", cf->holdout, "under_weight",
                                     cf->under_weight, "pooling", "every (point, ratio) pair of every text, equal weights",
                                     "n_texts", cf->n_texts, "texts", texts)
                         : NULL;
    if (!root) return pd_errorf(err, PD_ENOMEM, "%s: out of memory building the curve file", path);
    const size_t len = strlen(path) + 16;
    char *tmp = malloc(len);
    int rc = PD_OK;
    if (!tmp) {
        rc = pd_errorf(err, PD_ENOMEM, "%s: out of memory", path);
        goto done;
    }
    snprintf(tmp, len, "%s.tmp%ld", path, (long)getpid());
    if (json_dump_file(root, tmp, JSON_INDENT(2) | JSON_REAL_PRECISION(17)) != 0) {
        rc = pd_errorf(err, PD_EIO, "%s: cannot write it (does the directory exist and is it writable?)", tmp);
        unlink(tmp);
        goto done;
    }
    if (rename(tmp, path) != 0) {
        rc = pd_errorf(err, PD_EIO, "%s: cannot rename %s to it: %s", path, tmp, strerror(errno));
        unlink(tmp);
    }
done:
    free(tmp);
    json_decref(root);
    return rc;
}

static bool is_hex64(const char *s) {
    if (strlen(s) != 2 * PD_SHA256_LEN) return false;
    for (const char *p = s; *p; p++)
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f'))) return false;
    return true;
}

/* An array of n positive finite numbers in (lo, hi]. */
static bool read_reals(json_t *a, double lo, double hi, double *out, int n) {
    if (!json_is_array(a) || json_array_size(a) != (size_t)n) return false;
    for (int i = 0; i < n; i++) {
        json_t *v = json_array_get(a, (size_t)i);
        if (!json_is_number(v)) return false;
        out[i] = json_number_value(v);
        if (!(out[i] > lo && out[i] <= hi) || !isfinite(out[i])) return false;
    }
    return true;
}

int pd_curve_file_read(const char *path, pd_curve_file *out, pd_error *err) {
    memset(out, 0, sizeof *out);
    json_error_t je;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return pd_errorf(err, PD_EFORMAT, "%s: not a curve file: %s (line %d); write one with prefixctl calibrate",
                         path, je.text, je.line);
    int rc = PD_OK;
    json_t *obj = json_object_get(root, "object"), *ver = json_object_get(root, "version"),
           *pol = json_object_get(root, "policy"), *model = json_object_get(root, "model"),
           *a = json_object_get(root, "a"), *b = json_object_get(root, "b"), *pts = json_object_get(root, "points"),
           *texts = json_object_get(root, "texts");
    json_t *fp = json_object_get(model, "fingerprint"), *mf = json_object_get(model, "file");
    if (!json_is_string(obj) || strcmp(json_string_value(obj), CURVE_OBJECT) != 0) {
        rc = pd_errorf(err, PD_EFORMAT, "%s: \"object\" is not \"%s\"; write curve files with prefixctl calibrate",
                       path, CURVE_OBJECT);
        goto fail;
    }
    if (!json_is_integer(ver) || json_integer_value(ver) != CURVE_VERSION) {
        rc = pd_errorf(err, PD_EFORMAT, "%s: curve file version %s; this prefixctl reads version %d (calibrate again)",
                       path, json_is_integer(ver) ? "other" : "missing", CURVE_VERSION);
        goto fail;
    }
    pd_policy_spec spec;
    if (!json_is_string(pol) || pd_policy_spec_parse(json_string_value(pol), &spec, err)) {
        rc = pd_error_prefix(err, "%s: \"policy\"", path);
        if (!rc) rc = pd_errorf(err, PD_EFORMAT, "%s: \"policy\" must be a spec string", path);
        goto fail;
    }
    pd_curve_policy_print(&spec, out->policy, sizeof out->policy);
    if (!json_is_string(fp) || !is_hex64(json_string_value(fp)) || !json_is_string(mf)) {
        rc = pd_errorf(err, PD_EFORMAT, "%s: \"model\" must be {\"file\", \"fingerprint\": 64 lower-case hex digits}",
                       path);
        goto fail;
    }
    snprintf(out->fingerprint, sizeof out->fingerprint, "%s", json_string_value(fp));
    snprintf(out->model_file, sizeof out->model_file, "%s", json_string_value(mf));
    out->curve.a = json_number_value(a);
    out->curve.b = json_number_value(b);
    if (!json_is_number(a) || !json_is_number(b) || !(out->curve.a > 0) || !(out->curve.b > 0) ||
        !isfinite(out->curve.a) || !isfinite(out->curve.b)) {
        rc = pd_errorf(err, PD_EFORMAT, "%s: \"a\" and \"b\" must be positive numbers", path);
        goto fail;
    }
    out->n_points = json_is_array(pts) ? (int)json_array_size(pts) : 0;
    if (out->n_points < 1 || out->n_points > PD_CALIB_MAX_POINTS ||
        !read_reals(pts, 0, 1, out->points, out->n_points)) {
        rc = pd_errorf(err, PD_EFORMAT, "%s: \"points\" must be 1 to %d retentions in (0, 1]", path,
                       PD_CALIB_MAX_POINTS);
        goto fail;
    }
    out->holdout = json_number_value(json_object_get(root, "holdout"));
    out->under_weight = json_number_value(json_object_get(root, "under_weight"));
    const size_t nt = json_is_array(texts) ? json_array_size(texts) : 0;
    if (nt == 0 || nt > MAX_SET_FILES || !json_is_integer(json_object_get(root, "n_texts")) ||
        json_integer_value(json_object_get(root, "n_texts")) != (json_int_t)nt) {
        rc = pd_errorf(err, PD_EFORMAT, "%s: \"texts\" must be a non-empty array of \"n_texts\" texts", path);
        goto fail;
    }
    if (!(out->texts = calloc(nt, sizeof *out->texts))) {
        rc = pd_errorf(err, PD_ENOMEM, "%s: out of memory for %zu texts", path, nt);
        goto fail;
    }
    out->n_texts = (int)nt;
    for (size_t t = 0; t < nt; t++) {
        json_t *x = json_array_get(texts, t), *f = json_object_get(x, "file"), *n = json_object_get(x, "tokens");
        pd_curve_text *ct = &out->texts[t];
        ct->nll_full = json_number_value(json_object_get(x, "nll_full"));
        if (!json_is_string(f) || !json_is_integer(n) ||
            !read_reals(json_object_get(x, "ratios"), 0, INFINITY, ct->ratio, out->n_points)) {
            rc = pd_errorf(err, PD_EFORMAT, "%s: texts[%zu] must be {\"file\", \"tokens\", \"nll_full\", \"ratios\": "
                           "one positive ratio per point}", path, t);
            goto fail;
        }
        snprintf(ct->file, sizeof ct->file, "%s", json_string_value(f));
        ct->tokens = (int64_t)json_integer_value(n);
    }
    json_decref(root);
    return PD_OK;
fail:
    pd_curve_file_free(out);
    json_decref(root);
    return rc;
}

int pd_curve_file_check(const pd_curve_file *cf, const pd_policy_spec *spec, const uint8_t fingerprint[PD_SHA256_LEN],
                        pd_error *err) {
    char want[PD_POLICY_SPEC_MAX], hex[2 * PD_SHA256_LEN + 1];
    pd_curve_policy_print(spec, want, sizeof want);
    if (strcmp(want, cf->policy) != 0)
        return pd_errorf(err, PD_EINVAL, "the curve was fitted for policy %s, not %s (retention aside): fit one for "
                         "this policy with prefixctl calibrate", cf->policy, want);
    pd_hex(fingerprint, PD_SHA256_LEN, hex);
    if (strcmp(hex, cf->fingerprint) != 0)
        return pd_errorf(err, PD_EINVAL, "the curve was fitted on model %s (fingerprint %.12s...), not on this one "
                         "(fingerprint %.12s...): fit one for this model with prefixctl calibrate",
                         cf->model_file, cf->fingerprint, hex);
    return PD_OK;
}

/* ---- the calibration set ---------------------------------------------------------- */

typedef struct name_list {
    char **names;
    int n;
} name_list;

static void names_free(name_list *l) {
    for (int i = 0; i < l->n; i++) free(l->names[i]);
    free(l->names);
}

static int cmp_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* The regular files of dir, hidden ones left out, sorted bytewise. */
static int list_set(const char *dir, name_list *out, pd_error *err) {
    memset(out, 0, sizeof *out);
    DIR *d = opendir(dir);
    if (!d) return pd_errorf(err, PD_EIO, "--set %s: %s", dir, strerror(errno));
    int rc = PD_OK, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char path[4096];
        struct stat st;
        if ((size_t)snprintf(path, sizeof path, "%s/%s", dir, e->d_name) >= sizeof path) continue;
        if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) continue;
        if (out->n == MAX_SET_FILES) {
            rc = pd_errorf(err, PD_ERANGE, "--set %s: more than %d files", dir, MAX_SET_FILES);
            break;
        }
        if (out->n == cap) {
            cap = cap ? 2 * cap : 64;
            char **grown = realloc(out->names, sizeof *grown * (size_t)cap);
            if (!grown) {
                rc = pd_errorf(err, PD_ENOMEM, "out of memory listing %s", dir);
                break;
            }
            out->names = grown;
        }
        if (!(out->names[out->n] = strdup(e->d_name))) {
            rc = pd_errorf(err, PD_ENOMEM, "out of memory listing %s", dir);
            break;
        }
        out->n++;
    }
    closedir(d);
    if (rc) {
        names_free(out);
        return rc;
    }
    if (out->n == 0) return pd_errorf(err, PD_EINVAL, "--set %s holds no text files: put the calibration texts there", dir);
    qsort(out->names, (size_t)out->n, sizeof *out->names, cmp_name);
    return PD_OK;
}

/* "0.5,0.25,..." */
static int parse_points(const char *arg, pd_calib_opts *o) {
    int n = 0;
    const char *p = arg;
    while (*p) {
        char *end;
        errno = 0;
        const double v = strtod(p, &end);
        if (errno || end == p || !(v > 0 && v < 1) || n == PD_CALIB_MAX_POINTS || (*end && *end != ',')) {
            fprintf(stderr, "prefixctl calibrate: --points '%s': give 1 to %d retentions in (0, 1) separated by "
                    "commas, e.g. 0.5,0.25,0.125,0.0625\n", arg, PD_CALIB_MAX_POINTS);
            return 2;
        }
        o->points[n++] = v;
        p = *end ? end + 1 : end;
    }
    if (n == 0) {
        fprintf(stderr, "prefixctl calibrate: --points is empty\n");
        return 2;
    }
    o->n_points = n;
    return 0;
}

static int parse_num(const char *opt, const char *arg, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    const double v = strtod(arg, &end);
    if (errno || end == arg || *end || !(v > lo && v < hi)) {
        fprintf(stderr, "prefixctl calibrate: %s wants a number in (%g, %g), got '%s'\n", opt, lo, hi, arg);
        return 2;
    }
    *out = v;
    return 0;
}

static const char *base_name(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

static void calibrate_usage(FILE *f) {
    fputs("usage: prefixctl calibrate --model FILE --policy SPEC --set DIR --out CURVE.json [options]\n"
          "  fit one retention->quality curve on every text file of DIR, for zero-shot use with\n"
          "  prefixctl compress --curve CURVE.json --quality TAU (or the admin API's \"curve\")\n"
          "  --points LIST       retentions measured on every text (default 0.5,0.25,0.125,0.0625)\n"
          "  --holdout F         fraction of each text held out as its continuation (default 0.2)\n"
          "  --under-weight W    weight of under-prediction in the fit (default 4)\n"
          "  --threads N         CPU threads (default: all)\n",
          f);
}

/* Progress over the set: text t of n_texts, and the measurements of it. */
typedef struct set_progress {
    pd_progress line;
    int t, n_texts;
} set_progress;

static int on_measurement(void *ctx, int done, int total, pd_error *err) {
    set_progress *sp = ctx;
    char phase[64];
    snprintf(phase, sizeof phase, "measuring text %d of %d", sp->t + 1, sp->n_texts);
    pd_progress_update(&sp->line, phase, (sp->t + (double)done / (double)(total > 0 ? total : 1)) / sp->n_texts);
    return PD_OK;
}

int pd_calibrate_cli(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},   {"policy", required_argument, 0, 'p'},
        {"set", required_argument, 0, 's'},     {"out", required_argument, 0, 'o'},
        {"points", required_argument, 0, 'P'},  {"holdout", required_argument, 0, 'H'},
        {"under-weight", required_argument, 0, 'W'}, {"threads", required_argument, 0, 'T'},
        {"help", no_argument, 0, 'h'},          {0, 0, 0, 0}};
    const char *model = NULL, *policy = NULL, *set = NULL, *out_path = NULL;
    pd_calib_opts co;
    pd_calib_opts_default(&co);
    long threads = 0;
    int c, rc = PD_OK;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'p': policy = optarg; break;
        case 's': set = optarg; break;
        case 'o': out_path = optarg; break;
        case 'P': if ((rc = parse_points(optarg, &co))) return rc; break;
        case 'H': if ((rc = parse_num("--holdout", optarg, 0, 1, &co.holdout))) return rc; break;
        case 'W': if ((rc = parse_num("--under-weight", optarg, 0, 1e6, &co.under_weight))) return rc; break;
        case 'T': {
            char *end;
            errno = 0;
            threads = strtol(optarg, &end, 10);
            if (errno || end == optarg || *end || threads < 0 || threads > 1024) {
                fprintf(stderr, "prefixctl calibrate: --threads wants an integer in [0, 1024], got '%s'\n", optarg);
                return 2;
            }
            break;
        }
        case 'h': calibrate_usage(stdout); return 0;
        default: calibrate_usage(stderr); return 2;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "prefixctl calibrate: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (!model || !policy || !set || !out_path) {
        fputs("prefixctl calibrate: --model FILE, --policy SPEC, --set DIR and --out CURVE.json are required\n", stderr);
        return 2;
    }
    pd_error err = {0};
    pd_policy_spec spec;
    if (pd_policy_spec_parse(policy, &spec, &err)) {
        fprintf(stderr, "prefixctl calibrate: --policy: %s\n", err.msg);
        return 2;
    }
    if (spec.fair) {
        fputs("prefixctl calibrate: fair=1 needs spans, and calibration texts have none: calibrate the policy "
              "with fair=0\n", stderr);
        return 2;
    }
    name_list names = {0};
    pd_model *m = NULL;
    pd_curve_file cf;
    memset(&cf, 0, sizeof cf);
    double *ratios = NULL;
    pd_token *ids = NULL;
    set_progress sp = {.n_texts = 1};
    pd_progress_init(&sp.line);
    if ((rc = list_set(set, &names, &err))) goto fail;
    sp.n_texts = names.n;
    co.progress = on_measurement;
    co.progress_ctx = &sp;
    pd_progress_update(&sp.line, "loading model", 0);
    pd_model_params mp = {.n_threads = (int)threads};
    if ((rc = pd_model_load(model, &mp, &m, &err))) goto fail;
    if (!(cf.texts = calloc((size_t)names.n, sizeof *cf.texts)) ||
        !(ratios = malloc(sizeof *ratios * (size_t)names.n * (size_t)co.n_points))) {
        rc = pd_errorf(&err, PD_ENOMEM, "out of memory for %d texts", names.n);
        goto fail;
    }
    const double t0 = pd_now_seconds();
    for (int t = 0; t < names.n; t++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", set, names.names[t]);
        char *text = NULL;
        size_t len = 0, n = 0;
        pd_tokenize_opts to = {.add_special = true};
        rc = pd_read_file(path, &text, &len, &err);
        if (!rc) rc = pd_tokenize(pd_model_tokenizer(m), text, len, to, &ids, &n, &err);
        free(text);
        pd_curve_text *ct = &cf.texts[t];
        sp.t = t;
        if (!rc) rc = pd_calib_measure_text(m, ids, (int64_t)n, &spec, &co, ct->ratio, &ct->nll_full, &err);
        free(ids);
        ids = NULL;
        if (rc) {
            pd_error_prefix(&err, "%s", path);
            goto fail;
        }
        snprintf(ct->file, sizeof ct->file, "%s", names.names[t]);
        ct->tokens = (int64_t)n;
        memcpy(ratios + (size_t)t * (size_t)co.n_points, ct->ratio, sizeof(double) * (size_t)co.n_points);
        pd_progress_end(&sp.line); /* stdout may be the same terminal */
        printf("text %s: %zu tokens, continuation NLL %.6f, ratios", names.names[t], n, ct->nll_full);
        for (int i = 0; i < co.n_points; i++) printf(" %g:%.6f", co.points[i], ct->ratio[i]);
        putchar('\n');
        fflush(stdout);
    }
    pd_progress_update(&sp.line, "fitting the curve", 1);
    pd_progress_end(&sp.line);
    cf.n_texts = names.n;
    cf.n_points = co.n_points;
    memcpy(cf.points, co.points, sizeof cf.points);
    cf.holdout = co.holdout;
    cf.under_weight = co.under_weight;
    if ((rc = pd_curve_fit_set(co.points, co.n_points, ratios, names.n, co.under_weight, &cf.curve, &err))) goto fail;
    pd_curve_policy_print(&spec, cf.policy, sizeof cf.policy);
    snprintf(cf.model_file, sizeof cf.model_file, "%s", base_name(model));
    uint8_t fp[PD_SHA256_LEN];
    pd_model_fingerprint(m, fp);
    pd_hex(fp, PD_SHA256_LEN, cf.fingerprint);
    if ((rc = pd_curve_file_write(&cf, out_path, &err))) goto fail;
    printf("policy: %s\n", cf.policy);
    printf("curve over %d texts x %d points: f(r) = 1 + %.6g * (r^-%.6g - 1)\n", cf.n_texts, cf.n_points, cf.curve.a,
           cf.curve.b);
    static const double taus[] = {1.02, 1.05, 1.10};
    printf("zero-shot retention:");
    for (size_t i = 0; i < sizeof taus / sizeof taus[0]; i++)
        printf(" tau %.2f -> %.4f", taus[i], pd_curve_choose(cf.curve, taus[i], co.min_retention));
    printf("\nwrote %s (%.1f s)\n", out_path, pd_now_seconds() - t0);
fail:
    pd_progress_end(&sp.line);
    free(ratios);
    pd_curve_file_free(&cf);
    pd_model_free(m);
    names_free(&names);
    if (rc) {
        fprintf(stderr, "prefixctl calibrate: %s\n", err.msg);
        return 1;
    }
    return 0;
}
