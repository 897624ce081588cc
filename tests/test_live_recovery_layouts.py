"""Live recovery beyond DDP replicas (issue 30, docs/live-recovery.md): HSDP replica groups (FSDP2 inside a group,
torchft's manager as the replicate dimension across groups) and local SGD / DiLoCo workers as replicas (a quorum
per round, the outer all-reduce through torchft, commit or back to the last outer step).

The two slow tests are real `syncwise train --ft.replicas=2` runs (torchrun per replica group, gloo, torchft's
lighthouse) on the tiny preset with one replica killed mid-run; an injected slow loader gives the killed replica's
replacement (a fresh Python process) time to start and heal from the live peer before the run ends. What stays
refused is checked fast, from the config (CLI) and from the Python API, before any worker starts.
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from torch import nn

from helpers import final_replica_digests, metrics_rows
from syncwise.cli import main
from syncwise.config import build_config, check_references
from syncwise.errors import ConfigError

needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                   reason="torchft is not installed (requirements-dev.txt pins torchft==0.2.0)")

BASE = ["--preset", "tiny", "--data.seq_len=32", "--train.val_interval=0", "--train.val_batches=1",
        "--ckpt.interval=0", "--ft.timeout_s=10", "--ft.replicas=2"]


def _attempts(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())["live_recovery"]
    return summary, {(a["replica"], a["attempt"]): a for a in summary["attempts"]}


def _ended_identical(run_dir, steps, replicas=2):
    """One row per step, no step missing, both groups exited 0 and the replicas that trained to the end (``replicas``
    of them; None: at least one) ended with identical parameters: (rows, the live-recovery summary, its attempts by
    (replica, attempt))."""
    rows = metrics_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    summary, attempts = _attempts(run_dir)
    assert summary["steps_missing"] == [] and summary["exit_codes"] == [0, 0]
    digests = final_replica_digests(summary)
    assert (len(digests) == replicas if replicas else digests) and len(set(digests.values())) == 1, digests
    return rows, summary, attempts


def _mean(rows, which):
    return sum(r["loss"] for r in which(rows)) / len(which(rows))


# ---------------------------------------------------------------------------------------------- what stays refused
@pytest.mark.parametrize("overrides, field, says", [
    ({"dist.nproc": "2", "parallel.tp": "2"}, "parallel.tp", "tensor"),
    ({"dist.nproc": "2", "parallel.pp": "2"}, "parallel.pp", "pipeline"),
    ({"parallel.sync": "sparseloco:period=4"}, "parallel.sync", "all-gathered"),
    ({"parallel.sync": "streaming:period=4"}, "parallel.sync", "fragments"),
    ({"parallel.sync": "torch-localsgd:period=4"}, "parallel.sync", "PeriodicModelAverager"),
    ({"parallel.sync": "pipesgd"}, "parallel.sync", "one step late"),
    ({"parallel.sync": "diloco:period=4,delay=2"}, "parallel.sync", "delay=2"),
    ({"parallel.sync": "diloco:period=4,warmup=2"}, "parallel.sync", "warmup=2"),
    ({"parallel.sync": "localsgd:period=4,dtype=bf16"}, "parallel.sync", "dtype=bf16"),
    ({"dist.nproc": "2", "parallel.sync": "diloco:period=4"}, "dist.nproc", "one process"),
    ({"dist.nproc": "2", "parallel.dp_shard": "2", "parallel.sync": "diloco:period=4"}, "parallel.sync", "dp_shard"),
])
def test_what_live_recovery_does_not_cover_is_refused_with_the_field(overrides, field, says):
    with pytest.raises(ConfigError) as e:
        check_references(build_config(None, {"model.preset": "tiny", "ft.replicas": "2", "dist.nproc": "1",
                                             **overrides}))
    assert e.value.field == field, e.value
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides", [
    {"dist.nproc": "2", "parallel.dp_shard": "2"},                 # HSDP: FSDP2 inside, torchft across
    {"dist.nproc": "4", "parallel.dp_shard": "2"},                 # HSDP inside the group too
    {"dist.nproc": "1", "parallel.sync": "localsgd:period=4"},
    {"dist.nproc": "1", "parallel.sync": "diloco:period=4"},
])
@needs_torchft
def test_the_new_live_recovery_layouts_are_accepted(overrides):
    check_references(build_config(None, {"model.preset": "tiny", "ft.replicas": "2", **overrides}))


def test_cli_refuses_an_uncovered_sync_before_any_worker_starts(tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path / "run"), "--preset", "tiny", "--nproc", "1",
                 "--ft.replicas=2", "--parallel.sync=streaming:period=4"]) == 2
    err = capsys.readouterr().err
    assert "parallel.sync" in err and "streaming" in err
    assert not (tmp_path / "run").exists()


@needs_torchft
@pytest.mark.parametrize("sync, field", [("sparseloco:period=4", "parallel.sync"),
                                         ("diloco:period=4,delay=1", "parallel.sync")])
def test_python_api_refuses_an_uncovered_sync(sync, field):
    """``OptimizedTrainer(..., sync=..., live_recovery=LiveRecovery(...))``: refused in the constructor (nothing
    connects to the lighthouse before ``train()``)."""
    from syncwise.train import OptimizedTrainer
    from syncwise.train.live_recovery import LiveRecovery

    model = nn.Linear(4, 4)
    with pytest.raises(ConfigError) as e:
        OptimizedTrainer(model, torch.optim.AdamW(model.parameters()), nn.functional.mse_loss, sync=sync,
                         show_progress=False, live_recovery=LiveRecovery(replica=0, replicas=2, lighthouse="localhost:1"))
    assert e.value.field == field and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- real runs
@needs_torchft
@pytest.mark.slow
def test_hsdp_replica_group_killed_heals_its_shards_from_the_live_peer(tmp_path):
    """2 replica groups × 2 FSDP2 workers (dp_shard 2). Rank 2 (replica 1's group rank 0) is killed at step 3; its
    torchrun restarts both workers, which heal from replica 0 (group rank r from group rank r: the same shard, sent
    as local tensors into the new DTensors) and train on. One row per step; the replicas end with identical
    (gathered) parameters; the loss comes down as in the uninterrupted runs."""
    run_dir = tmp_path / "hsdp"
    assert main(["train", "--run-dir", str(run_dir), *BASE, "--nproc", "2", "--parallel.dp_shard=2", "--steps", "16",
                 "--inject-fault", "slowdata:ms=500", "--inject-fault", "kill:rank=2,step=3"]) == 0
    # What holds at any speed: whether the replacement is back before the last step is a race (on a loaded machine
    # replica 0 once trained to the end alone). If it trained, it healed from the live peer and the run ended with
    # both replicas; if not, it found the run finished.
    rows, summary, attempts = _ended_identical(run_dir, 16, replicas=None)
    if attempts.get((1, 1), {}).get("param_digest"):
        heal = attempts[(1, 1)]["heals"]  # the replacement received the state from the live peer, no checkpoint read
        assert heal and heal[0]["step"] >= 2 and attempts[(1, 1)]["fallback_step"] is None
        assert rows[-1]["replicas"] == 2
    else:
        assert "already finished" in (run_dir / "ft" / "replica1.log").read_text()
    # trains on: the last steps' loss well below the first steps' (5.51 at step 1 on this preset)
    assert _mean(rows, lambda r: r[-3:]) < _mean(rows, lambda r: r[:3]) - 0.4


@needs_torchft
@pytest.mark.slow
def test_diloco_worker_killed_mid_round_is_replaced_and_heals_at_an_outer_step(tmp_path):
    """DiLoCo, 2 single-process replicas, period 4. Replica 1 is killed at step 3 (inside the first round): the
    survivor's outer all-reduce at step 4 does not commit, its parameters go back to the last outer step's (the
    round's 4 inner steps discarded, counted in step 4's row) and it trains on alone; the replacement joins at an
    outer-step boundary and receives the global parameters, the outer (Nesterov) state, the inner AdamW, the counters
    and the data position from it. One row per step; identical replicas at the end."""
    run_dir = tmp_path / "diloco"
    assert main(["train", "--run-dir", str(run_dir), *BASE, "--nproc", "1", "--parallel.sync=diloco:period=4",
                 "--steps", "20", "--inject-fault", "slowdata:ms=400", "--inject-fault", "kill:rank=1,step=3"]) == 0
    # What holds at any speed (as for HSDP above): the survivor discards the broken round; the replacement, if it is
    # back before the last step, heals at an outer-step boundary and both replicas end identical; else it found
    # the run finished (under load the survivor once trained all 20 steps alone first).
    rows, summary, attempts = _ended_identical(run_dir, 20, replicas=None)
    survivor = attempts[(0, 0)]
    assert survivor["discarded_rounds"] >= 1 and survivor["discarded_inner_steps"] >= 4
    assert rows[3].get("discarded_inner_steps") == 4 and summary["discarded_inner_steps"] == 4
    assert survivor["outer_steps"] == 4  # steps 8, 12, 16, 20 committed (4 did not), with or without a peer
    if attempts.get((1, 1), {}).get("param_digest"):
        heal = attempts[(1, 1)]["heals"]
        assert heal and heal[0]["step"] % 4 == 0 and heal[0]["step"] >= 4  # at an outer-step boundary
        assert rows[-1]["replicas"] == 2
    else:
        assert "already finished" in (run_dir / "ft" / "replica1.log").read_text()
    assert _mean(rows, lambda r: r[-3:]) < _mean(rows, lambda r: r[:3]) - 0.4
