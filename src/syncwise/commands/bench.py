"""`syncwise bench`: the seeds' "baseline vs optimized" table, measured for real.

Trains the same model from the same seed for the same number of steps once per configuration —
fp32 DDP (``none``), PyTorch's own fp16 and PowerSGD hooks, and syncwise's compressors — on local
workers or across the network lab, plus one compute-only run (1 worker, no communication, same
per-worker batch and threads) that defines parallel efficiency = compute-only step time / step time.
Each run is an ordinary `syncwise train` run whose directory is kept under ``--out-dir``; the table
is built from their ``summary.json`` and the loss-vs-wall-clock PNG from their ``metrics.jsonl``.
``--repeat N`` runs the whole set N times, alternating forward and reverse order (the machine's speed
drifts by several per cent over minutes), and reports each configuration's mean with every round's values.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..config import RunConfig, build_config
from ..errors import ConfigError, SyncwiseError
from ..metrics.figures import fewer_bytes
from ..layout import names_torch_hook
from ..parallel.sync_spec import METHODS as SYNC_METHODS
from ..rundir import RunDir
from ..specs import spec_name
from .console import output_to

COMPUTE_ONLY = "compute-only"
# N independent compute-only workers at once (N = all workers of the distributed runs): the lab's nodes share
# this host's cores, so this reference shows how much of a step's slowdown is CPU sharing, not communication.
COMPUTE_SHARED = "compute-only-shared"
BASELINE = "none"
#: the default side-by-side set: baseline, PyTorch's hooks, then every syncwise compressor
DEFAULT_CONFIGS = ("none", "torch-fp16", "torch-powersgd:rank=4", "fp16", "bf16", "fp8", "int8", "sign",
                   "topk:ratio=0.01", "randomk:ratio=0.01", "powersgd:rank=4")
DEFAULT_LAB_BANDWIDTH = "200mbit"
DEFAULT_STEPS = 30
# Keys the bench sets itself per run; --set may not override them.
_BENCH_KEYS = ("run_dir", "resume", "compress.method", "parallel.sync", "dist.nproc", "dist.lab", "model.preset",
               "train.steps")
# torch's powerSGD_hook aborts on gloo with more than one DDP bucket (FIELD-NOTES): give it one.
TORCH_POWERSGD_BUCKET_MB = 1000.0
# Parallel efficiency of a real (non-compute-only) run is in (0, ~1]; the factor 5,000 is the lab's
# measured CPU-vs-H100 slowdown (docs/network-lab.md) used to name the equivalent real link.
LAB_SLOWDOWN = 5000.0
MAX_REPEAT = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register bench's options on ``parser``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--lab", action="store_true",
                        help="run across the network lab (uses the running lab, reshaped to --bandwidth, or brings "
                             "one up with --nodes and takes it down afterwards)")
    parser.add_argument("--lab-prefix", default=None, help="name prefix of the lab to use (default: the default lab)")
    parser.add_argument("--nodes", type=int, default=2, help="lab nodes when the bench brings a lab up (default 2)")
    parser.add_argument("--bandwidth", default=None,
                        help=f"lab link rate, tc units (e.g. 100mbit, 1gbit); default: the running lab's rate, or "
                             f"{DEFAULT_LAB_BANDWIDTH} for a new lab")
    parser.add_argument("--nproc", type=int, default=None,
                        help="workers (per node with --lab; default 1 per node with --lab, 2 locally)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps per run (default {DEFAULT_STEPS})")
    parser.add_argument("--preset", default="small", help="model preset (default small)")
    parser.add_argument("--configs", default=None,
                        help="comma list of compress specs (or --sync specs: localsgd:..., diloco:..., "
                             "torch-localsgd:..., pipesgd) to compare (default: " + ",".join(DEFAULT_CONFIGS) +
                             f"); options after a spec's ':' continue it, e.g. topk:ratio=0.01,momentum=0.9. "
                             f"'{COMPUTE_ONLY}' and '{COMPUTE_SHARED}' always run (they define parallel efficiency)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run, e.g. --set train.val_batches=8 --set "
                             "dist.bucket_cap_mb=4 (repeatable; see `syncwise train --help`)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run every configuration N times, in forward then reverse order, alternately, so a "
                             "slow drift of the machine's speed cancels; each row then holds the mean and every "
                             "round's values, each round's efficiency against that round's compute-only run "
                             "(default 1)")
    parser.add_argument("--json", default=None, help="write the rows here (default: OUT_DIR/bench.json)")
    parser.add_argument("--plot", default=None, help="loss-vs-wall-clock PNG (default: next to the JSON, .png)")
    parser.add_argument("--out-dir", default=None, help="one run directory per configuration is kept here, under "
                                                        "roundN/ with --repeat (default: runs/bench-DATE-TIME)")
    parser.epilog = ("Columns: parallel efficiency = compute-only step time / step time (same per-worker batch and\n"
                     "threads); ratio = fp32 bytes per step / bytes per step; Δval = final validation loss relative\n"
                     "to fp32 DDP at equal steps.")


# ------------------------------------------------------------------------------------------- planning


@dataclass
class BenchRun:
    """One configuration of the bench: its name, its validated RunConfig and where it runs."""

    name: str
    cfg: RunConfig
    copies: int = 1  # COMPUTE_SHARED: independent single-worker runs started at the same time

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)


def split_configs(text: str) -> list[str]:
    """Split a ``--configs`` list: a comma item of the form ``key=value`` continues the previous spec's options."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError("configs", text, "a comma list of compress specs, e.g. none,torch-fp16,powersgd:rank=4")
    specs: list[str] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if "=" in item and ":" not in item and specs and ":" in specs[-1]:
            specs[-1] += "," + item
        else:
            specs.append(item)
    if not specs:
        raise ConfigError("configs", text, "at least one compress spec")
    dupes = sorted({s for s in specs if specs.count(s) > 1})
    if dupes:
        raise ConfigError("configs", text, f"each configuration once (repeated: {', '.join(dupes)})")
    return specs


def _parse_sets(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip().lstrip("-")
        if not eq or not key:
            raise ConfigError("set", item, "KEY=VALUE, e.g. train.val_batches=8")
        if key in _BENCH_KEYS:
            raise ConfigError("set", item, "any config key except " + ", ".join(_BENCH_KEYS) +
                              " (bench sets those; use --steps, --preset, --nproc, --configs)")
        out[key] = value
    return out


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", name).strip("_") or "run"


def plan_runs(args: argparse.Namespace, out_dir: Path) -> list[BenchRun]:
    """Validate every option and build one RunConfig per configuration; raises ConfigError before anything runs."""
    if isinstance(args.steps, bool) or not isinstance(args.steps, int) or args.steps < 1:
        raise ConfigError("steps", args.steps, "a positive integer")
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError("nproc", args.nproc, "an integer >= 1")
    if args.lab:
        from ..lab.cluster import MAX_NODES, _validate_prefix, parse_rate

        if not 2 <= args.nodes <= MAX_NODES:
            raise ConfigError("nodes", args.nodes, f"an integer 2..{MAX_NODES} (a bench needs at least 2 nodes)")
        if args.bandwidth is not None:
            parse_rate(args.bandwidth, "bandwidth")
        if args.lab_prefix is not None:
            _validate_prefix(args.lab_prefix)
    elif args.bandwidth is not None:
        raise ConfigError("bandwidth", args.bandwidth, "only together with --lab (local workers talk over loopback)")
    nproc = args.nproc or (1 if args.lab else 2)
    if not args.lab and nproc < 2:
        raise ConfigError("nproc", nproc, "an integer >= 2 for local workers (the bench compares communication)")
    specs = split_configs(args.configs) if args.configs else list(DEFAULT_CONFIGS)
    specs = [s for s in specs if s not in (COMPUTE_ONLY, COMPUTE_SHARED)]
    if not specs:
        raise ConfigError("configs", args.configs, f"at least one configuration besides {COMPUTE_ONLY}, e.g. none,fp16")
    # Checkpoints are not what a bench measures: only the final one (after the timed steps) unless --set says so.
    common = {"model.preset": args.preset, "train.steps": str(args.steps), "ckpt.interval": "0",
              **_parse_sets(args.sets)}
    runs = [BenchRun(name, build_config(None, {**common, "dist.nproc": "1", "dist.lab": "false",
                                               "compress.method": "none", "run_dir": str(out_dir / name)}))
            for name in (COMPUTE_ONLY, COMPUTE_SHARED)]
    workers = nproc * (args.nodes if args.lab else 1)
    for spec in specs:
        # A --sync spec (localsgd:..., diloco:..., pipesgd...) runs uncompressed; anything else is a compressor.
        is_sync = spec_name(spec) in SYNC_METHODS
        overrides = {**common, "dist.nproc": str(nproc), "dist.lab": str(bool(args.lab)).lower(),
                     "compress.method": "none" if is_sync else spec,
                     "parallel.sync": spec if is_sync else "every-step",
                     "run_dir": str(out_dir / _slug(spec))}
        if spec_name(spec) == "torch-powersgd":
            overrides["dist.bucket_cap_mb"] = str(TORCH_POWERSGD_BUCKET_MB)
        try:
            cfg = build_config(None, overrides)
        except ConfigError as e:
            if e.field.startswith("compress"):  # name the --configs item, not the config key
                raise ConfigError("configs", spec, e.accepted) from None
            raise
        runs.append(BenchRun(spec, cfg))
    runs[1].copies = workers
    slugs = [r.run_dir.name for r in runs]
    if len(set(slugs)) != len(slugs):
        raise ConfigError("configs", ",".join(specs), "configurations with distinct names")
    busy = [str(r.run_dir) for r in runs if RunDir(r.run_dir).metrics.exists() or
            RunDir(r.run_dir).summary.exists()]
    if busy:
        raise SyncwiseError(f"{busy[0]} already holds a run; nothing was started. Choose another --out-dir.")
    return runs


def plan_rounds(args: argparse.Namespace, out_dir: Path) -> list[list[BenchRun]]:
    """The runs of every round (``--repeat``): one plan, or one per ``out_dir/roundN``; validated up front."""
    repeat = getattr(args, "repeat", 1)
    if isinstance(repeat, bool) or not isinstance(repeat, int) or not 1 <= repeat <= MAX_REPEAT:
        raise ConfigError("repeat", repeat, f"an integer 1..{MAX_REPEAT}")
    if repeat == 1:
        return [plan_runs(args, out_dir)]
    return [plan_runs(args, out_dir / f"round{r}") for r in range(1, repeat + 1)]


def round_order(runs: list[BenchRun], round_index: int) -> list[BenchRun]:
    """Forward order in even-indexed rounds (0, 2, ...), reversed in odd ones: across a pair of rounds every
    configuration sits on average at the same point in time, so a linear drift of the machine's speed biases
    none of the ratios."""
    return list(runs) if round_index % 2 == 0 else list(reversed(runs))


# -------------------------------------------------------------------------------------------- running


def _launch_lab(cfg: RunConfig, prefix: Optional[str]) -> dict[str, Any]:
    from ..launch.run import Job, Worker, start
    from .train import worker_argv

    run_dir = Path(cfg.run_dir)
    logs = RunDir(run_dir).logs
    logs.mkdir(parents=True, exist_ok=True)
    # Node 0's output goes to a file too: the bench prints its own progress and table.
    with open(logs / "node0.console.log", "wb") as console:
        code = start(Job(nproc=cfg.dist.nproc, lab=True, lab_prefix=prefix, log_dir=str(logs), console=console),
                     Worker(argv=worker_argv(cfg))).codes[0]
    if code != 0:
        raise SyncwiseError(f"the lab job failed (exit code {code}); logs under {logs}")
    return json.loads(RunDir(run_dir).summary.read_text())


def _run_compute_only(cfg: RunConfig, threads: int) -> dict[str, Any]:
    """Run the 1-worker reference in this process with the distributed workers' thread count."""
    import torch

    from .train import launch

    old_threads, old_env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # init_distributed applies it
    torch.set_num_threads(threads)
    try:
        return launch(cfg)
    finally:
        torch.set_num_threads(old_threads)
        if old_env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old_env


def _run_compute_shared(run: BenchRun, threads: int) -> dict[str, Any]:
    """Start ``run.copies`` independent 1-worker runs at once (no process group: no communication)."""
    import copy

    from ..launch.run import Job, Worker, start
    from .train import worker_argv

    workers, dirs = [], []
    for i in range(run.copies):
        cfg = copy.deepcopy(run.cfg)
        cfg.run_dir = str(run.run_dir / f"worker{i}")
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        cfg.save(RunDir(cfg.run_dir).config)
        dirs.append(Path(cfg.run_dir))
        workers.append(Worker(argv=worker_argv(cfg), log=Path(cfg.run_dir) / "console.log"))
    codes = start(Job(copies=True, threads=threads), *workers).codes
    if any(codes):
        raise SyncwiseError(f"a compute-only worker failed (exit codes {codes}); see {run.run_dir}/worker*/console.log")
    summaries = [json.loads(RunDir(d).summary.read_text()) for d in dirs]
    summary = dict(summaries[0])
    # Every copy did the same work at the same time: their mean step time is the shared-CPU compute time.
    summary["mean_step_time_s"] = sum(x["mean_step_time_s"] for x in summaries) / len(summaries)
    summary["copies"] = run.copies
    RunDir(run.run_dir).summary.write_text(json.dumps(summary, indent=2) + "\n")
    # metrics.jsonl of the first copy, so the plot shows this reference too
    RunDir(run.run_dir).metrics.write_text(RunDir(dirs[0]).metrics.read_text())
    return summary


def run_one(run: BenchRun, threads: int, lab_prefix: Optional[str]) -> dict[str, Any]:
    """Train one configuration; return its summary (raises SyncwiseError if the workers failed). Its console
    output (progress, summary table) goes to ``RUN_DIR/console.log``."""
    from .train import prepare_run_dir

    prepare_run_dir(run.cfg)
    with output_to(run.run_dir / "console.log"):
        return _run_one(run, threads, lab_prefix)


def _run_one(run: BenchRun, threads: int, lab_prefix: Optional[str]) -> dict[str, Any]:
    from .train import launch

    if run.name == COMPUTE_ONLY:
        return _run_compute_only(run.cfg, threads)
    if run.name == COMPUTE_SHARED:
        return _run_compute_shared(run, threads)
    if run.cfg.dist.lab:
        return _launch_lab(run.cfg, lab_prefix)
    launch(run.cfg)
    return json.loads(RunDir(run.run_dir).summary.read_text())


class _Lab:
    """Use the running lab (reshaped to the bench's rate, restored afterwards) or bring one up and down."""

    def __init__(self, nodes: int, bandwidth: Optional[str], prefix: Optional[str]):
        self.nodes, self.bandwidth, self.prefix = nodes, bandwidth, prefix
        self.created, self.restore_rate = False, None
        self.state: Any = None

    def __enter__(self) -> "_Lab":
        from .. import lab
        from ..lab.cluster import parse_rate

        kw = {"prefix": self.prefix} if self.prefix else {}
        lab.check_supported()
        state = lab.status(**kw)
        if state is None:
            state = lab.up(self.nodes, self.bandwidth or DEFAULT_LAB_BANDWIDTH, **kw)
            self.created = True
        elif self.bandwidth is not None and parse_rate(self.bandwidth) != state.inter_node_bps:
            self.restore_rate = state.inter_node
            state = lab.shape(inter_node=self.bandwidth, **kw)
        self.state = state
        return self

    def __exit__(self, *exc: Any) -> None:
        from .. import lab

        kw = {"prefix": self.prefix} if self.prefix else {}
        if self.created:
            lab.down(**kw)
        elif self.restore_rate is not None:
            lab.shape(inter_node=self.restore_rate, **kw)


# ------------------------------------------------------------------------------------------- results


def equivalent_real_link(lab_bps: int, slowdown: float = LAB_SLOWDOWN) -> str:
    """The GPU-cluster link a lab rate stands for at the lab's compute slowdown (docs/network-lab.md)."""
    real = lab_bps * slowdown
    return f"{real / 1e12:g} Tbit/s" if real >= 1e12 else f"{real / 1e9:g} Gbit/s"


def build_rows(runs: list[BenchRun], summaries: dict[str, dict], errors: dict[str, str], bandwidth: str,
               fp32_bytes: Optional[float] = None) -> list[dict[str, Any]]:
    """One row per configuration, with ratios against the compute-only run and the fp32 DDP baseline."""
    compute = summaries.get(COMPUTE_ONLY, {}).get("mean_step_time_s")
    shared = summaries.get(COMPUTE_SHARED, {}).get("mean_step_time_s")
    base = summaries.get(BASELINE, {})
    if not base.get("comm_bytes_per_step") and fp32_bytes:
        base = {**base, "comm_bytes_per_step": fp32_bytes}
    rows = []
    for run in runs:
        s = summaries.get(run.name)
        row: dict[str, Any] = {"name": run.name, "compress": run.cfg.compress.method, "sync": run.cfg.parallel.sync,
                               "preset": run.cfg.model.preset,
                               "steps": run.cfg.train.steps,
                               "bandwidth": None if run.name in (COMPUTE_ONLY, COMPUTE_SHARED) else bandwidth,
                               "world_size": None, "run_dir": str(run.run_dir)}
        if s is None:
            row.update({k: None for k in ("steps_per_s", "parallel_efficiency", "comm_bytes_per_step",
                                          "hop_bytes_per_step_cross", "hop_bytes_per_step_intra",
                                          "compression_ratio", "ratio_on", "final_loss", "final_val_loss", "peak_mem_mb",
                                          "mean_step_time_s", "comm_exposed_share",
                                          "parallel_efficiency_shared_cpu")})
            row["error"] = errors.get(run.name, "not run")
            rows.append(row)
            continue
        t = s["mean_step_time_s"]
        reference = run.name in (COMPUTE_ONLY, COMPUTE_SHARED)
        nbytes = 0.0 if reference else s.get("comm_bytes_per_step")
        # "× fewer bytes" on the hop the slow link carries (metrics.figures.fewer_bytes): cross-node when both runs
        # span nodes
        ratio, ratio_on = (None, None) if reference else fewer_bytes(base, s)
        row.update({
            "world_size": s.get("world_size"),
            "steps_per_s": 1.0 / t if t else None,
            "mean_step_time_s": t,
            "parallel_efficiency": compute / t if compute and t else None,
            # vs N compute-only workers sharing the host's cores as the lab's nodes do
            "parallel_efficiency_shared_cpu": shared / t if shared and t else None,
            "comm_bytes_per_step": nbytes,
            "hop_bytes_per_step_cross": None if reference else s.get("hop_bytes_per_step_cross"),
            "hop_bytes_per_step_intra": None if reference else s.get("hop_bytes_per_step_intra"),
            "compression_ratio": ratio, "ratio_on": ratio_on,
            "final_loss": s.get("final_loss"),
            "final_val_loss": s.get("final_val_loss"),
            "peak_mem_mb": s.get("peak_mem_mb"),
            "comm_exposed_share": s.get("comm_exposed_share"),
            "warmup_steps": s.get("warmup_steps"),
            "warning": s.get("warning"),
            "error": None,
        })
        # The compute-only run trains 1 worker on a different data shard: no speed-up or loss parity vs fp32 DDP.
        if not reference:
            row.update({
                "speedup_vs_fp32": (base["mean_step_time_s"] / t) if base.get("mean_step_time_s") and t else None,
                "val_loss_vs_fp32": ((s["final_val_loss"] / base["final_val_loss"] - 1.0)
                                     if s.get("final_val_loss") and base.get("final_val_loss") else None),
            })
        else:
            row.update({"speedup_vs_fp32": None, "val_loss_vs_fp32": None})
        rows.append(row)
    return rows


#: per-round values each combined row lists under "rounds" (besides the run directory and any error)
ROUND_FIELDS = ("mean_step_time_s", "parallel_efficiency", "parallel_efficiency_shared_cpu", "speedup_vs_fp32",
                "comm_exposed_share", "final_loss", "final_val_loss", "val_loss_vs_fp32")
#: the measurements a combined row averages over the rounds that ran
MEAN_FIELDS = ROUND_FIELDS + ("comm_bytes_per_step", "hop_bytes_per_step_cross", "hop_bytes_per_step_intra",
                              "compression_ratio", "peak_mem_mb")


def combine_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per configuration from the rows of every round (``--repeat``).

    Every ratio was formed within its round (against that round's compute-only run and fp32 DDP run), so the
    mean of the paired ratios is what is reported, with each round's values under ``rounds`` and the
    efficiency's range in ``parallel_efficiency_min`` / ``_max``. A configuration that failed in some rounds
    keeps the others; its ``failed_rounds`` names the failures. ``steps_per_s`` is 1 / mean step time.
    """
    if len(rounds) == 1:
        return rounds[0]
    combined = []
    for per_round in zip(*rounds):
        ok = [r for r in per_round if not r.get("error")]
        row = dict(ok[0] if ok else per_round[0])
        row["repeats"] = len(per_round)
        row["rounds"] = [{"run_dir": r["run_dir"], "error": r.get("error"), **{k: r.get(k) for k in ROUND_FIELDS}}
                         for r in per_round]
        row["failed_rounds"] = [i + 1 for i, r in enumerate(per_round) if r.get("error")]
        if ok:
            row["error"] = None
            for key in MEAN_FIELDS:
                values = [r.get(key) for r in ok]
                row[key] = sum(values) / len(values) if all(isinstance(v, (int, float)) for v in values) else None
            t = row.get("mean_step_time_s")
            row["steps_per_s"] = 1.0 / t if t else None
            eff = [r["parallel_efficiency"] for r in ok if r.get("parallel_efficiency") is not None]
            row["parallel_efficiency_min"] = min(eff) if eff else None
            row["parallel_efficiency_max"] = max(eff) if eff else None
        combined.append(row)
    return combined


def _fmt(v: Any, spec: str, none: str = "–") -> str:
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def render_table(rows: list[dict[str, Any]], title: str, console: Any = None) -> None:
    """Print the rows as a rich table."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    on = sorted({r["ratio_on"] for r in rows if r.get("ratio_on")})
    table = Table(title=title, caption="efficiency = compute-only step (1 worker) / step; eff. shared CPU = the same "
                                       "with all N workers computing at once, no communication;\nMB/step = every "
                                       "hop, cross MB = between nodes only; ratio = fp32 DDP's bytes / the run's, on "
                                       f"{' / '.join(on) or 'cross-node bytes'}; Δval = final val loss vs fp32 DDP "
                                       "at equal steps")
    for col in ("config", "step ms", "steps/s", "efficiency", "eff. shared CPU", "MB/step", "cross MB", "ratio",
                "vs fp32", "loss", "val loss", "Δval", "exposed comm", "peak MB"):
        table.add_column(col, justify="left" if col == "config" else "right", no_wrap=True)
    for r in rows:
        if r.get("error"):
            table.add_row(r["name"], f"[red]failed: {r['error'][:60]}[/red]", *[""] * 12)
            continue
        mb = r["comm_bytes_per_step"]
        efficiency = _fmt(r["parallel_efficiency"], ".2f")
        if r.get("repeats", 1) > 1 and r.get("parallel_efficiency_min") is not None:
            efficiency += f" ({r['parallel_efficiency_min']:.2f}–{r['parallel_efficiency_max']:.2f})"
        table.add_row(
            r["name"], _fmt(r["mean_step_time_s"] and r["mean_step_time_s"] * 1e3, ".0f"), _fmt(r["steps_per_s"], ".2f"),
            efficiency, _fmt(r.get("parallel_efficiency_shared_cpu"), ".2f"),
            _fmt(None if mb is None else mb / 1e6, ".2f", "n/c"),
            _fmt(None if r.get("hop_bytes_per_step_cross") is None else r["hop_bytes_per_step_cross"] / 1e6, ".2f"),
            _fmt(r["compression_ratio"], ".1f"), _fmt(r.get("speedup_vs_fp32"), ".2f"), _fmt(r["final_loss"], ".4f"),
            _fmt(r["final_val_loss"], ".4f"),
            _fmt(None if r.get("val_loss_vs_fp32") is None else 100 * r["val_loss_vs_fp32"], "+.2f") +
            ("%" if r.get("val_loss_vs_fp32") is not None else ""),
            _fmt(None if r["comm_exposed_share"] is None else 100 * r["comm_exposed_share"], ".0f") +
            ("%" if r["comm_exposed_share"] is not None else ""),
            _fmt(r["peak_mem_mb"], ".0f"))
    console.print(table)
    for r in rows:
        if r.get("warning"):
            console.print(f"[yellow]warning[/yellow]: {r['name']}: {r['warning']}", soft_wrap=True)
    if any(r.get("comm_bytes_per_step") is None and not r.get("error") for r in rows):
        console.print("n/c: not counted — PyTorch's PowerSGD hook issues its collectives itself, bypassing syncwise.comm")


def write_plot(rows: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """PNG of loss against wall-clock time (cumulative step time from each run's metrics.jsonl)."""
    from ..extras import pyplot

    plt = pyplot("syncwise bench --plot")

    from ..metrics.logger import read_jsonl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for r in rows:
        metrics = read_jsonl(RunDir(r["run_dir"]).metrics)
        if r.get("error") or not metrics:
            continue
        t, clock, ema, smooth = [], 0.0, None, []
        for m in metrics:
            clock += m["step_time_s"]
            t.append(clock)
            # The per-step loss is noisy; an EMA keeps the curves readable without shifting them much.
            ema = m["loss"] if ema is None else 0.9 * ema + 0.1 * m["loss"]
            smooth.append(ema)
        style = "--" if r["name"] in (COMPUTE_ONLY, COMPUTE_SHARED) else ":" if names_torch_hook(r["name"]) else "-"
        line, = ax.plot(t, smooth, style, label=r["name"], linewidth=1.4)
        vt = [(tt, m["val_loss"]) for tt, m in zip(t, metrics) if m.get("val_loss") is not None]
        if vt:
            ax.plot([p[0] for p in vt], [p[1] for p in vt], "o", color=line.get_color(), markersize=4)
    ax.set_xlabel("wall-clock time (s, cumulative step time)")
    ax.set_ylabel("train loss (EMA 0.9); dots: validation loss")
    ax.set_title("\n".join(textwrap.wrap(title, 100)), fontsize=10)  # long lab titles would be clipped
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fp32_bytes(cfg: RunConfig) -> float:
    """Bytes per step of an fp32 all-reduce of every parameter (the baseline when `none` is not run)."""
    from ..data import load_corpus
    from ..models import build_model, count_params
    from ..models.hf import is_hf

    if is_hf(cfg.model.preset):  # a Hugging Face model folder (--preset hf:FOLDER), as the workers build it
        from ..models.hf_model import build_hf_model
        return 4.0 * count_params(build_hf_model(cfg.model.preset))
    corpus = load_corpus(cfg.data.corpus, val_fraction=cfg.data.val_fraction)
    model = build_model(cfg.model.preset, vocab_size=corpus.vocab_size, seq_len=cfg.data.seq_len)
    return 4.0 * count_params(model)


# ---------------------------------------------------------------------------------------------- main


def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Validate, run every configuration, write JSON and PNG; return the rows."""
    from rich.console import Console

    # Wide enough for the 12-column table even when the output is a file or a pipe.
    console = Console(width=max(Console().width, 190))
    out_dir = Path(args.out_dir or Path("runs") / datetime.datetime.now().strftime("bench-%Y%m%d-%H%M%S"))
    rounds = plan_rounds(args, out_dir)  # every ConfigError surfaces here, before a lab or a worker starts
    runs = rounds[0]
    json_path = Path(args.json) if args.json else out_dir / "bench.json"
    plot_path = Path(args.plot) if args.plot else json_path.with_suffix(".png")
    nproc = runs[-1].cfg.dist.nproc
    summaries: list[dict[str, dict]] = [{} for _ in rounds]
    errors: list[dict[str, str]] = [{} for _ in rounds]

    def go(threads: int) -> None:
        total = len(rounds) * len(runs)
        for k, round_runs in enumerate(rounds):
            for i, run in enumerate(round_order(round_runs, k), k * len(runs) + 1):
                where_round = f"round {k + 1}/{len(rounds)}, " if len(rounds) > 1 else ""
                head = f"bench {i}/{total}: {run.name} ({where_round}{run.run_dir})"
                console.print(head, end="", soft_wrap=True)
                try:
                    summary = summaries[k][run.name] = run_one(run, threads, args.lab_prefix)
                except SyncwiseError as e:  # one crashing configuration (e.g. torch's PowerSGD) must not sink the rest
                    errors[k][run.name] = str(e)
                    console.print(f": [red]failed[/red]: {e} (its output: {run.run_dir / 'console.log'})",
                                  soft_wrap=True)
                    if run.name == COMPUTE_ONLY:
                        raise
                    continue
                console.print(f": {summary['mean_step_time_s'] * 1e3:.0f} ms/step", soft_wrap=True)

    out_dir.mkdir(parents=True, exist_ok=True)
    if args.lab:
        from ..lab.launch import omp_threads

        with _Lab(args.nodes, args.bandwidth, args.lab_prefix) as lab_ctx:
            state = lab_ctx.state
            bandwidth = state.inter_node
            equiv = equivalent_real_link(state.inter_node_bps)
            where = f"{state.num_nodes} lab nodes × {nproc} at {bandwidth} (≈ {equiv} between GPU nodes at 5,000×)"
            for round_runs in rounds:  # a running lab may have another node count than --nodes
                round_runs[1].copies = state.num_nodes * nproc
            go(omp_threads(state, nproc))
    else:
        from ..launch.local import threads_per_worker

        bandwidth, where = "loopback", f"{nproc} local workers over loopback"
        go(threads_per_worker(nproc))

    fp32_bytes = None if all(BASELINE in s for s in summaries) else _fp32_bytes(runs[0].cfg)
    rows = combine_rounds([build_rows(r, s, e, bandwidth, fp32_bytes) for r, s, e in zip(rounds, summaries, errors)])
    title = f"syncwise bench: {runs[0].cfg.model.preset}, {args.steps} steps, {where}"
    if len(rounds) > 1:
        title += f"; mean of {len(rounds)} rounds (range), curves of each one's first completed round"
    render_table(rows, title, console)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(rows, indent=2) + "\n")
    console.print(f"rows: {json_path}")
    console.print(f"plot: {write_plot(rows, plot_path, title)}")
    console.print(f"run directories: {out_dir}")
    return rows


def run(args: argparse.Namespace) -> int:
    """`syncwise bench` entry point: 0 if every configuration ran, 1 if some failed (their rows say why)."""
    rows = bench(args)
    return 1 if any(r.get("error") for r in rows) else 0
