"""What every command shares: the database of PARALON_DATABASE_URL, --json,
and typed errors as one line (or JSON) with exit status 2."""
from __future__ import annotations

import json
import sys
from functools import wraps

import click
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from app.settings import Settings
from ledger.db import make_engine
from ledger.errors import LedgerError

EXIT_INVALID = click.UsageError.exit_code  # 2, as for a command line click refuses

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


def emit(as_json: bool, data: dict, text: str) -> None:
    click.echo(json.dumps(data, sort_keys=True) if as_json else text)


def fail(as_json: bool, code: str, message: str) -> None:
    if as_json:
        click.echo(json.dumps({"error": {"code": code, "message": message}}), err=True)
    else:
        click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_INVALID)


def handles_errors(fn):
    """Typed errors become one clear line (or JSON) and exit status 2; nothing was written."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = kwargs.get("as_json", False)
        try:
            return fn(*args, **kwargs)
        except LedgerError as exc:
            fail(as_json, exc.code, str(exc))
        except ValueError as exc:
            fail(as_json, "invalid_input", str(exc))
        except OperationalError as exc:
            fail(as_json, "database_unreachable", f"cannot use the database: {exc.orig}")

    return wrapper


def engine() -> Engine:
    return make_engine(Settings.from_env().database.url)


def owner_engine() -> Engine:
    """The owner role's (PARALON_MIGRATION_DATABASE_URL, else PARALON_DATABASE_URL): for migrations and repairs."""
    return make_engine(Settings.from_env().database.owner_url)


def progress(total: int, label: str):
    return click.progressbar(length=total, label=label, file=sys.stderr, show_pos=True)
