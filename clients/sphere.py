"""L2 clipping and uniform directions on the unit sphere, drawn from the CSPRNG or derived from a seed.

A uniform direction is a standard normal vector divided by its norm (Muller, CACM 1959); the normals come from
the Box-Muller transform (Box and Muller, Ann. Math. Stat. 1958) of 53-bit uniforms taken from a ChaCha20
keystream (RFC 8439). :func:`directions` draws from the client's :class:`shuffledp.clients.noise.ChaCha20Rng`
(keyed from ``os.urandom``), with the angle ``2 pi u``; :func:`direction_from_seed` derives one direction
deterministically from a 32-byte seed, so that a client can send the seed and the server rebuild the same
direction, with the angle drawn as a quarter-turn arc and one of four arcs (:func:`directions_from_seeds`: the
same law, and ``cos``/``sin`` only on ``(-pi/4, pi/4)``). Directions never depend on the data; the mechanisms that
use them let the data in only through exactly sampled coins (:mod:`shuffledp.clients.duchi`) or through an
acceptance test (:mod:`shuffledp.clients.privunit`).

Both work a block of rows at a time, in work arrays that stay in cache; each row's result is the same whatever
the block (every step is elementwise or row by row).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
from collections.abc import Callable

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from shuffledp.clients.noise import ChaCha20Rng
from shuffledp.clients.validation import check_int, check_positive_finite

__all__ = ["SEED_BYTES", "row_norms", "clip_l2", "clip_l2_rows", "clip_l2_rows_and_norms", "unit_rows",
           "unit_or_default", "directions", "seed_keystreams", "directions_from_seeds", "direction_from_seed"]

#: Bytes of the seed a direction is derived from (a ChaCha20 key).
SEED_BYTES = 32
_NONCE = b"shuffledp-dir\x00\x00\x00"  # 16 bytes: domain separation of the derived keystream
_MAX_ELEMENTS = 2**28
_CLIP_BLOCK_ELEMENTS = 2**14  # clipping works on this many entries at a time (in cache)
_BLOCK_PAIRS = 2**12  # directions are derived this many Box-Muller pairs at a time (their work arrays stay in cache)
_SHIFT = np.uint64(11)  # a 64-bit word's top 53 bits make one uniform
_BIT62 = np.uint64(62)
_BIT63 = np.uint64(63)
_QUARTER_TURN = math.pi * 2.0**-54  # (pi/2) 2**-53


def _peak_and_scaled_norms(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's largest magnitude ``peak`` and the norm ``s`` of the row divided by it (1 <= s <= sqrt(d); 0 for
    a zero row), so that ``||x_i||_2 = s_i peak_i`` without overflow."""
    arr = np.asarray(x, dtype=np.float64)
    peak = np.abs(arr).max(axis=1) if arr.shape[1] else np.zeros(arr.shape[0])
    return peak, _scaled_norms(arr, peak)


def _scaled_norms(arr: np.ndarray, peak: np.ndarray, work: np.ndarray | None = None) -> np.ndarray:
    """The norm of each row of ``arr`` divided by its ``peak`` (the row itself for a zero peak); ``work``, if given,
    is an ``arr``-shaped float64 array to hold the divided rows."""
    scaled = np.divide(arr, np.where(peak > 0.0, peak, 1.0)[:, None], out=work)
    return np.sqrt(np.einsum("ij,ij->i", scaled, scaled))


def row_norms(x: np.ndarray) -> np.ndarray:
    """The L2 norm of each row of a finite ``(k, d)`` array, computed on the row divided by its largest magnitude.

    Returns:
        float64 ``(k,)`` (0 for a zero row; inf only when the norm itself exceeds the float range).
    """
    peak, s = _peak_and_scaled_norms(x)
    with np.errstate(over="ignore"):
        return s * peak


def clip_l2_rows(x: np.ndarray, clip: float) -> np.ndarray:
    """Scale each row of ``x`` so that its L2 norm is at most ``clip`` (a new float64 array; ``x`` is never modified).

    Args:
        x: a real array ``(k, d)``.
        clip: the L2 radius, finite and > 0.

    Returns:
        float64 ``(k, d)``: row by row ``x * min(1, clip / ||x||_2)``, the direction kept (the scale computed as
        ``(clip / peak) / s``, without overflow); each row has ``row_norms(out) <= clip`` as :func:`row_norms`
        computes it (a row's scale is nudged down if rounding overshoots).

    Raises:
        ValueError: ``x`` has a NaN or Inf entry or is not 2-D; TypeError: ``x`` is not a real array.
    """
    return clip_l2_rows_and_norms(x, clip)[0]


def clip_l2_rows_and_norms(x: np.ndarray, clip: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`clip_l2_rows` and the :func:`row_norms` of its result (computed on the way, so not twice).

    Rows are processed a block at a time (a block's temporaries stay in cache); every row's result is the one the
    whole-array computation gives (each row's norm and scale depend on that row only).

    Returns:
        ``(clipped rows, their norms)``.

    Raises:
        ValueError: ``x`` has a NaN or Inf entry or is not 2-D; TypeError: ``x`` is not a real array.
    """
    c = check_positive_finite("clip", clip)
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiub":
        raise TypeError(f"x must be a real numeric array, got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"clip_l2_rows takes a 2-D array of rows, got shape {arr.shape}")
    k, d = arr.shape
    out = np.empty((k, d))
    norms = np.empty(k)
    scale = np.ones(k)
    rows = max(1, _CLIP_BLOCK_ELEMENTS // max(d, 1))
    work = np.empty((min(rows, k), d))
    for lo in range(0, k, rows):
        base = arr[lo:lo + rows].astype(np.float64, copy=False)
        buf = work[:base.shape[0]]
        peak = np.abs(base, out=buf).max(axis=1) if d else np.zeros(base.shape[0])
        if not np.isfinite(peak).all():  # max propagates NaN: a row with a NaN or Inf entry has a non-finite peak
            bad = int(np.count_nonzero(~np.isfinite(arr.astype(np.float64, copy=False))))
            raise ValueError(f"x has {bad} non-finite entries; refusing to clip")
        s = _scaled_norms(base, peak, buf)
        with np.errstate(over="ignore"):
            block_norms = s * peak  # an overflow to inf is a norm above c too
        clipped = block_norms > c
        block_out = out[lo:lo + rows]
        if clipped.any():
            block_scale = scale[lo:lo + rows]
            block_scale[clipped] = (c / peak[clipped]) / s[clipped]
            np.multiply(base, block_scale[:, None], out=block_out)  # x * 1.0 is x: rows inside the ball unchanged
            # row_norms(block_out), whose peak is peak * scale (rounding is monotone and odd): the rows inside the
            # ball get their norm again, the clipped ones the norm of their result
            out_peak = peak * block_scale
            with np.errstate(over="ignore"):
                block_norms = _scaled_norms(block_out, out_peak, buf) * out_peak
        else:
            block_out[...] = base
        norms[lo:lo + rows] = block_norms
    pending = np.flatnonzero(norms > c)  # only a clipped row's rounding can overshoot
    for _ in range(199):
        if pending.size == 0:
            return out, norms
        scale[pending] = np.nextafter(scale[pending], 0.0) * (1.0 - 2.0**-50)
        out[pending] = arr[pending].astype(np.float64, copy=False) * scale[pending, None]
        norms[pending] = row_norms(out[pending])
        pending = pending[norms[pending] > c]
    if pending.size == 0:
        return out, norms
    raise ArithmeticError("could not bring the L2 norm under the clip bound")  # pragma: no cover


def clip_l2(x: np.ndarray, clip: float) -> np.ndarray:
    """Scale ``x`` (flattened) so that its L2 norm is at most ``clip``: :func:`clip_l2_rows` on one row.

    Returns:
        float64 ``(x.size,)``: ``x * min(1, clip / ||x||_2)``, the direction kept, norm at most ``clip``.

    Raises:
        ValueError: ``x`` has a NaN or Inf entry; TypeError: ``x`` is not a real array.
    """
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiub":
        raise TypeError(f"x must be a real numeric array, got dtype {arr.dtype}")
    return clip_l2_rows(arr.reshape(1, -1), clip)[0]


def unit_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The direction and norm of each row of a finite ``(k, d)`` array.

    Returns:
        ``(u, norms)``: ``u[i] = x[i] / ||x[i]||_2`` and ``norms[i] = ||x[i]||_2``; a zero row gets ``(e_1, 0.0)``
        (any direction serves: the mechanisms then give both signs of it probability 1/2).
    """
    v = np.asarray(x, dtype=np.float64)
    peak = np.max(np.abs(v), axis=1) if v.shape[1] else np.zeros(v.shape[0])
    zero = peak == 0.0
    safe = np.where(zero, 1.0, peak)
    scaled = v / safe[:, None]
    n = np.sqrt(np.einsum("ij,ij->i", scaled, scaled))
    u = scaled / np.where(zero, 1.0, n)[:, None]
    if zero.any():
        u[zero] = 0.0
        u[zero, 0] = 1.0
    return u, np.where(zero, 0.0, n * peak)


def unit_or_default(x: np.ndarray) -> tuple[np.ndarray, float]:
    """The direction and norm of a finite vector (:func:`unit_rows` on one row).

    Returns:
        ``(x / ||x||_2, ||x||_2)``; for the zero vector, ``(e_1, 0.0)``.
    """
    u, n = unit_rows(np.asarray(x, dtype=np.float64).reshape(1, -1))
    return u[0], float(n[0])


class _Work:
    """Work arrays for the Box-Muller transform and normalisation of up to ``rows`` directions in R^d (one block)."""

    def __init__(self, rows: int, d: int) -> None:
        half = (d + 1) // 2
        pairs = rows * half
        self.d = d
        self.half = half
        self.ints = np.empty(pairs, dtype=np.uint64)
        self.mask = np.empty(pairs, dtype=np.uint64)
        self.radius = np.empty(pairs)
        self.angle = np.empty(pairs)
        self.cos = np.empty(pairs)
        self.sin = np.empty(pairs)
        self.normals = np.empty((rows, 2 * half))
        self.squares = np.empty((rows, d))
        self.norms = np.empty(rows)

    def uniforms(self, words: np.ndarray, out: np.ndarray) -> None:
        """``out = ((words >> 11) + 1/2) 2**-53``: uniforms in (0, 1) (the conversion to float64 is exact)."""
        ints = self.ints[:words.shape[0]]
        np.right_shift(words, _SHIFT, out=ints)
        out[...] = ints.view(np.int64)  # < 2**53: exact
        out += 0.5
        out *= 2.0**-53

    def full_turn(self, words: np.ndarray) -> None:
        """``cos``, ``sin`` := ``cos t``, ``sin t`` for ``t = 2 pi u`` (``u`` the :meth:`uniforms` of ``words``)."""
        n = words.shape[0]
        t = self.angle[:n]
        self.uniforms(words, t)
        t *= 2.0 * math.pi
        np.cos(t, out=self.cos[:n])
        np.sin(t, out=self.sin[:n])

    def quarter_turns(self, words: np.ndarray) -> None:
        """``cos``, ``sin`` := the cosine and sine of a uniform angle, as a quarter-turn arc and one of four arcs.

        ``t = ((w >> 11) - 2**52 + 1/2) (pi/2) 2**-53`` in (-pi/4, pi/4) (the subtraction is exact; ``t`` is uniform on
        a grid symmetric about 0), ``(c, s) = (cos t, sin t)``; bit 0 of ``w`` negates ``c``, then bit 1 swaps
        ``c`` and ``s``. The four outcomes are the points at angle ``t``, ``pi - t``, ``pi/2 - t`` and ``t - pi/2``:
        each a measure-preserving image of ``(-pi/4, pi/4)`` on one of four arcs that partition the circle, so the
        angle is uniform on the circle (up to the grid), and ``|t| < pi/4`` keeps ``cos``/``sin`` on their short
        argument path. The negation and the swap are exact (sign-bit and masked bit operations).
        """
        n = words.shape[0]
        t, ints, mask = self.angle[:n], self.ints[:n], self.mask[:n]
        c, s = self.cos[:n], self.sin[:n]
        np.right_shift(words, _SHIFT, out=ints)
        t[...] = ints.view(np.int64)  # < 2**53: exact
        t -= 2.0**52 - 0.5  # exact: a half-integer of magnitude < 2**52
        t *= _QUARTER_TURN
        np.cos(t, out=c)
        np.sin(t, out=s)
        cb, sb = c.view(np.uint64), s.view(np.uint64)
        np.left_shift(words, _BIT63, out=ints)  # bit 0 -> the sign bit
        cb ^= ints
        np.left_shift(words, _BIT62, out=mask)
        signed = mask.view(np.int64)
        signed >>= 63  # arithmetic: bit 1 -> all ones (swap) or zero
        np.bitwise_xor(cb, sb, out=ints)
        ints &= mask
        cb ^= ints
        sb ^= ints

    def unit_normals(self, words: np.ndarray, out: np.ndarray, scales: np.ndarray | None, *, quarter: bool) -> None:
        """Rows of ``out`` (``(m, d)``) := the directions of the uint64 ``words`` (``(m, 2 half)``), times ``scales``.

        Box-Muller (Box and Muller, Ann. Math. Stat. 1958) on each pair of words ``(w1, w2)``: ``r = sqrt(-2 ln u1)``
        (``u1`` the :meth:`uniforms` of ``w1``) and the angle of ``w2`` (:meth:`quarter_turns` if ``quarter``, else
        :meth:`full_turn`) give the normals ``(r cos, r sin)``; the row's first ``d`` normals are divided by their
        L2 norm (``sqrt`` of the row's ``add.reduce`` of squares: Muller, CACM 1959), then multiplied by its scale.
        """
        m = words.shape[0]
        pairs = m * self.half
        w = words.reshape(pairs, 2)
        r = self.radius[:pairs]
        self.uniforms(w[:, 0], r)
        np.log(r, out=r)
        r *= -2.0
        np.sqrt(r, out=r)
        if quarter:
            self.quarter_turns(w[:, 1])
        else:
            self.full_turn(w[:, 1])
        normals = self.normals[:m]
        flat = normals.reshape(pairs, 2)
        np.multiply(self.cos[:pairs], r, out=flat[:, 0])
        np.multiply(self.sin[:pairs], r, out=flat[:, 1])
        z = normals[:, :self.d]
        squares, norms = self.squares[:m], self.norms[:m]
        np.multiply(z, z, out=squares)
        np.add.reduce(squares, axis=1, out=norms)
        np.sqrt(norms, out=norms)  # > 0 with probability 1 (r > 0 and cos, sin never both 0)
        np.divide(z, norms[:, None], out=out)
        if scales is not None:
            out *= scales[:, None]


def _check_rows(out: np.ndarray | None, scales: np.ndarray | None, k: int,
                d: int) -> tuple[np.ndarray, np.ndarray | None]:
    if out is not None and (not isinstance(out, np.ndarray) or out.dtype != np.float64 or out.shape != (k, d)):
        raise ValueError(f"out must be a float64 array of shape {(k, d)}")
    factors = None if scales is None else np.asarray(scales, dtype=np.float64)
    if factors is not None and factors.shape != (k,):
        raise ValueError(f"scales must have shape {(k,)}, got {factors.shape}")
    return (np.empty((k, d)) if out is None else out), factors


def directions(n: int, d: int, rng: ChaCha20Rng) -> np.ndarray:
    """``n`` independent uniform directions in R^d from the CSPRNG.

    Returns:
        A float64 array of shape ``(n, d)`` whose rows have unit L2 norm.

    Raises:
        TypeError, ValueError: ``n`` or ``d`` is not an int >= 1, or ``n * d`` exceeds 2**28.
    """
    n = check_int("n", n, 1, _MAX_ELEMENTS)
    d = check_int("d", d, 1, _MAX_ELEMENTS)
    if n * d > _MAX_ELEMENTS:
        raise ValueError(f"n * d must be <= 2**28, got {n} * {d}")
    half = (d + 1) // 2
    words = rng.uint64(2 * half * n).reshape(n, 2 * half)
    out = np.empty((n, d))
    rows = min(n, max(1, _BLOCK_PAIRS // half))
    work = _Work(rows, d)
    for lo in range(0, n, rows):
        work.unit_normals(words[lo:lo + rows], out[lo:lo + rows], None, quarter=False)
    return out


def _ietf_counter_and_nonce(nonce16: bytes) -> tuple[int, bytes]:
    """RFC 8439's split of ``cryptography``'s 16-byte ChaCha20 nonce: a little-endian 32-bit initial block counter,
    then the 96-bit nonce."""
    return int.from_bytes(nonce16[:4], "little"), nonce16[4:]


@functools.lru_cache(maxsize=1)
def _sodium_xor_ic() -> Callable[..., int] | None:
    """libsodium's ``crypto_stream_chacha20_ietf_xor_ic`` (the same RFC 8439 ChaCha20, one C call per seed instead
    of a ``cryptography`` cipher object), from PyNaCl's bundled library or the system's; None when neither has it
    or it does not reproduce ``cryptography``'s keystream on a test seed (then the slower path is used)."""
    paths = []
    try:
        import nacl._sodium as bundled  # PyNaCl, a dependency: its extension links libsodium in

        paths.append(bundled.__file__)
    except ImportError:  # pragma: no cover - PyNaCl is a dependency
        pass
    found = ctypes.util.find_library("sodium")
    if found:
        paths.append(found)
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            fn = lib.crypto_stream_chacha20_ietf_xor_ic
            if lib.sodium_init() < 0:
                continue
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int  # no argtypes: _keystreams_with passes typed ctypes objects (cheaper per call)
        probe = np.frombuffer(bytes(range(64)), dtype=np.uint8).reshape(2, SEED_BYTES)
        got = np.empty((2, 1040), dtype=np.uint8)
        _keystreams_with(fn, probe, got)
        if np.array_equal(got, _keystreams_cryptography(probe, 1040)):
            return fn
    return None  # pragma: no cover - depends on the platform's libraries


def _keystreams_cryptography(seeds: np.ndarray, nbytes: int) -> np.ndarray:
    out = np.empty((seeds.shape[0], nbytes), dtype=np.uint8)
    zeros = bytes(nbytes)
    for i, seed in enumerate(seeds):
        out[i] = np.frombuffer(Cipher(algorithms.ChaCha20(seed.tobytes(), _NONCE), mode=None).encryptor().update(zeros),
                               dtype=np.uint8)
    return out


@functools.lru_cache(maxsize=1)
def _ietf_nonce() -> tuple[int, object, int]:
    """The block counter, a C buffer holding the 96-bit nonce (never written) and its address."""
    counter, nonce = _ietf_counter_and_nonce(_NONCE)
    buf = ctypes.create_string_buffer(nonce, len(nonce))
    return counter, buf, ctypes.addressof(buf)


def _keystreams_with(fn: Callable[..., int], seeds: np.ndarray, out: np.ndarray) -> None:
    """Row i of the C-contiguous uint8 ``out`` := the keystream under ``seeds[i]`` (C-contiguous ``(m, 32)``): the
    XOR of zeros with it, in place."""
    m, nbytes = out.shape
    counter, _, nptr = _ietf_nonce()
    if counter + (nbytes + 63) // 64 > 2**32:  # libsodium's counter does not carry into the nonce
        raise ValueError("the keystream would wrap the 32-bit block counter")
    if not (seeds.flags.c_contiguous and out.flags.c_contiguous and seeds.shape == (m, SEED_BYTES)):
        raise ValueError("the keystream rows and their seeds must be C-contiguous and match")  # pragma: no cover
    out.fill(0)
    dst0, key0 = out.ctypes.data, seeds.ctypes.data
    dst, key = ctypes.c_void_p(), ctypes.c_void_p()
    length, nonce, ic = ctypes.c_ulonglong(nbytes), ctypes.c_void_p(nptr), ctypes.c_uint32(counter)
    for dst.value, key.value in zip(range(dst0, dst0 + m * nbytes, nbytes),
                                    range(key0, key0 + m * SEED_BYTES, SEED_BYTES)):
        if fn(dst, dst, length, nonce, ic, key) != 0:
            raise RuntimeError("libsodium's ChaCha20 failed")


def _keystreams_into(seeds: np.ndarray, out: np.ndarray) -> None:
    fn = _sodium_xor_ic()
    if fn is None:  # pragma: no cover - depends on the platform's libraries
        out[...] = _keystreams_cryptography(seeds, out.shape[1])
    else:
        _keystreams_with(fn, seeds, out)


def _check_seeds(seeds: np.ndarray) -> np.ndarray:
    arr = np.asarray(seeds)
    if arr.dtype != np.uint8 or arr.ndim != 2 or arr.shape[1] != SEED_BYTES:
        raise ValueError(f"direction seeds must be a (k, {SEED_BYTES}) uint8 array, got {arr.dtype} {arr.shape}")
    return np.ascontiguousarray(arr)


def seed_keystreams(seeds: np.ndarray, nbytes: int) -> np.ndarray:
    """The first ``nbytes`` of the ChaCha20 keystream under each seed, with the fixed nonce (RFC 8439): through
    libsodium when it reproduces ``cryptography``'s keystream (checked once), else through ``cryptography``.

    Args:
        seeds: uint8 ``(k, 32)``.
        nbytes: bytes per seed.

    Returns:
        uint8 ``(k, nbytes)``.
    """
    arr = _check_seeds(seeds)
    out = np.empty((arr.shape[0], check_int("nbytes", nbytes, 0, 2**38)), dtype=np.uint8)
    _keystreams_into(arr, out)
    return out


def directions_from_seeds(seeds: np.ndarray, d: int, *, scales: np.ndarray | None = None,
                          out: np.ndarray | None = None) -> np.ndarray:
    """The uniform direction in R^d derived from each seed (a uniform 32-byte seed gives a uniform direction),
    optionally times a per-row scale.

    The derivation (duchi's report format depends on it: :data:`shuffledp.clients.duchi.DUCHI_MAGIC`). Row i's
    keystream is ChaCha20 under ``seeds[i]`` with a fixed nonce (RFC 8439), its first ``16 ceil(d/2)`` bytes read
    as little-endian uint64 words; each pair of words ``(a, b)`` gives two normals by Box-Muller (Box and Muller,
    Ann. Math. Stat. 1958): the radius ``r = sqrt(-2 ln u)`` with ``u = ((a >> 11) + 1/2) 2**-53``, and the angle
    ``t = ((b >> 11) - 2**52 + 1/2) (pi/2) 2**-53`` in (-pi/4, pi/4), ``(c, s) = (cos t, sin t)``, ``c`` negated
    if bit 0 of ``b`` is set, then ``c`` and ``s`` swapped if bit 1 is: the normals are ``(r c, r s)``. The four
    bit cases put the point at angle ``t``, ``pi - t``, ``pi/2 - t``, ``t - pi/2``, measure-preserving images of
    (-pi/4, pi/4) on four arcs that partition the circle, so the angle is uniform and independent of ``r``, as
    Box-Muller needs. The first ``d`` normals are divided by their L2 norm (Muller, CACM 1959). Client and server
    compute the same direction up to the last bits of ``log``/``cos``/``sin`` on their platforms (an ulp-level
    difference changes the decoded vector by about 1e-16 relatively, and never the privacy: the direction is
    data-independent, see docs/mechanisms.md).

    Args:
        seeds: uint8 ``(k, 32)``, one seed per row.
        d: the dimension.
        scales: float64 ``(k,)``: row i is ``scales[i] * z_i`` (one rounding, as ``scales[:, None] * z``).
        out: a float64 ``(k, d)`` array to write the rows into (default: a new one).

    Returns:
        float64 ``(k, d)``: the unit rows (times ``scales``); ``out`` when given.

    Raises:
        ValueError: ``seeds`` is not ``(k, 32)`` uint8, ``d`` is out of range, or ``scales``/``out`` do not match.
    """
    arr = _check_seeds(seeds)
    d = check_int("d", d, 1, _MAX_ELEMENTS)
    k = arr.shape[0]
    res, factors = _check_rows(out, scales, k, d)
    if k == 0:
        return res
    half = (d + 1) // 2
    rows = min(k, max(1, _BLOCK_PAIRS // half))
    work = _Work(rows, d)
    stream = np.empty((rows, 16 * half), dtype=np.uint8)
    for lo in range(0, k, rows):
        block = stream[:min(rows, k - lo)]
        _keystreams_into(arr[lo:lo + rows], block)
        work.unit_normals(block.view("<u8"), res[lo:lo + rows], None if factors is None else factors[lo:lo + rows],
                          quarter=True)
    return res


def direction_from_seed(seed: bytes, d: int) -> np.ndarray:
    """The uniform direction in R^d derived from ``seed``: :func:`directions_from_seeds` on one seed.

    Returns:
        A float64 unit vector of shape ``(d,)``.

    Raises:
        ValueError: ``seed`` is not 32 bytes or ``d`` is out of range.
    """
    if not isinstance(seed, (bytes, bytearray)) or len(seed) != SEED_BYTES:
        raise ValueError(f"a direction seed must be {SEED_BYTES} bytes")
    return directions_from_seeds(np.frombuffer(bytes(seed), dtype=np.uint8).reshape(1, SEED_BYTES), d)[0]
