"""Several statements as one query of the simple protocol, their parameters written as literals.

psycopg's `ClientCursor.mogrify` writes the same literals, through its
adapters: measured, about 20 µs of this process's CPU per statement, where
this takes 2 to 3. A durable batch sends three such queries; at a batch of
one settlement (the proxy's, at a few requests a millisecond) the writer's
thread used 0.877 of its CPU before (`benchmarks/append_ab.py --durable
--batch-size 1`). Each literal is written as psycopg writes it
(`tests/ledger/storage/test_pg_literals.py` compares them on every type
used), and a value of any other type is refused rather than guessed at.
"""
from __future__ import annotations

import re
from datetime import datetime
from functools import lru_cache

# What a statement may hold after a "%": psycopg's placeholders by position
# or by name (`%s`, `%(name)s`), or a "%" written twice. Python's own
# operator, which fills them, would also take `%d` or `%r`: refused here.
_PLACEHOLDER = re.compile(r"%(?:\([A-Za-z_][A-Za-z0-9_]*\)s|s|%)")


def literal(value: object) -> str:
    """A parameter as psycopg's client-side binding writes it."""
    kind = type(value)
    if kind is str:
        return _text(value)  # type: ignore[arg-type]
    if kind is int:
        return str(value) if value >= 0 else f" {value}"  # type: ignore[operator]  # the space: "- -1", never "--1", a comment
    if value is None:
        return "NULL"
    if kind is bytes:
        return f"'\\x{value.hex()}'::bytea"  # type: ignore[union-attr]
    if kind is datetime and value.tzinfo is not None:  # type: ignore[union-attr]
        return f"'{value}'::timestamptz"
    raise TypeError(f"no literal is written for a parameter of type {kind.__name__}")


def _text(value: str) -> str:
    if "\x00" in value:
        raise ValueError("PostgreSQL text cannot contain NUL characters")
    if "\\" in value:  # an escape string, a backslash itself whatever standard_conforming_strings says; the space keeps the E apart
        return " E'" + value.replace("\\", "\\\\").replace("'", "''") + "'"
    return "'" + value.replace("'", "''") + "'"


@lru_cache
def _checked(sql: str) -> str:
    """`sql` once its every "%" is a placeholder or a "%%" (cached: the statements are module constants)."""
    if _PLACEHOLDER.sub("", sql).count("%"):
        raise ValueError(f"a statement holds a '%' that is no placeholder: {sql[:80]!r}")
    return sql


def statement_text(sql: str, params: dict | tuple | None) -> str:
    """One statement with its parameters in place; without any, `sql` as it is (a "%" stays one)."""
    if not params:
        return sql
    if type(params) is dict:
        return _checked(sql) % {name: literal(value) for name, value in params.items()}
    return _checked(sql) % tuple(map(literal, params))


def statements_text(statements: list[tuple[str, dict | tuple | None]]) -> str:
    """The statements as one query, run in order by the server."""
    return ";\n".join([statement_text(sql, params) for sql, params in statements])
