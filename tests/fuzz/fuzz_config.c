/* libFuzzer target: config files and --set assignments. Whatever loads must
 * print to text that loads back to the same config. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    pd_config c, back;
    pd_error err;
    pd_config_defaults(&c);
    if (pd_config_load_string(&c, text, "fuzz", &err) == PD_OK) {
        char *out = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&out, &len);
        if (!f) abort();
        pd_config_print(&c, f, &err);
        fclose(f);
        pd_config_defaults(&back);
        if (pd_config_load_string(&back, out, "printed", &err) != PD_OK || !pd_config_equal(&c, &back)) {
            fprintf(stderr, "round trip failed: %s\n%s\n", err.msg, out);
            abort();
        }
        free(out);
    }
    pd_config_defaults(&c);
    pd_config_set(&c, text, &err);
    free(text);
    return 0;
}
