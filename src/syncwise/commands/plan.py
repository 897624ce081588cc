"""`syncwise plan`: which layout to use on a cluster, predicted before paying for it.

    syncwise plan --cluster examples/clusters/h100-8x4-ib.toml --model xl-dense --global-batch 256 --seq-len 1024
    syncwise plan ... --layout dp=4,tp=2,microbatch=2,recompute=full      # evaluate one layout
    syncwise plan ... --json rows.json --emit-config train.toml
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ..errors import ConfigError, SyncwiseError
from ..plan import (MEGATRON, SYNCWISE, explain, load_cluster, load_model, parse_layout, predict, search,
                    train_config_toml)
from ..plan.search import DEFAULT_COMPRESS, LABELS

_EPILOG = ("Predictions come from an analytical cost model (docs/plan.md lists every assumption); the catalog's "
           "efficiencies are assumptions to calibrate. By default only layouts syncwise can run are searched "
           "(ParallelSpec's rules); --any-layout searches the general space (e.g. tp × pp, ZeRO-1 excluded).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `syncwise plan`'s options on ``parser``."""
    parser.epilog = _EPILOG
    parser.add_argument("--cluster", required=True, help="cluster TOML (examples/clusters/*.toml)")
    parser.add_argument("--model", required=True, help="a syncwise preset, a Hugging Face config.json (or its "
                        "folder; read locally, nothing downloaded), or a model .toml")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--top", type=int, default=5, help="layouts to show (default 5)")
    parser.add_argument("--layout", default=None, help="evaluate one layout: dp=..,dp_shard=..,tp=..,pp=..,ep=..,"
                        "microbatch=..,recompute=none|selective|full[,schedule=..,v=..,compress=..,sync=..]")
    parser.add_argument("--compress", action="append", default=None, metavar="SPEC",
                        help="compressor(s) to consider (repeatable; default: " + ", ".join(DEFAULT_COMPRESS) + ")")
    parser.add_argument("--sync", action="append", default=None, metavar="SPEC",
                        help="sync strategies to consider (repeatable; default every-step), e.g. "
                             "localsgd:period=4 — they change the optimisation, so only when asked")
    parser.add_argument("--recipe", choices=("syncwise", "megatron"), default="syncwise",
                        help="bytes per parameter and overlap rules: syncwise train's (fp32 weights under "
                             "autocast) or Megatron-LM style mixed precision")
    parser.add_argument("--any-layout", action="store_true", help="also layouts syncwise cannot run yet")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the rows as JSON")
    parser.add_argument("--emit-config", default=None, metavar="FILE",
                        help="write the `syncwise train` TOML that runs the best layout")


def run(args: argparse.Namespace) -> int:
    cloud = load_cluster(args.cluster)
    model = load_model(args.model, args.seq_len)
    if args.global_batch < 1:
        raise ConfigError("--global-batch", args.global_batch, "a positive integer (sequences per step)")
    if args.top < 1:
        raise ConfigError("--top", args.top, "a positive integer")
    training = MEGATRON if args.recipe == "megatron" else SYNCWISE
    rules = not args.any_layout
    if args.layout:
        layout = parse_layout(args.layout, cloud.world_size)
        if args.compress:
            if len(args.compress) > 1:
                raise ConfigError("--compress", args.compress, "one compressor with --layout")
            layout = dataclasses.replace(layout, compress=args.compress[0])
        if args.sync:
            if len(args.sync) > 1:
                raise ConfigError("--sync", args.sync, "one sync strategy with --layout")
            layout = dataclasses.replace(layout, sync=args.sync[0])
        preds = [predict(cloud, model, layout, args.global_batch, args.seq_len, training=training,
                         syncwise_rules=True)]
    else:
        preds = search(cloud, model, args.global_batch, args.seq_len, top=args.top, training=training,
                       syncwise_rules=rules, compress=tuple(args.compress or DEFAULT_COMPRESS),
                       sync=tuple(args.sync or ("every-step",)))
        if not preds:
            raise SyncwiseError(f"syncwise plan: no layout of {model.name} fits {cloud.describe()} at global batch "
                                f"{args.global_batch} × {args.seq_len} tokens (memory per GPU "
                                f"{(cloud.accelerator.memory_bytes - cloud.accelerator.reserved_bytes) / 2**30:.1f} "
                                "GiB usable); try more nodes, a shorter sequence or --any-layout")
    _print(cloud, model, preds, args)
    if args.json:
        rows = [p.row() for p in preds]
        Path(args.json).write_text(json.dumps({"cluster": cloud.describe(), "model": model.describe(),
                                               "global_batch": args.global_batch, "seq_len": args.seq_len,
                                               "rows": rows}, indent=2) + "\n")
    if args.emit_config:
        best = preds[0]
        if best.runnable is False:
            raise ConfigError("--emit-config", args.emit_config, f"a layout syncwise can run; "
                              f"{best.layout.describe()} is not: {best.not_runnable}")
        preset = args.model if model.source == "syncwise preset" else None
        Path(args.emit_config).write_text(train_config_toml(best, cloud, preset, args.seq_len, model.name))
        print(f"wrote {args.emit_config}: syncwise train --config {args.emit_config}"
              + ("" if preset else " (add [model] preset: syncwise train builds presets only)"))
    return 0


def _print(cloud, model, preds, args) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, width=max(120, Console().width))
    title = (f"{model.describe()}\non {cloud.describe()}, global batch {args.global_batch} × {args.seq_len} tokens")
    table = Table(title=title, title_justify="left")
    for col in ("#", "layout", "step s", "tokens/s", "TFLOP/s/GPU", "MFU", "GiB/GPU", "dominant cost", "syncwise"):
        table.add_column(col, justify="left" if col in ("layout", "dominant cost", "syncwise") else "right",
                         overflow="fold")
    for i, p in enumerate(preds, 1):
        fits = f"{p.memory_gb_per_gpu:.1f}/{p.memory_limit_gb:.0f}" + ("" if p.fits else " ✗")
        share = p.breakdown[p.dominant] / p.step_time_s
        runs = "yes" if p.runnable else "no" if p.runnable is False else "-"
        table.add_row(str(i), p.layout.describe(), f"{p.step_time_s:.4g}", f"{p.tokens_per_s:,.0f}",
                      f"{p.tflops_per_gpu:.4g}", f"{p.mfu:.1%}", fits, f"{LABELS[p.dominant]} {share:.0%}", runs)
    console.print(table)
    if len(preds) == 1:
        p = preds[0]
        parts = ", ".join(f"{LABELS[k]} {v:.4g}" for k, v in p.breakdown.items() if v > 0)
        console.print(f"step (s): {parts}")
        console.print("memory (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in p.memory.items() if v > 0))
        if not p.fits:
            console.print(f"does not fit: {p.memory_gb_per_gpu:.1f} GiB > {p.memory_limit_gb:.1f} GiB usable")
        if p.runnable is False:
            console.print(f"syncwise cannot run it yet: {p.not_runnable}")
    else:
        console.print("why: " + explain(preds[0], preds[1]))
