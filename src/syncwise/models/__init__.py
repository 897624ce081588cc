"""syncwise.models: a DeepSeek-style decoder LM (dense or DeepSeekMoE, MHA or MLA) and presets."""
from .config import ATTENTION_KINDS, PRESETS, ModelConfig, resolve_config
from .deepseek import (Block, DeepSeekLM, build_model, count_params, flops_per_token, lm_loss,
                       param_counts, train_memory_bytes)
from .layers import Attention, MLAttention, RMSNorm, SwiGLU, apply_rope, rope_tables
from .moe import MoE, GroupedExperts, Routing

__all__ = [
    "ModelConfig", "PRESETS", "ATTENTION_KINDS", "resolve_config", "DeepSeekLM", "Block", "build_model",
    "count_params", "lm_loss", "param_counts", "flops_per_token", "train_memory_bytes", "MoE", "GroupedExperts", "Routing",
    "Attention", "MLAttention", "RMSNorm", "SwiGLU", "apply_rope", "rope_tables",
]
