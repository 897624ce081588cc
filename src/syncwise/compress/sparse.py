"""Sparsifiers: top-k (DGC-style, error feedback, optional momentum correction) and random-k."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import ConfigError
from .base import (Compressor, CompressorConfig, GatherCompressor, flatten, nonfinite_flag, opt, poison, sizes_of,
                   unflatten_into)


def k_for(numel: int, ratio: float) -> int:
    """Elements kept of a tensor of ``numel`` elements at ``ratio`` (at least 1)."""
    return max(1, min(numel, math.ceil(ratio * numel)))


def _check_ratio(name: str, ratio: float) -> None:
    if not 0.0 < ratio <= 1.0:
        raise ConfigError("compress", f"{name}:ratio={ratio}", "ratio in (0, 1]")


@dataclass
class TopKConfig(CompressorConfig):
    """Options of the top-k compressor."""

    ratio: float = opt(0.01, "fraction of each tensor's elements sent (k = ceil(ratio * numel))")
    error_feedback: bool = opt(True, "accumulate unsent values locally and add them next step")
    momentum: float = opt(0.0, "DGC momentum correction factor (0 = off; then use an optimizer without momentum)")


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
        self._momentum = flatten([u if u is not None and u.shape == t.shape else torch.zeros_like(t)
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

        def commit() -> None:
            off = 0
            for k, t in zip(keys, comp):
                self._slot(k)["momentum"] = momentum[off:off + t.numel()].view_as(t).clone()
                off += t.numel()
            if store_residuals is not None:
                store_residuals()

        return commit

    def _decode_sum(self, gathered, sizes, n):
        k = sum(k_for(s, self.config.ratio) for s in sizes)
        v = gathered[:, :4 * k].contiguous().view(torch.float32).reshape(-1)
        i = gathered[:, 4 * k:].contiguous().view(torch.int32).reshape(-1).long()
        return torch.zeros(n, device=v.device).index_add_(0, i, v)


@dataclass
class RandomKConfig(CompressorConfig):
    """Options of the random-k compressor."""

    ratio: float = opt(0.01, "fraction of each tensor's elements sent")
    error_feedback: bool = opt(True, "accumulate unsent values locally and add them next step")


class RandomKCompressor(Compressor):
    """k random coordinates per tensor, chosen from a seed shared by all ranks (same indices
    everywhere), so the values are summed by ONE fp32 all-reduce (4 bytes per kept element, no
    indices sent); the policy's uncompressed tensors ride in the same all-reduce."""

    name: ClassVar[str] = "randomk"
    Config: ClassVar[type] = RandomKConfig

    def _validate(self) -> None:
        _check_ratio(self.name, self.config.ratio)

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
            # identical on all ranks: seeded from (seed, tensor name, its step counter)
            g = self._generator("randomk", key, self._count(key))
            idx.append(torch.randperm(n, generator=g)[:k_for(n, self.config.ratio)].add_(off).to(x.device))
            off += n
        i = torch.cat(idx)
        # the non-finite flag rides as the last element of the same all-reduce (its sum counts bad ranks)
        flag = nonfinite_flag([x] + list(raw))
        summed = self._average_raw(raw, group, world, extra=torch.cat([x[i], flag.reshape(1)]))
        if summed[-1] > 0:
            return poison(comp + list(raw))
        summed = summed[:-1]
        out = torch.zeros_like(x)
        out[i] = summed.div_(world)
        if ef:
            x[i] = 0.0  # what was not sent stays behind
            off = 0
            for k, t in zip(keys, comp):
                self._residual(k, t).copy_(x[off:off + t.numel()].view_as(t))
                off += t.numel()
        unflatten_into(out, comp)
        return True
