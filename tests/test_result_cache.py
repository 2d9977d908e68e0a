"""Reused tuning results: a second run builds only what it chooses; a killed run resumes.

(With screening, a candidate that a killed run had screened but not yet swept is built again on resume, to
be swept; the kill test turns screening off so that "finished" means fully measured.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from toy_models import mlp

import torch_tweak.torch as tt
from torch_tweak.torch.profiling import ProfilingConfig
from torch_tweak.torch.testing import FakeClock, TimedBackend

BUILDS: list[str] = []


class Counted(TimedBackend):
    """Records every build, so a test can tell what a run built."""

    def _build(self, module, graph_spec, data, cache_dir):
        BUILDS.append(self.describe())
        return super()._build(module, graph_spec, data, cache_dir)


@pytest.fixture
def clock():
    BUILDS.clear()
    return FakeClock()


def run(clock, backends, model=None, **kwargs):
    strat = tt.HighestThroughputStrategy(backends, profiling=ProfilingConfig(clock=clock, pause_s=0, min_time_s=0),
                                         baseline=Counted(clock, ms_per_call=1.0), **kwargs)
    model = model or mlp()
    reference = mlp(seed=1) if model is not None and torch.equal(model[0].weight, mlp(seed=1)[0].weight) else mlp()
    wrapped = tt.Module(model, strategy=strat)
    report = tt.tune(wrapped, [torch.randn(8) for _ in range(4)], batch_sizes=[1, 2, 4, 8],
                     ignore_failing_modules=False)
    x = torch.randn(3, 8)
    torch.testing.assert_close(wrapped(x), reference(x))
    return {c.backend: c for c in report.modules[0].graphs[0].candidates}, report.modules[0].graphs[0]


def backends(clock):
    return [Counted(clock, ms_per_call=0.5), Counted(clock, ms_per_call=0.8), Counted(clock, ms_per_call=9.0)]


def test_second_run_reuses_every_result_and_builds_only_the_chosen(clock):
    first, graph = run(clock, backends(clock))
    assert len(BUILDS) == 4 and not any(row.reused for row in first.values())
    BUILDS.clear()
    second, again = run(clock, backends(clock))
    assert again.chosen == graph.chosen == Counted(clock, ms_per_call=0.5).describe()
    assert BUILDS == [graph.chosen]  # built again to serve; nothing else
    assert all(row.reused for row in second.values())
    assert {k: (r.status, r.measurements["batch_sizes"]) for k, r in second.items()} == \
        {k: (r.status, r.measurements["batch_sizes"]) for k, r in first.items()}


def test_changed_weights_miss_every_result(clock):
    run(clock, backends(clock))
    BUILDS.clear()
    rows, _ = run(clock, backends(clock), model=mlp(seed=1))
    assert len(BUILDS) == 4 and not any(row.reused for row in rows.values())


def test_a_changed_backend_config_misses_only_its_own_result(clock):
    run(clock, backends(clock))
    BUILDS.clear()
    changed = [Counted(clock, ms_per_call=0.5), Counted(clock, ms_per_call=0.8), Counted(clock, ms_per_call=7.0)]
    rows, _ = run(clock, changed)
    assert BUILDS == [changed[2].describe(), changed[0].describe()]  # the new config, then the winner to serve
    assert not rows[changed[2].describe()].reused and rows[changed[1].describe()].reused


def test_reuse_can_be_turned_off(clock):
    run(clock, backends(clock))
    BUILDS.clear()
    rows, _ = run(clock, backends(clock), reuse_results=False)
    assert len(BUILDS) == 4 and not any(row.reused for row in rows.values())


def test_a_malformed_stored_result_is_a_miss(clock, caplog):
    run(clock, backends(clock))
    results = list(Path(tt.config.cache_dir).rglob("results/*.json"))
    assert len(results) == 4
    for path in results:
        path.write_text(json.dumps({"format": 1, "row": {"backend": 3}, "sweep": None}))
    BUILDS.clear()
    rows, _ = run(clock, backends(clock))
    assert len(BUILDS) == 4 and "Ignoring the stored tuning result" in caplog.text


_CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    sys.path.insert(0, sys.argv[2])
    from toy_models import mlp
    import torch_tweak.torch as tt
    from torch_tweak.torch.profiling import ProfilingConfig
    from torch_tweak.torch.testing import FakeClock, TimedBackend

    class Logged(TimedBackend):
        def _build(self, module, graph_spec, data, cache_dir):
            with open(os.environ["BUILD_LOG"], "a") as log:
                log.write(self.describe() + "\\n")
            if self.timing.label == "dies" and os.environ.get("KILL") == "1":
                os.kill(os.getpid(), signal.SIGKILL)  # the run dies midway, as with kill -9
            return super()._build(module, graph_spec, data, cache_dir)

    tt.config.cache_dir = sys.argv[1]
    clock = FakeClock()
    candidates = [Logged(clock, ms_per_call=0.5), Logged(clock, ms_per_call=0.8), Logged(clock, label="dies")]
    strategy = tt.HighestThroughputStrategy(candidates, baseline=Logged(clock, ms_per_call=1.0), screening=False,
                                            profiling=ProfilingConfig(clock=clock, pause_s=0, min_time_s=0))
    wrapped = tt.Module(mlp(), strategy=strategy)
    report = tt.tune(wrapped, [torch.randn(8) for _ in range(4)], batch_sizes=[1, 2, 4, 8])
    print(sorted(c.backend for c in report.modules[0].graphs[0].candidates if c.reused))
""")


def test_a_killed_run_resumes_without_rebuilding_what_finished(tmp_path):
    log = tmp_path / "builds.txt"
    tests = str(Path(__file__).parent)

    def child(kill: bool) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "BUILD_LOG": str(log), "KILL": "1" if kill else "0"}
        return subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "cache"), tests], capture_output=True,
                              text=True, env=env, timeout=300)

    killed = child(kill=True)
    assert killed.returncode == -9, killed.stderr[-2000:]
    first = log.read_text().splitlines()
    assert first[-1] == "Logged(label=dies)" and len(first) == 4  # baseline, two candidates, then killed
    log.unlink()
    resumed = child(kill=False)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rebuilt = log.read_text().splitlines()
    assert rebuilt == ["Logged(label=dies)", "Logged(ms_per_call=0.5)"]  # the rest, then the winner
    assert resumed.stdout.strip().endswith(
        "['Logged()', 'Logged(ms_per_call=0.5)', 'Logged(ms_per_call=0.8)']")


def test_a_candidate_serving_two_batch_ranges_is_built_once_when_reused(clock):
    """A router sends batch 1 and 8 to one candidate and batch 2-7 to another: the second run builds each once."""
    def candidates():
        return [Counted(clock, ms_per_call=0.1, ms_per_sample=0.1),
                Counted(clock, ms_per_call=0.25, ms_per_sample_squared=0.012)]

    _, graph = run(clock, candidates())
    assert graph.chosen.startswith("BatchRouterBackend(batch<=1: ") and graph.chosen.count("ms_per_call=0.1,") == 2
    BUILDS.clear()
    _, again = run(clock, candidates())
    assert again.chosen == graph.chosen
    assert sorted(BUILDS) == sorted(c.describe() for c in candidates())  # each once, though one serves two ranges


RELEASED: list[str] = []


class Scratch(Counted):
    """Records every release of its runtime's scratch memory."""

    def release_scratch(self):
        RELEASED.append(self.describe())


def test_a_candidate_built_again_to_serve_releases_its_scratch_memory_after_its_check(clock):
    RELEASED.clear()
    run(clock, [Scratch(clock, ms_per_call=0.5)])
    assert RELEASED == []  # built and checked here in the first run: kept as measured
    _, graph = run(clock, [Scratch(clock, ms_per_call=0.5)])
    assert RELEASED == [graph.chosen]  # reused, built again and confirmed: the check's buffers are released


class Compiled(Counted):
    """A candidate whose build compiles: built again to serve, it compiles again (no files to reuse)."""

    rebuilds_from_files = False


@pytest.mark.parametrize(("kind", "b1_gain", "routed"), [
    (Compiled, 1.15, False),  # within the noise: not worth compiling again in this process
    (Compiled, 1.6, True),
    (Counted, 1.15, True),  # built again from its files (or for free): the eager margin is enough
])
def test_a_route_to_a_reused_candidate_that_compiles_again_needs_a_gain_above_noise(clock, kind, b1_gain, routed):
    """The first run builds every candidate here, so a 15 % faster batch-1 route is served; the second run reuses the
    measurements and would have to compile that candidate again to serve the route."""
    def candidates():
        large = Counted(clock, ms_per_call=0.5, ms_per_sample=0.02)  # b1 0.52 ms, b8 0.66 ms (eager: 1 ms a call)
        return [large, kind(clock, ms_per_call=round(0.52 / b1_gain - 0.2, 3), ms_per_sample=0.2)]

    _, graph = run(clock, candidates())
    fast_b1 = candidates()[1].describe()
    assert graph.chosen.startswith(f"BatchRouterBackend(batch<=1: {fast_b1}")  # built here: the margin is eager's
    BUILDS.clear()
    rows, again = run(clock, candidates())
    assert all(row.reused for row in rows.values())
    if routed:
        assert again.chosen == graph.chosen and fast_b1 in BUILDS
    else:
        assert again.chosen == candidates()[0].describe() and fast_b1 not in BUILDS
        assert rows[fast_b1].status != "chosen"


def test_stored_probes_restore_only_the_names_asked_for(caplog):
    from torch_tweak.torch.tune_strategy.result_cache import ResultCache

    class Spec:
        def to_dict(self):
            return {"inputs": "x"}

    def cache():
        return ResultCache(mlp(), Spec(), {"strategy": "test"})

    cache().store_probes({"kernel_time": [1, 0.5, 1.0], "other": 2}, ("kernel_time", "other"))
    probed: dict = {}
    cache().restore_probes(probed, ("kernel_time",))  # what the caller names, nothing else of the file
    assert probed == {"kernel_time": [1, 0.5, 1.0]}
    stored = [p for p in Path(tt.config.cache_dir).rglob("results/*.json") if "kernel_time" in p.read_text()]
    assert len(stored) == 1
    stored[0].write_text("{not json")
    probed = {}
    cache().restore_probes(probed, ("kernel_time",))
    assert probed == {} and "Ignoring the stored probes" in caplog.text
    changed = ResultCache(mlp(seed=1), Spec(), {"strategy": "test"})  # other weights: another key
    changed.restore_probes(probed, ("kernel_time",))
    assert probed == {}
