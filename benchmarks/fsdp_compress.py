"""Quantized FSDP2 collectives (issue 40): how much sooner than fp32 FSDP2 does a sharded run reach its loss?

benchmarks/time_to_loss.py's method with fp32 **FSDP2** (``parallel.dp_shard`` = every worker, one replica) as the
baseline instead of fp32 DDP: the baseline trains ``--steps`` N steps, its target is the mean of its last
``--last-evals`` validation losses; every other configuration trains up to ``--cap`` steps and the step, wall-clock
time and tokens at which its validation loss first reaches the target are interpolated between the evaluations
that bracket it. Reported per configuration: time and tokens to target, the validation-loss gap at matched tokens
(N steps), 'fsdp' bytes per step (``comm_bytes_per_step``: FSDP2's gathers and reduce-scatters as they go on the
wire), peak memory per rank, and the ratios against the baseline and against the best peer, formed within a round
and averaged over ``--repeats`` rounds (forward / reverse order alternately).

Configurations (name → ``--compress`` and ``[parallel]`` settings; every one also has dp_shard = all workers):

- ours: ``qgZ`` (int8 reduce-scatter), ``qwZ`` (int8 weight gather), ``hpZ`` (fsdp_reshard=node), ``qgZ+qwZ``,
  ``qgZ+qwZ+hpZ``, ``qgZ-int4+qwZ+hpZ`` (int8:levels=7: two codes per byte), ``fp8-qgZ+qwZ+hpZ``;
- peers: ``torch-fsdp2-bf16`` (PyTorch's MixedPrecisionPolicy reduce_dtype=bf16: ``--compress bf16``) and
  ``hsdp-fp8`` (the layout a user would pick instead: dp_shard inside a node, dp_replicate across nodes, syncwise's
  fp8 across the replicas).

The issue's goals, to read off the table: ≥ 3.5× fewer cross-node bytes than fp32 FSDP2 for qgZ+qwZ+hpZ, ≥ 2× sooner
to its loss, within 1 % of its validation loss at matched tokens, sooner than every peer. Meant for the network lab
(``--lab RATE``, 2 nodes × 2 workers, a link where fp32 FSDP2 runs at ≤ 0.5 parallel efficiency) on a quiet machine:

    python benchmarks/fsdp_compress.py --dry-run                    # validate every configuration, run nothing
    python benchmarks/fsdp_compress.py --lab 200mbit --nproc 2 --preset small --steps 600 --cap 1200 --repeats 3

On 2 nodes × 2 the quantized reduce-scatter is hierarchical under ``dist.hierarchical=auto`` (fp32 inside the node,
int8 across; ``--set dist.hierarchical=off`` for the flat one), and the rows' cross-node bytes are split per hop
(``hop_bytes_cross``: FSDP2's rings count N_g / W of their bytes across, its all-to-alls their chunks for other
nodes; before that split FSDP2's bytes had no hop and the "cross B/token" column read 0). The run below predates
both.

Run once so far, small (RESULTS.md §3, results/fsdp-compress-tiny-50mbit.json):

    python benchmarks/fsdp_compress.py --lab 50mbit --nproc 2 --preset tiny --steps 150 --cap 300 --val-interval 15 \
        --configs qgZ,qgZ+qwZ,qgZ+qwZ+hpZ --peers torch-fsdp2-bf16,hsdp-fp8
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import time_to_loss as T  # noqa: E402
from syncwise.commands import bench as B  # noqa: E402
from syncwise.errors import ConfigError, SyncwiseError  # noqa: E402
from syncwise.rundir import RunDir  # noqa: E402

BASELINE_NAME = "fp32-fsdp2"
#: name -> (compress.method, {[parallel] field: value}); dp_shard (and dp_replicate) are filled in per job
CONFIGS: dict[str, tuple[str, dict[str, str]]] = {
    "qgZ": ("int8", {}),
    "qwZ": ("none", {"fsdp_gather": "int8"}),
    "hpZ": ("none", {"fsdp_reshard": "node"}),
    "qgZ+qwZ": ("int8", {"fsdp_gather": "int8"}),
    "qgZ+qwZ+hpZ": ("int8", {"fsdp_gather": "int8", "fsdp_reshard": "node"}),
    "qgZ-int4+qwZ+hpZ": ("int8:levels=7", {"fsdp_gather": "int8", "fsdp_reshard": "node"}),
    "fp8-qgZ+qwZ+hpZ": ("fp8", {"fsdp_gather": "fp8", "fsdp_reshard": "node"}),
}
PEERS: dict[str, tuple[str, dict[str, str]]] = {
    "torch-fsdp2-bf16": ("bf16", {}),
    "hsdp-fp8": ("fp8", {"hsdp": "1"}),
}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--cap", type=int, default=None)
    ap.add_argument("--val-interval", type=int, default=20)
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--last-evals", type=int, default=3)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="names from CONFIGS")
    ap.add_argument("--peers", default=",".join(PEERS), help="names from PEERS")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--lab", metavar="RATE", default=None)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--lab-prefix", default=None)
    ap.add_argument("--nproc", type=int, default=None, help="workers per node with --lab (default 2), else local")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="build and validate every run's config, run nothing")
    args = ap.parse_args(argv)
    args.cap = args.cap if args.cap is not None else 2 * args.steps
    if args.nproc is None:
        args.nproc = 2
    for name in args.configs.split(","):
        if name not in CONFIGS:
            raise ConfigError("configs", name, "names from: " + ", ".join(CONFIGS))
    for name in [n for n in args.peers.split(",") if n]:
        if name not in PEERS:
            raise ConfigError("peers", name, "names from: " + ", ".join(PEERS))
    return args


def _variant(base: B.BenchRun, name: str, compress: str, parallel: dict[str, str], steps: int, where: Path,
             world: int, per_node: int) -> B.BenchRun:
    """The baseline's config with this configuration's compressor and [parallel] fields, checked by the layout's
    owner for this world (the same rules as `syncwise train --check`)."""
    from syncwise.config import run_layout

    cfg = copy.deepcopy(base.cfg)
    cfg.compress.method = compress
    cfg.run_dir, cfg.train.steps = str(where / B._slug(name)), steps
    fields = dict(parallel)
    if fields.pop("hsdp", None):
        cfg.parallel.dp_shard, cfg.parallel.dp_replicate = per_node, world // per_node
    else:
        cfg.parallel.dp_shard, cfg.parallel.dp_replicate = world, 1
    for k, v in fields.items():
        setattr(cfg.parallel, k, v)
    run_layout(cfg).check(world)
    return B.BenchRun(name, cfg)


def plan(args: argparse.Namespace, out_dir: Path) -> list[list[B.BenchRun]]:
    """Per round: compute-only, fp32 FSDP2 (N steps), every configuration and peer (cap steps)."""
    per_node = args.nproc
    world = per_node * (args.nodes if args.lab is not None else 1)
    rounds = []
    for r in range(args.repeats):
        where = out_dir / f"round{r + 1}"
        base = B.plan_runs(T._bench_ns(args, B.BASELINE, args.steps), where)
        fsdp = _variant(base[2], B.BASELINE, "none", {}, args.steps, where, world, per_node)
        fsdp.cfg.run_dir = str(where / BASELINE_NAME)
        runs = [base[0], B.BenchRun(B.BASELINE, fsdp.cfg)]  # named 'none': time_to_loss's baseline key
        for name in args.configs.split(","):
            runs.append(_variant(base[2], name, *CONFIGS[name], args.cap, where, world, per_node))
        for name in [n for n in args.peers.split(",") if n]:
            runs.append(_variant(base[2], name, *PEERS[name], args.cap, where, world, per_node))
        rounds.append(runs)
    return rounds


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir or Path("runs") / time.strftime("fsdp-compress-%Y%m%d-%H%M%S"))
    rounds = plan(args, out_dir)  # every ConfigError here, before a lab or a worker starts
    if args.dry_run:
        for run in rounds[0]:
            p = run.cfg.parallel
            print(f"{run.name:20s} compress={run.cfg.compress.method:14s} dp_shard={p.dp_shard} "
                  f"dp_replicate={p.dp_replicate} fsdp_gather={p.fsdp_gather} fsdp_reshard={p.fsdp_reshard} "
                  f"steps={run.cfg.train.steps}")
        return 0
    summaries: list[dict[str, dict]] = [{} for _ in rounds]
    errors: list[dict[str, str]] = [{} for _ in rounds]

    def go(threads: int) -> None:
        for k, runs in enumerate(rounds):
            for run in B.round_order(runs, k):
                print(f"round {k + 1}/{len(rounds)}: {run.name} ({run.cfg.train.steps} steps)", flush=True)
                try:
                    summaries[k][run.name] = B.run_one(run, threads, args.lab_prefix)
                except SyncwiseError as e:
                    errors[k][run.name] = str(e)
                    print(f"  failed: {e}", flush=True)

    out_dir.mkdir(parents=True, exist_ok=True)
    if args.lab is not None:
        from syncwise.lab.launch import omp_threads

        with B._Lab(args.nodes, args.lab, args.lab_prefix) as lab:
            bandwidth = lab.state.inter_node
            where = f"{lab.state.num_nodes} lab nodes × {args.nproc} at {bandwidth}"
            go(omp_threads(lab.state, args.nproc))
    else:
        from syncwise.launch.local import threads_per_worker

        bandwidth, where = "loopback", f"{args.nproc} local workers over loopback"
        go(threads_per_worker(args.nproc))

    targets, per_round = zip(*[T.round_rows(r, s, e, args, bandwidth, is_peer=PEERS.__contains__)
                               for r, s, e in zip(rounds, summaries, errors)])
    for rows in per_round:
        for row in rows:
            if row["name"] == B.BASELINE:
                row["name"] = BASELINE_NAME
            summary = RunDir(row["run_dir"]).summary  # the run's own record (a lab run_one returns the launch's)
            row["peak_mem_mb"] = json.loads(summary.read_text()).get("peak_mem_mb") if summary.exists() else None
    rows = T.combine(list(per_round))
    target = sum(targets) / len(targets)
    title = (("SMOKE (too short to rank anything): " if args.smoke else "") +
             f"time to fp32 FSDP2's loss: {args.preset}, N={args.steps}, cap {args.cap}, {where}, "
             f"{args.repeats} round(s)")
    T.render(rows, title, target, baseline="fp32 FSDP2")
    json_path = Path(args.json) if args.json else out_dir / "fsdp-compress.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    result = {"smoke": args.smoke, "title": title,
              "command": "python benchmarks/fsdp_compress.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "target_val_loss": target, "targets_per_round": list(targets), "where": where,
              "configs": {n: CONFIGS.get(n) or PEERS.get(n) for n in [*args.configs.split(","),
                                                                       *[p for p in args.peers.split(",") if p]]},
              "rows": rows}
    json_path.write_text(json.dumps(result, indent=2, default=T._nan_safe) + "\n")
    png = T.plot(rows, target, Path(args.plot) if args.plot else json_path.with_suffix(".png"), title)
    print(f"results: {json_path}" + (f"\nplot: {png}" if png else ""))
    return 1 if any(r.get("error") for rr in per_round for r in rr) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as e:
        print(f"fsdp_compress: {e}", file=sys.stderr)
        sys.exit(2)
