"""Local SGD / DiLoCo on real 2-process gloo groups: exactness, conservation, overlap, checkpoints, config."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import run_workers
from test_resume import _fresh  # the tiny-moe run the resume tests rebuild from scratch
from syncwise.checkpoint import SmartCheckpointer
from syncwise.checkpoint.storage import step_dirname
from syncwise.comm.stats import CommStats
from syncwise.config import build_config, check_references
from syncwise.errors import ConfigError
from syncwise.parallel import LocalSGD, SyncSpec, build_sync
from syncwise.train import OptimizedTrainer


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def _inner_step(model, opt, rank, step):
    opt.zero_grad()
    x, y = _batch(rank, step)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _period_one_equals_ddp(rank, world):
    """localsgd:period=1 with plain SGD is data-parallel SGD: average of the replicas' steps."""
    model = _mlp()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = build_sync("localsgd:period=1", model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(1, 6):
        _inner_step(model, opt, rank, step)
        outer.after_step(step, last=step == 5)
        # reference: the mean gradient over both ranks' batches, in one process
        ref_opt.zero_grad()
        for r in range(world):
            x, y = _batch(r, step)
            (nn.functional.cross_entropy(reference(x), y) / world).backward()
        ref_opt.step()
    return (_flat(model) - _flat(reference)).abs().max().item()


def test_period_one_with_sgd_equals_data_parallel_sgd():
    for diff in run_workers(_period_one_equals_ddp, 2):
        assert diff < 1e-6


def _conservation(rank, world, spec):
    """Outer lr 1, no momentum: an outer step moves no replica mass, it only redistributes it."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = build_sync(spec, model, stats=CommStats())
    report = []
    for step in range(1, 10):
        _inner_step(model, opt, rank, step)
        before = torch.stack(_gather(_flat(model))).mean(0)
        landing = outer._pending is not None and step >= outer._pending["apply_at"]
        outer.after_step(step, last=step == 9)
        after = _gather(_flat(model))
        report.append((step, landing or outer.is_sync_step(step), (torch.stack(after).mean(0) - before).abs().max()
                       .item(), (after[0] - after[1]).abs().max().item()))
    return report, outer.syncs


def test_outer_step_conserves_the_replica_mean_with_and_without_overlap():
    for spec in ("localsgd:period=3", "localsgd:period=3,delay=2"):
        report, syncs = run_workers(_conservation, 2, spec)[0]
        assert syncs == 3  # steps 3, 6, 9 (the last one forced without delay)
        for step, outer_step, mean_shift, spread in report:
            assert mean_shift < 1e-6, (spec, step)
            if step == 9:
                assert spread == 0.0  # the run ends with identical replicas
            elif not outer_step:
                assert spread > 0  # between outer steps the replicas drift apart


def _cast_feedback(rank, world):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = CommStats()
    outer = LocalSGD(model, SyncSpec.parse("localsgd:period=2,dtype=bf16,delay=1"), stats=stats)
    for step in (1, 2):
        _inner_step(model, opt, rank, step)
    delta = outer.anchor - outer._read()
    outer.after_step(2)
    sent = delta.to(torch.bfloat16)  # what this rank put on the wire (the buffer is reduced in place)
    # Error feedback: what was sent plus the new residual is exactly this replica's pseudo-gradient.
    conserved = (sent.float() + outer.residual - delta).abs().max().item()
    dropped = outer.residual.abs().max().item()
    dtype = outer._send.dtype
    outer._land()
    # the pseudo-gradient in bf16, and one flag per step of the period (steps a replica dropped; issue 23)
    return conserved, dropped, dtype, stats.total_bytes, (sent.numel() + 2) * 2


def test_bf16_pseudo_gradient_keeps_what_the_cast_dropped_and_counts_its_bytes():
    for conserved, dropped, dtype, counted, expected in run_workers(_cast_feedback, 2):
        assert dtype == torch.bfloat16
        assert conserved == 0.0 and dropped > 0
        assert counted == expected


def _matches_torch_averager(rank, world):
    """syncwise localsgd (fp32, no delay) and PyTorch's PeriodicModelAverager average the same replicas."""
    ours, theirs = _mlp(), _mlp()
    opt_a, opt_b = torch.optim.SGD(ours.parameters(), lr=0.1), torch.optim.SGD(theirs.parameters(), lr=0.1)
    a, b = build_sync("localsgd:period=2", ours), build_sync("torch-localsgd:period=2", theirs)
    for step in range(1, 7):
        _inner_step(ours, opt_a, rank, step)
        _inner_step(theirs, opt_b, rank, step)
        a.after_step(step)
        b.after_step(step)
    return (_flat(ours) - _flat(theirs)).abs().max().item(), a.syncs, b.syncs


def test_localsgd_matches_pytorchs_periodic_model_averager():
    for diff, ours, theirs in run_workers(_matches_torch_averager, 2):
        assert diff < 1e-6 and ours == theirs == 3


STEPS = 9


def _resume_mid_flight(rank, world, ckpt_dir, sync):
    torch.use_deterministic_algorithms(True)
    straight, loader, _ = _fresh(rank, world, steps=STEPS, sync=sync)
    straight.checkpointer = SmartCheckpointer(ckpt_dir, interval=5, max_checkpoints=5, async_save=False)
    summary = straight.train(loader, steps=STEPS)
    # Step 5: an average launched at step 4 (period 4, delay 2) is still in flight; resume from there.
    resumed, loader2, _ = _fresh(rank, world, steps=STEPS, sync=sync)
    resumed.checkpointer = SmartCheckpointer(ckpt_dir, interval=1000, max_checkpoints=5, async_save=False)
    resumed.train(loader2, steps=STEPS, resume=str(__import__("pathlib").Path(ckpt_dir) / step_dirname(5)))
    same = all(torch.equal(x, y) for x, y in zip(straight.model.state_dict().values(),
                                                  resumed.model.state_dict().values()))
    # parameters and buffers (the MoE router biases each replica balanced on its own)
    replicas = _gather(torch.cat([t.flatten().float() for t in straight.model.state_dict().values()]))
    return same, (replicas[0] - replicas[1]).abs().max().item(), summary


@pytest.mark.parametrize("sync, rounds", [("localsgd:period=4,delay=2,dtype=bf16", 3), ("pipesgd:dtype=fp16", STEPS),
                                         ("torch-localsgd:period=4", 3)])
def test_trainer_resumes_exactly_with_an_average_in_flight(tmp_path, sync, rounds):
    # localsgd: steps 4 (landed at 6), 8 (in flight at 9, landed early), 9 (forced); pipesgd: one per step;
    # torch-localsgd: steps 4, 8, 9 (forced).
    for same, spread, summary in run_workers(_resume_mid_flight, 2, str(tmp_path / "ck"), sync):
        assert same  # every replica, its AdamW state and the in-flight average were restored
        assert spread == 0.0  # the run ends with identical replicas
        assert summary["sync_rounds"] == rounds and summary["sync"] == sync


def _pipelined(rank, world):
    """pipesgd with plain SGD: each update applies the mean gradient computed one update earlier."""
    model = _mlp()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = OptimizedTrainer(model, opt, nn.functional.cross_entropy, clip_grad_norm=0.0, show_progress=False,
                               sync="pipesgd")
    batches = [_batch(rank, step) for step in range(1, 6)]
    summary = trainer.train(batches, steps=5)
    # reference in one process: g_t is the mean gradient over both ranks' step-t batches at the params
    # after t-2 updates; update t-1 applies it, the last step applies two (the pipeline drains).
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    grads = []
    for step in range(1, 6):
        reference.zero_grad()
        for r in range(world):
            x, y = _batch(r, step)
            (nn.functional.cross_entropy(reference(x), y) / world).backward()
        grads.append([p.grad.clone() for p in reference.parameters()])
        for g in grads[-2:-1] + (grads[-1:] if step == 5 else []):
            for p, gp in zip(reference.parameters(), g):
                p.grad = gp.clone()
            ref_opt.step()
    replicas = _gather(_flat(model))
    return (_flat(model) - _flat(reference)).abs().max().item(), (replicas[0] - replicas[1]).abs().max().item(), \
        summary["comm_bytes_per_step"], sum(p.numel() * 4 for p in model.parameters())


def test_pipesgd_applies_the_previous_steps_mean_gradient_and_keeps_replicas_identical():
    for diff, spread, per_step, param_bytes in run_workers(_pipelined, 2):
        assert diff < 1e-6
        assert spread == 0.0
        assert per_step == param_bytes  # one fp32 gradient all-reduce per step, moved across the boundary


def test_sync_spec_errors_name_the_field_and_what_is_accepted():
    assert SyncSpec.parse("every-step") is None
    spec = SyncSpec.parse("diloco:period=8,delay=3")
    assert (spec.outer_lr, spec.momentum, spec.nesterov, spec.period, spec.delay) == (0.7, 0.9, True, 8, 3)
    cases = {"gossip": "localsgd", "localsgd:period=0": "≥ 1", "localsgd:period=4,delay=5": "[0, period]",
             "localsgd:dtype=int4": "fp32", "localsgd:stride=2": "keys of localsgd", "diloco:momentum=1.5": "[0, 1)",
             "localsgd:period=x": "an integer", "torch-localsgd:delay=1": "keys of torch-localsgd"}
    for text, accepted in cases.items():
        with pytest.raises(ConfigError) as e:
            SyncSpec.parse(text)
        assert "parallel.sync" in str(e.value) and text in str(e.value) and accepted in str(e.value)
    with pytest.raises(ConfigError) as e:
        check_references(build_config(None, {"parallel.sync": "localsgd:period=4", "compress.method": "fp16"}))
    assert "parallel.sync" in str(e.value) and "every-step" in str(e.value)


def _warmup(rank, world):
    """During warm-up DDP all-reduces gradients (the parameters are views of LocalSGD's flat state)."""
    model = _mlp()
    trainer = OptimizedTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), nn.functional.cross_entropy,
                               show_progress=False, sync="localsgd:period=3,warmup=2")
    summary = trainer.train([_batch(rank, step) for step in range(1, 3)], steps=2)
    replicas = _gather(_flat(model))
    return (replicas[0] - replicas[1]).abs().max().item(), summary["comm_bytes_per_step"], \
        sum(p.numel() * 4 for p in model.parameters()), trainer.sync.syncs


def test_warmup_steps_use_ddps_gradient_all_reduce():
    for spread, per_step, param_bytes, syncs in run_workers(_warmup, 2):
        assert spread == 0.0 and per_step == param_bytes and syncs == 0


def test_resume_without_its_own_state_restarts_the_outer_loop_from_the_loaded_weights():
    # A resume at another world size skips per-rank state: the anchor must not stay at the initial weights.
    model = _mlp()
    outer = LocalSGD(model, SyncSpec.parse("localsgd:period=2,dtype=bf16"))
    saved = outer.state_dict()
    with torch.no_grad():  # what loading a checkpoint does: copy the trained weights in place
        for p in model.parameters():
            p.add_(1.0)
    outer.residual.fill_(0.5)
    outer.resumed()
    assert torch.equal(outer.anchor, _flat(model)) and outer.residual.abs().max() == 0
    restored = LocalSGD(_mlp(), SyncSpec.parse("localsgd:period=2,dtype=bf16"))
    restored.load_state_dict(saved)
    restored.resumed()  # its own state was in the checkpoint: kept
    assert torch.equal(restored.anchor, saved["anchor"])


NAN_STEP = 5  # rank 1's loss is NaN at step 5; the checkpoint after step 5 holds its drop before any average


def _nan_on_one_replica(rank, world, ckpt_dir, sync):
    torch.use_deterministic_algorithms(True)
    fault = [f"nan:step={NAN_STEP},rank=1"]
    straight, loader, _ = _fresh(rank, world, steps=STEPS, sync=sync, inject_faults=fault)
    straight.checkpointer = SmartCheckpointer(ckpt_dir, interval=5, max_checkpoints=5, async_save=False)
    summary = straight.train(loader, steps=STEPS)
    resumed, loader2, _ = _fresh(rank, world, steps=STEPS, sync=sync, inject_faults=fault)
    resumed.checkpointer = SmartCheckpointer(ckpt_dir, interval=1000, max_checkpoints=5, async_save=False)
    again = resumed.train(loader2, steps=STEPS, resume=str(__import__("pathlib").Path(ckpt_dir) / step_dirname(5)))
    same = all(torch.equal(x, y) for x, y in zip(straight.model.state_dict().values(),
                                                  resumed.model.state_dict().values()))
    replicas = _gather(torch.cat([t.flatten().float() for t in straight.model.state_dict().values()]))
    lrs = _gather(torch.tensor([straight.optimizer.param_groups[0]["lr"]], dtype=torch.float64))
    return (summary["skipped_steps"], again["skipped_steps"], summary["final_loss"], same,
            (replicas[0] - replicas[1]).abs().max().item(), lrs[0].item() == lrs[1].item())


@pytest.mark.parametrize("sync, skipped", [("localsgd:period=2", NAN_STEP), ("diloco:period=4,delay=2,dtype=bf16", NAN_STEP),
                                           ("torch-localsgd:period=2", NAN_STEP), ("pipesgd", NAN_STEP + 1),
                                           ("sparseloco:period=4,chunk=256,topk=8", NAN_STEP),
                                           ("streaming:period=4,fragments=2", NAN_STEP)])
def test_a_nan_on_one_replica_is_skipped_and_recorded_by_every_replica(tmp_path, sync, skipped):
    """Issue 23: under local SGD no every-step collective carries the non-finite flag, so the replica that saw the
    NaN dropped the step alone and the others never knew (an empty skipped list on rank 0). The drop now rides on
    the next average: every rank lists the step, also after a --deterministic resume between the drop and that
    average (bit-identical), the LR schedules stay together, and the replicas end identical and finite. Pipe-SGD
    averages every step's gradient, so every rank skips the update that applies the NaN gradient (one step later)."""
    for straight, resumed, final_loss, same, spread, same_lr in run_workers(_nan_on_one_replica, 2,
                                                                           str(tmp_path / "ck"), sync):
        assert straight == [skipped] and resumed == [skipped]
        assert final_loss is not None and final_loss == final_loss  # finite: not NaN
        assert same  # the resumed run is bit-identical to the uninterrupted one
        assert spread == 0.0 and same_lr
