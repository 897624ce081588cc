"""The training loop's step callbacks (train/callbacks.py): a user's sees every point of the loop, a refused commit
redoes the step, and a feature that is off is not in the loop's list."""
import json

import torch
from torch import nn

from syncwise.train import OptimizedTrainer
from syncwise.train.callbacks import StepCallback


def _trainer(tmp_path, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return OptimizedTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), nn.functional.cross_entropy,
                            mixed_precision=False, show_progress=False, run_dir=tmp_path / "run", **kw)


def _loader(n=12):
    x = torch.randn(n * 4, 8, generator=torch.Generator().manual_seed(1))
    y = x[:, :4].argmax(1)
    return [(x[i:i + 4], y[i:i + 4]) for i in range(0, len(x), 4)]


class Recorder(StepCallback):
    def __init__(self, refuse_once_at=None):
        self.events, self.rows, self.refuse_once_at = [], [], refuse_once_at
        self.counted_tokens = 0

    def on_train_start(self, trainer):
        self.events.append(("train_start", trainer.step))

    def on_step_start(self, trainer, step):
        self.events.append(("step_start", step))

    def commits(self, trainer, pending):
        if pending.step == self.refuse_once_at:
            self.refuse_once_at = None
            return False
        return True

    def on_step_end(self, trainer, pending):
        self.events.append(("step_end", trainer.step, pending.step))
        self.counted_tokens += pending.tokens

    def on_row(self, trainer, row):
        self.rows.append(dict(row))

    def on_train_end(self, trainer):
        self.events.append(("train_end", trainer.step))

    def close(self, trainer):
        self.events.append(("close", trainer.step))

    def summary(self, trainer):
        return {"recorded_rows": len(self.rows)}


def test_a_user_callback_sees_every_step_and_row_after_the_trainers_own(tmp_path):
    trainer = _trainer(tmp_path, val_loader=_loader(2), val_interval=2)
    seen = Recorder()
    trainer.callbacks.append(seen)
    summary = trainer.train(_loader(), steps=4, checkpoint_dir=tmp_path / "ckpt")
    assert seen.events == [("train_start", 0)] + [e for s in range(1, 5) for e in (("step_start", s),
                                                                                   ("step_end", s, s))] + \
        [("train_end", 4), ("close", 4)]
    assert [r["step"] for r in seen.rows] == [1, 2, 3, 4]
    # the trainer's callbacks ran first on each row: its checkpoint column, validation at steps 2 and 4
    assert all("ckpt_in_flight" in r for r in seen.rows)
    assert [("val_loss" in r) for r in seen.rows] == [False, True, False, True]
    assert summary["recorded_rows"] == 4 and summary["final_val_loss"] == seen.rows[-1]["val_loss"]
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]


def test_a_refused_commit_redoes_the_step_with_the_next_batch(tmp_path):
    trainer = _trainer(tmp_path)
    seen = Recorder(refuse_once_at=2)
    trainer.callbacks.append(seen)
    summary = trainer.train(_loader(), steps=3)
    starts = [e[1] for e in seen.events if e[0] == "step_start"]
    assert starts == [1, 2, 2, 3]  # step 2 twice: its first attempt did not count
    assert [e[1] for e in seen.events if e[0] == "step_end"] == [1, 2, 3]
    assert summary["steps"] == 3 and trainer.step == 3
    assert trainer.tokens_seen == seen.counted_tokens > 0  # the counted steps' tokens only
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3]  # one row per step


def test_a_feature_that_is_off_is_not_in_the_loops_list(tmp_path):
    plain = _trainer(tmp_path)
    plain.train(_loader(), steps=2)
    assert [type(c).__name__ for c in plain._callbacks] == ["Preemption"]  # its install clears a stale marker
    full = _trainer(tmp_path / "full", val_loader=_loader(1), inject_faults=["kill:rank=0,step=99"])
    full.train(_loader(), steps=2, checkpoint_dir=tmp_path / "ckpt")
    assert [type(c).__name__ for c in full._callbacks] == ["InjectedKills", "Validation", "Preemption",
                                                          "CheckpointCadence"]


def test_before_backward_is_asked_before_each_backward_once_the_steps_gradients_are_cleared(tmp_path):
    """``before_backward`` (live recovery's last moment before the gradient sync changes its state): before every
    backward of the step, the first finding no gradient yet; only callbacks that override it are asked."""
    class Gate(StepCallback):
        def __init__(self):
            self.calls = []

        def before_backward(self, trainer, step):
            self.calls.append((step, all(p.grad is None for p in trainer.model.parameters())))

    trainer = _trainer(tmp_path, grad_accum_steps=2)
    gate = Gate()
    trainer.callbacks += [Recorder(), gate]
    trainer.train(_loader(8), steps=2)
    assert gate.calls == [(1, True), (1, False), (2, True), (2, False)], gate.calls
    assert trainer._backward_gates == [gate]  # (the others, the trainer's own included, are not asked)
