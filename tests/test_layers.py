"""The layer rule of DESIGN.md §3, checked on the source: each layer only imports the ones below it.

Every module under src/syncwise is parsed with ``ast`` (no import runs) and each ``import`` /
``from ... import`` of a syncwise module — at module level or inside a function — is checked against
the order below (docs/architecture.md explains where each name sits and why). A module may import its
own layer and the layers below it, never one above.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "syncwise"

# Top to bottom, as in DESIGN.md §3; the last entry holds the shared leaves that DESIGN.md does not list
# (each imports nothing of syncwise but the other leaves). `metrics` is the trainer's metrics/progress
# (DESIGN.md's train line); `commands` are the cli's subcommands, including the worker's composition root.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("cli", ("syncwise.cli", "syncwise.commands")),
    ("config", ("syncwise.config",)),
    ("launch", ("syncwise.launch",)),
    ("doctor", ("syncwise.doctor",)),
    ("plan", ("syncwise.plan",)),
    ("integrations", ("syncwise.integrations",)),  # syncwise inside other trainers (docs/integrations.md)
    ("train", ("syncwise.train", "syncwise.metrics")),
    ("checkpoint", ("syncwise.checkpoint",)),
    ("parallel", ("syncwise.parallel",)),
    ("compress", ("syncwise.compress",)),
    ("comm", ("syncwise.comm",)),
    ("models", ("syncwise.models",)),
    ("data", ("syncwise.data",)),
    ("lab", ("syncwise.lab",)),
    # syncwise.layout: DESIGN.md lists it between plan and train, but as a torch-free leaf (it imports only errors
    # and specs), so config, plan, parallel and compress all ask it
    ("leaves", ("syncwise", "syncwise.errors", "syncwise.specs", "syncwise.devices", "syncwise.rundir",
                "syncwise.layout", "syncwise.tokenize_pool", "syncwise.extras",
                "syncwise.bind", "syncwise.secret", "syncwise.profiling", "syncwise.live_env", "syncwise.schema")),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def layer_of(module: str) -> int:
    """Index into LAYERS (0 = top). ``__main__`` modules are program entry points: the cli layer."""
    if module.rsplit(".", 1)[-1] == "__main__":
        return 0
    best, index = "", None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, index = prefix, i
    if index is None or (best == "syncwise" and module != "syncwise"):
        raise LookupError(module)
    return index


def imports_of(module: str) -> list[tuple[int, str]]:
    """(line, imported syncwise module) for every import statement in ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:  # `from syncwise import devices` imports the module syncwise.devices
                sub = f"{base}.{a.name}"
                found.append((node.lineno, sub if sub in MODULES else base))
    return [(line, name) for line, name in found if name == "syncwise" or name.startswith("syncwise.")]


def test_every_module_has_a_layer():
    unplaced = []
    for module in MODULES:
        try:
            layer_of(module)
        except LookupError:
            unplaced.append(module)
    assert not unplaced, f"add these to LAYERS (and docs/architecture.md): {unplaced}"


def test_no_module_imports_a_layer_above_its_own():
    violations = []
    for module in MODULES:
        mine = layer_of(module)
        for line, target in sorted(set(imports_of(module))):
            theirs = layer_of(target)
            if theirs < mine:
                violations.append(f"{MODULES[module].relative_to(SRC.parent)}:{line}: {module} "
                                  f"({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]})")
    assert not violations, "upward imports:\n" + "\n".join(violations)


def test_entry_points_are_never_imported():
    """A ``__main__`` module may import any layer only because nothing imports it back."""
    importers = [f"{m} imports {t}" for m in MODULES for _, t in imports_of(m) if t.endswith(".__main__")]
    assert not importers


@pytest.mark.parametrize("package", ["train", "checkpoint", "parallel", "compress", "comm", "models", "data"])
def test_the_worker_side_does_not_know_config_or_commands(package):
    for module in MODULES:
        in_package = module == f"syncwise.{package}" or module.startswith(f"syncwise.{package}.")
        if in_package and not module.endswith(".__main__"):
            bad = [t for _, t in imports_of(module) if t.startswith(("syncwise.config", "syncwise.commands"))]
            assert not bad, f"{module} imports {bad}"


def test_importing_the_library_layers_loads_neither_config_nor_commands():
    code = ("import sys, syncwise.train, syncwise.checkpoint, syncwise.parallel, syncwise.compress, "
            "syncwise.comm, syncwise.models, syncwise.data\n"
            "print(sorted(m for m in sys.modules if m.startswith(('syncwise.config', 'syncwise.commands'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("module, allowed", [
    ("syncwise.layout", {"syncwise.errors", "syncwise.specs"}),
    # the one definition of each option: both doors' fields are made from it (`syncwise train --help` loads no torch)
    ("syncwise.schema", {"syncwise.errors", "syncwise.layout", "syncwise.profiling"}),
])
def test_layout_and_schema_are_torch_free_leaves(module, allowed):
    """syncwise.layout and syncwise.schema import nothing of syncwise but the other leaves, and no torch."""
    assert layer_of(module) == len(LAYERS) - 1
    assert {t for _, t in imports_of(module)} <= allowed
    tree = ast.parse(MODULES[module].read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n == "torch" or n.startswith("torch.")]


def _cycles() -> list[list[str]]:
    """Strongly connected components (more than one module) of the import graph: every import, at module level
    or inside a function, between syncwise modules (a package's __init__ counts as its own module)."""
    graph = {m: sorted({t for _, t in imports_of(m) if t in MODULES and t != m}) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm (the graph is a few hundred modules: recursion is fine)
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert _cycles() == []
