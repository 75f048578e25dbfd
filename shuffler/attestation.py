"""The shuffler's signed attestation of a sealed batch, and the output digest it commits to.

Statement: canonical JSON (sorted keys, no spaces), UTF-8::

    {"format": "shuffledp-attestation/v3", "batch_id": hex16, "protocol_version": 2, "key_epoch": E,
     "round_id": R, "model_digest": hex32, "k": k, "n_received": N, "n_accepted": A, "inner_length": L,
     "output_digest": hex32, "dropped": {reason: count, ...}[, "envelope_length": B]}

``envelope_length`` is present only if the submit header announced one (then it is that length).

Signature: Ed25519 (RFC 8032) by the shuffler's signing key over ``"shuffledp/attestation/v1" || statement``.
A verifier checks the signature over the bytes it received and only then parses them.

Output digest (format v3, for batches of envelope protocol version 2): SHA-256 over
``"shuffledp/batch-output/v3"`` followed by ``len:u64 || BLAKE3(inner)`` for each inner ciphertext in output
order. It pins both the contents and the order of the batch, so a fetch that returns different bytes, a
different order, or a different count is detected (collision resistance of BLAKE3 per item and of SHA-256 over
the list). Hashing each item separately lets the shuffler reuse the hash of the inner ciphertext it already
computed to check the report's signature (``shuffledp.shuffler.envelope.inner_hash``), so sealing a batch reads no
report bytes a second time; a verifier makes one pass over the bytes it fetched.

Each envelope protocol version has one statement format, and a statement whose format and ``protocol_version``
disagree does not verify:

- format v3 (``"shuffledp-attestation/v3"``): protocol version 2, per-item BLAKE3, as above;
- format v2 (``"shuffledp-attestation/v2"``): protocol version 1, per-item SHA-256, domain
  ``"shuffledp/batch-output/v2"``. The shuffler still seals protocol-1 batches of older peers this way;
- format v1 (``"shuffledp-attestation/v1"``, the first format, no longer sealed): protocol version 1; it
  hashed the items themselves: ``"shuffledp/batch-output/v1"`` followed by ``len:u64 || inner``.

Statements of every format still verify, and :class:`OutputDigest` is built for the statement's format, so
batches journaled before an upgrade can still be fetched and checked.

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

from shuffledp.shuffler.envelope import inner_hash, inner_length_for

__all__ = [
    "ATTESTATION_FORMAT",
    "ATTESTATION_FORMATS",
    "DROP_REASONS",
    "Attestation",
    "AttestationError",
    "OutputDigest",
    "format_for_protocol",
    "sign_statement",
]

ATTESTATION_FORMAT = "shuffledp-attestation/v3"  # the format of batches of the current envelope version (2)
#: Statement formats a verifier accepts, with the output-digest version each one commits to.
_DIGEST_VERSION_OF_FORMAT = {"shuffledp-attestation/v1": 1, "shuffledp-attestation/v2": 2, ATTESTATION_FORMAT: 3}
#: The envelope protocol version of the batches each format attests (checked when a statement is verified).
_PROTOCOL_OF_FORMAT = {"shuffledp-attestation/v1": 1, "shuffledp-attestation/v2": 1, ATTESTATION_FORMAT: 2}
#: The format the shuffler writes for a batch of each envelope protocol version.
_FORMAT_OF_PROTOCOL = {1: "shuffledp-attestation/v2", 2: ATTESTATION_FORMAT}
ATTESTATION_FORMATS = frozenset(_DIGEST_VERSION_OF_FORMAT)  # the statement formats a verifier accepts
_SIG_DOMAIN = b"shuffledp/attestation/v1"  # the signature's domain tag; unchanged across statement formats
_OUTPUT_DOMAIN = {1: b"shuffledp/batch-output/v1", 2: b"shuffledp/batch-output/v2", 3: b"shuffledp/batch-output/v3"}
#: The envelope version whose inner hash (``shuffledp.shuffler.envelope.inner_hash``) a per-item digest version uses.
_ITEM_HASH_OF_DIGEST = {2: 1, 3: 2}
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


def format_for_protocol(protocol_version: int) -> str:
    """The statement format of a batch of envelope ``protocol_version`` (1: v2, 2: v3)."""
    try:
        return _FORMAT_OF_PROTOCOL[protocol_version]
    except KeyError:
        raise ValueError(
            f"no attestation format for protocol version {protocol_version!r}; known: {sorted(_FORMAT_OF_PROTOCOL)}"
        ) from None


class OutputDigest:
    """Incremental output digest (see module docstring): ``version`` 3 (the default: per-item BLAKE3), 2
    (per-item SHA-256) or 1 (the items themselves; legacy statements)."""

    def __init__(self, version: int = 3) -> None:
        if version not in _OUTPUT_DOMAIN:
            raise ValueError(f"output digest version must be one of {sorted(_OUTPUT_DOMAIN)}, got {version!r}")
        self.version = version
        self._h = hashlib.sha256(_OUTPUT_DOMAIN[version])
        self.count = 0

    @classmethod
    def for_attestation(cls, attestation: "Attestation") -> "OutputDigest":
        """The digest the attestation's statement format commits to."""
        return cls(_DIGEST_VERSION_OF_FORMAT[attestation.format])

    @classmethod
    def for_protocol(cls, protocol_version: int) -> "OutputDigest":
        """The digest the shuffler commits to for a batch of envelope ``protocol_version``."""
        return cls(_DIGEST_VERSION_OF_FORMAT[format_for_protocol(protocol_version)])

    def update(self, inner: bytes | memoryview) -> None:
        """Add the next inner ciphertext in output order."""
        if self.version in _ITEM_HASH_OF_DIGEST:
            self.update_hashed(len(inner), inner_hash(inner, _ITEM_HASH_OF_DIGEST[self.version]))
            return
        self._h.update(_LEN.pack(len(inner)))
        self._h.update(inner)
        self.count += 1

    def update_hashed(self, length: int, item_hash: bytes) -> None:
        """Add the next item from its length and its hash (versions 2 and 3: SHA-256, resp. BLAKE3, of the item;
        ``shuffledp.shuffler.envelope.inner_hash``): the same result as ``update(inner)`` without reading the bytes
        again."""
        if self.version not in _ITEM_HASH_OF_DIGEST:
            raise ValueError(
                f"update_hashed needs output digest version 2 or 3, not {self.version} (version 1 hashes the "
                "bytes themselves)"
            )
        if len(item_hash) != 32:
            raise ValueError(f"item_hash must be 32 bytes, got {len(item_hash)}")
        self._h.update(_LEN.pack(length))
        self._h.update(item_hash)
        self.count += 1

    def update_packed(self, rows: bytes | bytearray | memoryview, count: int) -> None:
        """Add ``count`` items at once from ``rows``, their ``len:u64 || hash`` encodings concatenated (versions 2
        and 3): the same result as :meth:`update_hashed` for each row in turn."""
        if self.version not in _ITEM_HASH_OF_DIGEST:
            raise ValueError(f"update_packed needs output digest version 2 or 3, not {self.version}")
        if memoryview(rows).nbytes != count * (_LEN.size + 32):
            raise ValueError(f"rows must hold {count} items of {_LEN.size + 32} bytes")
        self._h.update(rows)
        self.count += count

    def digest(self) -> bytes:
        """The digest of the items added so far (32 bytes); it does not end the running hash."""
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
        """The statement the shuffler signs: canonical JSON (sorted keys, no spaces) of the batch's fields.

        The format tag follows ``protocol_version``; every drop reason appears (0 if none); ``envelope_length``
        appears only when announced, so statements without it keep their exact bytes.
        """
        doc = {
            "format": format_for_protocol(protocol_version),
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
        if att.protocol_version != _PROTOCOL_OF_FORMAT[att.format]:
            raise AttestationError(
                f"attestation format {att.format} attests protocol version {_PROTOCOL_OF_FORMAT[att.format]}, "
                f"but the statement says {att.protocol_version}"
            )
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
