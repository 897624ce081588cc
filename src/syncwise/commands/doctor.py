"""`syncwise doctor RUN_DIR [OTHER_RUN_DIR] [--json FILE]`: why a run is slow, and what to change.

Reads the run's metrics.jsonl, summary.json, config.json and every rank's own log (RUN_DIR/ranks/), prints where
the step goes, the causes of lost efficiency ranked by the time they lose, and the change predicted to help most
(docs/doctor.md). With a second run directory it explains how the two steps differ.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import ConfigError, SyncwiseError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `syncwise doctor`'s options on ``parser``."""
    parser.add_argument("run_dir", help="a run directory (syncwise train --run-dir, or OptimizedTrainer(run_dir=))")
    parser.add_argument("other_run_dir", nargs="?", default=None,
                        help="a second run directory: explain how its step differs from the first's")
    parser.add_argument("--json", dest="json_path", default=None, metavar="FILE",
                        help="also write the diagnosis (or the comparison) as JSON to FILE ('-': standard output)")
    parser.add_argument("--no-predict", action="store_true",
                        help="do not ask the cost model (syncwise.plan) for the recommendations' gains")
    parser.add_argument("--html", dest="html_path", default=None, metavar="FILE",
                        help="where to write the picture (per-rank timeline, per-step breakdown) as one HTML file; "
                             "default RUN_DIR/doctor.html, 'none' for no picture")
    parser.add_argument("--follow", action="store_true",
                        help="watch a run while it trains: re-diagnose its last --window steps every --interval "
                             "seconds and print a line when the top cause changes, until the run finishes")
    parser.add_argument("--interval", type=float, default=2.0, help="--follow: seconds between looks (default 2)")
    parser.add_argument("--window", type=int, default=20, help="--follow: steps diagnosed each look (default 20)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..doctor import compare, diagnose, load_run, print_comparison, print_diagnosis

    if args.interval <= 0:
        raise ConfigError("interval", args.interval, "a number of seconds > 0")
    if args.window < 3:
        raise ConfigError("window", args.window, "an integer number of steps ≥ 3")
    if args.follow:
        from ..doctor.follow import follow

        if args.other_run_dir is not None:
            raise ConfigError("follow", "with two run directories", "one run directory (the one that trains)")
        out = open(args.json_path, "a") if args.json_path and args.json_path != "-" else None
        try:
            follow(args.run_dir, args.interval, args.window,
                   emit=(lambda look: (out.write(json.dumps(look) + "\n"), out.flush())) if out else None)
        finally:
            if out is not None:
                out.close()
        return 0
    from ..doctor import flight

    hang = flight.summarize(args.run_dir)  # RUN_DIR/flight: the ranks' flight recorders, dumped on a hang
    try:
        run_read = load_run(args.run_dir)
    except SyncwiseError:
        if hang is None or args.other_run_dir is not None:
            raise
        if args.json_path:  # a run that hung before it wrote its summary: the hang alone
            text = json.dumps({"flight": hang}, indent=2, default=str) + "\n"
            print(text, end="") if args.json_path == "-" else Path(args.json_path).write_text(text)
        else:
            from rich.console import Console as _Console

            flight.print_flight(hang, _Console())
        return 0
    a = diagnose(run_read, predict=not args.no_predict)
    result = a
    if args.other_run_dir is not None:
        b = diagnose(load_run(args.other_run_dir), predict=not args.no_predict)
        result = compare(a, b)
    to_stdout = args.json_path == "-"
    if not to_stdout:
        console = Console()
        if args.other_run_dir is not None:
            print_comparison(result, console)
        else:
            print_diagnosis(result, console)
            if args.html_path != "none":
                from ..doctor.picture import write

                where = Path(args.html_path) if args.html_path else Path(args.run_dir) / "doctor.html"
                try:
                    console.print(f"picture: {write(result, where)}")
                except OSError as e:
                    console.print(f"[dim]note: no picture written to {where} ({e.strerror or e})[/dim]")
    if args.json_path:
        out = result.as_dict()
        if hasattr(result, "steady_steps"):  # one run: its communication per parallel dimension too
            from ..doctor.dimensions import by_dimension
            out["by_dimension"] = by_dimension(result.run.ranks, result.steady_steps)
            out["trace"] = result.trace  # None without --profile.* traces
            out["flight"] = hang  # None without a hang's dumps
        text = json.dumps(out, indent=2, default=str) + "\n"
        if to_stdout:
            print(text, end="")
        else:
            try:
                Path(args.json_path).write_text(text)
            except OSError as e:
                raise SyncwiseError(f"doctor: cannot write --json {args.json_path} ({e.strerror or e})") from None
    return 0
