"""What every console page does the same way: find the session behind the
cookie, decide whether its person may see this account and this page, check
the CSRF token of every form, render a template, and send the security headers.

A page at /console/{account_id}/… acts with the rights of the signed-in
person's membership of that account (app/members.py), or, for a platform
admin, of an admin token naming it. An account they may not see answers 404,
as one that does not exist; a page their role may not use on their own
account, 403. Each handler names the management API guard whose roles it
shares (`opt={"guard": requires_reader, "kinds": (...)}`), so the console
never lets a role do what the API would refuse it."""
from __future__ import annotations

import asyncio
import secrets
from http import HTTPStatus
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from jinja2 import Environment, FileSystemLoader, select_autoescape
from litestar import Request, Response
from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie
from litestar.handlers.base import BaseRouteHandler
from litestar.response import Redirect
from markupsafe import Markup
from sqlalchemy import Engine, select

from app.http.errors import http_error_for
from app.console.sessions import Session, csrf_matches, csrf_token_of, find_session
from app.limits import SESSION_ABSOLUTE_S
from app.members import PLATFORM_ADMIN, Membership, memberships_of
from app.tokens import ADMIN, Principal
from invoices.render import cents_text
from ledger.errors import LedgerError
from proxy.errors import ProxyError
from ledger.schema import accounts

HERE = Path(__file__).resolve().parent
STATIC_DIR = HERE / "static"
SESSION_COOKIE = "paralon_session"
# Before there is a session (the sign-in forms), CSRF is a double-submit cookie.
PRE_SESSION_CSRF_COOKIE = "paralon_csrf"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Nothing inline, nothing from elsewhere: every script and style is a file served from /console/static.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; font-src 'self'; form-action 'self'; base-uri 'none'; "
                           "frame-ancestors 'none'")
SECURITY_HEADERS = {"content-security-policy": CONTENT_SECURITY_POLICY, "x-content-type-options": "nosniff",
                    "referrer-policy": "same-origin", "x-frame-options": "DENY", "cache-control": "no-store"}

templates = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]))


def money(amount_nano_usd: int | None) -> Markup:
    """Cents on the page, the exact nano-dollars on hover (and to screen readers)."""
    if amount_nano_usd is None:
        return Markup('<span class="money">—</span>')
    cents = cents_text(amount_nano_usd)
    return Markup('<span class="money" title="{n} nano-USD" data-nano-usd="{n}">{s}${c}</span>').format(
        n=f"{amount_nano_usd:,}", s="-" if cents.startswith("-") else "", c=cents.removeprefix("-"))  # -$25.00


templates.filters.update(money=money)


class SignInRequired(Exception):
    """No live session: pages send the person to the sign-in form."""


class NotThere(Exception):
    """The account or the thing is not theirs to see: exactly like not existing (404)."""


class NotAllowed(Exception):
    """Their own account, but their role may not use this page (403)."""


class BadForm(Exception):
    """A form without a valid CSRF token, or with a value refused: nothing was written."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Viewer:
    """Who is looking, at which account, with which rights."""

    session: Session
    memberships: list[Membership]
    principal: Principal | None = None  # None on pages outside any account
    account: dict = field(default_factory=dict)  # id, kind, name

    @property
    def csrf_token(self) -> str:
        return self.session.csrf_token

    @property
    def is_platform_admin(self) -> bool:
        return any(m.role == PLATFORM_ADMIN for m in self.memberships)


def engine_of(connection: ASGIConnection) -> Engine:
    return connection.app.state.ledger.engine


async def console_guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """Signed in, allowed to see the account in the path, allowed this page, CSRF on forms."""
    secret = connection.cookies.get(SESSION_COOKIE, "")
    account_id = connection.path_params.get("account_id")
    viewer = await asyncio.to_thread(_find_viewer, engine_of(connection), secret, account_id)
    if viewer is None:
        raise SignInRequired()
    connection.state.viewer = viewer
    if account_id is not None:
        _check_page(viewer, handler.opt)
    if connection.scope["method"] not in SAFE_METHODS:
        sent = connection.headers.get(CSRF_HEADER) or (await connection.form()).get(CSRF_FIELD)  # type: ignore[attr-defined]
        if not csrf_matches(viewer.session, sent):
            raise BadForm("this form has expired or did not come from this site: reload the page and try again", 403)


def _find_viewer(engine: Engine, secret: str, account_id: int | None) -> Viewer | None:
    with engine.connect() as conn:
        session = find_session(conn, secret)
        if session is None:
            return None
        memberships = memberships_of(conn, session.email)
        viewer = Viewer(session, memberships)
        if account_id is None:
            return viewer
        row = conn.execute(select(accounts.c.id, accounts.c.kind, accounts.c.name).where(accounts.c.id == account_id)).first()
    own = [m for m in memberships if m.account_id == account_id]
    if row is None or row.kind not in ("customer", "owner", "platform"):
        raise NotThere()
    if own:
        viewer.principal = own[0].principal()
    elif viewer.is_platform_admin:
        admin = next(m for m in memberships if m.role == PLATFORM_ADMIN)
        viewer.principal = Principal(None, account_id, ADMIN, admin.member_id)
    else:
        raise NotThere()
    viewer.account = {"id": row.id, "kind": row.kind, "name": row.name}
    return viewer


def _check_page(viewer: Viewer, opt: dict) -> None:
    if viewer.account["kind"] not in opt.get("kinds", ()):
        raise NotThere()  # an owner's page of a customer account does not exist
    if viewer.principal.role not in opt["guard"].roles:
        raise NotAllowed()


def viewer_of(request: Request) -> Viewer:
    return request.state.viewer


def render(template: str, status: int = 200, cookies: list[Cookie] | None = None, **context) -> Response:
    html = templates.get_template(template).render(**context)
    return Response(html, status_code=status, media_type="text/html; charset=utf-8", cookies=cookies)


def page(request: Request, template: str, **context) -> Response:
    """A page of an account: the layout's navigation, the CSRF token and who is signed in come with it."""
    viewer = viewer_of(request)
    return render(template, viewer=viewer, account=viewer.account, role=viewer.principal.role if viewer.principal else None,
                  csrf_token=viewer.csrf_token, path=request.url.path, **context)


def is_https(connection: ASGIConnection) -> bool:
    """Behind a proxy that terminates TLS, X-Forwarded-Proto says so."""
    return connection.url.scheme == "https" or connection.headers.get("x-forwarded-proto", "") == "https"


def session_cookie(connection: ASGIConnection, secret: str | None) -> Cookie:
    """The session cookie (None: deleted). HttpOnly, SameSite=Lax, Secure behind HTTPS."""
    return Cookie(key=SESSION_COOKIE, value=secret or "", path="/console", httponly=True, samesite="lax",
                  secure=is_https(connection), max_age=SESSION_ABSOLUTE_S if secret else 0)


def pre_session_csrf(connection: ASGIConnection) -> tuple[str, list[Cookie]]:
    """The double-submit token of the sign-in forms: the cookie's, or a new one with its cookie."""
    token = connection.cookies.get(PRE_SESSION_CSRF_COOKIE)
    if token and len(token) == len(csrf_token_of("")):
        return token, []
    token = csrf_token_of(secrets.token_urlsafe())  # random, and shaped like a session's
    return token, [Cookie(key=PRE_SESSION_CSRF_COOKIE, value=token, path="/console", httponly=True, samesite="strict",
                          secure=is_https(connection))]


async def check_pre_session_csrf(request: Request) -> dict:
    """The form, when its token matches the cookie's; else `BadForm`."""
    form = await request.form()
    cookie, sent = request.cookies.get(PRE_SESSION_CSRF_COOKIE, ""), form.get(CSRF_FIELD)
    if not cookie or not isinstance(sent, str) or not secrets.compare_digest(cookie, sent):
        raise BadForm("this form has expired or did not come from this site: reload the page and try again", 403)
    return dict(form)


def sign_in_redirect(request: Request, _: SignInRequired) -> Response:
    if request.method not in SAFE_METHODS:
        return render("error.html", status=401, title="Signed out", message="Your session has ended: sign in again.")
    return Redirect(f"/console/sign-in?next={quote(request.url.path)}")


def error_page(status: int, title: str, message: str) -> Response:
    return render("error.html", status=status, title=title, message=message)


def service_error_page(request: Request, exc: LedgerError | ProxyError) -> Response:
    """A service's typed error as the API would answer it, as a page: what is not theirs is a 404."""
    error = http_error_for(exc) if isinstance(exc, LedgerError) else exc
    return error_page(error.status, "Not found" if error.status == HTTPStatus.NOT_FOUND else "Not done", str(error))


CONSOLE_EXCEPTION_HANDLERS = {
    LedgerError: service_error_page,
    ProxyError: service_error_page,
    SignInRequired: sign_in_redirect,
    NotThere: lambda request, exc: error_page(404, "Not found", "There is nothing here."),
    NotAllowed: lambda request, exc: error_page(403, "Not for your role", "Your role on this account may not use this page."),
    BadForm: lambda request, exc: error_page(exc.status, "Not saved", str(exc)),
}


async def security_headers(response: Response) -> Response:
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response
