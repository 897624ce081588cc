"""`syncwise comm-bench`: nccl-tests style sweep of collectives on local workers or across the network lab.

Prints a table (time = median of the slowest rank, algbw, busbw), optionally writes the rows as JSON
(``algbw_gbps`` / ``busbw_gbps`` are Gbit/s; ``*_GBps`` GB/s) and a busbw-vs-size PNG.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Optional

from ..comm.bench import (DEFAULT_SIZES, DTYPES, OPS, parse_ops, parse_sizes, render_table, sweep_worker, write_json,
                          write_plot)
from ..errors import ConfigError, SyncwiseError

DEFAULT_LOCAL_NPROC = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register comm-bench's options on ``parser``."""
    parser.add_argument("--lab", action="store_true",
                        help="run across the network lab's nodes (start it with `syncwise cluster up` first)")
    parser.add_argument("--lab-prefix", default=None,
                        help="name prefix of the lab to use (as `syncwise cluster --prefix`; default: the default lab)")
    parser.add_argument("--nproc", type=int, default=None,
                        help=f"workers (per node with --lab; default {DEFAULT_LOCAL_NPROC} locally, "
                             "the lab's procs_per_node with --lab)")
    parser.add_argument("--ops", default="all", help="'all' or a comma list of " + ", ".join(OPS))
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help="a range 1KB-256MB (powers of 2) or a list 64MB,1MB (units B/KB/MB/GB, powers of 1024)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per size (fewer for big sizes)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed warm-up iterations per size")
    parser.add_argument("--dtype", default="float32", help="element type: " + ", ".join(DTYPES))
    parser.add_argument("--procs-per-node", type=int, default=None,
                        help="treat every N consecutive ranks as one node (e.g. --nproc 4 --procs-per-node 2 "
                             "emulates 2 nodes x 2 for hier_all_reduce)")
    parser.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    parser.add_argument("--json", default=None, help="write the rows here (a list of JSON objects)")
    parser.add_argument("--plot", default=None, help="busbw-vs-size PNG (default: next to --json, .png)")


def _validate(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    ops, sizes = parse_ops(args.ops), parse_sizes(args.sizes)
    if args.nproc is not None and (args.nproc < 1):
        raise ConfigError("nproc", args.nproc, "an integer >= 1")
    if args.iters < 1:
        raise ConfigError("iters", args.iters, "an integer >= 1")
    if args.warmup < 0:
        raise ConfigError("warmup", args.warmup, "an integer >= 0")
    if args.dtype not in DTYPES:
        raise ConfigError("dtype", args.dtype, ", ".join(DTYPES))
    if args.timeout <= 0:
        raise ConfigError("timeout", args.timeout, "a positive number of seconds")
    if args.procs_per_node is not None:
        if args.procs_per_node < 1:
            raise ConfigError("procs-per-node", args.procs_per_node, "an integer >= 1")
        nproc = args.nproc or DEFAULT_LOCAL_NPROC
        if not args.lab and nproc % args.procs_per_node:
            raise ConfigError("procs-per-node", args.procs_per_node, f"a divisor of --nproc ({nproc})")
    return ops, sizes


def _worker_argv(args: argparse.Namespace, json_path: str) -> list[str]:
    argv = ["syncwise.comm.bench", "--ops", args.ops, "--sizes", args.sizes, "--iters", str(args.iters),
            "--warmup", str(args.warmup), "--dtype", args.dtype, "--timeout", str(args.timeout),
            "--json", json_path, "--quiet"]
    if args.procs_per_node is not None:
        argv += ["--procs-per-node", str(args.procs_per_node)]
    return argv


def _run_lab(args: argparse.Namespace) -> list[dict]:
    try:
        from ..launch.run import Job, Worker, start
    except ImportError as exc:
        raise SyncwiseError(f"the network lab launcher is not available in this installation ({exc})") from exc
    # Rank 0 runs in a lab namespace but shares this filesystem: it writes the rows where we read them.
    with tempfile.TemporaryDirectory(prefix="syncwise-comm-bench-") as tmp:
        json_path = args.json or str(Path(tmp) / "rows.json")
        if args.json:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        code = start(Job(nproc=args.nproc, lab=True, lab_prefix=args.lab_prefix),
                     Worker(argv=_worker_argv(args, str(Path(json_path).resolve())))).codes[0]
        if code != 0 and not Path(json_path).exists():
            raise SyncwiseError(f"the lab comm-bench job failed (exit code {code}); see the worker output above")
        return json.loads(Path(json_path).read_text())


def _run_local(args: argparse.Namespace, ops: list[str], sizes: list[int]) -> list[dict]:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from ..launch.run import Job, Worker, start

    nproc = args.nproc or DEFAULT_LOCAL_NPROC
    try:
        sweep = Worker(fn=sweep_worker, args=(ops, sizes, args.iters, args.warmup, args.dtype, args.procs_per_node,
                                              args.timeout, True))
        results = start(Job(nproc=nproc), sweep).results
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise SyncwiseError(f"comm-bench worker {rank} failed (exit code {failure.exitcode}): "
                            f"{failure.message or 'see its output above'}") from None
    return results[0]


def run(args: argparse.Namespace) -> int:
    """Validate, run the sweep, print the table, write JSON / PNG; 1 if a correctness check failed."""
    ops, sizes = _validate(args)
    rows = _run_lab(args) if args.lab else _run_local(args, ops, sizes)
    render_table(rows)
    plot: Optional[str] = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if args.json and not args.lab:
        write_json(rows, args.json)
    if args.json:
        print(f"rows: {args.json}")
    if plot:
        print(f"plot: {write_plot(rows, plot)}")
    failed = sorted({r["op"] for r in rows if r["check"] != "ok"})
    if failed:
        print(f"comm-bench: wrong results from {', '.join(failed)}")
        return 1
    return 0
