"""Quantizers: int8 QSGD (stochastic rounding, per-chunk scales) and 1-bit sign with error feedback.

Low-bit values cannot be summed on the wire (int8 sums overflow, packed bits do not add), so both
all-gather one byte payload per rank and reduce locally in fp32 (see :class:`GatherCompressor`).
"""
from __future__ import annotations

from typing import ClassVar

import torch

from ..errors import ConfigError
from .base import GatherCompressor, config_class


Int8Config = config_class("int8", "Int8Config", __name__)  # options, types, defaults: syncwise.layout.COMPRESSORS


class Int8Compressor(GatherCompressor):
    """QSGD int8: q = sign(x) * floor(|x|/scale * s + u), u ~ U[0,1): unbiased, 1 byte/element
    plus 4 bytes per chunk."""

    name: ClassVar[str] = "int8"
    Config: ClassVar[type] = Int8Config

    def _validate(self) -> None:
        c = self.config
        if c.chunk < 1:
            raise ConfigError("compress", f"int8:chunk={c.chunk}", "chunk >= 1")
        if not 1 <= c.levels <= 127:
            raise ConfigError("compress", f"int8:levels={c.levels}", "levels in 1..127")

    def _encode(self, x, sizes, keys, rank):
        c = self.config
        n = x.numel()
        nc = -(-n // c.chunk)
        xp = torch.nn.functional.pad(x, (0, nc * c.chunk - n)).view(nc, c.chunk)
        y = xp.abs()
        scale = y.amax(1).clamp_min_(torch.finfo(torch.float32).tiny)
        y.div_(scale[:, None]).mul_(c.levels)  # in [0, levels]
        if c.stochastic:
            # independent noise per rank and tensor, replayable from (seed, rank, tensor, its step) whatever
            # bucket the tensor lands in (DDP lays buckets out differently in the first step after a resume),
            # drawn on the tensor's device (a CPU draw copied over took 219 ms for 25 M elements on an H100)
            u = torch.empty(nc * c.chunk, device=y.device)
            off = 0
            for key, size in zip(keys, sizes):
                g = self._generator("int8", rank, key, self._count(key), device=y.device)
                u[off:off + size].uniform_(0.0, 1.0, generator=g)
                off += size
            u[n:].zero_()  # the padding quantizes to 0 whatever the noise
            y.add_(u.view_as(y)).floor_().clamp_max_(c.levels)
        else:
            y.round_()
        q = torch.copysign(y, xp, out=y).to(torch.int8)  # y >= 0: the same as y * sign(x), in one pass
        payload = torch.cat([q.view(-1)[:n].view(torch.uint8), scale.view(torch.uint8)])  # no padding sent
        local = None
        if c.error_feedback:
            local = (q.float() * (scale / c.levels)[:, None]).view(-1)[:n]
        return payload, local

    def _decode_sum(self, gathered, sizes, n):
        c = self.config
        nc = -(-n // c.chunk)
        world = gathered.shape[0]
        scale = gathered[:, n:].contiguous().view(torch.float32).view(world, nc, 1) / c.levels
        total = None
        for w in range(world):  # rank order: the same fp32 sum on every rank
            q = gathered[w, :n].view(torch.int8).float()
            q = (q if n == nc * c.chunk else torch.nn.functional.pad(q, (0, nc * c.chunk - n))).view(nc, c.chunk)
            total = q.mul_(scale[w]) if total is None else total.addcmul_(q, scale[w])
        return total.view(-1)[:n]


SignConfig = config_class("sign", "SignConfig", __name__)  # options, types, defaults: syncwise.layout.COMPRESSORS

_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)
# byte -> its 8 signs as +-1.0 (MSB first): decoding is one table lookup instead of shifts and masks
_SIGN_TABLE = ((torch.arange(256, dtype=torch.uint8).unsqueeze(1) >> _SHIFTS) & 1).float().mul_(2).sub_(1)
_ON_DEVICE: dict = {}


def _on(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``table`` on ``device``, copied once per device: a copy from pageable host memory per bucket would
    make the host wait for the device's stream every time."""
    if device.type == "cpu":
        return table
    key = (id(table), device)
    out = _ON_DEVICE.get(key)
    if out is None:
        out = _ON_DEVICE[key] = table.to(device)
    return out


_SIZES: dict = {}


def _on_sizes(sizes: list[int], device: torch.device) -> torch.Tensor:
    """``sizes`` as an int64 tensor on ``device``, made once per bucket layout and device (no pageable copy per
    bucket)."""
    key = (tuple(sizes), device)
    out = _SIZES.get(key)
    if out is None:
        if len(_SIZES) > 4096:
            _SIZES.clear()
        out = _SIZES[key] = torch.tensor(sizes, dtype=torch.long).to(device)
    return out


def _segments(sizes: list[int]) -> list[tuple[int, int]]:
    out, off = [], 0
    for n in sizes:
        out.append((off, off + n))
        off += n
    return out


class SignCompressor(GatherCompressor):
    """1-bit sign, 8 signs packed per byte, one fp32 scale (mean |x|) per tensor, error feedback."""

    name: ClassVar[str] = "sign"
    Config: ClassVar[type] = SignConfig

    def _encode(self, x, sizes, keys, rank):
        n = x.numel()
        segs = _segments(sizes)
        scale = torch.stack([x[a:b].abs().mean() for a, b in segs])
        bits = torch.nn.functional.pad((x >= 0).to(torch.uint8), (0, -n % 8)).view(-1, 8)
        packed = (bits << _on(_SHIFTS, x.device)).sum(1, dtype=torch.uint8)
        payload = torch.cat([packed, scale.view(torch.uint8)])
        local = None
        if self.config.error_feedback:
            local = _on(_SIGN_TABLE, x.device)[packed.long()].view(-1)[:n]
            for (a, b), sc in zip(segs, scale):
                local[a:b].mul_(sc)
        return payload, local

    def _decode_sum(self, gathered, sizes, n):
        nbytes = -(-n // 8)
        signs = _on(_SIGN_TABLE, gathered.device)[gathered[:, :nbytes].long()].view(gathered.shape[0], -1)  # world x 8*nbytes
        scale = gathered[:, nbytes:].contiguous().view(torch.float32)  # world x tensors
        # each element's scale, per rank (world x n): the tensors' scales repeated over their elements
        scale = scale.repeat_interleave(_on_sizes(sizes, gathered.device), dim=1, output_size=n)
        out = torch.mul(signs[0, :n], scale[0])
        for w in range(1, gathered.shape[0]):  # rank order: the same fp32 sum on every rank and every GPU model
            out.addcmul_(signs[w, :n], scale[w])  # (a matrix-vector product sums in the library's own order)
        return out
