"""Exact Renyi divergence of the clone pairs (:func:`clone_renyi`; the reduction is described in
:mod:`shuffledp.accounting.clones`)."""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import special, stats

from shuffledp.accounting.binomial import binom_logpmf, binom_window
from shuffledp.accounting.clone_pair import (
    CHUNK_ELEMENTS,
    RENYI_MAX_ORDER,
    RENYI_WINDOW_DROP,
    Variant,
    _one_minus_2w,
    _params,
    _stable_log_ratio,
    check_variant,
)
from shuffledp.accounting.core import RefusedError
from shuffledp.accounting.validation import check_eps0, check_n, check_order

__all__ = ["clone_renyi"]


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
    rows = max(1, CHUNK_ELEMENTS // offsets.size)
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
            log_bin += binom_logpmf(xc, m, log_half, log_half)
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
        c_lo_win = binom_window(trials, log_q, log_1mq, RENYI_WINDOW_DROP + extra)
        c_hi_win = binom_window(trials, log_q, log_1mq, RENYI_WINDOW_DROP)
        c = np.arange(int(c_lo_win[0]), int(c_hi_win[-1]) + 1, dtype=np.int64)
        lp = binom_logpmf(c, trials, log_q, log_1mq)
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

    ``D_a(P||Q) = log(sum P^a Q^{1-a}) / (a - 1)`` (Renyi 1961; Chen, Cao, Ge, "Renyi DP in the shuffle model:
    enhanced amplification bounds", ICASSP 2024, seed 000, Thm 1 computes it for the FOCS pair). Since C is
    observed, ``sum P^a Q^{1-a} = 1 + sum_c P(C=c) E_{Q(.|c)}[f(log r)]`` with
    ``f(l) = e^{a l} - 1 - a(e^l - 1) >= 0`` (uses ``E_Q[r - 1] = 0``), so the tiny excess over 1 is
    summed directly, in log space, without cancellation; ``D_a = log1p(excess) / (a - 1)``. The x window
    per c widens with the order (log-mass drop ``40 + log m + a eps0``); the C window is chosen so the
    rigorously bounded tail terms are below e^-40 relative. Cost grows like ``sqrt(n)`` times the number
    of c in the window and with the order: about a second at ``n = 1e6`` and small orders, but minutes at
    ``n = 1e8`` or order 1e4 (measured: 249 s and 481 s), with no time limit. The pair is symmetric
    (``x -> m - x`` swaps P and Q given c), so ``D_a(P||Q) = D_a(Q||P)``: the maximum of both directions is
    computed as one of them (the tests evaluate both and check they agree). Orders above
    :data:`RENYI_MAX_ORDER` (10000) raise :class:`accounting.RefusedError` saying so.

    Args:
        eps0: local privacy parameter eps0 > 0.
        n: number of shuffled reports.
        order: Renyi order lambda > 1.
        variant: ``"stronger"`` or ``"focs"`` (the clone pair).

    Returns:
        The Renyi divergence of one round.
    """
    eps0 = check_eps0(eps0)
    n = check_n(n)
    variant = check_variant(variant)
    a = check_order(order)
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
