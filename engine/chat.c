/* Chat templates: recognise the common families from a model's
 * `tokenizer.chat_template` text and render conversations in them.
 *
 * prefixd runs no Jinja. Detection looks for each family's distinctive
 * markers, in the order llama.cpp's llm_chat_detect_template uses, and
 * rendering follows llama.cpp's llm_chat_apply_template for the same family
 * (see docs/chat-templates.md for the exact formats and the variants that
 * are mapped or refused). */

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

typedef struct chat_buf {
    char *data;
    size_t len, cap;
    bool oom;
} chat_buf;

/* Append n bytes; on allocation failure (or size overflow) remember it and
 * ignore further appends, so the renderers need no error path per call. */
static void buf_add(chat_buf *b, const char *s, size_t n) {
    if (b->oom || n == 0) return;
    if (n > SIZE_MAX - 1 - b->len) {
        b->oom = true;
        return;
    }
    size_t need = b->len + n + 1; /* + NUL */
    if (need > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < need) cap = cap > SIZE_MAX / 2 ? need : cap * 2;
        char *p = realloc(b->data, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->data = p;
        b->cap = cap;
    }
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
}

static void buf_str(chat_buf *b, const char *s) { buf_add(b, s, strlen(s)); }

static bool is_ascii_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

/* Llama 3 and Gemma trim every message they trim (the official templates'
 * `| trim`, and llama.cpp's trim()); ASCII whitespace only, as llama.cpp's
 * isspace. */
static void buf_trimmed(chat_buf *b, const char *s) {
    size_t n = strlen(s);
    size_t a = 0;
    while (a < n && is_ascii_space(s[a])) a++;
    while (n > a && is_ascii_space(s[n - 1])) n--;
    buf_add(b, s + a, n - a);
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

typedef enum chat_role { ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT } chat_role;

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
static void render_qwen3_assistant(const char *content, bool after_last_query, bool last, chat_buf *b) {
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
    buf_str(b, "<|im_start|>assistant\n");
    if (after_last_query && (last || r_end > r)) {
        strip_newlines(&r, &r_end, true, true);
        buf_str(b, "<think>\n");
        buf_add(b, r, (size_t)(r_end - r));
        buf_str(b, "\n</think>\n\n");
        strip_newlines(&c, &c_end, true, false);
    }
    buf_add(b, c, (size_t)(c_end - c));
    buf_str(b, "<|im_end|>\n");
}

/* Turn-based families: every message is "open role sep content close",
 * with its own role name, so a system message may appear anywhere. */
static void render_turns(pd_chat_family f, const pd_chat_message *msgs, const chat_role *roles, size_t n,
                         size_t n_lead_sys, bool add_gen, chat_buf *b, size_t *system_len) {
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
                buf_str(b, "<|im_start|>");
                buf_str(b, role);
                buf_str(b, "\n");
                buf_str(b, msgs[i].content);
                buf_str(b, "<|im_end|>\n");
                break;
            case PD_CHAT_LLAMA3:
                buf_str(b, "<|start_header_id|>");
                buf_str(b, role);
                buf_str(b, "<|end_header_id|>\n\n");
                buf_trimmed(b, msgs[i].content);
                buf_str(b, "<|eot_id|>");
                break;
            case PD_CHAT_ZEPHYR:
            case PD_CHAT_PHI3:
                buf_str(b, "<|");
                buf_str(b, role);
                buf_str(b, "|>\n");
                buf_str(b, msgs[i].content);
                buf_str(b, f == PD_CHAT_PHI3 ? "<|end|>\n" : "</s>\n");
                break;
            default: break;
            }
        }
        if (i + 1 == n_lead_sys) *system_len = b->len;
    }
    if (!add_gen) return;
    switch (f) {
    case PD_CHAT_CHATML: buf_str(b, "<|im_start|>assistant\n"); break;
    case PD_CHAT_QWEN3: buf_str(b, "<|im_start|>assistant\n<think>\n\n</think>\n\n"); break;
    case PD_CHAT_LLAMA3: buf_str(b, "<|start_header_id|>assistant<|end_header_id|>\n\n"); break;
    case PD_CHAT_ZEPHYR:
    case PD_CHAT_PHI3: buf_str(b, "<|assistant|>\n"); break;
    default: break;
    }
}

/* [INST] families. The leading system message(s) go inside the first
 * [INST]: Llama 2 in one <<SYS>> block, Mistral (no system role) as plain
 * text followed by "\n", as llama.cpp does for templates without <<SYS>>.
 * Several leading system messages are joined with "\n". "[/INST]" already
 * ends the user turn, so there is no generation prompt to add. */
static void render_inst(pd_chat_family f, const pd_chat_message *msgs, const chat_role *roles,
                        size_t n, size_t n_lead_sys, chat_buf *b, size_t *system_len) {
    buf_str(b, "[INST] ");
    if (n_lead_sys > 0) {
        if (f == PD_CHAT_LLAMA2) buf_str(b, "<<SYS>>\n");
        for (size_t i = 0; i < n_lead_sys; i++) {
            if (i > 0) buf_str(b, "\n");
            buf_str(b, msgs[i].content);
        }
        buf_str(b, f == PD_CHAT_LLAMA2 ? "\n<</SYS>>\n\n" : "\n");
        *system_len = b->len;
    }
    bool open = true; /* inside an [INST] turn that has been written */
    for (size_t i = n_lead_sys; i < n; i++) {
        if (!open) {
            /* Llama 2 chat restarts every exchange with BOS; Mistral's
             * template emits BOS only once, at the very start. */
            buf_str(b, f == PD_CHAT_LLAMA2 ? "<s>[INST] " : "[INST] ");
            open = true;
        }
        if (roles[i] == ROLE_USER) {
            buf_str(b, msgs[i].content);
            buf_str(b, " [/INST]");
        } else { /* assistant: system ones were refused by validation */
            buf_str(b, msgs[i].content);
            buf_str(b, "</s>");
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
                         bool add_gen, chat_buf *b, size_t *system_len) {
    bool open = false; /* a user turn holding the system text is open */
    if (n_lead_sys > 0) {
        buf_str(b, "<start_of_turn>user\n");
        for (size_t i = 0; i < n_lead_sys; i++) {
            buf_str(b, msgs[i].content);
            buf_str(b, "\n\n");
        }
        *system_len = b->len;
        open = true;
    }
    for (size_t i = n_lead_sys; i < n; i++) {
        const bool user = roles[i] == ROLE_USER; /* system ones were refused by validation */
        if (open && !user) buf_str(b, "<end_of_turn>\n");
        if (!open || !user) {
            buf_str(b, "<start_of_turn>");
            buf_str(b, user ? "user" : "model");
            buf_str(b, "\n");
        }
        open = false;
        buf_trimmed(b, msgs[i].content);
        buf_str(b, "<end_of_turn>\n");
    }
    if (!add_gen) return;
    if (open) buf_str(b, "<end_of_turn>\n");
    buf_str(b, "<start_of_turn>model\n");
}

int pd_chat_render(pd_chat_family f, const pd_chat_message *msgs, size_t n, bool add_generation_prompt,
                   char **out, size_t *len, size_t *system_len, pd_error *err) {
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

    chat_role *roles = calloc(n, sizeof *roles); /* calloc: checks n * size for overflow */
    if (!roles) return pd_errorf(err, PD_ENOMEM, "chat: out of memory for %zu messages", n);

    /* Validate everything before rendering so a bad message never leaves a
     * half-built prompt behind. */
    size_t n_lead_sys = 0;
    bool leading = true;
    int rc = PD_OK;
    for (size_t i = 0; i < n; i++) {
        const char *role = msgs[i].role;
        if (!role) {
            rc = pd_errorf(err, PD_EINVAL, "chat: message %zu has no role; use \"system\", \"user\" or \"assistant\"", i);
        } else if (strcmp(role, "system") == 0) {
            roles[i] = ROLE_SYSTEM;
        } else if (strcmp(role, "user") == 0) {
            roles[i] = ROLE_USER;
        } else if (strcmp(role, "assistant") == 0) {
            roles[i] = ROLE_ASSISTANT;
        } else {
            rc = pd_errorf(err, PD_EINVAL,
                           "chat: message %zu has role \"%.64s\"; only \"system\", \"user\" and "
                           "\"assistant\" are supported",
                           i, role);
        }
        if (rc != PD_OK) break;
        if (!msgs[i].content) {
            rc = pd_errorf(err, PD_EINVAL, "chat: message %zu (%s) has NULL content; use \"\" for an empty message",
                           i, role);
            break;
        }
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

    chat_buf b = {0};
    size_t sys_len = 0;
    if (family_has_system_turn(f))
        render_turns(f, msgs, roles, n, n_lead_sys, add_generation_prompt, &b, &sys_len);
    else if (f == PD_CHAT_GEMMA)
        render_gemma(msgs, roles, n, n_lead_sys, add_generation_prompt, &b, &sys_len);
    else
        render_inst(f, msgs, roles, n, n_lead_sys, &b, &sys_len);
    free(roles);
    if (b.oom || !b.data) {
        free(b.data);
        return pd_errorf(err, PD_ENOMEM, "chat: out of memory rendering %zu messages (%s template)", n,
                         pd_chat_family_name(f));
    }
    *out = b.data;
    if (len) *len = b.len;
    if (system_len) *system_len = sys_len;
    return PD_OK;
}
