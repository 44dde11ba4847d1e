"""`paralon members`: the people who sign in to the console for an account, and their roles."""
from __future__ import annotations

import click

from app.cli.output import emit, engine, handles_errors, json_option
from app.members import MEMBER_ROLES, add_member, list_members, remove_member


@click.group("members")
def members_group() -> None:
    """Console members of an account (roles: customer_admin, customer_viewer, accountant, owner, platform_admin)."""


@members_group.command("add")
@click.argument("account_id", type=int)
@click.option("--email", required=True)
@click.option("--role", type=click.Choice(MEMBER_ROLES), required=True,
              help="platform_admin joins the platform account (`paralon accounts platform`).")
@json_option
@handles_errors
def members_add(account_id: int, email: str, role: str, as_json: bool) -> None:
    with engine().begin() as conn:
        member = add_member(conn, account_id, email, role)
    emit(as_json, member.as_dict(), f"{member.email} is now {role} of account {account_id}")


@members_group.command("list")
@click.argument("account_id", type=int)
@json_option
@handles_errors
def members_list(account_id: int, as_json: bool) -> None:
    with engine().connect() as conn:
        found = list_members(conn, account_id)
    emit(as_json, {"data": [m.as_dict() for m in found]},
         "\n".join(f"{m.member_id}\t{m.email}\t{m.role}" for m in found) or f"account {account_id} has no members")


@members_group.command("remove")
@click.argument("account_id", type=int)
@click.option("--email", required=True)
@json_option
@handles_errors
def members_remove(account_id: int, email: str, as_json: bool) -> None:
    """Their console pages of this account answer 404 from their next click."""
    with engine().begin() as conn:
        member = remove_member(conn, account_id, email)
    emit(as_json, {**member.as_dict(), "removed": True}, f"{member.email} removed from account {account_id}")


COMMANDS = (members_group,)
