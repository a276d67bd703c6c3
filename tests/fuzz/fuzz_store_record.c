/* libFuzzer target: the prefix store's record decoders (cache/record.c) on
 * arbitrary stored bytes, raw, with repaired checksums, and as encoded
 * records with one byte flipped. The modes and checks live in
 * harness_record.h, which the test suite's replay
 * (tests/test_fuzz_replay.c) runs on tests/fuzz/corpus-record and
 * tests/fuzz/regressions-record too. Seeds: gen_record_seeds.c. */
#include <stddef.h>
#include <stdint.h>

#include "tests/fuzz/harness_record.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    pd_fuzz_record_input(data, size);
    return 0;
}
