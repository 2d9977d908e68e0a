"""Execution graphs: signatures, batch and dynamic axis detection, GraphSpec round trips."""

from __future__ import annotations

import json

import pytest
import torch
from toy_models import DataclassModel, Doubler, KwargsModel, Pair, SeqModel, cnn

import torch_tweak.torch as tt
from torch_tweak.errors import ConfigError
from torch_tweak.torch.module.recording import record
from torch_tweak.torch.module.spec import GraphSpec, resize_batch


def dry_run(model, dataset, **kwargs):
    wrapped = tt.Module(model) if not isinstance(model, tt.Module) else model
    report = tt.tune(wrapped, dataset, dry_run=True, **kwargs)
    return wrapped, report


def test_cnn_batch_axis_from_three_batch_sizes():
    wrapped, report = dry_run(cnn(), [torch.randn(3, 8, 8) for _ in range(4)], batch_sizes=[1, 2, 4])
    (spec,) = wrapped.graph_specs
    (x,) = spec.inputs
    assert x.shape == ("batch0", 3, 8, 8)
    assert x.min_shape == (1, 3, 8, 8) and x.max_shape == (4, 3, 8, 8)
    assert x.batch_multipliers == {0: 1}
    assert spec.outputs[0].shape == ("batch0", 3)
    assert spec.batch_range() == (1, 4)
    assert report.dry_run and report.modules[0].status == "dry_run"
    assert wrapped.state is tt.ModuleState.RECORDING


def test_sequence_length_varying_independently_is_a_dynamic_axis():
    items = [{"input_ids": torch.randint(0, 50, (n,)), "attention_mask": torch.ones(n)} for n in (5, 9, 7, 12)]
    wrapped, _ = dry_run(SeqModel(), items, batch_sizes=[1, 2])
    (spec,) = wrapped.graph_specs
    ids = next(t for t in spec.inputs if t.name == "kwargs_input_ids")
    assert ids.shape == ("batch0", "dim1")
    assert ids.min_shape[1] == 5 and ids.max_shape[1] == 12
    assert ids.dynamic_axes() == [1]
    assert [t.locator for t in spec.outputs] == ["outputs['last_hidden_state']", "outputs['pooled']"]
    assert spec.outputs[0].shape == ("batch0", "dim1", 8)
    assert spec.outputs[1].shape == ("batch0", 8)


def test_single_batch_size_gives_static_shapes():
    wrapped, _ = dry_run(cnn(), [torch.randn(3, 8, 8)] * 2, batch_sizes=[2])
    assert wrapped.graph_specs[0].inputs[0].shape == (2, 3, 8, 8)
    assert not wrapped.graph_specs[0].has_batch_axis()


def test_stacked_batch_gets_multiplier_two():
    child = tt.Module(cnn())
    tt.tune(Doubler(child), [torch.randn(3, 8, 8)] * 4, batch_sizes=[1, 2, 4], dry_run=True)
    (x,) = child.graph_specs[0].inputs
    assert x.shape[0] == "batch0" and x.batch_multipliers == {0: 2}
    assert child.graph_specs[0].batch_range() == (1, 4)


def test_strict_mode_separates_non_tensor_values():
    items = [((torch.randn(6),), {"scale": s}) for s in (1.0, 2.0)]
    wrapped, _ = dry_run(KwargsModel(), items, batch_sizes=[1, 2])
    assert len(wrapped.graph_specs) == 2


def test_non_strict_mode_merges_non_tensor_values():
    tt.config.strict_mode = False
    items = [((torch.randn(6),), {"scale": s}) for s in (1.0, 2.0)]
    wrapped, _ = dry_run(KwargsModel(), items, batch_sizes=[1, 2])
    assert len(wrapped.graph_specs) == 1
    assert wrapped.graph_specs[0].strict is False


def test_rank_and_structure_make_distinct_graphs():
    items = [((torch.randn(6),), {}), ((torch.randn(6),), {"mask": torch.ones(6)})]
    wrapped, _ = dry_run(KwargsModel(), items, batch_sizes=[1, 2])
    assert [g.name for g in wrapped.graph_specs] == ["0", "1"]
    assert [len(g.inputs) for g in wrapped.graph_specs] == [1, 2]


def test_keyword_order_does_not_matter():
    model = SeqModel()
    ids, mask = torch.randint(0, 50, (2, 4)), torch.ones(2, 4)
    graphs = record(model, [(2, ((), {"input_ids": ids, "attention_mask": mask})),
                            (2, ((), {"attention_mask": mask, "input_ids": ids}))])
    assert len(graphs) == 1


def test_graph_spec_round_trip_and_table():
    wrapped, _ = dry_run(KwargsModel(), [((torch.randn(6),), {"mask": torch.ones(6), "scale": 2.0})] * 2)
    spec = wrapped.graph_specs[0]
    data = json.loads(json.dumps(spec.to_dict()))
    again = GraphSpec.from_dict(data)
    assert again == spec
    assert again.output_structure[1] is Pair
    table = str(spec)
    for column in ("locator", "name", "shape", "min", "max", "dtype", "kwargs['mask']", "batch0"):
        assert column in table


def test_dataclass_outputs_are_described():
    wrapped, _ = dry_run(DataclassModel(), [torch.randn(5)] * 2)
    assert [t.locator for t in wrapped.graph_specs[0].outputs] == ["outputs.hidden", "outputs.score"]


def test_resize_batch_and_example_inputs():
    wrapped, _ = dry_run(cnn(), [torch.randn(3, 8, 8) for _ in range(2)])
    spec = wrapped.graph_specs[0]
    sample = ((torch.arange(2.0).reshape(2, 1, 1, 1).expand(2, 3, 8, 8).contiguous(),), {})
    (big,), _ = resize_batch(sample, spec, 5)
    assert big.shape == (5, 3, 8, 8)
    assert big[:, 0, 0, 0].tolist() == [0.0, 1.0, 0.0, 1.0, 0.0]
    (example,), kwargs = spec.example_inputs(batch_size=3)
    assert example.shape == (3, 3, 8, 8) and kwargs == {}
    assert spec.with_max_batch_size(64).batch_range() == (1, 64)
    static, _ = dry_run(cnn(), [torch.randn(3, 8, 8)] * 2, batch_sizes=[2])
    with pytest.raises(ConfigError, match="no batch axis"):
        resize_batch(sample, static.graph_specs[0], 2)


@pytest.mark.parametrize("strict", [True, False])
def test_graph_key_from_spec_matches_the_recorded_key(strict):
    from torch_tweak.torch.module.recording import Recorder

    recorder = Recorder(strict, 2)
    calls = [
        ((torch.randn(2, 6),), {"mask": torch.ones(2, 6), "scale": 2.0}),
        ((torch.randn(2, 6),), {}),
        (([torch.ones(2, 6), (torch.ones(2), None)],), {"opts": {"k": 3, "t": torch.ones(1)}}),
    ]

    def forward(*args, **kwargs):
        return Pair(torch.ones(1), args[0] if isinstance(args[0], torch.Tensor) else args[0][0])

    for args, kwargs in calls:
        recorder.record_call(forward, args, kwargs, 2)
    for key, graph in recorder.graphs.items():
        spec = GraphSpec.from_dict(json.loads(json.dumps(graph.graph_spec().to_dict())))
        assert spec.key() == key


class _Cache:
    def __init__(self, length: int) -> None:
        self.length = length

    def get_seq_length(self) -> int:
        return self.length


class _LM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, cache_position=None, past_key_values=None):
        return self.lin(x)


def test_llm_phases_are_separate_graphs():
    lm = tt.Module(_LM())
    tt.tune(lm, [((torch.randn(4),), {"cache_position": torch.arange(1)}),
                 ((torch.randn(4),), {"cache_position": torch.tensor([5])})], dry_run=True)
    specs = lm.graph_specs
    assert [s.name for s in specs] == ["0-prefill", "1-decode"]
    assert GraphSpec.from_dict(specs[1].to_dict()).key() == specs[1].key()
    assert "(decode phase)" in str(specs[1])

    with_cache = tt.Module(_LM())

    def generate(x):
        with_cache(x, past_key_values=_Cache(0))
        return with_cache(x, past_key_values=_Cache(7))

    tt.tune(generate, [torch.randn(4)], dry_run=True)
    assert [s.phase for s in with_cache.graph_specs] == ["prefill", "decode"]


def test_phase_detection_can_be_disabled():
    tt.config.llm_phase_detection = False
    lm = tt.Module(_LM())
    tt.tune(lm, [((torch.randn(4),), {"cache_position": torch.arange(1)}),
                 ((torch.randn(4),), {"cache_position": torch.tensor([5])})], dry_run=True)
    assert [s.phase for s in lm.graph_specs] == [None]


class _Counting(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 3)
        self.batches: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batches.append(x.shape[0])
        return self.linear(x)


def test_later_batch_sizes_run_one_batch_of_the_items_the_first_ran_in_full(caplog):
    items = [torch.randn(8) for _ in range(8)]
    model = _Counting()
    with caplog.at_level("INFO", logger="torch_tweak"):
        wrapped, _ = dry_run(model, items, batch_sizes=[1, 2, 4])
    assert model.batches == [1] * 8 + [2, 4]
    assert wrapped.graph_specs[0].batch_range() == (1, 4)
    assert any("Batch size 2: ran 1 batch(es)" in r.getMessage() for r in caplog.records)

    model = _Counting()
    dry_run(model, items, batch_sizes=[1, 2, 4], max_num_batches_per_batch_size=3)  # the argument caps every size
    assert model.batches == [1] * 3 + [2] * 3 + [4] * 2

    model = _Counting()
    tt.config.max_num_batches_after_first_size = None
    try:
        dry_run(model, items, batch_sizes=[4, 1])
    finally:
        tt.config.max_num_batches_after_first_size = 1
    assert model.batches == [4] * 2 + [1] * 8
    with pytest.raises(ConfigError, match="max_num_batches_after_first_size"):
        tt.config.max_num_batches_after_first_size = 0


def test_every_batch_size_keeps_an_in_memory_sample_before_a_second_shape():
    from torch_tweak.torch.module.state import internals

    items = [{"input_ids": torch.randint(0, 50, (n,)), "attention_mask": torch.ones(n)} for n in (5, 9, 7, 12, 6, 4)]
    wrapped, _ = dry_run(SeqModel(), items, batch_sizes=[1, 2, 3])
    (graph,) = internals(wrapped).recorded_graphs()
    assert len(graph.samples) == tt.config.max_num_samples_stored == 4
    assert [s.batch_size for s in graph.samples] == [1, 1, 2, 3]  # the third and fourth length gave way
    assert [s.sample[1]["input_ids"].shape[1] for s in graph.samples] == [5, 9, 5, 5]
