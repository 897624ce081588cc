"""Memory per rank: parameters, gradients and optimizer state under each sharding, activations under each
recomputation mode, pipeline in-flight micro-batches, and the transient buffers.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(MLSys 2023, arXiv:2205.05198), §4: one GPT layer stores ``s·b·h·(34 + 5·a·s/h)`` bytes in 16-bit activations
(attention 11·sbh + 5·a·s²·b, MLP 19·sbh, two LayerNorms 4·sbh); with tensor parallel t the part inside the
tensor-parallel regions divides by t, ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``; with sequence parallel all of it,
``s·b·h·(34/t + 5·a·s/(h·t))``; selective recomputation drops the ``5·a·s/h`` attention-core term; full
recomputation keeps only each layer's input ``2·s·b·h`` (÷ t with sequence parallel). The output layer keeps
fp32 logits, ``4·s·b·v/t``. The first pipeline stage holds ``p`` micro-batches in flight under 1F1B (``M``
under GPipe), and interleaving with ``v`` stages per rank multiplies that by ``1 + (p − 1)/(p·v)`` (§4.2.3).

The terms are generalised (each term of the paper's sum kept by name) to SwiGLU MLPs (gate, up and their
product: 3·F instead of GeLU's 2·F), grouped-query attention (K and V at n_kv_heads), MLA (the latent
vectors), MoE blocks (top_k dispatched copies, expert hidden states and outputs, shared experts, fp32 router
logits), fused attention kernels (no s² terms, as selective recomputation), no dropout (no masks) and an fp32
residual stream (autocast over fp32 weights). Each assumption is listed in docs/plan.md.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from .layout import Layout, Training
from .model import ModelSpec


@dataclass
class Memory:
    """Bytes on the most loaded rank, by kind; ``total`` sums them."""

    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())


# ------------------------------------------------------------------------------------------------ parameters
@dataclass(frozen=True)
class StageParams:
    """Parameters held by one rank, split by how they are synchronised: ``dense`` (data-parallel over all dp
    ranks) and ``expert`` (routed experts: data-parallel over dp / ep ranks), plus ``unit`` = the largest FSDP
    unit (one block) before sharding, all after tensor / expert parallel splits."""

    dense: float
    expert: float
    unit: float
    layers: float

    @property
    def total(self) -> float:
        return self.dense + self.expert


def _layer_split(model: ModelSpec, i: int, tp: int, ep: int) -> tuple[float, float]:
    """(dense, expert) parameters of block ``i`` on one rank: attention, dense MLP and shared experts ÷ tp
    (MLA's latent down-projections and norms stay replicated, as syncwise's tensor-parallel plan keeps them);
    routed experts ÷ ep (replicated under tp, as in syncwise); norms and router replicated."""
    p = model.layer_params(i)
    t = tp
    attn = p["attention"]
    if model.attention == "mla" and t > 1:
        m = model.mla_dims()
        replicated = model.d_model * (m["q_lora_rank"] + m["kv_lora_rank"] + m["qk_rope_head_dim"]) \
            + m["q_lora_rank"] + m["kv_lora_rank"]
        attn = replicated + (attn - replicated) / t
    else:
        attn = attn / t
    dense = attn + p["norms"] + p["mlp"] / t + p["shared"] / t + p["router"]
    return dense, p["routed"] / ep


def stage_params(model: ModelSpec, layout: Layout) -> StageParams:
    """The most loaded rank's parameters: ``L / pp`` layers (syncwise balances stages by FLOPs; the average is
    used) plus the embedding on the first stage or the head on the last (both on rank 0 under a V schedule)."""
    v_shape = layout.pp_schedule in ("zbv", "dualpipev") and layout.pp > 1
    return _stage_params(model, layout.tp, layout.ep, layout.pp, v_shape)


@functools.lru_cache(maxsize=4096)
def _stage_params(model: ModelSpec, tp: int, ep: int, pp: int, v_shape: bool) -> StageParams:
    dense = expert = unit = 0.0
    for i in range(model.n_layers):
        d, e = _layer_split(model, i, tp, ep)
        dense, expert, unit = dense + d, expert + e, max(unit, d + e)
    dense, expert = dense / pp, expert / pp
    embed = model.embedding_params() / tp
    head = model.head_params() / tp
    ends = embed + head if (pp == 1 or v_shape) else max(embed, head)
    return StageParams(dense + ends, expert, unit, model.n_layers / pp)


def state_bytes(model: ModelSpec, layout: Layout, training: Training, accumulating: bool) -> dict[str, float]:
    """Weights, gradients, optimizer state (and the buffers that scale with them) on one rank.

    DDP: everything whole. FSDP2 / HSDP (dp_shard > 1): weights, gradients and optimizer state ÷ dp_shard, plus
    two gathered units (the one computing and the one prefetched) and, when micro-batches accumulate, the
    unsharded gradient sum (syncwise's ``no_gradient_sync`` keeps it until the last micro-batch). ZeRO-1
    (``zero1``): optimizer state ÷ dp. Expert parameters shard the same way over their own replicas."""
    sp = stage_params(model, layout)
    t = training
    shard = layout.dp_shard
    opt_div = layout.dp if layout.zero1 else shard
    out = {
        "weights": sp.total * t.weight_bytes / shard,
        "gradients": sp.total * t.grad_bytes / shard,
        "optimizer": sp.dense * t.optimizer_bytes / opt_div
        + sp.expert * t.optimizer_bytes / (max(1, layout.dp // layout.ep) if layout.zero1 else shard),
    }
    if shard > 1:
        out["fsdp_gathered_units"] = 2 * sp.unit * t.gather_bytes
        if accumulating:
            out["gradients"] += sp.total * t.grad_bytes * (1 - 1 / shard)
    elif t.ddp_bucket_copy and layout.dp > 1 and layout.pp == 1 and not (layout.tp > 1 and t.fsdp_with_tp):
        out["ddp_buckets"] = sp.total * t.grad_bytes
    state = layout.compress.state_bytes_per_element   # the compressor's spec: residuals (+ DGC momentum), fp32
    if state:
        out["compressor_state"] = sp.total * state / shard
    sync = layout.sync
    if sync is not None and sync.state_copies:
        out["sync_state"] = sp.total * 4 * sync.state_copies  # anchor copy (+ outer momentum)
    return out


# ------------------------------------------------------------------------------------------------ activations
@functools.lru_cache(maxsize=256)
def activation_terms(model: ModelSpec, seq_len: int, training: Training) -> tuple[dict, ...]:
    """``layer_activation_bytes`` of every block (cached: the search asks for them per layout)."""
    return tuple(layer_activation_bytes(model, i, seq_len, training) for i in range(model.n_layers))


def layer_activation_bytes(model: ModelSpec, i: int, seq_len: int, training: Training) -> dict:
    """Bytes per token of block ``i``'s stored activations, by Korthikanti's terms, before recomputation:
    ``replicated`` (not split by tensor parallel unless the sequence is), ``split`` (÷ tp), ``core`` (the
    attention core's s-proportional softmax / dropout terms, ÷ tp; 0 with fused attention)."""
    a, r = training.activation_bytes, training.residual_bytes
    d, H = model.d_model, model.n_heads
    mask = 1.0 if training.dropout else 0.0
    replicated = 2 * d * r + 2 * d * a + 2 * d * mask      # 2 norm inputs, attention + MLP inputs, 2 dropout masks
    if model.attention == "mla":
        m = model.mla_dims()
        qk, v = model.qk_v_dims
        replicated += (m["q_lora_rank"] + m["kv_lora_rank"] + m["qk_rope_head_dim"]) * a * 2  # latents, normed
        split = (2 * H * qk + H * v + H * v) * a          # Q, K, V, attention output
    else:
        hd, kv = model.hd, model.kv_heads
        split = (H * hd + 2 * kv * hd + H * hd) * a        # Q, K, V, attention output
    core = 0.0 if training.flash_attention else (2 + mask + (2 if training.dropout else 0)) * H * seq_len
    if model.layer_is_moe(i):
        k, m_h = model.top_k, model.moe_hidden
        hidden = (3 if model.mlp == "swiglu" else 2) * a
        split += model.n_shared_experts * m_h * hidden                       # shared experts
        split += k * (2 * d * a + m_h * hidden) + model.n_routed_experts * 4  # copies in/out, experts, router
    else:
        split += model.ffn_hidden * (3 if model.mlp == "swiglu" else 2) * a
    return {"replicated": replicated, "split": split, "core": core}


def in_flight(layout: Layout, microbatches: int) -> float:
    """Micro-batches whose activations the most loaded pipeline rank holds at its peak, in units of the
    rank's layers: 1 without pp; GPipe / looped BFS: M; 1F1B: min(p, M); interleaved (v stages per rank):
    p + (p − 1)/v (Korthikanti §4.2.3); ZB-V: p (ZB paper: 1F1B's memory); DualPipeV: p + 1 (DeepSeek-V3 §3.2.1)."""
    p, v, M = layout.pp, layout.stages_per_rank, microbatches
    if p == 1:
        return 1.0
    s = layout.pp_schedule
    if s in ("gpipe", "looped-bfs"):
        return float(M)
    if s == "1f1b":
        return float(min(p, M))
    if s in ("interleaved-1f1b", "interleaved-zb"):
        return min(float(M), p + (p - 1) / v)
    if s == "zbv":
        return float(min(p, M))
    return float(min(p + 1, M))   # dualpipev


def activation_bytes(model: ModelSpec, layout: Layout, training: Training, seq_len: int, micro_batch: int,
                     microbatches: int) -> dict[str, float]:
    """Activation bytes on the most loaded rank (the first pipeline stage; the last adds the logits)."""
    t, sp = layout.tp, layout.sp
    tokens = micro_batch * seq_len
    per_layer = activation_terms(model, seq_len, training)
    layers = model.n_layers / layout.pp

    def stored(x: dict) -> float:
        rep = x["replicated"] / (t if sp else 1)
        if layout.recompute == "full":
            return model.d_model * training.residual_bytes / (t if sp else 1)   # the block input only
        core = 0.0 if layout.recompute == "selective" else x["core"] / t
        return rep + x["split"] / t + core

    mean_layer = sum(stored(x) for x in per_layer) / model.n_layers
    stage = layers * mean_layer * tokens
    logits = tokens * model.vocab_size * (4 + training.activation_bytes) / t   # bf16 output + fp32 for the loss
    gpipe_like = layout.pp > 1 and layout.pp_schedule in ("gpipe", "looped-bfs")
    first = stage * in_flight(layout, microbatches)
    last = stage * (in_flight(layout, microbatches) if gpipe_like or layout.pp == 1 else 1.0) \
        + logits * (microbatches if gpipe_like else 1)
    if layout.pp == 1 or layout.pp_schedule in ("zbv", "dualpipev"):   # one rank holds the first and last stage
        out = {"activations": first, "logits": logits * (microbatches if gpipe_like else 1)}
    elif first >= last:
        out = {"activations": first, "logits": 0.0}
    else:
        out = {"activations": last - logits * (microbatches if gpipe_like else 1),
               "logits": logits * (microbatches if gpipe_like else 1)}
    if layout.recompute == "full":   # one block's full activations while it is recomputed in backward
        worst = max(per_layer, key=lambda x: x["replicated"] + x["split"] + x["core"])
        out["recompute_working_set"] = (worst["replicated"] / (t if sp else 1) + (worst["split"] + worst["core"])
                                        / t) * tokens
    return out


def memory_per_rank(model: ModelSpec, layout: Layout, training: Training, seq_len: int, micro_batch: int,
                    microbatches: int) -> Memory:
    """Everything the most loaded rank holds at its peak (no framework overhead: see Accelerator.reserved_bytes)."""
    accumulating = layout.pp == 1 and microbatches > 1
    parts = state_bytes(model, layout, training, accumulating)
    parts.update(activation_bytes(model, layout, training, seq_len, micro_batch, microbatches))
    return Memory(parts)
