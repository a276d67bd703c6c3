/* Chat templates: recognise the common families from a model's
 * `tokenizer.chat_template` text and render conversations in them.
 *
 * prefixd runs no Jinja. Detection looks for each family's distinctive
 * markers, in the order llama.cpp's llm_chat_detect_template uses, and
 * rendering follows llama.cpp's llm_chat_apply_template for the same family
 * (see docs/chat-templates.md for the exact formats and the variants that
 * are mapped or refused). */

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"

static const char *const family_names[PD_CHAT_FAMILY_COUNT] = {
    [PD_CHAT_NONE] = "none",
    [PD_CHAT_CHATML] = "chatml",
    [PD_CHAT_LLAMA3] = "llama3",
    [PD_CHAT_LLAMA2] = "llama2",
    [PD_CHAT_MISTRAL] = "mistral",
    [PD_CHAT_ZEPHYR] = "zephyr",
    [PD_CHAT_PHI3] = "phi3",
    [PD_CHAT_GEMMA] = "gemma",
    [PD_CHAT_QWEN3] = "qwen3",
};

const char *pd_chat_family_name(pd_chat_family f) {
    if ((int)f < 0 || f >= PD_CHAT_FAMILY_COUNT) return "unknown";
    return family_names[f];
}

static char ascii_lower(char c) { return (c >= 'A' && c <= 'Z') ? (char)(c - 'A' + 'a') : c; }

/* Case-insensitive equality of a length-delimited string and a C string
 * (ASCII only; family names are ASCII). */
static bool name_equals(const char *s, size_t len, const char *name) {
    size_t n = strlen(name);
    if (len != n) return false;
    for (size_t i = 0; i < n; i++)
        if (ascii_lower(s[i]) != name[i]) return false;
    return true;
}

static bool family_from_name_len(const char *s, size_t len, pd_chat_family *out) {
    for (int f = 0; f < PD_CHAT_FAMILY_COUNT; f++) {
        if (name_equals(s, len, family_names[f])) {
            *out = (pd_chat_family)f;
            return true;
        }
    }
    return false;
}

bool pd_chat_family_from_name(const char *name, pd_chat_family *out) {
    if (!name || !out) return false;
    return family_from_name_len(name, strlen(name), out);
}

/* ------------------------------------------------------------------------
 * Detection
 * ------------------------------------------------------------------------ */

/* The template comes straight from the GGUF mapping, so it is not
 * NUL-terminated: search within len bytes only. */
static bool has(const char *text, size_t len, const char *needle) {
    size_t n = strlen(needle);
    return n <= len && memmem(text, len, needle, n) != NULL;
}

pd_chat_family pd_chat_detect(const char *t, size_t len) {
    if (!t || len == 0) return PD_CHAT_NONE;
    /* A bare family name (as llama.cpp accepts "chatml" etc.), so a
     * configured override can go through the same function. */
    pd_chat_family named;
    if (family_from_name_len(t, len, &named)) return named;

    if (has(t, len, "<|im_start|>")) {
        /* Phi-4 ("<|im_sep|>") and SmolVLM ("<end_of_utterance>") reuse
         * <|im_start|> but are not ChatML; rendering them as ChatML would
         * produce a prompt the model was never trained on. */
        if (has(t, len, "<|im_sep|>") || has(t, len, "<end_of_utterance>")) return PD_CHAT_NONE;
        /* Qwen3 reads enable_thinking and writes <think> blocks; SmolLM3
         * reads it too but turns it into a "/think" reasoning_mode flag in
         * its own system header, which is not Qwen3's layout. */
        if (has(t, len, "enable_thinking") && has(t, len, "<think>") && !has(t, len, "reasoning_mode"))
            return PD_CHAT_QWEN3;
        return PD_CHAT_CHATML;
    }
    if (has(t, len, "[INST]")) {
        /* Mistral v7 has a native [SYSTEM_PROMPT] turn and different spacing:
         * not something the classic renderer can stand in for. */
        if (has(t, len, "[SYSTEM_PROMPT]")) return PD_CHAT_NONE;
        if (has(t, len, "<<SYS>>")) return PD_CHAT_LLAMA2;
        /* Classic Mistral (v0.1/v0.2, Mixtral), and also the v1/v3/v3-tekken
         * templates, which differ from it in spaces and in where the system
         * text goes: an approximation, documented. */
        return PD_CHAT_MISTRAL;
    }
    /* Phi-3 before Zephyr: both use <|user|> and <|assistant|>; <|end|> is
     * Phi-3's own turn terminator. */
    if (has(t, len, "<|assistant|>") && has(t, len, "<|end|>")) return PD_CHAT_PHI3;
    if (has(t, len, "<|user|>") && (has(t, len, "</s>") || has(t, len, "eos_token"))) {
        /* StableLM-Zephyr ends turns with <|endoftext|>, not </s>. (GLM-Edge
         * and ChatGLM have no end marker, so they fail the test above.) */
        if (has(t, len, "<|endoftext|>")) return PD_CHAT_NONE;
        return PD_CHAT_ZEPHYR;
    }
    /* Gemma 1, 2 and 3 (one turn format; 3 folds a system message into the
     * first user turn, 1 and 2 refuse one). */
    if (has(t, len, "<start_of_turn>")) return PD_CHAT_GEMMA;
    if (has(t, len, "<|start_header_id|>") &&
        (has(t, len, "<|end_header_id|>") || has(t, len, "<|eot_id|>")))
        return PD_CHAT_LLAMA3;
    return PD_CHAT_NONE;
}

/* Tokens the rendered text relies on being single tokens of the vocabulary.
 * A template naming a family whose markers the vocabulary lacks would be
 * rendered into plain text the model never saw, so such a model gets
 * PD_CHAT_NONE instead. ("[INST]" is ordinary text in Llama 2/Mistral
 * vocabularies, so only the end-of-sequence marker is required there.) */
static const char *const *family_required_tokens(pd_chat_family f) {
    static const char *const chatml[] = {"<|im_start|>", "<|im_end|>", NULL};
    static const char *const llama3[] = {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", NULL};
    static const char *const llama2[] = {"<s>", "</s>", NULL};
    static const char *const eos_only[] = {"</s>", NULL};
    static const char *const phi3[] = {"<|user|>", "<|assistant|>", "<|end|>", NULL};
    static const char *const gemma[] = {"<start_of_turn>", "<end_of_turn>", NULL};
    static const char *const qwen3[] = {"<|im_start|>", "<|im_end|>", "<think>", "</think>", NULL};
    switch (f) {
    case PD_CHAT_CHATML: return chatml;
    case PD_CHAT_LLAMA3: return llama3;
    case PD_CHAT_LLAMA2: return llama2;
    case PD_CHAT_MISTRAL:
    case PD_CHAT_ZEPHYR: return eos_only;
    case PD_CHAT_PHI3: return phi3;
    case PD_CHAT_GEMMA: return gemma;
    case PD_CHAT_QWEN3: return qwen3;
    default: return NULL;
    }
}

pd_chat_family pd_model_chat_family(const pd_model *m) {
    if (!m) return PD_CHAT_NONE;
    const pd_gguf *g = pd_model_gguf(m);
    if (!g) return PD_CHAT_NONE;
    const pd_gguf_value *v = pd_gguf_find(g, "tokenizer.chat_template");
    if (!v || v->type != PD_GGUF_STRING) return PD_CHAT_NONE;
    pd_chat_family f = pd_chat_detect(v->str.ptr, (size_t)v->str.len);
    const pd_tokenizer *tok = pd_model_tokenizer(m);
    const char *const *req = family_required_tokens(f);
    if (tok && req) {
        for (size_t i = 0; req[i]; i++)
            if (pd_tokenizer_find(tok, req[i], strlen(req[i])) == PD_TOKEN_NULL) return PD_CHAT_NONE;
    }
    return f;
}

/* ------------------------------------------------------------------------
 * Rendering
 * ------------------------------------------------------------------------ */

/* Rendered text goes into a pd_sbuf (util.h): appends need no error path
 * per call; an allocation failure shows as oom at the end. */

static bool is_ascii_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

/* Llama 3 and Gemma trim every message they trim (the official templates'
 * `| trim`, and llama.cpp's trim()); ASCII whitespace only, as llama.cpp's
 * isspace. */
static void buf_trimmed(pd_sbuf *b, const char *s) {
    size_t n = strlen(s);
    size_t a = 0;
    while (a < n && is_ascii_space(s[a])) a++;
    while (n > a && is_ascii_space(s[n - 1])) n--;
    pd_sbuf_putn(b, s + a, n - a);
}

/* [p, end) without leading (lead) and/or trailing (trail) '\n' bytes:
 * Python's str.lstrip('\n') / rstrip('\n') / strip('\n'). */
static void strip_newlines(const char **p, const char **end, bool lead, bool trail) {
    while (lead && *p < *end && **p == '\n') (*p)++;
    while (trail && *end > *p && (*end)[-1] == '\n') (*end)--;
}

/* First / last occurrence of needle in [p, end), or NULL. */
static const char *find_first(const char *p, const char *end, const char *needle) {
    return memmem(p, (size_t)(end - p), needle, strlen(needle));
}
static const char *find_last(const char *p, const char *end, const char *needle) {
    const char *last = NULL;
    for (const char *q = p; (q = find_first(q, end, needle)) != NULL; q++) last = q;
    return last;
}

typedef enum chat_role { ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT, ROLE_TOOL } chat_role;

static bool family_has_system_turn(pd_chat_family f) {
    return f == PD_CHAT_CHATML || f == PD_CHAT_LLAMA3 || f == PD_CHAT_ZEPHYR || f == PD_CHAT_PHI3 ||
           f == PD_CHAT_QWEN3;
}

/* A Qwen3 "user" message that only carries tool output does not start a new
 * query (the template's multi_step_tool rule). */
static bool qwen3_is_tool_response(const char *s) {
    static const char open[] = "<tool_response>", close[] = "</tool_response>";
    const size_t n = strlen(s);
    return n >= sizeof open - 1 && memcmp(s, open, sizeof open - 1) == 0 && n >= sizeof close - 1 &&
           memcmp(s + n - (sizeof close - 1), close, sizeof close - 1) == 0;
}

/* A Qwen3 assistant turn, as its template writes it with enable_thinking
 * false. Reasoning written into the content (<think>...</think>) is cut
 * out; a turn after the last user query keeps it in a <think> block, and
 * the final turn always has one (empty when there was no reasoning). */
static void render_qwen3_assistant(const char *content, bool after_last_query, bool last, pd_sbuf *b) {
    const char *c = content, *c_end = content + strlen(content);
    const char *r = c, *r_end = c; /* reasoning: empty unless </think> is present */
    const char *close_first = find_first(c, c_end, "</think>");
    if (close_first) {
        r_end = close_first;
        strip_newlines(&r, &r_end, false, true);
        const char *open_last = find_last(r, r_end, "<think>");
        if (open_last) r = open_last + strlen("<think>");
        strip_newlines(&r, &r_end, true, false);
        c = find_last(c, c_end, "</think>") + strlen("</think>");
        strip_newlines(&c, &c_end, true, false);
    }
    pd_sbuf_puts(b, "<|im_start|>assistant\n");
    if (after_last_query && (last || r_end > r)) {
        strip_newlines(&r, &r_end, true, true);
        pd_sbuf_puts(b, "<think>\n");
        pd_sbuf_putn(b, r, (size_t)(r_end - r));
        pd_sbuf_puts(b, "\n</think>\n\n");
        strip_newlines(&c, &c_end, true, false);
    }
    pd_sbuf_putn(b, c, (size_t)(c_end - c));
    pd_sbuf_puts(b, "<|im_end|>\n");
}

/* Turn-based families: every message is "open role sep content close",
 * with its own role name, so a system message may appear anywhere.
 * verbatim[i] (may be NULL) exempts a text built here from Llama 3's trim. */
static void render_turns(pd_chat_family f, const pd_chat_message *msgs, const chat_role *roles, const bool *verbatim,
                         size_t n, size_t n_lead_sys, bool add_gen, pd_sbuf *b, size_t *system_len) {
    size_t last_query = n - 1; /* Qwen3: the last user message that is not tool output */
    for (size_t i = n; i-- > 0;)
        if (roles[i] == ROLE_USER && !qwen3_is_tool_response(msgs[i].content)) {
            last_query = i;
            break;
        }
    for (size_t i = 0; i < n; i++) {
        const char *role = msgs[i].role;
        if (f == PD_CHAT_QWEN3 && roles[i] == ROLE_ASSISTANT) {
            render_qwen3_assistant(msgs[i].content, i > last_query, i + 1 == n, b);
        } else {
            switch (f == PD_CHAT_QWEN3 ? PD_CHAT_CHATML : f) { /* Qwen3's other turns are ChatML's */
            case PD_CHAT_CHATML:
                pd_sbuf_puts(b, "<|im_start|>");
                pd_sbuf_puts(b, role);
                pd_sbuf_puts(b, "\n");
                pd_sbuf_puts(b, msgs[i].content);
                pd_sbuf_puts(b, "<|im_end|>\n");
                break;
            case PD_CHAT_LLAMA3:
                pd_sbuf_puts(b, "<|start_header_id|>");
                pd_sbuf_puts(b, role);
                pd_sbuf_puts(b, "<|end_header_id|>\n\n");
                if (verbatim && verbatim[i])
                    pd_sbuf_puts(b, msgs[i].content);
                else
                    buf_trimmed(b, msgs[i].content);
                pd_sbuf_puts(b, "<|eot_id|>");
                break;
            case PD_CHAT_ZEPHYR:
            case PD_CHAT_PHI3:
                pd_sbuf_puts(b, "<|");
                pd_sbuf_puts(b, role);
                pd_sbuf_puts(b, "|>\n");
                pd_sbuf_puts(b, msgs[i].content);
                pd_sbuf_puts(b, f == PD_CHAT_PHI3 ? "<|end|>\n" : "</s>\n");
                break;
            default: break;
            }
        }
        if (i + 1 == n_lead_sys) *system_len = b->len;
    }
    if (!add_gen) return;
    switch (f) {
    case PD_CHAT_CHATML: pd_sbuf_puts(b, "<|im_start|>assistant\n"); break;
    case PD_CHAT_QWEN3: pd_sbuf_puts(b, "<|im_start|>assistant\n<think>\n\n</think>\n\n"); break;
    case PD_CHAT_LLAMA3: pd_sbuf_puts(b, "<|start_header_id|>assistant<|end_header_id|>\n\n"); break;
    case PD_CHAT_ZEPHYR:
    case PD_CHAT_PHI3: pd_sbuf_puts(b, "<|assistant|>\n"); break;
    default: break;
    }
}

/* [INST] families. The leading system message(s) go inside the first
 * [INST]: Llama 2 in one <<SYS>> block, Mistral (no system role) as plain
 * text followed by "\n", as llama.cpp does for templates without <<SYS>>.
 * Several leading system messages are joined with "\n". "[/INST]" already
 * ends the user turn, so there is no generation prompt to add.
 * Mistral's tool list (tools_block, or NULL) goes before the last user
 * turn, as its v0.3 template puts it; when that turn is the one the system
 * text opens (or there is no user turn), the list opens the text and the
 * system prefix covers it. Mistral's tool results (ROLE_TOOL, already
 * rendered) follow the call without reopening [INST]. */
static void render_inst(pd_chat_family f, const pd_chat_message *msgs, const chat_role *roles, size_t n,
                        size_t n_lead_sys, const char *tools_block, pd_sbuf *b, size_t *system_len) {
    size_t last_user = n;
    for (size_t i = n; i-- > n_lead_sys;)
        if (roles[i] == ROLE_USER) {
            last_user = i;
            break;
        }
    const bool tools_first = tools_block && (last_user == n || last_user == n_lead_sys);
    if (tools_first) {
        pd_sbuf_puts(b, tools_block);
        *system_len = b->len;
    }
    pd_sbuf_puts(b, "[INST] ");
    if (n_lead_sys > 0) {
        if (f == PD_CHAT_LLAMA2) pd_sbuf_puts(b, "<<SYS>>\n");
        for (size_t i = 0; i < n_lead_sys; i++) {
            if (i > 0) pd_sbuf_puts(b, "\n");
            pd_sbuf_puts(b, msgs[i].content);
        }
        pd_sbuf_puts(b, f == PD_CHAT_LLAMA2 ? "\n<</SYS>>\n\n" : "\n");
        *system_len = b->len;
    }
    bool open = true;          /* inside an [INST] turn that has been written */
    bool after_results = false; /* the model answers right after [/TOOL_RESULTS] */
    for (size_t i = n_lead_sys; i < n; i++) {
        if (roles[i] == ROLE_TOOL) {
            pd_sbuf_puts(b, msgs[i].content);
            after_results = true;
            continue;
        }
        if (tools_block && !tools_first && i == last_user) pd_sbuf_puts(b, tools_block);
        const bool answer_to_results = after_results && roles[i] == ROLE_ASSISTANT;
        after_results = false;
        if (!open && !answer_to_results) {
            /* Llama 2 chat restarts every exchange with BOS; Mistral's
             * template emits BOS only once, at the very start. */
            pd_sbuf_puts(b, f == PD_CHAT_LLAMA2 ? "<s>[INST] " : "[INST] ");
            open = true;
        }
        if (roles[i] == ROLE_USER) {
            pd_sbuf_puts(b, msgs[i].content);
            pd_sbuf_puts(b, " [/INST]");
        } else { /* assistant: system ones were refused by validation */
            pd_sbuf_puts(b, msgs[i].content);
            pd_sbuf_puts(b, "</s>");
            open = false;
        }
    }
}

/* Gemma: user and model turns, contents trimmed. The leading system
 * message(s) open the first user turn, followed by "\n\n" (Gemma 3's
 * template; several are joined with "\n\n"). When the conversation does
 * not go on with a user message, that user turn holds only the system text:
 * it is closed before a model turn or the generation prompt, and left open
 * when nothing follows (the system prefix alone). */
static void render_gemma(const pd_chat_message *msgs, const chat_role *roles, size_t n, size_t n_lead_sys,
                         bool add_gen, pd_sbuf *b, size_t *system_len) {
    bool open = false; /* a user turn holding the system text is open */
    if (n_lead_sys > 0) {
        pd_sbuf_puts(b, "<start_of_turn>user\n");
        for (size_t i = 0; i < n_lead_sys; i++) {
            pd_sbuf_puts(b, msgs[i].content);
            pd_sbuf_puts(b, "\n\n");
        }
        *system_len = b->len;
        open = true;
    }
    for (size_t i = n_lead_sys; i < n; i++) {
        const bool user = roles[i] == ROLE_USER; /* system ones were refused by validation */
        if (open && !user) pd_sbuf_puts(b, "<end_of_turn>\n");
        if (!open || !user) {
            pd_sbuf_puts(b, "<start_of_turn>");
            pd_sbuf_puts(b, user ? "user" : "model");
            pd_sbuf_puts(b, "\n");
        }
        open = false;
        buf_trimmed(b, msgs[i].content);
        pd_sbuf_puts(b, "<end_of_turn>\n");
    }
    if (!add_gen) return;
    if (open) pd_sbuf_puts(b, "<end_of_turn>\n");
    pd_sbuf_puts(b, "<start_of_turn>model\n");
}

/* ------------------------------------------------------------------------
 * Tools
 *
 * Tool schemas and call arguments are JSON that the templates re-serialize
 * with their `tojson` filter, which is Python's json.dumps: ", " and ": "
 * separators (",\n" and indentation with indent=4), keys in the order
 * given, non-ASCII text as is. The py_json_* functions write exactly that.
 * ------------------------------------------------------------------------ */

void pd_chat_tool_syntax_of(pd_chat_family f, pd_chat_tool_syntax *out) {
    if (!out) return;
    switch (f) {
    case PD_CHAT_LLAMA3: /* one bare {"name": ..., "parameters": {...}} per turn */
        *out = (pd_chat_tool_syntax){.open = "", .close = "", .sep = "", .json_list = false, .parallel = false,
                                     .args_key = "parameters"};
        break;
    case PD_CHAT_MISTRAL:
        *out = (pd_chat_tool_syntax){.open = "[TOOL_CALLS] [", .close = "]", .sep = ", ", .json_list = true,
                                     .parallel = true, .args_key = "arguments"};
        break;
    default: /* Hermes / Qwen2.5 <tool_call> blocks, also the generic form */
        *out = (pd_chat_tool_syntax){.open = "<tool_call>\n", .close = "\n</tool_call>", .sep = "\n",
                                     .json_list = false, .parallel = true, .args_key = "arguments"};
        break;
    }
}

/* Python's json.dumps(s, ensure_ascii=False) for a string: only the quote,
 * the backslash and control characters are escaped (\uXXXX in lower case
 * where there is no short form). */
static void py_json_string(pd_sbuf *b, const char *s, size_t n) {
    pd_sbuf_puts(b, "\"");
    size_t run = 0; /* start of the bytes not yet written */
    for (size_t i = 0; i < n; i++) {
        const unsigned char c = (unsigned char)s[i];
        char hex[8];
        const char *esc = NULL;
        switch (c) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        default:
            if (c < 0x20) {
                snprintf(hex, sizeof hex, "\\u%04x", c);
                esc = hex;
            }
            break;
        }
        if (esc) {
            pd_sbuf_putn(b, s + run, i - run);
            pd_sbuf_puts(b, esc);
            run = i + 1;
        }
    }
    pd_sbuf_putn(b, s + run, n - run);
    pd_sbuf_puts(b, "\"");
}

/* Python's repr of a float: the shortest digits that read back as the same
 * double; positional for decimal exponents -4..15 (always with a fraction,
 * "2.0"), else d.ddde+XX. */
static void py_json_real(pd_sbuf *b, double v) {
    char sci[40];
    for (int precision = 0; precision < 17; precision++) {
        snprintf(sci, sizeof sci, "%.*e", precision, v);
        if (strtod(sci, NULL) == v) break;
    }
    const char *s = sci;
    char digits[24];
    size_t nd = 0;
    bool negative = *s == '-';
    if (negative) s++;
    for (; *s && *s != 'e' && nd < sizeof digits; s++)
        if (*s != '.') digits[nd++] = *s;
    const int exp = *s == 'e' ? atoi(s + 1) : 0;
    while (nd > 1 && digits[nd - 1] == '0') nd--;

    char out[64];
    size_t o = 0;
    if (negative) out[o++] = '-';
    if (exp < -4 || exp >= 16) {
        out[o++] = digits[0];
        if (nd > 1) {
            out[o++] = '.';
            memcpy(out + o, digits + 1, nd - 1);
            o += nd - 1;
        }
        o += (size_t)snprintf(out + o, sizeof out - o, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    } else if (exp < 0) {
        out[o++] = '0';
        out[o++] = '.';
        for (int k = 0; k < -exp - 1; k++) out[o++] = '0';
        memcpy(out + o, digits, nd);
        o += nd;
    } else {
        for (int k = 0; k <= exp; k++) out[o++] = (size_t)k < nd ? digits[k] : '0';
        out[o++] = '.';
        if (nd > (size_t)exp + 1) {
            memcpy(out + o, digits + exp + 1, nd - (size_t)exp - 1);
            o += nd - (size_t)exp - 1;
        } else {
            out[o++] = '0';
        }
    }
    pd_sbuf_putn(b, out, o);
}

static void py_json_newline(pd_sbuf *b, int indent, int depth) {
    if (indent <= 0) return;
    pd_sbuf_puts(b, "\n");
    for (int i = 0; i < indent * depth; i++) pd_sbuf_puts(b, " ");
}

/* json.dumps(v, ensure_ascii=False, indent=indent or None). */
static void py_json_dump(pd_sbuf *b, json_t *v, int indent, int depth) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        if (json_object_size(v) == 0) {
            pd_sbuf_puts(b, "{}");
            break;
        }
        pd_sbuf_puts(b, "{");
        const char *key;
        json_t *val;
        bool first = true;
        json_object_foreach(v, key, val) {
            if (!first) pd_sbuf_puts(b, indent > 0 ? "," : ", ");
            first = false;
            py_json_newline(b, indent, depth + 1);
            py_json_string(b, key, strlen(key));
            pd_sbuf_puts(b, ": ");
            py_json_dump(b, val, indent, depth + 1);
        }
        py_json_newline(b, indent, depth);
        pd_sbuf_puts(b, "}");
        break;
    }
    case JSON_ARRAY: {
        if (json_array_size(v) == 0) {
            pd_sbuf_puts(b, "[]");
            break;
        }
        pd_sbuf_puts(b, "[");
        size_t i;
        json_t *val;
        json_array_foreach(v, i, val) {
            if (i > 0) pd_sbuf_puts(b, indent > 0 ? "," : ", ");
            py_json_newline(b, indent, depth + 1);
            py_json_dump(b, val, indent, depth + 1);
        }
        py_json_newline(b, indent, depth);
        pd_sbuf_puts(b, "]");
        break;
    }
    case JSON_STRING: py_json_string(b, json_string_value(v), json_string_length(v)); break;
    case JSON_INTEGER: {
        char num[32];
        snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        pd_sbuf_puts(b, num);
        break;
    }
    case JSON_REAL: py_json_real(b, json_real_value(v)); break;
    case JSON_TRUE: pd_sbuf_puts(b, "true"); break;
    case JSON_FALSE: pd_sbuf_puts(b, "false"); break;
    case JSON_NULL: pd_sbuf_puts(b, "null"); break;
    }
}

/* Parse JSON text that must be an object. NULL text (no value given) is
 * the empty object. On failure *why says what is wrong. */
static json_t *parse_object(const char *text, char *why, size_t why_len) {
    if (!text) return json_object();
    json_error_t jerr;
    json_t *v = json_loads(text, 0, &jerr);
    if (!v) {
        snprintf(why, why_len, "not valid JSON (%s at character %d)", jerr.text, jerr.position);
        return NULL;
    }
    if (!json_is_object(v)) {
        snprintf(why, why_len, "a JSON array, not an object");
        json_decref(v);
        return NULL;
    }
    return v;
}

/* The tool as the templates receive it: {"type": "function", "function":
 * {"name": ..., "description": ..., "parameters": ...}}, absent fields left
 * out. NULL on allocation failure (the schema was validated before). */
static json_t *tool_object(const pd_chat_tool *t) {
    char why[256];
    json_t *fn = json_object(), *tool = json_object();
    if (!fn || !tool) goto fail;
    if (json_object_set_new(fn, "name", json_string_nocheck(t->name))) goto fail;
    if (t->description && json_object_set_new(fn, "description", json_string_nocheck(t->description))) goto fail;
    if (t->parameters) {
        json_t *params = parse_object(t->parameters, why, sizeof why);
        if (!params || json_object_set_new(fn, "parameters", params)) goto fail;
    }
    if (json_object_set_new(tool, "type", json_string("function"))) goto fail;
    if (json_object_set_new(tool, "function", fn)) {
        fn = NULL; /* set_new took it, even on failure */
        goto fail;
    }
    return tool;
fail:
    json_decref(fn);
    json_decref(tool);
    return NULL;
}

static void dump_tool(pd_sbuf *b, const pd_chat_tool *t, int indent) {
    json_t *tool = tool_object(t);
    if (!tool) {
        b->oom = true;
        return;
    }
    py_json_dump(b, tool, indent, 0);
    json_decref(tool);
}

/* One call as {"name": NAME, ARGS_KEY: {...}}, with Mistral's "id" after
 * the arguments when there is one. */
static void dump_call(pd_sbuf *b, const pd_chat_tool_call *c, const char *args_key, bool with_id) {
    char why[256];
    json_t *call = json_object();
    json_t *args = parse_object(c->arguments, why, sizeof why); /* validated before: fails only for memory */
    if (!call || !args) {
        json_decref(args);
        goto fail;
    }
    /* set_new takes its value even when it fails */
    if (json_object_set_new(call, "name", json_string_nocheck(c->name))) {
        json_decref(args);
        goto fail;
    }
    if (json_object_set_new(call, args_key, args)) goto fail;
    if (with_id && c->id && json_object_set_new(call, "id", json_string_nocheck(c->id))) goto fail;
    py_json_dump(b, call, 0, 0);
    json_decref(call);
    return;
fail:
    json_decref(call);
    b->oom = true;
}

/* Qwen2.5 / Qwen3 (Hermes) tool block: its fixed instructions, one tool per
 * line inside <tools></tools>. Also the generic block of the other families. */
static const char hermes_tools_head[] =
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>";
static const char hermes_tools_tail[] =
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>";

/* Llama 3.1's system header when tools are given (its template with
 * tools_in_user_message=false and the default date_string): the
 * environment line, the knowledge dates, and the JSON calling instructions,
 * whose sentences the template joins without spaces. */
static const char llama3_tools_head[] =
    "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
    "You have access to the following functions. To call a function, please respond with JSON for a function "
    "call.Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "
    "value}.Do not use variables.\n\n";

/* The system text with the tool block in it (sys may be NULL: no system
 * message). Llama 3 puts the block before the (trimmed) system text, the
 * others after it, separated by a blank line. */
static void compose_system(pd_chat_family f, const char *sys, const pd_chat_tool *tools, size_t n_tools,
                           pd_sbuf *b) {
    if (f == PD_CHAT_LLAMA3) {
        pd_sbuf_puts(b, llama3_tools_head);
        for (size_t t = 0; t < n_tools; t++) {
            dump_tool(b, &tools[t], 4);
            pd_sbuf_puts(b, "\n\n");
        }
        if (sys) buf_trimmed(b, sys);
        return;
    }
    if (sys) {
        pd_sbuf_puts(b, sys);
        pd_sbuf_puts(b, "\n\n");
    }
    pd_sbuf_puts(b, hermes_tools_head);
    for (size_t t = 0; t < n_tools; t++) {
        pd_sbuf_puts(b, "\n");
        dump_tool(b, &tools[t], 0);
    }
    pd_sbuf_puts(b, hermes_tools_tail);
}

/* Mistral v0.3's list: [AVAILABLE_TOOLS] [tool, tool][/AVAILABLE_TOOLS]. */
static void compose_mistral_tools(const pd_chat_tool *tools, size_t n_tools, pd_sbuf *b) {
    pd_sbuf_puts(b, "[AVAILABLE_TOOLS] [");
    for (size_t t = 0; t < n_tools; t++) {
        if (t > 0) pd_sbuf_puts(b, ", ");
        dump_tool(b, &tools[t], 0);
    }
    pd_sbuf_puts(b, "][/AVAILABLE_TOOLS]");
}

/* An assistant turn's text with its calls in the family's syntax. Llama 3's
 * and Mistral's templates write only the calls of such a turn; Qwen's (and
 * the generic form) keep the text and put the calls after a newline. */
static void compose_assistant_calls(pd_chat_family f, const pd_chat_message *m, pd_sbuf *b) {
    pd_chat_tool_syntax syn;
    pd_chat_tool_syntax_of(f, &syn);
    const bool keeps_text = f != PD_CHAT_LLAMA3 && f != PD_CHAT_MISTRAL;
    if (keeps_text && m->content[0]) {
        pd_sbuf_puts(b, m->content);
        pd_sbuf_puts(b, "\n");
    }
    if (syn.json_list) pd_sbuf_puts(b, syn.open);
    for (size_t k = 0; k < m->n_tool_calls; k++) {
        if (k > 0) pd_sbuf_puts(b, syn.sep);
        if (!syn.json_list) pd_sbuf_puts(b, syn.open);
        dump_call(b, &m->tool_calls[k], syn.args_key, f == PD_CHAT_MISTRAL);
        if (!syn.json_list) pd_sbuf_puts(b, syn.close);
    }
    if (syn.json_list) pd_sbuf_puts(b, syn.close);
}

/* Mistral v0.3's result: [TOOL_RESULTS] {"content": C, "call_id": ID}[/TOOL_RESULTS],
 * the content written as given (the template does not quote it). */
static void compose_mistral_result(const pd_chat_message *m, pd_sbuf *b) {
    pd_sbuf_puts(b, "[TOOL_RESULTS] {\"content\": ");
    pd_sbuf_puts(b, m->content);
    if (m->tool_call_id) {
        pd_sbuf_puts(b, ", \"call_id\": ");
        py_json_string(b, m->tool_call_id, strlen(m->tool_call_id));
    }
    pd_sbuf_puts(b, "}[/TOOL_RESULTS]");
}

/* The conversation the renderers see: tool blocks, calls and results
 * turned into ordinary system/user/assistant text in the family's way
 * (Llama 3 keeps "ipython" turns, Mistral ROLE_TOOL ones). */
typedef struct chat_conv {
    pd_chat_message *msgs;
    chat_role *roles;
    bool *verbatim;  /* texts built here that Llama 3 must not trim */
    char **owned;    /* the texts built here */
    size_t n, n_owned, n_lead_sys;
    char *tools_block; /* Mistral's [AVAILABLE_TOOLS] list, or NULL */
    bool oom;
} chat_conv;

static void conv_free(chat_conv *c) {
    for (size_t i = 0; i < c->n_owned; i++) free(c->owned[i]);
    free(c->owned);
    free(c->msgs);
    free(c->roles);
    free(c->verbatim);
    free(c->tools_block);
}

/* Take a built text as the next message of c (or note the failure). */
static void conv_push_built(chat_conv *c, const char *role, chat_role r, pd_sbuf *b, bool verbatim) {
    if (b->oom || !b->p) {
        free(b->p);
        c->oom = true;
        return;
    }
    c->owned[c->n_owned++] = b->p;
    c->msgs[c->n] = (pd_chat_message){.role = role, .content = b->p};
    c->roles[c->n] = r;
    c->verbatim[c->n] = verbatim;
    c->n++;
}

static void conv_push(chat_conv *c, const pd_chat_message *m, chat_role r) {
    c->msgs[c->n] = (pd_chat_message){.role = m->role, .content = m->content};
    c->roles[c->n] = r;
    c->verbatim[c->n] = false;
    c->n++;
}

static void build_conv(pd_chat_family f, const pd_chat_message *msgs, const chat_role *roles, size_t n,
                       size_t n_lead_sys, const pd_chat_tool *tools, size_t n_tools, chat_conv *c) {
    const size_t cap = n + 1; /* + the system turn a tool block may create */
    c->msgs = calloc(cap, sizeof *c->msgs);
    c->roles = calloc(cap, sizeof *c->roles);
    c->verbatim = calloc(cap, sizeof *c->verbatim);
    c->owned = calloc(cap, sizeof *c->owned);
    if (!c->msgs || !c->roles || !c->verbatim || !c->owned) {
        c->oom = true;
        return;
    }
    size_t i = 0;
    c->n_lead_sys = n_lead_sys;
    if (n_tools > 0 && f == PD_CHAT_MISTRAL) {
        pd_sbuf b = {0};
        compose_mistral_tools(tools, n_tools, &b);
        if (b.oom) free(b.p);
        c->tools_block = b.oom ? NULL : b.p;
        c->oom |= b.oom;
    } else if (n_tools > 0) {
        /* The block joins the first system message, or makes one. */
        pd_sbuf b = {0};
        compose_system(f, n_lead_sys > 0 ? msgs[0].content : NULL, tools, n_tools, &b);
        conv_push_built(c, "system", ROLE_SYSTEM, &b, true);
        if (n_lead_sys > 0)
            i = 1;
        else
            c->n_lead_sys = 1;
    }
    for (; i < n && !c->oom; i++) {
        pd_sbuf b = {0};
        if (roles[i] == ROLE_ASSISTANT && msgs[i].n_tool_calls > 0) {
            compose_assistant_calls(f, &msgs[i], &b);
            conv_push_built(c, msgs[i].role, ROLE_ASSISTANT, &b, true);
        } else if (roles[i] != ROLE_TOOL) {
            conv_push(c, &msgs[i], roles[i]);
        } else if (f == PD_CHAT_LLAMA3) { /* its "ipython" turn, the result as given */
            conv_push(c, &msgs[i], ROLE_TOOL);
            c->msgs[c->n - 1].role = "ipython";
            c->verbatim[c->n - 1] = true;
        } else if (f == PD_CHAT_MISTRAL) {
            compose_mistral_result(&msgs[i], &b);
            conv_push_built(c, "tool", ROLE_TOOL, &b, true);
        } else {
            /* Consecutive results share one user turn, each in a
             * <tool_response> block (Qwen2.5/Qwen3). */
            for (size_t j = i; j < n && roles[j] == ROLE_TOOL; j++) {
                if (j > i) pd_sbuf_puts(&b, "\n");
                pd_sbuf_puts(&b, "<tool_response>\n");
                pd_sbuf_puts(&b, msgs[j].content);
                pd_sbuf_puts(&b, "\n</tool_response>");
                i = j;
            }
            conv_push_built(c, "user", ROLE_USER, &b, false);
        }
    }
}

/* ------------------------------------------------------------------------
 * Validation and entry points
 * ------------------------------------------------------------------------ */

static int validate_tool_calls(pd_chat_family f, const pd_chat_message *m, size_t i, chat_role role,
                               pd_error *err) {
    if (m->n_tool_calls == 0) return PD_OK;
    if (!m->tool_calls)
        return pd_errorf(err, PD_EINVAL, "chat: message %zu has %zu tool_calls but a NULL tool_calls array", i,
                         m->n_tool_calls);
    if (role != ROLE_ASSISTANT)
        return pd_errorf(err, PD_EINVAL,
                         "chat: message %zu (%s) has tool_calls; only assistant messages carry tool calls", i,
                         m->role);
    if (f == PD_CHAT_LLAMA3 && m->n_tool_calls > 1)
        return pd_errorf(err, PD_EINVAL,
                         "chat: message %zu has %zu tool_calls; the llama3 template writes one call per "
                         "assistant turn (send each call as its own assistant message, followed by its tool "
                         "result)",
                         i, m->n_tool_calls);
    for (size_t k = 0; k < m->n_tool_calls; k++) {
        const pd_chat_tool_call *c = &m->tool_calls[k];
        if (!c->name || !c->name[0])
            return pd_errorf(err, PD_EINVAL, "chat: message %zu: tool_calls[%zu] has no function name", i, k);
        char why[256];
        json_t *args = parse_object(c->arguments, why, sizeof why);
        if (!args)
            return pd_errorf(err, PD_EINVAL,
                             "chat: message %zu: tool_calls[%zu].function.arguments is %s; send the "
                             "arguments as the text of a JSON object, e.g. \"{\\\"city\\\": \\\"Paris\\\"}\"",
                             i, k, why);
        json_decref(args);
    }
    return PD_OK;
}

static int validate_tools(const pd_chat_tool *tools, size_t n_tools, pd_error *err) {
    if (n_tools > 0 && !tools)
        return pd_errorf(err, PD_EINVAL, "chat: %zu tools but a NULL tools array", n_tools);
    for (size_t t = 0; t < n_tools; t++) {
        if (!tools[t].name || !tools[t].name[0])
            return pd_errorf(err, PD_EINVAL, "chat: tools[%zu] has no name; give every tool a function.name", t);
        if (!tools[t].parameters) continue;
        char why[256];
        json_t *params = parse_object(tools[t].parameters, why, sizeof why);
        if (!params)
            return pd_errorf(err, PD_EINVAL,
                             "chat: tools[%zu] (%.64s): function.parameters is %s; send a JSON Schema object", t,
                             tools[t].name, why);
        json_decref(params);
    }
    return PD_OK;
}

int pd_chat_render(pd_chat_family f, const pd_chat_message *msgs, size_t n, bool add_generation_prompt,
                   char **out, size_t *len, size_t *system_len, pd_error *err) {
    return pd_chat_render_tools(f, msgs, n, NULL, 0, add_generation_prompt, out, len, system_len, err);
}

int pd_chat_render_tools(pd_chat_family f, const pd_chat_message *msgs, size_t n, const pd_chat_tool *tools,
                         size_t n_tools, bool add_generation_prompt, char **out, size_t *len, size_t *system_len,
                         pd_error *err) {
    if (out) *out = NULL;
    if (len) *len = 0;
    if (system_len) *system_len = 0;
    if (!out) return pd_errorf(err, PD_EINVAL, "pd_chat_render: NULL output pointer");
    if ((int)f < 0 || f >= PD_CHAT_FAMILY_COUNT)
        return pd_errorf(err, PD_EINVAL, "chat template: unknown family value %d", (int)f);
    if (f == PD_CHAT_NONE)
        return pd_errorf(err, PD_EINVAL,
                         "chat template: none; the model's tokenizer.chat_template is absent or not a "
                         "recognised family (chatml, llama3, llama2, mistral, zephyr, phi3, gemma, qwen3); name one "
                         "explicitly or send a plain completion prompt");
    if (n == 0) return pd_errorf(err, PD_EINVAL, "chat: no messages; send at least one message");
    if (!msgs) return pd_errorf(err, PD_EINVAL, "chat: %zu messages but a NULL message array", n);
    int rc = validate_tools(tools, n_tools, err);
    if (rc != PD_OK) return rc;

    chat_role *roles = calloc(n, sizeof *roles); /* calloc: checks n * size for overflow */
    if (!roles) return pd_errorf(err, PD_ENOMEM, "chat: out of memory for %zu messages", n);

    /* Validate everything before rendering so a bad message never leaves a
     * half-built prompt behind. */
    size_t n_lead_sys = 0;
    bool leading = true;
    for (size_t i = 0; i < n; i++) {
        const char *role = msgs[i].role;
        if (!role) {
            rc = pd_errorf(err, PD_EINVAL,
                           "chat: message %zu has no role; use \"system\", \"user\", \"assistant\" or \"tool\"", i);
        } else if (strcmp(role, "system") == 0) {
            roles[i] = ROLE_SYSTEM;
        } else if (strcmp(role, "user") == 0) {
            roles[i] = ROLE_USER;
        } else if (strcmp(role, "assistant") == 0) {
            roles[i] = ROLE_ASSISTANT;
        } else if (strcmp(role, "tool") == 0) {
            roles[i] = ROLE_TOOL;
        } else {
            rc = pd_errorf(err, PD_EINVAL,
                           "chat: message %zu has role \"%.64s\"; only \"system\", \"user\", \"assistant\" and "
                           "\"tool\" are supported",
                           i, role);
        }
        if (rc != PD_OK) break;
        if (!msgs[i].content) {
            rc = pd_errorf(err, PD_EINVAL, "chat: message %zu (%s) has NULL content; use \"\" for an empty message",
                           i, role);
            break;
        }
        rc = validate_tool_calls(f, &msgs[i], i, roles[i], err);
        if (rc != PD_OK) break;
        if (roles[i] == ROLE_SYSTEM && leading) {
            n_lead_sys++;
        } else {
            leading = false;
            if (roles[i] == ROLE_SYSTEM && !family_has_system_turn(f))
                rc = pd_errorf(err, PD_EINVAL,
                               "chat: message %zu is a system message after the conversation started; "
                               "the %s template can only place system text at the start (move it to the "
                               "beginning or fold it into a user message)",
                               i, pd_chat_family_name(f));
        }
        if (rc != PD_OK) break;
    }
    if (rc != PD_OK) {
        free(roles);
        return rc;
    }

    chat_conv c = {0};
    build_conv(f, msgs, roles, n, n_lead_sys, tools, n_tools, &c);
    free(roles);
    pd_sbuf b = {0};
    size_t sys_len = 0;
    if (!c.oom) {
        if (family_has_system_turn(f))
            render_turns(f, c.msgs, c.roles, c.verbatim, c.n, c.n_lead_sys, add_generation_prompt, &b, &sys_len);
        else if (f == PD_CHAT_GEMMA)
            render_gemma(c.msgs, c.roles, c.n, c.n_lead_sys, add_generation_prompt, &b, &sys_len);
        else
            render_inst(f, c.msgs, c.roles, c.n, c.n_lead_sys, c.tools_block, &b, &sys_len);
    }
    const bool oom = c.oom || b.oom || !b.p;
    conv_free(&c);
    if (oom) {
        free(b.p);
        return pd_errorf(err, PD_ENOMEM, "chat: out of memory rendering %zu messages (%s template)", n,
                         pd_chat_family_name(f));
    }
    *out = b.p;
    if (len) *len = b.len;
    if (system_len) *system_len = sys_len;
    return PD_OK;
}
