"""shuffledp accounting: privacy accounting for the shuffle model of differential privacy.

This module is deliberately light: it holds the names of the contract (``Bound``, ``RefusedError``, ``FAMILIES``)
and imports nothing beyond the standard library and two standard-library-only modules of its own:
:mod:`shuffledp.accounting.core` (limits, kinds, ``RefusedError``) and :mod:`shuffledp.accounting.families` (the
registry of bound families, one object per family; its numerical modules load on first use). The numerical work
lives in :mod:`shuffledp.accounting.bounds` (the public functions), :mod:`shuffledp.accounting.families` (each
family's formulas and refusal rule), :mod:`shuffledp.accounting.literature` (the published bounds),
:mod:`shuffledp.accounting.rdp` (Renyi accounting), :mod:`shuffledp.accounting.clones` and
:mod:`shuffledp.accounting.pld` (the exact clone analysis and privacy-loss-distribution composition),
:mod:`shuffledp.accounting.composition` (the PLDs the families share) and :mod:`shuffledp.accounting.mechanisms`
(randomizer descriptions). Parameters are checked by :mod:`shuffledp.accounting.validation`.

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

from shuffledp.accounting.core import EPS0_MAX, KIND_WORDS, KINDS, N_MAX, RefusedError
from shuffledp.accounting.families import FAMILIES, FAMILY_KINDS

__all__ = [
    "Bound", "RefusedError", "FAMILIES", "KINDS", "KIND_WORDS", "FAMILY_KINDS", "EPS0_MAX", "N_MAX", "format_bound",
]


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
