"""``serve``'s log lines are JSON, and a contained bug's (``Metrics.bug``) carries
its traceback and the ``bug`` mark that soaks and tests look for (it once said:
``worker_loop_crashed`` with ``"exc_info": true`` and nothing more)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiproc

SCRIPT = """
import structlog
from vertumnus.cli.serve import configure_logging
from vertumnus.runtime.metrics import Metrics
configure_logging()
try:
    {}["missing"]
except KeyError as exc:
    Metrics().bug("worker_step", "worker_step_failed", exc, worker=2)
structlog.get_logger("vertumnus").info("after", n=1)
"""


@pytest.mark.timeout(60)
def test_a_logged_exception_carries_its_traceback() -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=50)
    assert run.returncode == 0, run.stderr
    failed, after = (json.loads(line) for line in run.stderr.splitlines())
    assert failed["event"] == "worker_step_failed" and failed["level"] == "error"
    assert failed["bug"] is True and failed["where"] == "worker_step" and failed["worker"] == 2
    assert "Traceback (most recent call last)" in failed["exception"]
    assert "KeyError: 'missing'" in failed["exception"]
    assert (after["event"], after["n"]) == ("after", 1) and "exception" not in after
