"""The control channel's wire form and the ``[cluster]`` configuration: a message
round-trips; a frame set signed with another secret, or altered, is refused before
anything is parsed; bad settings get clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from vertumnus.config import ConfigError
from vertumnus.runtime.cluster import channel
from vertumnus.runtime.cluster.channel import ControlError, FromRank, Hello, Keys, Spawn
from vertumnus.runtime.serve_config import ClusterConfig, load, load_cluster

SECRET = "control-test-secret-0123"


def test_round_trip_keeps_type_fields_and_payload() -> None:
    keys = Keys(SECRET)
    for msg, payload in (
        (Hello("host0", 8, "cuda", 1234), b""),
        (Spawn((0, 1, 2), (0, 1, 0)), b"\x80\x05spec"),
        (FromRank(3, 2), bytes(range(256)) * 10),
    ):
        frames = channel.encode(keys, msg, payload)
        assert channel.decode(keys, frames) == (msg, payload)


def test_another_secret_or_an_altered_frame_is_refused() -> None:
    keys = Keys(SECRET)
    frames = channel.encode(keys, FromRank(1, 0), b"payload")
    with pytest.raises(ControlError, match="bad signature"):
        channel.decode(Keys(SECRET + "x"), frames)
    for k in (1, 2):
        altered = list(frames)
        altered[k] = altered[k].replace(b"1", b"2").replace(b"payload", b"paylaod")
        with pytest.raises(ControlError, match="bad signature"):
            channel.decode(keys, altered)
    with pytest.raises(ControlError, match="3 frames"):
        channel.decode(keys, frames[:2])


def test_a_signed_but_unknown_message_is_refused() -> None:
    keys = Keys(SECRET)
    header = b'{"type": "Exec", "code": "rm"}'
    mac = channel._mac(keys, header, b"")
    with pytest.raises(ControlError, match="malformed"):
        channel.decode(keys, [mac, header, b""])
    with pytest.raises(TypeError):
        channel.encode(keys, object())


def test_secret_and_address_checks() -> None:
    with pytest.raises(ControlError, match="16 characters"):
        Keys("short")
    assert "secret" not in repr(Keys(SECRET)).lower().replace("<secret>", "")
    assert channel.split_address("10.0.0.1:7700") == ("10.0.0.1", 7700)
    assert channel.split_address("[::1]:7700") == ("::1", 7700)
    for bad in ("10.0.0.1", ":7700", "host:port", "host:70000"):
        with pytest.raises(ControlError, match="HOST:PORT"):
            channel.split_address(bad)


def test_cluster_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VERTUMNUS_CLUSTER_SECRET", raising=False)
    path = tmp_path / "c.toml"
    path.write_text('[pool]\ndegrees = [1, 2]\n[cluster]\nhosts = 2\nlisten = "0.0.0.0:7700"\n')
    with pytest.raises(ConfigError, match="secret"):
        load_cluster(path)
    monkeypatch.setenv("VERTUMNUS_CLUSTER_SECRET", SECRET)
    cluster = load_cluster(path)
    assert cluster is not None and cluster.hosts == 2 and cluster.secret == SECRET
    assert SECRET not in repr(cluster)
    with pytest.raises(ConfigError, match="agents"):
        load(path)  # the topology is the agents'
    cfg = load(path, topology=(4, 2))
    assert (cfg.ranks, cfg.devices_per_host, cfg.layout) == (4, 2, (1, 1, 1, 1))
    path.write_text("[pool]\nranks = 4\n[cluster]\nhosts = 2\n")
    with pytest.raises(ConfigError, match="learned from the agents"):
        load(path, topology=(4, 2))
    assert load_cluster(None) is None
    for bad in (dict(hosts=0), dict(listen="7700"), dict(heartbeat_s=5.0, agent_timeout_s=5.0)):
        with pytest.raises(ConfigError):
            ClusterConfig(secret=SECRET, **bad)  # type: ignore[arg-type]
