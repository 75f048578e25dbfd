"""One round's clone-pair PLD for any n, assembled from cached conditional PLDs of blocks of clone counts.

The clone pair's output reveals C (the number of clones), so its privacy loss distribution is the mixture over c of
the conditional PLDs given C = c, weighted by ``P(C = c)``, ``C ~ Bin(n - 1, q)`` (Feldman, McMillan, Talwar,
FOCS'21 Thm 3.1 and SODA'23; see :mod:`shuffledp.accounting.clones`). The pair with fewer clones dominates the pair
with more (it is a post-processing: add a fresh clone), so every c may be replaced by a smaller one. Here the
clone counts are cut into blocks on ONE geometric grid for every n (relative width ``BLOCK_RELATIVE_WIDTH``; every
c below ``1 / BLOCK_RELATIVE_WIDTH`` is its own block) and each block is represented by its LOWEST c: grouping
rounds of nearby n (or nearby c) is thus always pessimistic, fewer clones meaning weaker amplification.

The conditional PLD of each block's representative is put on the grid ``h`` by the pessimistic mean-preserving
spread (:mod:`shuffledp.accounting.pld_spread`; Doroshenko et al., PETS 2022) and cached, ``BLOCK_GROUP`` blocks
at a time (a fixed group of block indices, so a block's values never depend on which round asked for it). The
spread needs only two sums per grid cell (:func:`_group_table`), so a table costs a product recurrence over the
window of X, no logarithm per point. A round with a new n then needs the block masses of ``Bin(n - 1, q)``
(:func:`_block_masses`: its tails go below the window to infinite loss, above it to the last block) and one
weighted sum of table rows per group.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
from scipy import special

from shuffledp.accounting import pld_spread as ps
from shuffledp.accounting.binomial import tail_ge
from shuffledp.accounting.clone_pair import PLD_WINDOW_DROP, _one_minus_2w, _params
from shuffledp.accounting.core import N_MAX

__all__ = [
    "BLOCK_RELATIVE_WIDTH",
    "BLOCK_GROUP",
    "ROUND_CACHE_SIZE",
    "block_group",
    "block_of",
    "block_start",
    "round_pld",
    "clear_block_cache",
]

#: Relative width of the blocks of clone counts. Each block uses its lowest c, which raises epsilon by about a
#: quarter of the width (relative): 1,000 rounds with n uniform in [5e4, 2e5], eps0 = 1, delta = 1e-6 give
#: 0.491796 at 1e-3, 0.491924 at 2e-3 (+0.026%), 0.492179 at 4e-3 (+0.078%), with the n grid of ratio 1.005; the
#: table rows, one per block over the range of clone counts a run meets, are most of the cost of a run's new rounds,
#: and halve with each doubling. The exact composition of those rounds is 0.490971.
BLOCK_RELATIVE_WIDTH = 4e-3
#: Most blocks computed and stored together: block j belongs to the group ``[g, g + size)`` of
#: :func:`block_group`, ``size`` a power of 2 up to this, smaller where the windows of X are long.
BLOCK_GROUP = 16
#: Points of the windows of X in one group, about (fewer rows where each window is longer).
_GROUP_POINTS = 2**17
#: Distinct (eps0, variant, interval) block tables kept.
_TABLES = 8
_C0 = int(math.ceil(1.0 / BLOCK_RELATIVE_WIDTH))
_LOG_R = math.log1p(BLOCK_RELATIVE_WIDTH)
#: Half width of the window of X given C, in standard deviations of X (log-mass drop ``PLD_WINDOW_DROP``).
_X_HALF_SDS = math.sqrt(2.0 * PLD_WINDOW_DROP)
# (eps0, variant, h) -> {first block of a group: (half width S, rows x (2 S + 1) matrix on -S..S, infinity masses)}
_cache: OrderedDict[tuple[float, str, float], dict[int, tuple[int, np.ndarray, np.ndarray]]] = OrderedDict()


_starts: list[int] = []
_starts_array = np.zeros(0, dtype=np.int64)
#: Blocks kept ready in the array of starts: past the block of ``N_MAX`` clones (no round has more).
_J_MAX = _C0 + int(math.ceil(math.log(N_MAX / _C0) / _LOG_R)) + 2


def _start_table(upto: int) -> list[int]:
    """``block_start`` of every block below ``upto`` (computed once per block with the C library's ``exp``, so a
    block's start never depends on the array it was asked in)."""
    while len(_starts) < upto:
        j = len(_starts)
        _starts.append(j if j < _C0 else int(math.ceil(_C0 * math.exp((j - _C0) * _LOG_R))))
    return _starts


def _start_array(upto: int) -> np.ndarray:
    """:func:`_start_table` as an int64 array (the same values), grown with room up to the blocks of ``N_MAX``
    clones so that it is rebuilt rarely."""
    global _starts_array  # pylint: disable=global-statement
    if _starts_array.size < upto:
        _start_table(max(upto, min(2 * _starts_array.size, _J_MAX)))
        _starts_array = np.asarray(_starts, dtype=np.int64)
        _starts_array.setflags(write=False)
    return _starts_array


def block_start(j: np.ndarray) -> np.ndarray:
    """Lowest clone count of block ``j``: ``j`` below ``C0 = 1/BLOCK_RELATIVE_WIDTH``, else
    ``ceil(C0 (1 + BLOCK_RELATIVE_WIDTH)^(j - C0))``.

    Args:
        j: block indices (int64 array).

    Returns:
        The lowest c of each block.
    """
    j = np.asarray(j, dtype=np.int64)
    if j.size == 0:
        return j.copy()
    return _start_array(int(j.max()) + 1)[j.ravel()].reshape(j.shape)


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


def _block_of_int(c: int) -> int:
    """:func:`block_of` of one count (the same block starts, without the array round trip)."""
    if c < _C0:
        return c
    j = _C0 + int(math.floor(math.log(c / _C0) / _LOG_R))
    while True:
        table = _start_table(j + 2)
        if table[j] > c:
            j -= 1
        elif table[j + 1] <= c:
            j += 1
        else:
            return j


def block_group(j: int) -> tuple[int, int]:
    """The group of block ``j``: ``(first block, size)``. Groups are a fixed partition of the block indices: every
    aligned run of ``BLOCK_GROUP`` blocks is cut into equal groups of a power-of-2 size chosen from its first
    block (about ``_GROUP_POINTS`` points of the windows of X per group).

    Args:
        j: a block index.

    Returns:
        The first block of its group and the group's size.
    """
    band = j - j % BLOCK_GROUP
    m = float(_start_table(band + 1)[band]) + 1.0
    rows = _GROUP_POINTS / (_X_HALF_SDS * 0.5 * math.sqrt(m) + 10.0)
    size = int(min(BLOCK_GROUP, 2 ** max(0, int(math.floor(math.log2(max(rows, 1.0)))))))
    return j - j % size, size


def _group_table(eps0: float, variant: str, h: float, first: int, count: int) -> tuple[int, np.ndarray, np.ndarray]:
    """The spread conditional PLDs of the blocks ``first .. first + count - 1`` (one row each, grid ``-S..S``).

    Given C = c (m = c + 1), ``P(X = x) = Bin(x; m, 1/2) 2 num / m`` and ``Q(X = x) = Bin(x; m, 1/2) 2 den / m``
    with ``num = (1-w) x + w (m-x)``, ``den = w x + (1-w)(m-x)`` (Feldman, McMillan, Talwar, FOCS'21 Thm 3.1); the
    loss ``log(num/den)`` grows with x, and ``Q(x) = P(m - x)``: the side ``x > m/2`` gives the other side by
    symmetry (loss ``-l``, masses swapped). On that side x runs over ``half + i``, ``i = 1..H`` (``H`` =
    ``_X_HALF_SDS`` standard deviations of X); grid cell k, losses ``[k h, (k+1) h)``, is ``i >= i_k = m tanh(k
    h/2) / (2t) + (m mod 2)/2`` (``t = 1 - 2w``). Only two sums per cell are needed: ``B_k = sum b`` and ``I_k =
    sum b i`` (``b`` proportional to ``Bin(x; m, 1/2)``, by its ratio recurrence); then ``P_k = 2 (w m + t half)
    B_k / m + 2 t I_k / m``, ``Q_k`` likewise (or summed on its own where ``den`` would cancel), and the
    mean-preserving spread (Doroshenko et al., PETS 2022) moves ``D_k / expm1(-h)`` of the cell to its upper point,
    ``D_k = e^{kh} Q_k - P_k = 2 t (e^{kh} + 1)(i_k B_k - I_k) / m`` (either form, the better conditioned one),
    keeping both masses; the mirrored cell likewise. The masses of X beyond the window are exact binomial tails
    (:func:`shuffledp.accounting.binomial.tail_ge`): above it to infinite loss, below it moved up to the lowest kept
    loss (both pessimistic); the window is scaled to the rest.

    Args:
        eps0: local privacy parameter.
        variant: the clone pair.
        h: the grid interval.
        first: the group's first block index.
        count: its number of blocks.

    Returns:
        ``(S, matrix, infinity)``: row r is block ``first + r`` on the grid ``-S..S``.
    """
    w, _, _ = _params(eps0, variant)
    t = _one_minus_2w(eps0)
    reps = block_start(np.arange(first, first + count, dtype=np.int64))
    rows = reps.size
    mi = reps + 1
    m = mi.astype(np.float64)
    half = (mi // 2).astype(np.float64)
    big_h = np.minimum(np.ceil(_X_HALF_SDS * 0.5 * np.sqrt(m) + 10.0).astype(np.int64), mi - mi // 2)
    width = int(big_h.max()) + 1
    cols = np.arange(width, dtype=np.float64)
    # b[:, col] proportional to Bin(half + col + 1; m, 1/2) (the window is scaled to its exact mass below), by the
    # ratio recurrence; zero from i = H + 1 on
    b = (m - half)[:, None] - cols[None, :]
    b /= (half + 1.0)[:, None] + cols[None, :]
    b[:, 0] = 1.0
    b[np.arange(rows), big_h] = 0.0
    np.cumprod(b, axis=1, out=b)
    i_col = cols + 1.0
    # den = w x + (1-w)(m-x) = a - t i along a row: as an affine sum per cell where it never falls below a / 2
    a_row = w * (half + 1.0) + (1.0 - w) * (m - half - 1.0) + t
    affine = bool(np.all(t * big_h <= 0.5 * a_row))
    x_hi = half + big_h
    l_hi = np.log((1.0 - w) * x_hi + w * (m - x_hi)) - np.log(w * x_hi + (1.0 - w) * (m - x_hi))
    k_cap = int(np.max(np.floor(l_hi / h))) + 2
    kk = np.arange(k_cap + 1, dtype=np.float64)
    i_star = (m / (2.0 * t))[:, None] * np.tanh(0.5 * h * kk)[None, :] + 0.5 * (m - 2.0 * half)[:, None]
    col_k = np.minimum(np.maximum(np.ceil(i_star) - 1.0, 0.0), big_h[:, None]).astype(np.int64)
    flat = (np.arange(rows, dtype=np.int64)[:, None] * width + col_k).ravel()
    empty = col_k[:, 1:] == col_k[:, :-1]
    sums = []
    if affine:
        weighted = (b, b * i_col)
    else:  # each den a sum of two non-negative terms
        x = half[:, None] + i_col[None, :]
        weighted = (b, b * i_col, b * (w * x + (1.0 - w) * (m[:, None] - x)))
    for values in weighted:
        cell = np.add.reduceat(values.ravel(), flat).reshape(col_k.shape)[:, :-1]
        cell[empty] = 0.0
        sums.append(cell)
    s_b, s_i = sums[0], sums[1]
    s_den = a_row[:, None] * s_b - t * s_i if affine else sums[2]
    center = np.where(mi % 2 == 0, (half + 1.0) / (m - half), 0.0)  # Bin(m/2) / Bin(m/2 + 1), loss 0
    g0, g1 = tail_ge(x_hi, reps), tail_ge(x_hi + 1.0, reps)
    above = (1.0 - w) * g0 + w * g1  # P(X > x_hi)
    below = w * g0 + (1.0 - w) * g1  # P(X < m - x_hi) = Q(X > x_hi)
    # window mass: sum (P + Q) over the side x > m/2 (sum b (num + den) 2/m = 2 sum b) and the centre
    scale = (1.0 - above - below) / (2.0 * b.sum(axis=1) + center)
    two = (2.0 * scale / m)[:, None]
    p_k = two * ((w * m + t * half)[:, None] * s_b + t * s_i)
    q_k = two * s_den
    e_lo, e_hi = np.exp(h * kk[:-1])[None, :], np.exp(-h * kk[1:])[None, :]
    # D = e^{kh} Q_k - P_k <= 0 directly (loses about 1/h of the digits) or as 2t/m (e^{kh}+1)(i_k B_k - I_k)
    # (loses i_k / cell width); the mirror, losses [-(k+1)h, -kh) with P-mass Q_k and Q-mass P_k:
    # D' = e^{-(k+1)h} P_k - Q_k, or 2t/m (1 + e^{-(k+1)h})(I_k - i_{k+1} B_k)
    fac = two * t * (e_lo + 1.0)
    via_i = fac * i_star[:, :-1] * s_b
    fac_neg = two * t * (1.0 + e_hi)
    via_i_neg = fac_neg * i_star[:, 1:] * s_b
    if affine:  # a window away from x = m: i_k / (cell width in i) is about k, the i-form loses few digits
        d_pos = via_i - fac * s_i
        d_neg = fac_neg * s_i - via_i_neg
    else:
        d_pos = np.where(via_i < e_lo * q_k + p_k, via_i - fac * s_i, e_lo * q_k - p_k)
        d_neg = np.where(via_i_neg < e_hi * p_k + q_k, fac_neg * s_i - via_i_neg, e_hi * p_k - q_k)
    em1 = math.expm1(-h)
    up = np.minimum(np.maximum(np.minimum(d_pos, 0.0) / em1, 0.0), p_k)
    up_neg = np.minimum(np.maximum(np.minimum(d_neg, 0.0) / em1, 0.0), q_k)
    size = k_cap  # cells 0..k_cap-1 on each side: grid -k_cap..k_cap
    out = np.zeros((rows, 2 * size + 1))
    out[:, size : 2 * size] = p_k - up
    out[:, size + 1 : 2 * size + 1] += up
    out[:, 0:size] = (q_k - up_neg)[:, ::-1]
    out[:, 1 : size + 1] += up_neg[:, ::-1]
    out[:, size] += center * scale
    # the mass below the window, as one point at the lowest kept loss -l_hi (cell K of the negative side)
    k_hi = np.sum(col_k <= (big_h - 1)[:, None], axis=1) - 1
    frac = np.clip(np.expm1(l_hi - (k_hi + 1.0) * h) / em1, 0.0, 1.0)
    r = np.arange(rows)
    out[r, size - k_hi - 1] += below * (1.0 - frac)
    out[r, size - k_hi] += below * frac
    out.setflags(write=False)
    return size, out, above


def _tables(eps0: float, variant: str, h: float, j_lo: int, j_hi: int) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
    """``(first block, S, matrix, infinity)`` of every group that holds a block of ``[j_lo, j_hi]``."""
    key = (eps0, variant, h)
    table = _cache.get(key)
    if table is None:
        table = _cache[key] = {}
        while len(_cache) > _TABLES:
            _cache.popitem(last=False)
    _cache.move_to_end(key)
    out = []
    j = j_lo
    while j <= j_hi:
        first, count = block_group(j)
        if first not in table:
            table[first] = _group_table(eps0, variant, h, first, count)
        out.append((first, *table[first]))
        j = first + count
    return out


def _block_masses(n: int, eps0: float, variant: str) -> tuple[int, np.ndarray, float]:
    """Masses of the blocks of ``C ~ Bin(n - 1, q)`` over its window (log-mass within ``PLD_WINDOW_DROP`` of the
    mode), and the mass below the window.

    The window's masses come from the ratio recurrence of the binomial from its mode (Loader's saddle-point form
    there, :func:`shuffledp.accounting.binomial.binom_logpmf`), scaled to ``1 - below - above``; the tails are
    regularised incomplete beta functions (exact, never ``1 - sum``). More clones than the window go to the last
    block (fewer clones dominate).

    Args:
        n: reports in the round.
        eps0: local privacy parameter.
        variant: the clone pair.

    Returns:
        ``(first block, masses of the consecutive blocks, mass below the window)``.
    """
    _, log_q, log_1mq = _params(eps0, variant)
    trials = n - 1
    if trials == 0:
        return 0, np.ones(1), 0.0
    q, p = math.exp(log_q), math.exp(log_1mq)
    mean = trials * q
    half = int(math.ceil(math.sqrt(2.0 * PLD_WINDOW_DROP) * math.sqrt(mean * p) * 1.25 + PLD_WINDOW_DROP + 10))
    lo, hi = max(0, int(math.floor(mean)) - half), min(trials, int(math.ceil(mean)) + half)
    mode = min(max(int(math.floor((trials + 1) * q)), lo), hi)
    c_up = np.arange(mode, hi, dtype=np.float64)
    c_dn = np.arange(mode, lo, -1, dtype=np.float64)
    up = np.cumprod((trials - c_up) / (c_up + 1.0) * (q / p))
    down = np.cumprod(c_dn / (trials - c_dn + 1.0) * (p / q))
    rel = np.concatenate((down[::-1], [1.0], up))
    keep = np.flatnonzero(rel >= math.exp(-PLD_WINDOW_DROP))
    c_lo, c_hi = lo + int(keep[0]), lo + int(keep[-1])
    rel = rel[keep[0] : keep[-1] + 1]
    below = float(special.betainc(trials - c_lo + 1.0, float(c_lo), p)) if c_lo > 0 else 0.0
    above = float(special.betainc(c_hi + 1.0, float(trials - c_hi), q)) if c_hi < trials else 0.0
    pmf = rel * ((1.0 - below - above) / rel.sum())
    j_lo, j_hi = _block_of_int(c_lo), _block_of_int(c_hi)
    starts = block_start(np.arange(j_lo + 1, j_hi + 1, dtype=np.int64)) - c_lo
    masses = np.add.reduceat(pmf, np.concatenate(([0], starts)))
    masses[-1] += above
    return j_lo, masses, below


#: One-round PLDs kept for reuse (most recently used last): a long run with n on the accountant's grid of n
#: (``HETEROGENEOUS_N_GRID_RATIO``) meets each grid value many times. An entry is one PMF of about 1e3-1e4 floats.
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
    dense = _round_pld(float(eps0), int(n), variant, float(h))
    dense[1].setflags(write=False)
    _rounds[key] = dense
    while len(_rounds) > ROUND_CACHE_SIZE:
        _rounds.popitem(last=False)
    return dense


def _round_pld(eps0: float, n: int, variant: str, h: float) -> ps.Dense:
    j_lo, masses, infinity = _block_masses(n, eps0, variant)
    j_hi = j_lo + masses.size - 1
    tables = _tables(eps0, variant, h, j_lo, j_hi)
    size = max(s for _, s, _, _ in tables)
    out = np.zeros(2 * size + 1)
    for first, s, matrix, inf in tables:  # the rows of the round's blocks, weighted by their masses
        a, b = max(j_lo, first) - first, min(j_hi, first + inf.size - 1) - first
        weights = masses[a + first - j_lo : b + first - j_lo + 1]
        out[size - s : size + s + 1] += weights @ matrix[a : b + 1]
        infinity += float(weights @ inf[a : b + 1])
    nz = np.flatnonzero(out)
    if nz.size == 0:
        return 0, np.zeros(1), min(1.0, infinity)
    return int(nz[0]) - size, out[nz[0] : nz[-1] + 1].copy(), min(1.0, infinity)


def clear_block_cache() -> None:
    """Forget every cached block table and one-round PLD."""
    _cache.clear()
    _rounds.clear()
