"""transformers.Trainer + a syncwise compressor, on a tiny Llama built from a local config (no downloads).
    torchrun --nproc_per_node=2 examples/integrations/hf_trainer.py
Resume: run it again with --resume (checkpoint-<step>/syncwise_compress.pt holds every rank's compressor state).
"""
import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from syncwise.integrations.transformers import attach

p = argparse.ArgumentParser()
p.add_argument("--compress", default="powersgd:rank=4")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--dir", default="/tmp/syncwise-hf-example")
p.add_argument("--resume", action="store_true")
a = p.parse_args()

config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
torch.manual_seed(0)
ids = torch.randint(0, 256, (256, 64))
data = [{"input_ids": r, "labels": r} for r in ids]
args = TrainingArguments(output_dir=a.dir, max_steps=a.steps, per_device_train_batch_size=4, learning_rate=1e-3,
                         use_cpu=not torch.cuda.is_available(), save_steps=10, logging_steps=5, report_to=[],
                         ddp_find_unused_parameters=False)
trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=data)
attach(trainer, a.compress, min_numel=1024)                              # <- the one syncwise line
trainer.train(resume_from_checkpoint=True if a.resume else None)
