"""PrivUnit2 (Bhowmick, Duchi, Freudiger, Kapoor, Rogers, "Protection against reconstruction and its
applications in private federated learning", arXiv:1812.00984, 2018, Algorithm 1) on the L2-clipped update,
sampled by rejection from a data-independent proposal.

Mechanism. The update is clipped to L2 radius C: ``g``. Its direction ``u`` is rounded to ``+-u`` with
``P[+] = 1/2 + ||g||_2 / (2C)`` (so that ``E[+-u] C = g``; Duchi, Jordan, Wainwright, JASA 2018, use the same
rounding). PrivUnit2 then outputs a point ``V`` of the unit sphere: with probability ``p`` uniform on the cap
``{v : <v, +-u> >= gamma}``, else uniform on its complement. Its density ratio between any two unit inputs is
``(p / (1 - p)) * ((1 - A) / A)`` with ``A`` the cap's share of the sphere, ``A = I_{1 - gamma^2}((d-1)/2, 1/2) / 2``
(regularised incomplete beta). eps0 is split as ``log(p / (1 - p)) + log((1 - A) / A)``, the same way for every
``d``: ``eps_cap = 2 eps0 / 3`` (at most 6.9) and ``eps_p = eps0 - eps_cap``
(:func:`shuffledp.accounting.privunit_box.privunit_split`). Why fixed, not searched per ``d`` (as Asi, Feldman,
Talwar, ICML 2022, optimise PrivUnit's parameters numerically): with a split of eps0 alone every report's
likelihood ratio against the uniform law on the sphere lies in a box ``[L, e^eps0 L]`` that depends on eps0 only
(:func:`shuffledp.accounting.privunit_box.privunit_blanket_box`), the box a privacy-blanket accountant needs, whose
bounds see eps0 and n but not d. Against the best of 255 splits per ``d`` the fixed split loses at most 0.4% of
``m`` below (the variance is ``C^2 / m^2``) for d >= 10 and eps0 in [1, 6], about 1% at eps0 in [8, 10], and up to
10% at d = 2, 5% at d = 3 (tests/clients/test_privunit_box.py compares them).

Sampling (where the data enter). The region coin (cap or not) is drawn with probability ``p`` exactly
(:func:`shuffledp.clients.coins.bernoulli`), independently of the data. Then uniform directions are drawn from
the CSPRNG (:func:`shuffledp.clients.sphere.directions`), independently of the data, until one falls in the drawn
region; the data enter only through that acceptance test ``<V, +-u> >= gamma``. Floating point can therefore
change only the proposal mass of the tested region, never which outputs are possible; ``gamma`` is chosen with
a relative margin :data:`CAP_MARGIN` on the cap mass for that. docs/mechanisms.md gives the argument and its
assumption (the accuracy of the platform's ``log``, ``cos``, ``sin``); it is not certified in code, so PrivUnit2
is research-only: a deployed client refuses it (:data:`shuffledp.clients.mechanism.RESEARCH_ONLY`).

Decode (unbiased). With ``t = <V, u>`` of density proportional to ``(1 - t^2)^((d-3)/2)``,
``E[t 1{t >= gamma}] = K = (1 - gamma^2)^((d-1)/2) / ((d - 1) B(1/2, (d-1)/2))``, so ``E[V] = m u`` with
``m = K (p / A - (1 - p) / (1 - A))`` (Bhowmick et al., Sec. 4.1) and ``g_hat = (C / m) V`` has ``E[g_hat] = g`` and
``||g_hat||_2^2 = C^2 / m^2``.

Report: the 20-byte mechanism header (magic ``b"SDU2"``) and ``V`` as float32[d] (rounding ``V`` is
post-processing; it moves the estimate by a relative 2**-24 at most). The magic names the split rule too: a report
of the per-``d`` split (magic ``b"SDPU"``) has another ``m`` and is refused, never decoded with this one.

Batches. :meth:`PrivUnit2Mechanism.randomize_batch` randomizes k updates at once (:meth:`randomize` is it on a
batch of one): the sign and region coins of every client first (one 64-bit word each, from the CSPRNG), then
rounds of proposals, each client taking the first of its proposals that falls in its drawn region. The proposals
are iid uniform directions whatever the data, so each client's output has the law above.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from shuffledp.accounting.privunit_box import (
    EPS_CAP_MAX,
    PRIVUNIT_MAX_EPS0,
    PRIVUNIT_MIN_EPS0,
    privunit_blanket_box,
    privunit_split,
)
from shuffledp.clients.coins import (
    RR_MAX_EPS0,
    bernoulli_words,
    check_l2_parameters,
    coin_words,
    exp_lower,
    rr_interval,
)
from shuffledp.clients.noise import ChaCha20Rng
from shuffledp.clients.report import DecodedBatch, Payloads, encode_mechanism_header, read_mechanism_reports
from shuffledp.clients.sphere import clip_l2_rows, directions, unit_rows
from shuffledp.clients.validation import check_int, check_positive_finite

__all__ = ["PRIVUNIT_MAGIC", "CAP_MARGIN", "MIN_CAP_MASS", "PrivUnitParams", "privunit_params", "cap_mass",
           "PrivUnit2Mechanism"]

#: The report's magic; it names the split rule too, so a report of another rule (``b"SDPU"``: a split searched per
#: d, another ``m``) is refused, never decoded with this rule's ``m``.
PRIVUNIT_MAGIC = b"SDU2"
#: The cap mass used in the privacy bound is ``A * (1 - CAP_MARGIN)``: the float acceptance test may shrink the
#: tested cap's proposal mass by this much (relatively) before the loss exceeds eps0 (docs/mechanisms.md).
CAP_MARGIN = 2.0**-10
#: No cap holds less of the sphere (the rejection sampler would draw more than about 1 / MIN_CAP_MASS directions
#: per report); the split's largest eps_cap keeps above it (checked at import: :func:`_check_split_constants`).
MIN_CAP_MASS = 2.0**-10
#: The relative slack on the cap mass a client needs (:func:`_need`).
_NEED_SLACK = 2.0**-30
_HEADER_BYTES = 20
_MAX_BATCH_ELEMENTS = 2**22
_NORM_TOLERANCE = 1e-4


def cap_mass(gamma: float, d: int) -> float:
    """The share of the unit sphere of R^d in the cap ``{v : <v, u> >= gamma}`` (Bhowmick et al. 2018, Sec. 4.1).

    Returns:
        ``I_{1 - gamma^2}((d-1)/2, 1/2) / 2`` for ``gamma >= 0`` (one minus that at ``-gamma`` otherwise).
    """
    from scipy.special import betainc

    half = 0.5 * float(betainc((d - 1) / 2.0, 0.5, 1.0 - gamma * gamma))
    return half if gamma >= 0 else 1.0 - half


@dataclass(frozen=True)
class PrivUnitParams:
    """PrivUnit2's parameters for one (eps0, d): region probability ``p``, cap threshold ``gamma``, cap mass ``A``,
    the decode factor ``m`` (``E[V] = m u``) and the privacy loss they give, with the cap margin."""

    d: int
    p: float
    gamma: float
    cap: float
    m: float
    eps_used: float


def _log_k(gamma: float, d: int) -> float:
    from scipy.special import betaln

    a = (d - 1) / 2.0
    return a * math.log1p(-gamma * gamma) - math.log(d - 1) - float(betaln(0.5, a))


def _eps(p: float, cap: float) -> float:
    low = cap * (1.0 - CAP_MARGIN)
    return (math.log(p) - math.log1p(-p)) + (math.log1p(-low) - math.log(low))


def _gamma_for(cap: float, d: int) -> float:
    """The threshold whose cap has mass about ``cap`` (< 1/2); the caller recomputes the mass."""
    from scipy.special import betaincinv

    g2 = float(betaincinv(0.5, (d - 1) / 2.0, 1.0 - 2.0 * cap))  # gamma^2: I_{gamma^2}(1/2, (d-1)/2) = 1 - 2A
    return math.sqrt(min(max(g2, 0.0), 1.0))


def _need(eps_cap: float) -> float:
    """The cap mass a client needs at ``eps_cap``: ``A (1 - CAP_MARGIN) >= 1 / (1 + e^eps_cap)``, raised by a
    relative :data:`_NEED_SLACK`, far above the rounding of this float expression.

    Returns:
        ``(1 + _NEED_SLACK) / ((1 + e^eps_cap) (1 - CAP_MARGIN))``.
    """
    return (1.0 + _NEED_SLACK) / ((1.0 + math.exp(eps_cap)) * (1.0 - CAP_MARGIN))


def _check_split_constants() -> None:
    """The split's constants (:mod:`shuffledp.accounting.privunit_box`) fit this client's: the same eps0 range,
    every cap at least :data:`MIN_CAP_MASS`, and room below a hemisphere for the cap at the smallest eps0."""
    if PRIVUNIT_MAX_EPS0 != RR_MAX_EPS0:
        raise RuntimeError(f"privunit2's largest eps0 {PRIVUNIT_MAX_EPS0} differs from the coins' {RR_MAX_EPS0}")
    if not _need(EPS_CAP_MAX) >= MIN_CAP_MASS:
        raise RuntimeError(f"the split's largest eps_cap {EPS_CAP_MAX} gives a cap below MIN_CAP_MASS")
    if not _need(privunit_split(PRIVUNIT_MIN_EPS0)[1]) <= 0.5 * (1.0 - 2.0**-12):
        raise RuntimeError(f"at eps0 = {PRIVUNIT_MIN_EPS0} the cap with CAP_MARGIN leaves no room below 1/2")


_check_split_constants()


@functools.lru_cache(maxsize=64)
def privunit_params(eps0: float, d: int) -> PrivUnitParams:
    """The PrivUnit2 parameters for ``eps0`` and dimension ``d`` at the split of eps0 that does not depend on d
    (:func:`shuffledp.accounting.privunit_box.privunit_split`; Bhowmick et al. 2018, Theorem 1 and Sec. 4.1).

    The split is fixed so that the likelihood-ratio box of the reports against the uniform law depends on eps0
    only (:func:`shuffledp.accounting.privunit_box.privunit_blanket_box`, the box a privacy-blanket accountant
    needs); choosing it per d would move the box with d. Against the best of 255 splits per d it costs at most
    0.4% of ``m`` for d >= 10 and eps0 in [1, 6], about 1% at eps0 in [8, 10] (tests/clients/test_privunit_box.py).

    The region coin's ``p`` is the largest float ``<= E / (1 + E)`` for a certified ``E <= e^eps_p``
    (:func:`shuffledp.clients.coins.rr_interval`), so ``log(p / (1 - p)) <= eps_p`` exactly; ``gamma`` is a
    threshold whose cap mass ``A`` is at least :func:`_need`, so that ``A (1 - CAP_MARGIN) >= 1 / (1 + e^eps_cap)``
    (checked in rationals against a certified lower bound on ``e^eps_cap``). These two make the budget
    ``eps_p + eps_cap <= eps0`` hold, and the reports' box ``[(1 - p) / (1 - A_low), p / A_low]`` (``A_low = A (1 -
    CAP_MARGIN)``) lie in :func:`~shuffledp.accounting.privunit_box.privunit_blanket_box` (checked in floats).

    Returns:
        :class:`PrivUnitParams` with ``eps_used <= eps0`` counted with the cap margin.

    Raises:
        ValueError: ``d < 2``, or eps0 outside privunit2's range (:func:`privunit_split`).
        ArithmeticError: a check above fails (a float evaluation off by more than its stated slack).
    """
    eps = check_positive_finite("eps0", eps0)
    if eps > RR_MAX_EPS0:
        raise ValueError(f"eps0 must be <= {RR_MAX_EPS0} for privunit2, got {eps0!r}")
    eps_p, eps_cap = privunit_split(eps)
    d = check_int("d", d, 2, 2**28)
    p = rr_interval(eps_p)[1]
    need = _need(eps_cap)
    gamma = _gamma_for(need, d)
    cap = cap_mass(gamma, d)
    step = max(gamma * 2.0**-40, 2.0**-60)
    while cap < need and gamma > 0.0:  # the inverse is approximate: lower the threshold until the mass fits
        gamma = max(0.0, gamma - step)
        step *= 2.0
        cap = cap_mass(gamma, d)
    if not need <= cap < 0.5:
        raise ArithmeticError(f"privunit2 found no cap of mass in [{need!r}, 1/2) for eps0={eps!r}, d={d}")
    low = Fraction(cap) * (1 - Fraction(CAP_MARGIN))  # A_low, exactly
    if not low * (1 + exp_lower(eps_cap)) >= 1:
        raise ArithmeticError(f"privunit2's counted cap mass {float(low)!r} is below 1 / (1 + e^{eps_cap!r})")
    used = _eps(p, cap)
    lo_box, log_ratio = privunit_blanket_box(eps)
    low_f = cap * (1.0 - CAP_MARGIN)
    log_lo, log_hi = math.log1p(-p) - math.log1p(-low_f), math.log(p) - math.log(low_f)
    if used > eps or log_lo < math.log(lo_box) or log_hi > math.log(lo_box) + log_ratio:
        raise ArithmeticError(f"privunit2 at eps0={eps!r}, d={d} spends {used!r} or leaves its eps0-only box")
    m = math.exp(_log_k(gamma, d)) * (p / cap - (1.0 - p) / (1.0 - cap))
    return PrivUnitParams(d=d, p=p, gamma=gamma, cap=cap, m=m, eps_used=used)


class PrivUnit2Mechanism:
    """eps0-LDP randomizer of an L2-clipped update by PrivUnit2 (module docstring; Bhowmick, Duchi, Freudiger,
    Kapoor, Rogers, arXiv:1812.00984, 2018), research-only (docs/mechanisms.md).

    Args:
        eps0: the pinned local epsilon, in [0.006, 64] (:func:`privunit_split`).
        clip_l2: the L2 clip radius C > 0.
        rng: the CSPRNG (coins and directions). Default: a :class:`ChaCha20Rng` keyed from ``os.urandom``.
    """

    name = "privunit2"

    def __init__(self, eps0: float, clip_l2: float, *, rng: ChaCha20Rng | None = None) -> None:
        self.eps0, self.clip = check_l2_parameters(eps0, clip_l2, "privunit2")
        privunit_split(self.eps0)  # refuses an eps0 below privunit2's range at construction
        self.rng = rng if rng is not None else ChaCha20Rng()

    def params(self, dim: int) -> PrivUnitParams:
        """The parameters for dimension ``dim`` (:func:`privunit_params`).

        Returns:
            :class:`PrivUnitParams`.
        """
        if isinstance(dim, int) and not isinstance(dim, bool) and dim < 2:
            raise ValueError(f"privunit2 needs an update of at least 2 coordinates (the sphere of R^1 has no caps), "
                             f"got d={dim}")
        return privunit_params(self.eps0, check_int("dim", dim, 2, 2**28))

    def sample_rows(self, u: np.ndarray, in_cap: np.ndarray, par: PrivUnitParams) -> np.ndarray:
        """One PrivUnit2 output per row of ``u`` given its region coin: rejection from uniform directions.

        Clients are served in blocks of at most :data:`_MAX_BATCH_ELEMENTS` proposal coordinates; in each round a
        pending client gets ``max(8, ceil(2 / share))`` fresh proposals (``share`` its region's mass, capped by the
        block) and keeps the first in its region ``<v, u_i> >= gamma`` (cap) or ``<`` (rest).

        Args:
            u: float64 ``(k, d)`` unit rows (the rounded directions ``+-u``).
            in_cap: bool ``(k,)``: the region coins.
            par: the parameters for ``d``.

        Returns:
            float64 ``(k, d)`` unit rows.
        """
        k, d = u.shape
        out = np.empty((k, d))
        per = np.where(in_cap, math.ceil(2.0 / par.cap), math.ceil(2.0 / (1.0 - par.cap)))
        per = np.minimum(np.maximum(8, per), max(1, _MAX_BATCH_ELEMENTS // d))
        pending = np.arange(k)
        while pending.size:
            # the next block of pending clients whose proposals fit in the element budget (at least one client)
            take = max(1, int(np.searchsorted(np.cumsum(per[pending]) * d, _MAX_BATCH_ELEMENTS, side="right")))
            block, rest = pending[:take], pending[take:]
            counts = per[block]
            v = directions(int(counts.sum()), d, self.rng)
            owner = np.repeat(np.arange(block.size), counts)
            hits = (np.einsum("ij,ij->i", v, u[block][owner]) >= par.gamma) == in_cap[block][owner]
            hit = np.flatnonzero(hits)
            who, at = np.unique(owner[hit], return_index=True)  # each client's first hit, in proposal order
            first = np.full(block.size, -1)
            first[who] = hit[at]
            done = first >= 0
            out[block[done]] = v[first[done]]
            pending = np.concatenate([block[~done], rest])
        return out

    def sample(self, u: np.ndarray, par: PrivUnitParams) -> np.ndarray:
        """One PrivUnit2 output for the unit vector ``u``: the region coin, then rejection from uniform directions.

        Returns:
            A float64 unit vector of shape ``(d,)``.
        """
        width = coin_words(par.p)
        in_cap = bernoulli_words(np.array([par.p]), self.rng.random_bytes(8 * width).view(">u8").reshape(1, width))
        return self.sample_rows(np.asarray(u, dtype=np.float64).reshape(1, -1), in_cap, par)[0]

    def randomize_batch(self, vecs: np.ndarray) -> np.ndarray:
        """Randomize k updates: for each, clip to L2 radius C, round the direction's sign by the norm, and apply
        PrivUnit2 (module docstring).

        Args:
            vecs: real ``(k, d)``, one update per row.

        Returns:
            uint8 ``(k, 20 + 4 d)``: row i is the report of ``vecs[i]``.

        Raises:
            ValueError: ``vecs`` has a non-finite entry or fewer than 2 columns.
        """
        g = clip_l2_rows(vecs, self.clip)
        k, d = g.shape
        par = self.params(d)
        u, norm = unit_rows(g)
        keep_p = 0.5 + 0.5 * np.minimum(1.0, norm / self.clip)
        w_keep, w_cap = coin_words(0.5), coin_words(par.p)
        words = self.rng.random_bytes(8 * k * (w_keep + w_cap)).view(">u8").reshape(k, w_keep + w_cap)
        keep = bernoulli_words(keep_p, words[:, :w_keep].astype(np.uint64))
        in_cap = bernoulli_words(np.full(k, par.p), words[:, w_keep:].astype(np.uint64))
        v = self.sample_rows(np.where(keep[:, None], u, -u), in_cap, par)
        out = np.empty((k, _HEADER_BYTES + 4 * d), dtype=np.uint8)
        out[:, :_HEADER_BYTES] = np.frombuffer(encode_mechanism_header(PRIVUNIT_MAGIC, par.d, par.eps_used),
                                               dtype=np.uint8)
        out[:, _HEADER_BYTES:] = v.astype("<f4").view(np.uint8)
        return out

    def randomize(self, vec: np.ndarray) -> bytes:
        """Clip to L2 radius C, round the direction's sign by the norm, and apply PrivUnit2
        (:meth:`randomize_batch` on one update).

        Returns:
            The fixed-length report (:meth:`report_length`).

        Raises:
            ValueError: ``vec`` has a non-finite entry or fewer than 2 entries.
        """
        return self.randomize_batch(np.asarray(vec).reshape(1, -1))[0].tobytes()

    def decode_batch(self, reports: Payloads, dim: int) -> DecodedBatch:
        """The unbiased estimates ``(C / m) V`` of a batch of reports; a malformed report, or one whose ``V`` is
        not finite or not of unit norm (within 1e-4), is refused, not raised.

        Args:
            reports: a ``(k, 20 + 4 dim)`` uint8 array or a sequence of payloads.
            dim: the model's dimension.

        Returns:
            :class:`shuffledp.clients.report.DecodedBatch` (float64 ``(k, dim)``).
        """
        par = self.params(dim)
        body, refused = read_mechanism_reports(reports, magic=PRIVUNIT_MAGIC, expected_dim=dim, body_bytes=4 * dim)
        v = body.view("<f4").astype(np.float64)
        finite = np.isfinite(v).all(axis=1)
        if not finite.all():
            for i in np.flatnonzero(~finite):
                refused.setdefault(int(i), "the privunit2 report has non-finite coordinates")
            v[~finite] = 0.0
        norm = np.sqrt(np.einsum("ij,ij->i", v, v))
        off = np.abs(norm - 1.0) > _NORM_TOLERANCE
        if off.any():
            for i in np.flatnonzero(off):
                refused.setdefault(int(i), f"the privunit2 report's vector has norm {float(norm[i])!r}, not 1")
        out = (self.clip / par.m) * v
        if refused:
            out[list(refused)] = 0.0
        return DecodedBatch(out, refused)

    def decode(self, report: bytes, dim: int) -> np.ndarray:
        """The unbiased estimate ``(C / m) V`` of the client's clipped update (:meth:`decode_batch` on one report).

        Returns:
            A float64 vector of shape ``(dim,)``.

        Raises:
            ReportError: a malformed report, or a ``V`` that is not finite or not of unit norm (within 1e-4).
        """
        return self.decode_batch([report], dim).only()

    def report_length(self, dim: int) -> int:
        """Bytes of one report.

        Returns:
            ``20 + 4 * dim``.
        """
        return _HEADER_BYTES + 4 * check_int("dim", dim, 2, 2**28)

    def variance(self, dim: int) -> float:
        """``E||g_hat||_2^2 = (C / m)^2``, a bound on the estimate's variance for every input.

        Returns:
            The bound (float).
        """
        return (self.clip / self.params(dim).m) ** 2

    def label(self, dim: int) -> str:
        """The mechanism's name and parameters, as the ledger records them.

        Returns:
            e.g. ``"privunit2-l2(d=650,C=1,eps0=2,p=0.73,gamma=0.041)"``.
        """
        par = self.params(dim)
        return f"privunit2-l2(d={dim},C={self.clip:g},eps0={self.eps0:g},p={par.p:.6g},gamma={par.gamma:.6g})"

    def __repr__(self) -> str:
        return f"PrivUnit2Mechanism(eps0={self.eps0}, clip_l2={self.clip})"
