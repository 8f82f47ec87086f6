"""DeepSeek-V4 through the CLI: ``prefill --check`` over gloo rank processes at CP 2
gives transformers' logits, fresh and resuming a prefix from the pool's 128-token
blocks; ``profile`` fits its compressed attention with prefix hits; a block size that
cannot hold its prefix state is refused at once for either, saying why."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from support.dsv4 import write_dsv4_folder

pytestmark = pytest.mark.multiproc


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "vertumnus", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


@pytest.mark.timeout(240)
def test_prefill_check_over_rank_processes_gives_transformers_logits(tmp_path: Path) -> None:
    folder = tmp_path / "dsv4"
    model = write_dsv4_folder(folder)
    tokens = [
        int(t) for t in torch.randint(0, 256, (700,), generator=torch.Generator().manual_seed(1))
    ]
    (tmp_path / "tokens.json").write_text(json.dumps(tokens))
    out = _cli(
        "prefill", "--model", str(folder), "--cp", "2", "--tokens-file",
        str(tmp_path / "tokens.json"), "--dtype", "float32", "--check",
        "--dump-logits", str(tmp_path / "logits.npy"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["collectives_per_rank"] == {"halo": 4, "comp": 3, "out": 1}
    assert result["cached_tokens"] == 0 and result["computed_tokens"] == 700
    assert result["max_abs_diff"] <= 1e-4
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0].numpy()
    got = np.load(tmp_path / "logits.npy")
    assert float(np.abs(got - want).max()) <= 1e-4


@pytest.mark.timeout(240)
def test_a_cached_prefix_resumes_from_the_blocks_at_cp_2(tmp_path: Path) -> None:
    folder = tmp_path / "dsv4"
    write_dsv4_folder(folder)
    out = _cli("prefill", "--model", str(folder), "--cp", "2", "--prompt-len", "700",
               "--prefix-len", "256", "--block-size", "128", "--dtype", "float32",
               "--check")  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["cached_tokens"] == 256 and result["computed_tokens"] == 444
    assert result["collectives_per_rank"] == {"prefix": 1, "halo": 4, "comp": 3, "out": 1}
    assert result["max_abs_diff"] <= 1e-4
    out = _cli("prefill", "--model", str(folder), "--prompt-len", "300", "--prefix-len", "128")
    assert out.returncode == 2
    assert "blocks of a multiple of 128 tokens" in out.stderr and "not 16" in out.stderr


@pytest.mark.timeout(240)
def test_profile_fits_its_compressed_attention_work(tmp_path: Path) -> None:
    """``profile`` measures a DeepSeek-V4 folder over rank processes, with prefix hits
    from 128-token blocks, and stores its layers' work; prefix hits at a block size
    that cannot hold its state are refused, saying why."""
    from vertumnus.config import ModelConfig
    from vertumnus.config.model import attention_mix
    from vertumnus.perfmodel import Profile

    folder = tmp_path / "dsv4"
    write_dsv4_folder(folder)
    lengths = ",".join(str(256 * i) for i in range(1, 9))
    out = _cli("profile", "--model", str(folder), "--degrees", "1", "--lengths", lengths,
               "--hit-ratios", "0,0.5", "--block-size", "128", "--repeats", "1",
               "--warmup", "0", "--dtype", "float32", "--compile", "off",
               "--out", str(tmp_path / "p.json"),
               "--samples-out", str(tmp_path / "s.csv"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    profile = Profile.load(str(tmp_path / "p.json"))
    assert profile.attention == attention_mix(ModelConfig.from_dir(folder))
    assert profile.predict(1, 2048, 0) > profile.predict(1, 256, 0) > 0
    rows = (tmp_path / "s.csv").read_text().splitlines()[1:]
    cached = {int(row.split(",")[2]) for row in rows}  # measured: the prefix each resumed
    assert cached == {0, *(128 * i for i in range(1, 9))}
    refused = _cli("profile", "--model", str(folder), "--hit-ratios", "0,0.5", "--out", "x.json")
    assert refused.returncode == 2 and "give 0 alone" in refused.stderr
