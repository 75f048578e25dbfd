"""What the ``shuffledp account`` and ``shuffledp ledger`` commands share: argument types, output, messages.

Imports only the standard library and :mod:`shuffledp.accounting` (no numpy, scipy or dp_accounting at import).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TextIO

from shuffledp.accounting import FAMILIES

__all__ = [
    "EXIT_OK",
    "EXIT_USAGE",
    "KIND_MEANING",
    "Parser",
    "UsageError",
    "cli_message",
    "emit",
    "family_names",
    "finite_float",
    "fmt",
    "order",
    "plural",
    "positive_float",
    "positive_int",
    "probability",
    "table",
]

EXIT_OK = 0
EXIT_USAGE = 2

#: What each kind of figure means, as the tables print it.
KIND_MEANING = {
    "upper": "guarantee (upper bound)",
    "approximate": "estimate, not a guarantee",
    "lower": "lower bound (true loss is at least this)",
    "refused": "refused",
}


class UsageError(Exception):
    """Raised instead of argparse's ``sys.exit(2)`` so that the command's ``main`` returns the code."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors raise :class:`UsageError` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        """Raise :class:`UsageError` with argparse's message (argparse's hook for every usage error).

        Args:
            message: argparse's description of the error.
        """
        raise UsageError(f"{self.prog}: error: {message}")


# -- messages ----------------------------------------------------------------------------------------------------
#: The Python spelling of an option in a library message, and the flag that says the same on the command line.
_PYTHON_TO_FLAG = (("allow_approximate=True", "--allow-approximate"),)


def plural(count: int, noun: str) -> str:
    """Return ``"1 round"``, ``"2 rounds"``: a count with its noun, singular for exactly one.

    Args:
        count: how many.
        noun: the singular noun (an ``s`` is added otherwise).

    Returns:
        The count and the noun.
    """
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def cli_message(text: str) -> str:
    """Return a library message as the command line should print it.

    The accounting library words its refusals for Python callers (``allow_approximate=True``); through the CLI
    they name the flag (``--allow-approximate``). A count of one is singular ("1 round", not "1 rounds").

    Args:
        text: the message (e.g. ``str`` of a RefusedError).

    Returns:
        The message with the CLI's spelling.
    """
    for python, flag in _PYTHON_TO_FLAG:
        text = text.replace(python, flag)
    return re.sub(r"\b1 (round|report|point|bound)s\b", r"1 \1", text)


# -- argument types ----------------------------------------------------------------------------------------------
def finite_float(text: str) -> float:
    """Parse a finite real number (argparse ``type``).

    Args:
        text: the argument.

    Returns:
        The number.

    Raises:
        argparse.ArgumentTypeError: not a finite real number.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a real number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite real number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """Parse a finite real number > 0 (argparse ``type``).

    Args:
        text: the argument.

    Returns:
        The number.

    Raises:
        argparse.ArgumentTypeError: not a finite real number > 0.
    """
    value = finite_float(text)
    if value <= 0.0:
        raise argparse.ArgumentTypeError(f"expected a real number > 0, got {text!r}")
    return value


def probability(text: str) -> float:
    """Parse a number strictly between 0 and 1 (argparse ``type``).

    Args:
        text: the argument.

    Returns:
        The number.

    Raises:
        argparse.ArgumentTypeError: not a number in (0, 1).
    """
    value = finite_float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number strictly between 0 and 1, got {text!r}")
    return value


def order(text: str) -> float:
    """Parse a Renyi order, a finite real number > 1 (argparse ``type``).

    Args:
        text: the argument.

    Returns:
        The order.

    Raises:
        argparse.ArgumentTypeError: not a finite real number > 1.
    """
    value = finite_float(text)
    if value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a Renyi order > 1, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """Parse an integer >= 1; accepts ``10000``, ``10_000`` and ``1e4`` (an exactly integral float).

    Args:
        text: the argument.

    Returns:
        The integer.

    Raises:
        argparse.ArgumentTypeError: not an integer >= 1.
    """
    try:
        value = int(text)
    except ValueError:
        try:
            number = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
        if not math.isfinite(number) or not number.is_integer():
            raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
        value = int(number)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def family_names() -> list[str]:
    """Return the names of every bound family, in the registry's order.

    Returns:
        The family names.
    """
    return list(FAMILIES)


# -- output ------------------------------------------------------------------------------------------------------
def fmt(value: Any) -> str:
    """Return a table cell: ``-`` for None, 10 significant digits for a float, ``str`` otherwise.

    Args:
        value: the cell's value.

    Returns:
        Its text.
    """
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.10g}"
    return str(value)


def table(rows: Sequence[Sequence[Any]], out: TextIO) -> None:
    """Write ``rows`` as left-aligned columns separated by two spaces.

    Args:
        rows: the rows, each a sequence of cells (formatted with :func:`fmt`).
        out: where to write.
    """
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells if i < len(row)) for i in range(max(len(r) for r in cells))]
    for row in cells:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")


def emit(obj: dict[str, Any], as_json: bool, out: TextIO, write_table: Callable[[], None]) -> int:
    """Write a command's result: ``obj`` as one JSON line under ``--json``, else the readable table.

    Args:
        obj: the result document.
        as_json: whether ``--json`` was given.
        out: where to write.
        write_table: writes the readable form.

    Returns:
        :data:`EXIT_OK`.
    """
    if as_json:
        out.write(json.dumps(obj, allow_nan=False) + "\n")
    else:
        write_table()
    return EXIT_OK
