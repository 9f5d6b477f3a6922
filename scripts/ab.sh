#!/usr/bin/env bash
# A/B of one bench between two trees in one device call: the tree in A_DIR (e.g.
# `git archive <commit> | tar -x -C .ab-a`, made before the call: the device's copy has no
# .git) and this one run alternately (A B A B) with the same arguments; each run's figures
# are printed side by side. Usage (repo root, GPU machine):
#   A_DIR=.ab-a ARGS="--dtype bf16 --rows 2000000 --tokens 150000" bash scripts/ab.sh serve
#   A_DIR=.ab-a ARGS="--ks 1,12,48,192" bash scripts/ab.sh fault
# A tree from before bench/ became a package runs its bench/<name>.py as a script.
# serve: each phase's ratio, lookahead ratio and fault ms a step; fault: each k's cold step
# (its read, the floor) and warm step, in microseconds.
set -u
BENCH=${1:?give the bench: serve or fault}
case $BENCH in
  serve|fault) ;;
  *) echo "unknown bench $BENCH (serve or fault)"; exit 2 ;;
esac
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
A=${A_DIR:?set A_DIR to the A tree}
for t in "$A" .; do (cd "$t" && python3 setup.py -q build_ext --inplace >/dev/null 2>&1); done
run() {  # $1: label, $2: tree; the JSON report goes to $OUT/$1.json
  case $BENCH in
    serve) set -- "$1" "$2" --workdir /tmp/serve --save "$OUT/$1.json" ;;
    fault) set -- "$1" "$2" --dir /tmp/rowcache-fault --json ;;
  esac
  local label=$1 tree=$2; shift 2
  local entry=(-m "bench.$BENCH")
  [ -f "$tree/bench/$BENCH.py" ] && [ ! -f "$tree/bench/__init__.py" ] && entry=("bench/$BENCH.py")
  (cd "$tree" && PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 timeout ${AB_T:-150} python3 "${entry[@]}" \
    --device cuda ${ARGS:-} "$@" >"$OUT/$label.out" 2>"$OUT/$label.log")
  echo "rc=$? ($label)"
  [ "$BENCH" = fault ] && cp "$OUT/$label.out" "$OUT/$label.json"
  return 0
}
for r in 1 2; do run "a$r" "$A"; run "b$r" .; done
python3 - "$OUT" "$BENCH" <<'PY'
import json, sys, os
rows = {}
for name in ("a1", "b1", "a2", "b2"):
    try:
        text = open(os.path.join(sys.argv[1], name + ".json")).read()
        d = json.loads(text[text.index("{"):])
    except (OSError, ValueError):
        continue
    if sys.argv[2] == "serve":
        for p in d["phases"]:
            deep = "".join(f" / la{k[9:-6]} {v:.3f}" for k, v in p.items()
                           if k.startswith("lookahead") and k.endswith("_ratio") and k[9:-6].isdigit())
            la = p["lookahead_ratio"]
            rows.setdefault(p["phase"], {})[name] = (
                f"{p['ratio']:.3f} / la {la if isinstance(la, str) else f'{la:.3f}'}{deep}"
                f" / fault {p['fault_ms_per_step']:.3f} ms")
    else:
        for r in d["results"]:
            rows.setdefault(f"k={r['k']}", {})[name] = (
                f"cold {r['checked_ms']*1e3:.0f} (read {r['read_ms']*1e3:.0f}, floor "
                f"{r['floor_ms']*1e3:.0f}) warm {r['warm_ms']*1e3:.0f} us")
for key, by in rows.items():
    print(key, "  ".join(f"{k}: {v}" for k, v in by.items()))
PY
