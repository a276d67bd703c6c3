/* grammar-bench: what a token mask costs at a real vocabulary size.
 *
 *   grammar-bench [--walks N] [--steps N] [--seed S] [--pad-to N] [--grammar FILE]
 *                 (VOCAB.gguf | --encoder-json encoder.json)
 *
 * Loads a vocabulary (a GGUF's tokenizer: control tokens are special, EOG
 * tokens end the text; or a GPT-2 style encoder.json of byte-level BPE
 * pieces), a generic JSON grammar (or --grammar), and drives random walks:
 * at each step pd_grammar_matcher_mask, then a token drawn uniformly from
 * the allowed ones (every other step only from those with a byte that is
 * not a letter or digit, so walks leave strings and visit the structure),
 * then pd_grammar_matcher_accept. Half the walks run with a budget of
 * --steps tokens, so they close their document and the budget path runs.
 * --pad-to N appends pieces (two random pieces joined) up to N tokens, for
 * vocabulary sizes no shared file has.
 *
 * Prints the vocabulary size, the time to build its trie and to compile
 * the grammar, cold masks (a mask that computed a state's token set: count,
 * median, max), warm masks (everything cached: median, p99, mean), accept
 * times, and the cache's states and bytes. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/gguf.h"
#include "engine/engine.h"
#include "grammar/grammar.h"

static const char json_grammar[] =
    "root   ::= ws value ws\n"
    "value  ::= object | array | string | number | \"true\" | \"false\" | \"null\"\n"
    "object ::= \"{\" ws ( member ( ws \",\" ws member )* ws )? \"}\"\n"
    "member ::= string ws \":\" ws value\n"
    "array  ::= \"[\" ws ( value ( ws \",\" ws value )* ws )? \"]\"\n"
    "string ::= \"\\\"\" ( [^\"\\\\\\x00-\\x1f] | \"\\\\\" ( [\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4} ) )* \"\\\"\"\n"
    "number ::= \"-\"? ( \"0\" | [1-9] [0-9]* ) ( \".\" [0-9]+ )? ( [eE] [-+]? [0-9]+ )?\n"
    "ws     ::= [ \\t\\n]{0,20}\n";

typedef struct vocab_in {
    int32_t n;
    char **pieces;
    uint32_t *lens;
    uint8_t *kinds;
} vocab_in;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static int cmp_double(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

static double pct(double *v, size_t n, double p) {
    if (n == 0) return NAN;
    qsort(v, n, sizeof *v, cmp_double);
    size_t i = (size_t)(p * (double)(n - 1) + 0.5);
    return v[i];
}

static int push_piece(vocab_in *v, const char *bytes, uint32_t len, uint8_t kind) {
    char **p = realloc(v->pieces, (size_t)(v->n + 1) * sizeof *p);
    if (p) v->pieces = p;
    uint32_t *l = realloc(v->lens, (size_t)(v->n + 1) * sizeof *l);
    if (l) v->lens = l;
    uint8_t *k = realloc(v->kinds, (size_t)(v->n + 1));
    if (k) v->kinds = k;
    char *copy = malloc(len ? len : 1);
    if (!p || !l || !k || !copy) {
        free(copy);
        return -1;
    }
    memcpy(copy, bytes, len);
    v->pieces[v->n] = copy;
    v->lens[v->n] = len;
    v->kinds[v->n] = kind;
    v->n++;
    return 0;
}

static int load_gguf(const char *path, vocab_in *v) {
    pd_gguf *g;
    pd_tokenizer *t;
    pd_error err;
    if (pd_gguf_open(path, &g, &err) || pd_tokenizer_load(g, &t, &err)) {
        fprintf(stderr, "grammar-bench: %s: %s\n", path, err.msg);
        return -1;
    }
    int32_t n = pd_tokenizer_n_vocab(t);
    for (int32_t i = 0; i < n; i++) {
        char buf[1024];
        int len = pd_token_to_piece(t, i, false, buf, sizeof buf);
        if (len < 0 || len > (int)sizeof buf) len = 0;
        uint8_t kind = PD_GTOK_BYTES;
        if (pd_tokenizer_is_eog(t, i))
            kind = PD_GTOK_EOG;
        else if (pd_tokenizer_token_type(t, i) == PD_TOKEN_TYPE_CONTROL)
            kind = PD_GTOK_SPECIAL;
        if (push_piece(v, buf, (uint32_t)len, kind)) return -1;
    }
    pd_tokenizer_free(t);
    pd_gguf_close(g);
    return 0;
}

/* GPT-2 byte-level BPE: each byte is written as one code point. */
static int load_encoder_json(const char *path, vocab_in *v) {
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!json_is_object(root)) {
        fprintf(stderr, "grammar-bench: %s: %s\n", path, je.text);
        return -1;
    }
    int byte_of[512];
    for (int i = 0; i < 512; i++) byte_of[i] = -1;
    int extra = 0;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        byte_of[printable ? b : 256 + extra++] = b;
    }
    size_t n = json_object_size(root);
    char **pieces = calloc(n, sizeof *pieces);
    uint32_t *lens = calloc(n, sizeof *lens);
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        json_int_t id = json_integer_value(val);
        if (id < 0 || (size_t)id >= n) continue;
        size_t kl = strlen(key), o = 0;
        char *out = malloc(kl + 1);
        for (size_t i = 0; i < kl;) { /* decode code points < 0x800 */
            unsigned c = (unsigned char)key[i];
            unsigned cp = c;
            if ((c & 0xE0) == 0xC0 && i + 1 < kl) {
                cp = ((c & 0x1F) << 6) | ((unsigned char)key[i + 1] & 0x3F);
                i += 2;
            } else {
                i += 1;
            }
            out[o++] = (char)(cp < 512 && byte_of[cp] >= 0 ? byte_of[cp] : '?');
        }
        pieces[id] = out;
        lens[id] = (uint32_t)o;
    }
    for (size_t i = 0; i < n; i++) {
        if (push_piece(v, pieces[i] ? pieces[i] : "", lens[i], PD_GTOK_BYTES)) return -1;
        free(pieces[i]);
    }
    free(pieces);
    free(lens);
    json_decref(root);
    /* no special tokens in the file: one EOG so documents can end */
    return push_piece(v, "", 0, PD_GTOK_EOG);
}

static void usage(FILE *f) {
    fputs("usage: grammar-bench [options] (VOCAB.gguf | --encoder-json FILE)\n"
          "  --walks N         random walks (default 20; half of them with a budget)\n"
          "  --steps N         tokens per walk at most, and the budget (default 200)\n"
          "  --seed S          random seed (default 1)\n"
          "  --pad-to N        add joined pieces up to N tokens\n"
          "  --grammar FILE    GBNF instead of the built-in JSON grammar\n"
          "  --decode N        VOCAB.gguf is a model: also time N decode steps (batch 1) and print\n"
          "                    the mask's cost as a share of one decode step\n"
          "  --threads N       decode threads (default 2)\n",
          f);
}

/* The median time of one decode step (batch 1) of the model in path: what
 * a mask is compared with, on the same machine in the same run. */
static int decode_median(const char *path, int threads, int steps, double *out_ms, pd_error *err) {
    pd_model *m = NULL;
    pd_model_params mp = {.n_threads = threads};
    int rc = pd_model_load(path, &mp, &m, err);
    if (rc) return rc;
    const pd_hparams *hp = pd_model_hparams(m);
    float *logits = malloc(sizeof(float) * (size_t)hp->n_vocab);
    double *t = malloc(sizeof(double) * (size_t)steps);
    pd_seq *s = NULL;
    rc = logits && t ? pd_seq_create(m, steps + 2, &s, err) : pd_errorf(err, PD_ENOMEM, "out of memory");
    pd_token tok = 1;
    for (int i = 0; !rc && i < steps; i++) {
        double a = now_ms();
        rc = pd_decode(m, &s, &tok, 1, logits, err);
        t[i] = now_ms() - a;
        tok = (pd_token)((tok * 31 + 7) % hp->n_vocab);
    }
    if (!rc) *out_ms = pct(t, (size_t)steps, 0.5);
    pd_seq_free(s);
    free(logits);
    free(t);
    pd_model_free(m);
    return rc;
}

int main(int argc, char **argv) {
    const char *gguf = NULL, *encoder = NULL, *grammar_file = NULL;
    long walks = 20, steps = 200, seed = 1, pad_to = 0, decode_steps = 0, threads = 2;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has = i + 1 < argc;
        if (!strcmp(a, "--walks") && has)
            walks = strtol(argv[++i], NULL, 10);
        else if (!strcmp(a, "--steps") && has)
            steps = strtol(argv[++i], NULL, 10);
        else if (!strcmp(a, "--seed") && has)
            seed = strtol(argv[++i], NULL, 10);
        else if (!strcmp(a, "--pad-to") && has)
            pad_to = strtol(argv[++i], NULL, 10);
        else if (!strcmp(a, "--decode") && has)
            decode_steps = strtol(argv[++i], NULL, 10);
        else if (!strcmp(a, "--threads") && has)
            threads = strtol(argv[++i], NULL, 10);
        else if (!strcmp(a, "--grammar") && has)
            grammar_file = argv[++i];
        else if (!strcmp(a, "--encoder-json") && has)
            encoder = argv[++i];
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (a[0] != '-' && !gguf)
            gguf = a;
        else {
            usage(stderr);
            return 2;
        }
    }
    if ((!gguf) == (!encoder) || walks < 1 || steps < 2) {
        usage(stderr);
        return 2;
    }
    vocab_in in = {0};
    if (gguf ? load_gguf(gguf, &in) : load_encoder_json(encoder, &in)) return 1;
    srand((unsigned)seed);
    int32_t real_n = in.n;
    while (pad_to > in.n) {
        int32_t a = rand() % real_n, b = rand() % real_n;
        if (in.kinds[a] || in.kinds[b] || in.lens[a] + in.lens[b] > 64) continue;
        char buf[128];
        memcpy(buf, in.pieces[a], in.lens[a]);
        memcpy(buf + in.lens[a], in.pieces[b], in.lens[b]);
        if (push_piece(&in, buf, in.lens[a] + in.lens[b], PD_GTOK_BYTES)) return 1;
    }
    char *gtext = (char *)json_grammar;
    size_t glen = strlen(json_grammar);
    pd_error err;
    if (grammar_file && pd_read_file(grammar_file, &gtext, &glen, &err)) {
        fprintf(stderr, "grammar-bench: %s\n", err.msg);
        return 1;
    }
    double t0 = now_ms();
    pd_grammar_vocab *v;
    if (pd_grammar_vocab_create(in.n, (const char *const *)in.pieces, in.lens, in.kinds, &v, &err)) {
        fprintf(stderr, "grammar-bench: %s\n", err.msg);
        return 1;
    }
    double t_vocab = now_ms() - t0;
    t0 = now_ms();
    pd_grammar *g;
    if (pd_grammar_compile(gtext, glen, &g, &err)) {
        fprintf(stderr, "grammar-bench: %s\n", err.msg);
        return 1;
    }
    double t_compile = now_ms() - t0;

    size_t cap = (size_t)(walks * steps);
    double *cold = malloc(cap * sizeof *cold), *warm = malloc(cap * sizeof *warm), *acc = malloc(cap * sizeof *acc);
    double *warm_budget = malloc(cap * sizeof *warm_budget);
    size_t n_cold = 0, n_warm = 0, n_acc = 0, n_warm_budget = 0;
    float *logits = malloc((size_t)in.n * sizeof *logits);
    int32_t *allowed = malloc((size_t)in.n * sizeof *allowed);
    long ended = 0, total_tokens = 0, total_bytes = 0;
    double allowed_sum = 0;
    for (long w = 0; w < walks; w++) {
        pd_grammar_matcher *m;
        if (pd_grammar_matcher_create(g, v, &m, &err)) {
            fprintf(stderr, "grammar-bench: %s\n", err.msg);
            return 1;
        }
        bool budgeted = w % 2 == 1;
        for (long s = 0; s < steps; s++) {
            for (int32_t t = 0; t < in.n; t++) logits[t] = 0;
            pd_grammar_stats before, after;
            pd_grammar_stats_get(g, &before);
            int32_t budget = budgeted ? (int32_t)(steps - s) : 0;
            double a = now_ms();
            int rc = pd_grammar_matcher_mask(m, logits, budget, &err);
            double dt = now_ms() - a;
            pd_grammar_stats_get(g, &after);
            if (rc) {
                fprintf(stderr, "grammar-bench: walk %ld step %ld: %s\n", w, s, err.msg);
                break;
            }
            if (after.cache_misses > before.cache_misses)
                cold[n_cold++] = dt;
            else if (budgeted)
                warm_budget[n_warm_budget++] = dt;
            else
                warm[n_warm++] = dt;
            int32_t n_allowed = 0, n_struct = 0;
            for (int32_t t = 0; t < in.n; t++)
                if (!isinf(logits[t])) allowed[n_allowed++] = t;
            allowed_sum += n_allowed;
            if (s % 2 == 1) { /* prefer tokens with punctuation, to leave strings */
                for (int32_t k = 0; k < n_allowed; k++) {
                    int32_t t = allowed[k];
                    bool punct = in.kinds[t] != PD_GTOK_BYTES;
                    for (uint32_t b = 0; b < in.lens[t] && !punct; b++) {
                        unsigned char c = (unsigned char)in.pieces[t][b];
                        punct = c < 0x80 && !((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'));
                    }
                    if (punct) allowed[n_struct++] = t;
                }
            }
            int32_t pool = n_struct ? n_struct : n_allowed;
            int32_t pick = allowed[rand() % pool];
            a = now_ms();
            if (pd_grammar_matcher_accept(m, pick, &err)) {
                fprintf(stderr, "grammar-bench: accept: %s\n", err.msg);
                return 1;
            }
            acc[n_acc++] = now_ms() - a;
            total_tokens++;
            total_bytes += in.kinds[pick] == PD_GTOK_BYTES ? in.lens[pick] : 0;
            if (in.kinds[pick] == PD_GTOK_EOG) {
                ended++;
                break;
            }
        }
        pd_grammar_matcher_free(m);
    }
    pd_grammar_stats st;
    pd_grammar_stats_get(g, &st);
    double cold_sum = 0, warm_sum = 0;
    for (size_t i = 0; i < n_cold; i++) cold_sum += cold[i];
    for (size_t i = 0; i < n_warm; i++) warm_sum += warm[i];
    printf("vocab            %d tokens (%s%s)\n", in.n, gguf ? gguf : encoder, pad_to ? ", padded" : "");
    printf("vocab trie       %.1f ms\n", t_vocab);
    printf("grammar compile  %.2f ms\n", t_compile);
    printf("walks            %ld (%ld ended by EOG), %ld tokens, %ld bytes, %.0f tokens allowed per step on average\n",
           walks, ended, total_tokens, total_bytes, total_tokens ? allowed_sum / (double)total_tokens : 0.0);
    printf("cold mask        %zu masks, median %.2f ms, max %.2f ms, total %.1f ms\n", n_cold, pct(cold, n_cold, 0.5),
           pct(cold, n_cold, 1.0), cold_sum);
    printf("warm mask        %zu masks, median %.3f ms, p99 %.3f ms, mean %.3f ms\n", n_warm, pct(warm, n_warm, 0.5),
           pct(warm, n_warm, 0.99), n_warm ? warm_sum / (double)n_warm : 0.0);
    printf("warm mask budget %zu masks, median %.3f ms, p99 %.3f ms\n", n_warm_budget,
           pct(warm_budget, n_warm_budget, 0.5), pct(warm_budget, n_warm_budget, 0.99));
    printf("accept           median %.4f ms, p99 %.4f ms\n", pct(acc, n_acc, 0.5), pct(acc, n_acc, 0.99));
    printf("cache            %" PRId64 " states, %.1f MiB, %" PRId64 " hits, %" PRId64 " misses\n", st.states_cached,
           (double)st.cache_bytes / (1024.0 * 1024.0), st.cache_hits, st.cache_misses);
    if (decode_steps > 0) {
        if (!gguf || pad_to) {
            fprintf(stderr, "grammar-bench: --decode needs a model GGUF (with weights) and no --pad-to\n");
            return 2;
        }
        double per_token = 0;
        if (decode_median(gguf, (int)threads, (int)decode_steps, &per_token, &err)) {
            fprintf(stderr, "grammar-bench: %s\n", err.msg);
            return 1;
        }
        double wm = n_warm ? warm_sum / (double)n_warm : 0.0;
        printf("decode           median %.2f ms per token (batch 1, %ld threads, %ld steps)\n", per_token, threads,
               decode_steps);
        printf("mask / decode    warm mean %.2f%%, warm p99 %.2f%%, cold median %.1f%%\n", 100.0 * wm / per_token,
               100.0 * pct(warm, n_warm, 0.99) / per_token, 100.0 * pct(cold, n_cold, 0.5) / per_token);
    }
    pd_grammar_free(g);
    pd_grammar_vocab_free(v);
    for (int32_t i = 0; i < in.n; i++) free(in.pieces[i]);
    free(in.pieces);
    free(in.lens);
    free(in.kinds);
    if (gtext != json_grammar) free(gtext);
    free(cold);
    free(warm);
    free(warm_budget);
    free(acc);
    free(logits);
    free(allowed);
    return 0;
}
