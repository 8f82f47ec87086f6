"""The KV hand-off's wire format: how a prompt's K and V travel from the prefill
pool to a decode server (``GET /v1/kv/{handle}``; docs/api.md, "Hand-off").

A stream is a header, then chunks of consecutive tokens in sequence order, then an
end mark::

    header   u32 little-endian n, then n bytes of JSON (``KVHeader``)
    chunk    u32 kind, u32 t (tokens in the chunk), then K of the t tokens, then V
             of the same shape, both in ``dtype``, C order, little-endian:
               kind 1 (rows)    [num_layers, t, num_kv_heads, head_dim]
               kind 2 (blocks)  [t / block_size, num_layers, block_size,
                                 num_kv_heads, head_dim]: whole blocks as the
                                 pool's paged store keeps them, so that it sends
                                 them as they lie (t a multiple of block_size)
               kind 3 (state)   DeepSeek-V4: the prompt's state after its t tokens
                                 (``engine/dsv4/state.py``: the window's last rows,
                                 the compressed entries, the open windows), the
                                 header's ``state_bytes`` of one safetensors blob;
                                 the only chunk of such a stream
    end      u32 0, u32 0

A stream that stops before its end mark, or whose chunks do not add up to the
header's ``num_tokens``, is truncated: the reader raises ``WireError``. Pure
Python and bytes; the tensors on either side are the caller's (``torch`` reads and
writes these buffers without a copy where it can).
"""

from __future__ import annotations

import struct
from dataclasses import asdict, dataclass
from typing import Any

import orjson

CHUNK_ROWS = 1
CHUNK_BLOCKS = 2
CHUNK_STATE = 3
_U32 = struct.Struct("<I")
_CHUNK = struct.Struct("<II")
END = _CHUNK.pack(0, 0)
ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_HEADER_BYTES = 64 * 1024


class WireError(ValueError):
    """A hand-off stream that is malformed or truncated."""


class HandoffError(RuntimeError):
    """A hand-off that failed, on either side. ``kind``: on the prefill side,
    ``unknown`` (404: no such hand-off), ``ended`` (410), ``busy`` (409: being
    pulled) or ``unsupported`` (400: a DeepSeek-V4 state asked of the dist
    transport); on the decode side, ``http`` (the pool answered with an error),
    ``unreachable``, ``truncated``, ``malformed`` or ``mismatch``. ``status``: the
    HTTP status it is answered or was answered with (None: none)."""

    def __init__(self, message: str, kind: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind, self.status = kind, status


@dataclass(frozen=True)
class KVHeader:
    handle: str
    num_tokens: int  # tokens whose K and V the stream carries (the prompt but its last)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a key of ``ITEM_BYTES``
    block_size: int  # the prefill pool's (for the record)
    model: str
    state_bytes: int = 0  # DeepSeek-V4: the state chunk's bytes (K and V rows otherwise)

    def __post_init__(self) -> None:
        if self.dtype not in ITEM_BYTES:
            raise WireError(f"dtype {self.dtype!r} is not one of {', '.join(ITEM_BYTES)}")
        dims = (self.num_layers, self.num_kv_heads, self.head_dim)
        if self.num_tokens < 0 or min(dims) < 1 or self.state_bytes < 0:
            raise WireError(f"bad shape in the header: tokens {self.num_tokens}, dims {dims}")

    @property
    def token_bytes(self) -> int:
        """Bytes of K and V of one token over every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * ITEM_BYTES[self.dtype]

    @property
    def total_bytes(self) -> int:
        return self.state_bytes or self.num_tokens * self.token_bytes

    def encode(self) -> bytes:
        body = orjson.dumps(asdict(self))
        return _U32.pack(len(body)) + body

    @classmethod
    def decode(cls, body: bytes) -> KVHeader:
        try:
            raw: Any = orjson.loads(body)
            return cls(**raw)
        except (orjson.JSONDecodeError, TypeError) as exc:
            raise WireError(f"bad hand-off header: {exc}") from None


def chunk_header(tokens: int, kind: int = CHUNK_ROWS) -> bytes:
    return _CHUNK.pack(kind, tokens)


def header_length(prefix: bytes) -> int:
    """The JSON header's length from the stream's first 4 bytes."""
    n = int(_U32.unpack(prefix)[0])
    if not 0 < n <= MAX_HEADER_BYTES:
        raise WireError(f"hand-off header of {n} bytes")
    return n


def parse_chunk_header(raw: bytes, block_size: int) -> tuple[int, int] | None:
    """The kind of the chunk that follows and its tokens, or None at the end mark."""
    kind, tokens = _CHUNK.unpack(raw)
    if kind == 0 and tokens == 0:
        return None
    # (A state chunk may be of no token: a one-token prompt's state before it.)
    if kind not in (CHUNK_ROWS, CHUNK_BLOCKS, CHUNK_STATE) or (tokens == 0 and kind != CHUNK_STATE):
        raise WireError(f"bad chunk header: kind {kind}, {tokens} tokens")
    if kind == CHUNK_BLOCKS and tokens % block_size:
        raise WireError(f"a chunk of blocks of {tokens} tokens (blocks of {block_size})")
    return int(kind), int(tokens)


CHUNK_HEADER_BYTES = _CHUNK.size
HEADER_PREFIX_BYTES = _U32.size
