"""The ``syncwise train`` configuration (TOML, the ``--config`` format of syncwise.config) that runs a layout.

The planner sits below the config layer, so the file is written here as plain tables with the config's
section and key names; tests/test_plan.py loads it back with ``syncwise.config.load_file`` + ``build_config``.
"""
from __future__ import annotations

from typing import Any, Optional

from ..errors import ConfigError
from .cloud import CloudConfig
from .cost import Prediction


def train_config(pred: Prediction, cloud: CloudConfig, preset: Optional[str], seq_len: int,
                 model_name: str = "") -> dict[str, Any]:
    """``[section] key = value`` tables for ``syncwise train --config``: the layout of ``pred`` on ``cloud``.

    Batch: ``data.batch_size`` is sequences per micro-batch per worker and ``train.grad_accum`` micro-batches
    per step; under pp the pipeline's micro-batches replace accumulation, so ``data.batch_size`` is the rank's
    whole batch and ``parallel.microbatches`` splits it. Recomputation: syncwise has full block
    recomputation (``train.activation_checkpointing``); selective maps to off (its fused attention keeps no
    s² activations, which is what selective recomputation drops)."""
    lay = pred.layout
    if lay.zero1:
        raise ConfigError("--emit-config", lay.text(), "a syncwise layout (zero1 is not one: syncwise shards "
                          "optimizer state only with FSDP2, dp_shard)")
    lab = cloud.inter_node.kind == "lab" or cloud.accelerator.name == "cpu-lab"
    pipeline = lay.pp > 1
    values: dict[str, Any] = {
        # Not a preset: the model's own name, which syncwise train refuses in plain words (never the default preset).
        "model": {"preset": preset or model_name or "?"},
        "data": {"seq_len": seq_len, "batch_size": pred.micro_batch * (pred.microbatches if pipeline else 1)},
        "train": {"grad_accum": 1 if pipeline else pred.microbatches,
                  "activation_checkpointing": lay.recompute == "full"},
        "dist": {"nproc": cloud.gpus_per_node, "nnodes": "1" if lab else str(cloud.nodes), "lab": lab},
        "parallel": {"dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "tp": lay.tp, "pp": lay.pp,
                     "pp_schedule": lay.pp_schedule, "microbatches": pred.microbatches if pipeline else 0,
                     "stages_per_rank": lay.stages_per_rank, "ep": lay.ep, "ep_dispatch": lay.ep_dispatch,
                     "sync": lay.sync_text},
        "compress": {"method": lay.compress.text},
    }
    return values


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(c if c >= " " else f"\\u{ord(c):04X}" for c in s) + '"'


def to_toml(values: dict[str, Any], header: str = "") -> str:
    """``{section: {key: value}}`` as TOML (strings, numbers and booleans only)."""
    lines = [f"# {line}" for line in header.splitlines()]
    for section, table in values.items():
        lines += ["", f"[{section}]"] + [f"{k} = {_value(v)}" for k, v in table.items()]
    return "\n".join(lines).lstrip("\n") + "\n"


def train_config_toml(pred: Prediction, cloud: CloudConfig, preset: Optional[str], seq_len: int,
                      model_name: str = "") -> str:
    """The TOML text of :func:`train_config`, with a header naming the prediction and how to launch it."""
    lay = pred.layout
    launch = ("syncwise cluster up --nodes {n} --procs-per-node {g} ...; syncwise train --config FILE"
              .format(n=cloud.nodes, g=cloud.gpus_per_node) if cloud.inter_node.kind == "lab" else
              "syncwise train --config FILE" if cloud.nodes == 1 else
              f"on each of the {cloud.nodes} nodes: torchrun --nnodes {cloud.nodes} --nproc-per-node "
              f"{cloud.gpus_per_node} ... -m syncwise.commands.worker --config FILE (see docs/plan.md)")
    header = (f"syncwise plan: {lay.text()} on {cloud.describe()}\n"
              f"predicted step {pred.step_time_s:.4g} s, {pred.tokens_per_s:,.0f} tokens/s, MFU {pred.mfu:.1%}, "
              f"{pred.memory_gb_per_gpu:.1f} GiB per GPU\nrun: {launch}")
    if not preset:
        header += f"\n{not_a_preset(model_name)}"
    if lay.recompute == "selective":
        header += "\nselective recomputation: syncwise's fused attention keeps no s² activations (= off here)"
    return to_toml(train_config(pred, cloud, preset, seq_len, model_name), header)


def not_a_preset(model_name: str) -> str:
    """The plain words for a planned model that ``syncwise train`` cannot build."""
    return (f"model {model_name or '?'} is not a syncwise preset: syncwise train refuses this file (model.preset) "
            "until [model] preset names a syncwise preset or hf:FOLDER (a Hugging Face model folder; data parallel "
            "only, see docs/integrations.md); the layout above is the plan for that model")
