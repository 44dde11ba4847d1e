"""A customer's overview and an owner's earnings page each read in one go what
the management API's functions give one by one: the same figures, of the
account's own rows only, over the same windows."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

from app import accounts
from app.limits import SUMMARY_WINDOW_DAYS_MAX
from app.tokens import CUSTOMER, Principal
from invoices.schema import earnings_daily, usage_daily
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.service import append_now

MODELS = ("alpha-7b", "beta-70b")  # names every collation orders alike
WORKERS = (3, 11)
KEYS = (0, 5)  # 0: a request without a key
TODAY = datetime.now(UTC).date()
DAYS_AGO = (0, 1, 6, 7, 29, 30, 45)  # the windows' edges, and days before the 30
SINCE = accounts._day_text(TODAY, SUMMARY_WINDOW_DAYS_MAX)


def _day(days_ago: int) -> str:
    return (TODAY - timedelta(days=days_ago)).isoformat()


def test_the_overview_reads_what_the_usage_functions_give(engine):
    with engine.begin() as conn:
        customer = acc.create_account(conn, cmd.CUSTOMER, "Customer")
        other = acc.create_account(conn, cmd.CUSTOMER, "Other customer")
        conn.execute(usage_daily.insert(), [
            {"account_id": account, "api_key_id": key, "model": model, "day": _day(n), "requests": 1 + n + account,
             "prompt_tokens": 100 * n + key, "completion_tokens": 10 * n + 1, "cost_nano_usd": 1_000 * (n + 1) + 7 * key + account}
            for account in (customer, other) for key in KEYS for model in MODELS for n in DAYS_AGO])
    append_now(engine, cmd.GrantCredits(customer, 5 * 10**9, "credits", "grant:overview"))
    who = Principal(None, customer, CUSTOMER)
    with engine.connect() as conn:
        seen = accounts.usage_overview(conn, who, TODAY)
        assert seen == {"balance": accounts.account_view(conn, who), "summary": accounts.usage_summary(conn, customer, TODAY),
                        "by_day_model": accounts.usage(conn, customer, "day,model", SINCE),
                        "by_model": accounts.usage(conn, customer, "model", SINCE)}
    assert seen["summary"]["spend_30d_nano_usd"] > seen["summary"]["spend_7d_nano_usd"] > seen["summary"]["spend_1d_nano_usd"] > 0
    assert seen["summary"]["days_left"] is not None
    assert [row["model"] for row in seen["by_model"]] == list(MODELS)


def test_the_earnings_page_reads_what_the_earnings_functions_give(engine):
    with engine.begin() as conn:
        owner = acc.create_account(conn, cmd.OWNER, "Owner")
        other = acc.create_account(conn, cmd.OWNER, "Other owner")
        conn.execute(earnings_daily.insert(), [
            {"owner_account_id": account, "worker_id": worker, "model": model, "day": _day(n), "requests": 2 + n,
             "earnings_nano_usd": 800 * (n + 1) + worker + account}
            for account in (owner, other) for worker in WORKERS for model in MODELS for n in DAYS_AGO])
    with engine.connect() as conn:
        seen = accounts.earnings_overview(conn, owner, TODAY)
        assert seen == {"summary": accounts.earnings_summary(conn, owner, TODAY),
                        "by_day_worker": accounts.earnings(conn, owner, "day,worker", SINCE),
                        "by_day_model": accounts.earnings(conn, owner, "day,model", SINCE)}
    assert seen["summary"]["earnings_30d_nano_usd"] > seen["summary"]["earnings_7d_nano_usd"] > 0
    assert {row["day"] for row in seen["by_day_worker"]} == {_day(n) for n in DAYS_AGO if n < SUMMARY_WINDOW_DAYS_MAX}
