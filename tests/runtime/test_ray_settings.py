"""The multi-host pool's settings and reports, without a Ray cluster: the
``[cluster]`` table (Ray the only engine; the removed agents' keys refused by
name), the token check before anything connects, the hosts' watch turning Ray's
silence into ``ClusterReach`` reports, and ``/ready`` saying so meanwhile."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from support.fake_ranks import fake_pool_config, start_coordinator
from support.virtual_time import run_virtual
from vertumnus.config import ConfigError
from vertumnus.runtime.cluster import auth
from vertumnus.runtime.cluster.ray_hosts import RayHosts
from vertumnus.runtime.intents import ClusterReach
from vertumnus.runtime.serve_config import ClusterConfig, load_cluster
from vertumnus.sim.time_model import SimSettings


def test_cluster_table_defaults_and_errors(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text('[cluster]\nengine = "ray"\nhosts = 2\n')
    cluster = load_cluster(config)
    assert cluster == ClusterConfig(hosts=2)
    assert (cluster.address, cluster.private_network, cluster.cpus_per_rank) == ("auto", False, 1)
    config.write_text('[cluster]\nlisten = "0.0.0.0:7700"\nsecret = "0123456789abcdef"\n')
    with pytest.raises(ConfigError, match=r"listen, secret: the node agents .* Ray"):
        load_cluster(config)
    with pytest.raises(ConfigError, match='engine must be "ray"'):
        ClusterConfig(engine="agents")
    with pytest.raises(ConfigError, match="hosts must be >= 1"):
        ClusterConfig(hosts=0)
    with pytest.raises(ConfigError, match="cpus_per_rank must be > 0"):
        ClusterConfig(cpus_per_rank=0)
    config.write_text("[cluster]\nhosts = 2\nworkers = 3\n")
    with pytest.raises(ConfigError, match="workers"):
        load_cluster(config)


def test_token_check_needs_token_mode_and_a_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # (no ~/.ray/auth_token)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(ConfigError, match=r"RAY_AUTH_MODE=None.*private_network = true"):
        auth.check_token_auth("10.0.0.1:6379")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    with pytest.raises(ConfigError, match="no token"):
        auth.check_token_auth("10.0.0.1:6379")
    token = tmp_path / "token"
    token.write_text("t" * 32)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    auth.check_token_auth("10.0.0.1:6379")  # (no probe: nothing is contacted)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t" * 32)
    assert auth.has_token()


class Events:
    def __init__(self, stop_after: int) -> None:
        self.reports: list[str | None] = []
        self.done = threading.Event()
        self.stop_after = stop_after

    def host_lost(self, host: int) -> None:
        raise AssertionError("no host was lost")

    def host_back(self, host: int) -> None:
        raise AssertionError("no host came back")

    def reach_changed(self, error: str | None) -> None:
        self.reports.append(error)
        if len(self.reports) == self.stop_after:
            self.done.set()


def test_the_watch_reports_ray_silent_once_and_back_once() -> None:
    """Three failed checks make one report, the next good one another."""
    hosts = RayHosts(ClusterConfig(poll_s=0.001), "cpu")
    events = Events(stop_after=2)
    outcomes: list[Any] = [ConnectionError("gcs gone")] * 3 + [None] * 1000

    def check() -> None:
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    hosts._check = check  # type: ignore[method-assign]
    hosts._events = events
    thread = threading.Thread(target=hosts._watch, daemon=True)
    thread.start()
    try:
        assert events.done.wait(60), events.reports
    finally:
        hosts.close()
        thread.join(10)
    assert events.reports[0] is not None and "does not answer" in events.reports[0]
    assert "ConnectionError: gcs gone" in events.reports[0]
    assert events.reports[1:] == [None]
    assert hosts.trouble is None


@pytest.mark.timeout(60)
def test_ready_names_ray_while_it_does_not_answer(tmp_path: Path) -> None:
    async def main() -> None:
        cfg = fake_pool_config(tmp_path, (2,))
        coord, _ = await start_coordinator(cfg, SimSettings(switch_s=0.01))
        try:
            assert coord.unready_reason() is None
            coord.switchboard.route(ClusterReach("the Ray cluster does not answer: boom"))
            assert coord.unready_reason() == "the Ray cluster does not answer: boom"
            coord.switchboard.route(ClusterReach(None))
            assert coord.unready_reason() is None
        finally:
            await coord.close()

    run_virtual(main())


def test_a_check_that_hangs_makes_ray_unreachable_until_one_answers() -> None:
    """Ray's calls wait, rather than fail, while its GCS is gone: a check still
    unanswered after ``reach_timeout_s`` is reported, and the next good one clears it."""
    hosts = RayHosts(ClusterConfig(poll_s=0.01, reach_timeout_s=0.05), "cpu")
    events = Events(stop_after=2)
    release = threading.Event()
    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) == 1:
            assert release.wait(60)

    hosts._check = check  # type: ignore[method-assign]
    hosts._events = events
    thread = threading.Thread(target=hosts._watch, daemon=True)
    thread.start()
    try:
        for _ in range(6000):
            if events.reports:
                break
            threading.Event().wait(0.01)
        assert events.reports and "no answer in" in (events.reports[0] or "")
        release.set()
        assert events.done.wait(60), events.reports
    finally:
        release.set()
        hosts.close()
        thread.join(10)
    assert events.reports[1:] == [None]
