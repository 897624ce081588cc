"""``--sync``: how often and how replicas synchronise, parsed and validated before any worker starts.

every-step: DDP's per-step gradient all-reduce (optionally compressed, ``--compress``);
localsgd / diloco: replicas train alone and average every H steps (``local_sgd.py``);
torch-localsgd: the same with PyTorch's ``PeriodicModelAverager`` (the reference);
pipesgd: every step's gradient all-reduce overlaps the next step's compute (``pipe_sgd.py``).
"""
from __future__ import annotations

import torch

from ..comm import hostread
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
    ``skip(step)`` / ``take_skips()``: a step one replica dropped, and the drops every replica learns at an average.
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

    # ---- a step one replica dropped (non-finite gradients; issue 23) --------------------------------------
    # Between averages no collective runs, so the replica whose gradients were non-finite is the only one that
    # knows: it drops its own update (the bad gradient never touches its parameters or optimizer state, so there is
    # nothing to exclude from the next average) and the step rides on that average as one flag per step since the
    # last one. Every replica reads the flags and records the step; the LR schedule (the run's, one per step)
    # keeps pace on every replica. A tiny flag all-reduce every step would tell sooner, but it is exactly the
    # per-step collective (lockstep with the slowest rank) that local SGD exists to remove.
    def __init__(self) -> None:
        self.skips: list[int] = []  # steps this replica dropped that the others have not heard of (per-rank state)
        self._learned: list[int] = []  # steps some replica dropped, read from an average, not yet taken

    def skip(self, step: int) -> bool:
        """This replica dropped step ``step``'s update (non-finite gradients). True when the drop is this replica's
        alone (replicas diverge and the step kept its gradients local): it is then carried on the next average;
        False when every rank saw the same gradients (warm-up, Pipe-SGD) and skipped alike."""
        if not self.replicas_diverge or self.syncs_gradients(step):
            return False
        self.skips.append(step)
        return True

    def take_skips(self) -> list[int]:
        """Steps some replica dropped, learned from the averages since the last call (the trainer records them)."""
        learned, self._learned = self._learned, []
        return learned

    def _pack_skips(self, at: int, flags: torch.Tensor) -> None:
        """This replica's dropped steps into ``flags`` (slot d: step ``at - d``), for the average launched at ``at``.
        Every unsent drop is at most ``period - 1`` steps before the launch (one launch per period); one outside the
        slots (only after a resume with another period) is left out of the others' records."""
        flags.zero_()
        for step in self.skips:
            if 0 <= at - step < flags.numel():
                flags[at - step] = 1.0
        self.skips = []

    def _unpack_skips(self, at: int, flags: torch.Tensor) -> None:
        """The averaged flags of the average launched at ``at``: a slot above 0 is a step some replica dropped."""
        with hostread.designed("outer average landed: the steps a replica dropped (once per period)"):
            steps = [at - int(d) for d in torch.nonzero(flags.float() > 0).flatten().tolist()]
        self._learned.extend(sorted(steps))

    def resumed(self) -> None:
        """Called after a checkpoint was loaded (``self.restored``: this strategy's own state was in it)."""
