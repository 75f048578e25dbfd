"""One submission in progress: :class:`BatchBuilder` (begun by :meth:`shuffledp.shuffler.core.ShufflerCore.begin`)."""

from __future__ import annotations

import logging
import mmap
import os
import secrets
from array import array
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from shuffledp.shuffler import envelope as env
from shuffledp.shuffler.batch import (
    PIPELINE_MAX_BYTES,
    PIPELINE_MAX_REPORTS,
    PIPELINE_MIN_JOB_BYTES,
    Header,
    Refused,
    SealedBatch,
    envelope_fingerprint,
    request_digest,
)
from shuffledp.shuffler.opening import open_job, verify_job
from shuffledp.shuffler.staging import (
    close_mapping,
    draw_permutation,
    map_staging_buffer,
    pwrite_all,
    reserve_file,
    stages_in_memory,
)
from shuffledp.shuffler.tags import TagSet

__all__ = ["BatchBuilder"]

log = logging.getLogger(__name__)


class BatchBuilder:
    """One submission in progress. Not thread-safe (one per stream).

    Permute on arrival: at the first envelope that passes the public length checks, a uniformly random
    permutation ``perm`` of the ``expected_count`` slots is drawn from the CSPRNG (:meth:`draw_permutation`) and
    kept compactly as an ``array('I')``; the k-th claim of a slot gets slot ``perm[k]`` of the staging area. A
    report claims its slot when it is accepted (and is copied in), or, on the memory path with an announced
    ``envelope_length``, when it passes the length checks (it is then decrypted straight into the slot,
    :mod:`shuffledp.shuffler.opening`). The output order is the slot order. Slots of dropped
    envelopes are holes, squeezed out at seal time; which claims are accepted depends on the reports only, never on
    ``perm``, so the accepted reports' slots are in a uniformly random relative order. The permutation exists only
    in memory and is dropped at seal time.

    Where the slots live is a deterministic function of the batch size, ``expected_count * inner_length``
    (:func:`stages_in_memory`): up to ``staging_memory_limit`` bytes, in one anonymous ``mmap`` buffer (memory
    path), and the output file is written once, in output order, at seal time; above it, in a staging file
    that is allocated and zero-filled in offset order (in the page cache, not synced) before the first report is
    written, so that any writeback lays the blocks out in offset order, never in arrival order (disk path; see
    ``_preallocate``). On both paths free space for the whole batch (plus the journal reserve) is checked and
    reserved with ``posix_fallocate`` when the first report is accepted; there is no sync during the batch,
    only the one before the commit. Each accepted report's inner hash (computed for its signature check) is kept
    at its slot, 32 bytes per slot, so that the output digest needs no second pass over the reports.

    Memory per report is a few fixed-width arrays, never a Python object per report: the permutation (4 bytes),
    the slot hash (32), the envelope fingerprint (32), and the replay tags and inner encapsulated key in
    :class:`~shuffledp.shuffler.tags.TagSet` s (about 40, 24 and 40 bytes); one report per signer is a bitmap over
    the enrolment (one byte per enrolled client).

    Signature checks are done per job: the envelopes of one received message (:meth:`add_many`; :meth:`add`
    is a job of one). An envelope decrypted into its slot is opened with its job (:mod:`shuffledp.shuffler.opening`),
    any other on the calling thread as it arrives. With ``verify_threads`` >= 1, a job of at least
    ``PIPELINE_MIN_JOB_BYTES`` of plaintext is opened and checked (inner hash + Ed25519, GIL-free) on the core's
    verify pool, several jobs at once; jobs are concluded oldest first, and everything after the check (enrolment,
    replay, one report per signer, the slot) happens on the calling thread in arrival order, exactly as with
    inline checks. A report is therefore staged in its own call if its job is already done, or a few messages
    later, or in :meth:`finish`; :meth:`settle` waits for all. The pool is the core's, shared by concurrent
    submits.
    """

    def __init__(self, core: Any, header: Header, *, replay_only: bool) -> None:
        self.core = core
        self.header = header
        self.replay_only = replay_only
        self.received = 0
        self.n_accepted = 0
        self.drops: Counter[str] = Counter()
        #: the fingerprint of every envelope received (:func:`envelope_fingerprint`, 32 bytes each, arrival order)
        self._fingerprints = bytearray()
        self.inner_length = -1
        self._lengths: set[int] = set()
        #: one byte per enrolled client: set once a report of that signer was accepted (sized at first staging)
        self._signers = bytearray()
        #: the accepted reports' replay tags (outer HPKE enc, report id) and inner HPKE encapsulated keys. Two
        #: enrolled signers wrapping one inner ciphertext would be counted as two reports (the copy as cover) for
        #: one report the server opens; an identical inner ciphertext has the same encapsulated key, so that key
        #: catches it (and a different one sharing the key). Sized for the batch at first staging.
        self.encs = TagSet(env.ENC_BYTES)
        self.report_ids = TagSet(env.REPORT_ID_BYTES)
        self._inner_encs = TagSet(env.ENC_BYTES)
        self._tags_sized = False
        #: slots handed out so far: the k-th claim gets slot perm[k] (see _begin_staging)
        self._claimed = 0
        #: the slots of the accepted reports, in acceptance order
        self._accepted_slots = array("I")
        #: whether envelopes are decrypted straight into their slots (set at first staging)
        self._into_slots = False
        self._done = False
        self.staging_fd = -1
        self.staging_path: Path | None = None
        #: the memory path's slot buffer (None on the disk path, before staging began, after seal)
        self.staging_buffer: mmap.mmap | None = None
        #: True/False once staging began and the path was chosen; None before
        self.in_memory: bool | None = None
        self._perm: array | None = None
        #: the inner ciphertext's hash at each slot (shuffledp.shuffler.envelope.inner_hash; 32 bytes per slot, slot
        #: order), for the output digest
        self._slot_hashes: bytearray | None = None
        #: signature-check jobs in flight on the core's verify pool, oldest first: (future, reports, bytes, slots)
        self._pending: deque[tuple[Future[list[env.OpenedReport | str]], int, int, list[int]]] = deque()
        self._pending_reports = 0
        self._pending_bytes = 0
        if not replay_only:
            # Created empty at the header on both paths (it is the output-to-be); it holds no report data until
            # the first one is accepted (disk path) or until seal (memory path). Removed at start if orphaned.
            self.staging_path = core.journal.staging_dir / f"{secrets.token_hex(16)}.stage"
            self.staging_fd = os.open(self.staging_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._opener = env.OuterOpener(
            core._hpke_sk,
            key_epoch=header.key_epoch,
            round_id=header.round_id,
            model_digest=header.model_digest,
            version=header.protocol_version,
        )

    @staticmethod
    def draw_permutation(n: int) -> array:
        """A uniformly random permutation of ``range(n)`` as ``array('I')``, from the CSPRNG
        (:func:`shuffledp.shuffler.staging.draw_permutation`)."""
        return draw_permutation(n)

    def used_slots(self) -> np.ndarray:
        """The slots of the accepted reports in ascending (output) order, as ``uint32`` (raises once the
        permutation is gone)."""
        if self._perm is None:
            raise RuntimeError("no permutation (replay-only builder, nothing accepted, or already sealed)")
        return np.sort(np.frombuffer(self._accepted_slots, dtype=np.uint32))

    @property
    def slot_hashes(self) -> bytearray:
        """Hash of the inner ciphertext in each slot, 32 bytes per slot, in slot order (unused slots zero)."""
        if self._slot_hashes is None:
            raise RuntimeError("no slot hashes (replay-only builder, nothing accepted, or already sealed)")
        return self._slot_hashes

    def forget_permutation(self) -> None:
        """Drop the permutation and the slot hashes (once the output digest is computed, before writing the output)."""
        self._perm = None
        self._slot_hashes = None

    def forget_tags(self) -> None:
        """Drop the per-report checking state (fingerprints, replay tags, inner keys, signer bitmap) once the seal
        has taken the request digest and the sorted replay tags from it."""
        self._fingerprints = bytearray()
        self.encs, self.report_ids, self._inner_encs = TagSet(32), TagSet(16), TagSet(32)
        self._signers = bytearray()

    def release_buffer(self, *, retain: bool = False) -> None:
        """Let go of the memory path's staging buffer (idempotent). ``retain=True`` (after a successful seal only)
        hands it to the core for the next batch (:meth:`ShufflerCore.give_back_buffer`); otherwise, as on every
        refusal and abort, it is unmapped: the pages go back to the system now, not at garbage collection."""
        buf, self.staging_buffer = self.staging_buffer, None
        if buf is None:
            return
        if retain:
            self.core.give_back_buffer(buf)
        else:
            close_mapping(buf)

    def _begin_staging(self, inner_length: int) -> None:
        """Fix the batch's inner length, stage (:meth:`_start_staging`) and draw the permutation: called once, at
        the first envelope that passes the public length checks (``inner_length`` is its length minus the outer
        layer's overhead), whether or not it later opens and verifies. Raises :class:`Refused` (already aborted).
        """
        self.inner_length = inner_length
        # Without an announced envelope_length (legacy) the first envelope may be dropped after it fixed the slots'
        # length: _accept then stages anew at the first accepted report's length (_restage), so only the accepted
        # reports' lengths decide whether the batch is mixed_lengths, wherever an odd envelope stands.
        self._start_staging()  # chooses memory or disk staging
        self._perm = self.draw_permutation(self.header.expected_count)  # allocated lazily
        self._slot_hashes = bytearray(32 * self.header.expected_count)
        # On the memory path with an announced envelope_length (every accepted report then has the slots' length)
        # envelopes are decrypted straight into their slots (shuffledp.shuffler.opening; the head to a small buffer,
        # the inner ciphertext into the slot, by AES-GCM as a stream, on the submitting thread or a worker): the k-th
        # envelope that passes the length checks claims slot perm[k] before it is opened, and one that does not
        # open, or is dropped later, leaves a hole there, squeezed out at seal. Otherwise the k-th accepted report
        # claims slot perm[k] and is copied in.
        # Either way the claims are a prefix of perm and which ones are accepted depends on the reports only, so
        # the accepted reports' slots are in a uniformly random relative order. A function of public sizes only.
        self._into_slots = bool(self.in_memory and self.header.envelope_length)
        self._claimed = 0
        if not self._tags_sized:  # nothing is accepted before the first staging: the sets are still empty
            count = self.header.expected_count
            self.encs = TagSet(env.ENC_BYTES, count)
            self.report_ids = TagSet(env.REPORT_ID_BYTES, count)
            self._inner_encs = TagSet(env.ENC_BYTES, count)
            self._signers = bytearray(len(self.core.enrolled))
            self._tags_sized = True

    def _restage(self, inner_length: int) -> None:
        """Legacy header only, before any report is accepted: the first accepted report's inner length differs
        from the slots' (fixed by an envelope that was then dropped), so the staging and the permutation are made
        anew at that length. Raises :class:`Refused` (already aborted) as :meth:`_begin_staging` does."""
        self.release_buffer()
        self.forget_permutation()
        os.ftruncate(self.staging_fd, 0)
        self._begin_staging(inner_length)

    def _start_staging(self) -> None:
        """Choose the staging path for this batch, then allocate: called once, from :meth:`_begin_staging`.

        Raises :class:`Refused` (resource_exhausted: ``staging_memory`` or ``disk_full``); the batch is then
        counted as refused and everything it allocated is released.
        """
        size = self.header.expected_count * self.inner_length
        try:
            self.in_memory = stages_in_memory(
                self.header.expected_count, self.inner_length, self.core.config.staging_memory_limit
            )
            if self.in_memory:
                self.staging_buffer = map_staging_buffer(self.core.take_buffer, size, self.header.expected_count)
            self._preallocate(zero_fill=not self.in_memory)
        except Refused as exc:
            with self.core._lock:
                self.core.counters["batches_refused"] += 1
            log.info("batch refused: %s", exc.reason)
            self.abort()
            raise

    def _preallocate(self, *, zero_fill: bool = True) -> None:
        """Check free space and reserve the whole file (the staging file, or on the memory path the output
        file); on the disk path also zero-fill it. Before the first report is written
        (:func:`shuffledp.shuffler.staging.reserve_file`). Raises :class:`Refused` (``disk_full``)."""
        with self.core._alloc_lock:  # check and reserve atomically with respect to other batches
            reserve_file(self.staging_fd, self.core.journal.staging_dir, self.header.expected_count,
                         self.inner_length, zero_fill=zero_fill)

    def request_digest(self) -> bytes:
        """The order-independent digest of this submission: its header and the sorted envelope fingerprints."""
        return request_digest(self.header, self._fingerprints)

    @property
    def room(self) -> int:
        """Envelopes the header's ``expected_count`` still allows (0 once it is reached)."""
        return max(0, self.header.expected_count - self.received)

    def add(self, envelope: bytes) -> None:
        """Process one envelope: verify and stage it, or count why it was dropped (:meth:`add_many` of one)."""
        self.add_many((envelope,))

    def add_many(self, envelopes: Sequence[bytes]) -> None:
        """Process the envelopes of one received message, in order: verify and stage each, or count why it was
        dropped. Their signature checks form one job (inline, or on the verify pool if the job is large enough).
        """
        if self._done:
            raise RuntimeError("batch already finished")
        room = self.room
        self._check_job(*self._decrypt_all(envelopes[:room] if len(envelopes) > room else envelopes))
        if len(envelopes) > room:
            self.received += 1
            self.settle()  # a staging refusal pending behind a signature check takes precedence, as inline
            with self.core._lock:
                self.core.counters["batches_refused"] += 1
            log.info("batch refused: count_mismatch")
            self.abort()
            raise Refused(
                "invalid_argument",
                "count_mismatch",
                f"more envelopes than the header's expected_count {self.header.expected_count}",
            )

    def _decrypt_all(self, envelopes: Sequence[bytes]) -> tuple[list[Any], list[int]]:
        """Count the envelopes in and drop what fails the length checks; return the job and each entry's slot.

        Into the slots (memory path, announced ``envelope_length``): each envelope claims its slot here, in arrival
        order, before it is opened, and the job holds ``(envelope, slot)`` pairs, opened with their signature
        checks (:mod:`shuffledp.shuffler.opening`); one that then does not open leaves a hole, like one dropped
        later. Otherwise
        the outer layer is opened here (a failed open is dropped) and the job holds the decrypted reports, slot -1
        (copied to a slot if accepted)."""
        cfg = self.core.config
        out: list[Any] = []
        slots: list[int] = []
        for envelope in envelopes:
            self.received += 1
            self._fingerprints += envelope_fingerprint(envelope)
            if self.replay_only:
                continue
            if len(envelope) == 0:  # the submitter's placeholder for a report it does not have (keeps the count)
                self.drops["empty"] += 1
            elif len(envelope) > cfg.max_envelope_bytes:
                self.drops["oversized"] += 1
            elif self.header.envelope_length and len(envelope) != self.header.envelope_length:
                self.drops["wrong_length"] += 1
            else:
                if self.inner_length < 0 and len(envelope) >= env.ENVELOPE_OVERHEAD:
                    # Staging starts at the first envelope that passes the public length checks, BEFORE it is
                    # opened or verified: its cost (allocation, zero-fill, a disk_full refusal) must not tell the
                    # submitter whether an envelope verifies. Raises Refused (the builder is then aborted).
                    self._begin_staging(env.inner_length_for(len(envelope)))
                if self._into_slots and self._perm is not None:
                    slot = self._perm[self._claimed]
                    self._claimed += 1
                    out.append((envelope, slot))
                    slots.append(slot)
                    continue
                try:
                    out.append(self._opener.decrypt(envelope))
                    slots.append(-1)
                except env.EnvelopeError as exc:
                    self.drops[exc.reason] += 1
        return out, slots

    def _check_job(self, job: list[Any], slots: list[int]) -> None:
        if not job:
            return
        into = self._into_slots  # fixed at the first staging, before any entry of a job: all pairs, or none
        size = len(job) * (env.OUTER_HEAD_BYTES + self.inner_length) if into else sum(d.size for d in job)
        pool = self.core.verify_pool
        if pool is None or size < PIPELINE_MIN_JOB_BYTES:
            self.settle()  # earlier reports first: acceptance stays in arrival order
            if into:  # the same function as on a worker, here on this thread
                results = open_job(self._opener, self.staging_buffer, self.inner_length, job)  # type: ignore[arg-type] - buf is set on the memory path
            else:
                results = verify_job(self._opener, job)
            self._conclude(results, slots)
            return
        # Pipelined: the job's checks (and the opening of its envelopes into their slots) run on a worker while
        # this thread receives the next messages, several jobs at once with several workers; jobs are concluded in
        # arrival order, so what is accepted, and where, is exactly as inline. Opening on the workers rather than
        # here: submit + fetch of 1,000 x 100 KiB in a median 0.955 of the time per pair (40 alternating pairs,
        # 2 workers, the same CPU seconds); 0.965 at 200 x 1 MiB (20 pairs).
        if into:
            future = pool.submit(open_job, self._opener, self.staging_buffer, self.inner_length, job)
        else:
            future = pool.submit(verify_job, self._opener, job)
        self._pending.append((future, len(job), size, slots))
        self._pending_reports += len(job)
        self._pending_bytes += size
        while self._pending and (
            self._pending[0][0].done()
            or (len(self._pending) > 1
                and (self._pending_reports > PIPELINE_MAX_REPORTS or self._pending_bytes > PIPELINE_MAX_BYTES))
        ):
            self._take_pending()

    def _take_pending(self) -> None:
        """Wait for the oldest pending job and accept or drop its reports."""
        future, n, size, slots = self._pending.popleft()
        self._pending_reports -= n
        self._pending_bytes -= size
        self._conclude(future.result(), slots)

    def _conclude(self, results: list[env.OpenedReport | str], slots: list[int]) -> None:
        """Count a drop for each failed signature check, else accept or drop the verified report, in order
        (``slots``: where each was decrypted into, -1 if nowhere yet)."""
        for result, slot in zip(results, slots, strict=True):
            if isinstance(result, str):
                self.drops[result] += 1
            else:
                self._accept(result, slot)

    def settle(self) -> None:
        """Wait for every signature check in flight and accept or drop its report, in arrival order (no-op when
        checks run inline). :meth:`finish` does this first; callers that inspect the staging state call it."""
        while self._pending:
            self._take_pending()

    def _accept(self, report: env.OpenedReport, placed: int = -1) -> None:
        """Enrolment, replay and one-report-per-signer checks for a verified report, then staging at its slot
        (``placed``: the slot it was decrypted into, else -1 and it is copied to the next claimed slot)."""
        core = self.core
        signer = core.enrolled.index(report.signer_public_key)
        if signer < 0:
            self.drops["unknown_signer"] += 1
            return
        epoch = self.header.key_epoch
        enc, report_id = report.enc, report.report_id
        inner_enc = bytes(report.inner[: env.ENC_BYTES])
        if not report.inner_hash:
            raise RuntimeError("a verified report without its inner hash")  # verify() always sets it
        seen_enc, seen_rid = core._seen_enc.get(epoch), core._seen_rid.get(epoch)
        if (
            self.encs.index(enc) >= 0
            or self.report_ids.index(report_id) >= 0
            or (seen_enc is not None and seen_enc.index(enc) >= 0)
            or (seen_rid is not None and seen_rid.index(report_id) >= 0)
            # an inner ciphertext (or its inner encapsulated key) already accepted in this batch, wrapped again by
            # another enrolled signer: keep the first, so the attested count is one per distinct report. Across
            # batches the inner layer is bound to its round id, so a copy of an earlier round's does not open.
            or self._inner_encs.index(inner_enc) >= 0
        ):
            self.drops["replay"] += 1
            return
        if self._signers[signer]:
            self.drops["duplicate_signer"] += 1
            return
        self._signers[signer] = 1
        self.encs.add(enc)
        self.report_ids.add(report_id)
        self._inner_encs.add(inner_enc)
        inner = report.inner
        if len(inner) != self.inner_length and self.n_accepted == 0 and not self.header.envelope_length:
            self._restage(len(inner))
        self._lengths.add(len(inner))
        if len(inner) == self.inner_length and self._perm is not None and self._slot_hashes is not None:
            slot = placed
            if slot < 0:  # slots are fixed-size: the k-th claim gets slot perm[k], at perm[k] * inner_length
                slot = self._perm[self._claimed]
                self._claimed += 1
                off = slot * self.inner_length
                if self.staging_buffer is not None:
                    self.staging_buffer[off : off + self.inner_length] = inner
                else:
                    pwrite_all(self.staging_fd, inner, off)
            self._accepted_slots.append(slot)
            # through a memoryview: a hash of another length raises instead of resizing the array
            memoryview(self._slot_hashes)[slot * 32 : (slot + 1) * 32] = report.inner_hash
        self.n_accepted += 1

    def finish(self) -> SealedBatch:
        """Check the batch and seal it, or raise :class:`Refused`. Always releases the staging file.

        Refusal messages carry the reason tag and public parameters only, never counts of what was accepted
        (they would be a free probing oracle), and a refused batch's drops are not added to the counters.
        """
        if self._done:
            raise RuntimeError("batch already finished")
        try:
            self.settle()  # a Refused from here (staging could not start) is already counted and aborted
        except BaseException:
            self.abort()
            raise
        core = self.core
        try:
            if self.received != self.header.expected_count:
                raise Refused(
                    "invalid_argument",
                    "count_mismatch",
                    f"received {self.received} envelopes; the header announced {self.header.expected_count}",
                )
            key = (self.header.key_epoch, self.header.round_id)
            with core._commit_lock:  # the binding check and the commit are one step for concurrent batches
                existing = core._by_binding.get(key)
                if existing is not None:
                    if existing.request_digest == self.request_digest():
                        return existing  # identical resubmission: same batch id and attestation
                    raise Refused(
                        "already_exists",
                        "binding_used",
                        f"a different batch was already sealed for key epoch {key[0]}, round {key[1]}",
                    )
                if core._closed:
                    raise Refused("unavailable", "shutting_down", "the shuffler stopped before this batch was sealed")
                if self.replay_only:
                    raise RuntimeError("replay-only builder without a sealed batch")
                if len(self._lengths) > 1:
                    raise Refused(
                        "invalid_argument",
                        "mixed_lengths",
                        "accepted inner ciphertexts differ in length; all reports in a batch must have the same "
                        "length (announce envelope_length in the header to drop odd ones instead)",
                    )
                if self.n_accepted < core.config.k:
                    raise Refused(
                        "failed_precondition",
                        "below_threshold",
                        f"fewer distinct enrolled signers than the release threshold k = {core.config.k}",
                    )
                return core._commit(self)
        except Refused as exc:
            with core._lock:
                core.counters["batches_refused"] += 1
            log.info("batch refused: %s", exc.reason)
            raise
        finally:
            self.abort()

    def abort(self) -> None:
        """Discard the staging buffer and the staging file (idempotent)."""
        if not self._done:
            self._done = True
            self.core._builder_closed()
        for future, _, _, _ in self._pending:
            future.cancel()  # one already running finishes on its own plaintext; nothing reads its result
        self._pending.clear()
        self._pending_reports = 0
        self._pending_bytes = 0
        self._perm = None
        self._slot_hashes = None
        self.release_buffer()
        if self.staging_fd >= 0:
            os.close(self.staging_fd)
            self.staging_fd = -1
        if self.staging_path is not None:
            try:
                self.staging_path.unlink()
            except FileNotFoundError:
                pass
            self.staging_path = None
