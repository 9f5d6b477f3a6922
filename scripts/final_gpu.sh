#!/usr/bin/env bash
# One device call for a session's last checks: the GPU suite, compute-sanitizer over the
# kernels' GPU tests, an A/B of bench.embed_step against the tree in A_DIR run in the order
# B A B A B A (so that neither tree always runs first), an A/B of bench.engram --quick
# (engramab), and the Qwen4 judge (QWEN4_ARGS).
# Stages (STAGES) run under `timeout`, bounded by what is left of DEADLINE_S; logs under $OUT.
# Usage (repo root, .whl and A_DIR carried):
#   A_DIR=.ab-a STAGES="tests sanitizer embed qwen4" QWEN4_ARGS="..." bash scripts/final_gpu.sh
set -u
STAGES=${STAGES:-"tests sanitizer embed engramab qwen4"}
source "$(dirname "$0")/stages.sh"
A=${A_DIR:-}
[ -n "$A" ] && (cd "$A" && python3 setup.py -q build_ext --inplace >/dev/null 2>&1)
if has tests; then
  echo "=== GPU suite (t=$(( $(date +%s) - T0 ))s)"
  timeout "$(lim 240)" python3 -m pytest -m gpu tests -p no:cacheprovider -rfE 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|Error" | tail -25
fi
if has sanitizer; then
  echo "=== compute-sanitizer memcheck, kernels' GPU tests (t=$(( $(date +%s) - T0 ))s)"
  timeout "$(lim 120)" compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu tests/kernels -p no:cacheprovider -q -x 2>&1 | tail -3
  echo "sanitizer rc=${PIPESTATUS[0]}"
fi
if has engramab && [ -n "$A" ]; then
  echo "=== A/B bench.engram --quick, B A B A (t=$(( $(date +%s) - T0 ))s)"
  for r in 1 2; do
    for t in . "$A"; do
      tag=$([ "$t" = . ] && echo b || echo a)$r
      (cd "$t" && PYTHONPATH=/tmp/site:$PWD timeout "$(lim 60)" python3 -m bench.engram --device cuda --quick > "$OUT/engram-$tag.out" 2>&1)
      echo "engram $tag rc=$?"; tail -3 "$OUT/engram-$tag.out" | cut -c1-110
    done
  done
fi
if has embed && [ -n "$A" ]; then
  echo "=== A/B bench.embed_step, B A B A B A (t=$(( $(date +%s) - T0 ))s)"
  for r in 1 2 3; do
    for t in . "$A"; do
      tag=$([ "$t" = . ] && echo b || echo a)$r
      (cd "$t" && PYTHONPATH=/tmp/site:$PWD timeout "$(lim 60)" python3 -m bench.embed_step --device cuda --cached-ratio 2 --reps 10 --skip static,fp8 --json > "$OUT/embed-$tag.json" 2> "$OUT/embed-$tag.log")
      echo "embed $tag rc=$?"
    done
  done
  python3 - "$OUT" <<'PY'
import json, sys, os
rows = {}
for tag in ("b1", "a1", "b2", "a2", "b3", "a3"):
    try:
        d = json.load(open(os.path.join(sys.argv[1], f"embed-{tag}.json")))
    except (OSError, ValueError):
        print(tag, "no result"); continue
    for series in ("cached", "cached_graph"):
        for r in d.get(series, []):
            if r["mode"] != "hot replay":
                continue
            key = f"{series:12} {r['shape']:12}"
            rows.setdefault(key, {})[tag] = f"{r['ratio_cached_over_resident']:.2f} ({r['cached_seconds']*1e3:.3f}/{r['resident_seconds']*1e3:.3f})"
for k, by in rows.items():
    print(k, " ".join(f"{t}: {v}" for t, v in sorted(by.items())))
PY
fi
if has qwen4; then
  echo "=== bench.qwen4 ${QWEN4_ARGS:-} (t=$(( $(date +%s) - T0 ))s)"
  df -h /tmp | tail -1; stat -fc %T /sys/fs/cgroup
  timeout "$(lim 420)" python3 -m bench.qwen4 --device cuda ${QWEN4_ARGS:-} --json > "$OUT/qwen4.json" 2> "$OUT/qwen4.log"
  echo "qwen4 rc=$?"; grep -vE "^\s*$" "$OUT/qwen4.log" | grep -v "^build:" | tail -8 | cut -c1-220
  # the figures in the reply itself (its files may not all come back)
  python3 - "$OUT/qwen4.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no report: {e}")
for r in d.get("results", []) + d.get("targets", []):
    print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
PY
fi
echo "=== done (t=$(( $(date +%s) - T0 ))s)"
