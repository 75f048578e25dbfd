"""Many rounds of the clone pair: PLDs discretised to second order (:mod:`shuffledp.accounting.pld_spread`).

The exact losses of the clone pair (:func:`shuffledp.accounting.clone_pld._loss_support`: windows, blocks of C
and truncated tails already on the safe side) are put on a grid of interval ``h`` by the pessimistic spread
("connect the dots", Doroshenko et al., PETS 2022) for an upper bound, or by the optimistic hull for a lower
bound on the pair's composed epsilon (the bracket). Both move each round's mean loss by at most ``h^2/8`` and
its variance by at most ``h^2/4``: unlike rounding up (up to ``h`` per round), the error does not grow with the
number of rounds T relative to the composed epsilon (about ``T m1 + z sqrt(T) s1``, ``m1``/``s1`` the mean and
standard deviation of one round's loss). :func:`spread_interval` picks ``h`` for a relative excess of
``SPREAD_RELATIVE_ERROR``; the composed grid spans about ``T m1 + 18 sqrt(T) s1``, and where that needs more
than ``MAX_COMPOSED_GRID`` points ``h`` grows; where the excess would then pass ``SPREAD_MAX_RELATIVE_ERROR`` the
bound is refused (RefusedError) rather than reported loose. Measured at
n = 1e4, eps0 = 1, delta = 1e-6: bracket width 0.05% at T = 1e3, 0.07% at 1e5, 0.09% at 1e7 (983.1).
"""

from __future__ import annotations

import functools
import math

from shuffledp.accounting import pld as _pld
from shuffledp.accounting import pld_spread as ps
from shuffledp.accounting.clone_pair import MAX_COMPOSED_GRID, MIN_COMPOSED_GRID
from shuffledp.accounting.clone_pld import _loss_support, clone_loss_moments, round_interval
from shuffledp.accounting.core import RefusedError

__all__ = [
    "SPREAD_RELATIVE_ERROR",
    "SPREAD_MAX_RELATIVE_ERROR",
    "SPREAD_Z",
    "discretisation_excess",
    "spread_interval",
    "spread_clone_pld",
    "composed_clone_pld",
    "heterogeneous_clone_pld",
]

#: Target relative excess of a composed epsilon due to the grid (:func:`discretisation_excess`).
SPREAD_RELATIVE_ERROR = 1e-3
#: Largest estimated relative excess accepted when the grid cap forces a coarser grid; beyond it the composed
#: bound is refused rather than reported loose.
SPREAD_MAX_RELATIVE_ERROR = 2e-2
#: Multiple of the composed standard deviation at which the excess of the spread is estimated (a generous
#: z: epsilon at delta = 1e-12 of a Gaussian loss is about 7 standard deviations above its mean).
SPREAD_Z = 8.0


def discretisation_excess(moments: list[tuple[float, float, int]], h: float) -> tuple[float, float]:
    """``(excess, scale)``: an estimate of how much the spread at interval ``h`` can raise the composed epsilon,
    and a lower estimate of that epsilon.

    Per round the spread raises the mean loss by at most ``h^2/8`` and the variance by at most ``h^2/4``, so
    ``excess = sum T h^2/8 + SPREAD_Z (sqrt(V + T h^2/4) - sqrt(V))`` with ``V = sum T s1^2``; the composed
    epsilon is at least about ``scale = sum T m1 + 2 sqrt(V)`` for delta <= 0.02 (as in
    :func:`shuffledp.accounting.clones.suggested_interval`).

    Args:
        moments: ``(m1, s1, count)`` per group of rounds.
        h: the grid interval.

    Returns:
        ``(excess, scale)``.
    """
    total = sum(c for _, _, c in moments)
    mean = sum(c * m for m, _, c in moments)
    var = sum(c * s * s for _, s, c in moments)
    excess = total * h * h / 8.0 + SPREAD_Z * (math.sqrt(var + total * h * h / 4.0) - math.sqrt(var))
    return excess, mean + 2.0 * math.sqrt(var)


def spread_interval(moments: list[tuple[float, float, int]], what: str) -> float:
    """Grid interval for composing rounds with per-round loss moments ``(m1, s1, count)``.

    The largest ``h`` whose :func:`discretisation_excess` is at most ``SPREAD_RELATIVE_ERROR`` of the epsilon's
    scale and that gives the composed width ``sum T m1 + 18 sqrt(sum T s1^2) + 20 max s1`` at least
    ``MIN_COMPOSED_GRID`` points (finer costs nothing noticeable), but at least that width over
    ``MAX_COMPOSED_GRID``; rounded to 3 significant digits (a cache key).

    Args:
        moments: ``(m1, s1, count)`` per group of rounds.
        what: the rounds, for the refusal message.

    Returns:
        The interval.

    Raises:
        RefusedError: the grid cap forces an ``h`` whose excess exceeds ``SPREAD_MAX_RELATIVE_ERROR``.
    """
    mean = sum(c * m for m, _, c in moments)
    var = sum(c * s * s for _, s, c in moments)
    width = mean + 18.0 * math.sqrt(var) + 20.0 * max(s for _, s, _ in moments)
    floor = width / MAX_COMPOSED_GRID
    _, scale = discretisation_excess(moments, 1.0)
    if not (scale > 0.0 and math.isfinite(scale) and math.isfinite(floor)):
        raise ArithmeticError(f"cannot choose a grid interval for {what}: loss moments {moments!r}")
    lo, hi = 0.0, width  # excess(h) grows with h: bisection on the target
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if discretisation_excess(moments, mid)[0] <= SPREAD_RELATIVE_ERROR * scale:
            lo = mid
        else:
            hi = mid
    lo = min(lo, width / MIN_COMPOSED_GRID)  # a grid below MIN_COMPOSED_GRID points costs nothing noticeable
    if floor > lo:
        excess = discretisation_excess(moments, floor)[0]
        if excess > SPREAD_MAX_RELATIVE_ERROR * scale:
            raise RefusedError(
                f"clones cannot resolve {what}: the composed privacy loss spans about {width:.4g}, which on at most "
                f"MAX_COMPOSED_GRID={MAX_COMPOSED_GRID} points needs a grid interval of {floor:.3g}; that could "
                f"raise epsilon by about {excess:.3g} ({100 * excess / scale:.2g}% of its scale {scale:.4g}, more "
                f"than SPREAD_MAX_RELATIVE_ERROR={SPREAD_MAX_RELATIVE_ERROR:g}), so no bound is reported (fewer "
                "rounds are resolved)")
        return round_interval(floor, up=True)
    return round_interval(lo, up=False)


@functools.lru_cache(maxsize=64)
def spread_clone_pld(eps0: float, n: int, variant: str, h: float, pessimistic: bool = True):
    """One round's clone-pair PLD on the grid ``h``: pessimistic spread (upper) or optimistic hull (lower).

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        variant: ``"stronger"`` or ``"focs"``.
        h: the grid interval.
        pessimistic: spread (an upper bound after any composition) or hull (a lower bound on the pair's).

    Returns:
        A symmetric ``PrivacyLossDistribution``.
    """
    losses, probs, infinity = _loss_support(eps0, n, variant, pessimistic)
    if pessimistic:
        dense = ps.spread_onto_grid(losses, probs, min(1.0, infinity), h)
    else:
        dense = ps.hull_onto_grid(losses, probs, h)
    return ps.to_pld(dense, h, pessimistic=pessimistic)


def composed_clone_pld(eps0: float, n: int, rounds: int, variant: str, *, pessimistic: bool = True):
    """``rounds`` identical rounds composed (FFT power, :func:`shuffledp.accounting.pld.compose`).

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        rounds: number of rounds T >= 1.
        variant: ``"stronger"`` or ``"focs"``.
        pessimistic: upper (spread) or lower (hull) discretisation.

    Returns:
        ``(composed PLD, interval)``.

    Raises:
        RefusedError: the grid cannot resolve ``rounds`` rounds (:func:`spread_interval`).
    """
    m1, s1 = clone_loss_moments(eps0, n, variant)
    h = spread_interval([(m1, s1, rounds)], f"{rounds} rounds of n={n}, eps0={eps0}")
    one = spread_clone_pld(eps0, n, variant, h, pessimistic)
    return (one if rounds == 1 else _pld.compose([(one, rounds)])), h


def heterogeneous_clone_pld(items: list[tuple[int, float, int]], variant: str):
    """Groups ``(n, eps0, count)`` composed on one grid, pessimistic spread.

    Args:
        items: ``(n, eps0, count)`` per group.
        variant: ``"stronger"`` or ``"focs"``.

    Returns:
        ``(composed PLD, interval)``.
    """
    moments = [(*clone_loss_moments(eps0, n, variant), c) for n, eps0, c in items]
    total = sum(c for _, _, c in items)
    h = spread_interval(moments, f"{total} rounds in {len(items)} groups")
    plds = [(spread_clone_pld(eps0, n, variant, h, True), c) for n, eps0, c in items]
    return _pld.compose(plds), h
