"""Signing in by an emailed link, sessions and their cookie, CSRF on every
form and the pages' security headers, through the real app and a real SMTP
server."""
from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from sqlalchemy import func, select

from app.console import sessions
from app.console.signin import RateLimited, redeem_link, request_link, sign_in_requests
from app.http.console.web import CONTENT_SECURITY_POLICY, SESSION_COOKIE
from app.limits import (
    SESSION_ABSOLUTE_S,
    SESSION_IDLE_S,
    SIGN_IN_LINK_TTL_S,
    SIGN_IN_LINKS_PER_ADDRESS_MAX,
    SIGN_IN_REQUESTS_PER_IP_MAX,
)
from ledger.schema import utc_now
from tests.app.console.conftest import CSRF, PEOPLE

CUSTOMER = "customer_admin@example.com"


def _ask(console, address: str):
    console.client.cookies.clear()
    form = console.client.get("/console/sign-in")
    return console.client.post("/console/sign-in", data={"csrf_token": CSRF.search(form.text).group(1), "email": address})


def _confirm(console, link: str):
    console.client.cookies.clear()
    confirm = console.client.get(link)
    return console.client.post(link.split("?")[0], data={"csrf_token": CSRF.search(confirm.text).group(1)},
                               follow_redirects=False)


def test_a_member_signs_in_through_the_mailed_link_once(console):
    assert _ask(console, CUSTOMER.upper()).status_code == 200  # addresses are compared in lower case
    [link] = console.inbox.links_to(CUSTOMER)
    opened = console.client.get(link)  # opening it (a mail scanner) uses nothing up
    assert opened.status_code == 200 and 'id="confirm-sign-in"' in opened.text
    done = _confirm(console, link)
    assert done.status_code == 302 and done.headers["location"] == "/console"
    cookie = done.headers["set-cookie"]
    assert f"{SESSION_COOKIE}=ss-par-" in cookie and "HttpOnly" in cookie and "SameSite=lax" in cookie.replace("Lax", "lax")
    assert "Path=/console" in cookie and "Secure" not in cookie
    console.sessions[CUSTOMER] = done.cookies[SESSION_COOKIE]
    assert console.get("/console/", CUSTOMER).status_code == 302  # signed in: on to the one account
    again = _confirm(console, link)
    assert again.status_code == 400 and SESSION_COOKIE not in again.headers.get("set-cookie", "")


def test_an_unknown_address_gets_the_same_answer_and_no_link(console):
    known, unknown = _ask(console, CUSTOMER), _ask(console, "nobody@example.com")
    assert known.status_code == unknown.status_code == 200
    assert known.text.replace(CUSTOMER, "X") == unknown.text.replace("nobody@example.com", "X")
    assert console.inbox.links_to("nobody@example.com") == []
    with console.engine.connect() as conn:
        rows = conn.execute(select(sign_in_requests.c.email, sign_in_requests.c.link_sha256)).all()
    assert {r.email: r.link_sha256 is not None for r in rows} == {CUSTOMER: True, "nobody@example.com": False}
    assert all(b"sl-par-" not in (r.link_sha256 or b"") for r in rows)  # only its hash is kept


def test_a_bad_address_or_a_form_without_its_token_is_refused_and_writes_nothing(console):
    console.client.cookies.clear()
    form = console.client.get("/console/sign-in")
    token = CSRF.search(form.text).group(1)
    bad = console.client.post("/console/sign-in", data={"csrf_token": token, "email": "not an address"})
    forged = console.client.post("/console/sign-in", data={"csrf_token": "f" * len(token), "email": CUSTOMER})
    console.client.cookies.clear()  # another site's form: no cookie of ours
    cross_site = console.client.post("/console/sign-in", data={"csrf_token": token, "email": CUSTOMER})
    assert (bad.status_code, forged.status_code, cross_site.status_code) == (400, 403, 403)
    with console.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(sign_in_requests)).scalar_one() == 0
    assert console.inbox.messages == []


def test_links_are_rate_limited_per_address_and_per_ip(console):
    for _ in range(SIGN_IN_LINKS_PER_ADDRESS_MAX):
        assert _ask(console, CUSTOMER).status_code == 200
    assert _ask(console, CUSTOMER).status_code == 429
    assert len(console.inbox.links_to(CUSTOMER)) == SIGN_IN_LINKS_PER_ADDRESS_MAX
    with console.engine.begin() as conn:
        now = utc_now()
        for i in range(SIGN_IN_REQUESTS_PER_IP_MAX):
            request_link(conn, f"p{i}@example.com", "203.0.113.9", now)
        try:
            request_link(conn, "viewer@example.com", "203.0.113.9", now)
            raise AssertionError("the IP's limit let one more through")
        except RateLimited:
            pass
        # The window moves on: the same IP may ask again later.
        assert request_link(conn, "viewer@example.com", "203.0.113.9", now + timedelta(seconds=SIGN_IN_LINK_TTL_S + 1))


def test_a_link_expires_and_is_redeemed_by_one_of_many_racers(console):
    with console.engine.begin() as conn:
        issued = utc_now()
        _, token = request_link(conn, CUSTOMER, "192.0.2.1", issued)
        assert redeem_link(conn, token, issued + timedelta(seconds=SIGN_IN_LINK_TTL_S)) is None  # expired
        _, token = request_link(conn, CUSTOMER, "192.0.2.1", issued)
    racers = 8
    barrier = threading.Barrier(racers)

    def redeem() -> str | None:
        barrier.wait()
        with console.engine.begin() as conn:
            return redeem_link(conn, token, issued)

    with ThreadPoolExecutor(racers) as pool:
        results = list(pool.map(lambda _: redeem(), range(racers)))
    assert results.count(CUSTOMER) == 1 and results.count(None) == racers - 1


def test_signing_in_again_rotates_the_session_and_signing_out_everywhere_ends_all(console):
    first = console.sign_in(CUSTOMER)
    console.client.cookies.set(SESSION_COOKIE, first, path="/console")
    assert _ask(console, CUSTOMER).status_code == 200
    link = console.inbox.links_to(CUSTOMER)[-1]
    console.client.cookies.set(SESSION_COOKIE, first, path="/console")
    confirm = console.client.get(link)
    console.client.cookies.set(SESSION_COOKIE, first, path="/console")
    done = console.client.post(link.split("?")[0], data={"csrf_token": CSRF.search(confirm.text).group(1)},
                               follow_redirects=False)
    second = done.cookies[SESSION_COOKIE]
    assert second != first
    console.sessions.update({"first": first, "second": second})
    assert console.get("/console/", "first").headers["location"].startswith("/console/sign-in?next=")  # ended
    third = console.sign_in(CUSTOMER)
    console.sessions["third"] = third
    signed_out = console.post_form("/console/sign-out-everywhere", "third", csrf_from="/console/sign-in")
    assert signed_out.status_code == 403  # the sign-in page's token is not this session's
    ended = console.post_form("/console/sign-out-everywhere", "third", csrf_from=f"/console/{console.accounts['customer']}/overview")
    assert ended.status_code == 302 and 'paralon_session=""' in ended.headers["set-cookie"]
    for name in ("second", "third"):
        assert console.get(f"/console/{console.accounts['customer']}/overview", name).status_code == 302


def test_sessions_end_when_idle_and_at_their_absolute_expiry(console):
    with console.engine.begin() as conn:
        start = utc_now()
        session = sessions.start_session(conn, CUSTOMER, now=start)
        used = sessions.start_session(conn, CUSTOMER, now=start)
    with console.engine.connect() as conn:
        assert sessions.find_session(conn, session.secret, start + timedelta(seconds=SESSION_IDLE_S + 1)) is None
        # Used often enough, it still ends at its absolute expiry.
        session, later = used, start
        while later + timedelta(seconds=SESSION_IDLE_S // 2) < start + timedelta(seconds=SESSION_ABSOLUTE_S):
            later += timedelta(seconds=SESSION_IDLE_S // 2)
            assert sessions.find_session(conn, session.secret, later)
        assert sessions.find_session(conn, session.secret, start + timedelta(seconds=SESSION_ABSOLUTE_S)) is None


def test_the_cookie_is_secure_behind_https(console):
    assert _ask(console, CUSTOMER).status_code == 200
    link = console.inbox.links_to(CUSTOMER)[-1]
    console.client.cookies.clear()
    confirm = console.client.get(link, headers={"x-forwarded-proto": "https"})
    assert "Secure" in confirm.headers["set-cookie"]  # the sign-in form's CSRF cookie too
    console.client.cookies.clear()  # an http:// client would not send a Secure cookie back: send it as a browser would
    done = console.client.post(link.split("?")[0], headers={"x-forwarded-proto": "https",
                                                            "cookie": f"paralon_csrf={confirm.cookies['paralon_csrf']}"},
                               data={"csrf_token": CSRF.search(confirm.text).group(1)}, follow_redirects=False)
    assert "Secure" in done.headers["set-cookie"]


def test_a_next_page_elsewhere_is_not_followed(console):
    assert _ask(console, CUSTOMER).status_code == 200
    link = console.inbox.links_to(CUSTOMER)[-1]
    console.client.cookies.clear()
    confirm = console.client.get(link)
    done = console.client.post(link.split("?")[0], data={"csrf_token": CSRF.search(confirm.text).group(1),
                                                         "next": "//evil.example/console"}, follow_redirects=False)
    assert done.headers["location"] == "/console"


def test_every_page_sends_the_security_headers_and_has_no_inline_script(signed_in):
    cid = signed_in.accounts["customer"]
    for path, who in ((f"/console/{cid}/overview", CUSTOMER), ("/console/sign-in", None), (f"/console/{cid}/keys", CUSTOMER)):
        page = signed_in.get(path, who)
        assert page.status_code == 200
        assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert "'unsafe-inline'" not in CONTENT_SECURITY_POLICY and "script-src 'self'" in CONTENT_SECURITY_POLICY
        assert page.headers["x-frame-options"] == "DENY" and page.headers["cache-control"] == "no-store"
        for tag in re.findall(r"<script[^>]*>", page.text):
            assert " src=" in tag or 'type="application/json"' in tag, tag
        assert not re.search(r"\son[a-z]+=", page.text) and " style=" not in page.text


def test_a_removed_member_sees_nothing_from_the_next_click(signed_in):
    from app.members import remove_member

    cid = signed_in.accounts["customer"]
    assert signed_in.get(f"/console/{cid}/overview", "viewer@example.com").status_code == 200
    with signed_in.engine.begin() as conn:
        remove_member(conn, cid, "viewer@example.com")
    assert signed_in.get(f"/console/{cid}/overview", "viewer@example.com").status_code == 404


def test_every_person_lands_on_their_role_s_home(signed_in):
    homes = {"customer_admin": "overview", "customer_viewer": "overview", "accountant": "overview", "owner": "earnings",
             "platform_admin": "fleet"}
    for address, (account, role) in PEOPLE.items():
        account_id = signed_in.accounts[account]
        home = signed_in.get(f"/console/{account_id}", address)
        assert home.status_code == 302 and home.headers["location"] == f"/console/{account_id}/{homes[role]}", address
