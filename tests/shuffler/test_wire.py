"""The hand-encoded hot messages are byte-identical to the generated protobuf serialisers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shuffledp.shuffler import shuffler_pb2 as pb
from shuffledp.shuffler.wire import (
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

    from shuffledp.shuffler.service import _submit_request

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
    from shuffledp.shuffler.service import _submit_request, batch_envelopes

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


def test_a_batch_of_many_tiny_items_is_neither_walked_nor_materialised(monkeypatch) -> None:
    """A 4 MiB message of 2 million empty envelopes (2 bytes each on the wire): the deserializer does not walk
    it, and taking the envelopes the batch has room for walks only that far (the whole walk cost 0.79 CPU-s
    here, about 12.6 s for a 64 MiB message), and only those become objects."""
    import tracemalloc

    from shuffledp.shuffler import wire
    from shuffledp.shuffler.service import _submit_request, batch_envelopes

    walked = 0
    real_field_at = wire._field_at

    def counting_field_at(raw, pos, tag):
        nonlocal walked
        walked += 1
        return real_field_at(raw, pos, tag)

    monkeypatch.setattr(wire, "_field_at", counting_field_at)
    raw = encode_bytes_field(4, b"\x0a\x00" * 2_000_000)
    tracemalloc.start()
    try:
        req = _submit_request(raw)
        assert req.WhichOneof("item") == "batch"
        assert walked == 2  # the single envelope field (absent) and the single batch field: no item yet
        assert len(batch_envelopes(req, 5)) == 5
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert walked == 2 + 5
    assert peak < 64 * 1024  # one memoryview per item would be about 380 MB
    with pytest.raises(ValueError, match="offset 6"):
        list(wire.iter_repeated_bytes_field(b"\x0a\x00" * 3 + b"\x08\x01", 1))


def test_a_large_non_canonical_message_is_refused_not_parsed(monkeypatch) -> None:
    """Above CANONICAL_ABOVE bytes, a message that is not one envelope or one canonical batch is refused with
    INVALID_ARGUMENT non_canonical; the generated parser (one object per item, about 1 GiB of memory for a 64 MiB
    message of empty items) never sees it. Below it, odd encodings are still parsed."""
    from shuffledp.shuffler.core import Refused
    from shuffledp.shuffler.service import CANONICAL_ABOVE, _item_kind, _submit_request, batch_envelopes

    def no_parser(raw):
        raise AssertionError("the generated parser was called")

    tiny = b"\x0a\x00" * ((CANONICAL_ABOVE + 2) // 2)
    # batch field split in two (protobuf merges repeated occurrences of a message field): not canonical
    split = encode_bytes_field(4, tiny) + encode_bytes_field(4, b"\x0a\x00")
    # a batch whose items are followed by an unknown field
    unknown = encode_bytes_field(4, tiny + b"\x10\x01")
    monkeypatch.setattr(pb.SubmitRequest, "FromString", no_parser)
    monkeypatch.setattr(pb.EnvelopeBatch, "FromString", no_parser)
    req = _submit_request(split)
    with pytest.raises(Refused) as info:
        _item_kind(req)
    assert (info.value.code, info.value.reason) == ("invalid_argument", "non_canonical")
    with pytest.raises(Refused) as info:
        batch_envelopes(_submit_request(unknown), len(tiny))  # room for all items: the walk meets the odd field
    assert (info.value.code, info.value.reason) == ("invalid_argument", "non_canonical")
    monkeypatch.undo()
    small = encode_bytes_field(4, b"\x0a\x01x" * 3 + b"\x10\x01") + encode_bytes_field(4, b"\x0a\x00")
    assert [bytes(x) for x in batch_envelopes(_submit_request(small), 10)] == [b"x", b"x", b"x", b""]
    with pytest.raises(Refused) as info:  # a small batch payload the parser cannot read either
        batch_envelopes(_submit_request(encode_bytes_field(4, b"\x0a\x05ab")), 10)
    assert info.value.reason == "malformed_batch"


def test_packed_keeps_order_and_the_limit() -> None:
    from shuffledp.shuffler.wire import packed

    items = [b"a" * 10, b"b" * 10, b"c" * 50, b"", b"d" * 10]
    groups = list(packed(iter(items), 45))
    assert [x for g in groups for x in g] == items  # order kept, nothing lost
    assert groups == [[b"a" * 10, b"b" * 10], [b"c" * 50], [b"", b"d" * 10]]  # an oversized item goes alone
    assert list(packed([], 45)) == []
