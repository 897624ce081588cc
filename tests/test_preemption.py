"""Preemption (SIGTERM / SIGUSR1): stop at a step every rank agrees on, save, exit 83, resume bit-exactly.

Real gloo processes, real signals (``os.kill``), real DCP checkpoints. The signal lands mid-step on one rank
only, during an asynchronous save still in flight, and right after a save; each time no finished step is lost,
the newest checkpoint is the stop's (complete and verified, never a half-written one), and a fresh trainer
resumes to a loss curve bit-identical to an uninterrupted run.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import torch

from distributed import run_workers
from helpers import GatedCheckpointer
from syncwise.checkpoint import SmartCheckpointer
from syncwise.checkpoint.storage import latest_valid, published_checkpoints, verify_checkpoint
from syncwise.cli import main
from syncwise.data import TokenBatchLoader
from syncwise.models import build_model
from syncwise.train import OptimizedTrainer, adamw, warmup_cosine
from syncwise.train.preemption import EXIT_GRACE_EXPIRED, EXIT_PREEMPTED, Preempted, read_marker

STEPS = 8


def _fresh(rank, world, run_dir, gate=None):
    """Model, optimizer, schedule, data, checkpointer and trainer built from scratch, as a new process would."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(5))
    model = build_model("tiny", seq_len=32)
    opt = adamw(model, 3e-3, 0.1)
    ckpt = None
    if run_dir is not None:
        kind = GatedCheckpointer if gate is not None else SmartCheckpointer
        ckpt = kind(os.path.join(run_dir, "checkpoints"), interval=3, **({"gate": gate} if gate else {}))
    trainer = OptimizedTrainer(model, opt, lr_scheduler=warmup_cosine(opt, 2, STEPS), show_progress=False,
                               run_dir=run_dir, checkpointer=ckpt, preempt_grace_s=60)
    return trainer, TokenBatchLoader(tokens, 4, 32, rank, world, seed=3)


def _record_losses(trainer, out, before_step=None):
    """Record each step's loss; ``before_step(trainer, step)`` runs inside the step, before its forward."""
    original = trainer._train_step

    def step(batches):
        if before_step is not None:
            before_step(trainer, trainer.step + 1)
        result = original(batches)
        out.append(result.settle().loss)
        return result

    trainer._train_step = step


def _signal_at(rank, step, sig):
    def hook(trainer, s):
        if trainer.rank == rank and s == step:
            os.kill(os.getpid(), sig)
    return hook


def _preempt_then_resume(rank, world, run_dir, hook=None, gate=None, after_save=None):
    """One preempted attempt (returns what it left behind) and a fresh trainer resuming it to the end."""
    first, loader = _fresh(rank, world, run_dir, gate)
    losses = []
    _record_losses(first, losses, hook)
    if after_save is not None:  # signal right after a save() returned
        save = first.checkpointer.save

        def save_then_signal(step, state, **kw):
            stats = save(step, state, **kw)
            if first.rank == after_save[0] and step == after_save[1]:
                os.kill(os.getpid(), after_save[2])
            return stats

        first.checkpointer.save = save_then_signal
    if gate is not None:  # the save of step 3 stays unpublished for a while, whatever happens meanwhile
        threading.Timer(1.5, gate.set).start()
    try:
        first.train(loader, steps=STEPS)
        stopped = None
    except Preempted as e:
        stopped = {"code": e.code, "step": e.step, "signal": e.signal_name, "checkpoint": e.checkpoint}
    ckdir = os.path.join(run_dir, "checkpoints")
    newest = latest_valid(ckdir)
    left = {"stopped": stopped, "newest": newest.name if newest is not None else None,
            "newest_problem": verify_checkpoint(newest) if newest is not None else "none",
            "published": [p.name for p in published_checkpoints(ckdir)],
            "partials": sorted(n for n in os.listdir(ckdir) if n.endswith(".partial")),
            "handler_after": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}
    second, loader2 = _fresh(rank, world, run_dir)
    _record_losses(second, losses)
    second.train(loader2, steps=STEPS, resume="auto")
    return left, losses, [t.clone() for t in second.model.state_dict().values()]


def _scenarios(rank, world, root):
    torch.use_deterministic_algorithms(True)
    straight, loader = _fresh(rank, world, None)
    reference = []
    _record_losses(straight, reference)
    straight.train(loader, steps=STEPS)
    ref_params = list(straight.model.state_dict().values())
    out = {"reference": reference}
    runs = {
        # SIGTERM on rank 1 only, while its step 4 runs: both ranks stop after the same step.
        "mid_step": dict(hook=_signal_at(1, 4, signal.SIGTERM)),
        # SIGUSR1 on rank 0 while the save of step 3 is still being written (held back by the gate).
        "during_async_save": dict(hook=_signal_at(0, 4, signal.SIGUSR1), gate=threading.Event()),
        # SIGUSR1 on rank 1 the moment save() of step 3 returned (its write still in flight).
        "after_save": dict(after_save=(1, 3, signal.SIGUSR1)),
    }
    for name, kw in runs.items():
        left, losses, params = _preempt_then_resume(rank, world, os.path.join(root, name), **kw)
        left["losses"] = losses
        left["params_equal"] = all(torch.equal(a, b) for a, b in zip(ref_params, params))
        out[name] = left
    return out


def _rows(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def test_signal_mid_step_during_save_and_after_save_loses_nothing_and_resumes_bit_exactly(tmp_path):
    by_rank = run_workers(_scenarios, 2, str(tmp_path), timeout=240)
    first_signalled = {"mid_step": 4, "during_async_save": 4, "after_save": 4}
    for name, signalled in first_signalled.items():
        r0, r1 = by_rank[0][name], by_rank[1][name]
        stop = r0["stopped"]
        assert stop is not None and stop["code"] == EXIT_PREEMPTED, (name, stop)
        assert r1["stopped"]["step"] == stop["step"], name  # every rank stopped after the same step
        # The flag all-reduce lags one step: a signal during step S stops the run after S or S + 1.
        assert signalled <= stop["step"] <= signalled + 1, (name, stop)
        # No finished step is lost: the newest checkpoint is the stop's, complete and verified; nothing partial.
        assert r0["newest"] == f"step_{stop['step']:08d}" and r0["newest_problem"] is None, (name, r0)
        assert r0["partials"] == [], name
        assert stop["checkpoint"].endswith(r0["newest"]), name
        assert r0["handler_after"], name  # train() gave the signal back
        # The resumed run's curve is the uninterrupted one, bit for bit, and so are the final weights.
        assert len(r0["losses"]) == STEPS and r0["losses"] == by_rank[0]["reference"], name
        assert r1["losses"] == by_rank[1]["reference"], name
        assert r0["params_equal"] and r1["params_equal"], name
    assert by_rank[0]["mid_step"]["stopped"]["signal"] == "SIGTERM"  # rank 0 learned it from rank 1
    assert by_rank[1]["during_async_save"]["stopped"]["signal"] == "SIGUSR1"
    # During the held save, the stop's save waited for it: both are published, the stop's is the newest.
    assert {"step_00000003"} <= set(by_rank[0]["during_async_save"]["published"])


def test_guard_off_leaves_signals_alone_and_on_restores_them(tmp_path):
    torch.manual_seed(0)
    seen = []
    for grace in (0, 5):
        model = build_model("tiny", seq_len=16)
        trainer = OptimizedTrainer(model, adamw(model, 1e-3, 0.0), show_progress=False, preempt_grace_s=grace)
        _record_losses(trainer, [], lambda t, s: seen.append((grace, signal.getsignal(signal.SIGUSR1))))
        tokens = torch.randint(0, 256, (2_000,), generator=torch.Generator().manual_seed(1))
        trainer.train(TokenBatchLoader(tokens, 2, 16, 0, 1, seed=0), steps=1)
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    assert seen[0] == (0, signal.SIG_DFL) and callable(seen[1][1]) and seen[1][1] != signal.SIG_DFL


_HUNG_SAVE = textwrap.dedent("""
    import os, signal, sys, threading, torch
    sys.path.insert(0, sys.argv[2])
    from test_preemption import GatedCheckpointer, _record_losses
    from syncwise.data import TokenBatchLoader
    from syncwise.models import build_model
    from syncwise.train import OptimizedTrainer, adamw
    torch.manual_seed(0)
    run = sys.argv[1]
    model = build_model("tiny", seq_len=16)
    ckpt = GatedCheckpointer(os.path.join(run, "checkpoints"), interval=2, gate=threading.Event())  # never published
    trainer = OptimizedTrainer(model, adamw(model, 1e-3, 0.0), show_progress=False, run_dir=run,
                               checkpointer=ckpt, preempt_grace_s=1.5)
    _record_losses(trainer, [], lambda t, s: s == 3 and os.kill(os.getpid(), signal.SIGTERM))
    tokens = torch.randint(0, 256, (5_000,), generator=torch.Generator().manual_seed(1))
    trainer.train(TokenBatchLoader(tokens, 2, 16, 0, 1, seed=0), steps=50)
    print("not reached")
""")


def test_save_that_outlasts_the_grace_exits_84_and_says_so(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _HUNG_SAVE, str(run), os.path.dirname(__file__)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_GRACE_EXPIRED, proc.stderr[-2000:]
    assert "grace of 1.5 s" in proc.stderr and "not reached" not in proc.stdout
    record = read_marker(run)
    assert record["saved"] is False and record["exit_code"] == EXIT_GRACE_EXPIRED and record["step"] == 3
    assert latest_valid(run / "checkpoints") is None  # nothing half-written counts as a checkpoint


# The CLI under torchrun's elastic agent: SIGUSR1 reaches the launcher (as `scancel --signal=USR1` would), the agent
# forwards it, the workers stop and save, the launcher reports it and exits 83; --resume auto finishes identically.
CLI = ["--preset", "tiny", "--steps", "10", "--data.seq_len=128", "--data.batch_size=24", "--deterministic",
       "--ckpt.interval=4", "--train.val_interval=0", "--train.val_batches=1"]


def test_cli_sigusr1_under_torchrun_reports_exits_83_and_resumes_identically(tmp_path, capfd):
    assert main(["train", "--run-dir", str(tmp_path / "straight"), *CLI]) == 0
    run = tmp_path / "pre"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [os.path.join(os.path.dirname(__file__), "..", "src"),
                                                                   os.environ.get("PYTHONPATH", "")] if p)}
    proc = subprocess.Popen([sys.executable, "-m", "syncwise.cli", "train", "--run-dir", str(run), *CLI],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2:
            proc.send_signal(signal.SIGUSR1)
            break
        time.sleep(0.05)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    record = read_marker(run)
    assert record["signal"] == "SIGUSR1" and record["saved"] and record["step"] < 10
    stop = record["step"]
    assert f"preempted (SIGUSR1) after step {stop}; checkpoint of step {stop} saved" in err
    assert f"resume with: syncwise train --run-dir {run} --resume auto" in err and "Traceback" not in err
    assert latest_valid(run / "checkpoints").name == f"step_{stop:08d}"
    assert main(["train", "--run-dir", str(run), *CLI, "--resume", "auto"]) == 0
    assert read_marker(run) is None  # the resumed run removed the old attempt's marker
    straight, resumed = _rows(tmp_path / "straight"), _rows(run)
    assert [r["step"] for r in resumed] == list(range(1, 11))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
