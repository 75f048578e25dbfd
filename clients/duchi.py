"""Duchi, Jordan and Wainwright's L2 mechanism ("Minimax optimal procedures for locally private estimation",
JASA 2018, Sec. 4.2.3), as one exactly sampled randomized-response bit.

Mechanism. The update is clipped to L2 radius C: ``g``, ``||g||_2 <= C``. The client draws a 32-byte seed from the
CSPRNG and derives a uniform direction ``z`` on the unit sphere of R^d from it
(:func:`shuffledp.clients.sphere.direction_from_seed`); ``z`` is data-independent. With
``x = sign(<g, z>) * ||g||_2 / C`` in [-1, 1] (``x = 0`` when ``<g, z> = 0``), it sends the seed and one bit
``b = +1`` with probability ``p(x) = clamp(1/2 + x (p_hi - 1/2), p_lo, p_hi)``, ``-1`` otherwise, where
``[p_lo, p_hi]`` is the randomized-response interval of eps0 (:func:`shuffledp.clients.coins.rr_interval`).

This is Duchi et al.'s mechanism in distribution: their client first rounds ``g`` to ``+-C g/||g||`` (the sign
``+`` with probability ``1/2 + ||g||/(2C)``), then outputs a point ``w`` uniform on the hemisphere of that vector
with probability ``pi = e^eps0/(e^eps0 + 1)``, on the other with ``1 - pi``. The output ``b z`` has that law: given
``z``, ``P[b = sign<g, z>] = 1/2 + (||g||/C)(pi - 1/2)``.

Privacy (any two inputs, floating point included). The output is ``(seed, b)``. The seed's law does not depend
on the data; given the seed, ``P[b = +1]`` is a float in ``[p_lo, p_hi]`` whatever floats ``<g, z>`` and
``||g||`` came out as (the clamp is the last operation), and the coin is drawn with exactly that probability
(:func:`shuffledp.clients.coins.bernoulli`). So for any inputs ``g, g'`` and any output,
``P[out | g] / P[out | g'] <= max(p_hi / p_lo, (1 - p_lo) / (1 - p_hi)) <= e^eps0``, checked exactly in rationals.

Decode (unbiased). For ``z`` uniform on the sphere, ``E[z sign<u, z>] = m_d u`` for any unit ``u``, with
``m_d = E|z_1| = Gamma(d/2) / (sqrt(pi) Gamma((d + 1)/2))``. Given ``z``, ``E[b] = 2 p(x) - 1 = c x`` with
``c = 2 p_hi - 1`` (up to the clamp on the low side, below 2**-52 relatively). Hence
``E[b z] = c (||g|| / C) E[sign<g, z> z] = (c m_d / C) g``, and the server's estimate
``g_hat = C / (c m_d) * b z`` is unbiased, with ``||g_hat||_2^2 = C^2 / (c m_d)^2`` (about ``pi d C^2 / (2 c^2)``).

Report: the 20-byte mechanism header (magic ``b"SDPD"``), the 32-byte seed and one byte ``b in {0, 1}``: 53 bytes
whatever d.
"""

from __future__ import annotations

import math

import numpy as np

from shuffledp.clients.coins import bernoulli, check_l2_parameters, rr_epsilon, rr_interval
from shuffledp.clients.noise import ChaCha20Rng
from shuffledp.clients.report import ReportError, decode_mechanism_header, encode_mechanism_header
from shuffledp.clients.sphere import SEED_BYTES, clip_l2, direction_from_seed
from shuffledp.clients.validation import check_int

__all__ = ["DUCHI_MAGIC", "DuchiMechanism", "mean_abs_coordinate"]

DUCHI_MAGIC = b"SDPD"
_HEADER_BYTES = 20
_BODY_BYTES = SEED_BYTES + 1


def mean_abs_coordinate(d: int) -> float:
    """``E|z_1|`` for ``z`` uniform on the unit sphere of R^d (Duchi, Jordan, Wainwright, JASA 2018, Sec. 4.2.3).

    Returns:
        ``Gamma(d/2) / (sqrt(pi) Gamma((d + 1)/2))`` computed in log space (about ``sqrt(2 / (pi d))``).
    """
    d = check_int("d", d, 1, 2**28)
    return math.exp(math.lgamma(d / 2) - math.lgamma((d + 1) / 2) - 0.5 * math.log(math.pi))


class DuchiMechanism:
    """eps0-LDP randomizer of an L2-clipped update: one exact randomized-response bit on ``sign<g, z>`` for a
    uniform direction ``z`` sent as a seed (module docstring; Duchi, Jordan, Wainwright, JASA 2018).

    Args:
        eps0: the pinned local epsilon, in (0, 64].
        clip_l2: the L2 clip radius C > 0.
        rng: the CSPRNG (seeds and coins). Default: a :class:`ChaCha20Rng` keyed from ``os.urandom``.
    """

    name = "duchi"

    def __init__(self, eps0: float, clip_l2: float, *, rng: ChaCha20Rng | None = None) -> None:
        self.eps0, self.clip = check_l2_parameters(eps0, clip_l2, "duchi")
        self.p_lo, self.p_hi = rr_interval(self.eps0)
        self.half_gap = self.p_hi - 0.5  # exact (Sterbenz: p_hi in (1/2, 1))
        self.eps_used = rr_epsilon(self.p_lo, self.p_hi)
        self.rng = rng if rng is not None else ChaCha20Rng()

    def flip_probability(self, x: float) -> float:
        """``P[b = +1]`` for the signed, scaled projection ``x`` in [-1, 1].

        Returns:
            ``clamp(1/2 + x (p_hi - 1/2), p_lo, p_hi)``: always a float in ``[p_lo, p_hi]`` (a non-finite ``x``
            gives 1/2).
        """
        if not math.isfinite(x):
            return 0.5
        p = 0.5 + self.half_gap * x
        return min(max(p, self.p_lo), self.p_hi)

    def projection(self, g: np.ndarray, z: np.ndarray) -> float:
        """``x = sign(<g, z>) min(1, ||g||_2 / C)`` for a clipped update ``g`` and a direction ``z``.

        Returns:
            The float x in [-1, 1] (0 when ``<g, z> = 0``).
        """
        dot = float(np.dot(g, z))
        if dot == 0.0 or not math.isfinite(dot):
            return 0.0
        scale = min(1.0, float(np.linalg.norm(g)) / self.clip)
        return math.copysign(scale, dot)

    def randomize(self, vec: np.ndarray) -> bytes:
        """Clip to L2 radius C, draw a seed and its direction, send one exact randomized-response bit.

        Returns:
            The fixed-length report (:meth:`report_length`).

        Raises:
            ValueError: ``vec`` has a non-finite entry or is empty.
        """
        g = clip_l2(vec, self.clip)
        d = check_int("the update's size", int(g.size), 1, 2**28)
        seed = self.rng.random_bytes(SEED_BYTES).tobytes()
        z = direction_from_seed(seed, d)
        bit = bernoulli(self.flip_probability(self.projection(g, z)), self.rng)
        return encode_mechanism_header(DUCHI_MAGIC, d, self.eps_used) + seed + (b"\x01" if bit else b"\x00")

    def scale(self, dim: int) -> float:
        """The decode factor ``C / (c m_d)`` with ``c = 2 p_hi - 1``.

        Returns:
            The factor (float): ``g_hat = scale * b * z``; also ``||g_hat||_2`` for every report.
        """
        return self.clip / ((2.0 * self.half_gap) * mean_abs_coordinate(dim))

    def decode(self, report: bytes, dim: int) -> np.ndarray:
        """The unbiased estimate ``C / (c m_d) * b z`` of the client's clipped update (module docstring).

        Returns:
            A float64 vector of shape ``(dim,)``.

        Raises:
            ReportError: a malformed report (magic, version, dimension, length, bit not 0 or 1).
        """
        decode_mechanism_header(report, magic=DUCHI_MAGIC, expected_dim=dim, body_bytes=_BODY_BYTES)
        buf = bytes(report)
        seed, bit = buf[_HEADER_BYTES:_HEADER_BYTES + SEED_BYTES], buf[-1]
        if bit not in (0, 1):
            raise ReportError(f"the duchi report's bit must be 0 or 1, got {bit}")
        z = direction_from_seed(seed, dim)
        return (self.scale(dim) if bit else -self.scale(dim)) * z

    def report_length(self, dim: int) -> int:
        """Bytes of one report: the header, the seed and the bit.

        Returns:
            53, whatever ``dim`` (checked to be an int in [1, 2**28]).
        """
        check_int("dim", dim, 1, 2**28)
        return _HEADER_BYTES + _BODY_BYTES

    def variance(self, dim: int) -> float:
        """``E||g_hat - g||_2^2 <= E||g_hat||_2^2 = (C / (c m_d))^2`` (the bound, for every input).

        Returns:
            The bound (float).
        """
        return self.scale(dim) ** 2

    def label(self, dim: int) -> str:
        """The mechanism's name and parameters, as the ledger records them.

        Returns:
            e.g. ``"duchi-l2(d=650,C=1,eps0=2)"``.
        """
        return f"duchi-l2(d={dim},C={self.clip:g},eps0={self.eps0:g})"

    def __repr__(self) -> str:
        return f"DuchiMechanism(eps0={self.eps0}, clip_l2={self.clip}, p_lo={self.p_lo!r}, p_hi={self.p_hi!r})"
