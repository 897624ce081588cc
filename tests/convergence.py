"""A small real training run shared by the convergence tests of the Adam-aware strategies (issue 26): the `tiny`
dense preset on the stdlib corpus (real text, byte tokens), 2 gloo ranks, fixed seeds, AdamW, a fixed held-out
set. ``python tests/convergence.py SPEC...`` prints each spec's losses against fp32 DDP (how the tolerances in
tests/test_adam_aware.py were measured; ``--steps N``: N steps instead of 60; ``--sgd LR``: the strategies under plain SGD at LR instead of AdamW)."""
from __future__ import annotations

import sys

import torch

from syncwise.data import TokenBatchLoader, load_corpus
from syncwise.models import build_model
from syncwise.train import OptimizedTrainer, adamw, warmup_cosine

SEQ, BATCH, LR = 64, 8, 3e-3


def tokens():
    corpus = load_corpus("stdlib", max_bytes=2_000_000)
    return torch.as_tensor(corpus.train[:400_000]).long(), torch.as_tensor(corpus.val[:40_000]).long()


def fresh(rank, world, steps, compress=None, sync=None, sgd_lr=None, **options):
    """Trainer and loader built from scratch, as a new process would (same seeds every time). ``sgd_lr``: plain SGD
    (no momentum, decoupled weight decay 0) at that LR without clipping, instead of AdamW (DeMo's own setting)."""
    torch.manual_seed(0)
    train, val = tokens()
    model = build_model("tiny", seq_len=SEQ)
    if sgd_lr is not None:
        opt = torch.optim.SGD(model.parameters(), lr=sgd_lr)
        options["clip_grad_norm"] = 0.0
    else:
        opt = adamw(model, LR, 0.1)
    loader = TokenBatchLoader(train, BATCH, SEQ, rank, world, seed=3)
    val_batches = [next(iter(TokenBatchLoader(val, 16, SEQ, 0, 1, seed=i))) for i in range(4)]
    trainer = OptimizedTrainer(model, opt, compress_gradients=compress, sync=sync, show_progress=False,
                               lr_scheduler=warmup_cosine(opt, 5, steps), val_loader=val_batches, **options)
    return trainer, loader


def run(rank, world, steps, compress=None, sync=None, sgd_lr=None):
    """(per-step train losses, final validation loss, summary) of one run."""
    trainer, loader = fresh(rank, world, steps, compress, sync, sgd_lr)
    losses = []
    original = trainer._train_step

    def step(batches):
        result = original(batches)
        losses.append(float(result.settle().loss))
        return result

    trainer._train_step = step
    summary = trainer.train(loader, steps=steps)
    return losses, trainer.evaluate(), summary


def compare(specs, steps=60, sgd_lr=None):
    from distributed import run_workers

    base = run_workers(run, 2, steps, None, None)[0]  # fp32 DDP with AdamW: the reference either way
    print(f"none: val {base[1]:.4f}  bytes/step {base[2].get('comm_bytes_per_step')}")
    for spec in specs:
        sync = spec if spec.split(":")[0] in ("sparseloco", "diloco", "localsgd", "streaming") else None
        out = run_workers(run, 2, steps, None if sync else spec, sync, sgd_lr)[0]
        print(f"{spec}: val {out[1]:.4f} ({100 * (out[1] / base[1] - 1):+.2f} %)  bytes/step "
              f"{out[2].get('comm_bytes_per_step')}")


if __name__ == "__main__":
    args = sys.argv[1:]
    steps = int(args.pop(args.index("--steps") + 1)) if "--steps" in args else 60
    sgd = float(args.pop(args.index("--sgd") + 1)) if "--sgd" in args else None
    compare([a for a in args if a not in ("--steps", "--sgd")], steps, sgd)
