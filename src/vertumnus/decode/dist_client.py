"""The ``dist`` transport of the KV hand-off: the pool's ranks send a prompt's blocks
to the decode server point to point over torch.distributed, not through the
coordinator (``POST /v1/kv/{handle}/dist``; docs/api.md, "Transport").

The decode server hosts a ``TCPStore`` on a free port and asks the pool to send;
the pool answers at once with the layout (per rank of the worker: the group's name
and the depths of the blocks it sends, in order) and the rows no block holds (over
HTTP, they live in the coordinator); then every rank joins its two-member group
(the decode server is member 0) and sends one tensor [2, layers, blocks * block,
Hkv, D], which lands here in one receive per rank. NCCL when both sides are on
GPUs, gloo on CPU: both sides must be alike. Tested with gloo on CPU ranks; the
NCCL path is the same code with the other backend, and has not been run (no GPU
pair was available).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import timedelta

import aiohttp
import orjson
import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from vertumnus import kv_wire as wire
from vertumnus.config import ModelConfig
from vertumnus.decode.kv_client import DEFAULT_TIMEOUT_S, _auth, _error_of, _session
from vertumnus.decode.kv_pull import PulledKV
from vertumnus.decode.kv_stream import TORCH_DTYPES, check_header
from vertumnus.decode.prompt_kv import PromptKV
from vertumnus.engine.comm import make_group
from vertumnus.kv_wire import HandoffError


async def pull_dist(
    base: str,
    handle: str,
    token: str | None,
    *,
    model: ModelConfig | None = None,
    device: torch.device | None = None,
    host: str = "127.0.0.1",
    session: aiohttp.ClientSession | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> PulledKV:
    """The KV of ``handle`` from the pool at ``base`` by the ``dist`` transport;
    ``host``: this server's address as the pool's ranks reach it (the store's)."""
    device = device or torch.device("cpu")
    what = f"dist pull of KV {handle!r} from {base}"
    wait = timedelta(seconds=timeout_s)
    start = time.perf_counter()
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=wait)
    body = {"store_host": host, "store_port": store.port, "prefix": f"kv/{uuid.uuid4().hex}"}
    url = f"{base.rstrip('/')}/v1/kv/{handle}/dist"
    try:
        async with _session(session) as s, s.post(url, json=body, headers=_auth(token)) as resp:
            if resp.status != 200:
                raise await _error_of(resp, what)
            raw = await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        message = f"{what}: cannot reach the prefill pool: {exc!r}"
        raise HandoffError(message, "unreachable") from exc
    n = int.from_bytes(raw[:4], "little")
    layout = orjson.loads(raw[4 : 4 + n])
    try:
        header = wire.KVHeader(**layout["header"])
    except (TypeError, wire.WireError) as exc:
        raise HandoffError(f"{what}: bad layout: {exc}", "malformed") from exc
    check_header(header, handle, model)
    dtype, block = TORCH_DTYPES[header.dtype], header.block_size
    shape = (header.num_layers, header.num_tokens, header.num_kv_heads, header.head_dim)
    k = torch.empty(shape, dtype=dtype, device=device)
    v = torch.empty_like(k)

    def receive(entry: dict[str, object]) -> None:
        depths = entry["depths"]
        assert isinstance(depths, list)
        group = make_group(store, str(entry["group"]), (0, 1), 0, device, wait)
        rows = torch.empty(
            (2, header.num_layers, len(depths) * block, *shape[2:]), dtype=dtype, device=device
        )
        group.recv([rows], 1, 0).wait()
        for i, depth in enumerate(depths):
            at = depth * block
            k[:, at : at + block] = rows[0, :, i * block : (i + 1) * block]
            v[:, at : at + block] = rows[1, :, i * block : (i + 1) * block]

    try:
        await asyncio.gather(*(asyncio.to_thread(receive, e) for e in layout["ranks"]))
    except RuntimeError as exc:  # a rank that never joined, or a broken group
        raise HandoffError(f"{what}: the ranks' send failed: {exc}", "unreachable") from exc
    _rows_into(raw[4 + n :], int(layout["rows_from"]), header, k, v, what)
    seconds = time.perf_counter() - start
    return PulledKV(header, PromptKV.from_rows(k, v), header.total_bytes, seconds)


def _rows_into(
    rest: bytes, first: int, header: wire.KVHeader, k: torch.Tensor, v: torch.Tensor, what: str
) -> None:
    """The rows no block holds (a wire chunk, or none), then the end mark."""
    chunk = wire.parse_chunk_header(rest[: wire.CHUNK_HEADER_BYTES], header.block_size)
    at, tokens = wire.CHUNK_HEADER_BYTES, None
    if chunk is not None:
        if chunk[0] != wire.CHUNK_ROWS:
            raise HandoffError(f"{what}: the rows come as a chunk of kind {chunk[0]}", "malformed")
        tokens = chunk[1]
        size = tokens * header.token_bytes
        data = torch.frombuffer(bytearray(rest[at : at + size]), dtype=TORCH_DTYPES[header.dtype])
        rows = data.view(2, header.num_layers, tokens, header.num_kv_heads, header.head_dim)
        k[:, first : first + tokens] = rows[0].to(k.device)
        v[:, first : first + tokens] = rows[1].to(v.device)
        at += size
        end = rest[at : at + wire.CHUNK_HEADER_BYTES]
        if wire.parse_chunk_header(end, header.block_size) is not None:
            raise HandoffError(f"{what}: more than one chunk of rows", "malformed")
        at += wire.CHUNK_HEADER_BYTES
    if at != len(rest) or first + (tokens or 0) != header.num_tokens:
        raise HandoffError(f"{what}: the rows do not complete the prompt", "malformed")
