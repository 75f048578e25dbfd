"""Mechanism-aware amplification by the privacy blanket: the dominating pair of a box of likelihood ratios, by
default the one of the project's discrete Laplace randomizer.

The randomizer (:class:`shuffledp.clients.randomizer.DiscreteLaplaceRandomizer`) maps every input to an integer
vector ``q`` with ``||q||_1 <= K`` and adds iid discrete Laplace noise ``P(Z = k) = (1-t)/(1+t) t^|k|`` per
coordinate, ``t = exp(-s)``, ``s = eps_used / (2K) <= eps0 / (2K)``. Its output pmf is ``P_q(y) = P_0(y) t^(||y-q||_1
- ||y||_1)``, so for every input and output

    P_q(y) >= t^K P_0(y) = gamma P_0(y),   gamma = e^{-eps_used/2} >= e^{-eps0/2}:

every report is, with probability gamma, a draw from the blanket ``P_0`` (the output at the centre), whatever its
input (Balle, Bell, Gascon, Nissim, "The privacy blanket of the shuffle model", CRYPTO 2019). The likelihood
ratios ``a = P_x/P_0`` and ``b = P_x'/P_0`` of two inputs of the client under attack lie in ``[gamma, 1/gamma]``.

**The box.** The pair uses three facts about a randomizer R: a base law omega, likelihood ratios ``dR(x)/d omega``
in a box ``[lo, hi]``, ``hi = e^eps0 lo``, with mean 1 under omega, and the blanket ``R(x) >= lo omega``. The
discrete Laplace randomizer has ``omega = P_0``, ``lo = gamma`` (the default, ``lo=None``); any ``lo`` with
``2/(e^eps0+1) <= lo < 1`` (``lo + hi >= 2``: the countermonotone corner law below exists) may be given. At
``lo = 2/(e^eps0+1)`` there is no Z corner and the pair is the stronger clone pair of ``clones``.

This module computes the privacy loss of the dominating pair derived in docs/accounting.md ("Mechanism-aware
accounting for the discrete Laplace randomizer"): the blanket reports among the ``n - 1`` others are revealed
as such (``M ~ Bin(n-1, lo)``), and the law of ``(a, b)`` under omega is replaced by the countermonotone law
on the corners of ``[lo, hi]^2`` (a mean-preserving spread; for the discrete Laplace it is exactly the law of the
mechanism with ``K = 1``, the worst grid): ``H = (hi, lo)`` and ``L = (lo, hi)`` with probability
``pi_s = (1 - lo)/(hi - lo)`` each, ``Z = (lo, lo)`` otherwise. So each other report is H or L with probability
``2 pi = 2 lo pi_s = 2 (1 - lo)/(e - 1)``, Z with ``rho = lo (1 - 2 pi_s) = lo - 2 pi``, revealed otherwise; the
attacked report is H, L, Z with ``pi_s hi, pi_s lo, rho`` under x. Counting H, L and Z among the blanket reports
and the attacked client's report, with ``s = #H + #L``, ``z = #Z``, ``h = #H``, ``e = e^eps0``, ``P(h, l, z) =
Mult_n(h, l, z) (e h + l + z)/n`` (the attacked report's corner removes one count), hence:

* ``(s, z)`` has the same law under both inputs (it is ancillary), with weight
  ``W(s, z) = Bin(s; n, 2 pi) Bin(z; n - s, rho') (z + s (e+1)/2) / n``, ``rho' = rho/(1 - 2 pi)``
  (``E[z + s (e+1)/2] = n lo (1 + pi_s (e - 1)) = n``); for the discrete Laplace ``pi = gamma^2/(1+gamma)``,
  ``rho = gamma (1-gamma)/(1+gamma)``;
* given ``(s, z)``, ``P(h) = Bin(h; s, 1/2) (1 + v)``, ``Q(h) = Bin(h; s, 1/2) (1 - v)`` with
  ``v = (1 - lam) kappa (2h - s)/s``, ``kappa = tanh(eps0/2)``, ``lam = z / (z + s (e+1)/2)``: the loss is
  ``log((1+v)/(1-v))``, at most eps0 in absolute value; only ``e`` enters, ``lo`` only through ``pi`` and ``rho``.

The conditional pair is Blackwell-decreasing in ``s`` and in ``lam`` (docs/accounting.md), so blocks of ``s`` and
cells of ``lam`` are replaced by their smallest values: a dominating pair. Windows cut at a log-mass drop of
:data:`BLANKET_WINDOW_DROP`; the cut mass goes to the infinity mass (or, below the ``h`` window, up to the
lowest kept loss). Every step is pessimistic, so every delta(eps) of every composition is an upper bound.

**Memory.** The support (15 M points at n = 10,000) is never held: its rows (one per cell of ``(s, z)``, 61,000
at n = 10,000) are kept and its points generated from them in chunks of about ``_CHUNK``, again for each pass
(:mod:`shuffledp.accounting.loss_stream`): one pass gives the moments, the extent and the bins from which one
round's delta is exact at every bin edge; a second collects the points of the one bin that holds the answer; the
PLD spread adds the chunks onto its grid in order.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
from scipy import stats

from shuffledp.accounting import loss_stream as ls
from shuffledp.accounting.binomial import binom_logpmf, binom_window, tail_ge, tail_le
from shuffledp.accounting.core import RefusedError
from shuffledp.accounting.validation import check_delta, check_eps0, check_epsilon, check_n, check_real, check_rounds

__all__ = [
    "BLANKET_WINDOW_DROP", "BLANKET_S_BLOCK_RELATIVE_WIDTH", "BLANKET_LAMBDA_CELL",
    "BLANKET_Z_GROUP_RELATIVE_WIDTH", "BLANKET_EXACT_SUPPORT", "BLANKET_MAX_SUPPORT", "BLANKET_MAX_COARSENING",
    "blanket_mass", "blanket_loss_support", "blanket_loss_moments", "blanket_delta", "blanket_epsilon",
    "spread_blanket_pld", "composed_blanket_pld", "BLANKET_EPSILON_RTOL"
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
#: Largest number of support points of one round's loss distribution (a pass takes about 50 ns per point; memory
#: does not grow with it); beyond, blocks and cells are widened, at most BLANKET_MAX_COARSENING (a power of 2) times.
BLANKET_MAX_SUPPORT = 40_000_000
BLANKET_MAX_COARSENING = 16

#: Support points per generated chunk (at least one row of h).
_CHUNK = 1 << 16


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


def _checked(eps0: Any, n: Any, lo: Any) -> tuple[float, int, float | None]:
    """``(eps0, n, lo)`` validated; ``lo`` is None for the discrete Laplace's ``e^{-eps0/2}`` (given as None or as
    that float: one cache key and one set of closed forms), else a float with ``2/(e^eps0+1) <= lo < 1``."""
    eps0 = check_eps0(eps0)
    n = check_n(n)
    if lo is None:
        return eps0, n, None
    lo_min = 2.0 / (math.exp(eps0) + 1.0)
    allowed = (f"None (the discrete Laplace's e^(-eps0/2)) or a real number with 2/(e^eps0+1) = {lo_min!r} <= lo "
               "< 1 (the blanket mass of a box [lo, e^eps0 lo] of likelihood ratios; lo + hi >= 2)")
    value = check_real("lo", lo, allowed)
    if not lo_min <= value < 1.0:
        raise ValueError(f"lo must be {allowed}, got {value!r}")
    return eps0, n, None if value == math.exp(-0.5 * eps0) else value


def _params(eps0: float, lo: float | None) -> dict[str, float]:
    """The corner law's constants (module docstring), in log space where they can underflow."""
    if lo is None:  # the discrete Laplace box, lo = gamma = e^{-eps0/2}, by its closed forms
        log_g = -0.5 * eps0
        log_1pg = math.log1p(math.exp(log_g))
        log_1mg = math.log(-math.expm1(log_g))
        log_2pi = math.log(2.0) + 2.0 * log_g - log_1pg  # 2 pi = 2 gamma^2 / (1 + gamma): H or L among the n
        log_rho = log_g + log_1mg - log_1pg  # rho = gamma (1 - gamma) / (1 + gamma): Z among the n
    else:
        log_2pi = math.log(2.0) + math.log1p(-lo) - math.log(math.expm1(eps0))  # 2 pi = 2 (1 - lo) / (e - 1)
        excess = lo - 2.0 / (math.exp(eps0) + 1.0)  # rho = lo - 2 pi = (lo - 2/(e+1)) / kappa
        log_rho = math.log(excess) - math.log(math.tanh(0.5 * eps0)) if excess > 0.0 else -math.inf
    log_1m2pi = math.log(-math.expm1(log_2pi))
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
    if p["log_rho_c"] == -math.inf:  # lo = 2/(e^eps0+1): no Z corner, z = 0
        return np.zeros(1, dtype=np.int64), np.ones(1), 0.0
    e_half = p["half_ep1"]
    rho_c = math.exp(p["log_rho_c"])
    z = binom_window(n - s, p["log_rho_c"], p["log_1mrho_c"], BLANKET_WINDOW_DROP)
    norm = (n - s) * rho_c + s * e_half
    law = np.exp(binom_logpmf(z, n - s, p["log_rho_c"], p["log_1mrho_c"])) * (z + s * e_half) / norm
    cut = _tilted_tails(n - s, p["log_rho_c"], p["log_1mrho_c"], int(z[0]), int(z[-1]), s * e_half / norm, 1.0 / norm)
    return z, law, cut


def _rows(n: int, p: dict[str, float], exact_z: bool,
          scale: int = 1) -> tuple[list[tuple[int, np.ndarray, np.ndarray]], float]:
    """Blocks of s with their representative rows ``(s0, 1 - lam per row, weight per row)``, and the cut weight;
    ``scale`` multiplies the relative widths of the blocks of s and of the cells of lam.

    Pessimistic throughout (docs/accounting.md): a block of s uses its smallest s; the z-law of a group of
    blocks is the one at the group's largest s (stochastically the smallest z: fewer trials, flatter tilt), so
    weight only moves to smaller lam; a cell of z uses the largest 1 - lam of its (s, z) pairs.
    """
    e_half = p["half_ep1"]
    rho_c = math.exp(p["log_rho_c"])
    s_all = binom_window(n, p["log_2pi"], p["log_1m2pi"], BLANKET_WINDOW_DROP)
    s_lo, s_hi = int(s_all[0]), int(s_all[-1])
    # weight of s outside the window: E[z + s (e+1)/2 | s] / n = ((n - s) rho' + s (e+1)/2) / n
    infinity = _tilted_tails(n, p["log_2pi"], p["log_1m2pi"], s_lo, s_hi, rho_c, e_half - rho_c) / n
    w_s = np.exp(binom_logpmf(s_all, n, p["log_2pi"], p["log_1m2pi"])) * ((n - s_all) * rho_c + s_all * e_half) / n
    width = max(1, int(math.floor(BLANKET_S_BLOCK_RELATIVE_WIDTH * scale * max(1, s_hi))))
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
            cell = np.floor(np.log(r_of_z) / math.log1p(BLANKET_LAMBDA_CELL * scale)).astype(np.int64)
            starts = np.flatnonzero(np.r_[True, cell[1:] != cell[:-1]])
            blocks.append((s0, r_of_z[starts], weight * np.add.reduceat(law, starts)))
    return blocks, infinity


def _h_half(s0: int) -> int:
    """Half-width of the window of h ~ Bin(s0, 1/2) (about sqrt(2 drop) standard deviations, plus a margin)."""
    return int(math.ceil(math.sqrt(2.0 * BLANKET_WINDOW_DROP) * 0.5 * math.sqrt(max(s0, 1)) + 10))


def _h_window(s0: int) -> np.ndarray:
    half = _h_half(s0)
    return np.arange(max(0, s0 // 2 - half), min(s0, s0 // 2 + half) + 1, dtype=np.float64)


class _Block(NamedTuple):
    """One block of s: its smallest s, ``1 - lam`` and weight per row, and per row the P-mass of h below the
    window (None: a single zero loss of mass ``w.sum()``)."""

    s0: int
    r: np.ndarray
    w: np.ndarray
    below: np.ndarray | None


#: Row sets kept (24 bytes per row: 61,000 rows, 1.4 MiB, at n = 10,000; a few MiB at most).
_ROWS_KEPT = 8


@functools.lru_cache(maxsize=_ROWS_KEPT)
def _blocks(eps0: float, n: int, lo: float | None) -> tuple[tuple[_Block, ...], float]:
    """The blocks of rows of the support (block by block, rows of positive weight) and its infinity mass.

    Beyond :data:`BLANKET_MAX_SUPPORT` points, blocks and cells are widened by powers of 2 (pessimistic at any
    width) up to :data:`BLANKET_MAX_COARSENING`; RefusedError if the support still does not fit.
    """
    p = _params(eps0, lo)
    rows, infinity = _rows(n, p, exact_z=True)
    total = sum(r.size * (2 * _h_half(s0) + 1) for s0, r, _ in rows)
    scale = 1
    while total > BLANKET_EXACT_SUPPORT and (scale == 1 or total > BLANKET_MAX_SUPPORT):
        if scale > BLANKET_MAX_COARSENING:
            raise RefusedError(
                f"blanket pair at n={n}, eps0={eps0} needs {total} support points even with blocks and cells "
                f"{BLANKET_MAX_COARSENING}x their widths, more than BLANKET_MAX_SUPPORT={BLANKET_MAX_SUPPORT}; no "
                "bound is reported")
        rows, infinity = _rows(n, p, exact_z=False, scale=scale)
        total = sum(r.size * (2 * _h_half(s0) + 1) for s0, r, _ in rows)
        scale *= 2
    pe = 1.0 - 0.5 * p["one_m_kappa"]  # e/(e+1): the attacked client's corner is H with this probability, given S
    blocks = []
    for s0, r_rows, w_rows in rows:
        keep = w_rows > 0.0
        r_rows, w_rows = r_rows[keep], w_rows[keep]
        if s0 == 0 or r_rows.size == 0:
            blocks.append(_Block(0, r_rows, w_rows, None))
            continue
        h = _h_window(s0)
        # P-mass of h outside the window: P = lam Bin(s, 1/2) + (1 - lam) (Bern(e/(e+1)) + Bin(s - 1, 1/2))
        h_lo, h_hi = float(h[0]), float(h[-1])
        lam = 1.0 - r_rows
        above = lam * float(tail_ge(h_hi + 1.0, s0)) + r_rows * (
            pe * float(tail_ge(h_hi, s0 - 1)) + (1.0 - pe) * float(tail_ge(h_hi + 1.0, s0 - 1)))
        below = lam * float(tail_le(h_lo - 1.0, s0)) + r_rows * (
            pe * float(tail_le(h_lo - 2.0, s0 - 1)) + (1.0 - pe) * float(tail_le(h_lo - 1.0, s0 - 1)))
        infinity += float(np.dot(above, w_rows))  # above the window: to infinity
        blocks.append(_Block(s0, r_rows, w_rows, below))
    return tuple(blocks), float(min(infinity, 1.0))


def _chunks(eps0: float, n: int, lo: float | None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The support's ``(losses, P-masses)`` in chunks of about :data:`_CHUNK` points (one row of h at least), block
    by block and row by row; points of zero mass are left out.

    Raises:
        ArithmeticError: a loss or a mass is not finite (a numerical failure).
    """
    p = _params(eps0, lo)
    kappa, one_m_kappa = p["kappa"], p["one_m_kappa"]
    log_half = -math.log(2.0)
    for s0, r_rows, w_rows, below in _blocks(eps0, n, lo)[0]:
        if below is None:
            mass = float(w_rows.sum())
            if mass > 0.0:
                yield np.zeros(1), np.array([mass])
            continue
        h = _h_window(s0)
        bin_h = np.exp(binom_logpmf(h, s0, log_half, log_half))[None, :]
        x = (2.0 * h - s0) / s0  # in [-1, 1]
        ax, sign, upper = np.abs(x)[None, :], np.sign(x)[None, :], x[None, :] >= 0.0
        step = max(1, _CHUNK // h.size)
        for i in range(0, r_rows.size, step):
            r, w = r_rows[i : i + step, None], w_rows[i : i + step]
            c0 = (1.0 - r) + r * one_m_kappa  # 1 - (1 - lam) kappa, without cancellation
            big = 1.0 + r * kappa * ax  # 1 + |v|
            small = (1.0 - ax) + ax * c0  # 1 - |v|
            loss = (sign * (np.log(big) - np.log(small))).ravel()
            probs = bin_h * np.where(upper, big, small) * w[:, None]
            probs[:, 0] += below[i : i + step] * w  # the mass below the window, moved up to the lowest kept loss
            probs = probs.ravel()
            if not (np.all(np.isfinite(loss)) and np.all(np.isfinite(probs))):
                raise ArithmeticError(f"blanket-laplace at n={n}, eps0={eps0}: a support point is not finite")
            keep = probs > 0.0
            yield (loss, probs) if keep.all() else (loss[keep], probs[keep])


def blanket_loss_support(eps0: float, n: int, *, lo: float | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """Exact losses and P-masses of the dominating blanket pair (pessimistic blocks and windows), unsorted.

    The whole support at once (about 16 bytes per point, 15 M points at n = 10,000): for tests and small n. The
    accountant's paths never build it.

    Args:
        eps0: local privacy parameter of the randomizer, > 0.
        n: number of shuffled reports, >= 1.
        lo: the box's lower end, ``2/(e^eps0+1) <= lo < 1``; None: the discrete Laplace's ``e^{-eps0/2}``.

    Returns:
        ``(losses, probs, infinity_mass)``, points of positive mass; ``probs`` plus ``infinity_mass`` sum to 1 up
        to round-off.

    Raises:
        RefusedError: the support would exceed :data:`BLANKET_MAX_SUPPORT` points.
    """
    eps0, n, lo = _checked(eps0, n, lo)
    parts = list(_chunks(eps0, n, lo))
    losses = np.concatenate([c[0] for c in parts]) if parts else np.zeros(0)
    probs = np.concatenate([c[1] for c in parts]) if parts else np.zeros(0)
    return losses, probs, _blocks(eps0, n, lo)[1]


# ---------------------------------------------------------------------------------------------------------
# One pass (moments, extent, bins); one round exact on the support; several rounds (pessimistic PLD composition)
# ---------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)  # about 1.5 MiB each (the bins)
def _scan(eps0: float, n: int, lo: float | None) -> ls.Scan:
    """One pass over the support (:func:`shuffledp.accounting.loss_stream.scan`; every loss is at most eps0)."""
    return ls.scan(_chunks(eps0, n, lo), eps0)


@functools.lru_cache(maxsize=64)
def _summary(eps0: float, n: int, lo: float | None) -> tuple[tuple[float, float], tuple[float, float], float]:
    """``(moments, extent, infinity)`` of :func:`_scan`, kept longer than its bins."""
    scan = _scan(eps0, n, lo)
    return scan.moments, scan.extent, _blocks(eps0, n, lo)[1]


def blanket_loss_moments(eps0: float, n: int, *, lo: float | None = None) -> tuple[float, float]:
    """Mean and standard deviation of one round's loss under P (the finite part; sizes the composition grid).

    Args:
        eps0: local privacy parameter, > 0.
        n: number of shuffled reports, >= 1.
        lo: the box's lower end (see :func:`blanket_loss_support`); None: the discrete Laplace's.

    Returns:
        ``(mean, standard deviation)``.
    """
    return _summary(*_checked(eps0, n, lo))[0]


def _streamed(eps0: float, n: int, lo: float | None) -> ls.Streamed:
    scan = _scan(eps0, n, lo)
    return ls.Streamed(functools.partial(_chunks, eps0, n, lo), _blocks(eps0, n, lo)[1], scan.bins, scan.extent[1])


def blanket_delta(eps0: float, n: int, epsilon: float, *, lo: float | None = None) -> float:
    """One round's delta(epsilon) of the dominating blanket pair: ``inf + sum_{L > eps} P (1 - e^{eps - L})``.

    Every term is non-negative (``-expm1(eps - L)``; over a whole bin two non-negative terms,
    :mod:`shuffledp.accounting.loss_stream`), summed directly (no difference of tails). Two passes over the support
    (the first one cached).

    Args:
        eps0: local privacy parameter of the randomizer, > 0.
        n: number of shuffled reports, >= 1.
        epsilon: finite, >= 0.
        lo: the box's lower end (see :func:`blanket_loss_support`); None: the discrete Laplace's.

    Returns:
        The delta, an upper bound for the shuffled randomizer.
    """
    eps0, n, lo = _checked(eps0, n, lo)
    return ls.delta(_streamed(eps0, n, lo), check_epsilon(epsilon))


def blanket_epsilon(eps0: float, n: int, delta: float, *, lo: float | None = None) -> float:
    """One round's smallest epsilon (to :data:`BLANKET_EPSILON_RTOL`, rounded up) with delta(eps) <= delta.

    The exact delta at the edges of the bins locates the bin of the answer; bisection on the direct non-negative
    sum over that bin's points and the bins above, then the value is checked and stepped up by at most
    :data:`BLANKET_EPSILON_RTOL` relative until it passes (:func:`shuffledp.accounting.loss_stream.epsilon`). Two
    passes over the support (the first one cached).

    Args:
        eps0: local privacy parameter, > 0.
        n: number of shuffled reports, >= 1.
        delta: 0 < delta < 1.
        lo: the box's lower end (see :func:`blanket_loss_support`); None: the discrete Laplace's.

    Returns:
        The epsilon (``math.inf`` when the infinity mass alone exceeds delta).

    Raises:
        ArithmeticError: the checked delta stays above ``delta`` after the step-up (a numerical failure).
    """
    eps0, n, lo = _checked(eps0, n, lo)
    target = check_delta(delta)
    try:
        return ls.epsilon(_streamed(eps0, n, lo), target, BLANKET_EPSILON_RTOL)
    except ArithmeticError as exc:
        raise ArithmeticError(f"blanket-laplace at n={n}, eps0={eps0}: {exc}") from exc


def spread_blanket_pld(eps0: float, n: int, h: float, *, lo: float | None = None) -> Any:
    """One round's PLD on the grid ``h`` by the pessimistic mean-preserving spread (Doroshenko, Ghazi, Kamath,
    Kumar, Manurangsi, "Connect the dots", PETS 2022; :func:`shuffledp.accounting.pld_spread.spread_onto_grid`).

    Args:
        eps0: local privacy parameter, > 0.
        n: number of shuffled reports, >= 1.
        h: the grid interval, > 0.
        lo: the box's lower end (see :func:`blanket_loss_support`); None: the discrete Laplace's.

    Returns:
        A symmetric ``PrivacyLossDistribution`` (the pair is symmetric: swapping the inputs maps h to s - h).
    """
    eps0, n, lo = _checked(eps0, n, lo)
    h = check_real("h", h, "a finite real number > 0")
    if not (math.isfinite(h) and h > 0.0):
        raise ValueError(f"h must be a finite real number > 0, got {h!r}")
    return _spread_pld(eps0, n, h, lo)


@functools.lru_cache(maxsize=32)
def _spread_pld(eps0: float, n: int, h: float, lo: float | None) -> Any:
    from shuffledp.accounting import pld_spread as ps

    return ps.to_pld(_spread_dense(eps0, n, h, lo), h, pessimistic=True)


def _spread_dense(eps0: float, n: int, h: float, lo: float | None) -> tuple[int, np.ndarray, float]:
    """The spread onto the grid ``h`` as ``(lower, probs, infinity_mass)``, chunk by chunk (one pass)."""
    _, extent, infinity = _summary(eps0, n, lo)
    return ls.spread(_chunks(eps0, n, lo), infinity, h, extent)


def composed_blanket_pld(items: list[tuple[Any, ...]]) -> tuple[Any, float]:
    """Groups ``(n, eps0, count)`` or ``(n, eps0, count, lo)`` of rounds composed on one grid (FFT powers,
    :func:`..pld.compose`); ``lo`` absent or None: the discrete Laplace's box.

    The grid interval is chosen as for the clone pairs (:func:`shuffledp.accounting.clone_spread.spread_interval`,
    which refuses a grid too coarse for its error target).

    Args:
        items: ``(n, eps0, count)`` or ``(n, eps0, count, lo)`` per group.

    Returns:
        ``(composed PLD, interval)``.
    """
    from shuffledp.accounting import pld as _pld
    from shuffledp.accounting.clone_spread import spread_interval

    groups = []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) not in (3, 4):
            raise TypeError(f"each item must be a tuple (n, eps0, count) or (n, eps0, count, lo), got {item!r}")
        eps0, n, lo = _checked(item[1], item[0], item[3] if len(item) == 4 else None)
        groups.append((eps0, n, lo, check_rounds(item[2], "count")))
    moments = [(*_summary(eps0, n, lo)[0], count) for eps0, n, lo, count in groups]
    total = sum(count for *_, count in groups)
    h = spread_interval(moments, f"blanket-laplace, {total} rounds in {len(groups)} group(s)")
    plds = [(_spread_pld(eps0, n, h, lo), count) for eps0, n, lo, count in groups]
    return _pld.compose(plds), h
