/* Token sampler: logit bias, repetition / presence / frequency penalties,
 * greedy, temperature, top-k, top-p, min-p, seeded draws and logprobs.
 * See the sampler section of engine/engine.h for the exact semantics of the
 * chain. */

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include <sys/random.h>
#include <time.h>

/* Radix selection digits: 11 + 11 + 10 bits of a 32-bit key. */
#define RADIX_BINS 2048
/* Weights are summed in blocks of this many tokens (float lanes inside a
 * block, double across blocks); the draw finds its block, then its token. */
#define SUM_BLOCK 256
/* top_k up to this uses a heap (one pass); larger k, radix selection. */
#define HEAP_MAX 256

typedef struct ranked { /* a (logit, token) pair */
    float v;
    int32_t id;
} ranked;

struct pd_sampler {
    pd_sampler_params p; /* p.logit_bias points at `bias` */
    pd_logit_bias *bias; /* merged: one entry per token, sorted by id; bans are -inf */
    size_t n_bias;
    int32_t n_vocab;
    uint64_t seed;
    uint64_t rng[4];

    /* repetition penalty: tokens in the window of the last penalty_last_n */
    bool rep_on;
    int32_t *win_count;  /* occurrences inside the window, per token */
    pd_token *win_list;  /* tokens whose win_count became > 0 (some may be 0 again) */
    uint8_t *win_listed; /* token is in win_list */
    size_t n_win_list, n_win_live;
    pd_token *ring;      /* the window itself, when penalty_last_n > 0 */
    size_t ring_cap, ring_pos;
    uint64_t n_hist;

    /* presence / frequency penalties: generated tokens */
    bool pf_on;
    int32_t *gen_count;
    pd_token *gen_list; /* distinct generated tokens */
    size_t n_gen_list;

    /* scratch, sized at creation */
    float *eff;          /* adjusted logits (bias, penalties) */
    float *w;            /* unnormalised tempered probabilities exp((x - max) / T) */
    int32_t *cand, *tmp; /* candidate lists for top-k / top-p */
    double *blocks;      /* weight sums per SUM_BLOCK tokens */
    ranked heap[HEAP_MAX];
    uint32_t hist_count[RADIX_BINS];
    double hist_mass[RADIX_BINS];
};

/* ---- random numbers ------------------------------------------------------ */

static inline uint64_t rotl64(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

/* xoshiro256** 1.0 (Blackman & Vigna). */
static uint64_t xoshiro_next(uint64_t s[4]) {
    const uint64_t result = rotl64(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl64(s[3], 45);
    return result;
}

/* Uniform in [0, 1) with 53 random bits. */
static double rng_double(pd_sampler *s) {
    return (double)(xoshiro_next(s->rng) >> 11) * 0x1.0p-53;
}

static void rng_seed(pd_sampler *s) {
    uint64_t x = s->seed;
    for (int i = 0; i < 4; i++) s->rng[i] = pd_splitmix64(&x);
}

static uint64_t random_seed(void) {
    uint64_t v = 0;
    if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t x = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
        x ^= (uint64_t)(uintptr_t)&v;
        v = pd_splitmix64(&x);
    }
    if (v == PD_SAMPLER_SEED_RANDOM) v = 0; /* keep the sentinel out of reported seeds */
    return v;
}

/* ---- params ---------------------------------------------------------------- */

pd_sampler_params pd_sampler_params_default(void) {
    pd_sampler_params p;
    memset(&p, 0, sizeof p);
    p.temperature = 1.0f;
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    p.seed = PD_SAMPLER_SEED_RANDOM;
    p.repetition_penalty = 1.0f;
    p.penalty_last_n = 64;
    return p;
}

int pd_sampler_params_validate(const pd_sampler_params *p, int32_t n_vocab, pd_error *err) {
    if (!p) return pd_errorf(err, PD_EINVAL, "sampler params: NULL");
    if (n_vocab <= 0)
        return pd_errorf(err, PD_EINVAL, "sampler: n_vocab must be > 0 (got %d)", (int)n_vocab);
    if (!(p->temperature >= 0.0f) || !isfinite(p->temperature))
        return pd_errorf(err, PD_EINVAL,
                         "temperature must be a finite number >= 0 (0 = greedy); got %g",
                         (double)p->temperature);
    if (p->top_k < 0)
        return pd_errorf(err, PD_EINVAL, "top_k must be >= 0 (0 = disabled); got %d",
                         (int)p->top_k);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return pd_errorf(err, PD_EINVAL, "top_p must be in (0, 1] (1 = disabled); got %g",
                         (double)p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return pd_errorf(err, PD_EINVAL, "min_p must be in [0, 1] (0 = disabled); got %g",
                         (double)p->min_p);
    if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f))
        return pd_errorf(err, PD_EINVAL, "presence_penalty must be in [-2, 2]; got %g",
                         (double)p->presence_penalty);
    if (!(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f))
        return pd_errorf(err, PD_EINVAL, "frequency_penalty must be in [-2, 2]; got %g",
                         (double)p->frequency_penalty);
    if (!(p->repetition_penalty > 0.0f) || !isfinite(p->repetition_penalty))
        return pd_errorf(err, PD_EINVAL,
                         "repetition_penalty must be a finite number > 0 (1 = disabled); got %g",
                         (double)p->repetition_penalty);
    if (p->penalty_last_n < -1 || p->penalty_last_n > PD_SAMPLER_MAX_LAST_N)
        return pd_errorf(err, PD_EINVAL,
                         "penalty_last_n must be -1 (all tokens), 0 (disabled) or 1..%d; got %d",
                         PD_SAMPLER_MAX_LAST_N, (int)p->penalty_last_n);
    if (p->n_logprobs < 0 || p->n_logprobs > PD_SAMPLER_MAX_LOGPROBS)
        return pd_errorf(err, PD_EINVAL, "top_logprobs (n_logprobs) must be in 0..%d; got %d",
                         PD_SAMPLER_MAX_LOGPROBS, (int)p->n_logprobs);
    if (p->n_logit_bias > 0 && !p->logit_bias)
        return pd_errorf(err, PD_EINVAL, "logit_bias: %zu entries but the array is NULL",
                         p->n_logit_bias);
    for (size_t i = 0; i < p->n_logit_bias; i++) {
        const pd_logit_bias *b = &p->logit_bias[i];
        if (b->token < 0 || b->token >= n_vocab)
            return pd_errorf(err, PD_EINVAL,
                             "logit_bias: token %d is outside the vocabulary [0, %d)",
                             (int)b->token, (int)n_vocab);
        if (!(b->bias == -INFINITY || (b->bias >= -100.0f && b->bias <= 100.0f)))
            return pd_errorf(err, PD_EINVAL,
                             "logit_bias: the bias of token %d must be in [-100, 100] "
                             "(-100 bans the token); got %g",
                             (int)b->token, (double)b->bias);
    }
    return PD_OK;
}

/* ---- creation ---------------------------------------------------------------- */

static int cmp_bias(const void *a, const void *b) {
    const pd_logit_bias *x = a, *y = b;
    return (x->token > y->token) - (x->token < y->token);
}

void pd_sampler_free(pd_sampler *s) {
    if (!s) return;
    free(s->bias);
    free(s->win_count);
    free(s->win_list);
    free(s->win_listed);
    free(s->ring);
    free(s->gen_count);
    free(s->gen_list);
    free(s->eff);
    free(s->w);
    free(s->cand);
    free(s->tmp);
    free(s->blocks);
    free(s);
}

int pd_sampler_create(const pd_sampler_params *p, int32_t n_vocab, pd_sampler **out,
                      pd_error *err) {
    if (!out) return pd_errorf(err, PD_EINVAL, "pd_sampler_create: NULL output");
    *out = NULL;
    int rc = pd_sampler_params_validate(p, n_vocab, err);
    if (rc) return rc;

    pd_sampler *s = calloc(1, sizeof *s);
    if (!s) return pd_errorf(err, PD_ENOMEM, "sampler: out of memory");
    s->p = *p;
    s->n_vocab = n_vocab;
    const size_t n = (size_t)n_vocab;

    /* Logit bias: copy, merge duplicates (they add up; a ban wins). */
    if (p->n_logit_bias > 0) {
        s->bias = malloc(p->n_logit_bias * sizeof *s->bias);
        if (!s->bias) goto oom;
        memcpy(s->bias, p->logit_bias, p->n_logit_bias * sizeof *s->bias);
        qsort(s->bias, p->n_logit_bias, sizeof *s->bias, cmp_bias);
        size_t m = 0;
        for (size_t i = 0; i < p->n_logit_bias; i++) {
            if (m > 0 && s->bias[m - 1].token == s->bias[i].token)
                s->bias[m - 1].bias += s->bias[i].bias;
            else
                s->bias[m++] = s->bias[i];
        }
        for (size_t i = 0; i < m; i++)
            if (s->bias[i].bias <= PD_LOGIT_BIAS_BAN) s->bias[i].bias = -INFINITY;
        s->n_bias = m;
    }
    s->p.logit_bias = s->bias;
    s->p.n_logit_bias = s->n_bias;

    s->rep_on = p->repetition_penalty != 1.0f && p->penalty_last_n != 0;
    if (s->rep_on) {
        s->win_count = calloc(n, sizeof *s->win_count);
        s->win_list = malloc(n * sizeof *s->win_list);
        s->win_listed = calloc(n, 1);
        if (!s->win_count || !s->win_list || !s->win_listed) goto oom;
        if (p->penalty_last_n > 0) {
            s->ring_cap = (size_t)p->penalty_last_n;
            s->ring = malloc(s->ring_cap * sizeof *s->ring);
            if (!s->ring) goto oom;
        }
    }
    s->pf_on = p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f;
    if (s->pf_on) {
        s->gen_count = calloc(n, sizeof *s->gen_count);
        s->gen_list = malloc(n * sizeof *s->gen_list);
        if (!s->gen_count || !s->gen_list) goto oom;
    }
    if (s->n_bias > 0 || s->rep_on || s->pf_on) {
        s->eff = malloc(n * sizeof *s->eff);
        if (!s->eff) goto oom;
    }
    if (p->temperature > 0.0f) {
        s->w = malloc(n * sizeof *s->w);
        s->blocks = malloc((n / (SUM_BLOCK / 4) + 1) * sizeof *s->blocks);
        if (!s->w || !s->blocks) goto oom;
        if ((p->top_k > 0 && p->top_k < n_vocab) || p->top_p < 1.0f) {
            s->cand = malloc(n * sizeof *s->cand);
            s->tmp = malloc(n * sizeof *s->tmp);
            if (!s->cand || !s->tmp) goto oom;
        }
    }

    s->seed = p->seed == PD_SAMPLER_SEED_RANDOM ? random_seed() : p->seed;
    s->p.seed = s->seed;
    rng_seed(s);
    *out = s;
    return PD_OK;
oom:
    pd_sampler_free(s);
    return pd_errorf(err, PD_ENOMEM, "sampler: out of memory for a vocabulary of %d tokens",
                     (int)n_vocab);
}

void pd_sampler_reset(pd_sampler *s) {
    if (!s) return;
    if (s->rep_on) {
        for (size_t i = 0; i < s->n_win_list; i++) {
            s->win_count[s->win_list[i]] = 0;
            s->win_listed[s->win_list[i]] = 0;
        }
        s->n_win_list = s->n_win_live = 0;
        s->ring_pos = 0;
    }
    if (s->pf_on) {
        for (size_t i = 0; i < s->n_gen_list; i++) s->gen_count[s->gen_list[i]] = 0;
        s->n_gen_list = 0;
    }
    s->n_hist = 0;
    rng_seed(s);
}

uint64_t pd_sampler_seed(const pd_sampler *s) { return s->seed; }
int32_t pd_sampler_n_vocab(const pd_sampler *s) { return s->n_vocab; }
const pd_sampler_params *pd_sampler_params_of(const pd_sampler *s) { return &s->p; }

/* ---- history ------------------------------------------------------------------ */

int pd_sampler_accept(pd_sampler *s, pd_token t, bool generated, pd_error *err) {
    if (!s) return pd_errorf(err, PD_EINVAL, "pd_sampler_accept: NULL sampler");
    if (t < 0 || t >= s->n_vocab)
        return pd_errorf(err, PD_EINVAL, "sampler: token %d is outside the vocabulary [0, %d)",
                         (int)t, (int)s->n_vocab);
    if (s->rep_on) {
        if (s->ring) {
            if (s->n_hist >= s->ring_cap) {
                pd_token old = s->ring[s->ring_pos];
                if (--s->win_count[old] == 0) s->n_win_live--;
            }
            s->ring[s->ring_pos] = t;
            s->ring_pos = s->ring_pos + 1 == s->ring_cap ? 0 : s->ring_pos + 1;
        }
        if (s->win_count[t]++ == 0) {
            s->n_win_live++;
            if (!s->win_listed[t]) {
                s->win_listed[t] = 1;
                s->win_list[s->n_win_list++] = t;
            }
        }
        /* Drop tokens that left the window once they are half the list. */
        if (s->n_win_list > 2 * s->n_win_live + 64) {
            size_t m = 0;
            for (size_t i = 0; i < s->n_win_list; i++) {
                pd_token x = s->win_list[i];
                if (s->win_count[x] > 0) s->win_list[m++] = x;
                else s->win_listed[x] = 0;
            }
            s->n_win_list = m;
        }
    }
    s->n_hist++;
    if (s->pf_on && generated) {
        if (s->gen_count[t]++ == 0) s->gen_list[s->n_gen_list++] = t;
    }
    return PD_OK;
}

int pd_sampler_accept_many(pd_sampler *s, const pd_token *tokens, size_t n, bool generated,
                           pd_error *err) {
    if (n > 0 && !tokens) return pd_errorf(err, PD_EINVAL, "pd_sampler_accept_many: NULL tokens");
    for (size_t i = 0; i < n; i++) {
        int rc = pd_sampler_accept(s, tokens[i], generated, err);
        if (rc) {
            pd_error_prefix(err, "token %zu of %zu", i, n);
            return rc;
        }
    }
    return PD_OK;
}

/* ---- adjusted logits ------------------------------------------------------------ */

static bool mods_pending(const pd_sampler *s) {
    return s->n_bias > 0 || (s->rep_on && s->n_win_live > 0) || (s->pf_on && s->n_gen_list > 0);
}

/* Steps 1-2 of the chain, in place. */
static void apply_mods(const pd_sampler *s, float *x) {
    for (size_t i = 0; i < s->n_bias; i++) {
        const pd_logit_bias *b = &s->bias[i];
        x[b->token] = b->bias == -INFINITY ? -INFINITY : x[b->token] + b->bias;
    }
    if (s->rep_on) {
        const float r = s->p.repetition_penalty;
        for (size_t i = 0; i < s->n_win_list; i++) {
            pd_token t = s->win_list[i];
            if (s->win_count[t] <= 0) continue;
            float v = x[t];
            x[t] = v > 0.0f ? v / r : v * r;
        }
    }
    if (s->pf_on) {
        const float pres = s->p.presence_penalty, freq = s->p.frequency_penalty;
        for (size_t i = 0; i < s->n_gen_list; i++) {
            pd_token t = s->gen_list[i];
            x[t] -= (float)s->gen_count[t] * freq + pres;
        }
    }
}

void pd_sampler_adjust(const pd_sampler *s, const float *logits, float *out) {
    memcpy(out, logits, (size_t)s->n_vocab * sizeof *out);
    apply_mods(s, out);
}

/* ---- radix selection ----------------------------------------------------------- */

/* Order-preserving map of a float to uint32 (larger float, larger key);
 * -0 and +0 map to the same key. */
static inline uint32_t fkey(float f) {
    f += 0.0f; /* -0 -> +0 */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

static const int radix_shift[3] = {21, 10, 0};
static const int radix_bits[3] = {11, 11, 10};

/* Select, among the candidates in[0..n) (or the ids 0..n-1 when in is
 * NULL), the top ones by logit x:
 *   - w == NULL: the k largest (k < n);
 *   - w != NULL: the shortest top prefix whose mass (sum of w) reaches
 *     target, at least one (all of them if their mass stays below).
 * Equal logits are taken in candidate order (lowest id first when the
 * candidates are in id order; relative order of equal keys is kept by every
 * selection, so this stays true after one selection feeds another). The
 * chosen ids go to out (which may alias in), in no particular order; tmp is
 * scratch of n entries. Returns the number chosen. O(n), three passes at
 * most over shrinking lists. */
static size_t radix_select(pd_sampler *s, const float *x, const float *w, const int32_t *in,
                           size_t n, size_t k, double target, int32_t *out, int32_t *tmp) {
    const bool by_mass = w != NULL;
    size_t n_out = 0;
    const int32_t *cur = in;
    size_t n_cur = n;
    size_t need = k;
    double need_mass = target;

    for (int level = 0; level < 3; level++) {
        const int shift = radix_shift[level];
        const uint32_t nb = 1u << radix_bits[level], mask = nb - 1;
        memset(s->hist_count, 0, nb * sizeof s->hist_count[0]);
        if (by_mass) memset(s->hist_mass, 0, nb * sizeof s->hist_mass[0]);
        for (size_t j = 0; j < n_cur; j++) {
            int32_t id = cur ? cur[j] : (int32_t)j;
            uint32_t d = (fkey(x[id]) >> shift) & mask;
            s->hist_count[d]++;
            if (by_mass) s->hist_mass[d] += w[id];
        }
        /* Boundary bin: everything above it is in, part of it may be. */
        uint32_t b = nb;
        size_t above_n = 0;
        double above_m = 0.0;
        bool found = false;
        while (b-- > 0) {
            if (by_mass) {
                if (s->hist_count[b] > 0 && above_m + s->hist_mass[b] >= need_mass) {
                    found = true;
                    break;
                }
                above_m += s->hist_mass[b];
            } else if (above_n + s->hist_count[b] >= need) {
                found = true;
                break;
            }
            above_n += s->hist_count[b];
        }
        if (!found) { /* mass target missed by rounding: take everything */
            for (size_t j = 0; j < n_cur; j++) out[n_out++] = cur ? cur[j] : (int32_t)j;
            return n_out;
        }
        size_t n_b = 0;
        for (size_t j = 0; j < n_cur; j++) {
            int32_t id = cur ? cur[j] : (int32_t)j;
            uint32_t d = (fkey(x[id]) >> shift) & mask;
            if (d > b) out[n_out++] = id;
            else if (d == b) tmp[n_b++] = id;
        }
        cur = tmp;
        n_cur = n_b;
        if (by_mass) need_mass -= above_m;
        else need -= above_n;
        if ((!by_mass && need == n_cur) || (by_mass && n_cur == 1)) {
            for (size_t j = 0; j < n_cur; j++) out[n_out++] = cur[j];
            return n_out;
        }
    }
    /* Every remaining candidate has the same logit: take them in order. */
    size_t take;
    if (by_mass) {
        const double v = w[cur[0]];
        const double t = v > 0.0 ? ceil(need_mass / v) : (double)n_cur;
        take = t >= (double)n_cur ? n_cur : t < 1.0 ? 1 : (size_t)t;
    } else {
        take = need;
    }
    if (take > n_cur) take = n_cur;
    for (size_t j = 0; j < take; j++) out[n_out++] = cur[j];
    return n_out;
}

/* ---- vector helpers ----------------------------------------------------------- */

/* Four-lane float math with GCC/Clang vector extensions (SSE2 on any
 * x86-64, NEON on aarch64; no -march needed). Each lane performs exactly
 * the scalar IEEE operations, so results do not depend on the lane width
 * and the scalar path (one splat lane) gives bit-identical values. */
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

static inline v4f v4_load(const float *p) {
    v4f v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void v4_store(float *p, v4f v) { memcpy(p, &v, sizeof v); }
static inline v4f v4_splat(float c) { return (v4f){c, c, c, c}; }
static inline v4f v4_select(v4i m, v4f a, v4f b) {
    return (v4f)(((v4i)a & m) | ((v4i)b & ~m));
}

/* exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-6
 * polynomial; about 1 ulp). Results below exp(-87) (1.6e-38) and -inf give
 * exactly 0, so banned tokens have weight 0. Own implementation, so the
 * values do not change with the C library. */
static inline v4f v4_exp_neg(v4f x) {
    const v4i under = x < v4_splat(-87.0f);
    x = v4_select(under, v4_splat(-87.0f), x);
    const v4f magic = v4_splat(12582912.0f); /* 1.5 * 2^23: round to integer */
    const v4f t = x * v4_splat(1.44269504088896341f) + magic;
    const v4f nf = t - magic;
    const v4i ni = (v4i)t - (v4i)magic;
    v4f r = x - nf * v4_splat(0.693359375f);
    r = r - nf * v4_splat(-2.12194440e-4f);
    const v4f z = r * r;
    v4f y = v4_splat(1.9875691500e-4f);
    y = y * r + v4_splat(1.3981999507e-3f);
    y = y * r + v4_splat(8.3334519073e-3f);
    y = y * r + v4_splat(4.1665795894e-2f);
    y = y * r + v4_splat(1.6666665459e-1f);
    y = y * r + v4_splat(5.0000001201e-1f);
    y = y * z + r + v4_splat(1.0f);
    const v4f scale = (v4f)((ni + 127) << 23);
    return (v4f)((v4i)(y * scale) & ~under);
}

/* exp((x - xmax) * inv_t), with x == xmax giving exactly 1 (also when
 * inv_t is +inf for a subnormal temperature). */
static inline v4f v4_tempered(v4f x, float xmax, float inv_t) {
    const v4f d = x - v4_splat(xmax);
    const v4f a = (v4f)((v4i)(d * v4_splat(inv_t)) & ~(d == v4_splat(0.0f)));
    return v4_exp_neg(a);
}
static inline float tempered1(float x, float xmax, float inv_t) {
    return v4_tempered(v4_splat(x), xmax, inv_t)[0];
}

/* Maximum of x[0..n) ignoring NaN; *bad is set when a NaN or +inf occurs. */
static float max_scan(const float *x, size_t n, bool *bad) {
    v4f m = v4_splat(-INFINITY);
    v4i b = {0, 0, 0, 0};
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const v4f v = v4_load(x + i);
        b |= ~(v <= v4_splat(FLT_MAX));
        m = v4_select(v > m, v, m);
    }
    float best = -INFINITY;
    bool isbad = (b[0] | b[1] | b[2] | b[3]) != 0;
    for (int l = 0; l < 4; l++)
        if (m[l] > best) best = m[l];
    for (; i < n; i++) {
        isbad |= !(x[i] <= FLT_MAX);
        if (x[i] > best) best = x[i];
    }
    *bad = isbad;
    return best;
}

/* sum of exp(x[i] - xmax) in double (blocks of 256 summed in float lanes). */
static double sum_exp(const float *x, size_t n, float xmax) {
    double total = 0.0;
    for (size_t b = 0; b < n; b += SUM_BLOCK) {
        const size_t e = b + SUM_BLOCK < n ? b + SUM_BLOCK : n;
        v4f acc = v4_splat(0.0f);
        size_t i = b;
        for (; i + 4 <= e; i += 4) acc += v4_tempered(v4_load(x + i), xmax, 1.0f);
        float tail = 0.0f;
        for (; i < e; i++) tail += tempered1(x[i], xmax, 1.0f);
        total += (double)acc[0] + (double)acc[1] + (double)acc[2] + (double)acc[3] + tail;
    }
    return total;
}

/* ---- top-n by heap ---------------------------------------------------------------- */

/* "worse" = smaller value, or equal value and larger id. */
static inline bool worse(ranked a, ranked b) { return a.v < b.v || (a.v == b.v && a.id > b.id); }

static void heap_sift_down(ranked *h, size_t n, size_t i) {
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && worse(h[l], h[m])) m = l;
        if (r < n && worse(h[r], h[m])) m = r;
        if (m == i) return;
        ranked t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

/* The k best of x[0..n) (largest values, ties to the lowest id), best
 * first, into h (k entries). Values that are not > -inf are skipped when
 * finite_only. Returns how many were found (< k only when n or the finite
 * values run out). O(n log k) worst case, about n compares typically. */
static size_t top_by_heap(const float *x, size_t n, size_t k, bool finite_only, ranked *h) {
    size_t m = 0;
    size_t i = 0;
    for (; i < n && m < k; i++) {
        if (finite_only && !(x[i] > -INFINITY)) continue;
        h[m] = (ranked){x[i], (int32_t)i};
        /* sift up */
        size_t c = m++;
        while (c > 0) {
            size_t p = (c - 1) / 2;
            if (!worse(h[c], h[p])) break;
            ranked t = h[c];
            h[c] = h[p];
            h[p] = t;
            c = p;
        }
    }
    if (m == k) {
        float thr = h[0].v;
        /* ties lose (the heap holds lower ids), so only v > thr enters;
         * eight at a time, most blocks have none */
        while (i < n) {
            if (i + 8 <= n) {
                const v4f t = v4_splat(thr);
                const v4i gt = (v4_load(x + i) > t) | (v4_load(x + i + 4) > t);
                if (!(gt[0] | gt[1] | gt[2] | gt[3])) {
                    i += 8;
                    continue;
                }
            }
            const size_t e = i + 8 < n ? i + 8 : n;
            for (; i < e; i++) {
                const float v = x[i];
                if (!(v > thr)) continue;
                h[0] = (ranked){v, (int32_t)i};
                heap_sift_down(h, m, 0);
                thr = h[0].v;
            }
        }
    }
    /* heapsort in place: the worst goes to the end, so best ends first */
    for (size_t e = m; e > 1; e--) {
        ranked t = h[0];
        h[0] = h[e - 1];
        h[e - 1] = t;
        heap_sift_down(h, e - 1, 0);
    }
    return m;
}

/* ---- sampling ----------------------------------------------------------------- */

/* Weights of every token (min-p folded in when thr > 0) into s->w and the
 * block sums into s->blocks; returns the total. */
static double weights_all(pd_sampler *s, const float *x, float xmax, float inv_t, float thr) {
    const size_t n = (size_t)s->n_vocab;
    float *w = s->w;
    double total = 0.0;
    size_t nb = 0;
    for (size_t b = 0; b < n; b += SUM_BLOCK) {
        const size_t e = b + SUM_BLOCK < n ? b + SUM_BLOCK : n;
        v4f acc = v4_splat(0.0f);
        size_t i = b;
        for (; i + 4 <= e; i += 4) {
            v4f v = v4_tempered(v4_load(x + i), xmax, inv_t);
            if (thr > 0.0f) v = (v4f)((v4i)v & (v >= v4_splat(thr)));
            v4_store(w + i, v);
            acc += v;
        }
        float tail = 0.0f;
        for (; i < e; i++) {
            float v = tempered1(x[i], xmax, inv_t);
            if (v < thr) v = 0.0f;
            w[i] = v;
            tail += v;
        }
        double bs = (double)acc[0] + (double)acc[1] + (double)acc[2] + (double)acc[3] + tail;
        s->blocks[nb++] = bs;
        total += bs;
    }
    return total;
}

/* The block a uniform draw u in [0, total) falls into, skipping empty blocks
 * (rounding can leave u past the last sum: the last non-empty block then);
 * *base receives the sum of the blocks before it. SIZE_MAX if all are empty. */
static size_t pick_block(const double *blocks, size_t nb, double u, double *base) {
    double acc = 0.0;
    size_t blk = SIZE_MAX;
    for (size_t b = 0; b < nb; b++) {
        if (!(blocks[b] > 0.0)) continue;
        blk = b;
        *base = acc;
        if (u < acc + blocks[b]) break;
        acc += blocks[b];
    }
    return blk;
}

/* Draw from the weights of every token: find the block, then the token. */
static pd_token walk_all(pd_sampler *s, double total) {
    const size_t n = (size_t)s->n_vocab;
    const size_t nb = (n + SUM_BLOCK - 1) / SUM_BLOCK;
    const double u = rng_double(s) * total;
    double base = 0.0;
    const size_t blk = pick_block(s->blocks, nb, u, &base);
    if (blk == SIZE_MAX) return PD_TOKEN_NULL;
    const size_t e = (blk + 1) * SUM_BLOCK < n ? (blk + 1) * SUM_BLOCK : n;
    const double u2 = u - base;
    double a2 = 0.0;
    pd_token last = PD_TOKEN_NULL;
    for (size_t i = blk * SUM_BLOCK; i < e; i++) {
        const float wi = s->w[i];
        if (wi > 0.0f) {
            a2 += wi;
            last = (pd_token)i;
            if (u2 < a2) return last;
        }
    }
    return last; /* rounding between the block sum and this walk */
}

/* Draw from the candidates list[0..n) with weights w (those below thr
 * count as 0): block sums first (four float accumulators per block of
 * SUM_BLOCK / 4 entries), then the block, then the token. */
static pd_token walk_list(pd_sampler *s, const int32_t *list, size_t n, float thr) {
    const float *w = s->w;
    const size_t bl = SUM_BLOCK / 4;
    double total = 0.0;
    size_t nb = 0;
    for (size_t b = 0; b < n; b += bl) {
        const size_t e = b + bl < n ? b + bl : n;
        float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        size_t j = b;
        for (; j + 4 <= e; j += 4)
            for (int l = 0; l < 4; l++) {
                const float wi = w[list[j + (size_t)l]];
                a[l] += wi >= thr ? wi : 0.0f;
            }
        for (; j < e; j++) {
            const float wi = w[list[j]];
            a[0] += wi >= thr ? wi : 0.0f;
        }
        const double bs = (double)a[0] + (double)a[1] + (double)a[2] + (double)a[3];
        s->blocks[nb++] = bs;
        total += bs;
    }
    const double u = rng_double(s) * total;
    double base = 0.0;
    const size_t blk = pick_block(s->blocks, nb, u, &base);
    if (blk == SIZE_MAX) return PD_TOKEN_NULL;
    const size_t e = (blk + 1) * bl < n ? (blk + 1) * bl : n;
    const double u2 = u - base;
    double a2 = 0.0;
    pd_token last = PD_TOKEN_NULL;
    for (size_t j = blk * bl; j < e; j++) {
        const float wi = w[list[j]];
        if (wi > 0.0f && wi >= thr) {
            a2 += wi;
            last = list[j];
            if (u2 < a2) return last;
        }
    }
    return last; /* rounding between the block sum and this walk */
}

/* Steps 4-8 on adjusted logits x whose maximum is xmax (finite). */
static pd_token sample_dist(pd_sampler *s, const float *x, float xmax) {
    const size_t n = (size_t)s->n_vocab;
    const float inv_t = 1.0f / s->p.temperature;
    const float thr = s->p.min_p; /* see below */
    const bool topk = s->p.top_k > 0 && (size_t)s->p.top_k < n;
    const bool topp = s->p.top_p < 1.0f;
    float *w = s->w;

    /* min-p: the most likely token always survives top-k and top-p and has
     * weight exactly 1, so p_i >= min_p * p_max is w_i >= min_p. */
    if (!topk && !topp) return walk_all(s, weights_all(s, x, xmax, inv_t, thr));

    const int32_t *list = NULL; /* NULL: every token */
    size_t n_list = n;
    bool sorted = false; /* list is by logit descending, ties by id */
    bool topp_done = false;
    if (topk) {
        const size_t k = (size_t)s->p.top_k;
        if (k <= HEAP_MAX) {
            n_list = top_by_heap(x, n, k, false, s->heap);
            for (size_t j = 0; j < n_list; j++) s->cand[j] = s->heap[j].id;
            sorted = true;
        } else {
            n_list = radix_select(s, x, NULL, NULL, n, k, 0.0, s->cand, s->tmp);
        }
        list = s->cand;
        for (size_t j = 0; j < n_list; j++) w[list[j]] = tempered1(x[list[j]], xmax, inv_t);
    } else {
        /* Top-p over the whole vocabulary. Tokens with w < tau = (1-p) Z / n
         * weigh less than (1-p) Z together, so the tokens kept by top-p
         * (mass >= p Z) are all among those with w >= tau: select from
         * those only. With real logits that is a few hundred tokens. */
        const double z = weights_all(s, x, xmax, inv_t, 0.0f);
        const float tau = (float)((1.0 - (double)s->p.top_p) * z / (double)n) * 0.5f;
        v4i cnt = {0, 0, 0, 0};
        size_t i = 0;
        for (; i + 4 <= n; i += 4) cnt -= v4_load(w + i) >= v4_splat(tau);
        size_t m = (size_t)cnt[0] + (size_t)cnt[1] + (size_t)cnt[2] + (size_t)cnt[3];
        for (; i < n; i++) m += w[i] >= tau;
        /* a flat distribution keeps most tokens: then scan them in place */
        const bool all = m > n / 4;
        if (!all) {
            m = 0;
            for (i = 0; i + 4 <= n; i += 4) {
                const v4i ge = v4_load(w + i) >= v4_splat(tau);
                if (!(ge[0] | ge[1] | ge[2] | ge[3])) continue;
                for (int l = 0; l < 4; l++) {
                    s->cand[m] = (int32_t)(i + (size_t)l); /* branch-free append */
                    m += (size_t)(ge[l] & 1);
                }
            }
            for (; i < n; i++) {
                s->cand[m] = (int32_t)i;
                m += w[i] >= tau;
            }
        }
        n_list = radix_select(s, x, w, all ? NULL : s->cand, all ? n : m, 0,
                              (double)s->p.top_p * z, s->cand, s->tmp);
        list = s->cand;
        topp_done = true;
    }
    if (topp && !topp_done) {
        if (sorted) {
            double z = 0.0;
            for (size_t j = 0; j < n_list; j++) z += w[list[j]];
            const double target = (double)s->p.top_p * z;
            double c = 0.0;
            size_t j = 0;
            while (j < n_list) {
                c += w[list[j++]];
                if (c >= target) break;
            }
            n_list = j;
        } else {
            double z = 0.0;
            for (size_t j = 0; j < n_list; j++) z += w[list[j]];
            n_list = radix_select(s, x, w, list, n_list, 0, (double)s->p.top_p * z, s->cand,
                                  s->tmp);
            list = s->cand;
        }
    }
    return walk_list(s, list, n_list, thr);
}

static void fill_logprobs(pd_sampler *s, const float *x, float xmax, pd_sample_result *out) {
    const size_t n = (size_t)s->n_vocab;
    const double lz = (double)xmax + log(sum_exp(x, n, xmax));
    out->has_logprob = true;
    out->logprob = (float)((double)x[out->token] - lz);
    if (s->p.n_logprobs <= 0) return;
    ranked top[PD_SAMPLER_MAX_LOGPROBS];
    size_t m = top_by_heap(x, n, (size_t)s->p.n_logprobs, true, top);
    out->n_top = (int32_t)m;
    for (size_t j = 0; j < m; j++) {
        out->top[j].token = top[j].id;
        out->top[j].logprob = (float)((double)top[j].v - lz);
    }
}

int pd_sampler_sample(pd_sampler *s, const float *logits, pd_sample_result *out, pd_error *err) {
    if (!s || !logits || !out)
        return pd_errorf(err, PD_EINVAL, "pd_sampler_sample: NULL argument");
    memset(out, 0, sizeof *out);
    out->token = PD_TOKEN_NULL;
    const size_t n = (size_t)s->n_vocab;
    const float *x = logits;
    if (mods_pending(s)) {
        memcpy(s->eff, logits, n * sizeof *s->eff);
        apply_mods(s, s->eff);
        x = s->eff;
    }

    bool bad = false;
    const float xmax = max_scan(x, n, &bad);
    if (bad) {
        size_t i = 0;
        while (i < n && x[i] <= FLT_MAX) i++;
        bool raw_bad = !(logits[i] <= FLT_MAX);
        return pd_errorf(err, PD_ERANGE,
                         "sampler: logit of token %zu is %s%s; the model produced non-finite "
                         "logits",
                         i, isnan(x[i]) ? "NaN" : "+inf",
                         raw_bad ? "" : " after logit bias and penalties");
    }
    if (!(xmax > -INFINITY))
        return pd_errorf(err, PD_ERANGE,
                         "sampler: every token is banned (logit_bias) or has a -inf logit; "
                         "nothing can be sampled");

    if (s->p.temperature == 0.0f) {
        size_t i = 0;
        while (x[i] != xmax) i++; /* the lowest id among the maxima */
        out->token = (pd_token)i;
    } else {
        out->token = sample_dist(s, x, xmax);
    }
    if (out->token == PD_TOKEN_NULL) /* cannot happen: the maximum always survives */
        return pd_errorf(err, PD_ERANGE, "sampler: no candidate survived truncation");
    if (s->p.logprobs || s->p.n_logprobs > 0) fill_logprobs(s, x, xmax, out);
    return PD_OK;
}
