"""Exact privacy accounting of one shuffle round via clone pairs.

Clone reduction (Feldman, McMillan & Talwar, FOCS'21, Thm 3.1; "stronger clones", SODA'23): for any
eps0-LDP randomizer and n users, the shuffled output on neighbouring data sets is a post-processing of
one of two distributions ``P, Q`` on pairs ``(C, X)``:

    C ~ Bin(n - 1, q),   A | C ~ Bin(C, 1/2),   X = A + D,   w = 1 / (e^eps0 + 1),
    D ~ Bern(1 - w) under P,   D ~ Bern(w) under Q.

* ``variant="stronger"`` (default): ``q = 2 / (e^eps0 + 1)`` (FMT SODA'23; the pair of Wang, Su, Ye,
  Shokri & Su, NeurIPS'23, seed 003, App. C: ``P = (1-w) P0 + w Q0`` with ``P0 = (A+1, C-A)``).
* ``variant="focs"``: ``q = e^-eps0`` with ``Delta ~ Bern(e^eps0/(e^eps0+1))``, ``P = (A + Delta,
  C - A + 1 - Delta)``, ``Q = (A + 1 - Delta, C - A + Delta)`` (FMT FOCS'21 Thm 3.1; seed 000 Prop. 1.
  Seed 000's Thm 1 writes ``Bern(p)``, which is wrong). Its first coordinate is ``X = A + Delta`` under P
  and ``A + 1 - Delta`` under Q, which is the common form above with ``1 - w = e^eps0/(e^eps0+1)``.

Given ``C = c`` (write ``m = c + 1``), ``P(x | c) = Bin(x; m, 1/2) * 2((1-w)x + w(m-x)) / m`` and
``Q(x | c) = Bin(x; m, 1/2) * 2(wx + (1-w)(m-x)) / m``, so the likelihood ratio
``((1-w)x + w(m-x)) / (wx + (1-w)(m-x))`` is increasing in ``x`` and at most ``e^eps0``. Hence, for each
``c``, ``sum_x [P - e^eps Q]_+`` is a pair of binomial tails of ``A ~ Bin(c, 1/2)`` with
``S(k) = P(A >= k)``:  ``alpha S(t-1) - beta S(t)`` with ``alpha = (1-w) - e^eps w``,
``beta = e^eps (1-w) - w`` and ``t`` the smallest ``x`` with ratio ``> e^eps``.

Both pairs are symmetric: ``x -> m - x`` maps ``P(. | c)`` onto ``Q(. | c)``, so the hockey-stick
divergence, the Renyi divergence and the privacy loss distribution are the same in both directions
(one direction is computed; the tests compute both and check that they agree).

Monotonicity used for rigorous truncation: the pair with ``c + 1`` clones is a post-processing of the pair
with ``c`` clones (add a fresh ``Bern(1/2)`` clone to ``A``), so every divergence is non-increasing in
``c``. Masses of ``C`` and ``X`` come from Loader's saddle-point form of the binomial mass (accurate to
~1e-12 at n = 1e9; plain log-gamma differences are off by ~1e-9 at n = 1e6) on a window around the mode
(log-mass at least ``max - drop``), normalised to ``1 - (tail masses)`` with the tails from the
incomplete beta function (``scipy.stats.binom.cdf/sf``, ``scipy.special.bdtr/bdtrc``), never ``1 - sum``.

Privacy loss distribution (:func:`clone_pld`): the exact losses ``log(P/Q)`` on the windows, with the
truncated mass sent to infinity (pessimistic) and blocks of ``c`` replaced by their lowest ``c``
(a dominating pair), rounded up onto a grid whose interval :func:`suggested_interval` scales with the
loss's mean and standard deviation and the number of rounds. The optimistic PLD mirrors every step (a
dominated pair, rounded down, truncated mass dropped) and gives a lower bound *on the clone pair's epsilon*, which
brackets the discretisation error; it is not a lower bound on the shuffled mechanism's epsilon (the clone pair
only bounds that from above; family ``"rr-lower"`` of ``shuffledp.accounting.bounds`` is a lower bound on the mechanism).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Literal

import numpy as np
from scipy import optimize, special, stats

from shuffledp.accounting import EPS0_MAX, N_MAX, RefusedError
from shuffledp.accounting import pld as _pld
from shuffledp.accounting.pld import PrivacyLossDistribution

__all__ = [
    "Variant",
    "VARIANTS",
    "clone_delta",
    "clone_epsilon",
    "clone_renyi",
    "clone_pld",
    "clone_epsilon_composed",
    "suggested_interval",
    "round_interval",
    "clone_loss_moments",
    "clone_epsilon_baseline",
    "clear_caches",
]

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


# ----------------------------------------------------------------------------------------------------
# validation


def _check_eps0(eps0: float) -> float:
    if isinstance(eps0, bool) or not isinstance(eps0, numbers.Real):
        raise TypeError(f"eps0 must be a real number in (0, {MAX_EPS0}], got {type(eps0).__name__}")
    e = float(eps0)
    if not (math.isfinite(e) and 0.0 < e <= MAX_EPS0):
        raise ValueError(f"eps0 must be in (0, {MAX_EPS0}], got {e!r}")
    return e


def _check_n(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"n must be an integer in [1, {MAX_N}], got {type(n).__name__} {n!r}")
    if not 1 <= int(n) <= MAX_N:
        raise ValueError(f"n must be in [1, {MAX_N}] (the number of shuffled reports), got {n}")
    return int(n)


def _check_variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    return variant


def _check_delta(delta: float) -> float:
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real):
        raise TypeError(f"delta must be a real number in (0, 1), got {type(delta).__name__}")
    d = float(delta)
    if not 0.0 < d < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {d!r}")
    return d


def _check_epsilon(epsilon: float) -> float:
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real):
        raise TypeError(f"epsilon must be a real number >= 0, got {type(epsilon).__name__}")
    e = float(epsilon)
    if math.isnan(e) or e < 0.0:
        raise ValueError(f"epsilon must be >= 0, got {e!r}")
    return e


def _check_rounds(rounds: int) -> int:
    if isinstance(rounds, bool) or not isinstance(rounds, numbers.Integral) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    return int(rounds)


# ----------------------------------------------------------------------------------------------------
# the pair


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


def _binom_window(trials: int, log_p: float, log_1mp: float, drop: float) -> np.ndarray:
    """Integers k of Bin(trials, p) whose log-mass is within ``drop`` of the maximum."""
    if trials == 0:
        return np.zeros(1, dtype=np.int64)
    p = math.exp(log_p)
    mean = trials * p
    sd = math.sqrt(trials * p * math.exp(log_1mp))
    half = int(math.ceil(math.sqrt(2.0 * drop) * sd * 1.25 + drop + 10))
    lo = max(0, int(math.floor(mean)) - half)
    hi = min(trials, int(math.ceil(mean)) + half)
    k = np.arange(lo, hi + 1, dtype=np.int64)
    lp = _binom_logpmf(k, trials, log_p, log_1mp)
    keep = lp >= lp.max() - drop
    idx = np.flatnonzero(keep)
    return k[idx[0] : idx[-1] + 1]


_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def _stirlerr(k: np.ndarray) -> np.ndarray:
    """``log(k!) - (k + 1/2) log k + k - log(2 pi)/2`` for k >= 1 (Loader 2000, "Fast and accurate
    computation of binomial probabilities"): Stirling series for k > 15, log-gamma below."""
    k = np.asarray(k, dtype=np.float64)
    out = np.empty_like(k)
    big = k > 15.0
    kb = k[big]
    inv = 1.0 / kb
    inv2 = inv * inv
    out[big] = inv * (1.0 / 12 - inv2 * (1.0 / 360 - inv2 * (1.0 / 1260 - inv2 * (
        1.0 / 1680 - inv2 / 1188))))
    ks = k[~big]
    out[~big] = special.gammaln(ks + 1.0) - (ks + 0.5) * np.log(ks) + ks - _HALF_LOG_2PI
    return out


def _bd0(k: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """``k log(k / mu) + mu - k = mu phi(v)``, ``v = (k - mu)/mu``, ``phi(v) = (1+v) log1p(v) - v``,
    by its alternating series ``sum_{j>=2} (-v)^j / (j (j-1))`` when ``|v| < 0.1`` (Loader 2000)."""
    k = np.asarray(k, dtype=np.float64)
    mu = np.asarray(mu, dtype=np.float64)
    v = (k - mu) / mu
    out = np.empty(np.broadcast(k, mu).shape)
    v = np.broadcast_to(v, out.shape)
    mub = np.broadcast_to(mu, out.shape)
    small = np.abs(v) < 0.1
    vs = v[small]
    acc = np.zeros_like(vs)
    pw = vs * vs
    for j in range(2, 19):
        acc += pw / (j * (j - 1.0)) if j % 2 == 0 else -pw / (j * (j - 1.0))
        pw = pw * vs
    out[small] = mub[small] * acc
    vb = v[~small]
    out[~small] = mub[~small] * ((1.0 + vb) * np.log1p(vb) - vb)
    return out


def _binom_logpmf(k: np.ndarray, trials, log_p: float, log_1mp: float) -> np.ndarray:
    """log Bin(k; trials, p), accurate to ~1e-14 relative in the mass even for trials ~ 1e9.

    Loader's saddle-point form ``stirlerr(n) - stirlerr(k) - stirlerr(n-k) - bd0(k, np) -
    bd0(n-k, nq) + log(n / (2 pi k (n-k)))/2``; the plain log-gamma difference loses ~1e-9 at n = 1e6.
    ``trials`` may be an array broadcasting with ``k``.
    """
    k = np.asarray(k, dtype=np.float64)
    nn = np.asarray(trials, dtype=np.float64)
    k, nn = np.broadcast_arrays(k, nn)
    out = np.full(k.shape, -np.inf)
    p = math.exp(log_p)
    q = math.exp(log_1mp)
    edge0 = k == 0
    edge1 = k == nn
    out[edge0] = nn[edge0] * log_1mp
    out[edge1] = nn[edge1] * log_p
    inner = (k > 0) & (k < nn)
    ki, ni = k[inner], nn[inner]
    out[inner] = (
        _stirlerr(ni) - _stirlerr(ki) - _stirlerr(ni - ki)
        - _bd0(ki, ni * p) - _bd0(ni - ki, ni * q)
        + 0.5 * np.log(ni / (ki * (ni - ki))) - _HALF_LOG_2PI
    )
    return out


def _c_distribution(n: int, eps0: float, variant: str, drop: float):
    """Window of C with normalised masses and the exact log tail masses below/above it."""
    _, log_q, log_1mq = _params(eps0, variant)
    trials = n - 1
    c = _binom_window(trials, log_q, log_1mq, drop)
    q = math.exp(log_q)
    if trials == 0:
        return c, np.ones(1), 0.0, 0.0
    lp = _binom_logpmf(c, trials, log_q, log_1mq)
    pmf = np.exp(lp - lp.max())
    lo_tail = float(stats.binom.cdf(c[0] - 1, trials, q)) if c[0] > 0 else 0.0
    hi_tail = float(stats.binom.sf(c[-1], trials, q)) if c[-1] < trials else 0.0
    pmf *= (1.0 - lo_tail - hi_tail) / pmf.sum()
    return c, pmf, lo_tail, hi_tail


def _tail_ge(k: np.ndarray, c: np.ndarray) -> np.ndarray:
    """S_c(k) = P(Bin(c, 1/2) >= k) = I_{1/2}(k, c - k + 1), elementwise, no 1 - sum.

    The regularised incomplete beta is scipy's ``betainc`` (Boost: ~5e-12 relative at c = 1e9). Cephes'
    ``bdtrc`` lost 1e-8 at c = 1e7 and 1e-6 at c = 7.5e8, and the per-c divergence cancels by ~1e3 there, which
    put the single-round clones value up to 1e-7 relative below the exact one at n = 1e8 (review 41, F6)."""
    k, c = np.broadcast_arrays(np.asarray(k, dtype=np.float64), np.asarray(c, dtype=np.int64))
    out = np.where(k <= 0, 1.0, 0.0)
    mid = (k > 0) & (k <= c)
    if np.any(mid):
        km, cm = k[mid], c[mid].astype(np.float64)
        out[mid] = special.betainc(km, cm - km + 1.0, 0.5)
    return out


def _tail_le(k: np.ndarray, c: np.ndarray) -> np.ndarray:
    """P(Bin(c, 1/2) <= k) = I_{1/2}(c - k, k + 1), elementwise (``betainc``, as :func:`_tail_ge`)."""
    k, c = np.broadcast_arrays(np.asarray(k, dtype=np.float64), np.asarray(c, dtype=np.int64))
    out = np.where(k >= c, 1.0, 0.0)
    mid = (k >= 0) & (k < c)
    if np.any(mid):
        km, cm = k[mid], c[mid].astype(np.float64)
        out[mid] = special.betainc(cm - km, km + 1.0, 0.5)
    return out


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
    s_t = _tail_ge(t, c)
    k = t - 1.0
    inside = (k >= 0) & (k <= cf)
    b = np.zeros_like(cf)
    if np.any(inside):
        kk, cc = k[inside], cf[inside]
        b[inside] = np.exp(_binom_logpmf(kk, cc, -math.log(2.0), -math.log(2.0)))
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


def _one_minus_2w(eps0: float) -> float:
    """``1 - 2w = (e^eps0 - 1)/(e^eps0 + 1) = tanh(eps0/2)`` for ``w = 1/(e^eps0 + 1)``, without the cancellation of
    ``1.0 - 2.0 * w`` at small eps0 (relative error ~1e-16/eps0 there, which scaled every loss and put the upper
    bound below the exact value at eps0 ~ 1e-8: review 41, F1)."""
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
    """
    eps0 = _check_eps0(eps0)
    n = _check_n(n)
    epsilon = _check_epsilon(epsilon)
    variant = _check_variant(variant)
    return _delta_exact(eps0, n, epsilon, variant)


def clone_epsilon(eps0: float, n: int, delta: float, variant: Variant = "stronger") -> float:
    """Exact smallest ``epsilon`` with ``clone_delta(eps0, n, epsilon) <= delta`` (one round).

    ``delta(eps)`` is continuous and non-increasing on ``[0, eps0]`` with ``delta(eps0) = 0`` (the
    largest privacy loss of the pair is ``eps0``), so Brent's method on ``delta(eps) - delta`` is
    bracketed; relative tolerance ``EPSILON_RTOL``. Returns 0 when ``delta(0) <= delta``.
    """
    eps0 = _check_eps0(eps0)
    n = _check_n(n)
    delta = _check_delta(delta)
    variant = _check_variant(variant)
    return _epsilon_exact(eps0, n, delta, variant)


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
    x = eps0 * 1e-3
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


# ----------------------------------------------------------------------------------------------------
# Renyi divergence


def _log_f(a: float, lr: np.ndarray) -> np.ndarray:
    """log f(l), f(l) = e^{a l} - 1 - a (e^l - 1) >= 0 (Bernoulli's inequality), without cancellation.

    Near 0 a series ``f = sum_{k>=2} (a^k - a) l^k / k!`` is used; for large ``a l`` the value is
    factored as ``e^{a l} (1 - e^{-a l}(1 + a(e^l - 1)))`` in log space (no overflow).
    """
    lr = np.asarray(lr, dtype=np.float64)
    out = np.empty_like(lr)
    al = a * np.abs(lr)
    small = al < 0.05
    if np.any(small):
        x = lr[small]
        acc = np.zeros_like(x)
        term_a = a  # a^k
        fact = 1.0
        xp = x.copy()  # x^k
        for k in range(2, 15):
            term_a *= a
            fact *= k
            xp = xp * x
            acc += (term_a - a) / fact * xp
        with np.errstate(divide="ignore"):
            out[small] = np.log(acc)
    big = ~small
    if np.any(big):
        x = lr[big]
        pos = a * x > 30.0
        res = np.empty_like(x)
        xp_ = x[pos]
        with np.errstate(over="ignore"):
            res[pos] = a * xp_ + np.log1p(-np.exp(-a * xp_) * (1.0 + a * np.expm1(xp_)))
        xn = x[~pos]
        res[~pos] = np.log(np.expm1(a * xn) - a * np.expm1(xn))
        out[big] = res
    return out


#: Elements per chunk in the vectorised Renyi sums (memory ~ 10 float64 arrays of this size).
_CHUNK_ELEMENTS = 1_000_000


def _f_linear(a: float, lr: np.ndarray, u: np.ndarray) -> np.ndarray:
    """f = r^a - 1 - a (r - 1) with ``u = r - 1`` and ``lr = log1p(u)``, in linear space (callers
    ensure ``a lr < 600``).

    Direct ``expm1(a lr) - a u`` loses about ``2e-16 / ((a - 1) |lr|)`` relative, so for
    ``a |lr| < 1e-3`` the series ``sum_{k>=2} (a^k - a) lr^k / k!`` (6 terms, error < 1e-18 relative)
    is used instead."""
    out = np.expm1(a * lr) - a * np.expm1(lr) if u is None else np.expm1(a * lr) - a * u
    small = np.abs(a * lr) < 1e-3
    if np.any(small):
        x = lr[small]
        acc = np.zeros_like(x)
        term_a = a
        fact = 1.0
        xp = x.copy()
        for k in range(2, 8):
            term_a *= a
            fact *= k
            xp = xp * x
            acc += ((term_a - a) / fact) * xp
        out[small] = acc
    return np.maximum(out, 0.0)


def _log_excess(a: float, cs: np.ndarray, w: float, eps0: float, reverse: bool) -> np.ndarray:
    """For each c: ``log(E_{x ~ Q(.|c)}[r^a] - 1)`` with ``r = P/Q`` (``Q/P`` if reverse), summed
    exactly over an x window of log-mass drop ``30 + log m + a eps0`` around ``m/2`` (the dropped terms
    are at most ``Q(outside) (e^{a eps0} + a)``, below e^-30 of the smallest possible excess).

    Binomial masses relative to the centre of each row come from the exact ratio recurrence
    ``Bin(x+1)/Bin(x) = (m - x)/(x + 1)`` multiplied outwards (rounding ~1e-14); each row of Q is then
    normalised to its exact total 1. With ``u = r - 1`` (exact: ``+-(1-2w)(2x-m)/den``), the summand is
    ``f = expm1(a log1p(u)) - a u`` (series in ``log1p(u)`` when it is tiny, see :func:`_f_linear`).
    For ``a eps0 >= 600`` (where ``r^a`` could overflow) the same sum is done in log space.
    """
    cs = np.asarray(cs, dtype=np.int64)
    out = np.empty(cs.size)
    if cs.size == 0:
        return out
    m_max = int(cs.max()) + 1
    drop = 30.0 + math.log(m_max + 1.0) + a * eps0
    half = int(math.ceil(math.sqrt(2.0 * drop) * 0.5 * math.sqrt(m_max) + 10))
    half = min(half, m_max // 2 + 2)
    offsets = np.arange(-half, half + 1, dtype=np.float64)
    rows = max(1, _CHUNK_ELEMENTS // offsets.size)
    sign = -1.0 if reverse else 1.0
    one_m2w = _one_minus_2w(eps0)
    log_half = -math.log(2.0)
    linear = a * eps0 < 600.0
    centre = half  # column of x = floor(m / 2)
    for start in range(0, cs.size, rows):
        c = cs[start : start + rows].astype(np.float64)[:, None]
        m = c + 1.0
        xc = np.floor(m / 2.0)
        x = xc + offsets[None, :]
        valid = (x >= 0.0) & (x <= m)
        xs = np.clip(x, 0.0, m)
        den = w * xs + (1.0 - w) * (m - xs)  # Q(x|c) = Bin(x; m, 1/2) * 2 den / m
        num = (1.0 - w) * xs + w * (m - xs)
        if reverse:
            den, num = num, den
        u = sign * one_m2w * (2.0 * xs - m) / den  # r - 1
        lr = _stable_log_ratio(u, num, den)
        if linear:
            # Bin(x)/Bin(xc): right of the centre multiply (m - x)/(x + 1) (0 once x reaches m),
            # left of it multiply x/(m - x + 1) (0 once x reaches 0)
            rel = np.empty_like(x)
            rel[:, centre] = 1.0
            xr = x[:, centre:-1]
            rel[:, centre + 1 :] = np.cumprod(np.maximum(m - xr, 0.0) / (xr + 1.0), axis=1)
            xl = x[:, centre:0:-1]
            rel[:, :centre] = np.cumprod(np.maximum(xl, 0.0) / (m - xl + 1.0), axis=1)[:, ::-1]
            qv = np.where(valid, rel * den, 0.0)
            total = np.sum(qv * _f_linear(a, lr, u), axis=1) / np.sum(qv, axis=1)
            with np.errstate(divide="ignore"):
                out[start : start + rows] = np.log(total)
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                step = np.log1p((m - 2.0 * xs - 1.0) / (xs + 1.0))
            step = np.where(valid & (xs < m), step, 0.0)
            log_bin = np.zeros_like(x)
            log_bin[:, centre + 1 :] = np.cumsum(step[:, centre:-1], axis=1)
            log_bin[:, :centre] = -np.cumsum(step[:, centre - 1 :: -1], axis=1)[:, ::-1]
            log_bin += _binom_logpmf(xc, m, log_half, log_half)
            with np.errstate(divide="ignore", invalid="ignore"):
                log_q = np.where(valid, log_bin + np.log(2.0 * den / m), -np.inf)
            log_q -= special.logsumexp(log_q, axis=1, keepdims=True)
            terms = np.where(valid, _log_f(a, lr) + log_q, -np.inf)
            out[start : start + rows] = special.logsumexp(terms, axis=1)
    return out


def _renyi_one(eps0: float, n: int, a: float, variant: str, reverse: bool) -> float:
    w, log_q, log_1mq = _params(eps0, variant)
    trials = n - 1
    # excess_c = E_Q[r^a] - 1 is non-increasing in c (data processing); bound the C tails with it.
    log_ex0 = float(_log_excess(a, np.zeros(1, dtype=np.int64), w, eps0, reverse)[0])
    if trials == 0:
        lt = log_ex0
    else:
        q = math.exp(log_q)
        mode = min(trials, int(math.floor(n * q)))
        log_ex_mode = float(_log_excess(a, np.array([mode]), w, eps0, reverse)[0])
        # window: upper side drop RENYI_WINDOW_DROP (excess there <= excess at the mode), lower side
        # wider by log(excess_0 / excess_mode) so the bounded lower-tail term stays below
        # e^-RENYI_WINDOW_DROP relative.
        extra = max(0.0, log_ex0 - log_ex_mode)
        c_lo_win = _binom_window(trials, log_q, log_1mq, RENYI_WINDOW_DROP + extra)
        c_hi_win = _binom_window(trials, log_q, log_1mq, RENYI_WINDOW_DROP)
        c = np.arange(int(c_lo_win[0]), int(c_hi_win[-1]) + 1, dtype=np.int64)
        lp = _binom_logpmf(c, trials, log_q, log_1mq)
        rel_lp = lp - lp.max()
        pmf = np.exp(rel_lp)
        lo_tail = float(stats.binom.cdf(c[0] - 1, trials, q)) if c[0] > 0 else 0.0
        hi_tail = float(stats.binom.sf(c[-1], trials, q)) if c[-1] < trials else 0.0
        # in log space: exp(rel_lp) may underflow to 0 far from the mode (log 0 warned and gave -inf)
        log_pmf = rel_lp + math.log((1.0 - lo_tail - hi_tail) / pmf.sum())
        terms = _log_excess(a, c, w, eps0, reverse)
        parts = list(log_pmf + terms)
        # rigorous tail terms (upper bounds, negligible): below -> excess_0, above -> excess_{c_hi}
        if lo_tail > 0.0:
            parts.append(math.log(lo_tail) + log_ex0)
        if hi_tail > 0.0:
            parts.append(math.log(hi_tail) + float(terms[-1]))
        parts = np.asarray(parts)
        parts = parts[np.isfinite(parts)]
        lt = float(special.logsumexp(parts)) if parts.size else -math.inf
    # D_a = log(1 + excess) / (a - 1)
    if lt == -math.inf:
        return 0.0
    log1p_ex = lt + math.log1p(math.exp(-lt)) if lt > 0 else math.log1p(math.exp(lt))
    return log1p_ex / (a - 1.0)


def clone_renyi(eps0: float, n: int, order: float, variant: Variant = "stronger") -> float:
    """Exact Renyi divergence ``D_order`` of the clone pair (both directions: they are equal).

    ``D_a(P||Q) = log(sum P^a Q^{1-a}) / (a - 1)`` (Renyi 1961; seed 000 Thm 1 computes it for the FOCS
    pair). Since C is observed, ``sum P^a Q^{1-a} = 1 + sum_c P(C=c) E_{Q(.|c)}[f(log r)]`` with
    ``f(l) = e^{a l} - 1 - a(e^l - 1) >= 0`` (uses ``E_Q[r - 1] = 0``), so the tiny excess over 1 is
    summed directly, in log space, without cancellation; ``D_a = log1p(excess) / (a - 1)``. The x window
    per c widens with the order (log-mass drop ``40 + log m + a eps0``); the C window is chosen so the
    rigorously bounded tail terms are below e^-40 relative. Cost grows like ``sqrt(n)`` times the number
    of c in the window and with the order: about a second at ``n = 1e6`` and small orders, but minutes at
    ``n = 1e8`` or order 1e4 (review 41 measured 249 s and 481 s), with no time limit. The pair is
    symmetric (``x -> m - x`` swaps P and
    Q given c), so ``D_a(P||Q) = D_a(Q||P)``: the maximum of both directions is computed as one of them
    (the tests evaluate both and check they agree). Orders above :data:`RENYI_MAX_ORDER` (10000) raise
    :class:`accounting.RefusedError` saying so.
    """
    eps0 = _check_eps0(eps0)
    n = _check_n(n)
    variant = _check_variant(variant)
    if isinstance(order, bool) or not isinstance(order, numbers.Real):
        raise TypeError(f"order must be a real number > 1, got {type(order).__name__}")
    a = float(order)
    if not (math.isfinite(a) and 1.0 < a):
        raise ValueError(f"order must be a finite real number > 1, got {a!r}")
    if a > RENYI_MAX_ORDER:
        raise RefusedError(
            f"the exact clone Renyi divergence is computed for orders 1 < order <= {RENYI_MAX_ORDER:g} "
            f"(RENYI_MAX_ORDER: its x window widens with order * eps0 and the cost with it); got order={a:g}. "
            f"For larger orders use D_order <= D_inf <= eps0 = {eps0:g}, or a smaller order"
        )
    return _renyi_cached(eps0, n, a, variant)


@functools.lru_cache(maxsize=256)
def _renyi_cached(eps0: float, n: int, a: float, variant: str) -> float:
    # Both directions are equal for clone pairs (x -> m - x maps P(.|c) onto Q(.|c)); the reverse
    # direction is computed by _renyi_one(..., reverse=True) in the tests to check this symmetry.
    return _renyi_one(eps0, n, a, variant, reverse=False)


# ----------------------------------------------------------------------------------------------------
# privacy loss distribution


@functools.lru_cache(maxsize=32)
def _loss_support(eps0: float, n: int, variant: str, pessimistic: bool):
    """Exact losses and P-masses of a (blocked, truncated) pair dominating / dominated by the clone pair.

    Rigorous construction (see module docstring for the monotonicity in c):

    * C outside its window (log-mass drop ``PLD_WINDOW_DROP``): pessimistic -> lower tail to infinity
      mass, upper tail to the last block (whose representative has fewer clones); optimistic -> lower
      tail to the first block (whose representative has more clones), upper tail dropped.
    * C inside the window is cut into blocks of relative width ``PLD_BLOCK_RELATIVE_WIDTH``; every c in
      a block is replaced by the block's lowest c (pessimistic: a dominating pair) or highest c
      (optimistic: a dominated pair).
    * For a representative c, X outside its window: pessimistic -> mass below goes to the lowest kept
      loss (rounding up), mass above to infinity; optimistic -> mass below dropped, mass above to the
      highest kept loss (rounding down).

    Returns ``(losses, probs, infinity_mass)`` as float arrays sorted by loss (not yet on a grid).
    """
    w, _, _ = _params(eps0, variant)
    one_m2w = _one_minus_2w(eps0)
    c, pmf, lo_tail, hi_tail = _c_distribution(n, eps0, variant, PLD_WINDOW_DROP)
    width = max(1, int(math.floor(PLD_BLOCK_RELATIVE_WIDTH * max(1, int(c[-1])))))
    starts = np.arange(0, c.size, width)
    block_mass = np.add.reduceat(pmf, starts)
    if pessimistic:
        reps = c[starts]
        block_mass[-1] += hi_tail
        infinity = lo_tail
    else:
        ends = np.minimum(starts + width, c.size) - 1
        reps = c[ends]
        block_mass[0] += lo_tail
        infinity = 0.0
    keep = block_mass > 0.0
    reps, block_mass = reps[keep], block_mass[keep]
    all_l, all_p = [], []
    m_max = int(reps.max()) + 1
    half = int(math.ceil(math.sqrt(2.0 * PLD_WINDOW_DROP) * 0.5 * math.sqrt(m_max) + 10))
    half = min(half, m_max // 2 + 2)
    offsets = np.arange(-half, half + 1, dtype=np.float64)
    rows = max(1, _CHUNK_ELEMENTS // offsets.size)
    log_half = -math.log(2.0)
    for start in range(0, reps.size, rows):
        cr = reps[start : start + rows]
        mass = block_mass[start : start + rows]
        m = cr.astype(np.float64)[:, None] + 1.0
        xc = np.floor(m / 2.0)
        x = xc + offsets[None, :]
        valid = (x >= 0.0) & (x <= m)
        xs = np.clip(x, 0.0, m)
        # log Bin(x; m, 1/2): Loader's form at the centre, exact ratio recurrence outwards
        with np.errstate(divide="ignore", invalid="ignore"):
            step = np.log1p((m - 2.0 * xs - 1.0) / (xs + 1.0))
        step = np.where(valid & (xs < m), step, 0.0)
        log_bin = np.zeros_like(x)
        log_bin[:, half + 1 :] = np.cumsum(step[:, half:-1], axis=1)
        log_bin[:, :half] = -np.cumsum(step[:, half - 1 :: -1], axis=1)[:, ::-1]
        log_bin += _binom_logpmf(xc, m, log_half, log_half)
        num = (1.0 - w) * xs + w * (m - xs)  # P(x|c) = Bin(x; m, 1/2) * 2 num / m
        den = w * xs + (1.0 - w) * (m - xs)
        with np.errstate(divide="ignore", invalid="ignore", under="ignore"):
            probs = np.where(valid, np.exp(log_bin) * (2.0 * num / m), 0.0)
            losses = np.where(valid, _stable_log_ratio(one_m2w * (2.0 * xs - m) / den, num, den), 0.0)
        # exact P-masses outside the window: X = A + D, A ~ Bin(c, 1/2), D ~ Bern(1 - w)
        x_lo = np.maximum(xc[:, 0] - half, 0.0)
        x_hi = np.minimum(xc[:, 0] + half, m[:, 0])
        below = w * _tail_le(x_lo - 1.0, cr) + (1.0 - w) * _tail_le(x_lo - 2.0, cr)
        above = (1.0 - w) * _tail_ge(x_hi, cr) + w * _tail_ge(x_hi + 1.0, cr)
        probs *= ((1.0 - below - above) / probs.sum(axis=1))[:, None]
        first = np.argmax(valid, axis=1)
        last = valid.shape[1] - 1 - np.argmax(valid[:, ::-1], axis=1)
        rr = np.arange(cr.size)
        if pessimistic:
            probs[rr, first] += below
            infinity += float(np.dot(mass, above))
        else:
            probs[rr, last] += above
        probs *= mass[:, None]
        all_l.append(losses[valid])
        all_p.append(probs[valid])
    losses = np.concatenate(all_l)
    probs = np.concatenate(all_p)
    order = np.argsort(losses, kind="stable")  # sorted once here, cached; later sorts are linear
    return losses[order], probs[order], float(infinity)


def clone_loss_moments(eps0: float, n: int, variant: Variant = "stronger") -> tuple[float, float]:
    """Mean (the KL divergence) and standard deviation of the privacy loss of the (pessimistic) pair."""
    eps0 = _check_eps0(eps0)
    n = _check_n(n)
    variant = _check_variant(variant)
    losses, probs, _ = _loss_support(eps0, n, variant, True)
    # Losses of -inf (P-mass where the log-ratio underflows, only at very large eps0) carry no
    # hockey-stick mass; the moments (used only to size the grid) are those of the finite part.
    finite = np.isfinite(losses)
    losses, probs = losses[finite], probs[finite]
    tot = probs.sum()
    mean = float(np.dot(losses, probs) / tot)
    var = float(np.dot((losses - mean) ** 2, probs) / tot)
    return mean, math.sqrt(var)


def suggested_interval(
    eps0: float, n: int, rounds: int = 1, variant: Variant = "stronger"
) -> float:
    """Grid interval for a PLD that will be composed ``rounds`` times.

    Rounding each loss up by less than ``h`` shifts the composed loss by less than ``T h`` (so the
    pessimistic epsilon is at most ``T h`` above the undiscretised one, about ``T h / 2`` on average).
    With ``m1`` the mean (KL) and ``s1`` the standard deviation of one round's loss, the composed epsilon
    is at least ``T m1 + 2 sqrt(T) s1`` for any delta <= 0.02, so
    ``h = INTERVAL_RELATIVE_ERROR * (m1 + 2 s1 / sqrt(T))`` keeps the discretisation error below
    ``INTERVAL_RELATIVE_ERROR`` (0.4%; the typical excess is half of it, as rounding up adds ``h/2`` per
    round on average) relative. ``h`` is then enlarged if needed so the composed grid (the Chernoff
    window of the composition is about ``T m1 + 17 sqrt(T) s1`` wide) stays below ``MAX_COMPOSED_GRID``
    points, and reduced if the grid would have fewer than ``MIN_COMPOSED_GRID`` points (cheap, and it
    keeps the error small when delta is close to the total variation distance, where epsilon is small
    compared with ``s1``: e.g. 2e-4 relative at T = 1, n = 1e6, eps0 = 0.5, delta = 1e-4). The value
    is rounded down to 3 significant digits so it can serve as a cache key.
    """
    eps0 = _check_eps0(eps0)
    n = _check_n(n)
    rounds = _check_rounds(rounds)
    variant = _check_variant(variant)
    m1, s1 = clone_loss_moments(eps0, n, variant)
    t = float(rounds)
    width = t * m1 + 18.0 * math.sqrt(t) * s1
    h = min(INTERVAL_RELATIVE_ERROR * (m1 + 2.0 * s1 / math.sqrt(t)), width / MIN_COMPOSED_GRID)
    h = max(h, width / MAX_COMPOSED_GRID)
    if not (h > 0.0 and math.isfinite(h)):
        raise ValueError(f"cannot choose a grid interval for eps0={eps0}, n={n}: loss moments {m1}, {s1}")
    return round_interval(h, up=False)  # never coarser than the bounds above allow


def round_interval(h: float, *, up: bool) -> float:
    """A grid interval ``h`` rounded to 3 significant digits, a stable cache key for PLDs: ``up=False`` never
    coarser (keeps an error target), ``up=True`` never finer (keeps a grid-size limit)."""
    scale = 10.0 ** (math.floor(math.log10(h)) - 2)
    return float(f"{(math.ceil(h / scale) if up else math.floor(h / scale)) * scale:.3g}")


def clone_pld(
    eps0: float,
    n: int,
    variant: Variant = "stronger",
    *,
    value_discretization_interval: float | None = None,
    pessimistic: bool = True,
) -> PrivacyLossDistribution:
    """Privacy loss distribution of one shuffle round (clone pair), for composition.

    Pessimistic (default): a valid upper bound for every composition (losses rounded up, truncated mass
    to infinity, blocks of C replaced by their lowest c; see ``_loss_support``). Optimistic: the mirror
    image, a lower bound on the clone pair's epsilon (not on the mechanism's: the clone pair is a reduction that
    bounds it from above). ``value_discretization_interval=None`` uses
    ``suggested_interval(eps0, n, rounds=1)``; pass ``suggested_interval(eps0, n, rounds=T)`` when the PLD
    will be composed ``T`` times (or use :func:`clone_epsilon_composed`). Symmetric (both directions
    coincide for clone pairs). Cached by ``(eps0, n, variant, interval, pessimistic)``.
    """
    eps0 = _check_eps0(eps0)
    n = _check_n(n)
    variant = _check_variant(variant)
    if not isinstance(pessimistic, bool):
        raise TypeError(f"pessimistic must be a bool, got {type(pessimistic).__name__}")
    if value_discretization_interval is None:
        h = suggested_interval(eps0, n, 1, variant)
    else:
        h = _pld._check_interval(value_discretization_interval)  # pylint: disable=protected-access
    return _clone_pld_cached(eps0, n, variant, h, pessimistic)


@functools.lru_cache(maxsize=64)
def _clone_pld_cached(
    eps0: float, n: int, variant: str, h: float, pessimistic: bool
) -> PrivacyLossDistribution:
    losses, probs, infinity = _loss_support(eps0, n, variant, pessimistic)
    return _pld.pld_from_losses(
        losses,
        probs,
        infinity_mass=min(1.0, infinity),
        pessimistic=pessimistic,
        value_discretization_interval=h,
        tail_mass_truncation=PLD_TAIL_MASS_TRUNCATION,
    )


def clone_epsilon_composed(
    eps0: float,
    n: int,
    delta: float,
    rounds: int,
    variant: Variant = "stronger",
    *,
    pessimistic: bool = True,
    value_discretization_interval: float | None = None,
) -> float:
    """Epsilon at ``delta`` of ``rounds`` identical shuffle rounds, by PLD composition.

    Pessimistic (default): an upper bound on the mechanism's epsilon (Feldman-McMillan-Talwar's clone
    reduction, composed by PLD). Optimistic: a lower bound on the *clone pair's* composed epsilon, so the pair
    (optimistic, pessimistic) brackets the discretisation error of this bound; it is not a lower bound on the
    mechanism's epsilon. The interval defaults to ``suggested_interval(eps0, n, rounds)``.
    """
    eps0 = _check_eps0(eps0)
    n = _check_n(n)
    delta = _check_delta(delta)
    rounds = _check_rounds(rounds)
    variant = _check_variant(variant)
    h = (
        suggested_interval(eps0, n, rounds, variant)
        if value_discretization_interval is None
        else value_discretization_interval
    )
    one = clone_pld(eps0, n, variant, value_discretization_interval=h, pessimistic=pessimistic)
    composed = one if rounds == 1 else _pld.compose([(one, rounds)])
    return _pld.epsilon_for_delta(composed, delta)


# ----------------------------------------------------------------------------------------------------
# the straightforward baseline (benchmark and cross-check only)


def clone_epsilon_baseline(
    eps0: float, n: int, delta: float, variant: Variant = "stronger"
) -> float:
    """Single-round epsilon "the straightforward way": for every c of the support of C (all c whose
    mass is not zero in float64), binomial tails from scipy for each trial epsilon, summed with numpy,
    and a scipy root find (brentq on [0, eps0]). No windows, no bracketing tricks, no caching. Used
    by ``benchmarks/bench_accounting.py`` as the reference cost and by the tests as a cross-check.
    """
    eps0 = _check_eps0(eps0)
    n = _check_n(n)
    delta = _check_delta(delta)
    variant = _check_variant(variant)
    w, log_q, _ = _params(eps0, variant)
    c = np.arange(0, n, dtype=np.int64)
    pmf = stats.binom.pmf(c, n - 1, math.exp(log_q))
    nz = pmf > 0
    c, pmf = c[nz], pmf[nz] / pmf[nz].sum()

    def gap(e: float) -> float:
        return float(np.sum(pmf * _delta_per_c(c, e, w, eps0))) - delta

    if gap(0.0) <= 0.0:
        return 0.0
    return float(optimize.brentq(gap, 0.0, eps0, xtol=1e-300, rtol=EPSILON_RTOL, maxiter=500))


def clear_caches() -> None:
    """Empty the memoisation caches (PLDs, loss supports, exact inversions, Renyi values)."""
    for cached in (_loss_support, _clone_pld_cached, _epsilon_exact, _renyi_cached):
        cached.cache_clear()
