"""Renyi differential privacy: summation over rounds and conversion to (eps, delta).

Composition (Mironov 2017, Prop. 1): RDP curves of adaptively composed mechanisms add order by order.

Conversion (Balle, Barthe, Gaboardi, Hsu, Sato 2020, Thm 21; Canonne, Kamath, Steinke 2020, Prop. 12): a
mechanism that is ``(a, rho)``-RDP with ``a > 1`` is ``(eps, delta)``-DP for

    ``eps = rho + log((a-1)/a) - (log delta + log a) / (a - 1)``,
    ``delta = exp((a-1)(rho - eps)) (1 - 1/a)^(a-1) / a``,

and one takes the best order over a grid. The grid is fixed (so a value minimised over it inherits the
monotonicity of the RDP curve in n, eps0 and rounds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "DEFAULT_ORDERS",
    "INTEGER_ORDERS",
    "compose_rdp",
    "epsilon_from_rdp",
    "delta_from_rdp",
    "rdp_curve",
]


def _make_orders() -> tuple[np.ndarray, np.ndarray]:
    # orders below 1.01 are left out: the conversion is numerically delicate there and never the best order
    # for the deltas of interest (same choice as dp_accounting's RDP accountant).
    fractional = np.concatenate([1.0 + np.geomspace(1e-2, 0.9, 20), np.arange(2.0, 8.0, 0.25)])
    integers = np.concatenate([np.arange(2, 257), np.unique(np.round(np.geomspace(257, 1e7, 160)))]).astype(np.float64)
    return np.unique(np.concatenate([fractional, integers])), integers


#: The orders every conversion minimises over: 1.01 to 2 geometric, quarters to 8, every integer up to 256,
#: then geometric to 1e7 (INTEGER_ORDERS: the integer ones, for bounds stated for integer orders only).
DEFAULT_ORDERS, INTEGER_ORDERS = _make_orders()


def compose_rdp(curves: Sequence[tuple[np.ndarray, int]]) -> np.ndarray:
    """Sum of ``count * rdp`` over ``(rdp_on_orders, count)`` pairs (Mironov 2017, Prop. 1).

    All curves must be evaluated on the same orders.

    Args:
        curves: ``(one-round RDP curve, count)`` pairs on the same orders.

    Returns:
        The composed curve, ``sum count * curve``.
    """
    if not curves:
        raise ValueError("compose_rdp needs at least one (rdp, count) pair")
    total = np.zeros_like(np.asarray(curves[0][0], dtype=np.float64))
    for rdp, count in curves:
        arr = np.asarray(rdp, dtype=np.float64)
        if arr.shape != total.shape:
            raise ValueError(f"RDP curves must share their orders: shapes {arr.shape} and {total.shape}")
        total = total + count * arr
    return total


def _validated(orders: np.ndarray, rdp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(orders, dtype=np.float64)
    r = np.asarray(rdp, dtype=np.float64)
    if a.shape != r.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"orders and rdp must be 1-d arrays of the same non-zero length, got {a.shape}, {r.shape}")
    if np.any(~(a > 1.0)):
        raise ValueError("every Renyi order must be > 1")
    if np.any(np.isnan(r)) or np.any(r < 0.0):
        raise ValueError("RDP values must be >= 0 and not NaN")
    return a, r


def epsilon_from_rdp(orders: np.ndarray, rdp: np.ndarray, delta: float) -> tuple[float, float]:
    """``(eps, best_order)``: the improved RDP -> (eps, delta) conversion minimised over ``orders``.

    Balle et al. 2020, Thm 21 / Canonne-Kamath-Steinke 2020, Prop. 12:
    ``eps = rho + log1p(-1/a) - (log delta + log a) / (a - 1)``, clipped at 0.

    Args:
        orders: the Renyi orders of the curve.
        rdp: the RDP values at ``orders``.
        delta: target delta, 0 < delta < 1.

    Returns:
        ``(epsilon, the order that attains it)``.
    """
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    a, r = _validated(orders, rdp)
    eps = r + np.log1p(-1.0 / a) - (np.log(delta) + np.log(a)) / (a - 1.0)
    eps = np.where(np.isfinite(r), eps, np.inf)
    i = int(np.argmin(eps))
    return max(float(eps[i]), 0.0), float(a[i])


def delta_from_rdp(orders: np.ndarray, rdp: np.ndarray, epsilon: float) -> tuple[float, float]:
    """``(delta, best_order)``: the same conversion solved for delta, minimised over ``orders``, capped at 1.

    ``log delta = (a-1)(rho - eps) + (a-1) log1p(-1/a) - log a`` (Canonne-Kamath-Steinke 2020, Prop. 12).

    Args:
        orders: the Renyi orders of the curve.
        rdp: the RDP values at ``orders``.
        epsilon: epsilon >= 0.

    Returns:
        ``(delta, the order that attains it)``.
    """
    if not epsilon >= 0.0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    a, r = _validated(orders, rdp)
    log_delta = (a - 1.0) * (r - epsilon) + (a - 1.0) * np.log1p(-1.0 / a) - np.log(a)
    log_delta = np.where(np.isfinite(r), log_delta, np.inf)
    i = int(np.argmin(log_delta))
    return float(min(1.0, np.exp(min(log_delta[i], 0.0)))), float(a[i])


def rdp_curve(function: Callable[[float], float], orders: np.ndarray) -> np.ndarray:
    """Evaluate a one-order RDP function on every order of ``orders``.

    Args:
        function: one-round RDP as a function of the order.
        orders: the Renyi orders of the curve.

    Returns:
        The curve, one value per order.
    """
    return np.array([function(float(a)) for a in orders], dtype=np.float64)
