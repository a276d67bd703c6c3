/* libFuzzer target: the GGUF reader and the tokenizer loader on arbitrary
 * bytes. Anything either accepts is walked end to end, and an accepted
 * vocabulary tokenizes and detokenizes a fixed string. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void exercise_tokenizer(const pd_gguf *g) {
    pd_tokenizer *tok = NULL;
    pd_error err;
    if (pd_tokenizer_load(g, &tok, &err) != PD_OK) return;
    static const char text[] = "Hello world! <s> 3.14 \xe2\x96\x81 caf\xc3\xa9 \xf0\x9f\x98\x81";
    pd_tokenize_opts opts = {.add_special = true, .parse_special = true};
    pd_token *ids = NULL;
    size_t n = 0;
    if (pd_tokenize(tok, text, sizeof text - 1, opts, &ids, &n, &err) == PD_OK) {
        char *out = NULL;
        size_t len = 0;
        if (pd_detokenize(tok, ids, n, true, true, &out, &len, &err) == PD_OK) free(out);
        free(ids);
    }
    pd_tokenizer_free(tok);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* A private copy of exactly `size` bytes so ASan catches any over-read. */
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy) return 0;
    if (size) memcpy(copy, data, size);
    pd_gguf *g = NULL;
    pd_error err;
    if (pd_gguf_open_memory(copy, size, &g, &err) == PD_OK) {
        static FILE *sink;
        if (!sink) sink = fopen("/dev/null", "w");
        pd_gguf_print(g, sink, 64);
        for (size_t i = 0; i < pd_gguf_tensor_count(g); i++) {
            const pd_gguf_tensor *t = pd_gguf_tensor_at(g, i);
            volatile uint8_t acc = 0;
            if (t->n_bytes) acc ^= t->data[0] ^ t->data[t->n_bytes - 1];
            (void)acc;
        }
        exercise_tokenizer(g);
        pd_gguf_close(g);
    }
    free(copy);
    return 0;
}
