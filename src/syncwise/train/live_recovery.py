"""Live recovery: a data-parallel replica is the unit of failure (engine: torchft 0.2.0; docs/live-recovery.md).

Each replica group (a whole copy of the model: one torchrun job of ``dist.nproc`` DDP workers, or FSDP2 workers
whose shards pair up rank for rank across groups: HSDP with torchft as the replicate dimension) has a torchft
``Manager``. Every optimizer step the trainer asks this object three things, on the sync-strategy seam (local SGD /
DiLoCo workers as replicas: :class:`LiveOuterSync`, a quorum and a commit once per round):

1. ``begin_step`` (before the step's batch): a quorum with the other replica groups through the lighthouse. On a
   healthy step it only starts here and runs in torchft's background thread during the batch and forward/backward
   (the first cross-replica all-reduce waits for it); when this replica may be behind (its join, the redo of a step
   that did not commit, the first step after a checkpoint fallback) it is awaited here. A replica that is behind
   receives the current state from a live peer over torchft's HTTP checkpoint transport (model, optimizer, LR
   schedule, GradScaler, the trainer's counters and the data position) — no checkpoint is read — and continues at
   the peers' step, before its forward. Every replica in the quorum counts in the step's average.
2. ``exchange`` (after backward): the gradients are averaged over the replicas that took part in the quorum
   (torchft's reconfigurable process group: NCCL when the replicas compute on CUDA, gloo on the CPU, one rule in
   ``syncwise.devices.replica_backend``; fixed flat buckets that, with one worker per group, go out from
   gradient hooks during backward: ``ReplicaBuckets`` (train/live_buckets.py)), then ``should_commit``: every replica
   group applies the update only when the all-reduce succeeded everywhere in it and at least ``min_replicas``
   replicas took part. A step that does not commit is redone with the next batch (same step number: metrics.jsonl
   keeps one row per step); the batch it used is skipped, not repeated, and counted (``discarded_batches``).
3. ``saves_checkpoints``: only the replica of participating rank 0 writes the shared checkpoints (the replicas are
   identical); when every replica is lost, the first replicas to start again find no live peer (every one is at
   step 0 in the first quorum) and load the newest checkpoint — the checkpoint path as the fallback.

Batch and learning rate while the replica count changes: torchft averages over the participants, so with k of R
replicas the step's global batch is k/R of the configured one and the LR schedule runs on unchanged (one step per
committed step). Fewer samples per step only make the gradient noisier for those steps (no bias); the rows carry
``replicas`` so the loss curve can be read against it. The data each lost replica's shard would have used during
its absence is skipped, never repeated: a replacement continues from the peers' position in its own shard.

torchft is imported only when live recovery is on (requirements-dev.txt pins it; docs say how to install it).
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import hmac
import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch

from ..errors import ConfigError, SyncwiseError
from .. import bind, devices, live_env
from ..secret import ENV_SECRET_FILE, read_secret, sign
from ..parallel.local_sgd import is_dtensor as _is_dtensor
from .callbacks import StepCallback
from .live_buckets import ReplicaBuckets, overlap_ok, wire_dtype

if TYPE_CHECKING:
    from .live_outer import LiveOuterSync

# the environment protocol's names (syncwise.live_env owns them; these aliases are what this module reads)
ENV_REPLICA, ENV_REPLICAS, ENV_LIGHTHOUSE = live_env.REPLICA, live_env.REPLICAS, live_env.LIGHTHOUSE
ENV_MIN, ENV_QUORUM_TIMEOUT, ENV_TIMEOUT = live_env.MIN_REPLICAS, live_env.QUORUM_TIMEOUT_S, live_env.TIMEOUT_S
ENV_STATUS_DIR = live_env.STATUS_DIR


def require_torchft() -> None:
    """torchft importable, else one line that says how to get it."""
    import importlib

    try:
        importlib.import_module("torchft")
    except ImportError as e:
        raise ConfigError("ft.replicas", "≥ 2", f"0 unless torchft is installed (pip install torchft==0.2.0; "
                          f"import failed: {e})") from None


class LiveRecovery:
    """One replica group's side of live recovery (see the module doc). Build it with :meth:`from_env` in a worker
    started by ``syncwise train --ft.replicas=N`` (or ``syncwise.launch.ft``), or with explicit values, and give it
    to ``OptimizedTrainer(..., live_recovery=...)``."""

    def __init__(self, replica: int, replicas: int, lighthouse: str, min_replicas: int = 1,
                 quorum_timeout_s: float = 60.0, timeout_s: float = 30.0, status_dir: Optional[str] = None,
                 secret: Optional[bytes] = None):
        if replicas < 2:
            raise ConfigError("ft.replicas", replicas, "0 (off) or an integer ≥ 2")
        if not 0 <= replica < replicas:
            raise ConfigError("replica", replica, f"an integer from 0 to {replicas - 1}")
        if not 1 <= min_replicas <= replicas:
            raise ConfigError("ft.min_replicas", min_replicas, f"an integer from 1 to ft.replicas ({replicas})")
        if not lighthouse:
            raise ConfigError("ft.lighthouse", lighthouse, "the lighthouse's HOST:PORT")
        require_torchft()
        self.replica, self.replicas, self.min_replicas = replica, replicas, min_replicas
        self.lighthouse = lighthouse if "://" in lighthouse else f"http://{lighthouse}"
        self.quorum_timeout_s, self.timeout_s = quorum_timeout_s, timeout_s
        self.status_dir = Path(status_dir) if status_dir else None
        # the job's secret (secret.py): heal transfers are signed with it (train/heal_transport.py)
        self.secret = secret
        self.manager: Any = None
        self.params: list = []
        self.heals: list[dict] = []             # {"step", "seconds"}: state received from a live peer
        self.discarded = 0                      # steps whose update did not commit (batch skipped, step redone)
        self.participants = 0                   # replica groups in the current quorum
        self.members: list[int] = []            # their indices
        self.changes: list[dict] = []           # quorum size changes: {"step", "replicas", "lost"}
        self.fallback_step: Optional[int] = None  # every replica lost: resumed from this checkpoint step
        self._quorum_ready = False
        self._committed = True
        self._discarded_this_step = 0
        self._quorum_s = self._discarded_s = 0.0     # this step's quorum time, its discarded attempts' time
        self._attempt_started = 0.0
        self._trainer: Any = None
        self.stats: Any = None  # where the cross-replica average is counted (the run's ledger.dp, set by the trainer)
        self.outer: Optional["LiveOuterSync"] = None  # local SGD / DiLoCo workers as replicas (see attach)
        self._state_obj: Any = None
        self._for_peers: dict[str, Any] = {}       # components as they were at this step's start (_state)
        self._peer_lock = threading.Lock()          # _state (torchft's quorum thread) against before_backward
        self._backward_started = False            # this step's backward has begun (before_backward)
        self.peer_copies = 0                      # copies of the gradient sync's state made for healing peers
        self._quorum_pending: Optional[tuple] = None  # (step, started, step before): the async quorum in flight
        self._quorum_error: Optional[BaseException] = None
        self._behind = False                      # the async quorum found this replica behind (_found_behind)
        self._sync_next = False                   # the next quorum is awaited in begin_step (after a fallback)
        self._pending_before = (0, 0)             # the manager's (step, batches committed) before the async quorum
        self._quorum_wait_s = 0.0                  # this step's wait for its async quorum (inside the step)
        self._grads: Optional[ReplicaBuckets] = None
        self._proved_quorum: Optional[int] = None   # the last quorum id whose members all proved the job's secret
        self.wire_device = torch.device("cpu")     # where the cross-replica traffic's tensors live (join)
        self.backend = "gloo"                      # its process group's (devices.replica_backend)

    @classmethod
    def from_env(cls) -> Optional["LiveRecovery"]:
        """The values ``syncwise.launch.ft`` puts in each replica group's environment; None when not set."""
        if ENV_REPLICA not in os.environ:
            return None
        return cls(int(os.environ[ENV_REPLICA]), int(os.environ[ENV_REPLICAS]), os.environ[ENV_LIGHTHOUSE],
                   min_replicas=int(os.environ.get(ENV_MIN, "1")),
                   quorum_timeout_s=float(os.environ.get(ENV_QUORUM_TIMEOUT, "60")),
                   timeout_s=float(os.environ.get(ENV_TIMEOUT, "30")), status_dir=os.environ.get(ENV_STATUS_DIR),
                   secret=read_secret())

    def run_dir(self, base: str) -> str:
        """This replica group attempt's own run directory under ``base`` (BASE/ft/replica{R}.{attempt}), as
        ``syncwise train`` uses: a restarted group never writes over its earlier attempt's files."""
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) + \
            int(os.environ.get(live_env.FIRST_ATTEMPT, "0") or 0)  # (a relaunch numbers on after the last)
        return str(Path(base) / "ft" / f"replica{self.replica}.{attempt}")

    # ------------------------------------------------------------------------ what the trainer asks (its seam)
    replicas_diverge = False  # the sync-strategy protocol: replicas hold the same parameters after every step
    restored = False
    syncs = 0

    def step_callback(self) -> "LiveQuorum":
        """Its part in the training loop (the quorum before each step, the commit after it): a step callback."""
        return LiveQuorum(self)

    def data_shard(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """This rank's data shard over all configured replicas: (shard index, shards). A replica's shard is fixed
        while others come and go (what a lost replica's shard misses is skipped, see the module doc)."""
        return self.replica * dp_size + dp_rank, self.replicas * dp_size

    def attach(self, model: Any, sync: Any) -> Any:
        """The sync strategy the trainer drives: this object (every-step: DDP or FSDP2 inside the replica group,
        the gradients averaged across groups every step), or for a local-SGD / DiLoCo spec (``sync``, a parsed
        SyncSpec; syncwise.layout.check_live_sync says which) a :class:`LiveOuterSync` around syncwise's LocalSGD,
        whose outer step goes through this object's torchft manager once per round."""
        if sync is None:
            return self
        from .live_outer import LiveOuterSync

        self.outer = LiveOuterSync(self, model, sync)
        return self.outer

    def join(self, trainer: Any, state: Any, resume_fallback: Callable[[], Optional[int]]) -> None:
        """Start the Manager and take part in the first quorum (it counts as the quorum of the trainer's next
        step): heal from a live peer when behind. When no replica has trained yet in this quorum (a fresh job, or
        every replica was lost), ``resume_fallback()`` loads the newest checkpoint (None/0: there is none)."""
        import torch.distributed as dist
        from torchft import Manager

        self._trainer, self._state_obj = trainer, state
        self.params = [p for p in trainer.model.parameters() if p.requires_grad]
        # the cross-replica group goes where the gradients are (devices.replica_backend: NCCL for CUDA, gloo for the
        # CPU); torchft builds an NCCL communicator on the current device, so that is this rank's parameters' device
        self.wire_device = _wire_device(self.params, getattr(trainer, "device", None))
        self.backend = devices.replica_backend(self.wire_device.type)
        if self.wire_device.type == "cuda":
            torch.cuda.set_device(self.wire_device)
        group_rank = dist.get_rank() if dist.is_initialized() else 0
        group_size = dist.get_world_size() if dist.is_initialized() else 1
        store_addr = os.environ.get("MASTER_ADDR", "localhost")
        store_port = int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None
        if store_port is None:  # one process, no torchrun: a store of its own (on the job's address only)
            store_addr = _bind_host()
            self._store = bind.tcp_store(store_addr, 0, is_master=True, wait_for_workers=False)
            store_port = self._store.port
        if self.secret is None and group_rank == 0:
            print(f"syncwise: live recovery: replica {self.replica} has no job secret ({ENV_SECRET_FILE}): its heal "
                  "transfers are not authenticated (still loaded as tensors and plain data only)", file=sys.stderr,
                  flush=True)
        with _manager_bound_to(_bind_host()):  # (torchft binds its manager to [::]; this job's address instead)
            self.manager = Manager(
                pg=replica_process_group(self.backend, timedelta(seconds=self.timeout_s)),
                min_replica_size=self.min_replicas,
                load_state_dict=lambda sd: self._load(state, sd), state_dict=lambda: self._state(state),
                # Every quorum member's gradient counts (a replica that heals at its quorum does so before its forward);
                # a healthy step's quorum still runs in the background during forward/backward (_start_async_quorum).
                use_async_quorum=False,
                replica_id=f"replica_{self.replica}", store_addr=store_addr, store_port=store_port, rank=group_rank,
                world_size=group_size, lighthouse_addr=self.lighthouse, hostname=_advertised_host(),
                timeout=timedelta(seconds=self.timeout_s), quorum_timeout=timedelta(seconds=self.quorum_timeout_s),
                connect_timeout=timedelta(seconds=self.quorum_timeout_s),
                checkpoint_transport=_transport(timedelta(seconds=self.timeout_s), self.secret))
        self.manager.load_state_dict({"step": self._progress(trainer.step), "batches_committed": 0})
        deadline = self._wait_for_the_others_at_start()
        self._snapshot_for_peers()
        self._quorum(trainer.step + 1)
        while deadline is not None and self.participants < self.replicas and time.monotonic() < deadline:
            # A fresh job's first quorum must hold every replica group: a group whose Manager had not heartbeated
            # yet is not waited for by the lighthouse (a loaded machine), so ask again until all are in (nobody
            # trains before: every group loops here), or until quorum_timeout_s (a group that never came up)
            time.sleep(0.1)
            self._quorum(trainer.step + 1)
        self._quorum_ready = True
        if self.outer is None:  # (local SGD / DiLoCo: no gradient crosses replicas; the outer step averages)
            self._grads = ReplicaBuckets(self.params, self._issue, overlap=overlap_ok(trainer, group_size),
                                          wire_dtype=wire_dtype(getattr(trainer, "compress_spec", None)))
        for buffer in self._wire_buffers():  # (allocated once: each is checked here, not every step)
            devices.check_replica_wire(self.backend, buffer.device)
        if self.manager.current_step() == 0 and trainer.step == 0:
            step = resume_fallback()
            if step:
                self.fallback_step = step
                self.manager.load_state_dict({"step": step, "batches_committed": 0})
                self._quorum_ready = False  # a new quorum at the checkpoint's step (the others loaded it too)
                self._sync_next = True  # (awaited: a replica that loaded an older checkpoint heals before its forward)
        self._record_status(trainer.step)

    def begin_step(self, step: int) -> None:
        """Before step ``step``'s batch: the step's quorum (after :meth:`join`, its first quorum serves). On a
        healthy step it only starts here and runs in torchft's thread during forward/backward; the first bucket's
        all-reduce waits for it (``quorum_wait_s`` in the row, inside ``step_time_s``). A redo (the last attempt
        did not commit) or the first step after a checkpoint fallback awaits it here instead, so a replica behind
        heals before its forward. The time spent here is outside the step meter's clock (``quorum_s``), as is
        that of the step's discarded attempts (``discarded_s``)."""
        now = time.perf_counter()
        if self._committed:  # a new step (not a redo of a discarded one)
            self._discarded_this_step, self._quorum_s, self._discarded_s = 0, 0.0, 0.0
            self._quorum_wait_s = 0.0
        self._attempt_started = now
        self._behind = False
        if self.outer is not None and not self._quorum_ready and not self.outer.quorum_due:
            return  # local SGD / DiLoCo: an inner step talks to no one (the round's quorum came at its first step)
        if not self._quorum_ready:
            self._snapshot_for_peers()
            if self.outer is not None:  # once a round, awaited (torchft heals those with less committed progress)
                self.manager.load_state_dict({"step": self._progress(step - 1),
                                              "batches_committed": self.manager.batches_committed()})
                self._quorum(step)
            elif self._committed and not self._sync_next:  # healthy: overlaps forward/backward
                self._start_quorum(step)
            else:  # this replica may be behind (peers committed without it): heal before the forward
                self._quorum(step)
            self._sync_next = False
        self._quorum_ready = False
        if self.outer is not None:
            self.outer.round_started(self._trainer.step + 1 if self._trainer is not None else step)
        self._quorum_s += time.perf_counter() - now
        if self._grads is not None:
            self._grads.arm()

    def syncs_gradients(self, step: int) -> bool:
        return True  # inside the replica group: DDP every step

    def exchange(self, step: int, last: bool = False) -> tuple[list, float]:
        """Average the gradients over the quorum's replicas, then ask whether the step commits: ``[None]`` (apply
        the averaged ``.grad``) or ``[]`` (no update: the step is redone). Returns (updates, seconds waited).

        The buckets whose gradients were ready during backward are already on the wire (:class:`~syncwise.train.live_buckets.ReplicaBuckets`);
        the rest are sent now, in the same bucket order on every replica, and all are awaited."""
        start = time.perf_counter()
        self._await_quorum()
        if self._quorum_error is not None:
            raise self._quorum_error
        self._grads.finish()
        if self._behind:  # (see _found_behind)
            self.manager.report_error(SyncwiseError(f"replica {self.replica} was behind at step {step}"))
        self._committed = self.manager.should_commit()
        if not self._committed:
            self.discarded += 1
            self._discarded_this_step += 1
            self._discarded_s += time.perf_counter() - self._attempt_started
        return ([None] if self._committed else []), time.perf_counter() - start

    @property
    def committed(self) -> bool:
        """Whether the last :meth:`exchange` committed (False: the trainer redoes the step with the next batch)."""
        return self._committed

    def after_step(self, step: int, last: bool = False) -> float:
        if self._committed:
            self._record_status(step)
        return 0.0

    def skip(self, step: int) -> bool:
        return False  # a non-finite step: the averaged gradient is non-finite on every replica, all skip alike

    def take_skips(self) -> list[int]:
        return []

    def resumed(self) -> None:
        pass

    def saves_checkpoints(self) -> bool:
        """Only the replica of participating rank 0 writes the (shared) checkpoints."""
        return self.manager is None or self.manager.participating_rank() == 0

    def row(self) -> dict[str, Any]:
        """Extra columns of this step's metrics row."""
        out: dict[str, Any] = {"replicas": self.participants, "replica": self.replica, "quorum_s": self._quorum_s,
                               "quorum_wait_s": self._quorum_wait_s}
        if self._discarded_this_step:  # the attempts that did not commit: their batches and time (outside step_time_s)
            out["discarded_batches"] = self._discarded_this_step
            out["discarded_s"] = self._discarded_s
        if self.outer is not None:
            out.update(self.outer.row())
        return out

    def summary(self) -> dict[str, Any]:
        return {"replica": self.replica, "replicas": self.replicas, "heals": self.heals,
                "discarded_steps": self.discarded, "quorum_changes": self.changes, "fallback_step": self.fallback_step,
                # copies of the gradient sync's state made for a peer that might heal (before_backward, _state)
                "sync_state_copies": self.peer_copies,
                "param_digest": self.param_digest(), **(self.outer.summary() if self.outer is not None else {})}

    def param_digest(self) -> Optional[str]:
        """sha256 of this rank's parameters (replicas must end identical; None above 50 M elements: too slow to
        hash at every run's end)."""
        if self._trainer is None:
            return None
        params = [p.detach() for p in self._trainer.model.parameters()]
        if sum(p.numel() for p in params) > 50_000_000:
            return None
        h = hashlib.sha256()
        for p in params:  # (FSDP2: the whole parameter, gathered inside the replica group; every rank calls this)
            p = p.full_tensor() if _is_dtensor(p) else p
            h.update(p.cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def close(self) -> None:
        if self._grads is not None:
            self._grads.close()
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None

    # ------------------------------------------------------------------------ internals
    def _quorum(self, step: int) -> None:
        """A quorum awaited here, before the step's forward: a replica behind heals now (the join, a redo)."""
        started, before = time.perf_counter(), self.manager.current_step()
        self.manager.start_quorum()
        self._after_quorum(step, started, before)

    def _start_quorum(self, step: int) -> None:
        """A healthy step's quorum, in torchft's background thread while this replica computes (_await_quorum)."""
        self._quorum_pending = (step, time.perf_counter(), self.manager.current_step())
        self._pending_before = (self.manager.current_step(), self.manager.batches_committed())
        self._quorum_error = None
        if not _start_async_quorum(self.manager):  # (another torchft than 0.2.0: the quorum is awaited here)
            self.manager.start_quorum()
            self._await_quorum()

    def _await_quorum(self) -> None:
        """Wait for the async quorum (at the first bucket's all-reduce, or in exchange) and note what it decided.
        An exception is kept for :meth:`exchange` to raise (not thrown through autograd from a gradient hook)."""
        if self._quorum_pending is None:
            return
        step, started, before = self._quorum_pending
        self._quorum_pending = None
        waited = time.perf_counter()
        future, trainer = getattr(self.manager, "_quorum_future", None), self._trainer
        phase = trainer.phase if trainer is not None and future is not None and not future.done() else None
        if phase is not None:  # a hang report names the quorum, not the backward it waits in
            trainer.phase = "live recovery quorum"
        try:
            self.manager.wait_quorum()
        except Exception as e:  # the lighthouse did not answer within quorum_timeout_s: as a synchronous quorum
            self._quorum_error = e
            return
        finally:
            self._quorum_wait_s += time.perf_counter() - waited
            if phase is not None:
                trainer.phase = phase
        try:
            if self.manager.errored() is None and getattr(self.manager, "_healing", False):
                self._found_behind(step)
            else:
                self._after_quorum(step, started, before)  # (raises when the quorum or a transfer failed)
        except SyncwiseError as e:
            self._quorum_error = e

    def _found_behind(self, step: int) -> None:
        """The async quorum found this replica behind (peers committed a step it did not: e.g. it was stopped right
        after a commit) while its forward/backward ran on stale state. It does not load the peers' state in the
        middle of the step (the trainer took its step number and batch from the stale state): it sends zeros
        (the quorum counts it, so the others' update for this one step is (k-1)/k of the average), does not
        commit, and its redo's quorum, awaited before the forward, heals it."""
        before = self._pending_before
        self.manager._pending_state_dict = None
        self.manager._healing = False
        self.manager.load_state_dict({"step": before[0], "batches_committed": before[1]})  # still behind
        self._behind = True
        self._admit(step)  # (its peers check this new quorum's members before their first all-reduce too)
        print(f"syncwise: live recovery: replica {self.replica} found itself behind at step {step}'s quorum; "
              f"it sends zeros, discards this attempt and heals from a live peer before the redo",
              file=sys.stderr, flush=True)

    def _after_quorum(self, step: int, started: float, before: int) -> None:
        """A quorum's outcome: the members (a change is printed and recorded), a heal."""
        if self.manager.errored():
            raise SyncwiseError(f"live recovery: replica {self.replica} could not join the quorum for step {step}: "
                                f"{self.manager.errored()}")
        n = self.manager.num_participants()
        members = self._members()
        strangers = [m for m in members if not 0 <= m < self.replicas]
        if strangers:  # a member the launcher never started (its replica id is not one of replica_0 .. replica_R-1)
            raise SyncwiseError(f"live recovery: replica {self.replica} refuses step {step}'s quorum: it holds "
                                f"replica(s) {strangers}, which this job never started (ft.replicas = "
                                f"{self.replicas}); something outside the job joined the lighthouse (docs/security.md)")
        self._admit(step)
        if n != self.participants or members != self.members:
            lost = sorted(set(self.members) - set(members))
            joined = sorted(set(members) - set(self.members))
            self.changes.append({"step": step, "replicas": n, "lost": lost, "joined": joined})
            if self.participants:
                what = "; ".join([f"lost {self._describe_lost(lost)}"] * bool(lost) +
                                 [f"replica(s) {joined} (re)joined"] * bool(joined)) or "the quorum changed"
                print(f"syncwise: live recovery: step {step}: {what}; {n} of {self.replicas} replicas train on "
                      f"(global batch × {n}/{self.replicas})", file=sys.stderr, flush=True)
            self.participants, self.members = n, members
        if self.manager.current_step() != before:  # healed: the state came from a live peer
            seconds = time.perf_counter() - started
            healed = self._trainer.step if self._trainer is not None and self.outer is not None else \
                self.manager.current_step()  # (local SGD / DiLoCo: torchft's step encodes the outer steps too)
            self.heals.append({"step": healed, "seconds": seconds})
            print(f"syncwise: live recovery: replica {self.replica} healed from a live peer at step "
                  f"{healed} in {seconds:.2f} s (no checkpoint read)", file=sys.stderr, flush=True)

    def _admit(self, step: int) -> None:
        """Admission: once per quorum (torchft's quorum id changes exactly when its members do, the same for every
        member), before any gradient crosses replicas, every member proves it holds the job's secret: each sends
        its replica index and HMAC(secret, quorum id, index, group rank) through the quorum's own process group
        (one all-gather of 33 integers) and checks everyone's. torchft 0.2.0's lighthouse and managers admit anyone
        who reaches them; a member that cannot prove the secret (something that joined under a replica's name),
        or two members claiming one replica, end this replica's step with one line naming them, so no foreign
        gradient is averaged in. A member that dies during the check, or never takes part, fails it as any collective
        of the quorum fails in torchft: the step is discarded and redone at a new quorum, checked again. Without a
        job secret (a warning said so at the join) there is nothing to prove."""
        quorum_id = getattr(self.manager, "_quorum_id", None)
        if self.secret is None or quorum_id is None or quorum_id == self._proved_quorum:
            return
        from torch.distributed.distributed_c10d import AllgatherOptions

        pg, group_rank = self.manager._pg, getattr(self.manager, "_group_rank", 0)
        members = self._members()
        # (on the group's device: NCCL moves CUDA tensors only; read back once per quorum, not per step)
        mine = torch.tensor([self.replica, *_admission_mac(self.secret, quorum_id, self.replica, group_rank)],
                            dtype=torch.int64).to(self.wire_device)
        got = [torch.empty_like(mine) for _ in range(max(1, len(getattr(pg, "_global_ranks", None) or [])))]
        try:
            pg.allgather([got], [mine], AllgatherOptions()).wait()
            got = [t.cpu() for t in got]
        except Exception as e:  # noqa: BLE001 - a member died meanwhile, or does not take part (torchft's timeout)
            # as torchft treats any failed collective of a quorum: this step is not committed and is redone at the
            # next quorum, whose members are checked again (nothing was averaged with an unchecked member)
            self.manager.report_error(e)
            return
        claimed = [int(t[0]) for t in got]
        unproved = sorted({r for r, t in zip(claimed, got) if not hmac.compare_digest(
            bytes(int(b) for b in t[1:]), _admission_mac(self.secret, quorum_id, r, group_rank))})
        doubled = sorted({r for r in claimed if claimed.count(r) > 1})
        if unproved or doubled or sorted(set(claimed)) != members:
            said = [f"member(s) claiming replica(s) {unproved} did not prove the job's secret"] * bool(unproved)
            said += [f"replica(s) {doubled} claimed twice"] * bool(doubled)
            what = "; ".join(said) or f"the members claim replicas {sorted(claimed)}, the quorum holds {members}"
            raise SyncwiseError(f"live recovery: replica {self.replica} refuses step {step}'s quorum: {what}; "
                                "something outside the job joined the lighthouse under a replica's name "
                                "(docs/security.md)")
        self._proved_quorum = quorum_id

    def _issue(self, flat: torch.Tensor) -> Any:
        """One bucket's cross-replica all-reduce (average over the quorum's participants), after its quorum
        (None when the quorum failed: exchange raises its error)."""
        self._await_quorum()
        if self._quorum_error is not None:
            return None
        if flat.device.type != self.wire_device.type:  # (the buckets are checked at the join; this is metadata only)
            devices.check_replica_wire(self.backend, flat.device)
        if self._behind:
            flat.zero_()
        if self.stats is not None:  # (the bytes this rank puts on the wire; torchft's all-reduce bypasses comm.ops)
            self.stats.record("all_reduce", flat.numel() * flat.element_size())
        return self.manager.allreduce(flat)

    def _wire_buffers(self) -> list[torch.Tensor]:
        """The tensors this replica hands the cross-replica group every step (allocated once): the gradient buckets
        (and their 16-bit wire copies), or local SGD / DiLoCo's outer-step buffer."""
        out: list[torch.Tensor] = []
        if self._grads is not None:
            out += list(self._grads.flats) + [w for w in self._grads.wires if w is not None]
        if self.outer is not None:
            inner = self.outer.inner
            out += [t for t in (getattr(inner, "_wire", None), getattr(inner, "_send", None)) if t is not None]
        return out

    def _snapshot_for_peers(self) -> None:
        """The components a healing peer may receive during this step, as they are at the step's start: with the
        quorum in the background, the peer's request arrives while this replica draws its batch and runs its
        forward and backward. By when each component changes in a step:

        - the model and optimizer change only after should_commit, which a healing peer's all-reduce (issued after
          its transfer) precedes: sent as they are, never copied;
        - the gradient sync's state (``compressor``: error feedback, PowerSGD's matrices, a gradient's size) changes
          from the backward on: not copied here; :meth:`before_backward` copies it only when the backward starts
          while a quorum that may serve a peer still runs, and :meth:`_state` reads it as it is before that;
        - the small rest (data position, counters, LR schedule, scaler) is copied here."""
        state = self._state_obj
        if state is None:
            return
        with self._peer_lock:
            self._for_peers = {name: copy.deepcopy(state[name].state_dict()) for name in _healed_names(state)
                               if name != "model" and name not in _FROM_BACKWARD}
            self._backward_started = False

    def before_backward(self) -> None:
        """The step's first backward is about to start (the trainer asks before each; only the first counts): the
        last moment the gradient sync's state is still the step's start. Copied now only when this step's quorum
        still runs in the background (it may yet serve a healing peer); a quorum already done served whoever it
        served (:meth:`_state` read that state as it was), so a healthy step whose quorum ended during the forward
        copies nothing."""
        if self._backward_started:
            return
        state = self._state_obj
        with self._peer_lock:
            self._backward_started = True
            if state is None or not self._quorum_running():
                return
            for name in _FROM_BACKWARD:
                if name in state and name not in self._for_peers:
                    self._for_peers[name] = state[name].state_dict()  # (a copy: Compressor.state_dict clones)
                    self.peer_copies += 1

    def _quorum_running(self) -> bool:
        """Whether this step's quorum may still call :meth:`_state` (it runs in torchft's thread until its future is
        done; a synchronous quorum, or one already awaited, has ended)."""
        if self._quorum_pending is None:
            return False
        future = getattr(self.manager, "_quorum_future", None)
        return future is None or not future.done()

    def _state(self, state: Any) -> dict[str, Any]:
        """What a joining replica receives: the train state's components (model, optimizer, scheduler, scaler,
        trainer counters, data position, the gradient sync's state), this rank's own where per-rank (the peer's rank
        of the same index). Called in torchft's quorum thread, only when a peer heals from this replica."""
        trainer = self._trainer
        if trainer is not None:  # (injected: healkill, a failure during the healing transfer)
            trainer.faults.maybe_kill_healing(trainer.step, trainer.rank)
        with self._peer_lock:  # (the backward does not start changing the gradient sync's state meanwhile)
            if self.wire_device.type == "cuda":  # the last step's update and gradient sync, queued, done first
                torch.cuda.synchronize(self.wire_device)  # (this thread waits; the training thread does not)
            snapshot = self._for_peers  # (as they were at this step's start)
            for name in _FROM_BACKWARD:
                if name in state and name not in snapshot and not self._backward_started:
                    snapshot[name] = state[name].state_dict()  # (before the backward: still the step's start)
                    self.peer_copies += 1
            sd = {name: snapshot[name] if name in snapshot else state[name].state_dict()
                  for name in _healed_names(state)}
        # DTensors (FSDP2 shards) travel as this rank's local shards: pickling a DTensor would drag its device mesh
        # and process groups along; the receiver (same group rank, same sharding) puts them back into its own.
        sd = _to_local_tree(sd)
        if self.outer is not None:  # the peer trains on (inner steps) while the joiner fetches: send a snapshot
            sd = _clone_tree(sd)
        return sd

    def _load(self, state: Any, sd: dict[str, Any]) -> None:
        sharded = any(_is_dtensor(p) for p in self.params)
        for name, value in sd.items():
            if sharded:  # the local shards back into this rank's DTensors (their mesh and placements)
                value = _to_dtensor_tree(value, state[name].state_dict())
            state[name].load_state_dict(value)

    def _progress(self, step: int) -> int:
        """The step torchft compares in a quorum (the replicas below the highest heal from a peer at it): the
        trainer's step; with local SGD / DiLoCo (committed outer steps, trainer step), so a replica whose round did
        not commit while a peer's did heals, and a fresh one joins at the peers' step."""
        return step if self.outer is None else (self.outer.syncs << 32) + step

    def _wait_for_the_others_at_start(self) -> Optional[float]:
        """A fresh job (this group's first attempt): wait up to ``quorum_timeout_s`` until every configured replica
        group is up (its status file), so the first quorum holds them all; otherwise the first to start would
        train alone and the others join later as replacements. A restarted group joins at once (None); a fresh
        one gets the deadline until which its first quorum may be asked again (see :meth:`join`)."""
        self._record_status(-1 if self._trainer is None or not self._trainer.step else self._trainer.step)
        if self.status_dir is None or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 or \
                (self._trainer is not None and self._trainer.step):
            return None
        deadline = time.monotonic() + self.quorum_timeout_s
        while time.monotonic() < deadline:
            if all((self.status_dir / f"replica{r}.json").exists() for r in range(self.replicas)):
                break
            time.sleep(0.1)
        return deadline

    def _record_status(self, step: int) -> None:
        if self.status_dir is None:
            return
        try:
            self.status_dir.mkdir(parents=True, exist_ok=True)
            path = self.status_dir / f"replica{self.replica}.json"
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"step": step, "pid": os.getpid(), "host": _advertised_host(),
                                       "time": time.time()}))
            os.replace(tmp, path)
        except OSError:
            pass

    def _members(self) -> list[int]:
        """The replica indices of the current quorum: torchft hands its reconfigurable process group the quorum's
        global ranks (replica index × group size + group rank; ``_global_ranks`` of torchft's ProcessGroupGloo and
        ProcessGroupNCCL alike)."""
        ranks = getattr(getattr(self.manager, "_pg", None), "_global_ranks", None) or []
        size = max(1, getattr(self.manager, "_group_world_size", 1))
        return sorted({int(r) // size for r in ranks})

    def _describe_lost(self, lost: list[int]) -> str:
        """'replica 1 (last step 4, pid 1234)': who left the quorum and, from its status file, where it stopped."""
        out = []
        for r in lost:
            try:
                last = json.loads((self.status_dir / f"replica{r}.json").read_text()) if self.status_dir else {}
            except (OSError, ValueError):
                last = {}
            detail = f" (last step {last['step']}, pid {last.get('pid')} on {last.get('host')})" if "step" in last else ""
            out.append(f"replica {r}{detail}")
        return ", ".join(out)


class LiveQuorum(StepCallback):
    """Live recovery in the training loop, as one of its step callbacks (train/callbacks.py): the step's quorum
    before its batch (a replica behind heals from a live peer there: ``trainer.step`` moves), the commit after its
    update (not committed on every replica: the step is redone with the next batch), the row's columns (replicas,
    quorum time, discarded batches), the manager's shutdown and the summary's ``live_recovery``. The exchange itself
    is the sync strategy's (:meth:`LiveRecovery.attach`)."""

    def __init__(self, live: LiveRecovery):
        self.live = live

    def on_step_start(self, trainer: Any, step: int) -> None:
        trainer.phase = "live recovery quorum"
        self.live.begin_step(step)

    def before_backward(self, trainer: Any, step: int) -> None:
        self.live.before_backward()

    def commits(self, trainer: Any, pending: Any) -> bool:
        if self.live.committed:
            pending.parallel_metrics.update(self.live.row())
        return self.live.committed

    def close(self, trainer: Any) -> None:
        self.live.close()

    def summary(self, trainer: Any) -> dict[str, Any]:
        return {"live_recovery": self.live.summary()}


# Per-rank components that must not travel: the RNG (this rank's own streams) and the micro-batch size found here.
_NOT_HEALED = ("rng", "batcher")
# Components that change only from the step's backward on (the gradient sync's state, as large as a gradient):
# copied for a healing peer only when needed (LiveRecovery.before_backward), never at every step's start.
_FROM_BACKWARD = ("compressor",)


def _admission_mac(secret: bytes, quorum_id: int, replica: int, group_rank: int) -> bytes:
    """What a quorum member sends to prove it holds the job's secret (:meth:`LiveRecovery._admit`): the job's
    signature (``secret.sign``, HMAC-SHA256) over the quorum id, its replica index and its rank in the replica group."""
    return sign(secret, b"syncwise-admission", *(str(n).encode() for n in (quorum_id, replica, group_rank)))


def _healed_names(state: Any) -> list[str]:
    return [name for name in (*state.global_components, *state.per_rank_components) if name not in _NOT_HEALED]


def _start_async_quorum(manager: Any) -> bool:
    """Start the step's quorum in the Manager's background thread, as ``start_quorum`` does for a Manager built
    with ``use_async_quorum=True`` (torchft 0.2.0, manager.py), while this Manager keeps the synchronous mode's
    participation: every replica in the quorum counts in the average (the asynchronous mode counts only those
    already at the newest step, so a replica that healed at its quorum would send zeros for that step).
    False (nothing started) when the Manager lacks those internals (another torchft version)."""
    needed = ("_quorum_future", "_executor", "_async_quorum", "_quorum_timeout", "_errored", "_healing")
    if not all(hasattr(manager, name) for name in needed):
        return False
    if manager._quorum_future is not None:
        manager._quorum_future.result()
    manager._errored, manager._healing = None, False
    device = torch.accelerator.current_device_index() if torch.accelerator.is_available() else -1
    manager._quorum_future = manager._executor.submit(manager._async_quorum, allow_heal=True, shrink_only=False,
                                                      quorum_timeout=manager._quorum_timeout, curr_device=device)
    return True


def replica_process_group(backend: str, timeout: timedelta) -> Any:
    """Live recovery's cross-replica process group for ``backend`` (``devices.replica_backend`` of the replicas'
    device): torchft's reconfigurable groups, rebuilt by the Manager at each new quorum. 'nccl':
    ``torchft.ProcessGroupNCCL`` (in this process, non-blocking communicators; with NCCL ≥ 2.25 a collective that
    outlives ``timeout`` is ended by ``ncclCommAbort`` instead of hanging the step, and the next quorum builds a
    fresh communicator); torchft's ``ProcessGroupBabyNCCL`` (NCCL in a child process) would time-share the GPU with
    a second CUDA context, so the buckets sent during backward would not overlap it. 'gloo':
    ``torchft.ProcessGroupGloo`` (CPU tensors: the join refuses CUDA buffers on it)."""
    if backend == "nccl":
        from torchft import ProcessGroupNCCL

        # its abort timer (torchft warns and sets it from the timeout when unset; set here, quietly, the same way)
        os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(timeout.total_seconds()))
        return ProcessGroupNCCL(timeout=timeout)
    if backend == "gloo":
        from torchft import ProcessGroupGloo

        return ProcessGroupGloo(timeout=timeout)
    raise ConfigError("backend", backend, "nccl or gloo (devices.replica_backend)")


def _wire_device(params: list, fallback: Any = None) -> torch.device:
    """Where this rank's gradients live (its parameters', their local shards' for DTensors); ``fallback`` (the
    trainer's device) without trainable parameters. Parameters on several device types are refused: their buckets
    could not share one cross-replica group."""
    found = {_local_tensor(p).device for p in params}
    if not found:
        return torch.device(fallback) if fallback is not None else torch.device("cpu")
    if len({d.type for d in found}) > 1:
        raise ConfigError("model", sorted(str(d) for d in found), "parameters on one device type (live recovery "
                          "sends every gradient bucket over one cross-replica group: NCCL for CUDA, gloo for the CPU)")
    first = min(found, key=lambda d: d.index or 0)  # (one device type; several GPUs: the first, as the buckets')
    return devices.resolve(first) if first.type == "cuda" else first


def _local_tensor(t: Any) -> Any:
    return t.to_local() if _is_dtensor(t) else t


def _transport(timeout: timedelta, secret: Optional[bytes] = None) -> Any:
    """The heal transfer (train/heal_transport.py, in place of torchft's HTTPTransport): listening on the job's
    address only, advertised as ``_advertised_host()`` (the lab's namespaces share one host name), requests and
    payloads signed with the job's secret, loaded with ``weights_only=True``."""
    from .heal_transport import transport

    return transport(timeout, host=_bind_host(), advertise=_advertised_host(), secret=secret)


def _bind_host() -> str:
    """Where this replica's manager, heal server and own store listen: the job's address (bind.py; a job
    whose lighthouse is elsewhere spans machines: this node's own address)."""
    return bind.bind_host_for(1, os.environ.get(ENV_LIGHTHOUSE, ""))


def _advertised_host() -> str:
    """The host peers reach this replica's manager and heal server at: the address they listen on
    (SYNCWISE_FT_HOST overrides: the network lab names each node's namespace)."""
    return os.environ.get(live_env.HOST) or _bind_host()


@contextlib.contextmanager
def _manager_bound_to(host: str) -> Iterator[None]:
    """torchft 0.2.0's Manager starts its ManagerServer (Rust) with ``bind='[::]:PORT'``, every interface: while a
    Manager is built, it gets ``HOST:PORT`` instead (the same port choice)."""
    import torchft.manager as tm

    original = tm.ManagerServer

    def bound(*args: Any, **kwargs: Any) -> Any:
        if "bind" in kwargs:
            kwargs["bind"] = bind.hostport(host, int(str(kwargs["bind"]).rsplit(":", 1)[1]))
        return original(*args, **kwargs)

    tm.ManagerServer = bound
    try:
        yield
    finally:
        tm.ManagerServer = original


# ---------------------------------------------------------------------------------------------- HSDP: DTensors
def _map_tree(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` applied to every leaf of a state dict's nested dicts, lists and tuples."""
    if isinstance(tree, dict):
        return {k: _map_tree(fn, v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tree(fn, v) for v in tree)
    return fn(tree)


def _to_local_tree(tree: Any) -> Any:
    return _map_tree(_local_tensor, tree)


def _clone_tree(tree: Any) -> Any:
    return _map_tree(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


def _to_dtensor_tree(received: Any, current: Any) -> Any:
    """``received`` (a peer's state, DTensors sent as local shards) with each tensor whose place in ``current``
    (this rank's own state) holds a DTensor made a DTensor again on this rank's mesh and placements."""
    from torch.distributed.tensor import DTensor

    if isinstance(received, dict) and isinstance(current, dict):
        return {k: _to_dtensor_tree(v, current.get(k)) for k, v in received.items()}
    if isinstance(received, (list, tuple)) and isinstance(current, (list, tuple)) and len(received) == len(current):
        return type(received)(_to_dtensor_tree(v, c) for v, c in zip(received, current))
    if isinstance(current, DTensor) and isinstance(received, torch.Tensor) and not isinstance(received, DTensor):
        return DTensor.from_local(received.to(current.device), current.device_mesh, current.placements,
                                  run_check=False, shape=current.shape, stride=current.stride())
    return received
