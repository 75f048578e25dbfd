"""Reading a sealed output for Fetch (:meth:`shuffledp.shuffler.core.ShufflerCore.read_batch_messages`).

A Fetch message is ``FetchResponse{inner: [...]}``: consecutive inner ciphertexts of the sealed order, each
encoded as a ``bytes`` field (tag, varint length, item). All items of a batch have one length, so every field
header is the same and a message is built with one ``b"".join`` of that header and views of the items where
they lie (the read buffer, or the retained staging buffer that still holds the output): each byte of the batch
is copied once on its way to gRPC, and no Python object is made per item.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from shuffledp.shuffler import wire

__all__ = ["read_output", "read_messages", "messages_from_view", "items_per_message"]

#: Bytes per ``O_DIRECT`` read when a sealed output is fetched (two page-aligned buffers per fetch).
_READ_CHUNK = 8 << 20
#: Read buffers kept for the next fetch (private anonymous mappings, already faulted in): a fresh mapping costs
#: its page faults (zeroing) at every fetch. At most this many, so idle memory stays at 4 x _READ_CHUNK.
_SPARE_READ_BUFFERS = 4
_spare_read_buffers: list[mmap.mmap] = []
_spare_lock = threading.Lock()


def _take_read_buffer() -> mmap.mmap:
    """A page-aligned read buffer of ``_READ_CHUNK`` bytes: a kept one if there is one, else a fresh private
    anonymous mapping (not ``mmap``'s default shared one, which lives in shmem and is zeroed on every fault)."""
    with _spare_lock:
        while _spare_read_buffers:
            buf = _spare_read_buffers.pop()
            if len(buf) == _READ_CHUNK and not buf.closed:
                return buf
            _close_quietly(buf)
    return mmap.mmap(-1, _READ_CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _give_back_read_buffer(buf: mmap.mmap) -> None:
    """Keep a read buffer for the next fetch, or unmap it if enough are kept."""
    with _spare_lock:
        if len(_spare_read_buffers) < _SPARE_READ_BUFFERS and len(buf) == _READ_CHUNK and not buf.closed:
            _spare_read_buffers.append(buf)
            return
    _close_quietly(buf)


def _close_quietly(buf: mmap.mmap) -> None:
    """Unmap ``buf`` unless a view of it is still alive (then the garbage collector unmaps it later)."""
    try:
        buf.close()
    except BufferError:
        pass


def items_per_message(inner_length: int, packing: int) -> int:
    """How many items of ``inner_length`` bytes one Fetch message holds when packed up to ``packing`` bytes:
    as many as ``wire.packed`` groups (each item budgeted with ``wire.FIELD_OVERHEAD``), at least one."""
    return max(1, packing // (inner_length + wire.FIELD_OVERHEAD))


def _messages(chunks: Iterable[tuple[memoryview, Callable[[], None]]], n: int, inner_length: int,
              per: int) -> Iterator[bytes]:
    """Fetch messages of ``per`` items (the last may hold fewer) from ``chunks``, consecutive views of the output
    in order, each with a callback that hands its buffer back once nothing refers to it any more. Yields
    serialised ``FetchResponse`` messages; raises RuntimeError if the chunks end before ``n`` items."""
    head = wire.field_header(1, inner_length)
    parts: list[bytes | memoryview] = []
    in_message = 0
    produced = 0
    carry = bytearray()  # an item straddling two chunks
    for view, release in chunks:
        got = len(view)
        i = 0
        if carry:
            i = min(inner_length - len(carry), got)
            carry += view[:i]
            if len(carry) == inner_length:
                parts += (head, bytes(carry))
                carry.clear()
                produced += 1
                in_message += 1
        while produced < n and i + inner_length <= got:
            if in_message == per:
                yield b"".join(parts)
                parts.clear()
                in_message = 0
            parts += (head, view[i : i + inner_length])
            i += inner_length
            produced += 1
            in_message += 1
        if produced < n and i < got:
            carry += view[i:got]
        if in_message == per or produced == n:
            if parts:
                yield b"".join(parts)
            parts.clear()
            in_message = 0
        elif parts:
            parts[:] = [b"".join(parts)]  # detach the partial message from the buffer before it is reused
        del view
        release()
        if produced == n:
            return
    raise RuntimeError("sealed batch output is truncated")


def messages_from_view(view: memoryview, n: int, inner_length: int, packing: int) -> Iterator[bytes]:
    """The Fetch messages of an output held in memory (``view`` holds at least ``n * inner_length`` bytes)."""
    if n == 0:
        return iter(())
    return _messages([(view[: n * inner_length], _nothing)], n, inner_length, items_per_message(inner_length, packing))


def _nothing() -> None:
    return None


def read_messages(path: Path, n: int, inner_length: int, packing: int) -> Iterator[bytes]:
    """The Fetch messages of a sealed output file: ``n`` items of ``inner_length`` bytes, packed up to ``packing``
    bytes per message (an item larger than that travels alone).

    Read with ``O_DIRECT`` where the filesystem allows it: the output (written with ``O_DIRECT`` on the memory
    path, so not cached) then does not have to be brought into fresh page-cache pages first, which on a VM is
    most of the cost of a buffered read. A reader thread fills two page-aligned buffers in turn
    (:class:`_DirectReader`), so the device read of the next chunk overlaps the sending of this one. Where
    ``O_DIRECT`` is refused (EINVAL on open or on the first read: tmpfs, some network filesystems) the file is
    read through the page cache. Raises RuntimeError if the file is shorter than ``n * inner_length``.
    """
    if n == 0:
        return
    per = items_per_message(inner_length, packing)
    fd = -1
    if hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    if fd < 0:
        yield from _messages(_buffered_chunks(path), n, inner_length, per)
        return
    try:
        reader = _DirectReader(fd, n * inner_length)
    except BaseException:
        os.close(fd)
        raise
    try:
        chunks = ((memoryview(buf)[:got], lambda b=buf: reader.done_with(b)) for buf, got in reader)
        try:
            yield from _messages(chunks, n, inner_length, per)
        except RuntimeError:
            if not reader.refused:
                raise
    finally:
        reader.close()
        os.close(fd)
    if reader.refused:  # O_DIRECT reads refused at the first read: nothing was yielded
        yield from _messages(_buffered_chunks(path), n, inner_length, per)


def _buffered_chunks(path: Path) -> Iterator[tuple[memoryview, Callable[[], None]]]:
    """The file in chunks of ``_READ_CHUNK`` bytes, through the page cache (one reused buffer)."""
    buf = bytearray(_READ_CHUNK)
    with open(path, "rb", buffering=0) as fh, memoryview(buf) as whole:
        while True:
            got = fh.readinto(whole)
            if not got:
                return
            yield whole[:got], _nothing


def read_output(path: Path, n: int, inner_length: int) -> Iterator[bytes]:
    """The ``n`` items of ``inner_length`` bytes in a sealed output file, in order (:func:`read_messages`, one item
    at a time). Raises RuntimeError if the file is shorter than ``n * inner_length``."""
    for message in read_messages(path, n, inner_length, 1):
        yield from wire.iter_repeated_bytes_field(message, 1)


class _DirectReader:
    """Reads ``total`` bytes of ``fd`` (opened with ``O_DIRECT``) in page-aligned chunks of ``_READ_CHUNK``,
    on its own thread, into two buffers used in turn. Iterating yields ``(buffer, bytes_read)``; the consumer
    hands each buffer back with :meth:`done_with` before the reader may refill it. If the very first read fails
    with EINVAL (direct reads refused), the iteration ends at once with ``refused`` set; any other error is
    raised to the consumer; a read of 0 bytes before ``total`` ends the iteration (the caller reports the
    truncation)."""

    _DATA, _END, _REFUSED, _ERROR = range(4)

    def __init__(self, fd: int, total: int) -> None:
        self._fd = fd
        self._total = total
        self._free: queue.SimpleQueue[mmap.mmap | None] = queue.SimpleQueue()
        self._full: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self._bufs: list[mmap.mmap] = []
        self.refused = False
        try:
            for _ in range(2):
                self._bufs.append(_take_read_buffer())
                self._free.put(self._bufs[-1])
            self._thread = threading.Thread(target=self._run, name="shuffler-fetch-read", daemon=True)
            self._thread.start()
        except BaseException:
            for b in self._bufs:
                _give_back_read_buffer(b)
            raise

    def _run(self) -> None:
        pos = 0
        try:
            while pos < self._total:
                buf = self._free.get()
                if buf is None:  # closed by the consumer
                    return
                try:
                    got = os.preadv(self._fd, [buf], pos)
                except OSError as exc:
                    refused = exc.errno == errno.EINVAL and pos == 0
                    self._full.put((self._REFUSED, None) if refused else (self._ERROR, exc))
                    return
                if got <= 0:
                    break
                self._full.put((self._DATA, (buf, got)))
                pos += got
        except BaseException as exc:  # never leave the consumer waiting
            self._full.put((self._ERROR, exc))
            return
        self._full.put((self._END, None))

    def __iter__(self) -> Iterator[tuple[mmap.mmap, int]]:
        while True:
            kind, value = self._full.get()
            if kind == self._DATA:
                yield value
            elif kind == self._ERROR:
                raise value
            else:
                self.refused = kind == self._REFUSED
                return

    def done_with(self, buf: mmap.mmap) -> None:
        self._free.put(buf)

    def close(self) -> None:
        self._free.put(None)
        self._free.put(None)
        self._thread.join()
        for b in self._bufs:
            _give_back_read_buffer(b)
