"""Local SGD and DiLoCo: replicas step on their own and synchronise every H steps, overlapped with compute.

Compression shrinks each step's gradient all-reduce; local SGD removes most of them. Every rank runs its
own inner optimizer (AdamW) on its own data for ``period`` steps without communicating; then the
*pseudo-gradient* ``anchor - params`` (how far this replica moved since the last sync) is averaged
across ranks and an outer optimizer steps the shared anchor (DiLoCo, Douillard et al. 2023: SGD with
Nesterov momentum; plain local SGD = outer lr 1, no momentum = parameter averaging).

What syncwise adds over PyTorch's ``PeriodicModelAverager`` (which ``torch-localsgd`` runs side by side):
- **overlap** (``delay=D``): the average is started asynchronously at the sync step and applied D steps
  later, so the all-reduce runs while the replica keeps training; the local progress made meanwhile is
  kept on top of the new anchor (θ ← anchor' + (θ_now − θ_sync)), so no step's work is lost or counted
  twice ("eager/overlapped" outer step, as in Streaming DiLoCo);
- **low-precision pseudo-gradients** (``dtype=bf16|fp16``) with error feedback: what the cast dropped is
  added to the next sync's pseudo-gradient, so nothing is lost over time;
- **low-bit pseudo-gradients** (``bits=4|8``): quantized per block, all-gathered and averaged locally, with error
  feedback (the bytes on the wire shrink to about bits/32);
- **sharded replicas** (HSDP's replica groups): with DTensor parameters (FSDP2 over ``dp_shard``) the replica state
  is this rank's local shards, averaged with the same shard of the other groups (``group`` = ``dp_replicate``);
- **warm-up** with ordinary per-step gradient all-reduce (post-local SGD, Lin et al. 2020);
- exact checkpoint/resume of every replica, the anchor, the outer momentum and an in-flight average.

The last step of a run always synchronises without delay, so training ends with identical replicas.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..comm import ops, timing
from ..comm.stats import CommStats
from .sync_spec import DTYPES, SyncSpec, SyncStrategy


class LocalSGD(SyncStrategy):
    """The outer loop of local SGD / DiLoCo over one model's replica state.

    The replica state is every trainable parameter plus the floating-point buffers (e.g. the MoE
    router biases, which each replica balances on its own between syncs). Call ``syncs_gradients(step)``
    before a step (True during warm-up: the trainer lets DDP all-reduce gradients) and
    ``after_step(step, last)`` after the inner optimizer stepped; it returns the seconds the step waited
    on the network. Steps are 1-based optimizer steps.

    The state lives in one flat fp32 buffer that the parameters are views of (when they are all fp32 on
    one device), and every work buffer is allocated once: an outer step is a handful of passes over
    memory, with no flatten/unflatten and no fresh allocations (measured: 55 ms → ~20 ms per sync for 5.5 M
    parameters on one CPU core).
    """

    def __init__(self, model: nn.Module, spec: SyncSpec, group: Any = None, stats: Optional[CommStats] = None):
        super().__init__()
        self.spec, self.group, self.stats = spec, group, stats if stats is not None else CommStats()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.tensors = self.params + [b for b in model.buffers() if b.is_floating_point()]
        # FSDP2 / HSDP: the parameters are DTensors; the replica state is this rank's shards (averaged with the same
        # shard of the other replica groups, ``group`` = dp_replicate), read through ``to_local()`` at every use
        self._sharded = any(is_dtensor(t) for t in self.tensors)
        self.flat, self._views = _flat_storage(self.tensors, views=not self._sharded)
        self.anchor = self.flat.clone()  # the last agreed replica state
        self.outer_opt = torch.optim.SGD([self.anchor], lr=spec.outer_lr, momentum=spec.momentum,
                                         nesterov=spec.nesterov and spec.momentum > 0)
        # What one average carries: the pseudo-gradient (then the averaged one), fp32, and behind it one flag per step
        # since the last average, set where this replica dropped a step (non-finite gradients; SyncStrategy.skip).
        n = self.flat.numel()
        self._wire = torch.empty(n + spec.period, dtype=torch.float32, device=self.flat.device)
        self._delta, self._flags = self._wire[:n], self._wire[n:]
        low = DTYPES[spec.dtype] != torch.float32
        self._send = torch.empty_like(self._wire, dtype=DTYPES[spec.dtype]) if low else self._wire
        # Error feedback of the low-precision cast: what it dropped goes out with the next sync.
        # bits=4|8: the outer gradient is quantized per block and all-gathered (_launch_quantized), with error feedback
        self._quant = spec.method != "sparseloco" and getattr(spec, "bits", 32) in (4, 8)
        self.residual: Optional[torch.Tensor] = torch.zeros_like(self.flat) if low or self._quant else None
        if self._quant:
            self._init_quantized()
        self._at_launch = torch.empty_like(self.flat) if spec.delay else None
        self._pending: Optional[dict[str, Any]] = None  # the in-flight average
        self.syncs = 0

    # ------------------------------------------------------------------------------------------ schedule
    def syncs_gradients(self, step: int) -> bool:
        """Whether step ``step`` uses the ordinary per-step gradient all-reduce (the warm-up)."""
        return step <= self.spec.warmup

    def is_sync_step(self, step: int, last: bool = False) -> bool:
        return step > self.spec.warmup and (last or (step - self.spec.warmup) % self.spec.period == 0)

    def after_step(self, step: int, last: bool = False) -> float:
        """Start, land or skip the outer step after inner step ``step``; return seconds spent waiting."""
        if step <= self.spec.warmup:
            if step == self.spec.warmup:  # replicas are identical here: local training starts from them
                self.anchor.copy_(self._read())
            return 0.0
        waited = 0.0
        if self._pending is not None and (last or step >= self._pending["apply_at"]):
            waited += self._land()
        if self.is_sync_step(step, last):
            self._launch(step, delay=0 if last else self.spec.delay)
            if self._pending["apply_at"] <= step:
                waited += self._land()
        return waited

    # --------------------------------------------------------------------------------------- outer step
    @torch.no_grad()
    def _launch(self, step: int, delay: int) -> None:
        current = self._read()
        if delay:
            self._at_launch.copy_(current)  # θ at launch: the local progress after it is kept
        torch.sub(self.anchor, current, out=self._delta)  # this replica's pseudo-gradient
        self._pack_skips(step, self._flags)  # the steps it dropped since the last average ride along
        if self._quant:
            self._launch_quantized(step, delay)
            return
        if self.residual is not None:
            self._delta.add_(self.residual)
            self._send.copy_(self._wire)
            torch.sub(self._delta, self._send[:self._delta.numel()], out=self.residual)
        work = ops.all_reduce(self._send, "avg", group=self.group, async_op=True, stats=self.stats)
        self._pending = {"launched_at": step, "apply_at": step + delay, "work": work}

    @torch.no_grad()
    def _land(self) -> float:
        pending, self._pending = self._pending, None
        # comm.timing: on CUDA the stream's wait for the average (events; read here, as this strategy reads the
        # host anyway), not the host's return from an NCCL wait() that only enqueues a stream wait
        with timing.timed(self.anchor.device) as iv:
            if pending["work"] is not None:
                pending["work"].wait()
        waited = iv.seconds()
        if pending.get("gathered") is not None:
            self._decode_gathered(pending)
        elif self._send is not self._wire:
            self._wire.copy_(self._send)
        self._unpack_skips(pending["launched_at"], self._flags)  # every replica records the steps any one dropped
        self.anchor.grad = self._delta  # the averaged pseudo-gradient
        self.outer_opt.step()
        self.anchor.grad = None
        if pending["apply_at"] > pending["launched_at"]:
            # θ ← anchor' + (θ_now − θ_launch): keep what this replica learned while the average travelled.
            torch.sub(self.anchor, self._at_launch, out=self._delta)
            self._write(self._read().add_(self._delta))
        else:
            self._write(self.anchor)
        self.syncs += 1
        return waited

    def _read(self) -> torch.Tensor:
        """The replica state as one flat fp32 tensor (the live buffer when the parameters are its views)."""
        if self._views:
            return self.flat
        return self.flat.copy_(_flatten_dense_tensors([local_shard(t).detach().float() for t in self.tensors]))

    def _write(self, flat: torch.Tensor) -> None:
        if flat is not self.flat:
            self.flat.copy_(flat)
        if not self._views:
            local = [local_shard(t) for t in self.tensors]
            for t, value in zip(local, _unflatten_dense_tensors(self.flat, local)):
                t.detach().copy_(value)

    @torch.no_grad()
    def resumed(self) -> None:
        """Without its own state (a resume at another world size skips per-rank state), start the outer loop
        afresh from the loaded parameters: an anchor left at the initial weights would send the whole
        training so far as one pseudo-gradient."""
        if not self.restored:
            self.anchor.copy_(self._read())
            self.outer_opt.state.clear()
            if self.residual is not None:
                self.residual.zero_()
            self._pending = None

    # ------------------------------------------------------------------------------------- checkpoints
    def _settled_pending(self) -> Optional[dict[str, Any]]:
        """The in-flight average's schedule for a checkpoint, after waiting for it (None: none in flight); the
        subclass adds what it carries."""
        if self._pending is None:
            return None
        if self._pending["work"] is not None:
            self._pending["work"].wait()
            self._pending["work"] = None
        return {"launched_at": self._pending["launched_at"], "apply_at": self._pending["apply_at"],
                "at_launch": None if self._at_launch is None else self._at_launch.clone()}

    def state_dict(self) -> dict[str, Any]:
        """Anchor, outer momentum, cast residual and an in-flight average (waited for: its result is saved)."""
        pending = self._settled_pending()
        if pending is not None and self._pending.get("gathered") is not None:
            self._decode_gathered(self._pending)  # the quantized payloads, averaged (what landing would apply)
        if pending is not None:
            pending["averaged"] = self._send.clone()
        return {"anchor": self.anchor.clone(), "outer_opt": self.outer_opt.state_dict(),
                "residual": None if self.residual is None else self.residual.clone(), "pending": pending,
                "syncs": self.syncs, "skips": list(self.skips)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.anchor.copy_(state["anchor"])
        self.outer_opt.load_state_dict(state["outer_opt"])
        if self.residual is not None and state.get("residual") is not None:
            self.residual.copy_(state["residual"])
        pending = state.get("pending")
        self._pending = None
        if pending is not None:
            averaged = pending["averaged"]
            self._send.zero_()  # a checkpoint from before the flags (issue 23) holds the pseudo-gradient alone
            self._send[:averaged.numel()].copy_(averaged)
            if pending.get("at_launch") is not None:
                self._at_launch.copy_(pending["at_launch"])
            self._pending = {"launched_at": pending["launched_at"], "apply_at": pending["apply_at"], "work": None}
        self.syncs = int(state.get("syncs", 0))
        self.skips = [int(s) for s in state.get("skips", [])]
        self.restored = True


    # ---------------------------------------------------------------- low-bit outer gradients (bits=4|8)
    # Streaming DiLoCo sends its outer gradients in 4 bits (arXiv 2501.18512), INTELLECT-1 in 8. Here: symmetric
    # integer levels (±7 for 4 bits, ±127 for 8) with one fp32 scale (the block's absmax / levels) per OUTER_QBLOCK
    # elements, round to nearest, and error feedback (what the rounding dropped goes out with the next sync). A sum
    # of quantized values is not quantized, so each rank all-gathers every rank's payload (codes, scales and the
    # skip flags as one uint8 buffer) and decodes and averages them locally: the bytes on the wire are the
    # payload's, about bits/32 of the fp32 all-reduce's.
    def _init_quantized(self) -> None:
        from ..layout import OUTER_QBLOCK
        import torch.distributed as dist

        n, dev = self.flat.numel(), self.flat.device
        self._qblock = OUTER_QBLOCK
        self._nblocks = -(-n // OUTER_QBLOCK)
        self._qmax = 7 if self.spec.bits == 4 else 127
        padded = self._nblocks * OUTER_QBLOCK
        self._code_bytes = padded // 2 if self.spec.bits == 4 else padded
        self._meta = torch.empty(self._nblocks + self.spec.period, dtype=torch.float32, device=dev)  # scales, flags
        self._payload = torch.empty(self._code_bytes + self._meta.numel() * 4, dtype=torch.uint8, device=dev)
        self._qwork = torch.zeros(padded, dtype=torch.float32, device=dev)
        world = dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1
        self._gathered = torch.empty(world * self._payload.numel(), dtype=torch.uint8, device=dev)

    @property
    def outer_payload_bytes(self) -> int:
        """Bytes this rank puts on the wire per outer step (all-gather input, or all-reduce tensor)."""
        return self._payload.numel() if self._quant else self._send.numel() * self._send.element_size()

    @torch.no_grad()
    def _launch_quantized(self, step: int, delay: int) -> None:
        n, qb = self._delta.numel(), self._qblock
        self._delta.add_(self.residual)  # error feedback
        x = self._qwork
        x[:n].copy_(self._delta)
        blocks = x.view(self._nblocks, qb)
        scale = blocks.abs().amax(dim=1).div_(self._qmax)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = blocks.div(scale[:, None]).round_().clamp_(-self._qmax, self._qmax)
        torch.sub(self._delta, (q * scale[:, None]).view(-1)[:n], out=self.residual)  # what the rounding dropped
        if self.spec.bits == 4:
            u = (q + 8).to(torch.uint8).view(-1, 2)
            codes = u[:, 0] | (u[:, 1] << 4)
        else:
            codes = q.to(torch.int8).view(torch.uint8).view(-1)
        self._meta[:self._nblocks].copy_(scale)
        self._meta[self._nblocks:].copy_(self._flags)
        self._payload[:self._code_bytes].copy_(codes)
        self._payload[self._code_bytes:].copy_(self._meta.view(torch.uint8))
        work = ops.all_gather(self._gathered, self._payload, group=self.group, async_op=True, stats=self.stats)
        self._pending = {"launched_at": step, "apply_at": step + delay, "work": work, "gathered": True}

    @torch.no_grad()
    def _decode_gathered(self, pending: dict) -> None:
        """Every rank's payload, decoded and averaged into the wire buffer (pseudo-gradient, then the flags)."""
        n, qb, nb = self._delta.numel(), self._qblock, self._nblocks
        world = self._gathered.numel() // self._payload.numel()
        rows = self._gathered.view(world, self._payload.numel())
        total = torch.zeros(nb * qb, dtype=torch.float32, device=self._delta.device)
        flags = torch.zeros_like(self._flags)
        for r in range(world):  # in rank order on every rank: the same sum everywhere
            codes, meta = rows[r, :self._code_bytes], rows[r, self._code_bytes:].clone().view(torch.float32)
            if self.spec.bits == 4:
                q = torch.stack([codes & 15, codes >> 4], dim=1).view(-1).float().sub_(8)
            else:
                q = codes.view(torch.int8).float()
            total.add_(q.view(nb, qb).mul_(meta[:nb, None]).view(-1))
            flags.add_(meta[nb:])
        self._delta.copy_(total[:n].div_(world))
        self._flags.copy_(flags.div_(world))
        pending["gathered"] = None


def is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "device_mesh")


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 / HSDP parameters; sharing its storage), else the tensor itself. Read
    at every use: FSDP2 may re-point a parameter's local tensor at its lazy initialisation (first forward)."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()


def _flat_storage(tensors: list[torch.Tensor], views: bool = True) -> tuple[torch.Tensor, bool]:
    """One flat fp32 copy of ``tensors`` (their local shards for DTensors); when they are all fp32 on one device (and
    ``views``), re-point them to be views of it (so reading and writing the replica state costs nothing). Returns
    (flat, are_views)."""
    flat = _flatten_dense_tensors([local_shard(t).detach().float() for t in tensors]).clone()
    if not views or any(t.dtype != torch.float32 or t.device != flat.device for t in tensors):
        return flat, False
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.data = flat[offset:offset + n].view_as(t)
            offset += n
    return flat, True


class TorchPeriodicAveraging(SyncStrategy):
    """PyTorch's own local SGD piece, ``PeriodicModelAverager``, behind the same two calls (the reference).

    It averages the parameters (fp32, blocking) every ``period`` steps after ``warmup`` — as shipped, it
    skips parameters without a gradient in that step (unused MoE experts). It does not take buffers, so
    the floating-point buffers (MoE router biases, which each replica balances on its own) are averaged
    next to it with PyTorch's ``average_parameters``, as LocalSGD averages them. These all-reduces bypass
    syncwise.comm, so their bytes are recorded here.
    """

    def __init__(self, model: nn.Module, spec: SyncSpec, group: Any = None, stats: Optional[CommStats] = None):
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        super().__init__()
        self.spec, self.stats = spec, stats if stats is not None else CommStats()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.averager = PeriodicModelAverager(period=spec.period, warmup_steps=spec.warmup, process_group=group)
        self.syncs = 0

    def syncs_gradients(self, step: int) -> bool:
        return step <= self.spec.warmup

    def after_step(self, step: int, last: bool = False) -> float:
        from torch.distributed.algorithms.model_averaging.utils import average_parameters

        # The averager counts its own steps (it averages when its count ≥ warmup and is a multiple of
        # period); keep it aligned with the trainer's step so a resumed run averages at the same steps.
        self.averager.step = step
        averages = step >= self.spec.warmup and (step - self.spec.warmup) % self.spec.period == 0
        group = self.averager.process_group
        iv = timing.Interval(self.params[0].device if self.params else None).start()
        if last and not averages:  # end on identical replicas: every parameter, with or without a gradient
            average_parameters(iter(self.params), group)
            averaged = self.params
        else:
            averaged = [p for p in self.params if p.grad is not None] if averages else []
            self.averager.average_parameters(iter(self.params))
        if not (averages or last):
            return 0.0
        if self.buffers:
            average_parameters(iter(self.buffers), group)
        # The steps a replica dropped since the last average (SyncStrategy.skip): torch's averager has no room for
        # them, so a tiny all-reduce of one flag per step rides next to it (per average, not per step).
        flags = torch.empty(self.spec.period, device=self.params[0].device if self.params else None)
        self._pack_skips(step, flags)
        ops.all_reduce(flags, "max", group=group, stats=self.stats)
        self._unpack_skips(step, flags)
        nbytes = sum(t.numel() * t.element_size() for t in averaged + self.buffers)
        self.stats.record("all_reduce", nbytes, hop=ops.split_bytes(nbytes, group, "ring"))
        self.syncs += 1
        return iv.stop().seconds()  # CUDA events on a GPU (torch's averager returns at enqueue under NCCL)

    def state_dict(self) -> dict[str, Any]:
        return {"syncs": self.syncs, "skips": list(self.skips)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.syncs = int(state.get("syncs", 0))
        self.skips = [int(s) for s in state.get("skips", [])]
        self.restored = True
