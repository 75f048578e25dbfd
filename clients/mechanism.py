"""One interface over the local randomizers: ``laplace`` (the default), ``duchi`` and ``privunit2``.

Every mechanism maps a client's update (a flat float vector) to a fixed-length report, eps0-LDP for ANY two
inputs of the client, and the server decodes a report to an unbiased estimate of the client's clipped update::

    mech = make_mechanism("duchi", eps0=1.0, clip_l1=1.0, clip_l2=1.0)
    report = mech.randomize(update)            # client: bytes of length mech.report_length(d)
    estimate = mech.decode(report, d)          # server: E[estimate] = the clipped update
    reports = mech.randomize_batch(updates)    # k clients at once: uint8 (k, mech.report_length(d)), one per row
    batch = mech.decode_batch(reports, d)      # DecodedBatch: values (k, d), refused {row: why}

* ``laplace``: L1 clip ``clip-l1``, the exact discrete Laplace mechanism (:mod:`shuffledp.clients.randomizer`;
  Dwork, McSherry, Nissim, Smith, TCC 2006; Canonne, Kamath, Steinke, NeurIPS 2020);
* ``duchi``: L2 clip ``clip-l2``, one exact randomized-response bit on ``sign<g, z>`` for a seeded uniform direction
  ``z`` (:mod:`shuffledp.clients.duchi`; Duchi, Jordan, Wainwright, JASA 2018);
* ``privunit2``: L2 clip ``clip-l2``, PrivUnit2 (:mod:`shuffledp.clients.privunit`; Bhowmick, Duchi, Freudiger,
  Kapoor, Rogers, arXiv:1812.00984, 2018). Research-only (:data:`RESEARCH_ONLY`): its floating-point argument
  is written in docs/mechanisms.md, not certified in code, so a deployed client refuses it.

The apps (the ClientApp's report path, the server's decode) and in-process benchmarks use this same code: each
mechanism implements the batch methods, and ``randomize`` / ``decode`` are them on a batch of one.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from shuffledp.clients.noise import ChaCha20Rng
from shuffledp.clients.randomizer import DiscreteLaplaceRandomizer
from shuffledp.clients.report import DecodedBatch, Payloads, read_reports, report_length

__all__ = ["MECHANISMS", "L2_MECHANISMS", "RESEARCH_ONLY", "DEFAULT_MECHANISM", "Mechanism", "LaplaceMechanism",
           "make_mechanism", "check_mechanism_name"]

MECHANISMS = ("laplace", "duchi", "privunit2")
#: The mechanisms that act on the L2-clipped update (their clip is ``clip-l2``; ``laplace`` uses ``clip-l1``).
L2_MECHANISMS = ("duchi", "privunit2")
#: Mechanisms whose eps0-LDP argument covers floating point only under assumptions not checked in code: usable in
#: simulation and in-process benchmarks, refused by a deployed client and by ``shuffledp deploy bundle``.
RESEARCH_ONLY = frozenset({"privunit2"})
DEFAULT_MECHANISM = "laplace"


@runtime_checkable
class Mechanism(Protocol):
    """A local randomizer and its server-side decoder (module docstring)."""

    name: str
    eps0: float
    clip: float

    def randomize(self, vec: np.ndarray) -> bytes:
        """Clip ``vec`` and randomize it; returns the fixed-length report (``randomize_batch`` on one row)."""
        ...

    def randomize_batch(self, vecs: np.ndarray) -> np.ndarray:
        """Clip and randomize each row of ``vecs`` (``(k, d)``); returns uint8 ``(k, report_length(d))``, one report
        per row."""
        ...

    def decode(self, report: bytes, dim: int) -> np.ndarray:
        """Validate a report of dimension ``dim``; returns the unbiased float64 estimate of the clipped update.
        Raises :class:`shuffledp.clients.report.ReportError` for a malformed report (``decode_batch`` on one)."""
        ...

    def decode_batch(self, reports: Payloads, dim: int) -> DecodedBatch:
        """Validate and decode a batch (a ``(k, length)`` uint8 array or a sequence of payloads); returns a
        :class:`shuffledp.clients.report.DecodedBatch` whose malformed rows are zero and named, not raised."""
        ...

    def report_length(self, dim: int) -> int:
        """Returns the byte length of every report of dimension ``dim``."""
        ...

    def label(self, dim: int) -> str:
        """Returns the mechanism's name and parameters, as the ledger records them."""
        ...


class LaplaceMechanism:
    """The exact discrete Laplace mechanism on the L1-clipped update behind the :class:`Mechanism` interface
    (:class:`shuffledp.clients.randomizer.DiscreteLaplaceRandomizer`; Canonne, Kamath, Steinke, NeurIPS 2020).

    Args:
        randomizer: the client's randomizer (its eps0, clip-l1, grid and CSPRNG). The decoder accepts reports on
            the default grid of (eps0, clip-l1) only (a report on another grid would be an outsized contribution).
    """

    name = "laplace"

    def __init__(self, randomizer: DiscreteLaplaceRandomizer) -> None:
        self.randomizer = randomizer
        self.eps0 = randomizer.eps0
        self.clip = randomizer.clip
        self.expected_log2_grid = DiscreteLaplaceRandomizer(randomizer.eps0, randomizer.clip,
                                                            rng=randomizer.rng).log2_grid

    def randomize_batch(self, vecs: np.ndarray) -> np.ndarray:
        """Clip each row to L1, round to the grid, add exact discrete Laplace noise, encode.

        Args:
            vecs: real ``(k, d)``, one update per row.

        Returns:
            uint8 ``(k, 20 + 4 d)``, one report per row (:meth:`DiscreteLaplaceRandomizer.encode_rows`).
        """
        return self.randomizer.encode_rows(vecs)

    def randomize(self, vec: np.ndarray) -> bytes:
        """Clip to L1, round to the grid, add exact discrete Laplace noise, encode (:meth:`randomize_batch` on one).

        Returns:
            The fixed-length report (:func:`shuffledp.clients.report.encode_report`).
        """
        return self.randomize_batch(np.asarray(vec).reshape(1, -1))[0].tobytes()

    def decode_batch(self, reports: Payloads, dim: int) -> DecodedBatch:
        """The reports' real-valued vectors (unbiased: the noise has mean 0; up to the grid rounding and the rare
        int32 saturation); a malformed report or one on another grid than (eps0, clip-l1)'s default is refused.

        Returns:
            :class:`shuffledp.clients.report.DecodedBatch` (float64 ``(k, dim)``).
        """
        return read_reports(reports, expected_dim=dim, expected_log2_grid=self.expected_log2_grid).to_batch()

    def decode(self, report: bytes, dim: int) -> np.ndarray:
        """The report's real-valued vector (:meth:`decode_batch` on one report).

        Returns:
            A float64 vector of shape ``(dim,)``.

        Raises:
            ReportError: a malformed report or one on another grid than (eps0, clip-l1)'s default.
        """
        return self.decode_batch([report], dim).only()

    def report_length(self, dim: int) -> int:
        """Returns ``20 + 4 * dim`` (:func:`shuffledp.clients.report.report_length`)."""
        return report_length(dim)

    def label(self, dim: int) -> str:
        """Returns e.g. ``"discrete-laplace-l1(d=650,C=1,eps0=4)"``."""
        return f"discrete-laplace-l1(d={dim},C={self.clip:g},eps0={self.eps0:g})"


def check_mechanism_name(name: object, where: str = "mechanism") -> str:
    """Returns ``name`` if it is one of :data:`MECHANISMS`; raises ValueError naming the allowed values."""
    if not isinstance(name, str) or name not in MECHANISMS:
        raise ValueError(f"{where} must be one of {', '.join(MECHANISMS)}; got {name!r}")
    return name


def make_mechanism(name: str, *, eps0: float, clip_l1: float | None = None, clip_l2: float | None = None,
                   log2_grid: int | None = None, rng: ChaCha20Rng | None = None) -> Mechanism:
    """The mechanism ``name`` for the pinned parameters.

    Args:
        name: one of :data:`MECHANISMS`.
        eps0: the local epsilon.
        clip_l1: the L1 clip (``laplace`` only; required for it).
        clip_l2: the L2 clip (``duchi``, ``privunit2``; required for them).
        log2_grid: ``laplace``'s grid exponent (None: the default); must be None for the L2 mechanisms.
        rng: the CSPRNG; default, a fresh :class:`ChaCha20Rng` keyed from ``os.urandom``.

    Returns:
        A :class:`Mechanism`.

    Raises:
        ValueError / TypeError: an unknown name, a missing clip, or a parameter the mechanism refuses.
    """
    check_mechanism_name(name)
    if name == "laplace":
        if clip_l1 is None:
            raise ValueError("the laplace mechanism needs clip-l1 (its L1 clip radius)")
        return LaplaceMechanism(DiscreteLaplaceRandomizer(eps0, clip_l1, log2_grid=log2_grid, rng=rng))
    if clip_l2 is None:
        raise ValueError(f"the {name} mechanism needs clip-l2 (its L2 clip radius)")
    if log2_grid is not None:
        raise ValueError(f"log2-grid belongs to the laplace mechanism; the {name} mechanism has no grid")
    if name == "duchi":
        from shuffledp.clients.duchi import DuchiMechanism

        return DuchiMechanism(eps0, clip_l2, rng=rng)
    from shuffledp.clients.privunit import PrivUnit2Mechanism

    return PrivUnit2Mechanism(eps0, clip_l2, rng=rng)
