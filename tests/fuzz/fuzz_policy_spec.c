/* libFuzzer target: policy spec strings and layouts (policies/spec.c,
 * policies/layout.c). The checks live in harness_policy.h, which the test
 * suite's replay (tests/test_fuzz_replay.c) runs on tests/fuzz/corpus-spec
 * and tests/fuzz/regressions-spec too. */
#include <stddef.h>
#include <stdint.h>

#include "tests/fuzz/harness_policy.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    pd_fuzz_policy_input(data, size);
    return 0;
}
