"""Every limit is named once, with its unit, in its package's limits.py, and in
one package only: a limit two packages need lives in ledger/limits.py, which
every package may import (app imports what proxy or invoices own from them).
tests/support/literals.py says which numbers are not limits; ledger/ has its
own, stricter test (tests/ledger/test_limits.py)."""
from __future__ import annotations

import importlib
from collections import defaultdict
from pathlib import Path

import pytest

from tests.support.literals import assigned_names, stray_numbers

PACKAGES = ("ledger", "proxy", "invoices", "app")
# Files of data, not limits: what the numbers in them are.
DATA_FILES = {
    "proxy": {"sim/profiles.py": "the GPU profiles: what real GPUs were measured doing"},
    "invoices": {},
    "app": {"cli/demo.py": "the scripted tour's story: its prices, token counts and requests"},
}
NAMED_IN = {"ledger": ("limits.py", "money.py")}  # money.py names the units of money
UNITS_OF_TIME = {"S", "MS"}


def package_dir(package: str) -> Path:
    return Path(importlib.import_module(package).__file__).parent


@pytest.mark.parametrize("package", DATA_FILES)
def test_no_limit_is_written_outside_the_packages_limits_py(package):
    assert stray_numbers(package_dir(package), DATA_FILES[package]) == [], f"name these in {package}/limits.py"


@pytest.mark.parametrize("package", PACKAGES)
def test_each_limit_is_named_once_in_its_package(package):
    names = [name for module in NAMED_IN.get(package, ("limits.py",)) for name in assigned_names(package_dir(package) / module)]
    assert sorted(names) == sorted(set(names))


def meaning(name: str) -> str:
    """HOLD_TTL_S_DEFAULT, HOLD_TTL_S and HOLD_TTL_MS all mean the hold's lifetime."""
    return "_".join("<time>" if word in UNITS_OF_TIME else word for word in name.split("_") if word != "DEFAULT")


def test_meaning_leaves_out_the_unit_of_time_and_default():
    assert meaning("HOLD_TTL_S_DEFAULT") == meaning("HOLD_TTL_S") == meaning("HOLD_TTL_MS") == "HOLD_TTL_<time>"
    assert meaning("HOLD_TTL_S_MAX") != meaning("HOLD_TTL_S")


def test_no_limit_is_named_in_two_packages():
    named = defaultdict(list)
    for package in PACKAGES:
        for module in NAMED_IN.get(package, ("limits.py",)):
            for name in assigned_names(package_dir(package) / module):
                named[meaning(name)].append(f"{package}/{module}: {name}")
    assert {limit: places for limit, places in named.items() if len(places) > 1} == {}
