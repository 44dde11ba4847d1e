"""PostgreSQL array literals, built at C speed.

psycopg adapts a list element by element in Python, which was the largest
single cost of a batch; one text literal per column, cast on the server
(`%(x)s::bigint[]`), costs a `join`.
"""
from __future__ import annotations


def ints(values) -> str:
    return "{" + ",".join(map(str, values)) + "}"


def nullable_ints(values) -> str:
    return "{" + ",".join(["NULL" if v is None else str(v) for v in values]) + "}"


def words(values) -> str:
    """Strings that need no quoting: event type names."""
    return "{" + ",".join(values) + "}"


def bytea_array(values) -> str:
    """bytea elements in hex form; the backslash is doubled for the array parser."""
    return "{" + ",".join(['"\\\\x' + v.hex() + '"' for v in values]) + "}"


def _quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def texts(values) -> str:
    return "{" + ",".join(map(_quoted, values)) + "}"


def nullable_texts(values) -> str:
    return "{" + ",".join(["NULL" if v is None else _quoted(v) for v in values]) + "}"
