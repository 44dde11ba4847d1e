"""Errors the proxy raises to a caller of the OpenAI API, each with its HTTP
status and OpenAI error type. The HTTP edge (app/http/errors.py) turns them
into OpenAI's error JSON and adds its own (authentication, permissions).

Each also says whether asking again can help, as the OpenAI SDKs read it:
`retry_after_s` (a `retry-after` header) where it can, `should_retry = False`
(`x-should-retry: false`) where it cannot, so an SDK does not spend its retries
on a bad body, a missing key or an exhausted spend limit."""
from __future__ import annotations

from ledger.errors import InsufficientFunds, SpendLimitReached, WriterOverloaded
from proxy.limits import DATABASE_RETRY_AFTER_S, HOLDS_BUSY_RETRY_AFTER_S, NO_WORKER_RETRY_AFTER_S, NOT_READY_RETRY_AFTER_S


class ProxyError(Exception):
    status = 500
    error_type = "api_error"
    code = "internal_error"
    param: str | None = None
    retry_after_s: int | None = None
    should_retry: bool | None = None  # None: the SDK decides by the status

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        if param is not None:
            self.param = param
        if code is not None:
            self.code = code


class CallerMistake(ProxyError):
    """A 4xx that the same request will meet again: no retry can fix it."""

    should_retry = False


class InvalidRequest(CallerMistake):
    status, error_type, code = 400, "invalid_request_error", "invalid_request"


class ContextTooLong(InvalidRequest):
    code = "context_length_exceeded"


class NotEnoughCredits(CallerMistake):
    status, error_type, code = 402, "insufficient_quota", "insufficient_credits"


class UnknownModel(CallerMistake):
    status, error_type, code = 404, "invalid_request_error", "model_not_found"


class LimitReached(CallerMistake):
    """The key's spend limit: a 429 as OpenAI's exhausted quota is, and like it never worth a retry."""

    status, error_type, code = 429, "insufficient_quota", "insufficient_quota"


class NoWorkerAvailable(ProxyError):
    status, error_type, code = 503, "service_unavailable", "no_worker_available"
    retry_after_s = NO_WORKER_RETRY_AFTER_S


class UpstreamFailed(ProxyError):
    status, error_type, code = 502, "api_error", "upstream_error"


class NotReady(ProxyError):
    """What was asked for is being prepared (a read model is catching up): ask again shortly."""

    status, error_type, code = 503, "service_unavailable", "not_ready"
    retry_after_s = NOT_READY_RETRY_AFTER_S


class DatabaseAway(ProxyError):
    """The database cannot be reached just now: ask again shortly (Retry-After)."""

    status, error_type, code = 503, "service_unavailable", "database_unavailable"
    retry_after_s = DATABASE_RETRY_AFTER_S


class HoldsBusy(ProxyError):
    """More holds are waiting to be written than the queue takes: ask again shortly (Retry-After)."""

    status, error_type, code = 503, "service_unavailable", "overloaded"
    retry_after_s = HOLDS_BUSY_RETRY_AFTER_S

    def __init__(self) -> None:
        super().__init__("too many requests are waiting for their holds just now: try again shortly")


def hold_refusal(exc: BaseException, to_need_less: str) -> ProxyError | None:
    """The caller's error for a hold the ledger refused (`to_need_less`: how
    this request could ask for less); None for any other failure."""
    if isinstance(exc, InsufficientFunds):
        return NotEnoughCredits(f"not enough credits for this request: add credits or {to_need_less}")
    if isinstance(exc, SpendLimitReached):
        return LimitReached("this API key has reached its spend limit")
    if isinstance(exc, WriterOverloaded):
        return HoldsBusy()
    return None
