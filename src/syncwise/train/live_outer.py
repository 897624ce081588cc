"""Local SGD / DiLoCo workers as live-recovery replicas (docs/live-recovery.md): :class:`LiveOuterSync`, a quorum
and a commit once per round through :class:`syncwise.train.live_recovery.LiveRecovery`'s torchft manager."""
from __future__ import annotations

import sys
import time
from typing import Any

import torch

class LiveOuterSync:
    """Local SGD / DiLoCo with each replica group (one process) as a worker, on torchft (docs/live-recovery.md).

    Syncwise's :class:`~syncwise.parallel.local_sgd.LocalSGD` keeps the replica state (parameters as views of one
    flat fp32 buffer), the anchor (the last agreed parameters) and the outer optimizer (DiLoCo: SGD with Nesterov
    momentum; local SGD: lr 1, none); this wrapper replaces its communication. A round of ``period`` inner steps:

    1. its first step's quorum (:meth:`LiveRecovery.begin_step`; the inner steps after it run without talking to
       anyone): a replica behind — a replacement, or one whose last outer step did not commit while a peer's did —
       receives the parameters, the anchor and the outer optimizer state, the inner optimizer, the LR schedule,
       the counters and the data position from a live peer (a snapshot taken at the round's start);
    2. its last step (:meth:`after_step`): the pseudo-gradient (anchor − parameters) and the steps this replica
       dropped are averaged over the quorum through torchft's manager, then ``should_commit``: committed, the outer
       optimizer steps the anchor and the parameters become it; not committed (a replica died in the round), the
       parameters go back to the anchor — the round's inner steps are discarded (their metrics rows stay, and the
       sync step's row counts them: ``discarded_inner_steps``).

    The trainer drives it as any sync strategy (its ``exchange`` leaves the gradients local) and checkpoints and
    heals its state as the ``sync`` component. It needs the manager's synchronous quorum (``use_async_quorum=False``,
    as torchft's own DiLoCo requires): the heal must land before the round's first inner step.
    """

    replicas_diverge = False  # one process per replica group: nothing diverges inside the group

    def __init__(self, live: Any, model: Any, spec: Any):  # live: this replica group's LiveRecovery
        from ..parallel.local_sgd import LocalSGD

        self.live, self.spec = live, spec
        # its state and outer optimizer; the all-reduce is torchft's (counted by live in the run's ledger.dp)
        self.inner = LocalSGD(model, spec, group=None, stats=getattr(live, "stats", None))
        self.params = self.inner.params
        self.quorum_due = True           # the next step starts a round (after join: its quorum serves)
        self.discarded_rounds = 0        # outer steps that did not commit (parameters back to the anchor)
        self.discarded_inner_steps = 0   # the inner steps of those rounds
        self._round_start = 1            # the first step of the current round
        self._row: dict[str, Any] = {}

    # the sync-strategy protocol (syncwise.parallel.sync_spec.SyncStrategy), as the trainer asks it
    @property
    def syncs(self) -> int:
        return self.inner.syncs

    @property
    def restored(self) -> bool:
        return self.inner.restored

    def syncs_gradients(self, step: int) -> bool:
        return False

    def exchange(self, step: int, last: bool = False) -> tuple[list, float]:
        self._row = {}
        return [None], 0.0  # the inner optimizer applies this replica's own gradients

    def skip(self, step: int) -> bool:
        return self.inner.skip(step)

    def take_skips(self) -> list[int]:
        return self.inner.take_skips()

    def resumed(self) -> None:
        self.inner.resumed()

    def state_dict(self) -> dict[str, Any]:
        return {**self.inner.state_dict(), "discarded_rounds": self.discarded_rounds,
                "discarded_inner_steps": self.discarded_inner_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
        self.discarded_rounds = int(state.get("discarded_rounds", 0))
        self.discarded_inner_steps = int(state.get("discarded_inner_steps", 0))

    def after_step(self, step: int, last: bool = False) -> float:
        """The outer step at the round's last step (``period`` steps, and the run's last): returns seconds waited."""
        if not self.inner.is_sync_step(step, last):
            return 0.0
        waited = self._outer_step(step)
        self.quorum_due = True
        return waited

    def round_started(self, step: int) -> None:
        """The round's quorum is done (a heal may have moved the trainer to the peers' step): its first step."""
        self.quorum_due, self._round_start = False, step

    @torch.no_grad()
    def _outer_step(self, step: int) -> float:
        inner, manager = self.inner, self.live.manager
        torch.sub(inner.anchor, inner._read(), out=inner._delta)  # this replica's pseudo-gradient
        inner._pack_skips(step, inner._flags)  # the steps it dropped in the round ride along
        started = time.perf_counter()
        manager.allreduce(inner._wire).wait()  # the average over the quorum's replicas (its gloo or NCCL group)
        committed = manager.should_commit()
        waited = time.perf_counter() - started
        if committed:
            inner._unpack_skips(step, inner._flags)
            inner.anchor.grad = inner._delta
            inner.outer_opt.step()
            inner.anchor.grad = None
            inner.syncs += 1
            self.live._record_status(step)
        else:  # back to the last outer step's parameters: this round's inner steps are discarded
            # (the inner AdamW keeps its moments and the LR schedule its steps, as in torchft's DiLoCo)
            steps = step - self._round_start + 1
            self.discarded_rounds += 1
            self.discarded_inner_steps += steps
            self._row = {"discarded_inner_steps": steps}
            print(f"syncwise: live recovery: replica {self.live.replica}: the outer step at step {step} did not "
                  f"commit; the round's {steps} inner step(s) are discarded (parameters back to the last outer "
                  "step's)", file=sys.stderr, flush=True)
        inner._write(inner.anchor)
        return waited

    def row(self) -> dict[str, Any]:
        return dict(self._row)

    def summary(self) -> dict[str, Any]:
        return {"outer_steps": self.inner.syncs, "discarded_rounds": self.discarded_rounds,
                "discarded_inner_steps": self.discarded_inner_steps}
