"""The published shuffle-model bounds, each as a plain function with its source, equation and kind.

Every function here works on ONE round unless its name says otherwise; composition over rounds is done by
:mod:`shuffledp.accounting.bounds`. Kinds: ``upper`` (a guarantee), ``approximate`` (a CLT value, may fall below the
truth), ``lower`` (the loss of a concrete instance; any valid general bound is at least this).

Sources (see ``seeds/README.md`` of the project for the copies and their known errors):

* seed 000: Chen, Cao, Ge, "Renyi DP in the shuffle model: enhanced amplification bounds", ICASSP 2024.
* seed 002: Shvets, "Universal shuffle asymptotics: JSD and GDP", 2026.
* FMT'21: Feldman, McMillan, Talwar, "Hiding among the clones", FOCS 2021, Theorem 3.1.
* Girgis et al., "On the Renyi differential privacy of the shuffle model", CCS 2021 (as quoted in seed 000).
* Dong, Roth, Su, "Gaussian differential privacy", JRSS-B 2022 (the GDP (eps, delta) curve, Cor. 2.13).
* Kairouz, Oh, Viswanath, "The composition theorem for differential privacy", ICML 2015 / IEEE TIT 2017.

Numerics: log space (``scipy.special.log_ndtr``, ``logaddexp``, ``log1p``/``expm1``); tails are summed from
their own terms, never formed as ``1 - sum``. Root finds use :func:`scipy.optimize.brentq` with the
tolerances named below.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special

from shuffledp.accounting import RefusedError
from shuffledp.accounting.clones import _binom_logpmf

__all__ = [
    "ROOT_XTOL",
    "ROOT_RTOL",
    "clt_expected_clones_ok",
    "require_clt_regime",
    "gdp_delta",
    "gdp_epsilon",
    "ccg_gdp_mu",
    "ccg_rdp",
    "girgis_rdp_upper",
    "girgis_rdp_lower",
    "fmt_validity_limit",
    "fmt_epsilon",
    "fmt_epsilon_eq33_as_printed",
    "RRShuffleLoss",
    "rr_shuffle_loss",
    "rr_lower_delta",
    "rr_lower_epsilon",
    "rr_lower_renyi",
    "canonical_mu",
    "canonical_gdp_epsilon",
    "canonical_jsd_expansion",
    "no_shuffle_delta",
    "no_shuffle_epsilon",
]

#: Absolute tolerance on epsilon for the root finds of this module.
ROOT_XTOL = 1e-14
#: Relative tolerance on epsilon for the root finds of this module (brentq's floor is 4 machine epsilons).
ROOT_RTOL = 8.881784197001252e-16 * 4

# Binomial windows keep all but exp(-_TAIL_EXPONENT) of the mass on each side (Bernstein's inequality).
_TAIL_EXPONENT = 100.0


# ---------------------------------------------------------------------------------------------------------
# CLT refusal rule (seeds README: the CLT families fall below the exact value when few clones are expected)
# ---------------------------------------------------------------------------------------------------------


def clt_expected_clones_ok(eps0: float, n: int, delta: float) -> bool:
    """True when ``n / (e^{eps0} + 1) >= 2 ln(1/delta)``: enough expected clones for a CLT value to be sane.

    Below this line the asymptotic (CLT) families were measured to fall BELOW the exact value (e.g. n=1e4,
    eps0=8, delta=1e-6); see the project's seeds README. Evaluated in log space.
    """
    lhs = math.log(n) - (eps0 + math.log1p(math.exp(-eps0)))
    rhs = math.log(2.0) + math.log(-math.log(delta))
    return lhs >= rhs


def require_clt_regime(family: str, eps0: float, n: int, delta: float, allow_approximate: bool) -> None:
    """Raise :class:`RefusedError` unless the CLT rule holds or ``allow_approximate`` is set."""
    if n < 2:
        raise RefusedError(f"{family} needs n >= 2 reports (its mu has sqrt(n - 1) in the denominator), got n={n}")
    if allow_approximate or clt_expected_clones_ok(eps0, n, delta):
        return
    expected = n / (math.exp(eps0) + 1.0) if eps0 < 700 else 0.0
    raise RefusedError(
        f"{family} is a CLT approximation and is refused here: n/(e^eps0+1) = {expected:.4g} expected clones "
        f"< 2 ln(1/delta) = {2.0 * math.log(1.0 / delta):.4g} (n={n}, eps0={eps0}, delta={delta}); in this "
        "regime it can fall below the true privacy loss. Use an upper family (clones) or pass "
        "allow_approximate=True to get the approximate value anyway."
    )


# ---------------------------------------------------------------------------------------------------------
# Gaussian differential privacy
# ---------------------------------------------------------------------------------------------------------


def gdp_delta(mu: float, epsilon: float) -> float:
    """``delta_mu(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``: the (eps, delta) curve of mu-GDP.

    Dong, Roth, Su (2022), Corollary 2.13; seed 002 eq. (31); seed 000 via Theorem 2. Exact (it is the curve of
    the Gaussian pair N(0,1) vs N(mu,1)). Computed in log space with ``log_ndtr``.
    """
    if mu <= 0.0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    a = -epsilon / mu + mu / 2.0
    b = -epsilon / mu - mu / 2.0
    log_first = float(special.log_ndtr(a))
    log_second = epsilon + float(special.log_ndtr(b))
    diff = log_second - log_first  # < 0 by the Gaussian likelihood-ratio identity
    if diff >= 0.0:
        return 0.0
    return math.exp(log_first + math.log(-math.expm1(diff)))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest ``eps >= 0`` with ``delta_mu(eps) <= delta`` (inverse of :func:`gdp_delta`).

    Root find (brentq, tolerances ``ROOT_XTOL``/``ROOT_RTOL``) on ``log delta_mu(eps) - log delta``, which is
    decreasing in eps. The bracket's upper end ``mu^2/2 + mu z`` with ``Phi(-z) = delta`` has
    ``delta_mu <= Phi(-eps/mu + mu/2) <= delta``.
    """
    if mu <= 0.0:
        return 0.0
    if gdp_delta(mu, 0.0) <= delta:
        return 0.0
    z = -float(special.ndtri(delta))
    hi = mu * mu / 2.0 + mu * max(z, 0.0) + 1e-300
    while gdp_delta(mu, hi) > delta:  # guard against rounding at the bracket end
        hi *= 2.0
    log_delta = math.log(delta)

    def f(eps: float) -> float:
        d = gdp_delta(mu, eps)
        return (math.log(d) if d > 0.0 else -math.inf) - log_delta

    if f(hi) == 0.0:
        return hi
    return float(optimize.brentq(lambda e: max(f(e), -1e300), 0.0, hi, xtol=ROOT_XTOL, rtol=ROOT_RTOL, maxiter=500))


def ccg_gdp_mu(eps0: float, n: int) -> float:
    """``mu = 2 e^{eps0/2} / sqrt(n - 1)``: seed 000, Theorem 2. Kind: APPROXIMATE (a CLT limit, not a bound).

    One round of n shuffled eps0-LDP reports "approximately satisfies" mu-GDP. T rounds compose to
    ``sqrt(T) mu`` (Dong-Roth-Su 2022, Cor. 3.3). Needs n >= 2.
    """
    if n < 2:
        raise RefusedError(f"ccg-gdp needs n >= 2 reports, got n={n}")
    return 2.0 * math.exp(eps0 / 2.0) / math.sqrt(n - 1)


def ccg_rdp(eps0: float, n: int, order: float) -> float:
    """``(lambda, 2 e^{eps0} lambda / (n - 1))``-RDP: seed 000, Corollary 2. Kind: APPROXIMATE.

    It is Theorem 2's mu-GDP through "mu-GDP implies (lambda, mu^2 lambda / 2)-RDP" (Bun-Steinke 2016,
    Prop. 1.6; Dong-Roth-Su 2022). Corollary 2 states it for lambda >= 2, and so do we: RefusedError below 2.
    """
    if n < 2:
        raise RefusedError(f"ccg-rdp needs n >= 2 reports, got n={n}")
    if not order >= 2.0:
        raise RefusedError(f"ccg-rdp (seed 000 Cor. 2) is stated for orders lambda >= 2, got order={order}")
    return 2.0 * math.exp(eps0) * order / (n - 1)


# ---------------------------------------------------------------------------------------------------------
# Girgis et al. CCS'21 (as given in seed 000, eqs. (5) and (6))
# ---------------------------------------------------------------------------------------------------------


def _require_integer_order(family: str, order: float) -> int:
    if order != math.floor(order) or order < 2:
        raise RefusedError(f"{family} is stated for integer Renyi orders lambda >= 2 only, got order={order!r}")
    return int(order)


def girgis_rdp_upper(eps0: float, n: int, order: float) -> float:
    """Girgis et al. CCS'21 RDP upper bound as printed in seed 000, eq. (5). Kind: UPPER.

    ``eps(lambda) <= 1/(lambda-1) log( exp(lambda^2 (e^{eps0}-1)^2 / nbar) + exp(eps0 lambda - (n-1)/(8 e^{eps0})) )``
    with ``nbar = floor((n-1) / (2 e^{eps0})) + 1``, for integer ``lambda >= 2``. Evaluated with ``logaddexp``.
    """
    lam = _require_integer_order("girgis", order)
    nbar = math.floor((n - 1) / (2.0 * math.exp(eps0))) + 1
    first = lam * lam * math.expm1(eps0) ** 2 / nbar
    second = eps0 * lam - (n - 1) / (8.0 * math.exp(eps0))
    return float(np.logaddexp(first, second)) / (lam - 1)


def girgis_rdp_lower(eps0: float, n: int, order: float) -> float:
    """Girgis et al. CCS'21 RDP lower bound as printed in seed 000, eq. (6). Kind: LOWER.

    ``eps(lambda) >= 1/(lambda-1) log(1 + lambda(lambda-1)/2 (e^{eps0}-1)^2 / (n e^{eps0}))`` for integer
    ``lambda >= 2``. It bounds a Renyi divergence from below; no (eps, delta) lower bound follows from it by the
    usual (upper-bound) conversions.
    """
    lam = _require_integer_order("girgis-lower", order)
    chi2 = 4.0 * math.sinh(eps0 / 2.0) ** 2  # (e^{eps0}-1)^2 / e^{eps0}
    return math.log1p(lam * (lam - 1) / 2.0 * chi2 / n) / (lam - 1)


# ---------------------------------------------------------------------------------------------------------
# Feldman-McMillan-Talwar FOCS'21, Theorem 3.1
# ---------------------------------------------------------------------------------------------------------


def fmt_validity_limit(n: int, delta: float) -> float:
    """The largest eps0 FMT'21 Theorem 3.1 covers: ``log(n / (16 log(2/delta)))`` (may be negative)."""
    return math.log(n) - math.log(16.0 * math.log(2.0 / delta))


def _require_fmt_valid(eps0: float, n: int, delta: float) -> None:
    limit = fmt_validity_limit(n, delta)
    if eps0 > limit:
        raise RefusedError(
            f"fmt (FMT'21 Theorem 3.1) holds only for eps0 <= log(n / (16 log(2/delta))) = {limit:.6g} "
            f"(n={n}, delta={delta}); got eps0={eps0}. Use the clones family, which has no such restriction."
        )


def fmt_epsilon(eps0: float, n: int, delta: float) -> float:
    """FMT'21 Theorem 3.1, the paper's bracketing. Kind: UPPER. Raises RefusedError outside its validity region.

    ``eps = log(1 + (e^{eps0}-1)/(e^{eps0}+1) * (8 sqrt(e^{eps0} log(4/delta)) / sqrt(n) + 8 e^{eps0} / n))``
    for ``eps0 <= log(n / (16 log(2/delta)))``. Here the ``8 e^{eps0}/n`` term is INSIDE the
    ``(e^{eps0}-1)/(e^{eps0}+1)`` factor, as in the FMT paper. (Seed 002's eq. (33) prints it outside; that form
    is :func:`fmt_epsilon_eq33_as_printed` and is only used to reproduce seed 002's Table 1.)
    """
    _require_fmt_valid(eps0, n, delta)
    factor = math.tanh(eps0 / 2.0)  # (e^{eps0}-1)/(e^{eps0}+1)
    inner = 8.0 * math.sqrt(math.exp(eps0) * math.log(4.0 / delta) / n) + 8.0 * math.exp(eps0) / n
    return math.log1p(factor * inner)


def fmt_epsilon_eq33_as_printed(eps0: float, n: int, delta: float) -> float:
    """Seed 002 eq. (33) exactly as printed (``8 e^{eps0}/n`` OUTSIDE the tanh factor). Kind: UPPER.

    ``eps = log(1 + (e^{eps0}-1)/(e^{eps0}+1) * 8 sqrt(e^{eps0} log(4/delta)) / sqrt(n) + 8 e^{eps0} / n)``.
    This is the form that reproduces seed 002's Table 1; it is larger than :func:`fmt_epsilon` (hence still an
    upper bound where FMT's holds). Same validity region; raises RefusedError outside it.
    """
    _require_fmt_valid(eps0, n, delta)
    factor = math.tanh(eps0 / 2.0)
    return math.log1p(factor * 8.0 * math.sqrt(math.exp(eps0) * math.log(4.0 / delta) / n) + 8.0 * math.exp(eps0) / n)


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
    """log Bin(k; trials, 1/(e^eps0 + 1)) in Loader's saddle-point form (``clones._binom_logpmf``), accurate at
    large ``trials``, unlike a log-gamma difference such as scipy's ``binom.logpmf``."""
    return _binom_logpmf(k, trials, -float(np.logaddexp(0.0, eps0)), -float(np.logaddexp(0.0, -eps0)))


def rr_shuffle_loss(eps0: float, n: int, *, full_support: bool = False) -> RRShuffleLoss:
    """Support, normalised ``log P0`` and privacy loss of shuffled binary RR (see :class:`RRShuffleLoss`).

    With ``full_support=False`` only a window holding all but ``e^{-100}`` of the mass on each side is kept;
    dropping mass can only lower the hockey-stick divergence, so values stay lower bounds.
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
    """
    return _rr_delta_from(rr_shuffle_loss(eps0, n), epsilon)


def rr_lower_epsilon(eps0: float, n: int, delta: float) -> float:
    """Exact eps(delta) of shuffled binary RR, others all 0. Kind: LOWER. Root find on [0, eps0] (brentq).

    Reference: n=1e4, eps0=1, delta=1e-6 gives 0.03565881530.
    """
    rr = rr_shuffle_loss(eps0, n)
    if _rr_delta_from(rr, 0.0) <= delta:
        return 0.0
    hi = float(np.max(np.abs(rr.loss)))  # delta(eps) = 0 at the largest loss
    if _rr_delta_from(rr, hi) > delta:  # pragma: no cover - cannot happen: no mass above the largest loss
        raise ArithmeticError("rr-lower: delta at the largest privacy loss is not 0")
    return _certified_root(lambda e: _rr_delta_from(rr, e), delta, 0.0, hi, upper=False)


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
    Kind: LOWER for general eps0-LDP randomizers (seed 000's Fig. 2-3 lower curve is the weaker Girgis eq. (6)).
    """
    rr = rr_shuffle_loss(eps0, n, full_support=True)
    forward = _log_moment(rr.log_p0, order * rr.loss)
    backward = _log_moment(rr.log_p0, (1.0 - order) * rr.loss)
    return max(forward, backward, 0.0) / (order - 1.0)


# ---------------------------------------------------------------------------------------------------------
# canonical-gdp: Shvets (seed 002)
# ---------------------------------------------------------------------------------------------------------


def canonical_mu(chi2: float, n: int) -> float:
    """``mu_n = sqrt(chi^2(W_1 || W_0) / n)``: seed 002, Theorem 17. Kind: APPROXIMATE (asymptotic, instance).

    It describes the canonical pair (0,...,0) vs (1,0,...,0) for ONE given randomizer W (an instance value, not
    a worst case over eps0-LDP randomizers); the trade-off curve converges to mu_n-GDP with error O(n^{-1/2}).
    """
    return math.sqrt(chi2 / n)


def canonical_gdp_epsilon(randomizer: object, n: int, delta: float, rounds: int = 1) -> float:
    """eps(delta) of ``sqrt(rounds) * mu_n``-GDP for a finite randomizer with a ``chi2`` attribute. APPROXIMATE.

    ``randomizer`` is e.g. :class:`shuffledp.accounting.mechanisms.KaryRandomizedResponse` (seed 002 eq. (15)) or
    :class:`shuffledp.accounting.mechanisms.BinaryRandomizedResponse` (the default of the ``canonical-gdp`` family);
    ``mu_n = sqrt(chi^2/n)`` (seed 002 Thm 17), T rounds compose to ``sqrt(T) mu_n`` (Dong-Roth-Su Cor. 3.3),
    and the (eps, delta) conversion is the exact GDP curve, seed 002 eq. (31).
    """
    chi2 = getattr(randomizer, "chi2", None)
    if not isinstance(chi2, float) or not chi2 > 0.0:
        raise TypeError(f"randomizer must have a positive float attribute chi2 (chi^2(W_1||W_0)), got {randomizer!r}")
    return gdp_epsilon(canonical_mu(chi2, n) * math.sqrt(rounds), delta)


def canonical_jsd_expansion(chi2: float, mu3: float, n: int) -> float:
    """``JSD(T_n || T'_n) = chi^2/(8n) - mu_3/(16 n^2) + 7 chi^4 / (64 n^2) + O(n^{-3})``: seed 002, Theorem 7.

    Kind: APPROXIMATE (an asymptotic expansion, remainder O(n^{-3}) not included).
    """
    return chi2 / (8.0 * n) - mu3 / (16.0 * n * n) + 7.0 * chi2 * chi2 / (64.0 * n * n)


# ---------------------------------------------------------------------------------------------------------
# no-shuffle: each eps0-DP report seen directly, composed optimally (Kairouz-Oh-Viswanath)
# ---------------------------------------------------------------------------------------------------------


def no_shuffle_delta(eps0: float, rounds: int, epsilon: float) -> float:
    """Exact optimal delta(eps) of ``rounds``-fold composition of eps0-DP. Kind: UPPER (and tight).

    Kairouz-Oh-Viswanath (2017), Theorem 3.3: randomized response with eps0 is the worst case of eps0-DP, so
    the composition's privacy loss is ``(T - 2l) eps0`` with ``l ~ Bin(T, q)``, ``q = 1/(e^{eps0}+1)`` and
    ``delta(eps) = sum_{l : (T-2l) eps0 > eps} P(l) (1 - e^{eps - (T-2l) eps0})`` (each term computed directly).
    """
    t = int(rounds)
    ls = np.arange(0, t + 1)
    losses = (t - 2.0 * ls) * eps0
    above = losses > epsilon
    if not above.any():
        return 0.0
    log_p = _rr_binom_logpmf(ls[above], t, eps0)
    return float(np.sum(np.exp(log_p) * -np.expm1(epsilon - losses[above])))


def no_shuffle_epsilon(eps0: float, rounds: int, delta: float) -> float:
    """Exact optimal eps(delta) of ``rounds``-fold composition of eps0-DP (inverse of :func:`no_shuffle_delta`).

    Kind: UPPER. Root find on ``[0, T eps0]`` (``delta(T eps0) = 0``), brentq with ``ROOT_XTOL``/``ROOT_RTOL``.
    """
    top = rounds * eps0
    if no_shuffle_delta(eps0, rounds, 0.0) <= delta:
        return 0.0
    return _certified_root(lambda e: no_shuffle_delta(eps0, rounds, e), delta, 0.0, top, upper=True)


def _certified_root(delta_of: Callable[[float], float], delta: float, lo: float, hi: float, *, upper: bool) -> float:
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
