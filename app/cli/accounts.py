"""`paralon accounts` and `paralon tokens`: who exists, and who may act for
them through the management API."""
from __future__ import annotations

import click
from sqlalchemy import select

from app.cli.output import emit, engine, handles_errors, json_option
from app.members import add_first_member
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
@click.option("--email", default=None, help="Where invoices and statements go; also the account's first console member.")
@json_option
@handles_errors
def accounts_create(kind: str, name: str, email: str | None, as_json: bool) -> None:
    with engine().begin() as conn:
        account_id = acc.create_account(conn, kind, name, email)
        add_first_member(conn, account_id, kind, email)
    emit(as_json, {"id": account_id, "kind": kind, "name": name, "email": email}, f"created {kind} account {account_id}")


@accounts_group.command("platform")
@json_option
@handles_errors
def accounts_platform(as_json: bool) -> None:
    """The platform's own account (what admin tokens act for)."""
    with engine().connect() as conn:
        account_id = conn.execute(select(accounts_table.c.id).where(accounts_table.c.system_code == "platform:revenue")).scalar_one()
    emit(as_json, {"id": account_id}, f"platform account {account_id}")


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


COMMANDS = (accounts_group, tokens_group)
