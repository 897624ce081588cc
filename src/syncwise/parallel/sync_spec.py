"""``--sync``: how often and how replicas synchronise, parsed and validated before any worker starts.

every-step: DDP's per-step gradient all-reduce (optionally compressed, ``--compress``);
localsgd / diloco: replicas train alone and average every H steps (``local_sgd.py``);
torch-localsgd: the same with PyTorch's ``PeriodicModelAverager`` (the reference);
pipesgd: every step's gradient all-reduce overlaps the next step's compute (``pipe_sgd.py``).
"""
from __future__ import annotations

import torch

from ..layout import (EVERY_STEP, MAX_OUTER_LR, MAX_PERIOD, MAX_WARMUP, METHODS, SYNC_ACCEPTED, SyncSpec,  # noqa: F401
                      _coerce)

# The spec itself (methods, defaults, bounds, the parser) is torch-free and lives with the layout's other rules
# (syncwise.layout); this module adds the torch dtypes and the strategies' protocol.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ACCEPTED = SYNC_ACCEPTED


class SyncStrategy:
    """What the trainer calls around each optimizer step (steps are 1-based); the defaults do nothing.

    ``syncs_gradients(step)``: let DDP all-reduce this step's gradients; ``exchange(step, last)``: the
    gradient sets to apply now (``None`` = what is in ``.grad``) and seconds waited; ``after_step(step,
    last)``: move parameters after the update, return seconds waited. ``replicas_diverge``: ranks hold
    different parameters between syncs (their model and optimizer state are then checkpointed per rank).
    """

    replicas_diverge = True
    restored = False  # set by load_state_dict
    spec: SyncSpec
    params: list
    syncs = 0

    def syncs_gradients(self, step: int) -> bool:
        return False

    def exchange(self, step: int, last: bool = False) -> tuple[list, float]:
        return [None], 0.0

    def after_step(self, step: int, last: bool = False) -> float:
        return 0.0

    def resumed(self) -> None:
        """Called after a checkpoint was loaded (``self.restored``: this strategy's own state was in it)."""
