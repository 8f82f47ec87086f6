"""The pull of a hand-off's KV, received straight into its tensors.

``GET {base}/v1/kv/{handle}`` is read by a small HTTP/1.1 client of its own, on a
blocking socket in a thread (faster than the same reads driven by the event loop,
which wakes for every 64 KB the socket holds): ``recv_into`` writes each chunk of
the ``kv_wire.py`` stream (its K and V, rows or whole blocks) straight into one
buffer, chunk after chunk, with no copy in this process; the caller gets the
chunks as the pieces of a ``PromptKV`` (``prompt_kv.py``), which the decode
engine copies into its cache once. The buffer comes from an ``Arena``: memory
kept for the next pull, its pages already touched, so a pull does not pay a page
fault per 4 KB of a large KV. The caller gives it back (``PulledKV.release``)
once the KV is in its cache.

The request is one GET with ``Connection: close``; the answer must carry a
``Content-Length`` (the pool always sends one). Errors are one ``HandoffError``,
as for the other calls to the pool (``kv_client.py``). Not here: the wire format
(``kv_wire.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import orjson
import torch
from torch import Tensor

from vertumnus import kv_wire as wire
from vertumnus.config import ModelConfig
from vertumnus.decode.prompt_kv import KVPiece, PromptKV
from vertumnus.kv_wire import HandoffError

HEAD_BYTES = 64 * 1024  # the most an answer's status line and headers may take
ERROR_BODY_BYTES = 64 * 1024  # the most of an error answer's body read


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


@dataclass
class PulledKV:
    header: wire.KVHeader
    prompt: PromptKV  # CPU, in the stream's dtype
    num_bytes: int  # the whole stream
    seconds: float  # from the request to the end mark
    stream_s: float | None = None  # from the answer's first bytes to its end mark
    _release: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def kv(self) -> list[tuple[Tensor, Tensor]]:
        """Per layer (K, V), each [n, Hkv, D] (a copy)."""
        return self.prompt.layers()

    def release(self) -> None:
        """The KV was used: its memory may take the next pull (``kv`` is invalid
        after this). Idempotent; a pull never released only costs new memory."""
        release, self._release = self._release, None
        if release is not None:
            release()


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


def error_message(status: int, raw: bytes) -> str:
    """The pool's error answer: its JSON message when it sent one."""
    message = raw[:300].decode("utf-8", errors="replace")
    try:
        body = orjson.loads(raw)
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            message = str(body["error"].get("message", message))
    except orjson.JSONDecodeError:
        pass
    return f"HTTP {status}: {message}"


class _Stream:
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

    def prompt(self) -> PromptKV:
        header = self.header
        assert header is not None
        dims = (header.num_layers, header.num_kv_heads, header.head_dim)
        return PromptKV(self.pieces, header.num_tokens, *dims)


class _Pull:
    """One GET on a blocking socket, run in a thread of its own (``recv_into``
    releases the GIL): its answer head parsed, then its body received region by
    region (``_Stream``). ``abort`` (from any thread) ends it: the blocked read
    returns and the pull fails."""

    def __init__(self, host: str, port: int, request: bytes, stream: _Stream) -> None:
        self.host, self.port, self.request, self.stream = host, port, request, stream
        self.sock: socket.socket | None = None
        self.aborted = False
        self.num_bytes = 0
        self.stream_s: float | None = None

    def abort(self) -> None:
        self.aborted = True
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def run(self, timeout_s: float, context: ssl.SSLContext | None) -> tuple[int, bytes]:
        """(200, b"") once the stream is whole, or an error status and its body."""
        what = self.stream.what
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout_s)
        except OSError as exc:
            message = f"{what}: cannot reach the prefill pool: {exc!r}"
            raise HandoffError(message, "unreachable") from exc
        try:
            if context is not None:
                sock = context.wrap_socket(sock, server_hostname=self.host)
            self.sock = sock
            if self.aborted:
                raise HandoffError(f"{what}: given up", "unreachable")
            sock.sendall(self.request)
            status, length, rest = self._head(sock)
            if status != 200:
                return status, self._error_body(sock, length, rest)
            first = time.perf_counter()
            body = self._body(sock, length, rest)
            self.stream_s = time.perf_counter() - first
            return status, body
        except TimeoutError as exc:
            raise HandoffError(
                f"{what}: nothing came for {timeout_s:.0f} s", "unreachable"
            ) from exc
        except OSError as exc:
            if self.aborted:
                raise HandoffError(f"{what}: given up", "unreachable") from exc
            raise HandoffError(f"{what}: the stream was truncated: {exc!r}", "truncated") from exc
        finally:
            sock.close()

    def _head(self, sock: socket.socket) -> tuple[int, int, bytes]:
        """The status, the Content-Length and the bytes read past the head."""
        what, head = self.stream.what, bytearray()
        while (end := head.find(b"\r\n\r\n")) < 0:
            if len(head) > HEAD_BYTES:
                raise HandoffError(f"{what}: an answer head too long", "malformed")
            piece = sock.recv(HEAD_BYTES)
            if not piece:
                raise HandoffError(f"{what}: the stream was truncated: no answer", "truncated")
            head += piece
        lines = head[:end].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise HandoffError(f"{what}: not an HTTP answer: {lines[0]!r}", "malformed")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = headers.get("content-length")
        if length is None or not length.isdigit():
            raise HandoffError(
                f"{what}: the answer has no Content-Length (a proxy between this server "
                "and the pool that re-chunks the stream?)",
                "malformed",
            )
        return int(parts[1]), int(length), bytes(head[end + 4 :])

    def _error_body(self, sock: socket.socket, length: int, rest: bytes) -> bytes:
        body = bytearray(rest)
        while len(body) < min(length, ERROR_BODY_BYTES):
            piece = sock.recv(ERROR_BODY_BYTES)
            if not piece:
                break
            body += piece
        return bytes(body[:ERROR_BODY_BYTES])

    def _body(self, sock: socket.socket, length: int, rest: bytes) -> bytes:
        what = self.stream.what
        regions = self.stream.regions()
        region: memoryview | None = next(regions)
        data = memoryview(rest)
        left = length
        while region is not None:
            if len(data):  # bytes that came with the head: copied into their regions
                n = min(len(data), len(region))
                region[:n] = data[:n]
                data = data[n:]
            else:
                if left <= 0:
                    raise HandoffError(
                        f"{what}: the stream was truncated: it ended within its Content-Length",
                        "truncated",
                    )
                n = sock.recv_into(region, min(len(region), left))
                if n == 0:
                    raise HandoffError(
                        f"{what}: the stream was truncated: {left} bytes missing", "truncated"
                    )
            left -= n
            self.num_bytes += n
            region = region[n:]
            while region is not None and not len(region):
                region = next(regions, None)
        if left != 0 or len(data):
            raise HandoffError(f"{what}: the answer's length and its stream differ", "malformed")
        return b""


_THREADS: ThreadPoolExecutor | None = None
PULL_THREADS = 8  # pulls received at once (more wait for a thread)


def _threads() -> ThreadPoolExecutor:
    global _THREADS
    if _THREADS is None:
        _THREADS = ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="kv-pull")
    return _THREADS


async def pull(
    base: str,
    handle: str,
    token: str | None,
    *,
    model: ModelConfig | None = None,
    timeout_s: float = 60.0,
    arena: Arena | None = None,
) -> PulledKV:
    """The KV of ``handle`` from the pool at ``base`` (``http://`` or ``https://``),
    into a buffer of ``arena`` (default: the process's); its header must fit
    ``model`` (when given). ``timeout_s``: to connect, and at most between two
    reads. A pulled lease is gone on the pool. Cancelled, the pull stops at once."""
    url = urlsplit(base.rstrip("/"))
    what = f"pull of KV {handle!r} from {base}"
    if url.scheme not in ("http", "https") or not url.hostname:
        raise HandoffError(f"{what}: not an http(s) address", "unreachable")
    port = url.port or (443 if url.scheme == "https" else 80)
    host = url.netloc.rpartition("@")[2]
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    request = (
        f"GET {url.path}/v1/kv/{handle} HTTP/1.1\r\nHost: {host}\r\n{auth}"
        "Accept: application/octet-stream\r\nConnection: close\r\n\r\n"
    ).encode("latin-1")
    arena = arena or ARENA
    stream = _Stream(what, handle, model, arena)
    context = ssl.create_default_context() if url.scheme == "https" else None
    job = _Pull(url.hostname, port, request, stream)
    start = time.perf_counter()
    loop = asyncio.get_running_loop()
    try:
        try:
            status, body = await loop.run_in_executor(_threads(), job.run, timeout_s, context)
        except asyncio.CancelledError:
            job.abort()
            raise
        except wire.WireError as exc:
            raise HandoffError(f"{what}: {exc}", "malformed") from exc
        if status != 200:
            raise HandoffError(f"{what}: {error_message(status, body)}", "http", status)
    except BaseException:
        if stream.buffer is not None and not job.aborted:
            arena.give(stream.buffer)
        raise
    seconds = time.perf_counter() - start
    header, buffer = stream.header, stream.buffer
    assert header is not None and buffer is not None
    prompt = stream.prompt()
    return PulledKV(
        header, prompt, job.num_bytes, seconds, job.stream_s, lambda: arena.give(buffer)
    )
