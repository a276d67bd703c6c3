/* Perplexity of a token stream, measured the way llama.cpp's llama-perplexity
 * measures it (b4748, default options), so the two numbers can be compared:
 * fixed chunks of n_ctx tokens, each evaluated alone from position 0 with its
 * first token replaced by BOS, and only the second half of each chunk scored
 * (every scored token has at least n_ctx/2 tokens of context). */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>

#include "engine/engine.h"

#define PPL_LOGIT_ROWS 64 /* rows of logits per prefill call: bounds the buffer at 64 x n_vocab */

/* -log softmax(logits)[target] as llama-perplexity computes it: float max,
 * float exponentials summed in double. */
static double llama_nll(const float *logits, int32_t n_vocab, pd_token target) {
    float mx = logits[0];
    for (int32_t i = 1; i < n_vocab; i++)
        if (logits[i] > mx) mx = logits[i];
    double sum = 0.0;
    for (int32_t i = 0; i < n_vocab; i++) sum += expf(logits[i] - mx);
    return (double)mx + log(sum) - (double)logits[target];
}

/* Score one chunk: feed its first half, then read the logits of positions
 * first .. n_ctx-2, each predicting the next token. The chunk is evaluated
 * as given (the caller has put BOS in front). */
static int score_chunk(pd_model *m, const pd_token *chunk, int32_t n_ctx, float *logits, double *nll, double *nll2,
                       pd_error *err) {
    const int32_t V = pd_model_hparams(m)->n_vocab, first = n_ctx / 2;
    pd_seq *s = NULL;
    int rc = pd_seq_create(m, n_ctx, &s, err);
    if (!rc) rc = pd_prefill(m, s, chunk, first, NULL, NULL, err);
    const pd_prefill_opts all = {.logits_all = true};
    for (int32_t i = first; !rc && i < n_ctx - 1; i += PPL_LOGIT_ROWS) {
        const int32_t n = n_ctx - 1 - i < PPL_LOGIT_ROWS ? n_ctx - 1 - i : PPL_LOGIT_ROWS;
        rc = pd_prefill(m, s, chunk + i, n, &all, logits, err);
        for (int32_t j = 0; !rc && j < n; j++) {
            const double v = llama_nll(logits + (size_t)j * (size_t)V, V, chunk[i + j + 1]);
            *nll += v;
            *nll2 += v * v;
        }
    }
    pd_seq_free(s);
    return rc;
}

int pd_perplexity(pd_model *m, const pd_token *tokens, int64_t n_tokens, const pd_ppl_opts *opts, pd_ppl_result *out,
                  pd_error *err) {
    const pd_hparams *hp = pd_model_hparams(m);
    const pd_tokenizer *tok = pd_model_tokenizer(m);
    const int32_t n_ctx = opts->n_ctx;
    if (n_ctx < PD_PPL_MIN_CTX)
        return pd_errorf(err, PD_EINVAL, "context %d is too small: at least %d tokens, so that a chunk's second half "
                                         "has a token to score", n_ctx, PD_PPL_MIN_CTX);
    if (n_ctx > hp->n_ctx_train)
        return pd_errorf(err, PD_ERANGE, "context %d is above the model's training context (%d): use a context of at "
                                         "most %d", n_ctx, hp->n_ctx_train, hp->n_ctx_train);
    if (pd_tokenizer_add_eos(tok))
        return pd_errorf(err, PD_EINVAL, "the vocabulary appends EOS to every text (tokenizer.ggml.add_eos_token), which "
                                         "llama-perplexity refuses too: chunks would not be plain text");
    if (n_tokens < 2 * (int64_t)n_ctx)
        return pd_errorf(err, PD_EINVAL, "the text is %" PRId64 " tokens; a context of %d needs at least %" PRId64
                                         " (two chunks): use a longer text or a smaller context", n_tokens, n_ctx,
                         2 * (int64_t)n_ctx);
    if (opts->max_chunks < 0) return pd_errorf(err, PD_EINVAL, "max_chunks %d is negative (0 = all)", opts->max_chunks);
    for (int64_t i = 0; i < n_tokens; i++)
        if (tokens[i] < 0 || tokens[i] >= hp->n_vocab)
            return pd_errorf(err, PD_EINVAL, "token %" PRId64 " (id %d) is outside the vocabulary (0..%d)", i, tokens[i],
                             hp->n_vocab - 1);
    const pd_token bos = pd_tokenizer_add_bos(tok) ? pd_tokenizer_bos(tok) : PD_TOKEN_NULL;

    int64_t n_chunks = n_tokens / n_ctx;
    if (opts->max_chunks > 0 && opts->max_chunks < n_chunks) n_chunks = opts->max_chunks;
    const int64_t per_chunk = n_ctx - n_ctx / 2 - 1;
    float *logits = malloc(sizeof(float) * (size_t)hp->n_vocab * PPL_LOGIT_ROWS);
    pd_token *chunk = malloc(sizeof(pd_token) * (size_t)n_ctx);
    int rc = logits && chunk ? PD_OK : pd_errorf(err, PD_ENOMEM, "out of memory for %d x %d logits", PPL_LOGIT_ROWS,
                                                 hp->n_vocab);
    double nll = 0.0, nll2 = 0.0;
    int64_t count = 0;
    for (int64_t c = 0; !rc && c < n_chunks; c++) {
        for (int32_t i = 0; i < n_ctx; i++) chunk[i] = tokens[c * n_ctx + i];
        if (bos != PD_TOKEN_NULL) chunk[0] = bos; /* replaced, not inserted: a chunk stays n_ctx tokens */
        rc = score_chunk(m, chunk, n_ctx, logits, &nll, &nll2, err);
        if (rc) {
            pd_error_prefix(err, "chunk %" PRId64 " of %" PRId64, c + 1, n_chunks);
            break;
        }
        count += per_chunk;
        if (opts->progress) opts->progress(opts->progress_ctx, (int32_t)(c + 1), exp(nll / (double)count));
    }
    free(chunk);
    free(logits);
    if (rc) return rc;

    /* llama-perplexity's "+/-": the standard error of the mean NLL, times the
     * perplexity (first-order propagation through exp). */
    const double mean = nll / (double)count, var = nll2 / (double)count - mean * mean;
    *out = (pd_ppl_result){
        .n_tokens = n_tokens,
        .n_chunks = (int32_t)n_chunks,
        .n_scored = count,
        .mean_nll = mean,
        .ppl = exp(mean),
        .ppl_err = var > 0 && count > 1 ? sqrt(var / (double)(count - 1)) * exp(mean) : 0.0,
    };
    return PD_OK;
}
