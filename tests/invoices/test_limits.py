"""Every limit of invoices/ is named once, with its unit, in invoices/limits.py
(tests/support/literals.py says which numbers are not limits)."""
from __future__ import annotations

from pathlib import Path

import invoices
from tests.support.literals import assigned_names, stray_numbers

INVOICES_DIR = Path(invoices.__file__).parent


def test_no_limit_is_written_outside_limits_py():
    assert stray_numbers(INVOICES_DIR, data_files={}) == [], "name these in invoices/limits.py"


def test_each_limit_is_named_once():
    names = assigned_names(INVOICES_DIR / "limits.py")
    assert sorted(names) == sorted(set(names))
