"""The package works once installed, away from a source checkout.

The wheel is built from a copy of the project's sources and installed (no
dependencies: they come from the test venv's site-packages, on the path of the new
venv through a ``.pth`` line) into a fresh virtual environment. Then, from an empty
folder elsewhere, the three commands the README promises run on their embedded
defaults, whose profiles are package data: ``prefill --check``, ``simulate`` and
``serve`` (started, asked for a prefill, stopped)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The python of a fresh venv with the built wheel installed."""
    root = tmp_path_factory.mktemp("installed")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(
        REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    wheels = root / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    subprocess.run([*build, "-q", "-w", str(wheels), str(source)], check=True, timeout=300)
    (wheel,) = wheels.glob("vertumnus-*.whl")
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)  # ensurepip: offline
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    pip = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    subprocess.run([*pip, str(wheel)], check=True, timeout=300)
    # The dependencies: the test venv's own, after the new venv's (a plain path, so
    # the test venv's editable install of vertumnus is not picked up); written after
    # the install, so that pip sees nothing of the test venv.
    (site / "test-venv-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    yield python


def run(python: Path, cwd: Path, *args: str, timeout: float = 240) -> str:
    result = subprocess.run(
        [str(python), "-m", "vertumnus", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.timeout(600)
def test_the_installed_package_runs_its_commands_from_anywhere(
    installed: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run(
        [str(installed), "-c", "import vertumnus; print(vertumnus.__file__)"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert where.startswith(str(installed.parents[1])), where  # not the source checkout
    script = installed.parent / "vertumnus"
    assert (
        "prefill"
        in subprocess.run(
            [str(script), "--help"], capture_output=True, text=True, check=True
        ).stdout
    )

    out = run(installed, elsewhere, "prefill", "--model", "tiny", "--cp", "2", "--dtype", "float32",
              "--prompt-len", "512", "--check")  # fmt: skip
    prefill = json.loads(out)
    assert prefill["cp_degree"] == 2 and prefill["max_abs_diff"] < 1e-4

    trace = elsewhere / "trace.jsonl"
    lines = []
    for i in range(40):
        ids = [0, *range(100 * i + 1, 100 * i + 1 + 3 + i % 5)]
        lines.append({"timestamp": 400 * i, "input_length": 512 * len(ids) - 7, "hash_ids": ids})
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = run(installed, elsewhere, "simulate", "--trace", str(trace), "--out", "sim")
    summary = json.loads((elsewhere / "sim" / "summary.json").read_text())
    assert summary["completed"] == 40 and summary["devices"] == 40, out

    proc = subprocess.Popen(
        [str(installed), "-m", "vertumnus", "serve", "--port", "0"],
        cwd=elsewhere,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("vertumnus listening on "), line
        url = line.split()[-1]
        body = json.dumps({"token_ids": list(range(1, 40))}).encode()
        request = urllib.request.Request(
            url + "/v1/prefill", body, {"Content-Type": "application/json"}
        )
        for _ in range(600):  # ready once every rank has started
            try:
                with urllib.request.urlopen(url + "/ready", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, "the server exited"
            time.sleep(0.2)
        with urllib.request.urlopen(request, timeout=60) as resp:
            answer = json.loads(resp.read())
        assert answer["cp_degree"] in (1, 2) and "first_token" in answer
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
