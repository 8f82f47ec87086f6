"""The engine's settings: one pool of rank processes and their KV caches.

``[engine]`` in the TOML dialect; ``block_size`` and ``kv_blocks_per_rank`` are also
the KV geometry the policy plans with (the simulator's pool too). Does not import
torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from vertumnus.config.tables import ConfigError


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one pool of rank processes and their KV caches."""

    block_size: int = 16  # tokens per KV block; only full blocks are cached
    kv_blocks_per_rank: int = 1024  # KV cache capacity of one rank, in blocks
    device: str = "auto"  # "auto" (cuda if present), "cpu" or "cuda"
    dtype: str = "auto"  # "auto" (bf16 on cuda and bf16-capable cpus, else fp32), ...
    threads_per_rank: int | None = None  # intra-op threads per CPU rank; None: cores / ranks
    # torch.compile the layers' arithmetic around attention ("auto": where Inductor
    # compiles here, else eager with a warning; "on": a failure stops the rank; "off")
    compile: str = "auto"
    # a CPU rank's attention kernel: "flash" (torch's fused CPU kernel), "chunked" (blocks
    # of query rows through batched GEMMs) or "auto" (the faster, timed at the rank's start)
    cpu_attention: str = "auto"
    seed: int = 0  # seed of the random weights of built-in presets
    rank_timeout_s: float = 120.0  # start-up and per-step deadline for rank replies

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_blocks_per_rank < 0:
            raise ConfigError(f"kv_blocks_per_rank must be >= 0, got {self.kv_blocks_per_rank}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.compile not in ("auto", "on", "off"):
            raise ConfigError(f"compile must be auto, on or off, got {self.compile!r}")
        if self.cpu_attention not in ("auto", "flash", "chunked"):
            raise ConfigError(
                f"cpu_attention must be auto, flash or chunked, got {self.cpu_attention!r}"
            )
        if self.threads_per_rank is not None and self.threads_per_rank <= 0:
            raise ConfigError(f"threads_per_rank must be positive, got {self.threads_per_rank}")
        if not (self.rank_timeout_s > 0 and math.isfinite(self.rank_timeout_s)):
            raise ConfigError(f"rank_timeout_s must be positive, got {self.rank_timeout_s}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
