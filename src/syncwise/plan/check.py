"""Is the chosen layout far from the best? ``check_layout`` (pure) and ``check_trainer`` (what
``OptimizedTrainer.train(cloud_config=...)`` calls) predict the layout a run uses and the best layout the
planner finds for the same model, batch and cluster, and warn when the chosen one is predicted more than
``THRESHOLD`` (1.25×) slower — a margin well outside the cost model's accuracy (docs/plan.md: 5-10 %).

A user ``nn.Module`` without a syncwise config is described from its parameter count (``describe_module``):
a dense GPT-like decoder whose width is the embedding's (or the most common ``nn.Linear`` input width), whose
vocabulary is the largest embedding's, with 4·d GeLU MLPs and ``(N − embeddings) / 12d²`` layers, heads of
64. FLOPs (6N + attention), memory (N) and traffic (N) are then right to within the guessed shape; what the
shape decides alone (tensor-parallel activations, per-layer latency) is approximate.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from .cloud import CloudConfig, load_cluster
from ..layout import parse_compress
from .cost import Prediction, predict
from .layout import Layout, Training
from .model import ModelSpec, from_model_config
from .search import DEFAULT_COMPRESS, search

THRESHOLD = 1.25   # warn when the chosen layout is predicted this many times slower than the best


@dataclass
class LayoutCheck:
    """The chosen layout's prediction, the best one's, their ratio and the warning (empty when none)."""

    chosen: Prediction
    best: Optional[Prediction]
    ratio: float
    threshold: float
    warning: str = ""
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """What the run's summary.json records."""
        return {"chosen": self.chosen.layout.text(), "chosen_step_s": self.chosen.step_time_s,
                "best": self.best.layout.text() if self.best else None,
                "best_step_s": self.best.step_time_s if self.best else None, "ratio": self.ratio,
                "threshold": self.threshold, "warning": self.warning, "notes": self.notes}


def _as_cloud(cloud: Any) -> CloudConfig:
    return cloud if isinstance(cloud, CloudConfig) else load_cluster(Path(cloud))


def check_layout(cloud: Any, model: ModelSpec, layout: Layout, global_batch: int, seq_len: Optional[int] = None, *,
                 training: Optional[Training] = None, threshold: float = THRESHOLD,
                 compress: Sequence[str] = DEFAULT_COMPRESS, syncwise_rules: bool = True) -> LayoutCheck:
    """Predict ``layout`` and search the best layout syncwise can run for ``model`` at ``global_batch`` on
    ``cloud`` (a CloudConfig or a cluster TOML path); ``warning`` is set when the chosen one is predicted more
    than ``threshold`` × slower, naming the better layout and its predicted gain. The search keeps the
    chosen layout's sync strategy and adds its compressor to ``compress``."""
    from .calibrate import recipe_for

    cloud = _as_cloud(cloud)
    seq_len = seq_len or model.seq_len
    training = training or recipe_for(cloud.accelerator)
    chosen = predict(cloud, model, layout, global_batch, seq_len, training=training, syncwise_rules=False)
    pool = tuple(dict.fromkeys([*(parse_compress(c, "compress") for c in compress), layout.compress]))
    found = search(cloud, model, global_batch, seq_len, top=1, training=training, syncwise_rules=syncwise_rules,
                   compress=pool, sync=(layout.sync,))
    best = found[0] if found else None
    ratio = chosen.step_time_s / best.step_time_s if best else 1.0
    check = LayoutCheck(chosen, best, ratio, threshold)
    if not chosen.fits:
        check.notes.append(f"the chosen layout is predicted not to fit: {chosen.memory_gb_per_gpu:.1f} GiB > "
                           f"{chosen.memory_limit_gb:.1f} GiB usable per GPU")
    if best is not None and ratio > threshold:
        check.warning = (
            f"syncwise plan: the layout this run uses ({layout.text()}) is predicted at "
            f"{chosen.step_time_s:.3g} s per step on {cloud.describe()}, {ratio:.2f}× the best layout syncwise can "
            f"run for this model and batch ({best.layout.text()}, {best.step_time_s:.3g} s): switching is "
            f"predicted to gain {ratio - 1:.0%} throughput (warned above {threshold:.2f}×; `syncwise plan` "
            "explains the breakdown)")
    return check


# ------------------------------------------------------------------------------------------------ the trainer side
def describe_module(module: Any, seq_len: int, name: str = "") -> ModelSpec:
    """A ModelSpec for ``module``: syncwise's own config when the module (or its ``module`` attribute, as DDP
    wraps it) carries one, else a dense GPT-like decoder guessed from the parameter count (module docstring).
    Parameters are counted at their logical (DTensor) size."""
    for obj in (module, getattr(module, "module", None)):
        cfg = getattr(obj, "config", None)
        if cfg is not None and all(hasattr(cfg, k) for k in ("d_model", "n_layers", "vocab_size", "n_routed_experts")):
            return dataclasses.replace(from_model_config(cfg, name or type(obj).__name__), seq_len=seq_len)
    from torch import nn

    total = sum(p.numel() for p in module.parameters())
    embeds = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    vocab = max((e.num_embeddings for e in embeds), default=0)
    if embeds:
        d = max(embeds, key=lambda e: e.num_embeddings).embedding_dim
    elif linears:
        widths = [m.in_features for m in linears]
        d = max(set(widths), key=widths.count)
    else:
        d = max(1, int(round((total / 12) ** 0.5)))
    rest = max(0, total - sum(e.weight.numel() for e in embeds))
    layers = max(1, round(rest / (12 * d * d)))
    heads = max(1, d // 64) if d % 64 == 0 else 1
    return ModelSpec(name or type(module).__name__, max(vocab, 2), d, layers, heads, 4 * d, seq_len=seq_len,
                     mlp="gelu", source=f"approximated from {total:,} parameters (syncwise.plan.check.describe_module)")


def trainer_layout(trainer: Any, batch_rows: int) -> tuple[Layout, int]:
    """The planner's Layout of a running ``OptimizedTrainer`` and its global batch in sequences (the loader's
    rows per batch × data-parallel ranks × accumulation; under pp the rows are the rank's whole batch). The
    layout is the one ``parallelize`` resolved and checked (``trainer.par.spec``: a ``syncwise.layout.Layout``
    with the run's parsed compressor and sync specs); the planner adds its own fields."""
    spec = trainer.par.spec
    pp = spec.pp
    M = spec.microbatches_per_step if pp > 1 else trainer.grad_accum_steps
    global_batch = batch_rows * spec.dp * (1 if pp > 1 else M)
    micro = batch_rows // M if pp > 1 else batch_rows
    return Layout.of_owner(spec, microbatches=M, micro_batch=max(1, micro),
                           recompute="full" if _checkpointed(trainer.model) else "none"), global_batch


def _checkpointed(module: Any) -> bool:
    """Whether syncwise's activation checkpointing wrapped the blocks (their ``forward`` is a partial of
    ``torch.utils.checkpoint.checkpoint``, parallel/activation_checkpoint.py)."""
    import functools

    for m in module.modules():
        fwd = m.__dict__.get("forward")
        if isinstance(fwd, functools.partial) and getattr(fwd.func, "__name__", "") == "checkpoint":
            return True
    return False


def check_trainer(trainer: Any, cloud_config: Any, first_batch: Any) -> dict[str, Any]:
    """What ``OptimizedTrainer.train(cloud_config=...)`` records: the layout check of the run (its model, its
    layout, the global batch and sequence length of ``first_batch``) on ``cloud_config`` (a CloudConfig or a
    cluster TOML path). Warns (``warnings.warn``, rank 0) when the chosen layout is predicted more than 1.25×
    slower than the best; the returned dict has the warning text for the run's notes and summary."""
    cloud = _as_cloud(cloud_config)
    inputs = first_batch[0] if isinstance(first_batch, (tuple, list)) else first_batch
    shape = tuple(getattr(inputs, "shape", ()))
    if len(shape) < 2:
        return {"skipped": f"the loader's inputs are not (batch, sequence) token ids (shape {shape})"}
    rows, seq_len = int(shape[0]), int(shape[1])
    if cloud.world_size != trainer.world_size:
        return {"skipped": f"the cluster has {cloud.world_size} GPUs ({cloud.describe()}), this run "
                           f"{trainer.world_size} workers: the layout check compares layouts of the same world"}
    model = describe_module(getattr(trainer, "user_model", None) or trainer.model, seq_len)
    layout, global_batch = trainer_layout(trainer, rows)
    if layout.pp > 1 and model.source.startswith("approximated"):
        model = dataclasses.replace(model, n_layers=model.n_layers * layout.pp)    # the rank holds 1/pp of it
    check = check_layout(cloud, model, layout, global_batch, seq_len)
    out = {"model": model.describe(), "global_batch": global_batch, "seq_len": seq_len, **check.summary()}
    if check.warning and trainer.rank == 0:
        warnings.warn(check.warning, stacklevel=3)
    return out


def check_training_run(cloud: CloudConfig, trainer: Any, first_batch: Any) -> dict[str, Any]:
    """``CloudConfig.check_training_run``: the planner's check of a running ``OptimizedTrainer``'s layout on this
    cluster. ``OptimizedTrainer.train(cloud_config=...)`` calls it as a method, since the train layer sits below
    plan and does not import it (DESIGN.md §3); ``syncwise/plan/__init__.py`` attaches it to CloudConfig, so
    cloud.py does not import this module (which imports cloud: the cycle plan once had)."""
    return check_trainer(trainer, cloud, first_batch)
