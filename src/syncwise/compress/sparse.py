"""Sparsifiers: top-k (DGC-style, error feedback, optional momentum correction) and random-k."""
from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from ..errors import ConfigError
from .base import (Compressor, GatherCompressor, commit, config_class, divisor, flatten, nonfinite_flag, sizes_of,
                   unflatten_into)


def k_for(numel: int, ratio: float) -> int:
    """Elements kept of a tensor of ``numel`` elements at ``ratio`` (at least 1)."""
    return max(1, min(numel, math.ceil(ratio * numel)))


def _check_ratio(name: str, ratio: float) -> None:
    if not 0.0 < ratio <= 1.0:
        raise ConfigError("compress", f"{name}:ratio={ratio}", "ratio in (0, 1]")


TopKConfig = config_class("topk", "TopKConfig", __name__)  # options, types, defaults: syncwise.layout.COMPRESSORS


class TopKCompressor(GatherCompressor):
    """Per tensor, the k largest |values| (fp32) and their int32 bucket offsets are all-gathered in one
    collective (8 bytes per kept element); each rank scatter-adds all ranks' values locally."""

    name: ClassVar[str] = "topk"
    Config: ClassVar[type] = TopKConfig

    def _validate(self) -> None:
        _check_ratio(self.name, self.config.ratio)
        if not 0.0 <= self.config.momentum < 1.0:
            raise ConfigError("compress", f"topk:momentum={self.config.momentum}", "momentum in [0, 1)")

    def _compensate(self, comp, keys):
        m = self.config.momentum
        if m == 0.0:
            return super()._compensate(comp, keys)
        # DGC momentum correction: u = m*u + g; v = residual + u; both masked where sent (in _encode). The
        # new momentum is staged (self._momentum) and stored by _staged_state once every rank was finite.
        olds = [self._slot(k).get("momentum") for k in keys]
        self._momentum = flatten([u.to(t.device) if u is not None and u.shape == t.shape else torch.zeros_like(t)
                                  for u, t in zip(olds, comp)]).mul_(m).add_(flatten(comp))
        x = self._momentum.clone()
        if self.config.error_feedback:
            x.add_(flatten([self._residual(k, t) for k, t in zip(keys, comp)]))
        return x

    def _encode(self, x, sizes, keys, rank):
        vals, idx, off = [], [], 0
        for n in sizes:
            seg = x[off:off + n]
            i = torch.topk(seg.abs(), k_for(n, self.config.ratio), sorted=False).indices
            vals.append(seg[i])
            idx.append(i.add_(off))
            off += n
        v = torch.cat(vals)
        i = torch.cat(idx)
        payload = torch.cat([v.view(torch.uint8), i.to(torch.int32).view(torch.uint8)])
        if self.config.momentum > 0.0:
            self._momentum[i] = 0.0  # momentum factor masking: stop the momentum of coordinates just sent
        local = None
        if self.config.error_feedback:
            local = torch.zeros_like(x)
            local[i] = v
        return payload, local

    def _staged_state(self, comp, keys, x, local):
        store_residuals = super()._staged_state(comp, keys, x, local)
        if self.config.momentum == 0.0:
            return store_residuals
        momentum, self._momentum = self._momentum, None

        def store(ok) -> None:
            off = 0
            for k, t in zip(keys, comp):
                s = self._slot(k)
                old = s.get("momentum")
                if old is None or old.shape != t.shape or old.device != t.device:
                    # what its absence means (zeros), or the loaded one moved to the gradient's device
                    old = s["momentum"] = (torch.zeros_like(t, dtype=momentum.dtype) if old is None or
                                           old.shape != t.shape else old.to(t.device))
                commit(old, momentum[off:off + t.numel()].view_as(t), ok)
                off += t.numel()
            if store_residuals is not None:
                store_residuals(ok)

        return store

    def _decode_sum(self, gathered, sizes, n):
        k = sum(k_for(s, self.config.ratio) for s in sizes)
        v = gathered[:, :4 * k].contiguous().view(torch.float32).reshape(-1)
        i = gathered[:, 4 * k:].contiguous().view(torch.int32).reshape(-1).long()
        out = torch.zeros(n, device=v.device)
        # One index_add_ per rank, in rank order: a rank's indices are distinct (top-k per tensor, offsets apart), so
        # no call adds twice into one element, and each element's sum is ((r0 + r1) + r2) ... on every rank. One
        # index_add_ over every rank's pairs would collide where ranks picked the same coordinate, and CUDA's float
        # atomics add colliding pairs in a scheduling-dependent order: DDP replicas would drift apart (issue 39 N3).
        for w in range(gathered.shape[0]):
            out.index_add_(0, i[w * k:(w + 1) * k], v[w * k:(w + 1) * k])
        return out


RandomKConfig = config_class("randomk", "RandomKConfig", __name__)  # options, types, defaults: syncwise.layout.COMPRESSORS


class RandomKCompressor(Compressor):
    """k random coordinates per tensor, chosen from a seed shared by all ranks (same indices
    everywhere), so the values are summed by ONE fp32 all-reduce (4 bytes per kept element, no
    indices sent); the policy's uncompressed tensors ride in the same all-reduce."""

    name: ClassVar[str] = "randomk"
    Config: ClassVar[type] = RandomKConfig

    def _validate(self) -> None:
        _check_ratio(self.name, self.config.ratio)

    def indices(self, key: str, n: int, device: Any) -> torch.Tensor:
        """The ascending indices of tensor ``key`` (``n`` elements) sent at its current step: k distinct of
        n, uniformly at random, seeded from (seed, key, step count), so every rank draws the same ones (and a
        resumed run draws what the original would have).

        Drawn on a CPU generator and moved to ``device`` (issue 24): the ranks must agree, and a CUDA generator's
        stream depends on the kernel's launch configuration (ranks on different GPU models, or torch builds, could
        draw different indices and sum unrelated coordinates). A CPU draw is the same on every host."""
        device = torch.device(device)
        k = k_for(n, self.config.ratio)
        g = self._generator("randomk", key, self._count(key), device="cpu")
        if 4 * k <= n:
            idx = first_distinct(n, k, g)  # O(k) draws instead of a permutation of n: ~50x faster at 1 %
        else:
            idx = torch.randperm(n, generator=g)[:k].sort().values
        if device.type == "cuda":  # pinned, so the copy is queued on the stream instead of waiting for it (N12)
            return idx.pin_memory().to(device, non_blocking=True)
        return idx.to(device)

    def _average(self, comp, keys, raw, group, world):
        if not comp:
            return self._average_raw_checked(raw, group, world)
        sizes = sizes_of(comp)
        x = flatten(comp)
        ef = self.config.error_feedback
        if ef:
            x.add_(flatten([self._residual(k, t) for k, t in zip(keys, comp)]))
        idx, off = [], 0
        for key, n in zip(keys, sizes):
            idx.append(self.indices(key, n, x.device).add_(off))
            off += n
        i = torch.cat(idx)
        # the non-finite flag rides as the last element of the same all-reduce (its sum counts bad ranks);
        # the verdict stays on the device: a bad bucket comes back NaN with the residuals kept as they were
        summed, ok = self._average_raw(raw, group, world, extra=x[i], flag=nonfinite_flag([x] + list(raw)))
        out = torch.empty_like(x).copy_(torch.where(ok, 0.0, float("nan")))
        out[i] = summed.div_(divisor(ok, world))
        if ef:
            x[i] = 0.0  # what was not sent stays behind
            off = 0
            for k, t in zip(keys, comp):
                commit(self._residual(k, t), x[off:off + t.numel()].view_as(t), ok)
                off += t.numel()
        unflatten_into(out, comp)
        return ok


def first_distinct(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """k distinct indices of ``range(n)``, uniformly at random, ascending: the first k distinct values of
    a stream of uniform draws from ``g`` (sampling without replacement is exactly that). Data-dependent
    sizes: meant for CPU tensors (on a GPU ``unique`` would wait for the device)."""
    drawn = torch.empty(0, dtype=torch.long)
    missing = k
    while missing > 0:
        # repeats among m draws number ~ m^2 / 2n: draw that many more plus slack; draw again on a shortfall
        m = missing + (k * k) // n + 64
        drawn = torch.cat([drawn, torch.randint(n, (m,), generator=g, dtype=torch.long)])
        values, inverse = torch.unique(drawn, sorted=True, return_inverse=True)
        missing = k - values.numel()
    # position of each distinct value's first draw; keep the k drawn first
    first = torch.full((values.numel(),), drawn.numel(), dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(drawn.numel()), "amin")
    keep = first.topk(k, largest=False, sorted=False).indices
    return values[keep.sort().values]
