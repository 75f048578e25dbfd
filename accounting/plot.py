"""Curves of cumulative epsilon against rounds or against n, for several bound families, and their PNG.

Computing the curves needs only :mod:`shuffledp.accounting.bounds`; drawing them imports matplotlib, lazily, inside
:func:`render_png`, so that importing this module (or running any other ``shuffledp account`` command) never
loads a plotting library.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shuffledp.accounting import FAMILIES, RefusedError, bounds

__all__ = ["Curve", "DEFAULT_FAMILIES", "epsilon_curves", "integer_grid", "render_png"]

#: Families drawn by default: all but the instance value ``canonical-gdp`` (not a worst case) and ``blanket-duchi``,
#: which draws the same curve as ``clones`` and would hide it.
DEFAULT_FAMILIES: tuple[str, ...] = tuple(f for f in FAMILIES if f not in ("canonical-gdp", "blanket-duchi"))

_STYLE = {"upper": "-", "approximate": ":", "lower": "--"}


@dataclass
class Curve:
    """One family's curve: ``values[i]`` is epsilon at ``xs[i]``, or None where the family refused."""

    family: str
    kind: str
    xs: list[int]
    values: list[float | None]
    refusals: list[dict[str, Any]] = field(default_factory=list)


def integer_grid(low: int, high: int, points: int) -> list[int]:
    """Return up to ``points`` distinct integers from ``low`` to ``high`` inclusive, evenly spaced in log scale.

    Raises:
        ValueError: ``low < 1``, ``high < low`` or ``points < 1``.
    """
    if low < 1 or high < low or points < 1:
        raise ValueError(f"need 1 <= low <= high and points >= 1, got low={low}, high={high}, points={points}")
    if points == 1 or low == high:
        return [high]
    grid = np.unique(np.rint(np.geomspace(low, high, points)).astype(np.int64))
    return [int(v) for v in grid]


def epsilon_curves(
    families: Sequence[str],
    *,
    x: str,
    xs: Sequence[int],
    eps0: float,
    delta: float,
    n: int | None = None,
    rounds: int | None = None,
    allow_approximate: bool = False,
) -> list[Curve]:
    """Evaluate :func:`shuffledp.accounting.bounds.epsilon` for each family at every point of ``xs``.

    ``x = "rounds"``: ``xs`` are numbers of rounds T, each of ``n`` reports. ``x = "n"``: ``xs`` are numbers of
    reports n, composed over ``rounds`` rounds. Refused points are kept as None with their reason, never as a
    number.

    Raises:
        ValueError: ``x`` is neither "rounds" nor "n", or the parameter it needs is missing.
    """
    if x == "rounds":
        if n is None:
            raise ValueError("epsilon_curves(x='rounds') needs n, the number of reports per round")
    elif x == "n":
        if rounds is None:
            raise ValueError("epsilon_curves(x='n') needs rounds, the number of rounds composed")
    else:
        raise ValueError(f"x must be 'rounds' or 'n', got {x!r}")
    curves = []
    for family in families:
        values: list[float | None] = []
        refusals: list[dict[str, Any]] = []
        kind = "refused"
        for point in xs:
            t, size = (int(point), n) if x == "rounds" else (rounds, int(point))
            try:
                bound = bounds.epsilon(family, eps0, size, delta, t, allow_approximate=allow_approximate)
            except RefusedError as exc:
                values.append(None)
                refusals.append({x: int(point), "reason": str(exc)})
                continue
            value = float(bound.value)
            if not math.isfinite(value):
                values.append(None)
                refusals.append({x: int(point), "reason": f"no finite value ({value!r})"})
                continue
            values.append(value)
            kind = bound.kind
        curves.append(Curve(family=family, kind=kind, xs=[int(p) for p in xs], values=values, refusals=refusals))
    return curves


def render_png(curves: Sequence[Curve], *, x: str, out: str | os.PathLike[str], title: str = "") -> None:
    """Draw the curves (log-log axes; solid = upper bound, dotted = approximation, dashed = lower bound) to PNG."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.5), dpi=120)
    try:
        for curve in curves:
            pts = [(px, v) for px, v in zip(curve.xs, curve.values) if v is not None and v > 0]
            if not pts:
                continue
            px, pv = zip(*pts)
            ax.plot(px, pv, _STYLE.get(curve.kind, "-"), marker=".", label=f"{curve.family} ({curve.kind})")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("rounds T" if x == "rounds" else "reports per round n")
        ax.set_ylabel("cumulative epsilon")
        if title:
            ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(os.fspath(out), format="png")
    finally:
        plt.close(fig)
