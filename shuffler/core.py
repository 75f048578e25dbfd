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
accepted inner ciphertexts of different lengths refuse the batch; uniform permutation (Fisher-Yates with
``secrets.randbelow`` over ``os.urandom``); the output carries inner ciphertexts only.

Refusals raise :class:`Refused` with a ``code`` the gRPC layer maps to a status code.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import math
import mmap
import os
import queue
import secrets
import struct
import threading
import time
from array import array
from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import x25519

from shuffledp.shuffler import envelope as env
from shuffledp.shuffler.attestation import DROP_REASONS, Attestation, OutputDigest, sign_statement
from shuffledp.shuffler.journal import Journal, JournalFailed, JournalWriteError, fsync_dir
from shuffledp.shuffler.validation import require_int

__all__ = ["CoreConfig", "Header", "Refused", "SealedBatch", "ShufflerCore", "BatchBuilder", "stages_in_memory"]

log = logging.getLogger("shuffledp.shuffler.core")

#: Refusal codes (mapped to gRPC status codes in shuffledp.shuffler.service).
REFUSAL_CODES = (
    "invalid_argument",
    "failed_precondition",
    "already_exists",
    "resource_exhausted",
    "not_found",
    "permission_denied",
    "unavailable",
)

#: Hard cap on max_batch_reports (the permutation and the replay tags of a batch are held in memory).
MAX_BATCH_REPORTS_CAP = 1_000_000
#: Free space that must remain after a staging file is allocated, for the journal's commit records: a fixed
#: part plus a per-report part (each accepted report adds two hex replay tags, ~100 bytes, to its record).
JOURNAL_HEADROOM_BYTES = 64 * 1024 * 1024
JOURNAL_HEADROOM_PER_REPORT = 256
_ZERO_CHUNK = 1 << 20
#: Default ``staging_memory_limit``: a batch of at most this many bytes (expected_count x inner length) is
#: staged in memory and written to disk once, at seal time; a larger batch is staged in a zero-filled file.
DEFAULT_STAGING_MEMORY_LIMIT = 1024**3
#: Upper bound accepted for ``staging_memory_limit`` (1 TiB).
MAX_STAGING_MEMORY_LIMIT = 1 << 40
#: Bytes per write() when the in-memory batch is written out at seal time.
_WRITE_CHUNK = 64 << 20
#: Alignment of O_DIRECT writes (offset, length, memory): the memory buffer is rounded up to a multiple of it.
_DIRECT_ALIGN = 4096
#: Upper bound accepted for ``verify_threads``.
MAX_VERIFY_THREADS = 64
#: Pipelined signature checks (``verify_threads`` >= 1): the checks of one received message form a job. After
#: handing a job to the pool, a submit waits for the oldest jobs until at most this many reports and bytes of
#: plaintext are in flight, or a single job (one message: at most the service's message limit,
#: ``max(max_envelope_bytes, wire.PACKED_MESSAGE_BYTES)`` plus framing).
PIPELINE_MAX_REPORTS = 16
PIPELINE_MAX_BYTES = 32 << 20
#: A job with less plaintext is checked inline even with ``verify_threads`` >= 1: handing it to a worker and
#: taking the GIL back costs more than the overlap saves for a small job. Measured over mTLS with
#: bench_shuffler (1,000 x 100 KiB, packed two per message, three alternating pairs): with the threshold at
#: 192 KiB (those pairs pipelined) the shuffler spent 0.42-0.46 CPU-s per submit against 0.35-0.37 at 256 KiB
#: (checked inline), and submit took 0.41-0.45 s against 0.35-0.37 s. One 1 MiB envelope per job gains (submit
#: medians 1.62-1.73 s pipelined against 1.77-1.87 s inline). The ServerApp packs 100 KiB envelopes ten to a
#: 1 MiB message, so those jobs are pipelined: neutral (submit + fetch 245-282 MB/s inline against 245-256
#: pipelined, three alternating invocations).
PIPELINE_MIN_JOB_BYTES = 256 << 10
#: errnos that mean "no space": a rolled-back commit with one of these is reported as disk_full
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class Refused(Exception):
    """A request the shuffler refuses. ``code`` is one of REFUSAL_CODES; ``reason`` a short machine tag."""

    def __init__(self, code: str, reason: str, message: str) -> None:
        if code not in REFUSAL_CODES:
            raise ValueError(f"unknown refusal code {code!r}")
        super().__init__(message)
        self.code = code
        self.reason = reason


@dataclass(frozen=True)
class CoreConfig:
    """What the core needs. Keys are raw bytes; ``enrolment`` maps client id -> Ed25519 public key."""

    key_epoch: int
    k: int
    hpke_private_key: bytes
    signing_private_key: bytes
    enrolment: Mapping[str, bytes]
    journal_dir: Path
    max_envelope_bytes: int
    max_batch_reports: int = 100_000
    staging_memory_limit: int = DEFAULT_STAGING_MEMORY_LIMIT
    #: keep the memory path's staging buffer mapped after a sealed batch and reuse it for the next one (see
    #: ShufflerCore.take_buffer): idle memory up to staging_memory_limit, in exchange for not faulting in fresh
    #: pages for every batch (on this project's VM that is most of the memory path's cost)
    retain_staging_buffer: bool = True
    #: worker threads that check report signatures (the hash of the inner ciphertext, then Ed25519; both release
    #: the GIL) while the submitting thread receives and decrypts the next envelopes; 0 checks them inline
    verify_threads: int = 1

    def __post_init__(self) -> None:
        require_int("verify_threads", self.verify_threads, 0, MAX_VERIFY_THREADS)
        if not isinstance(self.retain_staging_buffer, bool):
            raise ValueError(f"retain_staging_buffer must be a bool, got {self.retain_staging_buffer!r}")
        require_int("staging_memory_limit", self.staging_memory_limit, 0, MAX_STAGING_MEMORY_LIMIT)
        require_int("k", self.k, 1)
        require_int("key_epoch", self.key_epoch, 0, 2**32 - 1)
        require_int("max_envelope_bytes", self.max_envelope_bytes, env.ENVELOPE_OVERHEAD)
        require_int("max_batch_reports", self.max_batch_reports, 1, MAX_BATCH_REPORTS_CAP)
        if len(self.hpke_private_key) != 32 or len(self.signing_private_key) != 32:
            raise ValueError("hpke_private_key and signing_private_key must be 32 raw bytes each")
        if not self.enrolment:
            raise ValueError("the enrolment is empty: no client could ever be accepted")
        if self.k > len(self.enrolment):
            raise ValueError(
                f"k = {self.k} exceeds the {len(self.enrolment)} enrolled clients: no batch could ever be released"
            )


@dataclass(frozen=True)
class Header:
    """The submit header: the binding and the number of envelopes that follow.

    ``envelope_length`` (0 = not given, legacy) is the length every envelope of the round has; an envelope of
    another length is then a counted drop (``wrong_length``) instead of refusing the whole batch.
    """

    protocol_version: int
    key_epoch: int
    round_id: int
    model_digest: bytes
    expected_count: int
    envelope_length: int = 0


@dataclass(frozen=True)
class SealedBatch:
    """A committed batch: its id, signed statement and where its output lives."""

    batch_id: bytes
    statement: bytes
    signature: bytes
    key_epoch: int
    round_id: int
    request_digest: bytes
    output: Path
    n: int
    inner_length: int


def envelope_fingerprint(envelope: bytes) -> bytes:
    """Identifies an envelope for idempotent resubmission: SHA-256 of its length, first 37 bytes (prefix and
    HPKE enc) and last 16 (AEAD tag).

    For an envelope that opens, enc and tag determine it (a second ciphertext with the same enc and a valid tag
    would be an AEAD forgery). A resubmission that merely matches fingerprints gets back the attestation the
    server already holds and nothing new, so a collision gains nothing. Hashing 53 bytes instead of the whole
    envelope keeps submit transport-bound.
    """
    h = hashlib.sha256(struct.pack(">Q", len(envelope)))
    h.update(envelope[:37])
    h.update(envelope[-16:] if len(envelope) >= 16 else b"")
    return h.digest()


def _request_digest(header: Header, envelope_hashes: list[bytes]) -> bytes:
    """Order-independent digest of a submission: the header and the sorted envelope fingerprints."""
    h = hashlib.sha256(b"shuffledp/request/v1")
    h.update(
        struct.pack(">BIQI", header.protocol_version, header.key_epoch, header.round_id, header.expected_count)
    )
    h.update(header.model_digest)
    if header.envelope_length:  # absent from legacy digests, so they stay valid
        h.update(struct.pack(">Q", header.envelope_length))
    for eh in sorted(envelope_hashes):
        h.update(eh)
    return h.digest()


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (asm-generic/mman-common.h); Python 3.11's mmap does not name it


def _prefault(buf: mmap.mmap) -> None:
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
    zeros = bytes(min(_ZERO_CHUNK, len(buf)))
    with memoryview(buf) as mv:
        for off in range(0, len(mv), len(zeros)):
            end = min(off + len(zeros), len(mv))
            mv[off:end] = zeros[: end - off]


def _round_up(size: int) -> int:
    return -(-size // _DIRECT_ALIGN) * _DIRECT_ALIGN


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset``: a short write is continued, never ignored; no progress is EIO."""
    with memoryview(data) as view:
        done = 0
        while done < len(view):
            wrote = os.pwrite(fd, view[done : done + _WRITE_CHUNK], offset + done)
            if wrote <= 0:
                raise OSError(errno.EIO, "write made no progress")
            done += wrote


def _write_out(fd: int, path: Path, mv: memoryview, total: int) -> None:
    """Write ``mv[:total]`` to the start of the (reserved, still empty) output file, front to back.

    Uses ``O_DIRECT`` where the filesystem supports it: the batch goes from the buffer to the device without a
    second copy in the page cache (and without allocating one: on a VM that is most of the cost of a buffered
    write). The write is rounded up to the alignment; the rounding tail is zeroed first (it would otherwise
    hold stale slot bytes) and cut off by the caller's ``ftruncate``. Where ``O_DIRECT`` is refused (tmpfs,
    some network filesystems: EINVAL) the same bytes are written through the page cache. Durability comes from
    the caller's ``fsync`` on ``fd`` in both cases.
    """
    aligned = _round_up(total)
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
                if written <= 0 or (written % _DIRECT_ALIGN and pos + written < aligned):
                    raise OSError(errno.EIO, "direct output write made no progress or was misaligned")
                pos += written
        finally:
            os.close(direct_fd)
        if pos >= aligned:
            return
    if pos < total:
        _pwrite_all(fd, mv[pos:total], pos)


#: Bytes per ``O_DIRECT`` read when a sealed output is fetched (one page-aligned buffer per fetch).
_READ_CHUNK = 8 << 20


def _read_output(path: Path, n: int, inner_length: int) -> Iterator[bytes]:
    """The ``n`` items of ``inner_length`` bytes in a sealed output file, in order.

    Read with ``O_DIRECT`` where the filesystem allows it: the output (written with ``O_DIRECT`` on the memory
    path, so not cached) then does not have to be brought into fresh page-cache pages first, which on a VM is
    most of the cost of a buffered read. A reader thread fills two page-aligned buffers in turn
    (:class:`_DirectReader`), so the device read of the next chunk overlaps the sending of this one. Where
    ``O_DIRECT`` is refused (EINVAL on open or on the first read: tmpfs, some network filesystems) the file is
    read through the page cache. Raises RuntimeError if the file is shorter than ``n * inner_length``.
    """
    fd = -1
    if hasattr(os, "O_DIRECT") and n > 0:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    if fd < 0:
        yield from _read_output_buffered(path, n, inner_length)
        return
    produced = 0
    try:
        reader = _DirectReader(fd, n * inner_length)
    except BaseException:
        os.close(fd)
        raise
    try:
        carry = bytearray()
        for buf, got in reader:
            with memoryview(buf) as whole:
                i = 0
                if carry:
                    need = min(inner_length - len(carry), got)
                    carry += whole[:need]
                    i = need
                    if len(carry) == inner_length:
                        yield bytes(carry)
                        produced += 1
                        carry.clear()
                while produced < n and i + inner_length <= got:
                    yield bytes(whole[i : i + inner_length])
                    i += inner_length
                    produced += 1
                if produced < n and i < got:
                    carry += whole[i:got]
            reader.done_with(buf)
            if produced == n:
                break
        if produced < n and not reader.refused:
            raise RuntimeError(f"sealed batch output {path.name} is truncated")
    finally:
        reader.close()
        os.close(fd)
    if reader.refused:  # O_DIRECT reads refused at the first read: nothing was yielded
        yield from _read_output_buffered(path, n, inner_length)


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
                self._bufs.append(mmap.mmap(-1, _READ_CHUNK))
                self._free.put(self._bufs[-1])
            self._thread = threading.Thread(target=self._run, name="shuffler-fetch-read", daemon=True)
            self._thread.start()
        except BaseException:
            for b in self._bufs:
                b.close()
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
            b.close()


def _read_output_buffered(path: Path, n: int, inner_length: int) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        for _ in range(n):
            chunk = fh.read(inner_length)
            if len(chunk) != inner_length:
                raise RuntimeError(f"sealed batch output {path.name} is truncated")
            yield chunk


def stages_in_memory(expected_count: int, inner_length: int, staging_memory_limit: int) -> bool:
    """The staging path of a batch, a function of public sizes only: memory iff ``expected_count *
    inner_length <= staging_memory_limit`` (``inner_length = envelope_length - 166`` when the header announces
    ``envelope_length``, else the length of the first envelope that passes the length checks, minus 166). Never
    depends on load: a batch that cannot get its memory is refused (``staging_memory``), it does not fall back
    to disk."""
    return expected_count * inner_length <= staging_memory_limit


class ShufflerCore:
    """State shared by all batches: enrolment, replay cache, sealed batches, counters."""

    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        self._by_key = {bytes(pk): cid for cid, pk in config.enrolment.items()}
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
        self.journal = Journal(config.journal_dir)
        #: called (no arguments) once if the journal fails for good; the service turns health NOT_SERVING
        self.on_unhealthy: list[Any] = []
        self._sealed: dict[bytes, SealedBatch] = {}
        self._by_binding: dict[tuple[int, int], SealedBatch] = {}
        self._seen_enc: dict[int, set[bytes]] = {}
        self._seen_rid: dict[int, set[bytes]] = {}
        self.counters: Counter[str] = Counter()
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
        #: runs BatchBuilder's signature checks off the submitting thread (None: config.verify_threads == 0)
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
        self._register(
            sb,
            {bytes.fromhex(x) for x in rec["replay_enc"]},
            {bytes.fromhex(x) for x in rec["replay_report_ids"]},
            rec.get("dropped", {}),
        )

    def _register(self, sb: SealedBatch, encs: set[bytes], rids: set[bytes], dropped: Mapping[str, int]) -> None:
        """Make a sealed batch known (replay cache, binding, counters). Cheap: a commit calls it holding _lock."""
        self._sealed[sb.batch_id] = sb
        self._by_binding[(sb.key_epoch, sb.round_id)] = sb
        if sb.key_epoch == self.config.key_epoch:  # older epochs' caches are flushed by key rotation
            self._seen_enc.setdefault(sb.key_epoch, set()).update(encs)
            self._seen_rid.setdefault(sb.key_epoch, set()).update(rids)
        self.counters["batches_sealed"] += 1
        self.counters["reports_accepted"] += sb.n
        for reason, count in dropped.items():
            self.counters[f"dropped:{reason}"] += int(count)

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
        """Finalise the permuted output, sign, journal. Called with the staging complete and checks passed.

        The staging buffer (memory path) or staging file (disk path) already holds the accepted inner
        ciphertexts at their permuted slots (see :class:`BatchBuilder`); if some envelopes were dropped, the
        holes are squeezed out here, keeping the slot order. On the memory path the output file is then written
        once, in output order; on the disk path the staging file becomes the output. Either way the output is
        fsynced and renamed into ``batches/`` before the commit record is appended.
        """
        if self.journal.failed:
            # A batch that was open when the journal failed must not add a second output without a record
            # (journal.Journal refuses to start beside more than one).
            raise Refused("unavailable", "journal_failed", "the shuffler's journal failed; it accepts no batches")
        header = builder.header
        batch_id = secrets.token_bytes(16)
        n = builder.n_accepted
        inner_length = builder.inner_length
        out_name = f"{batch_id.hex()}.out"
        final = self.journal.batches_dir / out_name
        digest = OutputDigest.for_protocol(header.protocol_version)
        fd = builder.staging_fd
        source = builder.staging_path
        if source is None or fd < 0:
            raise RuntimeError("no staging file")
        occupied = sorted(builder.used_slots())  # output order = slot order
        # The output digest comes from the hash of each inner ciphertext (BLAKE3, or SHA-256 for a protocol-1
        # batch), computed when its signature was checked and kept at its slot (shuffledp.shuffler.attestation, formats
        # v3 and v2): no report byte is read again here.
        hashes = builder.slot_hashes
        for slot in occupied:
            digest.update_hashed(inner_length, hashes[slot * 32 : (slot + 1) * 32])
        builder.forget_permutation()
        buf = builder.staging_buffer
        if buf is not None:
            # Memory path: squeeze the holes out in the buffer (the i-th occupied slot moves to position
            # i <= slot, so a slot is read before anything is written over it), then write the output once, in
            # offset order, into the file that was reserved (posix_fallocate) when the first report arrived.
            with memoryview(buf) as mv:
                for i, slot in enumerate(occupied):
                    if slot != i:
                        mv[i * inner_length : (i + 1) * inner_length] = mv[
                            slot * inner_length : (slot + 1) * inner_length
                        ]
                del occupied
                _write_out(fd, source, mv, n * inner_length)
            builder.release_buffer(retain=True)  # the batch now exists in the output file (and, if retained,
            # in the spare buffer until the next batch overwrites it; see take_buffer)
        else:
            # Disk path: squeeze out the holes in place in the staging file, same order argument as above (with
            # no holes, nothing moves and nothing is read). No second copy of the batch is needed on disk.
            for i, slot in enumerate(occupied):
                if slot == i:
                    continue
                chunk = os.pread(fd, inner_length, slot * inner_length)
                if len(chunk) != inner_length:
                    raise RuntimeError("staging file is shorter than expected")
                _pwrite_all(fd, chunk, i * inner_length)
            del occupied
        os.ftruncate(fd, n * inner_length)
        os.fchmod(fd, 0o400)  # a sealed batch never changes
        os.fsync(fd)  # data, size and mode durable before the rename
        os.replace(source, final)
        builder.staging_path = None
        try:  # until the record is durable the output is not a batch: a failure removes it
            fsync_dir(self.journal.batches_dir)
            fsync_dir(self.journal.staging_dir)
            dropped = {r: builder.drops.get(r, 0) for r in DROP_REASONS}
            statement = Attestation.build_statement(
                batch_id=batch_id,
                protocol_version=header.protocol_version,
                key_epoch=header.key_epoch,
                round_id=header.round_id,
                model_digest=header.model_digest,
                k=self.config.k,
                n_received=builder.received,
                n_accepted=n,
                inner_length=inner_length,
                output_digest=digest.digest(),
                dropped=dropped,
                envelope_length=header.envelope_length,
            )
            signature = sign_statement(statement, self.config.signing_private_key)
            encs = sorted(e.hex() for e in builder.encs)
            rids = sorted(r.hex() for r in builder.report_ids)
            request_digest = builder.request_digest()
            record = {
                "type": "batch",
                "batch_id": batch_id.hex(),
                "key_epoch": header.key_epoch,
                "round_id": header.round_id,
                "request_digest": request_digest.hex(),
                "statement": statement.decode(),
                "signature": signature.hex(),
                "output": out_name,
                "n": n,
                "inner_length": inner_length,
                "replay_enc": encs,
                "replay_report_ids": rids,
                "dropped": dropped,
            }
            self.journal.append(record)  # the commit point: durable before anyone is told
        except JournalFailed:
            # unknown state: keep the output (quarantined at the next start) and stop accepting batches
            self._mark_unhealthy()
            raise Refused(
                "unavailable", "journal_failed", "the shuffler's journal failed; it accepts no batches"
            ) from None
        except BaseException as exc:
            # Nothing was committed and nobody was told (a rolled-back append, or a failure before it): the output
            # is not a batch and must not stay in batches/ without a record (a crash leaves at most one such).
            final.unlink(missing_ok=True)
            try:
                fsync_dir(self.journal.batches_dir)
            except OSError:
                pass
            if isinstance(exc, JournalWriteError):
                log.error("batch not committed: the journal append failed and was rolled back (%s)", exc.strerror)
            raise  # a JournalWriteError is an OSError; the service maps a full disk to RESOURCE_EXHAUSTED disk_full
        sb = SealedBatch(
            batch_id=batch_id,
            statement=statement,
            signature=signature,
            key_epoch=header.key_epoch,
            round_id=header.round_id,
            request_digest=request_digest,
            output=final,
            n=n,
            inner_length=inner_length,
        )
        with self._lock:
            self._register(sb, builder.encs, builder.report_ids, dropped)
        log.info(
            "batch sealed: epoch=%d round=%d received=%d accepted=%d dropped=%s",
            header.key_epoch,
            header.round_id,
            builder.received,
            n,
            {r: c for r, c in dropped.items() if c},
        )
        return sb

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
        """The sealed output, one inner ciphertext at a time, in sealed order (the same bytes every time).

        The first read of a batch is put on record first (:meth:`record_release`): nothing of a batch leaves
        the shuffler before its release record is durable. Raises :class:`Refused` (not_found, invalid_argument,
        or as :meth:`record_release`).
        """
        sb = self.lookup(batch_id)
        self.record_release(sb)
        return _read_output(sb.output, sb.n, sb.inner_length)

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
            buf, self._spare_buffer = self._spare_buffer, None
        if buf is not None and len(buf) < size:
            buf.close()
            buf = None
        return buf

    def give_back_buffer(self, buf: mmap.mmap) -> None:
        """Retain a sealed batch's staging buffer for the next batch (``retain_staging_buffer``), keeping the
        larger one if a spare exists already; unmap what is not kept."""
        if buf.closed:
            return
        if not self.config.retain_staging_buffer:
            buf.close()
            return
        with self._spare_lock:
            spare = self._spare_buffer
            if spare is None or len(spare) < len(buf):
                self._spare_buffer, buf = buf, spare  # type: ignore[assignment] - spare may be None
        if buf is not None:
            buf.close()

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
        if spare is not None:
            spare.close()
        with self._commit_lock, self._lock:  # not during a commit; a later commit sees _closed and is refused
            self._closed = True
            self.journal.close()
        return drained


class BatchBuilder:
    """One submission in progress. Not thread-safe (one per stream).

    Permute on arrival: when the first report is accepted, a uniformly random permutation ``perm`` of the
    ``expected_count`` slots is drawn (Fisher-Yates with ``secrets.randbelow``, over ``os.urandom``) and kept
    compactly as an ``array('I')``; the j-th *accepted* inner ciphertext is written at slot ``perm[j]`` of the
    staging file. The output order is the slot order. If some envelopes were dropped, the holes are squeezed
    out at seal time, and the relative order of ``perm[0..m-1]`` is itself a uniform permutation of the m
    accepted reports. The permutation exists only in memory and is dropped at seal time.

    Where the slots live is a deterministic function of the batch size, ``expected_count * inner_length``
    (:func:`stages_in_memory`): up to ``staging_memory_limit`` bytes, in one anonymous ``mmap`` buffer (memory
    path), and the output file is written once, in output order, at seal time; above it, in a staging file
    that is allocated and zero-filled in offset order (in the page cache, not synced) before the first report is
    written, so that any writeback lays the blocks out in offset order, never in arrival order (disk path; see
    ``_preallocate``). On both paths free space for the whole batch (plus the journal reserve) is checked and
    reserved with ``posix_fallocate`` when the first report is accepted; there is no sync during the batch,
    only the one before the commit. Each accepted report's inner hash (computed for its signature check) is kept
    at its slot, 32 bytes per slot, so that the output digest needs no second pass over the reports.

    Signature checks are done per job: the envelopes of one received message (:meth:`add_many`; :meth:`add`
    is a job of one). Each envelope is decrypted on the calling thread. With ``verify_threads`` >= 1, a job of
    at least ``PIPELINE_MIN_JOB_BYTES`` of plaintext has its signature checks (inner hash + Ed25519, GIL-free)
    done on the core's verify pool; jobs are concluded oldest first, and everything after the check (enrolment,
    replay, one report per signer, the slot) happens on the calling thread in arrival order, exactly as with
    inline checks. A report is therefore staged in its own call if its job is already done, or a few messages
    later, or in :meth:`finish`; :meth:`settle` waits for all. The pool is the core's, shared by concurrent
    submits.
    """

    def __init__(self, core: ShufflerCore, header: Header, *, replay_only: bool) -> None:
        self.core = core
        self.header = header
        self.replay_only = replay_only
        self.received = 0
        self.n_accepted = 0
        self.drops: Counter[str] = Counter()
        self._envelope_hashes: list[bytes] = []
        self.inner_length = -1
        self._lengths: set[int] = set()
        self._signers: set[bytes] = set()
        self.encs: set[bytes] = set()
        self.report_ids: set[bytes] = set()
        #: the accepted inner ciphertexts' hashes and inner HPKE encapsulated keys: two enrolled signers wrapping
        #: one inner ciphertext would be counted as two reports (the copy as cover) for one report the server opens
        self._inner_hashes: set[bytes] = set()
        self._inner_encs: set[bytes] = set()
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
        #: signature-check jobs in flight on the core's verify pool, oldest first: (future, reports, bytes)
        self._pending: deque[tuple[Future[list[env.OpenedReport | str]], int, int]] = deque()
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
        """A uniformly random permutation of ``range(n)`` as ``array('I')``: Fisher-Yates over a CSPRNG."""
        perm = array("I", range(n))
        for i in range(n - 1, 0, -1):
            j = secrets.randbelow(i + 1)
            perm[i], perm[j] = perm[j], perm[i]
        return perm

    def used_slots(self) -> list[int]:
        """The slots of the accepted reports, in acceptance order (raises once the permutation is gone)."""
        if self._perm is None:
            raise RuntimeError("no permutation (replay-only builder, nothing accepted, or already sealed)")
        return list(self._perm[: self.n_accepted])

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
            buf.close()

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
                try:
                    # the retained buffer of an earlier batch if it is large enough, else a fresh anonymous,
                    # private mapping (zero pages until written; never backed by a file)
                    retained = self.core.take_buffer(_round_up(size))
                    buf = retained or mmap.mmap(-1, _round_up(size), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                except (OSError, MemoryError, OverflowError) as exc:
                    raise Refused(
                        "resource_exhausted",
                        "staging_memory",
                        f"cannot allocate {size} bytes of staging memory for a batch of "
                        f"{self.header.expected_count} reports ({type(exc).__name__}); retry later",
                    ) from None
                self.staging_buffer = buf
                # MADV_DONTDUMP: keep reports and their slot layout out of core dumps. MADV_HUGEPAGE: 512x fewer
                # page faults while the buffer fills (best effort; both are advice only).
                for advice in ("MADV_DONTDUMP", "MADV_HUGEPAGE"):
                    if hasattr(mmap, advice):
                        try:
                            buf.madvise(getattr(mmap, advice))
                        except OSError:
                            pass
                if retained is None:
                    try:
                        _prefault(buf)
                    except (OSError, MemoryError) as exc:
                        raise Refused(
                            "resource_exhausted",
                            "staging_memory",
                            f"cannot fault in {size} bytes of staging memory for a batch of "
                            f"{self.header.expected_count} reports ({type(exc).__name__}); retry later",
                        ) from None
            self._preallocate(zero_fill=not self.in_memory)
        except Refused as exc:
            with self.core._lock:
                self.core.counters["batches_refused"] += 1
            log.info("batch refused: %s", exc.reason)
            self.abort()
            raise

    def _preallocate(self, *, zero_fill: bool = True) -> None:
        """Check free space and reserve the whole file (the staging file, or on the memory path the output
        file); on the disk path also zero-fill it. Before the first report is written.

        The free-space check keeps a reserve for the journal, so that concurrent batches cannot fill the disk
        and make a commit record fail. Zero-filling in offset order dirties every page of the file before any
        report arrives, so whenever the kernel writes pages back (at the commit's fsync, or earlier under
        memory pressure or the dirty-page expiry) it writes all of them, in (cyclic) offset order: the filesystem
        converts ``posix_fallocate``'s unwritten extents in that order, not in arrival order, and reports
        later only overwrite blocks already laid out. Without the zero-fill, an early writeback would convert
        just the slots filled so far and the layout could record part of the permutation. The zeros are not
        synced: nothing needs them on disk (a staging file is discarded after a crash), and a sync here would
        write the whole batch to disk twice. The memory path writes nothing before seal (the output is then
        written once, in output order), so it only reserves the space.
        """
        size = self.header.expected_count * self.inner_length
        need = size + JOURNAL_HEADROOM_BYTES + JOURNAL_HEADROOM_PER_REPORT * self.header.expected_count
        with self.core._alloc_lock:  # check and reserve atomically with respect to other batches
            st = os.statvfs(self.core.journal.staging_dir)
            free = st.f_bavail * st.f_frsize
            if free < need:
                raise Refused(
                    "resource_exhausted",
                    "disk_full",
                    f"a batch of {self.header.expected_count} reports needs {need} bytes with the journal "
                    "reserve; not enough is free",  # the host's free space is not the submitter's business
                )
            try:
                os.posix_fallocate(self.staging_fd, 0, size)
            except OSError as exc:
                raise Refused(
                    "resource_exhausted",
                    "disk_full",
                    f"cannot allocate {size} bytes for a batch of {self.header.expected_count} reports: "
                    f"{exc.strerror}",
                ) from None
        if not zero_fill:
            return
        zeros = memoryview(bytes(min(_ZERO_CHUNK, size)))
        try:
            for pos in range(0, size, _ZERO_CHUNK):
                _pwrite_all(self.staging_fd, zeros[: min(len(zeros), size - pos)], pos)
        except OSError as exc:
            raise Refused(
                "resource_exhausted", "disk_full", f"cannot write the staging file: {exc.strerror}"
            ) from None

    def request_digest(self) -> bytes:
        """The order-independent digest of this submission: its header and the sorted envelope fingerprints."""
        return _request_digest(self.header, self._envelope_hashes)

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
        self._check_job(self._decrypt_all(envelopes[:room] if len(envelopes) > room else envelopes))
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

    def _decrypt_all(self, envelopes: Sequence[bytes]) -> list[env.DecryptedReport]:
        """Count the envelopes in, drop what fails the length checks or the outer HPKE open, return the rest."""
        cfg = self.core.config
        out: list[env.DecryptedReport] = []
        for envelope in envelopes:
            self.received += 1
            self._envelope_hashes.append(envelope_fingerprint(envelope))
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
                try:
                    out.append(self._opener.decrypt(envelope))
                except env.EnvelopeError as exc:
                    self.drops[exc.reason] += 1
        return out

    def _verify_job(self, job: list[env.DecryptedReport]) -> list[env.OpenedReport | str]:
        """The signature checks of one job, in order: the verified report, or the drop reason of a failed check
        (a string, not the exception, whose traceback would keep this frame and the job's plaintexts alive until
        the cyclic garbage collector runs). Anything other than an
        :class:`~shuffledp.shuffler.envelope.EnvelopeError` is a bug and propagates."""
        results: list[env.OpenedReport | str] = []
        for decrypted in job:
            try:
                results.append(self._opener.verify(decrypted))
            except env.EnvelopeError as exc:
                results.append(exc.reason)
        return results

    def _check_job(self, job: list[env.DecryptedReport]) -> None:
        if not job:
            return
        size = sum(len(d.outer_plaintext) for d in job)
        pool = self.core.verify_pool
        if pool is None or size < PIPELINE_MIN_JOB_BYTES:
            self.settle()  # earlier reports first: acceptance stays in arrival order
            self._conclude(self._verify_job(job))
            return
        # Pipelined: the job's signature checks run on a worker while this thread receives and decrypts the next
        # messages; jobs are concluded in arrival order, so what is accepted, and where, is exactly as inline.
        self._pending.append((pool.submit(self._verify_job, job), len(job), size))
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
        future, n, size = self._pending.popleft()
        self._pending_reports -= n
        self._pending_bytes -= size
        self._conclude(future.result())

    def _conclude(self, results: list[env.OpenedReport | str]) -> None:
        """Count a drop for each failed signature check, else accept or drop the verified report, in order."""
        for result in results:
            if isinstance(result, str):
                self.drops[result] += 1
            else:
                self._accept(result)

    def settle(self) -> None:
        """Wait for every signature check in flight and accept or drop its report, in arrival order (no-op when
        checks run inline). :meth:`finish` does this first; callers that inspect the staging state call it."""
        while self._pending:
            self._take_pending()

    def _accept(self, report: env.OpenedReport) -> None:
        """Enrolment, replay and one-report-per-signer checks for a verified report, then staging at its slot."""
        if report.signer_public_key not in self.core._by_key:
            self.drops["unknown_signer"] += 1
            return
        epoch = self.header.key_epoch
        inner_enc = bytes(report.inner[: env.ENC_BYTES])
        if not report.inner_hash:
            raise RuntimeError("a verified report without its inner hash")  # verify() always sets it
        if (
            report.enc in self.encs
            or report.report_id in self.report_ids
            or report.enc in self.core._seen_enc.get(epoch, ())
            or report.report_id in self.core._seen_rid.get(epoch, ())
            # an inner ciphertext (or its inner encapsulated key) already accepted in this batch, wrapped again by
            # another enrolled signer: keep the first, so the attested count is one per distinct report. Across
            # batches the inner layer is bound to its round id, so a copy of an earlier round's does not open.
            or report.inner_hash in self._inner_hashes
            or inner_enc in self._inner_encs
        ):
            self.drops["replay"] += 1
            return
        if report.signer_public_key in self._signers:
            self.drops["duplicate_signer"] += 1
            return
        self._signers.add(report.signer_public_key)
        self.encs.add(report.enc)
        self.report_ids.add(report.report_id)
        self._inner_hashes.add(report.inner_hash)
        self._inner_encs.add(inner_enc)
        inner = report.inner
        if len(inner) != self.inner_length and self.n_accepted == 0 and not self.header.envelope_length:
            self._restage(len(inner))
        self._lengths.add(len(inner))
        if len(inner) == self.inner_length and self._perm is not None and self._slot_hashes is not None:
            # slots are fixed-size: the j-th accepted report goes to slot perm[j], at perm[j] * inner_length
            slot = self._perm[self.n_accepted]
            off = slot * self.inner_length
            if self.staging_buffer is not None:
                self.staging_buffer[off : off + self.inner_length] = inner
            else:
                _pwrite_all(self.staging_fd, inner, off)
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
        for future, _, _ in self._pending:
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
