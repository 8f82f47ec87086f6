"""A property-based fuzz run of the whole REST API, from its own ``/openapi.json``,
by schemathesis: no input, valid or not, gets a 5xx, and the server keeps serving
(admin calls included, with the token: the fuzzer's reshapes run for real)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support.server import ADMIN_TOKEN, running_server, write_serve_config

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(300)
def test_no_input_gets_a_server_error(tmp_path: Path) -> None:
    # One bearer for every route: the admin token is also the API key (which the KV
    # pull takes too), so the fuzzer reaches every operation.
    server = {"admin_token": ADMIN_TOKEN, "api_key": ADMIN_TOKEN}
    config = write_serve_config(tmp_path / "serve.toml", server=server)
    with running_server(config) as server:
        run = subprocess.run(
            [
                str(Path(sys.executable).with_name("schemathesis")),
                "run",
                f"{server.url}/openapi.json",
                "--checks",
                "not_a_server_error",
                "--max-examples",
                "25",
                "--seed",
                "7",
                "--header",
                f"Authorization: Bearer {ADMIN_TOKEN}",
                "--request-timeout",
                "60",
                # Every warning but one: random KV handles are unknown (404) by design.
                "--warnings",
                "missing_auth,base_url_mismatch,validation_mismatch,missing_deserializer",
            ],
            capture_output=True,
            text=True,
            timeout=240,
            cwd=tmp_path,  # its .schemathesis cache stays out of the repository
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
        assert "No issues found" in run.stdout
        status, health = server.call("GET", "/health")
        assert status == 200 and health["rank_error"] is None
    log = (tmp_path / "server.log").read_text()
    assert "internal_error" not in log
    assert log.count('"event":"prefill"') > 0  # it did reach the ranks
