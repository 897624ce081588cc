"""Live recovery on GPUs (issue 39 row N6), checked on the CPU: the rule that picks the cross-replica group by the
replicas' device (NCCL for CUDA, gloo for the CPU) and refuses a tensor on the wrong one; each replica group's own
GPU range on one machine (CUDA_VISIBLE_DEVICES from the launcher) and its one-line refusal; and the gradient sync's
state (a compressor's error feedback) copied for a healing peer only when a heal may need it, never on a healthy
step whose quorum ended before its backward. No GPU runs here: the NCCL group itself is unverified on a real GPU in
this repository (docs/gpu.md)."""
from __future__ import annotations

import concurrent.futures
import importlib.util
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from distributed import run_workers
from syncwise import devices
from syncwise.errors import ConfigError, SyncwiseError

needs_torchft = pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                   reason="torchft is not installed (requirements-dev.txt pins torchft==0.2.0)")


# ------------------------------------------------------------------------------------ the backend, by device
def test_the_cross_replica_backend_follows_the_replicas_device():
    assert devices.replica_backend("cpu") == "gloo"
    assert devices.replica_backend("cuda") == "nccl"
    with pytest.raises(ConfigError) as e:
        devices.replica_backend("mps")
    assert e.value.field == "device" and "\n" not in str(e.value)


def test_a_tensor_on_the_wrong_side_of_the_cross_replica_group_is_refused():
    devices.check_replica_wire("gloo", torch.device("cpu"))
    devices.check_replica_wire("nccl", torch.device("cuda", 0))  # (a device object: no GPU needed to name one)
    with pytest.raises(SyncwiseError, match="a cuda tensor was handed to the gloo cross-replica group") as e:
        devices.check_replica_wire("gloo", torch.device("cuda", 1))
    assert "\n" not in str(e.value) and "nccl" in str(e.value)
    with pytest.raises(SyncwiseError, match="a cpu tensor was handed to the nccl"):
        devices.check_replica_wire("nccl", "cpu")


@needs_torchft
def test_the_worker_builds_torchfts_group_for_the_rule_and_its_buckets_refuse_another_device():
    import torchft

    from syncwise.train.live_recovery import LiveRecovery, _wire_device, replica_process_group

    assert type(replica_process_group("gloo", timedelta(seconds=5))) is torchft.ProcessGroupGloo
    with pytest.raises(ConfigError):
        replica_process_group("mpi", timedelta(seconds=5))
    if torch.cuda.is_available():  # (a GPU machine: torchft's abortable NCCL group, built on the current device)
        assert type(replica_process_group("nccl", timedelta(seconds=5))) is torchft.ProcessGroupNCCL
    assert _wire_device(list(nn.Linear(2, 2).parameters())) == torch.device("cpu")
    assert _wire_device([], "cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="one device type"):
        _wire_device([torch.zeros(1), torch.zeros(1, device="meta")])

    # a bucket on another device than the group's never reaches it (here a 'meta' tensor stands for a CUDA one on
    # a CPU-only machine: the same check, the same one line)
    live = LiveRecovery(replica=0, replicas=2, lighthouse="localhost:1")
    assert (live.backend, live.wire_device.type) == ("gloo", "cpu")
    with pytest.raises(SyncwiseError, match="a meta tensor was handed to the gloo cross-replica group"):
        live._issue(torch.zeros(4, device="meta"))


# ------------------------------------------------------------------------------- one GPU range per replica group
def test_each_replica_group_gets_gpus_of_its_own():
    assert [devices.replica_gpus(r, 2, 4, 8) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [devices.replica_gpus(r, 3, 1, 4) for r in range(3)] == [range(0, 1), range(1, 2), range(2, 3)]
    assert devices.replica_visible_devices("cuda", 1, 2, 2, 4) == "2,3"
    assert devices.replica_visible_devices("auto", 1, 2, 2, 4) == "2,3"
    # the launcher's own CUDA_VISIBLE_DEVICES is split, not the machine's numbering
    assert devices.replica_visible_devices("auto", 1, 2, 2, 4, parent="4,5,6,7") == "6,7"
    assert devices.replica_visible_devices("auto", 0, 2, 1, 2, parent="GPU-aa, GPU-bb") == "GPU-aa"
    # the CPU: the environment is left as it is
    assert devices.replica_visible_devices("cpu", 1, 2, 2, 4) is None
    assert devices.replica_visible_devices("auto", 1, 2, 2, 0) is None


def test_too_few_gpus_for_the_replica_groups_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        devices.replica_gpus(0, 2, 1, 1)  # two replica groups on one GPU: NCCL would refuse them at the first quorum
    assert e.value.field == "ft.replicas" and "\n" not in str(e.value)
    assert "at most 1 replica group(s) of 1 worker(s) on this machine's 1 GPU(s)" in str(e.value)
    assert "dist.device=cpu" in str(e.value)
    with pytest.raises(ConfigError, match="at most 2 replica group"):  # 3 groups of 2 workers, 4 GPUs
        devices.replica_visible_devices("auto", 0, 3, 2, 4)
    with pytest.raises(ConfigError) as e:
        devices.replica_visible_devices("cuda", 0, 2, 1, 0)
    assert e.value.field == "dist.device"


def test_the_launcher_gives_each_replica_group_its_range_before_starting_any():
    from syncwise.launch.ft import replica_gpu_env

    assert replica_gpu_env("auto", 2, 2, base={}, visible_gpus=4) == [{"CUDA_VISIBLE_DEVICES": "0,1"},
                                                                      {"CUDA_VISIBLE_DEVICES": "2,3"}]
    assert replica_gpu_env("auto", 2, 1, base={"CUDA_VISIBLE_DEVICES": "3,5"}, visible_gpus=2) == [
        {"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    assert replica_gpu_env("cpu", 3, 2, base={}, visible_gpus=4) == [{}, {}, {}]
    assert replica_gpu_env("auto", 3, 2, base={}, visible_gpus=0) == [{}, {}, {}]
    with pytest.raises(ConfigError, match="ft.replicas"):
        replica_gpu_env("auto", 3, 2, base={}, visible_gpus=4)


# ------------------------------------------------------------------- the gradient sync's state and a healing peer
class _Position:
    """A data position (changes when the step's batch is drawn, before its quorum may have ended)."""

    def __init__(self):
        self.index = 0

    def state_dict(self):
        return {"index": self.index}

    def load_state_dict(self, sd):
        self.index = sd["index"]


def _copies_for_a_healing_peer(rank, world):
    """Five steps of one replica, driving LiveRecovery's snapshot points as the trainer and torchft's quorum thread
    do (begin_step's snapshot, the quorum's ``_state`` when a peer heals, ``before_backward``, the backward's
    compressor update, which changes its residual in place), with a real error-feedback compressor. Returns, per
    step, the compressor state copies made and whether what a healing peer got is the step's start. (The manager is
    reduced to the one thing these points read of it: its quorum's future.)"""
    import os

    from syncwise.checkpoint import TrainState
    from syncwise.comm import hostread
    from syncwise.compress import CompressionHookState, CompressionPolicy, parse_compress_spec
    from syncwise.train.live_recovery import LiveRecovery

    class Counting(CompressionHookState):
        copies = 0

        def state_dict(self):  # (every copy of the compressor's state goes through here: it clones its tensors)
            Counting.copies += 1
            return super().state_dict()

    grad = torch.arange(64, dtype=torch.float32).sin().reshape(8, 8)
    hook = Counting(parse_compress_spec("topk:ratio=0.25"), None, {}, CompressionPolicy(min_numel=1),
                    dedicated_group=False)
    data = _Position()
    state = TrainState()
    state.register("data", data, per_rank=True)
    state.register("compressor", hook, per_rank=True)
    live = LiveRecovery(replica=0, replicas=2, lighthouse="localhost:1")
    live._state_obj = state

    def residual():
        return {k: {n: v.clone() for n, v in s.items() if torch.is_tensor(v)}
                for k, s in hook.compressor._state.items()}

    def backward():  # the gradient sync's hook: the compressor's error feedback changes
        hook.average([grad.clone()], ["w"])

    def step(heal_before_backward, quorum_done_at_backward, heal_after_backward):
        """One step; returns (copies, what a healing peer got matched the step's start)."""
        before = Counting.copies
        live._snapshot_for_peers()  # begin_step, then the quorum starts in torchft's thread
        future = concurrent.futures.Future()
        live.manager, live._quorum_pending = SimpleNamespace(_quorum_future=future), (1, 0.0, 0)
        start_residual, start_index = residual(), data.index
        data.index += 1  # the batch is drawn
        served = []
        if heal_before_backward:  # a peer heals while this replica runs its forward
            served.append(live._state(state))
        if quorum_done_at_backward:
            future.set_result(None)
        with hostread.step_region():  # (strict: the trainer's step, where before_backward runs, reads no step value
            live.before_backward()    # on the host except by design)
            backward()
        after = residual()
        changed = bool(start_residual) and any(not torch.equal(after[k][n], v) for k, s in start_residual.items()
                                               for n, v in s.items())
        if heal_after_backward:  # the quorum still ran when the backward began; a peer asks now
            served.append(live._state(state))
        if not future.done():
            future.set_result(None)
        live._quorum_pending = None
        good = all(sd["data"]["index"] == start_index and all(
            torch.equal(sd["compressor"]["compressor"]["per_tensor"][k][n], v)
            for k, s in start_residual.items() for n, v in s.items()) for sd in served)
        return Counting.copies - before, good and changed  # (changed: the backward did move the state)

    os.environ[hostread.STRICT_ENV] = "1"
    backward()  # a residual to protect
    return [step(False, True, False),   # healthy, its quorum ended during the forward: nothing copied
            step(False, True, False),   # (again: no copy accumulates either)
            step(True, True, False),    # a heal during the forward: the state read once, as it is (the start)
            step(False, False, True),   # the backward began while the quorum ran: one copy, and the peer gets it
            step(False, False, False)]  # the backward began while the quorum ran, nobody healed: one copy


@needs_torchft
def test_a_healthy_step_does_not_copy_the_compressor_state_and_a_healing_peer_gets_the_steps_start():
    (results,) = run_workers(_copies_for_a_healing_peer, 1)
    assert results == [(0, True), (0, True), (1, True), (1, True), (1, True)], results


@needs_torchft
@pytest.mark.slow
def test_a_compressor_inside_the_replica_groups_heals_with_the_rest(tmp_path):
    """2 replica groups × 2 DDP workers with top-k (error feedback) inside each group; rank 2 (replica 1's group rank
    0) is killed at step 3, its group restarts and heals from replica 0 — the compressor's state included, read by
    the peer as it was before its step's backward. What holds at any speed: one row per step, identical replicas at
    the end, and a replacement that trained healed from the live peer (else it found the run finished)."""
    import json

    from helpers import final_replica_digests, metrics_rows
    from syncwise.cli import main

    run_dir = tmp_path / "topk"
    assert main(["train", "--run-dir", str(run_dir), "--preset", "tiny", "--nproc", "2", "--steps", "12",
                 "--data.seq_len=32", "--train.val_interval=0", "--train.val_batches=1", "--ckpt.interval=0",
                 "--ft.timeout_s=10", "--ft.replicas=2", "--compress.method=topk:ratio=0.1",
                 "--inject-fault", "slowdata:ms=500", "--inject-fault", "kill:rank=2,step=3"]) == 0
    assert [r["step"] for r in metrics_rows(run_dir)] == list(range(1, 13))
    live = json.loads((run_dir / "summary.json").read_text())["live_recovery"]
    digests = final_replica_digests(live)
    assert len(set(digests.values())) == 1, digests
    attempts = {(a["replica"], a["attempt"]): a for a in live["attempts"]}
    assert all("sync_state_copies" in a for a in attempts.values())
    if attempts.get((1, 1), {}).get("param_digest"):
        assert attempts[(1, 1)]["heals"] and attempts[(1, 1)]["fallback_step"] is None
    else:
        assert "already finished" in (run_dir / "ft" / "replica1.log").read_text()
