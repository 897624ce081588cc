"""A full disk under the run directory (issue 42, row 9): a real, tiny tmpfs as the run directory (mounted as
root; skipped where mounting is not allowed). The metrics write and TensorBoard's writer end in syncwise's one
paragraph naming the run directory, not in raw tracebacks."""
from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from helpers import tmpfs

from syncwise.errors import SyncwiseError
from syncwise.metrics import MetricsLogger


@pytest.fixture
def tiny_disk(tmp_path):
    with tmpfs(tmp_path / "disk", "256k") as mnt:
        yield mnt


def _fill(mnt, leave):
    free = shutil.disk_usage(mnt).free
    with open(mnt / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def _rows(n):
    return [{"step": i, "loss": 5.0, "tokens_per_s": 1e4, "comm_exposed_s": 0.0, "step_time_s": 0.1,
             "pad": "x" * 300} for i in range(1, n + 1)]


def _one_paragraph(e, run):
    text = str(e)
    assert len(text.splitlines()) == 1 and str(run) in text and "--resume auto" in text, text
    return text


def test_a_full_disk_under_metrics_and_tensorboard_is_one_paragraph(tiny_disk, capfd):
    run = tiny_disk / "run"
    logger = MetricsLogger(run, 500, show=False)  # metrics.jsonl and TensorBoard's event file opened
    _fill(tiny_disk, leave=0)
    with pytest.raises(SyncwiseError) as e:
        for row in _rows(500):
            logger.log_step(row)
        logger.finish({"steps": 500})
    text = _one_paragraph(e.value, run)
    assert "No space left on device" in text and "is full" in text, text
    err = capfd.readouterr().err
    assert "Traceback" not in err, err


def test_a_trainer_on_a_full_run_directory_ends_in_the_paragraph(tiny_disk, capfd):
    from syncwise.train import OptimizedTrainer

    run = tiny_disk / "run"
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x = torch.randn(8, 4)
    loader = [(x, x[:, :2])] * 200
    trainer = OptimizedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), nn.functional.mse_loss,
                               run_dir=run, show_progress=False, mixed_precision="none")
    _fill(tiny_disk, leave=8 << 10)
    with pytest.raises(SyncwiseError) as e:
        trainer.train(loader, steps=200)
    _one_paragraph(e.value, run)
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
