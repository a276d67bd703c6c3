/* Constrained output end to end below HTTP: request bodies -> the grammar
 * (api/constrain.c) -> the matcher over a real vocabulary -> random walks
 * whose every answer must parse and validate, and tool calls read back for
 * every family's syntax. Random logits stand in for a model with random
 * weights: the grammar alone has to make the answer valid. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"
#include "helpers.h"

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* One answer: at each step random logits, masked, the best survivor taken
 * (a uniform pick among the allowed tokens), until an end-of-generation
 * token or the budget. Returns the text (malloc'd); *ended says whether an
 * EOG token ended it. */
static char *walk(const pd_grammar *gr, const pd_grammar_vocab *v, const pd_tokenizer *tok, int32_t max_tokens,
                  uint64_t seed, bool *ended) {
    pd_grammar_matcher *m = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_grammar_matcher_create(gr, v, &m, &err), PD_OK, "%s", err.msg);
    const int32_t n = pd_tokenizer_n_vocab(tok);
    float *logits = malloc(sizeof(float) * (size_t)n);
    size_t cap = 4096, len = 0;
    char *text = malloc(cap);
    *ended = false;
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int32_t i = 0; i < max_tokens; i++) {
        for (int32_t t = 0; t < n; t++) logits[t] = (float)(rng_next(&s) >> 40) / (float)(1 << 24);
        cr_assert_eq(pd_grammar_matcher_mask(m, logits, max_tokens - i, &err), PD_OK, "%s", err.msg);
        int32_t best = -1;
        for (int32_t t = 0; t < n; t++)
            if (isfinite(logits[t]) && (best < 0 || logits[t] > logits[best])) best = t;
        cr_assert_geq(best, 0);
        if (pd_tokenizer_is_eog(tok, best)) {
            cr_assert(pd_grammar_matcher_complete(m), "EOG allowed before the text is complete");
            *ended = true;
            break;
        }
        cr_assert_eq(pd_grammar_matcher_accept(m, best, &err), PD_OK, "%s", err.msg);
        char piece[256];
        int pl = pd_token_to_piece(tok, best, true, piece, sizeof piece);
        cr_assert(pl >= 0 && (size_t)pl < sizeof piece);
        if (len + (size_t)pl + 1 > cap) text = realloc(text, cap *= 2);
        memcpy(text + len, piece, (size_t)pl);
        len += (size_t)pl;
    }
    text[len] = '\0';
    free(logits);
    pd_grammar_matcher_free(m);
    return text;
}

static void parse_chat(const char *body, pd_api_request *r) {
    pd_api_error e;
    cr_assert_eq(pd_api_parse_request(PD_API_CHAT, body, strlen(body), NULL, r, &e), PD_OK, "%s", e.message);
}

static pd_grammar *compile_constraint(const pd_api_request *r, pd_chat_family f, const pd_tokenizer *tok,
                                      pd_api_constraint *con) {
    pd_api_error e;
    cr_assert_eq(pd_api_constraint_build(r, f, tok, con, &e), PD_OK, "%s", e.message);
    cr_assert_not_null(con->grammar);
    pd_grammar *g = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_grammar_compile(con->grammar, strlen(con->grammar), &g, &err), PD_OK, "%s\n%s", err.msg,
                 con->grammar);
    return g;
}

#define PERSON_SCHEMA                                                                                                  \
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":12},\"age\":{\"type\":"        \
    "\"integer\"},\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"red\",\"green\",\"blue\"]},\"maxItems\":3},"     \
    "\"ok\":{\"type\":\"boolean\"},\"note\":{\"anyOf\":[{\"type\":\"null\"},{\"const\":\"fine\"}]}},\"required\":"    \
    "[\"name\",\"age\",\"tags\",\"ok\"],\"additionalProperties\":false}"

Test(constrain, json_schema_answers_always_parse_and_validate) {
    pd_tokenizer *tok = th_shared_tokenizer("vocab/ggml-vocab-phi-3.gguf");
    pd_grammar_vocab *v = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_api_grammar_vocab(tok, &v, &err), PD_OK, "%s", err.msg);
    const char *bodies[] = {
        "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"response_format\":{\"type\":"
        "\"json_schema\",\"json_schema\":{\"name\":\"person\",\"strict\":true,\"schema\":" PERSON_SCHEMA "}}}",
        "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"response_format\":{\"type\":"
        "\"json_object\"}}",
    };
    json_t *schema = json_loads(PERSON_SCHEMA, 0, NULL);
    for (size_t b = 0; b < 2; b++) {
        pd_api_request r;
        parse_chat(bodies[b], &r);
        pd_api_constraint con;
        pd_grammar *g = compile_constraint(&r, PD_CHAT_PHI3, tok, &con);
        cr_expect_not(con.tool_calls);
        for (uint64_t seed = 1; seed <= 60; seed++) {
            bool ended = false;
            char *text = walk(g, v, tok, 96, seed, &ended);
            cr_assert(ended, "seed %llu: the budget of 96 tokens did not end the document: %s", (unsigned long long)seed,
                      text);
            json_error_t jerr;
            json_t *doc = json_loads(text, 0, &jerr);
            cr_assert_not_null(doc, "seed %llu: not JSON (%s): %s", (unsigned long long)seed, jerr.text, text);
            cr_assert(json_is_object(doc), "%s", text);
            if (b == 0) cr_assert_eq(pd_json_schema_validate(schema, doc, &err), PD_OK, "%s: %s", err.msg, text);
            json_decref(doc);
            free(text);
        }
        pd_grammar_free(g);
        pd_api_constraint_free(&con);
        pd_api_request_free(&r);
    }
    json_decref(schema);
    pd_grammar_vocab_free(v);
    pd_tokenizer_free(tok);
}

#define WEATHER_TOOLS                                                                                                  \
    "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\","   \
    "\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":16},\"unit\":{\"enum\":[\"c\",\"f\"]}},"             \
    "\"required\":[\"city\",\"unit\"],\"additionalProperties\":false}}},{\"type\":\"function\",\"function\":"        \
    "{\"name\":\"get_time\"}}]"

/* Every family's syntax: tool_choice required always gives calls that read
 * back with valid arguments; auto gives calls or text that does not start
 * like calls. */
Test(constrain, tool_calls_read_back_in_every_family_syntax) {
    pd_tokenizer *tok = th_shared_tokenizer("vocab/ggml-vocab-llama-spm.gguf");
    pd_grammar_vocab *v = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_api_grammar_vocab(tok, &v, &err), PD_OK, "%s", err.msg);
    json_t *weather = json_loads("{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":16},"
                                 "\"unit\":{\"enum\":[\"c\",\"f\"]}},\"required\":[\"city\",\"unit\"],"
                                 "\"additionalProperties\":false}",
                                 0, NULL);
    const char *choices[] = {"\"required\"", "\"auto\"", "{\"type\":\"function\",\"function\":{\"name\":\"get_time\"}}"};
    for (int f = PD_CHAT_CHATML; f < PD_CHAT_FAMILY_COUNT; f++) {
        for (size_t ci = 0; ci < 3; ci++) {
            char body[2048];
            snprintf(body, sizeof body,
                     "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]," WEATHER_TOOLS
                     ",\"tool_choice\":%s}",
                     choices[ci]);
            pd_api_request r;
            parse_chat(body, &r);
            pd_api_constraint con;
            pd_grammar *g = compile_constraint(&r, (pd_chat_family)f, tok, &con);
            cr_assert(con.tool_calls);
            int calls_seen = 0;
            for (uint64_t seed = 1; seed <= 25; seed++) {
                bool ended = false;
                char *text = walk(g, v, tok, 120, seed, &ended);
                cr_assert(ended, "%s %s seed %llu: not ended: %s", pd_chat_family_name((pd_chat_family)f), choices[ci],
                          (unsigned long long)seed, text);
                pd_api_tool_call *calls = NULL;
                size_t n = 0;
                int rc = pd_api_tool_calls_parse(&con.syntax, text, strlen(text), &calls, &n);
                cr_assert_eq(rc, PD_OK, "%s %s: calls do not read back: %s", pd_chat_family_name((pd_chat_family)f),
                             choices[ci], text);
                if (ci != 1) cr_assert_geq(n, 1, "%s: no calls in %s", choices[ci], text);
                if (ci == 1 && n == 0) cr_assert(strncmp(text, con.trigger, strlen(con.trigger)) != 0, "%s", text);
                if (!con.syntax.parallel || ci == 2) cr_assert_leq(n, 1, "%s", text);
                for (size_t i = 0; i < n; i++) {
                    json_t *args = json_loads(calls[i].arguments, 0, NULL);
                    cr_assert(json_is_object(args), "%s", calls[i].arguments);
                    if (strcmp(calls[i].name, "get_weather") == 0) {
                        cr_assert_neq(ci, 2, "tool_choice named get_time called %s", calls[i].name);
                        cr_assert_eq(pd_json_schema_validate(weather, args, &err), PD_OK, "%s: %s", err.msg,
                                     calls[i].arguments);
                    } else {
                        cr_assert_str_eq(calls[i].name, "get_time");
                        cr_assert_eq(json_object_size(args), 0, "%s", calls[i].arguments);
                    }
                    cr_assert(strncmp(calls[i].id, "call_", 5) == 0);
                    json_decref(args);
                }
                calls_seen += n > 0;
                pd_api_tool_calls_free(calls, n);
                free(text);
            }
            if (ci != 1) cr_assert_eq(calls_seen, 25);
            pd_grammar_free(g);
            pd_api_constraint_free(&con);
            pd_api_request_free(&r);
        }
    }
    json_decref(weather);
    pd_grammar_vocab_free(v);
    pd_tokenizer_free(tok);
}

Test(constrain, calls_parse_in_each_syntax_and_partial_calls_are_content) {
    for (int f = PD_CHAT_CHATML; f < PD_CHAT_FAMILY_COUNT; f++) {
        pd_chat_tool_syntax syn;
        pd_chat_tool_syntax_of((pd_chat_family)f, &syn);
        char text[1024];
        const char *call1 = "{\"name\": \"a\", \"%s\": {\"x\": 1}}", *call2 = "{\"name\":\"b\",\"%s\":{}}";
        char c1[128], c2[128];
        snprintf(c1, sizeof c1, call1, syn.args_key);
        snprintf(c2, sizeof c2, call2, syn.args_key);
        if (syn.json_list)
            snprintf(text, sizeof text, "%s%s%s%s%s", syn.open, c1, syn.sep, c2, syn.close);
        else if (syn.parallel)
            snprintf(text, sizeof text, "%s%s%s%s%s%s%s", syn.open, c1, syn.close, syn.sep, syn.open, c2, syn.close);
        else
            snprintf(text, sizeof text, "%s%s%s", syn.open, c1, syn.close);
        pd_api_tool_call *calls = NULL;
        size_t n = 0;
        cr_assert_eq(pd_api_tool_calls_parse(&syn, text, strlen(text), &calls, &n), PD_OK, "%s: %s",
                     pd_chat_family_name((pd_chat_family)f), text);
        cr_assert_eq(n, syn.parallel ? 2u : 1u, "%s", text);
        cr_assert_str_eq(calls[0].name, "a");
        cr_assert_str_eq(calls[0].arguments, "{\"x\":1}");
        if (n == 2) cr_assert_str_eq(calls[1].arguments, "{}");
        pd_api_tool_calls_free(calls, n);
        /* cut short: content, not calls */
        cr_assert_eq(pd_api_tool_calls_parse(&syn, text, strlen(text) - 3, &calls, &n), PD_EFORMAT, "%s", text);
        cr_assert_eq(n, 0);
        cr_assert_eq(pd_api_tool_calls_parse(&syn, "Hello there", 11, &calls, &n), PD_OK);
        cr_assert_eq(n, 0);
    }
}

static void expect_400(pd_api_kind kind, const char *body, const char *param, const char *needle) {
    pd_api_request r;
    pd_api_error e;
    int rc = pd_api_parse_request(kind, body, strlen(body), NULL, &r, &e);
    if (rc == PD_OK) {
        pd_tokenizer *tok = th_shared_tokenizer("vocab/ggml-vocab-phi-3.gguf");
        pd_api_constraint con;
        rc = pd_api_constraint_build(&r, PD_CHAT_PHI3, tok, &con, &e);
        pd_api_request_free(&r);
        pd_tokenizer_free(tok);
    }
    cr_assert_neq(rc, PD_OK, "%s was accepted", body);
    cr_assert_eq(e.http_status, 400, "%s", e.message);
    cr_assert_str_eq(e.param, param, "%s", e.message);
    cr_assert(strstr(e.message, needle), "'%s' does not mention %s", e.message, needle);
}

Test(constrain, bad_constraints_are_400s_that_name_the_field) {
#define CHAT(rest) "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]," rest "}"
    expect_400(PD_API_CHAT,
               CHAT("\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"n\",\"schema\":"
                    "{\"type\":\"object\",\"properties\":{\"age\":{\"type\":\"integer\",\"multipleOf\":3}}}}}"),
               "response_format.json_schema.schema", "multipleOf");
    expect_400(PD_API_CHAT,
               CHAT("\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":"
                    "\"object\",\"properties\":{\"s\":{\"type\":\"string\",\"format\":\"email\"}}}}}]"),
               "tools[0].function.parameters", "format");
    expect_400(PD_API_CHAT, CHAT("\"response_format\":{\"type\":\"yaml\"}"), "response_format.type", "json_schema");
    expect_400(PD_API_CHAT, CHAT("\"tool_choice\":\"auto\""), "tool_choice", "tools");
    expect_400(PD_API_CHAT,
               CHAT("\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],\"tool_choice\":\"always\""),
               "tool_choice", "\"required\"");
    expect_400(PD_API_CHAT,
               CHAT("\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],\"tool_choice\":{\"type\":"
                    "\"function\"}"),
               "tool_choice", "\"required\"");
    expect_400(PD_API_CHAT,
               CHAT("\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],\"tool_choice\":{\"type\":"
                    "\"function\",\"function\":{\"name\":\"g\"}}"),
               "tool_choice", "\"g\"");
    expect_400(PD_API_CHAT, CHAT("\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"bad name\"}}]"),
               "tools[0].function.name", "function name");
    expect_400(PD_API_COMPLETION,
               "{\"model\":\"m\",\"prompt\":\"x\",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]}",
               "tools", "chat");
    expect_400(PD_API_CHAT,
               "{\"model\":\"m\",\"messages\":[{\"role\":\"tool\",\"content\":\"42\"}]}", "messages[0].tool_call_id",
               "required");
    expect_400(PD_API_CHAT,
               "{\"model\":\"m\",\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c\","
               "\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"[1]\"}}]}]}",
               "messages[0].tool_calls[0]", "arguments");
    expect_400(PD_API_CHAT,
               CHAT("\"grammar\":\"root ::= \\\"a\\\"\",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":"
                    "\"f\"}}]"),
               "grammar", "tools");
    expect_400(PD_API_CHAT, CHAT("\"grammar\":\"\""), "grammar", "GBNF");
#undef CHAT
}

/* The parsed messages carry tool calls and results to the template. */
Test(constrain, tool_turns_parse_into_messages) {
    pd_api_request r;
    parse_chat("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"w?\"},{\"role\":\"assistant\","
               "\"content\":null,\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":"
               "\"get_weather\",\"arguments\":\"{\\\"city\\\": \\\"Paris\\\"}\"}}]},{\"role\":\"tool\","
               "\"tool_call_id\":\"call_1\",\"content\":\"21C\"}]," WEATHER_TOOLS "}",
               &r);
    cr_assert_eq(r.n_messages, 3);
    cr_assert_eq(r.messages[1].n_tool_calls, 1);
    cr_assert_str_eq(r.messages[1].tool_calls[0].name, "get_weather");
    cr_assert_str_eq(r.messages[1].tool_calls[0].arguments, "{\"city\":\"Paris\"}");
    cr_assert_str_eq(r.messages[1].tool_calls[0].id, "call_1");
    cr_assert_str_eq(r.messages[1].content, "");
    cr_assert_str_eq(r.messages[2].role, "tool");
    cr_assert_str_eq(r.messages[2].tool_call_id, "call_1");
    cr_assert_eq(r.n_tools, 2);
    cr_assert_eq(r.tool_choice, PD_API_TOOLS_AUTO);
    cr_assert(r.parallel_tool_calls);
    cr_assert_null(r.tools[1].parameters);
    pd_api_request_free(&r);
}

/* A schema whose grammar would be huge (a request can ask for one) is
 * refused with a message that says what to shrink, instead of being built. */
Test(constrain, a_schema_too_large_to_build_is_refused) {
    pd_tokenizer *tok = th_shared_tokenizer("vocab/ggml-vocab-phi-3.gguf");
    pd_api_request r;
    parse_chat("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"response_format\":{\"type\":"
               "\"json_schema\",\"json_schema\":{\"name\":\"big\",\"schema\":{\"type\":\"array\",\"items\":{\"type\":"
               "\"string\",\"maxLength\":10000},\"maxItems\":10000}}}}",
               &r);
    pd_api_constraint con;
    pd_api_error e;
    cr_assert_eq(pd_api_constraint_build(&r, PD_CHAT_PHI3, tok, &con, &e), PD_OK, "%s", e.message);
    pd_grammar *g = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_grammar_compile(con.grammar, strlen(con.grammar), &g, &err), PD_EINVAL);
    cr_assert_null(g);
    cr_assert(strstr(err.msg, "automaton states") && strstr(err.msg, "repetition"), "%s", err.msg);
    pd_api_constraint_free(&con);
    pd_api_request_free(&r);
    pd_tokenizer_free(tok);
}

/* Warmed ahead, a grammar serves every mask from its cache: random walks
 * after pd_grammar_warm compute nothing more. */
Test(constrain, a_warmed_grammar_masks_from_its_cache) {
    pd_tokenizer *tok = th_shared_tokenizer("vocab/ggml-vocab-phi-3.gguf");
    pd_grammar_vocab *v = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_api_grammar_vocab(tok, &v, &err), PD_OK, "%s", err.msg);
    pd_api_request r;
    parse_chat("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]," WEATHER_TOOLS
               ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"p\",\"schema\":"
               PERSON_SCHEMA "}}}",
               &r);
    pd_api_constraint con;
    pd_grammar *g = compile_constraint(&r, PD_CHAT_CHATML, tok, &con);
    atomic_bool stop = true;
    cr_assert_eq(pd_grammar_warm(g, v, &stop, &err), PD_OK);
    pd_grammar_stats st;
    pd_grammar_stats_get(g, &st);
    cr_assert_eq(st.states_cached, 0, "a stop request is honoured before any work");
    cr_assert_eq(pd_grammar_warm(g, v, NULL, &err), PD_OK, "%s", err.msg);
    pd_grammar_stats_get(g, &st);
    const int64_t warmed = st.states_cached;
    cr_assert_gt(warmed, 10);
    for (uint64_t seed = 1; seed <= 20; seed++) {
        bool ended = false;
        free(walk(g, v, tok, 120, seed, &ended));
        cr_assert(ended);
    }
    pd_grammar_stats_get(g, &st);
    cr_assert_eq(st.states_cached, warmed, "walks computed %lld more states", (long long)(st.states_cached - warmed));
    pd_grammar_free(g);
    pd_api_constraint_free(&con);
    pd_api_request_free(&r);
    pd_grammar_vocab_free(v);
    pd_tokenizer_free(tok);
}
