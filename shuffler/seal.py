"""Sealing a batch (:meth:`shuffledp.shuffler.core.ShufflerCore` commits through :func:`commit`): the permuted
output made final and durable, the attestation signed, and the commit record journaled before anyone is told.

The staging buffer (memory path) or staging file (disk path) already holds the accepted inner ciphertexts at
their permuted slots (:class:`~shuffledp.shuffler.builder.BatchBuilder`). :func:`commit`

1. squeezes the holes of dropped envelopes out, keeping slot order (in the buffer, then writes the output once,
   front to back, into the reserved file; or in place in the staging file), truncates, ``fchmod 0400``, fsyncs,
   renames it to ``batches/<id>.out`` and fsyncs both directories;
2. signs the attestation, whose output digest is built from the per-report hashes kept at the slots (no report
   byte is read again);
3. appends the commit record (attestation, request fingerprint, sorted replay tags) to the journal and fsyncs it;
4. only then registers the batch (binding, replay cache, counters, and for ``Stats`` how long the commit and
   the output's writes and fsync took) and returns.

A failure before the record is durable removes the output (it is not a batch); a journal that failed for good
marks the core unhealthy.
"""

from __future__ import annotations

import base64
import logging
import os
import secrets
import struct
import time
from typing import Any

import numpy as np

from shuffledp.shuffler.attestation import DROP_REASONS, Attestation, OutputDigest, sign_statement
from shuffledp.shuffler.batch import Refused, SealedBatch
from shuffledp.shuffler.journal import JournalFailed, JournalWriteError, fsync_dir
from shuffledp.shuffler.staging import pwrite_all, write_out

__all__ = ["commit", "commit_record", "replay_tags_of_record", "update_digest"]

log = logging.getLogger(__name__)


def update_digest(digest: OutputDigest, inner_length: int, slot_hashes: bytes | bytearray,
                  occupied: np.ndarray) -> None:
    """Add the items at the ``occupied`` slots (ascending: the output order) to ``digest`` from their hashes
    (32 bytes per slot in ``slot_hashes``): the same result as ``digest.update_hashed(inner_length, h)`` for each,
    in one pass of C code over ``len:u64 || hash`` rows."""
    if not len(occupied):
        return
    rows = np.empty((len(occupied), 40), dtype=np.uint8)
    rows[:, :8] = np.frombuffer(struct.pack(">Q", inner_length), dtype=np.uint8)
    rows[:, 8:] = np.frombuffer(slot_hashes, dtype=np.uint8).reshape(-1, 32)[occupied]
    for chunk in range(0, len(rows), 1 << 16):
        part = rows[chunk : chunk + (1 << 16)]
        digest.update_packed(part.tobytes(), len(part))


def commit_record(*, sb: SealedBatch, statement: bytes, signature: bytes, dropped: dict[str, int],
                  encs: bytes, report_ids: bytes) -> dict[str, Any]:
    """The journal's commit record of ``sb``: its attestation, request fingerprint and replay tags.

    The tags (the accepted reports' outer HPKE encapsulated keys and report ids) are each one sorted concatenation
    (``encs``, ``report_ids``), stored base64-encoded: one string per kind rather than one per report, so a
    1,000,000-report record is about 64 MB of JSON and builds no Python object per report. Records written before
    hold them as lists of hex strings (``replay_enc``, ``replay_report_ids``); :func:`replay_tags_of_record` reads
    both.
    """
    return {
        "type": "batch",
        "batch_id": sb.batch_id.hex(),
        "key_epoch": sb.key_epoch,
        "round_id": sb.round_id,
        "request_digest": sb.request_digest.hex(),
        "statement": statement.decode(),
        "signature": signature.hex(),
        "output": sb.output.name,
        "n": sb.n,
        "inner_length": sb.inner_length,
        "replay_enc_sorted": base64.b64encode(encs).decode(),
        "replay_report_ids_sorted": base64.b64encode(report_ids).decode(),
        "dropped": dropped,
    }


def replay_tags_of_record(rec: dict[str, Any]) -> tuple[bytes, bytes]:
    """The replay tags of a commit record, each kind concatenated: ``(encs, report ids)``, in either format of
    :func:`commit_record`."""
    if "replay_enc_sorted" in rec:
        return (base64.b64decode(rec["replay_enc_sorted"], validate=True),
                base64.b64decode(rec["replay_report_ids_sorted"], validate=True))
    return (b"".join(bytes.fromhex(x) for x in rec["replay_enc"]),
            b"".join(bytes.fromhex(x) for x in rec["replay_report_ids"]))


def _squeeze(builder: Any, occupied: np.ndarray, inner_length: int) -> None:
    """Move the i-th occupied slot to position i (i <= slot, so a slot is read before anything is written over
    it): in the staging buffer on the memory path, in place in the staging file on the disk path. With no holes
    nothing moves and nothing is read."""
    if not len(occupied) or int(occupied[-1]) == len(occupied) - 1:
        return  # slots 0..n-1 all occupied: already in place
    moved = np.nonzero(occupied != np.arange(len(occupied), dtype=occupied.dtype))[0]
    first = int(moved[0])
    buf = builder.staging_buffer
    if buf is not None:
        with memoryview(buf) as mv:  # the slots start at its first byte (shuffledp.shuffler.staging.map_staging_buffer)
            for i in range(first, len(occupied)):
                slot = int(occupied[i])
                mv[i * inner_length : (i + 1) * inner_length] = mv[slot * inner_length : (slot + 1) * inner_length]
        return
    fd = builder.staging_fd
    for i in range(first, len(occupied)):
        slot = int(occupied[i])
        chunk = os.pread(fd, inner_length, slot * inner_length)
        if len(chunk) != inner_length:
            raise RuntimeError("staging file is shorter than expected")
        pwrite_all(fd, chunk, i * inner_length)


def commit(core: Any, builder: Any) -> SealedBatch:
    """Seal ``builder``'s batch for ``core`` (see the module docstring); called under the core's commit lock,
    with the staging complete and the batch's checks passed. Returns the sealed batch, registered."""
    started = time.perf_counter()
    if core.journal.failed:
        # A batch that was open when the journal failed must not add a second output without a record
        # (journal.Journal refuses to start beside more than one).
        raise Refused("unavailable", "journal_failed", "the shuffler's journal failed; it accepts no batches")
    header = builder.header
    batch_id = secrets.token_bytes(16)
    n = builder.n_accepted
    inner_length = builder.inner_length
    final = core.journal.batches_dir / f"{batch_id.hex()}.out"
    digest = OutputDigest.for_protocol(header.protocol_version)
    fd = builder.staging_fd
    source = builder.staging_path
    retained = None
    if source is None or fd < 0:
        raise RuntimeError("no staging file")
    occupied = builder.used_slots()  # ascending: output order = slot order
    # The output digest comes from the hash of each inner ciphertext (BLAKE3, or SHA-256 for a protocol-1 batch),
    # computed when its signature was checked and kept at its slot (attestation formats v3 and v2).
    update_digest(digest, inner_length, builder.slot_hashes, occupied)
    builder.forget_permutation()
    buf = builder.staging_buffer
    # write_seconds (for Stats): the output's writes and its fsync; on the disk path the staging file is the output,
    # so its in-place squeeze counts, and the reports' own writes happened as they arrived
    clock = time.perf_counter()
    _squeeze(builder, occupied, inner_length)
    write_seconds = 0.0 if buf is not None else time.perf_counter() - clock
    del occupied
    if buf is not None:
        # Memory path: write the output once, in offset order, into the file reserved when the first report came.
        clock = time.perf_counter()
        with memoryview(buf) as mv:
            write_out(fd, source, mv, n * inner_length)
        write_seconds += time.perf_counter() - clock
        retained = buf
        builder.release_buffer(retain=True)  # the batch now exists in the output file (and, if retained, in the
        # spare buffer until the next batch overwrites it; see ShufflerCore.take_buffer)
    clock = time.perf_counter()
    os.ftruncate(fd, n * inner_length)
    os.fchmod(fd, 0o400)  # a sealed batch never changes
    os.fsync(fd)  # data, size and mode durable before the rename
    write_seconds += time.perf_counter() - clock
    os.replace(source, final)
    builder.staging_path = None
    try:  # until the record is durable the output is not a batch: a failure removes it
        fsync_dir(core.journal.batches_dir)
        fsync_dir(core.journal.staging_dir)
        dropped = {r: builder.drops.get(r, 0) for r in DROP_REASONS}
        statement = Attestation.build_statement(
            batch_id=batch_id, protocol_version=header.protocol_version, key_epoch=header.key_epoch,
            round_id=header.round_id, model_digest=header.model_digest, k=core.config.k,
            n_received=builder.received, n_accepted=n, inner_length=inner_length, output_digest=digest.digest(),
            dropped=dropped, envelope_length=header.envelope_length,
        )
        signature = sign_statement(statement, core.config.signing_private_key)
        sb = SealedBatch(batch_id=batch_id, statement=statement, signature=signature, key_epoch=header.key_epoch,
                         round_id=header.round_id, request_digest=builder.request_digest(), output=final, n=n,
                         inner_length=inner_length)
        encs, rids = builder.encs.packed_sorted(), builder.report_ids.packed_sorted()
        builder.forget_tags()  # before the record is built: its strings are the peak of a large batch's memory
        core.journal.append(commit_record(sb=sb, statement=statement, signature=signature, dropped=dropped,
                                          encs=encs, report_ids=rids))  # the commit point: durable before anyone
        # is told
        if retained is not None:
            core._spare_now_holds(retained, batch_id)
    except JournalFailed:
        # unknown state: keep the output (quarantined at the next start) and stop accepting batches
        core._mark_unhealthy()
        raise Refused("unavailable", "journal_failed", "the shuffler's journal failed; it accepts no batches") from None
    except BaseException as exc:
        # Nothing was committed and nobody was told (a rolled-back append, or a failure before it): the output is
        # not a batch and must not stay in batches/ without a record (a crash leaves at most one such).
        final.unlink(missing_ok=True)
        try:
            fsync_dir(core.journal.batches_dir)
        except OSError:
            pass
        if isinstance(exc, JournalWriteError):
            log.error("batch not committed: the journal append failed and was rolled back (%s)", exc.strerror)
        raise  # a JournalWriteError is an OSError; the service maps a full disk to RESOURCE_EXHAUSTED disk_full
    core._register(sb, encs, rids, dropped,  # takes the core's _lock itself
                   seal_seconds=(time.perf_counter() - started, write_seconds))
    log.info("batch sealed: epoch=%d round=%d received=%d accepted=%d dropped=%s", header.key_epoch,
             header.round_id, builder.received, n, {r: c for r, c in dropped.items() if c})
    return sb
