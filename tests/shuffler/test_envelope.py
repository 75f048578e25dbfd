"""Envelope format: round trip, sizes, binding, tampering."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519, x25519

from shuffledp.shuffler import envelope as env
from shuffledp.shuffler.envelope import (
    ENVELOPE_OVERHEAD,
    INNER_OVERHEAD,
    EnvelopeError,
    model_digest,
    open_inner,
    open_outer,
    seal,
)


@pytest.fixture(scope="module")
def keys() -> dict[str, bytes]:
    server = x25519.X25519PrivateKey.generate()
    shuffler = x25519.X25519PrivateKey.generate()
    client = ed25519.Ed25519PrivateKey.generate()
    return {
        "server_sk": server.private_bytes_raw(),
        "server_pk": server.public_key().public_bytes_raw(),
        "shuffler_sk": shuffler.private_bytes_raw(),
        "shuffler_pk": shuffler.public_key().public_bytes_raw(),
        "client_sk": client.private_bytes_raw(),
        "client_pk": client.public_key().public_bytes_raw(),
    }


DIGEST = model_digest([b"model"])


def _seal(keys: dict[str, bytes], payload: bytes = b"p" * 64, **over: object) -> bytes:
    kw: dict[str, object] = dict(
        server_public_key=keys["server_pk"],
        shuffler_public_key=keys["shuffler_pk"],
        signing_key=keys["client_sk"],
        key_epoch=3,
        round_id=7,
        model_digest=DIGEST,
    )
    kw.update(over)
    return seal(payload, **kw)  # type: ignore[arg-type] - keyword arguments of any type


def _open(keys: dict[str, bytes], envelope: bytes, **over: object) -> env.OpenedReport:
    kw: dict[str, object] = dict(
        shuffler_private_key=keys["shuffler_sk"], key_epoch=3, round_id=7, model_digest=DIGEST
    )
    kw.update(over)
    return open_outer(envelope, **kw)  # type: ignore[arg-type] - keyword arguments of any type


def test_round_trip_and_sizes(keys: dict[str, bytes]) -> None:
    for size in (0, 1, 1000):
        payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
        e = _seal(keys, payload)
        assert len(e) == size + ENVELOPE_OVERHEAD
        opened = _open(keys, e)
        assert opened.signer_public_key == keys["client_pk"]
        assert len(opened.report_id) == 16 and len(opened.enc) == 32
        assert len(opened.inner) == size + INNER_OVERHEAD
        assert open_inner(opened.inner, server_private_key=keys["server_sk"], key_epoch=3, round_id=7) == payload


def test_fresh_randomness_per_seal(keys: dict[str, bytes]) -> None:
    a, b = _open(keys, _seal(keys)), _open(keys, _seal(keys))
    assert a.report_id != b.report_id and a.enc != b.enc and a.inner != b.inner


def test_signer_is_not_visible_in_envelope(keys: dict[str, bytes]) -> None:
    e = _seal(keys)
    assert keys["client_pk"] not in e


@pytest.mark.parametrize(
    "field,value",
    [("round_id", 8), ("model_digest", model_digest([b"other"]))],
)
def test_binding_mismatch_is_undecryptable(keys: dict[str, bytes], field: str, value: object) -> None:
    with pytest.raises(EnvelopeError) as info:
        _open(keys, _seal(keys), **{field: value})
    assert info.value.reason == "undecryptable"


def test_wrong_epoch_and_version(keys: dict[str, bytes]) -> None:
    e = _seal(keys)
    with pytest.raises(EnvelopeError) as info:
        _open(keys, e, key_epoch=4)
    assert info.value.reason == "wrong_epoch"
    # rewriting the clear epoch prefix does not help: the epoch is bound in info
    forged = e[:1] + (4).to_bytes(4, "big") + e[5:]
    with pytest.raises(EnvelopeError) as info:
        _open(keys, forged, key_epoch=4)
    assert info.value.reason == "undecryptable"
    with pytest.raises(EnvelopeError) as info:
        _open(keys, b"\x01" + e[1:])
    assert info.value.reason == "wrong_version"
    with pytest.raises(EnvelopeError) as info:  # a batch of version 1 does not take a version-2 envelope
        _open(keys, e, version=1)
    assert info.value.reason == "wrong_version"


def test_every_bit_flip_region_is_rejected(keys: dict[str, bytes]) -> None:
    e = _seal(keys)
    for pos in (5, 20, 40, 100, len(e) - 1):
        flipped = bytearray(e)
        flipped[pos] ^= 0x01
        with pytest.raises(EnvelopeError) as info:
            _open(keys, bytes(flipped))
        assert info.value.reason == "undecryptable"


def test_truncated(keys: dict[str, bytes]) -> None:
    e = _seal(keys)
    for n in (0, 4, ENVELOPE_OVERHEAD - 1):
        with pytest.raises(EnvelopeError) as info:
            _open(keys, e[:n])
        assert info.value.reason == "malformed"
    with pytest.raises(EnvelopeError) as info:
        _open(keys, e[:-1])
    assert info.value.reason == "undecryptable"


def test_bad_signature_detected_inside_valid_outer(keys: dict[str, bytes]) -> None:
    """A party holding the shuffler's public key can build a well-formed outer layer with a bad signature."""
    from cryptography.hazmat.primitives.hpke import AEAD, KDF, KEM, Suite

    good = _open(keys, _seal(keys))
    bind = env.binding(3, 7, DIGEST)
    other = ed25519.Ed25519PrivateKey.generate()
    # claims to be the enrolled client but is signed by another key
    sig = other.sign(env._signed_message(bind, good.report_id, len(good.inner), env.inner_hash(good.inner)))
    pt = bytes([2]) + good.report_id + keys["client_pk"] + sig + good.inner
    suite = Suite(KEM.X25519, KDF.HKDF_SHA256, AEAD.AES_128_GCM)
    forged = bytes([2]) + (3).to_bytes(4, "big") + suite.encrypt(
        pt, x25519.X25519PublicKey.from_public_bytes(keys["shuffler_pk"]), info=b"shuffledp/outer" + bind
    )
    with pytest.raises(EnvelopeError) as info:
        _open(keys, forged)
    assert info.value.reason == "bad_signature"


def test_inner_bound_to_round_and_key(keys: dict[str, bytes]) -> None:
    inner = _open(keys, _seal(keys)).inner
    with pytest.raises(EnvelopeError):
        open_inner(inner, server_private_key=keys["server_sk"], key_epoch=3, round_id=8)
    with pytest.raises(EnvelopeError):
        open_inner(inner, server_private_key=keys["shuffler_sk"], key_epoch=3, round_id=7)
    with pytest.raises(EnvelopeError) as info:
        open_inner(inner[:10], server_private_key=keys["server_sk"], key_epoch=3, round_id=7)
    assert info.value.reason == "malformed"


def test_parameter_validation(keys: dict[str, bytes]) -> None:
    with pytest.raises(ValueError, match="model_digest must be exactly 32 bytes"):
        _seal(keys, model_digest=b"short")
    with pytest.raises(ValueError, match="round_id"):
        _seal(keys, round_id=-1)
    with pytest.raises(ValueError, match="key_epoch"):
        _seal(keys, key_epoch=2**32)
    with pytest.raises(TypeError, match="key_epoch must be an int"):
        _seal(keys, key_epoch=True)
    with pytest.raises(ValueError, match="signing_key must be exactly 32 bytes"):
        _seal(keys, signing_key=b"x" * 31)
    with pytest.raises(TypeError, match="payload must be bytes"):
        _seal(keys, payload="text")  # type: ignore[arg-type] - the wrong type on purpose


def test_model_digest_properties() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert model_digest([a]) == model_digest([a.tobytes()])
    assert model_digest([b"ab", b"c"]) != model_digest([b"a", b"bc"])  # length-prefixed
    assert model_digest([]) != model_digest([b""])
    assert len(model_digest([b"x"])) == 32
    with pytest.raises(TypeError, match="chunk 1 must be bytes-like"):
        model_digest([b"x", "text"])  # type: ignore[list-item] - the wrong type on purpose
    with pytest.raises(ValueError, match="not C-contiguous"):
        model_digest([a.T])


def test_opened_report_carries_the_inner_hash_of_its_version(keys: dict[str, bytes]) -> None:
    import hashlib

    import blake3

    r = _open(keys, _seal(keys, b"q" * 1000))
    assert r.inner_hash == blake3.blake3(r.inner).digest() and len(r.inner) == 1000 + INNER_OVERHEAD
    r1 = _open(keys, _seal(keys, b"q" * 1000, version=1), version=1)
    assert r1.inner_hash == hashlib.sha256(r1.inner).digest()
    assert env.inner_hash(b"") == bytes.fromhex("af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262")


def test_both_versions_round_trip_and_each_is_bound_to_its_version(keys: dict[str, bytes]) -> None:
    """Version 1 (SHA-256 inner hash) is still sealed on request and opened by a version-1 opener; an envelope
    of one version never opens as the other, even with its clear version byte rewritten (the version is bound in
    the outer info), and its inner layer opens only with its own version."""
    assert env.ENVELOPE_VERSION == 2 and env.ENVELOPE_VERSIONS == {1, 2}
    for version in (1, 2):
        e = _seal(keys, b"v" * 100, version=version)
        assert e[0] == version and len(e) == 100 + ENVELOPE_OVERHEAD
        r = _open(keys, e, version=version)
        assert open_inner(r.inner, server_private_key=keys["server_sk"], key_epoch=3, round_id=7,
                          version=version) == b"v" * 100
        other = 3 - version
        with pytest.raises(EnvelopeError) as info:
            _open(keys, bytes([other]) + e[1:], version=other)
        assert info.value.reason == "undecryptable"
        with pytest.raises(EnvelopeError) as info:
            open_inner(r.inner, server_private_key=keys["server_sk"], key_epoch=3, round_id=7, version=other)
        assert info.value.reason == "undecryptable"
    with pytest.raises(ValueError, match=r"envelope version must be one of \[1, 2\], got 3"):
        _seal(keys, version=3)
    with pytest.raises(ValueError, match=r"envelope version must be one of \[1, 2\], got 0"):
        _open(keys, _seal(keys), version=0)


def test_signatures_are_checked_by_libsodium_with_rfc8032_semantics(keys: dict[str, bytes]) -> None:
    """The shuffler checks signatures with libsodium, the client signs with cryptography (OpenSSL): every honest
    signature must verify; a non-canonical S (S + L, which RFC 8032 section 5.1.7 requires verifiers to reject)
    must not, and neither must the identity-key forgery (public key = R = identity point, S = 0), which
    OpenSSL's cofactorless check accepts for every message (so this fails if the check goes back to OpenSSL)."""
    from cryptography.hazmat.primitives.hpke import AEAD, KDF, KEM, Suite

    for i in range(50):  # honest signatures over many random messages all verify
        payload = bytes([i]) * (i + 1)
        assert open_inner(_open(keys, _seal(keys, payload)).inner, server_private_key=keys["server_sk"], key_epoch=3,
                          round_id=7) == payload
    good = _open(keys, _seal(keys))
    bind = env.binding(3, 7, DIGEST)
    sk = ed25519.Ed25519PrivateKey.from_private_bytes(keys["client_sk"])
    sig = sk.sign(env._signed_message(bind, good.report_id, len(good.inner), env.inner_hash(good.inner)))
    order = 2**252 + 27742317777372353535851937790883648493
    s = int.from_bytes(sig[32:], "little")
    malleated = sig[:32] + (s + order).to_bytes(32, "little")
    suite = Suite(KEM.X25519, KDF.HKDF_SHA256, AEAD.AES_128_GCM)
    shuffler_pk = x25519.X25519PublicKey.from_public_bytes(keys["shuffler_pk"])

    def wrapped(signature: bytes, signer: bytes = keys["client_pk"]) -> bytes:
        pt = bytes([2]) + good.report_id + signer + signature + good.inner
        return bytes([2]) + (3).to_bytes(4, "big") + suite.encrypt(pt, shuffler_pk, info=b"shuffledp/outer" + bind)

    assert _open(keys, wrapped(sig)).report_id == good.report_id
    with pytest.raises(EnvelopeError) as info:
        _open(keys, wrapped(malleated))
    assert info.value.reason == "bad_signature"

    identity = (1).to_bytes(32, "little")  # the encoding of the neutral point (x = 0, y = 1)
    forged_sig = identity + bytes(32)
    message = env._signed_message(bind, good.report_id, len(good.inner), env.inner_hash(good.inner))
    ed25519.Ed25519PublicKey.from_public_bytes(identity).verify(forged_sig, message)  # OpenSSL: accepted
    with pytest.raises(EnvelopeError) as info:
        _open(keys, wrapped(forged_sig, identity))
    assert info.value.reason == "bad_signature"
