"""`syncwise doctor`: each cause planted on a real 2-rank gloo run, named first; two runs compared; JSON; bad input.

The runs go through the worker `syncwise train` starts (``syncwise.commands.worker.run_worker``, config.json written
by the launcher's own ``prepare_run_dir``), several of them one after another in one pair of spawned processes so
the suite pays for process start-up and ``import torch`` once (a fresh gloo group per run). The link cause runs on
the network lab (2 namespaces joined by 20 Mbit/s tbf-shaped links).
"""
from __future__ import annotations

import json
import os
import queue
import traceback

import pytest
import torch.multiprocessing as mp

from syncwise.cli import main
from syncwise.doctor import compare, diagnose, load_run
from syncwise.doctor.analyze import MIN_SHARE
from syncwise.errors import ConfigError, SyncwiseError
from syncwise.train.faults import Fault

from helpers import lab_unavailable

BASE = ["--preset", "tiny", "--steps", "8", "--data.seq_len=32", "--train.val_interval=0", "--train.val_batches=1",
        "--ckpt.interval=0"]
# name -> (extra flags, the cause doctor must name first)
PLANTED = {
    "base": ([], None),
    "straggler": (["--inject-fault", "slow:rank=1,factor=3"], "straggler"),
    "data": (["--inject-fault", "slowdata:ms=100,rank=1"], "data_loader"),
    "small_buckets": (["--dist.bucket_cap_mb=0.001"], "buckets_too_small"),
    "checkpoint": (["--ckpt.interval=1", "--ckpt.async_save=false"], "checkpoint"),
    "bubble": (["--parallel.pp=2", "--parallel.microbatches=2", "--parallel.pp_schedule=gpipe"], "pipeline_bubble"),
    "large_buckets": (["--preset", "small-dense", "--data.batch_size=2", "--dist.bucket_cap_mb=1000"],
                      "buckets_too_large"),
    "compression": (["--preset", "small-dense", "--data.batch_size=2", "--compress", "topk:ratio=0.01"],
                    "compression"),
    "experts": (["--preset", "small", "--data.seq_len=64", "--parallel.ep=2", "--inject-fault", "skew:experts=2"],
                "expert_imbalance"),
}


def _entry(rank: int, world: int, jobs: list, ports, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0", OMP_NUM_THREADS="1")
    import torch

    from syncwise.commands.worker import run_worker
    from syncwise.launch import free_port

    torch.set_num_threads(1)
    try:
        for cfg in jobs:
            # each job's port is chosen as it starts, by rank 0, not all at once before the first job: a port
            # left unbound for a minute is one any connection on the machine (other tests' workers) may take
            if rank == 0:
                port = free_port()
                for _ in range(world - 1):
                    ports.put(port)
            else:
                port = ports.get(timeout=120)
            os.environ["MASTER_PORT"] = str(port)
            run_worker(cfg)  # joins the job's gloo group, trains, destroys the group
        results.put((rank, None))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def train_runs(argvs: list[list[str]], world: int = 2, timeout: float = 300.0) -> None:
    """`syncwise train` for each argv (config.json by the launcher's prepare_run_dir), on one pair of workers."""
    from syncwise.commands.train import prepare_run_dir
    from syncwise.config import config_from_argv

    jobs = []
    for argv in argvs:
        cfg = config_from_argv(argv)
        prepare_run_dir(cfg).release()
        jobs.append(cfg)
    ctx = mp.get_context("spawn")
    results, ports = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, world, jobs, ports, results)) for r in range(world)]
    for p in procs:
        p.start()
    errors = []
    try:
        for _ in range(world):
            rank, err = results.get(timeout=timeout)
            if err:
                errors.append(f"rank {rank}:\n{err}")
    except queue.Empty:
        errors.append(f"timed out after {timeout}s")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(errors)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor")
    train_runs([BASE + ["--run-dir", str(root / name)] + flags for name, (flags, _) in PLANTED.items()])
    return root


# ---------------------------------------------------------------------------------------------- recording
def test_every_rank_records_its_steps_and_totals(runs):
    run = load_run(runs / "straggler")
    assert sorted(run.ranks) == [0, 1] and sorted(run.totals) == [0, 1]
    for r in (0, 1):
        assert [row["step"] for row in run.ranks[r]] == list(range(1, 9))
        assert all(k in run.ranks[r][0] for k in ("step_time_s", "compute_s", "data_wait_s", "comm_exposed_s"))
    # the straggler's own compute is stretched; rank 0 waits for it in the gradient sync
    late = [row for row in run.ranks[1] if row["step"] > 2]
    early = [row for row in run.ranks[0] if row["step"] > 2]
    assert sum(r["compute_s"] for r in late) > 1.5 * sum(r["compute_s"] for r in early)
    assert sum(r["comm_exposed_s"] for r in early) > sum(r["comm_exposed_s"] for r in late)
    # per-collective totals of this run: DDP's all-reduce bytes = the gradient bytes per step × steps
    rows = load_run(runs / "base").rows
    totals = load_run(runs / "base").totals[1]
    assert totals["comm"]["all_reduce"]["bytes"] >= sum(r["comm_bytes"] for r in rows)
    assert totals["control"]["all_reduce"]["calls"] >= 8  # the loss average, every step
    # compression compute and expert load are recorded where they exist
    assert all(r["compress_s"] > 0 for r in load_run(runs / "compression").ranks[0])
    experts = load_run(runs / "experts")
    assert all(r["expert_imbalance"] > 2 and "ep_comm_s" in r for r in experts.ranks[1])
    # synchronous saves of every step are in each rank's totals
    assert len(load_run(runs / "checkpoint").totals[1]["checkpoint_saves"]) == 8


@pytest.mark.parametrize("name", [n for n, (_, cause) in PLANTED.items() if cause])
def test_doctor_names_the_planted_cause_first(runs, name):
    d = diagnose(load_run(runs / name))
    expected = PLANTED[name][1]
    assert d.top is not None, d.as_dict()
    assert d.top.cause == expected, [(f.cause, round(f.lost_s * 1e3, 1)) for f in d.findings]
    assert d.top.lost_s > MIN_SHARE * d.wall_s
    # a change is recommended with a prediction in the direction the measurements support, or doctor says why not
    if d.top.predicted_step_s is not None:
        assert d.top.predicted_efficiency > d.efficiency
    else:
        assert not d.top.flag and d.top.predicted_by, d.top
    if expected == "straggler":
        assert d.top.details["rank"] == 1 and d.top.details["stays_slow"]
        assert "rank 1" in d.top.title and "stays slow" in d.top.evidence
    if expected == "data_loader":
        assert d.top.details["ranks"] == [1]
    if expected == "buckets_too_small":
        assert d.top.predicted_by == "cost model" and d.top.flag.startswith("--")
    if expected == "compression":
        # A cheaper compressor is recommended (cost model) only when predicted >= 3 % sooner to fp32 DDP's loss by
        # auto's terms; whether one clears that bar depends on how slow this run's top-k measured against the
        # model's prices (a fresh clone under a loaded second pytest worker found none). Either way the finding
        # predicts a faster step (above): by the cost model with a --compress flag, or by removing the measured
        # compression compute.
        assert (d.top.predicted_by == "cost model" and d.top.flag.startswith("--compress ")) or (
            d.top.predicted_by == "measured loss removed" and not d.top.flag), d.top
    if expected in ("buckets_too_large", "pipeline_bubble"):  # priced with the run's overlap / micro-batch cost
        assert d.top.predicted_by.startswith("cost model") or d.top.predicted_by == "not priced"
        assert d.top.details["verdict"] in ("faster", "slower", "unknown")
        assert bool(d.top.flag) == (d.top.predicted_step_s is not None)
    if expected == "buckets_too_large":  # a CPU over loopback: nothing hides behind the backward
        assert d.facts["overlap"]["credit"] == 0.0 and "bucket_cap_mb" not in d.top.flag
    if expected == "expert_imbalance":
        assert d.top.predicted_by == "not priced" and d.top.predicted_step_s is None


def test_the_baseline_has_no_planted_cause(runs):
    d = diagnose(load_run(runs / "base"))
    # Causes only a plant makes here. Not checked: a straggler (on 2 shared cores one rank is sometimes really
    # slower), the link and a tiny model's gradients in one bucket (true of the default too).
    planted = {"data_loader", "checkpoint", "pipeline_bubble", "expert_imbalance", "compression",
               "buckets_too_small"}
    assert not planted & {f.cause for f in d.findings}
    parts = d.parts
    assert abs(sum(parts.values()) - d.wall_s) < 0.05 * d.wall_s + 1e-3
    assert 0 < d.efficiency <= 1


def test_cli_prints_the_verdict_and_writes_json(runs, tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(["doctor", str(runs / "checkpoint"), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "where the step goes" in text and "checkpoint stalls" in text and "verdict" in text
    data = json.loads(out.read_text())
    assert data["top_cause"] == "checkpoint"
    assert set(data) >= {"run", "steps", "world_size", "step_time_s", "wall_step_s", "efficiency", "breakdown_s",
                         "breakdown_share", "per_rank", "findings", "facts"}
    assert set(data["breakdown_s"]) == {"compute", "straggler_wait", "data_wait", "compress", "comm_dp", "comm_ep",
                                        "expert_wait", "pp_bubble", "checkpoint", "other"}
    f = data["findings"][0]
    assert set(f) >= {"cause", "title", "lost_s", "lost_share", "evidence", "recommendation", "flag",
                      "predicted_step_s", "predicted_efficiency", "predicted_by"}
    assert sorted(data["per_rank"]) == ["0", "1"]
    assert main(["doctor", str(runs / "data"), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["top_cause"] == "data_loader"


def test_two_runs_are_compared_part_by_part(runs, capsys):
    c = compare(diagnose(load_run(runs / "base")), diagnose(load_run(runs / "straggler")))
    parts = {k: (a, b) for k, a, b in c.parts}
    assert c.parts[0][0] == "straggler_wait" and parts["straggler_wait"][1] > parts["straggler_wait"][0]
    assert ("inject_fault", [], ["slow:rank=1,factor=3"]) in c.changes
    assert "slower" in c.summary and "rank 1 is a persistent compute straggler" in c.summary
    assert main(["doctor", str(runs / "base"), str(runs / "checkpoint"), "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parts"][0]["part"] == "checkpoint" and data["parts"][0]["delta_s"] > 0
    assert {x["key"] for x in data["config_changes"]} == {"ckpt.interval", "ckpt.async_save"}


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_run_directories_get_a_clear_error(tmp_path, capsys):
    cases = {}
    cases["missing"] = tmp_path / "nope"
    (tmp_path / "file").write_text("x")
    cases["file"] = tmp_path / "file"
    (tmp_path / "empty").mkdir()
    cases["empty"] = tmp_path / "empty"
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "metrics.jsonl").write_text('{"step": 1, "step_time_s": 0.1}\n')
    (torn / "summary.json").write_text("{not json")
    cases["torn"] = torn
    nosum = tmp_path / "nosum"
    nosum.mkdir()
    (nosum / "metrics.jsonl").write_text('{"step": 1, "step_time_s": 0.1}\n')
    cases["nosum"] = nosum
    badrow = tmp_path / "badrow"
    badrow.mkdir()
    (badrow / "metrics.jsonl").write_text('{"loss": 1}\n{"step": 2, "step_time_s": 0.1}\n')
    (badrow / "summary.json").write_text("{}")
    cases["badrow"] = badrow
    expect = {"missing": "does not exist", "file": "is not a directory", "empty": "has no metrics.jsonl",
              "torn": "is not valid JSON", "nosum": "has no summary.json", "badrow": "line 1"}
    for name, path in cases.items():
        with pytest.raises(SyncwiseError) as e:
            load_run(path)
        assert str(path) in str(e.value) and expect[name] in str(e.value), (name, str(e.value))
        assert main(["doctor", str(path)]) == 2
        err = capsys.readouterr().err
        assert str(path) in err and "Traceback" not in err and "expected" in err


def test_fault_specs_are_parsed_by_the_one_parser():
    assert Fault.parse("slow:rank=1,factor=2") == Fault("slow", 1, 1, 2.0)
    assert Fault.parse("slowdata:ms=200") == Fault("slowdata", 1, None, 200.0)
    assert Fault.parse(" SlowData : ms = 50 , rank = 0 , step = 3 ") == Fault("slowdata", 3, 0, 50.0)
    assert Fault.parse("skew:experts=2") == Fault("skew", 1, None, 2.0)
    for bad in ("slow:rank=1", "slow:factor=2", "slow:rank=1,factor=0.5", "slowdata", "slowdata:ms=-1",
                "slowdata:ms=fast", "skew:experts=0", "slow:rank=1,factor=2,size=3", "slower:rank=1"):
        with pytest.raises(ConfigError) as e:
            Fault.parse(bad)
        assert e.value.field == "inject_fault" and "slow:rank=R,factor=F" in e.value.accepted


# ---------------------------------------------------------------------------------------------- the link (lab)
@pytest.mark.lab
@pytest.mark.skipif(lab_unavailable() is not None, reason=lab_unavailable() or "")
def test_doctor_names_a_slow_link_on_the_lab(tmp_path, monkeypatch):
    from syncwise.commands.train import prepare_run_dir
    from syncwise.config import config_from_argv
    from syncwise.lab import cluster as lab
    from syncwise.lab.launch import lab_torchrun

    prefix = "swdt"
    monkeypatch.setenv("SYNCWISE_LAB_DIR", str(tmp_path / "state"))
    run_dir = tmp_path / "lab"
    cfg = config_from_argv(BASE + ["--run-dir", str(run_dir), "--dist.lab=true", "--dist.nproc=1"])
    prepare_run_dir(cfg).release()
    try:
        lab.up(2, "20mbit", prefix=prefix)
        rc = lab_torchrun(["-m", "syncwise.commands.worker", "--config", str(run_dir / "config.json")],
                          log_dir=tmp_path / "logs", timeout=180, prefix=prefix)
    finally:
        lab.down(prefix)
    assert rc == 0, (tmp_path / "logs" / "node1.log").read_text()[-2000:]
    d = diagnose(load_run(run_dir))
    assert d.top is not None and d.top.cause == "link", [(f.cause, f.lost_s) for f in d.findings]
    bw = d.top.details["effective_bandwidth_bytes_s"]
    assert bw is not None and bw * 8 < 40e6  # at most about the 20 Mbit/s link
    assert d.top.flag.startswith("--compress") and d.top.predicted_by == "cost model"
    assert d.top.predicted_efficiency > d.efficiency
    assert "network lab" in d.top.evidence
