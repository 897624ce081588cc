"""``OptimizedTrainer``'s options in four typed groups, one per component (as torchtitan's per-component configs).

    OptimizedTrainer(model, optimizer, loss_fn,
                     comm=CommOptions(compress_gradients="powersgd:rank=4", parallel={"dp_shard": 2}),
                     step=StepOptions(mixed_precision="bf16", grad_accum_steps=4),
                     run=RunOptions(run_dir="runs/a", log_interval=5),
                     faults=FaultOptions(collective_timeout_s=60))

Every field is also a keyword of ``OptimizedTrainer`` itself, with the same name and default (the seed's
``OptimizedTrainer(model, optimizer, loss_fn, compress_gradients=..., mixed_precision=..., dynamic_batch=...)``);
a keyword set to something other than its default together with the group that holds it is refused (it would be
given twice). Every field is a ``syncwise.schema.Option`` (default, doc, accepted values, rule), checked when its
group is made with the error naming the field as the keyword does; a field that the command line has too is the
same Option as ``syncwise train``'s section field (written once, in ``syncwise.schema``). What depends on the
device or the layout (fp16 needs CUDA, dynamic batching needs replicas) is checked by the trainer.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Callable, Iterable, Optional

from .. import schema
from ..errors import ConfigError
from ..profiling import check_pair
from ..schema import option
from . import arguments
from .dynamic_batch import DynamicBatcher
from .faults import Fault


def _compressor_like(v: Any) -> bool:
    from ..compress.api import GradientCompressor
    from ..compress.base import Compressor
    from ..parallel import TorchHookSpec

    return isinstance(v, (Compressor, GradientCompressor, TorchHookSpec))


def _sync_like(v: Any) -> bool:
    from ..layout import SyncSpec

    return isinstance(v, SyncSpec)


def _layout_like(v: Any) -> bool:
    from ..layout import Layout

    return isinstance(v, Layout)


def _iterable_not_text(v: Any) -> bool:
    return hasattr(v, "__iter__") and not isinstance(v, (str, bytes, bytearray, dict))


def _fault_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(x, (str, Fault)) for x in v)


def _device_like(v: Any) -> bool:
    import torch

    return v is None or isinstance(v, (str, torch.device)) or (isinstance(v, int) and not isinstance(v, bool))


# Every field is a syncwise.schema.Option: its default, doc, accepted values and rule in one place. Those the command
# line has too are schema's (one definition for both doors); the Python API's own are written here. A wrong value is
# refused when the group is made, in one line naming the keyword, before anything is built (not a traceback deep
# inside, nor a silent truthiness test: show_progress='no' is not True); what depends on the device or the layout is
# the trainer's and layout.check_step's.


@dataclass
class CommOptions:
    """How the ranks communicate: the layout, gradient compression, reduced sync and DDP's buckets."""

    compress_gradients: Any = option(
        None, "gradient compression (docs/compression.md); True: powersgd:rank=4",
        "None/False/'none', True, a spec string ('powersgd:rank=4', 'torch-fp16') or a syncwise Compressor",
        lambda v: v is None or isinstance(v, (bool, str)) or _compressor_like(v))
    sync: Any = option(None, "reduced sync: local SGD / DiLoCo every H steps, Pipe-SGD, ... (None: every step)",
                       "None (every step), a spec string ('localsgd:period=8', 'diloco:...') or a syncwise SyncSpec",
                       lambda v: v is None or isinstance(v, str) or _sync_like(v), rule="sync")
    parallel: Any = option(None, "the layout: FSDP2 / HSDP / tensor / pipeline / expert degrees (None: every rank a "
                           "DDP replica)", "None (DDP replicas), a dict of ParallelSpec fields or a "
                           "syncwise.parallel.ParallelSpec", lambda v: v is None or isinstance(v, dict) or _layout_like(v))
    tp_plan: Optional[dict] = option(None, "a user model's tensor-parallel plan (parallelize_module's dict)",
                                     "None or a dict (parallelize_module's plan)")
    pipeline_split: Optional[Callable[[Any, int, int], Any]] = option(
        None, "a user model's pipeline split: split_fn(model, stage, n_stages) -> the stage's module",
        "None or a function split_fn(model, stage, n_stages)")
    bucket_cap_mb: float = schema.BUCKET_CAP.field(api=True)
    min_numel: int = schema.MIN_NUMEL_OPTION.field(api=True)

    def __post_init__(self) -> None:
        schema.validate_fields(self)


@dataclass
class StepOptions:
    """What one optimizer step does: precision, accumulation, clipping, micro-batching, compile, recompute."""

    mixed_precision: Any = schema.MIXED_PRECISION.field(api=True)
    grad_accum_steps: int = schema.GRAD_ACCUM.field(api=True)
    clip_grad_norm: float = schema.CLIP_GRAD.field(api=True)
    lr_scheduler: Any = option(None, "stepped after each applied update",
                               "None or a learning-rate scheduler (an object with .step())",
                               lambda v: v is None or callable(getattr(v, "step", None)))
    dynamic_batch: Optional[DynamicBatcher] = option(None, "micro-batches that fit in memory (docs/dynamic-batch.md)",
                                                     "None or a syncwise.train.DynamicBatcher", rule="dynamic_batch")
    compile: bool = schema.COMPILE.field(api=True)
    activation_checkpointing: bool = schema.ACTIVATION_CHECKPOINTING.field(api=True)
    tf32: bool = option(True, "fp32 matmuls on tensor cores (CUDA)", "True or False")

    def __post_init__(self) -> None:
        schema.validate_fields(self)  # (the trainer keeps mixed_precision's spelling for its errors)


@dataclass
class RunOptions:
    """Where the run lives and what it reports: device, run directory, validation, progress, checkpoints."""

    device: Any = option(None, "where the model trains (None: the model's)",
                         "None (the model's), a torch.device, 'cpu', 'cuda' or 'cuda:N'", _device_like)
    run_dir: Any = option(None, "metrics.jsonl, summary.json, ranks/, heartbeats/ (None: no files); its rule is "
                          "arguments.as_path's, as train(checkpoint_dir=)'s")
    val_loader: Optional[Iterable] = option(None, "validation batches", "None or an iterable of batches (a DataLoader)",
                             lambda v: v is None or _iterable_not_text(v))
    val_interval: int = schema.VAL_INTERVAL.field(api=True)
    log_interval: int = schema.LOG_INTERVAL.field(api=True)
    show_progress: bool = option(True, "False silences the console only; files are still written", "True or False")
    flops_per_token: Optional[float] = option(None, "the model's FLOPs per token, for MFU",
                                              "None or a finite number > 0", lambda v: v > 0)
    checkpointer: Any = option(None, "a SmartCheckpointer (or train(checkpoint_dir=...))",
                               "None or a syncwise SmartCheckpointer (or train(checkpoint_dir=...))",
                               lambda v: v is None or all(hasattr(v, a) for a in ("save", "load", "directory")))
    data_seed: int = option(0, "shuffle order of a sharded loader", "an integer ≥ 0", lambda v: v >= 0)
    profile_steps: Optional[str] = schema.PROFILE_STEPS.field(api=True)
    profile_every: int = schema.PROFILE_EVERY.field(api=True)

    def __post_init__(self) -> None:
        schema.validate_fields(self)
        self.run_dir = arguments.as_path("run_dir", self.run_dir)
        check_pair(self.profile_steps, self.profile_every)
        if self.device is not None:  # a torch.device from here on (the trainer reads .type)
            from ..devices import resolve

            self.device = resolve(self.device, "device")


@dataclass
class FaultOptions:
    """When something goes wrong: hung collectives, preemption signals, and injected faults for tests and demos."""

    collective_timeout_s: Optional[float] = schema.COLLECTIVE_TIMEOUT.field(api=True)
    preempt_grace_s: Optional[float] = schema.PREEMPT_GRACE.field(api=True)
    inject_faults: Any = option(None, "faults to inject (train/faults.py), parsed once, here",
                                "None or a list of fault specs ('kill:rank=R,step=S', 'nan:step=S', ...)",
                                lambda v: v is None or isinstance(v, str) or _fault_list(v))
    live_recovery: Any = option(None, "a train.live_recovery.LiveRecovery: this replica group's torchft side",
                                "None or a syncwise.train.live_recovery.LiveRecovery",
                                lambda v: v is None or (hasattr(v, "attach") and hasattr(v, "join")))

    def __post_init__(self) -> None:
        schema.validate_fields(self)
        if isinstance(self.inject_faults, str):  # one spec
            self.inject_faults = [self.inject_faults]
        # parsed once, here: the trainer's FaultPlan gets Fault objects (a bad spec fails before anything is built)
        self.inject_faults = [Fault.parse(x) if isinstance(x, str) else x for x in self.inject_faults or []]


@dataclass
class TrainerOptions:
    """The four groups one trainer was made with (``OptimizedTrainer.options``)."""

    comm: CommOptions
    step: StepOptions
    run: RunOptions
    faults: FaultOptions


GROUPS = {"comm": CommOptions, "step": StepOptions, "run": RunOptions, "faults": FaultOptions}
KEYWORDS = frozenset(f.name for kind in GROUPS.values() for f in fields(kind))  # OptimizedTrainer's flat keywords
#: The training fields ``layout.check_step`` involves, as ``OptimizedTrainer``'s keywords ({rule: keyword}): read
#: off the groups' fields whose Option carries that rule (``schema.rule_fields``; the command line's: ``config``).
API_STEP_FIELDS = schema.rule_fields(GROUPS, qualified=False)


def gather(keywords: dict[str, Any], **groups: Any) -> TrainerOptions:
    """The four groups from ``OptimizedTrainer``'s flat ``keywords`` (those given; the rest keep their group's
    default) and the groups given (``comm=``, ``step=``, ``run=``, ``faults=``): a group given is used as it is;
    otherwise it is made from the keywords. A keyword no group has is refused, with the nearest name."""
    unknown = sorted(set(keywords) - KEYWORDS)
    if unknown:
        import difflib

        near = difflib.get_close_matches(unknown[0], sorted(KEYWORDS), n=1)
        raise ConfigError(unknown[0], _short(keywords[unknown[0]]), (f"did you mean {near[0]!r}? " if near else "")
                          + "a keyword of OptimizedTrainer: " + ", ".join(sorted(KEYWORDS | set(GROUPS))))
    out: dict[str, Any] = {}
    for name, kind in GROUPS.items():
        given = groups.get(name)
        if given is None:
            out[name] = kind(**{f.name: keywords[f.name] for f in fields(kind) if f.name in keywords})
            continue
        if not isinstance(given, kind):
            raise ConfigError(name, given, f"None or a syncwise.train.{kind.__name__}")
        for f in fields(kind):
            if f.name in keywords and not _is_default(keywords[f.name], f.default):
                raise ConfigError(f.name, keywords[f.name], f"its default ({f.default!r}) when {name}= is given: "
                                  f"set it in the {kind.__name__} instead")
        out[name] = given
    return TrainerOptions(**out)


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    plain = (bool, int, float, str)
    return isinstance(value, plain) and isinstance(default, plain) and type(value) is type(default) and value == default


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def signature(init: Callable) -> Any:
    """``init``'s signature with every group field added as a keyword-only parameter (its name, default and type):
    what ``help(OptimizedTrainer)`` and IDEs show for the flat keywords, derived from the groups, written nowhere
    else."""
    import inspect

    base = inspect.signature(init)
    params = [p for p in base.parameters.values() if p.kind is not p.VAR_KEYWORD]
    for kind in GROUPS.values():
        params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
                   for f in fields(kind)]
    return base.replace(parameters=params)


def shared_keywords(config: Any) -> dict[str, Any]:
    """``OptimizedTrainer``'s keywords from the values of a tree of dataclasses (``syncwise train``'s RunConfig and
    its sections): every field that is the same ``syncwise.schema.Option`` as a group field gives that field's
    keyword (``[train] grad_accum`` → ``grad_accum_steps``). The worker hands a job's options to the trainer so: the
    pairing is the schema's, written nowhere else."""
    keyword = {schema.option_of(f): f.name for kind in GROUPS.values() for f in fields(kind) if schema.option_of(f)}
    out: dict[str, Any] = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if is_dataclass(value):
            out.update(shared_keywords(value))
        elif schema.option_of(f) in keyword:
            out[keyword[schema.option_of(f)]] = value
    return out
