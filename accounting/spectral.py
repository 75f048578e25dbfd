"""Composed privacy loss distributions kept as discrete Fourier transforms (the accountant's round-by-round path).

A composition of PMFs on the grid ``k h`` is their convolution; on a circle of ``N`` points it is the product of
their real FFTs, so a new round costs one product over the band kept (below) instead of a convolution, and a
round's transform is computed once per distinct round and circle size. Rigour (every delta an upper bound):

* Circle. The circular composition is the exact composition ALIASED modulo ``N``: every point's mass lands on its
  residue, so inside any window of ``N`` consecutive points it is at least the exact mass there. Where the mass
  lies is bounded by Chernoff: ``P(S >= b) <= exp(sum_i log M_i(s) - s b)`` (``M_i`` the moment generating
  function of round i's loss index, exact from its PMF, ``s = 2^k`` near the Gaussian optimum), so the window
  :meth:`Composition.window` misses at most ``COMPOSED_TAIL_MASS`` above and below. The query adds that upper
  mass to the infinity mass (aliased mass sits lower in the window than it should: it can only be under-counted
  by its size); mass aliased from below lands higher (pessimistic). A circle too small for the next composition is
  grown by cutting the window out of the inverse transform (``slack`` += both tails and any mass the band's bound
  added, :meth:`Composition.cut_mass`; the slack is added to the infinity mass).
* Exact integers. The sums of ``log M_i(s)`` (rounded UP to multiples of ``2^-40``), of the variances and of the
  supports are integers, so a composition's window does not depend on the order its rounds were added in: a
  checkpoint replay (runs of equal rounds as one power) rebuilds every decision and every bit.
* Query. The epsilon is read from the composition spread onto a coarser grid ``H = f h`` (``f`` a power of 2,
  about ``QUERY_STEPS_PER_SD`` points per standard deviation of the composed loss): the spread is pessimistic for
  every hockey-stick divergence (:mod:`shuffledp.accounting.pld_spread`; Doroshenko et al., PETS 2022, "Connect
  the dots") and costs ``H^2/8`` in the mean once, not per round. Spreading and keeping every ``f``-th point is a
  correlation with ``2f - 1`` weights (transform ``W``, ``|W| <= f``) and a decimation: on the transform, the
  coarse coefficient ``J`` is ``(1/f) sum_r (S W)[J + r N/f]``.
* Band. A composed loss spread over ``sigma`` grid points has a transform of size about ``exp(-(sigma w)^2 / 2)``
  at frequency ``w``: beyond the band ``j <= L = N / (2f)`` (the coarse grid's Nyquist frequency) it is far below
  round-off. Only the band is kept, with a bound ``tau >= |S_j|`` for every ``j > L`` (the product of each
  round's largest ``|R_j|`` beyond the band, and the largest dropped coefficient when the band narrows). Then a
  round costs ``L + 1`` products and the query an inverse transform of ``N/f`` points, and the band's error is
  bounded: at most ``f tau`` per coarse point (``N - N/f`` dropped aliases, each at most ``tau f / f``, over
  ``N/f`` coefficients) and at most ``tau`` per fine point of a reconstruction; that much is ADDED to every point,
  so the result stays above the exact one. The band narrows only where all that moves at most ``BAND_TAIL_MASS``
  (else the whole transform is kept); in ``benchmarks/bench_long_runs.py`` ``tau`` is at most e^-80.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import fft as sfft

from shuffledp.accounting import pld_spread as ps

__all__ = [
    "COMPOSED_TAIL_MASS",
    "BAND_TAIL_MASS",
    "QUERY_STEPS_PER_SD",
    "MIN_FFT",
    "Item",
    "Composition",
    "item",
    "anchor_item",
    "clear_caches",
]

#: Chernoff bound on the mass beyond each end of a composition's window (the upper one goes to infinite loss).
COMPOSED_TAIL_MASS = 1e-15
#: Points of the query grid per standard deviation of the composed loss (its spread raises the variance by at most
#: ``1 / (4 QUERY_STEPS_PER_SD^2)`` relative, once).
QUERY_STEPS_PER_SD = 48.0
#: Smallest circle.
MIN_FFT = 256
#: Largest mass the band may move in all (twice the circle times the bound on the dropped coefficients): the band
#: narrows only where the dropped coefficients are that small, else the whole transform is kept.
BAND_TAIL_MASS = 1e-30
#: Fixed point of the log-MGF sums, and of the variance sums (which only choose ``s``).
_LAM_SCALE = 2**40
_VAR_SCALE = 2**20
#: Relative and absolute margin added to a log-MGF before it is rounded up (float round-off of the logsumexp).
_LAM_MARGIN = 1e-12
#: Largest ``|s (i - c)|`` for which a log-MGF is summed directly (no overflow of ``e^{+-s (i - c)}``).
_LAM_DIRECT = 600.0
_LOG_TAIL = math.log(1.0 / COMPOSED_TAIL_MASS)
#: Bytes of round transforms kept.
_SPECTRA_BYTES = 128 * 2**20


def _log(x: float) -> float:
    return math.log(x) if x > 0.0 else -math.inf


def _arc(ring: np.ndarray, lo: int, hi: int, *, fresh: bool = False) -> np.ndarray:
    """``ring[lo..hi]`` read around the circle (``hi - lo < ring.size``), as a new array (a view of ``ring`` when
    ``fresh``: the ring is a temporary the caller may change)."""
    n = ring.size
    start, stop = lo % n, hi % n
    if start <= stop:
        return ring[start : stop + 1] if fresh else ring[start : stop + 1].copy()
    return np.concatenate((ring[start:], ring[: stop + 1]))


def _circle(dense: ps.Dense, n_fft: int) -> np.ndarray:
    """A dense PMF's finite part placed on the circle of ``n_fft`` points (aliased) and transformed."""
    lower, probs, _ = dense
    if probs.size <= n_fft:
        ring = np.zeros(n_fft)
        start = lower % n_fft
        head = min(probs.size, n_fft - start)
        ring[start : start + head] = probs[:head]
        ring[: probs.size - head] = probs[head:]
    else:
        ring = np.bincount((lower + np.arange(probs.size)) % n_fft, weights=probs, minlength=n_fft)
    return sfft.rfft(ring)


_spectra: OrderedDict[tuple, tuple[np.ndarray, np.ndarray]] = OrderedDict()
_spectra_bytes = 0


@dataclass(eq=False)
class Item:
    """A PMF on the grid with its statistics in exact integers (index units), computed on first use.

    Attributes:
        key: the cache key of its transforms (None: not cached).
        dense: ``(lower, probs, infinity_mass)``.
    """

    key: tuple | None
    dense: ps.Dense
    _lam: dict[int, tuple[int, int]] = field(default_factory=dict)
    _stats: tuple[int, int, int, float] | None = None
    _support: tuple[np.ndarray, np.ndarray, int] | None = None
    _own: dict = field(default_factory=dict)

    def stats(self) -> tuple[int, int, int, float]:
        """``(support low, support high, variance * 2^20 rounded, log of the finite mass)``."""
        if self._stats is None:
            lower, probs, inf = self.dense
            nz = np.flatnonzero(probs > 0.0)
            if nz.size == 0:
                self._stats = (lower, lower, 0, -math.inf)
            else:
                p = probs[nz]
                total = float(p.sum())
                mean = float(np.dot(nz, p)) / total
                var = float(np.dot((nz - mean) ** 2, p)) / total
                self._stats = (lower + int(nz[0]), lower + int(nz[-1]), int(round(var * _VAR_SCALE)),
                               math.log1p(-min(inf, 1.0)))
        return self._stats

    def lam(self, k: int) -> tuple[int, int]:
        """``ceil(2^40 log M(+-2^k))`` (``M`` the moment generating function of the finite part's loss index):
        upper bounds, so Chernoff bounds built from them stay bounds.

        ``M(s) = e^{s c} sum_i p_i e^{s (i - c)}`` about the support's middle ``c``: where every ``|s (i - c)|`` is
        at most ``_LAM_DIRECT`` the sum is taken as it is (a pairwise sum of positive terms: relative error a few
        times ``1e-15``, far inside ``_LAM_MARGIN``), else as a log-sum-exp.

        Args:
            k: the exponent of ``s = 2^k``.

        Returns:
            The two rounded log-MGFs, at ``+s`` and at ``-s``.
        """
        found = self._lam.get(k)
        if found is None:
            if self._support is None:
                lower, probs, _ = self.dense
                nz = np.flatnonzero(probs > 0.0)
                middle = int(nz[0] + nz[-1]) // 2 if nz.size else 0
                self._support = ((nz - middle).astype(np.float64), probs[nz], lower + middle)
            offsets, p, middle = self._support
            if offsets.size == 0:
                found = (-(2**62), -(2**62))
            else:
                s = 2.0**k
                if s * max(-float(offsets[0]), float(offsets[-1])) <= _LAM_DIRECT:
                    z = np.exp(s * offsets)
                    sums = (float((p * z).sum()), float((p / z).sum()))
                    values = (math.log(sums[0]) + s * middle, math.log(sums[1]) - s * middle)
                else:
                    x = np.outer(np.array([s, -s]), offsets)
                    x += np.log(p)
                    top = x.max(axis=1)
                    shifted = (top + np.log(np.exp(x - top[:, None]).sum(axis=1))).tolist()
                    values = (shifted[0] + s * middle, shifted[1] - s * middle)
                up, dn = (int(math.ceil((v + _LAM_MARGIN * (1.0 + abs(v))) * _LAM_SCALE)) for v in values)
                found = (up, dn)
            self._lam[k] = found
        return found

    def spectrum(self, n_fft: int) -> np.ndarray:
        """The real FFT of the finite part on the circle of ``n_fft`` points (read-only; cached by key).

        Args:
            n_fft: the circle size.

        Returns:
            ``n_fft // 2 + 1`` complex values.
        """
        return self._transform(n_fft)[0]

    def tail(self, n_fft: int, band: int) -> float:
        """``log max_{j > band} |R_j|`` on the circle of ``n_fft`` points (``-inf`` beyond the last frequency).

        Args:
            n_fft: the circle size.
            band: the last frequency kept.

        Returns:
            The log of the largest magnitude beyond the band.
        """
        if band >= n_fft // 2:
            return -math.inf
        return _log(float(self._transform(n_fft)[1][band + 1]))

    def _transform(self, n_fft: int) -> tuple[np.ndarray, np.ndarray]:
        """``(transform, suffix maxima of its magnitudes)`` on the circle of ``n_fft`` points (``[j]`` = ``max_{i >= j}
        |R_i|``, so that every band's tail is one lookup): in the module's cache (least recently used out past
        ``_SPECTRA_BYTES``) for a keyed item, on the item itself otherwise."""
        global _spectra_bytes  # pylint: disable=global-statement
        if self.key is None:
            if n_fft not in self._own:
                self._own[n_fft] = _with_suffix_max(_circle(self.dense, n_fft))
            return self._own[n_fft]
        key = (*self.key, n_fft)
        found = _spectra.get(key)
        if found is not None:
            _spectra.move_to_end(key)
            return found
        found = _spectra[key] = _with_suffix_max(_circle(self.dense, n_fft))
        _spectra_bytes += found[0].nbytes + found[1].nbytes
        while _spectra_bytes > _SPECTRA_BYTES and len(_spectra) > 1:
            _, (old, old_max) = _spectra.popitem(last=False)
            _spectra_bytes -= old.nbytes + old_max.nbytes
        return found


def _with_suffix_max(spectrum: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``spectrum`` (made read-only) and the suffix maxima of its magnitudes (read-only): ``[j] = max_{i >= j}
    |R_i|`` for ``j`` up to the last frequency. Returns both."""
    spectrum.setflags(write=False)
    suffix = np.maximum.accumulate(np.abs(spectrum)[::-1])[::-1].copy()
    suffix.setflags(write=False)
    return spectrum, suffix


_items: OrderedDict[tuple, Item] = OrderedDict()
_ITEMS = 1024


def item(key: tuple, build: Any) -> Item:
    """The cached :class:`Item` of ``key``, built by ``build()`` (a function returning a dense PMF) when missing.

    Args:
        key: a hashable key naming the PMF completely (e.g. eps0, n, variant, interval).
        build: returns the dense PMF.

    Returns:
        The item.
    """
    found = _items.get(key)
    if found is not None:
        _items.move_to_end(key)
        return found
    made = Item(key, build())
    _items[key] = made
    while len(_items) > _ITEMS:
        _items.popitem(last=False)
    return made


def anchor_item(dense: ps.Dense) -> Item:
    """An uncached :class:`Item` (a materialised composition).

    Args:
        dense: the PMF (its infinity mass is ignored: compositions carry theirs apart).

    Returns:
        The item.
    """
    return Item(None, (dense[0], dense[1], 0.0))


def _circle_size(x: float) -> int:
    """The smallest power of 2 of at least ``x`` points (and ``MIN_FFT``): fast transforms, divisible by every query
    factor, and few sizes over a run (each round's transform is computed once per size)."""
    return max(MIN_FFT, 1 << max(0, int(math.ceil(math.log2(max(x, 1.0))))))


@dataclass(eq=False)
class Composition:
    """An anchor (or nothing) composed with rounds, as the band ``0..band`` of its transform on a circle of ``n_fft``
    points with a bound on the rest (immutable by convention: methods return new objects or memoised values).

    Attributes:
        h: the grid interval.
        n_fft: the circle size.
        band: the last frequency kept (``n_fft // (2 f)``, ``f`` the query factor).
        spectrum: the transform at ``0..band`` (read-only).
        log_tail: log of a bound on ``|S_j|`` for ``band < j <= n_fft/2`` (``-inf``: none beyond the band).
        anchor: a materialised composition the rounds follow, or None.
        counts: rounds since the anchor, ``{key: (item, count)}``.
        var: sum of the variances (index units, times ``2^20``).
        support: sum of the supports (index units).
        log_keep: log of the probability that no loss is infinite.
        slack: mass cut from windows so far (added to the infinity mass of every query).
        rounds: the number of rounds.
    """

    h: float
    n_fft: int
    band: int
    spectrum: np.ndarray
    log_tail: float
    anchor: Item | None
    counts: dict
    var: int
    support: tuple[int, int]
    log_keep: float
    slack: float
    rounds: int
    _lams: dict = field(default_factory=dict)
    _moved: dict = field(default_factory=dict)
    _window: tuple[int, int] | None = None
    _query: tuple | None = None

    # -- the window --------------------------------------------------------------------------------------------
    def k_star(self) -> int:
        """The exponent of ``s = 2^k`` nearest the Gaussian optimum ``sqrt(2 log(1/tail) / variance)``."""
        var = max(self.var / _VAR_SCALE, 1e-6)
        return int(min(8, max(-80, round(math.log2(math.sqrt(2.0 * _LOG_TAIL / var))))))

    def lam_sums(self, k: int) -> tuple[int, int]:
        """Exact sums of the rounded log-MGFs at ``+-2^k`` over the anchor and every round (memoised).

        Args:
            k: the exponent.

        Returns:
            ``(sum at +s, sum at -s)``.
        """
        if k not in self._lams:
            up = dn = 0
            if self.anchor is not None:
                up, dn = self.anchor.lam(k)
            for it, count in self.counts.values():
                a, b = it.lam(k)
                up, dn = up + count * a, dn + count * b
            self._lams[k] = (up, dn)
        return self._lams[k]

    def window(self) -> tuple[int, int]:
        """Index range ``[a, b]`` outside which the exact composition has at most ``COMPOSED_TAIL_MASS`` on each
        side (Chernoff at ``s = 2^k_star``, intersected with the support)."""
        if self._window is None:
            k = self.k_star()
            up, dn = self.lam_sums(k)
            s = 2.0**k
            hi = math.ceil((up / _LAM_SCALE + _LOG_TAIL) / s) + 1
            lo = math.floor(-(dn / _LAM_SCALE + _LOG_TAIL) / s) - 1
            lo, hi = max(lo, self.support[0]), min(hi, self.support[1])
            self._window = (lo, max(lo, hi))
        return self._window

    def query_factor(self) -> int:
        """``f``: the query grid is ``f h``, a power of 2 with about ``QUERY_STEPS_PER_SD`` points per standard
        deviation."""
        sd = math.sqrt(self.var / _VAR_SCALE)
        return 1 << max(0, int(math.floor(math.log2(max(sd / QUERY_STEPS_PER_SD, 1.0)))))

    def fft_size(self) -> int:
        """The circle this composition needs: its window, two query cells and a margin."""
        lo, hi = self.window()
        return _circle_size(hi - lo + 1 + 2 * self.query_factor() + 8)

    # -- other circles and bands -------------------------------------------------------------------------------
    def dense(self) -> ps.Dense:
        """The window of the inverse transform, each point raised by the band's bound (so never below the
        circle's exact value) and negative round-off set to 0; infinity mass apart.

        Returns:
            ``(lower, probs, 0.0)`` on the grid ``h``; the mass beyond the window is at most
            ``COMPOSED_TAIL_MASS`` per side, and the mass added is at most :meth:`cut_mass` minus that (callers
            that continue from it add :meth:`cut_mass` to ``slack``: added mass may later move above a window).
        """
        lo, hi = self.window()
        half = np.zeros(self.n_fft // 2 + 1, dtype=np.complex128)
        half[: self.band + 1] = self.spectrum
        out = _arc(sfft.irfft(half, self.n_fft), lo, hi)
        if self.log_tail > -math.inf:
            out += math.exp(self.log_tail)
        return lo, np.maximum(out, 0.0, out=out), 0.0

    def cut_mass(self) -> float:
        """A bound on the mass a materialisation (:meth:`dense`) moves: both tails beyond the window, and twice the
        band's bound on each point of the window (it is added to each point, and the point may be that much low)."""
        lo, hi = self.window()
        return 2.0 * COMPOSED_TAIL_MASS + 2.0 * (hi - lo + 1) * math.exp(self.log_tail)

    def moved(self, n_fft: int, band: int) -> tuple[np.ndarray, float]:
        """The band ``0..band`` of the transform on a circle of ``n_fft >= self.n_fft`` points, and the log of a
        bound beyond it: the same circle with a narrower band (the dropped coefficients join the bound), or the
        window cut out and moved to a larger circle (the caller adds :meth:`cut_mass` to ``slack``). Memoised.

        Args:
            n_fft: the circle size.
            band: the last frequency to keep (at most ``self.band`` on the same circle).

        Returns:
            ``(transform band, log bound beyond it)``.
        """
        key = (n_fft, band)
        if key not in self._moved:
            if n_fft < self.n_fft or (n_fft == self.n_fft and band > self.band):
                raise ValueError(f"cannot widen a band ({self.band} to {band}) or shrink a circle ({self.n_fft} to "
                                 f"{n_fft}): the coefficients were not kept")
            if n_fft == self.n_fft:
                if band == self.band:
                    out = (self.spectrum, self.log_tail)
                else:
                    dropped = float(np.abs(self.spectrum[band + 1 :]).max())
                    out = (self.spectrum[: band + 1], max(self.log_tail, _log(dropped)))
            else:
                if n_fft not in self._moved:
                    self._moved[n_fft] = _circle(self.dense(), n_fft)
                full = self._moved[n_fft]
                rest = float(np.abs(full[band + 1 :]).max()) if band < n_fft // 2 else 0.0
                out = (full[: band + 1], _log(rest))
            out[0].setflags(write=False)
            self._moved[key] = out
        return self._moved[key]

    def infinity(self) -> float:
        """The infinity mass of a query: rounds with an infinite loss, the mass above the window, the slack."""
        return min(1.0, -math.expm1(self.log_keep) + COMPOSED_TAIL_MASS + self.slack)

    # -- the query ---------------------------------------------------------------------------------------------
    def query_dense(self) -> tuple[ps.Dense, float]:
        """The composition spread onto the query grid ``f h`` (pessimistic), with the infinity mass.

        Returns:
            ``((lower, probs, infinity), f h)`` (memoised; ``probs`` read-only).
        """
        if self._query is None:
            self._query = self._spread_query()
            self._query[0][1].setflags(write=False)
        return self._query

    def _spread_query(self) -> tuple[ps.Dense, float]:
        n, band = self.n_fft, self.band
        f = n // (2 * band)
        lo, hi = self.window()
        if f == 1:
            lower, probs, _ = self.dense()
            return (lower, probs, self.infinity()), self.h
        m = n // f
        coarse = self.spectrum * _spread_kernel(n, f, self.h)
        coarse[-1] = 2.0 * coarse[-1].real  # the coarse Nyquist term gathers both +-band (conjugates)
        k_lo = lo // f
        out = _arc(sfft.irfft(coarse, m, overwrite_x=True), k_lo, hi // f + 1, fresh=True)
        if self.log_tail > -math.inf:
            out += f * math.exp(self.log_tail)
        return (k_lo, np.maximum(out, 0.0, out=out), self.infinity()), f * self.h


@functools.lru_cache(maxsize=16)
def _spread_kernel(n: int, f: int, h: float) -> np.ndarray:
    """``W[J] / f`` for ``J = 0..n/(2f)``, ``W[j] = sum_s w_s e^{2 pi i j s / n}``: the spread of a point at offset
    ``r`` above a multiple of ``f`` gives ``b_r = expm1(-r h) / expm1(-f h)`` to the next multiple and ``1 - b_r``
    to its own (:func:`shuffledp.accounting.pld_spread.coarsen`); as a correlation, ``w_r = 1 - b_r`` and
    ``w_{r-f} = b_r``."""
    r = np.arange(f, dtype=np.float64)
    b = np.expm1(-r * h) / math.expm1(-f * h)
    offsets = np.concatenate((r, r[1:] - f))
    weights = np.concatenate((1.0 - b, b[1:]))
    angles = np.outer(np.arange(n // (2 * f) + 1, dtype=np.float64), offsets * (2.0 * math.pi / n))
    out = (np.cos(angles) @ weights + 1j * (np.sin(angles) @ weights)) / f  # real cos/sin: no complex exp
    out.setflags(write=False)
    return out


def clear_caches() -> None:
    """Forget every cached item, transform and kernel."""
    global _spectra_bytes  # pylint: disable=global-statement
    _items.clear()
    _spectra.clear()
    _spectra_bytes = 0
    _spread_kernel.cache_clear()
