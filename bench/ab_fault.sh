#!/usr/bin/env bash
# A/B of bench/fault.py between two trees in one device call: the tree in A_DIR (e.g.
# `git archive <commit> | tar -x -C .ab-a`, made before the call: the device's copy has no
# .git) and this one run alternately (A B A B) on one store, with the same arguments; the
# cold and warm steps of each run are printed side by side. Usage (repo root, GPU machine):
#   A_DIR=.ab-a FAULT_ARGS="--ks 1,12,48,192" bash bench/ab_fault.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
A=${A_DIR:?set A_DIR to the A tree}
for t in "$A" .; do (cd "$t" && python3 setup.py -q build_ext --inplace >/dev/null 2>&1); done
run() {  # $1: label, $2: tree
  (cd "$2" && PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 timeout ${AB_T:-150} python3 bench/fault.py \
    --device cuda --dir /tmp/rowcache-fault ${FAULT_ARGS:-} --json >"$OUT/$1.json" 2>"$OUT/$1.err")
  echo "rc=$? ($1)"
}
for r in 1 2; do run "a$r" "$A"; run "b$r" .; done
python3 - "$OUT" <<'PY'
import json, sys, os
rows = {}
for name in ("a1", "b1", "a2", "b2"):
    path = os.path.join(sys.argv[1], name + ".json")
    try:
        s = open(path).read()
        d = json.loads(s[s.index("{"):])
    except (OSError, ValueError):
        continue
    for r in d["results"]:
        rows.setdefault(r["k"], {})[name] = r
for k, by in rows.items():
    print(f"k={k}: " + "  ".join(
        f"{n}: cold {r['checked_ms']*1e3:.0f} (read {r['read_ms']*1e3:.0f}, floor {r['floor_ms']*1e3:.0f}) warm {r['warm_ms']*1e3:.0f}"
        for n, r in by.items()) + " us")
PY
