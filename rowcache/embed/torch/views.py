"""torch <-> cupy plumbing of the PyTorch adapter: views, checks, torch's current stream.

Owns the zero-copy cupy view of a CUDA tensor (:func:`cupy_view`, kept per address by
:class:`TensorViews`), the token tensors' check (:func:`check_token_ids`) and torch's raw current
stream and capture flag (:func:`raw_stream`, :func:`capturing`). Importing it imports
torch. Used by ``rowcache.embed.torch.module``, ``rowcache.embed.torch.packed`` and ``rowcache.embed.torch.static``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rowcache.errors import ConfigError
from rowcache.kernels.reference import BF16


def cupy_view(t: torch.Tensor, owner: Any = True) -> Any:
    """A cupy array over a CUDA tensor's memory, at the tensor's strides (no copy).

    ``owner=True`` keeps the tensor alive as the memory's owner; ``owner=None`` makes a
    bare view (:class:`TensorViews`, whose caller holds the tensor while the view is used).
    The zero-copy exchange DLPack would make, without its stream handshake: the
    embedding runs on torch's current stream itself, so there is no other stream to
    order against, and ``cupy.from_dlpack`` of a torch tensor (``Tensor.__dlpack__``'s
    per-call ``ExternalStream`` and event) took ~65 us a tensor on the H200 host under
    cProfile, this view 3-4 us (``bench/torch_step.py --profile``).
    """
    import cupy as cp

    dtype = _NP_INTS[t.dtype]
    size = t.element_size()
    # the bytes the view spans (torch strides are >= 0; an empty tensor spans none)
    span = 0 if t.numel() == 0 else 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    mem = cp.cuda.UnownedMemory(
        t.data_ptr(), span * size, t if owner is True else None, t.get_device()
    )
    strides = tuple(st * size for st in t.stride())
    return cp.ndarray(
        tuple(t.shape), dtype=dtype, memptr=cp.cuda.MemoryPointer(mem, 0), strides=strides
    )


def _bf16_rows(t: torch.Tensor) -> Any:
    """A bare ml_dtypes-bfloat16 cupy view ``[rows, last dim]`` of a contiguous bf16 tensor."""
    return cupy_view(t.view(torch.int16), owner=None).view(BF16).reshape(-1, t.shape[-1])


_NP_INTS = {torch.int64: np.int64, torch.int16: np.int16, torch.int32: np.int32}
_INT_DTYPES = frozenset(
    {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}
    | {getattr(torch, f"uint{b}") for b in (16, 32, 64) if hasattr(torch, f"uint{b}")}
)
MAX_VIEWS = 64


class TensorViews:
    """Bare cupy views of CUDA tensors, kept by (address, shape, strides, dtype).

    torch's caching allocator hands a step's output and packed tokens the same blocks
    step after step, so the same few views serve every call (a dict lookup, against
    ~3 us to build one). A view owns nothing: it is only used while the caller holds
    the tensor it was looked up for, which is what makes a stale entry harmless (its
    address is looked up again only for a live tensor of the same size)."""

    def __init__(self) -> None:
        self._views: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], Any] = {}
        self._rows: dict[tuple[int, torch.Size], Any] = {}

    def rows(self, t: torch.Tensor) -> Any:
        """The ``[rows, hidden]`` view of a contiguous bfloat16 tensor (a step's output,
        made by the caller), kept by address and shape only."""
        key = (t.data_ptr(), t.shape)
        v = self._rows.get(key)
        if v is None:
            if len(self._rows) >= MAX_VIEWS:
                self._rows.clear()
            v = self._rows[key] = _bf16_rows(t)
        return v

    def __call__(self, t: torch.Tensor, shape: tuple[int, ...] | None = None) -> Any:
        """The view of ``t``: int64 tokens at their strides, or contiguous bf16 rows
        viewed as ml_dtypes bfloat16 ``[rows, hidden]``; or of its memory as ``shape``."""
        key = (t.data_ptr(), t.shape if shape is None else shape, t.stride(), t.dtype)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= MAX_VIEWS:
                self._views.clear()
            if t.dtype == torch.bfloat16:
                v = _bf16_rows(t)
            else:
                v = cupy_view(t, owner=None)
            if shape is not None:
                v = v.reshape(shape)
            self._views[key] = v
        return v


def check_plain_tensor(name: str, t: torch.Tensor) -> None:
    """A one-line ``ConfigError`` naming ``name`` unless ``t`` is a plain tensor with values:
    not on the meta device (shapes only, nothing to read), not nested (rows of several
    lengths) and strided (not sparse), which torch's own calls would refuse deep inside."""
    if t.is_meta:
        raise ConfigError(
            f"{name} is on the meta device (a shape without values, as a model made under "
            "torch.device('meta') or init_empty_weights holds): give a tensor on the CPU or "
            "a CUDA device"
        )
    if t.is_nested:
        raise ConfigError(
            f"{name} is a nested tensor; give a padded [B, L] tensor "
            "(torch.nested.to_padded_tensor) and mark the padding with attention_mask"
        )
    if t.layout != torch.strided:
        raise ConfigError(f"{name} has layout {t.layout}; give a dense tensor (.to_dense())")


def check_token_ids(name: str, t: Any, device: torch.device | None, ndim: int) -> torch.Tensor:
    """``t`` as int64 token ids, checked: a plain tensor (:func:`check_plain_tensor`) of
    integers, ``ndim``-D, on ``device`` (None: not checked)."""
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_plain_tensor(name, t)
    dt = t.dtype
    if dt not in _INT_DTYPES:
        raise ConfigError(f"{name} must hold integer token ids (int64), got {dt}")
    if t.dim() != ndim:
        raise ConfigError(f"{name} must be {ndim}-D, got shape {list(t.shape)}")
    if device is not None and t.get_device() != (-1 if device.index is None else device.index):
        if t.device != device:  # get_device: an int, not a device object, on the common path
            raise ConfigError(
                f"{name} is on {t.device}, input_ids on {device}: put them on one device"
            )
    return t if dt is torch.int64 else t.to(torch.int64)


# torch's current CUDA stream as a cudaStream_t int, and whether it is capturing: the
# private calls torch's own kernels use (the public ones cost ~2-5 us more a call on the
# H200 host), with the public ones where a torch build lacks them
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_CAPTURING = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def raw_stream(index: int) -> int:
    """torch's current CUDA stream on device ``index``, as a ``cudaStream_t`` int."""
    if _RAW_STREAM is not None:
        return int(_RAW_STREAM(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


def capturing() -> bool:
    """Whether torch's current CUDA stream is capturing a graph."""
    if _CAPTURING is not None:
        return bool(_CAPTURING())
    return torch.cuda.is_current_stream_capturing()


class TorchStreams:
    """cupy's view of each torch stream a module has run on (one per stream, kept)."""

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}

    def __call__(self, raw: int, index: int) -> Any:
        """cupy's stream for torch's raw stream ``raw`` on device ``index``."""
        import warnings

        import cupy as cp

        ext = self._streams.get(raw)
        if ext is None:
            if raw == 0:  # torch's default stream is the legacy null stream: cupy's own
                ext = cp.cuda.Stream.null
            else:
                with warnings.catch_warnings():  # cupy 14 deprecates it for a
                    warnings.simplefilter("ignore")  # from_external whose form varies
                    ext = cp.cuda.ExternalStream(raw, index)
            self._streams[raw] = ext
        return ext
