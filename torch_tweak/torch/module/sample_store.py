"""Recorded calls kept on disk: calibration data for quantized candidates and held-out inputs for the fidelity check.

Why: a few in-memory samples (``tt.config.max_num_samples_stored``) are enough to build a candidate and to
catch a wrong one, not to calibrate int8 scales or to judge a quantized model like its task: a CNN accepted
on 8 samples agreed with eager on only 81-90 % of held-out top-1 predictions. When a graph's strategy has a
quantized candidate or judges by a task metric, tuning therefore records more of the graph's calls (up to
``tt.config.max_num_calibration_samples``) into a :class:`SampleStore`, on disk rather than in RAM.

Layout: ``<cache>/<module>/<graph>/recorded-calls-<owner>-<random>/call-<index>.safetensors``, one
safetensors file per call, written and deleted by torch_tweak (the folder is created owner-only; ``tt.tune``
removes it when tuning ends, and a later store removes the folders of processes that were killed). A file
holds the call's input tensors (``input.<i>``, flattened like :class:`GraphSpec` inputs) and, for held-out
calls, the eager outputs (``output.<j>``); containers and non-tensor values are rebuilt from the structure
the graph recorded, so nothing but tensors is written and loading runs no code. A call whose structure
differs from the graph's first stored call (other non-tensor values, possible when ``strict_mode`` is off) or
whose inputs or outputs cannot be rebuilt (opaque objects such as a KV cache) is not stored.

Split (:func:`is_held_out`): every fourth call, starting with the second, is held out; the rest calibrate.
It is decided when a call is recorded, so held-out calls keep the eager outputs computed anyway, and it
is deterministic: the same recording gives the same sets, and a graph with two or more stored calls has at
least one held out and one calibrating. A held-out call that recording did not run (its output shapes were known,
:mod:`~torch_tweak.torch.module.known_shapes`) is written without outputs; the first :meth:`SampleStore.held_out`
that reads it computes them with the module and writes them into its file.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar, overload

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from torch_tweak.torch.module.tree import Sample, Spec, flatten, map_tensors, unflatten, unflatten_sample
from torch_tweak.utils.leftovers import owner_tag, remove_leftovers

logger = logging.getLogger(__name__)

STORE_PREFIX = "recorded-calls-"
_LEFTOVER = re.compile(rf"{re.escape(STORE_PREFIX)}(?P<tag>\d+x\d+)-[A-Za-z0-9_]+")
HELD_OUT_EVERY = 4
T = TypeVar("T")


def is_held_out(index: int) -> bool:
    """Whether the ``index``-th stored call of a graph is held out from calibration (1, 5, 9, ...: a quarter)."""
    return index % HELD_OUT_EVERY == 1


class StoredCalls(Sequence[T]):
    """A read-only sequence of stored calls, each loaded from disk when it is accessed (never all at once)."""

    def __init__(self, indices: list[int], load: Callable[[int], T]) -> None:
        self._indices = indices
        self._load = load

    def __len__(self) -> int:
        return len(self._indices)

    @overload
    def __getitem__(self, item: int) -> T: ...

    @overload
    def __getitem__(self, item: slice) -> StoredCalls[T]: ...

    def __getitem__(self, item: int | slice) -> T | StoredCalls[T]:
        if isinstance(item, slice):
            return StoredCalls(self._indices[item], self._load)
        return self._load(self._indices[item])

    def __iter__(self) -> Iterator[T]:
        for index in self._indices:
            yield self._load(index)


class SampleStore:
    """The calls of one graph kept on disk (see the module docstring); at most ``limit`` of them."""

    def __init__(self, parent: Path, limit: int) -> None:
        remove_leftovers(parent, _LEFTOVER)
        self.folder = Path(tempfile.mkdtemp(prefix=f"{STORE_PREFIX}{owner_tag()}-", dir=parent))
        self.limit = limit
        self.count = 0
        self.stopped: str | None = None  # why no more calls are stored
        self._inputs: Spec | None = None
        self._outputs: Spec | None = None

    # recording ---------------------------------------------------------------------------------------

    def wants_call(self) -> bool:
        """True while calls are being stored (below the limit, not stopped, not removed)."""
        return self.stopped is None and self.count < self.limit

    @staticmethod
    def capture(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """CPU copies of a call's input tensors, taken before the forward runs (it may change them in place)."""
        return [_cpu_copy(leaf) for leaf in leaves]

    def takes_pending(self) -> bool:
        """True when a call without outputs can be stored: a call with outputs was, so their structure is known."""
        return self._outputs is not None

    def add(self, inputs: list[torch.Tensor], devices: list[str], input_structure: Spec, outputs: Any,
            batch_size: int | None, pending: bool = False) -> None:
        """Store one call: ``inputs`` from :meth:`capture`, the devices they came from, their structure (from
        :func:`flatten_sample`) and, for a held-out call, the eager ``outputs``. ``pending``: the call was not run
        (``outputs`` is ignored; only once :meth:`takes_pending`), a held-out one gets its outputs when first read."""
        if not self.wants_call() or (pending and not self.takes_pending()):
            return
        held_out = is_held_out(self.count) and not pending
        output_leaves, output_structure = ([], None) if pending else flatten(outputs)
        if self._inputs is None:
            if not self._rebuildable(inputs, input_structure, output_leaves, output_structure):
                return
            self._inputs, self._outputs = input_structure, output_structure
        elif input_structure != self._inputs or (held_out and output_structure != self._outputs):
            logger.debug("%s: a call with other non-tensor values than the first stored one is not stored", self.folder)
            return
        tensors = {f"input.{i}": t for i, t in enumerate(inputs)}
        meta = {"input_devices": json.dumps(devices), "batch_size": json.dumps(batch_size)}
        if held_out:
            tensors.update({f"output.{j}": _cpu_copy(t) for j, t in enumerate(output_leaves)})
            meta["output_devices"] = json.dumps([str(t.device) for t in output_leaves])
        try:
            save_file(tensors, str(self._path(self.count)), metadata=meta)
        except Exception as exc:  # noqa: BLE001 - a call that cannot be stored ends storing, never recording
            self._stop(f"a call could not be written ({type(exc).__name__}: {exc})")
            return
        self.count += 1

    def _rebuildable(self, inputs: list[torch.Tensor], input_structure: Spec, output_leaves: list[torch.Tensor],
                     output_structure: Spec) -> bool:
        try:
            unflatten_sample(input_structure, list(inputs))
            unflatten(output_structure, list(output_leaves))
        except Exception as exc:  # noqa: BLE001 - e.g. an opaque object (KV cache) cannot be rebuilt from tensors
            self._stop(f"its inputs or outputs cannot be rebuilt from their tensors ({exc})")
            return False
        return True

    def _stop(self, reason: str) -> None:
        self.stopped = reason
        logger.info("Graph calls in %s: no more calls are stored for calibration and held-out checks: %s",
                    self.folder, reason)

    # reading -----------------------------------------------------------------------------------------

    def calibration(self, max_samples: int | None = None) -> StoredCalls[Sample]:
        """The stored calls that calibrate: inputs only, loaded one at a time; with ``max_samples``, the first of
        them (in recording order) up to that many samples in all (at least one call; a call without a batch
        size counts as one sample)."""
        indices = [i for i in range(self.count) if not is_held_out(i)]
        if max_samples is not None:
            kept, samples = [], 0
            for index in indices:
                samples += self.batch_size(index) or 1
                if kept and samples > max_samples:
                    break
                kept.append(index)
            indices = kept
        return StoredCalls(indices, lambda i: self.load(i)[0])

    def batch_size(self, index: int) -> int | None:
        """The batch size call ``index`` was recorded at (read from its file's header, no tensor is loaded)."""
        with safe_open(str(self._path(index)), framework="pt") as handle:
            return json.loads((handle.metadata() or {})["batch_size"])

    def held_out(self, forward: Callable[..., Any] | None = None) -> StoredCalls[tuple[Sample, Any, int | None]]:
        """The held-out calls as ``(inputs, eager outputs, batch size)``, loaded one at a time; ``forward`` (the
        module's own) computes the outputs of a call recording did not run, which are then written to its file
        (without it such a call's outputs are None)."""
        return StoredCalls([i for i in range(self.count) if is_held_out(i)],
                           lambda index: self.load(index, forward))

    def load(self, index: int, forward: Callable[..., Any] | None = None) -> tuple[Sample, Any, int | None]:
        """Call ``index``: ``(args, kwargs)`` on the devices it was recorded on, its eager outputs (None for a
        calibrating call) and its batch size; ``forward``: see :meth:`held_out`."""
        if self._inputs is None or not 0 <= index < self.count:
            raise IndexError(f"{self.folder} holds {self.count} call(s); there is no call {index}.")
        with safe_open(str(self._path(index)), framework="pt") as handle:
            meta = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        inputs = _placed(tensors, "input", json.loads(meta["input_devices"]))
        sample = unflatten_sample(self._inputs, inputs)
        outputs = None
        if "output_devices" in meta and self._outputs is not None:
            outputs = unflatten(self._outputs, _placed(tensors, "output", json.loads(meta["output_devices"])))
        elif forward is not None and is_held_out(index):
            outputs = eager_reference(forward, *sample)
            self._write_outputs(index, tensors, meta, outputs)
        return sample, outputs, json.loads(meta["batch_size"])

    def _write_outputs(self, index: int, tensors: dict[str, torch.Tensor], meta: dict[str, str], outputs: Any) -> None:
        """Put the eager outputs computed for call ``index`` into its file (atomically: a worker may read it)."""
        leaves = flatten(outputs)[0]
        tensors = {**tensors, **{f"output.{j}": _cpu_copy(t) for j, t in enumerate(leaves)}}
        meta = {**meta, "output_devices": json.dumps([str(t.device) for t in leaves])}
        path = self._path(index)
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            save_file(tensors, str(partial), metadata=meta)
            os.replace(partial, path)
        except Exception as exc:  # noqa: BLE001 - computed again at the next read
            partial.unlink(missing_ok=True)
            logger.debug("%s: the outputs of call %d could not be written (%s)", self.folder, index, exc)

    def remove(self) -> None:
        """Delete the folder and everything in it (only files this store wrote are there)."""
        self.stopped, self.count = "removed", 0
        shutil.rmtree(self.folder, ignore_errors=True)

    def _path(self, index: int) -> Path:
        return self.folder / f"call-{index:06d}.safetensors"


def eager_reference(forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``forward``'s outputs for a copy of ``args``/``kwargs`` (it may change its inputs in place), detached."""
    copied_args, copied_kwargs = copy.deepcopy((args, kwargs))
    with torch.no_grad():
        outputs = forward(*copied_args, **copied_kwargs)
    return map_tensors(outputs, lambda t: t.detach())


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True).contiguous()


def _placed(tensors: dict[str, torch.Tensor], kind: str, devices: list[str]) -> list[torch.Tensor]:
    return [tensors[f"{kind}.{i}"] if device == "cpu" else tensors[f"{kind}.{i}"].to(device)
            for i, device in enumerate(devices)]
