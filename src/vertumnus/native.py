"""Compiled twins of the hottest pure-Python modules, used only when built from the
very source that runs.

The what-if controller's replays (``policy/control/replay_loop.py``) place tens of
thousands of requests per decision at 1,024 GPUs, in a loop that the interpreter
runs at about 2 us a request. ``tools/build_native.py`` (run by
``tools/setup.sh``) compiles each module named in ``MODULES`` with mypyc, the
compiler of typed Python that ships with mypy, into a top-level extension
``_vertumnus_native_<name>`` in the environment, and records in it the SHA-256 of
the source it compiled. ``compiled(module)`` returns that extension when it is
installed and its record matches the module's source as it is now, and the module
itself otherwise: an edited source runs as written until the next build, never a
stale twin. The twin is the same source, so it computes the same results (the
same IEEE operations in the same order: ``tests/policy/control/test_native.py`` compares
them bit for bit); only faster.

``VERTUMNUS_NATIVE=0`` keeps every module pure. ``status()`` says, per module,
which one runs and why (``vertumnus simulate`` and ``serve`` log it).
"""

from __future__ import annotations

import hashlib
import importlib
import os
from pathlib import Path
from types import ModuleType

# The modules compiled by tools/build_native.py (dotted names under vertumnus.policy).
MODULES: tuple[str, ...] = ("control.replay_loop",)

_status: dict[str, str] = {}


def twin_name(module_name: str) -> str:
    """The extension's import name for a module such as ``vertumnus.policy.control.replay_loop``."""
    return "_vertumnus_native_" + module_name.rpartition(".")[2]


def source_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def enabled() -> bool:
    return os.environ.get("VERTUMNUS_NATIVE", "1").strip().lower() not in ("0", "false", "no")


def compiled(module: ModuleType) -> ModuleType:
    """``module``'s compiled twin when it is built from this source, else ``module``."""
    name = module.__name__
    if not enabled():
        _status[name] = "pure (VERTUMNUS_NATIVE=0)"
        return module
    try:
        twin = importlib.import_module(twin_name(name))
    except ImportError:
        _status[name] = "pure (not built: run python -m tools.build_native)"
        return module
    path = module.__file__
    if path is None or getattr(twin, "SOURCE_SHA256", None) != source_hash(Path(path)):
        _status[name] = "pure (the build is of another source: run python -m tools.build_native)"
        return module
    _status[name] = "compiled"
    return twin


def status() -> dict[str, str]:
    """Per module loaded through ``compiled``: "compiled", or "pure (why)"."""
    return dict(_status)
