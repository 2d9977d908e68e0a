"""Turning the user's dataset into batched calls ``(args, kwargs)``.

Accepted datasets: a tensor (one item without a batch axis), a sequence (list/tuple) of items, or a
``torch.utils.data.Dataset`` with ``__len__``. Items can be:

* a tensor or numpy array → one positional argument;
* a dict → keyword arguments;
* a pair ``(args, kwargs)`` with a tuple/list and a dict → both;
* a tuple or list of values → positional arguments;
* a string → one positional argument (a batch is a list of strings).

A batch of size ``b`` stacks ``b`` consecutive items along a new first axis. Items whose tensors do
not share shapes (e.g. sentences of different lengths) or whose structures differ are batched by
repeating each item ``b`` times.
Numbers stay plain values (``num_steps=2``); items whose numbers differ are batched by repetition too.

:class:`DataLoaderFactory` (the reference Torch Tweak's name) wraps such a dataset and, optionally, a
``collate_fn`` that turns a list of items into one call's arguments.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from torch_tweak.errors import ConfigError, DatasetError, UnsupportedInputError
from torch_tweak.torch.module.tree import Sample

logger = logging.getLogger(__name__)


class _RaggedBatchError(Exception):
    """Items of a batch have tensors of different shapes."""


class DataLoaderFactory:
    """A dataset plus how to batch it, as the reference Torch Tweak spells it; ``tt.tune`` and ``tt.inspect``
    accept it wherever they accept a dataset.

    Args:
        dataset: any dataset ``tt.tune`` accepts (a tensor, a list of items, a ``torch.utils.data.Dataset``).
        collate_fn: turns a list of items into one call (a tensor, a dict of keyword arguments, or an
            ``(args, kwargs)`` pair); None batches as described in this module.
        num_workers: passed to the ``DataLoader`` that :meth:`create_dataloader` makes.
    """

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None = None, num_workers: int = 0) -> None:
        if collate_fn is not None and not callable(collate_fn):
            raise ConfigError(f"DataLoaderFactory: collate_fn must be callable or None, got {type(collate_fn).__name__}.")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(f"DataLoaderFactory: num_workers must be an integer >= 0, got {num_workers!r}.")
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.num_workers = num_workers

    def create_dataloader(self, batch_size: int) -> torch.utils.data.DataLoader:
        """A ``DataLoader`` over the items (a short dataset is cycled to one full batch; the last partial
        batch is dropped)."""
        items = dataset_items(self.dataset)
        if len(items) < batch_size:
            items = [items[i % len(items)] for i in range(batch_size)]
        collate = self.collate_fn or (lambda group: _collate_calls([_as_call(item) for item in group]))
        return torch.utils.data.DataLoader(items, batch_size=batch_size, collate_fn=collate, drop_last=True,  # type: ignore[arg-type]
                                           num_workers=self.num_workers)


class _Collated(list):  # type: ignore[type-arg]
    """Dataset items that a user ``collate_fn`` batches."""

    collate_fn: Callable[[list[Any]], Any]


def dataset_items(dataset: Any) -> list[Any]:
    """Return the dataset's items as a list, validating their types."""
    if isinstance(dataset, DataLoaderFactory):
        items = dataset_items(dataset.dataset)
        if dataset.collate_fn is None:
            return items
        collated = _Collated(items)
        collated.collate_fn = dataset.collate_fn
        return collated
    if isinstance(dataset, torch.Tensor):
        items: list[Any] = [dataset]
    elif isinstance(dataset, (list, tuple)):
        items = list(dataset)
    elif isinstance(dataset, torch.utils.data.Dataset) and hasattr(dataset, "__len__"):
        items = [dataset[i] for i in range(len(dataset))]  # type: ignore[arg-type]
    elif isinstance(dataset, (str, bytes, dict, set, frozenset)) or not hasattr(dataset, "__iter__"):
        raise UnsupportedInputError(
            f"Unsupported dataset type {type(dataset).__name__}: pass a tensor, a list of items or a "
            "torch.utils.data.Dataset with __len__."
        )
    else:
        items = list(dataset)
    if not items:
        raise DatasetError("The dataset is empty: tt.tune needs at least one sample to record the modules' inputs.")
    for index, item in enumerate(items):
        _check_item(item, f"dataset[{index}]")
    return items


def _check_item(item: Any, where: str) -> None:
    if isinstance(item, (torch.Tensor, np.ndarray, str, numbers.Number)) or item is None:
        return
    if isinstance(item, dict):
        for key, value in item.items():
            _check_item(value, f"{where}[{key!r}]")
        return
    if isinstance(item, (list, tuple)):
        for i, value in enumerate(item):
            _check_item(value, f"{where}[{i}]")
        return
    raise UnsupportedInputError(
        f"{where} has unsupported type {type(item).__name__}. Dataset items may be tensors, numpy arrays, "
        "numbers, strings, None, and tuples, lists or dicts of those (or an (args, kwargs) pair)."
    )


def _as_call(item: Any) -> Sample:
    if isinstance(item, dict):
        return (), dict(item)
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], (tuple, list)) and isinstance(item[1], dict):
        return tuple(item[0]), dict(item[1])
    if isinstance(item, (tuple, list)):
        return tuple(item), {}
    return (item,), {}


def iter_batches(items: Sequence[Any], batch_size: int) -> Iterator[Sample]:
    """Yield calls ``(args, kwargs)`` of ``batch_size`` items each; a short dataset is cycled once."""
    if len(items) < batch_size:
        groups = [[items[i % len(items)] for i in range(batch_size)]]
    else:
        groups = [list(items[i : i + batch_size]) for i in range(0, len(items) - batch_size + 1, batch_size)]
    collate_fn = getattr(items, "collate_fn", None)
    for group in groups:
        if collate_fn is not None:
            yield _as_call(collate_fn(group))
            continue
        calls = [_as_call(item) for item in group]
        try:
            yield _collate_calls(calls)
        except _RaggedBatchError:
            logger.debug("Items of different shapes: batching each item by repetition (batch size %d)", batch_size)
            for call in calls:
                yield _collate_calls([call] * batch_size)


def _collate_calls(calls: list[Sample]) -> Sample:
    first_args, first_kwargs = calls[0]
    if any(len(a) != len(first_args) or set(k) != set(first_kwargs) for a, k in calls):
        raise _RaggedBatchError
    args = tuple(_collate([a[i] for a, _ in calls]) for i in range(len(first_args)))
    kwargs = {key: _collate([k[key] for _, k in calls]) for key in first_kwargs}
    return args, kwargs


def _collate(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, np.ndarray):
        values = [torch.from_numpy(np.asarray(v)) for v in values]
        first = values[0]
    if isinstance(first, torch.Tensor):
        if any(not isinstance(v, torch.Tensor) or v.shape != first.shape for v in values):
            raise _RaggedBatchError
        return torch.stack(values)
    if isinstance(first, str):
        return list(values)
    if first is None:
        return None
    if isinstance(first, dict):
        return {key: _collate([v[key] for v in values]) for key in first}
    if isinstance(first, (list, tuple)):
        return type(first)(_collate([v[i] for v in values]) for i in range(len(first)))
    if isinstance(first, numbers.Number):
        if all(v == first for v in values):
            return first
        raise _RaggedBatchError
    raise UnsupportedInputError(f"Cannot batch values of type {type(first).__name__}.")
