/* prefixctl: the admin command-line tool.
 *
 *   prefixctl inspect FILE
 *   prefixctl tokenize --model FILE [--no-bos] [--special]     < text
 *   prefixctl detokenize --model FILE [--special] [--keep-leading-space] < ids
 *   prefixctl gen-model [options] -o OUT.gguf
 *   prefixctl cuda-info
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "kernels/kernels.h"
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
          "  gen-model [options] -o OUT    write a seeded random GGUF model (--help for options)\n"
          "  cuda-info                     list CUDA devices and run a cuBLAS self-test\n",
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

static int cmd_cuda_info(void) {
    printf("CUDA backend compiled in: %s\n", pd_cuda_compiled() ? "yes" : "no");
    int n = pd_cuda_device_count();
    printf("CUDA devices: %d\n", n);
    for (int i = 0; i < n; i++) {
        pd_cuda_device_info info;
        pd_error err;
        if (pd_cuda_device_info_get(i, &info, &err)) return fail(&err);
        double max_err = 0;
        int rc = pd_cuda_selftest(i, &max_err, &err);
        printf("  [%d] %s, compute capability %d.%d, %.1f GiB; cuBLAS SGEMM self-test: %s (max abs err %.3g)\n", i,
               info.name, info.cc_major, info.cc_minor, (double)info.total_mem / (1024.0 * 1024 * 1024),
               rc ? err.msg : "ok", max_err);
        if (rc) return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    argc--, argv++; /* argv[0] is now the command name, as getopt expects */
    if (strcmp(cmd, "inspect") == 0) return cmd_inspect(argc, argv);
    if (strcmp(cmd, "tokenize") == 0) return cmd_tokenize(argc, argv);
    if (strcmp(cmd, "detokenize") == 0) return cmd_detokenize(argc, argv);
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
