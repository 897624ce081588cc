"""`syncwise cluster`: the network lab — an emulated multi-node cluster on this machine.

    syncwise cluster up --nodes 2 --bandwidth 100mbit [--inter-node RATE] [--intra-node RATE]
    syncwise cluster status
    syncwise cluster exec 1 -- ip addr
    syncwise cluster run [--nproc-per-node P] -- -m my.module args...
    syncwise cluster down
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..errors import ConfigError, SyncwiseError
from ..lab import cluster as lab

_EPILOG = ("Links are shaped in rate only, with `tc qdisc ... tbf` on both ends of every node's veth "
           "(both directions). netem (delay, loss, jitter) is not available on this machine's kernel, "
           "so the lab emulates bandwidth, not latency. Needs root (network namespaces + tc). "
           "See docs/network-lab.md for choosing a bandwidth that matches a real GPU cluster.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `cluster up|down|status|exec|run` on ``parser``."""
    parser.epilog = _EPILOG
    parser.add_argument("--prefix", default=lab.PREFIX,
                        help=f"name prefix of the lab's namespaces/interfaces (default {lab.PREFIX}); "
                             "different prefixes are independent labs")
    sub = parser.add_subparsers(dest="cluster_command", required=True, metavar="{up,down,status,exec,run}")

    p = sub.add_parser("up", help="create the lab (removes a stale one first)", epilog=_EPILOG,
                       description="Create N nodes (network namespaces) on a bridge, links shaped with tbf.")
    p.add_argument("--nodes", type=int, required=True, help=f"number of nodes, 1..{lab.MAX_NODES}")
    p.add_argument("--bandwidth", required=True,
                   help="link rate, e.g. 100mbit, 1gbit, 500kbit (tc units: bit/kbit/mbit/gbit/tbit)")
    p.add_argument("--inter-node", default=None, help="node-to-node link rate (default: --bandwidth)")
    p.add_argument("--intra-node", default=None,
                   help="rate between processes on the same node (shapes the node's loopback; default unshaped)")
    p.add_argument("--procs-per-node", type=int, default=1, help="default workers per node for `cluster run` (syncwise train --lab uses its --nproc)")
    p.add_argument("--burst", default=None, help="tbf bucket, e.g. 256kb (default: 4 ms of traffic, >= 128kb)")
    p.add_argument("--latency", default=None, help="tbf queue bound: max time a packet waits (default: room for "
                                                   "~2.5 MB of frames, 50 ms at 1gbit, 200 ms at 100mbit)")
    p.add_argument("--subnet", default=lab.DEFAULT_SUBNET, help=f"node addresses (default {lab.DEFAULT_SUBNET})")

    sub.add_parser("down", help="remove the lab: every namespace, link and qdisc it made")
    sub.add_parser("status", help="nodes, addresses, interfaces, rates and tbf counters")

    p = sub.add_parser("exec", help="run a command in a node's namespace: exec NODE -- CMD...")
    p.add_argument("node", type=int, help="node index (0 is the rendezvous host)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command (after --)")

    p = sub.add_parser("run", help="run a torchrun job on every node: run [opts] -- -m MODULE ARGS... | SCRIPT ARGS...")
    p.add_argument("--nproc-per-node", type=int, default=None, help="workers per node (default: the lab's)")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun elastic restarts")
    p.add_argument("--log-dir", default=None, help="write node i's output to LOG_DIR/node<i>.log")
    p.add_argument("--timeout", type=float, default=None, help="stop the job after this many seconds")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-m MODULE ARGS... or SCRIPT.py ARGS... (after --)")


def _strip_dashdash(cmd: Sequence[str]) -> list[str]:
    cmd = list(cmd)
    return cmd[1:] if cmd[:1] == ["--"] else cmd


def _up(args: argparse.Namespace) -> int:
    state = lab.up(args.nodes, args.bandwidth, inter_node=args.inter_node, intra_node=args.intra_node,
                   procs_per_node=args.procs_per_node, burst=args.burst, latency=args.latency, subnet=args.subnet,
                   prefix=args.prefix)
    intra = f", intra-node {state.intra_node}" if state.intra_node else ""
    print(f"lab up: {state.num_nodes} nodes on {state.subnet}, inter-node {state.inter_node} each way{intra}; "
          f"state in {lab.state_path(state.prefix)}")
    _print_status(state)
    return 0


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _print_status(state: lab.LabState) -> None:
    from rich.console import Console
    from rich.table import Table

    stats = lab.qdisc_stats(state)
    table = Table(title=f"network lab '{state.prefix}' — {state.num_nodes} nodes, {state.subnet}, tbf shaping")
    for col in ("node", "namespace", "address", "interface", "rate out", "rate in", "intra (lo)",
                "tx bytes (drops)", "rx bytes (drops)"):
        table.add_column(col, justify="right" if col == "node" else "left", no_wrap=True)

    def rate(q: dict | None) -> str:
        return lab.format_rate(q["rate_bps"]) if q else "unshaped"

    def cell(q: dict | None) -> str:
        return "-" if not q else f"{_fmt_bytes(q['bytes'])} ({q['drops']})"

    # Rates are read back from the kernel's qdiscs, so the table shows what is really applied.
    for n in state.nodes:
        s = stats.get(n.index, {})
        table.add_row(str(n.index), n.namespace, n.address, n.ifname, rate(s.get("egress")), rate(s.get("ingress")),
                      rate(s.get("lo")), cell(s.get("egress")), cell(s.get("ingress")))
    console = Console()
    if not console.is_terminal:  # piped output: do not squeeze the table into 80 columns
        console = Console(width=max(console.width, 130))
    console.print(table)
    print(f"rendezvous host: node 0 ({state.nodes[0].address}); workers per node: `syncwise train --lab` and "
          f"`bench --lab` start --nproc (default 2), `cluster run` --nproc-per-node (default {state.procs_per_node}, "
          "--procs-per-node); rates and counters read from the kernel (tc -s qdisc)")


def _exec(args: argparse.Namespace) -> int:
    cmd = _strip_dashdash(args.cmd)
    if not cmd:
        raise ConfigError("cmd", "", "a command after --, e.g. `syncwise cluster exec 0 -- ip addr`")
    proc = lab.exec_in(args.node, cmd, prefix=args.prefix)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        raise


def _run_job(args: argparse.Namespace) -> int:
    from ..launch.run import Job, Worker, start

    cmd = _strip_dashdash(args.cmd)
    if not cmd:
        raise ConfigError("cmd", "", "-m MODULE ARGS... or SCRIPT.py ARGS... after --")
    job = Job(nproc=args.nproc_per_node, lab=True, lab_prefix=args.prefix, max_restarts=args.max_restarts,
              script=cmd[0] != "-m", log_dir=args.log_dir, timeout_s=args.timeout)
    return start(job, Worker(argv=cmd)).codes[0]


def run(args: argparse.Namespace) -> int:
    """Dispatch `syncwise cluster <command>`; returns the process exit code."""
    cmd = args.cluster_command
    if cmd == "up":
        return _up(args)
    if cmd == "down":
        lab.check_supported()
        existed = bool(lab.list_namespaces(args.prefix))
        lab.down(args.prefix)
        print("lab down: all lab namespaces, links and qdiscs removed" if existed else "no lab was running")
        return 0
    if cmd == "status":
        state = lab.status(args.prefix)
        if state is None:
            print("no lab is running (start one with `syncwise cluster up --nodes 2 --bandwidth 100mbit`)")
            return 1
        _print_status(state)
        return 0
    if cmd == "exec":
        return _exec(args)
    if cmd == "run":
        return _run_job(args)
    raise SyncwiseError(f"unknown cluster command {cmd!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (`python -m syncwise.commands.cluster ...`), same behaviour as the CLI."""
    parser = argparse.ArgumentParser(prog="syncwise cluster", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args) or 0
    except SyncwiseError as e:
        print(f"syncwise: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
