"""Planted hangs across layouts: does `syncwise doctor` name the collective the ranks disagree on, and who is missing?

For each layout (DDP, FSDP2, tp 2, pp 2, ep 2; reliability.py's LAYOUTS, 2 ranks of `tiny`/`tiny-moe`) and each
planted cause, a real `syncwise train` with ``--dist.timeout_s=5`` is left to hang, then `syncwise doctor RUN
--json` is read (``flight``: the ranks' flight-recorder dumps aligned, syncwise.doctor.flight):

- ``stop``: ``--inject-fault hang:rank=R,step=S`` — rank R stops as step S begins (it never enters that step's
  collectives; the other rank times out inside the first one);
- ``sigstop``: SIGSTOP of a random worker at a random moment of a random step (it can be stopped inside a collective);
- ``kill``: SIGKILL of a random worker at a random moment of a random step, no restart (it can die inside a
  collective).

A trial counts as *named* when doctor gives the collective (op, process group, sequence number and the Python frame
that issued it) and lists the planted rank among the ranks that did not enter it (or that left no dump), and no
other rank there. Counts per layout and cause go to ``benchmarks/results/planted_hangs.json``.

    python benchmarks/planted_hangs.py --trials 2
    python benchmarks/planted_hangs.py --layouts ddp,tp2 --causes stop --trials 1
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reliability import HANG_TIMEOUT_S, LAYOUTS, RESULTS, _hostile_cmd, _Job, _wait_for_step  # noqa: E402

DEFAULT_LAYOUTS = ("ddp", "fsdp", "tp2", "pp2-1f1b", "ep2")
CAUSES = ("stop", "sigstop", "kill")


def _doctor(run: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "syncwise.cli", "doctor", str(run), "--json", "-", "--no-predict"],
                         capture_output=True, text=True, timeout=300)
    try:
        return json.loads(out.stdout).get("flight") or {}
    except ValueError:
        return {"error": (out.stderr or out.stdout)[-1000:]}


def trial(work: Path, layout: str, cause: str, n: int, rng: random.Random) -> dict:
    run = work / f"{layout}-{cause}-{n}"
    rank, step = rng.randrange(2), rng.randrange(3, 8)
    extra = [*LAYOUTS[layout], "--ckpt.interval=0", f"--dist.timeout_s={HANG_TIMEOUT_S}"]
    if cause == "stop":
        extra += ["--inject-fault", f"hang:rank={rank},step={step}"]
    row = {"layout": layout, "cause": cause, "trial": n, "rank": rank}
    job = _Job(_hostile_cmd(run, 12 if cause == "stop" else 1000, *extra))
    if cause == "stop":
        row["step"] = step
    else:
        if not _wait_for_step(run, step, job):
            job.kill()
            return {**row, "tried": False, "err": job.err()[-2000:]}
        time.sleep(rng.random() * 0.1)
        os.kill(job.workers()[rank], signal.SIGSTOP if cause == "sigstop" else signal.SIGKILL)
    code = job.wait(HANG_TIMEOUT_S + 120)
    job.kill()
    flight = _doctor(run)
    m = flight.get("first_mismatch") or {}
    absent = set(m.get("missing") or []) | set(m.get("no_dump") or [])
    named = bool(m.get("op")) and m.get("seq") is not None and bool(m.get("frame")) and absent == {rank}
    return {**row, "tried": True, "exit_code": code, "named": named, "op": m.get("op"), "group": m.get("group"),
            "seq": m.get("seq"), "frame": m.get("frame"), "missing": m.get("missing"), "no_dump": m.get("no_dump"),
            "ranks_dumped": flight.get("ranks_dumped"), "why": m.get("why"), "error": flight.get("error")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS))
    p.add_argument("--causes", default=",".join(CAUSES))
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default="/tmp/syncwise-planted-hangs")
    p.add_argument("--out", default=str(RESULTS / "planted_hangs.json"))
    args = p.parse_args()
    layouts = [x for x in args.layouts.split(",") if x]
    causes = [x for x in args.causes.split(",") if x]
    bad = [x for x in layouts if x not in LAYOUTS] + [x for x in causes if x not in CAUSES]
    if bad:
        raise SystemExit(f"unknown layout or cause {bad}: layouts {', '.join(LAYOUTS)}; causes {', '.join(CAUSES)}")
    rng = random.Random(args.seed)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for layout in layouts:
        for cause in causes:
            for n in range(args.trials):
                row = trial(work, layout, cause, n, rng)
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary: dict = {}
    for r in rows:
        s = summary.setdefault(r["layout"], {}).setdefault(r["cause"], {"tried": 0, "named": 0})
        s["tried"] += bool(r.get("tried"))
        s["named"] += bool(r.get("named"))
    Path(args.out).write_text(json.dumps({"command": "python benchmarks/planted_hangs.py " + " ".join(sys.argv[1:]),
                                          "timeout_s": HANG_TIMEOUT_S, "summary": summary, "runs": rows},
                                         indent=1) + "\n")
    print("| layout | " + " | ".join(causes) + " |\n|---|" + "---|" * len(causes))
    for layout, s in summary.items():
        print(f"| {layout} | " + " | ".join(f"{s[c]['named']}/{s[c]['tried']}" if c in s else "–" for c in causes)
              + " |")
    print(f"named: the collective and exactly the planted rank as missing. results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
