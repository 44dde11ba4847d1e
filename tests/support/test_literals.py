"""What the limits tests count as a limit written outside limits.py, and what they pass over."""
from __future__ import annotations

import textwrap
from pathlib import Path

from tests.support.literals import stray_numbers

MODULE = '''
WAIT_S = 1.0
PAGE_ROWS = 500
DEFAULT_PORT = 8100


def answer(body, status=200):
    return body, status


class Refused(Exception):
    status, kind = 404, "not_found"

    def __init__(self, status, message):
        super().__init__(message)


def handler(response, row, reference, report):
    if response.status_code != 200:
        raise Refused(503, "away")
    column = String(500)
    first = row[3]
    short = reference[:500]
    answer(column, 201)
    option("--port", default=8000, type=IntRange(1, 65535))
    report.lines(200)
    return first, short, sleep(0.1), sleep(1)
'''


def test_statuses_and_ports_named_as_such_are_passed_over_and_every_other_limit_counted(tmp_path: Path):
    (tmp_path / "module.py").write_text(textwrap.dedent(MODULE))
    (tmp_path / "limits.py").write_text("ANYTHING = 12345\n")
    counted = [line.split(": ", 1)[1] for line in stray_numbers(tmp_path, data_files={})]
    assert sorted(counted, key=float) == sorted(["1.0", "500", "500", "500", "65535", "200", "0.1"], key=float)


def test_a_file_of_data_is_passed_over(tmp_path: Path):
    (tmp_path / "profiles.py").write_text("H200 = {'tok_s': 170}\n")
    assert stray_numbers(tmp_path, data_files={"profiles.py": "measured, a table"}) == []
