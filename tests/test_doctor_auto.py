"""Issue 43 row 4: doctor recommends a compressor by --compress auto's terms (predicted step × the steps it needs to
fp32 DDP's loss, the convergence table), and names the cause its recommendation acts on."""
import json

import pytest

from syncwise.doctor import diagnose, load_run
from syncwise.doctor.analyze import _Model

from test_doctor_pricing import _one_bucket, _write


def _run(tmp_path, compressor):
    root = _write(tmp_path / compressor, bucket_cap_mb=1000.0, row=_one_bucket)  # one bucket, exposed, on a CPU
    summary = json.loads((root / "summary.json").read_text())
    (root / "summary.json").write_text(json.dumps({**summary, "compressor": compressor}))
    return diagnose(load_run(root))


@pytest.mark.parametrize("compressor", ["none", "fp8"])
def test_doctor_recommends_what_auto_would_rank_first_and_not_what_needs_more_steps(compressor, tmp_path):
    d = _run(tmp_path, compressor)
    model = _Model(d)
    flags = [f.flag for f in d.findings if f.flag.startswith("--compress")]
    assert not any("powersgd" in f for f in flags), flags  # 1.6× the steps in the table: later to the loss
    for f in d.findings:
        if not f.flag.startswith("--compress"):
            continue
        spec = f.flag.split()[1]
        soonest = f.predicted_step_s * model.steps_ratio(spec)
        for other in model._table_compressors():  # by auto's terms no other compressor gets there sooner
            r, step = model.steps_ratio(other), model.whatif(compress=other)
            if r is not None and step is not None and other.split(":")[0] != compressor:
                assert soonest <= step * r + 1e-9, (spec, other)
        assert "× the steps" in f.recommendation and "time to fp32 DDP's loss" in f.recommendation
    if compressor == "fp8":  # already the table's soonest: nothing to switch to, and the link finding says why
        assert not flags
        link = next(f for f in d.findings if f.cause == "link")
        assert "no compressor is predicted" in link.recommendation


def test_the_cause_named_matches_the_recommendation(tmp_path):
    d = _run(tmp_path, "none")
    f = next(x for x in d.findings if x.cause == "buckets_too_large")
    assert f.details["verdict"] == "slower" and "bucket_cap_mb" not in f.flag
    assert "too large" not in f.title and "exposed after the backward" in f.title, f.title


def test_predicted_to_help_carries_its_band_and_basis(tmp_path):
    """Issue 41 item 4: doctor's recommendation prints, like auto's line, a band on the time ratio and on the steps,
    and what the steps stand on (the convergence model, the run's horizon and replicas)."""
    d = _run(tmp_path, "none")
    model = _Model(d)
    recs = [f for f in d.findings if f.flag.startswith("--compress")]
    assert recs, [f.flag for f in d.findings]
    for f in recs:
        spec = f.flag.split()[1]
        lo, hi = model.steps_band(spec)
        assert lo <= model.steps_ratio(spec) <= hi and lo < hi
        text = f.recommendation
        assert "the run's time to fp32 DDP's loss" in text and "× (band " in text and "the steps (band " in text
        assert "convergence model fitted on" in text and f"predicted at {model.horizon()} steps" in text
