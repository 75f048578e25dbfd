"""Privacy loss distributions (PLDs): construction from exact losses, composition, queries.

A thin, validated layer over Google's ``dp_accounting`` PLD engine (``dp_accounting.pld``, pinned
``>=0.6,<0.7``). The hockey-stick divergence of a pair ``(P, Q)`` is

    delta(eps) = E_{o ~ P}[(1 - e^{eps - L(o)})_+],   L(o) = log(P(o) / Q(o)),

and the PLD of a composition is the convolution of the PLDs (Meiser & Mohammadi, CCS'18; Koskela,
Jaelkoe & Honkela, AISTATS'20; Doroshenko et al., PETS'22 "Connect the dots"). Because
``(1 - e^{eps - l})_+`` is non-decreasing in ``l``, moving probability mass to a *larger* loss (or to
``+inf``) can only increase ``delta`` of the composition, and moving it to a smaller loss (or dropping
it) can only decrease it. This gives the two discretisations:

* ``pessimistic=True``: losses rounded UP onto the grid ``k * interval``, truncated mass -> infinity
  mass. Every ``delta``/``eps`` computed from it (after any composition) is an upper bound.
* ``pessimistic=False``: losses rounded DOWN, truncated mass dropped. A lower bound (up to the
  FFT aliasing of the truncated self-convolution, at most ``_TAIL_MASS_TRUNCATION`` in delta per
  composition step; see :func:`compose`).

Self-composition (:func:`compose`) is done here with a real FFT and powers by repeated squaring inside
a Chernoff window (the same method as dp_accounting's ``self_compose``, about 3x faster, checked against
it and against direct convolution in the tests); the result is a ``dp_accounting`` ``DensePLDPmf``
wrapped in a ``PrivacyLossDistribution``, so either library's queries apply.

The queries :func:`epsilon_for_delta` and :func:`delta_for_epsilon` are vectorised re-implementations
of the same formulas (``dp_accounting``'s dense ``get_epsilon_for_delta`` is a Python loop over the grid,
which costs seconds on composed PLDs of millions of points). For non-symmetric PLDs they return the
maximum over the two directions (remove/add).

This module reads the private fields ``_pmf_remove``, ``_pmf_add``, ``_symmetric`` of
``PrivacyLossDistribution`` and ``_lower_loss``, ``_probs``, ``_discretization``, ``_infinity_mass``,
``_pessimistic_estimate`` of ``DensePLDPmf``; they are stable across dp_accounting 0.6.x, which the
project pins.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution
from scipy import fft as sfft
from scipy import special

from shuffledp.accounting.validation import check_delta, check_epsilon, check_real, check_rounds

__all__ = [
    "PrivacyLossDistribution",
    "pld_from_losses",
    "compose",
    "epsilon_for_delta",
    "delta_for_epsilon",
    "dense_parts",
    "MAX_GRID_POINTS",
    "check_interval",
]

#: Mass the self-convolution may cut from each tail (dp_accounting's default). For pessimistic PLDs it is
#: added to the infinity mass; for optimistic ones :func:`compose` removes that addition again.
_TAIL_MASS_TRUNCATION = 1e-15
#: Tolerance on ``sum(probs) + infinity_mass`` exceeding 1 (masses built from log-gamma functions).
MASS_SUM_TOLERANCE = 1e-9
#: Largest dense grid :func:`pld_from_losses` will build (about 400 MB of float64 for the FFT later).
MAX_GRID_POINTS = 50_000_000


def check_interval(value_discretization_interval: Any) -> float:
    """A grid interval: a finite real number > 0.

    Args:
        value_discretization_interval: the value to check.

    Returns:
        The value as a float.

    Raises:
        TypeError: not a real number. ValueError: not finite or <= 0.
    """
    allowed = "a finite real number > 0"
    h = check_real("value_discretization_interval", value_discretization_interval, allowed)
    if not (math.isfinite(h) and h > 0):
        raise ValueError(f"value_discretization_interval must be {allowed}, got {h!r}")
    return h


def _check_mass(name: str, value: Any) -> float:
    allowed = "a real number in [0, 1]"
    v = check_real(name, value, allowed)
    if not (math.isfinite(v) and 0.0 <= v <= 1.0):
        raise ValueError(f"{name} must be {allowed}, got {v!r}")
    return v


def _rounded_pmf(
    losses: np.ndarray,
    probs: np.ndarray,
    infinity_mass: float,
    pessimistic: bool,
    h: float,
    which: str,
    tail_mass_truncation: float = 0.0,
) -> pld_pmf.DensePLDPmf:
    losses = np.asarray(losses, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    if losses.ndim != 1 or probs.ndim != 1 or losses.shape != probs.shape:
        raise ValueError(
            f"{which}: losses and probs must be 1-D arrays of the same length, got shapes "
            f"{losses.shape} and {probs.shape}"
        )
    if losses.size == 0 and infinity_mass == 0.0:
        raise ValueError(f"{which}: losses is empty and infinity_mass is 0: not a distribution")
    if np.any(np.isnan(losses)):
        raise ValueError(f"{which}: losses contain NaN")
    if np.any(np.isneginf(losses)):
        raise ValueError(
            f"{which}: a loss of -inf means P(o) = 0; remove such outcomes (they carry no P-mass)"
        )
    if not np.all(np.isfinite(probs)) or np.any(probs < 0):
        raise ValueError(f"{which}: probs must be finite and >= 0")
    # Outcomes with loss +inf (Q(o) = 0) belong to the infinity mass, in both estimates.
    posinf = np.isposinf(losses)
    if np.any(posinf):
        infinity_mass = infinity_mass + float(probs[posinf].sum())
        losses, probs = losses[~posinf], probs[~posinf]
    total = float(probs.sum()) + infinity_mass
    if total > 1.0 + MASS_SUM_TOLERANCE:
        raise ValueError(
            f"{which}: probs sum to {total - infinity_mass!r} plus infinity_mass {infinity_mass!r} "
            f"= {total!r} > 1 (tolerance MASS_SUM_TOLERANCE={MASS_SUM_TOLERANCE})"
        )
    # Outcomes of zero mass carry nothing; dropping them keeps the grid short.
    nz = probs > 0.0
    if not np.all(nz):
        losses, probs = losses[nz], probs[nz]
    if tail_mass_truncation > 0.0 and losses.size > 1:
        order = np.argsort(losses, kind="stable")
        losses, probs = losses[order], probs[order]
        half = 0.5 * tail_mass_truncation
        # largest prefix / suffix whose mass is at most half the budget each
        left = int(np.searchsorted(np.cumsum(probs), half, side="right"))
        right = int(np.searchsorted(np.cumsum(probs[::-1]), half, side="right"))
        left = min(left, losses.size - 1)
        right = min(right, losses.size - 1 - left)
        left_mass = float(probs[:left].sum())
        right_mass = float(probs[losses.size - right :].sum())
        losses = losses[left : losses.size - right]
        probs = probs[left : probs.size - right].copy()
        if pessimistic:
            probs[0] += left_mass  # moved UP to the smallest kept loss
            infinity_mass = infinity_mass + right_mass
        else:
            probs[-1] += right_mass  # moved DOWN to the largest kept loss; left mass dropped
    if losses.size == 0:
        idx = np.zeros(1, dtype=np.int64)
        probs = np.zeros(1)
    else:
        scaled = losses / h
        idx = np.ceil(scaled) if pessimistic else np.floor(scaled)
        lo, hi = float(idx.min()), float(idx.max())
        if hi - lo + 1 > MAX_GRID_POINTS:
            raise ValueError(
                f"{which}: losses span [{losses.min()!r}, {losses.max()!r}], which needs "
                f"{int(hi - lo + 1)} grid points at value_discretization_interval={h!r}; at most "
                f"MAX_GRID_POINTS={MAX_GRID_POINTS} are allowed: use a larger interval"
            )
        idx = idx.astype(np.int64)
    lower = int(idx.min())
    dense = np.bincount(idx - lower, weights=probs) if losses.size else probs
    return pld_pmf.DensePLDPmf(h, lower, dense.astype(np.float64), float(infinity_mass), pessimistic)


def pld_from_losses(
    losses: np.ndarray,
    probs: np.ndarray,
    *,
    infinity_mass: float,
    pessimistic: bool,
    value_discretization_interval: float,
    losses_reverse: np.ndarray | None = None,
    probs_reverse: np.ndarray | None = None,
    infinity_mass_reverse: float | None = None,
    tail_mass_truncation: float = 0.0,
) -> PrivacyLossDistribution:
    """Discretise exact privacy losses into a dense ``dp_accounting`` PLD.

    ``losses[i] = log(P(o_i) / Q(o_i))`` and ``probs[i] = P(o_i)`` describe the loss distribution of
    ``(P, Q)`` under ``P``; ``infinity_mass`` is the P-mass of outcomes with ``Q(o) = 0`` plus any mass
    the caller truncated pessimistically. Losses are rounded up (``pessimistic=True``) or down onto
    multiples of ``value_discretization_interval`` (Koskela et al. 2020; dp_accounting's
    ``from_two_probability_mass_functions`` does the same per outcome, this does it vectorised).
    ``+inf`` losses are moved to the infinity mass.

    If ``losses_reverse``/``probs_reverse`` are given they describe the other direction ``(Q, P)``
    and the PLD is non-symmetric (its queries take the maximum of both directions);
    ``infinity_mass_reverse`` defaults to ``infinity_mass``. Otherwise the PLD is symmetric: only use
    that when the pair is symmetric (the two loss distributions coincide).

    ``tail_mass_truncation`` (default 0) cuts at most half of it from each end of the loss distribution
    (like dp_accounting's ``_truncate_tails``): pessimistic -> the low end is merged into the smallest
    kept loss (moved up) and the high end goes to the infinity mass; optimistic -> the high end is merged
    into the largest kept loss (moved down) and the low end is dropped. Both keep the estimate's
    direction. Outcomes of zero mass are always dropped.

    Args:
        losses: privacy losses of the support points.
        probs: their probabilities.
        infinity_mass: probability of an infinite loss.
        pessimistic: pessimistic (an upper bound) or optimistic (a lower bound on the pair) discretisation.
        value_discretization_interval: grid interval, or None for :func:`suggested_interval`.
        losses_reverse: losses of the other direction, or None for a symmetric PLD.
        probs_reverse: their probabilities.
        infinity_mass_reverse: infinite-loss mass of the other direction.
        tail_mass_truncation: mass that may be cut from each tail.

    Returns:
        The PLD.
    """
    h = check_interval(value_discretization_interval)
    if not isinstance(pessimistic, bool):
        raise TypeError(f"pessimistic must be a bool, got {type(pessimistic).__name__}")
    inf_mass = _check_mass("infinity_mass", infinity_mass)
    tail = _check_mass("tail_mass_truncation", tail_mass_truncation)
    pmf_remove = _rounded_pmf(losses, probs, inf_mass, pessimistic, h, "remove direction", tail)
    if (losses_reverse is None) != (probs_reverse is None):
        raise ValueError("give both losses_reverse and probs_reverse, or neither")
    if losses_reverse is None:
        if infinity_mass_reverse is not None:
            raise ValueError("infinity_mass_reverse given without losses_reverse/probs_reverse")
        return PrivacyLossDistribution(pmf_remove)
    inf_rev = inf_mass if infinity_mass_reverse is None else _check_mass(
        "infinity_mass_reverse", infinity_mass_reverse
    )
    pmf_add = _rounded_pmf(
        losses_reverse, probs_reverse, inf_rev, pessimistic, h, "add direction", tail
    )
    return PrivacyLossDistribution(pmf_remove, pmf_add)


def _pmfs(pld: PrivacyLossDistribution) -> list[pld_pmf.PLDPmf]:
    if not isinstance(pld, PrivacyLossDistribution):
        raise TypeError(
            f"expected a dp_accounting PrivacyLossDistribution, got {type(pld).__name__}"
        )
    if pld._symmetric:  # pylint: disable=protected-access
        return [pld._pmf_remove]  # pylint: disable=protected-access
    return [pld._pmf_remove, pld._pmf_add]  # pylint: disable=protected-access


def dense_parts(pld: PrivacyLossDistribution) -> list[tuple[np.ndarray, np.ndarray, float]]:
    """``[(losses, probs, infinity_mass)]`` for each direction of ``pld`` (one if symmetric).

    Args:
        pld: a privacy loss distribution.

    Returns:
        ``(losses, probs, infinity mass)`` per direction.
    """
    out = []
    for pmf in _pmfs(pld):
        d = pmf.to_dense_pmf()
        # pylint: disable=protected-access
        losses = (np.arange(d.size) + d._lower_loss) * d._discretization
        out.append((losses, np.asarray(d._probs, dtype=np.float64), float(d._infinity_mass)))
        # pylint: enable=protected-access
    return out


def _meta(pld: PrivacyLossDistribution) -> tuple[float, bool]:
    pmf = _pmfs(pld)[0]
    return float(pmf._discretization), bool(pmf._pessimistic_estimate)  # pylint: disable=protected-access


def _less_infinity(pmf: pld_pmf.PLDPmf, amount: float) -> pld_pmf.DensePLDPmf:
    d = pmf.to_dense_pmf()
    # pylint: disable=protected-access
    return pld_pmf.DensePLDPmf(
        d._discretization, d._lower_loss, d._probs, max(0.0, d._infinity_mass - amount), False
    )
    # pylint: enable=protected-access


def _unbias(pld: PrivacyLossDistribution, amount: float) -> PrivacyLossDistribution:
    """Remove ``amount`` of infinity mass that dp_accounting adds for tail truncation (optimistic)."""
    pmfs = [_less_infinity(p, amount) for p in _pmfs(pld)]
    return PrivacyLossDistribution(pmfs[0], pmfs[1] if len(pmfs) == 2 else None)


def _chernoff_window(probs: np.ndarray, times: int, tail: float) -> tuple[int, int]:
    """Index range ``[lo, hi]`` (offsets from ``times * lower``) outside which the ``times``-fold
    convolution of ``probs`` has at most ``tail / 2`` mass on each side.

    Chernoff: ``P(S >= b) <= exp(times log M(t) - t b)`` for ``t > 0`` (and the mirror for ``t < 0``),
    ``M(t) = sum_k p_k e^{t k}``; the bound is minimised over 25 values of ``t`` around the Gaussian
    optimum ``sqrt(2 log(2/tail) / times) / sd``.
    """
    k = np.arange(probs.size, dtype=np.float64)
    pos = probs > 0
    kk, lp = k[pos], np.log(probs[pos])
    total = float(probs[pos].sum())
    mean = float(np.dot(kk, probs[pos]) / total)
    sd = math.sqrt(max(float(np.dot((kk - mean) ** 2, probs[pos]) / total), 1e-12))
    log_budget = math.log(2.0 / tail)
    t_star = math.sqrt(2.0 * log_budget / times) / sd
    hi_full = (probs.size - 1) * times
    lo, hi = 0, hi_full
    for t in t_star * np.geomspace(0.1, 10.0, 25):
        for sgn in (1.0, -1.0):
            tt = sgn * t
            # log M(tt) about the mean, so exponents stay small
            log_m = float(special.logsumexp(tt * (kk - mean) + lp))
            b = (times * log_m + log_budget) / tt + times * mean  # bound on S (index units)
            if not math.isfinite(b):
                continue
            if sgn > 0:
                hi = min(hi, int(math.ceil(b)))
            else:
                lo = max(lo, int(math.floor(b)))
    lo = max(0, min(lo, hi_full))
    hi = max(lo, min(hi, hi_full))
    return lo, hi


def _self_compose_dense(pmf: pld_pmf.PLDPmf, times: int, tail: float) -> pld_pmf.DensePLDPmf:
    """``times``-fold self-composition of a PMF: real FFT, power by repeated squaring, inverse FFT.

    The output keeps only the Chernoff window (:func:`_chernoff_window`); the circular convolution
    aliases the at most ``tail`` mass outside it into the window. As in dp_accounting, ``tail`` is added
    to the infinity mass, which covers that aliasing for pessimistic PMFs (any mass moved down changes
    delta by at most its size). Infinity mass composes as ``1 - (1 - inf)^times`` (log1p/expm1).
    FFT round-off (about 1e-16 of the largest mass) can leave tiny negative entries; they are set to 0.
    """
    d = pmf.to_dense_pmf()
    # pylint: disable=protected-access
    probs = np.asarray(d._probs, dtype=np.float64)
    lower = int(d._lower_loss)
    inf_mass = float(d._infinity_mass)
    h = float(d._discretization)
    pess = bool(d._pessimistic_estimate)
    # pylint: enable=protected-access
    new_inf = min(1.0, tail - math.expm1(times * math.log1p(-min(inf_mass, 1.0))))
    if not np.any(probs > 0):
        return pld_pmf.DensePLDPmf(h, lower * times, np.zeros(1), min(1.0, new_inf - tail), pess)
    lo, hi = _chernoff_window(probs, times, tail)
    out_len = hi - lo + 1
    if out_len > MAX_GRID_POINTS:
        raise ValueError(
            f"composing {times} times needs {out_len} grid points at interval {h!r}; at most "
            f"MAX_GRID_POINTS={MAX_GRID_POINTS} are allowed: use a larger value_discretization_interval"
        )
    n_fft = sfft.next_fast_len(max(out_len, probs.size), real=True)
    base = sfft.rfft(probs, n_fft)
    result = None
    e = times
    while e > 0:
        if e & 1:
            if result is None:
                result = base.copy()
            else:
                np.multiply(result, base, out=result)
        e >>= 1
        if e:
            np.multiply(base, base, out=base)
    del base
    circ = sfft.irfft(result, n_fft)
    del result
    start = lo % n_fft
    if start + out_len <= n_fft:
        out = circ[start : start + out_len]
    else:
        out = np.concatenate((circ[start:], circ[: out_len - (n_fft - start)]))
    out = np.maximum(out, 0.0)
    return pld_pmf.DensePLDPmf(h, lower * times + lo, out, new_inf, pess)


def compose(
    plds_with_counts: Sequence[tuple[PrivacyLossDistribution, int]],
) -> PrivacyLossDistribution:
    """Compose ``pld_1`` ``count_1`` times with ``pld_2`` ``count_2`` times, and so on.

    Self-composition is one FFT power (:func:`_self_compose_dense`), different PLDs are convolved
    pairwise (dp_accounting ``compose``). All PLDs must share the discretisation interval and the
    estimate type. Each step may cut tail mass of at most ``_TAIL_MASS_TRUNCATION`` (Chernoff bounds);
    pessimistic PLDs carry it as infinity mass (a valid upper bound). For optimistic PLDs that
    infinity-mass addition is removed again, so the result stays a lower bound up to FFT aliasing of at
    most ``_TAIL_MASS_TRUNCATION`` in delta per step.

    Args:
        plds_with_counts: ``(PrivacyLossDistribution, count)`` pairs sharing interval and discretisation.

    Returns:
        The composed PLD.
    """
    if isinstance(plds_with_counts, (str, bytes)) or not isinstance(plds_with_counts, Sequence):
        raise TypeError("plds_with_counts must be a sequence of (PrivacyLossDistribution, count)")
    if len(plds_with_counts) == 0:
        raise ValueError("plds_with_counts is empty: nothing to compose")
    items = []
    for i, item in enumerate(plds_with_counts):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"item {i} must be a (PrivacyLossDistribution, count) tuple")
        pld, count = item
        items.append((pld, check_rounds(count, f"item {i}: count")))
    h0, pess0 = _meta(items[0][0])
    for i, (pld, _) in enumerate(items):
        h, pess = _meta(pld)
        if h != h0 or pess != pess0:
            raise ValueError(
                f"item {i} has interval {h!r} / pessimistic={pess}, item 0 has interval {h0!r} / "
                f"pessimistic={pess0}: all PLDs must share both"
            )
    result = None
    for pld, count in items:
        part = pld
        if count > 1:
            pmfs = [_self_compose_dense(p, count, _TAIL_MASS_TRUNCATION) for p in _pmfs(pld)]
            part = PrivacyLossDistribution(pmfs[0], pmfs[1] if len(pmfs) == 2 else None)
            if not pess0:
                part = _unbias(part, _TAIL_MASS_TRUNCATION)
        result = part if result is None else result.compose(
            part, tail_mass_truncation=_TAIL_MASS_TRUNCATION
        )
    return result


def _eps_one(losses: np.ndarray, probs: np.ndarray, inf_mass: float, delta: float) -> float:
    """Smallest eps >= 0 with delta(eps) <= delta for one direction; ``losses`` ascending (as from :func:`dense_parts`).

    For eps in [l_{k-1}, l_k): delta(eps) = U_k - e^eps W_k with U_k = inf + sum_{j>=k} p_j and W_k = sum_{j>=k}
    p_j e^{-l_j}; each such line is a lower bound on delta(eps) everywhere, and the line of the interval that holds
    eps* is tight, so eps* = max(0, max_k log((U_k - delta) / W_k)) (Koskela, Jalko, Honkela, AISTATS 2020). Only
    k with l_k > 0, U_k > delta and W_k > 0 count: both sums shrink with k, so those k are a prefix. ``log W_k`` is
    accumulated in log space where e^{-l} would underflow (losses of composed PLDs reach hundreds).
    """
    if inf_mass > delta:
        return math.inf
    start = int(np.searchsorted(losses, 0.0, side="right"))
    lk, pk = losses[start:], np.maximum(probs[start:], 0.0)
    if lk.size == 0:
        return 0.0
    u = inf_mass + np.cumsum(pk[::-1])[::-1]
    l_min, l_max = float(lk[0]), float(lk[-1])
    terms = pk * np.exp(l_min - lk) if l_max - l_min < 600.0 else None
    if terms is not None and np.count_nonzero(terms) == np.count_nonzero(pk):  # no positive term underflowed
        # W_k = e^{-l_min} sum_{j>=k} p_j e^{-(l_j - l_min)}: no overflow, and no term underflowed
        w = np.cumsum(terms[::-1])[::-1]
        kept = min(int(np.count_nonzero(u > delta)), int(np.count_nonzero(w > 0.0)))
        log_w = np.log(w[:kept]) - l_min
    else:
        with np.errstate(divide="ignore"):
            log_w = np.logaddexp.accumulate((np.log(pk) - lk)[::-1])[::-1]
        kept = min(int(np.count_nonzero(u > delta)), int(np.count_nonzero(np.isfinite(log_w))))
        log_w = log_w[:kept]
    if kept == 0:
        return 0.0
    return max(0.0, float((np.log(u[:kept] - delta) - log_w).max()))


def _delta_one(losses: np.ndarray, probs: np.ndarray, inf_mass: float, epsilon: float) -> float:
    """``inf + sum_{l > eps} p (1 - e^{eps - l})``, one direction, ``losses`` ascending, not clipped (a fresh copy of
    the masses is summed, so the result does not depend on where they sit in memory)."""
    start = int(np.searchsorted(losses, epsilon, side="right"))
    return inf_mass - float(np.dot(np.expm1(epsilon - losses[start:]), probs[start:].copy()))  # -(sum p expm1)


def epsilon_for_delta(pld: PrivacyLossDistribution, delta: float) -> float:
    """Smallest eps >= 0 such that the hockey-stick divergence of ``pld`` at eps is <= ``delta``.

    Maximum over both directions for non-symmetric PLDs; ``math.inf`` if the infinity mass exceeds
    ``delta``. Same result as dp_accounting's ``get_epsilon_for_delta`` (Koskela et al. 2020, eq. for
    the discrete PLD), vectorised.

    Args:
        pld: a privacy loss distribution.
        delta: target delta, 0 < delta < 1.

    Returns:
        The epsilon.
    """
    d = check_delta(delta)
    return max(_eps_one(losses, p, inf, d) for losses, p, inf in dense_parts(pld))


def delta_for_epsilon(pld: PrivacyLossDistribution, epsilon: float) -> float:
    """Hockey-stick divergence ``inf + sum_{l > eps} p (1 - e^{eps - l})`` (max over directions).

    Args:
        pld: a privacy loss distribution.
        epsilon: epsilon >= 0.

    Returns:
        The delta.
    """
    e = check_epsilon(epsilon, allow_inf=True)
    best = 0.0
    for losses, probs, inf in dense_parts(pld):
        best = max(best, inf if math.isinf(e) else _delta_one(losses, probs, inf, e))
    return min(1.0, max(0.0, best))
