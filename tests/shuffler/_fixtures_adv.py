"""Helpers for the adversarial, crash and permutation tests of the shuffler (no fixtures with side effects here).

* :func:`craft_envelope` is an independent implementation of the envelope format documented in
  ``docs/shuffler.md`` (versions 1 and 2), with knobs to build envelopes that ``shuffledp.shuffler.envelope.seal``
  refuses to produce: a signature by another key under an enrolled signer's public key, a wrong version byte inside the
  outer layer, a signature over another binding, a short outer plaintext. Building honest envelopes with it and
  having the shuffler accept them is also a conformance check of the documented format.
* :func:`write_service_config` writes a ``shuffledp shuffler serve`` TOML file for the conftest ``kit``.
* :func:`proto_fields` decodes protobuf wire bytes without a schema (to look at exactly what is on the wire).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import struct
from pathlib import Path
from typing import Any

import blake3
import grpc
from cryptography.hazmat.primitives.asymmetric import ed25519, x25519
from cryptography.hazmat.primitives.hpke import AEAD, KDF, KEM, Suite

from shuffledp.shuffler import shuffler_pb2 as pb
from shuffledp.shuffler.envelope import ENVELOPE_VERSION, open_inner
from shuffledp.shuffler.process import ShufflerProcess

SUBMIT = "/shuffledp.shuffler.v1.Shuffler/Submit"
FETCH = "/shuffledp.shuffler.v1.Shuffler/Fetch"
STATS = "/shuffledp.shuffler.v1.Shuffler/Stats"
SERVICE = "shuffledp.shuffler.v1.Shuffler"

_SUITE = Suite(KEM.X25519, KDF.HKDF_SHA256, AEAD.AES_128_GCM)


# ----------------------------------------------------------------------------------------------- envelopes
def doc_binding(key_epoch: int, round_id: int, digest: bytes, version: int = 2) -> bytes:
    """``"SDPB" || version:u8 || key_epoch:u32 || round_id:u64 || model_digest:32B`` (docs/shuffler.md)."""
    return b"SDPB" + struct.pack(">BIQ", version, key_epoch, round_id) + digest


def craft_envelope(
    payload: bytes,
    *,
    server_pk: bytes,
    shuffler_pk: bytes,
    signing_sk: bytes,
    key_epoch: int,
    round_id: int,
    digest: bytes,
    claimed_signer_pk: bytes | None = None,
    sign_binding: bytes | None = None,
    sign_report_id: bytes | None = None,
    outer_version: int | None = None,
    prefix_version: int | None = None,
    report_id: bytes | None = None,
    truncate_outer_pt: int | None = None,
    version: int = 2,
    inner: bytes | None = None,
) -> bytes:
    """Build an envelope of format ``version`` from the documented format, with optional deviations (see module
    doc). The inner hash is SHA-256 for version 1 and BLAKE3 for version 2. ``inner``: wrap this inner ciphertext
    (another envelope's) instead of sealing ``payload``."""
    outer_version = version if outer_version is None else outer_version
    prefix_version = version if prefix_version is None else prefix_version
    bind = doc_binding(key_epoch, round_id, digest, version)
    if inner is None:
        inner = _SUITE.encrypt(
            payload,
            x25519.X25519PublicKey.from_public_bytes(server_pk),
            info=b"shuffledp/inner" + struct.pack(">BIQ", version, key_epoch, round_id),
        )
    rid = secrets.token_bytes(16) if report_id is None else report_id
    sk = ed25519.Ed25519PrivateKey.from_private_bytes(signing_sk)
    message = (
        b"shuffledp/report-signature/v1"
        + (bind if sign_binding is None else sign_binding)
        + (rid if sign_report_id is None else sign_report_id)
        + struct.pack(">Q", len(inner))
        + (hashlib.sha256(inner).digest() if version == 1 else blake3.blake3(inner).digest())
    )
    signature = sk.sign(message)
    signer = sk.public_key().public_bytes_raw() if claimed_signer_pk is None else claimed_signer_pk
    outer_pt = bytes([outer_version]) + rid + signer + signature + inner
    if truncate_outer_pt is not None:
        outer_pt = outer_pt[:truncate_outer_pt]
    outer = _SUITE.encrypt(
        outer_pt, x25519.X25519PublicKey.from_public_bytes(shuffler_pk), info=b"shuffledp/outer" + bind
    )
    return struct.pack(">BI", prefix_version, key_epoch) + outer


def envelope_enc(envelope: bytes) -> bytes:
    """The outer HPKE encapsulated key (bytes 5..37), the replay tag."""
    return envelope[5:37]


def open_all(kit: Any, inners: list[bytes], round_id: int) -> list[bytes]:
    return [open_inner(x, server_private_key=kit.server_sk, key_epoch=kit.key_epoch, round_id=round_id) for x in inners]


def read_journal(path: Path) -> list[dict[str, Any]]:
    """Read-only parse of ``journal.log`` (``"SJR1" || len:u32 || SHA-256(body) || body``), complete records only.

    Unlike ``shuffledp.shuffler.journal.Journal`` this never truncates a torn tail or deletes orphans, so it is safe to
    call while the service runs."""
    data = path.read_bytes()
    out: list[dict[str, Any]] = []
    pos = 0
    while pos + 40 <= len(data):
        magic, length = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "big")
        body = data[pos + 40 : pos + 40 + length]
        if magic != b"SJR1" or len(body) != length or hashlib.sha256(body).digest() != data[pos + 8 : pos + 40]:
            break
        out.append(json.loads(body))
        pos += 40 + length
    return out


# ------------------------------------------------------------------------------------------------- service
def write_service_config(
    kit: Any,
    path: Path,
    *,
    journal: str = "journal",
    k: int | None = None,
    max_envelope_bytes: int = 1 << 20,
    max_batch_reports: int | None = None,
    enrolment: Path | None = None,
) -> Path:
    """A mTLS service config next to ``path`` that uses the kit's key files (127.0.0.1, port 0)."""
    d = kit.d
    lines = [
        'address = "127.0.0.1:0"',
        f"key_epoch = {kit.key_epoch}",
        f"k = {kit.k if k is None else k}",
        f"max_envelope_bytes = {max_envelope_bytes}",
        f'hpke_key = "{d.shuffler_hpke_key}"',
        f'signing_key = "{d.shuffler_signing_key}"',
        f'enrolment = "{d.enrolment if enrolment is None else enrolment}"',
        f'journal_dir = "{journal}"',
    ]
    if max_batch_reports is not None:
        lines.append(f"max_batch_reports = {max_batch_reports}")
    lines += [
        "[tls]",
        f'ca = "{d.ca_cert}"',
        f'cert = "{d.shuffler_cert}"',
        f'key = "{d.shuffler_tls_key}"',
        'client_common_names = ["serverapp"]',
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def process(kit: Any, config: Path, **kw: Any) -> ShufflerProcess:
    return ShufflerProcess(
        config, root_certificate=kit.ca, client_certificate=kit.app_cert, client_key=kit.app_key, **kw
    )


def raw_channel(
    kit: Any, address: str, *, max_bytes: int = 8 << 20, options: list[tuple[str, Any]] | None = None
) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=kit.ca, private_key=kit.app_key, certificate_chain=kit.app_cert
    )
    return grpc.secure_channel(
        address,
        creds,
        options=[("grpc.max_send_message_length", max_bytes), ("grpc.max_receive_message_length", max_bytes)]
        + (options or []),
    )


def header_msg(kit: Any, count: int, *, round_id: int, **over: Any) -> bytes:
    kw: dict[str, Any] = dict(
        protocol_version=ENVELOPE_VERSION, key_epoch=kit.key_epoch, round_id=round_id, model_digest=kit.digest,
        expected_count=count
    )
    kw.update(over)
    return pb.SubmitRequest(header=pb.SubmitHeader(**kw)).SerializeToString()


def envelope_msg(envelope: bytes) -> bytes:
    return pb.SubmitRequest(envelope=envelope).SerializeToString()


# ----------------------------------------------------------------------------------------- protobuf wire
def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos
        if shift > 63:
            raise ValueError("varint too long")


def proto_fields(buf: bytes) -> list[tuple[int, int, bytes | int]]:
    """Schema-free decode of one protobuf message: ``[(field_number, wire_type, value), ...]`` in wire order."""
    out: list[tuple[int, int, bytes | int]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wt = key >> 3, key & 7
        if wt == 0:
            v, pos = _varint(buf, pos)
            out.append((field, wt, v))
        elif wt == 2:
            n, pos = _varint(buf, pos)
            if pos + n > len(buf):
                raise ValueError("truncated length-delimited field")
            out.append((field, wt, buf[pos : pos + n]))
            pos += n
        elif wt == 1:
            out.append((field, wt, buf[pos : pos + 8]))
            pos += 8
        elif wt == 5:
            out.append((field, wt, buf[pos : pos + 4]))
            pos += 4
        else:
            raise ValueError(f"unexpected wire type {wt}")
    return out
