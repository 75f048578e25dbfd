"""Heap tuning for a process that streams megabyte-sized gRPC messages (glibc's malloc only).

glibc serves an allocation above ``M_MMAP_THRESHOLD`` (128 KiB at start, raised dynamically at most to the size
of the largest freed mapping) with a fresh ``mmap`` and returns it with ``munmap`` when freed, and it trims the
top of the heap when more than ``M_TRIM_THRESHOLD`` of it is free. A Submit or Fetch stream allocates and frees
a message buffer, a ``bytes`` object and a decrypted plaintext of up to a few MiB per report, so by default
almost every one of them is a fresh mapping whose pages are faulted in (zeroed by the kernel) and then thrown
away. That costs far more than the copy itself: on this project's VM, where memory the host has reclaimed
is slow to touch again, ``bytes(bytearray(x))`` of 1 MiB took 0.83-0.89 ms per call with the defaults and
0.04-0.05 ms after :func:`tune_heap`; see docs/shuffler.md for what it does to the shuffler benchmark.

:func:`tune_heap` fixes both thresholds with ``mallopt`` (glibc manual, "Memory Allocation Tunables";
``mallopt(3)``): allocations up to ``mmap_threshold`` come from the heap and are reused after ``free``, and the
process keeps up to ``trim_threshold`` bytes of free heap instead of returning it at once. The cost is that
much idle memory at most (plus fragmentation), so it is an option of the shuffler service (``heap_tuning``)
and of the ServerApp's shuffler connection, on by default and reported in their logs. Setting either
threshold turns glibc's dynamic threshold off, which is why both are set together. On a C library other than
glibc nothing is changed and :class:`HeapTuning` says why.

This module touches no report data and no randomness; it only changes where the allocator gets memory from.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["HeapTuning", "tune_heap", "MMAP_THRESHOLD_MAX", "DEFAULT_TRIM_THRESHOLD"]

log = logging.getLogger(__name__)

#: glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2, which is 32 MiB on 64-bit builds (mallopt(3)).
MMAP_THRESHOLD_MAX = 32 * 1024**2
#: free heap kept for reuse before glibc trims it; the most memory this tuning can leave idle (before
#: fragmentation)
DEFAULT_TRIM_THRESHOLD = 256 * 1024**2
_MIN_THRESHOLD = 1024**2
# mallopt parameter numbers from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_lock = threading.Lock()
_applied: "HeapTuning | None" = None


@dataclass(frozen=True)
class HeapTuning:
    """What :func:`tune_heap` did. ``applied`` is False with a ``reason`` when nothing was changed."""

    applied: bool
    mmap_threshold: int
    trim_threshold: int
    reason: str = ""

    def describe(self) -> str:
        """One line for a log."""
        if not self.applied:
            return f"heap tuning not applied: {self.reason}"
        return (f"heap tuning: glibc mmap threshold {self.mmap_threshold // 1024**2} MiB, "
                f"trim threshold {self.trim_threshold // 1024**2} MiB")


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``int mallopt(int param, int value)``, or None if the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    fn = libc.mallopt
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def tune_heap(max_message_bytes: int, *, trim_threshold: int = DEFAULT_TRIM_THRESHOLD) -> HeapTuning:
    """Make glibc reuse heap memory for message-sized allocations (process-wide, see the module docstring).

    ``max_message_bytes`` is the largest gRPC message the process expects (at least 1); the mmap threshold is
    set just above it, at least 1 MiB and at most :data:`MMAP_THRESHOLD_MAX` (larger allocations stay
    mmapped). ``trim_threshold`` (bytes, at least the mmap threshold) bounds the free heap kept for reuse.
    Idempotent per process: a second call returns the first call's result unchanged, because thresholds that
    shrink under running code would only reintroduce the page faults. Raises ``ValueError`` on bad arguments;
    a refusal by the C library is returned as ``applied=False`` with the reason, never raised.
    """
    global _applied
    if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) or max_message_bytes < 1:
        raise ValueError(f"max_message_bytes must be a positive int, got {max_message_bytes!r}")
    mmap_threshold = min(MMAP_THRESHOLD_MAX, max(_MIN_THRESHOLD, max_message_bytes + 64 * 1024))
    if isinstance(trim_threshold, bool) or not isinstance(trim_threshold, int) or trim_threshold < mmap_threshold:
        raise ValueError(
            f"trim_threshold must be an int >= the mmap threshold ({mmap_threshold} bytes), got {trim_threshold!r}"
        )
    with _lock:
        if _applied is not None:
            return _applied
        mallopt = _mallopt()
        if mallopt is None:
            result = HeapTuning(False, 0, 0, "the C library is not glibc (no mallopt); allocator left as it is")
        else:
            ok_mmap = mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
            ok_trim = ok_mmap and mallopt(_M_TRIM_THRESHOLD, trim_threshold) == 1
            if ok_mmap and ok_trim:
                result = HeapTuning(True, mmap_threshold, trim_threshold)
            elif not ok_mmap:
                result = HeapTuning(False, 0, 0, f"glibc refused mallopt(M_MMAP_THRESHOLD, {mmap_threshold})")
            else:
                result = HeapTuning(False, mmap_threshold, 0, f"glibc refused mallopt(M_TRIM_THRESHOLD, "
                                    f"{trim_threshold}); only the mmap threshold is set")
        _applied = result
    log.info("%s", result.describe())
    return result
