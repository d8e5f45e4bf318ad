"""Imports only run downward between packages; the trainer sees only the protocol.

Reads every module's source (``ast``: nothing is imported), including imports
inside functions, and checks each import between two different packages
against the floors below. A new package or top-level module must be given a
floor here, or this test fails: the layout is a decision, not an accident.

    pytest tests/unit/test_layers.py -q
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FLOORS = {
    "rollout_service.protocol": 0,
    "rollout_service.client": 1,
    "rollout_service.embedded": 1,
    "rollout_service.telemetry": 1,
    "rollout_service.speculation": 1,
    "rollout_service.engines": 2,
    "rollout_service.pausing": 2,
    "trainer_client": 2,
    "rollout_service.choices": 3,
    "rollout_service.sampling": 3,
    "rollout_service.logprob_views": 3,
    "rollout_service.config": 3,
    "rollout_service.weights": 3,
    "rollout_service.spec_calibration": 4,
    "rollout_service.spec_control": 5,
    "rollout_service.service": 6,
    "rollout_service.local": 7,
    "rollout_service.completions": 7,
    "rollout_service.api": 8,
    "rollout_service.serve": 9,
    "rollout_service.tools": 10,
    "rollout_service.cli": 11,
}
"""Package (or top-level module) -> floor. An import may only reach a lower floor,
or stay inside its own package."""

TRAINER_MAY_IMPORT = ("rollout_service.protocol", "rollout_service.client")
"""All of the server a trainer process imports."""

PROTOCOL_MAY_NOT_IMPORT = ("fastapi", "uvicorn", "vllm", "ray", "sglang", "torch")
"""At module level: the protocol loads in any process, the trainer's included (torch
only inside the functions that move tensor bytes)."""


def _modules() -> dict[str, Path]:
    found = {}
    for package in ("rollout_service", "trainer_client"):
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _unit(module: str) -> str:
    """The package (key of FLOORS) a module belongs to."""
    matches = [p for p in FLOORS if module == p or module.startswith(p + ".")]
    if not matches:
        pytest.fail(f"{module} is in no package of FLOORS: give it a floor in {__file__}")
    return max(matches, key=len)


def _imports(module: str, path: Path, *, module_level_only: bool = False) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import in ``path`` (relative ones resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.append((candidate if candidate in MODULES else base, node.lineno))
    return found


def _edges() -> list[tuple[str, str, str, int]]:
    """``(importer, imported, file, line)`` for imports between our own packages."""
    edges = []
    for module, path in sorted(MODULES.items()):
        for imported, line in _imports(module, path):
            if imported.split(".")[0] in ("rollout_service", "trainer_client"):
                edges.append((module, imported, str(path.relative_to(ROOT)), line))
    return edges


def test_every_module_has_a_floor() -> None:
    for module in MODULES:
        if module not in ("rollout_service", "trainer_client"):
            _unit(module)


def test_imports_run_only_downward() -> None:
    upward = []
    for importer, imported, file, line in _edges():
        if imported in ("rollout_service", "trainer_client"):
            continue  # the bare package: its __init__ holds only a docstring
        source, target = _unit(importer), _unit(imported)
        if source != target and FLOORS[target] >= FLOORS[source]:
            upward.append(f"{file}:{line}: {source} (floor {FLOORS[source]}) imports "
                          f"{imported} ({target}, floor {FLOORS[target]})")
    assert not upward, "imports running up or sideways:\n" + "\n".join(upward)


def test_trainer_imports_only_the_protocol_and_the_client() -> None:
    reached = sorted({f"{file}:{line}: {imported}" for importer, imported, file, line in _edges()
                      if importer.startswith("trainer_client")
                      and imported.startswith("rollout_service")
                      and not imported.startswith(TRAINER_MAY_IMPORT)})
    assert not reached, "trainer_client reaches into the server:\n" + "\n".join(reached)


def test_protocol_loads_without_server_or_engine_libraries() -> None:
    heavy = [f"{path.relative_to(ROOT)}:{line}: {imported}"
             for module, path in MODULES.items() if module.startswith("rollout_service.protocol")
             for imported, line in _imports(module, path, module_level_only=True)
             if imported.split(".")[0] in PROTOCOL_MAY_NOT_IMPORT]
    assert not heavy, "protocol imports at module level:\n" + "\n".join(heavy)


def test_the_check_catches_an_upward_import(tmp_path: Path) -> None:
    """The walk sees imports inside functions and resolves relative ones."""
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from ..service import RolloutService\n")
    assert _imports("rollout_service.protocol.x", path) == [("rollout_service.service", 2)]
    source, target = _unit("rollout_service.protocol.x"), _unit("rollout_service.service")
    assert FLOORS[target] > FLOORS[source]
