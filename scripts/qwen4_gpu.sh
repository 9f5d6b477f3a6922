#!/usr/bin/env bash
# One device call for the Qwen4 n-gram table's judge (issue 49 item 5): the GPU tests of the
# bench (optional), then bench.qwen4 on the GPU (the release's 320M rows unless QWEN4_ARGS
# says --rows). Stages (STAGES, default "qwen4") run under `timeout`, bounded by DEADLINE_S;
# the report and the log under $OUT. Usage (repo root, .whl carried):
#   STAGES="qwen4" QWEN4_ARGS="--budgets tune,1/32" bash scripts/qwen4_gpu.sh
set -u
STAGES=${STAGES:-"qwen4"}
source "$(dirname "$0")/stages.sh"
if has tests; then
  echo "=== GPU tests: bench (t=$(( $(date +%s) - T0 ))s)"
  timeout "$(lim 200)" python3 -m pytest -m gpu tests/bench -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|Error" | tail -15
fi
if has qwen4; then
  echo "=== bench.qwen4 ${QWEN4_ARGS:-} (t=$(( $(date +%s) - T0 ))s)"
  df -h /tmp | tail -1; free -g | head -2; stat -fc %T /sys/fs/cgroup; cat /proc/self/cgroup
  timeout "$(lim 560)" python3 -m bench.qwen4 --device cuda ${QWEN4_ARGS:-} --json \
    > "$OUT/qwen4.json" 2> "$OUT/qwen4.log"
  echo "qwen4 rc=$?"
  # the run's log as it went (a row a budget and mode; all there even where it was cut short)
  grep -v "^\s*$" "$OUT/qwen4.log" | grep -v "it/s\]$" | cut -c1-400 | tail -70
  python3 - "$OUT/qwen4.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no report: {e}")
for r in d.get("targets", []):
    print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
PY
fi
echo "=== done (t=$(( $(date +%s) - T0 ))s)"
