"""The judges: argparse scripts that measure a claim of the project against its baseline in
the same run, each with ``--quick`` (tiny sizes, what the tests run once).

Run from the repository root as modules, ``python -m bench.<judge> [--quick] [--json]``:
build, read, cache, fault (the cache's fault path against the disk's floor),
gather_kernels, embed_step, overlay, torch_step, mrc, sizing_check, fullsize, and serve (a
package). ``_common`` holds what several judges share; ``floor.c`` is the native floor
reader of fault and serve. Not collected by pytest (``tests/bench/`` runs them).
"""
