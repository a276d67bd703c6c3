/* prefixctl end to end: the real binary, real files, real pipes. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"

static const char *prefixctl(void) {
    const char *p = getenv("PD_PREFIXCTL");
    cr_assert(p, "PD_PREFIXCTL is not set");
    return p;
}

static int run(char **out, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int run(char **out, const char *fmt, ...) {
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    return th_run(cmd, out);
}

Test(cli, usage_errors_exit_2) {
    char *out = NULL;
    cr_assert_eq(run(&out, "%s 2>&1", prefixctl()), 2);
    cr_assert(strstr(out, "usage"));
    free(out);
    cr_assert_eq(run(&out, "%s frobnicate 2>&1", prefixctl()), 2);
    cr_assert(strstr(out, "unknown command 'frobnicate'"), "%s", out);
    free(out);
    cr_assert_eq(run(&out, "echo hi | %s tokenize 2>&1", prefixctl()), 2);
    cr_assert(strstr(out, "--model FILE is required"), "%s", out);
    free(out);
}

Test(cli, missing_or_bad_model_is_explained) {
    char *out = NULL;
    cr_assert_eq(run(&out, "echo hi | %s tokenize --model /nonexistent.gguf 2>&1", prefixctl()), 1);
    cr_assert(strstr(out, "/nonexistent.gguf"), "%s", out);
    free(out);
    char *dir = th_mkdtemp();
    cr_assert(dir);
    cr_assert_eq(run(&out, "printf 'GGUF\\003\\000\\000\\000' > %s/bad.gguf && %s inspect %s/bad.gguf 2>&1", dir,
                     prefixctl(), dir),
                 1);
    cr_assert(strstr(out, "truncated"), "%s", out);
    free(out);
    th_rmtree(dir);
    free(dir);
}

Test(cli, gen_model_then_inspect_tokenize_detokenize) {
    char *dir = th_mkdtemp();
    cr_assert(dir);
    char *out = NULL;
    cr_assert_eq(run(&out, "%s gen-model --preset tiny --seed 3 -o %s/m.gguf 2>&1", prefixctl(), dir), 0, "%s", out);
    free(out);
    cr_assert_eq(run(&out, "%s inspect %s/m.gguf", prefixctl(), dir), 0);
    cr_assert(strstr(out, "general.architecture"), "%s", out);
    cr_assert(strstr(out, "blk.0.attn_q.weight"), "%s", out);
    cr_assert(strstr(out, "fingerprint "), "%s", out);
    free(out);
    cr_assert_eq(run(&out, "printf 'hello world' | %s tokenize --model %s/m.gguf | %s detokenize --model %s/m.gguf",
                     prefixctl(), dir, prefixctl(), dir),
                 0);
    cr_assert_str_eq(out, "hello world");
    free(out);
    th_rmtree(dir);
    free(dir);
}

/* The reference greedy continuation of stories260K (MANIFEST.md section 1). */
static const char *const reference_ids =
    "403 407 261 378 432 383 286 261 376 298 315 421 395 317 426 338 401 396 267 337 410 408 419 292 411 322 265 "
    "282 295 433 426 385 328 432 358 394 261 370 432 352 266 268 388 426 338 391 266 267 337 335 312 432 398 312 "
    "286 267 414 270 333 415 426 13 438 310";
static const char *const reference_text =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, she saw "
    "a big, red ball. She wanted to play with it, but it was too high.\nLily";

Test(cli, stories260k_reference_text) {
    TH_REQUIRE_SHARED();
    char model[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    char *out = NULL;
    cr_assert_eq(run(&out, "echo '%s' | %s detokenize --model %s", reference_ids, prefixctl(), model), 0);
    cr_assert_str_eq(out, reference_text);
    free(out);
    /* BOS first, then ids that decode back to the same text. */
    char *dir = th_mkdtemp();
    char path[1100];
    snprintf(path, sizeof path, "%s/ref.txt", dir);
    FILE *f = fopen(path, "w");
    fputs(reference_text, f);
    fclose(f);
    cr_assert_eq(run(&out, "%s tokenize --model %s < %s", prefixctl(), model, path), 0);
    cr_assert(strncmp(out, "1 ", 2) == 0, "BOS (1) should come first: %s", out);
    free(out);
    cr_assert_eq(run(&out, "%s tokenize --model %s --no-bos < %s | %s detokenize --model %s", prefixctl(), model, path,
                     prefixctl(), model),
                 0);
    cr_assert_str_eq(out, reference_text);
    free(out);
    th_rmtree(dir);
    free(dir);
}

Test(cli, detokenize_rejects_garbage_ids) {
    TH_REQUIRE_SHARED();
    char model[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    char *out = NULL;
    cr_assert_eq(run(&out, "echo '5 x7' | %s detokenize --model %s 2>&1", prefixctl(), model), 1);
    cr_assert(strstr(out, "not a token id"), "%s", out);
    free(out);
    cr_assert_eq(run(&out, "echo '5 99999' | %s detokenize --model %s 2>&1", prefixctl(), model), 1);
    cr_assert(strstr(out, "99999"), "%s", out);
    free(out);
}

Test(cli, generate_greedy_reproduces_reference) {
    TH_REQUIRE_SHARED();
    char model[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    char *out = NULL;
    cr_assert_eq(run(&out, "%s generate --model %s --prompt '' -n 64 --ids --threads 1 2>/dev/null", prefixctl(), model),
                 0);
    char want[512];
    snprintf(want, sizeof want, "%s\n", reference_ids);
    cr_assert_str_eq(out, want);
    free(out);
    cr_assert_eq(run(&out, "%s generate --model %s --prompt '' -n 64 2>&1 >/dev/null", prefixctl(), model), 0);
    cr_assert(strstr(out, "tok/s") && strstr(out, "finish: length"), "speed report on stderr: %s", out);
    free(out);
    /* Text output stops before a stop string. */
    cr_assert_eq(run(&out, "%s generate --model %s --prompt '' -n 64 --stop ' named' 2>/dev/null", prefixctl(), model),
                 0);
    cr_assert_str_eq(out, " Once upon a time, there was a little girl\n");
    free(out);
}

Test(cli, generate_sampling_is_seeded) {
    TH_REQUIRE_SHARED();
    char model[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    char *a = NULL, *b = NULL, *c = NULL;
    const char *fmt = "%s generate --model %s --prompt 'Once upon' -n 24 --temp 1.0 --seed %d --ids 2>/dev/null";
    cr_assert_eq(run(&a, fmt, prefixctl(), model, 7), 0);
    cr_assert_eq(run(&b, fmt, prefixctl(), model, 7), 0);
    cr_assert_eq(run(&c, fmt, prefixctl(), model, 8), 0);
    cr_assert_str_eq(a, b, "same seed, same tokens");
    cr_assert_str_neq(a, c, "another seed, other tokens");
    free(a), free(b), free(c);
    cr_assert_eq(run(&a, "%s generate --model %s --prompt x --temp -1 2>&1", prefixctl(), model), 1);
    cr_assert(strstr(a, "temperature"), "%s", a);
    free(a);
}

Test(cli, nll_of_likely_text_is_lower) {
    TH_REQUIRE_SHARED();
    char model[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    char *likely = NULL, *unlikely = NULL;
    cr_assert_eq(run(&likely, "%s nll --model %s --context 'Once upon a time, there was a little girl' "
                              "--text 'named Lily. She loved to play outside in the park.' 2>/dev/null",
                     prefixctl(), model),
                 0);
    cr_assert_eq(run(&unlikely, "%s nll --model %s --context 'Once upon a time, there was a little girl' "
                                "--text 'quantum chromodynamics of the electroweak vacuum' 2>/dev/null",
                     prefixctl(), model),
                 0);
    double l = atof(likely), u = atof(unlikely);
    cr_assert(l > 0 && u > 0, "%s / %s", likely, unlikely);
    cr_assert_lt(l, u, "story text should be likelier than physics: %g vs %g", l, u);
    free(likely), free(unlikely);
}

/* ---- the admin client without a daemon, and progress lines ---------------------- */

/* Nothing listens on a port th_free_port just returned: connecting is
 * refused, over http and https alike, with a message that names the URL
 * and what to check, and exit status 1. */
Test(cli, prefix_connection_refused_is_explained) {
    const int port = th_free_port();
    const char *const schemes[] = {"http", "https"};
    for (int i = 0; i < 2; i++) {
        char *out = NULL;
        cr_assert_eq(run(&out, "%s prefix --url %s://127.0.0.1:%d --token t list 2>&1", prefixctl(), schemes[i], port),
                     1, "%s", out);
        char want[96];
        snprintf(want, sizeof want, "cannot connect to %s://127.0.0.1:%d", schemes[i], port);
        cr_assert(strstr(out, want), "%s", out);
        cr_assert(strstr(out, "is prefixd running"), "%s", out);
        free(out);
    }
    /* Bad URLs are usage errors (2), before any connection. */
    char *out = NULL;
    cr_assert_eq(run(&out, "%s prefix --url ftp://127.0.0.1:%d --token t list 2>&1", prefixctl(), port), 2);
    cr_assert(strstr(out, "only http:// and https://"), "%s", out);
    free(out);
    cr_assert_eq(run(&out, "%s prefix --url http://127.0.0.1:%d/admin --token t list 2>&1", prefixctl(), port), 2);
    cr_assert(strstr(out, "not a path"), "%s", out);
    free(out);
    /* No scheme means http (prefixd's listeners), not libcurl's https. */
    cr_assert_eq(run(&out, "%s prefix --url 127.0.0.1:%d --token t list 2>&1", prefixctl(), port), 1);
    char want[64];
    snprintf(want, sizeof want, "http://127.0.0.1:%d", port);
    cr_assert(strstr(out, want), "%s", out);
    free(out);
}

/* stderr not a terminal: gen-model names each phase once, on its own line;
 * stdout keeps only the summary. */
Test(cli, gen_model_phase_lines) {
    char *dir = th_mkdtemp();
    cr_assert(dir);
    char *out = NULL;
    cr_assert_eq(run(&out, "%s gen-model --preset tiny -o %s/m.gguf 2>%s/err >%s/out", prefixctl(), dir, dir, dir), 0);
    free(out);
    cr_assert_eq(run(&out, "cat %s/err", dir), 0);
    cr_assert_str_eq(out, "building vocabulary\nwriting tensors\n");
    free(out);
    cr_assert_eq(run(&out, "cat %s/out", dir), 0);
    cr_assert(strncmp(out, "wrote ", 6) == 0 && !strchr(out, '\r'), "%s", out);
    free(out);
    /* --quiet: neither. */
    cr_assert_eq(run(&out, "%s gen-model --preset tiny -q -o %s/m.gguf 2>&1", prefixctl(), dir), 0);
    cr_assert_str_eq(out, "");
    free(out);
    th_rmtree(dir);
    free(dir);
}

/* compress --json --quality: stdout is one JSON document, the phases go to
 * stderr, one line each, in order. */
Test(cli, compress_json_stdout_and_phase_lines) {
    TH_REQUIRE_SHARED();
    char model[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", model, sizeof model));
    char *dir = th_mkdtemp();
    cr_assert(dir);
    char path[1100];
    snprintf(path, sizeof path, "%s/t.txt", dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    for (int i = 0; i < 3; i++) fputs(reference_text, f);
    fclose(f);
    char *out = NULL;
    cr_assert_eq(run(&out, "%s compress --model %s --policy snapkv --quality 1.1 --text %s --eval %s --json 2>%s/err",
                     prefixctl(), model, path, path, dir),
                 0, "%s", out);
    json_error_t je;
    json_t *j = json_loads(out, 0, &je);
    cr_assert_not_null(j, "stdout is not one JSON document (%s): %s", je.text, out);
    cr_assert(json_is_object(json_object_get(j, "calibration")), "%s", out);
    json_decref(j);
    free(out);
    cr_assert_eq(run(&out, "cat %s/err", dir), 0);
    cr_assert_str_eq(out, "loading model\ncalibrating\ncompressing\nevaluating\n");
    free(out);
    th_rmtree(dir);
    free(dir);
}
