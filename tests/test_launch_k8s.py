"""`syncwise launch k8s`: the manifests validate against the official schemas, and the elastic, restart and
preemption fields say what docs/launch.md says.

Core resources (ConfigMap, PersistentVolumeClaim, Service, and the JobSet's batch/v1 Job template) are checked
with ``kubernetes-validate`` (Kubernetes 1.37's OpenAPI schemas, strict: unknown fields refused); the JobSet with
``jsonschema`` against its CRD's openAPIV3Schema shipped in syncwise (release v0.12.0), unknown fields refused
wherever the CRD does not preserve them, as the API server's strict field validation does.
"""
import copy
import tomllib

import jsonschema
import kubernetes_validate
import pytest
import yaml

from syncwise.cli import main
from syncwise.launch.kubernetes import jobset_schema, to_yaml
from syncwise.train.preemption import EXIT_GRACE_EXPIRED, EXIT_PREEMPTED

K8S = "1.37.0"
CLUSTER = """nodes = 4
gpus_per_node = 8
[accelerator]
name = "h100-sxm"
[launch]
shared_dir = "/mnt/ckpt"
min_nodes = 2
max_nodes = 4
max_restarts = 3
grace_s = 180
rdzv_port = 29400
nccl_socket_ifname = "eth0"
env = { NCCL_DEBUG = "WARN" }
[kubernetes]
namespace = "training"
image = "ghcr.io/example/syncwise:0.1.0"
storage = "2Ti"
storage_class = "nfs-client"
cpu = "96"
memory = "1500Gi"
"""


def _strict(schema):
    """Refuse unknown fields wherever the CRD lists properties and does not preserve unknown ones."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and \
            not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


JOBSET = jsonschema.Draft7Validator(_strict(jobset_schema()["openAPIV3Schema"]))


def _generate(tmp_path, cluster=CLUSTER, name="llm-run", extra=""):
    (tmp_path / "c.toml").write_text(cluster)
    (tmp_path / "run.toml").write_text('[model]\npreset = "small"\n[train]\nsteps = 500\nmixed_precision = "bf16"\n'
                                       + extra)
    assert main(["launch", "k8s", "--cluster", str(tmp_path / "c.toml"), "--config", str(tmp_path / "run.toml"),
                 "--out", str(tmp_path / "out"), "--name", name]) == 0
    docs = list(yaml.safe_load_all((tmp_path / "out" / f"{name}.yaml").read_text()))
    return {d["kind"]: d for d in docs if d}


def _job_of(jobset):
    template = jobset["spec"]["replicatedJobs"][0]["template"]
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x", **template.get("metadata", {})},
            "spec": template["spec"]}


def _validate_all(docs):
    for kind in ("ConfigMap", "PersistentVolumeClaim", "Service"):
        kubernetes_validate.validate(docs[kind], K8S, strict=True)
    kubernetes_validate.validate(_job_of(docs["JobSet"]), K8S, strict=True)
    JOBSET.validate(docs["JobSet"])


def test_manifests_validate_against_the_official_schemas(tmp_path):
    docs = _generate(tmp_path)
    assert set(docs) == {"ConfigMap", "PersistentVolumeClaim", "Service", "JobSet"}
    assert docs["JobSet"]["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert jobset_schema()["release"] == "v0.12.0"
    _validate_all(docs)


def test_the_validation_refuses_broken_manifests(tmp_path):
    docs = _generate(tmp_path)
    broken = copy.deepcopy(docs["JobSet"])
    broken["spec"]["replicatedJobs"][0]["replicas"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        JOBSET.validate(broken)
    typo = copy.deepcopy(docs["JobSet"])
    typo["spec"]["failurePolicy"]["maxRestart"] = 3  # not a field: the API server would refuse it (strict)
    with pytest.raises(jsonschema.ValidationError):
        JOBSET.validate(typo)
    bad_rule = copy.deepcopy(docs["JobSet"])
    bad_rule["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"][0]["action"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(_job_of(bad_rule), K8S, strict=True)
    pvc = copy.deepcopy(docs["PersistentVolumeClaim"])
    pvc["spec"]["accesModes"] = pvc["spec"].pop("accessModes")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pvc, K8S, strict=True)


def test_elastic_restart_preemption_and_rendezvous_fields(tmp_path):
    docs = _generate(tmp_path)
    js, svc, pvc, cm = docs["JobSet"], docs["Service"], docs["PersistentVolumeClaim"], docs["ConfigMap"]
    rjob = js["spec"]["replicatedJobs"][0]
    job, pod = rjob["template"]["spec"], rjob["template"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = c["command"]
    # Elastic: torchrun between min and max nodes, one pod per node up to max, restarts inside and outside a pod.
    assert "--nnodes=2:4" in args and "--nproc-per-node=8" in args and "--max-restarts=3" in args
    assert job["parallelism"] == job["completions"] == 4 and job["completionMode"] == "Indexed"
    assert js["spec"]["failurePolicy"]["maxRestarts"] == 3 and job["backoffLimit"] == 0
    # Preemption: the grace, SIGUSR1 forwarded, and a stop-and-save (83/84) or an eviction is not a failure.
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] == 180
    assert "--shutdown-timeout=180" in args and any(a.startswith("--signals-to-handle=") and "SIGUSR1" in a for a in args)
    rules = job["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    codes = next(r["onExitCodes"] for r in rules if "onExitCodes" in r)
    assert codes["containerName"] == c["name"] and codes["values"] == [EXIT_PREEMPTED, EXIT_GRACE_EXPIRED]
    assert args[:3] == ["python3", "-m", "syncwise.launch.agent"]  # exits 83 when the workers saved
    run = tomllib.loads(cm["data"]["run.toml"])
    assert 0 < run["ckpt"]["preempt_grace_s"] < 180 and run["resume"] == "auto" and "--resume" in args
    # Rendezvous: pod 0's stable hostname in the headless Service that is the JobSet's subdomain.
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": svc["metadata"]["name"],
                                     "publishNotReadyAddresses": True}
    assert svc["spec"]["selector"] == {"jobset.sigs.k8s.io/jobset-name": js["metadata"]["name"]}
    endpoint = next(a.split("=", 1)[1] for a in args if a.startswith("--rdzv-endpoint="))
    assert endpoint == f"llm-run-{rjob['name']}-0-0.{svc['metadata']['name']}:29400"
    assert svc["spec"]["ports"][0]["port"] == c["ports"][0]["containerPort"] == 29400
    # Resources, the checkpoint volume at the shared path, the run's configuration from the ConfigMap.
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 8, "cpu": "96", "memory": "1500Gi"}
    assert c["resources"]["requests"] == c["resources"]["limits"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"]["storageClassName"] == "nfs-client"
    assert pvc["spec"]["resources"]["requests"]["storage"] == "2Ti"
    claims = {v["name"]: v for v in pod["volumes"]}
    assert claims["shared"]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["shared"] == "/mnt/ckpt" and args[args.index("--run-dir") + 1] == "/mnt/ckpt/runs/llm-run"
    assert args[args.index("--config") + 1] == f"{mounts['config']}/run.toml"
    assert {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"} in c["env"]
    assert all(d["metadata"]["namespace"] == "training" for d in docs.values())


def test_a_cpu_cluster_asks_for_no_gpus_and_still_validates(tmp_path):
    cpu = CLUSTER.replace('name = "h100-sxm"', 'name = "cpu-lab"').replace('cpu = "96"\n', "")
    docs = _generate(tmp_path, cpu, name="cpu-run")
    limits = docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "resources"]["limits"]
    assert "nvidia.com/gpu" not in limits
    _validate_all(docs)


def test_yaml_writer_round_trips_awkward_strings():
    docs = [{"a": "yes", "b": "1.0", "c": "x: y # z", "d": "", "e": ["-m", "*", "~"], "f": True, "g": 0,
             "h": "line one\n\n  indented\nlast\n", "i": {}, "j": [], "k": [{"x": [1, {"y": "null"}]}], "l": "é ×"}]
    assert list(yaml.safe_load_all(to_yaml(docs))) == docs


def test_live_recovery_manifests_lighthouse_replica_jobs_and_what_replaces_a_lost_replica(tmp_path):
    """[ft] replicas = 4 on 4 nodes: a lighthouse Deployment + Service, the JobSet's replicated job 'replica' with 4
    one-pod Jobs (the replica index from the job-index annotation, each its own rendezvous), a lost pod replaced by
    its Job, a failed Job recreated alone (RestartJob) — all valid against the schemas."""
    pytest.importorskip("torchft", reason="live recovery needs torchft (requirements-dev.txt)")
    cluster = CLUSTER.replace("min_nodes = 2", "min_nodes = 4")
    docs = _generate(tmp_path, cluster, name="ft-run", extra="[ft]\nreplicas = 4\nmin_replicas = 2\n"
                                                             "replica_restarts = 5\n")
    every = [d for d in yaml.safe_load_all((tmp_path / "out" / "ft-run.yaml").read_text()) if d]
    assert [d["kind"] for d in every] == ["ConfigMap", "Secret", "PersistentVolumeClaim", "Service", "Service",
                                          "Deployment", "JobSet"]
    for doc in every[:-1]:
        kubernetes_validate.validate(doc, K8S, strict=True)
    kubernetes_validate.validate(_job_of(docs["JobSet"]), K8S, strict=True)
    JOBSET.validate(docs["JobSet"])
    js, deploy, lh_svc = docs["JobSet"], docs["Deployment"], every[4]
    assert lh_svc["metadata"]["name"] == "ft-run-lighthouse" and every[3]["metadata"]["name"] == "ft-run-rdzv"
    # the per-job secret: a fresh token in a Secret, mounted as one owner-only file the replicas sign heals with;
    # the manifests holding it are written owner-only
    secret = every[1]
    assert secret["metadata"]["name"] == "ft-run-secret" and len(secret["stringData"]["job.secret"]) == 64
    assert (tmp_path / "out" / "ft-run.yaml").stat().st_mode & 0o077 == 0
    (rjob,) = js["spec"]["replicatedJobs"]
    job, pod = rjob["template"]["spec"], rjob["template"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = c["command"]
    assert rjob["name"] == "replica" and rjob["replicas"] == 4
    assert job["parallelism"] == job["completions"] == 1 and job["backoffLimit"] == 3  # launch.max_restarts
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 3, "rules": [
        {"name": "replace-lost-replica", "action": "RestartJob", "targetReplicatedJobs": ["replica"]}]}
    assert "--nnodes=1" in args and "--max-restarts=5" in args
    assert "--rdzv-endpoint=ft-run-replica-$(SYNCWISE_FT_REPLICA)-0.ft-run-rdzv:29400" in args
    assert "--rdzv-id=ft-run-r$(SYNCWISE_FT_REPLICA)" in args
    env = {e["name"]: e for e in c["env"]}
    assert env["SYNCWISE_FT_REPLICA"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['jobset.sigs.k8s.io/job-index']"
    assert list(env).index("SYNCWISE_FT_REPLICA") == 0  # defined before the command references it
    assert env["TORCHFT_LIGHTHOUSE"]["value"] == "http://ft-run-lighthouse:30400"
    assert env["SYNCWISE_SECRET_FILE"]["value"] == "/var/run/syncwise/job.secret"
    mount = next(m for m in c["volumeMounts"] if m["name"] == "secret")
    assert mount == {"name": "secret", "mountPath": "/var/run/syncwise/job.secret", "subPath": "job.secret",
                     "readOnly": True}
    volume = next(v for v in pod["volumes"] if v["name"] == "secret")
    assert volume["secret"] == {"secretName": "ft-run-secret", "defaultMode": 0o400}
    assert env["SYNCWISE_FT_REPLICAS"]["value"] == "4" and env["SYNCWISE_FT_MIN_REPLICAS"]["value"] == "2"
    (lh,) = deploy["spec"]["template"]["spec"]["containers"]
    # bound by bind.py's rule on the pod (its own address), never every interface (issue 42)
    bound = lh["command"].index("--")
    assert lh["command"][1:bound] == ["-m", "syncwise.bind", "--nodes", "4", "--port", "30400"]
    assert lh["command"][bound + 1:bound + 3] == ["torchft_lighthouse", "--min_replicas=2"]
    assert not any("[::]" in a or "0.0.0.0" in a for a in lh["command"])
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"] == {"type": "Recreate"}
    assert lh_svc["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    assert lh_svc["spec"]["ports"][0]["port"] == 30400
    run = tomllib.loads(docs["ConfigMap"]["data"]["run.toml"])
    assert run["ft"]["replicas"] == 4 and run["dist"]["nnodes"] == "1"
