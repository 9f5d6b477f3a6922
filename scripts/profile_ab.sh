#!/usr/bin/env bash
# One device call that says where a step's host time goes in two trees: cProfile of
# bench.embed_step (cached series, eager, hot replay) and of bench.fault (k=12,48) in the tree
# in A_DIR and in this one, in the order B A B A, then a side-by-side table of the
# per-call times of the step's functions (scripts/prof_table.py). Usage (repo root, .whl and
# A_DIR carried):
#   A_DIR=.ab-a STAGES="embed fault" bash scripts/profile_ab.sh
set -u
STAGES=${STAGES:-"embed fault"}
source "$(dirname "$0")/stages.sh"
A=${A_DIR:?set A_DIR to the A tree}
(cd "$A" && python3 setup.py -q build_ext --inplace >/dev/null 2>&1)
for r in 1 2; do
  for t in . "$A"; do
    tag=$([ "$t" = . ] && echo b || echo a)$r
    if has embed; then
      (cd "$t" && timeout "$(lim 90)" python3 -m cProfile -o "$OUT/embed-$tag.prof" -m bench.embed_step \
        --device cuda --cached-ratio 2 --reps 40 --skip static,fp8,graph,bf16 --json > "$OUT/embed-$tag.json" 2>/dev/null)
      echo "embed $tag rc=$?"
    fi
    if has fault; then
      (cd "$t" && timeout "$(lim 90)" python3 -m cProfile -o "$OUT/fault-$tag.prof" -m bench.fault \
        --device cuda --ks 12,48 --dir /tmp/rowcache-fault --json > "$OUT/fault-$tag.json" 2>/dev/null)
      echo "fault $tag rc=$?"
    fi
  done
done
python3 "$(dirname "$0")/prof_table.py" "$OUT"
