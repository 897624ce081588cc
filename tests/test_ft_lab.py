"""Live recovery across the network lab (issue 30): the lighthouse on node 0, one replica group per lab node; a
whole node killed mid-run, the survivor trains on, the node's replica group is relaunched there and heals from the
live peer over the shaped link. Real namespaces, real torchrun jobs, gloo; own prefix and state directory."""
from __future__ import annotations

import json
import threading
import time

import pytest

from helpers import lab_unavailable

PREFIX = "swft"
SUBNET = "10.77.34.0/24"
_SKIP = lab_unavailable()


@pytest.mark.lab
@pytest.mark.slow
@pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")
def test_a_killed_lab_node_is_relaunched_and_its_replica_heals_from_the_live_peer(tmp_path, monkeypatch):
    pytest.importorskip("torchft", reason="live recovery needs torchft (requirements-dev.txt)")
    from syncwise.commands.train import prepare_run_dir
    from syncwise.config import config_from_argv
    from syncwise.lab import cluster as lab
    from syncwise.launch.ft import merge_metrics
    from syncwise.launch.ft_lab import kill_node, run_replicas_lab

    monkeypatch.setenv("SYNCWISE_LAB_DIR", str(tmp_path / "state"))
    run = tmp_path / "run"
    steps = 150
    lab.up(2, "1gbit", procs_per_node=1, subnet=SUBNET, prefix=PREFIX)
    try:
        cfg = config_from_argv(["--run-dir", str(run), "--nproc", "1", "--ft.replicas=2", "--ft.timeout_s=10",
                                "--preset", "tiny", "--steps", str(steps), "--data.seq_len=32",
                                "--train.val_interval=0", "--train.val_batches=1",
                                "--inject-fault", "slowdata:ms=100"])  # steps long enough to kill mid-run
        lock = prepare_run_dir(cfg)
        killed: list[int] = []

        def kill_when_training() -> None:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                rows = [line for p in run.glob("ft/replica1.*/metrics.jsonl") for line in p.read_text().splitlines()]
                if len(rows) >= 10:
                    killed.append(kill_node(1, prefix=PREFIX))
                    return
                time.sleep(0.1)

        threading.Thread(target=kill_when_training, daemon=True).start()
        codes = run_replicas_lab(["-m", "syncwise.commands.worker", "--config", str(run / "config.json")], run,
                                 replicas=2, nproc=1, restarts=2, timeout_s=10, prefix=PREFIX)
        summary = merge_metrics(run, steps)
        lock.release()
    finally:
        lab.down(PREFIX)
    assert killed and killed[0] >= 1 and codes == [0, 0]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # one row per step, none lost
    attempts = {(a["replica"], a["attempt"]): a for a in summary["live_recovery"]["attempts"]}
    # the relaunched group's attempts start at 1 × (restarts + 1): the lost attempt's directory is kept
    assert (run / "ft" / "replica1.0").is_dir() and (1, 3) in attempts
    assert attempts[(1, 3)]["heals"], "the replacement did not heal from the live peer"
    sizes = [q["replicas"] for q in attempts[(0, 0)]["quorum_changes"]]
    # the survivor's quorum starts and ends with both replicas; it shrank to the survivor in between unless the
    # replacement was back before the lighthouse's heartbeat timeout (then it joined the next quorum directly)
    assert sizes[0] == 2 and sizes[-1] == 2 and set(sizes) <= {1, 2}
