/* tools: admin CLI helpers and the test-model generator.
 *
 * This header is the folder's public contract. */
#ifndef PD_TOOLS_H
#define PD_TOOLS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/kernels.h"
#include "policies/policies.h"
#include "util/util.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------
 * Progress of long work (tools/progress.c)
 *
 * On stderr. When stderr is a terminal: one line redrawn in place,
 * "[#####     ]  42% phase", erased by pd_progress_end. Otherwise (a pipe,
 * a log file): one line per phase, its name, printed when the phase
 * changes; fractions are not printed, so logs stay short and stable.
 * stdout is never touched.
 * ------------------------------------------------------------------------ */

typedef struct pd_progress {
    bool tty;            /* stderr is a terminal */
    bool drawn;          /* a refreshed line is on screen (tty) */
    int shown_pct;
    char phase[64];      /* the last phase shown */
} pd_progress;

void pd_progress_init(pd_progress *p);
/* fraction in [0, 1] of the whole work (clamped). */
void pd_progress_update(pd_progress *p, const char *phase, double fraction);
/* Erases the refreshed line (tty); call before printing anything else to
 * the terminal. A later update draws it again. */
void pd_progress_end(pd_progress *p);

/* ------------------------------------------------------------------------
 * Test-model generator
 *
 * Writes a GGUF model with llama.cpp's exact tensor names, shapes and
 * metadata keys for the `llama`, `qwen2`, `qwen3`, `gemma2`, `gemma3` or
 * `phi3` architecture, filled with seeded pseudo-random weights: matrices
 * ~ N(0, 0.02^2) (sum-of-12-uniforms approximation, computed with exact
 * integer/IEEE arithmetic so the same options give a byte-identical file on
 * every machine), norm weights 1.0, biases ~ N(0, 0.02^2). Each tensor's
 * values depend only on (seed, tensor name), never on its storage type, so
 * a Q8_0 model holds the quantized values of the F32 model with the same
 * seed.
 *
 * Such weights give an almost flat next-token distribution (perplexity
 * close to n_vocab), which cannot tell a right forward pass from a wrong
 * one. `peaked` weights can: matrices ~ N(0, 1/cols) so every layer moves
 * the residual stream; the vocabulary matrices' rows get element 0 set to
 * D (1 + a_j), a constant "bias" feature that grows with a prior a_j: the
 * log of the token's count in a greedy longest match of a built-in English
 * text, scaled to [0, 1] (0 for normal tokens it does not use, -0.5 for
 * control, byte and unused ones), attn_norm/ffn_norm weights hide that
 * element from the layers (0), Q and K rows are drawn 3x larger (and
 * per-head Q/K norm weights are 2) so attention is sharp enough for masks
 * and windows to matter, and
 * output_norm.weight[0] sizes it so the prior spans about 6 logits on top
 * of a context-dependent spread of about 1. The next-token distribution
 * is then peaked and a text's perplexity well below n_vocab.
 *
 * Matrices are stored in `wtype`. A matrix whose row length (ne[0]) is not a
 * multiple of that type's block size falls back, as llama-quantize does, to
 * a compatible type: q4_k -> q4_0 -> f16, q6_k -> q8_0 -> f16,
 * the other 32-element types (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl) -> f16.
 * Norms and biases are always F32.
 *
 * Vocabulary: built in (a small SentencePiece-style "llama" vocab: <unk>,
 * <s>, </s>, the 256 byte tokens, then "▁", printable ASCII and common
 * English pieces with descending scores; padded with "[PAD<id>]" unused
 * tokens, or truncated, to n_vocab), or every tokenizer.* key copied from
 * another GGUF file (`vocab_from`), in which case n_vocab becomes that
 * file's token count.
 * ------------------------------------------------------------------------ */

typedef struct pd_testmodel_opts {
    const char *arch;     /* "llama", "qwen2", "qwen3", "gemma2", "gemma3" or "phi3" */
    const char *name;     /* general.name; NULL = "prefixd-test-<preset or arch>" */
    uint32_t n_vocab;     /* 0 = size of the built-in vocab */
    uint32_t n_embd;
    uint32_t n_ff;
    uint32_t n_layer;
    uint32_t n_head;
    uint32_t n_head_kv;
    uint32_t n_ctx;
    uint32_t head_dim;    /* 0 = n_embd / n_head; written as attention.key_length/value_length */
    uint32_t sliding_window; /* gemma2, gemma3, phi3: attention.sliding_window (gemma3 needs one) */
    float attn_softcap;   /* gemma2: attn_logit_softcapping (0 = key not written) */
    float final_softcap;  /* gemma2: final_logit_softcapping (0 = key not written) */
    float rope_scale;     /* > 0: rope.scaling.type "linear" with this rope.scaling.factor */
    float rope_freq_base;
    float rms_eps;
    bool tied;            /* no output.weight: the output reuses token_embd (gemma2 always) */
    bool peaked;          /* peaked weights (see above) instead of N(0, 0.02^2) everywhere */
    pd_type wtype;        /* storage type of the 2-D matrices (token_embd included) */
    uint64_t seed;
    const char *vocab_from; /* NULL = built-in vocab; else a GGUF path */
    const char *preset;   /* informational: name of the preset the shape came from */
    /* Optional: called as the file is written (phase name, fraction of the
     * tensor bytes written so far). */
    void (*progress)(void *ctx, const char *phase, double fraction);
    void *progress_ctx;
} pd_testmodel_opts;

/* What pd_testmodel_write produced. */
typedef struct pd_testmodel_info {
    uint32_t n_vocab;     /* effective vocabulary size */
    uint64_t n_tensors;
    uint64_t n_params;    /* total elements over all tensors */
    uint64_t n_fallback;  /* matrices stored in a fallback type */
    uint64_t data_bytes;  /* bytes of tensor data (without padding) */
} pd_testmodel_info;

/* Fill *o with the named preset: "tiny", "stories260k", "smollm2-135m",
 * "llama-3.2-1b", "qwen2.5-0.5b" (flat weights), "mistral-7b",
 * "qwen3-0.6b", "gemma-2-2b", "gemma-3-1b", "phi-3-mini" (peaked weights)
 * (case-insensitive). Type f32, seed 1. */
int pd_testmodel_preset(const char *name, pd_testmodel_opts *o, pd_error *err);
/* Number of presets and the name of preset i (NULL when out of range). */
size_t pd_testmodel_preset_count(void);
const char *pd_testmodel_preset_name(size_t i);

/* Check the options: arch, shape consistency (n_embd % n_head == 0, even
 * head_dim, n_head % n_head_kv == 0, ...), weight type. */
int pd_testmodel_validate(const pd_testmodel_opts *o, pd_error *err);

/* Generate the model and write it atomically to path. info may be NULL. */
int pd_testmodel_write(const pd_testmodel_opts *o, const char *path, pd_testmodel_info *info,
                       pd_error *err);

/* The float values the generator draws for tensor `name` (before they are
 * converted to the storage type). n must equal the tensor's element count. */
int pd_testmodel_tensor_values(const pd_testmodel_opts *o, const char *name, float *dst,
                               uint64_t n, pd_error *err);

/* Size of the built-in vocabulary (before padding to n_vocab). */
uint32_t pd_testmodel_builtin_vocab_size(void);

/* `prefixctl gen-model ...`: argv[0] is the subcommand name. Prints a
 * summary on stdout, errors on stderr. Returns 0 on success, 2 on a usage
 * error, 1 when generation fails. */
int pd_testmodel_cli(int argc, char **argv);

/* `prefixctl store --dir DIR list|show ID|verify [--repair]|delete ID|pin ID|unpin ID|stats`
 * (tools/store_cli.c): argv[0] is the subcommand name. Exit codes as above. */
int pd_store_cli(int argc, char **argv);

/* `prefixctl prefix [--url URL] [--token T] add|list|show ID|delete ID|job ID`
 * (tools/prefix_cli.c): the daemon's admin API over HTTP. argv[0] is the
 * subcommand name. Exit codes as above. */
int pd_prefix_cli(int argc, char **argv);

/* ------------------------------------------------------------------------
 * Offline calibration curves (tools/calibrate_cli.c)
 *
 * A curve file (CURVE.json) holds one retention->quality curve fitted by
 * `prefixctl calibrate` on a set of texts, for one policy and one model, to
 * be applied zero-shot (`prefixctl compress --curve`, the admin API's
 * `curve`). JSON:
 *   {"object": "prefixd.curve", "version": 1,
 *    "policy": canonical spec without retention (pd_curve_policy_print),
 *    "model": {"file": GGUF basename, "fingerprint": 64 hex (pd_model_fingerprint)},
 *    "a": A, "b": B, "points": [...], "holdout": H, "under_weight": W,
 *    "n_texts": K, "texts": [{"file", "tokens", "nll_full", "ratios": [...]}]}
 * ------------------------------------------------------------------------ */

typedef struct pd_curve_text {
    char file[256];             /* name inside the calibration set */
    int64_t tokens;             /* BOS included */
    double nll_full;            /* continuation NLL after the full prefix */
    double ratio[PD_CALIB_MAX_POINTS]; /* at each point */
} pd_curve_text;

typedef struct pd_curve_file {
    char policy[PD_POLICY_SPEC_MAX];  /* pd_curve_policy_print of the spec */
    char model_file[256];             /* basename of the GGUF (informational) */
    char fingerprint[2 * PD_SHA256_LEN + 1]; /* lower-case hex: what is checked */
    pd_curve curve;
    int n_points;
    double points[PD_CALIB_MAX_POINTS];
    double holdout, under_weight;
    int n_texts;
    pd_curve_text *texts;             /* [n_texts], malloc'd */
} pd_curve_file;

/* Written atomically (temporary file, then rename). */
int pd_curve_file_write(const pd_curve_file *cf, const char *path, pd_error *err);
/* Reads and validates (version, a and b positive, a policy that parses,
 * a 64-hex fingerprint, one ratio per point in every text). Free with
 * pd_curve_file_free. */
int pd_curve_file_read(const char *path, pd_curve_file *out, pd_error *err);
void pd_curve_file_free(pd_curve_file *cf);
/* PD_EINVAL unless the curve was fitted for this policy (retention aside)
 * and this model (fingerprint), with a message naming both sides. */
int pd_curve_file_check(const pd_curve_file *cf, const pd_policy_spec *spec, const uint8_t fingerprint[PD_SHA256_LEN],
                        pd_error *err);

/* `prefixctl calibrate --model F --policy SPEC --set DIR --out CURVE.json
 * [--points LIST] [--holdout F] [--under-weight W] [--threads N] [--device D]`:
 * argv[0] is the subcommand name. Exit codes as above. */
int pd_calibrate_cli(int argc, char **argv);

#ifdef __cplusplus
}
#endif
#endif
