"""Configuration: frozen dataclasses, validated on construction, read from TOML.

    model.py     the served model's shape (``ModelConfig``) and the built-in presets
    engine.py    the rank processes and their KV caches (``EngineConfig``)
    tables.py    ``ConfigError``, reading TOML, building a dataclass from a table
    pool.py      the pool: degrees, layout, bounds, hosts (``PoolConfig``)
    dialect.py   the one TOML dialect of ``serve`` and ``simulate``

Every default lives once, in a dataclass field. Nothing here imports torch: the
coordinator, the simulator and the CLI read these without loading the engine.
"""

from vertumnus.config.engine import EngineConfig
from vertumnus.config.families import SUPPORTED_ARCHITECTURES
from vertumnus.config.model import PRESETS, ModelConfig, resolve_model
from vertumnus.config.tables import ConfigError, build_table, read_toml

__all__ = [
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "ConfigError",
    "EngineConfig",
    "ModelConfig",
    "build_table",
    "read_toml",
    "resolve_model",
]
