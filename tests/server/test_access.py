"""Access control of the REST API, on the app itself (no rank processes): the admin
token for /v1/admin/*, the optional API key for the rest of /v1, open health and
metrics routes, tokens from the environment or the config file."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from vertumnus.config import ConfigError
from vertumnus.protocol.tokenizer import Tokenizer
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.serve_config import ServeConfig, load
from vertumnus.server.app import build_app
from vertumnus.slo import TtftSlo

ADMIN = "admin-token-0123456789"
KEY = "api-key-0123456789abcdef"


def calls(
    cfg: ServeConfig, requests: list[tuple[str, str, Mapping[str, str]]]
) -> list[tuple[int, Any, Mapping[str, str]]]:
    """(status, JSON body, headers) of each (method, path, headers), against an app
    whose coordinator never started (a prefill that gets through answers 503)."""

    async def main() -> list[tuple[int, Any, Mapping[str, str]]]:
        coord = Coordinator(cfg)
        tokenizer = Tokenizer.for_model(coord.model_dir, coord.model_cfg.vocab_size)
        async with TestClient(TestServer(build_app(coord, tokenizer))) as client:
            out = []
            for method, path, headers in requests:
                body = {"op": "merge"} if "admin" in path else {"token_ids": [1, 2, 3]}
                resp = await client.request(
                    method, path, json=body if method == "POST" else None, headers=dict(headers)
                )
                data = await resp.json() if resp.content_type == "application/json" else None
                out.append((resp.status, data, dict(resp.headers)))
            return out

    return asyncio.run(main())


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.timeout(60)
def test_admin_calls_need_the_admin_token() -> None:
    cfg = ServeConfig(admin_token=ADMIN)
    missing, wrong, basic, good = calls(
        cfg,
        [
            ("POST", "/v1/admin/reconfigure", {}),
            ("POST", "/v1/admin/reconfigure", bearer("not-the-token-at-all")),
            ("POST", "/v1/admin/reconfigure", {"Authorization": f"Basic {ADMIN}"}),
            ("POST", "/v1/admin/reconfigure", bearer(ADMIN)),
        ],
    )
    assert missing[0] == 401 and missing[1]["error"]["type"] == "unauthorized"
    assert missing[2]["WWW-Authenticate"].startswith("Bearer")
    assert wrong[0] == 403 and wrong[1]["error"]["message"] == "wrong admin token"
    assert basic[0] == 401
    # Through the gate: the coordinator (never started) cannot reshape: 503.
    assert good[0] == 503 and good[2]["Retry-After"], good
    assert ADMIN not in str(good[1])


@pytest.mark.timeout(60)
def test_without_an_admin_token_every_admin_call_is_refused() -> None:
    results = calls(
        ServeConfig(),
        [
            ("POST", "/v1/admin/reconfigure", {}),
            ("POST", "/v1/admin/reconfigure", bearer(ADMIN)),
            ("GET", "/v1/admin/anything", bearer(ADMIN)),
        ],
    )
    for status, body, _ in results:
        assert status == 403 and "VERTUMNUS_ADMIN_TOKEN" in body["error"]["message"]


@pytest.mark.timeout(60)
def test_the_api_key_guards_v1_but_not_health() -> None:
    cfg = ServeConfig(api_key=KEY)
    results = calls(
        cfg,
        [
            ("POST", "/v1/prefill", {}),
            ("POST", "/v1/prefill", bearer("wrong-key-0123456789")),
            ("GET", "/v1/workers", {}),
            ("POST", "/v1/prefill", bearer(KEY)),
            ("GET", "/health", {}),
            ("GET", "/openapi.json", {}),
            ("GET", "/metrics", {}),
        ],
    )
    statuses = [r[0] for r in results]
    assert statuses[:3] == [401, 401, 401]
    assert statuses[3] == 503  # through the gate; the pool is not running
    assert results[3][2]["Retry-After"]
    assert statuses[4:] == [200, 200, 200]
    # No API key configured: /v1 is open.
    (open_call,) = calls(ServeConfig(), [("GET", "/v1/workers", {})])
    assert open_call[0] == 200


@pytest.mark.timeout(60)
def test_the_pool_lists_its_model_as_openai_clients_expect() -> None:
    """``GET /v1/models``, behind the API key like the rest of /v1."""
    refused, listed = calls(
        ServeConfig(api_key=KEY), [("GET", "/v1/models", {}), ("GET", "/v1/models", bearer(KEY))]
    )
    assert refused[0] == 401
    assert listed[0] == 200
    (entry,) = listed[1]["data"]
    assert listed[1]["object"] == "list"
    assert (entry["id"], entry["object"], entry["owned_by"]) == ("tiny", "model", "vertumnus")
    assert entry["max_model_len"] > 0


def test_tokens_come_from_the_environment_or_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "serve.toml"
    path.write_text(f'[server]\nadmin_token = "{ADMIN}"\n')
    monkeypatch.delenv("VERTUMNUS_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("VERTUMNUS_API_KEY", raising=False)
    assert load(path).admin_token == ADMIN and load(path).api_key is None
    monkeypatch.setenv("VERTUMNUS_ADMIN_TOKEN", "from-the-environment-123")
    monkeypatch.setenv("VERTUMNUS_API_KEY", KEY)
    cfg = load(path)
    assert (cfg.admin_token, cfg.api_key) == ("from-the-environment-123", KEY)
    assert ADMIN not in repr(cfg) and KEY not in repr(cfg)
    path.write_text('[server]\nadmin_token = "short"\n')
    monkeypatch.delenv("VERTUMNUS_ADMIN_TOKEN")
    with pytest.raises(ConfigError, match="at least 16 characters"):
        load(path)


@pytest.mark.timeout(60)
def test_the_dashboard_data_follows_the_api_key_and_its_page_is_served_locally() -> None:
    """``/v1/timeline`` is behind the API key like the rest of /v1; the page and its
    assets hold no data and are open (the page asks for the key); 'since' is checked."""
    refused, timeline, bad, page, script, plotly_js, missing = calls(
        ServeConfig(api_key=KEY, slo=TtftSlo.parse("800ms")),
        [
            ("GET", "/v1/timeline", {}),
            ("GET", "/v1/timeline?since=0", bearer(KEY)),
            ("GET", "/v1/timeline?since=nan", bearer(KEY)),
            ("GET", "/dashboard", {}),
            ("GET", "/dashboard/dashboard.js", {}),
            ("GET", "/dashboard/plotly.min.js", {}),
            ("GET", "/dashboard/other.js", {}),
        ],
    )
    assert refused[0] == 401
    assert timeline[0] == 200
    body = timeline[1]
    assert {"samples", "events", "workers", "composition", "epoch", "window_s"} <= body.keys()
    assert body["composition"] == "2CP1" and len(body["workers"]) == 2
    assert body["slo"] == "0.8s"  # [server] slo
    assert bad[0] == 400 and "since" in bad[1]["error"]["message"]
    assert page[0] == 200 and page[2]["Content-Type"].startswith("text/html")
    assert script[0] == 200 and plotly_js[0] == 200 and missing[0] == 404
