"""The JSON entry points of structure specs: a spec written to a checkpoint, and one read back from a file.

Each node writes and reads its own JSON form (:mod:`~torch_tweak.torch.module.nodes`); this module only
knows which node class a JSON tag stands for. A spec read back comes from a file that whoever sent it fully
controls: :func:`spec_from_json` validates its shape and leaves each class-naming node to apply the trust
policy documented in :mod:`~torch_tweak.torch.module.class_nodes` (classes resolve statically, nothing named
in the file is imported or called, and only containers rebuilt through their own protocol, or classes
registered with ``tt.register_type``, are accepted).
"""

from __future__ import annotations

from typing import Any

from torch_tweak.errors import UnsupportedInputError
from torch_tweak.torch.module.class_nodes import (
    ContainerNode,
    DataclassNode,
    MappingNode,
    NamedTupleNode,
    OpaqueNode,
    SequenceNode,
)
from torch_tweak.torch.module.nodes import ConstNode, DictNode, ListNode, Node, TensorNode, TupleNode

_NODES: dict[str, type[Node]] = {
    node.tag: node
    for node in (TensorNode, ConstNode, TupleNode, ListNode, DictNode, NamedTupleNode, SequenceNode, MappingNode,
                 DataclassNode, ContainerNode, OpaqueNode)
}


def spec_to_json(spec: Node) -> Any:
    """Convert a spec into JSON-able lists; raises for values that cannot be stored safely."""
    return spec.to_json()


def spec_from_json(data: Any) -> Node:
    """Inverse of :func:`spec_to_json` for untrusted data: validates the shape and admits only safe classes.

    Raises :class:`UnsupportedInputError` for malformed data and for classes outside the policy of
    :mod:`~torch_tweak.torch.module.class_nodes`; nothing named in ``data`` is imported or called here.
    """
    if not isinstance(data, list) or not data or not isinstance(data[0], str):
        raise UnsupportedInputError(f"Malformed structure spec: {data!r:.200}")
    node = _NODES.get(data[0])
    try:
        spec = node.from_json(data, spec_from_json) if node is not None else None
    except UnsupportedInputError:
        raise
    except TypeError as exc:
        raise UnsupportedInputError(f"Malformed structure spec node {data!r:.200}") from exc
    if spec is None:
        raise UnsupportedInputError(f"Malformed structure spec node {data!r:.200}")
    return spec
