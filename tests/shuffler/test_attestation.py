"""The attestation statement formats and the output digest, checked against their written definitions
(shuffler/attestation.py module docstring), computed here independently with hashlib and blake3."""

from __future__ import annotations

import hashlib
import json
import secrets
import struct

import blake3
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from shuffledp.shuffler.attestation import (
    ATTESTATION_FORMAT,
    DROP_REASONS,
    Attestation,
    AttestationError,
    OutputDigest,
    format_for_protocol,
    sign_statement,
)

#: BLAKE3 of the empty input, from the BLAKE3 reference test vectors (test_vectors.json, input_len 0)
_BLAKE3_EMPTY = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"


def _item_hash(x: bytes, version: int) -> bytes:
    return hashlib.sha256(x).digest() if version == 2 else blake3.blake3(x).digest()


def _spec_digest(items: list[bytes], version: int) -> bytes:
    h = hashlib.sha256(f"shuffledp/batch-output/v{version}".encode())
    for x in items:
        h.update(struct.pack(">Q", len(x)))
        h.update(x if version == 1 else _item_hash(x, version))
    return h.digest()


def _items(n: int = 7, size: int = 300) -> list[bytes]:
    return [secrets.token_bytes(size) for _ in range(n)]


def test_the_blake3_module_is_the_reference_function() -> None:
    assert blake3.blake3(b"").hexdigest() == _BLAKE3_EMPTY


@pytest.mark.parametrize("version", [3, 2])
def test_per_item_digests_are_the_documented_formula_and_update_hashed_agrees(version: int) -> None:
    items = _items()
    a, b = OutputDigest(version), OutputDigest(version)
    for x in items:
        a.update(x)
        b.update_hashed(len(x), _item_hash(x, version))
    assert a.count == b.count == len(items)
    assert a.digest() == b.digest() == _spec_digest(items, version)
    assert _spec_digest(items, version) != _spec_digest(items[::-1], version)  # the order is pinned
    assert len({_spec_digest(items, v) for v in (1, 2, 3)}) == 3  # the versions are domain-separated


def test_the_default_digest_is_v3_and_each_protocol_has_its_own() -> None:
    assert OutputDigest().version == 3
    assert OutputDigest.for_protocol(2).version == 3 and OutputDigest.for_protocol(1).version == 2
    assert format_for_protocol(2) == ATTESTATION_FORMAT == "shuffledp-attestation/v3"
    assert format_for_protocol(1) == "shuffledp-attestation/v2"
    with pytest.raises(ValueError, match=r"no attestation format for protocol version 3; known: \[1, 2\]"):
        format_for_protocol(3)


def test_v1_digest_is_kept_for_old_statements() -> None:
    items = _items()
    d = OutputDigest(1)
    for x in items:
        d.update(x)
    assert d.digest() == _spec_digest(items, 1)
    with pytest.raises(ValueError, match="needs output digest version 2 or 3, not 1"):
        d.update_hashed(300, hashlib.sha256(items[0]).digest())
    with pytest.raises(ValueError, match="must be 32 bytes"):
        OutputDigest().update_hashed(300, b"short")
    with pytest.raises(ValueError, match=r"version must be one of \[1, 2, 3\]"):
        OutputDigest(4)


def _statement(fmt: str, output_digest: bytes, protocol_version: int = 1) -> bytes:
    doc = json.loads(Attestation.build_statement(
        batch_id=secrets.token_bytes(16), protocol_version=protocol_version, key_epoch=0, round_id=5,
        model_digest=b"\x01" * 32, k=2, n_received=4, n_accepted=3, inner_length=300, output_digest=output_digest,
        dropped={r: int(r == "empty") for r in DROP_REASONS}))  # 3 accepted + 1 dropped = 4 received
    doc["format"] = fmt
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _signed(statement: bytes) -> tuple[bytes, bytes, bytes]:
    sk = ed25519.Ed25519PrivateKey.generate()
    return statement, sign_statement(statement, sk.private_bytes_raw()), sk.public_key().public_bytes_raw()


@pytest.mark.parametrize("fmt, protocol, version", [("shuffledp-attestation/v1", 1, 1),
                                                     ("shuffledp-attestation/v2", 1, 2), (ATTESTATION_FORMAT, 2, 3)])
def test_each_accepted_statement_format_selects_its_digest(fmt: str, protocol: int, version: int) -> None:
    items = _items(3)
    att = Attestation.verify(*_signed(_statement(fmt, _spec_digest(items, version), protocol)))
    assert att.format == fmt and att.protocol_version == protocol
    d = OutputDigest.for_attestation(att)
    assert d.version == version
    for x in items:
        d.update(x)
    assert d.digest() == att.output_digest


@pytest.mark.parametrize("fmt, protocol", [("shuffledp-attestation/v1", 2), ("shuffledp-attestation/v2", 2),
                                           (ATTESTATION_FORMAT, 1)])
def test_a_format_that_does_not_match_its_protocol_version_is_refused(fmt: str, protocol: int) -> None:
    # A protocol-2 batch is hashed with BLAKE3 per item: checking it as v2 (SHA-256) would fail only at the end
    # of a fetch, and as v1 never matches. The statement is refused at once instead.
    with pytest.raises(AttestationError, match=f"attestation format {fmt} attests protocol version"):
        Attestation.verify(*_signed(_statement(fmt, b"\x00" * 32, protocol)))


def test_new_statements_follow_the_protocol_and_unknown_formats_are_refused() -> None:
    doc = json.loads(Attestation.build_statement(
        batch_id=secrets.token_bytes(16), protocol_version=2, key_epoch=0, round_id=5, model_digest=b"\x01" * 32,
        k=1, n_received=1, n_accepted=1, inner_length=300, output_digest=b"\x00" * 32, dropped={}))
    assert doc["format"] == "shuffledp-attestation/v3" and doc["protocol_version"] == 2
    sk = ed25519.Ed25519PrivateKey.generate()
    statement = _statement("shuffledp-attestation/v9", b"\x00" * 32)
    with pytest.raises(AttestationError, match="attestation format 'shuffledp-attestation/v9'; expected one of"):
        Attestation.verify(statement, sign_statement(statement, sk.private_bytes_raw()),
                           sk.public_key().public_bytes_raw())
