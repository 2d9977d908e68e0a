"""Structure flattening, signatures and the JSON form of specs."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from toy_models import Out, Pair

from torch_tweak.errors import UnsupportedInputError
from torch_tweak.torch.module.tree import (
    flatten,
    resolve_type,
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
