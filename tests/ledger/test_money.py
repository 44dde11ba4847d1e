"""Integer money: parsing is exact, the split always adds up."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.errors import InvalidAmount
from ledger.money import nano_usd_to_usd_text, split_charge, usd_to_nano_usd


@pytest.mark.parametrize(
    "text, nano",
    [("12.50", 12_500_000_000), ("0.000000001", 1), ("7", 7_000_000_000), (" 1.1 ", 1_100_000_000), ("-2.25", -2_250_000_000)],
)
def test_usd_text_parses_exactly(text, nano):
    assert usd_to_nano_usd(text) == nano


@pytest.mark.parametrize("text", ["", "abc", "1.0000000001", "NaN", "Infinity", "1e-10", "0x10"])
def test_unparseable_or_too_precise_amounts_are_refused(text):
    with pytest.raises(InvalidAmount):
        usd_to_nano_usd(text)


def test_cents_only_amounts_can_be_required():
    assert usd_to_nano_usd("25.00", decimals_max=2) == 25_000_000_000
    with pytest.raises(InvalidAmount):
        usd_to_nano_usd("25.001", decimals_max=2)


@given(st.integers(min_value=0, max_value=10**18))
def test_owner_and_platform_shares_add_up_to_the_charge(charge):
    owner, platform = split_charge(charge)
    assert owner == charge * 80 // 100
    assert owner + platform == charge and 0 <= platform <= charge


@given(st.integers(min_value=-(10**18), max_value=10**18))
def test_text_round_trips(nano):
    assert usd_to_nano_usd(nano_usd_to_usd_text(nano)) == nano


@pytest.mark.parametrize("text", ["1e999999999", "1e30", "1E+3", "١٢", "1_000", "12,50", "", ".", "+", "0x10", "NaN", "Infinity",
                                  "12345678901", "99999999999.5", " 1 2"])
def test_an_amount_that_is_not_plain_ascii_decimal_within_the_limit_is_refused(text):
    """Given text that Decimal() alone would take (underscores, other scripts'
    digits, exponents that overflow) or that exceeds the limit, when parsed as
    USD, then it is an InvalidAmount (exit 2, 400), never another exception."""
    with pytest.raises(InvalidAmount):
        usd_to_nano_usd(text)


@pytest.mark.parametrize(("text", "nano_usd"), [("12.50", 12_500_000_000), ("0.000000001", 1), (".5", 500_000_000),
                                                ("-1.25", -1_250_000_000), ("1000000000", 10**18), (7, 7_000_000_000), (2.5, 2_500_000_000)])
def test_plain_decimals_parse_exactly(text, nano_usd):
    assert usd_to_nano_usd(text) == nano_usd
