#!/usr/bin/env bash
# One device call for Engram (issue 40): the GPU tests of the cache, the embeddings and the
# judges, the host hash's speed (bench.engram_hash, one thread, the CPU's path and the
# scalar fallback), then the judge bench.engram at the largest store the disk holds, arena by
# tune; or (stage v41, not in the default) the judge at DeepSeek-V4.1's own format, warmed,
# beside pinned host memory and the checkpoint layout (bench/engram_v41.py). Stages (STAGES,
# default "tests hash engram") run under `timeout`, bounded by DEADLINE_S; reports and logs
# under $OUT. Usage (repo root, .whl carried):
#   STAGES="tests hash engram" ENGRAM_ARGS="--config v41" bash scripts/engram_gpu.sh
#   STAGES="v41" V41_ARGS="" bash scripts/engram_gpu.sh
set -u
STAGES=${STAGES:-"tests hash engram"}
source "$(dirname "$0")/stages.sh"
if has tests; then
  echo "=== GPU tests: cache, embed, bench (t=$(( $(date +%s) - T0 ))s)"
  timeout "$(lim 200)" python3 -m pytest -m gpu tests/cache tests/embed tests/bench -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|Error" | tail -15
fi
if has hash; then
  echo "=== bench.engram_hash, one thread (t=$(( $(date +%s) - T0 ))s)"
  timeout "$(lim 90)" python3 -m bench.engram_hash --threads 1 --repeat 20 2>&1 | tee "$OUT/engram-hash.txt" | tail -12
fi
if has engram; then
  echo "=== bench.engram ${ENGRAM_ARGS:-} (t=$(( $(date +%s) - T0 ))s)"
  df -h /tmp | tail -1; free -g | head -2
  timeout "$(lim 420)" python3 -m bench.engram --device cuda ${ENGRAM_ARGS:-} --json \
    > "$OUT/engram.json" 2> "$OUT/engram.log"
  echo "engram rc=$?"; tail -5 "$OUT/engram.log"
  python3 - "$OUT/engram.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no report: {e}")
for line in d.get("settings", {}).get("log", []):
    print(line)
for r in d.get("results", []):
    print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
PY
fi
if has v41; then
  echo "=== bench.engram --format v41 ${V41_ARGS:-} (t=$(( $(date +%s) - T0 ))s)"
  df -h /tmp | tail -1; free -g | head -2; nproc
  timeout "$(lim 560)" python3 -m bench.engram --format v41 --device cuda ${V41_ARGS:-} --json \
    > "$OUT/v41.json" 2> "$OUT/v41.log"
  echo "v41 rc=$?"
  # the run's log as it went: sizes, each phase's time, each series' figures, a row a mode
  grep -v "^\s*$" "$OUT/v41.log" | grep -v "%), [0-9.]* GB/s$" | cut -c1-700 | tail -60
fi
echo "=== done (t=$(( $(date +%s) - T0 ))s)"
