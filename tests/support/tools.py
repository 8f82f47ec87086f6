"""The tools under ``tools/`` as the modules of the ``tools`` package (on the path
through pytest's ``pythonpath``), named by their files."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def load_tool(path: str) -> ModuleType:
    """``tools/<path>`` (e.g. ``"experiments/sim_experiment.py"``) imported as
    ``tools.experiments.sim_experiment``: the name it has when run with ``python -m``
    and when the processes it spawns import it."""
    file = TOOLS / path
    assert file.is_file() and file.suffix == ".py", f"no tool at {file}"
    return importlib.import_module(".".join(("tools", *Path(path).with_suffix("").parts)))
