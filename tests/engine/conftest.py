"""Fixtures of the engine tests: a random DeepSeek-V4 folder transformers saved, and
the engine's model loaded from it in fp32, once per test process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from support.dsv4 import write_dsv4_folder
from vertumnus.config import ModelConfig
from vertumnus.engine.dsv4.load import load_dsv4
from vertumnus.engine.dsv4.model import DeepseekV4LM


@pytest.fixture(scope="session")
def dsv4_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """The folder and transformers' model it holds (``support/dsv4.py``)."""
    path = tmp_path_factory.mktemp("dsv4")
    return path, write_dsv4_folder(path)


@pytest.fixture(scope="session")
def dsv4_engine(dsv4_folder: tuple[Path, Any]) -> DeepseekV4LM:
    path, _ = dsv4_folder
    return load_dsv4(ModelConfig.from_dir(path), path, torch.float32, torch.device("cpu"))
