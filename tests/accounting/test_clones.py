"""Behaviour of shuffledp.accounting.clones and shuffledp.accounting.pld.

The brute-force checks build the clone pairs straight from the papers' definitions (enumerating C, A and
the Bernoulli bit, for the stronger pair of Wang, Su, Ye, Shokri, Su (NeurIPS 2023, seed 003) App. C and the
FOCS pair of Chen, Cao, Ge (ICASSP 2024, seed 000) Prop. 1) and compare every quantity with the fast formulas
of shuffledp.accounting.clones.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest
from dp_accounting.pld import pld_pmf
from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution
from scipy import special, stats

from shuffledp.accounting import binomial, clone_pair, clone_pld, clone_renyi, clones, pld

#: Agreement between two exact computations of the same quantity in float64.
EXACT_RTOL = 1e-9
#: How close the pessimistic single-round PLD epsilon must be to the exact one (default grid, T = 1).
PLD_T1_RTOL = 1e-3
#: Mass normalisation tolerance at n = 1e6 (reference file: gammaln masses are off by up to 1e-9).
MASS_TOL = 1e-9


# ---------------------------------------------------------------------------------------------------
# brute force from the definitions


def brute_pair(eps0: float, n: int, variant: str) -> tuple[dict, dict]:
    """P and Q over outcomes (first count, second count), enumerated from the paper definitions."""
    e0 = math.exp(eps0)
    if variant == "stronger":
        q = 2.0 / (e0 + 1.0)
    else:
        q = 1.0 / e0
    P: dict = defaultdict(float)
    Q: dict = defaultdict(float)
    for c in range(n):
        pc = stats.binom.pmf(c, n - 1, q)
        for a in range(c + 1):
            pa = pc * stats.binom.pmf(a, c, 0.5)
            if variant == "stronger":
                # seed 003: P = (1-w) P0 + w Q0, Q = (1-w) Q0 + w P0, P0 = (A+1, C-A), Q0 = (A, C-A+1)
                w = 1.0 / (e0 + 1.0)
                P[(a + 1, c - a)] += pa * (1 - w)
                P[(a, c - a + 1)] += pa * w
                Q[(a, c - a + 1)] += pa * (1 - w)
                Q[(a + 1, c - a)] += pa * w
            else:
                # FMT FOCS'21 / seed 000 Prop. 1: Delta ~ Bern(e^eps0/(e^eps0+1)),
                # P = (A + Delta, C - A + 1 - Delta), Q = (A + 1 - Delta, C - A + Delta)
                p = e0 / (e0 + 1.0)
                for dlt, pd in ((1, p), (0, 1 - p)):
                    P[(a + dlt, c - a + 1 - dlt)] += pa * pd
                    Q[(a + 1 - dlt, c - a + dlt)] += pa * pd
    return dict(P), dict(Q)


def brute_delta(P: dict, Q: dict, eps: float) -> float:
    e = math.exp(eps)
    return math.fsum(max(P[o] - e * Q.get(o, 0.0), 0.0) for o in P)


def brute_renyi(P: dict, Q: dict, a: float) -> float:
    logs = np.array([a * math.log(P[o]) + (1 - a) * math.log(Q[o]) for o in P if P[o] > 0])
    return float(special.logsumexp(logs)) / (a - 1)


@pytest.fixture(scope="module", params=[("stronger", 0.5), ("stronger", 2.0), ("focs", 1.0)])
def small_pair(request):
    variant, eps0 = request.param
    n = 25
    P, Q = brute_pair(eps0, n, variant)
    return variant, eps0, n, P, Q


def test_brute_force_pair_is_a_distribution(small_pair):
    _, _, _, P, Q = small_pair
    assert math.fsum(P.values()) == pytest.approx(1.0, abs=1e-12)
    assert math.fsum(Q.values()) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("eps", [0.0, 0.05, 0.2, 0.45])
def test_delta_matches_brute_force_both_directions(small_pair, eps):
    variant, eps0, n, P, Q = small_pair
    fwd = brute_delta(P, Q, eps)
    rev = brute_delta(Q, P, eps)
    assert fwd == pytest.approx(rev, rel=EXACT_RTOL, abs=1e-300)  # the pair is symmetric
    assert clones.clone_delta(eps0, n, eps, variant) == pytest.approx(fwd, rel=EXACT_RTOL)


@pytest.mark.parametrize("order", [1.5, 2.0, 8.0, 40.0])
def test_renyi_matches_brute_force_both_directions(small_pair, order):
    variant, eps0, n, P, Q = small_pair
    fwd = brute_renyi(P, Q, order)
    rev = brute_renyi(Q, P, order)
    got = clones.clone_renyi(eps0, n, order, variant)
    assert got == pytest.approx(max(fwd, rev), rel=1e-8)
    assert fwd == pytest.approx(rev, rel=1e-8)


@pytest.mark.parametrize(("variant", "eps0", "order"), [("stronger", 10.0, 100.0), ("focs", 8.0, 90.0)])
def test_renyi_log_space_path_matches_brute_force(variant, eps0, order):
    # order * eps0 >= 600: r^order overflows float64, the log-space path must take over
    n = 25
    P, Q = brute_pair(eps0, n, variant)
    expected = max(brute_renyi(P, Q, order), brute_renyi(Q, P, order))
    assert clones.clone_renyi(eps0, n, order, variant) == pytest.approx(expected, rel=1e-9)


def test_renyi_reverse_direction_equals_forward_at_larger_n():
    # clone_renyi computes one direction and relies on the symmetry x -> m - x; check it directly
    for variant in clones.VARIANTS:
        fwd = clone_renyi._renyi_one(1.0, 2000, 3.0, variant, reverse=False)
        rev = clone_renyi._renyi_one(1.0, 2000, 3.0, variant, reverse=True)
        assert fwd == pytest.approx(rev, rel=1e-10)


def test_epsilon_matches_brute_force_inversion(small_pair):
    variant, eps0, n, P, Q = small_pair
    target = 1e-3
    eps = clones.clone_epsilon(eps0, n, target, variant)
    assert 0.0 < eps < eps0
    assert brute_delta(P, Q, eps) <= target * (1 + 1e-9)
    assert brute_delta(P, Q, eps * (1 - 1e-6)) > target


def test_pld_from_brute_force_losses_matches_clone_pld(small_pair):
    variant, eps0, n, P, Q = small_pair
    outcomes = list(P)
    losses = np.array([math.log(P[o] / Q[o]) for o in outcomes])
    probs = np.array([P[o] for o in outcomes])
    h = 1e-4
    ref = pld.pld_from_losses(
        losses, probs, infinity_mass=0.0, pessimistic=True, value_discretization_interval=h
    )
    ours = clones.clone_pld(eps0, n, variant, value_discretization_interval=h)
    for d in (1e-2, 1e-3, 1e-5):
        assert pld.epsilon_for_delta(ours, d) == pytest.approx(pld.epsilon_for_delta(ref, d), abs=h)


# ---------------------------------------------------------------------------------------------------
# closed form at n = 1 (no clones: binary randomized response with eps0)


@pytest.mark.parametrize("eps0", [1.3, 8.0, 20.0])
@pytest.mark.parametrize("d", [1e-2, 1e-8])
def test_single_user_is_randomized_response(eps0, d):
    # near eps0 the float threshold between outcomes is 1 - 1e-17: the code must not lose the outcome
    w = 1.0 / (math.exp(eps0) + 1.0)
    expected = math.log(1 - w - d) - math.log(w)
    assert clones.clone_epsilon(eps0, 1, d) == pytest.approx(expected, rel=1e-10)
    assert clones.clone_delta(eps0, 1, expected) == pytest.approx(d, rel=1e-6)
    # two users: the second one is a clone with probability 2w only, the value barely moves
    assert clones.clone_epsilon(eps0, 2, d) <= expected * (1 + 1e-12)


def test_single_user_delta_and_renyi_closed_forms():
    eps0 = 1.3
    w = 1.0 / (math.exp(eps0) + 1.0)
    assert clones.clone_delta(eps0, 1, 0.4) == pytest.approx((1 - w) - math.exp(0.4) * w, rel=1e-12)
    a = 3.0
    renyi = math.log((1 - w) ** a * w ** (1 - a) + w**a * (1 - w) ** (1 - a)) / (a - 1)
    assert clones.clone_renyi(eps0, 1, a) == pytest.approx(renyi, rel=1e-10)


def test_delta_vanishes_at_eps0_and_is_one_minus_tv_bounded():
    assert clones.clone_delta(1.0, 1000, 1.0) == 0.0
    assert clones.clone_delta(1.0, 1000, 5.0) == 0.0
    assert clones.clone_epsilon(1.0, 1000, 0.9) == 0.0  # delta(0) = TV distance < 0.9


# ---------------------------------------------------------------------------------------------------
# stability and monotonicity


def test_stable_at_one_million_users():
    n, eps0 = 1_000_000, 1.0
    c, pmf, lo, hi = clone_pair._c_distribution(n, eps0, "stronger", clones.EXACT_WINDOW_DROP)
    assert np.all(np.isfinite(pmf)) and np.all(pmf >= 0)
    assert math.fsum(pmf) + lo + hi == pytest.approx(1.0, abs=1e-14)
    eps_grid = [0.0, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1]
    deltas = [clones.clone_delta(eps0, n, e) for e in eps_grid]
    assert all(math.isfinite(x) and 0.0 <= x <= 1.0 for x in deltas)
    assert all(a > b for a, b in zip(deltas, deltas[1:]) if b > 0)
    assert deltas[-1] >= 0.0
    losses, probs, inf = clone_pld._loss_support(eps0, n, "stronger", True)
    assert np.all(np.isfinite(losses)) and np.all(probs >= 0)
    assert math.fsum(probs) + inf == pytest.approx(1.0, abs=MASS_TOL)
    p1 = clones.clone_pld(eps0, n)
    for ls, ps, inf_mass in pld.dense_parts(p1):
        assert np.all(ps >= 0) and math.fsum(ps) + inf_mass == pytest.approx(1.0, abs=MASS_TOL)
        assert 0.0 <= inf_mass < 1e-15


def test_binomial_log_masses_match_scipy_reference():
    # Loader's saddle-point form (used for C and X masses) against scipy's boost implementation
    for trials, p in [(999_999, 0.5378828427399902), (10_000, 0.01), (37, 0.5)]:
        mode = int(trials * p)
        k = np.arange(max(0, mode - 2000), min(trials, mode + 2000) + 1)
        ours = np.exp(binomial.binom_logpmf(k, trials, math.log(p), math.log1p(-p)))
        ref = stats.binom.pmf(k, trials, p)
        keep = ref > 1e-250
        assert np.max(np.abs(ours[keep] / ref[keep] - 1)) < 1e-11


def test_epsilon_non_increasing_in_n_and_non_decreasing_in_eps0():
    ns = [10, 100, 1_000, 10_000, 100_000]
    for variant in clones.VARIANTS:
        vals = [clones.clone_epsilon(1.0, n, 1e-6, variant) for n in ns]
        assert all(a >= b for a, b in zip(vals, vals[1:])), vals
        assert vals[-1] < vals[0]
    eps0s = [0.1, 0.5, 1.0, 2.0, 4.0, 8.0]
    vals = [clones.clone_epsilon(e, 10_000, 1e-6) for e in eps0s]
    assert all(a <= b for a, b in zip(vals, vals[1:])), vals
    assert all(v <= e for v, e in zip(vals, eps0s))


def test_stronger_pair_is_tighter_than_focs_pair():
    for eps0 in (0.5, 2.0, 4.0):
        assert clones.clone_epsilon(eps0, 10_000, 1e-6, "stronger") <= clones.clone_epsilon(
            eps0, 10_000, 1e-6, "focs"
        )


def test_renyi_non_increasing_in_n_and_non_decreasing_in_order():
    by_n = [clones.clone_renyi(1.0, n, 4.0) for n in (100, 1_000, 10_000)]
    assert by_n[0] > by_n[1] > by_n[2] > 0
    by_order = [clones.clone_renyi(1.0, 1_000, a) for a in (1.5, 2.0, 4.0, 16.0, 128.0)]
    assert all(a < b for a, b in zip(by_order, by_order[1:]))
    assert by_order[-1] <= 1.0  # D_a never exceeds eps0 for an eps0-DP pair


# ---------------------------------------------------------------------------------------------------
# PLD: pessimism, brackets, composition


@pytest.mark.parametrize(
    ("n", "eps0", "delta"),
    [(1_000, 4.0, 1e-5), (10_000, 2.0, 1e-6), (100_000, 1.0, 1e-8), (50, 0.5, 1e-3)],
)
def test_single_round_pld_brackets_exact(n, eps0, delta):
    exact = clones.clone_epsilon(eps0, n, delta)
    pess = pld.epsilon_for_delta(clones.clone_pld(eps0, n), delta)
    opt = pld.epsilon_for_delta(clones.clone_pld(eps0, n, pessimistic=False), delta)
    assert opt <= exact <= pess
    assert pess == pytest.approx(exact, rel=PLD_T1_RTOL)


def test_pld_delta_brackets_exact_delta():
    eps = 0.1
    exact = clones.clone_delta(2.0, 10_000, eps)
    pess = pld.delta_for_epsilon(clones.clone_pld(2.0, 10_000), eps)
    opt = pld.delta_for_epsilon(clones.clone_pld(2.0, 10_000, pessimistic=False), eps)
    assert opt <= exact <= pess


def test_composed_epsilon_grows_with_rounds_and_stays_below_rounds_times_eps0():
    vals = [clones.clone_epsilon_composed(2.0, 1_000, 1e-6, t) for t in (1, 10, 100)]
    assert vals[0] < vals[1] < vals[2]
    assert vals[2] <= 100 * 2.0
    # composing the PLD beats composing per-round (eps, delta) pairs naively
    assert vals[1] < 10 * clones.clone_epsilon(2.0, 1_000, 1e-7)


@pytest.mark.parametrize(("n", "eps0"), [(100, 10.0), (2, 20.0), (10_000, 20.0)])
def test_composed_epsilon_with_huge_losses_does_not_underflow(n, eps0):
    # composed losses reach T * eps0 = 1000..2000, where e^{-loss} underflows in float64
    rounds, delta = 100, 1e-8
    got = clones.clone_epsilon_composed(eps0, n, delta, rounds)
    h = clones.suggested_interval(eps0, n, rounds)
    one = clones.clone_pld(eps0, n, value_discretization_interval=h)
    assert got == pytest.approx(one.self_compose(rounds).get_epsilon_for_delta(delta), rel=1e-6)
    assert 0.8 * rounds * eps0 < got <= rounds * (eps0 + h)


def test_clone_pld_is_cached():
    a = clones.clone_pld(1.0, 5_000, value_discretization_interval=1e-4)
    b = clones.clone_pld(1.0, 5_000, value_discretization_interval=1e-4)
    assert a is b


def test_suggested_interval_bounds_the_discretisation_error_and_the_grid():
    m1, s1 = clones.clone_loss_moments(1.0, 10_000)
    for rounds in (1, 10, 100, 1000):
        h = clones.suggested_interval(1.0, 10_000, rounds)
        # rounding up moves the composed loss by < rounds * h: at most INTERVAL_RELATIVE_ERROR of the
        # smallest composed epsilon of interest (T m1 + 2 sqrt(T) s1); 1.001 allows the 3-digit rounding
        floor = rounds * m1 + 2 * math.sqrt(rounds) * s1
        width = rounds * m1 + 18 * math.sqrt(rounds) * s1
        capped = width / h >= clones.MAX_COMPOSED_GRID * 0.999  # memory cap reached: coarser grid
        assert capped or rounds * h <= clones.INTERVAL_RELATIVE_ERROR * floor * 1.001
        assert clones.MIN_COMPOSED_GRID * 0.999 <= width / h <= clones.MAX_COMPOSED_GRID * 1.01


def _direct_power(p: np.ndarray, times: int) -> np.ndarray:
    """times-fold convolution by repeated squaring with np.convolve (direct sums of positive terms)."""
    res, base, e = None, p.copy(), times
    while e:
        if e & 1:
            res = base.copy() if res is None else np.convolve(res, base)
        e >>= 1
        if e:
            base = np.convolve(base, base)
    return res


def test_own_self_composition_matches_direct_convolution_and_dp_accounting():
    h = 1e-2
    one = clones.clone_pld(2.0, 1_000, value_discretization_interval=h)
    (losses, probs, inf), = pld.dense_parts(one)
    lower = int(round(losses[0] / h))
    direct = PrivacyLossDistribution(
        pld_pmf.DensePLDPmf(h, 50 * lower, _direct_power(probs, 50), 1 - (1 - inf) ** 50, True)
    )
    ours = pld.compose([(one, 50)])
    theirs = one.self_compose(50)
    for d in (1e-3, 1e-6, 1e-9):
        exact = pld.epsilon_for_delta(direct, d)
        got = pld.epsilon_for_delta(ours, d)
        # the FFT route carries the truncated tail (1e-15) as infinity mass: never below the direct sum
        assert exact <= got <= exact * (1 + 1e-6)
        assert got == pytest.approx(theirs.get_epsilon_for_delta(d), rel=1e-6)


def test_heterogeneous_composition_matches_repeated_composition():
    h = 1e-3
    a = clones.clone_pld(2.0, 1_000, value_discretization_interval=h)
    b = clones.clone_pld(1.0, 5_000, value_discretization_interval=h)
    ours = pld.compose([(a, 3), (b, 2)])
    theirs = a.compose(a).compose(a).compose(b).compose(b)
    for d in (1e-4, 1e-7):
        assert pld.epsilon_for_delta(ours, d) == pytest.approx(theirs.get_epsilon_for_delta(d), rel=1e-7)


def test_compose_rejects_mismatched_plds():
    a = clones.clone_pld(2.0, 1_000, value_discretization_interval=1e-3)
    b = clones.clone_pld(2.0, 1_000, value_discretization_interval=2e-3)
    c = clones.clone_pld(2.0, 1_000, value_discretization_interval=1e-3, pessimistic=False)
    with pytest.raises(ValueError, match="interval"):
        pld.compose([(a, 1), (b, 1)])
    with pytest.raises(ValueError, match="pessimistic"):
        pld.compose([(a, 1), (c, 1)])
    with pytest.raises(ValueError, match="count"):
        pld.compose([(a, 0)])
    with pytest.raises(ValueError, match="empty"):
        pld.compose([])


# ---------------------------------------------------------------------------------------------------
# pld.py helpers


def test_pld_from_losses_rounds_in_the_right_direction():
    losses = np.array([-0.25, 0.1, 0.37])
    probs = np.array([0.2, 0.5, 0.3])
    h = 0.1
    pess = pld.pld_from_losses(losses, probs, infinity_mass=0.0, pessimistic=True,
                               value_discretization_interval=h)
    opt = pld.pld_from_losses(losses, probs, infinity_mass=0.0, pessimistic=False,
                              value_discretization_interval=h)
    (lp, pp, _), = pld.dense_parts(pess)
    (lo, po, _), = pld.dense_parts(opt)
    assert np.allclose(lp[pp > 0], [-0.2, 0.1, 0.4])
    assert np.allclose(lo[po > 0], [-0.3, 0.1, 0.3])
    for eps in (0.0, 0.05, 0.2):
        exact = float(np.dot(probs, np.maximum(0, 1 - np.exp(eps - losses))))
        assert pld.delta_for_epsilon(opt, eps) <= exact + 1e-15 <= pld.delta_for_epsilon(pess, eps) + 2e-15


def test_pld_from_losses_moves_infinite_losses_to_infinity_mass():
    p = pld.pld_from_losses(np.array([0.0, np.inf]), np.array([0.7, 0.3]), infinity_mass=0.0,
                            pessimistic=True, value_discretization_interval=0.01)
    assert pld.dense_parts(p)[0][2] == pytest.approx(0.3)
    assert pld.epsilon_for_delta(p, 0.2) == math.inf


def test_pld_from_losses_tail_truncation_keeps_direction():
    losses = np.array([-1.0, 0.0, 0.5, 3.0])
    probs = np.array([1e-12, 0.5, 0.5 - 2e-12, 1e-12])
    pess = pld.pld_from_losses(losses, probs, infinity_mass=0.0, pessimistic=True,
                               value_discretization_interval=0.5, tail_mass_truncation=1e-11)
    opt = pld.pld_from_losses(losses, probs, infinity_mass=0.0, pessimistic=False,
                              value_discretization_interval=0.5, tail_mass_truncation=1e-11)
    (lp, pp, ip), = pld.dense_parts(pess)
    (lo, po, io), = pld.dense_parts(opt)
    assert ip == pytest.approx(1e-12) and lp[0] == 0.0 and lp[-1] == 0.5
    assert io == 0.0 and lo[-1] == 0.5 and po[-1] == pytest.approx(0.5 - 1e-12)
    exact = float(np.dot(probs, np.maximum(0, 1 - np.exp(0.25 - losses))))
    assert pld.delta_for_epsilon(opt, 0.25) <= exact <= pld.delta_for_epsilon(pess, 0.25)


def test_non_symmetric_pld_takes_the_worse_direction():
    p = pld.pld_from_losses(np.array([0.0, 1.0]), np.array([0.5, 0.5]), infinity_mass=0.0,
                            pessimistic=True, value_discretization_interval=0.01,
                            losses_reverse=np.array([0.0, 2.0]), probs_reverse=np.array([0.6, 0.4]),
                            infinity_mass_reverse=0.0)
    fwd = 0.5 * (1 - math.exp(0.5 - 1.0))
    rev = 0.4 * (1 - math.exp(0.5 - 2.0))
    assert pld.delta_for_epsilon(p, 0.5) == pytest.approx(max(fwd, rev), rel=1e-12)
    assert pld.epsilon_for_delta(p, 0.1) == pytest.approx(p.get_epsilon_for_delta(0.1), rel=1e-12)


def test_epsilon_and_delta_queries_match_dp_accounting():
    one = clones.clone_pld(2.0, 2_000, value_discretization_interval=5e-4)
    composed = pld.compose([(one, 20)])
    for d in (1e-2, 1e-5, 1e-8):
        assert pld.epsilon_for_delta(composed, d) == pytest.approx(
            composed.get_epsilon_for_delta(d), rel=1e-9
        )
    for e in (0.0, 0.3, 1.0):
        assert pld.delta_for_epsilon(composed, e) == pytest.approx(
            composed.get_delta_for_epsilon(e), rel=1e-9, abs=1e-18
        )


def test_queries_accept_sparse_plds_from_dp_accounting():
    sparse = PrivacyLossDistribution(pld_pmf.SparsePLDPmf({-1: 0.3, 2: 0.7}, 0.5, 0.0, True))
    assert pld.delta_for_epsilon(sparse, 0.5) == pytest.approx(0.7 * (1 - math.exp(0.5 - 1.0)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"losses": np.zeros(2), "probs": np.ones(3) / 3}, "same length"),
        ({"losses": np.zeros(2), "probs": np.array([0.5, -0.1])}, ">= 0"),
        ({"losses": np.zeros(2), "probs": np.array([0.7, 0.7])}, "> 1"),
        ({"losses": np.array([np.nan, 0.0]), "probs": np.array([0.5, 0.5])}, "NaN"),
        ({"losses": np.array([-np.inf, 0.0]), "probs": np.array([0.5, 0.5])}, "-inf"),
        ({"value_discretization_interval": 0.0}, "value_discretization_interval"),
        ({"value_discretization_interval": float("nan")}, "value_discretization_interval"),
        ({"infinity_mass": 1.5}, "infinity_mass"),
        ({"losses_reverse": np.zeros(2)}, "both"),
        ({"value_discretization_interval": 1e-12, "losses": np.array([0.0, 1.0])}, "grid points"),
    ],
)
def test_pld_from_losses_rejects_bad_input(kwargs, match):
    args = {
        "losses": np.array([0.0, 0.1]),
        "probs": np.array([0.5, 0.5]),
        "infinity_mass": 0.0,
        "pessimistic": True,
        "value_discretization_interval": 0.01,
    }
    args.update(kwargs)
    losses, probs = args.pop("losses"), args.pop("probs")
    with pytest.raises(ValueError, match=match):
        pld.pld_from_losses(losses, probs, **args)


def test_pld_queries_reject_bad_input():
    one = clones.clone_pld(2.0, 1_000, value_discretization_interval=1e-3)
    for bad in (0.0, 1.0, -1e-6, float("nan")):
        with pytest.raises(ValueError, match="delta"):
            pld.epsilon_for_delta(one, bad)
    with pytest.raises(ValueError, match="epsilon"):
        pld.delta_for_epsilon(one, -0.1)
    with pytest.raises(TypeError, match="PrivacyLossDistribution"):
        pld.epsilon_for_delta("not a pld", 1e-6)


# ---------------------------------------------------------------------------------------------------
# validation of the clone API


@pytest.mark.parametrize("eps0", [0.0, -1.0, float("nan"), float("inf"), 1e3])
def test_rejects_bad_eps0(eps0):
    with pytest.raises(ValueError, match="eps0"):
        clones.clone_epsilon(eps0, 100, 1e-6)


@pytest.mark.parametrize("eps0", [True, "1.0", None])
def test_rejects_non_numeric_eps0(eps0):
    with pytest.raises(TypeError, match="eps0"):
        clones.clone_delta(eps0, 100, 0.1)


@pytest.mark.parametrize(("n", "exc"), [(0, ValueError), (-5, ValueError), (1.5, TypeError),
                                        (True, TypeError), (10**10, ValueError)])
def test_rejects_bad_n(n, exc):
    with pytest.raises(exc, match="n must"):
        clones.clone_epsilon(1.0, n, 1e-6)


def test_rejects_bad_variant_delta_epsilon_order_rounds():
    with pytest.raises(ValueError, match="variant"):
        clones.clone_epsilon(1.0, 100, 1e-6, "soda")
    for d in (0.0, 1.0, 2.0):
        with pytest.raises(ValueError, match="delta"):
            clones.clone_epsilon(1.0, 100, d)
    with pytest.raises(ValueError, match="epsilon"):
        clones.clone_delta(1.0, 100, -0.5)
    for a in (1.0, 0.5, float("inf")):
        with pytest.raises(ValueError, match="order"):
            clones.clone_renyi(1.0, 100, a)
    with pytest.raises(ValueError, match="rounds"):
        clones.clone_epsilon_composed(1.0, 100, 1e-6, 0)
    with pytest.raises(TypeError, match="pessimistic"):
        clones.clone_pld(1.0, 100, pessimistic=1)
    with pytest.raises(ValueError, match="value_discretization_interval"):
        clones.clone_pld(1.0, 100, value_discretization_interval=-1.0)


def test_numpy_integers_are_accepted():
    assert clones.clone_epsilon(np.float64(1.0), np.int64(1000), 1e-6) == clones.clone_epsilon(
        1.0, 1000, 1e-6
    )


def test_accounting_modules_do_not_import_torch_flwr_or_grpc():
    code = (
        "import sys, shuffledp.accounting.clones, shuffledp.accounting.pld\n"
        "bad = [m for m in ('torch', 'flwr', 'grpc') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


@pytest.mark.parametrize("eps0", [1e-8, 1e-7, 1e-6])
def test_small_eps0_upper_bound_is_not_below_the_exact_value(eps0: float) -> None:
    # 1.0 - 2.0 * w cancels at small eps0 (relative error ~1e-16/eps0) and would scale every loss, so at n = 1 (no
    # clones: the mechanism itself, whose epsilon at tiny delta is eps0 up to ~1e-30 relative) the "upper bound"
    # would come out 6e-9 relative below eps0. tanh(eps0/2) has no cancellation.
    from shuffledp.accounting import bounds

    for rounds in (1, 3):
        value = bounds.epsilon("clones", eps0, 1, 1e-30, rounds).value
        assert value >= rounds * eps0 * (1.0 - 1e-15), (rounds, value)


def test_binomial_tails_are_accurate_at_large_c() -> None:
    # Cephes' bdtrc/bdtr lose ~1e-8 relative at c = 1e7 (1e-6 at 7.5e8), which would move the single-round
    # clones epsilon below the exact value at n = 1e8. Reference: a direct mpmath sum of the tail's terms.
    import mpmath as mp

    #: relative agreement of the float tails with the 30-digit sum (Boost's incomplete beta reaches ~1e-12)
    tail_rtol = 1e-10
    c = 10**7
    sd = math.sqrt(c) / 2.0
    with mp.workdps(30):
        for z in (1.0, 3.0):
            k = int(c / 2 + z * sd)
            term = mp.e ** (mp.loggamma(c + 1) - mp.loggamma(k + 1) - mp.loggamma(c - k + 1) - c * mp.log(2))
            exact, x = mp.mpf(0), k
            while x <= k + 14 * sd + 50:
                exact += term
                term = term * (c - x) / (x + 1)
                x += 1
            ge = binomial.tail_ge(np.array([float(k)]), np.array([c]))[0]
            le = binomial.tail_le(np.array([float(c - k)]), np.array([c]))[0]  # P(X <= c-k) = P(X >= k) by symmetry
            assert abs(ge - exact) <= tail_rtol * exact, (z, ge, exact)
            assert abs(le - exact) <= tail_rtol * exact, (z, le, exact)
