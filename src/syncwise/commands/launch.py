"""`syncwise launch slurm|k8s`: a scheduler job for a run — the sbatch script or the Kubernetes manifests.

Everything is checked before anything is written: the cluster file (the planner's CloudConfig TOML with its
``[launch]`` / ``[slurm]`` / ``[kubernetes]`` tables, syncwise.launch.spec) and the run configuration (the
`syncwise train --config` TOML, by the configuration's own validation at the job's smallest and largest world
size; what only the cluster's nodes can answer — their devices, memory, the corpus path — is checked by the
workers when they start). Existing files in --out are never overwritten without --force. ``--submit`` hands the
file to ``sbatch`` / ``kubectl apply -f``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ..config import RunConfig, build_config, format_config, load_file
from ..errors import ConfigError

SCHEDULERS = {"slurm": "slurm", "k8s": "k8s", "kubernetes": "k8s"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scheduler", choices=sorted(SCHEDULERS), help="slurm: an sbatch script; k8s: Kubernetes "
                        "manifests (a JobSet, its checkpoint PVC, the rendezvous Service, the run's ConfigMap)")
    parser.add_argument("--cluster", required=True, help="cluster TOML (examples/clusters/*.toml) with a [launch] "
                        "table (shared_dir ...) and [slurm] / [kubernetes] (docs/launch.md)")
    parser.add_argument("--config", required=True, help="the run's `syncwise train --config` TOML")
    parser.add_argument("--out", default=".", help="directory for the generated files (default: here)")
    parser.add_argument("--name", help="job name (default: the --config file's name); also the run directory's "
                        "name under launch.shared_dir/runs/")
    parser.add_argument("--submit", action="store_true", help="submit it: sbatch FILE / kubectl apply -f FILE")
    parser.add_argument("--force", action="store_true", help="overwrite files of the same name in --out")


def _job_name(args: argparse.Namespace) -> str:
    name = args.name if args.name is not None else re.sub(r"[^a-z0-9-]+", "-", Path(args.config).stem.lower()).strip("-")
    # A DNS-1123 label for Kubernetes (also fine for Slurm and as a directory name); the JobSet's pod hostnames
    # (NAME-node-J-P) must stay within 63 characters, so names are kept to 40.
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?", name or ""):
        raise ConfigError("--name", name, "1 to 40 lower-case letters, digits and '-', starting and ending with a "
                          "letter or digit (a Kubernetes name and a directory name)")
    return name


@contextlib.contextmanager
def _job_environment(world: int, local: int):
    """Validate as a worker of the job would: torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE in the environment."""
    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(local))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_config_for(cluster, config_path: str, name: str) -> tuple[RunConfig, str]:
    """The run configuration validated for the job (every world size it may have), and its TOML as the job
    embeds it: run directory on the shared path, ``resume = "auto"``, the trainer's preemption grace."""
    values = load_file(config_path)
    dist = values.get("dist", {}) if isinstance(values.get("dist", {}), dict) else {}
    nproc = cluster.cloud.gpus_per_node
    if dist.get("lab"):
        raise ConfigError("dist.lab", dist["lab"], "false in a Slurm/Kubernetes job (the lab is this machine's "
                          "emulated cluster)")
    if "nproc" in dist and dist["nproc"] != nproc:
        raise ConfigError("dist.nproc", dist["nproc"], f"{nproc}, the cluster's gpus_per_node ({cluster.source}), or "
                          "unset: the job runs one worker per accelerator")
    la = cluster.launch
    overrides = {"ckpt.preempt_grace_s": str(la.trainer_grace_s)}
    ft = values.get("ft", {}) if isinstance(values.get("ft", {}), dict) else {}
    live = bool(ft.get("replicas"))  # live recovery: each node is a replica group of its own (a world of nproc)
    cfg = None
    for nodes in [1] if live else sorted({la.min_nodes, la.max_nodes}):
        with _job_environment(nodes * nproc, nproc):
            cfg = build_config({k: v for k, v in values.items() if k not in ("run_dir", "resume")}, overrides,
                               here=False)
    gpus = cluster.gpus_per_node
    if not gpus and cfg.dist.backend == "nccl":
        raise ConfigError("dist.backend", "nccl", f"gloo or auto: the cluster's accelerator "
                          f"({cluster.cloud.accelerator.name}) has no GPUs")
    if not gpus and cfg.dist.device == "cuda":
        raise ConfigError("dist.device", "cuda", f"cpu or auto: the cluster's accelerator "
                          f"({cluster.cloud.accelerator.name}) has no GPUs")
    if cfg.train.mixed_precision == "fp16" and not gpus:
        raise ConfigError("train.mixed_precision", "fp16", "none, bf16 or auto on a cluster without GPUs")
    cfg.run_dir = f"{la.shared_dir}/runs/{name}"
    cfg.resume = "auto"
    cfg.dist.nnodes = "1" if live else f"{la.min_nodes}:{la.max_nodes}" if la.min_nodes != la.max_nodes \
        else str(la.min_nodes)
    if nproc <= 4 * (os.cpu_count() or 1):  # within the field's bound as this machine states it
        cfg.dist.nproc = nproc
    text = format_config(cfg).replace("# syncwise train: resolved configuration (validated; nothing was started or "
                                      "written)", f"# {name}: resolved from {config_path} by `syncwise launch`")
    return cfg, text + "\n"


def _write(out: Path, files: dict[str, str], force: bool) -> list[Path]:
    existing = [name for name in files if (out / name).exists()]
    if existing and not force:
        raise ConfigError("--out", str(out), f"a directory without {', '.join(existing)} (syncwise never overwrites "
                          "a file: remove it, choose another --out or --name, or pass --force)")
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", str(out), "a directory (this is a file)")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        path = out / name
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        if name.endswith(".sbatch"):
            tmp.chmod(0o755)
        elif "\nkind: Secret\n" in text:  # a job's secret inside: owner-only, as the run directory's job.secret
            tmp.chmod(0o600)
        os.replace(tmp, path)
        written.append(path)
    return written


def _submit(command: list[str], what: str) -> int:
    tool = command[0]
    if shutil.which(tool) is None:
        print(f"syncwise: {tool} is not on PATH here, so nothing was submitted; the {what} is written. Submit it "
              f"where {tool} works: {' '.join(command)}", file=sys.stderr)
        return 2
    proc = subprocess.run(command, capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    if proc.returncode != 0:
        print(f"syncwise: `{' '.join(command)}` failed (exit code {proc.returncode}): {proc.stderr.strip()}",
              file=sys.stderr)
        return 2
    return 0


def run(args: argparse.Namespace) -> int:
    from ..launch.spec import JobSpec, load_cluster_launch

    scheduler = SCHEDULERS[args.scheduler]
    cluster = load_cluster_launch(args.cluster)
    if scheduler == "k8s" and not cluster.kubernetes.image:
        raise ConfigError("kubernetes.image", "", f"a container image with syncwise and torch (required for "
                          f"`syncwise launch k8s`; set it in [kubernetes] of {args.cluster})")
    name = _job_name(args)
    if args.submit and scheduler == "slurm" and not Path(cluster.launch.shared_dir).is_dir():
        raise ConfigError("launch.shared_dir", cluster.launch.shared_dir, "a directory mounted where the job is "
                          "submitted (--submit): the job's log, run directory and checkpoints go there")
    cfg, run_toml = run_config_for(cluster, args.config, name)
    from ..launch.spec import live_recovery_job

    job = JobSpec(name=name, run_toml=run_toml, nproc_per_node=cluster.cloud.gpus_per_node, source=args.config,
                  ft=live_recovery_job(getattr(cfg, "ft", None), cfg.train.steps, cluster.launch))
    out = Path(args.out)
    if scheduler == "slurm":
        from ..launch.slurm import sbatch_script

        files = {f"{name}.sbatch": sbatch_script(cluster, job)}
    else:
        from ..launch.kubernetes import manifests, to_yaml

        files = {f"{name}.yaml": to_yaml(manifests(cluster, job))}
    written = _write(out, files, args.force)
    la = cluster.launch
    print(f"wrote {', '.join(str(p) for p in written)}: {name} on {cluster.cloud.describe()}, "
          f"{la.min_nodes}-{la.max_nodes} node(s) x {job.nproc_per_node} worker(s), run directory "
          f"{cfg.run_dir}, grace {la.grace_s} s")
    if scheduler == "slurm":
        # Slurm opens the job's log file before the script runs, and does not create its directory: make it where
        # the shared path is mounted here (never the shared path itself), else say so.
        logs = Path(job.log_dir(la.shared_dir))
        if Path(la.shared_dir).is_dir():
            logs.mkdir(parents=True, exist_ok=True)
        else:
            print(f"note: {la.shared_dir} is not mounted here: create {logs} on the cluster before sbatch (Slurm "
                  "writes the job's log there and does not create the directory)", file=sys.stderr)
    if not args.submit:
        how = f"sbatch {written[0]}" if scheduler == "slurm" else f"kubectl apply -f {written[0]}"
        print(f"submit with: {how}  (or add --submit)")
        return 0
    if scheduler == "slurm":
        return _submit(["sbatch", str(written[0])], "sbatch script")
    return _submit(["kubectl", "apply", "-f", str(written[0])], "manifest")
