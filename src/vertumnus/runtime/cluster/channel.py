"""The control channel between the coordinator and its node agents (ZeroMQ).

Owns the messages that cross it, their wire form, and the sockets' security. It
does not own what either side does with a message (``runtime/cluster/ranks.py``: the
coordinator's side; ``runtime/cluster/agent.py``: a host's).

    agent  --Hello / Heartbeat / Spawned / FromRank / RankExited-->  coordinator
    coordinator  --Welcome / Refused / Heartbeat / Spawn / ToRank / Kill / Stop-->  agent

The coordinator binds a ROUTER socket; each agent connects a DEALER. A frame set is
``[mac, header, payload]``: the header is the message dataclass as JSON (orjson,
with its type's name), the payload opaque bytes (a rank command or answer as the
rank protocol pickles it, or a ``Spawn``'s ``RankSpec``), and the mac an
HMAC-SHA256 over both with a key derived from the cluster secret. A frame set whose
mac does not verify is dropped before anything is parsed, so nothing is unpickled
that a holder of the secret did not send. The connection is also encrypted with
CurveZMQ: the server's key pair is derived from the same secret, each agent uses a
fresh one, so a captured session cannot be replayed into another.

The secret comes from ``$VERTUMNUS_CLUSTER_SECRET`` (or ``[cluster] secret``), at
least 16 characters, the same on every host. torch.distributed's own TCP store and
gloo/NCCL connections carry no authentication: keep the pool on a private network.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

import orjson
import zmq
import zmq.utils.z85

PROTOCOL = 1
SECRET_ENV = "VERTUMNUS_CLUSTER_SECRET"


class ControlError(RuntimeError):
    """A malformed or unauthenticated frame, or a peer that speaks another protocol."""


# -- messages ------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """An agent's first message: who it is and what its host has."""

    name: str  # unique per host in the pool (default: the host name)
    devices: int  # rank processes this host runs (one per GPU)
    device: str  # "cuda" or "cpu"
    pid: int
    protocol: int = PROTOCOL


@dataclass(frozen=True)
class Welcome:
    """The agent's place in the pool: global ranks ``first_rank ..`` ``+ devices``."""

    first_rank: int
    world_size: int
    heartbeat_s: float
    timeout_s: float  # silence after which either side counts the other as gone


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass(frozen=True)
class Heartbeat:
    pass


@dataclass(frozen=True)
class Spawn:
    """Start (or restart: the old processes are killed first) these ranks; the
    payload is their ``RankSpec`` pickled (the agent fills in its store host)."""

    ranks: tuple[int, ...]
    incarnations: tuple[int, ...]  # per rank: how many times it was restarted


@dataclass(frozen=True)
class Spawned:
    rank: int
    incarnation: int
    pid: int


@dataclass(frozen=True)
class Kill:
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class ToRank:
    """The payload is a rank command as ``multiprocessing`` pickles it."""

    rank: int


@dataclass(frozen=True)
class FromRank:
    """The payload is a rank's answer as it wrote it on its answer pipe; answers of
    an earlier incarnation of the rank are dropped."""

    rank: int
    incarnation: int


@dataclass(frozen=True)
class RankExited:
    rank: int
    incarnation: int
    exitcode: int | None


@dataclass(frozen=True)
class Stop:
    """The coordinator closes: stop the ranks and exit."""


MESSAGES: dict[str, type[Any]] = {
    cls.__name__: cls
    for cls in (
        Hello,
        Welcome,
        Refused,
        Heartbeat,
        Spawn,
        Spawned,
        Kill,
        ToRank,
        FromRank,
        RankExited,
        Stop,
    )
}


# -- wire form -----------------------------------------------------------------------


class Keys:
    """Everything derived from the cluster secret."""

    def __init__(self, secret: str) -> None:
        if not isinstance(secret, str) or len(secret) < 16:
            raise ControlError(
                f"the cluster secret (${SECRET_ENV} or [cluster] secret) must be at least "
                "16 characters"
            )
        raw = secret.encode()
        self.mac_key = hashlib.sha256(b"vertumnus/mac/" + raw).digest()
        seed = hashlib.sha256(b"vertumnus/curve/" + raw).digest()
        self.server_secret = zmq.utils.z85.encode(seed)
        self.server_public = zmq.curve_public(self.server_secret)

    def __repr__(self) -> str:
        return "Keys(<secret>)"


def _mac(keys: Keys, header: bytes, payload: bytes) -> bytes:
    h = hmac.new(keys.mac_key, len(header).to_bytes(8, "big"), hashlib.sha256)
    h.update(header)
    h.update(payload)
    return h.digest()


def encode(keys: Keys, msg: object, payload: bytes = b"") -> list[bytes]:
    name = type(msg).__name__
    if name not in MESSAGES:
        raise TypeError(f"not a control message: {name}")
    header = orjson.dumps({"type": name, **dataclasses.asdict(msg)})  # type: ignore[call-overload]
    return [_mac(keys, header, payload), header, payload]


def decode(keys: Keys, frames: list[bytes]) -> tuple[object, bytes]:
    """The message and its payload; ControlError if the frames are not a message
    signed with this secret (checked before anything is parsed)."""
    if len(frames) != 3:
        raise ControlError(f"expected 3 frames, got {len(frames)}")
    mac, header, payload = frames
    if not hmac.compare_digest(mac, _mac(keys, header, payload)):
        raise ControlError("bad signature (a peer with another secret?)")
    try:
        fields = orjson.loads(header)
        cls = MESSAGES[fields.pop("type")]
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
        return cls(**values), payload
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise ControlError(f"malformed message: {exc}") from exc


# -- sockets ---------------------------------------------------------------------------


def server_socket(ctx: zmq.Context[Any], keys: Keys, address: str) -> zmq.Socket[Any]:
    """The coordinator's ROUTER, bound to ``address`` (``host:port``; port 0: any
    free one). Watch ``monitor(sock)`` to see an agent's connection drop at once."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone peer raises
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    host, _, port = address.rpartition(":")
    if port == "0":
        sock.bind_to_random_port(f"tcp://{host}")
    else:
        sock.bind(f"tcp://{host}:{port}")
    return sock


def monitor(sock: zmq.Socket[Any]) -> zmq.Socket[Any]:
    """A socket that receives the ROUTER's disconnect events; each names the file
    descriptor of the connection (``disconnected_fd``), which a message received
    with ``copy=False`` also carries (``frame.get(zmq.SRCFD)``). (libzmq's
    ROUTER_NOTIFY would name the peer, but it is a draft API that pyzmq's wheels
    leave out.)"""
    mon: zmq.Socket[Any] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    return mon


def disconnected_fd(mon: zmq.Socket[Any]) -> int | None:
    """The connection that a monitor event says dropped, or None (another event)."""
    from zmq.utils.monitor import recv_monitor_message

    event = recv_monitor_message(mon, zmq.NOBLOCK)
    if int(event["event"]) != zmq.EVENT_DISCONNECTED:
        return None
    return int(event["value"])


def bound_port(sock: zmq.Socket[Any]) -> int:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return int(endpoint.decode().rpartition(":")[2])


def client_socket(ctx: zmq.Context[Any], keys: Keys, address: str) -> zmq.Socket[Any]:
    """An agent's DEALER, connecting to the coordinator at ``address``."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    public, secret = zmq.curve_keypair()
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.connect(f"tcp://{address}")
    return sock


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port), with a clear error."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ControlError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)
