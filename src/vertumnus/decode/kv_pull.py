"""The pull of a hand-off's KV, received straight into its tensors.

``GET {base}/v1/kv/{handle}`` is one GET with ``Connection: close``, read on a
blocking socket in a thread (``kv_socket.py``) straight into one buffer of an
``Arena`` (``kv_stream.py``), chunk after chunk; the caller gets the chunks as the
pieces of a ``PromptKV`` (``prompt_kv.py``), which the decode engine copies into
its cache once. The caller gives the buffer back (``PulledKV.release``) once the
KV is in its cache.

Errors are one ``HandoffError``, as for the other calls to the pool
(``kv_client.py``). Not here: the wire format (``kv_wire.py``).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import orjson
from torch import Tensor

from vertumnus import kv_wire as wire
from vertumnus.config import ModelConfig
from vertumnus.decode.kv_socket import SocketPull
from vertumnus.decode.kv_stream import ARENA, Arena, KVStream
from vertumnus.decode.prompt_kv import PromptKV
from vertumnus.engine.dsv4.state import DsV4State
from vertumnus.kv_wire import HandoffError


@dataclass
class PulledKV:
    header: wire.KVHeader
    prompt: PromptKV | DsV4State  # CPU, in the stream's dtype; DeepSeek-V4: its state
    num_bytes: int  # the whole stream
    seconds: float  # from the request to the end mark
    stream_s: float | None = None  # from the answer's first bytes to its end mark
    _release: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def kv(self) -> list[tuple[Tensor, Tensor]]:
        """Per layer (K, V), each [n, Hkv, D] (a copy)."""
        if isinstance(self.prompt, DsV4State):
            raise TypeError("DeepSeek-V4's hand-off carries a state, not K and V rows")
        return self.prompt.layers()

    def release(self) -> None:
        """The KV was used: its memory may take the next pull (``kv`` is invalid
        after this). Idempotent; a pull never released only costs new memory."""
        release, self._release = self._release, None
        if release is not None:
            release()


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
    stream = KVStream(what, handle, model, arena)
    context = ssl.create_default_context() if url.scheme == "https" else None
    job = SocketPull(url.hostname, port, request, stream)
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
