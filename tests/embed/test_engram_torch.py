"""TorchEngramMemory and a tiny Engram block in torch (the reference's gating and short
convolution, random weights): the same output from cached and resident tables."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rowcache.embed.engram.hash import EngramContext  # noqa: E402
from rowcache.embed.torch.engram import TorchEngramMemory  # noqa: E402
from tests.embed.test_engram_memory import CFG, _setup  # noqa: E402


class TinyEngramBlock(torch.nn.Module):
    """docs/engram-spec.md section 5's model side: for each of ``groups`` hidden copies, a
    key from ``e`` (projected, RMS-normed) gates the normed hidden state (scaled dot product,
    signed square root, sigmoid); the gated value projection plus its depthwise causal
    convolution (RMS-normed per group, kernel 4, dilation max_ngram, SiLU) is the output."""

    def __init__(self, e_dim: int, hidden: int, groups: int, dilation: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.groups, self.hidden = groups, hidden
        self.key = torch.nn.ModuleList(torch.nn.Linear(e_dim, hidden) for _ in range(groups))
        self.value = torch.nn.Linear(e_dim, hidden)
        self.norm_k = torch.nn.ModuleList(torch.nn.RMSNorm(hidden) for _ in range(groups))
        self.norm_q = torch.nn.ModuleList(torch.nn.RMSNorm(hidden) for _ in range(groups))
        self.norm_c = torch.nn.ModuleList(torch.nn.RMSNorm(hidden, eps=1e-5) for _ in range(groups))
        ch = hidden * groups
        self.conv = torch.nn.Conv1d(
            ch, ch, 4, groups=ch, bias=False, padding=3 * dilation, dilation=dilation
        )
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def forward(self, hidden: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        B, T, G, D = hidden.shape
        e = e.float()
        gates = []
        for i in range(G):
            k = self.norm_k[i](self.key[i](e))
            q = self.norm_q[i](hidden[:, :, i])
            gate = (k * q).sum(-1) / math.sqrt(D)
            gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
            gates.append(gate.sigmoid().unsqueeze(-1))
        value = torch.stack(gates, dim=2) * self.value(e).unsqueeze(2)  # [B, T, G, D]
        normed = torch.cat([self.norm_c[i](value[:, :, i]) for i in range(G)], dim=-1)
        y = torch.nn.functional.silu(self.conv(normed.transpose(1, 2))[..., :T])
        return value + y.transpose(1, 2).reshape(B, T, G, D)


def _run(device: str, tmp_path, dtype: str):
    h, _, resident, cached, _ = _setup(tmp_path, dtype, shared=True, device=device)
    mods = {"resident": TorchEngramMemory(resident), "cached": TorchEngramMemory(cached)}
    block = TinyEngramBlock(CFG.output_dim, 16, 2, CFG.max_ngram).to(device)
    rng = np.random.default_rng(7)
    tokens = torch.from_numpy(rng.integers(0, 500, (3, 30)))
    hidden = torch.randn(3, 30, 2, 16, generator=torch.Generator().manual_seed(1)).to(device)
    outs: dict[str, list[torch.Tensor]] = {"resident": [], "cached": []}
    for name, mod in mods.items():
        ctx = EngramContext(h, 3)
        for a, b in ((0, 12), (12, 13), (13, 24), (24, 30)):
            piece = tokens[:, a:b]
            kept = torch.from_numpy(ctx.kept)
            if name == "cached":
                mod.prefetch(piece, kept)
            for layer in CFG.layer_ids:
                e = mod(layer, piece, kept)
                assert e.dtype == torch.bfloat16 and e.shape == (3, b - a, CFG.output_dim)
                assert e.device.type == device
                outs[name].append(block(hidden[:, a:b], e))
            mod.end_step()
            ctx.step(piece.numpy())
    for got, want in zip(outs["cached"], outs["resident"]):
        assert torch.equal(got, want)
    return outs


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_engram_block_cached_equals_resident_cpu(tmp_path, dtype):
    outs = _run("cpu", tmp_path, dtype)
    assert all(torch.isfinite(o).all() for o in outs["cached"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_engram_block_cached_equals_resident_gpu(tmp_path, dtype):
    pytest.importorskip("cupy")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    _run("cuda", tmp_path, dtype)


def test_module_refusals(tmp_path):
    from rowcache.errors import ConfigError

    _, _, resident, _, _ = _setup(tmp_path)
    mod = TorchEngramMemory(resident)
    with pytest.raises(ConfigError, match="integer token ids"):
        mod(1, torch.zeros(1, 2))
    with pytest.raises(ConfigError, match="2-D"):
        mod(1, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ConfigError, match="EngramMemory"):
        TorchEngramMemory(object())
