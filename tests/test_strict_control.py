"""Control traffic (issue 39 N8), guarded on the CPU: under strict devices (tests/conftest.py) ``comm.ops`` counts
every collective per (group, op, the communicator a GPU run gives it: ops.STRICT_COUNTS), and the strict check holds
syncwise's own groups to their GPU run's backend (the compressor's group is a copy of the training group's: on a
CPU run its 'gloo' took every tensor, so nothing could fail there).

A steady DDP step's collectives are the gradient sync's only: on the compressor's communicator (its tensors are the
gradients: CUDA on a GPU run, NCCL) and none elsewhere — no collective on a gloo-only group (preemption's flag aside,
by design), none on the default group (a host value agreed there would cross the gloo half of
devices.NCCL_PROCESS_GROUP). A steady step's counts are the difference between two runs of different lengths, so
set-up and the first step's one-time work cancel.
"""
import pytest
import torch
from torch import nn

from distributed import run_workers
from syncwise.comm import ops

SPECS = [None, "topk:ratio=0.1", "powersgd:rank=2,start_iter=1", "fp8", "sign"]
SHORT, LONG = 3, 6


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def _counts(spec, steps, rank, plant=None):
    from syncwise.train import OptimizedTrainer

    model = _mlp()
    if plant is not None:  # a per-step control collective, agreed before every forward
        group = ops.new_group(backend="gloo", desc="planted") if plant == "gloo" else None
        model.register_forward_pre_hook(
            lambda *_: ops.all_reduce(torch.zeros(1, dtype=torch.int64), "max", group=group, stats=None))
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(steps)]
    trainer = OptimizedTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), nn.functional.cross_entropy,
                               compress_gradients=spec, min_numel=256, show_progress=False)
    ops.STRICT_COUNTS.clear()
    trainer.train(batches, steps=steps)
    return dict(ops.STRICT_COUNTS)


def _per_step(rank, world, specs, plant=None):
    out = {}
    for spec in specs:
        short, long = _counts(spec, SHORT, rank, plant), _counts(spec, LONG, rank, plant)
        out[str(spec)] = {k: (long.get(k, 0) - short.get(k, 0)) / (LONG - SHORT) for k in set(short) | set(long)
                          if long.get(k, 0) != short.get(k, 0)}
    return out


#: A steady step's collectives by design, besides the gradient sync's ('compress') and preemption's flag (its own gloo
#: group, by design: a host flag): the meter's average of the step's loss across ranks (train/meter.py
#: backward_done: the loss is a device tensor, so NCCL's half on a GPU run; async, read a step later).
DESIGNED = {("default", "all_reduce", "nccl"): 1.0}


def _extra(per_step):
    """A steady step's collectives beyond the gradient sync's communicator, preemption's flag and DESIGNED."""
    out = {k: n for k, n in per_step.items() if k[0] not in ("compress", "preemption")}
    for k, n in DESIGNED.items():
        if out.get(k) == n:
            del out[k]
    return out


def test_steady_ddp_steps_issue_collectives_only_on_the_gradient_syncs_communicator():
    for result in run_workers(_per_step, 2, SPECS):
        for spec, per_step in result.items():
            assert _extra(per_step) == {}, (spec, per_step)
            gloo = {k: n for k, n in per_step.items() if k[2] == "gloo" and k[0] != "preemption"}
            assert gloo == {}, (spec, per_step)  # goal: 0 on the gloo half outside preemption's flag
            if spec != "None":  # the compressor's collectives: on its communicator, NCCL's half on a GPU run
                assert all(k[2] == "nccl" for k in per_step if k[0] == "compress"), (spec, per_step)
                assert any(k[0] == "compress" for k in per_step), (spec, per_step)


@pytest.mark.parametrize("plant", ["default", "gloo"])
def test_a_planted_per_step_control_collective_is_counted(plant):
    """The positive control: one host value agreed per step, on the default group (its gloo half on a GPU run: a
    host tensor) or on a gloo group of its own, shows up as one more collective per steady step."""
    for result in run_workers(_per_step, 2, [None], plant):
        per_step = result["None"]
        if plant == "default":
            assert per_step[("default", "all_reduce", "nccl")] == 2.0, per_step
            assert _extra(per_step) == {("default", "all_reduce", "nccl"): 2.0}
        else:
            assert _extra(per_step) == {("planted", "all_reduce", "gloo"): 1.0}, per_step


def _copy_of_training_group(rank, world):
    """The compressor's group is declared as the training group is on a GPU run, not as this run's gloo."""
    g = ops.new_group(like=torch.distributed.group.WORLD, desc="compress")
    ops.declare_backend("nccl")  # as if the training group were NCCL-only
    try:
        h = ops.new_group(like=torch.distributed.group.WORLD, desc="compress2")
        with pytest.raises(ops.StrictDeviceError, match="compress2"):
            ops.all_reduce(torch.ones(1), group=h, stats=None)
    finally:
        ops.declare_backend(None)
    return ops.declared_backend(g)


def test_a_copy_of_the_training_group_is_held_to_its_gpu_backend():
    from syncwise import devices

    # declared when made: the default's GPU-run backend (devices.NCCL_PROCESS_GROUP), not this run's 'gloo'
    assert run_workers(_copy_of_training_group, 2) == [devices.NCCL_PROCESS_GROUP] * 2
