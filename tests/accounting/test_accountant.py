"""ShuffleRound (events) and ShuffleAccountant: composition, queries, budgets and checkpoints."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from shuffledp.accounting import Bound, RefusedError, bounds
from shuffledp.accounting.accountant import GUARANTEE_FAMILIES, Refusal, ShuffleAccountant
from shuffledp.accounting.events import ShuffleRound
from shuffledp.accounting.ledger import Ledger, LedgerError

# Reference values: ../shared/reference/accounting_values.md (exact sums over the clone-pair support).
REF_CLONES_1E4_2_1E6 = 0.1143996153
REF_COMPOSED_1E5_1_T100 = (0.1483732, 0.1485597)  # [optimistic, pessimistic]
PLD_SLACK = 0.005  # the acceptance: a composed value may sit at most 0.5 % above the bracket
REL_EXACT = 1e-6  # the acceptance for exact single-round values
ROUNDOFF = 1e-12  # relative: two bounds that coincide (no amplification) may differ by float round-off


# -- ShuffleRound -----------------------------------------------------------------------------------------------
def test_shuffle_round_is_immutable_and_normalises_numeric_types() -> None:
    event = ShuffleRound(np.int64(100), np.float32(0.5))
    assert event == ShuffleRound(100, 0.5)
    assert type(event.n) is int and type(event.eps0) is float
    with pytest.raises(AttributeError):
        event.n = 5
    assert ShuffleRound.from_dict(json.loads(json.dumps(event.to_dict()))) == event


@pytest.mark.parametrize(
    ("n", "eps0", "error", "message"),
    [
        (0, 1.0, ValueError, r"integer in \[1, 1e\+09\].*, got 0"),
        (-3, 1.0, ValueError, r"integer in \[1, 1e\+09\]"),
        (2.0, 1.0, TypeError, "got float"),
        (True, 1.0, TypeError, "boolean"),
        ("10", 1.0, TypeError, r"integer in \[1, 1e\+09\]"),
        (10, 0.0, ValueError, "finite real number > 0"),
        (10, -1.0, ValueError, "finite real number > 0"),
        (10, math.inf, ValueError, "finite"),
        (10, math.nan, ValueError, "finite"),
        (10, "1", TypeError, "real number"),
        (10, False, TypeError, "real number"),
    ],
)
def test_shuffle_round_validation(n: object, eps0: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        ShuffleRound(n, eps0)


def test_shuffle_round_from_dict_refuses_unknown_keys() -> None:
    with pytest.raises(ValueError, match="exactly the keys"):
        ShuffleRound.from_dict({"n": 3, "eps0": 1.0, "extra": 1})


# -- construction -----------------------------------------------------------------------------------------------
def test_guarantee_families_are_exactly_the_upper_bound_families() -> None:
    assert set(GUARANTEE_FAMILIES) == {"clones", "clones-focs", "girgis", "fmt", "no-shuffle", "blanket-laplace",
                                       "blanket-privunit2", "blanket-duchi"}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"target_delta": 0.0}, ValueError, r"target_delta must be a real number with 0 < target_delta < 1"),
        ({"target_delta": 1.0}, ValueError, "target_delta"),
        ({"target_delta": "1e-6"}, TypeError, "target_delta"),
        ({"target_delta": 1e-6, "family": "nope"}, ValueError, "family must be one of"),
        ({"target_delta": 1e-6, "family": "ccg-gdp"}, ValueError, "does not give a guarantee"),
        ({"target_delta": 1e-6, "family": "rr-lower"}, ValueError, "does not give a guarantee"),
        ({"target_delta": 1e-6, "comparison_families": ("rr-lower", "rr-lower")}, ValueError, "twice"),
        ({"target_delta": 1e-6, "comparison_families": ("clones",)}, ValueError, "must not repeat"),
        ({"target_delta": 1e-6, "comparison_families": ("bogus",)}, ValueError, "comparison family must be one of"),
        ({"target_delta": 1e-6, "comparison_families": "rr-lower"}, TypeError, "not the string"),
        ({"target_delta": 1e-6, "allow_approximate": 1}, TypeError, "allow_approximate must be a bool"),
    ],
)
def test_constructor_validation(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        ShuffleAccountant(**kwargs)


def test_empty_accountant_reports_zero() -> None:
    acct = ShuffleAccountant(1e-6, comparison_families=("rr-lower",))
    assert acct.rounds == () and acct.num_releases == 0
    assert acct.epsilon().value == 0.0 and acct.epsilon().kind == "upper"
    assert acct.epsilons()["rr-lower"].value == 0.0


def test_compose_validation_leaves_state_unchanged() -> None:
    acct = ShuffleAccountant(1e-6)
    acct.compose(ShuffleRound(1000, 1.0))
    with pytest.raises(TypeError, match="ShuffleRound"):
        acct.compose((1000, 1.0))
    with pytest.raises(ValueError, match="count must be an integer >= 1"):
        acct.compose(ShuffleRound(1000, 1.0), count=0)
    assert acct.rounds == (ShuffleRound(1000, 1.0),)


# -- values -----------------------------------------------------------------------------------------------------
def test_single_round_matches_the_exact_reference_value() -> None:
    acct = ShuffleAccountant(1e-6)
    acct.compose(ShuffleRound(10_000, 2.0))
    bound = acct.epsilon()
    assert isinstance(bound, Bound) and bound.kind == "upper" and bound.family == "clones"
    # sound (never below the exact value) and tight (inside the PLD slack)
    assert bound.value >= REF_CLONES_1E4_2_1E6 * (1 - REL_EXACT)
    assert bound.value <= REF_CLONES_1E4_2_1E6 * (1 + PLD_SLACK)


def test_composed_value_is_inside_the_reference_bracket() -> None:
    acct = ShuffleAccountant(1e-6)
    acct.compose(ShuffleRound(100_000, 1.0), count=100)
    assert acct.num_releases == 100
    low, high = REF_COMPOSED_1E5_1_T100
    value = acct.epsilon().value
    assert low <= value <= high * (1 + PLD_SLACK)


def test_accountant_agrees_with_epsilon_for_rounds_on_heterogeneous_rounds() -> None:
    history = [ShuffleRound(5_000, 1.0), ShuffleRound(20_000, 2.0), ShuffleRound(8_000, 0.5)]
    acct = ShuffleAccountant(1e-6, family="clones-focs")
    for event in history:
        acct.compose(event)
    direct = bounds.epsilon_for_rounds("clones-focs", history, 1e-6)
    assert acct.epsilon().value == direct.value
    assert acct.epsilon(delta=1e-8).value == bounds.epsilon_for_rounds("clones-focs", history, 1e-8).value
    # a smaller delta costs more epsilon
    assert acct.epsilon(delta=1e-8).value > acct.epsilon().value


def test_cumulative_epsilon_grows_with_rounds_and_stays_below_the_trivial_bound() -> None:
    acct = ShuffleAccountant(1e-6)
    values = []
    for _ in range(5):
        acct.compose(ShuffleRound(10_000, 1.0))
        values.append(acct.epsilon().value)
    assert all(b > a for a, b in zip(values, values[1:]))
    assert values[-1] <= 5 * 1.0


def test_epsilons_reports_kinds_and_refusals_never_as_numbers() -> None:
    # n/(e^eps0+1) = 1e4/(e^8+1) ~ 3.4 < 2 ln(1e6) ~ 27.6: the CLT approximations must refuse
    acct = ShuffleAccountant(1e-6, comparison_families=("ccg-gdp", "rr-lower", "no-shuffle"))
    acct.compose(ShuffleRound(10_000, 8.0))
    report = acct.epsilons()
    assert list(report) == ["clones", "ccg-gdp", "rr-lower", "no-shuffle"]
    refused = report["ccg-gdp"]
    assert isinstance(refused, Refusal) and refused.value is None and refused.kind == "refused"
    assert refused.reason  # the family's own explanation
    with pytest.raises(RefusedError):
        bounds.epsilon_for_rounds("ccg-gdp", acct.rounds, 1e-6)
    assert report["clones"].kind == "upper" and report["rr-lower"].kind == "lower"
    # with ~3.4 expected clones there is almost no amplification: all three nearly coincide with eps0
    assert report["rr-lower"].value <= report["clones"].value * (1 + ROUNDOFF)
    assert report["clones"].value <= report["no-shuffle"].value * (1 + ROUNDOFF)

    permissive = ShuffleAccountant(1e-6, comparison_families=("ccg-gdp",), allow_approximate=True)
    permissive.compose(ShuffleRound(10_000, 8.0))
    approx = permissive.epsilons()["ccg-gdp"]
    assert isinstance(approx, Bound) and approx.kind == "approximate" and math.isfinite(approx.value)


def test_default_family_refusal_is_raised_not_replaced() -> None:
    # FMT'21 Thm 3.1 needs eps0 <= log(n / (16 log(4/delta))); here log(1000/(16 log 4e6)) ~ 1.4 < 4
    acct = ShuffleAccountant(1e-6, family="fmt", comparison_families=("clones",))
    acct.compose(ShuffleRound(1_000, 4.0))
    with pytest.raises(RefusedError):
        acct.epsilon()
    assert isinstance(acct.epsilons()["fmt"], Refusal)
    assert acct.epsilons()["clones"].kind == "upper"


def test_would_exceed_is_consistent_with_composing() -> None:
    acct = ShuffleAccountant(1e-6)
    acct.compose(ShuffleRound(10_000, 1.0), count=3)
    nxt = ShuffleRound(10_000, 1.0)
    probe = ShuffleAccountant.from_state_dict(acct.state_dict())
    probe.compose(nxt)
    after = probe.epsilon().value
    assert acct.would_exceed(nxt, after * 0.999) is True
    assert acct.would_exceed(nxt, after * 1.001) is False
    assert acct.would_exceed(nxt, math.inf) is False
    assert acct.num_releases == 3  # asking does not compose
    # several prospective rounds at once
    probe.compose(nxt, count=4)
    assert acct.would_exceed(nxt, probe.epsilon().value * 0.999, count=5) is True
    assert acct.would_exceed(nxt, probe.epsilon().value * 1.001, count=5) is False


@pytest.mark.parametrize(
    ("budget", "error"), [(0.0, ValueError), (-1.0, ValueError), (math.nan, ValueError), ("1", TypeError)]
)
def test_would_exceed_validates_the_budget(budget: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="budget_epsilon"):
        ShuffleAccountant(1e-6).would_exceed(ShuffleRound(100, 1.0), budget)


# -- checkpoints ------------------------------------------------------------------------------------------------
def test_state_dict_round_trips_exactly_through_json() -> None:
    acct = ShuffleAccountant(1e-6 / 3, family="clones-focs", comparison_families=("ccg-gdp", "rr-lower"),
                             allow_approximate=True)
    acct.compose(ShuffleRound(7_001, 0.1 + 0.2))
    acct.compose(ShuffleRound(12_345, 1 / 3), count=2)
    text = json.dumps(acct.state_dict(), allow_nan=False)
    restored = ShuffleAccountant.from_state_dict(json.loads(text))
    assert restored.state_dict() == acct.state_dict()
    assert restored.rounds == acct.rounds and restored.rounds[0].eps0 == 0.1 + 0.2
    assert restored.target_delta == 1e-6 / 3
    assert restored.epsilons() == acct.epsilons()
    other = ShuffleAccountant(1e-3)
    other.load_state_dict(json.loads(text))
    assert other.state_dict() == acct.state_dict()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s.update(version=2), "version 2 is not supported"),
        (lambda s: s.update(format="other"), "not a shuffledp accountant state"),
        (lambda s: s.pop("rounds"), "expected exactly"),
        (lambda s: s.update(extra=1), "expected exactly"),
        (lambda s: s.update(rounds=[{"n": 0, "eps0": 1.0}]), r"integer in \[1"),
        (lambda s: s.update(rounds=[{"n": 5}]), "exactly the keys"),
        (lambda s: s.update(rounds="x"), "must be a list"),
        (lambda s: s.update(family="ccg-rdp"), "does not give a guarantee"),
        (lambda s: s.update(target_delta=2.0), "target_delta"),
        # a wrong type is the documented ValueError too, and a version must be the int 1 (not True or 1.0)
        (lambda s: s.update(version=True), "version True is not supported"),
        (lambda s: s.update(version=1.0), "version 1.0 is not supported"),
        (lambda s: s.update(target_delta="1e-6"), "wrong type"),
        (lambda s: s.update(rounds=[{"n": 1000.0, "eps0": 1.0}]), "n"),
    ],
)
def test_invalid_state_is_refused_and_changes_nothing(mutate, message: str) -> None:
    acct = ShuffleAccountant(1e-6)
    acct.compose(ShuffleRound(1_000, 1.0))
    state = acct.state_dict()
    mutate(state)
    with pytest.raises(ValueError, match=message):  # the documented error, whatever the field's type
        ShuffleAccountant.from_state_dict(state)
    before = acct.state_dict()
    with pytest.raises(ValueError, match=message):
        acct.load_state_dict(state)
    assert acct.state_dict() == before


# -- with the ledger --------------------------------------------------------------------------------------------
def test_ledger_records_the_accountant_each_round(tmp_path: Path) -> None:
    acct = ShuffleAccountant(1e-6, comparison_families=("ccg-gdp", "rr-lower"))
    with Ledger(tmp_path / "ledger.db") as ledger:
        with pytest.raises(LedgerError, match="composed no round"):
            ledger.record(acct, round=1, mechanism="rr")
        for rnd, n in enumerate((10_000, 20_000), start=1):
            acct.compose(ShuffleRound(n, 8.0))
            row = ledger.record(acct, round=rnd, mechanism="binary-rr")
            assert row["n_reports"] == n and row["eps0"] == 8.0 and row["delta"] == 1e-6
            assert row["epsilons"]["clones"] == {"value": acct.epsilon().value, "kind": "upper", "reason": None}
        rows = ledger.rows()
    assert [r["round"] for r in rows] == [1, 2]
    # round 1: n/(e^8+1) ~ 3.4 clones expected -> the CLT approximation refused, stored without a number
    assert rows[0]["epsilons"]["ccg-gdp"]["kind"] == "refused" and rows[0]["epsilons"]["ccg-gdp"]["value"] is None
    assert rows[0]["epsilons"]["ccg-gdp"]["reason"]
    assert rows[1]["epsilons"]["clones"]["value"] > rows[0]["epsilons"]["clones"]["value"]
    assert rows[1]["epsilons"]["rr-lower"]["value"] <= rows[1]["epsilons"]["clones"]["value"] * (1 + ROUNDOFF)


def test_the_ledger_refuses_an_accountant_that_misses_a_recorded_round(tmp_path: Path) -> None:
    # Two server processes on one run, each with its own accountant. A restored round 1, then B
    # (whose accountant never composed A's round 2) charges round 3: its cumulative epsilon would leave round 2 out.
    a, b = ShuffleAccountant(1e-6), ShuffleAccountant(1e-6)
    with Ledger(tmp_path / "ledger.db") as ledger:
        for acct in (a, b):
            acct.compose(ShuffleRound(12, 4.0))
        ledger.record(a, round=1, mechanism="rr")
        a.compose(ShuffleRound(12, 4.0))
        ledger.record(a, round=2, mechanism="rr")
        b.compose(ShuffleRound(12, 4.0))
        before = ledger.rows()
        with pytest.raises(LedgerError, match="compose 1 earlier round.*but the ledger holds 2.*another writer"):
            ledger.record(b, round=3, mechanism="rr")
        assert ledger.rows() == before  # nothing written
        # an accountant whose earlier rounds are the ledger's, but with another count, is refused too
        c = ShuffleAccountant(1e-6)
        for n in (12, 11, 12):
            c.compose(ShuffleRound(n, 4.0))
        refused = "compose 2 earlier round.*holds 2, and their .* are not the accountant's"
        with pytest.raises(LedgerError, match=refused):
            ledger.record(c, round=3, mechanism="rr")
        a.compose(ShuffleRound(12, 4.0))  # the writer that holds every round goes on
        assert ledger.record(a, round=3, mechanism="rr")["epsilons"]["clones"]["value"] == a.epsilon().value


# ------------------------------------------------------------------ eps0 above EPS0_MAX never enters


def test_shuffle_round_rejects_eps0_above_the_limit_of_every_bound() -> None:
    from shuffledp.accounting import EPS0_MAX

    assert ShuffleRound(100, EPS0_MAX).eps0 == EPS0_MAX
    with pytest.raises(ValueError, match=r"<= 100 \(EPS0_MAX"):
        ShuffleRound(100, 150.0)
    with pytest.raises(ValueError, match="EPS0_MAX"):
        ShuffleRound.from_dict({"n": 100, "eps0": 100.5})
    with pytest.raises(ValueError, match="N_MAX = 1,000,000,000"):
        ShuffleRound(10**9 + 1, 1.0)


def test_compose_validates_before_changing_the_history() -> None:
    acc = ShuffleAccountant(1e-6)
    acc.compose(ShuffleRound(1000, 2.0))
    before = acc.epsilon().value
    bad = ShuffleRound(100, 1.0)
    object.__setattr__(bad, "eps0", 150.0)  # a frozen round altered behind its back
    with pytest.raises(ValueError, match="EPS0_MAX"):
        acc.compose(bad)
    with pytest.raises(ValueError, match="EPS0_MAX"):
        acc.would_exceed(bad, 10.0)
    assert acc.rounds == (ShuffleRound(1000, 2.0),)
    assert acc.state_dict()["rounds"] == [{"n": 1000, "eps0": 2.0}]
    assert acc.epsilon().value == before
    assert not acc.would_exceed(ShuffleRound(1000, 2.0), 100.0)


@pytest.mark.parametrize(
    "big, small",
    [
        (ShuffleRound(10**8, 0.1), ShuffleRound(2, 0.1)),
        (ShuffleRound(10**7, 0.5), ShuffleRound(3, 0.5)),
        (ShuffleRound(10**6, 0.01), ShuffleRound(100, 5.0)),
        (ShuffleRound(10**9, 1e-3), ShuffleRound(10, 2.0)),
    ],
)
def test_rounds_of_very_different_sizes_compose_without_running_out_of_grid(big, small) -> None:
    """A large-n round (losses near 1e-6) next to a small-n one (losses up to eps0): the grid must not be sized by
    the finest round alone (hundreds of millions of points, an exception in a server that asked would_exceed).
    The composition must be at least its larger single round, at most the no-shuffle value, and above the rr lower
    bound."""
    acct = ShuffleAccountant(family="clones", target_delta=1e-6)
    acct.compose(big)
    assert acct.would_exceed(small, budget_epsilon=1e-9) is True
    acct.compose(small)
    both = acct.epsilon()
    assert both.kind == "upper" and math.isfinite(both.value)
    single = max(bounds.epsilon("clones", r.eps0, r.n, 1e-6).value for r in (big, small))
    assert single <= both.value <= big.eps0 + small.eps0
    lower = bounds.epsilon_for_rounds("rr-lower", [big, small], 1e-6)
    assert lower.kind == "lower" and lower.value <= both.value
