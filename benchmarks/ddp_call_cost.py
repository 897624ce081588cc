"""What one extra gradient collective costs DDP on this machine's CPUs (syncwise.plan.whatif.DDP_CALL_S).

Two gloo ranks (torchrun) train a stack of 30 Linear layers with bucket_cap_mb=0.001 (one all-reduce per parameter
tensor: 60 a step) and 25 MB (one), interleaved in 6 rounds of 20 steps each; the per-call cost is the
difference of the median steps divided by the 59 extra calls. Shared machine: a paired, interleaved ratio.

    torchrun --nproc_per_node 2 benchmarks/ddp_call_cost.py
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for width in (64, 256):
        models = {}
        for cap in (0.001, 25.0):
            torch.manual_seed(0)
            net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(30)])
            models[cap] = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=cap)
        x = torch.randn(8, width)
        times: dict[float, list[float]] = {cap: [] for cap in models}
        for _ in range(6):
            for cap, m in models.items():
                for _ in range(3):
                    m(x).sum().backward()
                t = time.perf_counter()
                for _ in range(20):
                    m(x).sum().backward()
                times[cap].append((time.perf_counter() - t) / 20)
        tiny, big = statistics.median(times[0.001]), statistics.median(times[25.0])
        if rank == 0:
            print(f"width {width}: buckets of 0.001 MB {tiny * 1e3:.2f} ms/step, 25 MB {big * 1e3:.2f} ms/step: "
                  f"{(tiny - big) / 59 * 1e6:.0f} µs per extra gradient collective")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
