/* pd_perplexity against a naive reference: every chunk prefilled whole with
 * logits for every position, the second half scored by hand in double. The
 * llama.cpp comparison itself is test_ppl_parity. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "helpers.h"
#include "tools/tools.h"

static char *tmpdir;
static char model_path[4096];

static void setup(void) {
    tmpdir = th_mkdtemp();
    cr_assert_not_null(tmpdir);
    pd_testmodel_opts o;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset("tiny", &o, &err), PD_OK, "%s", err.msg);
    o.seed = 7;
    snprintf(model_path, sizeof model_path, "%s/tiny.gguf", tmpdir);
    cr_assert_eq(pd_testmodel_write(&o, model_path, NULL, &err), PD_OK, "%s", err.msg);
}

static void teardown(void) {
    th_rmtree(tmpdir);
    free(tmpdir);
    tmpdir = NULL;
}

TestSuite(perplexity, .init = setup, .fini = teardown);

static pd_model *load(const char *path) {
    pd_model *m = NULL;
    pd_error err = {0};
    pd_model_params p = {.n_threads = 1};
    cr_assert_eq(pd_model_load(path, &p, &m, &err), PD_OK, "%s: %s", path, err.msg);
    return m;
}

/* n pseudo-random token ids in [3, n_vocab), BOS first like a tokenized text. */
static pd_token *text_tokens(const pd_model *m, int64_t n, uint64_t seed) {
    pd_token *t = malloc(sizeof *t * (size_t)n);
    cr_assert_not_null(t);
    const int32_t V = pd_model_hparams(m)->n_vocab;
    for (int64_t i = 0; i < n; i++) t[i] = 3 + (pd_token)(pd_splitmix64(&seed) % (uint64_t)(V - 3));
    t[0] = pd_tokenizer_bos(pd_model_tokenizer(m));
    return t;
}

/* The definition, written out: chunk c is tokens [c*ctx, (c+1)*ctx) with
 * its first token replaced by `bos` (unless PD_TOKEN_NULL), run whole; the
 * logits at positions ctx/2 .. ctx-2 predict the next token. */
static double reference_ppl(pd_model *m, const pd_token *tokens, int64_t n_chunks, int32_t ctx, pd_token bos,
                            int64_t *scored) {
    const int32_t V = pd_model_hparams(m)->n_vocab;
    float *logits = malloc(sizeof(float) * (size_t)V * (size_t)ctx);
    pd_token *chunk = malloc(sizeof *chunk * (size_t)ctx);
    cr_assert(logits && chunk);
    double sum = 0;
    int64_t count = 0;
    pd_error err = {0};
    pd_prefill_opts all = {.logits_all = true};
    for (int64_t c = 0; c < n_chunks; c++) {
        memcpy(chunk, tokens + c * ctx, sizeof *chunk * (size_t)ctx);
        if (bos != PD_TOKEN_NULL) chunk[0] = bos;
        pd_seq *s = NULL;
        cr_assert_eq(pd_seq_create(m, ctx, &s, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_prefill(m, s, chunk, ctx, &all, logits, &err), PD_OK, "%s", err.msg);
        for (int32_t i = ctx / 2; i < ctx - 1; i++) {
            const float *row = logits + (size_t)i * (size_t)V;
            double z = 0;
            for (int32_t v = 0; v < V; v++) z += exp((double)row[v]);
            sum += log(z) - row[chunk[i + 1]];
            count++;
        }
        pd_seq_free(s);
    }
    free(chunk);
    free(logits);
    *scored = count;
    return exp(sum / (double)count);
}

typedef struct progress_log {
    int32_t calls, last_chunk;
    double last_ppl;
} progress_log;

static void on_chunk(void *ctx, int32_t done, double ppl) {
    progress_log *p = ctx;
    p->calls++;
    p->last_chunk = done;
    p->last_ppl = ppl;
}

Test(perplexity, matches_the_chunked_definition) {
    pd_model *m = load(model_path);
    const pd_tokenizer *tok = pd_model_tokenizer(m);
    cr_assert(pd_tokenizer_add_bos(tok), "the built-in vocab adds BOS");
    const pd_token bos = pd_tokenizer_bos(tok);
    /* 5 whole chunks of 40 and a tail of 17 that is ignored; an odd context
     * (33: 16 tokens scored per chunk) too. */
    const int32_t ctxs[] = {40, 33};
    for (size_t k = 0; k < sizeof ctxs / sizeof *ctxs; k++) {
        const int32_t ctx = ctxs[k];
        const int64_t n = 5 * ctx + 17;
        pd_token *t = text_tokens(m, n, 11 + k);
        progress_log seen = {0};
        pd_ppl_opts o = {.n_ctx = ctx, .progress = on_chunk, .progress_ctx = &seen};
        pd_ppl_result r;
        pd_error err = {0};
        cr_assert_eq(pd_perplexity(m, t, n, &o, &r, &err), PD_OK, "%s", err.msg);
        int64_t scored = 0;
        const double want = reference_ppl(m, t, 5, ctx, bos, &scored);
        cr_assert_eq(r.n_chunks, 5);
        cr_assert_eq(r.n_tokens, n);
        cr_assert_eq(r.n_scored, scored);
        cr_assert_eq(r.n_scored, 5 * (ctx - ctx / 2 - 1));
        cr_assert_float_eq(r.ppl, want, want * 1e-5, "ctx %d: ppl %.8g, by hand %.8g", ctx, r.ppl, want);
        cr_assert_float_eq(r.mean_nll, log(r.ppl), 1e-12);
        cr_assert(r.ppl_err > 0 && r.ppl_err < r.ppl, "+/- %g", r.ppl_err);
        cr_assert_eq(seen.calls, 5);
        cr_assert_eq(seen.last_chunk, 5);
        cr_assert_float_eq(seen.last_ppl, r.ppl, r.ppl * 1e-12);
        /* Each chunk starts with BOS: without the replacement the number differs. */
        const double no_bos = reference_ppl(m, t, 5, ctx, PD_TOKEN_NULL, &scored);
        cr_assert(fabs(no_bos / r.ppl - 1) > 1e-4, "BOS replacement made no difference (%g vs %g)", no_bos, r.ppl);
        free(t);
    }
    pd_model_free(m);
}

Test(perplexity, max_chunks_limits_the_chunks_scored) {
    pd_model *m = load(model_path);
    const int32_t ctx = 32;
    const int64_t n = 6 * ctx;
    pd_token *t = text_tokens(m, n, 5);
    pd_ppl_opts o = {.n_ctx = ctx, .max_chunks = 2};
    pd_ppl_result r;
    pd_error err = {0};
    cr_assert_eq(pd_perplexity(m, t, n, &o, &r, &err), PD_OK, "%s", err.msg);
    int64_t scored = 0;
    const double want = reference_ppl(m, t, 2, ctx, pd_tokenizer_bos(pd_model_tokenizer(m)), &scored);
    cr_assert_eq(r.n_chunks, 2);
    cr_assert_eq(r.n_scored, scored);
    cr_assert_float_eq(r.ppl, want, want * 1e-5);
    /* More chunks asked than the text has: every whole chunk. */
    o.max_chunks = 100;
    cr_assert_eq(pd_perplexity(m, t, n, &o, &r, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(r.n_chunks, 6);
    free(t);
    pd_model_free(m);
}

Test(perplexity, refuses_what_llama_perplexity_cannot_measure) {
    pd_model *m = load(model_path);
    const int32_t n_ctx_train = pd_model_hparams(m)->n_ctx_train;
    const int64_t n = 2 * (int64_t)n_ctx_train + 10;
    pd_token *t = text_tokens(m, n, 3);
    pd_ppl_result r;
    pd_error err = {0};

    pd_ppl_opts o = {.n_ctx = 64};
    cr_assert_eq(pd_perplexity(m, t, 127, &o, &r, &err), PD_EINVAL, "a text shorter than two chunks");
    cr_assert(strstr(err.msg, "at least 128"), "%s", err.msg);
    cr_assert_eq(pd_perplexity(m, t, 128, &o, &r, &err), PD_OK, "%s", err.msg);

    o.n_ctx = n_ctx_train + 1;
    cr_assert_eq(pd_perplexity(m, t, n, &o, &r, &err), PD_ERANGE, "a context above the training context");
    cr_assert(strstr(err.msg, "training context"), "%s", err.msg);

    o.n_ctx = PD_PPL_MIN_CTX - 1;
    cr_assert_eq(pd_perplexity(m, t, n, &o, &r, &err), PD_EINVAL);
    o.n_ctx = PD_PPL_MIN_CTX; /* the smallest context scores one token per chunk */
    cr_assert_eq(pd_perplexity(m, t, 2 * PD_PPL_MIN_CTX, &o, &r, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(r.n_scored, 2);

    o.n_ctx = 16;
    o.max_chunks = -1;
    cr_assert_eq(pd_perplexity(m, t, n, &o, &r, &err), PD_EINVAL);
    o.max_chunks = 0;
    t[20] = pd_model_hparams(m)->n_vocab;
    cr_assert_eq(pd_perplexity(m, t, n, &o, &r, &err), PD_EINVAL, "a token outside the vocabulary");
    free(t);
    pd_model_free(m);
}

/* prefixctl perplexity reads the file the way llama-perplexity -f does (one
 * trailing newline dropped), tokenizes it whole with BOS and prints the
 * number on stdout. */
Test(perplexity, prefixctl_prints_what_the_engine_computes) {
    const char *ctl = getenv("PD_PREFIXCTL");
    cr_assert(ctl && *ctl, "PD_PREFIXCTL is not set (run through meson test)");
    static const char story[] = "Once upon a time, there was a little girl named Lily. She saw a big dog in the sun. ";
    char path[4200];
    snprintf(path, sizeof path, "%s/text.txt", tmpdir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    for (int i = 0; i < 6; i++) fputs(story, f);
    fputs("\n", f);
    fclose(f);

    pd_model *m = load(model_path);
    char *text = NULL;
    size_t len = 0;
    pd_error err = {0};
    cr_assert_eq(pd_read_file(path, &text, &len, &err), PD_OK, "%s", err.msg);
    pd_token *ids = NULL;
    size_t n = 0;
    pd_tokenize_opts to = {.add_special = true};
    cr_assert_eq(pd_tokenize(pd_model_tokenizer(m), text, len - 1, to, &ids, &n, &err), PD_OK, "%s", err.msg);
    pd_ppl_opts o = {.n_ctx = 48};
    pd_ppl_result r;
    cr_assert_eq(pd_perplexity(m, ids, (int64_t)n, &o, &r, &err), PD_OK, "%s", err.msg);

    char *out = NULL;
    cr_assert_eq(th_runf(&out, "%s perplexity --model %s --file %s --ctx 48 --threads 1 2>/dev/null", ctl, model_path,
                         path), 0, "%s", out);
    cr_assert_float_eq(strtod(out, NULL), r.ppl, r.ppl * 1e-6, "prefixctl %s, engine %.6f", out, r.ppl);
    free(out);
    /* The summary on stderr, llama-perplexity's wording. */
    cr_assert_eq(th_runf(&out, "%s perplexity --model %s --file %s --ctx 48 --threads 1 2>&1 >/dev/null", ctl,
                         model_path, path), 0, "%s", out);
    cr_assert(strstr(out, "Final estimate: PPL = "), "%s", out);
    cr_assert(strstr(out, "[1]"), "%s", out);
    free(out);
    /* Too short for the context: a message that names the fix, exit 1. */
    cr_assert_eq(th_runf(&out, "%s perplexity --model %s --file %s --ctx 200 2>&1", ctl, model_path, path), 1);
    cr_assert(strstr(out, "smaller context"), "%s", out);
    free(out);
    free(ids);
    free(text);
    pd_model_free(m);
}
