"""The auditor recomputes the ledger's epsilons: each row's cumulative epsilon, for every family the row records,
from the (n, eps0) of that row and every row before it, at the row's delta, with the same accounting code
(:func:`shuffledp.accounting.bounds.epsilon_for_rounds`).

A recorded value of an upper-bound family below the recomputed one (beyond :data:`EPSILON_RECHECK_REL_TOL`)
understates the privacy spent: a violation. Any other difference (a lower bound, or an upper bound recorded
higher than needed, which is safe) is a note, as is a family the recomputation refuses where the row has a value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EPSILON_RECHECK_REL_TOL", "Recheck", "recheck_epsilons"]

#: Relative tolerance between a recorded and a recomputed epsilon. The values are deterministic to the last
#: digit with the same library versions; the tolerance leaves room for another platform's last bits.
EPSILON_RECHECK_REL_TOL = 1e-9


@dataclass
class Recheck:
    """What :func:`recheck_epsilons` found for one ledger."""

    rows_checked: int = 0
    values_checked: int = 0
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def recheck_epsilons(name: str, rows: Sequence[Mapping[str, Any]]) -> Recheck:
    """Recompute every recorded cumulative epsilon of a ledger's rows (in round order).

    Args:
        name: the ledger's name, for the messages.
        rows: :meth:`shuffledp.accounting.ledger.Ledger.rows` (``round``, ``n_reports``, ``eps0``, ``delta``,
            ``epsilons``: family -> ``{"value", "kind", "reason"}``).

    Returns:
        The counts checked, violations (an upper bound recorded below its recomputed value) and notes.
    """
    from shuffledp.accounting import RefusedError
    from shuffledp.accounting.bounds import epsilon_for_rounds
    from shuffledp.accounting.events import ShuffleRound

    out = Recheck()
    history: list[ShuffleRound] = []
    gap: int | None = None  # the first round without its eps0: later cumulative values cannot be recomputed
    for row in sorted(rows, key=lambda r: int(r["round"])):
        epsilons = row.get("epsilons") or {}
        if gap is None and (row.get("eps0") is None or row.get("delta") is None):
            gap = int(row["round"])
        if gap is not None:
            if epsilons:
                out.notes.append(f"{name}: round {gap} records no eps0 or delta, so the epsilons of round "
                                 f"{row['round']} on were not recomputed")
                break
            continue
        history.append(ShuffleRound(n=int(row["n_reports"]), eps0=float(row["eps0"])))
        if not epsilons:
            continue
        out.rows_checked += 1
        for family, recorded in sorted(epsilons.items()):
            value = recorded.get("value") if isinstance(recorded, Mapping) else None
            if value is None:
                continue
            where = f"{name}: round {row['round']}, {family}"
            try:
                again = epsilon_for_rounds(family, history, float(row["delta"]))
            except RefusedError as exc:
                out.notes.append(f"{where}: recorded {value!r}, but recomputing it is refused ({exc})")
                continue
            out.values_checked += 1
            if math.isclose(float(value), again.value, rel_tol=EPSILON_RECHECK_REL_TOL, abs_tol=0.0):
                continue
            if again.kind == "upper" and float(value) < again.value:
                out.violations.append(f"{where}: recorded epsilon {value!r} is below the recomputed upper bound "
                                      f"{again.value!r}: the ledger understates the privacy spent")
            else:
                out.notes.append(f"{where}: recorded epsilon {value!r}, recomputed {again.value!r} ({again.kind})")
    return out
