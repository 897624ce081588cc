"""SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706): local steps whose pseudo-gradient is sent as chunked top-k values
in 2 bits, with an error-feedback accumulator in place of DiLoCo's outer momentum.

Every ``period`` steps each replica forms its pseudo-gradient ``Δ = anchor − θ`` and

    e ← decay · e + Δ                         (the accumulator: what earlier rounds did not send, decayed)
    ê = Q₂(top-k per chunk of e)              (k of every ``chunk`` elements, each in 2 bits + one fp32 scale/chunk)
    e ← e − ê                                 (what was not sent stays for the next round)
    anchor ← anchor − outer_lr · mean_r(ê_r)  (all-gathered; every rank decodes the same bytes in rank order)
    θ ← anchor

The replica state is the same flat fp32 buffer as :class:`~syncwise.parallel.local_sgd.LocalSGD`'s (parameters and
floating-point buffers), cut into chunks of ``chunk`` elements (the last one zero-padded). Per chunk the payload is
``topk`` int16 indices, ``topk`` 2-bit codes (4 per byte) and one fp32 scale: with the defaults (4096, 64) 148 bytes
per 4,096 elements, 0.036 B/element per round, 1/16 of that per step at period 16. ``bits=32`` sends fp32 values
instead (the ablation without quantization). The 2-bit code of a kept value ``v`` in a chunk of scale ``s = max|v|``
is its sign and whether ``|v| ≥ 2s/3``: it decodes to ``±s`` or ``±s/3`` (round to the nearer of the two levels).

A non-finite pseudo-gradient on any rank (its flag rides in the payload) skips the round on every rank: the anchor
and the accumulators stay, and every replica restarts from the anchor. Overlap (``delay``), warm-up and the last
step's forced sync are LocalSGD's. The accumulator is checkpointed with the anchor (bit-exact resume).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..comm import hostread, ops, timing
from ..comm.stats import CommStats
from .local_sgd import LocalSGD
from .sync_spec import SyncSpec

_FLAG = 4  # bytes: the int32 non-finite flag at the end of every payload


class SparseLoCo(LocalSGD):
    """Local SGD whose outer step averages 2-bit chunked top-k pseudo-gradients with error feedback (module doc)."""

    def __init__(self, model: nn.Module, spec: SyncSpec, group: Any = None, stats: Optional[CommStats] = None):
        super().__init__(model, spec, group=group, stats=stats)
        n = self.flat.numel()
        self.chunks = -(-n // spec.chunk)
        self.error = torch.zeros(self.chunks * spec.chunk, dtype=torch.float32, device=self.flat.device)
        self._staged: Optional[torch.Tensor] = None  # the accumulator after this round, committed when all were finite

    # --------------------------------------------------------------------------------------- the payload
    @property
    def payload_bytes(self) -> int:
        """Bytes each rank sends per round: per chunk k int16 indices, k values (2 bits, or fp32), one fp32 scale."""
        k, c = self.spec.topk, self.chunks
        values = c * (-(-k // 4) if self.spec.bits == 2 else 4 * k)
        return c * 2 * k + values + (4 * c if self.spec.bits == 2 else 0) + self.spec.period + _FLAG

    def encode(self, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 payload without the flag, the dense decode of it) of the accumulator ``e`` (chunks × chunk)."""
        k = self.spec.topk
        idx = torch.topk(e.abs(), k, dim=1, sorted=False).indices.sort(dim=1).values
        vals = torch.gather(e, 1, idx)
        parts = [idx.to(torch.int16).view(torch.uint8).reshape(-1)]
        if self.spec.bits == 2:
            scale = vals.abs().amax(1, keepdim=True)
            big = vals.abs() >= scale * (2.0 / 3.0)
            neg = vals < 0
            codes = (big.to(torch.uint8) | (neg.to(torch.uint8) << 1)).reshape(-1)
            parts += [_pack2(codes), scale.reshape(-1).view(torch.uint8)]
            vals = _levels(big, neg, scale)
        else:
            parts.append(vals.reshape(-1).view(torch.uint8))
        sent = torch.zeros_like(e).scatter_(1, idx, vals)
        return torch.cat(parts), sent

    def decode_sum(self, gathered: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (rank order) of the dense decodes of ``gathered`` (world × payload bytes, flag included)."""
        world, k, c, size = gathered.shape[0], self.spec.topk, self.chunks, self.spec.chunk
        n_idx = 2 * c * k
        idx = gathered[:, :n_idx].contiguous().view(torch.int16).long().view(world, c, k)
        if self.spec.bits == 2:
            n_codes = -(-c * k // 4)
            codes = _unpack2(gathered[:, n_idx:n_idx + n_codes].contiguous(), c * k).view(world, c, k)
            scale = gathered[:, n_idx + n_codes:n_idx + n_codes + 4 * c].contiguous().view(torch.float32)
            vals = _levels((codes & 1).bool(), (codes & 2).bool(), scale.view(world, c, 1))
        else:
            vals = gathered[:, n_idx:n_idx + 4 * c * k].contiguous().view(torch.float32).view(world, c, k)
        flat = idx + (torch.arange(c, device=idx.device) * size).view(1, c, 1)
        out = torch.zeros(c * size, device=gathered.device)
        for w in range(world):  # rank order, distinct indices per rank: the same fp32 sum on every rank, even on CUDA
            out.index_add_(0, flat[w].reshape(-1), vals[w].reshape(-1))
        return out

    # --------------------------------------------------------------------------------------- outer step
    @torch.no_grad()
    def _launch(self, step: int, delay: int) -> None:
        current = self._read()
        if delay:
            self._at_launch.copy_(current)
        n = self.flat.numel()
        acc = self.error.mul(self.spec.decay)
        acc[:n].add_(self.anchor).sub_(current)  # e·decay + Δ, Δ = anchor − θ
        bad = (~torch.isfinite(acc).all()).to(torch.int32).reshape(1)
        payload, sent = self.encode(torch.nan_to_num(acc).view(self.chunks, self.spec.chunk))
        self._staged = acc.sub_(sent.view(-1))  # what stays for the next round
        # then one byte per step since the last round, set where this replica dropped a step (SyncStrategy.skip),
        # and the non-finite flag
        self._pack_skips(step, self._flags)
        payload = torch.cat([payload, self._flags.to(torch.uint8), bad.view(torch.uint8)])
        out = torch.empty(self._world() * payload.numel(), dtype=torch.uint8, device=payload.device)
        work = ops.all_gather(out, payload, group=self.group, async_op=True, stats=self.stats)
        # the payload stays referenced until the round lands (comm.ops's in-flight record owns it too, issue 39 N1)
        self._pending = {"launched_at": step, "apply_at": step + delay, "work": work, "gathered": out,
                         "payload": payload.numel(), "sent": payload}

    def _world(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self.group)

    @torch.no_grad()
    def _land(self) -> float:
        pending, self._pending = self._pending, None
        with timing.timed(self.anchor.device) as iv:
            if pending["work"] is not None:
                pending["work"].wait()
        waited = iv.seconds()
        gathered = pending["gathered"].view(-1, pending["payload"])
        with hostread.designed("outer average landed: every replica finite? (once per period)"):
            ok = bool(gathered[:, -_FLAG:].contiguous().view(torch.int32).eq(0).all())
        skips = -_FLAG - self.spec.period
        self._unpack_skips(pending["launched_at"], gathered[:, skips:-_FLAG].amax(0))  # every replica records them
        if ok:
            mean = self.decode_sum(gathered[:, :skips])[:self.flat.numel()].div_(gathered.shape[0])
            self.anchor.sub_(mean, alpha=self.spec.outer_lr)
            self.error.copy_(self._staged)
        self._staged = None
        if ok and pending["apply_at"] > pending["launched_at"]:
            # θ ← anchor' + (θ_now − θ_launch): keep what this replica learned while the average travelled
            torch.sub(self.anchor, self._at_launch, out=self._delta)
            self._write(self._read().add_(self._delta))
        else:  # landed at once, or a rank was non-finite: every replica restarts from the (kept) anchor
            self._write(self.anchor)
        self.syncs += 1
        return waited

    @torch.no_grad()
    def resumed(self) -> None:
        super().resumed()
        if not self.restored:
            self.error.zero_()

    # ------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Anchor, accumulator and an in-flight round (waited for: its gathered bytes and staged accumulator)."""
        pending = self._settled_pending()
        if pending is not None:
            pending.update(gathered=self._pending["gathered"].clone(), payload=self._pending["payload"],
                           staged=self._staged.clone())
        return {"anchor": self.anchor.clone(), "error": self.error.clone(), "pending": pending, "syncs": self.syncs,
                "skips": list(self.skips)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.anchor.copy_(state["anchor"])
        self.error.copy_(state["error"])
        pending = state.get("pending")
        self._pending, self._staged = None, None
        if pending is not None:
            if pending.get("at_launch") is not None:
                self._at_launch.copy_(pending["at_launch"])
            self._staged = pending["staged"].clone()
            self._pending = {"launched_at": pending["launched_at"], "apply_at": pending["apply_at"], "work": None,
                             "gathered": pending["gathered"].clone(), "payload": pending["payload"]}
        self.syncs = int(state.get("syncs", 0))
        self.skips = [int(s) for s in state.get("skips", [])]  # dropped here, not yet carried on an average
        self.restored = True


def _levels(big: torch.Tensor, neg: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The value of a 2-bit code: ±scale where ``big``, ±scale/3 elsewhere."""
    mag = torch.where(big, scale, scale / 3.0)
    return torch.where(neg, -mag, mag)


def _pack2(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in 0..3, four per byte (zero-padded)."""
    pad = (-codes.numel()) % 4
    c = torch.nn.functional.pad(codes, (0, pad)).view(-1, 4)
    return c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)


def _unpack2(packed: torch.Tensor, n: int) -> torch.Tensor:
    """(world, bytes) packed codes → (world, n) uint8 codes."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 3).reshape(packed.shape[0], -1)[:, :n]
