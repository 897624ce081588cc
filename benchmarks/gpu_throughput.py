"""Tokens/s and MFU of syncwise's trainer and of a plain PyTorch loop, side by side, on one device.

Same model (same seed), same token batches, same optimizer (AdamW via ``syncwise.train.adamw``: fused on a
GPU), same precision (bf16 autocast on a GPU that has it, fp32 on a CPU), same clipping; the MoE router-bias
update in both. The plain loop is what a careful user writes by hand: no host sync inside the loop, one at
the end of the timed window. Each (preset, mode) runs plain and syncwise alternately for ``--rounds`` rounds
(A B A B ...) so drift hits both alike; the table shows the median of the rounds and the ratio.

    python benchmarks/gpu_throughput.py                      # GPU: xl-dense, large, xl (MoE); eager and compiled
    python benchmarks/gpu_throughput.py --presets tiny-moe,small --steps 25 --rounds 5 --batch 8 --seq-len 128 \
        --threads 1                                          # CPU: the committed results/gpu-throughput-cpu.json

MFU = flops_per_token (PaLM's 6N + attention convention, ``syncwise.models.flops_per_token``) x tokens/s /
the detected part's dense bf16 peak (``syncwise.metrics.peak_flops``); on a CPU there is no agreed peak and
MFU is left out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from syncwise.metrics import mfu, peak_flops
from syncwise.models import build_model, count_params, flops_per_token
from syncwise.train import OptimizedTrainer, adamw, lm_loss

GPU_PRESETS = "xl-dense,large,xl"
# Micro-batch (sequences) per preset on one 80 GB H100 at the preset's own context; --batch overrides.
GPU_BATCH = {"xl-dense": 16, "large": 32, "xl": 16}


def _batches(vocab: int, batch: int, seq_len: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, vocab, (count, batch, seq_len + 1), generator=g)
    pin = torch.cuda.is_available()
    return [((d[:, :-1].pin_memory() if pin else d[:, :-1]), (d[:, 1:].pin_memory() if pin else d[:, 1:]))
            for d in data]


def _model(preset: str, seq_len: int, device: torch.device):
    torch.manual_seed(0)
    return build_model(preset, seq_len=seq_len).to(device)


def _amp(device: torch.device):
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast(device.type, enabled=False)


def plain_loop(preset: str, seq_len: int, device: torch.device, data: list, warmup: int, steps: int,
               compiled: bool) -> float:
    """The hand-written loop; returns the seconds of the ``steps`` timed steps."""
    model = _model(preset, seq_len, device)
    opt = adamw(model, 3e-4, 0.1)
    fwd = torch.compile(model) if compiled else model
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    def step(i: int) -> torch.Tensor:
        x, y = data[i % len(data)]
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with _amp(device):
            loss = lm_loss(fwd(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_router_bias()
        return loss.detach()

    for i in range(warmup):
        step(i)
    return _timed(device, lambda: [step(warmup + i) for i in range(steps)][-1].item())


def syncwise_trainer(preset: str, seq_len: int, device: torch.device, data: list, warmup: int, steps: int,
                     compiled: bool) -> float:
    """OptimizedTrainer with its defaults on this device; returns the seconds of the ``steps`` timed steps."""
    model = _model(preset, seq_len, device)
    trainer = OptimizedTrainer(model, adamw(model, 3e-4, 0.1), compile=compiled, device=device,
                               show_progress=False, flops_per_token=flops_per_token(model.config))
    trainer.train(data, steps=warmup)
    return _timed(device, lambda: trainer.train(data, steps=warmup + steps))


def _timed(device: torch.device, fn: Callable[[], Any]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    p.add_argument("--presets", default=GPU_PRESETS if cuda else "tiny,tiny-moe")
    p.add_argument("--modes", default="eager,compiled", help="eager, compiled or both (comma-separated)")
    p.add_argument("--batch", type=int, default=0, help="sequences per step (0: per-preset default)")
    p.add_argument("--seq-len", type=int, default=0, help="context (0: the preset's own)")
    p.add_argument("--steps", type=int, default=30 if cuda else 6)
    p.add_argument("--warmup", type=int, default=5 if cuda else 2)
    p.add_argument("--rounds", type=int, default=3 if cuda else 2)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default); 1 steadies CPU runs")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                         f"gpu-throughput-{'cuda' if cuda else 'cpu'}.json"))
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device("cuda" if cuda else "cpu")
    peak = peak_flops(device)
    rows = []
    for preset in a.presets.split(","):
        probe = build_model(preset)
        seq_len = a.seq_len or probe.config.seq_len
        batch = a.batch or GPU_BATCH.get(preset, 8 if cuda else 4)
        fpt = flops_per_token(probe.config, seq_len)
        data = _batches(probe.config.vocab_size, batch, seq_len, 8)
        tokens = a.steps * batch * seq_len
        for mode in a.modes.split(","):
            times: dict[str, list[float]] = {"plain": [], "syncwise": []}
            for r in range(a.rounds):
                for name, fn in (("plain", plain_loop), ("syncwise", syncwise_trainer)):
                    times[name].append(fn(preset, seq_len, device, data, a.warmup, a.steps, mode == "compiled"))
                    if cuda:
                        torch.cuda.empty_cache()
            row: dict[str, Any] = {"preset": preset, "mode": mode, "params": count_params(probe),
                                   "batch": batch, "seq_len": seq_len, "steps": a.steps, "rounds": a.rounds}
            for name, ts in times.items():
                tps = tokens / statistics.median(ts)
                row[f"{name}_tokens_per_s"] = tps
                row[f"{name}_mfu"] = mfu(fpt, tps, peak)
                row[f"{name}_rounds_s"] = ts
            row["syncwise_vs_plain"] = row["syncwise_tokens_per_s"] / row["plain_tokens_per_s"]
            rows.append(row)
            m = lambda v: f"{v * 100:.1f} %" if v is not None else "n/a"  # noqa: E731
            print(f"{preset:10s} {mode:8s} plain {row['plain_tokens_per_s']:>12,.0f} tok/s (MFU {m(row['plain_mfu'])})"
                  f"   syncwise {row['syncwise_tokens_per_s']:>12,.0f} tok/s (MFU {m(row['syncwise_mfu'])})"
                  f"   syncwise/plain {row['syncwise_vs_plain']:.3f}", flush=True)
    result = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "peak_flops": peak,
              "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
