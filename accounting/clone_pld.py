"""Privacy loss distributions of the clone pairs, their composition, and the straightforward baseline (the
reduction is described in :mod:`shuffledp.accounting.clones`)."""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import optimize, stats

from shuffledp.accounting import pld as _pld
from shuffledp.accounting.clone_pair import (
    CHUNK_ELEMENTS,
    EPSILON_RTOL,
    INTERVAL_RELATIVE_ERROR,
    MAX_COMPOSED_GRID,
    MIN_COMPOSED_GRID,
    PLD_BLOCK_RELATIVE_WIDTH,
    PLD_TAIL_MASS_TRUNCATION,
    PLD_WINDOW_DROP,
    Variant,
    _c_distribution,
    _delta_per_c,
    _one_minus_2w,
    _outside_x_window,
    _params,
    _x_window,
    check_variant,
)
from shuffledp.accounting.pld import PrivacyLossDistribution
from shuffledp.accounting.validation import check_delta, check_eps0, check_n, check_rounds

__all__ = [
    "clone_pld",
    "clone_epsilon_composed",
    "suggested_interval",
    "round_interval",
    "clone_loss_moments",
    "clone_epsilon_baseline",
]


# ----------------------------------------------------------------------------------------------------
# privacy loss distribution


@functools.lru_cache(maxsize=32)
def _loss_support(eps0: float, n: int, variant: str, pessimistic: bool):
    """Exact losses and P-masses of a (blocked, truncated) pair dominating / dominated by the clone pair.

    Rigorous construction (see module docstring for the monotonicity in c):

    * C outside its window (log-mass drop ``PLD_WINDOW_DROP``): pessimistic -> lower tail to infinity
      mass, upper tail to the last block (whose representative has fewer clones); optimistic -> lower
      tail to the first block (whose representative has more clones), upper tail dropped.
    * C inside the window is cut into blocks of relative width ``PLD_BLOCK_RELATIVE_WIDTH``; every c in
      a block is replaced by the block's lowest c (pessimistic: a dominating pair) or highest c
      (optimistic: a dominated pair).
    * For a representative c, X outside its window: pessimistic -> mass below goes to the lowest kept
      loss (rounding up), mass above to infinity; optimistic -> mass below dropped, mass above to the
      highest kept loss (rounding down).

    Returns ``(losses, probs, infinity_mass)`` as float arrays sorted by loss (not yet on a grid).
    """
    w, _, _ = _params(eps0, variant)
    one_m2w = _one_minus_2w(eps0)
    c, pmf, lo_tail, hi_tail = _c_distribution(n, eps0, variant, PLD_WINDOW_DROP)
    width = max(1, int(math.floor(PLD_BLOCK_RELATIVE_WIDTH * max(1, int(c[-1])))))
    starts = np.arange(0, c.size, width)
    block_mass = np.add.reduceat(pmf, starts)
    if pessimistic:
        reps = c[starts]
        block_mass[-1] += hi_tail
        infinity = lo_tail
    else:
        ends = np.minimum(starts + width, c.size) - 1
        reps = c[ends]
        block_mass[0] += lo_tail
        infinity = 0.0
    keep = block_mass > 0.0
    reps, block_mass = reps[keep], block_mass[keep]
    all_l, all_p = [], []
    m_max = int(reps.max()) + 1
    half = int(math.ceil(math.sqrt(2.0 * PLD_WINDOW_DROP) * 0.5 * math.sqrt(m_max) + 10))
    half = min(half, m_max // 2 + 2)
    offsets = np.arange(-half, half + 1, dtype=np.float64)
    rows = max(1, CHUNK_ELEMENTS // offsets.size)
    for start in range(0, reps.size, rows):
        cr = reps[start : start + rows]
        mass = block_mass[start : start + rows]
        m = cr.astype(np.float64)[:, None] + 1.0
        xc, valid, probs, losses = _x_window(m, offsets, w, one_m2w)
        # exact P-masses outside the window: X = A + D, A ~ Bin(c, 1/2), D ~ Bern(1 - w)
        x_lo = np.maximum(xc[:, 0] - half, 0.0)
        x_hi = np.minimum(xc[:, 0] + half, m[:, 0])
        below, above = _outside_x_window(cr, x_lo, x_hi, w)
        probs *= ((1.0 - below - above) / probs.sum(axis=1))[:, None]
        first = np.argmax(valid, axis=1)
        last = valid.shape[1] - 1 - np.argmax(valid[:, ::-1], axis=1)
        rr = np.arange(cr.size)
        if pessimistic:
            probs[rr, first] += below
            infinity += float(np.dot(mass, above))
        else:
            probs[rr, last] += above
        probs *= mass[:, None]
        all_l.append(losses[valid])
        all_p.append(probs[valid])
    losses = np.concatenate(all_l)
    probs = np.concatenate(all_p)
    order = np.argsort(losses, kind="stable")  # sorted once here, cached; later sorts are linear
    return losses[order], probs[order], float(infinity)


def clone_loss_moments(eps0: float, n: int, variant: Variant = "stronger") -> tuple[float, float]:
    """Mean (the KL divergence) and standard deviation of the privacy loss of the (pessimistic) pair.

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        variant: ``"stronger"`` or ``"focs"`` (the clone pair).

    Returns:
        ``(mean, standard deviation)``.
    """
    eps0 = check_eps0(eps0)
    n = check_n(n)
    variant = check_variant(variant)
    losses, probs, _ = _loss_support(eps0, n, variant, True)
    # Losses of -inf (P-mass where the log-ratio underflows, only at very large eps0) carry no
    # hockey-stick mass; the moments (used only to size the grid) are those of the finite part.
    finite = np.isfinite(losses)
    losses, probs = losses[finite], probs[finite]
    tot = probs.sum()
    mean = float(np.dot(losses, probs) / tot)
    var = float(np.dot((losses - mean) ** 2, probs) / tot)
    return mean, math.sqrt(var)


def suggested_interval(
    eps0: float, n: int, rounds: int = 1, variant: Variant = "stronger"
) -> float:
    """Grid interval for a PLD that will be composed ``rounds`` times.

    Rounding each loss up by less than ``h`` shifts the composed loss by less than ``T h`` (so the
    pessimistic epsilon is at most ``T h`` above the undiscretised one, about ``T h / 2`` on average).
    With ``m1`` the mean (KL) and ``s1`` the standard deviation of one round's loss, the composed epsilon
    is at least ``T m1 + 2 sqrt(T) s1`` for any delta <= 0.02, so
    ``h = INTERVAL_RELATIVE_ERROR * (m1 + 2 s1 / sqrt(T))`` keeps the discretisation error below
    ``INTERVAL_RELATIVE_ERROR`` (0.4%; the typical excess is half of it, as rounding up adds ``h/2`` per
    round on average) relative. ``h`` is then enlarged if needed so the composed grid (the Chernoff
    window of the composition is about ``T m1 + 17 sqrt(T) s1`` wide) stays below ``MAX_COMPOSED_GRID``
    points, and reduced if the grid would have fewer than ``MIN_COMPOSED_GRID`` points (cheap, and it
    keeps the error small when delta is close to the total variation distance, where epsilon is small
    compared with ``s1``: e.g. 2e-4 relative at T = 1, n = 1e6, eps0 = 0.5, delta = 1e-4). The value
    is rounded down to 3 significant digits so it can serve as a cache key.

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        rounds: number of rounds T >= 1.
        variant: ``"stronger"`` or ``"focs"`` (the clone pair).

    Returns:
        The interval (3 significant digits).
    """
    eps0 = check_eps0(eps0)
    n = check_n(n)
    rounds = check_rounds(rounds)
    variant = check_variant(variant)
    m1, s1 = clone_loss_moments(eps0, n, variant)
    t = float(rounds)
    width = t * m1 + 18.0 * math.sqrt(t) * s1
    h = min(INTERVAL_RELATIVE_ERROR * (m1 + 2.0 * s1 / math.sqrt(t)), width / MIN_COMPOSED_GRID)
    h = max(h, width / MAX_COMPOSED_GRID)
    if not (h > 0.0 and math.isfinite(h)):
        raise ValueError(f"cannot choose a grid interval for eps0={eps0}, n={n}: loss moments {m1}, {s1}")
    return round_interval(h, up=False)  # never coarser than the bounds above allow


def round_interval(h: float, *, up: bool) -> float:
    """A grid interval ``h`` rounded to 3 significant digits, a stable cache key for PLDs: ``up=False`` never
    coarser (keeps an error target), ``up=True`` never finer (keeps a grid-size limit).

    Args:
        h: the interval, > 0.
        up: round up (never finer) instead of down (never coarser).

    Returns:
        The rounded interval.
    """
    scale = 10.0 ** (math.floor(math.log10(h)) - 2)
    return float(f"{(math.ceil(h / scale) if up else math.floor(h / scale)) * scale:.3g}")


def clone_pld(
    eps0: float,
    n: int,
    variant: Variant = "stronger",
    *,
    value_discretization_interval: float | None = None,
    pessimistic: bool = True,
) -> PrivacyLossDistribution:
    """Privacy loss distribution of one shuffle round (clone pair), for composition.

    Pessimistic (default): a valid upper bound for every composition (losses rounded up, truncated mass
    to infinity, blocks of C replaced by their lowest c; see ``_loss_support``). Optimistic: the mirror
    image, a lower bound on the clone pair's epsilon (not on the mechanism's: the clone pair is a reduction that
    bounds it from above). ``value_discretization_interval=None`` uses
    ``suggested_interval(eps0, n, rounds=1)``; pass ``suggested_interval(eps0, n, rounds=T)`` when the PLD
    will be composed ``T`` times (or use :func:`clone_epsilon_composed`). Symmetric (both directions
    coincide for clone pairs). Cached by ``(eps0, n, variant, interval, pessimistic)``.

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        variant: ``"stronger"`` or ``"focs"`` (the clone pair).
        value_discretization_interval: grid interval, or None for :func:`suggested_interval`.
        pessimistic: pessimistic (an upper bound) or optimistic (a lower bound on the pair) discretisation.

    Returns:
        The PLD of one round.
    """
    eps0 = check_eps0(eps0)
    n = check_n(n)
    variant = check_variant(variant)
    if not isinstance(pessimistic, bool):
        raise TypeError(f"pessimistic must be a bool, got {type(pessimistic).__name__}")
    if value_discretization_interval is None:
        h = suggested_interval(eps0, n, 1, variant)
    else:
        h = _pld.check_interval(value_discretization_interval)
    return _clone_pld_cached(eps0, n, variant, h, pessimistic)


@functools.lru_cache(maxsize=64)
def _clone_pld_cached(
    eps0: float, n: int, variant: str, h: float, pessimistic: bool
) -> PrivacyLossDistribution:
    losses, probs, infinity = _loss_support(eps0, n, variant, pessimistic)
    return _pld.pld_from_losses(
        losses,
        probs,
        infinity_mass=min(1.0, infinity),
        pessimistic=pessimistic,
        value_discretization_interval=h,
        tail_mass_truncation=PLD_TAIL_MASS_TRUNCATION,
    )


def clone_epsilon_composed(
    eps0: float,
    n: int,
    delta: float,
    rounds: int,
    variant: Variant = "stronger",
    *,
    pessimistic: bool = True,
    value_discretization_interval: float | None = None,
) -> float:
    """Epsilon at ``delta`` of ``rounds`` identical shuffle rounds, by PLD composition.

    Pessimistic (default): an upper bound on the mechanism's epsilon (Feldman-McMillan-Talwar's clone
    reduction, composed by PLD). Optimistic: a lower bound on the *clone pair's* composed epsilon, so the pair
    (optimistic, pessimistic) brackets the discretisation error of this bound; it is not a lower bound on the
    mechanism's epsilon. The interval defaults to ``suggested_interval(eps0, n, rounds)``.

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        delta: target delta, 0 < delta < 1.
        rounds: number of rounds T >= 1.
        variant: ``"stronger"`` or ``"focs"`` (the clone pair).
        pessimistic: pessimistic (an upper bound) or optimistic (a lower bound on the pair) discretisation.
        value_discretization_interval: grid interval, or None for :func:`suggested_interval`.

    Returns:
        The composed epsilon.
    """
    eps0 = check_eps0(eps0)
    n = check_n(n)
    delta = check_delta(delta)
    rounds = check_rounds(rounds)
    variant = check_variant(variant)
    h = (
        suggested_interval(eps0, n, rounds, variant)
        if value_discretization_interval is None
        else value_discretization_interval
    )
    one = clone_pld(eps0, n, variant, value_discretization_interval=h, pessimistic=pessimistic)
    composed = one if rounds == 1 else _pld.compose([(one, rounds)])
    return _pld.epsilon_for_delta(composed, delta)


# ----------------------------------------------------------------------------------------------------
# the straightforward baseline (benchmark and cross-check only)


def clone_epsilon_baseline(
    eps0: float, n: int, delta: float, variant: Variant = "stronger"
) -> float:
    """Single-round epsilon "the straightforward way": for every c of the support of C (all c whose
    mass is not zero in float64), binomial tails from scipy for each trial epsilon, summed with numpy,
    and a scipy root find (brentq on [0, eps0]). No windows, no bracketing tricks, no caching. Used
    by ``benchmarks/bench_accounting.py`` as the reference cost and by the tests as a cross-check.

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        delta: target delta, 0 < delta < 1.
        variant: ``"stronger"`` or ``"focs"`` (the clone pair).

    Returns:
        The epsilon of one round.
    """
    eps0 = check_eps0(eps0)
    n = check_n(n)
    delta = check_delta(delta)
    variant = check_variant(variant)
    w, log_q, _ = _params(eps0, variant)
    c = np.arange(0, n, dtype=np.int64)
    pmf = stats.binom.pmf(c, n - 1, math.exp(log_q))
    nz = pmf > 0
    c, pmf = c[nz], pmf[nz] / pmf[nz].sum()

    def gap(e: float) -> float:
        return float(np.sum(pmf * _delta_per_c(c, e, w, eps0))) - delta

    if gap(0.0) <= 0.0:
        return 0.0
    return float(optimize.brentq(gap, 0.0, eps0, xtol=1e-300, rtol=EPSILON_RTOL, maxiter=500))
