"""Printing a diagnosis (rich tables and plain sentences) for people."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .analyze import PART_WORDS, PARTS, Diagnosis
from .compare import Comparison
from .dimensions import by_dimension, lines


def headline(d: Diagnosis) -> str:
    """One sentence: the top cause, its share of the step, and the predicted effect of the top recommendation."""
    top = d.top
    if top is None:
        return (f"no cause loses more than 5 % of the step; parallel efficiency is {d.efficiency:.2f} "
                f"(compute {d.parts['compute'] * 1e3:,.0f} ms of a {d.wall_s * 1e3:,.0f} ms step)")
    text = f"{top.title}: {top.lost_s / d.wall_s * 100:.0f} % of the step is lost to it"
    if top.flag and top.predicted_efficiency is not None:
        text += (f"; `{top.flag}` is predicted to take efficiency from {d.efficiency:.2f} to "
                 f"{top.predicted_efficiency:.2f} ({top.predicted_by})")
    elif top.predicted_efficiency is not None:
        text += f"; without it efficiency would be {top.predicted_efficiency:.2f} instead of {d.efficiency:.2f}"
    elif top.predicted_by:
        text += f"; no change recommended with a prediction ({top.predicted_by})"
    return text


def hop_line(facts: dict) -> str:
    """Rank 0's bytes per step by hop, or what is known instead (one node: nothing crosses; hops not known)."""
    from ..metrics.units import human_bytes

    hops, said = facts.get("hop_bytes_per_step"), facts.get("comm_hops")
    if hops and not (said and said.startswith(("one node", "topology unknown"))):
        unsplit = f", {human_bytes(hops['unsplit'])} no hop known" if hops.get("unsplit") else ""
        return (f"bytes per step by hop (rank 0): {human_bytes(hops['cross'])} cross-node (the slow link), "
                f"{human_bytes(hops['intra'])} inside a node{unsplit}")
    return f"bytes per hop: {said}" if said else "bytes per hop: not recorded (a run from before they were counted)"


def print_diagnosis(d: Diagnosis, console: Console) -> None:
    f = d.facts
    console.print(f"[bold]syncwise doctor[/bold] — {d.run.path}")
    console.print(f"{d.world_size} rank(s), {f.get('layout') or 'layout not recorded'}, compressor "
                  f"{f.get('compressor')}, {d.steps} steps ({len(d.steady_steps)} steady); step "
                  f"{d.step_s * 1e3:,.1f} ms" + (f" + {d.parts['checkpoint'] * 1e3:,.1f} ms checkpoint stall"
                                                  if d.wall_s > d.step_s else "")
                  + f"; parallel efficiency {d.efficiency:.2f}")
    table = Table(title="where the step goes", show_edge=False)
    table.add_column("part")
    table.add_column("ms / step", justify="right")
    table.add_column("share", justify="right")
    for k in PARTS:
        v = d.parts[k]
        if v > 0 or k == "compute":
            table.add_row(PART_WORDS[k], f"{v * 1e3:,.1f}", f"{100 * v / d.wall_s:.0f} %" if d.wall_s else "-")
    console.print(table)
    dims = by_dimension(d.run.ranks, d.steady_steps)
    if dims:
        comm = Table(title="communication by dimension (bytes: all ranks; ms: the mean rank)",
                     show_edge=False)
        for col in ("dimension", "MB / step", "ms / step", "exposed ms", "exposed share"):
            comm.add_column(col, justify="left" if col == "dimension" else "right")
        for row in lines(dims):
            comm.add_row(*row)
        console.print(comm)
    console.print(hop_line(f))
    if len(d.per_rank) > 1:
        ranks = Table(title="per rank (steady steps, ms)", show_edge=False)
        for col in ("rank", "step", "compute", "data wait", "exposed comm", "compress", "expert a2a"):
            ranks.add_column(col, justify="right")
        for r, v in sorted(d.per_rank.items()):
            ranks.add_row(str(r), *(f"{v[k] * 1e3:,.1f}" for k in ("step_time_s", "own_compute_s", "data_wait_s",
                                                                  "comm_exposed_s", "compress_s", "ep_comm_s")))
        console.print(ranks)
    from .trace import print_traces  # RUN_DIR/traces, when --profile.* recorded some
    print_traces(d.trace, console)
    from .flight import print_flight, summarize as hang  # RUN_DIR/flight, when a hang dumped the flight recorders
    print_flight(hang(d.run.path), console)
    if d.findings:
        causes = Table(title="causes of lost efficiency, by time lost", show_edge=False)
        causes.add_column("#", justify="right")
        causes.add_column("cause")
        causes.add_column("lost ms", justify="right")
        causes.add_column("share", justify="right")
        causes.add_column("change")
        causes.add_column("predicted efficiency", justify="right")
        for i, x in enumerate(d.findings, 1):
            causes.add_row(str(i), x.title, f"{x.lost_s * 1e3:,.1f}", f"{100 * x.lost_s / d.wall_s:.0f} %",
                           x.flag or "-", f"{d.efficiency:.2f} → {x.predicted_efficiency:.2f}"
                           if x.predicted_efficiency is not None else "-")
        console.print(causes)
        for i, x in enumerate(d.findings, 1):
            console.print(f"{i}. [bold]{x.title}[/bold]: {x.evidence}.")
            if x.recommendation:
                console.print(f"   → {x.recommendation}" + (f" (predicted step {x.predicted_step_s * 1e3:,.0f} ms, "
                                                             f"{x.predicted_by})" if x.predicted_step_s else
                                                             f" ({x.predicted_by})" if x.predicted_by else ""))
    console.print(f"[bold]verdict:[/bold] {headline(d)}")
    for note in d.notes:
        console.print(f"[dim]note: {note}[/dim]")


def print_comparison(c: Comparison, console: Console) -> None:
    console.print(f"[bold]syncwise doctor[/bold] — A: {c.a.run.path}   B: {c.b.run.path}")
    table = Table(title="the step, A against B (ms / step)", show_edge=False)
    for col in ("part", "A", "B", "Δ"):
        table.add_column(col, justify="right" if col != "part" else "left")
    for k, x, y in c.parts:
        if x > 0 or y > 0:
            table.add_row(PART_WORDS[k], f"{x * 1e3:,.1f}", f"{y * 1e3:,.1f}", f"{(y - x) * 1e3:+,.1f}")
    table.add_row("[bold]step + stall[/bold]", f"{c.a.wall_s * 1e3:,.1f}", f"{c.b.wall_s * 1e3:,.1f}",
                  f"{(c.b.wall_s - c.a.wall_s) * 1e3:+,.1f}")
    console.print(table)
    for line in c.summary.splitlines():
        console.print(line)
    for name, d in (("A", c.a), ("B", c.b)):
        console.print(f"[bold]{name}:[/bold] {headline(d)}")
