"""Flags of earlier versions are refused with the flag to write instead, never ignored."""

from __future__ import annotations

import pytest

from vertumnus.__main__ import main


@pytest.mark.parametrize("command", ["simulate", "serve"])
def test_policy_is_now_preset(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--policy", "fixed"])
    assert exit_info.value.code == 2
    assert "--policy was renamed: write --preset fixed" in capsys.readouterr().err


def test_preset_is_read(capsys: pytest.CaptureFixture[str]) -> None:
    """``--preset`` parses (the run then stops at the missing ``--out``, before any work)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--preset", "fixed"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "the following arguments are required: --out" in err and "renamed" not in err
