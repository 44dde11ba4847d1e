"""The real HTTP app on SQLite behind Litestar's test client: two customers
(one with credits, an API key and a settled request), two owners with a worker
each, and a management token for every role."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from litestar.testing import TestClient
from sqlalchemy import select

from app.http.factory import create_app
from app.migrate import migrate
from app.payments.chain_settings import CryptoSettings
from app.payments.stripe import StripeSettings
from app.tokens import ACCOUNTANT, ADMIN, CUSTOMER, OWNER, VIEWER, create_token, revoke_token
from invoices.service import InvoiceSettings
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.db import make_engine
from ledger.holds import PlaceHold, settlement_key
from ledger.schema import accounts
from ledger.service import Ledger
from proxy import keys as api_keys
from proxy import prices
from proxy import workers as registry
from tests.conftest import migrated_database_url
from tests.ledger.helpers import money_snapshot

MODEL = "paralon-test"
CREDITS_NANO_USD = 10 * 10**9
SETTLED_CHARGE_NANO_USD = 3_000
UNREACHABLE_WORKER_URL = "http://127.0.0.1:1"  # health probes fail at once; nothing is routed there


@dataclass
class Site:
    client: TestClient
    engine: object
    customer_id: int
    other_customer_id: int
    owner_id: int
    other_owner_id: int
    worker_id: int
    other_worker_id: int
    key: str  # the customer's API key
    key_id: int
    other_key: str  # the other customer's
    settled_request_id: str  # a request of the customer's, settled
    tokens: dict[str, str]  # customer, viewer, accountant, owner, admin, other_customer, other_owner, revoked
    token_ids: dict[str, int]

    def call(self, method: str, path: str, token: str | None = None, **kwargs):
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return self.client.request(method, path, headers=headers, **kwargs)

    def money(self) -> dict:
        return money_snapshot(self.engine)


@pytest.fixture
def site(tmp_path):
    yield from _site(f"sqlite:///{tmp_path}/paralon.db", tmp_path)


@pytest.fixture(params=["sqlite", "postgresql"])
def site_each_storage(request, tmp_path):
    """The same site on each storage: PostgreSQL refuses what SQLite stores (a NUL in text, for one)."""
    yield from _site(migrated_database_url(request, request.param, tmp_path), tmp_path)


def _site(database_url: str, tmp_path):
    engine = make_engine(database_url)
    migrate(engine)
    ledger = Ledger(engine)
    people = _people(engine, ledger)
    app = create_app(
        ledger, key_cache_ttl_s=0, health_interval_s=60,
        stripe_settings=StripeSettings(None, None, None, 500, 1_000_000, "http://test/done", "http://test/cancelled"),
        crypto_settings=CryptoSettings(None, (), 12, None), invoice_settings=InvoiceSettings(tmp_path / "invoices"),
    )
    with TestClient(app) as client:
        yield Site(client=client, engine=engine, **people)
    ledger.close()
    engine.dispose()


def _people(engine, ledger: Ledger) -> dict:
    with engine.begin() as conn:
        customer, other_customer = (acc.create_account(conn, cmd.CUSTOMER, name) for name in ("Ada", "Grace"))
        owner, other_owner = (acc.create_account(conn, cmd.OWNER, name) for name in ("GPU farm", "another farm"))
        platform = conn.execute(select(accounts.c.id).where(accounts.c.system_code == "platform:revenue")).scalar_one()
        prices.set_price(conn, MODEL, "0.10", "0.20")
        worker = registry.add_worker(conn, owner, UNREACHABLE_WORKER_URL, MODEL)
        other_worker = registry.add_worker(conn, other_owner, UNREACHABLE_WORKER_URL, MODEL)
        key_id, key = api_keys.create_key(conn, customer, name="ci")
        _, other_key = api_keys.create_key(conn, other_customer)
        made = {name: create_token(conn, account, role) for name, account, role in (
            ("customer", customer, CUSTOMER), ("viewer", customer, VIEWER), ("accountant", customer, ACCOUNTANT), ("owner", owner, OWNER),
            ("admin", platform, ADMIN), ("other_customer", other_customer, CUSTOMER), ("other_owner", other_owner, OWNER),
            ("revoked", customer, CUSTOMER))}
        revoke_token(conn, made["revoked"][0])
    ledger.append(cmd.GrantCredits(customer, CREDITS_NANO_USD, "test credits", "test:grant"))
    hold = ledger.place_hold(PlaceHold(customer, 10 * SETTLED_CHARGE_NANO_USD, "test:hold"))
    ledger.append(cmd.SettleRequest(hold.hold_id, owner, SETTLED_CHARGE_NANO_USD, "req-settled", settlement_key("req-settled"),
                                    {"model": MODEL, "prompt_tokens": 10, "completion_tokens": 10}))
    return dict(customer_id=customer, other_customer_id=other_customer, owner_id=owner, other_owner_id=other_owner,
                worker_id=worker, other_worker_id=other_worker, key=key, key_id=key_id, other_key=other_key,
                settled_request_id="req-settled", tokens={name: token for name, (_, token) in made.items()},
                token_ids={name: token_id for name, (token_id, _) in made.items()})
