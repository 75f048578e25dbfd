"""Privacy events: immutable records of what happened in one round.

Following the design of Google's ``dp_accounting`` (events are kept apart from the accountants that interpret
them), a :class:`ShuffleRound` only says *what was released*: ``n`` shuffled reports, each produced by an
``eps0``-LDP randomizer. How much privacy that costs is decided by an accountant and a bound family
(:mod:`shuffledp.accounting.bounds`, :mod:`shuffledp.accounting.accountant`), never by the event.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Any

from shuffledp.accounting import EPS0_MAX, N_MAX

__all__ = ["ShuffleRound"]


def _as_report_count(value: Any) -> int:
    """Return ``value`` as a Python int >= 1, or raise ``ValueError``/``TypeError`` saying what is allowed."""
    if isinstance(value, bool):
        raise TypeError(f"n (number of attested reports) must be an integer >= 1, got the boolean {value!r}")
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(
            f"n (number of attested reports) must be an integer >= 1, got {type(value).__name__} {value!r}"
        ) from None
    if count < 1:
        raise ValueError(f"n (number of attested reports) must be an integer >= 1, got {count}")
    if count > N_MAX:
        raise ValueError(
            f"n (number of attested reports) must be <= {N_MAX:,} (N_MAX, the largest n the exact clone "
            f"analysis accepts), got {count}"
        )
    return int(count)


def _as_local_epsilon(value: Any) -> float:
    """Return ``value`` as a float in (0, EPS0_MAX], or raise ``ValueError``/``TypeError`` saying what is allowed.

    The upper limit is the one every bound enforces (:data:`accounting.EPS0_MAX`): a round the bounds would
    reject must never enter an accountant, where it would make every later query fail.
    """
    allowed = f"a finite real number > 0 and <= {EPS0_MAX:g} (EPS0_MAX, the largest eps0 any bound accepts)"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"eps0 (local randomizer epsilon) must be {allowed}, got {value!r}")
    eps0 = float(value)
    if not math.isfinite(eps0) or not 0.0 < eps0 <= EPS0_MAX:
        raise ValueError(f"eps0 (local randomizer epsilon) must be {allowed}, got {eps0!r}")
    return eps0


@dataclass(frozen=True, slots=True)
class ShuffleRound:
    """One round of the shuffle model: ``n`` reports, each from an ``eps0``-LDP randomizer, shuffled together.

    ``n`` is the number of reports the shuffler *attested* it mixed (its signed count), not the number of
    clients the server asked: amplification is only as strong as the anonymity set that really existed.
    ``n = 1`` is allowed and means no amplification at all (the single report is ``eps0``-DP).

    Attributes:
        n: attested number of shuffled reports in the round, an integer in [1, N_MAX].
        eps0: the local (pure) differential-privacy parameter of each report's randomizer, in (0, EPS0_MAX]
            (EPS0_MAX = 100, the limit of every bound).

    Raises:
        TypeError: ``n`` is not an integer or ``eps0`` is not a real number.
        ValueError: ``n`` outside [1, N_MAX] or ``eps0`` outside (0, EPS0_MAX].
    """

    n: int
    eps0: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", _as_report_count(self.n))
        object.__setattr__(self, "eps0", _as_local_epsilon(self.eps0))

    def to_dict(self) -> dict[str, int | float]:
        """Return a JSON-safe dict ``{"n": int, "eps0": float}`` (floats round-trip exactly through JSON)."""
        return {"n": self.n, "eps0": self.eps0}

    @classmethod
    def from_dict(cls, data: Any) -> ShuffleRound:
        """Rebuild a round from :meth:`to_dict` output, validating it like the constructor.

        Raises:
            ValueError: ``data`` is not a mapping with exactly the keys ``n`` and ``eps0``.
        """
        if not isinstance(data, dict) or set(data) != {"n", "eps0"}:
            raise ValueError(f"a ShuffleRound record must be a dict with exactly the keys 'n' and 'eps0', got {data!r}")
        return cls(n=data["n"], eps0=data["eps0"])
