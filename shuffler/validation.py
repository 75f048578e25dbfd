"""Checks of the shuffler's integer parameters (settings, sizes, counts), shared by its modules.

A bool is an ``int`` to Python but never a valid count or size here, so every check refuses it. The envelope
format's own field checks (:mod:`shuffledp.shuffler.envelope`) stay with the format: they raise ``TypeError`` for a
value of the wrong type, where a setting that is not an int in range is one ``ValueError``.
"""

from __future__ import annotations

from typing import TypeGuard


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is a Python ``int`` and not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def require_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """Return ``value`` if it is an int (not a bool) in ``[low, high]`` (``>= low`` if ``high`` is None).

    Args:
        name: how the message names the parameter.
        value: the value to check.
        low: the smallest allowed value.
        high: the largest allowed value, or None for no upper bound.

    Returns:
        ``value``, unchanged.

    Raises:
        ValueError: ``"<name> must be an int in [low, high], got <value!r>"`` (or ``>= low``).
    """
    if not is_int(value) or value < low or (high is not None and value > high):
        allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an int {allowed}, got {value!r}")
    return value
