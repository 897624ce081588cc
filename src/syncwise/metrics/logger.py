"""Per-step metrics: JSONL file, live rich progress bar, TensorBoard events, final summary table."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from ..errors import SyncwiseError
from ..rundir import RunDir
from ..schema import LOG_INTERVAL


def read_jsonl(path: str | Path, damaged: Optional[list[tuple[int, str]]] = None) -> list[dict[str, Any]]:
    """Every valid row of a metrics.jsonl. A damaged line (a torn last line from a crash, a line cut or edited
    anywhere) is skipped, never the rows after it; ``damaged`` collects them as (line number, text)."""
    rows = []
    p = Path(path)
    if not p.exists():
        return rows
    for number, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif damaged is not None:
            damaged.append((number, line))
    return rows


QUARANTINE_SUFFIX = ".damaged"  # metrics.jsonl.damaged: the lines a repair could not read, kept as they were


def truncate_jsonl(path: str | Path, last_step: int) -> int:
    """Keep only rows with ``step <= last_step`` (a resumed run re-logs the steps it redoes); returns rows kept.
    A damaged line is moved to ``metrics.jsonl.damaged`` (appended, with its line number) with a warning; every
    valid row around it is kept."""
    p = Path(path)
    damaged: list[tuple[int, str]] = []
    rows = [r for r in read_jsonl(p, damaged) if _step(r) <= last_step]
    if damaged:
        aside = p.with_name(p.name + QUARANTINE_SUFFIX)
        with open(aside, "a") as f:
            f.writelines(f"{number}\t{line}\n" for number, line in damaged)
        where = ", ".join(str(n) for n, _ in damaged[:5]) + (" ..." if len(damaged) > 5 else "")
        print(f"syncwise: {p}: {len(damaged)} damaged line(s) (line {where}) moved to {aside}; every valid row is "
              "kept", file=sys.stderr, flush=True)
    tmp = p.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, p)
    return len(rows)


def _step(row: dict[str, Any]) -> float:
    try:
        return float(row.get("step", 0))
    except (TypeError, ValueError):
        return float("inf")  # (a row whose step is not a number: not kept as an earlier step's)


class MetricsLogger:
    """Writes one JSON object per optimizer step and shows progress; a no-op on ranks other than 0."""

    def __init__(self, run_dir: str | Path | None, total_steps: int, enabled: bool = True, start_step: int = 0,
                 tensorboard: bool = True, console: Optional[Console] = None, show: bool = True,
                 log_interval: int = LOG_INTERVAL.default):
        # Files whenever enabled (rank 0) with a run directory; progress, notes and the summary table also need
        # ``show`` (OptimizedTrainer's show_progress=False keeps the files and silences the console).
        self.enabled = enabled
        self.show = show
        self.log_interval = max(1, int(log_interval))
        self._first_step = start_step + 1  # plain output prints it at once: the run is seen to be going
        self.total_steps = total_steps
        self.console = console or Console(stderr=False)
        self._progress: Optional[Progress] = None
        self._tb = None
        self._file = None
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.path: Optional[Path] = None
        if not self.enabled:
            return
        if self.run_dir is not None:
            self._open_files(start_step, tensorboard)
        if not show:
            return
        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=self.console,
            disable=not self.console.is_terminal and not os.environ.get("SYNCWISE_FORCE_PROGRESS"),
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
        self._progress.start()
        self._plain = not self.console.is_terminal

    def _write_failed(self, what: str, e: OSError) -> SyncwiseError:
        """One paragraph for a run-directory write that failed (a full disk, a quota, a lost mount): the files are
        closed quietly first, so nothing else raises over it (TensorBoard's writer thread included)."""
        from ..checkpoint.storage import disk_full_hint

        tb, self._tb = self._tb, None
        file, self._file = self._file, None
        for closing in (getattr(file, "close", None), getattr(tb, "close", None)):
            try:
                if closing is not None:
                    closing()
            except Exception:  # noqa: BLE001 — the same disk: its error is the one reported below
                pass
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        return SyncwiseError(
            f"writing {what} under the run directory {self.run_dir} failed: {e.strerror or e}"
            f"{disk_full_hint(self.run_dir)}. The rows and checkpoints written before are kept; free space under "
            f"{self.run_dir} (or point --run-dir elsewhere) and continue with --resume auto.")

    def _open_files(self, start_step: int, tensorboard: bool) -> None:
        try:
            self._open(start_step, tensorboard)
        except OSError as e:
            raise self._write_failed(RunDir.METRICS, e) from None

    def _open(self, start_step: int, tensorboard: bool) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = RunDir(self.run_dir).metrics
        if start_step == 0 and self.path.exists():
            self.path.unlink()  # a fresh run in this directory: the old run's rows do not belong to it
        elif self.path.exists():
            truncate_jsonl(self.path, start_step)
        self._file = open(self.path, "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tb"))
                _quiet_writer_thread()
            except OSError:
                raise
            except Exception:  # tensorboard not installed: JSONL is the record
                self._tb = None

    def log_step(self, row: dict[str, Any]) -> None:
        """Record one optimizer step's metrics; ``time`` (Unix seconds when the row is written) is added when the
        row has none, so a run's timeline (a failure's stall, a recovery) can be read from the file."""
        if not self.enabled:
            return
        what = RunDir.METRICS
        try:
            if self._file is not None:
                self._file.write(json.dumps(row if "time" in row else {**row, "time": round(time.time(), 4)}) + "\n")
            what = "TensorBoard's events (tb/)"
            if self._tb is not None:
                for k, v in row.items():
                    if isinstance(v, (int, float)) and k != "step" and v is not None:
                        self._tb.add_scalar(k, v, row["step"])
        except OSError as e:
            raise self._write_failed(what, e) from None
        # A non-finite loss whose step was not skipped: Pipe-SGD applies a step's gradient one step later, so the
        # update that carries it is skipped then (issue 23: this line raised a TypeError and ended the run).
        loss = ("skipped (non-finite)" if row.get("skipped") else "non-finite" if row.get("loss") is None
                else f"{row['loss']:.4f}")
        info = f"loss {loss}  {row['tokens_per_s']:,.0f} tok/s  {comm_line(row)}"
        if row.get("val_loss") is not None:
            info += f"  val {row['val_loss']:.4f}"
        if self._progress is None:
            return
        self._progress.update(self._task, completed=row["step"], info=info)
        step = row["step"]
        if self._plain and (step % self.log_interval == 0 or step in (self._first_step, self.total_steps)
                            or "val_loss" in row):
            print(f"step {row['step']:>6}/{self.total_steps}  {info}", file=sys.stdout, flush=True)

    def note(self, message: str) -> None:
        """A line for the user (e.g. 'resumed from step 40')."""
        if self.enabled and self.show:
            self.console.print(message)

    def finish(self, summary: dict[str, Any]) -> None:
        """Write summary.json and print the summary table."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        what = RunDir.METRICS
        try:
            if self._file is not None:
                self._file.close()
                self._file = None
                what = RunDir.SUMMARY
                RunDir(self.run_dir).summary.write_text(json.dumps(summary, indent=2) + "\n")
            what = "TensorBoard's events (tb/)"
            if self._tb is not None:
                self._tb.close()
                self._tb = None
        except OSError as e:
            raise self._write_failed(what, e) from None
        if not self.show:
            return
        table = Table(title="syncwise train — summary", show_header=False)
        table.add_column("metric", style="bold")
        table.add_column("value", justify="right")
        for k, v in summary.items():
            shown = summary_value(k, v)
            if shown is not None:
                table.add_row(k, shown)
        self.console.print(table)
        self.console.print(SUMMARY_LEGEND, highlight=False, markup=False)
        if self.path is not None:
            self.console.print(f"metrics: {self.path}")


def _quiet_writer_thread() -> None:
    """TensorBoard writes from a thread of its own; an OSError there (a full disk) is re-raised by its next write
    or close, where MetricsLogger turns it into one paragraph, but the thread also hands it to
    ``threading.excepthook``, which would print a raw traceback first. That one report is left out (once per
    process; every other thread's exceptions are printed as before)."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "_syncwise_tb", False):
        return

    def hook(args: Any) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread":
            return
        previous(args)

    hook._syncwise_tb = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def comm_line(row: dict[str, Any]) -> str:
    """The progress line's communication, in words that explain themselves (issue 43): the step's exposed ms (every
    dimension's), then per parallel dimension its exposed ms of its total ms and the bytes this rank sent —
    ``comm 12 ms exposed (tp 9 of 9 ms, 41 MB sent · dp 3 of 20 ms, 20 MB sent)``; a time that is not measured
    (an exposed share on a GPU, DDP's built-in all-reduce's total) shows as ``–``."""
    from .units import human_bytes

    parts = []
    for dim in ("dp", "fsdp", "tp", "pp", "ep"):
        sent, took = row.get(f"comm_bytes_{dim}"), row.get(f"comm_s_{dim}")
        if not sent and not took:  # absent, or a dimension of one rank (nothing sent)
            continue
        exposed = row.get(f"comm_exposed_s_{dim}")
        shown = "–" if exposed is None else f"{exposed * 1e3:.0f}"
        total = "–" if took is None else f"{took * 1e3:.0f}"
        parts.append(f"{dim} {shown} of {total} ms" + (f", {human_bytes(sent)} sent" if sent is not None else ""))
    measured = [row.get(f"comm_exposed_s_{d}") for d in ("dp", "fsdp", "tp", "pp", "ep")]
    total = sum(e for e in measured if e is not None) if parts else row["comm_exposed_s"]
    text = f"comm {total * 1e3:.0f} ms exposed"
    if parts and row.get("hop_bytes_cross") is not None:  # on nodes > 1: what of it crossed between nodes
        parts.append(f"{human_bytes(row['hop_bytes_cross'])} cross-node")
    return text + (f" ({' · '.join(parts)})" if parts else "")


#: the summary table's legend (issue 43): each figure's unit and scope, named once; docs/usage.md repeats it
SUMMARY_LEGEND = (
    "per rank = rank 0's own figure; per job = every rank's together. Rates and means are over the steady steps "
    "(the first tenth and a compressor's warm-up left out: metrics.figures).\n"
    "  tokens_per_s: the job's tokens per second (Σ tokens / Σ step time); mean_step_time_s: per step; "
    "train_time_s: the sum of the step times; wall_time_s: this invocation's wall clock (start-up, validation and "
    "checkpoints included).\n"
    "  *_share: of the mean step (per rank); comm_bytes_per_step[_<dim>]: bytes rank 0 sent per step; "
    "job_comm_bytes_per_step[_<dim>]: bytes every rank sent per step, summed (per job); comm_s_per_step_<dim>: "
    "seconds rank 0's collectives of that dimension took per step (dp: the whole gradient sync, codec included); "
    "peak_mem_mb: rank 0's peak memory.\n"
    "  hop_bytes_per_step_cross / _intra: the same bytes of rank 0 that crossed between nodes / stayed inside one "
    "(comm_hops: the topology; one node or an unknown one is said, not split); \"× fewer bytes\" than fp32 DDP is "
    "formed on the cross-node hop.\n"
    "  progress line: `comm 12 ms exposed (dp 3 of 20 ms, 20 MB sent)` = the step waited 12 ms on the network; "
    "of dp's 20 ms, 3 were exposed; rank 0 sent 20 MB; – = not measured.")


def summary_value(key: str, v: Any) -> Optional[str]:
    """How the summary table shows one value, or None to leave the row out (nothing to say: None, [])."""
    from .units import human_bytes, human_seconds, loss

    if v is None or v == [] or v == {}:
        return None
    for dim in ("_dp", "_fsdp", "_tp", "_pp", "_ep"):  # per-dimension keys read as their total's
        if key.startswith("comm_") and key.endswith(dim):
            key = key[:-len(dim)]
            key = "comm_s" if key == "comm_s_per_step" else key
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, list) and isinstance(v[0], dict):
        return f"{len(v)} (details in summary.json)"  # e.g. one record per checkpoint save
    if isinstance(v, dict):
        if key == "preempted":  # its record: the signal, the step, the checkpoint (and a Unix time, not shown)
            return f"{v.get('signal')} after step {v.get('step')}" + (", saved" if v.get("saved") else "")
        return "details in summary.json"
    if isinstance(v, list):
        return ", ".join(str(x) for x in v[:10]) + (f" ... ({len(v)})" if len(v) > 10 else "")
    if isinstance(v, (int, float)):
        if "bytes" in key:
            return human_bytes(v)
        if "loss" in key:
            return loss(v)
        if key.endswith("_share"):
            return f"{100 * v:.1f}%"
        if key.endswith("_per_s"):
            return f"{v:,.0f}"
        if key.endswith("_s"):
            return human_seconds(v)
        if key.endswith("_mb"):
            return human_bytes(v * 1e6)
        if isinstance(v, float):
            return f"{v:,.4g}" if abs(v) < 1e6 else f"{v:,.0f}"
        return f"{v:,}"
    return str(v)
