"""The convergence model (issue 41): steps to fp32 DDP's loss vs horizon per strategy, fitted with censored points,
its held-out check, and auto ranking with it (syncwise.plan.convergence_model, benchmarks/convergence_fit.py)."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from syncwise.layout import Layout
from syncwise.plan import convergence_model as M
from syncwise.plan import load_model
from syncwise.plan import strategy as S

ROOT = Path(__file__).resolve().parent.parent


def _pt(spec, horizon, ratio, fp32=None, cap=2.0):
    fp32 = fp32 if fp32 is not None else 0.95 * horizon
    return M.Point(spec, "tiny", horizon, 2, fp32, ratio * fp32 if ratio is not None else None, cap * fp32, "t")


def test_an_exact_log_linear_law_is_recovered():
    law = {"fp8": (1.0, 0.0), "powersgd:rank=4": (1.5, -0.1), "topk:ratio=0.01": (1.8, -0.1)}
    pts = [_pt(s, h, r0 * (h / 300) ** b) for s, (r0, b) in law.items() for h in (100, 300, 1000)]
    m = M.fit(pts, h_ref=300)
    assert m.b["compressor"] == pytest.approx(-0.1, abs=1e-6) and m.b["cast"] == pytest.approx(0.0, abs=1e-6)
    assert math.exp(m.a["powersgd:rank=4"]) == pytest.approx(1.5, rel=1e-6)
    p = m.predict("topk:ratio=0.01", 3000, 2)
    assert p.ratio == pytest.approx(1.8 * 10 ** -0.1, rel=1e-6) and p.low < p.ratio < p.high
    assert "outside 100–1000" in p.extrapolated
    # exact data: the leave-one-out errors are ~0, so the band is the floor
    assert m.sigma["*"] == pytest.approx(0.02)


def test_never_reached_is_censored_not_infinite():
    """DiLoCo-like: never within 2× at 300 steps, 1.6× at 1000: the model predicts it reaches at 1000, not at 300
    (measured never there), and the censored point pulls the family's slope down instead of being dropped."""
    pts = [_pt("localsgd:period=4", 300, 1.1), _pt("localsgd:period=4", 1000, 1.1),
           _pt("diloco:period=16", 300, None), _pt("diloco:period=16", 1000, 1.6)]
    m = M.fit(pts, h_ref=548)
    assert m.b["local-step"] < 0
    at_1000, at_300 = m.predict("diloco:period=16", 1000, 2), m.predict("diloco:period=16", 300, 2)
    assert at_1000.reached and at_1000.ratio < 2.0
    assert not at_300.reached and at_300.measured_never == 300
    # only censored points: no point prediction, a lower bound
    only = M.fit([_pt("demo", 300, None), _pt("fp8", 300, 1.0)], h_ref=300)
    p = only.predict("demo", 300, 2)
    assert p.ratio is None and p.at_least == pytest.approx(2.0)


def test_other_replicas_widen_the_band():
    m = M.fit([_pt("fp8", 300, 1.0), _pt("fp8", 1000, 1.0), _pt("int8", 300, 1.02)], h_ref=548)
    two, eight = m.predict("fp8", 500, 2), m.predict("fp8", 500, 8)
    assert two.ratio == eight.ratio and eight.high / eight.ratio == pytest.approx((two.high / two.ratio) ** 2)
    assert "8 replicas, fitted at 2" in eight.extrapolated and not two.extrapolated


def _fit_script():
    spec = importlib.util.spec_from_file_location("convergence_fit", ROOT / "benchmarks" / "convergence_fit.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_committed_model_is_the_fit_of_the_committed_results():
    """src/syncwise/plan/convergence-model.json = benchmarks/convergence_fit.py's fit of benchmarks/results/."""
    _, pts = _fit_script().inventory()
    refit = M.fit([p for p in pts if not p.smoke])
    shipped = M.load_model()
    assert shipped.h_ref == refit.h_ref and set(shipped.a) == set(refit.a)
    for s in refit.a:
        assert shipped.a[s] == pytest.approx(refit.a[s], abs=1e-9)
    assert shipped.horizons == [300, 1000] and shipped.replicas == [2]
    # the held-out horizon's check, as recorded: the goal (steps to the target within ±25 %)
    h = shipped.holdout
    assert h["holdout_horizon"] == 1000 and h["scored"] >= 3 and h["max_abs_error"] <= 0.25
    recorded = json.loads((ROOT / "benchmarks" / "results" / "convergence-fit.json").read_text())
    assert recorded["holdout"]["max_abs_error"] == pytest.approx(h["max_abs_error"])


def test_auto_takes_a_local_step_strategy_at_a_long_horizon_that_never_reached_at_a_short_one(monkeypatch, tmp_path):
    """The committed model on a 20 Mbit/s link: diloco:period=16 never reached fp32 DDP's loss within the 300-step
    run's cap — not a candidate at 300 steps — but reached in the 1000-step run: a candidate there."""
    cloud = S.job_cloud(2, 1, 20e6)

    def ranked(h):
        return S.resolve_auto(Layout.of(sync="auto"), cloud, load_model("tiny", 128), 16, 128, micro_batch=8,
                              horizon=h, replicas=2)

    _, line_300, at_300 = ranked(300)
    _, line_1000, at_1000 = ranked(1000)
    d300 = next(r for r in at_300 if r.spec == "diloco:period=16")
    d1000 = next(r for r in at_1000 if r.spec == "diloco:period=16")
    assert d300.why_not.startswith("never reached") and "300-step run" in d300.why_not
    assert not d1000.why_not and d1000.steps_low < d1000.steps_ratio < d1000.steps_high
    # the line names the model's basis and the horizon it was asked at, and a band on the steps
    assert "convergence model fitted on" in line_1000 and "horizons 300–1000 steps" in line_1000
    assert "predicted at 1000 steps, 2 replicas" in line_1000 and "the steps (band " in line_1000
    # ranked by expected time: the first candidate has the lowest expected time ratio
    cands = [r for r in at_1000 if not r.why_not]
    assert cands[0].expected_time_ratio == min(r.expected_time_ratio for r in cands)
