"""Mechanism-aware amplification for the project's discrete Laplace randomizer: the privacy blanket pair.

The randomizer (:class:`shuffledp.clients.randomizer.DiscreteLaplaceRandomizer`) maps every input to an integer
vector ``q`` with ``||q||_1 <= K`` and adds iid discrete Laplace noise ``P(Z = k) = (1-t)/(1+t) t^|k|`` per
coordinate, ``t = exp(-s)``, ``s = eps_used / (2K) <= eps0 / (2K)``. Its output pmf is ``P_q(y) = P_0(y) t^(||y-q||_1
- ||y||_1)``, so for every input and output

    P_q(y) >= t^K P_0(y) = gamma P_0(y),   gamma = e^{-eps_used/2} >= e^{-eps0/2}:

every report is, with probability gamma, a draw from the blanket ``P_0`` (the output at the centre), whatever its
input (Balle, Bell, Gascon, Nissim, "The privacy blanket of the shuffle model", CRYPTO 2019). The likelihood
ratios ``a = P_x/P_0`` and ``b = P_x'/P_0`` of two inputs of the client under attack lie in ``[gamma, 1/gamma]``.

This module computes the privacy loss of the dominating pair derived in docs/accounting.md ("Mechanism-aware
accounting for the discrete Laplace randomizer"): the blanket reports among the ``n - 1`` others are revealed
as such (``M ~ Bin(n-1, gamma)``), and the law of ``(a, b)`` under ``P_0`` is replaced by the countermonotone law
on the corners of ``[gamma, 1/gamma]^2`` (a mean-preserving spread; it is exactly the law of the mechanism with
``K = 1``, the worst grid). Counting the corners ``H = (1/gamma, gamma)``, ``L = (gamma, 1/gamma)`` and
``Z = (gamma, gamma)`` among the blanket reports and the attacked client's report, with ``s = #H + #L``,
``z = #Z``, ``h = #H``:

* ``(s, z)`` has the same law under both inputs (it is ancillary), with weight
  ``W(s, z) = Bin(s; n, 2 pi) Bin(z; n - s, rho') (z + s (e+1)/2) / n``, ``e = e^eps0``, ``pi = gamma^2/(1+gamma)``,
  ``rho' = rho/(1 - 2 pi)``, ``rho = gamma (1-gamma)/(1+gamma)``;
* given ``(s, z)``, ``P(h) = Bin(h; s, 1/2) (1 + v)``, ``Q(h) = Bin(h; s, 1/2) (1 - v)`` with
  ``v = (1 - lam) kappa (2h - s)/s``, ``kappa = tanh(eps0/2)``, ``lam = z / (z + s (e+1)/2)``: the loss is
  ``log((1+v)/(1-v))``.

The conditional pair is Blackwell-decreasing in ``s`` and in ``lam`` (docs/accounting.md), so blocks of ``s`` and
cells of ``lam`` are replaced by their smallest values: a dominating pair. Windows cut at a log-mass drop of
:data:`BLANKET_WINDOW_DROP`; the cut mass goes to the infinity mass (or, below the ``h`` window, up to the
lowest kept loss). Every step is pessimistic, so every delta(eps) of every composition is an upper bound.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from scipy import stats

from shuffledp.accounting.binomial import binom_logpmf, binom_window, tail_ge, tail_le
from shuffledp.accounting.core import RefusedError
from shuffledp.accounting.validation import check_eps0, check_n

__all__ = [
    "BLANKET_WINDOW_DROP",
    "BLANKET_S_BLOCK_RELATIVE_WIDTH",
    "BLANKET_LAMBDA_CELL",
    "BLANKET_Z_GROUP_RELATIVE_WIDTH",
    "BLANKET_EXACT_SUPPORT",
    "BLANKET_MAX_SUPPORT",
    "blanket_mass",
    "blanket_loss_support",
    "blanket_loss_moments",
    "blanket_delta",
    "blanket_epsilon",
    "spread_blanket_pld",
    "composed_blanket_pld",
    "BLANKET_EPSILON_RTOL",
]

#: Log-mass drop that delimits the windows of s, z and h (e^-50 ~ 2e-22 of mass per window goes to infinity).
BLANKET_WINDOW_DROP = 50.0
#: Relative width of the blocks of s (each block uses its smallest s: the loss scale grows by about half of it).
BLANKET_S_BLOCK_RELATIVE_WIDTH = 1e-3
#: Width of the cells of 1 - lam relative to 1 - lam (each cell uses its smallest lam, i.e. largest 1 - lam).
BLANKET_LAMBDA_CELL = 5e-4
#: Relative width of the groups of s that share one z-law (the law at the group's largest s, a pessimistic one).
BLANKET_Z_GROUP_RELATIVE_WIDTH = 1e-2
#: Up to this many support points every z is its own row (no cells of lam); beyond, cells of lam.
BLANKET_EXACT_SUPPORT = 4_000_000
#: Relative tolerance of the bisection of the single-round epsilon (the value is rounded up).
BLANKET_EPSILON_RTOL = 1e-12
#: Largest number of support points the single-round loss distribution may have (memory ~ 16 bytes each).
BLANKET_MAX_SUPPORT = 40_000_000


def blanket_mass(eps0: float) -> float:
    """The blanket mass ``gamma = e^{-eps0/2}`` of the discrete Laplace randomizer (any dimension, any grid).

    ``inf_q P_q(y) = t^K P_0(y)`` (the farthest point of the integer L1 ball from ``y`` is a vertex at distance
    ``||y||_1 + K``), and ``sum_y P_0(y) = 1``, so the blanket mass is ``t^K = e^{-eps_used/2}``, at least
    ``e^{-eps0/2}`` (Balle, Bell, Gascon, Nissim, CRYPTO 2019, the privacy blanket).

    Args:
        eps0: the local privacy parameter the randomizer was built with.

    Returns:
        ``gamma = e^{-eps0/2}``.
    """
    return math.exp(-0.5 * check_eps0(eps0))


def _params(eps0: float) -> dict[str, float]:
    """The corner law's constants, in log space where they can underflow."""
    log_g = -0.5 * eps0
    log_1pg = math.log1p(math.exp(log_g))
    log_1mg = math.log(-math.expm1(log_g))
    log_2pi = math.log(2.0) + 2.0 * log_g - log_1pg  # 2 pi = 2 gamma^2 / (1 + gamma): H or L among the n
    log_1m2pi = math.log(-math.expm1(log_2pi))
    log_rho = log_g + log_1mg - log_1pg  # rho = gamma (1 - gamma) / (1 + gamma): Z among the n
    log_rho_c = log_rho - log_1m2pi  # rho' = rho / (1 - 2 pi): Z among the n - s others
    return {
        "log_2pi": log_2pi,
        "log_1m2pi": log_1m2pi,
        "log_rho_c": log_rho_c,
        "log_1mrho_c": math.log(-math.expm1(log_rho_c)),
        "half_ep1": 0.5 * (math.exp(eps0) + 1.0),  # (e + 1) / 2
        "kappa": math.tanh(0.5 * eps0),
        "one_m_kappa": 2.0 / (math.exp(eps0) + 1.0),  # 1 - kappa without cancellation
    }


def _tilted_tails(trials: int, log_q: float, log_1mq: float, lo: int, hi: int, a: float, b: float) -> float:
    """``sum_{k < lo or k > hi} Bin(k; trials, q) (a + b k)`` by binomial tails (never ``1 - sum``).

    Uses ``sum_{k >= j} k Bin(k; N, q) = N q P(Bin(N-1, q) >= j-1)``.
    """
    q = math.exp(log_q)
    out = 0.0
    if lo > 0:
        out += a * float(stats.binom.cdf(lo - 1, trials, q))
        if trials > 0 and lo > 1:
            out += b * trials * q * float(stats.binom.cdf(lo - 2, trials - 1, q))
    if hi < trials:
        out += a * float(stats.binom.sf(hi, trials, q))
        out += b * trials * q * float(stats.binom.sf(hi - 1, trials - 1, q))
    return out


def _z_law(n: int, s: int, p: dict[str, float]) -> tuple[np.ndarray, np.ndarray, float]:
    """The law of z given s (``Bin(z; n - s, rho')`` tilted by ``z + s (e+1)/2``) on its window, and the mass
    outside the window (exact tails)."""
    e_half = p["half_ep1"]
    rho_c = math.exp(p["log_rho_c"])
    z = binom_window(n - s, p["log_rho_c"], p["log_1mrho_c"], BLANKET_WINDOW_DROP)
    norm = (n - s) * rho_c + s * e_half
    law = np.exp(binom_logpmf(z, n - s, p["log_rho_c"], p["log_1mrho_c"])) * (z + s * e_half) / norm
    cut = _tilted_tails(n - s, p["log_rho_c"], p["log_1mrho_c"], int(z[0]), int(z[-1]), s * e_half / norm, 1.0 / norm)
    return z, law, cut


def _rows(eps0: float, n: int, exact_z: bool) -> tuple[list[tuple[int, np.ndarray, np.ndarray]], float]:
    """Blocks of s with their representative rows ``(s0, 1 - lam per row, weight per row)``, and the cut weight.

    Pessimistic throughout (docs/accounting.md): a block of s uses its smallest s; the z-law of a group of
    blocks is the one at the group's largest s (stochastically the smallest z: fewer trials, flatter tilt), so
    weight only moves to smaller lam; a cell of z uses the largest 1 - lam of its (s, z) pairs.
    """
    p = _params(eps0)
    e_half = p["half_ep1"]
    rho_c = math.exp(p["log_rho_c"])
    s_all = binom_window(n, p["log_2pi"], p["log_1m2pi"], BLANKET_WINDOW_DROP)
    s_lo, s_hi = int(s_all[0]), int(s_all[-1])
    # weight of s outside the window: E[z + s (e+1)/2 | s] / n = ((n - s) rho' + s (e+1)/2) / n
    infinity = _tilted_tails(n, p["log_2pi"], p["log_1m2pi"], s_lo, s_hi, rho_c, e_half - rho_c) / n
    w_s = np.exp(binom_logpmf(s_all, n, p["log_2pi"], p["log_1m2pi"])) * ((n - s_all) * rho_c + s_all * e_half) / n
    width = max(1, int(math.floor(BLANKET_S_BLOCK_RELATIVE_WIDTH * max(1, s_hi))))
    group = max(width, int(math.floor(BLANKET_Z_GROUP_RELATIVE_WIDTH * max(1, s_hi))) // width * width)
    blocks = []
    for g_start in range(0, s_all.size, group):
        g_end = min(g_start + group, s_all.size)
        z, law, cut = _z_law(n, int(s_all[g_end - 1]), p)
        infinity += cut * float(w_s[g_start:g_end].sum())
        zf = z.astype(np.float64)
        for start in range(g_start, g_end, width):
            block = s_all[start : min(start + width, g_end)]
            s0, s1 = int(block[0]), int(block[-1])
            weight = float(w_s[start : start + block.size].sum())
            if s0 == 0:  # s = 0 (no H or L at all): P = Q, a zero loss
                r_of_z = np.zeros(1)
                blocks.append((0, r_of_z, np.array([weight])))
                continue
            r_of_z = s1 / (s1 + zf / e_half)  # 1 - lam, decreasing in z
            if exact_z:
                blocks.append((s0, r_of_z, weight * law))
                continue
            cell = np.floor(np.log(r_of_z) / math.log1p(BLANKET_LAMBDA_CELL)).astype(np.int64)
            starts = np.flatnonzero(np.r_[True, cell[1:] != cell[:-1]])
            blocks.append((s0, r_of_z[starts], weight * np.add.reduceat(law, starts)))
    return blocks, infinity


#: Supports kept (each about 16 bytes per point: 11 M points at n = 5,000, 15 M at 10,000). A run meets one
#: (eps0, n) per round; a run whose n changes from round to round rebuilds the support anyway, and more entries
#: would only hold hundreds of MiB each (16 held 8 GiB at n = 5,000).
_SUPPORTS_KEPT = 2


@functools.lru_cache(maxsize=_SUPPORTS_KEPT)
def blanket_loss_support(eps0: float, n: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Exact losses and P-masses of the dominating blanket pair (pessimistic blocks and windows), unsorted.

    Args:
        eps0: local privacy parameter of the discrete Laplace randomizer, > 0.
        n: number of shuffled reports, >= 1.

    Returns:
        ``(losses, probs, infinity_mass)``; ``probs`` plus ``infinity_mass`` sum to 1 up to round-off.

    Raises:
        RefusedError: the support would exceed :data:`BLANKET_MAX_SUPPORT` points.
    """
    eps0 = check_eps0(eps0)
    n = check_n(n)
    p = _params(eps0)
    blocks, infinity = _rows(eps0, n, exact_z=True)
    total = sum(r.size * (2 * _h_half(s0) + 1) for s0, r, _ in blocks)
    if total > BLANKET_EXACT_SUPPORT:  # cells of lam (pessimistic, BLANKET_LAMBDA_CELL) instead of every z
        blocks, infinity = _rows(eps0, n, exact_z=False)
        total = sum(r.size * (2 * _h_half(s0) + 1) for s0, r, _ in blocks)
    if total > BLANKET_MAX_SUPPORT:
        raise RefusedError(
            f"blanket-laplace at n={n}, eps0={eps0} needs {total} support points, more than "
            f"BLANKET_MAX_SUPPORT={BLANKET_MAX_SUPPORT}; no bound is reported")
    kappa, one_m_kappa = p["kappa"], p["one_m_kappa"]
    pe = 1.0 - 0.5 * one_m_kappa  # e/(e+1): the attacked client's corner is H with this probability, given H or L
    log_half = -math.log(2.0)
    all_l, all_p = [], []
    for s0, r_rows, w_rows in blocks:
        keep = w_rows > 0.0
        r_rows, w_rows = r_rows[keep], w_rows[keep]
        if s0 == 0 or r_rows.size == 0:
            all_l.append(np.zeros(1))
            all_p.append(np.array([float(w_rows.sum())]))
            continue
        half = _h_half(s0)
        h = np.arange(max(0, s0 // 2 - half), min(s0, s0 // 2 + half) + 1, dtype=np.float64)
        logb = binom_logpmf(h, s0, log_half, log_half)
        x = (2.0 * h - s0) / s0  # in [-1, 1]
        ax = np.abs(x)[None, :]
        r = r_rows[:, None]
        c0 = (1.0 - r) + r * one_m_kappa  # 1 - (1 - lam) kappa, without cancellation
        big = 1.0 + r * kappa * ax  # 1 + |v|
        small = (1.0 - ax) + ax * c0  # 1 - |v|
        loss = np.sign(x)[None, :] * (np.log(big) - np.log(small))
        one_plus_v = np.where(x[None, :] >= 0.0, big, small)
        probs = np.exp(logb)[None, :] * one_plus_v * w_rows[:, None]
        # P-mass of h outside the window: P = lam Bin(s, 1/2) + (1 - lam) (Bern(e/(e+1)) + Bin(s - 1, 1/2))
        h_lo, h_hi = float(h[0]), float(h[-1])
        lam = 1.0 - r_rows
        above = lam * float(tail_ge(h_hi + 1.0, s0)) + r_rows * (
            pe * float(tail_ge(h_hi, s0 - 1)) + (1.0 - pe) * float(tail_ge(h_hi + 1.0, s0 - 1)))
        below = lam * float(tail_le(h_lo - 1.0, s0)) + r_rows * (
            pe * float(tail_le(h_lo - 2.0, s0 - 1)) + (1.0 - pe) * float(tail_le(h_lo - 1.0, s0 - 1)))
        probs[:, 0] += below * w_rows  # moved up to the lowest kept loss
        infinity += float(np.dot(above, w_rows))
        all_l.append(loss.ravel())
        all_p.append(probs.ravel())
    return np.concatenate(all_l), np.concatenate(all_p), float(min(infinity, 1.0))


def _h_half(s0: int) -> int:
    """Half-width of the window of h ~ Bin(s0, 1/2) (about sqrt(2 drop) standard deviations, plus a margin)."""
    return int(math.ceil(math.sqrt(2.0 * BLANKET_WINDOW_DROP) * 0.5 * math.sqrt(max(s0, 1)) + 10))


@functools.lru_cache(maxsize=64)
def blanket_loss_moments(eps0: float, n: int) -> tuple[float, float]:
    """Mean and standard deviation of one round's loss under P (the finite part; sizes the composition grid).

    Args:
        eps0: local privacy parameter, > 0.
        n: number of shuffled reports, >= 1.

    Returns:
        ``(mean, standard deviation)``.
    """
    losses, probs, _ = blanket_loss_support(eps0, n)
    tot = float(probs.sum())
    mean = float(np.dot(losses, probs) / tot)
    var = float(np.dot((losses - mean) ** 2, probs) / tot)
    return mean, math.sqrt(max(var, 0.0))


# ---------------------------------------------------------------------------------------------------------
# One round (exact on the support) and several rounds (pessimistic PLD composition)
# ---------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)  # four arrays of the support's size: only the last (a run's single-round value)
def _sorted_support(eps0: float, n: int) -> tuple[np.ndarray, np.ndarray, float, np.ndarray, np.ndarray]:
    """The support sorted by loss, with suffix sums of P and of P e^{-L} (summed from the top: no ``1 - sum``)."""
    losses, probs, infinity = blanket_loss_support(eps0, n)
    order = np.argsort(losses, kind="stable")
    losses, probs = losses[order], probs[order]
    tail_p = np.r_[np.cumsum(probs[::-1])[::-1], 0.0]
    tail_q = np.r_[np.cumsum((probs * np.exp(-losses))[::-1])[::-1], 0.0]
    return losses, probs, infinity, tail_p, tail_q


def blanket_delta(eps0: float, n: int, epsilon: float) -> float:
    """One round's delta(epsilon) of the dominating blanket pair: ``inf + sum_{L > eps} P (1 - e^{eps - L})``.

    Every term is non-negative (``-expm1(eps - L)``), summed directly (no difference of tails).

    Args:
        eps0: local privacy parameter of the discrete Laplace randomizer, > 0.
        n: number of shuffled reports, >= 1.
        epsilon: finite, >= 0.

    Returns:
        The delta, an upper bound for the shuffled randomizer.
    """
    losses, probs, infinity, _, _ = _sorted_support(eps0, n)
    i = int(np.searchsorted(losses, epsilon, side="right"))
    return float(min(1.0, infinity + float(np.dot(probs[i:], -np.expm1(epsilon - losses[i:])))))


def blanket_epsilon(eps0: float, n: int, delta: float) -> float:
    """One round's smallest epsilon (to :data:`BLANKET_EPSILON_RTOL`, rounded up) with delta(eps) <= delta.

    Bisection on the suffix sums (``inf + S_P - e^eps S_Q``), then the value is checked with :func:`blanket_delta`
    (direct non-negative sum) and stepped up by at most :data:`BLANKET_EPSILON_RTOL` relative until it passes.

    Args:
        eps0: local privacy parameter, > 0.
        n: number of shuffled reports, >= 1.
        delta: 0 < delta < 1.

    Returns:
        The epsilon (``math.inf`` when the infinity mass alone exceeds delta).

    Raises:
        ArithmeticError: the checked delta stays above ``delta`` after the step-up (a numerical failure).
    """
    losses, _, infinity, tail_p, tail_q = _sorted_support(eps0, n)
    if infinity > delta:
        return math.inf

    def fast(eps: float) -> float:
        i = int(np.searchsorted(losses, eps, side="right"))
        return infinity + float(tail_p[i]) - math.exp(eps) * float(tail_q[i])

    lo, hi = 0.0, max(float(losses[-1]), 0.0)
    if blanket_delta(eps0, n, 0.0) <= delta:
        return 0.0
    while hi - lo > 0.25 * BLANKET_EPSILON_RTOL * max(hi, 1e-300):
        mid = 0.5 * (lo + hi)
        if fast(mid) <= delta:
            hi = mid
        else:
            lo = mid
    limit = hi * (1.0 + BLANKET_EPSILON_RTOL)
    step = 0.25 * BLANKET_EPSILON_RTOL * max(hi, 1e-300)
    while blanket_delta(eps0, n, hi) > delta:
        if hi + step > limit:
            raise ArithmeticError(
                f"blanket-laplace: delta({hi!r}) = {blanket_delta(eps0, n, hi)!r} > {delta!r} after the step-up")
        hi += step
    return hi


@functools.lru_cache(maxsize=32)
def spread_blanket_pld(eps0: float, n: int, h: float) -> Any:
    """One round's PLD on the grid ``h`` by the pessimistic mean-preserving spread (Doroshenko, Ghazi, Kamath,
    Kumar, Manurangsi, "Connect the dots", PETS 2022; :func:`shuffledp.accounting.pld_spread.spread_onto_grid`).

    Args:
        eps0: local privacy parameter, > 0.
        n: number of shuffled reports, >= 1.
        h: the grid interval, > 0.

    Returns:
        A symmetric ``PrivacyLossDistribution`` (the pair is symmetric: swapping the inputs maps h to s - h).
    """
    from shuffledp.accounting import pld_spread as ps

    losses, probs, infinity = blanket_loss_support(eps0, n)
    extent = _support_extent(eps0, n)
    if extent is None:  # a loss that is not finite or a mass that is not > 0: the general routine handles it
        dense = ps.spread_onto_grid(losses, probs, infinity, h)
    else:
        dense = _spread_in_chunks(losses, probs, infinity, h, extent)
    return ps.to_pld(dense, h, pessimistic=True)


#: Support points per chunk of :func:`_spread_in_chunks` (buffers stay in cache, no fresh arrays of the support's size).
_SPREAD_CHUNK = 1 << 16


@functools.lru_cache(maxsize=16)
def _support_extent(eps0: float, n: int) -> tuple[float, float] | None:
    """``(smallest, largest)`` loss of :func:`blanket_loss_support` when every loss is finite and every mass finite
    and > 0 (then :func:`shuffledp.accounting.pld_spread.spread_onto_grid` keeps every point as it is), else None."""
    losses, probs, _ = blanket_loss_support(eps0, n)
    if losses.size == 0 or not (np.all(np.isfinite(losses)) and np.all(np.isfinite(probs)) and np.all(probs > 0.0)):
        return None
    return float(losses.min()), float(losses.max())


def _spread_in_chunks(
    losses: np.ndarray, probs: np.ndarray, infinity: float, h: float, extent: tuple[float, float]
) -> tuple[int, np.ndarray, float]:
    """:func:`shuffledp.accounting.pld_spread.spread_onto_grid` for a support of finite losses and positive masses,
    bit for bit (the same operations on every point, the masses added to the grid in the same order), a chunk
    at a time.

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
    buf_k, buf_d, buf_up, buf_w = (np.empty(_SPREAD_CHUNK) for _ in range(4))
    buf_i = np.empty(_SPREAD_CHUNK, dtype=np.int64)
    for start in range(0, losses.size, _SPREAD_CHUNK):
        lc, pc = losses[start : start + _SPREAD_CHUNK], probs[start : start + _SPREAD_CHUNK]
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


def composed_blanket_pld(items: list[tuple[int, float, int]]) -> tuple[Any, float]:
    """Groups ``(n, eps0, count)`` of rounds composed on one grid (FFT powers, :func:`..pld.compose`).

    The grid interval is chosen as for the clone pairs (:func:`shuffledp.accounting.clone_spread.spread_interval`,
    which refuses a grid too coarse for its error target).

    Args:
        items: ``(n, eps0, count)`` per group.

    Returns:
        ``(composed PLD, interval)``.
    """
    from shuffledp.accounting import pld as _pld
    from shuffledp.accounting.clone_spread import spread_interval

    moments = [(*blanket_loss_moments(eps0, n), count) for n, eps0, count in items]
    total = sum(count for _, _, count in items)
    h = spread_interval(moments, f"blanket-laplace, {total} rounds in {len(items)} group(s)")
    plds = [(spread_blanket_pld(eps0, n, h), count) for n, eps0, count in items]
    return _pld.compose(plds), h
