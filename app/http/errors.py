"""HTTP errors of Paralon's own API, and how every error becomes OpenAI's
error JSON.

The proxy raises its own errors (proxy/errors.py: a bad request, no credits,
no worker). The ones here are raised at the edge: a token or key that does
not authenticate, a role that may not, what is not there. The services of
app/, invoices/ and ledger/ raise typed `LedgerError`s; `http_error_for` maps
each to its status, so a controller only calls the service."""
from __future__ import annotations

import logging
from http import HTTPStatus
from collections.abc import Iterator
from contextlib import contextmanager

from litestar import Request, Response
from litestar.exceptions import HTTPException

from app.accounts import NotVisible
from app.http.plumbing import json_response
from app.payments import payouts
from invoices.files import DocumentUnavailable
from invoices.statements import NoStatement, StatementNotReady
from ledger.db import DATABASE_ERRORS, is_connection_failure
from ledger.errors import DatabaseUnavailable, InvariantBroken, LedgerError, first_line
from proxy import workers as registry
from proxy.errors import CallerMistake, DatabaseAway, InvalidRequest, NotReady, ProxyError


class AuthenticationFailed(CallerMistake):
    """No bearer token, or one that is unknown or revoked (API keys and management tokens alike)."""

    status, error_type, code = 401, "authentication_error", "invalid_api_key"


class PermissionDenied(CallerMistake):
    """The token's role may not do this to its own account's data."""

    status, error_type, code = 403, "permission_error", "permission_denied"


class NotFound(CallerMistake):
    """Does not exist, or belongs to an account the token may not know about."""

    status, error_type, code = 404, "invalid_request_error", "not_found"


class UnknownGeneration(CallerMistake):
    status, error_type, code = 404, "invalid_request_error", "generation_not_found"


class WorkerNotSuspended(CallerMistake):
    status, error_type, code = 409, "invalid_request_error", "worker_not_suspended"


class PayoutInFlight(CallerMistake):
    """Another payout of the owner is in flight on that rail: it settles or fails first."""

    status, error_type, code = 409, "invalid_request_error", "payout_in_flight"


class PayoutDestinationCoolingDown(CallerMistake):
    status, error_type, code = 409, "invalid_request_error", "payout_destination_cooling_down"


class DocumentMismatch(ProxyError):
    """A recorded document whose stored bytes are not the recorded ones: refused, never another's."""

    status, error_type, code = 503, "service_unavailable", "document_unavailable"


# Most specific first; any other LedgerError is the caller's mistake (400).
HTTP_ERROR_OF_SERVICE_ERROR: tuple[tuple[type[LedgerError], type[ProxyError]], ...] = (
    (DatabaseUnavailable, DatabaseAway),
    (NotVisible, NotFound),
    (NoStatement, NotFound),
    (registry.UnknownWorker, NotFound),
    (payouts.UnknownPayout, NotFound),
    (payouts.PayoutInFlight, PayoutInFlight),
    (payouts.DestinationCoolingDown, PayoutDestinationCoolingDown),
    (registry.WorkerNotSuspended, WorkerNotSuspended),
    (StatementNotReady, NotReady),
    (DocumentUnavailable, DocumentMismatch),
    (InvariantBroken, ProxyError),  # the books disagree: not the caller's doing
)


def http_error_for(exc: LedgerError) -> ProxyError:
    for service_error, http_error in HTTP_ERROR_OF_SERVICE_ERROR:
        if isinstance(exc, service_error):
            return http_error(str(exc))
    return InvalidRequest(str(exc))


@contextmanager
def about_field(param: str) -> Iterator[None]:
    """A caller's mistake raised inside names the request field it is about."""
    try:
        yield
    except LedgerError as exc:
        error = http_error_for(exc)
        if isinstance(error, InvalidRequest):
            error.param = param
        raise error from None


def error_body(exc: ProxyError) -> dict:
    return {"error": {"message": str(exc), "type": exc.error_type, "param": exc.param, "code": exc.code}}


def retry_headers(retry_after_s: int | None, should_retry: bool | None) -> dict[str, str]:
    """What tells an OpenAI SDK whether to ask again: `retry-after` (seconds),
    or `x-should-retry: false`, which the SDKs obey before their status rules."""
    headers = {"retry-after": str(retry_after_s)} if retry_after_s else {}
    if should_retry is not None:
        headers["x-should-retry"] = "true" if should_retry else "false"
    return headers


def proxy_error_response(_: Request, exc: ProxyError) -> Response:
    return json_response(error_body(exc), exc.status, retry_headers(exc.retry_after_s, exc.should_retry) or None)


def service_error_response(request: Request, exc: LedgerError) -> Response:
    return proxy_error_response(request, http_error_for(exc))


# A timeout, a conflict or too many requests may pass when asked again (the SDKs retry them).
RETRYABLE_CLIENT_STATUSES = frozenset({HTTPStatus.REQUEST_TIMEOUT, HTTPStatus.CONFLICT, HTTPStatus.TOO_MANY_REQUESTS})


def http_exception_response(_: Request, exc: HTTPException) -> Response:
    """Litestar's own errors (no such route, a path parameter of the wrong type) in the same shape."""
    error_type = "invalid_request_error" if exc.status_code < 500 else "api_error"
    final = exc.status_code < 500 and exc.status_code not in RETRYABLE_CLIENT_STATUSES  # a wrong path stays wrong
    headers = {**(exc.headers or {}), **retry_headers(None, False if final else None)}  # a 405's Allow (RFC 9110) kept
    return json_response({"error": {"message": str(exc.detail), "type": error_type, "param": None, "code": None}},
                         exc.status_code, headers)


log = logging.getLogger(__name__)


def database_error_response(request: Request, exc: Exception) -> Response:
    """The database away (a refused or dropped connection, wherever it surfaced:
    a key lookup, a read, a hold) is a 503 with Retry-After, never a 500."""
    if isinstance(exc, DatabaseUnavailable) or is_connection_failure(exc):
        log.warning("%s %s: the database is unavailable (%s: %s)", request.method, request.url.path, type(exc).__name__,
                    first_line(exc))
        return proxy_error_response(request, DatabaseAway("the database is unavailable just now: try again shortly"))
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return proxy_error_response(request, ProxyError("internal error"))


DATABASE_EXCEPTION_HANDLERS = {DatabaseUnavailable: database_error_response, **dict.fromkeys(DATABASE_ERRORS, database_error_response)}
EXCEPTION_HANDLERS = {ProxyError: proxy_error_response, HTTPException: http_exception_response, **DATABASE_EXCEPTION_HANDLERS}
# Routes that call the services of app/, invoices/ and ledger/ also translate their typed errors.
SERVICE_EXCEPTION_HANDLERS = {LedgerError: service_error_response}
