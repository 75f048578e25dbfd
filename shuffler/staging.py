"""Staging of a batch's slots and the output write at seal (:mod:`shuffledp.shuffler.builder`,
:mod:`shuffledp.shuffler.core`): the staging path chosen from public sizes only, prefaulting a fresh memory buffer,
complete ``pwrite``s, and the front-to-back (``O_DIRECT`` where allowed) write of the permuted output.
"""

from __future__ import annotations

import errno
import mmap
import os
from array import array
from collections.abc import Callable
from pathlib import Path

import numpy as np

from shuffledp.shuffler.batch import JOURNAL_HEADROOM_BYTES, JOURNAL_HEADROOM_PER_REPORT, Refused

__all__ = ["stages_in_memory", "prefault", "round_up", "pwrite_all", "write_out", "reserve_file", "close_mapping",
           "map_staging_buffer", "draw_permutation", "ZERO_CHUNK", "DIRECT_ALIGN"]

ZERO_CHUNK = 1 << 20
#: Bytes per write() when the in-memory batch is written out at seal time.
_WRITE_CHUNK = 64 << 20
#: Alignment of O_DIRECT writes (offset, length, memory): the memory buffer is rounded up to a multiple of it.
DIRECT_ALIGN = 4096

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (asm-generic/mman-common.h); Python 3.11's mmap does not name it


def prefault(buf: mmap.mmap) -> None:
    """Fault in every page of a fresh staging buffer before any report is written to it.

    A report is copied to the slot the secret permutation gives it. In a fresh mapping the first write to a page
    pays a page fault (zeroing it; on this VM about 2 ms per MB), so without this the time to accept a report
    would say whether its slot shares a page with an earlier report's, which a submitter can watch through flow
    control. Faulting the whole buffer in here costs the same faults, at a time that depends on the batch size
    only. A retained buffer was faulted in when it was made. ``MADV_POPULATE_WRITE`` where the kernel has it,
    else a sequential zero write."""
    try:
        buf.madvise(getattr(mmap, "MADV_POPULATE_WRITE", _MADV_POPULATE_WRITE))
        return
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # ENOMEM and the like: memory is short, refuse (no zero write to OOM)
            raise
    # a kernel without MADV_POPULATE_WRITE (EINVAL): write zeros
    zeros = bytes(min(ZERO_CHUNK, len(buf)))
    with memoryview(buf) as mv:
        for off in range(0, len(mv), len(zeros)):
            end = min(off + len(zeros), len(mv))
            mv[off:end] = zeros[: end - off]


def round_up(size: int) -> int:
    """``size`` rounded up to a multiple of the ``O_DIRECT`` alignment (returns bytes)."""
    return -(-size // DIRECT_ALIGN) * DIRECT_ALIGN


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset``: a short write is continued, never ignored; no progress is EIO."""
    with memoryview(data) as view:
        done = 0
        while done < len(view):
            wrote = os.pwrite(fd, view[done : done + _WRITE_CHUNK], offset + done)
            if wrote <= 0:
                raise OSError(errno.EIO, "write made no progress")
            done += wrote


def write_out(fd: int, path: Path, mv: memoryview, total: int) -> None:
    """Write ``mv[:total]`` to the start of the (reserved, still empty) output file, front to back.

    Uses ``O_DIRECT`` where the filesystem supports it: the batch goes from the buffer to the device without a
    second copy in the page cache (and without allocating one: on a VM that is most of the cost of a buffered
    write). The write is rounded up to the alignment; the rounding tail is zeroed first (it would otherwise
    hold stale slot bytes) and cut off by the caller's ``ftruncate``. Where ``O_DIRECT`` is refused (tmpfs,
    some network filesystems: EINVAL) the same bytes are written through the page cache. Durability comes from
    the caller's ``fsync`` on ``fd`` in both cases.
    """
    aligned = round_up(total)
    direct_fd = -1
    if hasattr(os, "O_DIRECT") and aligned <= len(mv):
        try:
            direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        except OSError:
            direct_fd = -1
    pos = 0
    if direct_fd >= 0:
        try:
            mv[total:aligned] = bytes(aligned - total)
            while pos < aligned:
                try:
                    written = os.pwrite(direct_fd, mv[pos : min(aligned, pos + _WRITE_CHUNK)], pos)
                except OSError as exc:
                    if exc.errno != errno.EINVAL or pos:
                        raise
                    break  # the filesystem rejects direct writes: write through the page cache instead
                if written <= 0 or (written % DIRECT_ALIGN and pos + written < aligned):
                    raise OSError(errno.EIO, "direct output write made no progress or was misaligned")
                pos += written
        finally:
            os.close(direct_fd)
        if pos >= aligned:
            return
    if pos < total:
        pwrite_all(fd, mv[pos:total], pos)



def stages_in_memory(expected_count: int, inner_length: int, staging_memory_limit: int) -> bool:
    """The staging path of a batch, a function of public sizes only: memory iff ``expected_count *
    inner_length <= staging_memory_limit`` (``inner_length = envelope_length - 166`` when the header announces
    ``envelope_length``, else the length of the first envelope that passes the length checks, minus 166). Never
    depends on load: a batch that cannot get its memory is refused (``staging_memory``), it does not fall back
    to disk."""
    return expected_count * inner_length <= staging_memory_limit


def reserve_file(fd: int, directory: Path, count: int, inner_length: int, *, zero_fill: bool) -> None:
    """Check free space and reserve a batch's whole file (the staging file, or on the memory path the output
    file) with ``posix_fallocate``; with ``zero_fill`` (the disk path) also write zeros over it, in offset order.
    Called once per batch, before the first report is written, under the core's allocation lock (the check and
    the reservation are atomic with respect to other batches).

    The free-space check keeps a reserve for the journal, so that concurrent batches cannot fill the disk and
    make a commit record fail. Zero-filling in offset order dirties every page of the file before any report
    arrives, so whenever the kernel writes pages back (at the commit's fsync, or earlier under memory pressure or
    the dirty-page expiry) it writes all of them, in (cyclic) offset order: the filesystem converts
    ``posix_fallocate``'s unwritten extents in that order, not in arrival order, and reports later only overwrite
    blocks already laid out. Without the zero-fill, an early writeback would convert just the slots filled so far
    and the layout could record part of the permutation. The zeros are not synced: nothing needs them on disk (a
    staging file is discarded after a crash), and a sync here would write the whole batch to disk twice. The
    memory path writes nothing before seal (the output is then written once, in output order), so it only
    reserves the space.

    Raises :class:`~shuffledp.shuffler.batch.Refused` (``disk_full``): not enough free space with the journal
    reserve, or the reservation or the zero-fill failed.
    """
    size = count * inner_length
    need = size + JOURNAL_HEADROOM_BYTES + JOURNAL_HEADROOM_PER_REPORT * count
    st = os.statvfs(directory)
    if st.f_bavail * st.f_frsize < need:
        raise Refused(
            "resource_exhausted",
            "disk_full",
            f"a batch of {count} reports needs {need} bytes with the journal reserve; not enough is free",
        )  # the host's free space is not the submitter's business
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise Refused(
            "resource_exhausted", "disk_full", f"cannot allocate {size} bytes for a batch of {count} reports: "
            f"{exc.strerror}",
        ) from None
    if not zero_fill:
        return
    zeros = memoryview(bytes(min(ZERO_CHUNK, size)))
    try:
        for pos in range(0, size, ZERO_CHUNK):
            pwrite_all(fd, zeros[: min(len(zeros), size - pos)], pos)
    except OSError as exc:
        raise Refused("resource_exhausted", "disk_full", f"cannot write the staging file: {exc.strerror}") from None


def close_mapping(buf: mmap.mmap) -> None:
    """Unmap a staging buffer now, or, while a view of it is still alive (a report decrypted into its slot and
    held by a signature check that an abort could not cancel), as soon as the last view is gone: the mapping is
    then freed by the garbage collector, never reused."""
    try:
        buf.close()
    except BufferError:
        pass


def map_staging_buffer(take_buffer: Callable[[int], mmap.mmap | None], size: int, count: int) -> mmap.mmap:
    """The memory path's slot buffer for a batch of ``count`` reports of ``size`` bytes in all: the slots (slot
    ``i`` of ``L`` bytes at ``i * L``) from its first byte, page-aligned like every mapping, so the output, which
    starts there, is written with O_DIRECT from an aligned address; rounded up to ``DIRECT_ALIGN``. The
    retained buffer of an earlier batch if ``take_buffer`` (:meth:`shuffledp.shuffler.core.ShufflerCore.take_buffer`)
    gives one large enough, else a fresh anonymous, private mapping (never backed by a file), advised
    ``MADV_DONTDUMP`` (reports and their slot layout stay out of core dumps) and ``MADV_HUGEPAGE`` (512x fewer page
    faults), and faulted in whole (:func:`prefault`) before any report is written.

    Raises :class:`~shuffledp.shuffler.batch.Refused` (``staging_memory``) if it cannot be mapped or faulted in.
    """
    try:
        retained = take_buffer(round_up(size))
        buf = retained or mmap.mmap(-1, round_up(size), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, MemoryError, OverflowError) as exc:
        raise Refused(
            "resource_exhausted", "staging_memory", f"cannot allocate {size} bytes of staging memory for a batch "
            f"of {count} reports ({type(exc).__name__}); retry later",
        ) from None
    for advice in ("MADV_DONTDUMP", "MADV_HUGEPAGE"):  # best effort: both are advice only
        if hasattr(mmap, advice):
            try:
                buf.madvise(getattr(mmap, advice))
            except OSError:
                pass
    if retained is None:
        try:
            prefault(buf)
        except (OSError, MemoryError) as exc:
            close_mapping(buf)
            raise Refused(
                "resource_exhausted", "staging_memory", f"cannot fault in {size} bytes of staging memory for a "
                f"batch of {count} reports ({type(exc).__name__}); retry later",
            ) from None
    return buf


def draw_permutation(n: int) -> array:
    """A uniformly random permutation of ``range(n)`` as ``array('I')``, from the CSPRNG.

    The order of ``n`` independent uniform 64-bit keys from ``os.urandom``: given that no two keys are equal, every
    order is equally likely, and a draw with a tie (probability below ``n**2 / 2**65``) is discarded and drawn
    again, so the result is exactly uniform. ``numpy`` only sorts the keys here (none of its generators). About
    0.1 s for 1,000,000 slots, where a Fisher-Yates shuffle with one ``secrets.randbelow`` per slot took seconds.
    """
    if n <= 1:
        return array("I", range(n))
    while True:
        keys = np.frombuffer(os.urandom(8 * n), dtype=np.uint64)
        order = np.argsort(keys, kind="stable")
        ranked = keys[order]
        if not np.any(ranked[1:] == ranked[:-1]):
            break
    perm = array("I")
    perm.frombytes(order.astype(np.uint32).tobytes())
    return perm
