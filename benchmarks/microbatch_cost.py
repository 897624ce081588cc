"""A micro-batch's fixed host cost on this machine's CPU, measured outside a run: forward + backward of one preset
at micro-batch sizes 1, 2 and 4 sequences in one process (1 thread), time = fixed + per-sequence × size (least
squares over each size's fastest repetition). Doctor does not read it: it takes the fixed cost from the run (two or
more recorded micro-batch sizes) or brackets it (``syncwise.doctor.analyze._microbatch_evidence``, ``_Model``);
this script checks that bracket on a quiet machine (on a loaded one the fit is noise: it measured −15 to +72 ms
for small-dense within a minute on the shared 2-core machine).

    python benchmarks/microbatch_cost.py [--preset small-dense] [--seq-len 64] [--reps 15]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small-dense")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--sizes", default="1,2,4")
    args = ap.parse_args()
    import torch

    from syncwise.models.deepseek import build_model, lm_loss
    from syncwise.plan.cost import kernels_per_microbatch
    from syncwise.plan.layout import SYNCWISE, Layout
    from syncwise.plan.model import from_preset

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(args.preset)
    vocab = model.cfg.vocab_size if hasattr(model, "cfg") else 256
    sizes = [int(s) for s in args.sizes.split(",")]
    med = {}
    for mb in sizes:
        x = torch.randint(0, vocab, (mb, args.seq_len))
        times = []
        for i in range(args.reps + 3):
            t0 = time.perf_counter()
            loss = lm_loss(model(x), x)
            loss.backward()
            dt = time.perf_counter() - t0
            if i >= 3:
                times.append(dt)
        med[mb] = min(times)  # the least-disturbed repetition (a shared machine adds, never removes)
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(med.values()) / n
    slope = sum((s - mx) * (med[s] - my) for s in sizes) / sum((s - mx) ** 2 for s in sizes)
    fixed = my - slope * mx
    kernels = kernels_per_microbatch(from_preset(args.preset).with_seq_len(args.seq_len), Layout(), SYNCWISE, 1)
    out = {"preset": args.preset, "seq_len": args.seq_len, "median_s_by_size": med, "fixed_s": fixed,
           "per_sequence_s": slope, "kernels_per_microbatch": kernels, "fixed_s_per_kernel": fixed / kernels}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
