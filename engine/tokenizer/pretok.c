/* BPE pre-tokenizers: the regex list for each tokenizer.ggml.pre value and
 * llama.cpp's unicode_regex_split semantics on top of PCRE2.
 *
 * Each regex of a list splits every current piece further: the matches AND
 * the unmatched gaps between them become pieces. Matching is confined to the
 * piece (the subject ends where the piece ends), as in llama.cpp.
 *
 * The lists below are llama.cpp's (src/llama-vocab.cpp, llm_tokenizer_bpe),
 * written in llama.cpp's syntax and translated at compile time:
 *   - `\s` / `\S` become an explicit class of the 25 White_Space code points
 *     llama.cpp uses (PCRE2's UCP `\s` also matches U+180E);
 *   - `$` means end of piece (PCRE2_DOLLAR_ENDONLY), as in ECMAScript.
 * Where llama.cpp's std::wregex path sees a different text than PCRE2 would
 * (it rewrites non-ASCII whitespace to U+000B first, so literal ranges that
 * contain such code points never match them), the ranges are narrowed by
 * hand; see docs/tokenizers.md. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer_internal.h"

/* ---- the regex lists (llama.cpp syntax) -------------------------------- */

#define RE_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"

#define RE_LLAMA3                                                                              \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|" \
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

#define RE_QWEN2                                                                               \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|" \
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

/* deepseek-llm's cased-letter class (llama.cpp spells it with literal
 * characters; these are the same code points). */
#define DS_LETTERS                                                                             \
    "A-Za-z\\x{B5}\\x{C0}-\\x{D6}\\x{D8}-\\x{F6}\\x{F8}-\\x{1BA}\\x{1BC}-\\x{1BF}\\x{1C4}-"     \
    "\\x{293}\\x{295}-\\x{2AF}\\x{370}-\\x{373}\\x{376}-\\x{377}\\x{37B}-"                      \
    "\\x{37D}\\x{37F}\\x{386}\\x{388}-\\x{38A}\\x{38C}\\x{38E}-\\x{3A1}\\x{3A3}-"               \
    "\\x{3F5}\\x{3F7}-\\x{481}\\x{48A}-\\x{52F}\\x{531}-\\x{556}\\x{10A0}-\\x{10C5}\\x{13A0}-"  \
    "\\x{13F5}\\x{13F8}-\\x{13FD}\\x{1C90}-\\x{1CBA}\\x{1CBD}-\\x{1CBF}\\x{1D00}-"              \
    "\\x{1D2B}\\x{1D6B}-\\x{1D77}\\x{1D79}-\\x{1D9A}\\x{1E00}-\\x{1F15}\\x{1F18}-"              \
    "\\x{1F1D}\\x{1F20}-\\x{1F45}\\x{1F48}-\\x{1F4D}\\x{1F50}-"                                 \
    "\\x{1F57}\\x{1F59}\\x{1F5B}\\x{1F5D}\\x{1F5F}-\\x{1F7D}\\x{1F80}-\\x{1FB4}\\x{1FB6}-"      \
    "\\x{1FBC}\\x{1FBE}\\x{1FC2}-\\x{1FC4}\\x{1FC6}-\\x{1FCC}\\x{1FD0}-\\x{1FD3}\\x{1FD6}-"     \
    "\\x{1FDB}\\x{1FE0}-\\x{1FEC}\\x{1FF2}-\\x{1FF4}\\x{1FF6}-"                                 \
    "\\x{1FFC}\\x{2102}\\x{2107}\\x{210A}-\\x{2113}\\x{2115}\\x{2119}-"                         \
    "\\x{211D}\\x{2124}\\x{2126}\\x{2128}\\x{212A}-\\x{212D}\\x{212F}-"                         \
    "\\x{2134}\\x{2139}\\x{213C}-\\x{213F}\\x{2145}-\\x{2149}\\x{214E}\\x{2183}-"               \
    "\\x{2184}\\x{2C00}-\\x{2C7B}\\x{2C7E}-\\x{2CE4}\\x{2CEB}-\\x{2CEE}\\x{2CF2}-"              \
    "\\x{2CF3}\\x{A640}-\\x{A66D}\\x{A680}-\\x{A69B}\\x{A722}-\\x{A76F}\\x{A771}-"              \
    "\\x{A787}\\x{A78B}-\\x{A78E}\\x{AB70}-\\x{ABBF}\\x{FB00}-\\x{FB06}\\x{FB13}-"              \
    "\\x{FB17}\\x{FF21}-\\x{FF3A}\\x{FF41}-\\x{FF5A}\\x{10400}-\\x{1044F}\\x{104B0}-"          \
    "\\x{104D3}\\x{104D8}-\\x{104FB}\\x{10C80}-\\x{10CB2}\\x{10CC0}-\\x{10CF2}\\x{118A0}-"     \
    "\\x{118DF}\\x{1E900}-\\x{1E943}"

/* llama.cpp: "[!-/:-~！-／：-～‘-‟　-。]". U+3000 is whitespace, which
 * llama.cpp rewrites to U+000B before matching, so the last range
 * effectively starts at U+3001. */
#define DS_PUNCT "!-/:-~\\x{FF01}-\\x{FF0F}\\x{FF1A}-\\x{FF5E}\\x{2018}-\\x{201F}\\x{3001}-\\x{3002}"

/* llama.cpp: "[一-龥ࠀ-一가-퟿]" = U+4E00-9FA5, U+0800-4E00, U+AC00-D7FF; the
 * middle range loses the whitespace code points inside it (see above). */
#define DS_CJK                                                                                 \
    "[\\x{4E00}-\\x{9FA5}\\x{800}-\\x{167F}\\x{1681}-\\x{1FFF}\\x{200B}-\\x{2027}"            \
    "\\x{202A}-\\x{202E}\\x{2030}-\\x{205E}\\x{2060}-\\x{2FFF}\\x{3001}-\\x{4E00}"            \
    "\\x{AC00}-\\x{D7FF}]+"

/* bloom / poro / gpt3-finnish / viking: " ?[^(\s|.,!?…。，、।۔،)]+" */
#define RE_PORO " ?[^(\\s|.,!?\\x{2026}\\x{3002}\\x{FF0C}\\x{3001}\\x{964}\\x{6D4}\\x{60C})]+"

#define RE_TEKKEN                                                                              \
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|"                     \
    "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|"                     \
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

static const char *const re_default[] = {"[\\p{P}\\$\\+<=>\\^~\\|]+", RE_GPT2, "\\p{N}+",
                                          "[0-9][0-9][0-9]", NULL};
static const char *const re_llama3[] = {RE_LLAMA3, NULL};
static const char *const re_deepseek_llm[] = {"[\r\n]", "\\s?[" DS_LETTERS "]+", "\\s?[" DS_PUNCT "]+",
                                              "\\s+$", DS_CJK, "\\p{N}+", NULL};
static const char *const re_deepseek_coder[] = {"[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", DS_CJK,
                                                "\\p{N}", NULL};
static const char *const re_falcon[] = {"[\\p{P}\\$\\+<=>\\^~\\|`]+", RE_GPT2, "[0-9][0-9][0-9]", NULL};
static const char *const re_gpt2[] = {RE_GPT2, NULL};
static const char *const re_starcoder[] = {"\\p{N}", RE_GPT2, NULL};
static const char *const re_qwen2[] = {RE_QWEN2, NULL};
static const char *const re_poro[] = {RE_PORO, NULL};
static const char *const re_viking[] = {RE_PORO, "\\p{N}", NULL};
static const char *const re_tekken[] = {RE_TEKKEN, NULL};
static const char *const re_chameleon[] = {"<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                                           "([\\t\\n]|    |  )", "\\p{N}", "[\\p{P}!-/:-@\\[-`{-~]",
                                           RE_GPT2, NULL};

static const char *const *regex_list(tk_pre pre) {
    switch (pre) {
    case TK_PRE_LLAMA3: return re_llama3;
    case TK_PRE_CHATGLM4: return re_llama3;
    case TK_PRE_DEEPSEEK_LLM: return re_deepseek_llm;
    case TK_PRE_DEEPSEEK_CODER: return re_deepseek_coder;
    case TK_PRE_FALCON: return re_falcon;
    case TK_PRE_GPT2: return re_gpt2;
    case TK_PRE_STARCODER: return re_starcoder;
    case TK_PRE_QWEN2: return re_qwen2;
    case TK_PRE_PORO: return re_poro;
    case TK_PRE_VIKING: return re_viking;
    case TK_PRE_TEKKEN: return re_tekken;
    case TK_PRE_CHAMELEON: return re_chameleon;
    case TK_PRE_DEFAULT: break;
    }
    return re_default;
}

/* ---- tokenizer.ggml.pre names (llama.cpp's accepted values) ------------- */

typedef struct pre_entry {
    const char *name;
    const char *canonical;
    tk_pre pre;
    bool clean_spaces, ignore_merges, add_bos, no_bos;
} pre_entry;

static const pre_entry pre_table[] = {
    {"default", "default", TK_PRE_DEFAULT, true, false, false, false},
    {"llama3", "llama3", TK_PRE_LLAMA3, true, true, true, false},
    {"llama-v3", "llama3", TK_PRE_LLAMA3, true, true, true, false},
    {"llama-bpe", "llama3", TK_PRE_LLAMA3, true, true, true, false},
    {"falcon3", "llama3", TK_PRE_LLAMA3, true, true, true, false},
    {"deepseek-llm", "deepseek-llm", TK_PRE_DEEPSEEK_LLM, false, false, false, false},
    {"deepseek-coder", "deepseek-coder", TK_PRE_DEEPSEEK_CODER, false, false, false, false},
    {"falcon", "falcon", TK_PRE_FALCON, true, false, false, false},
    {"mpt", "mpt", TK_PRE_GPT2, true, false, false, false},
    {"starcoder", "starcoder", TK_PRE_STARCODER, true, false, false, false},
    {"gpt-2", "gpt-2", TK_PRE_GPT2, true, false, false, false},
    {"phi-2", "gpt-2", TK_PRE_GPT2, true, false, false, false},
    {"jina-es", "gpt-2", TK_PRE_GPT2, true, false, false, false},
    {"jina-de", "gpt-2", TK_PRE_GPT2, true, false, false, false},
    {"gigachat", "gpt-2", TK_PRE_GPT2, true, false, false, false},
    {"jina-v1-en", "gpt-2", TK_PRE_GPT2, true, false, false, false},
    {"jina-v2-es", "gpt-2", TK_PRE_GPT2, true, false, false, false},
    {"jina-v2-de", "gpt-2", TK_PRE_GPT2, true, false, false, false},
    {"jina-v2-code", "gpt-2", TK_PRE_GPT2, true, false, false, false},
    {"roberta-bpe", "gpt-2", TK_PRE_GPT2, true, false, false, false},
    {"refact", "refact", TK_PRE_STARCODER, true, false, false, false},
    {"command-r", "command-r", TK_PRE_STARCODER, false, false, false, false},
    {"qwen2", "qwen2", TK_PRE_QWEN2, false, false, false, false},
    {"deepseek-r1-qwen", "qwen2", TK_PRE_QWEN2, false, false, false, false},
    {"stablelm2", "stablelm2", TK_PRE_QWEN2, true, false, false, false},
    {"megrez", "megrez", TK_PRE_QWEN2, true, false, false, false},
    {"olmo", "olmo", TK_PRE_GPT2, true, false, false, false},
    {"jais", "jais", TK_PRE_GPT2, true, false, false, false},
    {"dbrx", "dbrx", TK_PRE_LLAMA3, true, false, false, false},
    {"smaug-bpe", "smaug-bpe", TK_PRE_LLAMA3, true, false, false, false},
    {"poro-chat", "poro-chat", TK_PRE_PORO, false, false, false, false},
    {"bloom", "bloom", TK_PRE_PORO, true, false, false, false},
    {"gpt3-finnish", "gpt3-finnish", TK_PRE_PORO, true, false, false, false},
    {"chatglm-bpe", "chatglm-bpe", TK_PRE_CHATGLM4, true, false, false, true},
    {"viking", "viking", TK_PRE_VIKING, false, false, false, false},
    {"tekken", "tekken", TK_PRE_TEKKEN, false, true, true, false},
    {"smollm", "smollm", TK_PRE_STARCODER, false, false, false, false},
    {"codeshell", "codeshell", TK_PRE_STARCODER, true, false, false, false},
    {"exaone", "exaone", TK_PRE_STARCODER, true, false, false, false},
    {"minerva-7b", "minerva-7b", TK_PRE_STARCODER, true, false, false, false},
    {"chameleon", "chameleon", TK_PRE_CHAMELEON, false, false, true, false},
};

bool tk_pre_find(const char *name, size_t len, tk_pre_info *out) {
    for (size_t i = 0; i < sizeof pre_table / sizeof *pre_table; i++) {
        const pre_entry *e = &pre_table[i];
        if (strlen(e->name) == len && memcmp(e->name, name, len) == 0) {
            out->pre = e->pre;
            out->canonical = e->canonical;
            out->clean_spaces = e->clean_spaces;
            out->ignore_merges = e->ignore_merges;
            out->add_bos = e->add_bos;
            out->no_bos = e->no_bos;
            return true;
        }
    }
    return false;
}

const char *tk_pre_supported(void) {
    return "default, llama3, llama-v3, llama-bpe, falcon3, deepseek-llm, deepseek-coder, falcon, mpt, "
           "starcoder, gpt-2, phi-2, jina-es, jina-de, gigachat, jina-v1-en, jina-v2-es, jina-v2-de, "
           "jina-v2-code, roberta-bpe, refact, command-r, qwen2, deepseek-r1-qwen, stablelm2, megrez, "
           "olmo, jais, dbrx, smaug-bpe, poro-chat, bloom, gpt3-finnish, chatglm-bpe, viking, tekken, "
           "smollm, codeshell, exaone, minerva-7b, chameleon";
}

/* ---- compile ----------------------------------------------------------- */

/* llama.cpp's whitespace set, as PCRE2 class contents. */
#define WS_CLASS                                                                              \
    "\\t-\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}"  \
    "\\x{3000}"

/* Rewrite `\s` and `\S` (inside and outside classes) to WS_CLASS. */
static int translate(const char *src, tk_buf *out) {
    bool in_class = false;
    for (size_t i = 0; src[i]; i++) {
        char c = src[i];
        if (c == '\\' && src[i + 1]) {
            char e = src[i + 1];
            i++;
            if (e == 's') {
                if (in_class) {
                    if (tk_buf_append(out, WS_CLASS, strlen(WS_CLASS))) return PD_ENOMEM;
                } else if (tk_buf_append(out, "[" WS_CLASS "]", strlen("[" WS_CLASS "]"))) {
                    return PD_ENOMEM;
                }
                continue;
            }
            if (e == 'S') {
                if (in_class) return PD_EUNSUPPORTED; /* not used by any list */
                if (tk_buf_append(out, "[^" WS_CLASS "]", strlen("[^" WS_CLASS "]"))) return PD_ENOMEM;
                continue;
            }
            char esc[2] = {c, e};
            if (tk_buf_append(out, esc, 2)) return PD_ENOMEM;
            continue;
        }
        if (c == '[' && !in_class) {
            in_class = true;
            if (tk_buf_append(out, "[", 1)) return PD_ENOMEM;
            if (src[i + 1] == '^') {
                if (tk_buf_append(out, "^", 1)) return PD_ENOMEM;
                i++;
            }
            continue;
        }
        if (c == ']' && in_class) in_class = false;
        if (tk_buf_append(out, &c, 1)) return PD_ENOMEM;
    }
    return tk_buf_append(out, "", 1);
}

int tk_pre_compile(pd_tokenizer *t, pd_error *err) {
    const char *const *list = regex_list(t->pre);
    uint32_t n = 0;
    while (list[n]) n++;
    t->regex = calloc(n, sizeof *t->regex);
    if (!t->regex) return pd_errorf(err, PD_ENOMEM, "out of memory");
    for (uint32_t i = 0; i < n; i++) {
        tk_buf pat = {0};
        int rc = translate(list[i], &pat);
        if (rc) {
            free(pat.p);
            return pd_errorf(err, rc, "pre-tokenizer '%s': cannot translate regex %u", t->pre_name, i);
        }
        int ecode;
        PCRE2_SIZE eoff;
        pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat.p, PCRE2_ZERO_TERMINATED,
                                       PCRE2_UTF | PCRE2_UCP | PCRE2_DOLLAR_ENDONLY |
                                           PCRE2_MATCH_INVALID_UTF,
                                       &ecode, &eoff, NULL);
        if (!re) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(ecode, msg, sizeof msg);
            rc = pd_errorf(err, PD_EFORMAT, "pre-tokenizer '%s': regex %u does not compile at offset %zu: %s",
                           t->pre_name, i, (size_t)eoff, (const char *)msg);
            free(pat.p);
            return rc;
        }
        free(pat.p);
        (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* the interpreter is the fallback */
        t->regex[t->n_regex++] = re;
    }
    return PD_OK;
}

void tk_pre_free(pd_tokenizer *t) {
    for (uint32_t i = 0; i < t->n_regex; i++) pcre2_code_free((pcre2_code *)t->regex[i]);
    free(t->regex);
    t->regex = NULL;
    t->n_regex = 0;
}

/* ---- split ------------------------------------------------------------- */

typedef struct spans {
    size_t *v; /* pairs (offset, length) */
    size_t n, cap;
} spans;

static int spans_push(spans *s, size_t off, size_t len) {
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 64;
        size_t *v = realloc(s->v, cap * 2 * sizeof *v);
        if (!v) return PD_ENOMEM;
        s->v = v;
        s->cap = cap;
    }
    s->v[2 * s->n] = off;
    s->v[2 * s->n + 1] = len;
    s->n++;
    return PD_OK;
}

int tk_pre_split(const pd_tokenizer *t, const char *text, size_t len, size_t **out, size_t *n_out,
                 pd_error *err) {
    *out = NULL;
    *n_out = 0;
    if (len == 0) return PD_OK;
    spans cur = {0}, next = {0};
    int rc = PD_OK;
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    if (!md || spans_push(&cur, 0, len)) {
        rc = pd_errorf(err, PD_ENOMEM, "out of memory in the pre-tokenizer");
        goto done;
    }
    for (uint32_t r = 0; r < t->n_regex; r++) {
        const pcre2_code *re = t->regex[r];
        next.n = 0;
        for (size_t s = 0; s < cur.n; s++) {
            size_t off = cur.v[2 * s], plen = cur.v[2 * s + 1];
            PCRE2_SPTR subj = (PCRE2_SPTR)(text + off);
            size_t start = 0, prev_end = 0;
            while (start <= plen) {
                int m = pcre2_match(re, subj, plen, start, 0, md, NULL);
                if (m == PCRE2_ERROR_JIT_STACKLIMIT)
                    m = pcre2_match(re, subj, plen, start, PCRE2_NO_JIT, md, NULL);
                if (m == PCRE2_ERROR_NOMATCH) break;
                if (m < 0) {
                    PCRE2_UCHAR msg[256];
                    pcre2_get_error_message(m, msg, sizeof msg);
                    rc = pd_errorf(err, PD_EINVAL,
                                   "pre-tokenizer '%s': regex %u failed on a %zu-byte piece at byte %zu: %s",
                                   t->pre_name, r, plen, off + start, (const char *)msg);
                    goto done;
                }
                PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
                size_t ms = ov[0], me = ov[1];
                if (me <= ms) { /* empty match: no piece, step one character */
                    start = ms + 1;
                    while (start < plen && (subj[start] & 0xC0) == 0x80) start++;
                    continue;
                }
                if (ms > prev_end && spans_push(&next, off + prev_end, ms - prev_end)) goto nomem;
                if (spans_push(&next, off + ms, me - ms)) goto nomem;
                prev_end = start = me;
            }
            if (prev_end < plen && spans_push(&next, off + prev_end, plen - prev_end)) goto nomem;
        }
        spans tmp = cur;
        cur = next;
        next = tmp;
    }
    *out = cur.v;
    *n_out = cur.n;
    cur.v = NULL;
    goto done;
nomem:
    rc = pd_errorf(err, PD_ENOMEM, "out of memory in the pre-tokenizer");
done:
    free(cur.v);
    free(next.v);
    pcre2_match_data_free(md);
    return rc;
}
