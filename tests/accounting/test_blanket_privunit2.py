"""``blanket-privunit2``: the privacy blanket of the project's PrivUnit2 at its eps0 split.

Checked: the family is the blanket pair at the split's box; it dominates exact shuffled instances of cap
mechanisms on a finite "sphere" whose likelihood ratios lie in that box (the only property the derivation uses);
it is tighter than the generic families; uneven rounds are bounded by their bucketed ones; the restriction is
stated and the mechanism's ``auto`` resolves to it.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from shuffledp.accounting import blanket, bounds
from shuffledp.accounting.cli import main as cli_main
from shuffledp.accounting.families import AUTO_FAMILIES, FAMILY_MECHANISMS, REGISTRY
from shuffledp.accounting.privunit_box import privunit_blanket_box, privunit_split

from .test_blanket import _hockey, _shuffled  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)

#: Float round-off allowed when the family's delta is compared with a delta it must dominate.
ROUNDOFF = 1e-12


def test_registered_as_the_mechanisms_upper_family() -> None:
    family = REGISTRY["blanket-privunit2"]
    assert family.kind == "upper" and FAMILY_MECHANISMS["blanket-privunit2"] == "privunit2"
    assert AUTO_FAMILIES["privunit2"] == "blanket-privunit2"
    assert "PrivUnit2Mechanism" in family.restriction and "not other eps0-LDP randomizers" in family.restriction


def test_cli_states_the_restriction(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["account", "epsilon", "--bound", "blanket-privunit2", "--eps0", "4", "--n", "1437",
                     "--delta", "1e-6", "--rounds", "1", "--json"])
    assert code == 0
    obj = json.loads(capsys.readouterr().out)
    assert "PrivUnit2Mechanism" in obj["holds_only_for"] and obj["kind"] == "upper"


@pytest.mark.parametrize(("eps0", "n", "delta"), [(1.0, 1_437, 1e-6), (4.0, 1_437, 1e-6), (6.0, 5_000, 1e-8)])
def test_one_round_is_the_blanket_pair_at_the_splits_box(eps0: float, n: int, delta: float) -> None:
    lo, log_ratio = privunit_blanket_box(eps0)
    got = bounds.epsilon("blanket-privunit2", eps0, n, delta, 1)
    assert got.value == blanket.blanket_epsilon(log_ratio, n, delta, lo=lo)
    assert got.details["mechanism"] == "privunit2"


@pytest.mark.parametrize(("eps0", "n", "delta", "rounds"), [
    (1.0, 1_437, 1e-6, 1), (3.3204, 1_437, 1e-6, 1), (4.0, 1_437, 1e-6, 1), (6.0, 5_000, 1e-8, 1),
    (3.3204, 1_437, 1e-6, 20),
])
def test_tighter_than_the_generic_families(eps0: float, n: int, delta: float, rounds: int) -> None:
    """The split's blanket (0.224 at eps0 = 4) is far above the worst eps0-LDP randomizer's 2/(e^eps0+1), and above
    the discrete Laplace's e^{-eps0/2}: the family is below ``clones``, ``clones-focs`` and ``blanket-laplace``."""
    value = bounds.epsilon("blanket-privunit2", eps0, n, delta, rounds).value
    for other in ("clones", "clones-focs", "blanket-laplace"):
        assert value < bounds.epsilon(other, eps0, n, delta, rounds).value, other


def test_reference_point() -> None:
    """n = 1,437, eps0 = 4, delta = 1e-6: 1.1027 (clones 1.3502, clones-focs 3.1870)."""
    value = bounds.epsilon("blanket-privunit2", 4.0, 1_437, 1e-6, 1).value
    assert value == pytest.approx(1.1027, abs=2e-4)
    assert value <= 0.82 * bounds.epsilon("clones", 4.0, 1_437, 1e-6, 1).value


def test_uneven_rounds_lie_between_their_uniform_bounds() -> None:
    """Two rounds at different eps0 and n: at most two rounds at the larger eps0 and smaller n (the box grows with
    eps0, one more report is post-processing), at least two rounds at the smaller eps0 and larger n."""
    from shuffledp.accounting.accountant import ShuffleAccountant
    from shuffledp.accounting.events import ShuffleRound

    acc = ShuffleAccountant(target_delta=1e-6, family="blanket-privunit2")
    acc.compose(ShuffleRound(n=1_437, eps0=3.0))
    acc.compose(ShuffleRound(n=1_400, eps0=3.3204))
    value = acc.epsilon().value
    high = bounds.epsilon("blanket-privunit2", 3.3204, 1_400, 1e-6, 2).value
    low = bounds.epsilon("blanket-privunit2", 3.0, 1_437, 1e-6, 2).value
    assert low <= value <= high


# ---------------------------------------------------------------------------------- exact cap instances


def _cap_pmf(m: int, cap: tuple[int, ...], p: float) -> np.ndarray:
    """A cap mechanism on the "sphere" {0, ..., m-1} under the uniform law: probability p uniform on the cap,
    1 - p uniform on the rest (PrivUnit2's two densities, p / A and (1 - p) / (1 - A))."""
    out = np.full(m, (1.0 - p) / (m - len(cap)))
    out[list(cap)] = p / len(cap)
    return out


def _exact_delta(pmfs_x: list[np.ndarray], pmfs_y: list[np.ndarray], eps: float) -> float:
    p, q = _shuffled(pmfs_x), _shuffled(pmfs_y)
    return max(_hockey(p, q, eps), _hockey(q, p, eps))


@pytest.mark.parametrize(("m", "k", "x", "x_prime", "others"), [
    (8, 1, (0,), (1,), [(2,), (3,)]),        # disjoint caps, others elsewhere
    (8, 1, (0,), (1,), [(1,), (1,)]),        # the others' caps on the second input's
    (8, 1, (0,), (1,), [(0,), (1,)]),
    (16, 2, (0, 1), (2, 3), [(4, 5), (6, 7)]),
    (16, 2, (0, 1), (1, 2), [(3, 4), (1, 2)]),  # overlapping caps
])
def test_dominates_exact_cap_instances(m: int, k: int, x: tuple, x_prime: tuple, others: list) -> None:
    """eps0 = 3: eps_cap = 2 needs a cap of mass >= 1/(1+e^2) = 0.119, here k/m = 1/8; p from eps_p = 1. Every such
    instance has its likelihood ratios in the split's box, so the family's delta is above its exact delta."""
    eps0 = 3.0
    eps_p, eps_cap = privunit_split(eps0)
    assert k / m >= 1.0 / (1.0 + math.exp(eps_cap))
    p = 1.0 / (1.0 + math.exp(-eps_p))
    rest = [_cap_pmf(m, c, p) for c in others]
    n = 1 + len(rest)
    for eps in (0.1, 0.5, 1.0):
        exact = _exact_delta([_cap_pmf(m, x, p), *rest], [_cap_pmf(m, x_prime, p), *rest], eps)
        family = bounds.delta("blanket-privunit2", eps0, n, eps, 1).value
        assert family >= exact - ROUNDOFF, (eps, family, exact)
        assert exact > 1e-4  # the instances are informative: the comparison is not vacuous


def test_a_cap_smaller_than_the_split_allows_is_not_covered() -> None:
    """The check has teeth: a cap of mass 1/16 with the same p (its ratio box is wider than the split's, so it is
    not PrivUnit2 at this eps0) can exceed the family's delta somewhere."""
    eps0, m = 3.0, 16
    eps_p, _ = privunit_split(eps0)
    p = 1.0 / (1.0 + math.exp(-eps_p))
    rest = [_cap_pmf(m, (2,), p)]
    worst = max(_exact_delta([_cap_pmf(m, (0,), p), *rest], [_cap_pmf(m, (1,), p), *rest], eps)
                - bounds.delta("blanket-privunit2", eps0, 2, eps, 1).value for eps in (0.1, 0.5, 1.0, 2.0, 2.5))
    assert worst > 0.0
