"""Many rounds: every family answers in bounded memory or refuses, and no bound is reported that the numerics
cannot support (a lower bound that falls as rounds grow, an approximation below a proven lower bound)."""

from __future__ import annotations

import math

import pytest

from shuffledp.accounting import RefusedError, literature_rr
from shuffledp.accounting.bounds import epsilon, renyi


def test_no_shuffle_sums_a_window_beyond_two_million_rounds_and_stays_an_upper_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    windowed = literature_rr.no_shuffle_delta(1.0, 3_000_000, 1.38e6)
    monkeypatch.setattr(literature_rr, "NO_SHUFFLE_DIRECT_MAX", 10**9)
    direct = literature_rr.no_shuffle_delta(1.0, 3_000_000, 1.38e6)
    assert math.isclose(windowed, direct, rel_tol=1e-12)
    # the tail bound is what makes the window an upper bound: the Chernoff bound on the mass left out
    assert literature_rr._rr_binomial_tail_bound(3_000_000, 1.0, 0, 3_000_000) == 0.0
    assert 0.0 < literature_rr._rr_binomial_tail_bound(1000, 1.0, 200, 340) < 1.0


def test_a_billion_rounds_answer_without_allocating_per_round() -> None:
    """``np.arange(0, T + 1)`` needed 74.5 GiB at T = 1e10; the window needs a few million terms."""
    value = epsilon("no-shuffle", 1.0, 10_000, 1e-6, rounds=10**9).value
    assert 0.46e9 < value < 0.47e9  # about T eps0 tanh(eps0 / 2), the mean loss of randomized response


def test_rr_lower_refuses_rounds_its_grid_cannot_resolve() -> None:
    """It fell with T (68.7 at 1e6, 39.8 at 3e6, 0.0 at 1e7): where rounding each loss down may take more than
    the value itself, it refuses."""
    assert epsilon("rr-lower", 1.0, 10_000, 1e-6, rounds=10**5).value > 19.0
    for rounds in (10**6, 10**7):
        with pytest.raises(RefusedError, match=f"rr-lower cannot resolve {rounds} rounds"):
            epsilon("rr-lower", 1.0, 10_000, 1e-6, rounds=rounds)


def test_ccg_rdp_renyi_below_the_exact_lower_bound_is_refused() -> None:
    """0.477 against the exact rr-lower 3.21 at eps0 = 8, n = 1e5, order 8 (33.5 expected clones)."""
    lower = renyi("rr-lower", 8.0, 100_000, 8.0).value
    assert lower > 3.2
    with pytest.raises(RefusedError, match="below the exact Renyi divergence of shuffled binary randomized"):
        renyi("ccg-rdp", 8.0, 100_000, 8.0)
    assert renyi("ccg-rdp", 1.0, 100_000, 8.0).value > renyi("rr-lower", 1.0, 100_000, 8.0).value
    with pytest.raises(RefusedError, match="fewer than 1000"):
        renyi("ccg-rdp", 20.0, 10**8, 8.0)


def test_rr_lower_refuses_unresolved_heterogeneous_rounds_too() -> None:
    from shuffledp.accounting.bounds import epsilon_for_rounds
    from shuffledp.accounting.events import ShuffleRound

    few = [ShuffleRound(10_000, 1.0), ShuffleRound(12_000, 1.0)] * 50
    assert epsilon_for_rounds("rr-lower", few, 1e-6).value > 0
    many = [ShuffleRound(10_000, 1.0)] * 1_500_000 + [ShuffleRound(12_000, 1.0)] * 1_500_000
    with pytest.raises(RefusedError, match="rr-lower cannot resolve 3000000 rounds"):
        epsilon_for_rounds("rr-lower", many, 1e-6)


def test_a_long_uneven_run_checks_the_no_shuffle_cap_rarely(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap's check costs O(T) (no-shuffle's binomial sums over T rounds); it was done at every charge. Since
    no-shuffle's epsilon never decreases with more rounds, a check at twice the value covers the charges until the
    value doubles: over 200 uneven rounds a handful of checks, and the same values as epsilon_for_rounds."""
    import random

    from shuffledp.accounting import bounds, running
    from shuffledp.accounting.accountant import ShuffleAccountant
    from shuffledp.accounting.events import ShuffleRound

    calls = []
    real = running.lit.no_shuffle_delta
    monkeypatch.setattr(running.lit, "no_shuffle_delta", lambda *a: calls.append(a) or real(*a))
    rng = random.Random(3)
    acct = ShuffleAccountant(1e-6)
    for t in range(200):
        event = ShuffleRound(rng.randint(50_000, 200_000), 1.0)
        acct.would_exceed(event, 1e9)
        acct.compose(event)
        if t in (10, 199):
            assert acct.epsilon().value == bounds.epsilon_for_rounds("clones", acct.rounds, 1e-6).value
    assert len(calls) <= 20
