"""Signing in and out: the email form, the link's confirmation (a link is
redeemed by a button, not by opening it, so a mail scanner that follows links
does not use it up), the account chooser and signing out everywhere."""
from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

from litestar import Controller, Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.params import FromPath
from litestar.response import Redirect

from app.console import sessions
from app.console.signin import ConsoleSettings, RateLimited, deliver_link, redeem_link, request_link
from app.http.console.web import (
    CONSOLE_EXCEPTION_HANDLERS,
    SESSION_COOKIE,
    BadForm,
    console_guard,
    engine_of,
    pre_session_csrf,
    check_pre_session_csrf,
    render,
    security_headers,
    session_cookie,
    viewer_of,
)
from app.members import PLATFORM_ADMIN, account_names
from invoices.mail import MailSettings
from ledger.errors import InvalidInput

log = logging.getLogger("paralon.console")


def _safe_next(target: object) -> str:
    """Only a path of this console: never another site (an open redirect)."""
    if isinstance(target, str) and target.startswith("/console") and not urlsplit(target).netloc and "\\" not in target:
        return target
    return "/console"


class SignInController(Controller):
    path = "/console"
    include_in_schema = False
    exception_handlers = CONSOLE_EXCEPTION_HANDLERS
    after_request = security_headers

    @get("/sign-in")
    async def form(self, request: Request) -> Response:
        token, cookies = pre_session_csrf(request)
        return render("sign_in.html", cookies=cookies, csrf_token=token, next_path=_safe_next(request.query_params.get("next")))

    @post("/sign-in")
    async def ask(self, request: Request) -> Response:
        form = await check_pre_session_csrf(request)
        settings: ConsoleSettings = request.app.state.console
        ip_address = request.client.host if request.client else "unknown"
        try:
            found = await asyncio.to_thread(_request_link, request, form.get("email"), ip_address)
        except InvalidInput as exc:
            raise BadForm(str(exc)) from None
        except RateLimited as exc:
            return render("error.html", status=429, title="Too many requests", message=str(exc))
        task = None
        if found is not None:  # mailed after the answer, so a member's address takes no longer to answer
            address, token = found
            url = f"{settings.public_url}/console/sign-in/{token}?next={_safe_next(form.get('next'))}"
            task = BackgroundTask(_deliver, settings.mail, address, url)
        response = render("sign_in_sent.html", email=str(form.get("email", "")).strip())
        response.background = task
        return response

    @get("/sign-in/{token:str}")
    async def confirm(self, request: Request, token: FromPath[str]) -> Response:
        csrf, cookies = pre_session_csrf(request)
        return render("sign_in_confirm.html", cookies=cookies, csrf_token=csrf, token=token,
                      next_path=_safe_next(request.query_params.get("next")))

    @post("/sign-in/{token:str}")
    async def redeem(self, request: Request, token: FromPath[str]) -> Response:
        form = await check_pre_session_csrf(request)
        session = await asyncio.to_thread(_redeem, request, token)
        if session is None:
            return render("error.html", status=400, title="Link not valid",
                          message="This sign-in link was used already or has expired: ask for a new one.")
        response = Redirect(_safe_next(form.get("next")))
        response.set_cookie(session_cookie(request, session.secret))  # a new session: rotated at every sign-in
        return response

    @get("/", guards=[console_guard])
    async def choose(self, request: Request) -> Response:
        viewer = viewer_of(request)
        memberships = viewer.memberships
        if len(memberships) == 1 and memberships[0].role != PLATFORM_ADMIN:
            return Redirect(f"/console/{memberships[0].account_id}")
        names = await asyncio.to_thread(_account_names, request, [m.account_id for m in memberships])
        return render("choose.html", viewer=viewer, csrf_token=viewer.csrf_token,
                      memberships=[(m, names.get(m.account_id, "")) for m in memberships])

    @post("/sign-out", guards=[console_guard])
    async def sign_out(self, request: Request) -> Response:
        await asyncio.to_thread(_end, request, everywhere=False)
        return _signed_out(request)

    @post("/sign-out-everywhere", guards=[console_guard])
    async def sign_out_everywhere(self, request: Request) -> Response:
        await asyncio.to_thread(_end, request, everywhere=True)
        return _signed_out(request)


@get("/checkout/{outcome:str}", include_in_schema=False)
async def checkout_return(outcome: FromPath[str]) -> Response:
    """Where Stripe Checkout sends the customer back: the console, whose balance shows the credit once Stripe's webhook arrives."""
    return Redirect("/console")


def _signed_out(request: Request) -> Response:
    response = Redirect("/console/sign-in")
    response.set_cookie(session_cookie(request, None))
    return response


def _request_link(request: Request, email: object, ip_address: str) -> tuple[str, str] | None:
    with engine_of(request).begin() as conn:
        return request_link(conn, email, ip_address)


def _deliver(mail: MailSettings, address: str, url: str) -> None:
    try:
        deliver_link(mail, address, url)
    except OSError:  # the mail server is away: the person asks again; nothing else depends on it
        log.warning("could not mail a sign-in link to %s", address, exc_info=True)


def _redeem(request: Request, token: str) -> sessions.Session | None:
    with engine_of(request).begin() as conn:
        address = redeem_link(conn, token)
        if address is None:
            return None
        return sessions.start_session(conn, address, replacing=request.cookies.get(SESSION_COOKIE))


def _end(request: Request, everywhere: bool) -> None:
    viewer = viewer_of(request)
    with engine_of(request).begin() as conn:
        if everywhere:
            sessions.end_every_session(conn, viewer.session.email)
        else:
            sessions.end_session(conn, viewer.session.secret)


def _account_names(request: Request, account_ids: list[int]) -> dict[int, str]:
    with engine_of(request).connect() as conn:
        return account_names(conn, account_ids)


