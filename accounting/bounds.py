"""The bound-family dispatcher: epsilon, delta, Renyi divergence, calibration and heterogeneous rounds.

Families (kind in brackets; see :data:`accounting.FAMILY_KINDS`):

* ``clones`` [upper]: the stronger clone pair, C ~ Bin(n-1, 2/(e^{eps0}+1)), w = 1/(e^{eps0}+1)
  (Feldman-McMillan-Talwar SODA'23; Wang et al. NeurIPS'23, seed 003). One round: the exact delta(eps)/eps(delta)
  of the pair (:mod:`shuffledp.accounting.clones`). Several rounds: composition of its pessimistic privacy loss
  distribution (PLD) (:mod:`shuffledp.accounting.pld`).
* ``clones-focs`` [upper]: the FOCS'21 pair, C ~ Bin(n-1, e^{-eps0}), Delta ~ Bern(e^{eps0}/(e^{eps0}+1)); same
  machinery (seed 000, Thm 1 / Cor. 1).
* ``ccg-gdp`` [approximate]: seed 000, Thm 2, mu = 2 e^{eps0/2}/sqrt(n-1); T rounds: sqrt(sum mu^2).
* ``ccg-rdp`` [approximate]: seed 000, Cor. 2, (lambda, 2 e^{eps0} lambda/(n-1))-RDP, summed over rounds,
  converted with the improved conversion (:mod:`shuffledp.accounting.rdp`).
* ``girgis`` [upper], ``girgis-lower`` [lower, Renyi only]: Girgis et al. CCS'21 as in seed 000 eqs. (5), (6).
* ``fmt`` [upper]: FMT'21 Thm 3.1, only inside eps0 <= log(n/(16 log(2/delta))). Several rounds: each round is
  (eps_1, delta_1)-DP at delta_1 = f delta / T, composed exactly by Kairouz-Oh-Viswanath (Thm 3.3), best f of
  a fixed grid.
* ``rr-lower`` [lower]: exact loss of shuffled binary randomized response, others holding 0. Several rounds:
  PLD composition with OPTIMISTIC discretisation, so the value stays a lower bound.
* ``canonical-gdp`` [approximate]: Shvets (seed 002) mu_n = sqrt(chi^2(W_1||W_0)/n) for binary randomized
  response with eps0; T rounds: sqrt(T) mu_n.
* ``no-shuffle`` [upper]: each report eps0-DP seen by the server, T rounds composed optimally (KOV).

Capping: the shuffled output is a post-processing of the n eps0-LDP reports, so the ``no-shuffle`` value is a
valid upper bound too. Every non-lower family's epsilon/delta is the minimum of its own value and the
``no-shuffle`` value; when the cap applies, ``details["capped_by_no_shuffle"]`` is True and
``details["uncapped"]`` holds the family's own number. Renyi values are the families' formulas, uncapped.

Refusals (:class:`accounting.RefusedError`): ``fmt`` outside its validity region; ``ccg-gdp``, ``ccg-rdp`` and
``canonical-gdp`` when n/(e^{eps0}+1) < 2 ln(1/delta) (few expected clones: the CLT values were measured below
the exact value there) unless ``allow_approximate=True``; families without an RDP curve in :func:`renyi`;
``girgis-lower`` outside :func:`renyi`.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from scipy import optimize

from shuffledp.accounting import EPS0_MAX, FAMILIES, FAMILY_KINDS, N_MAX, Bound, RefusedError
from shuffledp.accounting import literature as lit
from shuffledp.accounting import rdp as rdp_mod

if TYPE_CHECKING:  # pragma: no cover - typing only
    from shuffledp.accounting.events import ShuffleRound

__all__ = [
    "Bound",
    "RefusedError",
    "FAMILIES",
    "RENYI_FAMILIES",
    "CALIBRATION_RANGE",
    "CALIBRATION_RTOL",
    "FMT_DELTA_FRACTIONS",
    "PLD_STEP_UP_RTOL",
    "EPS0_MAX",
    "HETEROGENEOUS_INTERVAL",
    "epsilon",
    "delta",
    "renyi",
    "calibrate",
    "epsilon_for_rounds",
    "epsilon_bracket",
    "EpsilonBracket",
]

#: Families with a Renyi-divergence curve (:func:`renyi`).
RENYI_FAMILIES: tuple[str, ...] = ("clones", "clones-focs", "ccg-rdp", "girgis", "girgis-lower", "rr-lower")

#: The eps0 range :func:`calibrate` searches.
CALIBRATION_RANGE: tuple[float, float] = (1e-3, 20.0)
#: Relative tolerance of the calibrated eps0: the answer ``lo`` is certified and ``hi <= lo (1 + rtol)`` is not.
CALIBRATION_RTOL = 1e-6
#: Fractions f of delta spent on the per-round delta_1 = f delta / T when composing FMT over T > 1 rounds.
FMT_DELTA_FRACTIONS: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 0.9)
#: Relative tolerance of delta when a delta is found by bisection on epsilon (the ``fmt`` family).
DELTA_SEARCH_RTOL = 1e-9
#: Smallest delta the bisection of :func:`delta` explores for the ``fmt`` family.
DELTA_SEARCH_FLOOR = 1e-300

_ALL_FAMILIES = tuple(FAMILY_KINDS)
_VARIANT = {"clones": "stronger", "clones-focs": "focs"}


# ---------------------------------------------------------------------------------------------------------
# Validation at the boundary
# ---------------------------------------------------------------------------------------------------------


def _check_family(family: Any, *, allow_girgis_lower: bool) -> str:
    allowed = _ALL_FAMILIES if allow_girgis_lower else FAMILIES
    if not isinstance(family, str) or family not in _ALL_FAMILIES:
        raise ValueError(f"family must be one of {list(allowed)}, got {family!r}")
    if family not in allowed:
        raise RefusedError(
            f"{family} bounds a Renyi divergence from below; no (eps, delta) lower bound follows from it by the "
            f"RDP conversion. Use it with renyi(), or use rr-lower for an (eps, delta) lower bound."
        )
    return family


def _check_n(n: Any) -> int:
    if isinstance(n, bool):
        raise TypeError(f"n (number of shuffled reports) must be an integer >= 1, got {n!r}")
    if isinstance(n, float) and n.is_integer():
        n = int(n)
    try:
        value = operator.index(n)
    except TypeError:
        raise TypeError(
            f"n (number of shuffled reports) must be an integer >= 1, got {type(n).__name__} {n!r}"
        ) from None
    if not 1 <= value <= N_MAX:
        raise ValueError(f"n (number of shuffled reports) must be an integer in [1, {N_MAX:.0e}], got {value}")
    return int(value)


def _check_real(name: str, value: Any, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {allowed}, got {value!r}")
    return float(value)




def _check_eps0(eps0: Any) -> float:
    value = _check_real("eps0", eps0, f"a finite real number > 0 and <= {EPS0_MAX:g}")
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"eps0 must be a finite real number > 0 and <= {EPS0_MAX:g}, got {value!r}")
    if value > EPS0_MAX:
        raise ValueError(
            f"eps0 must be a finite real number > 0 and <= {EPS0_MAX:g} (an eps0 this large gives no privacy "
            f"worth accounting), got {value!r}"
        )
    return value


def _check_delta(delta: Any) -> float:
    value = _check_real("delta", delta, "a real number with 0 < delta < 1")
    if not 0.0 < value < 1.0:
        raise ValueError(f"delta must be a real number with 0 < delta < 1, got {value!r}")
    return value


def _check_epsilon(name: str, epsilon: Any) -> float:
    value = _check_real(name, epsilon, "a finite real number >= 0")
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{name} must be a finite real number >= 0, got {value!r}")
    return value


def _check_rounds(rounds: Any) -> int:
    if isinstance(rounds, bool):
        raise TypeError(f"rounds must be an integer >= 1, got {rounds!r}")
    try:
        value = operator.index(rounds)
    except TypeError:
        raise TypeError(f"rounds must be an integer >= 1, got {type(rounds).__name__} {rounds!r}") from None
    if value < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {value}")
    return int(value)


def _check_order(order: Any) -> float:
    value = _check_real("order", order, "a finite real number > 1")
    if not math.isfinite(value) or value <= 1.0:
        raise ValueError(f"order (Renyi order lambda) must be a finite real number > 1, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------------------
# Lazy access to the exact clone analysis and the PLD engine (they import dp_accounting)
# ---------------------------------------------------------------------------------------------------------


def _clones() -> Any:
    from shuffledp.accounting import clones

    return clones


def _pld() -> Any:
    from shuffledp.accounting import pld

    return pld


# ---------------------------------------------------------------------------------------------------------
# Per-family pieces
# ---------------------------------------------------------------------------------------------------------

_CCG_MIN_ORDER = 2.0


def _rdp_curve(family: str, eps0: float, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(orders, one-round RDP) for the RDP families used in (eps, delta) conversions."""
    if family == "girgis":
        orders = rdp_mod.INTEGER_ORDERS
        return orders, rdp_mod.rdp_curve(lambda a: lit.girgis_rdp_upper(eps0, n, a), orders)
    if family == "ccg-rdp":
        orders = rdp_mod.DEFAULT_ORDERS[rdp_mod.DEFAULT_ORDERS >= _CCG_MIN_ORDER]
        return orders, rdp_mod.rdp_curve(lambda a: lit.ccg_rdp(eps0, n, a), orders)
    raise AssertionError(f"no RDP curve for {family}")  # pragma: no cover - internal misuse


#: Largest relative increase of a PLD's epsilon allowed while stepping it up until its delta is within target.
PLD_STEP_UP_RTOL = 1e-9
#: Most step-up attempts (each one pass over the grid); the step doubles from one ulp each time.
PLD_STEP_UP_MAX_STEPS = 64


def _pld_epsilon(composed: Any, delta: float, *, lower: bool = False) -> float:
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
    first = value
    check = float(pld.delta_for_epsilon(composed, value))
    limit = first + PLD_STEP_UP_RTOL * max(abs(first), 1.0)
    step = math.ulp(max(value, 1.0))
    for _ in range(PLD_STEP_UP_MAX_STEPS):
        if check <= delta:
            return value
        if value + step > limit:
            break
        value = value + step
        step *= 2.0
        check = float(pld.delta_for_epsilon(composed, value))
    if check <= delta:
        return value
    raise ArithmeticError(
        f"PLD epsilon query returned eps={first!r} with delta(eps)={float(pld.delta_for_epsilon(composed, first))!r}"
        f" > delta={delta!r}, and stepping eps up by up to {PLD_STEP_UP_RTOL:g} relative (to {value!r}) still "
        f"gives delta={check!r}: numerical failure of the PLD query; refusing to report it"
    )


def _rr_lower_pld(eps0: float, n: int, rounds_hint: int, interval: float | None = None) -> Any:
    """Optimistic PLD of shuffled binary RR (others 0), both directions (a lower bound after composition)."""
    rr = lit.rr_shuffle_loss(eps0, n)
    p0 = np.exp(rr.log_p0)
    p1 = np.exp(rr.log_p0 + rr.loss)
    if interval is None:
        interval = _rr_interval(eps0, n, rounds_hint)
    return _pld().pld_from_losses(
        rr.loss,
        p1,
        infinity_mass=0.0,
        pessimistic=False,
        value_discretization_interval=interval,
        losses_reverse=-rr.loss,
        probs_reverse=p0,
    )


def _rr_interval(eps0: float, n: int, rounds: int) -> float:
    """Discretisation interval for the optimistic rr-lower PLD: small against the composed loss's spread, but
    no finer than :func:`_rr_interval_floor` (the composed grid must fit ``MAX_COMPOSED_GRID`` points).

    The loss has standard deviation about mu = sqrt(chi^2/n); the composed eps grows like sqrt(T) mu, and
    optimistic rounding lowers the composed loss by at most T * interval, so interval = mu / (200 sqrt(T))
    keeps that shift near 1/200 of sqrt(T) mu (clamped to [1e-7, 1e-2]). A coarser interval only lowers the
    value further, so it stays a lower bound.
    """
    target = min(1e-2, max(1e-7, _rr_mu(eps0, n) / (200.0 * math.sqrt(rounds))))
    floor = _rr_interval_floor(eps0, n, rounds)
    return _clones().round_interval(floor, up=True) if floor > target else float(target)


def _rr_mu(eps0: float, n: int) -> float:
    return 2.0 * math.sinh(min(eps0, 700.0) / 2.0) / math.sqrt(n)


def _rr_interval_floor(eps0: float, n: int, rounds: int) -> float:
    """The composed Chernoff window over ``MAX_COMPOSED_GRID``, as for clones
    (:func:`shuffledp.accounting.clones.suggested_interval`): ``T m1 + 18 sqrt(T) s1`` plus the loss span ``2 eps0``, with
    the per-round mean ``m1 <= min(mu^2, eps0)`` and standard deviation ``s1 <= min(mu, eps0)`` (the loss lies in
    [-eps0, eps0]). Without it, T = 20,000 rounds at n = 1e4, eps0 = 1 asked for 67 million grid points and
    raised, which stopped a run whose comparison families include rr-lower (the server's default)."""
    mu = _rr_mu(eps0, n)
    t = float(rounds)
    width = t * min(mu * mu, eps0) + 18.0 * math.sqrt(t) * min(mu, eps0) + 2.0 * eps0
    return width / _clones().MAX_COMPOSED_GRID


def _rr_pair_pld(eps_pure: float, delta_inf: float, interval: float) -> Any:
    """Pessimistic PLD of randomized response with eps (the worst case of (eps, delta)-DP, KOV) plus delta at +inf."""
    e = float(eps_pure)
    probs = np.array([(1.0 - delta_inf) / (1.0 + math.exp(-e)), (1.0 - delta_inf) / (1.0 + math.exp(e))])
    losses = np.array([e, -e])
    return _pld().pld_from_losses(
        losses, probs, infinity_mass=delta_inf, pessimistic=True, value_discretization_interval=interval
    )


def _fmt_epsilon(eps0: float, n: int, delta: float, rounds: int) -> tuple[float, dict[str, Any]]:
    if rounds == 1:
        return lit.fmt_epsilon(eps0, n, delta), {"method": "closed form, FMT'21 Thm 3.1"}
    best: tuple[float, float] | None = None
    reasons = []
    for frac in FMT_DELTA_FRACTIONS:
        delta1 = frac * delta / rounds
        try:
            eps1 = lit.fmt_epsilon(eps0, n, delta1)
        except RefusedError as exc:
            reasons.append(str(exc))
            continue
        # KOV Thm 3.3: T-fold (eps1, delta1)-DP is (eps, 1 - (1-delta1)^T (1 - delta_KOV(eps)))-DP.
        delta_rest = -math.expm1(math.log1p(-delta) - rounds * math.log1p(-delta1))
        value = lit.no_shuffle_epsilon(eps1, rounds, delta_rest)
        if best is None or value < best[0]:
            best = (value, frac)
    if best is None:
        raise RefusedError(
            f"fmt over {rounds} rounds needs each round valid at delta_1 = f*delta/T for some f in "
            f"{FMT_DELTA_FRACTIONS}; none is: {reasons[-1]}"
        )
    return best[0], {"method": "FMT'21 Thm 3.1 per round, KOV composition", "delta_fraction_per_rounds": best[1]}


def _gdp_mu(family: str, eps0: float, n: int) -> float:
    if family == "ccg-gdp":
        return lit.ccg_gdp_mu(eps0, n)
    chi2 = 4.0 * math.sinh(eps0 / 2.0) ** 2  # binary randomized response, seed 002 Sec. 9.3
    return lit.canonical_mu(chi2, n)


def _family_epsilon(
    family: str, eps0: float, n: int, delta: float, rounds: int, allow_approximate: bool
) -> tuple[float, dict[str, Any]]:
    if family in _VARIANT:
        variant = _VARIANT[family]
        clones = _clones()
        if rounds == 1:
            return float(clones.clone_epsilon(eps0, n, delta, variant)), {"method": "exact"}
        interval = clones.suggested_interval(eps0, n, rounds, variant)
        one = clones.clone_pld(eps0, n, variant, value_discretization_interval=interval, pessimistic=True)
        value = _pld_epsilon(_pld().compose([(one, rounds)]), delta)
        return value, {"method": "pld", "discretisation": "pessimistic", "interval": interval}
    if family in ("ccg-gdp", "canonical-gdp"):
        lit.require_clt_regime(family, eps0, n, delta, allow_approximate)
        mu = _gdp_mu(family, eps0, n) * math.sqrt(rounds)
        return lit.gdp_epsilon(mu, delta), {"mu": mu}
    if family in ("ccg-rdp", "girgis"):
        if family == "ccg-rdp":
            lit.require_clt_regime(family, eps0, n, delta, allow_approximate)
        orders, curve = _rdp_curve(family, eps0, n)
        value, order = rdp_mod.epsilon_from_rdp(orders, rounds * curve, delta)
        return value, {"order": order}
    if family == "fmt":
        return _fmt_epsilon(eps0, n, delta, rounds)
    if family == "rr-lower":
        if rounds == 1:
            return lit.rr_lower_epsilon(eps0, n, delta), {"method": "exact"}
        pld = _pld()
        composed = pld.compose([(_rr_lower_pld(eps0, n, rounds), rounds)])
        return _pld_epsilon(composed, delta, lower=True), {"method": "pld", "discretisation": "optimistic"}
    if family == "no-shuffle":
        return lit.no_shuffle_epsilon(eps0, rounds, delta), {"method": "exact (Kairouz-Oh-Viswanath)"}
    raise AssertionError(family)  # pragma: no cover - families are validated before


def _family_delta(
    family: str, eps0: float, n: int, epsilon: float, rounds: int, allow_approximate: bool
) -> tuple[float, dict[str, Any]]:
    if family in _VARIANT:
        variant = _VARIANT[family]
        clones = _clones()
        if rounds == 1:
            return float(clones.clone_delta(eps0, n, epsilon, variant)), {"method": "exact"}
        pld = _pld()
        interval = clones.suggested_interval(eps0, n, rounds, variant)
        one = clones.clone_pld(eps0, n, variant, value_discretization_interval=interval, pessimistic=True)
        composed = pld.compose([(one, rounds)])
        return float(pld.delta_for_epsilon(composed, epsilon)), {
            "method": "pld",
            "discretisation": "pessimistic",
            "interval": interval,
        }
    if family in ("ccg-gdp", "canonical-gdp", "ccg-rdp"):
        if n < 2:
            raise RefusedError(f"{family} needs n >= 2 reports, got n={n}")
        if family == "ccg-rdp":
            orders, curve = _rdp_curve(family, eps0, n)
            value, order = rdp_mod.delta_from_rdp(orders, rounds * curve, epsilon)
            details: dict[str, Any] = {"order": order}
        else:
            mu = _gdp_mu(family, eps0, n) * math.sqrt(rounds)
            value, details = lit.gdp_delta(mu, epsilon), {"mu": mu}
        # The refusal rule is applied to every answer, before it is returned. A delta that underflowed to 0 is
        # below the smallest float, so 2 ln(1/delta) > 2 ln(1/5e-324) ~ 1489 at least and is not known
        # beyond that: the rule cannot be shown to hold, and the family refuses (unless allow_approximate).
        if value <= 0.0 and not allow_approximate:
            expected = n / (math.exp(eps0) + 1.0)
            raise RefusedError(
                f"{family} is a CLT approximation and is refused here: its delta at epsilon={epsilon} underflows "
                f"to 0 (below {math.ulp(0.0):.3g}), so the refusal rule n/(e^eps0+1) >= 2 ln(1/delta) (here "
                f"n/(e^eps0+1) = {expected:.4g}, and 2 ln(1/delta) > {2.0 * -math.log(math.ulp(0.0)):.4g}) cannot "
                "be shown to hold; in this regime it can fall below the true privacy loss. Use an upper family "
                "(clones) or pass allow_approximate=True to get the approximate value anyway."
            )
        if 0.0 < value < 1.0:
            lit.require_clt_regime(family, eps0, n, value, allow_approximate)
        return value, details
    if family == "girgis":
        orders, curve = _rdp_curve(family, eps0, n)
        value, order = rdp_mod.delta_from_rdp(orders, rounds * curve, epsilon)
        return value, {"order": order}
    if family == "fmt":
        return _fmt_delta(eps0, n, epsilon, rounds)
    if family == "rr-lower":
        if rounds == 1:
            return lit.rr_lower_delta(eps0, n, epsilon), {"method": "exact"}
        pld = _pld()
        composed = pld.compose([(_rr_lower_pld(eps0, n, rounds), rounds)])
        return float(pld.delta_for_epsilon(composed, epsilon)), {"method": "pld", "discretisation": "optimistic"}
    if family == "no-shuffle":
        return lit.no_shuffle_delta(eps0, rounds, epsilon), {"method": "exact (Kairouz-Oh-Viswanath)"}
    raise AssertionError(family)  # pragma: no cover


def _fmt_delta(eps0: float, n: int, epsilon: float, rounds: int) -> tuple[float, dict[str, Any]]:
    """Smallest delta (to DELTA_SEARCH_RTOL, rounded up) whose fmt epsilon is <= ``epsilon``: bisection on log delta.

    fmt's epsilon decreases in delta and its validity region grows with delta, so "certified at delta" is
    monotone; the returned delta is one at which the certificate was checked. If eps0 is valid but FMT's
    epsilon exceeds the target for every delta < 1, the answer is the vacuous delta = 1 (flagged
    ``vacuous``); if eps0 is outside the validity region even as delta -> 1, RefusedError.
    """

    def ok(d: float) -> bool:
        try:
            return _fmt_epsilon(eps0, n, d, rounds)[0] <= epsilon
        except RefusedError:
            return False

    hi = 1.0 - 1e-12
    if not ok(hi):
        _fmt_epsilon(eps0, n, hi, rounds)  # raises RefusedError if eps0 is outside the validity region
        # valid, but FMT's epsilon stays above the target for every delta < 1: only the vacuous delta = 1
        return 1.0, {"method": "bisection on FMT epsilon", "vacuous": True}
    lo = DELTA_SEARCH_FLOOR
    if ok(lo):
        return lo, {"method": "bisection on FMT epsilon", "floor_reached": True}
    log_lo, log_hi = math.log(lo), math.log(hi)
    while log_hi - log_lo > DELTA_SEARCH_RTOL:
        mid = 0.5 * (log_lo + log_hi)
        if ok(math.exp(mid)):
            log_hi = mid
        else:
            log_lo = mid
    return math.exp(log_hi), {"method": "bisection on FMT epsilon", "rtol": DELTA_SEARCH_RTOL}


def _kind(family: str) -> str:
    return FAMILY_KINDS[family]


# ---------------------------------------------------------------------------------------------------------
# Public API (docs/interfaces.md)
# ---------------------------------------------------------------------------------------------------------


def epsilon(
    family: str, eps0: float, n: int, delta: float, rounds: int = 1, *, allow_approximate: bool = False
) -> Bound:
    """Epsilon at ``delta`` after ``rounds`` rounds of ``n`` shuffled ``eps0``-LDP reports.

    Args:
        family: one of :data:`accounting.FAMILIES`.
        eps0: local privacy parameter, finite and > 0.
        n: number of shuffled reports per round, an integer >= 1.
        delta: 0 < delta < 1.
        rounds: number of rounds T >= 1 (all with the same n and eps0; see :func:`epsilon_for_rounds`).
        allow_approximate: let CLT families answer where their refusal rule would refuse.

    Returns:
        A :class:`Bound` of the family's kind. Non-lower families are capped by the ``no-shuffle`` value (see
        the module docstring).

    Raises:
        ValueError/TypeError: an argument is outside its allowed range. RefusedError: the family refuses.
    """
    family = _check_family(family, allow_girgis_lower=False)
    eps0, n, delta, rounds = _check_eps0(eps0), _check_n(n), _check_delta(delta), _check_rounds(rounds)
    value, details = _family_epsilon(family, eps0, n, delta, rounds, allow_approximate)
    if _kind(family) != "lower" and family != "no-shuffle":
        cap = lit.no_shuffle_epsilon(eps0, rounds, delta)
        if cap < value:
            details = {**details, "capped_by_no_shuffle": True, "uncapped": value}
            value = cap
    return Bound(value=max(value, 0.0), kind=_kind(family), family=family, details=details)


def delta(
    family: str, eps0: float, n: int, epsilon: float, rounds: int = 1, *, allow_approximate: bool = False
) -> Bound:
    """Delta at ``epsilon`` after ``rounds`` rounds of ``n`` shuffled ``eps0``-LDP reports.

    Same families, validation, kinds and no-shuffle cap as :func:`epsilon`; ``epsilon`` must be finite and >= 0.
    For the CLT families the refusal rule is checked at the delta they return.
    """
    family = _check_family(family, allow_girgis_lower=False)
    eps0, n, rounds = _check_eps0(eps0), _check_n(n), _check_rounds(rounds)
    eps = _check_epsilon("epsilon", epsilon)
    value, details = _family_delta(family, eps0, n, eps, rounds, allow_approximate)
    if _kind(family) != "lower" and family != "no-shuffle":
        cap = lit.no_shuffle_delta(eps0, rounds, eps)
        if cap < value:
            details = {**details, "capped_by_no_shuffle": True, "uncapped": value}
            value = cap
    return Bound(value=min(max(value, 0.0), 1.0), kind=_kind(family), family=family, details=details)


def renyi(family: str, eps0: float, n: int, order: float, rounds: int = 1) -> Bound:
    """Renyi divergence of order ``order`` > 1 after ``rounds`` rounds: ``rounds * D_order`` (Mironov 2017).

    Families with a Renyi curve: :data:`RENYI_FAMILIES`. ``clones``/``clones-focs``: exact Renyi divergence
    of the clone pair, max of both directions (upper), for orders up to ``clones.RENYI_MAX_ORDER`` (10000;
    larger orders raise RefusedError). ``girgis``/``girgis-lower``: seed 000 eqs. (5)/(6),
    integer orders >= 2. ``ccg-rdp``: seed 000 Cor. 2, orders >= 2 (approximate). ``rr-lower``: exact for
    shuffled binary randomized response (lower). Others raise :class:`RefusedError`.
    """
    family = _check_family(family, allow_girgis_lower=True)
    eps0, n, order, rounds = _check_eps0(eps0), _check_n(n), _check_order(order), _check_rounds(rounds)
    if family not in RENYI_FAMILIES:
        raise RefusedError(
            f"{family} has no Renyi-divergence curve; renyi() is available for {list(RENYI_FAMILIES)}"
        )
    if family in _VARIANT:
        one = float(_clones().clone_renyi(eps0, n, order, _VARIANT[family]))
    elif family == "girgis":
        one = lit.girgis_rdp_upper(eps0, n, order)
    elif family == "girgis-lower":
        one = lit.girgis_rdp_lower(eps0, n, order)
    elif family == "ccg-rdp":
        one = lit.ccg_rdp(eps0, n, order)  # refuses orders below 2 (Cor. 2's statement)
    else:
        one = lit.rr_lower_renyi(eps0, n, order)
    return Bound(value=rounds * one, kind=_kind(family), family=family, details={"order": order, "rounds": rounds})


def calibrate(
    family: str, target_epsilon: float, delta: float, n: int, rounds: int, *, allow_approximate: bool = False
) -> Bound:
    """The largest eps0 in :data:`CALIBRATION_RANGE` with ``epsilon(family, eps0, n, delta, rounds) <= target``.

    Brent's method on ``log(achieved/target)`` over ``log eps0`` (Brent 1973), then geometric bisection, until
    the certified bracket has ``hi <= lo (1 + CALIBRATION_RTOL)``: the returned ``lo`` was evaluated and
    satisfies the target, ``hi`` was evaluated and does not. An eps0 the family refuses (RefusedError) or
    cannot evaluate (ArithmeticError: a numerical failure of the PLD query, see :func:`_pld_epsilon`) counts
    as NOT satisfying the target, so the answer is always an eps0 whose epsilon was actually certified;
    ``details["unevaluable_trials"]`` counts the numerical failures.
    ``details``: ``achieved_epsilon`` at the returned eps0, ``first_failing_eps0`` (``hi``), the tolerance and
    the search range; ``range_upper_end_reached`` is True when even the top of the range satisfies the target
    (the answer is then that top, not a larger eps0).

    Raises:
        RefusedError: no eps0 in the range satisfies the target (never a fallback value).
    """
    family = _check_family(family, allow_girgis_lower=False)
    target = _check_epsilon("target_epsilon", target_epsilon)
    if target <= 0.0:
        raise ValueError(f"target_epsilon must be a finite real number > 0, got {target!r}")
    delta, n, rounds = _check_delta(delta), _check_n(n), _check_rounds(rounds)

    failures = {"count": 0}

    def achieved(e0: float) -> float | None:
        try:
            return epsilon(family, e0, n, delta, rounds, allow_approximate=allow_approximate).value
        except RefusedError:
            return None
        except ArithmeticError:  # numerical failure at this trial point: counts as failing the target
            failures["count"] += 1
            return None

    lo, hi = CALIBRATION_RANGE
    base = {"target_epsilon": target, "delta": delta, "n": n, "rounds": rounds, "search_range": list(CALIBRATION_RANGE)}
    at_lo = achieved(lo)
    if at_lo is None or at_lo > target:
        raise RefusedError(
            f"calibrate: no eps0 in [{lo}, {hi}] keeps {family} within eps={target} at delta={delta} for "
            f"n={n}, rounds={rounds} (at eps0={lo} it gives "
            f"{'a refusal' if at_lo is None else format(at_lo, '.6g')})"
        )
    at_hi = achieved(hi)
    if at_hi is not None and at_hi <= target:
        return Bound(
            value=hi,
            kind=_kind(family),
            family=family,
            details={**base, "achieved_epsilon": at_hi, "range_upper_end_reached": True, "evaluations": 2},
        )
    # Brent's method on log(eps0) accelerates the search; every evaluation also narrows the certified
    # bracket [lo (satisfies), hi (does not)], and plain geometric bisection finishes the job if needed.
    state = {"lo": lo, "hi": hi, "best": at_lo, "evaluations": 2}

    def gap(log_e0: float) -> float:
        e0 = math.exp(log_e0)
        got = achieved(e0)
        state["evaluations"] += 1
        if got is not None and got <= target:
            if e0 > state["lo"]:
                state["lo"], state["best"] = e0, got
        elif e0 < state["hi"]:
            state["hi"] = e0
        if got is None:
            return 1.0  # refused: counts as exceeding the target
        return math.log(got / target) if got > 0.0 else -1.0

    try:
        optimize.brentq(gap, math.log(lo), math.log(hi), xtol=0.25 * CALIBRATION_RTOL, maxiter=60)
    except (RuntimeError, ValueError):  # no convergence or no sign change: the bisection below still applies
        pass
    lo, hi, best = state["lo"], state["hi"], state["best"]
    while hi > lo * (1.0 + CALIBRATION_RTOL):
        mid = math.sqrt(lo * hi)
        got = achieved(mid)
        state["evaluations"] += 1
        if got is not None and got <= target:
            lo, best = mid, got
        else:
            hi = mid
    return Bound(
        value=lo,
        kind=_kind(family),
        family=family,
        details={
            **base,
            "achieved_epsilon": best,
            "first_failing_eps0": hi,
            "rtol": CALIBRATION_RTOL,
            "evaluations": state["evaluations"],
            "unevaluable_trials": failures["count"],
        },
    )


def _check_round(index: int, r: Any) -> tuple[int, float]:
    try:
        n, eps0 = r.n, r.eps0
    except AttributeError:
        raise TypeError(f"rounds[{index}] must be a ShuffleRound (with .n and .eps0), got {r!r}") from None
    try:
        return _check_n(n), _check_eps0(eps0)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"rounds[{index}]: {exc}") from None


def epsilon_for_rounds(
    family: str, rounds: Sequence[ShuffleRound], delta: float, *, allow_approximate: bool = False
) -> Bound:
    """Epsilon at ``delta`` after heterogeneous rounds (each its own n and eps0).

    Equal ``(n, eps0)`` rounds are grouped. One group is :func:`epsilon` with ``rounds = count``. Several
    groups: PLD composition (pessimistic for ``clones``/``clones-focs``/``no-shuffle``/``fmt``, optimistic for
    ``rr-lower``), RDP summation (``ccg-rdp``, ``girgis``), ``sqrt(sum mu^2)`` (``ccg-gdp``, ``canonical-gdp``).
    ``fmt`` spends ``delta/2`` on the per-round deltas (``delta/(2T)`` each) and composes the (eps_i, delta_i)
    pairs through the PLD of their worst case (KOV). Non-lower families are capped by the heterogeneous
    ``no-shuffle`` value (grouped by eps0 alone: n plays no role there).

    Speed: with more than ``HETEROGENEOUS_EXACT_GROUPS`` distinct groups the PLD families (``clones``,
    ``clones-focs``, ``rr-lower``, ``fmt``) move each round to a dominating point of a geometric grid of ratio
    ``HETEROGENEOUS_N_GRID_RATIO`` in n and ``HETEROGENEOUS_EPS0_GRID_RATIO`` in eps0 (n down / eps0 up for upper
    families, the reverse for ``rr-lower``, see :func:`_dominating_round`) so rounds with nearly equal n merge;
    ``details["bucketed"]`` says so. The value stays on the safe side of the family's kind. How far it moves:
    n by less than 0.5% (every n below 200 stays exact), eps0 by less than 0.1%; measured for ``clones`` with
    every eps0 just above a grid point and five n just above 1e5 (the worst case), delta = 1e-6: +0.22% at
    eps0 = 0.5, +0.25% at eps0 = 2, +0.58% at eps0 = 8 (the value grows about like e^(eps0/2), so a relative
    eps0 change x moves it by about eps0 x / 2).
    """
    family = _check_family(family, allow_girgis_lower=False)
    delta = _check_delta(delta)
    if isinstance(rounds, (str, bytes)) or not isinstance(rounds, Sequence):
        raise TypeError(f"rounds must be a sequence of ShuffleRound, got {type(rounds).__name__}")
    if len(rounds) == 0:
        raise ValueError("rounds must hold at least one ShuffleRound")
    groups: dict[tuple[int, float], int] = {}
    for i, r in enumerate(rounds):
        key = _check_round(i, r)
        groups[key] = groups.get(key, 0) + 1
    extra: dict[str, Any] = {}
    if family == "no-shuffle":  # n plays no role: merge by eps0 (exact)
        groups = _merge(groups, lambda n, eps0: (1, eps0))
    elif family in _BUCKETED_FAMILIES and len(groups) > HETEROGENEOUS_EXACT_GROUPS:
        lower = _kind(family) == "lower"
        extra = {
            "bucketed": {
                "groups_before": len(groups),
                "n_ratio": HETEROGENEOUS_N_GRID_RATIO,
                "eps0_ratio": HETEROGENEOUS_EPS0_GRID_RATIO,
            }
        }
        groups = _merge(groups, lambda n, eps0: _dominating_round(n, eps0, lower=lower))
    if len(groups) == 1:
        (n, eps0), count = next(iter(groups.items()))
        one = epsilon(family, eps0, n, delta, count, allow_approximate=allow_approximate)
        if not extra:
            return one
        return Bound(value=one.value, kind=one.kind, family=family, details={**one.details, **extra})
    items = [(n, eps0, count) for (n, eps0), count in groups.items()]
    total = sum(c for _, _, c in items)
    value, details = _heterogeneous_epsilon(family, items, total, delta, allow_approximate)
    details = {**details, **extra, "groups": len(items), "rounds": total}
    if _kind(family) != "lower" and family != "no-shuffle":
        by_eps0 = _merge({(n, e): c for n, e, c in items}, lambda n, eps0: (1, eps0))
        if len(by_eps0) == 1:
            cap = lit.no_shuffle_epsilon(items[0][1], total, delta)
        else:
            merged = [(n, e, c) for (n, e), c in by_eps0.items()]
            cap, _ = _heterogeneous_epsilon("no-shuffle", merged, total, delta, allow_approximate)
        if cap < value:
            details = {**details, "capped_by_no_shuffle": True, "uncapped": value}
            value = cap
    return Bound(value=max(value, 0.0), kind=_kind(family), family=family, details=details)


#: Up to this many distinct (n, eps0) groups are composed as they are; beyond it the PLD families round each
#: round to a dominating grid point (see :func:`_dominating_round`) so that rounds merge.
HETEROGENEOUS_EXACT_GROUPS = 4
#: Ratio of the geometric grid of n in :func:`_dominating_round` (n moves by < 0.5%; n < 200 stays exact).
HETEROGENEOUS_N_GRID_RATIO = 1.005
#: Ratio of the geometric grid of eps0 in :func:`_dominating_round` (eps0 moves by < 0.1%). Finer than n's
#: grid because epsilon reacts to eps0 more strongly (about eps0/2 times the relative change) than to n
#: (about half the relative change); eps0 rarely varies between rounds, so it costs few extra groups.
HETEROGENEOUS_EPS0_GRID_RATIO = 1.001
_BUCKETED_FAMILIES = ("clones", "clones-focs", "rr-lower", "fmt")


def _merge(groups: dict[tuple[int, float], int], key: Any) -> dict[tuple[int, float], int]:
    out: dict[tuple[int, float], int] = {}
    for (n, eps0), count in groups.items():
        k = key(n, eps0)
        out[k] = out.get(k, 0) + count
    return out


def _dominating_round(n: int, eps0: float, *, lower: bool) -> tuple[int, float]:
    """Move (n, eps0) onto geometric grids (ratios ``HETEROGENEOUS_N_GRID_RATIO`` = r for n,
    ``HETEROGENEOUS_EPS0_GRID_RATIO`` for eps0), in the safe direction.

    Upper families: n rounded DOWN and eps0 rounded UP. Fewer shuffled reports can only leak more (the clone
    pair with more clones is a post-processing of the one with fewer: add independent clones split by a fair
    coin), and an eps0-LDP randomizer is also eps0'-LDP for eps0' >= eps0; so the bound of the rounded round
    covers the real one. n goes to the smallest integer of its cell ``[r^k, r^(k+1))``, ``ceil(r^k)``, so an n
    that is the only integer of its cell (every n below ``1 / (r - 1)`` = 200) stays exact. Lower family
    (rr-lower): n UP to the largest integer of its cell, ``floor(r^(k+1))``, and eps0 DOWN, so the value stays
    a lower bound. A coordinate whose rounded value would leave the accepted range (eps0 above
    :data:`EPS0_MAX`, n above :data:`N_MAX`) is kept exact instead (the exact value is its own dominating point).
    """
    log_rn = math.log(HETEROGENEOUS_N_GRID_RATIO)
    log_re = math.log(HETEROGENEOUS_EPS0_GRID_RATIO)
    kn = math.log(n) / log_rn
    ke = math.log(eps0) / log_re
    if lower:
        n2 = max(n, math.floor(HETEROGENEOUS_N_GRID_RATIO ** math.ceil(kn)))
        e2 = min(eps0, HETEROGENEOUS_EPS0_GRID_RATIO ** math.floor(ke))
        if n2 > N_MAX:  # rounding up would leave the accepted range: keep the exact n (no bucketing of n)
            n2 = n
    else:
        n2 = max(1, min(n, math.ceil(HETEROGENEOUS_N_GRID_RATIO ** math.floor(kn))))
        e2 = max(eps0, HETEROGENEOUS_EPS0_GRID_RATIO ** math.ceil(ke))
        if e2 > EPS0_MAX:  # rounding up would pass the cap every bound enforces: keep the exact eps0 group
            e2 = eps0
    return int(n2), float(e2)


#: Coarsest discretisation interval of the two-point PLDs (no-shuffle, fmt) composed across heterogeneous
#: groups; :func:`_heterogeneous_pair_interval` goes finer when the per-round epsilons are small. Clone PLDs use
#: :func:`_heterogeneous_clone_interval`.
HETEROGENEOUS_INTERVAL = 1e-4


def _heterogeneous_pair_interval(pairs: list[tuple[float, int]]) -> float:
    """Grid interval for composing randomized-response PLDs (losses +-eps_g, ``count_g`` rounds each).

    Rounding each loss up by less than ``h`` raises the composed epsilon by less than ``T h``. With ``m`` the
    summed mean (KL) and ``v`` the summed variance of the per-round losses (for loss +-eps: mean
    ``eps tanh(eps/2)``, variance ``eps^2 - mean^2``), the composed epsilon is at least ``m + 2 sqrt(v)`` for
    delta <= 0.02 (as in :func:`shuffledp.accounting.clones.suggested_interval`), so
    ``h = INTERVAL_RELATIVE_ERROR (m + 2 sqrt(v)) / T`` keeps the discretisation error below 0.4% relative.
    ``h`` is at most :data:`HETEROGENEOUS_INTERVAL` (finer costs little for the usual eps0 ~ 1) and at least the
    composed Chernoff window ``m + 18 sqrt(v)`` (plus the widest loss span) over ``MAX_COMPOSED_GRID``. A fixed
    1e-4 made the heterogeneous no-shuffle value 96 times the exact one at eps0 = 1e-5 over 2,000 rounds.
    """
    clones = _clones()
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


def _heterogeneous_clone_interval(clones: Any, items: list[tuple[int, float, int]], total: int, variant: str) -> float:
    """Grid interval for composing clone PLDs of different (n, eps0) groups.

    The finest of the groups' :func:`shuffledp.accounting.clones.suggested_interval` (each keeps its own discretisation
    error below ``INTERVAL_RELATIVE_ERROR``), but no finer than the composed Chernoff window, ``sum_g T_g m1_g +
    18 sqrt(sum_g T_g s1_g^2)`` as in ``suggested_interval``, divided by ``MAX_COMPOSED_GRID``, and than each
    group's loss span (at most ``2 eps0``) divided by the same. Without the floor, a round with large n (losses
    near 1e-6) next to one with small n (losses up to eps0) asked for hundreds of millions of grid points and
    raised. A coarser interval keeps the pessimistic discretisation an upper bound; its error is at most one
    interval per round, small against the composed width.
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


def _heterogeneous_epsilon(
    family: str, items: list[tuple[int, float, int]], total: int, delta: float, allow_approximate: bool
) -> tuple[float, dict[str, Any]]:
    if family in ("ccg-gdp", "canonical-gdp"):
        for n, eps0, _ in items:
            lit.require_clt_regime(family, eps0, n, delta, allow_approximate)
        mu = math.sqrt(sum(c * _gdp_mu(family, eps0, n) ** 2 for n, eps0, c in items))
        return lit.gdp_epsilon(mu, delta), {"mu": mu}
    if family in ("ccg-rdp", "girgis"):
        curves = []
        orders = None
        for n, eps0, c in items:
            if family == "ccg-rdp":
                lit.require_clt_regime(family, eps0, n, delta, allow_approximate)
            orders, curve = _rdp_curve(family, eps0, n)
            curves.append((curve, c))
        value, order = rdp_mod.epsilon_from_rdp(orders, rdp_mod.compose_rdp(curves), delta)
        return value, {"order": order}
    pld = _pld()
    if family in _VARIANT:
        variant = _VARIANT[family]
        clones = _clones()
        interval = _heterogeneous_clone_interval(clones, items, total, variant)
        plds = [
            (clones.clone_pld(eps0, n, variant, value_discretization_interval=interval, pessimistic=True), c)
            for n, eps0, c in items
        ]
        return _pld_epsilon(pld.compose(plds), delta), {
            "method": "pld",
            "discretisation": "pessimistic",
            "interval": interval,
        }
    if family == "rr-lower":
        # no finer than the widest group's loss span (at most 2 eps0) over MAX_COMPOSED_GRID: a coarser optimistic
        # grid only lowers the value, so it stays a lower bound (as for clones, see _heterogeneous_clone_interval)
        span = max(2.0 * eps0 for _, eps0, _ in items)
        floor = max(max(_rr_interval_floor(eps0, n, total) for n, eps0, _ in items), span / _clones().MAX_COMPOSED_GRID)
        interval = max(min(_rr_interval(eps0, n, total) for n, eps0, _ in items), floor)
        plds = [(_rr_lower_pld(eps0, n, total, interval), c) for n, eps0, c in items]
        return _pld_epsilon(pld.compose(plds), delta, lower=True), {
            "method": "pld",
            "discretisation": "optimistic",
            "interval": interval,
        }
    if family == "no-shuffle":
        interval = _heterogeneous_pair_interval([(eps0, c) for _, eps0, c in items])
        plds = [(_rr_pair_pld(eps0, 0.0, interval), c) for n, eps0, c in items]
        return _pld_epsilon(pld.compose(plds), delta), {
            "method": "pld of randomized response (KOV worst case)",
            "discretisation": "pessimistic",
            "interval": interval,
        }
    if family == "fmt":
        delta1 = 0.5 * delta / total
        per_round = [(lit.fmt_epsilon(eps0, n, delta1), c) for n, eps0, c in items]
        interval = _heterogeneous_pair_interval(per_round)
        plds = [(_rr_pair_pld(eps1, delta1, interval), c) for eps1, c in per_round]
        return _pld_epsilon(pld.compose(plds), delta), {
            "method": "FMT'21 Thm 3.1 per round at delta/(2T), PLD of the (eps, delta) worst case",
            "discretisation": "pessimistic",
            "interval": interval,
        }
    raise AssertionError(family)  # pragma: no cover


class EpsilonBracket(NamedTuple):
    """Two PLD epsilons that bracket the true composed epsilon of the clone pair (see :func:`epsilon_bracket`).

    ``lower``: optimistic discretisation, a LOWER bound on the pair's epsilon; ``upper``: pessimistic
    discretisation, an UPPER bound (the value the ``clones`` families report, before the no-shuffle cap).
    Unpacks as ``(lower, upper)``.
    """

    lower: float
    upper: float

    @property
    def kinds(self) -> dict[str, str]:
        """What each number is, in the accountant's vocabulary."""
        return {"lower": "lower", "upper": "upper"}


def epsilon_bracket(family: str, eps0: float, n: int, delta: float, rounds: int) -> EpsilonBracket:
    """``(lower, upper)`` PLD epsilons of ``clones``/``clones-focs`` over ``rounds`` rounds.

    The true composed epsilon of the clone pair lies in this bracket (pessimistic discretisation over-, and
    optimistic discretisation under-estimates every hockey-stick divergence; Koskela et al. / Google
    ``dp_accounting`` PLD). Uncapped. Returns an :class:`EpsilonBracket` whose fields name which bound is which.
    """
    if family not in _VARIANT:
        raise RefusedError(f"epsilon_bracket is available for {list(_VARIANT)}, got {family!r}")
    eps0, n, delta, rounds = _check_eps0(eps0), _check_n(n), _check_delta(delta), _check_rounds(rounds)
    clones = _clones()
    variant = _VARIANT[family]
    interval = clones.suggested_interval(eps0, n, rounds, variant)
    out = [
        float(
            clones.clone_epsilon_composed(
                eps0, n, delta, rounds, variant, pessimistic=pessimistic, value_discretization_interval=interval
            )
        )
        for pessimistic in (False, True)
    ]
    return EpsilonBracket(lower=out[0], upper=out[1])
