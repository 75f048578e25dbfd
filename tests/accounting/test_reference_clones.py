"""Reference values for the clone-pair accounting (docs: shared reference file accounting_values.md).

The values were computed independently of this code (exact sums over the clone-pair support in log
space, cross-checked against three public implementations). Exact single-round quantities must agree to
a relative EXACT_RTOL; PLD-composed epsilons must lie in the published [optimistic, pessimistic] bracket,
the pessimistic one at most COMPOSED_SLACK above its upper end.
"""

from __future__ import annotations

import pytest

from shuffledp.accounting import clones

#: Relative tolerance for exact single-round values (issue 2 acceptance).
EXACT_RTOL = 1e-6
#: How far above the reference bracket a pessimistic composed epsilon may lie (issue 2: 0.5%).
COMPOSED_SLACK = 0.005


@pytest.mark.parametrize(
    ("variant", "n", "eps0", "delta", "expected"),
    [
        ("stronger", 10_000, 2.0, 1e-6, 0.1143996153),
        ("focs", 10_000, 2.0, 1e-6, 0.1550452425),
        ("focs", 100_000, 4.0, 1e-6, 0.1697697473),
        ("stronger", 1_000_000, 1.0, 1e-8, 0.005011620846),
        ("stronger", 1_000, 4.0, 1e-5, 1.498244341),
    ],
)
def test_exact_single_round_epsilon(variant, n, eps0, delta, expected):
    got = clones.clone_epsilon(eps0, n, delta, variant)
    assert got == pytest.approx(expected, rel=EXACT_RTOL)


def test_exact_delta_at_epsilon():
    got = clones.clone_delta(2.0, 10_000, 0.1, "stronger")
    assert got == pytest.approx(6.021292672e-06, rel=EXACT_RTOL)


def test_exact_epsilon_inverts_exact_delta():
    eps = clones.clone_epsilon(2.0, 10_000, 1e-6, "stronger")
    assert clones.clone_delta(2.0, 10_000, eps, "stronger") == pytest.approx(1e-6, rel=1e-9)


@pytest.mark.parametrize(
    ("variant", "n", "eps0", "order", "expected"),
    [
        ("focs", 10_000, 1.0, 2.0, 2.322115839e-4),
        ("stronger", 10_000, 1.0, 2.0, 1.588158093e-4),
        ("stronger", 10_000, 1.0, 64.0, 5.082161068e-3),
        # naive logsumexp gives 3.944e-7 here: the excess over 1 must be summed without cancellation
        ("focs", 1_000_000, 0.5, 2.0, 3.955952179e-7),
    ],
)
def test_exact_renyi(variant, n, eps0, order, expected):
    got = clones.clone_renyi(eps0, n, order, variant)
    assert got == pytest.approx(expected, rel=EXACT_RTOL)


@pytest.mark.parametrize(
    ("n", "eps0", "delta", "rounds", "bracket"),
    [
        (100_000, 1.0, 1e-6, 100, (0.1483732, 0.1485597)),
        (10_000, 2.0, 1e-6, 1000, (4.809818, 4.814653)),
    ],
)
def test_pld_composed_inside_reference_bracket(n, eps0, delta, rounds, bracket):
    ref_lo, ref_hi = bracket
    pess = clones.clone_epsilon_composed(eps0, n, delta, rounds, "stronger", pessimistic=True)
    opt = clones.clone_epsilon_composed(eps0, n, delta, rounds, "stronger", pessimistic=False)
    # our upper bound is above the true value, hence above the reference lower end ...
    assert pess >= ref_lo
    # ... and at most COMPOSED_SLACK above the reference upper end
    assert pess <= ref_hi * (1.0 + COMPOSED_SLACK)
    # our lower bound is below the true value, hence below the reference upper end ...
    assert opt <= ref_hi
    # ... and not uselessly loose
    assert opt >= ref_lo * (1.0 - COMPOSED_SLACK)
    assert opt <= pess


def test_baseline_agrees_with_fast_exact():
    fast = clones.clone_epsilon(2.0, 10_000, 1e-6, "stronger")
    base = clones.clone_epsilon_baseline(2.0, 10_000, 1e-6, "stronger")
    assert base == pytest.approx(fast, rel=1e-9)
    assert base == pytest.approx(0.1143996153, rel=EXACT_RTOL)
