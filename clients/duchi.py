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

Report: the 20-byte mechanism header (magic ``b"SDD2"``), the 32-byte seed and one byte ``b in {0, 1}``: 53 bytes
whatever d. The magic also names the derivation of ``z`` from the seed
(:func:`shuffledp.clients.sphere.directions_from_seeds`: Box-Muller with the angle drawn as a quarter-turn arc
and one of four arcs): a report made with another derivation carries another magic (``b"SDPD"`` for the angle
``2 pi u``) and is refused, never decoded with another direction.

Batches. :meth:`DuchiMechanism.randomize_batch` randomizes k updates at once and :meth:`DuchiMechanism.randomize`
is it on a batch of one. Each client takes a fixed ``32 + 8 W`` bytes of the CSPRNG, its seed then its coin's
``W`` words (:func:`shuffledp.clients.coins.coin_words` of ``p_lo``: the same for every input), client after
client, so a batch consumes the keystream exactly as the same clients randomized one at a time would.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from shuffledp.clients.coins import bernoulli_words, check_l2_parameters, coin_words, rr_epsilon, rr_interval
from shuffledp.clients.noise import ChaCha20Rng
from shuffledp.clients.report import DecodedBatch, Payloads, encode_mechanism_header, read_mechanism_reports
from shuffledp.clients.sphere import SEED_BYTES, clip_l2_rows_and_norms, directions_from_seeds, row_norms
from shuffledp.clients.validation import check_int

__all__ = ["DUCHI_MAGIC", "DuchiMechanism", "mean_abs_coordinate"]

DUCHI_MAGIC = b"SDD2"
_HEADER_BYTES = 20
_BODY_BYTES = SEED_BYTES + 1
_BLOCK_ELEMENTS = 2**16  # a batch's directions are derived and projected this many coordinates at a time


@functools.lru_cache(maxsize=64)
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

    def flip_probabilities(self, x: np.ndarray) -> np.ndarray:
        """``P[b = +1]`` for each signed, scaled projection in ``x``.

        Returns:
            float64 ``clamp(1/2 + x (p_hi - 1/2), p_lo, p_hi)`` elementwise, the clamp last: always in
            ``[p_lo, p_hi]`` (a non-finite ``x`` gives 1/2).
        """
        x = np.asarray(x, dtype=np.float64)
        finite = np.isfinite(x)
        p = 0.5 + self.half_gap * np.where(finite, x, 0.0)
        return np.where(finite, np.minimum(np.maximum(p, self.p_lo), self.p_hi), 0.5)

    def flip_probability(self, x: float) -> float:
        """``P[b = +1]`` for one projection ``x`` (:meth:`flip_probabilities`).

        Returns:
            A float in ``[p_lo, p_hi]``.
        """
        return float(self.flip_probabilities(np.array([x], dtype=np.float64))[0])

    def projections(self, g: np.ndarray, z: np.ndarray, norms: np.ndarray | None = None) -> np.ndarray:
        """``x_i = sign(<g_i, z_i>) min(1, ||g_i||_2 / C)`` for clipped updates and directions, row by row.

        Args:
            g: clipped updates ``(k, d)``; z: directions ``(k, d)``.
            norms: ``row_norms(g)`` if already known.

        Returns:
            float64 ``(k,)`` in [-1, 1] (0 where ``<g_i, z_i> = 0``).
        """
        dot = np.einsum("ij,ij->i", g, z)
        scale = np.minimum(1.0, (row_norms(g) if norms is None else norms) / self.clip)
        zero = (dot == 0.0) | ~np.isfinite(dot)
        return np.where(zero, 0.0, np.copysign(scale, np.where(zero, 1.0, dot)))

    def projection(self, g: np.ndarray, z: np.ndarray) -> float:
        """``x = sign(<g, z>) min(1, ||g||_2 / C)`` for one clipped update and direction (:meth:`projections`).

        Returns:
            The float x in [-1, 1] (0 when ``<g, z> = 0``).
        """
        return float(self.projections(np.asarray(g, dtype=np.float64).reshape(1, -1),
                                      np.asarray(z, dtype=np.float64).reshape(1, -1))[0])

    @property
    def coin_words(self) -> int:
        """The 64-bit words of every coin (:func:`shuffledp.clients.coins.coin_words` of ``p_lo``)."""
        return coin_words(self.p_lo)

    def randomize_batch(self, vecs: np.ndarray) -> np.ndarray:
        """Randomize k updates: for each, clip to L2 radius C, take a seed and its direction, send one exact
        randomized-response bit (module docstring).

        Args:
            vecs: real ``(k, d)``, one update per row.

        Returns:
            uint8 ``(k, 53)``: row i is the report of ``vecs[i]``.

        Raises:
            ValueError: ``vecs`` has a non-finite entry or no column.
        """
        g, norms = clip_l2_rows_and_norms(vecs, self.clip)
        k, d = g.shape
        check_int("the update's size", d, 1, 2**28)
        width = self.coin_words
        draws = self.rng.random_bytes(k * (SEED_BYTES + 8 * width)).reshape(k, SEED_BYTES + 8 * width)
        seeds = draws[:, :SEED_BYTES]
        words = np.ascontiguousarray(draws[:, SEED_BYTES:]).view(">u8").astype(np.uint64)
        x = np.empty(k)
        step = min(k, max(1, _BLOCK_ELEMENTS // d))
        z = np.empty((step, d))
        for lo in range(0, k, step):
            block = z[:min(step, k - lo)]
            directions_from_seeds(seeds[lo:lo + step], d, out=block)
            x[lo:lo + step] = self.projections(g[lo:lo + step], block, norms[lo:lo + step])
        bits = bernoulli_words(self.flip_probabilities(x), words)
        out = np.empty((k, _HEADER_BYTES + _BODY_BYTES), dtype=np.uint8)
        out[:, :_HEADER_BYTES] = np.frombuffer(encode_mechanism_header(DUCHI_MAGIC, d, self.eps_used), dtype=np.uint8)
        out[:, _HEADER_BYTES:_HEADER_BYTES + SEED_BYTES] = seeds
        out[:, -1] = bits
        return out

    def randomize(self, vec: np.ndarray) -> bytes:
        """Clip to L2 radius C, draw a seed and its direction, send one exact randomized-response bit
        (:meth:`randomize_batch` on one update).

        Returns:
            The fixed-length report (:meth:`report_length`).

        Raises:
            ValueError: ``vec`` has a non-finite entry or is empty.
        """
        return self.randomize_batch(np.asarray(vec).reshape(1, -1))[0].tobytes()

    def scale(self, dim: int) -> float:
        """The decode factor ``C / (c m_d)`` with ``c = 2 p_hi - 1``.

        Returns:
            The factor (float): ``g_hat = scale * b * z``; also ``||g_hat||_2`` for every report.
        """
        return self.clip / ((2.0 * self.half_gap) * mean_abs_coordinate(dim))

    def decode_batch(self, reports: Payloads, dim: int) -> DecodedBatch:
        """The unbiased estimates ``C / (c m_d) * b z`` of a batch of reports (module docstring); a malformed report
        (magic, version, dimension, length, bit not 0 or 1) is refused, not raised.

        Args:
            reports: a ``(k, 53)`` uint8 array or a sequence of payloads.
            dim: the model's dimension.

        Returns:
            :class:`shuffledp.clients.report.DecodedBatch` (float64 ``(k, dim)``).
        """
        body, refused = read_mechanism_reports(reports, magic=DUCHI_MAGIC, expected_dim=dim, body_bytes=_BODY_BYTES)
        bits = body[:, -1]
        bad_bit = bits > 1
        if bad_bit.any():
            for i in np.flatnonzero(bad_bit):
                refused.setdefault(int(i), f"the duchi report's bit must be 0 or 1, got {bits[i]}")
        s = self.scale(dim)
        signed = np.where(bits == 1, s, -s)
        seeds = body[:, :SEED_BYTES]
        if not refused:
            return DecodedBatch(directions_from_seeds(seeds, dim, scales=signed), refused)
        out = np.zeros((body.shape[0], dim))
        ok = np.ones(body.shape[0], dtype=bool)
        ok[list(refused)] = False
        out[ok] = directions_from_seeds(seeds[ok], dim, scales=signed[ok])
        return DecodedBatch(out, refused)

    def decode(self, report: bytes, dim: int) -> np.ndarray:
        """The unbiased estimate ``C / (c m_d) * b z`` of the client's clipped update (:meth:`decode_batch` on one
        report).

        Returns:
            A float64 vector of shape ``(dim,)``.

        Raises:
            ReportError: a malformed report (magic, version, dimension, length, bit not 0 or 1).
        """
        return self.decode_batch([report], dim).only()

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
