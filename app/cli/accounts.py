"""`paralon accounts` and `paralon tokens`: who exists, and who may act for
them through the management API."""
from __future__ import annotations

import click
from sqlalchemy import select

from app import low_balance
from app.cli.output import emit, engine, fail, handles_errors, json_option
from app.tokens import ROLES, create_token, revoke_token
from ledger import accounts as acc
from ledger import commands as cmd
from ledger.schema import accounts as accounts_table


@click.group("accounts")
def accounts_group() -> None:
    """Customer and GPU-owner accounts."""


@accounts_group.command("create")
@click.option("--kind", type=click.Choice([cmd.CUSTOMER, cmd.OWNER]), required=True)
@click.option("--name", required=True)
@click.option("--email", default=None, help="Where invoices and statements go.")
@json_option
@handles_errors
def accounts_create(kind: str, name: str, email: str | None, as_json: bool) -> None:
    with engine().begin() as conn:
        account_id = acc.create_account(conn, kind, name, email)
    emit(as_json, {"id": account_id, "kind": kind, "name": name, "email": email}, f"created {kind} account {account_id}")


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
    """Management tokens (roles: customer, accountant, owner, admin), shown once, stored hashed."""


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


COMMANDS = (accounts_group, tokens_group)
