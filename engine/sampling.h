/* engine/sampling.h: Sampling and generation: the sampler, stop strings and the generation state machine.
 * Part of engine's public contract (engine/engine.h includes every part). */
#ifndef PD_ENGINE_SAMPLING_H
#define PD_ENGINE_SAMPLING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------
 * Sampler
 *
 * One sampler per sequence. It turns a vector of n_vocab logits into one
 * token. The chain, in this order:
 *
 *   1. logit bias     x[t] += bias; a bias <= -100 (PD_LOGIT_BIAS_BAN, or
 *                     -INFINITY) bans the token (x[t] = -inf). Several
 *                     entries for one token add up.
 *   2. penalties      a. repetition (llama.cpp / CTRL): every distinct token
 *                        among the last penalty_last_n accepted tokens
 *                        (prompt and generated): x > 0 ? x / r : x * r.
 *                     b. presence / frequency (OpenAI), over the tokens
 *                        accepted as generated since creation or reset:
 *                        x -= presence * (count > 0) + frequency * count.
 *   -- the result is the "adjusted logits" (pd_sampler_adjust) --
 *   3. temperature 0: greedy: argmax of the adjusted logits, ties broken
 *      towards the lowest token id. Steps 4-8 are skipped and no random
 *      number is drawn. Otherwise:
 *   4. temperature    p ~ exp(x / T)
 *   5. top-k          keep the k highest (ties: lowest ids)
 *   6. top-p          keep the shortest prefix of the survivors, sorted by
 *                     probability (renormalised over the survivors), whose
 *                     cumulative probability reaches top_p (at least one)
 *   7. min-p          keep survivors with p >= min_p * p_max
 *   8. draw           one token from the survivors, with probability
 *                     proportional to exp(x / T), from the sampler's own
 *                     xoshiro256** generator (seeded by splitmix64).
 *
 * Log-probabilities (when asked for) come from ONE distribution, the same
 * one OpenAI reports: log-softmax of the adjusted logits (after bias and
 * penalties; BEFORE temperature, top-k, top-p and min-p). So the chosen
 * token's logprob does not depend on temperature or truncation, a banned
 * token has logprob -inf, and exp(logprob) over all tokens sums to 1.
 *
 * Determinism: for the same params (seed included), the same sequence of
 * accept calls and the same logits, sample returns the same tokens on every
 * run and machine with IEEE floats. Ordering ties are always broken by the
 * lowest token id, never by memory layout.
 *
 * Cost: no allocation per sample call; scratch is sized at creation. No
 * sort of the vocabulary: greedy is one pass over the logits; top-k <= 256
 * is one pass with a heap, larger k a radix selection (O(n_vocab)); top-p
 * over the whole vocabulary selects among the tokens that can matter
 * (weight >= (1-top_p) Z / (2 n_vocab)) by radix selection on probability
 * mass; exponentials are a 4-lane SIMD polynomial (own code, so results do
 * not depend on the C library). On one x86 core at n_vocab = 151936: greedy
 * ~0.08 ms, top-k 40 ~0.09 ms, plain temperature ~0.26 ms, top-p 0.95
 * 0.3-0.8 ms, logprobs add ~0.2 ms. Memory: 4 to 24 bytes per vocabulary
 * entry, depending on which features the params enable.
 * ------------------------------------------------------------------------ */

#define PD_SAMPLER_MAX_LOGPROBS 20      /* top alternatives per token, like OpenAI */
#define PD_SAMPLER_MAX_LAST_N (1 << 20) /* largest penalty_last_n */
#define PD_SAMPLER_SEED_RANDOM UINT64_MAX /* seed from the OS (getrandom) at creation */
#define PD_LOGIT_BIAS_BAN (-100.0f)     /* biases at or below this ban the token */

typedef struct pd_logit_bias {
    pd_token token;
    float bias; /* [-100, 100] or -INFINITY */
} pd_logit_bias;

typedef struct pd_sampler_params {
    float temperature;        /* >= 0 (finite); 0 = greedy. Default 1 */
    int32_t top_k;            /* >= 0; 0 = off (values >= n_vocab are off too). Default 0 */
    float top_p;              /* (0, 1]; 1 = off. Default 1 */
    float min_p;              /* [0, 1]; 0 = off. Default 0 */
    uint64_t seed;            /* PD_SAMPLER_SEED_RANDOM = pick one (see pd_sampler_seed). Default random */
    float presence_penalty;   /* [-2, 2]; 0 = off */
    float frequency_penalty;  /* [-2, 2]; 0 = off */
    float repetition_penalty; /* > 0 (finite); 1 = off. Default 1 */
    int32_t penalty_last_n;   /* window of the repetition penalty: > 0 that many tokens,
                                 -1 every token accepted since creation/reset, 0 off.
                                 At most PD_SAMPLER_MAX_LAST_N. Default 64 */
    const pd_logit_bias *logit_bias; /* copied by pd_sampler_create */
    size_t n_logit_bias;
    bool logprobs;            /* fill pd_sample_result.logprob */
    int32_t n_logprobs;       /* 0..PD_SAMPLER_MAX_LOGPROBS alternatives; > 0 implies logprobs */
} pd_sampler_params;

typedef struct pd_token_logprob {
    pd_token token;
    float logprob;
} pd_token_logprob;

typedef struct pd_sample_result {
    pd_token token;
    bool has_logprob;  /* params.logprobs or n_logprobs > 0 */
    float logprob;     /* of `token`, see above; 0 when !has_logprob */
    int32_t n_top;     /* min(n_logprobs, tokens with a finite logprob) */
    pd_token_logprob top[PD_SAMPLER_MAX_LOGPROBS]; /* most likely first; equal
                          logprobs by lowest id. The chosen token is in it only
                          if it is among the n_top most likely. */
} pd_sample_result;

typedef struct pd_sampler pd_sampler;

/* temperature 1, no truncation, no penalties, no bias, random seed,
 * penalty_last_n 64, no logprobs. */
pd_sampler_params pd_sampler_params_default(void);
/* Check every parameter against n_vocab. The message names the parameter
 * (OpenAI / llama.cpp spelling: "temperature", "top_p", "logit_bias", ...). */
int pd_sampler_params_validate(const pd_sampler_params *p, int32_t n_vocab, pd_error *err);

/* Validate, copy the params (logit_bias included) and size the scratch. */
int pd_sampler_create(const pd_sampler_params *p, int32_t n_vocab, pd_sampler **out,
                      pd_error *err);
void pd_sampler_free(pd_sampler *s);
/* Forget the history (penalty counts) and restart the generator from the
 * seed, so the sampler behaves as if just created. */
void pd_sampler_reset(pd_sampler *s);

/* Add a token to the history. Call it for every prompt token (generated =
 * false; they feed only the repetition penalty) and for every token the
 * sequence actually generated (generated = true; usually the one sample
 * returned), in order. Sample does not accept on its own. PD_EINVAL for an
 * id outside [0, n_vocab). */
int pd_sampler_accept(pd_sampler *s, pd_token token, bool generated, pd_error *err);
int pd_sampler_accept_many(pd_sampler *s, const pd_token *tokens, size_t n, bool generated,
                           pd_error *err);

/* Pick the next token from n_vocab logits (not modified). PD_ERANGE when a
 * logit is NaN or +inf, or when every token is banned (all -inf). */
int pd_sampler_sample(pd_sampler *s, const float *logits, pd_sample_result *out, pd_error *err);

/* The adjusted logits (bias and penalties applied: steps 1-2) into out
 * (n_vocab floats), for inspection and tests. */
void pd_sampler_adjust(const pd_sampler *s, const float *logits, float *out);

/* The seed in use (the drawn one for PD_SAMPLER_SEED_RANDOM), so a run can
 * be reproduced. */
uint64_t pd_sampler_seed(const pd_sampler *s);
int32_t pd_sampler_n_vocab(const pd_sampler *s);
/* The params as copied at creation (logit_bias points into the sampler). */
const pd_sampler_params *pd_sampler_params_of(const pd_sampler *s);

/* ------------------------------------------------------------------------
 * Stop sequences
 *
 * Stop strings are matched on the decoded bytes, across token boundaries.
 * Feed each token's piece (pd_token_to_piece bytes); each call says which
 * bytes are safe to show now. Bytes are held back while they could still be
 * the start of a stop string, and an incomplete UTF-8 character at the end
 * is held back until it completes, so a chunk never ends inside a
 * character. The stream stops at the first stop string occurrence to be
 * complete (earliest end in the text; on a tie the earliest start, then the
 * first listed), as soon as it is complete: the text ends right before it
 * and the stop string itself is never emitted. The result does not depend
 * on how the text is cut into pieces. pd_stop_finish flushes what is held
 * (also a trailing incomplete character: the stream is over).
 *
 * Concatenating every emitted chunk gives exactly the fed bytes, cut right
 * before that stop string (or all of them when none matched); the emitted
 * text never contains a whole stop string.
 * ------------------------------------------------------------------------ */

#define PD_STOP_MAX_STRINGS 64 /* OpenAI allows 4 */
#define PD_STOP_MAX_LEN 1024   /* bytes per stop string */

typedef struct pd_stop_matcher pd_stop_matcher;

typedef struct pd_stop_result {
    const char *text; /* bytes to emit now; valid until the next call on the matcher */
    size_t len;
    bool matched;     /* a stop string matched: the stream is over */
    int32_t stop_index; /* which one, -1 if none */
} pd_stop_result;

/* n stop strings; lens may be NULL (then they are NUL-terminated). Strings
 * are copied. n may be 0 (only UTF-8 holding). Empty strings, more than
 * PD_STOP_MAX_STRINGS strings, or longer than PD_STOP_MAX_LEN: PD_EINVAL
 * naming "stop". */
int pd_stop_create(const char *const *stops, const size_t *lens, size_t n,
                   pd_stop_matcher **out, pd_error *err);
void pd_stop_free(pd_stop_matcher *m);
void pd_stop_reset(pd_stop_matcher *m);
/* Feed bytes. After a match, further feeds emit nothing and report the
 * match again. */
int pd_stop_feed(pd_stop_matcher *m, const char *bytes, size_t len, pd_stop_result *out,
                 pd_error *err);
/* End of stream: emit everything held (nothing after a match). */
void pd_stop_finish(pd_stop_matcher *m, pd_stop_result *out);
/* Bytes currently held back. */
size_t pd_stop_held(const pd_stop_matcher *m);

/* ------------------------------------------------------------------------
 * Generation: stop strings + end-of-generation tokens + max_tokens
 *
 * Turns the stream of sampled tokens into the text to send and the finish
 * reason. For each sampled token, in order:
 *   - an end-of-generation token (pd_tokenizer_is_eog), unless ignore_eos:
 *     finish "stop"; its text is not emitted; held bytes are flushed;
 *   - otherwise its piece (control tokens rendered only when `special`) goes
 *     through the stop matcher; a match finishes with "stop";
 *   - then, if max_tokens tokens have been pushed, finish "length" and
 *     flush.
 * Every pushed token counts towards max_tokens and pd_generation_n_tokens
 * (the EOG token included).
 * ------------------------------------------------------------------------ */

typedef enum pd_finish_reason {
    PD_FINISH_NONE = 0,   /* still generating */
    PD_FINISH_STOP = 1,   /* EOG token or stop string: "stop" */
    PD_FINISH_LENGTH = 2, /* max_tokens reached: "length" */
} pd_finish_reason;

/* "stop", "length"; NULL for PD_FINISH_NONE (JSON null). */
const char *pd_finish_reason_name(pd_finish_reason r);

typedef struct pd_generation_params {
    int32_t max_tokens;      /* > 0; tokens this request may generate */
    const char *const *stop; /* stop strings (NUL-terminated), may be NULL */
    size_t n_stop;
    bool ignore_eos;         /* keep going past EOG tokens (benchmarks) */
    bool special;            /* render control tokens' text (default false) */
} pd_generation_params;

typedef struct pd_generation pd_generation;

typedef struct pd_generation_step {
    const char *text;        /* bytes to send for this token; valid until the next call */
    size_t len;
    pd_finish_reason finish; /* PD_FINISH_NONE while more tokens may follow */
    int32_t stop_index;      /* the stop string that matched, else -1 */
    bool eog;                /* this token was an end-of-generation token */
} pd_generation_step;

/* The tokenizer must outlive the generation. */
int pd_generation_create(const pd_tokenizer *tok, const pd_generation_params *p,
                         pd_generation **out, pd_error *err);
void pd_generation_free(pd_generation *g);
/* Push one sampled token. PD_EINVAL after the generation has finished or
 * for an invalid id. */
int pd_generation_push(pd_generation *g, pd_token token, pd_generation_step *out, pd_error *err);
/* Finish early (client gone, context full): flush held bytes; the finish
 * reason becomes `reason` (normally PD_FINISH_LENGTH) unless already set. */
void pd_generation_finish(pd_generation *g, pd_finish_reason reason, pd_generation_step *out);
int32_t pd_generation_n_tokens(const pd_generation *g);
/* max_tokens minus the tokens pushed so far. */
int32_t pd_generation_tokens_left(const pd_generation *g);
pd_finish_reason pd_generation_finish_reason(const pd_generation *g);

#ifdef __cplusplus
}
#endif
#endif
