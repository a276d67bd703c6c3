#!/usr/bin/env bash
# Run the libFuzzer targets for a while.
#   tools/fuzz.sh [SECONDS]
# fuzz_gguf runs SECONDS (default 600); fuzz_tokenize, fuzz_config,
# fuzz_policy_spec and fuzz_store_record a fifth each (at least 10 s).
# fuzz_gguf feeds arbitrary bytes to the GGUF reader, printer and tokenizer
# loader; fuzz_tokenize arbitrary text to every vocabulary; fuzz_config to the
# INI parser and --set; fuzz_policy_spec to the policy spec and layout parsers;
# fuzz_store_record to the prefix store's record decoders (see
# tests/fuzz/harness_*.h). Seeds come from tests/fuzz/corpus*,
# tests/fuzz/regressions*, a generated model and gen_record_seeds. New
# crashers land in build-fuzz/crashes/; once fixed, copy them into
# tests/fuzz/regressions/ (GGUF), regressions-spec/ or regressions-record/
# (the test suite replays those folders: test_gguf, test_fuzz_replay).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-600}
config_secs=$(( secs / 5 > 10 ? secs / 5 : 10 ))
if [ ! -f build-fuzz/build.ninja ]; then
  CC=clang meson setup build-fuzz -Dfuzz=true -Dtests=false -Dcuda=disabled \
    -Db_sanitize=address,undefined -Db_lundef=false -Dc_args=-fsanitize=fuzzer-no-link
fi
# Only what runs here: the fuzz targets, their seed writer and prefixctl.
meson compile -C build-fuzz tests/fuzz/fuzz_gguf tests/fuzz/fuzz_tokenize tests/fuzz/fuzz_config \
  tests/fuzz/fuzz_policy_spec tests/fuzz/fuzz_store_record tests/fuzz/gen_record_seeds tools/prefixctl
mkdir -p build-fuzz/corpus build-fuzz/corpus-config build-fuzz/corpus-text build-fuzz/crashes \
  build-fuzz/corpus-spec build-fuzz/corpus-record
cp -n tests/fuzz/corpus/* tests/fuzz/regressions/* build-fuzz/corpus/ 2>/dev/null || true
cp -n tests/fuzz/corpus-config/* build-fuzz/corpus-config/ 2>/dev/null || true
cp -n tests/fuzz/corpus-text/* build-fuzz/corpus-text/ 2>/dev/null || true
cp -n tests/fuzz/corpus-spec/* tests/fuzz/regressions-spec/* build-fuzz/corpus-spec/ 2>/dev/null || true
cp -n tests/fuzz/corpus-record/* tests/fuzz/regressions-record/* build-fuzz/corpus-record/ 2>/dev/null || true
# Record seeds in the current format, encoded by this build.
ASAN_OPTIONS=detect_leaks=0 build-fuzz/tests/fuzz/gen_record_seeds build-fuzz/corpus-record
shared=${PD_SHARED_MODELS:-$PWD/../shared/models}
# llama.cpp's tokenizer test inputs make good text seeds (not copied into the repo).
if [ -f "$shared/vocab/ggml-vocab-gpt-2.gguf.inp" ]; then
  python3 - "$shared/vocab/ggml-vocab-gpt-2.gguf.inp" build-fuzz/corpus-text <<'PY'
import sys
parts = open(sys.argv[1], 'rb').read().split(b'\n__ggml_vocab_test__\n')[:-1]
for i, text in enumerate(parts):
    open('%s/vec%02d' % (sys.argv[2], i), 'wb').write(bytes([i * 37 % 256]) + text)
PY
fi
# A small generated model with the built-in vocabulary reaches the tokenizer.
model=build-fuzz/corpus/gen-tiny
ASAN_OPTIONS=detect_leaks=0 build-fuzz/tools/prefixctl gen-model --preset tiny --n-layer 1 \
  --n-embd 32 --n-ff 32 --n-head 2 --n-head-kv 1 --type q4_0 --seed 1 -o "$model" >/dev/null

common=(-timeout=10 -rss_limit_mb=2048 -artifact_prefix=build-fuzz/crashes/ -print_final_stats=1)
echo "fuzz_gguf: ${secs}s"
build-fuzz/tests/fuzz/fuzz_gguf build-fuzz/corpus -max_total_time="$secs" -max_len=131072 "${common[@]}"
echo "fuzz_tokenize: ${config_secs}s"
PD_FUZZ_MODEL="$model" PD_SHARED_MODELS="$shared" build-fuzz/tests/fuzz/fuzz_tokenize build-fuzz/corpus-text \
  -max_total_time="$config_secs" -max_len=8192 "${common[@]}"
echo "fuzz_config: ${config_secs}s"
build-fuzz/tests/fuzz/fuzz_config build-fuzz/corpus-config -max_total_time="$config_secs" -max_len=4096 "${common[@]}"
echo "fuzz_policy_spec: ${config_secs}s"
build-fuzz/tests/fuzz/fuzz_policy_spec build-fuzz/corpus-spec -max_total_time="$config_secs" -max_len=4096 "${common[@]}"
echo "fuzz_store_record: ${config_secs}s"
build-fuzz/tests/fuzz/fuzz_store_record build-fuzz/corpus-record -max_total_time="$config_secs" -max_len=16384 \
  "${common[@]}"
