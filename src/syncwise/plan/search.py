"""``search``: every layout of a cluster that fits in memory (and, by default, that syncwise can run), ranked by
predicted step time; ``explain`` says in one line why the best beat the runner-up."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional, Sequence

from ..layout import NO_COMPRESS, parse_compress, parse_sync
from .cloud import CloudConfig
from .cost import Prediction, predict
from .layout import SYNCWISE, Layout, Training, syncwise_refusal
from .memory import memory_per_rank
from .model import ModelSpec

#: (schedule, stages per rank) tried when pp > 1
PIPELINE_SCHEDULES: tuple[tuple[str, int], ...] = (
    ("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 2), ("zbv", 2), ("dualpipev", 2))
#: compressors tried by default: the ones syncwise measured within 1 % of fp32's loss (benchmarks/RESULTS.md §3)
DEFAULT_COMPRESS = ("none", "bf16", "fp8")
TIE = 0.02   # network_priority re-ranks layouts within 2 % of the best step time


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(n: int, most: int) -> list[int]:
    out, d = [], 1
    while d <= min(n, most):
        if n % d == 0:
            out.append(d)
        d *= 2
    return out


def candidate_layouts(cloud: CloudConfig, model: ModelSpec, global_batch: int, *,
                      compress: Sequence[Any] = DEFAULT_COMPRESS, sync: Sequence[Any] = ("every-step",),
                      schedules: Sequence[tuple[str, int]] = PIPELINE_SCHEDULES, max_pp: Optional[int] = None,
                      ep_dispatch: str = "fp32", fsdp: bool = True, zero1: bool = False,
                      sequence_parallel: bool = True) -> Iterable[Layout]:
    """Every structural layout whose product is the world size: tp a power of two within a node dividing the
    heads, pp ≤ layers, every dp_shard × dp_replicate split whose dp divides the batch, ep dividing experts and
    dp; the pipeline schedules; compressors only where there is data parallelism, sync strategies only with
    plain replicas. Micro-batch size and recomputation are chosen by :func:`search`."""
    W, G = cloud.world_size, cloud.gpus_per_node
    compress = [parse_compress(c, "compress") for c in compress]   # each spec parsed once, travels as an object
    sync = [parse_sync(s, "sync") for s in sync]
    for tp in _powers_of_two(W, G):
        if model.n_heads % tp:
            continue
        for pp in divisors(W // tp):
            if pp > model.n_layers or (max_pp and pp > max_pp):
                continue
            for shard in (divisors(W // (tp * pp)) if fsdp else [1]):
                rep = W // (tp * pp * shard)
                dp = rep * shard
                if global_batch % dp:
                    continue
                eps = [e for e in divisors(dp) if model.is_moe and model.n_routed_experts % e == 0] or [1]
                for ep in eps:
                    for sched, v in (schedules if pp > 1 else (("1f1b", 1),)):
                        if pp * v > model.n_layers:
                            continue
                        for c in (compress if dp > 1 else (NO_COMPRESS,)):
                            for s in sync:
                                if s is not None and (dp == 1 or shard > 1 or tp > 1 or pp > 1 or ep > 1
                                                      or not c.is_none):
                                    continue
                                yield Layout(dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, ep=ep, pp_schedule=sched,
                                             stages_per_rank=v, compress=c, sync=s,
                                             ep_dispatch=ep_dispatch,
                                             zero1=zero1 and dp > 1 and shard == 1,
                                             sequence_parallel=sequence_parallel)


def search(cloud: CloudConfig, model: ModelSpec, global_batch: int, seq_len: Optional[int] = None, top: int = 5, *,
           training: Training = SYNCWISE, syncwise_rules: bool = True, compress: Sequence[Any] = DEFAULT_COMPRESS,
           sync: Sequence[Any] = ("every-step",), recompute: Sequence[str] = ("none", "selective", "full"),
           micro_batches: Optional[Sequence[int]] = None, schedules: Sequence[tuple[str, int]] = PIPELINE_SCHEDULES,
           distinct: bool = True, max_pp: Optional[int] = None, ep_dispatch: str = "fp32",
           matmul_efficiency: Optional[float] = None, fsdp: bool = True, zero1: bool = False,
           sequence_parallel: bool = True) -> list[Prediction]:
    """The ``top`` fastest layouts that fit in memory, sorted by predicted step time (network_priority breaks
    near-ties). Only layouts whose product equals nodes × gpus_per_node are built; with ``syncwise_rules`` only
    those ``syncwise.layout.Layout.check`` / ``check_model`` accept. For each structure the
    micro-batch sizes (powers of two up to 32 dividing the per-rank batch, or ``micro_batches``) are tried with
    the least recomputation that fits (more recomputation is never faster in this model); ``distinct`` keeps
    the best micro-batch / recomputation per structure. ``fsdp=False`` leaves dp_shard at 1 (a framework
    without FSDP, e.g. Megatron-LM 2021); ``zero1`` shards optimizer state over data parallel (not a syncwise
    layout); ``sequence_parallel=False`` runs tensor parallel without it (not a syncwise layout either)."""
    seq_len = seq_len or model.seq_len
    model = model.with_seq_len(seq_len)
    limit = cloud.accelerator.memory_bytes - cloud.accelerator.reserved_bytes
    order = [r for r in ("none", "selective", "full") if r in recompute]
    if training.flash_attention and "none" in order and "selective" in order:
        order.remove("selective")      # fused attention stores no s² terms: selective = none
    refusals: dict[tuple, Optional[str]] = {}
    best: dict[tuple, Prediction] = {}
    results: list[Prediction] = []
    for base in candidate_layouts(cloud, model, global_batch, compress=compress, sync=sync, schedules=schedules,
                                  max_pp=max_pp, ep_dispatch=ep_dispatch, fsdp=fsdp, zero1=zero1,
                                  sequence_parallel=sequence_parallel):
        per_rank = global_batch // base.dp
        sizes = [m for m in (micro_batches or _powers_of_two(per_rank, 32)) if per_rank % m == 0]
        for mb in sizes:
            M = per_rank // mb
            if base.pp > 1 and M < base.pp and base.pp_schedule != "gpipe":
                continue
            layout = dataclasses.replace(base, micro_batch=mb, microbatches=M)
            if syncwise_rules:
                key = (base.dp_replicate, base.dp_shard, base.tp, base.pp, base.ep, base.pp_schedule,
                       base.stages_per_rank, M if base.pp > 1 else 0, base.compress, base.sync)
                if key not in refusals:
                    refusals[key] = syncwise_refusal(layout, model, cloud.world_size, M)
                if refusals[key]:
                    continue
            for rc in order:
                candidate = dataclasses.replace(layout, recompute=rc)
                if memory_per_rank(model, candidate, training, seq_len, mb, M).total > limit:
                    continue
                pred = predict(cloud, model, candidate, global_batch, seq_len, training=training,
                               syncwise_rules=False, matmul_efficiency=matmul_efficiency)
                if syncwise_rules:
                    pred.runnable = True
                if distinct:
                    k = (base.dp_replicate, base.dp_shard, base.tp, base.pp, base.ep, base.pp_schedule,
                         base.stages_per_rank, base.compress, base.sync)
                    if k not in best or pred.step_time_s < best[k].step_time_s:
                        best[k] = pred
                else:
                    results.append(pred)
                break
    results = list(best.values()) if distinct else results
    ranked = rank(results, cloud.network_priority)
    if distinct:   # schedules the model cannot tell apart (the zero-bubble family): keep the first listed
        seen: set = set()
        kept = []
        for p in ranked:
            lay = p.layout
            key = (lay.dp_replicate, lay.dp_shard, lay.tp, lay.pp, lay.ep, lay.compress, lay.sync, lay.micro_batch,
                   lay.recompute, round(p.step_time_s, 9), round(p.memory_gb_per_gpu, 6))
            if key not in seen:
                seen.add(key)
                kept.append(p)
        ranked = kept
    return ranked[:top]


def rank(preds: list[Prediction], priority: str = "balanced") -> list[Prediction]:
    """Sort by step time; with ``low_latency`` / ``bandwidth`` priority the layouts within 2 % of the best are
    re-ordered by inter-node messages / bytes per step."""
    preds = sorted(preds, key=lambda p: p.step_time_s)
    if priority == "balanced" or not preds:
        return preds
    cut = preds[0].step_time_s * (1 + TIE)
    near = [p for p in preds if p.step_time_s <= cut]
    rest = preds[len(near):]
    attr = "inter_node_messages" if priority == "low_latency" else "inter_node_bytes"
    return sorted(near, key=lambda p: (getattr(p, attr), p.step_time_s)) + rest


LABELS = {"compute": "compute", "kernel_overhead": "per-kernel launch overhead", "recompute": "recomputation",
          "tp_comm": "tensor-parallel communication",
          "ep_comm": "expert all-to-alls", "pp_p2p": "pipeline sends", "pp_bubble": "the pipeline bubble",
          "pp_imbalance": "the busiest pipeline stage", "grad_accumulation": "gradient accumulation",
          "fsdp_comm_exposed": "exposed FSDP gathers", "dp_comm_exposed": "exposed gradient sync",
          "sync_exposed": "exposed replica averaging", "compress_compute": "compression compute",
          "optimizer": "the optimizer step"}


def explain(best: Prediction, runner_up: Optional[Prediction]) -> str:
    """One line: why ``best`` beat ``runner_up`` (the breakdown entry that differs most)."""
    if runner_up is None:
        return f"{best.layout.text()} is the only layout that fits."
    diff = {k: runner_up.breakdown.get(k, 0.0) - best.breakdown.get(k, 0.0) for k in best.breakdown}
    key = max(diff, key=diff.get)
    gain = runner_up.step_time_s / best.step_time_s - 1
    line = (f"{best.layout.text()} beats {runner_up.layout.text()} by {gain:.1%} "
            f"({_s(best.step_time_s)} vs {_s(runner_up.step_time_s)} per step): {LABELS.get(key, key)} "
            f"{_s(best.breakdown[key])} vs {_s(runner_up.breakdown[key])}")
    if gain < TIE:
        line += " — a near-tie, inside the model's accuracy: either layout is fine"
        if best.step_time_s >= runner_up.step_time_s:
            line += f" (ranked first by network_priority: fewer inter-node {'messages' if best.inter_node_messages < runner_up.inter_node_messages else 'bytes'})"
    return line


def _s(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 0.1 else f"{seconds * 1e3:.3g} ms"


def human_time(seconds: float) -> str:
    """A predicted time as people read it, four significant digits and never an exponent (issue 43 row 9):
    '912.4 ms', '6.818 s', '10,320 s'."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.4g} ms"
    return f"{seconds:.4g} s" if seconds < 1000 else f"{seconds:,.0f} s"


def wrap_layout(text: str) -> str:
    """A layout for a table cell: a space after each comma, so a narrow column wraps between its keys, never inside
    one (``parse_layout`` reads it back with the spaces)."""
    return ", ".join(part.strip() for part in text.split(","))

