"""Resharding checkpoints: a model + optimizer saved under one parallel layout loads under another.

SmartCheckpointer + TrainState + ModelOptimizerState as the trainer registers them (trainer.py's
``train_state()``), with a per-rank 'compressor' component standing in for error feedback: it must be
dropped (with a warning) whenever the layout changes, and restored when it does not.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_workers

from syncwise.checkpoint import Counters, ModelOptimizerState, RNGState, SmartCheckpointer, TrainState
from syncwise.checkpoint import read_manifest, storage
from syncwise.models import build_model
from syncwise.parallel.fsdp import apply_fsdp
from syncwise.parallel.mesh import ParallelSpec, build_mesh

SEQ, PER_RANK = 16, 2


class Residual:
    """Per-rank state like a compressor's error feedback: a tensor that only means something on its rank."""

    def __init__(self, value: torch.Tensor):
        self.residual = value

    def state_dict(self):
        return {"residual": self.residual}

    def load_state_dict(self, sd):
        self.residual = sd["residual"]


class _Log(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _build(kind: str, preset: str):
    """(model, layout string) for 'single', 'ddp' (dp_replicate = world), 'fsdp' (dp_shard = world) or
    'tp' (tp = world)."""
    torch.manual_seed(0)
    model = build_model(preset, seq_len=SEQ)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if kind == "single":
        return model, ParallelSpec().resolve(1).describe
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model), ParallelSpec().resolve(world).describe
    if kind in ("tp-dp", "pp", "ep"):  # as the trainer builds them (parallelize)
        from syncwise.parallel.parallelize import parallelize
        par = parallelize(model, {"tp-dp": {"tp": 2}, "pp": {"pp": 2, "microbatches": 2}, "ep": {"ep": 2}}[kind])
        par.model._par = par  # the pipeline runs the step; the norm sums over the stages
        return (par.model if kind == "pp" else par.module), par.spec.describe
    if kind == "tp":
        from syncwise.parallel.tensor_parallel import apply_tensor_parallel
        spec = ParallelSpec(tp=world).resolve(world)
        return apply_tensor_parallel(model, build_mesh(spec, "cpu")["tp"]), spec.describe
    spec = ParallelSpec(dp_shard=world).resolve(world)
    return apply_fsdp(model, build_mesh(spec, "cpu"), ("dp_shard",)), spec.describe


def _train_state(model, opt, sched, residual):
    """What the trainer registers (model+optimizer, scheduler, counters, rng) plus a per-rank residual."""
    ts = TrainState()
    ts.register("model", ModelOptimizerState(model, opt))
    ts.register("scheduler", sched)
    ts.register("trainer", Counters(step=0, tokens_seen=0))
    ts.register("rng", RNGState(), per_rank=True)
    ts.register("compressor", Residual(residual), per_rank=True)
    return ts


def _step(model, opt, sched, step, rank, world):
    tp = getattr(model, "_syncwise_tp", None)
    if tp:  # tensor parallel: every rank of a tp group reads the same rows
        rank, world = rank // tp["size"], world // tp["size"]
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, 256, (PER_RANK * world, SEQ + 1), generator=g)[rank * PER_RANK:(rank + 1) * PER_RANK]
    opt.zero_grad()
    par = getattr(getattr(model, "module", model), "_par", None)
    if par is not None and par.pipeline is not None:
        with par.micro_batch(True):
            loss = par.pipeline.step(tokens[:, :-1], tokens[:, 1:])
        par.clip_grad_norm(1.0)
        opt.step()
        sched.step()
        return loss.item()
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    if par is not None:  # expert parallel: expert gradients summed over their group
        par._reduce_expert_gradients()
    loss = loss.detach()
    if getattr(model, "_syncwise_tp", None) or (par is not None and par.spec.ep > 1):
        from syncwise.parallel.tensor_parallel import clip_grad_norm
        clip_grad_norm(list(model.parameters()), 1.0)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss.item()


def _full(model, opt) -> tuple[dict, dict]:
    """Model and optimizer state as full (unsharded) tensors keyed by FQN: comparable across layouts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, [opt], options=StateDictOptions(full_state_dict=True))
    m = {k: v.detach().numpy().copy() for k, v in msd.items()}
    o = {f"{fqn}.{k}": (v.numpy().copy() if isinstance(v, torch.Tensor) else v)
         for fqn, s in osd["state"].items() for k, v in s.items()}
    return m, o


def _setup(kind, preset, residual):
    model, layout = _build(kind, preset)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched, layout, _train_state(model, opt, sched, residual)


def _save_worker(rank, world, directory, kind, preset, steps):
    model, opt, sched, layout, ts = _setup(kind, preset, torch.full((3,), float(rank + 1)))
    for s in range(steps):
        _step(model, opt, sched, s, rank, world)
    ts["trainer"].step = steps
    ck = SmartCheckpointer(directory, interval=1, layout=layout)
    ck.save(steps, ts)
    ck.close()
    return _full(model, opt), layout


def _load_worker(rank, world, directory, kind, preset):
    model, opt, sched, layout, ts = _setup(kind, preset, torch.zeros(3))
    handler = _Log()
    logging.getLogger("syncwise.checkpoint").addHandler(handler)
    ck = SmartCheckpointer(directory, interval=1, layout=layout)
    step = ck.load("auto", ts)
    ck.close()
    full, epoch = _full(model, opt), sched.last_epoch
    # the loaded state trains on under the new layout
    loss = _step(model, opt, sched, 99, rank, world)
    return step, full, ts["compressor"].residual.numpy().copy(), handler.lines, epoch, layout, loss


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert np.array_equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _check_reshard(saved, loaded):
    (model_sd, optim_sd), layout_before = saved[0]
    for step, (m, o), residual, warnings, epoch, layout_after, loss in loaded:
        assert step == 3 and epoch == 3
        _assert_same(m, model_sd)
        _assert_same(o, optim_sd)
        assert np.isfinite(loss)
        # per-rank state does not follow a layout change: the residual keeps its fresh value, with a warning
        assert np.array_equal(residual, np.zeros(3))
        assert any("compressor" in w and "not restored" in w for w in warnings), warnings


def test_ddp2_to_fsdp2(tmp_path):
    saved = run_workers(_save_worker, 2, str(tmp_path), "ddp", "tiny-moe", 3)
    # the two DDP replicas hold the same state
    _assert_same(saved[0][0][0], saved[1][0][0])
    assert read_manifest(storage.published_checkpoints(tmp_path)[0])["layout"] == "dp_replicate 2"
    loaded = run_workers(_load_worker, 2, str(tmp_path), "fsdp", "tiny-moe")
    assert loaded[0][5] == "dp_shard 2"
    _check_reshard(saved, loaded)
    assert any("layout 'dp_replicate 2', this run's is 'dp_shard 2'" in w for w in loaded[0][3])


def test_fsdp2_to_single_process_and_to_ddp2(tmp_path):
    saved = run_workers(_save_worker, 2, str(tmp_path), "fsdp", "tiny", 3)
    _assert_same(saved[0][0][0], saved[1][0][0])  # full_state_dict all-gathers: every rank sees the whole
    # one process, no process group
    single = _load_worker(0, 1, str(tmp_path), "single", "tiny")
    _check_reshard(saved, [single])
    assert any("written by 2 ranks, this run has 1" in w for w in single[3])
    # DDP on 2 ranks
    loaded = run_workers(_load_worker, 2, str(tmp_path), "ddp", "tiny")
    _check_reshard(saved, loaded)


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_tp2_to_dp2(tmp_path, preset):
    saved = run_workers(_save_worker, 2, str(tmp_path), "tp", preset, 3)
    _assert_same(saved[0][0][0], saved[1][0][0])
    loaded = run_workers(_load_worker, 2, str(tmp_path), "ddp", preset)
    _check_reshard(saved, loaded)
    assert any("layout 'tp 2', this run's is 'dp_replicate 2'" in w for w in loaded[0][3])


def test_fsdp2_to_tp2(tmp_path):
    saved = run_workers(_save_worker, 2, str(tmp_path), "fsdp", "tiny-moe", 3)
    loaded = run_workers(_load_worker, 2, str(tmp_path), "tp", "tiny-moe")
    _check_reshard(saved, loaded)
    assert any("layout 'dp_shard 2', this run's is 'tp 2'" in w for w in loaded[0][3])


@pytest.mark.slow
def test_four_ranks_dp4_to_fsdp4_and_tp2xdp2_to_dp4(tmp_path):
    saved = run_workers(_save_worker, 4, str(tmp_path / "a"), "ddp", "tiny", 3, timeout=300)
    loaded = run_workers(_load_worker, 4, str(tmp_path / "a"), "fsdp", "tiny", timeout=300)
    _check_reshard(saved, loaded)
    assert loaded[0][5] == "dp_shard 4"
    saved = run_workers(_save_worker, 4, str(tmp_path / "b"), "tp-dp", "tiny-moe", 3, timeout=300)
    assert saved[0][1] == "dp_replicate 2 × tp 2"
    _assert_same(saved[0][0][0], saved[3][0][0])
    loaded = run_workers(_load_worker, 4, str(tmp_path / "b"), "ddp", "tiny-moe", timeout=300)
    _check_reshard(saved, loaded)
    assert any("layout 'dp_replicate 2 × tp 2', this run's is 'dp_replicate 4'" in w for w in loaded[0][3])


def test_pp2_to_dp2_and_ep2_to_dp2(tmp_path):
    """Issue 16: a pipeline's stages save their own layers under the full model's names, experts split over ep
    save as one tensor each (DTensor); both load into plain replicas, model and AdamW state bit-equal."""
    saved = run_workers(_save_worker, 2, str(tmp_path / "pp"), "pp", "tiny-moe", 3)
    model_sd = {**saved[0][0][0], **saved[1][0][0]}  # each stage holds its own layers
    optim_sd = {**saved[0][0][1], **saved[1][0][1]}
    assert set(saved[0][0][0]).isdisjoint(k for k in saved[1][0][0] if k.startswith("layers."))
    loaded = run_workers(_load_worker, 2, str(tmp_path / "pp"), "ddp", "tiny-moe")
    _check_reshard([((model_sd, optim_sd), saved[0][1])], loaded)
    assert any("layout 'pp 2', this run's is 'dp_replicate 2'" in w for w in loaded[0][3])

    saved = run_workers(_save_worker, 2, str(tmp_path / "ep"), "ep", "tiny-moe", 3)
    loaded = run_workers(_load_worker, 2, str(tmp_path / "ep"), "ddp", "tiny-moe")
    _check_reshard(saved, loaded)
    assert any("layout 'dp_replicate 2 × ep 2', this run's is 'dp_replicate 2'" in w for w in loaded[0][3])


# ------------------------------------------------------------------------- unchanged layout: bit-exact resume
def _resume_worker(rank, world, directory, kind, phase):
    """phase 'save': 3 steps, checkpoint, 2 more steps; phase 'resume': load, the same 2 steps."""
    model, opt, sched, layout, ts = _setup(kind, "tiny-moe", torch.full((3,), float(rank + 1)) if phase == "save"
                                           else torch.zeros(3))
    handler = _Log()
    logging.getLogger("syncwise.checkpoint").addHandler(handler)
    ck = SmartCheckpointer(directory, interval=1, layout=layout)
    if phase == "save":
        for s in range(3):
            _step(model, opt, sched, s, rank, world)
        ck.save(3, ts)
    else:
        assert ck.load("auto", ts) == 3
    ck.close()
    noise = torch.rand(4)  # the restored RNG stream continues where it was saved
    losses = [_step(model, opt, sched, s, rank, world) for s in (3, 4)]
    return losses, _full(model, opt), ts["compressor"].residual.numpy().copy(), noise.numpy(), handler.lines


def test_fsdp2_resume_under_the_same_layout_is_bit_exact(tmp_path):
    before = run_workers(_resume_worker, 2, str(tmp_path), "fsdp", "save")
    after = run_workers(_resume_worker, 2, str(tmp_path), "fsdp", "resume")
    for rank, (b, a) in enumerate(zip(before, after)):
        assert a[0] == b[0]  # losses, bit-equal
        _assert_same(a[1][0], b[1][0])
        _assert_same(a[1][1], b[1][1])
        assert np.array_equal(a[2], np.full((3,), float(rank + 1)))  # per-rank state restored on its rank
        assert np.array_equal(a[3], b[3])
        assert not any("not restored" in w for w in a[4]), a[4]
