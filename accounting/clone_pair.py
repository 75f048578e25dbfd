"""The clone pairs and their exact single-round hockey-stick divergence (see :mod:`shuffledp.accounting.clones`
for the reduction: Feldman, McMillan, Talwar, FOCS 2021 and SODA 2023; Wang, Su, Ye, Shokri, Su, NeurIPS 2023,
seed 003).

Holds the constants of the clone analysis, the pair's parameters, the distribution of the number of clones C,
and :func:`clone_delta` / :func:`clone_epsilon`. The Renyi divergence is in :mod:`shuffledp.accounting.clone_renyi`,
the privacy loss distribution in :mod:`shuffledp.accounting.clone_pld`.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import numpy as np
from scipy import special, stats

from shuffledp.accounting.binomial import binom_logpmf, binom_window, tail_ge, tail_le
from shuffledp.accounting.core import EPS0_MAX, N_MAX
from shuffledp.accounting.validation import check_delta, check_eps0, check_epsilon, check_n

__all__ = [
    "Variant",
    "VARIANTS",
    "clone_delta",
    "clone_epsilon",
]

Variant = Literal["stronger", "focs"]
VARIANTS: tuple[str, ...] = ("stronger", "focs")

Variant = Literal["stronger", "focs"]
VARIANTS: tuple[str, ...] = ("stronger", "focs")

#: Largest local privacy parameter accepted (beyond it e^eps0 loses all precision in the mixture weight).
MAX_EPS0 = EPS0_MAX
#: Largest number of users accepted (windows grow like sqrt(n)).
MAX_N = N_MAX
#: Largest Renyi order :func:`clone_renyi` computes; larger orders are refused (RefusedError).
RENYI_MAX_ORDER = 10_000.0
#: Log-mass drop that delimits the windows of C and of X in the exact computations (e^-60 ~ 1e-26).
EXACT_WINDOW_DROP = 60.0
#: Log-mass drop of the window of C in the Renyi sums (tail terms are bounded and below e^-30 relative).
RENYI_WINDOW_DROP = 30.0
#: Log-mass drop of the windows used to build PLDs (e^-50 ~ 2e-22 of mass per round is truncated).
PLD_WINDOW_DROP = 50.0
#: Mass cut from each end of a single-round loss distribution before it is put on the grid (pessimistic:
#: the top goes to infinity, the bottom is moved up; optimistic: mirrored). Keeps the grid short.
PLD_TAIL_MASS_TRUNCATION = 1e-20
#: Relative width of the blocks of C in the PLD: within a block every c uses the block's lowest c
#: (pessimistic) or highest c (optimistic). The loss scale behaves like c^{-1/2}, so the added
#: pessimism is about PLD_BLOCK_RELATIVE_WIDTH / 2 relative.
PLD_BLOCK_RELATIVE_WIDTH = 2e-4
#: Target relative error of a composed epsilon due to the grid (see :func:`suggested_interval`).
INTERVAL_RELATIVE_ERROR = 4e-3
#: Upper limit on the estimated grid size of a composed PLD (memory/time of the FFT).
MAX_COMPOSED_GRID = 2**22
#: Lower limit on it: below this size a finer grid costs nothing noticeable.
MIN_COMPOSED_GRID = 2**18
#: Relative tolerance of the root finding in :func:`clone_epsilon` (well below the 1e-6 acceptance).
EPSILON_RTOL = 1e-12
#: Elements per chunk in the vectorised Renyi and PLD sums (memory ~ 10 float64 arrays of this size).
CHUNK_ELEMENTS = 1_000_000


def check_variant(variant: str) -> str:
    """The clone pair's name, one of :data:`VARIANTS`.

    Args:
        variant: the name to check.

    Returns:
        ``variant``.

    Raises:
        ValueError: not one of :data:`VARIANTS`.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    return variant


def _params(eps0: float, variant: str) -> tuple[float, float, float]:
    """Return ``(w, log q, log(1 - q))`` with ``w = 1/(e^eps0+1)`` and C ~ Bin(n-1, q)."""
    w = float(special.expit(-eps0))
    if variant == "stronger":
        log_q = math.log(2.0) + float(special.log_expit(-eps0))
        log_1mq = math.log(math.tanh(eps0 / 2.0)) if eps0 < 1.0 else math.log1p(-2.0 * w)
    else:
        log_q = -eps0
        log_1mq = math.log(-math.expm1(-eps0))
    return w, log_q, log_1mq


def _c_distribution(n: int, eps0: float, variant: str, drop: float):
    """Window of C with normalised masses and the exact log tail masses below/above it."""
    _, log_q, log_1mq = _params(eps0, variant)
    trials = n - 1
    c = binom_window(trials, log_q, log_1mq, drop)
    q = math.exp(log_q)
    if trials == 0:
        return c, np.ones(1), 0.0, 0.0
    lp = binom_logpmf(c, trials, log_q, log_1mq)
    pmf = np.exp(lp - lp.max())
    lo_tail = float(stats.binom.cdf(c[0] - 1, trials, q)) if c[0] > 0 else 0.0
    hi_tail = float(stats.binom.sf(c[-1], trials, q)) if c[-1] < trials else 0.0
    pmf *= (1.0 - lo_tail - hi_tail) / pmf.sum()
    return c, pmf, lo_tail, hi_tail


def _delta_and_qtail_per_c(
    c: np.ndarray, eps: float, w: float, eps0: float
) -> tuple[np.ndarray, np.ndarray]:
    """For each c: ``sum_x [P(x|c) - e^eps Q(x|c)]_+`` and ``Q(X >= t_c | c)`` (the set where the
    likelihood ratio exceeds e^eps).

    With ``S(k) = P(Bin(c, 1/2) >= k)`` and ``b = P(Bin(c, 1/2) = t - 1)``:
    ``P(X >= t|c) = (1-w) S(t-1) + w S(t)``, ``Q(X >= t|c) = w S(t-1) + (1-w) S(t)`` and
    ``S(t-1) = S(t) + b``, so the divergence is ``alpha b - (e^eps - 1) S(t)`` with
    ``alpha = (1-w) - e^eps w``: one incomplete-beta tail and one binomial mass per c. The second value
    is ``-d delta / d eps * e^-eps`` (used by the Newton steps of :func:`clone_epsilon`).
    """
    em1 = math.expm1(eps)
    cf = c.astype(np.float64)
    m = cf + 1.0
    one_m2w = _one_minus_2w(eps0)
    # ratio > e^eps  <=>  x > m (e^eps (1-w) - w) / ((1-2w)(1+e^eps)); the float value of this
    # threshold can be off by one near eps0 (it is 1 - O(1e-17) there), so the neighbours are
    # re-checked with the log-ratio itself.
    tau = m * (one_m2w + em1 * (1.0 - w)) / (one_m2w * (2.0 + em1))
    t = np.floor(tau) + 1.0
    below = t - 1.0
    t = np.where((below >= 0.0) & (_log_ratio(below, m, w, one_m2w) > eps), below, t)
    t = np.where((t <= cf + 1.0) & (_log_ratio(np.minimum(t, m), m, w, one_m2w) <= eps), t + 1.0, t)
    s_t = tail_ge(t, c)
    k = t - 1.0
    inside = (k >= 0) & (k <= cf)
    b = np.zeros_like(cf)
    if np.any(inside):
        kk, cc = k[inside], cf[inside]
        b[inside] = np.exp(binom_logpmf(kk, cc, -math.log(2.0), -math.log(2.0)))
    # alpha = (1-w) - e^eps w = (1-w)(1 - e^{eps - eps0}) since e^eps0 w = 1 - w: no cancellation
    alpha = (1.0 - w) * -math.expm1(eps - eps0)
    dval = np.maximum(alpha * b - em1 * s_t, 0.0)
    qtail = w * (s_t + b) + (1.0 - w) * s_t
    return dval, qtail


def _stable_log_ratio(u: np.ndarray, num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``log(num/den)`` given ``u = num/den - 1``: ``log1p(u)`` (exact near 0) where ``u > -1/2``, else
    ``log(num) - log(den)`` of the two positive sums (``1 + u`` cancels there: at eps0 > ~37 and x = 0 it
    rounded to ``log1p(-1) = -inf`` instead of ``-eps0``)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(u > -0.5, np.log1p(np.maximum(u, -0.5)), np.log(num) - np.log(den))


def _x_window(m: np.ndarray, offsets: np.ndarray, w: float, one_m2w: float,
              halves: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The clone pair's output X = A + D given m = C + 1, on a window of X around m/2, row by row.

    Args:
        m: ``C + 1`` per row (a column vector, float).
        offsets: the window's offsets from ``floor(m/2)`` (one row, float).
        w, one_m2w: the pair's mixture weight and ``1 - 2w``.
        halves: per-row half widths narrower than the offsets (None: the offsets only).

    Returns:
        ``(xc, valid, probs, losses)``: the window centres ``floor(m/2)``, which cells are in a row's window,
        ``P(X = x | C)`` there (``Bin(x; m, 1/2) * 2 num / m``: Loader's form at the centre, the exact ratio
        recurrence outwards) and the privacy loss at each cell (0 outside).
    """
    half = (offsets.size - 1) // 2
    log_half = -math.log(2.0)
    xc = np.floor(m / 2.0)
    x = xc + offsets[None, :]
    valid = (x >= 0.0) & (x <= m)
    if halves is not None:
        valid &= np.abs(offsets)[None, :] <= halves[:, None]
    xs = np.clip(x, 0.0, m)
    with np.errstate(divide="ignore", invalid="ignore"):
        step = np.log1p((m - 2.0 * xs - 1.0) / (xs + 1.0))
    step = np.where(valid & (xs < m), step, 0.0)
    log_bin = np.zeros_like(x)
    log_bin[:, half + 1 :] = np.cumsum(step[:, half:-1], axis=1)
    log_bin[:, :half] = -np.cumsum(step[:, half - 1 :: -1], axis=1)[:, ::-1]
    log_bin += binom_logpmf(xc, m, log_half, log_half)
    num = (1.0 - w) * xs + w * (m - xs)
    den = w * xs + (1.0 - w) * (m - xs)
    with np.errstate(divide="ignore", invalid="ignore", under="ignore"):
        probs = np.where(valid, np.exp(log_bin) * (2.0 * num / m), 0.0)
        losses = np.where(valid, _stable_log_ratio(one_m2w * (2.0 * xs - m) / den, num, den), 0.0)
    return xc, valid, probs, losses


def _outside_x_window(c: np.ndarray, x_lo: np.ndarray, x_hi: np.ndarray, w: float) -> tuple[np.ndarray, np.ndarray]:
    """Exact P-masses of X = A + D (A ~ Bin(c, 1/2), D ~ Bern(1 - w)) below ``x_lo`` and above ``x_hi``.

    Returns:
        ``(below, above)`` per row, from the binomial tails (never as 1 - sum).
    """
    below = w * tail_le(x_lo - 1.0, c) + (1.0 - w) * tail_le(x_lo - 2.0, c)
    above = (1.0 - w) * tail_ge(x_hi, c) + w * tail_ge(x_hi + 1.0, c)
    return below, above


def _one_minus_2w(eps0: float) -> float:
    """``1 - 2w = (e^eps0 - 1)/(e^eps0 + 1) = tanh(eps0/2)`` for ``w = 1/(e^eps0 + 1)``, without the cancellation of
    ``1.0 - 2.0 * w`` at small eps0 (relative error ~1e-16/eps0 there, which scaled every loss and put the upper
    bound below the exact value at eps0 ~ 1e-8)."""
    return math.tanh(eps0 / 2.0)


def _log_ratio(x: np.ndarray, m: np.ndarray, w: float, one_m2w: float) -> np.ndarray:
    """log(P(x|c)/Q(x|c)) = log1p((1-2w)(2x - m) / (w x + (1-w)(m - x))), exact near x = m/2 (``one_m2w`` is
    :func:`_one_minus_2w`)."""
    den = w * x + (1.0 - w) * (m - x)
    num = (1.0 - w) * x + w * (m - x)
    return _stable_log_ratio(one_m2w * (2.0 * x - m) / den, num, den)


def _delta_per_c(c: np.ndarray, eps: float, w: float, eps0: float) -> np.ndarray:
    """sum_x [P(x|c) - e^eps Q(x|c)]_+ for each c (two binomial tails, see module docstring)."""
    return _delta_and_qtail_per_c(c, eps, w, eps0)[0]


def _lower_tail_bound(
    eps: float, w: float, eps0: float, c_lo: int, trials: int, q: float, steps: int = 12
) -> float:
    """Upper bound on ``sum_{c < c_lo} P(C=c) delta_c(eps)`` by a staircase: delta_c is non-increasing
    in c, so on ``[c_j, c_{j+1})`` it is at most ``delta_{c_j}``."""
    if c_lo <= 0:
        return 0.0
    grid = np.unique(np.round(np.linspace(0.0, float(c_lo), steps + 1)).astype(np.int64))
    cdf = stats.binom.cdf(grid - 1, trials, q)
    cdf[grid == 0] = 0.0
    masses = np.diff(cdf)
    return float(np.dot(masses, _delta_per_c(grid[:-1], eps, w, eps0)))


def _delta_exact(eps0: float, n: int, eps: float, variant: str, cdist=None,
                 with_slope: bool = False):
    w, log_q, _ = _params(eps0, variant)
    if eps >= eps0:
        return (0.0, 0.0) if with_slope else 0.0
    c, pmf, lo_tail, hi_tail = cdist if cdist is not None else _c_distribution(
        n, eps0, variant, EXACT_WINDOW_DROP
    )
    dc, qt = _delta_and_qtail_per_c(c, eps, w, eps0)
    total = math.fsum(pmf * dc)
    # Rigorous handling of the truncated tails of C (delta_c is non-increasing in c): a staircase
    # bound below the window, delta_{c_hi} above it. Both are below e^-EXACT_WINDOW_DROP relative.
    if lo_tail > 0.0:
        total += _lower_tail_bound(eps, w, eps0, int(c[0]), n - 1, math.exp(log_q))
    if hi_tail > 0.0:
        total += hi_tail * float(dc[-1])
    total = min(1.0, max(0.0, total))
    if with_slope:
        # d delta / d eps = -e^eps Q(L > eps)
        return total, -math.exp(eps) * math.fsum(pmf * qt)
    return total


def clone_delta(eps0: float, n: int, epsilon: float, variant: Variant = "stronger") -> float:
    """Exact hockey-stick divergence ``delta(epsilon)`` of one shuffle round (clone pair).

    ``sum_c P(C=c) [P(X >= t_c | c) - e^eps Q(X >= t_c | c)]`` with binomial tails (module docstring;
    FMT FOCS'21 Thm 3.1 / SODA'23; seed 003 App. C). C is summed over the window of log-mass within
    ``EXACT_WINDOW_DROP`` of the mode; the truncated tails of C are bounded (monotonicity in c) and
    added, so the value is exact up to ~1e-26 absolute and never below the exact value.

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        epsilon: epsilon >= 0.
        variant: ``"stronger"`` or ``"focs"`` (the clone pair).

    Returns:
        The delta of one round.
    """
    eps0 = check_eps0(eps0)
    n = check_n(n)
    epsilon = check_epsilon(epsilon)
    variant = check_variant(variant)
    return _delta_exact(eps0, n, epsilon, variant)


def clone_epsilon(eps0: float, n: int, delta: float, variant: Variant = "stronger") -> float:
    """Exact smallest ``epsilon`` with ``clone_delta(eps0, n, epsilon) <= delta`` (one round).

    ``delta(eps)`` is continuous and non-increasing on ``[0, eps0]`` with ``delta(eps0) = 0`` (the
    largest privacy loss of the pair is ``eps0``), so Brent's method on ``delta(eps) - delta`` is
    bracketed; relative tolerance ``EPSILON_RTOL``. Returns 0 when ``delta(0) <= delta``.

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        delta: target delta, 0 < delta < 1.
        variant: ``"stronger"`` or ``"focs"`` (the clone pair).

    Returns:
        The epsilon of one round.
    """
    eps0 = check_eps0(eps0)
    n = check_n(n)
    delta = check_delta(delta)
    variant = check_variant(variant)
    return _epsilon_exact(eps0, n, delta, variant)


def _gaussian_start(eps0: float, n: int, delta: float, variant: str) -> float:
    """A starting point only: the epsilon of a Gaussian privacy loss with the pair's loss deviation (mean s^2/2)."""
    _, log_q, _ = _params(eps0, variant)
    s = min(eps0, 2.0 * math.tanh(eps0 / 2.0) / math.sqrt((n - 1) * math.exp(log_q) + 1.0))
    lo, hi = 0.0, eps0
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        d = 0.5 * math.erfc((mid / s - s / 2) / math.sqrt(2.0)) - math.exp(mid) * 0.5 * math.erfc(
            (mid / s + s / 2) / math.sqrt(2.0))
        lo, hi = (mid, hi) if d > delta else (lo, mid)
    return hi


@functools.lru_cache(maxsize=256)
def _epsilon_exact(eps0: float, n: int, delta: float, variant: str) -> float:
    """Safeguarded Newton iteration on ``log delta(eps) - log delta`` inside a shrinking bracket.

    ``delta(eps)`` is convex and decreasing, ``log delta`` is close to quadratic, and the slope comes
    with the same tails (``delta' = -e^eps Q(L > eps)``), so 5-8 evaluations reach ``EPSILON_RTOL``;
    a step that leaves the bracket is replaced by bisection.
    """
    cdist = _c_distribution(n, eps0, variant, EXACT_WINDOW_DROP)
    log_target = math.log(delta)
    d0 = _delta_exact(eps0, n, 0.0, variant, cdist)
    if d0 <= delta:
        return 0.0
    lo, hi = 0.0, eps0  # delta(lo) > target >= delta(hi) = 0
    x = min(max(_gaussian_start(eps0, n, delta, variant), eps0 * 1e-6), eps0 * (1.0 - 1e-9))
    for _ in range(200):
        val, slope = _delta_exact(eps0, n, x, variant, cdist, with_slope=True)
        if val > delta:
            lo = x
        else:
            hi = x
        if hi - lo <= EPSILON_RTOL * hi:
            return hi
        nxt = 0.5 * (lo + hi)
        if val > 0.0 and slope < 0.0:
            newton = x - (math.log(val) - log_target) * val / slope
            if abs(newton - x) <= 0.25 * EPSILON_RTOL * x:
                # converged: settle the side of the limit point and return the upper end
                if _delta_exact(eps0, n, newton, variant, cdist) <= delta:
                    return newton
                lo = max(lo, newton)
                x = min(hi, newton * (1.0 + EPSILON_RTOL))
                continue
            if lo < newton < hi:
                nxt = newton
        x = nxt
    raise RuntimeError(
        f"clone_epsilon did not converge for eps0={eps0}, n={n}, delta={delta}, variant={variant}"
    )
