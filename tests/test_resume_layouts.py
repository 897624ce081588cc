"""Issue 23: resume and recovery under every layout (docs/resume.md).

* pipeline runs resume bit-identically under ``--deterministic``, one schedule per family (single-stage 1F1B,
  looped interleaved 1F1B, zero-bubble V, DualPipeV), and with pp × dp × ep (a compressor's error feedback in each
  stage's gradient sync) and pp × tp on 4 ranks;
* a killed pipeline worker is restarted by torchrun and the run finishes with the uninterrupted run's losses;
* the layout can change at resume: saved layout × resumed layout over DDP, FSDP2, tp 2, pp 2 and ep 2 on 2 ranks,
  each cell continuing (the same layout: bit-identical; another: the loss within ``TOLERANCE`` of the saved
  layout's own continuation) or refused in one line before any worker starts;
* giving any ``--parallel`` degree at resume replaces the saved layout as a whole.

Real ``syncwise train`` runs (torchrun, gloo, 2 or 4 workers). "Stopped at a checkpoint and resumed": a run of
``STEPS`` steps saves at steps 3 and 6; its newest checkpoint and summary are removed (as if it had died after
step 6 before saving), and ``--resume auto`` restarts from step 3 in new processes and redoes steps 4 to 6, whose
losses are compared with the first run's.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from syncwise.cli import main

STEPS = 6
COMMON = ["--steps", str(STEPS), "--data.seq_len=32", "--deterministic", "--ckpt.interval=3",
          "--train.val_interval=0", "--train.val_batches=1"]
# One schedule per family; tiny has 2 layers (one stage per rank), small 4 (two stages per rank).
FAMILIES = {
    "1f1b": ["--preset", "tiny", "--parallel.pp", "2"],
    "interleaved-1f1b": ["--preset", "small", "--parallel.pp", "2", "--parallel.stages_per_rank", "2",
                         "--parallel.pp_schedule", "interleaved-1f1b", "--data.batch_size", "4",
                         "--parallel.microbatches", "4"],
    "zbv": ["--preset", "small", "--parallel.pp", "2", "--parallel.stages_per_rank", "2",
            "--parallel.pp_schedule", "zbv", "--data.batch_size", "4", "--parallel.microbatches", "4"],
    "dualpipev": ["--preset", "small", "--parallel.pp", "2", "--parallel.stages_per_rank", "2",
                  "--parallel.pp_schedule", "dualpipev", "--data.batch_size", "4", "--parallel.microbatches", "4"],
}


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in _rows(run_dir)]


def _train(run_dir: Path, *args: str) -> None:
    assert main(["train", "--run-dir", str(run_dir), *COMMON, *args]) == 0


def _stop_after_first_checkpoint(run_dir: Path) -> None:
    """As if the run had died after its last step, before its final save: only the step-3 checkpoint is left."""
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    assert [c.name for c in ckpts] == ["step_00000003", "step_00000006"]
    shutil.rmtree(ckpts[-1])
    (run_dir / "summary.json").unlink()


def _resume_bit_exact(tmp_path: Path, capfd, *layout: str) -> None:
    run = tmp_path / "run"
    _train(run, *layout)
    straight = _losses(run)
    assert len(straight) == STEPS
    _stop_after_first_checkpoint(run)
    _train(run, *layout, "--resume", "auto")
    assert "resumed from step 3" in capfd.readouterr().out
    assert [r["step"] for r in _rows(run)] == list(range(1, STEPS + 1))
    assert _losses(run) == straight  # bit-identical: model, AdamW, data position, RNG and schedule state


# ------------------------------------------------------------------------------------------ pipeline resume
@pytest.fixture(scope="module")
def straight_1f1b(tmp_path_factory):
    run = tmp_path_factory.mktemp("straight") / "run"
    _train(run, *FAMILIES["1f1b"])
    return _losses(run)


def test_pipeline_1f1b_resume_is_bit_exact(tmp_path, capfd, straight_1f1b):
    run = tmp_path / "run"
    _train(run, *FAMILIES["1f1b"])
    assert _losses(run) == straight_1f1b  # (deterministic: the module's uninterrupted run)
    _stop_after_first_checkpoint(run)
    _train(run, *FAMILIES["1f1b"], "--resume", "auto")
    assert "resumed from step 3" in capfd.readouterr().out
    assert _losses(run) == straight_1f1b


@pytest.mark.slow
@pytest.mark.parametrize("family", ["interleaved-1f1b", "zbv", "dualpipev"])
def test_multi_stage_pipeline_resume_is_bit_exact(tmp_path, capfd, family):
    """Two stages per rank, looped or in a V (zbv, dualpipev: the V's evaluation at the end of the run included)."""
    _resume_bit_exact(tmp_path, capfd, *FAMILIES[family])


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    # pp 2 × dp 2, the dp ranks borrowed by ep 2; top-k's error feedback in each stage's gradient sync (dense and
    # expert gradients): per-rank state that must come back for the curve to match
    ["--preset", "tiny-moe", "--parallel.pp", "2", "--parallel.ep", "2", "--compress", "topk:ratio=0.1"],
    ["--preset", "tiny", "--parallel.pp", "2", "--parallel.tp", "2"],             # pp 2 × tp 2
], ids=["pp2xdp2xep2-topk", "pp2xtp2"])
def test_four_rank_pipeline_layouts_resume_bit_exact(tmp_path, capfd, layout):
    _resume_bit_exact(tmp_path, capfd, "--nproc", "4", *layout)


def test_killed_pipeline_worker_is_restarted_and_finishes_identically(tmp_path, capfd, straight_1f1b):
    run = tmp_path / "killed"
    # Synchronous saves: the step-3 checkpoint is published before step 4 starts (an async save of these ~10 ms
    # steps may still be in flight at step 5, and the restart would then rightly start from scratch).
    _train(run, *FAMILIES["1f1b"], "--ckpt.async_save", "false", "--max-restarts", "1",
           "--inject-fault", "kill:rank=1,step=5")
    out = capfd.readouterr().out
    assert "restarted" in out and "resumed from step 3" in out
    assert [r["step"] for r in _rows(run)] == list(range(1, STEPS + 1))  # one row per step after the resume
    assert _losses(run) == straight_1f1b


# ------------------------------------------------------------------------------------------ layout changes
# Every layout of 2 ranks the model allows (tiny-moe: ep needs routed experts), each with the same global batch of 16
# rows (data.batch_size is per data-parallel worker: 8 × dp 2, 16 × dp 1), so that every layout reads the same data
# at every step and the curves can be compared closely. Resuming into DDP names its degree: with no --parallel
# degree given, the saved layout is kept.
LAYOUTS = {
    "ddp": ["--parallel.dp_replicate", "2", "--data.batch_size", "8"],
    "fsdp": ["--parallel.dp_shard", "2", "--data.batch_size", "8"],
    "tp2": ["--parallel.tp", "2", "--data.batch_size", "16"],
    "pp2": ["--parallel.pp", "2", "--data.batch_size", "16"],
    "ep2": ["--parallel.ep", "2", "--data.batch_size", "8"],
}
DESCRIBED = {"ddp": "dp_replicate 2", "fsdp": "dp_shard 2", "tp2": "tp 2", "pp2": "pp 2", "ep2": "dp_replicate 2 × ep 2"}
# A high learning rate without warm-up, so 3 steps move the loss far (5.6 -> 4.5) from a fresh model's: a resume
# that lost the model or optimizer state, or the data position, would miss by far more than TOLERANCE.
MATRIX = ["--preset", "tiny-moe", "--train.lr", "0.01", "--train.warmup_steps", "0"]
# Steps 4-6 under another layout vs the saved layout's own steps 4-6: the same weights, optimizer state, data and
# global batch; only the order of floating-point reductions differs (docs/resume.md has the measured differences).
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    """One saved run per layout, made on first use: (run directory, its STEPS losses)."""
    runs: dict[str, tuple[Path, list[float]]] = {}

    def get(layout: str) -> tuple[Path, list[float]]:
        if layout not in runs:
            run = tmp_path_factory.mktemp(f"saved-{layout}") / "run"
            _train(run, *MATRIX, *LAYOUTS[layout])
            runs[layout] = run, _losses(run)
        return runs[layout]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("resumed", list(LAYOUTS))
@pytest.mark.parametrize("saved", list(LAYOUTS))
def test_layout_change_at_resume(saved, resumed, saved_runs, tmp_path, capfd):
    source, straight = saved_runs(saved)
    run = tmp_path / "run"
    shutil.copytree(source, run)
    _stop_after_first_checkpoint(run)
    capfd.readouterr()
    _train(run, *MATRIX, *LAYOUTS[resumed], "--resume", "auto")
    out = capfd.readouterr().out
    assert f"worker(s) ({DESCRIBED[resumed]})" in out and "resumed from step 3" in out
    losses = _losses(run)
    assert losses[:3] == straight[:3] and len(losses) == STEPS
    if saved == resumed:
        assert losses == straight
    else:
        worst = max(abs(a - b) for a, b in zip(losses[3:], straight[3:]))
        print(f"layout change {saved} -> {resumed}: steps 4-6 differ by at most {worst:.2e}")
        assert worst <= TOLERANCE, (saved, resumed, losses, straight)


def test_a_degree_given_at_resume_replaces_the_saved_layout_as_a_whole(tmp_path):
    """The issue's example: a run saved as FSDP2 (dp_shard 2) resumed with --parallel.tp 2 is tp 2 (dp_shard back
    to its default), not 'dp_shard 2 × tp 2' on 2 ranks. Flags that are not degrees still merge."""
    from syncwise.commands.train import resolve_config
    from syncwise.config import build_config

    run = tmp_path / "run"
    run.mkdir()
    build_config(None, {"run_dir": str(run), "model.preset": "tiny-moe", "parallel.dp_shard": "2",
                        "parallel.ep_dispatch": "bf16"}).save(run / "config.json")
    base = {"run_dir": str(run), "resume": "auto"}
    kept = resolve_config(None, dict(base))
    assert (kept.parallel.dp_shard, kept.parallel.tp, kept.model.preset) == (2, 1, "tiny-moe")
    changed = resolve_config(None, {**base, "parallel.tp": "2"})
    assert (changed.parallel.dp_shard, changed.parallel.tp) == (1, 2)
    assert changed.model.preset == "tiny-moe" and changed.parallel.ep_dispatch == "bf16"  # the rest is the run's
    from_file = resolve_config({"parallel": {"pp": 2}}, dict(base))  # a TOML file's [parallel] degree, the same
    assert (from_file.parallel.dp_shard, from_file.parallel.pp) == (1, 2)
    schedule_only = resolve_config(None, {**base, "parallel.pp_schedule": "gpipe"})  # not a degree: merged
    assert (schedule_only.parallel.dp_shard, schedule_only.parallel.pp_schedule) == (2, "gpipe")


def test_what_cannot_change_at_resume_is_refused_in_one_line(tmp_path, capsys):
    """The model, the data layout, the compressor and the sync strategy are the run's: refused before any worker
    starts, in one line naming the field. So is a new layout the saved compressor cannot run under."""
    run = tmp_path / "run"
    _train(run, *MATRIX, "--steps", "3", "--compress", "topk:ratio=0.1")
    capsys.readouterr()
    for flags, field in [(["--compress", "none"], "compress.method"),
                         (["--parallel.sync", "localsgd:period=2"], "parallel.sync"),
                         (["--preset", "tiny"], "model.preset"),
                         (["--parallel.dp_shard", "2"], "compress")]:
        assert main(["train", "--run-dir", str(run), *COMMON, *MATRIX, "--compress", "topk:ratio=0.1", *flags,
                     "--resume", "auto"]) == 2, flags
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and field in err and "Traceback" not in err, (flags, err)
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000003"]  # nothing touched


def test_optimizer_saved_flattened_and_nested_checkpoints_still_load(tmp_path):
    """One process: the optimizer's entries are per parameter (what lets stages save and load their own); a
    checkpoint written nested (torch's default, syncwise before issue 23) loads the same state."""
    import torch
    import torch.distributed.checkpoint as dcp

    from syncwise.checkpoint import ModelOptimizerState, SmartCheckpointer, TrainState
    from syncwise.models import build_model

    def state(seed):
        torch.manual_seed(seed)
        model = build_model("tiny", seq_len=16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ts = TrainState()
        ts.register("model", ModelOptimizerState(model, opt))
        return model, opt, ts

    model, opt, ts = state(0)
    model(torch.randint(0, 256, (2, 16))).sum().backward()
    opt.step()
    for form, flat in (("flat", True), ("nested", False)):
        ts["model"]._flat = flat  # nested: as an earlier syncwise wrote it
        ck = SmartCheckpointer(tmp_path / form, interval=1, async_save=False)
        ck.save(1, ts)
        ck.close()
        keys = set(dcp.FileSystemReader(str(next((tmp_path / form).glob("step_*")))).read_metadata()
                   .state_dict_metadata)
        assert ("model.optim.param_groups.0.params" in keys) is not flat
        assert ("model.optim.param_groups.output.weight.lr" in keys) is flat
        model2, opt2, ts2 = state(1)
        assert SmartCheckpointer(tmp_path / form, interval=1, async_save=False).load("auto", ts2) == 1
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
        for p, p2 in zip(model.parameters(), model2.parameters()):
            assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[p2]["exp_avg_sq"]), form
        assert opt2.param_groups[0]["lr"] == 1e-3 and ts2["model"]._flat  # the next save is flattened again


def test_nan_on_a_first_stage_rank_is_skipped_on_every_rank(tmp_path):
    """A NaN injected on pp rank 0, which holds no loss (the last stage computes it), poisons that stage's gradients
    instead: the step is skipped on both ranks (before, the injection on a first-stage rank did nothing)."""
    run = tmp_path / "run"
    _train(run, *FAMILIES["1f1b"], "--steps", "3", "--inject-fault", "nan:step=2,rank=0")
    rows = _rows(run)
    assert [r["step"] for r in rows if r.get("skipped")] == [2]
    assert json.loads((run / "summary.json").read_text())["skipped_steps"] == [2]
    assert all(r["loss"] is not None and r["loss"] == r["loss"] for r in rows if r["step"] != 2)
