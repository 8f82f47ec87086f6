"""The routes that serve a prompt (docs/api.md):

    POST /v1/prefill        {"token_ids": [...]} or {"prompt": "..."}: the first
                            token, where and how fast it was computed
    POST /v1/completions    the OpenAI completions subset: one token from the pool,
                            or (max_tokens > 1, or a stream) through the decode
                            proxy (``proxy.py``)

Bodies are read and checked in ``request_bodies.py``, answers shaped in
``answers.py``; a 400 names the field at fault.
"""

from __future__ import annotations

from aiohttp import web

from vertumnus.server.answers import first_token_completion, serve_prefill
from vertumnus.server.handoff_routes import transfer_params
from vertumnus.server.http import BadRequest, error_response, json_response
from vertumnus.server.keys import COORDINATOR, PROXY, TOKENIZER
from vertumnus.server.request_bodies import CompletionRequest, PrefillRequest, read_body


async def prefill(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    try:
        body = await read_body(request)
        asked = PrefillRequest.parse(body, request.app[TOKENIZER], coord.model_cfg)
    except BadRequest as exc:
        return error_response(400, str(exc), "invalid_request")
    result = await serve_prefill(coord, asked.tokens, asked.handoff)
    if isinstance(result, web.Response):
        return result
    out = dict(result.__dict__)
    out.pop("logits")
    out.pop("handoff")
    if asked.handoff:
        out["kv_transfer_params"] = transfer_params(request, coord, result)
    if asked.ttft_slo_s is not None:
        out["slo_met"] = result.ttft_s <= asked.ttft_slo_s
    return json_response(out)


async def completions(request: web.Request) -> web.StreamResponse:
    coord, tokenizer = request.app[COORDINATOR], request.app[TOKENIZER]
    proxy = request.app.get(PROXY)
    try:
        body = await read_body(request)
        asked = CompletionRequest.parse(body, tokenizer, coord.model_cfg, proxy is not None)
    except BadRequest as exc:
        return error_response(400, str(exc), "invalid_request_error")
    if asked.needs_decode:
        assert proxy is not None
        return await proxy.complete(request, asked.body, asked.tokens)
    result = await serve_prefill(coord, asked.tokens, asked.handoff)
    if isinstance(result, web.Response):
        return result
    text = tokenizer.decode([result.first_token])
    model = body.get("model") or coord.cfg.model
    out = first_token_completion(result, text, model, len(asked.tokens))
    if asked.handoff:
        out["kv_transfer_params"] = transfer_params(request, coord, result)
    return json_response(out)


ROUTES = [
    web.post("/v1/prefill", prefill),
    web.post("/v1/completions", completions),
]
