/* api/: OpenAI request parsing and validation (every field, every error
 * class), prompt tokenization, scheduler parameters, and the response
 * builders (JSON and SSE) parsed back with jansson. Streaming is checked
 * against the non-streamed body on a real model's generation. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"
#include "helpers.h"

TestSuite(api);

static pd_api_request parse_ok(pd_api_kind kind, const char *body) {
    pd_api_request r;
    pd_api_error e = {0};
    int rc = pd_api_parse_request(kind, body, strlen(body), NULL, &r, &e);
    cr_assert_eq(rc, PD_OK, "%s -> %d %s (%s)", body, e.http_status, e.message, e.param);
    return r;
}

static pd_api_error parse_err(pd_api_kind kind, const char *body) {
    pd_api_request r;
    pd_api_error e = {0};
    int rc = pd_api_parse_request(kind, body, strlen(body), NULL, &r, &e);
    cr_assert_neq(rc, PD_OK, "%s should fail", body);
    cr_assert_null(r.model);
    pd_api_request_free(&r);
    return e;
}

static json_t *load(const char *s, size_t len) {
    json_error_t je;
    json_t *j = json_loadb(s, len, 0, &je);
    cr_assert_not_null(j, "invalid JSON (%s): %.*s", je.text, (int)len, s);
    return j;
}

static const char *jstr(json_t *o, const char *path) {
    json_t *v = json_object_get(o, path);
    cr_assert(json_is_string(v), "%s is not a string", path);
    return json_string_value(v);
}

/* ------------------------------------------------------------------ parsing */

Test(api, completion_every_field) {
    const char *body = "{\"model\":\"m1\",\"prompt\":\"Once upon\",\"max_tokens\":32,\"temperature\":0.5,"
                       "\"top_p\":0.9,\"n\":3,\"stop\":[\"\\n\",\"END\"],\"seed\":-7,\"presence_penalty\":1.5,"
                       "\"frequency_penalty\":-0.5,\"logit_bias\":{\"13\":-100,\"42\":2.5},\"logprobs\":3,"
                       "\"echo\":false,\"stream\":true,\"stream_options\":{\"include_usage\":true},\"user\":\"u\","
                       "\"suffix\":null,\"top_k\":40,\"min_p\":0.05,\"repetition_penalty\":1.1,"
                       "\"prefix_id\":\"00112233445566778899AABBCCDDEEFF00112233445566778899aabbccddeeff\","
                       "\"cache\":\"auto\",\"some_unknown_field\":{\"x\":[1,2]},\"best_of\":3}";
    pd_api_request r = parse_ok(PD_API_COMPLETION, body);
    cr_expect_eq(r.kind, PD_API_COMPLETION);
    cr_expect_str_eq(r.model, "m1");
    cr_expect(!r.prompt_is_tokens);
    cr_expect_str_eq(r.prompt_text, "Once upon");
    cr_expect_eq(r.prompt_len, 9);
    cr_expect_eq(r.max_tokens, 32);
    cr_expect_float_eq(r.sampling.temperature, 0.5f, 1e-6);
    cr_expect_float_eq(r.sampling.top_p, 0.9f, 1e-6);
    cr_expect_eq(r.n, 3);
    cr_expect_eq(r.n_stop, 2);
    cr_expect_str_eq(r.stop[0], "\n");
    cr_expect_str_eq(r.stop[1], "END");
    cr_expect(r.has_seed);
    cr_expect_eq(r.sampling.seed, (uint64_t)(int64_t)-7);
    cr_expect_float_eq(r.sampling.presence_penalty, 1.5f, 1e-6);
    cr_expect_float_eq(r.sampling.frequency_penalty, -0.5f, 1e-6);
    cr_expect_eq(r.n_logit_bias, 2);
    cr_expect_eq(r.sampling.logit_bias, r.logit_bias);
    float b13 = 0, b42 = 0;
    for (size_t i = 0; i < r.n_logit_bias; i++) {
        if (r.logit_bias[i].token == 13) b13 = r.logit_bias[i].bias;
        if (r.logit_bias[i].token == 42) b42 = r.logit_bias[i].bias;
    }
    cr_expect_float_eq(b13, -100.0f, 1e-6);
    cr_expect_float_eq(b42, 2.5f, 1e-6);
    cr_expect(r.sampling.logprobs);
    cr_expect_eq(r.sampling.n_logprobs, 3);
    cr_expect(r.stream);
    cr_expect(r.include_usage);
    cr_expect_str_eq(r.user, "u");
    cr_expect_eq(r.sampling.top_k, 40);
    cr_expect_float_eq(r.sampling.min_p, 0.05f, 1e-6);
    cr_expect_float_eq(r.sampling.repetition_penalty, 1.1f, 1e-6);
    cr_expect(r.has_prefix_id);
    cr_expect_eq(r.prefix_id.b[0], 0x00);
    cr_expect_eq(r.prefix_id.b[10], 0xAA);
    cr_expect_eq(r.prefix_id.b[31], 0xff);
    cr_expect_eq(r.cache, PD_CACHE_AUTO);
    cr_expect_eq(r.ns[0], '\0');
    pd_api_request_free(&r);
}

Test(api, completion_defaults) {
    pd_api_request r = parse_ok(PD_API_COMPLETION, "{\"model\":\"m\",\"prompt\":\"\"}");
    pd_sampler_params d = pd_sampler_params_default();
    cr_expect_eq(r.n, 1);
    cr_expect_eq(r.max_tokens, 0);
    cr_expect_eq(r.n_stop, 0);
    cr_expect(!r.has_seed);
    cr_expect_eq(r.sampling.seed, PD_SAMPLER_SEED_RANDOM);
    cr_expect_float_eq(r.sampling.temperature, d.temperature, 0);
    cr_expect_float_eq(r.sampling.top_p, 1.0f, 0);
    cr_expect(!r.sampling.logprobs);
    cr_expect(!r.stream);
    cr_expect_eq(r.cache, PD_CACHE_AUTO);
    cr_expect(!r.has_prefix_id);
    cr_expect_str_eq(r.prompt_text, "");
    pd_api_request_free(&r);
    /* null counts as absent */
    r = parse_ok(PD_API_COMPLETION, "{\"model\":\"m\",\"prompt\":\"x\",\"max_tokens\":null,\"stop\":null,"
                                    "\"logprobs\":null,\"temperature\":null,\"cache\":\"off\"}");
    cr_expect_eq(r.max_tokens, 0);
    cr_expect(!r.sampling.logprobs);
    cr_expect_eq(r.cache, PD_CACHE_OFF);
    pd_api_request_free(&r);
}

Test(api, prompt_forms) {
    pd_api_request r = parse_ok(PD_API_COMPLETION, "{\"model\":\"m\",\"prompt\":[\"only one\"]}");
    cr_expect_str_eq(r.prompt_text, "only one");
    pd_api_request_free(&r);
    r = parse_ok(PD_API_COMPLETION, "{\"model\":\"m\",\"prompt\":[1,403,407]}");
    cr_expect(r.prompt_is_tokens);
    cr_assert_eq(r.n_prompt_tokens, 3);
    cr_expect_eq(r.prompt_tokens[0], 1);
    cr_expect_eq(r.prompt_tokens[2], 407);
    pd_api_request_free(&r);
    r = parse_ok(PD_API_COMPLETION, "{\"model\":\"m\",\"prompt\":[[1,2]]}");
    cr_expect(r.prompt_is_tokens);
    cr_expect_eq(r.n_prompt_tokens, 2);
    pd_api_request_free(&r);
    r = parse_ok(PD_API_COMPLETION, "{\"model\":\"m\",\"prompt\":\"caf\\u00e9 \\ud83d\\ude00\"}");
    cr_expect_str_eq(r.prompt_text, "caf\xc3\xa9 \xf0\x9f\x98\x80");
    pd_api_request_free(&r);
}

Test(api, chat_every_field) {
    const char *body =
        "{\"model\":\"c\",\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Hello\"},{\"type\":\"text\",\"text\":\"there\"}]},"
        "{\"role\":\"assistant\",\"content\":null,\"name\":\"bot\"},{\"role\":\"user\",\"content\":\"Go\"}],"
        "\"max_tokens\":5,\"max_completion_tokens\":7,\"logprobs\":true,\"top_logprobs\":4,\"stream\":false,"
        "\"tools\":[],\"response_format\":{\"type\":\"text\"}}";
    pd_api_request r = parse_ok(PD_API_CHAT, body);
    cr_assert_eq(r.n_messages, 4);
    cr_expect_str_eq(r.messages[0].role, "system");
    cr_expect_str_eq(r.messages[0].content, "Be brief.");
    cr_expect_str_eq(r.messages[1].role, "user");
    cr_expect_str_eq(r.messages[1].content, "Hello\nthere");
    cr_expect_str_eq(r.messages[2].role, "assistant");
    cr_expect_str_eq(r.messages[2].content, "");
    cr_expect_str_eq(r.messages[3].content, "Go");
    cr_expect_eq(r.max_tokens, 7, "max_completion_tokens wins");
    cr_expect(r.sampling.logprobs);
    cr_expect_eq(r.sampling.n_logprobs, 4);
    pd_api_request_free(&r);
    r = parse_ok(PD_API_CHAT, "{\"model\":\"c\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":5,"
                              "\"logprobs\":false}");
    cr_expect_eq(r.max_tokens, 5);
    cr_expect(!r.sampling.logprobs);
    pd_api_request_free(&r);
}

typedef struct err_case {
    pd_api_kind kind;
    const char *body;
    int status;
    const char *type;
    const char *param; /* "" = null */
    const char *in_message;
} err_case;

#define C PD_API_COMPLETION
#define H PD_API_CHAT
#define INV PD_API_ERR_INVALID
static const err_case err_cases[] = {
    {C, "", 400, INV, "", "empty"},
    {C, "not json", 400, INV, "", "not valid JSON"},
    {C, "[1,2]", 400, INV, "", "must be a JSON object"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"model\":\"n\"}", 400, INV, "", "duplicate"},
    {C, "{\"prompt\":\"a\"}", 400, INV, "model", "required"},
    {C, "{\"model\":5,\"prompt\":\"a\"}", 400, INV, "model", "must be a string"},
    {C, "{\"model\":\"m\"}", 400, INV, "prompt", "required"},
    {C, "{\"model\":\"m\",\"prompt\":5}", 400, INV, "prompt", "not an integer"},
    {C, "{\"model\":\"m\",\"prompt\":[]}", 400, INV, "prompt", "empty"},
    {C, "{\"model\":\"m\",\"prompt\":[\"a\",\"b\"]}", 400, INV, "prompt", "one prompt per request"},
    {C, "{\"model\":\"m\",\"prompt\":[[1],[2]]}", 400, INV, "prompt", "one prompt per request"},
    {C, "{\"model\":\"m\",\"prompt\":[1,\"a\"]}", 400, INV, "prompt", "token id"},
    {C, "{\"model\":\"m\",\"prompt\":[1,-2]}", 400, INV, "prompt", "token id"},
    {C, "{\"model\":\"m\",\"prompt\":[[]]}", 400, INV, "prompt", "empty"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"max_tokens\":0}", 400, INV, "max_tokens", "out of range"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"max_tokens\":5000}", 400, INV, "max_tokens", "out of range"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"max_tokens\":1.5}", 400, INV, "max_tokens", "must be an integer"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"max_tokens\":\"8\"}", 400, INV, "max_tokens", "not a string"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"temperature\":2.5}", 400, INV, "temperature", "out of range"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"temperature\":-0.1}", 400, INV, "temperature", "out of range"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"temperature\":\"hot\"}", 400, INV, "temperature", "must be a number"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"top_p\":0}", 400, INV, "top_p", "out of range"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"top_p\":1.01}", 400, INV, "top_p", "out of range"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"n\":0}", 400, INV, "n", "out of range"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"n\":9}", 400, INV, "n", "out of range"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}", 400, INV, "stop", "at most 4"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"stop\":\"\"}", 400, INV, "stop", "must not be empty"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"stop\":[1]}", 400, INV, "stop", "must be a string"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"stop\":{}}", 400, INV, "stop", "string or an array"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"seed\":1.5}", 400, INV, "seed", "integer"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"presence_penalty\":3}", 400, INV, "presence_penalty", "out of range"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"frequency_penalty\":-2.01}", 400, INV, "frequency_penalty", "range"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"logit_bias\":[1]}", 400, INV, "logit_bias", "must be an object"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"logit_bias\":{\"x\":1}}", 400, INV, "logit_bias", "not a token id"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"logit_bias\":{\"-1\":1}}", 400, INV, "logit_bias", "not a token id"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"logit_bias\":{\"5\":101}}", 400, INV, "logit_bias", "[-100, 100]"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"logit_bias\":{\"5\":\"1\"}}", 400, INV, "logit_bias", "number"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"logprobs\":6}", 400, INV, "logprobs", "[0, 5]"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"logprobs\":true}", 400, INV, "logprobs", "integer 0..5"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"echo\":true}", 400, INV, "echo", "not supported"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"echo\":1}", 400, INV, "echo", "boolean"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"suffix\":\"end\"}", 400, INV, "suffix", "not supported"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"best_of\":2}", 400, INV, "best_of", "not supported"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"stream\":\"yes\"}", 400, INV, "stream", "boolean"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"stream_options\":true}", 400, INV, "stream_options", "object"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"stream_options\":{\"include_usage\":1}}", 400, INV,
     "stream_options.include_usage", "boolean"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"user\":7}", 400, INV, "user", "string"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"top_k\":-1}", 400, INV, "top_k", "out of range"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"min_p\":1.5}", 400, INV, "min_p", "out of range"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"repetition_penalty\":0}", 400, INV, "repetition_penalty", "range"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"prefix_id\":\"abc\"}", 400, INV, "prefix_id", "64 hex"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"prefix_id\":12}", 400, INV, "prefix_id", "must be a string"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"prefix_id\":\"zz112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\"}",
     400, INV, "prefix_id", "not hexadecimal"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"cache\":\"sometimes\"}", 400, INV, "cache", "\"auto\" or \"off\""},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"cache\":\"off\",\"prefix_id\":"
        "\"00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\"}", 400, INV, "prefix_id", "off"},
    {H, "{\"model\":\"c\"}", 400, INV, "messages", "required"},
    {H, "{\"model\":\"c\",\"messages\":{}}", 400, INV, "messages", "must be an array"},
    {H, "{\"model\":\"c\",\"messages\":[]}", 400, INV, "messages", "empty"},
    {H, "{\"model\":\"c\",\"messages\":[\"hi\"]}", 400, INV, "messages[0]", "object"},
    {H, "{\"model\":\"c\",\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"function\",\"content\":\"x\"}]}", 400,
     INV, "messages[1].role", "\"system\", \"user\", \"assistant\" or \"tool\""},
    {H, "{\"model\":\"c\",\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"tool\",\"content\":\"x\"}]}", 400,
     INV, "messages[1].tool_call_id", "required"},
    {H, "{\"model\":\"c\",\"messages\":[{\"content\":\"a\"}]}", 400, INV, "messages[0].role", "must be a string"},
    {H, "{\"model\":\"c\",\"messages\":[{\"role\":\"user\",\"content\":5}]}", 400, INV, "messages[0].content", "string"},
    {H, "{\"model\":\"c\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]}", 400, INV,
     "messages[0].content[0].type", "text"},
    {H, "{\"model\":\"c\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\"}]}]}", 400, INV,
     "messages[0].content[0].text", "string"},
    {H, "{\"model\":\"c\",\"messages\":[{\"role\":\"user\",\"content\":[3]}]}", 400, INV, "messages[0].content[0]",
     "object"},
    {H, "{\"model\":\"c\",\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"logprobs\":3}", 400, INV, "logprobs",
     "boolean"},
    {H, "{\"model\":\"c\",\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"top_logprobs\":2}", 400, INV,
     "top_logprobs", "logprobs"},
    {H, "{\"model\":\"c\",\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"logprobs\":true,\"top_logprobs\":21}",
     400, INV, "top_logprobs", "out of range"},
    {H, "{\"model\":\"c\",\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"max_completion_tokens\":0}", 400, INV,
     "max_completion_tokens", "out of range"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\\u0000b\"}", 400, INV, "", "not valid JSON"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"cache_salt\":7}", 400, INV, "cache_salt", "must be a string"},
    {C, "{\"model\":\"m\",\"prompt\":\"a\",\"cache_salt\":\"\"}", 400, INV, "cache_salt", "1..64 bytes"},
};
#undef C
#undef H
#undef INV

Test(api, cache_salt_and_the_key_namespace_make_the_lookup_namespace) {
    pd_api_request r = parse_ok(PD_API_COMPLETION, "{\"model\":\"m\",\"prompt\":\"a\",\"cache_salt\":\"s1\"}");
    pd_api_error e;
    cr_assert_eq(pd_api_request_namespace(&r, "tenant", &e), PD_OK);
    cr_assert(memcmp(r.ns, "tenant\x1fs1", 10) == 0 && r.ns[9] == '\0', "%s", r.ns);
    pd_api_request_free(&r);
    r = parse_ok(PD_API_COMPLETION, "{\"model\":\"m\",\"prompt\":\"a\"}");
    cr_assert_eq(pd_api_request_namespace(&r, "tenant", &e), PD_OK);
    cr_assert_str_eq(r.ns, "tenant", "no salt: the key's namespace as it is");
    pd_api_request_free(&r);
    char big[PD_PREFIX_NS_MAX];
    memset(big, 'n', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    r = parse_ok(PD_API_COMPLETION, "{\"model\":\"m\",\"prompt\":\"a\",\"cache_salt\":\"s\"}");
    cr_assert_eq(pd_api_request_namespace(&r, big + 1, &e), PD_EINVAL, "namespace + salt must fit");
    cr_assert_str_eq(e.param, "cache_salt");
    pd_api_request_free(&r);
}

Test(api, error_classes) {
    for (size_t i = 0; i < sizeof err_cases / sizeof err_cases[0]; i++) {
        const err_case *c = &err_cases[i];
        pd_api_error e = parse_err(c->kind, c->body);
        cr_expect_eq(e.http_status, c->status, "%s: status %d", c->body, e.http_status);
        cr_expect_str_eq(e.type, c->type, "%s", c->body);
        cr_expect_str_eq(e.param, c->param, "%s: param '%s'", c->body, e.param);
        cr_expect(strstr(e.message, c->in_message) != NULL, "%s: message '%s' lacks '%s'", c->body, e.message,
                  c->in_message);
    }
}

Test(api, error_json_shape) {
    pd_api_error e;
    cr_assert_eq(pd_api_errorf(&e, 400, PD_API_ERR_INVALID, "messages[1].role", NULL, "role '%s' is bad", "tool"),
                 PD_EINVAL);
    char *s = NULL;
    size_t len = 0;
    cr_assert_eq(pd_api_error_json(&e, &s, &len), PD_OK);
    json_t *j = load(s, len);
    cr_expect_eq(json_object_size(j), 1);
    json_t *in = json_object_get(j, "error");
    cr_assert(json_is_object(in));
    cr_expect_eq(json_object_size(in), 4);
    cr_expect_str_eq(jstr(in, "message"), "role 'tool' is bad");
    cr_expect_str_eq(jstr(in, "type"), "invalid_request_error");
    cr_expect_str_eq(jstr(in, "param"), "messages[1].role");
    cr_expect(json_is_null(json_object_get(in, "code")));
    json_decref(j);
    free(s);

    /* 5xx, null param, a code; invalid UTF-8 in the message survives as JSON */
    cr_assert_eq(pd_api_errorf(&e, 500, PD_API_ERR_SERVER, NULL, "boom", "bad \xff byte"), PD_EIO);
    cr_assert_eq(pd_api_error_json(&e, &s, &len), PD_OK);
    j = load(s, len);
    in = json_object_get(j, "error");
    cr_expect(json_is_null(json_object_get(in, "param")));
    cr_expect_str_eq(jstr(in, "code"), "boom");
    cr_expect_str_eq(jstr(in, "type"), "server_error");
    json_decref(j);
    free(s);

    /* mapping lower-layer errors */
    struct {
        int code;
        int status;
        const char *type;
    } map[] = {{PD_EINVAL, 400, "invalid_request_error"}, {PD_ERANGE, 400, "invalid_request_error"},
               {PD_EUNSUPPORTED, 400, "invalid_request_error"}, {PD_ENOTFOUND, 404, "not_found_error"},
               {PD_ENOMEM, 503, "overloaded_error"}, {PD_EIO, 500, "server_error"}};
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
        pd_error pe = {0};
        pd_errorf(&pe, map[i].code, "lower layer says %zu", i);
        pd_api_error_from(&e, &pe, "prompt");
        cr_expect_eq(e.http_status, map[i].status);
        cr_expect_str_eq(e.type, map[i].type);
        cr_expect(strstr(e.message, "lower layer says"));
    }
    /* the other classes the server builds */
    const char *types[] = {PD_API_ERR_AUTH, PD_API_ERR_TOO_LARGE, PD_API_ERR_RATE_LIMIT};
    int statuses[] = {401, 413, 429};
    for (int i = 0; i < 3; i++) {
        pd_api_errorf(&e, statuses[i], types[i], NULL, NULL, "x");
        cr_assert_eq(pd_api_error_json(&e, &s, &len), PD_OK);
        j = load(s, len);
        cr_expect_str_eq(jstr(json_object_get(j, "error"), "type"), types[i]);
        json_decref(j);
        free(s);
    }
}

Test(api, big_and_deep_bodies) {
    /* over the limit: 413 before parsing */
    size_t n = (1u << 20) + 64;
    char *big = malloc(n + 1);
    cr_assert_not_null(big);
    int h = snprintf(big, n, "{\"model\":\"m\",\"prompt\":\"");
    memset(big + h, 'a', n - (size_t)h - 2);
    memcpy(big + n - 2, "\"}", 2);
    big[n] = '\0';
    pd_api_request r;
    pd_api_error e = {0};
    cr_expect_neq(pd_api_parse_request(PD_API_COMPLETION, big, n, NULL, &r, &e), PD_OK);
    cr_expect_eq(e.http_status, 413);
    cr_expect_str_eq(e.type, PD_API_ERR_TOO_LARGE);
    /* with a larger limit, a 1 MB prompt parses */
    pd_api_limits lim;
    pd_api_limits_default(&lim);
    lim.max_body_bytes = 2u << 20;
    cr_assert_eq(pd_api_parse_request(PD_API_COMPLETION, big, n, &lim, &r, &e), PD_OK, "%s", e.message);
    cr_expect_eq(r.prompt_len, n - (size_t)h - 2);
    pd_api_request_free(&r);
    free(big);

    /* deep nesting (inside an ignored field) is refused without recursing */
    size_t depth = 200000;
    char *deep = malloc(2 * depth + 64);
    cr_assert_not_null(deep);
    size_t o = (size_t)sprintf(deep, "{\"model\":\"m\",\"prompt\":\"a\",\"x\":");
    for (size_t i = 0; i < depth; i++) deep[o++] = '[';
    for (size_t i = 0; i < depth; i++) deep[o++] = ']';
    deep[o++] = '}';
    cr_expect_neq(pd_api_parse_request(PD_API_COMPLETION, deep, o, NULL, &r, &e), PD_OK);
    cr_expect_eq(e.http_status, 400);
    cr_expect(strstr(e.message, "deeper than 16"), "%s", e.message);
    free(deep);

    /* brackets inside strings do not count as nesting */
    const char *s = "{\"model\":\"m\",\"prompt\":\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\\\"[[[[[[\"}";
    r = parse_ok(PD_API_COMPLETION, s);
    cr_expect_str_eq(r.prompt_text, "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\"[[[[[[");
    pd_api_request_free(&r);
}

/* xorshift, so the fuzz loop is the same on every run */
static uint64_t next_rand(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

Test(api, fuzz_mutations_never_crash) {
    const char *seed_bodies[] = {
        "{\"model\":\"m\",\"prompt\":[\"Once\"],\"max_tokens\":8,\"temperature\":0.7,\"stop\":[\"x\",\"y\"],"
        "\"logit_bias\":{\"3\":1.5},\"logprobs\":2,\"stream\":true,\"stream_options\":{\"include_usage\":true},"
        "\"prefix_id\":\"00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff\",\"cache\":\"auto\"}",
        "{\"model\":\"c\",\"messages\":[{\"role\":\"system\",\"content\":\"S\"},{\"role\":\"user\",\"content\":"
        "[{\"type\":\"text\",\"text\":\"hi\"}]}],\"max_completion_tokens\":9,\"logprobs\":true,\"top_logprobs\":3,"
        "\"n\":2,\"seed\":42,\"top_k\":5,\"min_p\":0.1,\"repetition_penalty\":1.2}",
    };
    const char alphabet[] = "{}[]\",:0123456789-.eE\\u tfnrl\xff\xc3\xa9";
    uint64_t st = 0x9e3779b97f4a7c15ull;
    size_t ok = 0, failed = 0;
    for (int it = 0; it < 20000; it++) {
        const char *src = seed_bodies[it & 1];
        size_t len = strlen(src);
        char buf[1024];
        memcpy(buf, src, len);
        int muts = 1 + (int)(next_rand(&st) % 4);
        for (int m = 0; m < muts; m++) {
            size_t pos = (size_t)(next_rand(&st) % len);
            switch (next_rand(&st) % 3) {
            case 0: buf[pos] = alphabet[next_rand(&st) % (sizeof alphabet - 1)]; break;
            case 1: buf[pos] = (char)(next_rand(&st) & 0xff); break;
            default: /* truncate */
                len = pos;
                break;
            }
            if (len == 0) break;
        }
        pd_api_kind kind = (it & 2) ? PD_API_CHAT : PD_API_COMPLETION;
        pd_api_request r;
        pd_api_error e = {0};
        int rc = pd_api_parse_request(kind, buf, len, NULL, &r, &e);
        if (rc == PD_OK) {
            ok++;
            cr_assert_not_null(r.model);
        } else {
            failed++;
            cr_assert(e.http_status == 400 || e.http_status == 413, "status %d", e.http_status);
            cr_assert(e.message[0] != '\0');
            char *js = NULL;
            size_t jl = 0;
            cr_assert_eq(pd_api_error_json(&e, &js, &jl), PD_OK);
            json_t *j = load(js, jl);
            json_decref(j);
            free(js);
        }
        pd_api_request_free(&r);
    }
    cr_expect_gt(failed, 0);
    cr_log_info("fuzz: %zu parsed, %zu refused", ok, failed);
}

/* ------------------------------------------------------------------ scheduler parameters */

Test(api, sched_params) {
    pd_api_limits lim;
    pd_api_limits_default(&lim);
    pd_token prompt[10] = {1, 5, 6, 7, 8, 9, 10, 11, 12, 13};
    pd_sched_params p;
    pd_api_error e = {0};

    pd_api_request r = parse_ok(PD_API_COMPLETION, "{\"model\":\"m\",\"prompt\":\"a\",\"n\":2,\"stop\":\"zz\","
                                                   "\"logit_bias\":{\"7\":-100},\"seed\":9,\"temperature\":0,"
                                                   "\"cache\":\"off\"}");
    snprintf(r.ns, sizeof r.ns, "tenant-a");
    cr_assert_eq(pd_api_sched_params(&r, prompt, 10, 512, 512, &lim, &p, &e), PD_OK, "%s", e.message);
    cr_expect_eq(p.prompt, prompt);
    cr_expect_eq(p.n_prompt, 10);
    cr_expect_eq(p.n_choices, 2);
    cr_expect_eq(p.gen.max_tokens, PD_API_COMPLETION_MAX_TOKENS);
    cr_expect_eq(p.gen.n_stop, 1);
    cr_expect_str_eq(p.gen.stop[0], "zz");
    cr_expect_eq(p.sampling.n_logit_bias, 1);
    cr_expect_eq(p.sampling.logit_bias[0].token, 7);
    cr_expect_eq(p.sampling.seed, 9);
    cr_expect_float_eq(p.sampling.temperature, 0.0f, 0);
    cr_expect_eq(p.cache, PD_CACHE_OFF);
    cr_expect_str_eq(p.ns, "tenant-a");
    cr_expect(!p.has_prefix_id);
    /* completions default shrinks to the room left */
    cr_assert_eq(pd_api_sched_params(&r, prompt, 10, 20, 512, &lim, &p, &e), PD_OK);
    cr_expect_eq(p.gen.max_tokens, 10);
    /* no room at all */
    cr_expect_neq(pd_api_sched_params(&r, prompt, 10, 10, 512, &lim, &p, &e), PD_OK);
    cr_expect_str_eq(e.code, "context_length_exceeded");
    cr_expect_str_eq(e.param, "prompt");
    /* logit_bias and prompt ids checked against the vocabulary */
    cr_expect_neq(pd_api_sched_params(&r, prompt, 10, 512, 7, &lim, &p, &e), PD_OK);
    cr_expect_str_eq(e.param, "prompt");
    cr_expect(strstr(e.message, "vocabulary"), "%s", e.message);
    pd_token small[2] = {1, 2};
    cr_expect_neq(pd_api_sched_params(&r, small, 2, 512, 7, &lim, &p, &e), PD_OK);
    cr_expect_str_eq(e.param, "logit_bias");
    cr_expect_neq(pd_api_sched_params(&r, small, 0, 512, 512, &lim, &p, &e), PD_OK);
    pd_api_request_free(&r);

    /* explicit max_tokens must fit */
    r = parse_ok(PD_API_COMPLETION, "{\"model\":\"m\",\"prompt\":\"a\",\"max_tokens\":100}");
    cr_assert_eq(pd_api_sched_params(&r, prompt, 10, 110, 512, &lim, &p, &e), PD_OK);
    cr_expect_eq(p.gen.max_tokens, 100);
    cr_expect_neq(pd_api_sched_params(&r, prompt, 10, 109, 512, &lim, &p, &e), PD_OK);
    cr_expect_eq(e.http_status, 400);
    cr_expect_str_eq(e.param, "max_tokens");
    cr_expect_str_eq(e.code, "context_length_exceeded");
    cr_expect(strstr(e.message, "at most 99"), "%s", e.message);
    pd_api_request_free(&r);

    /* chat: the context remainder, capped, or the configured default */
    r = parse_ok(PD_API_CHAT, "{\"model\":\"c\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}");
    cr_assert_eq(pd_api_sched_params(&r, prompt, 10, 512, 512, &lim, &p, &e), PD_OK);
    cr_expect_eq(p.gen.max_tokens, 502);
    cr_assert_eq(pd_api_sched_params(&r, prompt, 10, 100000, 512, &lim, &p, &e), PD_OK);
    cr_expect_eq(p.gen.max_tokens, lim.max_tokens_limit);
    lim.default_max_tokens = 64;
    cr_assert_eq(pd_api_sched_params(&r, prompt, 10, 512, 512, &lim, &p, &e), PD_OK);
    cr_expect_eq(p.gen.max_tokens, 64);
    cr_expect_eq(p.cache, PD_CACHE_AUTO);
    cr_expect_null(p.ns);
    pd_api_request_free(&r);

    /* prefix_id passes through */
    r = parse_ok(PD_API_COMPLETION, "{\"model\":\"m\",\"prompt\":\"a\",\"prefix_id\":"
                                    "\"ff112233445566778899aabbccddeeff00112233445566778899aabbccddee01\"}");
    cr_assert_eq(pd_api_sched_params(&r, prompt, 10, 512, 512, &lim, &p, &e), PD_OK);
    cr_expect(p.has_prefix_id);
    cr_expect_eq(p.prefix_id.b[0], 0xff);
    cr_expect_eq(p.prefix_id.b[31], 0x01);
    pd_api_request_free(&r);
}

/* ------------------------------------------------------------------ prompt tokens (real tokenizer) */

static pd_model *load_stories(void) {
    char path[4096];
    if (!th_shared_file("tinystories/stories260K.gguf", path, sizeof path)) return NULL;
    pd_model *m = NULL;
    pd_error err = {0};
    pd_model_params mp = {.n_threads = 1};
    cr_assert_eq(pd_model_load(path, &mp, &m, &err), PD_OK, "%s", err.msg);
    return m;
}

Test(api, prompt_tokens) {
    TH_REQUIRE_SHARED();
    pd_model *m = load_stories();
    if (!m) cr_skip_test("stories260K.gguf is absent");
    const pd_tokenizer *tok = pd_model_tokenizer(m);
    pd_api_error e = {0};
    pd_error err = {0};
    pd_token *t = NULL, *ref = NULL;
    int64_t n = 0;
    size_t nref = 0, sys = 99;

    pd_api_request r = parse_ok(PD_API_COMPLETION, "{\"model\":\"m\",\"prompt\":\"Once upon a time\"}");
    cr_assert_eq(pd_api_prompt_tokens(&r, tok, PD_CHAT_NONE, NULL, &t, &n, &sys, &e), PD_OK, "%s", e.message);
    pd_tokenize_opts o = {.add_special = true, .parse_special = false};
    cr_assert_eq(pd_tokenize(tok, "Once upon a time", 16, o, &ref, &nref, &err), PD_OK);
    cr_assert_eq((size_t)n, nref);
    cr_expect_eq(t[0], 1, "BOS first");
    cr_expect_arr_eq(t, ref, nref * sizeof *t);
    cr_expect_eq(sys, 0);
    free(t);
    free(ref);
    /* too long for the configured limit */
    pd_api_limits lim;
    pd_api_limits_default(&lim);
    lim.max_prompt_tokens = 2;
    cr_expect_neq(pd_api_prompt_tokens(&r, tok, PD_CHAT_NONE, &lim, &t, &n, NULL, &e), PD_OK);
    cr_expect_str_eq(e.code, "context_length_exceeded");
    pd_api_request_free(&r);

    r = parse_ok(PD_API_COMPLETION, "{\"model\":\"m\",\"prompt\":[[1,403,407]]}");
    cr_assert_eq(pd_api_prompt_tokens(&r, tok, PD_CHAT_NONE, NULL, &t, &n, NULL, &e), PD_OK);
    cr_assert_eq(n, 3);
    cr_expect_eq(t[1], 403);
    free(t);
    pd_api_request_free(&r);

    /* chat: no template is a clear 400; a family renders like pd_chat_render */
    r = parse_ok(PD_API_CHAT, "{\"model\":\"c\",\"messages\":[{\"role\":\"system\",\"content\":\"You tell stories.\"},"
                              "{\"role\":\"user\",\"content\":\"A cat\"}]}");
    cr_expect_neq(pd_api_prompt_tokens(&r, tok, PD_CHAT_NONE, NULL, &t, &n, NULL, &e), PD_OK);
    cr_expect_eq(e.http_status, 400);
    cr_expect_str_eq(e.code, "no_chat_template");
    cr_expect(strstr(e.message, "/v1/completions"));
    cr_assert_eq(pd_api_prompt_tokens(&r, tok, PD_CHAT_ZEPHYR, NULL, &t, &n, &sys, &e), PD_OK, "%s", e.message);
    char *text = NULL;
    size_t len = 0, rsys = 0;
    cr_assert_eq(pd_chat_render(PD_CHAT_ZEPHYR, r.messages, r.n_messages, true, &text, &len, &rsys, &err), PD_OK);
    pd_tokenize_opts oc = {.add_special = true, .parse_special = true};
    cr_assert_eq(pd_tokenize(tok, text, len, oc, &ref, &nref, &err), PD_OK);
    cr_assert_eq((size_t)n, nref);
    cr_expect_arr_eq(t, ref, nref * sizeof *t);
    cr_expect_eq(sys, rsys);
    cr_expect_gt(sys, 0);
    free(text);
    free(ref);
    free(t);
    pd_api_request_free(&r);
    pd_model_free(m);
}

/* ------------------------------------------------------------------ responses */

static pd_sample_result sample_of(pd_token tok, float lp, int ntop) {
    pd_sample_result s;
    memset(&s, 0, sizeof s);
    s.token = tok;
    s.has_logprob = true;
    s.logprob = lp;
    s.n_top = ntop;
    for (int i = 0; i < ntop; i++) {
        s.top[i].token = tok + i;
        s.top[i].logprob = lp - (float)i;
    }
    return s;
}

Test(api, completion_json_shape) {
    pd_api_response_opts o = {.kind = PD_API_COMPLETION, .id = "cmpl-test", .created = 1700000000,
                              .model = "stories", .n_choices = 2};
    pd_api_response *r = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_api_response_create(&o, &r, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_api_response_token(r, 0, "Hel", 3, NULL, &err), PD_OK);
    cr_assert_eq(pd_api_response_token(r, 0, "lo", 2, NULL, &err), PD_OK);
    cr_assert_eq(pd_api_response_token(r, 1, "", 0, NULL, &err), PD_OK);
    cr_expect_neq(pd_api_response_token(r, 2, "x", 1, NULL, &err), PD_OK, "choice out of range");
    cr_assert_eq(pd_api_response_finish(r, 0, PD_FINISH_LENGTH, &err), PD_OK);
    cr_expect_neq(pd_api_response_token(r, 0, "x", 1, NULL, &err), PD_OK, "after finish");
    pd_sched_usage u = {.prompt_tokens = 12, .completion_tokens = 3, .cached_tokens = 8, .prefix_used = true,
                        .prefix_kept_rows = 40, .prefix_full_rows = 160};
    u.prefix_id.b[0] = 0xab;
    snprintf(u.prefix_spec, sizeof u.prefix_spec, "compactor:retention=0.25");
    pd_api_response_usage(r, &u);
    char *s = NULL;
    size_t len = 0;
    cr_assert_eq(pd_api_response_json(r, &s, &len, &err), PD_OK);
    json_t *j = load(s, len);
    cr_expect_str_eq(jstr(j, "id"), "cmpl-test");
    cr_expect_str_eq(jstr(j, "object"), "text_completion");
    cr_expect_eq(json_integer_value(json_object_get(j, "created")), 1700000000);
    cr_expect_str_eq(jstr(j, "model"), "stories");
    json_t *ch = json_object_get(j, "choices");
    cr_assert_eq(json_array_size(ch), 2);
    json_t *c0 = json_array_get(ch, 0), *c1 = json_array_get(ch, 1);
    cr_expect_eq(json_integer_value(json_object_get(c0, "index")), 0);
    cr_expect_str_eq(jstr(c0, "text"), "Hello");
    cr_expect_str_eq(jstr(c0, "finish_reason"), "length");
    cr_expect(json_is_null(json_object_get(c0, "logprobs")));
    cr_expect_eq(json_integer_value(json_object_get(c1, "index")), 1);
    cr_expect_str_eq(jstr(c1, "text"), "");
    cr_expect(json_is_null(json_object_get(c1, "finish_reason")));
    json_t *us = json_object_get(j, "usage");
    cr_expect_eq(json_integer_value(json_object_get(us, "prompt_tokens")), 12);
    cr_expect_eq(json_integer_value(json_object_get(us, "completion_tokens")), 3);
    cr_expect_eq(json_integer_value(json_object_get(us, "total_tokens")), 15);
    cr_expect_eq(json_integer_value(json_object_get(json_object_get(us, "prompt_tokens_details"), "cached_tokens")), 8);
    json_t *px = json_object_get(j, "prefix");
    cr_assert(json_is_object(px));
    cr_expect_eq(strlen(jstr(px, "id")), 64);
    cr_expect_eq(strncmp(jstr(px, "id"), "ab00", 4), 0);
    cr_expect_eq(json_integer_value(json_object_get(px, "original_tokens")), 8);
    cr_expect_eq(json_integer_value(json_object_get(px, "kept_tokens")), 2);
    cr_expect_float_eq(json_real_value(json_object_get(px, "kept_fraction")), 0.25, 1e-12);
    cr_expect_str_eq(jstr(px, "policy"), "compactor:retention=0.25");
    json_decref(j);
    free(s);
    pd_api_response_free(r);

    /* random ids; no prefix object without a stored prefix */
    o.id = NULL;
    o.created = 0;
    cr_assert_eq(pd_api_response_create(&o, &r, &err), PD_OK);
    cr_expect_eq(strncmp(pd_api_response_id(r), "cmpl-", 5), 0);
    cr_expect_eq(strlen(pd_api_response_id(r)), 5 + 24);
    cr_assert_eq(pd_api_response_json(r, &s, &len, &err), PD_OK);
    j = load(s, len);
    cr_expect_null(json_object_get(j, "prefix"));
    cr_expect_gt(json_integer_value(json_object_get(j, "created")), 1600000000);
    json_decref(j);
    free(s);
    pd_api_response_free(r);
    o.kind = PD_API_CHAT;
    cr_assert_eq(pd_api_response_create(&o, &r, &err), PD_OK);
    cr_expect_eq(strncmp(pd_api_response_id(r), "chatcmpl-", 9), 0);
    pd_api_response_free(r);
}

static pd_model *load_stories(void);

Test(api, logprobs_shapes) {
    TH_REQUIRE_SHARED();
    pd_model *model = load_stories();
    if (!model) cr_skip_test("stories260K.gguf is absent");
    const pd_tokenizer *tk = pd_model_tokenizer(model);
    char p65[64], p66[64];
    int l65 = pd_token_to_piece(tk, 65, true, p65, sizeof p65), l66 = pd_token_to_piece(tk, 66, true, p66, sizeof p66);
    cr_assert(l65 > 0 && l66 > 0);
    p65[l65] = p66[l66] = '\0';
    for (int kind = 0; kind < 2; kind++) {
        pd_api_response_opts o = {.kind = (pd_api_kind)kind, .id = "x", .created = 1, .model = "m",
                                  .n_choices = 1, .logprobs = true, .n_logprobs = 2, .tok = tk};
        pd_api_response *r = NULL;
        pd_error err = {0};
        cr_assert_eq(pd_api_response_create(&o, &r, &err), PD_OK);
        pd_sample_result a = sample_of(65, -0.5f, 3), b = sample_of(66, -1.25f, 1);
        cr_assert_eq(pd_api_response_token(r, 0, "A", 1, &a, &err), PD_OK);
        cr_assert_eq(pd_api_response_token(r, 0, "B", 1, &b, &err), PD_OK);
        cr_assert_eq(pd_api_response_finish(r, 0, PD_FINISH_STOP, &err), PD_OK);
        char *s = NULL;
        size_t len = 0;
        cr_assert_eq(pd_api_response_json(r, &s, &len, &err), PD_OK);
        json_t *j = load(s, len);
        json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
        json_t *lp = json_object_get(c0, "logprobs");
        cr_assert(json_is_object(lp), "%s", s);
        if (kind == PD_API_COMPLETION) {
            json_t *toks = json_object_get(lp, "tokens"), *tl = json_object_get(lp, "token_logprobs");
            json_t *tops = json_object_get(lp, "top_logprobs"), *off = json_object_get(lp, "text_offset");
            cr_assert_eq(json_array_size(toks), 2);
            cr_assert_eq(json_array_size(tl), 2);
            cr_assert_eq(json_array_size(tops), 2);
            cr_assert_eq(json_array_size(off), 2);
            cr_expect_float_eq(json_real_value(json_array_get(tl, 0)), -0.5, 1e-6);
            cr_expect_float_eq(json_real_value(json_array_get(tl, 1)), -1.25, 1e-6);
            cr_expect_eq(json_object_size(json_array_get(tops, 0)), 2, "capped at n_logprobs");
            cr_expect_eq(json_object_size(json_array_get(tops, 1)), 1);
            cr_expect_eq(json_integer_value(json_array_get(off, 0)), 0);
            cr_expect_eq(json_integer_value(json_array_get(off, 1)), l65, "offset = piece lengths before");
            cr_expect_str_eq(json_string_value(json_array_get(toks, 0)), p65);
            cr_expect_str_eq(json_string_value(json_array_get(toks, 1)), p66);
            cr_expect_float_eq(json_real_value(json_object_get(json_array_get(tops, 0), p66)), -1.5, 1e-6);
        } else {
            cr_expect_str_eq(jstr(json_object_get(c0, "message"), "content"), "AB");
            json_t *content = json_object_get(lp, "content");
            cr_assert_eq(json_array_size(content), 2);
            json_t *e0 = json_array_get(content, 0);
            cr_expect_str_eq(jstr(e0, "token"), p65);
            json_t *bytes = json_object_get(e0, "bytes");
            cr_assert_eq(json_array_size(bytes), (size_t)l65);
            for (int q = 0; q < l65; q++)
                cr_expect_eq(json_integer_value(json_array_get(bytes, (size_t)q)), (unsigned char)p65[q]);
            cr_expect_float_eq(json_real_value(json_object_get(e0, "logprob")), -0.5, 1e-6);
            cr_expect(json_is_array(json_object_get(e0, "bytes")));
            json_t *tops = json_object_get(e0, "top_logprobs");
            cr_assert_eq(json_array_size(tops), 2);
            cr_expect_float_eq(json_real_value(json_object_get(json_array_get(tops, 1), "logprob")), -1.5, 1e-6);
            cr_expect(json_is_array(json_object_get(json_array_get(tops, 1), "bytes")));
        }
        json_decref(j);
        free(s);
        pd_api_response_free(r);
    }
    pd_model_free(model);
}

/* Collect every SSE event of a response into one buffer, checking framing. */
typedef struct sse_log {
    json_t *events; /* array of parsed chunks */
} sse_log;

static void take(sse_log *l, char *ev, size_t len) {
    if (!ev) {
        cr_assert_eq(len, 0);
        return;
    }
    cr_assert_gt(len, 8);
    cr_assert_eq(strncmp(ev, "data: ", 6), 0);
    cr_assert_eq(strcmp(ev + len - 2, "\n\n"), 0);
    cr_assert_eq(strlen(ev), len);
    json_t *j = load(ev + 6, len - 8);
    json_array_append_new(l->events, j);
    free(ev);
}

/* Concatenated content and logprobs entries of choice `c` over the events. */
static void collect(json_t *events, pd_api_kind kind, int c, char **text, json_t *lps, const char **finish) {
    size_t cap = 1, n = 0;
    char *t = calloc(1, 1);
    *finish = NULL;
    for (size_t i = 0; i < json_array_size(events); i++) {
        json_t *ev = json_array_get(events, i);
        json_t *chs = json_object_get(ev, "choices");
        for (size_t k = 0; k < json_array_size(chs); k++) {
            json_t *ch = json_array_get(chs, k);
            if (json_integer_value(json_object_get(ch, "index")) != c) continue;
            cr_assert_null(*finish, "nothing after the finish chunk");
            const char *piece = "";
            if (kind == PD_API_CHAT) {
                json_t *content = json_object_get(json_object_get(ch, "delta"), "content");
                if (content) piece = json_string_value(content);
            } else {
                piece = json_string_value(json_object_get(ch, "text"));
            }
            cr_assert_not_null(piece);
            size_t pl = strlen(piece);
            t = realloc(t, cap += pl);
            memcpy(t + n, piece, pl);
            n += pl;
            t[n] = '\0';
            json_t *lp = json_object_get(ch, "logprobs");
            if (json_is_object(lp)) {
                if (kind == PD_API_CHAT) {
                    json_array_extend(json_object_get(lps, "content"), json_object_get(lp, "content"));
                } else {
                    const char *keys[] = {"tokens", "token_logprobs", "top_logprobs", "text_offset"};
                    for (int q = 0; q < 4; q++)
                        json_array_extend(json_object_get(lps, keys[q]), json_object_get(lp, keys[q]));
                }
            }
            json_t *fr = json_object_get(ch, "finish_reason");
            if (json_is_string(fr)) *finish = json_string_value(fr);
        }
    }
    *text = t;
}

/* Generate greedily from the real model with logprobs and a stop string, and
 * feed the same accumulator path both ways. */
static void stream_vs_whole(pd_api_kind kind, bool split_utf8) {
    pd_model *m = load_stories();
    if (!m) cr_skip_test("stories260K.gguf is absent");
    const pd_tokenizer *tok = pd_model_tokenizer(m);
    int32_t nv = pd_model_hparams(m)->n_vocab;
    pd_error err = {0};
    pd_api_response_opts o = {.kind = kind, .id = "id-1", .created = 5, .model = "stories260K", .n_choices = 2,
                              .logprobs = true, .n_logprobs = 3, .include_usage = true, .tok = tok};
    pd_api_response *r = NULL;
    cr_assert_eq(pd_api_response_create(&o, &r, &err), PD_OK);
    sse_log log = {json_array()};
    pd_sampler_params sp = pd_sampler_params_default();
    sp.temperature = 0;
    sp.n_logprobs = 3;
    sp.logprobs = true;
    float *logits = malloc((size_t)nv * sizeof *logits);
    cr_assert_not_null(logits);
    const char *stops[] = {"park"};
    for (int c = 0; c < 2; c++) {
        pd_seq *seq = NULL;
        pd_sampler *smp = NULL;
        pd_generation *gen = NULL;
        cr_assert_eq(pd_seq_create(m, 256, &seq, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_sampler_create(&sp, nv, &smp, &err), PD_OK, "%s", err.msg);
        pd_generation_params gp = {.max_tokens = c == 0 ? 60 : 12, .stop = stops, .n_stop = 1};
        cr_assert_eq(pd_generation_create(tok, &gp, &gen, &err), PD_OK, "%s", err.msg);
        pd_token t = c == 0 ? 1 : 403;
        cr_assert_eq(pd_prefill(m, seq, &t, 1, NULL, logits, &err), PD_OK, "%s", err.msg);
        for (;;) {
            pd_sample_result s;
            cr_assert_eq(pd_sampler_sample(smp, logits, &s, &err), PD_OK, "%s", err.msg);
            cr_assert_eq(pd_sampler_accept(smp, s.token, true, &err), PD_OK);
            pd_generation_step st;
            cr_assert_eq(pd_generation_push(gen, s.token, &st, &err), PD_OK, "%s", err.msg);
            if (split_utf8 && st.len > 0) {
                /* replace the text by a multi-byte character cut across two tokens */
                static const char euro[] = "\xe2\x82\xac";
                size_t cut = (size_t)(pd_generation_n_tokens(gen) % 3);
                cr_assert_eq(pd_api_response_token(r, c, euro, cut, &s, &err), PD_OK);
                char *ev = NULL;
                size_t el = 0;
                cr_assert_eq(pd_api_response_sse_chunk(r, c, &ev, &el, &err), PD_OK);
                take(&log, ev, el);
                pd_sample_result none = s;
                cr_assert_eq(pd_api_response_token(r, c, euro + cut, 3 - cut, &none, &err), PD_OK);
            } else {
                cr_assert_eq(pd_api_response_token(r, c, st.text, st.len, &s, &err), PD_OK);
            }
            char *ev = NULL;
            size_t el = 0;
            cr_assert_eq(pd_api_response_sse_chunk(r, c, &ev, &el, &err), PD_OK);
            take(&log, ev, el);
            if (st.finish != PD_FINISH_NONE) {
                cr_assert_eq(pd_api_response_finish(r, c, st.finish, &err), PD_OK);
                cr_assert_eq(pd_api_response_sse_finish(r, c, &ev, &el, &err), PD_OK);
                take(&log, ev, el);
                /* a second finish renders nothing */
                cr_assert_eq(pd_api_response_sse_finish(r, c, &ev, &el, &err), PD_OK);
                cr_assert_null(ev);
                break;
            }
            cr_assert_eq(pd_decode(m, &seq, &s.token, 1, logits, &err), PD_OK, "%s", err.msg);
        }
        pd_generation_free(gen);
        pd_sampler_free(smp);
        pd_seq_free(seq);
    }
    pd_sched_usage u = {.prompt_tokens = 1, .completion_tokens = 0};
    pd_api_response_usage(r, &u);
    char *ev = NULL;
    size_t el = 0;
    cr_assert_eq(pd_api_response_sse_usage(r, &ev, &el, &err), PD_OK);
    take(&log, ev, el);

    char *whole = NULL;
    size_t wl = 0;
    cr_assert_eq(pd_api_response_json(r, &whole, &wl, &err), PD_OK);
    json_t *w = load(whole, wl);
    cr_expect_str_eq(jstr(w, "object"), kind == PD_API_CHAT ? "chat.completion" : "text_completion");

    /* every chunk: the object, id, usage null; the first chat chunk of each choice has the role */
    json_t *events = log.events;
    cr_assert_gt(json_array_size(events), 4);
    bool seen_role[2] = {false, false};
    for (size_t i = 0; i < json_array_size(events); i++) {
        json_t *e = json_array_get(events, i);
        cr_expect_str_eq(jstr(e, "object"), kind == PD_API_CHAT ? "chat.completion.chunk" : "text_completion");
        cr_expect_str_eq(jstr(e, "id"), "id-1");
        cr_expect_str_eq(jstr(e, "model"), "stories260K");
        json_t *chs = json_object_get(e, "choices");
        if (i + 1 == json_array_size(events)) {
            cr_expect_eq(json_array_size(chs), 0, "usage chunk has no choices");
            json_t *us = json_object_get(e, "usage");
            cr_expect(json_equal(us, json_object_get(w, "usage")));
            continue;
        }
        cr_expect(json_is_null(json_object_get(e, "usage")));
        cr_assert_eq(json_array_size(chs), 1);
        if (kind == PD_API_CHAT) {
            json_t *ch = json_array_get(chs, 0);
            int idx = (int)json_integer_value(json_object_get(ch, "index"));
            json_t *role = json_object_get(json_object_get(ch, "delta"), "role");
            cr_expect_eq(role != NULL, !seen_role[idx], "role only in the first chunk of a choice");
            if (role) cr_expect_str_eq(json_string_value(role), "assistant");
            seen_role[idx] = true;
        }
    }
    int64_t total_tokens = 0;
    for (int c = 0; c < 2; c++) {
        char *text = NULL;
        const char *finish = NULL;
        json_t *lps = kind == PD_API_CHAT
                          ? json_pack("{s:[]}", "content")
                          : json_pack("{s:[],s:[],s:[],s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
        collect(events, kind, c, &text, lps, &finish);
        json_t *wc = json_array_get(json_object_get(w, "choices"), (size_t)c);
        const char *wtext = kind == PD_API_CHAT ? jstr(json_object_get(wc, "message"), "content") : jstr(wc, "text");
        cr_expect_str_eq(text, wtext, "choice %d: streamed text equals the whole text", c);
        cr_expect_gt(strlen(wtext), 0);
        cr_assert_not_null(finish);
        cr_expect_str_eq(finish, jstr(wc, "finish_reason"));
        cr_expect(json_equal(lps, json_object_get(wc, "logprobs")), "choice %d: logprobs differ", c);
        json_t *content = kind == PD_API_CHAT ? json_object_get(json_object_get(wc, "logprobs"), "content")
                                              : json_object_get(json_object_get(wc, "logprobs"), "tokens");
        total_tokens += (int64_t)json_array_size(content);
        if (split_utf8) cr_expect(strstr(wtext, "\xe2\x82\xac") != NULL);
        free(text);
        json_decref(lps);
    }
    json_t *us = json_object_get(w, "usage");
    cr_expect_eq(json_integer_value(json_object_get(us, "completion_tokens")), total_tokens);
    /* choice 0 reaches the stop string "park" in the reference story */
    json_t *c0 = json_array_get(json_object_get(w, "choices"), 0);
    cr_expect_str_eq(jstr(c0, "finish_reason"), "stop");
    if (!split_utf8) {
        const char *t0 = kind == PD_API_CHAT ? jstr(json_object_get(c0, "message"), "content") : jstr(c0, "text");
        cr_expect(strstr(t0, "play outside in the ") != NULL, "%s", t0);
        cr_expect(strstr(t0, "park") == NULL);
    }
    json_decref(w);
    json_decref(events);
    free(whole);
    free(logits);
    pd_api_response_free(r);
    pd_model_free(m);
}

Test(api, stream_equals_whole_completion) {
    TH_REQUIRE_SHARED();
    stream_vs_whole(PD_API_COMPLETION, false);
}

Test(api, stream_equals_whole_chat) {
    TH_REQUIRE_SHARED();
    stream_vs_whole(PD_API_CHAT, false);
}

Test(api, stream_equals_whole_split_utf8) {
    TH_REQUIRE_SHARED();
    stream_vs_whole(PD_API_CHAT, true);
    stream_vs_whole(PD_API_COMPLETION, true);
}

Test(api, invalid_utf8_becomes_replacement) {
    pd_api_response_opts o = {.kind = PD_API_CHAT, .id = "x", .created = 1, .model = "m", .n_choices = 1};
    pd_api_response *r = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_api_response_create(&o, &r, &err), PD_OK);
    sse_log log = {json_array()};
    const char *pieces[] = {"a\xff", "b\xe2\x82", "", "\xac", "\xc3", "(", "\xf0\x9f\x98"};
    for (size_t i = 0; i < sizeof pieces / sizeof pieces[0]; i++) {
        cr_assert_eq(pd_api_response_token(r, 0, pieces[i], strlen(pieces[i]), NULL, &err), PD_OK);
        char *ev = NULL;
        size_t el = 0;
        cr_assert_eq(pd_api_response_sse_chunk(r, 0, &ev, &el, &err), PD_OK);
        take(&log, ev, el);
    }
    cr_assert_eq(pd_api_response_finish(r, 0, PD_FINISH_LENGTH, &err), PD_OK);
    char *ev = NULL, *whole = NULL;
    size_t el = 0, wl = 0;
    cr_assert_eq(pd_api_response_sse_finish(r, 0, &ev, &el, &err), PD_OK);
    take(&log, ev, el);
    cr_assert_eq(pd_api_response_sse_usage(r, &ev, &el, &err), PD_OK);
    cr_expect_null(ev, "no usage chunk without include_usage");
    cr_assert_eq(pd_api_response_json(r, &whole, &wl, &err), PD_OK);
    json_t *w = load(whole, wl);
    const char *wt = jstr(json_object_get(json_array_get(json_object_get(w, "choices"), 0), "message"), "content");
    cr_expect_str_eq(wt, "a\xef\xbf\xbd" "b\xe2\x82\xac\xef\xbf\xbd(\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd");
    char *text = NULL;
    const char *finish = NULL;
    json_t *lps = json_pack("{s:[]}", "content");
    collect(log.events, PD_API_CHAT, 0, &text, lps, &finish);
    cr_expect_str_eq(text, wt);
    cr_expect_str_eq(finish, "length");
    free(text);
    json_decref(lps);
    json_decref(w);
    json_decref(log.events);
    free(whole);
    pd_api_response_free(r);
}

/* ------------------------------------------------------------------ models */

Test(api, models) {
    char id[128];
    pd_api_model_id(NULL, "/var/lib/prefixd/models/SmolLM2-135M.Q8_0.gguf", id, sizeof id);
    cr_expect_str_eq(id, "SmolLM2-135M.Q8_0");
    pd_api_model_id(NULL, "plain", id, sizeof id);
    cr_expect_str_eq(id, "plain");
    pd_api_model_id(NULL, "/x/.gguf", id, sizeof id);
    cr_expect_str_eq(id, "model");
    char *s = NULL;
    size_t len = 0;
    pd_error err = {0};
    cr_assert_eq(pd_api_models_json("stories260K", 1700000001, &s, &len, &err), PD_OK);
    json_t *j = load(s, len);
    cr_expect_str_eq(jstr(j, "object"), "list");
    json_t *d = json_object_get(j, "data");
    cr_assert_eq(json_array_size(d), 1);
    json_t *m0 = json_array_get(d, 0);
    cr_expect_str_eq(jstr(m0, "id"), "stories260K");
    cr_expect_str_eq(jstr(m0, "object"), "model");
    cr_expect_str_eq(jstr(m0, "owned_by"), "prefixd");
    cr_expect_eq(json_integer_value(json_object_get(m0, "created")), 1700000001);
    json_decref(j);
    free(s);

    if (th_shared_models()) {
        pd_model *m = load_stories();
        if (m) {
            pd_api_model_id(pd_model_gguf(m), "/a/stories260K.gguf", id, sizeof id);
            cr_expect_str_eq(id, "llama", "general.name wins");
            pd_model_free(m);
        }
    }
}

Test(api, one_model_object) {
    char *s = NULL;
    size_t len = 0;
    pd_error err = {0};
    cr_assert_eq(pd_api_model_json("org/model", 1700000002, &s, &len, &err), PD_OK);
    json_t *j = load(s, len);
    cr_expect_eq(json_object_size(j), 4);
    cr_expect_str_eq(jstr(j, "id"), "org/model");
    cr_expect_str_eq(jstr(j, "object"), "model");
    cr_expect_str_eq(jstr(j, "owned_by"), "prefixd");
    cr_expect_eq(json_integer_value(json_object_get(j, "created")), 1700000002);
    json_decref(j);
    free(s);
}

/* A request body with every %s of fmt (at most two) set to role. */
static void fill_roles(char *out, size_t cap, const char *fmt, const char *role) {
    cr_assert(fmt);
    snprintf(out, cap, fmt, role, role);
}

/* "developer" parses as "system", so every template renders the two
 * identically, wherever the message stands; validation treats it the same
 * too (a family without a system turn refuses both after the first turn). */
Test(api, developer_renders_as_system_in_every_template) {
    static const char *const bodies[] = {
        "{\"model\":\"c\",\"messages\":[{\"role\":\"%s\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Hi\"}]}",
        "{\"model\":\"c\",\"messages\":[{\"role\":\"%s\",\"content\":\"A\"},{\"role\":\"%s\",\"content\":\"B\"},"
        "{\"role\":\"user\",\"content\":\"Hi\"},{\"role\":\"assistant\",\"content\":\"Yo\"},{\"role\":\"user\","
        "\"content\":\"Go\"}]}",
        "{\"model\":\"c\",\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"},{\"role\":\"%s\",\"content\":\"Late.\"}]}",
    };
    for (size_t b = 0; b < sizeof bodies / sizeof bodies[0]; b++) {
        char sys_body[512], dev_body[512];
        fill_roles(sys_body, sizeof sys_body, bodies[b], "system");
        fill_roles(dev_body, sizeof dev_body, bodies[b], "developer");
        pd_api_request rs = parse_ok(PD_API_CHAT, sys_body), rd = parse_ok(PD_API_CHAT, dev_body);
        cr_assert_eq(rd.n_messages, rs.n_messages);
        for (size_t i = 0; i < rd.n_messages; i++) cr_expect_str_eq(rd.messages[i].role, rs.messages[i].role);
        for (int f = PD_CHAT_NONE + 1; f < PD_CHAT_FAMILY_COUNT; f++) {
            char *ts = NULL, *td = NULL;
            size_t ls = 0, ld = 0, ss = 0, sd = 0;
            pd_error es = {0}, ed = {0};
            const int rcs = pd_chat_render((pd_chat_family)f, rs.messages, rs.n_messages, true, &ts, &ls, &ss, &es);
            const int rcd = pd_chat_render((pd_chat_family)f, rd.messages, rd.n_messages, true, &td, &ld, &sd, &ed);
            cr_expect_eq(rcd, rcs, "family %d, body %zu: %s / %s", f, b, es.msg, ed.msg);
            if (rcs == PD_OK && rcd == PD_OK) {
                cr_expect(ls == ld && memcmp(ts, td, ls) == 0, "family %d, body %zu:\n%.*s\n---\n%.*s", f, b, (int)ls,
                          ts, (int)ld, td);
                cr_expect_eq(sd, ss);
                /* the instruction is in the prompt (folded or as its own turn) */
                cr_expect(memmem(td, ld, b == 1 ? "B" : b == 2 ? "Late." : "Be brief.", b == 1 ? 1 : b == 2 ? 5 : 9),
                          "family %d drops the developer message:\n%.*s", f, (int)ld, td);
            }
            free(ts);
            free(td);
        }
        pd_api_request_free(&rs);
        pd_api_request_free(&rd);
    }
}

/* ------------------------------------------------------------------ tokenize */

Test(api, tokenize_parse) {
    pd_api_tokenize_request r;
    pd_api_error e = {0};
    const char *b = "{\"content\":\"caf\\u00e9\",\"with_pieces\":true,\"model\":\"ignored\"}";
    cr_assert_eq(pd_api_parse_tokenize(false, b, strlen(b), NULL, &r, &e), PD_OK, "%s", e.message);
    cr_expect_str_eq(r.content, "caf\xc3\xa9");
    cr_expect_eq(r.content_len, 5);
    cr_expect(r.with_pieces && r.parse_special && !r.add_special, "llama-server's defaults");
    pd_api_tokenize_request_free(&r);
    b = "{\"content\":\"x\",\"add_special\":true,\"parse_special\":false,\"with_pieces\":null}";
    cr_assert_eq(pd_api_parse_tokenize(false, b, strlen(b), NULL, &r, &e), PD_OK, "%s", e.message);
    cr_expect(r.add_special && !r.parse_special && !r.with_pieces);
    pd_api_tokenize_request_free(&r);
    b = "{\"tokens\":[1,2,3]}";
    cr_assert_eq(pd_api_parse_tokenize(true, b, strlen(b), NULL, &r, &e), PD_OK, "%s", e.message);
    cr_assert_eq(r.n_tokens, 3);
    cr_expect_eq(r.tokens[2], 3);
    pd_api_tokenize_request_free(&r);
    b = "{\"tokens\":[]}";
    cr_assert_eq(pd_api_parse_tokenize(true, b, strlen(b), NULL, &r, &e), PD_OK, "%s", e.message);
    cr_expect_eq(r.n_tokens, 0);
    pd_api_tokenize_request_free(&r);

    pd_api_limits lim;
    pd_api_limits_default(&lim);
    lim.max_prompt_tokens = 2;
    b = "{\"tokens\":[1,2,3]}";
    cr_assert_neq(pd_api_parse_tokenize(true, b, strlen(b), &lim, &r, &e), PD_OK);
    cr_expect_str_eq(e.code, "context_length_exceeded");
    cr_expect_str_eq(e.param, "tokens");
    cr_expect_null(r.tokens);
    lim.max_body_bytes = 10;
    cr_assert_neq(pd_api_parse_tokenize(true, b, strlen(b), &lim, &r, &e), PD_OK);
    cr_expect_eq(e.http_status, 413);
}

Test(api, tokenize_answers) {
    TH_REQUIRE_SHARED();
    pd_model *m = load_stories();
    if (!m) cr_skip_test("stories260K.gguf is absent");
    const pd_tokenizer *tok = pd_model_tokenizer(m);
    pd_api_tokenize_request r;
    pd_api_error e = {0};
    char *out = NULL;
    size_t len = 0;
    /* ids as pd_tokenize gives them; with pieces, a lone byte of a split
     * character is its byte value */
    const char *b = "{\"content\":\"Once \\u5abd\",\"add_special\":true,\"with_pieces\":true}";
    cr_assert_eq(pd_api_parse_tokenize(false, b, strlen(b), NULL, &r, &e), PD_OK, "%s", e.message);
    cr_assert_eq(pd_api_tokenize_answer(&r, tok, NULL, &out, &len, &e), PD_OK, "%s", e.message);
    pd_token *ref = NULL;
    size_t nref = 0;
    pd_error err = {0};
    pd_tokenize_opts o = {.add_special = true, .parse_special = true};
    cr_assert_eq(pd_tokenize(tok, r.content, r.content_len, o, &ref, &nref, &err), PD_OK);
    json_t *j = load(out, len);
    json_t *arr = json_object_get(j, "tokens");
    cr_assert_eq(json_array_size(arr), nref, "%s", out);
    cr_expect_str_eq(jstr(json_array_get(arr, 0), "piece"), "<s>");
    bool bytes = false;
    for (size_t i = 0; i < nref; i++) {
        json_t *t = json_array_get(arr, i);
        cr_expect_eq(json_integer_value(json_object_get(t, "id")), ref[i]);
        json_t *p = json_object_get(t, "piece");
        if (json_is_array(p)) {
            bytes = true;
            cr_expect_eq(json_array_size(p), 1);
            cr_expect_geq(json_integer_value(json_array_get(p, 0)), 0x80);
        }
    }
    cr_expect(bytes, "%s", out);
    json_decref(j);
    free(out);
    pd_api_tokenize_request_free(&r);

    /* detokenize: pieces joined, the BOS as its text; a lone byte is U+FFFD;
     * ids past the vocabulary name their index */
    char body[256];
    snprintf(body, sizeof body, "{\"tokens\":[%d,%d,%d]}", ref[0], ref[1], ref[nref - 1]);
    cr_assert_eq(pd_api_parse_tokenize(true, body, strlen(body), NULL, &r, &e), PD_OK, "%s", e.message);
    cr_assert_eq(pd_api_tokenize_answer(&r, tok, NULL, &out, &len, &e), PD_OK, "%s", e.message);
    j = load(out, len);
    cr_expect_str_eq(jstr(j, "content"), "<s> Once\xef\xbf\xbd");
    json_decref(j);
    free(out);
    pd_api_tokenize_request_free(&r);
    snprintf(body, sizeof body, "{\"tokens\":[1,%d]}", pd_tokenizer_n_vocab(tok));
    cr_assert_eq(pd_api_parse_tokenize(true, body, strlen(body), NULL, &r, &e), PD_OK, "%s", e.message);
    cr_assert_neq(pd_api_tokenize_answer(&r, tok, NULL, &out, &len, &e), PD_OK);
    cr_expect_eq(e.http_status, 400);
    cr_expect_str_eq(e.param, "tokens[1]");
    cr_expect_null(out);
    pd_api_tokenize_request_free(&r);
    /* the token limit applies after tokenization */
    pd_api_limits lim;
    pd_api_limits_default(&lim);
    lim.max_prompt_tokens = 3;
    b = "{\"content\":\"Once upon a time there was\"}";
    cr_assert_eq(pd_api_parse_tokenize(false, b, strlen(b), &lim, &r, &e), PD_OK, "%s", e.message);
    cr_assert_neq(pd_api_tokenize_answer(&r, tok, &lim, &out, &len, &e), PD_OK);
    cr_expect_str_eq(e.code, "context_length_exceeded");
    cr_expect_str_eq(e.param, "content");
    pd_api_tokenize_request_free(&r);
    free(ref);
    pd_model_free(m);
}
