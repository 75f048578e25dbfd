"""Checks of the clients' numeric parameters, shared by the randomizer, the report format, the noise sampler,
the models and the data helpers.

A bool is an ``int`` to Python but never a valid count, size or scale here, so every check refuses it. Two
contracts are in use and kept apart: :func:`require_int` (the shuffler's, re-exported) raises one ``ValueError``
for a setting that is not an int in range; :func:`check_int` and :func:`check_positive_finite` (the randomizer's
and the report format's arguments, which also take NumPy scalars) raise ``TypeError`` for a value of the wrong
type and ``ValueError`` for one out of range.
"""

from __future__ import annotations

import math

import numpy as np

from shuffledp.shuffler.validation import require_int  # the same contract as the shuffler's settings

__all__ = ["require_int", "check_int", "check_positive_finite"]


def check_int(name: str, value: object, low: int, high: int) -> int:
    """Return ``value`` as a Python int if it is an int or NumPy integer (not a bool) in ``[low, high]``.

    Args:
        name: how the message names the parameter.
        value: the value to check.
        low: the smallest allowed value.
        high: the largest allowed value.

    Returns:
        ``int(value)``.

    Raises:
        TypeError: ``value`` is not an int or NumPy integer.
        ValueError: ``value`` is outside ``[low, high]``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= int(value) <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return int(value)


def check_positive_finite(name: str, value: object) -> float:
    """Return ``value`` as a float if it is a real number (Python or NumPy, not a bool), finite and > 0.

    Args:
        name: how the message names the parameter.
        value: the value to check.

    Returns:
        ``float(value)``.

    Raises:
        TypeError: ``value`` is not a real number.
        ValueError: ``value`` is not finite or not > 0.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    v = float(value)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return v
