"""The shuffler's signed attestation of a sealed batch, and the output digest it commits to.

Statement: canonical JSON (sorted keys, no spaces), UTF-8::

    {"format": "shuffledp-attestation/v2", "batch_id": hex16, "protocol_version": 1, "key_epoch": E,
     "round_id": R, "model_digest": hex32, "k": k, "n_received": N, "n_accepted": A, "inner_length": L,
     "output_digest": hex32, "dropped": {reason: count, ...}[, "envelope_length": B]}

``envelope_length`` is present only if the submit header announced one (then it is that length).

Signature: Ed25519 (RFC 8032) by the shuffler's signing key over ``"shuffledp/attestation/v1" || statement``.
A verifier checks the signature over the bytes it received and only then parses them.

Output digest (format v2): SHA-256 over ``"shuffledp/batch-output/v2"`` followed by
``len:u64 || SHA-256(inner)`` for each inner ciphertext in output order. It pins both the contents and the order
of the batch, so a fetch that returns different bytes, a different order, or a different count is detected
(collision resistance of SHA-256, applied twice). Hashing each item separately lets the shuffler reuse the
SHA-256 of the inner ciphertext it already computed to check the report's signature (shuffler.envelope), so
sealing a batch reads no report bytes a second time; a verifier does the same single pass as before.

Format v1 (``"shuffledp-attestation/v1"``, sealed by shuffledp before 2026-11-21) hashed the items themselves:
``"shuffledp/batch-output/v1"`` followed by ``len:u64 || inner``. Such statements still verify, and
:class:`OutputDigest` is built for the statement's format, so batches journaled before an upgrade can still be
fetched and checked.

The dropped counters are per reason and per batch, never per position or per client.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ed25519

from shuffler.envelope import inner_length_for

__all__ = [
    "ATTESTATION_FORMAT",
    "ATTESTATION_FORMATS",
    "DROP_REASONS",
    "Attestation",
    "AttestationError",
    "OutputDigest",
    "sign_statement",
]

ATTESTATION_FORMAT = "shuffledp-attestation/v2"
#: Statement formats a verifier accepts, with the output-digest version each one commits to.
_DIGEST_VERSION_OF_FORMAT = {"shuffledp-attestation/v1": 1, ATTESTATION_FORMAT: 2}
ATTESTATION_FORMATS = frozenset(_DIGEST_VERSION_OF_FORMAT)  # the statement formats a verifier accepts
_SIG_DOMAIN = b"shuffledp/attestation/v1"  # the signature's domain tag; unchanged across statement formats
_OUTPUT_DOMAIN = {1: b"shuffledp/batch-output/v1", 2: b"shuffledp/batch-output/v2"}
_LEN = struct.Struct(">Q")

#: Why an envelope was dropped (counted, never attributed).
DROP_REASONS: tuple[str, ...] = (
    "empty",  # a zero-length placeholder: the submitter had no report for this slot (no reply, or too large)
    "malformed",  # too short or structurally invalid
    "oversized",  # longer than max_envelope_bytes
    "wrong_version",  # envelope format version not spoken here
    "wrong_epoch",  # clear key-epoch prefix differs from the batch's
    "undecryptable",  # HPKE authentication failed (wrong key, round, epoch, model digest, or modified bytes)
    "bad_signature",  # Ed25519 signature does not verify
    "unknown_signer",  # signer key not in the enrolment file
    "duplicate_signer",  # a second report from the same enrolled client in this round
    "replay",  # HPKE enc or report id seen before in this key epoch
    "wrong_length",  # not the envelope length announced in the submit header
)


class AttestationError(ValueError):
    """An attestation or a fetched batch does not verify."""


class OutputDigest:
    """Incremental output digest (see module docstring); ``version`` 2 (the default) or 1 (legacy statements)."""

    def __init__(self, version: int = 2) -> None:
        if version not in _OUTPUT_DOMAIN:
            raise ValueError(f"output digest version must be one of {sorted(_OUTPUT_DOMAIN)}, got {version!r}")
        self.version = version
        self._h = hashlib.sha256(_OUTPUT_DOMAIN[version])
        self.count = 0

    @classmethod
    def for_attestation(cls, attestation: "Attestation") -> "OutputDigest":
        """The digest the attestation's statement format commits to."""
        return cls(_DIGEST_VERSION_OF_FORMAT[attestation.format])

    def update(self, inner: bytes | memoryview) -> None:
        """Add the next inner ciphertext in output order."""
        if self.version == 2:
            self.update_hashed(len(inner), hashlib.sha256(inner).digest())
            return
        self._h.update(_LEN.pack(len(inner)))
        self._h.update(inner)
        self.count += 1

    def update_hashed(self, length: int, inner_sha256: bytes) -> None:
        """Add the next item from its length and its SHA-256 (version 2 only): the same result as
        ``update(inner)`` without reading the bytes again."""
        if self.version != 2:
            raise ValueError("update_hashed needs output digest version 2 (version 1 hashes the bytes themselves)")
        if len(inner_sha256) != 32:
            raise ValueError(f"inner_sha256 must be 32 bytes, got {len(inner_sha256)}")
        self._h.update(_LEN.pack(length))
        self._h.update(inner_sha256)
        self.count += 1

    def digest(self) -> bytes:
        return self._h.digest()


@dataclass(frozen=True)
class Attestation:
    """A verified (or to-be-verified) attestation. ``n_accepted`` is what the accountant is charged with."""

    batch_id: bytes
    protocol_version: int
    key_epoch: int
    round_id: int
    model_digest: bytes
    k: int
    n_received: int
    n_accepted: int
    inner_length: int
    output_digest: bytes
    dropped: Mapping[str, int] = field(default_factory=dict)
    statement: bytes = b""
    signature: bytes = b""
    envelope_length: int = 0  # the envelope length announced in the submit header (0: none, legacy)
    format: str = ATTESTATION_FORMAT  # the statement's format; it fixes the output digest's version

    @staticmethod
    def build_statement(
        *,
        batch_id: bytes,
        protocol_version: int,
        key_epoch: int,
        round_id: int,
        model_digest: bytes,
        k: int,
        n_received: int,
        n_accepted: int,
        inner_length: int,
        output_digest: bytes,
        dropped: Mapping[str, int],
        envelope_length: int = 0,
    ) -> bytes:
        doc = {
            "format": ATTESTATION_FORMAT,
            "batch_id": batch_id.hex(),
            "protocol_version": protocol_version,
            "key_epoch": key_epoch,
            "round_id": round_id,
            "model_digest": model_digest.hex(),
            "k": k,
            "n_received": n_received,
            "n_accepted": n_accepted,
            "inner_length": inner_length,
            "output_digest": output_digest.hex(),
            "dropped": {r: int(dropped.get(r, 0)) for r in DROP_REASONS},
        }
        if envelope_length:  # only when announced, so legacy statements keep their exact form
            doc["envelope_length"] = int(envelope_length)
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def verify(cls, statement: bytes, signature: bytes, verify_key: bytes) -> "Attestation":
        """Verify the shuffler's signature over ``statement`` and parse it. Raises :class:`AttestationError`."""
        if not isinstance(verify_key, (bytes, bytearray)) or len(verify_key) != 32:
            raise ValueError("verify_key must be the shuffler's raw 32-byte Ed25519 public key")
        try:
            ed25519.Ed25519PublicKey.from_public_bytes(bytes(verify_key)).verify(
                bytes(signature), _SIG_DOMAIN + bytes(statement)
            )
        except (InvalidSignature, ValueError) as exc:
            raise AttestationError("attestation signature does not verify with the pinned shuffler key") from exc
        try:
            doc = json.loads(statement)
            if doc.get("format") not in _DIGEST_VERSION_OF_FORMAT:
                raise AttestationError(
                    f"attestation format {doc.get('format')!r}; expected one of {sorted(_DIGEST_VERSION_OF_FORMAT)}"
                )
            att = cls(
                batch_id=bytes.fromhex(doc["batch_id"]),
                protocol_version=int(doc["protocol_version"]),
                key_epoch=int(doc["key_epoch"]),
                round_id=int(doc["round_id"]),
                model_digest=bytes.fromhex(doc["model_digest"]),
                k=int(doc["k"]),
                n_received=int(doc["n_received"]),
                n_accepted=int(doc["n_accepted"]),
                inner_length=int(doc["inner_length"]),
                output_digest=bytes.fromhex(doc["output_digest"]),
                dropped={str(r): int(c) for r, c in doc["dropped"].items()},
                statement=bytes(statement),
                signature=bytes(signature),
                envelope_length=int(doc.get("envelope_length", 0)),
                format=str(doc["format"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, AttestationError):
                raise
            raise AttestationError(f"signed attestation statement is malformed: {exc}") from exc
        if not 0 <= att.n_accepted <= att.n_received or att.n_accepted < att.k:
            raise AttestationError("attestation counts are inconsistent (n_accepted vs n_received vs k)")
        unknown = sorted(set(att.dropped) - set(DROP_REASONS))
        if unknown or any(c < 0 for c in att.dropped.values()):
            raise AttestationError(f"attestation drop counters are invalid (unknown reasons {unknown} or negative)")
        if att.n_accepted + sum(att.dropped.values()) != att.n_received:
            raise AttestationError(
                f"attestation counts do not add up: {att.n_accepted} accepted + {sum(att.dropped.values())} dropped "
                f"!= {att.n_received} received"
            )
        if att.envelope_length and att.inner_length != inner_length_for(att.envelope_length):
            raise AttestationError(
                f"attestation inner_length {att.inner_length} does not follow from envelope_length "
                f"{att.envelope_length}"
            )
        return att

    def to_dict(self) -> dict[str, str]:
        """JSON-serialisable form (statement and signature, hex), e.g. for a ledger."""
        return {"statement": self.statement.decode(), "signature": self.signature.hex()}

    @classmethod
    def from_dict(cls, d: Mapping[str, str], verify_key: bytes) -> "Attestation":
        """Inverse of :meth:`to_dict`; re-verifies the signature."""
        return cls.verify(d["statement"].encode(), bytes.fromhex(d["signature"]), verify_key)


def sign_statement(statement: bytes, signing_key: bytes) -> bytes:
    """Ed25519 signature over ``"shuffledp/attestation/v1" || statement``."""
    return ed25519.Ed25519PrivateKey.from_private_bytes(signing_key).sign(_SIG_DOMAIN + statement)
