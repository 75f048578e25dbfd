"""The public bound functions: epsilon, delta, Renyi divergence, calibration and heterogeneous rounds.

Each function validates its parameters (:mod:`shuffledp.accounting.validation`), looks the family up in the
registry (:mod:`shuffledp.accounting.families`, where each family's formulas, kind and refusal rule live, with the
papers they come from) and applies what is common to all families:

Capping: the shuffled output is a post-processing of the n eps0-LDP reports, so the ``no-shuffle`` value is a
valid upper bound too. Every non-lower family's epsilon/delta is the minimum of its own value and the
``no-shuffle`` value; when the cap applies, ``details["capped_by_no_shuffle"]`` is True and
``details["uncapped"]`` holds the family's own number. Renyi values are the families' formulas, uncapped.

Refusals (:class:`shuffledp.accounting.RefusedError`): ``fmt`` outside its validity region; ``ccg-gdp``,
``ccg-rdp`` and ``canonical-gdp`` when n/(e^{eps0}+1) < 2 ln(1/delta) (few expected clones: the CLT values were
measured below the exact value there) unless ``allow_approximate=True``; families without an RDP curve in
:func:`renyi`; ``girgis-lower`` outside :func:`renyi`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from scipy import optimize

from shuffledp.accounting import EPS0_MAX, FAMILIES, Bound, RefusedError
from shuffledp.accounting import families as fam
from shuffledp.accounting import heterogeneous as het
from shuffledp.accounting import literature as lit
from shuffledp.accounting.composition import HETEROGENEOUS_INTERVAL, PLD_STEP_UP_RTOL
from shuffledp.accounting.families import FMT_DELTA_FRACTIONS, RENYI_FAMILIES
from shuffledp.accounting.validation import (
    check_delta,
    check_eps0,
    check_epsilon,
    check_n,
    check_order,
    check_rounds,
)

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
    "clones_in_order",
    "epsilon_bracket",
    "EpsilonBracket",
]

#: The eps0 range :func:`calibrate` searches.
CALIBRATION_RANGE: tuple[float, float] = (1e-3, 20.0)
#: Relative tolerance of the calibrated eps0: the answer ``lo`` is certified and ``hi <= lo (1 + rtol)`` is not.
CALIBRATION_RTOL = 1e-6

_N_NAME = "n (number of shuffled reports)"


def _checked(eps0: Any, n: Any) -> tuple[float, int]:
    return check_eps0(eps0), check_n(n, _N_NAME, integral_float=True)


def _bound(family: fam.Family, value: float, details: dict[str, Any]) -> Bound:
    return Bound(value=value, kind=family.kind, family=family.name, details=details)


def _capped(value: float, details: dict[str, Any], cap: float) -> tuple[float, dict[str, Any]]:
    if cap < value:
        return cap, {**details, "capped_by_no_shuffle": True, "uncapped": value}
    return value, details


def epsilon(
    family: str, eps0: float, n: int, delta: float, rounds: int = 1, *, allow_approximate: bool = False
) -> Bound:
    """Epsilon at ``delta`` after ``rounds`` rounds of ``n`` shuffled ``eps0``-LDP reports.

    Args:
        family: one of :data:`shuffledp.accounting.FAMILIES`.
        eps0: local privacy parameter, finite, > 0 and <= ``EPS0_MAX``.
        n: number of shuffled reports per round, an integer in ``[1, N_MAX]``.
        delta: 0 < delta < 1.
        rounds: number of rounds T >= 1 (all with the same n and eps0; see :func:`epsilon_for_rounds`).
        allow_approximate: let CLT families answer where their refusal rule would refuse.

    Returns:
        A :class:`Bound` of the family's kind. Non-lower families are capped by the ``no-shuffle`` value (see
        the module docstring).

    Raises:
        ValueError/TypeError: an argument is outside its allowed range. RefusedError: the family refuses.
    """
    found = fam.lookup(family)
    eps0, n = _checked(eps0, n)
    delta, rounds = check_delta(delta), check_rounds(rounds)
    value, details = found.epsilon(eps0, n, delta, rounds, allow_approximate)
    if found.capped:
        value, details = _capped(value, details, lit.no_shuffle_epsilon(eps0, rounds, delta))
    return _bound(found, max(value, 0.0), details)


def delta(
    family: str, eps0: float, n: int, epsilon: float, rounds: int = 1, *, allow_approximate: bool = False
) -> Bound:
    """Delta at ``epsilon`` after ``rounds`` rounds of ``n`` shuffled ``eps0``-LDP reports.

    Same families, validation, kinds and no-shuffle cap as :func:`epsilon`. For the CLT families the refusal
    rule is checked at the delta they return.

    Args:
        family: one of :data:`shuffledp.accounting.FAMILIES`.
        eps0: local privacy parameter, finite, > 0 and <= ``EPS0_MAX``.
        n: number of shuffled reports per round, an integer in ``[1, N_MAX]``.
        epsilon: finite and >= 0.
        rounds: number of rounds T >= 1.
        allow_approximate: let CLT families answer where their refusal rule would refuse.

    Returns:
        A :class:`Bound` of the family's kind, its value in [0, 1].
    """
    found = fam.lookup(family)
    eps0, n = _checked(eps0, n)
    rounds = check_rounds(rounds)
    eps = check_epsilon(epsilon)
    value, details = found.delta(eps0, n, eps, rounds, allow_approximate)
    if found.capped:
        value, details = _capped(value, details, lit.no_shuffle_delta(eps0, rounds, eps))
    return _bound(found, min(max(value, 0.0), 1.0), details)


def renyi(family: str, eps0: float, n: int, order: float, rounds: int = 1) -> Bound:
    """Renyi divergence of order ``order`` > 1 after ``rounds`` rounds: ``rounds * D_order`` (Mironov, CSF 2017).

    Families with a Renyi curve: :data:`RENYI_FAMILIES`. ``clones``/``clones-focs``: exact Renyi divergence
    of the clone pair, max of both directions (upper), for orders up to ``clones.RENYI_MAX_ORDER`` (10000;
    larger orders raise RefusedError). ``girgis``/``girgis-lower``: Girgis et al. (CCS 2021) as printed in
    Chen, Cao, Ge (ICASSP 2024, seed 000) eqs. (5)/(6), integer orders >= 2. ``ccg-rdp``: seed 000 Cor. 2,
    orders >= 2 (approximate). ``rr-lower``: exact for shuffled binary randomized response (lower). Others raise
    :class:`RefusedError`.

    Args:
        family: one of :data:`RENYI_FAMILIES` (``girgis-lower`` included).
        eps0: local privacy parameter, finite, > 0 and <= ``EPS0_MAX``.
        n: number of shuffled reports per round, an integer in ``[1, N_MAX]``.
        order: the Renyi order, finite and > 1.
        rounds: number of rounds T >= 1.

    Returns:
        A :class:`Bound` of the family's kind (details: ``order``, ``rounds``).
    """
    found = fam.lookup(family, renyi=True)
    eps0, n = _checked(eps0, n)
    order, rounds = check_order(order), check_rounds(rounds)
    if not found.has_renyi:
        raise RefusedError(
            f"{found.name} has no Renyi-divergence curve; renyi() is available for {list(RENYI_FAMILIES)}"
        )
    one = found.renyi(eps0, n, order)
    return _bound(found, rounds * one, {"order": order, "rounds": rounds})


def calibrate(
    family: str, target_epsilon: float, delta: float, n: int, rounds: int, *, allow_approximate: bool = False
) -> Bound:
    """The largest eps0 in :data:`CALIBRATION_RANGE` with ``epsilon(family, eps0, n, delta, rounds) <= target``.

    Brent's method on ``log(achieved/target)`` over ``log eps0`` (Brent 1973), then geometric bisection, until
    the certified bracket has ``hi <= lo (1 + CALIBRATION_RTOL)``: the returned ``lo`` was evaluated and
    satisfies the target, ``hi`` was evaluated and does not. An eps0 the family refuses (RefusedError) or
    cannot evaluate (ArithmeticError: a numerical failure of the PLD query, see
    :func:`shuffledp.accounting.composition.pld_epsilon`) counts as NOT satisfying the target, so the answer is
    always an eps0 whose epsilon was actually certified; ``details["unevaluable_trials"]`` counts the numerical
    failures. ``details``: ``achieved_epsilon`` at the returned eps0, ``first_failing_eps0`` (``hi``), the
    tolerance and the search range; ``range_upper_end_reached`` is True when even the top of the range satisfies
    the target (the answer is then that top, not a larger eps0).

    Args:
        family: one of :data:`shuffledp.accounting.FAMILIES`.
        target_epsilon: the epsilon to stay within, finite and > 0.
        delta: 0 < delta < 1.
        n: number of shuffled reports per round, an integer in ``[1, N_MAX]``.
        rounds: number of rounds T >= 1.
        allow_approximate: let CLT families answer where their refusal rule would refuse.

    Returns:
        A :class:`Bound` whose value is the calibrated eps0.

    Raises:
        RefusedError: no eps0 in the range satisfies the target (never a fallback value).
    """
    found = fam.lookup(family)
    target = check_epsilon(target_epsilon, "target_epsilon")
    if target <= 0.0:
        raise ValueError(f"target_epsilon must be a finite real number > 0, got {target!r}")
    delta, n, rounds = check_delta(delta), check_n(n, _N_NAME, integral_float=True), check_rounds(rounds)

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
        details = {**base, "achieved_epsilon": at_hi, "range_upper_end_reached": True, "evaluations": 2}
        return _bound(found, hi, details)
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
    return _bound(
        found,
        lo,
        {
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
        return check_n(n, _N_NAME, integral_float=True), check_eps0(eps0)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"rounds[{index}]: {exc}") from None


def epsilon_for_rounds(
    family: str, rounds: Sequence[ShuffleRound], delta: float, *, allow_approximate: bool = False
) -> Bound:
    """Epsilon at ``delta`` after heterogeneous rounds (each its own n and eps0).

    Equal ``(n, eps0)`` rounds are grouped. One group is :func:`epsilon` with ``rounds = count``. Several
    groups: each family's :meth:`~shuffledp.accounting.families.Family.heterogeneous_epsilon`: PLD composition
    (pessimistic for ``clones``/``clones-focs``/``no-shuffle``/``fmt``, optimistic for ``rr-lower``), RDP
    summation (``ccg-rdp``, ``girgis``), ``sqrt(sum mu^2)`` (``ccg-gdp``, ``canonical-gdp``). ``fmt`` spends
    ``delta/2`` on the per-round deltas (``delta/(2T)`` each) and composes the (eps_i, delta_i) pairs through the
    PLD of their worst case (KOV). Non-lower families are capped by the heterogeneous ``no-shuffle`` value
    (grouped by eps0 alone: n plays no role there).

    Speed: with more than ``HETEROGENEOUS_EXACT_GROUPS`` distinct groups the bucketed families (``clones``,
    ``clones-focs``, ``rr-lower``, ``fmt``) move each round to a dominating point of a geometric grid of ratio
    ``HETEROGENEOUS_N_GRID_RATIO`` in n and ``HETEROGENEOUS_EPS0_GRID_RATIO`` in eps0 (n down / eps0 up for upper
    families, the reverse for ``rr-lower``, see :func:`shuffledp.accounting.heterogeneous.dominating_round`) so
    rounds with nearly equal n merge; ``details["bucketed"]`` says so. The value stays on the safe side of the
    family's kind. How far it moves: n by less than 0.5% (every n below 200 stays exact), eps0 by less than
    0.1%; measured for ``clones`` with every eps0 just above a grid point and five n just above 1e5 (the worst
    case), delta = 1e-6: +0.22% at eps0 = 0.5, +0.25% at eps0 = 2, +0.58% at eps0 = 8 (the value grows about
    like e^(eps0/2), so a relative eps0 change x moves it by about eps0 x / 2).

    Args:
        family: one of :data:`shuffledp.accounting.FAMILIES`.
        rounds: the rounds, a non-empty sequence of :class:`~shuffledp.accounting.events.ShuffleRound`.
        delta: 0 < delta < 1.
        allow_approximate: let CLT families answer where their refusal rule would refuse.

    Returns:
        A :class:`Bound` of the family's kind (details: ``groups``, ``rounds`` when there are several groups).
    """
    found = fam.lookup(family)
    delta = check_delta(delta)
    if isinstance(rounds, (str, bytes)) or not isinstance(rounds, Sequence):
        raise TypeError(f"rounds must be a sequence of ShuffleRound, got {type(rounds).__name__}")
    if len(rounds) == 0:
        raise ValueError("rounds must hold at least one ShuffleRound")
    groups: dict[tuple[int, float], int] = {}
    pairs = []
    for i, r in enumerate(rounds):
        key = _check_round(i, r)
        pairs.append(key)
        groups[key] = groups.get(key, 0) + 1
    extra: dict[str, Any] = {}
    if family in fam.CLONE_VARIANTS and len(groups) > 1:
        return clones_in_order(family, pairs, delta)
    if found.merge_by_eps0:  # n plays no role: merge by eps0 (exact)
        groups = het.merge(groups, lambda n, eps0: (1, eps0))
    elif found.bucketed and len(groups) > het.HETEROGENEOUS_EXACT_GROUPS:
        lower = found.kind == "lower"
        extra = {
            "bucketed": {
                "groups_before": len(groups),
                "n_ratio": het.HETEROGENEOUS_N_GRID_RATIO,
                "eps0_ratio": het.HETEROGENEOUS_EPS0_GRID_RATIO,
            }
        }
        groups = het.merge(groups, lambda n, eps0: het.dominating_round(n, eps0, lower=lower))
    if len(groups) == 1:
        (n, eps0), count = next(iter(groups.items()))
        one = epsilon(family, eps0, n, delta, count, allow_approximate=allow_approximate)
        if not extra:
            return one
        return Bound(value=one.value, kind=one.kind, family=family, details={**one.details, **extra})
    items = [(n, eps0, count) for (n, eps0), count in groups.items()]
    total = sum(c for _, _, c in items)
    value, details = found.heterogeneous_epsilon(items, total, delta, allow_approximate)
    details = {**details, **extra, "groups": len(items), "rounds": total}
    if found.capped:
        by_eps0 = het.merge({(n, e): c for n, e, c in items}, lambda n, eps0: (1, eps0))
        if len(by_eps0) == 1:
            cap = lit.no_shuffle_epsilon(items[0][1], total, delta)
        else:
            merged = [(n, e, c) for (n, e), c in by_eps0.items()]
            cap, _ = fam.REGISTRY["no-shuffle"].heterogeneous_epsilon(merged, total, delta, allow_approximate)
        value, details = _capped(value, details, cap)
    return _bound(found, max(value, 0.0), details)


@functools.lru_cache(maxsize=1 << 16)
def _dominating_upper(n: int, eps0: float) -> tuple[int, float]:
    return het.dominating_round(n, eps0, lower=False)


def clones_in_order(
    family: str, pairs: Sequence[tuple[int, float]], delta: float, states: list[tuple[tuple, Any]] | None = None
) -> Bound:
    """A clone family's epsilon over rounds of several ``(n, eps0)`` groups: the rounds composed in order, one
    run of equal rounds at a time (:func:`shuffledp.accounting.composed.fold`), capped by ``no-shuffle``.

    With more than ``HETEROGENEOUS_EXACT_GROUPS`` groups each round is first moved to its dominating grid point
    (n DOWN, eps0 UP: :func:`shuffledp.accounting.heterogeneous.dominating_round`), as for the other bucketed
    families. ``states`` (the accountant's) holds ``(rounds as composed, composed state)`` pairs: the longest one
    that is a prefix of these rounds is extended instead of starting afresh, and the result is added to it (at
    most three kept). The value does not depend on ``states``: the composed state is a function of the rounds.

    Args:
        family: ``"clones"`` or ``"clones-focs"``.
        pairs: ``(n, eps0)`` of the rounds, in order, already validated (e.g. taken from ShuffleRound events).
        delta: 0 < delta < 1.
        states: composed states to start from and to keep, or None.

    Returns:
        A :class:`Bound` (details: ``groups``, ``rounds``, ``interval``, and ``bucketed`` when rounds were moved).
    """
    from shuffledp.accounting import composed
    from shuffledp.accounting.composition import pld_epsilon

    found = fam.lookup(family)
    distinct = set(pairs)
    extra: dict[str, Any] = {}
    if len(distinct) > het.HETEROGENEOUS_EXACT_GROUPS:
        moved = {p: _dominating_upper(*p) for p in distinct}
        pairs = [moved[p] for p in pairs]
        extra = {"bucketed": {"groups_before": len(distinct), "n_ratio": het.HETEROGENEOUS_N_GRID_RATIO,
                              "eps0_ratio": het.HETEROGENEOUS_EPS0_GRID_RATIO}}
    key = tuple(pairs)
    start, state = 0, None
    for prefix, kept in states or ():
        if start < len(prefix) <= len(key) and key[: len(prefix)] == prefix:
            start, state = len(prefix), kept
    state = composed.fold(pairs[start:], fam.CLONE_VARIANTS[found.name], state)
    if states is not None and start != len(key):
        states[:] = [(p, k) for p, k in states if p != key][-2:] + [(key, state)]
    value = pld_epsilon(state.delta_pld(), delta)
    details: dict[str, Any] = {
        "method": "pld, composed round by round",
        "discretisation": "pessimistic (mean-preserving spread, connect the dots; clone blocks at their lowest c)",
        "interval": state.h,
        **extra,
        "groups": len(set(pairs)),
        "rounds": len(pairs),
    }
    by_eps0: dict[float, int] = {}
    for _, e in pairs:
        by_eps0[e] = by_eps0.get(e, 0) + 1
    if len(by_eps0) == 1:
        (eps0,) = by_eps0
        # the cap binds only where no-shuffle's delta at this value is within delta: skip the root find otherwise
        if math.isfinite(value) and lit.no_shuffle_delta(eps0, len(pairs), value) > delta:
            cap = math.inf
        else:
            cap = lit.no_shuffle_epsilon(eps0, len(pairs), delta)
    else:
        merged = [(1, e, c) for e, c in by_eps0.items()]
        cap, _ = fam.REGISTRY["no-shuffle"].heterogeneous_epsilon(merged, len(pairs), delta, False)
    value, details = _capped(value, details, cap)
    return _bound(found, max(value, 0.0), details)


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

    The true composed epsilon of the clone pair lies in this bracket: the pessimistic spread over-, and the
    optimistic hull under-estimates every composed hockey-stick divergence, both to second order in the grid
    interval (:mod:`shuffledp.accounting.clone_spread`; Doroshenko et al., PETS 2022, "Connect the dots"). Uncapped.

    Raises:
        RefusedError: the grid cannot resolve ``rounds`` rounds
            (:func:`shuffledp.accounting.clone_spread.spread_interval`).

    Args:
        family: ``"clones"`` or ``"clones-focs"``.
        eps0: local privacy parameter, finite, > 0 and <= ``EPS0_MAX``.
        n: number of shuffled reports per round, an integer in ``[1, N_MAX]``.
        delta: 0 < delta < 1.
        rounds: number of rounds T >= 1.

    Returns:
        An :class:`EpsilonBracket` whose fields name which bound is which.
    """
    if family not in fam.CLONE_VARIANTS:
        raise RefusedError(f"epsilon_bracket is available for {list(fam.CLONE_VARIANTS)}, got {family!r}")
    eps0, n = _checked(eps0, n)
    delta, rounds = check_delta(delta), check_rounds(rounds)
    from shuffledp.accounting import clone_spread
    from shuffledp.accounting.composition import pld_epsilon

    variant = fam.CLONE_VARIANTS[family]
    out = []
    for pessimistic in (False, True):
        composed, _ = clone_spread.composed_clone_pld(eps0, n, rounds, variant, pessimistic=pessimistic)
        out.append(float(pld_epsilon(composed, delta, lower=not pessimistic)))
    return EpsilonBracket(lower=out[0], upper=out[1])
