"""The live dashboard in a real browser (headless Chromium, selenium): a served pool
under load, ``/dashboard`` opened, its charts filled from ``/v1/timeline``, the
composition it shows equal to ``/v1/composition`` before and after a reshape (which
it marks), its worker table equal to ``/v1/workers``, and nothing loaded from
outside the server; with an API key, the page asks for it. The screenshot is saved
in the test's folder."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from support.browser import CHARTS_JS, RESOURCES_JS, chromium, wait_for
from support.factories import make_tokens
from support.server import ADMIN_TOKEN, Server, running_server, write_serve_config

pytestmark = [pytest.mark.browser, pytest.mark.multiproc]


def charts(browser: Any) -> dict[str, dict[str, int]]:
    """Per chart: trace name -> points drawn."""
    drawn = browser.execute_script(CHARTS_JS)
    return {c["id"]: {t["name"]: t["points"] for t in c["traces"]} for c in drawn}


def worker_table(browser: Any) -> list[list[str]]:
    """The worker table's cells, row by row, as the page shows them now."""
    cells: list[list[str]] = browser.execute_script(
        "return Array.from(document.querySelectorAll('#workers tbody tr'))"
        ".map(r => Array.from(r.querySelectorAll('td')).map(td => td.innerText.trim()))"
    )
    return cells


def shown_composition(browser: Any) -> str:
    from selenium.webdriver.common.by import By

    text: str = browser.find_element(By.ID, "composition").text
    return text


def load(server: Server, n: int, seed: int) -> None:
    """``n`` prefills at once, some sharing a prefix (so the cache hits)."""
    shared = make_tokens(96, seed=seed)
    bodies = [
        {"token_ids": shared + make_tokens(16 + 24 * i, seed=seed * 100 + i)} for i in range(n)
    ]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda b: server.call("POST", "/v1/prefill", b), bodies))
    assert [status for status, _ in answers] == [200] * n, answers


@pytest.mark.timeout(300)
def test_the_live_dashboard_follows_the_pool(tmp_path: Path) -> None:
    config = write_serve_config(
        tmp_path / "serve.toml", server={"admin_token": ADMIN_TOKEN, "timeline_s": 0.5}
    )
    with running_server(config) as server, chromium(tmp_path) as browser:
        load(server, 12, seed=1)
        browser.get(server.url + "/dashboard")
        drawn = wait_for(
            "the TTFT and composition charts to hold data",
            lambda: (
                (c := charts(browser))
                and c.get("chart-ttft", {}).get("P90", 0) > 0
                and c.get("chart-composition", {}).get("CP1", 0) > 0
                and c
            ),
        )
        assert drawn["chart-rate"]["requests / s"] > 0
        assert drawn["chart-cache"]["hit rate (%)"] > 0
        _, composition = server.call("GET", "/v1/composition")
        assert shown_composition(browser) == composition["composition"] == "2CP1"

        # A reshape: the page follows it and marks it.
        status, merged = server.call("POST", "/v1/admin/reconfigure", {"op": "merge"})
        assert status == 200, merged
        load(server, 8, seed=2)
        wait_for("the merge on the page", lambda: shown_composition(browser) == "1CP2")
        _, composition = server.call("GET", "/v1/composition")
        assert composition["composition"] == "1CP2"
        wait_for(
            "the reshape's marker",
            lambda: charts(browser)["chart-composition"].get("operator reshape", 0) == 1,
        )
        wait_for("the CP2 worker drawn", lambda: charts(browser)["chart-composition"].get("CP2"))

        # The worker table is /v1/workers (read in one script: the page redraws it
        # at every poll, and an element found before a redraw is stale after it).
        _, workers = server.call("GET", "/v1/workers")
        ids = [str(w["worker"]) for w in workers["workers"]]
        table = wait_for(
            f"the worker table to list workers {ids}",
            lambda: (t := worker_table(browser)) and [row[0] for row in t] == ids and t,
        )
        assert table[0][1] == "CP2"

        # Everything the page loaded came from the server.
        loaded = browser.execute_script(RESOURCES_JS)
        assert len(loaded) >= 4 and all(u.startswith(server.url) for u in loaded), loaded
        stats = browser.execute_script("return window.vertumnusStats")
        assert stats["polls"] >= 2 and stats["errors"] == 0, stats
        browser.save_screenshot(str(tmp_path / "dashboard.png"))
        # the timeline the page drew from, for the record
        with urllib.request.urlopen(server.url + "/v1/timeline", timeout=10) as resp:
            timeline = json.loads(resp.read())
        assert timeline["events"] and timeline["events"][-1]["rule"] == "operator"


@pytest.mark.timeout(240)
def test_with_an_api_key_the_page_asks_for_it(tmp_path: Path) -> None:
    """The page is open, its data is not: it asks for the key, refuses a wrong one
    with the same form, and draws once given the right one."""
    from selenium.webdriver.common.by import By

    key = "dashboard-api-key-0123456789"
    config = write_serve_config(tmp_path / "serve.toml", server={"api_key": key})
    with running_server(config) as server, chromium(tmp_path) as browser:
        browser.get(server.url + "/dashboard")

        def submit(text: str) -> None:
            field = wait_for("the key form", lambda: browser.find_elements(By.ID, "apikey"))[0]
            field.send_keys(text)
            browser.find_element(By.CSS_SELECTOR, "form.key button").click()

        submit("not-the-key-at-all")
        wait_for(
            "the form again, saying the key was refused",
            lambda: "refused" in browser.find_element(By.ID, "keyform").text,
        )
        submit(key)
        wait_for(
            "the composition drawn",
            lambda: charts(browser).get("chart-composition", {}).get("CP1", 0) > 0,
        )
        assert shown_composition(browser) == "2CP1"
        assert not browser.find_elements(By.ID, "apikey")


@pytest.mark.timeout(240)
def test_the_dashboard_shows_the_host_tier(tmp_path: Path) -> None:
    """With a host tier, the page says how much of it is used and what moved, as
    ``/v1/timeline`` has it; without one it says nothing of a tier."""
    from selenium.webdriver.common.by import By

    config = write_serve_config(
        tmp_path / "serve.toml",
        server={"timeline_s": 0.5},
        engine={"threads_per_rank": 1, "kv_blocks_per_rank": 8},
        cache={"host_tier_bytes": 1 << 22},
    )
    with running_server(config) as server, chromium(tmp_path) as browser:
        load(server, 12, seed=3)  # more blocks than the ranks hold: some are demoted
        _, timeline = server.call("GET", "/v1/timeline")
        tier = timeline["host_tier"]
        assert tier["demoted_blocks"] > 0 and tier["capacity_bytes"] == 1 << 22
        browser.get(server.url + "/dashboard")
        text = wait_for(
            "the host tier's line",
            lambda: "demoted" in (t := browser.find_element(By.ID, "host-tier").text) and t,
        )
        assert "/ 4 MiB" in text, text  # (the capacity; nothing moves after the load)
        assert f"{tier['demoted_blocks']} blocks demoted" in text, text
    plain = write_serve_config(tmp_path / "plain.toml", server={"timeline_s": 0.5})
    with running_server(plain) as server, chromium(tmp_path) as browser:
        browser.get(server.url + "/dashboard")
        wait_for("the page drawn", lambda: charts(browser))
        assert browser.find_element(By.ID, "host-tier").text == ""
