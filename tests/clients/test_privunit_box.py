"""PrivUnit2's split of eps0 alone and its d-free box: every client's actual likelihood-ratio box (its own p, cap and
margin) lies in :func:`privunit_blanket_box` for every d; the box grows with eps0; the fixed split's decode factor m
stays within 0.4% of the best per-d split (an oracle: the search over 255 splits, from the same formulas); a report
of the per-d split (magic ``SDPU``) is refused."""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np
import pytest

from shuffledp.accounting.privunit_box import (
    BOX_SLACK,
    CAP_SHARE,
    EPS_CAP_MAX,
    PRIVUNIT_MAX_EPS0,
    PRIVUNIT_MIN_EPS0,
    privunit_blanket_box,
    privunit_split,
)
from shuffledp.clients import privunit as pu
from shuffledp.clients.noise import ChaCha20Rng
from shuffledp.clients.report import ReportError

EPS0_GRID = [PRIVUNIT_MIN_EPS0, 0.05, 0.3, 1.0, 2.0, 3.3204, 4.0, 6.0, 8.0, 10.35, 12.0, 20.0, 40.0, PRIVUNIT_MAX_EPS0]
DIMS = [2, 3, 10, 110, 650, 100000]


def _mp(q: Fraction) -> mpmath.mpf:
    with mpmath.workdps(60):
        return mpmath.mpf(q.numerator) / q.denominator


def _old_best_m(eps0: float, d: int) -> float:
    """The oracle: the largest m over the 255 splits eps_p = eps0 i / 256 that keep the cap mass in [2^-10, 1/2)
    and the budget (the rule a split searched per d uses), with the client's own cap formulas."""
    best = 0.0
    for i in range(1, 256):
        eps_p = eps0 * i / 256
        p = 1.0 / (1.0 + math.exp(-eps_p))
        if p >= 1.0:
            continue
        eps_cap = eps0 - (math.log(p) - math.log1p(-p))
        need = 1.0 / ((1.0 + math.exp(eps_cap)) * (1.0 - pu.CAP_MARGIN))
        if not pu.MIN_CAP_MASS <= need < 0.5:
            continue
        gamma = pu._gamma_for(need * (1.0 + 2.0**-30), d)
        cap = pu.cap_mass(gamma, d)
        step = max(gamma * 2.0**-40, 2.0**-60)
        while cap < need and gamma > 0.0:
            gamma = max(0.0, gamma - step)
            step *= 2.0
            cap = pu.cap_mass(gamma, d)
        if cap >= 0.5 or pu._eps(p, cap) > eps0:
            continue
        best = max(best, math.exp(pu._log_k(gamma, d)) * (p / cap - (1.0 - p) / (1.0 - cap)))
    return best


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("eps0", EPS0_GRID)
def test_the_clients_box_lies_in_the_eps0_only_box(eps0: float, d: int) -> None:
    """The report's density against the uniform law on the sphere is ``p / A'`` on the cap and ``(1 - p) / (1 - A')``
    off it, with ``A'`` the proposal mass of the float-tested cap, somewhere in ``[A_low, A]`` (``A_low = A (1 -
    CAP_MARGIN)``: the float test may shrink the cap by that much, docs/mechanisms.md). ``p / A'`` decreases and
    ``(1 - p) / (1 - A')`` increases in ``A'``, so both extremes of the box are at ``A' = A_low``:
    ``hi_a = p / A_low``, ``lo_a = (1 - p) / (1 - A_low)``. Compared exactly: the client's floats as rationals,
    ``e^log_ratio`` at 60 digits."""
    par = pu.privunit_params(eps0, d)
    lo, log_ratio = privunit_blanket_box(eps0)
    p, low = Fraction(par.p), Fraction(par.cap) * (1 - Fraction(pu.CAP_MARGIN))
    lo_a, hi_a = (1 - p) / (1 - low), p / low
    assert Fraction(lo) <= lo_a
    with mpmath.workdps(60):
        assert _mp(hi_a) <= mpmath.mpf(lo) * mpmath.exp(mpmath.mpf(log_ratio))
    assert par.eps_used <= eps0 and pu.MIN_CAP_MASS <= par.cap < 0.5
    # the box is L(eps0) and e^eps0 L(eps0) of the split, widened by BOX_SLACK only
    eps_p, eps_cap = privunit_split(eps0)
    big_l = (1 + math.exp(-eps_cap)) / (1 + math.exp(eps_p))
    assert lo == pytest.approx(big_l * (1 - BOX_SLACK), rel=1e-14)
    assert log_ratio == eps0 + 2 * BOX_SLACK


def test_the_box_at_eps0_4_and_its_comparisons() -> None:
    """L(4) = (1 + e^-8/3) / (1 + e^4/3) = 0.2231, against e^-2 = 0.135 (the discrete Laplace's blanket) and
    2 / (e^4 + 1) = 0.036 (any eps0-LDP randomizer)."""
    lo, log_ratio = privunit_blanket_box(4.0)
    assert lo == pytest.approx(0.22310, abs=1e-5)
    assert lo > math.exp(-2.0) > 2.0 / (math.exp(4.0) + 1.0)
    assert log_ratio - 4.0 == pytest.approx(2e-9)


def test_the_box_grows_with_eps0() -> None:
    """A smaller eps0's box lies inside a larger one's: lo does not increase, lo e^log_ratio does not decrease.
    Above eps0 = 10.35 the top ``H`` tends to ``1 + e^EPS_CAP_MAX`` and its float evaluation is flat up to a relative
    few 1e-15; the slack (1e-9) of every box keeps the smaller eps0's true ``[L, H]`` inside the larger's box."""
    grid = np.unique(np.concatenate([np.geomspace(PRIVUNIT_MIN_EPS0, PRIVUNIT_MAX_EPS0, 600), EPS0_GRID]))
    boxes = [privunit_blanket_box(float(e)) for e in grid]
    log_lo = np.array([math.log(lo) for lo, _ in boxes])
    log_hi = log_lo + np.array([r for _, r in boxes])
    assert np.all(np.diff(log_lo) <= 0) and np.all(np.diff(log_hi) >= -1e-13)
    assert np.all(np.diff(log_hi)[grid[1:] < 10.35] > 0)
    assert 0 < boxes[-1][0] < boxes[0][0] < 1


@pytest.mark.parametrize("eps0", EPS0_GRID + [0.0061, 9.0, 10.0, 14.1, 20.1, 33.3])
def test_the_split_spends_at_most_eps0(eps0: float) -> None:
    eps_p, eps_cap = privunit_split(eps0)
    assert Fraction(eps_p) + Fraction(eps_cap) <= Fraction(eps0)
    assert eps0 - eps_p - eps_cap <= 4 * math.ulp(eps0)
    assert eps_cap == min(CAP_SHARE * eps0, EPS_CAP_MAX) and eps_p > 0
    assert 1 / (1 + math.exp(EPS_CAP_MAX)) <= 1 / (1 + math.exp(eps_cap)) <= (1 - 2.0**-9) / 2


@pytest.mark.parametrize("bad,kind,words", [
    (0.005, ValueError, "no cap of mass < 1/2"), (0.0, ValueError, "privunit2's range"),
    (-1.0, ValueError, "privunit2's range"), (64.5, ValueError, "privunit2's range"),
    (math.nan, ValueError, "privunit2's range"), (math.inf, ValueError, "privunit2's range"),
    (True, TypeError, "privunit2's range"), ("1", TypeError, "privunit2's range"),
])
def test_eps0_outside_the_range_is_refused(bad: object, kind: type, words: str) -> None:
    with pytest.raises(kind, match=words):
        privunit_split(bad)


@pytest.mark.parametrize("bad", [0.0, -1.0, 100.5, math.nan, math.inf, True, "1"])
def test_the_box_refuses_an_eps0_outside_the_accounting_range(bad: object) -> None:
    with pytest.raises((TypeError, ValueError), match="eps0"):
        privunit_blanket_box(bad)


@pytest.mark.parametrize("eps0", [1e-6, 1e-3, 0.005, 70.0, 100.0])
def test_the_box_outside_the_clients_range_is_the_formula_and_a_valid_blanket_box(eps0: float) -> None:
    """A calibration searches eps0 from 0.001: the box answers there (no client reports there), still the split's
    formula, and a box the blanket pair accepts (lo >= 2 / (e^log_ratio + 1), lo < 1)."""
    lo, log_ratio = privunit_blanket_box(eps0)
    eps_cap = min(CAP_SHARE * eps0, EPS_CAP_MAX)
    eps_p = eps0 - eps_cap
    expected = (1 + math.exp(-eps_cap)) / (1 + math.exp(eps_p))
    assert lo == pytest.approx(expected, rel=2 * BOX_SLACK) and lo < expected
    assert 2.0 / (math.exp(log_ratio) + 1.0) <= lo < 1.0


def test_the_client_refuses_a_too_small_eps0_when_built() -> None:
    with pytest.raises(ValueError, match="no cap of mass < 1/2"):
        pu.PrivUnit2Mechanism(0.005, 1.0)
    with pytest.raises(ValueError, match="no cap of mass < 1/2"):
        pu.privunit_params(0.005, 10)


@pytest.mark.parametrize("eps0", [1.0, 3.3204, 4.0, 6.0])
@pytest.mark.parametrize("d", [10, 110, 650])
def test_the_fixed_split_keeps_m_within_0_4_percent_of_the_best_per_d(eps0: float, d: int) -> None:
    ratio = pu.privunit_params(eps0, d).m / _old_best_m(eps0, d)
    assert 0.996 <= ratio <= 1.0 + 1e-3, ratio


@pytest.mark.parametrize("eps0", [8.0, 10.0])
def test_the_fixed_split_keeps_m_within_1_1_percent_at_larger_eps0(eps0: float) -> None:
    for d in (10, 110, 650):
        assert pu.privunit_params(eps0, d).m / _old_best_m(eps0, d) >= 0.989


def test_a_report_of_the_per_d_split_is_refused() -> None:
    mech = pu.PrivUnit2Mechanism(2.0, 1.0, rng=ChaCha20Rng(bytes(32)))
    report = mech.randomize(np.ones(7))
    assert report[:4] == pu.PRIVUNIT_MAGIC == b"SDU2"
    with pytest.raises(ReportError, match="bad magic b'SDPU'"):
        mech.decode(b"SDPU" + report[4:], 7)
    assert mech.decode_batch([report, b"SDPU" + report[4:]], 7).refused.keys() == {1}
