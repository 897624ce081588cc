"""One launcher (DESIGN.md §3.1c, docs/architecture.md): checked on the source with ``ast`` (nothing runs).

- only the launch table, ``syncwise.launch.run``, asks the mechanisms that start workers (its rows: torchrun's
  elastic agent here, one agent per lab node, live recovery's replica groups here or in the lab), and only the
  table and those mechanisms start processes of their own (``subprocess.Popen``, ``elastic_launch``, spawn, ...);
  the few other modules that start a process, none of them a worker, are listed below with the reason;
- live recovery's environment protocol is spelled in one module, ``syncwise.live_env``: every other module names
  its variables through it (a string constant that is not a docstring may not hold ``SYNCWISE_FT_`` or
  ``TORCHFT_LIGHTHOUSE``).
"""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "syncwise"


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module(p): p for p in sorted(SRC.rglob("*.py"))}


def _trees():
    for name, path in MODULES.items():
        yield name, path, ast.parse(path.read_text(), str(path))


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def test_live_recovery_environment_names_have_one_owner():
    """... in syncwise and in the benchmarks that drive live recovery (benchmarks/live_recovery.py,
    torchft_diloco.py): they import the names too (text or bytes)."""
    found = []
    benchmarks = [(p.stem, p, ast.parse(p.read_text(), str(p)))
                  for p in sorted((SRC.parents[1] / "benchmarks").glob("*.py"))]
    for name, path, tree in [*_trees(), *benchmarks]:
        if name == "syncwise.live_env":
            continue
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            value = getattr(node, "value", None) if isinstance(node, ast.Constant) else None
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            if isinstance(text, str) and id(node) not in docs \
                    and ("SYNCWISE_FT_" in text or "TORCHFT_LIGHTHOUSE" in text):
                found.append(f"{path.relative_to(SRC.parents[1])}:{node.lineno}: {text[:60]!r}")
    assert not found, "name these through syncwise.live_env:\n" + "\n".join(found)


TABLE = "syncwise.launch.run"

# The mechanisms the table's rows drive: (module, function) -> row. Only the table calls them from outside
# their own module.
MECHANISMS = {
    ("syncwise.launch.local", "run_local"): "elastic",
    ("syncwise.lab.launch", "lab_torchrun"): "lab",
    ("syncwise.lab.launch", "lab_python"): "lab (one python process in a node; nothing in syncwise calls it)",
    ("syncwise.launch.ft", "run_replicas"): "live",
    ("syncwise.launch.ft", "Lighthouse"): "live (torchft's lighthouse)",
    ("syncwise.launch.ft_lab", "run_replicas_lab"): "live-lab",
}

# Modules that start processes themselves (the primitives below), each with why.
STARTS_PROCESSES = {
    TABLE: "the table: its copies row (bench's independent one-worker processes)",
    "syncwise.launch.local": "the elastic row's mechanism: torchrun's elastic_launch in this process",
    "syncwise.lab.launch": "the lab row's mechanism: one torchrun agent per lab namespace",
    "syncwise.launch.ft": "the live row's mechanism: torchft's lighthouse and one torchrun per replica group; its "
                          "main() is `python -m syncwise.launch.ft -- script.py`, a user script's own live-recovery "
                          "launcher (it cannot ask the table: the table imports this module)",
    "syncwise.launch.ft_lab": "the live-lab row's mechanism: the lighthouse and replica groups in the lab's "
                              "namespaces; `ip netns pids` to find a node's processes",
    "syncwise.lab.cluster": "not a worker: `ip`/`tc` set the lab up, and `syncwise cluster exec` runs the user's "
                            "command in a namespace",
    "syncwise.commands.launch": "not a worker: `syncwise launch --submit` hands the generated file to sbatch/kubectl",
    "syncwise.bind": "not a worker: `python -m syncwise.bind -- PROGRAM` becomes the program (os.execvp), bound "
                     "by the address rule (the Slurm script's lighthouse)",
}

_PRIMITIVE_NAMES = {"Popen", "elastic_launch", "start_processes", "Process", "spawn", "call", "check_call",
                    "check_output", "system", "fork", "forkpty"}
_PRIMITIVE_MODULES = {"subprocess", "os", "mp", "multiprocessing", "torch.multiprocessing"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else node.attr
    return ""


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name:
                yield node.lineno, name


def _is_primitive(name: str) -> bool:
    base, _, last = name.rpartition(".")
    if last in ("Popen", "elastic_launch", "start_processes"):
        return True
    if base in _PRIMITIVE_MODULES and (last in _PRIMITIVE_NAMES or last == "run" and base == "subprocess"
                                       or last.startswith(("exec", "spawn", "posix_spawn"))):
        return True
    return False


def test_only_the_launch_table_asks_the_mechanisms_that_start_workers():
    by_name = {fn: module for module, fn in MECHANISMS}
    found = []
    for module, path, tree in _trees():
        for line, name in _calls(tree):
            owner = by_name.get(name.rpartition(".")[2])
            if owner and module not in (TABLE, owner):
                found.append(f"{path.relative_to(SRC.parent)}:{line}: {module} calls {name} ({owner})")
    assert not found, "ask syncwise.launch.run (the launch table) instead:\n" + "\n".join(found)


def test_only_the_table_and_its_mechanisms_start_processes():
    found = []
    for module, path, tree in _trees():
        if module in STARTS_PROCESSES:
            continue
        found += [f"{path.relative_to(SRC.parent)}:{line}: {name}" for line, name in _calls(tree)
                  if _is_primitive(name)]
    assert not found, ("a process started outside the launch table (ask syncwise.launch.run, or list the module "
                       "in STARTS_PROCESSES with why):\n" + "\n".join(found))


def test_every_listed_exception_still_starts_a_process():
    """The list shrinks with the code: a module that no longer starts anything leaves it."""
    starts = {module for module, _, tree in _trees() if any(_is_primitive(n) for _, n in _calls(tree))}
    assert set(STARTS_PROCESSES) <= starts, sorted(set(STARTS_PROCESSES) - starts)


def test_the_table_has_one_row_per_case():
    from syncwise.launch import run

    assert set(run.ROWS) == {run.IN_PROCESS, run.ELASTIC, run.LAB, run.LIVE, run.LIVE_LAB, run.COPIES}
    live = run.Live(replicas=2, restarts=1)
    cases = {
        run.Job(nproc=1, in_process=True): run.IN_PROCESS,
        run.Job(nproc=1): run.ELASTIC,                                   # a caller that never runs in-process
        run.Job(nproc=2, in_process=True): run.ELASTIC,
        run.Job(nproc=1, in_process=True, max_restarts=1): run.ELASTIC,
        run.Job(nproc=1, in_process=True, nnodes="1:2"): run.ELASTIC,
        run.Job(nproc=1, lab=True, in_process=True): run.LAB,
        run.Job(nproc=1, live=live, in_process=True): run.LIVE,
        run.Job(nproc=1, lab=True, live=live): run.LIVE_LAB,
        run.Job(copies=True): run.COPIES,
    }
    assert {job: run.route(job) for job in cases} == cases

