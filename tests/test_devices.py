"""Device placement (issue 14): which device local rank r uses and which backend goes with it — one rule,
``syncwise.devices`` — checked before any worker starts, used by the worker, CommContext, the Python API's
torchrun join and the prefetcher; and the set-up script that keeps an installed (CUDA) torch.

Everything here runs on a CPU-only machine and on one with GPUs: a machine's GPUs are either given to the pure
functions or faked by replacing ``syncwise.devices``' probes; nothing assumes ``cuda:1`` exists.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from syncwise import devices
from syncwise.cli import main
from syncwise.config import RunConfig, build_config
from syncwise.data import SmartPrefetcher
from syncwise.errors import ConfigError
from syncwise.launch import free_port
from syncwise.train import arguments
from syncwise.commands import worker as worker_main

REPO = Path(__file__).resolve().parents[1]
GPU_COUNTS = (0, 1, 2, 8)


# -- the rule, pure --------------------------------------------------------------------------------------------
@settings(max_examples=400, deadline=None)
@given(device=st.sampled_from(devices.DEVICES), backend=st.sampled_from(devices.BACKENDS),
       gpus=st.sampled_from(GPU_COUNTS), nproc=st.integers(1, 17), nccl=st.booleans(), lab=st.booleans())
def test_the_rule_for_every_device_backend_gpu_count_and_nproc(device, backend, gpus, nproc, nccl, lab):
    kind = device if device != "auto" else ("cuda" if gpus else "cpu")
    try:
        p = devices.plan(device, backend, nproc, gpus, nccl_available=nccl, lab=lab)
    except ConfigError as e:
        # Refused exactly where a job could not run, naming the field, the value and what is accepted.
        if kind == "cuda" and gpus == 0:
            assert (e.field, e.value) == ("dist.device", "cuda") and "no CUDA GPU" in e.accepted
        else:
            assert backend == "nccl" and "gloo" in e.accepted
            if kind == "cpu":
                assert (e.field, e.value) == ("dist.backend", "nccl")
            elif not nccl or lab:
                assert e.field == "dist.backend"
            else:
                assert nproc > gpus and (e.field, e.value) == ("dist.nproc", nproc)
                assert "Duplicate GPU detected" in e.accepted and f"at most {gpus}" in e.accepted
        return
    assert not (kind == "cuda" and gpus == 0)
    assert p.device_type == kind and p.local_world_size == nproc
    placed = [p.device(r) for r in range(nproc)]
    if kind == "cpu":
        assert p.backend == "gloo" and all(d == torch.device("cpu") for d in placed) and not p.shared
        assert p.note == ""
        return
    # Every rank on a visible GPU, round-robin.
    assert placed == [torch.device("cuda", r % gpus) for r in range(nproc)]
    assert p.shared == (nproc > gpus) and p.ranks_per_gpu == -(-nproc // gpus)
    if p.backend == "nccl":  # NCCL: never two ranks on one GPU, rank r on cuda:r
        assert len(set(placed)) == nproc and nproc <= gpus and not lab and nccl
    if backend == "auto":
        assert p.backend == ("nccl" if nproc <= gpus and nccl and not lab else "gloo")
    else:
        assert p.backend == backend
    # One line when 'auto' made ranks share GPUs, naming the way to NCCL.
    assert bool(p.note) == (backend == "auto" and nproc > gpus and not lab)
    if p.note:
        assert "gloo" in p.note and f"--nproc {gpus}" in p.note


@pytest.mark.parametrize("device, backend, nproc, gpus, want_backend, want", [
    ("auto", "auto", 2, 0, "gloo", ["cpu", "cpu"]),              # CPU machine: as before
    ("auto", "gloo", 2, 0, "gloo", ["cpu", "cpu"]),
    ("auto", "auto", 2, 1, "gloo", ["cuda:0", "cuda:0"]),        # the default job on one GPU
    ("auto", "auto", 1, 1, "nccl", ["cuda:0"]),
    ("auto", "auto", 2, 2, "nccl", ["cuda:0", "cuda:1"]),
    ("auto", "auto", 8, 8, "nccl", [f"cuda:{r}" for r in range(8)]),
    ("auto", "auto", 2, 8, "nccl", ["cuda:0", "cuda:1"]),
    ("auto", "auto", 3, 2, "gloo", ["cuda:0", "cuda:1", "cuda:0"]),
    ("auto", "gloo", 2, 2, "gloo", ["cuda:0", "cuda:1"]),         # gloo no longer means the CPU
    ("cuda", "gloo", 4, 1, "gloo", ["cuda:0"] * 4),
    ("cpu", "auto", 2, 8, "gloo", ["cpu", "cpu"]),                # the CPU on a GPU machine
    ("cuda", "nccl", 8, 8, "nccl", [f"cuda:{r}" for r in range(8)]),
])
def test_placements(device, backend, nproc, gpus, want_backend, want):
    p = devices.plan(device, backend, nproc, gpus)
    assert p.backend == want_backend
    assert [str(devices.assign(device, backend, r, nproc, gpus)) for r in range(nproc)] == want


@pytest.mark.parametrize("device, backend, nproc, gpus, field, words", [
    ("cuda", "auto", 1, 0, "dist.device", "no CUDA GPU is visible"),
    ("auto", "nccl", 1, 0, "dist.backend", "without CUDA"),
    ("cpu", "nccl", 1, 8, "dist.backend", "NCCL moves only CUDA tensors"),
    ("auto", "nccl", 2, 1, "dist.nproc", "Duplicate GPU detected"),
    ("cuda", "nccl", 9, 8, "dist.nproc", "at most 8 local worker(s)"),
    ("gpu", "auto", 1, 1, "dist.device", "one of: auto, cpu, cuda"),
    ("auto", "mpi", 1, 1, "dist.backend", "one of: auto, nccl, gloo"),
    ("auto", "auto", 0, 1, "dist.nproc", "an integer ≥ 1"),
])
def test_refusals_name_the_field_the_value_and_what_is_accepted(device, backend, nproc, gpus, field, words):
    with pytest.raises(ConfigError) as info:
        devices.plan(device, backend, nproc, gpus)
    assert info.value.field == field and words in info.value.accepted


def test_nccl_is_refused_where_torch_has_none_and_in_the_lab():
    assert devices.plan("auto", "auto", 2, 2, nccl_available=False).backend == "gloo"
    with pytest.raises(ConfigError, match="without NCCL"):
        devices.plan("auto", "nccl", 2, 2, nccl_available=False)
    lab = devices.plan("auto", "auto", 2, 2, lab=True)  # the lab's nodes all share this machine's GPUs
    assert lab.backend == "gloo" and lab.note == ""
    with pytest.raises(ConfigError, match="network lab"):
        devices.plan("auto", "nccl", 1, 2, lab=True)


def test_a_local_rank_outside_the_job_is_refused():
    with pytest.raises(ConfigError) as info:
        devices.assign("auto", "auto", 2, 2, 1)
    assert info.value.field == "LOCAL_RANK" and "0 to 1" in info.value.accepted


@pytest.mark.parametrize("device, local_rank, local_world, gpus, want", [
    ("cpu", 0, 2, 2, "gloo"),
    ("cuda:0", 0, 1, 1, "nccl"),
    ("cuda:1", 1, 2, 2, "nccl"),
    ("cuda:0", 1, 2, 1, "gloo"),   # two ranks on one GPU: NCCL would say 'Duplicate GPU detected'
    ("cuda:0", 0, 2, 1, "gloo"),
    ("cuda:0", 1, 2, 2, "gloo"),   # a hand-made mapping the rule does not make: gloo is right for any
    ("cuda:3", 3, 8, 8, "nccl"),
])
def test_backend_for_a_device_already_chosen(device, local_rank, local_world, gpus, want):
    assert devices.backend_for(torch.device(device), local_rank, local_world, gpus) == want
    assert devices.backend_for(torch.device(device), local_rank, local_world, gpus, nccl_available=False) == "gloo"


# -- a machine with GPUs, faked: the probes are the only place syncwise asks ---------------------------------------
@pytest.fixture
def fake_gpus(monkeypatch):
    def use(n: int):
        monkeypatch.setattr(devices, "visible_gpus", lambda: n)
        monkeypatch.setattr(devices, "nccl_available", lambda: n > 0)
        monkeypatch.setattr(devices, "gpu_memory_bytes", lambda index=0: 80 * 2**30)
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(key, raising=False)
    return use


@pytest.mark.parametrize("gpus, argv, field, words", [
    (1, ["--dist.backend=nccl"], "dist.backend", "Duplicate GPU detected"),   # the default --nproc 2
    (1, ["--nproc", "3", "--dist.backend=nccl"], "dist.nproc", "at most 1 local worker"),
    (2, ["--nproc", "4", "--dist.backend", "nccl"], "dist.nproc", "at most 2 local worker"),
    (0, ["--dist.device=cuda"], "dist.device", "no CUDA GPU"),
    (0, ["--dist.backend=nccl"], "dist.backend", "without CUDA"),
    (1, ["--dist.device=cpu", "--dist.backend=nccl"], "dist.backend", "NCCL moves only CUDA tensors"),
    (0, ["--dist.device=tpu"], "dist.device", "one of: auto, cpu, cuda"),
    (0, ["--train.mixed_precision=fp16"], "train.mixed_precision", "fp16 needs CUDA"),
    (2, ["--dist.device=cpu", "--train.mixed_precision=fp16"], "train.mixed_precision", "dist.device=cpu"),
])
def test_train_refuses_a_placement_before_any_worker_starts(gpus, argv, field, words, fake_gpus, tmp_path, capsys):
    fake_gpus(gpus)
    for check in (["--check"], []):
        code = main(["train", *check, "--run-dir", str(tmp_path / "run"), *argv])
        err = capsys.readouterr().err
        assert code == 2, err
        assert f"'{field}'" in err and words in err and "accepted" in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1
        assert not (tmp_path / "run").exists()  # nothing was started or written


@pytest.mark.parametrize("gpus, argv, note", [
    (0, [], None),
    (1, [], "2 workers share 1 GPU over gloo"),      # the default job on a one-GPU machine runs
    (1, ["--nproc", "1"], None),
    (2, [], None),                                   # NCCL, one GPU each
    (2, ["--nproc", "4"], "4 workers share 2 GPUs (2 per GPU at most) over gloo"),
    (1, ["--dist.backend=gloo"], None),              # asked for: no note
    (8, ["--dist.device=cpu", "--nproc", "4"], None),
])
def test_check_accepts_the_default_job_on_any_gpu_count_and_says_when_gpus_are_shared(
        gpus, argv, note, fake_gpus, capsys):
    fake_gpus(gpus)
    assert main(["train", "--check", *argv]) == 0
    out = capsys.readouterr().out
    if note is None:
        assert "# note:" not in out
    else:
        assert f"# note: {note}" in out and f"--nproc {gpus}" in out
    assert 'device = "' in out  # the field is part of the resolved configuration


def test_the_check_on_this_machine_accepts_the_default_job(capsys):
    """Whatever this machine has (no GPU, one, several), the default job is valid."""
    assert main(["train", "--check"]) == 0
    assert "[dist]" in capsys.readouterr().out


def test_gpu_memory_is_shared_by_the_workers_on_one_gpu(fake_gpus, monkeypatch, capsys):
    fake_gpus(1)
    monkeypatch.setattr(devices, "gpu_memory_bytes", lambda index=0: 2**30)  # a 1 GiB GPU
    assert main(["train", "--check", "--preset", "tiny", "--nproc", "1"]) == 0
    capsys.readouterr()
    code = main(["train", "--check", "--preset", "large", "--data.batch_size=64", "--nproc", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "GPU memory (cuda:0 shared by 2 workers)" in err, err


# -- the worker, the Python API, the prefetcher ----------------------------------------------------------------------
def test_init_distributed_places_a_rank_that_shares_the_gpu_and_joins_over_gloo(fake_gpus, monkeypatch, capsys):
    """Worker rank 1 of the default job on a one-GPU machine: cuda:0 (not cuda:1), gloo, and no second note."""
    fake_gpus(1)
    calls = {}
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(worker_main, "join_torchrun",
                        lambda d, timeout, backend: calls.update(join=(d, backend)) or True)
    cfg = RunConfig()
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert worker_main.init_distributed(cfg) == torch.device("cuda", 0)
        assert calls["set_device"] == torch.device("cuda", 0) and calls["join"] == (torch.device("cuda", 0), "gloo")
        out = capsys.readouterr().out
        assert (out.count("share 1 GPU over gloo") == 1) == (rank == 0), out


def test_init_distributed_on_the_cpu_joins_a_real_gloo_group(monkeypatch):
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    cfg = build_config(None, {"dist.device": "cpu"})
    try:
        assert worker_main.init_distributed(cfg) == torch.device("cpu")
        assert dist.is_initialized() and dist.get_backend() == "gloo"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("gpus, local_rank, device, want", [
    (1, 1, "cuda:0", "gloo"),   # the second of two ranks on one GPU: gloo, not nccl
    (2, 1, "cuda:1", "nccl"),
    (1, 0, "cuda", "gloo"),     # index-less: the current device (0) -- shared by the 2 ranks
    (0, 1, "cpu", "gloo"),
])
def test_join_torchrun_picks_the_backend_by_the_same_rule(gpus, local_rank, device, want, fake_gpus, monkeypatch):
    fake_gpus(gpus)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for key, value in dict(RANK=str(local_rank), WORLD_SIZE="2", LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE="2",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(key, value)
    seen = {}
    monkeypatch.setattr(arguments.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(arguments.dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend, **kw))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.update(set_device=torch.device(d)))
    # no store either: rank 0's bound TCPStore is tests/test_security.py's (MASTER_PORT=1 here has no server)
    monkeypatch.setattr("syncwise.bind.store_kwargs", lambda timeout=None: {})
    assert arguments.join_torchrun(torch.device(device), 5.0) is True
    # NCCL joins with a CPU communicator too (issue 24: CPU control tensors on an NCCL-only group killed every run)
    assert seen["backend"] == (devices.NCCL_PROCESS_GROUP if want == "nccl" else want)
    assert ("device_id" in seen) == (want == "nccl")  # device_id binds a device to NCCL only
    if want == "nccl":
        assert seen["device_id"] == torch.device(device)
    if torch.device(device).type == "cuda":  # before the group: tensors made with current_device() land here
        assert seen["set_device"] == devices.resolve(torch.device(device))


def test_join_torchrun_refuses_nccl_for_a_cpu_model(monkeypatch):
    for key, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(arguments.dist, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match="NCCL moves only CUDA tensors"):
        arguments.join_torchrun(torch.device("cpu"), backend="nccl")


def test_prefetcher_refuses_cuda_at_construction_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0", torch.device("cuda")):
        with pytest.raises(ConfigError) as info:
            SmartPrefetcher([1, 2], device=device)
        assert info.value.field == "device" and "no CUDA GPU is visible" in info.value.accepted
    with pytest.raises(ConfigError, match="a torch device"):
        SmartPrefetcher([1, 2], device="gpu")
    assert list(SmartPrefetcher([torch.ones(2)], device="cpu"))[0].device.type == "cpu"


def test_prefetcher_resolves_an_indexless_cuda_device_to_the_current_one(monkeypatch):
    """The producer thread needs an index (torch.cuda.set_device(torch.device('cuda')) fails there)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    p = SmartPrefetcher([1, 2], device="cuda")  # constructing starts nothing
    assert p.device == torch.device("cuda", 1) and p._cuda
    with pytest.raises(ConfigError, match="N from 0 to 1"):
        SmartPrefetcher([1, 2], device="cuda:2")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (any one: cuda:0)")
def test_prefetcher_with_an_indexless_cuda_device_on_a_gpu():
    batches = [(torch.arange(4) + i, torch.arange(4)) for i in range(3)]
    with SmartPrefetcher(batches, device="cuda") as p:
        got = list(p)
    assert [b[0].device for b in got] == [torch.device("cuda", torch.cuda.current_device())] * 3
    assert [b[0].cpu().tolist() for b in got] == [b[0].tolist() for b in batches]


def test_comm_context_places_a_single_process_job_by_the_rule(monkeypatch):
    from syncwise.comm import CommContext

    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    with CommContext("gloo", device="cpu") as ctx:
        assert ctx.device == torch.device("cpu") and ctx.backend == "gloo"
        assert "device='cpu'" in repr(ctx)
    assert not dist.is_initialized()
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError) as info:
            CommContext(device="cuda")
        assert info.value.field == "device"


# -- the set-up script keeps an installed torch --------------------------------------------------------------------
def _setup(python: str, req: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/setup.sh", req], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": python, **env})


def _venv(path: Path, torch_version: str | None, with_pip: bool = False) -> str:
    """A virtual environment (its own pip, from the interpreter's bundled ensurepip, if asked); with a stand-in
    torch distribution (metadata and module) if asked. Nothing from the system's or the test run's site-packages:
    a fresh machine has neither ``wheel`` nor a setuptools that builds wheels by itself (< 70.1)."""
    args = [sys.executable, "-m", "venv", *([] if with_pip else ["--without-pip"]), str(path)]
    subprocess.run(args, check=True, capture_output=True)
    python = str(path / "bin" / "python")
    if torch_version:
        site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
        (site / "torch").mkdir()
        (site / "torch" / "__init__.py").write_text(f"__version__ = {torch_version!r}\n")
        info = site / f"torch-{torch_version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n")
        (info / "RECORD").write_text("")
    return python


@pytest.mark.parametrize("req, rest", [("requirements.txt", "numpy rich matplotlib"),
                                       ("requirements-dev.txt", "numpy rich matplotlib pytest pytest-xdist tensorboard hypothesis kubernetes-validate==1.37.0 jsonschema pyyaml lightning==2.6.6 accelerate==1.15.0 transformers==5.23.0 prometheus_client==0.26.0 wandb==0.30.0 tokenizers==0.23.3 datasets==5.2.0 torchft==0.2.0")])
def test_setup_keeps_an_installed_torch(req, rest, tmp_path):
    python = _venv(tmp_path / "cuda", "2.11.0+cu130")
    r = _setup(python, req, SYNCWISE_SETUP_DRY_RUN="1")
    assert r.returncode == 0, r.stderr
    assert "keeping the installed torch 2.11.0+cu130" in r.stdout
    assert f"requirements without torch: {rest}\n" in r.stdout  # -r includes followed, torch dropped
    assert "-c " in r.stdout and "-e ." in r.stdout


def test_setup_installs_the_pinned_cpu_torch_where_there_is_none(tmp_path):
    python = _venv(tmp_path / "bare", None)
    r = _setup(python, "requirements.txt", SYNCWISE_SETUP_DRY_RUN="1")
    assert r.returncode == 0, r.stderr
    assert "no torch importable" in r.stdout
    assert f"would run: {python} -m pip install -q -r requirements.txt -e ." in r.stdout


@pytest.mark.slow
def test_pip_itself_would_keep_a_cuda_torch(tmp_path):
    """pip's own resolution (--dry-run --report), in an environment whose torch is a stand-in CUDA build.

    As on a fresh machine: the venv's own pip (ensurepip) and pip's default build isolation, which installs
    pyproject's build requirement (setuptools>=70.1, whose bdist_wheel needs no ``wheel``) to prepare syncwise's
    editable metadata -- nothing borrowed from this interpreter's site-packages."""
    python = _venv(tmp_path / "cuda", "2.11.0+cu130", with_pip=True)
    report = tmp_path / "report.json"
    r = _setup(python, "requirements-dev.txt", SYNCWISE_SETUP_PIP_ARGS=f"--dry-run --report {report}")
    assert r.returncode == 0, r.stdout + r.stderr
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert "torch" not in names and "syncwise" in names, names


# -- the project's own virtual environment (no venv active, no PYTHON): made, and the system's torch kept ---------
def _stand_in(where: Path, torch_version: str | None = None, broken: tuple[str, ...] = ()) -> Path:
    """A directory for PYTHONPATH: a stand-in torch distribution, and modules that fail to import."""
    where.mkdir()
    if torch_version:
        (where / "torch").mkdir()
        (where / "torch" / "__init__.py").write_text(f"__version__ = {torch_version!r}\n")
        (where / f"torch-{torch_version}.dist-info").mkdir()
        (where / f"torch-{torch_version}.dist-info" / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n")
    for name in broken:
        (where / name).mkdir()
        (where / name / "__init__.py").write_text(f"raise ImportError('no {name} here')\n")
    return where


def _project_setup(tmp_path: Path, pythonpath: Path, req: str, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    base = getattr(sys, "_base_executable", sys.executable)  # not a venv's python: the interpreter venv copies
    return subprocess.run(["bash", "scripts/setup.sh", req], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**clean, "SYNCWISE_VENV": str(tmp_path / "venv"), "SYNCWISE_BASE_PYTHON": base,
                               "PYTHONPATH": f"{pythonpath}{os.pathsep}{REPO / 'src'}", **env})


@pytest.mark.slow
def test_setup_makes_a_venv_with_the_system_site_packages_when_python3_has_a_torch(tmp_path):
    """As on a GPU machine whose python3 imports a CUDA torch: the project venv sees it, and pip keeps it."""
    report = tmp_path / "report.json"
    r = _project_setup(tmp_path, _stand_in(tmp_path / "system", "2.11.0+cu130"), "requirements.txt",
                       SYNCWISE_SETUP_PIP_ARGS=f"--dry-run --report {report}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "with --system-site-packages" in r.stdout and "keeping the installed torch 2.11.0+cu130" in r.stdout
    assert "include-system-site-packages = true" in (tmp_path / "venv" / "pyvenv.cfg").read_text()
    assert (tmp_path / "venv" / "bin" / "pip").exists()  # the venv's own pip installs there, not in the system
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert "torch" not in names and "syncwise" in names, names


def test_setup_makes_a_plain_venv_where_python3_has_no_torch(tmp_path):
    r = _project_setup(tmp_path, _stand_in(tmp_path / "system", broken=("torch",)), "requirements.txt",
                       SYNCWISE_SETUP_DRY_RUN="1")
    assert r.returncode == 0, r.stdout + r.stderr
    venv = tmp_path / "venv"
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    assert f"would run: {venv}/bin/python -m pip install -q -r requirements.txt -e ." in r.stdout
    # Run again: the venv is reused, not made anew.
    again = _project_setup(tmp_path, tmp_path / "system", "requirements.txt", SYNCWISE_SETUP_DRY_RUN="1")
    assert again.returncode == 0 and "making" not in again.stdout, again.stdout + again.stderr


def test_setup_says_in_one_line_that_python3_venv_is_missing(tmp_path):
    r = _project_setup(tmp_path, _stand_in(tmp_path / "system", broken=("ensurepip",)), "requirements.txt",
                       SYNCWISE_SETUP_APT="0")
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "install python3-venv" in r.stderr, r.stderr
    assert not (tmp_path / "venv" / "bin").exists()


# -- gloo's socket rule on an NCCL job (bind.gloo_env) -----------------------------------------------------------
_IFACES = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.5"], "eth1": ["10.1.0.5"], "docker0": ["172.17.0.1"],
           "ib0": []}


@pytest.mark.parametrize("nccl, bind_host, expected", [
    ("=eth1", "", "eth1"),                   # NCCL's exact name
    ("eth", "", "eth0,eth1"),                # NCCL's prefix: this machine's interfaces with an address
    ("^docker,lo", "10.1.0.5", "eth1"),      # an exclusion list names none: the bind rule's interface
    ("", "10.0.0.5", "eth0"),                # no NCCL interface: the bind rule's
    ("", "127.0.0.1", "lo"),                 # one machine: loopback
    ("ib", "", None),                        # a prefix matching no interface with an address, no bind host
    ("", "", None),                          # nothing to go on: gloo chooses (its own host-name rule)
])
def test_gloo_interface_from_nccl_then_the_bind_rule(nccl, bind_host, expected):
    from syncwise import bind

    env = {bind.ENV_NCCL_IFNAME: nccl, bind.ENV_BIND: bind_host}
    assert bind.gloo_interface(env, _IFACES) == expected


def test_gloo_env_keeps_the_users_values_and_is_lazy_only_for_nccl():
    from syncwise import bind

    env = {bind.ENV_NCCL_IFNAME: "=eth0"}
    assert bind.gloo_env(devices.NCCL_PROCESS_GROUP, env, _IFACES) == {"GLOO_SOCKET_IFNAME": "eth0",
                                                                       "TORCH_GLOO_LAZY_INIT": "1"}
    assert env["GLOO_SOCKET_IFNAME"] == "eth0" and env["TORCH_GLOO_LAZY_INIT"] == "1"
    mine = {bind.ENV_NCCL_IFNAME: "=eth0", "GLOO_SOCKET_IFNAME": "eth1", "TORCH_GLOO_LAZY_INIT": "0"}
    assert bind.gloo_env(devices.NCCL_PROCESS_GROUP, mine, _IFACES) == {}
    assert mine["GLOO_SOCKET_IFNAME"] == "eth1" and mine["TORCH_GLOO_LAZY_INIT"] == "0"
    gloo_job = {bind.ENV_BIND: "127.0.0.1"}
    assert bind.gloo_env("gloo", gloo_job, _IFACES) == {"GLOO_SOCKET_IFNAME": "lo"}  # a gloo job: eager mesh


def test_the_python_api_join_sets_gloos_rule_before_init(monkeypatch):
    """join_torchrun asks bind.gloo_env with the backend it passes to init_process_group (here gloo on the CPU:
    the interface of the bind rule's loopback address, no lazy pairs)."""
    from syncwise import bind

    port = free_port()
    for key in ("GLOO_SOCKET_IFNAME", "TORCH_GLOO_LAZY_INIT", "NCCL_SOCKET_IFNAME"):
        monkeypatch.setenv(key, "")  # (recorded, so what gloo_env sets is undone after the test)
        monkeypatch.delenv(key)
    monkeypatch.setenv(bind.ENV_BIND, "127.0.0.1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    try:
        assert arguments.join_torchrun(torch.device("cpu"), backend="auto")
        assert os.environ["GLOO_SOCKET_IFNAME"] == bind.loopback_interface()
        assert "TORCH_GLOO_LAZY_INIT" not in os.environ
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _socket_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _gloo_groups_fds(rank, world, groups):
    """Sockets this rank opens for ``groups`` gloo groups, eager then lazy (TORCH_GLOO_LAZY_INIT, which
    bind.gloo_env sets on an NCCL job: the gloo halves of its groups), and after one collective on one lazy group."""
    from syncwise.comm import ops

    out = {}
    for lazy in (False, True):
        os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
        if lazy:
            os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
        dist.barrier()
        before = _socket_fds()
        made = [ops.new_group(backend="gloo", desc=f"g{i}") for i in range(groups)]
        dist.barrier()
        out[lazy] = _socket_fds() - before
        dist.barrier()  # every rank counted before any uses a lazy group (a peer's first collective connects to it)
        if lazy:
            t = torch.ones(1)
            ops.all_reduce(t, "sum", group=made[0], stats=None)
            out["used"] = _socket_fds() - before
            out["sum"] = float(t)
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts sockets in /proc/self/fd (Linux)")
def test_lazy_gloo_opens_one_listener_per_group_not_a_mesh():
    """fds ≈ groups × peers was issue 39's N5: eagerly, each gloo group connects every pair at creation (per rank
    and group: one listening socket + world-1 connections); lazily, one listening socket per group and connections
    only to the peers a collective uses. The barriers' own store sockets are the same in both counts."""
    from tests.distributed import run_workers

    world, groups = 3, 4
    for rank, r in enumerate(run_workers(_gloo_groups_fds, world, groups)):
        assert r["sum"] == world
        assert r[False] >= groups * world, r           # the eager full mesh: listener + (world - 1) pairs per group
        assert r[True] < groups * world, r
        if rank == 0:
            continue  # rank 0 also serves the store: its accepted store connections come and go with the barriers
        assert r[True] == groups, r                     # lazy: one listening socket per group
        assert groups < r["used"] <= groups + world - 1, r  # the used group connected its peers, no other group
