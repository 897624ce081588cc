"""OptimizedTrainer's option groups (CommOptions / StepOptions / RunOptions / FaultOptions) next to its flat keywords,
and the step meter's fixed points (issue 25)."""
import inspect
import json
from dataclasses import fields

import pytest
import torch
from torch import nn

from syncwise import ConfigError
from syncwise.train import CommOptions, FaultOptions, OptimizedTrainer, RunOptions, StepOptions
from syncwise.train.options import GROUPS, KEYWORDS


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _loader(n=16):
    x = torch.randn(n * 4, 8, generator=torch.Generator().manual_seed(1))
    y = x[:, :4].argmax(1)
    return [(x[i:i + 4], y[i:i + 4]) for i in range(0, len(x), 4)]


def test_every_group_field_is_a_keyword_with_the_same_default():
    params = inspect.signature(OptimizedTrainer.__init__).parameters
    for name, kind in GROUPS.items():
        assert params[name].default is None
        for f in fields(kind):
            assert params[f.name].default == f.default, f.name
    flat = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} - set(GROUPS)
    assert flat == KEYWORDS  # nothing flat outside a group, nothing in a group that is not a keyword


def test_groups_and_keywords_make_the_same_trainer(tmp_path):
    model, opt = _model()
    by_group = OptimizedTrainer(model, opt, nn.functional.cross_entropy,
                                comm=CommOptions(bucket_cap_mb=5.0),
                                step=StepOptions(mixed_precision=False, grad_accum_steps=2, clip_grad_norm=0.5),
                                run=RunOptions(run_dir=tmp_path / "a", show_progress=False, log_interval=3),
                                faults=FaultOptions(inject_faults=["nan:step=2"], preempt_grace_s=None))
    model2, opt2 = _model()
    by_keyword = OptimizedTrainer(model2, opt2, nn.functional.cross_entropy, bucket_cap_mb=5.0,
                                  mixed_precision=False, grad_accum_steps=2, clip_grad_norm=0.5,
                                  run_dir=tmp_path / "b", show_progress=False, log_interval=3,
                                  inject_faults=["nan:step=2"], preempt_grace_s=None)
    for t in (by_group, by_keyword):
        assert (t.grad_accum_steps, t.clip_grad_norm, t.log_interval, t.amp_dtype) == (2, 0.5, 3, None)
        assert t.options.comm.bucket_cap_mb == 5.0 and t.options.faults.inject_faults[0].kind == "nan"
    a = by_group.train(_loader(), steps=3)
    b = by_keyword.train(_loader(), steps=3)
    assert a["skipped_steps"] == b["skipped_steps"] == [2]
    assert a["final_loss"] == b["final_loss"]
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "loss", "compute_s", "comm_exposed_s", "data_wait_s", "comm_bytes", "comm_bytes_dp"} <= set(rows[0])
    assert rows[1]["skipped"] is True


def test_a_keyword_given_twice_is_refused_and_groups_check_their_fields():
    model, opt = _model()
    with pytest.raises(ConfigError) as e:
        OptimizedTrainer(model, opt, step=StepOptions(grad_accum_steps=2), grad_accum_steps=4)
    assert e.value.field == "grad_accum_steps" and "StepOptions" in str(e.value)
    with pytest.raises(ConfigError) as e:
        OptimizedTrainer(model, opt, comm={"bucket_cap_mb": 5})
    assert e.value.field == "comm" and "CommOptions" in str(e.value)
    # the same field named, whether the bad value comes as a keyword or in its group
    for make in (lambda: StepOptions(grad_accum_steps=0), lambda: OptimizedTrainer(model, opt, grad_accum_steps=0)):
        with pytest.raises(ConfigError) as e:
            make()
        assert e.value.field == "grad_accum_steps"
    with pytest.raises(ConfigError) as e:
        FaultOptions(inject_faults=["nan:step=zero"])
    assert e.value.field == "inject_fault"
    with pytest.raises(ConfigError) as e:
        RunOptions(log_interval=0)
    assert e.value.field == "log_interval"


def test_the_meter_reports_the_phase_and_an_after_update_callback_runs(tmp_path):
    model, opt = _model()
    trainer = OptimizedTrainer(model, opt, nn.functional.cross_entropy, mixed_precision=False, show_progress=False)
    seen = []
    trainer.after_update.append(lambda skipped: seen.append((trainer.phase, bool(skipped))))
    summary = trainer.train(_loader(), steps=2)
    assert seen == [("optimizer step", False)] * 2
    assert summary["steps"] == 2 and summary["comm_bytes_per_step"] == 0  # one process: nothing sent


def test_an_unknown_keyword_is_refused_with_the_nearest_name():
    model, opt = _model()
    with pytest.raises(ConfigError) as e:
        OptimizedTrainer(model, opt, grad_acum_steps=2)
    assert e.value.field == "grad_acum_steps" and "did you mean 'grad_accum_steps'" in str(e.value)
    assert "\n" not in str(e.value)
