"""One launcher (DESIGN.md §3.1c, docs/architecture.md): checked on the source with ``ast`` (nothing runs).

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
    found = []
    for name, path, tree in _trees():
        if name == "syncwise.live_env":
            continue
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                    and ("SYNCWISE_FT_" in node.value or "TORCHFT_LIGHTHOUSE" in node.value):
                found.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: {node.value[:60]!r}")
    assert not found, "name these through syncwise.live_env:\n" + "\n".join(found)
