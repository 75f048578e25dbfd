"""Fixed-length wire format of one randomized report (the plaintext inside the inner HPKE layer).

Layout (all fields little-endian; the length depends only on the dimension ``d``)::

    offset  size   field
    0       4      magic  b"SDPR"
    4       1      version (uint8) = REPORT_VERSION
    5       1      log2_grid (int8): the grid is gamma = 2**log2_grid
    6       2      reserved (uint16) = 0
    8       4      d (uint32): number of coordinates
    12      8      eps_used (float64): the epsilon the client's randomizer actually spent (informational:
                   the server never trusts it; the accountant is charged with the pinned eps0)
    20      4*d    y (int32[d]): the noisy integer vector, saturated to [-(2**31 - 1), 2**31 - 1]

Why int32, saturating: ``y = q + z`` with ``|q| <= K <= 2**30`` (the L1 radius in grid units) and ``z`` discrete
Laplace noise of scale ``2K/eps0``. Clamping ``y`` to the int32 range is a deterministic function of the
already-private output, i.e. post-processing, so it never weakens the eps0-LDP guarantee; it only biases the
rare saturated coordinate. The randomizer refuses settings whose per-coordinate saturation probability is not
negligible (see :class:`shuffledp.clients.randomizer.DiscreteLaplaceRandomizer`). int32 halves the bytes of int64 and
the envelope size is dominated by this vector. The value ``-2**31`` is never produced, so the decoder treats it as
out of range (it is what a naive int32 overflow would produce).

All reports of one round therefore have the same length, ``REPORT_HEADER_BYTES + 4 * d``.

The L2 mechanisms (:mod:`shuffledp.clients.duchi`, :mod:`shuffledp.clients.privunit`) use the same 20-byte header
shape with their own magic (:func:`encode_mechanism_header`, :func:`decode_mechanism_header`): magic, version,
two reserved fields (0), ``d`` and ``eps_used``, followed by a body whose length depends only on ``d``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from shuffledp.clients.validation import check_int

__all__ = [
    "REPORT_MAGIC",
    "REPORT_VERSION",
    "REPORT_HEADER_BYTES",
    "INT_MAX",
    "LOG2_GRID_MIN",
    "LOG2_GRID_MAX",
    "ReportError",
    "DecodedReport",
    "report_length",
    "encode_report",
    "decode_report",
    "decode_report_full",
    "encode_mechanism_header",
    "decode_mechanism_header",
]

REPORT_MAGIC = b"SDPR"
REPORT_VERSION = 1
_HEADER = struct.Struct("<4sBbHId")
REPORT_HEADER_BYTES = _HEADER.size  # 20
INT_MAX = 2**31 - 1  # saturation bound; -2**31 is out of range on the wire
LOG2_GRID_MIN = -60
LOG2_GRID_MAX = 20
MAX_DIM = 2**28  # 1 GiB of int32; anything larger is refused before allocating


class ReportError(ValueError):
    """A report payload is malformed: wrong length, version, dimension, grid or integer range.

    The server counts and skips such reports; it never aborts a round because of one.
    """


@dataclass(frozen=True)
class DecodedReport:
    """A validated report: the integer vector, its grid exponent and the client's declared eps."""

    ints: np.ndarray  # int32, shape (d,)
    log2_grid: int
    eps_used: float

    @property
    def values(self) -> np.ndarray:
        """Real-valued report, ``gamma * ints`` (float64; exact, since gamma is a power of two)."""
        return np.ldexp(self.ints.astype(np.float64), self.log2_grid)


def report_length(dim: int) -> int:
    """Byte length of a report of dimension ``dim``."""
    check_int("dim", dim, 1, MAX_DIM)
    return REPORT_HEADER_BYTES + 4 * dim


def encode_report(ints: np.ndarray, *, log2_grid: int, eps_used: float) -> bytes:
    """Encode a noisy integer vector as a fixed-length payload.

    ``ints`` is any integer array (flattened); values beyond the int32 range are saturated to
    ``+-(2**31 - 1)`` (post-processing, see the module docstring).
    """
    arr = np.asarray(ints)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"ints must be an integer array, got dtype {arr.dtype}")
    arr = arr.reshape(-1)
    dim = check_int("len(ints)", arr.size, 1, MAX_DIM)
    check_int("log2_grid", log2_grid, LOG2_GRID_MIN, LOG2_GRID_MAX)
    eps = float(eps_used)
    if not (math.isfinite(eps) and eps > 0.0):
        raise ValueError(f"eps_used must be a finite positive number, got {eps_used!r}")
    if arr.dtype.kind == "u":
        sat = np.minimum(arr, np.uint64(INT_MAX)).astype("<i4")
    else:
        sat = np.clip(arr.astype(np.int64, copy=False), -INT_MAX, INT_MAX).astype("<i4")
    header = _HEADER.pack(REPORT_MAGIC, REPORT_VERSION, int(log2_grid), 0, dim, eps)
    return header + sat.tobytes()


def _read_header(payload: bytes, header: struct.Struct, magic: bytes, dim: int) -> tuple[bytes, tuple[Any, ...]]:
    """The payload as bytes and its header's fields, after the checks every report format shares: bytes, at least a
    header, ``magic``, the version this decoder reads, dimension ``dim`` (fields 0, 1 and 4 of every header).

    Raises:
        ReportError: the first of those checks that fails, named.
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ReportError(f"payload must be bytes, got {type(payload).__name__}")
    buf = bytes(payload)
    if len(buf) < header.size:
        raise ReportError(f"payload too short: {len(buf)} bytes < header {header.size}")
    fields = header.unpack_from(buf, 0)
    if fields[0] != magic:
        raise ReportError(f"bad magic {fields[0]!r}, expected {magic!r}")
    if fields[1] != REPORT_VERSION:
        raise ReportError(f"unsupported report version {fields[1]}, this decoder reads {REPORT_VERSION}")
    if fields[4] != dim:
        raise ReportError(f"report dimension {fields[4]} != expected dimension {dim}")
    return buf, fields


def decode_report_full(
    payload: bytes, *, expected_dim: int, expected_log2_grid: int | None = None
) -> DecodedReport:
    """Validate and decode a payload; raise :class:`ReportError` on any defect.

    Checks, in order: length at least a header, magic, version, reserved field, dimension equal to
    ``expected_dim``, grid exponent in range (and equal to ``expected_log2_grid`` if given), eps_used finite and
    positive, total length, and every integer within ``[-(2**31 - 1), 2**31 - 1]``.
    """
    dim = check_int("expected_dim", expected_dim, 1, MAX_DIM)
    buf, (_, _, log2_grid, reserved, _, eps) = _read_header(payload, _HEADER, REPORT_MAGIC, dim)
    if reserved != 0:
        raise ReportError(f"reserved header field must be 0, got {reserved}")
    if not LOG2_GRID_MIN <= log2_grid <= LOG2_GRID_MAX:
        raise ReportError(f"log2_grid {log2_grid} outside [{LOG2_GRID_MIN}, {LOG2_GRID_MAX}]")
    if expected_log2_grid is not None and log2_grid != expected_log2_grid:
        raise ReportError(f"log2_grid {log2_grid} != expected {expected_log2_grid}")
    if not (math.isfinite(eps) and eps > 0.0):
        raise ReportError(f"eps_used must be finite and positive, got {eps!r}")
    want = REPORT_HEADER_BYTES + 4 * dim
    if len(buf) != want:
        raise ReportError(f"payload length {len(buf)} != {want} for dimension {dim}")
    ints = np.frombuffer(buf, dtype="<i4", offset=REPORT_HEADER_BYTES, count=dim)
    if np.any(ints == np.int32(-(2**31))):
        raise ReportError("integer out of range: -2**31 is never produced by a valid encoder")
    return DecodedReport(ints=ints.astype(np.int32), log2_grid=int(log2_grid), eps_used=float(eps))


def decode_report(payload: bytes, *, expected_dim: int, expected_log2_grid: int | None = None) -> np.ndarray:
    """Decode a payload to its real-valued vector ``gamma * y`` (float64, shape ``(expected_dim,)``).

    Raises :class:`ReportError` on wrong length, version, dimension, grid or out-of-range integers.
    """
    return decode_report_full(payload, expected_dim=expected_dim, expected_log2_grid=expected_log2_grid).values


_MECH_HEADER = struct.Struct("<4sBBHId")


def encode_mechanism_header(magic: bytes, dim: int, eps_used: float) -> bytes:
    """The 20-byte header of an L2 mechanism's report (module docstring): ``magic``, version 1, ``dim``, ``eps_used``.

    Returns:
        The header bytes.

    Raises:
        ValueError: ``magic`` is not 4 bytes, ``eps_used`` is not finite and positive; TypeError/ValueError: ``dim``
        is not an int in [1, 2**28].
    """
    if not isinstance(magic, bytes) or len(magic) != 4:
        raise ValueError(f"magic must be 4 bytes, got {magic!r}")
    dim = check_int("dim", dim, 1, MAX_DIM)
    eps = float(eps_used)
    if not (math.isfinite(eps) and eps > 0.0):
        raise ValueError(f"eps_used must be a finite positive number, got {eps_used!r}")
    return _MECH_HEADER.pack(magic, REPORT_VERSION, 0, 0, dim, eps)


def decode_mechanism_header(payload: bytes, *, magic: bytes, expected_dim: int, body_bytes: int) -> float:
    """Validate an L2 mechanism's report: magic, version, reserved fields, dimension, ``eps_used`` and length.

    Returns:
        The declared ``eps_used`` (informational; the server never trusts it).

    Raises:
        ReportError: any defect, named.
    """
    dim = check_int("expected_dim", expected_dim, 1, MAX_DIM)
    buf, (_, _, r8, r16, _, eps) = _read_header(payload, _MECH_HEADER, magic, dim)
    if r8 != 0 or r16 != 0:
        raise ReportError("reserved header fields must be 0")
    if not (math.isfinite(eps) and eps > 0.0):
        raise ReportError(f"eps_used must be finite and positive, got {eps!r}")
    if len(buf) != _MECH_HEADER.size + body_bytes:
        raise ReportError(f"payload length {len(buf)} != {_MECH_HEADER.size + body_bytes} for dimension {dim}")
    return float(eps)
