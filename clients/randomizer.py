"""The local randomizer: L1 clipping and the exact discrete Laplace mechanism on a power-of-two grid.

Guarantee (any-input eps0-LDP). For ANY two inputs x, x' of one client, and every output y in Z^d,

    P[R(x) = y] <= exp(eps_used) * P[R(x') = y],   eps_used <= eps0.

Proof sketch. ``quantize`` maps every input to an integer vector q with ||q||_1 <= K = floor(C / gamma), using
integer arithmetic only after rounding (so float error cannot break the bound), hence ||q(x) - q(x')||_1 <= 2K.
The noise is iid discrete Laplace with ``t = exp(-s)``, ``s = num / 2**52`` and
``num = floor(eps0 * 2**52 / (2K))`` (rounded down, the safe direction), so
``P[y | x] / P[y | x'] = t**(||y - q||_1 - ||y - q'||_1) <= exp(s * 2K) = exp(eps_used)``, by the triangle
inequality. This is the pure-DP Laplace mechanism (Dwork, McSherry, Nissim, Smith 2006) in its discrete form
(Ghosh, Roughgarden, Sundararajan 2012; Canonne, Kamath, Steinke 2020), calibrated to the L1 diameter 2C of the
clipped report as shuffle amplification requires (Feldman, McMillan, Talwar 2021: each report must be eps0-LDP
for any two inputs of its sender). It is NOT calibrated to one record's sensitivity 2C/m as Algorithm 1 of
Chen, Cao, Ge (ICASSP 2024) writes: that protects one sample of the client, not the client's report.

Why discrete: textbook float Laplace sampling has a porous output set that depends on the input (Mironov, CCS
2012); integer outputs from an exact sampler driven by a CSPRNG avoid it. Everything after the noise (int32
saturation, scaling by gamma) is post-processing.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from shuffledp.clients.noise import ChaCha20Rng, DiscreteLaplaceSampler
from shuffledp.clients.report import INT_MAX, LOG2_GRID_MAX, LOG2_GRID_MIN, encode_reports
from shuffledp.clients.validation import check_positive_finite

__all__ = ["clip_l1", "clip_l1_rows", "flatten_arrays", "unflatten_vector", "DiscreteLaplaceRandomizer",
           "NOISE_LOG2_DEN"]

NOISE_LOG2_DEN = 52  # the noise parameter s = num / 2**52
MAX_RADIUS = 2**30  # K = floor(C / gamma) must stay below this (|q| * K fits in int64)
DEFAULT_GRID_BITS = 20  # default grid: gamma = 2**(floor(log2 C) - 20), i.e. K in [2**20, 2**21)
MAX_SATURATION_LOG2 = -30  # refuse settings whose per-coordinate int32 saturation probability exceeds 2**-30
MAX_EPS0 = 64.0


def clip_l1_rows(x: np.ndarray, clip: float) -> np.ndarray:
    """Scale each row of ``x`` so that its L1 norm is at most ``clip`` (a new float64 array; ``x`` is never modified).

    Row by row, ``x * min(1, clip / ||x||_1)``: the direction is kept, a zero row stays zero. Each float result is
    guaranteed ``sum(|row|) <= clip`` as numpy computes it (a row's scale is nudged down if rounding overshoots).
    Only clipping: the privacy of :class:`DiscreteLaplaceRandomizer` rests on its integer re-projection, never on
    this float bound.

    Args:
        x: a real array ``(k, d)``.
        clip: the L1 radius, finite and > 0.

    Returns:
        float64 ``(k, d)``.

    Raises:
        ValueError: NaN or Inf anywhere (a non-finite update is a bug, not something to hide), or ``x`` not 2-D;
        TypeError: ``x`` is not a real array.
    """
    c = check_positive_finite("clip", clip)
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiub":
        raise TypeError(f"x must be a real numeric array, got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"clip_l1_rows takes a 2-D array of rows, got shape {arr.shape}")
    base = arr.astype(np.float64, copy=False)
    with np.errstate(over="ignore"):
        norm = np.abs(base).sum(axis=1)
    huge = ~np.isfinite(norm)
    if huge.any():
        # a finite sum of |x_i| proves every entry finite; otherwise look at the entries (NaN/Inf, or overflow)
        bad = int(np.count_nonzero(~np.isfinite(base[huge])))
        if bad:
            raise ValueError(f"x has {bad} non-finite entries (NaN or Inf); refusing to clip")
        # finite entries whose sum overflows: rescale first (exact power-of-two scaling, direction kept); the
        # original norm is > 1e308 >= c, so such a row must be scaled down in any case
        base = base.copy()
        base[huge] = np.ldexp(base[huge], -64)
        norm[huge] = np.abs(base[huge]).sum(axis=1)
    clipped = huge | (norm > c)
    # x * 1.0 is x exactly: the rows inside the ball are copied unchanged by the same product
    scale = np.divide(c, norm, out=np.ones_like(norm), where=clipped)
    out = base * scale[:, None]
    pending = np.flatnonzero(clipped & (np.abs(out).sum(axis=1) > c))  # the rows that rounding took over c
    for _ in range(200):
        if pending.size == 0:
            return out
        scale[pending] = np.nextafter(scale[pending], 0.0) * (1.0 - 2.0**-50)
        out[pending] = base[pending] * scale[pending, None]
        pending = pending[np.abs(out[pending]).sum(axis=1) > c]
    raise ArithmeticError("could not bring the L1 norm under the clip bound")  # pragma: no cover


def clip_l1(x: np.ndarray, clip: float) -> np.ndarray:
    """Scale ``x`` (any shape, one vector) so that its L1 norm is at most ``clip``: :func:`clip_l1_rows` on one row.

    Returns:
        A new float64 array of ``x``'s shape with ``sum(|out|) <= clip`` as numpy computes it.

    Raises:
        ValueError: NaN or Inf anywhere; TypeError: ``x`` is not a real array.
    """
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiub":
        raise TypeError(f"x must be a real numeric array, got dtype {arr.dtype}")
    return clip_l1_rows(arr.reshape(1, -1), clip).reshape(arr.shape)


def flatten_arrays(arrays: list[np.ndarray]) -> np.ndarray:
    """Concatenate a model's arrays (C order) into one float64 vector."""
    if len(arrays) == 0:
        raise ValueError("no arrays to flatten")
    return np.concatenate([np.asarray(a, dtype=np.float64).reshape(-1) for a in arrays])


def unflatten_vector(vec: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
    """Split a flat vector back into arrays shaped (and typed) like ``like``."""
    sizes = [int(np.asarray(a).size) for a in like]
    if int(np.asarray(vec).size) != sum(sizes):
        raise ValueError(f"vector has {np.asarray(vec).size} entries, the arrays need {sum(sizes)}")
    out = []
    pos = 0
    for a, n in zip(like, sizes):
        a = np.asarray(a)
        out.append(np.asarray(vec[pos : pos + n]).reshape(a.shape).astype(a.dtype))
        pos += n
    return out


class DiscreteLaplaceRandomizer:
    """eps0-LDP randomizer for a whole update: clip to L1 radius C, round to the grid gamma = 2**log2_grid,
    re-project onto the L1 ball of radius K = floor(C / gamma) in integers, add exact discrete Laplace noise of
    scale 2K / eps0 grid units (2C / eps0 in real units), and encode the integers.

    Parameters
    ----------
    eps0:
        The pinned local privacy parameter, in (0, 64]. The mechanism spends ``eps_used <= eps0`` (the noise
        parameter ``num / 2**52`` is rounded down; the relative loss ``1 - eps_used/eps0`` is below ``1/num``,
        and the default grid has ``2K < 2**22``, so ``num > eps0 * 2**30``).
    clip_l1:
        The L1 clipping radius C > 0 of the whole report.
    log2_grid:
        The grid exponent (gamma = 2**log2_grid), an int in [-60, 20] with 1 <= K <= 2**30 and a per-coordinate
        int32 saturation probability <= 2**-30. Default ``None``: ``floor(log2 C) - 20`` (K in [2**20, 2**21)),
        made coarser one step at a time while the saturation bound fails (small eps0).
    rng:
        The CSPRNG. Default: a fresh :class:`shuffledp.clients.noise.ChaCha20Rng` keyed from ``os.urandom``.
    """

    def __init__(
        self,
        eps0: float,
        clip_l1: float,
        *,
        log2_grid: int | None = None,
        rng: ChaCha20Rng | None = None,
    ) -> None:
        self.eps0 = check_positive_finite("eps0", eps0)
        if self.eps0 > MAX_EPS0:
            raise ValueError(f"eps0 must be <= {MAX_EPS0}, got {eps0!r}")
        self.clip = check_positive_finite("clip_l1", clip_l1)
        if log2_grid is None:
            _, e = math.frexp(self.clip)  # clip = m * 2**e, m in [0.5, 1): floor(log2 clip) = e - 1
            g = e - 1 - DEFAULT_GRID_BITS
            if g > LOG2_GRID_MAX:
                raise ValueError(
                    f"clip_l1 must be < 2**{LOG2_GRID_MAX + DEFAULT_GRID_BITS + 1} for the default grid (the report "
                    f"format's grid exponent is at most {LOG2_GRID_MAX}), got {clip_l1!r}"
                )
            g = max(g, LOG2_GRID_MIN)
            ok, why = self._grid_ok(g)
            binding = why  # why the coarsest grid that still resolves the clip (K >= 1) failed; else the first
            while not ok and g < LOG2_GRID_MAX:
                if self._radius(g) >= 1:
                    binding = f"at the coarsest grid that still resolves the clip, 2**{g}: {why}"
                g += 1
                ok, why = self._grid_ok(g)
            if not ok:
                raise ValueError(
                    f"no grid in [{LOG2_GRID_MIN}, {LOG2_GRID_MAX}] works for eps0={self.eps0!r}, "
                    f"clip_l1={self.clip!r}; " + binding.removesuffix("; use a coarser grid")
                    + ", and every coarser grid is coarser than the clip"
                )
        else:
            if isinstance(log2_grid, bool) or not isinstance(log2_grid, (int, np.integer)):
                raise TypeError(f"log2_grid must be an int or None, got {type(log2_grid).__name__}")
            g = int(log2_grid)
            if not LOG2_GRID_MIN <= g <= LOG2_GRID_MAX:
                raise ValueError(f"log2_grid must be in [{LOG2_GRID_MIN}, {LOG2_GRID_MAX}], got {g}")
            ok, why = self._grid_ok(g)
            if not ok:
                raise ValueError(f"log2_grid={g} is not usable: {why}")
        self.log2_grid = g
        self.radius = self._radius(g)  # K
        self.sensitivity = 2 * self.radius  # integer L1 sensitivity for ANY two inputs
        self.noise_num = self._noise_num(g)
        self.noise_log2_den = NOISE_LOG2_DEN
        self.eps_used_exact = Fraction(self.noise_num * self.sensitivity, 1 << NOISE_LOG2_DEN)
        if self.eps_used_exact > Fraction(self.eps0):  # pragma: no cover - guaranteed by the floor
            raise ArithmeticError("eps_used exceeds eps0")
        self.eps_used = float(self.eps_used_exact)
        self._sampler: DiscreteLaplaceSampler | None = None  # built on first use (tables take ~0.2 s)
        self.rng = rng if rng is not None else ChaCha20Rng()

    # -- parameter rules --------------------------------------------------------------------------------------

    def _radius(self, g: int) -> int:
        # K = floor(C / 2**g), computed exactly on the float's rational value
        return math.floor(Fraction(self.clip) / Fraction(2) ** g)

    def _noise_num(self, g: int) -> int:
        k = self._radius(g)
        return math.floor(Fraction(self.eps0) * (1 << NOISE_LOG2_DEN) / (2 * k)) if k >= 1 else 0

    def _grid_ok(self, g: int) -> tuple[bool, str]:
        k = self._radius(g)
        if k < 1:
            return False, f"the grid 2**{g} is coarser than the clip {self.clip} (K = 0)"
        if k > MAX_RADIUS:
            return False, f"K = floor(C / 2**{g}) = {k} exceeds 2**30; use a coarser grid"
        num = self._noise_num(g)
        if num < 1 or Fraction(num, 1 << NOISE_LOG2_DEN) < Fraction(1, 2**46):
            return False, "the noise scale 2K/eps0 is too large for the sampler; use a coarser grid"
        # P(|Z| >= n) = 2 t^n / (1 + t) <= 2 exp(-s n); need it <= 2**-30 at n = INT_MAX - K
        s = num / float(1 << NOISE_LOG2_DEN)
        log2_p = 1.0 - s * (INT_MAX - k) / math.log(2.0)
        if log2_p > MAX_SATURATION_LOG2:
            return False, (
                f"int32 saturation probability per coordinate ~2**{log2_p:.1f} > 2**{MAX_SATURATION_LOG2} "
                f"(noise scale {1 / s:.3g} grid units); use a coarser grid"
            )
        return True, ""

    @property
    def sampler(self) -> DiscreteLaplaceSampler:
        """The exact discrete Laplace sampler with t = exp(-noise_num / 2**52) (built lazily, tables cached)."""
        if self._sampler is None:
            self._sampler = DiscreteLaplaceSampler(self.noise_num, NOISE_LOG2_DEN)
        return self._sampler

    @property
    def gamma(self) -> float:
        """The grid step gamma = 2**log2_grid."""
        return math.ldexp(1.0, self.log2_grid)

    @property
    def noise_scale(self) -> float:
        """Scale of the noise in real units, 2K * gamma / eps_used (<= 2C / eps_used)."""
        return float(Fraction(1 << NOISE_LOG2_DEN, self.noise_num)) * self.gamma

    # -- the mechanism ----------------------------------------------------------------------------------------

    def quantize_rows(self, x: np.ndarray) -> np.ndarray:
        """Clip each row (float), round to the grid, and re-project in integers.

        Args:
            x: real ``(k, d)``: one update per row.

        Returns:
            int64 ``(k, d)`` with ``||q_i||_1 <= K`` for every row, exactly.
        """
        xc = clip_l1_rows(x, self.clip)
        q = np.rint(np.ldexp(xc, -self.log2_grid)).astype(np.int64)  # exact power-of-two scaling
        total = np.abs(q).sum(axis=1)
        over = np.flatnonzero(total > self.radius)
        if over.size:
            # sign(q) * floor(|q| * K / total): sum <= K exactly; |q| <= K + 1 < 2**31 so the product fits int64
            qo = q[over]
            mag = np.abs(qo) * np.int64(self.radius) // total[over, None]
            q[over] = np.sign(qo) * mag  # mag = 0 where q = 0
        return q

    def quantize(self, x: np.ndarray) -> np.ndarray:
        """Clip (float), round to the grid, and re-project in integers: int64 ``q`` with ``||q||_1 <= K``
        (:meth:`quantize_rows` on one row)."""
        return self.quantize_rows(np.asarray(x).reshape(1, -1))[0]

    def privatize_rows(self, x: np.ndarray) -> np.ndarray:
        """The noisy integer vectors ``q(x_i) + Z_i`` (int64 ``(k, d)``; not yet saturated): the noise of all rows
        is one draw of ``k * d`` iid exact discrete Laplace samples from the CSPRNG, in row order."""
        q = self.quantize_rows(x)
        q += self.sampler.sample(q.size, self.rng).reshape(q.shape)
        return q

    def privatize(self, x: np.ndarray) -> np.ndarray:
        """The noisy integer vector ``q(x) + Z`` (int64; not yet saturated): :meth:`privatize_rows` on one row."""
        return self.privatize_rows(np.asarray(x).reshape(1, -1))[0]

    def encode_rows(self, x: np.ndarray) -> np.ndarray:
        """clip -> grid -> projection -> exact noise -> fixed-length report, for each row of ``x`` (``(k, d)``).

        Returns:
            uint8 ``(k, 20 + 4 d)``: row i is the report of ``x[i]`` (:func:`shuffledp.clients.report.encode_reports`).
        """
        return encode_reports(self.privatize_rows(x), log2_grid=self.log2_grid, eps_used=self.eps_used)

    def encode(self, x: np.ndarray) -> bytes:
        """clip -> grid -> projection -> exact noise -> fixed-length report (see :mod:`shuffledp.clients.report`):
        :meth:`encode_rows` on one row."""
        return self.encode_rows(np.asarray(x).reshape(1, -1))[0].tobytes()

    def __repr__(self) -> str:
        return (
            f"DiscreteLaplaceRandomizer(eps0={self.eps0}, clip_l1={self.clip}, log2_grid={self.log2_grid}, "
            f"K={self.radius}, eps_used={self.eps_used!r})"
        )
