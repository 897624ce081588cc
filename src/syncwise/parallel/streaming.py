"""Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512): the model's parameters in F fragments, each synced by
its own DiLoCo outer loop every ``period`` steps, the fragments' syncs staggered by period / F steps.

Only one fragment's pseudo-gradient crosses the wire at a time (peak bandwidth / F, the same bytes per step as
DiLoCo), and with ``delay=D`` each fragment's average overlaps D local steps (the paper's τ; the local progress made
meanwhile is kept, as LocalSGD's overlap does). ``dtype=bf16|fp16`` sends the outer gradients in 16 bits with error
feedback; ``bits=4|8`` quantizes them (one fp32 scale per 256 elements, all-gathered, error feedback: the paper's
4 bits; ``LocalSGD._launch_quantized``). Each fragment is a :class:`~syncwise.parallel.local_sgd.LocalSGD` over its
share of the parameters (contiguous in the module's parameter order, split by element count; floating-point buffers such as MoE
router biases go with the first fragment), with its own anchor, outer Nesterov momentum, cast residual and in-flight
average, all checkpointed. Not built: the paper's mixing of local and global parameters (its α; here α = 0, the
fragment takes the global value plus the local progress made during the overlap).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from ..comm.stats import CommStats
from .local_sgd import LocalSGD
from .sync_spec import SyncSpec, SyncStrategy


class _Fragment(nn.Module):
    """A view of some of a model's parameters (and buffers) as one module, for a fragment's LocalSGD."""

    def __init__(self, params: list[nn.Parameter], buffers: list[torch.Tensor]):
        super().__init__()
        self.params = nn.ParameterList(params)
        for i, b in enumerate(buffers):
            self.register_buffer(f"b{i}", b)


def split_fragments(model: nn.Module, fragments: int) -> list[_Fragment]:
    """Up to ``fragments`` groups of consecutive trainable parameters of about equal element counts (an empty group,
    possible when one parameter outweighs a fragment, is dropped)."""
    params = [p for p in model.parameters() if p.requires_grad]
    fragments = max(1, min(fragments, len(params)))
    total = sum(p.numel() for p in params)
    groups: list[list[nn.Parameter]] = [[] for _ in range(fragments)]
    seen = 0
    for p in params:
        groups[min(seen * fragments // total, fragments - 1)].append(p)  # where its first element falls
        seen += p.numel()
    groups = [g for g in groups if g]
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    return [_Fragment(g, buffers if i == 0 else []) for i, g in enumerate(groups)]


class StreamingDiLoCo(SyncStrategy):
    """F staggered DiLoCo outer loops over the model's parameter fragments (module doc)."""

    def __init__(self, model: nn.Module, spec: SyncSpec, group: Any = None, stats: Optional[CommStats] = None):
        super().__init__()
        self.spec = spec
        self.params = [p for p in model.parameters() if p.requires_grad]
        inner = dataclasses.replace(spec, method="diloco", warmup=0)
        self.stats = stats if stats is not None else CommStats()  # every fragment's outer steps
        self.fragments = [LocalSGD(f, inner, group=group, stats=self.stats)
                          for f in split_fragments(model, spec.fragments)]
        n = len(self.fragments)
        # fragment i syncs at the steps s where (s - warmup + shift_i) % period == 0: staggered by period / n
        self.shifts = [(spec.period * (n - i)) // n % spec.period for i in range(n)]
        self.syncs = 0

    def syncs_gradients(self, step: int) -> bool:
        return step <= self.spec.warmup

    def skip(self, step: int) -> bool:
        """A step this replica dropped rides on every fragment's next average (in the fragment's step numbering),
        so every replica learns it even while some fragments' averages are still a period away."""
        if not super().skip(step):
            return False
        self.skips = []
        for f, shift in zip(self.fragments, self.shifts):
            f.skips.append(step - self.spec.warmup + shift)
        return True

    def take_skips(self) -> list[int]:
        """Steps some replica dropped, learned from any fragment's average (back in the run's step numbering)."""
        return sorted({s - shift + self.spec.warmup for f, shift in zip(self.fragments, self.shifts)
                       for s in f.take_skips()})

    def after_step(self, step: int, last: bool = False) -> float:
        if step <= self.spec.warmup:
            if step == self.spec.warmup:  # replicas are identical here: every fragment's outer loop starts from them
                for f in self.fragments:
                    f.anchor.copy_(f._read())
            return 0.0
        local = step - self.spec.warmup
        waited = sum(f.after_step(local + shift, last) for f, shift in zip(self.fragments, self.shifts))
        self.syncs = sum(f.syncs for f in self.fragments)
        return waited

    def resumed(self) -> None:
        for f in self.fragments:
            f.restored = self.restored
            f.resumed()

    def state_dict(self) -> dict[str, Any]:
        return {"fragments": [f.state_dict() for f in self.fragments], "syncs": self.syncs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f, s in zip(self.fragments, state["fragments"], strict=True):
            f.load_state_dict(s)
        self.syncs = int(state.get("syncs", 0))
        self.restored = True
