"""The decode side's calls to the prefill pool: ask for a prefill whose KV is kept
for us (``request_prefill``), pull that KV (``pull``, from ``kv_pull.py``: received
straight into its tensors), or give it up (``release``).

Whatever goes wrong (the pool's 404/410/401 with its JSON message, a stream cut
short, a header whose shape is not the served model's, an unreachable pool) is one
``HandoffError`` that says so. Not here: the wire format itself (``kv_wire.py``), what
the KV is used for (``engine.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from vertumnus.decode.kv_pull import error_message
from vertumnus.kv_wire import HandoffError

__all__ = ["TransferParams", "release", "request_prefill"]

DEFAULT_TIMEOUT_S = 60.0  # connect, and the longest wait for the next bytes
# A prefill answers only when done: a long prompt behind a queue takes minutes.
PREFILL_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class TransferParams:
    """Where a prompt's KV waits: the part of ``kv_transfer_params`` a pull needs."""

    base_url: str  # {remote_scheme}://remote_host:remote_port
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
        scheme = params.get("remote_scheme", "http")
        if scheme not in ("http", "https"):
            raise ValueError("'kv_transfer_params.remote_scheme' must be 'http' or 'https'")
        host = f"[{host}]" if ":" in host else host  # an IPv6 literal
        return cls(f"{scheme}://{host}:{port}", handle, num_tokens)


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
    message = error_message(resp.status, await resp.read())
    return HandoffError(f"{what}: {message}", "http", resp.status)


async def request_prefill(
    prefill_url: str,
    token_ids: list[int],
    key: str | None,
    *,
    session: aiohttp.ClientSession | None = None,
    timeout_s: float = PREFILL_TIMEOUT_S,
) -> dict[str, Any]:
    """Prefill ``token_ids`` on the pool, keeping their KV for a pull; returns the
    answer's ``kv_transfer_params`` (the one object, also when the pool answers a
    list of one)."""
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
    if isinstance(params, list) and len(params) == 1:  # one per prompt: here one prompt
        params = params[0]
    if not isinstance(params, dict):
        raise HandoffError(
            f"prefill at {url}: no kv_transfer_params in the answer (is it a decode-enabled "
            "vertumnus pool?)",
            "malformed",
        )
    return params


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
