"""syncwise compressors inside other trainers (plain DDP, Lightning, Accelerate, transformers.Trainer) on 2 gloo ranks.

Each test checks the three things a user needs: the replicas stay identical, the bytes on the wire (syncwise's
counters) are cut by the compressor, and a resume restores the compressor state so the loss curve continues
exactly as an uninterrupted run's.
"""
import contextlib
import io
import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run_workers
from syncwise.integrations import bytes_on_wire

SPEC = "powersgd:rank=2,start_iter=1"  # compressed (warm start + error feedback) from the first step
MIN_NUMEL = 256


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(32, 64)
        self.l2 = nn.Linear(64, 8)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 32, generator=g)
    return x, x[:, :8].sum(1, keepdim=True).expand(-1, 8)


def _fp32_bytes(model):
    return sum(p.numel() * 4 for p in model.parameters())


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same_state(a, b):
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return a == b


# ---- plain torchrun + DDP ---------------------------------------------------------------------------------
def _ddp_run(rank, spec, steps, start=0, ckpt=None, save_at=None):
    from syncwise.integrations import ddp as sw_ddp

    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    comp = sw_ddp.register(model, spec, min_numel=MIN_NUMEL)
    loaded = None
    if ckpt is not None:
        saved = torch.load(ckpt, weights_only=False)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        comp.load_state_dict(saved["compress"])
        loaded = saved["compress"]
    losses, before, saved_path = [], bytes_on_wire(comp), None
    for step in range(start, steps):
        x, y = _batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if save_at is not None and step + 1 == save_at:
            saved_path = f"{save_at}.rank{rank}.pt"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "compress": comp.state_dict()}, os.path.join(os.environ["SW_TMP"], saved_path))
    sent = bytes_on_wire(comp) - before
    state = comp.state_dict()
    return {"losses": losses, "params": _flat(model), "bytes_per_step": sent / (steps - start),
            "fp32": _fp32_bytes(model), "state": state, "restored": loaded is not None and loaded["steps"] > 0}


def _ddp_worker(rank, world, tmp):
    os.environ["SW_TMP"] = tmp
    none = _ddp_run(rank, "none", 2)
    full = _ddp_run(rank, SPEC, 6, save_at=3)
    resumed = _ddp_run(rank, SPEC, 6, start=3, ckpt=os.path.join(tmp, f"3.rank{rank}.pt"))
    every = {spec: _ddp_run(rank, spec, 2) for spec in ("fp16", "bf16", "fp8", "int8", "sign", "topk:ratio=0.1",
                                                         "randomk:ratio=0.1")}
    return {"none": none, "full": full, "resumed": resumed, "fresh": _resume_without_compressor_state(rank),
            "every": every}


def _resume_without_compressor_state(rank):
    """Control: the same resume without the compressor state diverges (so the resume check can fail)."""
    from syncwise.integrations import ddp as sw_ddp

    saved = torch.load(os.path.join(os.environ["SW_TMP"], f"3.rank{rank}.pt"), weights_only=False)
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.001)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sw_ddp.register(model, SPEC, min_numel=MIN_NUMEL)
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    losses = []
    for step in range(3, 6):
        x, y = _batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_ddp_register_bytes_replicas_resume(tmp_path):
    r0, r1 = run_workers(_ddp_worker, 2, str(tmp_path))
    for name in ("none", "full", "resumed"):
        assert torch.equal(r0[name]["params"], r1[name]["params"]), name  # replicas identical
    # syncwise's byte counter: "none" sends the fp32 gradients, PowerSGD far fewer bytes
    assert r0["none"]["bytes_per_step"] == r0["none"]["fp32"]
    assert r0["full"]["bytes_per_step"] < 0.5 * r0["none"]["bytes_per_step"]
    # resume: the compressor state came back and the loss curve continues exactly
    assert r0["resumed"]["restored"]
    assert r0["resumed"]["losses"] == r0["full"]["losses"][3:]
    assert torch.equal(r0["resumed"]["params"], r0["full"]["params"])
    assert r0["fresh"] != r0["full"]["losses"][3:]  # without the compressor state the curve does not continue
    assert _same_state(r0["resumed"]["state"], r0["full"]["state"])
    assert not _same_state(r0["full"]["state"]["compressor"], r1["full"]["state"]["compressor"])  # per-rank residuals
    for spec, run in r0["every"].items():  # every other syncwise compressor through the same one call
        assert torch.equal(run["params"], r1["every"][spec]["params"]), spec
        assert run["bytes_per_step"] <= 0.6 * r0["none"]["bytes_per_step"], spec
        assert run["state"]["steps"] == 2, spec


def test_register_refuses_bad_input():
    from syncwise.errors import ConfigError
    from syncwise.integrations import ddp as sw_ddp

    with pytest.raises(ConfigError, match="ddp_model"):
        sw_ddp.register(Net(), "fp16")
    from syncwise.integrations import compressor_from

    with pytest.raises(ConfigError, match="gzip"):
        compressor_from("gzip")
    with pytest.raises(ConfigError, match="compressor"):
        compressor_from(3)


# ---- PyTorch Lightning --------------------------------------------------------------------------------------
def _lightning_worker(rank, world, tmp):
    import logging
    import warnings

    import lightning.pytorch as L
    from lightning.pytorch.strategies import DDPStrategy

    from syncwise.integrations.lightning import SyncwiseCallback

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net()
            self.losses = []
            self.bytes = []

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def on_train_batch_start(self, batch, i):
            self.bytes.append(bytes_on_wire(self.cb))

        def on_train_batch_end(self, outputs, batch, i):
            self.losses.append(outputs["loss"].item())
            self.bytes[-1] = bytes_on_wire(self.cb) - self.bytes[-1]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(7)
    # one step an epoch: wherever Lightning resumes in its loop, the next batch is the same one
    xs = torch.randn(16, 32, generator=g)
    data = torch.utils.data.TensorDataset(xs, xs[:, :8].sum(1, keepdim=True).expand(-1, 8).contiguous())

    def fit(spec, steps, ckpt=None, save=None):
        torch.manual_seed(0)
        module, cb = Module(), SyncwiseCallback(spec, min_numel=MIN_NUMEL)
        module.cb = cb  # (a plain attribute: the callback is not a submodule)
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=DDPStrategy(process_group_backend="gloo"),
                            max_steps=steps, callbacks=[cb], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8), ckpt_path=ckpt)
        if save:
            trainer.save_checkpoint(save)
        return {"losses": module.losses, "bytes": module.bytes, "params": _flat(module.net),
                "fp32": _fp32_bytes(module.net), "state": cb.compressor.state_dict(), "registered": cb.registered}

    ckpt = os.path.join(tmp, "lightning.ckpt")
    full = fit(SPEC, 6)
    first = fit(SPEC, 3, save=ckpt)
    resumed = fit(SPEC, 6, ckpt=ckpt)
    saved = torch.load(ckpt, weights_only=False)["callbacks"]
    return {"full": full, "first": first, "resumed": resumed, "saved_ranks": len(next(iter(saved.values()))["ranks"])}


def test_lightning_callback(tmp_path):
    pytest.importorskip("lightning")
    r0, r1 = run_workers(_lightning_worker, 2, str(tmp_path))
    assert r0["full"]["registered"]
    for name in ("full", "first", "resumed"):
        assert torch.equal(r0[name]["params"], r1[name]["params"]), name
    assert r0["full"]["bytes"][0] == r0["full"]["fp32"]  # PowerSGD's warm-up step (start_iter=1) sends fp32
    assert max(r0["full"]["bytes"][1:]) < 0.2 * r0["full"]["fp32"]
    assert r0["saved_ranks"] == 2  # rank 0's checkpoint file holds both ranks' compressor state
    assert r0["resumed"]["losses"] == r0["full"]["losses"][3:]
    assert torch.equal(r0["resumed"]["params"], r0["full"]["params"])
    assert _same_state(r1["resumed"]["state"], r1["full"]["state"])


class _ResumableLoader:
    """A user's loader with Lightning's resumable-loader interface (state_dict / load_state_dict: the batches
    already taken this epoch), as torchdata's StatefulDataLoader provides; Lightning saves it in its checkpoints."""

    def __init__(self, loader):
        self.loader, self.taken, self.skip = loader, 0, 0

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        it = iter(self.loader)
        for _ in range(self.skip):
            next(it)
        self.taken, self.skip = self.skip, 0
        for batch in it:
            self.taken += 1
            yield batch

    def state_dict(self):
        return {"taken": self.taken}

    def load_state_dict(self, state):
        self.skip = state["taken"]


def _lightning_mid_epoch_worker(rank, world, tmp):
    import glob
    import logging
    import warnings

    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from syncwise.integrations.lightning import SyncwiseCallback

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.losses = Net(), []

        def training_step(self, batch, i):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def on_train_batch_end(self, outputs, batch, i):
            self.losses.append(outputs["loss"].item())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(7)
    xs = torch.randn(64, 32, generator=g)  # 4 steps an epoch on 2 ranks of 8
    data = torch.utils.data.TensorDataset(xs, xs[:, :8].sum(1, keepdim=True).expand(-1, 8).contiguous())
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)

    def fit(steps, ckpt=None, every=0):
        torch.manual_seed(0)
        module, cb = Module(), SyncwiseCallback(SPEC, min_numel=MIN_NUMEL)
        loader = _ResumableLoader(torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler))
        saver = [ModelCheckpoint(dirpath=tmp, every_n_train_steps=every, save_top_k=-1)] if every else []
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=DDPStrategy(process_group_backend="gloo"),
                            max_steps=steps, callbacks=[cb, *saver], logger=False, enable_checkpointing=bool(every),
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp,
                            use_distributed_sampler=False)
        trainer.fit(module, loader, ckpt_path=ckpt)
        return {"losses": module.losses, "params": _flat(module.net), "state": cb.compressor.state_dict(),
                "skipped": loader.taken}

    full = fit(6, every=3)  # saves at step 3, part-way through the first epoch
    ckpt = glob.glob(os.path.join(tmp, "*step=3*.ckpt"))[0]
    saved = torch.load(ckpt, weights_only=False)
    resumed = fit(6, ckpt=ckpt)
    return {"full": full, "resumed": resumed, "ckpt": os.path.basename(ckpt),
            "saved_loader": saved["loops"]["fit_loop"]["state_dict"].get("combined_loader"),
            "saved_ranks": len(next(v for k, v in saved["callbacks"].items() if "Syncwise" in k)["ranks"])}


def test_lightning_resume_mid_epoch(tmp_path):
    """A checkpoint Lightning writes part-way through an epoch (ModelCheckpoint every 3 steps of a 4-step epoch):
    the compressor state (both ranks') comes back with it, and with a resumable loader the loss curve continues
    exactly, across the next epoch boundary too."""
    pytest.importorskip("lightning")
    r0, r1 = run_workers(_lightning_mid_epoch_worker, 2, str(tmp_path))
    assert r0["ckpt"].startswith("epoch=0-step=3") and r0["saved_loader"] == [{"taken": 3}]
    assert r0["saved_ranks"] == 2
    assert len(r0["full"]["losses"]) == 6 and len(r0["resumed"]["losses"]) == 3
    assert r0["resumed"]["losses"] == r0["full"]["losses"][3:]
    for r in (r0, r1):
        assert torch.equal(r["resumed"]["params"], r["full"]["params"])
        assert _same_state(r["resumed"]["state"], r["full"]["state"])
    assert torch.equal(r0["resumed"]["params"], r1["resumed"]["params"])


# ---- Hugging Face Accelerate --------------------------------------------------------------------------------
def _accelerate_worker(rank, world, tmp):
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    from syncwise.integrations import accelerate as sw_accelerate

    def run(steps, start=0, load=None, save_at=None):
        acc = Accelerator(cpu=True)
        assert acc.distributed_type == DistributedType.MULTI_CPU, acc.distributed_type
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        model, opt = acc.prepare(model, opt)
        comp = sw_accelerate.register(acc, model, SPEC, min_numel=MIN_NUMEL)
        if load:
            acc.load_state(load)
        losses, per_step = [], []
        for step in range(start, steps):
            x, y = _batch(step, rank)
            before = bytes_on_wire(comp)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            acc.backward(loss)
            opt.step()
            per_step.append(bytes_on_wire(comp) - before)
            losses.append(loss.item())
            if save_at == step + 1:
                acc.save_state(os.path.join(tmp, "acc"))
        return {"losses": losses, "bytes": per_step, "params": _flat(model), "fp32": _fp32_bytes(model),
                "state": comp.state_dict()}

    full = run(6, save_at=3)
    resumed = run(6, start=3, load=os.path.join(tmp, "acc"))
    return {"full": full, "resumed": resumed}


def test_accelerate_register(tmp_path):
    pytest.importorskip("accelerate")
    r0, r1 = run_workers(_accelerate_worker, 2, str(tmp_path))
    for name in ("full", "resumed"):
        assert torch.equal(r0[name]["params"], r1[name]["params"]), name
    assert r0["full"]["bytes"][0] == r0["full"]["fp32"]  # PowerSGD's warm-up step
    assert max(r0["full"]["bytes"][1:]) < 0.2 * r0["full"]["fp32"]
    assert r0["resumed"]["losses"] == r0["full"]["losses"][3:]
    assert torch.equal(r0["resumed"]["params"], r0["full"]["params"])
    assert _same_state(r1["resumed"]["state"], r1["full"]["state"])


# ---- transformers.Trainer -----------------------------------------------------------------------------------
def _hf_worker(rank, world, tmp):
    import logging
    import warnings

    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from syncwise.integrations.transformers import FILENAME, attach

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    g = torch.Generator().manual_seed(3)
    # one batch a rank an epoch (see the Lightning test): the next batch never depends on where a resume lands
    ids = torch.randint(0, 64, (4, 16), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]

    def run(out, steps, resume=None):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=2, learning_rate=1e-2,
                                 use_cpu=True, ddp_backend="gloo", save_strategy="steps", save_steps=3,
                                 logging_steps=1, report_to=[], seed=0, dataloader_num_workers=0,
                                 disable_tqdm=True, lr_scheduler_type="constant", weight_decay=0.0,
                                 ddp_find_unused_parameters=False)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        cb = attach(trainer, SPEC, min_numel=MIN_NUMEL)
        before = bytes_on_wire(cb)
        said = io.StringIO()
        with contextlib.redirect_stdout(said):
            trainer.train(resume_from_checkpoint=resume)
        # a resumed run's log_history starts with the checkpoint's: keep the steps this run took
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > (3 if resume else 0)]
        return {"losses": losses, "bytes_per_step": (bytes_on_wire(cb) - before) / max(1, len(losses)),
                "fp32": _fp32_bytes(model), "params": _flat(model), "state": cb.compressor.state_dict(),
                "registered": cb.registered, "said": said.getvalue()}

    full = run(os.path.join(tmp, "full"), 6)
    resumed = run(os.path.join(tmp, "full"), 6, resume=os.path.join(tmp, "full", "checkpoint-3"))
    return {"full": full, "resumed": resumed,
            "file": os.path.exists(os.path.join(tmp, "full", "checkpoint-3", FILENAME))}


def test_transformers_trainer_callback(tmp_path):
    pytest.importorskip("transformers")
    r0, r1 = run_workers(_hf_worker, 2, str(tmp_path))
    assert r0["full"]["registered"] and r0["file"]
    # the first process says that syncwise compresses, and with what (nothing else in the Trainer's output does)
    assert "syncwise: compressing the Trainer's DDP gradient sync with powersgd across 2 processes" in r0["full"]["said"]
    assert "syncwise:" not in r1["full"]["said"]
    for name in ("full", "resumed"):
        assert torch.equal(r0[name]["params"], r1[name]["params"]), name
    assert r0["full"]["bytes_per_step"] < 0.5 * r0["full"]["fp32"]
    assert len(r0["full"]["losses"]) == 6 and len(r0["resumed"]["losses"]) == 3
    assert r0["resumed"]["losses"] == r0["full"]["losses"][3:]
    assert torch.equal(r0["resumed"]["params"], r0["full"]["params"])
    assert _same_state(r1["resumed"]["state"], r1["full"]["state"])


@pytest.mark.parametrize("adapter, module, package", [("lightning", "lightning.pytorch", "lightning"),
                                                      ("accelerate", "accelerate", "accelerate"),
                                                      ("transformers", "transformers", "transformers")])
def test_missing_framework_is_one_line_naming_the_package(adapter, module, package, monkeypatch):
    import importlib
    import sys

    from syncwise.errors import SyncwiseError

    monkeypatch.setitem(sys.modules, module, None)  # what Python does for a package that is not installed
    monkeypatch.delitem(sys.modules, f"syncwise.integrations.{adapter}", raising=False)
    with pytest.raises(SyncwiseError, match=f"pip install {package}$"):
        importlib.import_module(f"syncwise.integrations.{adapter}")
    import syncwise.integrations  # the package itself needs only torch

    assert syncwise.integrations.compressor_from("fp16").compressor.name == "fp16"


def test_ranked_state_from_another_world_size_starts_fresh_with_a_warning():
    from syncwise.errors import SyncwiseError
    from syncwise.integrations import compressor_from
    from syncwise.integrations._common import RankedCompressorState

    comp = compressor_from("topk:ratio=0.1")
    state = RankedCompressorState(comp)
    saved = state.state_dict()  # no process group: this process alone
    assert saved["world_size"] == 1 and len(saved["ranks"]) == 1
    two = dict(saved, world_size=2, ranks=saved["ranks"] * 2)
    with pytest.warns(UserWarning, match="holds 2 ranks' state, this run has 1"):
        state.load_state_dict(two)
    with pytest.raises(SyncwiseError, match="not a syncwise compressor checkpoint"):
        state.load_state_dict({"compressor": {}})


# ---- the three batch shapes through every integration ------------------------------------------------------
# (inputs, targets) tuples, a mapping passed as model(**batch) whose output carries .loss (a Hugging Face
# ModelOutput in small), and a model that returns its own loss as a tensor. The integrations only put a compressor on
# DDP's gradient sync, so each shape must train exactly as the others do (same model, same rows, same loss) with the
# compressor at work on 2 gloo ranks. transformers.Trainer takes mappings only (its collator and compute_loss call
# model(**batch)): its shapes are the model's own loss and compute_loss_func(outputs, labels).
SHAPES = ("tuple", "mapping", "own loss")


class _TupleNet(nn.Module):
    """``model(x)`` → outputs (the parameters under the same names as the other shapes': PowerSGD's state is keyed
    by name)."""

    def __init__(self):
        super().__init__()
        self.net = Net()

    def forward(self, x):
        return self.net(x)


class _KwargsNet(nn.Module):
    """``model(inputs=..., labels=...)`` → an object with ``.loss`` and ``.logits``."""

    def __init__(self):
        super().__init__()
        self.net = Net()

    def forward(self, inputs, labels=None):
        import types

        logits = self.net(inputs)
        return types.SimpleNamespace(loss=None if labels is None else nn.functional.mse_loss(logits, labels),
                                     logits=logits)


class _LossNet(nn.Module):
    """``model(x, y)`` → its own loss, a scalar tensor."""

    def __init__(self):
        super().__init__()
        self.net = Net()

    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(x), y)


def _shape_model(shape):
    torch.manual_seed(0)
    return {"tuple": _TupleNet, "mapping": _KwargsNet, "own loss": _LossNet}[shape]()


def _shape_rows(shape, n=32):
    """n rows (a DataLoader's samples) of the given shape; batched by the default collate into the same shape."""
    g = torch.Generator().manual_seed(11)
    xs = torch.randn(n, 32, generator=g)
    ys = xs[:, :8].sum(1, keepdim=True).expand(-1, 8).contiguous()
    return [{"inputs": x, "labels": y} if shape == "mapping" else (x, y) for x, y in zip(xs, ys)]


def _shape_loss(model, shape, batch):
    if shape == "tuple":
        x, y = batch
        return nn.functional.mse_loss(model(x), y)
    if shape == "mapping":
        return model(**batch).loss
    return model(*batch)


def _shape_result(model, comp, losses):
    return {"losses": losses, "params": _flat(model), "bytes": bytes_on_wire(comp), "fp32": _fp32_bytes(model)}


def _check_shapes(r0, r1, steps):
    for shape in SHAPES:
        assert torch.equal(r0[shape]["params"], r1[shape]["params"]), shape  # replicas identical
        assert len(r0[shape]["losses"]) == steps, shape
        # compressed: the warm-up step (start_iter=1) sends fp32, the others far less
        assert 0 < r0[shape]["bytes"] < r0[shape]["fp32"] * (1 + 0.3 * (steps - 1)), shape
    for shape in SHAPES[1:]:  # the same training, whatever the shape
        torch.testing.assert_close(r0[shape]["losses"], r0["tuple"]["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r0[shape]["params"], r0["tuple"]["params"], rtol=1e-5, atol=1e-6)


def _ddp_shapes_worker(rank, world):
    from syncwise.integrations import ddp as sw_ddp

    out = {}
    for shape in SHAPES:
        model = DDP(_shape_model(shape), bucket_cap_mb=0.001)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        comp = sw_ddp.register(model, SPEC, min_numel=MIN_NUMEL)
        sampler = torch.utils.data.DistributedSampler(_shape_rows(shape), world, rank, shuffle=False)
        losses = []
        for batch in torch.utils.data.DataLoader(_shape_rows(shape), batch_size=8, sampler=sampler):
            loss = _shape_loss(model, shape, batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out[shape] = _shape_result(model, comp, losses)
    return out


def test_ddp_register_trains_tuples_mappings_and_a_model_returning_its_loss_alike():
    r0, r1 = run_workers(_ddp_shapes_worker, 2)
    _check_shapes(r0, r1, steps=2)


def _accelerate_shapes_worker(rank, world):
    from accelerate import Accelerator

    from syncwise.integrations import accelerate as sw_accelerate

    out = {}
    for shape in SHAPES:
        acc = Accelerator(cpu=True)
        model = _shape_model(shape)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        # accelerate's own loader shards the rows and moves each batch, whatever its shape
        loader = torch.utils.data.DataLoader(_shape_rows(shape), batch_size=8)
        model, opt, loader = acc.prepare(model, opt, loader)
        comp = sw_accelerate.register(acc, model, SPEC, min_numel=MIN_NUMEL)
        losses = []
        for batch in loader:
            loss = _shape_loss(model, shape, batch)
            opt.zero_grad()
            acc.backward(loss)
            opt.step()
            losses.append(loss.item())
        out[shape] = _shape_result(model, comp, losses)
        acc.free_memory()
    return out


def test_accelerate_register_trains_tuples_mappings_and_a_model_returning_its_loss_alike():
    pytest.importorskip("accelerate", reason="syncwise.integrations.accelerate needs accelerate (syncwise[accelerate])")
    r0, r1 = run_workers(_accelerate_shapes_worker, 2)
    _check_shapes(r0, r1, steps=2)


def _lightning_shapes_worker(rank, world, tmp):
    import logging
    import warnings

    import lightning.pytorch as L
    from lightning.pytorch.strategies import DDPStrategy

    from syncwise.integrations.lightning import SyncwiseCallback

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    class Module(L.LightningModule):
        def __init__(self, shape):
            super().__init__()
            self.shape, self.net, self.losses = shape, _shape_model(shape), []

        def training_step(self, batch, i):
            return _shape_loss(self.net, self.shape, batch)

        def on_train_batch_end(self, outputs, batch, i):
            self.losses.append(outputs["loss"].item())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    out = {}
    for shape in SHAPES:
        module, cb = Module(shape), SyncwiseCallback(SPEC, min_numel=MIN_NUMEL)
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=DDPStrategy(process_group_backend="gloo"),
                            max_epochs=1, callbacks=[cb], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp)
        # Lightning's distributed sampler shards the rows; its batch transfer moves a tuple or a mapping alike
        trainer.fit(module, torch.utils.data.DataLoader(_shape_rows(shape), batch_size=8))
        assert cb.registered
        out[shape] = _shape_result(module.net, cb, module.losses)
    return out


def test_lightning_callback_trains_tuples_mappings_and_a_model_returning_its_loss_alike(tmp_path):
    pytest.importorskip("lightning", reason="syncwise.integrations.lightning needs lightning (syncwise[lightning])")
    r0, r1 = run_workers(_lightning_shapes_worker, 2, str(tmp_path))
    _check_shapes(r0, r1, steps=2)


def _hf_shapes_worker(rank, world, tmp):
    import dataclasses
    import logging
    import warnings
    from typing import Optional

    import transformers
    from transformers import Trainer, TrainingArguments
    from transformers.utils import ModelOutput

    from syncwise.integrations.transformers import attach

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    @dataclasses.dataclass
    class Output(ModelOutput):
        loss: Optional[torch.Tensor] = None
        logits: Optional[torch.Tensor] = None

    class HFNet(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = Net()

        def forward(self, inputs, labels=None):
            logits = self.net(inputs)
            return Output(loss=None if labels is None else nn.functional.mse_loss(logits, labels), logits=logits)

    def compute_loss(outputs, labels, num_items_in_batch=None):  # the Trainer's loss_fn(outputs, labels)
        return nn.functional.mse_loss(outputs.logits, labels)

    out = {}
    for shape, loss_func in (("model's loss", None), ("compute_loss_func", compute_loss)):
        model = HFNet()
        args = TrainingArguments(output_dir=os.path.join(tmp, shape.replace(" ", "_")), max_steps=2,
                                 per_device_train_batch_size=8, learning_rate=0.05, optim="sgd", use_cpu=True,
                                 ddp_backend="gloo", save_strategy="no", logging_steps=1, report_to=[], seed=0,
                                 dataloader_num_workers=0, disable_tqdm=True, lr_scheduler_type="constant",
                                 weight_decay=0.0, ddp_find_unused_parameters=False)
        trainer = Trainer(model=model, args=args, train_dataset=_shape_rows("mapping"), compute_loss_func=loss_func)
        cb = attach(trainer, SPEC, min_numel=MIN_NUMEL)
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train()
        assert cb.registered
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        out[shape] = _shape_result(model.net, cb, losses)
    return out


def test_transformers_callback_trains_with_the_models_loss_and_with_compute_loss_func_alike(tmp_path):
    pytest.importorskip("transformers", reason="syncwise.integrations.transformers needs transformers (syncwise[hf])")
    r0, r1 = run_workers(_hf_shapes_worker, 2, str(tmp_path))
    for shape in ("model's loss", "compute_loss_func"):
        assert torch.equal(r0[shape]["params"], r1[shape]["params"]), shape
        assert len(r0[shape]["losses"]) == 2, shape
        assert 0 < r0[shape]["bytes"] < r0[shape]["fp32"] * 1.3, shape
    torch.testing.assert_close(r0["compute_loss_func"]["params"], r0["model's loss"]["params"], rtol=1e-5, atol=1e-6)
