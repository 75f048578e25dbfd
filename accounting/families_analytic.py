"""The families given by closed-form curves: mu-GDP (``ccg-gdp``, ``canonical-gdp``) and Renyi DP (``ccg-rdp``,
``girgis``, ``girgis-lower``).

Sources: Chen, Cao, Ge, "Renyi DP in the shuffle model: enhanced amplification bounds", ICASSP 2024 (seed 000);
Shvets, "Universal shuffle asymptotics: JSD and GDP", 2026 (seed 002); Girgis, Data, Diggavi, Suresh, Kairouz,
"On the Renyi differential privacy of the shuffle model", CCS 2021 (as printed in seed 000); Dong, Roth, Su,
"Gaussian differential privacy", JRSS-B 2022. The CLT families (``ccg-gdp``, ``ccg-rdp``, ``canonical-gdp``)
refuse where few clones are expected (:func:`shuffledp.accounting.literature.require_clt_regime`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from shuffledp.accounting.core import RefusedError
from shuffledp.accounting.family_base import Details, Family, Items, _lit, _rdp

__all__ = [
    "GdpFamily",
    "CcgGdpFamily",
    "CanonicalGdpFamily",
    "RdpFamily",
    "GirgisFamily",
    "GirgisLowerFamily",
    "CcgRdpFamily",
]


# ---------------------------------------------------------------------------------------------------------
# CLT families (approximate): a refusal rule on the expected number of clones
# ---------------------------------------------------------------------------------------------------------


def _clt_checked_delta(
    name: str,
    eps0: float,
    n: int,
    epsilon: float,
    allow_approximate: bool,
    compute: Callable[[], tuple[float, Details]],
) -> tuple[float, Details]:
    """A CLT family's delta, with the refusal rule applied to the answer before it is returned.

    A delta that underflowed to 0 is below the smallest float, so 2 ln(1/delta) > 2 ln(1/5e-324) ~ 1489 at least
    and is not known beyond that: the rule cannot be shown to hold, and the family refuses (unless
    allow_approximate).
    """
    if n < 2:
        raise RefusedError(f"{name} needs n >= 2 reports, got n={n}")
    value, details = compute()
    if value <= 0.0 and not allow_approximate:
        expected = n / (math.exp(eps0) + 1.0)
        raise RefusedError(
            f"{name} is a CLT approximation and is refused here: its delta at epsilon={epsilon} underflows "
            f"to 0 (below {math.ulp(0.0):.3g}), so the refusal rule n/(e^eps0+1) >= 2 ln(1/delta) (here "
            f"n/(e^eps0+1) = {expected:.4g}, and 2 ln(1/delta) > {2.0 * -math.log(math.ulp(0.0)):.4g}) cannot "
            "be shown to hold; in this regime it can fall below the true privacy loss. Use an upper family "
            "(clones) or pass allow_approximate=True to get the approximate value anyway."
        )
    if 0.0 < value < 1.0:
        _lit().require_clt_regime(name, eps0, n, value, allow_approximate)
    return value, details


class GdpFamily(Family):
    """A CLT family that is mu-GDP per round; T rounds compose to ``sqrt(sum mu^2)`` (Dong, Roth, Su, JRSS-B
    2022, Cor. 3.3) and the (eps, delta) curve is the exact GDP curve (ibid., Cor. 2.13)."""

    kind = "approximate"

    def mu(self, eps0: float, n: int) -> float:
        """The per-round mu.

        Args:
            eps0: local privacy parameter.
            n: reports per round.

        Returns:
            mu.
        """
        raise NotImplementedError(self.name)

    def check(self, eps0: float, n: int, delta: float, allow_approximate: bool) -> None:
        """Refuse where few clones are expected: n/(e^{eps0}+1) < 2 ln(1/delta) (see :meth:`Family.check`)."""
        _lit().require_clt_regime(self.name, eps0, n, delta, allow_approximate)

    def epsilon(self, eps0: float, n: int, delta: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """The GDP curve's epsilon at ``sqrt(T) mu`` (see :meth:`Family.epsilon`)."""
        self.check(eps0, n, delta, allow_approximate)
        mu = self.mu(eps0, n) * math.sqrt(rounds)
        return _lit().gdp_epsilon(mu, delta), {"mu": mu}

    def delta(self, eps0: float, n: int, epsilon: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """The GDP curve's delta at ``sqrt(T) mu``, refusal rule checked at it (see :meth:`Family.delta`)."""

        def compute() -> tuple[float, Details]:
            mu = self.mu(eps0, n) * math.sqrt(rounds)
            return _lit().gdp_delta(mu, epsilon), {"mu": mu}

        return _clt_checked_delta(self.name, eps0, n, epsilon, allow_approximate, compute)

    def heterogeneous_epsilon(
        self, items: Items, total: int, delta: float, allow_approximate: bool
    ) -> tuple[float, Details]:
        """The GDP curve's epsilon at ``sqrt(sum_g T_g mu_g^2)`` (see :meth:`Family.heterogeneous_epsilon`)."""
        for n, eps0, _ in items:
            self.check(eps0, n, delta, allow_approximate)
        mu = math.sqrt(sum(c * self.mu(eps0, n) ** 2 for n, eps0, c in items))
        return _lit().gdp_epsilon(mu, delta), {"mu": mu}


class CcgGdpFamily(GdpFamily):
    """``ccg-gdp``: Chen, Cao, Ge, ICASSP 2024 (seed 000), Theorem 2."""

    name = "ccg-gdp"

    def mu(self, eps0: float, n: int) -> float:
        """``2 e^{eps0/2} / sqrt(n - 1)`` (seed 000, Thm 2; see :meth:`GdpFamily.mu`)."""
        return _lit().ccg_gdp_mu(eps0, n)


class CanonicalGdpFamily(GdpFamily):
    """``canonical-gdp``: Shvets 2026 (seed 002), Theorem 17, for binary randomized response with eps0."""

    name = "canonical-gdp"

    def mu(self, eps0: float, n: int) -> float:
        """``sqrt(chi^2 / n)`` with ``chi^2 = 4 sinh(eps0/2)^2`` (seed 002 Sec. 9.3; see :meth:`GdpFamily.mu`)."""
        chi2 = 4.0 * math.sinh(eps0 / 2.0) ** 2  # binary randomized response, seed 002 Sec. 9.3
        return _lit().canonical_mu(chi2, n)


# ---------------------------------------------------------------------------------------------------------
# RDP families: Renyi curves summed over rounds, converted to (eps, delta)
# ---------------------------------------------------------------------------------------------------------


class RdpFamily(Family):
    """A family given by a Renyi-divergence curve: rounds add (Mironov, CSF 2017), and (eps, delta) comes from
    the improved conversion (:mod:`shuffledp.accounting.rdp`)."""

    has_renyi = True

    def rdp_curve(self, eps0: float, n: int) -> tuple[Any, Any]:
        """``(orders, one-round RDP)`` used in the (eps, delta) conversions.

        Args:
            eps0: local privacy parameter.
            n: reports per round.

        Returns:
            Two numpy arrays.
        """
        raise NotImplementedError(self.name)

    def epsilon(self, eps0: float, n: int, delta: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """The conversion of ``rounds`` times the curve (see :meth:`Family.epsilon`)."""
        self.check(eps0, n, delta, allow_approximate)
        orders, curve = self.rdp_curve(eps0, n)
        value, order = _rdp().epsilon_from_rdp(orders, rounds * curve, delta)
        return value, {"order": order}

    def _rdp_delta(self, eps0: float, n: int, epsilon: float, rounds: int) -> tuple[float, Details]:
        orders, curve = self.rdp_curve(eps0, n)
        value, order = _rdp().delta_from_rdp(orders, rounds * curve, epsilon)
        return value, {"order": order}

    def delta(self, eps0: float, n: int, epsilon: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """The conversion of ``rounds`` times the curve (see :meth:`Family.delta`)."""
        return self._rdp_delta(eps0, n, epsilon, rounds)

    def heterogeneous_epsilon(
        self, items: Items, total: int, delta: float, allow_approximate: bool
    ) -> tuple[float, Details]:
        """The conversion of the summed curves (see :meth:`Family.heterogeneous_epsilon`)."""
        rdp = _rdp()
        curves = []
        orders = None
        for n, eps0, c in items:
            self.check(eps0, n, delta, allow_approximate)
            orders, curve = self.rdp_curve(eps0, n)
            curves.append((curve, c))
        value, order = rdp.epsilon_from_rdp(orders, rdp.compose_rdp(curves), delta)
        return value, {"order": order}


class GirgisFamily(RdpFamily):
    """``girgis``: Girgis et al., CCS 2021, upper bound as printed in Chen, Cao, Ge, ICASSP 2024 (seed 000),
    eq. (5); integer orders >= 2."""

    name = "girgis"

    def rdp_curve(self, eps0: float, n: int) -> tuple[Any, Any]:
        """Seed 000 eq. (5) on the integer orders (see :meth:`RdpFamily.rdp_curve`)."""
        rdp = _rdp()
        orders = rdp.INTEGER_ORDERS
        return orders, rdp.rdp_curve(lambda a: _lit().girgis_rdp_upper(eps0, n, a), orders)

    def renyi(self, eps0: float, n: int, order: float) -> float:
        """Seed 000 eq. (5) (see :meth:`Family.renyi`)."""
        return _lit().girgis_rdp_upper(eps0, n, order)


class GirgisLowerFamily(Family):
    """``girgis-lower``: Girgis et al., CCS 2021, lower bound as printed in seed 000, eq. (6). Renyi only."""

    name = "girgis-lower"
    kind = "lower"
    eps_delta = False
    eps_delta_refusal = (
        "girgis-lower bounds a Renyi divergence from below; no (eps, delta) lower bound follows from it by the "
        "RDP conversion. Use it with renyi(), or use rr-lower for an (eps, delta) lower bound."
    )
    has_renyi = True
    capped = False

    def renyi(self, eps0: float, n: int, order: float) -> float:
        """Seed 000 eq. (6) (see :meth:`Family.renyi`)."""
        return _lit().girgis_rdp_lower(eps0, n, order)


#: Smallest order of the ``ccg-rdp`` curve (seed 000 Cor. 2 is stated for lambda >= 2).
_CCG_MIN_ORDER = 2.0
#: Up to this n, ccg-rdp's Renyi value is checked against the exact rr-lower divergence (about 1 s at the top).
CCG_RDP_CHECK_MAX_N = 2_000_000
#: Above it, ccg-rdp's Renyi value needs at least this many expected clones.
CCG_RDP_MIN_CLONES = 1000.0


class CcgRdpFamily(RdpFamily):
    """``ccg-rdp``: Chen, Cao, Ge, ICASSP 2024 (seed 000), Corollary 2, ``(lambda, 2 e^{eps0} lambda/(n-1))``-RDP
    for lambda >= 2; a CLT approximation with the same refusal rule as the GDP families."""

    name = "ccg-rdp"
    kind = "approximate"

    def check(self, eps0: float, n: int, delta: float, allow_approximate: bool) -> None:
        """Refuse where few clones are expected: n/(e^{eps0}+1) < 2 ln(1/delta) (see :meth:`Family.check`)."""
        _lit().require_clt_regime(self.name, eps0, n, delta, allow_approximate)

    def rdp_curve(self, eps0: float, n: int) -> tuple[Any, Any]:
        """Seed 000 Cor. 2 on the default orders >= 2 (see :meth:`RdpFamily.rdp_curve`)."""
        rdp = _rdp()
        orders = rdp.DEFAULT_ORDERS[rdp.DEFAULT_ORDERS >= _CCG_MIN_ORDER]
        return orders, rdp.rdp_curve(lambda a: _lit().ccg_rdp(eps0, n, a), orders)

    def delta(self, eps0: float, n: int, epsilon: float, rounds: int, allow_approximate: bool) -> tuple[float, Details]:
        """The conversion's delta, refusal rule checked at it (see :meth:`Family.delta`)."""
        return _clt_checked_delta(
            self.name, eps0, n, epsilon, allow_approximate, lambda: self._rdp_delta(eps0, n, epsilon, rounds)
        )

    def renyi(self, eps0: float, n: int, order: float) -> float:
        """Seed 000 Cor. 2; refuses orders below 2 (see :meth:`Family.renyi`), and where the approximation is
        not shown safe: below the exact Renyi divergence of shuffled binary randomized response (a lower bound on
        the truth; computed for n <= ``CCG_RDP_CHECK_MAX_N``), or, for larger n, with fewer than
        ``CCG_RDP_MIN_CLONES`` expected clones ``n / (e^eps0 + 1)``."""
        value = _lit().ccg_rdp(eps0, n, order)
        clones = n / (math.exp(min(eps0, 700.0)) + 1.0)
        if n <= CCG_RDP_CHECK_MAX_N:
            lower = _lit().rr_lower_renyi(eps0, n, order)
            if value < lower:
                raise RefusedError(
                    f"ccg-rdp's CLT approximation {value:.4g} at order {order:g} is below the exact Renyi divergence "
                    f"of shuffled binary randomized response, {lower:.4g}, a lower bound on the truth: it is outside "
                    f"its region of validity here ({clones:.3g} expected clones)")
        elif clones < CCG_RDP_MIN_CLONES:
            raise RefusedError(
                f"ccg-rdp's CLT approximation is not checked above n = {CCG_RDP_CHECK_MAX_N} and {clones:.3g} "
                f"expected clones (n / (e^eps0 + 1)) are fewer than {CCG_RDP_MIN_CLONES}: refused")
        return value
