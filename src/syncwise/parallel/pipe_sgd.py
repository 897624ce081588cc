"""Pipe-SGD: the gradient all-reduce of step t runs while step t+1 computes (one step of staleness).

DDP overlaps a step's all-reduce with that step's own backward only; when the network needs longer than
the backward pass, the rest of the all-reduce is exposed. Pipe-SGD (Li et al., NeurIPS 2018) lets it run
across the step boundary instead: step t launches the (optionally fp16/bf16) average of its gradient and
the optimizer then applies the average of step t−1's gradient, which has had a whole step of compute to
arrive. Every rank applies the same averaged gradient, so replicas stay identical (unlike local SGD); the
price is that each update uses a gradient computed one update earlier. The pipeline fills on the first
step (no update) and drains on the last (two updates), so a run makes exactly as many updates as steps.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..comm import ops, timing
from ..comm.stats import CommStats
from .sync_spec import DTYPES, SyncSpec, SyncStrategy


class PipeSGD(SyncStrategy):
    """Delays each step's averaged gradient by one step so its all-reduce overlaps the next step's compute."""

    replicas_diverge = False  # every rank applies the same averaged gradient

    def __init__(self, model: nn.Module, spec: SyncSpec, group: Any = None, stats: Optional[CommStats] = None):
        super().__init__()
        self.spec, self.group, self.stats = spec, group, stats if stats is not None else CommStats()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._pending: Optional[dict[str, Any]] = None
        self.syncs = 0

    def exchange(self, step: int, last: bool = False) -> tuple[list[list[torch.Tensor]], float]:
        """Launch this step's gradient average; return the averaged gradients to apply now and the wait.

        Returns 0 gradient sets on the first step, 2 on the last (the drain), 1 otherwise.
        """
        grads = [p.grad.detach() if p.grad is not None else torch.zeros_like(p) for p in self.params]
        send = _flatten_dense_tensors(grads).to(DTYPES[self.spec.dtype])
        work = ops.all_reduce(send, "avg", group=self.group, async_op=True, stats=self.stats)
        ready, waited = [], 0.0
        if self._pending is not None:
            waited += self._wait(self._pending)
            ready.append(self._unflatten(self._pending["send"]))
        self._pending = {"launched_at": step, "work": work, "send": send}
        if last:
            waited += self._wait(self._pending)
            ready.append(self._unflatten(send))
            self._pending = None
        return ready, waited

    def _wait(self, pending: dict[str, Any]) -> float:
        # comm.timing: CUDA events on a GPU (an NCCL wait() returns at once, having queued a stream wait)
        with timing.timed(pending["send"].device) as iv:
            if pending["work"] is not None:
                pending["work"].wait()
                pending["work"] = None
        self.syncs += 1
        return iv.seconds()

    def _unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [g.to(p.dtype) for p, g in zip(self.params, _unflatten_dense_tensors(flat, self.params))]

    def state_dict(self) -> dict[str, Any]:
        """The averaged gradient still to be applied (waited for, so the checkpoint holds its value)."""
        if self._pending is None:
            return {"pending": None, "syncs": self.syncs}
        if self._pending["work"] is not None:
            self._pending["work"].wait()
            self._pending["work"] = None
        return {"pending": {"launched_at": self._pending["launched_at"], "send": self._pending["send"]},
                "syncs": self.syncs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pending = state.get("pending")
        self._pending = None if pending is None else {**pending, "work": None}
        self.syncs = int(state.get("syncs", 0))
        self.restored = True
