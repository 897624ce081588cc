"""``ModelSpec``: the shape of a decoder LM as the planner needs it, from a syncwise preset, a Hugging Face
``config.json`` (read from a local path; nothing is downloaded) or a small TOML file.

Counts follow syncwise's own accounting (``syncwise.models.deepseek.param_counts`` / ``flops_per_token``,
PaLM's convention, appendix B of Chowdhery et al. 2022): training FLOPs per token = 6 × N + 6 × L × T × H ×
(d_qk + d_v), N = the parameters that do a matmul per token (MoE: shared + top_k routed experts + router;
the input-embedding lookup excluded, the output head included), the second term QKᵀ and AV at context T
without discounting the causal mask — which is also Megatron-LM's 72·B·s·l·h²·(1 + s/6h + V/12hl) for GPT.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from ..errors import ConfigError
from ..specs import count

MLPS = ("swiglu", "gelu")
ATTENTIONS = ("mha", "mla")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: dense or MoE (fine-grained routed + shared experts, DeepSeekMoE / Mixtral),
    multi-head / grouped-query (``n_kv_heads``) or multi-head latent attention (MLA, DeepSeek-V2/V3)."""

    name: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn_hidden: int                 # dense MLP width
    seq_len: int = 2048             # the model's context (the training length unless the planner is told)
    n_kv_heads: int = 0             # 0: = n_heads (MHA)
    head_dim: int = 0               # 0: d_model // n_heads
    mlp: str = "swiglu"             # swiglu (3 matrices) | gelu (2 matrices, GPT-2 / NeoX)
    attention: str = "mha"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    top_k: int = 0
    moe_hidden: int = 0
    n_dense_layers: int = 0         # the first n_dense_layers blocks are dense (DeepSeek's first_k_dense_replace)
    tie_embeddings: bool = False
    learned_positions: int = 0      # GPT-2's position table (n_positions rows); 0: RoPE
    biases: bool = False            # linear biases (GPT-2, NeoX) and LayerNorm (2 vectors) instead of RMSNorm
    source: str = ""

    def __post_init__(self) -> None:
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "ffn_hidden", "seq_len"):
            count(f"model.{key}", getattr(self, key))
        for key in ("n_kv_heads", "head_dim", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim", "n_routed_experts", "n_shared_experts", "top_k", "moe_hidden", "n_dense_layers",
                    "learned_positions"):
            count(f"model.{key}", getattr(self, key), minimum=0)
        if self.mlp not in MLPS:
            raise ConfigError("model.mlp", self.mlp, "one of: " + ", ".join(MLPS))
        if self.attention not in ATTENTIONS:
            raise ConfigError("model.attention", self.attention, "one of: " + ", ".join(ATTENTIONS))
        if self.n_kv_heads and self.n_heads % self.n_kv_heads:
            raise ConfigError("model.n_kv_heads", self.n_kv_heads, f"a divisor of n_heads ({self.n_heads})")
        if self.n_routed_experts:
            if not 1 <= self.top_k <= self.n_routed_experts:
                raise ConfigError("model.top_k", self.top_k, f"an integer in 1..{self.n_routed_experts} (experts)")
            count("model.moe_hidden", self.moe_hidden)
            if self.n_dense_layers > self.n_layers:
                raise ConfigError("model.n_dense_layers", self.n_dense_layers, f"an integer in 0..{self.n_layers}")

    # ---- shape ---------------------------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hd(self) -> int:
        """Per-head width of standard attention."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0 and self.n_dense_layers < self.n_layers

    def layer_is_moe(self, i: int) -> bool:
        """Whether block ``i`` (0-based) is an MoE block (the name syncwise's ParallelSpec.check_model calls)."""
        return self.n_routed_experts > 0 and i >= self.n_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return sum(self.layer_is_moe(i) for i in range(self.n_layers))

    def mla_dims(self) -> dict[str, int]:
        """MLA ranks and head dims with syncwise's 0 = automatic defaults resolved."""
        hd = self.hd
        return {"q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank or max(1, self.d_model // 2),
                "qk_nope_head_dim": self.qk_nope_head_dim or hd, "qk_rope_head_dim": self.qk_rope_head_dim or max(2, hd // 2),
                "v_head_dim": self.v_head_dim or hd}

    @property
    def qk_v_dims(self) -> tuple[int, int]:
        """Per-head (d_qk, d_v) of the attention core (QKᵀ, AV)."""
        if self.attention == "mla":
            m = self.mla_dims()
            return m["qk_nope_head_dim"] + m["qk_rope_head_dim"], m["v_head_dim"]
        return self.hd, self.hd

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.mlp == "swiglu" else 2

    # ---- parameters ----------------------------------------------------------------------------------------
    def attention_matrices(self) -> list[tuple[int, int]]:
        """(in, out) of every attention weight matrix of one block."""
        d, H = self.d_model, self.n_heads
        if self.attention == "mha":
            hd, kv = self.hd, self.kv_heads
            return [(d, H * hd), (d, kv * hd), (d, kv * hd), (H * hd, d)]
        m = self.mla_dims()
        qk = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
        q = [(d, m["q_lora_rank"]), (m["q_lora_rank"], H * qk)] if m["q_lora_rank"] else [(d, H * qk)]
        kv = [(d, m["kv_lora_rank"] + m["qk_rope_head_dim"]),
              (m["kv_lora_rank"], H * (m["qk_nope_head_dim"] + m["v_head_dim"]))]
        return q + kv + [(H * m["v_head_dim"], d)]

    def attention_params(self) -> int:
        """Weights of one block's attention, MLA's latent norms and GPT-2's biases included."""
        n = sum(a * b for a, b in self.attention_matrices())
        if self.attention == "mla":
            m = self.mla_dims()
            n += m["q_lora_rank"] + m["kv_lora_rank"]          # the latent RMSNorms
        if self.biases:
            n += sum(b for _, b in self.attention_matrices())
        return n

    def norm_params(self) -> int:
        return (2 if self.biases else 1) * self.d_model

    def dense_mlp_params(self) -> int:
        n = self.mlp_matrices * self.d_model * self.ffn_hidden
        return n + (self.ffn_hidden * (self.mlp_matrices - 1) + self.d_model if self.biases else 0)

    def expert_params(self) -> int:
        """One routed (or shared) expert: a SwiGLU of width moe_hidden."""
        return self.mlp_matrices * self.d_model * self.moe_hidden

    def layer_params(self, i: int) -> dict[str, int]:
        """Block ``i``'s parameters by kind: attention, norms, dense MLP, router, shared experts, routed experts."""
        out = {"attention": self.attention_params(), "norms": 2 * self.norm_params(), "mlp": 0, "router": 0,
               "shared": 0, "routed": 0}
        if self.layer_is_moe(i):
            out["router"] = self.n_routed_experts * self.d_model
            out["shared"] = self.n_shared_experts * self.expert_params()
            out["routed"] = self.n_routed_experts * self.expert_params()
        else:
            out["mlp"] = self.dense_mlp_params()
        return out

    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model + self.learned_positions * self.d_model

    def head_params(self) -> int:
        """Output head + final norm (0 head weights when tied to the embedding)."""
        return (0 if self.tie_embeddings else self.vocab_size * self.d_model) + self.norm_params()

    def tensor_count(self) -> int:
        """Parameter tensors (= gradient tensors a data-parallel sync handles; a compressor's fixed cost is per
        tensor): every weight matrix (a layer's experts stacked, one tensor per matrix kind, as syncwise's and
        torchtitan's grouped experts hold them), norms, biases, embeddings, head."""
        per_norm = 2 if self.biases else 1
        n = 1 + (1 if self.learned_positions else 0) + (0 if self.tie_embeddings else 1) + per_norm
        for i in range(self.n_layers):
            mats = len(self.matrices(i))
            n += mats + 2 * per_norm + (mats if self.biases else 0)
            if self.attention == "mla":
                m = self.mla_dims()
                n += (1 if m["q_lora_rank"] else 0) + 1
        return n

    def param_counts(self) -> tuple[int, int]:
        """(total, active per token) parameters, embedding and head included (tied: once); syncwise's
        ``param_counts`` for its presets."""
        total = active = self.embedding_params() + self.head_params()
        for i in range(self.n_layers):
            p = self.layer_params(i)
            common = p["attention"] + p["norms"] + p["mlp"] + p["router"] + p["shared"]
            total += common + p["routed"]
            active += common + (self.top_k * self.expert_params() if p["routed"] else 0)
        return total, active

    def flops_per_token(self, seq_len: Optional[int] = None) -> float:
        """Training FLOPs per token (forward + backward): 6 × matmul-active params + 6·L·T·H·(d_qk + d_v)."""
        T = self.seq_len if seq_len is None else seq_len
        _, active = self.param_counts()
        n = active - self.embedding_params() + (self.vocab_size * self.d_model if self.tie_embeddings else 0)
        qk, v = self.qk_v_dims
        return float(6 * n + 6 * self.n_layers * T * self.n_heads * (qk + v))

    def attention_core_flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of QKᵀ and AV alone (the part selective recomputation redoes)."""
        qk, v = self.qk_v_dims
        return float(6 * self.n_layers * seq_len * self.n_heads * (qk + v))

    def matrices(self, i: int) -> list[tuple[int, int, int]]:
        """(count, rows, cols) of block ``i``'s weight matrices (PowerSGD compresses each as rows × cols)."""
        out = [(1, a, b) for a, b in self.attention_matrices()]
        d = self.d_model
        if self.layer_is_moe(i):
            out.append((1, self.n_routed_experts, d))
            for n in (self.n_shared_experts, self.n_routed_experts):
                if n:
                    out += [(n, d, self.moe_hidden)] * (self.mlp_matrices - 1) + [(n, self.moe_hidden, d)]
        else:
            out += [(1, d, self.ffn_hidden)] * (self.mlp_matrices - 1) + [(1, self.ffn_hidden, d)]
        return out

    def with_seq_len(self, seq_len: int) -> "ModelSpec":
        return dataclasses.replace(self, seq_len=seq_len)

    def describe(self) -> str:
        total, active = self.param_counts()
        moe = f", MoE {self.n_routed_experts} experts top-{self.top_k}" if self.is_moe else ""
        act = f" ({_params(active)} active)" if self.is_moe else ""
        return f"{self.name}: {_params(total)} params{act}, {self.n_layers} layers, d={self.d_model}{moe}"


def _params(n: float) -> str:
    """A parameter count people read: 671 B, 6.74 B, 5.5 M, 120 K (not '0.00 B' for a small model)."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            v = n / scale
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f}"


# ------------------------------------------------------------------------------------------------ presets
def from_preset(name: str) -> ModelSpec:
    """A syncwise preset (``syncwise.models.PRESETS``; importing them loads torch, so it happens here only)."""
    from ..models.config import PRESETS  # noqa: PLC0415  (lazy: syncwise.models imports torch)

    if name not in PRESETS:
        raise ConfigError("--model", name, "a syncwise preset (" + ", ".join(PRESETS) + "), a Hugging Face "
                          "config.json, or a model .toml file")
    return from_model_config(PRESETS[name], name)


def from_model_config(cfg: Any, name: str = "model") -> ModelSpec:
    """A ModelSpec from syncwise's ``ModelConfig`` (any object with its fields)."""
    moe = cfg.n_routed_experts > 0
    return ModelSpec(name=name, vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers,
                     n_heads=cfg.n_heads, ffn_hidden=cfg.ffn_hidden, seq_len=cfg.seq_len, mlp="swiglu",
                     attention=cfg.attention, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                     qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
                     v_head_dim=cfg.v_head_dim, n_routed_experts=cfg.n_routed_experts,
                     n_shared_experts=cfg.n_shared_experts if moe else 0, top_k=cfg.top_k if moe else 0,
                     moe_hidden=cfg.moe_hidden if moe else 0, n_dense_layers=cfg.n_dense_layers if moe else 0,
                     tie_embeddings=cfg.tie_embeddings, source="syncwise preset")


# ------------------------------------------------------------------------------------------------ Hugging Face
HF_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "gpt_neox", "mixtral", "deepseek_v2", "deepseek_v3")


def _hf_get(cfg: dict, path: str, *keys: str, default: Any = None, required: bool = True) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    if required and default is None:
        raise ConfigError(f"{path}.{keys[0]}", None, "a value in the config.json (required for "
                          f"model_type {cfg.get('model_type')!r})")
    return default


def from_hf_config(values: dict[str, Any], name: str = "hf", path: str = "config.json") -> ModelSpec:
    """Map a Hugging Face ``config.json`` dict (Llama, Mistral, Qwen2, Qwen3, GPT-2, GPT-NeoX, Mixtral, DeepSeek-V2/V3)
    onto a ModelSpec. DeepSeek-V3's multi-token-prediction module (``num_nextn_predict_layers``) is not counted."""
    kind = values.get("model_type")
    if kind not in HF_TYPES:
        raise ConfigError(f"{path}.model_type", kind, "one of: " + ", ".join(HF_TYPES))
    g = lambda *keys, **kw: _hf_get(values, path, *keys, **kw)  # noqa: E731
    seq = g("max_position_embeddings", "n_positions", "n_ctx", default=2048, required=False)
    if kind == "gpt2":
        d = g("n_embd", "hidden_size")
        return ModelSpec(name=name, vocab_size=g("vocab_size"), d_model=d, n_layers=g("n_layer", "num_hidden_layers"),
                         n_heads=g("n_head", "num_attention_heads"), ffn_hidden=g("n_inner", default=4 * d, required=False),
                         seq_len=seq, mlp="gelu", tie_embeddings=bool(g("tie_word_embeddings", default=True,
                                                                          required=False)),
                         learned_positions=g("n_positions", default=seq, required=False), biases=True,
                         source=f"Hugging Face config ({kind})")
    common = dict(name=name, vocab_size=g("vocab_size"), d_model=g("hidden_size"), n_layers=g("num_hidden_layers"),
                  n_heads=g("num_attention_heads"), seq_len=seq,
                  tie_embeddings=bool(g("tie_word_embeddings", default=False, required=False)),
                  source=f"Hugging Face config ({kind})")
    if kind == "gpt_neox":
        return ModelSpec(ffn_hidden=g("intermediate_size"), mlp="gelu", biases=True, **common)
    kv = g("num_key_value_heads", default=common["n_heads"], required=False)
    hd = g("head_dim", default=0, required=False)
    if kind in ("llama", "mistral", "qwen2", "qwen3"):
        return ModelSpec(ffn_hidden=g("intermediate_size"), n_kv_heads=kv, head_dim=hd, **common)
    if kind == "mixtral":
        ffn = g("intermediate_size")
        return ModelSpec(ffn_hidden=ffn, n_kv_heads=kv, head_dim=hd, n_routed_experts=g("num_local_experts"),
                         top_k=g("num_experts_per_tok"), moe_hidden=ffn, n_shared_experts=0, n_dense_layers=0,
                         **common)
    # DeepSeek-V2 / V3: MLA and DeepSeekMoE
    freq = g("moe_layer_freq", default=1, required=False)
    if freq != 1:
        raise ConfigError(f"{path}.moe_layer_freq", freq, "1 (every block after first_k_dense_replace is MoE)")
    return ModelSpec(ffn_hidden=g("intermediate_size"), attention="mla",
                     q_lora_rank=g("q_lora_rank", default=0, required=False) or 0, kv_lora_rank=g("kv_lora_rank"),
                     qk_nope_head_dim=g("qk_nope_head_dim"), qk_rope_head_dim=g("qk_rope_head_dim"),
                     v_head_dim=g("v_head_dim"), n_routed_experts=g("n_routed_experts"),
                     n_shared_experts=g("n_shared_experts", default=0, required=False),
                     top_k=g("num_experts_per_tok"), moe_hidden=g("moe_intermediate_size"),
                     n_dense_layers=g("first_k_dense_replace", default=0, required=False), **common)


# ------------------------------------------------------------------------------------------------ TOML
_TOML_KEYS = {  # TOML key -> ModelSpec field
    "name": "name", "hidden_size": "d_model", "ffn_hidden_size": "ffn_hidden", "num_heads": "n_heads",
    "num_kv_heads": "n_kv_heads", "head_dim": "head_dim", "num_layers": "n_layers", "vocab_size": "vocab_size",
    "seq_len": "seq_len", "mlp": "mlp", "attention": "attention", "experts": "n_routed_experts",
    "active_experts": "top_k", "shared_experts": "n_shared_experts", "expert_ffn_hidden_size": "moe_hidden",
    "dense_layers": "n_dense_layers", "tie_embeddings": "tie_embeddings", "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim", "learned_positions": "learned_positions", "biases": "biases",
}
_TOML_REQUIRED = ("hidden_size", "ffn_hidden_size", "num_heads", "num_layers", "vocab_size")


def from_toml_dict(values: dict[str, Any], name: str = "model") -> ModelSpec:
    """A ModelSpec from a model TOML (keys: hidden_size, ffn_hidden_size, num_heads, num_layers, vocab_size,
    seq_len; optional num_kv_heads, mlp, attention, experts, active_experts, shared_experts,
    expert_ffn_hidden_size, dense_layers, tie_embeddings, MLA ranks)."""
    for key in values:
        if key not in _TOML_KEYS:
            raise ConfigError(f"model.{key}", values[key], "a model key: " + ", ".join(_TOML_KEYS))
    for key in _TOML_REQUIRED:
        if key not in values:
            raise ConfigError(f"model.{key}", None, "a positive integer (required)")
    kwargs = {_TOML_KEYS[k]: v for k, v in values.items()}
    kwargs.setdefault("name", name)
    for key in ("tie_embeddings", "biases"):
        if key in kwargs and not isinstance(kwargs[key], bool):
            raise ConfigError(f"model.{key}", kwargs[key], "true or false")
    if kwargs.get("n_routed_experts") and "moe_hidden" not in kwargs:
        kwargs["moe_hidden"] = kwargs["ffn_hidden"]
    return ModelSpec(source="model TOML", **kwargs)


def load_model(arg: str | ModelSpec, seq_len: Optional[int] = None) -> ModelSpec:
    """A preset name, a path to a Hugging Face config.json (or a folder holding one) or a model .toml; with
    ``seq_len`` the training length replaces the model's."""
    if isinstance(arg, ModelSpec):
        spec = arg
    else:
        p = Path(arg)
        if p.is_dir() and (p / "config.json").is_file():
            p = p / "config.json"
        if p.is_file():
            try:
                text = p.read_text()
                values = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
            except (OSError, ValueError, RecursionError) as e:
                raise ConfigError("--model", str(arg), f"a readable TOML / JSON model file ({e})") from None
            if not isinstance(values, dict):
                raise ConfigError("--model", str(arg), "a file holding one table / object")
            stem = p.parent.name if p.name == "config.json" else p.stem
            spec = from_toml_dict(values, stem) if p.suffix == ".toml" else from_hf_config(values, stem, str(p))
        else:
            spec = from_preset(str(arg))
    if seq_len is not None:
        count("--seq-len", seq_len)
        spec = spec.with_seq_len(seq_len)
    return spec

