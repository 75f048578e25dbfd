"""CSPRNG and an exact, integer-only discrete Laplace sampler, vectorised in numpy.

Randomness
    :class:`ChaCha20Rng` is a ChaCha20 keystream (RFC 8439, via ``cryptography``) keyed with 32 bytes from
    ``os.urandom``; it re-keys from ``os.urandom`` every 2**36 bytes. Only tests pass an explicit key.

Target distribution
    The discrete Laplace distribution on Z with ``t = exp(-x)``, ``x = num / 2**log2_den`` (an exact dyadic
    rational)::

        P(Z = k) = (1 - t) / (1 + t) * t**|k|

    (Canonne, Kamath, Steinke, "The discrete Gaussian for differential privacy", NeurIPS 2020, Def. 2 and
    Algorithm 2 use the same distribution; we sample it differently, see below.)

Method (exact relative to the CSPRNG; no floating point anywhere in the sampling)
    1. Magnitude ``G ~ Geometric``, ``P(G = g) = (1 - t) t**g``. Write ``G = sum_c 256**c L_c + 256**C H``.
       Because ``t**g`` factorises over the base-256 digits of ``g``, the digits are *independent*:
       ``L_c`` is a geometric with ratio ``r_c = t**(256**c)`` truncated to {0..255}, and ``H`` is a geometric
       with ratio ``t**(256**C)`` (C is chosen so that this ratio is <= exp(-1/64)).
    2. Each digit is drawn by inversion, ``L = #{l >= 1 : U < S_l}`` with ``S_l = P(L >= l)`` and ``U``
       uniform on [0, 1), compared *lazily*: the top 16 bits of ``U`` index a guide table that settles the
       outcome unless a threshold lies in that 2**-16 bucket (at most 255 of 65,536 buckets); then 64 more
       bits of ``U`` are compared with the thresholds ``floor(S_l 2**80)`` (exact Python integers computed with
       :mod:`decimal` at a precision that certifies the floor), and in the event of a
       tie (probability ~2**-70 per sample), 64 further bits at a time against thresholds recomputed at higher
       precision. Each decision is therefore exactly ``U < S_l``. (The ambiguous buckets are settled by a
       vectorised binary search, since the thresholds in one bucket are sorted.)
    3. ``H``'s table has outcomes 0..254 and "255 or more"; by memorylessness the latter adds 255 and redraws.
    4. Sign from one CSPRNG bit; the pair (negative, 0) is rejected and redrawn so that 0 is not counted twice.

The output pmf is exactly the one above, relative to the CSPRNG. About 2 bytes of keystream per digit and one
table gather per digit: about 7 bytes of keystream per sample at the randomizer's default scale (2**21 grid
units for eps0 = 1: two truncated digits and the top digit, plus a sign byte).
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Callable
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np

from shuffledp.clients.validation import require_int

__all__ = [
    "ChaCha20Rng",
    "DiscreteLaplaceSampler",
    "discrete_laplace_log_pmf",
    "geometric_survival_fraction_bounds",
]

_REKEY_BYTES = 2**36
_GUIDE_BITS = 16
_FIRST_BITS = _GUIDE_BITS + 64  # precision of the stored thresholds
_DIGIT_BITS = 8
_DIGITS = 1 << _DIGIT_BITS  # outcomes per digit table
_AMBIGUOUS_FLAG = np.uint16(1 << 15)


class ChaCha20Rng:
    """A fast CSPRNG: the ChaCha20 keystream under a key from ``os.urandom`` (re-keyed every 2**36 bytes and
    in a forked child process, so a child never repeats its parent's stream).

    ``key`` is for reproducible tests only; production code must leave it ``None``. Thread-safe: one lock
    serialises the keystream (the randomizer, and so this generator, is shared by every request of a process).
    """

    def __init__(self, key: bytes | None = None) -> None:
        if key is not None and (not isinstance(key, (bytes, bytearray)) or len(key) != 32):
            raise ValueError("key must be exactly 32 bytes (or None to draw one from os.urandom)")
        self._fixed_key = key is not None
        self._key_source = bytes(key) if key is not None else None
        self._zeros = bytearray()
        self._lock = threading.Lock()
        self._rekey()

    def _rekey(self) -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

        if self._key_source is not None:
            key = self._key_source  # test-only fixed key: used once; the stream refuses to wrap (below)
            self._key_source = None
        else:
            key = os.urandom(32)
        # 16-byte nonce = 32-bit block counter (starts at 0) || 96-bit nonce; the key is fresh, so zero is fine.
        self._enc = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
        self._used = 0
        self._pid = os.getpid()

    def random_bytes(self, n: int) -> np.ndarray:
        """``n`` keystream bytes as a fresh uint8 array."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if self._pid != os.getpid():
            # a forked child has only the forking thread: a lock another parent thread held is replaced, not waited on
            self._lock = threading.Lock()
        with self._lock:
            if self._pid != os.getpid() and not self._fixed_key:
                # a forked child must never replay its parent's keystream (two clients' noise would be equal)
                self._rekey()
            if self._used + n > _REKEY_BYTES:
                if self._fixed_key:
                    raise RuntimeError("fixed-key test stream exhausted (2**36 bytes)")
                self._rekey()
            if len(self._zeros) < n:
                self._zeros = bytearray(max(n, 1 << 16))
            out = bytearray(n + 64)
            written = self._enc.update_into(memoryview(self._zeros)[:n], out)
            if written != n:  # ChaCha20 is a stream cipher: cryptography returns exactly n bytes
                raise RuntimeError(f"ChaCha20 keystream returned {written} bytes, expected {n}")
            self._used += n
        return np.frombuffer(out, dtype=np.uint8, count=n)

    def uint16(self, n: int) -> np.ndarray:
        """``n`` uniform little-endian uint16 values from the keystream."""
        return self.random_bytes(2 * n).view("<u2")

    def uint64(self, n: int) -> np.ndarray:
        """``n`` uniform little-endian uint64 values from the keystream."""
        return self.random_bytes(8 * n).view("<u8")

    def getrandbits(self, k: int) -> int:
        """A uniform integer in [0, 2**k) (k a multiple of 64 is cheapest)."""
        words = (k + 63) // 64
        v = int.from_bytes(self.random_bytes(8 * words).tobytes(), "big")
        return v >> (64 * words - k)


# --------------------------------------------------------------------------------------------------------------
# Certified thresholds
# --------------------------------------------------------------------------------------------------------------

_MAX_PREC = 20_000


def _certified_floor(value: Callable[[int], Decimal], bits: int) -> int:
    """``floor(v * 2**bits)`` for an irrational ``v`` given ``value(prec)``, an approximation with absolute
    error <= 10**-(prec - 30) (see the survival functions). Raises if it cannot decide (v rational)."""
    prec = int(bits * 0.30103) + 60
    while prec <= _MAX_PREC:
        v = value(prec)
        with localcontext() as ctx:
            # enough digits that the subtraction/addition and the power-of-two scaling below are exact
            ctx.prec = prec + 100 + int(bits * 0.30103) + 10
            ctx.Emin = -(10**9)
            ctx.Emax = 10**9
            err = Decimal(10) ** (-(prec - 30))
            scale = Decimal(2) ** bits
            # the survival values are >= 0, so the floor is >= 0 even when v - err is negative
            lo = max(int(((v - err) * scale).to_integral_value(rounding="ROUND_FLOOR")), 0)
            hi = int(((v + err) * scale).to_integral_value(rounding="ROUND_FLOOR"))
        if lo == hi:
            return lo
        prec *= 2
    raise ArithmeticError(f"could not certify a threshold at {bits} bits")


def _exp_neg(x: Fraction, prec: int) -> Decimal:
    """exp(-x) for a dyadic rational x >= 0, correctly rounded to ``prec`` digits (decimal's exp is)."""
    den = x.denominator
    k = den.bit_length() - 1
    if den != 1 << k:
        raise ValueError("x must be a dyadic rational")
    # N / 2**k = N * 5**k / 10**k: the string constructor is exact (it never rounds)
    dx = Decimal(f"{x.numerator * 5**k}E-{k}")
    with localcontext() as ctx:
        ctx.prec = prec + 10
        ctx.Emin = -(10**9)
        ctx.Emax = 10**9
        return (-dx).exp()


def _truncated_survival(x: Fraction, n: int, ell: int) -> Callable[[int], Decimal]:
    """S_l = P(L >= l) for L truncated geometric on {0..n-1} with ratio exp(-x):
    (e^{-xl} - e^{-xn}) / (1 - e^{-xn}). Absolute error at ``prec`` digits <= 10**-(prec - 30): the
    denominator is >= 1 - e^{-2**-60} > 2**-61 and every operation is rounded to prec + 10 digits."""

    def f(prec: int) -> Decimal:
        with localcontext() as ctx:
            ctx.prec = prec + 40
            ctx.Emin = -(10**9)
            a = _exp_neg(x * ell, prec + 40)
            b = _exp_neg(x * n, prec + 40)
            return (a - b) / (1 - b)

    return f


def _geometric_survival(x: Fraction, ell: int) -> Callable[[int], Decimal]:
    """S_l = P(H >= l) = e^{-xl} for H geometric with ratio exp(-x)."""

    def f(prec: int) -> Decimal:
        return _exp_neg(x * ell, prec + 10)

    return f


class _DigitTable:
    """Inversion sampler for one digit with outcomes {0..n-1} (n <= 256), thresholds S_1 >= ... >= S_{n-1}.

    ``code[b]`` (uint16) for a 16-bit bucket ``b`` holds the outcome in its low byte when the bucket settles it,
    with bit 15 set when it does not (a threshold lies in the bucket) or, if ``flag_last``, when the outcome is
    the last one (the caller's memoryless restart).
    """

    def __init__(self, survival: list[Callable[[int], Decimal]], *, flag_last: bool = False) -> None:
        n_thr = len(survival)
        if not 1 <= n_thr <= 255:
            raise ValueError("a digit table has between 2 and 256 outcomes")
        self.survival = survival  # index l-1 -> S_l
        thr = [_certified_floor(s, _FIRST_BITS) for s in survival]
        if any(x < y for x, y in zip(thr, thr[1:])):
            raise ArithmeticError("survival thresholds are not non-increasing")
        top = np.array([t >> 64 for t in thr], dtype=np.int64)
        self.low64 = np.zeros(n_thr + 1, dtype=np.uint64)  # low64[l] for l = 1..n-1 (index 0 unused)
        self.low64[1:] = np.array([t & (2**64 - 1) for t in thr], dtype=np.uint64)
        amb = np.bincount(top, minlength=1 << _GUIDE_BITS)[: 1 << _GUIDE_BITS].astype(np.int64)
        above = np.cumsum(amb[::-1])[::-1]  # #{l : top_l >= b}
        base = above - amb  # #{l : top_l > b}: the outcome when no threshold lies in bucket b
        flag = amb > 0
        if flag_last:
            flag |= base == n_thr
        self.code = (base.astype(np.uint16) | np.where(flag, _AMBIGUOUS_FLAG, np.uint16(0))).astype(np.uint16)
        self.amb = amb
        self.base = base
        self.n_thr = n_thr

    def exact(self, b: np.ndarray, rng: ChaCha20Rng) -> np.ndarray:
        """Exact outcomes (int64) for uniforms whose top 16 bits are ``b``, drawing further bits lazily."""
        b = b.astype(np.int64)
        out = self.base[b].copy()
        sel = np.flatnonzero(self.amb[b] > 0)
        if sel.size:
            bb = b[sel]
            r2 = rng.uint64(sel.size)
            # thresholds l = start .. end-1 share the top 16 bits b; their low 64 bits are non-increasing in l,
            # so {l : r2 < low64[l]} is a prefix of that range: find its end by a vectorised binary search
            start = self.base[bb] + 1
            end = start + self.amb[bb]
            lo, hi = start.copy(), end.copy()
            for _ in range(int(self.amb[bb].max()).bit_length()):
                active = lo < hi
                mid = np.where(active, (lo + hi) // 2, start)
                below = active & (r2 < self.low64[mid])
                lo = np.where(below, mid + 1, lo)
                hi = np.where(active & ~below, mid, hi)
            out[sel] += lo - start
            # a tie (r2 equal to the first threshold not below it): these 80 bits do not decide, draw more
            tie = (lo < end) & (self.low64[np.minimum(lo, self.n_thr)] == r2)
            for j in np.flatnonzero(tie):
                out[sel[j]] = self._resolve(int(bb[j]) << 64 | int(r2[j]), _FIRST_BITS, rng)
        return out

    def sample(self, rng: ChaCha20Rng, m: int) -> np.ndarray:
        """``m`` independent outcomes (int64)."""
        b = rng.uint16(m)
        code = self.code[b]
        idx = np.flatnonzero(code >= _AMBIGUOUS_FLAG)
        out = (code & np.uint16(0xFF)).astype(np.int64)
        if idx.size:
            out[idx] = self.exact(b[idx], rng)
        return out

    def _resolve(self, prefix: int, bits: int, rng: ChaCha20Rng) -> int:
        """Exact outcome for a uniform whose first ``bits`` bits are ``prefix``, drawing 64 bits at a time."""
        count = 0
        pending: list[int] = []
        for ell in range(1, self.n_thr + 1):
            f = _certified_floor(self.survival[ell - 1], bits)
            if prefix < f:
                count += 1
            elif prefix == f:
                pending.append(ell)
        while pending:
            prefix = (prefix << 64) | rng.getrandbits(64)
            bits += 64
            still: list[int] = []
            for ell in pending:
                f = _certified_floor(self.survival[ell - 1], bits)
                if prefix < f:
                    count += 1
                elif prefix == f:
                    still.append(ell)
            pending = still
        return count


@functools.lru_cache(maxsize=64)
def _digit_table(kind: str, x_num: int, x_log2_den: int, n: int) -> _DigitTable:
    x = Fraction(x_num, 1 << x_log2_den) if x_log2_den >= 0 else Fraction(x_num << -x_log2_den)
    if kind == "truncated":
        return _DigitTable([_truncated_survival(x, n, ell) for ell in range(1, n)])
    if kind == "geometric":
        return _DigitTable([_geometric_survival(x, ell) for ell in range(1, n)], flag_last=True)
    raise ValueError(kind)  # pragma: no cover - internal


_TOP_MIN_X = Fraction(1, 64)


class DiscreteLaplaceSampler:
    """Exact discrete Laplace sampler, ``P(k) = (1-t)/(1+t) t^|k|`` with ``t = exp(-num / 2**log2_den)``.

    ``num`` and ``log2_den`` are integers (the noise parameter is an exact dyadic rational), so the
    randomizer can round it in the privacy-safe direction. Scale (in output units) is ``2**log2_den / num``;
    it must be below 2**46 (seven base-256 digits with room for the geometric tail).
    """

    def __init__(self, num: int, log2_den: int) -> None:
        require_int("num", num, 1)
        require_int("log2_den", log2_den, 0, 128)
        self.num = num
        self.log2_den = log2_den
        self.x = Fraction(num, 1 << log2_den)
        if self.x < Fraction(1, 2**46):
            raise ValueError(f"noise scale 2**{log2_den}/{num} is too large (must be < 2**46)")
        # number of truncated base-256 digits: the smallest C with x * 256**C >= 1/64 (then the top digit's
        # "255 or more" outcome, which triggers a restart, has probability exp(-255 x 256**C) <= e^-3.98)
        c = 0
        while self.x * (1 << (_DIGIT_BITS * c)) < _TOP_MIN_X:
            c += 1
        self.n_digits = c
        self._tables = [
            _digit_table("truncated", num, log2_den - _DIGIT_BITS * i, _DIGITS) for i in range(c)
        ]
        self._top = _digit_table("geometric", num, log2_den - _DIGIT_BITS * c, _DIGITS)

    @property
    def scale(self) -> float:
        """1/x, the scale of the noise in output units."""
        return float(1 / self.x)

    def geometric(self, m: int, rng: ChaCha20Rng) -> np.ndarray:
        """``m`` iid magnitudes, ``P(G = g) = (1 - t) t^g`` (int64)."""
        tables = [*self._tables, self._top]
        buckets = [rng.uint16(m) for _ in tables]
        raw = np.zeros((m, 8), dtype=np.uint8)
        flags = np.zeros(m, dtype=np.uint16)
        for i, (tab, b) in enumerate(zip(tables, buckets)):
            code = tab.code[b]
            flags |= code
            raw[:, i] = code  # low byte: the digit (setitem casts uint16 -> uint8 by truncation)
        g = raw.view("<i8").reshape(m)
        idx = np.flatnonzero(flags >= _AMBIGUOUS_FLAG)
        if idx.size:
            g[idx] = self._exact(idx, buckets, rng)
        return g

    def _exact(self, idx: np.ndarray, buckets: list[np.ndarray], rng: ChaCha20Rng) -> np.ndarray:
        """Exact magnitudes for the positions ``idx`` whose table lookups were not settled by the guide."""
        g = np.zeros(idx.size, dtype=np.int64)
        for i, tab in enumerate(self._tables):
            g += tab.exact(buckets[i][idx], rng) << (_DIGIT_BITS * i)
        shift = _DIGIT_BITS * self.n_digits
        last = _DIGITS - 1
        h = self._top.exact(buckets[-1][idx], rng)
        total = h.copy()
        pending = np.flatnonzero(h == last)
        # memoryless restart: P(H >= 255 + h | H >= 255) = P(H >= h)
        while pending.size:
            h = self._top.sample(rng, pending.size)
            total[pending] += h
            pending = pending[h == last]
        return g + (total << shift)

    def sample(self, m: int, rng: ChaCha20Rng | None = None) -> np.ndarray:
        """``m`` iid discrete Laplace samples (int64). ``rng`` defaults to a fresh :class:`ChaCha20Rng`."""
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 0:
            raise ValueError(f"m must be an int >= 0, got {m!r}")
        m = int(m)
        rng = rng if rng is not None else ChaCha20Rng()
        out = self.geometric(m, rng)
        bit = rng.random_bytes(m) & 1
        neg = bit.view(bool)
        # (negative, 0) is rejected and redrawn, so that P(0) is not doubled
        redo = np.flatnonzero(neg & (out == 0))
        out *= 1 - 2 * bit.view(np.int8)  # sign in {+1, -1}; a multiply is much faster than negative(where=)
        while redo.size:
            mag = self.geometric(redo.size, rng)
            sgn = (rng.random_bytes(redo.size) & 1).view(bool)
            ok = ~(sgn & (mag == 0))
            out[redo[ok]] = np.where(sgn[ok], -mag[ok], mag[ok])
            redo = redo[~ok]
        return out


def discrete_laplace_log_pmf(k: np.ndarray | int, num: int, log2_den: int) -> np.ndarray:
    """log P(Z = k) = log((1-t)/(1+t)) - x|k|, x = num / 2**log2_den, in float64 via log1p/expm1."""
    x = num / float(1 << log2_den)
    # (1-t)/(1+t) = tanh(x/2)
    log_c = math.log(math.tanh(x / 2.0)) if x < 40 else math.log1p(-2.0 * math.exp(-x) / (1 + math.exp(-x)))
    return log_c - x * np.abs(np.asarray(k, dtype=np.float64))


def geometric_survival_fraction_bounds(x: Fraction, ell: int, bits: int = 128) -> tuple[Fraction, Fraction]:
    """Rigorous bracket [lo, hi] of exp(-x ell) with width 2**-bits (for tests and threshold audits)."""
    f = _certified_floor(_geometric_survival(x, ell), bits)
    return Fraction(f, 1 << bits), Fraction(f + 1, 1 << bits)
