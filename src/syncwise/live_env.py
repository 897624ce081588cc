"""Live recovery's environment protocol: what a launcher puts in a replica group's environment and its workers
read (``syncwise.train.live_recovery.LiveRecovery.from_env``). One owner for the names: the local and lab
launchers (``launch/ft.py``, ``launch/ft_lab.py``), the Slurm and Kubernetes generators (``launch/spec.py``,
``slurm.py``, ``kubernetes.py``) and the worker import them from here (docs/live-recovery.md).
"""
from __future__ import annotations

REPLICA = "SYNCWISE_FT_REPLICA"                # this replica group's index, 0 .. replicas-1
REPLICAS = "SYNCWISE_FT_REPLICAS"              # the configured replica groups
LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"              # torchft's own variable: the lighthouse's http://HOST:PORT
MIN_REPLICAS = "SYNCWISE_FT_MIN_REPLICAS"
QUORUM_TIMEOUT_S = "SYNCWISE_FT_QUORUM_TIMEOUT_S"
TIMEOUT_S = "SYNCWISE_FT_TIMEOUT_S"
STATUS_DIR = "SYNCWISE_FT_STATUS_DIR"          # where each replica group records its last step (lost-replica names)
# a relaunched replica group's first attempt number (its torchrun counts restarts from 0 again); the attempt's run
# directory is RUN_DIR/ft/replica{R}.{FIRST_ATTEMPT + TORCHELASTIC_RESTART_COUNT}
FIRST_ATTEMPT = "SYNCWISE_FT_FIRST_ATTEMPT"
# the host name peers reach this replica's manager and heal server at (the network lab names each node's namespace)
HOST = "SYNCWISE_FT_HOST"

#: every variable of the protocol starts with one of these (what a cluster file copies into a replica's environment)
PREFIXES = ("SYNCWISE_FT_", "TORCHFT_")


def replica_vars(replica: object, replicas: int, lighthouse: str, min_replicas: int, quorum_timeout_s: float,
                 timeout_s: float, status_dir: str) -> dict[str, str]:
    """The protocol's variables for replica group ``replica`` (a number, or a shell/Kubernetes reference such as
    ``$r``)."""
    return {REPLICA: str(replica), REPLICAS: str(replicas), LIGHTHOUSE: lighthouse, MIN_REPLICAS: str(min_replicas),
            QUORUM_TIMEOUT_S: str(quorum_timeout_s), TIMEOUT_S: str(timeout_s), STATUS_DIR: status_dir}
