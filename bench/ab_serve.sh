#!/usr/bin/env bash
# A/B of bench/serve.py between two trees in one device call: the tree in A_DIR (e.g.
# `git archive <commit> | tar -x -C .ab-a`, made before the call: the device's copy
# has no .git) and this one run alternately (A B A B) on one store, with the same
# arguments; their phase ratios are printed side by side. Usage (repo root, GPU machine):
#   A_DIR=.ab-a SERVE_ARGS="--dtype bf16 --rows 2000000 --tokens 150000" bash bench/ab_serve.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
A=${A_DIR:?set A_DIR to the A tree}
for t in "$A" .; do (cd "$t" && python3 setup.py -q build_ext --inplace >/dev/null 2>&1); done
run() {  # $1: label, $2: tree
  (cd "$2" && PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 timeout ${AB_T:-150} python3 bench/serve.py \
    --device cuda ${SERVE_ARGS:-} --workdir /tmp/serve --save "$OUT/$1.json" >"$OUT/$1.log" 2>&1)
  echo "rc=$? ($1)"
}
for r in 1 2; do run "a$r" "$A"; run "b$r" .; done
python3 - "$OUT" <<'PY'
import json, sys, os
rows = {}
for name in ("a1", "b1", "a2", "b2"):
    path = os.path.join(sys.argv[1], name + ".json")
    if os.path.exists(path):
        for p in json.load(open(path))["phases"]:
            rows.setdefault(p["phase"], {})[name] = (p["ratio"], p["lookahead_ratio"], p["fault_ms_per_step"])
for phase, by in rows.items():
    print(phase, "  ".join(f"{k}: {v[0]:.3f} / la {v[1]:.3f} / fault {v[2]:.3f} ms" for k, v in by.items()))
PY
