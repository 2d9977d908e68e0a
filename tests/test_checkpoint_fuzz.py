"""Mutated checkpoints end in a CheckpointError or a correct load: never another exception, never a changed model.

Mutations: every single byte flipped in turn; random multi-byte edits, truncations and insertions; zip
structure edits (renamed, dropped, duplicated and added members, odd file modes, compression methods and
flags), with the sums file kept, or re-written to match as an attacker would; garbage sums files; and
manifests with random values replaced, re-signed so that they pass the hash checks and reach the loader;
and values an attacker would try (paths, commands, class names, artifact references) placed anywhere.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import members, resign, save_mlp, write_sums
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.errors import CheckpointError, TorchTweakError
from torch_tweak.torch.checkpoint import archive

FUZZ = settings(deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
NAMES = ["../x", "/abs", "a/../../b", "C:/x", "a\\b", "", ".", "a//b", "manifest.json", "tensors/m0.safetensors",
         "tensors", "tensors/m0.safetensors/x", "Manifest.JSON", "a" * 300, "é", "x\x00y"]


@dataclass
class Case:
    """The original checkpoint and a module loaded from it, reused by every mutated load."""

    path: Path
    raw: bytes
    sums: bytes
    content: dict[str, bytes]
    x: torch.Tensor
    expected: torch.Tensor
    target: tt.Module
    written_sums: bytes = b""

    def attempt(self, data: bytes, sums: bytes | None = None, resigned: bool = False) -> str:
        self.path.write_bytes(data)
        sums = self.sums if sums is None else sums
        if sums != self.written_sums:
            archive.sums_path(self.path).write_bytes(sums)
            self.written_sums = sums
        before = list(self.target.backends.values())
        try:
            loaded = tt.load(self.target.wrapped, self.path)
        except CheckpointError:
            assert list(self.target.backends.values()) == before  # untouched
            assert torch.allclose(self.target(self.x), self.expected)
            return "error"
        assert loaded is self.target
        if resigned:  # a consistent (re-signed) checkpoint may describe another valid configuration
            try:
                loaded(self.x)
            except TorchTweakError:
                pass
            self.attempt(self.raw)  # back to the original
            return "loaded"
        assert torch.allclose(loaded(self.x), self.expected)
        return "loaded"


@pytest.fixture
def case(tmp_path):
    path, x, expected = save_mlp(tmp_path / "base.tt")
    target = tt.load(mlp(seed=1), path)
    shm = Path("/dev/shm")
    scratch = Path(tempfile.mkdtemp(dir=shm)) if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    fuzzed = Case(scratch / "case.tt", path.read_bytes(), archive.sums_path(path).read_bytes(), members(path), x,
                  expected, target)
    del target
    yield fuzzed
    fuzzed.target = None  # type: ignore[assignment]  # free the module name for the next test
    gc.collect()
    if scratch != tmp_path:
        shutil.rmtree(scratch, ignore_errors=True)


def test_every_single_byte_flipped(case):
    outcomes = {"error": 0, "loaded": 0}
    for offset in range(len(case.raw)):
        data = bytearray(case.raw)
        data[offset] ^= 0xFF
        outcomes[case.attempt(bytes(data))] += 1
    assert outcomes["error"] > 0.9 * len(case.raw)  # a few header bytes (timestamps...) are not covered by hashes


@settings(FUZZ, max_examples=1000)
@given(data=st.data())
def test_random_byte_edits(case, data):
    raw = bytearray(case.raw)
    for _ in range(data.draw(st.integers(1, 6))):
        kind = data.draw(st.sampled_from(["set", "truncate", "insert", "delete"]))
        offset = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        if kind == "set" and raw:
            raw[offset] = data.draw(st.integers(0, 255))
        elif kind == "truncate":
            del raw[offset:]
        elif kind == "insert":
            raw[offset:offset] = data.draw(st.binary(min_size=1, max_size=8))
        elif raw:
            del raw[offset:offset + data.draw(st.integers(1, 8))]
    case.attempt(bytes(raw))


def _build_zip(entries: list[tuple[zipfile.ZipInfo, bytes]]) -> bytes | None:
    import io
    import warnings

    buffer = io.BytesIO()
    try:
        with warnings.catch_warnings(), zipfile.ZipFile(buffer, "w") as zf:
            warnings.simplefilter("ignore")
            for info, payload in entries:
                zf.writestr(info, payload)
    except Exception:  # zipfile refuses some combinations; those archives cannot exist, skip them
        return None
    return buffer.getvalue()


@settings(FUZZ, max_examples=500)
@given(data=st.data())
def test_zip_structure_edits(case, data):
    entries = []
    for name, payload in case.content.items():
        info = zipfile.ZipInfo(name)
        info.compress_type = zipfile.ZIP_DEFLATED
        entries.append([info, payload])
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["rename", "drop", "dup", "add", "mode", "compress", "flags", "payload"]))
        if not entries and op != "add":
            continue
        i = data.draw(st.integers(0, max(len(entries) - 1, 0)))
        name = data.draw(st.sampled_from(NAMES) | st.text(max_size=12))
        if op == "rename":
            entries[i][0].filename = name
        elif op == "drop":
            entries.pop(i)
        elif op == "dup":
            entries.append([zipfile.ZipInfo(entries[i][0].filename), data.draw(st.binary(max_size=32))])
        elif op == "add":
            entries.append([zipfile.ZipInfo(name or "x"), data.draw(st.binary(max_size=64))])
        elif op == "mode":
            entries[i][0].external_attr = data.draw(st.integers(0, 2**32 - 1))
        elif op == "compress":
            entries[i][0].compress_type = data.draw(st.sampled_from([0, 8, 12, 14]))
        elif op == "flags":
            entries[i][0].flag_bits = data.draw(st.integers(0, 0xFFFF)) & ~0x0808
        else:
            payload = bytearray(entries[i][1])
            if payload:
                payload[data.draw(st.integers(0, len(payload) - 1))] ^= data.draw(st.integers(1, 255))
            entries[i][1] = bytes(payload)
    raw = _build_zip([(info, payload) for info, payload in entries])
    if raw is None:
        return
    sums = None
    if data.draw(st.booleans()):  # an attacker re-writes the sums file to match
        sums_file = case.path.with_name("resigned.tt")
        write_sums(sums_file, {info.filename: payload for info, payload in entries if info.filename})
        sums = archive.sums_path(sums_file).read_bytes()
    case.attempt(raw, sums)


@settings(FUZZ, max_examples=200)
@given(sums=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_garbage_sums_file(case, sums):
    case.attempt(case.raw, sums)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**40) | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=10),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)


def _locations(value, path=()):
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _locations(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _locations(item, (*path, index))


def _attempt_resigned(case: Case, manifest: dict) -> None:
    """Load ``case``'s checkpoint with ``manifest``, file table and sums rewritten as an attacker would."""
    content = resign(dict(case.content), manifest)
    raw = _build_zip([(zipfile.ZipInfo(n), d) for n, d in content.items()])
    sums_file = case.path.with_name("resigned.tt")
    write_sums(sums_file, content)
    case.attempt(raw, archive.sums_path(sums_file).read_bytes(), resigned=True)


@pytest.mark.filterwarnings("ignore::torch_tweak.torch.checkpoint.CheckpointWarning")
@settings(FUZZ, max_examples=400)
@given(data=st.data())
def test_resigned_manifest_edits(case, data):
    manifest = json.loads(case.content["manifest.json"])
    locations = [p for p in _locations(manifest) if p and p[0] != "files"]
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(locations))
        parent = manifest
        for step in where[:-1]:
            parent = parent[step]
        if isinstance(parent, dict) and data.draw(st.booleans()):
            parent.pop(where[-1], None)
        else:
            parent[where[-1]] = data.draw(JSON)
        locations = [p for p in _locations(manifest) if p and p[0] != "files"]
    _attempt_resigned(case, manifest)


_MARKER = Path(tempfile.gettempdir()) / "torch_tweak_fuzz_attack_ran"
ATTACKS = st.sampled_from([
    "/etc/passwd", "../../../../etc", str(_MARKER), f"touch {_MARKER}",
    {"cpp.cxx": f"sh -c 'touch {_MARKER}'"}, {"global_cache_dir": "/"}, {"trace.enabled": True},
    "os:system", "subprocess:Popen", "numpy.lib.npyio:NpzFile", "builtins:eval", "importlib:import_module",
    ["map", "subprocess:Popen", ["args"], [["c", f"touch {_MARKER}"]]],
    ["dc", "subprocess:CompletedProcess", ["args", "returncode"], [["T"], ["c", 0]]],
    ["seq", "collections:UserList", [["T"]]], ["o", "os:system"],
    {"$tt": "artifact", "kind": "dir", "member": "../.."}, {"$tt": "artifact", "kind": "file", "member": "/etc/passwd"},
    "TorchInductorAOTBackend", "OpenVINOBackend", "BatchRouterBackend",
])


@pytest.mark.filterwarnings("ignore::torch_tweak.torch.checkpoint.CheckpointWarning")
@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_resigned_manifest_attack_values(case, data):
    """Values an attacker would try (paths, commands, class names, artifact references), placed anywhere in the
    manifest with the sums file rewritten: a CheckpointError or a harmless load, and nothing ever runs."""
    _MARKER.unlink(missing_ok=True)
    manifest = json.loads(case.content["manifest.json"])
    locations = [p for p in _locations(manifest) if p and p[0] != "files"]
    for _ in range(data.draw(st.integers(1, 2))):
        where = data.draw(st.sampled_from(locations))
        parent = manifest
        for step in where[:-1]:
            parent = parent[step]
        parent[where[-1]] = copy.deepcopy(data.draw(ATTACKS))
        locations = [p for p in _locations(manifest) if p and p[0] != "files"]
    _attempt_resigned(case, manifest)
    assert not _MARKER.exists()
