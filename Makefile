# Thin wrapper around meson. `make run` and `make test` work on a fresh
# Debian 12 machine: they install the dependencies first.

BUILD      ?= build
ASAN_BUILD ?= build-asan
EMU_BUILD  ?= build-cudaemu
TSAN_EMU_BUILD ?= build-cudaemu-tsan
MESON_OPTS ?=
SHARED     ?= $(abspath ../shared/models)
PEER       ?= $(abspath ../shared/peer)
FUZZ_SECS  ?= 600

# meson finds nvcc on PATH; the CUDA toolkit installs it outside.
export PATH := $(PATH):/usr/local/cuda/bin

DEFAULT_MODEL := $(if $(wildcard $(SHARED)/tinystories/stories260K.gguf),$(SHARED)/tinystories/stories260K.gguf,models/default.gguf)

.PHONY: all deps build test test-asan test-cudaemu run bench bench-gpu bench-store eval fuzz clean bench-serve bench-peer bench-conn bench-cluster screenshots

all: build

deps:
	@deploy/install-deps.sh

$(BUILD)/build.ninja: | deps
	meson setup $(BUILD) -Dwerror=true $(MESON_OPTS)

build: deps $(BUILD)/build.ninja
	meson compile -C $(BUILD)

test: build
	@rc=0; meson test -C $(BUILD) --print-errorlogs || rc=$$?; \
	  tools/test-summary.sh $(BUILD); exit $$rc

# Without nvcc: with no GPU its code runs nowhere here, and it took a third
# of this build's compile time (the CUDA sources run under ASan in
# test-cudaemu instead). The CPU kernels are built at -O1 (kernels/meson.build).
$(ASAN_BUILD)/build.ninja: | deps
	meson setup $(ASAN_BUILD) -Dwerror=true -Db_sanitize=address,undefined -Db_lundef=false \
	  -Dbuildtype=debug -Dcuda=disabled $(MESON_OPTS)

# The same tests under AddressSanitizer + UndefinedBehaviorSanitizer.
test-asan: deps $(ASAN_BUILD)/build.ninja
	meson compile -C $(ASAN_BUILD)
	@rc=0; ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	  meson test -C $(ASAN_BUILD) --print-errorlogs --timeout-multiplier 4 || rc=$$?; \
	  tools/test-summary.sh $(ASAN_BUILD); exit $$rc

# The operator console's screenshots shown in the README (docs/console/*.png,
# 1280x800): the browser test (tests/browser/test_console.py, headless
# Chromium against the real daemon) saves one of each page. CI=true: fail,
# not skip, when chromium or python3-websocket is missing. optipng shrinks
# them when it is installed (not a dependency).
# Only prefixd is built: `meson test --no-rebuild` skips the other targets.
screenshots: deps $(BUILD)/build.ninja
	meson compile -C $(BUILD) prefixd
	rm -f docs/console/failure.png
	CI=true PREFIXD_SCREENSHOTS=$(CURDIR)/docs/console meson test -C $(BUILD) --no-rebuild --suite browser --print-errorlogs
	@if command -v optipng >/dev/null 2>&1; then optipng -quiet -o2 docs/console/*.png; fi
	@ls -l docs/console/*.png

# The CUDA backend without a GPU: its sources built for cudaemu
# (tests/cudaemu, a CPU emulation of the CUDA runtime, cuBLAS and cuSOLVER),
# the GPU test suites under ASan+UBSan, then the kernels through the real
# tools under ThreadSanitizer (races between GPU threads). Not a GPU result:
# it checks logic, bookkeeping, memory bounds and synchronisation, not speed.
$(EMU_BUILD)/build.ninja: | deps
	meson setup $(EMU_BUILD) -Dwerror=true -Dcuda=disabled -Dcudaemu=true -Db_sanitize=address,undefined \
	  -Db_lundef=false -Dbuildtype=debugoptimized $(MESON_OPTS)

$(TSAN_EMU_BUILD)/build.ninja: | deps
	meson setup $(TSAN_EMU_BUILD) -Dwerror=true -Dcuda=disabled -Dcudaemu=true -Db_sanitize=thread \
	  -Dbuildtype=debugoptimized -Dtests=false $(MESON_OPTS)

# Only the GPU suites and what they run are built: the whole tree at -O2
# under ASan took 12 minutes on the 2-vCPU machine. `meson test --no-rebuild`
# keeps it so.
EMU_SUITES := test_cuda test_cuda_quant test_cuda_memory test_cuda_parity test_device test_cuda_fatal test_fused \
  test_cuda_attention

test-cudaemu: deps $(EMU_BUILD)/build.ninja $(TSAN_EMU_BUILD)/build.ninja
	meson compile -C $(EMU_BUILD) $(addprefix tests/,$(EMU_SUITES) store_writer) prefixd tools/prefixctl \
	  tools/prefix-bench
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	  meson test -C $(EMU_BUILD) --no-rebuild --print-errorlogs --timeout-multiplier 4 $(EMU_SUITES)
	meson compile -C $(TSAN_EMU_BUILD) tools/prefixctl tools/prefix-bench
	PD_SHARED_MODELS=$(SHARED) tests/cudaemu/race-check.sh $(TSAN_EMU_BUILD)

models/default.gguf: | build
	mkdir -p models
	$(BUILD)/tools/prefixctl gen-model --preset stories260k --seed 1 -o $@

# Until the serving daemon lands, `make run` shows what exists: the model,
# the tokenizer round trip, generation and the daemon's effective configuration.
run: build $(if $(findstring models/default.gguf,$(DEFAULT_MODEL)),models/default.gguf)
	@echo "== model: $(DEFAULT_MODEL)"
	$(BUILD)/tools/prefixctl inspect $(DEFAULT_MODEL) --items 4 | head -40
	@echo "== tokenize"
	echo "Once upon a time, there was a little girl named Lily." | $(BUILD)/tools/prefixctl tokenize --model $(DEFAULT_MODEL)
	@echo "== detokenize"
	echo "Once upon a time, there was a little girl named Lily." | $(BUILD)/tools/prefixctl tokenize --model $(DEFAULT_MODEL) \
	  | $(BUILD)/tools/prefixctl detokenize --model $(DEFAULT_MODEL)
	@echo "== generate (greedy)"
	$(BUILD)/tools/prefixctl generate --model $(DEFAULT_MODEL) --prompt "Once upon a time" -n 48
	@echo "== compress a prefix (Compactor, retention chosen for an NLL ratio <= 1.05)"
	$(BUILD)/tools/prefixctl generate --model $(DEFAULT_MODEL) --prompt "Once upon a time" -n 300 --temp 1 --seed 3 \
	  > $(BUILD)/demo-prefix.txt
	$(BUILD)/tools/prefixctl compress --model $(DEFAULT_MODEL) --policy compactor --quality 1.05 \
	  --text $(BUILD)/demo-prefix.txt --store var/prefixd
	@echo "== the prefix store (var/prefixd, the default cache.path)"
	$(BUILD)/tools/prefixctl store --dir var/prefixd list
	@echo "== prefixd --check-config"
	$(BUILD)/prefixd --check-config --set model.path=$(DEFAULT_MODEL)
	@echo "== CUDA"
	$(BUILD)/tools/prefixctl cuda-info
	@$(if $(findstring models/default.gguf,$(DEFAULT_MODEL)),echo "!! NO MODEL CONFIGURED: serving the GENERATED DEMO MODEL models/default.gguf (random weights, gibberish output); put ../shared/models beside the repo or run build/prefixd --set model.path=YOUR.gguf")
	@echo "== prefixd on http://127.0.0.1:8080 (Ctrl-C stops it), store in var/prefixd"
	@echo "   try: curl -s localhost:8080/v1/completions -H 'Content-Type: application/json' -d '{\"model\":\"demo\",\"prompt\":\"Once upon a time\",\"max_tokens\":32}'"
	$(BUILD)/prefixd --config deploy/prefixd.conf --set model.path=$(DEFAULT_MODEL) --set cache.path=var/prefixd \
	  --set server.model_names=demo

# Engine throughput on a generated SmolLM2-135M-shaped Q8_0 model (32000 vocab),
# the shape of the llama.cpp reference numbers in the README.
bench: build
	$(BUILD)/tools/prefix-bench --preset smollm2-135m --type q8_0 --n-vocab 32000 --threads 1,2 \
	  --prompt 256 --gen 64 --reps 3

# The CUDA backend on a generated Llama-3.2-1B-shaped BF16 model (~2.5 GB in
# $TMPDIR, written once): prefill/decode; decode steps at batch 1, 8, 16 and
# 32 (step time p50/p99/max, host enqueue vs GPU time, logits time, launches
# per step, decode against the bound of native weight bytes + KV); attention
# TFLOP/s at 4K and 16K keys; then Compactor compression, time to first token
# and decode with 4096- and 16384-token compressed prefixes (docs/gpu.md,
# "Benchmark", says which figure proves what). Then the decode steps again
# op by op (--no-graphs): what CUDA graphs gain.
bench-gpu: build
	$(BUILD)/tools/prefix-bench --preset llama-3.2-1b --type bf16 --device cuda:0 --prefix 4096,16384 \
	  --gen 64 --reps 2 --batches 1,8,16,32 --attn-keys 4096,16384 --attn-chunk 2048
	$(BUILD)/tools/prefix-bench --preset llama-3.2-1b --type bf16 --device cuda:0 --gen 64 --reps 2 \
	  --batches 1,8,16,32 --no-graphs

# Prefix store throughput: write/read MB/s, hot tier, lookup time with 10k
# stored prefixes (docs/store.md).
bench-store: build
	$(BUILD)/tools/store-bench --prefixes 10000

# NLL ratio of every KV-cache policy at retention 0.5/0.25/0.1, and the hit
# rate of context-calibrated compression, on stories sampled from the real
# stories260K model (the tables in docs/policies.md); then the separation
# tables (protection scaled, per-span keep rates, far-context copies,
# instruction survival) and the figures docs/figures/eval-*.png, drawn by
# gnuplot (tools/eval-figures.sh installs gnuplot-nox when missing).
eval: build
	@mkdir -p $(BUILD)/eval-data
	$(BUILD)/tools/policy-eval $(SHARED)/tinystories/stories260K.gguf --data-dir $(BUILD)/eval-data
	tools/eval-figures.sh $(BUILD)/eval-data docs/figures

# libFuzzer on the GGUF reader and tokenizer loader (clang, ASan+UBSan).
fuzz: deps
	tools/fuzz.sh $(FUZZ_SECS)

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(EMU_BUILD) $(TSAN_EMU_BUILD) build-fuzz

# Serving benchmark against a real prefixd (tools/serve-bench.c): time to
# first token with a stored ~400-token prefix at retention 1/0.5/0.25 vs no
# prefix, and decode tokens/s with 1, 8 and 32 concurrent streams. First on
# the real stories260K, then on a generated SmolLM2-135M-shaped Q8_0 model
# with the Llama SentencePiece vocabulary (32000 tokens, all with text).
BENCH_SERVE_MODEL := $(BUILD)/bench-smollm2-135m-q8_0.gguf

$(BENCH_SERVE_MODEL): | build
	$(BUILD)/tools/prefixctl gen-model --preset smollm2-135m --type q8_0 --seed 1 \
	  $(if $(wildcard $(SHARED)/vocab/ggml-vocab-llama-spm.gguf),--vocab-from $(SHARED)/vocab/ggml-vocab-llama-spm.gguf,--n-vocab 32000) \
	  -o $@

bench-serve: build $(BENCH_SERVE_MODEL) $(if $(findstring models/default.gguf,$(DEFAULT_MODEL)),models/default.gguf)
	$(BUILD)/tools/serve-bench --model $(DEFAULT_MODEL) --prefixctl $(BUILD)/tools/prefixctl --prefixd $(BUILD)/prefixd
	$(BUILD)/tools/serve-bench --model $(BENCH_SERVE_MODEL) --prefixctl $(BUILD)/tools/prefixctl --prefixd $(BUILD)/prefixd

# Side by side with llama.cpp b4748 (the binaries in $(PEER)): llama-bench and
# prefix-bench on the same generated files (SmolLM2-135M Q8_0, Llama-3.2-1B
# Q4_K and llama-quantize's Q4_K_M), interleaved rounds (BENCH_ROUNDS, default
# 3), decode against the measured memory bandwidth; then a stored compressed
# prefix against llama-server's saved slot: bytes and time to first token.
# Skips (exit 0) when the peer is absent or cannot run on this CPU.
# docs/bench-peer.md.
bench-peer: build
	BUILD=$(BUILD) PEER_DIR=$(PEER) tools/bench-peer.sh

# 2000 slowloris connections against a fresh daemon: /health and a short
# completion must answer within 1 s, 64 streams must finish (docs/deployment.md).
bench-conn: build
	tools/slowloris-bench.py --prefixd $(BUILD)/prefixd --model $(DEFAULT_MODEL)

# Prefix-affinity routing against round-robin on a 3-node cluster on this
# machine (redis-server, three prefixd, HAProxy; docs/deployment.md "Several nodes").
bench-cluster: build
	PD_SHARED_MODELS=$(SHARED) tools/cluster-bench.py --prefixd $(BUILD)/prefixd --prefixctl $(BUILD)/tools/prefixctl \
	  --rounds 3 --modes affinity,roundrobin,affinity-unbounded
