"""A completion's hand-off: the KV of its prompt but the last token, pulled from
the prefill pool (over HTTP, or ``dist``) where its ``kv_transfer_params`` say, or
after a prefill this server asks its pool for (``kv_client``); and the answer a
failed hand-off gets (the pool's 400 and 503 pass through, anything else is a 502
``handoff_error``). Not here: the decode (``answers.py``)."""

from __future__ import annotations

import time
from functools import partial

import structlog
from aiohttp import web

from vertumnus.decode.completion import Completion
from vertumnus.decode.dist_client import pull_dist
from vertumnus.decode.keys import RESOURCES, SETTINGS
from vertumnus.decode.kv_client import (
    HandoffError,
    PulledKV,
    TransferParams,
    pull,
    release,
    request_prefill,
)
from vertumnus.server.http import BadRequest, error_response

log = structlog.get_logger("vertumnus.decode")


async def handoff(request: web.Request, req: Completion) -> tuple[PulledKV, float | None]:
    """The prompt's KV (``PulledKV``) and the seconds of the prefill this server asked
    for (None when the request brought ``kv_transfer_params``)."""
    settings, session = request.app[SETTINGS], request.app[RESOURCES].pool_session()
    key, timeout_s = settings.prefill_key, settings.pool_timeout_s
    transfer, prefill_s = req.transfer, None
    if transfer is None:
        if settings.prefill_url is None:
            raise BadRequest("'kv_transfer_params' is needed: this server has no prefill pool")
        start = time.perf_counter()
        params = await request_prefill(
            settings.prefill_url,
            req.token_ids,
            key,
            session=session,
            timeout_s=settings.prefill_timeout_s,
        )
        prefill_s = time.perf_counter() - start
        try:
            transfer = TransferParams.parse(params)
        except ValueError as exc:
            raise HandoffError(f"the prefill pool's answer: {exc}", "malformed") from None
    n = len(req.token_ids) - 1
    if transfer.num_tokens != n:
        try:  # nobody will pull it: let the pool free it now
            await release(transfer.base_url, transfer.handle, key, session=session, timeout_s=5.0)
        except HandoffError as exc:
            log.warning("release_failed", handle=transfer.handle, error=str(exc))
        raise BadRequest(
            f"'kv_transfer_params.num_tokens' is {transfer.num_tokens}; a prompt of "
            f"{len(req.token_ids)} tokens needs the KV of {n}"
        )
    fetch = (
        pull
        if settings.transport == "http"
        else partial(pull_dist, host=settings.dist_host, session=session)
    )
    pulled = await fetch(
        transfer.base_url, transfer.handle, key, model=settings.model, timeout_s=timeout_s
    )
    if pulled.header.num_tokens != n:
        raise BadRequest(
            f"the pulled KV holds {pulled.header.num_tokens} tokens; a prompt of "
            f"{len(req.token_ids)} tokens needs {n}"
        )
    return pulled, prefill_s


def handoff_error(exc: HandoffError) -> web.Response:
    if exc.status == 400:
        return error_response(400, str(exc), "invalid_request_error")
    if exc.status == 503:
        return error_response(503, str(exc), "unavailable", retry_after_s=1)
    return error_response(502, str(exc), "handoff_error")
