"""The hub's record of a node agent (``Agent``: its name, its connection, its
ranks) and the rule for which agent may join the pool (``refusal``). The registry
of agents, its lock and their connections are ``runtime/cluster/hub.py``'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vertumnus.runtime.cluster import channel
from vertumnus.runtime.cluster.channel import Hello


@dataclass
class Agent:
    name: str
    peer: bytes  # its ZeroMQ routing id; a new one when it reconnects
    devices: int
    device: str
    fd: int | None = None  # its connection's file descriptor (monitor events name it)
    first_rank: int | None = None  # given when every host has joined
    connected: bool = True
    last_seen_s: float = field(default_factory=time.monotonic)

    def ranks(self) -> range:
        assert self.first_rank is not None
        return range(self.first_rank, self.first_rank + self.devices)


def refusal(
    hello: Hello, known: Agent | None, agents: dict[str, Agent], hosts: int, engine_device: str
) -> str | None:
    """Why the agent that sent ``hello`` may not join a pool of ``hosts`` hosts
    that has ``agents`` (``known``: the one of its name, coming back); None: it may.
    Every host runs as many ranks, and GPU ranks need a GPU."""
    if hello.protocol != channel.PROTOCOL:
        return f"protocol {hello.protocol}; this coordinator speaks {channel.PROTOCOL}"
    if hello.devices < 1:
        return "an agent must run at least one rank"
    if known is None and len(agents) >= hosts:
        return f"the pool has its {hosts} hosts: {sorted(agents)}"
    devices = known.devices if known else next((a.devices for a in agents.values()), None)
    if devices is not None and hello.devices != devices:
        return f"{hello.devices} ranks; every host of this pool runs {devices}"
    if engine_device == "cuda" and hello.device != "cuda":
        return "[engine] device is cuda, and this host has no GPU"
    return None
