"""Layouts through the trainer's one seam (``parallelize``), proven as torchtitan proves them: the first 10
steps' losses equal a single process on the same global batch and seed, within a stated tolerance.

Tolerance: 2e-5 relative on the losses. FSDP2 reduce-scatters and tensor parallel splits sums differently from
one process, so the last bits differ; AdamW then carries those differences (measured max below 1e-5).
"""
import pytest
import torch

from distributed import run_workers
from syncwise.parallel import ParallelSpec
from syncwise.train import OptimizedTrainer

STEPS, PER_RANK, SEQ = 10, 2, 16
RTOL = 2e-5


def _global_batches(dp):
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (STEPS, PER_RANK * dp, SEQ + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _losses(preset, layout, dp, rank=0, world=1):
    from syncwise.models import build_model

    torch.manual_seed(0)
    model = build_model(preset, seq_len=SEQ)
    spec = ParallelSpec(**layout).resolve(world)
    rows = PER_RANK * dp // spec.dp  # a single process (the reference) takes the whole global batch
    lo = spec.dp_rank(rank) * rows
    batches = [(x[lo:lo + rows], y[lo:lo + rows]) for x, y in _global_batches(dp)]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    trainer = OptimizedTrainer(model, opt, parallel=layout, mixed_precision=False, show_progress=False)
    losses = []
    step = trainer._train_step

    def record(batches_):
        queued = step(batches_)
        losses.append(queued.settle().loss)
        return queued

    trainer._train_step = record
    summary = trainer.train(batches, steps=STEPS)
    return losses, summary["layout"]


def _worker(rank, world, preset, layout):
    return _losses(preset, layout, ParallelSpec(**layout).resolve(world).dp, rank, world)


def _check(preset, layout, world):
    dp = ParallelSpec(**layout).resolve(world).dp
    reference, _ = _losses(preset, {}, dp)
    results = run_workers(_worker, world, preset, layout, timeout=300)
    for losses, described in results:
        assert described.startswith(ParallelSpec(**layout).resolve(world).describe)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=RTOL, atol=0)


def _name(layout):
    return "x".join(f"{k}{v}" for k, v in layout.items())


@pytest.mark.parametrize("layout", [{"dp_shard": 2}, {"tp": 2}, {"dp_replicate": 2}], ids=_name)
def test_two_rank_layouts_match_one_process(layout):
    _check("tiny", layout, 2)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"dp_replicate": 2, "tp": 2}, {"dp_shard": 2, "tp": 2},
                                    {"dp_replicate": 2, "dp_shard": 2}], ids=_name)
def test_four_rank_layouts_match_one_process(layout):
    _check("tiny", layout, 4)
