"""Tests of the dispatcher shuffledp.accounting.bounds: reference values, kinds, refusals, validation, calibration,
heterogeneous rounds, the no-shuffle cap, and stability at n = 1e6."""

from __future__ import annotations

import math

import pytest

from shuffledp.accounting import FAMILIES, FAMILY_KINDS, Bound, RefusedError, bounds
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


def test_eps0_above_the_supported_maximum_is_rejected_with_the_limit() -> None:
    with pytest.raises(ValueError, match="<= 100"):
        bounds.epsilon("no-shuffle", 150.0, 1000, 1e-6)
    assert bounds.epsilon("girgis", 100.0, 1000, 1e-6, rounds=3).value <= 300.0


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
