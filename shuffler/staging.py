"""Staging of a batch's slots and the output write at seal (:mod:`shuffledp.shuffler.builder`,
:mod:`shuffledp.shuffler.core`): the staging path chosen from public sizes only, prefaulting a fresh memory buffer,
complete ``pwrite``s, and the front-to-back (``O_DIRECT`` where allowed) write of the permuted output.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

__all__ = ["stages_in_memory", "prefault", "round_up", "pwrite_all", "write_out", "ZERO_CHUNK", "DIRECT_ALIGN"]

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
