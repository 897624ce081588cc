"""Live metric sinks: every row the trainer writes to metrics.jsonl, also served to Prometheus or logged to W&B.

A sink has ``log_step(row)`` and ``close()``. The trainer calls every sink in ``OptimizedTrainer.metric_sinks``
with each step's row, which is the same dict that goes to metrics.jsonl. ``open_sinks(cfg, ...)`` builds the
sinks that the ``[metrics]`` section asks for. ``prometheus_client`` and ``wandb`` are imported only when a
sink that needs them is configured.

Prometheus: one endpoint per node, served by the node's local rank 0 and showing that rank's rows. Every numeric
field of the row is a gauge ``syncwise_<field>`` (``syncwise_loss``, ``syncwise_step``, ``syncwise_tokens_per_s``,
``syncwise_compute_s``, ``syncwise_comm_exposed_s``, ``syncwise_data_wait_s``, ``syncwise_mfu``,
``syncwise_comm_bytes`` ...). These gauges are added:
``syncwise_sent_bytes_total`` (a counter: comm_bytes summed over the steps this process logged), ``syncwise_checkpoint_age_s`` (seconds since the newest checkpoint
finished, or since the process started when there is none yet) and ``syncwise_restarts`` (torchrun's restart
count). Labels: ``rank``, ``node``. A scrape reads one row as a whole, never half of one step and half of the next.
"""
from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Protocol

from ..errors import ConfigError, SyncwiseError


class MetricSink(Protocol):
    def log_step(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _numeric(row: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}


def _require(module: str, package: str, field: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise SyncwiseError(f"{field} needs {package}: pip install {package}") from None


class CheckpointClock:
    """Seconds since the newest checkpoint finished: watches ``checkpointer.history`` and, at the start, the
    newest published checkpoint in its directory (a resumed run's age goes on from the run it resumes)."""

    def __init__(self, checkpointer: Any = None):
        self.checkpointer = checkpointer
        self._seen = len(checkpointer.history) if checkpointer is not None else 0
        self._last = time.time()
        directory = getattr(checkpointer, "directory", None)
        if directory is not None and Path(directory).is_dir():
            mtimes = [p.stat().st_mtime for p in Path(directory).glob("step_*")]
            if mtimes:
                self._last = max(mtimes)

    def age_s(self) -> float:
        if self.checkpointer is not None and len(self.checkpointer.history) > self._seen:
            self._seen = len(self.checkpointer.history)
            self._last = time.time()
        return max(0.0, time.time() - self._last)


class PrometheusSink:
    """Serve the latest row at ``http://addr:port/metrics`` (one HTTP thread; ``close()`` stops it)."""

    def __init__(self, port: int, rank: int = 0, node: int = 0, addr: str = "127.0.0.1", checkpointer: Any = None):
        prom = _require("prometheus_client", "prometheus_client", "metrics.prometheus_port")
        self.rank, self.node = str(rank), str(node)
        self.clock = CheckpointClock(checkpointer)
        self.restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self._row: dict[str, float] = {}
        self._bytes_total = 0.0
        self._lock = threading.Lock()
        self.registry = prom.CollectorRegistry()
        self.registry.register(self)
        try:
            served = prom.start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            raise ConfigError("metrics.prometheus_port", port, f"a free TCP port on {addr} on this node "
                              f"({e.strerror}; metrics.prometheus_bind chooses the address)") from None
        self._server = served[0] if isinstance(served, tuple) else None
        self.port = port

    def log_step(self, row: dict[str, Any]) -> None:
        values = _numeric(row)
        with self._lock:
            self._bytes_total += values.get("comm_bytes", 0.0)
            values["comm_bytes_total"] = self._bytes_total
            self._row = values  # one assignment: a scrape sees one whole row

    def collect(self) -> Iterable[Any]:
        """prometheus_client's collector protocol: the latest row as gauges."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            row = dict(self._row)
        labels = ["rank", "node"]
        values = [self.rank, self.node]
        extra = {"checkpoint_age_s": self.clock.age_s(), "restarts": float(self.restarts)}
        for key, value in {**row, **extra}.items():
            if key == "comm_bytes_total":
                family = CounterMetricFamily("syncwise_sent_bytes", "bytes this rank sent in collectives, all steps",
                                             labels=labels)
            else:
                family = GaugeMetricFamily(f"syncwise_{key}", f"metrics.jsonl field {key} (latest step)",
                                           labels=labels)
            family.add_metric(values, value)
            yield family

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class WandbSink:
    """Log each row to Weights & Biases (step = the row's step) with the resolved config; rank 0 only."""

    def __init__(self, project: str, config: dict[str, Any], run_dir: Optional[str] = None,
                 name: Optional[str] = None):
        wandb = _require("wandb", "wandb", "metrics.wandb")
        directory = run_dir or None
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, config=config, dir=directory, name=name,
                              resume="allow" if name else None, id=name)

    def log_step(self, row: dict[str, Any]) -> None:
        self.run.log(_numeric(row), step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


def open_sinks(cfg: Any, rank: int, checkpointer: Any = None) -> list[Any]:
    """The sinks ``cfg.metrics`` asks for on this process (Prometheus on each node's local rank 0, W&B on rank 0)."""
    sinks: list[Any] = []
    metrics = getattr(cfg, "metrics", None)
    if metrics is None:
        return sinks
    try:
        if metrics.prometheus_port and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            node = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")) or 0)
            sinks.append(PrometheusSink(metrics.prometheus_port, rank=rank, node=node, checkpointer=checkpointer,
                                        addr=getattr(metrics, "prometheus_bind", "127.0.0.1")))
        if metrics.wandb and rank == 0:
            name = None
            if cfg.run_dir:  # one W&B run per run directory: a resumed run (--resume auto) continues it
                import hashlib

                where = str(Path(cfg.run_dir).resolve())
                name = f"{Path(where).name}-{hashlib.sha1(where.encode()).hexdigest()[:8]}"
            sinks.append(WandbSink(metrics.wandb_project, cfg.to_dict(), cfg.run_dir or None, name=name))
    except BaseException:
        close_sinks(sinks)
        raise
    return sinks


def close_sinks(sinks: list[Any]) -> None:
    """Close every sink (errors in one do not keep the others open)."""
    for sink in sinks:
        try:
            sink.close()
        except Exception:
            pass
