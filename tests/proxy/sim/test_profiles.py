"""The performance profiles: the decode model passes through the public measurements."""
from __future__ import annotations

import pytest

from proxy.sim.profiles import PROFILES, get_profile
from proxy.sim.worker import build_app


@pytest.mark.parametrize("name", [n for n, p in PROFILES.items() if p.paced])
def test_decode_curve_passes_through_both_measurements(name: str) -> None:
    profile = get_profile(name)

    assert profile.per_request_tok_s(1) == pytest.approx(profile.single_request_tok_s)
    assert profile.total_tok_s(profile.reference_concurrency) == pytest.approx(profile.reference_total_tok_s)
    assert profile.total_tok_s(8) > profile.total_tok_s(1)


def test_unknown_profile_is_refused() -> None:
    with pytest.raises(ValueError, match="h200"):
        build_app("a100")
