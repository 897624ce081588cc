"""``transformers.Trainer``: a callback that puts a syncwise compressor on the DDP model's gradient sync.

    trainer = Trainer(model, args, train_dataset=ds)
    attach(trainer, "powersgd:rank=4")           # a SyncwiseTrainerCallback that can reach trainer.model_wrapped
    trainer.train()                              # or trainer.train(resume_from_checkpoint=True)

The hook is registered on the DDP-wrapped model when training begins; every checkpoint folder
(``checkpoint-<step>``) gets ``syncwise_compress.pt`` with every rank's compressor state, and a resumed run
(global step > 0 at ``on_train_begin``) reads it back from ``<output_dir>/checkpoint-<step>`` (or from
``resume_from``).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from ..errors import SyncwiseError
from ._common import CompressorLike, RankedCompressorState, compressor_from, require
from ..layout import MIN_NUMEL

_tf = require("transformers", "transformers", "transformers")

FILENAME = "syncwise_compress.pt"


class SyncwiseTrainerCallback(_tf.TrainerCallback):
    """Compress ``transformers.Trainer``'s DDP gradient sync with a syncwise compressor (spec, Compressor or
    GradientCompressor); ``min_numel``: smaller tensors go as fp32. ``resume_from``: a checkpoint folder to read
    the compressor state from instead of ``<output_dir>/checkpoint-<global step>``."""

    def __init__(self, compressor: CompressorLike = "powersgd:rank=4", *, min_numel: int = MIN_NUMEL,
                 min_ndim: int = 2, resume_from: Optional[str] = None):
        self.compressor = compressor_from(compressor, min_numel=min_numel, min_ndim=min_ndim)
        self._state = RankedCompressorState(self.compressor)
        self.resume_from = resume_from
        self.trainer: Any = None
        self.registered = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        model = getattr(trainer, "model_wrapped", None) if trainer is not None else None
        if model is None or not hasattr(model, "register_comm_hook"):
            model = kwargs.get("model")
        if state.global_step > 0 or self.resume_from:
            folder = self.resume_from or os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            path = os.path.join(folder, FILENAME)
            if not os.path.exists(path):
                raise SyncwiseError(f"resuming at step {state.global_step} but {path} does not exist: resume from a "
                                    "checkpoint written with SyncwiseTrainerCallback, or pass resume_from=FOLDER")
            import torch

            device = next(model.parameters()).device if model is not None else None
            try:  # tensors and plain data only: a checkpoint folder is data someone may hand us, never code
                saved = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:
                first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                raise SyncwiseError(f"{path} is not a syncwise compressor checkpoint that loads as tensors and plain "
                                    f"data (refused, nothing of it was run: {first})") from None
            self._state.load_state_dict(saved, device)
        if self.registered:
            return
        what = self.compressor.compressor.name
        if model is not None and hasattr(model, "register_comm_hook"):
            self.compressor.register(model)
            self.registered = True
            if args.process_index == 0:  # say so: nothing else in the Trainer's output shows syncwise at work
                print(f"syncwise: compressing the Trainer's DDP gradient sync with {what} across {args.world_size} "
                      f"processes (tensors under {self.compressor.policy.min_numel} elements go as they are)",
                      flush=True)
        elif args.world_size <= 1:
            print(f"syncwise: one process, no DDP gradient sync: {what} compresses nothing here (launch with "
                  "torchrun or accelerate for several processes)", flush=True)
        else:
            raise SyncwiseError("SyncwiseTrainerCallback cannot see the DDP-wrapped model from a callback list: add it "
                                "with syncwise.integrations.transformers.attach(trainer, compressor)")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        import torch

        full = self._state.state_dict()  # every rank calls on_save: the gather is collective
        if args.process_index == 0:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            torch.save(full, os.path.join(folder, FILENAME))


def attach(trainer: Any, compressor: CompressorLike = "powersgd:rank=4", **options: Any) -> SyncwiseTrainerCallback:
    """Add a :class:`SyncwiseTrainerCallback` to an existing ``trainer`` (it finds the DDP model through it)."""
    cb = SyncwiseTrainerCallback(compressor, **options)
    cb.trainer = trainer
    trainer.add_callback(cb)
    return cb
