"""DeepSeekMoE layer: shared experts + fine-grained routed experts with sigmoid top-k gating and
auxiliary-loss-free load balancing (DeepSeek-V3, arXiv 2412.19437, §2.1.2)."""
from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import MOE_IMPLS, ModelConfig
from .layers import SwiGLU


class Routing(NamedTuple):
    """The router's decision for N tokens."""

    indices: torch.Tensor  # (N, k) int64: the k routed experts chosen per token
    weights: torch.Tensor  # (N, k) float32: gate weights (sum to route_scale per token)
    scores: torch.Tensor   # (N, E) float32: sigmoid affinities (without the balancing bias)


class _Recompute:
    depth = 0  # > 0 while activation checkpointing re-runs a forward (syncwise's, through recomputing())


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Mark a forward re-run by activation checkpointing: its tokens were counted by the first forward.
    syncwise's ``apply_activation_checkpointing`` passes it as ``torch.utils.checkpoint``'s recompute context; a
    model checkpointed by hand under ``torch.compile`` should do the same (``context_fn``)."""
    _Recompute.depth += 1
    try:
        yield
    finally:
        _Recompute.depth -= 1


@torch.no_grad()
def balance_bias_(bias: torch.Tensor, load: torch.Tensor, rate: float, apply: torch.Tensor | None = None) -> torch.Tensor:
    """Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2), in place: ``bias += rate * sign(mean(load) - load)``, on
    the device and without reading anything back; nothing moves when no token was counted or ``apply`` is False.
    Returns that decision (a bool tensor). Shared by syncwise's MoE and Hugging Face DeepSeek-V3 routers."""
    load = load.to(bias.device).float()
    ok = load.sum() > 0
    if apply is not None:
        ok = ok & apply.to(ok.device)
    bias += torch.where(ok, rate * torch.sign(load.mean() - load), 0.0).to(bias.dtype)
    return ok


def _in_backward() -> bool:
    # Activation checkpointing re-runs forward inside backward; those tokens were already counted. Issue 24:
    # torch._C._current_graph_task_id() is opaque to dynamo (one graph break per MoE layer), so under
    # torch.compile only the recompute flag decides (a plain attribute: dynamo guards on it, no break); eager
    # runs also ask autograd, which catches checkpointing applied by hand.
    if _Recompute.depth:
        return True
    if torch.compiler.is_compiling():
        return False
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # torch._grouped_mm is on no autocast list (under CPU autocast it returns fp32), so the expert
    # matmuls cast by hand to what autocast would have used for the loop path's ``@``.
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, dims: tuple[int, ...] = ()) -> tuple[bool, str]:
    """Whether ``torch._grouped_mm`` runs here at full speed and without a device-to-host sync.

    Returns ``(ok, reason)``. The rules are those of the installed torch (checked against 2.13's
    ``aten/src/ATen/native/cuda/GroupedBlas.cpp``, ``GroupedMMUtils.h`` and the op's meta function):
    - CUDA: the CUTLASS fast path needs bf16 operands and a device of compute capability 9.x or 10.x
      (H100/H200/H800, B200/GB200); anything else takes ``_grouped_mm_fallback``, which copies the
      offsets to the host (a sync per call) and loops over groups. Strides must be multiples of 16
      bytes, i.e. every matrix dimension a multiple of 8 in bf16. ROCm's fast path depends on a
      build flag (CK) that cannot be queried, so ROCm is treated as unsupported.
    - CPU: fp32, fp16 and bf16 run eagerly (a C++ loop over groups, no Python, no sync), but the
      op's meta function accepts only bf16, so under ``torch.compile`` only bf16 traces.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False, "this torch has no torch._grouped_mm"
    compiling = torch.compiler.is_compiling()
    if device.type == "cpu":
        if compiling and dtype != torch.bfloat16:
            return False, f"torch.compile traces _grouped_mm only in bf16 (its meta function), not {dtype}"
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False, f"_grouped_mm takes fp32/fp16/bf16, not {dtype}"
        return True, "CPU"
    if device.type == "cuda":
        if torch.version.hip is not None:
            return False, "ROCm: the grouped-GEMM fast path depends on a CK build flag"
        if dtype != torch.bfloat16:
            return False, f"the CUDA fast path needs bf16 operands, not {dtype} (the fallback syncs the host)"
        major = torch.cuda.get_device_properties(device).major
        if major not in (9, 10):
            return False, f"the CUDA fast path needs compute capability 9.x or 10.x, not {major}.x"
        if any(d % 8 for d in dims):
            return False, f"the CUDA fast path needs dimensions that are multiples of 8 in bf16, got {dims}"
        return True, f"CUDA sm{major}x bf16"
    return False, f"no _grouped_mm fast path on {device.type}"


def _local(w: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor: tensor parallel keeps the router and routed experts as replicated
    DTensors (identical on every tp rank), and the routing code below runs on their local values."""
    return w.to_local() if hasattr(w, "to_local") else w


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: ``_grouped_mm``'s backward refuses
    a stride-0 incoming gradient (e.g. from ``y.sum().backward()``)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad.contiguous()


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked (E, ...) weights, so expert parallelism can shard dim 0
    and every expert weight always receives a gradient tensor (zero where an expert got no tokens).

    Three exact implementations of the same computation (``impl``; see docs/gpu.md):

    - ``grouped``: three ``torch._grouped_mm`` calls over the expert-sorted rows with int32 offsets
      (cumulative counts). No host sync, static shapes. Chosen where the device and dtype have a
      fast path (``grouped_mm_supported``).
    - ``padded``: each expert's rows are padded to a multiple of a block size B and scattered into a
      fixed (n_blocks, B, d) buffer, n_blocks = (N + E (B - 1)) // B, an upper bound known from
      shapes alone, so no token is ever dropped; each block carries its expert's weights and three
      ``bmm`` calls do the work. Padding rows are zeros and contribute exact zeros. No host sync,
      static shapes. (B = N gives the classic worst-case-capacity (E, N, d) layout.)
    - ``loop``: a Python loop over experts on host-side counts (one sync per call): the reference.

    ``auto`` picks per call from device, dtype and whether torch.compile is tracing: ``grouped``
    where supported, else ``padded``."""

    def __init__(self, n_experts: int, dim: int, hidden: int, impl: str = "auto",
                 block_size: int | None = None) -> None:
        super().__init__()
        if impl not in MOE_IMPLS:
            raise ValueError(f"GroupedExperts impl must be one of {MOE_IMPLS}, got {impl!r}")
        self.impl = impl
        self.block_size = block_size   # padded path; None = chosen from the token and expert counts
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        # Never leave uninitialised memory in a module built on its own (the full model re-inits anyway).
        self.reset_parameters(0.02, 0.02)

    def resolve_impl(self, x: torch.Tensor) -> str:
        """The implementation a call with input ``x`` uses (``auto`` resolved; static per trace)."""
        if self.impl != "auto":
            return self.impl
        ok, _ = grouped_mm_supported(x.device, _compute_dtype(x), tuple(self.w2.shape[-2:]))
        return "grouped" if ok else "padded"

    def forward(self, x: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """``x`` holds token rows sorted by expert, ``counts[e]`` rows for expert e (a tensor on
        ``x``'s device avoids any host sync; a list is accepted too)."""
        impl = self.resolve_impl(x)
        if impl == "loop":
            return self._loop(x, counts if isinstance(counts, list) else counts.tolist())
        if not isinstance(counts, torch.Tensor):
            counts = torch.tensor(counts, dtype=torch.int64, device=x.device)
        if impl == "grouped":
            return self._grouped(x, counts)
        return self._padded(x, counts)

    # ---- implementations ------------------------------------------------------------------------
    def _loop(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # unbind, not w1[e]: the backward of E separate selects would materialise and sum E
        # full-size zero gradients; unbind's backward is a single stack.
        w1, w3, w2 = _local(self.w1).unbind(0), _local(self.w3).unbind(0), _local(self.w2).unbind(0)
        outs = []
        for e, chunk in enumerate(torch.split(x, counts, dim=0)):
            if chunk.shape[0] == 0:
                continue
            outs.append((F.silu(chunk @ w1[e]) * (chunk @ w3[e])) @ w2[e])
        if not outs:
            return x.new_zeros(0, self.w2.shape[-1])
        return torch.cat(outs, dim=0)

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        dt = _compute_dtype(x)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)   # end row of each expert's group
        x = x.to(dt)
        w1, w3, w2 = (_local(w).to(dt) for w in (self.w1, self.w3, self.w2))
        h = F.silu(torch._grouped_mm(x, w1, offs=offs)) * torch._grouped_mm(x, w3, offs=offs)
        return _ContiguousGrad.apply(torch._grouped_mm(h, w2, offs=offs))

    def padded_block_size(self, n_rows: int) -> int:
        """Block size B of the padded path for ``n_rows`` routed rows (``self.block_size`` if set)."""
        if self.block_size is not None:
            return self.block_size
        # Worst-case padding adds E * (B - 1) rows of matmul work, and every block copies its
        # expert's weights: B = half the mean group size (a power of two in 16..256) bounds the
        # padding at ~2x the rows in the worst case and ~1.25x at balanced load, with about three
        # weight copies per expert. On CPU (docs/gpu.md) B = 64 was the best of 8..256 for
        # `small` and tied with 128 for `medium`; GPU matmuls want B >= 64 as well.
        mean = max(1, n_rows // self.w1.shape[0])
        return max(16, min(256, 1 << max(0, (mean // 2).bit_length() - 1)))

    def _padded(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        dt = _compute_dtype(x)
        n, d = x.shape
        n_exp = counts.shape[0]
        B = self.padded_block_size(n)
        n_blocks = (n + n_exp * (B - 1)) // B               # >= sum_e ceil(counts[e] / B), from shapes alone
        blocks = (counts + (B - 1)) // B                    # blocks per expert
        block_end = torch.cumsum(blocks, 0)
        ends = torch.cumsum(counts, 0)
        rows = torch.arange(n, device=x.device)
        expert_of_row = torch.searchsorted(ends, rows, right=True)
        # Row i of expert e (sorted input) goes to padded row (first block of e) * B + (i - start of e).
        dest = rows + ((block_end - blocks) * B - (ends - counts))[expert_of_row]
        buf = x.new_zeros(n_blocks * B, d, dtype=dt).index_copy(0, dest, x.to(dt)).view(n_blocks, B, d)
        # Blocks past the last used one hold zeros; clamp gives them a valid (any) expert.
        block_expert = torch.searchsorted(block_end, torch.arange(n_blocks, device=x.device),
                                          right=True).clamp_(max=n_exp - 1)
        w1, w3, w2 = (_local(w).to(dt).index_select(0, block_expert) for w in (self.w1, self.w3, self.w2))
        h = F.silu(torch.bmm(buf, w1)) * torch.bmm(buf, w3)
        return torch.bmm(h, w2).view(n_blocks * B, -1).index_select(0, dest)

    def reset_parameters(self, std: float, out_std: float) -> None:
        """Normal init; the residual output projection gets the smaller ``out_std``."""
        nn.init.normal_(self.w1, std=std)
        nn.init.normal_(self.w3, std=std)
        nn.init.normal_(self.w2, std=out_std)


class MoE(nn.Module):
    """Shared experts + top-k routed experts; tracks per-expert load for bias balancing."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_routed_experts, cfg.top_k
        self.route_scale, self.bias_update_rate = cfg.route_scale, cfg.bias_update_rate
        self.router = nn.Linear(cfg.d_model, cfg.n_routed_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_routed_experts, cfg.d_model, cfg.moe_hidden, impl=cfg.moe_impl)
        self.shared = (SwiGLU(cfg.d_model, cfg.n_shared_experts * cfg.moe_hidden)
                       if cfg.n_shared_experts > 0 else None)
        # Selection bias: a persistent buffer (checkpointed; identical on all ranks because the
        # load counts are summed across ranks before each update). It never receives gradients.
        self.register_buffer("expert_bias", torch.zeros(cfg.n_routed_experts), persistent=True)
        # Load counts since the last update_bias(): a plain tensor, not a buffer, so DDP does not
        # broadcast rank 0's counts over the others' and checkpoints do not carry a transient.
        self.tokens_per_expert: torch.Tensor = torch.zeros(cfg.n_routed_experts, dtype=torch.int64)
        self.last_load: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> Routing:
        """Sigmoid affinities; top-k by affinity + bias; gate weights = affinities normalised over k."""
        # Gating in fp32 even under autocast: a bf16 router makes near-tie selections noisy.
        with torch.autocast(device_type=x.device.type, enabled=False):
            scores = torch.sigmoid(F.linear(x.float(), _local(self.router.weight).float()))
        # The bias only decides *which* experts; it must not leak into the gate values.
        _, indices = torch.topk(scores.detach() + self.expert_bias.float(), self.top_k, dim=-1)
        weights = scores.gather(-1, indices)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.route_scale
        return Routing(indices, weights, scores)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        r = self.route(x)
        flat = r.indices.reshape(-1)                                   # (N*k,)
        # scatter_add_, not bincount: CUDA's bincount reads the maximum back to the host to size
        # its output. Same int64 counts; no host sync anywhere below (except impl="loop").
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        if self.training and torch.is_grad_enabled() and not _in_backward():
            self._count(counts)
        # Sort token slots by expert so each expert runs one dense matmul over its own tokens.
        order = torch.argsort(flat, stable=True)
        token_of_slot = order // self.top_k
        routed = self.experts(x[token_of_slot], counts)
        routed = routed * r.weights.reshape(-1)[order].unsqueeze(-1).to(routed.dtype)
        out = torch.zeros_like(x, dtype=routed.dtype).index_add_(0, token_of_slot, routed).to(x.dtype)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.reshape(shape)

    def _count(self, counts: torch.Tensor) -> None:
        if self.tokens_per_expert.device != counts.device:
            self.tokens_per_expert = self.tokens_per_expert.to(counts.device)
        self.tokens_per_expert += counts

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor | None = None, apply: torch.Tensor | None = None) -> None:
        """bias += rate * sign(mean_load - load) from ``counts`` (default: own counts); reset counts.

        Decided on the device, without reading anything back: no update when no token was counted, nor
        where ``apply`` (a bool tensor: the trainer's "this step was not skipped") is False. The counts are reset
        either way: a skipped step's routing goes with its update (they are a transient that checkpoints do not
        hold, so carrying them into the next update made a resume from a checkpoint just after a skipped step
        differ from the run that went on; issue 23)."""
        load = (self.tokens_per_expert if counts is None else counts).to(self.expert_bias.device).float()
        ok = balance_bias_(self.expert_bias, load, self.bias_update_rate, apply)
        self.last_load = torch.where(ok, load, load if self.last_load is None else self.last_load)
        self.tokens_per_expert = torch.zeros_like(self.tokens_per_expert)

    def reset_parameters(self, std: float, out_std: float) -> None:
        """Re-initialise weights and zero the selection bias and load counts."""
        nn.init.normal_(self.router.weight, std=std)
        self.experts.reset_parameters(std, out_std)
        if self.shared is not None:
            self.shared.reset_parameters(std, out_std)
        self.expert_bias.zero_()
        self.tokens_per_expert = torch.zeros(self.n_experts, dtype=torch.int64)
        self.last_load = None
