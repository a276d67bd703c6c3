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

typedef struct pd_chat_message {
    const char *role;    /* "system", "user" or "assistant" */
    const char *content; /* UTF-8, NUL-terminated */
} pd_chat_message;

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

#ifdef __cplusplus
}
#endif
#endif
