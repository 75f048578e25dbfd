"""Per-party key generation for a deployment: each party makes its own secrets on its own host.

``shuffledp deploy keys --out DIR --nodes N`` (:func:`shuffledp.deploy.keys.create_deploy_keys`) writes every
party's secrets into one directory, which suits one-operator tests only: whoever holds that directory holds
both HPKE private keys and can link every report to its sender. ``--party`` splits the same layout by who keeps
what (deploy/README.md, "Keys and who keeps them"), and only public files and a certificate signing request
travel between parties:

========== ============================================================ ==========================================
party      writes (its own secrets stay in its directory, mode 0600)     hands over (public)
========== ============================================================ ==========================================
server     ``server/hpke.key``; SuperLink CA, certificate, key and       ``public/server_hpke.pub``,
           SuperExec secret under ``superlink/``; the ServerApp's mTLS  ``superlink/ca.crt`` (to devices);
           key ``tls/serverapp.key`` and its request                    ``tls/serverapp.csr`` (to the shuffler)
           ``tls/serverapp.csr``
shuffler   ``shuffler/hpke.key``, ``shuffler/signing.key``, the mTLS CA  ``public/shuffler_hpke.pub`` (devices),
           (``tls/ca.key``), its server certificate, ``shuffler.toml``   ``public/shuffler_signing.pub`` and
                                                                        ``tls/ca.crt`` (server), and the
                                                                        ServerApp's certificate it signs
device i   ``client.key`` (envelope signing), ``supernode.key``          ``client.pub`` (enrolment),
           (SuperNode authentication)                                   ``supernode.pub`` (SuperLink registration)
========== ============================================================ ==========================================

Each directory gets a ``deploy.json`` naming its party, which :func:`check_party_directory` (``shuffledp deploy
check``) uses to verify that the directory holds what its party needs and **no other party's secret**.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shuffledp.deploy.bundle import bundle_key_paths, device_node_config
from shuffledp.deploy.errors import DeployError, DeployUsageError
from shuffledp.deploy.flower import write_toml
from shuffledp.deploy.keys import (
    DEFAULT_KEY_EPOCH,
    DeployKeys,
    staged_directory,
    superlink_names,
    supernode_keypair,
    write_manifest,
    write_new_file,
    write_superlink_tls,
)
from shuffledp.deploy.validation import check_int

__all__ = [
    "PARTIES",
    "create_server_keys",
    "create_shuffler_keys",
    "create_device_keys",
    "complete_device_bundle",
    "sign_serverapp_request",
    "check_party_directory",
    "public_fingerprints",
    "DEVICE_FILES",
]

#: The parties ``deploy keys --party`` knows; ``all`` is the one-directory layout of ``create_deploy_keys``.
PARTIES = ("all", "server", "shuffler", "device")

#: File names in a device's directory (the same names as in a ``deploy bundle``).
DEVICE_FILES = {
    "client_key": "client.key",
    "client_pub": "client.pub",
    "supernode_key": "supernode.key",
    "supernode_pub": "supernode.pub",
}

# Secrets by party, as paths relative to a directory (DeployKeys / shuffledp.shuffler.keys.KeyDirectory layout); a
# party's directory must hold none of another party's.
_SECRETS = {
    "server": ("server/hpke.key", "superlink/ca.key", "superlink/superlink.key", "superlink/superexec.secret",
               "tls/serverapp.key"),
    "shuffler": ("shuffler/hpke.key", "shuffler/signing.key", "tls/ca.key", "tls/shuffler.key"),
    "device": ("client.key", "supernode.key"),
}
# What a party's directory must hold before its service can run (after the hand-overs of the module docstring).
_NEEDS = {
    "server": ("server/hpke.key", "public/server_hpke.pub", "public/shuffler_signing.pub", "superlink/ca.crt",
               "superlink/superlink.crt", "superlink/superlink.key", "tls/ca.crt", "tls/serverapp.crt",
               "tls/serverapp.key"),
    "shuffler": ("shuffler/hpke.key", "shuffler/signing.key", "public/shuffler_hpke.pub",
                 "public/shuffler_signing.pub", "tls/ca.crt", "tls/shuffler.crt", "tls/shuffler.key",
                 "shuffler.toml", "enrolment.json"),
    "device": ("client.key", "supernode.key", "superlink-ca.crt", "server_hpke.pub", "shuffler_hpke.pub",
               "node-config.toml"),
}
# Where each missing file comes from, for check_party_directory's messages.
_SOURCE = {
    "public/shuffler_signing.pub": "copy it from the shuffler operator's public/",
    "tls/ca.crt": "copy the shuffler operator's tls/ca.crt",
    "tls/serverapp.crt": "send tls/serverapp.csr to the shuffler operator (`shuffledp deploy sign-serverapp`)",
    "enrolment.json": "enrol each device's client.pub (`shuffledp keys enrol`)",
    "superlink-ca.crt": "complete the device with `shuffledp deploy bundle --device`",
    "server_hpke.pub": "complete the device with `shuffledp deploy bundle --device`",
    "shuffler_hpke.pub": "complete the device with `shuffledp deploy bundle --device`",
    "node-config.toml": "complete the device with `shuffledp deploy bundle --device`",
}


def create_server_keys(out: str | os.PathLike[str], *, sans: Sequence[str] = ()) -> DeployKeys:
    """The server operator's keys, made on the server's host (``deploy keys --party server``).

    Writes the server's HPKE key pair (the inner layer of every report is sealed to it), the SuperLink's own CA
    and TLS certificate (SANs ``localhost``, ``127.0.0.1`` and ``sans``), the SuperExec shared secret, and the
    ServerApp's mTLS key with a certificate signing request for the shuffler operator to answer
    (:func:`sign_serverapp_request`). The directory is made whole or not at all.

    Returns:
        The paths of the new directory.

    Raises:
        DeployUsageError: a directory that already holds files, or a bad SAN.
    """
    names = superlink_names(sans)
    with staged_directory(out) as root:
        _write_server_keys(root, names)
    return DeployKeys(Path(out))


def _write_server_keys(root: Path, names: list[str]) -> None:
    from shuffledp.shuffler import keys as shuffler_keys
    from shuffledp.shuffler import tls

    paths = DeployKeys(root)
    write_superlink_tls(paths, names)
    for sub, mode in (("server", 0o700), ("public", 0o755), ("tls", 0o700)):
        (root / sub).mkdir()
        os.chmod(root / sub, mode)
    sk, pk = shuffler_keys.generate_keypair("x25519")
    shuffler_keys.save_private_key(root / "server" / "hpke.key", sk, "x25519")
    shuffler_keys.save_public_key(paths.server_public_key, pk, "x25519")
    csr, key = tls.create_csr("serverapp")
    write_new_file(paths.serverapp_key, key, 0o600)
    write_new_file(root / "tls" / "serverapp.csr", csr, 0o644)
    write_manifest(root, "server", **{"superlink-sans": names})


def create_shuffler_keys(out: str | os.PathLike[str], *, k: int, key_epoch: int = DEFAULT_KEY_EPOCH,
                         sans: Sequence[str] = ()) -> DeployKeys:
    """The shuffler operator's keys, made on the shuffler's host (``deploy keys --party shuffler``).

    :func:`shuffledp.shuffler.keys.init_shuffler_keys`: the shuffler's HPKE and signing keys, its mTLS CA and server
    certificate (SANs ``localhost``, ``127.0.0.1`` and ``sans``) and ``shuffler.toml`` with release threshold
    ``k``. The enrolment file is made by ``shuffledp keys enrol`` from the devices' ``client.pub``; the service
    refuses to start until ``k`` clients are enrolled.

    Returns:
        The paths of the new directory.

    Raises:
        DeployUsageError: a bad ``k``, key epoch or SAN, or a directory that already holds files.
    """
    from shuffledp.shuffler import keys as shuffler_keys

    k = check_int("--k", k, 1, 1_000_000)
    key_epoch = check_int("--key-epoch", key_epoch, 0, 2**32 - 1)
    names = superlink_names(sans)
    with staged_directory(out) as root:
        try:
            shuffler_keys.init_shuffler_keys(root, k=k, key_epoch=key_epoch, shuffler_sans=tuple(names))
        except ValueError as exc:
            raise DeployUsageError(f"cannot create the shuffler's keys: {exc}") from exc
        write_manifest(root, "shuffler", **{"shuffler-sans": names, "key-epoch": key_epoch, "k": k})
    return DeployKeys(Path(out))


def create_device_keys(out: str | os.PathLike[str], node: int) -> Path:
    """Device ``node``'s own keys, made on the device (``deploy keys --party device``).

    ``client.key`` signs its envelopes (Ed25519; ``client.pub`` goes to the enrolment authority, which enrols it
    as ``client-<node>``) and ``supernode.key`` authenticates its SuperNode to the SuperLink (ECDSA P-384;
    ``supernode.pub`` is registered with ``flwr supernode register``). ``deploy bundle --device`` later adds the
    public files the device pins and its node config.

    Returns:
        The new directory.

    Raises:
        DeployUsageError: a bad ``node``, or a directory that already holds files.
    """
    from shuffledp.shuffler import keys as shuffler_keys

    node = check_int("--node", node, 0, 2**31 - 1)
    with staged_directory(out) as root:
        shuffler_keys.create_client_key(root, "client")  # client.key (0600) and client.pub
        private, public = supernode_keypair()
        write_new_file(root / DEVICE_FILES["supernode_key"], private, 0o600)
        write_new_file(root / DEVICE_FILES["supernode_pub"], public, 0o644)
        write_manifest(root, "device", node=node, **{"client-id": shuffler_keys.client_id(node)})
    return Path(out)


def complete_device_bundle(device_dir: str | os.PathLike[str], *, nodes: int, superlink_ca: str | os.PathLike[str],
                           server_public_key: str | os.PathLike[str], shuffler_public_key: str | os.PathLike[str],
                           eps0: float, clip_l1: float, prefix: str | None = None,
                           **limits_and_data: Any) -> Path:
    """On the device: add the public files it pins and its ``node-config.toml`` to the directory made by
    :func:`create_device_keys` (``deploy bundle --device``), which then has a bundle's layout.

    ``superlink_ca`` is the server operator's ``superlink/ca.crt`` and ``server_public_key`` its
    ``public/server_hpke.pub``; ``shuffler_public_key`` is the shuffler operator's ``public/shuffler_hpke.pub``.
    Each is checked to be what it claims (a CA certificate, X25519 public keys) before anything is written.
    ``limits_and_data`` are :func:`shuffledp.deploy.bundle.device_node_config`'s. Only the parsed public objects are
    written (never the rest of a file), and all four files are written or none.

    Returns:
        The device's directory, now with a bundle's layout.

    Raises:
        DeployUsageError: a bad setting, or a directory already (partly) completed; DeployError: not a device's
            directory, or a public file that is not what it claims.
    """
    root = Path(device_dir)
    doc = DeployKeys(root).load_manifest()
    if doc.get("party") != "device":
        raise DeployError(f"{root} is not a device's directory (its deploy.json names party "
                          f"{doc.get('party', 'all')!r}; make one with `deploy keys --party device`)")
    node = doc.get("node")
    if isinstance(node, bool) or not isinstance(node, int):
        raise DeployError(f"{root / 'deploy.json'} names no node index; make the directory with `deploy keys "
                          "--party device --node I`")
    config = device_node_config(node, nodes, eps0=eps0, clip_l1=clip_l1,
                                key_paths=bundle_key_paths(root, prefix), **limits_and_data)
    sources = {"superlink-ca.crt": Path(superlink_ca), "server_hpke.pub": Path(server_public_key),
               "shuffler_hpke.pub": Path(shuffler_public_key)}
    targets = [root / name for name in (*sources, "node-config.toml")]
    present = [t.name for t in targets if t.exists() or t.is_symlink()]
    if present:
        state = "is already complete" if len(present) == len(targets) else f"already has {', '.join(present)}"
        raise DeployUsageError(f"this device's directory {root} {state}; a bundle is never overwritten")
    contents = {name: _public_pem(name, src) for name, src in sources.items()}
    if contents["server_hpke.pub"] == contents["shuffler_hpke.pub"]:
        raise DeployError(f"{server_public_key} and {shuffler_public_key} hold the same key: the server's and the "
                          "shuffler's HPKE keys must differ (with one party's key in both places, that party could "
                          "open both layers and link each report to this device)")
    written: list[Path] = []
    try:
        for name, data in contents.items():
            write_new_file(root / name, data, 0o644)
            written.append(root / name)
        write_toml(root / "node-config.toml", config)
    except BaseException:
        for path in written:  # all or nothing: a retry must not find half a bundle
            path.unlink(missing_ok=True)
        raise
    return root


def _public_pem(name: str, src: Path) -> bytes:
    """The public object in ``src`` (an X25519 public key for ``*.pub``, a CA certificate for ``*.crt``) written
    out anew, so that nothing else the file holds reaches the bundle. A file with private key material or more
    than one PEM block is refused: whoever sent it has leaked a secret or sent the wrong file."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import x25519

    try:
        data = src.read_bytes()
    except OSError as exc:
        raise DeployError(f"cannot read {src} (this device's {name}): {exc.strerror}") from exc
    if b"PRIVATE KEY" in data or data.count(b"-----BEGIN ") != 1:
        raise DeployError(f"{src} cannot be this device's {name}: it must hold exactly one PEM block and no private "
                          "key (if it holds one, that key has leaked: the sender must replace it)")
    try:
        if name.endswith(".pub"):
            key = serialization.load_pem_public_key(data)
            if not isinstance(key, x25519.X25519PublicKey):
                raise ValueError(f"it holds a {type(key).__name__}, not an X25519 public key")
            return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        cert = x509.load_pem_x509_certificate(data)
        if not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            raise ValueError("it is not a CA certificate")
        return cert.public_bytes(serialization.Encoding.PEM)
    except (ValueError, TypeError, x509.ExtensionNotFound) as exc:
        raise DeployError(f"{src} cannot be this device's {name}: {exc}") from exc


def sign_serverapp_request(shuffler_dir: str | os.PathLike[str], csr: str | os.PathLike[str],
                           out: str | os.PathLike[str]) -> Path:
    """The shuffler operator issues the ServerApp's mTLS client certificate from the server's request.

    Only the request's public key is used (CN ``serverapp``, client authentication only, whatever the request
    asks), signed with the shuffler's mTLS CA key (``tls/ca.key`` of ``shuffler_dir``). Writes ``out`` (never
    overwriting); hand it back with ``tls/ca.crt``.

    Returns:
        The certificate's path, ``out``.

    Raises:
        DeployError: a bad request, or a directory without the CA key; DeployUsageError: ``out`` exists.
    """
    from shuffledp.shuffler import tls
    from shuffledp.shuffler.keys import KeyDirectory

    d = KeyDirectory(Path(shuffler_dir))
    try:
        ca_cert, ca_key = d.ca_cert.read_bytes(), d.ca_key.read_bytes()
    except OSError as exc:
        raise DeployError(f"cannot read the shuffler's mTLS CA ({exc.filename}: {exc.strerror}): --keys must be the "
                          "shuffler operator's directory (`shuffledp deploy keys --party shuffler`)") from exc
    try:
        request = Path(csr).read_bytes()
    except OSError as exc:
        raise DeployError(f"cannot read the signing request {csr}: {exc}") from exc
    try:
        cert = tls.issue_certificate_for_csr(ca_cert, ca_key, request, "serverapp", is_server=False, is_client=True)
    except ValueError as exc:
        raise DeployError(f"{csr}: {exc}") from exc
    dest = Path(out)
    if dest.exists():
        raise DeployUsageError(f"{dest} already exists; a certificate is never overwritten")
    write_new_file(dest, cert, 0o644)
    return dest


def check_party_directory(root: str | os.PathLike[str]) -> list[str]:
    """What is wrong with a party's key directory (empty list: nothing), from its ``deploy.json``.

    Checks that the directory holds every file its party needs (with where a missing one comes from); that **no
    file holds a secret that is not one of the party's own** (another party's key at its usual path is named as
    such; private key material anywhere else, say appended to a certificate or under another name, is found by
    content: the non-collusion the trust model assumes starts here); private keys of mode 0600 and no directory
    writable by others; that each TLS certificate matches its key and was issued by its CA (the ServerApp's
    with CN ``serverapp`` for client authentication), that the shuffler has at least ``k`` clients enrolled, and
    that a device pins two different HPKE keys. A one-directory layout (``party`` ``all``) is reported as such.
    This is a check of files, not of who has copies elsewhere.

    Returns:
        One line per problem.

    Raises:
        DeployError: no valid ``deploy.json``, or one naming an unknown party.
    """
    base = Path(root)
    doc = DeployKeys(base).load_manifest()
    party = doc.get("party", "all")
    if party not in PARTIES:
        raise DeployError(f"{base / 'deploy.json'} names the unknown party {party!r}; known: {', '.join(PARTIES)}")
    if party == "all":
        return [f"{base} holds every party's secrets (made by `deploy keys` without --party): a one-operator test "
                "set-up, in which the shuffler and the server do not stay apart"]
    problems: list[str] = []
    for rel in _NEEDS[party]:
        if not (base / rel).is_file():
            hint = _SOURCE.get(rel)
            problems.append(f"missing {rel}" + (f": {hint}" if hint else ""))
    problems += _foreign_secrets(base, party)
    for rel in _SECRETS[party]:
        path = base / rel
        if path.is_file() and stat.S_IMODE(path.stat().st_mode) & 0o077:
            problems.append(f"{rel} is readable by others (mode {stat.S_IMODE(path.stat().st_mode):04o}); "
                            "make it 0600")
    for directory in [base, *[p for p in base.rglob("*") if p.is_dir()]]:
        if stat.S_IMODE(directory.stat().st_mode) & 0o022:
            problems.append(f"{directory} is writable by others than its owner; make it 0700 or 0755")
    if party == "server":
        problems += _leaf_problems(base, "tls/serverapp.crt", "tls/serverapp.key", "tls/ca.crt", "serverapp",
                                   client=True)
        problems += _leaf_problems(base, "superlink/superlink.crt", "superlink/superlink.key", "superlink/ca.crt",
                                   "superlink", client=False)
    elif party == "shuffler":
        problems += _leaf_problems(base, "tls/shuffler.crt", "tls/shuffler.key", "tls/ca.crt", "shuffler",
                                   client=False)
        problems += _enrolment_problems(base)
    elif (base / "server_hpke.pub").is_file() and (base / "shuffler_hpke.pub").is_file():
        if (base / "server_hpke.pub").read_bytes() == (base / "shuffler_hpke.pub").read_bytes():
            problems.append("server_hpke.pub and shuffler_hpke.pub are the same key: one party could open both "
                            "layers of this device's reports")
    return problems


#: Files larger than this are not scanned for key material (keys and certificates are a few KiB; the shuffler's
#: journal may hold gigabytes of ciphertexts).
_SCAN_LIMIT_BYTES = 1 << 20
_PRIVATE_MARKERS = (b"PRIVATE KEY-----", b"PRIVATE KEY BLOCK-----")


def _foreign_secrets(base: Path, party: str) -> list[str]:
    """Files that hold a secret that is not one of ``party``'s own: another party's at its usual path, or any
    private key material or ``*.secret`` file elsewhere (found by content)."""
    own = set(_SECRETS[party])
    owner = {rel: other for other, files in _SECRETS.items() if other != party for rel in files}
    problems = []
    for path in sorted(base.rglob("*")):
        rel = str(path.relative_to(base))
        if rel in own or not path.is_file():
            continue
        if rel in owner:
            problems.append(f"{rel} is a secret of the {owner[rel]}, not of the {party}: delete it from {base}")
            continue
        if path.suffix == ".secret":
            problems.append(f"{rel} is a shared secret, not one of the {party}'s: delete it from {base}")
            continue
        if path.stat().st_size > _SCAN_LIMIT_BYTES:
            continue
        if any(marker in path.read_bytes() for marker in _PRIVATE_MARKERS):
            problems.append(f"{rel} holds private key material but is not one of the {party}'s own secrets "
                            f"({', '.join(sorted(own))}): find out whose it is and delete it")
    return problems


def _leaf_problems(base: Path, cert_rel: str, key_rel: str, ca_rel: str, common_name: str, *,
                   client: bool) -> list[str]:
    """A TLS leaf certificate must carry the public key of its key file, be issued by its CA, name
    ``common_name`` and be for client (``client``) or server authentication; otherwise the peer refuses it at
    the handshake. Missing files are reported elsewhere."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    try:
        cert = x509.load_pem_x509_certificate((base / cert_rel).read_bytes())
        ca = x509.load_pem_x509_certificate((base / ca_rel).read_bytes())
        key = serialization.load_pem_private_key((base / key_rel).read_bytes(), password=None)
    except FileNotFoundError:
        return []
    except (ValueError, TypeError) as exc:  # TypeError: an encrypted key (the services read unencrypted keys)
        return [f"cannot read {cert_rel}, {key_rel} or {ca_rel}: {exc}"]
    problems = []
    if key.public_key() != cert.public_key():
        problems.append(f"{cert_rel} is not the certificate of {key_rel}")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        problems.append(f"{cert_rel} was not issued by {ca_rel}")
    names = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if names != [common_name]:
        problems.append(f"{cert_rel} names {names}, not CN {common_name!r}")
    want = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    try:
        usages = list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        usages = []
    if want not in usages:
        problems.append(f"{cert_rel} is not for {'client' if client else 'server'} authentication")
    return problems


def _enrolment_problems(base: Path) -> list[str]:
    """The shuffler refuses to start with fewer enrolled clients than its release threshold ``k``."""
    from shuffledp.shuffler.config import ConfigError, load_config
    from shuffledp.shuffler.keys import load_enrolment

    if not (base / "enrolment.json").is_file():
        return []  # reported as missing
    try:
        k = load_config(base / "shuffler.toml").k
        enrolled = len(load_enrolment(base / "enrolment.json"))
    except (ConfigError, ValueError, OSError) as exc:
        return [f"cannot read shuffler.toml or enrolment.json: {exc}"]
    if enrolled < k:
        return [f"enrolment.json has {enrolled} client(s), fewer than k = {k}: the shuffler refuses to start "
                "(enrol more devices with `shuffledp keys enrol`)"]
    return []


def public_fingerprints(root: str | os.PathLike[str]) -> dict[str, str]:
    """SHA-256 (hex) of every public file of a directory (``*.pub``, ``*.crt``, ``*.csr``), by relative path.

    The hand-overs between parties need authenticity: the receiver compares these over a second channel (a call,
    a signed message) with what the sender's ``deploy check`` printed.

    Returns:
        ``{relative path: hex SHA-256}``, sorted by path.
    """
    import hashlib

    base = Path(root)
    return {str(p.relative_to(base)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(base.rglob("*")) if p.is_file() and p.suffix in (".pub", ".crt", ".csr")}
