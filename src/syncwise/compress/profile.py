"""Compression ratio and per-bucket compress+decompress CPU cost of a compressor on real gradients.

Runs the compressor in a 1-rank gloo group, so the collectives are local copies and the time is
the compressor's own compute. Wall-clock value on the wire is measured elsewhere (benchmarks, lab).
"""
from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .base import Compressor
from .hook import CompressionPolicy
from ..layout import BUCKET_CAP_MB


def ddp_like_buckets(named: Sequence[tuple[str, torch.Tensor]], bucket_cap_mb: float) -> list[list[int]]:
    """Group tensors in reverse order into buckets of at most ``bucket_cap_mb`` (as DDP does)."""
    cap = bucket_cap_mb * 1024 * 1024
    buckets: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(named))):
        nbytes = named[i][1].numel() * 4
        if buckets[-1] and size + nbytes > cap:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


def profile_compressor(compressor: Compressor, grads: Sequence[tuple[str, torch.Tensor]],
                       bucket_cap_mb: float = BUCKET_CAP_MB, policy: Optional[CompressionPolicy] = None,
                       steps: int = 3, group: Any = None) -> dict[str, Any]:
    """Average ``grads`` (name, tensor) ``steps`` times bucket by bucket; report ratio and ms per bucket.

    Returns ``elements``, ``bytes_sent`` per step, ``ratio`` (fp32 bytes / bytes sent), ``buckets``,
    ``ms_per_bucket`` and ``ms_per_step`` (median over steps, after one warm-up step). ``group``: the process
    group to average over (default: the world; a 1-rank group of its own when none is initialized).
    """
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        policy = policy or CompressionPolicy()
        buckets = ddp_like_buckets(grads, bucket_cap_mb)
        times = []
        sent = 0
        for step in range(steps + 1):
            inputs = [[grads[i][1].clone() for i in b] for b in buckets]  # fresh copies, outside the clock
            before = compressor.counters["bytes_sent"]
            t0 = time.perf_counter()
            for b, ts in zip(buckets, inputs):
                keys = [grads[i][0] for i in b]
                compressor.average(ts, keys, group, [policy.compress(t) for t in ts])
            times.append(time.perf_counter() - t0)
            sent = compressor.counters["bytes_sent"] - before
        elements = sum(t.numel() for _, t in grads)
        med = sorted(times[1:])[len(times[1:]) // 2]
        return {"compressor": repr(compressor), "elements": elements, "bytes_sent": sent,
                "ratio": 4 * elements / max(sent, 1), "buckets": len(buckets),
                "ms_per_step": 1e3 * med, "ms_per_bucket": 1e3 * med / len(buckets)}
    finally:
        if own_group:
            dist.destroy_process_group()


def model_gradients(model: nn.Module, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Gradient-shaped random tensors for every parameter of ``model`` (name, tensor)."""
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]
