"""Hugging Face Accelerate + a syncwise compressor.
    accelerate launch --cpu --num_processes 2 examples/integrations/accelerate_ddp.py
    (or: torchrun --nproc_per_node=2 examples/integrations/accelerate_ddp.py)
Resume: run it again with --resume (accelerator.load_state restores the compressor with the rest).
"""
import argparse

import torch
from accelerate import Accelerator
from torch import nn

from syncwise.integrations import accelerate as sw_accelerate, bytes_on_wire

p = argparse.ArgumentParser()
p.add_argument("--compress", default="powersgd:rank=4")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--dir", default="/tmp/syncwise-accelerate-example")
p.add_argument("--resume", action="store_true")
a = p.parse_args()

acc = Accelerator(cpu=not torch.cuda.is_available())
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt = acc.prepare(model, opt)
comp = sw_accelerate.register(acc, model, a.compress, min_numel=1024)   # <- the one syncwise line
if a.resume:
    acc.load_state(a.dir)
g = torch.Generator().manual_seed(acc.process_index)
for step in range(a.steps):
    x = torch.randn(32, 256, generator=g).to(acc.device)
    loss = nn.functional.mse_loss(model(x), x.flip(1))
    opt.zero_grad()
    acc.backward(loss)
    opt.step()
    if step % 5 == 0:
        acc.print(f"step {step} loss {loss.item():.4f} sent {bytes_on_wire(comp) / 1e6:.2f} MB")
acc.save_state(a.dir)
