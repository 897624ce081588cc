"""syncwise.models: a DeepSeek-style decoder LM (dense or DeepSeekMoE, MHA or MLA) and presets."""
from .config import ATTENTION_KINDS, PRESETS, ModelConfig, resolve_config

# The modules below import torch; they load on first use (PEP 562), so the presets and configs (syncwise.plan,
# config checks) are readable without it.
_LAZY = {**{n: "deepseek" for n in ("Block", "DeepSeekLM", "build_model", "count_params", "flops_per_token",
                                     "lm_loss", "param_counts", "train_memory_bytes")},
         **{n: "layers" for n in ("Attention", "MLAttention", "RMSNorm", "SwiGLU", "apply_rope", "rope_tables")},
         **{n: "moe" for n in ("MoE", "GroupedExperts", "Routing")}}
_SUBMODULES = ("deepseek", "layers", "moe")

__all__ = [
    "ModelConfig", "PRESETS", "ATTENTION_KINDS", "resolve_config", "DeepSeekLM", "Block", "build_model",
    "count_params", "lm_loss", "param_counts", "flops_per_token", "train_memory_bytes", "MoE", "GroupedExperts", "Routing",
    "Attention", "MLAttention", "RMSNorm", "SwiGLU", "apply_rope", "rope_tables",
]


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBMODULES})
