import time

import pytest
import torch
import torch.distributed as dist

from distributed import run_workers
from syncwise.comm import CommContext, Topology
from syncwise.errors import ConfigError, SyncwiseError
from syncwise.launch import run_local


def _context_ops(rank, world):
    out = {}
    ctx = CommContext("gloo")
    out["ids"] = (ctx.get_rank(), ctx.get_world_size(), ctx.local_rank, ctx.local_world_size, ctx.node_rank,
                  ctx.num_nodes)
    local = torch.tensor([1.0, 2.0, 3.0]) * (rank + 1)
    res = {}
    for op in ("sum", "avg", "max", "min", "product"):
        dst = torch.empty(3)
        got = ctx.all_reduce(local, dst, op)
        res[op] = (got is dst, dst.tolist(), local.tolist())
    out["out_ops"] = res
    inplace = torch.full((4,), float(rank))
    out["inplace"] = (ctx.all_reduce(inplace) is inplace, inplace.tolist())
    for bad in (lambda: ctx.all_reduce(local, op="mean"), lambda: ctx.all_reduce(local, torch.empty(2))):
        try:
            bad()
            out.setdefault("errors", []).append(None)
        except SyncwiseError as e:
            out.setdefault("errors", []).append(type(e).__name__)
    out["bytes"] = ctx.stats.snapshot()["all_reduce"]  # the context's own counter
    ctx.barrier()
    with CommContext() as ctx2:  # a second context reuses the existing group
        out["ctx2_backend"] = ctx2.backend
    # The group was created by the harness, not by the context: closing must not destroy it.
    ctx.close()
    out["still_initialized"] = dist.is_initialized()
    return out


def test_comm_context_rank_world_and_all_reduce_with_out_and_ops():
    res = run_workers(_context_ops, 2)
    for rank, out in enumerate(res):
        assert out["ids"] == (rank, 2, rank, 2, 0, 1)
        r = out["out_ops"]
        assert r["sum"] == (True, [3.0, 6.0, 9.0], [float(rank + 1) * v for v in (1, 2, 3)])  # local untouched
        assert r["avg"][1] == [1.5, 3.0, 4.5]
        assert r["max"][1] == [2.0, 4.0, 6.0]
        assert r["min"][1] == [1.0, 2.0, 3.0]
        assert r["product"][1] == [2.0, 8.0, 18.0]
        assert out["inplace"] == (True, [1.0] * 4)
        assert out["errors"] == ["ConfigError", "SyncwiseError"]
        # 5 out-of-place (3 floats) + 1 in-place (4 floats) reductions, payload bytes counted exactly.
        assert out["bytes"]["calls"] == 6 and out["bytes"]["bytes"] == 5 * 12 + 16
        assert out["ctx2_backend"] == "gloo"
        assert out["still_initialized"]


def _node_topology(rank, world):
    ctx = CommContext()
    x = torch.tensor([float(rank + 1)])
    # one process per node: no intra-node group, the cross-node group is the world
    ctx.all_reduce(x, group=ctx.inter_group)
    return ctx.topology, ctx.node_rank, ctx.local_rank, ctx.intra_group is None, x.item()


def test_topology_from_torchrun_env_one_proc_per_node():
    res = run_workers(_node_topology, 2, local_world_size=1)
    for rank, (topo, node, local, no_intra, val) in enumerate(res):
        assert topo == Topology(2, 1) and node == rank and local == 0 and no_intra and val == 3.0


def test_topology_validation(monkeypatch):
    t = Topology(3, 2)
    assert t.world_size == 6 and t.node_ranks(1) == [2, 3] and t.cross_ranks(1) == [1, 3, 5]
    assert t.node_of(5) == 2 and t.local_rank_of(5) == 1 and not t.is_trivial and Topology(1, 8).is_trivial
    with pytest.raises(ConfigError, match="topology.nodes"):
        Topology(0, 2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE"):
        Topology.from_env()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("GROUP_RANK", "0")
    with pytest.raises(SyncwiseError, match="GROUP_RANK"):
        Topology.from_env()


def test_bad_backend_is_rejected_before_anything_starts():
    with pytest.raises(ConfigError, match="backend"):
        CommContext("mpi")
    with pytest.raises(ConfigError, match="timeout_s"):
        CommContext("gloo", timeout_s=0)


def _init_from_env_and_hang(timeout_s):
    """Under torchrun (run_local): the context initialises the group itself; rank 1 never joins a collective."""
    torch.set_num_threads(1)
    ctx = CommContext("auto", timeout_s=timeout_s)
    info = {"owns": ctx._owns_default, "backend": ctx.backend, "world": ctx.get_world_size()}
    ok = torch.ones(2)
    ctx.all_reduce(ok)
    info["sum"] = ok.tolist()
    if ctx.get_rank() == 0:
        start = time.monotonic()
        try:
            ctx.all_reduce(torch.ones(1))
            info["error"] = None
        except SyncwiseError as e:
            info["error"] = str(e)
        info["elapsed"] = time.monotonic() - start
    else:
        time.sleep(timeout_s + 3)  # stay alive, so rank 0 sees a timeout rather than a closed socket
    ctx.close()
    info["destroyed"] = not dist.is_initialized()
    return info


def test_context_initialises_from_torchrun_env_and_a_hung_collective_times_out():
    res = run_local(_init_from_env_and_hang, 2, 2.0)
    for rank in (0, 1):
        assert res[rank]["owns"] and res[rank]["backend"] == "gloo" and res[rank]["world"] == 2
        assert res[rank]["sum"] == [2.0, 2.0]
        assert res[rank]["destroyed"]
    assert "timeout" in res[0]["error"] and "rank 0 of 2" in res[0]["error"]
    # fails within the configured timeout (generous upper bound: this is a 2-core shared machine)
    assert 1.5 <= res[0]["elapsed"] < 30
