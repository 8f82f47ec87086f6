"""``serve`` with ``[pool] composition = "auto"``: it starts from the composition its
state file keeps (or, that failing, from the built-in mix, saying why), logs the
choice, shows its source in ``/v1/composition``, and keeps the composition after
every reshape and at shutdown. Fake in-process ranks, simulated time; the same
through a real server: ``test_a_served_pool_starts_where_it_stopped``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from support.fake_ranks import start_coordinator
from support.server import running_server, write_serve_config
from support.virtual_time import run_virtual
from vertumnus.config import ConfigError
from vertumnus.config.start import write_state
from vertumnus.policy.geometry import LatticeConfig
from vertumnus.runtime import serve_config
from vertumnus.sim.time_model import SimSettings

SETTINGS = SimSettings(switch_s=0.01)
LATTICE = LatticeConfig(2, (1, 2))


def auto_config(folder: Path, **pool: object) -> Path:
    table = {"composition": "auto", "ranks": 2, "degrees": [1, 2], **pool}
    return write_serve_config(folder / "serve.toml", pool=table)


def test_auto_starts_from_the_state_file_and_keeps_every_reshape(tmp_path: Path) -> None:
    state = tmp_path / "pool.json"
    write_state(str(state), LATTICE, [2])
    cfg = serve_config.load(auto_config(tmp_path, state_file=str(state)))
    assert cfg.layout == (2,) and cfg.start is not None and cfg.start.source == "state_file"

    async def main() -> None:
        with capture_logs() as logs:
            coord, _ = await start_coordinator(cfg, SETTINGS)
        try:
            chosen = [e for e in logs if e["event"] == "start_chosen"]
            assert chosen == [
                {
                    "event": "start_chosen",
                    "log_level": "info",
                    "source": "state_file",
                    "origin": str(state),
                    "composition": "1CP2",
                    "predicted_s": {},
                }
            ]
            view = coord.composition_view()
            assert view["composition"] == "1CP2" and view["start_source"] == "state_file"
            await coord.begin_reshape(coord.reshape_for("split", None))
            assert json.loads(state.read_text())["layout"] == [1, 1]
            await coord.begin_reshape(coord.reshape_for("merge", None))
            assert json.loads(state.read_text())["composition"] == "1CP2"
            state.unlink()
        finally:
            await coord.close()
        assert json.loads(state.read_text())["composition"] == "1CP2"  # (at shutdown)

    run_virtual(main())


def test_a_state_file_of_another_pool_is_passed_over_with_a_warning(tmp_path: Path) -> None:
    state = tmp_path / "pool.json"
    write_state(str(state), LatticeConfig(4, (1, 2)), [2, 2])
    path = auto_config(tmp_path, state_file=str(state), start_rate=2.0)
    cfg = serve_config.load(path)
    assert cfg.start is not None and cfg.start.source == "builtin_mix"
    assert set(cfg.start.predicted_s) == {"2CP1", "1CP2"}

    async def main() -> None:
        with capture_logs() as logs:
            coord, _ = await start_coordinator(cfg, SETTINGS)
        try:
            skipped = [e for e in logs if e["event"] == "start_source_skipped"]
            assert len(skipped) == 1 and skipped[0]["log_level"] == "warning"
            assert "is not this pool's: it is of 4 ranks" in skipped[0]["reason"]
            chosen = next(e for e in logs if e["event"] == "start_chosen")
            assert (
                chosen["source"] == "builtin_mix" and chosen["composition"] == cfg.start.composition
            )
            assert coord.composition_view()["start_source"] == "builtin_mix"
        finally:
            await coord.close()
        # Kept now for this pool: the next start takes it.
        again = serve_config.load(path)
        assert again.start is not None and again.start.source == "state_file"
        assert again.layout == cfg.layout

    run_virtual(main())


def test_serve_refuses_auto_without_a_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="start_workload"):
        serve_config.load(auto_config(tmp_path))
    missing = tmp_path / "none.json"
    with pytest.raises(ConfigError, match="does not exist yet"):
        serve_config.load(auto_config(tmp_path, state_file=str(missing)))


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_served_pool_starts_where_it_stopped(tmp_path: Path) -> None:
    state = tmp_path / "pool.json"
    write_state(str(state), LATTICE, [2])
    config = auto_config(tmp_path, state_file=str(state))
    with running_server(config) as srv:
        status, view = srv.call("GET", "/v1/composition")
        assert status == 200 and view["composition"] == "1CP2"
        assert view["start_source"] == "state_file"
        state.unlink()
    assert json.loads(state.read_text())["composition"] == "1CP2"  # written at shutdown
    log = (tmp_path / "server.log").read_text()
    assert '"event":"start_chosen"' in log and '"source":"state_file"' in log


def test_a_profile_of_other_attention_work_is_named(tmp_path: Path) -> None:
    """Serving a windowed model (``tiny-gpt-oss``) on a profile of full attention
    (``tiny``'s) says so at start: the profile's E counts other attention work."""
    from support.fake_ranks import fake_pool_config
    from vertumnus.runtime.coordinator import Coordinator

    for model, warned in (("tiny-gpt-oss", True), ("tiny", False)):
        cfg = fake_pool_config(tmp_path, (1, 1), model=model)
        with capture_logs() as logs:
            Coordinator(cfg)
        found = [e for e in logs if e["event"] == "profile_attention_differs"]
        assert bool(found) == warned, logs
        if warned:
            assert found[0]["model"] == ((0.5, None), (0.5, 128))
            assert found[0]["profile"] == ((1.0, None),)
