import torch

from distributed import run_workers
from syncwise.comm import CommStats, all_gather, all_reduce, reduce_scatter


def _ops(rank, world):
    stats = CommStats()
    t = torch.full((5,), float(rank + 1))
    all_reduce(t, "sum", stats=stats)
    all_reduce(torch.ones(7), "sum")  # no stats given: counted nowhere
    out = torch.empty(world * 3)
    all_gather(out, torch.full((3,), float(rank)), stats=stats)
    rs = torch.empty(2)
    work = reduce_scatter(rs, torch.arange(2 * world, dtype=torch.float32), "sum", async_op=True, stats=stats)
    work.wait()
    return t.tolist(), out.tolist(), rs.tolist(), stats.snapshot()


def test_instrumented_collectives_are_correct_and_count_payload_bytes():
    res = run_workers(_ops, 2)
    for rank, (t, out, rs, snap) in enumerate(res):
        assert t == [3.0] * 5
        assert out == [0.0] * 3 + [1.0] * 3
        assert rs == [2.0 * (2 * rank), 2.0 * (2 * rank + 1)]
        assert snap["all_reduce"]["bytes"] == 5 * 4
        assert snap["all_gather"]["bytes"] == 3 * 4
        assert snap["reduce_scatter"]["bytes"] == 4 * 4
        assert all(v["calls"] == 1 for v in snap.values())
