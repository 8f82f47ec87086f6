"""The what-if replay (``policy/control/replay.py``): a forecast placed by the scheduler's own
cost rule over FIFO workers, worked out by hand, and checked against the real
``Scheduler`` on the same requests.

The coefficients are dyadic so that every time below is exact in binary:

    E_1(L, P) = (L - P) / 1024            E_2(L, P) = 1/4 + (L - P) / 2048

so degree 1 is faster under 512 tokens, degree 2 above, and they tie at 512.
``ReplayModel.run`` returns the mean TTFT only; ``ttfts`` recovers each request's
TTFT from the means of growing prefixes of the forecast."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import pytest

from vertumnus.perfmodel import DegreeCoeffs
from vertumnus.policy.control.forecast import ArrivalSample
from vertumnus.policy.control.replay import BUCKET_EDGES, Calibrated, Replay, ReplayModel, bucket_of
from vertumnus.policy.control.replay_types import ReplayMoves, ReplayResult, ReplayWorker
from vertumnus.policy.costs import CostWeights, reuse_curves
from vertumnus.policy.geometry import LatticeConfig
from vertumnus.policy.lattice import Lattice
from vertumnus.policy.placement.queues import PlacementRequest
from vertumnus.policy.placement.scheduler import Scheduler, SchedulerConfig

COEFFS = {
    1: DegreeCoeffs(c=2**-10),
    2: DegreeCoeffs(d=0.25, c=2**-10),
    4: DegreeCoeffs(d=0.5, c=2**-10),  # E_4(L, P) = 1/2 + (L - P) / 4096
}
CURVES = reuse_curves(COEFFS)


def e(c: int, n: int, p: int = 0) -> float:
    return CURVES[c].time_s(n, p)


def model(
    weights: CostWeights | None = None,
    scale: Mapping[int, Sequence[float]] | None = None,
    overhead_s: float = 0.0,
    degrees: Sequence[int] = (1, 2),
) -> ReplayModel:
    calibrated = Calibrated(scale or {}, overhead_s)
    return ReplayModel(CURVES, degrees, weights or CostWeights(), calibrated)


def req(
    rid: int,
    t: float,
    n: int,
    holders: tuple[tuple[int, int], ...] = (),
    key: int = 0,
    floor: int = 0,
) -> ArrivalSample:
    return ArrivalSample(rid, t, n, holders, key, floor)


def workers(*spec: tuple[int, float]) -> list[ReplayWorker]:
    """(degree, free at) per worker, ids 0, 1, ..."""
    return [ReplayWorker(k, c, free) for k, (c, free) in enumerate(spec)]


def run(
    samples: Sequence[ArrivalSample],
    pool: Sequence[ReplayWorker],
    replay: ReplayModel | None = None,
    **kwargs: object,
) -> ReplayResult:
    replay = replay or model()
    return replay.run(replay.prepare(samples, 0.0), pool, **kwargs)  # type: ignore[arg-type]


def ttfts(
    samples: Sequence[ArrivalSample],
    pool: Sequence[ReplayWorker],
    replay: ReplayModel | None = None,
    **kwargs: object,
) -> list[float]:
    """Each request's TTFT in the replay: from the means of growing prefixes."""
    out, before = [], 0.0
    for k in range(1, len(samples) + 1):
        total = run(samples[:k], pool, replay, **kwargs).mean_ttft_s * k
        out.append(total - before)
        before = total
    return out


def test_the_curves_are_as_the_module_doc_says() -> None:
    assert (e(1, 1024), e(1, 1024, 768), e(2, 1024), e(2, 2048)) == (1.0, 0.25, 0.75, 1.25)
    assert e(1, 512) == e(2, 512) == 0.5


# -- one degree ---------------------------------------------------------------------------


def test_one_worker_serves_fifo() -> None:
    samples = [req(1, 0.0, 1024), req(2, 0.5, 512), req(3, 0.625, 2048)]
    # r1 runs [0, 1); r2 waits 0.5 and runs [1, 1.5); r3 waits 0.875, runs [1.5, 3.5).
    expected = [e(1, 1024), 0.5 + e(1, 512), 0.875 + e(1, 2048)]
    assert expected == [1.0, 1.0, 2.875]
    result = run(samples, workers((1, 0.0)))
    assert result.mean_ttft_s == pytest.approx(sum(expected) / 3, rel=1e-12)
    assert (result.requests, result.busy_s, result.span_s) == (3, 3.5, 0.625)
    assert ttfts(samples, workers((1, 0.0))) == pytest.approx(expected, abs=1e-12)


def test_offsets_are_from_the_origin_and_backlog_delays_the_start() -> None:
    replay = model()
    samples = [req(1, 10.0, 1024), req(2, 10.5, 512)]
    prepared = replay.prepare(samples, 10.0)
    assert prepared.offsets == (0.0, 0.5) and prepared.span_s == 0.5
    assert replay.prepare(samples, 10.0, span_s=3.0).span_s == 3.0
    # A backlog of 0.25 s: r1 waits 0.25, runs [0.25, 1.25); r2 waits 0.75.
    result = replay.run(prepared, workers((1, 0.25)))
    assert result.mean_ttft_s == pytest.approx((1.25 + 1.25) / 2, rel=1e-12)


def test_the_earliest_free_worker_of_a_degree_wins() -> None:
    pool = workers((1, 2.0), (1, 1.0))
    # r1: worker 1 (free at 1) -> 2; r2: both free at 2, the lower id (0) -> 3;
    # r3: worker 1 (free at 2) -> 3.
    samples = [req(k, 0.0, 1024) for k in (1, 2, 3)]
    assert ttfts(samples, pool) == pytest.approx([2.0, 3.0, 3.0], abs=1e-12)


def test_a_tie_between_workers_of_one_degree_goes_to_the_lower_id() -> None:
    # r1 ties between two idle workers: worker 0 takes it (busy until 1). r2 reuses
    # 768 tokens held at worker 0: there it costs 0.5 + 0.25 < 1 (worker 1, no reuse).
    # Had r1 gone to worker 1, r2 would take 0.25.
    pool = workers((1, 0.0), (1, 0.0))
    samples = [req(1, 0.0, 1024), req(2, 0.5, 1024, holders=((0, 768),))]
    assert ttfts(samples, pool) == pytest.approx([1.0, 0.75], abs=1e-12)


def test_no_workers_is_an_error_and_no_requests_is_zero() -> None:
    with pytest.raises(ValueError, match="at least one worker"):
        run([req(1, 0.0, 10)], [])
    assert run([], workers((1, 0.0))) == ReplayResult(0.0, 0, 0.0, 0.0)


# -- two degrees: the cost rule -----------------------------------------------------------


def test_the_cost_rule_picks_the_faster_degree() -> None:
    pool = workers((1, 0.0), (2, 0.0))
    assert ttfts([req(1, 0.0, 2048)], pool) == [e(2, 2048)] == [1.25]  # long: degree 2
    assert ttfts([req(1, 0.0, 256)], pool) == [e(1, 256)] == [0.25]  # short: degree 1


def test_the_cost_rule_weighs_the_queue_against_the_execution() -> None:
    long = [req(1, 0.0, 2048)]  # E_1 = 2, E_2 = 1.25
    # Degree 2 free at 1: 1 + 1.25 > 2 at idle degree 1.
    assert ttfts(long, workers((1, 0.0), (2, 1.0))) == [2.0]
    # beta = 2 weighs execution over queue: 1 + 2.5 < 4; TTFT 1 + 1.25.
    assert ttfts(long, workers((1, 0.0), (2, 1.0)), model(CostWeights(beta=2.0))) == [2.25]
    # lambda = 1 charges degree 2 its extra device: 2 * 1.25 > 2 at idle degree 1.
    penalised = model(CostWeights(beta=1.0, gpu_penalty=1.0))
    assert ttfts(long, workers((1, 0.0), (2, 0.0))) == [1.25]
    assert ttfts(long, workers((1, 0.0), (2, 0.0)), penalised) == [2.0]


def test_a_cost_tie_goes_to_the_lower_queue() -> None:
    # r1 (2048): degree 1 idle costs 2; degree 2 free at 0.75 costs 0.75 + 1.25 = 2:
    # the lower q (degree 1) wins. r2 (256) then finds degree 1 busy until 2:
    # degree 2 costs 0.75 + 0.375. (Had r1 gone to degree 2, r2 would take 0.25.)
    samples = [req(1, 0.0, 2048), req(2, 0.0, 256)]
    assert ttfts(samples, workers((1, 0.0), (2, 0.75))) == pytest.approx([2.0, 1.125], abs=1e-12)


def test_a_tie_at_equal_queues_goes_to_the_lower_degree() -> None:
    # r1 (512) costs 0.5 at both idle workers: degree 1 wins. r2 (256): degree 1 costs
    # 0.5 + 0.25, degree 2 0.375. (Had r1 gone to degree 2, r2 would take 0.25.)
    samples = [req(1, 0.0, 512), req(2, 0.0, 256)]
    assert ttfts(samples, workers((2, 0.0), (1, 0.0))) == pytest.approx([0.5, 0.375], abs=1e-12)


# -- against the real scheduler -------------------------------------------------------------


def through_scheduler(
    layout: Sequence[int],
    samples: Sequence[ArrivalSample],
    weights: CostWeights,
    degrees: tuple[int, ...] = (1, 2),
) -> tuple[list[int], list[float]]:
    """The scheduler places each request at its arrival; workers run their queues
    FIFO for exactly the predicted time. Each request's worker and TTFT."""
    lattice = Lattice(LatticeConfig(sum(layout), degrees), layout)
    sched = Scheduler(lattice, COEFFS, SchedulerConfig(weights))
    arrival = {s.request_id: s.arrival_s for s in samples}
    exec_s: dict[int, float] = {}  # request -> its E where placed
    ends: dict[int, tuple[int, float]] = {}  # worker -> (running request, its end)
    ttft: dict[int, float] = {}

    def start(worker: int, now: float) -> None:
        rid = sched.head(worker)
        if rid is not None and worker not in ends:
            sched.start(rid, now)
            ends[worker] = (rid, now + exec_s[rid])
            ttft[rid] = now + exec_s[rid] - arrival[rid]

    chosen = []
    for s in samples:
        while True:  # every prefill that ends by now, in time order
            due = [(end, w) for w, (_, end) in ends.items() if end <= s.arrival_s]
            if not due:
                break
            end, w = min(due)
            sched.complete(ends.pop(w)[0])
            start(w, end)
        placed = sched.place(PlacementRequest(s.request_id, s.input_tokens), s.arrival_s)
        assert placed is not None
        chosen.append(placed.worker_id)
        exec_s[s.request_id] = placed.exec_s
        start(placed.worker_id, s.arrival_s)
    while ends:
        end, w = min((end, w) for w, (_, end) in ends.items())
        sched.complete(ends.pop(w)[0])
        start(w, end)
    return chosen, [ttft[s.request_id] for s in samples]


def replay_pool(layout: Sequence[int]) -> list[ReplayWorker]:
    return [ReplayWorker(k, c, 0.0) for k, c in enumerate(layout)]


def test_the_tie_cases_match_the_scheduler() -> None:
    # Layout (2, 1) on 3 devices: worker 0 of degree 2, worker 1 of degree 1.
    # r1 (2048 at 0) to degree 2 (1.25 < 2), busy until 1.25. At 0.5, r2 (2048): degree
    # 1 costs 2, degree 2 0.75 + 1.25 = 2: the lower q (worker 1). r3 (256 at 0.5):
    # worker 1 busy until 2.5 costs 2.25; worker 0: 0.75 + 0.375. r4 (512 at 3): both
    # idle at 0.5: the lower degree (worker 1).
    samples = [req(1, 0.0, 2048), req(2, 0.5, 2048), req(3, 0.5, 256), req(4, 3.0, 512)]
    chosen, sched_ttfts = through_scheduler((2, 1), samples, CostWeights())
    assert chosen == [0, 1, 0, 1]
    assert sched_ttfts == [1.25, 2.0, 1.125, 0.5]
    assert ttfts(samples, replay_pool((2, 1))) == pytest.approx(sched_ttfts, abs=1e-12)
    # Two idle workers of one degree: the lower id.
    same = [req(1, 0.0, 64), req(2, 0.0, 64), req(3, 0.0, 64)]
    chosen, sched_ttfts = through_scheduler((1, 1), same, CostWeights())
    assert chosen == [0, 1, 0] and sched_ttfts == [0.0625, 0.0625, 0.125]
    assert ttfts(same, replay_pool((1, 1))) == pytest.approx(sched_ttfts, abs=1e-12)


def random_stream(seed: int, count: int) -> list[ArrivalSample]:
    """Distinct lengths, arrival gaps in 1/64 s steps (every time stays dyadic)."""
    rng = random.Random(seed)
    lengths = rng.sample(range(32, 4096), count)
    t, out = 0.0, []
    for rid, n in enumerate(lengths):
        t += rng.randrange(0, 64) / 64
        out.append(req(rid, t, n))
    return out


@pytest.mark.parametrize(
    "weights",
    [
        CostWeights(backlog_weight=0.0),
        CostWeights(beta=1.5, backlog_weight=0.0),
        CostWeights(beta=1.0, gpu_penalty=0.5, backlog_weight=0.0),
    ],
    ids=["beta1", "beta1.5", "lambda0.5"],
)
@pytest.mark.parametrize("layout", [(1, 1, 2), (2, 2), (1, 1, 1, 1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_replay_places_like_the_scheduler(
    weights: CostWeights, layout: tuple[int, ...], seed: int
) -> None:
    samples = random_stream(seed, 60)
    chosen, sched_ttfts = through_scheduler(layout, samples, weights)
    assert len(set(chosen)) == len(layout)  # every worker served (the stream queues)
    assert ttfts(samples, replay_pool(layout), model(weights)) == pytest.approx(
        sched_ttfts, abs=1e-9
    )


@pytest.mark.parametrize("layout", [(1, 1, 2), (2, 2), (1, 1, 1, 1)])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_in_overload_the_replay_estimates_the_schedulers_backlog_depth(
    layout: tuple[int, ...], seed: int
) -> None:
    # The default weights (backlog_weight 1): the scheduler counts the requests
    # waiting at each worker, the replay estimates them from each queue's predicted
    # work over the forecast's mean E. One degree: E weighs the same everywhere, so
    # the choices are the scheduler's exactly. Mixed degrees: the mean TTFT within
    # 3 % (measured: within 0.6 % on these streams).
    samples = random_stream(seed, 60)
    _, sched_ttfts = through_scheduler(layout, samples, CostWeights())
    replayed = ttfts(samples, replay_pool(layout), model())
    if len(set(layout)) == 1:
        assert replayed == pytest.approx(sched_ttfts, abs=1e-9)
    else:
        assert sum(replayed) == pytest.approx(sum(sched_ttfts), rel=0.03)


def test_the_replay_prices_degrees_as_the_scheduler_without_the_smallest_degree() -> None:
    # Lattice degrees (1, 2, 4), workers of degrees 2, 2 and 4, lambda = 1. The
    # scheduler's C_min is the least degree among its candidates (2): degree 4's E
    # weighs 1 + 1 * (4/2 - 1) = 2, degree 2's 1. Two fillers of 1536 tokens (E_2 = 1,
    # E_4 = 0.875: 1 < 1.75) load workers 0 and 1 with 1 s each; then 4096 tokens
    # (E_2 = 2.25, E_4 = 1.5): 1 + 2.25 > 2 * 1.5, worker 2, TTFT 1.5.
    weights = CostWeights(beta=1.0, gpu_penalty=1.0)
    samples = [req(1, 0.0, 1536), req(2, 0.0, 1536), req(3, 0.0, 4096)]
    chosen, sched_ttfts = through_scheduler((2, 2, 4), samples, weights, (1, 2, 4))
    assert chosen == [0, 1, 2] and sched_ttfts == [1.0, 1.0, 1.5]
    replay = model(weights, degrees=(1, 2, 4))
    assert ttfts(samples, replay_pool((2, 2, 4)), replay) == pytest.approx(sched_ttfts, abs=1e-9)


# -- prefixes -----------------------------------------------------------------------------


def test_a_holder_that_is_busy_wins_when_cheaper() -> None:
    # Worker 1 holds 768 of 1024 tokens: 0.5 + 0.25 < 1 at idle worker 0.
    held = [req(1, 0.0, 1024, holders=((1, 768),))]
    assert ttfts(held, workers((1, 0.0), (1, 0.5))) == [0.75]
    # Busy until 0.875: 0.875 + 0.25 > 1: the idle worker, no reuse.
    assert ttfts(held, workers((1, 0.0), (1, 0.875))) == [1.0]
    # A holder that is not in the pool holds nothing.
    gone = [req(1, 0.0, 1024, holders=((7, 768),))]
    assert ttfts(gone, workers((1, 0.0), (1, 0.5))) == [1.0]


@pytest.mark.parametrize("backlog_weight", [0.0, 1.0])
def test_in_overload_the_replay_weighs_a_hit_as_the_scheduler_does(
    backlog_weight: float,
) -> None:
    # As the scheduler's test: fillers of 1024 tokens (E = 1) queue worker 0 until 4
    # and worker 1 until 3; a 640-token request reuses 512 at worker 0 (E = 0.125;
    # 0.625 at worker 1). The forecast's mean E at its best reuse is
    # (7 + 0.125) / 8 = 0.89: worker 0's queue counts 4 requests, worker 1's 3. The
    # depth is 3, so E weighs 1 + (3 - 1) = 3: 4 + 3 * 0.125 = 4.375 < 3 + 3 * 0.625
    # = 4.875 at the holder; without the term 4.125 > 3.625.
    samples = [req(r, 0.0, 1024) for r in range(1, 8)]
    samples.append(req(9, 0.0, 640, holders=((0, 512),)))
    replay = model(CostWeights(backlog_weight=backlog_weight), degrees=(1,))
    got = ttfts(samples, workers((1, 0.0), (1, 0.0)), replay)
    assert got[-1] == (4.125 if backlog_weight else 3.625)
    assert got[:-1] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0]


def test_a_remapped_holder_goes_to_the_target_its_key_picks() -> None:
    # Worker 5 was split into workers 10 and 11: its prefixes go to 10 + key % 2.
    # r1 ties between the idle targets: worker 10, busy until 1. r2 (key 3) finds its
    # prefix at worker 11 (idle): 0.25. With key 2 at worker 10 (busy): 1 + 0.25 > 1 at
    # worker 11 without reuse.
    pool = [ReplayWorker(10, 1, 0.0), ReplayWorker(11, 1, 0.0)]
    remap = {5: (10, 11)}
    for key, second in ((3, 0.25), (2, 1.0)):
        samples = [req(1, 0.0, 1024), req(2, 0.0, 1024, holders=((5, 768),), key=key)]
        assert ttfts(samples, pool, remap=remap) == pytest.approx([1.0, second], abs=1e-12)
    # A source remapped to nothing (its prefixes are gone) holds nothing.
    samples = [req(1, 0.0, 1024, holders=((5, 768),), key=3)]
    assert ttfts(samples, pool, remap={5: ()}) == [1.0]


def test_a_lost_prefix_misses_once_then_hits() -> None:
    # Worker 5 became worker 10 and left every prefix out of place (share 1): the
    # first request of key 3 computes all 1024 tokens, the next one reuses 768.
    pool = [ReplayWorker(10, 1, 0.0)]
    samples = [
        req(1, 0.0, 1024, holders=((5, 768),), key=3),
        req(2, 2.0, 1024, holders=((5, 768),), key=3),
        req(3, 4.0, 1024, holders=((5, 768),), key=4),  # another prefix: misses too
        req(4, 6.0, 1024, holders=((5, 768),), key=4),
    ]
    remap = {5: (10,)}
    assert ttfts(samples, pool, remap=remap, lost={5: 1.0}) == [1.0, 0.25, 1.0, 0.25]
    assert ttfts(samples, pool, remap=remap, lost={5: 0.0}) == [0.25] * 4
    assert ttfts(samples, pool, remap=remap) == [0.25] * 4
    # The share is per prefix key: about that fraction of keys miss first.
    # (one request per key, 2 s apart: no queue; a miss takes 1, a hit 0.25)
    many = [req(k, 2.0 * k, 1024, holders=((5, 768),), key=k + 1) for k in range(400)]
    mean = run(many, pool, remap=remap, lost={5: 0.25}).mean_ttft_s
    missed = round((mean * 400 - 0.25 * 400) / 0.75)
    assert mean == pytest.approx((missed * 1.0 + (400 - missed) * 0.25) / 400, rel=1e-12)
    assert 70 <= missed <= 130


def test_the_floor_is_reuse_at_every_worker() -> None:
    # 768 tokens reusable everywhere: the idle worker takes it, at 0.25.
    assert ttfts([req(1, 0.0, 1024, floor=768)], workers((1, 0.0), (1, 0.5))) == [0.25]
    assert ttfts([req(1, 0.0, 1024, floor=768)], workers((1, 0.5), (1, 0.0))) == [0.25]
    # ... and at every degree: E_2(1024, 768) = 0.25 + 0.125 > 0.25.
    assert ttfts([req(1, 0.0, 1024, floor=768)], workers((2, 0.0), (1, 0.0))) == [0.25]
    prepared = model().prepare([req(1, 0.0, 1024, floor=768)], 0.0)
    assert prepared.holders == ((),) and prepared.e_pred == ((0.25, 0.375),)
    # A holder above the floor: 1000 of 1024 at busy worker 1 (E = 24 / 1024) beats
    # the floor's 0.25 at idle worker 0 while its queue is under 0.25 - 24/1024.
    above = [req(1, 0.0, 1024, holders=((1, 1000),), floor=768)]
    assert ttfts(above, workers((1, 0.0), (1, 0.125))) == [0.125 + 24 / 1024]
    assert ttfts(above, workers((1, 0.0), (1, 0.25))) == [0.25]


# -- calibration, overhead, dilation ------------------------------------------------------


def test_the_calibration_scale_multiplies_service_time() -> None:
    # Degree 1 measures twice its prediction under 2K tokens and three times in [2K, 8K).
    scaled = model(scale={1: (2.0, 3.0, 1.0, 1.0)})
    samples = [req(1, 0.0, 1024), req(2, 10.0, 4096)]
    assert ttfts(samples, workers((1, 0.0)), scaled) == pytest.approx([2.0, 12.0], abs=1e-12)
    # The holder path is scaled too: E_1(1024, 768) = 0.25, times 2.
    held = [req(1, 0.0, 1024, holders=((0, 768),))]
    assert ttfts(held, workers((1, 0.0)), scaled) == [0.5]
    assert run(samples, workers((1, 0.0)), scaled).busy_s == 14.0


def test_the_queue_is_seen_in_predicted_seconds() -> None:
    # Degree 1 runs at twice its prediction: a backlog of 0.1875 real seconds is
    # 0.09375 predicted. L = 256: 0.09375 + 0.25 < 0.375 at idle degree 2; TTFT
    # 0.1875 + 2 * 0.25.
    scaled = model(scale={1: (2.0, 2.0, 2.0, 2.0)})
    samples = [req(1, 0.0, 256)]
    assert ttfts(samples, workers((1, 0.1875), (2, 0.0)), scaled) == [0.6875]
    # Unscaled, the same backlog costs 0.1875 + 0.25 > 0.375: degree 2.
    assert ttfts(samples, workers((1, 0.1875), (2, 0.0))) == [0.375]


def test_the_path_overhead_adds_to_every_service() -> None:
    with_overhead = model(overhead_s=0.125)
    samples = [req(1, 0.0, 1024), req(2, 0.0, 1024, holders=((0, 768),))]
    # r1: 1 + 0.125. r2 reuses at worker 0: waits 1.125, runs 0.25 + 0.125.
    assert ttfts(samples, workers((1, 0.0)), with_overhead) == pytest.approx(
        [1.125, 1.5], abs=1e-12
    )


def poisson_stream(seed: int, count: int, rate: float) -> list[ArrivalSample]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for rid in range(count):
        t += rng.expovariate(rate)
        out.append(req(rid, t, rng.randrange(256, 1536), key=rid + 1))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dilation_thins_and_keeps_the_queueing(seed: int) -> None:
    # 4 workers of degree 1, mean service 0.875 s, 3.2 req/s: utilisation 0.7, a mean
    # wait of about 0.2 s (a replay that dilated nothing would miss it by 17 %).
    samples = poisson_stream(seed, 4000, 3.2)
    replay = model()
    pool = workers((1, 0.0), (1, 0.0), (1, 0.0), (1, 0.0))
    whole = replay.run(replay.prepare(samples, 0.0), pool)
    thinned = replay.prepare(samples, 0.0, dilation=4.0)
    assert abs(len(thinned.offsets) / len(samples) - 0.25) < 0.02
    assert thinned.dilation == 4.0 and thinned.span_s == max(thinned.offsets)
    result = replay.run(thinned, pool)
    assert result.requests == len(thinned.offsets)
    assert result.mean_ttft_s == pytest.approx(whole.mean_ttft_s, rel=0.10)
    # busy_s is the whole forecast's service time, in real seconds.
    assert result.busy_s == pytest.approx(whole.busy_s, rel=0.10)
    # The thinning keeps the same requests whatever their ids (by length and key).
    renumbered = [req(s.request_id + 10_000, s.arrival_s, s.input_tokens, key=s.prefix_key)
                  for s in samples]  # fmt: skip
    assert replay.prepare(renumbered, 0.0, dilation=4.0).offsets == thinned.offsets


def test_dilation_thins_a_workload_of_one_length_too() -> None:
    # Every request 1024 tokens with no reusable prefix (key 0), as in a fixed-length
    # benchmark: a 1/m of them must still be kept, not all or none.
    samples = [req(k, k / 100, 1024) for k in range(3000)]
    for m in (2.0, 4.0):
        kept = len(model().prepare(samples, 0.0, dilation=m).offsets)
        assert abs(kept / len(samples) - 1 / m) < 0.02, (m, kept)


def test_no_dilation_keeps_everything() -> None:
    samples = poisson_stream(0, 100, 1.0)
    assert len(model().prepare(samples, 0.0, dilation=1.0).offsets) == 100


@pytest.mark.parametrize(
    ("tokens", "bucket"),
    [(0, 0), (1, 0), (2047, 0), (2048, 1), (8191, 1), (8192, 2), (32767, 2), (32768, 3),
     (10**7, 3)],
)  # fmt: skip
def test_bucket_edges(tokens: int, bucket: int) -> None:
    assert BUCKET_EDGES == (2048, 8192, 32768)
    assert bucket_of(tokens) == bucket


def test_a_warm_replay_reuses_each_prefix_wherever_the_trie_matched_it() -> None:
    curves = reuse_curves({1: DegreeCoeffs(d=0.5, c=1e-3)})
    model = ReplayModel(curves, (1,), CostWeights())
    held = ArrivalSample(0, 0.0, 1000, ((3, 256),), prefix_key=9, matched_tokens=768)
    cold = model.prepare([held], 0.0)
    warm = model.prepare([held], 0.0, warm=True)
    assert cold.e_pred[0] == (curves[1].time_s(1000, 0),)
    assert cold.holders[0] == ((3, (curves[1].time_s(1000, 256),)),)
    assert warm.e_pred[0] == (curves[1].time_s(1000, 768),) and warm.holders[0] == ()


# -- cycles: the load continued, the backlog carried ---------------------------------------


def test_cycles_continue_the_forecast_from_the_state_the_last_left() -> None:
    # One degree-1 worker, two 1024-token requests at 0 and 0.5 s (1 s each), a span of
    # 1 s: each cycle brings 2 s of work in 1 s, a second of backlog more.
    replay = model()
    forecast = replay.prepare([req(0, 0.0, 1024), req(1, 0.5, 1024)], 0.0, span_s=1.0)
    result = replay.run(forecast, workers((1, 0.0)), cycles=3)
    # cycle c: its requests wait c and c + 1/2 s before their second of service
    assert result.cycle_ttft_s == pytest.approx((1.25, 2.25, 3.25), rel=1e-12)
    assert result.mean_ttft_s == pytest.approx(2.25, rel=1e-12)
    assert result.requests == 6
    # the work queued past each cycle's end: 1, 2, 3 s
    assert result.backlog_s == pytest.approx((1.0, 2.0, 3.0), rel=1e-12)
    # busy: the first cycle's service
    assert result.busy_s == pytest.approx(2.0, rel=1e-12)
    # The same as the forecast laid out three times by hand.
    by_hand = [req(k, 0.5 * k, 1024) for k in range(6)]
    assert run(by_hand, workers((1, 0.0))).mean_ttft_s == pytest.approx(2.25, rel=1e-12)


def test_a_head_is_placed_once_before_the_cycles() -> None:
    replay = model()
    forecast = replay.prepare([req(0, 0.0, 512)], 0.0, span_s=1.0)
    head = replay.prepare([req(9, 0.0, 1024)], 0.0)
    result = replay.run(forecast, workers((1, 0.0)), head=head, cycles=2)
    # the head's 1 s first; then the cycle's request at 0 waits 1 s (0.5 s of service),
    # the next cycle's at 1 s waits 0.5 s
    assert result.cycle_ttft_s == pytest.approx((1.5, 1.0), rel=1e-12)
    assert result.mean_ttft_s == pytest.approx((1.0 + 1.5 + 1.0) / 3, rel=1e-12)


def test_batches_are_runs_of_consecutive_arrivals_over_every_cycle() -> None:
    replay = model()
    samples = [req(k, 0.25 * k, 256 * (k + 1)) for k in range(4)]
    forecast = replay.prepare(samples, 0.0, span_s=4.0)
    result = replay.run(forecast, workers((1, 0.0), (1, 0.0)), cycles=2, batches=2)
    # two idle workers, no queue: each request's TTFT is its service time
    first = (e(1, 256) + e(1, 512)) / 2
    second = (e(1, 768) + e(1, 1024)) / 2
    assert result.batch_ttft_s == pytest.approx((first, second), rel=1e-12)


def test_the_last_cycle_alone_its_requests_and_batches() -> None:
    # The growing backlog of the first test: cycle c's two requests wait c and
    # c + 1/2 s, so the last cycle's batches (one request each) are 2 + 1 and
    # 2.5 + 1 s after three cycles; after one, 1 and 1.5 s. A head is in no cycle.
    replay = model()
    forecast = replay.prepare([req(0, 0.0, 1024), req(1, 0.5, 1024)], 0.0, span_s=1.0)
    three = replay.run(forecast, workers((1, 0.0)), cycles=3, batches=2)
    assert three.last_requests == 2
    assert three.last_batch_ttft_s == pytest.approx((3.0, 3.5), rel=1e-12)
    one = replay.run(forecast, workers((1, 0.0)), cycles=1, batches=2)
    assert one.last_requests == 2 and one.last_batch_ttft_s == pytest.approx((1.0, 1.5))
    head = replay.prepare([req(9, 0.0, 1024)], 0.0)
    headed = replay.run(forecast, workers((1, 0.0)), head=head, cycles=1, batches=2)
    assert headed.requests == 3 and headed.last_requests == 2
    # the head's second first: the cycle's requests wait 1 and 1.5 s
    assert headed.last_batch_ttft_s == pytest.approx((2.0, 2.5), rel=1e-12)


def test_a_retired_worker_drains_then_its_replacements_serve() -> None:
    # Worker 0 (degree 2) takes no work arriving from t = 1; its queue ends at 2.0,
    # then two degree-1 workers made of it serve after a 0.5-s switch (free at 2.5).
    samples = [req(1, 0.0, 1024), req(2, 0.5, 2048), req(3, 1.0, 1024), req(4, 1.0, 1024)]
    # r1 runs [0, 0.75); r2 waits 0.25, runs [0.75, 2.0); r3 and r4 wait for the
    # replacements (1.5 s) and run 1.0 s each, one on each.
    expected = [e(2, 1024), 0.25 + e(2, 2048), 1.5 + e(1, 1024), 1.5 + e(1, 1024)]
    assert expected == [0.75, 1.5, 2.5, 2.5]
    made = (ReplayWorker(1, 1, 0.5), ReplayWorker(2, 1, 0.5))
    pool = workers((2, 0.0))
    assert ttfts(samples, pool, retire=[(1.0, 0, made)]) == pytest.approx(expected, abs=1e-12)
    # Unretired, r3 and r4 queue on worker 0: [2.0, 2.75) and [2.75, 3.5).
    assert ttfts(samples, pool) == pytest.approx([0.75, 1.5, 1.75, 2.5], abs=1e-12)
    # A retirement after the last arrival changes nothing.
    assert run(samples, pool, retire=[(5.0, 0, made)]) == run(samples, pool)


def test_retiring_every_worker_for_none_is_an_error() -> None:
    samples = [req(1, 0.0, 1024), req(2, 2.0, 1024)]
    with pytest.raises(ValueError, match="retired every worker"):
        run(samples, workers((1, 0.0)), retire=[(1.0, 0, ())])


@pytest.mark.parametrize("seed", range(3))
def test_an_extended_replay_is_the_replay_of_that_many_cycles(seed: int) -> None:
    # A backlogged pool with holders, a reshape's remap and lost share, a head, a
    # retirement and batches: extending 1 -> 2 -> 5 cycles, then asking for 3, gives
    # what a fresh replay of that many cycles gives, to the bit.
    rng = random.Random(seed)
    replay = model(CostWeights(backlog_weight=0.05))
    samples = [
        req(k, rng.uniform(0.0, 4.0), rng.choice((512, 1024, 3000)),
            ((rng.choice((0, 1, 7)), 256),) if k % 3 else (), key=k % 5)
        for k in range(40)
    ]  # fmt: skip
    forecast = replay.prepare(sorted(samples, key=lambda s: s.arrival_s), 0.0, span_s=4.0)
    head = replay.prepare([req(99, 0.0, 2048)], 0.0)
    pool = workers((2, 0.5), (1, 0.0), (1, 2.0))
    retire = [(3.0, 0, (ReplayWorker(5, 1, 0.25), ReplayWorker(6, 1, 0.25)))]
    args = {"remap": {7: (1, 2)}, "lost": {7: 0.5}, "head": head, "batches": 4}
    moves = ReplayMoves(args["remap"], args["lost"], head, retire)  # type: ignore[arg-type]
    grown = Replay(replay, forecast, pool, moves, batches=4)
    for cycles in (1, 2, 5, 3):
        fresh = replay.run(forecast, pool, cycles=cycles, retire=retire, **args)  # type: ignore[arg-type]
        assert grown.extend(cycles) == fresh
    assert fresh.requests == 1 + 3 * 40 and len(fresh.cycle_ttft_s) == 3
