"""The package's imports point one way (docs/architecture.md): a test, so the rule holds by itself.

Every ``import`` of a torch_tweak module, at module level or inside a function, is read with ``ast`` (nothing
is imported). A module may import its own layer or lower ones, never a higher one, and module-level imports
form no cycle. The few exceptions are listed with the reason they are allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "torch_tweak"

#: Lowest first. A module belongs to the layer of its longest matching prefix.
LAYERS: list[tuple[str, ...]] = [
    ("torch_tweak.errors", "torch_tweak.__version__", "torch_tweak.utils"),
    ("torch_tweak.torch.config", "torch_tweak.torch._device", "torch_tweak.torch.cache", "torch_tweak.torch.cache_limit",
     "torch_tweak.torch.progress",
     "torch_tweak.torch.environment", "torch_tweak.torch.executor"),
    ("torch_tweak.torch.module", "torch_tweak.torch.integrations"),
    ("torch_tweak.torch.backend", "torch_tweak.torch.fidelity", "torch_tweak.torch.fidelity_metrics",
     "torch_tweak.torch.fidelity_probes",
     "torch_tweak.torch.profiling", "torch_tweak.torch.task",
     "torch_tweak.torch.report", "torch_tweak.torch.dataset"),
    ("torch_tweak.torch.tune_strategy",),
    ("torch_tweak.torch.tuning", "torch_tweak.torch.reporting", "torch_tweak.torch.checkpoint",
     "torch_tweak.torch.inspecting"),
    ("torch_tweak.torch", "torch_tweak.torch.testing", "torch_tweak.tiny_models", "torch_tweak.demo", "torch_tweak.cli",
     "torch_tweak"),
]

#: (importer, imported) pairs allowed against the rule, and why.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(name: str) -> int:
    best, layer = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, layer = len(prefix), index
    assert layer >= 0, f"{name} is in no layer: add it to LAYERS in {__file__}"
    return layer


def imports() -> dict[str, list[tuple[str, bool]]]:
    """Module → [(imported torch_tweak module, at module level)]."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    found: dict[str, list[tuple[str, bool]]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = {id(node) for node in tree.body}
        top |= {id(n) for node in tree.body if isinstance(node, (ast.If, ast.Try)) for n in ast.walk(node)}
        edges = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            edges += [(t, id(node) in top) for t in targets if t.startswith("torch_tweak") and t in modules]
        found[name] = edges
    return found


def test_no_module_imports_a_higher_layer():
    upward = sorted(f"{importer} (layer {layer_of(importer)}) imports {target} (layer {layer_of(target)})"
                    for importer, edges in imports().items() for target, _ in edges
                    if layer_of(target) > layer_of(importer) and (importer, target) not in EXCEPTIONS
                    and not (importer.startswith(target + ".")))  # a package's own __init__ runs first anyway
    assert upward == []


def test_module_level_imports_form_no_cycle():
    graph = {m: {t for t, top in edges if top and t != m} for m, edges in imports().items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1 and not node.startswith(target + "."):
                cycles.append([*path[path.index(target):], target] if target in path else [node, target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_exceptions_are_still_needed():
    edges = {(importer, target) for importer, targets in imports().items() for target, _ in targets}
    assert set(EXCEPTIONS) <= edges, "remove exceptions the code no longer needs"
