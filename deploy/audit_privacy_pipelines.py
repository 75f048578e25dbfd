"""The randomizer pipelines that ``shuffledp audit privacy`` attacks: the project's real discrete Laplace
randomizer, and two pipelines that are BROKEN ON PURPOSE (they exist only to show that the audit catches real
flaws; they are not mechanisms, are not registered in :mod:`shuffledp.clients.mechanism`, and nothing outside the
audit uses them).

Every pipeline produces, for one hypothesis (``"a"``: the canary holds ``+C e1``; ``"b"``: it holds ``-C e1``)
and a number of independent trials, the score of one round's shuffled multiset of ``n`` reports (the canary's and
the ``n - 1`` others', see :class:`AuditInstance`). A score is a symmetric function of the multiset (the server
sees the multiset only, so the order of the reports never enters and no permutation is drawn in-process).

* :class:`LaplacePipeline` (real): the noise comes from the randomizer's own exact sampler and CSPRNG
  (:class:`shuffledp.clients.randomizer.DiscreteLaplaceRandomizer`: ``quantize`` then ``sampler.sample``). The
  bulk path draws the noise of all reports of many trials in one call of the same sampler: ``privatize(x)`` is
  ``quantize(x) + sampler.sample(d, rng)`` with iid coordinates and independent calls, so one call of ``m * d``
  samples has exactly the distribution of ``m`` calls of ``d``; the int32 saturation of
  :func:`shuffledp.clients.report.encode_report` is applied as post-processing. :meth:`LaplacePipeline.per_report`
  runs the client's real ``Mechanism.randomize`` and the server's decoder per report (tests compare the two).
  The score is the exact log likelihood ratio of the multiset (product-form noise, identical other inputs):
  ``log sum_j p_a(y_j)/q(y_j) - log sum_j p_b(y_j)/q(y_j)``, in log space (log-sum-exp).
* :class:`BrokenPerRecordPipeline` (BROKEN): noise calibrated to one record's sensitivity, scale
  ``2C / (eps0 m)`` (Algorithm 1 of Chen, Cao, Ge, ICASSP 2024), so each report is only ``(m eps0)``-LDP.
* :class:`BrokenNumpyFloatPipeline` (BROKEN): ``numpy.random.RandomState.laplace(loc=x, scale=2C/eps0)`` in
  float64 (the textbook float sampler; Mironov, CCS 2012): the set of floats an input can produce depends on the
  input. Its score counts the reports that no remaining input could have produced (:func:`float_laplace_member`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
from scipy.special import logsumexp

from shuffledp.clients.mechanism import LaplaceMechanism, make_mechanism
from shuffledp.clients.noise import ChaCha20Rng, DiscreteLaplaceSampler
from shuffledp.clients.randomizer import NOISE_LOG2_DEN
from shuffledp.clients.report import INT_MAX, decode_report_full

__all__ = ["AuditInstance", "OTHERS", "HYPOTHESES", "LaplacePipeline", "BrokenPerRecordPipeline",
           "BrokenNumpyFloatPipeline", "float_laplace_member", "make_pipeline", "PIPELINES"]

#: The other clients' fixed input: ``orthogonal`` = ``+C e2`` (L1 distance 2C, the diameter, from both canary
#: inputs: the least cover the ball allows), ``same`` = ``-C e1`` (the canary's second input), ``zero`` = 0.
OTHERS = ("orthogonal", "same", "zero")
HYPOTHESES = ("a", "b")
#: Reports (n * d entries) drawn per chunk of trials: bounds the memory of one chunk to ~100 MB.
_CHUNK_ENTRIES = 2_000_000


@dataclass(frozen=True)
class AuditInstance:
    """The audited neighbouring pair: one canary client with input ``+C e1`` (hypothesis a) or ``-C e1`` (b),
    opposite vertices of the L1 clip ball (the L1 sensitivity 2C is attained), and ``n - 1`` clients whose
    input is fixed (:data:`OTHERS`).

    Args:
        eps0: the local epsilon the mechanism is configured with.
        n: reports per round (the canary's included), >= 2.
        clip: the L1 clip radius C.
        dim: the report's dimension, >= 2 for ``orthogonal`` (coordinates past the second are 0 for everyone and
            carry no information about the canary).
        others: one of :data:`OTHERS`.
        log2_grid: the laplace randomizer's grid exponent (None: its default for eps0 and C, the grid the clients
            use; an integer, e.g. -1 for K = 2 grid steps per C, makes the instance small enough to enumerate
            exactly; the randomizer validates it).
    """

    eps0: float
    n: int
    clip: float = 1.0
    dim: int = 2
    others: str = "orthogonal"
    log2_grid: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.eps0, (int, float)) and math.isfinite(self.eps0) and 0 < self.eps0 <= 64):
            raise ValueError(f"eps0 must be a number in (0, 64], got {self.eps0!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 2 <= self.n <= 1_000_000:
            raise ValueError(f"n must be an int in [2, 1000000] (the canary and at least one other), got {self.n!r}")
        if not (isinstance(self.clip, (int, float)) and math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"clip must be a finite number > 0, got {self.clip!r}")
        if self.others not in OTHERS:
            raise ValueError(f"others must be one of {', '.join(OTHERS)}, got {self.others!r}")
        low = 2 if self.others == "orthogonal" else 1
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or not low <= self.dim <= 64:
            raise ValueError(f"dim must be an int in [{low}, 64] for others={self.others!r}, got {self.dim!r}")
        if self.log2_grid is not None and (isinstance(self.log2_grid, bool) or not isinstance(self.log2_grid, int)):
            raise ValueError(f"log2_grid must be None (the default grid) or an int, got {self.log2_grid!r}")

    def inputs(self) -> dict[str, np.ndarray]:
        """Returns the real-valued inputs: ``{"a": +C e1, "b": -C e1, "o": the others' input}``."""
        a = np.zeros(self.dim)
        a[0] = self.clip
        o = np.zeros(self.dim)
        if self.others == "orthogonal":
            o[1] = self.clip
        elif self.others == "same":
            o = -a
        return {"a": a, "b": -a, "o": o}


def _chunks(trials: int, entries_per_trial: int) -> list[int]:
    size = max(1, _CHUNK_ENTRIES // max(1, entries_per_trial))
    return [min(size, trials - start) for start in range(0, trials, size)]


def _check_hyp(hyp: str) -> str:
    if hyp not in HYPOTHESES:
        raise ValueError(f"hypothesis must be 'a' or 'b', got {hyp!r}")
    return hyp


class LaplacePipeline:
    """The project's real randomizer (``make_mechanism("laplace", ...)``), attacked with the exact likelihood
    ratio (module docstring).

    Args:
        instance: the audited pair and the others' input.
        rng: the CSPRNG of the noise (default: the mechanism's own, keyed from ``os.urandom``); tests may pass a
            fixed-key :class:`ChaCha20Rng`.
    """

    name = "laplace"
    broken = False

    def __init__(self, instance: AuditInstance, rng: ChaCha20Rng | None = None) -> None:
        self.instance = instance
        mech = make_mechanism("laplace", eps0=instance.eps0, clip_l1=instance.clip, log2_grid=instance.log2_grid,
                              rng=rng)
        assert isinstance(mech, LaplaceMechanism)
        self.mechanism = mech
        self.randomizer = mech.randomizer
        self.q = {k: self.randomizer.quantize(v) for k, v in instance.inputs().items()}
        self.noise_num = self.randomizer.noise_num
        self.sampler: DiscreteLaplaceSampler = self.randomizer.sampler

    @property
    def claimed_eps0(self) -> float:
        """The local epsilon the pipeline claims for each report (its configuration)."""
        return self.instance.eps0

    @property
    def s(self) -> float:
        """The noise parameter in grid units: ``P(z) ~ exp(-s |z|)``."""
        return self.noise_num / float(1 << NOISE_LOG2_DEN)

    def noisy(self, hyp: str, trials: int) -> np.ndarray:
        """Bulk path: ``trials`` shuffled multisets (int64, shape ``(trials, n, dim)``; row 0 is the canary's,
        the order is irrelevant to every score), noise from the randomizer's sampler and CSPRNG, saturated to
        int32 as the report encoding does."""
        inst = self.instance
        base = np.empty((trials, inst.n, inst.dim), dtype=np.int64)
        base[:, 0, :] = self.q[_check_hyp(hyp)]
        base[:, 1:, :] = self.q["o"]
        base += self.sampler.sample(base.size, self.randomizer.rng).reshape(base.shape)
        return np.clip(base, -INT_MAX, INT_MAX, out=base)

    def per_report(self, hyp: str) -> np.ndarray:
        """One multiset through the client's real ``Mechanism.randomize`` and the server's decoder, report by
        report (int64 grid values, shape ``(n, dim)``)."""
        inputs = self.instance.inputs()
        rows = [self.decode(self.mechanism.randomize(inputs[_check_hyp(hyp)]))]
        rows += [self.decode(self.mechanism.randomize(inputs["o"])) for _ in range(self.instance.n - 1)]
        return np.stack(rows)

    def decode(self, payload: bytes) -> np.ndarray:
        """A report's integer grid values, as the server decodes it (on the mechanism's expected grid)."""
        rep = decode_report_full(payload, expected_dim=self.instance.dim,
                                 expected_log2_grid=self.mechanism.expected_log2_grid)
        return rep.ints.astype(np.int64)

    def score(self, y: np.ndarray) -> np.ndarray:
        """The exact log likelihood ratio ``log P_a(multiset) / P_b(multiset)`` of each multiset.

        Args:
            y: int64 grid values, shape ``(trials, n, dim)`` (or ``(n, dim)`` for one multiset).

        Returns:
            float64 array of shape ``(trials,)`` (or a 0-d array).
        """
        y = np.asarray(y, dtype=np.int64)
        d_o = np.abs(y - self.q["o"]).sum(axis=-1)
        la = -self.s * (np.abs(y - self.q["a"]).sum(axis=-1) - d_o).astype(np.float64)
        lb = -self.s * (np.abs(y - self.q["b"]).sum(axis=-1) - d_o).astype(np.float64)
        return logsumexp(la, axis=-1) - logsumexp(lb, axis=-1)

    def round_scores(self, hyp: str, trials: int) -> np.ndarray:
        """Scores of ``trials`` independent one-round multisets under hypothesis ``hyp`` (float64)."""
        inst = self.instance
        parts = [self.score(self.noisy(hyp, m)) for m in _chunks(trials, inst.n * inst.dim)]
        return np.concatenate(parts) if parts else np.zeros(0)


class BrokenPerRecordPipeline(LaplacePipeline):
    """BROKEN ON PURPOSE: the discrete Laplace noise calibrated to one record's sensitivity ``2C / m`` (noise
    scale ``2C / (eps0 m)``; Chen, Cao, Ge, ICASSP 2024, Algorithm 1), so a report is only ``(m eps0)``-LDP while
    the pipeline claims ``eps0``. The score is the exact log likelihood ratio of the noise actually added (the
    auditor reads the implementation).

    Args:
        instance: as for :class:`LaplacePipeline`.
        records: m >= 2, the client's number of records.
    """

    name = "broken-per-record"
    broken = True

    def __init__(self, instance: AuditInstance, records: int = 10, rng: ChaCha20Rng | None = None) -> None:
        if isinstance(records, bool) or not isinstance(records, int) or not 2 <= records <= 1000:
            raise ValueError(f"records must be an int in [2, 1000], got {records!r}")
        super().__init__(instance, rng)
        self.records = records
        self.noise_num = self.randomizer.noise_num * records  # the flaw: scale divided by m
        self.sampler = DiscreteLaplaceSampler(self.noise_num, NOISE_LOG2_DEN)

    def per_report(self, hyp: str) -> np.ndarray:  # pragma: no cover - the broken pipeline has no client path
        """Refused: the broken calibration exists in the audit's bulk path only, never behind a client."""
        raise NotImplementedError("the broken pipeline exists only in the audit's bulk path")


# -- numpy's floating-point Laplace ----------------------------------------------------------------------------

_LOG = np.frompyfunc(math.log, 1, 1)  # the C library's log, as numpy's sampler calls it (np.log may differ by an ulp)
_TWO53 = float(2**53)


def _libm_log(v: np.ndarray) -> np.ndarray:
    return _LOG(v).astype(np.float64)


def _forward(k: np.ndarray, x: np.ndarray, scale: float, upper: bool) -> np.ndarray:
    """numpy's ``random_laplace(loc=x, scale)`` for the uniform ``U = k / 2**53`` (``next_double``), exactly as
    its C code computes it: ``U >= 0.5``: ``x - scale * log(2.0 - U - U)``; ``0 < U < 0.5``:
    ``x + scale * log(U + U)``. Non-decreasing in ``k`` on each half."""
    u = k.astype(np.float64) / _TWO53
    if upper:
        return x - scale * _libm_log((2.0 - u) - u)
    return x + scale * _libm_log(u + u)


def float_laplace_member(y: np.ndarray, x: np.ndarray | float, scale: float) -> np.ndarray:
    """Whether each float ``y`` is an output of ``RandomState.laplace(loc=x, scale)`` (float64), exactly.

    The sampler maps a 53-bit uniform ``k`` to a float through a map that is non-decreasing in ``k`` on each half
    (:func:`_forward`), so ``y`` is reachable iff the smallest ``k`` with ``forward(k) >= y`` hits ``y``: a
    vectorised bisection (53 steps) on the half that can reach ``y`` (``y <= x``: lower half; ``y >= x``: upper).
    The log is the C library's (``math.log``), which numpy's sampler calls.

    Args:
        y: float64 outputs (any shape).
        x: the candidate input(s), broadcastable to ``y``.
        scale: the Laplace scale.

    Returns:
        bool array shaped like ``y``.
    """
    y = np.asarray(y, dtype=np.float64)
    x = np.broadcast_to(np.asarray(x, dtype=np.float64), y.shape)
    out = np.zeros(y.shape, dtype=bool)
    for upper, lo0, hi0, sel in ((False, 1, 2**52 - 1, y <= x), (True, 2**52, 2**53 - 1, y >= x)):
        idx = np.flatnonzero(sel)
        if idx.size == 0:
            continue
        yy, xx = y.reshape(-1)[idx], x.reshape(-1)[idx]
        lo = np.full(idx.size, lo0, dtype=np.int64)
        hi = np.full(idx.size, hi0, dtype=np.int64)
        while True:  # invariant: forward(k) < y for k < lo; the answer is in [lo, hi] (hi: if any)
            active = lo < hi
            if not active.any():
                break
            mid = (lo + hi) // 2
            ge = _forward(mid, xx, scale, upper) >= yy
            hi = np.where(active & ge, mid, hi)
            lo = np.where(active & ~ge, mid + 1, lo)
        out.reshape(-1)[idx] |= _forward(lo, xx, scale, upper) == yy
    return out


class BrokenNumpyFloatPipeline:
    """BROKEN ON PURPOSE: the clipped input plus ``numpy.random.RandomState.laplace`` noise of scale ``2C/eps0``,
    released as float64 (Mironov, CCS 2012, on textbook floating-point Laplace). The generator is numpy's
    Mersenne Twister, seeded from ``os.urandom`` (that, too, is what such a pipeline does; it is no CSPRNG).

    Score: ``#{reports no input of hypothesis b could produce} - #{reports no input of hypothesis a could
    produce}``, where hypothesis b's inputs are ``{-C e1, others'}`` and a's are ``{+C e1, others'}``, by the
    exact membership test :func:`float_laplace_member` (coordinate by coordinate: the noise is drawn per
    coordinate). Under b the first count is 0, under a the second is 0: each nonzero value rules a hypothesis out.
    """

    name = "broken-numpy-float"
    broken = True

    def __init__(self, instance: AuditInstance) -> None:
        self.instance = instance
        self.scale = 2.0 * instance.clip / instance.eps0
        self.inputs = instance.inputs()
        self._rs = np.random.RandomState(int.from_bytes(os.urandom(4), "little"))

    @property
    def claimed_eps0(self) -> float:
        """The local epsilon the pipeline claims (that of the real-valued Laplace mechanism it imitates)."""
        return self.instance.eps0

    def noisy(self, hyp: str, trials: int) -> np.ndarray:
        """``trials`` multisets of float64 reports, shape ``(trials, n, dim)`` (row 0: the canary's)."""
        inst = self.instance
        loc = np.empty((trials, inst.n, inst.dim))
        loc[:, 0, :] = self.inputs[_check_hyp(hyp)]
        loc[:, 1:, :] = self.inputs["o"]
        return self._rs.laplace(loc, self.scale)

    def _member(self, y: np.ndarray, x: np.ndarray) -> np.ndarray:
        return float_laplace_member(y, x, self.scale).all(axis=-1)

    def score(self, y: np.ndarray) -> np.ndarray:
        """The score of each multiset (class docstring); float64 array of shape ``(trials,)``."""
        y = np.asarray(y, dtype=np.float64)
        from_o = self._member(y, self.inputs["o"])
        rest = ~from_o
        not_a = np.zeros(y.shape[:-1], dtype=bool)
        not_b = np.zeros(y.shape[:-1], dtype=bool)
        if rest.any():
            yr = y[rest]
            not_a[rest] = ~self._member(yr, self.inputs["a"])
            not_b[rest] = ~self._member(yr, self.inputs["b"])
        return (not_b.sum(axis=-1) - not_a.sum(axis=-1)).astype(np.float64)

    def round_scores(self, hyp: str, trials: int) -> np.ndarray:
        """Scores of ``trials`` independent one-round multisets under hypothesis ``hyp`` (float64)."""
        inst = self.instance
        parts = [self.score(self.noisy(hyp, m)) for m in _chunks(trials, inst.n * inst.dim)]
        return np.concatenate(parts) if parts else np.zeros(0)


#: The pipelines ``shuffledp audit privacy --pipeline`` accepts.
PIPELINES = ("laplace", "broken-per-record", "broken-numpy-float")


def make_pipeline(name: str, instance: AuditInstance, *, records: int = 10) -> LaplacePipeline | \
        BrokenNumpyFloatPipeline:
    """The pipeline ``name`` (one of :data:`PIPELINES`) for ``instance``.

    Args:
        name: the pipeline.
        instance: the audited pair.
        records: m, for ``broken-per-record`` only.

    Returns:
        The pipeline object.

    Raises:
        ValueError: an unknown name or a bad parameter.
    """
    if name == "laplace":
        return LaplacePipeline(instance)
    if name == "broken-per-record":
        return BrokenPerRecordPipeline(instance, records)
    if name == "broken-numpy-float":
        return BrokenNumpyFloatPipeline(instance)
    raise ValueError(f"pipeline must be one of {', '.join(PIPELINES)}, got {name!r}")
