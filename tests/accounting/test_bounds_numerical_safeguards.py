"""Numerical safeguards of shuffledp.accounting.bounds: rr-lower by enumeration, PLD re-check, bucketing, extremes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats

from shuffledp.accounting import bounds, clone_pld, composition, families, heterogeneous
from shuffledp.accounting import literature as lit
from shuffledp.accounting.events import ShuffleRound

# ------------------------------------------------------------- rr-lower composition against enumeration


def _rr_pair(eps0: float, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(P1, P0) of the count of ones: P0 = Bin(n, q), P1 = Bin(n-1, q) * Bern(1-q), by convolution."""
    q = 1.0 / (math.exp(eps0) + 1.0)
    base = stats.binom.pmf(np.arange(n), n - 1, q)
    return np.convolve(base, [q, 1 - q]), np.convolve(base, [1 - q, q])


def _exact_composed_epsilon(pairs: list[tuple[np.ndarray, np.ndarray]], delta: float) -> float:
    """eps(delta) of the product of the pairs (both directions), by explicit outer products."""
    p, q = np.ones(1), np.ones(1)
    for a, b in pairs:
        p, q = np.outer(p, a).ravel(), np.outer(q, b).ravel()

    def hockey(eps: float) -> float:
        return max(np.maximum(p - math.exp(eps) * q, 0).sum(), np.maximum(q - math.exp(eps) * p, 0).sum())

    return optimize.brentq(lambda e: hockey(e) - delta, 0.0, 50.0, xtol=1e-13)


def test_rr_lower_composition_is_a_lower_bound_close_to_the_exact_product() -> None:
    eps0, n, rounds, delta = 1.0, 30, 3, 1e-4
    exact = _exact_composed_epsilon([_rr_pair(eps0, n)] * rounds, delta)
    got = bounds.epsilon("rr-lower", eps0, n, delta, rounds).value
    assert got <= exact
    assert got >= exact * (1 - 1e-2)


def test_heterogeneous_rr_lower_against_exact_product() -> None:
    rounds = [ShuffleRound(30, 1.0), ShuffleRound(30, 1.0), ShuffleRound(12, 2.0)]
    exact = _exact_composed_epsilon([_rr_pair(1.0, 30), _rr_pair(1.0, 30), _rr_pair(2.0, 12)], 1e-4)
    got = bounds.epsilon_for_rounds("rr-lower", rounds, 1e-4).value
    assert got <= exact
    assert got >= exact * (1 - 1e-2)


# ------------------------------------------------------------------ PLD re-check: exact, stepped up


def test_a_failing_pld_query_is_refused_not_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    # If the PLD epsilon query ever returns a number whose delta exceeds the target (e.g. an underflow that
    # yields 0), bounds re-checks it and raises instead of quoting it as a guarantee.
    from shuffledp.accounting import pld

    good = bounds.epsilon("clones", 1.0, 10_000, 1e-6, rounds=5).value
    monkeypatch.setattr(pld, "epsilon_for_delta", lambda composed, delta: 0.0)
    with pytest.raises(ArithmeticError, match="numerical failure"):
        bounds.epsilon("clones", 1.0, 10_000, 1e-6, rounds=5)
    monkeypatch.setattr(pld, "epsilon_for_delta", lambda composed, delta: math.inf)
    with pytest.raises(ArithmeticError):
        bounds.epsilon("rr-lower", 1.0, 10_000, 1e-6, rounds=5)
    monkeypatch.undo()
    assert bounds.epsilon("clones", 1.0, 10_000, 1e-6, rounds=5).value == good


def test_pld_epsilon_at_huge_composed_losses_is_stepped_up_to_an_exact_certificate() -> None:
    # eps0 = 20, T = 1000: composed losses ~2e4; the closed-form query lands ~1e-6 relative below the crossing.
    from shuffledp.accounting import clones, pld

    eps0, n, delta, rounds = 20.0, 100, 1e-6, 1000
    interval = clones.suggested_interval(eps0, n, rounds, "stronger")
    one = clones.clone_pld(eps0, n, "stronger", value_discretization_interval=interval, pessimistic=True)
    composed = pld.compose([(one, rounds)])
    eps = composition.pld_epsilon(composed, delta)
    assert math.isfinite(eps)
    assert pld.delta_for_epsilon(composed, eps) <= delta  # exactly, no tolerance
    assert eps <= pld.epsilon_for_delta(composed, delta) * (1.0 + bounds.PLD_STEP_UP_RTOL)
    b = bounds.epsilon("clones", eps0, n, delta, rounds)  # raised ArithmeticError before
    assert b.kind == "upper" and b.value <= rounds * eps0


class _FakePLD:
    """A stand-in PLD module: epsilon_for_delta returns ``e0``; delta(eps) is ``above`` up to ``e_ok``."""

    def __init__(self, e0: float, e_ok: float, delta: float, above: float) -> None:
        self.e0, self.e_ok, self.delta, self.above = e0, e_ok, delta, above

    def epsilon_for_delta(self, composed: object, delta: float) -> float:
        return self.e0

    def delta_for_epsilon(self, composed: object, eps: float) -> float:
        return self.above if eps < self.e_ok else self.delta * (1.0 - 1e-12)


def test_pld_epsilon_never_accepts_a_delta_slightly_above_target(monkeypatch: pytest.MonkeyPatch) -> None:
    # delta(e0) = delta (1 + 5e-7): the old 1e-6 relative slack accepted e0 itself.
    delta, e0 = 1e-6, 3.0
    e_ok = e0 + 40 * math.ulp(e0)
    fake = _FakePLD(e0, e_ok, delta, delta * (1.0 + 5e-7))
    monkeypatch.setattr(composition, "_pld", lambda: fake)
    eps = composition.pld_epsilon(object(), delta)
    assert eps >= e_ok and fake.delta_for_epsilon(None, eps) <= delta
    assert eps <= e0 * (1.0 + bounds.PLD_STEP_UP_RTOL)


def test_pld_epsilon_raises_when_stepping_up_does_not_reach_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    delta, e0 = 1e-6, 3.0
    fake = _FakePLD(e0, e0 * 1.01, delta, delta * 1.5)  # needs 1% more: beyond PLD_STEP_UP_RTOL
    monkeypatch.setattr(composition, "_pld", lambda: fake)
    with pytest.raises(ArithmeticError, match="numerical failure"):
        composition.pld_epsilon(object(), delta)


def test_pld_epsilon_of_a_lower_bound_is_never_stepped_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # For an optimistic (lower-bound) PLD, delta(eps) > delta means eps is below the crossing: safe as it is.
    delta, e0 = 1e-6, 3.0
    fake = _FakePLD(e0, e0 + 40 * math.ulp(e0), delta, delta * (1.0 + 5e-7))
    monkeypatch.setattr(composition, "_pld", lambda: fake)
    assert composition.pld_epsilon(object(), delta, lower=True) == e0


# ------------------------------------------------------------- rr-lower at huge composed losses, many rounds, large n


def test_rr_lower_at_huge_composed_losses_stays_below_the_upper_families() -> None:
    lower = bounds.epsilon("rr-lower", 20.0, 100, 1e-6, 1000)  # a spurious ArithmeticError is what this guards against
    assert lower.kind == "lower"
    assert lower.value <= bounds.epsilon("clones", 20.0, 100, 1e-6, 1000).value
    assert lower.value <= lit.no_shuffle_epsilon(20.0, 1000, 1e-6)


def test_rr_lower_over_many_rounds_fits_the_grid_and_stays_below_the_upper_bound() -> None:
    # The interval mu / (200 sqrt(T)) had no floor: T = 20,000 asked for 67 million grid points and raised
    # ValueError, which the accountant does not turn into a refusal, so a long run with the default comparison
    # families (rr-lower, no-shuffle) stopped. The floor keeps the composed grid within MAX_COMPOSED_GRID.
    for rounds in (20_000, 100_000):
        lower = bounds.epsilon("rr-lower", 1.0, 10_000, 1e-6, rounds)
        assert lower.kind == "lower"
        assert 0.0 < lower.value <= bounds.epsilon("clones", 1.0, 10_000, 1e-6, rounds).value
    mixed = [ShuffleRound(10_000, 1.0)] * 10_000 + [ShuffleRound(100, 1.0)] * 10_000
    hetero = bounds.epsilon_for_rounds("rr-lower", mixed, 1e-6)
    assert hetero.kind == "lower" and hetero.value > 0.0


def test_rr_lower_at_large_n_composes() -> None:
    # scipy's log-gamma binomial masses are off by ~5e-6 relative at n = 1e9; the reverse-direction masses then
    # summed above 1 + 1e-9 and multi-round rr-lower raised from n ~ 1e7 at eps0 = 15 (compare exited 2)
    for eps0, n in ((15.0, 10**7), (20.0, 3 * 10**7), (1.0, 10**9)):
        lower = bounds.epsilon("rr-lower", eps0, n, 1e-6, 2)
        assert lower.kind == "lower" and 0.0 < lower.value <= bounds.epsilon("clones", eps0, n, 1e-6, 2).value
    rr = lit.rr_shuffle_loss(1.0, 10**9)
    assert float(np.sum(np.exp(rr.log_p0 + rr.loss))) <= 1.0 + 1e-12  # the reverse direction's total mass


# ------------------------------------------------------------------ bucketing heterogeneous rounds on the safe side


def test_many_groups_are_bucketed_on_the_safe_side() -> None:
    rounds = [ShuffleRound(2_000 + 37 * i, 1.0 + 0.001 * i) for i in range(6)]  # 6 groups > HETEROGENEOUS_EXACT_GROUPS
    items = [(r.n, r.eps0, 1) for r in rounds]
    for family, direction in (("clones", 1), ("rr-lower", -1)):
        b = bounds.epsilon_for_rounds(family, rounds, 1e-6)
        assert b.details["bucketed"]["groups_before"] == 6
        unbucketed, _ = families.lookup(family).heterogeneous_epsilon(items, 6, 1e-6, False)
        # upper: the bucketed rounds dominate (value >=); lower: they are dominated (value <=); both close
        assert direction * (b.value - unbucketed) >= -1e-3 * unbucketed
        assert b.value == pytest.approx(unbucketed, rel=1e-2)


def test_dominating_round_moves_in_the_safe_direction() -> None:
    for n, eps0 in [(1, 0.1), (10, 1.0), (12_345, 2.5), (10**6, 9.99)]:
        n_up, e_up = heterogeneous.dominating_round(n, eps0, lower=False)
        assert n_up <= n and e_up >= eps0 and n_up >= n / heterogeneous.HETEROGENEOUS_N_GRID_RATIO - 1
        n_lo, e_lo = heterogeneous.dominating_round(n, eps0, lower=True)
        assert n_lo >= n and e_lo <= eps0 and e_lo >= eps0 / heterogeneous.HETEROGENEOUS_EPS0_GRID_RATIO


# ------------------------------------------------------------------ bucketing near EPS0_MAX


def test_dominating_round_never_rounds_eps0_past_the_cap() -> None:
    from shuffledp.accounting import EPS0_MAX

    for eps0 in (EPS0_MAX, 99.9, 99.99):
        n2, e2 = heterogeneous.dominating_round(1000, eps0, lower=False)
        assert eps0 <= e2 <= EPS0_MAX and n2 <= 1000
    assert heterogeneous.dominating_round(1000, 50.0, lower=False)[1] > 50.0  # still bucketed below the cap


def test_heterogeneous_rounds_at_eps0_max_are_bucketed_without_leaving_the_range() -> None:
    rounds = [ShuffleRound(n, 100.0) for n in range(995, 1001)]  # 6 groups > HETEROGENEOUS_EXACT_GROUPS
    b = bounds.epsilon_for_rounds("clones", rounds, 1e-6)  # ValueError (eps0 100.3 > 100) before
    assert b.details["bucketed"]["groups_before"] == 6
    assert b.value <= 6 * 100.0


def test_clones_composed_at_large_eps0_has_finite_losses() -> None:
    # x = 0 at eps0 > ~37: log1p((1-2w)(2x-m)/den) rounded to log1p(-1) = -inf and the PLD refused it.

    for eps0 in (40.0, 100.0):
        losses, probs, _ = clone_pld._loss_support(eps0, 1000, "stronger", True)
        assert np.all(np.isfinite(losses)) and losses.min() == pytest.approx(-eps0, rel=1e-12)
        b = bounds.epsilon("clones", eps0, 1000, 1e-6, 6)
        assert b.details["uncapped"] >= b.value and b.value <= 6 * eps0


# ------------------------------------------------------------------ bucketing keeps small n exact, eps0 finely


def test_bucketing_keeps_every_small_n_exact() -> None:
    # Each n below 1 / (ratio - 1) is the only integer of its grid cell: rounding it to the cell's floor (n - 1)
    # made a 5-group history 1.6% looser than composing the groups as they are.
    ratio = heterogeneous.HETEROGENEOUS_N_GRID_RATIO
    limit = math.floor(1.0 / (ratio - 1.0) + 1e-9)
    assert limit >= 50
    for n in list(range(1, limit)) + [12_345, 10**6]:
        n_up, _ = heterogeneous.dominating_round(n, 1.0, lower=False)
        n_lo, _ = heterogeneous.dominating_round(n, 1.0, lower=True)
        if n < limit:
            assert n_up == n and n_lo == n
        else:  # still merged on the grid, in the safe direction
            assert n / ratio <= n_up <= n <= n_lo <= n * ratio
    rounds = [ShuffleRound(n, 1.0) for n in (20, limit // 4, limit // 2, 3 * limit // 4, limit - 1)]
    items = [(r.n, r.eps0, 1) for r in rounds]
    for family in ("clones", "rr-lower"):
        b = bounds.epsilon_for_rounds(family, rounds, 1e-6)
        assert b.details["bucketed"]["groups_before"] == 5
        unbucketed, _ = families.lookup(family).heterogeneous_epsilon(items, 5, 1e-6, False)
        assert b.value == pytest.approx(unbucketed, rel=1e-12)


def test_bucketing_moves_a_large_eps0_history_by_well_under_one_percent() -> None:
    # Worst case for eps0: every eps0 just above a grid point, so each is rounded up by almost a full step.
    # The value reacts by about eps0/2 times the relative step of eps0's grid.
    ratio = heterogeneous.HETEROGENEOUS_EPS0_GRID_RATIO
    eps0 = ratio ** math.floor(math.log(8.0) / math.log(ratio)) * (1.0 + 1e-9)
    rounds = [ShuffleRound(10**5 + k, eps0) for k in (1, 3, 5, 7, 9)]
    items = [(r.n, r.eps0, 1) for r in rounds]
    b = bounds.epsilon_for_rounds("clones", rounds, 1e-6)
    assert b.details["bucketed"]["groups_before"] == 5
    unbucketed, _ = families.lookup("clones").heterogeneous_epsilon(items, 5, 1e-6, False)
    assert unbucketed <= b.value <= unbucketed * 1.01


# ------------------------------------------------------------------ heterogeneous two-point PLDs: relative grid


@pytest.mark.parametrize("eps0, rounds", [(1e-5, 10), (1e-5, 1000), (1e-3, 1000), (0.1, 1000)])
def test_heterogeneous_no_shuffle_is_close_to_the_exact_composition_at_small_eps0(eps0: float, rounds: int) -> None:
    # Two eps0 groups a hair apart: the exact (KOV) value of 2T rounds at the larger eps0 is the reference.
    # A fixed 1e-4 grid made this 20x (T = 10) to 96x (T = 1000) the reference at eps0 = 1e-5, 33% at 1e-3.
    hist = [ShuffleRound(1000, eps0)] * rounds + [ShuffleRound(1000, eps0 * (1 + 1e-7))] * rounds
    b = bounds.epsilon_for_rounds("no-shuffle", hist, 1e-6)
    exact = lit.no_shuffle_epsilon(eps0 * (1 + 1e-7), 2 * rounds, 1e-6)
    assert b.details["groups"] == 2
    assert exact <= b.value <= exact * (1.0 + 4e-3)  # an upper bound, within INTERVAL_RELATIVE_ERROR


def test_heterogeneous_fmt_is_close_to_the_homogeneous_value_at_large_n() -> None:
    # n = 1e7: per-round FMT epsilons ~1e-3, below the old fixed grid's resolution (6.1% looser than the
    # homogeneous value then); the homogeneous value also optimises its delta split, so it is a lower reference.
    hist = [ShuffleRound(10**7, 1.0)] * 1000 + [ShuffleRound(10**7 + 1, 1.0)] * 1000
    b = bounds.epsilon_for_rounds("fmt", hist, 1e-6)
    same = bounds.epsilon("fmt", 1.0, 10**7, 1e-6, 2000).value
    assert b.kind == "upper" and b.details["interval"] < bounds.HETEROGENEOUS_INTERVAL
    assert same <= b.value <= same * 1.01


def test_heterogeneous_pair_interval_keeps_the_composed_grid_bounded() -> None:
    # eps 1e-5 next to eps 10 over many rounds: the relative target alone would ask for ~1e10 grid points.
    from shuffledp.accounting import clones

    h = composition.pair_interval([(1e-5, 1000), (10.0, 1000)])
    width = 1000 * 10.0 * math.tanh(5.0) + 18.0 * math.sqrt(1000 * (100.0 - (10.0 * math.tanh(5.0)) ** 2)) + 20.0
    assert width / h <= clones.MAX_COMPOSED_GRID
    assert composition.pair_interval([(1.0, 10)]) == bounds.HETEROGENEOUS_INTERVAL
