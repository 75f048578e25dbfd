"""One round's clone-pair PLD for any n, assembled from cached conditional PLDs of blocks of clone counts.

The clone pair's output reveals C (the number of clones), so its privacy loss distribution is the mixture over c of
the conditional PLDs given C = c, weighted by ``P(C = c)``, ``C ~ Bin(n - 1, q)`` (Feldman, McMillan, Talwar,
FOCS'21 Thm 3.1 and SODA'23; see :mod:`shuffledp.accounting.clones`). The pair with fewer clones dominates the pair
with more (it is a post-processing: add a fresh clone), so every c may be replaced by a smaller one. Here the
clone counts are cut into blocks on ONE geometric grid for every n (relative width ``BLOCK_RELATIVE_WIDTH``; every
c below ``1 / BLOCK_RELATIVE_WIDTH`` is its own block) and each block is represented by its LOWEST c: grouping
rounds of nearby n (or nearby c) is thus always pessimistic, fewer clones meaning weaker amplification. The
conditional PLD of each block's representative is put on the grid ``h`` once (pessimistic spread,
:func:`shuffledp.accounting.pld_spread.spread_onto_grid`) and cached; a round with a new n then only needs the
block masses of ``Bin(n - 1, q)`` (its tails: below the window to infinite loss, above it to the last block) and a
weighted sum, a few milliseconds instead of the exact support of 10^5-10^6 points. Each block is computed on its
own window and summed on its own, so its values never depend on which round asked for it first.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from shuffledp.accounting import pld_spread as ps
from shuffledp.accounting.clone_pair import (
    CHUNK_ELEMENTS,
    PLD_WINDOW_DROP,
    _c_distribution,
    _one_minus_2w,
    _outside_x_window,
    _params,
    _x_window,
)

__all__ = ["BLOCK_RELATIVE_WIDTH", "block_of", "block_start", "round_pld", "clear_block_cache"]

#: Relative width of the blocks of clone counts (each block uses its lowest c; about +0.05% on epsilon).
BLOCK_RELATIVE_WIDTH = 1e-3
#: Distinct (eps0, variant, interval) block tables kept.
_TABLES = 8
_C0 = int(math.ceil(1.0 / BLOCK_RELATIVE_WIDTH))
_LOG_R = math.log1p(BLOCK_RELATIVE_WIDTH)
_cache: OrderedDict[tuple[float, str, float], dict[int, ps.Dense]] = OrderedDict()


def block_start(j: np.ndarray) -> np.ndarray:
    """Lowest clone count of block ``j``: ``j`` below ``C0 = 1/BLOCK_RELATIVE_WIDTH``, else
    ``ceil(C0 (1 + BLOCK_RELATIVE_WIDTH)^(j - C0))``.

    Args:
        j: block indices (int64 array).

    Returns:
        The lowest c of each block.
    """
    j = np.asarray(j, dtype=np.int64)
    big = np.ceil(_C0 * np.exp((j - _C0).astype(np.float64) * _LOG_R)).astype(np.int64)
    return np.where(j < _C0, j, big)


def block_of(c: np.ndarray) -> np.ndarray:
    """Block index of each clone count ``c`` (``block_start(j) <= c < block_start(j + 1)``).

    Args:
        c: clone counts (int64 array, >= 0).

    Returns:
        Their block indices.
    """
    c = np.asarray(c, dtype=np.int64)
    with np.errstate(divide="ignore"):
        guess = _C0 + np.floor(np.log(np.maximum(c, 1) / _C0) / _LOG_R).astype(np.int64)
    j = np.where(c < _C0, c, np.maximum(guess, _C0))
    for _ in range(3):  # float rounding of the logarithm: settle the edge exactly
        j = np.where(block_start(j) > c, j - 1, j)
        j = np.where(block_start(j + 1) <= c, j + 1, j)
    return j


def _compute(eps0: float, variant: str, h: float, ids: np.ndarray) -> dict[int, ps.Dense]:
    """Spread conditional PLDs of the blocks ``ids`` (see ``clone_pld._loss_support`` for the pessimistic
    treatment of the X window: mass below it moved up to the lowest kept loss, above it to infinity). Each row has
    its own window and is summed on its own, so a block's values do not depend on the blocks computed with it."""
    w, _, _ = _params(eps0, variant)
    one_m2w = _one_minus_2w(eps0)
    reps = block_start(ids)
    m = reps.astype(np.float64)[:, None] + 1.0
    halves = np.minimum(np.ceil(math.sqrt(2.0 * PLD_WINDOW_DROP) * 0.5 * np.sqrt(m[:, 0]) + 10.0), m[:, 0] // 2 + 2)
    big = int(halves.max())
    offsets = np.arange(-big, big + 1, dtype=np.float64)
    xc, valid, probs, losses = _x_window(m, offsets, w, one_m2w, halves)
    x_lo = np.maximum(xc[:, 0] - halves, 0.0)
    x_hi = np.minimum(xc[:, 0] + halves, m[:, 0])
    below, above = _outside_x_window(reps, x_lo, x_hi, w)
    out = {}
    for i in range(reps.size):
        cols = np.flatnonzero(valid[i])
        li, pi = losses[i, cols[0] : cols[-1] + 1], probs[i, cols[0] : cols[-1] + 1].copy()
        pi *= (1.0 - below[i] - above[i]) / pi.sum()
        pi[0] += below[i]
        out[int(ids[i])] = ps.spread_onto_grid(li, pi, float(above[i]), h)
    return out


def _blocks(eps0: float, variant: str, h: float, wanted: np.ndarray) -> dict[int, ps.Dense]:
    key = (eps0, variant, h)
    table = _cache.get(key)
    if table is None:
        table = _cache[key] = {}
        while len(_cache) > _TABLES:
            _cache.popitem(last=False)
    _cache.move_to_end(key)
    missing = np.array(sorted({int(j) for j in wanted} - set(table)), dtype=np.int64)
    if missing.size:
        width = 2.0 * math.sqrt(2.0 * PLD_WINDOW_DROP) * 0.5 * math.sqrt(float(block_start(missing[-1:])[0]) + 1.0)
        rows = max(1, int(CHUNK_ELEMENTS // (width + 21.0)))
        for start in range(0, missing.size, rows):
            table.update(_compute(eps0, variant, h, missing[start : start + rows]))
    return table


#: One-round PLDs kept for reuse (most recently used last): a long run with n on the accountant's grid of n
#: (``HETEROGENEOUS_N_GRID_RATIO``) meets each grid value many times. An entry is one PMF of about 1e4 floats.
ROUND_CACHE_SIZE = 512
_rounds: OrderedDict[tuple[float, int, str, float], ps.Dense] = OrderedDict()


def round_pld(eps0: float, n: int, variant: str, h: float) -> ps.Dense:
    """One round's pessimistic PLD on the grid ``h``: the block mixture described in the module docstring.

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        variant: ``"stronger"`` or ``"focs"``.
        h: the grid interval.

    Returns:
        ``(lower, probs, infinity_mass)`` on the grid ``h`` (``probs`` read-only: it may be shared with later calls).
    """
    key = (float(eps0), int(n), variant, float(h))
    if key in _rounds:
        _rounds.move_to_end(key)
        return _rounds[key]
    dense = _round_pld(eps0, n, variant, h)
    dense[1].setflags(write=False)
    _rounds[key] = dense
    while len(_rounds) > ROUND_CACHE_SIZE:
        _rounds.popitem(last=False)
    return dense


def _round_pld(eps0: float, n: int, variant: str, h: float) -> ps.Dense:
    c, pmf, lo_tail, hi_tail = _c_distribution(n, eps0, variant, PLD_WINDOW_DROP)
    blocks = block_of(c)
    starts = np.flatnonzero(np.concatenate(([True], blocks[1:] != blocks[:-1])))
    weights = np.add.reduceat(pmf, starts)
    weights[-1] += hi_tail  # more clones than the window: the last block's fewer clones dominate
    ids = blocks[starts]
    table = _blocks(eps0, variant, h, ids)
    parts = [table[int(j)] for j in ids]
    lower = min(p[0] for p in parts)
    upper = max(p[0] + p[1].size for p in parts)
    out = np.zeros(upper - lower)
    infinity = lo_tail  # fewer clones than the window: worst case, infinite loss
    for wt, (lo, probs, inf) in zip(weights, parts):
        out[lo - lower : lo - lower + probs.size] += wt * probs
        infinity += wt * inf
    return lower, out, min(1.0, infinity)


def clear_block_cache() -> None:
    """Forget every cached block table and one-round PLD."""
    _cache.clear()
    _rounds.clear()
