"""DeepSeekMoE layer: shared experts + fine-grained routed experts with sigmoid top-k gating and
auxiliary-loss-free load balancing (DeepSeek-V3, arXiv 2412.19437, §2.1.2)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import SwiGLU


class Routing(NamedTuple):
    """The router's decision for N tokens."""

    indices: torch.Tensor  # (N, k) int64: the k routed experts chosen per token
    weights: torch.Tensor  # (N, k) float32: gate weights (sum to route_scale per token)
    scores: torch.Tensor   # (N, E) float32: sigmoid affinities (without the balancing bias)


def _in_backward() -> bool:
    # Activation checkpointing re-runs forward inside backward; those tokens were already counted.
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked (E, ...) weights, so expert parallelism can shard dim 0
    and every expert weight always receives a gradient tensor (zero where an expert got no tokens)."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        # Never leave uninitialised memory in a module built on its own (the full model re-inits anyway).
        self.reset_parameters(0.02, 0.02)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x`` holds token rows sorted by expert, ``counts[e]`` rows for expert e."""
        # unbind, not w1[e]: the backward of E separate selects would materialise and sum E
        # full-size zero gradients; unbind's backward is a single stack.
        w1, w3, w2 = self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0)
        outs = []
        for e, chunk in enumerate(torch.split(x, counts, dim=0)):
            if chunk.shape[0] == 0:
                continue
            outs.append((F.silu(chunk @ w1[e]) * (chunk @ w3[e])) @ w2[e])
        if not outs:
            return x.new_zeros(0, self.w2.shape[-1])
        return torch.cat(outs, dim=0)

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
        self.experts = GroupedExperts(cfg.n_routed_experts, cfg.d_model, cfg.moe_hidden)
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
            scores = torch.sigmoid(F.linear(x.float(), self.router.weight.float()))
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
        counts = torch.bincount(flat, minlength=self.n_experts)
        if self.training and torch.is_grad_enabled() and not _in_backward():
            self._count(counts)
        # Sort token slots by expert so each expert runs one dense matmul over its own tokens.
        order = torch.argsort(flat, stable=True)
        token_of_slot = order // self.top_k
        routed = self.experts(x[token_of_slot], counts.tolist())
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
    def update_bias(self, counts: torch.Tensor | None = None) -> None:
        """bias += rate * sign(mean_load - load) from ``counts`` (default: own counts); reset counts."""
        load = (self.tokens_per_expert if counts is None else counts).to(self.expert_bias.device).float()
        if load.sum() > 0:
            self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
            self.last_load = load.clone()
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
