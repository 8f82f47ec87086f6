"""What the browser tests share: headless Chromium (``chromium``, from
``tools/browser.py``, which the dashboard benchmark uses too), a wait that fails naming
what it waited for, and the scripts that read what a page drew and loaded."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from tools.browser import chromium

__all__ = ["CHARTS_JS", "RESOURCES_JS", "chromium", "wait_for"]


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
