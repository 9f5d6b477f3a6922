#!/usr/bin/env bash
# One device call (H200) for the serving-path figures: bench/serve.py, bench/fault.py,
# bench/embed.py (cached vs resident), bench/torch_step.py and compute-sanitizer memcheck on
# the GPU kernels' tests; every stage time-boxed, logs under $OUT, a short table last.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
stage() { local t=$1 name=$2; shift 2; echo "=== $name"; timeout "$t" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$? ($name)"; }
stage ${SERVE_T:-200} serve python3 bench/serve.py --device cuda --dtype bf16 --rows ${SERVE_ROWS:-2000000} --workdir /tmp/serve --save "$OUT/serve.json"
stage ${FAULT_T:-130} fault python3 bench/fault.py --device cuda --dir /tmp/rowcache-fault --json
stage ${EMBED_T:-100} embed bash -c "python3 bench/embed.py --write-tokens /tmp/toks.npy >/dev/null && python3 bench/embed.py --tokens-npy /tmp/toks.npy --skip fp8,static --cached-ratio 2 --reps 10"
stage ${TORCH_T:-60} torch python3 bench/torch_step.py --reps 20 --steps 16
stage ${SAN_T:-70} sanitizer compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_scatter.py tests/kernels/test_gather.py tests/kernels/test_quantize.py -k "not 70_000"
for f in serve fault embed torch sanitizer; do echo "----- $f"; tail -n ${TAIL:-16} "$OUT/$f.log" | cut -c1-220; done
