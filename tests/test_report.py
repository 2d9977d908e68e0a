"""TuningReport: the table, JSON with schema version and environment, the stored report, the progress display."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from report_samples import sample_report
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.errors import ConfigError
from torch_tweak.torch.backend import TorchEagerBackend
from torch_tweak.torch.cache import cache_root
from torch_tweak.torch.profiling import ProfilingConfig
from torch_tweak.torch.report.report import SCHEMA_VERSION, TABLE_HEADERS
from torch_tweak.torch.testing import WrongOutputBackend

FAST = ProfilingConfig(warmup_calls=1, min_calls=5, window_size=5, min_time_s=0.0, max_time_s=0.02, max_calls=50,
                       pause_s=0.0)


def tuned_mlp_report(batch_sizes=(1, 2, 4)):
    strategy = tt.HighestThroughputStrategy([TorchEagerBackend(), WrongOutputBackend()], profiling=FAST)
    wrapped = tt.Module(mlp(), name="mlp", strategy=strategy)
    return tt.tune(wrapped, [torch.randn(8) for _ in range(8)], batch_sizes=list(batch_sizes))


def test_table_has_every_column_with_speedup_and_notes():
    text = str(sample_report())
    lines = text.splitlines()
    assert all(h in lines[2] for h in TABLE_HEADERS)
    row = next(line for line in lines if "| OpenVINOBackend() " in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "chosen" and cells[10] == "*" and cells[4] == "fp32"
    assert cells[6].endswith("/s @8") and cells[9] == "2.58x"
    latency = next(line for line in lines if "| head " in line and "Inductor" in line)
    assert "1.60x" in latency and "@1" in latency  # latency strategy: p50 ratio at batch 1
    assert "rejected [1]" in text and "build_failed [2]" in text and "passthrough [3]" in text
    assert "[2] text_encoder/0 OpenVINOBackend(performance_hint=THROUGHPUT): BuildError: conversion failed" in text
    assert "second line" not in text


def test_rows_tolerate_missing_and_non_finite_numbers():
    report = sample_report()
    cand = report.modules[0].graphs[0].candidates[3]
    cand.fidelity = {**cand.fidelity, "max_abs_error": "nan"}
    report.modules[0].graphs[0].candidates[0].measurements = {"runs": "garbage"}
    rows = report.rows()
    assert rows[3][5] == "nan" and all(len(r) == len(TABLE_HEADERS) for r in rows)
    assert rows[1][9] == ""  # no baseline measurement, no speed-up
    str(report)


def test_json_round_trip_keeps_schema_environment_and_measurements():
    report = sample_report()
    data = json.loads(report.to_json())
    assert data["schema_version"] == SCHEMA_VERSION
    env = data["environment"]
    assert env["cpu"]["logical_cores"] == os.cpu_count() and isinstance(env["cpu"]["flags"], list)
    assert env["versions"]["torch"] == torch.__version__ and "torch_num_threads" in env["threads"]
    again = tt.TuningReport.from_dict(data)
    assert again.to_dict() == report.to_dict()
    assert str(again) == str(report)


def test_from_dict_refuses_newer_schema_and_non_reports(tmp_path):
    data = sample_report().to_dict()
    with pytest.raises(ConfigError, match="schema version 99 is not supported"):
        tt.TuningReport.from_dict({**data, "schema_version": 99})
    for bad in ([1, 2], {"modules": []}, {"schema_version": 1, "modules": [{"graphs": [{"candidates": [5]}]}]},
                {"schema_version": "1", "modules": []}):
        with pytest.raises(ConfigError):
            tt.TuningReport.from_dict(bad)
    extra = {**data, "future_field": 1}
    extra["modules"][0]["graphs"][0]["candidates"][0]["future"] = True
    assert tt.TuningReport.from_dict(extra).modules[0].name == "text_encoder"
    old = {"schema_version": 1, "modules": [], "device": "cpu", "environment": {}}
    assert tt.TuningReport.from_dict(old).environment == {}
    path = tmp_path / "x.json"
    path.write_text("not json")
    with pytest.raises(ConfigError, match="not JSON"):
        tt.TuningReport.load(path)


def test_tune_fills_environment_and_stores_the_report_in_the_cache():
    report = tuned_mlp_report()
    graph = report.modules[0].graphs[0]
    assert graph.candidates[0].role == "baseline" and graph.candidates[0].measurements["runs"]
    assert report.environment["cpu"]["logical_cores"] and report.created
    stored = sorted((tt.config.cache_dir / "reports").glob("*.json"))
    assert len(stored) == 1 and oct(stored[0].stat().st_mode & 0o777) == "0o600"
    loaded = tt.TuningReport.load(stored[0])
    assert loaded.to_dict() == report.to_dict()
    assert "1.00x" in str(report) and "rejected" in str(report)


def test_a_report_that_cannot_be_stored_does_not_fail_the_tune(tmp_path, caplog):
    cache_root()
    (tt.config.cache_dir / "reports").write_text("a file where the folder should be")
    report = tuned_mlp_report(batch_sizes=(1, 2))
    assert report.modules[0].status == "tuned"
    assert "Could not write the tuning report" in caplog.text


_PROGRAM = textwrap.dedent("""
    import logging, sys, torch
    sys.path.insert(0, {tests!r})
    import torch_tweak.torch as tt
    from test_report import tuned_mlp_report
    logging.basicConfig(level=logging.INFO, format="LOG %(name)s: %(message)s")
    tt.config.cache_dir = {cache!r}
    tt.config.progress = {setting}
    tuned_mlp_report()
    print("DONE", file=sys.stderr)
""")


def _run(tmp_path, setting, tty):
    code = _PROGRAM.format(tests=os.path.dirname(__file__), cache=str(tmp_path / "c"), setting=setting)
    if not tty:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stderr
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=follower)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + 300
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 1.0)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(leader)
    assert proc.wait(30) == 0
    return b"".join(chunks).decode("utf-8", "replace")


def test_progress_is_live_on_a_terminal_and_keeps_log_lines_whole(tmp_path):
    out = _run(tmp_path, None, tty=True)
    assert "\r\x1b[2K[torch_tweak] tuning" in out
    for phase in ("record", "build", "check", "measure"):
        assert f"> {phase} " in out, phase
    assert "mlp > graph 0 > TorchEagerBackend() > measure" in out
    # What a terminal shows on each line: the text after the last carriage return (each erases the line).
    screen = [line.split("\r")[-1].replace("\x1b[2K", "") for line in out.replace("\r\n", "\n").split("\n")]
    logs = [line for line in screen if "LOG " in line]
    assert logs and all(line.startswith("LOG ") for line in logs)
    assert any("Tuned 1 module(s)" in line for line in logs)
    assert out.rstrip().endswith("DONE")  # the status line was erased at the end
    for log in (tmp_path / "c").rglob("build.log"):
        assert "[torch_tweak] tuning" not in log.read_text()


def test_progress_is_off_without_a_terminal_or_when_disabled(tmp_path):
    assert "[torch_tweak] tuning" not in _run(tmp_path, None, tty=False)
    assert "[torch_tweak] tuning" not in _run(tmp_path, False, tty=True)
    forced = _run(tmp_path, True, tty=False)
    lines = [line for line in forced.splitlines() if line.startswith("[torch_tweak] tuning")]
    assert "\x1b" not in forced and any("> build" in line for line in lines) and any("> measure" in line for line in lines)
