/* prefixctl: the admin command-line tool.
 *
 *   prefixctl inspect FILE
 *   prefixctl tokenize --model FILE [--no-bos] [--special]     < text
 *   prefixctl detokenize --model FILE [--special] [--keep-leading-space] < ids
 *   prefixctl generate --model FILE --prompt TEXT [-n N] [--greedy | --temp T --seed S] [--ids] [--device D]
 *   prefixctl nll --model FILE --context TEXT --text TEXT [--device D]
 *   prefixctl perplexity --model FILE --file TEXT --ctx N [--chunks K] [--device D]
 *   prefixctl compress --model FILE --policy SPEC [--retention R | --quality TAU] --text FILE [--device D] ...
 *   prefixctl calibrate --model FILE --policy SPEC --set DIR --out CURVE.json [--points LIST] [--threads N]
 *   prefixctl policies
 *   prefixctl store --dir DIR list|show ID|verify [--repair]|delete ID|pin ID|unpin ID|stats
 *   prefixctl prefix [--url URL] [--token T] add|list|show ID|delete ID|job ID
 *   prefixctl gen-model [options] -o OUT.gguf
 *   prefixctl cuda-info
 */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cache/cache.h"
#include "engine/engine.h"
#include "kernels/kernels.h"
#include "policies/policies.h"
#include "tools/tools.h"
#include "util/util.h"

static void usage(FILE *f) {
    fputs("usage: prefixctl COMMAND [options]\n"
          "\n"
          "commands:\n"
          "  inspect FILE [--items N]      print GGUF metadata and tensor table\n"
          "  tokenize --model FILE         read text on stdin, print token ids\n"
          "      [--no-bos]                do not add BOS/EOS even if the vocab asks for them\n"
          "      [--special]               parse control tokens written as text (\"<|im_end|>\")\n"
          "  detokenize --model FILE       read token ids on stdin, write the exact bytes\n"
          "      [--special]               render control tokens as their text\n"
          "      [--keep-leading-space]    keep the space SentencePiece adds before the text\n"
          "  generate --model FILE --prompt TEXT\n"
          "      [-n N]                    tokens to generate (default 64)\n"
          "      [--greedy | --temp T]     greedy (default) or sampling at temperature T\n"
          "      [--top-k K] [--top-p P] [--min-p P] [--seed S]\n"
          "      [--stop TEXT]...          stop strings\n"
          "      [--ids]                   print token ids instead of text\n"
          "      [--threads N]             CPU threads (default: all)\n"
          "      [--device D]              cpu (default), cuda, cuda:N or auto\n"
          "      [--kv-type f16|f32]       KV cache element type (default f16: half the memory)\n"
          "  nll --model FILE --context TEXT --text TEXT\n"
          "                                mean negative log-likelihood of TEXT after CONTEXT\n"
          "      [--threads N] [--device D] [--kv-type T]  as for generate\n"
          "  perplexity --model FILE --file TEXT --ctx N\n"
          "                                perplexity of a text file as llama-perplexity -f TEXT -c N\n"
          "                                measures it; prints it on stdout, llama's summary on stderr\n"
          "      [--chunks K]              score at most K chunks of N tokens (default: all)\n"
          "      [--threads N] [--device D] [--kv-type T]  as for generate\n"
          "  compress --model FILE --policy SPEC --text FILE\n"
          "                                compress the text's KV cache with a policy and report it\n"
          "      [--retention R]           fraction of tokens kept, in (0, 1] (overrides the spec's)\n"
          "      [--quality TAU]           or choose the retention: NLL ratio at most TAU (> 1)\n"
          "      [--holdout F]             --quality: fraction of the text held out as probe (default 0.2)\n"
          "      [--curve CURVE.json]      --quality: choose the retention zero-shot from a curve fitted\n"
          "                                by prefixctl calibrate (no probe measurement)\n"
          "      [--spans FILE|auto]       named spans and kept ranges (\"name start end [keep]\" lines),\n"
          "                                or auto: split at turns, paragraphs, else sentences\n"
          "      [--keep-text PHRASE]...   always keep the tokens of every occurrence of PHRASE\n"
          "      [--eval FILE]             mean NLL of this continuation, full vs compressed prefix\n"
          "      [--threads N]             CPU threads (default: all)\n"
          "      [--device D]              cpu (default), cuda, cuda:N or auto\n"
          "      [--kv-type f16|f32]       KV cache element type (default f16)\n"
          "      [--store DIR]             also write the compressed prefix into the store at DIR\n"
          "      [--namespace NS] [--dtype f32|f16|bf16] [--pin]   how it is stored (default f16)\n"
          "      [--json]                  print one JSON object (spec, kept fractions per layer, head\n"
          "                                and span, calibration, eval) instead of the report\n"
          "  compress --list | policies    list the policies with their keys and defaults\n"
          "  calibrate --model FILE --policy SPEC --set DIR --out CURVE.json\n"
          "                                fit one retention->quality curve on a set of texts (--help)\n"
          "  store --dir DIR ACTION        inspect and maintain a prefix store (--help for actions)\n"
          "  prefix ACTION                 register and manage prefixes through a running prefixd's\n"
          "                                admin API (--help for actions)\n"
          "  gen-model [options] -o OUT    write a seeded random GGUF model (--help for options)\n"
          "  cuda-info                     list CUDA devices (memory, bandwidth); cuBLAS and kernel self-tests\n",
          f);
}

static int fail(const pd_error *err) {
    fprintf(stderr, "prefixctl: %s\n", err->msg);
    return 1;
}

static int cmd_inspect(int argc, char **argv) {
    static const struct option opts[] = {{"items", required_argument, 0, 'n'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    size_t items = 8;
    int c;
    while ((c = getopt_long(argc, argv, "n:h", opts, NULL)) != -1) {
        if (c == 'n') items = strtoul(optarg, NULL, 10);
        else {
            usage(c == 'h' ? stdout : stderr);
            return c == 'h' ? 0 : 2;
        }
    }
    if (optind != argc - 1) {
        fputs("prefixctl inspect: expected exactly one GGUF file\n", stderr);
        return 2;
    }
    pd_gguf *g = NULL;
    pd_error err;
    if (pd_gguf_open(argv[optind], &g, &err)) return fail(&err);
    pd_gguf_print(g, stdout, items);
    pd_gguf_close(g);
    return 0;
}

typedef struct tok_args {
    const char *model;
    bool no_bos, special, keep_space;
} tok_args;

static int parse_tok_args(int argc, char **argv, tok_args *a) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'}, {"no-bos", no_argument, 0, 'b'},
        {"special", no_argument, 0, 's'},     {"keep-leading-space", no_argument, 0, 'k'},
        {"help", no_argument, 0, 'h'},        {0, 0, 0, 0}};
    int c;
    memset(a, 0, sizeof *a);
    while ((c = getopt_long(argc, argv, "m:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': a->model = optarg; break;
        case 'b': a->no_bos = true; break;
        case 's': a->special = true; break;
        case 'k': a->keep_space = true; break;
        case 'h': usage(stdout); return 1;
        default: usage(stderr); return 2;
        }
    }
    if (!a->model) {
        fprintf(stderr, "prefixctl %s: --model FILE is required\n", argv[0]);
        return 2;
    }
    if (optind != argc) {
        fprintf(stderr, "prefixctl %s: unexpected argument '%s' (input is read from stdin)\n", argv[0], argv[optind]);
        return 2;
    }
    return 0;
}

static int load_tokenizer(const char *path, pd_tokenizer **tok, pd_error *err) {
    pd_gguf *g = NULL;
    int rc = pd_gguf_open(path, &g, err);
    if (rc) return rc;
    rc = pd_tokenizer_load(g, tok, err);
    if (rc) pd_error_prefix(err, "%s", path);
    pd_gguf_close(g);
    return rc;
}

static int cmd_tokenize(int argc, char **argv) {
    tok_args a;
    int rc = parse_tok_args(argc, argv, &a);
    if (rc) return rc == 1 ? 0 : rc;
    pd_error err;
    pd_tokenizer *tok = NULL;
    if (load_tokenizer(a.model, &tok, &err)) return fail(&err);
    char *text = NULL;
    size_t len = 0;
    if (pd_read_stream(stdin, &text, &len, &err)) {
        pd_tokenizer_free(tok);
        return fail(&err);
    }
    pd_token *ids = NULL;
    size_t n = 0;
    pd_tokenize_opts opts = {.add_special = !a.no_bos, .parse_special = a.special};
    rc = pd_tokenize(tok, text, len, opts, &ids, &n, &err);
    free(text);
    pd_tokenizer_free(tok);
    if (rc) return fail(&err);
    for (size_t i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
    putchar('\n');
    free(ids);
    return 0;
}

static int parse_ids(const char *text, pd_token **out, size_t *n_out, pd_error *err) {
    size_t cap = 64, n = 0;
    pd_token *ids = malloc(cap * sizeof *ids);
    if (!ids) return pd_errorf(err, PD_ENOMEM, "out of memory");
    const char *p = text;
    for (;;) {
        while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r' || *p == ',') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX) {
            free(ids);
            return pd_errorf(err, PD_EINVAL, "input position %zu: '%.20s' is not a token id", (size_t)(p - text), p);
        }
        if (n == cap) {
            pd_token *nid = realloc(ids, 2 * cap * sizeof *ids);
            if (!nid) {
                free(ids);
                return pd_errorf(err, PD_ENOMEM, "out of memory");
            }
            ids = nid;
            cap *= 2;
        }
        ids[n++] = (pd_token)v;
        p = end;
    }
    *out = ids;
    *n_out = n;
    return PD_OK;
}

static int cmd_detokenize(int argc, char **argv) {
    tok_args a;
    int rc = parse_tok_args(argc, argv, &a);
    if (rc) return rc == 1 ? 0 : rc;
    pd_error err;
    pd_tokenizer *tok = NULL;
    if (load_tokenizer(a.model, &tok, &err)) return fail(&err);
    char *text = NULL;
    pd_token *ids = NULL;
    size_t n = 0, len = 0;
    char *out = NULL;
    rc = pd_read_stream(stdin, &text, NULL, &err);
    if (!rc) rc = parse_ids(text, &ids, &n, &err);
    if (!rc) rc = pd_detokenize(tok, ids, n, a.special, !a.keep_space, &out, &len, &err);
    if (!rc) fwrite(out, 1, len, stdout);
    free(out);
    free(ids);
    free(text);
    pd_tokenizer_free(tok);
    return rc ? fail(&err) : 0;
}

static int parse_long(const char *opt, const char *arg, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(arg, &end, 10);
    if (errno || end == arg || *end || v < lo || v > hi) {
        fprintf(stderr, "prefixctl: %s wants an integer in [%ld, %ld], got '%s'\n", opt, lo, hi, arg);
        return 2;
    }
    *out = v;
    return 0;
}

static int parse_float(const char *opt, const char *arg, float *out) {
    char *end;
    errno = 0;
    float v = strtof(arg, &end);
    if (errno || end == arg || *end) {
        fprintf(stderr, "prefixctl: %s wants a number, got '%s'\n", opt, arg);
        return 2;
    }
    *out = v;
    return 0;
}

/* --device D for the commands that load a model. */
static int parse_device_opt(const char *cmd, const char *arg, pd_device *out) {
    pd_error err = {0};
    if (pd_device_parse(arg, out, &err)) {
        fprintf(stderr, "prefixctl %s: --device: %s\n", cmd, err.msg);
        return 2;
    }
    return 0;
}

/* --kv-type f16|f32 for the commands that load a model. */
static int parse_kv_type_opt(const char *cmd, const char *arg, bool *kv_f32) {
    if (strcmp(arg, "f16") != 0 && strcmp(arg, "f32") != 0) {
        fprintf(stderr, "prefixctl %s: --kv-type '%s': use f16 (the default) or f32\n", cmd, arg);
        return 2;
    }
    *kv_f32 = strcmp(arg, "f32") == 0;
    return 0;
}

/* Create the backend `dev` names, then load the model onto it with KV rows
 * in f16, or f32 with kv_f32. The model borrows the backend: free the model
 * first, then the backend. On failure nothing is left to free. */
static int load_model_on(const char *path, const pd_device *dev, int threads, bool kv_f32, pd_backend **be,
                         pd_model **m, pd_error *err) {
    *be = NULL;
    *m = NULL;
    int rc = pd_backend_create(dev, threads, be, err);
    if (rc) {
        char name[16];
        pd_device_format(dev, name, sizeof name);
        pd_error_prefix(err, "--device %s", name);
        return rc;
    }
    pd_model_params mp = {.n_threads = threads, .backend = *be, .kv_f32 = kv_f32};
    rc = pd_model_load(path, &mp, m, err);
    if (rc) {
        pd_backend_free(*be);
        *be = NULL;
    }
    return rc;
}

static int tokenize_text(const pd_tokenizer *tok, const char *text, bool add_special, pd_token **ids, size_t *n,
                         pd_error *err) {
    pd_tokenize_opts o = {.add_special = add_special};
    return pd_tokenize(tok, text, strlen(text), o, ids, n, err);
}

#define MAX_STOPS 16

static int cmd_generate(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'}, {"prompt", required_argument, 0, 'p'},
        {"greedy", no_argument, 0, 'G'},      {"temp", required_argument, 0, 't'},
        {"top-k", required_argument, 0, 'k'}, {"top-p", required_argument, 0, 'P'},
        {"min-p", required_argument, 0, 'M'}, {"seed", required_argument, 0, 's'},
        {"stop", required_argument, 0, 'S'},  {"ids", no_argument, 0, 'i'},
        {"threads", required_argument, 0, 'T'}, {"device", required_argument, 0, 'd'},
        {"kv-type", required_argument, 0, 'K'}, {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    const char *model = NULL, *prompt = NULL;
    pd_device device = {.kind = PD_DEVICE_CPU};
    bool kv_f32 = false;
    const char *stops[MAX_STOPS];
    size_t n_stops = 0;
    long n_predict = 64, threads = 0, v;
    bool ids_out = false;
    pd_sampler_params sp = pd_sampler_params_default();
    sp.temperature = 0.0f;
    sp.seed = 1;
    int c, rc = PD_OK;
    while ((c = getopt_long(argc, argv, "m:p:n:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'p': prompt = optarg; break;
        case 'n': if ((rc = parse_long("-n", optarg, 1, 1 << 20, &n_predict))) return rc; break;
        case 'G': sp.temperature = 0.0f; break;
        case 't': if ((rc = parse_float("--temp", optarg, &sp.temperature))) return rc; break;
        case 'k': if ((rc = parse_long("--top-k", optarg, 0, INT32_MAX, &v))) return rc; sp.top_k = (int32_t)v; break;
        case 'P': if ((rc = parse_float("--top-p", optarg, &sp.top_p))) return rc; break;
        case 'M': if ((rc = parse_float("--min-p", optarg, &sp.min_p))) return rc; break;
        case 's': if ((rc = parse_long("--seed", optarg, 0, INT64_MAX, &v))) return rc; sp.seed = (uint64_t)v; break;
        case 'S':
            if (n_stops == MAX_STOPS) {
                fprintf(stderr, "prefixctl generate: at most %d --stop strings\n", MAX_STOPS);
                return 2;
            }
            stops[n_stops++] = optarg;
            break;
        case 'i': ids_out = true; break;
        case 'T': if ((rc = parse_long("--threads", optarg, 0, 1024, &threads))) return rc; break;
        case 'd': if ((rc = parse_device_opt("generate", optarg, &device))) return rc; break;
        case 'K': if ((rc = parse_kv_type_opt("generate", optarg, &kv_f32))) return rc; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (!model || !prompt || optind != argc) {
        fputs("prefixctl generate: --model FILE and --prompt TEXT are required\n", stderr);
        return 2;
    }
    pd_error err = {0};
    pd_model *m = NULL;
    pd_backend *be = NULL;
    if (load_model_on(model, &device, (int)threads, kv_f32, &be, &m, &err)) return fail(&err);
    const pd_tokenizer *tok = pd_model_tokenizer(m);
    const int32_t V = pd_model_hparams(m)->n_vocab;
    pd_token *ids = NULL;
    size_t n_ids = 0;
    pd_seq *seq = NULL;
    pd_sampler *smp = NULL;
    pd_generation *gen = NULL;
    float *logits = malloc(sizeof(float) * (size_t)V);
    rc = logits ? PD_OK : pd_errorf(&err, PD_ENOMEM, "out of memory");
    if (!rc) rc = tokenize_text(tok, prompt, true, &ids, &n_ids, &err);
    if (!rc && n_ids == 0) rc = pd_errorf(&err, PD_EINVAL, "the prompt is empty and the model adds no BOS token");
    if (!rc) rc = pd_seq_create(m, 0, &seq, &err);
    if (!rc) rc = pd_sampler_create(&sp, V, &smp, &err);
    if (!rc) rc = pd_sampler_accept_many(smp, ids, n_ids, false, &err);
    pd_generation_params gp = {.max_tokens = (int32_t)n_predict, .stop = stops, .n_stop = n_stops};
    if (!rc) rc = pd_generation_create(tok, &gp, &gen, &err);
    double t0 = pd_now_seconds(), t1 = t0;
    if (!rc) rc = pd_prefill(m, seq, ids, (int64_t)n_ids, NULL, logits, &err);
    t1 = pd_now_seconds();
    int n_gen = 0;
    pd_generation_step step = {.finish = PD_FINISH_NONE};
    while (!rc && step.finish == PD_FINISH_NONE) {
        pd_sample_result r;
        if ((rc = pd_sampler_sample(smp, logits, &r, &err))) break;
        if ((rc = pd_sampler_accept(smp, r.token, true, &err))) break;
        if ((rc = pd_generation_push(gen, r.token, &step, &err))) break;
        n_gen++;
        if (ids_out) printf(n_gen > 1 ? " %d" : "%d", r.token);
        else fwrite(step.text, 1, step.len, stdout);
        fflush(stdout);
        if (step.finish != PD_FINISH_NONE) break;
        if (pd_seq_pos(seq) + 1 >= pd_model_hparams(m)->n_ctx_train) {
            pd_generation_finish(gen, PD_FINISH_LENGTH, &step);
            if (!ids_out) fwrite(step.text, 1, step.len, stdout);
            break;
        }
        rc = pd_decode(m, &seq, &r.token, 1, logits, &err);
    }
    double t2 = pd_now_seconds();
    if (!rc) {
        putchar('\n');
        fflush(stdout); /* the report on stderr comes after the text */
        fprintf(stderr, "prompt: %zu tokens in %.3f s (%.1f tok/s); generated: %d tokens in %.3f s (%.1f tok/s); finish: %s\n",
                n_ids, t1 - t0, (double)n_ids / (t1 - t0), n_gen, t2 - t1, n_gen > 1 ? (n_gen - 1) / (t2 - t1) : 0.0,
                pd_finish_reason_name(pd_generation_finish_reason(gen)) ? pd_finish_reason_name(pd_generation_finish_reason(gen)) : "none");
    }
    pd_generation_free(gen);
    pd_sampler_free(smp);
    pd_seq_free(seq);
    free(ids);
    free(logits);
    pd_model_free(m);
    pd_backend_free(be);
    return rc ? fail(&err) : 0;
}

static int cmd_nll(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'}, {"context", required_argument, 0, 'c'},
        {"text", required_argument, 0, 't'},  {"threads", required_argument, 0, 'T'},
        {"device", required_argument, 0, 'd'}, {"kv-type", required_argument, 0, 'K'},
        {"help", no_argument, 0, 'h'},         {0, 0, 0, 0}};
    const char *model = NULL, *context = NULL, *text = NULL;
    pd_device device = {.kind = PD_DEVICE_CPU};
    bool kv_f32 = false;
    long threads = 0;
    int c, rc = PD_OK;
    while ((c = getopt_long(argc, argv, "m:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'c': context = optarg; break;
        case 't': text = optarg; break;
        case 'T': if ((rc = parse_long("--threads", optarg, 0, 1024, &threads))) return rc; break;
        case 'd': if ((rc = parse_device_opt("nll", optarg, &device))) return rc; break;
        case 'K': if ((rc = parse_kv_type_opt("nll", optarg, &kv_f32))) return rc; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (!model || !context || !text || optind != argc) {
        fputs("prefixctl nll: --model FILE, --context TEXT and --text TEXT are required\n", stderr);
        return 2;
    }
    pd_error err = {0};
    pd_model *m = NULL;
    pd_backend *be = NULL;
    if (load_model_on(model, &device, (int)threads, kv_f32, &be, &m, &err)) return fail(&err);
    pd_token *ctx_ids = NULL, *text_ids = NULL;
    size_t n_ctx = 0, n_text = 0;
    double nll = 0;
    /* The context starts the document (BOS); the text continues it. */
    rc = tokenize_text(pd_model_tokenizer(m), context, true, &ctx_ids, &n_ctx, &err);
    if (!rc) rc = tokenize_text(pd_model_tokenizer(m), text, false, &text_ids, &n_text, &err);
    if (!rc) rc = pd_nll(m, NULL, ctx_ids, (int64_t)n_ctx, text_ids, (int64_t)n_text, &nll, &err);
    if (!rc) printf("%.6f\n", nll);
    if (!rc) fprintf(stderr, "context %zu tokens, text %zu tokens, perplexity %.4f\n", n_ctx, n_text, exp(nll));
    free(ctx_ids);
    free(text_ids);
    pd_model_free(m);
    pd_backend_free(be);
    return rc ? fail(&err) : 0;
}

static void print_ppl_progress(void *ctx, int32_t chunks_done, double ppl_so_far) {
    (void)ctx;
    fprintf(stderr, "[%d]%.4f,", chunks_done, ppl_so_far);
}

static int cmd_perplexity(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},   {"file", required_argument, 0, 'f'},
        {"ctx", required_argument, 0, 'c'},     {"chunks", required_argument, 0, 'C'},
        {"threads", required_argument, 0, 'T'}, {"device", required_argument, 0, 'd'},
        {"kv-type", required_argument, 0, 'K'}, {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    const char *model = NULL, *path = NULL;
    pd_device device = {.kind = PD_DEVICE_CPU};
    bool kv_f32 = false;
    long threads = 0, n_ctx = 0, chunks = 0;
    int c, rc = PD_OK;
    while ((c = getopt_long(argc, argv, "m:f:c:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'f': path = optarg; break;
        case 'c': if ((rc = parse_long("--ctx", optarg, PD_PPL_MIN_CTX, INT32_MAX, &n_ctx))) return rc; break;
        case 'C': if ((rc = parse_long("--chunks", optarg, 1, INT32_MAX, &chunks))) return rc; break;
        case 'T': if ((rc = parse_long("--threads", optarg, 0, 1024, &threads))) return rc; break;
        case 'd': if ((rc = parse_device_opt("perplexity", optarg, &device))) return rc; break;
        case 'K': if ((rc = parse_kv_type_opt("perplexity", optarg, &kv_f32))) return rc; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (!model || !path || !n_ctx || optind != argc) {
        fputs("prefixctl perplexity: --model FILE, --file TEXT and --ctx N are required\n", stderr);
        return 2;
    }
    pd_error err = {0};
    char *text = NULL;
    size_t len = 0;
    if (pd_read_file(path, &text, &len, &err)) return fail(&err);
    /* llama.cpp's -f drops one trailing newline from the file. */
    if (len > 0 && text[len - 1] == '\n') text[--len] = '\0';
    pd_model *m = NULL;
    pd_backend *be = NULL;
    if (load_model_on(model, &device, (int)threads, kv_f32, &be, &m, &err)) {
        free(text);
        return fail(&err);
    }
    pd_token *ids = NULL;
    size_t n = 0;
    pd_ppl_result r;
    pd_tokenize_opts to = {.add_special = true};
    rc = pd_tokenize(pd_model_tokenizer(m), text, len, to, &ids, &n, &err);
    if (rc) pd_error_prefix(&err, "%s", path);
    if (!rc) fprintf(stderr, "perplexity: %s tokenizes to %zu tokens\n", path, n);
    const double t0 = pd_now_seconds();
    pd_ppl_opts po = {.n_ctx = (int32_t)n_ctx, .max_chunks = (int32_t)chunks, .progress = print_ppl_progress};
    if (!rc) rc = pd_perplexity(m, ids, (int64_t)n, &po, &r, &err);
    if (!rc) {
        fprintf(stderr, "\nFinal estimate: PPL = %.4f +/- %.5f\n", r.ppl, r.ppl_err);
        fprintf(stderr, "perplexity: %d chunks of n_ctx=%ld, %" PRId64 " tokens scored, mean NLL %.6f, %.2f s\n",
                r.n_chunks, n_ctx, r.n_scored, r.mean_nll, pd_now_seconds() - t0);
        printf("%.6f\n", r.ppl);
    }
    free(ids);
    free(text);
    pd_model_free(m);
    pd_backend_free(be);
    return rc ? fail(&err) : 0;
}

static int parse_double(const char *opt, const char *arg, double *out) {
    char *end;
    errno = 0;
    double v = strtod(arg, &end);
    if (errno || end == arg || *end || !isfinite(v)) {
        fprintf(stderr, "prefixctl: %s wants a number, got '%s'\n", opt, arg);
        return 2;
    }
    *out = v;
    return 0;
}

static int read_tokens(const pd_tokenizer *tok, const char *path, bool add_special, pd_token **ids, size_t *n,
                       pd_error *err) {
    char *text = NULL;
    size_t len = 0;
    int rc = pd_read_file(path, &text, &len, err);
    if (rc) return rc;
    pd_tokenize_opts o = {.add_special = add_special};
    rc = pd_tokenize(tok, text, len, o, ids, n, err);
    free(text);
    if (rc) pd_error_prefix(err, "%s", path);
    return rc;
}

/* A plain prefill of the whole text: the reference the compressed prefix is
 * compared with. */
static int full_prefix(pd_model *m, const pd_token *ids, int64_t n, pd_kv_prefix **out, pd_error *err) {
    pd_seq *s = NULL;
    int rc = pd_seq_create(m, 0, &s, err);
    if (!rc) rc = pd_prefill(m, s, ids, n, NULL, NULL, err);
    if (!rc) rc = pd_seq_to_prefix(s, out, err);
    pd_seq_free(s);
    return rc;
}

static void print_calibration(const pd_calib_result *r, const pd_calib_opts *o, size_t n) {
    printf("calibration: tau %g, probe = the last %lld of the %zu tokens (holdout %g)\n", o->tau,
           (long long)llround(o->holdout * (double)n), n, o->holdout);
    printf("  probe NLL under the full prefix: %.6f\n", r->nll_full);
    for (int i = 0; i < r->n_points; i++)
        printf("  retention %-8g NLL ratio %.6f\n", r->retention[i], r->ratio[i]);
    printf("  curve: f(r) = 1 + %.6g * (r^-%.6g - 1)\n", r->curve.a, r->curve.b);
    printf("  chosen retention %.6g: predicted ratio %.6f, measured %.6f (on the probe)\n", r->chosen, r->predicted,
           r->measured);
}

#define MAX_KEEP_TEXTS 64

static json_t *calibration_json(const pd_calib_result *r, const pd_calib_opts *o, size_t n) {
    json_t *points = json_array();
    for (int i = 0; points && i < r->n_points; i++)
        json_array_append_new(points, json_pack("{s:f,s:f}", "retention", r->retention[i], "ratio", r->ratio[i]));
    return json_pack("{s:f,s:f,s:I,s:f,s:o,s:{s:f,s:f},s:f,s:f,s:f}", "tau", o->tau, "holdout", o->holdout,
                     "probe_tokens", (json_int_t)llround(o->holdout * (double)n), "probe_nll_full", r->nll_full,
                     "points", points ? points : json_null(), "curve", "a", r->curve.a, "b", r->curve.b, "chosen",
                     r->chosen, "predicted", r->predicted, "measured", r->measured);
}

/* --json: what the report prints, as numbers: the canonical spec and
 * layout, kept fractions overall, per layer, per (layer, kv head) and per
 * span, and the kept ranges. */
static int report_compression(json_t *report, const pd_policy_spec *spec, const char *layout_text,
                              const pd_layout *lay, size_t n, const pd_compress_stats *st, pd_error *err) {
    char buf[PD_POLICY_SPEC_MAX];
    pd_policy_spec_print(spec, buf, sizeof buf);
    const double per_layer = (double)n * st->n_head_kv;
    json_t *layers = json_array(), *heads = json_array(), *spans = json_array(), *ranges = json_array();
    int rc = layers && heads && spans && ranges ? PD_OK : PD_ENOMEM;
    for (int l = 0; !rc && l < st->n_layer; l++) {
        int64_t kept = 0;
        json_t *row = json_array();
        for (int h = 0; row && h < st->n_head_kv; h++) {
            kept += st->kept[l * st->n_head_kv + h];
            json_array_append_new(row, json_real((double)st->kept[l * st->n_head_kv + h] / (double)n));
        }
        if (!row || json_array_append_new(heads, row) ||
            json_array_append_new(layers, json_real((double)kept / per_layer)))
            rc = PD_ENOMEM;
    }
    for (int s = 0; !rc && lay && s < lay->n_spans && s < st->n_spans; s++) {
        const pd_span *sp = &lay->spans[s];
        double all = 0, unprotected = 0;
        pd_compress_span_fraction(st, s, &all, &unprotected);
        if (json_array_append_new(spans, json_pack("{s:s,s:I,s:I,s:I,s:b,s:f,s:f}", "name", sp->name, "start",
                                                   (json_int_t)sp->start, "end", (json_int_t)sp->end, "tokens",
                                                   (json_int_t)st->span_tokens[s], "whitelist", (int)sp->whitelist,
                                                   "kept_fraction", all, "unprotected_kept_fraction", unprotected)))
            rc = PD_ENOMEM;
    }
    for (int i = 0; !rc && lay && i < lay->n_whitelist; i++)
        if (json_array_append_new(ranges, json_pack("[I,I]", (json_int_t)lay->whitelist[i].start,
                                                    (json_int_t)lay->whitelist[i].end)))
            rc = PD_ENOMEM;
    const double entries = per_layer * st->n_layer;
    if (!rc && (json_object_set_new(report, "spec", json_string(buf)) ||
                (layout_text && json_object_set_new(report, "layout", json_string(layout_text))) ||
                json_object_set_new(report, "retention", json_real(spec->retention)) ||
                json_object_set_new(report, "prefix_tokens", json_integer((json_int_t)n)) ||
                json_object_set_new(report, "n_layer", json_integer(st->n_layer)) ||
                json_object_set_new(report, "n_head_kv", json_integer(st->n_head_kv)) ||
                json_object_set_new(report, "kept_entries", json_integer((json_int_t)st->kept_total)) ||
                json_object_set_new(report, "kept_fraction", json_real((double)st->kept_total / entries)) ||
                json_object_set(report, "layers", layers) || json_object_set(report, "heads", heads) ||
                (lay && lay->n_spans > 0 && json_object_set(report, "spans", spans)) ||
                (lay && lay->n_whitelist > 0 && json_object_set(report, "kept_ranges", ranges))))
        rc = PD_ENOMEM;
    json_decref(layers);
    json_decref(heads);
    json_decref(spans);
    json_decref(ranges);
    return rc ? pd_errorf(err, PD_ENOMEM, "out of memory for the JSON report") : PD_OK;
}

/* Write a compressed prefix into the store at dir, keyed by its canonical
 * spec (and layout: "SPEC|LAYOUT"), and print its id. */
static int store_prefix(const pd_model *m, const char *dir, const pd_policy_spec *spec, const pd_layout *layout,
                        const char *ns, pd_kv_dtype dtype, bool pin, const pd_prefix_quality *quality,
                        const pd_token *ids, size_t n, const pd_kv_prefix *prefix, json_t *report, pd_error *err) {
    pd_prefix_info info = {.dtype = dtype, .quality = *quality, .pinned = pin};
    pd_model_fingerprint(m, info.fingerprint);
    const size_t len = pd_policy_key_print(spec, layout, info.spec, sizeof info.spec);
    if (len >= sizeof info.spec)
        return pd_errorf(err, PD_ERANGE, "the spec and layout take %zu bytes; the store keeps at most %d", len,
                         PD_PREFIX_SPEC_MAX - 1);
    snprintf(info.ns, sizeof info.ns, "%s", ns);
    pd_store_opts o;
    pd_store_opts_default(&o);
    o.dir = dir;
    pd_store *s = NULL;
    bool existed = false;
    int rc = pd_store_open(&o, &s, err);
    if (!rc) rc = pd_store_put(s, &info, ids, (int64_t)n, prefix, &existed, err);
    if (!rc) {
        char hex[PD_PREFIX_ID_HEX];
        pd_prefix_id_hex(&info.id, hex);
        if (report)
            json_object_set_new(report, "stored", json_pack("{s:s,s:s,s:b,s:s,s:I,s:b,s:s}", "id", hex, "dir", dir,
                                                            "existed", (int)existed, "dtype",
                                                            pd_kv_dtype_name(info.dtype), "bytes",
                                                            (json_int_t)info.bytes, "pinned", (int)info.pinned,
                                                            "namespace", info.ns));
        else
            printf("stored: %s in %s (%s, %s, %.1f KiB%s%s%s)\n", hex, dir, existed ? "already there" : "new",
                   pd_kv_dtype_name(info.dtype), (double)info.bytes / 1024.0, info.pinned ? ", pinned" : "",
                   *info.ns ? ", namespace " : "", info.ns);
    }
    pd_store_close(s);
    return rc;
}

/* --curve: the retention a curve fitted offline licenses for tau, refused
 * when it was fitted for another policy or model. */
static int apply_curve(const char *path, const pd_model *m, double tau, pd_policy_spec *spec, json_t *report,
                       pd_error *err) {
    pd_curve_file cf;
    uint8_t fp[PD_SHA256_LEN];
    pd_model_fingerprint(m, fp);
    int rc = pd_curve_file_read(path, &cf, err);
    if (!rc && (rc = pd_curve_file_check(&cf, spec, fp, err))) pd_error_prefix(err, "--curve %s", path);
    if (!rc) {
        pd_calib_opts defaults;
        pd_calib_opts_default(&defaults);
        const double chosen = pd_curve_choose(cf.curve, tau, defaults.min_retention);
        pd_policy_spec_set_retention(spec, chosen);
        if (report)
            json_object_set_new(report, "zero_shot",
                                json_pack("{s:f,s:s,s:{s:f,s:f},s:i,s:f,s:f}", "tau", tau, "curve_file", path, "curve",
                                          "a", cf.curve.a, "b", cf.curve.b, "texts", (json_int_t)cf.n_texts, "chosen",
                                          chosen, "predicted", pd_curve_eval(cf.curve, chosen)));
        else
            printf("zero-shot: tau %g, curve f(r) = 1 + %.6g * (r^-%.6g - 1) from %s (%d texts), chosen retention "
                   "%.6g, predicted ratio %.6f\n", tau, cf.curve.a, cf.curve.b, path, cf.n_texts, chosen,
                   pd_curve_eval(cf.curve, chosen));
    }
    pd_curve_file_free(&cf);
    return rc;
}

/* Progress of compress: the phase's share of the whole is [base, base + span). */
typedef struct compress_progress {
    pd_progress line;
    double base, span;
} compress_progress;

static void compress_phase(compress_progress *cp, const char *phase, double base, double span) {
    cp->base = base;
    cp->span = span;
    pd_progress_update(&cp->line, phase, base);
}

static int on_calib_measurement(void *ctx, int done, int total, pd_error *err) {
    compress_progress *cp = ctx;
    pd_progress_update(&cp->line, "calibrating", cp->base + cp->span * done / (total > 0 ? total : 1));
    return PD_OK;
}

static int on_compress_layer(void *ctx, int layer, int n_layer, pd_error *err) {
    compress_progress *cp = ctx;
    pd_progress_update(&cp->line, "compressing", cp->base + cp->span * (layer + 1) / (n_layer > 0 ? n_layer : 1));
    return PD_OK;
}

static int cmd_compress(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},   {"policy", required_argument, 0, 'p'},
        {"retention", required_argument, 0, 'r'}, {"quality", required_argument, 0, 'q'},
        {"holdout", required_argument, 0, 'H'}, {"text", required_argument, 0, 't'},
        {"spans", required_argument, 0, 's'},   {"eval", required_argument, 0, 'e'},
        {"threads", required_argument, 0, 'T'}, {"list", no_argument, 0, 'l'},
        {"store", required_argument, 0, 'S'},   {"namespace", required_argument, 0, 'N'},
        {"dtype", required_argument, 0, 'D'},   {"pin", no_argument, 0, 'P'},
        {"device", required_argument, 0, 'd'},  {"kv-type", required_argument, 0, 'K'},
        {"json", no_argument, 0, 'J'},          {"keep-text", required_argument, 0, 'k'},
        {"curve", required_argument, 0, 'C'},
        {"help", no_argument, 0, 'h'},          {0, 0, 0, 0}};
    const char *curve_path = NULL;
    pd_device device = {.kind = PD_DEVICE_CPU};
    bool kv_f32 = false, json = false;
    const char *keep_texts[MAX_KEEP_TEXTS];
    int n_keep = 0;
    const char *model = NULL, *policy = NULL, *text_path = NULL, *spans_path = NULL, *eval_path = NULL;
    const char *store_dir = NULL, *ns = "";
    pd_kv_dtype dtype = PD_KV_F16;
    bool pin = false;
    double retention = 0, tau = 0;
    bool have_retention = false, have_quality = false, have_holdout = false, list = false;
    pd_calib_opts copts;
    pd_calib_opts_default(&copts);
    long threads = 0;
    int c, rc = PD_OK;
    while ((c = getopt_long(argc, argv, "m:p:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'p': policy = optarg; break;
        case 'r': if ((rc = parse_double("--retention", optarg, &retention))) return rc; have_retention = true; break;
        case 'q': if ((rc = parse_double("--quality", optarg, &tau))) return rc; have_quality = true; break;
        case 'H': if ((rc = parse_double("--holdout", optarg, &copts.holdout))) return rc; have_holdout = true; break;
        case 't': text_path = optarg; break;
        case 's': spans_path = optarg; break;
        case 'e': eval_path = optarg; break;
        case 'T': if ((rc = parse_long("--threads", optarg, 0, 1024, &threads))) return rc; break;
        case 'l': list = true; break;
        case 'S': store_dir = optarg; break;
        case 'N': ns = optarg; break;
        case 'D':
            if (!pd_kv_dtype_from_name(optarg, &dtype)) {
                fprintf(stderr, "prefixctl compress: --dtype '%s': use f32, f16 or bf16\n", optarg);
                return 2;
            }
            break;
        case 'P': pin = true; break;
        case 'd': if ((rc = parse_device_opt("compress", optarg, &device))) return rc; break;
        case 'K': if ((rc = parse_kv_type_opt("compress", optarg, &kv_f32))) return rc; break;
        case 'J': json = true; break;
        case 'k':
            if (n_keep == MAX_KEEP_TEXTS || !*optarg) {
                fprintf(stderr, "prefixctl compress: --keep-text takes a non-empty phrase, at most %d times\n",
                        MAX_KEEP_TEXTS);
                return 2;
            }
            keep_texts[n_keep++] = optarg;
            break;
        case 'C': curve_path = optarg; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "prefixctl compress: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (list) {
        pd_policy_describe(stdout);
        return 0;
    }
    if (!model || !policy || !text_path) {
        fputs("prefixctl compress: --model FILE, --policy SPEC and --text FILE are required "
              "(--list shows the policies)\n", stderr);
        return 2;
    }
    if (have_retention && have_quality) {
        fputs("prefixctl compress: give --retention R or --quality TAU, not both\n", stderr);
        return 2;
    }
    if (have_retention && !(retention > 0 && retention <= 1)) {
        fprintf(stderr, "prefixctl compress: --retention %g must be in (0, 1] (the fraction of tokens kept)\n",
                retention);
        return 2;
    }
    if (have_quality && !(tau > 1)) {
        fprintf(stderr, "prefixctl compress: --quality %g must be above 1 (the allowed NLL ratio, e.g. 1.05)\n", tau);
        return 2;
    }
    if (have_holdout && !have_quality) {
        fputs("prefixctl compress: --holdout only applies with --quality TAU\n", stderr);
        return 2;
    }
    if (curve_path && (!have_quality || have_holdout)) {
        fputs("prefixctl compress: --curve chooses the retention for --quality TAU without a probe: give --quality, "
              "and no --holdout\n", stderr);
        return 2;
    }
    if (!store_dir && (pin || *ns)) {
        fputs("prefixctl compress: --namespace and --pin only apply with --store DIR\n", stderr);
        return 2;
    }
    if (strlen(ns) >= PD_PREFIX_NS_MAX) {
        fprintf(stderr, "prefixctl compress: --namespace is longer than %d bytes\n", PD_PREFIX_NS_MAX - 1);
        return 2;
    }
    if (!(copts.holdout > 0 && copts.holdout < 1)) {
        fprintf(stderr, "prefixctl compress: --holdout %g must be a fraction in (0, 1)\n", copts.holdout);
        return 2;
    }
    pd_error err = {0};
    pd_policy_spec spec;
    if (pd_policy_spec_parse(policy, &spec, &err)) {
        fprintf(stderr, "prefixctl compress: --policy: %s\n", err.msg);
        return 2;
    }
    if (have_retention) pd_policy_spec_set_retention(&spec, retention);

    const double t0 = pd_now_seconds();
    pd_model *m = NULL;
    pd_backend *be = NULL;
    /* Progress on stderr (stdout is the report, pure JSON with --json). */
    compress_progress cp;
    pd_progress_init(&cp.line);
    compress_phase(&cp, "loading model", 0, 0);
    if (load_model_on(model, &device, (int)threads, kv_f32, &be, &m, &err)) {
        pd_progress_end(&cp.line);
        return fail(&err);
    }
    const pd_hparams *hp = pd_model_hparams(m);
    pd_token *ids = NULL, *eval_ids = NULL;
    size_t n = 0, n_eval = 0;
    char *spans_text = NULL, *layout_text = NULL;
    pd_layout layout = {0};
    bool have_layout = false;
    pd_kv_prefix *prefix = NULL, *full = NULL;
    pd_compress_stats st = {0};
    pd_prefix_quality quality = {.retention = NAN, .tau = have_quality ? tau : NAN, .nll_full = NAN, .nll_ratio = NAN};
    json_t *report = json ? json_object() : NULL;
    if (json && !report) rc = pd_errorf(&err, PD_ENOMEM, "out of memory");
    if (!rc) rc = read_tokens(pd_model_tokenizer(m), text_path, true, &ids, &n, &err);
    if (!rc && n == 0) rc = pd_errorf(&err, PD_EINVAL, "%s: the text is empty", text_path);
    if (!rc && eval_path) rc = read_tokens(pd_model_tokenizer(m), eval_path, false, &eval_ids, &n_eval, &err);
    if (!rc && eval_path && n_eval < 2)
        rc = pd_errorf(&err, PD_EINVAL, "%s: the eval text has %zu tokens; at least 2 are needed (the first is only fed)",
                       eval_path, n_eval);
    if (!rc && spans_path && strcmp(spans_path, "auto") == 0) {
        if ((rc = pd_layout_auto(pd_model_tokenizer(m), ids, (int64_t)n, NULL, &layout, &err)) == 0) have_layout = true;
        else pd_error_prefix(&err, "--spans auto");
    } else if (!rc && spans_path) {
        rc = pd_read_file(spans_path, &spans_text, NULL, &err);
        if (!rc && (rc = pd_layout_parse(spans_text, &layout, &err)) == 0) have_layout = true;
        if (!rc) rc = pd_layout_validate(&layout, (int64_t)n, &err);
        if (rc) pd_error_prefix(&err, "%s", spans_path);
    }
    if (!rc && n_keep > 0) {
        if ((rc = pd_layout_keep_phrases(pd_model_tokenizer(m), ids, (int64_t)n, keep_texts, n_keep, &layout, NULL,
                                         &err)) == 0)
            have_layout = true;
        else pd_error_prefix(&err, "--keep-text");
    }
    if (!rc && have_layout) {
        size_t need = pd_layout_print(&layout, NULL, 0) + 1;
        if (!(layout_text = malloc(need))) rc = pd_errorf(&err, PD_ENOMEM, "out of memory");
        else pd_layout_print(&layout, layout_text, need);
    }
    const pd_layout *lay = have_layout ? &layout : NULL;
    if (!rc && have_quality && curve_path) {
        rc = apply_curve(curve_path, m, tau, &spec, report, &err);
    } else if (!rc && have_quality) {
        pd_calib_result cr;
        pd_policy_spec chosen;
        copts.tau = tau;
        copts.progress = on_calib_measurement;
        copts.progress_ctx = &cp;
        compress_phase(&cp, "calibrating", 0.05, 0.55);
        rc = pd_calibrate(m, ids, (int64_t)n, &spec, lay, &copts, &cr, &chosen, &err);
        pd_progress_end(&cp.line);
        if (!rc) {
            if (report) json_object_set_new(report, "calibration", calibration_json(&cr, &copts, n));
            else print_calibration(&cr, &copts, n);
            spec = chosen;
            quality.nll_full = cr.nll_full;
            quality.nll_ratio = cr.measured;
        }
    }
    if (!rc) {
        const double from = have_quality && !curve_path ? 0.6 : 0.05;
        compress_phase(&cp, "compressing", from, (eval_path ? 0.85 : 0.95) - from);
        rc = pd_compress_prefix_observed(m, ids, (int64_t)n, &spec, lay, on_compress_layer, &cp, &prefix, &st, &err);
        pd_progress_end(&cp.line);
    }
    if (!rc && report) {
        rc = report_compression(report, &spec, layout_text, lay, n, &st, &err);
    } else if (!rc) {
        char buf[PD_POLICY_SPEC_MAX];
        pd_policy_spec_print(&spec, buf, sizeof buf);
        printf("policy: %s\n", buf);
        if (layout_text) printf("layout: %s\n", layout_text);
        printf("prefix: %zu tokens, %d layers x %d kv heads\n", n, st.n_layer, st.n_head_kv);
        const int64_t per_layer = (int64_t)n * st.n_head_kv;
        for (int l = 0; l < st.n_layer; l++) {
            int64_t kept = 0;
            for (int h = 0; h < st.n_head_kv; h++) kept += st.kept[l * st.n_head_kv + h];
            printf("  layer %2d: kept %6" PRId64 " of %" PRId64 " (%5.1f%%)  per head:", l, kept, per_layer,
                   100.0 * (double)kept / (double)per_layer);
            for (int h = 0; h < st.n_head_kv; h++) printf(" %" PRId64, st.kept[l * st.n_head_kv + h]);
            putchar('\n');
        }
        const int64_t all = per_layer * st.n_layer;
        printf("kept: %" PRId64 " of %" PRId64 " (layer, head, token) entries, fraction %.4f\n", st.kept_total, all,
               (double)st.kept_total / (double)all);
    }
    if (!rc && eval_path) {
        double nll_full = 0, nll_comp = 0;
        compress_phase(&cp, "evaluating", 0.85, 0.1);
        rc = full_prefix(m, ids, (int64_t)n, &full, &err);
        if (!rc) rc = pd_nll(m, full, NULL, 0, eval_ids, (int64_t)n_eval, &nll_full, &err);
        if (!rc) rc = pd_nll(m, prefix, NULL, 0, eval_ids, (int64_t)n_eval, &nll_comp, &err);
        pd_progress_end(&cp.line);
        if (!rc && report) {
            json_object_set_new(report, "eval_tokens", json_integer((json_int_t)n_eval));
            json_object_set_new(report, "nll_full", json_real(nll_full));
            json_object_set_new(report, "nll_compressed", json_real(nll_comp));
            json_object_set_new(report, "nll_ratio", json_real(nll_comp / nll_full));
        } else if (!rc) {
            printf("eval: %zu tokens; mean NLL full prefix %.6f, compressed %.6f, ratio %.6f\n", n_eval, nll_full,
                   nll_comp, nll_comp / nll_full);
        }
        if (!rc) {
            quality.nll_full = nll_full;
            quality.nll_ratio = nll_comp / nll_full;
        }
    }
    if (!rc && store_dir) {
        quality.retention = spec.retention;
        compress_phase(&cp, "storing", 0.95, 0.05);
        pd_progress_end(&cp.line); /* store_prefix reports on stdout */
        rc = store_prefix(m, store_dir, &spec, lay, ns, dtype, pin, &quality, ids, n, prefix, report, &err);
    }
    pd_progress_end(&cp.line);
    if (!rc && report) {
        json_object_set_new(report, "arch", json_string(hp->arch_name));
        json_object_set_new(report, "score_seconds", json_real(st.score_seconds));
        json_object_set_new(report, "total_seconds", json_real(pd_now_seconds() - t0));
        char *text = json_dumps(report, JSON_INDENT(2) | JSON_REAL_PRECISION(17));
        if (text) printf("%s\n", text);
        else rc = pd_errorf(&err, PD_ENOMEM, "out of memory for the JSON report");
        free(text);
    } else if (!rc) {
        printf("time: scoring and selection %.3f s, total %.3f s (%s)\n", st.score_seconds, pd_now_seconds() - t0,
               hp->arch_name);
    }
    json_decref(report);
    pd_compress_stats_free(&st);
    pd_kv_prefix_free(prefix);
    pd_kv_prefix_free(full);
    if (have_layout) pd_layout_free(&layout);
    free(layout_text);
    free(spans_text);
    free(eval_ids);
    free(ids);
    pd_model_free(m);
    pd_backend_free(be);
    return rc ? fail(&err) : 0;
}

/* One of our own kernels (RMSNorm) through the CUDA backend on device
 * `index`, against the same formula on the CPU. The cuBLAS self-test runs
 * NVIDIA's code; this one fails where our fatbinary has no code the GPU
 * runs (cudaErrorNoKernelImageForDevice, whose message names the -Dgpu_sm
 * fix) or where the GPU is broken. */
static int cuda_kernel_selftest(int index, double *max_rel_err, pd_error *err) {
    enum { ROWS = 4, DIM = 320 };
    const float eps = 1e-5f;
    float x[ROWS * DIM], w[DIM], got[ROWS * DIM];
    for (int i = 0; i < ROWS * DIM; i++) x[i] = (float)((i * 37 % 101) - 50) / 25.0f;
    for (int i = 0; i < DIM; i++) w[i] = 0.5f + (float)(i % 7) / 8.0f;
    pd_backend *be = NULL;
    float *dx = NULL, *dw = NULL, *dout = NULL;
    int rc = pd_backend_cuda_create(index, &be, err);
    if (!rc) {
        dx = pd_backend_alloc(be, sizeof x, err);
        dw = dx ? pd_backend_alloc(be, sizeof w, err) : NULL;
        dout = dw ? pd_backend_alloc(be, sizeof got, err) : NULL;
        if (!dout) rc = err->code ? err->code : PD_ENOMEM;
    }
    if (!rc) rc = pd_backend_upload(be, dx, x, sizeof x, err);
    if (!rc) rc = pd_backend_upload(be, dw, w, sizeof w, err);
    if (!rc) rc = pd_backend_rmsnorm(be, dx, dw, ROWS, DIM, eps, dout, err);
    if (!rc) rc = pd_backend_download(be, got, dout, sizeof got, err);
    if (!rc) rc = pd_backend_sync(be, err);
    double worst = 0;
    for (int r = 0; !rc && r < ROWS; r++) {
        double ss = 0;
        for (int i = 0; i < DIM; i++) ss += (double)x[r * DIM + i] * x[r * DIM + i];
        const double scale = 1.0 / sqrt(ss / DIM + eps);
        for (int i = 0; i < DIM; i++) {
            const double want = x[r * DIM + i] * scale * w[i];
            const double rel = fabs(got[r * DIM + i] - want) / (fabs(want) + 1e-3);
            if (!(rel <= worst)) worst = rel; /* NaN counts as the worst */
        }
    }
    if (!rc && !(worst < 1e-4))
        rc = pd_errorf(err, PD_EIO, "RMSNorm on cuda:%d differs from the CPU by %.3g (relative): the GPU computes "
                                    "wrongly; check it with nvidia-smi and NVIDIA's diagnostics (dcgmi diag)",
                       index, worst);
    *max_rel_err = worst;
    if (be) {
        pd_backend_release(be, dx);
        pd_backend_release(be, dw);
        pd_backend_release(be, dout);
        pd_backend_free(be);
    }
    return rc;
}

static int cmd_cuda_info(void) {
    printf("CUDA backend compiled in: %s\n", pd_cuda_compiled() ? "yes" : "no");
    int n = pd_cuda_device_count();
    printf("CUDA devices: %d\n", n);
    int status = 0;
    for (int i = 0; i < n; i++) {
        pd_cuda_device_info info;
        pd_error err = {0};
        if (pd_cuda_device_info_get(i, &info, &err)) return fail(&err);
        const double gib = 1024.0 * 1024 * 1024;
        printf("  [%d] cuda:%d  %s, compute capability %d.%d, %d SMs, %.1f GiB\n", i, i, info.name, info.cc_major,
               info.cc_minor, info.sm_count, (double)info.total_mem / gib);
        /* Double data rate: two transfers per memory clock. */
        const double peak = 2.0 * (double)info.mem_clock_khz * 1e3 * (double)info.mem_bus_width_bits / 8.0;
        if (peak > 0)
            printf("      memory: %d-bit bus at %.0f MHz, peak %.0f GB/s\n", info.mem_bus_width_bits,
                   (double)info.mem_clock_khz / 1e3, peak / 1e9);
        else
            printf("      memory: bus width and clock not reported\n");
        double bw = 0;
        if (pd_cuda_copy_bandwidth(i, (size_t)256 << 20, &bw, &err) == PD_OK) {
            printf("      device-to-device copy of 256 MiB: %.0f GB/s", bw / 1e9);
            if (peak > 0) printf(" (%.0f%% of peak)", 100.0 * bw / peak);
            putchar('\n');
        } else {
            printf("      device-to-device copy of 256 MiB: failed: %s\n", err.msg);
        }
        double max_err = 0;
        int rc = pd_cuda_selftest(i, &max_err, &err);
        printf("      cuBLAS SGEMM self-test: %s (max abs err %.3g)\n", rc ? err.msg : "ok", max_err);
        if (rc) status = 1;
        double kernel_err = 0;
        pd_error kerr = {0};
        rc = cuda_kernel_selftest(i, &kernel_err, &kerr);
        if (rc) printf("      kernel self-test (RMSNorm): failed: %s\n", kerr.msg);
        else printf("      kernel self-test (RMSNorm): ok (max rel err %.3g)\n", kernel_err);
        if (rc) status = 1;
    }
    return status;
}

int main(int argc, char **argv) {
    pd_cpu_prepare_process(argv);
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    argc--, argv++; /* argv[0] is now the command name, as getopt expects */
    if (strcmp(cmd, "inspect") == 0) return cmd_inspect(argc, argv);
    if (strcmp(cmd, "tokenize") == 0) return cmd_tokenize(argc, argv);
    if (strcmp(cmd, "detokenize") == 0) return cmd_detokenize(argc, argv);
    if (strcmp(cmd, "generate") == 0) return cmd_generate(argc, argv);
    if (strcmp(cmd, "nll") == 0) return cmd_nll(argc, argv);
    if (strcmp(cmd, "perplexity") == 0) return cmd_perplexity(argc, argv);
    if (strcmp(cmd, "compress") == 0) return cmd_compress(argc, argv);
    if (strcmp(cmd, "policies") == 0) {
        if (argc != 1) {
            fputs("prefixctl policies: takes no arguments\n", stderr);
            return 2;
        }
        pd_policy_describe(stdout);
        return 0;
    }
    if (strcmp(cmd, "calibrate") == 0) return pd_calibrate_cli(argc, argv);
    if (strcmp(cmd, "store") == 0) return pd_store_cli(argc, argv);
    if (strcmp(cmd, "prefix") == 0) return pd_prefix_cli(argc, argv);
    if (strcmp(cmd, "gen-model") == 0) return pd_testmodel_cli(argc, argv);
    if (strcmp(cmd, "cuda-info") == 0) return cmd_cuda_info();
    if (strcmp(cmd, "-h") == 0 || strcmp(cmd, "--help") == 0 || strcmp(cmd, "help") == 0) {
        usage(stdout);
        return 0;
    }
    fprintf(stderr, "prefixctl: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return 2;
}
