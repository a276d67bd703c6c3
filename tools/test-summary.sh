#!/usr/bin/env bash
# Print one closing line "N passed, N failed, N skipped" from meson's test log,
# counting the Criterion cases inside each test binary.
set -euo pipefail
log="${1:-build}/meson-logs/testlog.txt"
[ -f "$log" ] || { echo "test-summary: no $log" >&2; exit 0; }
# Criterion prints: [====] Synthesis: Tested: N | Passing: N | Failing: N | Crashing: N
# Criterion leaves skipped tests out of its synthesis; with --verbose it prints
# a [SKIP] line for each.
awk '/^\[SKIP\]/ { s++ }
     /Synthesis: Tested:/ {
       for (i = 1; i <= NF; i++) {
         if ($i == "Passing:") p += $(i+1); if ($i == "Failing:") f += $(i+1);
         if ($i == "Crashing:") f += $(i+1);
       }
     }
     END { printf "%d passed, %d failed, %d skipped\n", p, f, s }' "$log"
