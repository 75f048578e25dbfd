"""Report wire format: round trip and every ReportError."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from shuffledp.clients.report import (
    INT_MAX,
    REPORT_HEADER_BYTES,
    ReportError,
    decode_report,
    decode_report_full,
    encode_report,
    report_length,
)


def _payload(d: int = 5, grid: int = -3) -> tuple[np.ndarray, bytes]:
    ints = np.array([0, 1, -7, 123456, -(2**30)][:d], dtype=np.int64)
    return ints, encode_report(ints, log2_grid=grid, eps_used=1.25)


def test_round_trip() -> None:
    ints, p = _payload()
    assert len(p) == report_length(5) == REPORT_HEADER_BYTES + 20
    rep = decode_report_full(p, expected_dim=5)
    assert np.array_equal(rep.ints, ints) and rep.log2_grid == -3 and rep.eps_used == 1.25
    vals = decode_report(p, expected_dim=5)
    assert vals.dtype == np.float64 and np.array_equal(vals, ints / 8.0)


def test_fixed_length_and_saturation() -> None:
    a = encode_report(np.zeros(10, dtype=np.int64), log2_grid=0, eps_used=1.0)
    b = encode_report(np.array([2**40, -(2**40)] + [0] * 8), log2_grid=0, eps_used=1.0)
    assert len(a) == len(b)
    rep = decode_report_full(b, expected_dim=10)
    assert rep.ints[0] == INT_MAX and rep.ints[1] == -INT_MAX
    u = encode_report(np.array([2**40], dtype=np.uint64), log2_grid=0, eps_used=1.0)
    assert decode_report_full(u, expected_dim=1).ints[0] == INT_MAX


def _patch(p: bytes, offset: int, fmt: str, value) -> bytes:
    b = bytearray(p)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda p: p[:10], "too short"),
        (lambda p: b"XXXX" + p[4:], "bad magic"),
        (lambda p: _patch(p, 4, "<B", 2), "unsupported report version"),
        (lambda p: _patch(p, 6, "<H", 1), "reserved"),
        (lambda p: _patch(p, 8, "<I", 6), "dimension 6 != expected dimension 5"),
        (lambda p: _patch(p, 5, "<b", 30), "log2_grid 30 outside"),
        (lambda p: _patch(p, 12, "<d", float("nan")), "eps_used"),
        (lambda p: _patch(p, 12, "<d", -1.0), "eps_used"),
        (lambda p: p + b"\x00", "payload length"),
        (lambda p: p[:-4], "payload length"),
        (lambda p: _patch(p, REPORT_HEADER_BYTES + 8, "<i", -(2**31)), "out of range"),
    ],
)
def test_every_report_error(mutate, match: str) -> None:
    _, p = _payload()
    with pytest.raises(ReportError, match=match):
        decode_report(mutate(p), expected_dim=5)


def test_expected_grid_and_types() -> None:
    _, p = _payload(grid=-3)
    with pytest.raises(ReportError, match="expected -4"):
        decode_report(p, expected_dim=5, expected_log2_grid=-4)
    with pytest.raises(ReportError, match="must be bytes"):
        decode_report("text", expected_dim=5)  # type: ignore[arg-type] - the wrong type on purpose
    with pytest.raises(ValueError, match="expected_dim"):
        decode_report(p, expected_dim=0)
    assert issubclass(ReportError, ValueError)


def test_encode_validation() -> None:
    with pytest.raises(TypeError, match="integer"):
        encode_report(np.array([0.5]), log2_grid=0, eps_used=1.0)
    with pytest.raises(ValueError, match="log2_grid"):
        encode_report(np.array([1]), log2_grid=-61, eps_used=1.0)
    with pytest.raises(ValueError, match="eps_used"):
        encode_report(np.array([1]), log2_grid=0, eps_used=0.0)
    with pytest.raises(ValueError, match="len\\(ints\\)"):
        encode_report(np.array([], dtype=np.int64), log2_grid=0, eps_used=1.0)
