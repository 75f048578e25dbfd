"""Compact exact sets of fixed-width byte strings: the shuffler's replay cache, enrolment and per-batch checks.

A Python ``set`` of 32-byte ``bytes`` costs about 110-130 bytes per member (the object, its hash and the set's
slot at two thirds load), so the six per-report sets a 1,000,000-report batch kept (signers, both replay tags,
inner hashes and encapsulated keys, envelope fingerprints) took about 0.7 GB. :class:`TagSet` keeps its members
back to back in one ``bytearray`` (``width`` bytes each, insertion order) and an open-addressing index of
``uint32`` positions at most half full: ``width + 8`` bytes per member, and no Python object per member.

Membership is exact: a probe compares the stored bytes. The index position comes from Python's ``hash`` of the
member (SipHash with the interpreter's random per-process key) multiplied by a random odd 64-bit factor drawn
here from ``secrets`` (its top bits are the position), so a submitter who chooses report ids or encapsulated keys
cannot aim many of them at one probe chain, even where ``PYTHONHASHSEED`` fixes ``hash``.
"""

from __future__ import annotations

import secrets
from array import array
from collections.abc import Iterable, Iterator

import numpy as np

__all__ = ["TagSet", "sorted_packed"]

_M64 = (1 << 64) - 1
_MIN_BITS = 4


def sorted_packed(data: bytes | bytearray | memoryview, width: int) -> bytes:
    """``data`` (a concatenation of ``width``-byte strings) with its strings in ascending bytewise order, as
    ``b"".join(sorted(...))`` gives them, without a Python object per string."""
    view = memoryview(data)
    if view.nbytes % width:
        raise ValueError(f"{view.nbytes} bytes is not a whole number of {width}-byte strings")
    if not view.nbytes:
        return b""
    rows = np.frombuffer(view, dtype=np.uint8).reshape(-1, width)
    # lexsort's last key is the primary one: byte 0 first, then byte 1, ... (bytewise = lexicographic order)
    order = np.lexsort(rows.T[::-1])
    return rows[order].tobytes()


class TagSet:
    """An exact set of ``width``-byte strings with a compact index (see the module docstring).

    ``capacity`` sizes the index for that many members up front (it grows by doubling beyond). Members are
    ``bytes`` (or read-only ``bytes``-like objects) of exactly ``width`` bytes; :meth:`index` gives each member's
    insertion position, which stays fixed.

    Members are only ever added. One writer at a time; readers on other threads (under the GIL) see each member
    either absent or present: a member's bytes are appended before its index entry is written, and a larger index
    is built aside and swapped in whole (``_table`` holds the index, its mask and its shift as one tuple).
    """

    __slots__ = ("width", "_keys", "_count", "_table", "_mult")

    def __init__(self, width: int, capacity: int = 0) -> None:
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.width = width
        self._keys = bytearray()
        self._count = 0
        self._mult = secrets.randbits(64) | 1
        self._resize(max(_MIN_BITS, (2 * max(capacity, 1) - 1).bit_length()))

    def _resize(self, bits: int) -> None:
        size = 1 << bits
        index = array("I", bytes(4 * size))
        mask, shift, mult = size - 1, 64 - bits, self._mult
        keys, w = self._keys, self.width
        for pos in range(self._count):
            h = ((hash(bytes(keys[pos * w : (pos + 1) * w])) * mult) & _M64) >> shift
            while index[h]:
                h = (h + 1) & mask
            index[h] = pos + 1
        self._table = (index, mask, shift)

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """Bytes held: the members and the index."""
        index = self._table[0]
        return len(self._keys) + index.itemsize * len(index)

    def index(self, key: bytes) -> int:
        """The insertion position of ``key``, or -1 if it is not a member."""
        if len(key) != self.width:
            return -1
        index, mask, shift = self._table
        keys, w = self._keys, self.width
        h = ((hash(key) * self._mult) & _M64) >> shift
        while True:
            slot = index[h]
            if not slot:
                return -1
            o = (slot - 1) * w
            if keys[o : o + w] == key:
                return slot - 1
            h = (h + 1) & mask

    def __contains__(self, key: object) -> bool:
        return isinstance(key, (bytes, bytearray, memoryview)) and self.index(bytes(key)) >= 0

    def add(self, key: bytes) -> bool:
        """Add ``key``; True if it was not a member yet. Raises ValueError if it is not ``width`` bytes."""
        w = self.width
        if len(key) != w:
            raise ValueError(f"a member must be {w} bytes, got {len(key)}")
        index, mask, shift = self._table
        keys = self._keys
        h = ((hash(key) * self._mult) & _M64) >> shift
        while True:  # one probe: find the key, or the empty slot it goes to
            slot = index[h]
            if not slot:
                break
            o = (slot - 1) * w
            if keys[o : o + w] == key:
                return False
            h = (h + 1) & mask
        keys += key
        self._count += 1
        if 2 * self._count > len(index):
            self._resize(len(index).bit_length())  # double; places every member, this one too
        else:
            index[h] = self._count
        return True

    def update(self, keys: Iterable[bytes]) -> None:
        """Add every key of ``keys``."""
        for key in keys:
            self.add(bytes(key))

    def update_packed(self, data: bytes | bytearray | memoryview) -> None:
        """Add the ``width``-byte strings concatenated in ``data`` (as :meth:`packed` or :func:`sorted_packed`
        give them)."""
        view = memoryview(data)
        if view.nbytes % self.width:
            raise ValueError(f"{view.nbytes} bytes is not a whole number of {self.width}-byte members")
        w = self.width
        for o in range(0, view.nbytes, w):
            self.add(bytes(view[o : o + w]))

    def __iter__(self) -> Iterator[bytes]:
        keys, w = self._keys, self.width
        for pos in range(self._count):
            yield bytes(keys[pos * w : (pos + 1) * w])

    def packed(self) -> bytes:
        """The members concatenated in insertion order."""
        return bytes(self._keys)

    def packed_sorted(self) -> bytes:
        """The members concatenated in ascending bytewise order (:func:`sorted_packed`)."""
        return sorted_packed(self._keys, self.width)

    def __repr__(self) -> str:
        return f"TagSet(width={self.width}, members={self._count})"
