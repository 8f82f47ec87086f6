"""``python -m vertumnus agent``: removed. Pools across hosts run their ranks as Ray
actors: start Ray on every host (``ray start --head`` on one, ``ray start
--address HEAD:PORT`` on the others, with ``RAY_AUTH_MODE=token`` and the same
token) and give ``serve`` a ``[cluster]`` table with ``engine = "ray"``
(docs/multi-host.md). The command stays only to say so, and exits 2.
"""

from __future__ import annotations

import argparse

from vertumnus.config import ConfigError

INSTEAD = (
    "`vertumnus agent` was removed: pools across hosts run on Ray. On every host run "
    "`ray start` (--head on one, --address HEAD:6379 on the others) with "
    "RAY_AUTH_MODE=token and the same RAY_AUTH_TOKEN, and give serve a [cluster] table "
    'with engine = "ray" and hosts = N (docs/multi-host.md)'
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    # What the removed command took, so that an old command line gets the message
    # below rather than a usage error.
    for flag in ("--coordinator", "--name", "--devices"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    p.add_argument("old", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    raise ConfigError(INSTEAD)
