"""The `syncwise` command line: one subcommand per module under syncwise.commands."""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import SyncwiseError

# subcommand -> (module under syncwise.commands, one-line help)
COMMANDS = {
    "train": ("train", "train a model on N workers (local, or across the network lab)"),
    "bench": ("bench", "baseline vs optimized: compressors side by side, parallel efficiency, loss"),
    "comm-bench": ("comm_bench", "nccl-tests style collective sweep: time, algbw, busbw"),
    "cluster": ("cluster", "the network lab: emulated multi-node cluster on this machine"),
    "plan": ("plan", "which layout to use on a cluster: predicted step time, MFU and memory per layout"),
    "doctor": ("doctor", "why a run is slow: where the step goes, the causes ranked by time lost, what to change"),
    "launch": ("launch", "write (and optionally submit) a Slurm sbatch script or a Kubernetes manifest for a run"),
    "report": ("report", "look at runs: loss vs step and time, step-time split, bytes per step (PNG + HTML + text)"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; with ``only`` (the subcommand about to run) only that subcommand's module is
    imported and given its options: the others are listed by name and help alone. Some commands' modules load torch
    at import (comm-bench's sweep, bench), and a mistyped flag of another command must not wait for it (issue 43
    row 7: an error in well under a second)."""
    # allow_abbrev=False: a prefix of an option is not that option (--compres fp8 is refused, not taken as --compress)
    parser = argparse.ArgumentParser(prog="syncwise", description="Communication-efficient distributed training.",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
            continue
        try:
            mod = importlib.import_module(f"syncwise.commands.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"syncwise.commands.{module}":
                raise
            continue
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        mod.add_arguments(p)
        p.set_defaults(func=mod.run, command=name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # the subcommand is the first word that is not an option (the top-level parser has no option taking a value)
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(first if first in COMMANDS else None)
    args, extra = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            return args.func(args, extra)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return args.func(args) or 0
    except SyncwiseError as e:
        print(f"syncwise: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)  # 2, or a failure's own (launch.ft.LighthouseDied: 3)
    except KeyboardInterrupt:
        print("syncwise: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
