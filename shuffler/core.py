"""The shuffler's batch logic, free of any transport (no grpc here).

One batch per (key epoch, round): ``ShufflerCore.begin(header)`` draws a CSPRNG permutation and returns a
:class:`BatchBuilder`; each ``add(envelope)`` opens and verifies one envelope and writes its inner ciphertext
to its permuted slot, in memory if the batch (expected_count x inner length) is at most
``staging_memory_limit`` bytes, else in a zero-filled staging file (memory O(envelope)); ``finish()`` checks
the batch, writes (memory path) and fsyncs the permuted output, signs the attestation, appends the commit
record to the journal (fsync) and only then returns.

Duties (see docs/shuffler.md): verify signature, enrolment and binding, and count every drop by reason; at most
one report per enrolled client per round; replay cache on the outer HPKE ``enc`` and on the report id, per key
epoch, persisted in the journal; a binding (key epoch, round) is used once (an identical resubmission returns
the same attestation); at least ``k`` distinct enrolled signers or nothing is released; with an announced
``envelope_length`` an envelope of another length is a counted drop (``wrong_length``), without one (legacy)
accepted inner ciphertexts of different lengths refuse the batch; uniform permutation drawn from ``os.urandom``
(:meth:`BatchBuilder.draw_permutation`); the output carries inner ciphertexts only. Sealing is
:mod:`shuffledp.shuffler.seal`; the per-report state of a batch and the replay cache are compact arrays
(:mod:`shuffledp.shuffler.tags`), never a Python object per report.

Refusals raise :class:`Refused` with a ``code`` the gRPC layer maps to a status code.
"""

from __future__ import annotations

import logging
import math
import mmap
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cryptography.hazmat.primitives.asymmetric import x25519

from shuffledp.shuffler import envelope as env
from shuffledp.shuffler import seal, wire
from shuffledp.shuffler.attestation import DROP_REASONS
from shuffledp.shuffler.batch import (  # re-exported: the core's public vocabulary
    DEFAULT_STAGING_MEMORY_LIMIT,
    DISK_FULL_ERRNOS,
    JOURNAL_HEADROOM_BYTES,
    JOURNAL_HEADROOM_PER_REPORT,
    MAX_BATCH_REPORTS_CAP,
    MAX_STAGING_MEMORY_LIMIT,
    MAX_VERIFY_THREADS,
    PIPELINE_MAX_BYTES,
    PIPELINE_MAX_REPORTS,
    PIPELINE_MIN_JOB_BYTES,
    REFUSAL_CODES,
    CoreConfig,
    Header,
    Refused,
    SealedBatch,
    envelope_fingerprint,
)
from shuffledp.shuffler.builder import BatchBuilder
from shuffledp.shuffler.journal import Journal, JournalFailed, JournalWriteError
from shuffledp.shuffler.output import messages_from_view, read_messages
from shuffledp.shuffler.staging import close_mapping, stages_in_memory
from shuffledp.shuffler.tags import TagSet

__all__ = [
    "CoreConfig", "Header", "Refused", "SealedBatch", "ShufflerCore", "BatchBuilder", "stages_in_memory",
    "REFUSAL_CODES", "MAX_BATCH_REPORTS_CAP", "JOURNAL_HEADROOM_BYTES", "JOURNAL_HEADROOM_PER_REPORT",
    "DEFAULT_STAGING_MEMORY_LIMIT", "MAX_STAGING_MEMORY_LIMIT", "MAX_VERIFY_THREADS", "PIPELINE_MAX_REPORTS",
    "PIPELINE_MAX_BYTES", "PIPELINE_MIN_JOB_BYTES", "DISK_FULL_ERRNOS", "envelope_fingerprint",
]

log = logging.getLogger("shuffledp.shuffler.core")


class ShufflerCore:
    """State shared by all batches: enrolment, replay cache, sealed batches, counters."""

    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        #: the enrolled signers' public keys; a key's position is its index in a batch's signer bitmap
        self.enrolled = TagSet(32, len(config.enrolment))
        for pk in config.enrolment.values():
            self.enrolled.add(bytes(pk))
        self._hpke_sk = x25519.X25519PrivateKey.from_private_bytes(config.hpke_private_key)
        #: counters, open builders, closing flags and the sealed-batch maps; held only briefly, never through
        #: file I/O, so stats(), begin() and refusals never wait for a commit's writes and fsyncs
        self._lock = threading.Lock()
        #: serialises commits (binding check, output write, fsyncs, journal append) and journal closing; taken
        #: before _lock, never after it
        self._commit_lock = threading.Lock()
        self._alloc_lock = threading.Lock()
        #: the staging buffer retained from the last sealed memory-path batch (config.retain_staging_buffer)
        self._spare_buffer: mmap.mmap | None = None
        self._spare_lock = threading.Lock()  # its own lock: a buffer is given back during a commit
        #: the id of the sealed batch whose output the spare buffer holds (its first ``n * inner_length`` bytes,
        #: the same bytes as the output file), set once the batch's commit record is durable; None otherwise
        self._spare_holds: bytes | None = None
        #: fetches reading the spare buffer right now: while any does, it is neither taken, replaced nor unmapped
        self._spare_readers = 0
        self.journal = Journal(config.journal_dir)
        #: called (no arguments) once if the journal fails for good; the service turns health NOT_SERVING
        self.on_unhealthy: list[Any] = []
        self._sealed: dict[bytes, SealedBatch] = {}
        self._by_binding: dict[tuple[int, int], SealedBatch] = {}
        #: the replay cache of each key epoch (only the served one is kept): outer HPKE encs and report ids
        self._seen_enc: dict[int, TagSet] = {}
        self._seen_rid: dict[int, TagSet] = {}
        self.counters: Counter[str] = Counter()
        #: the last commit of this process: (seconds, of which the output's writes and fsync); see _register
        self._last_seal = (0.0, 0.0)
        #: batch id -> the release record of its first Fetch (see :meth:`read_batch`)
        self._released: dict[bytes, dict[str, Any]] = {}
        for rec in self.journal.records:
            if rec.get("type") == "batch":
                self._load_record(rec)
            elif rec.get("type") == "release":
                self._released[bytes.fromhex(rec["batch_id"])] = rec
        self.counters["batches_released"] = len(self._released)
        self.journal.records.clear()  # loaded into the structures above; no second copy stays in memory
        #: builders begun and not yet finished or aborted; :meth:`close` waits for them (graceful stop)
        self._open_builders = 0
        self._closing = False  # close() began: no new batches
        self._closed = False  # the journal is closed: no commits
        self._drained = threading.Condition(self._lock)
        #: opens and checks BatchBuilder jobs off the submitting thread (None: config.verify_threads == 0)
        self.verify_pool: ThreadPoolExecutor | None = (
            ThreadPoolExecutor(max_workers=config.verify_threads, thread_name_prefix="shuffler-verify")
            if config.verify_threads
            else None
        )

    def _load_record(self, rec: dict[str, Any]) -> None:
        sb = SealedBatch(
            batch_id=bytes.fromhex(rec["batch_id"]),
            statement=rec["statement"].encode(),
            signature=bytes.fromhex(rec["signature"]),
            key_epoch=int(rec["key_epoch"]),
            round_id=int(rec["round_id"]),
            request_digest=bytes.fromhex(rec["request_digest"]),
            output=self.journal.batches_dir / rec["output"],
            n=int(rec["n"]),
            inner_length=int(rec["inner_length"]),
        )
        expected = sb.n * sb.inner_length
        if not sb.output.exists() or sb.output.stat().st_size != expected:  # outputs are fsynced before their record
            raise RuntimeError(f"sealed batch output {sb.output.name} is missing or not {expected} bytes")
        encs, rids = seal.replay_tags_of_record(rec)
        self._register(sb, encs, rids, rec.get("dropped", {}))

    def _register(self, sb: SealedBatch, encs: bytes, rids: bytes, dropped: Mapping[str, int], *,
                  seal_seconds: tuple[float, float] | None = None) -> None:
        """Make a sealed batch known: its replay tags (``encs``, ``rids``: concatenated, 32 and 16 bytes each) join
        the epoch's replay cache, then, under ``_lock``, the binding and the counters. Called at start and by a
        commit (under the commit lock, so one writer at a time; a concurrent submit may read the cache meanwhile,
        and sees each tag either absent or present, see :class:`~shuffledp.shuffler.tags.TagSet`). A commit also
        passes ``seal_seconds``: its duration so far and, of it, the output's writes and fsync (``Stats``'
        ``last_seal_seconds`` and ``last_seal_write_seconds``), set with the counters so that a reader sees both of
        the same batch."""
        if sb.key_epoch == self.config.key_epoch:  # older epochs' caches are flushed by key rotation
            self._seen_enc.setdefault(sb.key_epoch, TagSet(32)).update_packed(encs)
            self._seen_rid.setdefault(sb.key_epoch, TagSet(16)).update_packed(rids)
        with self._lock:
            self._sealed[sb.batch_id] = sb
            self._by_binding[(sb.key_epoch, sb.round_id)] = sb
            self.counters["batches_sealed"] += 1
            self.counters["reports_accepted"] += sb.n
            for reason, count in dropped.items():
                self.counters[f"dropped:{reason}"] += int(count)
            if seal_seconds is not None:
                self._last_seal = seal_seconds

    @property
    def healthy(self) -> bool:
        """False once the journal failed for good (a failed append could not be rolled back)."""
        return not self.journal.failed

    def _mark_unhealthy(self) -> None:
        log.error("journal failed for good: refusing all further submissions")
        for cb in list(self.on_unhealthy):
            try:
                cb()
            except Exception as exc:  # noqa: BLE001 - a hook must not hide the original failure
                log.error("on_unhealthy hook failed (%s)", type(exc).__name__)

    # ----------------------------------------------------------------------------------------------- submit
    def begin(self, header: Header) -> "BatchBuilder":
        """Validate a submit header and start a batch. Raises :class:`Refused`."""
        try:
            self._check_header(header)
        except Refused as exc:
            with self._lock:
                self.counters["batches_refused"] += 1
            log.info("batch refused at the header: %s", exc.reason)
            raise
        with self._lock:
            if self._closing:
                raise Refused("unavailable", "shutting_down", "the shuffler is stopping; retry with its successor")
            self._open_builders += 1
        try:
            return BatchBuilder(self, header, replay_only=(header.key_epoch, header.round_id) in self._by_binding)
        except BaseException:
            self._builder_closed()
            raise

    def _builder_closed(self) -> None:
        """A builder was finished or aborted (called once per builder)."""
        with self._lock:
            self._open_builders -= 1
            if self._open_builders == 0:
                self._drained.notify_all()

    def _check_header(self, header: Header) -> None:
        if not self.healthy:
            raise Refused("unavailable", "journal_failed", "the shuffler's journal failed; it accepts no batches")
        if header.protocol_version not in env.ENVELOPE_VERSIONS:
            raise Refused(
                "invalid_argument",
                "protocol_version",
                f"protocol version {header.protocol_version}; this shuffler speaks "
                f"{', '.join(map(str, sorted(env.ENVELOPE_VERSIONS)))}",
            )
        if header.key_epoch != self.config.key_epoch:
            raise Refused(
                "failed_precondition",
                "key_epoch",
                f"key epoch {header.key_epoch} is not the shuffler's current epoch {self.config.key_epoch}",
            )
        if len(header.model_digest) != env.DIGEST_BYTES:
            raise Refused(
                "invalid_argument", "model_digest", f"model digest must be 32 bytes, got {len(header.model_digest)}"
            )
        if not 0 <= header.round_id < 2**64:
            raise Refused("invalid_argument", "round_id", "round id must fit in 64 bits")
        if header.expected_count < 1:
            raise Refused("invalid_argument", "empty_batch", "expected_count must be >= 1 (empty batch)")
        if header.expected_count > self.config.max_batch_reports:
            raise Refused(
                "resource_exhausted",
                "batch_too_large",
                f"expected_count {header.expected_count} exceeds max_batch_reports {self.config.max_batch_reports}",
            )
        if header.expected_count < self.config.k:
            raise Refused(
                "failed_precondition",
                "below_threshold",
                f"expected_count {header.expected_count} is below the release threshold k = {self.config.k}",
            )
        if header.envelope_length and not (
            env.ENVELOPE_OVERHEAD <= header.envelope_length <= self.config.max_envelope_bytes
        ):
            raise Refused(
                "invalid_argument",
                "envelope_length",
                f"envelope_length {header.envelope_length} is outside [{env.ENVELOPE_OVERHEAD}, "
                f"{self.config.max_envelope_bytes}]",
            )

    def _commit(self, builder: "BatchBuilder") -> SealedBatch:
        """Seal ``builder``'s batch (:func:`shuffledp.shuffler.seal.commit`): called by
        :meth:`BatchBuilder.finish` under the commit lock, with the staging complete and the checks passed."""
        return seal.commit(self, builder)

    # ------------------------------------------------------------------------------------------------ fetch
    def lookup(self, batch_id: bytes) -> SealedBatch:
        """The sealed batch with this id. Raises :class:`Refused` (not_found / invalid_argument)."""
        if len(batch_id) != 16:
            raise Refused("invalid_argument", "batch_id", f"batch id must be 16 bytes, got {len(batch_id)}")
        sb = self._sealed.get(bytes(batch_id))
        if sb is None:
            raise Refused("not_found", "unknown_batch", "no sealed batch with this id")
        return sb

    def read_batch(self, batch_id: bytes) -> Iterator[bytes]:
        """The sealed output, one inner ciphertext at a time, in sealed order (the same bytes every time):
        :meth:`read_batch_messages` decoded. Raises as :meth:`read_batch_messages`."""
        messages = self.read_batch_messages(batch_id, 1)
        return (item for message in messages for item in wire.iter_repeated_bytes_field(message, 1))

    def read_batch_messages(self, batch_id: bytes, packing: int) -> Iterator[bytes]:
        """The sealed output as serialised ``FetchResponse`` messages: consecutive inner ciphertexts in sealed
        order, packed up to ``packing`` bytes per message (an item larger than that travels alone). The items
        and their order are the same on every call.

        The first read of a batch is put on record first (:meth:`record_release`): nothing of a batch leaves
        the shuffler before its release record is durable. The messages come from the retained staging buffer
        while it still holds this batch's output (the bytes the output file holds, written from it), else from
        the output file. Raises :class:`Refused` (not_found, invalid_argument, or as :meth:`record_release`).
        """
        sb = self.lookup(batch_id)
        self.record_release(sb)
        with self._spare_lock:
            held = self._spare_buffer if self._spare_holds == sb.batch_id else None
            if held is not None:
                self._spare_readers += 1
        if held is None:
            return read_messages(sb.output, sb.n, sb.inner_length, packing)
        return self._messages_from_spare(held, sb, packing)

    def _messages_from_spare(self, buf: mmap.mmap, sb: SealedBatch, packing: int) -> Iterator[bytes]:
        """:func:`messages_from_view` over the spare buffer; the reader count taken by the caller is given back
        when the generator ends or is closed (a Fetch the peer abandoned)."""
        try:
            messages = messages_from_view(memoryview(buf), sb.n, sb.inner_length, packing)
            try:
                yield from messages
            finally:
                messages.close()  # type: ignore[attr-defined] - a generator; frees its views of the buffer
                del messages
        finally:
            with self._spare_lock:
                self._spare_readers -= 1

    def _spare_now_holds(self, buf: mmap.mmap, batch_id: bytes) -> None:
        """Note that the spare buffer, if it is ``buf``, holds the output of the batch just committed."""
        with self._spare_lock:
            if self._spare_buffer is buf:
                self._spare_holds = batch_id

    def record_release(self, sb: SealedBatch) -> None:
        """Journal (fsynced) that ``sb`` is being released, once per batch: its first Fetch.

        The journal's release records are the shuffler's own account of which batches the server has read,
        for an auditor to set against the rounds the server's ledger charged (``shuffledp shuffler journal``
        lists them): a batch released but never charged is privacy spent off the books. The record holds
        the batch id, key epoch, round, count and the time of release (whole seconds): nothing about a
        client or a position. Idempotent: later Fetches of the same batch add nothing.

        Raises :class:`Refused`: resource_exhausted ``disk_full`` if the append was rolled back for want of
        space, unavailable ``journal_write`` for another rolled-back write error, unavailable
        ``journal_failed`` if the journal failed for good, unavailable ``shutting_down`` once :meth:`close`
        closed the journal. Nothing is released then.
        """
        with self._lock:
            if sb.batch_id in self._released:
                return
        with self._commit_lock:  # the journal's appends are serialised by the commit lock
            with self._lock:
                if sb.batch_id in self._released:
                    return
                if self._closed:
                    raise Refused("unavailable", "shutting_down", "the shuffler is stopping; retry with its successor")
            record = {
                "type": "release",
                "batch_id": sb.batch_id.hex(),
                "key_epoch": sb.key_epoch,
                "round_id": sb.round_id,
                "n": sb.n,
                "released_at": int(time.time()),
            }
            try:
                self.journal.append(record)
            except JournalWriteError as exc:
                log.error("batch not released: its release record could not be written (%s)", exc.strerror)
                if exc.errno in DISK_FULL_ERRNOS:
                    raise Refused("resource_exhausted", "disk_full", "no space left to record the release") from None
                raise Refused("unavailable", "journal_write", "the release record could not be written") from None
            except JournalFailed:
                self._mark_unhealthy()
                raise Refused("unavailable", "journal_failed", "the shuffler's journal failed") from None
            with self._lock:
                self._released[sb.batch_id] = record
                self.counters["batches_released"] += 1
        log.info("batch released: epoch=%d round=%d n=%d", sb.key_epoch, sb.round_id, sb.n)

    def stats(self) -> dict[str, Any]:
        """Aggregate counters only (never per position or per client). ``epoch_batches_released`` counts the
        journal's released batches of the served key epoch (``key_epoch``), those of earlier processes included."""
        with self._lock:
            epoch = self.config.key_epoch
            return {
                "key_epoch": epoch,
                "epoch_batches_released": sum(1 for bid in self._released
                                              if bid in self._sealed and self._sealed[bid].key_epoch == epoch),
                "batches_sealed": self.counters["batches_sealed"],
                "batches_released": self.counters["batches_released"],
                "batches_refused": self.counters["batches_refused"],
                "reports_accepted": self.counters["reports_accepted"],
                "dropped": {r: self.counters[f"dropped:{r}"] for r in DROP_REASONS},
                "last_seal_seconds": self._last_seal[0],
                "last_seal_write_seconds": self._last_seal[1],
            }

    def take_buffer(self, size: int) -> mmap.mmap | None:
        """The retained staging buffer if it holds at least ``size`` bytes (it is then no longer retained), else
        None. A retained buffer that is too small is unmapped, so at most one spare buffer ever exists.

        Reusing the mapping avoids faulting in ``size`` bytes of fresh pages per batch. Its old contents are
        the last sealed batch's output (inner ciphertexts, in output order): nothing a new batch could release,
        since its output consists of the slots its own accepted reports were written to (holes are squeezed
        out, and the O_DIRECT rounding tail is zeroed).
        """
        with self._spare_lock:
            if self._spare_readers:  # a Fetch is reading it: the new batch maps its own buffer
                return None
            buf, self._spare_buffer = self._spare_buffer, None
            self._spare_holds = None
        if buf is not None and len(buf) < size:
            close_mapping(buf)
            buf = None
        return buf

    def give_back_buffer(self, buf: mmap.mmap) -> None:
        """Retain a sealed batch's staging buffer for the next batch (``retain_staging_buffer``), keeping the
        larger one if a spare exists already; unmap what is not kept."""
        if buf.closed:
            return
        if not self.config.retain_staging_buffer:
            close_mapping(buf)
            return
        with self._spare_lock:
            spare = self._spare_buffer
            if not self._spare_readers and (spare is None or len(spare) < len(buf)):
                self._spare_buffer, buf = buf, spare  # type: ignore[assignment] - spare may be None
                self._spare_holds = None
        if buf is not None:
            close_mapping(buf)

    def close(self, *, drain_timeout: float = 5.0) -> bool:
        """Refuse new batches, wait up to ``drain_timeout`` seconds for the open ones to finish or abort, then
        shut the verify pool and close the journal. Returns False if batches were still open at the deadline.

        The service calls this after ``server.stop(grace)``: gRPC has then cancelled the calls still running,
        but their handler threads may still be unwinding, and one may be committing. The journal is closed under
        the commit lock, which a commit holds throughout, so a commit either completes before it (the batch is
        sealed; an identical resubmission later gets its attestation back) or finds the core closed and is
        refused (``shutting_down``, nothing committed). A batch still open at the deadline ends the same way,
        or with a cancelled signature check.
        """
        if not 0 <= drain_timeout < math.inf:
            raise ValueError(f"drain_timeout must be a finite number of seconds >= 0, got {drain_timeout!r}")
        with self._lock:
            self._closing = True
            drained = self._drained.wait_for(lambda: self._open_builders == 0, timeout=drain_timeout)
            still_open = self._open_builders
        if not drained:
            log.warning("close: %d batch(es) still open after %g s; they will be refused", still_open, drain_timeout)
        if self.verify_pool is not None:
            self.verify_pool.shutdown(wait=True, cancel_futures=True)
        with self._spare_lock:
            spare, self._spare_buffer = self._spare_buffer, None
            self._spare_holds = None
        if spare is not None:
            try:
                spare.close()
            except BufferError:  # a Fetch still holds a view: the garbage collector unmaps it after that Fetch
                pass
        with self._commit_lock, self._lock:  # not during a commit; a later commit sees _closed and is refused
            self._closed = True
            self.journal.close()
        return drained
