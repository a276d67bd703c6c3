/* Random ids for responses and tool calls (pd_random_id, util.h). */
#include <stdint.h>
#include <stdio.h>
#include <sys/random.h>
#include <time.h>

#include "util/util.h"

void pd_random_id(char *out, size_t cap, const char *prefix) {
    static const char alphabet[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    unsigned char raw[24];
    if (getrandom(raw, sizeof raw, 0) != (ssize_t)sizeof raw) {
        /* No entropy: ids only need to be unique enough to tell responses apart. */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t x = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^ (uint64_t)(uintptr_t)out;
        for (size_t i = 0; i < sizeof raw; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            raw[i] = (unsigned char)(x >> 56);
        }
    }
    char suffix[sizeof raw + 1];
    for (size_t i = 0; i < sizeof raw; i++) suffix[i] = alphabet[raw[i] % (sizeof alphabet - 1)];
    suffix[sizeof raw] = '\0';
    snprintf(out, cap, "%s%s", prefix, suffix);
}
