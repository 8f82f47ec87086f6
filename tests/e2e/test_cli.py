"""``python -m vertumnus prefill`` as a user runs it: a subprocess.

Good runs print exactly one JSON object on stdout; bad input exits 2 with one clear
line on stderr and no traceback, before any rank starts; a rank that cannot start
exits 1, also with one line. Every CLI run gets a session of its own, so that the
module can check that no process of any run (its ranks included) outlived it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from support.factories import TINY, engine_config, make_tokens
from support.processes import pids_in_session
from support.reference import (
    ATOL,
    VOCAB,
    Checkpoint,
    drop_tensor,
    hf_logits,
    make_checkpoint,
    max_abs_diff,
)
from vertumnus.runtime.prefill import PrefillClient
from vertumnus.runtime.ranks import ChildRanks

# Every test here starts a process (the CLI), most of them rank processes too.
pytestmark = pytest.mark.multiproc

CLI_TIMEOUT_S = 90.0
_sessions: list[int] = []  # session ids of every CLI run of this module


def run_cli(*args: str, timeout_s: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run the CLI in a new session; on time-out, kill the whole session (its ranks too)."""
    cmd = [sys.executable, "-m", "vertumnus", *args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    _sessions.append(proc.pid)  # a session leader's sid is its pid
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module", autouse=True)
def _no_leftover_cli_processes(no_leftover_ranks: None) -> Iterator[None]:
    """No process of any CLI run outlives the module; then ``no_leftover_ranks``
    checks the rank processes the module started itself."""
    yield
    # A CLI's helpers (multiprocessing's resource tracker) exit just after it does:
    # give them a few seconds before calling anything a leftover.
    deadline = time.monotonic() + 5.0
    while True:
        leftover = {sid: pids_in_session(sid) for sid in _sessions}
        leftover = {sid: pids for sid, pids in leftover.items() if pids}
        if not leftover or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for sid in leftover:
        os.killpg(sid, signal.SIGKILL)
    assert leftover == {}, "CLI processes outlived their run"


def one_json_object(result: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    obj = json.loads(lines[0])
    assert isinstance(obj, dict)
    return obj


def assert_one_line_error(
    result: subprocess.CompletedProcess[str], returncode: int, message: str
) -> None:
    assert result.returncode == returncode, (result.returncode, result.stderr)
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines == [f"vertumnus prefill: error: {message}"]


@pytest.mark.timeout(120)
def test_prefill_prints_json_and_dumps_logits(tmp_path: Path) -> None:
    out_file = tmp_path / "OUT.npy"
    result = one_json_object(
        run_cli(
            "prefill",
            "--dtype",
            "float32",
            "--model",
            "tiny",
            "--cp",
            "2",
            "--prompt-len",
            "100",
            "--prefix-len",
            "40",
            "--check",
            "--dump-logits",
            str(out_file),
        )
    )
    assert set(result) == {
        "model",
        "cp_degree",
        "device",
        "prompt_tokens",
        "block_size",
        "cached_tokens",
        "computed_tokens",
        "first_token",
        "prefill_s",
        "prefix_prefill_s",
        "collectives_per_rank",
        "logits_file",
        "max_abs_diff",
    }
    assert (result["model"], result["cp_degree"], result["device"]) == ("tiny", 2, "cpu")
    assert (result["prompt_tokens"], result["block_size"]) == (100, 16)
    assert (result["cached_tokens"], result["computed_tokens"]) == (32, 68)
    assert type(result["first_token"]) is int
    assert 0 <= result["first_token"] < TINY.vocab_size
    for key in ("prefill_s", "prefix_prefill_s"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["collectives_per_rank"] == {"kv": TINY.num_hidden_layers, "out": 1}
    assert isinstance(result["max_abs_diff"], float) and result["max_abs_diff"] < 1e-4
    assert result["logits_file"] == str(out_file)
    logits = np.load(out_file)
    assert logits.shape == (68, TINY.vocab_size)
    assert logits.dtype == np.float32
    assert int(logits[-1].argmax()) == result["first_token"]


@pytest.mark.timeout(120)
def test_tokens_file_matches_the_api(tmp_path: Path) -> None:
    tokens = make_tokens(75, seed=31, vocab=TINY.vocab_size)
    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text(json.dumps(tokens))
    out_file = tmp_path / "logits"  # written under exactly this name
    result = one_json_object(
        run_cli(
            "prefill",
            "--dtype",
            "float32",
            "--model",
            "tiny",
            "--cp",
            "2",
            "--tokens-file",
            str(tokens_file),
            "--dump-logits",
            str(out_file),
        )
    )
    assert (result["prompt_tokens"], result["cached_tokens"], result["computed_tokens"]) == (
        75,
        0,
        75,
    )
    assert result["prefix_prefill_s"] is None
    with ChildRanks(TINY, None, engine_config(seed=0), world_size=1, degrees=[1]) as pool:
        api = PrefillClient(pool, (0,)).prefill(tokens, logits="all")
    assert result["first_token"] == api.first_token
    cli_logits = torch.from_numpy(np.load(out_file))
    assert max_abs_diff(cli_logits, api.logits) < ATOL


@pytest.mark.timeout(120)
def test_model_folder(checkpoint: Checkpoint, tmp_path: Path) -> None:
    tokens = make_tokens(50, seed=32, vocab=VOCAB)
    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text(json.dumps(tokens))
    out_file = tmp_path / "out.npy"
    result = one_json_object(
        run_cli(
            "prefill",
            "--dtype",
            "float32",
            "--model",
            str(checkpoint.model_dir),
            "--cp",
            "2",
            "--tokens-file",
            str(tokens_file),
            "--prefix-len",
            "20",
            "--check",
            "--dump-logits",
            str(out_file),
        )
    )
    assert result["model"] == checkpoint.model_dir.name
    assert (result["cached_tokens"], result["computed_tokens"]) == (16, 34)
    assert result["collectives_per_rank"] == {"kv": checkpoint.config.num_hidden_layers, "out": 1}
    assert result["max_abs_diff"] < ATOL
    # Against transformers, which wrote the checkpoint.
    ref = hf_logits(checkpoint.hf, tokens)[16:]
    assert max_abs_diff(torch.from_numpy(np.load(out_file)), ref) < ATOL
    assert result["first_token"] == int(ref[-1].argmax())


BAD_INPUT = {
    "unknown-model": (
        ["--model", "no-such-model", "--prompt-len", "10"],
        "--model 'no-such-model': neither a built-in preset (qwen3-0.6b-4l, qwen3-30b-a3b-2l, "
        "tiny, tiny-gpt-oss, tiny-moe) nor a folder with config.json and *.safetensors",
    ),
    "prefix-longer-than-prompt": (
        ["--prompt-len", "10", "--prefix-len", "11"],
        "--prefix-len must be in [0, 10], got 11",
    ),
    "negative-prefix": (
        ["--prompt-len", "10", "--prefix-len", "-1"],
        "--prefix-len must be in [0, 10], got -1",
    ),
    "cp-0": (["--prompt-len", "10", "--cp", "0"], "--cp must be >= 1, got 0"),
    "block-size-12": (
        ["--prompt-len", "10", "--block-size", "12"],
        "block_size must be a power of two, got 12",
    ),
    "prompt-len-0": (["--prompt-len", "0"], "--prompt-len must be positive, got 0"),
    "threads-0": (
        ["--prompt-len", "10", "--threads-per-rank", "0"],
        "threads_per_rank must be positive, got 0",
    ),
    "kv-blocks-negative": (
        ["--prompt-len", "10", "--kv-blocks-per-rank", "-1"],
        "kv_blocks_per_rank must be >= 0, got -1",
    ),
}

BAD_TOKENS_FILE = {
    "empty": ("[]", "the prompt is empty: a prefill needs at least one token"),
    "not-a-list": (
        '{"ids": [1, 2]}',
        "--tokens-file {}: expected a JSON list of integer token ids",
    ),
    "not-integers": ("[1, 2.5]", "--tokens-file {}: expected a JSON list of integer token ids"),
    "booleans": ("[1, true]", "--tokens-file {}: expected a JSON list of integer token ids"),
    "invalid-json": ("[1, 2,", "--tokens-file {}: Expecting value: line 1 column 7 (char 6)"),
    "id-out-of-vocabulary": ("[5, 1024, 7]", "token id 1024 outside the vocabulary [0, 1024)"),
    "negative-id": ("[5, -3]", "token id -3 outside the vocabulary [0, 1024)"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("args", "message"), BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_arguments(args: list[str], message: str) -> None:
    assert_one_line_error(run_cli("prefill", *args), 2, message)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("content", "message"), BAD_TOKENS_FILE.values(), ids=BAD_TOKENS_FILE.keys()
)
def test_bad_tokens_file(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(content)
    assert_one_line_error(run_cli("prefill", "--tokens-file", str(path)), 2, message.format(path))


@pytest.mark.timeout(30)
def test_missing_tokens_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.json"
    assert_one_line_error(
        run_cli("prefill", "--tokens-file", str(path)),
        2,
        f"--tokens-file {path}: [Errno 2] No such file or directory: '{path}'",
    )


@pytest.mark.timeout(30)
def test_bad_model_folders(checkpoint: Checkpoint, tmp_path: Path) -> None:
    assert_one_line_error(
        run_cli("prefill", "--model", str(tmp_path), "--prompt-len", "5"),
        2,
        f"{tmp_path}: no config.json (expected a Hugging Face model folder)",
    )
    raw = json.loads((checkpoint.model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "architectures": ["PhiForCausalLM"]}))
    assert_one_line_error(
        run_cli("prefill", "--model", str(tmp_path), "--prompt-len", "5"),
        2,
        "unsupported architecture 'PhiForCausalLM'; supported: Qwen3ForCausalLM, "
        "Qwen3MoeForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
        "Qwen2MoeForCausalLM, MixtralForCausalLM, GptOssForCausalLM, DeepseekV4ForCausalLM",
    )
    # Checked before any rank starts: the folder's config allows 4096 positions.
    assert_one_line_error(
        run_cli("prefill", "--model", str(checkpoint.model_dir), "--prompt-len", "4097"),
        2,
        "4097 tokens exceed the model's max_position_embeddings (4096)",
    )


@pytest.mark.timeout(30)
def test_dump_logits_into_missing_folder(tmp_path: Path) -> None:
    target = tmp_path / "absent" / "out.npy"
    assert_one_line_error(
        run_cli("prefill", "--prompt-len", "5", "--dump-logits", str(target)),
        2,
        f"--dump-logits {target}: no directory {target.parent}",
    )


@pytest.mark.timeout(60)
def test_checkpoint_missing_tensor(tmp_path: Path) -> None:
    """Only a rank finds out (it loads the weights): exit 1, one line, no traceback."""
    broken = make_checkpoint(tmp_path, tie_word_embeddings=True)
    drop_tensor(broken.model_dir, "model.layers.2.self_attn.k_norm.weight")
    assert_one_line_error(
        run_cli("prefill", "--model", str(tmp_path), "--prompt-len", "5"),
        1,
        f"rank 0 failed to start: ConfigError: {tmp_path}: checkpoint lacks tensors: "
        "model.layers.2.self_attn.k_norm.weight",
    )


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_without_gpu() -> None:
    assert_one_line_error(
        run_cli("prefill", "--prompt-len", "5", "--device", "cuda"),
        1,
        "rank 0 failed to start: RuntimeError: device = 'cuda' was asked for, but CUDA is "
        "not available",
    )


@pytest.mark.timeout(30)
def test_help() -> None:
    top = run_cli("--help")
    assert (top.returncode, top.stderr) == (0, "")
    assert top.stdout.startswith("usage: python -m vertumnus")
    assert "prefill" in top.stdout
    sub = run_cli("prefill", "--help")
    assert (sub.returncode, sub.stderr) == (0, "")
    assert sub.stdout.startswith("usage: python -m vertumnus prefill")
    for option in (
        "--model",
        "--cp",
        "--tokens-file",
        "--prompt-len",
        "--prefix-len",
        "--block-size",
        "--dump-logits",
        "--check",
    ):
        assert option in sub.stdout, option


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["prefill"], "one of the arguments --tokens-file --prompt-len is required"),
        (
            ["prefill", "--prompt-len", "5", "--cp", "two"],
            "argument --cp: invalid int value: 'two'",
        ),
    ],
    ids=["no-command", "no-prompt", "cp-not-int"],
)
def test_usage_errors(args: list[str], message: str) -> None:
    result = run_cli(*args)
    assert (result.returncode, result.stdout) == (2, "")
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[0].startswith("usage: python -m vertumnus")
    assert result.stderr.splitlines()[-1].endswith(f"error: {message}")


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_profile_then_fit_round_trip(tmp_path: Path) -> None:
    """`profile` measures a small grid on real ranks, fits, plots, and writes samples in
    the format `fit` reads."""
    out, samples = tmp_path / "profile.json", tmp_path / "samples.csv"
    args = [
        "profile",
        "--model",
        "tiny",
        "--degrees",
        "1,2",
        "--lengths",
        "16,48,96,160",
        "--hit-ratios",
        "0,0.5",
        "--repeats",
        "1",
        "--warmup",
        "1",
        "--out",
        str(out),
        "--samples-out",
        str(samples),
        "--plot",
        str(tmp_path / "fit.png"),
        "--dtype",
        "float32",
    ]
    result = run_cli(*args, timeout_s=170)
    assert result.returncode == 0, result.stderr
    assert "degree 1: MAPE fit" in result.stdout and "degree 2: MAPE fit" in result.stdout
    profile = json.loads(out.read_text())
    assert sorted(profile["degrees"]) == ["1", "2"]
    assert set(profile["degrees"]["2"]) == {"d", "a", "b", "c", "alpha"}
    assert profile["model"] == "tiny" and profile["block_size"] == 16
    assert set(profile["provenance"]["mape_held_out"]) == {"1", "2"}
    assert profile["provenance"]["dtype"] == "float32"
    # The host link, measured on the ranks' device once they are closed.
    link = profile["host_link"]
    assert link["kv_bytes_per_token"] == 2048 and link["source"].startswith("measured by")
    assert link["d2h_bytes_s"] > 0 and link["h2d_bytes_s"] > 0
    assert "host link: device-to-host" in result.stdout
    assert (tmp_path / "fit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = samples.read_text().splitlines()
    assert rows[0] == "degree,uncached_tokens,cached_tokens,seconds"
    assert len(rows) == 1 + 2 * 8
    # A 50 % hit on 96 tokens reuses 48 (three whole blocks).
    assert any(row.startswith("2,48,48,") for row in rows[1:])
    refit = run_cli("fit", "--samples", str(samples), "--out", str(tmp_path / "refit.json"))
    assert refit.returncode == 0, refit.stderr
    assert "degree 1: 8 samples, MAPE" in refit.stdout
