"""Expert parallelism (DeepSeekMoE / GShard style): each MoE layer's routed experts split over the ``ep`` ranks.

``apply_expert_parallel(model, ep_group, dispatch="fp8")`` replaces every ``MoE.experts`` (a
``GroupedExperts``) in place by an :class:`ExpertParallelExperts` that holds this rank's contiguous slice of
E / ep experts and has the same call, ``experts(x_sorted_by_expert, counts) -> rows in the same order``.
``MoE.forward`` is untouched: routing, gates, the aux-loss-free bias and ``tokens_per_expert`` are computed on
this rank's own tokens exactly as without EP; only the routed expert computation moves. Inside the call:

1. counts: an ``all_to_all_single`` of the (ep, E/ep) int64 row counts, so every rank learns how many rows it
   receives from each peer for each of its experts (the variable split sizes the next two need);
2. dispatch: ``all_to_all_single`` of the token rows (already grouped by destination rank, because the MoE
   sorts slots by expert and each rank owns a contiguous slice), in fp32, bf16 or fp8 e4m3 with one fp32
   scale per 128 elements of a row (DeepSeek-V3's 1x128 tiles; syncwise's ``FP8Compressor`` codec);
3. local grouped expert compute on the received rows, re-sorted by local expert (``GroupedExperts``' own
   implementations: grouped / padded / loop);
4. combine: the reverse ``all_to_all_single`` (bf16 when the dispatch is fp8, as in DeepSeek-V3).

A custom autograd Function runs the reverse exchange in backward: the gradient of the dispatch travels like a
combine and vice versa. Backward exchanges never use fp8 (see :data:`DISPATCH_DTYPES` and docs/expert_parallel.md).

The routed expert weights become DTensors ``Shard(0)`` on a 1-D ep mesh with their global (E, ...) shape and
unchanged names, so DCP checkpoints reshard between ep sizes (ep2 → ep1 and back) and ``count_params`` /
FLOPs counts still see the whole model; the forward reads the local shard through ``to_local()`` (as
``models/moe.py``'s ``_local`` already does for tensor parallel). Every all-to-all goes through
``syncwise.comm.ops.all_to_all`` into the ``stats`` given (a run's ``ledger.ep``: ``comm_bytes_ep``; else one CommStats
of its own shared by the model's layers, each layer's ``experts.stats``).

Gradient rule (see docs/expert_parallel.md): an expert's gradient already sums the contributions of every
ep-group rank's tokens, so where dense gradients are averaged over all ``dp`` data-parallel ranks, expert
gradients are summed over the ranks holding the same experts (dp / ep of them) and divided by ``dp``:
:func:`reduce_expert_gradients`.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import hostread, ops
from ..comm.stats import CommStats
from ..errors import ConfigError
from ..layout import DISPATCH, check_expert_count
from ..models.moe import GroupedExperts, MoE, _local

__all__ = ["apply_expert_parallel", "ExpertParallelExperts", "Wires", "DISPATCH_DTYPES", "COMBINE_DTYPES",
           "check_expert_parallel", "check_dispatch", "expert_parameters", "reduce_expert_gradients",
           "encode_fp8_rows", "decode_fp8_rows", "wire_row_bytes"]

#: accepted ``dispatch`` values; the wire dtypes of the four exchanges follow from it (docs/expert_parallel.md):
#: forward dispatch = ``dispatch``; forward combine = ``combine`` (default: bf16 under fp8, else ``dispatch``);
#: backward of the combine (dispatch-shaped) = ``dispatch`` with fp8 → bf16; backward of the dispatch = combine's.
DISPATCH_DTYPES = DISPATCH  # the layout owner's (syncwise.layout)
#: accepted ``combine`` values: combined rows are multiplied by gates and summed, DeepSeek-V3 keeps them 16-bit
COMBINE_DTYPES = ("bf16", "fp32")
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
FP8_BLOCK = 128   # elements per fp32 scale along a row (DeepSeek-V3's 1x128 activation tiles)


# ------------------------------------------------------------------------------------------- checks
def check_expert_parallel(n_routed_experts: int, ep: int) -> None:
    """Raise ConfigError (field ``parallel.ep``) unless ``ep`` ≥ 1 divides the routed experts per layer
    (the rule is syncwise.layout's)."""
    check_expert_count(n_routed_experts, ep)


def check_dispatch(dispatch: str, combine: Optional[str] = None) -> tuple[str, str]:
    """Validate the dispatch / combine precisions; return ``(dispatch, combine)`` with the default filled in."""
    if dispatch not in DISPATCH_DTYPES:
        raise ConfigError("parallel.ep_dispatch", dispatch, "one of: " + ", ".join(DISPATCH_DTYPES))
    if combine is None:
        combine = "bf16" if dispatch == "fp8" else dispatch
    if combine not in COMBINE_DTYPES:
        raise ConfigError("parallel.ep_combine", combine, "one of: " + ", ".join(COMBINE_DTYPES))
    if dispatch == "fp8" and getattr(torch, "float8_e4m3fn", None) is None:
        raise ConfigError("parallel.ep_dispatch", dispatch, "bf16 or fp32: this torch has no float8_e4m3fn")
    return dispatch, combine


# ------------------------------------------------------------------------------------------ fp8 rows
_CODECS: dict[int, Any] = {}


def _codec(block: int):
    # syncwise's fp8 code (compress/cast.py): one codec per block size, stateless without error feedback.
    codec = _CODECS.get(block)
    if codec is None:
        from ..compress.cast import FP8Compressor
        codec = _CODECS[block] = FP8Compressor(block=block)
    return codec


def wire_row_bytes(d: int, wire: str, block: int = FP8_BLOCK) -> int:
    """Bytes one row of ``d`` elements takes on the wire: 4d (fp32), 2d (bf16), d + 4 ceil(d / block) (fp8)."""
    if wire == "fp8":
        return d + 4 * -(-d // block)
    return d * _TORCH_DTYPES[wire].itemsize


def encode_fp8_rows(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """(n, d) floats → (n, d + 4 ceil(d / block)) uint8: each row's e4m3 codes, then its fp32 block scales.

    Blocks run along a row (a row is padded with zeros to whole blocks for the scales, the padding is not
    sent), so the payload splits by rows and all_to_all_single can cut it with row split sizes."""
    n, d = x.shape
    nb = -(-d // block)
    if n == 0:
        return torch.empty(0, d + 4 * nb, dtype=torch.uint8, device=x.device)
    width = nb * block
    xp = x.float()
    if width != d:
        xp = F.pad(xp, (0, width - d))
    flat, _ = _codec(block)._encode(xp.reshape(-1), None, None, 0)   # [n * width codes | n * nb fp32 scales]
    codes = flat[:n * width].view(n, width)[:, :d]
    scales = flat[n * width:].view(n, 4 * nb)
    return torch.cat([codes, scales], dim=1)


def decode_fp8_rows(payload: torch.Tensor, d: int, dtype: torch.dtype, block: int = FP8_BLOCK) -> torch.Tensor:
    """Inverse of :func:`encode_fp8_rows`: (n, d + 4 nb) uint8 → (n, d) in ``dtype``."""
    n = payload.shape[0]
    nb = -(-d // block)
    if n == 0:
        return torch.empty(0, d, dtype=dtype, device=payload.device)
    width = nb * block
    codes = payload[:, :d]
    if width != d:
        codes = F.pad(codes, (0, width - d))   # code 0 is +0.0
    flat = torch.cat([codes.reshape(-1), payload[:, d:].reshape(-1)])
    return _codec(block)._decode_sum(flat[None], None, n * width).view(n, width)[:, :d].to(dtype)


# ----------------------------------------------------------------------------------------- exchange
def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any, wire: str,
              stats: CommStats, block: int) -> torch.Tensor:
    """all_to_all_single of rows ``x`` (``in_splits`` rows to each rank) in the ``wire`` precision; the rows
    received (``out_splits`` from each rank) come back in ``x``'s dtype."""
    rows = sum(out_splits)
    if wire == "fp8":
        send = encode_fp8_rows(x, block)
        recv = send.new_empty(rows, send.shape[1])
        ops.all_to_all(recv, send, out_splits, in_splits, group=group, stats=stats)
        return decode_fp8_rows(recv, x.shape[1], x.dtype, block)
    send = x.to(_TORCH_DTYPES[wire]).contiguous()
    recv = send.new_empty(rows, *send.shape[1:])
    ops.all_to_all(recv, send, out_splits, in_splits, group=group, stats=stats)
    return recv.to(x.dtype)


class _AllToAll(torch.autograd.Function):
    """Rows to peers; backward sends the rows' gradients back by the mirrored splits (in ``grad_wire``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any,  # noqa: D102
                wire: str, grad_wire: str, stats: CommStats, block: int) -> torch.Tensor:
        ctx.args = (out_splits, in_splits, group, grad_wire, stats, block, x.dtype)
        return _exchange(x, out_splits, in_splits, group, wire, stats, block)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        out_splits, in_splits, group, grad_wire, stats, block, dtype = ctx.args
        g = _exchange(grad.contiguous(), in_splits, out_splits, group, grad_wire, stats, block).to(dtype)
        return g, None, None, None, None, None, None, None


@dataclass(frozen=True)
class Wires:
    """Wire precision of each of the four row exchanges of one MoE layer."""

    dispatch: str        # forward: token rows to their experts
    combine: str         # forward: expert outputs back to their tokens
    dispatch_grad: str   # backward of the dispatch (combine-shaped): gradients of the expert inputs
    combine_grad: str    # backward of the combine (dispatch-shaped): gradients of the expert outputs

    @classmethod
    def of(cls, dispatch: str, combine: Optional[str] = None) -> "Wires":
        dispatch, combine = check_dispatch(dispatch, combine)
        # Gradients are not sent in fp8: bf16 where the dispatch is fp8 (DeepSeek-V3 also quantises the
        # gradient entering the down-projections to fp8; kept 16-bit here, a choice, not a limitation).
        return cls(dispatch, combine, dispatch_grad=combine, combine_grad="bf16" if dispatch == "fp8" else dispatch)


# ------------------------------------------------------------------------------------- the EP module
class ExpertParallelExperts(GroupedExperts):
    """This rank's E / ep routed experts (DTensor ``Shard(0)`` weights of global shape (E, ...)) behind
    ``GroupedExperts``' call: dispatch → local grouped compute → combine (see the module doc)."""

    def __init__(self, experts: GroupedExperts, mesh: Any, wires: Wires, stats: CommStats,
                 block: int = FP8_BLOCK) -> None:
        from torch.distributed.tensor import DTensor, Shard

        # nn.Module.__init__, not GroupedExperts.__init__: that one would allocate and randomly initialise
        # weights, drawing from the global RNG differently than the run without EP.
        nn.Module.__init__(self)
        self.impl, self.block_size = experts.impl, experts.block_size
        n_experts = experts.w1.shape[0]
        self.ep, self.ep_rank = mesh.size(), mesh.get_local_rank()
        check_expert_parallel(n_experts, self.ep)
        self.n_experts, self.n_local = n_experts, n_experts // self.ep
        self.mesh, self.group = mesh, mesh.get_group()
        self.wires, self.stats, self.block = wires, stats, block
        lo = self.ep_rank * self.n_local
        for name in ("w1", "w3", "w2"):
            full = getattr(experts, name)
            shard = full.detach()[lo:lo + self.n_local].clone()
            self.register_parameter(name, nn.Parameter(DTensor.from_local(shard, mesh, [Shard(0)], run_check=False),
                                                       requires_grad=full.requires_grad))

    def __deepcopy__(self, memo: dict) -> "ExpertParallelExperts":
        # A copy (an EMA model, a reference) shares the process groups and the byte counter: neither can be
        # copied (a ProcessGroup does not pickle, CommStats holds a lock), and both belong to the job.
        for shared in (self.mesh, self.group, self.stats):
            memo[id(shared)] = shared
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = copy.deepcopy(value, memo)
        return new

    def extra_repr(self) -> str:
        w = self.wires
        return (f"experts {self.ep_rank * self.n_local}..{(self.ep_rank + 1) * self.n_local - 1} of {self.n_experts}, "
                f"ep={self.ep}, dispatch={w.dispatch}, combine={w.combine}, impl={self.impl}")

    def padded_block_size(self, n_rows: int) -> int:
        # The same rule as GroupedExperts', over the local experts (w1.shape[0] is the global E here).
        if self.block_size is not None:
            return self.block_size
        mean = max(1, n_rows // self.n_local)
        return max(16, min(256, 1 << max(0, (mean // 2).bit_length() - 1)))

    # Opaque to torch.compile: the split sizes are host integers read from a collective's result, and the
    # collectives run inside an autograd Function; the expert matmuls inside run eagerly.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """``x``: this rank's token rows sorted by (global) expert, ``counts[e]`` rows for expert e; returns
        the experts' outputs for those rows, in the same order."""
        if not isinstance(counts, torch.Tensor):
            counts = torch.tensor(counts, dtype=torch.int64, device=x.device)
        ep, n_local, group, w = self.ep, self.n_local, self.group, self.wires
        # Rows this rank sends to (rank r, its local expert e): contiguous in x, because experts are
        # contiguous per rank and x is sorted by expert.
        send = counts.to(torch.int64).reshape(ep, n_local).contiguous()
        recv = torch.empty_like(send)
        ops.all_to_all(recv, send, group=group, stats=self.stats)
        # The one host sync: all_to_all_single takes its split sizes as host integers.
        with hostread.designed("expert parallel: all_to_all split sizes (NCCL takes them from the host)"):
            in_splits, out_splits = torch.stack([send.sum(1), recv.sum(1)]).tolist()
        rows = _AllToAll.apply(x, out_splits, in_splits, group, w.dispatch, w.dispatch_grad, self.stats, self.block)
        y = self._local_experts(rows, recv)
        return _AllToAll.apply(y, in_splits, out_splits, group, w.combine, w.combine_grad, self.stats, self.block)

    def _local_experts(self, rows: torch.Tensor, recv: torch.Tensor) -> torch.Tensor:
        """Rows arrive grouped by source rank, then by local expert: compute them grouped by local expert
        and hand the outputs back in arrival order."""
        n = rows.shape[0]
        if n == 0:
            # No rows here this step. The output still hangs off ``rows``, so this rank's backward runs the
            # dispatch's reverse all-to-all like its peers (a skipped collective would hang them), and off
            # the weights, which get (zero) gradients as every expert does without EP.
            zero = sum(_local(p).sum() for p in (self.w1, self.w3, self.w2)) * 0.0
            return rows.new_zeros(0, self.w2.shape[-1]) + (zero.to(rows.dtype) + rows.sum() * 0.0)
        local_counts = recv.sum(0)
        if self.n_local == 1:
            return GroupedExperts.forward(self, rows, local_counts)
        ids = torch.arange(self.n_local, device=rows.device).repeat(self.ep)
        expert_of_row = torch.repeat_interleave(ids, recv.reshape(-1), output_size=n)
        order = torch.argsort(expert_of_row, stable=True)
        y = GroupedExperts.forward(self, rows.index_select(0, order), local_counts)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(n, device=order.device))
        return y.index_select(0, inverse)


# ------------------------------------------------------------------------------------------ applying
def _ep_mesh(ep_group: Any, device_type: str) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(ep_group, DeviceMesh):
        if ep_group.ndim != 1:
            raise ValueError(f"apply_expert_parallel takes a 1-D ep mesh (e.g. mesh['ep']), got {ep_group.ndim}-D")
        return ep_group
    return DeviceMesh.from_group(ep_group, device_type, mesh_dim_names=("ep",))


def apply_expert_parallel(model: nn.Module, ep_group: Any, dispatch: str = "fp32", combine: Optional[str] = None,
                          *, stats: Optional[CommStats] = None, block: int = FP8_BLOCK) -> nn.Module:
    """Split every MoE layer's routed experts of ``model`` over ``ep_group`` in place and return ``model``.

    ``ep_group``: a ProcessGroup or a 1-D DeviceMesh (``mesh['ep']``) of the ranks that share experts; each
    must feed its own tokens (EP ranks are data-parallel ranks). ``dispatch``: ``fp8`` | ``bf16`` | ``fp32``
    wire precision of the token rows; ``combine``: ``bf16`` | ``fp32`` (default: bf16 under fp8, else the
    dispatch's). ``stats``: where the bytes of every all-to-all (counts, dispatch, combine, and their backward) go (a
    run's ``ledger.ep``; default: one CommStats of their own, every layer's ``experts.stats``). ``block``: elements per
    fp8 scale. Shared experts and the router stay as they are (replicated). Call it with identical weights on
    every rank (same seed), after tensor parallel and before data parallel / FSDP2 and the optimizer."""
    if ep_group is None:
        return model
    wires = Wires.of(dispatch, combine)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    device = next(model.parameters()).device
    mesh = _ep_mesh(ep_group, device.type)
    ep = mesh.size()
    if ep == 1:
        return model
    if not moes:
        raise ConfigError("parallel.ep", ep, "1 for a model without MoE layers")
    stats = stats if stats is not None else CommStats()
    for moe in moes:
        check_expert_parallel(moe.n_experts, ep)
        experts = moe.experts
        if isinstance(experts, ExpertParallelExperts) or any(hasattr(p, "to_local") for p in experts.parameters()):
            raise ConfigError("parallel.ep", ep, "ep = 1 with tensor parallel or a model already expert-parallel: "
                              "routed experts that are DTensors already cannot be split again")
        moe.experts = ExpertParallelExperts(experts, mesh, wires, stats, block)
    model._syncwise_ep = {"size": ep, "dispatch": wires.dispatch, "combine": wires.combine}
    return model


# ---------------------------------------------------------------------------------------- gradients
def expert_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The expert-parallel parameters of ``model`` by name (what dense data parallel must leave alone)."""
    out: dict[str, nn.Parameter] = {}
    for name, module in model.named_modules():
        if isinstance(module, ExpertParallelExperts):
            for p_name, p in module.named_parameters(recurse=False):
                out[f"{name}.{p_name}" if name else p_name] = p
    return out


@torch.no_grad()
def reduce_expert_gradients(model: nn.Module, dp_size: int, replica_group: Any = None,
                            stats: Optional[CommStats] = None, compressed: Any = None) -> None:
    """Make expert gradients what the job's loss (the mean over all ``dp_size`` data-parallel ranks) asks.

    After backward each expert's gradient already sums every ep-group rank's tokens (the dispatch brought them
    to it); ranks with the same ep coordinate hold copies of the same experts (``replica_group``, dp / ep of
    them; None when there is only one). The rule: sum over ``replica_group``, divide by ``dp_size`` — the factor
    dense gradients are averaged by. Call once per optimizer step, after the last micro-batch's backward.

    ``compressed``: a ``CompressionHookState`` whose compressor carries the sum instead of an fp32 all-reduce: its
    average over the R copies, divided by dp / R (the compressor's state is keyed by the experts' names).
    ``stats``: where the fp32 sum is counted (a run's ``ledger.dp``; None: nowhere)."""
    named = [(n, p.grad) for n, p in expert_parameters(model).items() if p.grad is not None]
    if not named:
        return
    local = [_local(g) for _, g in named]
    if compressed is not None and replica_group is not None:
        import torch.distributed as dist
        compressed.average(local, [n for n, _ in named], replica_group)
        torch._foreach_div_(local, float(dp_size // dist.get_world_size(replica_group)))
        return
    if replica_group is not None:
        import torch.distributed as dist
        if dist.get_world_size(replica_group) > 1:
            flat = torch.cat([g.reshape(-1) for g in local])
            ops.all_reduce(flat, "sum", group=replica_group, stats=stats)
            for g, c in zip(local, flat.split([g.numel() for g in local])):
                g.copy_(c.view_as(g))
    torch._foreach_div_(local, float(dp_size))
