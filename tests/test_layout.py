"""The package's boundaries, read from the import statements of its modules: the
policy is pure (no torch, asyncio or aiohttp), the engine knows nothing of the
coordinator, the simulator runs without torch or asyncio, the configuration
without torch; and no module grows past about 400 lines unnoticed."""

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


def test_modules_stay_readable() -> None:
    """About 400 lines at most: a module past that has more than one job to split."""
    long = {
        str(path.relative_to(SRC)): n
        for path in sorted(SRC.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > 420
    }
    assert long == {}
