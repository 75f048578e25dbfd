"""L2 clipping and uniform directions on the unit sphere, drawn from the CSPRNG or derived from a seed.

A uniform direction is a standard normal vector divided by its norm (Muller, CACM 1959); the normals come from
the Box-Muller transform (Box and Muller, Ann. Math. Stat. 1958) of 53-bit uniforms taken from a ChaCha20
keystream (RFC 8439). :func:`directions` draws from the client's :class:`shuffledp.clients.noise.ChaCha20Rng`
(keyed from ``os.urandom``); :func:`direction_from_seed` derives one direction deterministically from a 32-byte
seed, so that a client can send the seed and the server rebuild the same direction. Directions never depend on
the data; the mechanisms that use them let the data in only through exactly sampled coins
(:mod:`shuffledp.clients.duchi`) or through an acceptance test (:mod:`shuffledp.clients.privunit`).
"""

from __future__ import annotations

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


def _peak_and_scaled_norms(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's largest magnitude ``peak`` and the norm ``s`` of the row divided by it (1 <= s <= sqrt(d); 0 for
    a zero row), so that ``||x_i||_2 = s_i peak_i`` without overflow."""
    arr = np.asarray(x, dtype=np.float64)
    peak = np.abs(arr).max(axis=1) if arr.shape[1] else np.zeros(arr.shape[0])
    scaled = arr / np.where(peak > 0.0, peak, 1.0)[:, None]
    return peak, np.sqrt(np.einsum("ij,ij->i", scaled, scaled))


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
    base = arr.astype(np.float64, copy=False)
    if not np.isfinite(base).all():
        raise ValueError(f"x has {int(np.count_nonzero(~np.isfinite(base)))} non-finite entries; refusing to clip")
    peak, s = _peak_and_scaled_norms(base)
    with np.errstate(over="ignore"):
        norms = s * peak  # an overflow to inf is a norm above c too
    clipped = norms > c
    if not clipped.any():
        return base.copy(), norms
    scale = np.ones_like(s)
    scale[clipped] = (c / peak[clipped]) / s[clipped]
    out = base * scale[:, None]  # x * 1.0 is x exactly: the rows inside the ball are copied unchanged
    pending = np.flatnonzero(clipped)
    for _ in range(200):
        norms[pending] = row_norms(out[pending])
        pending = pending[norms[pending] > c]
        if pending.size == 0:
            return out, norms
        scale[pending] = np.nextafter(scale[pending], 0.0) * (1.0 - 2.0**-50)
        out[pending] = base[pending] * scale[pending, None]
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


def _normals_from_words(words: np.ndarray) -> np.ndarray:
    """``words.size // 2`` standard normals from uint64 words (Box-Muller on pairs of 53-bit uniforms in (0, 1))."""
    u = (words >> np.uint64(11)).view(np.int64).astype(np.float64)  # < 2**53: exact
    u += 0.5
    u *= 2.0**-53
    pairs = u.reshape(-1, 2)  # (u1, u2) per pair
    r = np.log(pairs[:, 0])
    r *= -2.0
    np.sqrt(r, out=r)
    theta = pairs[:, 1] * (2.0 * math.pi)
    out = np.empty_like(pairs)
    np.cos(theta, out=out[:, 0])
    np.sin(theta, out=out[:, 1])
    out *= r[:, None]
    return out.reshape(-1)


def _rows_to_unit(normals: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(normals, axis=1, keepdims=True)
    return normals / norms  # a row of normals is zero with probability 0 (r > 0 and cos, sin never both 0)


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
    words = rng.uint64(2 * half * n)
    normals = _normals_from_words(words).reshape(n, 2 * half)[:, :d]
    return _rows_to_unit(normals)


def _ietf_counter_and_nonce(nonce16: bytes) -> tuple[int, bytes]:
    """RFC 8439's split of ``cryptography``'s 16-byte ChaCha20 nonce: a little-endian 32-bit initial block counter,
    then the 96-bit nonce."""
    return int.from_bytes(nonce16[:4], "little"), nonce16[4:]


@functools.lru_cache(maxsize=1)
def _sodium_xor_ic() -> Callable[..., int] | None:
    """libsodium's ``crypto_stream_chacha20_ietf_xor_ic`` (the same RFC 8439 ChaCha20, one C call per seed instead
    of a ``cryptography`` cipher object), from PyNaCl's bundled library or the system's; None when neither has it
    or it does not reproduce ``cryptography``'s keystream on a test seed (then the slower path is used)."""
    import ctypes
    import ctypes.util

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
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_uint32,
                       ctypes.c_void_p]
        probe = np.frombuffer(bytes(range(64)), dtype=np.uint8).reshape(2, SEED_BYTES)
        if np.array_equal(_keystreams_with(fn, probe, 1040), _keystreams_cryptography(probe, 1040)):
            return fn
    return None  # pragma: no cover - depends on the platform's libraries


def _keystreams_cryptography(seeds: np.ndarray, nbytes: int) -> np.ndarray:
    out = np.empty((seeds.shape[0], nbytes), dtype=np.uint8)
    zeros = bytes(nbytes)
    for i, seed in enumerate(seeds):
        out[i] = np.frombuffer(Cipher(algorithms.ChaCha20(seed.tobytes(), _NONCE), mode=None).encryptor().update(zeros),
                               dtype=np.uint8)
    return out


def _keystreams_with(fn: Callable[..., int], seeds: np.ndarray, nbytes: int) -> np.ndarray:
    import ctypes

    counter, nonce = _ietf_counter_and_nonce(_NONCE)
    if counter + (nbytes + 63) // 64 > 2**32:  # libsodium's counter does not carry into the nonce
        raise ValueError("the keystream would wrap the 32-bit block counter")
    keys = np.ascontiguousarray(seeds, dtype=np.uint8)
    out = np.empty((keys.shape[0], nbytes), dtype=np.uint8)
    zeros = np.zeros(nbytes, dtype=np.uint8)
    nbuf = ctypes.create_string_buffer(nonce, len(nonce))
    dst, src, key, nptr = out.ctypes.data, zeros.ctypes.data, keys.ctypes.data, ctypes.addressof(nbuf)
    for i in range(keys.shape[0]):
        if fn(dst + i * nbytes, src, nbytes, nptr, counter, key + i * SEED_BYTES) != 0:
            raise RuntimeError("libsodium's ChaCha20 failed")
    return out


def seed_keystreams(seeds: np.ndarray, nbytes: int) -> np.ndarray:
    """The first ``nbytes`` of the ChaCha20 keystream under each seed, with the fixed nonce (RFC 8439): through
    libsodium when it reproduces ``cryptography``'s keystream (checked once), else through ``cryptography``.

    Args:
        seeds: uint8 ``(k, 32)``.
        nbytes: bytes per seed.

    Returns:
        uint8 ``(k, nbytes)``.
    """
    fn = _sodium_xor_ic()
    if fn is None:  # pragma: no cover - depends on the platform's libraries
        return _keystreams_cryptography(seeds, nbytes)
    return _keystreams_with(fn, seeds, nbytes)


def directions_from_seeds(seeds: np.ndarray, d: int) -> np.ndarray:
    """The uniform direction in R^d derived from each seed (a uniform 32-byte seed gives a uniform direction).

    Row i's keystream is ChaCha20 under ``seeds[i]`` with a fixed nonce (RFC 8439), read as uint64 words for
    Box-Muller (Box and Muller, Ann. Math. Stat. 1958), normalised (Muller, CACM 1959). Client and server compute
    the same direction up to the last bits of ``log``/``cos``/``sin`` on their platforms (an ulp-level difference
    changes the decoded vector by about 1e-16 relatively, and never the privacy: the direction is
    data-independent, see docs/mechanisms.md).

    Args:
        seeds: uint8 ``(k, 32)``, one seed per row.
        d: the dimension.

    Returns:
        float64 ``(k, d)`` unit rows.

    Raises:
        ValueError: ``seeds`` is not ``(k, 32)`` uint8 or ``d`` is out of range.
    """
    arr = np.asarray(seeds)
    if arr.dtype != np.uint8 or arr.ndim != 2 or arr.shape[1] != SEED_BYTES:
        raise ValueError(f"direction seeds must be a (k, {SEED_BYTES}) uint8 array, got {arr.dtype} {arr.shape}")
    d = check_int("d", d, 1, _MAX_ELEMENTS)
    half = (d + 1) // 2
    stream = seed_keystreams(arr, 16 * half)
    words = stream.view("<u8")  # (k, 2 half)
    normals = _normals_from_words(words.reshape(-1)).reshape(arr.shape[0], 2 * half)[:, :d]
    return _rows_to_unit(normals)


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
