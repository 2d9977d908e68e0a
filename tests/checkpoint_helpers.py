"""Helpers shared by the checkpoint tests: tuning a tiny model, reading, forging and rewriting archives."""

from __future__ import annotations

import gc
import hashlib
import json
import zipfile
from pathlib import Path

import torch
from torch import nn
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.torch.backend import TorchEagerBackend
from torch_tweak.torch.checkpoint import archive
from torch_tweak.torch.module import forward as _forward
from torch_tweak.torch.module.wrapper import registered_modules


def eager() -> tt.OneBackendStrategy:
    return tt.OneBackendStrategy(TorchEagerBackend())


def tuned_mlp(name: str = "mlp", seed: int = 0) -> tt.Module:
    wrapped = tt.Module(mlp(seed), name=name, strategy=eager())
    tt.tune(wrapped, [torch.randn(8) for _ in range(4)])
    return wrapped


def save_mlp(path: Path, seed: int = 0) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """Save an eager-tuned MLP to ``path``; return the path, an input and the expected output."""
    wrapped = tuned_mlp(seed=seed)
    x = torch.randn(3, 8)
    expected = wrapped(x)
    tt.save(wrapped, path)
    del wrapped
    gc.collect()  # frees the name "mlp" for the loads that follow
    return path, x, expected


def members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def write_sums(path: Path, listed: dict[str, bytes]) -> None:
    lines = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in sorted(listed.items()))
    archive.sums_path(path).write_text(lines)


def write_zip(path: Path, entries: list[tuple[zipfile.ZipInfo | str, bytes]], sums: dict[str, bytes] | None = None):
    """Write ``entries`` as a zip and a sums file listing ``sums`` (default: every entry)."""
    with zipfile.ZipFile(path, "w") as zf:
        for info, data in entries:
            zf.writestr(info, data)
    write_sums(path, sums if sums is not None else
               {(i.filename if isinstance(i, zipfile.ZipInfo) else i): d for i, d in entries})


def resign(content: dict[str, bytes], data: dict) -> dict[str, bytes]:
    """Members with ``data`` as a manifest whose file table matches ``content`` (as an attacker could write)."""
    content = {n: d for n, d in content.items() if n != "manifest.json"}
    data["files"] = {n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in content.items()
                     if n != "signature.json"}  # the signature covers the manifest, so the manifest does not list it
    content["manifest.json"] = json.dumps(data).encode()
    return content


def rewrite(path: Path, edit_manifest=None, extra: dict[str, bytes] | None = None) -> None:
    """Rewrite a checkpoint with an edited manifest and extra members, re-signing everything."""
    content = members(path)
    data = json.loads(content["manifest.json"])
    content.update(extra or {})
    if edit_manifest is not None:
        edit_manifest(data)
    write_zip(path, list(resign(content, data).items()))


def snapshot(model: nn.Module) -> tuple:
    return ([type(m).__name__ for m in model._modules.values()],
            [_forward.is_intercepted(m) for m in model.modules()],
            {k: v.clone() for k, v in model.state_dict().items()}, set(registered_modules()))


def assert_untouched(model: nn.Module, before: tuple) -> None:
    after = snapshot(model)
    assert after[:2] == before[:2] and after[3] == before[3]
    assert after[2].keys() == before[2].keys()
    assert all(torch.equal(after[2][k], v) for k, v in before[2].items())
