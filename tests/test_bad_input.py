"""Bad input through both doors (issue 42, row 11): the nonsense values the fuzz accepted are refused with their
field; no refusal echoes more than ~200 characters of a value; every wrong-typed OptimizedTrainer keyword is a
ConfigError naming it (a property over all keywords), never a traceback nor a silent acceptance."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import pytest

from syncwise.cli import main
from syncwise.errors import ConfigError
from syncwise.train import OptimizedTrainer
from syncwise.train.options import KEYWORDS


@pytest.mark.parametrize("args,field", [
    (["--train.lr=4.9e-324"], "train.lr"),
    (["--train.lr=1e-300"], "train.lr"),
    (["--train.warmup_steps=1000000000", "--steps", "1"], "train.warmup_steps"),
    (["--train.warmup_steps=50", "--steps", "10"], "train.warmup_steps"),
    (["--train.clip_grad=5e-324"], "train.clip_grad"),
    (["--run-dir", "RUN\u202etxt.exe"], "run_dir"),
    (["--run-dir", "RUN\x1b[31mred"], "run_dir"),
    (["--run-dir", "RUN\u200bzero"], "run_dir"),
    (["--ft.replicas=2", "--metrics.prometheus_port=9400"], "metrics.prometheus_port"),
])
def test_nonsense_values_are_refused_with_their_field(args, field, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--check", "--preset", "tiny", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"'{field}'" in err, err
    assert "\u202e" not in err and "\x1b" not in err  # escaped, never printed raw


def test_the_defaults_short_runs_use_are_still_accepted(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default warm-up (20) with fewer steps, clip off, a modest lr
    assert main(["train", "--check", "--preset", "tiny", "--steps", "5", "--train.clip_grad=0",
                 "--train.lr=1e-6", "--run-dir", str(tmp_path / "run-é")]) == 0


def test_no_refusal_echoes_a_huge_value(tmp_path, capsys):
    e = ConfigError("data.corpus", "x" * 1_000_000, "a corpus")
    assert len(str(e)) < 250 and "1,000,002 characters" in str(e)
    e = ConfigError("k" * 10_000, "\n" * 500, "anything")
    assert len(str(e)) < 350 and len(str(e).splitlines()) == 1
    assert main(["train", "--check", "--preset", "tiny", "--run-dir", "y" * 1_000_000]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and len(err) < 400, len(err)


# What each keyword takes, by type (its values are checked elsewhere); any other type must be refused.
def _compressor_types():
    from syncwise.compress.api import GradientCompressor
    from syncwise.compress.base import Compressor
    from syncwise.parallel import TorchHookSpec

    return (Compressor, GradientCompressor, TorchHookSpec)


NUMBER = (int, float)
ACCEPTS = {
    "compress_gradients": lambda v: v is None or isinstance(v, (bool, str, *_compressor_types())),
    "sync": lambda v: v is None or isinstance(v, str),
    "parallel": lambda v: v is None or isinstance(v, dict),
    "tp_plan": lambda v: v is None or isinstance(v, dict),
    "pipeline_split": lambda v: v is None or callable(v),
    "bucket_cap_mb": lambda v: isinstance(v, NUMBER) and not isinstance(v, bool),
    "min_numel": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "mixed_precision": lambda v: v is None or isinstance(v, (bool, str, torch.dtype)),
    "grad_accum_steps": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "clip_grad_norm": lambda v: isinstance(v, NUMBER) and not isinstance(v, bool),
    "lr_scheduler": lambda v: v is None,
    "dynamic_batch": lambda v: v is None,
    "compile": lambda v: isinstance(v, bool),
    "activation_checkpointing": lambda v: isinstance(v, bool),
    "tf32": lambda v: isinstance(v, bool),
    "device": lambda v: v is None or isinstance(v, (str, torch.device, int)) and not isinstance(v, bool),
    "run_dir": lambda v: v is None or isinstance(v, str),
    "val_loader": lambda v: v is None or hasattr(v, "__iter__") and not isinstance(v, (str, bytes, dict)),
    "val_interval": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "log_interval": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "show_progress": lambda v: isinstance(v, bool),
    "flops_per_token": lambda v: v is None or isinstance(v, NUMBER) and not isinstance(v, bool),
    "checkpointer": lambda v: v is None,
    "data_seed": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "profile_steps": lambda v: v is None or isinstance(v, str),
    "profile_every": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "collective_timeout_s": lambda v: v is None or isinstance(v, NUMBER) and not isinstance(v, bool),
    "preempt_grace_s": lambda v: v is None or isinstance(v, NUMBER) and not isinstance(v, bool),
    "inject_faults": lambda v: v is None or isinstance(v, (str, list, tuple)),
    "live_recovery": lambda v: v is None,
}
VALUES = st.one_of(
    st.text(max_size=12), st.sampled_from(["no", "false", "0", "", "yes", "cpu", "1e3"]), st.integers(-3, 10**6),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.binary(max_size=6),
    st.lists(st.integers(0, 5), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.complex_numbers(max_magnitude=10), st.just(object()), st.just(torch.zeros(2)), st.just(b"x"),
    st.sets(st.integers(0, 3), max_size=2), st.just(nn.Linear(1, 1)), st.just(3.5),
)


def test_the_accepted_types_cover_every_keyword():
    assert set(ACCEPTS) == set(KEYWORDS)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(name=st.sampled_from(sorted(KEYWORDS)), value=VALUES)
def test_every_wrong_typed_keyword_is_refused_in_one_line_naming_it(name, value):
    if ACCEPTS[name](value):
        return  # a value of an accepted type: its value checks are other tests'
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        OptimizedTrainer(model, opt, nn.functional.mse_loss, **{name: value})
    except ConfigError as e:
        assert e.field == name, (name, value, str(e))
        assert len(str(e).splitlines()) == 1 and len(str(e)) < 2000
        return
    raise AssertionError(f"{name}={value!r} was accepted")


def test_show_progress_no_is_refused_not_progress_on():
    model = nn.Linear(4, 2)
    with pytest.raises(ConfigError, match="'show_progress'"):
        OptimizedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), show_progress="no")
    # a string device works as a device (it used to reach the trainer as a str)
    t = OptimizedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.mse_loss, device="cpu")
    assert t.device == torch.device("cpu")
