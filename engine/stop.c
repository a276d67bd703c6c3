/* Stop strings across token boundaries, UTF-8-safe streaming, and the
 * per-request generation limits (EOG tokens, max_tokens, finish reasons).
 * See the stop-string section of engine/engine.h. */

#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"

struct pd_stop_matcher {
    char **stops;
    size_t *lens;
    size_t n;
    char *buf;       /* bytes fed and not yet returned, after `consumed` returned ones */
    size_t len, cap;
    size_t consumed; /* front bytes returned by the last call; dropped by the next */
    bool matched;
    int32_t match_index;
};

void pd_stop_free(pd_stop_matcher *m) {
    if (!m) return;
    for (size_t i = 0; i < m->n; i++) free(m->stops[i]);
    free(m->stops);
    free(m->lens);
    free(m->buf);
    free(m);
}

int pd_stop_create(const char *const *stops, const size_t *lens, size_t n,
                   pd_stop_matcher **out, pd_error *err) {
    if (!out) return pd_errorf(err, PD_EINVAL, "pd_stop_create: NULL output");
    *out = NULL;
    if (n > PD_STOP_MAX_STRINGS)
        return pd_errorf(err, PD_EINVAL, "stop: at most %d stop strings are allowed; got %zu",
                         PD_STOP_MAX_STRINGS, n);
    if (n > 0 && !stops) return pd_errorf(err, PD_EINVAL, "stop: %zu strings but no array", n);
    for (size_t i = 0; i < n; i++) {
        if (!stops[i]) return pd_errorf(err, PD_EINVAL, "stop[%zu] is NULL", i);
        size_t l = lens ? lens[i] : strlen(stops[i]);
        if (l == 0) return pd_errorf(err, PD_EINVAL, "stop[%zu] is an empty string; stop strings must not be empty", i);
        if (l > PD_STOP_MAX_LEN)
            return pd_errorf(err, PD_EINVAL, "stop[%zu] is %zu bytes long; the limit is %d", i, l,
                             PD_STOP_MAX_LEN);
    }
    pd_stop_matcher *m = calloc(1, sizeof *m);
    if (!m) return pd_errorf(err, PD_ENOMEM, "stop: out of memory");
    m->match_index = -1;
    size_t max_len = 0;
    if (n > 0) {
        m->stops = calloc(n, sizeof *m->stops);
        m->lens = calloc(n, sizeof *m->lens);
        if (!m->stops || !m->lens) goto oom;
        for (size_t i = 0; i < n; i++) {
            size_t l = lens ? lens[i] : strlen(stops[i]);
            m->stops[i] = malloc(l);
            if (!m->stops[i]) goto oom;
            memcpy(m->stops[i], stops[i], l);
            m->lens[i] = l;
            m->n = i + 1;
            if (l > max_len) max_len = l;
        }
    }
    m->cap = max_len + 256;
    m->buf = malloc(m->cap);
    if (!m->buf) goto oom;
    *out = m;
    return PD_OK;
oom:
    pd_stop_free(m);
    return pd_errorf(err, PD_ENOMEM, "stop: out of memory");
}

void pd_stop_reset(pd_stop_matcher *m) {
    if (!m) return;
    m->len = m->consumed = 0;
    m->matched = false;
    m->match_index = -1;
}

size_t pd_stop_held(const pd_stop_matcher *m) { return m->len - m->consumed; }

/* Largest e <= end such that buf[0..e) does not end inside a UTF-8
 * character that later bytes could complete. Malformed bytes are not held
 * (waiting would not fix them). */
static size_t utf8_safe_end(const char *buf, size_t end) {
    size_t i = end, cont = 0;
    while (i > 0 && cont < 3 && ((unsigned char)buf[i - 1] & 0xC0) == 0x80) {
        i--;
        cont++;
    }
    if (i == 0) return end;
    unsigned char c = (unsigned char)buf[i - 1];
    size_t need;
    if ((c & 0xE0) == 0xC0) need = 2;
    else if ((c & 0xF0) == 0xE0) need = 3;
    else if ((c & 0xF8) == 0xF0) need = 4;
    else return end; /* ASCII, or not a lead byte */
    return cont + 1 < need ? i - 1 : end;
}

static void drop_consumed(pd_stop_matcher *m) {
    if (m->consumed == 0) return;
    memmove(m->buf, m->buf + m->consumed, m->len - m->consumed);
    m->len -= m->consumed;
    m->consumed = 0;
}

static void set_result(pd_stop_result *out, const char *text, size_t len, const pd_stop_matcher *m) {
    out->text = text;
    out->len = len;
    out->matched = m->matched;
    out->stop_index = m->match_index;
}

int pd_stop_feed(pd_stop_matcher *m, const char *bytes, size_t len, pd_stop_result *out,
                 pd_error *err) {
    if (!m || !out || (len > 0 && !bytes))
        return pd_errorf(err, PD_EINVAL, "pd_stop_feed: NULL argument");
    if (m->matched) {
        m->consumed = m->len;
        set_result(out, m->buf, 0, m);
        return PD_OK;
    }
    drop_consumed(m);
    if (len > m->cap - m->len) {
        size_t cap = m->cap * 2;
        if (cap < m->len + len) cap = m->len + len;
        char *nb = realloc(m->buf, cap);
        if (!nb) return pd_errorf(err, PD_ENOMEM, "stop: out of memory buffering %zu bytes", cap);
        m->buf = nb;
        m->cap = cap;
    }
    const size_t old = m->len;
    if (len > 0) memcpy(m->buf + m->len, bytes, len);
    m->len += len;

    /* The stop string occurrence that is complete first (earliest end),
     * then the earliest start, then the first listed: the same answer
     * however the text is cut into pieces. The bytes held before this call
     * had no occurrence, so one must end in the new bytes. */
    size_t best = SIZE_MAX, best_end = SIZE_MAX;
    int32_t best_i = -1;
    for (size_t i = 0; i < m->n; i++) {
        const size_t sl = m->lens[i];
        if (sl > m->len) continue;
        size_t from = old >= sl ? old - sl + 1 : 0;
        const char *hit = memmem(m->buf + from, m->len - from, m->stops[i], sl);
        if (!hit) continue;
        size_t start = (size_t)(hit - m->buf), end = start + sl;
        if (end < best_end || (end == best_end && start < best)) {
            best = start;
            best_end = end;
            best_i = (int32_t)i;
        }
    }
    if (best_i >= 0) {
        m->matched = true;
        m->match_index = best_i;
        m->consumed = m->len; /* nothing after the emitted text matters any more */
        set_result(out, m->buf, best, m);
        return PD_OK;
    }

    /* Hold back the longest suffix that is a proper prefix of a stop string. */
    size_t hold = 0;
    for (size_t i = 0; i < m->n; i++) {
        size_t l = m->lens[i] - 1;
        if (l > m->len) l = m->len;
        for (; l > hold; l--) {
            if (memcmp(m->buf + m->len - l, m->stops[i], l) == 0) {
                hold = l;
                break;
            }
        }
    }
    size_t e = utf8_safe_end(m->buf, m->len - hold);
    m->consumed = e;
    set_result(out, m->buf, e, m);
    return PD_OK;
}

void pd_stop_finish(pd_stop_matcher *m, pd_stop_result *out) {
    if (m->matched) {
        m->consumed = m->len;
        set_result(out, m->buf, 0, m);
        return;
    }
    /* Held bytes follow the last emitted chunk directly in buf. */
    size_t from = m->consumed;
    m->consumed = m->len;
    set_result(out, m->buf + from, m->len - from, m);
}

/* ---- generation --------------------------------------------------------------- */

const char *pd_finish_reason_name(pd_finish_reason r) {
    switch (r) {
    case PD_FINISH_STOP: return "stop";
    case PD_FINISH_LENGTH: return "length";
    case PD_FINISH_NONE: break;
    }
    return NULL;
}

struct pd_generation {
    const pd_tokenizer *tok;
    int32_t max_tokens;
    bool ignore_eos, special;
    pd_stop_matcher *stop;
    char *piece;
    size_t piece_cap;
    char *out; /* text of the current step */
    size_t out_len, out_cap;
    int32_t n_tokens;
    pd_finish_reason finish;
    int32_t stop_index;
};

void pd_generation_free(pd_generation *g) {
    if (!g) return;
    pd_stop_free(g->stop);
    free(g->piece);
    free(g->out);
    free(g);
}

int pd_generation_create(const pd_tokenizer *tok, const pd_generation_params *p,
                         pd_generation **out, pd_error *err) {
    if (!out) return pd_errorf(err, PD_EINVAL, "pd_generation_create: NULL output");
    *out = NULL;
    if (!tok || !p) return pd_errorf(err, PD_EINVAL, "pd_generation_create: NULL argument");
    if (p->max_tokens <= 0)
        return pd_errorf(err, PD_EINVAL, "max_tokens must be > 0; got %d", (int)p->max_tokens);
    pd_generation *g = calloc(1, sizeof *g);
    if (!g) return pd_errorf(err, PD_ENOMEM, "generation: out of memory");
    g->tok = tok;
    g->max_tokens = p->max_tokens;
    g->ignore_eos = p->ignore_eos;
    g->special = p->special;
    g->stop_index = -1;
    int rc = pd_stop_create(p->stop, NULL, p->n_stop, &g->stop, err);
    if (rc) {
        pd_generation_free(g);
        return rc;
    }
    g->piece_cap = 256;
    g->out_cap = 512;
    g->piece = malloc(g->piece_cap);
    g->out = malloc(g->out_cap);
    if (!g->piece || !g->out) {
        pd_generation_free(g);
        return pd_errorf(err, PD_ENOMEM, "generation: out of memory");
    }
    *out = g;
    return PD_OK;
}

static int out_append(pd_generation *g, const char *p, size_t n, pd_error *err) {
    if (n == 0) return PD_OK;
    if (n > g->out_cap - g->out_len) {
        size_t cap = g->out_cap * 2;
        if (cap < g->out_len + n) cap = g->out_len + n;
        char *nb = realloc(g->out, cap);
        if (!nb) return pd_errorf(err, PD_ENOMEM, "generation: out of memory");
        g->out = nb;
        g->out_cap = cap;
    }
    memcpy(g->out + g->out_len, p, n);
    g->out_len += n;
    return PD_OK;
}

static void fill_step(const pd_generation *g, pd_generation_step *out, bool eog) {
    out->text = g->out;
    out->len = g->out_len;
    out->finish = g->finish;
    out->stop_index = g->stop_index;
    out->eog = eog;
}

/* Flush what the stop matcher holds into the step text. */
static int flush(pd_generation *g, pd_error *err) {
    pd_stop_result r;
    pd_stop_finish(g->stop, &r);
    return out_append(g, r.text, r.len, err);
}

int pd_generation_push(pd_generation *g, pd_token token, pd_generation_step *out, pd_error *err) {
    if (!g || !out) return pd_errorf(err, PD_EINVAL, "pd_generation_push: NULL argument");
    memset(out, 0, sizeof *out);
    out->stop_index = -1;
    if (g->finish != PD_FINISH_NONE)
        return pd_errorf(err, PD_EINVAL, "generation already finished (%s); token %d not accepted",
                         pd_finish_reason_name(g->finish), (int)token);
    if (token < 0 || token >= pd_tokenizer_n_vocab(g->tok))
        return pd_errorf(err, PD_EINVAL, "generation: token %d is outside the vocabulary [0, %d)",
                         (int)token, (int)pd_tokenizer_n_vocab(g->tok));
    g->out_len = 0;
    g->n_tokens++;
    bool eog = false;
    int rc;
    if (!g->ignore_eos && pd_tokenizer_is_eog(g->tok, token)) {
        eog = true;
        g->finish = PD_FINISH_STOP;
        if ((rc = flush(g, err))) return rc;
    } else {
        int n = pd_token_to_piece(g->tok, token, g->special, g->piece, g->piece_cap);
        if (n < 0) return pd_errorf(err, n, "generation: cannot render token %d", (int)token);
        if ((size_t)n > g->piece_cap) {
            char *nb = realloc(g->piece, (size_t)n);
            if (!nb) return pd_errorf(err, PD_ENOMEM, "generation: out of memory");
            g->piece = nb;
            g->piece_cap = (size_t)n;
            n = pd_token_to_piece(g->tok, token, g->special, g->piece, g->piece_cap);
            if (n < 0) return pd_errorf(err, n, "generation: cannot render token %d", (int)token);
        }
        pd_stop_result r;
        if ((rc = pd_stop_feed(g->stop, g->piece, (size_t)n, &r, err))) return rc;
        if ((rc = out_append(g, r.text, r.len, err))) return rc;
        if (r.matched) {
            g->finish = PD_FINISH_STOP;
            g->stop_index = r.stop_index;
        }
    }
    if (g->finish == PD_FINISH_NONE && g->n_tokens >= g->max_tokens) {
        g->finish = PD_FINISH_LENGTH;
        if ((rc = flush(g, err))) return rc;
    }
    fill_step(g, out, eog);
    return PD_OK;
}

void pd_generation_finish(pd_generation *g, pd_finish_reason reason, pd_generation_step *out) {
    memset(out, 0, sizeof *out);
    g->out_len = 0;
    if (g->finish == PD_FINISH_NONE) {
        g->finish = reason == PD_FINISH_NONE ? PD_FINISH_LENGTH : reason;
        pd_stop_result r;
        pd_stop_finish(g->stop, &r);
        if (out_append(g, r.text, r.len, NULL) != PD_OK) g->out_len = 0;
    }
    fill_step(g, out, false);
}

int32_t pd_generation_n_tokens(const pd_generation *g) { return g->n_tokens; }
int32_t pd_generation_tokens_left(const pd_generation *g) { return g->max_tokens - g->n_tokens; }
pd_finish_reason pd_generation_finish_reason(const pd_generation *g) { return g->finish; }
