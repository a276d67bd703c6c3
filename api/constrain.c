/* Constrained output: the grammar a request's answer must follow
 * (response_format, tools with tool_choice) and the vocabulary the grammar
 * masks. The calls are read back in toolcalls.c. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"

#define BAD(e, param, ...) pd_api_errorf((e), 400, PD_API_ERR_INVALID, (param), NULL, __VA_ARGS__)
#define OOM(e) pd_api_errorf((e), 503, PD_API_ERR_OVERLOADED, NULL, "out_of_memory", "out of memory building the grammar")

/* ---------------------------------------------------------------- vocabulary */

int pd_api_grammar_vocab(const pd_tokenizer *tok, pd_grammar_vocab **out, pd_error *err) {
    *out = NULL;
    const int32_t n = pd_tokenizer_n_vocab(tok);
    const char **pieces = calloc((size_t)n, sizeof *pieces);
    uint32_t *lens = calloc((size_t)n, sizeof *lens);
    uint8_t *kinds = calloc((size_t)n, 1);
    size_t *offs = calloc((size_t)n, sizeof *offs);
    pd_sbuf bytes = {0}; /* every piece, back to back */
    int rc = PD_OK;
    char buf[256];
    for (int32_t i = 0; pieces && lens && kinds && offs && i < n; i++) {
        if (pd_tokenizer_is_eog(tok, i)) kinds[i] = PD_GTOK_EOG;
        else if (pd_tokenizer_token_type(tok, i) == PD_TOKEN_TYPE_CONTROL) kinds[i] = PD_GTOK_SPECIAL;
        else kinds[i] = PD_GTOK_BYTES;
        int len = kinds[i] == PD_GTOK_BYTES ? pd_token_to_piece(tok, i, false, buf, sizeof buf) : 0;
        if (len < 0 || (size_t)len > sizeof buf) len = 0; /* longer than any real token: never allowed */
        offs[i] = bytes.len;
        lens[i] = (uint32_t)len;
        pd_sbuf_putn(&bytes, buf, (size_t)len);
    }
    if (!pieces || !lens || !kinds || !offs || bytes.oom) {
        rc = pd_errorf(err, PD_ENOMEM, "out of memory for the grammar vocabulary (%d tokens)", n);
        goto done;
    }
    for (int32_t i = 0; i < n; i++) pieces[i] = pd_sbuf_str(&bytes) + offs[i];
    rc = pd_grammar_vocab_create(n, pieces, lens, kinds, out, err);
done:
    free(pieces);
    free(lens);
    free(kinds);
    free(offs);
    free(bytes.p);
    return rc;
}

/* ---------------------------------------------------------------- grammar text */

static void put_literal(pd_sbuf *b, const char *bytes, size_t n) {
    char *q = pd_grammar_quote(bytes, n);
    if (!q) {
        b->oom = true;
        return;
    }
    pd_sbuf_puts(b, q);
    free(q);
}

/* The control token of the vocabulary written at text[i] ("[TOOL_CALLS]",
 * "<|tool_call|>"): its id, with *end just past it; else PD_TOKEN_NULL. */
static pd_token control_token_at(const pd_tokenizer *tok, const char *text, size_t i, size_t n, size_t *end) {
    if (text[i] != '[' && text[i] != '<') return PD_TOKEN_NULL;
    for (size_t j = i + 1; j < n && j - i < 32; j++) {
        if (text[j] != ']' && text[j] != '>') continue;
        pd_token t = pd_tokenizer_find(tok, text + i, j - i + 1);
        if (t != PD_TOKEN_NULL && pd_tokenizer_token_type(tok, t) == PD_TOKEN_TYPE_CONTROL) {
            *end = j + 1;
            return t;
        }
    }
    return PD_TOKEN_NULL;
}

/* Text of a tool syntax as grammar elements: a control token of the
 * vocabulary written in it ("[TOOL_CALLS]" of Mistral's) becomes <[id]>,
 * since the model emits it as that one token; the rest are literals. */
static void put_syntax_text(pd_sbuf *b, const pd_tokenizer *tok, const char *text) {
    size_t n = strlen(text), lit = 0;
    if (n == 0) {
        pd_sbuf_puts(b, "\"\"");
        return;
    }
    for (size_t i = 0; i < n; i++) {
        size_t end;
        pd_token t = control_token_at(tok, text, i, n, &end);
        if (t == PD_TOKEN_NULL) continue;
        if (i > lit) {
            put_literal(b, text + lit, i - lit);
            pd_sbuf_puts(b, " ");
        }
        pd_sbuf_printf(b, "<[%d]> ", (int)t);
        lit = end;
        i = end - 1;
    }
    if (lit < n) put_literal(b, text + lit, n - lit);
}

/* Whether the syntax text starts with a control token (then plain text can
 * never begin a call: the model has no bytes that make that token). */
static bool starts_with_control(const pd_tokenizer *tok, const char *text) {
    size_t end;
    return text[0] && control_token_at(tok, text, 0, strlen(text), &end) != PD_TOKEN_NULL;
}

/* Rules of one schema under a prefix, appended. schema_param names the
 * request field for a 400. */
static int put_schema(pd_sbuf *b, const json_t *schema, const char *prefix, const char *schema_param, pd_api_error *e) {
    char *text = NULL;
    pd_error err = {0};
    int rc = pd_json_schema_grammar(schema, prefix, &text, &err);
    if (rc == PD_ENOMEM) return OOM(e);
    if (rc) return BAD(e, schema_param, "'%s': %s", schema_param, err.msg);
    pd_sbuf_puts(b, text);
    pd_sbuf_puts(b, "\n");
    free(text);
    return PD_OK;
}

/* Plain text that does not start with `trigger`: ASCII trigger bytes, one
 * rule per position (the text may stop, differ there, or go on matching). */
static void put_text_rules(pd_sbuf *b, const char *trigger) {
    size_t n = strlen(trigger);
    for (size_t k = 0; k < n; k++) {
        pd_sbuf_printf(b, "tc-text%zu ::= \"\" | [^\\x%02x] .*", k, (unsigned char)trigger[k]);
        if (k + 1 < n) pd_sbuf_printf(b, " | \"\\x%02x\" tc-text%zu", (unsigned char)trigger[k], k + 1);
        pd_sbuf_puts(b, "\n");
    }
}

int pd_api_constraint_build(const pd_api_request *r, pd_chat_family family, const pd_tokenizer *tok,
                            pd_api_constraint *out, pd_api_error *e) {
    memset(out, 0, sizeof *out);
    const bool tools = r->kind == PD_API_CHAT && r->n_tools > 0 && r->tool_choice != PD_API_TOOLS_NONE;
    if (r->grammar) { /* the client's own grammar, as it is (its rules, its root) */
        out->grammar = strdup(r->grammar);
        return out->grammar ? PD_OK : OOM(e);
    }
    if (!tools && r->format == PD_API_FORMAT_TEXT) return PD_OK;
    pd_sbuf b = {0};
    int rc = PD_OK;
    pd_sbuf_puts(&b, "tc-ws ::= ( \" \" | \"\\n\" [ \\t]{0,20} )?\n");
    /* the answer when it is not a call: a document (response_format) */
    if (r->format == PD_API_FORMAT_JSON_OBJECT) {
        json_t *obj = json_pack("{s:s}", "type", "object");
        rc = obj ? put_schema(&b, obj, "fmt", "response_format", e) : OOM(e);
        json_decref(obj);
    } else if (r->format == PD_API_FORMAT_JSON_SCHEMA) {
        rc = put_schema(&b, r->schema, "fmt", "response_format.json_schema.schema", e);
    }
    if (rc) goto fail;
    if (!tools) {
        pd_sbuf_puts(&b, "root ::= fmt\n");
        goto done;
    }

    pd_chat_tool_syntax syn;
    pd_chat_tool_syntax_of(family, &syn);
    out->tool_calls = true;
    out->syntax = syn;
    pd_api_tool_trigger(&syn, out->trigger, sizeof out->trigger);
    pd_sbuf_puts(&b, "tc-call ::= ");
    size_t n_calls = 0;
    for (size_t i = 0; i < r->n_tools; i++) {
        if (r->tool_choice == PD_API_TOOLS_NAMED && strcmp(r->tools[i].name, r->tool_choice_name) != 0) continue;
        pd_sbuf_printf(&b, "%stc-call%zu", n_calls++ ? " | " : "", i);
    }
    pd_sbuf_puts(&b, "\n");
    for (size_t i = 0; i < r->n_tools; i++) {
        if (r->tool_choice == PD_API_TOOLS_NAMED && strcmp(r->tools[i].name, r->tool_choice_name) != 0) continue;
        char param[64], prefix[32];
        snprintf(param, sizeof param, "tools[%zu].function.parameters", i);
        snprintf(prefix, sizeof prefix, "tc-a%zu", i);
        json_error_t jerr;
        json_t *schema = r->tools[i].parameters ? json_loads(r->tools[i].parameters, 0, &jerr)
                                                : json_pack("{s:s,s:b}", "type", "object", "additionalProperties", 0);
        if (!schema) {
            rc = OOM(e);
            goto fail;
        }
        rc = put_schema(&b, schema, prefix, param, e);
        json_decref(schema);
        if (rc) goto fail;
        /* {"name": "NAME", "ARGS": {...}} with the JSON spacing a model writes */
        pd_sbuf_printf(&b,
                       "tc-call%zu ::= \"{\" tc-ws \"\\\"name\\\"\" tc-ws \":\" tc-ws \"\\\"%s\\\"\" tc-ws \",\" "
                       "tc-ws \"\\\"%s\\\"\" tc-ws \":\" tc-ws %s tc-ws \"}\"\n",
                       i, r->tools[i].name, syn.args_key, prefix);
    }
    const bool many = syn.parallel && r->parallel_tool_calls && r->tool_choice != PD_API_TOOLS_NAMED;
    pd_sbuf_puts(&b, "tc-calls ::= ");
    put_syntax_text(&b, tok, syn.open);
    pd_sbuf_puts(&b, " tc-call ");
    if (!syn.json_list) {
        put_syntax_text(&b, tok, syn.close);
        if (many) {
            pd_sbuf_puts(&b, " ( ");
            put_syntax_text(&b, tok, syn.sep);
            pd_sbuf_puts(&b, " ");
            put_syntax_text(&b, tok, syn.open);
            pd_sbuf_puts(&b, " tc-call ");
            put_syntax_text(&b, tok, syn.close);
            pd_sbuf_puts(&b, " )*");
        }
    } else {
        if (many) {
            pd_sbuf_puts(&b, "( ");
            put_syntax_text(&b, tok, syn.sep);
            pd_sbuf_puts(&b, " tc-call )* ");
        }
        put_syntax_text(&b, tok, syn.close);
    }
    pd_sbuf_puts(&b, "\n");
    if (r->tool_choice == PD_API_TOOLS_REQUIRED || r->tool_choice == PD_API_TOOLS_NAMED) {
        pd_sbuf_puts(&b, "root ::= tc-calls\n");
    } else if (r->format != PD_API_FORMAT_TEXT) {
        pd_sbuf_puts(&b, "root ::= tc-calls | fmt\n");
    } else if (starts_with_control(tok, syn.open)) {
        pd_sbuf_puts(&b, "root ::= tc-calls | .*\n");
    } else {
        put_text_rules(&b, out->trigger);
        pd_sbuf_puts(&b, "root ::= tc-calls | tc-text0\n");
    }
done:
    if (b.oom) {
        rc = OOM(e);
        goto fail;
    }
    out->grammar = b.p;
    return PD_OK;
fail:
    free(b.p);
    memset(out, 0, sizeof *out);
    return rc;
}

void pd_api_constraint_free(pd_api_constraint *c) {
    if (!c) return;
    free(c->grammar);
    memset(c, 0, sizeof *c);
}

