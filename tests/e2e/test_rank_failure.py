"""Rank failures on the real server: a rank killed (SIGKILL) in the middle of a
prefill, and a rank that hangs (SIGSTOP, past ``step_timeout_s``). The worker leaves
the candidate set at once, its requests are answered elsewhere, exactly once and
with the right first token, its holder records leave the trie, and it is restarted
and rejoins with an empty cache."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from support.factories import make_tokens
from support.reference import make_checkpoint
from support.server import ADMIN_TOKEN, Server, running_server, write_serve_config

pytestmark = pytest.mark.multiproc


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[Server]:
    config = write_serve_config(
        tmp_path / "serve.toml",
        cache={"replication": False},
        engine={"rank_timeout_s": 60},
        server={"step_timeout_s": 4},
    )
    with running_server(config) as srv:
        yield srv


def first_token(server: Server, prompt: list[int]) -> int:
    status, body = server.call("POST", "/v1/prefill", {"token_ids": prompt})
    assert status == 200, body
    return int(body["first_token"])


def workers(server: Server) -> dict[int, dict]:  # type: ignore[type-arg]
    return {w["worker"]: w for w in server.call("GET", "/v1/workers")[1]["workers"]}


def wait_rejoined(server: Server, worker: int, old_pid: int, timeout_s: float = 60.0) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        w = workers(server)[worker]
        if w["state"] == "active" and not w["restarting"] and w["pids"][0] != old_pid:
            return w
        time.sleep(0.1)
    raise AssertionError(f"worker {worker} did not rejoin: {workers(server)[worker]}")


def run_killing(server: Server, sig: signal.Signals) -> None:
    prompts = [make_tokens(3000, seed=s, vocab=256) for s in range(12)]
    # Reference answers, and a cached prefix on each worker.
    expected = [first_token(server, p) for p in prompts]
    before = workers(server)
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(server.call, "POST", "/v1/prefill", {"token_ids": p}) for p in prompts
        ]
        # Strike the rank of whichever worker is busy.
        deadline = time.monotonic() + 10
        victim = None
        while victim is None and time.monotonic() < deadline:
            busy = [w for w in workers(server).values() if w["running"] is not None]
            if busy:
                victim = busy[0]
            else:
                time.sleep(0.005)
        assert victim is not None
        struck = time.monotonic()
        os.kill(victim["pids"][0], sig)
        # Out of the candidate set within a second (the hang: within step_timeout_s).
        limit = 1.0 if sig == signal.SIGKILL else 4.0 + 1.0
        while workers(server)[victim["worker"]]["state"] == "active":
            assert time.monotonic() - struck < limit, "the worker is still a candidate"
            time.sleep(0.02)
        answers = [f.result() for f in futures]
    # Every request answered once, correctly, though one worker died under it.
    assert [a[0] for a in answers] == [200] * len(prompts), answers
    assert [a[1]["first_token"] for a in answers] == expected
    ids = [a[1]["request_id"] for a in answers]
    assert len(set(ids)) == len(ids)
    assert before[victim["worker"]]["cached_blocks"] > 0
    back = wait_rejoined(server, victim["worker"], victim["pids"][0])
    # Back with an empty cache, and the trie holds nothing for it.
    assert back["cached_blocks"] == 0
    assert server.call("GET", "/v1/cache")[1]["holders"][str(victim["worker"])] == 0
    # It serves again, and right: a burst spreads over both workers.
    with ThreadPoolExecutor(4) as pool:
        again = list(
            pool.map(lambda p: server.call("POST", "/v1/prefill", {"token_ids": p}), prompts[:4])
        )
    assert [a[1]["first_token"] for a in again] == expected[:4]
    assert victim["worker"] in {a[1]["worker"] for a in again}
    health = server.call("GET", "/health")[1]
    assert health["status"] == "ok"
    metrics = server.call("GET", "/metrics")[1]
    assert "vertumnus_worker_restarts_total 1.0" in metrics


@pytest.mark.timeout(240)
def test_a_rank_killed_mid_prefill_loses_nothing(server: Server) -> None:
    run_killing(server, signal.SIGKILL)


@pytest.mark.timeout(240)
def test_a_hung_rank_is_restarted_after_the_step_timeout(server: Server) -> None:
    run_killing(server, signal.SIGSTOP)


@pytest.mark.timeout(240)
def test_a_rank_killed_while_its_worker_drains_for_a_merge(tmp_path: Path) -> None:
    config = write_serve_config(
        tmp_path / "serve.toml",
        cache={"replication": False},
        engine={"rank_timeout_s": 60},
        server={"step_timeout_s": 4, "admin_token": ADMIN_TOKEN},
    )
    with running_server(config) as server:
        prompts = [make_tokens(3000, seed=s, vocab=256) for s in range(10)]
        expected = [first_token(server, p) for p in prompts]
        with ThreadPoolExecutor(len(prompts) + 1) as pool:
            futures = [
                pool.submit(server.call, "POST", "/v1/prefill", {"token_ids": p}) for p in prompts
            ]
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # both workers busy
                ws = workers(server)
                if all(w["running"] is not None for w in ws.values()):
                    break
                time.sleep(0.005)
            merge = pool.submit(server.call, "POST", "/v1/admin/reconfigure", {"op": "merge"})
            while time.monotonic() < deadline:  # the merge drains
                ws = workers(server)
                if any(w["state"] == "draining" for w in ws.values()):
                    break
                time.sleep(0.002)
            victim = next(w for w in ws.values() if w["state"] == "draining")
            old_pids = {p for w in ws.values() for p in w["pids"]}
            os.kill(victim["pids"][0], signal.SIGKILL)
            status, merged = merge.result()
            answers = [f.result() for f in futures]
        # The merge completed, every request was answered once and right.
        # (Its one new worker had a dead rank: not a candidate until restarted.)
        assert status == 200 and merged["cp_degree"] == 2 and merged["composition"] == "-", merged
        assert [a[0] for a in answers] == [200] * len(prompts), answers
        assert [a[1]["first_token"] for a in answers] == expected
        ids = [a[1]["request_id"] for a in answers]
        assert len(set(ids)) == len(ids)
        # The merged worker had a dead rank: it restarts (both ranks) and serves.
        (new,) = merged["new_workers"]
        back = wait_rejoined(server, new, victim["pids"][0])
        assert back["cp_degree"] == 2 and not set(back["pids"]) & old_pids  # both restarted
        assert server.call("GET", "/v1/composition")[1]["composition"] == "1CP2"
        assert "vertumnus_worker_restarts_total 1.0" in server.call("GET", "/metrics")[1]
        # The requests that waited for it were served by it; so are these, right.
        assert [first_token(server, p) for p in prompts[:3]] == expected[:3]
        held = server.call("GET", "/v1/cache")[1]["holders"][str(new)]
        assert held == workers(server)[new]["cached_blocks"] > 0


@pytest.mark.timeout(240)
def test_a_failed_restart_is_retried_with_backoff(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "model", tie_word_embeddings=True)
    config = write_serve_config(
        tmp_path / "serve.toml",
        model={"name": str(ckpt.model_dir)},
        cache={"replication": False},
        engine={"rank_timeout_s": 60},
        server={"max_restart_attempts": 4},
    )
    log_path = tmp_path / "server.log"
    with running_server(config) as server:
        prompt = make_tokens(100, seed=5, vocab=256)
        expected = first_token(server, prompt)
        victim = workers(server)[0]
        weights = ckpt.model_dir / "model.safetensors"
        weights.rename(weights.with_suffix(".hidden"))  # the restart cannot load them
        os.kill(victim["pids"][0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while '"worker_restart_failed"' not in log_path.read_text():
            assert time.monotonic() < deadline, "the restart did not fail"
            time.sleep(0.1)
        # Meanwhile the other worker serves, right.
        assert first_token(server, prompt) == expected
        weights.with_suffix(".hidden").rename(weights)
        back = wait_rejoined(server, 0, victim["pids"][0])
        assert back["cached_blocks"] == 0
        assert first_token(server, prompt) == expected
    events = [
        json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")
    ]
    kinds = [e["event"] for e in events]
    assert kinds.count("worker_failed") == 1  # one failure, no crash loop
    failed = [e for e in events if e["event"] == "worker_restart_failed"]
    assert failed and failed[0]["attempt"] == 1 and failed[0]["retry_in_s"] == 2.0
    rejoined = [e for e in events if e["event"] == "worker_rejoined"]
    assert len(rejoined) == 1 and rejoined[0]["attempt"] == len(failed) + 1
