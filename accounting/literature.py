"""The published shuffle-model bounds, each as a plain function with its source, equation and kind.

Every function here works on ONE round unless its name says otherwise (the randomized-response ones, ``rr-lower``
and ``no-shuffle``, live in :mod:`shuffledp.accounting.literature_rr` and are re-exported here); composition over
rounds is done by :mod:`shuffledp.accounting.bounds`. Kinds: ``upper`` (a guarantee), ``approximate`` (a CLT
value, may fall below the truth), ``lower`` (the loss of a concrete instance; any valid general bound is at least
this).

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

import numpy as np
from scipy import optimize, special

from shuffledp.accounting.core import RefusedError
from shuffledp.accounting.literature_rr import (
    ROOT_RTOL,
    ROOT_XTOL,
    RRShuffleLoss,
    no_shuffle_delta,
    no_shuffle_epsilon,
    rr_lower_delta,
    rr_lower_epsilon,
    rr_lower_renyi,
    rr_shuffle_loss,
)

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
    "require_fmt_valid",
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




# ---------------------------------------------------------------------------------------------------------
# CLT refusal rule (seeds README: the CLT families fall below the exact value when few clones are expected)
# ---------------------------------------------------------------------------------------------------------


def clt_expected_clones_ok(eps0: float, n: int, delta: float) -> bool:
    """True when ``n / (e^{eps0} + 1) >= 2 ln(1/delta)``: enough expected clones for a CLT value to be sane.

    Below this line the asymptotic (CLT) families were measured to fall BELOW the exact value (e.g. n=1e4,
    eps0=8, delta=1e-6); see the project's seeds README. Evaluated in log space.

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        delta: target delta, 0 < delta < 1.

    Returns:
        Whether the CLT rule holds.
    """
    lhs = math.log(n) - (eps0 + math.log1p(math.exp(-eps0)))
    rhs = math.log(2.0) + math.log(-math.log(delta))
    return lhs >= rhs


def require_clt_regime(family: str, eps0: float, n: int, delta: float, allow_approximate: bool) -> None:
    """Raise :class:`RefusedError` unless the CLT rule holds or ``allow_approximate`` is set.

    Args:
        family: the family's name, for the message.
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        delta: target delta, 0 < delta < 1.
        allow_approximate: answer even where the rule would refuse.
    """
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

    Args:
        mu: the mu of mu-GDP, >= 0.
        epsilon: epsilon >= 0.

    Returns:
        delta_mu(eps).
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

    Args:
        mu: the mu of mu-GDP, >= 0.
        delta: target delta, 0 < delta < 1.

    Returns:
        The epsilon.
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

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.

    Returns:
        mu.
    """
    if n < 2:
        raise RefusedError(f"ccg-gdp needs n >= 2 reports, got n={n}")
    return 2.0 * math.exp(eps0 / 2.0) / math.sqrt(n - 1)


def ccg_rdp(eps0: float, n: int, order: float) -> float:
    """``(lambda, 2 e^{eps0} lambda / (n - 1))``-RDP: seed 000, Corollary 2. Kind: APPROXIMATE.

    It is Theorem 2's mu-GDP through "mu-GDP implies (lambda, mu^2 lambda / 2)-RDP" (Bun-Steinke 2016,
    Prop. 1.6; Dong-Roth-Su 2022). Corollary 2 states it for lambda >= 2, and so do we: RefusedError below 2.

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        order: Renyi order lambda > 1.

    Returns:
        The Renyi divergence of one round.
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

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        order: Renyi order lambda > 1.

    Returns:
        The Renyi divergence bound of one round.
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

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        order: Renyi order lambda > 1.

    Returns:
        The Renyi divergence bound of one round.
    """
    lam = _require_integer_order("girgis-lower", order)
    chi2 = 4.0 * math.sinh(eps0 / 2.0) ** 2  # (e^{eps0}-1)^2 / e^{eps0}
    return math.log1p(lam * (lam - 1) / 2.0 * chi2 / n) / (lam - 1)


# ---------------------------------------------------------------------------------------------------------
# Feldman-McMillan-Talwar FOCS'21, Theorem 3.1
# ---------------------------------------------------------------------------------------------------------


def fmt_validity_limit(n: int, delta: float) -> float:
    """The largest eps0 FMT'21 Theorem 3.1 is taken to cover: ``log(n / (16 log(4/delta)))`` (may be negative).

    The paper prints ``16 log(2/delta)``; its authors' own code (apple/ml-shuffling-amplification,
    ``computeamplification.py``) uses ``log(4/delta)``, and a reader's report there (issue #1) traces the 2 to a typo
    in Lemma 3.5, Theorem 3.8 and Proposition 5.3. The smaller region (``4/delta``) is the pessimistic reading:
    inside it both readings hold.

    Args:
        n: number of shuffled reports.
        delta: target delta, 0 < delta < 1.

    Returns:
        The limit on eps0.
    """
    return math.log(n) - math.log(16.0 * math.log(4.0 / delta))


def require_fmt_valid(eps0: float, n: int, delta: float) -> None:
    """FMT'21 Theorem 3.1's validity rule: raise :class:`RefusedError` unless ``eps0 <= fmt_validity_limit(n, delta)``.

    Args:
        eps0: local privacy parameter.
        n: reports per round.
        delta: the delta of the bound.
    """
    limit = fmt_validity_limit(n, delta)
    if eps0 > limit:
        raise RefusedError(
            f"fmt (FMT'21 Theorem 3.1) holds only for eps0 <= log(n / (16 log(4/delta))) = {limit:.6g} "
            f"(n={n}, delta={delta}); got eps0={eps0}. Use the clones family, which has no such restriction."
        )


def fmt_epsilon(eps0: float, n: int, delta: float) -> float:
    """FMT'21 Theorem 3.1, the paper's bracketing. Kind: UPPER. Raises RefusedError outside its validity region.

    ``eps = log(1 + (e^{eps0}-1)/(e^{eps0}+1) * (8 sqrt(e^{eps0} log(4/delta)) / sqrt(n) + 8 e^{eps0} / n))``
    for ``eps0 <= log(n / (16 log(4/delta)))``. Here the ``8 e^{eps0}/n`` term is INSIDE the
    ``(e^{eps0}-1)/(e^{eps0}+1)`` factor, as in the FMT paper. (Seed 002's eq. (33) prints it outside; that form
    is :func:`fmt_epsilon_eq33_as_printed` and is only used to reproduce seed 002's Table 1.)

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        delta: target delta, 0 < delta < 1.

    Returns:
        The epsilon of one round.
    """
    require_fmt_valid(eps0, n, delta)
    factor = math.tanh(eps0 / 2.0)  # (e^{eps0}-1)/(e^{eps0}+1)
    inner = 8.0 * math.sqrt(math.exp(eps0) * math.log(4.0 / delta) / n) + 8.0 * math.exp(eps0) / n
    return math.log1p(factor * inner)


def fmt_epsilon_eq33_as_printed(eps0: float, n: int, delta: float) -> float:
    """Seed 002 eq. (33) exactly as printed (``8 e^{eps0}/n`` OUTSIDE the tanh factor). Kind: UPPER.

    ``eps = log(1 + (e^{eps0}-1)/(e^{eps0}+1) * 8 sqrt(e^{eps0} log(4/delta)) / sqrt(n) + 8 e^{eps0} / n)``.
    This is the form that reproduces seed 002's Table 1; it is larger than :func:`fmt_epsilon` (hence still an
    upper bound where FMT's holds). Same validity region; raises RefusedError outside it.

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        delta: target delta, 0 < delta < 1.

    Returns:
        The epsilon of one round.
    """
    require_fmt_valid(eps0, n, delta)
    factor = math.tanh(eps0 / 2.0)
    return math.log1p(factor * 8.0 * math.sqrt(math.exp(eps0) * math.log(4.0 / delta) / n) + 8.0 * math.exp(eps0) / n)


# ---------------------------------------------------------------------------------------------------------
# canonical-gdp: Shvets (seed 002)
# ---------------------------------------------------------------------------------------------------------


def canonical_mu(chi2: float, n: int) -> float:
    """``mu_n = sqrt(chi^2(W_1 || W_0) / n)``: seed 002, Theorem 17. Kind: APPROXIMATE (asymptotic, instance).

    It describes the canonical pair (0,...,0) vs (1,0,...,0) for ONE given randomizer W (an instance value, not
    a worst case over eps0-LDP randomizers); the trade-off curve converges to mu_n-GDP with error O(n^{-1/2}).

    Args:
        chi2: chi^2(W_1 || W_0) of the randomizer.
        n: number of shuffled reports.

    Returns:
        mu_n.
    """
    return math.sqrt(chi2 / n)


def canonical_gdp_epsilon(randomizer: object, n: int, delta: float, rounds: int = 1) -> float:
    """eps(delta) of ``sqrt(rounds) * mu_n``-GDP for a finite randomizer with a ``chi2`` attribute. APPROXIMATE.

    ``randomizer`` is e.g. :class:`shuffledp.accounting.mechanisms.KaryRandomizedResponse` (seed 002 eq. (15)) or
    :class:`shuffledp.accounting.mechanisms.BinaryRandomizedResponse` (the default of the ``canonical-gdp`` family);
    ``mu_n = sqrt(chi^2/n)`` (seed 002 Thm 17), T rounds compose to ``sqrt(T) mu_n`` (Dong-Roth-Su Cor. 3.3),
    and the (eps, delta) conversion is the exact GDP curve, seed 002 eq. (31).

    Args:
        randomizer: a randomizer with a positive float ``chi2`` attribute.
        n: number of shuffled reports.
        delta: target delta, 0 < delta < 1.
        rounds: number of rounds T >= 1.

    Returns:
        The epsilon.
    """
    chi2 = getattr(randomizer, "chi2", None)
    if not isinstance(chi2, float) or not chi2 > 0.0:
        raise TypeError(f"randomizer must have a positive float attribute chi2 (chi^2(W_1||W_0)), got {randomizer!r}")
    return gdp_epsilon(canonical_mu(chi2, n) * math.sqrt(rounds), delta)


def canonical_jsd_expansion(chi2: float, mu3: float, n: int) -> float:
    """``JSD(T_n || T'_n) = chi^2/(8n) - mu_3/(16 n^2) + 7 chi^4 / (64 n^2) + O(n^{-3})``: seed 002, Theorem 7.

    Kind: APPROXIMATE (an asymptotic expansion, remainder O(n^{-3}) not included).

    Args:
        chi2: chi^2(W_1 || W_0) of the randomizer.
        mu3: mu_3 = E_{W_0}[(W_1/W_0 - 1)^3] of the randomizer.
        n: number of shuffled reports.

    Returns:
        The expansion's value.
    """
    return chi2 / (8.0 * n) - mu3 / (16.0 * n * n) + 7.0 * chi2 * chi2 / (64.0 * n * n)
