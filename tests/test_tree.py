"""Structure flattening, signatures and the JSON form of specs."""

from __future__ import annotations

import collections
import json
import math
from typing import Any

import pytest
import torch
from toy_models import Out, Pair

from torch_tweak.errors import UnsupportedInputError
from torch_tweak.torch.module import classes
from torch_tweak.torch.module.class_nodes import ContainerNode, DataclassNode, NamedTupleNode, OpaqueNode
from torch_tweak.torch.module.nodes import TENSOR, ConstNode, DictNode, ListNode, Node, TupleNode
from torch_tweak.torch.module.recording import graph_key, record
from torch_tweak.torch.module.spec import GraphSpec
from torch_tweak.torch.module.tree import (
    dispatch_key,
    flatten,
    flatten_sample,
    leaf_paths,
    map_tensors,
    register_container,
    resolve_type,
    sample_leaf_paths,
    signature,
    unflatten,
)
from torch_tweak.torch.module.tree_json import spec_from_json, spec_to_json


class Custom(collections.OrderedDict):
    pass


def test_round_trip_keeps_container_types():
    value = (
        torch.ones(2),
        [Pair(torch.zeros(1), None), {"a": torch.ones(3), "n": 3, "s": "text"}],
        Out(hidden=torch.ones(1), score=None),
        Custom(x=torch.ones(2)),
        torch.float16,
    )
    leaves, spec = flatten(value)
    assert len(leaves) == 5
    rebuilt = unflatten(spec, [t * 2 for t in leaves])
    assert type(rebuilt[1][0]) is Pair and rebuilt[1][0].second is None
    assert isinstance(rebuilt[2], Out) and rebuilt[2].score is None
    assert type(rebuilt[3]) is Custom and torch.equal(rebuilt[3]["x"], torch.full((2,), 2.0))
    assert rebuilt[1][1]["n"] == 3 and rebuilt[4] is torch.float16


def test_json_round_trip_resolves_only_imported_types():
    _, spec = flatten((Pair(torch.ones(1), 2.5), {"k": torch.dtype.__class__ and torch.float32}))
    text = json.dumps(spec_to_json(spec))
    assert spec_from_json(json.loads(text)) == spec
    with pytest.raises(UnsupportedInputError, match="not imported"):
        resolve_type("some_module_that_is_not_imported:Thing")
    with pytest.raises(UnsupportedInputError):
        spec_from_json(["dict", ["a"], []])
    with pytest.raises(UnsupportedInputError):
        spec_from_json(["c", {"eval": "os.system"}])


def test_signature_uses_ranks_structure_and_values():
    x = torch.ones(2, 3)
    assert signature((x,), {}, True) == signature((torch.zeros(7, 9),), {}, True)
    assert signature((x,), {}, True) != signature((torch.ones(2),), {}, True)
    assert signature((x,), {"s": 1.0}, True) != signature((x,), {"s": 2.0}, True)
    assert signature((x,), {"s": 1.0}, False) == signature((x,), {"s": 2.0}, False)
    assert signature((x,), {"a": 1, "b": x}, True) == signature((x,), {"b": x, "a": 1}, True)
    assert signature(([x],), {}, True) != signature(((x,),), {}, True)


def test_unrebuildable_objects_raise_clearly():
    class Opaque:
        pass

    leaves, spec = flatten((torch.ones(1), Opaque()))
    with pytest.raises(UnsupportedInputError, match="Cannot rebuild"):
        unflatten(spec, leaves)


def test_json_spec_refuses_classes_that_do_not_fit_their_node():
    import subprocess  # noqa: F401 - makes subprocess:Popen resolvable, as an attacker would hope

    for node in (["seq", "subprocess:Popen", [["c", "echo"]]],
                 ["ntuple", "builtins:tuple", []],
                 ["map", "subprocess:Popen", [], []],
                 ["dc", "collections:OrderedDict", [], []],
                 ["u", "collections:OrderedDict", [], []]):
        with pytest.raises(UnsupportedInputError, match="cannot stand for"):
            spec_from_json(node)


class Cache:
    """A registered tensor container: traversed for keys and leaves, passed on by reference."""

    def __init__(self) -> None:
        self.keys = [torch.ones(1, 2)]


register_container(Cache, lambda cache: {"keys": cache.keys})


class Opaque:
    pass


def test_flatten_makes_typed_nodes_that_equal_their_tagged_tuples():
    x = torch.ones(2)
    _, spec = flatten((x, [x, 1.5], {"k": None}, Pair(x, 2), Out(hidden=x), Cache(), Opaque()))
    assert type(spec) is TupleNode and all(isinstance(child, Node) for child in spec.children)
    tensor, seq, mapping, pair, out, cache, opaque = spec.children
    assert tensor is TENSOR and type(seq) is ListNode and type(mapping) is DictNode
    assert seq == ("list", (("T",), ("c", 1.5))) and hash(seq) == hash(("list", (("T",), ("c", 1.5))))
    assert type(seq.children[1]) is ConstNode and seq.children[1].value == 1.5 and mapping.keys == ("k",)
    assert type(pair) is NamedTupleNode and pair.cls is Pair and pair[1] is Pair
    assert type(out) is DataclassNode and out.keys == ("hidden", "score")
    assert type(cache) is ContainerNode and type(opaque) is OpaqueNode and opaque == ("o", Opaque)


def test_json_form_is_unchanged():
    """The on-disk form of specs: checkpoints written before typed nodes must keep loading."""
    x = torch.ones(2, 3)
    leaves, spec = flatten_sample((x, [x, (2, "s")], Pair(x, None)),
                                  {"out": Out(hidden=x), "t": torch.float16, "f": 0.5, "d": {3: x},
                                   "dev": torch.device("cpu"), "size": torch.Size([2])})
    text = json.dumps(spec_to_json(spec))
    assert text == (
        '["tuple", [["tuple", [["T"], ["list", [["T"], ["tuple", [["c", 2], ["c", "s"]]]]], '
        '["ntuple", "toy_models:Pair", [["T"], ["c", null]]]]], ["dict", ["d", "dev", "f", "out", "size", "t"], '
        '[["dict", [3], [["T"]]], ["c", {"device": "cpu"}], ["c", {"float": "0.5"}], '
        '["dc", "toy_models:Out", ["hidden", "score"], [["T"], ["c", null]]], ["c", {"size": [2]}], '
        '["c", {"dtype": "float16"}]]]]]'
    )
    loaded = spec_from_json(json.loads(text))
    assert loaded == spec and type(loaded) is TupleNode and json.dumps(spec_to_json(loaded)) == text
    assert sample_leaf_paths(loaded) == ["args[0]", "args[1][0]", "args[2][0]", "kwargs['d'][3]",
                                         "kwargs['out'].hidden"]
    assert leaf_paths(flatten(Out(hidden=x))[1], "outputs") == ["outputs.hidden"]


@pytest.mark.parametrize("strict", [True, False])
def test_live_and_stored_keys_come_from_one_function(strict):
    x, mask = torch.ones(2, 3), torch.ones(2)
    calls = [((x,), {}), ((x, mask), {}), ((), {"input_ids": x, "attention_mask": mask}),
             ((torch.nn.Parameter(x),), {}), ((x,), {"mask": mask, "scale": 2.0, "flag": True}),
             (([x, (x, 1)],), {"cache": Cache(), "other": Opaque()}), ((torch.ones([1] * 17),), {})]
    for args, kwargs in calls:
        leaves, structure = flatten_sample(args, kwargs)
        key = dispatch_key(structure, [t.dim() for t in leaves], strict)
        assert signature(args, kwargs, strict) == key == graph_key(args, kwargs, strict, phases=True)
        again = spec_from_json(json.loads(json.dumps(spec_to_json(structure)))) if args[:1] != ([x, (x, 1)],) \
            else structure
        assert dispatch_key(again, [t.dim() for t in leaves], strict) == key
    assert signature((torch.ones(2),), {}, strict) == signature((torch.nn.Parameter(torch.ones(2)),), {}, strict)
    for _ in range(2):  # the second call of each is answered from the memo
        assert (signature((x,), {"n": 1}, strict) == signature((x,), {"n": True}, strict)) is strict
        assert (signature((x, 1), {}, strict) == signature((x, 1.0), {}, strict)) is strict
        assert signature((x,), {"s": math.nan}, strict) == ((("T", 2),), ("s",), (("c", math.nan if strict else float),))


def test_memoized_keys_follow_ignore_type(monkeypatch):
    x = torch.ones(2)
    assert signature((x, 3), {}, True) == ((("T", 1), ("c", 3)),)
    monkeypatch.setattr(classes, "_IGNORED_TYPES", {int})
    assert signature((x, 3), {}, True) == ((("T", 1), ("o", int)),)


def test_graph_spec_key_matches_the_calls_it_was_recorded_from():
    x = torch.ones(2, 3)
    def model(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(1)

    calls = [(2, ((x,), {})), (2, ((), {"a": x, "b": 3})), (2, ((x,), {"cache_position": torch.arange(2)})),
             (1, ((x,), {"cache_position": torch.arange(1, 2)}))]
    graphs = record(model, calls)
    assert [spec.phase for spec, _ in graphs] == [None, None, "prefill", "decode"]
    for spec, samples in graphs:
        loaded = GraphSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
        for sample in samples:
            assert loaded.key() == spec.key() == graph_key(*sample.sample, strict=True, phases=True)


def test_map_tensors_rebuilds_containers_and_keeps_objects():
    cache, opaque = Cache(), Opaque()
    value = {"pair": Pair(torch.ones(1), "s"), "out": Out(hidden=torch.ones(2)), "cache": cache, "o": opaque}
    mapped = map_tensors(value, lambda t: t * 3)
    assert type(mapped["pair"]) is Pair and mapped["pair"].second == "s" and float(mapped["pair"].first) == 3
    assert type(mapped["out"]) is Out and torch.equal(mapped["out"].hidden, torch.full((2,), 3.0))
    assert mapped["cache"] is cache and mapped["o"] is opaque
