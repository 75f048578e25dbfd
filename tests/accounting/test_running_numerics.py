"""The numerical pieces of a charge, against their straightforward forms: the epsilon query's closed form and its
delta re-check, the log moment generating functions behind the Chernoff windows, the block starts and the one-round
mixture of block rows."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest

from shuffledp.accounting import clone_blocks, spectral
from shuffledp.accounting import pld as P

H = 2.0**-13  # the grid of the benchmark's first rounds (n in [5e4, 2e5], eps0 = 1)


def _delta_straight(losses: np.ndarray, probs: np.ndarray, inf_mass: float, eps: float) -> float:
    """``inf + sum_{l > eps} p (1 - e^{eps - l})``, term by term with an exactly rounded sum."""
    above = losses > eps
    return inf_mass + math.fsum((probs[above] * -np.expm1(eps - losses[above])).tolist())


#: Relative slack of the re-computed delta around the query's target (the query is exact up to round-off) ...
DELTA_RTOL = 1e-9
#: ... plus an absolute one per support point: the query's suffix sums of masses that sum to 1 carry up to about
#: one unit roundoff of absolute error per term added.
DELTA_ATOL_PER_POINT = 2.0**-53
#: How far below the returned epsilon the target delta must already be exceeded (relative to max(1, epsilon)).
BELOW_STEP = 1e-6


def _random_pmf(rng: np.random.Generator, size: int, interval: float, tiny: bool) -> tuple[np.ndarray, np.ndarray]:
    lower = int(rng.integers(-size, size // 4))
    losses = (np.arange(size) + lower) * interval
    probs = np.exp(-0.5 * ((np.arange(size) - 0.45 * size) / (0.1 * size)) ** 2) * rng.random(size)
    probs[rng.random(size) < 0.1] = 0.0
    if tiny:  # masses far below the smallest normal number times e^-600: the log-space branch
        probs[-size // 5 :] *= 1e-300
    return losses, probs / probs.sum()


@pytest.mark.parametrize("tiny", [False, True])
def test_the_epsilon_query_is_the_smallest_epsilon_meeting_delta_and_its_re_check_is_straightforward(
        tiny: bool) -> None:
    """The query's defining property, checked by an exactly rounded delta: delta(eps) <= target at the answer, and
    > target a little below it (or the answer is 0, or infinity when the infinity mass alone exceeds the target)."""
    rng = np.random.default_rng(11)
    for trial in range(200):
        size = int(rng.integers(2, 3000))
        interval = float(rng.choice([1e-3, 2.0**-9, 0.05, 1.0 if tiny else 0.3]))
        losses, probs = _random_pmf(rng, size, interval, tiny)
        inf_mass = float(rng.choice([0.0, 1e-15, 1e-9]))
        for delta in (1e-10, 1e-6, 1e-3):
            got = P._eps_one(losses, probs, inf_mass, delta)  # pylint: disable=protected-access
            if math.isinf(got):
                assert inf_mass > delta, (trial, delta)
                continue
            slack = delta * DELTA_RTOL + size * DELTA_ATOL_PER_POINT
            assert _delta_straight(losses, probs, inf_mass, got) <= delta + slack, (trial, delta)
            if got > 0.0:
                below = got - BELOW_STEP * max(1.0, got)
                assert _delta_straight(losses, probs, inf_mass, below) > delta - slack, (trial, delta)
            for eps in (0.0, got, got + 0.1 * interval):
                start = int(np.searchsorted(losses, eps, side="right"))
                straight = inf_mass + float(np.dot(-np.expm1(eps - losses[start:]), probs[start:].copy()))
                assert P._delta_one(losses, probs, inf_mass, eps) == straight  # pylint: disable=protected-access


def _log_mgf_exact(lower: int, probs: np.ndarray, s: float) -> mpmath.mpf:
    """``log sum_i p_i e^{s i}`` in 40-digit arithmetic."""
    with mpmath.workdps(40):
        return mpmath.log(mpmath.fsum(mpmath.mpf(float(p)) * mpmath.exp(mpmath.mpf(s) * (lower + i))
                                      for i, p in enumerate(probs) if p > 0.0))


@pytest.mark.parametrize("n", [50_000, 199_000])
def test_the_log_mgfs_are_rounded_up_and_within_the_margin_of_the_exact_values(n: int) -> None:
    """Summed directly where ``e^{+-s (i - c)}`` cannot overflow (small s), as a log-sum-exp otherwise (large s):
    both above the exact value and within the stated margin of it."""
    dense = clone_blocks.round_pld(1.0, n, "stronger", H)
    shifted = (dense[0] - 3_000, dense[1], dense[2])  # off-centre support: the centring is exact
    for lower, probs, inf in (dense, shifted):
        item = spectral.Item(None, (lower, probs, inf))
        for k in (-12, -7, -3, 0, 4, 8):
            s = 2.0**k
            up, dn = item.lam(k)
            for rounded, sign in ((up, 1.0), (dn, -1.0)):
                exact = _log_mgf_exact(lower, probs, sign * s)
                slack = mpmath.mpf(rounded) / 2**40 - exact
                assert 0 <= slack <= 2e-12 * (1 + abs(exact)) + 2.0**-39, (k, sign, float(slack))


def test_block_starts_read_from_the_array_are_the_scalar_table() -> None:
    j_max = int(clone_blocks.block_of(np.array([10**9]))[0])  # the block of N_MAX clones
    j = np.array([0, 1, 499, 500, 501, 2_000, j_max - 1, j_max, j_max + 50], dtype=np.int64)
    table = clone_blocks._start_table(int(j.max()) + 1)  # pylint: disable=protected-access
    assert clone_blocks.block_start(j).tolist() == [table[v] for v in j.tolist()]
    assert clone_blocks.block_start(j[:8].reshape(2, 4)).shape == (2, 4)
    assert clone_blocks.block_start(np.zeros(0, dtype=np.int64)).size == 0


@pytest.mark.parametrize("n", [1_000, 77_777, 190_001])
def test_one_round_is_the_mass_weighted_sum_of_its_block_rows(n: int) -> None:
    lower, probs, inf = clone_blocks.round_pld(1.0, n, "stronger", H)
    j_lo, masses, below = clone_blocks._block_masses(n, 1.0, "stronger")  # pylint: disable=protected-access
    tables = clone_blocks._tables(1.0, "stronger", H, j_lo, j_lo + masses.size - 1)  # pylint: disable=protected-access
    size = max(s for _, s, _, _ in tables)
    total = np.zeros(2 * size + 1)
    infinity = below
    for first, s, matrix, row_inf in tables:
        weights = np.zeros(row_inf.size)
        for j in range(max(j_lo, first), min(j_lo + masses.size, first + row_inf.size)):
            weights[j - first] = masses[j - j_lo]
        total[size - s : size + s + 1] += weights @ matrix
        infinity += float(weights @ row_inf)
    got = np.zeros(2 * size + 1)
    got[lower + size : lower + size + probs.size] = probs
    assert np.max(np.abs(got - total)) <= 1e-16
    assert math.isclose(inf, min(1.0, infinity), rel_tol=1e-12, abs_tol=1e-300)
