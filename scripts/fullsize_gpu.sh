#!/usr/bin/env bash
# Issue 14 part 3, in ONE device call (<= 9 min): the full FP8 store on the GPU machine.
#   1. wheels + native extensions (as scripts/gpu_session.sh), one bf16 source of the largest
#      table's rows (10,223,639 x 256, 5.2 GB, random, on disk), reused for all 12 tables;
#   2. build the full FP8 store (12 x 10,223,617+2i x 256, ~31.9 GB) with the GPU quantize
#      (bench.fullsize: build time, GB/s, peak RssAnon, vs a plain write), then verify it;
#   3. bench.build: FP8 (cuda and cpu engines) and BF16 vs plain write (same run);
#   4. bench.sizing_check --device cuda on the full store (profile/tune vs the GPU cache,
#      300k stdlib tokens: SIZING_TOKENS);
#   5. bench.serve (it builds its own store: ours is deleted first).
# Every stage runs under `timeout`, bounded by what is left of DEADLINE_S, and the summary
# table prints whatever finished. Usage (repository root, .whl/ carried):
#   bash scripts/fullsize_gpu.sh          # logs and JSON under $OUT
set -u
T0=$(date +%s)
DEADLINE_S=${DEADLINE_S:-500}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=${W:-/tmp/fullsize}; mkdir -p "$W"
left() { echo $(( DEADLINE_S - ($(date +%s) - T0) )); }
stage() {  # stage NAME LIMIT_S CMD...: run under min(LIMIT_S, time left - 15 s); stdout is
  local name=$1 lim=$2; shift 2  # $OUT/NAME.json, stderr goes to $OUT/stages.log (<= 8 files back)
  local l; l=$(( $(left) - 15 )); [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -le 5 ]; then echo "=== $name: skipped (no time left)"; return 0; fi
  echo "=== $name (limit ${lim}s, t=$(( $(date +%s) - T0 ))s)" | tee -a "$OUT/stages.log"
  timeout "$lim" "$@" > "$OUT/$name.json" 2> "$W/$name.err"
  echo "    rc=$? after $(( $(date +%s) - T0 ))s"
  tr '\r' '\n' < "$W/$name.err" | grep -v '^ *$' | tail -40 >> "$OUT/stages.log"
  tr '\r' '\n' < "$W/$name.err" | grep -v '^ *$' | tail -2
}

ROWS=${ROWS:-10223617}; TABLES=${TABLES:-12}  # smaller only for a smoke test of this script
PY=${PY:-python3}
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
$PY setup.py -q build_ext --inplace 2>&1 | grep -v -i "warn" | tail -3
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
df -h "$W" | tail -1; nproc; free -g | sed -n 2p
$PY -c "import rowcache.store.builder as b; print('fp8 engine:', b._fp8_engine())"

SRC=$W/src.npy
OUT_KEEP=$OUT; OUT=$W  # the source's line stays out of $OUT
stage source 60 $PY - "$SRC" $(( ROWS + 2 * (TABLES - 1) )) <<'EOF'
import sys, time, numpy as np
from concurrent.futures import ThreadPoolExecutor
rows, dim, path = int(sys.argv[2]), 256, sys.argv[1]
out = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint16, shape=(rows, dim))
t0, ch = time.time(), 1 << 18
def fill(s):  # random sign and mantissa, exponent 2^-8..2^7: finite bf16, one seed a block
    e = min(rows, s + ch)
    v = np.random.default_rng([14, s]).integers(0, 1 << 16, size=(e - s, dim), dtype=np.uint16)
    out[s:e] = (v & 0x807F) | (((v >> 7) & 0xF) + 0x77) << 7
with ThreadPoolExecutor(16) as p:
    list(p.map(fill, range(0, rows, ch)))
out.flush()
print('{"source_s": %.1f}' % (time.time() - t0))
EOF
OUT=$OUT_KEEP; cat "$W/source.json"
stage build_fp8 240 $PY -m bench.fullsize --store "$W/store" --source "$SRC" --dtype fp8 --tables $TABLES --rows $ROWS --json
stage verify 90 $PY -m rowcache verify --json --no-progress "$W/store"
stage bench_build 120 $PY -m bench.build --rows ${BUILD_ROWS:-2000000} --repeat 2 --dir "$W/bb" --json
rm -rf "$W/bb"
stage sizing 200 $PY -m bench.sizing_check --device cuda --store "$W/store" --tokens ${SIZING_TOKENS:-300000} --embed-steps 200 --workdir "$W/sizing" --json
if [ -d bench/serve ]; then
  rm -rf "$W/store" "$SRC"  # bench.serve builds its own store from its own tables (outputs are checked)
  stage serve 300 $PY -m bench.serve --device cuda --dtype fp8 --rows $ROWS --workdir "$W/serve" --json
fi

echo "=== summary (t=$(( $(date +%s) - T0 ))s)"
$PY - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(out, name + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
b = load("build_fp8")
if b:
    r = b["results"][0]
    print(f"full FP8 store: {r['tables']} tables, {r['store_GB']:.1f} GB in {r['build_s']:.0f} s "
          f"({r['source_GB_s']:.2f} GB/s of source, {r['ratio_vs_plain']:.2f}x plain write "
          f"{r['plain_write_GB_s']:.2f} GB/s), engine {r.get('fp8_engine')}, "
          f"peak RssAnon {r['peak_RssAnon_MB']:.0f} MB")
v = load("verify")
if v:
    print(f"verify: ok={v.get('ok')} shards={v.get('shards_checked')} bytes={v.get('bytes_checked')}")
s = load("build") or load("bench_build")
if s:
    for r in s["results"]:
        print(f"bench.build {r['dtype']:>4} {r['engine']:>9} threads={r['threads']}: "
              f"{r['build_GB_s']:.2f} GB/s, ratio {r['ratio']:.2f} ({r['ratios']})")
z = load("sizing")
if z:
    for r in z["results"]:
        if r["arena"] in ("all tables", "shared"):
            print(f"sizing {r['budget']:>28} {r['arena']:>10}: faults {r['faults']:,} = exact "
                  f"{r['exact_pred']:,}? {r['equal']}; SHARDS err {r['shards_err_pct']:+.2f}%; "
                  f"fault us/token tune {r['tune_fault_us_per_token']:.1f} vs measured "
                  f"{r['measured_fault_us_per_token']:.1f}"
                  + (f"; {r['embed_tokens_s']:.0f} tok/s" if r.get("embed_tokens_s") else ""))
if load("serve"):
    print("bench.serve: see", os.path.join(out, "serve.json"))
EOF
rm -rf "$W"
