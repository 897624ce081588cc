"""Live recovery (issue 30, docs/live-recovery.md): replica groups of real processes (torchrun each, gloo, torchft's
lighthouse and Manager), with replicas killed mid-run.

Every run here is `syncwise train --ft.replicas=N` on the tiny preset with 1 worker per replica group; the steps are
stretched by an injected slow data loader so a killed replica's replacement (a fresh Python process) has time to
start and rejoin before the run ends.
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from helpers import final_replica_digests, metrics_rows
from syncwise.cli import main
from syncwise.config import build_config, check_references
from syncwise.errors import ConfigError

needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                   reason="torchft is not installed (requirements-dev.txt pins torchft==0.2.0)")

STEPS = 30
BASE = ["--preset", "tiny", "--nproc", "1", "--steps", str(STEPS), "--data.seq_len=32", "--train.val_interval=0",
        "--train.val_batches=1", "--ckpt.interval=0", "--ft.timeout_s=10", "--inject-fault", "slowdata:ms=300"]
# The loss of a run with a replica lost for a few steps (those steps average 2 of 3 replicas' gradients, the lost
# replica's shard is skipped) against the uninterrupted run: the mean of the last 5 steps within this much.
LOSS_TOLERANCE = 0.15


def _train(run_dir, *extra):
    return main(["train", "--run-dir", str(run_dir), *BASE, *extra])


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _tail_loss(rows, n=5):
    return sum(r["loss"] for r in rows[-n:]) / n


def _check_run(run_dir, replicas=3):
    """One metrics row per step; the replicas that trained to the end hold identical parameters (``replicas``: how
    many must have; None: at least one)."""
    rows = metrics_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # one row per step, none missing
    summary = _summary(run_dir)
    digests = final_replica_digests(summary["live_recovery"])
    assert len(set(digests.values())) == 1, digests  # replicas identical at the end
    assert len(digests) == replicas if replicas else digests, digests
    assert summary["live_recovery"]["steps_missing"] == []
    return rows, summary


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ft") / "clean"
    # without the slow loader (it only gives a killed replica's replacement time to start): same batches, same loss
    fast = [a for a in BASE if a not in ("--inject-fault", "slowdata:ms=300")]
    assert main(["train", "--run-dir", str(run_dir), *fast, "--ft.replicas=3"]) == 0
    rows, summary = _check_run(run_dir)
    assert all(r["replicas"] == 3 for r in rows)
    assert summary["live_recovery"]["data_skipped_by_replica"] == {}
    return rows


# ---------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("overrides, field", [
    ({"ft.replicas": "1"}, "ft.replicas"),
    ({"ft.replicas": "-2"}, "ft.replicas"),
    ({"ft.replicas": "3", "ft.min_replicas": "4"}, "ft.min_replicas"),
    ({"ft.replicas": "2", "ft.lighthouse": "nohost"}, "ft.lighthouse"),
    ({"ft.replicas": "2", "ft.quorum_timeout_s": "0"}, "ft.quorum_timeout_s"),
    ({"ft.replicas": "2", "dist.nproc": "2", "parallel.tp": "2"}, "parallel.tp"),
    ({"ft.replicas": "2", "dist.nproc": "2", "parallel.sync": "localsgd:period=4"}, "dist.nproc"),
    ({"ft.replicas": "2", "dist.max_restarts": "2"}, "dist.max_restarts"),
    ({"inject_fault": ["healkill:rank=0"]}, "inject_fault"),
    ({"ft.replicas": "2", "dist.nproc": "1", "compress.method": "topk:ratio=0.01"}, "compress.method"),
    ({"ft.replicas": "2", "dist.nproc": "1", "compress.method": "powersgd:rank=4"}, "compress.method"),
    ({"ft.replicas": "2", "dist.nproc": "1", "parallel.sync": "diloco:period=4,bits=4"}, "parallel.sync"),
])
def test_bad_live_recovery_settings_are_refused_with_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        cfg = build_config(None, {"model.preset": "tiny", **overrides})
        check_references(cfg)
    assert e.value.field == field, e.value
    assert "\n" not in str(e.value)


def test_cli_refuses_a_single_replica_before_any_worker_starts(tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path / "run"), "--preset", "tiny", "--ft.replicas=1"]) == 2
    err = capsys.readouterr().err
    assert "ft.replicas" in err and "2" in err
    assert not (tmp_path / "run").exists()


@needs_torchft
def test_python_api_refuses_a_bad_live_recovery():
    from syncwise.models import build_model
    from syncwise.train import OptimizedTrainer
    from syncwise.train.live_recovery import LiveRecovery

    model = build_model("tiny", vocab_size=64, seq_len=16)
    live = LiveRecovery(replica=0, replicas=2, lighthouse="localhost:1")
    with pytest.raises(ConfigError, match="compress_gradients"):  # before any Manager or quorum
        OptimizedTrainer(model, torch.optim.AdamW(model.parameters()), compress_gradients="topk:ratio=0.01",
                         live_recovery=live, show_progress=False)

    with pytest.raises(ConfigError, match="ft.replicas"):
        LiveRecovery(replica=0, replicas=1, lighthouse="localhost:1")
    with pytest.raises(ConfigError, match="ft.min_replicas"):
        LiveRecovery(replica=0, replicas=2, lighthouse="localhost:1", min_replicas=3)


@needs_torchft
@pytest.mark.slow
def test_a_killed_replica_then_a_failure_during_its_healing_transfer(tmp_path, uninterrupted):
    """Two failures in a row, one run: replica 1 is killed at step 3; when its replacement asks for the state, the
    peer sending it (replica 0: torchft assigns a healer the first up-to-date replica in id order) dies. The
    replacement's heal fails, it restarts and heals from replica 2, still alive; the killed sender is replaced too and
    heals from a live peer (no checkpoint read).

    Only what holds at any speed is asserted: whether a replacement is back before the last step is a race (on a slow
    machine replica 2 trains to the end alone and the replacements find the run finished). Whatever the timing: one row
    per step; the replicas that trained to the end are identical; a replacement that trained healed from a live peer; a
    shrink names a killed replica; the loss is within tolerance of the uninterrupted run; either the heal-kill
    happened (then the failed heal restarted and replica 0 was replaced) or replica 1's replacement says the run had
    already finished; every replica group exits 0."""
    run_dir = tmp_path / "heal"
    assert _train(run_dir, "--ft.replicas=3", "--inject-fault", "kill:rank=1,step=3",
                  "--inject-fault", "healkill:rank=0", "--ft.replica_restarts=4") == 0
    rows, summary = _check_run(run_dir, replicas=None)
    counts = [r["replicas"] for r in rows]
    assert counts[:2] == [3] * 2 and counts[-1] >= 1
    attempts = summary["live_recovery"]["attempts"]
    for a in attempts:  # every replacement that trained got its state from a live peer
        if a["attempt"] > 0 and a.get("param_digest"):
            assert a["heals"] and a["fallback_step"] is None, a
    for a in attempts:  # every shrink names a killed replica (1, or the sender 0), at or after the kill
        for change in a["quorum_changes"]:
            assert set(change["lost"]) <= {0, 1} and (change["step"] >= 3 or not change["lost"]), change
    assert abs(_tail_loss(rows) - _tail_loss(uninterrupted)) < LOSS_TOLERANCE
    ft = run_dir / "ft"
    logs = {r: (ft / f"replica{r}.log").read_text() for r in range(3)}
    if "killing rank 0 during a healing transfer" in logs[0]:
        assert "could not join the quorum" in "".join(logs.values())  # the heal failed: that replica restarted
        assert (ft / "replica0.1").is_dir()  # the killed sender was replaced
    else:  # replica 1's replacement came back after the last step and never asked for the state
        assert "already finished" in logs[1], logs[1][-2000:]
    assert summary["live_recovery"]["exit_codes"] == [0, 0, 0]


@needs_torchft
@pytest.mark.slow
def test_losing_every_replica_falls_back_to_the_newest_checkpoint_and_a_relaunch_resumes(tmp_path):
    """Both replicas killed at step 9: a restarted one finds no live peer and loads the newest checkpoint (step 5,
    or 8 where that save landed first); a replica restarted after it may heal from it instead, and a restart may
    itself fail and be restarted again (a loaded machine), so which attempt falls back is not asserted.
    Then `--resume auto` launches the finished run again with more steps: the new launch's attempts number on after
    the first launch's, its replicas load the final checkpoint, and metrics.jsonl covers every step once."""
    from syncwise.launch.ft import FT_DIR

    run_dir = tmp_path / "all"
    args = ["train", "--run-dir", str(run_dir), *[a if a != "--ckpt.interval=0" else "--ckpt.interval=5"
                                                  for a in BASE], "--ckpt.async_save=false", "--ft.replicas=2"]
    assert main([*args, "--inject-fault", "kill:rank=0,step=9", "--inject-fault", "kill:rank=1,step=9"]) == 0
    rows, summary = _check_run(run_dir, replicas=2)
    fallbacks = [a["fallback_step"] for a in summary["live_recovery"]["attempts"] if a["attempt"] >= 1]
    assert 5 in fallbacks or 8 in fallbacks, summary["live_recovery"]["attempts"]  # resumed from a checkpoint
    first = 1 + max(int(d.suffix[1:]) for d in (run_dir / FT_DIR).glob("replica*.*") if d.is_dir())
    assert main([*[a if a != str(STEPS) else str(STEPS + 3) for a in args], "--resume", "auto"]) == 0
    rows = metrics_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 4)) and rows[-1]["attempt"] >= first
    summary = _summary(run_dir)
    assert summary["steps"] == STEPS + 3
    relaunched = {a["fallback_step"] for a in summary["live_recovery"]["attempts"] if a["attempt"] == first}
    assert relaunched == {STEPS}, summary["live_recovery"]["attempts"]


API_SCRIPT = '''
import json, sys, torch
from torch.utils.data import DataLoader, TensorDataset
from syncwise.models import build_model
from syncwise.train import OptimizedTrainer
from syncwise.train.live_recovery import LiveRecovery

live = LiveRecovery.from_env()                  # set by python -m syncwise.launch.ft
torch.manual_seed(0)
model = build_model("tiny", vocab_size=64, seq_len=16)
tokens = torch.randint(0, 64, (64, 17), generator=torch.Generator().manual_seed(1))
loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
trainer = OptimizedTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), live_recovery=live,
                           run_dir=live.run_dir(sys.argv[1]), show_progress=False)
summary = trainer.train(loader, steps=6)
assert summary["live_recovery"]["replicas"] == 2
'''


@needs_torchft
@pytest.mark.slow
def test_python_api_trains_replica_groups_through_the_trainer(tmp_path):
    """A user's script: ``OptimizedTrainer(..., live_recovery=LiveRecovery.from_env())`` under
    ``python -m syncwise.launch.ft``; the trainer shards the loader over both replica groups and they end identical."""
    from syncwise.launch.ft import main as ft_main

    script = tmp_path / "train.py"
    script.write_text(API_SCRIPT)
    base = tmp_path / "run"
    assert ft_main(["--replicas", "2", "--run-dir", str(base), "--", str(script), str(base)]) == 0
    summaries = [json.loads((base / "ft" / f"replica{r}.0" / "summary.json").read_text()) for r in (0, 1)]
    assert summaries[0]["live_recovery"]["param_digest"] == summaries[1]["live_recovery"]["param_digest"]
    rows = [json.loads(line) for line in (base / "ft" / "replica0.0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(r["replicas"] == 2 for r in rows)


@needs_torchft
@pytest.mark.slow
def test_a_stopped_replica_is_dropped_after_the_timeout_and_heals_when_it_resumes(tmp_path):
    """SIGSTOP (a hung replica, not a dead one): the survivors discard the step that waited for it (its time is
    ``discarded_s`` in the row) and train on without it; after SIGCONT it finds itself behind and heals in place."""
    import os
    import signal
    import subprocess
    import sys
    import time

    run_dir = tmp_path / "stop"
    proc = subprocess.Popen([sys.executable, "-m", "syncwise.cli", "train", "--run-dir", str(run_dir), "--ft.replicas=3",
                             "--ft.timeout_s=5", *[a for a in BASE if a != "--ft.timeout_s=10"]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    status = run_dir / "ft" / "status" / "replica1.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            last = json.loads(status.read_text())
            if last["step"] >= 3:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("replica 1 never reached step 3")
    os.kill(last["pid"], signal.SIGSTOP)
    time.sleep(7)  # past the 5 s timeout: the survivors' step waited it out and was discarded
    os.kill(last["pid"], signal.SIGCONT)
    assert proc.wait(timeout=300) == 0
    # What holds at any speed: the survivors trained on without the stopped replica. Whether a step waited out the
    # 5 s timeout first (its time then is the row's `discarded_s`) or the next quorum left the replica out once its
    # heartbeat stopped depends on where in the step SIGSTOP landed (CI once saw no discarded step). If the replica
    # trained again after SIGCONT it healed in place (no restart) and the run ended with all three.
    rows, summary = _check_run(run_dir, replicas=None)
    assert 2 in [r["replicas"] for r in rows]
    attempts = {(a["replica"], a["attempt"]): a for a in summary["live_recovery"]["attempts"]}
    assert (1, 1) not in attempts  # SIGSTOP is no death: never restarted
    if rows[-1]["replicas"] == 3:
        assert attempts[(1, 0)]["heals"]  # healed in the same process
