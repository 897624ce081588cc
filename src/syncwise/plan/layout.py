"""``Layout``: one way to run a job (the layout owner's dimensions and pipeline settings, plus micro-batch size,
activation recomputation, the parsed compressor and sync specs), its ``--layout`` text form, the training recipe
(``Training``: bytes per parameter and what overlaps), and whether syncwise itself can run the layout.

``--layout`` is read by the one spec parser (``syncwise.specs.parse_spec``: ``key=value`` options separated by
commas) and its typed readers. Whether a layout is runnable is decided by the one owner of the layout's rules,
``syncwise.layout`` (torch-free): ``syncwise_refusal`` asks it, as ``syncwise train`` and ``OptimizedTrainer`` do.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from ..errors import ConfigError
from .. import layout as owner
from ..layout import DISPATCH, EVERY_STEP, SCHEDULES, Compress, SyncSpec, parse_compress, parse_sync
from ..specs import check_keys, parse_spec, read_bool, read_choice, read_int

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout(owner.Layout):
    """The owner's layout (``syncwise.layout.Layout``: degrees — world = pp × dp_replicate × dp_shard × tp, ep
    borrowed from data parallel —, the pipeline's schedule, the expert dispatch, the parsed compressor and sync
    specs, and so its ``dp``, its rules and its ``describe``) with what only the planner prices: ``micro_batch``
    sequences per micro-batch per data-parallel rank (0: the planner picks), recomputation, sequence parallel
    (syncwise's tensor parallel always shards the sequence), and two layouts that are not syncwise's, for published
    runs. Here ``microbatches`` is per step (pipeline M, or gradient accumulation when pp = 1; 0: derived from the
    batch), and ``dp_replicate`` is a count (default 1; ``parse_layout`` fills in the rest of a world).
    ``zero1``: a distributed optimizer (ZeRO-1, optimizer state sharded over data parallel). ``ep_fold``:
    Megatron-Core's MoE parallel folding (arXiv 2504.14960; expert tensor parallel 1): the expert layers regroup the
    ranks, an expert-parallel group taking ``ep`` consecutive ranks, tensor-parallel ones included, so an ep of up
    to a node's GPUs stays on the node's fabric and ep may divide dp × tp (syncwise's ep is borrowed from data
    parallel)."""

    dp_replicate: int = 1
    micro_batch: int = 0
    recompute: str = "none"
    sequence_parallel: bool = True
    zero1: bool = False
    ep_fold: bool = False

    def __post_init__(self) -> None:
        # --layout's own keys name the specs' errors (compress=, sync=); then the owner's checks and parsing.
        if not isinstance(self.compress, Compress):
            object.__setattr__(self, "compress", parse_compress(self.compress, "compress"))
        if self.sync is not None and not isinstance(self.sync, SyncSpec):
            object.__setattr__(self, "sync", parse_sync(self.sync, "sync"))
        super().__post_init__()

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    def text(self) -> str:
        """Compact text, the same keys ``--layout`` reads (``describe``, the owner's, names the degrees alone)."""
        parts = [f"dp={self.dp_replicate}"]
        for key, default in (("dp_shard", 1), ("tp", 1), ("pp", 1), ("ep", 1)):
            if getattr(self, key) != default:
                parts.append(f"{key}={getattr(self, key)}")
        if self.pp > 1:
            parts.append(f"schedule={self.pp_schedule}")
            if self.stages_per_rank > 1:
                parts.append(f"v={self.stages_per_rank}")
        if self.micro_batch:
            parts.append(f"microbatch={self.micro_batch}")
        if self.microbatches:
            parts.append(f"microbatches={self.microbatches}")
        parts.append(f"recompute={self.recompute}")
        if self.tp > 1 and not self.sequence_parallel:
            parts.append("sp=no")
        if self.ep > 1:
            parts.append(f"ep_dispatch={self.ep_dispatch}")
        if not self.compress.is_none:
            parts.append(f"compress={self.compress.text}")
        if self.sync is not None:
            parts.append(f"sync={self.sync}")
        for key, default in (("fsdp_gather", "fp32"), ("fsdp_reshard", "all"), ("hierarchical", "auto")):
            if getattr(self, key) != default:
                parts.append(f"{key}={getattr(self, key)}")
        if self.zero1:
            parts.append("zero1=yes")
        if self.ep_fold:
            parts.append("ep_fold=yes")
        return ",".join(parts)

    @classmethod
    def of_owner(cls, lay: Any, **planner: Any) -> "Layout":
        """The planner's Layout of the owner's (``syncwise.layout.Layout``, resolved): the same degrees, pipeline
        and expert settings and spec objects, plus the planner's own fields (``planner``)."""
        shared = {f.name for f in dataclasses.fields(cls)} & {f.name for f in dataclasses.fields(lay)}
        return cls(**({n: getattr(lay, n) for n in shared} | planner))

    @property
    def sync_text(self) -> str:
        """The sync spec as written, ``every-step`` for none."""
        return str(self.sync) if self.sync is not None else EVERY_STEP

    def as_dict(self) -> dict[str, Any]:
        """Plain values; the specs as their text."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)} | {
            "compress": self.compress.text, "sync": self.sync_text}


@dataclass(frozen=True)
class Training:
    """How the framework trains: bytes per parameter of weights, gradients and optimizer state, the dtypes on
    the wire, and what overlaps. Two recipes ship: ``SYNCWISE`` (what ``syncwise train`` does: fp32 weights
    under bf16 autocast, fp32 gradients, AdamW's two fp32 moments, fp32 FSDP2 gathers, DDP's bucket copy, the
    gradient all-reduce overlapped with backward bucket by bucket except under pp) and ``MEGATRON``
    (Megatron-LM style mixed precision: bf16/fp16 weights, fp32 main gradients, fp32 master weights and
    moments; no flash attention and attention dropout as in 2021; gradient all-reduce after backward; the 1F1B
    schedule waits on its send/recv pairs between micro-batches; every micro-batch's gradients added into the
    main gradients by a hook; L / pp layers on every stage)."""

    name: str = "syncwise"
    weight_bytes: float = 4
    grad_bytes: float = 4
    optimizer_bytes: float = 8
    gather_bytes: float = 4          # FSDP all-gather dtype
    grad_reduce_bytes: float = 4     # gradient all-reduce / reduce-scatter dtype without a compressor
    activation_bytes: float = 2      # matmul outputs under 16-bit autocast
    residual_bytes: float = 4        # the residual stream (fp32 under autocast over fp32 weights)
    ddp_bucket_copy: bool = True     # DDP's flat buckets hold a second copy of the gradients
    overlap_dp: bool = True          # gradient sync overlaps backward (all but the last bucket)
    overlap_dp_with_pp: bool = False  # ... also under pp (syncwise's StageGradientSync runs after the schedule)
    overlap_p2p: bool = True         # pipeline sends are isends (torch.distributed.pipelining): hidden in the steady state
    # Under tensor parallel without sequence parallel every tp rank holds the whole activation a stage sends; the
    # scatter/gather optimization sends 1/tp of it from each rank across the pipeline link and all-gathers the
    # slices over the tp group (NVLink) on the receiving stage (Narayanan et al. SC'21 §4.1; Megatron-LM's default,
    # --no-scatter-gather-tensors-in-pipeline turns it off; DeepSpeed's pipeline engine does the same with its
    # PartitionedTensor, deepspeed/runtime/pipe/engine.py: is_pipe_partitioned = is_model_parallel)
    pp_scatter_gather: bool = False
    # FSDP2's all-gathers and reduce-scatters overlap compute through its own CUDA streams (implicit prefetch issues
    # them synchronously on those streams); on a CPU the streams are the host thread, so nothing overlaps
    overlap_fsdp: bool = True
    fsdp_with_tp: bool = True        # FSDP2 holds the data-parallel ranks of a tensor-parallel model (syncwise)
    bucket_bytes: float = 25e6       # dist.bucket_cap_mb
    flash_attention: bool = True     # SDPA's fused kernels: no s² attention activations stored
    dropout: bool = False
    peak_dtype: str = "bf16"
    optimizer_pass_bytes: float = 36  # HBM traffic per local parameter of one AdamW step
    # HBM traffic per logit of the loss (forward + backward) as PyTorch's unfused cross-entropy runs under bf16
    # autocast: upcast bf16 → fp32 (2 + 4), log_softmax (3 reads + 1 write of 4 B: max, sum of exp, output),
    # nll_loss's dense gradient (4), log_softmax backward (2 reads + 1 write: 12), downcast to bf16 (4 + 2)
    loss_bytes_per_logit: float = 44
    # Gradient accumulation: each micro-batch's weight gradients (the parameter's dtype) are added into the step's
    # sum (grad_bytes): weight_bytes + 2 × grad_bytes of HBM traffic per local parameter (read, read, write).
    # Autograd accumulates into .grad from the second micro-batch on; a hook that adds every micro-batch's .grad
    # into a separate main-gradient buffer does it from the first (Megatron-LM's local DDP: param_hook's
    # ``param.main_grad.add_(param.grad.data)``, megatron/model/distributed.py)
    main_grad_hooks: bool = False
    # How the pipeline's layers are split over its stages (the head, the embedding on the end stages): None,
    # balanced by cost (syncwise's parallel.pipeline.split_layers: the last stage holds fewer layers beside the
    # head); an int k, the first and the last stage hold k fewer layers than the others and the layers are split
    # evenly otherwise (0: Megatron-LM's --num-layers / pp on every stage; Llama 3 removes one layer from each
    # end, Dubey et al. 2024 §3.3.2)
    pp_end_layers: Optional[int] = None


SYNCWISE = Training()
MEGATRON = Training(name="megatron", weight_bytes=2, grad_bytes=4, optimizer_bytes=12, gather_bytes=2,
                    grad_reduce_bytes=4, activation_bytes=2, residual_bytes=2, ddp_bucket_copy=False,
                    overlap_dp=False, overlap_p2p=False, fsdp_with_tp=False, flash_attention=False, dropout=True,
                    optimizer_pass_bytes=40, main_grad_hooks=True, pp_end_layers=0)

LAYOUT_ACCEPTED = ("key=value options separated by commas: dp (= dp_replicate), dp_shard (or fsdp), tp, pp, ep, "
                   "microbatch (sequences per micro-batch), microbatches (per step), schedule (" + "|".join(SCHEDULES)
                   + "), v (stages per rank), recompute (none|selective|full), sp (yes|no), ep_dispatch "
                   "(fp8|bf16|fp32), compress (a compressor spec without commas), sync (a sync spec without "
                   "commas), zero1 (yes|no), ep_fold (yes|no), fsdp_gather (" + "|".join(owner.FSDP_GATHER)
                   + "), fsdp_reshard (" + "|".join(owner.FSDP_RESHARD) + "), hierarchical (" + "|".join(owner.HIERARCHICAL)
                   + "); e.g. dp=4,tp=2,pp=2,microbatch=2,recompute=selective")
_INT_KEYS = {"dp": "dp_replicate", "dp_replicate": "dp_replicate", "dp_shard": "dp_shard", "fsdp": "dp_shard",
             "tp": "tp", "pp": "pp", "ep": "ep", "microbatch": "micro_batch", "micro_batch": "micro_batch",
             "microbatches": "microbatches", "v": "stages_per_rank", "stages_per_rank": "stages_per_rank"}
_KEYS = (*_INT_KEYS, "schedule", "pp_schedule", "recompute", "sp", "ep_dispatch", "compress", "sync", "zero1", "ep_fold",
         "fsdp_gather", "fsdp_reshard", "hierarchical")


def parse_layout(text: str, world: Optional[int] = None, field: str = "--layout") -> Layout:
    """``dp=..,tp=..,pp=..,ep=..,microbatch=..,recompute=..`` → Layout, through ``syncwise.specs.parse_spec``.
    An absent ``dp`` takes the ranks the others leave of ``world`` (the owner's dp_replicate = 0)."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(field, text, LAYOUT_ACCEPTED)
    _, options = parse_spec("layout:" + text.strip(), field, LAYOUT_ACCEPTED)
    check_keys(options, _KEYS, field, text, LAYOUT_ACCEPTED)
    kwargs: dict[str, Any] = {}
    for key, raw in options.items():
        if key in _INT_KEYS:
            lo = 0 if key in ("microbatch", "micro_batch", "microbatches") else 1
            kwargs[_INT_KEYS[key]] = read_int(raw, field, text, key, lo=lo, hi=1 << 20)
        elif key in ("schedule", "pp_schedule"):
            kwargs["pp_schedule"] = read_choice(raw, field, text, key, SCHEDULES)
        elif key == "recompute":
            kwargs["recompute"] = read_choice(raw, field, text, key, RECOMPUTE)
        elif key == "ep_dispatch":
            kwargs["ep_dispatch"] = read_choice(raw, field, text, key, DISPATCH)
        elif key == "sp":
            kwargs["sequence_parallel"] = read_bool(raw, field, text, key)
        elif key in ("zero1", "ep_fold"):
            kwargs[key] = read_bool(raw, field, text, key)
        elif key in ("fsdp_gather", "fsdp_reshard", "hierarchical"):   # the owner's choices (syncwise.layout)
            kwargs[key] = read_choice(raw, field, text, key, {"fsdp_gather": owner.FSDP_GATHER, "fsdp_reshard":
                                      owner.FSDP_RESHARD, "hierarchical": owner.HIERARCHICAL}[key])
        else:
            kwargs[key] = raw
    if "dp_replicate" not in kwargs:
        inner = kwargs.get("pp", 1) * kwargs.get("dp_shard", 1) * kwargs.get("tp", 1)
        if world is None or world % inner:
            raise ConfigError(field, text, f"dp=N, or degrees whose product divides the world size ({world}): "
                              f"pp × dp_shard × tp = {inner}")
        kwargs["dp_replicate"] = world // inner
    if kwargs.get("stages_per_rank", 1) > 1 and "pp_schedule" not in kwargs:
        kwargs["pp_schedule"] = "interleaved-1f1b"
    return Layout(**kwargs)


def owner_layout(layout: Layout, microbatches: int = 0) -> owner.Layout:
    """The planner's layout as the one owner of the layout's rules sees it (``syncwise.layout.Layout``: degrees,
    pipeline and expert settings, the parsed compressor and sync specs — the same objects). The planner's own
    fields (micro-batch size, recomputation, sequence parallel, zero1, ep_fold) stay here."""
    shared = {f.name for f in dataclasses.fields(owner.Layout)}
    return owner.Layout(**{f.name: getattr(layout, f.name) for f in dataclasses.fields(layout) if f.name in shared}
                        | {"microbatches": microbatches or layout.microbatches})


def syncwise_refusal(layout: Layout, model: Any, world: int, microbatches: int) -> Optional[str]:
    """Why syncwise cannot run ``layout`` (None when it can): ``syncwise.layout.Layout.check`` and
    ``check_model`` — the rules every ``syncwise train`` run and every ``OptimizedTrainer`` pass, pipeline
    schedules included — plus the planner-only fields (zero1, ep_fold, sp). Torch-free: what the installed torch ships
    (a schedule's class, float8 for an fp8 dispatch) is the cluster's torch's, checked when its workers start
    (``syncwise.parallel.mesh.check_torch_support``)."""
    try:
        owner_layout(layout, microbatches).check(world).check_model(model)
        if layout.zero1:
            raise ConfigError("zero1", True, "no: syncwise shards optimizer state only with FSDP2 (dp_shard)")
        if layout.ep_fold:
            raise ConfigError("ep_fold", True, "no: syncwise's expert parallel is borrowed from data parallel")
        if layout.tp > 1 and not layout.sequence_parallel:
            raise ConfigError("sp", False, "yes: syncwise's tensor parallel always shards the sequence")
    except ConfigError as e:
        return str(e).replace("invalid value for ", "")
    return None
