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

    #: A model built for sharding (build_hf_model(sharded=True)) until hand_over_shards: its tensors are on the
    #: meta device, rank 0 holds the whole model's (state dict, buffers) here (None on the other ranks).
    _full_on_rank0: "Optional[tuple[dict, dict]]" = None
    _sharded_target: Optional[torch.device] = None  # where the shards go (the last .to()'s device)

    @property
    def awaiting_shards(self) -> bool:
        """True while the model is on the meta device, waiting for FSDP2's shards (build_hf_model(sharded=True))."""
        return self._sharded_target is not None

    def to(self, *args, **kwargs):  # noqa: D102 (nn.Module.to)
        if not self.awaiting_shards:
            return super().to(*args, **kwargs)
        # On the meta device until sharded: remember where (the trainer moves the model before parallelizing it)
        device, dtype = torch._C._nn._parse_to(*args, **kwargs)[:2]
        if dtype is not None and dtype != torch.float32:
            raise ValueError(f"HFCausalLM.to(dtype={dtype}) before FSDP2 has sharded it: a model built for sharding "
                             "keeps fp32 master weights (build_hf_model(sharded=True)); cast after sharding, or "
                             "build it with sharded=False")
        if device is not None:
            self._sharded_target = device
        return self

    def hand_over_shards(self) -> "tuple[torch.device, Optional[tuple[dict, dict]]]":
        """For parallel/fsdp.apply_fsdp, once FSDP2 has sharded the structure: where the shards go (the device of
        the last ``.to()``) and, on rank 0, the whole model's (state dict, buffers) by this module's names (None on
        the other ranks). The model is then no longer awaiting its shards: the caller fills them."""
        device, full = self._sharded_target, self._full_on_rank0
        self._sharded_target = self._full_on_rank0 = None
        if full is not None:
            full = ({f"hf.{k}": v for k, v in full[0].items()}, {f"hf.{k}": v for k, v in full[1].items()})
        return device, full

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


def _hf_from_folder(info: HFModelInfo, meta: bool = False) -> nn.Module:
    """transformers' model for ``info`` in fp32: its safetensors weights when it has any, else at random from its
    config (torch's RNG); ``meta``: the structure only, every tensor on the meta device (no memory, no RNG)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = str(info.folder)
    if meta:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    elif info.weights:
        hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    else:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.config.use_cache = False
    hf.train()  # from_pretrained returns it in eval mode
    return hf


def build_hf_model(preset: str, seq_len: int = 0, *, sharded: bool = False) -> HFCausalLM:
    """Build ``hf:FOLDER`` with transformers, in fp32 (the trainer's master weights): from the folder's
    ``*.safetensors`` weights when it has any (``from_pretrained(local_files_only=True)``), else at random from its
    config (``from_config``; torch's RNG, so seed first).

    ``sharded`` (a process group exists, and FSDP2 will shard the whole model over every rank): every rank builds the
    model on the meta device; rank 0 alone also builds it for real on the CPU (the same weights an unsharded build
    gets: the folder's, or the RNG's at the same seed, drawn on a forked RNG so that every rank's stream stays
    alike) and keeps its tensors until FSDP2 has sharded the structure: then parallel/fsdp.apply_fsdp gives every
    rank its own shards from rank 0's, one tensor at a time (:meth:`HFCausalLM.hand_over_shards`). Host memory: the
    whole model once on rank 0 (not once per local rank), nothing on the others; GPU memory: each rank's shards."""
    info = read_hf_model(preset)
    if not sharded:
        return HFCausalLM(_hf_from_folder(info), info, seq_len)
    import torch.distributed as dist

    full = None
    if dist.get_rank() == 0:
        with torch.random.fork_rng(devices=[]):
            real = _hf_from_folder(info)
        full = (real.state_dict(), {n: b for n, b in real.named_buffers()})
        del real
    model = HFCausalLM(_hf_from_folder(info, meta=True), info, seq_len)
    model._full_on_rank0 = full
    model._sharded_target = torch.device("cpu")
    return model


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
