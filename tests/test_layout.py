"""The package's boundaries, read from the import statements of its modules: the
policy is pure (no torch, asyncio or aiohttp) and its subpackages import only
downwards, the engine knows nothing of the coordinator, the simulator runs without
torch or asyncio, the configuration without torch; and no module grows past about
400 lines unnoticed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "vertumnus"


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # ``from package import module`` imports the module too.
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("policy", ("torch", "asyncio", "aiohttp", "vertumnus.runtime", "vertumnus.sim")),
        ("engine", ("vertumnus.runtime", "vertumnus.server", "vertumnus.sim", "asyncio")),
        ("sim", ("torch", "asyncio", "aiohttp", "vertumnus.runtime", "vertumnus.engine")),
        ("config", ("torch", "asyncio", "vertumnus.runtime", "vertumnus.engine")),
    ],
)
def test_packages_keep_their_boundaries(package: str, forbidden: tuple[str, ...]) -> None:
    offences = [
        f"{path.relative_to(SRC)} imports {name}"
        for path in sorted((SRC / package).rglob("*.py"))
        for name in sorted(imports(path))
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]
    assert offences == []


# The policy's layers, lowest first: each imports only the layers before it and the
# base modules at the top of ``policy/`` (the cost terms, the lattice's geometry and
# the lattice); the stack (the other top-level modules) sits above them all.
POLICY_BASE = ("costs", "geometry", "lattice")
POLICY_LAYERS = ("cache", "placement", "control")


def test_policy_layers_import_downwards() -> None:
    offences = []
    for index, layer in enumerate(POLICY_LAYERS):
        allowed = {*POLICY_BASE, *POLICY_LAYERS[: index + 1]}
        for path in sorted((SRC / "policy" / layer).rglob("*.py")):
            for name in sorted(imports(path)):
                parts = name.split(".")
                inside = parts[:2] == ["vertumnus", "policy"] and len(parts) > 2
                if inside and parts[2] not in allowed:
                    offences.append(f"{path.relative_to(SRC)} imports {name}")
    assert offences == []


def test_no_policy_part_holds_the_stack() -> None:
    """The stack's parts are given their collaborators, never the stack: besides the
    stack itself, only the timeline, which samples the stack it is passed, imports it."""
    offences = [
        str(path.relative_to(SRC))
        for path in sorted((SRC / "policy").rglob("*.py"))
        if path.name not in ("pool_policy.py", "timeline.py")
        and any(n.startswith("vertumnus.policy.pool_policy") for n in imports(path))
    ]
    assert offences == []


def test_only_the_composition_root_names_the_coordinator() -> None:
    """The runtime's parts are given their collaborators (and ``apply``), never the
    coordinator: only the coordinator itself, the REST API it serves and the command
    that builds it import it."""
    allowed = ("runtime/coordinator.py", "cli/serve.py")
    offences = [
        str(path.relative_to(SRC))
        for path in sorted(SRC.rglob("*.py"))
        if str(path.relative_to(SRC)) not in allowed
        and path.relative_to(SRC).parts[0] != "server"
        and any(n.startswith("vertumnus.runtime.coordinator") for n in imports(path))
    ]
    assert offences == []


def test_policy_layers_exist() -> None:
    """The layer test above checks real folders: every layer is a package with modules."""
    for layer in POLICY_LAYERS:
        modules = list((SRC / "policy" / layer).glob("*.py"))
        assert (SRC / "policy" / layer / "__init__.py") in modules
        assert len(modules) > 2


def test_modules_stay_readable() -> None:
    """About 400 lines at most: a module past that has more than one job to split."""
    long = {
        str(path.relative_to(SRC)): n
        for path in sorted(SRC.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > 420
    }
    assert long == {}
