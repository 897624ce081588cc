"""DeepSeekLM: a plain nn.Module decoder (dense or MoE, MHA or MLA); parallelism is applied outside."""
from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from syncwise.errors import SyncwiseError

from .config import ModelConfig, resolve_config
from .layers import Attention, MLAttention, RMSNorm, SwiGLU, residual_out_std, rope_tables
from .moe import MoE


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp_or_moe(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = MLAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.moe = cfg.layer_is_moe(layer_id)
        self.ffn: nn.Module = MoE(cfg) if self.moe else SwiGLU(cfg.d_model, cfg.ffn_hidden)
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), cos, sin))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))

    def reset_parameters(self, cfg: ModelConfig) -> None:
        """GPT-2 style init of every weight in the block."""
        std, out_std = cfg.init_std, residual_out_std(cfg)
        self.attn_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attn.reset_parameters(std, out_std)
        self.ffn.reset_parameters(std, out_std)


class DeepSeekLM(nn.Module):
    """Decoder-only LM: ``model(idx) -> logits (B, T, vocab)``; no loss inside.

    Layers live in a ModuleDict keyed "0".."L-1" and the embedding, final norm and head may be set
    to None, so a pipeline stage can delete what it does not own and keep stable parameter names
    (torchtitan's convention). A stage without an embedding takes hidden states as input."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.sequence_shards = 1  # how many parts the residual stream's sequence is split into (sequence parallel)
        self._rope_dim = cfg.mla_dims()["qk_rope_head_dim"] if cfg.attention == "mla" else cfg.head_dim
        self.init_weights()

    # ---- properties the trainer reads -------------------------------------------------------
    @property
    def has_sparse_params(self) -> bool:
        """Whether some parameters can miss a gradient in a step (DDP ``find_unused_parameters``).

        False even for MoE: routed experts are stacked (E, ...) tensors, so an expert that got no
        tokens still receives a (zero) slice of a gradient tensor, and every token reaches the
        router weight through its gate values. Unused-parameter search would be pure overhead."""
        return False

    def moe_layers(self) -> Iterator[MoE]:
        """The MoE modules of this (possibly pipeline-split) model, in layer order."""
        for block in self.layers.values():
            if isinstance(block.ffn, MoE):
                yield block.ffn

    # ---- init ---------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise all weights GPT-2 style: N(0, init_std); residual output projections
        N(0, init_std / sqrt(2 * n_layers)); norms to one; MoE biases and counts to zero.
        Call after ``to_empty()`` when the model was built on the meta device."""
        cfg = self.config
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=cfg.init_std)
        for block in self.layers.values():
            block.reset_parameters(cfg)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not cfg.tie_embeddings:
            nn.init.normal_(self.output.weight, std=cfg.init_std)

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab); hidden states in/out for pipeline stages."""
        # A stage that starts from hidden states under sequence parallel gets its 1/sequence_shards of the sequence.
        T = idx.shape[1] * (self.sequence_shards if self.tok_embeddings is None else 1)
        if T > self.config.seq_len:
            raise SyncwiseError(f"input has {T} tokens but the model's seq_len is {self.config.seq_len}; "
                                "use shorter sequences or build the model with a larger model.seq_len")
        h = self.drop(self.tok_embeddings(idx)) if self.tok_embeddings is not None else idx
        cos, sin = rope_tables(T, self._rope_dim, self.config.rope_theta, device=h.device)
        for block in self.layers.values():
            h = block(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    # ---- MoE load balancing -------------------------------------------------------------------
    @torch.no_grad()
    def update_router_bias(self, reduce_fn: Callable[[torch.Tensor], object] | None = None,
                           apply: torch.Tensor | None = None) -> None:
        """Apply the auxiliary-loss-free bias update to every MoE layer from the token counts seen
        since the last call, then reset the counts. Call once after each optimizer step.

        ``reduce_fn(t)`` (e.g. an all-reduce sum over the data-parallel group) must sum ``t`` in
        place across ranks, so every rank applies the same update and biases stay identical. All
        layers' counts go in one (n_moe_layers, E) int64 tensor: one collective per step. ``apply``: a bool
        tensor, False when the optimizer skipped the step (the counts are reset either way)."""
        moes = list(self.moe_layers())
        if not moes:
            return
        counts = torch.stack([m.tokens_per_expert.to(m.expert_bias.device) for m in moes])
        if reduce_fn is not None:
            reduce_fn(counts)
        for moe, c in zip(moes, counts):
            moe.update_bias(c, apply)

    def router_load(self) -> dict[int, torch.Tensor]:
        """Per MoE layer (by layer index): each expert's share of routed token slots (sums to 1;
        uniform = 1/E) over the last window closed by update_router_bias (summed over ranks when a
        reduce_fn was given); before the first update, the current local counts."""
        loads = {}
        for block in self.layers.values():
            if isinstance(block.ffn, MoE):
                m = block.ffn
                load = m.last_load if m.last_load is not None else m.tokens_per_expert.float()
                total = load.sum()
                loads[block.layer_id] = load / total if total > 0 else torch.full_like(load, 1 / m.n_experts)
        return loads


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over (B, T, V) logits and (B, T) targets (the trainer's and the pipeline's
    last stage's loss)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def build_model(cfg_or_preset: ModelConfig | str = "small", **overrides: object) -> DeepSeekLM:
    """Build a DeepSeekLM from a ModelConfig or preset name, with field overrides (validated)."""
    return DeepSeekLM(resolve_config(cfg_or_preset, **overrides))


def count_params(model: nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once; DTensors by global size)."""
    return sum(p.numel() for p in model.parameters())


def _attn_params(cfg: ModelConfig) -> int:
    d = cfg.d_model
    if cfg.attention == "mha":
        return 4 * d * d
    m, H = cfg.mla_dims(), cfg.n_heads
    qk = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
    q = (d * m["q_lora_rank"] + m["q_lora_rank"] + m["q_lora_rank"] * H * qk) if m["q_lora_rank"] else d * H * qk
    kv = d * (m["kv_lora_rank"] + m["qk_rope_head_dim"]) + m["kv_lora_rank"] \
        + m["kv_lora_rank"] * H * (m["qk_nope_head_dim"] + m["v_head_dim"])
    return q + kv + H * m["v_head_dim"] * d


def param_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameter counts computed from the config alone.

    Active counts the shared experts, top_k of the routed experts and the router, not the other
    routed experts. Both include embedding and head (tied: once)."""
    d = cfg.d_model
    total = active = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2) + d   # embed, head, final norm
    for i in range(cfg.n_layers):
        layer = _attn_params(cfg) + 2 * d                                       # attention, two norms
        total += layer
        active += layer
        if cfg.layer_is_moe(i):
            expert = 3 * d * cfg.moe_hidden
            common = cfg.n_routed_experts * d + cfg.n_shared_experts * expert  # router, shared
            total += common + cfg.n_routed_experts * expert
            active += common + cfg.top_k * expert
        else:
            total += 3 * d * cfg.ffn_hidden
            active += 3 * d * cfg.ffn_hidden
    return total, active


def train_memory_bytes(cfg: ModelConfig, batch_size: int, activation_bytes: int = 4,
                       activation_checkpointing: bool = False) -> int:
    """A lower bound on one worker's memory for a training step with AdamW at context ``cfg.seq_len``.

    16 bytes per parameter (fp32 weights, gradients and AdamW's two moments) plus what backward keeps
    per token: in each block at least the two norm inputs and outputs, q/k/v, the rotated q/k and the
    attention output (10 x d_model) and two MLP hidden activations (the SwiGLU gate and up projections,
    for MoE blocks of the shared + top_k experts), plus the logits and their gradient; with activation
    checkpointing only each block's input and one block's activations at a time. Attention scores are
    not counted (SDPA's fused kernels need not store them), nor the framework's own overhead, so a
    configuration above this bound cannot run; one below it may still not fit.
    """
    d = cfg.d_model
    blocks = [10 * d + 2 * ((cfg.n_shared_experts + cfg.top_k) * cfg.moe_hidden if cfg.layer_is_moe(i)
                            else cfg.ffn_hidden) for i in range(cfg.n_layers)]
    per_token = (cfg.n_layers * d + max(blocks)) if activation_checkpointing else sum(blocks)
    per_token += 2 * cfg.vocab_size
    total, _ = param_counts(cfg)
    return 16 * total + activation_bytes * batch_size * cfg.seq_len * per_token


def flops_per_token(cfg: ModelConfig | str, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward), for MFU.

    ``6 * N + 6 * L * T * H * (d_qk + d_v)``, PaLM's convention (appendix B): N = active
    parameters that do a matmul per token (all of them except the input-embedding lookup; the
    output head is included; for MoE only shared + top_k routed experts + router), and the second
    term is the QK^T and AV matmuls (2 FLOPs per MAC, x3 for fwd+bwd) at context T = ``seq_len``
    (default cfg.seq_len), without discounting the causal mask. For MHA d_qk = d_v = head_dim,
    i.e. the familiar 12 * L * H * head_dim * T."""
    cfg = resolve_config(cfg)
    T = cfg.seq_len if seq_len is None else seq_len
    _, active = param_counts(cfg)
    n = active - cfg.vocab_size * cfg.d_model
    if cfg.tie_embeddings:
        # The tied matrix is still used once as the head matmul.
        n += cfg.vocab_size * cfg.d_model
    if cfg.attention == "mla":
        m = cfg.mla_dims()
        qk, v = m["qk_nope_head_dim"] + m["qk_rope_head_dim"], m["v_head_dim"]
    else:
        qk = v = cfg.head_dim
    return float(6 * n + 6 * cfg.n_layers * T * cfg.n_heads * (qk + v))
