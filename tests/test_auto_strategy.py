"""--compress auto / --sync auto and `syncwise plan --strategy` (issue 28 item 5): the choice = the planner's step
time × the measured steps to fp32 DDP's loss (syncwise.plan.strategy), resolved once before workers start."""
from __future__ import annotations

import json

import pytest

from syncwise.errors import ConfigError
from syncwise.layout import Layout
from syncwise.plan import load_model
from syncwise.plan import strategy as S


def _results(steps: dict[str, float | None]) -> dict:
    """A benchmarks/time_to_loss.py results file with these steps to the target (None: never reached)."""
    rows = []
    for name, s in steps.items():
        rows.append({"name": name, "peer": name.startswith("torch-"), "repeats": 1, "reached_in": int(s is not None),
                     "rounds": [{"steps_to_target": s, "reached": s is not None}], "steps_to_target": s,
                     "final_gap": 0.0 if s is not None else 0.4})
    return {"smoke": False, "command": "python benchmarks/time_to_loss.py --preset tiny --steps 100 --cap 200",
            "where": "2 local workers over loopback", "target_val_loss": 2.0, "rows": rows}


STEPS = {"none": 90.0, "fp16": 90.0, "fp8": 91.0, "powersgd:rank=4": 117.0, "topk:ratio=0.01": None,
         "diloco:period=16": 135.0, "torchft-diloco:period=16": 95.0}


@pytest.fixture
def table(tmp_path, monkeypatch):
    src = tmp_path / "ttl.json"
    src.write_text(json.dumps(_results(STEPS)))
    dest = S.write_table(src, tmp_path / "convergence.json")
    monkeypatch.setattr(S, "TABLE_PATH", dest)
    # what auto reads by default: the convergence model, here fitted on the same results (one horizon)
    from syncwise.plan import convergence_model as CM

    points, _ = CM.points_from_results(_results(STEPS), "ttl.json")
    model = tmp_path / "convergence-model.json"
    model.write_text(json.dumps(CM.fit(points).to_json()))
    monkeypatch.setattr(S, "MODEL_PATH", model)
    return S.load_table(dest)


def test_the_table_is_regenerated_from_time_to_loss_results(table):
    assert table.preset == "tiny" and table.fp32_steps == 90.0
    assert table.costs["powersgd:rank=4"].steps_ratio == pytest.approx(1.3)
    assert table.costs["topk:ratio=0.01"].steps_ratio is None and table.costs["topk:ratio=0.01"].cap_ratio == \
        pytest.approx(200 / 90)


def _pick(table, mbit: float, lay: Layout) -> tuple[Layout, str, list]:
    cloud = S.job_cloud(2, 1, mbit * 1e6)
    return S.resolve_auto(lay, cloud, load_model("tiny", 128), 16, 128, table, micro_batch=8)


def test_a_fast_link_picks_none_or_a_lossless_cast_and_a_slow_one_compresses(table):
    fast, line, _ = _pick(table, 100_000, Layout.of(compress="auto", sync="auto"))
    assert fast.compress.name in ("none", "fp16", "bf16") and fast.sync is None, line
    slow, line, ranked = _pick(table, 5, Layout.of(compress="auto", sync="auto"))
    assert (slow.compress.name, slow.sync and slow.sync.method) in (("fp8", None), ("powersgd", None),
                                                                    ("none", "diloco")), line
    assert line.startswith(f"auto: {ranked[0].spec} (predicted ") and "Mbit/s" in line and "× sooner" in line
    # never chosen: the strategy that did not reach the loss, and torchft's DiLoCo (syncwise cannot run it)
    assert {r.spec for r in ranked} >= {"topk:ratio=0.01"} and "torchft-diloco:period=16" not in {r.spec for r in ranked}
    assert next(r for r in ranked if r.spec == "topk:ratio=0.01").why_not.startswith("never reached")


def test_auto_chooses_only_in_its_space(table):
    lay, _, _ = _pick(table, 5, Layout.of(compress="auto"))          # compressors, every step
    assert lay.sync is None and not lay.compress.is_auto
    lay, _, _ = _pick(table, 5, Layout.of(sync="auto"))              # sync strategies (or fp32 every step)
    assert lay.compress.is_none and (lay.sync is None or lay.sync.method == "diloco")


def test_the_start_up_line_and_the_resolved_config(table, tmp_path, capsys):
    from syncwise.config import build_config

    toml = tmp_path / "slow.toml"
    toml.write_text('nodes = 2\ngpus_per_node = 1\n[accelerator]\nname = "cpu-lab"\n[intra_node]\nname = '
                    '"lab-loopback"\n[inter_node]\nname = "lab-tbf"\nbandwidth_gbit_s = 0.005\n')
    cfg = build_config(None, {"compress.method": "auto", "parallel.sync": "auto", "model.preset": "tiny",
                              "dist.nproc": "2", "dist.device": "cpu", "compress.auto_cluster": str(toml)})
    err = [ln for ln in capsys.readouterr().err.splitlines() if "auto:" in ln]
    assert len(err) == 1 and err[0].startswith("syncwise: auto: ") and "5 Mbit/s" in err[0]
    chosen = cfg.compress.method if cfg.parallel.sync == "every-step" else cfg.parallel.sync
    assert err[0].startswith(f"syncwise: auto: {chosen} ") and chosen not in ("auto", "none", "fp16")


@pytest.mark.parametrize("overrides,field", [
    ({"compress.method": "auto", "parallel.sync": "localsgd:period=4"}, "compress.method"),
    ({"compress.method": "fp8", "parallel.sync": "auto"}, "parallel.sync"),
])
def test_auto_with_a_conflicting_option_is_one_config_error(overrides, field):
    from syncwise.config import build_config

    with pytest.raises(ConfigError) as e:
        build_config(None, {**overrides, "model.preset": "tiny"})
    assert e.value.field == field and e.value.value == "auto" and "\n" not in str(e.value)


def test_the_command_line_refuses_a_conflict_in_one_line(capsys):
    from syncwise.cli import main

    assert main(["train", "--check", "--preset", "tiny", "--compress", "auto", "--sync", "diloco:period=8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'compress.method': 'auto'" in err[0] and "parallel.sync=diloco:period=8" in err[0]


def test_an_unresolved_auto_never_reaches_a_worker():
    with pytest.raises(ConfigError) as e:
        Layout.of(compress="auto").check(2)
    assert e.value.field == "compress.method" and "resolve" in e.value.accepted


def test_plan_strategy_prints_the_ranked_table(table, capsys, tmp_path):
    from syncwise.cli import main

    out = tmp_path / "rows.json"
    assert main(["plan", "--strategy", "--cluster", "examples/clusters/cpu-lab-2x2.toml", "--model", "tiny",
                 "--global-batch", "32", "--seq-len", "128", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "time to fp32 DDP's loss" in text and "never reached" in text and "auto: " in text
    rows = json.loads(out.read_text())
    assert rows["chosen"] == rows["rows"][0]["spec"] and len(rows["rows"]) == 6


def test_a_real_run_trains_with_what_auto_chose(table, tmp_path, capsys):
    """`syncwise train --compress auto`: 2 gloo workers, 2 steps; the workers run the strategy the line named."""
    from syncwise.cli import main

    toml = tmp_path / "slow.toml"
    toml.write_text('nodes = 1\ngpus_per_node = 2\n[accelerator]\nname = "cpu-lab"\n[intra_node]\nname = '
                    '"lab-loopback"\nbandwidth_gbit_s = 0.01\n[inter_node]\nname = "none"\n')
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--steps", "2", "--nproc", "2", "--dist.device=cpu",
                 "--compress", "auto", "--compress.auto_cluster", str(toml), "--run-dir", str(run),
                 "--train.val_interval=0", "--data.seq_len=32"]) == 0
    line = [ln for ln in capsys.readouterr().err.splitlines() if "auto:" in ln]
    assert len(line) == 1, line
    summary = json.loads((run / "summary.json").read_text())
    chosen = json.loads((run / "config.json").read_text())["compress"]["method"]
    assert line[0].startswith(f"syncwise: auto: {chosen} ") and summary["compressor"] == chosen != "none"


def test_the_probe_ranks_by_measured_steps(table, tmp_path, capsys, monkeypatch):
    """On the built-in cluster `syncwise train --compress auto` first trains fp32 DDP and the catalog's top 3 for a
    few steps each on its own 2 workers (compress.auto_probe), then ranks those by their measured step times; the
    probes' run directories are gone after (a real run with auto's pick: the test above)."""
    import tempfile

    from syncwise.commands.train import probe
    from syncwise.config import auto_ranking, build_config

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfg = build_config(None, {"model.preset": "tiny", "train.steps": "2", "dist.nproc": "2", "dist.device": "cpu",
                              "compress.auto_probe": "2", "train.val_interval": "0", "data.seq_len": "32"})
    cfg.compress.method = "auto"
    lay, line, ranked = auto_ranking(cfg, probe)
    err = capsys.readouterr().err.splitlines()
    probes = [ln.split(": auto: probe ")[1].rsplit(": ", 1)[0] for ln in err if ": auto: probe " in ln]
    assert len(probes) == 4 and probes[0] == "none", err
    chosen = lay.compress.text
    assert chosen in probes and line.startswith(f"auto: {chosen} ") and "probed on this job" in line
    assert {r.spec for r in ranked if not r.why_not} == set(probes)       # the others: 'not probed'
    assert not list(tmp_path.glob("syncwise-auto-probe-*"))


def test_no_probe_where_the_run_directory_refuses_the_run_or_a_run_resumes(table, tmp_path, capsys):
    """The probe starts workers, so it comes after the run directory's checks: a directory holding someone's files
    is refused in one line naming run_dir before any probe; a resumed run is not probed (its checkpoints hold the
    strategy it started with)."""
    from syncwise.cli import main
    from syncwise.commands.train import resolve_config

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert main(["train", "--preset", "tiny", "--nproc", "2", "--dist.device=cpu", "--compress", "auto",
                 "--run-dir", str(taken)]) == 2
    err = capsys.readouterr().err
    assert "'run_dir'" in err and "already holds a run" in err and "auto: prob" not in err, err
    assert (taken / "notes.txt").read_text() == "mine" and [p.name for p in taken.iterdir()] == ["notes.txt"]

    saved = tmp_path / "saved"
    base = {"model.preset": "tiny", "dist.nproc": "2", "dist.device": "cpu", "run_dir": str(saved)}
    saved.mkdir()
    resolve_config(None, {**base, "compress.method": "fp8"}).save(saved / "config.json")

    def refuse(*_):
        raise AssertionError("a resumed run was probed")
    cfg = resolve_config(None, {**base, "compress.method": "auto", "resume": "auto"}, probe=refuse)
    assert cfg.compress.method not in ("auto", "")


def test_the_probe_runs_under_the_run_directorys_lock_and_the_start_takes_it_over(table, tmp_path, capsys,
                                                                                   monkeypatch):
    """Two starts on one new directory: the second is refused at once, not after probing too. The probe holds the
    directory's lock (a sub-run's lock inside it gives the outer back), releases it when the probe fails, and a
    start takes over the lock it holds."""
    import os

    from syncwise import rundir
    from syncwise.cli import main
    from syncwise.commands import auto_probe
    from syncwise.commands.train import prepare_run_dir, resolve_config
    from syncwise.errors import SyncwiseError

    run_dir = tmp_path / "new"
    seen = {}

    def probing(cfg, candidates, start):
        with pytest.raises(SyncwiseError, match="in use by another syncwise run"):
            rundir.RunDirLock(run_dir).acquire()          # a second start on the same directory
        sub = rundir.RunDirLock(tmp_path / "sub").acquire()
        sub.release()
        seen["outer"] = rundir.held_by_launcher(run_dir)  # the sub-run's release gave the outer lock back
        raise SyncwiseError("probe failed")
    monkeypatch.setattr(auto_probe, "run_probes", probing)
    assert main(["train", "--preset", "tiny", "--nproc", "2", "--dist.device=cpu", "--compress", "auto",
                 "--run-dir", str(run_dir)]) != 0
    assert seen == {"outer": True} and "probe failed" in capsys.readouterr().err
    assert rundir.holder(run_dir) is None and rundir.LOCKED_ENV not in os.environ  # released with the failure
    cfg = resolve_config(None, {"model.preset": "tiny", "run_dir": str(run_dir)})
    held = rundir.RunDirLock(run_dir).acquire()
    try:
        assert prepare_run_dir(cfg, held) is held and (run_dir / "config.json").exists()
    finally:
        held.release()


def test_probed_steps_replace_the_catalogs_and_carry_their_error():
    """plan.strategy.probed: the measured step ratio × the steps ratio; a candidate not probed is not chosen; the
    band is the probe's error (at least PROBE_ERROR) each way, not the catalog's spread."""
    from syncwise.layout import NO_COMPRESS, parse_compress

    def row(spec, t, steps):
        c = NO_COMPRESS if spec == "none" else parse_compress(spec)
        return S.Ranked(spec, c, None, t, steps, t * steps / 1.0, floor_s=0.5)

    ranked = [row("fp8", 0.2, 1.0), row("int8", 0.21, 1.02), row("bf16", 0.3, 1.0), row("none", 1.0, 1.0)]
    measured = {"none": S.Measured(1.0, 0.01, 8), "fp8": S.Measured(0.5, 0.01, 8), "int8": S.Measured(0.4, 0.2, 8)}
    out = S.probed(ranked, measured)
    assert [r.spec for r in out] == ["int8", "fp8", "none", "bf16"]
    assert out[0].time_ratio == pytest.approx(0.4 * 1.02) and out[1].time_ratio == pytest.approx(0.5)
    assert out[3].why_not.startswith("not probed") and S.choose(out).spec == "int8"
    assert out[1].step_error == pytest.approx(S.PROBE_ERROR)                    # a tight probe: the floor
    assert out[0].step_error == pytest.approx(1.645 * (0.2 ** 2 + 0.01 ** 2) ** 0.5)  # a spread one: its own
    lo, hi = S.Basis(calibrated=False, probe="probed").band(out[1])
    assert (lo, hi) == pytest.approx((2 * 0.9 / 1.1, 2 * 1.1 / 0.9))


def test_the_probe_measures_whole_sync_periods():
    from syncwise.commands.auto_probe import measure, window

    assert window(8, 1) == 8 and window(8, 32) == 64 and window(40, 16) == 48 and window(1, 1) == 2
    rows = [{"step": i, "step_time_s": 9.0} for i in range(1, 4)]       # warm-up steps, left out
    rows += [{"step": 3 + i, "step_time_s": 1.0 if i % 4 == 0 else 0.1} for i in range(1, 9)]
    m = measure(rows, 8, 4)
    assert m.steps == 8 and m.step_s == pytest.approx((1.0 + 3 * 0.1) / 4) and m.rel_se == pytest.approx(0.0)


def _best(table, basis, mbit=20.0):
    cloud = S.job_cloud(2, 2, mbit * 1e6, basis=basis)
    _, line, ranked = S.resolve_auto(Layout.of(compress="auto"), cloud, load_model("tiny", 128), 32, 128, table,
                                     micro_batch=8, basis=basis)
    return line, next(r for r in ranked if not r.why_not and r.spec != "none"), ranked


def test_the_line_carries_its_basis_and_band(table):
    """Issue 41 row 1: a catalog figure is said to be one, with a wide band and no two-decimal ratio; a calibrated
    cluster's with the planner's error; either names the convergence table's model, horizon and replicas."""
    line, best, _ = _best(table, S.Basis(calibrated=False, workers_per_host=4, cores=4))
    assert "basis: catalog figure, not calibrated" in line and "share" not in line
    assert f"~{best.sooner:.2g}× sooner (band " in line and f"{best.sooner:.2f}×" not in line
    assert "tiny preset, 100-step horizon" in line and "2 replicas" in line
    low, high = S.Basis(False).band(best)
    assert low == pytest.approx(best.sooner / S.CATALOG_SPREAD) and low < best.sooner <= high <= S.ceiling(best)
    calibrated = S.Basis(calibrated=True)
    low, high = calibrated.band(best)
    assert low == pytest.approx(best.sooner * 0.9 / 1.1) and high <= best.sooner * 1.1 / 0.9 + 1e-9
    cloud = S.job_cloud(2, 2, 20e6)
    import dataclasses
    named = dataclasses.replace(cloud, name="calibrated-2x2")    # what `syncwise plan --calibrate` writes
    assert S.basis_of(named).calibrated and not S.basis_of(cloud).calibrated
    _, line, ranked = S.resolve_auto(Layout.of(compress="auto"), named, load_model("tiny", 128), 32, 128, table,
                                     micro_batch=8)
    top = next(r for r in ranked if not r.why_not)
    assert "basis: calibrated cluster (step times within ±10 %)" in line
    assert top.spec == "none" or f"{top.sooner:.2f}× sooner (band " in line


def test_workers_sharing_cores_cap_the_predicted_ratio(table):
    """4 workers on 2 cores compute at half the catalog's one-worker speed: the compute floor doubles, so neither
    the prediction nor its band can reach what 4 cores would allow, and the line says why."""
    own_line, own, _ = _best(table, S.Basis(False, 4, 4), mbit=5)
    line, shared, _ = _best(table, S.Basis(False, 4, 2), mbit=5)
    assert "4 workers share 2 cores: compute priced at 1/2 speed" in line and "ceiling" in line
    assert shared.floor_s == pytest.approx(2 * own.floor_s, rel=0.02)   # compute (and the optimizer's pass) at 1/2
    assert S.ceiling(shared) < S.ceiling(own) and shared.sooner < own.sooner
    # the cap: communication free, the step is its floor; the predicted ratio and the band's top stay under it
    assert shared.sooner <= S.ceiling(shared) and S.Basis(False, 4, 2).band(shared)[1] <= S.ceiling(shared)
    assert S.Basis(False, 4, 2).share == 2 and S.Basis(False, 2, 4).share == 1 and S.Basis(False).share == 1
    none = next(r for r in _best(table, S.Basis(False, 4, 2), mbit=5)[2] if r.spec == "none")
    assert S.Basis(False).band(none) == (1.0, 1.0) and S.ratio_words(none, S.Basis(False)) == "1×"
