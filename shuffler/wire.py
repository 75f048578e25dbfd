"""Byte-level protobuf encoding for the hot messages: envelopes on Submit, inner ciphertexts on Fetch.

``SubmitRequest{envelope}`` is a single length-delimited ``bytes`` field (protobuf encoding: tag byte
``(field << 3) | 2``, base-128 varint length, payload); ``SubmitRequest{batch{envelopes...}}`` and
``FetchResponse{inner...}`` are sequences of such fields. Encoding them directly saves the copies that building
and serialising a message object costs for megabyte payloads. The output is byte-identical to
``SerializeToString()`` (tests check this); decoding falls back to the generated parser for anything that is not
exactly in this canonical form.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

__all__ = [
    "PACKED_MESSAGE_BYTES",
    "LEGACY_PACKED_MESSAGE_BYTES",
    "FIELD_OVERHEAD",
    "packed",
    "encode_bytes_field",
    "field_header",
    "encode_batch_message",
    "encode_repeated_bytes_field",
    "decode_single_bytes_field",
    "decode_repeated_bytes_field",
    "iter_repeated_bytes_field",
]


#: Target size of one packed message (a Fetch message of inner ciphertexts, or a Submit batch of envelopes) when
#: the peer accepts it (it says so: ``FetchRequest.max_message_bytes``, ``StatsResponse.max_message_bytes``).
#: 1 MiB rather than 256 KiB: at 100 KiB reports, submit + fetch of 1,000 was faster in each of 9 alternating
#: pairs of bench_shuffler invocations (medians 240-275 against 219-236 MB/s); 512 KiB, 2 MiB and 4 MiB were no
#: better than 1 MiB.
PACKED_MESSAGE_BYTES = 1024 * 1024
#: The packing size of peers that state no message limit (0); every peer accepts it.
LEGACY_PACKED_MESSAGE_BYTES = 256 * 1024
#: Bytes budgeted per packed item for its framing: one tag byte and at most ten varint bytes.
FIELD_OVERHEAD = 11


def packed(items: Iterable[bytes], limit: int) -> Iterator[list[bytes]]:
    """Consecutive groups of ``items`` whose encodings as repeated ``bytes`` fields stay within ``limit`` bytes,
    in order; an item too large for ``limit`` forms a group of its own. Lazy: a generator reading from disk is
    never materialised."""
    group: list[bytes] = []
    size = 0
    for item in items:
        cost = len(item) + FIELD_OVERHEAD
        if group and size + cost > limit:
            yield group
            group, size = [], 0
        group.append(item)
        size += cost
    if group:
        yield group


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_bytes_field(field_number: int, data: bytes | bytearray | memoryview) -> bytes:
    """The protobuf encoding of a message holding only ``bytes`` field ``field_number`` = ``data``.

    Proto3 omits an empty ``bytes`` field that is not in a oneof; the two fields encoded here are oneof members
    or carry non-empty data, so an empty payload still gets its tag (as protobuf does for oneof members).
    """
    if not 1 <= field_number <= 15:
        raise ValueError(f"field_number must be in [1, 15] (one-byte tag), got {field_number}")
    view = memoryview(data)  # any contiguous buffer (bytes, bytearray, a numpy uint8 array); nbytes, not len
    if not view.c_contiguous:
        raise ValueError("data must be a C-contiguous buffer")
    return b"".join((bytes([(field_number << 3) | 2]), _varint(view.nbytes), view))


def field_header(field_number: int, length: int) -> bytes:
    """The tag and varint length that precede a ``bytes`` field ``field_number`` of ``length`` bytes."""
    if not 1 <= field_number <= 15:
        raise ValueError(f"field_number must be in [1, 15] (one-byte tag), got {field_number}")
    return bytes([(field_number << 3) | 2]) + _varint(length)


def encode_batch_message(outer_field: int, inner_field: int, items: list[bytes | memoryview]) -> bytes:
    """``encode_bytes_field(outer_field, encode_repeated_bytes_field(inner_field, items))`` with one copy of the
    items instead of three (== ``SubmitRequest(batch=EnvelopeBatch(envelopes=items)).SerializeToString()`` for
    fields 4 and 1)."""
    parts: list[bytes | memoryview] = [b"", b""]
    total = 0
    for item in items:
        view = memoryview(item)
        if not view.c_contiguous:
            raise ValueError("items must be C-contiguous buffers")
        head = field_header(inner_field, view.nbytes)
        parts += (head, view)
        total += len(head) + view.nbytes
    parts[0] = bytes([(outer_field << 3) | 2])
    parts[1] = _varint(total)
    return b"".join(parts)


def _field_at(raw: bytes | memoryview, pos: int, tag: int) -> tuple[int, int] | None:
    """(start, end) of the payload of the length-delimited field with one-byte ``tag`` at ``pos``, or None."""
    if pos + 2 > len(raw) or raw[pos] != tag:
        return None
    length = 0
    shift = 0
    i = pos + 1
    while True:
        if i >= len(raw) or i - pos > 10:
            return None
        b = raw[i]
        i += 1
        length |= (b & 0x7F) << shift
        if not b & 0x80:
            break
        shift += 7
    if i + length > len(raw):
        return None
    return i, i + length


def decode_single_bytes_field(raw: bytes | memoryview, field_number: int) -> bytes | memoryview | None:
    """``data`` if ``raw`` is exactly one ``bytes`` field ``field_number``, else ``None`` (use the full parser).

    The result is a slice of ``raw``: a copy for ``bytes``, a zero-copy view for a ``memoryview``.
    """
    span = _field_at(raw, 0, (field_number << 3) | 2)
    if span is None or span[1] != len(raw):
        return None
    return raw[span[0] :]


def _spans(raw: bytes | memoryview, field_number: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each value of ``raw`` read as repeated ``bytes`` field ``field_number``, in order; raises
    ``ValueError`` at the first part that is not such a field (one walk shared by the functions below)."""
    tag = (field_number << 3) | 2
    pos = 0
    while pos < len(raw):
        span = _field_at(raw, pos, tag)
        if span is None:
            raise ValueError(f"not a canonical repeated bytes field {field_number} at offset {pos}")
        yield span
        pos = span[1]


def iter_repeated_bytes_field(raw: bytes | memoryview, field_number: int) -> Iterator[bytes | memoryview]:
    """The values of ``raw``, in order, one at a time: a slice each (a copy for ``bytes``, a zero-copy view for a
    ``memoryview``). Raises ``ValueError`` at the first part that is not a ``bytes`` field ``field_number``
    (lazily: the values before that part have been yielded by then)."""
    for start, end in _spans(raw, field_number):
        yield raw[start:end]


def decode_repeated_bytes_field(raw: bytes | memoryview, field_number: int) -> list[bytes | memoryview] | None:
    """The values if ``raw`` is one or more ``bytes`` fields ``field_number`` and nothing else, else ``None``.

    Each value is a slice of ``raw`` (a copy for ``bytes``, a zero-copy view for a ``memoryview``).
    """
    try:
        return list(iter_repeated_bytes_field(raw, field_number)) or None
    except ValueError:
        return None


def encode_repeated_bytes_field(field_number: int, items: list[bytes | memoryview]) -> bytes:
    """The encoding of ``items`` as repeated ``bytes`` field ``field_number`` (== a repeated field's
    ``SerializeToString()``)."""
    return b"".join(encode_bytes_field(field_number, x) for x in items)
