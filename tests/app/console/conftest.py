"""The console behind Litestar's test client on SQLite: a customer, an owner
and the platform, each with members of every role their kind takes, another
customer and owner to be foreign to them, and a real SMTP server (aiosmtpd)
that receives the sign-in links."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest
from aiosmtpd.controller import Controller
from litestar.testing import TestClient
from sqlalchemy import select

from app.console.signin import ConsoleSettings
from app.http.console.web import SESSION_COOKIE
from app.http.factory import create_app
from app.members import add_member
from app.migrate import migrate
from app.payments.chain_settings import CryptoSettings
from app.payments.stripe import StripeSettings
from invoices.mail import MailSettings
from invoices.service import InvoiceSettings, issue_for_top_up
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.db import make_engine
from ledger.holds import PlaceHold, settlement_key
from ledger.schema import accounts
from ledger.service import Ledger
from proxy import keys as api_keys
from proxy import prices
from proxy import workers as registry
from tests.invoices.test_mail import Inbox as MailInbox
from tests.support.harness import free_port
from tests.ledger.helpers import money_snapshot

MODEL = "paralon-test"
CREDITS_NANO_USD = 10 * 10**9
SETTLED_CHARGE_NANO_USD = 3_000_123
UNREACHABLE_WORKER_URL = "http://127.0.0.1:1"
LINK = re.compile(r"http://console\.test(/console/sign-in/\S+)")
CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')

# Who signs in, the account they belong to (a key of Console.accounts) and their role.
PEOPLE = {
    "customer_admin@example.com": ("customer", "customer_admin"),
    "viewer@example.com": ("customer", "customer_viewer"),
    "accountant@example.com": ("customer", "accountant"),
    "owner@example.com": ("owner", "owner"),
    "admin@example.com": ("platform", "platform_admin"),
    "other_customer@example.com": ("other_customer", "customer_admin"),
    "other_owner@example.com": ("other_owner", "owner"),
}


class Inbox(MailInbox):
    def links_to(self, address: str) -> list[str]:
        return [LINK.search(m.get_content()).group(1) for m in self.messages if m["To"] == address]


@dataclass
class Console:
    client: TestClient
    engine: object
    inbox: Inbox
    accounts: dict[str, int]
    worker_id: int
    other_worker_id: int
    key_id: int
    other_key_id: int
    invoice_number: str  # the customer's, of a card top-up
    sessions: dict[str, str] = field(default_factory=dict)  # address -> session cookie

    def request(self, method: str, path: str, as_: str | None = None, **kwargs):
        """As the person signed in with `as_` (None: nobody); nothing else of the client's jar is sent."""
        self.client.cookies.clear()
        if as_ is not None:
            self.client.cookies.set(SESSION_COOKIE, self.sessions[as_], path="/console")
        try:
            return self.client.request(method, path, follow_redirects=False, **kwargs)
        finally:
            self.client.cookies.clear()

    def get(self, path: str, as_: str | None = None, **kwargs):
        return self.request("GET", path, as_, **kwargs)

    def post_form(self, path: str, as_: str, data: dict | None = None, csrf_from: str | None = None):
        """A form as the page `csrf_from` (default: the account's home) would send it."""
        return self.request("POST", path, as_, data={"csrf_token": self.csrf_token(as_, csrf_from or "/console/"), **(data or {})})

    def csrf_token(self, as_: str, page: str) -> str:
        """The CSRF token on `page` (or where it redirects to)."""
        answer = self.get(page, as_)
        while answer.status_code in (301, 302, 303, 307):
            answer = self.get(answer.headers["location"], as_)
        return CSRF.search(answer.text).group(1)

    def sign_in(self, address: str, ip: str = "testclient") -> str:
        """The whole flow: ask, receive the mail, confirm; returns the session cookie."""
        self.client.cookies.clear()
        form = self.client.get("/console/sign-in")
        sent = self.client.post("/console/sign-in", data={"csrf_token": CSRF.search(form.text).group(1), "email": address})
        assert sent.status_code == 200, sent.text
        link = self.inbox.links_to(address)[-1]
        confirm = self.client.get(link)
        done = self.client.post(link.split("?")[0], data={"csrf_token": CSRF.search(confirm.text).group(1), "next": "/console"},
                                follow_redirects=False)
        assert done.status_code in (302, 303), done.text
        secret = done.cookies[SESSION_COOKIE]
        self.client.cookies.clear()
        self.sessions[address] = secret
        return secret

    def money(self) -> dict:
        return money_snapshot(self.engine)


@pytest.fixture
def inbox():
    box, port = Inbox(), free_port()
    server = Controller(box, hostname="127.0.0.1", port=port)
    server.start()
    box.port = port
    yield box
    server.stop()


@pytest.fixture
def console(tmp_path, inbox):
    engine = make_engine(f"sqlite:///{tmp_path}/paralon.db")
    migrate(engine)
    ledger = Ledger(engine)
    made = _accounts(engine, ledger)
    made["invoice_number"] = _invoice(engine, ledger, made["accounts"]["customer"], tmp_path / "invoices")
    app = create_app(
        ledger, key_cache_ttl_s=0, health_interval_s=60,
        stripe_settings=StripeSettings(None, None, None, 500, 1_000_000, "http://test/done", "http://test/cancelled"),
        crypto_settings=CryptoSettings(None, (), 12, None), invoice_settings=InvoiceSettings(tmp_path / "invoices"),
        console_settings=ConsoleSettings("http://console.test", MailSettings("127.0.0.1", inbox.port)),
    )
    with TestClient(app) as client:
        yield Console(client=client, engine=engine, inbox=inbox, **made)
    ledger.close()
    engine.dispose()


def _accounts(engine, ledger: Ledger) -> dict:
    with engine.begin() as conn:
        made = {name: acc.create_account(conn, kind, name.replace("_", " ").title()) for name, kind in (
            ("customer", cmd.CUSTOMER), ("other_customer", cmd.CUSTOMER), ("owner", cmd.OWNER), ("other_owner", cmd.OWNER))}
        made["platform"] = conn.execute(select(accounts.c.id).where(accounts.c.system_code == "platform:revenue")).scalar_one()
        for address, (account, role) in PEOPLE.items():
            add_member(conn, made[account], address, role)
        prices.set_price(conn, MODEL, "0.10", "0.20")
        worker = registry.add_worker(conn, made["owner"], UNREACHABLE_WORKER_URL, MODEL)
        other_worker = registry.add_worker(conn, made["other_owner"], UNREACHABLE_WORKER_URL, MODEL)
        key_id, _ = api_keys.create_key(conn, made["customer"], name="ci")
        other_key_id, _ = api_keys.create_key(conn, made["other_customer"], name="theirs")
    ledger.append(cmd.GrantCredits(made["customer"], CREDITS_NANO_USD, "test credits", "test:grant"))
    hold = ledger.place_hold(PlaceHold(made["customer"], 10 * SETTLED_CHARGE_NANO_USD, "test:hold"))
    ledger.append(cmd.SettleRequest(hold.hold_id, made["owner"], SETTLED_CHARGE_NANO_USD, "req-settled", settlement_key("req-settled"),
                                    {"model": MODEL, "prompt_tokens": 10, "completion_tokens": 10, "worker_id": worker,
                                     "api_key_id": key_id}))
    return dict(accounts=made, worker_id=worker, other_worker_id=other_worker, key_id=key_id, other_key_id=other_key_id)


def _invoice(engine, ledger: Ledger, customer: int, invoice_dir) -> str:
    seq = ledger.append(cmd.PurchaseCredits(customer, 2_500_000_000, "card", "stripe:cs_console", "external:stripe",
                                            "console:top-up")).seq
    return issue_for_top_up(engine, InvoiceSettings(invoice_dir), seq)["number"]


@pytest.fixture
def signed_in(console):
    """Every person of PEOPLE signed in."""
    for address in PEOPLE:
        console.sign_in(address)
    return console
