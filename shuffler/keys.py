"""Keys, the enrolment file and the key directory written by ``shuffledp keys init``.

Key files are PEM: private keys PKCS#8 (mode 0600), public keys SubjectPublicKeyInfo, so each file says which
algorithm it holds (X25519 for HPKE, Ed25519 for signatures) and OpenSSL can read them. The API works with raw
32-byte keys, as :mod:`shuffledp.shuffler.envelope` does.

Key directory layout (binding, see docs/interfaces.md)::

    DIR/public/shuffler_hpke.pub     shuffler's X25519 public key  (clients pin it)
    DIR/public/shuffler_signing.pub  shuffler's Ed25519 public key (the server verifies attestations with it)
    DIR/public/server_hpke.pub       server's X25519 public key    (clients pin it)
    DIR/shuffler/hpke.key, DIR/shuffler/signing.key                (shuffler operator only; 0600)
    DIR/server/hpke.key                                            (server only; 0600)
    DIR/clients/client-<i>.key       client i's Ed25519 signing key (0600), i = partition id
    DIR/enrolment.json               client id -> Ed25519 public key (shuffler operator controls it)
    DIR/tls/ca.crt, shuffler.crt/.key, serverapp.crt/.key          mTLS between ServerApp and shuffler
    DIR/shuffler.toml                a ready ``shuffledp shuffler serve --config`` file (127.0.0.1, port 0)

The enrolment file is JSON ``{"format": "shuffledp-enrolment/v1", "clients": {"client-0": "<hex>", ...}}``.

``init_key_directory`` (``shuffledp keys init``) writes every client's signing key next to the CA key and the
shuffler's keys: that is for simulations only. In a deployment each device makes its own key pair
(:func:`create_client_key`, ``shuffledp keys client``) and hands over only the public key, and the shuffler
operator adds it to the enrolment (:func:`enrol_client`, ``shuffledp keys enrol``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import nacl.bindings
import nacl.exceptions
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, x25519

from shuffledp.shuffler import tls
from shuffledp.shuffler.journal import write_file_durably
from shuffledp.shuffler.validation import is_int, require_int

__all__ = [
    "KeyKind",
    "generate_keypair",
    "public_from_private",
    "save_private_key",
    "save_public_key",
    "load_private_key",
    "load_public_key",
    "save_enrolment",
    "load_enrolment",
    "client_id",
    "KeyDirectory",
    "init_key_directory",
    "init_shuffler_keys",
    "create_client_key",
    "enrol_client",
    "DEFAULT_MAX_ENVELOPE_BYTES",
]
_CLIENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

KeyKind = Literal["x25519", "ed25519"]
ENROLMENT_FORMAT = "shuffledp-enrolment/v1"
DEFAULT_MAX_ENVELOPE_BYTES = 64 * 1024 * 1024
_KINDS = ("x25519", "ed25519")


def _check_kind(kind: str) -> None:
    if kind not in _KINDS:
        raise ValueError(f"key kind must be one of {_KINDS}, got {kind!r}")


def _check_raw(raw: bytes, what: str) -> bytes:
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != 32:
        raise ValueError(f"{what} must be 32 raw bytes")
    return bytes(raw)


def generate_keypair(kind: KeyKind) -> tuple[bytes, bytes]:
    """A fresh ``(private, public)`` raw key pair from the OS CSPRNG (via OpenSSL)."""
    _check_kind(kind)
    sk = x25519.X25519PrivateKey.generate() if kind == "x25519" else ed25519.Ed25519PrivateKey.generate()
    return sk.private_bytes_raw(), sk.public_key().public_bytes_raw()


def _private_obj(raw: bytes, kind: KeyKind) -> x25519.X25519PrivateKey | ed25519.Ed25519PrivateKey:
    _check_kind(kind)
    raw = _check_raw(raw, f"{kind} private key")
    if kind == "x25519":
        return x25519.X25519PrivateKey.from_private_bytes(raw)
    return ed25519.Ed25519PrivateKey.from_private_bytes(raw)


def public_from_private(raw: bytes, kind: KeyKind) -> bytes:
    """The raw public key of a raw private key."""
    return _private_obj(raw, kind).public_key().public_bytes_raw()


def _atomic_write(path: Path, data: bytes, mode: int, *, overwrite: bool) -> None:
    try:
        write_file_durably(path, data, mode=mode, overwrite=overwrite)
    except FileExistsError as exc:
        if exc.filename != str(path):  # e.g. a parent path that is a regular file
            raise
        raise FileExistsError(f"{path} already exists; refusing to overwrite a key file") from None


def save_private_key(path: str | os.PathLike[str], raw: bytes, kind: KeyKind, *, overwrite: bool = False) -> None:
    """Write a raw private key as unencrypted PKCS#8 PEM with mode 0600."""
    pem = _private_obj(raw, kind).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _atomic_write(Path(path), pem, 0o600, overwrite=overwrite)


def save_public_key(path: str | os.PathLike[str], raw: bytes, kind: KeyKind, *, overwrite: bool = False) -> None:
    """Write a raw public key as SubjectPublicKeyInfo PEM with mode 0644."""
    _check_kind(kind)
    raw = _check_raw(raw, f"{kind} public key")
    obj = (
        x25519.X25519PublicKey.from_public_bytes(raw)
        if kind == "x25519"
        else ed25519.Ed25519PublicKey.from_public_bytes(raw)
    )
    pem = obj.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    _atomic_write(Path(path), pem, 0o644, overwrite=overwrite)


def _kind_of(obj: object) -> str:
    if isinstance(obj, (x25519.X25519PrivateKey, x25519.X25519PublicKey)):
        return "x25519"
    if isinstance(obj, (ed25519.Ed25519PrivateKey, ed25519.Ed25519PublicKey)):
        return "ed25519"
    return type(obj).__name__


def load_private_key(path: str | os.PathLike[str], kind: KeyKind | None = None) -> bytes:
    """Read a PEM private key file and return the raw 32 bytes.

    If ``kind`` is given, a key of another algorithm is refused. A file readable by group or others is refused
    (private keys must be 0600).
    """
    path = Path(path)
    if kind is not None:
        _check_kind(kind)
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise PermissionError(f"{path} has mode {mode:o}; a private key file must be 0600 (chmod 600 {path.name})")
    try:
        obj = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path} is not an unencrypted PEM private key: {exc}") from exc
    found = _kind_of(obj)
    if found not in _KINDS or (kind is not None and found != kind):
        raise ValueError(f"{path} holds a {found} key; expected {kind or 'x25519 or ed25519'}")
    return obj.private_bytes_raw()  # type: ignore[union-attr] - _kind_of checked it is X25519 or Ed25519


def load_public_key(path: str | os.PathLike[str], kind: KeyKind | None = None) -> bytes:
    """Read a PEM public key file and return the raw 32 bytes (checking the algorithm if ``kind`` is given)."""
    path = Path(path)
    if kind is not None:
        _check_kind(kind)
    try:
        obj = serialization.load_pem_public_key(path.read_bytes())
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path} is not a PEM public key: {exc}") from exc
    found = _kind_of(obj)
    if found not in _KINDS or (kind is not None and found != kind):
        raise ValueError(f"{path} holds a {found} key; expected {kind or 'x25519 or ed25519'}")
    return obj.public_bytes_raw()  # type: ignore[union-attr] - _kind_of checked it is X25519 or Ed25519


def client_id(partition_id: int) -> str:
    """The enrolment id of the client with this partition id (``client-<i>``)."""
    if not is_int(partition_id) or partition_id < 0:
        raise ValueError(f"partition_id must be a non-negative int, got {partition_id!r}")
    return f"client-{partition_id}"


def save_enrolment(
    path: str | os.PathLike[str], clients: Mapping[str, bytes], *, overwrite: bool = False
) -> None:
    """Write the enrolment file (client id -> raw Ed25519 public key)."""
    _validate_enrolment(clients, str(path))
    doc = {"format": ENROLMENT_FORMAT, "clients": {cid: bytes(pk).hex() for cid, pk in sorted(clients.items())}}
    _atomic_write(Path(path), (json.dumps(doc, indent=1) + "\n").encode(), 0o644, overwrite=overwrite)


def _validate_enrolment(clients: Mapping[str, bytes], where: str) -> None:
    seen: dict[bytes, str] = {}
    for cid, pk in clients.items():
        if not isinstance(cid, str) or not cid:
            raise ValueError(f"{where}: client ids must be non-empty strings, got {cid!r}")
        if not isinstance(pk, (bytes, bytearray)) or len(pk) != 32:
            raise ValueError(f"{where}: client {cid!r} must map to a 32-byte Ed25519 public key")
        try:
            # libsodium (which checks report signatures, shuffledp.shuffler.envelope) refuses small-order keys, keys
            # outside the prime-order subgroup and non-canonical encodings: such a client could never send a report that
            # verifies. Refusing the key here says so at enrolment instead of dropping every report later. (This
            # decodes the point; cryptography's from_public_bytes checks only the length, done above.)
            nacl.bindings.crypto_sign_ed25519_pk_to_curve25519(bytes(pk))
        except (ValueError, nacl.exceptions.RuntimeError) as exc:
            raise ValueError(
                f"{where}: client {cid!r} has an invalid Ed25519 public key (not a canonical point of prime "
                "order; such a key can never sign a report the shuffler accepts)"
            ) from exc
        if bytes(pk) in seen:
            raise ValueError(f"{where}: clients {seen[bytes(pk)]!r} and {cid!r} share a public key; one key per client")
        seen[bytes(pk)] = cid


def load_enrolment(path: str | os.PathLike[str]) -> dict[str, bytes]:
    """Read the enrolment file; returns client id -> raw Ed25519 public key. Duplicate keys are refused."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != ENROLMENT_FORMAT or not isinstance(doc.get("clients"), dict):
        raise ValueError(f"{path} is not an enrolment file (expected format {ENROLMENT_FORMAT!r} and a 'clients' map)")
    out: dict[str, bytes] = {}
    for cid, hexkey in doc["clients"].items():
        try:
            out[cid] = bytes.fromhex(hexkey)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: client {cid!r} key is not hex") from exc
    _validate_enrolment(out, str(path))
    return out


@dataclass(frozen=True)
class KeyDirectory:
    """Paths of a key directory (see the module docstring)."""

    root: Path

    @property
    def shuffler_hpke_pub(self) -> Path:
        """Path of the shuffler's X25519 (HPKE) public key (PEM): clients seal the outer layer to it."""
        return self.root / "public" / "shuffler_hpke.pub"

    @property
    def shuffler_signing_pub(self) -> Path:
        """Path of the shuffler's Ed25519 public key (PEM): the server checks batch attestations with it."""
        return self.root / "public" / "shuffler_signing.pub"

    @property
    def server_hpke_pub(self) -> Path:
        """Path of the server's X25519 (HPKE) public key (PEM): clients seal the inner layer to it."""
        return self.root / "public" / "server_hpke.pub"

    @property
    def shuffler_hpke_key(self) -> Path:
        """Path of the shuffler's X25519 (HPKE) private key (shuffler operator only, mode 0600)."""
        return self.root / "shuffler" / "hpke.key"

    @property
    def shuffler_signing_key(self) -> Path:
        """Path of the shuffler's Ed25519 signing key for attestations (shuffler operator only, mode 0600)."""
        return self.root / "shuffler" / "signing.key"

    @property
    def server_hpke_key(self) -> Path:
        """Path of the server's X25519 (HPKE) private key, which opens the inner layer (server only, 0600)."""
        return self.root / "server" / "hpke.key"

    def client_key(self, partition_id: int) -> Path:
        """Path of the Ed25519 signing key of the client with this partition id (``clients/client-<i>.key``)."""
        return self.root / "clients" / f"{client_id(partition_id)}.key"

    @property
    def enrolment(self) -> Path:
        """Path of the enrolment file: client id -> Ed25519 public key (see :func:`load_enrolment`)."""
        return self.root / "enrolment.json"

    @property
    def tls_dir(self) -> Path:
        """The folder of the mTLS certificates and keys."""
        return self.root / "tls"

    @property
    def ca_cert(self) -> Path:
        """Path of the certificate of the CA that signs the shuffler's and the ServerApp's TLS certificates."""
        return self.tls_dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        """Path of the CA's private key (needed only to issue certificates)."""
        return self.tls_dir / "ca.key"

    @property
    def shuffler_cert(self) -> Path:
        """Path of the shuffler's TLS server certificate."""
        return self.tls_dir / "shuffler.crt"

    @property
    def shuffler_tls_key(self) -> Path:
        """Path of the shuffler's TLS private key."""
        return self.tls_dir / "shuffler.key"

    @property
    def serverapp_cert(self) -> Path:
        """Path of the ServerApp's TLS client certificate (its mTLS identity towards the shuffler)."""
        return self.tls_dir / "serverapp.crt"

    @property
    def serverapp_tls_key(self) -> Path:
        """Path of the ServerApp's TLS private key."""
        return self.tls_dir / "serverapp.key"

    @property
    def config(self) -> Path:
        """Path of the shuffler's configuration file (``shuffler.toml``, see :mod:`shuffledp.shuffler.config`)."""
        return self.root / "shuffler.toml"


def _toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string literal is a valid TOML basic string for these paths


def _check_shuffler_settings(key_epoch: int, k: int, max_envelope_bytes: int) -> None:
    if not is_int(key_epoch) or not 0 <= key_epoch < 2**32:
        raise ValueError(f"key_epoch must be an int in [0, 2**32), got {key_epoch!r}")
    require_int("k", k, 1)
    require_int("max_envelope_bytes", max_envelope_bytes, 1024)


def _new_directory(out: str | os.PathLike[str], subdirs: tuple[str, ...], private: tuple[str, ...]) -> KeyDirectory:
    """Create ``out`` and its sub-directories (``private`` ones 0700 whatever the umask); refuse one holding keys."""
    d = KeyDirectory(Path(out))
    if d.enrolment.exists() or d.shuffler_hpke_key.exists() or d.server_hpke_key.exists() or d.config.exists():
        raise FileExistsError(f"{d.root} already holds a key directory; refusing to overwrite it")
    if not d.root.exists():
        d.root.mkdir(parents=True)
        os.chmod(d.root, 0o755)  # not group/world-writable whatever the umask: nobody else may swap a file in it
    for sub in subdirs:
        (d.root / sub).mkdir(exist_ok=True)
        os.chmod(d.root / sub, 0o700 if sub in private else 0o755)
    return d


def _write_shuffler_side(d: KeyDirectory, *, key_epoch: int, k: int, max_envelope_bytes: int,
                         shuffler_sans: tuple[str, ...]) -> tuple[bytes, bytes]:
    """The shuffler operator's files: its HPKE and signing keys (and their public halves), the mTLS CA, its server
    certificate and ``shuffler.toml``. Returns the CA ``(cert, key)`` PEMs."""
    sk, pk = generate_keypair("x25519")
    save_private_key(d.shuffler_hpke_key, sk, "x25519")
    save_public_key(d.shuffler_hpke_pub, pk, "x25519")
    sk, pk = generate_keypair("ed25519")
    save_private_key(d.shuffler_signing_key, sk, "ed25519")
    save_public_key(d.shuffler_signing_pub, pk, "ed25519")
    ca_cert, ca_key = tls.create_ca("shuffledp shuffler CA")
    _atomic_write(d.ca_cert, ca_cert, 0o644, overwrite=False)
    # The CA key is kept (0600) so that the operator can issue further certificates; move it offline if wanted.
    _atomic_write(d.ca_key, ca_key, 0o600, overwrite=False)
    cert, key = tls.issue_certificate(
        ca_cert, ca_key, "shuffler", sans=list(shuffler_sans), is_server=True, is_client=False
    )
    _atomic_write(d.shuffler_cert, cert, 0o644, overwrite=False)
    _atomic_write(d.shuffler_tls_key, key, 0o600, overwrite=False)
    config = "\n".join(
        [
            "# shuffledp shuffler service; paths are relative to this file.",
            'address = "127.0.0.1:0"',
            f"key_epoch = {key_epoch}",
            f"k = {k}",
            f"max_envelope_bytes = {max_envelope_bytes}",
            f"hpke_key = {_toml_str('shuffler/hpke.key')}",
            f"signing_key = {_toml_str('shuffler/signing.key')}",
            f"enrolment = {_toml_str('enrolment.json')}",
            f"journal_dir = {_toml_str('journal')}",
            "",
            "[tls]",
            f"ca = {_toml_str('tls/ca.crt')}",
            f"cert = {_toml_str('tls/shuffler.crt')}",
            f"key = {_toml_str('tls/shuffler.key')}",
            'client_common_names = ["serverapp"]',
            "",
        ]
    )
    _atomic_write(d.config, config.encode(), 0o644, overwrite=False)
    return ca_cert, ca_key


def init_key_directory(
    out: str | os.PathLike[str],
    n_clients: int,
    *,
    key_epoch: int = 0,
    k: int | None = None,
    max_envelope_bytes: int = DEFAULT_MAX_ENVELOPE_BYTES,
    shuffler_sans: tuple[str, ...] = ("localhost", "127.0.0.1"),
) -> KeyDirectory:
    """Create every file of the key directory layout under ``out`` (which must not already hold keys).

    ``k`` is the shuffler's release threshold (distinct enrolled signers); the default is
    ``min(n_clients, max(2, n_clients // 2))``. The written ``shuffler.toml`` uses paths relative to itself,
    listens on 127.0.0.1 port 0 and requires mTLS. Every party's secrets end up in one directory: for
    simulations and one-operator tests; :func:`init_shuffler_keys` writes the shuffler operator's part alone.
    """
    require_int("n_clients", n_clients, 1, 1_000_000)
    if k is None:
        k = min(n_clients, max(2, n_clients // 2))
    _check_shuffler_settings(key_epoch, k, max_envelope_bytes)
    if k > n_clients:
        raise ValueError(f"k must be an int in [1, n_clients = {n_clients}], got {k!r}")
    d = _new_directory(out, ("public", "shuffler", "server", "clients", "tls"), ("shuffler", "server", "clients"))
    ca_cert, ca_key = _write_shuffler_side(d, key_epoch=key_epoch, k=k, max_envelope_bytes=max_envelope_bytes,
                                           shuffler_sans=shuffler_sans)
    sk, pk = generate_keypair("x25519")
    save_private_key(d.server_hpke_key, sk, "x25519")
    save_public_key(d.server_hpke_pub, pk, "x25519")
    enrolled: dict[str, bytes] = {}
    for i in range(n_clients):
        sk, pk = generate_keypair("ed25519")
        save_private_key(d.client_key(i), sk, "ed25519")
        enrolled[client_id(i)] = pk
    save_enrolment(d.enrolment, enrolled)
    cert, key = tls.issue_certificate(ca_cert, ca_key, "serverapp", sans=(), is_server=False, is_client=True)
    _atomic_write(d.serverapp_cert, cert, 0o644, overwrite=False)
    _atomic_write(d.serverapp_tls_key, key, 0o600, overwrite=False)
    return d


def init_shuffler_keys(
    out: str | os.PathLike[str],
    *,
    k: int,
    key_epoch: int = 0,
    max_envelope_bytes: int = DEFAULT_MAX_ENVELOPE_BYTES,
    shuffler_sans: tuple[str, ...] = ("localhost", "127.0.0.1"),
) -> KeyDirectory:
    """Create the shuffler operator's own key directory under ``out``, on the shuffler's host.

    The same layout as :func:`init_key_directory`, restricted to what the shuffler operator keeps: its HPKE and
    signing keys, their public halves (``public/``, to publish), the mTLS CA (``tls/ca.crt``, ``tls/ca.key``),
    its server certificate and ``shuffler.toml``. Nothing of the server's or of any client's: the ServerApp's
    client certificate is issued from the server operator's signing request
    (:func:`shuffledp.shuffler.tls.issue_certificate_for_csr`), and ``enrolment.json`` is filled by :func:`enrol_client`
    from the keys the devices (or the enrolment authority) hand over. The service refuses to start until at least
    ``k`` clients are enrolled.
    """
    _check_shuffler_settings(key_epoch, k, max_envelope_bytes)
    d = _new_directory(out, ("public", "shuffler", "tls"), ("shuffler",))
    _write_shuffler_side(d, key_epoch=key_epoch, k=k, max_envelope_bytes=max_envelope_bytes,
                         shuffler_sans=shuffler_sans)
    return d


def _check_client_id(cid: str) -> str:
    if not isinstance(cid, str) or not _CLIENT_ID.fullmatch(cid):
        raise ValueError(f"client id must match {_CLIENT_ID.pattern} (letters, digits, '.', '_', '-'), got {cid!r}")
    return cid


def create_client_key(out: str | os.PathLike[str], cid: str) -> tuple[Path, Path]:
    """A device makes its own Ed25519 signing key pair: ``OUT/<id>.key`` (0600) and ``OUT/<id>.pub``.

    Only the public key leaves the device (to the shuffler operator, for :func:`enrol_client`). Refuses to
    overwrite existing files. Returns ``(private_key_path, public_key_path)``.
    """
    _check_client_id(cid)
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    key_path, pub_path = d / f"{cid}.key", d / f"{cid}.pub"
    if key_path.exists() or pub_path.exists():
        raise FileExistsError(f"{key_path} or {pub_path} already exists; refusing to overwrite a key")
    sk, pk = generate_keypair("ed25519")
    save_private_key(key_path, sk, "ed25519")
    save_public_key(pub_path, pk, "ed25519")
    return key_path, pub_path


def enrol_client(enrolment: str | os.PathLike[str], cid: str, public_key: str | os.PathLike[str]) -> None:
    """Add one client's Ed25519 public key (a PEM file the client supplied) to the enrolment file.

    Creates the file if it does not exist. Refuses a client id that is already enrolled and a key that is
    already enrolled under another id (one key per client).
    """
    _check_client_id(cid)
    path = Path(enrolment)
    clients = load_enrolment(path) if path.exists() else {}
    if cid in clients:
        raise ValueError(f"{path}: client {cid!r} is already enrolled")
    clients[cid] = load_public_key(public_key, "ed25519")
    save_enrolment(path, clients, overwrite=True)  # validates: a key enrolled twice is refused
