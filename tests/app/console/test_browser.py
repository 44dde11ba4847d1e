"""The console as its people use it, in a real headless Chromium (Debian's
`chromium`, driven by Playwright) against `paralon serve` on PostgreSQL, with
sign-in links mailed through a real SMTP server (aiosmtpd), card top-ups
through the Stripe stand-in and webhooks signed with Stripe's scheme, and a
simulated GPU worker answering the official `openai` SDK.

A customer signs in, tops up by card, creates an API key, calls the API with
it while the Activity page is open and sees the call's row appear there within
5 s without a reload, sees the exact cost as spend, downloads the invoice the
ledger recorded and sets a low-balance alert; the worker's owner sees 80 % of
that cost earned on that worker and drains it; an accountant downloads the
month's ledger CSV, whose opening and closing balances are the statement's,
the month's documents as one zip, and reconciles the month against the
statement, the CSV and `paralon ledger verify`; a platform admin looks at the
fleet, the accounts, the models and the platform's status. Every page is screenshotted into
test-output/console/, checked with axe-core (no serious or critical
violation) and holds no inline script; its Content-Security-Policy blocks one
and the session cookie is out of the page's reach.

Each step is a function of its own, taking the person whose browser does it."""
from __future__ import annotations

import csv
import hashlib
import io
import json
import re
import time
import zipfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from click.testing import CliRunner
from playwright.sync_api import Browser, BrowserContext, Page, expect
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from app.cli import main
from app.http.console.web import CONTENT_SECURITY_POLICY, SESSION_COOKIE
from app.jobs.ledger_check import run_verification
from ledger.db import make_engine
from proxy import workers as registry
from tests.conftest import migrated_database_url
from tests.support import harness
from tests.support.browser import PageWatch, launch_chromium
from tests.support.harness import MODEL, ServeProcess, ThreadedServer, free_port, sim_worker, wait_for
from tests.support.stripe_standin import StripeStandIn, session_event, signed

REPO = Path(__file__).resolve().parents[3]
SCREENSHOTS = REPO / "test-output" / "console"
AXE_SCRIPT = REPO / "node_modules" / "axe-core" / "axe.min.js"
BLOCKING_IMPACTS = ("serious", "critical")

CUSTOMER, OWNER, ACCOUNTANT = "customer@example.com", "owner@example.com", "accountant@example.com"
ADMIN = "admin@example.com"
WEBHOOK_SECRET = "whsec_console_browser"
CHECKOUT_HOST = "checkout.stripe.test"  # where the stand-in's sessions send the customer
TOP_UP_USD, TOP_UP_NANO_USD = "25.00", 25 * 10**9
OWNER_SHARE_PERCENT = 80

WIDE_PX, NARROW_PX, VIEWPORT_HEIGHT_PX = 1280, 360, 800
UI_TIMEOUT_MS = 60_000  # one page's bound on a shared, busy 2-core machine
SETTLED_TIMEOUT_S = 120.0  # until a webhook, a settlement or an invoice shows through the read models
MAIL_TIMEOUT_S = 60.0
SERVE_START_TIMEOUT_S = 120  # `paralon serve` took 35 s to listen on a heavily loaded machine
CHECK_TIMEOUT_MS = 10_000  # a page's own event (a CSP violation) arrives well within this
MAX_TABS = 60  # more stops than any console page has before its forms
LIVE_ROW_TIMEOUT_MS = 5_000  # the product's promise: a request shows on an open Activity page within 5 s
ALERT_USD, ALERT_NANO_USD = "5.00", 5 * 10**9


@dataclass
class Site:
    """`paralon serve` and everything it talks to, with the ids the CLI gave."""

    url: str
    database_url: str
    engine: object
    inbox: object
    standin: StripeStandIn
    worker_server: ThreadedServer
    customer_id: int
    owner_id: int
    worker_id: int
    customer_token: str
    accountant_token: str
    platform_id: int

    def api(self, path: str, token: str) -> httpx.Response:
        return httpx.get(self.url + path, headers={"authorization": f"Bearer {token}"}, timeout=60)


@dataclass
class Person:
    """One signed-in (or signing-in) person: a browser context of their own, so a cookie jar of their own."""

    name: str
    email: str
    site: Site
    context: BrowserContext
    page: Page
    watch: PageWatch

    @property
    def account_path(self) -> str:
        return urlsplit(self.page.url).path


def _cli(database_url: str, *args: str) -> dict:
    result = CliRunner().invoke(main, [*args, "--json"], env={"PARALON_DATABASE_URL": database_url})
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def browser(request) -> Browser:
    return launch_chromium(request)


@pytest.fixture
def site(request, tmp_path, inbox, monkeypatch) -> Site:
    monkeypatch.setattr(harness, "START_TIMEOUT_S", SERVE_START_TIMEOUT_S)
    database_url = migrated_database_url(request, "postgresql", tmp_path)
    standin = StripeStandIn()
    stripe_api = ThreadedServer(standin).start()
    request.addfinalizer(stripe_api.stop)
    worker_server = sim_worker("instant")
    request.addfinalizer(worker_server.stop)

    customer = _cli(database_url, "accounts", "create", "--kind", "customer", "--name", "Example Customer", "--email", CUSTOMER)
    owner = _cli(database_url, "accounts", "create", "--kind", "owner", "--name", "Example GPU Owner", "--email", OWNER)
    _cli(database_url, "members", "add", str(customer["id"]), "--email", ACCOUNTANT, "--role", "accountant")
    _cli(database_url, "models", "set-price", MODEL, "--input-usd-per-mtok", "0.15", "--output-usd-per-mtok", "0.60")
    worker = _cli(database_url, "workers", "add", "--owner", str(owner["id"]), "--url", worker_server.url, "--model", MODEL)
    customer_token = _cli(database_url, "tokens", "create", str(customer["id"]), "--role", "customer")["token"]
    accountant_token = _cli(database_url, "tokens", "create", str(customer["id"]), "--role", "accountant")["token"]
    platform = _cli(database_url, "accounts", "platform")
    _cli(database_url, "members", "add", str(platform["id"]), "--email", ADMIN, "--role", "platform_admin")

    port = free_port()
    serve = ServeProcess(database_url, port=port, PARALON_PUBLIC_URL=f"http://127.0.0.1:{port}",
                         PARALON_SMTP_HOST="127.0.0.1", PARALON_SMTP_PORT=str(inbox.port),
                         PARALON_STRIPE_SECRET_KEY="sk_test_standin", PARALON_STRIPE_WEBHOOK_SECRET=WEBHOOK_SECRET,
                         PARALON_STRIPE_API_BASE=stripe_api.url)
    request.addfinalizer(serve.stop)
    serve.start()
    engine = make_engine(database_url)
    request.addfinalizer(engine.dispose)
    return Site(serve.url, database_url, engine, inbox, standin, worker_server, customer["id"], owner["id"], worker["id"],
                customer_token, accountant_token, platform["id"])


def test_a_customer_an_owner_and_an_accountant_use_the_console(site, browser):
    customer = arrive(browser, site, "customer", CUSTOMER)
    sign_in(customer)
    overview_shows(customer, "overview", available_nano_usd=0, spent_nano_usd=0)
    the_page_cannot_run_inline_script_nor_read_the_session(customer)
    top_up_by_card(customer, TOP_UP_USD)
    overview_shows(customer, "overview-topped-up", available_nano_usd=TOP_UP_NANO_USD, spent_nano_usd=0)
    key = create_api_key(customer, "browser test")
    open_the_activity(customer)
    call = call_the_api(site, key)
    cost_nano_usd = call.cost_nano_usd
    the_call_shows_live(customer, call)
    overview_shows(customer, "overview-spent", available_nano_usd=TOP_UP_NANO_USD - cost_nano_usd, spent_nano_usd=cost_nano_usd)
    download_the_invoice(customer)
    set_a_low_balance_alert(customer, ALERT_USD, ALERT_NANO_USD)
    customer.watch.assert_clean()

    owner = arrive(browser, site, "owner", OWNER)
    sign_in(owner)
    earnings_show(owner, site.worker_id, cost_nano_usd * OWNER_SHARE_PERCENT // 100)
    drain_the_worker(owner, site.worker_id)
    owner.watch.assert_clean()

    accountant = arrive(browser, site, "accountant", ACCOUNTANT)
    sign_in(accountant)
    ledger_csv_agrees_with_the_statement(accountant, closing_nano_usd=TOP_UP_NANO_USD - cost_nano_usd)
    download_the_months_zip(accountant)
    reconciliation_balances(accountant, closing_nano_usd=TOP_UP_NANO_USD - cost_nano_usd)
    accountant.watch.assert_clean()

    admin = arrive(browser, site, "admin", ADMIN)
    sign_in(admin, lands=CHOOSER)
    look(admin, "choose")
    admin_pages_show_the_platform(admin)
    admin.watch.assert_clean()


# --- Who arrives, and how every page is looked at ------------------------------------------------

def arrive(browser: Browser, site: Site, name: str, email: str) -> Person:
    """A fresh browser for one person: 1280 px wide, allowed the clipboard, axe-core in every page.
    axe is added as an init script, which the page's CSP does not govern; the pages' own CSP stays on."""
    context = browser.new_context(base_url=site.url, viewport={"width": WIDE_PX, "height": VIEWPORT_HEIGHT_PX},
                                  accept_downloads=True)
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=site.url)
    context.add_init_script(path=str(AXE_SCRIPT))
    context.set_default_timeout(UI_TIMEOUT_MS)
    page = context.new_page()
    return Person(name, email, site, context, page, PageWatch(page))


def visit(person: Person, path: str, name: str, *, until=None) -> None:
    """Open a page of the console, reloaded until `until()` holds when given, and look at it (`look`)."""
    response = person.page.goto(path)
    assert response is not None and response.status == 200, (path, response and response.status)
    assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    if until is not None:
        reload_until(person, until)
    look(person, name)


def look(person: Person, name: str) -> None:
    """What every page must be: no inline script, no serious or critical accessibility violation,
    nothing wider than a 360 px phone; screenshotted whole at 1280 px and at 360 px."""
    page = person.page
    page.wait_for_load_state("load")
    scripts = page.evaluate("""() => [...document.scripts]
        .filter((s) => !s.src && s.type !== "application/json").map((s) => s.outerHTML.slice(0, 120))""")
    assert scripts == [], f"{name}: inline scripts {scripts}"
    _no_blocking_axe_violation(page, name)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / f"{person.name}-{name}.png", full_page=True)
    page.set_viewport_size({"width": NARROW_PX, "height": VIEWPORT_HEIGHT_PX})
    try:
        _fits_the_screen(page, name)
        page.screenshot(path=SCREENSHOTS / f"{person.name}-{name}-{NARROW_PX}.png", full_page=True)
    finally:
        page.set_viewport_size({"width": WIDE_PX, "height": VIEWPORT_HEIGHT_PX})


def _fits_the_screen(page: Page, name: str) -> None:
    """Nothing wider than the screen once the page has laid itself out again (the charts redraw on resize)."""
    try:
        page.wait_for_function("() => document.documentElement.scrollWidth <= document.documentElement.clientWidth",
                               timeout=CHECK_TIMEOUT_MS)
    except PlaywrightTimeoutError:
        overflow = page.evaluate("() => document.documentElement.scrollWidth - document.documentElement.clientWidth")
        raise AssertionError(f"{name}: the page is {overflow} px wider than a {page.viewport_size['width']} px screen") from None


def _no_blocking_axe_violation(page: Page, name: str) -> None:
    violations = page.evaluate("""async () => (await axe.run(document, {resultTypes: ["violations"]})).violations
        .map((v) => ({id: v.id, impact: v.impact, help: v.help, nodes: v.nodes.map((n) => n.target.join(" "))}))""")
    blocking = [v for v in violations if v["impact"] in BLOCKING_IMPACTS]
    assert blocking == [], f"{name}: accessibility violations {json.dumps(blocking, indent=1)}"


def money_of(page: Page, selector: str) -> int:
    """The exact nano-USD of a money figure: its title says '1,234 nano-USD'."""
    title = page.locator(f"{selector} .money").get_attribute("title")
    assert title and title.endswith(" nano-USD"), (selector, title)
    return int(title.removesuffix(" nano-USD").replace(",", ""))


def reload_until(person: Person, shown, timeout_s: float = SETTLED_TIMEOUT_S) -> None:
    """Reload until `shown()` holds: what the server wrote shows once its read models have it."""
    def check() -> bool:
        if shown():
            return True
        person.page.reload()
        return False

    try:
        wait_for(check, timeout_s=timeout_s, interval_s=0.5)
    except AssertionError:
        raise AssertionError(f"{person.page.url} never showed what was expected") from None


# --- Signing in ------------------------------------------------------------------------------

ACCOUNT_HOME = re.compile(r"/console/\d+/\w+")
CHOOSER = re.compile(r"/console/?$")  # where a platform admin lands: any account may be theirs to look at


def sign_in(person: Person, lands: re.Pattern = ACCOUNT_HOME) -> None:
    """Ask for a link in the browser, receive it by SMTP, open it and confirm; land on the account's home."""
    page, site = person.page, person.site
    visit(person, "/console/sign-in", "sign-in")
    page.get_by_label("Email address").fill(person.email)
    mailed_before = len(site.inbox.messages)
    page.get_by_role("button", name="Email me a sign-in link").click()
    expect(page.get_by_role("heading", name="Check your inbox")).to_be_visible(timeout=UI_TIMEOUT_MS)
    look(person, "sign-in-sent")
    link = _mailed_link(site, person.email, mailed_before)
    assert link.startswith(site.url + "/console/sign-in/"), link
    visit(person, link, "sign-in-confirm")
    page.locator("#confirm-sign-in").click()
    page.wait_for_url(lands)
    assert any(c["name"] == SESSION_COOKIE for c in person.context.cookies()), "signed in, with a session cookie"


def _mailed_link(site: Site, address: str, mailed_before: int) -> str:
    link = re.compile(re.escape(site.url) + r"/console/sign-in/\S+")

    def arrived() -> str | None:
        for message in site.inbox.messages[mailed_before:]:
            if message["To"] == address and (found := link.search(message.get_body(("plain",)).get_content())):
                return found.group(0)
        return None

    return wait_for(arrived, timeout_s=MAIL_TIMEOUT_S)


def the_page_cannot_run_inline_script_nor_read_the_session(person: Person) -> None:
    """In a second tab of the same session (its console error is the point, not a fault of the page):
    an inline script added to the page is refused by script-src, and document.cookie lacks the session."""
    tab = person.context.new_page()
    try:
        response = tab.goto(person.account_path)
        assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        outcome = tab.evaluate("""(waitMs) => new Promise((resolve) => {
            document.addEventListener("securitypolicyviolation",
                (e) => resolve({directive: e.effectiveDirective, ran: window.__inlineRan === true}), {once: true});
            const script = document.createElement("script");
            script.textContent = "window.__inlineRan = true;";
            document.head.appendChild(script);
            setTimeout(() => resolve({directive: null, ran: window.__inlineRan === true}), waitMs);
        })""", CHECK_TIMEOUT_MS)
        assert outcome == {"directive": "script-src-elem", "ran": False}, outcome
        assert SESSION_COOKIE not in tab.evaluate("() => document.cookie")
        session = [c for c in person.context.cookies() if c["name"] == SESSION_COOKIE]
        assert len(session) == 1 and session[0]["httpOnly"] is True
    finally:
        tab.close()


# --- A customer's ----------------------------------------------------------------------------

def overview_shows(person: Person, name: str, *, available_nano_usd: int, spent_nano_usd: int) -> None:
    """The balance, and the spend of the last 30 days (a run across midnight UTC still sees its own)."""
    visit(person, f"/console/{person.site.customer_id}/overview", name,
          until=lambda: (money_of(person.page, "#available"), money_of(person.page, "#spend-30d"))
          == (available_nano_usd, spent_nano_usd))


def top_up_by_card(person: Person, amount_usd: str) -> None:
    """The form posts; the browser moves on to Stripe Checkout (the stand-in's URL, answered here); the
    customer pays there, Stripe sends the signed webhook and the customer back to the console."""
    page, site = person.page, person.site
    visit(person, f"/console/{site.customer_id}/top-up", "top-up")
    page.route(f"https://{CHECKOUT_HOST}/**", lambda route: route.fulfill(
        status=200, content_type="text/html", body="<!doctype html><title>Stripe Checkout</title><p>Pay</p>"))
    page.get_by_label(re.compile(r"^Amount in USD")).fill(amount_usd)
    with page.expect_request(re.compile(rf"^https://{re.escape(CHECKOUT_HOST)}/")) as checkout:
        page.get_by_role("button", name="Pay with Stripe").click()
    session_id = checkout.value.url.rsplit("/", 1)[1]
    assert session_id in site.standin.sessions_by_id, checkout.value.url

    session = site.standin.pay(session_id)
    assert session["client_reference_id"] == str(site.customer_id) and session["amount_total"] == 2500
    event = session_event("checkout.session.completed", session)
    delivered = httpx.post(site.url + "/webhooks/stripe", content=event, timeout=60,
                           headers={"content-type": "application/json", "stripe-signature": signed(event, WEBHOOK_SECRET)})
    assert delivered.status_code == 200, delivered.text
    created = next(r for r in site.standin.requests if r["path"] == "/v1/checkout/sessions")
    page.goto(created["form"]["success_url"].replace("{CHECKOUT_SESSION_ID}", session_id))
    page.wait_for_url(re.compile(rf"/console/{site.customer_id}/overview$"))


def create_api_key(person: Person, name: str) -> str:
    """Create a key on the Keys page; it is shown once, and Copy puts it in the clipboard."""
    page = person.page
    visit(person, f"/console/{person.site.customer_id}/keys", "keys")
    page.get_by_label("Name", exact=True).fill(name)
    with page.expect_navigation(wait_until="load"):  # the Copy button works once the page's script has run
        page.get_by_role("button", name="Create key").click()
    shown = page.locator("#new-key")
    expect(shown).to_be_visible(timeout=UI_TIMEOUT_MS)
    key = shown.inner_text().strip()
    assert key.startswith("sk-par-"), key
    copy = page.locator("button.copy[data-copy=new-key]")
    copy.click()
    expect(copy).to_have_text("Copied", timeout=UI_TIMEOUT_MS)
    assert page.evaluate("() => navigator.clipboard.readText()") == key
    look(person, "keys-created")
    return key


@dataclass(frozen=True)
class Call:
    request_id: str
    cost_nano_usd: int
    returned_at: float  # time.monotonic() when the SDK returned


def call_the_api(site: Site, key: str) -> Call:
    """One chat completion with the official SDK; its request id and exact cost, as the headers and the usage say."""
    client = openai.OpenAI(base_url=site.url + "/v1", api_key=key, max_retries=0, timeout=60)
    wait_for(lambda: MODEL in {m.id for m in client.models.list().data}, timeout_s=SETTLED_TIMEOUT_S, interval_s=0.2)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello to the console."}], max_tokens=16)
    returned_at = time.monotonic()
    completion = raw.parse()
    cost_nano_usd = int(raw.headers["x-paralon-cost-nano-usd"])
    assert cost_nano_usd > 0
    assert completion.usage.model_extra["cost_details"]["nano_usd"] == cost_nano_usd
    return Call(raw.headers["x-request-id"], cost_nano_usd, returned_at)


def open_the_activity(person: Person) -> None:
    """The Activity page, open before the call it will show; it polls for new rows itself."""
    visit(person, f"/console/{person.site.customer_id}/activity", "activity")
    expect(person.page.locator("#activity-empty")).to_be_visible()


def the_call_shows_live(person: Person, call: Call) -> None:
    """Without a reload, the call's row appears within 5 s of the SDK returning, with its exact cost."""
    page = person.page
    url_before = page.url
    row = page.locator(f'[id="gen-{call.request_id}"]')
    expect(row).to_be_visible(timeout=LIVE_ROW_TIMEOUT_MS)
    waited_s = time.monotonic() - call.returned_at
    assert waited_s <= LIVE_ROW_TIMEOUT_MS / 1000, f"the row appeared {waited_s:.1f} s after the call returned"
    assert page.url == url_before
    expect(page.locator("#activity-empty")).to_be_hidden()
    title = row.locator(".money").get_attribute("title")
    assert title == f"{call.cost_nano_usd:,} nano-USD", (title, call.cost_nano_usd)
    look(person, "activity-live")


def set_a_low_balance_alert(person: Person, amount_usd: str, amount_nano_usd: int) -> None:
    """By keyboard alone: Tab from the top of the page reaches the skip link first and then the alert's
    field with a visible focus ring; typing and Enter save the threshold, which the page then shows."""
    page = person.page
    visit(person, f"/console/{person.site.customer_id}/alerts", "alerts")
    page.keyboard.press("Tab")
    assert page.evaluate("() => document.activeElement.textContent") == "Skip to content"
    tab_to(page, "#threshold")
    assert page.evaluate("() => getComputedStyle(document.activeElement).outlineStyle") != "none"
    page.keyboard.type(amount_usd)
    with page.expect_navigation(wait_until="load"):
        page.keyboard.press("Enter")
    expect(page.locator("#alert-threshold")).to_be_visible(timeout=UI_TIMEOUT_MS)
    title = page.locator("#alert-threshold .money").get_attribute("title")
    assert title == f"{amount_nano_usd:,} nano-USD", title
    look(person, "alerts-set")


def tab_to(page: Page, selector: str) -> None:
    """Presses Tab until `selector` has the focus; a page that traps or skips it fails here."""
    for _ in range(MAX_TABS):
        if page.evaluate("(s) => document.activeElement.matches(s)", selector):
            return
        page.keyboard.press("Tab")
    raise AssertionError(f"{MAX_TABS} presses of Tab never reached {selector}")


def download_the_invoice(person: Person) -> None:
    """The top-up's invoice from Documents is the very PDF the ledger recorded (its SHA-256)."""
    page, site = person.page, person.site
    listed = wait_for(lambda: [i for i in site.api("/v1/invoices", site.customer_token).json()["data"] if i["pdf_sha256"]],
                      timeout_s=SETTLED_TIMEOUT_S, interval_s=0.5)
    assert len(listed) == 1, listed
    invoice = listed[0]
    visit(person, f"/console/{site.customer_id}/documents", "documents")
    link = page.get_by_role("link", name=f"Download {invoice['number']}")
    with page.expect_download() as download:
        link.click()
    assert download.value.suggested_filename == f"{invoice['number']}.pdf"
    content = Path(download.value.path()).read_bytes()
    assert content.startswith(b"%PDF-")
    assert hashlib.sha256(content).hexdigest() == invoice["pdf_sha256"]


# --- An owner's ------------------------------------------------------------------------------

def earnings_show(person: Person, worker_id: int, earned_nano_usd: int) -> None:
    """The owner's share of what the worker served, on that worker's row and in the 30 days' total."""
    cell = f"#worker-earned-{worker_id}"
    visit(person, f"/console/{person.site.owner_id}/earnings", "earnings",
          until=lambda: person.page.locator(cell).count() == 1 and money_of(person.page, cell) == earned_nano_usd)
    assert money_of(person.page, "#earn-30d") == earned_nano_usd


def drain_the_worker(person: Person, worker_id: int) -> None:
    """Drain from the Workers page. The worker is switched off first: a draining worker that answers
    no probe stays draining (until its deadline), where an idle, healthy one becomes drained at the
    next health check, which the page would race."""
    page, site = person.page, person.site
    site.worker_server.stop()
    row = page.locator(f"#worker-{worker_id}")
    visit(person, f"/console/{site.owner_id}/workers", "workers", until=lambda: "unhealthy" in row.locator(".state").inner_text())
    with page.expect_navigation(wait_until="load"):
        row.get_by_role("button", name=f"Drain worker {worker_id}").click()
    assert urlsplit(page.url).path == f"/console/{site.owner_id}/workers"
    expect(row.locator(".state")).to_contain_text("draining", timeout=UI_TIMEOUT_MS)
    expect(row.get_by_role("button")).to_have_count(0, timeout=UI_TIMEOUT_MS)
    with site.engine.connect() as conn:
        assert registry.get_worker(conn, worker_id).state == "draining"
    look(person, "workers-draining")


# --- An accountant's -------------------------------------------------------------------------

def ledger_csv_agrees_with_the_statement(person: Person, closing_nano_usd: int) -> None:
    """This month's ledger CSV from Documents opens and closes where the month's statement does."""
    page, site = person.page, person.site
    visit(person, f"/console/{site.customer_id}/documents", "documents")
    month = page.locator("#csv-from").input_value()
    with page.expect_download() as download:
        page.get_by_role("button", name="Download CSV").click()
    rows = list(csv.DictReader(io.StringIO(Path(download.value.path()).read_text())))
    assert rows, "the month has postings"
    opening = int(rows[0]["balance_after_nano_usd"]) - int(rows[0]["amount_nano_usd"])
    closing = int(rows[-1]["balance_after_nano_usd"])
    statement = site.api(f"/v1/statements/{month}.json", site.accountant_token)
    assert statement.status_code == 200, statement.text
    figures = statement.json()
    assert (opening, closing) == (figures["opening_balance_nano_usd"], figures["closing_balance_nano_usd"])
    assert closing == closing_nano_usd


def _this_and_next_month() -> tuple[str, str]:
    now = datetime.now(UTC)
    after = datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=UTC)
    return now.strftime("%Y-%m"), after.strftime("%Y-%m")


def download_the_months_zip(person: Person) -> None:
    """This month's PDFs in one zip from Documents: the invoice the ledger recorded (its SHA-256), and a manifest."""
    page, site = person.page, person.site
    month, after = _this_and_next_month()
    invoices = [i for i in site.api("/v1/invoices", site.accountant_token).json()["data"] if i["pdf_sha256"]]
    assert len(invoices) == 1, invoices
    invoice = invoices[0]
    visit(person, f"/console/{site.customer_id}/documents?from={month}&to={after}", "documents-period")
    with page.expect_download() as download:
        page.locator("#documents-zip").click()
    with zipfile.ZipFile(download.value.path()) as archive:
        names = archive.namelist()
        assert "manifest.csv" in names, names
        pdf_name = f"invoices/{invoice['number']}.pdf"
        assert pdf_name in names, names
        assert hashlib.sha256(archive.read(pdf_name)).hexdigest() == invoice["pdf_sha256"]
        manifest = list(csv.DictReader(io.StringIO(archive.read("manifest.csv").decode())))
    assert {"name": pdf_name, "sha256": invoice["pdf_sha256"]}.items() <= next(
        r for r in manifest if r["name"] == pdf_name).items(), manifest


def reconciliation_balances(person: Person, closing_nano_usd: int) -> None:
    """This month's reconciliation adds up as shown, closes where the statement and the ledger CSV do,
    and a full ledger verify (the CLI, on the same database) has checked at least as far."""
    page, site = person.page, person.site
    month, after = _this_and_next_month()
    visit(person, f"/console/{site.customer_id}/reconciliation?from={month}&to={after}", "reconciliation")
    opening, closing = money_of(page, "#r-opening"), money_of(page, "#r-closing")
    figure_ids = page.locator("#reconciliation td.num").evaluate_all("(cells) => cells.map((c) => c.id)")
    figures = [money_of(page, f"#{cell}") for cell in figure_ids if cell not in ("r-opening", "r-closing")]
    assert figures, figure_ids
    assert opening + sum(figures) == closing, (opening, figures, closing)
    assert closing == closing_nano_usd
    expect(page.locator("#r-verdict")).to_contain_text("Balanced")
    through_seq = int(page.locator("#r-through-seq").inner_text())

    statement = site.api(f"/v1/statements/{month}.json", site.accountant_token)
    assert statement.status_code == 200, statement.text
    assert statement.json()["closing_balance_nano_usd"] == closing
    exported = page.request.get(f"/console/{site.customer_id}/exports/ledger.csv?from={month}&to={after}")
    assert exported.status == 200, exported.text()
    assert int(exported.headers["x-paralon-closing-balance-nano-usd"]) == closing

    verified = _cli(site.database_url, "ledger", "verify")
    assert verified["ok"] is True, verified
    assert verified["events_checked"] >= through_seq, (verified, through_seq)


# --- A platform admin's ----------------------------------------------------------------------

def admin_pages_show_the_platform(person: Person) -> None:
    """The fleet, the accounts, the models and the status, with the scheduled ledger verify's result."""
    page, site = person.page, person.site
    base = f"/console/{site.platform_id}"
    visit(person, f"{base}/fleet", "fleet")
    expect(page.get_by_text(site.worker_server.url)).to_be_visible()
    visit(person, f"{base}/accounts", "accounts")
    expect(page.get_by_text("Example Customer")).to_be_visible()
    visit(person, f"{base}/models", "models")
    expect(page.get_by_text(MODEL).first).to_be_visible()
    verified = run_verification(site.engine)  # what the scheduled job does
    assert verified["ok"] is True, verified
    visit(person, f"{base}/status", "status")
    expect(page.locator("#verify-result")).to_have_text("passed")
    expect(page.get_by_text(f"through event {verified['verified_seq']}")).to_be_visible()
