/* Internal to grammar/: the pieces JSON Schema translation shares between
 * schema.c (schemas), regex.c (patterns, literal and class spelling) and
 * validate.c (the direct validator). */
#ifndef PD_GRAMMAR_SCHEMA_INTERNAL_H
#define PD_GRAMMAR_SCHEMA_INTERNAL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar.h"

/* The largest count a schema may ask for (minItems, maxLength, {m,n} in a
 * pattern): the grammar's own repetition limit. */
#define PD_SCHEMA_MAX_COUNT 10000

static inline void pd_sbuf_free(pd_sbuf *b) {
    free(b->p);
    *b = (pd_sbuf){0};
}

/* Keywords that constrain nothing and are accepted and ignored.
 * "discriminator" is OpenAPI's hint beside a oneOf (pydantic v2 writes it
 * for tagged unions): the branches themselves already decide. */
static inline bool pd_schema_is_annotation(const char *key) {
    static const char *const names[] = {"title",     "description", "default",  "examples", "$schema",
                                        "$id",       "$comment",    "deprecated", "readOnly", "writeOnly",
                                        "$defs",     "definitions", "discriminator"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(key, names[i]) == 0) return true;
    return false;
}

/* Append a JSON pointer token (escaping ~ and /) to a "#/a/b" path. */
static inline void pd_schema_path_push(pd_sbuf *path, const char *token) {
    pd_sbuf_putn(path, "/", 1);
    for (const char *c = token; *c; c++) {
        if (*c == '~') pd_sbuf_puts(path, "~0");
        else if (*c == '/') pd_sbuf_puts(path, "~1");
        else pd_sbuf_putn(path, c, 1);
    }
}

static inline void pd_schema_path_pop(pd_sbuf *path, size_t len) {
    if (path->p && len <= path->len) {
        path->len = len;
        path->p[len] = '\0';
    }
}

/* The definition a "$ref" names in root: "#/$defs/NAME",
 * "#/definitions/NAME" or "#" (root itself). NULL with *err filled when the
 * reference is of another form (PD_EUNSUPPORTED) or names nothing
 * (PD_EINVAL). */
const json_t *pd_schema_resolve_ref(const json_t *root, const char *ref, const char *path, pd_error *err);

/* validate.c: doc against schema, a node of the schema root (for $ref);
 * with skip_enum the node's own enum and const are not checked (schema.c
 * keeps the enum values that meet the rest of a schema). *violation tells
 * a document that does not fit (PD_EINVAL) from a schema that is wrong. */
int pd_schema_validate_node(const json_t *root, const json_t *schema, const json_t *doc, bool skip_enum,
                            bool *violation, pd_error *err);

/* The message for a keyword outside the subset (PD_EUNSUPPORTED). */
int pd_schema_unsupported_keyword(pd_error *err, const char *key, const char *path);

/* regex.c: the expression (grammar text) that spells, inside a JSON
 * string's quotes, every string the ECMAScript-subset pattern matches
 * (unanchored ends may be any text: char_rule*). The spelling of
 * characters JSON must escape is their JSON escape. Unsupported constructs
 * are PD_EUNSUPPORTED naming "pattern", the construct and path. */
int pd_schema_pattern_expr(const char *pattern, const char *char_rule, const char *path, pd_sbuf *out,
                           pd_error *err);

/* regex.c: one code point inside a grammar class [...], escaped where the
 * class syntax needs it; and the canonical JSON spelling of one character
 * inside a string (raw UTF-8, or \" \\ \n ... \u001f). */
void pd_schema_class_char(pd_sbuf *b, uint32_t cp);
void pd_schema_spell_cp(pd_sbuf *b, uint32_t cp);

#endif
