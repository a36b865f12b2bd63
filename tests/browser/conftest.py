"""Browser tests: Playwright driving Debian's Chromium against a real API process and a real
Celery worker on Postgres and Redis. Every page a test opens is checked for console errors, and
screenshots are written to MUONFORGE_TEST_ARTIFACTS (default tests/browser/artifacts)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.web.pages import NODE_MODULES
from tests.support.api import key_of
from tests.support.browser import CHROMIUM, LAUNCH_ARGS
from tests.support.services import ROOT, unavailable

ARTIFACTS = Path(os.environ.get("MUONFORGE_TEST_ARTIFACTS", ROOT / "tests" / "browser" / "artifacts"))


def missing() -> str | None:
    """What the browser tests need and this machine lacks, in a line; None if nothing."""
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "needs Playwright's Python package (pip install -e '.[dev]')"
    if not Path(CHROMIUM).exists() and not shutil.which(CHROMIUM):
        return f"needs Chromium at {CHROMIUM} (apt-get install chromium, or MUONFORGE_TEST_CHROMIUM)"
    if not (NODE_MODULES / "uplot").is_dir():
        return "needs the web app's packages (make web)"
    return None


@pytest.fixture(scope="module")
def chromium():
    """One Chromium per test module. Playwright's sync API keeps an event loop running in this
    thread until it stops, so it must stop before tests that run their own (asyncio.run)."""
    reason = missing()
    if reason:
        unavailable(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        yield browser
        browser.close()


class Browser:
    """Opens signed-in pages and remembers every console error and uncaught exception. Chromium
    also logs every 4xx answer to a fetch as an error; ``expect(status)`` marks one a test
    provokes on purpose (a wrong key, another tenant's job, a 422)."""

    def __init__(self, chromium, url: str) -> None:
        self.chromium, self.url, self.contexts = chromium, url, []
        self.messages: list[str] = []
        self.expected: set[int] = set()

    def expect(self, *statuses: int) -> None:
        self.expected.update(statuses)

    @property
    def errors(self) -> list[str]:
        provoked = re.compile(r"Failed to load resource: the server responded with a status of (\d+)")
        return [m for m in self.messages if not ((found := provoked.search(m)) and int(found[1]) in self.expected)]

    def page(self, key: str | None = None, width: int = 1400, height: int = 900):
        context = self.chromium.new_context(viewport={"width": width, "height": height})
        self.contexts.append(context)
        page = context.new_page()
        page.on("console", lambda m: m.type == "error" and self.messages.append(f"{page.url}: {m.text}"))
        page.on("pageerror", lambda e: self.messages.append(f"{page.url}: {e}"))
        if key:
            page.goto(f"{self.url}/")
            page.get_by_label("API key").fill(key)
            page.get_by_role("button", name="Sign in").click()
            page.wait_for_selector("#jobs")
        return page

    def close(self) -> None:
        for context in self.contexts:
            context.close()


@pytest.fixture
def browser(chromium, api_url) -> Iterator[Browser]:
    b = Browser(chromium, api_url)
    yield b
    b.close()
    assert b.errors == [], "console errors"


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=path, full_page=True)
    return path


@pytest.fixture
def key(auth) -> str:
    """The API key of the test's tenant (the one the shared worker settles after the test)."""
    return key_of(auth)
