"""`syncwise report RUN [RUN ...]`: one look at one or more runs, during or after them.

For each run directory (its ``metrics.jsonl``, and ``summary.json`` once it finished) it draws, in one PNG:
train and validation loss against the step and against training time (the sum of the step times: the same axis
for a resumed run as for one that never stopped), each step's time, the average step split into compute, exposed
communication, data wait and the rest, the bytes each step sent, and tokens per second. An HTML page embeds that
picture and the curves' data (JSON, in ``<script id="syncwise-data">``) so it opens anywhere, and a one-screen
text comparison is printed. Files: ``--out DIR`` (default ``RUN/report`` for one run, ``./syncwise-report`` for
several) holds ``report.png`` and ``report.html``; a report there is replaced, any other file of those names is not.
"""
from __future__ import annotations

import argparse
import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from ..doctor import trace
from ..errors import ConfigError
from ..metrics import figures, read_jsonl
from ..metrics.units import human_bytes, human_seconds, loss
from ..rundir import RunDir

MARKER = "<!-- written by syncwise report -->"
SPLIT = (("compute_s", "compute"), ("comm_exposed_s", "exposed comm"), ("data_wait_s", "data wait"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register report's options on ``parser``."""
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directories (each with a metrics.jsonl)")
    parser.add_argument("--out", default=None, help="directory for report.png and report.html (default: RUN/report "
                                                    "for one run, ./syncwise-report for several)")


def load_run(path: Path) -> dict[str, Any]:
    """A run's curves and figures from its directory (a running run too: a torn last row is skipped)."""
    metrics = RunDir(path).metrics
    if not path.is_dir():
        raise ConfigError("RUN", str(path), "a run directory (syncwise train --run-dir DIR made it)")
    if not metrics.exists():
        raise ConfigError("RUN", str(path), "a run directory with a metrics.jsonl (it has none yet: the run has not "
                                            "finished a step, or this is not a run directory)")
    damaged: list[tuple[int, str]] = []
    try:
        raw = read_jsonl(metrics, damaged)
    except OSError as e:
        raise ConfigError("RUN", str(path), f"a run directory whose metrics.jsonl can be read ({metrics}: "
                                            f"{e.strerror or e})") from None
    rows = [r for _, r in sorted((_clean(r) for r in raw if _is_step_row(r)), key=lambda t: t[0])]
    skipped = len(damaged) + len(raw) - len(rows)
    if not rows:
        raise ConfigError("RUN", str(path), "a run with at least one step in its metrics.jsonl (it has none"
                          + (f": {skipped} line(s) there are not step rows)" if skipped else ": it is empty)"))
    try:
        summary = json.loads(RunDir(path).summary.read_text())
    except (OSError, ValueError):
        summary = None
    if not isinstance(summary, dict):  # a damaged summary: the run reads as unfinished
        summary = None
    elapsed, t = [], 0.0
    for r in rows:
        t += r.get("step_time_s") or 0.0
        elapsed.append(t)
    # the steady steps, tokens/s and train time by the summary's own rule (metrics.figures): the same figures
    # for the same run; a running run has no summary yet, so no warm-up steps are known to leave out
    warm = int((summary or {}).get("warmup_steps") or 0)
    kept, _, _ = figures.steady_steps(len(rows), int(rows[0].get("step", 1)), warm)
    steady = [rows[i] for i in kept] or rows
    n = len(steady)
    step_times = [r.get("step_time_s") or 0.0 for r in steady]
    split = {key: sum(r.get(key) or 0.0 for r in steady) / n for key, _ in SPLIT}
    step_s = sum(r.get("step_time_s") or 0.0 for r in steady) / n
    counted = [r["comm_bytes"] for r in steady if r.get("comm_bytes") is not None]
    val = [(r["step"], t, r["val_loss"]) for r, t in zip(rows, elapsed) if r.get("val_loss") is not None]
    return {
        "name": path.name, "path": str(path), "finished": summary is not None,
        "steps": rows[-1]["step"],
        "curves": {
            "step": [r["step"] for r in rows], "train_time_s": elapsed,
            "loss": [r.get("loss") for r in rows],
            "val_step": [v[0] for v in val], "val_time_s": [v[1] for v in val], "val_loss": [v[2] for v in val],
            "step_time_s": [r.get("step_time_s") for r in rows],
            "comm_bytes": [r.get("comm_bytes") for r in rows],
            "tokens_per_s": [r.get("tokens_per_s") for r in rows],
        },
        "mean_step_time_s": step_s,
        "split_s": {**split, "other_s": max(0.0, step_s - sum(split.values()))},
        "comm_bytes_per_step": sum(counted) / len(counted) if counted and len(counted) == n else None,
        # the same bytes per hop (metrics.figures.hop_means); None: one node, hops not known, or not counted
        "hop_bytes_per_step": figures.hop_means(steady),
        "tokens_per_s": figures.tokens_per_s([(r.get("tokens_per_s") or 0.0) * t for r, t in zip(steady, step_times)],
                                             step_times),
        "final_loss": next((r["loss"] for r in reversed(rows) if r.get("loss") is not None), None),
        "final_val_loss": val[-1][2] if val else None,
        "train_time_s": figures.train_time_s([r.get("step_time_s") or 0.0 for r in rows]),
        "summary": summary,
        "skipped_rows": skipped,
        "timeline": trace.timeline(path),  # one profiled step per rank, where --profile.* recorded traces
    }


NUMBERS = ("loss", "val_loss", "step_time_s", "comm_bytes", "tokens_per_s", *(key for key, _ in SPLIT))


def _is_step_row(row: Any) -> bool:
    return isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row.get("step"), bool)


def _clean(row: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(step, the row with every figure the report draws a finite number or None): an edited or damaged value is
    a gap in its curve, not a TypeError."""
    import math

    out = dict(row)
    for key in NUMBERS:
        v = out.get(key)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
            out[key] = None
    return row["step"], out


def _names(runs: list[dict[str, Any]]) -> None:
    """Distinct labels: the directory's name, with its parent's where two runs share a name."""
    seen: dict[str, int] = {}
    for r in runs:
        seen[r["name"]] = seen.get(r["name"], 0) + 1
    for r in runs:
        if seen[r["name"]] > 1:
            r["name"] = f"{Path(r['path']).parent.name}/{r['name']}"


#: how the timeline draws a step's intervals (syncwise.doctor.trace.timeline): lane, colour, label
LANES = (("compute", "C0", "compute"), ("overlapped", "C1", "communication beside compute"),
         ("exposed", "C3", "exposed communication"), ("compress", "C8", "compression on the critical path"),
         ("launch", "C2", "launch overhead (GPU)"))


def _draw_timeline(ax: Any, r: dict[str, Any]) -> None:
    """One profiled step of one run, a row per rank: compute, communication (exposed / beside compute), and under
    it, per parallel dimension where the trace names the groups; launch overhead on a GPU trace (the device idle
    while a kernel launch was under way); what is left blank is host-bound."""
    t = r["timeline"]
    ranks = sorted(t["ranks"])
    ticks = []
    for y, rank in enumerate(ranks):
        lanes = t["ranks"][rank]
        base = y * 2
        for key, color, label in LANES:
            ax.broken_barh([(a, b - a) for a, b in lanes.get(key, [])], (base, 0.8), color=color,
                           label=label if y == 0 else None)
        dims = sorted(k for k in lanes if k.startswith("dim:"))
        for j, key in enumerate(dims):
            ax.broken_barh([(a, b - a) for a, b in lanes[key]], (base + 0.9, 0.5), color=f"C{4 + j}",
                           label=f"{key[4:]} collectives" if y == 0 else None)
        ax.plot([0, lanes["step_ms"]], [base - 0.1] * 2, color="0.6", linewidth=1)
        ticks.append((base + 0.4, f"rank {rank}"))
    ax.set_yticks([a for a, _ in ticks], [b for _, b in ticks])
    ax.invert_yaxis()
    ax.set_title(f"{r['name']}: step {t['step']} inside (torch profiler trace; blank = host-bound)")
    ax.set_xlabel("ms from the step's start")


def draw(runs: list[dict[str, Any]]) -> bytes:
    """The report's figure as PNG bytes (with a row of step timelines where a run recorded profiler traces)."""
    from ..extras import pyplot

    plt = pyplot("syncwise report (its picture)")

    traced = [r for r in runs if r.get("timeline")]
    fig = plt.figure(figsize=(16, 9 + 3 * bool(traced)), dpi=100)
    grid = fig.add_gridspec(2 + bool(traced), 3)
    axes = [[fig.add_subplot(grid[i, j]) for j in range(3)] for i in range(2)]
    (ax_step, ax_time, ax_st), (ax_split, ax_bytes, ax_tps) = axes
    for k, r in enumerate(traced[:3]):  # a timeline each, the first three traced runs
        _draw_timeline(fig.add_subplot(grid[2, k] if len(traced) > 1 else grid[2, :]), r)
    for i, r in enumerate(runs):
        c, color = r["curves"], f"C{i}"
        ax_step.plot(c["step"], c["loss"], color=color, label=f"{r['name']} train")
        ax_time.plot(c["train_time_s"], c["loss"], color=color, label=f"{r['name']} train")
        if c["val_loss"]:
            ax_step.plot(c["val_step"], c["val_loss"], "o--", color=color, label=f"{r['name']} val")
            ax_time.plot(c["val_time_s"], c["val_loss"], "o--", color=color, label=f"{r['name']} val")
        ax_st.plot(c["step"], [None if v is None else v * 1e3 for v in c["step_time_s"]], color=color, label=r["name"])
        if any(b is not None for b in c["comm_bytes"]):
            ax_bytes.plot(c["step"], [None if b is None else b / 1e6 for b in c["comm_bytes"]], color=color,
                          label=r["name"])
        ax_tps.plot(c["step"], c["tokens_per_s"], color=color, label=r["name"])
    left = [0.0] * len(runs)
    names = [r["name"] for r in runs]
    for j, (key, label) in enumerate((*SPLIT, ("other_s", "other"))):
        widths = [r["split_s"][key] * 1e3 for r in runs]
        ax_split.barh(names, widths, left=left, color=f"C{j}", label=label)
        left = [a + b for a, b in zip(left, widths)]
    for ax, title, xlabel, ylabel in (
            (ax_step, "loss vs step", "step", "loss"),
            (ax_time, "loss vs training time", "training time (s, sum of step times)", "loss"),
            (ax_st, "step time", "step", "ms"),
            (ax_split, "average step (after the first tenth)", "ms", ""),
            (ax_bytes, "bytes sent per step (counted at the collectives)", "step", "MB"),
            (ax_tps, "throughput", "step", "tokens/s")):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    for ax in fig.axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    ax_split.invert_yaxis()
    fig.suptitle("syncwise report: " + ", ".join(names))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def text(runs: list[dict[str, Any]]) -> str:
    """The one-screen comparison: a row per run."""
    head = ("run", "steps", "loss", "val loss", "step", "compute", "comm", "data", "sent/step", "cross-node/step",
            "tokens/s", "time")
    rows = []
    for r in runs:
        t = r["mean_step_time_s"] or 0.0
        share = lambda key: f"{100 * r['split_s'][key] / t:.0f}%" if t else "–"  # noqa: E731
        rows.append((r["name"] + ("" if r["finished"] else " (running)"), str(r["steps"]), loss(r["final_loss"]),
                     loss(r["final_val_loss"]), human_seconds(r["mean_step_time_s"]), share("compute_s"),
                     share("comm_exposed_s"), share("data_wait_s"), human_bytes(r["comm_bytes_per_step"]),
                     _cross(r), f"{r['tokens_per_s']:,.0f}", human_seconds(r["train_time_s"])))
    widths = [max(len(x[i]) for x in (head, *rows)) for i in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(head), *(line(x) for x in rows)])


def _cross(run: dict[str, Any]) -> str:
    """The comparison's cross-node bytes per step: the figure where the rows split by hop, else what is known
    instead — 'one node' (nothing crosses), or '–' (hops not known)."""
    said = str((run.get("summary") or {}).get("comm_hops") or "")
    if said.startswith("one node"):
        return "one node"
    hops = run.get("hop_bytes_per_step")
    return human_bytes(hops["cross"]) if hops is not None else "–"


def page(runs: list[dict[str, Any]], png: bytes, comparison: str) -> str:
    """The HTML page: the picture (embedded), the comparison, and the curves' data as JSON."""
    data = json.dumps({"runs": [{k: v for k, v in r.items() if k != "summary"} | {"summary": r["summary"]}
                                for r in runs]}).replace("</", "<\\/")
    title = "syncwise report: " + ", ".join(r["name"] for r in runs)
    return (f"<!DOCTYPE html>\n{MARKER}\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;margin:2em}pre{background:#f5f5f5;padding:1em}</style></head><body>\n"
            f"<h1>{html.escape(title)}</h1>\n<pre>{html.escape(comparison)}</pre>\n"
            f"<img alt=\"curves\" style=\"max-width:100%\" src=\"data:image/png;base64,{base64.b64encode(png).decode()}\">\n"
            "<p>Training time is the sum of the step times. The curves' data: the JSON below "
            "(<code>document.getElementById('syncwise-data')</code>).</p>\n"
            f"<script type=\"application/json\" id=\"syncwise-data\">{data}</script>\n</body></html>\n")


def _out_dir(args: argparse.Namespace) -> Path:
    if args.out:
        return Path(args.out)
    return Path(args.runs[0]) / "report" if len(args.runs) == 1 else Path("syncwise-report")


def run(args: argparse.Namespace) -> int:
    """`syncwise report` entry point."""
    runs = [load_run(Path(p)) for p in args.runs]  # every bad RUN fails here, before anything is written
    _names(runs)
    out = _out_dir(args)
    html_path, png_path = out / "report.html", out / "report.png"
    if (html_path.is_file() and MARKER not in html_path.read_text(errors="replace")) or (
            html_path.exists() and not html_path.is_file()) or (png_path.exists() and not html_path.exists()):
        raise ConfigError("--out", str(out), "a directory without a report.html / report.png of someone else's "
                                             "(those there were not written by syncwise report): choose another --out")
    comparison = text(runs)
    png = draw(runs)
    try:
        out.mkdir(parents=True, exist_ok=True)
        png_path.write_bytes(png)
        html_path.write_text(page(runs, png, comparison))
    except OSError as e:
        raise ConfigError("--out", str(out), f"a directory the report can be written to ({e.filename}: "
                                             f"{e.strerror or e})") from None
    for r in runs:
        if r["skipped_rows"]:
            print(f"note: {r['name']}: {r['skipped_rows']} line(s) of its metrics.jsonl are not step rows (damaged "
                  "or edited): skipped")
    print(comparison)
    for r in runs:
        if r["timeline"]:
            print(f"{r['name']}: step {r['timeline']['step']} of its profiler traces drawn per rank (compute, "
                  "exposed and overlapped communication, launch overhead on a GPU trace, host-bound)")
    print(f"picture: {png_path}\npage: {html_path}  (open it in a browser)")
    return 0
