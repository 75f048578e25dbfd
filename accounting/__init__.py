"""shuffledp accounting: privacy accounting for the shuffle model of differential privacy.

This module is deliberately light: it defines the three names of the contract (``Bound``, ``RefusedError``,
``FAMILIES``) and imports nothing beyond the standard library. The numerical work lives in
:mod:`shuffledp.accounting.bounds` (the dispatcher), :mod:`shuffledp.accounting.literature` (the published bounds),
:mod:`shuffledp.accounting.rdp` (Renyi accounting), :mod:`shuffledp.accounting.clones` and :mod:`shuffledp.accounting.pld` (the exact clone
analysis and privacy-loss-distribution composition) and :mod:`shuffledp.accounting.mechanisms` (randomizer descriptions).

Kinds of a :class:`Bound`:

* ``"upper"``: a guarantee; the true privacy loss of the shuffled protocol is at most this value.
* ``"approximate"``: an asymptotic (CLT) value; it can fall below the truth and is not a guarantee.
* ``"lower"``: the privacy loss of a concrete instance; no valid guarantee for general eps0-LDP randomizers
  can be smaller.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, ROUND_FLOOR, ROUND_HALF_EVEN, Context, Decimal
from typing import Any

__all__ = [
    "Bound", "RefusedError", "FAMILIES", "KINDS", "KIND_WORDS", "FAMILY_KINDS", "EPS0_MAX", "N_MAX", "format_bound",
]

#: Largest eps0 any bound accepts (e^100 ~ 2.7e43 keeps every formula in range); events and bounds share it.
EPS0_MAX = 100.0
#: Largest number of shuffled reports per round the exact clone analysis accepts.
N_MAX = 10**9

#: Bound families accepted by :mod:`shuffledp.accounting.bounds` (``"girgis-lower"`` is accepted as well where a
#: lower bound of Girgis et al. is meaningful, i.e. for Renyi divergences).
FAMILIES: tuple[str, ...] = (
    "clones",
    "clones-focs",
    "ccg-gdp",
    "ccg-rdp",
    "girgis",
    "fmt",
    "rr-lower",
    "canonical-gdp",
    "no-shuffle",
)

KINDS: tuple[str, ...] = ("upper", "approximate", "lower")

#: How each kind is named next to a printed number ("epsilon 4.18 (clones, upper bound)").
KIND_WORDS: Mapping[str, str] = {"upper": "upper bound", "approximate": "approximation", "lower": "lower bound"}

#: The kind of every family (including ``girgis-lower``).
FAMILY_KINDS: Mapping[str, str] = {
    "clones": "upper",
    "clones-focs": "upper",
    "ccg-gdp": "approximate",
    "ccg-rdp": "approximate",
    "girgis": "upper",
    "girgis-lower": "lower",
    "fmt": "upper",
    "rr-lower": "lower",
    "canonical-gdp": "approximate",
    "no-shuffle": "upper",
}


class RefusedError(ValueError):
    """A bound family refuses these parameters.

    Raised when the parameters are valid numbers but lie outside the region where the family's formula holds
    (e.g. FMT'21 Theorem 3.1 outside ``eps0 <= log(n / (16 log(2/delta)))``), or when a CLT approximation is
    asked for where it is known to be unsafe and ``allow_approximate`` was not given. The message says why
    and what would be accepted.
    """


@dataclass(frozen=True)
class Bound:
    """One privacy figure with its provenance.

    Attributes:
        value: the number (an epsilon, a delta, a Renyi divergence, or a calibrated eps0).
        kind: ``"upper"``, ``"approximate"`` or ``"lower"`` (see the module docstring).
        family: the bound family that produced it (one of :data:`FAMILIES` or ``"girgis-lower"``).
        details: JSON-friendly extra information (e.g. the optimistic/pessimistic bracket of a PLD, the Renyi
            order chosen by a conversion, whether the no-shuffle cap was applied).
    """

    value: float
    kind: str
    family: str
    details: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Bound.kind must be one of {KINDS}, got {self.kind!r}")
        if self.family not in FAMILY_KINDS:
            raise ValueError(f"Bound.family must be one of {tuple(FAMILY_KINDS)}, got {self.family!r}")
        value = float(self.value)
        if math.isnan(value):
            raise ValueError(f"Bound.value must not be NaN (family {self.family!r})")
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "details", dict(self.details))


def format_bound(value: float, kind: str, *, significant: int | None = None, decimals: int | None = None) -> str:
    """``value`` as text, rounded *outward* for a bound: up for an ``"upper"`` bound, down for a ``"lower"``
    one, to nearest otherwise; to ``significant`` digits (``g`` style, default 10) or to ``decimals`` places.
    A printed upper bound is then never below the bound, nor a lower bound above it (the rounding of the
    decimal expansion of the exact binary value, so no second rounding). Non-finite values print as Python does.
    """
    if significant is not None and decimals is not None:
        raise ValueError("give significant or decimals, not both")
    digits = 10 if significant is None else significant
    if not 1 <= digits <= 15:
        raise ValueError(f"significant must be in [1, 15] (float64 holds them exactly), got {digits}")
    if decimals is not None and not 0 <= decimals <= 30:
        raise ValueError(f"decimals must be in [0, 30], got {decimals}")
    if not math.isfinite(value):
        return repr(float(value))
    rounding = {"upper": ROUND_CEILING, "lower": ROUND_FLOOR}.get(kind, ROUND_HALF_EVEN)
    exact = Decimal(float(value))  # exact: no context rounding before the directed one
    if exact.is_zero():
        exact = Decimal(0)  # -0.0 prints as 0
    if decimals is not None:
        context = Context(prec=400)  # enough for every float64 to the given decimals (1e308 has 309 digits)
        return f"{exact.quantize(Decimal(1).scaleb(-decimals), rounding=rounding, context=context):f}"
    if exact == 0:
        return "0"
    rounded = exact.quantize(Decimal(1).scaleb(exact.adjusted() - digits + 1), rounding=rounding)
    # ``rounded`` has at most ``digits`` <= 15 significant digits, so the nearest float prints back as exactly it
    return format(float(rounded), f".{digits}g")
