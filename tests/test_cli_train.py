"""`syncwise train` end to end, and its configuration errors (which must come before any worker starts)."""
import json

import pytest

from syncwise.cli import main


@pytest.mark.parametrize("argv, field", [
    (["--train.stpes=3"], "train.stpes"),
    (["--steps", "-5"], "train.steps"),
    (["--preset", "gigantic"], "model.preset"),
    (["--data.corpus=/no/such/corpus"], "data.corpus"),
    (["--nproc", "1000"], "dist.nproc"),
    (["--train.lr=fast"], "train.lr"),
    (["--compress", "zip"], "compress"),
    (["--ckpt.interval=5 minutes"], "ckpt.interval"),
    (["--nosuchsection.key=1"], "nosuchsection.key"),
    (["--train.memory_threshold=1.5"], "train.memory_threshold"),
    (["--model.moe_impl=fast"], "model.moe_impl"),
    (["--parallel.tp=3"], "parallel.tp"),  # 2 workers: dp_replicate × dp_shard × tp must be 2
    (["--parallel.dp_shard=2", "--compress", "topk:ratio=0.1"], "compress.method"),
    (["--parallel.tp=2", "--sync", "localsgd:period=4"], "parallel.sync"),
    (["--parallel.dp_shard=2", "--train.dynamic_batch=true"], "train.dynamic_batch"),
    # issue 16: pipeline and expert parallel (the default preset: 4 layers, 16 routed experts; 2 workers)
    (["--nproc", "1", "--parallel.pp=2"], "parallel.pp"),                          # product ≠ world
    (["--parallel.pp=2", "--preset", "tiny", "--parallel.stages_per_rank=2",
      "--parallel.pp_schedule=interleaved-1f1b"], "parallel.stages_per_rank"),    # 4 stages > tiny's 2 layers
    (["--parallel.pp=2", "--parallel.microbatches=1"], "parallel.microbatches"),   # 1F1B needs M ≥ pp
    (["--parallel.pp=2", "--parallel.pp_schedule=chimera"], "parallel.pp_schedule"),
    (["--parallel.pp=2", "--train.grad_accum=2"], "train.grad_accum"),
    (["--parallel.ep=3"], "parallel.ep"),                                          # not a divisor of dp (2)
    (["--nproc", "3", "--parallel.ep=3"], "parallel.ep"),                          # not a divisor of 16 experts
    (["--parallel.ep=2", "--preset", "tiny"], "parallel.ep"),                      # no routed experts
    (["--parallel.ep=2", "--parallel.ep_dispatch=fp4"], "parallel.ep_dispatch"),
    # pp 2 × dp_shard 2 on 4 workers leaves one replica: fp8 has no all-reduce across replicas to compress (and
    # FSDP2's quantized reduce-scatter is not built for pipeline stages yet)
    (["--nproc", "4", "--parallel.pp=2", "--parallel.dp_shard=2", "--compress", "fp8"], "compress.method"),
])
def test_bad_config_fails_before_any_worker_with_a_clear_message(argv, field, tmp_path, capsys):
    code = main(["train", "--run-dir", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert field in err and "accepted" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing was started or written


def test_a_pipeline_schedule_missing_from_this_torch_is_named(monkeypatch):
    """A schedule syncwise knows but the installed torch does not ship: refused, naming the torch version."""
    from syncwise.errors import ConfigError
    from syncwise.parallel import pipeline

    older = {k: v for k, v in pipeline.torch_schedules().items() if k != "dualpipev"}  # e.g. torch 2.6
    monkeypatch.setattr(pipeline, "torch_schedules", lambda: older)
    with pytest.raises(ConfigError, match="not available in this torch version") as e:
        pipeline.check_pipeline(8, 2, "dualpipev", 8, 2)
    assert e.value.field == "parallel.pp_schedule"


def test_bad_toml_file_is_reported(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text("[train]\nsteps = 'many'\n")
    assert main(["train", "--config", str(cfg)]) == 2
    assert "train.steps" in capsys.readouterr().err


def test_train_two_workers_end_to_end_and_refuses_to_overwrite(tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["train", "--nproc", "2", "--preset", "tiny", "--steps", "6", "--run-dir", str(run_dir),
            "--data.seq_len=32", "--train.val_interval=3", "--train.val_batches=1"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["comm_bytes"] > 0 for r in rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6
    # A second run into the same directory must not silently overwrite the first.
    before = (run_dir / "metrics.jsonl").read_text()
    assert main(args) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (run_dir / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize("where", ["file", "flag"])
def test_misspelled_section_names_it_and_lists_the_sections(where, tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text("[trian]\nsteps = 3\n")
    argv = ["--config", str(cfg)] if where == "file" else ["--trian.steps=3"]
    assert main(["train", "--check", *argv]) == 2
    err = capsys.readouterr().err
    assert ("'trian'" if where == "file" else "'trian.steps'") in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    for section in ("[model]", "[data]", "[train]", "[dist]", "[compress]", "[ckpt]"):
        assert section in err, err
    assert "run_dir" in err and "did you mean [train]?" in err


def test_help_lists_the_model_presets_and_no_missing_commands(capsys):
    from syncwise.models import PRESETS

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    preset_line = next(line for line in out.splitlines() if "--model.preset=" in line)
    assert all(name in preset_line for name in PRESETS), preset_line
    assert "syncwise models" not in out and "syncwise launch" not in out


def test_dynamic_batch_and_moe_impl_from_the_command_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "--nproc", "1", "--preset", "tiny-moe", "--steps", "3", "--run-dir", str(run_dir),
                 "--data.seq_len=32", "--data.batch_size=6", "--train.val_batches=1", "--model.moe_impl=padded",
                 "--train.dynamic_batch=true"]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["micro_batch"] for r in rows] == [6, 6, 6]  # a tiny model: the whole batch fits
    assert "dynamic batch: micro-batches of 6 row(s)" in capsys.readouterr().out
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["model"]["moe_impl"] == "padded" and saved["train"]["dynamic_batch"] is True


def test_tensor_parallel_job_from_the_command_line(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["train", "--nproc", "2", "--preset", "tiny", "--steps", "3", "--run-dir", str(run_dir),
                 "--data.seq_len=32", "--train.val_batches=1", "--parallel.tp=2"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["layout"].startswith("tp 2") and summary["steps"] == 3
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("comm_bytes_tp" in r for r in rows)


@pytest.mark.parametrize("argv, hint", [(["--stpes", "3"], "--steps"), (["--compres", "fp8"], "--compress")])
def test_a_misspelt_flag_is_refused_with_the_flag_it_resembles(argv, hint):
    """No prefix matching (--compres is not --compress) and a near miss is named, in one line."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "syncwise.cli", "train", "--check", *argv], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert f"(did you mean {hint}?)" in p.stderr


def test_every_doc_the_help_names_exists():
    """`syncwise train --help` points to docs/*.md files: each one is there."""
    import re
    from pathlib import Path

    from syncwise.cli import build_parser

    root = Path(__file__).resolve().parents[1]
    helps = build_parser().format_help() + "".join(
        action.choices[name].format_help() for action in build_parser()._subparsers._group_actions
        for name in action.choices)
    named = set(re.findall(r"docs/[\w.-]+\.md", helps))
    assert named and all((root / doc).is_file() for doc in named), sorted(d for d in named if not (root / d).is_file())
