"""``blanket-duchi``: the privacy blanket of the project's Duchi et al. mechanism is the stronger clone pair.

Three things are checked here. (1) The family gives exactly the numbers of ``clones`` (it reuses the clone-pair
code), for one round, several rounds, uneven rounds, the accountant and the Renyi divergence, and it says what it
is restricted to. (2) Independently of the production code, the box-blanket pair of docs/accounting.md Steps 2-3
for a likelihood-ratio box [lo, hi] with lo + hi = 2 (corner law H = (hi, lo), L = (lo, hi), probability 1/2 each;
the counts of H, L and revealed non-blanket reports among n reports) is enumerated exactly in rationals and its
delta equals the clone pair's delta. (3) The premise for the mechanism: every flip probability it can draw with
lies in the box, so its likelihood ratios against (seed law) x (fair bit) lie in [2/(e^eps0+1), 2e^eps0/(e^eps0+1)];
and exact small shuffled instances of a Duchi-type randomizer stay below the family's delta.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from fractions import Fraction

import pytest

from shuffledp.accounting import bounds, clones
from shuffledp.accounting.accountant import ShuffleAccountant
from shuffledp.accounting.cli import main as cli_main
from shuffledp.accounting.events import ShuffleRound
from shuffledp.accounting.families import FAMILY_MECHANISMS, REGISTRY
from shuffledp.clients.coins import exp_lower, rr_interval
from shuffledp.clients.duchi import DuchiMechanism

#: Agreement asked of two float computations of the same exact quantity.
RTOL = 1e-9
#: Slack for a quantity the family's value must dominate (float round-off only).
ROUNDOFF = 1e-12


# ------------------------------------------------------------------------- (1) the same numbers as clones


def test_registered_as_a_mechanism_aware_upper_family() -> None:
    family = REGISTRY["blanket-duchi"]
    assert family.kind == "upper" and FAMILY_MECHANISMS["blanket-duchi"] == "duchi"
    assert "DuchiMechanism" in family.restriction and "not other eps0-LDP randomizers" in family.restriction


def test_cli_states_the_restriction(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["account", "calibrate", "--bound", "blanket-duchi", "--target-epsilon", "1", "--n", "1437",
                     "--delta", "1e-6", "--rounds", "1", "--json"])
    assert code == 0
    obj = json.loads(capsys.readouterr().out)
    assert "DuchiMechanism" in obj["holds_only_for"] and obj["kind"] == "upper"
    assert obj["value"] == bounds.calibrate("clones", 1.0, 1e-6, 1437, 1).value


@pytest.mark.parametrize(("eps0", "n", "delta", "rounds"), [
    (1.0, 1_000, 1e-6, 1), (3.3204, 1_437, 1e-6, 1), (4.0, 10_000, 1e-8, 1), (2.0, 500, 1e-5, 5),
    (3.3204, 1_437, 1e-6, 20),
])
def test_epsilon_equals_clones(eps0: float, n: int, delta: float, rounds: int) -> None:
    duchi = bounds.epsilon("blanket-duchi", eps0, n, delta, rounds)
    generic = bounds.epsilon("clones", eps0, n, delta, rounds)
    assert duchi.value == generic.value and duchi.kind == generic.kind == "upper"
    assert duchi.family == "blanket-duchi" and duchi.details["mechanism"] == "duchi"


@pytest.mark.parametrize(("eps0", "n", "epsilon", "rounds"), [
    (1.0, 1_000, 0.2, 1), (3.3204, 1_437, 0.8, 1), (6.0, 5_000, 2.0, 1), (2.0, 500, 1.0, 5),
])
def test_delta_equals_clones(eps0: float, n: int, epsilon: float, rounds: int) -> None:
    assert bounds.delta("blanket-duchi", eps0, n, epsilon, rounds).value == \
        bounds.delta("clones", eps0, n, epsilon, rounds).value


def test_uneven_rounds_the_accountant_and_renyi_equal_clones() -> None:
    events = [ShuffleRound(n=1_000, eps0=2.0)] * 3 + [ShuffleRound(n=700, eps0=2.5)] * 2
    assert bounds.epsilon_for_rounds("blanket-duchi", events, 1e-6).value == \
        bounds.epsilon_for_rounds("clones", events, 1e-6).value
    accountants = [ShuffleAccountant(1e-6, family=f) for f in ("blanket-duchi", "clones")]
    for acct in accountants:
        for event in events:
            acct.compose(event)
    assert accountants[0].epsilon().value == accountants[1].epsilon().value > 0
    assert bounds.renyi("blanket-duchi", 2.0, 1_000, 4.0).value == bounds.renyi("clones", 2.0, 1_000, 4.0).value


# ----------------------------------------------------- (2) the box-blanket pair, enumerated exactly in rationals


def _convolve(dist: dict[tuple[int, int, int], Fraction], step: Sequence[Fraction]) -> dict[tuple[int, int, int],
                                                                                              Fraction]:
    """Add one report whose symbol is H, L or N (non-blanket, revealed) with the probabilities ``step``."""
    out: dict[tuple[int, int, int], Fraction] = {}
    for counts, mass in dist.items():
        for symbol, p in enumerate(step):
            if p:
                key = tuple(c + (i == symbol) for i, c in enumerate(counts))
                out[key] = out.get(key, Fraction(0)) + mass * p
    return out


def box_blanket_delta(n: int, lo: Fraction, hi: Fraction, c: Fraction) -> Fraction:
    """The hockey-stick divergence H_c of the box-blanket pair for n reports, exactly.

    Corner law under the base omega: H = (a, b) = (hi, lo) and L = (lo, hi), probability 1/2 each (lo + hi = 2,
    so E a = E b = 1 and no (lo, lo) corner). The attacked report is drawn from omega reweighted by a (under x) or
    by b (under x'); each of the n - 1 others is a blanket draw of omega with probability lo (then H or L) and
    otherwise a non-blanket report the adversary is given (N). The view is the counts (#H, #L, #N).
    """
    assert lo + hi == 2 and 0 < lo < 1 < hi
    half = Fraction(1, 2)
    others: dict[tuple[int, int, int], Fraction] = {(0, 0, 0): Fraction(1)}
    for _ in range(n - 1):
        others = _convolve(others, (lo * half, lo * half, 1 - lo))
    p = _convolve(others, (half * hi, half * lo, Fraction(0)))
    q = _convolve(others, (half * lo, half * hi, Fraction(0)))
    return sum((max(p[k] - c * q.get(k, Fraction(0)), Fraction(0)) for k in p), Fraction(0))


@pytest.mark.parametrize("big_e", [Fraction(3), Fraction(7), Fraction(41, 2)])
@pytest.mark.parametrize("n", [1, 2, 5, 11])
@pytest.mark.parametrize("c", [Fraction(1), Fraction(3, 2), Fraction(5, 2)])
def test_the_box_blanket_pair_is_the_stronger_clone_pair(big_e: Fraction, n: int, c: Fraction) -> None:
    """For the box [2/(E+1), 2E/(E+1)] the enumerated delta at e^eps = c is the clone pair's at eps0 = ln E."""
    lo, hi = 2 / (big_e + 1), 2 * big_e / (big_e + 1)
    exact = box_blanket_delta(n, lo, hi, c)
    computed = clones.clone_delta(math.log(big_e), n, math.log(c), "stronger")
    assert computed == pytest.approx(float(exact), rel=RTOL, abs=1e-15)


def test_the_enumeration_tells_boxes_apart() -> None:
    """The check above can fail: a wider box (smaller blanket mass) gives a different, larger delta than the clone
    pair at the same eps0, and the FOCS pair (blanket mass e^-eps0) differs from the box pair."""
    big_e, n, c = Fraction(7), 5, Fraction(3, 2)
    clone = clones.clone_delta(math.log(big_e), n, math.log(c), "stronger")
    wider = box_blanket_delta(n, Fraction(1, 5), Fraction(9, 5), c)  # lo = 0.2 < 2/(E+1) = 0.25
    assert float(wider) > clone * (1 + 1e-3)
    assert clones.clone_delta(math.log(big_e), n, math.log(c), "focs") > clone * (1 + 1e-3)


# ------------------------------------------------------------ (3) the premise for the mechanism, and soundness


@pytest.mark.parametrize("eps0", [0.05, 1.0, 3.3204, 8.0, 30.0, 64.0])
def test_every_flip_probability_of_the_mechanism_lies_in_the_box(eps0: float) -> None:
    """The likelihood ratios 2p and 2(1-p) of a drawn bit against a fair bit lie in [2/(E+1), 2E/(E+1)] for a
    certified E <= e^eps0 (exact rationals), which is inside the box of eps0; the clamp keeps every p there."""
    big_e = exp_lower(eps0)
    lo, hi = 2 / (big_e + 1), 2 * big_e / (big_e + 1)
    p_lo, p_hi = (Fraction(v) for v in rr_interval(eps0))
    for p in (p_lo, p_hi):
        assert lo <= 2 * p <= hi and lo <= 2 * (1 - p) <= hi
    mech = DuchiMechanism(eps0, 1.0)
    for x in (-1.0, -0.3, 0.0, 0.7, 1.0, 1e300, -1e300, math.inf, -math.inf, math.nan):
        p = Fraction(mech.flip_probability(x))
        assert p_lo <= p <= p_hi


def _shuffled_delta(inputs: Sequence[float], other: Sequence[float], directions: Sequence[float], eps0: float,
                    eps: float) -> float:
    """Exact H_{e^eps} between the shuffled outputs (counts of (direction, bit)) of a Duchi-type randomizer on two
    data sets differing in the first input: seed = one of ``directions`` (angles, uniform), P[b = +1] =
    clamp(1/2 + x (p_hi - 1/2)) with x = cos(angle between input and direction) (unit inputs, clip 1)."""
    mech = DuchiMechanism(eps0, 1.0)
    k = len(directions)

    def law(angle: float) -> list[float]:
        out = []
        for z in directions:
            p = mech.flip_probability(math.cos(angle - z))
            out += [p / k, (1.0 - p) / k]
        return out

    def shuffled(first: float) -> dict[tuple[int, ...], float]:
        dist: dict[tuple[int, ...], float] = {(0,) * (2 * k): 1.0}
        for angle in (first, *other):
            step = law(angle)
            new: dict[tuple[int, ...], float] = {}
            for counts, mass in dist.items():
                for s, p in enumerate(step):
                    key = counts[:s] + (counts[s] + 1,) + counts[s + 1:]
                    new[key] = new.get(key, 0.0) + mass * p
            dist = new
        return dist

    p, q = shuffled(inputs[0]), shuffled(inputs[1])
    return sum(max(v - math.exp(eps) * q.get(key, 0.0), 0.0) for key, v in p.items())


@pytest.mark.parametrize("eps0", [1.0, 2.5])
def test_small_shuffled_duchi_instances_stay_below_the_family(eps0: float) -> None:
    directions = [0.0, 2.0 * math.pi / 3.0, 4.0 * math.pi / 3.0]
    n, worst = 4, 0.0
    pairs = [(0.0, math.pi), (0.0, math.pi / 2.0), (0.3, 2.0)]
    for (a, b), others in itertools.product(pairs, ([math.pi] * 3, [1.0, 2.0, 4.0], [0.0] * 3)):
        for eps in (0.0, 0.3, 0.8):
            exact = _shuffled_delta((a, b), others, directions, eps0, eps)
            family = bounds.delta("blanket-duchi", eps0, n, eps).value
            assert exact <= family + ROUNDOFF
            worst = max(worst, exact / family)
    assert worst > 0.2  # the instances are not trivially far below the bound
