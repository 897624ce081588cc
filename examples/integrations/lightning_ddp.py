"""PyTorch Lightning + a syncwise compressor.   python examples/integrations/lightning_ddp.py  (Lightning starts 2 processes)

Resume: run it again with --resume (Lightning's checkpoint carries every rank's compressor state).
"""
import argparse
import os

import lightning.pytorch as L
import torch
from torch import nn

from syncwise.integrations.lightning import SyncwiseCallback


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))

    def training_step(self, batch, i):
        (x,) = batch
        loss = nn.functional.mse_loss(self.net(x), x.flip(1))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--compress", default="powersgd:rank=4")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--dir", default="/tmp/syncwise-lightning-example")
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    data = torch.utils.data.TensorDataset(torch.randn(1024, 256, generator=torch.Generator().manual_seed(0)))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=a.steps, default_root_dir=a.dir,
                        callbacks=[SyncwiseCallback(a.compress, min_numel=1024)], logger=False)  # <- syncwise
    ckpt = os.path.join(a.dir, "last.ckpt")
    trainer.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=32), ckpt_path=ckpt if a.resume else None)
    trainer.save_checkpoint(ckpt)
