"""Conformance of the written-out RFC 9180 open (shuffledp.shuffler.hpke_open), checked from outside:

* the key schedule against an independent reference (``hmac`` and ``cryptography``'s HKDFExpand, written from RFC
  9180 Sections 4, 4.1 and 5.1) checked on the RFC's Appendix A.1.1 values, and against ``cryptography``'s HPKE for
  many keys, infos (empty, one byte, 64, 65, long) and plaintext sizes, in both directions;
* the HMAC states against ``hmac`` for keys shorter than, as long as and longer than the 64-byte block;
* libsodium's X25519 against ``cryptography``'s and RFC 7748's ladder on random, non-canonical, top-bit and
  small-order inputs (the same result, the same refusals);
* the streaming AES-GCM: no byte outside the given views is written, for every split of 0..40 bytes, large
  plaintexts, failed tags and refusals before the AEAD; threads writing adjacent regions of one mmap;
* that nothing an attacker sends to ``OuterOpener.decrypt_into`` raises anything but ``EnvelopeError``.
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os
import random
import struct
import sys
import threading

import nacl.bindings
import nacl.exceptions
import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ed25519, x25519
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hpke import AEAD, KDF, KEM, Suite
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

from shuffledp.shuffler import envelope as env
from shuffledp.shuffler import hpke_open
from shuffledp.shuffler.hpke_open import ENC_BYTES, TAG_BYTES, BaseModeOpener, OpenFailed

SUITE = Suite(KEM.X25519, KDF.HKDF_SHA256, AEAD.AES_128_GCM)
P = 2**255 - 19

# ------------------------------------------------------------------------------------------- reference schedule
#: RFC 9180 Section 4.1 / 5.1 suite ids, written from the numbers: KEM 0x0020; HPKE KEM 0x0020, KDF 0x0001, AEAD 0x0001
REF_KEM_ID = b"KEM" + (0x0020).to_bytes(2, "big")
REF_HPKE_ID = b"HPKE" + (0x0020).to_bytes(2, "big") + (0x0001).to_bytes(2, "big") + (0x0001).to_bytes(2, "big")


def _ref_labeled_extract(suite_id: bytes, salt: bytes, label: bytes, ikm: bytes) -> bytes:
    # HKDF-Extract (RFC 5869): HMAC-Hash(salt, IKM), salt defaulting to HashLen zeros
    return hmac.new(salt or bytes(32), b"HPKE-v1" + suite_id + label + ikm, hashlib.sha256).digest()


def _ref_labeled_expand(suite_id: bytes, prk: bytes, label: bytes, info: bytes, length: int) -> bytes:
    labeled_info = length.to_bytes(2, "big") + b"HPKE-v1" + suite_id + label + info
    return HKDFExpand(hashes.SHA256(), length, labeled_info).derive(prk)


def _ref_schedule(sk_r: bytes, enc: bytes, info: bytes) -> dict[str, bytes]:
    """DHKEM(X25519, HKDF-SHA256) Decap and the base-mode KeySchedule, with ``cryptography``'s X25519."""
    sk = x25519.X25519PrivateKey.from_private_bytes(sk_r)
    dh = sk.exchange(x25519.X25519PublicKey.from_public_bytes(enc))
    pk_r = sk.public_key().public_bytes_raw()
    eae_prk = _ref_labeled_extract(REF_KEM_ID, b"", b"eae_prk", dh)
    shared = _ref_labeled_expand(REF_KEM_ID, eae_prk, b"shared_secret", enc + pk_r, 32)
    psk_id_hash = _ref_labeled_extract(REF_HPKE_ID, b"", b"psk_id_hash", b"")
    info_hash = _ref_labeled_extract(REF_HPKE_ID, b"", b"info_hash", info)
    context = b"\x00" + psk_id_hash + info_hash
    secret = _ref_labeled_extract(REF_HPKE_ID, shared, b"secret", b"")
    return {"shared_secret": shared, "context": context, "secret": secret,
            "key": _ref_labeled_expand(REF_HPKE_ID, secret, b"key", context, 16),
            "base_nonce": _ref_labeled_expand(REF_HPKE_ID, secret, b"base_nonce", context, 12)}


# RFC 9180 Appendix A.1.1: DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, AES-128-GCM, mode 0 (base). Its encryptions all
# carry an AAD ("Count-0", ...); ours is always empty, so the test checks the vector's first encryption with the
# vector's key and nonce (which ties them to the vector's bytes) and opens the same plaintext sealed with them and an
# empty AAD.
A11 = {k: bytes.fromhex(v) for k, v in {
    "info": "4f6465206f6e2061204772656369616e2055726e",
    "skEm": "52c4a758a802cd8b936eceea314432798d5baf2d7e9235dc084ab1b9cfa2f736",
    "enc": "37fda3567bdbd628e88668c3c8d7e97d1d1253b6d4ea6d44c150f741f1bf4431",
    "skRm": "4612c550263fc8ad58375df3f557aac531d26850903e55a9f23f21d8534e8ac8",
    "pkRm": "3948cfe0ad1ddb695d780e59077195da6c56506b027329794ab02bca80815c4d",
    "shared_secret": "fe0e18c9f024ce43799ae393c7e8fe8fce9d218875e8227b0187c04e7d2ea1fc",
    "context": "00725611c9d98c07c03f60095cd32d400d8347d45ed67097bbad50fc56da742d07cb6cffde367bb0565ba28bb02c90744a20f5"
               "ef37f30523526106f637abb05449",
    "secret": "12fff91991e93b48de37e7daddb52981084bd8aa64289c3788471d9a9712f397",
    "key": "4531685d41d65f03dc48f6b8302c05b0",
    "base_nonce": "56d890e5accaaf011cff4b7d",
    "pt": "4265617574792069732074727574682c20747275746820626561757479",
    "aad0": "436f756e742d30",
    "ct0": "f938558b5d72f1a23810b4be2ab4f84331acc02fc97babc53a52ae8218a355a96d8770ac83d07bea87e13c512a",
}.items()}


def test_rfc_9180_a11_vector() -> None:
    v = A11
    # the vector is self-consistent as embedded (keys, and the first encryption under its key and nonce)
    assert nacl.bindings.crypto_scalarmult_base(v["skEm"]) == v["enc"]
    assert x25519.X25519PrivateKey.from_private_bytes(v["skRm"]).public_key().public_bytes_raw() == v["pkRm"]
    assert AESGCM(v["key"]).encrypt(v["base_nonce"], v["pt"], v["aad0"]) == v["ct0"]
    # the reference schedule gives every intermediate value of the RFC
    ref = _ref_schedule(v["skRm"], v["enc"], v["info"])
    assert ref == {k: v[k] for k in ("shared_secret", "context", "secret", "key", "base_nonce")}
    # the opener under test
    opener = BaseModeOpener(v["skRm"], v["info"])
    assert opener.public_key == v["pkRm"]
    ct = AESGCM(v["key"]).encrypt(v["base_nonce"], v["pt"], b"")
    out = bytearray(len(v["pt"]))
    opener.open_into(v["enc"], ct, memoryview(out))
    assert bytes(out) == v["pt"]
    assert SUITE.decrypt(v["enc"] + ct, x25519.X25519PrivateKey.from_private_bytes(v["skRm"]), v["info"]) == v["pt"]
    with pytest.raises(OpenFailed, match="tag"):  # the AAD is empty, never the vector's "Count-0"
        opener.open_into(v["enc"], v["ct0"], memoryview(bytearray(len(v["pt"]))))
    with pytest.raises(OpenFailed, match="tag"):  # info is bound
        BaseModeOpener(v["skRm"], v["info"] + b"!").open_into(v["enc"], ct, memoryview(bytearray(len(v["pt"]))))


INFOS = [b"", b"i", bytes(range(64)), bytes(range(65)), os.urandom(200), b"shuffledp/outer" + os.urandom(49),
         os.urandom(5000)]
SIZES = [0, 1, 15, 16, 17, 31, 33, 113, 114, 129, 1000, 65_537, 300_000]


@pytest.mark.parametrize("info", INFOS, ids=lambda i: f"info{len(i)}")
def test_schedule_matches_cryptography_and_the_reference_both_ways(info: bytes) -> None:
    for size in SIZES:
        sk = x25519.X25519PrivateKey.generate()
        raw = sk.private_bytes_raw()
        opener = BaseModeOpener(raw, info)
        assert opener.public_key == sk.public_key().public_bytes_raw()
        pt = os.urandom(size)
        # cryptography seals, the reference's key and nonce open it, and so does the opener
        blob = SUITE.encrypt(pt, sk.public_key(), info)
        enc, ct = blob[:ENC_BYTES], blob[ENC_BYTES:]
        ref = _ref_schedule(raw, enc, info)
        assert AESGCM(ref["key"]).decrypt(ref["base_nonce"], ct, b"") == pt
        out = bytearray(size)
        opener.open_into(enc, memoryview(ct), memoryview(out))
        assert out == pt
        # the reference seals to a fresh enc; cryptography and the opener open it
        enc2 = x25519.X25519PrivateKey.generate().public_key().public_bytes_raw()
        ref2 = _ref_schedule(raw, enc2, info)
        ct2 = AESGCM(ref2["key"]).encrypt(ref2["base_nonce"], pt, b"")
        assert SUITE.decrypt(enc2 + ct2, sk, info) == pt
        out2 = bytearray(size)
        opener.open_into(enc2, ct2, memoryview(out2))
        assert out2 == pt


def test_many_random_keys_infos_and_sizes() -> None:
    rng = random.Random(9180)
    for _ in range(150):
        raw = os.urandom(32)  # unclamped: both sides clamp
        sk = x25519.X25519PrivateKey.from_private_bytes(raw)
        info = os.urandom(rng.choice([0, 1, 32, 63, 64, 65, 127, 128, 129, 300]))
        pt = os.urandom(rng.randrange(0, 3000))
        blob = SUITE.encrypt(pt, sk.public_key(), info)
        out = bytearray(len(pt))
        BaseModeOpener(raw, info).open_into(blob[:ENC_BYTES], blob[ENC_BYTES:], memoryview(out))
        assert out == pt


def test_encodings_that_rfc_7748_reduces_open_with_the_raw_enc_in_the_kem_context() -> None:
    """An enc with the top bit set, or u in [p, 2^255), is a valid X25519 input (RFC 7748 masks and reduces it)
    and RFC 9180 hashes the enc bytes as sent: ciphertexts sealed to such encodings open here as in cryptography."""
    sk = x25519.X25519PrivateKey.generate()
    raw = sk.private_bytes_raw()
    opener = BaseModeOpener(raw, b"ctx")
    honest = x25519.X25519PrivateKey.generate().public_key().public_bytes_raw()
    encs = [honest[:31] + bytes([honest[31] | 0x80])] + [(P + u).to_bytes(32, "little") for u in (2, 9, 18)]
    encs += [((P + u) | (1 << 255)).to_bytes(32, "little") for u in (3, 17)]
    for enc in encs:
        ref = _ref_schedule(raw, enc, b"ctx")
        ct = AESGCM(ref["key"]).encrypt(ref["base_nonce"], b"m" * 200, b"")
        assert SUITE.decrypt(enc + ct, sk, b"ctx") == b"m" * 200
        out = bytearray(200)
        opener.open_into(enc, ct, memoryview(out))
        assert out == b"m" * 200


# ------------------------------------------------------------------------------------------------------- HMAC
def test_hmac_states_match_hmac_for_keys_up_to_and_beyond_the_block() -> None:
    rng = random.Random(2104)
    for n in [*range(0, 66), 100, 128, 129, 1000]:
        key = os.urandom(n)
        states = hpke_open._hmac_states(key)
        for m in (0, 1, 55, 56, 64, 65, rng.randrange(0, 500)):
            msg = os.urandom(m)
            assert hpke_open._hmac(states, msg) == hmac.new(key, msg, hashlib.sha256).digest(), (n, m)
        # the states are copied, never consumed: a second use gives the same
        assert hpke_open._hmac(states, b"again") == hpke_open._hmac(states, b"again")
    zero = os.urandom(40)
    assert hpke_open._hmac(hpke_open._ZERO_SALT_STATES, zero) == hmac.new(bytes(32), zero, hashlib.sha256).digest()
    for salt in (b"", os.urandom(32)):
        assert hpke_open.labeled_extract(REF_HPKE_ID, salt, b"lbl", b"ikm") == _ref_labeled_extract(
            REF_HPKE_ID, salt, b"lbl", b"ikm")


# ----------------------------------------------------------------------------------------------------- X25519
def _x25519_rfc7748(k: bytes, u: bytes) -> bytes:
    """RFC 7748 Section 5, as written there (decodeScalar25519, decodeUCoordinate, the ladder)."""
    kb = bytearray(k)
    kb[0] &= 248
    kb[31] &= 127
    kb[31] |= 64
    scalar = int.from_bytes(kb, "little")
    x1 = (int.from_bytes(u, "little") & ((1 << 255) - 1)) % P
    x2, z2, x3, z3, swap = 1, 0, x1, 1, 0
    for t in reversed(range(255)):
        bit = (scalar >> t) & 1
        swap ^= bit
        if swap:
            x2, x3, z2, z3 = x3, x2, z3, z2
        swap = bit
        a, b = (x2 + z2) % P, (x2 - z2) % P
        aa, bb = a * a % P, b * b % P
        e = (aa - bb) % P
        c, d = (x3 + z3) % P, (x3 - z3) % P
        da, cb = d * a % P, c * b % P
        x3, z3 = (da + cb) ** 2 % P, x1 * (da - cb) ** 2 % P
        x2, z2 = aa * bb % P, e * (aa + 121665 * e) % P
    if swap:
        x2, x3, z2, z3 = x3, x2, z3, z2
    return (x2 * pow(z2, P - 2, P) % P).to_bytes(32, "little")


def _sodium(k: bytes, u: bytes) -> bytes | None:
    try:
        return nacl.bindings.crypto_scalarmult(k, u)
    except nacl.exceptions.RuntimeError:
        return None


def _openssl(k: bytes, u: bytes) -> bytes | None:
    try:
        return x25519.X25519PrivateKey.from_private_bytes(k).exchange(x25519.X25519PublicKey.from_public_bytes(u))
    except ValueError:
        return None


_ORDER8 = [bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
           bytes.fromhex("5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157")]
#: every encoding of a small-order u (0, 1, p - 1, the two of order 8; p and p + 1), each with and without the top bit
_SMALL = [x.to_bytes(32, "little") for x in (0, 1, P - 1, P, P + 1)] + _ORDER8
SMALL_ORDER = _SMALL + [s[:31] + bytes([s[31] | 0x80]) for s in _SMALL]
#: other edge encodings: every non-canonical u in [p + 2, 2^255) and the same with the top bit, 2^255 - 1, 2^256 - 1,
#: the base point, 2, and the top bit alone on a few
EDGE = ([(P + i).to_bytes(32, "little") for i in range(2, 19)]
        + [((P + i) | (1 << 255)).to_bytes(32, "little") for i in range(2, 19)]
        + [(2**255 - 1).to_bytes(32, "little"), (2**256 - 1).to_bytes(32, "little"), (9).to_bytes(32, "little"),
           (2).to_bytes(32, "little"), (1 << 255 | 9).to_bytes(32, "little"), (1 << 255 | 2).to_bytes(32, "little")])


def test_rfc_7748_section_5_2_vectors() -> None:
    for k, u, want in [
        ("a546e36bf0527c9d3b16154b82465edd62144c0ac1fc5a18506a2244ba449ac4",
         "e6db6867583030db3594c1a424b15f7c726624ec26b3353b10a903a6d0ab1c4c",
         "c3da55379de9c6908e94ea4df28d084f32eccf03491c71f754b4075577a28552"),
        ("4b66e9d4d1b4673c5ad22691957d6af5c11b6421e0ea01d42ca4169e7918ba0d",  # u has the top bit set
         "e5210f12786811d3f4b7959d0538ae2c31dbe7106fc03c3efc4cd549c715a493",
         "95cbde9476e8907d7aade45cb4b873f88b595a68799fa152e6f8f7647aac7957"),
    ]:
        kb, ub, wb = bytes.fromhex(k), bytes.fromhex(u), bytes.fromhex(want)
        assert _x25519_rfc7748(kb, ub) == _sodium(kb, ub) == _openssl(kb, ub) == wb


def test_libsodium_and_openssl_agree_on_random_and_edge_inputs() -> None:
    for _ in range(600):
        k, u = os.urandom(32), os.urandom(32)
        got = _sodium(k, u)
        assert got is not None and got == _openssl(k, u)
    for u in EDGE:
        for k in [os.urandom(32) for _ in range(8)]:
            got = _sodium(k, u)
            assert got is not None and got == _openssl(k, u), u.hex()
        k = os.urandom(32)
        assert _sodium(k, u) == _x25519_rfc7748(k, u), u.hex()


def test_both_refuse_exactly_the_small_order_inputs() -> None:
    for u in SMALL_ORDER:
        for k in [os.urandom(32) for _ in range(8)] + [bytes(32), b"\xff" * 32]:
            assert _sodium(k, u) is None and _openssl(k, u) is None, u.hex()
        assert _x25519_rfc7748(os.urandom(32), u) == bytes(32)  # all-zero output, RFC 7748 Section 6.1
    for k in (bytes(32), b"\xff" * 32):  # extreme scalars on ordinary points
        for u in EDGE[:4] + [os.urandom(32) for _ in range(20)]:
            assert _sodium(k, u) == _openssl(k, u) == _x25519_rfc7748(k, u)


@pytest.mark.parametrize("point", SMALL_ORDER, ids=lambda p: p.hex()[:6] + p.hex()[-2:])
def test_small_order_enc_is_refused_before_anything_is_written(point: bytes) -> None:
    opener = BaseModeOpener(os.urandom(32), b"")
    backing = bytearray(b"\xa5" * 300)
    with pytest.raises(OpenFailed, match="small order"):
        opener.open_into(point, bytes(100 + TAG_BYTES), memoryview(backing)[10:60], memoryview(backing)[60:110])
    assert backing == b"\xa5" * 300


# ------------------------------------------------------------------------------------------ streaming AES-GCM
def _guarded(sizes: list[int], pad: int = 23, fill: int = 0xC3) -> tuple[list[bytearray], list[memoryview]]:
    backings = [bytearray([fill]) * (n + 2 * pad) for n in sizes]
    return backings, [memoryview(b)[pad : pad + n] for b, n in zip(backings, sizes, strict=True)]


def _untouched_outside(backings: list[bytearray], sizes: list[int], pad: int = 23, fill: int = 0xC3) -> bool:
    return all(b[:pad] == bytes([fill]) * pad and b[pad + n :] == bytes([fill]) * pad
               for b, n in zip(backings, sizes, strict=True))


def test_every_two_way_split_up_to_40_bytes_writes_exactly_its_views() -> None:
    sk = x25519.X25519PrivateKey.generate()
    opener = BaseModeOpener(sk.private_bytes_raw(), b"split")
    for n in range(0, 41):
        pt = os.urandom(n)
        blob = SUITE.encrypt(pt, sk.public_key(), b"split")
        enc, ct = blob[:ENC_BYTES], memoryview(blob)[ENC_BYTES:]
        bad = bytearray(blob[ENC_BYTES:])
        bad[-1] ^= 1
        for k in range(0, n + 1):
            sizes = [k, n - k]
            backings, views = _guarded(sizes)
            opener.open_into(enc, ct, *views)
            assert b"".join(bytes(v) for v in views) == pt and _untouched_outside(backings, sizes), (n, k)
            backings, views = _guarded(sizes)
            with pytest.raises(OpenFailed, match="tag"):
                opener.open_into(enc, bytes(bad), *views)
            assert _untouched_outside(backings, sizes), (n, k)
        # three and more parts, zero-length ones among them
        for sizes in ([0] * 3 + [n], [1] * n + [0], [n // 3, 0, n - n // 3] if n else [0, 0]):
            backings, views = _guarded(sizes, pad=16, fill=0x00)
            opener.open_into(enc, ct, *views)
            assert b"".join(bytes(v) for v in views) == pt and _untouched_outside(backings, sizes, 16, 0), sizes
        if n == 0:  # an empty plaintext: no buffer at all, or empty ones
            opener.open_into(enc, ct)
            opener.open_into(enc, ct, memoryview(bytearray()), memoryview(bytearray()))


def test_large_plaintexts_split_at_awkward_places() -> None:
    sk = x25519.X25519PrivateKey.generate()
    opener = BaseModeOpener(sk.private_bytes_raw(), b"large")
    rng = random.Random(3817)
    for n in (65_536, 100_000 + 113, (1 << 20) + 7):
        pt = os.urandom(n)
        blob = SUITE.encrypt(pt, sk.public_key(), b"large")
        enc, ct = blob[:ENC_BYTES], blob[ENC_BYTES:]
        cuts = sorted({113, 16, 15, 17, n - 15, n - 16, n - 1, *(rng.randrange(n) for _ in range(5))})
        bounds = [0, *cuts, n]
        sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
        backings, views = _guarded(sizes)
        opener.open_into(enc, ct, *views)
        assert b"".join(bytes(v) for v in views) == pt and _untouched_outside(backings, sizes)
        bad = bytearray(ct)
        bad[n // 2] ^= 4
        backings, views = _guarded(sizes)
        with pytest.raises(OpenFailed):
            opener.open_into(enc, bytes(bad), *views)
        assert _untouched_outside(backings, sizes)


def test_size_mismatch_is_refused_before_anything_is_written() -> None:
    sk = x25519.X25519PrivateKey.generate()
    opener = BaseModeOpener(sk.private_bytes_raw(), b"")
    blob = SUITE.encrypt(b"z" * 50, sk.public_key(), b"")
    for sizes in ([49], [51], [10, 39], [10, 41]):
        backings, views = _guarded(sizes)
        with pytest.raises(ValueError, match="output buffers hold"):
            opener.open_into(blob[:ENC_BYTES], blob[ENC_BYTES:], *views)
        assert all(b == bytes([0xC3]) * len(b) for b in backings)
    with pytest.raises(ValueError, match="output buffers hold"):
        opener.open_into(blob[:ENC_BYTES], bytes(TAG_BYTES - 1))


@pytest.mark.parametrize("kind", ["mmap", "bytearray"])
def test_threads_open_into_adjacent_regions_of_one_buffer(kind: str) -> None:
    """Eight threads open into tightly packed slots of one buffer, neighbours handled by different threads, a quarter
    of the ciphertexts forged: every genuine slot ends with its plaintext, nothing before or after the slots moves."""
    sk = x25519.X25519PrivateKey.generate()
    opener = BaseModeOpener(sk.private_bytes_raw(), b"threads")
    length, count, threads, guard = 1021, 160, 8, 64  # odd length: slots straddle 16-byte blocks
    items = []
    for i in range(count):
        pt = os.urandom(113 + length)
        blob = bytearray(SUITE.encrypt(pt, sk.public_key(), b"threads"))
        forged = i % 4 == 1
        if forged:
            blob[-1 - (i % TAG_BYTES)] ^= 0x10
        items.append((pt, bytes(blob[:ENC_BYTES]), bytes(blob[ENC_BYTES:]), forged))
    size = 2 * guard + count * length
    buf: mmap.mmap | bytearray = mmap.mmap(-1, size) if kind == "mmap" else bytearray(size)
    buf[:] = b"\xee" * size
    outcome: dict[int, str] = {}
    barrier = threading.Barrier(threads)

    def run(t: int) -> None:
        barrier.wait()
        for _ in range(12):  # several rounds: the same slots written again while neighbours are being written
            for i in range(t, count, threads):
                pt, enc, ct, _ = items[i]
                head = bytearray(113)
                start = guard + i * length
                with memoryview(buf) as whole:
                    try:
                        opener.open_into(enc, ct, memoryview(head), whole[start : start + length])
                        # only this thread writes this slot: it must hold the plaintext now, whatever the others do
                        good = head == pt[:113] and whole[start : start + length] == pt[113:]
                        outcome[i] = "ok" if good and outcome.get(i, "ok") == "ok" else "bad"
                    except OpenFailed:
                        outcome[i] = "failed"

    workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: a shared scratch buffer would show
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(interval)
    assert buf[:guard] == b"\xee" * guard and buf[guard + count * length :] == b"\xee" * guard
    for i, (pt, _, _, forged) in enumerate(items):
        assert outcome[i] == ("failed" if forged else "ok"), i
        if not forged:
            assert buf[guard + i * length : guard + (i + 1) * length] == pt[113:], i
    if isinstance(buf, mmap.mmap):
        buf.close()


# ------------------------------------------------------------------------------- error mapping at the envelope
def _outer_opener() -> tuple[env.OuterOpener, bytes, x25519.X25519PrivateKey]:
    sk = x25519.X25519PrivateKey.generate()
    digest = os.urandom(32)
    opener = env.OuterOpener(sk, key_epoch=7, round_id=3, model_digest=digest)
    server_pk = x25519.X25519PrivateKey.generate().public_key().public_bytes_raw()
    envelope = env.seal(os.urandom(500), server_public_key=server_pk,
                        shuffler_public_key=sk.public_key().public_bytes_raw(),
                        signing_key=ed25519.Ed25519PrivateKey.generate().private_bytes_raw(), key_epoch=7,
                        round_id=3, model_digest=digest)
    return opener, envelope, sk


def test_decrypt_into_raises_only_envelope_errors_on_hostile_input() -> None:
    opener, envelope, _ = _outer_opener()
    prefix = struct.pack(">BI", env.ENVELOPE_VERSION, 7)
    body_len = len(envelope) - 5
    L = env.inner_length_for(len(envelope))
    want = opener.open(envelope)  # cryptography's HPKE (OuterOpener.decrypt), then the signature
    # the genuine one, from every kind of buffer, opens to the same bytes and verifies
    for form in (bytes, bytearray, memoryview):
        out = memoryview(bytearray(L))
        got = opener.verify(opener.decrypt_into(form(envelope), out))
        assert bytes(out) == bytes(want.inner) and got.inner_hash == want.inner_hash == env.inner_hash(out)
        assert (got.report_id, got.signer_public_key, got.enc) == (want.report_id, want.signer_public_key, want.enc)
    hostile = []
    for enc in SMALL_ORDER + EDGE + [os.urandom(32) for _ in range(20)]:
        hostile.append(prefix + enc + envelope[5 + ENC_BYTES :])  # another enc, the rest genuine
        hostile.append(prefix + enc + os.urandom(body_len - ENC_BYTES))
    for pos in range(5, len(envelope), 37):
        bad = bytearray(envelope)
        bad[pos] ^= 0x80
        hostile.append(bytes(bad))
    mm = mmap.mmap(-1, 2 * L + 64)
    try:
        for h in hostile:
            for out in (memoryview(bytearray(L)), memoryview(mm)[32 : 32 + L]):
                with pytest.raises(env.EnvelopeError) as info:
                    opener.decrypt_into(h, out)
                assert info.value.reason == "undecryptable"
                out.release()
        # any length from the minimum to past the genuine one: refusal by reason, never another exception
        for n in (env.ENVELOPE_OVERHEAD - 1, env.ENVELOPE_OVERHEAD, env.ENVELOPE_OVERHEAD + 1, len(envelope) + 3):
            h = prefix + os.urandom(max(n - 5, 0))
            with pytest.raises(env.EnvelopeError):
                opener.decrypt_into(h, memoryview(bytearray(max(env.inner_length_for(n), 0))))
        with memoryview(mm) as whole:  # nothing outside the slot was written by all of the above
            assert whole[:32] == bytes(32) and whole[32 + L :] == bytes(L + 32)
    finally:
        mm.close()


def test_cryptography_refuses_what_the_opener_refuses() -> None:
    """A forged enc is refused by both implementations alike (``InvalidTag`` or ``ValueError`` there,
    ``OpenFailed`` here), so switching implementations changed no acceptance decision."""
    sk = x25519.X25519PrivateKey.generate()
    opener = BaseModeOpener(sk.private_bytes_raw(), b"i")
    blob = SUITE.encrypt(b"q" * 40, sk.public_key(), b"i")
    for enc in SMALL_ORDER + EDGE[:6]:
        with pytest.raises((InvalidTag, ValueError)):
            SUITE.decrypt(enc + blob[ENC_BYTES:], sk, b"i")
        with pytest.raises(OpenFailed):
            opener.open_into(enc, blob[ENC_BYTES:], memoryview(bytearray(40)))
