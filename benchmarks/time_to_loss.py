"""Time to target loss (issue 26): how much sooner does each strategy reach the loss fp32 DDP reaches?

fp32 DDP (``none``) trains ``--steps`` N steps; its target is the mean of its last ``--last-evals`` validation losses
(a fixed held-out set, evaluated every ``--val-interval`` steps). Every other configuration trains up to
``--cap`` steps, and the step, wall-clock time (the run's own cumulative step time, evaluations excluded) and tokens
at which its validation loss first reaches the target are interpolated linearly between the two evaluations that
bracket it (fp32 DDP's own crossing is measured the same way). The table reports time to target, tokens to target,
bytes per token (bytes this rank sent up to the target / tokens; cross-node: those between nodes only),
parallel efficiency (the bench's compute-only run /
mean step time) and the ratios against fp32 DDP and against the best peer (PyTorch's own hooks and averagers,
``torch-*``, and torchft's DiLoCo, ``torchft-diloco``), each formed within one round and averaged over
``--repeats`` rounds (forward then reverse order, alternately, as ``syncwise bench --repeat`` does). A
configuration that never reaches the target within the cap has no time; its row says so and gives its final
distance to the target.

Every run is an ordinary ``syncwise train`` run, planned and launched by ``syncwise bench``'s runner
(``syncwise.commands.bench``: the same configs, the lab, the compute-only reference). The learning rate is constant
after its warm-up (``train.min_lr_ratio=1``) unless ``--set`` says otherwise: runs of different lengths then share
one LR trajectory, so a strategy is not helped or hurt by a schedule stretched to the cap.

    python benchmarks/time_to_loss.py --preset tiny --steps 30 --cap 60 --val-interval 5 --smoke
    python benchmarks/time_to_loss.py --lab 60mbit --preset small --steps 1000 --cap 2000 --repeats 3

Writes ``--json`` (rows, per-round values, the target, the command) and a PNG of validation loss against
wall-clock time with the target drawn in. ``torchft-diloco[:period=H]`` runs torchft's DiLoCo (locally, or with
``--lab`` one replica per lab node; benchmarks/torchft_diloco.py says what it needs); its bytes are nominal (torchft's collectives bypass syncwise.comm).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from syncwise.commands import bench as B  # noqa: E402
from syncwise.errors import ConfigError, SyncwiseError  # noqa: E402
from syncwise.metrics.logger import read_jsonl  # noqa: E402

PEERS_DEFAULT = "torch-fp16,torch-powersgd:rank=4,torch-localsgd:period=16,torchft-diloco:period=16"
TORCHFT = "torchft-diloco"
OURS_DEFAULT = "fp8,demo,topk:ratio=0.01,warmup=20,diloco:period=16,sparseloco:period=16"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="fp32 DDP's steps N (default 200)")
    p.add_argument("--cap", type=int, default=None, help="step cap of the other configurations (default 2 N)")
    p.add_argument("--val-interval", type=int, default=10, help="evaluate every K steps (default 10)")
    p.add_argument("--val-batches", type=int, default=8, help="batches of the held-out set per evaluation (default 8)")
    p.add_argument("--last-evals", type=int, default=3, help="fp32 DDP evaluations averaged into the target (default 3)")
    p.add_argument("--preset", default="small", help="model preset (default small)")
    p.add_argument("--configs", default=OURS_DEFAULT, help=f"syncwise configurations (default {OURS_DEFAULT})")
    p.add_argument("--peers", default=PEERS_DEFAULT, help=f"peer configurations (default {PEERS_DEFAULT})")
    p.add_argument("--repeats", type=int, default=1, help="rounds, alternating forward / reverse order (default 1)")
    p.add_argument("--lab", metavar="RATE", default=None,
                   help="run across the network lab at this link rate (tc units, e.g. 60mbit); default: local workers")
    p.add_argument("--nodes", type=int, default=2, help="lab nodes (default 2)")
    p.add_argument("--lab-prefix", default=None, help="lab name prefix (default: the default lab)")
    p.add_argument("--nproc", type=int, default=None, help="workers (per node with --lab; default 2 locally, 1 per node)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run (repeatable)")
    p.add_argument("--out-dir", default=None, help="run directories (default runs/time-to-loss-DATE-TIME)")
    p.add_argument("--json", default=None, help="results file (default OUT_DIR/time-to-loss.json)")
    p.add_argument("--plot", default=None, help="loss-vs-wall-clock PNG (default: next to the JSON)")
    p.add_argument("--smoke", action="store_true", help="label the results a smoke test (too short to rank anything)")
    args = p.parse_args(argv)
    args.cap = args.cap if args.cap is not None else 2 * args.steps
    for name, lo in (("steps", 1), ("cap", 1), ("val_interval", 1), ("val_batches", 1), ("last_evals", 1),
                     ("repeats", 1)):
        v = getattr(args, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ConfigError(name.replace("_", "-"), v, f"an integer ≥ {lo}")
    if args.cap < args.steps:
        raise ConfigError("cap", args.cap, f"an integer ≥ --steps ({args.steps})")
    if args.repeats > B.MAX_REPEAT:
        raise ConfigError("repeats", args.repeats, f"an integer 1..{B.MAX_REPEAT}")
    if args.steps // args.val_interval < args.last_evals:
        raise ConfigError("last-evals", args.last_evals, f"at most steps / val-interval = "
                          f"{args.steps // args.val_interval} (fp32 DDP's evaluations)")
    return args


def _bench_ns(args: argparse.Namespace, configs: str, steps: int) -> argparse.Namespace:
    sets = [f"train.val_interval={args.val_interval}", f"train.val_batches={args.val_batches}",
            "train.min_lr_ratio=1", "train.log_interval=1000000", *args.sets]
    return argparse.Namespace(steps=steps, nproc=args.nproc, lab=args.lab is not None, nodes=args.nodes,
                              bandwidth=args.lab, lab_prefix=args.lab_prefix, configs=configs, sets=sets,
                              preset=args.preset, repeat=1)


def plan(args: argparse.Namespace, out_dir: Path) -> list[list[B.BenchRun]]:
    """Per round: compute-only, fp32 DDP (N steps), every configuration and peer (cap steps). Validated up front."""
    others = [s for s in B.split_configs(f"{args.configs},{args.peers}") if s != B.BASELINE]
    torchft = {s: torchft_period(s) for s in others if s.partition(":")[0] == TORCHFT}
    if torchft and args.lab is not None and (args.nproc or 1) != 1:
        raise ConfigError("peers", next(iter(torchft)), "configurations without torchft-diloco with --lab and --nproc "
                          f"{args.nproc}: its replicas are one process per lab node")
    ours = [s for s in others if s not in torchft]
    rounds = []
    for r in range(args.repeats):
        where = out_dir / f"round{r + 1}"
        base = B.plan_runs(_bench_ns(args, B.BASELINE, args.steps), where)
        rest = B.plan_runs(_bench_ns(args, ",".join(ours), args.cap), where)[2:] if ours else []
        for spec in torchft:  # torchft's DiLoCo: the baseline's config, run by benchmarks/torchft_diloco.py
            cfg = copy.deepcopy(base[2].cfg)
            cfg.run_dir, cfg.train.steps = str(where / B._slug(spec)), args.cap
            rest.append(B.BenchRun(spec, cfg))
        order = {s: i for i, s in enumerate(others)}
        rounds.append([base[0], base[2]] + sorted(rest, key=lambda run: order[run.name]))
    return rounds


def torchft_period(spec: str) -> int:
    """H of ``torchft-diloco[:period=H]`` (default 16); ConfigError for anything else."""
    accepted = "torchft-diloco[:period=H] with H an integer ≥ 1"
    name, _, opts = spec.partition(":")
    period = 16
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if key.strip() != "period" or not eq or not value.strip().isdigit() or int(value) < 1:
            raise ConfigError("peers", spec, accepted)
        period = int(value)
    return period


def run_torchft(run: B.BenchRun, threads: int, lab_prefix: Optional[str] = None, nodes: int = 1) -> dict[str, Any]:
    """Run torchft's DiLoCo (benchmarks/torchft_diloco.py) for ``run``; its console output goes to console.log."""
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        raise SyncwiseError("torchft is not installed (pip install torchft; 0.2.0 works on CPU with gloo)")
    from torchft_diloco import run as torchft_run

    run.run_dir.mkdir(parents=True, exist_ok=True)
    with B._output_to(run.run_dir / "console.log"):
        replicas = nodes if run.cfg.dist.lab else run.cfg.dist.nproc   # on the lab: one replica per node
        return torchft_run(run.cfg, torchft_period(run.name), replicas, threads, lab_prefix)


# -------------------------------------------------------------------------------------------- reading runs
def curve(run_dir: Path) -> list[dict[str, float]]:
    """Every evaluation of a run: step, cumulative step time (s), tokens, bytes up to it (all; ``cross``: between
    nodes, None where the rows have no split by hop), validation loss."""
    out, clock, tokens, nbytes, cross = [], 0.0, 0.0, 0.0, 0.0
    for m in read_jsonl(run_dir / "metrics.jsonl"):
        clock += m["step_time_s"]
        tokens += m.get("tokens_per_s", 0.0) * m["step_time_s"]
        # None once a step's bytes were not counted (PyTorch's PowerSGD hook bypasses syncwise.comm)
        nbytes = None if nbytes is None or m.get("comm_bytes") is None else nbytes + m["comm_bytes"]
        cross = None if cross is None or m.get("hop_bytes_cross") is None else cross + m["hop_bytes_cross"]
        if m.get("val_loss") is not None:
            out.append({"step": m["step"], "time_s": clock, "tokens": tokens, "bytes": nbytes, "cross": cross,
                        "val_loss": m["val_loss"]})
    return out


def crossing(points: list[dict[str, float]], target: float) -> Optional[dict[str, float]]:
    """Step, time, tokens and bytes at which the validation loss first reaches ``target`` (linear between the two
    evaluations that bracket it; the first evaluation itself if it is already there); None if it never does."""
    prev = None
    for p in points:
        if p["val_loss"] <= target:
            if prev is None or prev["val_loss"] == p["val_loss"]:
                return dict(p)
            f = (prev["val_loss"] - target) / (prev["val_loss"] - p["val_loss"])
            return {k: None if prev.get(k) is None or p.get(k) is None else prev[k] + f * (p[k] - prev[k])
                    for k in ("step", "time_s", "tokens", "bytes", "cross") if k in p} | {"val_loss": target}
        prev = p
    return None


def is_torch_peer(name: str) -> bool:
    """This benchmark's peers: PyTorch's own hooks and averagers, torchft's DiLoCo."""
    return name.startswith(("torch-", "torchft-"))


def round_rows(runs: list[B.BenchRun], summaries: dict[str, dict], errors: dict[str, str], args: argparse.Namespace,
               bandwidth: str, is_peer=is_torch_peer) -> tuple[float, list[dict[str, Any]]]:
    """(target, one row per configuration) of one round; ratios are formed within the round, "vs best peer"
    against the fastest configuration ``is_peer`` names."""
    base_curve = curve(runs[1].run_dir) if B.BASELINE in summaries else []
    if len(base_curve) < args.last_evals:
        raise SyncwiseError(f"fp32 DDP did not produce {args.last_evals} evaluations: {errors.get(B.BASELINE)}")
    target = sum(p["val_loss"] for p in base_curve[-args.last_evals:]) / args.last_evals
    bench_rows = {r["name"]: r for r in B.build_rows(runs, summaries, errors, bandwidth)}
    rows = []
    for run in runs[1:]:
        b = bench_rows[run.name]
        row: dict[str, Any] = {"name": run.name, "peer": is_peer(run.name), "steps_run": run.cfg.train.steps,
                               "run_dir": str(run.run_dir), "error": b.get("error"),
                               "parallel_efficiency": b.get("parallel_efficiency"),
                               "mean_step_time_s": b.get("mean_step_time_s"),
                               "comm_bytes_per_step": b.get("comm_bytes_per_step"),
                               "final_val_loss": b.get("final_val_loss"),
                               # fp32 DDP's bytes per step / this configuration's (bench's ratio: on the
                               # cross-node hop when the runs span nodes, metrics.figures.fewer_bytes)
                               "fewer_bytes_than_fp32": b.get("compression_ratio"), "fewer_bytes_on": b.get("ratio_on")}
        points = [] if row["error"] else curve(run.run_dir)
        hit = crossing(points, target)
        # matched tokens: the evaluation at fp32 DDP's N steps
        row["val_loss_at_n"] = next((q["val_loss"] for q in points if q["step"] >= args.steps), None)
        row.update({"reached": hit is not None,
                    "steps_to_target": hit and hit["step"], "time_to_target_s": hit and hit["time_s"],
                    "tokens_to_target": hit and hit["tokens"],
                    "bytes_per_token": hit and (hit["bytes"] / hit["tokens"] if hit["tokens"] and hit["bytes"] is not None
                                                else None),
                    "cross_bytes_per_token": hit and (hit["cross"] / hit["tokens"] if hit["tokens"] and
                                                      hit.get("cross") is not None else None),
                    "final_gap": (row["final_val_loss"] / target - 1) if row["final_val_loss"] else None})
        rows.append(row)
    base_t = rows[0]["time_to_target_s"]
    base_n = rows[0]["val_loss_at_n"]
    for r in rows:  # the loss gap at matched tokens (N steps)
        r["gap_at_n"] = r["val_loss_at_n"] / base_n - 1 if r["val_loss_at_n"] and base_n else None
    peers = [r["time_to_target_s"] for r in rows if r["peer"] and r["time_to_target_s"]]
    best_peer = min(peers) if peers else None
    for r in rows:
        t = r["time_to_target_s"]
        r["speedup_vs_fp32"] = base_t / t if t and base_t else None
        r["speedup_vs_best_peer"] = best_peer / t if t and best_peer else None
        r["best_peer_time_s"] = best_peer
    return target, rows


AVERAGED = ("time_to_target_s", "tokens_to_target", "steps_to_target", "bytes_per_token", "cross_bytes_per_token",
            "parallel_efficiency",
            "speedup_vs_fp32", "speedup_vs_best_peer", "comm_bytes_per_step", "final_val_loss", "final_gap",
            "val_loss_at_n", "gap_at_n", "fewer_bytes_than_fp32")


def combine(per_round: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Mean over the rounds in which a configuration reached the target, each round's values kept."""
    out = []
    for rows in zip(*per_round):
        row = {"name": rows[0]["name"], "peer": rows[0]["peer"], "repeats": len(rows),
               "fewer_bytes_on": next((r["fewer_bytes_on"] for r in rows if r.get("fewer_bytes_on")), None),
               "reached_in": sum(r["reached"] for r in rows),
               "rounds": [{k: r.get(k) for k in AVERAGED + ("run_dir", "error", "reached")} for r in rows]}
        for k in AVERAGED:
            vals = [r[k] for r in rows if isinstance(r.get(k), (int, float))]
            row[k] = sum(vals) / len(vals) if vals else None
            if k.startswith("speedup") and vals:
                row[k + "_range"] = [min(vals), max(vals)]
        out.append(row)
    return out


def render(rows: list[dict[str, Any]], title: str, target: float, baseline: str = "fp32 DDP") -> None:
    from rich.console import Console
    from rich.table import Table

    f = B._fmt
    on = sorted({r["fewer_bytes_on"] for r in rows if r.get("fewer_bytes_on")})
    table = Table(title=title, caption=f"target: {baseline}'s validation loss {target:.4f} (mean of its last evaluations)"
                                       "; time = cumulative step time; ratios paired within each round; B/token: "
                                       "every hop, cross B/token: between nodes; × fewer bytes: on "
                                       + (" / ".join(on) or "cross-node bytes"))
    for col in ("config", "reached", "time to target s", "steps", "tokens", "B/token", "cross B/token", "efficiency",
                "vs fp32",
                "vs best peer", "× fewer bytes", "gap at N", "final val gap"):
        table.add_column(col, justify="left" if col == "config" else "right", no_wrap=True)
    for r in rows:
        rng = r.get("speedup_vs_fp32_range")
        table.add_row(r["name"] + (" (peer)" if r["peer"] else ""), f"{r['reached_in']}/{r['repeats']}",
                      f(r["time_to_target_s"], ".2f"), f(r["steps_to_target"], ".0f"), f(r["tokens_to_target"], ".3g"),
                      f(r["bytes_per_token"], ".3g"), f(r.get("cross_bytes_per_token"), ".3g"),
                      f(r["parallel_efficiency"], ".2f"),
                      f(r["speedup_vs_fp32"], ".2f") + (f" ({rng[0]:.2f}–{rng[1]:.2f})" if rng and r["repeats"] > 1 else ""),
                      f(r["speedup_vs_best_peer"], ".2f"), f(r["fewer_bytes_than_fp32"], ".1f"),
                      f(None if r["gap_at_n"] is None else 100 * r["gap_at_n"], "+.2f") + "%",
                      f(None if r["final_gap"] is None else 100 * r["final_gap"], "+.2f") + "%")
    Console(width=200).print(table)


def plot(rows: list[dict[str, Any]], target: float, path: Path, title: str) -> Optional[Path]:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for r in rows:
        first = next((x for x in r["rounds"] if not x.get("error")), None)
        pts = curve(Path(first["run_dir"])) if first else []
        if pts:
            ax.plot([p["time_s"] for p in pts], [p["val_loss"] for p in pts], ":" if r["peer"] else "-",
                    marker="o", markersize=3, label=r["name"], linewidth=1.3)
    ax.axhline(target, color="black", linewidth=0.8, linestyle="--", label=f"target {target:.3f}")
    ax.set_xlabel("wall-clock time (s, cumulative step time)")
    ax.set_ylabel("validation loss")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir or Path("runs") / time.strftime("time-to-loss-%Y%m%d-%H%M%S"))
    rounds = plan(args, out_dir)  # every ConfigError here, before a lab or a worker starts
    summaries: list[dict[str, dict]] = [{} for _ in rounds]
    errors: list[dict[str, str]] = [{} for _ in rounds]

    def go(threads: int) -> None:
        for k, runs in enumerate(rounds):
            for run in B.round_order(runs, k):
                print(f"round {k + 1}/{len(rounds)}: {run.name} ({run.cfg.train.steps} steps)", flush=True)
                try:
                    if run.name.partition(":")[0] == TORCHFT:
                        summaries[k][run.name] = run_torchft(run, threads, args.lab_prefix, args.nodes)
                    else:
                        summaries[k][run.name] = B.run_one(run, threads, args.lab_prefix)
                except SyncwiseError as e:
                    errors[k][run.name] = str(e)
                    print(f"  failed: {e}", flush=True)

    out_dir.mkdir(parents=True, exist_ok=True)
    if args.lab is not None:
        from syncwise.lab.launch import omp_threads

        with B._Lab(args.nodes, args.lab, args.lab_prefix) as lab:
            bandwidth = lab.state.inter_node
            nproc = rounds[0][1].cfg.dist.nproc
            where = (f"{lab.state.num_nodes} lab nodes × {nproc} at {bandwidth} (≈ "
                     f"{B.equivalent_real_link(lab.state.inter_node_bps)} between GPU nodes at 5,000×)")
            go(omp_threads(lab.state, nproc))
    else:
        from syncwise.launch.local import threads_per_worker

        nproc = rounds[0][1].cfg.dist.nproc
        bandwidth, where = "loopback", f"{nproc} local workers over loopback"
        go(threads_per_worker(nproc))

    targets, per_round = zip(*[round_rows(r, s, e, args, bandwidth) for r, s, e in zip(rounds, summaries, errors)])
    rows = combine(list(per_round))
    target = sum(targets) / len(targets)
    title = (("SMOKE (too short to rank anything): " if args.smoke else "") +
             f"time to fp32 DDP's loss: {args.preset}, N={args.steps}, cap {args.cap}, {where}, "
             f"{args.repeats} round(s)")
    render(rows, title, target)
    json_path = Path(args.json) if args.json else out_dir / "time-to-loss.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    result = {"smoke": args.smoke, "title": title, "command": "python benchmarks/time_to_loss.py " + " ".join(
                  sys.argv[1:] if argv is None else argv),
              "target_val_loss": target, "targets_per_round": list(targets), "where": where,
              "schedule": "constant LR after warm-up (train.min_lr_ratio=1) unless --set overrides it",
              "time": "cumulative step time of each run (evaluations excluded)", "rows": rows}
    json_path.write_text(json.dumps(result, indent=2, default=_nan_safe) + "\n")
    png = plot(rows, target, Path(args.plot) if args.plot else json_path.with_suffix(".png"), title)
    print(f"results: {json_path}" + (f"\nplot: {png}" if png else "\nplot: matplotlib is not installed"))
    return 1 if any(r.get("error") for rr in per_round for r in rr) else 0


def _nan_safe(v: Any) -> Any:
    return None if isinstance(v, float) and math.isnan(v) else str(v)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ConfigError, SyncwiseError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
