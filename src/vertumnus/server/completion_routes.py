"""The routes that serve a prompt (docs/api.md):

    POST /v1/prefill               {"token_ids": [...]} or {"prompt": "..."}: the
                                   first token, where and how fast it was computed
    POST /v1/completions           OpenAI's completions and chat completions
    POST /v1/chat/completions      (``protocol/request.py``): answered by the pool
                                   itself when ``max_tokens`` is 0 (an echo) or 1
                                   without ``stream``, else through the decode proxy
                                   (``proxy.py``)

The prefill's body is read in ``request_bodies.py``, the completions' in
``protocol/request.py``; answers are shaped in ``answers.py``. A 400 names the field
at fault (``param``). The pool's own answer prefills every prompt at once and
chooses each copy's token from its prompt's last logits
(``decode/first_token.py``). ``kv_transfer_params`` with ``do_remote_decode``
there keeps the KV of its one prompt for a decode server, and the answer says
where; a proxy's own path sets them itself.
"""

from __future__ import annotations

import time

from aiohttp import web

from vertumnus.http_json import bad_request, json_response
from vertumnus.protocol.errors import BadRequest
from vertumnus.protocol.request import GenerateRequest, Served, parse
from vertumnus.server.answers import pool_answer, serve_prefill, serve_prefills
from vertumnus.server.handoff_routes import transfer_params
from vertumnus.server.keys import COORDINATOR, EOS_TOKEN_IDS, PROXY, TOKENIZER
from vertumnus.server.request_bodies import PrefillRequest, handoff_asked, read_body


async def prefill(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    try:
        body = await read_body(request)
        asked = PrefillRequest.parse(body, request.app[TOKENIZER], coord.model_cfg)
    except BadRequest as exc:
        return bad_request(exc, "invalid_request")
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


def check_servable(req: GenerateRequest, handoff: bool, decodes: bool, dsv4: bool = False) -> None:
    """What this server cannot do with a checked request: decode without a decode
    server, keep the KV of several prompts on the pool's own path, or (``dsv4``: the
    served model is DeepSeek-V4) a prompt's log-probabilities."""
    if dsv4 and req.prompt_logprobs is not None:
        raise BadRequest(
            "prompt logprobs (echo with logprobs) are not built for DeepSeek-V4 yet", "echo"
        )
    if req.needs_decode and not decodes:
        param = "stream" if req.stream else "max_tokens"
        raise BadRequest(
            "this server has no decode server ([decode] local = false and no url): "
            "max_tokens 0 (with echo) or 1, without stream, only",
            param,
        )
    if handoff and not req.needs_decode and len(req.prompts) > 1:
        raise BadRequest(
            "'kv_transfer_params' with do_remote_decode keeps the KV of one prompt: "
            f"this request has {len(req.prompts)}",
            "kv_transfer_params",
        )


async def generate(request: web.Request, chat: bool) -> web.StreamResponse:
    app, arrived = request.app, time.perf_counter()
    coord, tokenizer, proxy = app[COORDINATOR], app[TOKENIZER], app.get(PROXY)
    model = coord.model_cfg
    served = Served(coord.cfg.model, tokenizer, model.vocab_size, model.max_position_embeddings)
    try:
        body = await read_body(request)
        req = parse(body, served, chat)
        handoff = handoff_asked(body)
        check_servable(req, handoff, proxy is not None, model.dsv4 is not None)
        if req.needs_decode and proxy is not None:
            proxy.check(req)
    except BadRequest as exc:
        return bad_request(exc)
    if req.needs_decode:
        assert proxy is not None
        return await proxy.complete(request, req, body, chat)
    prompts = [p.token_ids for p in req.prompts]
    results = await serve_prefills(coord, prompts, handoff, req.prompt_logprobs)
    if isinstance(results, web.Response):
        return results
    out = pool_answer(req, results, tokenizer, app[EOS_TOKEN_IDS], arrived)
    if handoff:
        out["kv_transfer_params"] = transfer_params(request, coord, results[0])
    coord.metrics.request_done(time.perf_counter() - arrived, out["usage"]["completion_tokens"])
    return json_response(out)


async def completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, chat=True)


ROUTES = [
    web.post("/v1/prefill", prefill),
    web.post("/v1/completions", completions),
    web.post("/v1/chat/completions", chat_completions),
]
