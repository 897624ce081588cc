"""The sbatch script of a syncwise job: one torchrun agent per node, c10d rendezvous, preemption-safe.

How the pieces fit (docs/launch.md has the why of each):

- ``#SBATCH --nodes=MIN-MAX --ntasks-per-node=1``: one task per node; each task is torchrun's elastic agent
  (``--nnodes MIN:MAX --nproc-per-node N --max-restarts R``, run by ``syncwise.launch.agent`` so its exit code says
  "preempted"), which starts the node's workers (``-m syncwise.commands.worker``) and restarts the whole worker
  group after a failure;
- c10d rendezvous at the allocation's first node (``scontrol show hostnames $SLURM_JOB_NODELIST | head -1``), on
  port ``rdzv_port + job id mod 1000`` (two jobs on one node never collide), with the Slurm job id as the
  rendezvous id: no ssh, no hostfile;
- ``--requeue`` and ``--signal=USR1@GRACE``, without ``B:``: Slurm signals every process of the job step — the
  agents and the workers — GRACE seconds before the time limit. (With ``B:`` only the batch shell would get it and
  would have to pass it on.) The agents handle SIGUSR1 (``--signals-to-handle``, torch ≥ 2.9) and forward it,
  waiting up to GRACE s (``--shutdown-timeout``) for the workers; the workers finish their step, save and exit 83
  leaving ``RUN_DIR/preempted.json``; this script then requeues the job. ``scancel``, ``scontrol requeue`` and
  preemption send SIGTERM, handled the same way (Slurm itself requeues on preemption and requeue);
- ``--resume auto``: every start, first or requeued, continues from the newest valid checkpoint;
- run directories, checkpoints and logs on the shared path; ``--open-mode=append`` keeps every attempt's log;
- ``NCCL_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` when the cluster file names interfaces.

With live recovery (the run's ``[ft] replicas = R``, docs/live-recovery.md) the job has R nodes, one replica group
each, and ``--no-kill`` (a failed node does not end the allocation):

- torchft's lighthouse (the quorum server) is a job step of its own on the first node (``srun --overlap``: it
  shares the node with replica 0), at ``rdzv_port + 1000 + job id mod 1000``; every worker finds it through
  ``TORCHFT_LIGHTHOUSE``;
- each replica group is its own job step on its own node (``srun -w NODE``), with its own rendezvous there: a
  torchrun agent with ``--max-restarts = ft.replica_restarts`` restarts a failed worker, which rejoins through
  the lighthouse's quorum and heals from a live peer while the other replicas train on;
- a replica whose whole step ends in failure (its agent lost, its restarts spent) is relaunched by the script on
  its node, up to ``launch.max_restarts`` times; a node that is gone is not replaced inside the allocation (the
  other replicas train on, down to ``ft.min_replicas``);
- when every step has ended, the replica groups' metrics are merged (one row per step) and the lighthouse stops.
"""
from __future__ import annotations

import shlex

from .. import __version__, live_env
from ..train.preemption import EXIT_GRACE_EXPIRED, EXIT_PREEMPTED, MARKER
from ..secret import ENV_SECRET_FILE
from .spec import LIGHTHOUSE_PORT_OFFSET, ClusterLaunch, JobSpec, agent_argv, worker_argv

_HEREDOC = "SYNCWISE_RUN_TOML"


def sbatch_script(cluster: ClusterLaunch, job: JobSpec) -> str:
    """The whole sbatch script (text) that runs ``job`` on ``cluster``."""
    la, sl = cluster.launch, cluster.slurm
    run_dir, log_dir = job.run_dir(la.shared_dir), job.log_dir(la.shared_dir)
    if _HEREDOC in job.run_toml:
        raise ValueError(f"the run configuration contains {_HEREDOC}")
    nodes = str(la.min_nodes) if la.min_nodes == la.max_nodes else f"{la.min_nodes}-{la.max_nodes}"
    directives = [f"--job-name={job.name}", f"--nodes={nodes}", "--ntasks-per-node=1"]
    if job.ft:
        directives.append("--no-kill")  # a lost node ends its replica group, not the allocation
    if sl.cpus_per_task:
        directives.append(f"--cpus-per-task={sl.cpus_per_task}")
    if cluster.gpus_per_node:
        directives.append(f"--gpus-per-node={cluster.gpus_per_node}")
    for key in ("partition", "account", "time", "mem"):
        if getattr(sl, key):
            directives.append(f"--{key}={getattr(sl, key)}")
    directives += ["--requeue", f"--signal=USR1@{la.grace_s}", "--open-mode=append",
                   f"--output={log_dir}/%x-%j.out", *sl.sbatch]

    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # a separate store: restarts are reliable on gloo (field notes)
    if sl.cpus_per_task:
        env["OMP_NUM_THREADS"] = str(max(1, sl.cpus_per_task // job.nproc_per_node))
    if la.nccl_socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = la.nccl_socket_ifname
    if la.gloo_socket_ifname:
        env["GLOO_SOCKET_IFNAME"] = la.gloo_socket_ifname
    env.update(la.env)

    agent = [shlex.quote(a) for a in agent_argv(la, job.nproc_per_node, "HEAD", "ID", job.ft)]
    if job.ft:  # one replica group per node: its rendezvous on its own node
        agent = [a.replace("=HEAD", '="$NODE:$RDZV_PORT"').replace("=ID", '="syncwise-$SLURM_JOB_ID-r$r"')
                 for a in agent]
    else:
        agent = [a.replace("=HEAD", '="$HEAD_NODE:$RDZV_PORT"').replace("=ID", '="syncwise-$SLURM_JOB_ID"')
                 for a in agent]
    worker = [shlex.quote(a) if not a.startswith(run_dir) else a.replace(run_dir, '"$RUN_DIR"')
              for a in worker_argv(run_dir)]
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        f"# {job.name}: syncwise training job for Slurm, written by `syncwise launch slurm` (syncwise {__version__}).",
        f"# {cluster.cloud.describe()} (cluster file {cluster.source})",  # its name first: no "cluster: cluster:"
        f"# run configuration: {job.source or 'RUN.toml'}, validated, embedded below as $RUN_DIR/run.toml",
        f"# {la.min_nodes}-{la.max_nodes} node(s) x {job.nproc_per_node} worker(s); elastic restarts: {la.max_restarts}; "
        f"grace on preemption: {la.grace_s} s" + (f"; live recovery: {job.ft.replicas} replica groups (one per node), "
                                                   f"min {job.ft.min_replicas}" if job.ft else ""),
        "# Submit: sbatch THIS_FILE   (or syncwise launch slurm ... --submit)",
        *[f"#SBATCH {d}" for d in directives],
        "",
        "set -uo pipefail",
        f"RUN_DIR={q(run_dir)}",
        f"RDZV_PORT=$(( {la.rdzv_port} + SLURM_JOB_ID % 1000 ))  # jobs sharing a node never share a port",
        f'mkdir -p "$RUN_DIR" {q(log_dir)}',
        "# The validated run configuration (the same on every start; the workers read it from the shared path).",
        f"cat > \"$RUN_DIR/run.toml\" <<'{_HEREDOC}'",
        job.run_toml.rstrip("\n"),
        _HEREDOC,
        f'rm -f "$RUN_DIR/{MARKER}"  # written by the workers when they stop for a signal (read below)',
        "",
        *[f"export {k}={q(v)}" for k, v in env.items()],
        *sl.setup,
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'echo "syncwise: job $SLURM_JOB_ID (start ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NUM_NODES node(s): '
        'rendezvous at $HEAD_NODE:$RDZV_PORT, run directory $RUN_DIR"',
        "",
        *(_live_recovery_lines(cluster, job, agent, worker) if job.ft else [
            "# One torchrun agent per node; each starts the node's workers and restarts the group after a failure.",
            "srun --ntasks-per-node=1 --kill-on-bad-exit=0 \\",
            "    " + " ".join(agent) + " \\",
            "    " + " ".join(worker),
            "code=$?"]),
        f'if [ -f "$RUN_DIR/{MARKER}" ]; then',
        f"    # The workers stopped for SIGUSR1/SIGTERM and saved (exit {EXIT_PREEMPTED}; {EXIT_GRACE_EXPIRED}: the grace ran out",
        "    # first and the newest checkpoint is older): come back and resume. After scancel/scontrol requeue/preemption",
        "    # Slurm ends or requeues the job itself and this line may not run.",
        f'    echo "syncwise: preempted: $(tr -d \'\\n \' < "$RUN_DIR/{MARKER}"); requeueing job $SLURM_JOB_ID"',
        '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
        "fi",
        "exit $code",
    ]
    return "\n".join(lines) + "\n"


def _live_recovery_lines(cluster: ClusterLaunch, job: JobSpec, agent: list[str], worker: list[str]) -> list[str]:
    """The job steps of a live-recovery job: the lighthouse, one replica group per node (relaunched when its step
    fails), then the merged metrics. Sets ``code`` as the plain job's srun line does."""
    la, ft = cluster.launch, job.ft
    q = shlex.quote
    env = ft.replica_env("$r", "http://$HEAD_NODE:$LIGHTHOUSE_PORT", "$RUN_DIR/ft/status")
    env.pop(live_env.REPLICA)  # per replica group, on its srun line
    exports = [f'export {k}="{v}"' if "$" in v else f"export {k}={q(v)}" for k, v in env.items()]
    merge = ("import sys; from syncwise.launch.ft import merge_metrics; s = merge_metrics(sys.argv[1], "
             "int(sys.argv[2])); sys.exit(0 if s.get('steps', 0) >= int(sys.argv[2]) else 1)")
    return [
        "# Live recovery: torchft's lighthouse, then one replica group per node (docs/live-recovery.md).",
        f"LIGHTHOUSE_PORT=$(( RDZV_PORT + {LIGHTHOUSE_PORT_OFFSET} ))",
        *exports,
        "# The job's secret (owner-only, in the shared run directory): the replicas sign their heal transfers with it",
        f'export {ENV_SECRET_FILE}="$({q(la.python)} -m syncwise.secret "$RUN_DIR")" || exit 1',
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        "# A requeued job's attempts are numbered after the earlier ones (RUN_DIR/ft/replicaR.A), as syncwise train's.",
        'LAST=$(ls -d "$RUN_DIR"/ft/replica*.* 2>/dev/null | sed "s/.*\\.//" | grep -E "^[0-9]+$" | sort -n | tail -n 1)',
        'FIRST=$(( ${LAST:--1} + 1 )); rm -rf "$RUN_DIR/ft/status"',
        "# The quorum server: a step of its own on the first node, beside replica 0 (it keeps only soft state: the",
        "# replicas' heartbeats; if it dies the replicas cannot form a quorum until it is back).",
        'srun --nodes=1 --ntasks=1 --overlap -w "$HEAD_NODE" --kill-on-bad-exit=0 \\',
        # (it listens on the head node's own address, bind.py's rule applied there; not every interface)
        f"    {q(la.python)} -m syncwise.bind --nodes {ft.replicas} --port \"$LIGHTHOUSE_PORT\" -- "
        + " ".join(q(a) for a in ft.lighthouse_args) + " &",
        "LIGHTHOUSE=$!",
        "replica() {  # replica group $1 on its node: a job step; relaunched when the step itself fails",
        '    local r=$1 attempt=0 rc NODE="${NODES[$1]}"',
        "    while :; do",
        # each relaunch's attempts get run directories of their own (its torchrun counts restarts from 0 again)
        f'        {live_env.REPLICA}=$r {live_env.FIRST_ATTEMPT}=$(( FIRST + attempt * {ft.replica_restarts + 1} )) \\',
        '            srun --nodes=1 --ntasks=1 -w "$NODE" --kill-on-bad-exit=0 \\',
        "            " + " ".join(agent) + " \\",
        "            " + " ".join(worker),
        "        rc=$?",
        f'        if [ "$rc" -eq 0 ] || [ -f "$RUN_DIR/{MARKER}" ] || [ "$attempt" -ge {la.max_restarts} ]; then return "$rc"; fi',
        "        attempt=$(( attempt + 1 ))",
        f'        echo "syncwise: replica $r (node $NODE) ended with exit code $rc; relaunching it ($attempt/{la.max_restarts})"',
        "    done",
        "}",
        "PIDS=()",
        f'for r in $(seq 0 {ft.replicas - 1}); do replica "$r" & PIDS+=($!); done',
        'for p in "${PIDS[@]}"; do wait "$p"; done',
        'kill "$LIGHTHOUSE" 2>/dev/null; wait "$LIGHTHOUSE" 2>/dev/null',
        "# One row per step from the replica groups' own files; fails if no replica reached the last step.",
        f'{q(la.python)} -c {q(merge)} "$RUN_DIR" {ft.steps}',
        "code=$?",
    ]
