"""The train state: a registry of ``Stateful`` components that checkpoints save and restore.

Two kinds of component:

- *global*: identical on every rank, or sharded by DCP (model + optimizer through
  ``ModelOptimizerState``, LR scheduler, GradScaler, step/token counters). Saved once through
  ``torch.distributed.checkpoint``; loadable at another world size where the sharding allows.
- *per-rank*: different on every rank (RNG streams via ``RNGState``, a data sampler's position,
  a compressor's error-feedback residuals). Saved as one ``rank_<r>.pt`` file per rank and loaded
  with ``torch.load(weights_only=True)``, so their ``state_dict`` must hold only tensors, ints,
  floats, bools, strings, None, and lists/tuples/dicts of those.
"""
from __future__ import annotations

import random
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
import torch.nn as nn

from ..errors import ConfigError


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(sd)`` (modules, optimizers, schedulers...)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


class ModelOptimizerState:
    """Model + optimizer(s) as one component, through DCP's ``get_state_dict``/``set_state_dict``.

    Those handle plain modules, DDP, FSDP2 and tensor parallel alike (FQNs without wrapper prefixes,
    sharded tensors stay sharded), so the checkpoint is portable across wrappers and world sizes.

    The optimizer is saved *flattened* (torch's ``flatten_optimizer_state_dict``: ``state.<fqn>.exp_avg``,
    ``param_groups.<fqn>.lr``): every entry is keyed by a parameter's fully-qualified name, so a pipeline
    stage contributes exactly its own parameters' entries and loads exactly its own — the union over the
    stages is the unsplit model's state, and DCP reshards it to any stage count or layout. (Nested, torch's
    default, keeps ``param_groups`` as one list per rank: stages holding different parameters would write
    different lists under one key, and every stage would read back one stage's.) Checkpoints written
    nested, before this, still load: ``adapt_to_checkpoint`` picks the checkpoint's form for the load.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None):
        self.model, self.optimizer = model, optimizer
        self._flat = True  # the optimizer's form in the next state_dict()

    def _optims(self) -> list[torch.optim.Optimizer]:
        if self.optimizer is None:
            return []
        return list(self.optimizer) if isinstance(self.optimizer, (list, tuple)) else [self.optimizer]

    def _options(self, flat: bool) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=flat)

    def adapt_to_checkpoint(self, entries: set[str]) -> None:
        """Before a load: ``entries`` are this component's keys in the checkpoint (DCP's flattened names, without
        the component's own prefix). A checkpoint written with the optimizer nested (``optim.param_groups.0.params``)
        is loaded nested; the next save is flattened again."""
        self._flat = not any(k.startswith("optim.param_groups.") and k.endswith(".params")
                             and k.split(".")[2].isdigit() for k in entries)

    def state_dict(self) -> dict[str, Any]:
        """``{'model': ..., 'optim': ...}`` in DCP's canonical (wrapper-free) form, the optimizer flattened."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self._optims(), options=self._options(self._flat))
        return {"model": model_sd, "optim": optim_sd} if self._optims() else {"model": model_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``state_dict()`` produced, flattened or nested (strict: every key must be present)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        optim_sd = state_dict.get("optim", {})
        flat = not isinstance(optim_sd.get("param_groups"), list)
        set_state_dict(self.model, self._optims(), model_state_dict=state_dict["model"],
                       optim_state_dict=optim_sd, options=self._options(flat))
        self._flat = True


class RNGState:
    """This rank's random streams: python ``random``, numpy, torch CPU and (if present) CUDA.

    Python and numpy states are converted to tensors and ints so the per-rank file loads with
    ``weights_only=True``.
    """

    def state_dict(self) -> dict[str, Any]:
        """Snapshot of all generators as plain data."""
        version, mt, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        sd: dict[str, Any] = {
            "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
            "numpy": {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            sd["cuda"] = list(torch.cuda.get_rng_state_all())
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore every generator present in ``state_dict``."""
        py = state_dict["python"]
        random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
        n = state_dict["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
        torch.set_rng_state(state_dict["torch"])
        if "cuda" in state_dict and torch.cuda.is_available():
            cuda = state_dict["cuda"]
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)


class Counters:
    """Named numbers that must survive a restart (step, tokens seen, epoch...), as attributes.

    >>> c = Counters(step=0, tokens=0); c.step += 1
    """

    def __init__(self, **values: int | float):
        self.__dict__.update(values)

    def state_dict(self) -> dict[str, Any]:
        """All counters as a dict."""
        return dict(self.__dict__)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore counters (ints stay ints)."""
        self.__dict__.update({k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in state_dict.items()})

    def __repr__(self) -> str:
        return f"Counters({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


class TrainState:
    """Registry of the stateful components of one training run (see module docstring for kinds)."""

    def __init__(self) -> None:
        self.global_components: dict[str, Stateful] = {}
        self.per_rank_components: dict[str, Stateful] = {}
        self.portable: set[str] = set()  # per-rank components whose state any rank of another layout can load

    def register(self, name: str, component: Stateful, *, per_rank: bool = False,
                 portable: bool = False) -> Stateful:
        """Add ``component`` under ``name``; ``per_rank=True`` for state that differs by rank. ``portable=True``
        (per-rank only): after a change of layout or world size, load the state rank 0 of the old layout saved
        instead of dropping it — for state that is kept per rank but means the same on every rank and adapts
        to the new layout itself (a data loader's position in the epoch: windows consumed by all ranks)."""
        if not isinstance(component, Stateful):
            raise ConfigError(f"train_state[{name!r}]", type(component).__name__,
                              "an object with state_dict() and load_state_dict()")
        if not name or "." in name or name in self.global_components or name in self.per_rank_components:
            raise ConfigError("name", name, "a new, non-empty component name without '.'")
        if portable and not per_rank:
            raise ConfigError("portable", portable, "False unless per_rank=True (global state always reshards)")
        (self.per_rank_components if per_rank else self.global_components)[name] = component
        if portable:
            self.portable.add(name)
        return component

    def __contains__(self, name: str) -> bool:
        return name in self.global_components or name in self.per_rank_components

    def __getitem__(self, name: str) -> Stateful:
        return self.global_components.get(name) or self.per_rank_components[name]

    @classmethod
    def for_training(cls, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                     scheduler: Any = None, scaler: Any = None, rng: bool = True) -> "TrainState":
        """The usual set: 'model' (model+optimizer), 'scheduler', 'scaler', 'counters', 'rng'."""
        ts = cls()
        ts.register("model", ModelOptimizerState(model, optimizer))
        if scheduler is not None:
            ts.register("scheduler", scheduler)
        if scaler is not None:
            ts.register("scaler", scaler)
        ts.register("counters", Counters(step=0, tokens=0))
        if rng:
            ts.register("rng", RNGState(), per_rank=True)
        return ts
