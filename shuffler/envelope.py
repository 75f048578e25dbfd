"""The sealed-report envelope (format versions 1 and 2; :func:`seal` writes version 2).

A client seals one fixed-length payload twice with HPKE (RFC 9180, base mode; suite DHKEM(X25519,
HKDF-SHA256), HKDF-SHA256, AES-128-GCM, as implemented by ``cryptography``) and signs it with its enrolled
Ed25519 key (RFC 8032). ``cryptography``'s HPKE has no AAD argument, so all context is bound through ``info``.

The two versions differ in one function only, the hash ``H`` of the inner ciphertext that the signature
covers: SHA-256 (FIPS 180-4) in version 1, BLAKE3 with its default 32-byte output (O'Connor, Aumasson, Neves and
Wilcox-O'Hearn, 2020) in version 2. ``version`` below is the envelope's version, and it is bound everywhere the
version appears, so an envelope cannot be opened or verified as the other version.

All integers are big-endian. ``||`` is concatenation.

``binding = "SDPB" || version:u8 || key_epoch:u32 || round_id:u64 || model_digest:32B`` (49 bytes)

Inner layer (only the server can open it)::

    inner      = HPKE.Seal(pk_server, info = "shuffledp/inner" || version:u8 || key_epoch:u32 || round_id:u64,
                           pt = payload)                      # = enc:32B || ct(payload) || tag:16B

Outer layer (only the shuffler can open it)::

    message    = "shuffledp/report-signature/v1" || binding || report_id:16B || len(inner):u64 || H(inner)
    outer_pt   = version:u8 || report_id:16B || signer_public_key:32B || Ed25519.Sign(sk_client, message):64B
                 || inner
    envelope   = version:u8 || key_epoch:u32 || HPKE.Seal(pk_shuffler, info = "shuffledp/outer" || binding,
                                                             pt = outer_pt)

The 5-byte clear prefix (version, key epoch) only lets the shuffler reject a stale epoch with a precise reason;
both values are also bound into ``info``, so changing them makes the envelope undecryptable. The signer's
public key and the signature sit *inside* the outer layer: the server, which relays envelopes, cannot read
who signed one. The report id is 16 random bytes from ``secrets``; the shuffler's replay cache is keyed by it
and by the outer HPKE encapsulated key ``enc`` (fresh per seal).

Sizes: ``len(inner) = len(payload) + 48`` and ``len(envelope) = len(payload) + ENVELOPE_OVERHEAD`` (214 bytes),
so fixed-length payloads give fixed-length envelopes.

Why these choices: Prochlo's ESA shuffler (Bittau et al., SOSP 2017) used a home-made KDF and no context
binding; HPKE gives a standard KEM/KDF/AEAD composition, ``info`` binding stops cross-round and cross-model
replays (the decryption fails), and the signature lets the shuffler count distinct enrolled clients.

Why version 2: the shuffler hashes every inner ciphertext it accepts (to check the signature, and again, by
reusing that hash, for the output digest of its attestation), and the server hashes every one it fetches.
On the 2-core benchmark machine SHA-256 (with the SHA extensions) takes 49 us per 100 KiB and BLAKE3 12 us,
which is most of the difference between missing and meeting the shuffler's throughput goal (>= 300 MB/s of
submit + fetch on 2 cores, ``benchmarks/bench_shuffler.py``). Version 1 stays readable for envelopes and batches
of older peers.

The shuffler checks report signatures with libsodium (PyNaCl's ``crypto_sign_open``): 37 us per signature here
against 60-65 us for ``cryptography``'s (OpenSSL); both release the GIL. Both implement RFC 8032 verification and
accept every signature an honest signer makes; libsodium is the stricter of the two on crafted inputs: it rejects
small-order public keys and non-canonical encodings, where OpenSSL's cofactorless check accepts, for instance,
the identity point as public key with R = identity and S = 0 for every message. The enrolment refuses such keys
(``shuffledp.shuffler.keys``). BLAKE3 gains from about 16 KiB of inner ciphertext on; below that the ``blake3``
package's per-call overhead makes it slightly slower than SHA-256 (about 3 us against 1.6 us at 2.7 KB), which is
immaterial next to the signature check.
"""

from __future__ import annotations

import functools
import hashlib
import secrets
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import blake3
import nacl.bindings
import nacl.exceptions
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric import ed25519, x25519
from cryptography.hazmat.primitives.hpke import AEAD, KDF, KEM, Suite

from shuffledp.shuffler.hpke_open import ENC_BYTES, TAG_BYTES, BaseModeOpener, OpenFailed
from shuffledp.shuffler.validation import is_int

__all__ = [
    "ENVELOPE_VERSION",
    "ENVELOPE_VERSIONS",
    "inner_hash",
    "ENVELOPE_OVERHEAD",
    "INNER_OVERHEAD",
    "OUTER_HEAD_BYTES",
    "inner_length_for",
    "DIGEST_BYTES",
    "REPORT_ID_BYTES",
    "ENC_BYTES",
    "EnvelopeError",
    "OpenedReport",
    "DecryptedReport",
    "binding",
    "model_digest",
    "seal",
    "open_outer",
    "OuterOpener",
    "open_inner",
    "peek_prefix",
]

#: The version :func:`seal` writes and the server's submissions announce.
ENVELOPE_VERSION = 2
#: The versions the shuffler opens and the server can open (version 1: SHA-256 inner hash).
ENVELOPE_VERSIONS = frozenset({1, 2})
DIGEST_BYTES = 32
REPORT_ID_BYTES = 16
_KEY_BYTES = 32
_SIG_BYTES = 64
_PREFIX = struct.Struct(">BI")  # version, key_epoch
_U64 = struct.Struct(">Q")
_OUTER_HEAD = struct.Struct(f">B{REPORT_ID_BYTES}s{_KEY_BYTES}s{_SIG_BYTES}s")
INNER_OVERHEAD = ENC_BYTES + TAG_BYTES
#: Bytes of outer plaintext before the inner ciphertext: version, report id, signer key, signature
OUTER_HEAD_BYTES = _OUTER_HEAD.size
ENVELOPE_OVERHEAD = _PREFIX.size + ENC_BYTES + TAG_BYTES + _OUTER_HEAD.size + INNER_OVERHEAD
MIN_ENVELOPE_BYTES = ENVELOPE_OVERHEAD


def inner_length_for(envelope_length: int) -> int:
    """The length of the inner ciphertext carried by an envelope of ``envelope_length`` bytes (the outer layer
    adds ``ENVELOPE_OVERHEAD - INNER_OVERHEAD`` = 166 bytes around it)."""
    return envelope_length - (ENVELOPE_OVERHEAD - INNER_OVERHEAD)

_SUITE = Suite(KEM.X25519, KDF.HKDF_SHA256, AEAD.AES_128_GCM)
_MAX_U32 = 2**32 - 1
_MAX_U64 = 2**64 - 1
_SIG_DOMAIN = b"shuffledp/report-signature/v1"
_DIGEST_DOMAIN = b"shuffledp/model-digest/v1"


class EnvelopeError(ValueError):
    """An envelope or inner ciphertext was rejected. ``reason`` is a short machine-readable code.

    Reasons: ``malformed`` (too short, bad structure), ``wrong_version``, ``wrong_epoch``, ``undecryptable``
    (HPKE authentication failed: wrong key, wrong round/epoch/model digest, or modified bytes; these are
    indistinguishable by design), ``bad_signature``.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class OpenedReport:
    """What the shuffler learns from a verified envelope (see :func:`open_outer`)."""

    signer_public_key: bytes  # raw Ed25519 public key (32 bytes); looked up in the enrolment
    report_id: bytes  # 16 random bytes chosen by the client
    enc: bytes  # outer HPKE encapsulated key (32 bytes), the replay tag
    inner: bytes | memoryview  # the inner ciphertext (a view, not a copy), forwarded after shuffling
    inner_hash: bytes = b""  # H(inner) of the envelope's version, computed for the signature check; reused by
    # the output digest (shuffledp.shuffler.attestation)


@dataclass(frozen=True)
class DecryptedReport:
    """An outer layer that HPKE opened but whose signature is not yet checked (:meth:`OuterOpener.decrypt`).

    Nothing in it is authenticated as coming from an enrolled client until :meth:`OuterOpener.verify` returns.
    """

    enc: bytes  # outer HPKE encapsulated key (32 bytes)
    outer_plaintext: bytes  # version, report id, signer, signature, inner ciphertext (or without it, see inner)
    #: the inner ciphertext where :meth:`OuterOpener.decrypt_into` wrote it (``outer_plaintext`` then holds only
    #: what precedes it); None when it is the rest of ``outer_plaintext``
    inner: memoryview | None = None
    #: ``H(inner)`` when :meth:`OuterOpener.decrypt_into` took it, else empty (:meth:`OuterOpener.verify` takes it)
    inner_hash: bytes = b""

    @property
    def size(self) -> int:
        """Bytes of outer plaintext (the inner ciphertext included)."""
        return len(self.outer_plaintext) + (0 if self.inner is None else len(self.inner))


def _check_uint(name: str, value: int, maximum: int) -> None:
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= maximum:
        raise ValueError(f"{name} must be in [0, {maximum}], got {value}")


def _check_bytes(name: str, value: object, length: int | None = None) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"{name} must be bytes, got {type(value).__name__}")
    value = bytes(value)
    if length is not None and len(value) != length:
        raise ValueError(f"{name} must be exactly {length} bytes, got {len(value)}")
    return value


def _check_version(version: int) -> int:
    if not is_int(version):
        raise TypeError(f"version must be an int, got {type(version).__name__}")
    if version not in ENVELOPE_VERSIONS:
        raise ValueError(f"envelope version must be one of {sorted(ENVELOPE_VERSIONS)}, got {version}")
    return version


def inner_hash(inner: bytes | memoryview, version: int = ENVELOPE_VERSION) -> bytes:
    """``H(inner)`` of envelope ``version`` (32 bytes): SHA-256 for version 1, BLAKE3 for version 2. This is
    what a report's signature covers and what the output digest of a batch of that version hashes per item."""
    if _check_version(version) == 1:
        return hashlib.sha256(inner).digest()
    return blake3.blake3(inner).digest()


def binding(key_epoch: int, round_id: int, model_digest: bytes, version: int = ENVELOPE_VERSION) -> bytes:
    """The 49-byte context a report is bound to: version, key epoch, round id and model digest."""
    _check_uint("key_epoch", key_epoch, _MAX_U32)
    _check_uint("round_id", round_id, _MAX_U64)
    digest = _check_bytes("model_digest", model_digest, DIGEST_BYTES)
    return b"SDPB" + struct.pack(">BIQ", _check_version(version), key_epoch, round_id) + digest


def _inner_info(key_epoch: int, round_id: int, version: int) -> bytes:
    return b"shuffledp/inner" + struct.pack(">BIQ", version, key_epoch, round_id)


def _outer_info(bind: bytes) -> bytes:
    return b"shuffledp/outer" + bind


def _signed_message(bind: bytes, report_id: bytes, length: int, digest: bytes) -> bytes:
    # The signature covers H(inner) rather than the ciphertext itself, so that Ed25519 (which hashes its
    # message twice with SHA-512) stays cheap for megabyte-sized reports.
    return _SIG_DOMAIN + bind + report_id + struct.pack(">Q", length) + digest


def model_digest(chunks: Iterable[bytes]) -> bytes:
    """SHA-256 over domain tag || count-free sequence of (len:u64 || chunk) for each chunk.

    Each chunk is length-prefixed, so no two different chunk sequences hash the same input. Chunks may be any
    bytes-like objects (for example ``memoryview`` of a contiguous numpy array). Returns 32 bytes.
    """
    h = hashlib.sha256(_DIGEST_DOMAIN)
    for i, chunk in enumerate(chunks):
        try:
            view = memoryview(chunk)
        except TypeError:
            raise TypeError(f"model_digest: chunk {i} must be bytes-like, got {type(chunk).__name__}") from None
        if not view.c_contiguous:
            raise ValueError(f"model_digest: chunk {i} is not C-contiguous; pass a contiguous copy")
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        h.update(struct.pack(">Q", view.nbytes))
        h.update(view)
    return h.digest()


# Key objects parsed from raw bytes, kept per process: a simulation actor seals for hundreds of clients and the
# server opens every report of a round with one key; parsing each time costs about as much as a signature.
@functools.lru_cache(maxsize=4096)
def _x25519_public(raw: bytes) -> x25519.X25519PublicKey:
    return x25519.X25519PublicKey.from_public_bytes(raw)


@functools.lru_cache(maxsize=4096)
def _ed25519_signing(raw: bytes) -> tuple[ed25519.Ed25519PrivateKey, bytes]:
    sk = ed25519.Ed25519PrivateKey.from_private_bytes(raw)
    return sk, sk.public_key().public_bytes_raw()


@functools.lru_cache(maxsize=16)
def _x25519_private(raw: bytes) -> x25519.X25519PrivateKey:
    return x25519.X25519PrivateKey.from_private_bytes(raw)


def seal(
    payload: bytes,
    *,
    server_public_key: bytes,
    shuffler_public_key: bytes,
    signing_key: bytes,
    key_epoch: int,
    round_id: int,
    model_digest: bytes,
    version: int = ENVELOPE_VERSION,
) -> bytes:
    """Seal ``payload`` into an envelope of format ``version`` (see the module docstring; default 2).

    Keys are raw bytes: X25519 public keys of the server and the shuffler (32 bytes each) and the client's
    Ed25519 private key (32 bytes). Returns ``len(payload) + ENVELOPE_OVERHEAD`` bytes.
    """
    payload = _check_bytes("payload", payload)
    server_pk = _x25519_public(_check_bytes("server_public_key", server_public_key, _KEY_BYTES))
    shuffler_pk = _x25519_public(_check_bytes("shuffler_public_key", shuffler_public_key, _KEY_BYTES))
    sk, signer = _ed25519_signing(_check_bytes("signing_key", signing_key, _KEY_BYTES))
    bind = binding(key_epoch, round_id, model_digest, version)

    inner = _SUITE.encrypt(payload, server_pk, info=_inner_info(key_epoch, round_id, version))
    report_id = secrets.token_bytes(REPORT_ID_BYTES)
    signature = sk.sign(_signed_message(bind, report_id, len(inner), inner_hash(inner, version)))
    outer_pt = _OUTER_HEAD.pack(version, report_id, signer, signature) + inner
    return _PREFIX.pack(version, key_epoch) + _SUITE.encrypt(
        outer_pt, shuffler_pk, info=_outer_info(bind)
    )


def peek_prefix(envelope: bytes) -> tuple[int, int]:
    """Return the clear ``(version, key_epoch)`` prefix of an envelope (unauthenticated until opened)."""
    if len(envelope) < _PREFIX.size:
        raise EnvelopeError("malformed", f"envelope is {len(envelope)} bytes, shorter than its 5-byte prefix")
    version, epoch = _PREFIX.unpack_from(envelope, 0)
    return version, epoch


def open_outer(
    envelope: bytes,
    *,
    shuffler_private_key: bytes,
    key_epoch: int,
    round_id: int,
    model_digest: bytes,
    version: int = ENVELOPE_VERSION,
) -> OpenedReport:
    """Open and verify the outer layer of an envelope of format ``version`` (the shuffler's side).

    Checks, in order: length, version, key epoch, HPKE authentication under the expected binding, inner
    version, and the Ed25519 signature over (binding, report id, inner) by the key carried inside. Enrolment of
    that key is the caller's check. Raises :class:`EnvelopeError` with a ``reason`` on any failure.
    """
    sk = x25519.X25519PrivateKey.from_private_bytes(
        _check_bytes("shuffler_private_key", shuffler_private_key, _KEY_BYTES)
    )
    return OuterOpener(sk, key_epoch=key_epoch, round_id=round_id, model_digest=model_digest,
                       version=version).open(envelope)


class OuterOpener:
    """:func:`open_outer` with the key and binding prepared once, for opening a whole batch."""

    def __init__(
        self,
        private_key: x25519.X25519PrivateKey,
        *,
        key_epoch: int,
        round_id: int,
        model_digest: bytes,
        version: int = ENVELOPE_VERSION,
    ) -> None:
        self._sk = private_key
        self._epoch = key_epoch
        self._version = _check_version(version)
        self._bind = binding(key_epoch, round_id, model_digest, version)
        self._info = _outer_info(self._bind)
        #: the outer layer's HPKE open into a caller's buffer (:meth:`decrypt_into`)
        self._hpke = BaseModeOpener(private_key.private_bytes_raw(), self._info)
        #: H of this version (:func:`inner_hash`) and the signed message's prefix (:func:`_signed_message`)
        self._hash = hashlib.sha256 if self._version == 1 else blake3.blake3
        self._signed_prefix = _SIG_DOMAIN + self._bind

    def open(self, envelope: bytes) -> OpenedReport:
        """Decrypt and verify one envelope (:meth:`decrypt` then :meth:`verify`)."""
        return self.verify(self.decrypt(envelope))

    def decrypt(self, envelope: bytes) -> "DecryptedReport":
        """The first half of :meth:`open`: the prefix checks and the HPKE open of the outer layer. The result is
        unverified: nothing in it may be used before :meth:`verify` returns. Raises :class:`EnvelopeError`."""
        if not isinstance(envelope, (bytes, bytearray, memoryview)):
            raise TypeError(f"envelope must be bytes, got {type(envelope).__name__}")
        self._check_prefix(envelope)
        body = memoryview(envelope)[_PREFIX.size :]
        try:
            outer_pt = _SUITE.decrypt(body, self._sk, info=self._info)
        except (InvalidTag, ValueError) as exc:
            raise EnvelopeError("undecryptable", "outer layer failed HPKE authentication") from exc
        if len(outer_pt) < _OUTER_HEAD.size + INNER_OVERHEAD:
            raise EnvelopeError("malformed", "outer plaintext too short")
        return DecryptedReport(enc=bytes(body[:ENC_BYTES]), outer_plaintext=outer_pt)

    def _check_prefix(self, envelope: bytes | bytearray | memoryview) -> None:
        """The public checks before any decryption: the length, then this batch's version and key epoch.
        Raises :class:`EnvelopeError`."""
        if len(envelope) < ENVELOPE_OVERHEAD:
            raise EnvelopeError(
                "malformed", f"envelope is {len(envelope)} bytes; at least {ENVELOPE_OVERHEAD} are required"
            )
        version, epoch = _PREFIX.unpack_from(envelope, 0)  # peek_prefix, the length checked above
        if version != self._version:
            raise EnvelopeError("wrong_version", f"envelope version {version}; this batch is version {self._version}")
        if epoch != self._epoch:
            raise EnvelopeError("wrong_epoch", f"envelope key epoch {epoch}; expected {self._epoch}")

    def decrypt_into(self, envelope: bytes | memoryview, inner_out: memoryview) -> "DecryptedReport":
        """:meth:`decrypt`, with the inner ciphertext written into ``inner_out`` (a writable buffer of exactly
        :func:`inner_length_for` ``(len(envelope))`` bytes, such as the shuffler's staging slot) and ``H(inner)``
        taken at once, while those bytes are in the cache: same format, same checks, no byte written outside
        ``inner_out`` and no second copy. The result's ``inner`` is ``inner_out``, its ``outer_plaintext`` the
        :data:`OUTER_HEAD_BYTES`-byte head. On an :class:`EnvelopeError` ``inner_out`` holds unauthenticated bytes:
        unusable.

        The outer layer is opened by :class:`shuffledp.shuffler.hpke_open.BaseModeOpener` (RFC 9180 base mode,
        written out so that threads opening envelopes overlap and the plaintext's two parts go to two places;
        tests check it against ``cryptography``'s HPKE).
        """
        self._check_prefix(envelope)
        view = memoryview(envelope)
        size = inner_length_for(len(view))
        if len(inner_out) != size:
            raise ValueError(f"inner_out must be {size} bytes (the inner ciphertext), got {len(inner_out)}")
        enc = bytes(view[_PREFIX.size : _PREFIX.size + ENC_BYTES])
        head = bytearray(OUTER_HEAD_BYTES)
        try:
            self._hpke.open_into(enc, view[_PREFIX.size + ENC_BYTES :], memoryview(head), inner_out)
        except OpenFailed as exc:  # a small-order enc, or a tag that does not verify
            raise EnvelopeError("undecryptable", "outer layer failed HPKE authentication") from exc
        return DecryptedReport(enc=enc, outer_plaintext=bytes(head), inner=inner_out,
                               inner_hash=self._hash(inner_out).digest())

    def verify(self, decrypted: "DecryptedReport") -> OpenedReport:
        """The second half of :meth:`open`: the inner version and the Ed25519 signature over (binding, report
        id, length and ``H`` of the inner ciphertext). Its two costly steps, the hash (unless
        :meth:`decrypt_into` took it) and the signature check (libsodium), release the GIL, so the shuffler may run
        this on a worker thread while it receives and decrypts the next envelopes. Raises :class:`EnvelopeError`."""
        outer_pt = decrypted.outer_plaintext
        inner_version, report_id, signer, signature = _OUTER_HEAD.unpack_from(outer_pt, 0)
        if inner_version != self._version:
            raise EnvelopeError("wrong_version", f"outer plaintext version {inner_version}")
        inner = memoryview(outer_pt)[_OUTER_HEAD.size :] if decrypted.inner is None else decrypted.inner
        digest = decrypted.inner_hash or self._hash(inner).digest()
        if len(signer) != _KEY_BYTES or len(signature) != _SIG_BYTES:  # fixed by _OUTER_HEAD; PyNaCl does
            # not check the key's length itself (libsodium would read 32 bytes whatever it is given)
            raise EnvelopeError("malformed", "signer key or signature of the wrong length")
        try:
            # combined mode (signature || message): PyNaCl exposes libsodium's detached check only through it
            nacl.bindings.crypto_sign_open(  # == signature || _signed_message(bind, report_id, len(inner), digest)
                signature + self._signed_prefix + report_id + _U64.pack(len(inner)) + digest, signer
            )
        except (nacl.exceptions.BadSignatureError, ValueError) as exc:
            raise EnvelopeError("bad_signature", "report signature does not verify") from exc
        return OpenedReport(signer_public_key=signer, report_id=report_id, enc=decrypted.enc, inner=inner,
                            inner_hash=digest)


def open_inner(
    inner: bytes, *, server_private_key: bytes, key_epoch: int, round_id: int, version: int = ENVELOPE_VERSION
) -> bytes:
    """Open an inner ciphertext of envelope format ``version`` (the server's side) and return the payload.

    Raises :class:`EnvelopeError` (reason ``undecryptable``) if the key, key epoch or round id do not match or
    the bytes were modified, and ``malformed`` if it is shorter than the HPKE overhead.
    """
    _check_uint("key_epoch", key_epoch, _MAX_U32)
    _check_uint("round_id", round_id, _MAX_U64)
    _check_version(version)
    sk = _x25519_private(_check_bytes("server_private_key", server_private_key, _KEY_BYTES))
    inner = _check_bytes("inner", inner)
    if len(inner) < INNER_OVERHEAD:
        raise EnvelopeError("malformed", f"inner ciphertext is {len(inner)} bytes; at least {INNER_OVERHEAD} needed")
    try:
        return _SUITE.decrypt(inner, sk, info=_inner_info(key_epoch, round_id, version))
    except (InvalidTag, ValueError) as exc:
        raise EnvelopeError("undecryptable", "inner layer failed HPKE authentication") from exc
