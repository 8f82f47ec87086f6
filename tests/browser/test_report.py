"""A simulation's ``report.html`` and an experiment's, opened from disk in headless
Chromium: self-contained (nothing loaded but the file), charts drawn with the run's
data, the composition shown equal to the run's last, one marker per reshape, the
summary's figures in its table. The screenshots are saved in the test's folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support.browser import CHARTS_JS, RESOURCES_JS, chromium, wait_for
from support.tools import load_tool

pytestmark = [pytest.mark.browser, pytest.mark.multiproc]

CONFIG = """
[pool]
composition = "4CP4"
degrees = [4, 8]
ranks = 16

[workload]
seed = 5
phases = [
  { duration_s = 60, rate = 6.0, long_fraction = 0.02 },
  { duration_s = 60, rate = 2.0, long_fraction = 0.4 },
  { duration_s = 60, rate = 7.0, long_fraction = 0.02 },
]

[sim]
seed = 5
"""


def drawn(browser: Any) -> dict[str, dict[str, int]]:
    return {
        c["id"]: {t["name"]: t["points"] for t in c["traces"]}
        for c in browser.execute_script(CHARTS_JS)
    }


def open_report(browser: Any, page: Path) -> dict[str, dict[str, int]]:
    browser.get(page.as_uri())
    wait_for(
        "the report to render",
        lambda: browser.execute_script(
            "return window.vertumnusStats && window.vertumnusStats.renders"
        ),
    )
    loaded = browser.execute_script(RESOURCES_JS)
    assert loaded == [page.as_uri()], loaded  # self-contained: nothing else loaded
    return drawn(browser)


@pytest.mark.timeout(240)
def test_a_simulation_report_opens_from_disk(tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    config = tmp_path / "sim.toml"
    config.write_text(CONFIG)
    out = tmp_path / "run"
    subprocess.run(
        [sys.executable, "-m", "vertumnus", "simulate", "--config", str(config), "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=180,
    )
    summary = json.loads((out / "summary.json").read_text())
    timeline = json.loads((out / "timeline.json").read_text())
    assert summary["reshapes"] >= 1  # the phases move the composition
    with chromium(tmp_path) as browser:
        charts = open_report(browser, out / "report.html")
        assert browser.find_element(By.ID, "composition").text == summary["composition_end"]
        composition = charts["chart-composition"]
        markers = sum(composition.get(k, 0) for k in ("split", "merge"))
        # (one event per reshape, and one per move's audit: no marker)
        reshapes = [e for e in timeline["events"] if e["kind"] != "audit"]
        assert markers == summary["reshapes"] == len(reshapes)
        assert sum(composition.get(f"CP{d}", 0) for d in (4, 8)) >= len(timeline["samples"])
        assert charts["chart-ttft"]["P90"] > 0 and charts["chart-rate"]["requests / s"] > 0
        cells = [td.text for td in browser.find_elements(By.CSS_SELECTOR, "table.summary td")]
        mean = summary["mean_ttft_s"]  # as the page writes it: 4 decimals under 1
        assert "mean_ttft_s" in cells and (f"{mean:.4f}" if mean < 1 else f"{mean:.3f}") in cells
        rows = browser.find_elements(By.CSS_SELECTOR, "#workers tbody tr")
        assert len(rows) == sum(int(n) for n in timeline["samples"][-1]["workers"].values())
        browser.save_screenshot(str(tmp_path / "report.png"))


@pytest.mark.timeout(240)
def test_an_experiment_report_compares_its_variants(tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    tool = load_tool("experiments/sim_experiment.py")
    config = tmp_path / "experiment.toml"
    config.write_text(
        "[experiment]\nsweep_fixed = true\nrate_scales = [1, 2]\nvariants = [\n"
        '  { label = "vertumnus", preset = "vertumnus" },\n'
        '  { label = "fixed (start)", preset = "fixed" },\n]\n' + CONFIG
    )
    out = tool.run_experiment(config, tmp_path / "out", echo=False)
    runs = json.loads((out / "comparison.json").read_text())["runs"]
    with chromium(tmp_path) as browser:
        charts = open_report(browser, out / "report.html")
        table = browser.find_elements(By.CSS_SELECTOR, "table.summary tbody tr")
        assert [r.find_element(By.TAG_NAME, "td").text for r in table] == [r["run"] for r in runs]
        chosen = tool.over_time(runs)  # drawn over time, one rate at a time
        for rate in (1, 2):
            if rate == 2:  # the select: the other rate's runs
                Select(browser.find_element(By.ID, "rate")).select_by_value("2")
                shown = set(charts)
                wait_for("the redraw", lambda shown=shown: set(drawn(browser)) != shown)
                charts = drawn(browser)
            names = {r["run"] for r in chosen if r["rate_scale"] == rate}
            assert len(names) == 2 and set(charts["chart-ttft_p90_s"]) == names
            assert {k for k in charts if k.startswith("chart-composition-")} == {
                f"chart-composition-{name}" for name in names
            }
            if rate == 1:
                browser.save_screenshot(str(tmp_path / "experiment.png"))
