"""The load generator's report: its outcomes summarised as ``vllm bench serve`` does.

The results use the field names of ``vllm bench serve``: duration, completed,
failed, request_throughput, total_input_tokens, {mean,median,p90,p99}_ttft_ms,
token_slo_attainment, token_hit_rate; with N > 1 output tokens also
total_output_tokens, output_throughput (tokens/s) and
{mean,median,p90,p99}_{tpot,itl}_ms, over the completed requests. A request that
failed is counted in ``failed``, with its error. token_hit_rate counts the answers
that say what was cached; a stream whose usage does not say it is left out (none
saying: NaN). ``text_summary`` prints one screen of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from vertumnus.loadgen.client import LoadResult, Outcome
from vertumnus.slo import TtftSlo
from vertumnus.stats import percentile


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _spread(name: str, values_ms: Sequence[float]) -> dict[str, float]:
    """``{mean,median,p90,p99}_<name>_ms``."""
    return {
        f"mean_{name}_ms": _mean(values_ms),
        f"median_{name}_ms": percentile(values_ms, 50),
        f"p90_{name}_ms": percentile(values_ms, 90),
        f"p99_{name}_ms": percentile(values_ms, 99),
    }


def summarize(
    result: LoadResult,
    slo: TtftSlo | None = None,
    tau_of: Callable[[int], float] | None = None,
    detailed: bool = False,
) -> dict[str, Any]:
    """vLLM-style results. ``slo`` (fixed) or ``tau_of`` (per-request rule, by input
    length) sets the targets of the token-weighted attainment. Generation runs add
    the output tokens, their throughput, TPOT and ITL, over completed requests."""
    ok = [o for o in result.outcomes if o.error is None and o.ttft_s is not None]
    ttft_ms = [o.ttft_s * 1e3 for o in ok if o.ttft_s is not None]
    server_ms = [o.server_ttft_s * 1e3 for o in ok if o.server_ttft_s is not None]
    tokens = sum(o.input_tokens for o in result.outcomes)
    # A stream need not say what was cached: the hit rate is over those that did.
    reported = [o for o in ok if o.cached_tokens is not None]
    out: dict[str, Any] = {
        "duration": result.duration_s,
        "completed": len(ok),
        "failed": len(result.outcomes) - len(ok),
        "request_throughput": len(ok) / result.duration_s if result.duration_s else 0.0,
        "total_input_tokens": tokens,
        **_spread("ttft", ttft_ms),
        "mean_server_ttft_ms": _mean(server_ms),
        "median_server_ttft_ms": percentile(server_ms, 50),
        "p90_server_ttft_ms": percentile(server_ms, 90),
        "token_hit_rate": sum(o.cached_tokens or 0 for o in reported)
        / max(1, sum(o.input_tokens for o in reported))
        if reported or not ok
        else math.nan,
    }
    generation = result.output_tokens > 1
    if generation:
        output = sum(o.output_tokens for o in ok)
        out["total_output_tokens"] = output
        out["output_throughput"] = output / result.duration_s if result.duration_s else 0.0
        out |= _spread("tpot", [o.tpot_s * 1e3 for o in ok if o.tpot_s is not None])
        out |= _spread("itl", [gap * 1e3 for o in ok for gap in o.itl_s])
    if slo is not None or tau_of is not None:
        met = 0
        for o in ok:
            tau = tau_of(o.input_tokens) if tau_of is not None else slo.fixed_s  # type: ignore[union-attr]
            if o.ttft_s is not None and tau is not None and o.ttft_s <= tau:
                met += o.input_tokens
        out["token_slo_attainment"] = met / tokens if tokens else math.nan
        out["ttft_slo"] = slo.describe() if slo is not None else "rule"
    out["errors"] = sorted({o.error for o in result.outcomes if o.error})[:10]
    if detailed:
        out["requests"] = [_record(o, generation) for o in result.outcomes]
    return out


_GENERATION_FIELDS = ("output_tokens", "latency_s", "itl_s", "server_tpot_s")


def _record(o: Outcome, generation: bool) -> dict[str, Any]:
    record = asdict(o)
    if generation:
        return record | {"tpot_s": o.tpot_s}
    return {k: v for k, v in record.items() if k not in _GENERATION_FIELDS}


def text_summary(s: dict[str, Any]) -> str:
    """One screen: the counts and TTFT; for generation also the output tokens, then
    TPOT and ITL under ``vllm bench serve``'s section lines."""

    def row(label: str, value: str) -> str:
        return f"{label:<29} {value}"

    def spread(name: str, key: str, stats: Sequence[str]) -> list[str]:
        return [row(f"{q} {name} (ms):", f"{s[f'{q.lower()}_{key}_ms']:.2f}") for q in stats]

    generation = "total_output_tokens" in s
    lines = [
        "============ Vertumnus load generator ============",
        row("Successful requests:", f"{s['completed']}"),
        row("Failed requests:", f"{s['failed']}"),
        row("Duration (s):", f"{s['duration']:.2f}"),
        row("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        row("Total input tokens:", f"{s['total_input_tokens']}"),
    ]
    if generation:
        lines += [
            row("Total generated tokens:", f"{s['total_output_tokens']}"),
            row("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            "---------------Time to First Token----------------",
        ]
    lines += spread("TTFT", "ttft", ("Mean", "Median", "P90", "P99"))
    if generation:
        lines += [
            "-----Time per Output Token (excl. 1st token)------",
            *spread("TPOT", "tpot", ("Mean", "Median", "P99")),
            "---------------Inter-token Latency----------------",
            *spread("ITL", "itl", ("Mean", "Median", "P99")),
            "==================================================",
        ]
    if not math.isnan(s["token_hit_rate"]):
        lines.append(row("Token hit rate:", f"{s['token_hit_rate']:.3f}"))
    if "token_slo_attainment" in s:
        lines.append(f"Token SLO attainment ({s['ttft_slo']}): {s['token_slo_attainment']:.3f}")
    if s["errors"]:
        lines.append(row("Errors:", f"{s['errors']}"))
    return "\n".join(lines)
