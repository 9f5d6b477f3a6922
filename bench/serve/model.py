"""The serving judge's rest of the model: how long a step's non-embedding work takes, and a
workload that occupies the device for exactly that long.

Owns :class:`RestModel` (the step-time arithmetic, with its defaults for one H200 and for a
121 GB unified-memory box) and :func:`make_workload` (a ``%globaltimer`` spin kernel on the
current CUDA stream, or a GIL-releasing busy compute on the host's main thread).

The arithmetic (LongCat-Flash-Lite, FP8 weights: one byte a parameter):
- decode is bound by reading the weights once a step. Batch 1 reads the active parameters,
  2.9-4.5 B (the zero-computation experts make the count vary per token), plus the
  attention's KV cache: at ~3.5 TB/s achieved of the H200's 4.8 TB/s (4.3 TB/s measured
  device copy) that is 0.8-1.3 ms; we take 1.0 ms (the low end: the embedding's share is
  the largest there). Batch 64 touches most of the ~37 B non-embedding parameters: 37 GB
  at 4 TB/s = 9.25 ms; we take 9.0 ms. In between, the bytes grow with the experts the
  batch touches: linear in the batch from 1 to 64 (a simplification), constant above.
- a prefill chunk is bound by its FLOPs: 2 x 3.7 B (mean active) x tokens, at a rate of
  400 TFLOP/s on the H200 (about 0.75 of the 520 TFLOP/s that a bf16 GEMM of a
  2,048-token chunk reaches there, measured: docs/platform.md; MoE prefill runs smaller
  expert GEMMs and attention). A step takes the larger of its memory and compute times.
- the 121 GB unified-memory box at 273 GB/s reads the same bytes: 3.7 GB / 273 GB/s =
  13.6 ms at batch 1 (the mean active count), 37 GB / 273 GB/s = 135 ms at batch 64; its
  compute rate is taken as 60 TFLOP/s (about half a GB10-class chip's ~125 TFLOP/s dense
  BF16: an assumption, not a measurement).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

ACTIVE_PARAMS = 3.7e9  # mean active parameters a token (2.9-4.5 B)


@dataclass(frozen=True)
class RestModel:
    """Seconds of a step's rest of the model: ``max(memory(n), flops(prefill))``."""

    name: str
    decode1_s: float
    decode64_s: float
    flop_rate: float
    active_params: float = ACTIVE_PARAMS

    def seconds(self, tokens: int, prefill_tokens: int) -> float:
        """A step of ``tokens`` new tokens, ``prefill_tokens`` of them from prefill chunks."""
        if tokens <= 0:
            return 0.0
        n = min(tokens, 64)
        memory = self.decode1_s + (self.decode64_s - self.decode1_s) * (n - 1) / 63
        compute = 2.0 * self.active_params * tokens / self.flop_rate
        return max(memory, compute if prefill_tokens else 0.0)

    def scaled(self, factor: float) -> RestModel:
        return RestModel(
            f"{self.name} x{factor:g}",
            self.decode1_s * factor,
            self.decode64_s * factor,
            self.flop_rate / factor,
            self.active_params,
        )


REST_MODELS = {
    "h200": RestModel("h200", 1.0e-3, 9.0e-3, 400e12),
    "unified-121GB": RestModel("unified-121GB", 13.6e-3, 135e-3, 60e12),
}

_SPIN_SRC = r"""
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


def make_workload(device: str) -> Any:
    """``run(seconds)``: occupy the device that long, in the step's order.

    GPU: one thread of a kernel spinning on ``%globaltimer`` on the current stream (it
    returns at once on the host; the stream is busy for exactly that long whatever the
    clocks, and the embedding's kernels and copies, on the same stream, are ordered
    around it as around a model's kernels). A calibrated GEMM loop would also load
    HBM, but its duration drifts with clocks and L2 state; the spin is exact.
    CPU: the main thread calls a C function (compiled here with gcc, called through
    ctypes, which releases the GIL) that computes until the deadline: one core busy for
    the step, as a native inference engine's compute; the cache's I/O and prefetch
    threads run beside it on the other cores and take the GIL freely meanwhile. (A
    Python loop of small numpy calls instead would make those threads wait for the GIL
    and overshoot its deadline by up to the 5 ms switch interval.)
    """
    if device == "cuda":
        import cupy as cp

        kern = cp.RawKernel(_SPIN_SRC, "spin")

        def run_gpu(seconds: float) -> None:
            if seconds > 0:
                kern((1,), (1,), (np.uint64(int(seconds * 1e9)),))

        run_gpu.queued = True  # returns at once: the host goes on while the device spins
        run_gpu(1e-6)  # compile now, not inside a timed step
        cp.cuda.get_current_stream().synchronize()
        return run_gpu
    tmp = tempfile.mkdtemp(prefix="serve-spin-")
    src, lib = os.path.join(tmp, "spin.c"), os.path.join(tmp, "spin.so")
    with open(src, "w") as f:
        f.write(_CPU_SPIN_SRC)
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", lib, src], check=True)
    spin = ctypes.CDLL(lib).spin_ns
    spin.argtypes, spin.restype = [ctypes.c_longlong], ctypes.c_double
    shutil.rmtree(tmp, ignore_errors=True)  # the loaded library stays mapped

    def run_cpu(seconds: float) -> None:
        if seconds > 0:
            spin(int(seconds * 1e9))

    return run_cpu


_CPU_SPIN_SRC = r"""
#include <time.h>
static long long now(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}
double spin_ns(long long ns) {  /* floating-point work until the deadline */
    volatile double x = 1.0;
    long long end = now() + ns;
    while (now() < end)
        for (int i = 0; i < 256; i++) x = x * 1.0000001 + 1e-9;
    return x;
}
"""
