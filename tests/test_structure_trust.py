"""Structure specs read from a checkpoint name classes; none may become an import or a chosen constructor call.

A checkpoint's manifest is written by whoever sent it. These tests name classes in JSON specs the way an
attacker would and check that only containers rebuilt through their own protocol are accepted, that nothing
in the named classes runs, and that name resolution neither imports nor triggers a module ``__getattr__``.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.abc
import json
import sys
import types
from typing import Any, NamedTuple

import pytest
import torch

import torch_tweak.torch as tt
from torch_tweak.errors import UnsupportedInputError
from torch_tweak.torch.module import classes, tree
from torch_tweak.torch.module.tree import flatten, resolve_type, unflatten
from torch_tweak.torch.module.tree_json import spec_from_json, spec_to_json

CALLS: list[str] = []
"""Every constructor-like hook of the classes below appends here; a loaded spec must never add anything."""

MODULE = __name__


class Launcher:
    """Stands for any imported class with a dangerous constructor (``NpzFile``, ``Popen``...)."""

    def __init__(self, **kwargs: Any) -> None:
        CALLS.append(f"Launcher.__init__{sorted(kwargs)}")


class RecordingMapping(dict):
    """An unregistered dict subclass whose constructor has side effects."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        CALLS.append("RecordingMapping.__init__")
        super().__init__(*args, **kwargs)


@dataclasses.dataclass
class Recorded:
    """A legitimate dataclass whose ``__post_init__`` must not run when rebuilt."""

    x: torch.Tensor
    n: int = 0
    note: str = dataclasses.field(default="", init=False)

    def __post_init__(self) -> None:
        CALLS.append("Recorded.__post_init__")


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: torch.Tensor
    b: Any = None

    def __post_init__(self) -> None:
        CALLS.append("Frozen.__post_init__")


@dataclasses.dataclass(frozen=True, slots=True)
class Slotted:
    a: torch.Tensor
    scale: float = 1.0


@dataclasses.dataclass(init=False)
class CustomInit:
    a: torch.Tensor

    def __init__(self, a: torch.Tensor) -> None:
        CALLS.append("CustomInit.__init__")
        self.a = a


@dataclasses.dataclass
class NewHook:
    """A dataclass whose ``__new__`` has side effects: refused unless registered."""

    a: Any = None

    def __new__(cls, *args: Any, **kwargs: Any) -> NewHook:
        CALLS.append("NewHook.__new__")
        return super().__new__(cls)


@dataclasses.dataclass
class Finalized:
    a: Any = None

    def __del__(self) -> None:
        CALLS.append("Finalized.__del__")


class Point(collections.namedtuple("PointBase", ["x", "y"])):
    """A namedtuple subclass with a side-effecting ``__new__``: rebuilt without calling it."""

    __slots__ = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> Point:
        CALLS.append("Point.__new__")
        return super().__new__(cls, *args, **kwargs)


class Typed(NamedTuple):
    first: torch.Tensor
    second: int = 3


class Tokens(list):
    """An unregistered list subclass: rebuilding it calls the class, so a file may name it only once registered."""


class FakeTuple(tuple):
    _fields = ("a", "b")

    def __del__(self) -> None:
        CALLS.append("FakeTuple.__del__")


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    CALLS.clear()
    monkeypatch.setattr(classes, "_USER_TYPES", dict(classes._USER_TYPES))


def json_round_trip(value: Any) -> tuple[Any, Any]:
    """Flatten ``value``, store its spec as JSON text, read it back as a loader would and rebuild it."""
    leaves, spec = flatten(value)
    loaded = spec_from_json(json.loads(json.dumps(spec_to_json(spec))))
    assert loaded == spec
    return unflatten(loaded, [t + 1 for t in leaves]), leaves


def test_npzfile_attack_is_refused_and_nothing_is_called():
    npyio = pytest.importorskip("numpy.lib.npyio")
    name = tree.qualified_name(npyio.NpzFile)
    attack = ["map", name, ["fid", "allow_pickle"], [["c", "/tmp/payload.npy"], ["c", True]]]
    with pytest.raises(UnsupportedInputError, match=r"NpzFile.*register_type"):
        spec_from_json(attack)
    for node in (["map", f"{MODULE}:Launcher", ["fid"], [["c", "x"]]],
                 ["map", f"{MODULE}:RecordingMapping", ["a"], [["T"]]],
                 ["dc", f"{MODULE}:Launcher", [], []],
                 ["dc", f"{MODULE}:NewHook", ["a"], [["c", 1]]],
                 ["dc", f"{MODULE}:Finalized", ["a"], [["c", 1]]],
                 ["ntuple", f"{MODULE}:FakeTuple", [["c", 1], ["c", 2]]],
                 ["seq", f"{MODULE}:Tokens", [["T"]]],
                 ["u", f"{MODULE}:Launcher", [], []]):
        with pytest.raises(UnsupportedInputError, match=r"cannot stand for .*register_"):
            spec_from_json(node)
    assert CALLS == []


def test_refusal_message_names_the_class_and_the_fix():
    with pytest.raises(UnsupportedInputError) as info:
        spec_from_json(["map", f"{MODULE}:RecordingMapping", ["a"], [["T"]]])
    message = str(info.value)
    assert f"{MODULE}:RecordingMapping" in message
    assert "tt.register_type(cls)" in message and "before tt.load" in message


def test_opaque_nodes_resolve_but_are_never_called():
    spec = spec_from_json(["tuple", [["T"], ["o", f"{MODULE}:Launcher"]]])
    assert spec[1][1] == ("o", Launcher)
    with pytest.raises(UnsupportedInputError, match="Cannot rebuild"):
        unflatten(spec, [torch.ones(1)])
    assert CALLS == []


def test_dataclasses_rebuild_without_init_or_post_init():
    value = (Recorded(torch.ones(2), n=4), Frozen(torch.zeros(1), b=(1, None)), Slotted(torch.ones(3), 0.5),
             CustomInit(torch.ones(1)))
    CALLS.clear()
    rebuilt, leaves = json_round_trip(value)
    assert CALLS == []
    recorded, frozen, slotted, custom = rebuilt
    assert type(recorded) is Recorded and recorded.n == 4 and recorded.note == ""
    assert torch.equal(recorded.x, leaves[0] + 1)
    assert type(frozen) is Frozen and frozen.b == (1, None) and torch.equal(frozen.a, leaves[1] + 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.b = 2  # type: ignore[misc]
    assert type(slotted) is Slotted and slotted.scale == 0.5 and not hasattr(slotted, "__dict__")
    assert type(custom) is CustomInit and torch.equal(custom.a, leaves[3] + 1)


def test_dataclass_fields_must_match_exactly():
    base = f"{MODULE}:Recorded"
    for names, children in ((["x", "n"], [["T"], ["c", 1]]),
                            (["x", "n", "note", "extra"], [["T"], ["c", 1], ["c", ""], ["c", 2]]),
                            (["x", "n", "__class__"], [["T"], ["c", 1], ["c", ""]])):
        with pytest.raises(UnsupportedInputError, match="fields"):
            spec_from_json(["dc", base, names, children])
    assert CALLS == []


def test_namedtuples_rebuild_through_the_tuple_protocol():
    value = [Point(torch.ones(1), 2), Typed(torch.zeros(2))]
    CALLS.clear()
    rebuilt, leaves = json_round_trip(value)
    assert CALLS == []
    point, typed = rebuilt
    assert type(point) is Point and point.y == 2 and torch.equal(point.x, leaves[0] + 1)
    assert type(typed) is Typed and typed.second == 3
    with pytest.raises(UnsupportedInputError, match="2 fields"):
        spec_from_json(["ntuple", f"{MODULE}:Point", [["T"]]])


def test_in_process_unflatten_uses_the_same_protocol():
    leaves, spec = flatten((Recorded(torch.ones(1)), Point(torch.ones(1), None)))
    CALLS.clear()
    unflatten(spec, leaves)
    assert CALLS == []


def test_hugging_face_model_output_round_trips():
    outputs = pytest.importorskip("transformers.modeling_outputs")
    value = outputs.BaseModelOutput(last_hidden_state=torch.ones(1, 2, 4), hidden_states=(torch.ones(1), torch.zeros(1)))
    rebuilt, leaves = json_round_trip(value)
    assert type(rebuilt) is outputs.BaseModelOutput
    assert list(rebuilt.keys()) == ["last_hidden_state", "hidden_states"] and rebuilt.attentions is None
    assert torch.equal(rebuilt.last_hidden_state, leaves[0] + 1) and len(rebuilt.hidden_states) == 2
    name = tree.qualified_name(outputs.BaseModelOutput)
    with pytest.raises(UnsupportedInputError, match="fields"):
        spec_from_json(["map", name, ["fid"], [["c", 1]]])


def test_model_output_pair_reinterpretation_is_refused():
    outputs = pytest.importorskip("transformers.modeling_outputs")
    name = tree.qualified_name(outputs.BaseModelOutput)
    pairs = ["tuple", [["tuple", [["c", "to_tuple"], ["c", None]]], ["tuple", [["c", "last_hidden_state"], ["T"]]]]]
    spec = spec_from_json(["map", name, ["last_hidden_state"], [pairs]])
    with pytest.raises(UnsupportedInputError, match="reinterpreted"):
        unflatten(spec, [torch.ones(1)])


def test_diffusers_base_output_round_trips(monkeypatch: pytest.MonkeyPatch):
    diffusers_outputs = pytest.importorskip("diffusers.utils.outputs")

    @dataclasses.dataclass
    class SampleOutput(diffusers_outputs.BaseOutput):
        sample: torch.Tensor
        extra: Any = None

    module = types.ModuleType("tt_fake_diffusers_user")
    SampleOutput.__module__, SampleOutput.__qualname__ = module.__name__, "SampleOutput"
    module.SampleOutput = SampleOutput
    monkeypatch.setitem(sys.modules, module.__name__, module)
    rebuilt, leaves = json_round_trip(SampleOutput(sample=torch.ones(2)))
    assert type(rebuilt) is SampleOutput and torch.equal(rebuilt.sample, leaves[0] + 1) and rebuilt.extra is None


def test_ordered_dict_is_accepted_other_mappings_only_when_registered():
    rebuilt, _ = json_round_trip(collections.OrderedDict([("b", torch.ones(1)), ("a", 2)]))
    assert type(rebuilt) is collections.OrderedDict and list(rebuilt) == ["b", "a"]

    leaves, spec = flatten(RecordingMapping(a=torch.ones(1)))
    stored = spec_to_json(spec)
    CALLS.clear()
    with pytest.raises(UnsupportedInputError, match="not registered"):
        spec_from_json(stored)
    assert CALLS == []
    tt.register_type(RecordingMapping)
    assert type(unflatten(spec_from_json(stored), leaves)) is RecordingMapping


def test_unregistered_list_subclass_is_refused_then_accepted_after_register_type():
    leaves, spec = flatten(Tokens([torch.ones(1), 2]))
    stored = json.loads(json.dumps(spec_to_json(spec)))
    with pytest.raises(UnsupportedInputError, match=rf"{MODULE}:Tokens.*not registered.*tt.register_type"):
        spec_from_json(stored)
    assert tt.register_type(Tokens) is Tokens
    rebuilt = unflatten(spec_from_json(stored), leaves)
    assert type(rebuilt) is Tokens and rebuilt[1] == 2


def test_register_type_refuses_non_classes():
    with pytest.raises(UnsupportedInputError, match="expects a class"):
        tt.register_type(Launcher())  # type: ignore[arg-type]


def test_module_getattr_is_never_called(monkeypatch: pytest.MonkeyPatch):
    hooks: list[str] = []
    module = types.ModuleType("tt_fake_lazy_module")

    def module_getattr(attr: str) -> Any:
        hooks.append(attr)
        return Launcher

    module.__getattr__ = module_getattr  # type: ignore[method-assign]

    @dataclasses.dataclass
    class Thing:
        x: Any = None

    Thing.__module__, Thing.__qualname__ = module.__name__, "Thing"
    module.Thing = Thing
    monkeypatch.setitem(sys.modules, module.__name__, module)

    assert resolve_type("tt_fake_lazy_module:Thing") is Thing
    assert spec_from_json(["dc", "tt_fake_lazy_module:Thing", ["x"], [["T"]]])[1] is Thing
    for name in ("tt_fake_lazy_module:Launcher", "tt_fake_lazy_module:Thing.Inner", "tt_fake_lazy_module:__getattr__"):
        with pytest.raises(UnsupportedInputError, match="does not exist"):
            resolve_type(name)
    with pytest.raises(UnsupportedInputError, match="does not exist"):
        spec_from_json(["map", "tt_fake_lazy_module:Launcher", ["fid"], [["c", 1]]])
    with pytest.raises(UnsupportedInputError, match="does not exist"):
        spec_from_json(["o", "tt_fake_lazy_module:Anything"])
    assert hooks == [] and CALLS == []
    assert module.Launcher is Launcher and hooks == ["Launcher"]  # the hook would have run


def test_objects_in_sys_modules_that_are_not_modules_are_not_searched(monkeypatch: pytest.MonkeyPatch):
    touched: list[str] = []

    class Impostor:
        def __getattribute__(self, attr: str) -> Any:
            touched.append(attr)
            return Launcher

    monkeypatch.setitem(sys.modules, "tt_fake_impostor", Impostor())
    with pytest.raises(UnsupportedInputError, match="not a module"):
        resolve_type("tt_fake_impostor:Launcher")
    assert touched == []


def test_aliases_do_not_resolve_under_another_name(monkeypatch: pytest.MonkeyPatch):
    module = types.ModuleType("tt_fake_alias_module")
    module.Innocent = Launcher
    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(UnsupportedInputError, match="does not exist"):
        resolve_type("tt_fake_alias_module:Innocent")


class _ImportRecorder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.asked: list[str] = []

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        self.asked.append(fullname)
        return None


def test_modules_that_are_not_imported_are_refused_without_importing(monkeypatch: pytest.MonkeyPatch):
    recorder = _ImportRecorder()
    monkeypatch.setattr(sys, "meta_path", [recorder, *sys.meta_path])
    assert "json.tool" not in sys.modules  # an importable module nobody imported: naming it must not import it
    before = set(sys.modules)
    for node in (["ntuple", "tt_never_imported_pkg:Thing", [["T"]]],
                 ["map", "tt_never_imported_pkg.sub:Thing", [], []],
                 ["dc", "json.tool:Thing", [], []],
                 ["o", "tt_never_imported_pkg:Thing"]):
        with pytest.raises(UnsupportedInputError, match="not imported"):
            spec_from_json(node)
    assert set(sys.modules) == before
    assert recorder.asked == []
    assert "tt_never_imported_pkg" not in sys.modules and "json.tool" not in sys.modules
