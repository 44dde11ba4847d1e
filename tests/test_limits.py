"""No limit is named in two packages: a limit two packages need lives in
ledger/limits.py, which every package may import (proxy, invoices and app
import it from there; app imports what proxy or invoices own from them)."""
from __future__ import annotations

import importlib
from collections import defaultdict
from pathlib import Path

from tests.support.literals import assigned_names

PACKAGES = ("ledger", "proxy", "invoices", "app")
NAMED_IN = {"ledger": ("limits.py", "money.py")}  # money.py names the units of money
UNITS_OF_TIME = {"S", "MS"}


def meaning(name: str) -> str:
    """HOLD_TTL_S_DEFAULT, HOLD_TTL_S and HOLD_TTL_MS all mean the hold's lifetime."""
    return "_".join("<time>" if word in UNITS_OF_TIME else word for word in name.split("_") if word != "DEFAULT")


def test_meaning_leaves_out_the_unit_of_time_and_default():
    assert meaning("HOLD_TTL_S_DEFAULT") == meaning("HOLD_TTL_S") == meaning("HOLD_TTL_MS") == "HOLD_TTL_<time>"
    assert meaning("HOLD_TTL_S_MAX") != meaning("HOLD_TTL_S")


def test_no_limit_is_named_in_two_packages():
    named = defaultdict(list)
    for package in PACKAGES:
        directory = Path(importlib.import_module(package).__file__).parent
        for module in NAMED_IN.get(package, ("limits.py",)):
            for name in assigned_names(directory / module):
                named[meaning(name)].append(f"{package}/{module}: {name}")
    assert {limit: places for limit, places in named.items() if len(places) > 1} == {}
