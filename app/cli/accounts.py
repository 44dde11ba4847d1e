"""`paralon accounts` and `paralon tokens`: who exists, and who may act for
them through the management API; `paralon activity`: what an account's
requests did."""
from __future__ import annotations

import click
from sqlalchemy import select

from app import low_balance
from app.accounts import accounts_page
from app.activity import STATUSES, account_activity
from app.cli.output import emit, engine, fail, handles_errors, json_option
from app.limits import ACCOUNTS_PAGE_ROWS_DEFAULT, ACCOUNTS_PAGE_ROWS_MAX, ACTIVITY_ROWS_DEFAULT, ACTIVITY_ROWS_MAX
from app.members import add_first_member
from app.tokens import ROLES, create_token, revoke_token
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.money import nano_usd_to_usd_text
from ledger.schema import accounts as accounts_table


@click.group("accounts")
def accounts_group() -> None:
    """Customer and GPU-owner accounts."""


@accounts_group.command("create")
@click.option("--kind", type=click.Choice([cmd.CUSTOMER, cmd.OWNER]), required=True)
@click.option("--name", required=True)
@click.option("--email", default=None, help="Where invoices and statements go; also the account's first console member.")
@json_option
@handles_errors
def accounts_create(kind: str, name: str, email: str | None, as_json: bool) -> None:
    with engine().begin() as conn:
        account_id = acc.create_account(conn, kind, name, email)
        add_first_member(conn, account_id, kind, email)
    emit(as_json, {"id": account_id, "kind": kind, "name": name, "email": email}, f"created {kind} account {account_id}")


@accounts_group.command("list")
@click.option("--limit", type=click.IntRange(1, ACCOUNTS_PAGE_ROWS_MAX), default=ACCOUNTS_PAGE_ROWS_DEFAULT, show_default=True)
@click.option("--after-id", type=click.IntRange(min=0), default=0, show_default=True,
              help="The last id of the page before (next_after_id).")
@json_option
@handles_errors
def accounts_list(limit: int, after_id: int, as_json: bool) -> None:
    """Every account in id order, with its balances, a page at a time (GET /v1/accounts)."""
    with engine().connect() as conn:
        page = accounts_page(conn, after_id, limit)
    lines = [f"{a['id']}\t{a['kind']}\t{a['name']}\t{a['email'] or ''}\t{nano_usd_to_usd_text(a['balance_nano_usd'])} USD"
             f" (available {nano_usd_to_usd_text(a['available_nano_usd'])})" for a in page["data"]]
    if page["next_after_id"] is not None:
        lines.append(f"more: --after-id {page['next_after_id']}")
    emit(as_json, page, "\n".join(lines) or "no accounts")


@accounts_group.command("platform")
@json_option
@handles_errors
def accounts_platform(as_json: bool) -> None:
    """The platform's own account (what admin tokens act for)."""
    with engine().connect() as conn:
        account_id = conn.execute(select(accounts_table.c.id).where(accounts_table.c.system_code == "platform:revenue")).scalar_one()
    emit(as_json, {"id": account_id}, f"platform account {account_id}")


@accounts_group.command("low-balance-alert")
@click.argument("account_id", type=int)
@click.option("--threshold-usd", default=None, help="Email the account once its available balance falls below this (e.g. 2.00).")
@click.option("--off", is_flag=True, help="No more low-balance emails.")
@json_option
@handles_errors
def accounts_low_balance_alert(account_id: int, threshold_usd: str | None, off: bool, as_json: bool) -> None:
    """Set a customer's low-balance alert (once per fall below), turn it off, or, with neither option, show it."""
    if off and threshold_usd is not None:
        fail(as_json, "invalid_input", "give --threshold-usd or --off, not both")
    with engine().begin() as conn:
        if off or threshold_usd is not None:
            view = low_balance.set_alert(conn, account_id, None if off else threshold_usd)
        else:
            view = low_balance.alert_view(conn, account_id)
    emit(as_json, view, _alert_text(view))


def _alert_text(view: dict) -> str:
    if view["threshold_usd"] is None:
        return f"account {view['account_id']}: no low-balance alert"
    alerted = f", alerted at {view['alerted_at']}" if view["alerted_at"] else ""
    return f"account {view['account_id']}: an email when the available balance is below {view['threshold_usd']} USD{alerted}"


@click.group("tokens")
def tokens_group() -> None:
    """Management tokens (roles: customer, viewer, accountant, owner, admin), shown once, stored hashed."""


@tokens_group.command("create")
@click.argument("account_id", type=int)
@click.option("--role", type=click.Choice(ROLES), required=True,
              help="admin tokens act for the platform account (`paralon accounts platform`).")
@json_option
@handles_errors
def tokens_create(account_id: int, role: str, as_json: bool) -> None:
    with engine().begin() as conn:
        token_id, token = create_token(conn, account_id, role)
    emit(as_json, {"id": token_id, "token": token, "account_id": account_id, "role": role},
         f"{role} token {token_id}: {token}\n(shown once: store it now)")


@tokens_group.command("revoke")
@click.argument("token_id", type=int)
@json_option
@handles_errors
def tokens_revoke(token_id: int, as_json: bool) -> None:
    with engine().begin() as conn:
        revoke_token(conn, token_id)
    emit(as_json, {"id": token_id, "revoked": True}, f"management token {token_id} revoked")


@click.command("activity")
@click.argument("account_id", type=int)
@click.option("--model", default=None, help="Only this model's requests.")
@click.option("--key-id", type=int, default=None, help="Only this API key's requests.")
@click.option("--status", type=click.Choice(STATUSES), default=None,
              help="cancelled: cut short, billed for what was relayed; failed: not charged.")
@click.option("--after", default=None, help="The `after` cursor of an earlier call: only what is new or changed since.")
@click.option("--before", default=None, help="The `before` cursor of an earlier call: the older page.")
@click.option("--limit", type=click.IntRange(1, ACTIVITY_ROWS_MAX), default=ACTIVITY_ROWS_DEFAULT, show_default=True)
@json_option
@handles_errors
def activity(account_id: int, model: str | None, key_id: int | None, status: str | None, after: str | None,
             before: str | None, limit: int, as_json: bool) -> None:
    """An account's requests, newest first: cost, tokens, time to first token, status."""
    with engine().connect() as conn:
        page = account_activity(conn, account_id, model=model, api_key_id=key_id, status=status, after=after,
                                before=before, limit=limit)
    lines = [f"{r['completed_at']}\t{r['id']}\t{r['model']}\tkey {r['api_key_id']}\t{r['status']}\t"
             f"{r['prompt_tokens']}+{r['completion_tokens']} tokens\t{r['cost_nano_usd']} nano-USD\t"
             f"ttft {r['ttft_ms'] if r['ttft_ms'] is not None else '-'} ms" for r in page["data"]]
    emit(as_json, page, "\n".join(lines) or "no requests")


COMMANDS = (accounts_group, tokens_group, activity)
