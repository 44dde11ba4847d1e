"""A real headless Chromium for the tests that look at pages: Debian's
`chromium` driven by Playwright (no browser is downloaded). On a laptop
without it those tests skip; in CI (PARALON_REQUIRE_SERVICES=1) a missing
browser is a failure, never a skip."""
from __future__ import annotations

import shutil
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.support.services import REQUIRE_SERVICES

CHROMIUM_PATHS = ("/usr/bin/chromium", "chromium", "chromium-browser")
LOCAL_HOSTS = {"127.0.0.1", "localhost", "[::1]", "::1"}


def chromium_path() -> str:
    for name in CHROMIUM_PATHS:
        found = shutil.which(name)
        if found:
            return found
    message = "Chromium is not installed: make dev-venv installs Debian's chromium"
    if REQUIRE_SERVICES:
        pytest.fail(message)
    pytest.skip(message)


def launch_chromium(request) -> Browser:
    """A headless Chromium closed (then Playwright stopped) when the test ends."""
    path = chromium_path()
    runner = sync_playwright().start()
    request.addfinalizer(runner.stop)
    launched = runner.chromium.launch(executable_path=path, headless=True)
    request.addfinalizer(launched.close)  # finalisers run last-added first: the browser, then Playwright
    return launched


class PageWatch:
    """What a page did wrong: errors in its console or its scripts, requests that failed
    or answered an error, and every request to a host that is not this machine (blocked)."""

    def __init__(self, page: Page) -> None:
        self.console_errors: list[str] = []
        self.failed: list[str] = []
        self.foreign: list[str] = []
        self.downloads: set[str] = set()  # a navigation that becomes a download is aborted as a page: not a failure
        page.on("console", lambda message: message.type == "error" and self.console_errors.append(message.text))
        page.on("pageerror", lambda error: self.console_errors.append(str(error)))
        page.on("requestfailed", lambda req: self.failed.append(f"{req.url}: {req.failure}"))
        page.on("download", lambda download: self.downloads.add(f"{download.url}: net::ERR_ABORTED"))
        page.on("response", lambda response: response.status >= 400 and self.failed.append(f"{response.url}: {response.status}"))
        page.route("**/*", self._local_only)

    def _local_only(self, route) -> None:
        if urlsplit(route.request.url).hostname in LOCAL_HOSTS:
            route.continue_()
        else:
            self.foreign.append(route.request.url)
            route.abort("blockedbyclient")

    def assert_clean(self) -> None:
        assert self.foreign == [], f"the page asked hosts other than the app's own: {self.foreign}"
        assert self.console_errors == [], self.console_errors
        local = [failure for failure in self.failed
                 if urlsplit(failure).hostname in LOCAL_HOSTS and failure not in self.downloads]
        assert local == [], local
