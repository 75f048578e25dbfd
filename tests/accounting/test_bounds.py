"""Tests of the dispatcher shuffledp.accounting.bounds: reference values, kinds, refusals, validation, calibration,
heterogeneous rounds, the no-shuffle cap, and stability at n = 1e6."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats

from shuffledp.accounting import (
    FAMILIES,
    FAMILY_KINDS,
    Bound,
    RefusedError,
    bounds,
    clone_pld,
    composition,
    families,
    heterogeneous,
)
from shuffledp.accounting import literature as lit
from shuffledp.accounting.events import ShuffleRound

#: Exact single-round values must match the reference to this relative tolerance (issue 2).
REFERENCE_RTOL = 1e-6
#: Composed values may exceed the reference's pessimistic end by at most this fraction (issue 2: 0.5%).
BRACKET_SLACK = 5e-3
#: Agreement of two exact routes to the same number.
EXACT_RTOL = 1e-9


# ------------------------------------------------------------------ reference values (accounting_values.md)


@pytest.mark.parametrize(
    "family, n, eps0, delta, expected",
    [
        ("clones", 10_000, 2.0, 1e-6, 0.1143996153),
        ("clones-focs", 10_000, 2.0, 1e-6, 0.1550452425),
        ("clones-focs", 100_000, 4.0, 1e-6, 0.1697697473),
        ("clones", 1_000_000, 1.0, 1e-8, 0.005011620846),
        ("clones", 1_000, 4.0, 1e-5, 1.498244341),
        ("rr-lower", 10_000, 1.0, 1e-6, 0.03565881530),
    ],
)
def test_single_round_reference_values(family: str, n: int, eps0: float, delta: float, expected: float) -> None:
    b = bounds.epsilon(family, eps0, n, delta)
    assert b.value == pytest.approx(expected, rel=REFERENCE_RTOL)
    assert b.kind == FAMILY_KINDS[family] and b.family == family


def test_composed_reference_value_inside_bracket() -> None:
    lo, hi = 0.1483732, 0.1485597
    b = bounds.epsilon("clones", 1.0, 100_000, 1e-6, rounds=100)
    assert b.kind == "upper"
    assert lo <= b.value <= hi * (1 + BRACKET_SLACK)
    bracket = bounds.epsilon_bracket("clones", 1.0, 100_000, 1e-6, 100)
    opt, pess = bracket
    assert (bracket.lower, bracket.upper) == (opt, pess) and bracket.kinds == {"lower": "lower", "upper": "upper"}
    assert opt <= pess
    assert pess == pytest.approx(b.value, rel=EXACT_RTOL)
    assert opt <= hi and pess >= lo  # our bracket overlaps the reference bracket


def test_delta_and_renyi_reference_values() -> None:
    assert bounds.delta("clones", 2.0, 10_000, 0.1).value == pytest.approx(6.021292672e-06, rel=REFERENCE_RTOL)
    assert bounds.renyi("clones-focs", 1.0, 10_000, 2).value == pytest.approx(2.322115839e-4, rel=REFERENCE_RTOL)
    assert bounds.renyi("clones", 1.0, 10_000, 2).value == pytest.approx(1.588158093e-4, rel=REFERENCE_RTOL)
    assert bounds.renyi("clones", 1.0, 10_000, 64).value == pytest.approx(5.082161068e-3, rel=REFERENCE_RTOL)
    assert bounds.renyi("clones-focs", 0.5, 1_000_000, 2).value == pytest.approx(3.955952179e-7, rel=REFERENCE_RTOL)


def test_renyi_composes_linearly_and_has_kinds() -> None:
    for family, kind in [
        ("clones", "upper"),
        ("clones-focs", "upper"),
        ("girgis", "upper"),
        ("girgis-lower", "lower"),
        ("ccg-rdp", "approximate"),
        ("rr-lower", "lower"),
    ]:
        one = bounds.renyi(family, 1.0, 10_000, 4)
        ten = bounds.renyi(family, 1.0, 10_000, 4, rounds=10)
        assert one.kind == kind and ten.kind == kind
        assert ten.value == pytest.approx(10 * one.value, rel=EXACT_RTOL)
    # the ordering Fig. 2 of Chen, Cao, Ge (ICASSP 2024, seed 000) is about: exact lower <= clones (upper) <= girgis
    # (upper) at lambda=4
    rr = bounds.renyi("rr-lower", 2.0, 10_000, 4).value
    assert rr <= bounds.renyi("clones", 2.0, 10_000, 4).value <= bounds.renyi("girgis", 2.0, 10_000, 4).value


@pytest.mark.parametrize("family", ["ccg-gdp", "fmt", "canonical-gdp", "no-shuffle"])
def test_renyi_refused_for_families_without_a_curve(family: str) -> None:
    with pytest.raises(RefusedError) as info:
        bounds.renyi(family, 1.0, 10_000, 2)
    for name in bounds.RENYI_FAMILIES:
        assert name in str(info.value)


# ------------------------------------------------------------------------------------------ kinds, caps


def test_every_family_answers_with_its_kind() -> None:
    for family in FAMILIES:
        b = bounds.epsilon(family, 1.0, 100_000, 1e-6)
        assert isinstance(b, Bound)
        assert b.kind == FAMILY_KINDS[family]
        assert 0.0 < b.value <= 1.0


def test_upper_families_dominate_the_lower_one_and_approximations_are_labelled() -> None:
    from shuffledp.accounting.families import FAMILY_MECHANISMS

    # generic families only: a mechanism-aware one (blanket-laplace) may lie below rr-lower (docs/accounting.md)
    generic = [f for f in FAMILIES if f not in FAMILY_MECHANISMS]
    lower = bounds.epsilon("rr-lower", 1.0, 100_000, 1e-6).value
    for family in generic:
        b = bounds.epsilon(family, 1.0, 100_000, 1e-6)
        if b.kind == "upper":
            assert b.value >= lower
    # the clones family is the tightest generic upper family here
    uppers = [bounds.epsilon(f, 1.0, 100_000, 1e-6).value for f in generic if FAMILY_KINDS[f] == "upper"]
    assert bounds.epsilon("clones", 1.0, 100_000, 1e-6).value == min(uppers)


def test_no_shuffle_cap_is_applied_and_reported() -> None:
    b = bounds.epsilon("girgis", 2.0, 100, 1e-6)
    ns = bounds.epsilon("no-shuffle", 2.0, 100, 1e-6)
    assert b.details["capped_by_no_shuffle"] is True
    assert b.details["uncapped"] > ns.value
    assert b.value == ns.value
    assert "capped_by_no_shuffle" not in bounds.epsilon("girgis", 1.0, 100_000, 1e-6).details


def test_girgis_lower_is_refused_outside_renyi() -> None:
    with pytest.raises(RefusedError, match="renyi"):
        bounds.epsilon("girgis-lower", 1.0, 10_000, 1e-6)
    with pytest.raises(RefusedError):
        bounds.delta("girgis-lower", 1.0, 10_000, 0.1)


# -------------------------------------------------------------------------------------------- refusals


def test_ccg_refused_where_the_clt_is_unsafe_and_allowed_on_request() -> None:
    # seeds README: at n=1e4, eps0=8, delta=1e-6 the CLT value falls BELOW the exact clone value.
    for family in ("ccg-gdp", "ccg-rdp", "canonical-gdp"):
        with pytest.raises(RefusedError, match="allow_approximate"):
            bounds.epsilon(family, 8.0, 10_000, 1e-6)
    approx = bounds.epsilon("ccg-gdp", 8.0, 10_000, 1e-6, allow_approximate=True)
    assert approx.kind == "approximate"
    exact = bounds.epsilon("clones", 8.0, 10_000, 1e-6)
    assert approx.value < exact.value  # why the refusal exists


def test_fmt_refused_outside_validity_and_heterogeneous_too() -> None:
    with pytest.raises(RefusedError, match="16 log"):
        bounds.epsilon("fmt", 6.0, 10_000, 1e-6)
    with pytest.raises(RefusedError):
        bounds.epsilon_for_rounds("fmt", [ShuffleRound(10_000, 6.0), ShuffleRound(10_000, 1.0)], 1e-6)


def test_fmt_over_rounds_is_an_upper_bound_of_the_single_round() -> None:
    one = bounds.epsilon("fmt", 1.0, 100_000, 1e-6).value
    ten = bounds.epsilon("fmt", 1.0, 100_000, 1e-6, rounds=10)
    assert ten.value > one
    assert ten.value >= bounds.epsilon("rr-lower", 1.0, 100_000, 1e-6, rounds=10).value


# ------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"n": 0}, ValueError, "n \\(number of shuffled reports\\) must be an integer in \\[1, 1e\\+09\\]"),
        ({"n": 2.5}, TypeError, "integer"),
        ({"n": True}, TypeError, "integer"),
        ({"eps0": 0.0}, ValueError, "eps0 must be a finite real number > 0"),
        ({"eps0": -1.0}, ValueError, "eps0"),
        ({"eps0": math.inf}, ValueError, "eps0"),
        ({"eps0": math.nan}, ValueError, "eps0"),
        ({"eps0": "1"}, TypeError, "eps0"),
        ({"delta": 0.0}, ValueError, "0 < delta < 1"),
        ({"delta": 1.0}, ValueError, "0 < delta < 1"),
        ({"delta": math.nan}, ValueError, "delta"),
        ({"rounds": 0}, ValueError, "rounds must be an integer >= 1"),
        ({"rounds": 1.5}, TypeError, "rounds"),
        ({"family": "clone"}, ValueError, "family must be one of"),
    ],
)
def test_epsilon_validates_arguments(kwargs: dict, exc: type, match: str) -> None:
    args = {"family": "clones", "eps0": 1.0, "n": 1000, "delta": 1e-6, "rounds": 1}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        bounds.epsilon(args["family"], args["eps0"], args["n"], args["delta"], args["rounds"])


def test_other_entry_points_validate() -> None:
    with pytest.raises(ValueError, match="order"):
        bounds.renyi("clones", 1.0, 1000, 1.0)
    with pytest.raises(ValueError, match="epsilon"):
        bounds.delta("clones", 1.0, 1000, -0.1)
    with pytest.raises(ValueError, match="target_epsilon"):
        bounds.calibrate("clones", 0.0, 1e-6, 1000, 1)
    with pytest.raises(ValueError, match="at least one"):
        bounds.epsilon_for_rounds("clones", [], 1e-6)
    with pytest.raises(TypeError, match="rounds\\[1\\]"):
        bounds.epsilon_for_rounds("clones", [ShuffleRound(10, 1.0), (10, 1.0)], 1e-6)
    with pytest.raises(RefusedError, match="integer Renyi orders"):
        bounds.renyi("girgis", 1.0, 1000, 2.5)
    with pytest.raises(RefusedError, match="lambda >= 2"):
        bounds.renyi("ccg-rdp", 1.0, 1000, 1.5)


def test_integral_float_n_is_accepted() -> None:
    assert bounds.epsilon("no-shuffle", 1.0, 1e4, 1e-6).value == bounds.epsilon("no-shuffle", 1.0, 10_000, 1e-6).value


# ------------------------------------------------------------------------------------------ delta/epsilon


@pytest.mark.parametrize(
    "family, rounds",
    [
        ("clones", 1),
        ("clones-focs", 1),
        ("no-shuffle", 1),
        ("no-shuffle", 20),
        ("rr-lower", 1),
        ("ccg-gdp", 5),
        ("canonical-gdp", 1),
        ("girgis", 3),
        ("ccg-rdp", 3),
        ("fmt", 1),
        ("fmt", 4),
    ],
)
def test_delta_and_epsilon_are_consistent(family: str, rounds: int) -> None:
    eps0, n, target = 1.0, 100_000, 1e-6
    eps = bounds.epsilon(family, eps0, n, target, rounds).value
    back = bounds.delta(family, eps0, n, eps, rounds).value
    if family in ("girgis", "ccg-rdp"):
        # both directions minimise over the same order grid at different orders: delta(eps(d)) <= d
        assert back <= target * (1 + 1e-9)
    elif family == "fmt":
        assert back <= target * (1 + 1e-6)
    else:
        assert back == pytest.approx(target, rel=1e-6)


def test_composed_delta_is_consistent_with_composed_epsilon() -> None:
    eps = bounds.epsilon("clones", 1.0, 100_000, 1e-6, rounds=20).value
    back = bounds.delta("clones", 1.0, 100_000, eps, rounds=20).value
    assert back <= 1e-6 * (1 + 1e-6)
    assert back >= 1e-6 * 0.5  # the PLD's delta is continuous in eps: not far below at the answer


# ------------------------------------------------------------------------------------------ calibration


@pytest.mark.parametrize("family, rounds", [("no-shuffle", 1), ("clones", 1), ("ccg-gdp", 10), ("girgis", 2)])
def test_calibrate_returns_largest_certified_eps0(family: str, rounds: int) -> None:
    target, delta, n = 0.5, 1e-6, 10_000
    b = bounds.calibrate(family, target, delta, n, rounds)
    assert b.kind == FAMILY_KINDS[family]
    assert bounds.epsilon(family, b.value, n, delta, rounds).value <= target
    first_failing = b.details["first_failing_eps0"]
    assert first_failing <= b.value * (1 + bounds.CALIBRATION_RTOL) * (1 + 1e-12)
    assert bounds.epsilon(family, first_failing, n, delta, rounds).value > target


def test_calibrate_no_shuffle_matches_inverse_closed_form() -> None:
    # one round of eps0-DP at delta: eps = log(e^eps0 - delta (1 + e^eps0)) -> eps0 = log((e^eps + delta)/(1 - delta))
    target, delta = 1.0, 1e-6
    expected = math.log((math.exp(target) + delta) / (1 - delta))
    b = bounds.calibrate("no-shuffle", target, delta, 100, 1)
    assert b.value == pytest.approx(expected, rel=2 * bounds.CALIBRATION_RTOL)


def test_calibrate_raises_when_nothing_in_range_works() -> None:
    with pytest.raises(RefusedError, match="no eps0 in"):
        bounds.calibrate("clones", 1e-7, 1e-6, 100, 10)


def test_calibrate_reports_range_end() -> None:
    b = bounds.calibrate("no-shuffle", 100.0, 1e-6, 100, 1)
    assert b.value == bounds.CALIBRATION_RANGE[1]
    assert b.details["range_upper_end_reached"] is True


# --------------------------------------------------------------------------------- heterogeneous rounds


def test_single_group_equals_homogeneous_epsilon() -> None:
    rounds = [ShuffleRound(10_000, 1.0)] * 7
    for family in ("clones", "ccg-gdp", "girgis", "rr-lower", "no-shuffle", "fmt"):
        assert bounds.epsilon_for_rounds(family, rounds, 1e-6).value == pytest.approx(
            bounds.epsilon(family, 1.0, 10_000, 1e-6, rounds=7).value, rel=EXACT_RTOL
        )


def test_heterogeneous_rounds_sit_between_their_homogeneous_neighbours() -> None:
    a, b = ShuffleRound(10_000, 1.0), ShuffleRound(5_000, 2.0)  # b leaks more than a
    mixed = [a, b, a, b, a]
    for family in ("clones", "clones-focs", "ccg-gdp", "ccg-rdp", "girgis", "rr-lower", "no-shuffle", "canonical-gdp"):
        value = bounds.epsilon_for_rounds(family, mixed, 1e-6)
        assert value.kind == FAMILY_KINDS[family]
        assert value.details["groups"] == 2 and value.details["rounds"] == 5
        low = bounds.epsilon(family, 1.0, 10_000, 1e-6, rounds=5).value
        high = bounds.epsilon(family, 2.0, 5_000, 1e-6, rounds=5).value
        assert low * (1 - 5e-3) <= value.value <= high * (1 + 5e-3), family
        if family in ("clones", "girgis"):  # the order of rounds does not matter
            assert bounds.epsilon_for_rounds(family, list(reversed(mixed)), 1e-6).value == pytest.approx(value.value)


def test_heterogeneous_gdp_adds_mu_squared() -> None:
    rounds = [ShuffleRound(10_000, 1.0)] * 3 + [ShuffleRound(20_000, 0.5)] * 2
    mu = math.sqrt(3 * lit.ccg_gdp_mu(1.0, 10_000) ** 2 + 2 * lit.ccg_gdp_mu(0.5, 20_000) ** 2)
    assert bounds.epsilon_for_rounds("ccg-gdp", rounds, 1e-6).value == pytest.approx(
        lit.gdp_epsilon(mu, 1e-6), rel=EXACT_RTOL
    )


def test_heterogeneous_fmt_is_an_upper_bound() -> None:
    rounds = [ShuffleRound(100_000, 1.0)] * 2 + [ShuffleRound(50_000, 0.5)] * 2
    b = bounds.epsilon_for_rounds("fmt", rounds, 1e-6)
    assert b.kind == "upper"
    assert b.value >= bounds.epsilon_for_rounds("rr-lower", rounds, 1e-6).value


# ------------------------------------------------------------------------------------------ n = 1e6


def test_stable_at_one_million() -> None:
    for family in FAMILIES:
        e = bounds.epsilon(family, 1.0, 1_000_000, 1e-8)
        assert math.isfinite(e.value) and e.value > 0.0
        d = bounds.delta(family, 1.0, 1_000_000, 0.001)
        assert 0.0 <= d.value <= 1.0 and math.isfinite(d.value)


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


def test_eps0_above_the_supported_maximum_is_rejected_with_the_limit() -> None:
    with pytest.raises(ValueError, match="<= 100"):
        bounds.epsilon("no-shuffle", 150.0, 1000, 1e-6)
    assert bounds.epsilon("girgis", 100.0, 1000, 1e-6, rounds=3).value <= 300.0


# ------------------------------------------------------------------ PLD re-check: exact, stepped up


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


def test_calibrate_counts_a_numerical_failure_as_failing_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    real = bounds.epsilon

    def flaky(family: str, eps0: float, *args: object, **kwargs: object) -> Bound:
        if eps0 > 2.0:
            raise ArithmeticError("simulated PLD re-check failure")
        return real(family, eps0, *args, **kwargs)

    monkeypatch.setattr(bounds, "epsilon", flaky)
    b = bounds.calibrate("no-shuffle", 50.0, 1e-6, 100, 1)  # the true answer (range end 20) is unevaluable
    assert b.value <= 2.0 and b.details["unevaluable_trials"] >= 1
    assert real("no-shuffle", b.value, 100, 1e-6, 1).value <= 50.0


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


# ------------------------------------------------------------------ refusal before underflow, Renyi order limit


@pytest.mark.parametrize("family", ["ccg-gdp", "ccg-rdp", "canonical-gdp"])
def test_clt_delta_that_underflows_to_zero_is_refused(family: str) -> None:
    # delta(5) underflows to 0: the refusal rule cannot be shown to hold, so 0.0 must not come back as a value.
    with pytest.raises(RefusedError, match="underflows to 0"):
        bounds.delta(family, 1.0, 10_000, 5.0)
    b = bounds.delta(family, 1.0, 10_000, 5.0, allow_approximate=True)
    assert b.value == 0.0 and b.kind == "approximate"


def test_clone_renyi_refuses_orders_above_its_limit_with_the_limit_in_the_message() -> None:
    from shuffledp.accounting import clones

    with pytest.raises(RefusedError, match=r"order <= 10000 \(RENYI_MAX_ORDER"):
        bounds.renyi("clones", 1.0, 1000, 20_000.0)
    with pytest.raises(ValueError, match="> 1"):
        clones.clone_renyi(1.0, 1000, 1.0)
    assert math.isfinite(bounds.renyi("clones", 1.0, 1000, clones.RENYI_MAX_ORDER).value)


def test_pld_epsilon_of_a_lower_bound_is_never_stepped_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # For an optimistic (lower-bound) PLD, delta(eps) > delta means eps is below the crossing: safe as it is.
    delta, e0 = 1e-6, 3.0
    fake = _FakePLD(e0, e0 + 40 * math.ulp(e0), delta, delta * (1.0 + 5e-7))
    monkeypatch.setattr(composition, "_pld", lambda: fake)
    assert composition.pld_epsilon(object(), delta, lower=True) == e0


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
