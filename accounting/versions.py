"""The versions of shuffledp and of the libraries its privacy figures are computed with.

A ledger (its ``meta`` table) and a run's ``report.json`` record them, so a figure can be traced to the code that
produced it. Read from the installed distributions' metadata (:mod:`importlib.metadata`); nothing is imported.
"""

from __future__ import annotations

from importlib import metadata

__all__ = ["ACCOUNTING_DISTRIBUTIONS", "NOT_INSTALLED", "library_versions"]

#: The distributions whose versions are recorded: shuffledp itself and the libraries the accounting computes with.
ACCOUNTING_DISTRIBUTIONS = ("shuffledp", "dp-accounting", "numpy", "scipy")

#: What is recorded for a distribution that is not installed (e.g. shuffledp run from a source tree).
NOT_INSTALLED = "not installed"


def library_versions() -> dict[str, str]:
    """Return the installed version of each of :data:`ACCOUNTING_DISTRIBUTIONS`.

    Returns:
        distribution name -> version string, in the order of :data:`ACCOUNTING_DISTRIBUTIONS`; a distribution
        that is not installed maps to :data:`NOT_INSTALLED`.
    """
    found: dict[str, str] = {}
    for name in ACCOUNTING_DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = NOT_INSTALLED
    return found
