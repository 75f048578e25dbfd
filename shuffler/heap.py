"""Heap tuning for a process that streams megabyte-sized gRPC messages (glibc's malloc only).

glibc serves an allocation above ``M_MMAP_THRESHOLD`` (128 KiB at start) with a fresh ``mmap``; when such a
mapping is freed, the threshold rises to its size (at most 32 MiB) and the trim threshold to twice that, so
later allocations of that size come from the heap. The heap's top is then trimmed (``brk`` shrinks) whenever
more than ``M_TRIM_THRESHOLD`` of it is free, and grows again at the next allocation. A Submit or Fetch stream
allocates and frees a message buffer, a ``bytes`` object and a decrypted plaintext of up to a few MiB per
report, so with the defaults the heap's top churns: it shrinks after a report and grows back for the next,
and every page that comes back is faulted in and zeroed by the kernel again. That costs far more than the
copy itself: on this project's VM, where memory the host has reclaimed is slow to touch again,
``bytes(bytearray(x))`` of 1 MiB took 0.83-0.89 ms per call with the defaults and 0.04-0.05 ms after
:func:`tune_heap` (a loop of 200 such calls: about 96,000 minor page faults, against none).

:func:`tune_heap` fixes both thresholds with ``mallopt`` (``mallopt(3)``; glibc manual, "Malloc Tunable
Parameters"): allocations up to ``mmap_threshold`` come from a heap, and the main arena keeps up to
``trim_threshold`` bytes of free heap instead of returning it at once. Setting either threshold turns glibc's
dynamic adjustment off, which is why both are set together. The cost is idle memory: up to
``trim_threshold`` in the main arena, and in each further thread arena (glibc makes up to 8 per core) up to
the 64 MiB heap it lives in, plus fragmentation. So it is an option of the shuffler service (``heap_tuning``)
and of the ServerApp's shuffler connection (run config ``heap-tuning``), on by default and reported (the
shuffler's log; a progress line of the ServerApp). ``mallopt`` is documented MT-unsafe (it updates
process-wide parameters without every arena's lock); the only effect of a concurrent allocation is that it may
still see the old thresholds, so calling it after gRPC's threads exist is harmless. If the operator already set
glibc's malloc parameters through the environment (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
``GLIBC_TUNABLES``), or the C library is not glibc, nothing is changed and :class:`HeapTuning` says why.

This module touches no report data and no randomness; it only changes where the allocator gets memory from.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from shuffledp.shuffler.validation import is_int

__all__ = ["HeapTuning", "tune_heap", "MMAP_THRESHOLD_MAX", "DEFAULT_TRIM_THRESHOLD"]

log = logging.getLogger(__name__)

#: Largest mmap threshold set: glibc's own ceiling for its dynamic threshold on 64-bit builds
#: (DEFAULT_MMAP_THRESHOLD_MAX), half the 64 MiB heap of a thread arena. Larger allocations stay mmapped.
MMAP_THRESHOLD_MAX = 32 * 1024**2
#: mallopt takes a C int
_MAX_THRESHOLD = 2**31 - 1
#: environment variables through which an operator sets glibc's malloc parameters; they take precedence
_OPERATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
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
        return (f"heap tuning: glibc mmap threshold {self.mmap_threshold / 1024**2:.2f} MiB, "
                f"trim threshold {self.trim_threshold / 1024**2:.2f} MiB")


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``int mallopt(int param, int value)``, or None if the C library is not glibc."""
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
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
    Nothing is changed if the environment already sets glibc's malloc parameters (see the module docstring).
    Idempotent per process: a second call returns the first call's result unchanged, because thresholds that
    shrink under running code would only reintroduce the page faults. Raises ``ValueError`` on bad arguments;
    a refusal by the C library is returned as ``applied=False`` with the reason, never raised.
    """
    global _applied
    if not is_int(max_message_bytes) or max_message_bytes < 1:
        raise ValueError(f"max_message_bytes must be a positive int, got {max_message_bytes!r}")
    mmap_threshold = min(MMAP_THRESHOLD_MAX, max(_MIN_THRESHOLD, max_message_bytes + 64 * 1024))
    if not is_int(trim_threshold) or not mmap_threshold <= trim_threshold <= _MAX_THRESHOLD:
        raise ValueError(
            f"trim_threshold must be an int in [{mmap_threshold}, {_MAX_THRESHOLD}] (at least the mmap threshold, "
            f"at most a C int), got {trim_threshold!r}"
        )
    with _lock:
        if _applied is not None:
            return _applied
        mallopt = _mallopt()
        operator = [name for name in _OPERATOR_ENV if os.environ.get(name)]
        if operator:
            result = HeapTuning(False, 0, 0, f"glibc's malloc parameters are set in the environment "
                                f"({', '.join(operator)}); left as the operator set them")
        elif mallopt is None:
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
