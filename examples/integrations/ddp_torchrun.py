"""Plain torchrun + DDP with a syncwise compressor.   torchrun --nproc_per_node=2 examples/integrations/ddp_torchrun.py

Resume: run it again with --resume (each rank reloads its model, optimizer and compressor state).
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from syncwise.integrations import bytes_on_wire, ddp as sw_ddp

p = argparse.ArgumentParser()
p.add_argument("--compress", default="powersgd:rank=4")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--ckpt", default="/tmp/syncwise-ddp-example")
p.add_argument("--resume", action="store_true")
a = p.parse_args()

dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
comp = sw_ddp.register(model, a.compress, min_numel=1024)          # <- the one syncwise line
path = os.path.join(a.ckpt, f"rank{rank}.pt")
start = 0
if a.resume:
    state = torch.load(path, weights_only=False)
    model.module.load_state_dict(state["model"]), opt.load_state_dict(state["opt"])
    comp.load_state_dict(state["compress"])                          # residuals, Q matrices, counters
    start = state["step"]
g = torch.Generator().manual_seed(rank)
for step in range(start, start + a.steps):
    x = torch.randn(32, 256, generator=g)
    loss = nn.functional.mse_loss(model(x), x.flip(1))
    opt.zero_grad(), loss.backward(), opt.step()
    if rank == 0 and step % 5 == 0:
        print(f"step {step} loss {loss.item():.4f} sent {bytes_on_wire(comp) / 1e6:.2f} MB")
os.makedirs(a.ckpt, exist_ok=True)
torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "compress": comp.state_dict(),
            "step": start + a.steps}, path)
dist.destroy_process_group()
