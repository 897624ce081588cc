"""Fit the convergence model (issue 41) from the committed time-to-loss results, check it on a held-out horizon, and
write its parameters for the package.

    python benchmarks/convergence_fit.py                       # inventory, fit, held-out check, write both files
    python benchmarks/convergence_fit.py --holdout 300         # hold out another horizon
    python benchmarks/convergence_fit.py --with-smoke          # also fit the 30-step smoke run (not by default)

Reads every ``benchmarks/results/*.json``; a file carries steps to the target per strategy when it is a
benchmarks/time_to_loss.py (or auto_choice.py's per-rate) results file: ``rows`` with fp32 DDP ('none') first and
``rounds[].steps_to_target``. Each strategy in each such file is one point (preset, horizon = fp32 DDP's ``--steps``,
replicas from ``where``, steps or 'not within the cap'). Writes ``benchmarks/results/convergence-fit.json`` (the
inventory, the points, the fit, the held-out check) and ``src/syncwise/plan/convergence-model.json`` (what
``syncwise.plan.convergence_model.load_model`` reads). Pure Python; no training is run.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from syncwise.plan import convergence_model as M   # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def points_of(path: Path, data: dict) -> tuple[list[M.Point], str]:
    """The points of one results file, or ([], why it carries none)."""
    return M.points_from_results(data, str(path.relative_to(ROOT)))


#: results kept out of the fit: auto's held-out lab points, with and without its probe (RESULTS.md §15), the evidence the
#: fit is checked against
HELD_OUT = ("auto-heldout-", "auto-probe-")


def inventory() -> tuple[list[dict], list[M.Point]]:
    rows, pts = [], []
    for f in sorted(RESULTS.glob("*.json")):
        if f.name.startswith(HELD_OUT):
            continue
        try:
            data = json.loads(f.read_text())
        except ValueError:
            continue
        got, why = points_of(f, data)
        if not got and "steps_to_target" not in f.read_text():
            continue   # not a time-to-loss file at all: not listed
        rows.append({"file": str(f.relative_to(ROOT)), "points": len(got), "why_not": why,
                     **({"preset": got[0].preset, "horizon": got[0].horizon, "replicas": got[0].replicas,
                         "smoke": got[0].smoke, "strategies": sorted({p.spec for p in got})} if got else {})})
        pts += got
    return rows, pts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--holdout", type=int, default=1000, help="the horizon held out of the check's fit (default 1000)")
    ap.add_argument("--with-smoke", action="store_true", help="also fit smoke runs (30 steps, another warm-up)")
    ap.add_argument("--json", default=str(RESULTS / "convergence-fit.json"))
    ap.add_argument("--model-out", default=str(ROOT / "src" / "syncwise" / "plan" / "convergence-model.json"))
    args = ap.parse_args(argv)
    command = "python benchmarks/convergence_fit.py" + (f" --holdout {args.holdout}" if args.holdout != 1000 else "") \
        + (" --with-smoke" if args.with_smoke else "")

    inv, pts = inventory()
    print("inventory (files carrying steps to fp32 DDP's target):")
    for r in inv:
        what = (f"{r['preset']}, {r['horizon']} steps, {r['replicas']} replicas{', SMOKE' if r['smoke'] else ''}: "
                f"{r['points']} points" if r["points"] else f"not used: {r['why_not']}")
        print(f"  {r['file']}: {what}")
    use = [p for p in pts if args.with_smoke or not p.smoke]
    model = M.fit(use, command=command)
    print(f"\nfit: {model.basis()}; h_ref {model.h_ref:.0f} steps")
    print("  family slopes b (log ratio per log horizon): "
          + ", ".join(f"{f} {v:+.3f}" for f, v in sorted(model.b.items())))
    print("  sigma (RMS leave-one-out log error): " + ", ".join(f"{f} {v:.3f}" for f, v in sorted(model.sigma.items())))
    for s in sorted(model.a):
        print(f"  {s:42s} ratio at {model.h_ref:.0f}: {math.exp(model.a[s]):.3f}"
              + ("" if any(p.reached for p in model.measured(s)) else " (lower bound: never reached)"))

    # held-out horizon: fit without it, predict its reached points (strategies with a point elsewhere)
    train = [p for p in model.points if p.horizon != args.holdout]
    test = [p for p in model.points if p.horizon == args.holdout and p.spec != "none"]
    held = M.fit(train, h_ref=model.h_ref)
    fp32_frac = [p.fp32_steps / p.horizon for p in train if p.spec == "none"]
    frac = sum(fp32_frac) / len(fp32_frac)
    print(f"\nheld out: every point at horizon {args.holdout} (fit on horizons {held.horizons}); fp32 DDP's steps "
          f"predicted as {frac:.3f} × horizon (mean over the fitted runs)")
    rows, errs = [], []
    for p in test:
        pr = held.predict(p.spec, p.horizon, p.replicas)
        fp32_pred = frac * p.horizon
        row = {"spec": p.spec, "measured_steps": p.steps, "measured_ratio": p.ratio, "fp32_measured": p.fp32_steps,
               "fp32_predicted": fp32_pred}
        if pr.ratio is None:
            row["predicted"] = None
            row["why"] = ("no point prediction: never reached at the fitted horizons"
                          + (f" (at least {pr.at_least:.2f}×)" if pr.at_least else "")
                          if p.spec in held.a else "not in the fitted data")
        else:
            steps_pred = pr.ratio * fp32_pred
            row.update(predicted_ratio=pr.ratio, band=[pr.low, pr.high], predicted_steps=steps_pred)
            if p.reached:
                err = steps_pred / p.steps - 1
                row.update(error=err, in_band=pr.low <= p.ratio <= pr.high)
                errs.append(err)
            else:
                row.update(error=None, why=f"measured never within the cap ({p.cap_ratio:.2f}×); predicted "
                           f"{pr.ratio:.2f}× (band {pr.low:.2f}–{pr.high:.2f})",
                           in_band=pr.high >= p.cap_ratio)
        rows.append(row)
    for r in rows:
        if r.get("predicted_ratio") is None:
            print(f"  {r['spec']:42s} measured {r['measured_steps'] or 'never':>8} — {r['why']}")
        elif r.get("error") is None:
            print(f"  {r['spec']:42s} measured never — {r['why']}")
        else:
            print(f"  {r['spec']:42s} measured {r['measured_steps']:7.0f} steps ({r['measured_ratio']:.3f}×), "
                  f"predicted {r['predicted_steps']:7.0f} ({r['predicted_ratio']:.3f}×, band "
                  f"{r['band'][0]:.2f}–{r['band'][1]:.2f}): {100 * r['error']:+.1f} %"
                  + ("" if r["in_band"] else "  OUTSIDE the band"))
    summary = {"holdout_horizon": args.holdout, "scored": len(errs),
               "mean_abs_error": sum(abs(e) for e in errs) / len(errs) if errs else None,
               "max_abs_error": max((abs(e) for e in errs), default=None),
               "within_25_percent": sum(abs(e) <= 0.25 for e in errs),
               "unscored": [r["spec"] for r in rows if r.get("error") is None]}
    if errs:
        print(f"  scored {len(errs)}: mean |error| {100 * summary['mean_abs_error']:.1f} %, max "
              f"{100 * summary['max_abs_error']:.1f} %, {summary['within_25_percent']}/{len(errs)} within ±25 %")
    loo = M.loo_errors(model.points, model.h_ref)
    print(f"\nleave-one-point-out over all horizons ({len(loo)} points with a prediction): " + ", ".join(
        f"{p.spec}@{p.horizon} {100 * (math.exp(e) - 1):+.0f}%" for p, _, e in loo))

    model.holdout = {**summary, "rows": rows}
    Path(args.model_out).write_text(json.dumps(model.to_json(), indent=1) + "\n")
    Path(args.json).write_text(json.dumps({
        "command": command, "inventory": inv, "model": model.to_json(),
        "holdout": {**summary, "fp32_fraction": frac, "rows": rows},
        "leave_one_out": [{"spec": p.spec, "horizon": p.horizon, "measured_ratio": p.ratio, "predicted_ratio": pr,
                           "error": math.exp(e) - 1} for p, pr, e in loo]}, indent=1) + "\n")
    print(f"\nwrote {args.json} and {args.model_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
