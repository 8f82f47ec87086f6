"""vLLM's Prometheus series, beside the pool's own on ``/metrics``: the ``vllm:``
names, types, buckets and ``model_name`` label of vLLM v1, so that dashboards,
alerts and autoscalers written for vLLM read the pool unchanged.

vllm:time_to_first_token_seconds  histogram: a prompt's arrival at the coordinator to
                                  the end of its prefill (``vertumnus_ttft_seconds``)
vllm:e2e_request_latency_seconds  histogram: an API request, its arrival to its last
                                  token (``request_done``)
vllm:num_requests_running         gauge: prefills running on workers, plus completions
                                  decoding through the proxy (``decoding``)
vllm:num_requests_waiting         gauge: prefills queued on workers or waiting for one
vllm:prompt_tokens_total          counter: prompt tokens prefilled, cached or computed
vllm:generation_tokens_total      counter: tokens answered (``request_done``)
vllm:prefix_cache_queries_total   counter: prompt tokens looked up in the prefix cache
vllm:prefix_cache_hits_total      counter: of those, the tokens found cached

As in vLLM, the cache is queried in tokens (a prompt's length) and hits are the
tokens reused, so hits / queries is the token hit rate. The gauges are set when
``/metrics`` is read. This module owns the series only: the coordinator's
``Metrics`` feeds the prefill's, and the routes that answer call ``request_done``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM v1's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
E2E_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0),
    *(60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)


class VllmSeries:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        def one(kind: type[Any], name: str, doc: str, **kwargs: Any) -> Any:
            """One series of ``kind``, its child for the served model."""
            return kind(name, doc, ["model_name"], registry=registry, **kwargs).labels(model_name)

        self.ttft: Histogram = one(
            Histogram,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            buckets=TTFT_BUCKETS,
        )
        self.e2e: Histogram = one(
            Histogram,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            buckets=E2E_BUCKETS,
        )
        self.running: Gauge = one(
            Gauge, "vllm:num_requests_running", "Number of requests currently running."
        )
        self.waiting: Gauge = one(Gauge, "vllm:num_requests_waiting", "Number of requests waiting.")
        self.prompt_tokens: Counter = one(
            Counter, "vllm:prompt_tokens", "Number of prefill tokens processed."
        )
        self.generation_tokens: Counter = one(
            Counter, "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.cache_queries: Counter = one(
            Counter,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.cache_hits: Counter = one(
            Counter,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
        )
        self.decodes_in_flight = 0

    def prefilled(self, ttft_s: float, cached_tokens: int, computed_tokens: int) -> None:
        """One prompt's prefill ended (its first token is known)."""
        prompt_tokens = cached_tokens + computed_tokens
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.cache_queries.inc(prompt_tokens)
        self.cache_hits.inc(cached_tokens)

    def request_done(self, e2e_s: float, generation_tokens: int) -> None:
        """An API request answered: ``e2e_s`` from its arrival to its last token,
        ``generation_tokens`` the tokens of its answer (usage.completion_tokens:
        every choice's, the first token included)."""
        self.e2e.observe(e2e_s)
        self.generation_tokens.inc(generation_tokens)

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """Counts a completion as running while a decode server works on it."""
        self.decodes_in_flight += 1
        try:
            yield
        finally:
            self.decodes_in_flight -= 1

    def load(self, prefills_running: int, waiting: int) -> None:
        """The gauges, when ``/metrics`` is read."""
        self.running.set(prefills_running + self.decodes_in_flight)
        self.waiting.set(waiting)
