"""Randomized response in the shuffle model: the ``rr-lower`` lower bound and the ``no-shuffle`` composition.

Part of the published-bounds layer (:mod:`shuffledp.accounting.literature` re-exports every public name here).
Sources: Shvets, "Universal shuffle asymptotics: JSD and GDP", 2026 (seed 002), Lemma 3 (the exact likelihood
ratio of shuffled randomized response); Kairouz, Oh, Viswanath, "The composition theorem for differential
privacy", ICML 2015 / IEEE TIT 2017, Theorem 3.3 (randomized response is the worst case of eps0-DP).

Numerics: log space (``logsumexp``, ``log1p``/``expm1``); tails are summed from their own terms, never formed as
``1 - sum``. Root finds use :func:`scipy.optimize.brentq` with the tolerances named below, and the root is moved
to the certified side of the bound (:func:`certified_root`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special

from shuffledp.accounting.binomial import binom_logpmf

__all__ = [
    "ROOT_XTOL",
    "ROOT_RTOL",
    "RRShuffleLoss",
    "rr_shuffle_loss",
    "rr_lower_delta",
    "rr_lower_epsilon",
    "rr_lower_renyi",
    "no_shuffle_delta",
    "no_shuffle_epsilon",
    "certified_root",
]

#: Absolute tolerance on epsilon for the root finds of this module.
ROOT_XTOL = 1e-14
#: Relative tolerance on epsilon for the root finds of this module (brentq's floor is 4 machine epsilons).
ROOT_RTOL = 8.881784197001252e-16 * 4

# Binomial windows keep all but exp(-_TAIL_EXPONENT) of the mass on each side (Bernstein's inequality).
_TAIL_EXPONENT = 100.0


# ---------------------------------------------------------------------------------------------------------
# rr-lower: binary randomized response, the other n-1 users holding 0 (exact; a LOWER bound for eps0-LDP)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RRShuffleLoss:
    """Privacy loss of shuffled binary randomized response, first user 1 vs 0, the other n-1 users 0.

    The server sees ``K``, the number of 1s. Under D0 (all zeros) ``K ~ Bin(n, q)``, ``q = 1/(e^{eps0}+1)``;
    under D1 ``K ~ Bin(n-1, q) + Bern(1-q)``. By seed 002, Lemma 3 (exact likelihood ratio of shuffling), the
    likelihood ratio is ``L(k) = P1(k)/P0(k) = ((n-k) e^{-eps0} + k e^{eps0}) / n``.

    Attributes:
        k: the support points kept (all but ``exp(-100)`` of the mass on each side, or the full support).
        log_p0: ``log P0(k)``, normalised over ``k``.
        loss: ``log L(k)`` (the privacy loss of D1 against D0 at ``k``).
    """

    eps0: float
    n: int
    k: np.ndarray
    log_p0: np.ndarray
    loss: np.ndarray


def _binomial_window(n: int, p: float, tail_exponent: float = _TAIL_EXPONENT) -> tuple[int, int]:
    """``[lo, hi]`` holding all but ``exp(-tail_exponent)`` of ``Bin(n, p)`` on each side (Bernstein bound).

    Bernstein: ``P(|X - np| >= t) <= 2 exp(-t^2 / (2 (s^2 + t/3)))`` with ``s^2 = np(1-p)``; we take the
    ``t`` solving ``t^2 = 2 a (s^2 + t/3)`` with ``a = tail_exponent``.
    """
    s2 = n * p * (1.0 - p)
    a = tail_exponent
    t = (2.0 * a / 3.0 + math.sqrt((2.0 * a / 3.0) ** 2 + 8.0 * a * s2)) / 2.0
    mean = n * p
    return max(0, int(math.floor(mean - t))), min(n, int(math.ceil(mean + t)))


def _rr_binom_logpmf(k: np.ndarray, trials: int, eps0: float) -> np.ndarray:
    """log Bin(k; trials, 1/(e^eps0 + 1)) in Loader's saddle-point form
    (:func:`shuffledp.accounting.binomial.binom_logpmf`), accurate at large ``trials``, unlike a log-gamma
    difference such as scipy's ``binom.logpmf``."""
    return binom_logpmf(k, trials, -float(np.logaddexp(0.0, eps0)), -float(np.logaddexp(0.0, -eps0)))


def rr_shuffle_loss(eps0: float, n: int, *, full_support: bool = False) -> RRShuffleLoss:
    """Support, normalised ``log P0`` and privacy loss of shuffled binary RR (see :class:`RRShuffleLoss`).

    With ``full_support=False`` only a window holding all but ``e^{-100}`` of the mass on each side is kept;
    dropping mass can only lower the hockey-stick divergence, so values stay lower bounds.

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        full_support: keep the whole support instead of the window.

    Returns:
        An :class:`RRShuffleLoss`.
    """
    q = 1.0 / (math.exp(eps0) + 1.0) if eps0 < 700 else math.exp(-eps0)
    lo, hi = (0, n) if full_support else _binomial_window(n, q)
    k = np.arange(lo, hi + 1, dtype=np.int64)
    # Loader's saddle-point form, not a log-gamma difference (scipy's binom.logpmf): at n = 1e9 the latter is off
    # by 5e-6 relative per mass, and the reverse direction's masses P0 e^loss then summed to more than 1 + 1e-9
    # (multi-round rr-lower raised from n ~ 1e7 at eps0 = 15).
    log_p0 = _rr_binom_logpmf(k, n, eps0)
    log_p0 = log_p0 - special.logsumexp(log_p0)  # the window holds all but e^-100 of the mass on each side
    kf = k.astype(np.float64)
    with np.errstate(divide="ignore"):
        loss = np.logaddexp(np.log(n - kf) - eps0, np.log(kf) + eps0) - math.log(n)
    return RRShuffleLoss(eps0=eps0, n=n, k=k, log_p0=log_p0, loss=loss)


def _rr_delta_from(rr: RRShuffleLoss, epsilon: float) -> float:
    """Max over both directions of the hockey-stick divergence at ``epsilon`` (exact sum over the window)."""
    p0 = np.exp(rr.log_p0)
    # D1 vs D0: sum_k P0(k) (L(k) - e^eps)_+ = sum_k P0(k) e^eps expm1(loss - eps) over loss > eps.
    up = rr.loss > epsilon
    d10 = math.exp(epsilon) * float(np.sum(p0[up] * np.expm1(rr.loss[up] - epsilon))) if up.any() else 0.0
    # D0 vs D1: sum_k P0(k) (1 - e^eps L(k))_+ = sum_k P0(k) (-expm1(eps + loss)) over loss < -eps.
    down = rr.loss < -epsilon
    d01 = float(np.sum(p0[down] * -np.expm1(rr.loss[down] + epsilon))) if down.any() else 0.0
    return max(d10, d01, 0.0)


def rr_lower_delta(eps0: float, n: int, epsilon: float) -> float:
    """Exact delta(eps) of shuffled binary RR, others all 0 (max of both directions). Kind: LOWER.

    Any (eps, delta) guarantee for shuffling n general eps0-LDP reports must be at least this (binary RR is an
    eps0-LDP randomizer and this is one pair of neighbouring datasets).

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        epsilon: epsilon >= 0.

    Returns:
        The delta of one round.
    """
    return _rr_delta_from(rr_shuffle_loss(eps0, n), epsilon)


def rr_lower_epsilon(eps0: float, n: int, delta: float) -> float:
    """Exact eps(delta) of shuffled binary RR, others all 0. Kind: LOWER. Root find on [0, eps0] (brentq).

    Reference: n=1e4, eps0=1, delta=1e-6 gives 0.03565881530.

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        delta: target delta, 0 < delta < 1.

    Returns:
        The epsilon of one round.
    """
    rr = rr_shuffle_loss(eps0, n)
    if _rr_delta_from(rr, 0.0) <= delta:
        return 0.0
    hi = float(np.max(np.abs(rr.loss)))  # delta(eps) = 0 at the largest loss
    if _rr_delta_from(rr, hi) > delta:  # pragma: no cover - cannot happen: no mass above the largest loss
        raise ArithmeticError("rr-lower: delta at the largest privacy loss is not 0")
    return certified_root(lambda e: _rr_delta_from(rr, e), delta, 0.0, hi, upper=False)


def _log_moment(log_p0: np.ndarray, x: np.ndarray) -> float:
    """``log E_P0[e^x] = log sum_k P0(k) e^{x_k}`` without overflow, underflow or cancellation against 1.

    ``logsumexp(log_p0 + x)`` never overflows (``x`` may exceed 709, ``P0`` may underflow). When that log
    moment is small (<= ``_LOG_MOMENT_DIRECT``) its absolute error ~1e-16 would swamp a tiny divergence, so it
    is recomputed as ``log1p(sum_k P0(k) expm1(x_k))`` with every term finite: ``P0 expm1(x)`` where
    ``x <= 700`` and ``e^{log P0 + x} - P0`` above (each such term is <= e^{lse} there, so no overflow).
    """
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        lse = float(special.logsumexp(log_p0 + x))
    if math.isnan(lse):
        raise ArithmeticError("rr-lower: the Renyi moment sum is NaN (numerical failure); refusing to report it")
    if lse > _LOG_MOMENT_DIRECT:
        return lse
    p0 = np.exp(log_p0)
    big = x > 700.0
    with np.errstate(over="ignore", under="ignore"):
        terms = np.where(big, np.exp(np.where(big, log_p0 + x, 0.0)) - p0, p0 * np.expm1(np.minimum(x, 700.0)))
    return math.log1p(max(float(np.sum(terms)), 0.0))


#: Above this log moment, ``logsumexp`` is used as it is (relative error ~1e-16/0.5); below it, ``log1p``.
_LOG_MOMENT_DIRECT = 0.5


def rr_lower_renyi(eps0: float, n: int, order: float) -> float:
    """Exact Renyi divergence of order ``order`` > 1 of shuffled binary RR, others all 0, max of both directions.

    With ``loss_k = log(P1(k)/P0(k))``: ``D_a(P1||P0) = log sum_k P0(k) e^{a loss_k} / (a-1)`` and
    ``D_a(P0||P1) = log sum_k P1(k) e^{-a loss_k} / (a-1) = log sum_k P0(k) e^{(1-a) loss_k} / (a-1)``,
    computed over the full support in log space by :func:`_log_moment` (``a eps0`` may exceed 709 and P0 may
    underflow; small divergences go through ``log1p`` of a sum of ``expm1`` terms, no cancellation against 1).
    Kind: LOWER for general eps0-LDP randomizers (the lower curve of Figs. 2-3
    of Chen, Cao, Ge, ICASSP 2024, seed 000, is the weaker Girgis et al. eq. (6)).

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        order: Renyi order lambda > 1.

    Returns:
        The Renyi divergence of one round.
    """
    rr = rr_shuffle_loss(eps0, n, full_support=True)
    forward = _log_moment(rr.log_p0, order * rr.loss)
    backward = _log_moment(rr.log_p0, (1.0 - order) * rr.loss)
    return max(forward, backward, 0.0) / (order - 1.0)


# ---------------------------------------------------------------------------------------------------------
# no-shuffle: each eps0-DP report seen directly, composed optimally (Kairouz-Oh-Viswanath)
# ---------------------------------------------------------------------------------------------------------


def no_shuffle_delta(eps0: float, rounds: int, epsilon: float) -> float:
    """Exact optimal delta(eps) of ``rounds``-fold composition of eps0-DP. Kind: UPPER (and tight).

    Kairouz-Oh-Viswanath (2017), Theorem 3.3: randomized response with eps0 is the worst case of eps0-DP, so
    the composition's privacy loss is ``(T - 2l) eps0`` with ``l ~ Bin(T, q)``, ``q = 1/(e^{eps0}+1)`` and
    ``delta(eps) = sum_{l : (T-2l) eps0 > eps} P(l) (1 - e^{eps - (T-2l) eps0})`` (each term computed directly).

    Args:
        eps0: local privacy parameter eps0 > 0.
        rounds: number of rounds T >= 1.
        epsilon: epsilon >= 0.

    Returns:
        The delta.
    """
    t = int(rounds)
    if t <= NO_SHUFFLE_DIRECT_MAX:
        lo, hi = 0, t
    else:  # bounded memory: the window holding all but ~e^-800 of the mass, and a bound on the rest
        q = 1.0 / (math.exp(eps0) + 1.0)
        half = NO_SHUFFLE_WINDOW_SIGMAS * math.sqrt(t * q * (1.0 - q)) + 64.0
        lo, hi = max(0, math.floor(t * q - half)), min(t, math.ceil(t * q + half))
    ls = np.arange(lo, hi + 1)
    losses = (t - 2.0 * ls) * eps0
    above = losses > epsilon
    tail = _rr_binomial_tail_bound(t, eps0, lo, hi)
    if not above.any():
        return tail if lo > 0 and (t - 2.0 * (lo - 1)) * eps0 > epsilon else 0.0
    log_p = _rr_binom_logpmf(ls[above], t, eps0)
    return float(np.sum(np.exp(log_p) * -np.expm1(epsilon - losses[above]))) + tail


#: Up to this many rounds :func:`no_shuffle_delta` sums every term; beyond, a window of the binomial's mass and a
#: Chernoff bound on the rest (so memory and time stay bounded at any T, and the value stays an upper bound).
NO_SHUFFLE_DIRECT_MAX = 2_000_000
#: Half-width of that window in standard deviations (plus 64 terms): the mass outside is below e^-800.
NO_SHUFFLE_WINDOW_SIGMAS = 40.0


def _rr_binomial_tail_bound(t: int, eps0: float, lo: int, hi: int) -> float:
    """An upper bound on ``P(L < lo) + P(L > hi)`` for ``L ~ Bin(t, 1/(e^eps0 + 1))``: the Chernoff bound
    ``exp(-t KL(k/t || q))`` on each tail (Hoeffding, JASA 1963, Theorem 1), 0 where the window reaches the end.
    Each term of the delta sum is at most its probability, so adding this keeps :func:`no_shuffle_delta` an upper
    bound when it sums only ``[lo, hi]``."""
    q = 1.0 / (math.exp(eps0) + 1.0)

    def chernoff(k: float) -> float:
        x = k / t
        kl = x * math.log(x / q) if x > 0 else 0.0
        kl += (1.0 - x) * math.log((1.0 - x) / (1.0 - q)) if x < 1 else 0.0
        return math.exp(-t * kl)

    below = chernoff(lo - 1) if lo > 0 else 0.0
    above = chernoff(hi + 1) if hi < t else 0.0
    return below + above


def no_shuffle_epsilon(eps0: float, rounds: int, delta: float) -> float:
    """Exact optimal eps(delta) of ``rounds``-fold composition of eps0-DP (inverse of :func:`no_shuffle_delta`).

    Kind: UPPER. Root find on ``[0, T eps0]`` (``delta(T eps0) = 0``), brentq with ``ROOT_XTOL``/``ROOT_RTOL``.

    Args:
        eps0: local privacy parameter eps0 > 0.
        rounds: number of rounds T >= 1.
        delta: target delta, 0 < delta < 1.

    Returns:
        The epsilon.
    """
    top = rounds * eps0
    if no_shuffle_delta(eps0, rounds, 0.0) <= delta:
        return 0.0
    return certified_root(lambda e: no_shuffle_delta(eps0, rounds, e), delta, 0.0, top, upper=True)


def certified_root(delta_of: Callable[[float], float], delta: float, lo: float, hi: float, *, upper: bool) -> float:
    """The epsilon where the decreasing ``delta_of`` crosses ``delta`` (brentq on ``[lo, hi]``), moved to the
    certified side: ``delta_of(eps) <= delta`` for an upper bound, ``>= delta`` for a lower bound. brentq returns
    a point within its tolerance on either side of the root; this steps it outward by that tolerance, doubling,
    until the side holds (``hi`` satisfies the upper side and ``lo`` the lower side, so it ends).
    """
    eps = float(optimize.brentq(lambda e: delta_of(e) / delta - 1.0, lo, hi, xtol=ROOT_XTOL, rtol=ROOT_RTOL,
                                maxiter=500))
    step = ROOT_XTOL + ROOT_RTOL * abs(eps)
    if upper:
        while eps < hi and delta_of(eps) > delta:
            eps = min(hi, eps + step)
            step *= 2.0
    else:
        while eps > lo and delta_of(eps) < delta:
            eps = max(lo, eps - step)
            step *= 2.0
    return eps
