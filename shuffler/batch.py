"""The shuffler's batch vocabulary, shared by the core (:mod:`shuffledp.shuffler.core`) and the builder
(:mod:`shuffledp.shuffler.builder`): refusals, the core's configuration, the submit header, a sealed batch, the limits,
and the two digests that identify a submission (the envelope fingerprint and the order-independent request digest).
"""

from __future__ import annotations

import errno
import hashlib
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shuffledp.shuffler import envelope as env
from shuffledp.shuffler.config import (
    DEFAULT_STAGING_MEMORY_LIMIT,
    MAX_STAGING_MEMORY_LIMIT,
    MAX_VERIFY_THREADS,
    default_verify_threads,
)
from shuffledp.shuffler.tags import sorted_packed
from shuffledp.shuffler.validation import require_int

__all__ = [
    "CoreConfig", "Header", "Refused", "SealedBatch", "REFUSAL_CODES", "MAX_BATCH_REPORTS_CAP",
    "JOURNAL_HEADROOM_BYTES", "JOURNAL_HEADROOM_PER_REPORT", "DEFAULT_STAGING_MEMORY_LIMIT",
    "MAX_STAGING_MEMORY_LIMIT", "MAX_VERIFY_THREADS", "DEFAULT_VERIFY_THREADS", "PIPELINE_MAX_REPORTS",
    "PIPELINE_MAX_BYTES",
    "PIPELINE_MIN_JOB_BYTES", "DISK_FULL_ERRNOS", "envelope_fingerprint", "request_digest",
]

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

#: Hard cap on max_batch_reports (the permutation, slot hashes and replay tags of a batch are held in memory, as
#: compact arrays: about 170 bytes per report).
MAX_BATCH_REPORTS_CAP = 1_000_000
#: Free space that must remain after a staging file is allocated, for the journal's commit records: a fixed
#: part plus a per-report part (each accepted report adds two hex replay tags, ~100 bytes, to its record).
JOURNAL_HEADROOM_BYTES = 64 * 1024 * 1024
JOURNAL_HEADROOM_PER_REPORT = 256
#: The default verify_threads (:func:`shuffledp.shuffler.config.default_verify_threads`)
DEFAULT_VERIFY_THREADS = default_verify_threads()
#: Pipelined signature checks (``verify_threads`` >= 1): the checks of one received message form a job. After
#: handing a job to the pool, a submit waits for the oldest jobs until at most this many reports and bytes of
#: plaintext are in flight, or a single job (one message: at most the service's message limit,
#: ``max(max_envelope_bytes, wire.PACKED_MESSAGE_BYTES)`` plus framing). 32 reports: three messages of ten
#: 100 KiB envelopes, so that two workers opening them always have the next job at hand.
PIPELINE_MAX_REPORTS = 32
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
    #: worker threads that check report signatures (Ed25519 and the hash of the inner ciphertext, both GIL-free)
    #: and, on the memory path with an announced envelope_length, first open the envelopes into their slots
    #: (shuffledp.shuffler.opening), while the submitting thread receives the next messages; 0 does it all inline.
    #: Default: :func:`shuffledp.shuffler.config.default_verify_threads`
    verify_threads: int = DEFAULT_VERIFY_THREADS

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


def request_digest(header: Header, fingerprints: bytes | bytearray | memoryview) -> bytes:
    """Order-independent digest of a submission: the header and the envelope fingerprints
    (:func:`envelope_fingerprint`, 32 bytes each, concatenated in any order), sorted."""
    h = hashlib.sha256(b"shuffledp/request/v1")
    h.update(
        struct.pack(">BIQI", header.protocol_version, header.key_epoch, header.round_id, header.expected_count)
    )
    h.update(header.model_digest)
    if header.envelope_length:  # absent from legacy digests, so they stay valid
        h.update(struct.pack(">Q", header.envelope_length))
    h.update(sorted_packed(fingerprints, 32))  # == each of sorted(fingerprints) in turn
    return h.digest()
