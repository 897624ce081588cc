"""Hugging Face causal LMs as syncwise models: ``syncwise train --model hf:FOLDER``.

``FOLDER`` holds a ``config.json`` (and optionally ``*.safetensors`` weights, as ``save_pretrained`` writes them).
The model is built by ``transformers`` itself — ``AutoModelForCausalLM.from_config`` (random init at the run's
seed) or ``from_pretrained(FOLDER, local_files_only=True)`` when weights are present — in fp32 (the trainer's
master weights; autocast does the rest) and wrapped in :class:`HFCausalLM`, which gives the trainer syncwise's
contract: ``model(idx) -> logits (B, T, vocab)``, the loss is ``lm_loss(logits, targets)`` outside the model.

What the parallel layer needs from it: ``fsdp_units()`` (one FSDP2 unit per decoder layer, ``model.layers`` of
the Hugging Face model, then the root holds the embedding, final norm and head) and ``layers`` (the blocks
activation checkpointing wraps). Tensor, pipeline and expert parallel are refused for these models
(``check_hf_layout``): syncwise's TP plan, pipeline split and expert dispatch are written for its own model.

This module is torch-free (:func:`read_hf_model`, :func:`check_hf_shape`, :func:`hf_train_memory_bytes`: what the
configuration checks ask before any worker starts); the model itself is in ``hf_model.py``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..errors import ConfigError

PREFIX = "hf:"
# architecture (config.json "architectures") -> model_type
SUPPORTED = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
             "MixtralForCausalLM": "mixtral", "DeepseekV3ForCausalLM": "deepseek_v3"}
_BY_TYPE = {t: a for a, t in SUPPORTED.items()}
# Families whose transformers TP plan (config.base_model_tp_plan) is only 'colwise' / 'rowwise' Linear layers:
# applied through syncwise's tp mesh. Qwen3's per-head q/k norms need a gradient all-reduce ('replicated_with_
# grad_allreduce') and the MoE families' expert styles are transformers' own: refused for tp > 1.
TP_FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def is_hf(preset: str) -> bool:
    """Whether ``model.preset`` names a Hugging Face model folder (``hf:FOLDER``)."""
    return isinstance(preset, str) and preset.startswith(PREFIX)


def supported_list() -> str:
    return ", ".join(SUPPORTED)


@dataclass(frozen=True)
class HFModelInfo:
    """What ``hf:FOLDER`` holds, read without torch: the config values, the family, the weight files."""

    folder: Path
    architecture: str
    values: dict
    weights: tuple[str, ...]   # *.safetensors file names (empty: random init)

    @property
    def vocab_size(self) -> int:
        return int(self.values.get("vocab_size") or 0)

    @property
    def max_positions(self) -> Optional[int]:
        v = self.values.get("max_position_embeddings")
        return int(v) if isinstance(v, int) else None



def read_hf_model(preset: str, key: str = "model.preset") -> HFModelInfo:
    """Read and check ``hf:FOLDER``: a folder with a readable config.json whose architecture is supported.
    Raises ConfigError under ``key`` naming the value and what is accepted."""
    folder = Path(preset[len(PREFIX):])
    what = f"hf:FOLDER, a local folder with a Hugging Face config.json (families: {supported_list()})"
    if not preset[len(PREFIX):]:
        raise ConfigError(key, preset, what)
    config = folder / "config.json"
    try:
        found = config.is_file()
    except (OSError, ValueError) as e:  # a name too long, a NUL byte
        raise ConfigError(key, preset, f"{what}; {e}") from None
    if not found:
        raise ConfigError(key, preset, f"{what}; {config} does not exist")
    try:
        if config.stat().st_size > 16 * 2**20:
            raise ValueError("larger than 16 MiB")
        values = json.loads(config.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(key, preset, f"{what}; {config} is not readable JSON ({e})") from None
    if not isinstance(values, dict):
        raise ConfigError(key, preset, f"{what}; {config} holds no JSON object")
    archs = values.get("architectures")
    kind = values.get("model_type")
    if not archs:  # a config written without it: its model_type names the family
        archs = [_BY_TYPE.get(kind, kind)] if isinstance(kind, str) else []
    arch = archs[0] if isinstance(archs, list) and archs else archs
    if not isinstance(arch, str) or arch not in SUPPORTED:
        raise ConfigError(key, preset, f"a Hugging Face causal LM of a supported family: {supported_list()} "
                          f"({config} has architectures {values.get('architectures')!r}, model_type {kind!r})")
    if kind != SUPPORTED[arch]:
        raise ConfigError(key, preset, f"a config.json whose model_type is {SUPPORTED[arch]!r} for {arch} (got "
                          f"{kind!r}; transformers builds the model from model_type)")
    if not isinstance(values.get("vocab_size"), int) or values["vocab_size"] < 1:
        raise ConfigError(key, preset, f"a config.json with a positive integer vocab_size (got "
                          f"{values.get('vocab_size')!r})")
    try:
        weights = tuple(sorted(p.name for p in folder.glob("*.safetensors")))
    except OSError as e:
        raise ConfigError(key, preset, f"{what}; {folder} cannot be listed ({e})") from None
    return HFModelInfo(folder=folder, architecture=arch, values=values, weights=weights)


def check_hf_shape(info: HFModelInfo, preset: str, vocab: int, seq_len: int, key: str = "model.preset") -> None:
    """The tokenizer's ids must fit the model's embedding, and the sequence its positions."""
    if vocab > info.vocab_size:
        raise ConfigError(key, preset, f"a model whose vocab_size covers the tokenizer's {vocab} ids: config.json "
                          f"has vocab_size {info.vocab_size} (the byte tokenizer needs ≥ 256)")
    if info.max_positions is not None and seq_len > info.max_positions:
        raise ConfigError("data.seq_len", seq_len, f"at most the model's max_position_embeddings "
                          f"({info.max_positions}, {info.folder / 'config.json'})")


def hf_train_memory_bytes(spec: Any, batch_size: int, activation_bytes: int = 4,
                          activation_checkpointing: bool = False) -> int:
    """models.train_memory_bytes's lower bound for a planner ModelSpec (a Hugging Face model): 16 bytes per
    parameter (fp32 weights, gradients, AdamW's moments) plus what backward keeps per token."""
    d = spec.d_model
    blocks = [10 * d + 2 * ((spec.n_shared_experts + spec.top_k) * spec.moe_hidden if spec.layer_is_moe(i)
                            else spec.ffn_hidden) for i in range(spec.n_layers)]
    per_token = (spec.n_layers * d + max(blocks)) if activation_checkpointing else sum(blocks)
    per_token += 2 * spec.vocab_size
    total, _ = spec.param_counts()
    return 16 * total + activation_bytes * batch_size * spec.seq_len * per_token


def check_hf_tp(info: HFModelInfo, preset: str, tp: int) -> None:
    """Tensor parallel through the model's own TP plan: a family whose plan syncwise applies, and ``tp`` dividing
    the heads, the key/value heads and the MLP width (column-wise layers split them)."""
    if info.architecture not in TP_FAMILIES:
        raise ConfigError("parallel.tp", tp, f"1 with model.preset={preset} ({info.architecture}): tensor parallel "
                          f"of Hugging Face models is supported for {', '.join(TP_FAMILIES)} (their base_model_tp_plan "
                          "is column/row-wise Linear layers only); data parallel works for every family")
    v = info.values
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        size = v.get(name, v.get("num_attention_heads")) if name == "num_key_value_heads" else v.get(name)
        if not isinstance(size, int) or size % tp:
            raise ConfigError("parallel.tp", tp, f"a divisor of config.json's {name} ({size!r}): tensor parallel "
                              "splits it evenly across the tp ranks")
