"""syncwise.checkpoint: DCP round trips (2 real gloo ranks), atomic publish, retention, corruption
fallback, incompatible models, weights_only loading, interval math."""
from __future__ import annotations

import json
import logging
import math
import random
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from distributed import run_workers

from syncwise.checkpoint import (Counters, ModelOptimizerState, SmartCheckpointer, TrainState,
                                 corrupt_checkpoint, latest_valid, load, read_manifest,
                                 young_daly_interval_s)
from syncwise.checkpoint import storage
from syncwise.checkpoint.interval import interval_steps, parse_interval
from syncwise.errors import ConfigError, SyncwiseError

# DCP warns on every single-process save/load even when no_dist=True is explicit
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class PerRankResidual:
    """Stands in for a compressor's error-feedback state: a tensor that differs on every rank."""

    def __init__(self, value: torch.Tensor):
        self.residual = value

    def state_dict(self):
        return {"residual": self.residual.clone(), "count": 7}

    def load_state_dict(self, sd):
        self.residual = sd["residual"].clone()


def _model(d_in: int = 16, d_hidden: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, 4))


def _train_state(model, residual=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ts = TrainState.for_training(model, opt, sched)
    if residual is not None:
        ts.register("residual", PerRankResidual(residual), per_rank=True)
    return ts, opt, sched


def _step(model, opt, sched, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=g)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    sched.step()


def _snapshot(model, opt, sched):
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()},
            sched.state_dict())


def _same(snap_a, snap_b) -> bool:
    (ma, oa, sa), (mb, ob, sb) = snap_a, snap_b
    return (ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
            and oa.keys() == ob.keys() and all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in oa[i])
            and sa == sb)


# ------------------------------------------------------------------------- 2 real gloo ranks
def _ddp_roundtrip(rank, world, directory):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model())
    ts, opt, sched = _train_state(model, residual=torch.full((5,), float(rank + 1)))
    ck = SmartCheckpointer(directory, interval="dynamic", async_save=True, mtbf_s=60.0, calibration_steps=2)
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    torch.manual_seed(100 + rank)
    saved = None
    decisions = []
    for step in range(1, 4):
        _step(model, opt, sched, seed=step * 10 + rank)
        ts["counters"].step = step
        # ranks report different step times: the agreed (max) value must make them decide alike
        due = ck.should_save(step, step_time_s=0.05 * (rank + 1))
        decisions.append(due)
        if due:
            saved = (step, _snapshot(model.module, opt, sched), torch.get_rng_state().clone(),
                     random.getstate(), np.random.get_state()[1].copy())
            ck.save(step, ts)
            # training goes on while the background thread writes: in-place updates and more DDP
            # all-reduces must not leak into the checkpoint being written
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1000.0)
            _step(model, opt, sched, seed=999)
    stats = ck.wait()
    interval = ck.next_interval_steps
    # scramble everything, then restore
    _step(model, opt, sched, seed=12345)
    ts["residual"].residual = torch.zeros(5)
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    step = ck.load("auto", ts)
    ok = {
        "step": step == saved[0],
        "model_opt_sched": _same(_snapshot(model.module, opt, sched), saved[1]),
        "torch_rng": torch.equal(torch.get_rng_state(), saved[2]),
        "python_rng": random.getstate() == saved[3],
        "numpy_rng": np.array_equal(np.random.get_state()[1], saved[4]),
        "residual": torch.equal(ts["residual"].residual, torch.full((5,), float(rank + 1))),
        "counters": ts["counters"].step == saved[0],
    }
    ck.close()
    return ok, decisions, interval, stats.blocking_s, stats.total_s, saved[1][0]


def test_ddp_async_roundtrip_and_single_process_reload(tmp_path, caplog):
    directory = tmp_path / "ckpt"
    results = run_workers(_ddp_roundtrip, 2, str(directory))
    for ok, *_ in results:
        assert all(ok.values()), ok
    # both ranks took the same decisions and agreed on the same dynamic interval
    assert results[0][1] == results[1][1] and any(results[0][1])
    assert results[0][2] == results[1][2] and results[0][2] >= 1
    assert results[0][3] <= results[0][4]  # blocking part <= whole save on rank 0
    published = storage.published_checkpoints(directory)
    manifest = read_manifest(published[0])
    assert manifest["world_size"] == 2
    assert {"rank_00000.pt", "rank_00001.pt", ".metadata"} <= set(manifest["files"])

    # the 2-rank checkpoint loads in this single process (no process group): model weights equal;
    # per-rank state is skipped with a warning because the world size differs
    model = _model()
    ts, opt, sched = _train_state(model, residual=torch.zeros(5))
    with caplog.at_level(logging.WARNING, logger="syncwise.checkpoint"):
        step = load("auto", ts, directory=directory)
    assert step == manifest["step"]
    expected = results[0][5]
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert "written by 2 ranks" in caplog.text and "residual" in caplog.text
    assert torch.equal(ts["residual"].residual, torch.zeros(5))


# ------------------------------------------------------------------------- single process
def _saved_run(directory, steps, **kw):
    model = _model()
    ts, opt, sched = _train_state(model, residual=torch.arange(3.0))
    ck = SmartCheckpointer(directory, **kw)
    snaps = {}
    for step in range(1, steps + 1):
        _step(model, opt, sched, seed=step)
        if ck.should_save(step):
            ck.save(step, ts)
            snaps[step] = _snapshot(model, opt, sched)
    ck.close()
    return ck, snaps


def test_partial_dir_is_ignored_and_cleaned(tmp_path):
    crashed = tmp_path / "step_00000500.partial"
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"half a shard")
    ck, snaps = _saved_run(tmp_path, 2, interval=1, async_save=False)
    assert latest_valid(tmp_path).name == "step_00000002"
    assert not crashed.exists()
    # a .partial appearing later (a crash mid-save) is still never picked
    crashed.mkdir()
    assert latest_valid(tmp_path).name == "step_00000002"


def test_keep_last_n_never_leaves_no_checkpoint(tmp_path):
    model = _model()
    ts, opt, sched = _train_state(model)
    ck = SmartCheckpointer(tmp_path, interval=1, max_checkpoints=1, async_save=True)
    seen_empty_after_first, stop = [], threading.Event()
    first_published = threading.Event()

    def watch():
        # one directory listing per look, names only: published_checkpoints lists, then asks each entry is_dir(),
        # and between the two the retention may have deleted the older step the listing saw while the newer one
        # (renamed in before that deletion) was still '.partial' in it -- an empty answer the directory never had
        # (seen once under a second pytest worker's load)
        while not stop.is_set():
            names = [n for n in os.listdir(tmp_path) if storage.step_of(tmp_path / n) is not None]
            if names:
                first_published.set()
            elif first_published.is_set():
                seen_empty_after_first.append(True)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for step in range(1, 7):
            _step(model, opt, sched, seed=step)
            ck.save(step, ts)
        ck.close()
    finally:
        stop.set()
        watcher.join()
    assert not seen_empty_after_first
    assert [p.name for p in storage.published_checkpoints(tmp_path)] == ["step_00000006"]

    ck2, _ = _saved_run(tmp_path / "n3", 7, interval=1, max_checkpoints=3)
    assert [p.name for p in storage.published_checkpoints(tmp_path / "n3")] == [
        "step_00000007", "step_00000006", "step_00000005"]


@pytest.mark.parametrize("mode", ["truncate", "flip"])
def test_damaged_newest_falls_back_to_previous(tmp_path, caplog, mode):
    _, snaps = _saved_run(tmp_path, 4, interval=2, async_save=False)
    damaged = corrupt_checkpoint(tmp_path / "step_00000004", mode=mode)
    with caplog.at_level(logging.WARNING, logger="syncwise.checkpoint"):
        assert latest_valid(tmp_path).name == "step_00000002"
    assert str(damaged) in caplog.text
    model = _model()
    ts, opt, sched = _train_state(model, residual=torch.zeros(3))
    assert load("auto", ts, directory=tmp_path) == 2
    assert _same(_snapshot(model, opt, sched), snaps[2])
    assert torch.equal(ts["residual"].residual, torch.arange(3.0))
    with pytest.raises(SyncwiseError, match="step_00000004"):
        load(tmp_path / "step_00000004", ts)
    with pytest.raises(SyncwiseError, match="does-not-exist"):
        load(tmp_path / "does-not-exist", ts)


def test_incompatible_model_raises_clear_error(tmp_path):
    _saved_run(tmp_path, 1, interval=1, async_save=False)
    path = tmp_path / "step_00000001"
    wider = _model(d_hidden=48)
    ts, *_ = _train_state(wider)
    with pytest.raises(SyncwiseError, match=r"different shape.*\[32, 16\].*\[48, 16\]") as e:
        load(path, ts)
    assert str(path) in str(e.value) and "configuration" in str(e.value)
    deeper = nn.Sequential(*_model(), nn.ReLU(), nn.Linear(4, 4))
    ts, *_ = _train_state(deeper)
    with pytest.raises(SyncwiseError, match="missing from the checkpoint"):
        load(path, ts)
    shallower = nn.Sequential(nn.Linear(16, 32))
    ts, *_ = _train_state(shallower)
    with pytest.raises(SyncwiseError, match="do not exist in the run"):
        load(path, ts)


class _Payload:
    """A pickled object whose unpickling would run code (here: create a marker file)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_per_rank_file_with_pickled_object_is_refused(tmp_path):
    _saved_run(tmp_path, 1, interval=1, async_save=False)
    path = tmp_path / "step_00000001"
    marker = tmp_path / "code-ran"
    rank_file = path / "rank_00000.pt"
    torch.save({"format": "syncwise-rank-state/1", "components": {"residual": _Payload(str(marker))}}, rank_file)
    # keep the manifest consistent so only weights_only stands between the file and the unpickler
    manifest = read_manifest(path)
    manifest["files"]["rank_00000.pt"] = {"size": rank_file.stat().st_size, "sha256": storage.sha256_file(rank_file)}
    (path / "manifest.json").write_text(json.dumps(manifest))
    ts, *_ = _train_state(_model(), residual=torch.zeros(3))
    with pytest.raises(SyncwiseError, match="refused to load"):
        load(path, ts)
    assert not marker.exists()


def test_dcp_metadata_with_foreign_class_is_refused(tmp_path):
    _saved_run(tmp_path, 1, interval=1, async_save=False)
    path = tmp_path / "step_00000001"
    import pickle

    marker = tmp_path / "code-ran"
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    manifest = read_manifest(path)
    manifest["files"][".metadata"] = {"size": (path / ".metadata").stat().st_size,
                                      "sha256": storage.sha256_file(path / ".metadata")}
    (path / "manifest.json").write_text(json.dumps(manifest))
    ts, *_ = _train_state(_model(), residual=torch.zeros(3))
    with pytest.raises(SyncwiseError, match="metadata"):
        load(path, ts)
    assert not marker.exists()


def test_compressed_checkpoint_roundtrip(tmp_path):
    _, snaps = _saved_run(tmp_path, 2, interval=2, compression=True)
    manifest = read_manifest(tmp_path / "step_00000002")
    assert manifest["compression"] in ("zlib", "zstd")
    model = _model()
    ts, opt, sched = _train_state(model, residual=torch.zeros(3))
    assert load("auto", ts, directory=tmp_path) == 2
    assert _same(_snapshot(model, opt, sched), snaps[2])


def test_young_daly_interval_math():
    assert young_daly_interval_s(10.0, 14400.0) == pytest.approx(math.sqrt(2 * 10 * 14400))
    # Daly's refinement: sqrt(2dM)(1 + sqrt(d/2M)/3 + d/(18M)) - d
    d, m = 60.0, 3600.0
    expected = math.sqrt(2 * d * m) * (1 + math.sqrt(d / (2 * m)) / 3 + d / (18 * m)) - d
    assert young_daly_interval_s(d, m, refined=True) == pytest.approx(expected)
    assert young_daly_interval_s(3 * m, m, refined=True) == m
    # 2 s blocking, 1 h MTBF -> 120 s -> 240 steps of 0.5 s
    assert interval_steps("dynamic", 0, 0.5, 2.0, None, 3600.0) == 240
    # never shorter than a whole save (no two saves in flight)
    assert interval_steps("dynamic", 0, 0.5, 2.0, 300.0, 3600.0) == 600
    assert interval_steps("seconds", 30.0, 0.7, None, None, 1.0) == math.ceil(30 / 0.7)
    assert parse_interval("5m") == ("seconds", 300.0) and parse_interval(50) == ("steps", 50.0)
    assert parse_interval(0) == parse_interval("0") == ("final", 0.0)  # only the final checkpoint
    for bad in (-3, True, "soon", "0s", "-1"):
        with pytest.raises(ConfigError, match="interval"):
            parse_interval(bad)
    with pytest.raises(ConfigError, match="max_checkpoints"):
        SmartCheckpointer("/tmp/unused-syncwise", interval=1, max_checkpoints=0)
    with pytest.raises(ConfigError, match="compression"):
        SmartCheckpointer("/tmp/unused-syncwise", interval=1, compression="lz4")


def test_dynamic_interval_follows_measured_save_cost(tmp_path):
    model = _model()
    ts, opt, sched = _train_state(model)
    ck = SmartCheckpointer(tmp_path, interval="dynamic", mtbf_s=50.0, calibration_steps=3, async_save=False)
    assert ck.next_interval_steps is None
    assert [ck.should_save(s, step_time_s=0.01) for s in (1, 2)] == [False, False]
    assert ck.should_save(3, step_time_s=0.01)  # first save right after calibration measures δ
    stats = ck.save(3, ts)
    ck.wait()
    n = ck.next_interval_steps
    assert n == max(1, math.ceil(math.sqrt(2 * stats.blocking_s * 50.0) / 0.01))
    first_due = next(s for s in range(4, 4 + n + 2) if ck.should_save(s, step_time_s=0.01))
    assert first_due == 3 + n
    ck.close()


def test_train_state_registry_rejects_bad_components():
    ts = TrainState()
    ts.register("counters", Counters(step=1))
    with pytest.raises(ConfigError, match="name"):
        ts.register("counters", Counters())
    with pytest.raises(ConfigError, match="state_dict"):
        ts.register("thing", object())
    ts.register("mo", ModelOptimizerState(_model()))
    assert "mo" in ts and "counters" in ts.global_components


def _fsdp2_roundtrip(rank, world, directory):
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.5
        from torch.distributed._composable.fsdp import fully_shard
    model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    ts, opt, sched = _train_state(model)
    _step(model, opt, sched, seed=rank)
    ck = SmartCheckpointer(directory, interval=1)
    ck.save(1, ts)
    ck.wait()
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    step = ck.load("auto", ts)
    restored = all(torch.equal(v.full_tensor(), full[k]) for k, v in model.state_dict().items())
    ck.close()
    return step, restored, full


def test_fsdp2_sharded_checkpoint_roundtrip_and_reshard_to_one_process(tmp_path):
    results = run_workers(_fsdp2_roundtrip, 2, str(tmp_path))
    assert [r[:2] for r in results] == [(1, True), (1, True)]
    model = _model(d_hidden=32)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    ts, *_ = _train_state(model)
    assert load("auto", ts, directory=tmp_path) == 1
    assert all(torch.equal(v, results[0][2][k]) for k, v in model.state_dict().items())


# ------------------------------------------------------------------------- verification holes (issue 12, item 7)
def _resign(path: Path, *names: str) -> None:
    """Re-write the manifest entries of ``names`` to match the files, as someone tampering would."""
    manifest = read_manifest(path)
    for name in names:
        f = path / name
        manifest["files"][name] = {"size": f.stat().st_size, "sha256": storage.sha256_file(f)}
    (path / "manifest.json").write_text(json.dumps(manifest))


def _edit_manifest(path: Path, edit) -> None:
    manifest = read_manifest(path)
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def _plant_code(path: Path, rank: int, marker: Path) -> None:
    """Replace a rank file by one whose unpickling would run code; the manifest is made to match."""
    name = storage.rank_filename(rank)
    torch.save({"format": "syncwise-rank-state/1", "components": {"residual": _Payload(str(marker))}}, path / name)
    _resign(path, name)


def test_manifest_must_list_every_file_a_load_reads(tmp_path, caplog):
    import shutil

    pristine = tmp_path / "pristine"
    _saved_run(pristine, 2, interval=1, async_save=False)
    cases = {
        "lists no files": lambda d: _edit_manifest(d, lambda m: m.update(files={})),
        "rank_00000.pt": lambda d: _edit_manifest(d, lambda m: m["files"].pop("rank_00000.pt")),
        ".metadata": lambda d: _edit_manifest(d, lambda m: m["files"].pop(".metadata")),
        "DCP shard": lambda d: _edit_manifest(d, lambda m: [m["files"].pop(n) for n in list(m["files"])
                                                            if n.endswith(".distcp")]),
        "rank_00001.pt although": lambda d: (shutil.copy(d / "rank_00000.pt", d / "rank_00001.pt"),
                                             _resign(d, "rank_00001.pt")),
        "not for step 2": lambda d: _edit_manifest(d, lambda m: m.update(step=7)),
        "does not list __0_9.distcp": lambda d: (d / "__0_9.distcp").write_bytes(b"dropped in"),
        "no list of per rank components": lambda d: _edit_manifest(d, lambda m: m.pop("per_rank_components")),
    }
    for i, (reason, damage) in enumerate(cases.items()):
        directory = tmp_path / f"case{i}"
        shutil.copytree(pristine, directory)
        damage(directory / "step_00000002")
        problem = storage.verify_checkpoint(directory / "step_00000002")
        assert problem is not None and reason in problem, (reason, problem)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="syncwise.checkpoint"):
            assert latest_valid(directory).name == "step_00000001"
        assert "step_00000002" in caplog.text and reason in caplog.text
    # the load falls back too (here: the manifest that lists nothing)
    ts, *_ = _train_state(_model(), residual=torch.zeros(3))
    assert load("auto", ts, directory=tmp_path / "case0") == 1
    # a file the loader never opens does not make a good checkpoint invalid
    (pristine / "step_00000002" / "notes.txt").write_text("left by a user")
    assert storage.verify_checkpoint(pristine / "step_00000002") is None


@pytest.mark.parametrize("tamper", ["rank_file", "metadata"])
def test_tampered_newest_checkpoint_falls_back_on_auto_load(tmp_path, caplog, tamper):
    import pickle

    _, snaps = _saved_run(tmp_path, 4, interval=2, async_save=False)
    newest, marker = tmp_path / "step_00000004", tmp_path / "code-ran"
    if tamper == "rank_file":
        _plant_code(newest, 0, marker)
    else:
        (newest / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
        _resign(newest, ".metadata")
    assert storage.verify_checkpoint(newest) is None  # checksums match: only loading finds it out
    model = _model()
    ts, opt, sched = _train_state(model, residual=torch.zeros(3))
    with caplog.at_level(logging.WARNING, logger="syncwise.checkpoint"):
        assert load("auto", ts, directory=tmp_path) == 2
    assert _same(_snapshot(model, opt, sched), snaps[2])
    assert torch.equal(ts["residual"].residual, torch.arange(3.0))
    assert "step_00000004 could not be loaded" in caplog.text and "falling back" in caplog.text
    assert ("refused to load" if tamper == "rank_file" else "metadata") in caplog.text
    assert not marker.exists()
    # named explicitly, it is refused: never silently replaced by another checkpoint
    with pytest.raises(SyncwiseError, match="refused to load" if tamper == "rank_file" else "metadata"):
        load(newest, ts)
    assert not marker.exists()


def test_auto_refuses_to_start_over_when_no_checkpoint_loads(tmp_path):
    _saved_run(tmp_path, 4, interval=2, async_save=False)
    corrupt_checkpoint(tmp_path / "step_00000004", mode="truncate")
    _plant_code(tmp_path / "step_00000002", 0, tmp_path / "code-ran")
    ts, *_ = _train_state(_model(), residual=torch.zeros(3))
    with pytest.raises(SyncwiseError, match="no checkpoint in") as e:
        load("auto", ts, directory=tmp_path)
    text = str(e.value)
    assert "step_00000004" in text and "step_00000002" in text and "refused to load" in text
    assert "start afresh" in text
    assert [p.name for p in storage.published_checkpoints(tmp_path)] == ["step_00000004", "step_00000002"]
    assert not (tmp_path / "code-ran").exists()
    # only damaged ones (detected by the checksums): refused as well, not a silent fresh start
    corrupt_checkpoint(tmp_path / "step_00000002", mode="flip", file=".metadata")
    with pytest.raises(SyncwiseError, match="no checkpoint in .*step_00000004.*step_00000002"):
        load("auto", ts, directory=tmp_path)
    # a directory with no checkpoint at all still starts from scratch
    assert load("auto", ts, directory=tmp_path / "empty") == 0


def _one_rank_file_bad(rank, world, directory):
    import torch.distributed as dist

    directory = Path(directory)
    model = _model()  # identical on both ranks (same seed, same batches): a replicated model
    ts, opt, sched = _train_state(model, residual=torch.full((3,), float(rank)))
    ck = SmartCheckpointer(directory, interval=1, async_save=False)
    _step(model, opt, sched, seed=1)
    ck.save(1, ts)
    first = _snapshot(model, opt, sched)
    _step(model, opt, sched, seed=2)
    ts["residual"].residual = torch.full((3,), 10.0 + rank)
    ck.save(2, ts)
    dist.barrier()
    if rank == 0:  # only rank 1 will see the problem: its own file; rank 0's loads fine
        _plant_code(directory / "step_00000002", 1, directory / "code-ran")
    dist.barrier()
    _step(model, opt, sched, seed=3)
    ts["residual"].residual = torch.zeros(3)
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("syncwise.checkpoint").addHandler(handler)
    step = ck.load("auto", ts)
    restored = _same(_snapshot(model, opt, sched), first) and torch.equal(ts["residual"].residual,
                                                                          torch.full((3,), float(rank)))
    try:
        ck.load(directory / "step_00000002", ts)
        explicit = None
    except SyncwiseError as e:
        explicit = str(e)
    ck.close()
    return step, restored, records, explicit, (directory / "code-ran").exists()


def test_two_ranks_fall_back_together_when_only_one_rank_file_is_bad(tmp_path):
    results = run_workers(_one_rank_file_bad, 2, str(tmp_path))
    for rank, (step, restored, records, explicit, code_ran) in enumerate(results):
        assert step == 1 and restored, rank
        warning = next(r for r in records if "could not be loaded" in r)
        assert "step_00000002" in warning and "rank 1: refused to load" in warning
        assert explicit is not None and "refused to load" in explicit and "rank_00001.pt" in explicit
        assert not code_ran


def test_abandoned_checkpoints_are_pruned_and_never_overwritten(tmp_path, caplog):
    _saved_run(tmp_path, 4, interval=1, max_checkpoints=3, async_save=False)  # step_2, step_3, step_4
    # abandoned timelines of earlier resumes, one of them of step 4 again
    for name in ("step_00000001.abandoned", "step_00000004.abandoned", "step_00000009.abandoned"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text(name)
    model = _model()
    ts, *_ = _train_state(model, residual=torch.zeros(3))
    ck = SmartCheckpointer(tmp_path, interval=1, max_checkpoints=3, async_save=False)
    assert load(tmp_path / "step_00000002", ts) == 2
    with caplog.at_level(logging.WARNING, logger="syncwise.checkpoint"):
        ck.save(3, ts)  # resumed from step 2: step 4 belongs to an abandoned timeline now
    ck.close()
    assert [p.name for p in storage.published_checkpoints(tmp_path)] == ["step_00000003", "step_00000002"]
    # the earlier abandoned step 4 is kept beside the new one; beyond 3, the lowest step is removed
    assert sorted(p.name for p in tmp_path.glob("*.abandoned")) == [
        "step_00000004.2.abandoned", "step_00000004.abandoned", "step_00000009.abandoned"]
    assert (tmp_path / "step_00000004.abandoned" / "mine.txt").read_text() == "step_00000004.abandoned"
    assert storage.verify_checkpoint(tmp_path / "step_00000004.2.abandoned") is None
    assert "removing abandoned checkpoint" in caplog.text and "step_00000001.abandoned" in caplog.text
    assert not (tmp_path / "step_00000001.abandoned").exists()


def test_replaced_leftover_of_a_crashed_resave_is_restored_or_removed(tmp_path, caplog):
    import shutil

    _saved_run(tmp_path, 4, interval=1, max_checkpoints=3, async_save=False)  # step_2, step_3, step_4
    # a crash between the two renames of a re-save left step 2 only as step_2.replaced ...
    (tmp_path / "step_00000002").rename(tmp_path / "step_00000002.replaced")
    # ... and a stale copy of step 4 next to its published checkpoint
    shutil.copytree(tmp_path / "step_00000004", tmp_path / "step_00000004.replaced")
    with caplog.at_level(logging.INFO, logger="syncwise.checkpoint"):
        SmartCheckpointer(tmp_path, interval=1, max_checkpoints=3, async_save=False).close()
    assert storage.verify_checkpoint(tmp_path / "step_00000002") is None  # restored, not lost
    assert not list(tmp_path.glob("*.replaced"))
    assert "restoring" in caplog.text and "stale copy" in caplog.text
    assert [p.name for p in storage.published_checkpoints(tmp_path)] == [
        "step_00000004", "step_00000003", "step_00000002"]
