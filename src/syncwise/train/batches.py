"""The batch shapes ``OptimizedTrainer`` accepts, and how one becomes a loss.

A loader batch is one of:

* ``(inputs, targets)``: ``loss_fn(model(inputs), targets)`` (``loss_fn`` defaults to ``lm_loss``);
* a mapping of the model's keyword arguments (``{"input_ids", "labels"}``, with ``"attention_mask"`` ...; a Hugging
  Face ``BatchEncoding`` is one): ``model(**batch)``, whose loss is ``loss_fn(outputs, batch)`` when a ``loss_fn``
  is given, else the loss the model returns.

A model returns its own loss as an object with ``.loss`` (a Hugging Face ``ModelOutput``), a mapping with
``"loss"``, or a scalar tensor; with ``loss_fn=None`` that loss is used for either batch shape (a pair whose model
returns none falls back to ``lm_loss(outputs, targets)``).

Inside the trainer every batch is a pair: a mapping travels as ``(dict(batch), KWARGS)``, so micro-batching,
dynamic batching (which slice dicts along dim 0) and accumulation handle both shapes alike.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.utils.data

from ..errors import _ONE_LINE, ConfigError

ACCEPTED = ("(inputs, targets) tuples, or a mapping of the model's keyword arguments such as {'input_ids', "
            "'labels'} (model(**batch); its loss from loss_fn(outputs, batch) or the one the model returns)")


class _Kwargs:
    """The targets slot of a mapping batch: the model takes the mapping as keyword arguments."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "KWARGS"


KWARGS = _Kwargs()


class BatchShapeError(ConfigError):
    """A loader batch of a shape the trainer cannot use (one line: what was given, what is accepted)."""

    def __init__(self, given: str, accepted: str = ACCEPTED):
        self.field, self.value, self.accepted = "batch", given, accepted
        text = f"the loader yielded {given}; OptimizedTrainer accepts {accepted}"
        Exception.__init__(self, text.translate(_ONE_LINE))


def describe(batch: Any) -> str:
    """A batch as the refusal names it: its type and, for a tuple/list, its items' types; a mapping's keys."""
    if isinstance(batch, (tuple, list)):
        items = ", ".join(type(b).__name__ for b in batch[:4]) + (", ..." if len(batch) > 4 else "")
        return f"a {type(batch).__name__} of {len(batch)} item(s) ({items})"
    if isinstance(batch, Mapping):
        return f"a {type(batch).__name__} with keys {sorted(map(str, batch))}"
    return f"a {type(batch).__name__}"


def as_pair(batch: Any, pipeline: bool = False) -> tuple[Any, Any]:
    """``batch`` as the trainer's ``(inputs, targets)`` pair (a mapping: ``(dict, KWARGS)``); refuse another shape
    in one line naming what was given and what is accepted."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and not isinstance(batch[1], _Kwargs):
        return batch[0], batch[1]   # (first: the common shape skips the Mapping ABC's slower isinstance)
    if isinstance(batch, Mapping):
        if pipeline:
            raise BatchShapeError(describe(batch), "(inputs, targets) tuples with pipeline parallel (its schedule "
                                  "splits one input and one target tensor into microbatches; a model's keyword "
                                  "arguments cannot cross stages)")
        if not batch:
            raise BatchShapeError("an empty mapping")
        return dict(batch), KWARGS
    raise BatchShapeError(describe(batch))


def pairs(batches: Iterable, pipeline: bool = False) -> Iterator[tuple[Any, Any]]:
    """Each loader batch as a pair (:func:`as_pair`)."""
    for b in batches:
        yield as_pair(b, pipeline)


def to_device(x: Any, device: torch.device) -> Any:
    """Tensors in ``x`` (a tensor, or dicts/tuples/lists of them) on ``device``; other leaves unchanged."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(to_device(v, device) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(v, device) for v in x)
    return x


def own_loss(outputs: Any) -> Optional[torch.Tensor]:
    """The loss a model returned: ``.loss`` (a ModelOutput), a mapping's ``"loss"``, or a scalar tensor; else None."""
    if isinstance(outputs, torch.Tensor):
        return outputs if outputs.dim() == 0 else None
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    return loss if isinstance(loss, torch.Tensor) else None


def forward_loss(model: Callable, loss_fn: Optional[Callable], inputs: Any, targets: Any,
                 default_loss: Callable) -> torch.Tensor:
    """One (micro-)batch's forward and loss, for either batch shape (see the module docstring)."""
    if targets is KWARGS:
        outputs = model(**inputs)
        if loss_fn is not None:
            return loss_fn(outputs, inputs)
        loss = own_loss(outputs)
        if loss is None:
            raise ConfigError("loss_fn", None, f"a loss_fn(outputs, batch): model(**batch) returned "
                              f"{type(outputs).__name__} with no loss (keys {sorted(inputs)}; a Hugging Face model "
                              f"returns one when the batch has 'labels')")
        return loss
    outputs = model(inputs)
    if loss_fn is not None:
        return loss_fn(outputs, targets)
    loss = own_loss(outputs)
    return loss if loss is not None else default_loss(outputs, targets)


def tokens(inputs: Any, targets: Any = None) -> int:
    """Tokens in one batch: integer token ids count every element (a mapping's ``input_ids``, or its first integer
    tensor); float inputs count one per row."""
    x = inputs
    if isinstance(x, Mapping):
        x = x.get("input_ids", next((v for v in x.values() if isinstance(v, torch.Tensor)
                                     and not v.is_floating_point()), next(iter(x.values()), None)))
    while isinstance(x, (tuple, list)) and x:
        x = x[0]
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return 0
    return x.numel() if not x.is_floating_point() else x.size(0)


def peek(loader: Any) -> Any:
    """The first batch of ``loader`` without iterating it (its position and state stay as they are), where that is
    cheap: a list/tuple of batches, or a map-style DataLoader (its collate of the first sample). None otherwise."""
    if isinstance(loader, (list, tuple)):
        return loader[0] if loader else None
    dataset = getattr(loader, "dataset", None)
    collate = getattr(loader, "collate_fn", None)
    if dataset is None or collate is None or isinstance(dataset, torch.utils.data.IterableDataset):
        return None
    try:
        if len(dataset) == 0:
            return None
        sample = dataset[0]
        return collate([sample]) if getattr(loader, "batch_size", None) is not None else collate(sample)
    except Exception:  # noqa: BLE001 — a dataset that cannot be indexed this way: checked at the first step instead
        return None
