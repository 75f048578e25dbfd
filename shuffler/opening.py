"""Opening the envelopes of one received message (a job of :class:`~shuffledp.shuffler.builder.BatchBuilder`)
straight into their staging slots, and their signature checks.

On the memory path with an announced ``envelope_length`` each envelope claims its slot when it arrives; its outer
layer is then decrypted with its inner ciphertext going straight into that slot and hashed there
(:meth:`shuffledp.shuffler.envelope.OuterOpener.decrypt_into`): no plaintext object, no copy, and no byte
written outside the slot, so the same function (:func:`open_job`) serves the submitting thread (a small job) and the
workers of the core's verify pool (a large one, several at once, each into its own slots).
The signature checks get the hash and a copy of the outer plaintext's head, never a view of the buffer's bytes;
:func:`verify_job` makes them for reports opened outside the slots (no announced ``envelope_length``, or the disk
path). Every envelope costs the same whatever its slot. Each function returns, per entry and in
order, the verified report or the reason it was dropped (a string, not the exception, whose traceback would keep
the frame and the job's plaintexts alive until the cyclic garbage collector runs); anything other than an
:class:`~shuffledp.shuffler.envelope.EnvelopeError` is a bug and propagates.
"""

from __future__ import annotations

import mmap

from shuffledp.shuffler import envelope as env

__all__ = ["open_into_slot", "open_job", "verify_job"]

#: A job's entries: ``(envelope, slot)`` pairs to open into their slots
Pairs = list[tuple[bytes | memoryview, int]]


def open_into_slot(opener: env.OuterOpener, buf: mmap.mmap, slot: int, inner_length: int,
                   envelope: bytes | memoryview) -> env.DecryptedReport:
    """Open ``envelope`` with its inner ciphertext going straight into ``slot`` of the memory-path buffer ``buf``
    (slot ``i`` of ``inner_length`` bytes at ``i * inner_length``,
    :func:`shuffledp.shuffler.staging.map_staging_buffer`), hashed there; nothing outside the slot is written, so
    other threads may open envelopes into other slots meanwhile. Returns the report, its ``inner`` a view of the
    slot. Raises :class:`~shuffledp.shuffler.envelope.EnvelopeError` (the slot then holds unauthenticated bytes)."""
    start = slot * inner_length
    return opener.decrypt_into(envelope, memoryview(buf)[start : start + inner_length])


def verify_job(opener: env.OuterOpener, job: list[env.DecryptedReport]) -> list[env.OpenedReport | str]:
    """The signature checks of one job's decrypted reports (opened outside their slots), in order."""
    results: list[env.OpenedReport | str] = []
    for decrypted in job:
        try:
            results.append(opener.verify(decrypted))
        except env.EnvelopeError as exc:
            results.append(exc.reason)
    return results


def open_job(opener: env.OuterOpener, buf: mmap.mmap, inner_length: int, job: Pairs) -> list[env.OpenedReport | str]:
    """Open each pair of ``job`` into its slot of ``buf`` (:func:`open_into_slot`) and check its signature, in order:
    each the verified report, or the reason it was dropped. On the submitting thread or on a worker of the verify
    pool, while other threads open envelopes into other slots."""
    results: list[env.OpenedReport | str] = []
    for envelope, slot in job:
        try:
            results.append(opener.verify(open_into_slot(opener, buf, slot, inner_length, envelope)))
        except env.EnvelopeError as exc:
            results.append(exc.reason)
    return results
