/* policy-eval: how much each KV-cache policy costs in quality, on text the
 * model itself wrote.
 *
 *   policy-eval [MODEL] [--stories K] [--prefix N] [--cont N] [--seed S] [--threads N]
 *
 * K stories are sampled from BOS (temperature 1, seeds S, S+1, ...). Each
 * story's first N tokens are the prefix, the next ones the continuation.
 * For every policy and retention the table gives the NLL ratio
 * NLL(continuation | compressed prefix) / NLL(continuation | full prefix)
 * across stories. The calibration experiment runs pd_calibrate on each
 * prefix alone (its last 20% as probe), compresses the prefix at the chosen
 * retention and measures the ratio on the real continuation; the zero-shot
 * arm instead chooses from one curve fitted offline on K other stories
 * (seeds S + 1000 + i). Markdown on
 * stdout, progress on stderr. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "policies/policies.h"
#include "util/util.h"

#define DEFAULT_MODEL "../shared/models/tinystories/stories260K.gguf"
#define MAX_STORIES 64
#define N_SPANS 4
/* The zero-shot calibration set uses seeds S + this + i: disjoint from the
 * evaluated stories (S .. S + 63). */
#define ZERO_SHOT_SEED_OFFSET 1000

typedef struct story {
    pd_token *ids; /* prefix then continuation */
    int64_t n_prefix, n_cont;
    double nll_full; /* continuation after the full prefix */
} story;

typedef struct eval_ctx {
    pd_model *m;
    story stories[MAX_STORIES];
    int n_stories;
} eval_ctx;

static void usage(FILE *f) {
    fputs("usage: policy-eval [MODEL] [--stories K] [--prefix N] [--cont N] [--seed S] [--threads N]\n"
          "  MODEL           GGUF model (default " DEFAULT_MODEL ")\n"
          "  --stories K     stories sampled from the model (default 8, at most 64)\n"
          "  --prefix N      prefix tokens per story, BOS included (default 400)\n"
          "  --cont N        continuation tokens scored after it (default 100)\n"
          "  --seed S        sampler seed of the first story (default 1; story i uses S + i)\n"
          "  --threads N     CPU threads (default 2)\n",
          f);
}

static int parse_int(const char *opt, const char *arg, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(arg, &end, 10);
    if (errno || end == arg || *end || v < lo || v > hi) {
        fprintf(stderr, "policy-eval: %s wants an integer in [%ld, %ld], got '%s'\n", opt, lo, hi, arg);
        return 2;
    }
    *out = v;
    return 0;
}

/* Sample n tokens after BOS at temperature 1. */
static int sample_story(pd_model *m, uint64_t seed, int64_t n, pd_token *out, pd_error *err) {
    const int32_t V = pd_model_hparams(m)->n_vocab;
    float *logits = malloc(sizeof(float) * (size_t)V);
    if (!logits) return pd_errorf(err, PD_ENOMEM, "out of memory for logits");
    pd_sampler_params sp = pd_sampler_params_default();
    sp.temperature = 1.0f;
    sp.seed = seed;
    sp.penalty_last_n = 0;
    pd_sampler *smp = NULL;
    pd_seq *s = NULL;
    pd_token bos = pd_tokenizer_bos(pd_model_tokenizer(m));
    out[0] = bos == PD_TOKEN_NULL ? 1 : bos;
    int rc = pd_sampler_create(&sp, V, &smp, err);
    if (!rc) rc = pd_seq_create(m, 0, &s, err);
    if (!rc) rc = pd_prefill(m, s, out, 1, NULL, logits, err);
    for (int64_t i = 1; !rc && i < n; i++) {
        pd_sample_result r;
        if ((rc = pd_sampler_sample(smp, logits, &r, err))) break;
        out[i] = r.token;
        if (i + 1 < n) rc = pd_decode(m, &s, &out[i], 1, logits, err);
    }
    pd_seq_free(s);
    pd_sampler_free(smp);
    free(logits);
    return rc;
}

static int full_prefix(pd_model *m, const pd_token *ids, int64_t n, pd_kv_prefix **out, pd_error *err) {
    pd_seq *s = NULL;
    int rc = pd_seq_create(m, 0, &s, err);
    if (!rc) rc = pd_prefill(m, s, ids, n, NULL, NULL, err);
    if (!rc) rc = pd_seq_to_prefix(s, out, err);
    pd_seq_free(s);
    return rc;
}

/* The prefix cut into N_SPANS equal spans (the last takes the remainder). */
static void equal_spans(int64_t n, pd_span *spans) {
    for (int i = 0; i < N_SPANS; i++) {
        memset(&spans[i], 0, sizeof spans[i]);
        snprintf(spans[i].name, sizeof spans[i].name, "part%d", i + 1);
        spans[i].start = n * i / N_SPANS;
        spans[i].end = n * (i + 1) / N_SPANS;
    }
}

static int story_ratio(eval_ctx *e, const story *st, const pd_policy_spec *spec, double *ratio, pd_error *err) {
    pd_span spans[N_SPANS];
    equal_spans(st->n_prefix, spans);
    pd_layout lay = {.spans = spans, .n_spans = N_SPANS};
    pd_kv_prefix *p = NULL;
    double nll = 0;
    int rc = pd_compress_prefix(e->m, st->ids, st->n_prefix, spec, spec->fair ? &lay : NULL, &p, NULL, err);
    if (!rc) rc = pd_nll(e->m, p, NULL, 0, st->ids + st->n_prefix, st->n_cont, &nll, err);
    pd_kv_prefix_free(p);
    if (!rc) *ratio = nll / st->nll_full;
    return rc;
}

typedef struct summary {
    double mean, std, min, max;
} summary;

static summary summarise(const double *x, int n) {
    summary s = {0, 0, INFINITY, -INFINITY};
    for (int i = 0; i < n; i++) {
        s.mean += x[i];
        s.min = fmin(s.min, x[i]);
        s.max = fmax(s.max, x[i]);
    }
    s.mean /= n;
    for (int i = 0; i < n; i++) s.std += (x[i] - s.mean) * (x[i] - s.mean);
    s.std = n > 1 ? sqrt(s.std / (n - 1)) : 0;
    return s;
}

static const double retentions[] = {0.5, 0.25, 0.1};
#define N_RET ((int)(sizeof retentions / sizeof retentions[0]))

static int policy_table(eval_ctx *e, pd_error *err) {
    /* The 13 policies with their defaults, then fair eviction over 4 equal spans. */
    const char *specs[PD_POLICY_COUNT + 2];
    int n_specs = 0;
    for (int k = 0; k < PD_POLICY_COUNT; k++) specs[n_specs++] = pd_policy_kind_name((pd_policy_kind)k);
    specs[n_specs++] = "snapkv:fair=1";
    specs[n_specs++] = "compactor:fair=1";
    printf("| policy | retention 0.5 | retention 0.25 | retention 0.1 |\n|---|---|---|---|\n");
    double ratios[MAX_STORIES];
    for (int i = 0; i < n_specs; i++) {
        pd_policy_spec spec;
        int rc = pd_policy_spec_parse(specs[i], &spec, err);
        if (rc) return rc;
        printf("| `%s` |", specs[i]);
        for (int r = 0; r < N_RET; r++) {
            pd_policy_spec_set_retention(&spec, retentions[r]);
            for (int s = 0; s < e->n_stories; s++)
                if ((rc = story_ratio(e, &e->stories[s], &spec, &ratios[s], err)))
                    return pd_error_prefix(err, "%s at retention %g, story %d", specs[i], retentions[r], s);
            summary sm = summarise(ratios, e->n_stories);
            printf(" %.3f ± %.3f [%.3f, %.3f] |", sm.mean, sm.std, sm.min, sm.max);
        }
        putchar('\n');
        fflush(stdout);
        fprintf(stderr, "policy-eval: %s done\n", specs[i]);
    }
    return PD_OK;
}

/* The zero-shot arm's calibration set: stories sampled with seeds
 * cal_seed, cal_seed + 1, ... (disjoint from the evaluated ones), as long
 * as the evaluated stories (prefix + continuation). */
static int sample_calibration_set(eval_ctx *e, uint64_t cal_seed, pd_token **set, pd_error *err) {
    const int64_t n = e->stories[0].n_prefix + e->stories[0].n_cont;
    for (int s = 0; s < e->n_stories; s++) {
        if (!(set[s] = malloc(sizeof **set * (size_t)n)))
            return pd_errorf(err, PD_ENOMEM, "out of memory for calibration story %d", s);
        int rc = sample_story(e->m, cal_seed + (uint64_t)s, n, set[s], err);
        if (rc) return pd_error_prefix(err, "calibration story %d", s);
    }
    return PD_OK;
}

/* Offline calibration (the Compactor paper's setting): one curve fitted on
 * the calibration set, each story's continuation held out after its
 * prefix, exactly the evaluated stories' split. */
static int fit_zero_shot(eval_ctx *e, pd_token *const *set, const pd_policy_spec *spec, const pd_calib_opts *o,
                         pd_curve *curve, pd_error *err) {
    const int64_t n = e->stories[0].n_prefix + e->stories[0].n_cont;
    pd_calib_opts mo = *o;
    mo.holdout = (double)e->stories[0].n_cont / (double)n;
    double ratios[MAX_STORIES * PD_CALIB_MAX_POINTS];
    for (int s = 0; s < e->n_stories; s++) {
        int rc = pd_calib_measure_text(e->m, set[s], n, spec, &mo, ratios + s * mo.n_points, NULL, err);
        if (rc) return pd_error_prefix(err, "calibration story %d", s);
    }
    return pd_curve_fit_set(mo.points, mo.n_points, ratios, e->n_stories, mo.under_weight, curve, err);
}

typedef struct arm_stats {
    int hits;
    double chosen_sum, measured_sum, measured_max, probe_sum;
} arm_stats;

static void print_arm(const char *spec, double tau, const char *arm, const arm_stats *a, int k, bool probe) {
    printf("| `%s` | %.2f | %s | %d/%d | %.3f | %.4f | %.4f |", spec, tau, arm, a->hits, k, a->chosen_sum / k,
           a->measured_sum / k, a->measured_max);
    if (probe) printf(" %.4f |\n", a->probe_sum / k);
    else printf(" — |\n");
}

static int calibration_table(eval_ctx *e, uint64_t cal_seed, pd_error *err) {
    static const double taus[] = {1.02, 1.05, 1.10};
    static const char *const specs[] = {"compactor", "snapkv", "knorm"};
    pd_token *set[MAX_STORIES] = {0};
    int rc = sample_calibration_set(e, cal_seed, set, err);
    printf("| policy | tau | calibration | hit rate (measured <= tau) | mean chosen retention | mean measured ratio | "
           "max measured ratio | mean probe ratio at the choice |\n|---|---|---|---|---|---|---|---|\n");
    for (size_t p = 0; !rc && p < sizeof specs / sizeof specs[0]; p++) {
        pd_policy_spec spec;
        pd_curve curve;
        pd_calib_opts o;
        pd_calib_opts_default(&o);
        o.holdout = 0.2;
        if ((rc = pd_policy_spec_parse(specs[p], &spec, err))) break;
        if ((rc = fit_zero_shot(e, set, &spec, &o, &curve, err))) {
            pd_error_prefix(err, "zero-shot curve of %s", specs[p]);
            break;
        }
        fprintf(stderr, "policy-eval: zero-shot curve of %s: a %.6g, b %.6g\n", specs[p], curve.a, curve.b);
        for (size_t t = 0; !rc && t < sizeof taus / sizeof taus[0]; t++) {
            o.tau = taus[t];
            arm_stats probe = {0}, zero = {0};
            const double zero_chosen = pd_curve_choose(curve, taus[t], o.min_retention);
            pd_policy_spec zero_spec = spec;
            pd_policy_spec_set_retention(&zero_spec, zero_chosen);
            for (int s = 0; s < e->n_stories; s++) {
                const story *st = &e->stories[s];
                pd_calib_result cr;
                pd_policy_spec chosen;
                double ratio = 0, zero_ratio = 0;
                rc = pd_calibrate(e->m, st->ids, st->n_prefix, &spec, NULL, &o, &cr, &chosen, err);
                if (!rc) rc = story_ratio(e, st, &chosen, &ratio, err);
                if (!rc) rc = story_ratio(e, st, &zero_spec, &zero_ratio, err);
                if (rc) {
                    pd_error_prefix(err, "calibration of %s, tau %g, story %d", specs[p], taus[t], s);
                    break;
                }
                probe.hits += ratio <= taus[t];
                probe.chosen_sum += cr.chosen;
                probe.measured_sum += ratio;
                probe.measured_max = fmax(probe.measured_max, ratio);
                probe.probe_sum += cr.measured;
                zero.hits += zero_ratio <= taus[t];
                zero.chosen_sum += zero_chosen;
                zero.measured_sum += zero_ratio;
                zero.measured_max = fmax(zero.measured_max, zero_ratio);
            }
            if (rc) break;
            print_arm(specs[p], taus[t], "probe", &probe, e->n_stories, true);
            print_arm(specs[p], taus[t], "zero-shot", &zero, e->n_stories, false);
            fflush(stdout);
        }
        if (!rc) fprintf(stderr, "policy-eval: calibration of %s done\n", specs[p]);
    }
    for (int s = 0; s < e->n_stories; s++) free(set[s]);
    return rc;
}

int main(int argc, char **argv) {
    static const struct option opts[] = {
        {"stories", required_argument, 0, 'k'}, {"prefix", required_argument, 0, 'p'},
        {"cont", required_argument, 0, 'c'},    {"seed", required_argument, 0, 's'},
        {"threads", required_argument, 0, 'T'}, {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    long k = 8, n_prefix = 400, n_cont = 100, seed = 1, threads = 2;
    int c, rc;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'k': if ((rc = parse_int("--stories", optarg, 1, MAX_STORIES, &k))) return rc; break;
        case 'p': if ((rc = parse_int("--prefix", optarg, 64, 1 << 20, &n_prefix))) return rc; break;
        case 'c': if ((rc = parse_int("--cont", optarg, 2, 1 << 20, &n_cont))) return rc; break;
        case 's': if ((rc = parse_int("--seed", optarg, 0, INT32_MAX, &seed))) return rc; break;
        case 'T': if ((rc = parse_int("--threads", optarg, 0, 1024, &threads))) return rc; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (argc - optind > 1) {
        usage(stderr);
        return 2;
    }
    const char *path = optind < argc ? argv[optind] : DEFAULT_MODEL;
    pd_error err = {0};
    eval_ctx e;
    memset(&e, 0, sizeof e);
    pd_model_params mp = {.n_threads = (int)threads};
    if ((rc = pd_model_load(path, &mp, &e.m, &err))) {
        fprintf(stderr, "policy-eval: %s\n", err.msg);
        return 1;
    }
    const int32_t ctx = pd_model_hparams(e.m)->n_ctx_train;
    if (n_prefix + n_cont > ctx) {
        fprintf(stderr, "policy-eval: prefix %ld + continuation %ld tokens exceed the context of %d\n", n_prefix,
                n_cont, ctx);
        pd_model_free(e.m);
        return 2;
    }
    const double t0 = pd_now_seconds();
    double nll_sum = 0;
    for (int s = 0; !rc && s < k; s++) {
        story *st = &e.stories[s];
        st->n_prefix = n_prefix;
        st->n_cont = n_cont;
        pd_kv_prefix *full = NULL;
        if (!(st->ids = malloc(sizeof *st->ids * (size_t)(n_prefix + n_cont)))) {
            rc = pd_errorf(&err, PD_ENOMEM, "out of memory for story %d", s);
            break;
        }
        e.n_stories++;
        rc = sample_story(e.m, (uint64_t)(seed + s), n_prefix + n_cont, st->ids, &err);
        if (!rc) rc = full_prefix(e.m, st->ids, n_prefix, &full, &err);
        if (!rc) rc = pd_nll(e.m, full, NULL, 0, st->ids + n_prefix, n_cont, &st->nll_full, &err);
        pd_kv_prefix_free(full);
        nll_sum += st->nll_full;
    }
    if (!rc) {
        printf("Model `%s`, %d stories sampled at temperature 1 (seeds %ld..%ld), prefix %ld tokens (BOS "
               "included), continuation %ld tokens; mean continuation NLL after the full prefix %.4f nats/token.\n\n",
               path, e.n_stories, seed, seed + k - 1, n_prefix, n_cont, nll_sum / e.n_stories);
        printf("NLL ratio NLL(continuation | compressed prefix) / NLL(continuation | full prefix): mean ± std "
               "[min, max] over the stories. `fair=1` variants use 4 equal spans (debias=1, local=1).\n\n");
        rc = policy_table(&e, &err);
    }
    if (!rc) {
        printf("\nCalibration: `probe` runs pd_calibrate on the prefix alone (its last 20%% as probe, points 0.5, "
               "0.25, 0.125, 0.0625, min retention 0.05, under-prediction weight 4); `zero-shot` chooses from one "
               "curve per policy fitted offline (pd_curve_fit_set, same points and weight) on %ld other stories "
               "(seeds %ld..%ld), each split into the same prefix and continuation. Either way the prefix is then "
               "compressed at the chosen retention and the ratio measured on the real continuation.\n\n",
               k, seed + ZERO_SHOT_SEED_OFFSET, seed + ZERO_SHOT_SEED_OFFSET + k - 1);
        rc = calibration_table(&e, (uint64_t)(seed + ZERO_SHOT_SEED_OFFSET), &err);
    }
    if (!rc) fprintf(stderr, "policy-eval: %.1f s\n", pd_now_seconds() - t0);
    for (int s = 0; s < e.n_stories; s++) free(e.stories[s].ids);
    pd_model_free(e.m);
    if (rc) {
        fprintf(stderr, "policy-eval: %s\n", err.msg);
        return 1;
    }
    return 0;
}
