"""Optional dependencies (pyproject's extras): one line naming the extra when a feature needs one that is missing."""
from __future__ import annotations

from typing import Any

from .errors import SyncwiseError


def require_extra(module: str, extra: str, feature: str) -> Any:
    """Import ``module`` or raise one line naming the syncwise extra that installs it (``pip install
    'syncwise[report]'``); ``feature`` says what needed it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise SyncwiseError(f"{feature} needs {module.split('.')[0]}, which is not installed: "
                            f"pip install 'syncwise[{extra}]'") from None


def pyplot(feature: str) -> Any:
    """matplotlib.pyplot on the Agg backend, or one line naming the ``[report]`` extra."""
    matplotlib = require_extra("matplotlib", "report", feature)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
