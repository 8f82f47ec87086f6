"""Prometheus metrics of the serving coordinator (prometheus-client, own registry).

vertumnus_ttft_seconds               histogram of time to first token
vertumnus_queue_seconds              histogram of time waiting before the prefill
vertumnus_prefill_seconds            histogram of prefill execution time
vertumnus_requests_total             counter, by worker degree
vertumnus_cached_tokens_total        prompt tokens reused from a worker's cache
vertumnus_computed_tokens_total      prompt tokens computed
vertumnus_workers                    gauge: workers, by cp_degree and state
vertumnus_worker_queue_depth         gauge per worker: requests queued
vertumnus_worker_outstanding_seconds gauge per worker: predicted work outstanding
vertumnus_reconfigurations_total     counter, by kind (split, merge)
vertumnus_drain_seconds              histogram of a reshape's drain
vertumnus_switch_seconds             histogram of a reshape's switch
vertumnus_replications_total         KV copies and fetches that installed blocks
vertumnus_copied_blocks_total        KV blocks they installed
vertumnus_copy_seconds               histogram of a copy's time, start to visible
vertumnus_reclamations_total         replicas reclaimed
vertumnus_worker_restarts_total      workers restarted after a rank died or hung
vertumnus_handoff_leases             gauge: KV hand-offs waiting to be pulled
vertumnus_handoff_ended_total        hand-off leases ended, by why (pulled, expired,
                                     released, moved)
vertumnus_handoff_bytes_total        KV bytes pulled by decode servers
vertumnus_handoff_seconds            histogram of a pull, first byte to last
vertumnus_decode_waits_total         completions, prefilled, that waited for a decode
                                     server that went away, by outcome (forwarded:
                                     it came back; unavailable: a 503; client_gone)
vertumnus_internal_errors_total      bugs contained (logged with their traceback), by
                                     where (worker_step, reshape, task, handoff, api)
vertumnus_reshapes_rolled_back_total reshapes past [server] reshape_timeout_s, by how
                                     they ended (rolled_back, forced)
vertumnus_host_tier_demoted_blocks_total KV blocks copied from the ranks into the host
                                     tier (``runtime/kv/host_memory.py``)
vertumnus_host_tier_loaded_blocks_total  KV blocks loaded back from it into the ranks
vertumnus_host_tier_copy_seconds_total   the time of those copies (memcpy)
vertumnus_host_tier_used_bytes       gauge: the tier's blocks held, every host
vertumnus_host_tier_capacity_bytes   gauge: its size, every host (0: no tier)

Beside them, vLLM's own series (``vllm:``, ``vllm_metrics.py``): the prefill feeds
them here; the route or proxy that answers an API request calls ``request_done``,
and the proxy holds ``decoding()`` while a decode server works on a completion.

Also the pool over time for the dashboard (``timeline``, ``policy/timeline.py``):
the request path reports arrivals and answers to it, the coordinator its reshapes,
and the app's sampler closes a sample every ``timeline_s``.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vertumnus.policy.timeline import Timeline, trailing_window_s
from vertumnus.runtime.vllm_metrics import VllmSeries

log = structlog.get_logger("vertumnus")

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(
        self,
        timeline_s: float = 1.0,
        timeline_samples: int = 3600,
        origin_s: float = 0.0,
        controller_period_s: float = 10.0,
        model_name: str = "unknown",
    ) -> None:
        """The timeline's window is the simulator's: ``trailing_window_s``;
        ``model_name``: the served model's name, the ``vllm:`` series' label."""
        window_s = trailing_window_s(controller_period_s, timeline_s)
        self.timeline = Timeline(timeline_s, timeline_samples, origin_s=origin_s, window_s=window_s)
        self.started_unix = time.time()  # the wall time of the timeline's t = 0
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "vertumnus_ttft_seconds", "Time to first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.queue = Histogram(
            "vertumnus_queue_seconds", "Wait before the prefill", buckets=TTFT_BUCKETS, registry=r
        )
        self.prefill = Histogram(
            "vertumnus_prefill_seconds", "Prefill execution", buckets=TTFT_BUCKETS, registry=r
        )
        self.requests = Counter(
            "vertumnus_requests", "Prefills answered", ["cp_degree"], registry=r
        )
        self.cached = Counter("vertumnus_cached_tokens", "Prompt tokens reused", registry=r)
        self.computed = Counter("vertumnus_computed_tokens", "Prompt tokens computed", registry=r)
        self.workers = Gauge(
            "vertumnus_workers", "Workers, by degree and state", ["cp_degree", "state"], registry=r
        )
        self.depth = Gauge(
            "vertumnus_worker_queue_depth", "Requests queued", ["worker"], registry=r
        )
        self.outstanding = Gauge(
            "vertumnus_worker_outstanding_seconds",
            "Predicted work outstanding",
            ["worker"],
            registry=r,
        )
        self.reconfigurations = Counter(
            "vertumnus_reconfigurations", "Splits and merges done", ["kind"], registry=r
        )
        self.drain = Histogram("vertumnus_drain_seconds", "Reshape drain", registry=r)
        self.switch = Histogram("vertumnus_switch_seconds", "Reshape switch", registry=r)
        self.replications = Counter(
            "vertumnus_replications", "KV copies between workers", registry=r
        )
        self.copy_seconds = Histogram(
            "vertumnus_copy_seconds",
            "KV copies and fetches that installed blocks, start to visible",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.copied_blocks = Counter(
            "vertumnus_copied_blocks", "KV blocks installed by copies and fetches", registry=r
        )
        self.reclamations = Counter("vertumnus_reclamations", "Replicas reclaimed", registry=r)
        self.restarts = Counter(
            "vertumnus_worker_restarts",
            "Workers restarted after a rank died or hung",
            registry=r,
        )
        self.leases = Gauge("vertumnus_handoff_leases", "KV hand-offs not pulled", registry=r)
        self.leases_ended = Counter(
            "vertumnus_handoff_ended", "Hand-off leases ended", ["why"], registry=r
        )
        self.handoff_bytes = Counter(
            "vertumnus_handoff_bytes", "KV bytes pulled by decode servers", registry=r
        )
        self.handoff_seconds = Histogram(
            "vertumnus_handoff_seconds",
            "A pull, first byte to last",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.decode_waits = Counter(
            "vertumnus_decode_waits",
            "Completions, prefilled, that waited for a decode server that went away",
            ["outcome"],
            registry=r,
        )
        self.internal_errors = Counter(
            "vertumnus_internal_errors",
            "Bugs contained (logged with their traceback)",
            ["where"],
            registry=r,
        )
        self.overdue_reshapes = Counter(
            "vertumnus_reshapes_rolled_back",
            "Reshapes past their bound: rolled back before the commit, or forced after it",
            ["how"],
            registry=r,
        )
        self.tier_demoted = Counter(
            "vertumnus_host_tier_demoted_blocks",
            "KV blocks copied from the ranks into the host tier",
            registry=r,
        )
        self.tier_loaded = Counter(
            "vertumnus_host_tier_loaded_blocks",
            "KV blocks loaded back from the host tier into the ranks",
            registry=r,
        )
        self.tier_copy_seconds = Counter(
            "vertumnus_host_tier_copy_seconds", "Time of the host tier's copies", registry=r
        )
        self.tier_used = Gauge(
            "vertumnus_host_tier_used_bytes", "Host tier bytes held, every host", registry=r
        )
        self.tier_capacity = Gauge(
            "vertumnus_host_tier_capacity_bytes", "Host tier size, every host", registry=r
        )
        self.vllm = VllmSeries(r, model_name)
        self.internal_error_count = 0
        self._cached = self._total = 0
        self.replication_count = self.reclamation_count = 0

    def request(self, result: Any) -> None:
        self.ttft.observe(result.ttft_s)
        self.queue.observe(result.queue_s)
        self.prefill.observe(result.prefill_s)
        self.requests.labels(cp_degree=str(result.cp_degree)).inc()
        self.cached.inc(result.cached_tokens)
        self.computed.inc(result.computed_tokens)
        self._cached += result.cached_tokens
        self._total += result.cached_tokens + result.computed_tokens
        self.vllm.prefilled(result.ttft_s, result.cached_tokens, result.computed_tokens)

    def request_done(self, e2e_s: float, generation_tokens: int) -> None:
        """An API request answered, from its arrival to its last token, with the
        ``generation_tokens`` of its answer (``vllm:e2e_request_latency_seconds``,
        ``vllm:generation_tokens_total``)."""
        self.vllm.request_done(e2e_s, generation_tokens)

    def decoding(self) -> AbstractContextManager[None]:
        """``with metrics.decoding():`` around a decode server's work on a completion:
        it counts in ``vllm:num_requests_running`` meanwhile."""
        return self.vllm.decoding()

    def reshape(self, transition: Any) -> None:
        self.reconfigurations.labels(kind=transition.op.kind).inc()
        if transition.drain_s is not None:
            self.drain.observe(transition.drain_s)
        if transition.switch_s is not None:
            self.switch.observe(transition.switch_s)

    def hit_rate(self) -> float | None:
        return self._cached / self._total if self._total else None

    def render(
        self,
        workers: list[dict[str, Any]],
        leases: int = 0,
        waiting: int = 0,
        tier: dict[str, Any] | None = None,
    ) -> bytes:
        """``waiting``: the requests that wait for a worker (none can take them now);
        ``tier``: the host tier's view (``views.tier_view``; None: no tier)."""
        self.leases.set(leases)
        if tier is not None:
            self.tier_used.set(tier["used_bytes"])
            self.tier_capacity.set(tier["capacity_bytes"])
        running = sum(1 for w in workers if w.get("running") is not None)
        self.vllm.load(running, waiting + sum(w["queued"] for w in workers))
        for gauge in (self.workers, self.depth, self.outstanding):
            gauge.clear()  # workers that a reshape ended are gone from the answer
        for w in workers:
            self.workers.labels(cp_degree=str(w["cp_degree"]), state=w["state"]).inc()
            self.depth.labels(worker=str(w["worker"])).set(w["queued"])
            self.outstanding.labels(worker=str(w["worker"])).set(w["outstanding_s"])
        return generate_latest(self.registry)

    def copied(self, blocks: int, seconds: float) -> None:
        """A copy or fetch ended (``blocks`` installed; 0: nothing was missing)."""
        if blocks:
            self.replications.inc()
            self.replication_count += 1
            self.copied_blocks.inc(blocks)
            self.copy_seconds.observe(seconds)

    def tier_moved(self, demoted: int, loaded: int, seconds: float) -> None:
        """A prefill's host-tier copies: ``demoted`` blocks in, ``loaded`` out."""
        self.tier_demoted.inc(demoted)
        self.tier_loaded.inc(loaded)
        self.tier_copy_seconds.inc(seconds)

    def lease_ended(self, why: str) -> None:
        self.leases_ended.labels(why=why).inc()

    def pulled(self, num_bytes: int, seconds: float) -> None:
        self.handoff_bytes.inc(num_bytes)
        self.handoff_seconds.observe(seconds)

    def decode_waited(self, outcome: str) -> None:
        """A prefilled completion's wait for its decode server ended: ``forwarded``,
        ``unavailable`` (a 503) or ``client_gone``."""
        self.decode_waits.labels(outcome=outcome).inc()

    def internal_error(self, where: str) -> None:
        self.internal_errors.labels(where=where).inc()
        self.internal_error_count += 1

    def bug(self, where: str, event: str, exc: BaseException, **fields: Any) -> None:
        """A bug contained: one log line with its traceback, marked ``bug`` (what a
        soak or a test looks for), and its count in ``vertumnus_internal_errors_total``."""
        log.error(event, where=where, error=repr(exc), exc_info=exc, bug=True, **fields)
        self.internal_error(where)

    def reshape_overdue(self, how: str) -> None:
        self.overdue_reshapes.labels(how=how).inc()

    def restarted(self) -> None:
        self.restarts.inc()

    def reclaimed(self) -> None:
        self.reclamations.inc()
        self.reclamation_count += 1
