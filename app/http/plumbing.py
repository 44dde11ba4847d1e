"""What every controller does the same way: answer JSON, read a JSON body,
and run a service function on a database connection off the event loop."""
from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Annotated, TypeVar

import orjson
from litestar import Request, Response
from litestar.params import PathParameter, QueryParameter
from sqlalchemy import Engine

from ledger.limits import IDEMPOTENCY_KEY_CHARS_MAX, INT64_MAX
from proxy.errors import InvalidRequest

T = TypeVar("T")
# Row ids are the database's BIGINT: a larger one is a 400 here, not an error from the database.
PathId = Annotated[int, PathParameter(ge=1, le=INT64_MAX)]
QueryId = Annotated[int | None, QueryParameter(ge=1, le=INT64_MAX)]
# A name in a path that becomes a lookup key, a month or a file name (PAR-2026-000001.pdf,
# 2026-11.json, chatcmpl-…): ASCII letters, digits and . _ : - only. PostgreSQL refuses a NUL
# in text (a 500), a newline or a non-Latin-1 letter breaks a header, and \d matches
# every script's digits; all of them are a 400 here, before anything is read.
PATH_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"
PathName = Annotated[str, PathParameter(pattern=PATH_NAME_PATTERN, max_length=IDEMPOTENCY_KEY_CHARS_MAX)]
_PATH_NAME = re.compile(PATH_NAME_PATTERN.removeprefix("^").removesuffix("$"))


def path_name(value: str, what: str) -> str:
    """The pattern again, whole: Python's `$` (so Litestar's check) lets one trailing newline through."""
    if _PATH_NAME.fullmatch(value) is None:
        raise InvalidRequest(f"{what} is ASCII letters, digits and . _ : - only", param=what)
    return value


def json_response(data: object, status: int = 200, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json", headers=headers)


async def json_body(request: Request) -> object:
    """The body as JSON, whatever its shape."""
    return parse_json_body(await request.body())


def parse_json_body(raw: bytes) -> object:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidRequest("the request body is not valid JSON") from None


async def json_object(request: Request) -> dict:
    """The body as a JSON object; no body at all is an empty one."""
    body = await json_body(request) if await request.body() else {}
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return body


def usd_text(value: object, field: str) -> str:
    """Amounts come as decimal text ("5.00"): a JSON number may already have lost digits to a float."""
    if not isinstance(value, str):
        raise InvalidRequest(f'{field} is decimal text such as "5.00"', param=field)
    return value


async def read(request: Request, work: Callable[..., T], *args: object) -> T:
    """`work(conn, *args)` on a connection of its own, in a thread."""
    return await asyncio.to_thread(_run, request.app.state.ledger.engine, False, work, args)


async def write(request: Request, work: Callable[..., T], *args: object) -> T:
    """`work(conn, *args)` in a transaction of its own, in a thread: committed when it returns."""
    return await asyncio.to_thread(_run, request.app.state.ledger.engine, True, work, args)


def _run(engine: Engine, in_transaction: bool, work: Callable[..., T], args: tuple) -> T:
    with engine.begin() if in_transaction else engine.connect() as conn:
        return work(conn, *args)
