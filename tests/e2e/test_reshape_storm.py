"""A reshape storm on the real path: ``python -m vertumnus serve`` as users run it
(the adaptive pool with its local decode process, two CPU ranks), merges and splits
every second or two through the admin API and through the controller (the paper's
rules with thresholds that make it move at every window), under mixed traffic:
prefill-only requests, completions of 2-32 tokens (non-streamed and streamed),
streams the client abandons after the first event, and hand-offs asked for
directly whose leases are pulled, released, or left to expire.

This path once wedged the pool for good after one reshape: a hand-off's
prefill that ended a drain looked up its merged-away worker (``KeyError``), the
switch never reached the ranks, and every later request timed out.

It checks that every request is answered once, as it should be (200, with the
tokens asked for); every admin reshape answers 200 or 409 (another is under way),
never a timeout; the controller moved too; in the end every worker is active, no
lease, pin or row is left, nothing was logged as a bug, and every 503 of ``/ready``
named its reason."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from support.factories import make_tokens
from support.server import ADMIN_TOKEN, Server, running_server, write_serve_config

pytestmark = pytest.mark.multiproc

STORM_S = 40.0
SECRET = "storm-handoff-secret-0123456789"
# A contained bug is logged with "bug": true; a reshape that needed its bound says so.
BUG_MARKS = ('"bug":true', '"event":"reshape_rolled_back"', '"event":"reshape_forced"')
READY_REASONS = ("no worker can take requests now", "reshape_timeout_s", "decode process")


def call(server: Server, method: str, path: str, body: Any = None, timeout: float = 150) -> Any:
    """(status, JSON or bytes)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if path.startswith("/v1/admin/"):
        req.add_header("Authorization", f"Bearer {ADMIN_TOKEN}")
    if path.startswith("/v1/kv/"):
        req.add_header("Authorization", f"Bearer {SECRET}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status, ctype = resp.read(), resp.status, resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        raw, status, ctype = err.read(), err.code, err.headers.get("Content-Type", "")
    return status, json.loads(raw) if "json" in ctype else raw


def stream(server: Server, body: dict[str, Any], abandon: bool) -> tuple[int, list[int], bool]:
    """(status, token ids, saw [DONE]) of a streamed completion; ``abandon``: close
    the connection after the first event."""
    req = urllib.request.Request(
        server.url + "/v1/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    ids: list[int] = []
    try:
        with urllib.request.urlopen(req, timeout=150) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    return resp.status, ids, True
                event = json.loads(data)
                assert "error" not in event, event
                ids += event["choices"][0].get("token_ids", [])
                if abandon:
                    return resp.status, ids, False
            return resp.status, ids, False
    except urllib.error.HTTPError as err:
        return err.code, ids, False


def kinds_of(records: list[dict[str, Any]]) -> set[str]:
    return {r["kind"] for r in records}


def decisions_in(log: str) -> list[dict[str, Any]]:
    """The controller's logged decisions."""
    return [json.loads(line) for line in log.splitlines() if '"event":"decision"' in line]


def client(server: Server, seed: int, stop: threading.Event, out: list[dict[str, Any]]) -> None:
    rng = random.Random(seed)
    n = 0
    while not stop.is_set():
        n += 1
        kind = rng.choice(("prefill", "complete", "stream", "abandon", "handoff"))
        tokens = make_tokens(rng.randrange(64, 1024), seed=seed * 10_000 + n % 40)
        max_tokens = rng.randrange(2, 33)
        record: dict[str, Any] = {"kind": kind, "sent_s": time.monotonic()}
        if kind == "prefill":
            record["status"], _ = call(server, "POST", "/v1/prefill", {"token_ids": tokens})
        elif kind == "complete":
            body = {"prompt": tokens, "max_tokens": max_tokens, "ignore_eos": True}
            record["status"], answer = call(server, "POST", "/v1/completions", body)
            ok = record["status"] == 200
            record["tokens_ok"] = ok and len(answer["choices"][0]["token_ids"]) == max_tokens
        elif kind in ("stream", "abandon"):
            body = {"prompt": tokens, "max_tokens": max_tokens, "ignore_eos": True}
            record["status"], ids, done = stream(server, body, abandon=kind == "abandon")
            record["tokens_ok"] = kind == "abandon" or (done and len(ids) == max_tokens)
        else:
            body = {"token_ids": tokens, "kv_transfer_params": {"do_remote_decode": True}}
            record["status"], answer = call(server, "POST", "/v1/prefill", body)
            fate = rng.choice(("pull", "release", "expire"))
            record["fate"] = fate
            if record["status"] == 200 and fate != "expire":
                handle = answer["kv_transfer_params"]["remote_handle"]
                method = "GET" if fate == "pull" else "DELETE"
                record["fate_status"], _ = call(server, method, f"/v1/kv/{handle}")
        record["took_s"] = time.monotonic() - record["sent_s"]
        out.append(record)


def operator(server: Server, stop: threading.Event, out: list[tuple[str, int, Any]]) -> None:
    ops = ("merge", "split")
    k = 0
    while not stop.wait(1.5):
        op = ops[k % 2]
        k += 1
        status, body = call(server, "POST", "/v1/admin/reconfigure", {"op": op}, timeout=200)
        out.append((op, status, body))


def watch_ready(server: Server, stop: threading.Event, out: list[tuple[int, Any]]) -> None:
    while not stop.wait(0.1):
        out.append(call(server, "GET", "/ready", timeout=30))


@pytest.mark.timeout(400)
def test_a_reshape_storm_under_decode_traffic(tmp_path: Path) -> None:
    config = write_serve_config(
        tmp_path / "serve.toml",
        server={"admin_token": ADMIN_TOKEN, "request_timeout_s": 120},
        # The controller moves at every 2-s window: split when any work came, merge
        # when none did (the clients pause now and then).
        controller={
            "enabled": True,
            "mode": "rules",
            "window_s": 2.0,
            "upper_fraction": 0.002,
            "lower_fraction": 0.001,
            "merge_after_windows": 1,
        },
        decode={"local": True, "restart_s": 0.2},
        handoff={"lease_s": 3.0, "reshape_wait_s": 1.0, "secret": SECRET},
    )
    records: list[dict[str, Any]] = []
    reshapes: list[tuple[str, int, Any]] = []
    readiness: list[tuple[int, Any]] = []
    with running_server(config) as server:
        stop = threading.Event()
        threads = [
            threading.Thread(target=client, args=(server, seed, stop, records)) for seed in range(3)
        ]
        threads.append(threading.Thread(target=operator, args=(server, stop, reshapes)))
        threads.append(threading.Thread(target=watch_ready, args=(server, stop, readiness)))
        for t in threads:
            t.start()
        time.sleep(STORM_S)
        stop.set()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a client hung"
        time.sleep(5.0)  # past every lease left to expire (3 s)
        status, workers = call(server, "GET", "/v1/workers")
        assert status == 200
        states = [w["state"] for w in workers["workers"]]
        status, view = call(server, "GET", "/v1/handoffs")
        status_ready, ready = call(server, "GET", "/ready")
        _, metrics = call(server, "GET", "/metrics")
    log = (tmp_path / "server.log").read_text()

    summary = {
        "requests": len(records),
        "by_kind": {k: sum(r["kind"] == k for r in records) for k in sorted(kinds_of(records))},
        "admin_reshapes": [s for _, s, _ in reshapes].count(200),
        "admin_conflicts": [s for _, s, _ in reshapes].count(409),
        "controller_reshapes": sum(len(d.get("ops", [])) for d in decisions_in(log)),
        "reshapes_done": log.count('"reshape_done"'),
        "ready_503": sum(s != 200 for s, _ in readiness),
        "ready_samples": len(readiness),
        "slowest_s": round(max(r["took_s"] for r in records), 3),
    }
    (tmp_path / "storm.json").write_text(json.dumps(summary, indent=1))
    print("storm:", json.dumps(summary))
    kinds = {r["kind"] for r in records}
    assert kinds == {"prefill", "complete", "stream", "abandon", "handoff"}, kinds
    failed = [r for r in records if r["status"] != 200 or not r.get("tokens_ok", True)]
    assert not failed, failed[:5]
    fates = [r.get("fate_status") for r in records if r.get("fate") in ("pull", "release")]
    assert all(s == 200 for s in fates), fates
    assert max(r["took_s"] for r in records) < 120
    done = [r for r in reshapes if r[1] == 200]
    assert done and all(s in (200, 409) for _, s, _ in reshapes), reshapes
    moved = [d for d in decisions_in(log) if d.get("ops")]
    assert moved, "the controller never reshaped"
    assert set(states) == {"active"}, workers
    assert (view["open"], view["pinned_blocks"], view["held_rows"]) == (0, 0, 0), view
    assert status_ready == 200, ready
    for status, body in readiness:
        if status != 200:
            reason = body["error"]["message"]
            assert any(r in reason for r in READY_REASONS), reason
    counted = [
        line for line in metrics.decode().splitlines() if line.startswith("vertumnus_internal_")
    ]
    assert not counted, counted
    bugs = [line for line in log.splitlines() if any(b in line for b in BUG_MARKS)]
    assert not bugs, bugs[:3]
    assert "Traceback" not in log
