"""Privacy loss distributions built and queried for the bound families (the PLD side of the registry).

Here live the pieces that several families share when they compose rounds through a privacy loss distribution
(PLD; Koskela, Jalko, Honkela, AISTATS 2020; Google ``dp_accounting``): the checked epsilon query
(:func:`pld_epsilon`), the PLDs of shuffled binary randomized response (``rr-lower``) and of randomized
response as the worst case of (eps, delta)-DP (Kairouz, Oh, Viswanath, "The composition theorem for differential
privacy", ICML 2015; ``no-shuffle`` and ``fmt``), and the choice of grid intervals when groups of different
``(n, eps0)`` are composed. The families themselves are in :mod:`shuffledp.accounting.families`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from shuffledp.accounting import clones
from shuffledp.accounting import literature as lit

__all__ = [
    "PLD_STEP_UP_RTOL",
    "PLD_STEP_UP_MAX_STEPS",
    "HETEROGENEOUS_INTERVAL",
    "pld_epsilon",
    "rr_lower_pld",
    "rr_interval",
    "rr_interval_floor",
    "rr_pair_pld",
    "pair_interval",
    "clone_interval",
]

#: Largest relative increase of a PLD's epsilon allowed while stepping it up until its delta is within target.
PLD_STEP_UP_RTOL = 1e-9
#: Most step-up attempts (each one pass over the grid); the step doubles from one ulp each time.
PLD_STEP_UP_MAX_STEPS = 64
#: Coarsest discretisation interval of the two-point PLDs (no-shuffle, fmt) composed across heterogeneous
#: groups; :func:`pair_interval` goes finer when the per-round epsilons are small. Clone PLDs use
#: :func:`clone_interval`.
HETEROGENEOUS_INTERVAL = 1e-4


def _pld() -> Any:
    """The PLD engine, looked up at each call (so a test can stand in for it)."""
    from shuffledp.accounting import pld

    return pld


def pld_epsilon(composed: Any, delta: float, *, lower: bool = False) -> float:
    """``epsilon_for_delta`` of a composed PLD, re-checked with ``delta_for_epsilon`` before it is used.

    The returned eps always satisfies ``delta_for_epsilon(composed, eps) <= delta`` exactly (no tolerance in
    the unsafe direction). When the closed-form query lands a hair below the true crossing (composed losses
    of ~1e4 make ``U - e^eps W`` cancel), eps is stepped UP, from one ulp and doubling, at most
    ``PLD_STEP_UP_MAX_STEPS`` times and by at most ``PLD_STEP_UP_RTOL`` relative in total; a larger gap is
    a numerical failure and raises ArithmeticError. An infinite epsilon is returned only when more than
    ``delta`` of the mass sits at infinite loss.

    ``lower=True`` (an OPTIMISTIC PLD whose epsilon is reported as a lower bound): no stepping up, which would
    move the value in the unsafe direction for a lower bound. If ``delta(eps) > delta`` the eps lies below the
    PLD's own crossing, which is itself at most the true epsilon, so it is returned as it is.

    Args:
        composed: a (composed) privacy loss distribution.
        delta: the target delta, 0 < delta < 1.
        lower: the PLD is optimistic and its epsilon is reported as a lower bound.

    Returns:
        The epsilon (``math.inf`` when more than ``delta`` of the mass has infinite loss).
    """
    pld = _pld()
    value = float(pld.epsilon_for_delta(composed, delta))
    if not math.isfinite(value):
        infinite_mass = float(pld.delta_for_epsilon(composed, math.inf))
        if infinite_mass > delta:
            return math.inf  # legitimately no finite epsilon: more than delta of the mass has infinite loss
        raise ArithmeticError(
            f"PLD epsilon query returned {value} at delta={delta} although only {infinite_mass!r} of the mass "
            "has infinite loss: numerical failure of the PLD query; refusing to report it"
        )
    if lower:
        return value
    return step_up_until_checked(value, delta, lambda eps: float(pld.delta_for_epsilon(composed, eps)))


def step_up_until_checked(value: float, delta: float, delta_at: Callable[[float], float]) -> float:
    """The smallest of ``value``, ``value + ulp``, ``value + 3 ulp``, ... (doubling steps, at most
    :data:`PLD_STEP_UP_RTOL` relative above ``value``) whose ``delta_at`` is at most ``delta``: the re-check that
    makes a PLD epsilon an upper bound when the closed-form answer misses by rounding.

    Args:
        value: the epsilon the PLD query returned (finite).
        delta: the target delta.
        delta_at: the same PLD's delta at a given epsilon.

    Returns:
        The checked epsilon.

    Raises:
        ArithmeticError: no epsilon within the step-up limit passes the check (numerical failure: refused).
    """
    first = value
    check = delta_at(value)
    limit = first + PLD_STEP_UP_RTOL * max(abs(first), 1.0)
    step = math.ulp(max(value, 1.0))
    for _ in range(PLD_STEP_UP_MAX_STEPS):
        if check <= delta:
            return value
        if value + step > limit:
            break
        value = value + step
        step *= 2.0
        check = delta_at(value)
    if check <= delta:
        return value
    raise ArithmeticError(
        f"PLD epsilon query returned eps={first!r} with delta(eps)={delta_at(first)!r} > delta={delta!r}, and "
        f"stepping eps up by up to {PLD_STEP_UP_RTOL:g} relative (to {value!r}) still gives delta={check!r}: "
        "numerical failure of the PLD query; refusing to report it"
    )


def rr_lower_pld(eps0: float, n: int, rounds_hint: int, interval: float | None = None) -> Any:
    """Optimistic PLD of shuffled binary randomized response (others 0), both directions.

    A lower bound after composition (optimistic discretisation only lowers every hockey-stick divergence).

    Args:
        eps0: the randomizer's epsilon.
        n: reports per round.
        rounds_hint: how many times it will be composed (sets the default interval, :func:`rr_interval`).
        interval: the grid interval, or None for :func:`rr_interval`.

    Returns:
        The PLD.
    """
    rr = lit.rr_shuffle_loss(eps0, n)
    p0 = np.exp(rr.log_p0)
    p1 = np.exp(rr.log_p0 + rr.loss)
    if interval is None:
        interval = rr_interval(eps0, n, rounds_hint)
    return _pld().pld_from_losses(
        rr.loss,
        p1,
        infinity_mass=0.0,
        pessimistic=False,
        value_discretization_interval=interval,
        losses_reverse=-rr.loss,
        probs_reverse=p0,
    )


def rr_interval(eps0: float, n: int, rounds: int) -> float:
    """Discretisation interval for the optimistic rr-lower PLD.

    Small against the composed loss's spread, but no finer than :func:`rr_interval_floor` (the composed grid
    must fit ``MAX_COMPOSED_GRID`` points). The loss has standard deviation about mu = sqrt(chi^2/n); the
    composed eps grows like sqrt(T) mu, and optimistic rounding lowers the composed loss by at most
    T * interval, so interval = mu / (200 sqrt(T)) keeps that shift near 1/200 of sqrt(T) mu (clamped to
    [1e-7, 1e-2]). A coarser interval only lowers the value further, so it stays a lower bound.

    Args:
        eps0: the randomizer's epsilon.
        n: reports per round.
        rounds: the number of compositions.

    Returns:
        The interval.
    """
    target = min(1e-2, max(1e-7, _rr_mu(eps0, n) / (200.0 * math.sqrt(rounds))))
    floor = rr_interval_floor(eps0, n, rounds)
    return clones.round_interval(floor, up=True) if floor > target else float(target)


def _rr_mu(eps0: float, n: int) -> float:
    return 2.0 * math.sinh(min(eps0, 700.0) / 2.0) / math.sqrt(n)


def rr_interval_floor(eps0: float, n: int, rounds: int) -> float:
    """The composed Chernoff window over ``MAX_COMPOSED_GRID``, as for clones.

    As in :func:`shuffledp.accounting.clones.suggested_interval`: ``T m1 + 18 sqrt(T) s1`` plus the loss span
    ``2 eps0``, with the per-round mean ``m1 <= min(mu^2, eps0)`` and standard deviation ``s1 <= min(mu, eps0)``
    (the loss lies in [-eps0, eps0]). Without it, T = 20,000 rounds at n = 1e4, eps0 = 1 asked for 67 million
    grid points and raised, which stopped a run whose comparison families include rr-lower (the server's
    default).

    Args:
        eps0: the randomizer's epsilon.
        n: reports per round.
        rounds: the number of compositions.

    Returns:
        The smallest interval allowed.
    """
    mu = _rr_mu(eps0, n)
    t = float(rounds)
    width = t * min(mu * mu, eps0) + 18.0 * math.sqrt(t) * min(mu, eps0) + 2.0 * eps0
    return width / clones.MAX_COMPOSED_GRID


def rr_pair_pld(eps_pure: float, delta_inf: float, interval: float) -> Any:
    """Pessimistic PLD of randomized response with ``eps_pure`` plus ``delta_inf`` at infinite loss.

    Randomized response is the worst case of (eps, delta)-DP (Kairouz, Oh, Viswanath, ICML 2015, Theorem 3.3).

    Args:
        eps_pure: the epsilon of the pair.
        delta_inf: the mass put at infinite loss (the delta of the pair).
        interval: the grid interval.

    Returns:
        The PLD.
    """
    e = float(eps_pure)
    probs = np.array([(1.0 - delta_inf) / (1.0 + math.exp(-e)), (1.0 - delta_inf) / (1.0 + math.exp(e))])
    losses = np.array([e, -e])
    return _pld().pld_from_losses(
        losses, probs, infinity_mass=delta_inf, pessimistic=True, value_discretization_interval=interval
    )


def pair_interval(pairs: list[tuple[float, int]]) -> float:
    """Grid interval for composing randomized-response PLDs (losses +-eps_g, ``count_g`` rounds each).

    Rounding each loss up by less than ``h`` raises the composed epsilon by less than ``T h``. With ``m`` the
    summed mean (KL) and ``v`` the summed variance of the per-round losses (for loss +-eps: mean
    ``eps tanh(eps/2)``, variance ``eps^2 - mean^2``), the composed epsilon is at least ``m + 2 sqrt(v)`` for
    delta <= 0.02 (as in :func:`shuffledp.accounting.clones.suggested_interval`), so
    ``h = INTERVAL_RELATIVE_ERROR (m + 2 sqrt(v)) / T`` keeps the discretisation error below 0.4% relative.
    ``h`` is at most :data:`HETEROGENEOUS_INTERVAL` (finer costs little for the usual eps0 ~ 1) and at least the
    composed Chernoff window ``m + 18 sqrt(v)`` (plus the widest loss span) over ``MAX_COMPOSED_GRID``. A fixed
    1e-4 made the heterogeneous no-shuffle value 96 times the exact one at eps0 = 1e-5 over 2,000 rounds.

    Args:
        pairs: ``(eps_g, count_g)`` per group.

    Returns:
        The interval.
    """
    mean = 0.0
    var = 0.0
    total = 0
    span = 0.0
    for eps, count in pairs:
        m1 = eps * math.tanh(0.5 * eps)
        mean += count * m1
        var += count * max(eps * eps - m1 * m1, 0.0)
        total += count
        span = max(span, 2.0 * eps)
    target = clones.INTERVAL_RELATIVE_ERROR * (mean + 2.0 * math.sqrt(var)) / total
    floor = (mean + 18.0 * math.sqrt(var) + span) / clones.MAX_COMPOSED_GRID
    if not (target > 0.0 and math.isfinite(target) and floor > 0.0 and math.isfinite(floor)):
        raise ArithmeticError(f"cannot choose a grid interval for per-round epsilons {pairs!r}")
    if floor > min(HETEROGENEOUS_INTERVAL, target):
        return clones.round_interval(floor, up=True)
    return clones.round_interval(min(HETEROGENEOUS_INTERVAL, target), up=False)


def clone_interval(items: list[tuple[int, float, int]], total: int, variant: str) -> float:
    """Grid interval for composing clone PLDs of different (n, eps0) groups.

    The finest of the groups' :func:`shuffledp.accounting.clones.suggested_interval` (each keeps its own
    discretisation error below ``INTERVAL_RELATIVE_ERROR``), but no finer than the composed Chernoff window,
    ``sum_g T_g m1_g + 18 sqrt(sum_g T_g s1_g^2)`` as in ``suggested_interval``, divided by
    ``MAX_COMPOSED_GRID``, and than each group's loss span (at most ``2 eps0``) divided by the same. Without the
    floor, a round with large n (losses near 1e-6) next to one with small n (losses up to eps0) asked for
    hundreds of millions of grid points and raised. A coarser interval keeps the pessimistic discretisation an
    upper bound; its error is at most one interval per round, small against the composed width.

    Args:
        items: ``(n, eps0, count)`` per group.
        total: the number of rounds, ``sum(count)``.
        variant: the clone pair (``"stronger"`` or ``"focs"``).

    Returns:
        The interval.
    """
    finest = min(clones.suggested_interval(eps0, n, total, variant) for n, eps0, _ in items)
    mean = 0.0
    var = 0.0
    span = 0.0
    for n, eps0, count in items:
        m1, s1 = clones.clone_loss_moments(eps0, n, variant)
        mean += count * m1
        var += count * s1 * s1
        span = max(span, 2.0 * eps0)
    floor = max(mean + 18.0 * math.sqrt(var), span) / clones.MAX_COMPOSED_GRID
    if floor <= finest:
        return finest
    return clones.round_interval(floor, up=True)
