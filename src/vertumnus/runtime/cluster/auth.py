"""Whether a Ray cluster admits only holders of its token.

Ray runs whatever code anyone who reaches its ports sends it, unless it was started
with token authentication (``RAY_AUTH_MODE=token``; the token in ``RAY_AUTH_TOKEN``,
``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``). ``check_token_auth`` refuses a
pool on any other cluster: first this process must hold a token in token mode (a
client in token mode connects to an open cluster too, so that alone proves
nothing); then, once connected, a probe (a short-lived Python process with no token
and authentication off) connects to the cluster's GCS and must be turned away with
Ray's "Unauthenticated" answer. ``[cluster] private_network = true`` skips both, for
a cluster no one else can reach.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from vertumnus.config import ConfigError

HOW = (
    "start every Ray node with RAY_AUTH_MODE=token and the same token (RAY_AUTH_TOKEN, "
    "or `ray get-auth-token --generate` on the head and the file copied), export both "
    "here too, or set [cluster] private_network = true for a cluster that nothing "
    "else can reach (docs/multi-host.md)"
)

# The probe: connect without a token; a cluster that lets it in prints OPEN.
_PROBE = (
    "import sys, ray\n"
    "ray.init(address=sys.argv[1], log_to_driver=False, logging_level='error')\n"
    "print('OPEN', flush=True)\n"
)
_REFUSED = ("Unauthenticated", "InvalidAuthToken")


def has_token() -> bool:
    """This process is in token mode and holds a token."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return False
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    return Path(path).is_file()


def check_token_auth(address: str, probe: bool = False, timeout_s: float = 60.0) -> None:
    """Raise ConfigError unless this process holds a token (``probe``: and the
    cluster at ``address``, its GCS, turns a client without one away)."""
    if not has_token():
        raise ConfigError(
            "the Ray cluster must use token authentication, and this process has no "
            f"token (RAY_AUTH_MODE={os.environ.get('RAY_AUTH_MODE')!r}): {HOW}"
        )
    if probe:
        verdict = _probe(address, timeout_s)
        if verdict != "refused":
            raise ConfigError(
                f"the Ray cluster at {address} {verdict}: it must use token authentication: {HOW}"
            )


def _probe(address: str, timeout_s: float) -> str:
    """ "refused" when a client without a token is turned away; else what happened."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_TOKEN")}
    env["RAY_AUTH_MODE"] = "disabled"
    with tempfile.TemporaryDirectory(prefix="vertumnus-probe-") as home:
        env["HOME"] = home  # (no ~/.ray/auth_token to find)
        with subprocess.Popen(
            [sys.executable, "-c", _PROBE, address],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ) as proc:
            watchdog = threading.Timer(timeout_s, proc.kill)  # (a probe that hangs silent)
            watchdog.start()
            try:
                assert proc.stdout is not None
                for line in proc.stdout:  # (ends when the probe exits or is killed)
                    if any(word in line for word in _REFUSED):
                        return "refused"
                    if line.startswith("OPEN"):
                        return "let a client without a token in"
                return f"gave the probe no verdict within {timeout_s:g} s"
            finally:
                watchdog.cancel()
                proc.kill()
