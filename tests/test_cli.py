"""The ``torch-tweak`` command line, each command run in a subprocess: output, exit codes and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch
from report_samples import sample_report
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.torch.backend import TorchEagerBackend
from torch_tweak.torch.cache import CACHE_MARKER


def cli(*args, cache=None, code=None, timeout=300):
    env = {**os.environ, "TORCH_TWEAK_PROGRESS": "0"}
    env.pop("TORCH_TWEAK_DEBUG", None)
    if cache is not None:
        env["TORCH_TWEAK_CACHE_DIR"] = str(cache)
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "torch_tweak.cli", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


class InProcess:
    """``main(argv)`` run in this process (for the variations of a command already run as a subprocess)."""

    def __init__(self, capsys):
        self.capsys = capsys

    def __call__(self, *args):
        from torch_tweak.cli import main

        code = main([str(a) for a in args])
        out, err = self.capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)


@pytest.fixture
def run(capsys):
    return InProcess(capsys)


def one_line_error(done, command, *fragments):
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"torch-tweak {command}: error: "), done.stderr
    assert "Traceback" not in done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def checkpoint(tmp_path):
    if not hasattr(tt, "save"):
        pytest.skip("tt.save is not available")
    wrapped = tt.Module(mlp(), name="mlp", strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    tt.tune(wrapped, [torch.randn(8) for _ in range(4)], batch_sizes=[1, 2])
    return tt.save(wrapped, tmp_path / "model.tt")


def test_help_everywhere():
    done = cli("--help")
    assert done.returncode == 0 and all(c in done.stdout for c in ("demo", "report", "verify", "cache"))
    for command in ("demo", "report", "verify", "cache"):
        done = cli(command, "--help")
        assert done.returncode == 0 and done.stdout.startswith(f"usage: torch-tweak {command}"), done.stderr
    assert cli().returncode == 2 and cli("bogus").returncode == 2 and cli("cache", "wipe").returncode == 2


def test_quick_demo_prints_the_table_and_writes_report_html_and_checkpoint(tmp_path):
    out = tmp_path / "demo"
    done = cli("demo", "--quick", "--out", out, cache=tmp_path / "cache", timeout=600)
    assert done.returncode == 0, done.stderr
    for text in ("Tuning report", "demo_cnn", "demo_encoder", "TorchEagerBackend() (baseline)", "vs eager",
                 f"JSON report:  {out / 'report.json'}", f"HTML report:  {out / 'report.html'}"):
        assert text in done.stdout, text
    assert tt.TuningReport.load(out / "report.json").modules[1].name == "demo_encoder"
    assert "<img" in (out / "report.html").read_text()
    assert len(list((tmp_path / "cache" / "reports").glob("*.json"))) == 2  # one per tt.tune
    if hasattr(tt, "save"):
        assert f"checkpoint:   {out / 'demo.tt'}" in done.stdout and (out / "demo.tt").is_file()
        assert cli("verify", out / "demo.tt").returncode == 0


def test_report_prints_the_table_and_writes_html(tmp_path):
    path = tmp_path / "r.json"
    sample_report().to_json(path)
    done = cli("report", path, "--html", tmp_path / "r.html")
    assert done.returncode == 0, done.stderr
    assert "OpenVINOBackend()" in done.stdout and "2.58x" in done.stdout
    assert f"HTML report: {tmp_path / 'r.html'}" in done.stdout and (tmp_path / "r.html").stat().st_size > 10_000


def test_report_refuses_what_is_not_a_report_or_is_newer(tmp_path, run):
    newer = sample_report().to_dict()
    newer["schema_version"] = 99
    cases = {"newer.json": (json.dumps(newer), "schema version 99 is not supported"),
             "other.json": (json.dumps({"name": "package.json"}), "not a torch_tweak tuning report"),
             "text.json": ("hello", "not JSON"),
             "list.json": ("[1, 2]", "not a torch_tweak tuning report")}
    for i, (name, (text, message)) in enumerate(cases.items()):
        (tmp_path / name).write_text(text)
        runner = cli if i < 2 else run
        one_line_error(runner("report", tmp_path / name, "--html", tmp_path / "x.html"), "report", name, message)
    assert not (tmp_path / "x.html").exists()
    one_line_error(run("report", tmp_path / "missing.json"), "report", "missing.json")


def test_verify_accepts_a_good_checkpoint_without_importing_backends(checkpoint):
    done = cli("verify", checkpoint)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"OK: {checkpoint}") and "module mlp" in done.stdout
    probe = (f"import sys; from torch_tweak.cli import main; rc = main(['verify', {str(checkpoint)!r}]); "
             "loaded = [m for m in ('openvino', 'torchao', 'torch._inductor') if m in sys.modules]; "
             "print('LOADED', loaded); sys.exit(rc)")
    done = cli(code=probe)
    assert done.returncode == 0 and "LOADED []" in done.stdout, done.stdout + done.stderr


def test_verify_names_the_tampered_member(checkpoint, tmp_path, run):
    tampered = tmp_path / "tampered.tt"
    with zipfile.ZipFile(checkpoint) as source, zipfile.ZipFile(tampered, "w") as target:
        members = [(info, source.read(info.filename)) for info in source.infolist()]
        victim = next(info.filename for info, _ in members if info.filename.endswith(".safetensors"))
        for info, data in members:
            if info.filename == victim:
                data = data[:-1] + bytes([data[-1] ^ 1])
            target.writestr(info, data)
    sums = checkpoint.with_name("model_sha256_sums.txt")
    tampered.with_name("tampered_sha256_sums.txt").write_text(sums.read_text())
    one_line_error(cli("verify", tampered), "verify", victim)
    one_line_error(run("verify", tmp_path / "absent.tt"), "verify", "absent.tt")
    (tmp_path / "junk.tt").write_bytes(b"not a zip")
    one_line_error(run("verify", tmp_path / "junk.tt"), "verify", "junk.tt")


def test_cache_list_and_clear(tmp_path, run):
    cache = tmp_path / "cache"
    done = run("cache", "list", "--cache-dir", cache)
    assert done.returncode == 0 and "does not exist" in done.stdout
    tt.config.cache_dir = cache
    wrapped = tt.Module(mlp(), name="mlp", strategy=tt.OneBackendStrategy(TorchEagerBackend()))
    tt.tune(wrapped, [torch.randn(8) for _ in range(4)], batch_sizes=[1, 2])
    done = cli("cache", "list", cache=cache)
    assert done.returncode == 0 and f"cache folder {cache}" in done.stdout
    assert "mlp/  1 graphs, 1 candidate builds" in done.stdout and "reports/  1 tuning reports" in done.stdout
    outside = tmp_path / "keep.txt"
    outside.write_text("mine")
    done = cli("cache", "clear", "--cache-dir", cache)
    assert done.returncode == 0 and f"cleared {cache}" in done.stdout
    assert not cache.exists() and outside.read_text() == "mine"
    assert "nothing to clear" in run("cache", "clear", "--cache-dir", cache).stdout


def test_cache_clear_refuses_a_folder_that_is_not_ours(tmp_path, run):
    foreign = tmp_path / "home"
    (foreign / "docs").mkdir(parents=True)
    (foreign / "docs" / "thesis.tex").write_text("precious")
    one_line_error(cli("cache", "clear", "--cache-dir", foreign), "cache", "Refusing", CACHE_MARKER)
    assert (foreign / "docs" / "thesis.tex").read_text() == "precious"
    done = run("cache", "list", "--cache-dir", foreign)
    assert done.returncode == 0 and "not created by torch_tweak" in done.stdout
    link = tmp_path / "link"
    link.symlink_to(foreign)
    (foreign / CACHE_MARKER).touch()
    one_line_error(run("cache", "clear", "--cache-dir", link), "cache", "symbolic link")
    assert (foreign / "docs" / "thesis.tex").is_file()
