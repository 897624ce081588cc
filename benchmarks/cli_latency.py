"""How long a CLI mistake takes to be told: wall time from `syncwise ...` to its one-line error, per case.

    python benchmarks/cli_latency.py [--repeats 5] [--out benchmarks/results/cli-latency.json]

Each case is a fresh process (the `syncwise` console script's entry, `syncwise.cli:main`) that must exit 2 with one
line naming the field; the median of the repeats is reported beside the time of `python -c "import torch"` on the
same machine, the floor every error paid when torch was imported before validation (tests/test_first_contact.py
asserts the same cases never import torch). Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "negative steps": ["train", "--steps=-1"],
    "unknown compressor": ["train", "--compress", "bogus"],
    "misspelt option": ["train", "--stpes", "10"],
    "tp not a number": ["train", "--parallel.tp=abc"],
    "bad fault spec": ["train", "--inject-fault", "kill:rank=x"],
    "doctor, missing run dir": ["doctor", "/nonexistent/syncwise-run"],
    "report, missing run dir": ["report", "/nonexistent/syncwise-run"],
}


ENTRY = "import sys; from syncwise.cli import main; sys.exit(main())"  # what the console script runs


def _time(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=None)
    return time.perf_counter() - t0, r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/cli-latency.json"))
    args = ap.parse_args(argv)
    py = sys.executable
    torch_s = statistics.median(_time([py, "-c", "import torch"])[0] for _ in range(args.repeats))
    rows = []
    print(f"{'case':<26} {'median s':>9}  exit  first line of the error")
    for name, cli in CASES.items():
        times, r = [], None
        for _ in range(args.repeats):
            t, r = _time([py, "-c", ENTRY, *cli])
            times.append(t)
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        row = {"case": name, "argv": cli, "median_s": round(statistics.median(times), 3),
               "max_s": round(max(times), 3), "exit": r.returncode, "stderr_lines": len(lines),
               "error": lines[0] if lines else ""}
        rows.append(row)
        print(f"{name:<26} {row['median_s']:>9.3f}  {r.returncode:>4}  {row['error'][:90]}")
    worst = max(r["median_s"] for r in rows)
    print(f"`import torch` alone: {torch_s:.3f} s; slowest error {worst:.3f} s "
          f"({worst / torch_s:.2f} of importing torch)")
    Path(args.out).write_text(json.dumps({"repeats": args.repeats, "import_torch_s": round(torch_s, 3),
                                          "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
