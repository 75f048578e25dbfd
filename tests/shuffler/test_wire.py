"""The hand-encoded hot messages are byte-identical to the generated protobuf serialisers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shuffler import shuffler_pb2 as pb
from shuffler.wire import decode_single_bytes_field, encode_bytes_field


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=3000))
def test_encoding_matches_protobuf(data: bytes) -> None:
    assert encode_bytes_field(2, data) == pb.SubmitRequest(envelope=data).SerializeToString()
    assert encode_bytes_field(1, data) == pb.FetchResponse(inner=data).SerializeToString()
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
