#!/usr/bin/env bash
# cudaemu race check: runs the CUDA backend's kernels through the real tools
# (prefixctl, prefix-bench) on the emulated device in a ThreadSanitizer build,
# where every GPU thread is a TSan fiber and only __syncthreads, __syncwarp
# and block/launch boundaries order memory, and streams run asynchronously
# (tests/cudaemu/runtime.cpp). Any data race in a kernel (shared or global
# memory), between the host and queued device work (a buffer reused before
# its copy ran, results read before a sync), or between the backend's host
# threads, fails the run.
#
# usage: tests/cudaemu/race-check.sh BUILD_DIR   (meson -Dcudaemu=true -Db_sanitize=thread)
# Criterion's sandbox cannot start under TSan, hence tools, not the test suites.
set -euo pipefail
build=${1:?usage: race-check.sh BUILD_DIR}
shared=${PD_SHARED_MODELS:-$(cd "$(dirname "$0")/../.." && pwd)/../shared/models}
ctl=$build/tools/prefixctl
bench=$build/tools/prefix-bench
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export TSAN_OPTIONS="halt_on_error=1 exitcode=66 ${TSAN_OPTIONS:-}"
export UBSAN_OPTIONS="halt_on_error=1 print_stacktrace=1 ${UBSAN_OPTIONS:-}"

# Steps run as background jobs, as many at once as there are CPUs: each is
# one TSan process whose GPU threads are fibers on one OS thread, so two
# share the 2-vCPU CI machine without slowing each other much.
max_jobs=$(nproc)
running=0
n_steps=0
failed=0
reap() {
    if ! wait -n; then failed=1; fi
    running=$((running - 1))
}
step() {
    local name=$1
    shift
    n_steps=$((n_steps + 1))
    local out="$work/out.$n_steps"
    (
        t0=$SECONDS
        if ! "$@" >"$out" 2>&1; then
            cat "$out" >&2
            echo "race-check: FAILED: $name" >&2
            exit 1
        fi
        echo "race-check: ok ($((SECONDS - t0)) s): $name"
    ) &
    running=$((running + 1))
    if [ "$running" -ge "$max_jobs" ]; then reap; fi
}

story="Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends. One day, she saw a big red ball under a tree and ran to get it."
printf '%s %s %s\n' "$story" "$story" "$story" >"$work/prefix.txt"
printf 'Lily smiled and said thank you to her mom.\n' >"$work/eval.txt"

# GQA model with head_dim 64 (two output dims per lane), and q4_K and q5_1
# ones (kept in their blocks, dequantized in registers for decode and to
# bf16 row chunks for prefill).
"$ctl" gen-model --preset tiny --arch qwen2 --n-embd 256 --n-head 4 --n-head-kv 2 --n-ff 512 --n-layer 2 \
    --n-vocab 512 --type bf16 -q -o "$work/gqa.gguf"
"$ctl" gen-model --preset tiny --type q4_k --n-embd 256 --n-ff 512 --n-layer 2 -q -o "$work/q4k.gguf"
"$ctl" gen-model --preset tiny --type q5_1 --n-embd 256 --n-ff 512 --n-layer 2 -q -o "$work/q51.gguf"
# f16 weights (prefill scales activations for the f16 GEMM) and a 33 MB
# embedding: uploads larger than the two 8 MiB pinned staging buffers.
"$ctl" gen-model --preset tiny --type f16 --n-embd 512 --n-vocab 32000 --n-layer 1 -q -o "$work/big.gguf"

if [ -f "$shared/tinystories/stories260K.gguf" ]; then
    m=$shared/tinystories/stories260K.gguf
    step "stories260K prefill and decode" "$ctl" generate --model "$m" --prompt "$story" -n 16 --device cuda:0
    step "stories260K Compactor on the device, continuation over the compressed prefix" \
        "$ctl" compress --model "$m" --policy compactor --retention 0.3 --text "$work/prefix.txt" \
        --eval "$work/eval.txt" --device cuda:0
fi
step "qwen2 GQA (bf16) prefill and decode" "$ctl" generate --model "$work/gqa.gguf" --prompt "$story" -n 12 --device cuda:0
step "qwen2 GQA Compactor" "$ctl" compress --model "$work/gqa.gguf" --policy compactor --retention 0.25 \
    --text "$work/prefix.txt" --eval "$work/eval.txt" --device cuda:0
step "q4_K weights (native blocks: quantized GEMV, bf16 row chunks for prefill)" "$ctl" generate --model "$work/q4k.gguf" --prompt "$story" -n 8 --device cuda:0
step "q5_1 weights (32-element blocks with an offset and a fifth bit)" "$ctl" generate --model "$work/q51.gguf" --prompt "$story" -n 8 --device cuda:0
step "f16 weights, uploads through the pinned staging buffers" "$ctl" generate --model "$work/big.gguf" --prompt "$story" -n 2 --device cuda:0
step "prefix-bench: batched decode over a shared compressed prefix" \
    "$bench" --model "$work/gqa.gguf" --device cuda:0 --prompt 32 --gen 2 --reps 1 --prefix 64
step "prefix-bench: timed decode steps at batch 1 and 3 (timing events), attention over per-sequence KV" \
    "$bench" --model "$work/gqa.gguf" --device cuda:0 --prompt 8 --gen 2 --reps 1 --batches 1,3 --attn-keys 48 \
    --attn-chunk 16
while [ "$running" -gt 0 ]; do reap; done
if [ "$failed" -ne 0 ]; then
    echo "race-check: a step failed (its output is above)" >&2
    exit 1
fi
echo "race-check: no data race found"
