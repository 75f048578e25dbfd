"""Round-by-round composition of the clone pair's privacy loss distribution (the accountant's default path).

:class:`ComposedClones` holds the composed pessimistic PLD of the rounds so far as the low band of its discrete
Fourier transform on a circle of ``N`` points, with a bound on the rest (:class:`shuffledp.accounting.spectral.
Composition`), and composes a new round into it: one product over the band (about ``N / (2 f)`` values; the round's
transform is computed once per distinct round and circle size), so a charge costs the same at round 1,000 as at
round 1. The epsilon is read from the composition spread onto the coarser grid ``f h``, an inverse transform of
``N / f`` points (:meth:`ComposedClones.epsilon`, :meth:`ComposedClones.delta_pld`).

* One round's PMF comes from :func:`shuffledp.accounting.clone_blocks.round_pld`: cached conditional PLDs of blocks
  of clone counts, each block at its LOWEST count (fewer clones = weaker amplification, so grouping nearby n or c is
  pessimistic), discretised by the mean-preserving spread (:mod:`shuffledp.accounting.pld_spread`; pessimistic for
  every composition, second order in the grid interval).
* The grid interval is set by the first round (a power of 2, at least ``INCREMENTAL_STEPS_PER_SD`` points per
  standard deviation of its loss). A later round whose loss is much narrower refines the grid (exact: every point
  keeps its loss) while the composition stays below ``MAX_COMPOSED_GRID / 4`` points; a composition that would need
  a circle above ``MAX_COMPOSED_GRID`` points, or a round whose losses (in ``[-eps0, eps0]``) would need more than
  half that, makes the grid coarser by 2 (the same spread, pessimistic). Both materialise the composition (its
  Chernoff window, :mod:`shuffledp.accounting.spectral`) and continue from it.
* Every bound on the mass the circle leaves out is carried to the infinity mass of the query (Chernoff, at most
  ``COMPOSED_TAIL_MASS`` per side and per cut), so the value stays an upper bound.
* Canonical form: consecutive equal rounds form a run, composed as one power of the round's transform; every
  decision (circle size, coarsening) is taken from the run's base and its length alone, and the window sums are
  exact integers, so the state is a function of the sequence of rounds alone (not of how compose calls grouped
  them) and replaying a checkpoint's round list rebuilds it bit for bit.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from shuffledp.accounting import clone_blocks
from shuffledp.accounting import pld as _pld
from shuffledp.accounting import pld_spread as ps
from shuffledp.accounting import spectral as sp
from shuffledp.accounting.clone_pair import MAX_COMPOSED_GRID, _params

__all__ = [
    "ComposedClones",
    "fold",
    "INCREMENTAL_STEPS_PER_SD",
    "INCREMENTAL_MIN_STEPS_PER_SD",
    "loss_sd_estimate",
]

#: Grid points per (estimated) standard deviation of the first round's loss (excess about 1/(8 K^2) per round).
INCREMENTAL_STEPS_PER_SD = 24.0
#: A round with fewer grid points per standard deviation than this refines the grid (when it fits).
INCREMENTAL_MIN_STEPS_PER_SD = 8.0


@functools.lru_cache(maxsize=4096)
def loss_sd_estimate(eps0: float, n: int, variant: str) -> float:
    """A cheap estimate of the standard deviation of one round's privacy loss, to size the grid only.

    Given ``m = C + 1`` the loss is about ``4 (1 - 2w)(X - m/2) / m`` with ``sd(X) ~ sqrt(m)/2``:
    ``2 (1 - 2w) / sqrt(E[C] + 1)``, at most ``eps0`` (the loss lies in ``[-eps0, eps0]``).

    Args:
        eps0: local privacy parameter.
        n: reports in the round.
        variant: the clone pair.

    Returns:
        The estimate.
    """
    w, log_q, _ = _params(eps0, variant)
    return min(eps0, 2.0 * math.tanh(eps0 / 2.0) / math.sqrt((n - 1) * math.exp(log_q) + 1.0))


def _round_item(n: int, eps0: float, variant: str, h: float) -> sp.Item:
    return sp.item((float(eps0), int(n), variant, float(h)), lambda: clone_blocks.round_pld(eps0, n, variant, h))


def _power(spectrum: np.ndarray, times: int) -> np.ndarray:
    """``spectrum ** times`` by repeated squaring (a new array; ``spectrum`` is not changed)."""
    if times == 1:
        return spectrum
    base = spectrum.copy()
    result = None
    e = times
    while e > 0:
        if e & 1:
            result = base.copy() if result is None else np.multiply(result, base, out=result)
        e >>= 1
        if e:
            np.multiply(base, base, out=base)
    return result


def _empty(h: float) -> sp.Composition:
    """Nothing composed: the point mass at loss 0 (transform 1 everywhere, so its bound beyond any band is 1)."""
    one = np.ones(sp.MIN_FFT // 2 + 1, dtype=np.complex128)
    one.setflags(write=False)
    return sp.Composition(h, sp.MIN_FFT, sp.MIN_FFT // 2, one, -math.inf, None, {}, 0, (0, 0), 0.0, 0.0, 0)


def _band(comp: sp.Composition, n_fft: int, tail_at: Callable[[int], float], widest: int) -> tuple[int, float]:
    """The band a composition keeps on a circle of ``n_fft`` points, and the log of the bound beyond it: the query
    grid's Nyquist frequency ``n_fft / (2f)``, ``f`` from the composed variance, made smaller until the band may move
    at most ``BAND_TAIL_MASS`` (``2 n_fft tau``); ``f = 1`` keeps the whole transform. The band stays within
    ``widest`` (a band already cut cannot widen; the base's own band met the same rule, so it always qualifies)."""
    f = comp.query_factor()
    while n_fft % (2 * f):
        f //= 2
    limit = math.log(sp.BAND_TAIL_MASS / (2.0 * n_fft))
    while f > 1:
        band = n_fft // (2 * f)
        if band >= widest:
            break
        log_tail = tail_at(band)
        if log_tail <= limit:
            return band, log_tail
        f //= 2
    band = min(n_fft // (2 * f), widest)
    return band, (tail_at(band) if band < n_fft // 2 else -math.inf)


def _rebased(comp: sp.Composition, factor: int, coarser: bool) -> sp.Composition:
    """``comp`` materialised (its window cut out: the mass it moves to the slack) and moved to the grid ``h * factor``
    (coarser: the pessimistic spread) or ``h / factor`` (finer: exact), as the anchor of a new composition."""
    if comp.rounds == 0:
        return _empty(comp.h * factor if coarser else comp.h / factor)
    dense = comp.dense()
    if coarser:
        h, dense = comp.h * factor, ps.coarsen(dense, comp.h, factor)
    else:
        h, dense = comp.h / factor, ps.refine(dense, factor)
    anchor = sp.anchor_item(dense)
    low, high, var, _ = anchor.stats()
    new = sp.Composition(h, sp.MIN_FFT, 0, np.ones(1), 0.0, anchor, {}, var, (low, high), comp.log_keep,
                         comp.slack + comp.cut_mass(), comp.rounds)
    n_fft = new.fft_size()
    band, log_tail = _band(new, n_fft, lambda b: anchor.tail(n_fft, b), n_fft // 2)
    return sp.Composition(h, n_fft, band, anchor.spectrum(n_fft)[: band + 1], log_tail, anchor, {}, var, (low, high),
                          comp.log_keep, new.slack, comp.rounds)


def _extend(base: sp.Composition, it: sp.Item, key: tuple, times: int) -> sp.Composition:
    """``base`` followed by ``times`` rounds ``it`` (on base's grid), on the circle and band the result needs."""
    low, high, var, log_keep = it.stats()
    counts = dict(base.counts)
    prev = counts.get(key)
    counts[key] = (it, times + (prev[1] if prev else 0))
    comp = sp.Composition(base.h, base.n_fft, 0, base.spectrum, 0.0, base.anchor, counts, base.var + times * var,
                          (base.support[0] + times * low, base.support[1] + times * high),
                          base.log_keep + times * log_keep, base.slack, base.rounds + times)
    k = comp.k_star()
    if k in base._lams:  # pylint: disable=protected-access
        up, dn = base._lams[k]  # pylint: disable=protected-access
        a, b = it.lam(k)
        comp._lams[k] = (up + times * a, dn + times * b)  # pylint: disable=protected-access
    n_fft = max(base.n_fft, comp.fft_size())
    if base.rounds:
        band, log_tail = _band(comp, n_fft, lambda b: times * it.tail(n_fft, b) + base.moved(n_fft, b)[1],
                               base.band if n_fft == base.n_fft else n_fft // 2)
        spectrum = _power(it.spectrum(n_fft)[: band + 1], times) * base.moved(n_fft, band)[0]
        if n_fft > base.n_fft:
            comp.slack = base.slack + base.cut_mass()
    else:  # nothing before: its transform is 1, its bound beyond any band 1
        band, log_tail = _band(comp, n_fft, lambda b: times * it.tail(n_fft, b), n_fft // 2)
        spectrum = _power(it.spectrum(n_fft)[: band + 1], times)
    spectrum.setflags(write=False)
    comp.n_fft, comp.band, comp.spectrum, comp.log_tail = n_fft, band, spectrum, log_tail
    return comp


@dataclass(frozen=True)
class ComposedClones:
    """The composed PLD of a sequence of rounds (immutable: :meth:`extended` returns a new one).

    Attributes:
        variant: the clone pair (``"stronger"`` or ``"focs"``).
        h: the grid interval.
        base: the composition of every run before the last one (on its own grid), or None.
        run: ``(n, eps0)`` of the last run, or None when empty.
        run_length: rounds in the last run.
        current: the composition of all rounds, or None when empty.
        rounds: the number of rounds.
    """

    variant: str
    h: float = 0.0
    base: sp.Composition | None = None
    run: tuple[int, float] | None = None
    run_length: int = 0
    current: sp.Composition | None = None
    rounds: int = 0
    _coarser: dict = field(default_factory=dict, compare=False, repr=False)

    def _start(self, n: int, eps0: float) -> sp.Composition:
        """The base of a new run ``(n, eps0)``: the composition so far, on a grid fine enough for the round
        (refined by powers of 2 while it fits)."""
        sd = loss_sd_estimate(eps0, n, self.variant)
        if self.current is None:  # a power of 2: nearby first rounds (and any refinement) share the grid
            return _empty(2.0 ** math.floor(math.log2(sd / INCREMENTAL_STEPS_PER_SD)))
        comp = self.current
        factor = 1
        lo, hi = comp.window()
        while (sd / (comp.h / factor) < INCREMENTAL_MIN_STEPS_PER_SD
               and 2 * factor * (hi - lo + 1) <= MAX_COMPOSED_GRID // 4):
            factor *= 2
        return comp if factor == 1 else _rebased(comp, factor, coarser=False)

    def extended(self, n: int, eps0: float, count: int = 1) -> ComposedClones:
        """These rounds followed by ``count`` rounds of ``n`` reports at ``eps0``.

        Args:
            n: reports in the round (validated by the caller).
            eps0: the round's local privacy parameter.
            count: how many such rounds, >= 1.

        Returns:
            The new composed state.
        """
        if self.run == (n, eps0):
            base, length, coarser = self.base, self.run_length + count, self._coarser
        else:
            base, length, coarser = self._start(n, eps0), count, {}
        level = 0
        while 2.0 * eps0 / (base.h * 2**level) > MAX_COMPOSED_GRID // 2:  # one round's losses lie in [-eps0, eps0]
            level += 1
        while True:
            if level not in coarser:  # one memo per run: the base of a run never changes
                coarser[level] = base if level == 0 else _rebased(base, 2**level, coarser=True)
            start = coarser[level]
            it = _round_item(n, eps0, self.variant, start.h)
            current = _extend(start, it, (n, float(eps0)), length)
            if current.n_fft <= MAX_COMPOSED_GRID:
                break
            level += 1
        return ComposedClones(self.variant, current.h, base, (n, eps0), length, current, self.rounds + count,
                              coarser)

    def query_dense(self) -> tuple[ps.Dense, float]:
        """The composition spread onto the query grid, with its infinity mass, and that grid's interval.

        Returns:
            ``((lower, probs, infinity), interval)``.
        """
        if self.current is None:
            raise ValueError("no round has been composed")
        return self.current.query_dense()

    def epsilon(self, delta: float) -> float:
        """``pld_epsilon(self.delta_pld(), delta)`` (:func:`shuffledp.accounting.composition.pld_epsilon`: the
        closed-form query, re-checked and stepped up until its delta is within target), bit for bit, on the dense
        arrays without building the PLD objects.

        Args:
            delta: 0 < delta < 1 (validated by the caller).

        Returns:
            The epsilon (``math.inf`` when more than ``delta`` of the mass has infinite loss).
        """
        (lower, probs, inf), interval = self.query_dense()
        return dense_epsilon(lower, probs, min(inf, 1.0), interval, delta)

    def delta_pld(self) -> _pld.PrivacyLossDistribution:
        """The composed PLD on the query grid (symmetric, pessimistic), for the queries of
        :mod:`shuffledp.accounting.pld`.

        Returns:
            The PLD.
        """
        dense, interval = self.query_dense()
        return ps.to_pld(dense, interval, pessimistic=True)


def _dense_delta(losses: np.ndarray, probs: np.ndarray, inf: float, eps: float) -> float:
    """:func:`shuffledp.accounting.pld.delta_for_epsilon` of one symmetric dense PMF (the same function)."""
    return min(1.0, max(0.0, _pld._delta_one(losses, probs, inf, eps)))  # pylint: disable=protected-access


def dense_epsilon(lower: int, probs: np.ndarray, inf: float, interval: float, delta: float) -> float:
    """:func:`shuffledp.accounting.composition.pld_epsilon` of the symmetric pessimistic PLD of a dense PMF, with
    the same operations on the same arrays (so the same float), without the PLD objects.

    Args:
        lower: grid index of ``probs[0]``.
        probs: masses on the grid ``interval``.
        inf: infinity mass, in [0, 1].
        interval: the grid interval.
        delta: 0 < delta < 1.

    Returns:
        The smallest checked epsilon (``math.inf`` when ``inf > delta``).
    """
    from shuffledp.accounting.composition import step_up_until_checked

    losses = (np.arange(probs.size) + lower) * interval
    value = float(_pld._eps_one(losses, probs, inf, delta))  # pylint: disable=protected-access
    if not math.isfinite(value):
        if inf > delta:
            return math.inf
        raise ArithmeticError(f"PLD epsilon query returned {value} at delta={delta} with only {inf!r} of the mass "
                              "at infinite loss: numerical failure of the PLD query; refusing to report it")
    return step_up_until_checked(value, delta, lambda eps: _dense_delta(losses, probs, inf, eps))


def fold(rounds: list[tuple[int, float]], variant: str, start: ComposedClones | None = None) -> ComposedClones:
    """Compose ``rounds`` (``(n, eps0)`` pairs, in order) onto ``start`` (default: nothing composed yet), one
    maximal run of equal rounds at a time (the canonical form, so the result depends on the rounds alone).

    Args:
        rounds: the rounds to add, in order.
        variant: the clone pair (``"stronger"`` or ``"focs"``).
        start: the composed state they follow.

    Returns:
        The composed state.
    """
    state = ComposedClones(variant) if start is None else start
    i = 0
    while i < len(rounds):
        j = i
        while j < len(rounds) and rounds[j] == rounds[i]:
            j += 1
        state = state.extended(rounds[i][0], rounds[i][1], j - i)
        i = j
    return state
