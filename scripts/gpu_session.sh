#!/usr/bin/env bash
# One device call: install the carried wheels, run every GPU test, then the GPU benchmarks.
# Usage on the device machine (repository root): bash scripts/gpu_session.sh [pytest-args]   (writes logs under $OUT)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# the native host kernels (setup.py), built for this machine's Python
python3 setup.py -q build_ext --inplace 2>&1 | grep -v -i "warn" | tail -5
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import cupy, kvikio, lmdb; print('cupy', cupy.__version__, 'kvikio', kvikio.__version__, 'gpu', cupy.cuda.is_available())"
STAGE=${STAGE:-all}
if [ "$STAGE" = all ] || [ "$STAGE" = tests ]; then
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
fi
if [ "$STAGE" = all ] || [ "$STAGE" = bench ]; then
  D=/tmp/benchdata; mkdir -p $D
  for b in ${BENCHES:-gather_kernels cache read build}; do
    echo "=== bench.$b"
    timeout ${BENCH_TIMEOUT:-240} python3 -m bench.$b ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench-$b.log" | tail -25
  done
fi
