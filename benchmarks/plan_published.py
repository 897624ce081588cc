"""The planner against published large-scale runs: prediction, error and where the published layout ranks in
the planner's own search, for every run in syncwise.plan.published (sources and assumptions listed there).

    python benchmarks/plan_published.py            # -> benchmarks/results/plan-published.json

Pure Python, a few seconds, no GPU: the runs are the publications' (A100 / H100 clusters of 32 to 16,384 GPUs).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from syncwise.plan.published import evaluate, runs  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=str(Path(__file__).parent / "results" / "plan-published.json"))
    a = p.parse_args()
    rows = [evaluate(r) for r in runs()]
    confident = [r for r in rows if r["confident"]]
    mae = lambda rs: sum(abs(r["error"]) for r in rs) / len(rs) if rs else None  # noqa: E731
    summary = {"runs": len(rows), "publications": len({r["publication"] for r in rows}),
               "mean_abs_error_all": mae(rows), "mean_abs_error_confident": mae(confident),
               "mean_error_all": sum(r["error"] for r in rows) / len(rows),
               "paper_layout_in_top3": sum(1 for r in rows if r.get("paper_layout_rank") and
                                           r["paper_layout_rank"] <= 3)}
    print(f"{'run':32s} {'layout':44s} {'metric':15s} {'reported':>9s} {'predicted':>9s} {'error':>7s}  rank  top-3 (tp, pp)")
    for r in rows:
        flag = "" if r["confident"] else " (?)"
        print(f"{r['name'] + flag:32s} {r['layout'][:44]:44s} {r['metric']:15s} {r['reported']:9.1f} "
              f"{r['predicted']:9.1f} {r['error']:+7.1%}  {str(r.get('paper_layout_rank')):>4s}  "
              f"{', '.join(r.get('planner_top3', []))}")
    print(json.dumps(summary, indent=2))
    Path(a.json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
