"""`syncwise plan`: which layout to use on a cluster, predicted before paying for it.

    syncwise plan --cluster examples/clusters/h100-8x4-ib.toml --model xl-dense --global-batch 256 --seq-len 1024
    syncwise plan ... --layout dp=4,tp=2,microbatch=2,recompute=full      # evaluate one layout
    syncwise plan ... --json rows.json --emit-config train.toml
    syncwise plan --calibrate [--lab] [--out cluster.toml]             # measure this machine / the lab
    syncwise plan --strategy --cluster C --model M --global-batch B --seq-len S   # rank the sync strategies
    syncwise plan --convergence-from benchmarks/results/time-to-loss-X.json       # regenerate their table
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Optional

from ..errors import ConfigError, SyncwiseError
from ..plan import (MEGATRON, SYNCWISE, PlannedRun, explain, load_cluster, load_model, parse_layout, predict,
                    search, train_config, not_a_preset)
from ..plan.emit import header
from ..plan.search import DEFAULT_COMPRESS, LABELS, human_time, wrap_layout
from ..plan.uncertainty import QUANTILES, band_for, basis, describe

_EPILOG = ("Predictions come from an analytical cost model (docs/plan.md lists every assumption); the catalog's "
           "efficiencies are assumptions to calibrate. By default only layouts syncwise can run are searched "
           "(ParallelSpec's rules); --any-layout searches the general space (e.g. tp × pp, ZeRO-1 excluded).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `syncwise plan`'s options on ``parser``."""
    parser.epilog = _EPILOG
    parser.add_argument("--cluster", default=None, help="cluster TOML (examples/clusters/*.toml, or one "
                        "--calibrate wrote); required unless --calibrate")
    parser.add_argument("--model", default=None, help="a syncwise preset, a Hugging Face config.json (or its "
                        "folder; read locally, nothing downloaded), or a model .toml; required unless --calibrate")
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
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
    st = parser.add_argument_group("communication strategy (what --compress auto / --sync auto choose)")
    st.add_argument("--strategy", action="store_true", help="rank the communication strategies by predicted time to "
                    "fp32 DDP's loss: the planner's step time × the steps each needed in benchmarks/time_to_loss.py "
                    "(the convergence table); with --layout, on that layout's degrees")
    st.add_argument("--horizon", type=int, default=None, metavar="STEPS", help="with --strategy: the job's steps, "
                    "at which the convergence model predicts each strategy's steps to fp32 DDP's loss (default: the "
                    "model's reference horizon)")
    st.add_argument("--convergence-from", default=None, metavar="RESULTS.json", help="regenerate the convergence "
                    "table (syncwise/plan/convergence.json, or --out) from a benchmarks/time_to_loss.py results file")
    cal = parser.add_argument_group("calibration (--calibrate: measure, write a cluster TOML; about 10-60 s)")
    cal.add_argument("--calibrate", action="store_true",
                     help="measure this machine (or the network lab with --lab): GEMM FLOP/s over sizes, memory "
                          "bandwidth, a reference training step, each compressor's encode + decode, and comm-bench's "
                          "collectives (with --lab, the link's tbf bucket too); write a cluster TOML")
    cal.add_argument("--lab", action="store_true", help="with --calibrate: across the running network lab's nodes "
                     "(`syncwise cluster up` first)")
    cal.add_argument("--lab-prefix", default=None, help="the lab's name prefix (as `syncwise cluster --prefix`)")
    cal.add_argument("--nproc", type=int, default=None, help="workers (per node with --lab; default 2 locally, "
                     "the lab's procs_per_node with --lab)")
    cal.add_argument("--reference", default="small-dense:8:128", metavar="PRESET:BATCH:SEQ",
                     help="the reference training step that sets matmul_efficiency (default small-dense:8:128)")
    cal.add_argument("--iters", type=int, default=5, help="timed iterations per collective and size (default 5)")
    cal.add_argument("--out", default=None, metavar="FILE",
                     help="write the cluster TOML here (default: print it); the raw measurements go next to it "
                          "as FILE.json")


def _calibrate(args: argparse.Namespace) -> int:
    from ..plan.calibrate import calibrate, cloud_toml

    parts = args.reference.split(":")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit() or int(parts[1]) < 1 or int(parts[2]) < 2:
        raise ConfigError("--reference", args.reference, "PRESET:BATCH:SEQ, e.g. small-dense:8:128")
    load_model(parts[0], int(parts[2]))                 # an unknown preset fails here, before any worker starts
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError("--nproc", args.nproc, "an integer ≥ 1")
    if args.iters < 1:
        raise ConfigError("--iters", args.iters, "an integer ≥ 1")
    from ..launch.run import launch

    result = calibrate(lab=args.lab, prefix=args.lab_prefix, nproc=args.nproc,
                       reference=(parts[0], int(parts[1]), int(parts[2])), iters=args.iters, launcher=launch)
    command = "syncwise plan --calibrate" + (" --lab" if args.lab else "") + \
        (f" --lab-prefix {args.lab_prefix}" if args.lab_prefix else "") + (f" --nproc {args.nproc}" if args.nproc else "")
    text = cloud_toml(result, command)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        out.with_suffix(out.suffix + ".json").write_text(json.dumps(result, indent=1) + "\n")
        cloud = load_cluster(out)
        print(f"wrote {out} ({cloud.describe()}; raw measurements in {out}.json): "
              f"syncwise plan --cluster {out} --model ... --global-batch ... --seq-len ...")
    else:
        print(text, end="")
    return 0


def _strategy(args: argparse.Namespace, cloud, model, training) -> int:
    from ..layout import Layout as Owner
    from ..plan.strategy import basis_of, choose, explain, load_convergence, priced_fit, rank, render

    if args.compress or args.sync:
        raise ConfigError("--compress" if args.compress else "--sync", args.compress or args.sync,
                          "nothing with --strategy: it ranks every strategy of the convergence table")
    lay = parse_layout(args.layout, cloud.world_size) if args.layout else None
    owner = Owner(**({k: getattr(lay, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "ep")} if lay else {}),
                  compress="auto", sync="auto")
    table = load_convergence()
    horizon = getattr(args, "horizon", None)
    replicas = lay.dp_replicate * lay.dp_shard if lay else cloud.world_size
    ranked = rank(cloud, model, owner, args.global_batch, args.seq_len, table, training,
                  micro_batch=lay.micro_batch if lay else 0, microbatches=lay.microbatches if lay else 0,
                  horizon=horizon, replicas=replicas)
    unfit = priced_fit(cloud, model, owner, args.global_batch, args.seq_len, training,
                       micro_batch=lay.micro_batch if lay else 0, microbatches=lay.microbatches if lay else 0)
    if unfit:
        print(f"note: {unfit}" + ("" if lay else "; pass the layout you will run with --layout (`syncwise plan` "
                                  "without --strategy lists layouts that fit)"))
    render(ranked, cloud, table, f"{model.describe()}\non {cloud.describe()}, global batch {args.global_batch} × "
           f"{args.seq_len} tokens: time to fp32 DDP's loss, best first", horizon=horizon, replicas=replicas)
    print(explain(ranked, cloud, table, horizon=horizon, replicas=replicas) if any(not r.why_not for r in ranked)
          else "no candidate can run here")
    if args.json:
        Path(args.json).write_text(json.dumps({"cluster": cloud.describe(), "model": model.describe(),
                                               "convergence_model": table.source, "horizon": horizon or table.h_ref,
                                               "replicas": replicas, "chosen": choose(ranked).spec,
                                               "basis": basis_of(cloud).words(),
                                               "does_not_fit": unfit or None,
                                               "rows": [{"spec": r.spec, "step_time_s": r.step_time_s,
                                                         "steps_ratio": r.steps_ratio,
                                                         "steps_band": [r.steps_low, r.steps_high],
                                                         "time_ratio": r.time_ratio,
                                                         "sooner_band": basis_of(cloud).band(r) if r.sooner else None,
                                                         "not_a_candidate": r.why_not} for r in ranked]},
                                              indent=2) + "\n")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _calibrate(args)
    if args.convergence_from:
        from ..plan.strategy import write_table

        print(f"wrote {write_table(args.convergence_from, args.out)}")
        return 0
    if args.lab:
        raise ConfigError("--lab", True, "only with --calibrate")
    for flag, value in (("--cluster", args.cluster), ("--model", args.model), ("--global-batch", args.global_batch),
                        ("--seq-len", args.seq_len)):
        if value is None:
            raise ConfigError(flag, None, "a value (required unless --calibrate)")
    cloud = load_cluster(args.cluster)
    model = load_model(args.model, args.seq_len)
    if args.global_batch < 1:
        raise ConfigError("--global-batch", args.global_batch, "a positive integer (sequences per step)")
    if args.top < 1:
        raise ConfigError("--top", args.top, "a positive integer")
    training = MEGATRON if args.recipe == "megatron" else SYNCWISE
    if args.strategy:
        return _strategy(args, cloud, model, training)
    from ..layout import names_auto

    for flag, values in (("--compress", args.compress or []), ("--sync", args.sync or [])):
        if any(names_auto(v) for v in values):
            raise ConfigError(flag, "auto", "a spec; to see what auto would choose here: syncwise plan --strategy")
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
        b = band_for(cloud)
        Path(args.json).write_text(json.dumps({"cluster": cloud.describe(), "model": model.describe(),
                                               "global_batch": args.global_batch, "seq_len": args.seq_len,
                                               "basis": basis(cloud),
                                               "band": {"regime": b.regime, "measured_over_predicted": [b.lo, b.hi],
                                                        "quantiles": list(QUANTILES), "runs": b.runs},
                                               "rows": rows}, indent=2) + "\n")
    if args.emit_config:
        best = preds[0]
        if best.runnable is False:
            raise ConfigError("--emit-config", args.emit_config, f"a layout syncwise can run; "
                              f"{best.layout.text()} is not: {best.not_runnable}")
        preset = args.model if model.source == "syncwise preset" else None
        Path(args.emit_config).write_text(emit_config(best, cloud, preset, args.seq_len, model.name))
        print(f"wrote {args.emit_config}: syncwise train --config {args.emit_config}"
              + ("" if preset else f"\nnote: {not_a_preset(model.name)}"))
    return 0


def planned_config(run: PlannedRun) -> tuple[Any, list[str]]:
    """The ``syncwise train`` configuration (a ``config.RunConfig``) that runs a planned layout, and the keys the plan
    sets ('section.field'): what ``--emit-config`` writes. Every key is a field of config's sections (their
    constructors refuse any other name); ``[parallel]`` is the whole layout, each of ParallelSection's fields read
    off the Layout's field of the same name (the specs as their text)."""
    from .. import config

    lay = run.layout
    parallel = {f.name: lay.sync_text if f.name == "sync" else getattr(lay, f.name)
                for f in dataclasses.fields(config.ParallelSection)}
    given = {config.ModelSection: dict(preset=run.preset),
             config.DataSection: dict(seq_len=run.seq_len, batch_size=run.batch_size),
             config.TrainSection: dict(grad_accum=run.grad_accum, activation_checkpointing=run.activation_checkpointing),
             config.DistSection: dict(nproc=run.nproc, nnodes=run.nnodes, lab=run.lab),
             config.ParallelSection: parallel,
             config.CompressSection: dict(method=lay.compress.text)}
    section_of = {kind: name for name, kind in config._sections().items()}
    cfg = config.RunConfig(**{section_of[kind]: kind(**values) for kind, values in given.items()})
    return cfg, [f"{section_of[kind]}.{key}" for kind, values in given.items() for key in values]


def emit_config(pred: Any, cloud: Any, preset: Optional[str], seq_len: int, model_name: str = "") -> str:
    """``--emit-config``'s TOML: the planned run (``plan.emit.train_config``) in config's sections, written by
    ``config.format_config`` (key names from the fields), under a header naming the prediction and how to run it."""
    from ..config import format_config

    cfg, keys = planned_config(train_config(pred, cloud, preset, seq_len, model_name))
    return format_config(cfg, keys, header(pred, cloud, preset, model_name)) + "\n"


def _print(cloud, model, preds, args) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, width=max(120, Console().width))
    title = (f"{model.describe()}\non {cloud.describe()}, global batch {args.global_batch} × {args.seq_len} tokens")
    table = Table(title=title, title_justify="left")
    for col in ("#", "layout", "step", "tokens/s", "TFLOP/s/GPU", "MFU", "GiB/GPU", "dominant cost", "syncwise"):
        table.add_column(col, justify="left" if col in ("layout", "dominant cost", "syncwise") else "right",
                         overflow="fold")
    for i, p in enumerate(preds, 1):
        fits = f"{p.memory_gb_per_gpu:.1f}/{p.memory_limit_gb:.0f}" + ("" if p.fits else " ✗")
        share = p.breakdown[p.dominant] / p.step_time_s
        runs = "yes" if p.runnable else "no" if p.runnable is False else "-"
        table.add_row(str(i), wrap_layout(p.layout.text()), human_time(p.step_time_s), f"{p.tokens_per_s:,.0f}",
                      f"{p.tflops_per_gpu:.4g}", f"{p.mfu:.1%}", fits, f"{LABELS[p.dominant]} {share:.0%}", runs)
    console.print(table)
    console.print(("#1 " if len(preds) > 1 else "") + describe(preds[0].step_time_s, preds[0].mfu, cloud))
    if len(preds) == 1:
        p = preds[0]
        parts = ", ".join(f"{LABELS[k]} {human_time(v)}" for k, v in p.breakdown.items() if v > 0)
        console.print(f"step: {parts}")
        console.print("memory (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in p.memory.items() if v > 0))
        hops = p.info.get("fsdp_bytes_per_step")
        if hops:  # as the run's summary counts them (hop_bytes_per_step_cross / _intra), FSDP2's share
            from ..metrics.units import human_bytes
            console.print(f"FSDP2 bytes per rank per step: {human_bytes(hops['cross'])} across nodes, "
                          f"{human_bytes(hops['intra'])} inside a node")
        if not p.fits:
            console.print(f"does not fit: {p.memory_gb_per_gpu:.1f} GiB > {p.memory_limit_gb:.1f} GiB usable")
        if p.runnable is False:
            console.print(f"syncwise cannot run it yet: {p.not_runnable}")
    else:
        console.print("why: " + explain(preds[0], preds[1]))
