"""One configuration dialect: ``serve`` and ``simulate`` read the same tables and
keys into the same pool and policy, presets work for both, and every mistake is one
clear error line."""

from __future__ import annotations

from pathlib import Path

import pytest

from vertumnus.__main__ import main
from vertumnus.config import ConfigError
from vertumnus.config.pool import PoolConfig
from vertumnus.engine.weights import cpu_computes_bf16
from vertumnus.runtime import serve_config
from vertumnus.sim import config as sim_config

SHARED = """
[pool]
degrees = [1, 2]
composition = "2CP1/1CP2"
min_workers = { "1" = 2 }
[profile]
path = "tiny-cpu"
[scheduler]
router = "cache-first"
beta = 1.5
backlog_weight = 0.5
coming_reuse = false
[controller]
enabled = true
window_s = 7.5
upper_fraction = 0.8
[cache]
replication = true
scan_interval_s = 2.5
theta_intra = 4.0
retain_s = 30.0
[engine]
block_size = 32
kv_blocks_per_rank = 512
"""
OWN = """
[model]
name = "tiny"
[server]
max_queued = 64
[sim]
switch_s = 0.01
[workload]
phases = [{ duration_s = 5, rate = 2.0 }]
"""


def test_one_file_gives_both_commands_the_same_pool_and_policy(tmp_path: Path) -> None:
    path = tmp_path / "pool.toml"
    path.write_text(SHARED + OWN)
    served = serve_config.load(path)
    simulated = sim_config.load(path, {})
    assert served.pool_spec == simulated.spec
    assert served.policy == simulated.policy
    assert served.profile == simulated.profile_path == "tiny-cpu"
    policy = served.policy
    assert (policy.router, policy.adaptive, policy.replication) == ("cache-first", True, True)
    assert policy.coming_reuse is False and policy.weights.backlog_weight == 0.5
    assert (policy.weights.beta, policy.controller.window_s, policy.scan_interval_s) == (
        1.5,
        7.5,
        2.5,
    )
    assert (policy.cache.theta_intra, policy.retention.retain_s) == (4.0, 30.0)
    assert served.pool_spec.layout == (2, 1, 1) and served.pool_spec.block_tokens == 32
    assert served.pool.min_workers == {1: 2} and served.max_queued == 64


def test_presets_name_the_three_choices_for_both_commands(tmp_path: Path) -> None:
    path = tmp_path / "pool.toml"
    path.write_text(SHARED + OWN)
    for load in (
        lambda name: serve_config.load(path, preset=name).policy,
        lambda name: sim_config.load(path, {}, preset=name).policy,
    ):
        fixed = load("fixed")
        assert (fixed.router, fixed.adaptive, fixed.replication) == ("vertumnus", False, True)
        ablation = load("no-replication")
        assert (ablation.adaptive, ablation.replication) == (False, False)
        baseline = load("round-robin")
        assert (baseline.router, baseline.adaptive, baseline.replication) == (
            "round-robin",
            False,
            False,
        )
        assert load("fixed").controller.window_s == 7.5  # the rest of the file stays
    # A choice given on its own (a CLI flag) goes over the preset.
    mixed = sim_config.load(
        path, {}, preset="fixed", choices={"controller": {"enabled": True}}
    ).policy
    assert (mixed.adaptive, mixed.replication) == (True, True)


def test_the_embedded_defaults_of_each_command(tmp_path: Path) -> None:
    served = serve_config.load(None)
    # The shipped profile measured in the dtype the CPU ranks compute in.
    profile = "tiny-cpu-bf16" if cpu_computes_bf16() else "tiny-cpu"
    assert (served.model, served.ranks, served.layout, served.profile) == (
        "tiny",
        2,
        (1, 1),
        profile,
    )
    fp32_file = tmp_path / "fp32.toml"
    fp32_file.write_text('[engine]\ndtype = "float32"\n')
    assert serve_config.load(fp32_file).profile == "tiny-cpu"
    assert served.policy.controller.window_s == 10.0
    raw = {"workload": {"phases": [{"duration_s": 5, "rate": 2.0}]}}
    simulated = sim_config.load(None, {}, raw=raw)
    assert simulated.composition == {4: 4, 8: 3} and simulated.spec.block_tokens == 512
    assert simulated.spec.blocks_per_rank == 293 and simulated.policy.name == "vertumnus"
    assert simulated.policy.coming_reuse is True
    assert simulated.policy.weights.backlog_weight == 1.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[scheduler]\nrouter = "magic"\n', "unknown router 'magic'; choose one of cache-first, "),
        ('[scheduler]\npolicy = "fixed"\n', "[scheduler] policy moved: write [scheduler] router"),
        ("[cache]\nscan_interval_s = 0\n", "turn the scans off with replication = false"),
        ('[controller]\nenabled = "yes"\n', "[controller] enabled must be true or false"),
        ("[scheduler]\ncoming_reuse = 1\n", "[scheduler] coming_reuse must be true or false"),
        ("[scheduler]\nbacklog_weight = -1\n", "backlog_weight must be >= 0, got -1"),
        ("[pool]\nlayout = [1, 1]\ncomposition = '2CP1'\n", "give layout or composition"),
        (
            "[pool]\ndegrees = [1, 2]\nranks = 4\nlayout = [1, 1]\n",
            "covers 2 devices, not ranks = 4",
        ),
        ("[pool]\ndegrees = [1, 4]\n", "consecutive powers of two"),
        ("[pool]\ndegrees = [1, 2]\nlayout = [1, 2, 1]\n", "is not aligned"),
        ("[poool]\n", "unknown table [poool]; known: cache, cluster, controller"),
        ("[policy]\nname = 'fixed'\n", "[policy] is gone: write [scheduler] router"),
        ("[sim]\nblocks_per_rank = 9\n", "write [engine] kv_blocks_per_rank"),
        ("[engine]\nblock = 16\n", "[engine] unknown keys ['block']"),
    ],
)
def test_mistakes_are_one_clear_error_for_both_commands(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text + "[workload]\nphases = [{ duration_s = 5, rate = 2.0 }]\n")
    for load in (lambda: serve_config.load(path), lambda: sim_config.load(path, {})):
        with pytest.raises(ConfigError) as caught:
            load()
        assert message in str(caught.value)


def test_a_pool_the_lattice_builds_is_a_pool_the_server_takes(tmp_path: Path) -> None:
    """12 devices at {4, 8}: a top-level block of 8 and one of 4 (the rank pool used to
    refuse this with a bare ValueError)."""
    path = tmp_path / "pool.toml"
    path.write_text("[pool]\nranks = 12\ndegrees = [4, 8]\n")
    cfg = serve_config.load(path)
    assert cfg.layout == (4, 4, 4) and cfg.pool_spec.lattice.num_devices == 12
    assert PoolConfig((4, 8), (8, 4)).lattice.num_devices == 12


def test_the_server_says_what_is_wrong_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[pool]\nranks = 12\ndegrees = [4, 16]\n")
    assert main(["serve", "--config", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vertumnus serve: error: [pool] ")


def test_a_workload_must_come_in_the_pools_blocks(tmp_path: Path) -> None:
    """A served file (16-token blocks) replayed on a Mooncake trace (512-token blocks)
    would price every reuse 32 times too low: refused, with the fix."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1500, "hash_ids": [0, 1, 2]}\n')
    path = tmp_path / "served.toml"
    path.write_text(f'[engine]\nblock_size = 16\n[workload]\ntrace = "{trace}"\n')
    with pytest.raises(ConfigError, match="prefix blocks are 512 tokens but \\[engine\\] block"):
        sim_config.load(path, {})
    path.write_text(f'[engine]\nblock_size = 512\n[workload]\ntrace = "{trace}"\n')
    assert sim_config.load(path, {}).spec.block_tokens == 512


def test_an_experiment_file_is_not_a_simulate_configuration(tmp_path: Path) -> None:
    path = tmp_path / "experiment.toml"
    path.write_text('[experiment]\nvariants = [{ label = "a", preset = "fixed" }]\n')
    with pytest.raises(
        ConfigError, match=r"run it with `python -m tools\.experiments\.sim_experiment"
    ):
        sim_config.load(path, {})


def test_the_server_takes_its_dashboard_settings(tmp_path: Path) -> None:
    """``[server] timeline_s``, ``timeline_samples`` and ``slo`` (read as ``[sim] slo``
    is); a wrong one is a one-line ConfigError naming the key."""
    path = tmp_path / "serve.toml"
    path.write_text('[server]\ntimeline_s = 0.5\ntimeline_samples = 600\nslo = "800ms"\n')
    cfg = serve_config.load(path)
    assert (cfg.timeline_s, cfg.timeline_samples, cfg.slo.describe()) == (0.5, 600, "0.8s")
    assert serve_config.load(None).slo.describe() == "5x"
    for text, message in (
        ('[server]\nslo = "fast"\n', r"\[server\] slo: "),
        ("[server]\ntimeline_s = 0\n", "timeline_s > 0"),
        ("[server]\ntimeline_samples = 0\n", "timeline_samples >= 1"),
    ):
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            serve_config.load(path)
