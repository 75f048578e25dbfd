"""The parameter validators of the accounting package: one behaviour for every module.

A value of the wrong type raises :class:`TypeError`, a value of the right type outside the allowed range raises
:class:`ValueError`; either message names the parameter, says what is allowed and shows what was given. Booleans
are never numbers here (``True`` is not a count of reports). Integers are anything ``operator.index`` accepts
(``int``, numpy integers), not floats (one exception, opt-in: :func:`check_n`'s ``integral_float``). Each
validator returns the value as a plain Python ``int`` or ``float``.

Callers pass their own parameter name (``name``) so the message speaks the caller's vocabulary (``"n"`` in
:mod:`shuffledp.accounting.clones`, ``"n (number of shuffled reports)"`` in :mod:`shuffledp.accounting.bounds`).
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

from shuffledp.accounting.core import EPS0_MAX, N_MAX

__all__ = [
    "EPS0_ALLOWED",
    "N_ALLOWED",
    "check_real",
    "check_integer",
    "check_eps0",
    "check_n",
    "check_delta",
    "check_epsilon",
    "check_rounds",
    "check_order",
]

#: What :func:`check_eps0` accepts, as its messages say it.
EPS0_ALLOWED = f"a finite real number > 0 and <= {EPS0_MAX:g} (EPS0_MAX, the largest eps0 any bound accepts)"
#: What :func:`check_n` accepts, as its messages say it.
N_ALLOWED = f"an integer in [1, {N_MAX:.0e}] (N_MAX = {N_MAX:,}, the largest n the exact clone analysis accepts)"


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return f"the boolean {value!r}"
    return f"{type(value).__name__} {value!r}"


def check_real(name: str, value: Any, allowed: str) -> float:
    """``value`` as a float if it is a real number (not a bool); only the type is checked.

    Args:
        name: the parameter's name, for the message.
        value: the value to check.
        allowed: what the parameter accepts, for the message (e.g. ``"a finite real number > 0"``).

    Returns:
        ``float(value)``.

    Raises:
        TypeError: ``value`` is a bool or not a real number.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {allowed}, got {_shown(value)}")
    return float(value)


def check_integer(name: str, value: Any, minimum: int, maximum: int | None = None, *, allowed: str = "") -> int:
    """``value`` as an int in ``[minimum, maximum]`` (no upper limit when ``maximum`` is None).

    Args:
        name: the parameter's name, for the message.
        value: the value to check (``operator.index`` must accept it; bools are refused).
        minimum: the smallest allowed value.
        maximum: the largest allowed value, or None.
        allowed: what the parameter accepts, for the message; derived from the limits when empty.

    Returns:
        ``int(value)``.

    Raises:
        TypeError: ``value`` is a bool or not an integer. ValueError: it is outside the limits.
    """
    if not allowed:
        allowed = f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]"
    if isinstance(value, bool):
        raise TypeError(f"{name} must be {allowed}, got {_shown(value)}")
    try:
        result = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be {allowed}, got {_shown(value)}") from None
    if result < minimum or (maximum is not None and result > maximum):
        raise ValueError(f"{name} must be {allowed}, got {result}")
    return int(result)


def check_eps0(value: Any, name: str = "eps0") -> float:
    """A local privacy parameter: finite, > 0 and <= :data:`~shuffledp.accounting.core.EPS0_MAX`.

    Args:
        value: the value to check.
        name: the parameter's name, for the message.

    Returns:
        The value as a float.

    Raises:
        TypeError: not a real number. ValueError: outside ``(0, EPS0_MAX]`` or not finite.
    """
    eps0 = check_real(name, value, EPS0_ALLOWED)
    if not (math.isfinite(eps0) and 0.0 < eps0 <= EPS0_MAX):
        raise ValueError(f"{name} must be {EPS0_ALLOWED}, got {eps0!r}")
    return eps0


def check_n(value: Any, name: str = "n", *, integral_float: bool = False) -> int:
    """A number of shuffled reports: an integer in ``[1, N_MAX]``.

    Args:
        value: the value to check.
        name: the parameter's name, for the message.
        integral_float: also accept a float with an integer value (``1e4``), as the formula functions of
            :mod:`shuffledp.accounting.bounds` do for a number typed by hand; records (events, ledgers, states)
            hold ints and keep the default.

    Returns:
        The value as an int.

    Raises:
        TypeError: not an integer. ValueError: outside ``[1, N_MAX]``.
    """
    if integral_float and isinstance(value, float) and value.is_integer():
        value = int(value)
    return check_integer(name, value, 1, N_MAX, allowed=N_ALLOWED)


def check_delta(value: Any, name: str = "delta") -> float:
    """A delta of (eps, delta)-DP: a real number with ``0 < delta < 1``.

    Args:
        value: the value to check.
        name: the parameter's name, for the message.

    Returns:
        The value as a float.

    Raises:
        TypeError: not a real number. ValueError: outside ``(0, 1)`` (NaN included).
    """
    allowed = f"a real number with 0 < {name} < 1"
    delta = check_real(name, value, allowed)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"{name} must be {allowed}, got {delta!r}")
    return delta


def check_epsilon(value: Any, name: str = "epsilon", *, allow_inf: bool = False) -> float:
    """An epsilon: a real number >= 0, finite unless ``allow_inf``.

    Args:
        value: the value to check.
        name: the parameter's name, for the message.
        allow_inf: accept ``math.inf`` (a PLD's mass at infinite loss is queried at epsilon = inf).

    Returns:
        The value as a float.

    Raises:
        TypeError: not a real number. ValueError: negative, NaN, or infinite when not allowed.
    """
    allowed = "a real number >= 0 (or inf)" if allow_inf else "a finite real number >= 0"
    eps = check_real(name, value, allowed)
    if not (eps >= 0.0 and (allow_inf or math.isfinite(eps))):
        raise ValueError(f"{name} must be {allowed}, got {eps!r}")
    return eps


def check_rounds(value: Any, name: str = "rounds") -> int:
    """A number of rounds (or of repetitions): an integer >= 1.

    Args:
        value: the value to check.
        name: the parameter's name, for the message.

    Returns:
        The value as an int.

    Raises:
        TypeError: not an integer. ValueError: below 1.
    """
    return check_integer(name, value, 1)


def check_order(value: Any, name: str = "order") -> float:
    """A Renyi order lambda: a finite real number > 1.

    Args:
        value: the value to check.
        name: the parameter's name, for the message.

    Returns:
        The value as a float.

    Raises:
        TypeError: not a real number. ValueError: not finite or <= 1.
    """
    allowed = "a finite real number > 1 (a Renyi order lambda)"
    order = check_real(name, value, allowed)
    if not (math.isfinite(order) and order > 1.0):
        raise ValueError(f"{name} must be {allowed}, got {order!r}")
    return order
