"""The families composed through privacy loss distributions: the clone pairs (``clones``, ``clones-focs``,
``blanket-duchi``), ``fmt``, ``rr-lower``, ``no-shuffle``, ``blanket-laplace`` and ``blanket-privunit2``.

Sources: Feldman, McMillan, Talwar, "Hiding among the clones", FOCS 2021, and "Stronger privacy amplification by
shuffling for Renyi and approximate differential privacy", SODA 2023; Wang, Su, Ye, Shokri, Su, "Unified
enhancement of privacy bounds for mixture mechanisms via f-DP", NeurIPS 2023 (seed 003); Kairouz, Oh, Viswanath,
"The composition theorem for differential privacy", ICML 2015; Shvets, "Universal shuffle asymptotics: JSD and
GDP", 2026 (seed 002). The shared PLD pieces are in :mod:`shuffledp.accounting.composition`.
"""

from __future__ import annotations

import math
from typing import Any

from shuffledp.accounting.core import RefusedError
from shuffledp.accounting.family_base import Details, Family, Items, _clones, _comp, _lit, _pld

__all__ = [
    "CloneFamily",
    "FmtFamily",
    "RrLowerFamily",
    "NoShuffleFamily",
    "BlanketLaplaceFamily",
    "BlanketPrivUnit2Family",
    "BlanketDuchiFamily",
    "FMT_DELTA_FRACTIONS",
    "DELTA_SEARCH_RTOL",
    "DELTA_SEARCH_FLOOR",
]

#: Fractions f of delta spent on the per-round delta_1 = f delta / T when composing FMT over T > 1 rounds.
FMT_DELTA_FRACTIONS: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 0.9)
#: Relative tolerance of delta when a delta is found by bisection on epsilon (the ``fmt`` family).
DELTA_SEARCH_RTOL = 1e-9
#: Smallest delta the bisection of the ``fmt`` family's delta explores.
DELTA_SEARCH_FLOOR = 1e-300
#: How the clone families discretise composed rounds (:mod:`shuffledp.accounting.clone_spread`).
_SPREAD = "pessimistic (mean-preserving spread, connect the dots)"


# ---------------------------------------------------------------------------------------------------------
# Clone pairs (exact single round, pessimistic PLD composition)
# ---------------------------------------------------------------------------------------------------------


class CloneFamily(Family):
    """A clone pair of the clone reduction (FMT FOCS 2021 Thm 3.1; "stronger clones", FMT SODA 2023).

    ``variant="focs"`` (``clones-focs``) holds for every eps0-LDP randomizer (FOCS 2021 Thm 3.1, not among the
    results the SODA 2023 errata name). ``variant="stronger"`` (``clones``) rests on SODA 2023 Lemma 3.5 and
    Thms 3.1/3.2, whose proof for every eps0-LDP randomizer the paper's errata withdraw (they now hold for a
    restricted class of randomizers); no counterexample is known, and none of the project's randomizers is in the
    class as reconstructed in docs/accounting.md. The same pair is a rigorous bound for the ``duchi`` mechanism by
    another route (:class:`BlanketDuchiFamily`).

    Args:
        name: the family's name.
        variant: the pair, ``"stronger"`` or ``"focs"`` (:data:`shuffledp.accounting.clones.VARIANTS`).
    """

    has_renyi = True
    bucketed = True

    def __init__(self, name: str, variant: str) -> None:
        self.name = name
        self.variant = variant

    def _composed_pld(self, eps0: float, n: int, rounds: int) -> tuple[Any, float]:
        from shuffledp.accounting import clone_spread

        return clone_spread.composed_clone_pld(eps0, n, rounds, self.variant)

    def epsilon(self, eps0: float, n: int, delta: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """Exact for one round; pessimistic PLD composition for several (see :meth:`Family.epsilon`)."""
        if rounds == 1:
            return float(_clones().clone_epsilon(eps0, n, delta, self.variant)), {"method": "exact"}
        composed, interval = self._composed_pld(eps0, n, rounds)
        value = _comp().pld_epsilon(composed, delta)
        return value, {"method": "pld", "discretisation": _SPREAD, "interval": interval}

    def delta(self, eps0: float, n: int, epsilon: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """Exact for one round; pessimistic PLD composition for several (see :meth:`Family.delta`)."""
        if rounds == 1:
            return float(_clones().clone_delta(eps0, n, epsilon, self.variant)), {"method": "exact"}
        composed, interval = self._composed_pld(eps0, n, rounds)
        return float(_pld().delta_for_epsilon(composed, epsilon)), {
            "method": "pld",
            "discretisation": _SPREAD,
            "interval": interval,
        }

    def renyi(self, eps0: float, n: int, order: float) -> float:
        """Exact Renyi divergence of the pair, max of both directions (see :meth:`Family.renyi`)."""
        return float(_clones().clone_renyi(eps0, n, order, self.variant))

    def heterogeneous_epsilon(
        self, items: Items, total: int, delta: float, allow_approximate: bool
    ) -> tuple[float, Details]:
        """The groups composed in the given order, one run at a time (:func:`shuffledp.accounting.composed.fold`,
        the accountant's composition; see :meth:`Family.heterogeneous_epsilon`)."""
        from shuffledp.accounting import composed

        state = composed.ComposedClones(self.variant)
        for n, eps0, count in items:
            state = state.extended(n, eps0, count)
        return _comp().pld_epsilon(state.delta_pld(), delta), {
            "method": "pld, composed round by round",
            "discretisation": _SPREAD,
            "interval": state.h,
        }


# ---------------------------------------------------------------------------------------------------------
# The remaining families: FMT, rr-lower, no-shuffle
# ---------------------------------------------------------------------------------------------------------


class FmtFamily(Family):
    """``fmt``: Feldman, McMillan, Talwar, FOCS 2021, Theorem 3.1, inside its validity region only."""

    name = "fmt"
    bucketed = True

    def check(self, eps0: float, n: int, delta: float, allow_approximate: bool) -> None:
        """Refuse outside eps0 <= log(n / (16 log(4/delta))) (see :meth:`Family.check`)."""
        _lit().require_fmt_valid(eps0, n, delta)

    def epsilon(self, eps0: float, n: int, delta: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """Thm 3.1 per round at delta_1 = f delta / T, composed by KOV Thm 3.3, best f of
        :data:`FMT_DELTA_FRACTIONS` (see :meth:`Family.epsilon`)."""
        lit = _lit()
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

    def delta(self, eps0: float, n: int, epsilon: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """Smallest delta (to DELTA_SEARCH_RTOL, rounded up) whose fmt epsilon is <= ``epsilon``: bisection on
        log delta (see :meth:`Family.delta`).

        fmt's epsilon decreases in delta and its validity region grows with delta, so "certified at delta" is
        monotone; the returned delta is one at which the certificate was checked. If eps0 is valid but FMT's
        epsilon exceeds the target for every delta < 1, the answer is the vacuous delta = 1 (flagged
        ``vacuous``); if eps0 is outside the validity region even as delta -> 1, RefusedError.
        """

        def ok(d: float) -> bool:
            try:
                return self.epsilon(eps0, n, d, rounds, allow_approximate)[0] <= epsilon
            except RefusedError:
                return False

        hi = 1.0 - 1e-12
        if not ok(hi):
            self.epsilon(eps0, n, hi, rounds, allow_approximate)  # raises RefusedError outside the validity region
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

    def heterogeneous_epsilon(
        self, items: Items, total: int, delta: float, allow_approximate: bool
    ) -> tuple[float, Details]:
        """Thm 3.1 per round at delta/(2T), PLDs of the (eps, delta) worst case composed (see
        :meth:`Family.heterogeneous_epsilon`)."""
        comp = _comp()
        delta1 = 0.5 * delta / total
        per_round = [(_lit().fmt_epsilon(eps0, n, delta1), c) for n, eps0, c in items]
        interval = comp.pair_interval(per_round)
        plds = [(comp.rr_pair_pld(eps1, delta1, interval), c) for eps1, c in per_round]
        return comp.pld_epsilon(_pld().compose(plds), delta), {
            "method": "FMT'21 Thm 3.1 per round at delta/(2T), PLD of the (eps, delta) worst case",
            "discretisation": "pessimistic",
            "interval": interval,
        }


class RrLowerFamily(Family):
    """``rr-lower``: the exact loss of shuffled binary randomized response, the others holding 0 (a lower bound
    for every eps0-LDP randomizer); the likelihood ratio of Shvets 2026 (seed 002), Lemma 3."""

    name = "rr-lower"
    kind = "lower"
    has_renyi = True
    capped = False
    bucketed = True

    def _composed(self, eps0: float, n: int, rounds: int) -> Any:
        return _pld().compose([(_comp().rr_lower_pld(eps0, n, rounds), rounds)])

    def epsilon(self, eps0: float, n: int, delta: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """Exact for one round; optimistic PLD composition for several (see :meth:`Family.epsilon`)."""
        if rounds == 1:
            return _lit().rr_lower_epsilon(eps0, n, delta), {"method": "exact"}
        value = _comp().pld_epsilon(self._composed(eps0, n, rounds), delta, lower=True)
        slack = rounds * self._interval(eps0, n, rounds)
        if slack >= value:
            # Still a lower bound, but one the grid cannot resolve: rounding each of the T losses down by up to
            # one interval can lower the value by up to T intervals, more than the value itself (it then falls
            # as T grows: 68.7 at T = 1e6, 0.0 at 1e7 for n = 1e4, eps0 = 1, delta = 1e-6). Refused instead.
            raise RefusedError(
                f"rr-lower cannot resolve {rounds} rounds: its optimistic grid may round the composed loss down by "
                f"up to {slack:.3g} (rounds x interval), more than the value {value:.3g} it finds; no lower bound "
                "is reported (fewer rounds, or the single-round value, are resolved)")
        return value, {"method": "pld", "discretisation": "optimistic", "rounding_slack": slack}

    @staticmethod
    def _interval(eps0: float, n: int, rounds: int) -> float:
        """The grid interval :func:`shuffledp.accounting.composition.rr_lower_pld` uses for ``rounds``."""
        return _comp().rr_interval(eps0, n, rounds)

    def delta(self, eps0: float, n: int, epsilon: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """Exact for one round; optimistic PLD composition for several (see :meth:`Family.delta`)."""
        if rounds == 1:
            return _lit().rr_lower_delta(eps0, n, epsilon), {"method": "exact"}
        value = float(_pld().delta_for_epsilon(self._composed(eps0, n, rounds), epsilon))
        return value, {"method": "pld", "discretisation": "optimistic"}

    def renyi(self, eps0: float, n: int, order: float) -> float:
        """Exact Renyi divergence, max of both directions (see :meth:`Family.renyi`)."""
        return _lit().rr_lower_renyi(eps0, n, order)

    def heterogeneous_epsilon(
        self, items: Items, total: int, delta: float, allow_approximate: bool
    ) -> tuple[float, Details]:
        """Optimistic PLDs of every group on one grid, composed (see :meth:`Family.heterogeneous_epsilon`)."""
        comp = _comp()
        # no finer than the widest group's loss span (at most 2 eps0) over MAX_COMPOSED_GRID: a coarser optimistic
        # grid only lowers the value, so it stays a lower bound (as for clones, see composition.clone_interval)
        span = max(2.0 * eps0 for _, eps0, _ in items)
        floor = max(
            max(comp.rr_interval_floor(eps0, n, total) for n, eps0, _ in items), span / _clones().MAX_COMPOSED_GRID
        )
        interval = max(min(comp.rr_interval(eps0, n, total) for n, eps0, _ in items), floor)
        plds = [(comp.rr_lower_pld(eps0, n, total, interval), c) for n, eps0, c in items]
        value = comp.pld_epsilon(_pld().compose(plds), delta, lower=True)
        slack = total * interval
        if slack >= value:  # as in epsilon(): a value the grid cannot resolve is refused
            raise RefusedError(
                f"rr-lower cannot resolve {total} rounds: its optimistic grid may round the composed loss down by "
                f"up to {slack:.3g} (rounds x interval), more than the value {value:.3g} it finds; no lower bound "
                "is reported")
        return value, {
            "method": "pld",
            "discretisation": "optimistic",
            "interval": interval,
        }


class NoShuffleFamily(Family):
    """``no-shuffle``: every report eps0-DP seen by the server, rounds composed optimally (Kairouz, Oh,
    Viswanath, ICML 2015, Theorem 3.3). Exact, and the cap of every other non-lower family."""

    name = "no-shuffle"
    capped = False
    merge_by_eps0 = True

    def epsilon(self, eps0: float, n: int, delta: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """KOV's exact epsilon (see :meth:`Family.epsilon`)."""
        return _lit().no_shuffle_epsilon(eps0, rounds, delta), {"method": "exact (Kairouz-Oh-Viswanath)"}

    def delta(self, eps0: float, n: int, epsilon: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """KOV's exact delta (see :meth:`Family.delta`)."""
        return _lit().no_shuffle_delta(eps0, rounds, epsilon), {"method": "exact (Kairouz-Oh-Viswanath)"}

    def heterogeneous_epsilon(
        self, items: Items, total: int, delta: float, allow_approximate: bool
    ) -> tuple[float, Details]:
        """PLDs of randomized response with each eps0, composed (see :meth:`Family.heterogeneous_epsilon`)."""
        comp = _comp()
        interval = comp.pair_interval([(eps0, c) for _, eps0, c in items])
        plds = [(comp.rr_pair_pld(eps0, 0.0, interval), c) for n, eps0, c in items]
        return comp.pld_epsilon(_pld().compose(plds), delta), {
            "method": "pld of randomized response (KOV worst case)",
            "discretisation": "pessimistic",
            "interval": interval,
        }


# ---------------------------------------------------------------------------------------------------------
# Mechanism-aware: the privacy blanket of the project's discrete Laplace randomizer
# ---------------------------------------------------------------------------------------------------------


class BlanketLaplaceFamily(Family):
    """``blanket-laplace``: the privacy blanket of the project's discrete Laplace randomizer (Balle, Bell, Gascon,
    Nissim, "The privacy blanket of the shuffle model", CRYPTO 2019), blanket mass e^{-eps0/2}, likelihood ratios
    spread to the corners of [e^{-eps0/2}, e^{eps0/2}]^2 (:mod:`shuffledp.accounting.blanket`; derivation in
    docs/accounting.md). An upper bound for reports of :class:`shuffledp.clients.randomizer.DiscreteLaplaceRandomizer`
    only (any dimension, clip and grid); not for any other eps0-LDP randomizer."""

    name = "blanket-laplace"
    bucketed = True
    mechanism = "laplace"
    restriction = (
        "reports of the project's discrete Laplace randomizer (DiscreteLaplaceRandomizer: L1 clip, integer "
        "projection, discrete Laplace of scale 2C/eps0) at this eps0, in any dimension d, for any clip C and grid; "
        "not other eps0-LDP randomizers")

    def _box(self, eps0: float) -> tuple[float, float | None]:
        """The blanket pair's ``(eps0, lo)`` for reports at ``eps0``: the box ``[lo, e^eps0 lo]`` of their
        likelihood ratios, lo None for the discrete Laplace's ``e^{-eps0/2}``."""
        return eps0, None

    def _details(self, **extra: Any) -> Details:
        return {"mechanism": self.mechanism, "restriction": self.restriction, **extra}

    def epsilon(self, eps0: float, n: int, delta: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """Exact on the dominating pair for one round; pessimistic PLD composition for several."""
        from shuffledp.accounting import blanket

        e, lo = self._box(eps0)
        if rounds == 1:
            return blanket.blanket_epsilon(e, n, delta, lo=lo), self._details(method="exact on the dominating pair")
        composed, interval = blanket.composed_blanket_pld([(n, e, rounds, lo)])
        value = _comp().pld_epsilon(composed, delta)
        return value, self._details(method="pld", discretisation=_SPREAD, interval=interval)

    def delta(self, eps0: float, n: int, epsilon: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """Exact on the dominating pair for one round; pessimistic PLD composition for several."""
        from shuffledp.accounting import blanket

        e, lo = self._box(eps0)
        if rounds == 1:
            return blanket.blanket_delta(e, n, epsilon, lo=lo), self._details(method="exact on the dominating pair")
        composed, interval = blanket.composed_blanket_pld([(n, e, rounds, lo)])
        value = float(_pld().delta_for_epsilon(composed, epsilon))
        return value, self._details(method="pld", discretisation=_SPREAD, interval=interval)

    def heterogeneous_epsilon(
        self, items: Items, total: int, delta: float, allow_approximate: bool
    ) -> tuple[float, Details]:
        """The groups' PLDs on one grid, composed (see :meth:`Family.heterogeneous_epsilon`)."""
        from shuffledp.accounting import blanket

        boxes = [(n, self._box(eps0), count) for n, eps0, count in items]
        composed, interval = blanket.composed_blanket_pld([(n, e, count, lo) for n, (e, lo), count in boxes])
        value = _comp().pld_epsilon(composed, delta)
        return value, self._details(method="pld", discretisation=_SPREAD, interval=interval)


class BlanketPrivUnit2Family(BlanketLaplaceFamily):
    """``blanket-privunit2``: the privacy blanket (Balle, Bell, Gascon, Nissim, CRYPTO 2019) of the project's
    PrivUnit2 (Bhowmick, Duchi, Freudiger, Kapoor, Rogers 2018; :class:`shuffledp.clients.privunit.
    PrivUnit2Mechanism`). Its eps0 split depends on eps0 alone, so every report's likelihood ratio against the
    uniform law on the sphere lies in the d-free box ``[lo, e^log_ratio lo]`` of
    :func:`shuffledp.accounting.privunit_box.privunit_blanket_box` (``lo`` about ``(1 + e^{-2 eps0/3}) /
    (1 + e^{eps0/3})``, widened by a relative 1e-9), every report has blanket mass ``lo``, and the corner pair of
    that box (:mod:`shuffledp.accounting.blanket`, evaluated at ``log_ratio`` and ``lo``) dominates the shuffled
    output. The box grows with eps0, so rounds may be bucketed to a larger eps0. An upper bound for reports of that
    mechanism only (any d and L2 clip); not for any other eps0-LDP randomizer."""

    name = "blanket-privunit2"
    mechanism = "privunit2"
    restriction = (
        "reports of the project's PrivUnit2 (PrivUnit2Mechanism: L2 clip, the eps0 split of privunit_split, "
        "eps_cap = 2 eps0/3) at this eps0, in any dimension d and for any clip C; not other eps0-LDP randomizers")

    def _box(self, eps0: float) -> tuple[float, float | None]:
        """``(log_ratio, lo)`` of :func:`shuffledp.accounting.privunit_box.privunit_blanket_box`."""
        from shuffledp.accounting.privunit_box import privunit_blanket_box

        lo, log_ratio = privunit_blanket_box(eps0)
        return log_ratio, lo


# ---------------------------------------------------------------------------------------------------------
# Mechanism-aware: the privacy blanket of the project's Duchi et al. mechanism (the stronger clone pair)
# ---------------------------------------------------------------------------------------------------------


class BlanketDuchiFamily(CloneFamily):
    """``blanket-duchi``: the privacy blanket (Balle, Bell, Gascon, Nissim, "The privacy blanket of the shuffle
    model", CRYPTO 2019) of the project's Duchi, Jordan, Wainwright mechanism (:class:`shuffledp.clients.duchi.
    DuchiMechanism`), whose dominating pair is exactly the stronger clone pair of ``clones``.

    Derivation (docs/accounting.md, "What `clones` rests on"): the report is ``(seed, b)``; against the base law
    omega = (the seed's law) x (a fair bit), its likelihood ratio is ``2 P[b | seed, x]``, and the flip probability
    is clamped into ``[p_lo, p_hi]`` with ``p_lo >= 1/(E+1)``, ``p_hi <= E/(E+1)`` for a certified ``E <= e^eps0``
    (:func:`shuffledp.clients.coins.rr_interval`). So every input's ratio lies in the box
    ``[lo, hi] = [2/(e^eps0+1), 2 e^eps0/(e^eps0+1)]`` and every report has blanket mass ``lo``. The blanket argument
    (reveal the blanket; spread each ratio pair to the corners of the box) gives, since ``lo + hi = 2``, the corner
    law H = (hi, lo), L = (lo, hi) with probability 1/2 each, and counting H among the blanket draws and the attacked
    report is the pair C ~ Bin(n-1, 2/(e^eps0+1)), X = A + D of Feldman, McMillan, Talwar, SODA 2023 (and Wang et
    al., NeurIPS 2023): the same numbers as ``clones``, without SODA 2023 Lemma 3.5. An upper bound for reports of
    that mechanism only (any dimension and L2 clip); not for any other eps0-LDP randomizer.
    """

    mechanism = "duchi"
    restriction = (
        "reports of the project's Duchi et al. mechanism (DuchiMechanism: L2 clip, a data-independent direction "
        "sent as a seed, one exactly drawn randomized-response bit) at this eps0, in any dimension d and for any "
        "clip C; not other eps0-LDP randomizers")

    def __init__(self) -> None:
        super().__init__("blanket-duchi", "stronger")

    def _details(self, details: Details) -> Details:
        return {"mechanism": self.mechanism, "restriction": self.restriction, **details}

    def epsilon(self, eps0: float, n: int, delta: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """The stronger clone pair's epsilon (see :meth:`CloneFamily.epsilon`), with the restriction in details."""
        value, details = super().epsilon(eps0, n, delta, rounds, allow_approximate)
        return value, self._details(details)

    def delta(self, eps0: float, n: int, epsilon: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """The stronger clone pair's delta (see :meth:`CloneFamily.delta`), with the restriction in details."""
        value, details = super().delta(eps0, n, epsilon, rounds, allow_approximate)
        return value, self._details(details)

    def heterogeneous_epsilon(
        self, items: Items, total: int, delta: float, allow_approximate: bool
    ) -> tuple[float, Details]:
        """As :meth:`CloneFamily.heterogeneous_epsilon`, with the restriction in details. Moving a round to a
        larger eps0 or a smaller n dominates it here too: the box grows with eps0, and one more report is
        post-processing."""
        value, details = super().heterogeneous_epsilon(items, total, delta, allow_approximate)
        return value, self._details(details)
