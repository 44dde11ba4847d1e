"""The literals a durable batch's queries carry are psycopg's own, and the server reads back what was sent."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import psycopg
import pytest
from psycopg import ClientCursor

from ledger.storage.pg_literals import literal, statement_text, statements_text
from tests.conftest import POSTGRES_ADMIN_URL, postgres_available

TEXTS = ["", "plain", "it's", "''", "back\\slash", "\\x00ff", "E'\\'; DROP TABLE holds; --", "tab\tnew\nline", "é ü 中文 🚀",
         '{"a":"b\\"c"}', "-- comment", "/* open", "%s", "%(name)s", "100%"]
INTS = [0, 1, -1, 5, -5, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63)]
BYTES = [b"", b"\x00", b"\x00\xff\x10", bytes(range(256)), b"'\\"]
TIMES = [datetime(2026, 12, 5, 1, 2, 3, 456789, tzinfo=UTC), datetime(2026, 12, 5, 1, 2, 3, tzinfo=UTC),
         datetime(2026, 12, 5, 1, 2, 3, 7, tzinfo=timezone(timedelta(hours=-5, minutes=-30)))]
VALUES = [*TEXTS, *INTS, *BYTES, *TIMES, None]


@pytest.fixture(scope="module")
def server() -> psycopg.Connection:
    """A connection to the test server's admin database: only literals are selected, nothing is written."""
    if not postgres_available():
        pytest.skip("PostgreSQL is not reachable at PARALON_TEST_POSTGRES_URL")
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as conn:
        yield conn


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_a_literal_is_written_as_psycopgs_client_side_binding_writes_it(server, value):
    with ClientCursor(server) as cursor:
        assert literal(value) == cursor.mogrify("%s", (value,))


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_the_server_reads_back_the_value_sent(server, value):
    with ClientCursor(server) as cursor:
        cursor.execute(statement_text("SELECT %s", (value,)))
        assert cursor.fetchone()[0] == value


def test_statements_by_name_and_by_position_run_in_order_with_a_percent_kept():
    text = statements_text([("SELECT %(a)s, %(b)s, 'x%%'", {"a": "it's", "b": -3}), ("SELECT %s, %s", (b"\x01", None)),
                            ("SELECT '100%'", None), ("SELECT 1", {})])
    assert text == "SELECT 'it''s',  -3, 'x%';\nSELECT '\\x01'::bytea, NULL;\nSELECT '100%';\nSELECT 1"


def test_a_hostile_text_stays_one_literal_on_the_server(server):
    hostile = "x'); DELETE FROM pg_database; SELECT ('"
    with ClientCursor(server) as cursor:
        cursor.execute(statements_text([("SELECT %(v)s::text", {"v": hostile}), ("SELECT %s::text", (hostile + "\\",))]))
        assert cursor.fetchall() == [(hostile,)]
        assert cursor.nextset() and cursor.fetchall() == [(hostile + "\\",)]
        assert not cursor.nextset()


@pytest.mark.parametrize("value", [True, 1.5, datetime(2026, 12, 5), [1], {"a": 1}, bytearray(b"x")], ids=repr)
def test_a_parameter_of_any_other_type_is_refused(value):
    with pytest.raises(TypeError, match="no literal"):
        literal(value)


def test_text_with_nul_is_refused():
    with pytest.raises(ValueError, match="NUL"):
        literal("a\x00b")


@pytest.mark.parametrize("sql", ["SELECT %d", "SELECT %(a)d", "SELECT %r", "SELECT 5 % 2 + %s", "SELECT %-5s"])
def test_a_percent_that_is_no_placeholder_is_refused(sql):
    with pytest.raises(ValueError, match="no placeholder"):
        statement_text(sql, (1,))
