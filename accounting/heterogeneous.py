"""Grouping heterogeneous rounds (each its own n and eps0) before they are composed.

Equal ``(n, eps0)`` rounds are grouped (:func:`merge`); with many distinct groups the PLD families move each round
to a dominating point of geometric grids (:func:`dominating_round`) so that nearly equal rounds merge. Used by
:func:`shuffledp.accounting.bounds.epsilon_for_rounds`. Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from shuffledp.accounting.core import EPS0_MAX, N_MAX

__all__ = [
    "HETEROGENEOUS_EXACT_GROUPS",
    "HETEROGENEOUS_N_GRID_RATIO",
    "HETEROGENEOUS_EPS0_GRID_RATIO",
    "merge",
    "dominating_round",
]

#: Up to this many distinct (n, eps0) groups are composed as they are; beyond it the PLD families round each
#: round to a dominating grid point (see :func:`dominating_round`) so that rounds merge.
HETEROGENEOUS_EXACT_GROUPS = 4
#: Ratio of the geometric grid of n in :func:`dominating_round` (n moves down by < 1%; n < 100 stays exact).
HETEROGENEOUS_N_GRID_RATIO = 1.01
#: Ratio of the geometric grid of eps0 in :func:`dominating_round` (eps0 moves by < 0.1%). Finer than n's
#: grid because epsilon reacts to eps0 more strongly (about eps0/2 times the relative change) than to n
#: (about half the relative change); eps0 rarely varies between rounds, so it costs few extra groups.
HETEROGENEOUS_EPS0_GRID_RATIO = 1.001

Groups = dict[tuple[int, float], int]


def merge(groups: Groups, key: Callable[[int, float], tuple[int, float]]) -> Groups:
    """Regroup ``(n, eps0) -> count`` under ``key(n, eps0)``, adding the counts that meet.

    Args:
        groups: ``(n, eps0) -> count``.
        key: the new group of a round.

    Returns:
        The regrouped counts, in first-seen order.
    """
    out: Groups = {}
    for (n, eps0), count in groups.items():
        k = key(n, eps0)
        out[k] = out.get(k, 0) + count
    return out


def dominating_round(n: int, eps0: float, *, lower: bool) -> tuple[int, float]:
    """Move (n, eps0) onto geometric grids (ratios ``HETEROGENEOUS_N_GRID_RATIO`` = r for n,
    ``HETEROGENEOUS_EPS0_GRID_RATIO`` for eps0), in the safe direction.

    Upper families: n rounded DOWN and eps0 rounded UP. Fewer shuffled reports can only leak more (the clone
    pair with more clones is a post-processing of the one with fewer: add independent clones split by a fair
    coin), and an eps0-LDP randomizer is also eps0'-LDP for eps0' >= eps0; so the bound of the rounded round
    covers the real one. n goes to the smallest integer of its cell ``[r^k, r^(k+1))``, ``ceil(r^k)``, so an n
    that is the only integer of its cell (every n below ``1 / (r - 1)`` = 100) stays exact. Lower family
    (rr-lower): n UP to the largest integer of its cell, ``floor(r^(k+1))``, and eps0 DOWN, so the value stays
    a lower bound. A coordinate whose rounded value would leave the accepted range (eps0 above
    :data:`EPS0_MAX`, n above :data:`N_MAX`) is kept exact instead (the exact value is its own dominating point).

    Args:
        n: reports in the round.
        eps0: the round's local privacy parameter.
        lower: round for a lower bound (else for an upper bound or approximation).

    Returns:
        The dominating ``(n, eps0)``.
    """
    log_rn = math.log(HETEROGENEOUS_N_GRID_RATIO)
    log_re = math.log(HETEROGENEOUS_EPS0_GRID_RATIO)
    kn = math.log(n) / log_rn
    ke = math.log(eps0) / log_re
    if lower:
        n2 = max(n, math.floor(HETEROGENEOUS_N_GRID_RATIO ** math.ceil(kn)))
        e2 = min(eps0, HETEROGENEOUS_EPS0_GRID_RATIO ** math.floor(ke))
        if n2 > N_MAX:  # rounding up would leave the accepted range: keep the exact n (no bucketing of n)
            n2 = n
    else:
        n2 = max(1, min(n, math.ceil(HETEROGENEOUS_N_GRID_RATIO ** math.floor(kn))))
        e2 = max(eps0, HETEROGENEOUS_EPS0_GRID_RATIO ** math.ceil(ke))
        if e2 > EPS0_MAX:  # rounding up would pass the cap every bound enforces: keep the exact eps0 group
            e2 = eps0
    return int(n2), float(e2)
