"""Fetch messages built straight from where the output lies (read buffers, or the retained staging buffer) and
the one-copy Submit batch encoding: byte-identical to what the generic packing and the protobuf serialiser give."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

import shuffledp.shuffler.output as outmod
from shuffledp.shuffler import shuffler_pb2 as pb
from shuffledp.shuffler import wire
from shuffledp.shuffler.core import ShufflerCore

from ._direct_io import _refuse_o_direct  # noqa: TID252 - a helper module next to the tests (tests/ is not a package)


def _run(core: ShufflerCore, kit, envelopes: list[bytes], *, round_id: int = 1):
    b = core.begin(kit.header(len(envelopes), round_id=round_id))
    for e in envelopes:
        b.add(e)
    return b.finish()


def _expected(items: list[bytes], packing: int) -> list[bytes]:
    return [wire.encode_repeated_bytes_field(1, group) for group in wire.packed(items, packing)]


@pytest.mark.parametrize("inner_length", [1, 100, 3000, 4096, 8192, 20000])
@pytest.mark.parametrize("packing", [1, 10_000, 65_536])
def test_read_messages_match_the_generic_packing_across_read_chunks(tmp_path: Path, monkeypatch, inner_length: int,
                                                                     packing: int) -> None:
    """Items straddling 8 KiB read chunks, items longer than a chunk, messages of one item or many: the same
    messages as packing the items one by one (wire.packed + encode_repeated_bytes_field), through O_DIRECT reads,
    through the page cache, and from memory."""

    monkeypatch.setattr(outmod, "_READ_CHUNK", 8192)
    n = 13
    items = [secrets.token_bytes(inner_length) for _ in range(n)]
    path = tmp_path / "out"
    path.write_bytes(b"".join(items))
    expected = _expected(items, packing)
    assert list(outmod.read_messages(path, n, inner_length, packing)) == expected
    assert list(outmod.messages_from_view(memoryview(path.read_bytes()), n, inner_length, packing)) == expected
    _refuse_o_direct(monkeypatch)
    assert list(outmod.read_messages(path, n, inner_length, packing)) == expected
    path.write_bytes(b"".join(items)[:-1])
    with pytest.raises(RuntimeError, match="is truncated"):
        list(outmod.read_messages(path, n, inner_length, packing))


def test_read_buffers_are_private_and_reused(tmp_path: Path) -> None:
    """The O_DIRECT read buffers are private anonymous mappings kept for the next fetch (a shared mapping is
    shmem, zeroed at every fault of every fetch), and at most a few are kept."""
    path = tmp_path / "out"
    path.write_bytes(secrets.token_bytes(5 * 3000))
    list(outmod.read_messages(path, 5, 3000, 1 << 20))
    kept = list(outmod._spare_read_buffers)
    assert 1 <= len(kept) <= outmod._SPARE_READ_BUFFERS
    list(outmod.read_messages(path, 5, 3000, 1 << 20))
    assert {id(b) for b in outmod._spare_read_buffers} == {id(b) for b in kept}  # the same mappings again


def test_fetch_from_the_retained_buffer_is_the_file_and_holds_the_buffer(kit, tmp_path: Path) -> None:
    """While the retained staging buffer holds the last batch's output, Fetch messages come from it: the same
    bytes as the output file. A Fetch in progress keeps the buffer from the next batch (which maps its own), and
    once the buffer is taken, Fetch reads the file."""
    c = ShufflerCore(kit.core_config(tmp_path / "j"))
    try:
        sealed = _run(c, kit, [kit.seal(i) for i in range(6)])
        assert c._spare_holds == sealed.batch_id
        from_file = list(outmod.read_messages(sealed.output, sealed.n, sealed.inner_length, 1 << 20))
        assert list(c.read_batch_messages(sealed.batch_id, 1 << 20)) == from_file
        reading = c.read_batch_messages(sealed.batch_id, 1)
        first = next(reading)
        assert c._spare_readers == 1 and c.take_buffer(0) is None  # not taken while read
        second = _run(c, kit, [kit.seal(i, round_id=2) for i in range(6)], round_id=2)
        rest = list(reading)
        assert b"".join([first, *rest]) == from_file[0]  # the fetch in progress was not disturbed
        assert c._spare_readers == 0 and c._spare_holds == sealed.batch_id  # the second batch's buffer was dropped
        c.take_buffer(0).close()
        assert c._spare_holds is None
        assert list(c.read_batch_messages(sealed.batch_id, 1 << 20)) == from_file  # from the file now
        assert list(c.read_batch(second.batch_id)) == [
            x for m in outmod.read_messages(second.output, second.n, second.inner_length, 1)
            for x in wire.iter_repeated_bytes_field(m, 1)
        ]
        abandoned = c.read_batch_messages(second.batch_id, 1)
        next(abandoned)
        abandoned.close()  # a Fetch the peer abandoned gives the buffer back
        assert c._spare_readers == 0
    finally:
        c.close()


@pytest.mark.parametrize("sizes", [[0], [1, 2, 3], [300, 0, 70_000], [127, 128, 16_383, 16_384]])
def test_batch_message_is_the_protobuf_serialisation(sizes: list[int]) -> None:
    items = [secrets.token_bytes(n) for n in sizes]
    expected = pb.SubmitRequest(batch=pb.EnvelopeBatch(envelopes=items)).SerializeToString()
    assert wire.encode_batch_message(4, 1, items) == expected
    assert wire.encode_batch_message(4, 1, [memoryview(x) for x in items]) == expected
    assert wire.field_header(1, len(items[-1])) + items[-1] == wire.encode_bytes_field(1, items[-1])
