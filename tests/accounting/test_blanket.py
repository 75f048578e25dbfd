"""``blanket-laplace``: cross-checks against exact enumeration of tiny shuffled instances, against ``clones``, the
reference points, monotonicity, the blanket mass of the real randomizer, and the CLI's restriction line."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from shuffledp.accounting import blanket, bounds, clones, loss_stream
from shuffledp.accounting.cli import main as cli_main
from shuffledp.accounting.core import RefusedError

#: Output range [-R, R] per coordinate of the exact enumerations; outside it the brute force drops mass, so its
#: delta is a lower bound on the instance's exact delta (the comparison stays in the safe direction).
BRUTE_RANGE_1D = 45
BRUTE_RANGE_2D = 18
#: Slack allowed when comparing the family's value with a quantity it must dominate (float round-off only).
ROUNDOFF = 1e-12


def _dl_pmf(center: np.ndarray, t: float, r: int) -> np.ndarray:
    """Discrete Laplace pmf on [-r, r]^d (product over coordinates) centred at the integer vector ``center``."""
    axis = np.arange(-r, r + 1)
    out = np.ones(())
    for c in center:
        p = (1.0 - t) / (1.0 + t) * t ** np.abs(axis - c)
        out = np.multiply.outer(out, p)
    return out.ravel()


def _shuffled(pmfs: list[np.ndarray]) -> np.ndarray:
    """The pmf of the reports in a uniformly random order (a sufficient statistic for the multiset)."""
    total = None
    perms = list(itertools.permutations(range(len(pmfs))))
    for perm in perms:
        term = pmfs[perm[0]]
        for i in perm[1:]:
            term = np.multiply.outer(term, pmfs[i])
        total = term if total is None else total + term
    return total.ravel() / len(perms)


def _hockey(p: np.ndarray, q: np.ndarray, eps: float) -> float:
    return float(np.maximum(p - math.exp(eps) * q, 0.0).sum())


def _brute_delta(eps0: float, k: int, d: int, r: int, x1, x1p, others, eps: float) -> float:
    """Exact (truncated) hockey-stick divergence, both directions, of the shuffled discrete Laplace instance."""
    t = math.exp(-eps0 / (2 * k))
    rest = [_dl_pmf(np.array(o), t, r) for o in others]
    p = _shuffled([_dl_pmf(np.array(x1), t, r), *rest])
    q = _shuffled([_dl_pmf(np.array(x1p), t, r), *rest])
    return max(_hockey(p, q, eps), _hockey(q, p, eps))


@pytest.mark.parametrize(
    ("x1", "x1p", "others"),
    [((2,), (-2,), [(0,), (0,)]), ((2,), (-2,), [(2,), (-2,)]), ((2,), (0,), [(-2,), (-2,)]),
     ((1,), (-1,), [(2,), (2,)]), ((2,), (1,), [(-1,), (0,)])],
)
def test_dominates_exact_one_dimensional_instances(x1, x1p, others) -> None:
    """n = 3 reports, K = 2, eps0 = 2: the family's delta is above the exact delta of every listed instance."""
    eps0, n = 2.0, 3
    for eps in (0.25, 0.75, 1.25):
        exact = _brute_delta(eps0, 2, 1, BRUTE_RANGE_1D, x1, x1p, others, eps)
        assert blanket.blanket_delta(eps0, n, eps) >= exact - ROUNDOFF


@pytest.mark.parametrize(
    ("x1", "x1p", "other"),
    [((1, 0), (0, 1), (0, -1)), ((1, 0), (-1, 0), (0, 1)), ((1, 0), (0, -1), (-1, 0))],
)
def test_dominates_exact_two_dimensional_instances(x1, x1p, other) -> None:
    """d = 2, K = 1, n = 2, eps0 = 2 (the first is the issue's cross move: +e1 -> +e2, the other at -e2)."""
    eps0, n = 2.0, 2
    for eps in (0.25, 0.75, 1.25):
        exact = _brute_delta(eps0, 1, 2, BRUTE_RANGE_2D, x1, x1p, [other], eps)
        assert blanket.blanket_delta(eps0, n, eps) >= exact - ROUNDOFF


def test_one_dimension_k1_is_the_dominating_pair_itself() -> None:
    """With K = 1 the corner law is the mechanism's own law: the antipodal instance with the others at the
    centre comes close to the family (it reveals nothing about which reports are blanket, so it is below)."""
    eps0, n, eps = 2.0, 3, 0.5
    exact = _brute_delta(eps0, 1, 1, BRUTE_RANGE_1D, (1,), (-1,), [(0,), (0,)], eps)
    value = blanket.blanket_delta(eps0, n, eps)
    assert exact - ROUNDOFF <= value <= 3.0 * exact


def test_reference_points() -> None:
    """The issue's two reference points: corner-spread values, ratios to clones, above the proven floor 0.827."""
    one = blanket.blanket_epsilon(4.0, 1437, 1e-6)
    assert one == pytest.approx(1.2124, abs=2e-4)
    assert 0.827 <= one <= 0.90 * clones.clone_epsilon(4.0, 1437, 1e-6)
    two = blanket.blanket_epsilon(6.0, 5000, 1e-8)
    assert two == pytest.approx(3.5514, abs=2e-4)
    assert two <= 0.6 * clones.clone_epsilon(6.0, 5000, 1e-8)


@pytest.mark.parametrize("eps0", [0.5, 2.0, 4.0, 6.0])
@pytest.mark.parametrize("n", [2, 50, 400])
def test_at_most_clones(eps0: float, n: int) -> None:
    value = blanket.blanket_epsilon(eps0, n, 1e-6)
    assert value <= clones.clone_epsilon(eps0, n, 1e-6) + ROUNDOFF


def test_monotone_in_n_and_rounds() -> None:
    values = [blanket.blanket_epsilon(4.0, n, 1e-6) for n in (100, 200, 400, 800)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    composed = [bounds.epsilon("blanket-laplace", 4.0, 1437, 1e-6, t).value for t in (1, 2, 5, 10)]
    assert all(a <= b for a, b in zip(composed, composed[1:]))


def test_composed_single_round_is_pessimistic_and_close() -> None:
    from shuffledp.accounting import composition

    exact = blanket.blanket_epsilon(4.0, 1437, 1e-6)
    pld, _ = blanket.composed_blanket_pld([(1437, 4.0, 1)])
    via_pld = composition.pld_epsilon(pld, 1e-6)
    assert exact - 1e-9 <= via_pld <= exact * (1.0 + 1e-3)


def test_heterogeneous_rounds_between_their_uniform_bounds() -> None:
    lo = bounds.epsilon("blanket-laplace", 4.0, 2000, 1e-6, 4).value
    hi = bounds.epsilon("blanket-laplace", 4.0, 1000, 1e-6, 4).value
    from shuffledp.accounting.events import ShuffleRound

    rounds = [ShuffleRound(n=1000, eps0=4.0), ShuffleRound(n=2000, eps0=4.0)] * 2
    mixed = bounds.epsilon_for_rounds("blanket-laplace", rounds, 1e-6).value
    assert lo - 1e-9 <= mixed <= hi + 1e-9


def test_blanket_mass_of_the_real_randomizer() -> None:
    """inf_q P_q(y) = t^K P_0(y) over the integer L1 ball (checked by enumeration, d = 2, K = 2), and the
    randomizer's t^K = e^{-eps_used/2} is at least the e^{-eps0/2} the family assumes."""
    from shuffledp.clients.randomizer import DiscreteLaplaceRandomizer

    rnd = DiscreteLaplaceRandomizer(4.0, 2.0, log2_grid=0)
    k = rnd.radius
    log_t = -rnd.noise_num / 2.0**rnd.noise_log2_den
    assert k == 2 and k * log_t >= -2.0 - ROUNDOFF
    ball = [q for q in itertools.product(range(-k, k + 1), repeat=2) if abs(q[0]) + abs(q[1]) <= k]
    for y in itertools.product(range(-4, 5), repeat=2):
        worst = max(sum(abs(a - b) for a, b in zip(y, q)) - sum(abs(a) for a in y) for q in ball)
        assert worst == k  # log(inf_q P_q(y) / P_0(y)) = k log t
    assert blanket.blanket_mass(rnd.eps_used) >= blanket.blanket_mass(4.0)


def test_cli_states_the_restriction(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["account", "epsilon", "--bound", "blanket-laplace", "--eps0", "4", "--n", "1437",
                     "--delta", "1e-6"])
    assert code == 0
    text = capsys.readouterr().out
    assert "holds_only_for" in text and "discrete Laplace randomizer" in text


@pytest.mark.parametrize(("eps0", "n"), [(3.4434, 1437), (1.0, 200)])
def test_streamed_spread_is_the_general_spread_bit_for_bit(eps0: float, n: int) -> None:
    from shuffledp.accounting import pld_spread

    losses, probs, infinity = blanket.blanket_loss_support(eps0, n)
    extent = (float(losses.min()), float(losses.max()))
    assert blanket._summary(eps0, n, None)[1:] == (extent, infinity)
    for h in (2.71e-5, 3.25e-4, 0.0137):
        ref_lower, ref_dense, ref_inf = pld_spread.spread_onto_grid(losses, probs, infinity, h)
        for lower, dense, inf in (blanket._spread_dense(eps0, n, h, None),
                                  loss_stream.spread([(losses, probs)], infinity, h, extent)):
            assert (lower, inf) == (ref_lower, ref_inf)
            assert np.array_equal(dense, ref_dense)


def test_moments_of_the_chunks_are_those_of_the_support() -> None:
    """Chunk statistics merged (Chan et al.) against the whole support's two-pass moments: round-off apart."""
    losses, probs, _ = blanket.blanket_loss_support(2.0, 500)
    tot = float(probs.sum())
    mean = float(np.dot(losses, probs) / tot)
    sd = math.sqrt(max(float(np.dot((losses - mean) ** 2, probs) / tot), 0.0))
    got = blanket.blanket_loss_moments(2.0, 500)
    assert got[0] == pytest.approx(mean, rel=1e-13) and got[1] == pytest.approx(sd, rel=1e-13)
    assert blanket.blanket_loss_moments(2.0, 500) == got  # the cached value


def _sorted_epsilon(eps0: float, n: int, delta: float) -> float:
    """The single-round epsilon on the sorted whole support (bisection on suffix sums, then the checked step-up
    with the direct non-negative sum): the reference the streamed computation must meet."""
    losses, probs, infinity = blanket.blanket_loss_support(eps0, n)
    order = np.argsort(losses, kind="stable")
    losses, probs = losses[order], probs[order]
    tail_p = np.r_[np.cumsum(probs[::-1])[::-1], 0.0]
    tail_q = np.r_[np.cumsum((probs * np.exp(-losses))[::-1])[::-1], 0.0]

    def direct(eps: float) -> float:
        i = int(np.searchsorted(losses, eps, side="right"))
        return min(1.0, infinity + float(np.dot(probs[i:], -np.expm1(eps - losses[i:]))))

    def fast(eps: float) -> float:
        i = int(np.searchsorted(losses, eps, side="right"))
        return infinity + float(tail_p[i]) - math.exp(eps) * float(tail_q[i])

    if direct(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, float(losses[-1])
    while hi - lo > 0.25 * blanket.BLANKET_EPSILON_RTOL * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if fast(mid) <= delta else (mid, hi)
    while direct(hi) > delta:
        hi += 0.25 * blanket.BLANKET_EPSILON_RTOL * hi
    return hi


@pytest.mark.parametrize(("eps0", "n"), [(0.5, 50), (2.0, 500), (3.4434, 1437), (6.0, 5000)])
def test_streamed_single_round_is_the_sorted_one(eps0: float, n: int) -> None:
    """Bins, then one bin's points: epsilon within BLANKET_EPSILON_RTOL of the sorted support's, delta within
    round-off of its direct sum (the support is 1e4 to 3e6 points here)."""
    losses, probs, infinity = blanket.blanket_loss_support(eps0, n)
    for delta in (1e-5, 1e-8, 1e-10):
        got, ref = blanket.blanket_epsilon(eps0, n, delta), _sorted_epsilon(eps0, n, delta)
        assert abs(got - ref) <= blanket.BLANKET_EPSILON_RTOL * ref
        assert blanket.blanket_delta(eps0, n, got) <= delta
        for eps in (0.0, 0.5 * got, got, 1.7 * got):
            above = losses > eps
            direct = infinity + float(np.dot(probs[above], -np.expm1(eps - losses[above])))
            assert blanket.blanket_delta(eps0, n, eps) == pytest.approx(direct, rel=1e-12, abs=1e-300)


def test_bins_split_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """Few bins and a small cap force splits (two levels and more): the same values."""
    eps0, n = 2.0, 500
    want = [(blanket.blanket_epsilon(eps0, n, d), blanket.blanket_delta(eps0, n, 0.3)) for d in (1e-6, 1e-9)]
    blanket._scan.cache_clear()
    monkeypatch.setattr(loss_stream, "BINS", 16)
    monkeypatch.setattr(loss_stream, "BIN_POINTS", 40)
    try:
        got = [(blanket.blanket_epsilon(eps0, n, d), blanket.blanket_delta(eps0, n, 0.3)) for d in (1e-6, 1e-9)]
    finally:
        blanket._scan.cache_clear()
    for (e_want, d_want), (e_got, d_got) in zip(want, got):
        assert abs(e_got - e_want) <= blanket.BLANKET_EPSILON_RTOL * e_want
        assert d_got == pytest.approx(d_want, rel=1e-12)


def test_the_support_is_never_held() -> None:
    """Single round and composition at n = 500, eps0 = 2 (2.8 M support points, 44 MB as two arrays): the traced
    peak stays well below that (rows, bins, grid, one chunk's temporaries; about 15 MB, most of it the PLD's)."""
    import tracemalloc

    eps0, n = 2.0, 500
    blanket.composed_blanket_pld([(50, eps0, 3)])  # the imports, outside the trace
    for cached in (blanket._blocks, blanket._scan, blanket._summary, blanket._spread_pld):
        cached.cache_clear()
    tracemalloc.start()
    try:
        blanket.blanket_epsilon(eps0, n, 1e-6)
        single, _ = tracemalloc.get_traced_memory()[1], tracemalloc.reset_peak()
        blanket.composed_blanket_pld([(n, eps0, 3)])
        composed = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert single < 8 * 2**20 and composed < 24 * 2**20, (single, composed)


def _clear_blanket_caches() -> None:
    for value in vars(blanket).values():
        if hasattr(value, "cache_clear"):
            value.cache_clear()


def test_a_support_over_the_limit_is_coarsened_pessimistically(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wider blocks of s and cells of lam (forced here by a limit 40x below the support's size, so the widest
    blocks) can only raise epsilon, here by under 3%."""
    exact = blanket.blanket_epsilon(4.0, 1437, 1e-6)
    _clear_blanket_caches()
    monkeypatch.setattr(blanket, "BLANKET_EXACT_SUPPORT", 10_000)
    monkeypatch.setattr(blanket, "BLANKET_MAX_SUPPORT", 150_000)
    try:
        coarse = blanket.blanket_epsilon(4.0, 1437, 1e-6)
        blocks, _ = blanket._blocks(4.0, 1437, None)  # pylint: disable=protected-access
        assert sum(b.r.size * (2 * blanket._h_half(b.s0) + 1) for b in blocks if b.below is not None) <= 150_000
        monkeypatch.setattr(blanket, "BLANKET_MAX_SUPPORT", 1_000)
        _clear_blanket_caches()
        with pytest.raises(RefusedError, match="support points"):
            blanket.blanket_epsilon(4.0, 1437, 1e-6)
    finally:
        _clear_blanket_caches()
    assert exact < coarse <= 1.03 * exact
