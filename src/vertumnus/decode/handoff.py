"""A request's hand-off: per prompt, the KV of the prompt but its last token, pulled
from the prefill pool (over HTTP, or ``dist``) where its ``kv_transfer_params`` say
(``transfer.py``), or after a prefill this server asks its pool for, one per prompt
at once (``kv_client``); and the answer a failed hand-off gets (the pool's 400 and
503 pass through, anything else is a 502 ``handoff_error``).

No lease outlives a request that fails: when one prompt's entry, prefill or check
fails, the leases of the others, which nobody will pull, are released first; an
echo without decode (``max_tokens`` 0) pulls nothing and releases them all. Not
here: the decode (``answers.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import structlog
from aiohttp import web

from vertumnus.decode.dist_client import pull_dist
from vertumnus.decode.keys import RESOURCES, SETTINGS
from vertumnus.decode.kv_client import TransferParams, release, request_prefill
from vertumnus.decode.kv_pull import PulledKV, pull
from vertumnus.decode.transfer import (
    FIELD,
    PromptTransfer,
    check_entry,
    read_entry,
    transfer_list,
)
from vertumnus.http_json import error_response
from vertumnus.kv_wire import HandoffError
from vertumnus.protocol.answers import PromptLogprobs
from vertumnus.protocol.errors import BadRequest
from vertumnus.protocol.request import GenerateRequest

log = structlog.get_logger("vertumnus.decode")
T = TypeVar("T")


@dataclass
class Handoff:
    """What a request's decode starts from: one pulled KV per prompt (none for an echo
    without decode), handed on once (``take``: the decode thread copies each into its
    cache, and the request does not keep it for the whole decode)."""

    pulled: list[PulledKV]
    prefill_s: float | None  # the prefills this server asked for (None: a proxy did)
    prompt_logprobs: list[PromptLogprobs] | None
    handoff_s: float = field(init=False)  # the longest pull
    handoff_bytes: int = field(init=False)  # all pulls' streams

    def __post_init__(self) -> None:
        self.handoff_s = max((p.seconds for p in self.pulled), default=0.0)
        self.handoff_bytes = sum(p.num_bytes for p in self.pulled)

    def take(self) -> list[PulledKV]:
        pulled, self.pulled = self.pulled, []
        return pulled


async def handoff(request: web.Request, req: GenerateRequest) -> Handoff:
    """Each prompt's KV and, for an echo with logprobs, its log-probabilities."""
    settings = request.app[SETTINGS]
    prefill_s = None
    if req.transfer is None:
        if req.prompt_logprobs is not None:
            raise BadRequest(
                f"echo with logprobs needs '{FIELD}' with each prompt's prompt_logprobs "
                "(send it through the prefill pool)",
                FIELD,
            )
        if req.max_tokens == 0:  # an echo only: no KV is needed
            return Handoff([], None, None)
        if settings.prefill_url is None:
            raise BadRequest(f"'{FIELD}' is needed: this server has no prefill pool", FIELD)
        start = time.perf_counter()
        transfers = await _prefills(request, req)
        prefill_s = time.perf_counter() - start
    else:
        transfers = await _read(request, req)
    logprobs = [t.prompt_logprobs for t in transfers if t.prompt_logprobs is not None]
    prompt_logprobs = None if req.prompt_logprobs is None else logprobs
    if req.max_tokens == 0:  # an echo: nobody will pull the KV
        await _release(request, (t.params for t in transfers))
        return Handoff([], None, prompt_logprobs)
    return Handoff(await _pulls(request, req, transfers), prefill_s, prompt_logprobs)


async def _read(request: web.Request, req: GenerateRequest) -> list[PromptTransfer]:
    """The request's own ``kv_transfer_params``, one entry per prompt."""
    items = transfer_list(req.transfer)
    vocab_size = request.app[SETTINGS].model.vocab_size
    leases: list[TransferParams] = []  # released if the request fails
    read: list[PromptTransfer] = []
    error: BadRequest | None = None
    for i, item in enumerate(items):
        try:
            params, logprobs = read_entry(item)
            leases.append(params)
            if i < len(req.prompts):
                read.append(check_entry(params, logprobs, req.prompts[i], req, vocab_size))
        except BadRequest as exc:
            error = error or exc
    if error is None and len(items) != len(req.prompts):
        error = BadRequest(
            f"'{FIELD}' has {len(items)} entries for {len(req.prompts)} prompts", FIELD
        )
    if error is not None:
        await _release(request, leases)
        raise error
    return read


async def _prefills(request: web.Request, req: GenerateRequest) -> list[PromptTransfer]:
    """One prefill on the pool per prompt, all at once, each KV kept for a pull."""
    settings, session = request.app[SETTINGS], request.app[RESOURCES].pool_session()
    assert settings.prefill_url is not None
    url = settings.prefill_url

    async def one(ids: list[int]) -> PromptTransfer:
        params = await request_prefill(
            url, ids, settings.prefill_key, session=session, timeout_s=settings.prefill_timeout_s
        )
        try:
            parsed = TransferParams.parse(params)
        except ValueError as exc:
            raise HandoffError(f"the prefill pool's answer: {exc}", "malformed") from None
        if parsed.num_tokens != len(ids) - 1:
            await _release(request, [parsed])
            raise HandoffError(
                f"the prefill pool kept {parsed.num_tokens} tokens of a prompt of {len(ids)}",
                "malformed",
            )
        return PromptTransfer(parsed, None)

    done = await _all(one(p.token_ids) for p in req.prompts)
    ok = [t for t in done if isinstance(t, PromptTransfer)]
    if len(ok) < len(done):
        await _release(request, (t.params for t in ok))
        raise next(e for e in done if isinstance(e, BaseException))
    return ok


async def _pulls(
    request: web.Request, req: GenerateRequest, transfers: list[PromptTransfer]
) -> list[PulledKV]:
    """Every prompt's KV, pulled at once; on a failure the pulled ones are freed."""
    settings = request.app[SETTINGS]
    session = request.app[RESOURCES].pool_session()
    fetch = (
        pull
        if settings.transport == "http"
        else partial(pull_dist, host=settings.dist_host, session=session)
    )
    done = await _all(
        fetch(
            t.params.base_url,
            t.params.handle,
            settings.prefill_key,
            model=settings.model,
            timeout_s=settings.pool_timeout_s,
        )
        for t in transfers
    )
    pulled = [p for p in done if isinstance(p, PulledKV)]
    failed = next((e for e in done if isinstance(e, BaseException)), None)
    if failed is None:
        for kv, prompt in zip(pulled, req.prompts, strict=True):
            n = len(prompt.token_ids) - 1
            if kv.header.num_tokens != n:
                failed = BadRequest(
                    f"the pulled KV holds {kv.header.num_tokens} tokens; a prompt of "
                    f"{len(prompt.token_ids)} tokens needs {n}",
                    FIELD,
                )
    if failed is not None:
        for kv in pulled:
            kv.release()
        raise failed
    return pulled


async def _all(calls: Iterable[Awaitable[T]]) -> list[T | BaseException]:
    """Every call's result or exception, run at once (cancelled together)."""
    return await asyncio.gather(*calls, return_exceptions=True)


async def _release(request: web.Request, leases: Iterable[TransferParams]) -> None:
    """Let the pool free KV that nobody will pull (a failure is only logged)."""
    settings, session = request.app[SETTINGS], request.app[RESOURCES].pool_session()

    async def one(t: TransferParams) -> None:
        try:
            await release(
                t.base_url, t.handle, settings.prefill_key, session=session, timeout_s=5.0
            )
        except HandoffError as exc:
            log.warning("release_failed", handle=t.handle, error=str(exc))

    await asyncio.gather(*(one(t) for t in leases))


def handoff_error(exc: HandoffError) -> web.Response:
    if exc.status == 400:
        return error_response(400, str(exc), "invalid_request_error")
    if exc.status == 503:
        return error_response(503, str(exc), "unavailable", retry_after_s=1)
    return error_response(502, str(exc), "handoff_error")
