"""One ledger per run: no module-level communication counter, and two runs in one process count apart."""
import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from distributed import run_workers
from syncwise.comm import CommLedger, CommStats

SRC = Path(__file__).resolve().parents[1] / "src" / "syncwise"
COUNTERS = {"CommStats", "CommLedger"}


def _module_level_counters(text: str, name: str) -> list[str]:
    """'name:line Class' of each module-level statement that makes a CommStats / CommLedger (``X = CommStats()``,
    ``X: T = ops.CommStats()``, inside a module-level if / try / with as well)."""
    found = []

    def visit(body: list) -> None:
        for node in body:
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                for part in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []),
                             *[h.body for h in getattr(node, "handlers", [])]):
                    visit(part)
                continue
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            for call in ast.walk(node.value):
                if isinstance(call, ast.Call):
                    f = call.func
                    called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                    if called in COUNTERS:
                        found.append(f"{name}:{node.lineno} {called}")

    visit(ast.parse(text, name).body)
    return found


def test_no_module_level_communication_counters():
    found = [hit for path in sorted(SRC.rglob("*.py"))
             for hit in _module_level_counters(path.read_text(), str(path.relative_to(SRC.parent)))]
    assert found == [], "module-level counters (a run's ledger comes from parallelize): " + ", ".join(found)


def test_the_check_sees_the_forms_it_forbids():
    text = ("from .comm import ops\nfrom .comm.stats import CommStats\nSTATS = CommStats()\n"
            "X: object = ops.CommStats()\nif True:\n    Y = {'a': CommStats()}\n"
            "def f():\n    local = CommStats()\n")
    assert _module_level_counters(text, "m.py") == ["m.py:3 CommStats", "m.py:4 CommStats", "m.py:6 CommStats"]


def test_a_ledger_holds_one_counter_per_kind():
    ledger = CommLedger()
    assert set(ledger.KINDS) >= {"dp", "ep", "control", "norm", "pp", "signals"}
    assert ledger.dp is ledger["dp"] and isinstance(ledger.dp, CommStats)
    assert ledger.dp is not CommLedger().dp
    ledger.dp.record("all_reduce", 8)
    ledger.control.record("all_reduce", 4)
    assert ledger.snapshot() == {"dp": {"all_reduce": {"calls": 1, "bytes": 8, "time_s": 0.0}},
                                 "control": {"all_reduce": {"calls": 1, "bytes": 4, "time_s": 0.0}}}
    with pytest.raises(AttributeError):
        ledger.nope
    ledger.reset()
    assert ledger.snapshot() == {}


# ---------------------------------------------------------------- two trainers in one process, 2 gloo ranks
def _two_trainers(rank, world):
    from syncwise.train import OptimizedTrainer

    def trainer(seed, **options):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 4))
        return OptimizedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                                show_progress=False, **options), sum(p.numel() * 4 for p in model.parameters())

    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(4)]
    a, param_bytes = trainer(0)                               # DDP's built-in all-reduce: fp32 gradients
    b, _ = trainer(1, compress_gradients="fp16")               # syncwise's hook: half the bytes
    assert a.par.ledger is not b.par.ledger
    sa = a.train(batches, steps=2)
    after_a = a.par.ledger.dp.total_bytes
    sb = b.train(batches, steps=3)
    return {"param_bytes": param_bytes, "a": sa["comm_bytes_per_step"], "b": sb["comm_bytes_per_step"],
            "a_total": after_a, "a_total_after_b": a.par.ledger.dp.total_bytes,
            "b_total": b.par.ledger.dp.total_bytes, "b_compressor": b.compressor.stats is b.par.ledger.dp,
            "a_control": a.par.ledger.control.total_calls, "b_control": b.par.ledger.control.total_calls}


def test_two_trainers_in_one_process_keep_separate_byte_counts():
    for r in run_workers(_two_trainers, 2):
        assert r["a"] == r["param_bytes"] and r["a_total"] == 2 * r["param_bytes"]
        assert r["a_total_after_b"] == r["a_total"]             # b's steps are not counted in a's ledger
        assert r["b"] == r["param_bytes"] // 2 and r["b_total"] == 3 * r["param_bytes"] // 2
        assert r["b_compressor"]                                  # parallelize handed b's compressor its ledger
        assert r["a_control"] > 0 and r["b_control"] > 0          # each run's loss mean in its own control


def test_bytes_are_kept_per_hop():
    """Every record says which hop its bytes crossed; the hops add up to the total, unknown ones are kept apart."""
    s = CommStats()
    s.record("reduce_scatter", 12, hop="intra")
    s.record("all_gather", 3, hop="cross")
    s.record("all_reduce", 5)                    # no topology known
    s.record("all_reduce", 7, hop="sideways")    # not a hop: unknown, never dropped
    assert s.hop_bytes() == {"intra": 12, "cross": 3, "unknown": 12} and sum(s.hop_bytes().values()) == s.total_bytes
    s.record("all_reduce", 10, hop={"intra": 6, "cross": 4})   # a ring's split (comm.ops.split_bytes)
    s.record("all_reduce", 10, hop={"cross": 8})               # a split short of the bytes: the rest unknown
    assert s.hop_bytes() == {"intra": 18, "cross": 15, "unknown": 14} and sum(s.hop_bytes().values()) == s.total_bytes
    s.reset()
    assert s.hop_bytes() == {} and s.total_bytes == 0


def _hops_of_groups(rank, world, _):
    import torch.distributed as dist

    from syncwise.comm import ops

    node = dist.new_group([0, 1]), dist.new_group([2, 3])
    across = dist.new_group([0, 2])
    out = {"world": ops.hop_of(None), "node": ops.hop_of(node[rank // 2]),
           "across": ops.hop_of(across) if rank in (0, 2) else None}
    ops.declare_topology(4)                      # a CommContext saying all four are on one node
    out["world_one_node"] = ops.hop_of(None)
    return out


def test_a_groups_hop_follows_the_topology():
    res = run_workers(_hops_of_groups, 4, None, local_world_size=2)
    assert all(r["world"] == "cross" and r["node"] == "intra" and r["world_one_node"] == "intra" for r in res), res
    assert res[0]["across"] == res[2]["across"] == "cross"


def _split_by_the_ring_rule(rank, world, _):
    """Every ring collective through comm.ops on 2 nodes × 2 ranks, each into its own CommStats: bytes per hop."""
    import torch.distributed as dist

    from syncwise.comm import ops

    node = dist.new_group([0, 1]), dist.new_group([2, 3])
    across = dist.new_group([0, 2]), dist.new_group([1, 3])
    B = 4 * 1024                                   # bytes: 1,024 fp32 elements per rank
    out = {}

    def counted(name, call):
        stats = CommStats()
        call(stats)
        out[name] = stats.hop_bytes()

    counted("all_reduce", lambda s: ops.all_reduce(torch.ones(B // 4), stats=s))
    counted("all_gather", lambda s: ops.all_gather(torch.empty(B), torch.ones(B // 4), stats=s))
    counted("reduce_scatter", lambda s: ops.reduce_scatter(torch.empty(B // 16), torch.ones(B // 4), stats=s))
    counted("all_to_all", lambda s: ops.all_to_all(torch.empty(B // 4), torch.ones(B // 4), stats=s))
    # uneven splits (the expert dispatch's): rank r sends r + 1 rows of 8 elements to every rank j ... j + 1 rows
    rows = [j + 1 for j in range(4)]
    inp = torch.ones(sum(rows), 8)
    got = [rank + 1] * 4
    counted("all_to_all_uneven", lambda s: ops.all_to_all(torch.empty(sum(got), 8), inp, got, rows, stats=s))
    counted("all_reduce_node", lambda s: ops.all_reduce(torch.ones(B // 4), group=node[rank // 2], stats=s))
    counted("all_reduce_across", lambda s: ops.all_reduce(torch.ones(B // 4), group=across[rank % 2], stats=s))
    counted("broadcast", lambda s: ops.broadcast(torch.ones(B // 4), src=0, stats=s))
    return out


def test_every_ring_collective_counts_its_cross_node_share_by_the_one_rule():
    """Issue 40: a ring collective over a group that spans nodes counts N_g / W of its bytes across (comm.ops.
    cross_share), whoever issues it — DDP's and the compressors' all-reduces as FSDP2's gathers. On 2 nodes × 2 the
    ring through ranks 0 → 1 → 2 → 3 → 0 has 4 links, each carrying the same bytes in every step of the collective;
    1 → 2 and 3 → 0 join the two nodes: 2 of 4, so B / 2 of each rank's B bytes cross (per node the two ranks' halves
    make one rank's bytes: what its one boundary link carries). An all-to-all sends 1 of 4 equal chunks to each rank,
    2 of them to the other node: B / 2. With uneven splits, exactly the bytes for the other node's ranks: rank r sends
    (j + 1) rows of 32 B to rank j, so ranks 0, 1 send (3 + 4) · 32 B across and ranks 2, 3 (1 + 2) · 32 B. A node's
    group keeps all inside; one rank per node sends all across; a broadcast counts its group whole (hop_of)."""
    res = run_workers(_split_by_the_ring_rule, 4, None, local_world_size=2)
    B = 4 * 1024
    for rank, r in enumerate(res):
        for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            assert r[op] == {"intra": B // 2, "cross": B // 2}, (op, r[op])   # (the all-gather: its input)
        row = 8 * 4
        cross = (3 + 4) * row if rank < 2 else (1 + 2) * row
        assert r["all_to_all_uneven"] == {"intra": (1 + 2 + 3 + 4) * row - cross, "cross": cross}, r
        assert r["all_reduce_node"] == {"intra": B, "cross": 0}
        assert r["all_reduce_across"] == {"intra": 0, "cross": B}
        assert r["broadcast"] == {"cross": B}
