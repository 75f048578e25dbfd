"""A privacy loss distribution streamed in chunks, never held: moments, one round's exact delta(eps) and
epsilon(delta), and the pessimistic spread onto a grid.

A distribution is a mass at ``+inf`` and points ``(L, P)`` that a function generates again, in chunks, for every
pass. Its hockey-stick divergence ``delta(eps) = inf + sum_{L > eps} P (1 - e^{eps - L})`` is a sum of
non-negative terms. One pass sums, over bins ``[e_k, e_{k+1})`` of the losses,

    c_k = sum P (-expm1(e_k - L)),   d_k = sum P e^{e_k - L},

and since ``1 - e^{eps - L} = (1 - e^{e_k - L}) + e^{e_k - L} (1 - e^{eps - e_k})``, a bin's share of
``delta(eps)`` for every ``eps <= e_k`` is ``c_k + (-expm1(eps - e_k)) d_k``: two non-negative terms, no
difference of tails, no ``1 - sum``. So delta is exact at every edge, and a bisection over the edges finds the
bin that holds the answer. A second pass collects that bin's points (a bin with more than :data:`BIN_POINTS`
points is first split into :data:`BINS` bins again, by one more pass), and the answer is solved on them as on a
sorted support: the bins above add their exact share. :func:`spread` is
:func:`shuffledp.accounting.pld_spread.spread_onto_grid` a chunk at a time, bit for bit. Memory: the bins, the grid
and one bin's points, whatever the size of the support (the privacy blanket's, :mod:`shuffledp.accounting.blanket`,
has 15 M points at n = 10,000).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np

__all__ = ["BINS", "BIN_POINTS", "MAX_SPLITS", "Bins", "Scan", "Streamed", "empty_bins", "add", "scan", "delta",
           "epsilon", "spread"]

#: Number of bins of one layer (three arrays of this size, 1.5 MiB).
BINS = 1 << 16
#: Largest number of points collected from the bin that holds the answer; a fuller bin is split into bins again.
BIN_POINTS = 1 << 18
#: Splits at most this many times (a bin that narrow holds equal losses only; it is collected whatever its size).
MAX_SPLITS = 3
#: Points per step of :func:`spread` (its buffers stay in cache).
SPREAD_CHUNK = 1 << 16

#: A function giving the chunks ``(losses, P-masses)`` of the finite part (finite losses, masses > 0), anew each call.
Chunks = Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]]


class Bins(NamedTuple):
    """Bins ``[edges[k], edges[k+1])`` (``edges[-1]`` may be inf) with ``c[k] = sum P (-expm1(edges[k] - L))``,
    ``d[k] = sum P e^{edges[k] - L}`` and ``counts[k]`` points; equal widths on ``[edges[0], top]``."""

    edges: np.ndarray
    top: float
    c: np.ndarray
    d: np.ndarray
    counts: np.ndarray


class Scan(NamedTuple):
    """What one pass gives: ``(mean, standard deviation)`` of the loss under P (finite part), ``(smallest,
    largest)`` loss, and the bins of ``[0, top]`` (the last one to inf)."""

    moments: tuple[float, float]
    extent: tuple[float, float]
    bins: Bins


class Streamed(NamedTuple):
    """A streamed distribution: ``chunks``, the mass at ``+inf``, bins from 0 up holding every loss >= 0 (filled
    by one pass, :func:`add`) and the largest loss."""

    chunks: Chunks
    infinity: float
    bins: Bins
    largest: float


def empty_bins(a: float, top: float, b: float) -> Bins:
    """:data:`BINS` empty bins of equal width on ``[a, top]``, the last one reaching to ``b`` (``>= top``).

    Returns:
        The bins.
    """
    edges = np.clip(a + (top - a) * (np.arange(BINS + 1, dtype=np.float64) / BINS), a, b)
    edges[0], edges[-1] = a, b
    return Bins(np.maximum.accumulate(edges), top, np.zeros(BINS), np.zeros(BINS), np.zeros(BINS, dtype=np.int64))


def add(bins: Bins, losses: np.ndarray, probs: np.ndarray) -> None:
    """Add the points with ``edges[0] <= L < edges[-1]`` to their bins, exactly ``edges[k] <= L < edges[k+1]``.

    Returns:
        None (``bins`` is updated in place).
    """
    e = bins.edges
    nb = e.size - 1
    sel = (losses >= e[0]) & (losses < e[-1])
    if not sel.any():
        return
    ls, ps = losses[sel], probs[sel]
    k = np.minimum(((ls - e[0]) * (nb / (bins.top - e[0]))).astype(np.int64), nb - 1)
    while (down := ls < e[k]).any():  # the division may be a bin off: the comparisons decide
        k[down] -= 1
    while (up := ls >= e[k + 1]).any():
        k[up] += 1
    em = np.expm1(e[k] - ls)
    bins.c[:] += np.bincount(k, weights=ps * -em, minlength=nb)
    bins.d[:] += np.bincount(k, weights=ps * (1.0 + em), minlength=nb)
    bins.counts[:] += np.bincount(k, minlength=nb)


def scan(chunks: Iterable[tuple[np.ndarray, np.ndarray]], top: float) -> Scan:
    """One pass: the moments (chunk statistics merged as in Chan, Golub, LeVeque, "Algorithms for computing the
    sample variance", 1983), the extent, and the losses >= 0 added to bins of equal width on ``[0, top]``.

    Args:
        chunks: the finite part's ``(losses, P-masses)``, finite losses and masses > 0.
        top: the end of the bins of equal width (the largest loss, or a bound on it), > 0.

    Returns:
        The :class:`Scan`.

    Raises:
        ArithmeticError: there is no point.
    """
    bins = empty_bins(0.0, top, math.inf)
    tot = mean = m2 = 0.0
    low, high = math.inf, -math.inf
    for losses, probs in chunks:
        t = float(probs.sum())
        mu = float((losses * probs).sum()) / t  # products and pairwise sums: no BLAS threads per chunk
        dev = losses - mu
        shift, new = mu - mean, tot + t
        mean += shift * (t / new)
        m2 += float((dev * dev * probs).sum()) + shift * shift * (tot * t / new)
        tot = new
        low, high = min(low, float(losses.min())), max(high, float(losses.max()))
        add(bins, losses, probs)
    if not tot > 0.0:
        raise ArithmeticError("the loss distribution has no point of positive mass")
    return Scan((mean, math.sqrt(max(m2 / tot, 0.0))), (low, high), bins)


def _tail(bins: Bins, j: int, eps: float) -> float:
    """``sum P (1 - e^{eps - L})`` over bins ``j, j+1, ...`` (for ``eps <= edges[j]``: every term >= 0)."""
    nb = bins.c.size
    if j >= nb:
        return 0.0
    # products and pairwise sums rather than a BLAS dot (its threads cost more than the sum here)
    return float(bins.c[j:].sum()) + float((-np.expm1(eps - bins.edges[j:nb]) * bins.d[j:]).sum())


Outer = Callable[[float], float]


def _narrow(dist: Streamed, pick: Callable[[Bins, Outer], int]) -> tuple[Outer, np.ndarray, np.ndarray, float, float]:
    """The bin ``pick(bins, outer)`` names, split while it holds more than :data:`BIN_POINTS` points, and its
    points; ``outer(eps)`` is the infinity mass plus the exact share of the bins above the ones kept so far.

    Returns:
        ``(outer, losses, probs, a, b)``: for ``a <= eps <= b``, ``delta(eps) = outer(eps) + sum_{L > eps} P
        (-expm1(eps - L))`` over the returned points (those with ``a <= L < b``).
    """
    kept: list[tuple[Bins, int]] = []

    def outer(eps: float) -> float:
        return dist.infinity + sum(_tail(bins, j, eps) for bins, j in kept)

    bins = dist.bins
    for split in range(MAX_SPLITS + 1):
        j = pick(bins, outer)
        kept.append((bins, j + 1))
        a, b = float(bins.edges[j]), float(bins.edges[j + 1])
        if bins.counts[j] <= BIN_POINTS or split == MAX_SPLITS:
            break
        bins = empty_bins(a, b if math.isfinite(b) else float(np.nextafter(max(dist.largest, a), math.inf)), b)
        for losses, probs in dist.chunks():
            add(bins, losses, probs)
    parts = []
    for losses, probs in dist.chunks():
        sel = (losses >= a) & (losses < b)
        if sel.any():
            parts.append((losses[sel], probs[sel]))
    ls = np.concatenate([c[0] for c in parts]) if parts else np.zeros(0)
    ps = np.concatenate([c[1] for c in parts]) if parts else np.zeros(0)
    return outer, ls, ps, a, b


def _direct(outer: Outer, losses: np.ndarray, probs: np.ndarray, eps: float) -> float:
    """``min(1, outer(eps) + sum_{L > eps} P (-expm1(eps - L)))``: every term non-negative, summed directly."""
    above = losses > eps
    return float(min(1.0, outer(eps) + float((probs[above] * -np.expm1(eps - losses[above])).sum())))


def delta(dist: Streamed, eps: float) -> float:
    """``delta(eps) = min(1, inf + sum_{L > eps} P (1 - e^{eps - L}))``, every term non-negative (module docstring).

    One pass (or more when the bin of ``eps`` must be split).

    Args:
        dist: the distribution, its bins filled.
        eps: finite, >= 0.

    Returns:
        The hockey-stick divergence at ``e^eps``.
    """
    def containing(bins: Bins, outer: Outer) -> int:
        return min(int(np.searchsorted(bins.edges, eps, side="right")) - 1, bins.c.size - 1)

    outer, losses, probs, _, _ = _narrow(dist, containing)
    return _direct(outer, losses, probs, eps)


def epsilon(dist: Streamed, target: float, rtol: float) -> float:
    """The smallest ``eps >= 0`` (to ``rtol`` relative, rounded up) with ``delta(eps) <= target``.

    The exact delta at the bins' edges locates the bin of the answer (bisection over the edges); bisection on the
    direct sum over that bin's points and the bins above; the value is checked and stepped up by at most ``rtol``
    relative until it passes.

    Args:
        dist: the distribution, its bins filled.
        target: 0 < delta < 1.
        rtol: relative tolerance, > 0.

    Returns:
        The epsilon (``math.inf`` when the infinity mass alone exceeds ``target``).

    Raises:
        ArithmeticError: the checked delta stays above ``target`` after the step-up (a numerical failure).
    """
    if dist.infinity > target:
        return math.inf
    if min(1.0, dist.infinity + _tail(dist.bins, 0, 0.0)) <= target:
        return 0.0

    def root(bins: Bins, outer: Outer) -> int:
        """The bin ``j`` with ``delta(edges[j]) > target >= delta(edges[j+1])``."""
        below, above = 0, bins.c.size
        while above - below > 1:
            mid = (below + above) // 2
            edge = float(bins.edges[mid])
            if outer(edge) + _tail(bins, mid, edge) <= target:
                above = mid
            else:
                below = mid
        return below

    outer, losses, probs, a, b = _narrow(dist, root)
    low, high = a, b if math.isfinite(b) else max(dist.largest, a)
    while high - low > 0.25 * rtol * max(high, 1e-300):
        mid = 0.5 * (low + high)
        if _direct(outer, losses, probs, mid) <= target:
            high = mid
        else:
            low = mid
    limit = high * (1.0 + rtol)
    step = 0.25 * rtol * max(high, 1e-300)
    while (value := _direct(outer, losses, probs, high)) > target:
        if high + step > limit:
            raise ArithmeticError(f"delta({high!r}) = {value!r} > {target!r} after the step-up of {rtol!r} relative")
        high += step
    return high


def spread(
    chunks: Iterable[tuple[np.ndarray, np.ndarray]], infinity: float, h: float, extent: tuple[float, float]
) -> tuple[int, np.ndarray, float]:
    """:func:`shuffledp.accounting.pld_spread.spread_onto_grid` of the concatenated chunks (finite losses, masses
    > 0, ``extent`` their smallest and largest loss), bit for bit (the same operations on every point, the masses
    added to the grid in the same order), a chunk at a time: the pessimistic mean-preserving spread of Doroshenko,
    Ghazi, Kamath, Kumar, Manurangsi, "Connect the dots", PETS 2022.

    ``floor(l / h)`` is non-decreasing in ``l`` (correctly rounded division), so its extremes are those of the
    extreme losses. ``np.add.at`` adds the points in their order, as ``np.bincount`` does.

    Returns:
        ``(lower, probs, infinity_mass)`` on the grid ``h``.
    """
    lower = int(math.floor(extent[0] / h))
    size = int(math.floor(extent[1] / h)) - lower + 2
    to_lower, to_upper = np.zeros(size), np.zeros(size)
    scale = math.expm1(-h)
    shift = float(lower)
    buf_k, buf_d, buf_up, buf_w = (np.empty(SPREAD_CHUNK) for _ in range(4))
    buf_i = np.empty(SPREAD_CHUNK, dtype=np.int64)
    for losses, probs in chunks:
        for start in range(0, losses.size, SPREAD_CHUNK):
            lc, pc = losses[start : start + SPREAD_CHUNK], probs[start : start + SPREAD_CHUNK]
            m = lc.size
            k, d, up, w, idx = buf_k[:m], buf_d[:m], buf_up[:m], buf_w[:m], buf_i[:m]
            np.floor(np.divide(lc, h, out=k), out=k)  # k = floor(l / h)
            np.clip(np.subtract(lc, np.multiply(k, h, out=d), out=d), 0.0, h, out=d)  # d = clip(l - k h, 0, h)
            np.divide(np.expm1(np.negative(d, out=d), out=d), scale, out=d)
            np.multiply(pc, d, out=up)  # up = p expm1(-d) / expm1(-h)
            idx[...] = np.subtract(k, shift, out=k)  # (k - lower) as int64
            np.add.at(to_lower, idx, np.subtract(pc, up, out=w))
            idx += 1
            np.add.at(to_upper, idx, up)
    return lower, to_lower + to_upper, float(infinity) + 0.0
