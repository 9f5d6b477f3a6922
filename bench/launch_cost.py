"""Host cost of the CUDA calls a small step is made of (GPU machine), median µs a call.

Not a claim of its own: the measurement behind the fault path's and the rows step's
launch choices. Times, on one stream, 4,000 calls each (rotating blocks, median of
blocks): a cupy ``RawKernel`` call with the fault commit's 15 arguments, the same
kernel through ``rowcache.kernels.loader.RawLaunch`` (``cuLaunchKernel`` on arguments packed
once), a 256-byte host-to-device ``ndarray.set``, ``cupy.empty``, an event record,
and, where torch is installed, ``torch.empty`` on the GPU (four ways) and ``torch.ones``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=4000)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    import cupy as cp

    from rowcache.kernels.loader import RawLaunch, get_kernel

    k = get_kernel("scatter.cu", "fault_commit_16")
    table = cp.zeros((1024, 256), dtype=cp.uint16)
    rec = cp.zeros((4, 512), dtype=cp.uint8)
    side = cp.zeros(64, dtype=cp.int32)
    row_map = cp.full(4096, -1, dtype=cp.int32)
    stream = cp.cuda.Stream(non_blocking=True)
    # fault_commit's 15 parameters: records, side, table, scales, row_map, out, n, n_evicted,
    # n_out, words, records stride, table stride, scale offset, ctl, seq (n = 0: it writes
    # nothing; ctl 0: not a deferred fault)
    args = (np.uint64(rec.data.ptr), np.uint64(side.data.ptr), np.uint64(table.data.ptr),
            np.uint64(0), np.uint64(row_map.data.ptr), np.uint64(0), np.int64(0), np.int64(0),
            np.int64(0), np.int64(32), np.int64(32), np.int64(32), np.int64(256), np.uint64(0),
            np.int64(0))  # fmt: skip
    raw = RawLaunch(k, len(args))
    raw.pack(args)
    import cupyx

    pinned = cupyx.empty_pinned(64, dtype=np.int32)
    dev = cp.zeros(64, dtype=cp.int32)
    ev = cp.cuda.Event(disable_timing=True)

    def cupy_call():
        with stream:
            k((1,), (32, 8), args)

    def raw_call():
        raw.values[6] = 0  # as a hot launcher sets n
        raw((1,), (32, 8), stream.ptr)

    def copy_set():
        dev.set(pinned, stream=stream)

    def empty():
        cp.empty(64, dtype=cp.int32)

    def record():
        ev.record(stream)

    cases = {"cupy kernel call (15 args)": cupy_call, "RawLaunch (15 args)": raw_call,
             "ndarray.set 256 B": copy_set, "cupy.empty": empty, "event record": record}  # fmt: skip
    try:
        import torch

        tdev = torch.device("cuda", torch.cuda.current_device())
        proto = torch.empty(1, dtype=torch.bfloat16, device=tdev)
        shape = (1, 1, 3072)
        cases["torch.empty (cuda)"] = lambda: torch.empty(shape, dtype=torch.bfloat16,
                                                          device="cuda")  # fmt: skip
        cases["torch.empty (device object)"] = lambda: torch.empty(
            shape, dtype=torch.bfloat16, device=tdev
        )
        cases["Tensor.new_empty"] = lambda: proto.new_empty(shape)
        cases["torch.empty_like"] = lambda: torch.empty_like(proto)
        cases["torch.ones(1) (alloc + a fill)"] = lambda: torch.ones(1, device=tdev)
    except Exception:
        pass
    blocks = {name: [] for name in cases}
    per = 200
    for _ in range(a.calls // per):
        for name, f in cases.items():
            t0 = time.perf_counter()
            for _ in range(per):
                f()
            blocks[name].append((time.perf_counter() - t0) / per * 1e6)
            stream.synchronize()
    res = {name: float(np.median(v)) for name, v in blocks.items()}
    if a.json:
        print(json.dumps(res))
    for name, v in res.items():
        print(f"{name:30s} {v:7.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
