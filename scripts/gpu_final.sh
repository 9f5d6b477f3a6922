#!/usr/bin/env bash
# One device call (H200) for the serving-path figures: the GPU tests, bench.serve,
# bench.fault, bench.embed_step (cached vs resident; again with one host thread),
# bench.torch_step and compute-sanitizer memcheck on the GPU kernels' tests; every stage
# time-boxed (demo, demo2: `rowcache demo --device cuda` twice), logs under $OUT, their tails last. STAGES picks and orders them, e.g.
#   STAGES="tests fault torch" bash scripts/gpu_final.sh
# serve's table size and flags: SERVE_DTYPE, SERVE_ROWS, SERVE_ARGS, e.g. a server with history:
#   STAGES=serve SERVE_DTYPE=fp8 SERVE_ROWS=10223617 SERVE_T=585 \
#     SERVE_ARGS="--history 7800000 --tokens-npy .tok/serve-tokens.npy" bash scripts/gpu_final.sh
#   (.tok/serve-tokens.npy: `python -m bench.serve --history 7800000 --write-tokens ...` here,
#   carried; the GPU machine's stdlib has ~2.8M tokens)
# .whl (carried) holds what the GPU machine lacks: ../shared/tools/gpu-wheels.sh's wheels plus
#   crc32c and tqdm (`pip download --no-deps --only-binary=:all: --python-version 3.12
#   --platform manylinux2014_x86_64 -d .whl crc32c tqdm`).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 setup.py -q build_ext --inplace >/dev/null 2>&1
python3 -c "import rowcache.kernels._host, rowcache.io._rcio, rowcache.kernels._quantize" || echo "NATIVE EXTENSIONS MISSING"
stage() { local t=$1 name=$2; shift 2; echo "=== $name"; timeout "$t" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$? ($name)"; }
toks() { [ -f /tmp/toks.npy ] || python3 -m bench.embed_step --write-tokens /tmp/toks.npy >/dev/null; }
STAGES=${STAGES:-"tests serve fault embed torch sanitizer"}
for s in $STAGES; do
  case $s in
    tests) stage ${TESTS_T:-240} tests python3 -m pytest -m gpu -p no:cacheprovider -q -ra -x ;;
    serve) stage ${SERVE_T:-200} serve python3 -m bench.serve --device cuda --dtype ${SERVE_DTYPE:-bf16} --rows ${SERVE_ROWS:-2000000} --workdir /tmp/serve --save "$OUT/serve.json" ${SERVE_ARGS:-} ;;
    fault) stage ${FAULT_T:-130} fault python3 -m bench.fault --device cuda --dir /tmp/rowcache-fault --json ${FAULT_ARGS:-} ;;
    embed) toks; stage ${EMBED_T:-100} embed python3 -m bench.embed_step --tokens-npy /tmp/toks.npy --skip fp8,static --cached-ratio 2 --reps 10 ;;
    embed1) toks; ROWCACHE_HOST_THREADS=1 stage ${EMBED_T:-100} embed1 python3 -m bench.embed_step --tokens-npy /tmp/toks.npy --skip fp8,static --cached-ratio 2 --reps 10 ;;
    rtests) stage ${TESTS_T:-120} rtests python3 -m pytest -m gpu -p no:cacheprovider -q -ra -x tests/embed/test_rows.py tests/embed/test_layer.py -k "rows or hash_gather or gpu_cached" ;;
    sanrows) stage ${SAN_T:-120} sanrows compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 -m pytest -q -m gpu -p no:cacheprovider tests/embed/test_rows.py -k "hash_gather_rows or False" ;;
    ptests) stage ${TESTS_T:-150} ptests python3 -m pytest -m gpu -p no:cacheprovider -q -ra -x tests/cache/test_cache_gpu.py tests/cache/test_prefetch.py tests/embed/test_lookahead.py ;;
    dtests) stage ${TESTS_T:-150} dtests python3 -m pytest -m gpu -p no:cacheprovider -q -ra -x tests/embed/test_defer_reads.py tests/kernels/test_scatter.py tests/cache/test_deferred.py tests/cache/test_cache_gpu.py tests/cache/test_prefetch.py tests/embed/test_lookahead.py ;;
    ttests) stage ${TESTS_T:-120} ttests python3 -m pytest -m gpu -p no:cacheprovider -q -ra -x tests/embed/test_torch_module.py ;;
    demo) stage ${DEMO_T:-120} demo python3 -m rowcache.cli.app demo --device cuda ;;
    demo2) stage ${DEMO_T:-120} demo2 python3 -m rowcache.cli.app demo --device cuda ;;
    torch) stage ${TORCH_T:-90} torch python3 -m bench.torch_step --reps 20 --steps 16 ${TORCH_ARGS:-} ;;
    sanitizer) stage ${SAN_T:-70} sanitizer compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_scatter.py tests/kernels/test_gather.py tests/kernels/test_quantize.py tests/kernels/test_overlay_kernels.py tests/embed/test_ids.py -k "not 70_000" ;;
    *) echo "unknown stage $s" ;;
  esac
done
for f in $STAGES; do echo "----- $f"; tail -n ${TAIL:-16} "$OUT/$f.log" | cut -c1-240; done
