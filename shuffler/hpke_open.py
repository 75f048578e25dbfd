"""RFC 9180 base-mode single-shot open, written out for the one suite the envelopes use: DHKEM(X25519,
HKDF-SHA256), HKDF-SHA256, AES-128-GCM (Barnes, Bhargavan, Lipp and Wood, RFC 9180, 2022; Sections 4.1, 5.1, 5.2
and 7.1), decrypting into a caller's buffer.

The shuffler opens every envelope's outer layer with it (:meth:`shuffledp.shuffler.envelope.OuterOpener.decrypt_into`)
on several threads at once. What it is made of is chosen for how each piece treats the GIL, which decides whether
two threads opening envelopes overlap:

* the X25519 shared secret with libsodium (PyNaCl's ``crypto_scalarmult``, which releases the GIL while it
  computes); ``cryptography``'s ``exchange`` holds it for its 40 us, so two threads opening envelopes with it run
  one after the other;
* the key schedule's five HMAC-SHA256 evaluations with ``hashlib`` objects, each key's padded inner and outer
  states computed once (the zero salt's at import), which keeps the GIL for these few microseconds instead of
  releasing and re-taking it five times (``hmac.digest`` releases it on every call, and a thread that gives the GIL
  up waits to get it back behind the others);
* AES-GCM as a stream into the caller's buffers (``cryptography``'s GCM decryptor, which releases the GIL), so
  that an envelope's inner ciphertext is decrypted straight into its staging slot and its head elsewhere.

Each step is the RFC's; tests check the result against ``cryptography``'s HPKE on the same envelopes, and check
that the small-order public keys ``cryptography`` refuses are refused here too (libsodium's ``crypto_scalarmult``
fails on an all-zero shared secret, RFC 7748 Section 6.1).
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import nacl.bindings
import nacl.exceptions
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

__all__ = ["BaseModeOpener", "OpenFailed", "ENC_BYTES", "TAG_BYTES", "labeled_extract"]

ENC_BYTES = 32  # an X25519 public key
TAG_BYTES = 16  # AES-128-GCM
_NK = 16  # AES-128-GCM key bytes
_NN = 12  # AES-128-GCM nonce bytes
#: ``update_into``'s room beyond the output: the AES block size less one
_SLACK = 15
#: RFC 9180 suite ids: KEM 0x0020 (DHKEM(X25519, HKDF-SHA256)); KDF 0x0001 (HKDF-SHA256); AEAD 0x0001 (AES-128-GCM)
_KEM_SUITE_ID = b"KEM\x00\x20"
_HPKE_SUITE_ID = b"HPKE\x00\x20\x00\x01\x00\x01"
_BLOCK = 64  # SHA-256's block, the HMAC key's padded length (RFC 2104)
_IPAD = bytes(b ^ 0x36 for b in range(256))
_OPAD = bytes(b ^ 0x5C for b in range(256))


class OpenFailed(ValueError):
    """The ciphertext did not open: its encapsulated key gives no shared secret (a small-order point) or the AEAD
    tag does not verify (wrong key, wrong ``info``, modified bytes)."""


def _hmac_states(key: bytes) -> tuple["hashlib._Hash", "hashlib._Hash"]:
    """HMAC-SHA256's inner and outer hash states after the padded key (RFC 2104: a key longer than the 64-byte block
    is hashed first)."""
    if len(key) > _BLOCK:
        key = hashlib.sha256(key).digest()
    padded = key.ljust(_BLOCK, b"\x00")
    return hashlib.sha256(padded.translate(_IPAD)), hashlib.sha256(padded.translate(_OPAD))


def _hmac(states: tuple["hashlib._Hash", "hashlib._Hash"], message: bytes) -> bytes:
    """HMAC-SHA256 of ``message`` under the key whose states :func:`_hmac_states` made (returns 32 bytes)."""
    inner = states[0].copy()
    inner.update(message)
    outer = states[1].copy()
    outer.update(inner.digest())
    return outer.digest()


def labeled_extract(suite_id: bytes, salt: bytes, label: bytes, ikm: bytes) -> bytes:
    """RFC 9180 LabeledExtract with HKDF-SHA256 (Section 4): HMAC(salt or 32 zero bytes, "HPKE-v1" || suite || label
    || ikm). Returns the 32-byte pseudorandom key."""
    return _hmac(_hmac_states(salt or bytes(32)), b"HPKE-v1" + suite_id + label + ikm)


def _expand_input(suite_id: bytes, label: bytes, info: bytes, length: int) -> bytes:
    """The HMAC input of RFC 9180 LabeledExpand with HKDF-SHA256 for ``length`` <= 32 (one HMAC block, keyed with
    the PRK): ``I2OSP(length, 2) || "HPKE-v1" || suite || label || info || 0x01``."""
    return struct.pack(">H", length) + b"HPKE-v1" + suite_id + label + info + b"\x01"


#: DHKEM's ``LabeledExtract("", "eae_prk", dh)``: the zero salt's HMAC states and the input before ``dh``
_ZERO_SALT_STATES = _hmac_states(bytes(32))
_EAE_PRK_INPUT = b"HPKE-v1" + _KEM_SUITE_ID + b"eae_prk"
#: ``LabeledExpand(eae_prk, "shared_secret", enc || pkR, 32)``: the input before ``enc || pkR``
_SHARED_SECRET_INPUT = struct.pack(">H", 32) + b"HPKE-v1" + _KEM_SUITE_ID + b"shared_secret"
#: ``LabeledExtract(shared_secret, "secret", "")`` (base mode: no PSK)
_SECRET_INPUT = b"HPKE-v1" + _HPKE_SUITE_ID + b"secret"


class BaseModeOpener:
    """Opens single-shot base-mode HPKE ciphertexts made for one X25519 key and one ``info`` (empty AAD, as
    ``cryptography``'s HPKE seals them).

    Args:
        private_key: the recipient's raw 32-byte X25519 private key.
        info: the ``info`` every ciphertext was sealed with.
    """

    def __init__(self, private_key: bytes, info: bytes) -> None:
        if len(private_key) != 32:
            raise ValueError(f"an X25519 private key is 32 bytes, got {len(private_key)}")
        self._sk = bytes(private_key)
        self._pk = nacl.bindings.crypto_scalarmult_base(self._sk)
        # key_schedule_context of base mode: mode || psk_id_hash || info_hash (Section 5.1)
        context = b"\x00" + labeled_extract(_HPKE_SUITE_ID, b"", b"psk_id_hash", b"") + labeled_extract(
            _HPKE_SUITE_ID, b"", b"info_hash", info
        )
        self._key_input = _expand_input(_HPKE_SUITE_ID, b"key", context, _NK)
        self._nonce_input = _expand_input(_HPKE_SUITE_ID, b"base_nonce", context, _NN)

    @property
    def public_key(self) -> bytes:
        """The recipient's raw X25519 public key (32 bytes)."""
        return self._pk

    def open_into(self, enc: bytes, ciphertext: bytes | memoryview, *outs: memoryview) -> None:
        """Decrypt ``ciphertext`` (the AEAD output: plaintext then 16-byte tag) sealed to ``enc`` into ``outs``,
        writable buffers whose lengths add up to ``len(ciphertext) - 16``: the plaintext's first ``len(outs[0])``
        bytes go to ``outs[0]``, the next to ``outs[1]``, and so on, and no byte outside them is written. Returns
        nothing; raises :class:`OpenFailed` (the buffers then hold unauthenticated bytes, unusable).

        AES-GCM runs as a stream (``cryptography``'s GCM decryptor, which releases the GIL), so a caller can send
        the plaintext's parts to separate places, such as an envelope's head to a small buffer and its inner
        ciphertext straight into a staging slot, with no copy; the tag is checked at the end (NIST SP 800-38D,
        Section 7.2, decryption before the tag check, whose output is released only after it)."""
        enc = bytes(enc)  # PyNaCl's binding takes bytes only
        if len(enc) != ENC_BYTES:  # PyNaCl passes the pointer on: libsodium would read 32 bytes whatever it is given
            raise ValueError(f"an encapsulated key is {ENC_BYTES} bytes, got {len(enc)}")
        ct = memoryview(ciphertext)
        if len(ct) < TAG_BYTES or sum(len(o) for o in outs) != len(ct) - TAG_BYTES:
            raise ValueError(f"the output buffers hold {sum(len(o) for o in outs)} bytes; the plaintext is "
                             f"{max(len(ct) - TAG_BYTES, 0)}")
        try:
            dh = nacl.bindings.crypto_scalarmult(self._sk, enc)
        except nacl.exceptions.RuntimeError as exc:  # libsodium refuses an all-zero shared secret
            raise OpenFailed("the encapsulated key is a point of small order") from exc
        # DHKEM Decap (Section 4.1): eae_prk, then shared_secret; the key schedule (Section 5.1): secret, key, nonce
        eae_prk = _hmac(_ZERO_SALT_STATES, _EAE_PRK_INPUT + dh)
        shared = _hmac(_hmac_states(eae_prk), _SHARED_SECRET_INPUT + enc + self._pk + b"\x01")
        secret = _hmac_states(_hmac(_hmac_states(shared), _SECRET_INPUT))
        key = _hmac(secret, self._key_input)[:_NK]
        nonce = _hmac(secret, self._nonce_input)[:_NN]
        end = len(ct) - TAG_BYTES
        decryptor = Cipher(algorithms.AES(key), modes.GCM(nonce, bytes(ct[end:]))).decryptor()
        at = 0
        for out in outs:
            _update_exactly(decryptor, ct[at : at + len(out)], out)
            at += len(out)
        try:
            decryptor.finalize()
        except InvalidTag as exc:
            raise OpenFailed("the AEAD tag does not verify") from exc


def _update_exactly(decryptor: Any, data: memoryview, out: memoryview) -> None:
    """``decryptor.update_into(data, ...)`` writing exactly ``out`` (``len(out) == len(data)``). ``update_into`` asks
    for ``block size - 1`` = 15 bytes of room beyond the output, which GCM, a counter mode, never writes; so all but
    the last 15 bytes go straight into ``out`` (a view of ``len(out)`` bytes gives that room) and the last 15
    through a small buffer."""
    n = len(data)
    head = max(n - _SLACK, 0)
    if head and decryptor.update_into(data[:head], out) != head:
        raise RuntimeError("the GCM decryptor did not return its input's length")  # a counter mode always does
    tail = bytearray(2 * _SLACK)
    if decryptor.update_into(data[head:], tail) != n - head:
        raise RuntimeError("the GCM decryptor did not return its input's length")
    out[head:] = tail[: n - head]
