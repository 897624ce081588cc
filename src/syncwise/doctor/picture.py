"""Doctor's picture: one self-contained HTML page (inline SVG, no scripts, no network) beside the text report.

* **Per-rank timeline** — the last steady steps, one row per rank on the shared wall clock: each step as a bar,
  each collective this rank issued as a tick where it arrived (flight recorder), red where it was the last rank
  to arrive at that collective. A straggler shows as a row whose ticks sit to the right of the others'.
* **Per-step breakdown** — for every step, the straggler's (else rank 0's) step split into compute, waiting for
  data, exposed communication and the rest, with the steps the straggler was late in marked; and the steady
  step's breakdown as doctor computed it (``Diagnosis.parts``).
* The verdict and the findings, as in the text report.
"""
from __future__ import annotations

import html
from pathlib import Path

from .analyze import PART_WORDS, PARTS, Diagnosis

COLOURS = {"compute": "#4e79a7", "straggler_wait": "#e15759", "data_wait": "#f28e2b", "compress": "#b07aa1",
           "comm_dp": "#59a14f", "comm_ep": "#76b7b2", "expert_wait": "#ff9da7", "pp_bubble": "#9c755f",
           "checkpoint": "#bab0ac", "other": "#d4d4d4"}
STEP_PARTS = (("compute_s", "compute", COLOURS["compute"]), ("data_wait_s", "waiting for data", COLOURS["data_wait"]),
              ("comm_exposed_s", "exposed communication", COLOURS["comm_dp"]), ("rest", "other", COLOURS["other"]))
WIDTH = 960


def _esc(x: object) -> str:
    return html.escape(str(x))


def timeline_svg(d: Diagnosis, max_steps: int = 8) -> str:
    """The per-rank arrival timeline of the last ``max_steps`` steady steps ('' without arrivals)."""
    arr = d.arrivals
    if arr is None:
        return ""
    steps = [s for s in d.steady_steps if s in arr.span][-max_steps:]
    if not steps:
        return ""
    t0 = min(arr.span[s][0] for s in steps)
    t1 = max(arr.span[s][1] for s in steps)
    scale = (WIDTH - 80) / max(t1 - t0, 1)
    row_h, top = 28, 24
    last_of: dict[tuple[int, int], int] = {}
    for s in steps:
        times: dict[tuple[int, int], dict[int, int]] = {}
        for r in arr.ranks:
            row = arr.rows[r][s]
            for c in row["c"]:
                times.setdefault((c[0], c[1]), {})[r] = row["start_ns"] + c[4]
        for key, t in times.items():
            if len(t) == len(arr.ranks):
                last_of[key] = max(t, key=t.get)
    h = top + row_h * len(arr.ranks) + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{h}" font-family="sans-serif" '
           'font-size="11">']
    for i, r in enumerate(arr.ranks):
        y = top + i * row_h
        out.append(f'<text x="4" y="{y + 16}">rank {r}</text>')
        for s in steps:
            row = arr.rows[r][s]
            x0 = 70 + (row["start_ns"] - t0) * scale
            x1 = 70 + (row["end_ns"] - t0) * scale
            out.append(f'<rect x="{x0:.1f}" y="{y + 4}" width="{max(x1 - x0, 1):.1f}" height="{row_h - 8}" '
                       f'fill="#e8eef6" stroke="#9fb3c8"><title>rank {r} step {s}: '
                       f'{(row["end_ns"] - row["start_ns"]) / 1e6:.1f} ms</title></rect>')
            for c in row["c"]:
                x = 70 + (row["start_ns"] + c[4] - t0) * scale
                late = last_of.get((c[0], c[1])) == r
                out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y + 4}" y2="{y + row_h - 4}" '
                           f'stroke="{"#d62728" if late else "#1f3b5a"}" stroke-width="{2 if late else 1}">'
                           f'<title>{_esc(c[2])} #{c[1]} ({c[3]} elements), step {s}, +{c[4] / 1e6:.2f} ms'
                           f'{" — last to arrive" if late else ""}</title></line>')
    for s in steps:
        x = 70 + (arr.span[s][0] - t0) * scale
        out.append(f'<text x="{x + 2:.1f}" y="{top - 6}" fill="#555">step {s}</text>')
    out.append(f'<text x="70" y="{h - 8}" fill="#555">{(t1 - t0) / 1e6:,.0f} ms of wall time; ticks: arrival at '
               'a collective (red: the last rank to arrive at it)</text></svg>')
    return "".join(out)


def breakdown_svg(d: Diagnosis) -> str:
    """Stacked bars: every step of one rank (the straggler, else rank 0), then the steady mean by doctor's parts."""
    v = d.verdict
    rank = v.rank if v is not None and v.rank is not None else (0 if 0 in d.run.ranks else min(d.run.ranks))
    rows = d.run.ranks[rank]
    late = set(v.late_steps) if v is not None and v.rank == rank else set()
    if not rows:
        return ""
    peak = max(max(float(r.get("step_time_s", 0)) for r in rows), d.wall_s, 1e-9)
    bar_w = max(3.0, min(24.0, (WIDTH - 200) / max(len(rows), 1) - 2))
    chart_h, top = 180, 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{chart_h + top + 60}" '
           'font-family="sans-serif" font-size="11">']
    out.append(f'<text x="4" y="12">rank {rank}, each step (ms; ▲ the steps it arrived last in)</text>')
    x = 40.0
    for row in rows:
        total = float(row.get("step_time_s", 0))
        parts = {k: max(0.0, float(row.get(k) or 0)) for k in ("compute_s", "data_wait_s", "comm_exposed_s")}
        parts["rest"] = max(0.0, total - sum(parts.values()))
        y = top + chart_h
        for key, word, colour in STEP_PARTS:
            hgt = parts[key] / peak * chart_h
            y -= hgt
            out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w:.1f}" height="{hgt:.1f}" fill="{colour}">'
                       f'<title>step {row["step"]}: {word} {parts[key] * 1e3:.1f} ms</title></rect>')
        if row["step"] in late:
            out.append(f'<text x="{x:.1f}" y="{top + chart_h + 12}" fill="#d62728">▲</text>')
        x += bar_w + 2
    # the steady mean by doctor's parts
    x += 20
    y = top + chart_h
    for k in PARTS:
        hgt = d.parts[k] / peak * chart_h
        if hgt <= 0:
            continue
        y -= hgt
        out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="40" height="{hgt:.1f}" fill="{COLOURS[k]}">'
                   f'<title>{PART_WORDS[k]} {d.parts[k] * 1e3:.1f} ms</title></rect>')
    out.append(f'<text x="{x - 4:.1f}" y="{top + chart_h + 24}">doctor</text>')
    lx = 40
    for key, word, colour in STEP_PARTS:
        out.append(f'<rect x="{lx}" y="{top + chart_h + 34}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="{lx + 14}" y="{top + chart_h + 43}">{word}</text>')
        lx += 150
    out.append(f'<rect x="{lx}" y="{top + chart_h + 34}" width="10" height="10" fill="{COLOURS["straggler_wait"]}"/>'
               f'<text x="{lx + 14}" y="{top + chart_h + 43}">waiting for a slow rank (doctor bar)</text></svg>')
    return "".join(out)


def render(d: Diagnosis) -> str:
    """The whole page."""
    from .report import headline

    findings = "".join(
        f"<li><b>{_esc(x.title)}</b> — {x.lost_s * 1e3:,.1f} ms/step ({100 * x.lost_s / d.wall_s:.0f} %): "
        f"{_esc(x.evidence)}.<br>→ {_esc(x.recommendation)}"
        + (f" <code>{_esc(x.flag)}</code>" if x.flag else "")
        + (f" (predicted step {x.predicted_step_s * 1e3:,.0f} ms, {_esc(x.predicted_by)})"
           if x.predicted_step_s else f" ({_esc(x.predicted_by)})" if x.predicted_by else "") + "</li>"
        for x in d.findings)
    parts = "".join(f"<tr><td>{_esc(PART_WORDS[k])}</td><td>{d.parts[k] * 1e3:,.1f}</td>"
                    f"<td>{100 * d.parts[k] / d.wall_s:.0f} %</td></tr>" for k in PARTS
                    if d.parts[k] > 0 or k == "compute")
    timeline = timeline_svg(d)
    return ("<!doctype html><html><head><meta charset='utf-8'><title>syncwise doctor</title><style>"
            "body{font-family:sans-serif;max-width:1000px;margin:20px auto}td{padding:2px 10px}"
            "code{background:#f2f2f2}</style></head><body>"
            f"<h2>syncwise doctor — {_esc(d.run.path)}</h2>"
            f"<p>{d.world_size} rank(s), {_esc(d.facts.get('layout') or 'layout not recorded')}, {d.steps} steps "
            f"({len(d.steady_steps)} steady), step {d.step_s * 1e3:,.1f} ms, parallel efficiency "
            f"{d.efficiency:.2f}</p><p><b>verdict:</b> {_esc(headline(d))}</p>"
            "<h3>Per-rank timeline (arrival at each collective)</h3>"
            + (timeline or "<p>no arrivals recorded (one rank, or a run from before ranks/arrivals*.jsonl)</p>")
            + "<h3>Per-step breakdown</h3>" + breakdown_svg(d)
            + f"<table><tr><th>part</th><th>ms / step</th><th>share</th></tr>{parts}</table>"
            + f"<h3>Causes, by time lost</h3><ol>{findings or '<li>none over 5 % of the step</li>'}</ol>"
            + "".join(f"<p><i>note: {_esc(n)}</i></p>" for n in d.notes) + "</body></html>\n")


def write(d: Diagnosis, path: "str | Path") -> Path:
    p = Path(path)
    p.write_text(render(d))
    return p
