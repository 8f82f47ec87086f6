"""End-to-end benchmark on the real server, and the simulator's fidelity against it.

    .venv/bin/python -m tools.bench.e2e [--requests 600] [--rate-scale 10]
        [--length-scale 0.03125] [--output-tokens 1] [--out results/e2e]

It replays the first ``--requests`` requests of
``../shared/traces/conversation_trace.jsonl``, scaled to this machine. Lengths are
×1/32, so one 512-token trace block is one 16-token engine block and the prefix
structure is kept; the arrival rate is ×10. The server runs on the embedded
default: the ``tiny`` model on 2 CPU ranks, starting as 2CP1, with degrees {1, 2}.
Three server variants run side by side, one after the other:

  * ``vertumnus``: the cost rule, the what-if controller (a decision every 5 s)
    and the cache manager's scans;
  * ``rules``: the same with the paper's threshold rules (5 s windows);
  * ``fixed``: the same with the controller off;
  * ``cache-first``: the usual cache-aware router, no controller, no scans.

Then the same requests go through the simulator, with the same arrivals, lengths and
prefix blocks; the pool, cache capacity, KV retention, policy and profile (the
shipped ``tiny-cpu``, measured on this machine by ``vertumnus profile``) come from
the very configuration file the server ran (the one TOML dialect). Two more inputs
of the simulator are timings of this server, read from its
`/metrics` after the replay: the reshape switch (``switch_s``: about 10 ms through
the rank pipes here, against the 0.5 s default meant for NCCL groups on GPUs) and
the mean KV copy (``transfer_latency_s``), when it did any; and, from its answers,
the serving path's mean time around the ranks' compute per prefill
(``dispatch_s``: ``prefill_s`` - ``rank_compute_s``).
It prints and saves the relative error of mean, P50 and P90 TTFT (the server's own
TTFT, which the simulator models; the client's is printed beside it) and of the
token hit rate, for ``fixed`` and for ``vertumnus``. With ``--repeats N`` every
variant runs N times (in turn) and the summary gives each variant's median mean
TTFT and its gap to ``fixed``.

With ``--output-tokens N`` > 1 every request is a streamed completion of N tokens
through the server's decode proxy and its local decode process: the server's TTFT
then ends with the first token out of the decode server (queue, prefill, KV
hand-off, first decode step), and the simulator gets the measured hand-off as its
T_ext term: ``ext_latency_s`` + tokens * ``kv_bytes_per_token`` /
``handoff_bytes_s``, fitted by least squares to the server's own split of each
request (its TTFT less its queue and prefill) against the request's input tokens.
The load generator's TPOT and ITL are printed too.

Each comparison is printed twice: with the profile as it is, and with the ranks'
measured compute (``compute_slowdown``: per degree, the ranks' compute over the
profile's E for the same requests, read from the answers; the simulated prefills
take that much longer, the policy still plans with the profile). The second is a
measured input like the others above; what the simulator still predicts is the
queueing, placement and reshaping that follow from it.

Everything goes to ``OUT/e2e.json``, with the machine and source it was measured on
(``harness.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import urllib.request
from pathlib import Path
from typing import Any

import orjson

from tools.bench import harness
from tools.bench._serving import start_server
from vertumnus import loadgen
from vertumnus.config import resolve_model
from vertumnus.perfmodel import Profile
from vertumnus.runtime import serve_config
from vertumnus.sim.simulator import Simulation, biased
from vertumnus.sim.time_model import SimSettings
from vertumnus.sim.workload import SimRequest
from vertumnus.stats import percentile
from vertumnus.traces import load_trace

TRACE = Path("../shared/traces/conversation_trace.jsonl")
PERIOD_S = 5.0
VARIANTS = {
    "vertumnus": f"[controller]\nenabled = true\ndecision_s = {PERIOD_S}\n",
    "rules": f'[controller]\nenabled = true\nmode = "rules"\nwindow_s = {PERIOD_S}\n',
    "fixed": "[controller]\nenabled = false\n",
    "cache-first": '[controller]\nenabled = false\n[scheduler]\nrouter = "cache-first"\n'
    "[cache]\nreplication = false\n",
}


def server_timings(url: str) -> dict[str, float]:
    """The server's mean switch and mean KV copy, in seconds, from ``/metrics`` (a
    key is missing when the server did none)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sample.value
    out = {}
    for key, metric in (
        ("switch_s", "vertumnus_switch_seconds"),
        ("copy_s", "vertumnus_copy_seconds"),
    ):
        if sums.get(metric + "_count"):
            out[key] = sums[metric + "_sum"] / sums[metric + "_count"]
    return out


def fit_ext(result: loadgen.LoadResult) -> dict[str, float]:
    """T_ext = a + b * input tokens, least squares over the requests whose answer
    split its TTFT (a streamed completion's last event): {"ext_latency_s": a,
    "ext_s_per_token": b} (b = 0 when the lengths do not vary)."""
    points = [
        (float(o.input_tokens), o.server_ttft_s - o.server_queue_s - o.server_prefill_s)
        for o in result.outcomes
        if o.error is None
        and o.server_ttft_s is not None
        and o.server_queue_s is not None
        and o.server_prefill_s is not None
    ]
    if not points:
        return {}
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    var = sum((x - mx) ** 2 for x, _ in points)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in points) / var) if var else 0.0
    return {"ext_latency_s": max(0.0, my - slope * mx), "ext_s_per_token": slope}


def compute_slowdown(result: loadgen.LoadResult, profile: Profile) -> dict[int, float]:
    """Per CP degree: the ranks' measured compute over the profile's E for the same
    requests (sum over sum; 1.0: as profiled). Above 1 when something shares the
    cores with the ranks, as the local decode process does here."""
    measured: dict[int, float] = {}
    predicted: dict[int, float] = {}
    for o in result.outcomes:
        if o.server_rank_compute_s is None or o.cp_degree is None or o.cached_tokens is None:
            continue
        c = o.cp_degree
        e = profile.predict(c, o.input_tokens - o.cached_tokens, o.cached_tokens)
        measured[c] = measured.get(c, 0.0) + o.server_rank_compute_s
        predicted[c] = predicted.get(c, 0.0) + e
    return {c: measured[c] / predicted[c] for c in measured if predicted[c] > 0}


def simulate(
    requests: list[loadgen.LoadRequest],
    config: Path,
    window_phase_s: float = 0.0,
    timings: dict[str, float] | None = None,
    slowdown: dict[int, float] | None = None,
) -> dict[str, float]:
    """The same requests through the simulator, on the pool and policy the server
    ran: both read ``config`` (the one dialect), and both build ``PoolPolicy``.
    ``slowdown``: the prefills take that much longer than the profile says (the
    policy still plans with the profile, as the server's did)."""
    timings = timings or {}
    cfg = serve_config.load(config)
    profile = Profile.load(cfg.profile)
    bias: dict[int, float] = {}
    if slowdown:  # the true times scaled; the policy sees them times 1 / slowdown
        profile = biased(profile, slowdown)
        bias = {c: 1 / f for c, f in slowdown.items()}
    sim_requests = [
        SimRequest(
            r.index,
            r.arrival_s,
            r.input_tokens,
            tuple(h + 1 for h in r.block_hashes[: r.input_tokens // r.block_tokens]),
        )
        for r in requests
    ]
    assert requests[0].block_tokens == cfg.engine.block_size
    model, _ = resolve_model(cfg.model)
    kv_bytes = model.kv_bytes(4)
    per_token = timings.get("ext_s_per_token", 0.0)
    settings = SimSettings(
        window_phase_s=window_phase_s,
        switch_s=timings.get("switch_s", 0.01),
        transfer_latency_s=timings.get("copy_s", 0.01),
        dispatch_s=timings.get("dispatch_s", 0.0),
        kv_bytes_per_token=kv_bytes,  # the served model's, fp32 on CPU ranks
        ext_latency_s=timings.get("ext_latency_s", 0.0),
        handoff_bytes_s=kv_bytes / per_token if per_token > 0 else 0.0,
        profile_bias=bias,
    )
    sim = Simulation(settings, profile, cfg.pool_spec, cfg.policy, sim_requests)
    result = sim.run()
    ttft = [r.ttft_s * 1e3 for r in result.records if r.ttft_s is not None]
    tokens = sum(r.input_tokens for r in result.records)
    return {
        "mean_ttft_ms": sum(ttft) / len(ttft),
        "median_ttft_ms": percentile(ttft, 50),
        "p90_ttft_ms": percentile(ttft, 90),
        "token_hit_rate": sum(r.cached_tokens for r in result.records) / tokens,
        "splits": sum(r.kind == "split" for r in result.reshapes),
        "merges": sum(r.kind == "merge" for r in result.reshapes),
        "copies": result.copies,
        "blocks_copied": result.blocks_copied,
    }


def serve_once(
    name: str, requests: list[loadgen.LoadRequest], out: Path, output_tokens: int = 1
) -> tuple[dict[str, Any], float, dict[str, float], dict[int, float]]:
    """One run of a variant on a fresh server: its summary, how far into its
    controller period the load started, its timings and its compute slowdown."""
    config = out / f"{name}.toml"
    # Prefills only, or completions through the server's own decode process.
    decode = "[decode]\nlocal = false\n" if output_tokens == 1 else ""
    config.write_text(VARIANTS[name] + decode)
    proc, url = start_server(config)
    try:
        # How far into its current controller period the server is as the load
        # starts: the simulator lines its periods up with that.
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            phase = orjson.loads(resp.read())["window_phase_s"] or 0.0
        result = asyncio.run(
            loadgen.run(url, requests, max_concurrency=256, output_tokens=output_tokens)
        )
        timing = server_timings(url) | fit_ext(result)
        # The serving path's own time per prefill, around the ranks' compute.
        around = [
            o.server_prefill_s - o.server_rank_compute_s
            for o in result.outcomes
            if o.server_prefill_s is not None and o.server_rank_compute_s is not None
        ]
        if around:
            timing["dispatch_s"] = sum(around) / len(around)
        slowdown = compute_slowdown(result, Profile.load(serve_config.load(config).profile))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return loadgen.summarize(result, detailed=False), phase, timing, slowdown


def compare(
    name: str,
    requests: list[loadgen.LoadRequest],
    config: Path,
    phase: float,
    timing: dict[str, float],
    real: dict[str, Any],
    slowdown: dict[int, float] | None = None,
) -> dict[str, Any]:
    """The simulator on the same requests and configuration, against the server:
    with the profile as it is, then (given ``slowdown``) with the ranks' measured
    compute."""
    out: dict[str, Any] = {}
    for scale in (None, slowdown) if slowdown else (None,):
        if scale:
            label = ", ".join(f"CP{c} x{f:.2f}" for c, f in sorted(scale.items()))
            print(f"  with the ranks' measured compute ({label}):", flush=True)
        sim = simulate(requests, config, phase, timing, scale)
        errors = {
            "mean_ttft": sim["mean_ttft_ms"] / real["mean_server_ttft_ms"] - 1,
            "median_ttft": sim["median_ttft_ms"] / real["median_server_ttft_ms"] - 1,
            "p90_ttft": sim["p90_ttft_ms"] / real["p90_server_ttft_ms"] - 1,
            "token_hit_rate": sim["token_hit_rate"] / real["token_hit_rate"] - 1,
        }
        print(
            f"simulated {name:<10} mean {sim['mean_ttft_ms']:7.2f} ms "
            f"({100 * errors['mean_ttft']:+.1f} %), "
            f"median {sim['median_ttft_ms']:6.2f} ({100 * errors['median_ttft']:+.1f} %), P90 "
            f"{sim['p90_ttft_ms']:7.2f} ({100 * errors['p90_ttft']:+.1f} %), hit "
            f"{sim['token_hit_rate']:.3f} ({100 * errors['token_hit_rate']:+.1f} %); "
            f"{sim['merges']} merges, {sim['splits']} splits, {sim['copies']} copies; server "
            + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in timing.items()),
            flush=True,
        )
        result = {"simulated": sim, "server_timings": timing, "relative_error": errors}
        if scale:
            out["measured_compute"] = result | {"slowdown": {str(c): f for c, f in scale.items()}}
        else:
            out = result
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--rate-scale", type=float, default=10.0)
    parser.add_argument("--length-scale", type=float, default=1 / 32)
    parser.add_argument("--out", type=Path, default=Path("results/e2e"))
    parser.add_argument("--repeats", type=int, default=1, help="runs of every variant")
    parser.add_argument(
        "--output-tokens", type=int, default=1, help="> 1: streamed completions, decoded"
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated subset of " + ", ".join(VARIANTS),
    )
    harness.add_arguments(parser, json_option=False)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    trace = load_trace(TRACE)
    requests = loadgen.from_trace(trace, args.length_scale, 256, 0, args.rate_scale)
    requests = requests[: args.requests]
    summaries: dict[str, list[dict[str, Any]]] = {}
    fidelity: dict[str, list[dict[str, Any]]] = {}
    chosen = args.variants.split(",")
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    session = harness.Session("e2e", args)
    for repeat in range(args.repeats):
        for name in chosen:
            summary, phase, timing, slowdown = serve_once(
                name, requests, args.out, args.output_tokens
            )
            summaries.setdefault(name, []).append(summary)
            s = summary
            print(
                f"{name:<12} run {repeat + 1}: server TTFT mean {s['mean_server_ttft_ms']:7.2f} "
                f"ms, median {s['median_server_ttft_ms']:6.2f}, P90 "
                f"{s['p90_server_ttft_ms']:7.2f}; client mean {s['mean_ttft_ms']:7.2f} ms, "
                f"P90 {s['p90_ttft_ms']:7.2f}; hit {s['token_hit_rate']:.3f}; "
                f"failed {s['failed']}"
                + (
                    f"; TPOT mean {s['mean_tpot_ms']:.2f} ms, ITL mean {s['mean_itl_ms']:.2f} ms"
                    if "mean_tpot_ms" in s
                    else ""
                ),
                flush=True,
            )
            if name in ("fixed", "vertumnus"):
                fidelity.setdefault(name, []).append(
                    compare(
                        name, requests, args.out / f"{name}.toml", phase, timing, summary, slowdown
                    )
                )
    medians = {
        name: statistics.median(s["mean_server_ttft_ms"] for s in runs)
        for name, runs in summaries.items()
    }
    for name, value in medians.items():
        gap = f" ({100 * (value / medians['fixed'] - 1):+.1f} % against fixed)"
        print(
            f"{name:<12} median of {len(summaries[name])} mean TTFTs: {value:7.2f} ms"
            + (gap if "fixed" in medians and name != "fixed" else ""),
            flush=True,
        )
    session.finish(
        args.out / "e2e.json",
        {
            "args": vars(args) | {"out": str(args.out)},
            "server": summaries,
            "median_mean_ttft_ms": medians,
            "fidelity": fidelity,
        },
    )


if __name__ == "__main__":
    main()
