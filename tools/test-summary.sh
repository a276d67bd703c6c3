#!/usr/bin/env bash
# Print one closing line "N passed, N failed, N skipped" from meson's test log,
# counting the Criterion cases inside each test binary. A binary that failed
# without a failing case (a sanitizer report at exit, a crash in teardown)
# counts as one failure.
set -euo pipefail
log="${1:-build}/meson-logs/testlog.json"
[ -f "$log" ] || { echo "test-summary: no $log" >&2; exit 0; }
python3 - "$log" <<'PY'
import json, re, sys
passed = failed = skipped = 0
for line in open(sys.argv[1]):
    t = json.loads(line)
    out = (t.get("stdout") or "") + (t.get("stderr") or "")
    # Criterion: "[====] Synthesis: Tested: N | Passing: N | Failing: N | Crashing: N";
    # skipped cases are left out of it, but --verbose prints "[SKIP]" for each.
    m = re.search(r"Synthesis: Tested: (\d+) \| Passing: (\d+) \| Failing: (\d+) \| Crashing: (\d+)", out)
    p, f = (int(m.group(2)), int(m.group(3)) + int(m.group(4))) if m else (0, 0)
    if t["result"] not in ("OK", "SKIP", "EXPECTEDFAIL") and f == 0:
        f = 1
    passed += p
    failed += f
    skipped += len(re.findall(r"^\[SKIP\]", out, re.M))
print(f"{passed} passed, {failed} failed, {skipped} skipped")
PY
