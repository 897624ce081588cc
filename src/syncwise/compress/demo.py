"""DeMo-style decoupled momentum (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870) as a DDP gradient hook.

Each rank keeps a momentum ``m`` of its own gradients that is never averaged. Every step, per compressed tensor:

1. ``m ← decay·m + g``  (the local gradient, before any communication)
2. the 2-D view of ``m`` is cut into tiles of up to ``chunk × chunk`` (the largest divisors of its two sides, as
   DeMo's reference does), each tile goes through an orthonormal 2-D DCT-II, and the ``topk`` largest coefficients
   of every tile are this rank's *fast components*;
3. what they decode to is removed from ``m`` — what was not sent stays in the momentum: that is its error feedback;
4. the (int16 tile index, fp32 value) pairs of every rank are all-gathered (6 bytes per coefficient, counted),
   summed in rank order, decoded, and the tensor's update is their mean (``sign=false``) or its sign (DeMo's
   signSGD, the default). The trainer's optimizer then applies it as the averaged gradient.

Every rank decodes the same gathered bytes in the same order, so replicas stay identical. The momentum is
per-tensor compressor state (checkpointed, committed only when every rank's bucket was finite, like every
``GatherCompressor``'s residuals). Tensors the policy leaves uncompressed (norms, biases) are sent as their fp32
gradient mean in the same all-gather.

With the trainer's AdamW (the CLI's optimizer) DeMo's momentum sits *before* AdamW: AdamW then runs its own β1
average and second-moment normalisation on DeMo's update. DeMo proper replaces the optimizer's momentum with
plain SGD on the sign; that is what the Python API gives with ``torch.optim.SGD(momentum=0)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import ConfigError
from .base import GatherCompressor, config_class, flatten, fp32_matmul

MAX_CHUNK = 128  # a tile of 128 x 128 has 16,384 coefficients: its index fits an int16


DeMoConfig = config_class("demo", "DeMoConfig", __name__)  # options, types, defaults: syncwise.layout.COMPRESSORS


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is ≤ ``at_most``."""
    for d in range(min(n, at_most), 0, -1):
        if n % d == 0:
            return d
    return 1


def dct_matrix(n: int, device: Any = "cpu") -> torch.Tensor:
    """The orthonormal DCT-II matrix ``D`` (n × n): ``D @ x`` is ``scipy.fft.dct(x, norm='ortho')``, ``D.T`` inverts it."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(device=device, dtype=torch.float32)


@dataclass(frozen=True)
class Tiling:
    """How one tensor is cut: its 2-D view ``rows × cols`` in ``tile_rows × tile_cols`` tiles, ``k`` kept per tile."""

    rows: int
    cols: int
    tile_rows: int
    tile_cols: int
    k: int

    @property
    def tiles(self) -> int:
        return (self.rows // self.tile_rows) * (self.cols // self.tile_cols)

    @property
    def tile_size(self) -> int:
        return self.tile_rows * self.tile_cols

    @property
    def kept(self) -> int:
        return self.tiles * self.k


class DeMoCompressor(GatherCompressor):
    """Decoupled momentum: each rank sends the top-k DCT coefficients per tile of its local momentum (module doc)."""

    name: ClassVar[str] = "demo"
    Config: ClassVar[type] = DeMoConfig

    def _validate(self) -> None:
        c = self.config
        super()._validate()
        if not 2 <= c.chunk <= MAX_CHUNK:
            raise ConfigError("compress", f"demo:chunk={c.chunk}", f"chunk: an integer in [2, {MAX_CHUNK}]")
        if not 1 <= c.topk <= c.chunk * c.chunk:
            raise ConfigError("compress", f"demo:topk={c.topk}", f"topk: an integer in [1, chunk² = {c.chunk ** 2}]")
        if not 0.0 <= c.decay < 1.0:
            raise ConfigError("compress", f"demo:decay={c.decay}", "decay: a number in [0, 1)")

    @property
    def has_error_feedback(self) -> bool:
        return True  # the momentum is the residual: what was not sent stays in it

    def _transient(self) -> None:
        super()._transient()
        self._bases: dict[tuple[int, str], torch.Tensor] = {}
        self._shapes: list[torch.Size] = []

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in super().__getstate__().items() if k not in ("_bases", "_shapes")}

    def tiling(self, shape: torch.Size) -> Tiling:
        """The tiles of a tensor of ``shape`` (its 2-D view: first dimension × the rest, a 1-D one as 1 × n)."""
        c = self.config
        numel = math.prod(shape)
        rows = shape[0] if len(shape) > 1 else 1
        cols = numel // max(rows, 1)
        tr, tc = largest_divisor(rows, c.chunk), largest_divisor(cols, c.chunk)
        k = max(1, min(tr * tc, math.ceil(c.topk * tr * tc / (c.chunk * c.chunk))))
        return Tiling(rows, cols, tr, tc, k)

    def _basis(self, n: int, device: torch.device) -> torch.Tensor:
        key = (n, str(device))
        d = self._bases.get(key)
        if d is None:
            d = self._bases[key] = dct_matrix(n, device)
        return d

    def _to_tiles(self, x: torch.Tensor, t: Tiling) -> torch.Tensor:
        """(tiles, tile_rows, tile_cols) of the flat tensor ``x``."""
        v = x.view(t.rows // t.tile_rows, t.tile_rows, t.cols // t.tile_cols, t.tile_cols)
        return v.permute(0, 2, 1, 3).reshape(t.tiles, t.tile_rows, t.tile_cols)

    def _from_tiles(self, tiles: torch.Tensor, t: Tiling) -> torch.Tensor:
        v = tiles.view(t.rows // t.tile_rows, t.cols // t.tile_cols, t.tile_rows, t.tile_cols)
        return v.permute(0, 2, 1, 3).reshape(-1)

    def _dct(self, x: torch.Tensor, t: Tiling) -> torch.Tensor:
        """Coefficients (tiles, tile_size) of the flat tensor ``x``: ``D_r · tile · D_cᵀ`` per tile."""
        dr, dc = self._basis(t.tile_rows, x.device), self._basis(t.tile_cols, x.device)
        return fp32_matmul(lambda a, b, c: a @ b @ c, dr, self._to_tiles(x, t), dc.T).reshape(t.tiles, t.tile_size)

    def _idct(self, coeffs: torch.Tensor, t: Tiling) -> torch.Tensor:
        dr, dc = self._basis(t.tile_rows, coeffs.device), self._basis(t.tile_cols, coeffs.device)
        tiles = coeffs.view(t.tiles, t.tile_rows, t.tile_cols)
        return self._from_tiles(fp32_matmul(lambda a, b, c: a @ b @ c, dr.T, tiles, dc), t)

    # ---- GatherCompressor ---------------------------------------------------------------------
    def _compensate(self, comp, keys):
        """decay · momentum + gradient (a fresh vector; the state is committed once every rank was finite)."""
        self._shapes = [t.shape for t in comp]  # read by _encode / _decode_sum of this same bucket (same thread)
        x = flatten([self._residual(k, t) for k, t in zip(keys, comp)]).mul_(self.config.decay)
        return x.add_(flatten(comp))

    def _encode(self, x, sizes, keys, rank):
        values, indices, local, off = [], [], torch.empty_like(x), 0
        for shape, n in zip(self._shapes, sizes):
            t = self.tiling(shape)
            coeffs = self._dct(x[off:off + n], t)
            idx = torch.topk(coeffs.abs(), t.k, dim=1, sorted=False).indices
            val = torch.gather(coeffs, 1, idx)
            values.append(val.reshape(-1))
            indices.append(idx.to(torch.int16).reshape(-1))
            sent = torch.zeros_like(coeffs).scatter_(1, idx, val)
            local[off:off + n] = self._idct(sent, t)  # what this rank's coefficients decode to: leaves the momentum
            off += n
        payload = torch.cat([torch.cat(values).view(torch.uint8), torch.cat(indices).view(torch.uint8)])
        return payload, local

    def _decode_sum(self, gathered, sizes, n):
        world = gathered.shape[0]
        tilings = [self.tiling(s) for s in self._shapes]
        kept = sum(t.kept for t in tilings)
        values = gathered[:, :4 * kept].contiguous().view(torch.float32)
        indices = gathered[:, 4 * kept:6 * kept].contiguous().view(torch.int16)
        out, off, koff = torch.empty(n, device=gathered.device), 0, 0
        for t, size in zip(tilings, sizes):
            idx = indices[:, koff:koff + t.kept].long().view(world, t.tiles, t.k)
            idx = idx + (torch.arange(t.tiles, device=idx.device) * t.tile_size).view(1, -1, 1)
            coeffs = torch.zeros(t.tiles * t.tile_size, device=gathered.device)
            # one index_add per rank, in rank order: a rank's indices are distinct, so even CUDA's atomic adds sum
            # every coefficient in the same order on every rank (identical replicas without deterministic mode)
            for w in range(world):
                coeffs.index_add_(0, idx[w].reshape(-1), values[w, koff:koff + t.kept])
            out[off:off + size] = self._idct(coeffs.view(t.tiles, t.tile_size), t)
            off += size
            koff += t.kept
        if self.config.sign:
            # unpack_sum divides by the world size: the sign of the mean is sign(sum) · world / world
            out.sign_().mul_(world)
        return out

    def payload_bytes(self, shapes: list[torch.Size]) -> int:
        """Bytes this rank sends per step for compressed tensors of ``shapes`` (6 per kept coefficient)."""
        return sum(6 * self.tiling(s).kept for s in shapes)

