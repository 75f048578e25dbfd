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

import math

import numpy as np

from shuffledp.clients.noise import ChaCha20Rng
from shuffledp.clients.validation import check_int, check_positive_finite

__all__ = ["SEED_BYTES", "clip_l2", "unit_or_default", "directions", "direction_from_seed"]

#: Bytes of the seed a direction is derived from (a ChaCha20 key).
SEED_BYTES = 32
_NONCE = b"shuffledp-dir\x00\x00\x00"  # 16 bytes: domain separation of the derived keystream
_MAX_ELEMENTS = 2**28


def clip_l2(x: np.ndarray, clip: float) -> np.ndarray:
    """Scale ``x`` so that its L2 norm is at most ``clip`` (a new float64 array; ``x`` is never modified).

    Returns:
        ``x * min(1, clip / ||x||_2)``, the direction kept; the float result has ``||out||_2 <= clip`` as numpy
        computes it (the scale is nudged down if rounding overshoots).

    Raises:
        ValueError: ``x`` has a NaN or Inf entry; TypeError: ``x`` is not a real array.
    """
    c = check_positive_finite("clip", clip)
    arr = np.asarray(x)
    if arr.dtype.kind not in "fiub":
        raise TypeError(f"x must be a real numeric array, got dtype {arr.dtype}")
    out = np.array(arr, dtype=np.float64, copy=True).reshape(-1)
    if not np.all(np.isfinite(out)):
        raise ValueError(f"x has {int(np.count_nonzero(~np.isfinite(out)))} non-finite entries; refusing to clip")
    peak = float(np.max(np.abs(out))) if out.size else 0.0
    if peak == 0.0:
        return out
    scaled = out / peak  # no overflow in the norm below
    norm = float(np.linalg.norm(scaled)) * peak
    if norm <= c:
        return out
    scale = c / norm
    y = out * scale
    for _ in range(200):
        if float(np.linalg.norm(y)) <= c:
            return y
        scale = math.nextafter(scale, 0.0) * (1.0 - 2.0**-50)
        y = out * scale
    raise ArithmeticError("could not bring the L2 norm under the clip bound")  # pragma: no cover


def unit_or_default(x: np.ndarray) -> tuple[np.ndarray, float]:
    """The direction and norm of a finite vector.

    Returns:
        ``(x / ||x||_2, ||x||_2)``; for the zero vector, ``(e_1, 0.0)`` (any direction serves: the mechanisms
        then give both signs of it probability 1/2).
    """
    v = np.asarray(x, dtype=np.float64).reshape(-1)
    peak = float(np.max(np.abs(v))) if v.size else 0.0
    if peak == 0.0:
        e1 = np.zeros(v.size)
        e1[0] = 1.0
        return e1, 0.0
    scaled = v / peak
    n = float(np.linalg.norm(scaled))
    return scaled / n, n * peak


def _normals_from_words(words: np.ndarray) -> np.ndarray:
    """``words.size // 2`` standard normals from uint64 words (Box-Muller on pairs of 53-bit uniforms in (0, 1))."""
    u = ((words >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    u1, u2 = u[0::2], u[1::2]
    r = np.sqrt(-2.0 * np.log(u1))
    theta = (2.0 * math.pi) * u2
    out = np.empty(2 * u1.size)
    out[0::2] = r * np.cos(theta)
    out[1::2] = r * np.sin(theta)
    return out


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


def direction_from_seed(seed: bytes, d: int) -> np.ndarray:
    """The uniform direction in R^d derived from ``seed`` (a uniform 32-byte seed gives a uniform direction).

    The keystream is ChaCha20 under the seed with a fixed nonce (RFC 8439), read as uint64 words for
    Box-Muller. Client and server compute the same direction up to the last bits of ``log``/``cos``/``sin``
    on their platforms (an ulp-level difference changes the decoded vector by about 1e-16 relatively, and never
    the privacy: the direction is data-independent, see docs/mechanisms.md).

    Returns:
        A float64 unit vector of shape ``(d,)``.

    Raises:
        ValueError: ``seed`` is not 32 bytes or ``d`` is out of range.
    """
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    if not isinstance(seed, (bytes, bytearray)) or len(seed) != SEED_BYTES:
        raise ValueError(f"a direction seed must be {SEED_BYTES} bytes")
    d = check_int("d", d, 1, _MAX_ELEMENTS)
    half = (d + 1) // 2
    nbytes = 16 * half
    enc = Cipher(algorithms.ChaCha20(bytes(seed), _NONCE), mode=None).encryptor()
    stream = enc.update(bytes(nbytes))
    words = np.frombuffer(stream, dtype="<u8", count=2 * half)
    normals = _normals_from_words(words)[:d]
    return _rows_to_unit(normals.reshape(1, d))[0]
