"""The benchmark clients of the lane, and what each one's result files say.

A run is one client on one endpoint: ``aiperf-chat`` (aiperf's default endpoint,
``chat``, streamed), ``aiperf-completions``, ``guidellm-chat`` (guidellm's default
request format, ``/v1/chat/completions``, streamed) and ``guidellm-completions``.
Each runs from its own virtual environment (``tools/clients/setup.sh``) with a
fixed number of requests, short prompts and outputs, the model folder's tokenizer
(no download) and its results in a folder of its own. ``read_outcome`` reads them: the
requests that completed, those that failed (aiperf's per-request records, guidellm's
``request_totals``), and the first few distinct error messages. Neither client
exits non-zero on failed requests alone (aiperf does when every request failed),
so the result files, not the exit status, say whether a run passed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 32
OUTPUT_TOKENS = 16
MAX_MESSAGES = 3  # distinct error messages kept per run


@dataclass(frozen=True)
class Load:
    """What every run asks of the server."""

    url: str
    model: str  # the served model's id, as /v1/models gives it
    tokenizer: Path  # the model folder
    requests: int
    concurrency: int  # aiperf's; guidellm runs synchronous (one at a time)


@dataclass(frozen=True)
class Run:
    name: str
    client: str  # "aiperf" or "guidellm"
    path: str  # the endpoint it sends to

    def command(self, venvs: Path, load: Load, out: Path) -> list[str]:
        binary = str(venvs / self.client / "bin" / self.client)
        if self.client == "aiperf":
            return [binary, *_aiperf_args(self, load, out)]
        return [binary, *_guidellm_args(self, load, out)]

    def env(self, out: Path) -> dict[str, str]:
        """The client's environment: a Hugging Face cache of its own, offline. aiperf
        0.13.0 with ``HF_HUB_OFFLINE`` set looks a local tokenizer folder up in the
        hub cache and fails (HFValidationError), so it runs without; given a local
        path it reads the folder and asks the hub nothing."""
        env = {**os.environ, "HF_HOME": str(out / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1"}
        env.pop("HF_HUB_OFFLINE", None)
        env.pop("TRANSFORMERS_OFFLINE", None)
        if self.client == "guidellm":
            env["HF_HUB_OFFLINE"] = "1"
        return env


RUNS = {
    r.name: r
    for r in (
        Run("aiperf-chat", "aiperf", "/v1/chat/completions"),
        Run("aiperf-completions", "aiperf", "/v1/completions"),
        Run("guidellm-chat", "guidellm", "/v1/chat/completions"),
        Run("guidellm-completions", "guidellm", "/v1/completions"),
    )
}


def _aiperf_args(run: Run, load: Load, out: Path) -> list[str]:
    args = [
        "profile",
        "--model", load.model,
        "--tokenizer", str(load.tokenizer),
        "--url", load.url,
        "--streaming",
        "--request-count", str(load.requests),
        "--concurrency", str(load.concurrency),
        "--isl", str(PROMPT_TOKENS),
        "--osl", str(OUTPUT_TOKENS),
        "--random-seed", "0",
        # The requested output length, as benchmark runs ask for it (guidellm sends
        # it by itself): a random model's first sampled token is its end of text
        # about once in 512, and an empty answer counts as the client's error.
        "--extra-inputs", "ignore_eos:true",
        "--ui", "none",
        "--no-gpu-telemetry",
        "--artifact-dir", str(out),
    ]  # fmt: skip
    if run.path == "/v1/completions":
        args += ["--endpoint-type", "completions"]
    return args


def _guidellm_args(run: Run, load: Load, out: Path) -> list[str]:
    backend = f"kind=openai_http,target={load.url}"
    if run.path != "/v1/chat/completions":
        backend += f",request_format={run.path}"
    return [
        "run",
        "--backend", backend,
        "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={load.requests}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=huggingface_auto,model={load.tokenizer}",
        "--output", f"kind=json,path={out / 'benchmarks.json'}",
        "--disable-console-interactive",
    ]  # fmt: skip


@dataclass
class Outcome:
    """One run's result: ``completed`` and ``errors`` as the client's files count
    them (None where it wrote none), its exit status and the first errors."""

    run: str
    path: str
    expected: int
    exit_code: int | None  # None: killed at its time limit
    completed: int | None = None
    errors: int | None = None
    messages: list[str] = field(default_factory=list)
    seconds: float = 0.0
    endpoint_served: bool = True  # False: the server has no such route (a 404)

    @property
    def passed(self) -> bool:
        return self.exit_code == 0 and self.errors == 0 and self.completed == self.expected


def _keep(messages: list[str], message: str) -> None:
    message = " ".join(message.split())[:300]
    if message not in messages and len(messages) < MAX_MESSAGES:
        messages.append(message)


def read_aiperf(out: Path, outcome: Outcome) -> None:
    """Per-request records (``profile_export.jsonl``): a record with an ``error``
    failed. Written also when every request failed, unlike the summary."""
    records = out / "profile_export.jsonl"
    if not records.is_file():
        return
    outcome.completed = outcome.errors = 0
    for line in records.read_text().splitlines():
        record: dict[str, Any] = json.loads(line)
        if record.get("error"):
            outcome.errors += 1
            err = record["error"]
            _keep(outcome.messages, f"{err.get('code')} {err.get('type')}: {err.get('message')}")
        else:
            outcome.completed += 1
    summary = out / "profile_export_aiperf.json"
    if summary.is_file() and json.loads(summary.read_text()).get("was_cancelled"):
        _keep(outcome.messages, "aiperf: the run was cancelled")
        outcome.errors += 1


def read_guidellm(out: Path, outcome: Outcome) -> None:
    """``benchmarks.json``: each benchmark's ``request_totals``; an incomplete
    request counts as an error."""
    report = out / "benchmarks.json"
    if not report.is_file():
        return
    outcome.completed = outcome.errors = 0
    for bench in json.loads(report.read_text())["benchmarks"]:
        totals = bench["metrics"]["request_totals"]
        outcome.completed += int(totals["successful"])
        outcome.errors += int(totals["errored"]) + int(totals["incomplete"])
        for request in (bench.get("requests") or {}).get("errored") or []:
            _keep(outcome.messages, str((request.get("info") or {}).get("error")))


def read_outcome(run: Run, out: Path, outcome: Outcome) -> None:
    (read_aiperf if run.client == "aiperf" else read_guidellm)(out, outcome)
