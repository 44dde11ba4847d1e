"""Errors the proxy raises to a caller of the OpenAI API, each with its HTTP
status and OpenAI error type. The HTTP edge (app/http/errors.py) turns them
into OpenAI's error JSON and adds its own (authentication, permissions)."""
from __future__ import annotations

from proxy.limits import DATABASE_RETRY_AFTER_S, NOT_READY_RETRY_AFTER_S


class ProxyError(Exception):
    status = 500
    error_type = "api_error"
    code = "internal_error"
    param: str | None = None
    retry_after_s: int | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        if param is not None:
            self.param = param


class InvalidRequest(ProxyError):
    status, error_type, code = 400, "invalid_request_error", "invalid_request"


class ContextTooLong(InvalidRequest):
    code = "context_length_exceeded"


class NotEnoughCredits(ProxyError):
    status, error_type, code = 402, "insufficient_quota", "insufficient_credits"


class UnknownModel(ProxyError):
    status, error_type, code = 404, "invalid_request_error", "model_not_found"


class LimitReached(ProxyError):
    status, error_type, code = 429, "rate_limit_error", "spend_limit_reached"


class NoWorkerAvailable(ProxyError):
    status, error_type, code = 503, "service_unavailable", "no_worker_available"


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
