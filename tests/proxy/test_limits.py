"""Every limit of proxy/ is named once, with its unit, in proxy/limits.py
(tests/support/literals.py says which numbers are not limits)."""
from __future__ import annotations

from pathlib import Path

import proxy
from tests.support.literals import assigned_names, stray_numbers

PROXY_DIR = Path(proxy.__file__).parent
DATA_FILES = {"sim/profiles.py": "the GPU profiles: what real GPUs were measured doing, a table of data"}


def test_no_limit_is_written_outside_limits_py():
    assert stray_numbers(PROXY_DIR, DATA_FILES) == [], "name these in proxy/limits.py"


def test_each_limit_is_named_once():
    names = assigned_names(PROXY_DIR / "limits.py")
    assert sorted(names) == sorted(set(names))
