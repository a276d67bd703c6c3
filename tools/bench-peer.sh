#!/usr/bin/env bash
# bench-peer.sh: prefixd side by side with llama.cpp (the peer binaries in
# ../shared/peer) on the same generated GGUF files, in one interleaved run.
# What is measured and why: docs/bench-peer.md. `make bench-peer` runs it.
#
#   1. engine throughput: llama-bench and prefix-bench on the same file, thread
#      counts, prompt (prefill) and generation (decode from an empty context)
#      lengths, alternating which goes first, BENCH_ROUNDS rounds; one table of
#      medians with prefixd/llama.cpp ratios, and decode's bytes of weights per
#      second against the streaming-read bandwidth prefix-bench measures;
#   2. a stored compressed prefix vs llama-server's saved slot: bytes, and
#      time to first token (streaming) of a prompt that starts with it;
#   3. the same long prompt sent twice: prefixd's automatic prefix cache
#      (cache.auto_mb) vs llama-server's cache_prompt, and prefixd without
#      the cache (auto_mb = 0), TTFT of the 1st and the 2nd request.
#
# Environment:
#   BUILD          build folder with prefixd and tools/ (default: build)
#   PEER_DIR       llama.cpp binaries (default: ../shared/peer from the repo root)
#   BENCH_ROUNDS   interleaved rounds, medians over them (default 3)
#   BENCH_THREADS  comma-separated thread counts (default 1,2)
#   BENCH_GEN      decode tokens (default 64)
#   BENCH_THROUGHPUT  0 skips part 1 (default 1)
#   BENCH_TTFT     0 skips part 2 (default 1)
#   BENCH_AUTO     0 skips part 3 (default 1)
#   BENCH_AUTO_TOKENS  part 3's prompt length, BOS included (default 2000)
#   BENCH_SET      part 1's models: core (the SmolLM2 Q8_0 and Llama-1B Q4_K and
#                  Q4_K_M files, default), types (one row per weight type:
#                  llama-quantize mixes of a 4-layer 1B shape) or all
#   TMPDIR         the generated models are cached in ${TMPDIR:-/tmp}/prefixd-bench-peer
#   KEEP_WORK      1 keeps the scratch folder (logs, stores, slot files)
#
# Exits 0 with a SKIPPED line when the peer is absent or cannot run here.
set -uo pipefail
export LC_ALL=C

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-build}
[[ $BUILD == /* ]] || BUILD=$ROOT/$BUILD
PEER_DIR=${PEER_DIR:-$ROOT/../shared/peer}
ROUNDS=${BENCH_ROUNDS:-3}
THREADS=${BENCH_THREADS:-1,2}
GEN=${BENCH_GEN:-64}
DO_TTFT=${BENCH_TTFT:-1}
DO_THROUGHPUT=${BENCH_THROUGHPUT:-1}
DO_AUTO=${BENCH_AUTO:-1}
AUTO_TOKENS=${BENCH_AUTO_TOKENS:-2000}
SET=${BENCH_SET:-core}
CACHE=${TMPDIR:-/tmp}/prefixd-bench-peer
KEEP_WORK=${KEEP_WORK:-0}

PCTL=$BUILD/tools/prefixctl
PBENCH=$BUILD/tools/prefix-bench
PREFIXD=$BUILD/prefixd

# Prompt tokens for prefill: 256 on the small model (as `make bench` and the
# README's reference numbers), 128 on the 1B shapes (a run stays minutes).
PROMPT_SMALL=256
PROMPT_1B=128
# Part 2: the prefix, its two suffixes (the same length, different first
# tokens, so the warm request recomputes the whole suffix on both servers).
PREFIX_TOKENS=2193
SUFFIX_A="the little girl saw a big dog."
SUFFIX_B="a big dog saw the little girl."
TTFT_THREADS=2
TTFT_CTX=4096
# What this build's kernels compute (README: weight types).
OUR_TYPES=" f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 iq4_nl q2_k q3_k q4_k q5_k q6_k iq4_xs "

# awk helpers both result tables use: add(key, v) collects samples, med(key)
# is their median (-1 when there are none).
AWK_MEDIAN='
    function median(a, n,    i, j, x, b) {
        if (n < 1) return -1
        for (i = 1; i <= n; i++) b[i] = a[i]
        for (i = 2; i <= n; i++) { x = b[i]; for (j = i - 1; j >= 1 && b[j] > x; j--) b[j + 1] = b[j]; b[j + 1] = x }
        return n % 2 ? b[(n + 1) / 2] : (b[n / 2] + b[n / 2 + 1]) / 2
    }
    function add(key, v) { cnt[key]++; val[key, cnt[key]] = v }
    function med(key,    i, a) { for (i = 1; i <= cnt[key]; i++) a[i] = val[key, i]; return median(a, cnt[key]) }
'

say() { printf '%s\n' "$*"; }
warn() { printf 'bench-peer: %s\n' "$*" >&2; }
die() {
    warn "$*"
    exit 1
}
skip() {
    say "bench-peer: SKIPPED: $*"
    exit 0
}

[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || die "BENCH_ROUNDS must be a positive integer, not '$ROUNDS'"
[[ $SET =~ ^(core|types|all)$ ]] || die "BENCH_SET must be core, types or all, not '$SET'"
[[ $GEN =~ ^[1-9][0-9]*$ ]] || die "BENCH_GEN must be a positive integer, not '$GEN'"
[[ $THREADS =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || die "BENCH_THREADS must look like 1,2, not '$THREADS'"
IFS=, read -r -a THREAD_LIST <<< "$THREADS"

for b in "$PCTL" "$PBENCH" "$PREFIXD"; do
    [[ -x $b ]] || die "$b is missing: build first (make build, or BUILD=your-build-folder)"
done

# ---- the machine ---------------------------------------------------------------------
cpu=$(awk -F': *' '/^model name/ { print $2; exit }' /proc/cpuinfo 2>/dev/null)
cores=$(nproc 2>/dev/null || echo '?')
l3=$(sed -n 's/^\([0-9]*\)K$/\1/p' /sys/devices/system/cpu/cpu0/cache/index3/size 2>/dev/null)
[[ $l3 =~ ^[0-9]+$ ]] && l3=$((l3 * 1024)) || l3=0
mem=$(awk '/^MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo 2>/dev/null)
say "== bench-peer: prefixd vs llama.cpp on $(hostname 2>/dev/null || echo this machine)"
# busy_pct: the share of all cores busy over the next second (anyone's work).
busy_pct() {
    local a b
    a=$(awk '/^cpu / { print $2 + $3 + $4 + $7 + $8, $2 + $3 + $4 + $5 + $6 + $7 + $8 }' /proc/stat 2>/dev/null)
    sleep 1
    b=$(awk '/^cpu / { print $2 + $3 + $4 + $7 + $8, $2 + $3 + $4 + $5 + $6 + $7 + $8 }' /proc/stat 2>/dev/null)
    awk -v a="$a" -v b="$b" 'BEGIN { split(a, x, " "); split(b, y, " "); d = y[2] - x[2]; printf "%.0f%%", (d > 0 ? 100 * (y[1] - x[1]) / d : 0) }'
}
say "machine: ${cpu:-unknown CPU}, $cores cores, L3 $((l3 / 1048576)) MiB, ${mem:-? GiB} memory"
say "before the run: $(busy_pct) of the CPU busy with other work, load average $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"
say "prefixd: commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$ROOT" diff --quiet HEAD -- 2>/dev/null || echo ' with uncommitted changes in the tree'), build folder $BUILD"

# ---- the peer ------------------------------------------------------------------------
[[ -d $PEER_DIR ]] || skip "no llama.cpp binaries at $PEER_DIR (the peer folder is absent); nothing to compare with"
PEER_DIR=$(cd "$PEER_DIR" && pwd)
for b in llama-bench llama-quantize llama-server llama-tokenize; do
    [[ -x $PEER_DIR/$b ]] || skip "$PEER_DIR/$b is missing or not executable"
done

# ---- scratch folder and the servers we start -----------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/bench-peer.XXXXXX") || die "cannot create a scratch folder"
SERVER_PIDS=()
# stop_pid PID: SIGTERM, up to 10 s, then SIGKILL. The shell's stderr is
# muted meanwhile: llama-server aborts on SIGTERM ("terminate called without
# an active exception"), and bash would report that as it reaps the child.
stop_pid() {
    local pid=$1 i saved
    kill -0 "$pid" 2>/dev/null || return 0
    exec {saved}>&2 2>/dev/null
    kill -TERM "$pid"
    for ((i = 0; i < 100; i++)); do
        kill -0 "$pid" || break
        sleep 0.1
    done
    kill -KILL "$pid"
    wait "$pid"
    exec 2>&"$saved" {saved}>&-
    return 0
}
cleanup() {
    local p
    for p in "${SERVER_PIDS[@]}"; do stop_pid "$p"; done
    SERVER_PIDS=()
    if [[ $KEEP_WORK == 1 ]]; then
        warn "scratch folder kept: $WORK"
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- models (cached under $CACHE while the options stay the same) --------------------
mkdir -p "$CACHE" || die "cannot create $CACHE"

# cached FILE DESCRIPTION: true when FILE exists and was made from DESCRIPTION.
cached() { [[ -s $1 && -f $1.opts && $(<"$1.opts") == "$2" ]]; }

# gen_model FILE gen-model-options...
gen_model() {
    local f=$1
    shift
    local want="prefixctl gen-model $*"
    cached "$f" "$want" && return 0
    say "generating $f"
    rm -f "$f" "$f.opts"
    "$PCTL" gen-model "$@" --quiet -o "$f.tmp" > "$WORK/gen.log" 2>&1 || {
        cat "$WORK/gen.log" >&2
        rm -f "$f.tmp"
        return 1
    }
    mv "$f.tmp" "$f" && printf '%s' "$want" > "$f.opts"
}

SMOL=$CACHE/smollm2-135m-q8_0-v32000-s1.gguf
L1B_Q4K=$CACHE/llama-3.2-1b-q4_k-v32000-s1.gguf
L1B_Q4KM=$CACHE/llama-3.2-1b-q4_k_m-v32000-s1.gguf
gen_model "$SMOL" --preset smollm2-135m --type q8_0 --n-vocab 32000 --seed 1 || die "could not generate $SMOL"

# Can the peer run on this CPU at all? (GGML_NATIVE builds die with SIGILL
# on a CPU without the instructions they were built for.)
# (In a subshell, so that the shell's own "Illegal instruction" notice goes to
# the log too.)
("$PEER_DIR/llama-bench" -m "$SMOL" -p 8 -n 2 -t 1 -r 1 -o csv > "$WORK/probe.csv" 2> "$WORK/probe.err"; exit $?) 2>> "$WORK/probe.err"
rc=$?
if ((rc != 0)); then
    if ((rc >= 126)); then
        why="exit status $rc"
        ((rc > 128)) && why="killed by signal $((rc - 128))$( ((rc == 132)) && echo ': Illegal instruction')"
        grep -qi 'illegal instruction' "$WORK/probe.err" && why="Illegal instruction"
        skip "llama.cpp's binaries cannot run on this CPU ($why; they were built with GGML_NATIVE for an AVX-512 machine, see $PEER_DIR/README.md). No comparison is possible here; never substitute numbers measured elsewhere."
    fi
    tail -5 "$WORK/probe.err" >&2
    die "llama-bench failed on $SMOL (exit status $rc)"
fi
peer_build=$(awk -F'","' 'NR == 2 { gsub(/"/, "", $1); print "build " $2 " (" $1 ")" }' "$WORK/probe.csv")
say "llama.cpp: $PEER_DIR, ${peer_build:-unknown build}"

# quantize_mix OUT MIX gen-model-options...: llama-quantize MIX of a generated
# F16 file (the F16 file is deleted afterwards unless other mixes need it:
# KEEP_F16=1). Returns nonzero, with a line saying why, on failure.
KEEP_F16=0
quantize_mix() {
    local out=$1 mix=$2
    shift 2
    local want="llama-quantize $mix of prefixctl gen-model $* --type f16"
    cached "$out" "$want" && return 0
    local f16=$CACHE/f16-$(printf '%s' "$*" | tr -c 'A-Za-z0-9.\n-' '_').gguf
    rm -f "$out" "$out.opts"
    gen_model "$f16" "$@" --type f16 || return 1
    say "quantizing $out (llama-quantize $mix)"
    if "$PEER_DIR/llama-quantize" "$f16" "$out.tmp" "$mix" > "$WORK/quantize.log" 2>&1; then
        mv "$out.tmp" "$out" && printf '%s' "$want" > "$out.opts"
    else
        tail -5 "$WORK/quantize.log" >&2
        say "llama-quantize $mix failed: no row for it"
        rm -f "$out.tmp"
        ((KEEP_F16)) || rm -f "$f16" "$f16.opts"
        return 1
    fi
    ((KEEP_F16)) || rm -f "$f16" "$f16.opts"
}

# types_of FILE: "type xN, ..." of its matrices and vectors, or nothing when
# our reader cannot open it.
types_of() {
    "$PCTL" inspect "$1" --items 1 2> "$WORK/inspect.err" |
        awk '/^tensors:/ { t = 1; next } t && NF >= 2 { n[$2]++ } END { for (k in n) printf "%s%s x%d", (c++ ? ", " : ""), k, n[k] }'
}

# Our side must load and compute the model: its types are ones our kernels
# compute, and a one-token prefix-bench run works. Otherwise say why and
# leave the row out.
MODELS=()
LABELS=()
PROMPTS=()
add_model() { # FILE LABEL PROMPT
    local f=$1 label=$2 prompt=$3 types bad="" t
    types=$(types_of "$f")
    if [[ -z $types ]]; then
        say "SKIP $label: our GGUF reader cannot open $f: $(tail -1 "$WORK/inspect.err")"
        return
    fi
    for t in $(printf '%s\n' "$types" | tr ',' '\n' | awk '{ print $1 }'); do
        [[ $OUR_TYPES == *" $t "* ]] || bad+="${bad:+, }$t"
    done
    if [[ -n $bad ]]; then
        say "SKIP $label: $f contains tensor types this build cannot compute ($bad; it has $types)"
        return
    fi
    if ! "$PBENCH" --model "$f" --threads 1 --prompt 1 --gen 1 --reps 1 > /dev/null 2> "$WORK/load.err"; then
        say "SKIP $label: prefixd cannot run $f ($types): $(tail -1 "$WORK/load.err")"
        return
    fi
    MODELS+=("$f")
    LABELS+=("$label")
    PROMPTS+=("$prompt")
    say "model: $label  $(basename "$f")  $(du -m "$f" | cut -f1) MB  [$types]"
}
if [[ $SET == core || $SET == all ]]; then
    add_model "$SMOL" "smollm2-135m q8_0" "$PROMPT_SMALL"
    gen_model "$L1B_Q4K" --preset llama-3.2-1b --type q4_k --n-vocab 32000 --seed 1 &&
        add_model "$L1B_Q4K" "llama-3.2-1b q4_k" "$PROMPT_1B"
    quantize_mix "$L1B_Q4KM" Q4_K_M --preset llama-3.2-1b --n-vocab 32000 --seed 1 &&
        add_model "$L1B_Q4KM" "llama-3.2-1b q4_k_m" "$PROMPT_1B"
fi
# One row per weight type beyond the core set: llama-quantize's "mostly X"
# file types of a 4-layer Llama-3.2-1B shape (every row width a multiple of
# 256, so the K-quant types are not replaced by fallbacks; 4 layers keep a
# run short while the weights, ~150-300 MB, are still far beyond the caches).
if [[ $SET == types || $SET == all ]]; then
    KEEP_F16=1
    for mix in Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K_S Q4_K_S Q5_K_S Q6_K IQ4_NL IQ4_XS; do
        lc=$(tr 'A-Z' 'a-z' <<< "$mix")
        f=$CACHE/llama-1b-4l-$lc-v32000-s1.gguf
        quantize_mix "$f" "$mix" --preset llama-3.2-1b --n-layer 4 --n-vocab 32000 --seed 1 &&
            add_model "$f" "1b-4layer $lc" "$PROMPT_1B"
    done
    rm -f "$CACHE"/f16-*.gguf "$CACHE"/f16-*.gguf.opts
fi
((${#MODELS[@]})) || die "no model that both sides can run"

# ---- part 1: throughput, interleaved rounds ------------------------------------------
RES=$WORK/results.tsv # round, model index, threads, side, figure, value
SIMD=""
: > "$RES"

# llama-bench on one file at one thread count; appends prefill and decode tok/s.
run_llama() { # round model-index file prompt threads
    local r=$1 mi=$2 f=$3 p=$4 t=$5
    if ! "$PEER_DIR/llama-bench" -m "$f" -p "$p" -n "$GEN" -t "$t" -r 1 -o csv > "$WORK/lb.csv" 2> "$WORK/lb.err"; then
        warn "llama-bench failed on $f, $t threads: $(tail -1 "$WORK/lb.err")"
        return 1
    fi
    awk -v r="$r" -v mi="$mi" -v t="$t" '
        NR == 1 { n = split($0, h, ","); for (i = 1; i <= n; i++) col[h[i]] = i; next }
        {
            s = $0; sub(/^"/, "", s); sub(/"$/, "", s); split(s, f, "\",\"")
            np = f[col["n_prompt"]] + 0; ng = f[col["n_gen"]] + 0; ts = f[col["avg_ts"]] + 0
            if (np > 0 && ng == 0) printf "%s\t%s\t%s\tllama\tprefill\t%s\n", r, mi, t, ts
            if (ng > 0 && np == 0) printf "%s\t%s\t%s\tllama\tdecode\t%s\n", r, mi, t, ts
        }' "$WORK/lb.csv" >> "$RES"
}

# The number after "key": in a one-line JSON object.
json_num() { grep -o "\"$1\": *[-0-9.e+]*" <<< "$2" | head -1 | sed 's/.*: *//'; }

# prefix-bench on the same file: prefill of the same prompt, decode from an
# empty context (like llama-bench's tg), one rep after one warm-up (like
# llama-bench -r 1), and the streaming-read bandwidth at that thread count.
run_prefixd() { # round model-index file prompt threads
    local r=$1 mi=$2 f=$3 p=$4 t=$5 row v k
    if ! "$PBENCH" --model "$f" --threads "$t" --prompt "$p" --gen "$GEN" --reps 1 --decode-ctx 0 --bandwidth \
        --json > "$WORK/pb.json" 2> "$WORK/pb.err"; then
        warn "prefix-bench failed on $f, $t threads: $(tail -1 "$WORK/pb.err")"
        return 1
    fi
    row=$(grep '"threads"' "$WORK/pb.json" | head -1)
    SIMD=$(grep -o '"simd": *"[^"]*"' <<< "$row" | sed 's/.*: *"//; s/"$//')
    for k in prefill_tps:prefill decode_tps:decode decode_weight_bytes:bytes bandwidth_bytes_per_s:bandwidth; do
        v=$(json_num "${k%%:*}" "$row")
        [[ -n $v ]] || {
            warn "prefix-bench printed no ${k%%:*}: $row"
            return 1
        }
        printf '%s\t%s\t%s\tprefixd\t%s\t%s\n' "$r" "$mi" "$t" "${k#*:}" "$v" >> "$RES"
    done
}

# Last values of one round, for the progress line.
last_of() { awk -F'\t' -v r="$1" -v mi="$2" -v t="$3" -v s="$4" -v f="$5" '$1 == r && $2 == mi && $3 == t && $4 == s && $5 == f { v = $6 } END { if (v == "") print "-"; else printf "%.1f\n", v }' "$RES"; }

if ((DO_THROUGHPUT)); then
say ""
say "== part 1: prefill and decode, $ROUNDS interleaved round(s): llama-bench -r 1 and prefix-bench --reps 1 (each after one warm-up), decode of $GEN tokens from an empty context"
for ((r = 1; r <= ROUNDS; r++)); do
    say "round $r/$ROUNDS: $(busy_pct) of the CPU busy just before it"
    for mi in "${!MODELS[@]}"; do
        for t in "${THREAD_LIST[@]}"; do
            if ((r % 2)); then
                run_llama "$r" "$mi" "${MODELS[$mi]}" "${PROMPTS[$mi]}" "$t"
                run_prefixd "$r" "$mi" "${MODELS[$mi]}" "${PROMPTS[$mi]}" "$t"
                order="llama.cpp first"
            else
                run_prefixd "$r" "$mi" "${MODELS[$mi]}" "${PROMPTS[$mi]}" "$t"
                run_llama "$r" "$mi" "${MODELS[$mi]}" "${PROMPTS[$mi]}" "$t"
                order="prefixd first"
            fi
            printf 'round %d/%d  %-20s %2s threads  prefill %s / %s tok/s  decode %s / %s tok/s  (prefixd / llama.cpp, %s)\n' \
                "$r" "$ROUNDS" "${LABELS[$mi]}" "$t" \
                "$(last_of "$r" "$mi" "$t" prefixd prefill)" "$(last_of "$r" "$mi" "$t" llama prefill)" \
                "$(last_of "$r" "$mi" "$t" prefixd decode)" "$(last_of "$r" "$mi" "$t" llama decode)" "$order"
        done
    done
done

say ""
say "== engine throughput, medians of $ROUNDS round(s) (CPU: ${cpu:-unknown}, $cores cores; prefixd SIMD path ${SIMD:-?})"
labels_file=$WORK/labels.tsv
for mi in "${!MODELS[@]}"; do printf '%s\t%s\t%s\n' "$mi" "${LABELS[$mi]}" "${PROMPTS[$mi]}"; done > "$labels_file"
awk -F'\t' -v gen="$GEN" -v threads="$THREADS" '
'"$AWK_MEDIAN"'
    function fmt(v, d) { return v < 0 ? "-" : sprintf("%." d "f", v) }
    FNR == NR { label[$1] = $2; prompt[$1] = $3; order[++nm] = $1; next }
    { v[$1, $2, $3, $4, $5] = $6; seen[$2, $3] = 1; if ($1 > rounds) rounds = $1 }
    END {
        nt = split(threads, T, ",")
        printf "%-20s %3s  %-14s %10s %10s %8s  %-17s %-17s %10s\n", "model", "thr", "figure", "prefixd", "llama.cpp",
            "ratio", "prefixd GB/s", "llama.cpp GB/s", "bound GB/s"
        for (m = 1; m <= nm; m++) {
            mi = order[m]
            for (ti = 1; ti <= nt; ti++) {
                t = T[ti]
                if (!((mi, t) in seen)) continue
                for (fi = 1; fi <= 2; fi++) {
                    fig = fi == 1 ? "prefill" : "decode"
                    k = mi SUBSEP t SUBSEP fig
                    for (r = 1; r <= rounds; r++) {
                        p = (r, mi, t, "prefixd", fig) in v ? v[r, mi, t, "prefixd", fig] : ""
                        l = (r, mi, t, "llama", fig) in v ? v[r, mi, t, "llama", fig] : ""
                        if (p != "") add("p" k, p)
                        if (l != "") add("l" k, l)
                        if (p != "" && l != "" && l > 0) add("ratio" k, p / l)
                        if (fig == "decode") {
                            b = (r, mi, t, "prefixd", "bytes") in v ? v[r, mi, t, "prefixd", "bytes"] : ""
                            bw = (r, mi, t, "prefixd", "bandwidth") in v ? v[r, mi, t, "prefixd", "bandwidth"] : ""
                            if (b != "") bytes[mi] = b
                            if (bw != "" && bw > 0) {
                                add("bw" k, bw)
                                if (p != "" && b != "") add("pf" k, b * p / bw)
                                if (l != "" && b != "") add("lf" k, b * l / bw)
                            }
                        }
                    }
                    pm = med("p" k); lm = med("l" k); rm = med("ratio" k)
                    pcol = "-"; lcol = "-"; bcol = "-"
                    if (fig == "decode" && (mi in bytes)) {
                        if (pm >= 0) pcol = sprintf("%.1f (%2.0f%%)", bytes[mi] * pm / 1e9, 100 * med("pf" k))
                        if (lm >= 0) lcol = sprintf("%.1f (%2.0f%%)", bytes[mi] * lm / 1e9, 100 * med("lf" k))
                        if (cnt["bw" k]) bcol = sprintf("%.1f", med("bw" k) / 1e9)
                        if (cnt["pf" k] == 0) pcol = sprintf("%.1f", bytes[mi] * pm / 1e9)
                        if (cnt["lf" k] == 0 && lm >= 0) lcol = sprintf("%.1f", bytes[mi] * lm / 1e9)
                    }
                    printf "%-20s %3s  %-14s %10s %10s %8s  %-17s %-17s %10s\n", label[mi], t,
                        fig (fig == "prefill" ? " " prompt[mi] : " " gen) " t/s", fmt(pm, 1), fmt(lm, 1),
                        fmt(rm, 2), pcol, lcol, bcol
                }
            }
        }
        printf "\n"
        for (m = 1; m <= nm; m++)
            if (order[m] in bytes)
                printf "%s: a decode step reads %.1f MB of weights (every matrix as stored, the output matrix once)\n",
                    label[order[m]], bytes[order[m]] / 1e6
    }' "$labels_file" "$RES"
say "ratio = median over rounds of prefixd / llama.cpp within the round (the pair ran back to back)."
say "GB/s = weight bytes per decode step x decode tok/s; (%) = of the streaming-read bandwidth prefix-bench"
say "measured in the same round with the same thread count (bound GB/s, median)."
fi

((DO_TTFT || DO_AUTO)) || exit 0

# ---- part 2: stored prefix vs llama-server's slot, time to first token ----------------
say ""
((DO_TTFT)) && say "== part 2: a ${PREFIX_TOKENS}-token prefix on $(basename "$SMOL"), $TTFT_THREADS threads: llama-server (cache_prompt, slot save) vs prefixd (stored compressed prefix)"

# A deterministic text of builtin-vocabulary words (the generated model's
# SentencePiece-like vocabulary), cut to PREFIX_TOKENS tokens with BOS.
awk 'BEGIN {
    x = 12345
    nw = split("little girl boy dog cat ball tree sun big good happy very day time one home mom play saw went had was the a and to with for his her not but so all can like see", W, " ")
    ns = split("The|Lily|Once upon a time|One day|The little girl|Mom", S, "|")
    for (i = 0; i < 600; i++) {
        x = (x * 16807) % 2147483647; s = S[int(x / 7) % ns + 1]
        x = (x * 16807) % 2147483647; n = 5 + int(x / 7) % 8
        for (j = 0; j < n; j++) { x = (x * 16807) % 2147483647; s = s " " W[int(x / 7) % nw + 1] }
        printf "%s%s.", (i ? " " : ""), s
    }
}' > "$WORK/long.txt"
"$PCTL" tokenize --model "$SMOL" < "$WORK/long.txt" > "$WORK/long.ids" || die "prefixctl tokenize failed"
n_long=$(wc -w < "$WORK/long.ids")
((n_long >= PREFIX_TOKENS)) || die "the generated text has only $n_long tokens"
tr ' ' '\n' < "$WORK/long.ids" | sed -n "2,${PREFIX_TOKENS}p" | tr '\n' ' ' |
    "$PCTL" detokenize --model "$SMOL" > "$WORK/prefix.txt" || die "prefixctl detokenize failed"
"$PCTL" tokenize --model "$SMOL" < "$WORK/prefix.txt" > "$WORK/prefix.ids" || die "prefixctl tokenize failed"
PREFIX_IDS=$(tr -s ' \n' ',,' < "$WORK/prefix.ids" | sed 's/^,//; s/,$//')
n_prefix=$(tr ',' '\n' <<< "$PREFIX_IDS" | grep -c .)
want=$(tr ' ' '\n' < "$WORK/long.ids" | head -n "$PREFIX_TOKENS" | paste -sd, -)
[[ $PREFIX_IDS == "$want" ]] || warn "the prefix text re-tokenizes differently from the cut ids ($n_prefix tokens); using its own tokens"
say "prefix: $(wc -c < "$WORK/prefix.txt") bytes of text, $n_prefix tokens with BOS (prefixd's tokenizer)"

# Does llama.cpp's tokenizer agree? Both servers are sent prefixd's ids anyway.
"$PEER_DIR/llama-tokenize" -m "$SMOL" -f "$WORK/prefix.txt" --ids --no-escape --log-disable \
    > "$WORK/llama.ids" 2> "$WORK/llama-tokenize.err"
LLAMA_IDS=$(tr -d '[] \n' < "$WORK/llama.ids")
if [[ $LLAMA_IDS == "$PREFIX_IDS" ]]; then
    say "tokenizers: llama-tokenize gives the same $n_prefix ids"
else
    first_diff=$(paste -d' ' <(tr ',' '\n' <<< "$PREFIX_IDS") <(tr ',' '\n' <<< "$LLAMA_IDS") |
        awk '$1 != $2 { print NR ": prefixd " $1 ", llama.cpp " ($2 == "" ? "(none)" : $2); exit }')
    say "tokenizers DIFFER: llama-tokenize gives $(tr ',' '\n' <<< "$LLAMA_IDS" | grep -c .) ids, first difference at token ${first_diff:-?}; both servers get prefixd's ids"
fi

suffix_ids() { printf '%s' "$1" | "$PCTL" tokenize --model "$SMOL" --no-bos | tr -s ' \n' ',,' | sed 's/^,//; s/,$//'; }
SA=$(suffix_ids "$SUFFIX_A")
SB=$(suffix_ids "$SUFFIX_B")
na=$(tr ',' '\n' <<< "$SA" | grep -c .)
nb=$(tr ',' '\n' <<< "$SB" | grep -c .)
n_suffix=$((na < nb ? na : nb))
SA=$(tr ',' '\n' <<< "$SA" | head -n "$n_suffix" | paste -sd, -)
SB=$(tr ',' '\n' <<< "$SB" | head -n "$n_suffix" | paste -sd, -)
[[ ${SA%%,*} != "${SB%%,*}" ]] || warn "the two suffixes start with the same token: the warm request reuses more than the prefix"
say "suffixes: $n_suffix tokens each ('$SUFFIX_A' for the first request, '$SUFFIX_B' for the second)"

# A free loopback port (nothing answers on it).
free_port() {
    local p i
    for ((i = 0; i < 50; i++)); do
        p=$((20000 + RANDOM % 40000))
        (exec 3<> "/dev/tcp/127.0.0.1/$p") 2> /dev/null || {
            echo "$p"
            return 0
        }
    done
    return 1
}

# One HTTP/1.1 request over bash's /dev/tcp, reply saved in OUT. Prints
# "STATUS TTFT TOTAL": TTFT is the time from connecting to the first SSE
# "data:" line (-1 when none), both in seconds.
http_req() { # port method path body out
    local port=$1 method=$2 path=$3 body=$4 out=$5 line t0 t1="" t2 status="" fd
    : > "$out"
    t0=$EPOCHREALTIME
    exec {fd}<> "/dev/tcp/127.0.0.1/$port" || {
        echo "0 -1 -1"
        return 1
    }
    printf '%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s' \
        "$method" "$path" "${#body}" "$body" >&"$fd"
    while IFS= read -r -t 300 -u "$fd" line || [[ -n $line ]]; do
        line=${line%$'\r'}
        if [[ -z $status && $line == HTTP/* ]]; then
            status=${line#* }
            status=${status%% *}
        fi
        [[ -z $t1 && $line == data:* ]] && t1=$EPOCHREALTIME
        printf '%s\n' "$line" >> "$out"
    done
    t2=$EPOCHREALTIME
    exec {fd}>&-
    awk -v s="${status:-0}" -v a="$t0" -v b="${t1:-0}" -v c="$t2" 'BEGIN { printf "%s %.6f %.6f\n", s, (b > 0 ? b - a : -1), c - a }'
}

# wait_healthy PID PORT LOG: /health answers 200 within 60 s.
wait_healthy() {
    local pid=$1 port=$2 log=$3 i
    for ((i = 0; i < 240; i++)); do
        if ! kill -0 "$pid" 2>/dev/null; then
            warn "the server exited before it was ready:"
            tail -5 "$log" >&2
            return 1
        fi
        curl -sf -o /dev/null --max-time 2 "http://127.0.0.1:$port/health" && return 0
        sleep 0.25
    done
    warn "the server did not become healthy within 60 s"
    return 1
}

start_server() { # log command... ; sets SERVER_PID
    local log=$1
    shift
    "$@" > "$log" 2>&1 &
    SERVER_PID=$!
    SERVER_PIDS+=("$SERVER_PID")
}
stop_server() { # pid
    local p keep=()
    stop_pid "$1"
    for p in "${SERVER_PIDS[@]}"; do [[ $p == "$1" ]] || keep+=("$p"); done
    SERVER_PIDS=("${keep[@]}")
}

TT=$WORK/ttft.tsv # round, config, figure, value
: > "$TT"

# A new llama-server on a free loopback port; sets LS_PID and LS_PORT.
llama_start() {
    LS_PORT=$(free_port) || return 1
    mkdir -p "$WORK/slots"
    start_server "$WORK/llama-server.log" "$PEER_DIR/llama-server" -m "$SMOL" --host 127.0.0.1 --port "$LS_PORT" \
        --slot-save-path "$WORK/slots" -t "$TTFT_THREADS" -c "$TTFT_CTX" -np 1 --no-webui
    LS_PID=$SERVER_PID
    wait_healthy "$LS_PID" "$LS_PORT" "$WORK/llama-server.log" || {
        stop_server "$LS_PID"
        return 1
    }
}

# One streaming /completion of the prefix + a suffix, 1 token; records
# ttftN, prompt_nN (tokens computed) for round r.
llama_request() { # round N suffix-ids
    local r=$1 n=$2 suffix=$3 st out prompt_n body
    body="{\"prompt\":[$PREFIX_IDS,$suffix],\"n_predict\":1,\"cache_prompt\":true,\"stream\":true,\"temperature\":0}"
    read -r st out _ < <(http_req "$LS_PORT" POST /completion "$body" "$WORK/ls-reply-$n.txt")
    if [[ $st != 200 || $out == -1* ]]; then
        warn "llama-server request $n failed (HTTP $st)"
        return 1
    fi
    prompt_n=$(grep -o '"prompt_n":[0-9]*' "$WORK/ls-reply-$n.txt" | tail -1 | cut -d: -f2)
    printf '%s\tllama\tttft%s\t%s\n' "$r" "$n" "$out" >> "$TT"
    printf '%s\tllama\tprompt_n%s\t%s\n' "$r" "$n" "${prompt_n:-0}" >> "$TT"
}

# llama-server: request 1 (prefix + suffix A) on a new server fills the slot,
# request 2 (prefix + suffix B) reuses the prefix (cache_prompt); the slot is
# saved. Then a new server restores that file (its way to survive a restart)
# and answers request 3 (prefix + suffix A).
run_llama_server() { # round
    local r=$1 st out ok=1
    llama_start || return 1
    llama_request "$r" 1 "$SA" && llama_request "$r" 2 "$SB" || ok=0
    if ((ok)); then
        read -r st out _ < <(http_req "$LS_PORT" POST "/slots/0?action=save" '{"filename":"slot.bin"}' "$WORK/ls-save.txt")
        if [[ $st == 200 && -s $WORK/slots/slot.bin ]]; then
            printf '%s\tllama\tbytes\t%s\n' "$r" "$(stat -c %s "$WORK/slots/slot.bin")" >> "$TT"
            printf '%s\tllama\tsaved_tokens\t%s\n' "$r" "$(grep -o '"n_saved":[0-9]*' "$WORK/ls-save.txt" | cut -d: -f2)" >> "$TT"
        else
            warn "llama-server slot save failed (HTTP $st): $(tail -1 "$WORK/ls-save.txt")"
            ok=0
        fi
    fi
    stop_server "$LS_PID"
    if ((ok)) && llama_start; then
        read -r st _ out < <(http_req "$LS_PORT" POST "/slots/0?action=restore" '{"filename":"slot.bin"}' "$WORK/ls-restore.txt")
        if [[ $st == 200 ]]; then
            printf '%s\tllama\trestore\t%s\n' "$r" "$out" >> "$TT"
            llama_request "$r" 3 "$SA"
        else
            warn "llama-server slot restore failed (HTTP $st): $(tail -1 "$WORK/ls-restore.txt")"
        fi
        stop_server "$LS_PID"
    fi
    rm -f "$WORK/slots/slot.bin"
    ((ok))
}

# prefixd: a fresh daemon on the store, request 1 (prefix + suffix A) then
# request 2 (prefix + suffix B); both must use the stored prefix.
run_prefixd_server() { # round config store
    local r=$1 cfg=$2 store=$3 port st out cached
    port=$(free_port) || return 1
    start_server "$WORK/prefixd-$cfg.log" "$PREFIXD" --set "model.path=$SMOL" --set "server.listen=127.0.0.1" \
        --set "server.port=$port" --set "cache.path=$store" --set "model.n_threads=$TTFT_THREADS" --set "server.model_names=m"
    local pid=$SERVER_PID i body
    if ! wait_healthy "$pid" "$port" "$WORK/prefixd-$cfg.log"; then
        stop_server "$pid"
        return 1
    fi
    for i in 1 2; do
        body="{\"model\":\"m\",\"prompt\":[$PREFIX_IDS,$([[ $i == 1 ]] && echo "$SA" || echo "$SB")],\"max_tokens\":1,\"temperature\":0,\"stream\":true,\"stream_options\":{\"include_usage\":true}}"
        read -r st out _ < <(http_req "$port" POST /v1/completions "$body" "$WORK/pd-reply-$i.txt")
        if [[ $st != 200 || $out == -1* ]]; then
            warn "prefixd request $i failed (HTTP $st): $(grep -m1 error "$WORK/pd-reply-$i.txt")"
            stop_server "$pid"
            return 1
        fi
        cached=$(grep -o '"cached_tokens": *[0-9]*' "$WORK/pd-reply-$i.txt" | tail -1 | sed 's/.*: *//')
        printf '%s\t%s\tttft%s\t%s\n' "$r" "$cfg" "$i" "$out" >> "$TT"
        printf '%s\t%s\tcached%s\t%s\n' "$r" "$cfg" "$i" "${cached:-0}" >> "$TT"
    done
    stop_server "$pid"
}

# ---- part 3: the same long prompt twice (automatic prefix caching) --------------------
if ((DO_AUTO)); then
say ""
say "== part 3: the same ${AUTO_TOKENS}-token prompt twice on $(basename "$SMOL"), $TTFT_THREADS threads: llama-server (cache_prompt) vs prefixd (automatic prefix cache) vs prefixd with cache.auto_mb=0"
AUTO_IDS=$(tr ' ' '\n' < "$WORK/long.ids" | grep . | head -n "$AUTO_TOKENS" | paste -sd, -)
n_auto=$(tr ',' '\n' <<< "$AUTO_IDS" | grep -c .)
((n_auto == AUTO_TOKENS)) || warn "the generated text gives only $n_auto tokens"
AT=$WORK/auto.tsv # round, config, figure, value
: > "$AT"

# llama-server: a new server, the prompt twice; prompt_n = tokens computed.
run_llama_auto() { # round
    local r=$1 i st out prompt_n body
    llama_start || return 1
    body="{\"prompt\":[$AUTO_IDS],\"n_predict\":1,\"cache_prompt\":true,\"stream\":true,\"temperature\":0}"
    for i in 1 2; do
        read -r st out _ < <(http_req "$LS_PORT" POST /completion "$body" "$WORK/la-reply-$i.txt")
        if [[ $st != 200 || $out == -1* ]]; then
            warn "llama-server request $i failed (HTTP $st)"
            stop_server "$LS_PID"
            return 1
        fi
        prompt_n=$(grep -o '"prompt_n":[0-9]*' "$WORK/la-reply-$i.txt" | tail -1 | cut -d: -f2)
        printf '%s\tllama\tttft%s\t%s\n' "$r" "$i" "$out" >> "$AT"
        printf '%s\tllama\tcomputed%s\t%s\n' "$r" "$i" "${prompt_n:--1}" >> "$AT"
    done
    stop_server "$LS_PID"
}

# prefixd on an empty store (no registered prefix), the prompt twice;
# computed = prompt tokens - cached_tokens.
run_prefixd_auto() { # round config auto_mb
    local r=$1 cfg=$2 mb=$3 port st out cached i body store=$WORK/auto-store-$1-$2
    port=$(free_port) || return 1
    rm -rf "$store"
    start_server "$WORK/prefixd-auto-$cfg.log" "$PREFIXD" --set "model.path=$SMOL" --set "server.listen=127.0.0.1" \
        --set "server.port=$port" --set "cache.path=$store" --set "model.n_threads=$TTFT_THREADS" \
        --set "server.model_names=m" --set "cache.auto_mb=$mb"
    local pid=$SERVER_PID
    if ! wait_healthy "$pid" "$port" "$WORK/prefixd-auto-$cfg.log"; then
        stop_server "$pid"
        return 1
    fi
    body="{\"model\":\"m\",\"prompt\":[$AUTO_IDS],\"max_tokens\":1,\"temperature\":0,\"stream\":true,\"stream_options\":{\"include_usage\":true}}"
    for i in 1 2; do
        read -r st out _ < <(http_req "$port" POST /v1/completions "$body" "$WORK/pa-reply-$i.txt")
        if [[ $st != 200 || $out == -1* ]]; then
            warn "prefixd request $i failed (HTTP $st): $(grep -m1 error "$WORK/pa-reply-$i.txt")"
            stop_server "$pid"
            return 1
        fi
        cached=$(grep -o '"cached_tokens": *[0-9]*' "$WORK/pa-reply-$i.txt" | tail -1 | sed 's/.*: *//')
        printf '%s\t%s\tttft%s\t%s\n' "$r" "$cfg" "$i" "$out" >> "$AT"
        printf '%s\t%s\tcomputed%s\t%s\n' "$r" "$cfg" "$i" "$((n_auto - ${cached:-0}))" >> "$AT"
    done
    stop_server "$pid"
    rm -rf "$store"
}

for ((r = 1; r <= ROUNDS; r++)); do
    if ((r % 2)); then
        run_llama_auto "$r"; run_prefixd_auto "$r" auto 256; run_prefixd_auto "$r" off 0
    else
        run_prefixd_auto "$r" off 0; run_prefixd_auto "$r" auto 256; run_llama_auto "$r"
    fi
    printf 'round %d/%d  TTFT ms, 1st / 2nd:' "$r" "$ROUNDS"
    for cfg in llama auto off; do
        printf ' %s %s / %s' "$cfg" \
            "$(awk -F'\t' -v r="$r" -v c="$cfg" '$1 == r && $2 == c && $3 == "ttft1" { printf "%.1f", 1e3 * $4 }' "$AT")" \
            "$(awk -F'\t' -v r="$r" -v c="$cfg" '$1 == r && $2 == c && $3 == "ttft2" { printf "%.1f", 1e3 * $4 }' "$AT")"
    done
    printf '\n'
done

say ""
say "== the same prompt twice, medians of $ROUNDS round(s): $n_auto tokens (BOS included), 1 token generated, streaming, $TTFT_THREADS threads"
awk -F'\t' '
'"$AWK_MEDIAN"'
    function ms(v) { return v < 0 ? "-" : sprintf("%.1f", 1e3 * v) }
    function ratio(a, b) { return a < 0 || b <= 0 ? "-" : sprintf("%.3f", a / b) }
    { add($2 SUBSEP $3, $4) }
    END {
        printf "%-40s %11s %11s %9s %12s %9s\n", "", "TTFT 1st", "TTFT 2nd", "2nd/1st", "computed 2nd", "2nd/LS2"
        ls2 = med("llama" SUBSEP "ttft2")
        split("llama auto off", C, " ")
        name["llama"] = "llama-server (cache_prompt)"
        name["auto"] = "prefixd (cache.auto_mb=256)"
        name["off"] = "prefixd (cache.auto_mb=0)"
        for (i = 1; i <= 3; i++) {
            c = C[i]; f = med(c SUBSEP "ttft1"); w = med(c SUBSEP "ttft2")
            printf "%-40s %11s %11s %9s %12s %9s\n", name[c], ms(f), ms(w), ratio(w, f), med(c SUBSEP "computed2"), ratio(w, ls2)
        }
    }' "$AT"
say "TTFT in ms from connecting to the first streamed token; each server new, the 1st request computes the whole prompt."
say "computed 2nd: prompt tokens the 2nd request computed (llama-server prompt_n; prefixd prompt - cached_tokens)."
say "2nd/LS2: the 2nd request's TTFT over llama-server's (below 1.00: prefixd answers sooner)."
fi

((DO_TTFT)) || exit 0

# The stores: one per (retention, KV dtype), written once (not timed).
CONFIGS=()
for cfg in 1.0:f32 0.25:f32 1.0:f16 0.25:f16; do
    ret=${cfg%%:*} dt=${cfg#*:} store=$WORK/store-$ret-$dt
    if ! "$PCTL" compress --model "$SMOL" --policy compactor --retention "$ret" --dtype "$dt" --threads "$TTFT_THREADS" \
        --text "$WORK/prefix.txt" --store "$store" > "$WORK/compress-$ret-$dt.log" 2>&1; then
        warn "prefixctl compress at retention $ret ($dt) failed: $(tail -1 "$WORK/compress-$ret-$dt.log")"
        continue
    fi
    id=$("$PCTL" store --dir "$store" list | awk 'NR == 2 { print $1 }')
    show=$("$PCTL" store --dir "$store" show "$id" 2>&1)
    bytes=$(awk '/^size:/ { gsub(/[()]/, ""); for (i = 1; i <= NF; i++) if ($(i + 1) == "bytes") print $i }' <<< "$show")
    tokens=$(awk '/^tokens:/ { print $2 }' <<< "$show")
    [[ $tokens == "$n_prefix" ]] || warn "the store at retention $ret holds $tokens tokens, not $n_prefix"
    printf '0\t%s\tbytes\t%s\n' "$cfg" "${bytes:-0}" >> "$TT"
    printf '0\t%s\tkept\t%s\n' "$cfg" "$(awk '/^kept rows:/ { print $3 "/" $5 }' <<< "$show")" >> "$TT"
    CONFIGS+=("$cfg")
done
((${#CONFIGS[@]})) || die "no compressed prefix could be stored"

for ((r = 1; r <= ROUNDS; r++)); do
    if ((r % 2)); then
        run_llama_server "$r"
        for cfg in "${CONFIGS[@]}"; do run_prefixd_server "$r" "$cfg" "$WORK/store-${cfg%%:*}-${cfg#*:}"; done
    else
        for cfg in "${CONFIGS[@]}"; do run_prefixd_server "$r" "$cfg" "$WORK/store-${cfg%%:*}-${cfg#*:}"; done
        run_llama_server "$r"
    fi
    printf 'round %d/%d  TTFT ms, fresh / warm: llama-server %s / %s (restore + request %s)' "$r" "$ROUNDS" \
        "$(awk -F'\t' -v r="$r" '$1 == r && $2 == "llama" && $3 == "ttft1" { printf "%.1f", 1e3 * $4 }' "$TT")" \
        "$(awk -F'\t' -v r="$r" '$1 == r && $2 == "llama" && $3 == "ttft2" { printf "%.1f", 1e3 * $4 }' "$TT")" \
        "$(awk -F'\t' -v r="$r" '$1 == r && $2 == "llama" && ($3 == "restore" || $3 == "ttft3") { s += $4; n++ } END { if (n == 2) printf "%.1f", 1e3 * s }' "$TT")"
    for cfg in "${CONFIGS[@]}"; do
        printf ', prefixd %s %s / %s' "$cfg" \
            "$(awk -F'\t' -v r="$r" -v c="$cfg" '$1 == r && $2 == c && $3 == "ttft1" { printf "%.1f", 1e3 * $4 }' "$TT")" \
            "$(awk -F'\t' -v r="$r" -v c="$cfg" '$1 == r && $2 == c && $3 == "ttft2" { printf "%.1f", 1e3 * $4 }' "$TT")"
    done
    printf '\n'
done

say ""
say "== stored prefix and time to first token, medians of $ROUNDS round(s): $n_prefix-token prefix + $n_suffix-token suffix, 1 token generated, streaming, $TTFT_THREADS threads"
cfg_list=$(printf '%s ' "${CONFIGS[@]}")
awk -F'\t' -v cfgs="$cfg_list" -v nprefix="$n_prefix" -v nsuffix="$n_suffix" '
'"$AWK_MEDIAN"'
    function ms(v) { return v < 0 ? "-" : sprintf("%.1f", 1e3 * v) }
    function ratio(a, b) { return a < 0 || b <= 0 ? "-" : sprintf("%.2f", a / b) }
    { add($2 SUBSEP $3, $4) }
    END {
        lb = med("llama" SUBSEP "bytes"); lw = med("llama" SUBSEP "ttft2"); lc = med("llama" SUBSEP "ttft1")
        for (j = 1; j <= cnt["llama" SUBSEP "restore"] && j <= cnt["llama" SUBSEP "ttft3"]; j++)
            add("llama_rs", val["llama" SUBSEP "restore", j] + val["llama" SUBSEP "ttft3", j])
        lr = med("llama_rs")
        printf "%-34s %13s %8s %12s %12s %9s %9s\n", "", "stored bytes", "vs slot", "TTFT fresh", "TTFT warm",
            "fresh/LW", "warm/LW"
        printf "%-34s %13s %8s %12s %12s %9s %9s\n", "llama-server slot file (f16 KV)", lb < 0 ? "-" : sprintf("%d", lb),
            lb < 0 ? "-" : "1.00", ms(lc), ms(lw), ratio(lc, lw), "1.00"
        printf "%-34s %13s %8s %12s %12s %9s %9s\n", "llama-server restart + slot restore", "", "", ms(lr), "-",
            ratio(lr, lw), "-"
        n = split(cfgs, C, " ")
        for (i = 1; i <= n; i++) {
            c = C[i]; split(c, rd, ":")
            b = med(c SUBSEP "bytes"); f = med(c SUBSEP "ttft1"); w = med(c SUBSEP "ttft2")
            printf "%-34s %13s %8s %12s %12s %9s %9s\n", sprintf("prefixd retention %s (%s KV)", rd[1], rd[2]),
                b < 0 ? "-" : sprintf("%d", b), ratio(b, lb), ms(f), ms(w), ratio(f, lw), ratio(w, lw)
        }
        printf "\n"
        printf "TTFT in ms. llama-server: fresh = the 1st request to a new server, nothing cached (full prefill of %d\n", nprefix + nsuffix
        printf "  tokens); warm (LW) = the 2nd, the same prefix with another suffix (cache_prompt reuses the prefix and\n"
        printf "  recomputes the suffix). Tokens computed (median): 1st %s, 2nd %s. Slot file: %s tokens (prefix + 2nd suffix).\n",
            med("llama" SUBSEP "prompt_n1"), med("llama" SUBSEP "prompt_n2"), med("llama" SUBSEP "saved_tokens")
        printf "  Restart + slot restore: a new server, POST /slots/0?action=restore of that file (median %s ms), then the\n",
            ms(med("llama" SUBSEP "restore"))
        printf "  1st request again (%s tokens computed); fresh = restore + that TTFT.\n", med("llama" SUBSEP "prompt_n3")
        printf "prefixd: fresh = the 1st request after a restart (prefix read from the store), warm = the 2nd (hot tier);\n"
        printf "  stored prefix used (cached_tokens = %d) in", nprefix
        hits = 0; total = 0
        for (i = 1; i <= n; i++) for (q = 1; q <= 2; q++) { key = C[i] SUBSEP "cached" q; for (j = 1; j <= cnt[key]; j++) { total++; hits += val[key, j] == nprefix } }
        printf " %d of %d requests.\n", hits, total
        for (i = 1; i <= n; i++) if (cnt[C[i] SUBSEP "kept"]) printf "  %s: kept (layer, head, token) rows %s\n", C[i], val[C[i] SUBSEP "kept", 1]
    }' "$TT"
say "fresh/LW, warm/LW: TTFT over llama-server's warm TTFT (below 1.00: prefixd answers sooner)."
