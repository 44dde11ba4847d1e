"""Typed errors. Each carries a stable `code`, the name a result or an API reports."""
from __future__ import annotations


def a_or_an(word: str) -> str:
    """A word a message fills in, with its article: 'an owner', 'a customer'
    (the names filled in are roles, account kinds and part types: none says
    "you" for a leading u)."""
    return ("an " if word[:1].lower() in "aeio" else "a ") + word


class LedgerError(Exception):
    code = "ledger_error"


class InvalidInput(LedgerError):
    code = "invalid_input"


class BadDatabaseUrl(InvalidInput):
    code = "bad_database_url"


class InvalidAmount(InvalidInput):
    code = "invalid_amount"


class UnknownAccount(InvalidInput):
    code = "unknown_account"


class WrongAccountKind(InvalidInput):
    code = "wrong_account_kind"


class UnknownEvent(InvalidInput):
    code = "unknown_event"


class NotReversible(InvalidInput):
    code = "not_reversible"


class InsufficientFunds(LedgerError):
    """The customer's available balance (credits minus holds) would go below zero."""

    code = "overdraft"


class SpendLimitReached(LedgerError):
    """What a spend limit has left (limit - spent - held) does not cover the hold."""

    code = "spend_limit_reached"


class IdempotencyConflict(LedgerError):
    """The key was used before for a command with other content."""

    code = "exists_with_different_content"


class HoldError(LedgerError):
    code = "hold_error"


class HoldNotActive(HoldError):
    code = "hold_not_active"


class CaptureExceedsHold(HoldError):
    code = "capture_exceeds_hold"


class WriterOverloaded(LedgerError):
    """The group-commit queue is full; the caller should back off."""

    code = "overloaded"


class WriterClosed(LedgerError):
    code = "writer_closed"


class DatabaseUnavailable(LedgerError):
    """The database could not be reached (refused, dropped, timed out) after
    the retries allowed. Try again shortly: every command carries its
    idempotency key, so a command whose commit was cut off is found, not
    repeated, when it is sent again."""

    code = "database_unavailable"


class FlushNotConfirmed(DatabaseUnavailable):
    """A batch's commit may have taken effect, but its flush could not be
    confirmed: no caller may be told it is done, nor that it failed. Sent
    again with the same idempotency key, it is found if it committed."""

    def __init__(self, message: str = "the batch may have committed, but its flush could not be confirmed: "
                                      "send it again with the same idempotency key") -> None:
        super().__init__(message)


class InvariantBroken(LedgerError):
    """Something that must never happen did; raised instead of `assert`."""

    code = "invariant_broken"


def first_line(exc: BaseException) -> str:
    """An error's first line, for a log line that names its cause (a database's errors run to several)."""
    return str(exc).partition("\n")[0]
