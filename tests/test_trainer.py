"""OptimizedTrainer on real 2-process gloo groups."""
import copy
import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import run_workers
from syncwise.train import OptimizedTrainer


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def _data(n=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def _one_ddp_step(rank, world):
    x, y = _data()
    model = _mlp()
    reference = copy.deepcopy(model)
    shard = slice(rank * 8, rank * 8 + 8)
    trainer = OptimizedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.5), nn.functional.cross_entropy,
                               clip_grad_norm=0.0, show_progress=False)
    trainer.train([(x[shard], y[shard])], steps=1)
    # The same step in one process over the concatenated batch.
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    nn.functional.cross_entropy(reference(x), y).backward()
    opt.step()
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))


def test_one_ddp_step_equals_single_process_step_on_concatenated_batch():
    for diff in run_workers(_one_ddp_step, 2):
        assert diff < 1e-6


def _accumulate(rank, world, accum):
    x, y = _data(64, seed=rank + 3)
    model = _mlp()
    batches = [(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8]) for i in range(8)]
    trainer = OptimizedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                               grad_accum_steps=accum, show_progress=False)
    summary = trainer.train(batches, steps=2)
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return summary["comm_bytes_per_step"], n_bytes, trainer.par.dp.timer.buckets


def test_accumulation_communicates_once_per_optimizer_step():
    for per_step, param_bytes, hook_calls in run_workers(_accumulate, 2, 4):
        # Four micro-batches, but the gradients crossed the wire once: exactly the parameter bytes.
        assert per_step == param_bytes
        assert hook_calls >= 1


class UserConvNet(nn.Module):
    """Nothing like a language model: a user's own module, with float inputs and class targets."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 8, 3, padding=1)
        self.head = nn.Linear(8 * 16, 3)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x.unsqueeze(1))).flatten(1))


def _user_module(rank, world, tmp):
    torch.manual_seed(0)
    model = UserConvNet()
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(32, 16, generator=g)
    y = (x[:, :8].sum(1) > 0).long() + (x[:, 8:].sum(1) > 1).long()
    trainer = OptimizedTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), nn.functional.cross_entropy,
                               run_dir=tmp if rank == 0 else None)
    summary = trainer.train([(x[:16], y[:16]), (x[16:], y[16:])], steps=30)
    params_equal = [p.detach().clone() for p in model.parameters()]
    gathered = [None] * world
    dist.all_gather_object(gathered, [p.sum().item() for p in params_equal])
    return summary, gathered


def test_arbitrary_user_module_trains_under_optimized_trainer(tmp_path):
    results = run_workers(_user_module, 2, str(tmp_path))
    summary, gathered = results[0]
    assert gathered[0] == gathered[1]  # replicas stayed identical
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 30 and rows[-1]["loss"] < 0.7 * rows[0]["loss"]
    for key in ("step", "loss", "lr", "tokens_per_s", "step_time_s", "compute_s", "comm_exposed_s", "data_wait_s",
                "comm_bytes"):
        assert key in rows[0]
    assert summary["steps"] == 30 and json.loads((tmp_path / "summary.json").read_text())["steps"] == 30


def _options(rank, world):
    from syncwise.models import build_model

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(1))
    batches = [(tokens[i:i + 64].view(2, 32), tokens[i + 1:i + 65].view(2, 32)) for i in range(0, 640, 64)]
    results = {}
    for name, kwargs in {"plain": {}, "ckpt": {"activation_checkpointing": True},
                         "bf16": {"mixed_precision": "bf16"}}.items():
        torch.manual_seed(0)
        model = build_model("tiny-moe", seq_len=32)
        trainer = OptimizedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), show_progress=False, **kwargs)
        results[name] = trainer.train(batches, steps=3)["final_loss"]
    return results


def test_activation_checkpointing_is_exact_and_bf16_autocast_trains():
    for r in run_workers(_options, 2):
        assert r["ckpt"] == pytest.approx(r["plain"], rel=1e-5)  # recomputation changes memory, not math
        assert r["bf16"] == pytest.approx(r["plain"], rel=0.05)


def _lm_run(tmp_path, name, *, fused, log_lag, poison_step=None, steps=6, preset="tiny", device_skip=None):
    """A tiny LM run with a warm-up schedule; optionally NaN loss at one step (fault injection)."""
    from syncwise.data import TokenBatchLoader
    from syncwise.models import build_model
    from syncwise.train.schedule import warmup_cosine

    torch.manual_seed(0)
    model = build_model(preset, seq_len=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    tokens = torch.randint(0, 256, (4_000,), generator=torch.Generator().manual_seed(2))
    run = tmp_path / name
    trainer = OptimizedTrainer(model, opt, lr_scheduler=warmup_cosine(opt, 3, steps), run_dir=str(run),
                               mixed_precision=False,
                               inject_faults=[f"nan:step={poison_step}"] if poison_step else None)
    trainer.log_lag = log_lag
    if device_skip is not None:
        trainer._skips_on_device = device_skip
    summary = trainer.train(TokenBatchLoader(tokens, 2, 16, 0, 1, seed=0), steps=steps)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return trainer, summary, rows


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_fused_adamw_skips_a_nonfinite_step_on_the_device_like_the_host_check(tmp_path, preset):
    # The host path reads the gradient norm; the fused path hands the flag to the optimizer (found_inf) and reads
    # it one update later. Same skipped step, same schedule, same parameters (MoE router biases too: their update
    # is skipped on the device), same rows.
    # Both fused (identical arithmetic; the MoE's routing would amplify rounding differences), the host run made
    # to read the norm as a non-fused optimizer does.
    host, host_summary, host_rows = _lm_run(tmp_path, "host", fused=True, log_lag=0, poison_step=3, preset=preset,
                                            device_skip=False)
    dev, dev_summary, dev_rows = _lm_run(tmp_path, "device", fused=True, log_lag=1, poison_step=3, preset=preset)
    assert dev._skips_on_device
    assert not _lm_run(tmp_path, "foreach", fused=False, log_lag=0, steps=1)[0]._skips_on_device
    assert host_summary["skipped_steps"] == dev_summary["skipped_steps"] == [3]
    assert host.lr_scheduler.last_epoch == dev.lr_scheduler.last_epoch == 5  # 6 steps, one skipped
    assert int(dev.optimizer.state[next(iter(dev.model.parameters()))]["step"]) == 5
    assert [r["step"] for r in dev_rows] == list(range(1, 7)) and dev_rows[2].get("skipped") is True
    assert [r["lr"] for r in host_rows] == [r["lr"] for r in dev_rows]
    assert host_rows[0]["lr"] == pytest.approx(1e-2 / 3)  # the rate step 1 used (warm-up 1/3)
    for a, b in zip(host.model.state_dict().values(), dev.model.state_dict().values()):
        assert torch.equal(a, b)


def test_rows_read_one_step_late_equal_rows_read_at_once(tmp_path):
    _, now_summary, now_rows = _lm_run(tmp_path, "now", fused=False, log_lag=0)
    _, late_summary, late_rows = _lm_run(tmp_path, "late", fused=False, log_lag=1)
    keys = ("step", "loss", "lr", "grad_norm", "comm_bytes")
    assert [{k: r[k] for k in keys} for r in now_rows] == [{k: r[k] for k in keys} for r in late_rows]
    assert now_summary["final_loss"] == late_summary["final_loss"]


class _PlantedLimit(nn.Module):
    """An MLP whose forward runs out of memory (torch.OutOfMemoryError) above ``limit`` rows."""

    def __init__(self, limit):
        super().__init__()
        self.limit, self.net = limit, _mlp()

    def forward(self, x):
        if x.size(0) > self.limit:
            raise torch.OutOfMemoryError(f"planted: {x.size(0)} rows > {self.limit}")
        return self.net(x)


def test_dynamic_batch_finds_the_size_that_fits_and_keeps_the_global_batch(tmp_path):
    from syncwise.checkpoint import SmartCheckpointer
    from syncwise.train import DynamicBatcher

    x, y = _data(48, seed=5)
    batches = [(x[i:i + 12], y[i:i + 12]) for i in range(0, 48, 12)]

    def run(limit, batcher, steps, ckpt=None, resume=None, name=None):
        model = _PlantedLimit(limit)
        trainer = OptimizedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.functional.cross_entropy,
                                   grad_accum_steps=2, dynamic_batch=batcher,
                                   run_dir=str(tmp_path / (name or f"r{limit}")),
                                   checkpointer=ckpt, mixed_precision=False)
        trainer.train(batches, steps=steps, resume=resume)
        return trainer

    plain = run(1000, None, 2)
    dynamic = run(5, DynamicBatcher(2, 64), 2)
    assert dynamic.batcher.size == 5 and dynamic.batcher.found
    for a, b in zip(plain.model.parameters(), dynamic.model.parameters()):
        torch.testing.assert_close(a, b)  # 12-row batches in chunks of 5, 5, 2: the same gradient
    rows = [json.loads(r) for r in (tmp_path / "r5" / "metrics.jsonl").read_text().splitlines()]
    assert [r["micro_batch"] for r in rows] == [5, 5]
    # The found size is checkpointed: a resumed run does not probe again.
    ckpt_dir = tmp_path / "ck"
    run(5, DynamicBatcher(2, 64), 1, ckpt=SmartCheckpointer(ckpt_dir), name="ck-run")  # a new run: its own run_dir
    resumed = run(5, DynamicBatcher(2, 64), 2, ckpt=SmartCheckpointer(ckpt_dir), resume="auto", name="ck-run")
    assert resumed.batcher.found and resumed.batcher.size == 5
    assert sum(c.reason.startswith("probe") for c in resumed.batcher.history) == 1  # the first run's, restored


def test_the_summary_table_shows_values_as_people_read_them():
    from syncwise.metrics.logger import summary_value

    shown = {k: summary_value(k, v) for k, v in {
        "comm_bytes_per_step": 2.193e7, "final_loss": 1.79953, "final_val_loss": 1.8, "sync_rounds": None,
        "skipped_steps": [], "mean_step_time_s": 0.0395, "tokens_per_s": 51860.2, "compute_share": 0.7662,
        "preempted": {"signal": "SIGTERM", "step": 12, "saved": True, "time": 1763900000.0},
        "checkpoint_saves": [{"step": 3}], "steps": 30}.items()}
    assert shown == {"comm_bytes_per_step": "21.9 MB", "final_loss": "1.7995", "final_val_loss": "1.8000",
                     "sync_rounds": None, "skipped_steps": None, "mean_step_time_s": "39.5 ms",
                     "tokens_per_s": "51,860", "compute_share": "76.6%", "preempted": "SIGTERM after step 12, saved",
                     "checkpoint_saves": "1 (details in summary.json)", "steps": "30"}
