"""Side-by-side per-call times (µs) of rowcache's functions in two trees' cProfile runs.

Reads ``{embed,fault}-{a,b}{1,2}.prof`` (and the benches' JSON) in the folder given, prints
each bench's figures and, for the functions whose total time differs most between the
trees, calls and µs a call (cumulative and own) in each run. Used by scripts/profile_ab.sh.
"""

import json
import os
import pstats
import sys


def load(path):
    try:
        st = pstats.Stats(path)
    except (OSError, TypeError, ValueError, EOFError):
        return None
    out = {}
    for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items():
        if "rowcache" not in fn and "cupy" not in fn and "bench" not in fn:
            continue
        short = fn.split("rowcache/", 1)[-1] if "rowcache/" in fn else fn.rsplit("/", 2)[-1]
        out[f"{short}:{name}"] = (nc, tt, ct)
    return out


def figures(folder, bench, tag):
    try:
        text = open(os.path.join(folder, f"{bench}-{tag}.json")).read()
        d = json.loads(text[text.index("{") :])
    except (OSError, ValueError):
        return "no result"
    if bench == "embed":
        return " ".join(
            f"{r['shape']}:{r['ratio_cached_over_resident']:.2f}"
            for r in d.get("cached", [])
            if r["mode"] == "hot replay"
        )
    return " ".join(f"k={r['k']} warm {r['warm_ms'] * 1e3:.0f}us" for r in d.get("results", []))


def main(folder):
    for bench in ("embed", "fault"):
        runs = {t: load(os.path.join(folder, f"{bench}-{t}.prof")) for t in ("b1", "a1", "b2", "a2")}
        runs = {t: r for t, r in runs.items() if r}
        if not runs:
            continue
        print(f"=== {bench}")
        for t in runs:
            print(f"  {t}: {figures(folder, bench, t)}")
        names = set().union(*runs.values())

        def tot(tree, name):
            vals = [r[name][1] for t, r in runs.items() if t[0] == tree and name in r]
            return sum(vals) / len(vals) if vals else 0.0

        diff = sorted(names, key=lambda n: -abs(tot("b", n) - tot("a", n)))[:45]
        for name in diff:
            cells = []
            for t, r in runs.items():
                if name in r:
                    nc, tt, ct = r[name]
                    cells.append(f"{t} {nc:>7} {ct / nc * 1e6:8.1f} {tt / nc * 1e6:7.1f}")
                else:
                    cells.append(f"{t} {'-':>24}")
            print(f"  {name[:60]:60} | " + " | ".join(cells))


main(sys.argv[1])
