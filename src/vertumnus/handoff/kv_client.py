"""The decode side's calls to the prefill pool (aiohttp): ask for a prefill whose KV
is kept for us (``request_prefill``), pull that KV (``pull``), or give it up
(``release``).

``pull`` reads the ``wire.py`` stream of ``GET {base}/v1/kv/{handle}`` as it
arrives: the header sizes one K and one V tensor [L, n, Hkv, D] up front; each chunk
is read into one reused staging buffer, viewed in place with ``torch.frombuffer``
and copied once into its rows. The caller gets per-layer views [n, Hkv, D] of those
two tensors, on the CPU, in the stream's dtype. Whatever goes wrong (the pool's
404/410/401 with its JSON message, a stream cut short, a header whose shape is not
the served model's, an unreachable pool) is one ``HandoffError`` that says so. Not
here: the wire format itself (``wire.py``), what the KV is used for
(``decode_engine.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import torch
from torch import Tensor

from vertumnus.config import ModelConfig
from vertumnus.handoff import wire

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_TIMEOUT_S = 60.0  # connect, and the longest wait for the next bytes
# A prefill answers only when done: a long prompt behind a queue takes minutes.
PREFILL_TIMEOUT_S = 600.0


class HandoffError(RuntimeError):
    """A hand-off that failed. ``status``: the pool's HTTP status when it answered
    with an error (None otherwise); ``kind``: ``http``, ``unreachable``,
    ``truncated``, ``malformed`` or ``mismatch``."""

    def __init__(self, message: str, kind: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind, self.status = kind, status


@dataclass(frozen=True)
class TransferParams:
    """Where a prompt's KV waits: the part of ``kv_transfer_params`` a pull needs."""

    base_url: str  # http://remote_host:remote_port
    handle: str
    num_tokens: int  # the prompt's length - 1

    @classmethod
    def parse(cls, params: Any) -> TransferParams:
        """From the pool's ``kv_transfer_params``; ``ValueError`` names what is wrong."""
        if not isinstance(params, dict):
            raise ValueError("'kv_transfer_params' must be an object")
        host, port = params.get("remote_host"), params.get("remote_port")
        handle, num_tokens = params.get("remote_handle"), params.get("num_tokens")
        if not isinstance(host, str) or not host:
            raise ValueError("'kv_transfer_params.remote_host' must be a host name")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ValueError("'kv_transfer_params.remote_port' must be a port number")
        if not isinstance(handle, str) or not handle:
            raise ValueError("'kv_transfer_params.remote_handle' must be a non-empty string")
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ValueError("'kv_transfer_params.num_tokens' must be an integer >= 0")
        host = f"[{host}]" if ":" in host else host  # an IPv6 literal
        return cls(f"http://{host}:{port}", handle, num_tokens)


@dataclass(frozen=True)
class PulledKV:
    header: wire.KVHeader
    kv: list[tuple[Tensor, Tensor]]  # per layer (K, V), each [n, Hkv, D], CPU
    num_bytes: int  # the whole stream
    seconds: float  # from the request to the end mark


_JSON = {"Content-Type": "application/json"}


def _auth(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _timeout(seconds: float) -> aiohttp.ClientTimeout:
    """No bound on the whole call (a long prompt's KV takes its time); ``seconds`` to
    connect and at most between two reads."""
    return aiohttp.ClientTimeout(total=None, sock_connect=seconds, sock_read=seconds)


@asynccontextmanager
async def _session(session: aiohttp.ClientSession | None) -> AsyncIterator[aiohttp.ClientSession]:
    """The caller's session, or one for this call only."""
    if session is not None:
        yield session
        return
    async with aiohttp.ClientSession() as own:
        yield own


async def _error_of(resp: aiohttp.ClientResponse, what: str) -> HandoffError:
    """The pool's error answer, with its JSON message when it sent one."""
    raw = await resp.read()
    message = raw[:300].decode("utf-8", errors="replace")
    try:
        body = orjson.loads(raw)
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            message = str(body["error"].get("message", message))
    except orjson.JSONDecodeError:
        pass
    return HandoffError(f"{what}: HTTP {resp.status}: {message}", "http", resp.status)


async def request_prefill(
    prefill_url: str,
    token_ids: list[int],
    key: str | None,
    *,
    session: aiohttp.ClientSession | None = None,
    timeout_s: float = PREFILL_TIMEOUT_S,
) -> dict[str, Any]:
    """Prefill ``token_ids`` on the pool, keeping their KV for a pull; returns the
    answer's ``kv_transfer_params``."""
    url = f"{prefill_url.rstrip('/')}/v1/completions"
    body = {"prompt": token_ids, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    try:
        async with (
            _session(session) as s,
            s.post(
                url,
                data=orjson.dumps(body),
                headers=_auth(key) | _JSON,
                timeout=_timeout(timeout_s),
            ) as resp,
        ):
            if resp.status != 200:
                raise await _error_of(resp, f"prefill at {url}")
            answer = orjson.loads(await resp.read())
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise HandoffError(
            f"cannot reach the prefill pool at {url}: {exc!r}", "unreachable"
        ) from exc
    except orjson.JSONDecodeError as exc:
        raise HandoffError(f"prefill at {url}: the answer is not JSON: {exc}", "malformed") from exc
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict):
        raise HandoffError(
            f"prefill at {url}: no kv_transfer_params in the answer (is it a decode-enabled "
            "vertumnus pool?)",
            "malformed",
        )
    return params


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


class _Reader:
    """Exact reads from a response body, counting bytes; EOF early is truncation."""

    def __init__(self, content: aiohttp.StreamReader, what: str) -> None:
        self.content, self.what, self.num_bytes = content, what, 0

    async def exactly(self, n: int) -> bytes:
        try:
            data = await self.content.readexactly(n)
        except asyncio.IncompleteReadError as exc:
            raise self.truncated(f"{n - len(exc.partial)} bytes missing") from None
        self.num_bytes += n
        return data

    async def into_layers(
        self, dest: memoryview, layer_bytes: int, at: int, tokens_bytes: int, layers: int
    ) -> None:
        """Read ``layers`` runs of ``tokens_bytes`` (a chunk's K or V: [L, t, Hkv, D])
        straight into ``dest``, the bytes of a contiguous [L, n, Hkv, D] tensor: run l
        goes to ``l * layer_bytes + at``. One copy from the socket's pieces."""
        left, layer, off = layers * tokens_bytes, 0, 0
        while left:
            piece = await self.content.read(left)
            if not piece:
                raise self.truncated(f"a chunk's tensors lack their last {left} bytes")
            left -= len(piece)
            view = memoryview(piece)
            while view:
                n = min(len(view), tokens_bytes - off)
                start = layer * layer_bytes + at + off
                dest[start : start + n] = view[:n]
                view, off = view[n:], off + n
                if off == tokens_bytes:
                    layer, off = layer + 1, 0
        self.num_bytes += layers * tokens_bytes

    def truncated(self, detail: str) -> HandoffError:
        return HandoffError(f"{self.what}: the stream was truncated: {detail}", "truncated")


async def _read_stream(
    content: aiohttp.StreamReader, what: str, handle: str, model: ModelConfig | None
) -> tuple[wire.KVHeader, Tensor, Tensor, int]:
    """K and V [L, n, Hkv, D] of the whole stream, and its bytes."""
    reader = _Reader(content, what)
    length = wire.header_length(await reader.exactly(wire.HEADER_PREFIX_BYTES))
    header = wire.KVHeader.decode(await reader.exactly(length))
    check_header(header, handle, model)
    dtype = TORCH_DTYPES[header.dtype]
    dims = (header.num_kv_heads, header.head_dim)
    k = torch.empty((header.num_layers, header.num_tokens, *dims), dtype=dtype)
    v = torch.empty_like(k)
    row_bytes = header.token_bytes // 2 // header.num_layers  # K (or V): one token, one layer
    layer_bytes = header.num_tokens * row_bytes
    # (no rows: nothing to write, and a memoryview of an empty tensor cannot be cast)
    dests = [t.view(torch.uint8).numpy().data.cast("B") for t in (k, v) if t.numel()]
    done = 0
    while (
        tokens := wire.parse_chunk_header(await reader.exactly(wire.CHUNK_HEADER_BYTES))
    ) is not None:
        if done + tokens > header.num_tokens:
            raise HandoffError(
                f"{what}: chunks carry more than the header's {header.num_tokens} tokens",
                "malformed",
            )
        for dest in dests:
            at, run = done * row_bytes, tokens * row_bytes
            await reader.into_layers(dest, layer_bytes, at, run, header.num_layers)
        done += tokens
    if done != header.num_tokens:
        raise reader.truncated(f"{done} of the header's {header.num_tokens} tokens came")
    if await content.read(1):
        raise HandoffError(f"{what}: bytes after the end mark", "malformed")
    return header, k, v, reader.num_bytes


async def pull(
    base: str,
    handle: str,
    token: str | None,
    *,
    model: ModelConfig | None = None,
    session: aiohttp.ClientSession | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> PulledKV:
    """The KV of ``handle`` from the pool at ``base``; its header must fit ``model``
    (when given): layers, KV heads and head_dim. A pulled lease is gone on the pool."""
    url = f"{base.rstrip('/')}/v1/kv/{handle}"
    what = f"pull of KV {handle!r} from {base}"
    start = time.perf_counter()
    try:
        async with (
            _session(session) as s,
            s.get(url, headers=_auth(token), timeout=_timeout(timeout_s)) as resp,
        ):
            if resp.status != 200:
                raise await _error_of(resp, what)
            header, k, v, num_bytes = await _read_stream(resp.content, what, handle, model)
    except wire.WireError as exc:
        raise HandoffError(f"{what}: {exc}", "malformed") from exc
    except aiohttp.ClientPayloadError as exc:  # the connection closed mid-body
        raise HandoffError(f"{what}: the stream was truncated: {exc!r}", "truncated") from exc
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise HandoffError(
            f"{what}: cannot reach the prefill pool: {exc!r}", "unreachable"
        ) from exc
    seconds = time.perf_counter() - start
    return PulledKV(header, [(k[i], v[i]) for i in range(header.num_layers)], num_bytes, seconds)


async def release(
    base: str,
    handle: str,
    token: str | None,
    *,
    session: aiohttp.ClientSession | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> bool:
    """Give up the KV of ``handle`` (``DELETE``): True when the pool let it go, False
    when it was gone already (404/410). Other failures raise ``HandoffError``."""
    url = f"{base.rstrip('/')}/v1/kv/{handle}"
    try:
        async with (
            _session(session) as s,
            s.delete(url, headers=_auth(token), timeout=_timeout(timeout_s)) as resp,
        ):
            if resp.status in (404, 410):
                return False
            if resp.status >= 300:
                raise await _error_of(resp, f"release of KV {handle!r} at {base}")
            return True
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise HandoffError(
            f"cannot reach the prefill pool at {base}: {exc!r}", "unreachable"
        ) from exc
