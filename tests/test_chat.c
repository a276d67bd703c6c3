/* Chat templates: family detection from template text and from a model,
 * the exact rendered format of every family (the strings below are the
 * format contract, see docs/chat-templates.md), the system-prefix length,
 * errors, and how rendered text tokenizes. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "helpers.h"
#include "tools/tools.h"

static char *tmpdir;

static void setup(void) {
    tmpdir = th_mkdtemp();
    cr_assert_not_null(tmpdir);
}

static void teardown(void) {
    th_rmtree(tmpdir);
    free(tmpdir);
    tmpdir = NULL;
}

TestSuite(chat, .init = setup, .fini = teardown);

static const char *tpath(const char *name) {
    static char buf[1024];
    snprintf(buf, sizeof buf, "%s/%s", tmpdir, name);
    return buf;
}

static pd_chat_family detect(const char *text) { return pd_chat_detect(text, strlen(text)); }

/* Render and check success; the caller frees the text. */
static char *render(pd_chat_family f, const pd_chat_message *m, size_t n, bool gen, size_t *len,
                    size_t *sys_len) {
    char *out = NULL;
    pd_error err = {0};
    size_t l = 0, s = 0;
    int rc = pd_chat_render(f, m, n, gen, &out, &l, &s, &err);
    cr_assert_eq(rc, PD_OK, "%s: %s", pd_chat_family_name(f), err.msg);
    cr_assert_not_null(out);
    cr_assert_eq(strlen(out), l, "%s: length matches the NUL-terminated text", pd_chat_family_name(f));
    if (len) *len = l;
    if (sys_len) *sys_len = s;
    return out;
}

/* ---- names --------------------------------------------------------------- */

Test(chat, family_names_round_trip) {
    static const char *const names[PD_CHAT_FAMILY_COUNT] = {"none", "chatml", "llama3", "llama2",
                                                            "mistral", "zephyr", "phi3", "gemma", "qwen3"};
    for (int f = 0; f < PD_CHAT_FAMILY_COUNT; f++) {
        cr_expect_str_eq(pd_chat_family_name((pd_chat_family)f), names[f]);
        pd_chat_family back = PD_CHAT_FAMILY_COUNT;
        cr_expect(pd_chat_family_from_name(names[f], &back), "%s", names[f]);
        cr_expect_eq(back, (pd_chat_family)f, "%s", names[f]);
    }
    pd_chat_family f = PD_CHAT_CHATML;
    cr_expect(pd_chat_family_from_name("ChatML", &f), "names are case-insensitive");
    cr_expect_eq(f, PD_CHAT_CHATML);
    f = PD_CHAT_LLAMA3;
    cr_expect_not(pd_chat_family_from_name("vicuna", &f));
    cr_expect_not(pd_chat_family_from_name("chatml ", &f));
    cr_expect_not(pd_chat_family_from_name("", &f));
    cr_expect_not(pd_chat_family_from_name(NULL, &f));
    cr_expect_eq(f, PD_CHAT_LLAMA3, "left untouched on failure");
    cr_expect_str_eq(pd_chat_family_name(PD_CHAT_FAMILY_COUNT), "unknown");
}

/* ---- detection from template text --------------------------------------- */

/* Minimal Jinja-like snippets, each carrying only its family's markers. */
Test(chat, detect_families) {
    cr_expect_eq(detect("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + "
                        "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                        "{{ '<|im_start|>assistant\\n' }}{% endif %}"),
                 PD_CHAT_CHATML);
    cr_expect_eq(detect("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m.role + "
                        "'<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}{% endfor %}"),
                 PD_CHAT_LLAMA3);
    cr_expect_eq(detect("{% if messages[0].role == 'system' %}{% set s = '<<SYS>>\\n' + messages[0].content + "
                        "'\\n<</SYS>>\\n\\n' %}{% endif %}{% for m in loop_messages %}"
                        "{{ bos_token + '[INST] ' + m.content + ' [/INST]' }}{% endfor %}"),
                 PD_CHAT_LLAMA2);
    cr_expect_eq(detect("{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}"
                        "{{ '[INST] ' + m.content + ' [/INST]' }}{% else %}{{ m.content + eos_token }}"
                        "{% endif %}{% endfor %}"),
                 PD_CHAT_MISTRAL);
    cr_expect_eq(detect("{% for m in messages %}{% if m.role == 'user' %}{{ '<|user|>\\n' + m.content + "
                        "eos_token }}{% elif m.role == 'system' %}{{ '<|system|>\\n' + m.content + eos_token }}"
                        "{% else %}{{ '<|assistant|>\\n' + m.content + eos_token }}{% endif %}{% endfor %}"),
                 PD_CHAT_ZEPHYR);
    cr_expect_eq(detect("{% for m in messages %}{{ '<|user|>\\n' + m.content + '</s>\\n' }}{% endfor %}"),
                 PD_CHAT_ZEPHYR, "a literal </s> marks Zephyr as well as eos_token");
    cr_expect_eq(detect("{% for m in messages %}{% if m.role == 'user' %}{{ '<|user|>\\n' + m.content + "
                        "'<|end|>\\n<|assistant|>\\n' }}{% else %}{{ m.content + '<|end|>\\n' }}{% endif %}"
                        "{% endfor %}"),
                 PD_CHAT_PHI3, "Phi-3 wins over Zephyr: <|end|> is checked first");
}

Test(chat, detect_mistral_variants) {
    /* v1 (leading space) and v3 ([AVAILABLE_TOOLS]) are mapped to the classic renderer */
    cr_expect_eq(detect("{{- ' [INST] ' + system_message + '\\n\\n' + m.content + ' [/INST]' }}"),
                 PD_CHAT_MISTRAL);
    cr_expect_eq(detect("{{- '[AVAILABLE_TOOLS] [' }}{{- '[INST] ' + m.content + '[/INST]' }}"),
                 PD_CHAT_MISTRAL);
    /* v7 has a native system prompt: refused rather than rendered wrongly */
    cr_expect_eq(detect("{{ '[SYSTEM_PROMPT] ' + m.content + '[/SYSTEM_PROMPT]' }}{{ '[INST] ' + m.content + "
                        "'[/INST]' }}"),
                 PD_CHAT_NONE);
}

Test(chat, detect_unsupported_and_edge_cases) {
    cr_expect_eq(pd_chat_detect(NULL, 10), PD_CHAT_NONE);
    cr_expect_eq(pd_chat_detect("", 0), PD_CHAT_NONE);
    cr_expect_eq(detect("{{ messages }}"), PD_CHAT_NONE);
    /* Phi-4 and SmolVLM reuse <|im_start|> with another layout */
    cr_expect_eq(detect("{{ '<|im_start|>' + m.role + '<|im_sep|>' + m.content + '<|im_end|>' }}"), PD_CHAT_NONE);
    cr_expect_eq(detect("<|im_start|>{{ 'User: ' + m.content + '<end_of_utterance>\\n' }}"), PD_CHAT_NONE);
    /* StableLM-Zephyr ends turns with <|endoftext|>, GLM-Edge with nothing */
    cr_expect_eq(detect("{{ '<|user|>\\n' + m.content + '<|endoftext|>\\n' }}"), PD_CHAT_NONE);
    cr_expect_eq(detect("{% if r == 'user' %}<|user|>\\n{{ c }}{% endif %}<|assistant|>"), PD_CHAT_NONE);
    /* Llama 4 */
    cr_expect_eq(detect("{{ '<|header_start|>' + role + '<|header_end|>\\n\\n' }}"), PD_CHAT_NONE);
    /* A bare family name, as a configured override */
    cr_expect_eq(detect("chatml"), PD_CHAT_CHATML);
    cr_expect_eq(detect("Llama2"), PD_CHAT_LLAMA2);
    cr_expect_eq(detect("none"), PD_CHAT_NONE);
    /* Only len bytes are read: the text need not be NUL-terminated */
    static const char buf[] = {'<', '|', 'i', 'm', '_', 's', 't', 'a', 'r', 't', '|', '>'};
    cr_expect_eq(pd_chat_detect(buf, sizeof buf), PD_CHAT_CHATML);
    cr_expect_eq(pd_chat_detect(buf, 11), PD_CHAT_NONE, "marker cut by len is not seen");
}

/* The real phi-3 vocab carries Phi-3-mini's template (user/assistant, <|end|>). */
Test(chat, detect_real_phi3_vocab) {
    TH_REQUIRE_SHARED();
    char path[1024];
    cr_assert_not_null(th_shared_file("vocab/ggml-vocab-phi-3.gguf", path, sizeof path), "phi-3 vocab missing");
    pd_gguf *g = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open(path, &g, &err), PD_OK, "%s", err.msg);
    pd_str tmpl = {0};
    cr_assert_eq(pd_gguf_get_str(g, "tokenizer.chat_template", &tmpl, &err), PD_OK, "%s", err.msg);
    cr_expect_eq(pd_chat_detect(tmpl.ptr, (size_t)tmpl.len), PD_CHAT_PHI3);
    pd_gguf_close(g);
}

/* ---- rendering: the format contract ------------------------------------- */

static const pd_chat_message conv4[] = {
    {.role = "system", .content = "You are terse."},
    {.role = "user", .content = "Hello"},
    {.role = "assistant", .content = "Hi there"},
    {.role = "user", .content = "Who are you?"},
};

typedef struct expected_render {
    pd_chat_family f;
    const char *text;   /* without the generation prompt */
    const char *gen;    /* what add_generation_prompt appends */
    const char *prefix; /* the part system_len covers */
} expected_render;

static const expected_render expected4[] = {
    {PD_CHAT_CHATML,
     "<|im_start|>system\nYou are terse.<|im_end|>\n"
     "<|im_start|>user\nHello<|im_end|>\n"
     "<|im_start|>assistant\nHi there<|im_end|>\n"
     "<|im_start|>user\nWho are you?<|im_end|>\n",
     "<|im_start|>assistant\n", "<|im_start|>system\nYou are terse.<|im_end|>\n"},
    {PD_CHAT_LLAMA3,
     "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
     "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
     "<|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|>"
     "<|start_header_id|>user<|end_header_id|>\n\nWho are you?<|eot_id|>",
     "<|start_header_id|>assistant<|end_header_id|>\n\n",
     "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"},
    {PD_CHAT_LLAMA2,
     "[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHello [/INST]Hi there</s><s>[INST] Who are you? [/INST]", "",
     "[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\n"},
    {PD_CHAT_MISTRAL, "[INST] You are terse.\nHello [/INST]Hi there</s>[INST] Who are you? [/INST]", "",
     "[INST] You are terse.\n"},
    {PD_CHAT_ZEPHYR,
     "<|system|>\nYou are terse.</s>\n"
     "<|user|>\nHello</s>\n"
     "<|assistant|>\nHi there</s>\n"
     "<|user|>\nWho are you?</s>\n",
     "<|assistant|>\n", "<|system|>\nYou are terse.</s>\n"},
    {PD_CHAT_PHI3,
     "<|system|>\nYou are terse.<|end|>\n"
     "<|user|>\nHello<|end|>\n"
     "<|assistant|>\nHi there<|end|>\n"
     "<|user|>\nWho are you?<|end|>\n",
     "<|assistant|>\n", "<|system|>\nYou are terse.<|end|>\n"},
    {PD_CHAT_GEMMA,
     "<start_of_turn>user\nYou are terse.\n\nHello<end_of_turn>\n"
     "<start_of_turn>model\nHi there<end_of_turn>\n"
     "<start_of_turn>user\nWho are you?<end_of_turn>\n",
     "<start_of_turn>model\n", "<start_of_turn>user\nYou are terse.\n\n"},
    {PD_CHAT_QWEN3,
     "<|im_start|>system\nYou are terse.<|im_end|>\n"
     "<|im_start|>user\nHello<|im_end|>\n"
     "<|im_start|>assistant\nHi there<|im_end|>\n"
     "<|im_start|>user\nWho are you?<|im_end|>\n",
     "<|im_start|>assistant\n<think>\n\n</think>\n\n", "<|im_start|>system\nYou are terse.<|im_end|>\n"},
};

Test(chat, render_every_family_exactly) {
    size_t n_fam = sizeof expected4 / sizeof expected4[0];
    cr_assert_eq(n_fam, (size_t)PD_CHAT_FAMILY_COUNT - 1, "every family has a case");
    for (size_t k = 0; k < n_fam; k++) {
        const expected_render *e = &expected4[k];
        const char *name = pd_chat_family_name(e->f);
        for (int gen = 0; gen <= 1; gen++) {
            size_t len = 0, sys = 0;
            char *got = render(e->f, conv4, 4, gen, &len, &sys);
            char want[1024];
            snprintf(want, sizeof want, "%s%s", e->text, gen ? e->gen : "");
            cr_expect_str_eq(got, want, "%s gen=%d", name, gen);
            cr_expect_eq(len, strlen(want), "%s gen=%d", name, gen);
            cr_expect_eq(sys, strlen(e->prefix), "%s gen=%d system_len", name, gen);
            cr_expect(strncmp(got, e->prefix, strlen(e->prefix)) == 0, "%s: text starts with the prefix", name);
            free(got);
        }
    }
}

/* llama.cpp's own test conversation and its expected output for the
 * templates of these families (tests/test-chat-template.cpp): a
 * cross-check that we render as llama.cpp does, whitespace included. */
Test(chat, render_matches_llama_cpp_vectors) {
    static const pd_chat_message conv[] = {
        {.role = "system", .content = "You are a helpful assistant"}, {.role = "user", .content = "Hello"},
        {.role = "assistant", .content = "Hi there"},                 {.role = "user", .content = "Who are you"},
        {.role = "assistant", .content = "   I am an assistant   "},  {.role = "user", .content = "Another question"},
    };
    static const struct {
        pd_chat_family f;
        const char *want;
    } cases[] = {
        {PD_CHAT_CHATML,
         "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
         "<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nWho are you<|im_end|>\n"
         "<|im_start|>assistant\n   I am an assistant   <|im_end|>\n<|im_start|>user\nAnother question"
         "<|im_end|>\n<|im_start|>assistant\n"},
        {PD_CHAT_LLAMA3,
         "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|>"
         "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant"
         "<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWho are you"
         "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nI am an assistant<|eot_id|>"
         "<|start_header_id|>user<|end_header_id|>\n\nAnother question<|eot_id|><|start_header_id|>"
         "assistant<|end_header_id|>\n\n"},
        /* llama.cpp's "llama2-sys-bos" variant (BOS inside the history) */
        {PD_CHAT_LLAMA2,
         "[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST]Hi there</s><s>[INST] Who are "
         "you [/INST]   I am an assistant   </s><s>[INST] Another question [/INST]"},
        /* Mistral-7B-Instruct-v0.2's template */
        {PD_CHAT_MISTRAL,
         "[INST] You are a helpful assistant\nHello [/INST]Hi there</s>[INST] Who are you [/INST]   I am an "
         "assistant   </s>[INST] Another question [/INST]"},
        {PD_CHAT_PHI3,
         "<|system|>\nYou are a helpful assistant<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\nHi there"
         "<|end|>\n<|user|>\nWho are you<|end|>\n<|assistant|>\n   I am an assistant   <|end|>\n<|user|>\n"
         "Another question<|end|>\n<|assistant|>\n"},
        /* google/gemma-7b-it (also what Gemma 3's own template renders here) */
        {PD_CHAT_GEMMA,
         "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n<start_of_turn>model\nHi there"
         "<end_of_turn>\n<start_of_turn>user\nWho are you<end_of_turn>\n<start_of_turn>model\nI am an assistant"
         "<end_of_turn>\n<start_of_turn>user\nAnother question<end_of_turn>\n<start_of_turn>model\n"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char *got = render(cases[k].f, conv, 6, true, NULL, NULL);
        cr_expect_str_eq(got, cases[k].want, "%s", pd_chat_family_name(cases[k].f));
        free(got);
    }
}

Test(chat, render_without_system) {
    static const pd_chat_message conv[] = {{.role = "user", .content = "Hi"}};
    static const struct {
        pd_chat_family f;
        const char *want;
    } cases[] = {
        {PD_CHAT_CHATML, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"},
        {PD_CHAT_LLAMA3, "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\n"},
        {PD_CHAT_LLAMA2, "[INST] Hi [/INST]"},
        {PD_CHAT_MISTRAL, "[INST] Hi [/INST]"},
        {PD_CHAT_ZEPHYR, "<|user|>\nHi</s>\n<|assistant|>\n"},
        {PD_CHAT_PHI3, "<|user|>\nHi<|end|>\n<|assistant|>\n"},
        {PD_CHAT_GEMMA, "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"},
        {PD_CHAT_QWEN3, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        size_t sys = 99;
        char *got = render(cases[k].f, conv, 1, true, NULL, &sys);
        cr_expect_str_eq(got, cases[k].want, "%s", pd_chat_family_name(cases[k].f));
        cr_expect_eq(sys, 0, "%s: no system message, no system prefix", pd_chat_family_name(cases[k].f));
        free(got);
    }
}

Test(chat, llama3_trims_content_others_keep_it) {
    static const pd_chat_message conv[] = {{.role = "system", .content = " \tS \n"}, {.role = "user", .content = "\n  Hi  "}};
    char *got = render(PD_CHAT_LLAMA3, conv, 2, false, NULL, NULL);
    cr_expect_str_eq(got, "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
                          "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
    free(got);
    got = render(PD_CHAT_CHATML, conv, 2, false, NULL, NULL);
    cr_expect_str_eq(got, "<|im_start|>system\n \tS \n<|im_end|>\n<|im_start|>user\n\n  Hi  <|im_end|>\n");
    free(got);
    static const pd_chat_message blank[] = {{.role = "user", .content = "   "}, {.role = "assistant", .content = ""}};
    got = render(PD_CHAT_LLAMA3, blank, 2, false, NULL, NULL);
    cr_expect_str_eq(got, "<|start_header_id|>user<|end_header_id|>\n\n<|eot_id|>"
                          "<|start_header_id|>assistant<|end_header_id|>\n\n<|eot_id|>");
    free(got);
}

/* ---- system_len ------------------------------------------------------------ */

/* The system prefix depends on the system message only: two conversations
 * that share it render to texts sharing exactly that many leading bytes,
 * and it equals the rendering of the system message on its own. */
Test(chat, system_len_is_a_shared_prefix) {
    static const pd_chat_message a[] = {{.role = "system", .content = "Answer in French."}, {.role = "user", .content = "first question"}};
    static const pd_chat_message b[] = {{.role = "system", .content = "Answer in French."},
                                        {.role = "user", .content = "something else entirely"},
                                        {.role = "assistant", .content = "d'accord"},
                                        {.role = "user", .content = "more"}};
    static const pd_chat_message c[] = {{.role = "system", .content = "Answer in German."}, {.role = "user", .content = "first question"}};
    static const pd_chat_message only[] = {{.role = "system", .content = "Answer in French."}};
    for (int fi = 1; fi < PD_CHAT_FAMILY_COUNT; fi++) {
        pd_chat_family f = (pd_chat_family)fi;
        const char *name = pd_chat_family_name(f);
        for (int gen = 0; gen <= 1; gen++) {
            size_t la, lb, lc, lo, sa, sb, sc, so;
            char *ta = render(f, a, 2, gen, &la, &sa);
            char *tb = render(f, b, 4, gen, &lb, &sb);
            char *tc = render(f, c, 2, gen, &lc, &sc);
            char *to = render(f, only, 1, false, &lo, &so);
            cr_expect_gt(sa, 0, "%s", name);
            cr_expect_eq(sa, sb, "%s: same system message, same prefix length", name);
            cr_expect(sa <= la && sb <= lb, "%s", name);
            cr_expect(memcmp(ta, tb, sa) == 0, "%s: texts share the system prefix", name);
            cr_expect(strstr(ta, "Answer in French.") && (size_t)(strstr(ta, "Answer in French.") - ta) +
                                                                 strlen("Answer in French.") <= sa,
                      "%s: the prefix holds the whole system text", name);
            cr_expect(memcmp(ta, tc, sa) != 0, "%s: another system message gives another prefix", name);
            cr_expect_eq(so, lo, "%s: a system-only conversation is all prefix", name);
            cr_expect_eq(so, sa, "%s", name);
            cr_expect(memcmp(to, ta, so) == 0, "%s: prefix = the system message rendered alone", name);
            /* nothing after the prefix depends on the system text: the rest is
             * what the same conversation without its system message renders to,
             * for the families whose system turn is self-contained */
            if (f != PD_CHAT_LLAMA2 && f != PD_CHAT_MISTRAL && f != PD_CHAT_GEMMA) {
                size_t ln;
                char *tn = render(f, a + 1, 1, gen, &ln, NULL);
                cr_expect_eq(la - sa, ln, "%s", name);
                cr_expect(memcmp(ta + sa, tn, ln) == 0, "%s: suffix = conversation without system", name);
                free(tn);
            }
            free(ta);
            free(tb);
            free(tc);
            free(to);
        }
    }
}

Test(chat, several_leading_system_messages) {
    static const pd_chat_message conv[] = {{.role = "system", .content = "A"}, {.role = "system", .content = "B"}, {.role = "user", .content = "U"}};
    static const struct {
        pd_chat_family f;
        const char *prefix;
        const char *rest;
    } cases[] = {
        {PD_CHAT_CHATML, "<|im_start|>system\nA<|im_end|>\n<|im_start|>system\nB<|im_end|>\n",
         "<|im_start|>user\nU<|im_end|>\n"},
        {PD_CHAT_LLAMA3,
         "<|start_header_id|>system<|end_header_id|>\n\nA<|eot_id|><|start_header_id|>system<|end_header_id|>"
         "\n\nB<|eot_id|>",
         "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"},
        {PD_CHAT_LLAMA2, "[INST] <<SYS>>\nA\nB\n<</SYS>>\n\n", "U [/INST]"},
        {PD_CHAT_MISTRAL, "[INST] A\nB\n", "U [/INST]"},
        {PD_CHAT_ZEPHYR, "<|system|>\nA</s>\n<|system|>\nB</s>\n", "<|user|>\nU</s>\n"},
        {PD_CHAT_PHI3, "<|system|>\nA<|end|>\n<|system|>\nB<|end|>\n", "<|user|>\nU<|end|>\n"},
        {PD_CHAT_GEMMA, "<start_of_turn>user\nA\n\nB\n\n", "U<end_of_turn>\n"},
        {PD_CHAT_QWEN3, "<|im_start|>system\nA<|im_end|>\n<|im_start|>system\nB<|im_end|>\n",
         "<|im_start|>user\nU<|im_end|>\n"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        size_t sys = 0;
        char *got = render(cases[k].f, conv, 3, false, NULL, &sys);
        char want[512];
        snprintf(want, sizeof want, "%s%s", cases[k].prefix, cases[k].rest);
        cr_expect_str_eq(got, want, "%s", pd_chat_family_name(cases[k].f));
        cr_expect_eq(sys, strlen(cases[k].prefix), "%s", pd_chat_family_name(cases[k].f));
        free(got);
    }
}

Test(chat, later_system_message) {
    static const pd_chat_message conv[] = {
        {.role = "user", .content = "U1"}, {.role = "assistant", .content = "A1"}, {.role = "system", .content = "Now be brief."}, {.role = "user", .content = "U2"}};
    /* a native system turn can go anywhere; it is not part of the prefix */
    size_t sys = 99;
    char *got = render(PD_CHAT_CHATML, conv, 4, false, NULL, &sys);
    cr_expect_str_eq(got, "<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
                          "<|im_start|>system\nNow be brief.<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n");
    cr_expect_eq(sys, 0);
    free(got);
    static const pd_chat_message lead[] = {{.role = "system", .content = "S"}, {.role = "user", .content = "U1"}, {.role = "system", .content = "T"}};
    got = render(PD_CHAT_PHI3, lead, 3, false, NULL, &sys);
    cr_expect_str_eq(got, "<|system|>\nS<|end|>\n<|user|>\nU1<|end|>\n<|system|>\nT<|end|>\n");
    cr_expect_eq(sys, strlen("<|system|>\nS<|end|>\n"), "only the leading system turn is the prefix");
    free(got);
    got = render(PD_CHAT_QWEN3, conv, 4, false, NULL, &sys);
    cr_expect_str_eq(got, "<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
                          "<|im_start|>system\nNow be brief.<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n");
    cr_expect_eq(sys, 0);
    free(got);
    /* families that fold system text into the first user turn cannot place it */
    pd_chat_family inst[] = {PD_CHAT_LLAMA2, PD_CHAT_MISTRAL, PD_CHAT_GEMMA};
    for (size_t k = 0; k < sizeof inst / sizeof *inst; k++) {
        char *out = (char *)"sentinel";
        size_t len = 7, sl = 7;
        pd_error err = {0};
        cr_expect_eq(pd_chat_render(inst[k], conv, 4, true, &out, &len, &sl, &err), PD_EINVAL);
        cr_expect_null(out);
        cr_expect_eq(len, 0);
        cr_expect_eq(sl, 0);
        cr_expect(strstr(err.msg, "message 2") && strstr(err.msg, pd_chat_family_name(inst[k])),
                  "names the message and the template: %s", err.msg);
    }
}

/* ---- errors ------------------------------------------------------------------ */

Test(chat, errors) {
    pd_error err = {0};
    char *out = NULL;
    size_t len, sys;
    static const pd_chat_message ok[] = {{.role = "user", .content = "hi"}};

    cr_expect_eq(pd_chat_render(PD_CHAT_CHATML, ok, 0, true, &out, &len, &sys, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "no messages"), "%s", err.msg);
    cr_expect_null(out);

    cr_expect_eq(pd_chat_render(PD_CHAT_CHATML, NULL, 2, true, &out, &len, &sys, &err), PD_EINVAL);

    /* "function" is the role OpenAI retired for "tool" */
    static const pd_chat_message fn[] = {{.role = "user", .content = "hi"}, {.role = "function", .content = "{}"}};
    cr_expect_eq(pd_chat_render(PD_CHAT_CHATML, fn, 2, true, &out, &len, &sys, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "\"function\"") && strstr(err.msg, "message 1"), "names role and index: %s", err.msg);
    cr_expect_null(out);

    static const pd_chat_message upper[] = {{.role = "User", .content = "hi"}};
    cr_expect_eq(pd_chat_render(PD_CHAT_PHI3, upper, 1, true, &out, &len, &sys, &err), PD_EINVAL,
                 "roles are case-sensitive");

    static const pd_chat_message norole[] = {{.role = NULL, .content = "hi"}};
    cr_expect_eq(pd_chat_render(PD_CHAT_LLAMA3, norole, 1, true, &out, &len, &sys, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "message 0"), "%s", err.msg);

    static const pd_chat_message nocontent[] = {{.role = "user", .content = "hi"}, {.role = "assistant", .content = NULL}};
    cr_expect_eq(pd_chat_render(PD_CHAT_ZEPHYR, nocontent, 2, true, &out, &len, &sys, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "message 1"), "%s", err.msg);

    cr_expect_eq(pd_chat_render(PD_CHAT_NONE, ok, 1, true, &out, &len, &sys, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "chat_template"), "says why: %s", err.msg);
    cr_expect_eq(pd_chat_render((pd_chat_family)42, ok, 1, true, &out, &len, &sys, &err), PD_EINVAL);
    cr_expect_eq(pd_chat_render(PD_CHAT_CHATML, ok, 1, true, NULL, &len, &sys, &err), PD_EINVAL);
    cr_expect_null(out);

    /* len and system_len are optional */
    cr_expect_eq(pd_chat_render(PD_CHAT_CHATML, ok, 1, true, &out, NULL, NULL, &err), PD_OK, "%s", err.msg);
    cr_expect_str_eq(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    free(out);
}

/* Long messages: the buffer grows past its first size. */
Test(chat, long_message) {
    size_t n = 100000;
    char *big = malloc(n + 1);
    cr_assert_not_null(big);
    memset(big, 'x', n);
    big[n] = '\0';
    pd_chat_message conv[] = {{.role = "system", .content = big}, {.role = "user", .content = big}};
    size_t len = 0, sys = 0;
    char *got = render(PD_CHAT_LLAMA2, conv, 2, true, &len, &sys);
    cr_expect_eq(sys, strlen("[INST] <<SYS>>\n") + n + strlen("\n<</SYS>>\n\n"));
    cr_expect_eq(len, sys + n + strlen(" [/INST]"));
    free(got);
    free(big);
}

/* ---- tokenization of rendered text ------------------------------------------ */

static size_t count_id(const pd_token *ids, size_t n, pd_token id) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++) c += ids[i] == id;
    return c;
}

/* The system prefix must tokenize to the leading tokens of the whole text,
 * or a stored prefix could not be reused token for token. */
static void expect_prefix_tokens(const pd_tokenizer *t, const char *text, size_t len, size_t sys_len,
                                 const char *what) {
    pd_tokenize_opts o = {.add_special = true, .parse_special = true};
    pd_error err = {0};
    pd_token *full = NULL, *pre = NULL;
    size_t nf = 0, np = 0;
    cr_assert_eq(pd_tokenize(t, text, len, o, &full, &nf, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_tokenize(t, text, sys_len, o, &pre, &np, &err), PD_OK, "%s", err.msg);
    cr_expect(np > 1 && np < nf, "%s: %zu prefix tokens of %zu", what, np, nf);
    cr_expect(np <= nf && memcmp(pre, full, np * sizeof *pre) == 0, "%s: prefix tokens lead the full text", what);
    free(full);
    free(pre);
}

static pd_token find_tok(const pd_tokenizer *t, const char *text) {
    pd_token id = pd_tokenizer_find(t, text, strlen(text));
    cr_assert_neq(id, PD_TOKEN_NULL, "%s is a token of the vocab", text);
    return id;
}

/* Phi-3 text through the phi-3 vocab: with parse_special every marker is one
 * control token; BOS comes from add_special, not from the text. */
Test(chat, phi3_markers_are_single_tokens) {
    TH_REQUIRE_SHARED();
    pd_tokenizer *t = th_shared_tokenizer("vocab/ggml-vocab-phi-3.gguf");
    size_t len = 0, sys_len = 0;
    char *text = render(PD_CHAT_PHI3, conv4, 4, true, &len, &sys_len);
    expect_prefix_tokens(t, text, len, sys_len, "phi3");
    pd_token sys = find_tok(t, "<|system|>"), user = find_tok(t, "<|user|>"),
             asst = find_tok(t, "<|assistant|>"), end = find_tok(t, "<|end|>");
    pd_error err = {0};
    pd_token *ids = NULL;
    size_t n = 0;
    pd_tokenize_opts special = {.add_special = true, .parse_special = true};
    cr_assert_eq(pd_tokenize(t, text, len, special, &ids, &n, &err), PD_OK, "%s", err.msg);
    cr_assert_gt(n, 0);
    cr_expect_eq(ids[0], pd_tokenizer_bos(t), "add_special puts BOS first");
    cr_expect_eq(count_id(ids, n, pd_tokenizer_bos(t)), 1, "the text itself holds no BOS");
    cr_expect_eq(ids[1], sys, "then <|system|>");
    cr_expect_eq(count_id(ids, n, sys), 1);
    cr_expect_eq(count_id(ids, n, user), 2);
    cr_expect_eq(count_id(ids, n, asst), 2, "one turn and the generation prompt");
    cr_expect_eq(count_id(ids, n, end), 4);
    cr_expect_eq(ids[n - 1], asst, "ends with the assistant opening (its newline is absorbed by phi-3's rstrip)");
    free(ids);
    /* without parse_special the markers are plain text */
    pd_tokenize_opts plain = {.add_special = false, .parse_special = false};
    cr_assert_eq(pd_tokenize(t, text, len, plain, &ids, &n, &err), PD_OK, "%s", err.msg);
    cr_expect_eq(count_id(ids, n, user) + count_id(ids, n, asst) + count_id(ids, n, end) + count_id(ids, n, sys), 0);
    free(ids);
    free(text);
    pd_tokenizer_free(t);
}

/* Llama 2 text through the Llama 2 vocab: "</s>" and the "<s>" inside the
 * history become EOS and BOS; "[INST]" stays ordinary text. (Mistral 7B's
 * vocab is the same kind of SentencePiece vocab, so its prefix is checked
 * here too.) */
Test(chat, llama2_bos_eos_in_history) {
    TH_REQUIRE_SHARED();
    pd_tokenizer *t = th_shared_tokenizer("vocab/ggml-vocab-llama-spm.gguf");
    size_t len = 0, sys_len = 0;
    char *text = render(PD_CHAT_LLAMA2, conv4, 4, true, &len, &sys_len);
    expect_prefix_tokens(t, text, len, sys_len, "llama2");
    char *mistral = render(PD_CHAT_MISTRAL, conv4, 4, true, &len, &sys_len);
    expect_prefix_tokens(t, mistral, len, sys_len, "mistral");
    free(mistral);
    len = strlen(text);
    pd_error err = {0};
    pd_token *ids = NULL;
    size_t n = 0;
    pd_tokenize_opts special = {.add_special = true, .parse_special = true};
    cr_assert_eq(pd_tokenize(t, text, len, special, &ids, &n, &err), PD_OK, "%s", err.msg);
    pd_token bos = pd_tokenizer_bos(t), eos = pd_tokenizer_eos(t);
    cr_expect_eq(ids[0], bos);
    cr_expect_eq(count_id(ids, n, bos), 2, "added BOS + the one before the second [INST]");
    cr_expect_eq(count_id(ids, n, eos), 1, "the assistant turn's </s>");
    cr_expect_eq(pd_tokenizer_find(t, "[INST]", 6), PD_TOKEN_NULL, "[INST] is not a special token here");
    free(ids);
    free(text);
    pd_tokenizer_free(t);
}

/* ---- pd_model_chat_family -------------------------------------------------- */

/* A tiny generated model; vocab_from copies every tokenizer.* key, the chat
 * template included. */
static pd_model *gen_model(const char *vocab_from, const char *name) {
    pd_testmodel_opts o;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset("tiny", &o, &err), PD_OK, "%s", err.msg);
    o.vocab_from = vocab_from;
    o.wtype = PD_TYPE_Q8_0;
    char path[1024];
    snprintf(path, sizeof path, "%s", tpath(name));
    cr_assert_eq(pd_testmodel_write(&o, path, NULL, &err), PD_OK, "%s", err.msg);
    pd_model *m = NULL;
    pd_model_params p = {.n_threads = 1};
    cr_assert_eq(pd_model_load(path, &p, &m, &err), PD_OK, "%s: %s", path, err.msg);
    return m;
}

/* A vocab-only GGUF: the tokenizer.* keys of `src` with another chat template. */
static const char *vocab_with_template(const char *src, const char *tmpl, const char *name) {
    pd_gguf *g = NULL;
    pd_gguf_writer *w = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open(src, &g, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_gguf_writer_new(&w, &err), PD_OK, "%s", err.msg);
    for (size_t i = 0; i < pd_gguf_kv_count(g); i++) {
        const pd_gguf_kv *kv = pd_gguf_kv_at(g, i);
        if (strncmp(kv->key, "tokenizer.", 10) != 0 || strcmp(kv->key, "tokenizer.chat_template") == 0) continue;
        cr_assert_eq(pd_gguf_writer_copy_kv(w, kv, &err), PD_OK, "%s", err.msg);
    }
    cr_assert_eq(pd_gguf_writer_set_str(w, "tokenizer.chat_template", tmpl, &err), PD_OK, "%s", err.msg);
    static char path[1024];
    snprintf(path, sizeof path, "%s", tpath(name));
    cr_assert_eq(pd_gguf_writer_write(w, path, 0, &err), PD_OK, "%s", err.msg);
    pd_gguf_writer_free(w);
    pd_gguf_close(g);
    return path;
}

Test(chat, model_without_template_is_none) {
    pd_model *m = gen_model(NULL, "builtin.gguf");
    cr_expect_null(pd_gguf_find(pd_model_gguf(m), "tokenizer.chat_template"));
    cr_expect_eq(pd_model_chat_family(m), PD_CHAT_NONE);
    pd_model_free(m);
    cr_expect_eq(pd_model_chat_family(NULL), PD_CHAT_NONE);
}

Test(chat, model_with_phi3_vocab) {
    TH_REQUIRE_SHARED();
    char vpath[1024];
    cr_assert_not_null(th_shared_file("vocab/ggml-vocab-phi-3.gguf", vpath, sizeof vpath));
    pd_model *m = gen_model(vpath, "phi3.gguf");
    cr_expect_eq(pd_model_chat_family(m), PD_CHAT_PHI3);
    pd_model_free(m);
}

/* Templates set on a copy of the phi-3 vocab (which has <s>, </s> and the
 * Phi-3 markers but no ChatML or Llama 3 tokens). */
Test(chat, model_template_must_match_vocab) {
    TH_REQUIRE_SHARED();
    char vpath[1024];
    cr_assert_not_null(th_shared_file("vocab/ggml-vocab-phi-3.gguf", vpath, sizeof vpath));
    static const struct {
        const char *tmpl;
        pd_chat_family want;
    } cases[] = {
        {"{% for m in messages %}{{ '<|user|>\\n' + m.content + eos_token + '\\n' }}{% endfor %}", PD_CHAT_ZEPHYR},
        {"{{ '[INST] <<SYS>>\\n' + s + '\\n<</SYS>>\\n\\n' }}", PD_CHAT_LLAMA2},
        {"{{ '[INST] ' + m.content + ' [/INST]' }}", PD_CHAT_MISTRAL},
        /* markers the vocab lacks: would render as plain text, so none */
        {"{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}", PD_CHAT_NONE},
        {"{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}", PD_CHAT_NONE},
        {"{{ messages }}", PD_CHAT_NONE},
        /* Gemma's and Qwen3's markers are not in the phi-3 vocab either */
        {"{{ '<start_of_turn>' + role + '\\n' + m.content | trim + '<end_of_turn>\\n' }}", PD_CHAT_NONE},
        {"{{ '<|im_start|>' + m.role }}{% if enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
         "{% endif %}",
         PD_CHAT_NONE},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char vname[64], mname[64];
        snprintf(vname, sizeof vname, "vocab%zu.gguf", k);
        snprintf(mname, sizeof mname, "model%zu.gguf", k);
        const char *vp = vocab_with_template(vpath, cases[k].tmpl, vname);
        pd_model *m = gen_model(vp, mname);
        cr_expect_eq(pd_model_chat_family(m), cases[k].want, "case %zu: %s", k, cases[k].tmpl);
        pd_model_free(m);
    }
}

/* ---- Gemma and Qwen3 ---------------------------------------------------------- */

/* Templates written the way the models ship them (Jinja, abridged to the
 * parts that decide the format). */
static const char gemma3_template[] =
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {{- message['content'] | trim }}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{ '<start_of_turn>model\\n' }}\n"
    "{%- endif -%}\n";

static const char gemma2_template[] =
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + "
    "message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{'<start_of_turn>model\\n'}}{% endif %}";

static const char qwen3_template[] =
    "{%- if messages[0].role == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and not(message.content.startswith('<tool_response>')"
    " and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- set content = message.content %}\n"
    "    {%- if message.role == \"user\" or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if '</think>' in content %}\n"
    "            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') %}\n"
    "            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}\n"
    "            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') }}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>assistant\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n";

/* Phi-3.5-mini / later Phi-3-mini: a system branch, EOS without a generation prompt. */
static const char phi35_template[] =
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}";

Test(chat, detect_gemma_qwen3_phi3_templates) {
    cr_expect_eq(detect(gemma3_template), PD_CHAT_GEMMA);
    cr_expect_eq(detect(gemma2_template), PD_CHAT_GEMMA);
    cr_expect_eq(detect(qwen3_template), PD_CHAT_QWEN3);
    cr_expect_eq(detect(phi35_template), PD_CHAT_PHI3);
    /* Qwen2.5 (no thinking) and QwQ (thinking always on, no switch) stay ChatML */
    cr_expect_eq(detect("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content "
                        "+ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
                        "{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"),
                 PD_CHAT_CHATML);
    /* SmolLM3 reads enable_thinking into its own system header */
    cr_expect_eq(detect("{%- if enable_thinking -%}{%- set reasoning_mode = \"/think\" -%}{%- else -%}"
                        "{%- set reasoning_mode = \"/no_think\" -%}{%- endif -%}{{- \"<|im_start|>system\\n\" -}}"
                        "{{- \"<think>\\n\\n</think>\\n\" }}"),
                 PD_CHAT_CHATML);
    cr_expect_eq(detect("gemma"), PD_CHAT_GEMMA);
    cr_expect_eq(detect("Qwen3"), PD_CHAT_QWEN3);
}

/* Gemma as Gemma 3's template renders: "model" for the assistant, every
 * turn's content trimmed, the system text (as given) + "\n\n" opening the
 * first user turn. */
Test(chat, gemma_renders_as_its_template) {
    static const pd_chat_message conv[] = {
        {.role = "system", .content = "  Be kind. "}, {.role = "user", .content = " Hello\n"}, {.role = "assistant", .content = "\n Hi! "}, {.role = "user", .content = "Bye"}};
    char *got = render(PD_CHAT_GEMMA, conv, 4, true, NULL, NULL);
    cr_expect_str_eq(got, "<start_of_turn>user\n  Be kind. \n\nHello<end_of_turn>\n"
                          "<start_of_turn>model\nHi!<end_of_turn>\n"
                          "<start_of_turn>user\nBye<end_of_turn>\n"
                          "<start_of_turn>model\n");
    free(got);
    /* A system message followed by a model turn: its user turn holds only
     * the system text (Gemma's template would refuse the order). */
    static const pd_chat_message model_first[] = {{.role = "system", .content = "S"}, {.role = "assistant", .content = "A"}, {.role = "user", .content = "U"}};
    size_t sys = 0;
    got = render(PD_CHAT_GEMMA, model_first, 3, true, NULL, &sys);
    cr_expect_str_eq(got, "<start_of_turn>user\nS\n\n<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n"
                          "<start_of_turn>user\nU<end_of_turn>\n<start_of_turn>model\n");
    cr_expect_eq(sys, strlen("<start_of_turn>user\nS\n\n"));
    free(got);
    /* System only, with a generation prompt: what the template renders for
     * the system message and an empty user message. */
    static const pd_chat_message only[] = {{.role = "system", .content = "S"}};
    static const pd_chat_message empty_user[] = {{.role = "system", .content = "S"}, {.role = "user", .content = ""}};
    char *a = render(PD_CHAT_GEMMA, only, 1, true, NULL, NULL);
    char *b = render(PD_CHAT_GEMMA, empty_user, 2, true, NULL, NULL);
    cr_expect_str_eq(a, "<start_of_turn>user\nS\n\n<end_of_turn>\n<start_of_turn>model\n");
    cr_expect_str_eq(a, b);
    free(a);
    free(b);
}

/* Qwen3 as its template renders with enable_thinking = false. */
Test(chat, qwen3_renders_as_its_template) {
    /* Reasoning written into an earlier answer is dropped from the history;
     * the final answer (after the last question) keeps a <think> block,
     * empty when it had no reasoning. */
    static const pd_chat_message conv[] = {{.role = "system", .content = "S"},
                                           {.role = "user", .content = "Q1"},
                                           {.role = "assistant", .content = "<think>\nplan\n</think>\n\nA1"},
                                           {.role = "user", .content = "Q2"},
                                           {.role = "assistant", .content = "A2"}};
    char *got = render(PD_CHAT_QWEN3, conv, 5, false, NULL, NULL);
    cr_expect_str_eq(got, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n"
                          "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
                          "<|im_start|>assistant\n<think>\n\n</think>\n\nA2<|im_end|>\n");
    free(got);
    static const pd_chat_message reasoned[] = {{.role = "user", .content = "Q"}, {.role = "assistant", .content = "<think>\n\nstep one\n\n</think>\n\nA"}};
    got = render(PD_CHAT_QWEN3, reasoned, 2, false, NULL, NULL);
    cr_expect_str_eq(got, "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nstep one\n</think>\n\nA"
                          "<|im_end|>\n");
    free(got);
    /* Tool output sent as a user message does not start a new query: the
     * answers after the question keep their reasoning, an answer without
     * reasoning that is not the last one stays plain. */
    static const pd_chat_message tools[] = {{.role = "user", .content = "Q"},
                                            {.role = "assistant", .content = "calling"},
                                            {.role = "user", .content = "<tool_response>\n42\n</tool_response>"},
                                            {.role = "assistant", .content = "<think>r</think>x"},
                                            {.role = "assistant", .content = "y"}};
    got = render(PD_CHAT_QWEN3, tools, 5, true, NULL, NULL);
    cr_expect_str_eq(got, "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\ncalling<|im_end|>\n"
                          "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                          "<|im_start|>assistant\n<think>\nr\n</think>\n\nx<|im_end|>\n"
                          "<|im_start|>assistant\n<think>\n\n</think>\n\ny<|im_end|>\n"
                          "<|im_start|>assistant\n<think>\n\n</think>\n\n");
    free(got);
    /* Only the part after the last </think> is the answer; the reasoning is
     * what precedes the first </think>, after its last <think>. */
    static const pd_chat_message nested[] = {{.role = "user", .content = "Q"}, {.role = "assistant", .content = "a<think>b</think>c</think>\nd"}};
    got = render(PD_CHAT_QWEN3, nested, 2, false, NULL, NULL);
    cr_expect_str_eq(got, "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nb\n</think>\n\nd<|im_end|>\n");
    free(got);
}

/* A copy of the phi-3 vocab with extra tokens appended (and a template):
 * the markers of a family the shared vocabularies lack. */
static const char *vocab_with_tokens(const char *src, const char *const *extra, const int32_t *types, size_t n_extra,
                                     const char *tmpl, const char *name) {
    pd_gguf *g = NULL;
    pd_gguf_writer *w = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_gguf_open(src, &g, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_gguf_writer_new(&w, &err), PD_OK, "%s", err.msg);
    const pd_gguf_value *toks = NULL, *scores = NULL, *ttypes = NULL;
    cr_assert_eq(pd_gguf_get_arr(g, "tokenizer.ggml.tokens", PD_GGUF_STRING, &toks, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_gguf_get_arr(g, "tokenizer.ggml.scores", PD_GGUF_FLOAT32, &scores, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_gguf_get_arr(g, "tokenizer.ggml.token_type", PD_GGUF_INT32, &ttypes, &err), PD_OK, "%s",
                 err.msg);
    const size_t n = (size_t)toks->arr.n, total = n + n_extra;
    pd_str *t = malloc(sizeof *t * total);
    float *sc = malloc(sizeof *sc * total);
    int32_t *ty = malloc(sizeof *ty * total);
    cr_assert(t && sc && ty);
    for (size_t i = 0; i < n; i++) {
        t[i] = toks->arr.strs[i];
        sc[i] = pd_gguf_arr_f32(scores, i);
        ty[i] = pd_gguf_arr_i32(ttypes, i);
    }
    for (size_t i = 0; i < n_extra; i++) {
        t[n + i] = (pd_str){extra[i], strlen(extra[i])};
        sc[n + i] = 0.0f;
        ty[n + i] = types[i];
    }
    for (size_t i = 0; i < pd_gguf_kv_count(g); i++) {
        const pd_gguf_kv *kv = pd_gguf_kv_at(g, i);
        if (strncmp(kv->key, "tokenizer.", 10) != 0 || strcmp(kv->key, "tokenizer.chat_template") == 0 ||
            strcmp(kv->key, "tokenizer.ggml.tokens") == 0 || strcmp(kv->key, "tokenizer.ggml.scores") == 0 ||
            strcmp(kv->key, "tokenizer.ggml.token_type") == 0)
            continue;
        cr_assert_eq(pd_gguf_writer_copy_kv(w, kv, &err), PD_OK, "%s", err.msg);
    }
    cr_assert_eq(pd_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", t, total, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_gguf_writer_set_arr(w, "tokenizer.ggml.scores", PD_GGUF_FLOAT32, sc, total, &err), PD_OK, "%s",
                 err.msg);
    cr_assert_eq(pd_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", PD_GGUF_INT32, ty, total, &err), PD_OK, "%s",
                 err.msg);
    cr_assert_eq(pd_gguf_writer_set_str(w, "tokenizer.chat_template", tmpl, &err), PD_OK, "%s", err.msg);
    static char path[1024];
    snprintf(path, sizeof path, "%s", tpath(name));
    cr_assert_eq(pd_gguf_writer_write(w, path, 0, &err), PD_OK, "%s", err.msg);
    pd_gguf_writer_free(w);
    pd_gguf_close(g);
    free(t);
    free(sc);
    free(ty);
    return path;
}

/* Gemma and Qwen3 markers on a vocabulary that has them: detected from the
 * model, one token each with parse_special, the system prefix tokenizes to
 * the leading tokens, and each family's end-of-turn token stops generation. */
Test(chat, gemma_qwen3_models_markers_and_stop_tokens) {
    TH_REQUIRE_SHARED();
    char vpath[1024];
    cr_assert_not_null(th_shared_file("vocab/ggml-vocab-phi-3.gguf", vpath, sizeof vpath));
    static const char *const extra[] = {"<start_of_turn>", "<end_of_turn>", "<|im_start|>",
                                        "<|im_end|>",      "<think>",       "</think>"};
    static const int32_t types[] = {PD_TOKEN_TYPE_CONTROL, PD_TOKEN_TYPE_CONTROL, PD_TOKEN_TYPE_CONTROL,
                                    PD_TOKEN_TYPE_CONTROL, PD_TOKEN_TYPE_USER_DEFINED, PD_TOKEN_TYPE_USER_DEFINED};
    static const struct {
        const char *tmpl;
        pd_chat_family f;
        const char *open, *close; /* turn markers */
        size_t n_open, n_close;   /* in conv4 with the generation prompt */
    } cases[] = {
        {gemma3_template, PD_CHAT_GEMMA, "<start_of_turn>", "<end_of_turn>", 4, 3},
        {qwen3_template, PD_CHAT_QWEN3, "<|im_start|>", "<|im_end|>", 5, 4},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        const char *name = pd_chat_family_name(cases[k].f);
        char vname[64], mname[64];
        snprintf(vname, sizeof vname, "vocab-%s.gguf", name);
        snprintf(mname, sizeof mname, "model-%s.gguf", name);
        const char *vp = vocab_with_tokens(vpath, extra, types, 6, cases[k].tmpl, vname);
        pd_model *m = gen_model(vp, mname);
        cr_expect_eq(pd_model_chat_family(m), cases[k].f, "%s", name);
        const pd_tokenizer *t = pd_model_tokenizer(m);
        size_t len = 0, sys_len = 0;
        char *text = render(cases[k].f, conv4, 4, true, &len, &sys_len);
        expect_prefix_tokens(t, text, len, sys_len, name);
        pd_token open = find_tok(t, cases[k].open), close = find_tok(t, cases[k].close);
        pd_tokenize_opts special = {.add_special = true, .parse_special = true};
        pd_token *ids = NULL;
        size_t n = 0;
        pd_error err = {0};
        cr_assert_eq(pd_tokenize(t, text, len, special, &ids, &n, &err), PD_OK, "%s", err.msg);
        cr_expect_eq(ids[0], pd_tokenizer_bos(t), "%s: BOS comes from add_special", name);
        cr_expect_eq(count_id(ids, n, open), cases[k].n_open, "%s", name);
        cr_expect_eq(count_id(ids, n, close), cases[k].n_close, "%s", name);
        /* the generation stops at the end of the model's turn, not at its opening */
        cr_expect(pd_tokenizer_is_eog(t, close), "%s: %s ends generation", name, cases[k].close);
        cr_expect_not(pd_tokenizer_is_eog(t, open), "%s: %s does not", name, cases[k].open);
        if (cases[k].f == PD_CHAT_QWEN3) {
            cr_expect_eq(count_id(ids, n, find_tok(t, "<think>")), 1, "the empty think block of the prompt");
            cr_expect_eq(count_id(ids, n, find_tok(t, "</think>")), 1);
            cr_expect_not(pd_tokenizer_is_eog(t, find_tok(t, "</think>")), "the answer follows </think>");
        }
        free(ids);
        free(text);
        pd_model_free(m);
    }
}

/* Phi-3 stops at <|end|> (its turn end) as well as at EOS <|endoftext|>. */
Test(chat, phi3_stop_tokens) {
    TH_REQUIRE_SHARED();
    pd_tokenizer *t = th_shared_tokenizer("vocab/ggml-vocab-phi-3.gguf");
    cr_expect(pd_tokenizer_is_eog(t, find_tok(t, "<|end|>")));
    cr_expect(pd_tokenizer_is_eog(t, find_tok(t, "<|endoftext|>")));
    cr_expect_eq(pd_tokenizer_eos(t), find_tok(t, "<|endoftext|>"));
    cr_expect_not(pd_tokenizer_is_eog(t, find_tok(t, "<|user|>")));
    cr_expect_not(pd_tokenizer_is_eog(t, find_tok(t, "<|assistant|>")));
    pd_tokenizer_free(t);
}

/* ---- tools: the format contract ------------------------------------------- */

/* The expected strings below are written by hand from the real templates:
 * Qwen2.5-7B-Instruct's and Qwen3-8B's tokenizer_config.json chat_template
 * (Hermes <tools>/<tool_call>/<tool_response>), Llama-3.1-8B-Instruct's
 * (JSON tool calling, tools_in_user_message=false, default date_string),
 * Mistral-7B-Instruct-v0.3's ([AVAILABLE_TOOLS], [TOOL_CALLS],
 * [TOOL_RESULTS], in the classic [INST] spacing prefixd renders), and
 * prefixd's generic block (the Hermes one) for the other families. */

/* The tool's parameters are compact on input: the templates' tojson
 * re-serializes them with ", " and ": ". */
static const pd_chat_tool weather_tool[] = {{
    .name = "get_weather",
    .description = "Get the weather in a city",
    .parameters = "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]}",
}};

#define TOOL_JSON                                                                                                   \
    "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get the weather in a "   \
    "city\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, "          \
    "\"required\": [\"city\"]}}}"

/* tojson(indent=4), as Llama 3.1 lists its tools */
#define TOOL_JSON_INDENT4                                                                                           \
    "{\n"                                                                                                           \
    "    \"type\": \"function\",\n"                                                                                 \
    "    \"function\": {\n"                                                                                         \
    "        \"name\": \"get_weather\",\n"                                                                          \
    "        \"description\": \"Get the weather in a city\",\n"                                                     \
    "        \"parameters\": {\n"                                                                                   \
    "            \"type\": \"object\",\n"                                                                           \
    "            \"properties\": {\n"                                                                               \
    "                \"city\": {\n"                                                                                 \
    "                    \"type\": \"string\"\n"                                                                    \
    "                }\n"                                                                                           \
    "            },\n"                                                                                              \
    "            \"required\": [\n"                                                                                 \
    "                \"city\"\n"                                                                                    \
    "            ]\n"                                                                                               \
    "        }\n"                                                                                                   \
    "    }\n"                                                                                                       \
    "}"

/* The Hermes tool block (Qwen2.5/Qwen3, and prefixd's generic form) */
#define HERMES_BLOCK                                                                                                \
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"                              \
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" TOOL_JSON              \
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "           \
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "                 \
    "<args-json-object>}\n</tool_call>"

#define LLAMA3_TOOLS_HEAD                                                                                           \
    "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"                      \
    "You have access to the following functions. To call a function, please respond with JSON for a function "     \
    "call.Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its "    \
    "value}.Do not use variables.\n\n" TOOL_JSON_INDENT4 "\n\n"

#define HERMES_CALL "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
#define HERMES_RESULT "<tool_response>\n{\"temp_c\": 21}\n</tool_response>"

static const pd_chat_tool_call paris_call[] = {
    {.id = "call_abc123", .name = "get_weather", .arguments = "{\"city\":\"Paris\"}"}};

/* system, user, an assistant turn that only calls, the tool's result */
static const pd_chat_message tool_conv[] = {
    {.role = "system", .content = "You are terse."},
    {.role = "user", .content = "Weather in Paris?"},
    {.role = "assistant", .content = "", .tool_calls = paris_call, .n_tool_calls = 1},
    {.role = "tool", .content = "{\"temp_c\": 21}", .tool_call_id = "call_abc123", .name = "get_weather"},
};

static const expected_render expected_tools[] = {
    {PD_CHAT_CHATML,
     "<|im_start|>system\nYou are terse.\n\n" HERMES_BLOCK "<|im_end|>\n"
     "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
     "<|im_start|>assistant\n" HERMES_CALL "<|im_end|>\n"
     "<|im_start|>user\n" HERMES_RESULT "<|im_end|>\n",
     "<|im_start|>assistant\n", "<|im_start|>system\nYou are terse.\n\n" HERMES_BLOCK "<|im_end|>\n"},
    {PD_CHAT_QWEN3, /* the call follows the last query and is not last: no think block */
     "<|im_start|>system\nYou are terse.\n\n" HERMES_BLOCK "<|im_end|>\n"
     "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
     "<|im_start|>assistant\n" HERMES_CALL "<|im_end|>\n"
     "<|im_start|>user\n" HERMES_RESULT "<|im_end|>\n",
     "<|im_start|>assistant\n<think>\n\n</think>\n\n",
     "<|im_start|>system\nYou are terse.\n\n" HERMES_BLOCK "<|im_end|>\n"},
    {PD_CHAT_LLAMA3,
     "<|start_header_id|>system<|end_header_id|>\n\n" LLAMA3_TOOLS_HEAD "You are terse.<|eot_id|>"
     "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
     "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"get_weather\", \"parameters\": {\"city\": "
     "\"Paris\"}}<|eot_id|>"
     "<|start_header_id|>ipython<|end_header_id|>\n\n{\"temp_c\": 21}<|eot_id|>",
     "<|start_header_id|>assistant<|end_header_id|>\n\n",
     "<|start_header_id|>system<|end_header_id|>\n\n" LLAMA3_TOOLS_HEAD "You are terse.<|eot_id|>"},
    {PD_CHAT_MISTRAL, /* the only user turn is the last: the tool list opens the text */
     "[AVAILABLE_TOOLS] [" TOOL_JSON "][/AVAILABLE_TOOLS][INST] You are terse.\nWeather in Paris? [/INST]"
     "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \"id\": \"call_abc123\"}]</s>"
     "[TOOL_RESULTS] {\"content\": {\"temp_c\": 21}, \"call_id\": \"call_abc123\"}[/TOOL_RESULTS]",
     "", "[AVAILABLE_TOOLS] [" TOOL_JSON "][/AVAILABLE_TOOLS][INST] You are terse.\n"},
    {PD_CHAT_LLAMA2,
     "[INST] <<SYS>>\nYou are terse.\n\n" HERMES_BLOCK "\n<</SYS>>\n\nWeather in Paris? [/INST]" HERMES_CALL
     "</s><s>[INST] " HERMES_RESULT " [/INST]",
     "", "[INST] <<SYS>>\nYou are terse.\n\n" HERMES_BLOCK "\n<</SYS>>\n\n"},
    {PD_CHAT_ZEPHYR,
     "<|system|>\nYou are terse.\n\n" HERMES_BLOCK "</s>\n"
     "<|user|>\nWeather in Paris?</s>\n"
     "<|assistant|>\n" HERMES_CALL "</s>\n"
     "<|user|>\n" HERMES_RESULT "</s>\n",
     "<|assistant|>\n", "<|system|>\nYou are terse.\n\n" HERMES_BLOCK "</s>\n"},
    {PD_CHAT_PHI3,
     "<|system|>\nYou are terse.\n\n" HERMES_BLOCK "<|end|>\n"
     "<|user|>\nWeather in Paris?<|end|>\n"
     "<|assistant|>\n" HERMES_CALL "<|end|>\n"
     "<|user|>\n" HERMES_RESULT "<|end|>\n",
     "<|assistant|>\n", "<|system|>\nYou are terse.\n\n" HERMES_BLOCK "<|end|>\n"},
    {PD_CHAT_GEMMA,
     "<start_of_turn>user\nYou are terse.\n\n" HERMES_BLOCK "\n\nWeather in Paris?<end_of_turn>\n"
     "<start_of_turn>model\n" HERMES_CALL "<end_of_turn>\n"
     "<start_of_turn>user\n" HERMES_RESULT "<end_of_turn>\n",
     "<start_of_turn>model\n", "<start_of_turn>user\nYou are terse.\n\n" HERMES_BLOCK "\n\n"},
};

static char *render_tools(pd_chat_family f, const pd_chat_message *m, size_t n, const pd_chat_tool *tools,
                          size_t n_tools, bool gen, size_t *sys_len) {
    char *out = NULL;
    pd_error err = {0};
    size_t l = 0, s = 0;
    int rc = pd_chat_render_tools(f, m, n, tools, n_tools, gen, &out, &l, &s, &err);
    cr_assert_eq(rc, PD_OK, "%s: %s", pd_chat_family_name(f), err.msg);
    cr_assert_not_null(out);
    cr_assert_eq(strlen(out), l, "%s: length matches the NUL-terminated text", pd_chat_family_name(f));
    if (sys_len) *sys_len = s;
    return out;
}

static char *concat(const char *a, const char *b) {
    size_t na = strlen(a), nb = strlen(b);
    char *s = malloc(na + nb + 1);
    cr_assert_not_null(s);
    memcpy(s, a, na);
    memcpy(s + na, b, nb + 1);
    return s;
}

Test(chat, tools_render_every_family_exactly) {
    cr_assert_eq(sizeof expected_tools / sizeof expected_tools[0], PD_CHAT_FAMILY_COUNT - 1, "every family");
    for (size_t k = 0; k < sizeof expected_tools / sizeof expected_tools[0]; k++) {
        const expected_render *e = &expected_tools[k];
        const char *name = pd_chat_family_name(e->f);
        size_t sys = 0;
        char *got = render_tools(e->f, tool_conv, 4, weather_tool, 1, false, &sys);
        cr_expect_str_eq(got, e->text, "%s without generation prompt", name);
        cr_expect_eq(sys, strlen(e->prefix), "%s: system_len covers the system text and its tools", name);
        cr_expect(strncmp(got, e->prefix, strlen(e->prefix)) == 0, "%s: the prefix leads the text", name);
        free(got);

        char *want = concat(e->text, e->gen);
        got = render_tools(e->f, tool_conv, 4, weather_tool, 1, true, &sys);
        cr_expect_str_eq(got, want, "%s with generation prompt", name);
        cr_expect_eq(sys, strlen(e->prefix), "%s", name);
        free(got);
        free(want);

        /* The system message with its tools alone is that prefix: a system
         * prompt with a tool list can be registered and found again. */
        got = render_tools(e->f, tool_conv, 1, weather_tool, 1, false, &sys);
        cr_expect_str_eq(got, e->prefix, "%s: system + tools alone render to the prefix", name);
        cr_expect_eq(sys, strlen(got), "%s", name);
        free(got);
    }
}

/* Without tools, pd_chat_render_tools is pd_chat_render, and the tool turns
 * of a conversation still render the family's way. */
Test(chat, tools_none_offered) {
    for (int f = 1; f < PD_CHAT_FAMILY_COUNT; f++) {
        size_t sys_a = 0, sys_b = 0, len = 0;
        char *a = render((pd_chat_family)f, conv4, 4, true, &len, &sys_a);
        char *b = render_tools((pd_chat_family)f, conv4, 4, NULL, 0, true, &sys_b);
        cr_expect_str_eq(a, b, "%s", pd_chat_family_name((pd_chat_family)f));
        cr_expect_eq(sys_a, sys_b);
        free(a);
        free(b);
    }
    char *got = render(PD_CHAT_CHATML, tool_conv + 1, 3, true, NULL, NULL);
    cr_expect_str_eq(got, "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                          "<|im_start|>assistant\n" HERMES_CALL "<|im_end|>\n"
                          "<|im_start|>user\n" HERMES_RESULT "<|im_end|>\n"
                          "<|im_start|>assistant\n");
    free(got);
    got = render(PD_CHAT_MISTRAL, tool_conv + 1, 3, false, NULL, NULL);
    cr_expect_str_eq(got, "[INST] Weather in Paris? [/INST]"
                          "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \"id\": "
                          "\"call_abc123\"}]</s>"
                          "[TOOL_RESULTS] {\"content\": {\"temp_c\": 21}, \"call_id\": \"call_abc123\"}[/TOOL_RESULTS]");
    free(got);
}

/* No system message: Qwen3's layout (the block alone in a system turn; no
 * Qwen2.5 default "You are Qwen..." text), a system turn / first user turn
 * made for the others. */
Test(chat, tools_without_system_message) {
    size_t sys = 0;
    char *got = render_tools(PD_CHAT_CHATML, tool_conv + 1, 1, weather_tool, 1, true, &sys);
    static const char chatml_sys[] = "<|im_start|>system\n" HERMES_BLOCK "<|im_end|>\n";
    cr_expect_str_eq(got, "<|im_start|>system\n" HERMES_BLOCK "<|im_end|>\n"
                          "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n");
    cr_expect_eq(sys, strlen(chatml_sys));
    free(got);

    got = render_tools(PD_CHAT_LLAMA3, tool_conv + 1, 1, weather_tool, 1, false, &sys);
    static const char llama3_sys[] = "<|start_header_id|>system<|end_header_id|>\n\n" LLAMA3_TOOLS_HEAD "<|eot_id|>";
    cr_expect_str_eq(got, "<|start_header_id|>system<|end_header_id|>\n\n" LLAMA3_TOOLS_HEAD "<|eot_id|>"
                          "<|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>");
    cr_expect_eq(sys, strlen(llama3_sys), "the block keeps its trailing blank line (not trimmed)");
    free(got);

    got = render_tools(PD_CHAT_GEMMA, tool_conv + 1, 1, weather_tool, 1, true, &sys);
    cr_expect_str_eq(got, "<start_of_turn>user\n" HERMES_BLOCK "\n\nWeather in Paris?<end_of_turn>\n"
                          "<start_of_turn>model\n");
    cr_expect_eq(sys, strlen("<start_of_turn>user\n" HERMES_BLOCK "\n\n"));
    free(got);

    got = render_tools(PD_CHAT_MISTRAL, tool_conv + 1, 1, weather_tool, 1, false, &sys);
    cr_expect_str_eq(got, "[AVAILABLE_TOOLS] [" TOOL_JSON "][/AVAILABLE_TOOLS][INST] Weather in Paris? [/INST]");
    cr_expect_eq(sys, strlen("[AVAILABLE_TOOLS] [" TOOL_JSON "][/AVAILABLE_TOOLS]"));
    free(got);
}

/* Mistral puts its list before the last user turn, so in a longer
 * conversation the system prefix is the one without tools. */
Test(chat, tools_mistral_before_last_user_turn) {
    size_t sys = 0;
    char *got = render_tools(PD_CHAT_MISTRAL, conv4, 4, weather_tool, 1, false, &sys);
    cr_expect_str_eq(got, "[INST] You are terse.\nHello [/INST]Hi there</s>"
                          "[AVAILABLE_TOOLS] [" TOOL_JSON "][/AVAILABLE_TOOLS][INST] Who are you? [/INST]");
    cr_expect_eq(sys, strlen("[INST] You are terse.\n"));
    free(got);
}

/* Qwen writes text before the calls, parallel calls one block each, and
 * consecutive results in one user turn; Mistral lists parallel calls in
 * one array and keeps each result in its own [TOOL_RESULTS]. */
Test(chat, tools_parallel_calls_and_results) {
    static const pd_chat_tool_call two[] = {
        {.id = "aaaaaaaaa", .name = "get_weather", .arguments = "{\"city\": \"Paris\"}"},
        {.id = "bbbbbbbbb", .name = "get_weather", .arguments = "{\"city\": \"Oslo\"}"},
    };
    static const pd_chat_message m[] = {
        {.role = "user", .content = "Paris and Oslo?"},
        {.role = "assistant", .content = "Checking.", .tool_calls = two, .n_tool_calls = 2},
        {.role = "tool", .content = "21", .tool_call_id = "aaaaaaaaa"},
        {.role = "tool", .content = "9", .tool_call_id = "bbbbbbbbb"},
        {.role = "assistant", .content = "Paris 21, Oslo 9."},
    };
    char *got = render_tools(PD_CHAT_CHATML, m, 5, NULL, 0, false, NULL);
    cr_expect_str_eq(got,
                     "<|im_start|>user\nParis and Oslo?<|im_end|>\n"
                     "<|im_start|>assistant\nChecking.\n"
                     "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
                     "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"
                     "<|im_end|>\n"
                     "<|im_start|>user\n<tool_response>\n21\n</tool_response>\n<tool_response>\n9\n</tool_response>"
                     "<|im_end|>\n"
                     "<|im_start|>assistant\nParis 21, Oslo 9.<|im_end|>\n");
    free(got);
    got = render_tools(PD_CHAT_MISTRAL, m, 5, NULL, 0, false, NULL);
    cr_expect_str_eq(got, "[INST] Paris and Oslo? [/INST]"
                          "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \"id\": "
                          "\"aaaaaaaaa\"}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}, \"id\": "
                          "\"bbbbbbbbb\"}]</s>"
                          "[TOOL_RESULTS] {\"content\": 21, \"call_id\": \"aaaaaaaaa\"}[/TOOL_RESULTS]"
                          "[TOOL_RESULTS] {\"content\": 9, \"call_id\": \"bbbbbbbbb\"}[/TOOL_RESULTS]"
                          "Paris 21, Oslo 9.</s>");
    free(got);
    /* Qwen3: the tool results are not a new query, so the final answer
     * (after the last query, and last) gets its empty think block */
    got = render_tools(PD_CHAT_QWEN3, m, 5, NULL, 0, false, NULL);
    cr_expect(strstr(got, "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
                          "Paris 21, Oslo 9.<|im_end|>\n") != NULL,
              "%s", got);
    free(got);
}

/* The rendered call is exactly what pd_chat_tool_syntax_of says the model
 * writes, so the parser reads back what the prompt shows. */
Test(chat, tools_syntax_matches_rendered_calls) {
    for (int f = 1; f < PD_CHAT_FAMILY_COUNT; f++) {
        pd_chat_tool_syntax syn = {0};
        pd_chat_tool_syntax_of((pd_chat_family)f, &syn);
        cr_assert(syn.open && syn.close && syn.sep && syn.args_key);
        char call[256];
        snprintf(call, sizeof call, "%s{\"name\": \"get_weather\", \"%s\": {\"city\": \"Paris\"}%s}%s", syn.open,
                 syn.args_key, f == PD_CHAT_MISTRAL ? ", \"id\": \"call_abc123\"" : "", syn.close);
        char *got = render_tools((pd_chat_family)f, tool_conv + 1, 2, NULL, 0, false, NULL);
        cr_expect(strstr(got, call) != NULL, "%s: %s not in %s", pd_chat_family_name((pd_chat_family)f), call, got);
        free(got);
    }
    pd_chat_tool_syntax syn;
    pd_chat_tool_syntax_of(PD_CHAT_LLAMA3, &syn);
    cr_expect_not(syn.parallel);
    cr_expect_str_eq(syn.args_key, "parameters");
    pd_chat_tool_syntax_of(PD_CHAT_MISTRAL, &syn);
    cr_expect(syn.json_list && syn.parallel);
    cr_expect_str_eq(syn.open, "[TOOL_CALLS] [");
    cr_expect_str_eq(syn.sep, ", ");
    pd_chat_tool_syntax_of(PD_CHAT_PHI3, &syn);
    cr_expect(!syn.json_list && syn.parallel);
    cr_expect_str_eq(syn.open, "<tool_call>\n");
    cr_expect_str_eq(syn.close, "\n</tool_call>");
    pd_chat_tool_syntax_of(PD_CHAT_NONE, &syn); /* every family has one */
    cr_expect_str_eq(syn.open, "<tool_call>\n");
    pd_chat_tool_syntax_of(PD_CHAT_CHATML, NULL); /* ignored */
}

/* Arguments are re-serialized as Python's json.dumps (the templates'
 * tojson) writes them; the expected strings are what CPython 3 prints. */
Test(chat, tools_json_as_python_writes_it) {
    static const pd_chat_tool_call c[] = {{
        .name = "f",
        .arguments = "{\"b\":1,\"a\":[],\"c\":{},\"d\":\"\xc3\xa9\\\"\\\\\\n\\u0001/\",\"e\":0.1,\"f\":1e16,"
                     "\"g\":1.5e-5,\"h\":-0.0,\"i\":1e2,\"j\":true,\"k\":null,\"l\":12345678901234,"
                     "\"m\":[1,{\"x\":[]}],\"n\":123456789.125,\"o\":1e-4,\"p\":3.0e15,\"b\":2}",
    }};
    static const pd_chat_message m[] = {{.role = "assistant", .content = "", .tool_calls = c, .n_tool_calls = 1}};
    char *got = render_tools(PD_CHAT_LLAMA3, m, 1, NULL, 0, false, NULL);
    /* key order kept (a repeated key keeps its place and takes the last
     * value, as a Python dict); UTF-8 as is; floats in repr form */
    cr_expect_str_eq(got, "<|start_header_id|>assistant<|end_header_id|>\n\n"
                          "{\"name\": \"f\", \"parameters\": {\"b\": 2, \"a\": [], \"c\": {}, "
                          "\"d\": \"\xc3\xa9\\\"\\\\\\n\\u0001/\", \"e\": 0.1, \"f\": 1e+16, \"g\": 1.5e-05, "
                          "\"h\": -0.0, \"i\": 100.0, \"j\": true, \"k\": null, \"l\": 12345678901234, "
                          "\"m\": [1, {\"x\": []}], \"n\": 123456789.125, \"o\": 0.0001, "
                          "\"p\": 3000000000000000.0}}<|eot_id|>");
    free(got);

    /* indent=4 with empty containers and nesting, as json.dumps(indent=4) */
    static const pd_chat_tool t[] = {{.name = "g", .parameters = "{\"a\":[],\"b\":{},\"m\":[1,{\"x\":[2]}]}"}};
    static const pd_chat_message u[] = {{.role = "user", .content = "go"}};
    got = render_tools(PD_CHAT_LLAMA3, u, 1, t, 1, false, NULL);
    cr_expect(strstr(got, "{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"g\",\n"
                          "        \"parameters\": {\n            \"a\": [],\n            \"b\": {},\n"
                          "            \"m\": [\n                1,\n                {\n"
                          "                    \"x\": [\n                        2\n                    ]\n"
                          "                }\n            ]\n        }\n    }\n}\n\n<|eot_id|>") != NULL,
              "%s", got);
    free(got);
}

Test(chat, tools_errors) {
    pd_error err = {0};
    char *out = NULL;
    size_t len = 1, sys = 1;
    static const pd_chat_message user[] = {{.role = "user", .content = "hi"}};

    static const pd_chat_tool unnamed[] = {{.name = "ok"}, {.name = "", .description = "x"}};
    cr_expect_eq(pd_chat_render_tools(PD_CHAT_CHATML, user, 1, unnamed, 2, true, &out, &len, &sys, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "tools[1]") && strstr(err.msg, "name"), "%s", err.msg);
    cr_expect_null(out);
    cr_expect_eq(len, 0);
    cr_expect_eq(sys, 0);

    static const pd_chat_tool bad_schema[] = {{.name = "f", .parameters = "[\"not\", \"an object\"]"}};
    cr_expect_eq(pd_chat_render_tools(PD_CHAT_PHI3, user, 1, bad_schema, 1, true, &out, &len, &sys, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "tools[0]") && strstr(err.msg, "parameters") && strstr(err.msg, "not an object"), "%s",
              err.msg);
    cr_expect_eq(pd_chat_render_tools(PD_CHAT_PHI3, user, 1, NULL, 1, true, &out, &len, &sys, &err), PD_EINVAL);

    /* not an object, not JSON, empty, cut short, an integer beyond 64 bits */
    static const char *const bad_args[] = {"[1]", "nope", "", "{\"a\": 1", "{\"n\": 123456789012345678901234567890}"};
    for (size_t k = 0; k < sizeof bad_args / sizeof bad_args[0]; k++) {
        const pd_chat_tool_call c[] = {{.name = "f", .arguments = "{}"}, {.name = "g", .arguments = bad_args[k]}};
        const pd_chat_message m[] = {{.role = "user", .content = "hi"},
                                     {.role = "assistant", .content = "", .tool_calls = c, .n_tool_calls = 2}};
        cr_expect_eq(pd_chat_render(PD_CHAT_QWEN3, m, 2, true, &out, &len, &sys, &err), PD_EINVAL, "%s", bad_args[k]);
        cr_expect(strstr(err.msg, "message 1") && strstr(err.msg, "tool_calls[1]") && strstr(err.msg, "arguments"),
                  "%s", err.msg);
        cr_expect_null(out);
    }

    static const pd_chat_tool_call nameless[] = {{.name = NULL, .arguments = "{}"}};
    static const pd_chat_message m1[] = {{.role = "assistant", .content = "", .tool_calls = nameless, .n_tool_calls = 1}};
    cr_expect_eq(pd_chat_render(PD_CHAT_GEMMA, m1, 1, true, &out, &len, &sys, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "message 0") && strstr(err.msg, "tool_calls[0]") && strstr(err.msg, "name"), "%s",
              err.msg);

    static const pd_chat_message on_user[] = {{.role = "user", .content = "", .tool_calls = paris_call, .n_tool_calls = 1}};
    cr_expect_eq(pd_chat_render(PD_CHAT_CHATML, on_user, 1, true, &out, &len, &sys, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "message 0") && strstr(err.msg, "assistant"), "%s", err.msg);

    /* Llama 3's template writes one call per turn */
    static const pd_chat_tool_call two[] = {{.name = "f", .arguments = "{}"}, {.name = "g", .arguments = "{}"}};
    static const pd_chat_message m2[] = {{.role = "user", .content = "hi"},
                                         {.role = "assistant", .content = "", .tool_calls = two, .n_tool_calls = 2}};
    cr_expect_eq(pd_chat_render(PD_CHAT_LLAMA3, m2, 2, true, &out, &len, &sys, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "message 1") && strstr(err.msg, "llama3"), "%s", err.msg);
    cr_expect_eq(pd_chat_render(PD_CHAT_CHATML, m2, 2, true, &out, &len, &sys, &err), PD_OK, "%s", err.msg);
    free(out);
    out = NULL;

    /* a result with no call before it, and NULL arguments (no arguments),
     * are accepted */
    static const pd_chat_tool_call noargs[] = {{.name = "now", .arguments = NULL}};
    static const pd_chat_message loose[] = {{.role = "tool", .content = "42"},
                                            {.role = "assistant", .content = "", .tool_calls = noargs, .n_tool_calls = 1}};
    cr_expect_eq(pd_chat_render(PD_CHAT_PHI3, loose, 2, false, &out, &len, &sys, &err), PD_OK, "%s", err.msg);
    cr_expect_str_eq(out, "<|user|>\n<tool_response>\n42\n</tool_response><|end|>\n"
                          "<|assistant|>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call><|end|>\n");
    free(out);
}
