"""The checks of ``shuffledp deploy``'s parameters: each names the flag, what it got and what is allowed.

Every check raises :class:`shuffledp.deploy.errors.DeployUsageError` (exit status 2) and returns the value,
normalised, so a caller writes ``nodes = check_int("--nodes", nodes, 1, MAX_NODES)``.
"""

from __future__ import annotations

import math

from shuffledp.deploy.errors import DeployUsageError

__all__ = ["MAX_NODES", "ISOLATIONS", "check_int", "check_positive", "check_reply_floor", "check_work_limits",
           "check_isolation"]

#: The most devices a key directory is made for.
MAX_NODES = 10_000
#: How the SuperLink runs the ServerApp: its own executor (``subprocess``) or a separate one (``process``).
ISOLATIONS = ("subprocess", "process")


def check_int(name: str, value: object, low: int, high: int) -> int:
    """``value`` if it is an integer (not a bool) in ``[low, high]``.

    Returns:
        ``value``.

    Raises:
        DeployUsageError: naming ``name``, the range and what was given.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise DeployUsageError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def check_positive(name: str, value: object) -> float:
    """``value`` as a float if it is a finite number > 0 (not a bool).

    Returns:
        ``float(value)``.

    Raises:
        DeployUsageError: naming ``name`` and what was given.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise DeployUsageError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def check_reply_floor(value: object) -> float:
    """``--reply-floor``: seconds in [0, 3600] (shuffledp.clients.settings.MAX_REPLY_FLOOR; see clients/app.py).

    Returns:
        The floor in seconds, as a float.

    Raises:
        DeployUsageError: outside the range, or not a number.
    """
    from shuffledp.clients.settings import MAX_REPLY_FLOOR

    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_REPLY_FLOOR:
        raise DeployUsageError(f"--reply-floor must be a number of seconds in [0, {MAX_REPLY_FLOOR:g}], got {value!r}")
    return float(value)


def check_work_limits(max_local_epochs: object, min_batch_size: object,
                      max_model_parameters: object) -> tuple[int, int, int]:
    """The work limits a device pins (shuffledp.clients.settings.PinnedSettings).

    Returns:
        ``(max_local_epochs, min_batch_size, max_model_parameters)``: ``--max-local-epochs`` in [1, 10000],
        ``--min-batch-size`` >= 1 and ``--max-model-parameters`` in [1, 2**28].

    Raises:
        DeployUsageError: naming the first limit out of its range.
    """
    return (check_int("--max-local-epochs", max_local_epochs, 1, 10_000),
            check_int("--min-batch-size", min_batch_size, 1, 2**31 - 1),
            check_int("--max-model-parameters", max_model_parameters, 1, 2**28))


def check_isolation(name: str, value: object) -> str:
    """``value`` if it is one of :data:`ISOLATIONS`.

    Returns:
        ``value``.

    Raises:
        DeployUsageError: naming ``name`` and the two allowed values.
    """
    if value not in ISOLATIONS:
        raise DeployUsageError(f"{name} must be 'subprocess' or 'process', got {value!r}")
    return str(value)
