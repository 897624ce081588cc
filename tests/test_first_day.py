"""A user's first day (issue 43): what `--resume auto` found, data pitfalls, the install's extras."""
import torch
from torch import nn
from torch.nn import functional as F

from syncwise import OptimizedTrainer
from syncwise.cli import main


def test_resume_auto_without_a_checkpoint_says_it_starts_fresh_in_the_python_api(tmp_path, capsys):
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    x = torch.randn(8, 4)
    trainer = OptimizedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, mixed_precision=False)
    assert trainer.train([(x, x)], steps=1, checkpoint_dir=str(tmp_path / "tpyo"), resume="auto")["steps"] == 1
    out = capsys.readouterr().out
    assert f"syncwise: resume auto found no checkpoint in {tmp_path / 'tpyo'}; starting a fresh run from step 0" \
        in out.splitlines(), out


def test_resume_auto_on_a_missing_run_dir_says_so_on_the_command_line(tmp_path, capsys):
    run = tmp_path / "tpyo"
    assert main(["train", "--nproc", "1", "--preset", "tiny", "--steps", "1", "--run-dir", str(run),
                 "--resume", "auto", "--data.seq_len=32", "--train.val_batches=1"]) == 0
    out = capsys.readouterr().out
    assert f"syncwise: resume auto found no checkpoint in {run / 'checkpoints'}; starting a fresh run from step 0" \
        in out.splitlines(), out
