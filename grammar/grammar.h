/* grammar: constrained decoding. A grammar (the GBNF syntax llama.cpp
 * uses, a subset: see below) is compiled to one byte-level automaton per
 * rule; a matcher per sequence masks the logits of every token that cannot
 * continue a valid text; JSON Schema (a subset) compiles to grammar text.
 *
 * The folder sits just above util/: it knows nothing of models or
 * tokenizers. A vocabulary is handed in as each token's bytes and kind, so
 * daemon/ and api/ build one per model and share it. */
#ifndef PD_GRAMMAR_H
#define PD_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdint.h>

#include <jansson.h>

#include "util/util.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------
 * Grammar text
 *
 *   # comment to the end of the line
 *   name ::= alternatives        rules; a rule runs until the next `name ::=`
 *   a b c                        sequence
 *   a | b                        alternatives
 *   ( ... )                      group
 *   x*  x+  x?  x{m}  x{m,}  x{m,n}   repetition (m, n <= 10000)
 *   "text"                       literal; escapes \" \\ \n \r \t \xHH \uHHHH \UHHHHHHHH
 *   [a-z_]  [^"\\]               a class of Unicode code points (ranges, escapes as above,
 *                                and \] \- \^ \[); [^...] is every code point not listed
 *   .                            any code point
 *   name                         a reference to a rule (defined anywhere in the text)
 *   <[123]>                      exactly the token with id 123 (for control tokens such as
 *                                Mistral's [TOOL_CALLS], which have no bytes of their own)
 *
 * Names are [A-Za-z0-9_-]+. The start rule is `root`. Code points are
 * matched as their UTF-8 bytes, so a class or `.` only ever admits valid
 * UTF-8 (no surrogates, nothing above U+10FFFF). Left recursion (a rule
 * that can reach itself without consuming a byte) is refused, as are rules
 * used but not defined and rules that match no finite text.
 * ------------------------------------------------------------------------ */

typedef struct pd_grammar pd_grammar;

/* Compile grammar text. Errors (PD_EINVAL) give line:column and what was
 * expected. The result is immutable apart from its internal mask cache
 * (locked), so one grammar serves any number of matchers on any threads. */
int pd_grammar_compile(const char *text, size_t len, pd_grammar **out, pd_error *err);
/* Grammars are reference-counted: compile returns one reference, retain
 * adds one (and returns g), free drops one. A matcher holds its own. */
pd_grammar *pd_grammar_retain(const pd_grammar *g);
void pd_grammar_free(pd_grammar *g);

/* ------------------------------------------------------------------------
 * Vocabulary
 * ------------------------------------------------------------------------ */

typedef enum pd_grammar_token_kind {
    PD_GTOK_BYTES = 0,  /* matched by its bytes (an empty piece is never allowed) */
    PD_GTOK_SPECIAL,    /* only where the grammar names it: <[id]> */
    PD_GTOK_EOG,        /* ends the text: allowed only where the text so far is complete */
} pd_grammar_token_kind;

typedef struct pd_grammar_vocab pd_grammar_vocab;

/* pieces[i] (lens[i] bytes) is token i's text as the sequence emits it.
 * Copied; the vocabulary is immutable and shareable across threads. */
int pd_grammar_vocab_create(int32_t n_vocab, const char *const *pieces, const uint32_t *lens,
                            const uint8_t *kinds, pd_grammar_vocab **out, pd_error *err);
void pd_grammar_vocab_free(pd_grammar_vocab *v);
int32_t pd_grammar_vocab_size(const pd_grammar_vocab *v);

/* ------------------------------------------------------------------------
 * Matcher: one per sequence
 *
 * pd_grammar_matcher_mask sets the logit of every token that cannot come
 * next to -INFINITY; sample from what is left, then accept the sampled
 * token. A token is allowed when its bytes continue a prefix of some text
 * of the grammar (a special token where the grammar names it; an EOG token
 * where the text so far is complete).
 *
 * Budget: with budget > 0 (the tokens the sequence may still generate, this
 * one included), a token is allowed only when the text can still be
 * completed, and ended by an EOG token, within the budget: the shortest
 * completion after it, in bytes (each byte can be one token), is at most
 * budget - 2. So a sequence that starts with a budget at least one more
 * than the grammar's shortest text always ends complete, whatever is
 * sampled. When no token meets that (the budget was too small from the
 * start), the tokens that shorten the completion most are allowed.
 *
 * Cost: the tokens a state admits are computed once per (rule, state) over
 * a trie of the vocabulary and cached in the grammar; a mask is then the
 * union of the cached sets of the live stacks plus an exact check of the
 * few tokens that leave the innermost rule.
 * ------------------------------------------------------------------------ */

typedef struct pd_grammar_matcher pd_grammar_matcher;

/* The grammar and the vocabulary must outlive the matcher. */
int pd_grammar_matcher_create(const pd_grammar *g, const pd_grammar_vocab *v, pd_grammar_matcher **out,
                              pd_error *err);
void pd_grammar_matcher_free(pd_grammar_matcher *m);
/* logits: pd_grammar_vocab_size floats. PD_ERANGE when no token at all is
 * allowed (the vocabulary cannot spell what the grammar needs next). */
int pd_grammar_matcher_mask(pd_grammar_matcher *m, float *logits, int32_t budget, pd_error *err);
/* Advance by one token. PD_EINVAL when the grammar does not allow it. */
int pd_grammar_matcher_accept(pd_grammar_matcher *m, int32_t token, pd_error *err);
/* Whether the text so far is a complete text of the grammar. */
bool pd_grammar_matcher_complete(const pd_grammar_matcher *m);
/* The shortest completion of the text so far, in bytes (0 when complete). */
int64_t pd_grammar_matcher_min_bytes(const pd_grammar_matcher *m);

/* Compute the token sets of every state a matcher can stop at, ahead of
 * use, so that masks do not walk the vocabulary on the caller's hot path
 * (the server does it on a low-priority thread for each new grammar).
 * Stops early when *stop (may be NULL) becomes true, or when the cache is
 * half full. PD_ENOMEM only. */
int pd_grammar_warm(const pd_grammar *g, const pd_grammar_vocab *v, const atomic_bool *stop, pd_error *err);

typedef struct pd_grammar_stats {
    int64_t states_cached;   /* (rule, state) token sets computed */
    int64_t cache_hits, cache_misses;
    int64_t cache_bytes;
} pd_grammar_stats;
void pd_grammar_stats_get(const pd_grammar *g, pd_grammar_stats *out);

/* ------------------------------------------------------------------------
 * JSON Schema to grammar (grammar/schema.c)
 *
 * Supported: type (a name or an array of names: object, array, string,
 * number, integer, boolean, null), enum, const, properties, required,
 * additionalProperties (absent or true: other keys allowed, false: none, a
 * schema: other keys with values of it), items, minItems, maxItems,
 * minLength, maxLength, anyOf, oneOf (generated as anyOf), allOf of one
 * schema, $ref to "#/$defs/NAME" or "#/definitions/NAME" (recursion
 * allowed), pattern (a regular expression subset: literals, ., classes,
 * \d \w \s, groups, |, * + ? {m,n}, ^ and $), prefixItems, minimum,
 * maximum, exclusiveMinimum, exclusiveMaximum (exact on integers; whole
 * bounds on numbers), format date, time, date-time, uuid, uniqueItems
 * false, and the annotations that constrain nothing
 * (title, description, default, examples, $schema, $id, $comment,
 * deprecated, readOnly, writeOnly). `true` and {} are any JSON value.
 * Properties are generated in the order the schema lists them.
 * Anything else is refused (PD_EUNSUPPORTED) with the keyword and where it
 * is ("multipleOf" at #/properties/age), never ignored.
 *
 * The text is JSON as json.dumps writes it or compact; whitespace between
 * tokens is at most one space, or a newline and up to 20 spaces or tabs.
 * ------------------------------------------------------------------------ */

/* Grammar rules for documents valid under schema. Every rule name starts
 * with rule_prefix ([A-Za-z0-9-]+), and the rule named rule_prefix itself
 * matches one document, so several schemas can live in one grammar text.
 * *out is malloc'd, NUL-terminated. */
int pd_json_schema_grammar(const json_t *schema, const char *rule_prefix, char **out, pd_error *err);
/* Whether doc is valid under schema (the same subset, checked directly on
 * the parsed document, independently of the grammar): PD_OK, or PD_EINVAL
 * with the first violation and where it is. */
int pd_json_schema_validate(const json_t *schema, const json_t *doc, pd_error *err);
/* A quoted grammar literal for bytes (for composing grammar text): "..."
 * with escapes. malloc'd. */
char *pd_grammar_quote(const char *bytes, size_t len);

#ifdef __cplusplus
}
#endif
#endif
