"""Tensors as plain bytes in pickled messages (``messages.py``, ``logprobs.py``).

A message's tensors cross the coordinator <-> rank pipes as (dtype, shape, bytes):
moving a tensor through shared memory costs about 0.5 ms per message on CPU (a
segment is created and mapped each time), more than a whole small prefill's
bookkeeping. A frozen dataclass that subclasses ``TensorsAsBytes`` and names its
tensor fields in ``_tensor_fields`` pickles them so; nested ones too.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch
from torch import Tensor


def tensor_to_wire(t: Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype name, shape, raw bytes) of a CPU tensor."""
    flat = t.detach().contiguous().reshape(-1).cpu()
    return (
        str(flat.dtype).removeprefix("torch."),
        tuple(t.shape),
        flat.view(torch.uint8).numpy().tobytes(),
    )


def tensor_from_wire(dtype: str, shape: tuple[int, ...], data: bytes) -> Tensor:
    raw = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )
    return raw.view(getattr(torch, dtype)).reshape(shape)


def _rebuild(cls: type[Any], values: dict[str, Any], tensors: dict[str, Any]) -> Any:
    for name, wire in tensors.items():
        values[name] = None if wire is None else tensor_from_wire(*wire)
    return cls(**values)


class TensorsAsBytes:
    """Pickle the dataclass's tensor fields (``_tensor_fields``) as bytes."""

    _tensor_fields: tuple[str, ...] = ()

    def __reduce__(self) -> tuple[Any, ...]:
        values = {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]
        tensors = {}
        for name in self._tensor_fields:
            t = values.pop(name)
            tensors[name] = None if t is None else tensor_to_wire(t)
        return (_rebuild, (type(self), values, tensors))
