"""A serving step with n-gram tables on disk: cached vs resident tokens/s, faults vs the disk's floor.

The judge of issue 10. The trace's server model (``rowcache.tools.trace.ServerModel``: 64
request slots, prefill in chunks of 512, then 256 decode tokens one a step, round robin)
runs real text (this interpreter's stdlib source, DeepSeek's tokenizer) through the LongCat
n-gram embedding (``NgramDims.longcat_flash_lite()``: 12 tables x 10,223,617 x 256, or the
largest row count the disk and memory hold, ``--rows``). Each step = the embedding of the
step's tokens + the rest of the model, modelled as a device workload of the step's
duration (``bench/serve/model.py`` documents the arithmetic; ``--rest``). Compared in one
run, on the same steps:

- resident: every table in device memory (HBM; host RAM on the CPU): the baseline;
- cached: the 12 tables through ONE shared ``NgramRowCache`` arena over the store, sized by
  ``rowcache tune`` for a 121 GB machine (profile of the same trace; ``--arena-bytes``);
- cached + lookahead: while step t runs, the rows of step t+1's prefill chunks are
  prefetched (their tokens are the prompt). Decode tokens of step t+1 are sampled at the
  end of step t, so they are never prefetched. ``--lookahead-steps 1,3`` adds a series
  that prefetches three steps ahead (a server knows the prompts it has admitted; the 64-slot
  server only);
- the floor: the pages each cached step faulted, re-read by a native reader
  (``bench/floor.c``, bench/fault.py's, compiled with gcc: io_uring at the cache's
  queue depth, and threads of blocking ``pread``), one batch a step.

Phases: decode x1 (a one-slot server), decode x64 (steps of the 64-slot server with no
prefill chunk), chunked prefill (its steps with at least one chunk; they also carry the
other slots' decode tokens). The first ``--warm`` fraction of each server's steps runs
untimed to fill the arena. ``--history N``: a server that has been serving: the text's first
N tokens come before the trace, and each cached series starts with their rows prefetched
into the arena (untimed; the arena is tuned on history + trace): in one sorted pass where
the arena holds every row of history and trace (no series evicts, checked), else in the
history's order. Without it
the server starts cold, and at this trace's length nearly every fault is a row's first
touch (bench/RESULTS.md). The series of a server take turns of ``--interleave`` steps
(their order rotating), so that a shared machine's drift lands on all of them alike; a
turn ends at the first step after that with no prefetch in flight, within as many steps
again (else a lookahead series' prefetches not started wait for its next turn, and it
waits for the pieces being read, paying that wait).
``--quick``: tiny sizes on the CPU (what the test runs).

Run from the repository root: ``python -m bench.serve [--quick] [--json] ...``. The
package: ``run`` (the judge), ``args`` (its options and series), ``steps`` (requests and
the server's steps), ``series`` (one embedding over a server's steps, the turns), ``model``
(the rest of the model), ``floor`` (the faulted pages re-read natively), ``report``.
"""
