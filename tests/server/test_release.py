"""The released batch opened one report at a time and decoded a chunk at a time (shuffledp.server.release).

:func:`open_release` must give the sum, count and bad count that opening and decoding each report alone gives
(``Mechanism.decode`` into ``ReportAccumulator.add``): exactly for ``laplace`` (its values are integers times one power
of two, so every partial sum is exact), and within :data:`DUCHI_RTOL` of the sum of the absolute values for
``duchi`` (float summation order). No shuffler process: the opener is a stand-in (a leading ``O`` opens, ``X``
fails to open).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shuffledp.clients.mechanism import Mechanism, make_mechanism
from shuffledp.clients.report import DecodedBatch
from shuffledp.server.optim import ReportAccumulator
from shuffledp.server.release import CHUNK_REPORTS, CHUNK_VALUES, chunk_rows, open_release

#: duchi's chunked sum against the single-report sum: at most this times the sum of the reports' absolute values per
#: coordinate (float64 summation of n terms in any order errs by at most about n * 1.1e-16 of it; n <= 1,025 here).
DUCHI_RTOL = 1e-12
ROUND = 7


def _mechanism(name: str) -> Mechanism:
    if name == "laplace":
        return make_mechanism("laplace", eps0=4.0, clip_l1=1.0)
    return make_mechanism("duchi", eps0=4.0, clip_l2=1.0)


def _payloads(mech: Mechanism, n: int, dim: int) -> list[bytes]:
    vecs = np.linspace(-1.0, 1.0, n * dim).reshape(n, dim) / dim
    return [row.tobytes() for row in mech.randomize_batch(vecs)]


def _opener(inner: bytes, round_id: int) -> bytes:
    """A stand-in for the server's HPKE opener: ``O`` + payload opens to the payload, anything else raises."""
    assert round_id == ROUND
    if not inner.startswith(b"O"):
        raise ValueError("the inner ciphertext does not open")
    return inner[1:]


def _sealed(payloads: list[bytes]) -> list[bytes]:
    return [b"O" + p for p in payloads]


def _one_at_a_time(mech: Mechanism, inners: list[bytes], dim: int) -> tuple[ReportAccumulator, int, np.ndarray]:
    """The single-report path: open, ``decode``, ``add`` each report alone, counting the failures; also the sum of
    the added reports' absolute values (the scale of the summation error)."""
    acc, bad, scale = ReportAccumulator(dim), 0, np.zeros(dim)
    for inner in inners:
        try:
            vec = mech.decode(_opener(inner, ROUND), dim)
            acc.add(vec)
            scale += np.abs(vec)
        except Exception:  # noqa: BLE001 - the single-report path counts any failure as a bad report
            bad += 1
    return acc, bad, scale


def _assert_same_sum(name: str, got: ReportAccumulator, ref: ReportAccumulator, scale: np.ndarray) -> None:
    assert got.count == ref.count
    if name == "laplace":
        np.testing.assert_array_equal(got._sum, ref._sum)
    else:
        assert np.all(np.abs(got._sum - ref._sum) <= DUCHI_RTOL * scale)


class Recording:
    """The mechanism, recording the size of every ``decode_batch`` call and how many inner ciphertexts had been
    read from the release when it was made."""

    def __init__(self, mech: Mechanism, read: list[int] | None = None) -> None:
        self.mech, self.sizes, self.read_at, self._read = mech, [], [], read

    def decode_batch(self, payloads: Any, dim: int) -> DecodedBatch:
        self.sizes.append(len(payloads))
        if self._read is not None:
            self.read_at.append(self._read[0])
        return self.mech.decode_batch(payloads, dim)

    def decode(self, payload: bytes, dim: int) -> np.ndarray:
        return self.mech.decode(payload, dim)


def _counting(inners: list[bytes], read: list[int]) -> Iterator[bytes]:
    for inner in inners:
        read[0] += 1
        yield inner


@pytest.mark.parametrize("name", ["laplace", "duchi"])
@pytest.mark.parametrize("n", [4, 5, 9])  # exactly one chunk, one chunk + 1, two chunks + 1
def test_the_chunked_sum_is_the_single_report_sum_laplace_exact_duchi_within_1e12(name: str, n: int) -> None:
    dim, chunk = 17, 4
    mech = _mechanism(name)
    inners = _sealed(_payloads(mech, n, dim))
    rec = Recording(mech)
    opened = open_release(iter(inners), _opener, ROUND, rec, dim, chunk=chunk)
    ref, ref_bad, scale = _one_at_a_time(mech, inners, dim)
    assert (opened.sum.count, opened.bad, opened.total) == (n, 0, n) and ref_bad == 0
    _assert_same_sum(name, opened.sum, ref, scale)
    assert rec.sizes == [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])


@pytest.mark.parametrize("n", [CHUNK_REPORTS, CHUNK_REPORTS + 1])
def test_the_default_chunk_boundary(n: int) -> None:
    """At d = 3 a chunk is CHUNK_REPORTS reports: exactly that many decode in one call, one more in a second, and
    the release is read no further ahead than one chunk (memory O(chunk * d))."""
    dim = 3
    assert chunk_rows(dim) == CHUNK_REPORTS
    mech = _mechanism("laplace")
    inners = _sealed(_payloads(mech, n, dim))
    read = [0]
    rec = Recording(mech, read)
    opened = open_release(_counting(inners, read), _opener, ROUND, rec, dim)
    ref, _, scale = _one_at_a_time(mech, inners, dim)
    assert (opened.sum.count, opened.bad) == (n, 0)
    _assert_same_sum("laplace", opened.sum, ref, scale)
    assert rec.sizes == [CHUNK_REPORTS] + ([1] if n > CHUNK_REPORTS else [])
    assert rec.read_at == [CHUNK_REPORTS] + ([n] if n > CHUNK_REPORTS else [])


def _malformed(name: str, payload: bytes) -> list[bytes]:
    """Payloads that open but must be refused: wrong magic, truncated, too long, and the mechanism's own defect (a
    report on a foreign grid for laplace, a bit that is not 0 or 1 for duchi)."""
    out = [b"JUNK" + payload[4:], payload[:-1], payload + b"\x00"]
    if name == "laplace":
        out.append(payload[:5] + bytes([(payload[5] + 5) % 256]) + payload[6:])
    else:
        out.append(payload[:-1] + b"\x02")
    return out


@pytest.mark.parametrize("name", ["laplace", "duchi"])
def test_bad_reports_in_a_chunk_are_counted_and_left_out_of_the_sum(name: str) -> None:
    """Reports that fail to open (never reach the decoder) and reports that open but are malformed (refused rows of
    their chunk) are counted bad; the others are summed as one at a time; count + bad is every report released."""
    dim, chunk = 17, 4
    mech = _mechanism(name)
    good = _sealed(_payloads(mech, 7, dim))
    bad_payloads = _malformed(name, good[0][1:])
    inners = [b"X-no-open", good[0], *(b"O" + p for p in bad_payloads[:2]), good[1], good[2], b"Xx",
              b"O" + bad_payloads[2], *good[3:], b"O" + bad_payloads[3]]
    rec = Recording(mech)
    opened = open_release(iter(inners), _opener, ROUND, rec, dim, chunk=chunk)
    ref, ref_bad, scale = _one_at_a_time(mech, inners, dim)
    assert (opened.sum.count, opened.bad) == (7, 6) == (ref.count, ref_bad)
    assert opened.total == len(inners)
    _assert_same_sum(name, opened.sum, ref, scale)
    assert sum(rec.sizes) == len(inners) - 2 and max(rec.sizes) == chunk  # the two that did not open never decode


def test_a_release_with_no_valid_report_adds_nothing_and_does_not_raise() -> None:
    dim = 5
    mech = _mechanism("laplace")
    payload = _payloads(mech, 1, dim)[0]
    inners = [b"O" + b"JUNK" + payload[4:]] * 5 + [b"X"] * 3
    opened = open_release(iter(inners), _opener, ROUND, mech, dim, chunk=4)
    assert (opened.sum.count, opened.bad, opened.total) == (0, 8, 8)
    empty = open_release(iter(()), _opener, ROUND, mech, dim)
    assert (empty.sum.count, empty.bad) == (0, 0)


def test_a_non_finite_row_the_decoder_did_not_refuse_is_bad() -> None:
    """``ReportAccumulator.add`` refuses a non-finite report (counted bad one at a time), so the chunked path leaves
    such a row out too, and keeps the rest of its chunk."""
    dim = 6
    mech = _mechanism("laplace")
    inners = _sealed(_payloads(mech, 5, dim))

    class NanRow:
        def decode_batch(self, payloads: Any, dim: int) -> DecodedBatch:
            batch = mech.decode_batch(payloads, dim)
            values = batch.values.copy()
            values[1, 2] = np.nan
            return DecodedBatch(values, dict(batch.refused))

    opened = open_release(iter(inners), _opener, ROUND, NanRow(), dim, chunk=5)  # type: ignore[arg-type] - a stand-in decoder
    ref, _, _ = _one_at_a_time(mech, inners[:1] + inners[2:], dim)
    assert (opened.sum.count, opened.bad) == (4, 1)
    np.testing.assert_array_equal(opened.sum._sum, ref._sum)


def test_a_decoder_that_raises_on_a_chunk_is_decoded_one_report_at_a_time(caplog: pytest.LogCaptureFixture) -> None:
    """``decode_batch`` refuses rows, it does not raise; if it raises all the same, no good report of the chunk is
    lost and each bad one is counted alone (as ``decode`` would), and the fact is logged."""
    dim = 6
    mech = _mechanism("laplace")
    good = _payloads(mech, 5, dim)
    inners = _sealed(good[:2] + [b"JUNK" + good[2][4:]] + good[3:])

    class Raises:
        def decode_batch(self, payloads: Any, dim: int) -> DecodedBatch:
            raise MemoryError("a decoder defect")

        def decode(self, payload: bytes, dim: int) -> np.ndarray:
            return mech.decode(payload, dim)

    with caplog.at_level(logging.WARNING, logger="shuffledp.server"):
        opened = open_release(iter(inners), _opener, ROUND, Raises(), dim, chunk=3)  # type: ignore[arg-type] - a stand-in decoder
    ref, ref_bad, _ = _one_at_a_time(mech, inners, dim)
    assert (opened.sum.count, opened.bad) == (4, 1) == (ref.count, ref_bad)
    np.testing.assert_array_equal(opened.sum._sum, ref._sum)
    assert sum("decoding them one at a time" in r.getMessage() for r in caplog.records) == 2  # one per chunk


def test_chunk_rows_bound_the_decoded_values() -> None:
    assert chunk_rows(650) == CHUNK_REPORTS
    assert chunk_rows(10**6) == CHUNK_VALUES // 10**6 >= 1
    assert chunk_rows(2**28) == 1
    for dim in (1, 650, 2048, 10**5, 2**21 + 1):
        assert 1 <= chunk_rows(dim) <= CHUNK_REPORTS and (chunk_rows(dim) * dim <= CHUNK_VALUES or chunk_rows(dim) == 1)
    with pytest.raises(ValueError, match="at least one report"):
        open_release(iter(()), _opener, ROUND, _mechanism("laplace"), 3, chunk=0)
