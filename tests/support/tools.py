"""The scripts under ``tools/`` as modules: they are not a package, so a test loads
one by its path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(path: str) -> ModuleType:
    """``tools/<path>`` (e.g. ``"experiments/sim_experiment.py"``) run as a module named
    after its file. The name is registered in ``sys.modules`` before it runs (unless
    already taken), for the dataclasses it defines and for processes it spawns, which
    import it by that name. The tool's folder goes on ``sys.path``, as it does for a
    script that is run, for the modules beside it that it imports."""
    file = TOOLS / path
    if str(file.parent) not in sys.path:
        sys.path.append(str(file.parent))
    spec = importlib.util.spec_from_file_location(file.stem, file)
    assert spec is not None and spec.loader is not None, f"no tool at {file}"
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(file.stem, module)
    spec.loader.exec_module(module)
    return module
