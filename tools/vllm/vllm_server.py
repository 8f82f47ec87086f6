"""Start and stop ``vllm serve`` from ``.venv-vllm`` (``tools/vllm/setup.sh``) for the
interop tests and the benchmark against vLLM: fp32, on a free port, alone (prefix
caching on or off) or with ``VertumnusConnector`` as the decode role."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
CONNECTOR = {
    "kv_connector": "VertumnusConnector",
    "kv_connector_module_path": "vertumnus.integrations.vllm",
    "kv_role": "kv_consumer",
    "kv_load_failure_policy": "recompute",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_vllm(
    folder: Path,
    log: IO[Any],
    *,
    connector: bool,
    prefix_caching: bool,
    prefill_key: str | None = None,
    timeout_s: float = 420.0,
    dtype: str = "float32",
    max_model_len: int = 4096,
) -> tuple[subprocess.Popen[bytes], str]:
    """(process, base URL) of a ready ``vllm serve`` of ``folder`` (served under the
    folder's path, as ``vertumnus serve`` names it)."""
    port = free_port()
    command = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.cli.main", "serve", str(folder),
        "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
        "--served-model-name", str(folder),
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip
    if connector:
        command += ["--kv-transfer-config", json.dumps(CONNECTOR)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    if prefill_key is not None:
        env["VERTUMNUS_PREFILL_KEY"] = prefill_key
    proc = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"vllm serve exited {proc.returncode}; the end of {log.name}:\n{_tail(log)}"
            )
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(1.0)
    stop(proc)
    raise RuntimeError(
        f"vllm serve did not start in {timeout_s:.0f} s; the end of {log.name}:\n{_tail(log)}"
    )


def _tail(log: IO[Any], lines: int = 15) -> str:
    """The last lines of the log vLLM writes (so that a failure in CI shows its cause)."""
    log.flush()
    try:
        text = Path(log.name).read_text(errors="replace")
    except OSError as exc:
        return f"(unreadable: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to its process group (its engine core and workers), then SIGKILL."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
