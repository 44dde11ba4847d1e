"""/docs as a person sees it: `paralon serve` on PostgreSQL, its page loaded in
a real headless Chromium (Debian's `chromium`, driven by Playwright; no browser
is downloaded). The page lists every operation of the document, shows no
error, logs none, loads nothing that fails, and asks no host but the app's own
(every other request is blocked and counted). "Authorize" takes an API key and
"Try it out" then answers with it."""
from __future__ import annotations

import httpx
import pytest

from tests.conftest import migrated_database_url
from tests.support.browser import PageWatch, launch_chromium
from tests.support.harness import make_fleet, serving

UI_TIMEOUT_MS = 60_000  # the page's own bound: 1.5 MB of script on a shared, busy machine


@pytest.fixture
def browser(request):
    return launch_chromium(request)


@pytest.fixture
def served(request, tmp_path):
    url = migrated_database_url(request, "postgresql", tmp_path)
    fleet = make_fleet(url, [])  # a customer's API key; no worker is needed to read the docs
    request.addfinalizer(fleet.engine.dispose)
    with serving(url) as proxy:
        yield proxy, fleet


def test_the_docs_render_every_operation_with_no_error(served, browser):
    proxy, fleet = served
    document = httpx.get(proxy.url + "/docs/openapi.json", timeout=10).json()
    operations = [(method, path) for path, item in document["paths"].items() for method in item]
    page = browser.new_page()
    page.set_default_timeout(UI_TIMEOUT_MS)
    watch = PageWatch(page)

    page.goto(proxy.url + "/docs", wait_until="load")
    chat = page.locator(".opblock-post .opblock-summary-path[data-path='/v1/chat/completions']")
    chat.wait_for(state="visible")

    assert page.locator(".opblock").count() == len(operations)
    for method, path in operations:
        assert page.locator(f".opblock-{method} .opblock-summary-path[data-path='{path}']").count() == 1, (method, path)
    assert "Unable to render" not in page.content()
    assert page.locator(".errors-wrapper").count() == 0  # Swagger UI's box of the document's own errors
    assert page.locator(".version-stamp").inner_text().strip().startswith("OAS 3.1")
    _authorize_and_try_models(page, fleet.key)
    watch.assert_clean()


def _authorize_and_try_models(page, api_key: str) -> None:
    """Authorize with an API key, then Try it out on GET /v1/models: the browser sends the key, the app answers 200."""
    page.locator(".auth-wrapper .authorize").click()
    dialog = page.locator(".modal-ux")
    assert dialog.get_by_text("ApiKey", exact=False).count() >= 1
    assert dialog.get_by_text("ManagementToken", exact=False).count() >= 1
    scheme = dialog.locator(".auth-container").filter(has_text="ApiKey")
    scheme.locator("input").fill(api_key)
    scheme.locator("button.authorize").click()
    dialog.locator("button.close-modal").click()

    models = page.locator(".opblock-get").filter(has=page.locator(".opblock-summary-path[data-path='/v1/models']"))
    models.locator(".opblock-summary").click()
    models.locator("button.try-out__btn").click()
    models.locator("button.execute").click()
    status = models.locator(".live-responses-table .response .response-col_status").first
    status.wait_for(state="visible")
    assert status.inner_text().strip() == "200"
    assert "Bearer sk-par-" in models.locator(".curl").inner_text()
