"""The torch half of ``hf:FOLDER`` models (see models/hf.py): build one with transformers and wrap it."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .hf import HFModelInfo, read_hf_model


class HFCausalLM(nn.Module):
    """A Hugging Face ``*ForCausalLM`` with syncwise's contract: ``forward(idx) -> logits (B, T, vocab)``.

    The Hugging Face model is ``self.hf`` (its parameters are named ``hf.model.layers.0...``); save it back
    with ``wrapper.hf.save_pretrained(folder)``."""

    def __init__(self, hf: nn.Module, info: Optional[HFModelInfo] = None, seq_len: int = 0) -> None:
        super().__init__()
        self.hf = hf
        self.info = info
        self.seq_len = seq_len

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers: the blocks activation checkpointing wraps."""
        return self.hf.model.layers

    def fsdp_units(self) -> list[nn.Module]:
        """One FSDP2 unit per decoder layer; the root keeps the embedding, the final norm and the head."""
        return list(self.hf.model.layers)

    #: The router load-balancing loss of the last forward (a scalar in the graph), when the config asks for it
    #: (Mixtral: ``output_router_logits``); None otherwise. :func:`hf_loss_fn` adds it to the loss.
    aux_loss: Optional[torch.Tensor] = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out = self.hf(input_ids=idx, use_cache=False)
        self.aux_loss = getattr(out, "aux_loss", None)
        return out.logits

    #: Training FLOPs per token, set by whoever builds the run (the worker: the planner's count of config.json at
    #: the training length, config.hf_model_spec); the models layer does not import the planner. 0: unknown.
    flops_per_token_value: float = 0.0

    def flops_per_token(self) -> float:
        """Training FLOPs per token (0 when the builder did not set it: no MFU)."""
        return self.flops_per_token_value


def build_hf_model(preset: str, seq_len: int = 0) -> HFCausalLM:
    """Build ``hf:FOLDER`` with transformers, in fp32 (the trainer's master weights): from the folder's
    ``*.safetensors`` weights when it has any (``from_pretrained(local_files_only=True)``), else at random from its
    config (``from_config``; torch's RNG, so seed first)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    info = read_hf_model(preset)
    folder = str(info.folder)
    if info.weights:
        hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    else:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.config.use_cache = False
    hf.train()  # from_pretrained returns it in eval mode
    return HFCausalLM(hf, info, seq_len)


def hf_tp_plan(model: HFCausalLM) -> dict:
    """transformers' tensor-parallel plan for the model (``config.base_model_tp_plan``) as ``parallelize_module``
    takes it: ``hf.model.<pattern>`` → ColwiseParallel / RowwiseParallel. The embedding, norms and head stay
    replicated (each tp rank computes them on the same input). Other styles are refused (models/hf.py:
    TP_FAMILIES)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ..errors import ConfigError

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = dict(getattr(model.hf.config, "base_model_tp_plan", None) or {})
    if not plan:
        raise ConfigError("parallel.tp", "> 1", f"1: {type(model.hf).__name__}'s config has no base_model_tp_plan")
    out = {}
    for pattern, style in plan.items():
        if style not in styles:
            raise ConfigError("parallel.tp", "> 1", f"1: {type(model.hf).__name__}'s TP plan uses {style!r} "
                              f"({pattern}); syncwise applies only {', '.join(styles)}")
        out[f"hf.model.{pattern}"] = styles[style]()
    return out



def router_aux_coef(model: nn.Module) -> float:
    """The weight of the router's load-balancing loss in the training loss: transformers' ``router_aux_loss_coef``
    when the config turns the loss on (``output_router_logits``, Mixtral), else 0."""
    config = getattr(getattr(model, "hf", None), "config", None)
    if config is None or not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def hf_loss_fn(model: HFCausalLM) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The trainer's loss for ``model``: next-token cross-entropy, plus ``router_aux_loss_coef`` × the router's
    load-balancing loss of the same forward when the config enables it — what transformers' own
    ``MixtralForCausalLM`` returns as ``loss`` given labels. Without the aux loss: ``lm_loss`` itself."""
    from .deepseek import lm_loss

    coef = router_aux_coef(model)
    if coef == 0.0:
        return lm_loss

    def loss_with_router_aux(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        aux = model.aux_loss
        model.aux_loss = None  # one forward, one use: a stale value is never added twice
        loss = lm_loss(logits, targets)
        return loss if aux is None else loss + coef * aux.to(loss.device, loss.dtype)

    return loss_with_router_aux
