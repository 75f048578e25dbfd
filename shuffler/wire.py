"""Byte-level protobuf encoding for the two hot messages (one envelope, one inner ciphertext per message).

``SubmitRequest{envelope}`` and ``FetchResponse{inner}`` are each a single length-delimited ``bytes`` field
(protobuf encoding: tag byte ``(field << 3) | 2``, base-128 varint length, payload). Encoding them directly
saves the copies that building and serialising a message object costs for megabyte payloads. The output is
byte-identical to ``SerializeToString()`` (tests check this); decoding falls back to the generated parser for
anything that is not exactly one such field.
"""

from __future__ import annotations

__all__ = ["encode_bytes_field", "decode_single_bytes_field"]


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


def decode_single_bytes_field(raw: bytes | memoryview, field_number: int) -> bytes | memoryview | None:
    """``data`` if ``raw`` is exactly one ``bytes`` field ``field_number``, else ``None`` (use the full parser).

    The result is a slice of ``raw``: a copy for ``bytes``, a zero-copy view for a ``memoryview``.
    """
    if len(raw) < 2 or raw[0] != ((field_number << 3) | 2):
        return None
    length = 0
    shift = 0
    pos = 1
    while True:
        if pos >= len(raw) or pos > 10:
            return None
        b = raw[pos]
        pos += 1
        length |= (b & 0x7F) << shift
        if not b & 0x80:
            break
        shift += 7
    if pos + length != len(raw):
        return None
    return raw[pos:]
