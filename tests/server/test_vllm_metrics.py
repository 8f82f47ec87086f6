"""vLLM's ``vllm:`` series beside the pool's own on /metrics: vLLM's names, types,
buckets and ``model_name`` label, fed by the prefill, by ``request_done`` and by
``decoding()``, and read from the app's /metrics."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer

from vertumnus.protocol.tokenizer import Tokenizer
from vertumnus.runtime.coordinator import Coordinator
from vertumnus.runtime.metrics import Metrics
from vertumnus.runtime.serve_config import ServeConfig
from vertumnus.runtime.vllm_metrics import E2E_BUCKETS, TTFT_BUCKETS
from vertumnus.server.app import build_app

MODEL = {"model_name": "Qwen/Qwen3-0.6B"}
TYPES = {
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
}


def prefill(ttft_s: float, cached: int, computed: int) -> SimpleNamespace:
    """What ``Metrics.request`` reads of a ``PrefillResult``."""
    return SimpleNamespace(
        ttft_s=ttft_s,
        queue_s=0.001,
        prefill_s=ttft_s - 0.001,
        cp_degree=2,
        cached_tokens=cached,
        computed_tokens=computed,
    )


def row(worker: int, queued: int, running: int | None) -> dict[str, object]:
    state = {"cp_degree": 1, "state": "active", "outstanding_s": 0.0}
    return {"worker": worker, "queued": queued, "running": running, **state}


def types(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("# TYPE vllm:"):
            _, _, name, kind = line.split()
            out[name] = kind
    return out


def test_the_series_have_vllms_names_types_and_buckets() -> None:
    metrics = Metrics(model_name=MODEL["model_name"])
    text = metrics.render([]).decode()
    assert TYPES.items() <= types(text).items()
    assert 'vllm:num_requests_running{model_name="Qwen/Qwen3-0.6B"} 0.0' in text
    for name, buckets in (
        ("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
        ("vllm:e2e_request_latency_seconds", E2E_BUCKETS),
    ):
        les = [
            line.split('le="')[1].split('"')[0]
            for line in text.splitlines()
            if line.startswith(f"{name}_bucket")
        ]
        assert les == [*(repr(float(b)) for b in buckets), "+Inf"]
    assert len(TTFT_BUCKETS) == 22 and TTFT_BUCKETS[:2] == (0.001, 0.005)
    assert len(E2E_BUCKETS) == 21 and E2E_BUCKETS[-1] == 7680.0


def test_a_prefill_feeds_ttft_prompt_tokens_and_the_prefix_cache_in_tokens() -> None:
    metrics = Metrics(model_name=MODEL["model_name"])
    metrics.request(prefill(0.03, cached=64, computed=36))
    metrics.request(prefill(3.0, cached=0, computed=10))
    value = metrics.registry.get_sample_value
    assert value("vllm:prompt_tokens_total", MODEL) == 110
    assert value("vllm:prefix_cache_queries_total", MODEL) == 110
    assert value("vllm:prefix_cache_hits_total", MODEL) == 64
    assert value("vllm:time_to_first_token_seconds_count", MODEL) == 2
    assert value("vllm:time_to_first_token_seconds_bucket", {**MODEL, "le": "0.02"}) == 0
    assert value("vllm:time_to_first_token_seconds_bucket", {**MODEL, "le": "0.04"}) == 1
    assert value("vllm:time_to_first_token_seconds_bucket", {**MODEL, "le": "5.0"}) == 2
    # the pool's own series move alike
    assert value("vertumnus_cached_tokens_total") == 64
    assert value("vertumnus_ttft_seconds_count") == 2
    # hits / queries is the token hit rate the pool reports
    assert metrics.hit_rate() == pytest.approx(64 / 110)


def test_request_done_feeds_e2e_latency_and_generation_tokens() -> None:
    metrics = Metrics(model_name=MODEL["model_name"])
    metrics.request_done(0.2, 1)  # a prefill-only completion: one token
    metrics.request_done(12.5, 256)
    value = metrics.registry.get_sample_value
    assert value("vllm:generation_tokens_total", MODEL) == 257
    assert value("vllm:e2e_request_latency_seconds_count", MODEL) == 2
    assert value("vllm:e2e_request_latency_seconds_sum", MODEL) == pytest.approx(12.7)
    assert value("vllm:e2e_request_latency_seconds_bucket", {**MODEL, "le": "0.3"}) == 1
    assert value("vllm:e2e_request_latency_seconds_bucket", {**MODEL, "le": "10.0"}) == 1
    assert value("vllm:e2e_request_latency_seconds_bucket", {**MODEL, "le": "15.0"}) == 2


def test_running_counts_prefills_and_decodes_and_waiting_the_queues() -> None:
    metrics = Metrics(model_name=MODEL["model_name"])
    value = metrics.registry.get_sample_value
    workers = [row(0, queued=3, running=17), row(1, queued=1, running=None), row(2, 0, 18)]
    metrics.render(workers, waiting=2)
    assert value("vllm:num_requests_running", MODEL) == 2
    assert value("vllm:num_requests_waiting", MODEL) == 6  # 3 + 1 queued, 2 with no worker
    with metrics.decoding(), metrics.decoding():
        metrics.render(workers)
        assert value("vllm:num_requests_running", MODEL) == 4
    with pytest.raises(RuntimeError), metrics.decoding():  # a decode that failed ends too
        raise RuntimeError("the decode server went away")
    metrics.render([row(0, queued=0, running=None)])
    assert value("vllm:num_requests_running", MODEL) == 0
    assert value("vllm:num_requests_waiting", MODEL) == 0


@pytest.mark.timeout(60)
def test_the_pools_metrics_route_carries_them_under_the_served_name() -> None:
    async def main() -> str:
        coord = Coordinator(ServeConfig())
        coord.metrics.request(prefill(0.05, cached=16, computed=4))
        coord.metrics.request_done(0.5, 1)
        tokenizer = Tokenizer.for_model(None, coord.model_cfg.vocab_size)
        async with TestClient(TestServer(build_app(coord, tokenizer))) as client:
            resp = await client.get("/metrics")
            assert resp.status == 200
            return await resp.text()

    text = asyncio.run(main())
    assert TYPES.items() <= types(text).items()
    assert 'vllm:prefix_cache_hits_total{model_name="tiny"} 16.0' in text
    assert 'vllm:prompt_tokens_total{model_name="tiny"} 20.0' in text
    assert 'vllm:generation_tokens_total{model_name="tiny"} 1.0' in text
    assert 'vllm:num_requests_waiting{model_name="tiny"} 0.0' in text
    assert "vertumnus_ttft_seconds_count 1.0" in text
