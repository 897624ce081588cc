"""The trainer's tax: OptimizedTrainer (optimizations off) vs a plain hand-written DDP loop.

Same model, same data, same optimizer, same steps, 2 local workers over gloo; the two loops alternate
(A B A B ...) inside one run so machine noise hits both alike. Reports the median step-time ratio, and the
median over rounds of each round's back-to-back ratio (steadier on a shared machine).

    python benchmarks/trainer_tax.py [--preset small] [--steps 30] [--rounds 3] [--label L] [--out FILE]

To compare two versions of syncwise, run this same file with PYTHONPATH pointing at each one's src/.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from syncwise.data import TokenBatchLoader, load_corpus
from syncwise.launch import run_local
from syncwise.models import build_model
from syncwise.train import OptimizedTrainer, adamw, lm_loss

WARMUP = 3  # steps left out of the timing (allocator warm-up, DDP bucket rebuild)


def _setup(preset: str, seq_len: int, batch: int):
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = load_corpus("stdlib")
    torch.manual_seed(0)
    model = build_model(preset, vocab_size=corpus.vocab_size, seq_len=seq_len)
    loader = TokenBatchLoader(corpus.train, batch, seq_len, rank, world, seed=0)
    return model, adamw(model, 1e-3, 0.1), loader


def plain_ddp(preset: str, steps: int, seq_len: int, batch: int) -> list[float]:
    """The loop a user writes by hand: DDP, AdamW, clip, step (and the MoE's router-bias update, which this
    model needs every step); timed per step."""
    model, opt, loader = _setup(preset, seq_len, batch)
    ddp = DDP(model, find_unused_parameters=bool(getattr(model, "has_sparse_params", False)),
              broadcast_buffers=False)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        x, y = next(loader)
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(ddp(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        # DeepSeek-V3's aux-loss-free balancing: sum expert loads over ranks, nudge the router biases.
        model.update_router_bias(lambda counts: dist.all_reduce(counts))
        loss.item()
        times.append(time.perf_counter() - t)
    return times[WARMUP:]


def syncwise_trainer(preset: str, steps: int, seq_len: int, batch: int) -> list[float]:
    """OptimizedTrainer with every optimization off (no compression, fp32, no accumulation, no prefetch)."""
    model, opt, loader = _setup(preset, seq_len, batch)
    trainer = OptimizedTrainer(model, opt, lm_loss, compress_gradients=None, clip_grad_norm=1.0, show_progress=False)
    times = []
    original = trainer._train_step

    def timed(batches):
        result = original(batches)
        times.append(result.step_time_s)  # host-timed when queued; settle() reads the rest
        return result

    trainer._train_step = timed
    trainer.train(loader, steps=steps)
    return times[WARMUP:]


def _worker(which: str, preset: str, steps: int, seq_len: int, batch: int) -> list[float]:
    dist.init_process_group("gloo")
    try:
        fn = plain_ddp if which == "plain" else syncwise_trainer
        return fn(preset, steps, seq_len, batch)
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--label", default="", help="what code ran (recorded in the results file)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "trainer_tax.json"))
    a = p.parse_args()
    samples: dict[str, list[float]] = {"plain": [], "syncwise": []}
    rounds: dict[str, list[float]] = {"plain": [], "syncwise": []}  # each round's median step
    for r in range(a.rounds):
        for which in ("plain", "syncwise"):
            res = run_local(_worker, a.nproc, which, a.preset, a.steps, a.seq_len, a.batch)
            # A step takes as long as its slowest rank.
            steps = [max(ts) for ts in zip(*res.values())]
            samples[which] += steps
            rounds[which].append(statistics.median(steps))
            print(f"round {r + 1}/{a.rounds} {which:9s} median step {rounds[which][-1] * 1e3:.1f} ms", flush=True)
    plain, ours = statistics.median(samples["plain"]), statistics.median(samples["syncwise"])
    # On a shared machine the load drifts between rounds: the ratio of the two runs of one round (back to back)
    # is steadier than the ratio of the medians over all rounds.
    paired = statistics.median(s / p for p, s in zip(rounds["plain"], rounds["syncwise"]))
    result = {"preset": a.preset, "nproc": a.nproc, "steps_per_round": a.steps, "rounds": a.rounds,
              "seq_len": a.seq_len, "batch": a.batch, "plain_median_step_s": plain,
              "syncwise_median_step_s": ours, "ratio": ours / plain, "tax_percent": (ours / plain - 1) * 100,
              "paired_ratio": paired, "round_medians_s": rounds, "label": a.label,
              "torch": torch.__version__}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
