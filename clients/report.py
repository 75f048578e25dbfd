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

Batches. Every format is encoded and validated a batch at a time (:func:`encode_reports`, :func:`read_reports`,
:func:`read_mechanism_reports`): a batch is a ``(k, length)`` uint8 array or a sequence of payloads, and each row
is checked in the order listed above, its first failing check naming the defect. The single-report functions
(:func:`encode_report`, :func:`decode_report_full`, :func:`decode_mechanism_header`) are the batch functions on a
batch of one, so the apps' report path and in-process studies run one implementation.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
    "DecodedReports",
    "DecodedBatch",
    "Payloads",
    "report_length",
    "encode_report",
    "encode_reports",
    "decode_report",
    "decode_report_full",
    "read_reports",
    "encode_mechanism_header",
    "decode_mechanism_header",
    "read_mechanism_reports",
]

REPORT_MAGIC = b"SDPR"
REPORT_VERSION = 1
_HEADER = struct.Struct("<4sBbHId")
REPORT_HEADER_BYTES = _HEADER.size  # 20
INT_MAX = 2**31 - 1  # saturation bound; -2**31 is out of range on the wire
LOG2_GRID_MIN = -60
LOG2_GRID_MAX = 20
MAX_DIM = 2**28  # 1 GiB of int32; anything larger is refused before allocating
# the header's numeric fields (both header shapes: field 5 is log2_grid (int8) or a reserved uint8)
_FIELDS = np.dtype({"names": ["version", "b5", "reserved", "dim", "eps"], "formats": ["u1", "u1", "<u2", "<u4", "<f8"],
                    "offsets": [4, 5, 6, 8, 12], "itemsize": REPORT_HEADER_BYTES})

#: A batch of payloads: a ``(k, length)`` uint8 array (one report per row) or a sequence of bytes-like payloads.
Payloads = np.ndarray | Sequence[Any]


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


@dataclass(frozen=True)
class DecodedBatch:
    """A batch of decoded reports: one row per report, the refused ones zero and named in ``refused``.

    Attributes:
        values: float64 ``(k, d)``: each accepted report's unbiased estimate; zero rows for refused reports.
        refused: row index -> why that report was refused (the message its :class:`ReportError` carries).
    """

    values: np.ndarray
    refused: dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> np.ndarray:
        """Boolean ``(k,)``: the accepted rows."""
        mask = np.ones(self.values.shape[0], dtype=bool)
        mask[list(self.refused)] = False
        return mask

    def only(self) -> np.ndarray:
        """The one report of a batch of one.

        Returns:
            Its float64 ``(d,)`` vector.

        Raises:
            ReportError: it was refused (the message says why).
        """
        if self.values.shape[0] != 1:
            raise ValueError(f"only() takes a batch of one report, this one has {self.values.shape[0]}")
        if self.refused:
            raise ReportError(self.refused[0])
        return self.values[0]


class _Rows:
    """A batch of payloads as a ``(k, 20)`` header array and a ``(k, body)`` body array (zero rows where a payload
    is not of the expected length). Checks are registered in order (:meth:`check`); :meth:`refused` names each
    failing row's first failed check."""

    def __init__(self, payloads: Payloads, length: int) -> None:
        if isinstance(payloads, (bytes, bytearray, memoryview, str)):
            raise TypeError("a batch is a sequence of payloads or a 2-D uint8 array, not one payload")
        self._early: dict[int, str] = {}  # rows refused before any check (not bytes)
        self._checks: list[tuple[np.ndarray, Callable[[int], str]]] = []
        self._failed: np.ndarray | None = None  # rows that failed any check so far
        self.lengths: np.ndarray | None = None  # set here for ragged batches, else every row's is the array's width
        if isinstance(payloads, np.ndarray):
            if payloads.dtype != np.uint8 or payloads.ndim != 2:
                raise TypeError(f"a batch array must be 2-D uint8, got {payloads.dtype} of shape {payloads.shape}")
            arr = payloads
        else:
            items = list(payloads)
            if all(type(p) is bytes and len(p) == length for p in items):
                arr = np.frombuffer(b"".join(items), dtype=np.uint8).reshape(len(items), length)
            else:
                arr = self._ragged(items, length)
        self.k = arr.shape[0]
        if self.lengths is None:
            self.lengths = np.full(self.k, arr.shape[1], dtype=np.int64)
        head = arr[:, :REPORT_HEADER_BYTES]
        if head.shape[1] < REPORT_HEADER_BYTES:
            head = np.zeros((self.k, REPORT_HEADER_BYTES), dtype=np.uint8)
        self.head = np.ascontiguousarray(head)
        self.fields = self.head.view(_FIELDS)[:, 0]
        self.body = arr[:, REPORT_HEADER_BYTES:length] if arr.shape[1] == length else \
            np.zeros((self.k, max(length - REPORT_HEADER_BYTES, 0)), dtype=np.uint8)
        lengths = self.lengths
        self.check(lengths < REPORT_HEADER_BYTES,
                   lambda i: f"payload too short: {lengths[i]} bytes < header {REPORT_HEADER_BYTES}")

    def _ragged(self, items: list[Any], length: int) -> np.ndarray:
        arr = np.zeros((len(items), length), dtype=np.uint8)
        self.lengths = np.zeros(len(items), dtype=np.int64)
        for i, p in enumerate(items):
            if not isinstance(p, (bytes, bytearray, memoryview)):
                self._early[i] = f"payload must be bytes, got {type(p).__name__}"
                continue
            buf = bytes(p)
            self.lengths[i] = len(buf)
            if len(buf) == length:
                arr[i] = np.frombuffer(buf, dtype=np.uint8)
            else:
                arr[i, :min(len(buf), REPORT_HEADER_BYTES)] = np.frombuffer(buf[:REPORT_HEADER_BYTES], dtype=np.uint8)
        return arr

    def check(self, fail: np.ndarray, message: Callable[[int], str]) -> None:
        """Register the next check: the rows where ``fail`` holds are refused with ``message(row)``, unless an
        earlier check refused them."""
        self._checks.append((fail, message))
        self._failed = fail if self._failed is None else self._failed | fail

    def refused(self) -> dict[int, str]:
        """Row -> its first failed check's message, for the rows that failed one."""
        out = dict(self._early)
        if not out and (self._failed is None or not self._failed.any()):
            return out
        for fail, message in self._checks:
            for i in np.flatnonzero(fail):
                out.setdefault(int(i), message(int(i)))
        return out

    def common(self, magic: bytes, dim: int) -> None:
        """The checks every format shares, in order: magic, version, dimension."""
        head = self.head
        self.check((head[:, :4] != np.frombuffer(magic, dtype=np.uint8)).any(axis=1),
                   lambda i: f"bad magic {bytes(head[i, :4])!r}, expected {magic!r}")
        version = self.fields["version"]
        self.check(version != REPORT_VERSION,
                   lambda i: f"unsupported report version {version[i]}, this decoder reads {REPORT_VERSION}")
        dims = self.fields["dim"]
        self.check(dims != dim, lambda i: f"report dimension {dims[i]} != expected dimension {dim}")

    def eps_used(self) -> np.ndarray:
        """The rows' ``eps_used``, after the check that refuses those that are not finite and positive."""
        eps = self.fields["eps"]
        self.check(~(eps > 0.0) | (eps == np.inf),  # NaN compares False: refused too
                   lambda i: f"eps_used must be finite and positive, got {float(eps[i])!r}")
        return eps

    def total_length(self, want: int, dim: int) -> None:
        """Refuse the rows whose length is not ``want``."""
        lengths = self.lengths
        self.check(lengths != want, lambda i: f"payload length {lengths[i]} != {want} for dimension {dim}")


def _zero_refused(rows: np.ndarray, refused: dict[int, str]) -> np.ndarray:
    """``rows`` with the refused rows set to zero (a copy when there are any)."""
    if not refused:
        return rows
    out = rows.copy()
    out[list(refused)] = 0
    return out


def report_length(dim: int) -> int:
    """Byte length of a report of dimension ``dim``."""
    check_int("dim", dim, 1, MAX_DIM)
    return REPORT_HEADER_BYTES + 4 * dim


def encode_reports(ints: np.ndarray, *, log2_grid: int, eps_used: float) -> np.ndarray:
    """Encode a batch of noisy integer vectors, one report per row.

    Args:
        ints: integer array ``(k, d)``; values beyond the int32 range are saturated to ``+-(2**31 - 1)``
            (post-processing, see the module docstring).
        log2_grid: the grid exponent every row was randomized on.
        eps_used: the epsilon the randomizer spent (informational).

    Returns:
        uint8 array ``(k, 20 + 4 d)``: row i is the payload of ``ints[i]``.

    Raises:
        TypeError: ``ints`` is not an integer array; ValueError: ``d``, ``log2_grid`` or ``eps_used`` out of range.
    """
    arr = np.asarray(ints)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"ints must be an integer array, got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"a batch of integer vectors is 2-D, got shape {arr.shape}")
    dim = check_int("len(ints)", arr.shape[1], 1, MAX_DIM)
    check_int("log2_grid", log2_grid, LOG2_GRID_MIN, LOG2_GRID_MAX)
    eps = float(eps_used)
    if not (math.isfinite(eps) and eps > 0.0):
        raise ValueError(f"eps_used must be a finite positive number, got {eps_used!r}")
    if arr.dtype.kind == "u":
        sat = np.minimum(arr, np.uint64(INT_MAX)).astype("<i4")
    else:
        sat = np.clip(arr.astype(np.int64, copy=False), -INT_MAX, INT_MAX).astype("<i4")
    out = np.empty((arr.shape[0], REPORT_HEADER_BYTES + 4 * dim), dtype=np.uint8)
    header = _HEADER.pack(REPORT_MAGIC, REPORT_VERSION, int(log2_grid), 0, dim, eps)
    out[:, :REPORT_HEADER_BYTES] = np.frombuffer(header, dtype=np.uint8)
    out[:, REPORT_HEADER_BYTES:] = sat.view(np.uint8).reshape(arr.shape[0], 4 * dim)
    return out


def encode_report(ints: np.ndarray, *, log2_grid: int, eps_used: float) -> bytes:
    """Encode a noisy integer vector (any shape, flattened) as a fixed-length payload: :func:`encode_reports` on a
    batch of one."""
    arr = np.asarray(ints)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"ints must be an integer array, got dtype {arr.dtype}")
    return encode_reports(arr.reshape(1, -1), log2_grid=log2_grid, eps_used=eps_used)[0].tobytes()


@dataclass(frozen=True)
class DecodedReports:
    """A validated batch of reports (:func:`read_reports`): refused rows are zero and named in ``refused``.

    Attributes:
        ints: int32 ``(k, d)``.
        log2_grid: int ``(k,)``.
        eps_used: float64 ``(k,)``.
        refused: row index -> why that report was refused.
    """

    ints: np.ndarray
    log2_grid: np.ndarray
    eps_used: np.ndarray
    refused: dict[int, str]

    def to_batch(self) -> DecodedBatch:
        """The real-valued reports ``gamma * y`` (exact: gamma is a power of two), refused rows zero."""
        vals = np.ldexp(self.ints.astype(np.float64), self.log2_grid[:, None].astype(np.int32))
        return DecodedBatch(vals, dict(self.refused))


def read_reports(payloads: Payloads, *, expected_dim: int, expected_log2_grid: int | None = None) -> DecodedReports:
    """Validate and decode a batch of payloads; a malformed one is refused (named in ``refused``), not raised.

    Checks per row, in order: bytes, length at least a header, magic, version, dimension equal to
    ``expected_dim``, reserved field, grid exponent in range (and equal to ``expected_log2_grid`` if given),
    eps_used finite and positive, total length, and every integer within ``[-(2**31 - 1), 2**31 - 1]``.

    Returns:
        :class:`DecodedReports`.
    """
    dim = check_int("expected_dim", expected_dim, 1, MAX_DIM)
    want = REPORT_HEADER_BYTES + 4 * dim
    rows = _Rows(payloads, want)
    rows.common(REPORT_MAGIC, dim)
    reserved, grid = rows.fields["reserved"], rows.fields["b5"].view(np.int8)
    rows.check(reserved != 0, lambda i: f"reserved header field must be 0, got {reserved[i]}")
    rows.check((grid < LOG2_GRID_MIN) | (grid > LOG2_GRID_MAX),
               lambda i: f"log2_grid {grid[i]} outside [{LOG2_GRID_MIN}, {LOG2_GRID_MAX}]")
    if expected_log2_grid is not None:
        rows.check(grid != expected_log2_grid, lambda i: f"log2_grid {grid[i]} != expected {expected_log2_grid}")
    eps = rows.eps_used()
    rows.total_length(want, dim)
    ints = rows.body.view("<i4")
    rows.check((ints == np.int32(-(2**31))).any(axis=1),
               lambda i: "integer out of range: -2**31 is never produced by a valid encoder")
    refused = rows.refused()
    return DecodedReports(_zero_refused(ints, refused).astype(np.int32), _zero_refused(grid, refused).astype(np.int64),
                          eps.astype(np.float64), refused)


def decode_report_full(
    payload: bytes, *, expected_dim: int, expected_log2_grid: int | None = None
) -> DecodedReport:
    """Validate and decode one payload (:func:`read_reports` on a batch of one); raise :class:`ReportError` on any
    defect, the first of the checks listed there."""
    batch = read_reports([payload], expected_dim=expected_dim, expected_log2_grid=expected_log2_grid)
    if batch.refused:
        raise ReportError(batch.refused[0])
    return DecodedReport(ints=batch.ints[0], log2_grid=int(batch.log2_grid[0]), eps_used=float(batch.eps_used[0]))


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


def read_mechanism_reports(payloads: Payloads, *, magic: bytes, expected_dim: int,
                           body_bytes: int) -> tuple[np.ndarray, dict[int, str]]:
    """Validate a batch of an L2 mechanism's reports: per row, bytes, magic, version, dimension, reserved fields,
    ``eps_used`` and length, in that order.

    Returns:
        ``(bodies, refused)``: uint8 ``(k, body_bytes)`` (zero rows where refused) and row -> why refused.
    """
    dim = check_int("expected_dim", expected_dim, 1, MAX_DIM)
    rows = _Rows(payloads, REPORT_HEADER_BYTES + body_bytes)
    rows.common(magic, dim)
    rows.check((rows.fields["b5"] != 0) | (rows.fields["reserved"] != 0), lambda i: "reserved header fields must be 0")
    rows.eps_used()
    rows.total_length(REPORT_HEADER_BYTES + body_bytes, dim)
    refused = rows.refused()
    return _zero_refused(rows.body, refused), refused


def decode_mechanism_header(payload: bytes, *, magic: bytes, expected_dim: int, body_bytes: int) -> float:
    """Validate one L2 mechanism's report (:func:`read_mechanism_reports` on a batch of one).

    Returns:
        The declared ``eps_used`` (informational; the server never trusts it).

    Raises:
        ReportError: any defect, named.
    """
    _, refused = read_mechanism_reports([payload], magic=magic, expected_dim=expected_dim, body_bytes=body_bytes)
    if refused:
        raise ReportError(refused[0])
    return float(struct.unpack_from("<d", bytes(payload), 12)[0])
