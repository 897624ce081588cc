"""What a planned layout asks of ``syncwise train``: the planner's values for the run (:class:`PlannedRun`) and the
header that names the prediction and how to launch it.

The planner sits below the config layer, so it writes no config key: ``syncwise plan --emit-config``
(``commands/plan.planned_config``) puts these values into ``syncwise.config``'s sections, whose fields name every
key of the file (``config.format_config``); tests/test_plan.py loads it back with ``load_file`` + ``build_config``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError
from .cloud import CloudConfig
from .cost import Prediction
from .layout import Layout


@dataclass(frozen=True)
class PlannedRun:
    """The run a prediction plans, in the planner's terms: the model (a syncwise preset, or the model's own name,
    which ``syncwise train`` refuses in plain words: never the default preset), sequences per micro-batch per
    worker, micro-batches per step, full recomputation, workers per node, nodes, whether it runs on the lab, and
    the layout (its ``microbatches`` the pipeline's, 0 without one)."""

    preset: str
    seq_len: int
    batch_size: int
    grad_accum: int
    activation_checkpointing: bool
    nproc: int
    nnodes: str
    lab: bool
    layout: Layout


def train_config(pred: Prediction, cloud: CloudConfig, preset: Optional[str], seq_len: int,
                 model_name: str = "") -> PlannedRun:
    """The run that trains the layout of ``pred`` on ``cloud``.

    Batch: ``batch_size`` is sequences per micro-batch per worker and ``grad_accum`` micro-batches per step; under
    pp the pipeline's micro-batches replace accumulation, so ``batch_size`` is the rank's whole batch and the
    layout's ``microbatches`` splits it. Recomputation: syncwise has full block recomputation
    (``activation_checkpointing``); selective maps to off (its fused attention keeps no s² activations, which is
    what selective recomputation drops)."""
    lay = pred.layout
    if lay.zero1:
        raise ConfigError("--emit-config", lay.text(), "a syncwise layout (zero1 is not one: syncwise shards "
                          "optimizer state only with FSDP2, dp_shard)")
    lab = cloud.inter_node.kind == "lab" or cloud.accelerator.name == "cpu-lab"
    pipeline = lay.pp > 1
    return PlannedRun(preset=preset or model_name or "?", seq_len=seq_len,
                      batch_size=pred.micro_batch * (pred.microbatches if pipeline else 1),
                      grad_accum=1 if pipeline else pred.microbatches,
                      activation_checkpointing=lay.recompute == "full", nproc=cloud.gpus_per_node,
                      nnodes="1" if lab else str(cloud.nodes), lab=lab,
                      layout=dataclasses.replace(lay, microbatches=pred.microbatches if pipeline else 0))


def header(pred: Prediction, cloud: CloudConfig, preset: Optional[str], model_name: str = "") -> str:
    """The emitted file's comment: the prediction, how to launch it, and what the file cannot do."""
    lay = pred.layout
    launch = ("syncwise cluster up --nodes {n} --procs-per-node {g} ...; syncwise train --config FILE"
              .format(n=cloud.nodes, g=cloud.gpus_per_node) if cloud.inter_node.kind == "lab" else
              "syncwise train --config FILE" if cloud.nodes == 1 else
              f"on each of the {cloud.nodes} nodes: torchrun --nnodes {cloud.nodes} --nproc-per-node "
              f"{cloud.gpus_per_node} ... -m syncwise.commands.worker --config FILE (see docs/plan.md)")
    text = (f"syncwise plan: {lay.text()} on {cloud.describe()}\n"
            f"predicted step {pred.step_time_s:.4g} s, {pred.tokens_per_s:,.0f} tokens/s, MFU {pred.mfu:.1%}, "
            f"{pred.memory_gb_per_gpu:.1f} GiB per GPU\nrun: {launch}")
    if not preset:
        text += f"\n{not_a_preset(model_name)}"
    if lay.recompute == "selective":
        text += "\nselective recomputation: syncwise's fused attention keeps no s² activations (= off here)"
    return text


def not_a_preset(model_name: str) -> str:
    """The plain words for a planned model that ``syncwise train`` cannot build."""
    return (f"model {model_name or '?'} is not a syncwise preset: syncwise train refuses this file (model.preset) "
            "until [model] preset names a syncwise preset or hf:FOLDER (a Hugging Face model folder; data parallel "
            "only, see docs/integrations.md); the layout above is the plan for that model")
