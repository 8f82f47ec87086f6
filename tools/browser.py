"""Headless Chromium (Debian's ``chromium`` and ``chromium-driver``, which
``tools/browser.sh`` installs, driven with selenium) for the browser tests and the
dashboard benchmark: found on the path or in /usr/bin, or a ``BrowserMissing`` that
says what to install. Started as this machine needs it: no sandbox (tests run as root
here), no GPU, and none of Chromium's own network traffic (the network is closed; its
background connections would only be refused). What a test asserts on a page lives
in ``tests/support/browser.py``."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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
    "`apt-get install chromium chromium-driver`), or leave the browser tests out with "
    "-m 'not browser'"
)


class BrowserMissing(RuntimeError):
    """No selenium, Chromium or ChromeDriver on this machine."""


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
    except ImportError as exc:
        raise BrowserMissing(
            f"headless Chromium needs selenium (pip install -e '.[test]'); {INSTALL}"
        ) from exc
    browser = _find(("chromium", "chromium-browser", "google-chrome"))
    driver_path = _find(("chromedriver",))
    missing = [n for n, p in (("chromium", browser), ("chromedriver", driver_path)) if p is None]
    if missing:
        raise BrowserMissing(f"no {' or '.join(missing)} on this machine: {INSTALL}")
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
