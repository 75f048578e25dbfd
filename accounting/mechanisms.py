"""Immutable descriptions of local randomizers and their local privacy parameter ``eps0``.

Shuffle amplification (every family in :mod:`shuffledp.accounting.bounds`) needs only that each report is ``eps0``-LDP:
for ANY two inputs of its sender the output distributions are within a factor ``e^{eps0}``. These classes say
what ``eps0`` a randomizer has; they draw no randomness (sampling lives in ``shuffledp.clients.randomizer``).

* :class:`LocalRandomizer`: a general ``eps0``-LDP randomizer (eps0 given).
* :class:`LaplaceRandomizer`: d-dimensional Laplace noise of scale ``b`` added to a report clipped to L1 norm
  ``C``. Two clipped reports differ by at most ``2C`` in L1 (the diameter of the clip ball), so by the Laplace
  mechanism (Dwork-Roth 2014, Thm 3.6) ``eps0 = 2C / b``. ``eps0`` is derived, never typed in a second time.
  (The Algorithm 1 of Chen, Cao, Ge, ICASSP 2024, seed 000, uses one record's sensitivity ``2C/m`` instead: that
  is not LDP for the report.)
* :class:`BinaryRandomizedResponse` and :class:`KaryRandomizedResponse`: ``k``-ary randomized response
  (Warner 1965; Kairouz-Oh-Viswanath 2016) keeps its input with probability ``e^{eps0}/(e^{eps0}+k-1)`` and
  outputs each other symbol with probability ``1/(e^{eps0}+k-1)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shuffledp.accounting.core import EPS0_MAX
from shuffledp.accounting.validation import check_eps0, check_integer, check_real

__all__ = [
    "LocalRandomizer",
    "LaplaceRandomizer",
    "KaryRandomizedResponse",
    "BinaryRandomizedResponse",
]


def _positive_finite(name: str, value: Any) -> float:
    """Return ``value`` as a finite float > 0 or raise saying what is allowed."""
    allowed = "a finite real number > 0"
    out = check_real(name, value, allowed)
    if not math.isfinite(out) or out <= 0.0:
        raise ValueError(f"{name} must be {allowed}, got {out!r}")
    return out


def _eps0(value: Any) -> float:
    """``value`` as an LDP parameter: finite, > 0 and at most :data:`accounting.EPS0_MAX` (the range every bound
    accepts; beyond it, e^{eps0} powers in the chi^2 and mu_3 formulas overflow)."""
    return check_eps0(value)


def _integer_at_least(name: str, value: Any, minimum: int) -> int:
    """Return ``value`` as an int >= ``minimum`` or raise saying what is allowed."""
    return check_integer(name, value, minimum)


@dataclass(frozen=True)
class LocalRandomizer:
    """A general ``eps0``-LDP local randomizer (pure local differential privacy with parameter ``eps0``).

    Attributes:
        eps0: finite, > 0.
    """

    eps0: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps0", _eps0(self.eps0))


@dataclass(frozen=True)
class LaplaceRandomizer:
    """Laplace noise of scale ``b`` on each of ``d`` coordinates of a report clipped to L1 norm ``clip_l1``.

    The report space is the L1 ball of radius ``C``; its L1 diameter is ``2C``, so the randomizer is
    ``eps0 = 2C/b``-LDP (Laplace mechanism, Dwork-Roth 2014, Theorem 3.6, with sensitivity ``2C``).

    Attributes:
        clip_l1: the L1 clip ``C`` > 0.
        noise_scale: the Laplace scale ``b`` > 0 (density proportional to ``exp(-|x|/b)`` per coordinate).
        dimension: ``d`` >= 1.
    """

    clip_l1: float
    noise_scale: float
    dimension: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "clip_l1", _positive_finite("clip_l1 (L1 clip C)", self.clip_l1))
        object.__setattr__(self, "noise_scale", _positive_finite("noise_scale (Laplace scale b)", self.noise_scale))
        object.__setattr__(self, "dimension", _integer_at_least("dimension d", self.dimension, 1))
        if not self.eps0 <= EPS0_MAX:
            raise ValueError(
                f"clip_l1 / noise_scale is too large: eps0 = 2C/b must be <= {EPS0_MAX:g} (accounting.EPS0_MAX), "
                f"got C={self.clip_l1!r}, b={self.noise_scale!r}"
            )

    @property
    def eps0(self) -> float:
        """``2 C / b``: the LDP parameter (the L1 diameter of the clip ball over the noise scale)."""
        return 2.0 * self.clip_l1 / self.noise_scale

    @classmethod
    def for_eps0(cls, eps0: float, clip_l1: float, dimension: int = 1) -> LaplaceRandomizer:
        """The Laplace randomizer with L1 clip ``clip_l1`` that is exactly ``eps0``-LDP: ``b = 2C/eps0``."""
        eps0 = _eps0(eps0)
        clip = _positive_finite("clip_l1 (L1 clip C)", clip_l1)
        return cls(clip_l1=clip, noise_scale=2.0 * clip / eps0, dimension=dimension)


@dataclass(frozen=True)
class KaryRandomizedResponse:
    """``k``-ary randomized response with parameter ``eps0`` (Kairouz-Oh-Viswanath 2016, Sec. 3).

    Attributes:
        eps0: finite, > 0.
        k: alphabet size, an integer >= 2.
    """

    eps0: float
    k: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps0", _eps0(self.eps0))
        object.__setattr__(self, "k", _integer_at_least("k (alphabet size)", self.k, 2))

    @property
    def p_keep(self) -> float:
        """Probability of reporting the true symbol: ``e^{eps0} / (e^{eps0} + k - 1)``."""
        # 1 / (1 + (k-1) e^{-eps0}): no overflow for large eps0.
        return 1.0 / (1.0 + (self.k - 1) * math.exp(-self.eps0))

    @property
    def p_other(self) -> float:
        """Probability of reporting one given other symbol: ``1 / (e^{eps0} + k - 1)``."""
        return math.exp(-self.eps0) / (1.0 + (self.k - 1) * math.exp(-self.eps0))

    def output_distribution(self, x: int) -> tuple[float, ...]:
        """The output probabilities ``W_x(y)`` for ``y = 0..k-1`` given input ``x`` in ``0..k-1``."""
        x = _integer_at_least("x (input symbol)", x, 0)
        if x >= self.k:
            raise ValueError(f"x (input symbol) must be in 0..{self.k - 1}, got {x}")
        return tuple(self.p_keep if y == x else self.p_other for y in range(self.k))

    @property
    def chi2(self) -> float:
        """``chi^2(W_1 || W_0) = (p - q)^2 (1/p + 1/q)``.

        Shvets, "Universal shuffle asymptotics: JSD and GDP", 2026 (seed 002), eq. (15).

        For ``k = 2`` this equals ``(e^{eps0}-1)^2 / e^{eps0} = 4 sinh^2(eps0/2)`` (seed 002, Sec. 9.3).
        Computed as ``(1 - e^{-eps0})^2 (p/q + ... )`` in a form without cancellation: with ``p = e^{eps0} q``,
        ``(p-q)^2 (1/p + 1/q) = q (e^{eps0} - 1)^2 (1 + e^{-eps0})``.
        """
        q = self.p_other
        return q * math.expm1(self.eps0) ** 2 * (1.0 + math.exp(-self.eps0))

    @property
    def mu3(self) -> float:
        """``mu_3 = E_{W_0}[(W_1/W_0 - 1)^3] = (p - q)^3 (1/q^2 - 1/p^2)`` (seed 002, Sec. 5.2 with eq. (6)).

        With ``p = e^{eps0} q``: ``(p-q)^3 (1/q^2 - 1/p^2) = q (e^{eps0}-1)^3 (1 - e^{-2 eps0})``.
        """
        q = self.p_other
        return q * math.expm1(self.eps0) ** 3 * (-math.expm1(-2.0 * self.eps0))


@dataclass(frozen=True)
class BinaryRandomizedResponse:
    """Binary randomized response with parameter ``eps0``: keep the bit w.p. ``e^{eps0}/(e^{eps0}+1)``.

    Attributes:
        eps0: finite, > 0.
    """

    eps0: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps0", _eps0(self.eps0))

    @property
    def flip_probability(self) -> float:
        """``q = 1 / (e^{eps0} + 1)``."""
        return 1.0 / (math.exp(self.eps0) + 1.0) if self.eps0 < 700 else math.exp(-self.eps0)

    @property
    def chi2(self) -> float:
        """``chi^2(W_1 || W_0) = (e^{eps0} - 1)^2 / e^{eps0} = 4 sinh^2(eps0 / 2)`` (seed 002, Sec. 9.3)."""
        return 4.0 * math.sinh(self.eps0 / 2.0) ** 2

    @property
    def mu3(self) -> float:
        """``mu_3 = E_{W_0}[(W_1/W_0 - 1)^3] = chi^4`` for binary randomized response (seed 002, eq. (14))."""
        return self.chi2**2

    def as_kary(self) -> KaryRandomizedResponse:
        """The same randomizer as a ``k = 2`` :class:`KaryRandomizedResponse`."""
        return KaryRandomizedResponse(eps0=self.eps0, k=2)
