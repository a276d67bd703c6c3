#!/usr/bin/env bash
# Run the GGUF/tokenizer fuzzer for a while.
#   tools/fuzz.sh [SECONDS]    (default 600)
# Seeds: tests/fuzz/corpus plus a few generated models. New crashers are
# written to build-fuzz/crashes/; copy them into tests/fuzz/regressions/ (the
# test suite replays that folder) once fixed.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-600}
if [ ! -f build-fuzz/build.ninja ]; then
  CC=clang meson setup build-fuzz -Dfuzz=true -Dtests=false -Dcuda=disabled \
    -Db_sanitize=address,undefined -Db_lundef=false -Dc_args=-fsanitize=fuzzer-no-link
fi
meson compile -C build-fuzz fuzz_gguf prefixctl
work=build-fuzz/corpus
mkdir -p "$work" build-fuzz/crashes
cp -n tests/fuzz/corpus/* tests/fuzz/regressions/* "$work"/ 2>/dev/null || true
# A tiny generated model with its built-in vocabulary covers the tokenizer paths.
ASAN_OPTIONS=detect_leaks=0 build-fuzz/tools/prefixctl gen-model --preset tiny --n-layer 1 \
  --n-embd 32 --n-ff 32 --n-head 2 --n-head-kv 1 --seed 1 -o "$work/gen-tiny" >/dev/null
build-fuzz/tests/fuzz/fuzz_gguf "$work" -max_total_time="$secs" -max_len=65536 -timeout=10 \
  -rss_limit_mb=2048 -artifact_prefix=build-fuzz/crashes/ -print_final_stats=1
