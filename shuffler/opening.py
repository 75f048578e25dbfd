"""Opening the envelopes of one received message (a job of :class:`~shuffledp.shuffler.builder.BatchBuilder`)
straight into their staging slots, and their signature checks.

On the memory path with an announced ``envelope_length`` each envelope claims its slot when it arrives; its outer
layer is then decrypted into that slot and its inner ciphertext hashed there
(:meth:`shuffledp.shuffler.envelope.OuterOpener.decrypt_into`), with no plaintext object and no second copy. A
small job is opened on the submitting thread (:func:`open_here`); a large one on a worker of the core's verify pool
(:func:`open_job`), several at once, each through its worker's scratch buffer. The signature checks
(:func:`verify_job`) get the hash and a copy of the outer plaintext's head, never a view of the buffer's bytes.
Every envelope costs the same whatever its slot. Each function returns, per entry and in order, the verified
report or the reason it was dropped (a string, not the exception, whose traceback would keep the frame and the
job's plaintexts alive until the cyclic garbage collector runs); anything other than an
:class:`~shuffledp.shuffler.envelope.EnvelopeError` is a bug and propagates.
"""

from __future__ import annotations

import dataclasses
import mmap
import threading
from typing import Any

import numpy as np

from shuffledp.shuffler import envelope as env
from shuffledp.shuffler.envelope import OUTER_HEAD_BYTES
from shuffledp.shuffler.staging import SLOT_BASE

__all__ = ["decrypt_into_slot", "open_into_slot", "open_here", "open_job", "verify_job"]

#: A job's entries: ``(envelope, slot)`` pairs to open into their slots
Pairs = list[tuple[bytes | memoryview, int]]


def decrypt_into_slot(opener: env.OuterOpener, buf: mmap.mmap, slot: int, inner_length: int,
                      envelope: bytes | memoryview) -> env.DecryptedReport:
    """Open ``envelope`` straight into ``slot`` of the memory-path buffer ``buf`` and hash its inner ciphertext
    there (:meth:`shuffledp.shuffler.envelope.OuterOpener.decrypt_into`; returns its report). The outer plaintext's
    head goes to the ``OUTER_HEAD_BYTES`` bytes just before the slot (the end of the slot before it, or the
    ``SLOT_BASE`` bytes before slot 0, :func:`shuffledp.shuffler.staging.map_staging_buffer`), which are copied
    first and put back whatever happens, so every slot costs the same and only the slot changes: nothing else may
    read or write ``buf`` meanwhile. Raises :class:`~shuffledp.shuffler.envelope.EnvelopeError` (the slot then
    holds unauthenticated bytes)."""
    start = SLOT_BASE + slot * inner_length
    head = start - OUTER_HEAD_BYTES
    mv = memoryview(buf)
    kept = bytes(mv[head:start])
    try:
        return opener.decrypt_into(envelope, mv[head : start + inner_length])
    finally:
        mv[head:start] = kept


def open_into_slot(opener: env.OuterOpener, buf: mmap.mmap, slot: int, inner_length: int,
                   envelope: bytes | memoryview) -> env.DecryptedReport:
    """:func:`decrypt_into_slot` for a worker thread, while other threads open envelopes into other slots of the
    same buffer: the outer plaintext goes to this thread's own scratch buffer (where its inner ciphertext is
    hashed) and only the inner ciphertext is copied into the slot, by ``numpy`` (which, unlike a copy by slice
    assignment, releases the GIL), so nothing outside the slot is touched. The same work whatever the slot.
    Returns the report, its ``inner`` a view of the slot. Raises
    :class:`~shuffledp.shuffler.envelope.EnvelopeError` (the slot is then left as it was)."""
    size = OUTER_HEAD_BYTES + inner_length
    scratch = getattr(_scratch, "buffer", None)
    if scratch is None or len(scratch) != size:
        scratch = _scratch.buffer = bytearray(size)  # kept for this thread's next envelope of that length
    decrypted = opener.decrypt_into(envelope, memoryview(scratch))
    start = SLOT_BASE + slot * inner_length
    slots = np.frombuffer(buf, dtype=np.uint8)
    np.copyto(slots[start : start + inner_length], np.frombuffer(scratch, dtype=np.uint8)[OUTER_HEAD_BYTES:])
    del slots  # the report's view below is the only one that outlives this call
    return dataclasses.replace(decrypted, inner=memoryview(buf)[start : start + inner_length])


#: Each worker thread's scratch buffer for :func:`open_into_slot` (one outer plaintext)
_scratch = threading.local()


def verify_job(opener: env.OuterOpener, job: list[Any]) -> list[env.OpenedReport | str]:
    """The signature checks of one job's decrypted reports, in order (an entry that is already a drop reason, from
    :func:`open_here`, is passed on)."""
    results: list[env.OpenedReport | str] = []
    for decrypted in job:
        if isinstance(decrypted, str):
            results.append(decrypted)
            continue
        try:
            results.append(opener.verify(decrypted))
        except env.EnvelopeError as exc:
            results.append(exc.reason)
    return results


def open_here(opener: env.OuterOpener, buf: mmap.mmap, inner_length: int, job: Pairs) -> list[Any]:
    """Open the pairs of ``job`` into their slots of ``buf`` on this thread, nothing else writing to ``buf``
    meanwhile (:func:`decrypt_into_slot`, no copy): each the decrypted report, or the reason it was dropped."""
    out: list[env.DecryptedReport | str] = []
    for envelope, slot in job:
        try:
            out.append(decrypt_into_slot(opener, buf, slot, inner_length, envelope))
        except env.EnvelopeError as exc:
            out.append(exc.reason)
    return out


def open_job(opener: env.OuterOpener, buf: mmap.mmap, inner_length: int, job: Pairs) -> list[env.OpenedReport | str]:
    """:func:`verify_job` of :func:`open_here` on a worker of the verify pool, while other workers open envelopes
    into other slots of ``buf``: each through the worker's scratch buffer (:func:`open_into_slot`)."""
    results: list[env.OpenedReport | str] = []
    for envelope, slot in job:
        try:
            results.append(opener.verify(open_into_slot(opener, buf, slot, inner_length, envelope)))
        except env.EnvelopeError as exc:
            results.append(exc.reason)
    return results
