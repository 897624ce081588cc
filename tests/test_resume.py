"""Runs that survive: bit-exact resume, elastic kill-and-recover, corrupted checkpoints, NaN steps."""
import json

import torch

from distributed import run_workers
from syncwise.checkpoint import SmartCheckpointer, corrupt_checkpoint
from syncwise.cli import main
from syncwise.data import TokenBatchLoader
from syncwise.models import build_model
from syncwise.train import OptimizedTrainer, adamw, warmup_cosine

STEPS = 8


def _fresh(rank, world, compress=None, steps=STEPS, **trainer_options):
    """Model, optimizer, schedule, data and trainer built from scratch, as a new process would."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(5))
    model = build_model("tiny-moe", seq_len=32)
    opt = adamw(model, 3e-3, 0.1)
    loader = TokenBatchLoader(tokens, 4, 32, rank, world, seed=3)
    trainer = OptimizedTrainer(model, opt, compress_gradients=compress, lr_scheduler=warmup_cosine(opt, 2, steps),
                               show_progress=False, **trainer_options)
    return trainer, loader, []


def _interrupted_vs_uninterrupted(rank, world, ckpt_dir, compress):
    torch.use_deterministic_algorithms(True)
    trainer, loader, straight = _fresh(rank, world, compress)
    trainer._train_step = _recording(trainer, straight)
    trainer.train(loader, steps=STEPS)
    # Interrupted: stop after 5 steps (final checkpoint), then a brand-new trainer resumes to the end.
    first, loader1, part1 = _fresh(rank, world, compress)
    first._train_step = _recording(first, part1)
    first.checkpointer = SmartCheckpointer(ckpt_dir, interval=100)
    first.train(loader1, steps=5)
    second, loader2, part2 = _fresh(rank, world, compress)
    second._train_step = _recording(second, part2)
    second.checkpointer = SmartCheckpointer(ckpt_dir, interval=100)
    second.train(loader2, steps=STEPS, resume="auto")
    params_equal = all(torch.equal(a, b) for a, b in zip(trainer.model.state_dict().values(),
                                                          second.model.state_dict().values()))
    return straight, part1 + part2, params_equal


def _recording(trainer, out):
    original = trainer._train_step

    def step(batches):
        result = original(batches)
        out.append(result.settle().loss)
        return result

    return step


def test_resume_is_bit_exact_with_moe_and_compressor_state(tmp_path):
    # topk keeps per-rank error-feedback residuals: they must be checkpointed for the curve to match.
    for straight, resumed, params_equal in run_workers(_interrupted_vs_uninterrupted, 2, str(tmp_path / "ck"),
                                                       "topk:ratio=0.05"):
        assert len(resumed) == STEPS
        assert resumed == straight  # bit-identical loss curve
        assert params_equal


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


COMMON = ["--preset", "tiny", "--steps", "10", "--data.seq_len=32", "--deterministic", "--ckpt.interval=2",
          "--train.val_interval=0", "--train.val_batches=1"]


def test_killed_worker_is_restarted_by_torchrun_and_finishes_identically(tmp_path, capfd):
    assert main(["train", "--run-dir", str(tmp_path / "straight"), *COMMON]) == 0
    assert main(["train", "--run-dir", str(tmp_path / "killed"), *COMMON, "--max-restarts", "1",
                 "--inject-fault", "kill:rank=1,step=6"]) == 0
    out = capfd.readouterr().out  # written by the worker processes
    assert "restarted" in out and "redone" in out
    straight, killed = _rows(tmp_path / "straight"), _rows(tmp_path / "killed")
    assert [r["step"] for r in killed] == list(range(1, 11))  # exactly one row per step after the resume
    assert [r["loss"] for r in killed] == [r["loss"] for r in straight]
    assert (tmp_path / "killed" / "faults").is_dir()


def test_truncated_newest_checkpoint_falls_back_to_previous(tmp_path, capfd):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *COMMON]) == 0
    ckpts = sorted((run / "checkpoints").glob("step_*"))
    assert [c.name for c in ckpts] == ["step_00000006", "step_00000008", "step_00000010"]  # keep-last-3
    corrupt_checkpoint(ckpts[-1], mode="truncate")
    (run / "summary.json").unlink()  # as if it died after its last save: a finished run is not resumed
    before = _rows(run)
    assert main(["train", "--run-dir", str(run), *COMMON, "--resume", "auto"]) == 0
    assert "resumed from step 8" in capfd.readouterr().out
    after = _rows(run)
    assert [r["step"] for r in after] == list(range(1, 11))
    assert [r["loss"] for r in after] == [r["loss"] for r in before]


def test_nan_step_is_skipped_exactly_and_reported(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *COMMON, "--compress", "topk:ratio=0.1",
                 "--inject-fault", "nan:step=4"]) == 0
    rows = _rows(run)
    assert [r["step"] for r in rows if r.get("skipped")] == [4]
    assert rows[3]["loss"] is None
    assert all(r["loss"] is not None and r["loss"] == r["loss"] for r in rows if r["step"] != 4)
    assert json.loads((run / "summary.json").read_text())["skipped_steps"] == [4]


def test_bad_resume_path_and_incompatible_run_are_clear_errors(tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path / "x"), "--resume", str(tmp_path / "missing")]) == 2
    assert "resume" in capsys.readouterr().err
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), "--preset", "tiny", "--steps", "2", "--data.seq_len=32"]) == 0
    assert main(["train", "--run-dir", str(run), "--preset", "tiny-moe", "--steps", "4", "--data.seq_len=32",
                 "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "model.preset" in err and "Traceback" not in err
    # A checkpoint path of a different model, given explicitly, is refused by the worker with a clear message.
    other = tmp_path / "other"
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    assert main(["train", "--run-dir", str(other), "--preset", "tiny-moe", "--steps", "4", "--data.seq_len=32",
                 "--resume", str(ckpt)]) == 2
    assert "does not match the model" in capsys.readouterr().err
