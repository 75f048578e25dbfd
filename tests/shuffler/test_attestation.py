"""The attestation statement formats and the output digest, checked against their written definitions
(shuffler/attestation.py module docstring), computed here independently with hashlib."""

from __future__ import annotations

import hashlib
import json
import secrets
import struct

import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519

from shuffler.attestation import (
    ATTESTATION_FORMAT,
    DROP_REASONS,
    Attestation,
    AttestationError,
    OutputDigest,
    sign_statement,
)


def _spec_digest(items: list[bytes], version: int) -> bytes:
    h = hashlib.sha256(f"shuffledp/batch-output/v{version}".encode())
    for x in items:
        h.update(struct.pack(">Q", len(x)))
        h.update(hashlib.sha256(x).digest() if version == 2 else x)
    return h.digest()


def _items(n: int = 7, size: int = 300) -> list[bytes]:
    return [secrets.token_bytes(size) for _ in range(n)]


def test_v2_digest_is_the_documented_formula_and_update_hashed_agrees() -> None:
    items = _items()
    a, b = OutputDigest(), OutputDigest()
    for x in items:
        a.update(x)
        b.update_hashed(len(x), hashlib.sha256(x).digest())
    assert a.version == 2 and a.count == b.count == len(items)
    assert a.digest() == b.digest() == _spec_digest(items, 2)
    assert _spec_digest(items, 2) != _spec_digest(items[::-1], 2)  # the order is pinned
    assert _spec_digest(items, 2) != _spec_digest(items, 1)  # the versions are domain-separated


def test_v1_digest_is_kept_for_old_statements() -> None:
    items = _items()
    d = OutputDigest(1)
    for x in items:
        d.update(x)
    assert d.digest() == _spec_digest(items, 1)
    with pytest.raises(ValueError, match="needs output digest version 2"):
        d.update_hashed(300, hashlib.sha256(items[0]).digest())
    with pytest.raises(ValueError, match="must be 32 bytes"):
        OutputDigest().update_hashed(300, b"short")
    with pytest.raises(ValueError, match=r"version must be one of \[1, 2\]"):
        OutputDigest(3)


def _statement(fmt: str, output_digest: bytes) -> bytes:
    doc = json.loads(Attestation.build_statement(
        batch_id=secrets.token_bytes(16), protocol_version=1, key_epoch=0, round_id=5, model_digest=b"\x01" * 32,
        k=2, n_received=4, n_accepted=3, inner_length=300, output_digest=output_digest,
        dropped={r: int(r == "empty") for r in DROP_REASONS}))  # 3 accepted + 1 dropped = 4 received
    doc["format"] = fmt
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


@pytest.mark.parametrize("fmt, version", [("shuffledp-attestation/v1", 1), (ATTESTATION_FORMAT, 2)])
def test_each_accepted_statement_format_selects_its_digest(fmt: str, version: int) -> None:
    sk = ed25519.Ed25519PrivateKey.generate()
    items = _items(3)
    statement = _statement(fmt, _spec_digest(items, version))
    att = Attestation.verify(statement, sign_statement(statement, sk.private_bytes_raw()),
                             sk.public_key().public_bytes_raw())
    assert att.format == fmt
    d = OutputDigest.for_attestation(att)
    assert d.version == version
    for x in items:
        d.update(x)
    assert d.digest() == att.output_digest


def test_new_statements_are_v2_and_unknown_formats_are_refused() -> None:
    assert ATTESTATION_FORMAT == "shuffledp-attestation/v2"
    assert json.loads(_statement(ATTESTATION_FORMAT, b"\x00" * 32))["format"] == ATTESTATION_FORMAT
    sk = ed25519.Ed25519PrivateKey.generate()
    statement = _statement("shuffledp-attestation/v9", b"\x00" * 32)
    with pytest.raises(AttestationError, match="attestation format 'shuffledp-attestation/v9'; expected one of"):
        Attestation.verify(statement, sign_statement(statement, sk.private_bytes_raw()),
                           sk.public_key().public_bytes_raw())
