"""A hand-off's KV stream as it is received: the ``kv_wire.py`` format as the
regions its bytes belong in (``KVStream``: scratch for the headers, each chunk's K
and V one after the other in one buffer), each header checked once its region is
full (``check_header``), and the buffers it is received into (``Arena``: memory
kept for the next pull, its pages already touched, so a pull does not pay a page
fault per 4 KB of a large KV). Not here: the socket (``kv_socket.py``), the pull
(``kv_pull.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Generator

import torch
from torch import Tensor

from vertumnus import kv_wire as wire
from vertumnus.config import ModelConfig
from vertumnus.decode.prompt_kv import KVPiece, PromptKV
from vertumnus.engine.dsv4.state import DsV4State, from_bytes
from vertumnus.kv_wire import HandoffError

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Arena:
    """Receive buffers kept between pulls (at most ``keep``, the largest kept when
    there are more); thread-safe: a decode thread gives back what the event loop
    took."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._free: list[Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Tensor:
        """A uint8 buffer of at least ``nbytes`` (the smallest free one that fits, or
        a new one, written once so that its pages exist)."""
        with self._lock:
            fits = [i for i, t in enumerate(self._free) if t.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.zeros(max(nbytes, 1), dtype=torch.uint8)

    def give(self, buffer: Tensor) -> None:
        with self._lock:
            self._free.append(buffer)
            if len(self._free) > self.keep:
                self._free.sort(key=lambda t: t.numel())
                self._free.pop(0)


ARENA = Arena()  # the process's own, unless a caller brings one


def check_header(header: wire.KVHeader, handle: str, model: ModelConfig | None) -> None:
    """The stream is the one asked for, and fits the served model."""
    if header.handle != handle:
        raise HandoffError(
            f"asked for KV {handle!r}, the stream carries {header.handle!r}", "mismatch"
        )
    if model is None:
        return
    got = (header.num_layers, header.num_kv_heads, header.head_dim)
    want = (model.num_hidden_layers, model.num_key_value_heads, model.head_dim)
    if got != want:
        raise HandoffError(
            f"the prefill pool's KV ({header.model!r}: {got[0]} layers, {got[1]} KV heads, "
            f"head_dim {got[2]}) does not fit this decode server's model ({model.name!r}: "
            f"{want[0]} layers, {want[1]} KV heads, head_dim {want[2]}): serve the same model",
            "mismatch",
        )


class KVStream:
    """The wire format as a sequence of regions to fill: ``regions`` yields, in
    stream order, each buffer the next bytes belong in (scratch for headers, a
    chunk's K and V otherwise, one after the other in the arena's buffer) and
    checks each header once its region is full."""

    def __init__(self, what: str, handle: str, model: ModelConfig | None, arena: Arena) -> None:
        self.what, self.handle, self.model, self.arena = what, handle, model, arena
        self.header: wire.KVHeader | None = None
        self.buffer: Tensor | None = None
        self.pieces: list[KVPiece] = []

    def regions(self) -> Generator[memoryview, None, None]:
        prefix = bytearray(wire.HEADER_PREFIX_BYTES)
        yield memoryview(prefix)
        body = bytearray(wire.header_length(bytes(prefix)))
        yield memoryview(body)
        header = self.header = wire.KVHeader.decode(bytes(body))
        check_header(header, self.handle, self.model)
        dtype = TORCH_DTYPES[header.dtype]
        buffer = self.buffer = self.arena.take(header.total_bytes)
        raw = buffer.numpy().data
        if header.state_bytes:  # DeepSeek-V4: one chunk, its prompt's state
            yield from self._state(header, raw)
            return
        dims = (header.num_kv_heads, header.head_dim)
        layers, block = header.num_layers, header.block_size
        done = at = 0
        while True:
            mark = bytearray(wire.CHUNK_HEADER_BYTES)
            yield memoryview(mark)
            chunk = wire.parse_chunk_header(bytes(mark), block)
            if chunk is None:
                break
            kind, tokens = chunk
            if done + tokens > header.num_tokens:
                raise HandoffError(
                    f"{self.what}: chunks carry more than the header's {header.num_tokens} tokens",
                    "malformed",
                )
            size = tokens * header.token_bytes
            yield raw[at : at + size]
            k, v = buffer[at : at + size].view(dtype).chunk(2)
            if kind == wire.CHUNK_BLOCKS:
                shape: tuple[int, ...] = (tokens // block, layers, block, *dims)
            else:
                shape = (layers, tokens, *dims)
            self.pieces.append(
                KVPiece(done, k.view(shape), v.view(shape), kind == wire.CHUNK_BLOCKS)
            )
            done, at = done + tokens, at + size
        if done != header.num_tokens:
            raise HandoffError(
                f"{self.what}: the stream was truncated: {done} of the header's "
                f"{header.num_tokens} tokens came",
                "truncated",
            )

    def _state(self, header: wire.KVHeader, raw: memoryview) -> Generator[memoryview, None, None]:
        mark = bytearray(wire.CHUNK_HEADER_BYTES)
        yield memoryview(mark)
        chunk = wire.parse_chunk_header(bytes(mark), header.block_size)
        if chunk != (wire.CHUNK_STATE, header.num_tokens):
            raise HandoffError(
                f"{self.what}: expected the prompt's state, got {chunk}", "malformed"
            )
        yield raw[: header.state_bytes]
        end = bytearray(wire.CHUNK_HEADER_BYTES)
        yield memoryview(end)
        if wire.parse_chunk_header(bytes(end), header.block_size) is not None:
            raise HandoffError(f"{self.what}: more than the state came", "malformed")

    def prompt(self) -> PromptKV | DsV4State:
        """The prompt's KV as pieces, or DeepSeek-V4's state (``kv_wire`` kind 3)."""
        header = self.header
        assert header is not None
        if header.state_bytes:
            assert self.buffer is not None
            try:
                return from_bytes(bytes(self.buffer[: header.state_bytes].numpy()))
            except ValueError as exc:
                raise HandoffError(f"{self.what}: {exc}", "malformed") from None
        dims = (header.num_layers, header.num_kv_heads, header.head_dim)
        return PromptKV(self.pieces, header.num_tokens, *dims)
