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


def _eps_one_reference(losses: np.ndarray, probs: np.ndarray, inf_mass: float, delta: float) -> float:
    """The closed-form query written out step by step (Koskela, Jalko, Honkela, AISTATS 2020)."""
    if inf_mass > delta:
        return math.inf
    start = int(np.searchsorted(losses, 0.0, side="right"))
    lk, pk = losses[start:], np.maximum(probs[start:], 0.0)
    if lk.size == 0:
        return 0.0
    u = inf_mass + np.cumsum(pk[::-1])[::-1]
    l_min, l_max = float(lk[0]), float(lk[-1])
    terms = pk * np.exp(l_min - lk) if l_max - l_min < 600.0 else None
    if terms is not None and not np.any((terms == 0.0) & (pk > 0.0)):
        w = np.cumsum(terms[::-1])[::-1]
        kept = min(int(np.count_nonzero(u > delta)), int(np.count_nonzero(w > 0.0)))
        log_w = np.log(w[:kept]) - l_min
    else:
        with np.errstate(divide="ignore"):
            log_w = np.logaddexp.accumulate((np.log(pk) - lk)[::-1])[::-1]
        kept = min(int(np.count_nonzero(u > delta)), int(np.count_nonzero(np.isfinite(log_w))))
        log_w = log_w[:kept]
    if kept == 0:
        return 0.0
    return max(0.0, float((np.log(u[:kept] - delta) - log_w).max()))


def _random_pmf(rng: np.random.Generator, size: int, interval: float, tiny: bool) -> tuple[np.ndarray, np.ndarray]:
    lower = int(rng.integers(-size, size // 4))
    losses = (np.arange(size) + lower) * interval
    probs = np.exp(-0.5 * ((np.arange(size) - 0.45 * size) / (0.1 * size)) ** 2) * rng.random(size)
    probs[rng.random(size) < 0.1] = 0.0
    if tiny:  # masses far below the smallest normal number times e^-600: the log-space branch
        probs[-size // 5 :] *= 1e-300
    return losses, probs / probs.sum()


@pytest.mark.parametrize("tiny", [False, True])
def test_the_epsilon_query_and_its_re_check_are_their_straightforward_forms_bit_for_bit(tiny: bool) -> None:
    rng = np.random.default_rng(11)
    for trial in range(200):
        size = int(rng.integers(2, 3000))
        interval = float(rng.choice([1e-3, 2.0**-9, 0.05, 1.0 if tiny else 0.3]))
        losses, probs = _random_pmf(rng, size, interval, tiny)
        inf_mass = float(rng.choice([0.0, 1e-15, 1e-9]))
        for delta in (1e-10, 1e-6, 1e-3):
            got = P._eps_one(losses, probs, inf_mass, delta)  # pylint: disable=protected-access
            assert got == _eps_one_reference(losses, probs, inf_mass, delta), (trial, delta)
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
