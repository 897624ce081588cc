"""Transformer building blocks: RMSNorm, RoPE, SwiGLU MLP, causal MHA and MLA attention."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (no bias, no mean subtraction)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch >= 2.4 ships a fused F.rms_norm; it also keeps the op visible to torch.compile.
        if hasattr(F, "rms_norm"):
            # Weight cast to the input dtype: under autocast, low-rank latents arrive in bf16 and a
            # dtype mismatch would drop torch to its unfused path.
            return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def reset_parameters(self) -> None:
        """Set the scale back to ones."""
        nn.init.ones_(self.weight)


def rope_tables(seq_len: int, dim: int, theta: float, device: torch.device | None = None,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, dim) for rotate-half RoPE over ``dim`` channels."""
    # Computed per forward instead of cached in a buffer: it costs microseconds, and keeping it out
    # of the module means no buffer for DDP to broadcast, nothing to fix after meta-device init.
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + d/2) of ``x`` (..., T, d) by position-dependent angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class SwiGLU(nn.Module):
    """SwiGLU feed-forward: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def reset_parameters(self, std: float, out_std: float) -> None:
        """Normal init; the residual output projection gets the smaller ``out_std``."""
        nn.init.normal_(self.w1.weight, std=std)
        nn.init.normal_(self.w3.weight, std=std)
        nn.init.normal_(self.w2.weight, std=out_std)


class Attention(nn.Module):
    """Causal multi-head self-attention with RoPE on queries and keys."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.dropout = cfg.n_heads, cfg.head_dim, cfg.dropout
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    @property
    def rope_dim(self) -> int:
        """Channels per head that RoPE rotates."""
        return self.head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # Heads from the last dim: -1 instead of n_heads so tensor-parallel (column-sharded) wq/wk/wv
        # with local heads work unchanged.
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def reset_parameters(self, std: float, out_std: float) -> None:
        """Normal init; the output projection gets the smaller ``out_std``."""
        for lin in (self.wq, self.wk, self.wv):
            nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.wo.weight, std=out_std)


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values are up-projected from one
    low-rank latent (what an inference KV cache would store), plus a small RoPE key shared by all
    heads, because RoPE cannot pass through the low-rank up-projection. Training form (no weight
    absorption): the latent is expanded to full per-head keys/values, then fed to SDPA."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.mla_dims()
        self.n_heads, self.dropout = cfg.n_heads, cfg.dropout
        self.q_lora_rank, self.kv_lora_rank = d["q_lora_rank"], d["kv_lora_rank"]
        self.nope_dim, self.rope_dim_, self.v_dim = d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
        qk_dim = self.nope_dim + self.rope_dim_
        if self.q_lora_rank > 0:
            self.wq_a = nn.Linear(cfg.d_model, self.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(self.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, cfg.n_heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(cfg.d_model, cfg.n_heads * qk_dim, bias=False)
        # One projection produces the KV latent and the shared RoPE key together.
        self.wkv_a = nn.Linear(cfg.d_model, self.kv_lora_rank + self.rope_dim_, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, cfg.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.v_dim, cfg.d_model, bias=False)

    @property
    def rope_dim(self) -> int:
        """Channels per head that RoPE rotates (the decoupled part)."""
        return self.rope_dim_

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        if self.q_lora_rank > 0:
            q = self.wq_b(self.q_norm(self.wq_a(x)))
        else:
            q = self.wq(x)
        q = q.view(B, T, -1, self.nope_dim + self.rope_dim_).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim_], dim=-1)
        kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim_], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(B, T, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        h = k_nope.shape[1]
        q_pe = apply_rope(q_pe, cos, sin)
        k_pe = apply_rope(k_pe.unsqueeze(1), cos, sin).expand(B, h, T, self.rope_dim_)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe], dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def reset_parameters(self, std: float, out_std: float) -> None:
        """Normal init for projections, ones for the latent norms, ``out_std`` for the output."""
        for name in ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b"):
            lin = getattr(self, name, None)
            if lin is not None:
                nn.init.normal_(lin.weight, std=std)
        for name in ("q_norm", "kv_norm"):
            norm = getattr(self, name, None)
            if norm is not None:
                norm.reset_parameters()
        nn.init.normal_(self.wo.weight, std=out_std)


def residual_out_std(cfg: ModelConfig) -> float:
    """GPT-2 scaled init for projections that write into the residual stream."""
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)
