"""Who may open which console page, generated from the app's route table:
every account page × every person (each member role, and the platform
admin) × their own account and every foreign one, with their own and
foreign keys and workers. A foreign account or thing answers 404, exactly as
one that does not exist; a page their role may not use, 403, like the API;
every form without the session's CSRF token is refused; none of it writes."""
from __future__ import annotations

import re
from datetime import UTC, datetime

from litestar.routes import HTTPRoute
from sqlalchemy import func, select

from app.console.sessions import console_sessions
from app.http.console.web import console_guard
from app.members import PRINCIPAL_ROLE_OF_MEMBER
from app.tokens import ADMIN
from proxy import keys as api_keys
from proxy import workers as registry
from tests.app.console.conftest import PEOPLE

THIS_MONTH = datetime.now(UTC).strftime("%Y-%m")
ACCOUNT_KINDS = {"customer": "customer", "other_customer": "customer", "owner": "owner", "other_owner": "owner",
                 "platform": "platform"}
# Whose keys and workers belong to which account.
KEY_OF = {"customer": "key_id", "other_customer": "other_key_id"}
WORKER_OF = {"owner": "worker_id", "other_owner": "other_worker_id"}


def account_routes(app) -> list[tuple[str, str, dict]]:
    """(method, path template, opt) of every page of an account."""
    found = []
    for route in app.routes:
        if isinstance(route, HTTPRoute) and route.path.startswith("/console/{account_id:int}"):
            for handler in route.route_handlers:
                if handler.http_methods == {"OPTIONS"}:  # Litestar's own answer to a CORS preflight
                    continue
                assert console_guard in handler.resolve_guards(), f"{route.path} answers without the console's guard"
                for method in handler.http_methods - {"HEAD", "OPTIONS"}:
                    found.append((method, route.path, handler.opt))
    return found


def _concrete(console, template: str, account: str, things_of: str) -> str:
    """The template for `account`, its key, worker and document ids those of `things_of`."""
    ids = {"account_id": console.accounts[account],
           "key_id": getattr(console, KEY_OF.get(things_of, "key_id")),
           "worker_id": getattr(console, WORKER_OF.get(things_of, "worker_id"))}
    path = re.sub(r"\{(\w+):int\}", lambda m: str(ids[m.group(1)]), template)
    return path.replace("{name:str}", f"{THIS_MONTH}.json" if "/statements/" in template else f"{console.invoice_number}.pdf")


def _expected(address: str, account: str, opt: dict) -> int | None:
    """404, 403, or None (the page is theirs to use)."""
    own_account, member_role = PEOPLE[address]
    role = PRINCIPAL_ROLE_OF_MEMBER[member_role]
    if account != own_account and role != ADMIN:
        return 404
    if ACCOUNT_KINDS[account] not in opt["kinds"]:
        return 404
    if (ADMIN if account != own_account else role) not in opt["guard"].roles:
        return 403
    return None


def _state(console) -> tuple:
    with console.engine.connect() as conn:
        keys = [(k["id"], k["revoked"]) for a in ("customer", "other_customer") for k in api_keys.list_keys(conn, console.accounts[a])]
        workers = sorted((w.id, w.state) for w in registry.list_workers(conn))
        session_count = conn.execute(select(func.count()).select_from(console_sessions)).scalar_one()
    return console.money(), keys, workers, session_count


def test_the_route_table_holds_every_kind_of_page(console):
    paths = {path for _, path, _ in account_routes(console.client.app)}
    assert {"/console/{account_id:int}/overview", "/console/{account_id:int}/keys/{key_id:int}/revoke",
            "/console/{account_id:int}/workers/{worker_id:int}/drain", "/console/{account_id:int}/fleet"} <= paths


def test_every_person_on_every_account_page_of_every_account(signed_in):
    console = signed_in
    before = _state(console)
    checked = 0
    for method, template, opt in account_routes(console.client.app):
        for address in PEOPLE:
            for account in ACCOUNT_KINDS:
                path = _concrete(console, template, account, account)
                expected = _expected(address, account, opt)
                if expected is None and "/invoices/" in template and account != "customer":
                    expected = 404  # the one invoice is the customer's: under any other account it is not there
                if method == "GET":
                    answer = console.get(path, address)
                    if expected is None:
                        assert answer.status_code not in (401, 403, 404), (address, path, answer.status_code)
                    else:
                        assert answer.status_code == expected, (address, path, answer.status_code)
                else:  # a form: refused without the token, and by role or ownership with it
                    assert console.request(method, path, address, data={}).status_code == (expected or 403), (address, path)
                    forged = console.request(method, path, address, data={"csrf_token": "0" * 64})
                    assert forged.status_code == (expected or 403), (address, path)
                    if expected is not None:
                        answer = console.post_form(path, address, csrf_from=f"/console/{console.accounts[PEOPLE[address][0]]}")
                        assert answer.status_code == expected, (address, path, answer.status_code)
                checked += 1
    assert checked > 500
    assert _state(console) == before, "nothing was written, no money moved"


def test_a_foreign_key_or_worker_under_ones_own_account_is_not_there(signed_in):
    console = signed_in
    before = _state(console)
    for method, template, opt in account_routes(console.client.app):
        if "{key_id:int}" not in template and "{worker_id:int}" not in template:
            continue
        for address, account, foreign in (("customer_admin@example.com", "customer", "other_customer"),
                                          ("owner@example.com", "owner", "other_owner"),
                                          ("admin@example.com", "customer", "other_customer"),
                                          ("admin@example.com", "owner", "other_owner")):
            if ACCOUNT_KINDS[account] not in opt["kinds"]:
                continue
            path = _concrete(console, template, account, foreign)
            answer = console.post_form(path, address, csrf_from=f"/console/{console.accounts[account]}/documents")
            assert answer.status_code == 404, (address, path, answer.status_code)
    assert _state(console) == before


def test_nobody_signed_in_is_sent_to_sign_in_and_writes_nothing(console):
    before = _state(console)
    for method, template, _ in account_routes(console.client.app):
        path = _concrete(console, template, "customer", "customer")
        answer = console.request(method, path, None, data={"csrf_token": "0" * 64})
        if method == "GET":
            assert answer.status_code == 302 and answer.headers["location"].startswith("/console/sign-in?next="), path
        else:
            assert answer.status_code == 401, path
    assert _state(console) == before
