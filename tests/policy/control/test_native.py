"""The compiled twin of the replay loop (``vertumnus.native``): the same results as the
pure module, bit for bit, on random replays that use every feature of the loop; and
the loader's rules (a twin of another source, or VERTUMNUS_NATIVE=0, keeps the pure
module).

Where the twin is not built, the comparison is skipped, unless
VERTUMNUS_REQUIRE_NATIVE=1 (``tools/test.sh`` sets it where a C compiler is found),
which makes a missing or stale twin a failure."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

from vertumnus import native
from vertumnus.perfmodel import DegreeCoeffs
from vertumnus.policy.control import replay_loop
from vertumnus.policy.control.forecast import ArrivalSample
from vertumnus.policy.control.replay import Calibrated, ReplayModel
from vertumnus.policy.control.replay_types import PreparedForecast, ReplayMoves, ReplayWorker
from vertumnus.policy.costs import CostWeights, reuse_curves

CURVES = reuse_curves(
    {
        1: DegreeCoeffs(a=1e-9, c=2.0e-4, alpha=1e-10),
        2: DegreeCoeffs(d=0.01, a=6e-10, c=1.1e-4),
        4: DegreeCoeffs(d=0.02, a=4e-10, c=6.0e-5),
        8: DegreeCoeffs(d=0.04, a=3e-10, c=3.5e-5),
    }
)


def twin() -> ModuleType:
    module = native.compiled(replay_loop)
    if module is replay_loop:
        why = native.status()[replay_loop.__name__]
        if os.environ.get("VERTUMNUS_REQUIRE_NATIVE") == "1":
            pytest.fail(f"the compiled replay loop is required but not in use: {why}")
        pytest.skip(f"the compiled replay loop is not in use: {why}")
    return module


def scenario(rng: random.Random) -> tuple[ReplayModel, dict[str, object], list[int]]:
    """A random model, forecast and worker set, with remaps, lost shares, a head,
    retirements, calibration, overhead and a rank limit, each drawn on or off."""
    degrees = sorted(rng.sample([1, 2, 4, 8], rng.randint(1, 4)))
    weights = CostWeights(backlog_weight=rng.choice([0.0, 0.5, 1.0]))
    scale = {c: tuple(rng.uniform(0.7, 1.4) for _ in range(4)) for c in degrees}
    model = ReplayModel(
        CURVES,
        degrees,
        weights,
        Calibrated(scale if rng.random() < 0.7 else {}, rng.choice([0.0, 0.003])),
        rng.choice([None, 20_000, 60_000]),
    )
    pool = [
        ReplayWorker(w, rng.choice(degrees), rng.uniform(0, 3)) for w in range(rng.randint(1, 9))
    ]
    ids = [w.worker_id for w in pool]
    rate, span = rng.uniform(2, 80), rng.uniform(5, 30)

    def samples(n: int, at_zero: bool = False) -> list[ArrivalSample]:
        out = []
        for i in range(n):
            length = rng.choice([300, 2_000, 9_000, 40_000, 120_000])
            holders = tuple(
                (w, rng.randint(1, length)) for w in rng.sample([*ids, 90, 91], rng.randint(0, 3))
            )
            t = 0.0 if at_zero else rng.uniform(0, span)
            out.append(ArrivalSample(i, t, length, holders, rng.randint(0, 40), 0))
        return sorted(out, key=lambda s: s.arrival_s)

    dilation = rng.choice([1.0, 1.0, 2.5])
    forecast = model.prepare(samples(int(rate * span)), 0.0, dilation, span)
    kwargs: dict[str, object] = {"batches": rng.choice([0, 4, 8])}
    if rng.random() < 0.5:  # a reshape: holders remapped to the workers made of them
        made = [100 + w for w in range(rng.randint(1, 3))]
        kwargs["remap"] = {ids[0]: tuple(made), 90: ()}
        kwargs["lost"] = {ids[0]: rng.choice([0.0, 0.4, 1.0])}
        pool = [w for w in pool if w.worker_id != ids[0]] + [
            ReplayWorker(m, degrees[0], rng.uniform(1, 4)) for m in made
        ]
    if rng.random() < 0.4:
        kwargs["head"] = model.prepare(samples(rng.randint(1, 6), True), 0.0, dilation)
    if rng.random() < 0.3 and len(pool) > 1:
        w = pool[-1]
        kwargs["retire"] = [(rng.uniform(0, span), w.worker_id,
                             (ReplayWorker(200, w.cp_degree, 0.5),)),
                            (1.0, 999, (ReplayWorker(201, w.cp_degree, 0.0),))]  # fmt: skip
        # (999 is no worker of the replay's: its retirement is ignored)
    moves = ReplayMoves(
        kwargs.get("remap"),  # type: ignore[arg-type]
        kwargs.get("lost"),  # type: ignore[arg-type]
        kwargs.get("head"),  # type: ignore[arg-type]
        kwargs.get("retire", ()),  # type: ignore[arg-type]
    )
    args = {"forecast": forecast, "workers": pool, "moves": moves, "batches": kwargs["batches"]}
    return model, args, [1, 2, 5]


def test_the_compiled_replay_gives_the_pure_replays_results_bit_for_bit() -> None:
    compiled = twin().Replay
    rng = random.Random(20261203)
    checked = 0
    for _ in range(150):
        model, args, cycles = scenario(rng)
        pure = replay_loop.Replay(model, **args)  # type: ignore[arg-type]
        twin_replay = compiled(model, **args)
        for c in cycles:
            expected = pure.extend(c)
            assert twin_replay.extend(c) == expected
            checked += expected.requests
    assert checked > 10_000  # the scenarios placed enough requests to mean something


def test_a_twin_built_from_another_source_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "fake_loop.py"
    source.write_text("X = 1\n")
    module = ModuleType("vertumnus.policy.fake_loop")
    module.__file__ = str(source)
    stand_in = ModuleType(native.twin_name(module.__name__))
    monkeypatch.setitem(sys.modules, stand_in.__name__, stand_in)
    stand_in.SOURCE_SHA256 = "0" * 64  # type: ignore[attr-defined]
    assert native.compiled(module) is module
    assert "another source" in native.status()[module.__name__]
    stand_in.SOURCE_SHA256 = native.source_hash(source)  # type: ignore[attr-defined]
    assert native.compiled(module) is stand_in
    assert native.status()[module.__name__] == "compiled"
    monkeypatch.setenv("VERTUMNUS_NATIVE", "0")
    assert native.compiled(module) is module
    assert native.status()[module.__name__] == "pure (VERTUMNUS_NATIVE=0)"


def test_a_missing_twin_keeps_the_pure_module(tmp_path: Path) -> None:
    source = tmp_path / "absent_loop.py"
    source.write_text("X = 2\n")
    module = ModuleType("vertumnus.policy.absent_loop")
    module.__file__ = str(source)
    assert native.compiled(module) is module
    assert native.status()[module.__name__].startswith("pure (not built")


def test_the_compiled_mean_e_equals_the_pure_one() -> None:
    compiled = twin().mean_best_e
    rng = random.Random(3)
    for _ in range(50):
        model, args, _ = scenario(rng)
        forecast = args["forecast"]
        assert isinstance(forecast, PreparedForecast)
        n = len(model.degrees)
        expected = replay_loop.mean_best_e(n, forecast.e_pred, forecast.holders)
        assert compiled(n, forecast.e_pred, forecast.holders) == expected
        assert expected == forecast.mean_e


def test_the_compiled_gather_equals_the_pure_one() -> None:
    compiled = twin().gather
    rng = random.Random(5)
    model = ReplayModel(CURVES, [1, 2, 4, 8], CostWeights())
    samples = [
        ArrivalSample(i, rng.uniform(0, 30), rng.choice([300, 9_000, 40_000]),
                      tuple((w, rng.randint(1, 200)) for w in rng.sample(range(6), 2)),
                      rng.randint(0, 40))
        for i in range(400)
    ]  # fmt: skip
    for keep in (2.0, 0.4, 0.05):
        pure_cache: dict[int, object] = {0: model.times(samples[1])}  # (a stale entry is read)
        twin_cache = dict(pure_cache)
        expected = replay_loop.gather(samples, 3.0, keep, pure_cache, model.times)  # type: ignore[arg-type]
        assert compiled(samples, 3.0, keep, twin_cache, model.times) == expected
        assert twin_cache == pure_cache
        kept = [s for s in samples if s.draw < keep]
        assert expected[0] == tuple(s.arrival_s - 3.0 for s in kept)
        assert expected[1] == tuple(s.prefix_key for s in kept)
        assert expected[3][1:] == tuple(model.times(s)[1] for s in kept[1:])
        assert set(pure_cache) == {s.request_id for s in kept} | {0}
