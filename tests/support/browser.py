"""Headless Chromium for the browser tests (Debian's ``chromium`` and
``chromium-driver``, driven with selenium): found on the path or in /usr/bin, or a
failure that says what to install. Started as this machine needs it: no sandbox
(tests run as root here), no GPU, and none of Chromium's own network traffic (the
network is closed; its background connections would only be refused)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1440,2000",
)
INSTALL = (
    "install Debian's chromium and chromium-driver (`bash tools/browser.sh`, or "
    "`apt-get install chromium chromium-driver`), or leave these tests out with "
    "-m 'not browser'"
)


def _find(names: tuple[str, ...]) -> str | None:
    for name in names:
        found = shutil.which(name) or (
            f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None
        )
        if found:
            return found
    return None


@contextmanager
def chromium(folder: Path) -> Iterator[Any]:
    """A selenium driver of headless Chromium; its profile and log under ``folder``."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail(f"the browser tests need selenium (pip install -e '.[test]'); {INSTALL}")
    browser = _find(("chromium", "chromium-browser", "google-chrome"))
    driver_path = _find(("chromedriver",))
    missing = [n for n, p in (("chromium", browser), ("chromedriver", driver_path)) if p is None]
    if missing:
        pytest.fail(f"no {' or '.join(missing)} on this machine: {INSTALL}")
    options = Options()
    options.binary_location = browser
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={folder / 'chromium-profile'}")
    service = Service(driver_path, log_output=str(folder / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """Poll ``check`` until it returns something true; fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {value!r})")
        time.sleep(0.2)


# What a page drew: per chart div, its traces' names and point counts.
CHARTS_JS = """
return Array.from(document.querySelectorAll('.js-plotly-plot')).map(gd => ({
  id: gd.id,
  traces: (gd.data || []).map(t => ({name: t.name, points: (t.y || []).filter(
      v => v !== null && v !== undefined).length}))
}));
"""
# Every resource the page loaded, by URL (the page itself first).
RESOURCES_JS = """
return [location.href].concat(performance.getEntriesByType('resource').map(e => e.name));
"""
