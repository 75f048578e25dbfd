"""The shuffler's batch logic, free of any transport (no grpc here).

One batch per (key epoch, round): ``ShufflerCore.begin(header)`` draws a CSPRNG permutation and returns a
:class:`BatchBuilder`; each ``add(envelope)`` opens and verifies one envelope and writes its inner ciphertext
to its permuted slot in a staging file (memory stays O(envelope), not O(batch)); ``finish()`` checks the
batch, fsyncs the permuted output, signs the attestation, appends the commit record to the journal (fsync) and
only then returns.

Duties (see docs/shuffler.md): verify signature, enrolment and binding, and count every drop by reason; at most
one report per enrolled client per round; replay cache on the outer HPKE ``enc`` and on the report id, per key
epoch, persisted in the journal; a binding (key epoch, round) is used once (an identical resubmission returns
the same attestation); at least ``k`` distinct enrolled signers or nothing is released; all accepted inner
ciphertexts the same length or the batch is refused; uniform permutation from ``secrets.SystemRandom``
(Fisher-Yates over ``os.urandom``); the output carries inner ciphertexts only.

Refusals raise :class:`Refused` with a ``code`` the gRPC layer maps to a status code.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import struct
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import x25519

from shuffler import envelope as env
from shuffler.attestation import DROP_REASONS, Attestation, OutputDigest, sign_statement
from shuffler.journal import Journal, fsync_dir

__all__ = ["CoreConfig", "Header", "Refused", "SealedBatch", "ShufflerCore", "BatchBuilder"]

log = logging.getLogger("shuffler.core")

#: Refusal codes (mapped to gRPC status codes in shuffler.service).
REFUSAL_CODES = (
    "invalid_argument",
    "failed_precondition",
    "already_exists",
    "resource_exhausted",
    "not_found",
    "permission_denied",
)


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

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an int >= 1, got {self.k!r}")
        if not isinstance(self.key_epoch, int) or not 0 <= self.key_epoch < 2**32:
            raise ValueError(f"key_epoch must be an int in [0, 2**32), got {self.key_epoch!r}")
        if not isinstance(self.max_envelope_bytes, int) or self.max_envelope_bytes < env.ENVELOPE_OVERHEAD:
            raise ValueError(
                f"max_envelope_bytes must be an int >= {env.ENVELOPE_OVERHEAD}, got {self.max_envelope_bytes!r}"
            )
        if not isinstance(self.max_batch_reports, int) or self.max_batch_reports < 1:
            raise ValueError(f"max_batch_reports must be an int >= 1, got {self.max_batch_reports!r}")
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
    """The submit header: the binding and the number of envelopes that follow."""

    protocol_version: int
    key_epoch: int
    round_id: int
    model_digest: bytes
    expected_count: int


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
    for eh in sorted(envelope_hashes):
        h.update(eh)
    return h.digest()


class ShufflerCore:
    """State shared by all batches: enrolment, replay cache, sealed batches, counters."""

    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        self._by_key = {bytes(pk): cid for cid, pk in config.enrolment.items()}
        self._hpke_sk = x25519.X25519PrivateKey.from_private_bytes(config.hpke_private_key)
        self._lock = threading.Lock()
        self.journal = Journal(config.journal_dir)
        self._sealed: dict[bytes, SealedBatch] = {}
        self._by_binding: dict[tuple[int, int], SealedBatch] = {}
        self._seen_enc: dict[int, set[bytes]] = {}
        self._seen_rid: dict[int, set[bytes]] = {}
        self.counters: Counter[str] = Counter()
        for rec in self.journal.records:
            if rec.get("type") == "batch":
                self._load_record(rec)
        self._rng = secrets.SystemRandom()

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
        self._register(sb, rec["replay_enc"], rec["replay_report_ids"], rec.get("dropped", {}))

    def _register(self, sb: SealedBatch, encs: list[str], rids: list[str], dropped: Mapping[str, int]) -> None:
        self._sealed[sb.batch_id] = sb
        self._by_binding[(sb.key_epoch, sb.round_id)] = sb
        if sb.key_epoch == self.config.key_epoch:  # older epochs' caches are flushed by key rotation
            self._seen_enc.setdefault(sb.key_epoch, set()).update(bytes.fromhex(x) for x in encs)
            self._seen_rid.setdefault(sb.key_epoch, set()).update(bytes.fromhex(x) for x in rids)
        self.counters["batches_sealed"] += 1
        self.counters["reports_accepted"] += sb.n
        for reason, count in dropped.items():
            self.counters[f"dropped:{reason}"] += int(count)

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
        return BatchBuilder(self, header, replay_only=(header.key_epoch, header.round_id) in self._by_binding)

    def _check_header(self, header: Header) -> None:
        if header.protocol_version != env.ENVELOPE_VERSION:
            raise Refused(
                "invalid_argument",
                "protocol_version",
                f"protocol version {header.protocol_version}; this shuffler speaks {env.ENVELOPE_VERSION}",
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

    def _commit(self, builder: "BatchBuilder") -> SealedBatch:
        """Finalise the permuted output, sign, journal. Called with the staging file complete and checks passed.

        The staging file already holds the accepted inner ciphertexts at their permuted slots (see
        :class:`BatchBuilder`); if some envelopes were dropped, the holes are squeezed out here, keeping the
        slot order. The output is fsynced and renamed into ``batches/`` before the commit record is appended.
        """
        header = builder.header
        batch_id = secrets.token_bytes(16)
        n = builder.n_accepted
        inner_length = builder.inner_length
        out_name = f"{batch_id.hex()}.out"
        final = self.journal.batches_dir / out_name
        digest = OutputDigest()
        fd = builder.staging_fd
        builder.wait_writeback()
        occupied = sorted(builder.used_slots())  # output order = slot order
        builder.forget_permutation()
        if len(occupied) == header.expected_count:  # no holes: the staging file is the output
            for slot in occupied:
                chunk = os.pread(fd, inner_length, slot * inner_length)
                if len(chunk) != inner_length:
                    raise RuntimeError("staging file is shorter than expected")
                digest.update(chunk)
            os.fsync(fd)
            source = builder.staging_path
        else:
            source = self.journal.staging_dir / f".{out_name}.tmp"
            with open(source, "wb") as out:
                for slot in occupied:
                    chunk = os.pread(fd, inner_length, slot * inner_length)
                    if len(chunk) != inner_length:
                        raise RuntimeError("staging file is shorter than expected")
                    digest.update(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
        del occupied
        if source is None:
            raise RuntimeError("no staging file")
        os.chmod(source, 0o400)  # a sealed batch never changes
        os.replace(source, final)
        fsync_dir(self.journal.batches_dir)
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
        self._register(sb, encs, rids, dropped)
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
        """The sealed output, one inner ciphertext at a time, in sealed order (the same bytes every time)."""
        sb = self.lookup(batch_id)

        def gen() -> Iterator[bytes]:
            with open(sb.output, "rb") as fh:
                for _ in range(sb.n):
                    chunk = fh.read(sb.inner_length)
                    if len(chunk) != sb.inner_length:
                        raise RuntimeError(f"sealed batch output {sb.output.name} is truncated")
                    yield chunk

        return gen()

    def stats(self) -> dict[str, Any]:
        """Aggregate counters only (never per position or per client)."""
        with self._lock:
            return {
                "batches_sealed": self.counters["batches_sealed"],
                "batches_refused": self.counters["batches_refused"],
                "reports_accepted": self.counters["reports_accepted"],
                "dropped": {r: self.counters[f"dropped:{r}"] for r in DROP_REASONS},
            }

    def close(self) -> None:
        self.journal.close()


class BatchBuilder:
    """One submission in progress. Not thread-safe (one per stream).

    Permute on arrival: at ``begin`` a uniformly random permutation ``perm`` of the ``expected_count`` slots is
    drawn with ``secrets.SystemRandom`` (Fisher-Yates over ``os.urandom``), and the j-th *accepted* inner
    ciphertext is written at slot ``perm[j]`` of the staging file. The output order is the slot order. If all
    envelopes are accepted, the staging file is the output; otherwise the holes are squeezed out, and the
    relative order of ``perm[0..m-1]`` is itself a uniform permutation of the m accepted reports. The
    permutation exists only in memory and is dropped at seal time. Writing in place lets the file's writeback
    (started in the background every ``_WRITEBACK_BYTES``) overlap with receiving, so the fsync before the
    acknowledgement is short.
    """

    _WRITEBACK_BYTES = 64 * 1024 * 1024

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
        self._done = False
        self.staging_fd = -1
        self.staging_path: Path | None = None
        self._perm: list[int] | None = None
        self._unsynced = 0
        self._writeback: threading.Thread | None = None
        if not replay_only:
            self._perm = list(range(header.expected_count))
            core._rng.shuffle(self._perm)
            self.staging_path = core.journal.staging_dir / f"{secrets.token_hex(16)}.stage"
            self.staging_fd = os.open(self.staging_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._opener = env.OuterOpener(
            core._hpke_sk,
            key_epoch=header.key_epoch,
            round_id=header.round_id,
            model_digest=header.model_digest,
        )

    def used_slots(self) -> list[int]:
        if self._perm is None:
            raise RuntimeError("no permutation (replay-only builder or already sealed)")
        return self._perm[: self.n_accepted]

    def forget_permutation(self) -> None:
        self._perm = None

    def _preallocate(self) -> None:
        """Allocate the whole staging file before the first write.

        Without this, the filesystem would allocate disk blocks in write (arrival) order while the logical
        offsets are in output order, and the physical layout of the file would record the permutation.
        Allocating everything up front also fails early, and clearly, when the disk cannot hold the batch.
        """
        size = self.header.expected_count * self.inner_length
        try:
            os.posix_fallocate(self.staging_fd, 0, size)
        except OSError as exc:
            raise Refused(
                "resource_exhausted",
                "disk_full",
                f"cannot allocate {size} bytes for a batch of {self.header.expected_count} reports: {exc.strerror}",
            ) from None

    def _start_writeback(self) -> None:
        if self._writeback is not None and self._writeback.is_alive():
            return
        fd = self.staging_fd
        self._writeback = threading.Thread(target=os.fdatasync, args=(fd,), daemon=True)
        self._writeback.start()

    def wait_writeback(self) -> None:
        if self._writeback is not None:
            self._writeback.join()
            self._writeback = None

    def request_digest(self) -> bytes:
        return _request_digest(self.header, self._envelope_hashes)

    def add(self, envelope: bytes) -> None:
        """Process one envelope: verify and stage it, or count why it was dropped."""
        if self._done:
            raise RuntimeError("batch already finished")
        cfg = self.core.config
        self.received += 1
        if self.received > self.header.expected_count:
            raise Refused(
                "invalid_argument",
                "count_mismatch",
                f"more envelopes than the header's expected_count {self.header.expected_count}",
            )
        self._envelope_hashes.append(envelope_fingerprint(envelope))
        if self.replay_only:
            return
        if len(envelope) > cfg.max_envelope_bytes:
            self.drops["oversized"] += 1
            return
        try:
            report = self._opener.open(envelope)
        except env.EnvelopeError as exc:
            self.drops[exc.reason] += 1
            return
        if report.signer_public_key not in self.core._by_key:
            self.drops["unknown_signer"] += 1
            return
        epoch = self.header.key_epoch
        if (
            report.enc in self.encs
            or report.report_id in self.report_ids
            or report.enc in self.core._seen_enc.get(epoch, ())
            or report.report_id in self.core._seen_rid.get(epoch, ())
        ):
            self.drops["replay"] += 1
            return
        if report.signer_public_key in self._signers:
            self.drops["duplicate_signer"] += 1
            return
        self._signers.add(report.signer_public_key)
        self.encs.add(report.enc)
        self.report_ids.add(report.report_id)
        inner = report.inner
        self._lengths.add(len(inner))
        if self.inner_length < 0:
            self.inner_length = len(inner)
            self._preallocate()
        if len(inner) == self.inner_length and self._perm is not None:
            # slots are fixed-size: the j-th accepted report goes to slot perm[j], at perm[j] * inner_length
            os.pwrite(self.staging_fd, inner, self._perm[self.n_accepted] * self.inner_length)
            self._unsynced += len(inner)
            if self._unsynced >= self._WRITEBACK_BYTES:
                self._unsynced = 0
                self._start_writeback()
        self.n_accepted += 1

    def finish(self) -> SealedBatch:
        """Check the batch and seal it, or raise :class:`Refused`. Always releases the staging file."""
        if self._done:
            raise RuntimeError("batch already finished")
        core = self.core
        try:
            if self.received != self.header.expected_count:
                raise Refused(
                    "invalid_argument",
                    "count_mismatch",
                    f"received {self.received} envelopes; the header announced {self.header.expected_count}",
                )
            key = (self.header.key_epoch, self.header.round_id)
            with core._lock:
                existing = core._by_binding.get(key)
                if existing is not None:
                    if existing.request_digest == self.request_digest():
                        return existing  # identical resubmission: same batch id and attestation
                    raise Refused(
                        "already_exists",
                        "binding_used",
                        f"a different batch was already sealed for key epoch {key[0]}, round {key[1]}",
                    )
                if self.replay_only:
                    raise RuntimeError("replay-only builder without a sealed batch")
                if len(self._lengths) > 1:
                    raise Refused(
                        "invalid_argument",
                        "mixed_lengths",
                        f"accepted inner ciphertexts have {len(self._lengths)} different lengths; "
                        "all reports in a batch must have the same length",
                    )
                n = self.n_accepted
                if n < core.config.k:
                    raise Refused(
                        "failed_precondition",
                        "below_threshold",
                        f"{n} distinct enrolled signers accepted; the release threshold is k = {core.config.k}",
                    )
                return core._commit(self)
        except Refused as exc:
            with core._lock:
                core.counters["batches_refused"] += 1
                for reason, count in self.drops.items():
                    core.counters[f"dropped:{reason}"] += count
            log.info("batch refused: %s (received=%d, dropped=%d)", exc.reason, self.received, sum(self.drops.values()))
            raise
        finally:
            self.abort()

    def abort(self) -> None:
        """Discard the staging file (idempotent)."""
        self._done = True
        self._perm = None
        self.wait_writeback()
        if self.staging_fd >= 0:
            os.close(self.staging_fd)
            self.staging_fd = -1
        if self.staging_path is not None:
            try:
                self.staging_path.unlink()  # already renamed away if the batch was sealed
            except FileNotFoundError:
                pass
            self.staging_path = None
