"""The package's ground vocabulary: the parameter limits, the kinds of a bound and :class:`RefusedError`.

Standard library only, and no first-party import: every other accounting module can import it (the family
registry, :mod:`shuffledp.accounting.families`, included) without an import cycle through the package's
``__init__``. The package re-exports all of it.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["EPS0_MAX", "N_MAX", "KINDS", "KIND_WORDS", "RefusedError"]

#: Largest eps0 any bound accepts (e^100 ~ 2.7e43 keeps every formula in range); events and bounds share it.
EPS0_MAX = 100.0
#: Largest number of shuffled reports per round the exact clone analysis accepts.
N_MAX = 10**9

#: The kinds of a :class:`shuffledp.accounting.Bound` (see the package docstring).
KINDS: tuple[str, ...] = ("upper", "approximate", "lower")

#: How each kind is named next to a printed number ("epsilon 4.18 (clones, upper bound)").
KIND_WORDS: Mapping[str, str] = {"upper": "upper bound", "approximate": "approximation", "lower": "lower bound"}


class RefusedError(ValueError):
    """A bound family refuses these parameters.

    Raised when the parameters are valid numbers but lie outside the region where the family's formula holds
    (e.g. Feldman, McMillan, Talwar, FOCS 2021, Theorem 3.1 outside ``eps0 <= log(n / (16 log(4/delta)))``),
    or when a CLT approximation is asked for where it is known to be unsafe and ``allow_approximate`` was not
    given. The message says why and what would be accepted.
    """
