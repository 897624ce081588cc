"""What a scheduler job needs beyond the cluster's hardware: the ``[launch]``, ``[slurm]`` and ``[kubernetes]``
tables of a cluster TOML file, and the job they describe.

The cluster file is the planner's ``CloudConfig`` TOML (``examples/clusters/*.toml``, ``syncwise.plan.load_cluster``);
these three optional tables are read here and ignored by the planner::

    [launch]                      # both schedulers
    shared_dir = "/shared/syncwise"   # every node mounts it (Slurm) / the PVC's mount path (Kubernetes): run dirs, logs
    min_nodes = 2                 # torchrun --nnodes MIN:MAX (default: nodes, nodes)
    max_nodes = 4
    max_restarts = 3              # torchrun --max-restarts: worker-group restarts inside one allocation
    grace_s = 120                 # a preempted job's time to save: Slurm --signal=USR1@grace, Kubernetes
                                  # terminationGracePeriodSeconds; the trainer keeps a margin (trainer_grace_s)
    rdzv_port = 29500
    nccl_socket_ifname = "eth0"   # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME (default: unset, the libraries choose)
    gloo_socket_ifname = "eth0"
    python = "python3"            # the interpreter that has syncwise and torch on the nodes
    env = { NCCL_DEBUG = "WARN" } # more environment for the workers

    [slurm]
    partition = "gpu"
    account = "my-project"
    time = "24:00:00"             # --time; grace_s must be shorter
    cpus_per_task = 64            # one task per node: its CPUs (OMP threads are split between the workers)
    mem = "0"                     # --mem (optional)
    sbatch = ["--qos=high"]       # more #SBATCH options (optional)
    setup = ["source /shared/venv/bin/activate"]   # shell lines before srun (optional)

    [kubernetes]
    namespace = "ml"
    image = "registry.example.com/syncwise:0.1.0"   # required for `syncwise launch k8s`
    storage = "500Gi"             # the checkpoint PVC (ReadWriteMany: every pod mounts it)
    storage_class = "nfs-client"  # optional
    gpu_resource = "nvidia.com/gpu"
    cpu = "32"                    # requests = limits per pod (optional)
    memory = "512Gi"

Every value is checked when the file is read; a bad one is a ``ConfigError`` naming ``launch.KEY`` /
``slurm.KEY`` / ``kubernetes.KEY``, the value and what is accepted, before anything is written.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .. import live_env
from ..errors import ConfigError
from ..plan.cloud import CloudConfig, cloud_from_dict, read_cluster_toml

#: The cluster file's tables this module owns (the planner ignores them).
LAUNCH_TABLES = ("launch", "slurm", "kubernetes")

_IFNAME = re.compile(r"^[\^=]?[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$")  # NCCL's syntax: eth0 | ^docker,lo | =eth0
_SLURM_WORD = re.compile(r"^[A-Za-z0-9_.,+-]+$")
_SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_K8S_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_K8S_RESOURCE = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_SAFE = re.compile(r"^[^\x00-\x1f\x7f'\"`$\\]+$")  # no control characters, quotes, backticks, $ or backslashes


@dataclass(frozen=True)
class LaunchOptions:
    """``[launch]``: the parts of a job both schedulers share."""

    shared_dir: str
    min_nodes: int
    max_nodes: int
    max_restarts: int = 3
    grace_s: int = 120
    rdzv_port: int = 29500
    nccl_socket_ifname: str = ""
    gloo_socket_ifname: str = ""
    python: str = "python3"
    env: dict = field(default_factory=dict)

    @property
    def trainer_grace_s(self) -> int:
        """The trainer's own deadline (``ckpt.preempt_grace_s``): the scheduler's grace less a margin (10 %, at
        least 5 s) for the agent's shutdown and the process exits, so the stop is syncwise's, not a SIGKILL."""
        return max(1, self.grace_s - max(5, self.grace_s // 10))


@dataclass(frozen=True)
class SlurmOptions:
    """``[slurm]``: where and how long the job runs."""

    partition: str = ""
    account: str = ""
    time: str = ""
    cpus_per_task: int = 0
    mem: str = ""
    sbatch: tuple = ()
    setup: tuple = ()


@dataclass(frozen=True)
class KubernetesOptions:
    """``[kubernetes]``: the namespace, the image, the checkpoint volume and the per-pod resources."""

    namespace: str = "default"
    image: str = ""
    storage: str = "100Gi"
    storage_class: str = ""
    gpu_resource: str = "nvidia.com/gpu"
    cpu: str = ""
    memory: str = ""


@dataclass(frozen=True)
class ClusterLaunch:
    """A cluster file read whole: the planner's ``CloudConfig`` and the launch tables."""

    cloud: CloudConfig
    launch: LaunchOptions
    slurm: SlurmOptions
    kubernetes: KubernetesOptions
    source: str = ""

    @property
    def gpus_per_node(self) -> int:
        """Accelerators a node's pod/allocation asks for: 0 for the CPU accelerators (the lab's ``cpu-lab``)."""
        return 0 if self.cloud.accelerator.name.lower().startswith("cpu") else self.cloud.gpus_per_node


def _text(key: str, value: Any, accepted: str, pattern: Optional[re.Pattern] = None, empty: bool = True) -> str:
    if not isinstance(value, str) or (not value and not empty) or (value and pattern is not None
                                                                    and not pattern.match(value)):
        raise ConfigError(key, value, accepted)
    return value


def _int(key: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(key, value, f"an integer from {lo:,} to {hi:,}")
    return value


def _strings(key: str, value: Any, accepted: str, check: Any = None) -> tuple:
    if not isinstance(value, list) or not all(isinstance(v, str) and (check is None or check(v)) for v in value):
        raise ConfigError(key, value, accepted)
    return tuple(value)


def _table(name: str, values: Any, cls: type) -> dict[str, Any]:
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(name, values, f"a [{name}] table")
    known = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in known:
            raise ConfigError(f"{name}.{key}", values[key], f"a key of [{name}]: " + ", ".join(known))
    return values


def slurm_seconds(time: str) -> Optional[int]:
    """Seconds of a Slurm ``--time`` value (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS); None if unlimited."""
    if time.upper() in ("", "UNLIMITED", "INFINITE"):
        return None
    m = _SLURM_TIME.match(time)
    if not m:
        raise ValueError(time)
    days, a, b, c = m.group(1), int(m.group(2)), m.group(3), m.group(4)
    parts = [a] + [int(x) for x in (b, c) if x is not None]
    if days is not None:  # D-HH[:MM[:SS]]
        h, mi, s = (parts + [0, 0])[:3]
        return int(days) * 86400 + h * 3600 + mi * 60 + s
    if len(parts) == 1:
        return parts[0] * 60  # MM
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]  # MM:SS
    return parts[0] * 3600 + parts[1] * 60 + parts[2]


def launch_from_dict(values: dict[str, Any], cloud: CloudConfig) -> tuple[LaunchOptions, SlurmOptions,
                                                                           KubernetesOptions]:
    """The three launch tables of a cluster file (already parsed TOML), checked."""
    la = _table("launch", values.get("launch"), LaunchOptions)
    if "shared_dir" not in la:
        raise ConfigError("launch.shared_dir", None, "an absolute path every node mounts (run directories, "
                          "checkpoints and logs go there); required")
    shared = _text("launch.shared_dir", la["shared_dir"], "an absolute path without quotes, $, backslashes or "
                   "control characters", _SAFE, empty=False)
    if not shared.startswith("/"):
        raise ConfigError("launch.shared_dir", shared, "an absolute path (it is the same on every node)")
    lo = _int("launch.min_nodes", la.get("min_nodes", cloud.nodes), 1, 65536)
    hi = _int("launch.max_nodes", la.get("max_nodes", max(cloud.nodes, lo)), 1, 65536)
    if hi < lo:
        raise ConfigError("launch.max_nodes", hi, f"an integer ≥ launch.min_nodes ({lo})")
    if hi > cloud.nodes:
        raise ConfigError("launch.max_nodes", hi, f"at most the cluster's nodes ({cloud.nodes}): the job never gets "
                          "more (raise nodes if the cluster has them)")
    env = la.get("env", {})
    if not isinstance(env, dict):
        raise ConfigError("launch.env", env, "a table of NAME = value (strings or numbers)")
    for k, v in env.items():
        if not _ENV_KEY.match(k) or isinstance(v, bool) or not isinstance(v, (str, int, float)) or \
                (isinstance(v, str) and v and not _SAFE.match(v)):
            raise ConfigError(f"launch.env.{k}", v, "a variable name [A-Za-z_][A-Za-z0-9_]* with a string or number "
                              "value (no quotes, $, backslashes or control characters)")
    iface = "an interface name or NCCL's list syntax (eth0, ^docker,lo, =ib0), no spaces"
    launch = LaunchOptions(
        shared_dir=shared.rstrip("/") or "/", min_nodes=lo, max_nodes=hi,
        max_restarts=_int("launch.max_restarts", la.get("max_restarts", 3), 0, 1000),
        grace_s=_int("launch.grace_s", la.get("grace_s", 120), 10, 86400),
        rdzv_port=_int("launch.rdzv_port", la.get("rdzv_port", 29500), 1024, 64536),  # + job id mod 1000 (Slurm)
        nccl_socket_ifname=_text("launch.nccl_socket_ifname", la.get("nccl_socket_ifname", ""), iface, _IFNAME),
        gloo_socket_ifname=_text("launch.gloo_socket_ifname", la.get("gloo_socket_ifname", ""), iface, _IFNAME),
        python=_text("launch.python", la.get("python", "python3"), "the nodes' Python command or path (no quotes, "
                     "$, backslashes or control characters)", _SAFE, empty=False),
        env={k: str(v) for k, v in env.items()})

    sl = _table("slurm", values.get("slurm"), SlurmOptions)
    word = "letters, digits and _ . , + - only"
    time = _text("slurm.time", sl.get("time", ""), "a Slurm time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS "
                 "or UNLIMITED")
    try:
        limit = slurm_seconds(time)
    except ValueError:
        raise ConfigError("slurm.time", time, "a Slurm time: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or "
                          "UNLIMITED") from None
    if limit is not None and limit <= launch.grace_s:
        raise ConfigError("launch.grace_s", launch.grace_s, f"fewer seconds than slurm.time ({time} = {limit} s): "
                          "Slurm sends the signal grace_s before the time limit")
    slurm = SlurmOptions(
        partition=_text("slurm.partition", sl.get("partition", ""), word, _SLURM_WORD),
        account=_text("slurm.account", sl.get("account", ""), word, _SLURM_WORD),
        time=time,
        cpus_per_task=_int("slurm.cpus_per_task", sl.get("cpus_per_task", 0), 0, 100_000),
        mem=_text("slurm.mem", sl.get("mem", ""), "a Slurm memory size: 0 (all), 500G, 64000M", 
                  re.compile(r"^[0-9]+[KMGT]?$")),
        sbatch=_strings("slurm.sbatch", sl.get("sbatch", []), "a list of sbatch options, each '--name' or "
                        "'--name=value' (no newlines)", lambda v: v.startswith("--") and "\n" not in v),
        setup=_strings("slurm.setup", sl.get("setup", []), "a list of shell lines (no newlines inside one)",
                       lambda v: "\n" not in v))

    ku = _table("kubernetes", values.get("kubernetes"), KubernetesOptions)
    dns = "a DNS-1123 label: lower-case letters, digits and '-', starting and ending with a letter or digit, ≤ 63"
    quantity = "a Kubernetes quantity such as 500Gi, 64, 2500m"
    k8s = KubernetesOptions(
        namespace=_text("kubernetes.namespace", ku.get("namespace", "default"), dns, _K8S_NAME, empty=False),
        image=_text("kubernetes.image", ku.get("image", ""), "a container image reference (no spaces or quotes)",
                    re.compile(r"^[A-Za-z0-9._/:@-]+$")),
        storage=_text("kubernetes.storage", ku.get("storage", "100Gi"), quantity, _K8S_QUANTITY, empty=False),
        storage_class=_text("kubernetes.storage_class", ku.get("storage_class", ""), dns.replace("label", "name")
                            .replace(", ≤ 63", ""), re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")),
        gpu_resource=_text("kubernetes.gpu_resource", ku.get("gpu_resource", "nvidia.com/gpu"),
                           "an extended resource name such as nvidia.com/gpu or amd.com/gpu", _K8S_RESOURCE,
                           empty=False),
        cpu=_text("kubernetes.cpu", ku.get("cpu", ""), quantity, _K8S_QUANTITY),
        memory=_text("kubernetes.memory", ku.get("memory", ""), quantity, _K8S_QUANTITY))
    if len(k8s.namespace) > 63:
        raise ConfigError("kubernetes.namespace", k8s.namespace, dns)
    return launch, slurm, k8s


def load_cluster_launch(path: "str | Path") -> ClusterLaunch:
    """Read a cluster TOML file: the ``CloudConfig`` (by the planner's own parser) and the launch tables."""
    values = read_cluster_toml(path)
    cloud = cloud_from_dict({k: v for k, v in values.items() if k not in LAUNCH_TABLES}, str(path))
    launch, slurm, k8s = launch_from_dict(values, cloud)
    return ClusterLaunch(cloud, launch, slurm, k8s, str(path))


#: torchft's lighthouse listens this many ports above the rendezvous port (Slurm: plus the job id mod 1000)
LIGHTHOUSE_PORT_OFFSET = 1000


@dataclass(frozen=True)
class LiveRecoveryJob:
    """The run's ``[ft]`` section as a scheduler job needs it (live recovery, docs/live-recovery.md): one replica
    group per node, torchft's lighthouse beside them, and who restarts a lost replica."""

    replicas: int
    min_replicas: int = 1
    replica_restarts: int = 3  # torchrun --max-restarts inside a replica group (each restart heals from a peer)
    quorum_timeout_s: float = 60.0
    timeout_s: float = 30.0
    heartbeat_timeout_s: float = 1.0
    steps: int = 0  # the run's steps: the replica groups' metrics are merged into one row per step at the end

    @property
    def lighthouse_args(self) -> list[str]:
        """torchft's lighthouse (the ``torchft_lighthouse`` binary of the torchft wheel) without ``--bind``: a
        quorum needs ``min_replicas``; the join timeout as ``syncwise train`` starts it locally, the heartbeat timeout
        ``ft.heartbeat_timeout_s`` (at most ``ft.timeout_s``)."""
        import inspect

        from .ft import Lighthouse, heartbeat_ms

        defaults = inspect.signature(Lighthouse.__init__).parameters
        return ["torchft_lighthouse", f"--min_replicas={self.min_replicas}",
                f"--join_timeout_ms={defaults['join_timeout_ms'].default}",
                f"--heartbeat_timeout_ms={heartbeat_ms(self.heartbeat_timeout_s, self.timeout_s)}"]

    def replica_env(self, replica: str, lighthouse: str, status_dir: str) -> dict[str, str]:
        """What a replica group's workers read (``syncwise.launch.ft.replica_env``'s variables): ``replica`` may be
        a shell/Kubernetes reference such as ``$SYNCWISE_FT_REPLICA``."""
        from .ft import replica_env

        env = replica_env(0, self.replicas, lighthouse, 1, self.min_replicas, self.quorum_timeout_s, self.timeout_s,
                          status_dir, base={})
        env = {k: v for k, v in env.items() if k.startswith(live_env.PREFIXES)}
        env[live_env.REPLICA] = replica
        return env


def live_recovery_job(ft: Any, steps: int, launch: LaunchOptions) -> Optional[LiveRecoveryJob]:
    """The job's live-recovery part from a validated run configuration's ``ft`` section (None when off), checked
    against the cluster's ``[launch]``: one replica group per node, so the job has ``ft.replicas`` nodes."""
    if ft is None or not getattr(ft, "replicas", 0):
        return None
    if launch.min_nodes != launch.max_nodes or launch.max_nodes != ft.replicas:
        raise ConfigError("ft.replicas", ft.replicas, f"launch.min_nodes = launch.max_nodes = ft.replicas (the cluster "
                          f"file has {launch.min_nodes}-{launch.max_nodes} nodes): a live-recovery job runs one replica "
                          "group per node, and the replica groups are its elastic unit (ft.min_replicas)")
    if launch.rdzv_port > 63536:
        raise ConfigError("launch.rdzv_port", launch.rdzv_port, "at most 63,536 with ft.replicas: the lighthouse "
                          "listens 1,000 ports above the rendezvous (Slurm: + job id mod 1000)")
    return LiveRecoveryJob(replicas=ft.replicas, min_replicas=ft.min_replicas, replica_restarts=ft.replica_restarts,
                           quorum_timeout_s=ft.quorum_timeout_s, timeout_s=ft.timeout_s,
                           heartbeat_timeout_s=ft.heartbeat_timeout_s, steps=steps)


@dataclass(frozen=True)
class JobSpec:
    """One training job as the generators write it: its name, the validated run configuration (TOML text,
    embedded in the job), workers per node and where its run directory and logs live on the shared path."""

    name: str
    run_toml: str
    nproc_per_node: int
    source: str = ""  # the RUN.toml it came from (for the generated file's header)
    ft: Optional[LiveRecoveryJob] = None  # live recovery ([ft] replicas ≥ 2): replica groups + lighthouse

    def run_dir(self, shared_dir: str) -> str:
        return f"{shared_dir.rstrip('/')}/runs/{self.name}"

    def log_dir(self, shared_dir: str) -> str:
        return f"{shared_dir.rstrip('/')}/logs"


def agent_argv(launch: LaunchOptions, nproc_per_node: int, endpoint: str, rdzv_id: str,
               ft: Optional[LiveRecoveryJob] = None) -> list[str]:
    """One node's torchrun agent, through ``syncwise.launch.agent`` (same arguments, an exit code that tells a
    preemption): elastic between min and max nodes, c10d rendezvous at ``endpoint``, SIGUSR1 forwarded too, and
    the workers given the whole grace before the agent kills them. With live recovery (``ft``) the agent is one
    replica group's: its own node, its own rendezvous, ``ft.replica_restarts`` restarts of its workers."""
    from ..train.preemption import TORCHRUN_SIGNALS

    nnodes = "1" if ft else f"{launch.min_nodes}:{launch.max_nodes}"
    restarts = ft.replica_restarts if ft else launch.max_restarts
    return [launch.python, "-m", "syncwise.launch.agent", f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={rdzv_id}", f"--max-restarts={restarts}", f"--signals-to-handle={TORCHRUN_SIGNALS}",
            f"--shutdown-timeout={launch.grace_s}"]


def worker_argv(run_dir: str) -> list[str]:
    """The worker entry point torchrun starts on every node (``syncwise train``'s own worker): the embedded run
    configuration, the shared run directory, and ``--resume auto`` so a requeued or restarted job continues."""
    return ["-m", "syncwise.commands.worker", "--config", f"{run_dir}/run.toml", "--run-dir", run_dir,
            "--resume", "auto"]
