/* Private to engine/tokenizer: the loaded vocabulary and the pieces the
 * tokenizers share. Nothing outside engine/ includes this header.
 *
 * A pd_tokenizer is immutable after pd_tokenizer_load(); every tokenize or
 * decode call keeps its working state on its own stack/heap, so one
 * tokenizer may be used from many threads at once. */
#ifndef PD_TOKENIZER_INTERNAL_H
#define PD_TOKENIZER_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"

/* Token attributes (llama.cpp's llama_token_attr bits: a token has one type
 * bit plus optional strip flags). */
enum {
    TK_ATTR_UNDEFINED = 0,
    TK_ATTR_UNKNOWN = 1u << 0,
    TK_ATTR_UNUSED = 1u << 1,
    TK_ATTR_NORMAL = 1u << 2,
    TK_ATTR_CONTROL = 1u << 3,
    TK_ATTR_USER_DEFINED = 1u << 4,
    TK_ATTR_BYTE = 1u << 5,
    TK_ATTR_LSTRIP = 1u << 7,
    TK_ATTR_RSTRIP = 1u << 8,
};

typedef struct tk_token {
    uint32_t off;  /* token text in t->text (NUL-terminated there) */
    uint32_t len;
    uint32_t piece_off; /* decoded piece (special = true) in t->pieces */
    uint32_t piece_len;
    float score;
    uint16_t attr;
    uint8_t type; /* tokenizer.ggml.token_type as stored (pd_token_type) */
    uint8_t eog;  /* ends generation */
} tk_token;

/* Open-addressing hash table of uint32 entry indices (0 = empty slot, so
 * entry i is stored as i + 1). Keys are compared through the owner's data. */
typedef struct tk_table {
    uint32_t *slots;
    uint64_t mask; /* capacity - 1, capacity a power of two */
} tk_table;

typedef struct tk_merge {
    uint32_t left_off, left_len;   /* in t->merge_text */
    uint32_t right_off, right_len;
    uint32_t rank;
} tk_merge;

/* Pre-tokenizers (tokenizer.ggml.pre) that have their own regex list. */
typedef enum tk_pre {
    TK_PRE_DEFAULT = 0,
    TK_PRE_LLAMA3,
    TK_PRE_DEEPSEEK_LLM,
    TK_PRE_DEEPSEEK_CODER,
    TK_PRE_FALCON,
    TK_PRE_GPT2,      /* also mpt, olmo, jais, gpt-2 aliases */
    TK_PRE_STARCODER, /* also refact, command-r, smollm, codeshell, exaone, minerva */
    TK_PRE_QWEN2,     /* also stablelm2, deepseek-r1-qwen, megrez */
    TK_PRE_PORO,      /* also bloom, gpt3-finnish */
    TK_PRE_CHATGLM4,
    TK_PRE_VIKING,
    TK_PRE_TEKKEN,
    TK_PRE_CHAMELEON,
} tk_pre;

struct pd_tokenizer {
    pd_vocab_kind kind;
    tk_pre pre;
    char pre_name[32]; /* canonical name in effect */

    int32_t n_tokens;
    tk_token *tokens;
    char *text;      /* all token texts, each NUL-terminated */
    char *pieces;    /* decoded pieces (token_to_piece with special = true) */
    tk_table vocab;  /* text -> id (last id wins on duplicates, like llama.cpp) */
    uint32_t max_token_len;

    /* BPE merges: (left, right) -> rank (first occurrence wins). */
    tk_merge *merges;
    uint32_t n_merges;
    char *merge_text;
    tk_table merge_map;

    pd_token bos, eos, eot, eom, unk, sep, pad, mask;
    pd_token fim_pre, fim_suf, fim_mid, fim_pad, fim_rep, fim_sep;

    bool add_bos, add_eos, add_space_prefix, ignore_merges, clean_spaces;

    /* Tokens split out of the text before the model tokenizer runs
     * (CONTROL, USER_DEFINED, UNKNOWN), longest text first. */
    pd_token *special;
    uint32_t n_special;
    /* For a fast "which special texts occur at all" pre-pass: a table from
     * text to the first special index with that text (special_rep[i] is
     * that index for special i), the distinct text lengths (ascending) and
     * the possible first bytes. */
    tk_table special_map;
    uint32_t *special_rep;
    uint32_t *special_lens;
    uint32_t n_special_lens;
    uint8_t special_first[32];

    /* BPE pre-tokenizer: compiled once (pcre2_code *), matched with
     * per-call match data. */
    void **regex;
    uint32_t n_regex;
};

/* ---- hash tables (vocab.c) ------------------------------------------- */

uint64_t tk_hash_bytes(const void *p, size_t n);
/* Id of the token whose text is exactly s[0..n), or PD_TOKEN_NULL. */
pd_token tk_lookup(const pd_tokenizer *t, const char *s, size_t n);
/* Rank of merging left and right, or -1. */
int32_t tk_merge_rank(const pd_tokenizer *t, const char *l, size_t ln, const char *r, size_t rn);

static inline const char *tk_text(const pd_tokenizer *t, pd_token id) {
    return t->text + t->tokens[id].off;
}

/* Index (into t->special) of the first special token whose text is s[0..n),
 * or -1. */
int32_t tk_special_lookup(const pd_tokenizer *t, const char *s, size_t n);

/* ---- growable outputs ------------------------------------------------- */

typedef struct tk_ids {
    pd_token *v;
    size_t n, cap;
} tk_ids;
int tk_ids_push(tk_ids *ids, pd_token id);

typedef struct tk_buf {
    char *p;
    size_t n, cap;
} tk_buf;
int tk_buf_reserve(tk_buf *b, size_t extra);
int tk_buf_append(tk_buf *b, const void *data, size_t n);

/* ---- merge queue (vocab.c) ---------------------------------------------
 * A binary min-heap of candidate merges: smaller key first, ties broken by
 * the leftmost position (SPM uses key = -score, BPE key = rank). */

typedef struct tk_bigram {
    double key;
    int32_t left, right;
    uint32_t size; /* bytes of left + right when queued */
} tk_bigram;

typedef struct tk_heap {
    tk_bigram *v;
    size_t n, cap;
} tk_heap;
int tk_heap_push(tk_heap *h, tk_bigram b);
tk_bigram tk_heap_pop(tk_heap *h); /* h->n must be > 0 */

/* A symbol of the merge loops: a byte range of the working string, linked
 * to its neighbours; n == 0 once merged away. */
typedef struct tk_sym {
    int32_t prev, next;
    uint32_t off, n;
} tk_sym;
/* Split s[0..len) into one linked symbol per UTF-8 character (length from
 * the lead byte, clipped at the end); sym has room for len entries. Returns
 * the number of symbols. */
int32_t tk_split_symbols(const char *s, size_t len, tk_sym *sym);

/* ---- unicode helpers (unicode.c) -------------------------------------- */

/* UTF-8 sequence length from the lead byte's high nibble (llama.cpp's
 * unicode_len_utf8: continuation bytes count as 1). */
static inline size_t tk_utf8_len(unsigned char c) {
    static const unsigned char lut[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return lut[c >> 4];
}
/* Decode one code point at s[*i] (n bytes total), advancing *i. Returns
 * -1 for an invalid or truncated sequence (and advances by one byte). */
int32_t tk_utf8_decode(const unsigned char *s, size_t n, size_t *i);
/* Encode cp into out (4 bytes at most); returns the length. */
size_t tk_utf8_encode(uint32_t cp, char *out);
/* White_Space, exactly llama.cpp's unicode_set_whitespace (25 code points). */
bool tk_is_whitespace(uint32_t cp);
/* GPT-2 byte-level mapping: byte -> code point, and back (-1 if cp is not
 * the image of a byte). */
uint32_t tk_byte_to_cp(uint8_t b);
int tk_cp_to_byte(uint32_t cp);

/* ---- model tokenizers -------------------------------------------------- */

int tk_spm_tokenize(const pd_tokenizer *t, const char *text, size_t len, tk_ids *out);
int tk_bpe_tokenize(const pd_tokenizer *t, const char *text, size_t len, tk_ids *out,
                    pd_error *err);
int tk_wpm_tokenize(const pd_tokenizer *t, const char *text, size_t len, tk_ids *out);

/* Pre-tokenizer table (pretok.c). */
typedef struct tk_pre_info {
    tk_pre pre;
    const char *canonical;
    bool clean_spaces;
    bool ignore_merges;
    bool add_bos; /* forces add_bos = true before add_bos_token is read */
    bool no_bos;  /* chatglm-bpe: no BOS token */
} tk_pre_info;
/* Look up a tokenizer.ggml.pre value; false if unsupported. */
bool tk_pre_find(const char *name, size_t len, tk_pre_info *out);
/* Comma-separated list of supported names, for error messages. */
const char *tk_pre_supported(void);
/* Compile the regex list for t->pre into t->regex. */
int tk_pre_compile(pd_tokenizer *t, pd_error *err);
void tk_pre_free(pd_tokenizer *t);

/* Split text by the pre-tokenizer's regex list (llama.cpp's
 * unicode_regex_split without the byte encoding): *spans receives n pairs
 * (offset, length) into text. Malloc'd; caller frees. */
int tk_pre_split(const pd_tokenizer *t, const char *text, size_t len, size_t **spans,
                 size_t *n_spans, pd_error *err);

/* Build t->pieces (decode.c). */
int tk_build_pieces(pd_tokenizer *t, pd_error *err);

#endif
