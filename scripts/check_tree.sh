#!/usr/bin/env bash
# One device call that checks a tree after a restructuring against the tree before it: the GPU
# suite, compute-sanitizer over the kernels' tests, A/B of bench.fault and bench.embed_step
# (A = the tree in A_DIR, made before the call with `git archive <commit> | tar -x -C .ab-a`),
# the demo on the GPU, bench.engram, and (engramab) an A/B of bench.engram --quick. Stages (STAGES, default all) run under `timeout`,
# bounded by what is left of DEADLINE_S; logs under $OUT. Usage (repo root, .whl carried):
#   A_DIR=.ab-a STAGES="tests sanitizer fault demo engram" bash scripts/check_tree.sh
set -u
STAGES=${STAGES:-"tests sanitizer fault embed demo engram"}
source "$(dirname "$0")/stages.sh"
A=${A_DIR:-}
[ -n "$A" ] && (cd "$A" && python3 setup.py -q build_ext --inplace >/dev/null 2>&1)
if has tests; then
  echo "=== GPU suite (t=$(( $(date +%s) - T0 ))s)"
  timeout "$(lim 300)" python3 -m pytest -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|Error" | tail -25
fi
if has sanitizer; then
  echo "=== compute-sanitizer memcheck, kernels' GPU tests (t=$(( $(date +%s) - T0 ))s)"
  timeout "$(lim 150)" compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -m gpu tests/kernels -p no:cacheprovider -x 2>&1 | tail -3
  echo "sanitizer rc=${PIPESTATUS[0]}"
fi
if has fault && [ -n "$A" ]; then
  echo "=== A/B bench.fault (t=$(( $(date +%s) - T0 ))s)"
  AB_T=$(( $(lim 400) / 4 )) A_DIR=$A ARGS="${FAULT_ARGS:---ks 1,12,48}" timeout "$(lim 400)" bash scripts/ab.sh fault 2>&1 | tail -8
fi
if has embed && [ -n "$A" ]; then
  echo "=== A/B bench.embed_step (t=$(( $(date +%s) - T0 ))s)"
  for r in 1 2; do
    for t in "$A" .; do
      tag=$([ "$t" = . ] && echo b || echo a)$r
      (cd "$t" && PYTHONPATH=/tmp/site:$PWD timeout "$(lim 150)" python3 -m bench.embed_step --device cuda ${EMBED_ARGS:---cached-ratio 2 --reps 10 --skip static,fp8} --json > "$OUT/embed-$tag.json" 2> "$OUT/embed-$tag.log")
      echo "embed $tag rc=$?"
    done
  done
  python3 - "$OUT" <<'PY'
import json, sys, os
# cached / resident seconds a step at 100 % hits (hot replay) and on the demo text, per shape
rows = {}
for tag in ("a1", "b1", "a2", "b2"):
    try:
        d = json.load(open(os.path.join(sys.argv[1], f"embed-{tag}.json")))
    except (OSError, ValueError):
        print(tag, "no result"); continue
    for series in ("cached", "cached_graph"):
      for r in d.get(series, []):
        key = f"{series:12} {r['shape']:12} {r['mode']:10}"
        rows.setdefault(key, {})[tag] = f"{r['ratio_cached_over_resident']:.3f} ({r['cached_seconds']*1e3:.3f}/{r['resident_seconds']*1e3:.3f} ms)"
for k, by in rows.items():
    print(k, "  ".join(f"{t}: {v}" for t, v in by.items()))
PY
fi
if has demo; then
  echo "=== demo --device cuda (t=$(( $(date +%s) - T0 ))s)"
  timeout "$(lim 120)" python3 -m rowcache demo --device cuda --no-progress 2>&1 | tail -13
fi
if has engramab && [ -n "$A" ]; then
  echo "=== A/B bench.engram --quick (t=$(( $(date +%s) - T0 ))s)"
  for r in 1 2; do
    for t in "$A" .; do
      tag=$([ "$t" = . ] && echo b || echo a)$r
      (cd "$t" && PYTHONPATH=/tmp/site:$PWD timeout "$(lim 90)" python3 -m bench.engram --device cuda --quick > "$OUT/engram-$tag.out" 2>&1)
      echo "engram $tag rc=$?"; tail -4 "$OUT/engram-$tag.out"
    done
  done
fi
if has engram; then
  echo "=== bench.engram (t=$(( $(date +%s) - T0 ))s)"
  timeout "$(lim 300)" python3 -m bench.engram --device cuda ${ENGRAM_ARGS:-} 2>&1 | tail -12
  timeout "$(lim 60)" python3 -m bench.engram_hash --threads 1 2>&1 | tail -9
fi
echo "=== done (t=$(( $(date +%s) - T0 ))s)"
