"""The hand-encoded hot messages are byte-identical to the generated protobuf serialisers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shuffler import shuffler_pb2 as pb
from shuffler.wire import (
    decode_repeated_bytes_field,
    decode_single_bytes_field,
    encode_bytes_field,
    encode_repeated_bytes_field,
)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=3000))
def test_encoding_matches_protobuf(data: bytes) -> None:
    assert encode_bytes_field(2, data) == pb.SubmitRequest(envelope=data).SerializeToString()
    assert encode_bytes_field(1, data) == pb.FetchResponse(inner=[data]).SerializeToString()
    assert decode_single_bytes_field(encode_bytes_field(1, data), 1) == data
    assert pb.SubmitRequest.FromString(encode_bytes_field(2, data)).envelope == data


def test_large_lengths_and_memoryview() -> None:
    data = bytes(range(256)) * 5000  # 1.28 MB: a three-byte varint
    enc = encode_bytes_field(2, memoryview(data))
    assert enc == pb.SubmitRequest(envelope=data).SerializeToString()
    assert decode_single_bytes_field(enc, 2) == data


def test_decode_rejects_anything_else() -> None:
    good = encode_bytes_field(1, b"abc")
    assert decode_single_bytes_field(good, 2) is None  # other field
    assert decode_single_bytes_field(good + b"\x08\x01", 1) is None  # trailing field
    assert decode_single_bytes_field(good[:-1], 1) is None  # truncated
    assert decode_single_bytes_field(b"\x0a", 1) is None
    assert decode_single_bytes_field(b"\x0a" + b"\xff" * 11, 1) is None  # overlong varint
    assert decode_single_bytes_field(b"", 1) is None


def test_numpy_buffers_use_their_byte_length() -> None:
    import numpy as np

    arr = np.arange(24, dtype=np.uint8).reshape(4, 6)  # len() would be 4
    assert encode_bytes_field(2, arr) == pb.SubmitRequest(envelope=arr.tobytes()).SerializeToString()
    wide = np.arange(6, dtype=np.int32)
    assert decode_single_bytes_field(encode_bytes_field(1, wide), 1) == wide.tobytes()


def test_submit_deserializer_fast_path_and_fallback() -> None:
    import pytest
    from google.protobuf.message import DecodeError

    from shuffler.service import _submit_request

    env = b"\x01" * 500
    fast = _submit_request(pb.SubmitRequest(envelope=env).SerializeToString())
    assert fast.WhichOneof("item") == "envelope" and bytes(fast.envelope) == env
    assert isinstance(fast.envelope, memoryview)  # sliced, not copied
    hdr = _submit_request(pb.SubmitRequest(header=pb.SubmitHeader(round_id=5)).SerializeToString())
    assert hdr.WhichOneof("item") == "header" and hdr.header.round_id == 5
    # header and envelope in one message: protobuf's oneof rule (last one wins) via the generated parser
    both = pb.SubmitRequest(header=pb.SubmitHeader(round_id=5)).SerializeToString() + encode_bytes_field(2, b"e")
    assert _submit_request(both).WhichOneof("item") == "envelope"
    assert _submit_request(b"").WhichOneof("item") is None
    with pytest.raises(DecodeError):
        _submit_request(b"\xff\xff\xff\xff\x0f junk")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=20))
def test_repeated_encoding_matches_protobuf(items: list[bytes]) -> None:
    fetch = encode_repeated_bytes_field(1, items)
    assert fetch == pb.FetchResponse(inner=items).SerializeToString()
    assert decode_repeated_bytes_field(fetch, 1) == items
    batch = encode_bytes_field(4, fetch)
    assert batch == pb.SubmitRequest(batch=pb.EnvelopeBatch(envelopes=items)).SerializeToString()


def test_repeated_decode_rejects_anything_else() -> None:
    good = encode_repeated_bytes_field(1, [b"abc", b"", b"de"])
    assert decode_repeated_bytes_field(good, 1) == [b"abc", b"", b"de"]
    assert decode_repeated_bytes_field(good, 2) is None  # other field
    assert decode_repeated_bytes_field(good + b"\x08\x01", 1) is None  # a varint field after them
    assert decode_repeated_bytes_field(good[:-1], 1) is None  # truncated
    assert decode_repeated_bytes_field(b"", 1) is None


def test_submit_deserializer_batch_fast_path() -> None:
    from shuffler.service import _submit_request, batch_envelopes

    items = [b"\x01" * 300, b"", b"\x02" * 5]
    req = _submit_request(pb.SubmitRequest(batch=pb.EnvelopeBatch(envelopes=items)).SerializeToString())
    assert req.WhichOneof("item") == "batch"
    taken = batch_envelopes(req, 10)
    assert [bytes(x) for x in taken] == items
    assert all(isinstance(x, memoryview) for x in taken)  # sliced, not copied
    assert [bytes(x) for x in batch_envelopes(req, 2)] == items[:2]  # only as many as asked for
    # a non-canonical batch (an unknown field inside) goes through the generated parser, which skips it
    odd = encode_bytes_field(4, encode_repeated_bytes_field(1, items) + b"\x10\x01")
    parsed = _submit_request(odd)
    assert parsed.WhichOneof("item") == "batch" and batch_envelopes(parsed, 10) == items
    assert batch_envelopes(parsed, 1) == items[:1]


def test_a_batch_of_many_tiny_items_is_not_materialised() -> None:
    """A packed message of 100,000 empty envelopes (2 bytes each on the wire) is counted without slicing, and
    only as many items as the batch has room for become objects."""
    import tracemalloc

    from shuffler import wire
    from shuffler.service import _submit_request, batch_envelopes

    raw = encode_bytes_field(4, b"\x0a\x00" * 100_000)
    tracemalloc.start()
    try:
        req = _submit_request(raw)
        assert req.WhichOneof("item") == "batch" and req.count == 100_000
        assert len(batch_envelopes(req, 4)) == 4
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024  # one memoryview per item would be about 19 MB
    assert wire.count_repeated_bytes_field(b"\x0a\x00" * 3 + b"\x08\x01", 1) is None  # a varint at the end
    with pytest.raises(ValueError, match="offset 6"):
        list(wire.iter_repeated_bytes_field(b"\x0a\x00" * 3 + b"\x08\x01", 1))


def test_packed_keeps_order_and_the_limit() -> None:
    from shuffler.wire import packed

    items = [b"a" * 10, b"b" * 10, b"c" * 50, b"", b"d" * 10]
    groups = list(packed(iter(items), 45))
    assert [x for g in groups for x in g] == items  # order kept, nothing lost
    assert groups == [[b"a" * 10, b"b" * 10], [b"c" * 50], [b"", b"d" * 10]]  # an oversized item goes alone
    assert list(packed([], 45)) == []
