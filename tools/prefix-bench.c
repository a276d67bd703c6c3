/* prefix-bench: throughput of the engine on a real or generated model.
 *
 *   prefix-bench [--model FILE | --preset NAME [--type T] [--n-vocab N]]
 *                [--threads 1,2] [--prompt 256] [--gen 64] [--reps 3] [--json]
 *
 * Prefill: tokens/s to run a prompt of --prompt tokens from an empty
 * sequence (logits of the last token included). Decode: tokens/s of --gen
 * single-token steps after that prompt. Each figure is the best of --reps
 * runs, after one warm-up run. A generated model is written once to
 * $TMPDIR and reused while its options stay the same. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine/engine.h"
#include "tools/tools.h"

static void usage(FILE *f) {
    fputs("usage: prefix-bench [--model FILE | --preset NAME [--type T] [--n-vocab N] [--seed S]]\n"
          "                    [--threads LIST] [--prompt N] [--gen N] [--reps N] [--json]\n"
          "  --preset    generate a model: tiny, stories260k, smollm2-135m, llama-3.2-1b, qwen2.5-0.5b\n"
          "  --type      weight type of the generated model (default q8_0)\n"
          "  --threads   comma-separated thread counts to measure (default 1,2)\n"
          "  --prompt    prompt tokens for prefill (default 256)\n"
          "  --gen       decode steps (default 64)\n"
          "  --reps      runs per figure, best kept (default 3)\n",
          f);
}

typedef struct bench_result {
    double prefill_tps, decode_tps;
} bench_result;

static int run_once(pd_model *m, int n_prompt, int n_gen, bench_result *r, pd_error *err) {
    const pd_hparams *hp = pd_model_hparams(m);
    pd_token *toks = malloc(sizeof(pd_token) * (size_t)n_prompt);
    float *logits = malloc(sizeof(float) * (size_t)hp->n_vocab);
    pd_seq *s = NULL;
    int rc = toks && logits ? PD_OK : pd_errorf(err, PD_ENOMEM, "out of memory");
    if (!rc) rc = pd_seq_create(m, n_prompt + n_gen + 1, &s, err);
    if (!rc) {
        for (int i = 0; i < n_prompt; i++) toks[i] = (pd_token)((i * 7919 + 13) % hp->n_vocab);
        double t0 = pd_now_seconds();
        rc = pd_prefill(m, s, toks, n_prompt, NULL, logits, err);
        double t1 = pd_now_seconds();
        r->prefill_tps = n_prompt / (t1 - t0);
        pd_token t = toks[0];
        double t2 = pd_now_seconds();
        for (int i = 0; !rc && i < n_gen; i++) {
            rc = pd_decode(m, &s, &t, 1, logits, err);
            t = (pd_token)((t * 31 + 7) % hp->n_vocab);
        }
        double t3 = pd_now_seconds();
        r->decode_tps = n_gen / (t3 - t2);
    }
    pd_seq_free(s);
    free(toks);
    free(logits);
    return rc;
}

int main(int argc, char **argv) {
    pd_cpu_prepare_process(argv);
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},   {"preset", required_argument, 0, 'p'},
        {"type", required_argument, 0, 't'},    {"n-vocab", required_argument, 0, 'v'},
        {"seed", required_argument, 0, 's'},    {"threads", required_argument, 0, 'T'},
        {"prompt", required_argument, 0, 'P'},  {"gen", required_argument, 0, 'g'},
        {"reps", required_argument, 0, 'r'},    {"json", no_argument, 0, 'j'},
        {"help", no_argument, 0, 'h'},          {0, 0, 0, 0}};
    const char *model = NULL, *preset = NULL, *type_name = "q8_0", *threads = "1,2";
    long n_vocab = 0, seed = 1, n_prompt = 256, n_gen = 64, reps = 3;
    bool json = false;
    int c;
    while ((c = getopt_long(argc, argv, "m:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'p': preset = optarg; break;
        case 't': type_name = optarg; break;
        case 'v': n_vocab = strtol(optarg, NULL, 10); break;
        case 's': seed = strtol(optarg, NULL, 10); break;
        case 'T': threads = optarg; break;
        case 'P': n_prompt = strtol(optarg, NULL, 10); break;
        case 'g': n_gen = strtol(optarg, NULL, 10); break;
        case 'r': reps = strtol(optarg, NULL, 10); break;
        case 'j': json = true; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (!model == !preset || n_prompt < 1 || n_gen < 1 || reps < 1) {
        usage(stderr);
        return 2;
    }
    pd_error err = {0};
    char gen_path[1024];
    if (preset) {
        pd_testmodel_opts o;
        pd_type type;
        if (pd_testmodel_preset(preset, &o, &err) || pd_type_from_name(type_name, &type, &err)) {
            fprintf(stderr, "prefix-bench: %s\n", err.msg);
            return 2;
        }
        o.wtype = type;
        o.seed = (uint64_t)seed;
        if (n_vocab > 0) o.n_vocab = (uint32_t)n_vocab;
        const char *tmp = getenv("TMPDIR");
        snprintf(gen_path, sizeof gen_path, "%s/prefix-bench-%s-%s-v%ld-s%ld.gguf", tmp && *tmp ? tmp : "/tmp", preset,
                 type_name, n_vocab, seed);
        if (access(gen_path, R_OK) != 0) {
            fprintf(stderr, "prefix-bench: generating %s\n", gen_path);
            if (pd_testmodel_write(&o, gen_path, NULL, &err)) {
                fprintf(stderr, "prefix-bench: %s\n", err.msg);
                return 1;
            }
        }
        model = gen_path;
    }

    if (json) printf("[");
    bool first = true;
    for (const char *p = threads; *p;) {
        char *end;
        long nt = strtol(p, &end, 10);
        if (end == p || nt < 1) {
            fprintf(stderr, "prefix-bench: bad --threads list '%s'\n", threads);
            return 2;
        }
        p = *end == ',' ? end + 1 : end;
        pd_model *m = NULL;
        pd_model_params mp = {.n_threads = (int)nt};
        if (pd_model_load(model, &mp, &m, &err)) {
            fprintf(stderr, "prefix-bench: %s\n", err.msg);
            return 1;
        }
        const pd_hparams *hp = pd_model_hparams(m);
        bench_result best = {0}, r;
        if (run_once(m, (int)n_prompt, (int)n_gen, &r, &err)) { /* warm-up */
            fprintf(stderr, "prefix-bench: %s\n", err.msg);
            return 1;
        }
        for (long i = 0; i < reps; i++) {
            if (run_once(m, (int)n_prompt, (int)n_gen, &r, &err)) {
                fprintf(stderr, "prefix-bench: %s\n", err.msg);
                return 1;
            }
            if (r.prefill_tps > best.prefill_tps) best.prefill_tps = r.prefill_tps;
            if (r.decode_tps > best.decode_tps) best.decode_tps = r.decode_tps;
        }
        const char *tname = pd_type_get(hp->wtype)->name;
        if (json) {
            printf("%s\n  {\"model\": \"%s\", \"type\": \"%s\", \"threads\": %ld, \"simd\": \"%s\", \"prompt\": %ld, "
                   "\"gen\": %ld, \"prefill_tps\": %.1f, \"decode_tps\": %.1f}",
                   first ? "" : ",", model, tname, nt, pd_cpu_simd_name(), n_prompt, n_gen, best.prefill_tps,
                   best.decode_tps);
        } else {
            if (first)
                printf("%-10s %-6s %-7s %-10s %14s %14s\n", "model", "type", "threads", "simd", "prefill tok/s",
                       "decode tok/s");
            printf("%-10s %-6s %-7ld %-10s %14.1f %14.1f\n", preset ? preset : "file", tname, nt, pd_cpu_simd_name(),
                   best.prefill_tps, best.decode_tps);
        }
        first = false;
        pd_model_free(m);
    }
    if (json) printf("\n]\n");
    return 0;
}
