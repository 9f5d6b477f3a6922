# Sourced by the device scripts (scripts/check_tree.sh, scripts/engram_gpu.sh): the wheels the
# GPU machine lacks installed from .whl, the native extensions built, and the helpers of a
# call run in stages: `has STAGE` (named in $STAGES), `lim SECONDS` (at most that, and what
# is left of $DEADLINE_S less 10 s, for a stage's `timeout`). Sets T0, OUT (made), PYTHONPATH.
T0=$(date +%s)
DEADLINE_S=${DEADLINE_S:-570}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
left() { echo $(( DEADLINE_S - ($(date +%s) - T0) )); }
lim() { local l; l=$(( $(left) - 10 )); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
has() { case " $STAGES " in *" $1 "*) return 0 ;; esac; return 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace 2>&1 | grep -i " error" | head -5
