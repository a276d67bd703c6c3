/* libFuzzer target: pd_tokenize / pd_detokenize on arbitrary text (request
 * bodies are untrusted). Vocabularies: the generated tiny model's, plus every
 * vocab GGUF under $PD_SHARED_MODELS/vocab when that folder exists. The first
 * input byte picks the vocabulary and the options; the rest is the text. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_VOCABS 32
static pd_tokenizer *vocabs[MAX_VOCABS];
static int n_vocabs;

static void load(const char *path) {
    pd_gguf *g = NULL;
    pd_error err;
    if (n_vocabs == MAX_VOCABS || pd_gguf_open(path, &g, &err) != PD_OK) return;
    if (pd_tokenizer_load(g, &vocabs[n_vocabs], &err) == PD_OK) n_vocabs++;
    else fprintf(stderr, "fuzz_tokenize: skipping %s: %s\n", path, err.msg);
    pd_gguf_close(g);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    const char *gen = getenv("PD_FUZZ_MODEL");
    if (gen) load(gen);
    const char *shared = getenv("PD_SHARED_MODELS");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/vocab", shared ? shared : "../shared/models");
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            size_t n = strlen(e->d_name);
            if (n < 5 || strcmp(e->d_name + n - 5, ".gguf") != 0) continue;
            char path[8192];
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            load(path);
        }
        closedir(d);
    }
    fprintf(stderr, "fuzz_tokenize: %d vocabularies loaded\n", n_vocabs);
    if (n_vocabs == 0) abort(); /* nothing to fuzz: a setup error, not a finding */
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const pd_tokenizer *tok = vocabs[data[0] % n_vocabs];
    pd_tokenize_opts opts = {.add_special = (data[0] >> 5) & 1, .parse_special = (data[0] >> 6) & 1};
    bool special = data[0] >> 7;
    /* A private copy of exactly the text, so ASan sees any over-read. */
    size_t len = size - 1;
    char *text = malloc(len ? len : 1);
    if (!text) return 0;
    memcpy(text, data + 1, len);
    pd_token *ids = NULL;
    size_t n = 0;
    pd_error err;
    if (pd_tokenize(tok, text, len, opts, &ids, &n, &err) == PD_OK) {
        int32_t n_vocab = pd_tokenizer_n_vocab(tok);
        for (size_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= n_vocab) abort();
        char *out = NULL;
        size_t out_len = 0;
        if (pd_detokenize(tok, ids, n, special, true, &out, &out_len, &err) == PD_OK) free(out);
        char piece[64];
        for (size_t i = 0; i < n; i++) (void)pd_token_to_piece(tok, ids[i], special, piece, sizeof piece);
        free(ids);
    }
    free(text);
    return 0;
}
