"""Per-rank memory of one model under each parallel layout, side by side in one run (issue 15).

4 local workers over gloo (torchrun's elastic agent), the `large` preset by default (100.5 M parameters).
Each layout trains 2 steps through `OptimizedTrainer(parallel=...)` (the seam), then every rank reports the
bytes it holds: parameters, gradients and AdamW state (local shards of DTensors), and its peak resident
memory. Ratios are against dp4 (plain DDP: every rank holds everything).

    python benchmarks/layouts_memory.py [--preset large] [--seq-len 64] [--batch 1]

Goals (issue 15): fsdp4 ≤ 0.3 × dp4's parameter + gradient + optimizer bytes; tp2 layouts ≤ 0.55 ×.
Peak RSS on a CPU includes the Python/torch baseline (~0.3-0.4 GiB) and the activations; step times over
gloo on one machine are not a network measurement (FSDP2's reduce-scatter is emulated on gloo).
"""
from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

from syncwise.launch import run_local

LAYOUTS = {"dp4": {"dp_replicate": 4}, "fsdp4": {"dp_shard": 4}, "tp2×dp2": {"tp": 2, "dp_replicate": 2},
           "tp2×fsdp2": {"tp": 2, "dp_shard": 2}}


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _worker(preset: str, layout: dict, seq_len: int, batch: int) -> dict:
    from syncwise.models import build_model
    from syncwise.train import OptimizedTrainer

    torch.manual_seed(0)
    model = build_model(preset, seq_len=seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    trainer = OptimizedTrainer(model, opt, parallel=layout, mixed_precision=False, show_progress=False)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (4, batch, seq_len + 1), generator=g)
    batches = [(d[:, :-1], d[:, 1:]) for d in data]
    t = time.perf_counter()
    trainer.train(batches, steps=2)
    step_s = (time.perf_counter() - t) / 2
    params = list(trainer.model.parameters())
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"param_bytes": sum(_local_bytes(p) for p in params),
            "grad_bytes": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
            "optim_bytes": sum(_local_bytes(v) for v in state),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "step_s": step_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="large")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "layouts-memory.json"))
    a = p.parse_args()
    rows = []
    for name in a.layouts.split(","):
        per_rank = run_local(_worker, 4, a.preset, LAYOUTS[name], a.seq_len, a.batch)
        worst = {k: max(r[k] for r in per_rank.values()) for k in next(iter(per_rank.values()))}
        worst["state_bytes"] = worst["param_bytes"] + worst["grad_bytes"] + worst["optim_bytes"]
        rows.append({"layout": name, **LAYOUTS[name], **worst})
    base = next((r for r in rows if r["layout"] == "dp4"), rows[0])
    print(f"{'layout':10s} {'params':>9s} {'grads':>9s} {'AdamW':>9s} {'sum':>9s} {'vs dp4':>7s} {'peak RSS':>9s}"
          f" {'step s':>7s}   (MiB per rank; the largest rank)")
    for r in rows:
        r["state_vs_dp4"] = r["state_bytes"] / base["state_bytes"]
        r["peak_vs_dp4"] = r["peak_rss_bytes"] / base["peak_rss_bytes"]
        mib = lambda k: f"{r[k] / 2**20:9.1f}"  # noqa: E731
        print(f"{r['layout']:10s} {mib('param_bytes')} {mib('grad_bytes')} {mib('optim_bytes')} {mib('state_bytes')}"
              f" {r['state_vs_dp4']:7.2f} {mib('peak_rss_bytes')} {r['step_s']:7.2f}")
    out = {"preset": a.preset, "seq_len": a.seq_len, "batch_per_rank": a.batch, "world": 4,
           "torch": torch.__version__, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
