"""The written-out RFC 9180 open (shuffledp.shuffler.hpke_open) against ``cryptography``'s HPKE: the same
plaintexts, the same refusals, small-order encapsulated keys included."""

from __future__ import annotations

import os
import threading

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric import x25519
from cryptography.hazmat.primitives.hpke import AEAD, KDF, KEM, Suite

from shuffledp.shuffler.hpke_open import ENC_BYTES, TAG_BYTES, BaseModeOpener, OpenFailed

SUITE = Suite(KEM.X25519, KDF.HKDF_SHA256, AEAD.AES_128_GCM)

#: X25519 u-coordinates of small order and their non-canonical encodings (RFC 7748 Section 5; the list libsodium
#: and others keep): 0, 1, the two points of order 8, p - 1, p, p + 1; then each with the top bit set, which RFC 7748
#: masks
_CANONICAL = [
    bytes(32),
    (1).to_bytes(32, "little"),
    bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
    bytes.fromhex("5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157"),
    bytes.fromhex("ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f"),
    bytes.fromhex("edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f"),
    bytes.fromhex("eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f"),
]
SMALL_ORDER = _CANONICAL + [p[:31] + bytes([p[31] | 0x80]) for p in _CANONICAL]


def _sealed(pk: x25519.X25519PublicKey, plaintext: bytes, info: bytes) -> tuple[bytes, memoryview]:
    """``cryptography``'s single-shot HPKE seal, split into (enc, AEAD ciphertext with its tag)."""
    blob = SUITE.encrypt(plaintext, pk, info=info)
    return blob[:ENC_BYTES], memoryview(blob)[ENC_BYTES:]


@pytest.fixture()
def recipient() -> tuple[x25519.X25519PrivateKey, BaseModeOpener]:
    sk = x25519.X25519PrivateKey.generate()
    return sk, BaseModeOpener(sk.private_bytes_raw(), b"shuffledp/test-info")


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 4096, 100_000])
def test_opens_what_cryptography_seals_into_the_callers_buffer(recipient, size: int) -> None:
    sk, opener = recipient
    assert opener.public_key == sk.public_key().public_bytes_raw()
    plaintext = os.urandom(size)
    enc, ct = _sealed(sk.public_key(), plaintext, b"shuffledp/test-info")
    backing = bytearray(b"\xaa" * (size + 9))  # a larger buffer: only the view given is written
    opener.open_into(enc, ct, memoryview(backing)[4 : 4 + size])
    assert bytes(backing[4 : 4 + size]) == plaintext
    assert backing[:4] == b"\xaa" * 4 and backing[4 + size :] == b"\xaa" * 5
    assert SUITE.decrypt(enc + bytes(ct), sk, info=b"shuffledp/test-info") == plaintext


@pytest.mark.parametrize("cuts", [(0,), (1,), (14,), (15,), (16,), (113,), (3, 40), (0, 500, 500), (499, 1)])
def test_a_plaintext_split_across_buffers_lands_exactly_in_them(recipient, cuts: tuple[int, ...]) -> None:
    """The plaintext's parts go to their buffers, each a view inside a larger one whose other bytes stay as they
    were (``update_into`` asks for 15 bytes of room beyond its output; none of it may be written)."""
    sk, opener = recipient
    plaintext = os.urandom(1000)
    enc, ct = _sealed(sk.public_key(), plaintext, b"shuffledp/test-info")
    bounds = [0, *[sum(cuts[: i + 1]) for i in range(len(cuts))], 1000]
    backings = [bytearray(b"\x5a" * (b - a + 40)) for a, b in zip(bounds, bounds[1:], strict=False)]
    views = [memoryview(bk)[20 : 20 + (b - a)] for bk, a, b in zip(backings, bounds, bounds[1:], strict=False)]
    opener.open_into(enc, ct, *views)
    assert b"".join(bytes(v) for v in views) == plaintext
    for bk, v in zip(backings, views, strict=True):
        assert bk[:20] == b"\x5a" * 20 and bk[20 + len(v) :] == b"\x5a" * 20
    with pytest.raises(ValueError, match="the output buffers hold 999 bytes; the plaintext is 1000"):
        opener.open_into(enc, ct, memoryview(bytearray(999)))


def test_refuses_what_cryptography_refuses(recipient) -> None:
    """Another info, another recipient, a flipped bit in the encapsulated key, the ciphertext or the tag: both
    implementations refuse each one."""
    sk, opener = recipient
    enc, ct = _sealed(sk.public_key(), b"x" * 300, b"shuffledp/test-info")
    out = memoryview(bytearray(300))
    cases = {"other info": _sealed(sk.public_key(), b"x" * 300, b"shuffledp/other-info"),
             "other recipient": _sealed(x25519.X25519PrivateKey.generate().public_key(), b"x" * 300,
                                        b"shuffledp/test-info")}
    for pos in (0, 31):
        bad = bytearray(enc)
        bad[pos] ^= 1
        cases[f"enc bit {pos}"] = (bytes(bad), ct)
    for pos in (0, 150, 300, 300 + TAG_BYTES - 1):
        bad = bytearray(ct)
        bad[pos] ^= 0x80
        cases[f"ciphertext byte {pos}"] = (enc, memoryview(bytes(bad)))
    for e, c in cases.values():
        with pytest.raises(OpenFailed):
            opener.open_into(e, c, out)
        with pytest.raises((InvalidTag, ValueError)):
            SUITE.decrypt(e + bytes(c), sk, info=b"shuffledp/test-info")


@pytest.mark.parametrize("point", SMALL_ORDER, ids=lambda p: p.hex()[:8])
def test_small_order_encapsulated_keys_are_refused_as_cryptography_refuses_them(recipient, point: bytes) -> None:
    sk, opener = recipient
    with pytest.raises(ValueError):  # noqa: PT011 - cryptography's message is not ours to pin
        sk.exchange(x25519.X25519PublicKey.from_public_bytes(point))
    with pytest.raises(OpenFailed, match="small order"):
        opener.open_into(point, memoryview(bytes(64 + TAG_BYTES)), memoryview(bytearray(64)))


def test_the_top_bit_of_the_encapsulated_key_is_ignored_as_rfc_7748_says(recipient) -> None:
    """RFC 7748 Section 5 masks the u-coordinate's top bit: a ciphertext whose enc has it flipped gives the same
    shared secret but another KEM context (enc is hashed in), so it must fail authentication, not crash."""
    sk, opener = recipient
    enc, ct = _sealed(sk.public_key(), b"y" * 64, b"shuffledp/test-info")
    flipped = enc[:31] + bytes([enc[31] ^ 0x80])
    assert sk.exchange(x25519.X25519PublicKey.from_public_bytes(flipped)) == sk.exchange(
        x25519.X25519PublicKey.from_public_bytes(enc))
    with pytest.raises(OpenFailed, match="tag"):
        opener.open_into(flipped, ct, memoryview(bytearray(64)))


def test_bad_lengths_are_refused_before_libsodium_reads_them(recipient) -> None:
    _, opener = recipient
    with pytest.raises(ValueError, match="encapsulated key is 32 bytes, got 31"):
        opener.open_into(bytes(31), memoryview(bytes(32)), memoryview(bytearray(16)))
    with pytest.raises(ValueError, match="private key is 32 bytes, got 16"):
        BaseModeOpener(bytes(16), b"")


def test_threads_opening_at_once_get_their_own_plaintexts(recipient) -> None:
    """Four threads open 50 ciphertexts each with one opener (the shuffler's verify pool shares its opener)."""
    sk, opener = recipient
    jobs = [[(p := os.urandom(2000), *_sealed(sk.public_key(), p, b"shuffledp/test-info")) for _ in range(50)]
            for _ in range(4)]
    failures: list[str] = []

    def run(job: list[tuple[bytes, bytes, memoryview]]) -> None:
        out = bytearray(2000)
        for plaintext, enc, ct in job:
            opener.open_into(enc, ct, memoryview(out))
            if bytes(out) != plaintext:
                failures.append(enc.hex())

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
