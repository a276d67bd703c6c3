/* engine/chat.h: Chat templates: the recognised families and their rendering.
 * Part of engine's public contract (engine/engine.h includes every part). */
#ifndef PD_ENGINE_CHAT_H
#define PD_ENGINE_CHAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------
 * Chat templates
 *
 * prefixd does not run Jinja: it recognises the common template families
 * from the model's `tokenizer.chat_template` text and renders them itself.
 * Rendered text carries special tokens as text ("<|im_start|>"), so tokenize
 * it with parse_special; it does NOT start with the BOS token — tokenize
 * with add_special so the vocabulary adds BOS as it asks.
 * ------------------------------------------------------------------------ */

typedef enum pd_chat_family {
    PD_CHAT_NONE = 0,  /* no template, or one we do not recognise */
    PD_CHAT_CHATML,    /* <|im_start|>role\n...<|im_end|>\n (Qwen2, SmolLM2, ...) */
    PD_CHAT_LLAMA3,    /* <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|> */
    PD_CHAT_LLAMA2,    /* [INST] <<SYS>>\n...\n<</SYS>>\n\nuser [/INST]answer</s><s>[INST] ... */
    PD_CHAT_MISTRAL,   /* [INST] user [/INST]answer</s>[INST] ..., system folded into the first user turn */
    PD_CHAT_ZEPHYR,    /* <|system|>\n...</s>\n<|user|>\n...</s>\n<|assistant|>\n */
    PD_CHAT_PHI3,      /* <|system|>\n...<|end|>\n<|user|>\n...<|end|>\n<|assistant|>\n */
    PD_CHAT_GEMMA,     /* <start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n, system folded into the first user turn */
    PD_CHAT_QWEN3,     /* ChatML with thinking off: the generation prompt ends in an empty <think></think> block */
    PD_CHAT_FAMILY_COUNT
} pd_chat_family;

/* A call an assistant turn made (OpenAI tool_calls[i].function). */
typedef struct pd_chat_tool_call {
    const char *id;        /* "call_..."; NULL when unknown */
    const char *name;      /* the function's name */
    const char *arguments; /* JSON text of the arguments object */
} pd_chat_tool_call;

typedef struct pd_chat_message {
    const char *role;    /* "system", "user", "assistant" or "tool" */
    const char *content; /* UTF-8, NUL-terminated ("" for an assistant turn that only calls tools) */
    const pd_chat_tool_call *tool_calls; /* assistant: the calls it made (may be NULL) */
    size_t n_tool_calls;
    const char *tool_call_id; /* tool: the call this result answers (may be NULL) */
    const char *name;         /* tool: the function's name (may be NULL) */
} pd_chat_message;

/* A function the model may call (OpenAI tools[i].function). */
typedef struct pd_chat_tool {
    const char *name;
    const char *description; /* may be NULL */
    const char *parameters;  /* JSON Schema text of the arguments object; NULL = none */
} pd_chat_tool;

/* How a family's model writes tool calls, for the grammar that constrains
 * them and the parser that reads them back. Each call is a JSON object
 * {"name": NAME, ARGS_KEY: {...}}. */
typedef struct pd_chat_tool_syntax {
    const char *open;    /* before each call, or before the list when json_list ("<tool_call>\n") */
    const char *close;   /* after each call, or after the list ("\n</tool_call>") */
    const char *sep;     /* between calls ("\n"; ", " inside a json_list) */
    bool json_list;      /* the calls are one JSON array between open and close (Mistral) */
    bool parallel;       /* more than one call per turn can be written */
    const char *args_key; /* "arguments", or "parameters" (Llama 3) */
} pd_chat_tool_syntax;

/* The family of a template text (NULL or unrecognised: PD_CHAT_NONE). */
pd_chat_family pd_chat_detect(const char *template_text, size_t len);
typedef struct pd_model pd_model; /* engine/model.h */
/* The model's family from its GGUF `tokenizer.chat_template`; PD_CHAT_NONE
 * too when the vocabulary lacks a control token the family renders. */
pd_chat_family pd_model_chat_family(const pd_model *m);
const char *pd_chat_family_name(pd_chat_family f);       /* "chatml", ... "none"; "unknown" if out of range */
bool pd_chat_family_from_name(const char *name, pd_chat_family *out);

/* Render a conversation. With add_generation_prompt the text ends with the
 * assistant turn's opening, ready for generation. *system_len is the length
 * of the leading part of the text that depends only on the leading system
 * message(s) (0 without one): the part to look up as a stored prefix.
 * Errors (PD_EINVAL): no messages, an unknown role, a system message after
 * the first turn where the family cannot place it, PD_CHAT_NONE. *out is
 * malloc'd and NUL-terminated; len and system_len may be NULL. */
int pd_chat_render(pd_chat_family f, const pd_chat_message *msgs, size_t n, bool add_generation_prompt, char **out,
                   size_t *len, size_t *system_len, pd_error *err);
/* The same with tools offered to the model: rendered into the prompt the
 * way the family's template does (Qwen2.5/Qwen3 and ChatML: a <tools> block
 * in the system turn; Llama 3: the JSON function list in the system turn;
 * Mistral: [AVAILABLE_TOOLS] before the last user turn; others: a generic
 * block in the system turn asking for <tool_call> JSON </tool_call>).
 * Assistant turns with tool_calls and "tool" turns are rendered as the
 * family writes them. system_len covers the tool block when it sits in the
 * system part, so a system prompt with its tools is one stored prefix.
 * n_tools may be 0 (then it is pd_chat_render, tool turns included). */
int pd_chat_render_tools(pd_chat_family f, const pd_chat_message *msgs, size_t n, const pd_chat_tool *tools,
                         size_t n_tools, bool add_generation_prompt, char **out, size_t *len, size_t *system_len,
                         pd_error *err);
/* The family's tool call syntax (every family has one; the generic form is
 * <tool_call>JSON</tool_call>). */
void pd_chat_tool_syntax_of(pd_chat_family f, pd_chat_tool_syntax *out);

#ifdef __cplusplus
}
#endif
#endif
