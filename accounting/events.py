"""Privacy events: immutable records of what happened in one round.

Following the design of Google's ``dp_accounting`` (events are kept apart from the accountants that interpret
them), a :class:`ShuffleRound` only says *what was released*: ``n`` shuffled reports, each produced by an
``eps0``-LDP randomizer. How much privacy that costs is decided by an accountant and a bound family
(:mod:`shuffledp.accounting.bounds`, :mod:`shuffledp.accounting.accountant`), never by the event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shuffledp.accounting.validation import check_eps0, check_n

__all__ = ["ShuffleRound"]


def _as_report_count(value: Any) -> int:
    """Return ``value`` as a Python int in [1, N_MAX], or raise ``ValueError``/``TypeError`` saying what is allowed."""
    return check_n(value, "n (number of attested reports)")


def _as_local_epsilon(value: Any) -> float:
    """Return ``value`` as a float in (0, EPS0_MAX], or raise ``ValueError``/``TypeError`` saying what is allowed.

    The upper limit is the one every bound enforces (:data:`accounting.EPS0_MAX`): a round the bounds would
    reject must never enter an accountant, where it would make every later query fail.
    """
    return check_eps0(value, "eps0 (local randomizer epsilon)")


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
