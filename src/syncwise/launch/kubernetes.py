"""Kubernetes manifests of a syncwise job: a JobSet (jobset.x-k8s.io/v1alpha2), its checkpoint PVC, the
rendezvous Service and the run's ConfigMap.

Why JobSet (docs/launch.md): it is the Kubernetes SIG's API for multi-node training (Kubeflow Trainer v2 builds
its TrainJob on it), needs no training runtime installed besides its controller, and is made of a plain batch/v1
Job — so the Job's own ``podFailurePolicy`` can say what a preemption is: a pod evicted or preempted (condition
``DisruptionTarget``) or one whose workers stopped and saved (exit code 83/84, ``syncwise.launch.agent``) is
replaced without counting as a failure, and the replacement resumes (``--resume auto``). Real failures fail the
Job (``backoffLimit: 0``) and the JobSet restarts all of it, ``launch.max_restarts`` times
(``failurePolicy.maxRestarts``). Inside a pod, torchrun's agent restarts the worker group on its own
(``--max-restarts``), elastic between ``min_nodes`` and ``max_nodes`` (``--nnodes MIN:MAX``).

The rendezvous: an Indexed Job gives pod ``i`` the hostname ``NAME-node-0-i``; the headless Service ``NAME-rdzv``
(the JobSet's network subdomain) makes ``NAME-node-0-0.NAME-rdzv`` resolve before the pods are ready, and pod 0's
agent hosts the c10d store there.

With live recovery (the run's ``[ft] replicas = R``, docs/live-recovery.md) the JobSet's replicated job
``replica`` has R Jobs of one pod each — one replica group per node, its own rendezvous on its own pod
(``NAME-replica-K-0.NAME-rdzv``), its index ``K`` from the JobSet's ``job-index`` annotation — and torchft's lighthouse
(the quorum server) is a Deployment with a Service, ``NAME-lighthouse``, that every worker reaches through
``TORCHFT_LIGHTHOUSE``. What restarts a replacement: inside the pod torchrun (``--max-restarts =
ft.replica_restarts``) restarts a failed worker; a lost pod is replaced by its Job (``backoffLimit =
launch.max_restarts``); a Job that fails for good is recreated alone (the JobSet's ``RestartJob`` rule), never the
other replicas, which train on; each replacement heals from a live peer. The Deployment restarts a lost lighthouse
(it keeps only soft state: the replicas re-register by their heartbeats; while it is down no quorum forms).
"""
from __future__ import annotations

import json
import re
import secrets
from typing import Any

from .. import __version__, live_env
from ..secret import ENV_SECRET_FILE
from ..train.preemption import EXIT_GRACE_EXPIRED, EXIT_PREEMPTED
from .spec import LIGHTHOUSE_PORT_OFFSET, ClusterLaunch, JobSpec, agent_argv, worker_argv

SCHEMA_FILE = "jobset.x-k8s.io_v1alpha2.json"
CONFIG_MOUNT = "/etc/syncwise"
SECRET_PATH = "/var/run/syncwise/job.secret"  # live recovery: the per-job secret, mounted from the job's Secret
CONTAINER = "trainer"
REPLICATED_JOB = "node"
REPLICA_JOB = "replica"  # live recovery: one Job (one pod) per replica group
JOB_INDEX = "jobset.sigs.k8s.io/job-index"  # the annotation JobSet puts on a child Job's pods: the replica's index


def manifests(cluster: ClusterLaunch, job: JobSpec) -> list[dict[str, Any]]:
    """ConfigMap, PersistentVolumeClaim, Service and JobSet (in the order ``kubectl apply`` should create them); with
    live recovery also the job's Secret (a fresh random token: the file holding these manifests is then written
    owner-only), the lighthouse's Service and Deployment."""
    la, k = cluster.launch, cluster.kubernetes
    name, ns = job.name, k.namespace
    labels = {"app.kubernetes.io/name": "syncwise", "app.kubernetes.io/instance": name,
              "app.kubernetes.io/managed-by": "syncwise-launch"}
    meta = lambda n: {"name": n, "namespace": ns, "labels": dict(labels)}  # noqa: E731
    run_dir = job.run_dir(la.shared_dir)
    service = f"{name}-rdzv"
    head = f"{name}-{REPLICATED_JOB}-0-0.{service}"

    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(f"{name}-config"),
                  "data": {"run.toml": job.run_toml}}
    pvc_spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": k.storage}}}
    if k.storage_class:
        pvc_spec["storageClassName"] = k.storage_class
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta(f"{name}-ckpt"), "spec": pvc_spec}
    rdzv = {"apiVersion": "v1", "kind": "Service", "metadata": meta(service),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {"jobset.sigs.k8s.io/jobset-name": name},
                     "ports": [{"name": "c10d", "port": la.rdzv_port, "targetPort": la.rdzv_port,
                                "protocol": "TCP"}]}}

    ft = job.ft
    rjob = REPLICA_JOB if ft else REPLICATED_JOB
    if ft:  # each replica group's rendezvous on its own pod ($(VAR): Kubernetes expands the container's env)
        head = f"{name}-{rjob}-$({live_env.REPLICA})-0.{service}"
    command = agent_argv(la, job.nproc_per_node, f"{head}:{la.rdzv_port}",
                         f"{name}-r$({live_env.REPLICA})" if ft else name, ft) + worker_argv(run_dir)
    command[command.index("--config") + 1] = f"{CONFIG_MOUNT}/run.toml"  # the ConfigMap, not the shared path
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
    lighthouse = f"{name}-lighthouse"
    lighthouse_port = la.rdzv_port + LIGHTHOUSE_PORT_OFFSET
    if ft:
        ft_env = ft.replica_env("", f"http://{lighthouse}:{lighthouse_port}", f"{run_dir}/ft/status")
        ft_env.pop(live_env.REPLICA)  # from the pod's job-index annotation (below)
        env.update(ft_env)
        env[ENV_SECRET_FILE] = SECRET_PATH  # heal transfers signed with it (docs/security.md)
    if la.nccl_socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = la.nccl_socket_ifname
    if la.gloo_socket_ifname:
        env["GLOO_SOCKET_IFNAME"] = la.gloo_socket_ifname
    env.update(la.env)
    resources: dict[str, dict[str, Any]] = {"limits": {}, "requests": {}}
    if cluster.gpus_per_node:
        resources["limits"][k.gpu_resource] = cluster.gpus_per_node
        resources["requests"][k.gpu_resource] = cluster.gpus_per_node
    for key in ("cpu", "memory"):
        if getattr(k, key):
            resources["limits"][key] = resources["requests"][key] = getattr(k, key)
    container = {
        "name": CONTAINER, "image": k.image, "command": command,
        "env": ([{"name": live_env.REPLICA, "valueFrom": {"fieldRef": {
                    "fieldPath": f"metadata.annotations['{JOB_INDEX}']"}}}] if ft else [])
        + [{"name": n, "value": v} for n, v in env.items()],
        "ports": [{"name": "c10d", "containerPort": la.rdzv_port, "protocol": "TCP"}],
        "resources": {key: value for key, value in resources.items() if value},
        "volumeMounts": [{"name": "shared", "mountPath": la.shared_dir},
                         {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod = {"metadata": {"labels": dict(labels)},
           "spec": {"restartPolicy": "Never",  # podFailurePolicy needs it; torchrun restarts workers in the pod
                    "terminationGracePeriodSeconds": la.grace_s,
                    "containers": [container],
                    "volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": f"{name}-ckpt"}},
                                {"name": "config", "configMap": {"name": f"{name}-config"}},
                                {"name": "dshm", "emptyDir": {"medium": "Memory"}}]}}
    secret = None
    if ft:  # the per-job secret (syncwise.secret): a Secret of its own, mounted as a file only its owner may read
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": meta(f"{name}-secret"), "type": "Opaque",
                  "stringData": {"job.secret": secrets.token_hex(32)}}
        # subPath: the file itself (a plain secret volume shows a symlink, which the secret's check refuses)
        container["volumeMounts"].append({"name": "secret", "mountPath": SECRET_PATH, "subPath": "job.secret",
                                          "readOnly": True})
        pod["spec"]["volumes"].append({"name": "secret", "secret": {"secretName": f"{name}-secret",
                                                                    "defaultMode": 0o400}})
    pods = 1 if ft else la.max_nodes
    job_spec = {
        "parallelism": pods, "completions": pods, "completionMode": "Indexed",
        # a real failure fails the Job; the JobSet then restarts everything (failurePolicy). Live recovery: a lost
        # pod is replaced (a replacement replica group, which heals from a live peer) up to max_restarts times
        "backoffLimit": la.max_restarts if ft else 0,
        "podFailurePolicy": {"rules": [
            # evicted, preempted, node drained: not the job's fault; a replacement pod resumes
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            # the workers stopped on SIGTERM and saved (83), or the grace ran out (84): resume, don't count it
            {"action": "Ignore", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                 "values": [EXIT_PREEMPTED, EXIT_GRACE_EXPIRED]}},
        ]},
        "template": pod,
    }
    jobset = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
              "metadata": {**meta(name), "annotations": {"syncwise/version": __version__,
                                                         "syncwise/cluster": cluster.cloud.describe()[:200]}},
              "spec": {"network": {"enableDNSHostnames": True, "subdomain": service, "publishNotReadyAddresses": True},
                       "failurePolicy": {"maxRestarts": la.max_restarts},
                       "replicatedJobs": [{"name": rjob, "replicas": ft.replicas if ft else 1,
                                           "template": {"metadata": {"labels": dict(labels)}, "spec": job_spec}}]}}
    if not ft:
        return [config_map, pvc, rdzv, jobset]
    # A replica group that failed for good is recreated alone; the others train on (live recovery).
    jobset["spec"]["failurePolicy"]["rules"] = [{"name": "replace-lost-replica", "action": "RestartJob",
                                                 "targetReplicatedJobs": [REPLICA_JOB]}]
    lh_labels = {**labels, "app.kubernetes.io/component": "lighthouse"}
    lh_service = {"apiVersion": "v1", "kind": "Service", "metadata": meta(lighthouse),
                  "spec": {"selector": dict(lh_labels), "ports": [{"name": "lighthouse", "port": lighthouse_port,
                                                                   "targetPort": lighthouse_port, "protocol": "TCP"}]}}
    lh_container = {"name": "lighthouse", "image": k.image,
                    # listens on the pod's own address (bind.py's rule, on the pod), not every interface
                    "command": [la.python, "-m", "syncwise.bind", "--nodes", str(ft.replicas), "--port",
                                str(lighthouse_port), "--", *ft.lighthouse_args],
                    "env": [{"name": "RUST_LOG", "value": "warn"}],
                    "ports": [{"name": "lighthouse", "containerPort": lighthouse_port, "protocol": "TCP"}],
                    "readinessProbe": {"tcpSocket": {"port": lighthouse_port}, "periodSeconds": 2}}
    lh_deploy = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(lighthouse),
                 "spec": {"replicas": 1, "selector": {"matchLabels": dict(lh_labels)},
                          "strategy": {"type": "Recreate"},  # never two lighthouses with split quorums
                          "template": {"metadata": {"labels": dict(lh_labels)},
                                       "spec": {"restartPolicy": "Always", "containers": [lh_container]}}}}
    return [config_map, secret, pvc, rdzv, lh_service, lh_deploy, jobset]


def jobset_schema() -> dict[str, Any]:
    """The JobSet CRD's ``openAPIV3Schema`` (jobset.x-k8s.io/v1alpha2, release v0.12.0), shipped with syncwise:
    ``{"source": ..., "release": ..., "openAPIV3Schema": {...}}`` (schemas/README.md says how it was made)."""
    from importlib import resources

    return json.loads(resources.files("syncwise.launch").joinpath("schemas", SCHEMA_FILE).read_text())


# ------------------------------------------------------------------------------------------------ YAML out
_PLAIN = re.compile(r"^[A-Za-z_/][A-Za-z0-9_./-]*$")
_RESERVED = {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"}


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v)
    return s if _PLAIN.match(s) and s.lower() not in _RESERVED else json.dumps(s, ensure_ascii=False)  # JSON strings are YAML


def _emit(v: Any, indent: int, out: list[str]) -> None:
    pad = " " * indent
    if isinstance(v, dict):
        for key, value in v.items():
            k = _scalar(key)
            if isinstance(value, (dict, list)) and value:
                out.append(f"{pad}{k}:")
                _emit(value, indent + 2, out)
            elif isinstance(value, str) and "\n" in value:
                out.append(f"{pad}{k}: |" + ("-" if not value.endswith("\n") else ""))
                out.extend(f"{pad}  {line}" if line else "" for line in value.rstrip("\n").split("\n"))
            else:
                out.append(f"{pad}{k}: {_scalar(value) if not isinstance(value, (dict, list)) else '{}' if isinstance(value, dict) else '[]'}")
    elif isinstance(v, list):
        for item in v:
            if isinstance(item, dict) and item:
                sub: list[str] = []
                _emit(item, indent + 2, sub)
                out.append(f"{pad}- {sub[0].lstrip()}")
                out.extend(sub[1:])
            elif isinstance(item, list) and item:
                out.append(f"{pad}-")
                _emit(item, indent + 2, out)
            else:
                out.append(f"{pad}- {_scalar(item)}")
    else:
        out.append(f"{pad}{_scalar(v)}")


def to_yaml(documents: list[dict[str, Any]]) -> str:
    """Multi-document YAML (``kubectl apply -f`` reads it); strings quoted where YAML could misread them."""
    parts = []
    for doc in documents:
        lines: list[str] = []
        _emit(doc, 0, lines)
        parts.append("\n".join(lines))
    header = f"# syncwise {__version__}: written by `syncwise launch k8s`; apply with kubectl apply -f THIS_FILE\n"
    return header + "---\n" + "\n---\n".join(parts) + "\n"
