"""The torch half of ``hf:FOLDER`` models (see models/hf.py): build one with transformers and wrap it."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .config import ModelConfig
from .hf import HFModelInfo, read_hf_model
from .moe import _in_backward, balance_bias_


class HFCausalLM(nn.Module):
    """A Hugging Face ``*ForCausalLM`` with syncwise's contract: ``forward(idx) -> logits (B, T, vocab)``.

    The Hugging Face model is ``self.hf`` (its parameters are named ``hf.model.layers.0...``); save it back
    with ``wrapper.hf.save_pretrained(folder)``."""

    def __init__(self, hf: nn.Module, info: Optional[HFModelInfo] = None, seq_len: int = 0,
                 bias_update_rate: Optional[float] = None) -> None:
        super().__init__()
        self.hf = hf
        self.info = info
        self.seq_len = seq_len
        # DeepSeek-V3's routers select experts by score + e_score_correction_bias; transformers never updates that
        # bias. syncwise does, as for its own MoE presets: each router's selections are counted (a forward hook on
        # the router's own top-k) and update_router_bias, which the trainer calls after every optimizer step,
        # moves the bias by the same rule and rate (models.moe.balance_bias_, ModelConfig.bias_update_rate).
        self._routers = [m for m in hf.modules() if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor)]
        self.bias_update_rate = ModelConfig.bias_update_rate if bias_update_rate is None else bias_update_rate
        for router in self._routers:
            router.register_forward_hook(_count_selections)

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

    @torch.no_grad()
    def update_router_bias(self, reduce_fn: Optional[Callable[[torch.Tensor], object]] = None,
                           apply: Optional[torch.Tensor] = None) -> None:
        """After an optimizer step: move every DeepSeek-V3 router's ``e_score_correction_bias`` toward balance
        from the selections counted since the last call (summed across ranks by ``reduce_fn``, one collective for
        all layers, so every replica applies the same update), then reset the counts. No routers, or a rate of 0:
        nothing (and no collective)."""
        if not self._routers or self.bias_update_rate == 0:
            return
        counts = torch.stack([_counts_of(r) for r in self._routers])
        if reduce_fn is not None:
            reduce_fn(counts)
        for router, load in zip(self._routers, counts):
            ok = balance_bias_(router.e_score_correction_bias, load, self.bias_update_rate, apply)
            own = _counts_of(router)
            router._syncwise_counts = torch.where(ok, torch.zeros_like(own), own)  # a skipped step's carry over

    #: Training FLOPs per token, set by whoever builds the run (the worker: the planner's count of config.json at
    #: the training length, config.hf_model_spec); the models layer does not import the planner. 0: unknown.
    flops_per_token_value: float = 0.0

    def flops_per_token(self) -> float:
        """Training FLOPs per token (0 when the builder did not set it: no MFU)."""
        return self.flops_per_token_value


def _counts_of(router: nn.Module) -> torch.Tensor:
    counts = getattr(router, "_syncwise_counts", None)
    if counts is None or counts.device != router.e_score_correction_bias.device:
        counts = torch.zeros(router.e_score_correction_bias.numel(), dtype=torch.int64,
                             device=router.e_score_correction_bias.device)
        router._syncwise_counts = counts
    return counts


def _count_selections(router: nn.Module, args: tuple, out: tuple) -> None:
    """Forward hook on a DeepSeek-V3 router (``(logits, weights, top-k indices)``): count each expert's selections
    in training forwards, not in evaluation nor in activation checkpointing's recompute (models.moe's rule)."""
    if not (router.training and torch.is_grad_enabled()) or _in_backward():
        return
    flat = out[2].reshape(-1)
    counts = _counts_of(router)
    counts.scatter_add_(0, flat.to(counts.device), torch.ones_like(flat, dtype=counts.dtype, device=counts.device))


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
