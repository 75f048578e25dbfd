"""Round-by-round composition (the accountant's default path) and the second-order discretisation of many rounds:
pessimistic against exact and independent compositions, grouping in the safe direction, exact checkpoints."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from scipy import fft as sfft

from shuffledp.accounting import RefusedError, bounds, clone_blocks, clone_spread, clones, heterogeneous
from shuffledp.accounting import literature as lit
from shuffledp.accounting import pld as P
from shuffledp.accounting import pld_spread as ps
from shuffledp.accounting.accountant import ShuffleAccountant
from shuffledp.accounting.cli import main
from shuffledp.accounting.clone_pld import _loss_support
from shuffledp.accounting.composition import pld_epsilon
from shuffledp.accounting.events import ShuffleRound

FFT_RTOL = 1e-9  # FFT round-off on a composed epsilon (relative), far below any discretisation effect
INCREMENTAL_RTOL = 3e-3  # clone blocks at their lowest c (+0.05%) and the first round's grid: the accountant vs exact
TIGHT_RTOL = 5e-3  # the acceptance: within 0.5% of an independent composition
BRACKET_RTOL = 0.10  # the acceptance: a bracket narrower than 10%
# n = 1e4, eps0 = 1, delta = 1e-6, T = 1e5: an independent PLD composition (dp_accounting, fine grid) brackets
# the clone pair's epsilon in [26.08, 26.38]
INDEPENDENT_T1E5 = (26.08, 26.38)


def _rr(eps: float) -> tuple[np.ndarray, np.ndarray]:
    return np.array([eps, -eps]), np.array([1.0 / (1.0 + math.exp(-eps)), 1.0 / (1.0 + math.exp(eps))])


@pytest.mark.parametrize("rounds", [1, 10, 100])
def test_spread_bounds_composed_randomized_response_from_above_and_the_hull_from_below(rounds: int) -> None:
    """Randomized response with eps = 0.7 off a grid of 0.03: point masses, the hardest case for both."""
    h, losses, probs = 0.03, *_rr(0.7)
    up = ps.to_pld(ps.spread_onto_grid(losses, probs, 0.0, h), h, pessimistic=True)
    down = ps.to_pld(ps.hull_onto_grid(losses, probs, h), h, pessimistic=False)
    if rounds > 1:
        up, down = P.compose([(up, rounds)]), P.compose([(down, rounds)])
    for eps in np.linspace(0.0, 0.7 * rounds, 15):
        exact = lit.no_shuffle_delta(0.7, rounds, float(eps))
        assert P.delta_for_epsilon(up, float(eps)) >= exact - 1e-12
        assert P.delta_for_epsilon(down, float(eps)) <= exact + 1e-12
    assert P.epsilon_for_delta(up, 1e-6) >= lit.no_shuffle_epsilon(0.7, rounds, 1e-6)


def test_spread_keeps_mass_and_q_mass_and_the_hull_stays_below_both() -> None:
    rng = np.random.default_rng(3)
    losses = rng.normal(0.0, 0.05, 2000)
    probs = rng.random(2000)
    probs /= probs.sum()
    h = 0.004
    lower, dense, inf = ps.spread_onto_grid(losses, probs, 1e-9, h)
    grid = (lower + np.arange(dense.size)) * h
    assert math.isclose(dense.sum() + inf, 1.0 + 1e-9, rel_tol=1e-12)
    assert math.isclose(float(np.dot(dense, np.exp(-grid))), float(np.dot(probs, np.exp(-losses))), rel_tol=1e-12)
    lower_o, dense_o, _ = ps.hull_onto_grid(losses, probs, h)
    grid_o = (lower_o + np.arange(dense_o.size)) * h
    assert dense_o.min() >= 0.0 and dense_o.sum() <= 1.0 + 1e-12
    for t in np.exp(-np.linspace(-0.2, 0.2, 41)):  # psi_o(t) <= psi(t) <= psi_s(t), psi(t) = E[(t - e^-L)_+]
        exact = float(np.dot(probs, np.maximum(t - np.exp(-losses), 0.0)))
        assert float(np.dot(dense_o, np.maximum(t - np.exp(-grid_o), 0.0))) <= exact + 1e-15
        assert float(np.dot(dense, np.maximum(t - np.exp(-grid), 0.0))) >= exact - 1e-15


def test_clone_blocks_group_clone_counts_downward_and_rounds_group_n_downward() -> None:
    """Fewer clones (fewer reports) = weaker amplification: every grouping goes down in c and in n."""
    c = np.array([0, 1, 999, 1000, 1001, 54_321, 10**6, 10**9 - 7], dtype=np.int64)
    j = clone_blocks.block_of(c)
    assert np.all(clone_blocks.block_start(j) <= c) and np.all(c < clone_blocks.block_start(j + 1))
    assert np.all(clone_blocks.block_start(j[c < 1000]) == c[c < 1000])  # below 1/width every c is its own block
    for n in (57_123, 123_457, 199_999):
        n_grid, eps0_grid = heterogeneous.dominating_round(n, 1.0, lower=False)
        assert n_grid <= n and eps0_grid >= 1.0
    # the block mixture of one round is above the exact single-round epsilon, and within a small margin of it
    for n in (50, 10_000, 123_457):
        h = 2.0 ** math.floor(math.log2(clones.clone_loss_moments(1.0, n)[1] / 24))
        value = P.epsilon_for_delta(ps.to_pld(clone_blocks.round_pld(1.0, n, "stronger", h), h, pessimistic=True), 1e-6)
        exact = clones.clone_epsilon(1.0, n, 1e-6)
        assert exact <= value <= exact * (1 + INCREMENTAL_RTOL)


def _uneven_rounds(count: int, seed: int) -> list[ShuffleRound]:
    rng = random.Random(seed)
    ns = [rng.randint(50_000, 200_000) for _ in range(4)]
    return [ShuffleRound(rng.choice(ns), 1.0) for _ in range(count)]


def test_incremental_accountant_is_above_an_exact_from_scratch_composition_and_close_to_it() -> None:
    history = _uneven_rounds(12, seed=1)
    acct = ShuffleAccountant(1e-6)
    for event in history:
        acct.compose(event)
    got = acct.epsilon()
    assert got.details["method"] == "pld, composed round by round"
    counts: dict[int, int] = {}
    for r in history:
        counts[r.n] = counts.get(r.n, 0) + 1
    items = [(n, 1.0, c) for n, c in counts.items()]
    exact_up, h = clone_spread.heterogeneous_clone_pld(items, "stronger")  # every n's own support, no blocks
    exact = pld_epsilon(exact_up, 1e-6)
    lower = P.compose([(clone_spread.spread_clone_pld(1.0, n, "stronger", h, False), c) for n, _, c in items])
    assert pld_epsilon(lower, 1e-6, lower=True) <= got.value
    assert exact * (1 - FFT_RTOL) <= got.value <= exact * (1 + INCREMENTAL_RTOL)
    assert got.value == bounds.epsilon_for_rounds("clones", history, 1e-6).value  # same composition from scratch


def test_checkpoint_replay_rebuilds_the_composed_distribution_bit_for_bit() -> None:
    history = _uneven_rounds(30, seed=2)
    one_by_one = ShuffleAccountant(1e-6)
    for event in history:
        one_by_one.would_exceed(event, 10.0)
        one_by_one.compose(event)
    value = one_by_one.epsilon().value
    grouped = ShuffleAccountant(1e-6)  # runs of equal rounds composed with count=: the same canonical composition
    i = 0
    while i < len(history):
        j = i
        while j < len(history) and history[j] == history[i]:
            j += 1
        grouped.compose(history[i], count=j - i)
        i = j
    assert grouped.epsilon().value == value
    clones.clear_caches()
    clone_blocks.clear_block_cache()  # a fresh process: nothing cached
    restored = ShuffleAccountant.from_state_dict(json.loads(json.dumps(one_by_one.state_dict())))
    assert restored.epsilon().value == value
    assert restored.epsilon(1e-9).value == one_by_one.epsilon(1e-9).value
    before = restored.state_dict()  # the server's rollback after a failed ledger write
    restored.compose(ShuffleRound(77_777, 1.0))
    assert restored.epsilon().value > value
    restored.load_state_dict(before)
    assert restored.epsilon().value == value


def _independent_bracket(eps0: float, n: int, delta: float, rounds: int, h: float) -> tuple[float, float]:
    """The clone pair's composed epsilon by a plain circular FFT power of the exact losses rounded down and up onto
    the grid h (a window of 13 standard deviations around the composed mean; no code of the package's PLD layer)."""
    out = []
    for pessimistic in (False, True):
        losses, probs, inf = _loss_support(eps0, n, "stronger", pessimistic)
        keep = np.isfinite(losses)
        losses, probs = losses[keep], probs[keep]
        idx = (np.ceil if pessimistic else np.floor)(losses / h).astype(np.int64)
        mean = float(np.dot(losses, probs))
        sd = math.sqrt(float(np.dot((losses - mean) ** 2, probs)))
        half = int(13.0 * math.sqrt(rounds) * sd / h) + rounds  # + rounding: at most one step per round
        centre = int(round(rounds * mean / h))
        size = sfft.next_fast_len(2 * half + 1, real=True)
        start = centre - half
        single = np.bincount(np.mod(idx, size), weights=probs, minlength=size)
        composed = np.maximum(sfft.irfft(sfft.rfft(single) ** rounds, size), 0.0)
        grid = np.arange(start, start + size)
        composed = composed[np.mod(grid, size)]
        grid_l = grid * h
        inf_total = -math.expm1(rounds * math.log1p(-inf)) if pessimistic else 0.0

        def delta_at(e: float, grid_l: np.ndarray = grid_l, composed: np.ndarray = composed,
                     inf_total: float = inf_total) -> float:
            m = grid_l > e
            return inf_total + float(np.dot(-np.expm1(e - grid_l[m]), composed[m]))

        lo, hi = 0.0, float(grid_l[-1])
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if delta_at(mid) > delta else (lo, mid)
        out.append(hi)
    return out[0], out[1]


@pytest.mark.parametrize(("rounds", "h"), [(1_000, 2e-6), (10_000, 4e-6)])
def test_many_rounds_match_an_independent_composition(rounds: int, h: float) -> None:
    low, high = _independent_bracket(1.0, 10_000, 1e-6, rounds, h)
    value = bounds.epsilon("clones", 1.0, 10_000, 1e-6, rounds=rounds).value
    assert low <= value <= high * (1 + FFT_RTOL)
    assert abs(value / (0.5 * (low + high)) - 1.0) <= TIGHT_RTOL


def test_a_hundred_thousand_rounds_sit_inside_the_independent_bracket() -> None:
    """27.17 (+3-4%) on a grid capped at 2^22 points rounding every loss up; the spread is second order."""
    value = bounds.epsilon("clones", 1.0, 10_000, 1e-6, rounds=100_000).value
    low, high = INDEPENDENT_T1E5
    assert low <= value <= high
    assert abs(value / (0.5 * (low + high)) - 1.0) <= TIGHT_RTOL
    bracket = bounds.epsilon_bracket("clones", 1.0, 10_000, 1e-6, 100_000)
    assert bracket.lower <= value <= bracket.upper * (1 + FFT_RTOL)


@pytest.mark.parametrize("rounds", [10**6, 10**7])
def test_the_bracket_stays_narrow_up_to_ten_million_rounds(rounds: int) -> None:
    """[0, 2772.8] at T = 1e7 before; the composed epsilon there is about 983."""
    bracket = bounds.epsilon_bracket("clones", 1.0, 10_000, 1e-6, rounds)
    assert 0.0 < bracket.lower <= bracket.upper <= bracket.lower * (1 + BRACKET_RTOL)
    assert bracket.upper <= bracket.lower * (1 + 2e-3)  # measured: 0.07% and 0.09%
    if rounds == 10**7:
        assert 975.0 < bracket.lower and bracket.upper < 990.0


def test_rounds_the_grid_cannot_resolve_are_refused_with_a_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RefusedError, match="clones cannot resolve 1000000000 rounds"):
        bounds.epsilon("clones", 1.0, 10_000, 1e-6, rounds=10**9)
    with pytest.raises(RefusedError, match="clones cannot resolve"):
        bounds.epsilon_bracket("clones", 1.0, 10_000, 1e-6, 10**9)
    code = main(["account", "epsilon", "--eps0", "1", "--n", "10000", "--delta", "1e-6", "--rounds", "1000000000",
                 "--json"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and "clones cannot resolve" in captured.err
