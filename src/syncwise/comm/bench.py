"""comm-bench worker: an nccl-tests style sweep of collectives over message sizes.

Run inside an initialised group (``run_sweep``) or as a torchrun worker module::

    torchrun --nproc-per-node 2 -m syncwise.comm.bench --ops all_reduce,all_gather --sizes 1KB-64MB --json out.json

Definitions follow nccl-tests: ``bytes`` is the size of the full buffer (all-reduce / broadcast: the
tensor; all-gather: the gathered output; reduce-scatter: the input before scattering; all-to-all:
each rank's send buffer). ``time_s`` is the median over timed iterations of the slowest rank's time.
``algbw = bytes / time``; ``busbw = algbw * factor`` with factor 2(n-1)/n for all-reduce, (n-1)/n for
all-gather / reduce-scatter / all-to-all and 1 for broadcast, so busbw is comparable to a link speed.

Units: ``*_gbps`` fields are **Gbit/s** (1e9 bits per second), as links are quoted; ``*_GBps``
fields are GB/s (1e9 bytes per second), as nccl-tests prints. Sizes use powers of 1024 (1KB = 1024 B).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

from syncwise.errors import ConfigError, SyncwiseError

from . import ops as cops, timing
from .context import CommContext, Topology
from .stats import CommStats
from .topology import TopoAwareCollective

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "hier_all_reduce")
DEFAULT_SIZES = "1KB-256MB"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "int32": torch.int32}
_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1024 ** 2, "MB": 1024 ** 2, "MIB": 1024 ** 2,
          "G": 1024 ** 3, "GB": 1024 ** 3, "GIB": 1024 ** 3}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_SIZES_ACCEPTED = ("a size like 64MB, a range like 1KB-256MB (powers of 2 from the first to the last), "
                   "or a comma list like 64MB,1MB; units B, KB, MB, GB (powers of 1024)")
# Default per-(op, size) data budget: big messages get fewer iterations so a full 1KB-256MB sweep of
# all six ops on 2 local workers takes about a minute.
DEFAULT_BUDGET_BYTES = 1 << 30
MIN_ITERS = 3


def parse_size(text: str) -> int:
    """'64MB' -> 67108864; units B/KB/MB/GB (powers of 1024; K, KiB... accepted)."""
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError("sizes", text, _SIZES_ACCEPTED)
    value = float(m.group(1)) * _UNITS[unit]
    if value < 1 or value != int(value):
        raise ConfigError("sizes", text, "a whole number of bytes >= 1; " + _SIZES_ACCEPTED)
    return int(value)


def parse_sizes(spec: str) -> list[int]:
    """'1KB-256MB' -> every lo*2^k <= hi; '64MB,1MB' -> those sizes (sorted, deduplicated)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("sizes", spec, _SIZES_ACCEPTED)
    sizes: set[int] = set()
    for part in spec.split(","):
        if "-" in part:
            lo_text, _, hi_text = part.partition("-")
            try:
                lo, hi = parse_size(lo_text), parse_size(hi_text)
            except ConfigError:
                raise ConfigError("sizes", spec, _SIZES_ACCEPTED) from None  # name the whole spec
            if lo > hi:
                raise ConfigError("sizes", spec, "a range whose first size is not larger than its last; "
                                  + _SIZES_ACCEPTED)
            s = lo
            while s <= hi:
                sizes.add(s)
                s *= 2
        else:
            sizes.add(parse_size(part))
    return sorted(sizes)


def parse_ops(spec: "str | Iterable[str]") -> list[str]:
    """'all_reduce,broadcast' (or 'all') -> validated op names in the order given."""
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s) for s in spec]
    names = [n for n in names if n]
    if names == ["all"]:
        return list(OPS)
    bad = [n for n in names if n not in OPS]
    if bad or not names:
        raise ConfigError("ops", ",".join(bad) if bad else spec, "'all' or a comma list of " + ", ".join(OPS))
    return list(dict.fromkeys(names))


def busbw_factor(op: str, world_size: int) -> float:
    """nccl-tests bus-bandwidth factor: busbw = algbw * factor."""
    n = world_size
    if op in ("all_reduce", "hier_all_reduce"):
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ConfigError("ops", op, ", ".join(OPS))


def iterations_for(nbytes: int, iters: int, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> int:
    """Timed iterations for a message: ``iters``, cut so iterations x bytes stays near the budget."""
    return max(min(iters, MIN_ITERS), min(iters, budget_bytes // max(nbytes, 1)))


class _Case:
    """Buffers, the timed call and the correctness check of one (op, size)."""

    def __init__(self, op: str, nbytes: int, dtype: torch.dtype, ctx: CommContext,
                 topo: Optional[TopoAwareCollective], stats: CommStats) -> None:
        n, rank = ctx.world_size, ctx.rank
        esize = torch.empty((), dtype=dtype).element_size()
        # Every buffer splits evenly into n chunks, as the collectives need.
        count = max(n, nbytes // esize // n * n)
        self.nbytes = count * esize
        self.count = count
        chunk = count // n
        mk = lambda c: torch.empty(c, dtype=dtype, device=ctx.device)  # noqa: E731  (NCCL: CUDA buffers)
        expected_sum = n * (n + 1) // 2
        if op in ("all_reduce", "hier_all_reduce"):
            buf = mk(count)
            if op == "all_reduce":
                self.call = lambda: cops.all_reduce(buf, "sum", stats=stats)
            else:
                assert topo is not None
                self.call = lambda: topo.all_reduce(buf, "sum")
            self.fill = lambda: buf.fill_(rank + 1)
            self.check = lambda: bool((buf == expected_sum).all())
        elif op == "all_gather":
            inp, out = mk(chunk), mk(count)
            self.call = lambda: cops.all_gather(out, inp, stats=stats)
            self.fill = lambda: inp.fill_(rank + 1)
            want = torch.arange(1, n + 1, dtype=dtype, device=ctx.device).repeat_interleave(chunk)
            self.check = lambda: bool(torch.equal(out, want))
        elif op == "reduce_scatter":
            inp, out = mk(count), mk(chunk)
            self.call = lambda: cops.reduce_scatter(out, inp, "sum", stats=stats)
            self.fill = lambda: inp.fill_(rank + 1)
            self.check = lambda: bool((out == expected_sum).all())
        elif op == "all_to_all":
            inp, out = mk(count), mk(count)
            self.call = lambda: cops.all_to_all(out, inp, stats=stats)
            # Chunk j of rank r carries r*n + j; afterwards chunk j of rank r holds j*n + r.
            self.fill = lambda: inp.copy_((rank * n + torch.arange(n, device=ctx.device)).to(dtype)
                                          .repeat_interleave(chunk))
            want = (torch.arange(n, device=ctx.device) * n + rank).to(dtype).repeat_interleave(chunk)
            self.check = lambda: bool(torch.equal(out, want))
        elif op == "broadcast":
            buf = mk(count)
            self.call = lambda: cops.broadcast(buf, 0, stats=stats)
            self.fill = lambda: buf.fill_(rank + 1)
            self.check = lambda: bool((buf == 1).all())
        else:
            raise ConfigError("ops", op, ", ".join(OPS))


def run_sweep(ops: Iterable[str], sizes: Iterable[int], iters: int = 20, warmup: int = 5,
              dtype: torch.dtype = torch.float32, ctx: Optional[CommContext] = None,
              budget_bytes: int = DEFAULT_BUDGET_BYTES, stats: Optional[CommStats] = None,
              on_row: Optional[Callable[[dict], None]] = None) -> list[dict]:
    """Time every op at every size inside an initialised group; every rank returns the same rows.

    Collective: all ranks must call it with the same arguments. Each (op, size) is first run once on
    known inputs and checked (row field ``check``), then warmed up and timed ``iterations_for`` times
    with a barrier before each iteration. Bytes go to ``stats`` (a private CommStats by default).
    """
    ops_list = parse_ops(list(ops))
    sizes_list = [int(s) for s in sizes]
    if iters < 1 or warmup < 0:
        raise ConfigError("iters/warmup", (iters, warmup), "iters >= 1 and warmup >= 0")
    own_ctx = ctx is None
    ctx = ctx or CommContext()
    stats = stats if stats is not None else CommStats()
    control = CommStats()  # the bench's own bookkeeping traffic is kept out of the measured stats
    topo = TopoAwareCollective(ctx, algorithm="hierarchical", stats=stats) if "hier_all_reduce" in ops_list else None
    n = ctx.world_size
    rows: list[dict] = []
    try:
        for op in ops_list:
            for size in sizes_list:
                case = _Case(op, size, dtype, ctx, topo, stats)
                case.fill()
                case.call()
                ok = torch.tensor([1 if case.check() else 0], dtype=torch.int32)
                cops.all_reduce(ok, "min", stats=control)
                k = iterations_for(case.nbytes, iters, budget_bytes)
                for _ in range(warmup if k >= iters else min(warmup, 1)):
                    case.call()
                # Control tensors stay on the CPU (the gloo half of an NCCL job's group: devices.NCCL_PROCESS_GROUP).
                samples = torch.empty(k, dtype=torch.float64)
                for i in range(k):
                    cops.barrier()
                    timing.synchronize(ctx.device)  # nothing queued before the start
                    with timing.timed(ctx.device) as iv:  # CUDA events: the collective, not its enqueue
                        case.call()
                    samples[i] = iv.seconds()
                # A collective is as slow as its slowest rank: max over ranks per iteration.
                cops.all_reduce(samples, "max", stats=control)
                times = samples.tolist()
                t = statistics.median(times)
                algbw = case.nbytes / t
                busbw = algbw * busbw_factor(op, n)
                row = {
                    "op": op, "bytes": case.nbytes, "count": case.count, "dtype": str(dtype).replace("torch.", ""),
                    "time_s": t, "time_min_s": min(times), "time_mean_s": statistics.fmean(times),
                    "algbw_gbps": algbw * 8e-9, "busbw_gbps": busbw * 8e-9,
                    "algbw_GBps": algbw * 1e-9, "busbw_GBps": busbw * 1e-9,
                    "iters": k, "world_size": n, "nodes": ctx.topology.nodes,
                    "procs_per_node": ctx.topology.procs_per_node, "backend": ctx.backend,
                    "check": "ok" if int(ok.item()) == 1 else "FAIL",
                }
                rows.append(row)
                if on_row is not None:
                    on_row(row)
                del case
    finally:
        if own_ctx:
            ctx.close()
    return rows


def sweep_worker(ops: list[str], sizes: list[int], iters: int = 20, warmup: int = 5, dtype: str = "float32",
                 procs_per_node: Optional[int] = None, timeout_s: float = 300.0, progress: bool = True) -> list[dict]:
    """Entry point for ``syncwise.launch.run_local``: init from env, sweep, close; returns the rows."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    topology = _topology(procs_per_node)
    with CommContext(timeout_s=timeout_s, topology=topology) as ctx:
        if progress and ctx.rank == 0:
            return _with_progress(ops, sizes, lambda on_row: run_sweep(
                ops, sizes, iters, warmup, DTYPES[dtype], ctx=ctx, on_row=on_row))
        return run_sweep(ops, sizes, iters, warmup, DTYPES[dtype], ctx=ctx)


def _topology(procs_per_node: Optional[int]) -> Optional[Topology]:
    if procs_per_node is None:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if procs_per_node < 1 or world % procs_per_node:
        raise ConfigError("procs_per_node", procs_per_node, f"a divisor of the world size {world}")
    return Topology(world // procs_per_node, procs_per_node)


def _with_progress(ops: list[str], sizes: list[int], body: Callable[[Callable[[dict], None]], list[dict]]):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("comm-bench"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task("", total=len(ops) * len(sizes))

        def on_row(row: dict) -> None:
            bar.update(task, advance=1, description=f"{row['op']} {format_bytes(row['bytes'])} "
                                                    f"busbw {row['busbw_gbps']:.2f} Gbit/s")
        return body(on_row)


# -- reporting ---------------------------------------------------------------------------------------
def format_bytes(n: float) -> str:
    """1048576 -> '1MB' (powers of 1024, as the size arguments)."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:g}{unit}" if float(n).is_integer() else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}GB"


def render_table(rows: list[dict], console: Any = None) -> None:
    """Print the rows as a rich table (one line per op and size)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    if not rows:
        console.print("comm-bench: no results")
        return
    r0 = rows[0]
    table = Table(title=f"comm-bench: {r0['world_size']} ranks = {r0['nodes']}x{r0['procs_per_node']}, "
                        f"{r0['backend']}, {r0['dtype']}", caption="time: median over iterations of the slowest rank")
    table.add_column("op", no_wrap=True, min_width=15)
    for col in ("size", "iters", "ms", "algbw\nGbit/s", "busbw\nGbit/s", "busbw\nGB/s", "check"):
        table.add_column(col, justify="left" if col == "check" else "right", no_wrap=col != "check")
    for r in rows:
        ms = r["time_s"] * 1e3
        table.add_row(r["op"], format_bytes(r["bytes"]), str(r["iters"]), f"{ms:.3f}" if ms < 100 else f"{ms:.1f}",
                      f"{r['algbw_gbps']:.3f}", f"{r['busbw_gbps']:.3f}", f"{r['busbw_GBps']:.3f}",
                      r["check"] if r["check"] == "ok" else f"[red]{r['check']}[/red]")
    console.print(table)


def write_json(rows: list[dict], path: "str | Path") -> Path:
    """Write the rows as a JSON list (creating parent directories)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    return path


def write_plot(rows: list[dict], path: "str | Path") -> Path:
    """PNG of busbw (Gbit/s) vs message size, one line per op (log-2 size axis)."""
    from ..extras import pyplot

    plt = pyplot("syncwise comm-bench --plot")

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 5))
    for op in dict.fromkeys(r["op"] for r in rows):
        pts = sorted((r["bytes"], r["busbw_gbps"]) for r in rows if r["op"] == op)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=op)
    ax.set_xscale("log", base=2)
    ticks = sorted({r["bytes"] for r in rows})
    if len(ticks) > 10:
        ticks = ticks[:: math.ceil(len(ticks) / 10)]
    ax.set_xticks(ticks)
    ax.set_xticklabels([format_bytes(t) for t in ticks], rotation=45)
    ax.set_xlabel("message size")
    ax.set_ylabel("bus bandwidth (Gbit/s)")
    if rows:
        r0 = rows[0]
        ax.set_title(f"comm-bench: {r0['world_size']} ranks ({r0['nodes']}x{r0['procs_per_node']}), {r0['backend']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- torchrun worker module --------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """Arguments of ``python -m syncwise.comm.bench`` (the torchrun worker)."""
    p = argparse.ArgumentParser(prog="python -m syncwise.comm.bench", description=__doc__.split("\n")[0])
    p.add_argument("--ops", default="all", help="'all' or a comma list of " + ", ".join(OPS))
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=_SIZES_ACCEPTED)
    p.add_argument("--iters", type=int, default=20, help="timed iterations (fewer for big messages)")
    p.add_argument("--warmup", type=int, default=5, help="untimed warm-up iterations")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--procs-per-node", type=int, default=None,
                   help="override torchrun's LOCAL_WORLD_SIZE as the node size (e.g. emulate 2x2 on one host)")
    p.add_argument("--timeout", type=float, default=300.0, help="process-group timeout in seconds")
    p.add_argument("--json", default=None, help="rank 0 writes the rows here")
    p.add_argument("--plot", default=None, help="rank 0 writes a busbw-vs-size PNG here")
    p.add_argument("--quiet", action="store_true", help="no table/progress on rank 0")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """torchrun worker: sweep, then rank 0 prints the table and writes JSON / plot. Exit 1 on a failed check."""
    args = build_parser().parse_args(argv)
    try:
        ops, sizes = parse_ops(args.ops), parse_sizes(args.sizes)
        rows = sweep_worker(ops, sizes, args.iters, args.warmup, args.dtype, args.procs_per_node, args.timeout,
                            progress=not args.quiet)
    except SyncwiseError as exc:
        print(f"syncwise comm-bench: {exc}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        if args.json:
            write_json(rows, args.json)
        if args.plot:
            write_plot(rows, args.plot)
        if not args.quiet:
            render_table(rows)
    return 0 if all(r["check"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
