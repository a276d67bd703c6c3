#!/usr/bin/env bash
# Run the libFuzzer targets for a while.
#   tools/fuzz.sh [SECONDS]    (default 600 for fuzz_gguf; fuzz_config gets a fifth)
# fuzz_gguf feeds arbitrary bytes to the GGUF reader, printer and tokenizer
# loader; fuzz_config to the INI parser and --set. Seeds come from
# tests/fuzz/corpus*, tests/fuzz/regressions and a generated model. New
# crashers land in build-fuzz/crashes/; once fixed, copy them into
# tests/fuzz/regressions/ (the test suite replays that folder).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-600}
config_secs=$(( secs / 5 > 10 ? secs / 5 : 10 ))
if [ ! -f build-fuzz/build.ninja ]; then
  CC=clang meson setup build-fuzz -Dfuzz=true -Dtests=false -Dcuda=disabled \
    -Db_sanitize=address,undefined -Db_lundef=false -Dc_args=-fsanitize=fuzzer-no-link
fi
meson compile -C build-fuzz fuzz_gguf fuzz_config prefixctl
mkdir -p build-fuzz/corpus build-fuzz/corpus-config build-fuzz/crashes
cp -n tests/fuzz/corpus/* tests/fuzz/regressions/* build-fuzz/corpus/ 2>/dev/null || true
cp -n tests/fuzz/corpus-config/* build-fuzz/corpus-config/ 2>/dev/null || true
# A small generated model with the built-in vocabulary reaches the tokenizer.
ASAN_OPTIONS=detect_leaks=0 build-fuzz/tools/prefixctl gen-model --preset tiny --n-layer 1 \
  --n-embd 32 --n-ff 32 --n-head 2 --n-head-kv 1 --type q4_0 --seed 1 -o build-fuzz/corpus/gen-tiny >/dev/null

common=(-timeout=10 -rss_limit_mb=2048 -artifact_prefix=build-fuzz/crashes/ -print_final_stats=1)
echo "fuzz_gguf: ${secs}s"
build-fuzz/tests/fuzz/fuzz_gguf build-fuzz/corpus -max_total_time="$secs" -max_len=131072 "${common[@]}"
echo "fuzz_config: ${config_secs}s"
build-fuzz/tests/fuzz/fuzz_config build-fuzz/corpus-config -max_total_time="$config_secs" -max_len=4096 "${common[@]}"
