"""The blanket pair of a box ``[lo, e^eps0 lo]`` (keyword ``lo``): an independent exact enumeration of the
revealed-blanket corner pair, monotonicity in lo, the discrete Laplace default bit for bit, the clone pair at the
smallest lo, and the checks of lo."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest

from shuffledp.accounting import blanket, clones, composition


def _oracle_delta(eps0: float, n: int, lo: float, eps: float) -> float:
    """delta(eps) of the box pair by enumeration, without its (s, z, lam) form: M ~ Bin(n-1, lo) of the others are
    blanket draws, each at corner H, L, Z with omega-probabilities pi_s, pi_s, 1 - 2 pi_s (pi_s = (1-lo)/(hi-lo));
    the attacked report is at H, L, Z with probabilities pi_s hi, pi_s lo, lo (1 - 2 pi_s) under x and pi_s lo,
    pi_s hi, lo (1 - 2 pi_s) under x'; the adversary sees M and the corner counts. Sum of (P - e^eps Q)_+."""
    hi = math.exp(eps0) * lo
    pi_s = (1.0 - lo) / (hi - lo)
    p_z = max(1.0 - 2.0 * pi_s, 0.0)  # 0 at lo = 2/(e^eps0+1), up to round-off
    attacked = (((1, 0, 0), pi_s * hi, pi_s * lo), ((0, 1, 0), pi_s * lo, pi_s * hi), ((0, 0, 1), lo * p_z, lo * p_z))
    p_mass: dict[tuple[int, int, int], float] = defaultdict(float)
    q_mass: dict[tuple[int, int, int], float] = defaultdict(float)
    for m in range(n):
        p_m = math.comb(n - 1, m) * lo**m * (1.0 - lo) ** (n - 1 - m)
        for h in range(m + 1):
            for low in range(m + 1 - h):
                z = m - h - low
                ways = math.factorial(m) // (math.factorial(h) * math.factorial(low) * math.factorial(z))
                weight = p_m * ways * pi_s ** (h + low) * p_z**z
                for (dh, dl, dz), under_x, under_xp in attacked:
                    key = (h + dh, low + dl, z + dz)
                    p_mass[key] += weight * under_x
                    q_mass[key] += weight * under_xp
    return sum(max(p_mass[k] - math.exp(eps) * q_mass[k], 0.0) for k in p_mass)


def _lo_min(eps0: float) -> float:
    return 2.0 / (math.exp(eps0) + 1.0)


@pytest.mark.parametrize(("eps0", "n", "lo"), [(3.0, 12, 0.12), (3.0, 12, 0.4), (1.0, 20, 0.8), (2.0, 15, None)])
def test_equals_the_exact_enumeration(eps0: float, n: int, lo: float | None) -> None:
    """At n <= 20 every block of s is one s, the z-law is exact and the windows drop about e^-50: the module's
    delta is the enumeration's (round-off apart), and its epsilon is where the enumeration's delta crosses."""
    box = math.exp(-0.5 * eps0) if lo is None else lo
    for eps in (0.0, 0.1, 0.5, 0.9 * eps0):
        want = _oracle_delta(eps0, n, box, eps)
        assert blanket.blanket_delta(eps0, n, eps, lo=lo) == pytest.approx(want, rel=1e-12, abs=1e-20)
    for delta in (1e-3, 1e-6):
        eps = blanket.blanket_epsilon(eps0, n, delta, lo=lo)
        if eps > 0.0:
            assert _oracle_delta(eps0, n, box, eps) <= delta * (1.0 + 1e-9)
            assert _oracle_delta(eps0, n, box, eps * (1.0 - 1e-9)) > delta


def test_smallest_lo_is_the_stronger_clone_pair() -> None:
    """lo = 2/(e^eps0+1), hi = 2 e^eps0/(e^eps0+1): no Z corner, the pair of ``clones`` (exact at these n)."""
    for eps0, n in ((4.0, 50), (4.0, 400), (2.0, 1437)):
        lo = _lo_min(eps0)
        assert _oracle_delta(eps0, 8, lo, 0.5) == pytest.approx(blanket.blanket_delta(eps0, 8, 0.5, lo=lo), rel=1e-12)
        value = blanket.blanket_epsilon(eps0, n, 1e-6, lo=lo)
        assert value == pytest.approx(clones.clone_epsilon(eps0, n, 1e-6), rel=1e-9)


@pytest.mark.parametrize(("eps0", "n"), [(4.0, 400), (2.0, 300)])
def test_epsilon_decreases_as_lo_grows(eps0: float, n: int) -> None:
    los = sorted([_lo_min(eps0), math.exp(-0.5 * eps0), 0.3, 0.45, 0.6, 0.95])
    values = [blanket.blanket_epsilon(eps0, n, 1e-6, lo=lo) for lo in los]
    assert all(a > b for a, b in zip(values, values[1:])), values
    composed = [composition.pld_epsilon(blanket.composed_blanket_pld([(n, eps0, 4, lo)])[0], 1e-6) for lo in los]
    assert all(a > b for a, b in zip(composed, composed[1:])), composed


@pytest.mark.parametrize(("eps0", "n"), [(3.4434, 1437), (1.0, 200), (6.0, 50)])
def test_discrete_laplace_lo_is_the_default_bit_for_bit(eps0: float, n: int) -> None:
    lo = math.exp(-0.5 * eps0)
    assert blanket.blanket_epsilon(eps0, n, 1e-6, lo=lo) == blanket.blanket_epsilon(eps0, n, 1e-6)
    assert blanket.blanket_delta(eps0, n, 0.3, lo=lo) == blanket.blanket_delta(eps0, n, 0.3)
    assert blanket.blanket_loss_moments(eps0, n, lo=lo) == blanket.blanket_loss_moments(eps0, n)
    with_lo, default = blanket.blanket_loss_support(eps0, n, lo=lo), blanket.blanket_loss_support(eps0, n)
    assert all(np.array_equal(a, b) for a, b in zip(with_lo[:2], default[:2])) and with_lo[2] == default[2]
    pld_lo, h_lo = blanket.composed_blanket_pld([(n, eps0, 3, lo)])
    pld_default, h_default = blanket.composed_blanket_pld([(n, eps0, 3)])
    assert h_lo == h_default
    assert composition.pld_epsilon(pld_lo, 1e-6) == composition.pld_epsilon(pld_default, 1e-6)
    assert blanket.composed_blanket_pld([(n, eps0, 3, None)])[1] == h_default


def test_general_lo_in_the_support_and_the_composition() -> None:
    """A box lo: masses sum to one, and the composed PLD's single round sits just above the exact value."""
    eps0, n, lo = 4.0, 400, 0.3
    losses, probs, infinity = blanket.blanket_loss_support(eps0, n, lo=lo)
    assert float(probs.sum()) + infinity == pytest.approx(1.0, abs=1e-12)
    assert float(np.abs(losses).max()) <= eps0 * (1.0 + 1e-12)
    exact = blanket.blanket_epsilon(eps0, n, 1e-6, lo=lo)
    via_pld = composition.pld_epsilon(blanket.composed_blanket_pld([(n, eps0, 1, lo)])[0], 1e-6)
    assert exact - 1e-9 <= via_pld <= exact * (1.0 + 1e-3)


@pytest.mark.parametrize("bad", [0.01, 1.0, 1.5, -0.2, math.nan, math.inf])
def test_lo_outside_the_range_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match=r"lo must be None .* <= lo < 1"):
        blanket.blanket_epsilon(4.0, 100, 1e-6, lo=bad)
    with pytest.raises(ValueError, match="lo must be"):
        blanket.composed_blanket_pld([(100, 4.0, 2, bad)])


def test_lo_of_the_wrong_type_is_refused() -> None:
    for bad in ("0.3", True):
        with pytest.raises(TypeError, match="lo must be"):
            blanket.blanket_delta(4.0, 100, 0.5, lo=bad)
    with pytest.raises(TypeError, match="each item must be"):
        blanket.composed_blanket_pld([(100, 4.0)])
