"""ModelConfig (every field documented in its ``help`` metadata) and the named presets."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from syncwise.errors import ConfigError

ATTENTION_KINDS = ("mha", "mla")
MOE_IMPLS = ("auto", "grouped", "padded", "loop")


def _f(default: object, help: str) -> object:
    # The help text lives in field metadata so the config layer can print it next to each key.
    return field(default=default, metadata={"help": help})


@dataclass
class ModelConfig:
    """Shape of a DeepSeek-style decoder LM (dense or MoE, MHA or MLA); see each field's ``help``."""

    vocab_size: int = _f(256, "Vocabulary size; 256 matches syncwise's byte tokenizer.")
    seq_len: int = _f(128, "Maximum sequence length (context) the model accepts; also the training length.")
    d_model: int = _f(128, "Residual stream width (hidden size).")
    n_layers: int = _f(4, "Number of transformer blocks.")
    n_heads: int = _f(4, "Attention heads; d_model must be divisible by n_heads.")
    ffn_hidden: int = _f(344, "Hidden width of the SwiGLU MLP in dense layers.")
    n_routed_experts: int = _f(0, "Fine-grained routed experts per MoE layer; 0 makes every layer dense.")
    n_shared_experts: int = _f(1, "Shared experts per MoE layer (always active; fused into one SwiGLU).")
    top_k: int = _f(2, "Routed experts each token is sent to (must be <= n_routed_experts).")
    moe_hidden: int = _f(128, "Hidden width of each (routed or shared) expert's SwiGLU.")
    n_dense_layers: int = _f(1, "The first n_dense_layers blocks use a dense MLP; the rest are MoE "
                                "(ignored when n_routed_experts is 0).")
    bias_update_rate: float = _f(1e-3, "Auxiliary-loss-free balancing: per-expert selection bias moves by "
                                       "rate * sign(mean_load - load) after each optimizer step.")
    route_scale: float = _f(1.0, "Multiplier applied to the normalised routed gate weights "
                                 "(DeepSeek-V3 uses 2.5 at 256 experts).")
    moe_impl: str = _f("auto", "How routed experts compute (same result, different speed): 'grouped' "
                               "(torch._grouped_mm, no host sync), 'padded' (block-padded bmm, no host "
                               "sync), 'loop' (per-expert Python loop, the reference; syncs the host), "
                               "or 'auto' (grouped where this device and dtype have a fast path, else "
                               "padded; see docs/gpu.md).")
    attention: str = _f("mha", "Attention kind: 'mha' (standard multi-head) or 'mla' "
                               "(multi-head latent attention: low-rank KV with a decoupled RoPE key).")
    q_lora_rank: int = _f(0, "MLA: rank of the query compression; 0 = no query compression.")
    kv_lora_rank: int = _f(0, "MLA: rank of the joint key/value compression; 0 = d_model // 2.")
    qk_nope_head_dim: int = _f(0, "MLA: per-head query/key dims without RoPE; 0 = d_model // n_heads.")
    qk_rope_head_dim: int = _f(0, "MLA: per-head dims of the decoupled RoPE query/key (the key part is "
                                  "shared by all heads); 0 = head_dim // 2.")
    v_head_dim: int = _f(0, "MLA: per-head value dims; 0 = d_model // n_heads.")
    rope_theta: float = _f(10000.0, "RoPE base frequency.")
    norm_eps: float = _f(1e-6, "RMSNorm epsilon.")
    tie_embeddings: bool = _f(False, "Share the input embedding with the output head. Off by default "
                                     "(as in DeepSeek): untied weights let pipeline stages split the "
                                     "model cleanly, and at vocab 256 the head is tiny anyway.")
    dropout: float = _f(0.0, "Dropout on attention probabilities and residual branches (0 = off).")
    init_std: float = _f(0.02, "Std of the normal weight init; residual output projections are scaled "
                               "by 1/sqrt(2 * n_layers) (GPT-2 style).")

    # ---- derived values -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """Per-head width of standard attention (d_model // n_heads)."""
        return self.d_model // self.n_heads

    @property
    def is_moe(self) -> bool:
        """True when at least one block is a mixture-of-experts block."""
        return self.n_routed_experts > 0 and self.n_dense_layers < self.n_layers

    def layer_is_moe(self, i: int) -> bool:
        """Whether block ``i`` (0-based) is an MoE block."""
        return self.n_routed_experts > 0 and i >= self.n_dense_layers

    def mla_dims(self) -> dict[str, int]:
        """MLA ranks and head dims with the 0 = automatic defaults resolved."""
        hd = self.head_dim
        return {
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank or max(1, self.d_model // 2),
            "qk_nope_head_dim": self.qk_nope_head_dim or hd,
            "qk_rope_head_dim": self.qk_rope_head_dim or max(2, hd // 2),
            "v_head_dim": self.v_head_dim or hd,
        }

    def validate(self) -> "ModelConfig":
        """Raise ConfigError naming the first bad field; return self when everything is valid."""
        def positive(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"model.{name}", v, "a positive integer")

        def non_negative(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"model.{name}", v, "an integer >= 0")

        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "ffn_hidden"):
            positive(name)
        for name in ("n_routed_experts", "n_shared_experts", "n_dense_layers", "q_lora_rank",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            non_negative(name)
        if self.d_model % self.n_heads:
            raise ConfigError("model.n_heads", self.n_heads, f"a divisor of d_model ({self.d_model})")
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError("model.attention", self.attention, "one of: " + ", ".join(ATTENTION_KINDS))
        if self.head_dim % 2:
            raise ConfigError("model.n_heads", self.n_heads,
                              f"a value giving an even head_dim for RoPE (d_model={self.d_model})")
        if self.attention == "mla" and self.mla_dims()["qk_rope_head_dim"] % 2:
            raise ConfigError("model.qk_rope_head_dim", self.qk_rope_head_dim, "an even number (RoPE rotates pairs)")
        if self.n_routed_experts > 0:
            positive("moe_hidden")
            positive("top_k")
            if self.top_k > self.n_routed_experts:
                raise ConfigError("model.top_k", self.top_k,
                                  f"an integer in 1..n_routed_experts ({self.n_routed_experts})")
            if self.n_dense_layers > self.n_layers:
                raise ConfigError("model.n_dense_layers", self.n_dense_layers,
                                  f"an integer in 0..n_layers ({self.n_layers})")
            if self.bias_update_rate < 0:
                raise ConfigError("model.bias_update_rate", self.bias_update_rate, "a number >= 0")
            if self.route_scale <= 0:
                raise ConfigError("model.route_scale", self.route_scale, "a number > 0")
        if self.moe_impl not in MOE_IMPLS:
            raise ConfigError("model.moe_impl", self.moe_impl, "one of: " + ", ".join(MOE_IMPLS))
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("model.dropout", self.dropout, "a number in [0, 1)")
        if self.norm_eps <= 0 or self.rope_theta <= 0 or self.init_std <= 0:
            bad = next(n for n in ("norm_eps", "rope_theta", "init_std") if getattr(self, n) <= 0)
            raise ConfigError(f"model.{bad}", getattr(self, bad), "a number > 0")
        return self


# Presets (vocab 256; counts checked by tests/test_models.py). fwd+bwd times: batch 8 x 128 tokens,
# 1 CPU thread, median on a shared 2-core EPYC. `small` is the default for `syncwise train`: it has
# to step fast on one CPU thread, hence 16 experts of width 96, top-2, and a 128-token context.
PRESETS: dict[str, ModelConfig] = {
    # 0.14 M params, dense: unit tests and smoke runs (8 x 64 tokens: ~11 ms).
    "tiny": ModelConfig(d_model=64, n_layers=2, n_heads=4, ffn_hidden=192, seq_len=64),
    # 0.21 M params (0.14 M active), MoE: 1 dense + 1 MoE block with 8 routed experts, top-2 (~14 ms).
    "tiny-moe": ModelConfig(d_model=64, n_layers=2, n_heads=4, ffn_hidden=192, seq_len=64,
                            n_routed_experts=8, n_shared_experts=1, top_k=2, moe_hidden=64,
                            n_dense_layers=1),
    # 5.5 M params (2.4 M active), MoE: the default training model (~0.26 s).
    "small": ModelConfig(d_model=256, n_layers=4, n_heads=4, ffn_hidden=688, seq_len=128,
                         n_routed_experts=16, n_shared_experts=1, top_k=2, moe_hidden=96,
                         n_dense_layers=1),
    # 4.9 M params, dense: a dense baseline at about `small`'s total size (~0.45 s).
    "small-dense": ModelConfig(d_model=256, n_layers=6, n_heads=4, ffn_hidden=688, seq_len=128),
    # 24.7 M params (10.3 M active), MoE (~1.0 s).
    "medium": ModelConfig(d_model=384, n_layers=8, n_heads=6, ffn_hidden=1024, seq_len=256,
                          n_routed_experts=16, n_shared_experts=2, top_k=2, moe_hidden=128,
                          n_dense_layers=1),
    # 25.6 M params, dense (~2.2-3 s).
    "medium-dense": ModelConfig(d_model=512, n_layers=8, n_heads=8, ffn_hidden=1376, seq_len=256),
    # 100.5 M params (44.8 M active), MoE (~5-6 s).
    "large": ModelConfig(d_model=768, n_layers=10, n_heads=12, ffn_hidden=2048, seq_len=512,
                         n_routed_experts=16, n_shared_experts=2, top_k=2, moe_hidden=192,
                         n_dense_layers=1),
    # ---- GPU sizes (for one 80 GB H100 with fp32 weights + AdamW; far too slow for CPU training) ----
    # Dimensions are multiples of 64 (tensor-core tiles; _grouped_mm's 16-byte stride rule) and
    # head_dim is 64. The vocabulary stays 256 (the byte tokenizer), so embedding + head are only
    # 0.5 M of the parameters and the head matmul is negligible: nearly all parameters are in the
    # transformer body, whereas at a 32 k-128 k BPE vocabulary the same body would carry another
    # 65-260 M embedding/head parameters. Byte-level 1024-token contexts hold ~1 k characters.
    # 308.9 M params, dense (~2.15 GFLOP/token fwd+bwd at T=1024): the >= 300 M dense benchmark model.
    "xl-dense": ModelConfig(d_model=1024, n_layers=24, n_heads=16, ffn_hidden=2816, seq_len=1024),
    # 868.7 M params (202.6 M active), MoE: 1 dense + 11 MoE blocks of 32 routed experts (top-4) and
    # 2 shared experts of width 704 (a quarter of the dense FFN: DeepSeekMoE's fine-grained split);
    # at 16 x 1024 tokens an expert averages 2 k rows, large enough for grouped GEMMs to run well.
    "xl": ModelConfig(d_model=1024, n_layers=12, n_heads=16, ffn_hidden=2816, seq_len=1024,
                      n_routed_experts=32, n_shared_experts=2, top_k=4, moe_hidden=704,
                      n_dense_layers=1),
}


def resolve_config(cfg_or_preset: "ModelConfig | str", **overrides: object) -> ModelConfig:
    """Return a validated copy of a ModelConfig (or named preset) with ``overrides`` applied."""
    if isinstance(cfg_or_preset, str):
        if cfg_or_preset not in PRESETS:
            raise ConfigError("model.preset", cfg_or_preset, "one of: " + ", ".join(PRESETS))
        base = PRESETS[cfg_or_preset]
    elif isinstance(cfg_or_preset, ModelConfig):
        base = cfg_or_preset
    else:
        raise ConfigError("model", cfg_or_preset, "a ModelConfig or a preset name: " + ", ".join(PRESETS))
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    for key in overrides:
        if key not in known:
            raise ConfigError(f"model.{key}", overrides[key], "a ModelConfig field: " + ", ".join(sorted(known)))
    return dataclasses.replace(base, **overrides).validate()
